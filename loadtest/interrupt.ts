// Ctrl-C (or a kill) of a load test: what it made is undone before it exits, as at its normal
// end. A second Ctrl-C ends it at once (the handlers are one-shot).

/**
 * On SIGINT or SIGTERM: logs, runs `undo` (which must be safe to run once more at the run's
 * own end), then exits 130 or 143. Returns a function that removes the handlers.
 */
export function onInterrupt(undo: () => Promise<void>, log: (line: string) => void): () => void {
  const handler = (sig: NodeJS.Signals): void => {
    log(`${sig}: tearing down what this run made (again to stop at once)`);
    void undo().finally(() => process.exit(sig === 'SIGINT' ? 130 : 143));
  };
  process.once('SIGINT', handler);
  process.once('SIGTERM', handler);
  return () => {
    process.off('SIGINT', handler);
    process.off('SIGTERM', handler);
  };
}

/**
 * A run's teardown, run once: on SIGINT or SIGTERM (onInterrupt) or by the run's own end,
 * which calls `undo()` in its `finally` and gets the same promise if a signal came first,
 * then `off()`.
 */
export function undoOnInterrupt(teardown: () => Promise<void>, log: (line: string) => void): { undo: () => Promise<void>; off: () => void } {
  let undone: Promise<void> | undefined;
  const undo = (): Promise<void> => (undone ??= teardown());
  return { undo, off: onInterrupt(undo, log) };
}

/** Thrown by work that a stopping run refused or cut short: the run unwinds; it is not a failed sample. */
export class RunStopped extends Error {
  constructor(what: string) {
    super(`${what}: the run is stopping`);
    this.name = 'RunStopped';
  }
}

/** A run's stop: the signal its work checks, and a teardown that waits for that work to unwind. */
export interface RunStop {
  /**
   * Aborted once the run stops (a signal, or its own end): no create, fork or cordon starts
   * after it, and waits for operations and execs end at once.
   */
  readonly signal: AbortSignal;
  /** Throws RunStopped once the run is stopping. */
  check(what: string): void;
  /** The run's own code has unwound: call it first in the run's `finally`, before `undo()`. */
  loopEnded(): void;
  /**
   * Once (a signal and the run's end share it): stops the run, waits for loopEnded() (so no
   * sample starts a fork or cordons a host behind the teardown's back), then tears down.
   */
  undo(): Promise<void>;
  /** Removes the signal handlers. */
  off(): void;
}

export function stopThenUndo(teardown: () => Promise<void>, log: (line: string) => void): RunStop {
  const ac = new AbortController();
  let ended = false;
  let markEnded!: () => void;
  const loop = new Promise<void>((r) => (markEnded = r));
  let undone: Promise<void> | undefined;
  const undo = (): Promise<void> =>
    (undone ??= (async () => {
      if (!ac.signal.aborted) ac.abort(new RunStopped('run'));
      if (!ended) log('waiting for the sample under way to stop (its operation is cancelled, what it made destroyed)');
      await loop;
      await teardown();
    })());
  return {
    signal: ac.signal,
    check: (what) => {
      if (ac.signal.aborted) throw new RunStopped(what);
    },
    loopEnded: () => {
      ended = true;
      markEnded();
    },
    undo,
    off: onInterrupt(undo, log),
  };
}
