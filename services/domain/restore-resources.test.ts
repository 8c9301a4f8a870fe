// What a restore (CreateSandbox from a snapshot) books: its snapshot's VM size, and the disk of
// the sandbox the snapshot was taken of, as a fork child has. The Fleet over a stub store of our
// own: one ready snapshot, its source sandbox's record, and the writes a submit commits.
import { describe, expect, it } from 'vitest';
import { Fleet } from './fleet.ts';
import type { CreateInput } from './fleet.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import type { FleetStore, StoreWrite } from './ports.ts';
import type { SandboxRec, SnapshotRec } from './records.ts';
import { sandboxRecord, snapshotRecord } from '../testkit/records.ts';

const GIB = 1024;
const VM = { machine: 'q35', memoryMib: 512, vcpus: 2, devices: [], qemuVersion: '8.2.0', accel: 'kvm', cpuModel: 'host', image: 'tiny' } as unknown as NonNullable<SnapshotRec['vmConfig']>;

/** A Fleet whose store holds `sn` and (unless null) its source sandbox `source`; `booked()`: the resources of the sandbox a create recorded. */
function fleetOver(sn: SnapshotRec, source: SandboxRec | null): { fleet: Fleet; booked: () => SandboxRec['resources'] | undefined } {
  let writes: StoreWrite[] = [];
  const store = {
    getIdempotent: async () => undefined,
    getSnapshot: async () => ({ value: sn, modRevision: 2 }),
    getSandbox: async (_t: string, id: string) => (source && id === source.id ? { value: source, modRevision: 2 } : undefined),
    commit: async (w: StoreWrite[]) => {
      writes = w;
      return true;
    },
  } as unknown as FleetStore;
  const fleet = new Fleet({ store, bus: {} as never, clock: { now: () => 1_000 }, heard: new HeartbeatRegistry(), liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 } });
  return { fleet, booked: () => writes.flatMap((w) => (w.kind === 'sandbox' ? [w.value.resources] : []))[0] };
}

/** A restore of `sn-a`, as the API hands it on: `diskMib` given, or the default (1 GiB) with `resourcesSet` saying so. */
function restore(diskMib?: number): CreateInput {
  return {
    tenantId: 't1',
    idempotencyKey: 'k1',
    image: '',
    snapshotId: 'sn-a',
    resources: { vcpus: 1, memoryMib: 256, diskMib: diskMib ?? GIB },
    resourcesSet: { vcpus: false, memoryMib: false, ...(diskMib !== undefined ? { diskMib: true } : {}) },
    labels: {},
    ttlMs: null,
    idleTimeoutMs: null,
    afterResume: [],
    allowEgress: false,
    allowCidrs: [],
    placement: { locality: 'ANY', spread: 'PACK', maxPerHost: 0, hostId: '' },
    hostname: '',
  };
}

const inheriting = (diskMib: number): SnapshotRec => snapshotRecord({ vmConfig: VM, inherits: { resources: { vcpus: 2, memoryMib: 512, diskMib }, image: 'tiny', idleTimeoutMs: null, afterResume: [], allowEgress: false, allowCidrs: [] } });

describe('a restore of a snapshot', () => {
  it('withoutDiskMib_booksTheDiskOfTheSandboxTheSnapshotWasTakenOf_notTheDefault', async () => {
    const { fleet, booked } = fleetOver(inheriting(20 * GIB), null);
    await fleet.createSandbox(restore());
    expect(booked()).toEqual({ vcpus: 2, memoryMib: 512, diskMib: 20 * GIB });
  });

  it('ofASnapshotRecordedBeforeInherits_takesTheDiskFromItsSandboxsRecord', async () => {
    const { fleet, booked } = fleetOver(snapshotRecord({ vmConfig: VM }), sandboxRecord({ resources: { vcpus: 2, memoryMib: 512, diskMib: 8 * GIB } }));
    await fleet.createSandbox(restore());
    expect(booked()?.diskMib).toBe(8 * GIB);
    // Neither copy there: the caller's (the default), as before.
    const gone = fleetOver(snapshotRecord({ vmConfig: VM }), null);
    await gone.fleet.createSandbox(restore());
    expect(gone.booked()?.diskMib).toBe(GIB);
  });

  it('withASmallerDiskMib_isInvalidArgumentNamingIt_theDiskCannotShrinkUnderTheSnapshot', async () => {
    const { fleet, booked } = fleetOver(inheriting(20 * GIB), null);
    await expect(fleet.createSandbox(restore(4 * GIB))).rejects.toMatchObject({ kind: 'invalid_argument', field: 'resources.disk_mib', message: expect.stringMatching(/20480 MiB of disk, which cannot shrink/) });
    expect(booked()).toBeUndefined();
  });

  it('withTheSameOrALargerDiskMib_booksWhatWasAskedFor', async () => {
    for (const asked of [20 * GIB, 30 * GIB]) {
      const { fleet, booked } = fleetOver(inheriting(20 * GIB), null);
      await fleet.createSandbox(restore(asked));
      expect(booked()?.diskMib).toBe(asked);
    }
  });
});
