// CreateSandbox and ForkSandbox with placement.host_id: a host that takes no new sandboxes is
// refused at admission, naming the field, before any record is written. The Fleet over a stub
// store of our own that holds one host record and records every write.
import { describe, expect, it } from 'vitest';
import { Fleet } from './fleet.ts';
import type { CreateInput, ForkInput, PlacementPrefs } from './fleet.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import { create as createMsg } from '@bufbuild/protobuf';
import { HeartbeatSchema } from './messages.ts';
import type { FleetStore, StoreWrite } from './ports.ts';
import type { HostRec } from './records.ts';

const HOST: HostRec = {
  id: 'h1',
  state: 'ready',
  cordoned: false,
  draining: false,
  capacity: { vcpus: 8, memoryMib: 16_384, diskMib: 100_000 },
  accel: 'kvm',
  qemuVersion: '7.2.0',
  cpuModel: 'host',
  machine: 'q35',
  peerAddress: '10.0.0.1:7001',
  linkBytesPerSecond: 125_000_000,
  labels: {},
  registeredAt: 0,
  lastHeartbeatAt: 0,
  bootId: 'b1',
};

/** Past the host check, a fork of a snapshot looks the snapshot up: the stub answers with this. */
const REACHED_SNAPSHOT = new Error('reached the snapshot lookup');

function fleetWith(host: HostRec | undefined, o: { snapshotHeldBy?: string[]; sandboxOn?: string; heard?: HeartbeatRegistry } = {}): { fleet: Fleet; writes: StoreWrite[] } {
  const writes: StoreWrite[] = [];
  const store = {
    getIdempotent: async () => undefined,
    getHost: async (id: string) => (host && id === host.id ? { value: host, modRevision: 3 } : undefined),
    getSnapshot: async (_t: string, id: string) => {
      if (!o.snapshotHeldBy) throw REACHED_SNAPSHOT;
      return { value: { id, tenantId: 't1', state: 'ready', hostIds: o.snapshotHeldBy, lineageId: 'l', sourceSandboxId: '', labels: {} }, modRevision: 4 };
    },
    getSandbox: async (_t: string, id: string) => (o.sandboxOn ? { value: { id, tenantId: 't1', state: 'running', hostId: o.sandboxOn, lineageId: 'l', afterResume: [], labels: {} }, modRevision: 5 } : undefined),

    commit: async (w: StoreWrite[]) => {
      writes.push(...w);
      return true;
    },
  } as unknown as FleetStore;
  return { fleet: new Fleet({ store, bus: {} as never, clock: { now: () => 1_000 }, heard: o.heard ?? new HeartbeatRegistry(), liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 } }), writes };
}

const placement = { locality: 'ANY' as const, spread: 'PACK' as const, maxPerHost: 0, hostId: 'h1' };
const create: CreateInput = { tenantId: 't1', idempotencyKey: 'k1', image: 'tiny', snapshotId: '', resources: { vcpus: 1, memoryMib: 256, diskMib: 1024 }, labels: {}, ttlMs: null, idleTimeoutMs: null, afterResume: [], allowEgress: false, allowCidrs: [], placement, hostname: '' };
const fork: ForkInput = { tenantId: 't1', idempotencyKey: 'k2', snapshotId: 'sn-a', sandboxId: '', count: 4, placement, labels: {}, ttlMs: null, idleTimeoutMs: null, afterResume: null };

describe('a pinned host at admission', () => {
  for (const [what, host, reason] of [
    ['cordoned', { ...HOST, cordoned: true }, /h1 is cordoned/],
    ['draining', { ...HOST, cordoned: true, draining: true }, /h1 is draining/],
    ['recorded lost', { ...HOST, state: 'lost' as const }, /h1 is lost/],
  ] as const) {
    it(`createAndFork_pinnedToAHostThatIs${what.replace(/ (.)/, (_, c: string) => c.toUpperCase()).replace(/^./, (c) => c.toUpperCase())}_areFailedPreconditionNamingPlacementHostId_andWriteNothing`, async () => {
      const { fleet, writes } = fleetWith(host);
      await expect(fleet.createSandbox(create)).rejects.toMatchObject({ kind: 'failed_precondition', field: 'placement.host_id', message: expect.stringMatching(reason) });
      await expect(fleet.forkSandbox(fork)).rejects.toMatchObject({ kind: 'failed_precondition', field: 'placement.host_id', message: expect.stringMatching(reason) });
      expect(writes).toEqual([]);
    });
  }

  it('fork_pinnedToAnUnknownHost_isInvalidArgumentNamingPlacementHostId', async () => {
    const { fleet } = fleetWith(undefined);
    await expect(fleet.forkSandbox(fork)).rejects.toMatchObject({ kind: 'invalid_argument', field: 'placement.host_id' });
  });

  it('fork_pinnedToAReadyHost_notHeardByThisReplica_goesOnToTheSnapshot', async () => {
    // This replica has heard no host (it may have just started): only the record decides.
    const { fleet } = fleetWith(HOST);
    await expect(fleet.forkSandbox(fork)).rejects.toBe(REACHED_SNAPSHOT);
  });
});

describe('a pinned host with a locality it can never meet, at admission', () => {
  const pinned = (locality: 'SAME_HOST' | 'CROSS_HOST'): PlacementPrefs => ({ ...placement, locality });
  const restore = (locality: 'SAME_HOST' | 'CROSS_HOST'): CreateInput => ({ ...create, snapshotId: 'sn-a', placement: pinned(locality) });

  it('restoreAndFork_sameHostPinnedToAHostThatDoesNotHoldTheSnapshot_areFailedPreconditionNamingPlacementLocality_andWriteNothing', async () => {
    const { fleet, writes } = fleetWith(HOST, { snapshotHeldBy: ['h2'] });
    const refusal = { kind: 'failed_precondition', field: 'placement.locality', message: expect.stringMatching(/h1: that host does not hold snapshot sn-a \(held by h2\)/) };
    await expect(fleet.createSandbox(restore('SAME_HOST'))).rejects.toMatchObject(refusal);
    await expect(fleet.forkSandbox({ ...fork, placement: pinned('SAME_HOST') })).rejects.toMatchObject(refusal);
    expect(writes).toEqual([]);
  });

  it('restoreAndFork_crossHostPinnedToAHolder_areFailedPreconditionNamingPlacementLocality', async () => {
    const { fleet, writes } = fleetWith(HOST, { snapshotHeldBy: ['h1', 'h2'] });
    await expect(fleet.createSandbox(restore('CROSS_HOST'))).rejects.toMatchObject({ kind: 'failed_precondition', field: 'placement.locality' });
    await expect(fleet.forkSandbox({ ...fork, placement: pinned('CROSS_HOST') })).rejects.toMatchObject({ kind: 'failed_precondition', field: 'placement.locality' });
    expect(writes).toEqual([]);
  });

  it('liveFork_sameHostPinnedToAnotherHostThanTheSources_isRefusedBeforeItsSourceIsSnapshotted_crossHostPinnedElsewhereGoesOn', async () => {
    const live: ForkInput = { ...fork, snapshotId: '', sandboxId: 'sb-src', placement: pinned('SAME_HOST') };
    const { fleet, writes } = fleetWith(HOST, { sandboxOn: 'h2' });
    await expect(fleet.forkSandbox(live)).rejects.toMatchObject({ kind: 'failed_precondition', field: 'placement.locality', message: expect.stringMatching(/does not hold sandbox sb-src/) });
    expect(writes).toEqual([]);
    await expect(fleet.forkSandbox({ ...live, placement: pinned('CROSS_HOST') })).resolves.toMatchObject({ kind: 'fork', state: 'pending' });
  });

  it('restore_sameHostPinnedToAHostWhoseHeartbeatSaysItHoldsTheSnapshot_notRecordedYet_isAccepted', async () => {
    // Placement counts such a host a holder (a fetch that just ended): so does admission.
    const heard = new HeartbeatRegistry();
    heard.record(createMsg(HeartbeatSchema, { hostId: 'h1', bootId: 'b', snapshots: [{ snapshotId: 'sn-a', complete: true }] }), 1_000);
    const { fleet } = fleetWith(HOST, { snapshotHeldBy: ['h2'], heard });
    await expect(fleet.createSandbox(restore('SAME_HOST'))).resolves.toMatchObject({ kind: 'create', state: 'pending' });
  });

  it('restore_sameHostPinnedToAHolder_isAccepted', async () => {
    const { fleet } = fleetWith(HOST, { snapshotHeldBy: ['h1'] });
    await expect(fleet.createSandbox(restore('SAME_HOST'))).resolves.toMatchObject({ kind: 'create', state: 'pending' });
  });
});
