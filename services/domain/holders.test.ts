// Recording the hosts that hold a snapshot (Executor.addHolder): the executor over a stub store
// of our own port whose guarded writes all conflict.
import { describe, expect, it } from 'vitest';
import { leaderExecutor } from '../testkit/executor.ts';
import { snapshotRecord } from '../testkit/records.ts';

describe('snapshot holders', () => {
  it('addHolder_whoseEveryWriteConflicts_rejects_ratherThanSayingTheHostWasRecorded', async () => {
    let tries = 0;
    const store = {
      getSnapshot: async () => ({ value: snapshotRecord({ id: 'sn-a', tenantId: 't1', hostIds: ['h1'] }), modRevision: 3 }),
      commitAt: async () => (tries++, 0),
    };
    const ex = leaderExecutor(store);
    const add = (ex as unknown as { addHolder(t: string, s: string, h: string): Promise<void> }).addHolder('t1', 'sn-a', 'h2');
    await expect(add).rejects.toMatchObject({ kind: 'aborted' });
    expect(tries).toBe(20);
  });

  it('pruneHolders_dropsAHostThatWasRemoved_atOnce_andKeepsTheHostsThatAreThere', async () => {
    // RemoveHost deletes a lost host's record: never heard again, it stayed a holder for good,
    // so `snapshot ls` listed it and placement counted it as a transfer source.
    let rec = snapshotRecord({ id: 'sn-a', tenantId: 't1', hostIds: ['h1', 'gone'] });
    const ex = leaderExecutor({
      getSnapshot: async () => ({ value: rec, modRevision: 3 }),
      commitAt: async (ws: Array<{ kind: string; value: typeof rec }>) => {
        for (const w of ws) if (w.kind === 'snapshot') rec = w.value;
        return 4;
      },
    });
    ex.cache.hosts.set('h1', { value: { id: 'h1', state: 'lost' } as never, modRevision: 1 });
    ex.cache.snapshots.set('t1/sn-a', { value: rec, modRevision: 3 });
    expect(await ex.pruneHolders()).toBe(1);
    expect(rec.hostIds).toEqual(['h1']);
  });
});
