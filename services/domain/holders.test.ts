// Recording the hosts that hold a snapshot (Executor.addHolder): the executor over a stub store
// of our own port whose guarded writes all conflict.
import { describe, expect, it } from 'vitest';
import pino from 'pino';
import { Executor } from './executor.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import { snapshotRecord } from '../testkit/records.ts';

/** A port stub: the named methods, and for every other one an async function answering []. */
function stub<T>(methods: Record<string, unknown>): T {
  return new Proxy(methods, { get: (target, key) => (key in target ? target[key as string] : key === 'then' ? undefined : async () => []) }) as T;
}

describe('snapshot holders', () => {
  it('addHolder_whoseEveryWriteConflicts_rejects_ratherThanSayingTheHostWasRecorded', async () => {
    let tries = 0;
    const store = {
      getSnapshot: async () => ({ value: snapshotRecord({ id: 'sn-a', tenantId: 't1', hostIds: ['h1'] }), modRevision: 3 }),
      commitAt: async () => (tries++, 0),
    };
    const ex = new Executor({
      store: stub(store),
      bus: stub({}),
      clock: { now: () => 1_000_000 },
      log: pino({ level: 'silent' }),
      heard: new HeartbeatRegistry(),
      signer: stub({}),
      config: { liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 }, stepTimeoutMs: 1000, stepAttempts: 1, chunkBytes: 1 << 18 },
    });
    (ex as unknown as { active: boolean }).active = true;
    const add = (ex as unknown as { addHolder(t: string, s: string, h: string): Promise<void> }).addHolder('t1', 'sn-a', 'h2');
    await expect(add).rejects.toMatchObject({ kind: 'aborted' });
    expect(tries).toBe(20);
  });
});
