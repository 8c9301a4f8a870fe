// Memory quota of wakes: a hibernated sandbox takes its memory again when it wakes, and wakes
// that arrive together are admitted one after another, as creates and forks are. The Fleet over
// a stub store of our own port whose every read and write answers a moment later.
import { describe, expect, it, vi } from 'vitest';
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

/**
 * One hibernated 256 MiB sandbox under a 256 MiB quota, whose store keeps idempotency keys and
 * operations, and whose leader (the commit) claims the sandbox for the first wake recorded:
 * waking, naming that wake, updatedAt moved on. Every read and write answers a moment later.
 */
function fleetOfOneHibernatedWhoseWakeStarts(): { fleet: Fleet; ops: OperationRec[]; sandbox: () => SandboxRec } {
  let sb = sandboxRecord({ id: 'sb-1', tenantId: 't1', state: 'hibernated', hostId: '', opId: '', updatedAt: 5, resources: { vcpus: 1, memoryMib: 256, diskMib: 1024 }, hibernationSnapshotId: 'sn-1' });
  const ops: OperationRec[] = [];
  const keys = new Map<string, string>();
  const later = <T>(v: T): Promise<T> => new Promise((r) => setTimeout(() => r(v), 2));
  const store = {
    getIdempotent: async (_t: string, key: string) => later(keys.get(key)),
    getOp: async (_t: string, id: string) => later(((o) => (o ? { value: o, modRevision: 1 } : undefined))(ops.find((o) => o.id === id))),
    getSandbox: async () => later({ value: sb, modRevision: 1 }),
    listSandboxes: async () => later([{ value: sb, modRevision: 1 }]),
    listSnapshots: async () => later([]),
    listOps: async () => later(ops.map((value) => ({ value, modRevision: 1 }))),
    commit: async (writes: StoreWrite[]) => {
      await later(undefined);
      if (writes.some((w) => w.kind === 'idem' && keys.has(w.key))) return false;
      for (const w of writes) {
        if (w.kind === 'idem') keys.set(w.key, w.opId);
        if (w.kind !== 'op') continue;
        ops.push(w.value);
        if (w.value.kind === 'wake' && sb.state === 'hibernated') sb = { ...sb, state: 'waking', opId: w.value.id, updatedAt: sb.updatedAt + 1 };
      }
      return true;
    },
  } as unknown as FleetStore;
  const fleet = new Fleet({ store, bus: {} as never, clock: { now: () => 1_000 }, heard: new HeartbeatRegistry(), liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 }, quotas: () => ({ memoryMib: 256 }) });
  // The wake succeeds: the sandbox runs on h1.
  vi.spyOn(fleet, 'waitOperation').mockImplementation(async (_t, id) => {
    sb = { ...sb, state: 'running', hostId: 'h1', opId: '' };
    return { ...ops.find((o) => o.id === id)!, state: 'succeeded' };
  });
  return { fleet, ops, sandbox: () => sb };
}

describe('wake admission', () => {
  it('twoResumesOfHibernatedSandboxesAtOnce_withMemoryForOne_wakeOne_andRefuseTheOtherNamingTheQuota', async () => {
    const { fleet, ops } = fleetOfTwoHibernated();
    const settled = await Promise.allSettled(['sb-1', 'sb-2'].map((id) => fleet.resumeSandbox({ tenantId: 't1', idempotencyKey: `k-${id}`, sandboxId: id })));
    expect(ops.filter((o) => o.kind === 'wake')).toHaveLength(1);
    expect(settled.filter((r) => r.status === 'rejected')).toEqual([expect.objectContaining({ reason: expect.objectContaining({ kind: 'resource_exhausted', field: 'quotas.memory_mib' }) })]);
  });

  it('twoResumesWithOtherKeysOfOneHibernatedSandbox_withMemoryForIt_bothAdmitted_theSecondJoiningTheFirstsWake', async () => {
    // The second resume's turn comes once the first's wake is recorded and started (waking):
    // the sandbox's memory is counted then, and asking for it again on top was refused.
    const { fleet, ops } = fleetOfOneHibernatedWhoseWakeStarts();
    const settled = await Promise.allSettled(['k-1', 'k-2'].map((key) => fleet.resumeSandbox({ tenantId: 't1', idempotencyKey: key, sandboxId: 'sb-1' })));
    expect(settled.map((r) => r.status)).toEqual(['fulfilled', 'fulfilled']);
    expect(ops.map((o) => [o.kind, o.targetId])).toEqual([
      ['wake', 'sb-1'],
      ['wake', 'sb-1'],
    ]);
  });

  it('callsOnOneHibernatedSandboxAtOnce_withMemoryForIt_shareOneWake_noneRefusedByTheQuota', async () => {
    // Exec, ReadFile and WriteFile wake the sandbox they name (runningSandbox): three at once.
    const { fleet, ops } = fleetOfOneHibernatedWhoseWakeStarts();
    const running = (fleet as unknown as { runningSandbox(tenantId: string, id: string): Promise<SandboxRec> }).runningSandbox.bind(fleet);
    const settled = await Promise.allSettled([1, 2, 3].map(() => running('t1', 'sb-1')));
    expect(settled).toEqual([1, 2, 3].map(() => ({ status: 'fulfilled', value: expect.objectContaining({ state: 'running', hostId: 'h1' }) })));
    expect(ops.filter((o) => o.kind === 'wake')).toHaveLength(1);
  });
});
