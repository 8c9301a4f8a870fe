import { describe, expect, it } from 'vitest';
import { fleetGauges } from './fleet-gauges.ts';
import type { HostRec, SandboxRec, SnapshotRec } from './records.ts';
import type { HeartbeatRegistry } from './fleet-view.ts';

const MIB = 1024 * 1024;
const host = (id: string, over: Partial<HostRec> = {}): HostRec => ({ id, state: 'ready', cordoned: false, draining: false, capacity: { vcpus: 8, memoryMib: 4096, diskMib: 10_000 }, ...over }) as HostRec;
const liveness = { suspectAfterMs: 5_000, lostAfterMs: 30_000 };

describe('fleetGauges', () => {
  it('hostsBookingAndUse_comeFromRecordsAllocsAndTheLastHeartbeat_stateAsListHostsShowsIt', () => {
    const now = 100_000;
    const heard = new Map([
      ['a', { heardAt: now - 1_000, hb: { memoryUsedBytes: 300n * BigInt(MIB), chunkStoreBytes: 42n, imageCacheBytes: 7n } }],
      ['b', { heardAt: now - 10_000, hb: { memoryUsedBytes: 0n, chunkStoreBytes: 0n } }],
    ]);
    const g = fleetGauges({
      hosts: [host('a'), host('b', { cordoned: true, draining: true }), host('c', { state: 'lost' }), host('d')],
      allocs: new Map([['a', { hostId: 'a', allocated: { vcpus: 3, memoryMib: 768, diskMib: 3072 }, sandboxes: 3 }]]),
      heard: heard as unknown as Pick<HeartbeatRegistry, 'get'>,
      now,
      liveness,
      sandboxes: undefined,
      snapshots: [],
    });
    expect(g.hosts.get('a')).toEqual({
      state: 'ready',
      cordoned: false,
      draining: false,
      capacity: { vcpus: 8, memoryBytes: 4096 * MIB, diskBytes: 10_000 * MIB },
      allocated: { vcpus: 3, memoryBytes: 768 * MIB, diskBytes: 3072 * MIB },
      sandboxes: 3,
      memoryUsedBytes: 300 * MIB,
      chunkStoreBytes: 42,
      imageCacheBytes: 7,
    });
    // Heard 10 s ago: suspect. Never heard by this replica: its record's state, no measured use.
    expect(g.hosts.get('b')).toMatchObject({ state: 'suspect', cordoned: true, draining: true, sandboxes: 0, allocated: { vcpus: 0, memoryBytes: 0, diskBytes: 0 } });
    expect(g.hosts.get('c')).toMatchObject({ state: 'lost', memoryUsedBytes: undefined });
    expect(g.hosts.get('d')).toMatchObject({ state: 'ready', chunkStoreBytes: undefined });
    // No sandbox index yet: no sandbox counts (not zeros).
    expect(g.sandboxes).toBeUndefined();
  });

  it('sandboxesAndSnapshots_areCountedByState_andOnlyReadySnapshotsAddStoredBytes', () => {
    const sb = (state: SandboxRec['state']): SandboxRec => ({ state, tenantId: 't', resources: { vcpus: 1, memoryMib: 256, diskMib: 1024 } }) as SandboxRec;
    const sn = (state: SnapshotRec['state'], storedBytes: number): SnapshotRec => ({ state, storedBytes, tenantId: 't' }) as SnapshotRec;
    const g = fleetGauges({
      hosts: [],
      allocs: new Map(),
      heard: { get: () => undefined },
      now: 0,
      liveness,
      sandboxes: [sb('running'), sb('running'), sb('hibernated'), sb('destroyed')],
      snapshots: [sn('ready', 100), sn('ready', 50), sn('creating', 7), sn('deleted', 1000)],
    });
    expect(Object.fromEntries(g.sandboxes!)).toEqual({ running: 2, hibernated: 1, destroyed: 1 });
    expect(Object.fromEntries(g.snapshots)).toEqual({ ready: 2, creating: 1, deleted: 1 });
    expect(g.snapshotStoredBytes).toBe(150);
  });

  it('perTenant_bookedCpuAndMemoryCountOnlySandboxesHoldingCapacity_andStorageOnlyReadySnapshots', () => {
    const sb = (tenantId: string, state: SandboxRec['state'], vcpus = 1, memoryMib = 256): SandboxRec => ({ tenantId, state, resources: { vcpus, memoryMib, diskMib: 1024 } }) as SandboxRec;
    const sn = (tenantId: string, state: SnapshotRec['state'], storedBytes: number): SnapshotRec => ({ tenantId, state, storedBytes }) as SnapshotRec;
    const input = {
      hosts: [],
      allocs: new Map(),
      heard: { get: () => undefined },
      now: 0,
      liveness,
      sandboxes: [sb('a', 'running', 2, 512), sb('a', 'paused'), sb('a', 'hibernated', 4, 4096), sb('a', 'destroyed', 8, 8192), sb('b', 'starting'), sb('b', 'failed'), sb('b', 'waking', 2, 1024)],
      snapshots: [sn('a', 'ready', 100), sn('a', 'creating', 5), sn('c', 'ready', 70)],
    };
    const g = fleetGauges(input);
    // A hibernated or destroyed sandbox books nothing: only storage for its snapshot.
    expect(g.tenants!.get('a')).toEqual({ sandboxes: new Map([['running', 1], ['paused', 1], ['hibernated', 1], ['destroyed', 1]]), vcpus: 3, memoryBytes: 768 * MIB, snapshotStoredBytes: 100 });
    // A waking one is booked on its host from its placement on, through its restore.
    expect(g.tenants!.get('b')).toMatchObject({ vcpus: 3, memoryBytes: 1280 * MIB, snapshotStoredBytes: 0 });
    // A tenant with snapshots and no sandboxes still shows its storage.
    expect(g.tenants!.get('c')).toEqual({ sandboxes: new Map(), vcpus: 0, memoryBytes: 0, snapshotStoredBytes: 70 });
    // No sandbox index yet: no tenant figures at all (not zeros).
    expect(fleetGauges({ ...input, sandboxes: undefined }).tenants).toBeUndefined();
  });
});
