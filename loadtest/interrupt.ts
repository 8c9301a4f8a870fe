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
