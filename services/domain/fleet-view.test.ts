import { describe, expect, it, vi } from 'vitest';
import { create, toBinary } from '@bufbuild/protobuf';
import { HeartbeatSchema, VmState } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { decodeHeartbeat } from '../adapters/nats/bus.ts';
import { FETCH_RATE_WINDOW_MS, FetchRates, fleetViewInput, HeartbeatRegistry, LinkLoads, livenessOf } from './fleet-view.ts';
import type { HostRec, SnapshotRec } from './records.ts';
import { buildFleetView, place, xoshiro128ss } from '../../scheduler/index.ts';
import { snapshotRecord } from '../testkit/records.ts';

const host = (id: string): HostRec => ({
  id, state: 'ready', cordoned: false, draining: false, capacity: { vcpus: 8, memoryMib: 8192, diskMib: 100_000 }, accel: 'tcg', qemuVersion: '7.2.0',
  cpuModel: 'max', machine: 'microvm', peerAddress: '', linkBytesPerSecond: 1.25e9, labels: {}, registeredAt: 0, lastHeartbeatAt: 0, bootId: 'b',
});

function input(ownInflight?: Map<string, number>) {
  const heard = new HeartbeatRegistry();
  heard.record(create(HeartbeatSchema, { hostId: 'measured', bootId: 'b', inflightOps: 2, restoreSlots: 4, restoreCostMs: 320 }), 1_000);
  heard.record(create(HeartbeatSchema, { hostId: 'new', bootId: 'b', inflightOps: 0, restoreSlots: 4, restoreCostMs: 0 }), 1_000);
  return fleetViewInput({
    hosts: [host('measured'), host('new')], allocs: new Map(), heard, snapshots: [], revision: 1, now: 1_000,
    liveness: { suspectAfterMs: 5_000, lostAfterMs: 15_000 }, chunkBytes: 262_144, ...(ownInflight ? { ownInflight } : {}),
  }).hosts;
}

describe('fleetViewInput', () => {
  it('hosts_thatReportRestoreCostAndSlots_carryThem_andOneThatMeasuredNoneYetIsPricedAtTheFleetsMedian', () => {
    const [measured, fresh] = input();
    expect(measured).toMatchObject({ restoreCostMs: 320, restoreSlots: 4, inflightOps: 2 });
    // No restore measured here yet: priced like the fleet's measured hosts, not at the
    // configured default (which undercut every measured host on TCG: wakes went cold).
    expect(fresh).toMatchObject({ restoreCostMs: 320, restoreSlots: 4 });
  });

  it('hosts_inAFleetThatMeasuredNoRestoreYet_fallBackToTheConfiguredDefaults', () => {
    const heard = new HeartbeatRegistry();
    heard.record(create(HeartbeatSchema, { hostId: 'a', bootId: 'b', restoreSlots: 4, restoreCostMs: 0 }), 1_000);
    const [a] = fleetViewInput({ hosts: [host('a')], allocs: new Map(), heard, snapshots: [], revision: 1, now: 1_000, liveness: { suspectAfterMs: 5_000, lostAfterMs: 15_000 }, chunkBytes: 262_144 }).hosts;
    expect(a?.restoreCostMs).toBeUndefined();
    expect(a?.restoreSlots).toBeUndefined();
  });

  it('bandwidth_isWhatHostsGotFetching_notTheLinksRate_andAHostThatFetchedNothingYetGetsTheFleetsMedian', () => {
    const heard = new HeartbeatRegistry();
    const view = (fetchRates?: Map<string, number>) =>
      fleetViewInput({ hosts: [host('a'), host('b'), host('c')], allocs: new Map(), heard, snapshots: [], revision: 1, now: 1_000, liveness: { suspectAfterMs: 5_000, lostAfterMs: 15_000 }, chunkBytes: 262_144, ...(fetchRates ? { fetchRates } : {}) }).hosts.map((h) => h.link.bandwidthBytesPerS);
    // Nothing fetched yet anywhere: the links' rate (1.25e9).
    expect(view()).toEqual([1.25e9, 1.25e9, 1.25e9]);
    // A fetch over a 10 Gbit/s link moved ~100 MB/s: priced at that, and c (no fetch yet) at the median.
    expect(view(new Map([['a', 1e8], ['b', 3e8]]))).toEqual([1e8, 3e8, 1e8]);
    // Never above the link's rate.
    expect(view(new Map([['a', 5e9]]))).toEqual([1.25e9, 1.25e9, 1.25e9]);
  });

  it('fetchRates_areTheMedianOfAHostsRecentFetches_andFetchesOlderThanTheWindowNoLongerPriceIt', () => {
    const rates = new FetchRates();
    rates.note('a', 2e7, 0); // one slow fetch
    rates.note('b', 1e8, 0);
    expect(rates.current(1_000)).toEqual(new Map([['a', 2e7], ['b', 1e8]]));
    // a stays priced at its slow fetch while placement avoids it, but only for the window.
    rates.note('b', 3e8, FETCH_RATE_WINDOW_MS);
    rates.note('b', 2e8, FETCH_RATE_WINDOW_MS);
    expect(rates.current(FETCH_RATE_WINDOW_MS)).toEqual(new Map([['a', 2e7], ['b', 2e8]]));
    expect(rates.current(FETCH_RATE_WINDOW_MS + 1)).toEqual(new Map([['b', 2e8]])); // the lower median of 3e8 and 2e8
    // A host gone from the fleet drops out too, and with nothing left the links' rate prices fetches again.
    expect(rates.current(2 * FETCH_RATE_WINDOW_MS + 1)).toEqual(new Map());
    rates.note('c', Number.NaN, 0);
    rates.note('c', 0, 0);
    expect(rates.current(0)).toEqual(new Map());
  });

  it('linkLoads_ofPlannedTransfers_takeTheirRateOfBothLinksUntilTheirPlannedEnd_andATakenBackPlanNone', () => {
    const loads = new LinkLoads();
    // 100 MB in 1 s from h1 to a, decided at t = 1000; and one to b, not committed.
    loads.add([{ sourceHostId: 'h1', destinationHostId: 'a', bytes: 1e8, startMs: 0, readyAtMs: 1000 }], 1000);
    const lost = loads.add([{ sourceHostId: 'h1', destinationHostId: 'b', bytes: 5e7, startMs: 500, readyAtMs: 1000 }], 1000);
    expect(loads.current(1500)).toEqual(new Map([['h1', { rx: 0, tx: 2e8 }], ['a', { rx: 1e8, tx: 0 }], ['b', { rx: 1e8, tx: 0 }]]));
    loads.remove(lost);
    expect(loads.current(1500)).toEqual(new Map([['h1', { rx: 0, tx: 1e8 }], ['a', { rx: 1e8, tx: 0 }]]));
    expect(loads.current(2000)).toEqual(new Map());
  });

  it('aHoldersUplinkTakenByAnEarlierPlansCopies_isSeenAsLoad_soTheNextCopyComesFromTheOtherHolder', () => {
    const heard = new HeartbeatRegistry();
    for (const id of ['h1', 'h2', 'c']) heard.record(create(HeartbeatSchema, { hostId: id, bootId: 'b', restoreSlots: 4, restoreCostMs: 300 }), 1_000);
    const sn = snapshotRecord({ id: 'sn-a', hostIds: ['h1', 'h2'], storedBytes: 256 << 20, vmConfig: { machine: 'microvm', memoryMib: 256, vcpus: 1, devices: [], qemuVersion: '7.2.0', accel: 'tcg', cpuModel: 'max', image: 'tiny' } });
    const sourceOfCopy = (linkLoads?: Map<string, { rx: number; tx: number }>): string | undefined => {
      const v = fleetViewInput({ hosts: [host('h1'), host('h2'), host('c')], allocs: new Map(), heard, snapshots: [sn], revision: 1, now: 1_000, liveness: { suspectAfterMs: 5_000, lostAfterMs: 15_000 }, chunkBytes: 262_144, ...(linkLoads ? { linkLoads } : {}) });
      // The 90% cap: a link never looks wholly taken.
      for (const h of v.hosts) expect(h.link.txLoadBytesPerS).toBeLessThanOrEqual(0.9 * h.link.bandwidthBytesPerS);
      const r = place(buildFleetView(v), { kind: 'fork', id: 'op-x', nowMs: 1_000, snapshotId: 'sn-a', count: 1, overlayDiskMib: 0, preferences: { locality: 'CROSS_HOST' } }, xoshiro128ss(1, 2, 3, 4));
      return r.ok ? r.transferPlan?.transfers[0]?.sourceHostId : undefined;
    };
    const idle = sourceOfCopy();
    const other = idle === 'h1' ? 'h2' : 'h1';
    expect(idle).toBeDefined();
    expect(sourceOfCopy(new Map([[idle!, { rx: 0, tx: 2e9 }]]))).toBe(other);
  });

  it('hostRecordedLost_staysLostInTheView_evenWithFreshHeartbeats_untilItsRecordIsReady', () => {
    const heard = new HeartbeatRegistry();
    heard.record(create(HeartbeatSchema, { hostId: 'back', bootId: 'b2' }), 1_000);
    const view = (state: HostRec['state']) => fleetViewInput({ hosts: [{ ...host('back'), state }], allocs: new Map(), heard, snapshots: [], revision: 1, now: 1_000, liveness: { suspectAfterMs: 5_000, lostAfterMs: 15_000 }, chunkBytes: 262_144 }).hosts[0]?.state;
    expect(view('lost')).toBe('lost');
    expect(view('ready')).toBe('ready');
  });

  it('hostWhoseAgentSaysItIsStopping_isSuspectInTheView_soNothingIsPlacedThere_thoughHeardJustNow', () => {
    const heard = new HeartbeatRegistry();
    heard.record(create(HeartbeatSchema, { hostId: 'stopping', bootId: 'b', stopping: true }), 1_000);
    heard.record(create(HeartbeatSchema, { hostId: 'up', bootId: 'b' }), 1_000);
    const v = fleetViewInput({ hosts: [host('stopping'), host('up')], allocs: new Map(), heard, snapshots: [], revision: 1, now: 1_000, liveness: { suspectAfterMs: 5_000, lostAfterMs: 15_000 }, chunkBytes: 262_144 });
    expect(v.hosts.map((h) => [h.id, h.state])).toEqual([['stopping', 'suspect'], ['up', 'ready']]);
    // Silent past the threshold it is lost all the same.
    const later = fleetViewInput({ hosts: [host('stopping')], allocs: new Map(), heard, snapshots: [], revision: 1, now: 20_000, liveness: { suspectAfterMs: 5_000, lostAfterMs: 15_000 }, chunkBytes: 262_144 });
    expect(later.hosts[0]?.state).toBe('lost');
  });

  it('inflightOps_isTheLargerOfTheHeartbeatsAndTheLeadersOwnStepsInFlight', () => {
    const [measured, fresh] = input(new Map([['measured', 1], ['new', 3]]));
    expect(measured?.inflightOps).toBe(2); // the heartbeat already counts the leader's step
    expect(fresh?.inflightOps).toBe(3); // sent since the host's last heartbeat
  });

  it('diskTakenByAHostsChunkStore_countsAsAllocated_soASnapshotItMustFetchGoesWhereItFits', () => {
    const heard = new HeartbeatRegistry();
    const GIB = 1n << 30n;
    // Both have 10 GiB to book and nothing booked; 'filled' holds 9 GiB of chunks fetched before.
    heard.record(create(HeartbeatSchema, { hostId: 'filled', bootId: 'b', restoreSlots: 4, restoreCostMs: 300, chunkStoreBytes: 9n * GIB + 1n }), 1_000);
    heard.record(create(HeartbeatSchema, { hostId: 'room', bootId: 'b', restoreSlots: 4, restoreCostMs: 300 }), 1_000);
    heard.record(create(HeartbeatSchema, { hostId: 'holder', bootId: 'b', restoreSlots: 4, restoreCostMs: 300 }), 1_000);
    const disk = (id: string): HostRec => ({ ...host(id), capacity: { vcpus: 8, memoryMib: 8192, diskMib: 10_240 }, cordoned: id === 'holder' });
    const sn = snapshotRecord({ id: 'sn-a', hostIds: ['holder'], storedBytes: 2 * 1024 ** 3, vmConfig: { machine: 'microvm', memoryMib: 256, vcpus: 1, devices: [], qemuVersion: '7.2.0', accel: 'tcg', cpuModel: 'max', image: 'tiny' } });
    const v = fleetViewInput({ hosts: ['filled', 'room', 'holder'].map(disk), allocs: new Map([['filled', { hostId: 'filled', allocated: { vcpus: 1, memoryMib: 256, diskMib: 100 }, sandboxes: 1 }]]), heard, snapshots: [sn], revision: 1, now: 1_000, liveness: { suspectAfterMs: 5_000, lostAfterMs: 15_000 }, chunkBytes: 262_144 });
    expect(v.hosts.find((h) => h.id === 'filled')?.allocated).toEqual({ vcpus: 1, memoryMib: 256, diskMib: 100 + 9 * 1024 + 1 });
    expect(v.hosts.find((h) => h.id === 'room')?.allocated.diskMib).toBe(0);
    for (let i = 0; i < 8; i++) {
      const r = place(buildFleetView(v), { kind: 'restore', id: `op-wake-${i}`, nowMs: 1_000, snapshotId: 'sn-a', overlayDiskMib: 100 }, xoshiro128ss(i, 2, 3, 4));
      expect(r.ok && r.placements.map((p) => p.hostId)).toEqual(['room']);
    }
  });

  it('diskTakenByAHostsMaterialisedImages_countsAsAllocatedBesideItsChunks', () => {
    const heard = new HeartbeatRegistry();
    const GIB = 1n << 30n;
    heard.record(create(HeartbeatSchema, { hostId: 'h', bootId: 'b', chunkStoreBytes: GIB, imageCacheBytes: 2n * GIB }), 1_000);
    const v = fleetViewInput({ hosts: [host('h')], allocs: new Map(), heard, snapshots: [], revision: 1, now: 1_000, liveness: { suspectAfterMs: 5_000, lostAfterMs: 15_000 }, chunkBytes: 262_144 });
    expect(v.hosts[0]?.allocated.diskMib).toBe(3 * 1024);
  });

  it('decision_isTheSameWhateverOrderTheCacheListsItsHosts_soReplicasAndAReplayAfterARestartAgree', () => {
    const heard = new HeartbeatRegistry();
    const ids = ['h1', 'h2', 'h3', 'h4', 'h5', 'h6'];
    for (const id of ids) heard.record(create(HeartbeatSchema, { hostId: id, bootId: 'b', restoreSlots: 4, restoreCostMs: 300 }), 1_000);
    // Identical holders: the choice among them is the seed's tie-break alone.
    const sn = snapshotRecord({ id: 'sn-a', hostIds: ids, storedBytes: 256 << 20, vmConfig: { machine: 'microvm', memoryMib: 256, vcpus: 1, devices: [], qemuVersion: '7.2.0', accel: 'tcg', cpuModel: 'max', image: 'tiny' } });
    const chosen = (order: string[]): string[] => {
      const v = fleetViewInput({ hosts: order.map(host), allocs: new Map(), heard, snapshots: [sn], revision: 1, now: 1_000, liveness: { suspectAfterMs: 5_000, lostAfterMs: 15_000 }, chunkBytes: 262_144 });
      const r = place(buildFleetView(v), { kind: 'fork', id: 'op-same', nowMs: 1_000, snapshotId: 'sn-a', count: 2, overlayDiskMib: 0, preferences: { locality: 'SAME_HOST', spread: 'SPREAD' } }, xoshiro128ss(1, 2, 3, 4));
      return r.ok ? r.placements.map((p) => p.hostId) : [];
    };
    const registered = chosen(ids);
    expect(registered).toHaveLength(2);
    expect(chosen([...ids].reverse())).toEqual(registered);
    expect(chosen(['h4', 'h1', 'h6', 'h3', 'h5', 'h2'])).toEqual(registered);
  });
});

describe('holdings in the view', () => {
  const snap = (id: string, hostIds: string[]) => ({ id, tenantId: 't', state: 'ready', hostIds, storedBytes: 1, vmConfig: null }) as unknown as SnapshotRec;

  it('heldSnapshots_comeFromRecordsAndHeartbeats_onlyForTheViewsSnapshots', () => {
    const heard = new HeartbeatRegistry();
    heard.record(create(HeartbeatSchema, { hostId: 'a', bootId: 'b', snapshots: [{ snapshotId: 'sn-1', complete: true }, { snapshotId: 'sn-2', complete: false }, { snapshotId: 'sn-other', complete: true }] }), 1_000);
    heard.record(create(HeartbeatSchema, { hostId: 'b', bootId: 'b' }), 1_000);
    const hosts = fleetViewInput({
      hosts: [host('a'), host('b')], allocs: new Map(), heard, snapshots: [snap('sn-1', []), snap('sn-2', ['b'])], revision: 1, now: 1_000,
      liveness: { suspectAfterMs: 5_000, lostAfterMs: 15_000 }, chunkBytes: 262_144,
    }).hosts;
    // a: sn-1 complete by heartbeat (sn-2 only partial, sn-other not in the view); b: sn-2 by its record.
    expect(hosts.map((h) => [h.id, [...h.heldSnapshots].sort()])).toEqual([['a', ['sn-1']], ['b', ['sn-2']]]);
  });

  it('aSnapshotRecordPlacementWouldRefuse_isLeftOutOfTheView_andTheRestArePlaceable', () => {
    const vm = { qemuVersion: '7.2.0', machine: 'microvm', cpuModel: 'max', accel: 'tcg', vcpus: 1, memoryMib: 256, image: 'tiny' };
    const rec = (id: string, over: object) => ({ id, tenantId: 't', state: 'ready', hostIds: ['a'], storedBytes: 1, vmConfig: { ...vm, ...over } }) as unknown as SnapshotRec;
    const v = fleetViewInput({
      hosts: [host('a')], allocs: new Map(), heard: new HeartbeatRegistry(), snapshots: [rec('ok', {}), rec('no-cpu', { vcpus: 0 }), rec('nan', { memoryMib: Number.NaN })], revision: 1, now: 1_000,
      liveness: { suspectAfterMs: 5_000, lostAfterMs: 15_000 }, chunkBytes: 262_144,
    });
    expect(v.snapshots.map((s) => s.id)).toEqual(['ok']);
    expect(() => buildFleetView(v)).not.toThrow();
  });

  it('imageBuilds_comeFromEachHostsLastHeartbeat_andASnapshotsBaseDiskFromItsRecord_forPlacementToMatch', () => {
    const heard = new HeartbeatRegistry();
    // Through the bus's decoder, as the leader reads it (the VM list is split off and decoded lazily).
    const beat = create(HeartbeatSchema, { hostId: 'a', bootId: 'b', vms: [{ sandboxId: 'sb-1', state: VmState.RUNNING }], images: [{ name: 'tiny', recipeHash: 'e250dbfa', diskSha256: 'aaaa' }, { name: 'debian', recipeHash: '', diskSha256: 'dddd' }] });
    heard.record(decodeHeartbeat(toBinary(HeartbeatSchema, beat)), 1_000);
    heard.record(create(HeartbeatSchema, { hostId: 'b', bootId: 'b' }), 1_000);
    const vmConfig = { machine: 'microvm', memoryMib: 256, vcpus: 1, devices: [], qemuVersion: '7.2.0', accel: 'tcg', cpuModel: 'max', image: 'tiny' };
    const view = fleetViewInput({
      hosts: [host('a'), host('b')], allocs: new Map(), heard,
      snapshots: [{ ...snap('sn-new', []), vmConfig: { ...vmConfig, imageRecipeHash: 'e250dbfa', imageDiskSha256: 'aaaa' } } as SnapshotRec, { ...snap('sn-old', []), vmConfig } as SnapshotRec],
      revision: 1, now: 1_000, liveness: { suspectAfterMs: 5_000, lostAfterMs: 15_000 }, chunkBytes: 262_144,
    });
    // An entry without a recipe hash names no build; a host that says nothing has no images.
    expect(view.hosts.map((h) => [h.id, h.vmm.images])).toEqual([['a', { 'tiny-e250dbfa': 'aaaa' }], ['b', undefined]]);
    // A snapshot recorded before the digests were: no base image to match.
    expect(view.snapshots.map((s) => [s.id, s.vmConfig.baseImage])).toEqual([['sn-new', { key: 'tiny-e250dbfa', diskSha256: 'aaaa' }], ['sn-old', undefined]]);
  });

  it('imageRecipes_areTheEntriesAHeartbeatMarksCurrent_builtOrNot_andAHostThatMarksNoneSaysNothing', () => {
    const heard = new HeartbeatRegistry();
    const beat = create(HeartbeatSchema, { hostId: 'a', bootId: 'b', images: [{ name: 'tiny', recipeHash: 'old1', diskSha256: 'aaaa' }, { name: 'tiny', recipeHash: 'new2', diskSha256: 'bbbb', current: true }, { name: 'debian', recipeHash: 'd3', current: true }] });
    heard.record(decodeHeartbeat(toBinary(HeartbeatSchema, beat)), 1_000);
    heard.record(create(HeartbeatSchema, { hostId: 'b', bootId: 'b', images: [{ name: 'tiny', recipeHash: 'old1', diskSha256: 'aaaa' }] }), 1_000);
    const view = fleetViewInput({ hosts: [host('a'), host('b')], allocs: new Map(), heard, snapshots: [], revision: 1, now: 1_000, liveness: { suspectAfterMs: 5_000, lostAfterMs: 15_000 }, chunkBytes: 262_144 });
    // The current recipe of an image not built yet names no build.
    expect(view.hosts.map((h) => [h.id, h.vmm.images, h.vmm.recipes])).toEqual([
      ['a', { 'tiny-old1': 'aaaa', 'tiny-new2': 'bbbb' }, { tiny: 'new2', debian: 'd3' }],
      ['b', { 'tiny-old1': 'aaaa' }, undefined],
    ]);
  });

  it('registry_vmAndHolds_lookUpTheLastHeartbeat', () => {
    const heard = new HeartbeatRegistry();
    heard.record(create(HeartbeatSchema, { hostId: 'a', bootId: 'b', vms: [{ sandboxId: 'sb-1', pid: 7 }], snapshots: [{ snapshotId: 'sn-1', complete: true }] }), 1_000);
    expect(heard.vm('a', 'sb-1')?.pid).toBe(7);
    expect(heard.holds('a', 'sn-1')).toBe(true);
    // A newer heartbeat replaces what the indexes answer.
    heard.record(create(HeartbeatSchema, { hostId: 'a', bootId: 'b', vms: [], snapshots: [] }), 2_000);
    expect(heard.vm('a', 'sb-1')).toBeUndefined();
    expect(heard.holds('a', 'sn-1')).toBe(false);
    expect(heard.vm('nobody', 'sb-1')).toBeUndefined();
  });
});

describe('liveness across wall clock steps', () => {
  const cfg = { suspectAfterMs: 5_000, lostAfterMs: 15_000 };

  it('livenessOf_aHostHeardJustNow_staysReadyWhenTheWallClockStepsAMinuteForward_andGoesLostWhenItIsSilentLongEnough_afterAnHourBack', () => {
    const heard = new HeartbeatRegistry();
    heard.record(create(HeartbeatSchema, { hostId: 'h', bootId: 'b' }), Date.now());
    const wall = Date.now();
    const mono = performance.now();
    const dateNow = vi.spyOn(Date, 'now');
    const perfNow = vi.spyOn(performance, 'now');
    try {
      // NTP steps the clock a minute forward; only a second has really passed.
      dateNow.mockReturnValue(wall + 61_000);
      perfNow.mockReturnValue(mono + 1_000);
      expect(livenessOf(heard.get('h')?.heardAt, Date.now(), cfg)).toBe('ready');
      // An hour back instead, and then 20 s of silence: lost, not ready for an hour.
      dateNow.mockReturnValue(wall - 3_600_000 + 20_000);
      perfNow.mockReturnValue(mono + 20_000);
      expect(livenessOf(heard.get('h')?.heardAt, Date.now(), cfg)).toBe('lost');
    } finally {
      dateNow.mockRestore();
      perfNow.mockRestore();
    }
    // With no step, the time heard is the time recorded, to the millisecond.
    heard.record(create(HeartbeatSchema, { hostId: 'h2', bootId: 'b' }), 12_345);
    expect(heard.get('h2')?.heardAt).toBe(12_345);
  });
});

describe('a heartbeat whose VM list does not decode', () => {
  // A heartbeat with one good VM entry, then an entry whose framing is sound (field 8, 3
  // bytes) but whose inner message is cut off (field 1, a 5-byte string, 1 byte given):
  // decodeHeartbeat takes it in and fails only when `vms` is read.
  function malformedBeat(): Uint8Array {
    const good = toBinary(HeartbeatSchema, create(HeartbeatSchema, { hostId: 'h1', bootId: 'b', vms: [{ sandboxId: 'sb-1', state: VmState.RUNNING }] }));
    return Uint8Array.from([...good, 0x42, 0x03, 0x0a, 0x05, 0x61]);
  }

  it('vms_ofAHostWhoseLastVmListIsMalformed_isUnknownNotEmpty_andReportedOnce', () => {
    const told: string[] = [];
    const heard = new HeartbeatRegistry((hostId) => told.push(hostId));
    heard.record(decodeHeartbeat(malformedBeat()), 1000);
    heard.record(create(HeartbeatSchema, { hostId: 'h2', bootId: 'b', vms: [{ sandboxId: 'sb-2', state: VmState.RUNNING }] }), 1000);
    expect(heard.vms('h1')).toBeUndefined();
    expect(heard.vm('h1', 'sb-1')).toBeNull();
    expect(heard.vm('h1', 'sb-1')).toBeNull();
    expect(told).toEqual(['h1']);
    // The other host's list is read as usual.
    expect(heard.vm('h2', 'sb-2')?.state).toBe(VmState.RUNNING);
    expect(heard.vm('h2', 'sb-9')).toBeUndefined();
    // A readable beat from the host makes its list known again.
    heard.record(create(HeartbeatSchema, { hostId: 'h1', bootId: 'b', vms: [] }), 2000);
    expect(heard.vms('h1')).toEqual([]);
    expect(heard.vm('h1', 'sb-1')).toBeUndefined();
  });
});
