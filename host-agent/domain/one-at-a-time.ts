// Calls that must not overlap per key (a journal directory, a step's journal entry).

/**
 * Runs `fn` once every earlier call with the same `key` in `queues` has settled (whether it
 * failed or not): calls of one key go one after another, calls of different keys run at once.
 * An entry leaves `queues` when its key's last call settles.
 */
export function oneAtATime<T>(queues: Map<string, Promise<unknown>>, key: string, fn: () => Promise<T>): Promise<T> {
  const p = (queues.get(key) ?? Promise.resolve()).then(fn, fn);
  queues.set(key, p);
  const done = (): void => {
    if (queues.get(key) === p) queues.delete(key);
  };
  p.then(done, done);
  return p;
}
