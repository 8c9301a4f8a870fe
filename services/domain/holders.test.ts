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
});
