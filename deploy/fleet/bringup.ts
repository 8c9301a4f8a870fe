// A fleet's start never leaves half of itself behind. Its processes run detached (their own
// session: a Ctrl-C reaches fleet.ts, not them), so a start that fails, or is stopped by a
// signal, must take down what it made itself, and only once every step still in flight has
// settled: a step that starts a process after the teardown read state.json leaves a process
// no one knows of, holding the fleet's ports.
//
//   a step fails ──────────────▶ steps beside it are stopped ─┐
//   SIGINT / SIGTERM / SIGHUP ─▶ every step is stopped ───────┼─▶ all settled ─▶ cleanup ─▶ throw
//                                (launch refuses, waits end)  ┘
import { FleetInterruptedError, STOP_SIGNALS, StartStoppedError } from './errors.ts';
import type { StopSignal } from './errors.ts';

/** Where stop signals come from: `process`, or a test's EventEmitter. */
export interface SignalSource {
  on(event: StopSignal, listener: (signal: NodeJS.Signals) => void): unknown;
  off(event: StopSignal, listener: (signal: NodeJS.Signals) => void): unknown;
}

/** Throws StartStoppedError once `abort` is aborted: at the start of a step, and in every wait. */
export function throwIfStopped(abort: AbortSignal | undefined): void {
  if (abort?.aborted) throw new StartStoppedError({ cause: abort.reason });
}

export interface GuardOptions {
  signals: SignalSource;
  /** Called as a signal arrives, before the steps in flight have settled. */
  onSignal?: (signal: StopSignal) => void;
}

/** Why a start is being cleaned up: the signal that stopped it, and the error it failed with (either or both). */
export interface StartEnd {
  signal?: StopSignal;
  error?: unknown;
}

/**
 * Runs `start`, handing it a signal that aborts on SIGINT, SIGTERM or SIGHUP. When `start`
 * fails, or a signal came, `cleanup` runs once `start` has settled; then start's error is
 * thrown, or after a signal a FleetInterruptedError (its cause: the error start failed with,
 * unless that was only the stop itself). The handlers are one-shot and go together: a second
 * signal ends the process at once (state.json still names what is left, for fleet:down).
 */
export async function guardedStart<T>(start: (abort: AbortSignal) => Promise<T>, cleanup: (end: StartEnd) => Promise<void>, o: GuardOptions): Promise<T> {
  const ctl = new AbortController();
  let caught: StopSignal | undefined;
  const off = (): void => {
    for (const s of STOP_SIGNALS) o.signals.off(s, handler);
  };
  const handler = (signal: NodeJS.Signals): void => {
    off();
    caught = signal as StopSignal;
    ctl.abort(caught);
    o.onSignal?.(caught);
  };
  for (const s of STOP_SIGNALS) o.signals.on(s, handler);
  try {
    let failed: { error: unknown } | undefined;
    try {
      const value = await start(ctl.signal);
      if (caught === undefined) return value;
    } catch (e) {
      failed = { error: e };
    }
    // The stop's own refusals say nothing of why: the signal does.
    const error = failed && !(failed.error instanceof StartStoppedError) ? failed : undefined;
    await cleanup({ ...(caught !== undefined ? { signal: caught } : {}), ...(error ? { error: error.error } : {}) });
    if (caught === undefined) throw failed?.error;
    throw new FleetInterruptedError(caught, `stopped by ${caught}`, error ? { cause: error.error } : {});
  } finally {
    off();
  }
}

/**
 * Runs steps side by side. Each is given a signal that aborts when `abort` does or when a step
 * beside it fails, so the others start nothing more and stop waiting. Settles only when every
 * step has (Promise.all would hand the first failure to a cleanup while another step still
 * starts a process); throws the failure that stopped the others, else the first.
 */
export async function allSteps(abort: AbortSignal, steps: ReadonlyArray<(abort: AbortSignal) => Promise<void>>): Promise<void> {
  const ctl = new AbortController();
  const follow = (): void => ctl.abort(abort.reason);
  if (abort.aborted) follow();
  else abort.addEventListener('abort', follow, { once: true });
  let first: { error: unknown } | undefined;
  try {
    const results = await Promise.allSettled(
      steps.map(async (step) => {
        try {
          await step(ctl.signal);
        } catch (e) {
          if (!ctl.signal.aborted) {
            first = { error: e };
            ctl.abort(e);
          }
          throw e;
        }
      }),
    );
    const failed = results.find((r): r is PromiseRejectedResult => r.status === 'rejected');
    if (failed) throw first ? first.error : failed.reason;
  } finally {
    abort.removeEventListener('abort', follow);
  }
}
