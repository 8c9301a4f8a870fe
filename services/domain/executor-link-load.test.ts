// Placements decided one after another see the copies the earlier ones planned on the links:
// the Executor against stub ports of our own (every store method not named answers at once
// with nothing), placing through its real placement group and the placement library.
import { describe, expect, it } from 'vitest';
import pino from 'pino';
import { create } from '@bufbuild/protobuf';
import { Executor } from './executor.ts';
import type { ExecutorDeps } from './executor.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import { HeartbeatSchema } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type { HostRec, OperationRec, SnapshotRec } from './records.ts';
import type { PlacementRequest, PlacementResult } from '../../scheduler/index.ts';

function stub<T>(methods: Record<string, unknown>): T {
  return new Proxy(methods, { get: (target, key) => (key in target ? target[key as string] : key === 'then' ? undefined : async () => []) }) as T;
}

const now = 1_000_000;
const host = (id: string, diskMib = 100_000): HostRec => ({ id, state: 'ready', cordoned: false, draining: false, capacity: { vcpus: 16, memoryMib: 16_384, diskMib }, accel: 'tcg', qemuVersion: '7.2.0', cpuModel: 'max', machine: 'microvm', peerAddress: '10.0.0.1:7000', linkBytesPerSecond: 1.25e8, labels: {}, registeredAt: 0, lastHeartbeatAt: now, bootId: 'b' });
const snap = { id: 'sn-1', tenantId: 't', state: 'ready', hostIds: ['h1', 'h2'], storedBytes: 256 << 20, logicalBytes: 256 << 20, labels: {}, vmConfig: { machine: 'microvm', memoryMib: 256, vcpus: 1, devices: [], qemuVersion: '7.2.0', accel: 'tcg', cpuModel: 'max', image: 'tiny' } } as unknown as SnapshotRec;

/**
 * An Executor over hosts h1, h2 (holding sn-1) and c1, c2, c3 (`coldDiskMib` of disk each);
 * `commits` answers each commit (a revision, or 0: a conflict). `place` forks one child of
 * sn-1 CROSS_HOST and answers its copy's source; `placedOn`, the host the child went to.
 */
function executor(commits: () => number, coldDiskMib = 100_000): { place: (opId: string) => Promise<string>; placedOn: (opId: string) => Promise<string> } {
  const store = {
    getSnapshot: async () => ({ value: snap, modRevision: 3 }),
    getOp: async (_t: string, id: string) => ({ value: { id, tenantId: 't', kind: 'fork', state: 'running', input: {}, progress: { done: 0, total: 1, message: '', bytesTransferred: 0 }, steps: {} } as unknown as OperationRec, modRevision: 4 }),
    commitAt: async () => commits(),
  };
  const heard = new HeartbeatRegistry();
  for (const h of ['h1', 'h2', 'c1', 'c2', 'c3']) heard.record(create(HeartbeatSchema, { hostId: h, bootId: 'b', restoreSlots: 4, restoreCostMs: 300, snapshots: snap.hostIds.includes(h) ? [{ snapshotId: 'sn-1', complete: true }] : [] }), now);
  const ex = new Executor({
    store: stub<ExecutorDeps['store']>(store),
    bus: stub<ExecutorDeps['bus']>({}),
    clock: { now: () => now },
    log: pino({ level: 'silent' }),
    heard,
    signer: stub({}),
    config: { liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 }, stepTimeoutMs: 100, stepAttempts: 1, chunkBytes: 1 << 18 },
  });
  const inner = ex as unknown as {
    active: boolean;
    cache: { apply(c: unknown): void; load(): Promise<void> };
    placeAndBook(op: OperationRec, snapshot: { tenantId: string; id: string }, request: (view: unknown) => PlacementRequest, records: () => { perChild: { res: { vcpus: number; memoryMib: number; diskMib: number } }; writes: [] }): Promise<{ result: Extract<PlacementResult, { ok: true }> }>;
  };
  inner.active = true;
  for (const h of ['h1', 'h2', 'c1', 'c2', 'c3']) inner.cache.apply({ kind: 'host', value: { value: host(h, h.startsWith('c') ? coldDiskMib : undefined), modRevision: 1 } });
  inner.cache.apply({ kind: 'snapshot', value: { value: snap, modRevision: 3 } });
  inner.cache.load = async () => undefined;
  const placed = async (opId: string): Promise<Extract<PlacementResult, { ok: true }>> => {
    const op = { id: opId, tenantId: 't', kind: 'fork' } as OperationRec;
    const { result } = await inner.placeAndBook(op, { tenantId: 't', id: 'sn-1' }, () => ({ kind: 'fork', id: opId, nowMs: now, snapshotId: 'sn-1', count: 1, overlayDiskMib: 0, preferences: { locality: 'CROSS_HOST' } }), () => ({ perChild: { res: { vcpus: 1, memoryMib: 256, diskMib: 0 } }, writes: [] }));
    return result;
  };
  return {
    place: async (opId) => (await placed(opId)).transferPlan?.transfers[0]?.sourceHostId ?? '',
    placedOn: async (opId) => (await placed(opId)).placements[0]?.hostId ?? '',
  };
}

describe('Executor placements one after another', () => {
  it('copiesACommittedPlacementPlanned_loadTheirSourcesUplink_soTheNextForksCopyComesFromTheOtherHolder', async () => {
    let rev = 10;
    const ex = executor(() => ++rev);
    const first = await ex.place('op-1');
    expect(['h1', 'h2']).toContain(first);
    expect(await ex.place('op-2')).toBe(first === 'h1' ? 'h2' : 'h1');
  });

  it('copiesACommittedPlacementPlanned_takeTheirDestinationsDisk_soACopyNeverGoesWhereAnEarlierOneLeftNoRoom', async () => {
    // Each cold host has room for one copy of sn-1 (256 MiB stored); bookings hold only the
    // children's overlays (none here), and no heartbeat counts a copy until it has landed.
    let rev = 10;
    const ex = executor(() => ++rev, 300);
    const hosts = [await ex.placedOn('op-1'), await ex.placedOn('op-2'), await ex.placedOn('op-3')];
    expect(hosts.sort()).toEqual(['c1', 'c2', 'c3']);
    await expect(ex.placedOn('op-4')).rejects.toMatchObject({ kind: 'resource_exhausted' });
  });

  it('aPlanWhoseCommitConflicted_leavesNoLoad_soItsReplanChoosesAsIfItHadNotBeen', async () => {
    const alone = await executor(() => 11).place('op-1');
    // The first commit conflicts (a record changed meanwhile); the plan made again commits.
    let n = 0;
    expect(await executor(() => (n++ === 0 ? 0 : 11)).place('op-1')).toBe(alone);
    expect(n).toBe(2);
  });
});
