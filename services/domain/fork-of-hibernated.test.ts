// ForkSandbox of a hibernated sandbox starts from its hibernation snapshot, the operation's
// target: the caller still finds the operation under the sandbox it named. The Fleet over a
// stub store of our own that keeps what is committed.
import { describe, expect, it } from 'vitest';
import { Fleet } from './fleet.ts';
import type { ForkInput } from './fleet.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import type { FleetStore, StoreWrite } from './ports.ts';
import type { OperationRec } from './records.ts';

function fleetOverAHibernatedSandbox(): Fleet {
  const ops: OperationRec[] = [];
  const store = {
    getIdempotent: async () => undefined,
    getSandbox: async (_t: string, id: string) => ({ value: { id, tenantId: 't1', state: 'hibernated', hostId: '', hibernationSnapshotId: 'sn-hib', lineageId: 'l', afterResume: [], labels: {} }, modRevision: 5 }),
    getSnapshot: async (_t: string, id: string) => ({ value: { id, tenantId: 't1', state: 'ready', hostIds: ['h1'], lineageId: 'l', sourceSandboxId: 'sb-1', labels: {} }, modRevision: 4 }),
    commit: async (w: StoreWrite[]) => {
      for (const x of w) if (x.kind === 'op') ops.push(x.value);
      return true;
    },
    listOps: async () => ops.map((value) => ({ value, modRevision: 6 })),
  } as unknown as FleetStore;
  return new Fleet({ store, bus: {} as never, clock: { now: () => 1_000 }, heard: new HeartbeatRegistry(), liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 } });
}

describe('a fork of a hibernated sandbox', () => {
  it('isTargetedAtItsHibernationSnapshot_andListedUnderTheSandboxItForked_asUnderThatSnapshot', async () => {
    const fleet = fleetOverAHibernatedSandbox();
    const input: ForkInput = { tenantId: 't1', idempotencyKey: 'k1', snapshotId: '', sandboxId: 'sb-1', count: 2, placement: { locality: 'ANY', spread: 'PACK', maxPerHost: 0, hostId: '' }, labels: {}, ttlMs: null, idleTimeoutMs: null, afterResume: null };
    const op = await fleet.forkSandbox(input);
    expect(op).toMatchObject({ kind: 'fork', targetId: 'sn-hib' });
    const by = async (targetId: string): Promise<string[]> => (await fleet.listOperations('t1', { states: [], kinds: [], targetId })).map((o) => o.id);
    expect(await by('sb-1')).toEqual([op.id]);
    expect(await by('sn-hib')).toEqual([op.id]);
    expect(await by('sb-other')).toEqual([]);
  });
});
