// Memory quota of wakes: a hibernated sandbox takes its memory again when it wakes, and wakes
// that arrive together are admitted one after another, as creates and forks are. The Fleet over
// a stub store of our own port whose every read and write answers a moment later.
import { describe, expect, it } from 'vitest';
import { Fleet } from './fleet.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import type { FleetStore, StoreWrite } from './ports.ts';
import type { OperationRec, SandboxRec } from './records.ts';
import { sandboxRecord } from '../testkit/records.ts';

function fleetOfTwoHibernated(): { fleet: Fleet; ops: OperationRec[] } {
  const hib = (id: string): SandboxRec => sandboxRecord({ id, tenantId: 't1', state: 'hibernated', hostId: 'h1', resources: { vcpus: 1, memoryMib: 256, diskMib: 1024 }, hibernationSnapshotId: `sn-${id}` });
  const sandboxes = [hib('sb-1'), hib('sb-2')];
  const ops: OperationRec[] = [];
  const later = <T>(v: T): Promise<T> => new Promise((r) => setTimeout(() => r(v), 2));
  const store = {
    getIdempotent: async () => undefined,
    getSandbox: async (_t: string, id: string) => later({ value: sandboxes.find((s) => s.id === id)!, modRevision: 1 }),
    listSandboxes: async () => later(sandboxes.map((value) => ({ value, modRevision: 1 }))),
    listSnapshots: async () => later([]),
    listOps: async () => later(ops.map((value) => ({ value, modRevision: 1 }))),
    commit: async (writes: StoreWrite[]) => {
      await later(undefined);
      for (const w of writes) if (w.kind === 'op') ops.push(w.value);
      return true;
    },
  } as unknown as FleetStore;
  const fleet = new Fleet({ store, bus: {} as never, clock: { now: () => 1_000 }, heard: new HeartbeatRegistry(), liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 }, quotas: () => ({ memoryMib: 256 }) });
  return { fleet, ops };
}

describe('wake admission', () => {
  it('twoResumesOfHibernatedSandboxesAtOnce_withMemoryForOne_wakeOne_andRefuseTheOtherNamingTheQuota', async () => {
    const { fleet, ops } = fleetOfTwoHibernated();
    const settled = await Promise.allSettled(['sb-1', 'sb-2'].map((id) => fleet.resumeSandbox({ tenantId: 't1', idempotencyKey: `k-${id}`, sandboxId: id })));
    expect(ops.filter((o) => o.kind === 'wake')).toHaveLength(1);
    expect(settled.filter((r) => r.status === 'rejected')).toEqual([expect.objectContaining({ reason: expect.objectContaining({ kind: 'resource_exhausted', field: 'quotas.memory_mib' }) })]);
  });
});
