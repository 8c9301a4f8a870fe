// Named errors of the local fleet (CONVENTIONS.md §5).
import { ForkfleetError, type ForkfleetErrorOptions } from '../../proto/errors.ts';

/** The signals that stop a fleet's start: Ctrl-C, a kill, a dropped session. */
export const STOP_SIGNALS = ['SIGINT', 'SIGTERM', 'SIGHUP'] as const;
export type StopSignal = (typeof STOP_SIGNALS)[number];
const SIGNAL_NUMBER: Record<StopSignal, number> = { SIGHUP: 1, SIGINT: 2, SIGTERM: 15 };

/**
 * A start stopped by a signal, after what it had made was removed. exitCode is what a shell
 * reports for a process the signal ended (128 + its number: 130, 143, 129).
 */
export class FleetInterruptedError extends ForkfleetError {
  readonly signal: StopSignal;
  readonly exitCode: number;
  constructor(signal: StopSignal, message: string, options: ForkfleetErrorOptions = {}) {
    super('cancelled', message, { retryable: true, ...options });
    this.signal = signal;
    this.exitCode = 128 + SIGNAL_NUMBER[signal];
  }
}

/**
 * A step of a start refused to begin, or stopped waiting, because the start is being stopped
 * (a signal, or a step beside it failed): the stop's cause is what to report, not this.
 */
export class StartStoppedError extends ForkfleetError {
  constructor(options: ForkfleetErrorOptions = {}) {
    super('cancelled', 'the fleet\'s start is being stopped', { retryable: true, ...options });
  }
}

/** No fleet recorded in the directory a command was given (status, restart). */
export class NoFleetError extends ForkfleetError {
  constructor(message: string, options: ForkfleetErrorOptions = {}) {
    super('failed_precondition', message, options);
  }
}

/** up over a finished fleet some of whose processes are not running (foundFleet 'partly-down'). */
export class FleetPartlyDownError extends ForkfleetError {
  constructor(message: string, options: ForkfleetErrorOptions = {}) {
    super('failed_precondition', message, options);
  }
}
