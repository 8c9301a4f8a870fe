// Property tests for place(): invariants that must hold on any fleet, not just examples.
import fc from 'fast-check';
import { describe, expect, it } from 'vitest';
import { compilePlacementConfig, type PlacementConfig } from './config.ts';
import { GIB, KVM_82, MIB } from './fixtures.ts';
import { missingBytes } from './cost.ts';
import { estimateAssignment, place } from './place.ts';
import { rngForRequest } from './rng.ts';
import { buildFleetView } from './view.ts';
import type { FleetView, ForkRequest, HostInput, HostVmm, PlacementResult, SnapshotInput } from './types.ts';

const PROFILES: readonly HostVmm[] = [
  KVM_82,
  { qemuVersion: '8.2.0', machines: ['pc-q35-8.2'], cpuModels: ['host'], accel: 'kvm' },
  { qemuVersion: '8.2.2', machines: ['pc-q35-8.2'], cpuModels: ['host'], accel: 'tcg' },
  { qemuVersion: '9.0.1', machines: ['pc-q35-8.2'], cpuModels: ['host'], accel: 'kvm' },
];

const snapshotArb: fc.Arbitrary<SnapshotInput> = fc.record({
  totalMib: fc.integer({ min: 1, max: 4096 }),
  memoryMib: fc.constantFrom(128, 256, 512, 1024),
  vcpus: fc.integer({ min: 1, max: 4 }),
}).map(({ totalMib, memoryMib, vcpus }) => ({
  id: 'snap-a',
  totalBytes: totalMib * MIB,
  chunkBytes: 4 * MIB,
  vmConfig: { qemuVersion: '8.2.0', machine: 'pc-q35-8.2', cpuModel: 'host', accel: 'kvm', vcpus, memoryMib },
}));

const hostArb = (i: number): fc.Arbitrary<HostInput> =>
  fc
    .record({
      state: fc.constantFrom('ready', 'ready', 'ready', 'ready', 'ready', 'ready', 'ready', 'ready', 'suspect', 'lost'),
      cordoned: fc.integer({ min: 0, max: 19 }).map((x) => x === 0),
      draining: fc.integer({ min: 0, max: 19 }).map((x) => x === 0),
      vcpus: fc.noBias(fc.integer({ min: 0, max: 48 })),
      memoryMib: fc.noBias(fc.integer({ min: 0, max: 32_768 })),
      diskMib: fc.noBias(fc.integer({ min: 0, max: 60_000 })),
      used: fc.constantFrom(0, 0, 0.25, 0.5, 0.9, 1),
      inflightOps: fc.integer({ min: 0, max: 30 }),
      bandwidth: fc.constantFrom(1e7, 1e8, 1.25e9, 1e10),
      rxLoad: fc.constantFrom(0, 0, 0.5, 1),
      txLoad: fc.constantFrom(0, 0, 0.5, 1),
      vmm: fc.constantFrom(...PROFILES, KVM_82, KVM_82, KVM_82, KVM_82, KVM_82, KVM_82), // 2 in 10 incompatible
      hold: fc.constantFrom('full', 'full', 'none', 'none', 'partial'),
      partialFrac: fc.double({ min: 0.01, max: 0.99, noNaN: true }),
      resident: fc.boolean(),
      shares: fc.constantFrom(0, 0, 1, 2, 5),
      restoreCostMs: fc.option(fc.integer({ min: 50, max: 600 }), { nil: undefined }),
      restoreSlots: fc.option(fc.integer({ min: 1, max: 8 }), { nil: undefined }),
    })
    .map((r) => ({
      id: `h${i}`,
      state: r.state,
      cordoned: r.cordoned,
      draining: r.draining,
      capacity: { vcpus: r.vcpus, memoryMib: r.memoryMib, diskMib: r.diskMib },
      allocated: { vcpus: Math.floor(r.vcpus * r.used), memoryMib: Math.floor(r.memoryMib * r.used), diskMib: Math.floor(r.diskMib * r.used) },
      inflightOps: r.inflightOps,
      link: { bandwidthBytesPerS: r.bandwidth, rxLoadBytesPerS: r.bandwidth * r.rxLoad, txLoadBytesPerS: r.bandwidth * r.txLoad },
      vmm: r.vmm,
      heldSnapshots: r.hold === 'full' ? ['snap-a'] : [],
      partialSnapshots: r.hold === 'partial' ? { 'snap-a': Math.floor(r.partialFrac * GIB) } : undefined,
      residentImages: r.hold === 'full' && r.resident ? ['snap-a'] : [],
      // Shares on any host: one dropped from the holders keeps the children booked there.
      imageShares: !(r.hold === 'full' && r.resident) && r.shares > 0 ? { 'snap-a': r.shares } : undefined,
      restoreCostMs: r.restoreCostMs,
      restoreSlots: r.restoreSlots,
    }));

interface Scenario {
  readonly view: FleetView;
  readonly snapshot: SnapshotInput;
  readonly request: ForkRequest;
  readonly config: PlacementConfig;
}

const scenarioArb: fc.Arbitrary<Scenario> = fc
  .noBias(fc.integer({ min: 1, max: 12 }))
  .chain((n) =>
    fc.record({
      hosts: fc.tuple(...Array.from({ length: n }, (_, i) => hostArb(i))),
      snapshot: snapshotArb,
      count: fc.integer({ min: 1, max: 20 }),
      id: fc.string({ minLength: 1, maxLength: 12 }),
      locality: fc.constantFrom('ANY', 'ANY', 'ANY', 'SAME_HOST', 'CROSS_HOST'),
      spread: fc.constantFrom('PACK', 'SPREAD'),
      maxPerHost: fc.option(fc.integer({ min: 1, max: 6 }), { nil: undefined }),
      pinned: fc.integer({ min: 0, max: 8 * n - 1 }).map((i) => (i < n ? i : undefined)), // pinned 1 time in 8
      overlayDiskMib: fc.constantFrom(0, 64, 512),
      maxFanOut: fc.integer({ min: 1, max: 4 }),
    }),
  )
  .map((r) => ({
    view: buildFleetView({ revision: 1, observedAtMs: 0, hosts: r.hosts, snapshots: [r.snapshot] }),
    snapshot: r.snapshot,
    config: compilePlacementConfig({ maxFanOut: r.maxFanOut }),
    request: {
      kind: 'fork',
      id: r.id,
      nowMs: 0,
      snapshotId: 'snap-a',
      count: r.count,
      overlayDiskMib: r.overlayDiskMib,
      preferences: {
        locality: r.locality,
        spread: r.spread,
        maxPerHost: r.maxPerHost,
        pinnedHostId: r.pinned === undefined ? undefined : `h${r.pinned}`,
      },
    },
  }));

function decide(s: Scenario): PlacementResult {
  return place(s.view, s.request, rngForRequest(s.request.id), s.config);
}

const RUNS = { numRuns: Number(process.env.FC_RUNS ?? 300) };
const EPS = 1e-6;

describe('place() properties', () => {
  it('never over-commits a host as the service books it: one shared image per holder, whole guests where it fetches, and the chunks it must fetch', () => {
    fc.assert(
      fc.property(scenarioArb, (s) => {
        const r = decide(s);
        if (!r.ok) return;
        const counts = new Map<string, number>();
        for (const p of r.placements) counts.set(p.hostId, (counts.get(p.hostId) ?? 0) + 1);
        const vm = s.snapshot.vmConfig;
        for (const [id, c] of counts) {
          const h = s.view.hosts[s.view.hostIndexById.get(id) ?? -1];
          if (h === undefined) throw new Error(`placed on unknown host ${id}`);
          const holds = h.heldSnapshots.includes('snap-a');
          const present = h.partialSnapshots?.['snap-a'] ?? 0;
          const missing = holds ? 0 : Math.ceil((s.snapshot.totalBytes - present) / s.snapshot.chunkBytes) * s.snapshot.chunkBytes;
          // What the service books (services/domain/image-shares.ts): on a holder, the children
          // share the image, n of them booking never more than n whole guests (a lone child
          // needs its guest's memory, as a create), else the image once plus n private sets;
          // on a host that fetches the snapshot, each child is a whole guest.
          const priv = Math.ceil(vm.memoryMib * (48 / 256));
          const together = (n: number): number => (n === 0 ? 0 : Math.min(n * vm.memoryMib, n * priv + vm.memoryMib));
          const n = h.imageShares?.['snap-a'] ?? 0;
          const memory = !holds ? c * vm.memoryMib : h.residentImages?.includes('snap-a') ? c * priv : together(n + c) - together(n);
          expect(h.allocated.vcpus + c * vm.vcpus).toBeLessThanOrEqual(h.capacity.vcpus);
          expect(h.allocated.memoryMib + memory).toBeLessThanOrEqual(h.capacity.memoryMib);
          expect(h.allocated.diskMib + c * s.request.overlayDiskMib + Math.ceil(Math.min(missing, s.snapshot.totalBytes) / MIB)).toBeLessThanOrEqual(h.capacity.diskMib);
          expect(h.state).toBe('ready');
          expect(h.cordoned || h.draining).toBe(false);
          if (s.request.preferences?.maxPerHost !== undefined) expect(c).toBeLessThanOrEqual(s.request.preferences.maxPerHost);
        }
      }),
      RUNS,
    );
  });

  it('gives the same result for the same seed', () => {
    fc.assert(
      fc.property(scenarioArb, (s) => {
        expect(decide(s)).toEqual(decide(s));
      }),
      RUNS,
    );
  });

  it('returns an explanation, never a throw, when there is no capacity', () => {
    fc.assert(
      fc.property(scenarioArb, (s) => {
        const r = decide(s);
        const e = r.explanation;
        const filtered = Object.values(e.filtered).reduce((a, b) => a + (b ?? 0), 0);
        expect(filtered + e.feasible).toBe(e.examined);
        expect(e.examined).toBe(s.view.hosts.length);
        if (r.ok) {
          expect(e.placed).toBe(s.request.count);
        } else {
          expect(r.reason).toBe('no_capacity');
          expect(e.placed).toBeLessThan(s.request.count);
          expect(e.summary).toContain('no capacity');
        }
      }),
      RUNS,
    );
  });

  it('caps fan-out; every destination lacking bytes gets exactly one transfer of them, from a source that holds the snapshot or receives it earlier, no faster than either link', () => {
    fc.assert(
      fc.property(scenarioArb, (s) => {
        const r = decide(s);
        if (!r.ok) return;
        const transfers = r.transferPlan?.transfers ?? [];
        const fanOut = new Map<string, number>();
        const readyAt = new Map<string, number>();
        for (const t of transfers) {
          expect(readyAt.has(t.destinationHostId)).toBe(false); // one copy per destination
          const n = (fanOut.get(t.sourceHostId) ?? 0) + 1;
          fanOut.set(t.sourceHostId, n);
          expect(n).toBeLessThanOrEqual(s.config.maxFanOut);
          const src = s.view.hosts[s.view.hostIndexById.get(t.sourceHostId) ?? -1];
          if (src?.heldSnapshots.includes('snap-a')) {
            expect(t.wave).toBe(1);
            expect(src.state).toBe('ready');
          } else {
            const srcReady = readyAt.get(t.sourceHostId);
            expect(srcReady).toBeDefined(); // received earlier in the tree
            expect(srcReady ?? Infinity).toBeLessThanOrEqual(t.startMs + EPS);
          }
          // Never faster than the slower of the source's uplink and the destination's downlink.
          const dst = s.view.hostIndexById.get(t.destinationHostId) ?? -1;
          const rate = Math.min(s.view.cols.uplink[s.view.hostIndexById.get(t.sourceHostId) ?? -1] ?? NaN, s.view.cols.downlink[dst] ?? NaN);
          expect(t.readyAtMs).toBeGreaterThanOrEqual(t.startMs + (t.bytes * 1000) / rate - EPS);
          expect(t.bytes).toBe(missingBytes(s.view.snapshots.get('snap-a') ?? null, s.view.partialHolders.get('snap-a')?.get(dst) ?? 0, false));
          readyAt.set(t.destinationHostId, t.readyAtMs);
        }
        for (const p of r.placements) {
          if (p.holdsSnapshot) continue;
          // A host that lacks bytes gets them by exactly one transfer, which its ETA counts.
          const missing = missingBytes(s.view.snapshots.get('snap-a') ?? null, s.view.partialHolders.get('snap-a')?.get(s.view.hostIndexById.get(p.hostId) ?? -1) ?? 0, false);
          expect(readyAt.has(p.hostId)).toBe(missing > 0);
          if (missing > 0) expect(readyAt.get(p.hostId)).toBe(p.score.transferMs);
        }
      }),
      RUNS,
    );
  });

  it('prefers holders: a cold host is opened only when no holder with room offers a better ETA', () => {
    fc.assert(
      fc.property(scenarioArb, (s) => {
        const r = decide(s);
        if (!r.ok) return;
        const firstCold = r.placements.find((p) => p.score.transferMs > 0);
        if (firstCold === undefined) return;
        const ids = r.placements.map((p) => p.hostId);
        for (const holder of s.view.holders.get('snap-a') ?? []) {
          const h = s.view.hosts[holder];
          if (h === undefined) continue;
          const more = estimateAssignment(s.view, s.request, [...ids, h.id], s.config);
          if (!more.ok) continue; // infeasible or full
          const next = more.placements[more.placements.length - 1];
          expect(next?.score.etaMs ?? Infinity).toBeGreaterThanOrEqual(firstCold.score.etaMs - EPS);
        }
      }),
      RUNS,
    );
  });

  /** A random feasible assignment built child by child from `picks`, or null if the walk gets stuck. */
  function randomAssignment(s: Scenario, picks: readonly number[], request: ForkRequest): string[] | null {
    const ids: string[] = [];
    const n = s.view.hosts.length;
    for (let child = 0; child < request.count; child++) {
      const start = (picks[child] ?? 0) % n;
      let chosen: string | undefined;
      for (let k = 0; k < n && chosen === undefined; k++) {
        const id = s.view.hosts[(start + k) % n]?.id ?? '';
        if (estimateAssignment(s.view, request, [...ids, id], s.config).ok) chosen = id;
      }
      if (chosen === undefined) return null;
      ids.push(chosen);
    }
    return ids;
  }

  function estimateOf(s: Scenario, r: PlacementResult): { makespanMs: number; sumEtaMs: number } {
    if (!r.ok) throw new Error(`expected a placement: ${r.explanation.summary}`);
    const e = estimateAssignment(s.view, s.request, r.placements.map((p) => p.hostId), s.config);
    if (!e.ok) throw new Error('place() result must be feasible');
    return e;
  }

  const picksArb = fc.array(fc.nat(), { minLength: 24, maxLength: 24 });

  it('is never slower to ready (makespan and total) than a random feasible placement when no transfer is needed', () => {
    // Holders only: every host's cost is independent of the others and non-decreasing per
    // sibling, so greedy takes the N cheapest child slots, which is optimal for both.
    fc.assert(
      fc.property(scenarioArb, picksArb, (s0, picks) => {
        const s: Scenario = { ...s0, request: { ...s0.request, preferences: { ...s0.request.preferences, locality: 'SAME_HOST' } } };
        const ids = randomAssignment(s, picks, s.request);
        if (ids === null) return;
        const random = estimateAssignment(s.view, s.request, ids, s.config);
        if (!random.ok) throw new Error('built assignment must be feasible');
        const mine = estimateOf(s, decide(s));
        expect(mine.makespanMs).toBeLessThanOrEqual(random.makespanMs + EPS);
        expect(mine.sumEtaMs).toBeLessThanOrEqual(random.sumEtaMs + EPS);
      }),
      RUNS,
    );
  });

  it('spills to cold hosts only when it helps: never a later finish than any random placement kept on holders', () => {
    fc.assert(
      fc.property(scenarioArb, picksArb, (s0, picks) => {
        const s: Scenario = { ...s0, request: { ...s0.request, preferences: { ...s0.request.preferences, locality: 'ANY', pinnedHostId: undefined } } };
        const holdersOnly: ForkRequest = { ...s.request, preferences: { ...s.request.preferences, locality: 'SAME_HOST' } };
        const ids = randomAssignment(s, picks, holdersOnly);
        if (ids === null) return;
        const random = estimateAssignment(s.view, s.request, ids, s.config);
        if (!random.ok) throw new Error('built assignment must be feasible');
        const mine = estimateOf(s, decide(s));
        expect(mine.makespanMs).toBeLessThanOrEqual(random.makespanMs + EPS);
      }),
      RUNS,
    );
  });

  it('sampling the fleet (holders included) never over-commits, stays deterministic and never turns a placement into no capacity', () => {
    // Threshold 1 and want = 1: every scenario is sampled, and more than 2 holders are sampled too.
    const sampling = (s: Scenario): Scenario => ({ ...s, config: compilePlacementConfig({ maxFanOut: s.config.maxFanOut, samplingThreshold: 1, sampleK: 1, sampleFactor: 0 }) });
    fc.assert(
      fc.property(scenarioArb, (s0) => {
        const s = sampling(s0);
        const r = decide(s);
        expect(r).toEqual(decide(s));
        expect(r.ok).toBe(decide(s0).ok);
        if (!r.ok) return;
        const counts = new Map<string, number>();
        for (const p of r.placements) counts.set(p.hostId, (counts.get(p.hostId) ?? 0) + 1);
        for (const [id, c] of counts) {
          const h = s.view.hosts[s.view.hostIndexById.get(id) ?? -1];
          if (h === undefined) throw new Error(`placed on unknown host ${id}`);
          expect(h.allocated.vcpus + c * s.snapshot.vmConfig.vcpus).toBeLessThanOrEqual(h.capacity.vcpus);
          expect(h.state === 'ready' && !h.cordoned && !h.draining).toBe(true);
        }
      }),
      RUNS,
    );
  });
});
