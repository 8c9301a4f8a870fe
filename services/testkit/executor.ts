// Executors over stubs of our own ports, for unit tests of the leader's rules.
import pino from 'pino';
import { Executor } from '../domain/executor.ts';
import type { ExecutorDeps } from '../domain/executor.ts';
import { HeartbeatRegistry } from '../domain/fleet-view.ts';

/** A port stub: the named methods, and for every other one an async function answering []. */
export function stubPort<T>(methods: Record<string, unknown>): T {
  return new Proxy(methods, { get: (target, key) => (key in target ? target[key as string] : key === 'then' ? undefined : async () => []) }) as T;
}

/**
 * An executor as a leader's (start() not run, but active: it writes), over `store` (stubbed:
 * other methods answer []), a stub bus and signer, a clock at 1,000,000 ms, and `deps` on top.
 */
export function leaderExecutor(store: Record<string, unknown>, deps: Partial<ExecutorDeps> = {}): Executor {
  const ex = new Executor({
    store: stubPort(store),
    bus: stubPort({}),
    clock: { now: () => 1_000_000 },
    log: pino({ level: 'silent' }),
    heard: new HeartbeatRegistry(),
    signer: stubPort({}),
    config: { liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 }, stepTimeoutMs: 1000, stepAttempts: 1, chunkBytes: 1 << 18 },
    ...deps,
  });
  (ex as unknown as { active: boolean }).active = true;
  return ex;
}
