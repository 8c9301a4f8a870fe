import { describe, expect, it } from 'vitest';
import { InvalidArgumentError } from '../proto/errors.ts';
import { compilePlacementConfig, DEFAULT_PLACEMENT_CONFIG } from './config.ts';
import { NoCapacityError, placementError } from './errors.ts';
import { forkRequest, GIB, hostInput, KVM_82, MIB, snapshotInput } from './fixtures.ts';
import { estimateAssignment, place } from './place.ts';
import { rngForRequest } from './rng.ts';
import { buildFleetView } from './view.ts';
import { diffFingerprint } from '../host-agent/domain/compat.ts';
import type { VmConfigFingerprint } from '../host-agent/domain/vmm.ts';
import type { CreateRequest, FleetView, HostInput, PlacementRequest, PlacementResult, RestoreRequest, SnapshotInput } from './types.ts';

function fleet(hosts: HostInput[], snapshots: SnapshotInput[] = [snapshotInput()]): FleetView {
  return buildFleetView({ revision: 7, observedAtMs: 1_700_000_000_000, hosts, snapshots });
}

function decide(view: FleetView, req: PlacementRequest, config = DEFAULT_PLACEMENT_CONFIG): PlacementResult {
  return place(view, req, rngForRequest(req.id), config);
}

function ok(r: PlacementResult): Extract<PlacementResult, { ok: true }> {
  if (!r.ok) throw new Error(`expected a placement, got ${r.reason}: ${r.explanation.summary}`);
  return r;
}

function perHost(r: PlacementResult): Record<string, number> {
  const out: Record<string, number> = {};
  for (const p of ok(r).placements) out[p.hostId] = (out[p.hostId] ?? 0) + 1;
  return out;
}

/** Memory for exactly `n` children of the default snapshot plus its image: 256 + n * 48. */
function memoryForChildren(n: number): number {
  return 256 + n * 48;
}

describe('fork', () => {
  it('fork_whenHolderHasRoom_placesOnHolderWithoutTransfer', () => {
    const view = fleet([hostInput('cold-1'), hostInput('holder', { heldSnapshots: ['snap-a'] }), hostInput('cold-2')]);
    const r = ok(decide(view, forkRequest(8)));
    expect(perHost(r)).toEqual({ holder: 8 });
    expect(r.transferPlan).toBeNull();
    expect(r.placements.every((p) => p.holdsSnapshot && p.score.transferMs === 0)).toBe(true);
  });

  it('fork_whenSourcesAreScarce_opensAColdHostThatCanPassTheBytesOn_soAForkThatFitsIsPlaced', () => {
    // One source (the holder; the other holder cannot upload) and maxFanOut 1: the cheapest
    // cold host to open (mostly fetched already) cannot upload, so opening it first leaves the
    // rest without a source: 12 of 13. Opening the empty host that can serve first places all.
    const room = (children: number) => ({ vcpus: 2 * children, memoryMib: 65536, diskMib: 500_000 });
    const noUplink = { bandwidthBytesPerS: 1.25e9, rxLoadBytesPerS: 0, txLoadBytesPerS: 1.25e9 };
    const view = fleet([
      hostInput('holder', { heldSnapshots: ['snap-a'], capacity: room(6) }),
      hostInput('holder-busy', { heldSnapshots: ['snap-a'], cordoned: true, link: noUplink }),
      hostInput('empty', { capacity: room(6) }),
      hostInput('mostly-there', { partialSnapshots: { 'snap-a': 0.9 * GIB }, capacity: room(6), link: noUplink }),
      hostInput('small', { partialSnapshots: { 'snap-a': 0.9 * GIB }, capacity: room(1) }),
    ]);
    const r = ok(decide(view, forkRequest(13), compilePlacementConfig({ maxFanOut: 1 })));
    expect(r.placements).toHaveLength(13);
    expect(perHost(r).holder).toBe(6);
    expect(r.transferPlan?.transfers.find((t) => t.destinationHostId === 'empty')?.sourceHostId).toBe('holder');
  });

  it('fork_whenHolderIsFull_spillsToColdHostWithTransferFromHolder', () => {
    const holder = hostInput('holder', { heldSnapshots: ['snap-a'], capacity: { vcpus: 4, memoryMib: 65536, diskMib: 500_000 } });
    const view = fleet([holder, hostInput('cold')]);
    const r = ok(decide(view, forkRequest(5)));
    expect(perHost(r)).toEqual({ holder: 2, cold: 3 });
    expect(r.transferPlan?.transfers).toHaveLength(1);
    const t = r.transferPlan?.transfers[0];
    expect(t).toMatchObject({ sourceHostId: 'holder', destinationHostId: 'cold', bytes: 1 * GIB, wave: 1, startMs: 0 });
    // 1 GiB over 1.25 GB/s
    expect(t?.readyAtMs).toBeCloseTo((GIB / 1.25e9) * 1000, 6);
    const cold = r.placements.filter((p) => p.hostId === 'cold');
    expect(cold.every((p) => p.score.transferMs === t?.readyAtMs)).toBe(true);
  });

  it('fork_whenHolderQueueIsLongerThanTransfer_spillsEvenThoughHolderHasRoom', () => {
    // 2000 ops * 40 ms on the holder dwarfs a 0.86 s copy.
    const view = fleet([hostInput('holder', { heldSnapshots: ['snap-a'], inflightOps: 2000 }), hostInput('cold')]);
    const r = ok(decide(view, forkRequest(2)));
    expect(perHost(r)).toEqual({ cold: 2 });
  });

  it('fork_whenHostsReportRestoreTimeAndSlots_pricesTheHoldersQueueByThemAndSpills', () => {
    // A 1 GiB copy at 1.25 GB/s takes ~0.86 s. Ten ops queued on the holder cost 0.4 s at the
    // default 40 ms each, so the child stays there; with measured 400 ms restores and one slot
    // they cost 4 s, and the cold host's copy is the shorter wait.
    const holder = (over: Partial<HostInput> = {}): HostInput => hostInput('holder', { heldSnapshots: ['snap-a'], inflightOps: 10, ...over });
    expect(perHost(decide(fleet([holder(), hostInput('cold')]), forkRequest(1)))).toEqual({ holder: 1 });
    const measured = { restoreCostMs: 400, restoreSlots: 1 };
    const r = ok(decide(fleet([holder(measured), hostInput('cold', measured)]), forkRequest(1)));
    expect(perHost(r)).toEqual({ cold: 1 });
    expect(r.placements[0]?.score).toMatchObject({ restoreMs: 400, queueMs: 0 });
    // Two slots halve what each op ahead costs: 10 * 200 ms on the holder.
    const est = estimateAssignment(fleet([holder({ restoreCostMs: 400, restoreSlots: 2 })]), forkRequest(1), ['holder']);
    if (!est.ok) throw new Error(est.reason);
    expect(est.placements[0]?.score.queueMs).toBe(2000);
  });

  it('fork_whenTransfersAreSlow_keepsEveryChildOnHoldersWhileTheyHaveRoom', () => {
    const slow = { bandwidthBytesPerS: 1e6, rxLoadBytesPerS: 0, txLoadBytesPerS: 0 };
    const view = fleet([
      hostInput('h1', { heldSnapshots: ['snap-a'], link: slow }),
      hostInput('c1', { link: slow }),
      hostInput('h2', { heldSnapshots: ['snap-a'], link: slow }),
      hostInput('c2', { link: slow }),
    ]);
    const r = ok(decide(view, forkRequest(30)));
    expect(r.placements.every((p) => p.holdsSnapshot)).toBe(true);
    expect(r.transferPlan).toBeNull();
  });

  it('fork_whenManyColdHostsNeeded_buildsTransferTreeWithinFanOutCap', () => {
    const small = { vcpus: 2, memoryMib: 65536, diskMib: 500_000 }; // one child per host
    const hosts = [hostInput('holder', { heldSnapshots: ['snap-a'], capacity: small })];
    for (let i = 0; i < 20; i++) hosts.push(hostInput(`cold-${i}`, { capacity: small }));
    const config = compilePlacementConfig({ maxFanOut: 2 });
    const r = ok(decide(fleet(hosts), forkRequest(21), config));
    const transfers = r.transferPlan?.transfers ?? [];
    expect(transfers).toHaveLength(20);
    const fanOut = new Map<string, number>();
    for (const t of transfers) fanOut.set(t.sourceHostId, (fanOut.get(t.sourceHostId) ?? 0) + 1);
    expect(Math.max(...fanOut.values())).toBeLessThanOrEqual(2);
    expect(Math.max(...transfers.map((t) => t.wave))).toBeGreaterThanOrEqual(3);
    const readyAt = new Map(transfers.map((t) => [t.destinationHostId, t.readyAtMs]));
    for (const t of transfers) {
      if (t.sourceHostId === 'holder') continue;
      expect(readyAt.get(t.sourceHostId)).toBeLessThanOrEqual(t.startMs);
    }
  });

  it('fork_childrenOfOneSnapshotOnOneHost_shareOneMemoryImage', () => {
    // Room for the image once plus 10 private working sets, not 10 full guests.
    const host = hostInput('holder', { heldSnapshots: ['snap-a'], capacity: { vcpus: 64, memoryMib: memoryForChildren(10), diskMib: 500_000 } });
    const r = ok(decide(fleet([host]), forkRequest(10)));
    expect(perHost(r)).toEqual({ holder: 10 });
    expect(decide(fleet([host]), forkRequest(11)).ok).toBe(false);
  });

  it('fork_whenImageAlreadyResident_chargesOnlyPrivateWorkingSets', () => {
    const host = hostInput('holder', {
      heldSnapshots: ['snap-a'],
      residentImages: ['snap-a'],
      allocated: { vcpus: 0, memoryMib: 256, diskMib: 0 },
      capacity: { vcpus: 64, memoryMib: memoryForChildren(10), diskMib: 500_000 },
    });
    expect(perHost(decide(fleet([host]), forkRequest(10)))).toEqual({ holder: 10 });
  });

  it('restore_whereTheImageIsResident_isChargedAWholeGuest_asTheServiceBooksIt', () => {
    // A restore shares no image (README "Memory"): 256 MiB, not a private working set of 48.
    const host = (free: number): ReturnType<typeof hostInput> =>
      hostInput('holder', { heldSnapshots: ['snap-a'], residentImages: ['snap-a'], allocated: { vcpus: 0, memoryMib: 256, diskMib: 0 }, capacity: { vcpus: 64, memoryMib: 256 + free, diskMib: 500_000 } });
    const restore: RestoreRequest = { kind: 'restore', id: 'op-wake-r', nowMs: 1, snapshotId: 'snap-a', overlayDiskMib: 0 };
    expect(decide(fleet([host(255)]), restore).explanation.filtered).toEqual({ insufficient_memory: 1 });
    expect(perHost(decide(fleet([host(256)]), restore))).toEqual({ holder: 1 });
  });

  it('fork_whenChildrenOfTheImageAreBookedThere_chargesWhatMoreChildrenAddToTheirSharedBooking', () => {
    // Two children booked as shares: 256 + 2 * 48 of memory. Each more one adds 48.
    const booked = memoryForChildren(2);
    const host = (free: number): ReturnType<typeof hostInput> =>
      hostInput('holder', { heldSnapshots: ['snap-a'], imageShares: { 'snap-a': 2 }, allocated: { vcpus: 0, memoryMib: booked, diskMib: 0 }, capacity: { vcpus: 64, memoryMib: booked + free, diskMib: 500_000 } });
    expect(perHost(decide(fleet([host(5 * 48)]), forkRequest(5)))).toEqual({ holder: 5 });
    expect(decide(fleet([host(5 * 48 - 1)]), forkRequest(5)).ok).toBe(false);
    // One child booked alone holds a whole guest (256): the second adds 2 * 48 (256 + 2 * 48 in all).
    const one = hostInput('holder', { heldSnapshots: ['snap-a'], imageShares: { 'snap-a': 1 }, allocated: { vcpus: 0, memoryMib: 256, diskMib: 0 }, capacity: { vcpus: 64, memoryMib: 256 + 2 * 48, diskMib: 500_000 } });
    expect(perHost(decide(fleet([one]), forkRequest(1)))).toEqual({ holder: 1 });
    expect(decide(fleet([{ ...one, capacity: { ...one.capacity, memoryMib: 256 + 2 * 48 - 1 } }]), forkRequest(1)).ok).toBe(false);
  });

  it('restore_whenForkChildrenShareTheImageThere_stillNeedsAWholeGuest', () => {
    const host = hostInput('holder', { heldSnapshots: ['snap-a'], imageShares: { 'snap-a': 4 }, allocated: { vcpus: 0, memoryMib: memoryForChildren(4), diskMib: 0 }, capacity: { vcpus: 64, memoryMib: memoryForChildren(4) + 255, diskMib: 500_000 } });
    expect(decide(fleet([host]), { kind: 'restore', id: 'r1', nowMs: 0, snapshotId: 'snap-a', overlayDiskMib: 1024 }).ok).toBe(false);
    expect(decide(fleet([{ ...host, capacity: { ...host.capacity, memoryMib: memoryForChildren(4) + 256 } }]), { kind: 'restore', id: 'r1', nowMs: 0, snapshotId: 'snap-a', overlayDiskMib: 1024 }).ok).toBe(true);
  });

  it('fork_onPartialHolder_fetchesOnlyMissingChunks', () => {
    const view = fleet([
      hostInput('holder', { heldSnapshots: ['snap-a'], capacity: { vcpus: 0, memoryMib: 0, diskMib: 0 } }),
      hostInput('partial', { partialSnapshots: { 'snap-a': 1 * GIB - 10 * MIB - 5 } }),
      hostInput('cold'),
    ]);
    const r = ok(decide(view, forkRequest(1)));
    expect(perHost(r)).toEqual({ partial: 1 });
    expect(r.transferPlan?.transfers[0]?.bytes).toBe(12 * MIB); // 10 MiB + 5 B rounded up to 4 MiB chunks
  });

  it('fork_withSameHostLocality_placesOnlyOnHolders', () => {
    const view = fleet([hostInput('holder', { heldSnapshots: ['snap-a'], capacity: { vcpus: 4, memoryMib: 65536, diskMib: 500_000 } }), hostInput('cold')]);
    expect(perHost(decide(view, forkRequest(2, { preferences: { locality: 'SAME_HOST' } })))).toEqual({ holder: 2 });
    const r = decide(view, forkRequest(3, { preferences: { locality: 'SAME_HOST' } }));
    expect(r.ok).toBe(false);
    expect(r.explanation.filtered.locality).toBe(1);
  });

  it('fork_withCrossHostLocality_placesOffHoldersAndStreamsFromThem', () => {
    const view = fleet([hostInput('holder', { heldSnapshots: ['snap-a'] }), hostInput('cold')]);
    const r = ok(decide(view, forkRequest(3, { preferences: { locality: 'CROSS_HOST' } })));
    expect(perHost(r)).toEqual({ cold: 3 });
    expect(r.transferPlan?.transfers.map((t) => t.sourceHostId)).toEqual(['holder']);
  });

  it('fork_withSpreadAndMaxPerHost_putsAtMostThatManyOnEachHost', () => {
    const view = fleet([0, 1, 2, 3].map((i) => hostInput(`h${i}`, { heldSnapshots: ['snap-a'] })));
    const r = decide(view, forkRequest(8, { preferences: { spread: 'SPREAD', maxPerHost: 2 } }));
    expect(perHost(r)).toEqual({ h0: 2, h1: 2, h2: 2, h3: 2 });
    expect(decide(view, forkRequest(9, { preferences: { maxPerHost: 2 } })).ok).toBe(false);
  });

  it('fork_withSiblingsAlreadyOnHosts_countsThemAgainstMaxPerHost', () => {
    const view = fleet([0, 1, 2].map((i) => hostInput(`h${i}`, { heldSnapshots: ['snap-a'] })));
    const siblingsPerHost = new Map([['h0', 2], ['h1', 1]]);
    expect(perHost(decide(view, forkRequest(3, { siblingsPerHost, preferences: { maxPerHost: 2 } })))).toEqual({ h1: 1, h2: 2 });
    expect(decide(view, forkRequest(4, { siblingsPerHost, preferences: { maxPerHost: 2 } })).ok).toBe(false);
    // Without maxPerHost, siblings cap nothing.
    expect(decide(view, forkRequest(4, { siblingsPerHost })).ok).toBe(true);
  });

  it('fork_withPack_prefersTheFullerHost', () => {
    const view = fleet([
      hostInput('empty', { heldSnapshots: ['snap-a'] }),
      hostInput('busy', { heldSnapshots: ['snap-a'], allocated: { vcpus: 16, memoryMib: 32768, diskMib: 0 } }),
    ]);
    expect(Object.keys(perHost(decide(view, forkRequest(2, { preferences: { spread: 'PACK' } }))))).toEqual(['busy']);
    expect(Object.keys(perHost(decide(view, forkRequest(1, { preferences: { spread: 'SPREAD' } }))))).toEqual(['empty']);
  });

  it('fork_withPinnedHost_placesOnlyThereAndCountsOthersAsNotPinned', () => {
    const view = fleet([hostInput('a', { heldSnapshots: ['snap-a'] }), hostInput('b'), hostInput('c')]);
    const r = ok(decide(view, forkRequest(2, { preferences: { pinnedHostId: 'c' } })));
    expect(perHost(r)).toEqual({ c: 2 });
    expect(r.explanation.filtered.not_pinned).toBe(2);
    const unknown = decide(view, forkRequest(1, { preferences: { pinnedHostId: 'nope' } }));
    expect(unknown.ok).toBe(false);
    expect(unknown.explanation.filtered.not_pinned).toBe(3);
  });

  it('fork_avoidingHosts_placesElsewhereAndCountsThemAsAvoided_yetAnAvoidedHolderStillServes', () => {
    // A fork's children placed again off a host that was lost and is back: never onto it.
    const view = fleet([hostInput('back', { heldSnapshots: ['snap-a'] }), hostInput('b'), hostInput('c')]);
    const r = ok(decide(view, forkRequest(2, { preferences: { avoidHostIds: ['back', 'unknown-host'], maxPerHost: 1 } })));
    expect(perHost(r)).toEqual({ b: 1, c: 1 });
    expect(r.explanation.filtered.avoided).toBe(1);
    expect(r.transferPlan?.transfers.map((t) => t.sourceHostId)).toContain('back');
    expect(estimateAssignment(view, forkRequest(1, { preferences: { avoidHostIds: ['back'] } }), ['back'])).toMatchObject({ ok: false, reason: 'avoided' });
    const none = decide(view, forkRequest(1, { preferences: { avoidHostIds: ['back', 'b', 'c'] } }));
    expect(none.ok).toBe(false);
    expect(none.explanation.filtered.avoided).toBe(3);
  });

  it('estimateAssignment_pinnedToAnUnknownHost_refusesEveryHostAsPlaceDoes', () => {
    const view = fleet([hostInput('h1', { heldSnapshots: ['snap-a'] })]);
    expect(decide(view, forkRequest(1, { preferences: { pinnedHostId: 'nope' } })).ok).toBe(false);
    expect(estimateAssignment(view, forkRequest(1, { preferences: { pinnedHostId: 'nope' } }), ['h1'])).toMatchObject({ ok: false, reason: 'not_pinned' });
  });

  it('fork_neverUsesSuspectHolderAsSource_butCordonedHolderStillServes', () => {
    const suspect = fleet([hostInput('holder', { heldSnapshots: ['snap-a'], state: 'suspect' }), hostInput('cold')]);
    const r1 = decide(suspect, forkRequest(1));
    expect(r1.ok).toBe(false);
    expect(r1.explanation.filtered).toEqual({ host_suspect: 1, no_transfer_source: 1 });
    const cordoned = fleet([hostInput('holder', { heldSnapshots: ['snap-a'], cordoned: true }), hostInput('cold')]);
    const r2 = ok(decide(cordoned, forkRequest(1)));
    expect(perHost(r2)).toEqual({ cold: 1 });
    expect(r2.transferPlan?.transfers[0]?.sourceHostId).toBe('holder');
  });
});

describe('no capacity', () => {
  it('place_whenNoHostFits_returnsExplanationCountingEachReason', () => {
    const view = fleet([
      hostInput('lost', { state: 'lost', heldSnapshots: ['snap-a'] }),
      hostInput('cordoned', { cordoned: true }),
      hostInput('draining', { draining: true }),
      hostInput('tcg', { vmm: { qemuVersion: '8.2.2', machines: ['pc-q35-8.2'], cpuModels: ['host'], accel: 'tcg' } }),
      hostInput('cpu-full', { allocated: { vcpus: 32, memoryMib: 0, diskMib: 0 } }),
      hostInput('mem-full', { allocated: { vcpus: 0, memoryMib: 65536 - 300, diskMib: 0 } }),
      hostInput('disk-full', { capacity: { vcpus: 32, memoryMib: 65536, diskMib: 1000 } }),
      hostInput('no-link', { link: { bandwidthBytesPerS: 1e9, rxLoadBytesPerS: 1e9, txLoadBytesPerS: 0 } }),
    ]);
    const r = decide(view, forkRequest(4));
    expect(r.ok).toBe(false);
    if (r.ok) return;
    expect(r.reason).toBe('no_capacity');
    // The only holder is lost, so no cold host can get the bytes: transfer reasons come after state/VMM checks.
    expect(r.explanation.filtered).toEqual({
      host_lost: 1,
      cordoned: 1,
      draining: 1,
      vmm_incompatible: 1,
      no_inbound_bandwidth: 1,
      no_transfer_source: 3,
    });
    expect(r.explanation.examined).toBe(8);
    expect(r.explanation.summary).toContain('could place 0 of 4');
    expect(placementError(r)).toBeInstanceOf(NoCapacityError);
    expect(placementError(r)?.retryable).toBe(true);
  });

  it('place_whenHostsFitSomeChildren_reportsHowManyCouldBePlaced', () => {
    const view = fleet([hostInput('holder', { heldSnapshots: ['snap-a'], capacity: { vcpus: 6, memoryMib: 65536, diskMib: 500_000 } })]);
    const r = decide(view, forkRequest(5));
    expect(r.ok).toBe(false);
    expect(r.explanation).toMatchObject({ requested: 5, placed: 3 });
  });

  it('place_whenAPerHostCapLeavesFeasibleHostsShort_saysSoInTheSummary', () => {
    const view = fleet([hostInput('h1', { heldSnapshots: ['snap-a'] }), hostInput('h2', { heldSnapshots: ['snap-a'] }), hostInput('h3', { heldSnapshots: ['snap-a'] })]);
    const r = decide(view, forkRequest(5, { preferences: { maxPerHost: 1 } }));
    expect(r.explanation.summary).toMatch(/could place 3 of 5; 3 feasible of 3 examined \(none filtered\); at most 1 per host$/);
    const again = decide(view, forkRequest(4, { siblingsPerHost: new Map([['h1', 1]]), preferences: { maxPerHost: 1 } }));
    expect(again.explanation.summary).toMatch(/could place 2 of 4; .* at most 1 per host, the fork's children already placed counted$/);
  });

  it('place_whenResourcesShort_namesTheResource', () => {
    const view = fleet([
      hostInput('cpu', { heldSnapshots: ['snap-a'], allocated: { vcpus: 31, memoryMib: 0, diskMib: 0 } }),
      hostInput('mem', { heldSnapshots: ['snap-a'], capacity: { vcpus: 32, memoryMib: 200, diskMib: 500_000 } }),
      hostInput('disk', { heldSnapshots: ['snap-a'], capacity: { vcpus: 32, memoryMib: 65536, diskMib: 100 } }),
    ]);
    expect(decide(view, forkRequest(1)).explanation.filtered).toEqual({ insufficient_vcpu: 1, insufficient_memory: 1, insufficient_disk: 1 });
  });

  it('place_whenSnapshotNotInView_returnsUnknownSnapshot', () => {
    const r = decide(fleet([hostInput('a')]), forkRequest(1, { snapshotId: 'ghost' }));
    expect(r).toMatchObject({ ok: false, reason: 'unknown_snapshot' });
    expect(placementError(r, 'ghost')?.kind).toBe('not_found');
  });
});

describe('restore and create', () => {
  const restore: RestoreRequest = { kind: 'restore', id: 'op-wake-1', nowMs: 1, snapshotId: 'snap-a', overlayDiskMib: 512 };

  it('restore_onIncompatibleVmm_filtersOlderNewerMajorAndOtherAccel', () => {
    const view = fleet([
      hostInput('older', { vmm: { qemuVersion: '8.1.5', machines: ['pc-q35-8.2'], cpuModels: ['host'], accel: 'kvm' } }),
      hostInput('next-major', { vmm: { qemuVersion: '9.0.0', machines: ['pc-q35-8.2'], cpuModels: ['host'], accel: 'kvm' } }),
      hostInput('no-machine', { vmm: { qemuVersion: '8.2.2', machines: ['microvm'], cpuModels: ['host'], accel: 'kvm' } }),
      hostInput('holder', { heldSnapshots: ['snap-a'] }),
      hostInput('ok', { vmm: { qemuVersion: '8.2.1', machines: ['pc-q35-8.2'], cpuModels: ['host'], accel: 'kvm' } }),
    ]);
    const r = ok(decide(view, restore));
    expect(r.placements).toHaveLength(1);
    expect(r.explanation.filtered).toEqual({ vmm_incompatible: 3 });
    expect(r.explanation.feasible).toBe(2);
  });

  it('restore_isPlacedOnlyOnHostsOfTheSnapshotsQemuSeries_theRuleTheHostAgentRestoresBy', () => {
    // Snapshot taken on 8.2.2. An 8.3 host used to pass (same major, not older), and its agent
    // refused every restore; an older 8.2.x patch release restores it, and used to be filtered.
    const vmm = (qemuVersion: string): HostInput['vmm'] => ({ qemuVersion, machines: ['pc-q35-8.2'], cpuModels: ['host'], accel: 'kvm' });
    const snapshotOn = (qemuVersion: string): SnapshotInput => snapshotInput('snap-a', { vmConfig: { ...snapshotInput().vmConfig, qemuVersion } });
    // It is held (served from) only by a host of another major release.
    const holder = hostInput('holder', { heldSnapshots: ['snap-a'], vmm: vmm('9.0.0') });
    const r = ok(decide(fleet([holder, hostInput('newer-minor', { vmm: vmm('8.3.0') }), hostInput('older-patch', { vmm: vmm('8.2.0') })], [snapshotOn('8.2.2')]), restore));
    expect(r.placements).toEqual([expect.objectContaining({ hostId: 'older-patch' })]);
    expect(r.explanation.filtered).toEqual({ vmm_incompatible: 2 });
    // Placed exactly where the agent's own check (diffFingerprint) lets the restore run.
    const fp: VmConfigFingerprint = { machineType: 'pc-q35-8.2', memoryMib: 256, vcpus: 2, devices: [], qemuVersion: '', accel: 'kvm', cpuModel: 'host' };
    for (const [host, taken] of [['8.3.0', '8.2.2'], ['8.2.0', '8.2.2'], ['9.0.0', '8.2.2'], ['8.2.9', '8.2.2'], ['8.1.5', '8.2.2'], ['7.2.22', '7.2.1']]) {
      const agentRestores = diffFingerprint({ ...fp, qemuVersion: taken! }, { ...fp, qemuVersion: host! }).length === 0;
      expect([host, taken, decide(fleet([holder, hostInput('h', { vmm: vmm(host!) })], [snapshotOn(taken!)]), restore).ok]).toEqual([host, taken, agentRestores]);
    }
  });

  it('restore_ofAGuestAsLargeAsAHostsWholeMemory_fitsThere_asItsCreateDid_whileTwoForkedChildrenNeedTheImageAndTwoPrivateShares', () => {
    // The default snapshot's guest has 256 MiB: a lone child needs 256 (not 256 + 48), two
    // children of one fork need 256 + 2 x 48 = 352 (not 2 x 256).
    const whole = fleet([hostInput('exact', { heldSnapshots: ['snap-a'], capacity: { vcpus: 32, memoryMib: 256, diskMib: 500_000 } })]);
    expect(ok(decide(whole, restore)).placements).toEqual([expect.objectContaining({ hostId: 'exact' })]);
    expect(decide(fleet([hostInput('short', { heldSnapshots: ['snap-a'], capacity: { vcpus: 32, memoryMib: 255, diskMib: 500_000 } })]), restore).explanation.filtered).toEqual({ insufficient_memory: 1 });
    const two = fleet([hostInput('two', { heldSnapshots: ['snap-a'], capacity: { vcpus: 32, memoryMib: 352, diskMib: 500_000 } })]);
    expect(perHost(ok(decide(two, forkRequest(2))))).toEqual({ two: 2 });
    expect(decide(two, forkRequest(3)).ok).toBe(false);
  });

  it('fork_ofASnapshotTakenOverOneBuildOfItsImage_leavesOutHostsWhoseBuildDiffers_evenOneHoldingIt_butNotHostsThatSayNothing', () => {
    const snap = snapshotInput('snap-a', { vmConfig: { ...snapshotInput().vmConfig, baseImage: { key: 'tiny-e250dbfa', diskSha256: 'aaaa' } } });
    const view = fleet(
      [
        hostInput('same-build', { vmm: { ...KVM_82, images: { 'tiny-e250dbfa': 'aaaa' } } }),
        hostInput('other-build', { vmm: { ...KVM_82, images: { 'tiny-e250dbfa': 'bbbb' } }, heldSnapshots: ['snap-a'] }),
        hostInput('other-recipe-only', { vmm: { ...KVM_82, images: { 'tiny-0123abcd': 'cccc' } } }),
        hostInput('says-nothing'),
      ],
      [snap],
    );
    const r = ok(decide(view, forkRequest(8)));
    // The holder cannot restore it: its children go where the snapshot must be sent, from it.
    expect(perHost(r)['other-build']).toBeUndefined();
    expect(r.explanation.filtered).toEqual({ vmm_incompatible: 1 });
    expect(r.explanation.feasible).toBe(3);
    expect(r.transferPlan?.transfers.every((t) => t.sourceHostId === 'other-build')).toBe(true);
  });

  it('fork_ofASnapshotOverARecipeAHostHasNotBuilt_leavesOutHostsThatBuildTheImageByAnotherRecipe_keepsThoseOfItsRecipe', () => {
    // Another kernel or package versions there: its agent builds `tiny` by another recipe, and
    // refuses a restore over this one's disk, every time.
    const snap = snapshotInput('snap-a', { vmConfig: { ...snapshotInput().vmConfig, baseImage: { key: 'tiny-e250dbfa', diskSha256: 'aaaa' } } });
    const view = fleet(
      [
        hostInput('holder', { heldSnapshots: ['snap-a'], vmm: { ...KVM_82, images: { 'tiny-e250dbfa': 'aaaa' }, recipes: { tiny: 'e250dbfa' } }, capacity: { vcpus: 32, memoryMib: 256, diskMib: 500_000 } }),
        hostInput('other-recipe', { vmm: { ...KVM_82, recipes: { tiny: '0123abcd' } } }),
        hostInput('other-recipe-but-built-this-one', { vmm: { ...KVM_82, images: { 'tiny-e250dbfa': 'aaaa' }, recipes: { tiny: '0123abcd' } } }),
        hostInput('same-recipe', { vmm: { ...KVM_82, recipes: { tiny: 'e250dbfa', debian: '99' } } }),
        hostInput('recipes-of-other-images-only', { vmm: { ...KVM_82, recipes: { debian: '99' } } }),
      ],
      [snap],
    );
    const r = ok(decide(view, forkRequest(8)));
    expect(perHost(r)['other-recipe']).toBeUndefined();
    expect(r.explanation.filtered).toEqual({ vmm_incompatible: 1 });
    expect(r.explanation.feasible).toBe(4);
  });

  it('create_bootsOnLeastCostFeasibleHostWithoutTransfer', () => {
    const req: CreateRequest = { kind: 'create', id: 'op-create-1', nowMs: 1, resources: { vcpus: 4, memoryMib: 4096, diskMib: 10_000 }, vmm: { accel: 'kvm', minQemuVersion: '8.2.0' } };
    const view = fleet([
      hostInput('busy', { inflightOps: 10 }),
      hostInput('idle'),
      hostInput('old', { vmm: { qemuVersion: '8.0.0', machines: ['pc-q35-8.0'], cpuModels: ['host'], accel: 'kvm' } }),
    ]);
    const r = ok(decide(view, req));
    expect(r.placements).toEqual([expect.objectContaining({ hostId: 'idle', holdsSnapshot: false })]);
    expect(r.placements[0]?.score.restoreMs).toBe(DEFAULT_PLACEMENT_CONFIG.bootCostMs);
    expect(r.transferPlan).toBeNull();
    expect(r.explanation.filtered).toEqual({ vmm_incompatible: 1 });
  });
});

describe('determinism, sampling and validation', () => {
  function bigFleet(n: number, holdEvery: number): FleetView {
    const hosts: HostInput[] = [];
    for (let i = 0; i < n; i++) hosts.push(hostInput(`h${i}`, { heldSnapshots: i % holdEvery === 0 ? ['snap-a'] : [], inflightOps: i % 7 }));
    return fleet(hosts);
  }

  it('place_withSameRequestId_returnsIdenticalResult', () => {
    const view = bigFleet(1000, 20);
    const a = decide(view, forkRequest(64, { id: 'op-x' }));
    const b = decide(view, forkRequest(64, { id: 'op-x' }));
    expect(a).toEqual(b);
  });

  it('fork_onLargeFleet_samplesButAlwaysExaminesHolders', () => {
    const view = bigFleet(2000, 20);
    const r = ok(decide(view, forkRequest(8)));
    expect(r.explanation.sampled).toBe(true);
    expect(r.explanation.fallbackFullScan).toBe(false);
    expect(r.explanation.examined).toBeGreaterThanOrEqual(100);
    expect(r.explanation.examined).toBeLessThan(400);
    expect(r.placements.every((p) => p.holdsSnapshot)).toBe(true);
  });

  it('fork_ofASnapshotHeldByHalfALargeFleet_samplesItsHoldersToo_andPlacesEveryChildOnAHolder', () => {
    const view = bigFleet(2000, 2); // 1000 holders
    const r = ok(decide(view, forkRequest(8)));
    expect(r.explanation.sampled).toBe(true);
    expect(r.explanation.fallbackFullScan).toBe(false);
    // 64 wanted holders (max(sampleK, 2 * count)) and 64 other hosts: not all 1000 holders.
    expect(r.explanation.examined).toBeLessThan(200);
    expect(r.placements.every((p) => p.holdsSnapshot)).toBe(true);
  });

  it('fork_onLargeFleet_whenSampleFindsNoRoom_fallsBackToFullScan', () => {
    const hosts: HostInput[] = [];
    for (let i = 0; i < 1000; i++) hosts.push(hostInput(`h${i}`, { heldSnapshots: i === 0 ? ['snap-a'] : [], cordoned: i !== 0 && i !== 777 }));
    hosts[0] = hostInput('h0', { heldSnapshots: ['snap-a'], capacity: { vcpus: 0, memoryMib: 0, diskMib: 0 } });
    // One draw: the sample almost surely misses the single free host (deterministic for this id).
    const config = compilePlacementConfig({ sampleK: 1, sampleAttemptsPerHost: 1 });
    const r = ok(decide(fleet(hosts), forkRequest(1, { id: 'op-needle' }), config));
    expect(perHost(r)).toEqual({ h777: 1 });
    expect(r.explanation.fallbackFullScan).toBe(true);
    expect(r.explanation.examined).toBe(1000);
  });

  it('estimateAssignment_ofPlacesOwnChoice_reproducesItsScores', () => {
    const small = { vcpus: 8, memoryMib: 65536, diskMib: 500_000 };
    const hosts = [hostInput('holder', { heldSnapshots: ['snap-a'], capacity: small })];
    for (let i = 0; i < 6; i++) hosts.push(hostInput(`c${i}`, { capacity: small, inflightOps: i }));
    const view = fleet(hosts);
    const req = forkRequest(20);
    const r = ok(decide(view, req));
    const est = estimateAssignment(view, req, r.placements.map((p) => p.hostId));
    if (!est.ok) throw new Error(est.reason);
    expect(est.placements).toEqual(r.placements);
    expect(est.transferPlan).toEqual(r.transferPlan);
    expect(est.makespanMs).toBe(r.explanation.makespanMs);
  });

  it('place_withInvalidCount_throwsInvalidArgumentNamingTheField', () => {
    const view = fleet([hostInput('a')]);
    for (const count of [0, -1, 1.5, 100_000]) {
      expect(() => decide(view, forkRequest(count))).toThrow(InvalidArgumentError);
    }
    try {
      decide(view, forkRequest(0));
    } catch (e) {
      expect(e).toMatchObject({ kind: 'invalid_argument', field: 'count' });
    }
  });

  it('compilePlacementConfig_rejectsOutOfRangeValues', () => {
    expect(() => compilePlacementConfig({ maxFanOut: 0 })).toThrow(/maxFanOut/);
    expect(() => compilePlacementConfig({ privateMemoryFraction: 0 })).toThrow(/privateMemoryFraction/);
    expect(Object.isFrozen(compilePlacementConfig({}))).toBe(true);
  });

  it('buildFleetView_rejectsDuplicateHostIds', () => {
    expect(() => fleet([hostInput('a'), hostInput('a')])).toThrow(InvalidArgumentError);
  });

  it('buildFleetView_withANaNOrNegativeLinkFigure_throwsInvalidArgumentNamingIt', () => {
    const link = { bandwidthBytesPerS: 1.25e9, rxLoadBytesPerS: 0, txLoadBytesPerS: 0 };
    expect(() => fleet([hostInput('a', { link: { ...link, bandwidthBytesPerS: Number.NaN } })])).toThrow(expect.objectContaining({ kind: 'invalid_argument', field: 'hosts[a].link.bandwidthBytesPerS' }));
    expect(() => fleet([hostInput('a', { link: { ...link, rxLoadBytesPerS: -1 } })])).toThrow(expect.objectContaining({ field: 'hosts[a].link.rxLoadBytesPerS' }));
    expect(() => fleet([hostInput('a', { link: { ...link, txLoadBytesPerS: undefined as unknown as number } })])).toThrow(expect.objectContaining({ field: 'hosts[a].link.txLoadBytesPerS' }));
  });

  it('buildFleetView_withBadRestoreSlotsOrCost_throwsInvalidArgumentNamingTheHostsField', () => {
    for (const restoreSlots of [0, 1.5, -1]) {
      expect(() => fleet([hostInput('a', { restoreSlots })])).toThrow(expect.objectContaining({ kind: 'invalid_argument', field: 'hosts[a].restoreSlots' }));
    }
    expect(() => fleet([hostInput('a', { restoreCostMs: Number.NaN })])).toThrow(expect.objectContaining({ field: 'hosts[a].restoreCostMs' }));
  });

  it('buildFleetView_withNaNOrNegativeInflightOps_orASnapshotOfNoVcpusOrNaNMemory_throwsNamingTheField', () => {
    // Each used to be placed: NaN ETAs, children past a host's memory, 50 children on 2 vCPUs.
    for (const inflightOps of [Number.NaN, -1000]) expect(() => fleet([hostInput('a', { inflightOps })])).toThrow(expect.objectContaining({ kind: 'invalid_argument', field: 'hosts[a].inflightOps' }));
    const vm = snapshotInput().vmConfig;
    expect(() => fleet([hostInput('a')], [snapshotInput('snap-a', { vmConfig: { ...vm, vcpus: 0 } })])).toThrow(expect.objectContaining({ field: 'snapshots[snap-a].vmConfig.vcpus' }));
    expect(() => fleet([hostInput('a')], [snapshotInput('snap-a', { vmConfig: { ...vm, memoryMib: Number.NaN } })])).toThrow(expect.objectContaining({ field: 'snapshots[snap-a].vmConfig.memoryMib' }));
  });
});
