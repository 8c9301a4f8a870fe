// A snapshot deleted (by retention or a user) while a fork or a restore of it is accepted: the
// accepted request is never undercut. Fleet (admission) and Executor (the delete's run) over
// stub stores of our own port.
import { describe, expect, it } from 'vitest';
import { Fleet } from './fleet.ts';
import type { CreateInput, ForkInput } from './fleet.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import type { FleetStore, StoreWrite } from './ports.ts';
import type { OperationRec, SnapshotRec } from './records.ts';
import { snapshotRecord } from '../testkit/records.ts';
import { leaderExecutor, stubPort } from '../testkit/executor.ts';

const placement = { locality: 'ANY' as const, spread: 'PACK' as const, maxPerHost: 0, hostId: '' };
const fork: ForkInput = { tenantId: 't1', idempotencyKey: 'k1', snapshotId: 'sn-a', sandboxId: '', count: 2, placement, labels: {}, ttlMs: null, idleTimeoutMs: null, afterResume: [] };
const restore: CreateInput = { tenantId: 't1', idempotencyKey: 'k2', image: '', snapshotId: 'sn-a', resources: { vcpus: 1, memoryMib: 256, diskMib: 1024 }, labels: {}, ttlMs: null, idleTimeoutMs: null, afterResume: [], allowEgress: false, allowCidrs: [], placement, hostname: '' };

/**
 * The Fleet over a store whose snapshot sn-a is read ready at revision 7 and changed by
 * `change` (revision 8) right after that first read, before the request commits; a guarded
 * commit fails as etcd's would.
 */
function admissionRacing(change: (sn: SnapshotRec) => SnapshotRec): { fleet: Fleet; committed: StoreWrite[][] } {
  let sn: { value: SnapshotRec; modRevision: number } = { value: snapshotRecord({ id: 'sn-a', tenantId: 't1', state: 'ready' }), modRevision: 7 };
  let reads = 0;
  const committed: StoreWrite[][] = [];
  const store = {
    getIdempotent: async () => undefined,
    getSandbox: async () => undefined,
    getSnapshot: async () => {
      const read = sn;
      if (++reads === 1) sn = { value: change(sn.value), modRevision: 8 };
      return read;
    },
    commit: async (w: StoreWrite[]) => {
      if (w.some((x) => x.kind === 'check-snapshot' && x.expectRevision !== sn.modRevision)) return false;
      committed.push(w);
      return true;
    },
  } as unknown as FleetStore;
  return { fleet: new Fleet({ store, bus: {} as never, clock: { now: () => 1_000 }, heard: new HeartbeatRegistry(), liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 } }), committed };
}

describe('a snapshot deleted while a fork or restore of it is accepted', () => {
  it('forkAndRestore_readyWhenRead_butMarkedDeletingBeforeTheyCommit_areFailedPreconditionNamingSnapshotId_andCommitNothing', async () => {
    for (const call of [(f: Fleet) => f.forkSandbox(fork), (f: Fleet) => f.createSandbox(restore)]) {
      const { fleet, committed } = admissionRacing((sn) => ({ ...sn, state: 'deleting' }));
      await expect(call(fleet)).rejects.toMatchObject({ kind: 'failed_precondition', field: 'snapshot_id', message: expect.stringContaining('sn-a is deleting') });
      expect(committed).toEqual([]);
    }
  });

  it('forkAndRestore_ofASnapshotWhoseRecordChangedButIsStillReady_areSubmittedUnderItsNewRevision', async () => {
    for (const call of [(f: Fleet) => f.forkSandbox(fork), (f: Fleet) => f.createSandbox(restore)]) {
      const { fleet, committed } = admissionRacing((sn) => ({ ...sn, hostIds: ['h1', 'h2'] }));
      await expect(call(fleet)).resolves.toMatchObject({ state: 'pending' });
      expect(committed).toHaveLength(1);
      expect(committed[0]).toContainEqual({ kind: 'check-snapshot', tenantId: 't1', id: 'sn-a', expectRevision: 8 });
    }
  });

  it('deleteThatMarkedTheSnapshot_findsAForkAcceptedBeforeItsMark_withNoChildRecordsYet_putsItBack_andDeletesNothing', async () => {
    let sn = { value: snapshotRecord({ id: 'sn-a', tenantId: 't1', state: 'ready', hostIds: ['h1'] }), modRevision: 7 };
    const forkOp = { id: 'op-f', tenantId: 't1', kind: 'fork', state: 'pending', input: { snapshotId: 'sn-a', count: 2 }, result: null } as unknown as OperationRec;
    const sent: unknown[] = [];
    const store = {
      getSnapshot: async () => structuredClone(sn),
      listSandboxes: async () => [],
      listOps: async () => [{ value: forkOp, modRevision: 6 }],
      commitAt: async (w: StoreWrite[]) => {
        for (const x of w) if (x.kind === 'snapshot') sn = { value: structuredClone(x.value), modRevision: sn.modRevision + 1 };
        return sn.modRevision;
      },
    };
    const ex = leaderExecutor(store, { bus: stubPort({ send: async (...a: unknown[]) => void sent.push(a) }) });
    const del = { id: 'op-d', tenantId: 't1', kind: 'delete_snapshot', state: 'running', targetId: 'sn-a', input: {} } as unknown as OperationRec;
    const run = (ex as unknown as { runDeleteSnapshot(op: OperationRec): Promise<void> }).runDeleteSnapshot(del);
    await expect(run).rejects.toMatchObject({ kind: 'failed_precondition', message: expect.stringContaining('op-f') });
    expect(sn.value.state).toBe('ready');
    expect(sn.value.deletingFrom).toBeUndefined();
    expect(sent).toEqual([]);
  });
});
