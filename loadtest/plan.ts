// Capacity planning: the load-test scenarios against a simulated fleet of thousands of hosts.
// A discrete-event simulation: forks arrive (Poisson, seeded, the same for every fleet size),
// the real placement library (scheduler/ place()) picks hosts from a fleet view refreshed every
// `viewRefreshMs` of simulated time, and each child's time to ready is drawn from a measured run:
//   - on a host holding the snapshot: a fork_same_host_1 sample;
//   - on a host that lacks it, as the executor's restoreRound decides (ADR 0015): where a fork
//     sends to at most 4 hosts lacking the snapshot, a host getting at most
//     `migrateMaxChildren` (FF_MIGRATE_MAX_CHILDREN, 2) of its children migrates each from a
//     holder: a sample + the measured migration extra (fork_cross_host_1 p50 - fork_same_host_1
//     p50) per child, and the host does not become a holder (item 5). Any other host fetches
//     the snapshot: a sample + the measured fetch extra (fork_cross_host_4 p50 -
//     fork_same_host_4 p50, or the migration extra when the run lacks those; its wire time
//     priced at the whole snapshot where the run's samples fetched a part); later children
//     there wait for that copy, and the host is reported as holding the snapshot once it is
//     complete. Of either extra only the wire time (the bytes the scenario moved, at the run's
//     link rate) scales with the simulated link rate; the rest (TLS, QEMU, CPU) stays as
//     measured. Link loads are not modelled: every copy gets the full link rate, however
//     many its source sends at once (optimistic for a popular template with few holders);
//   - plus queueing: a host restores at most `slotsPerHost` children at once (the agents'
//     FF_STEP_CONCURRENCY, 4), each as fast as one alone: restores are not slowed by the others.
// Hosts report what agents report: their restore time (the model's same-host median) and
// their slots, which price a host's queue in place(); and the placements made since the last
// refresh count in the queue at once, as the leader counts the steps it has sent.
// The fleet starts empty: forks of the first `warmUpSeconds` (the children's lifetime + 10 s,
// so that memory is as full as it gets) load it but are not measured.
// Answers "how many hosts at what link rate for X forks/s at p95 <= Y ms". Pure, seeded.
import { MAX_FORK_COUNT, buildFleetView, place, xoshiro128ss } from '../scheduler/index.ts';
import type { HostInput, SnapshotInput } from '../scheduler/index.ts';
import type { RunResult, ScenarioResult } from './report.ts';
import { SCHEMA_VERSION, isComplete } from './report.ts';
// The executor's rule for which hosts migrate a fork's children (restoreRound's migrates()).
import { MIGRATE_MAX_HOSTS } from '../services/domain/executor.ts';

/** Input the planner cannot use (a bad option, a run without the data it needs, a target no fleet meets): the message names the flag. */
export class PlanInputError extends Error {
  override readonly name = 'PlanInputError';
}


export interface PlanOptions {
  forksPerSecond: number;
  /** Per child: a fork's children each count. */
  p95TargetMs: number;
  /** Children per fork request. */
  childrenPerFork?: number;
  /** Concurrent restores a host runs; more wait in its queue. The agents' FF_STEP_CONCURRENCY (default 4). */
  slotsPerHost?: number;
  /** Seconds of arrivals measured, after the warm-up. */
  simulatedSeconds?: number;
  /** Seconds of arrivals before the measured ones, from an empty fleet; default childLifetimeS + 10. */
  warmUpSeconds?: number;
  /** Distinct templates (snapshots) forks are drawn from, Zipf-ish popularity. */
  templates?: number;
  /** How long a child lives (holds memory) before it is destroyed. */
  childLifetimeS?: number;
  hostMemoryMib?: number;
  linkRatesGbps?: readonly number[];
  maxHosts?: number;
  viewRefreshMs?: number;
  /** FF_MIGRATE_MAX_CHILDREN (default 2): a host lacking the snapshot with at most this many of a fork's children migrates them. */
  migrateMaxChildren?: number;
  seed?: number;
}

export interface LatencyModel {
  sameHostMs: readonly number[];
  /**
   * What a fork_cross_host_1 child took beyond a same-host one (p50s), at the run's link rate,
   * ms: what a migrated child pays (that scenario migrates; ADR 0015).
   */
  transferMsAtRun: number;
  /** The part of transferMsAtRun that is wire time (bytes moved / run link rate): it scales with the link. */
  wireMsAtRun: number;
  /**
   * What a fetch of the whole snapshot adds (fork_cross_host_4 - fork_same_host_4 p50s; where
   * those samples moved a part of it, the wire part priced at all of its stored bytes); absent:
   * transferMsAtRun.
   */
  fetchMsAtRun?: number;
  /** The part of fetchMsAtRun that is wire time; absent: wireMsAtRun. */
  fetchWireMsAtRun?: number;
  runLinkGbps: number;
  /** The run the model is from: its fleet's accel (restore times under tcg are emulation's), date and git commit. */
  runAccel: string;
  runDate: string;
  runGitCommit: string;
  guestMib: number;
  source: string;
  /** p50 of fork_same_host_N children over fork_same_host_1's, for the N the run has: not applied (restores are not slowed by concurrency). */
  concurrentSlowdown?: ReadonlyArray<{ children: number; ratio: number }>;
}

export interface SimOutcome {
  hosts: number;
  linkGbps: number;
  /** Children of the forks that arrived after the warm-up, and of those, the ones not placed. */
  children: number;
  p50Ms: number;
  p95Ms: number;
  crossHostFraction: number;
  unplaced: number;
}

/** Where a search stopped early: `hosts` missed (p95 `p95Ms`), and twice as many (`doubledP95Ms`) too. */
export interface NoBetterFrom {
  hosts: number;
  p95Ms: number;
  doubledP95Ms: number;
}

export interface Plan {
  request: Required<Pick<PlanOptions, 'forksPerSecond' | 'p95TargetMs'>> & PlanOptions;
  model: LatencyModel;
  /**
   * Per link rate: the fewest hosts meeting the target, or null if none up to maxHosts.
   * `noBetterFrom`: where a null answer stopped early (searchHosts), the size whose double did
   * no better, or too little better to reach the target by maxHosts.
   */
  answers: Array<{ linkGbps: number; hosts: number | null; outcome: SimOutcome | null; noBetterFrom?: NoBetterFrom }>;
}

/** Why a scenario cannot be used: failed, stopped early, or absent. */
function whyNoData(r: ScenarioResult | undefined): string {
  return r && 'failed' in r ? `it failed: ${r.failed}` : r && 'truncated' in r ? `stopped early: ${r.truncated}` : 'no samples';
}

/** Wire time of `bytes` at `link` Gbit/s, ms. */
function wireMs(bytes: number, link: number): number {
  return ((bytes * 8) / (link * 1e9)) * 1000;
}

/** Wire time of `bytes` at the run's link rate, at most `ms`; all of `ms` without bytes. */
function wireOf(ms: number, bytes: number | undefined, link: number): number {
  return bytes !== undefined && bytes > 0 ? Math.min(ms, wireMs(bytes, link)) : ms;
}

/**
 * A fork_cross_host_4 sample that moved at least this share of the snapshot's stored bytes
 * fetched it whole (a host may hold a few of its chunks from elsewhere); one that moved less
 * fetched a part, the rest it held from an earlier snapshot of the same template.
 */
const WHOLE_FETCH_SHARE = 0.9;

export function modelFrom(run: RunResult): LatencyModel {
  if (typeof run !== 'object' || run === null || typeof run.scenarios !== 'object' || run.scenarios === null || typeof run.env !== 'object' || run.env === null) throw new PlanInputError('--from: not a load-test run\'s JSON (it has no scenarios or env)');
  // Versions 1 and 2 read alike here (a scenario without samples is no data in both: isComplete needs n > 0).
  if ((run.schema_version ?? 1) > SCHEMA_VERSION) throw new PlanInputError(`--from: the run's schema_version ${run.schema_version} is newer than this planner reads (${SCHEMA_VERSION})`);
  const same = run.scenarios.fork_same_host_1;
  const cross = run.scenarios.fork_cross_host_1;
  if (!isComplete(same)) throw new PlanInputError(`--from: the run has no complete fork_same_host_1 (${whyNoData(same)})`);
  // Without it a cross-host fork has no price: a plan that took it as free would be optimistic.
  if (!isComplete(cross)) throw new PlanInputError(`--from: the run has no complete fork_cross_host_1 (${whyNoData(cross)}), so a fork on a host lacking the snapshot cannot be priced`);
  const measured = run.samples?.fork_same_host_1?.length ? run.samples.fork_same_host_1 : undefined;
  const samples = measured ?? [same.p50_ms];
  const transfer = Math.max(0, cross.p50_ms - same.p50_ms);
  // The wire part is scaled by the run's link rate (its hosts' reported one with --api).
  const link = run.env.link_gbps;
  if (link === null || !(link > 0)) throw new PlanInputError('--from: the run\'s link rate is unknown (its hosts reported none, or differing ones), so its transfer time cannot be scaled to other link rates');
  const moved = run.phases?.fork_cross_host_1?.bytes_moved;
  const wire = wireOf(transfer, moved, link);
  // fork_cross_host_1 migrates its one child (ADR 0015); a run whose phases say it did not
  // (an older run, or FF_MIGRATE_MAX_CHILDREN=0) priced a fetch, used then for both.
  const crossMigrated = (run.phases?.fork_cross_host_1?.migrated_samples ?? 1) > 0;
  // A fetch (a host getting more children than migrate): fork_cross_host_4 puts 4 children on
  // a host lacking the snapshot, fork_same_host_4 the same on a holder; only where it fetched.
  const same4 = run.scenarios.fork_same_host_4;
  const cross4 = run.scenarios.fork_cross_host_4;
  const fetched4 = isComplete(same4) && isComplete(cross4) && (run.phases?.fork_cross_host_4?.migrated_samples ?? 0) === 0;
  const measuredFetch = fetched4 ? Math.max(0, cross4.p50_ms - same4.p50_ms) : undefined;
  const moved4 = run.phases?.fork_cross_host_4?.bytes_moved;
  // Each fork_cross_host_4 sample forks a fresh snapshot of the same template, and a host
  // fetches only the chunks it lacks: after the first sample its targets hold most of them, so
  // the median sample moved a part. A host holding none moves all of the snapshot's stored
  // bytes: the wire part is priced at those (the rest, TLS, QEMU, CPU, is kept as measured,
  // so a fetch's per-byte CPU is still that of the part).
  const stored = run.env.snapshot_stored_bytes;
  const whole = typeof stored === 'number' && stored > 0 ? stored : undefined;
  const partial = measuredFetch !== undefined && whole !== undefined && moved4 !== undefined && moved4 < WHOLE_FETCH_SHARE * whole;
  let fetch = measuredFetch;
  let fetchWire = measuredFetch !== undefined ? wireOf(measuredFetch, moved4, link) : undefined;
  if (partial) {
    // (A median of 0 bytes moved: all of the measured extra is other than wire time.)
    const rest = measuredFetch - (moved4 > 0 ? fetchWire! : 0);
    fetchWire = wireMs(whole, link);
    fetch = rest + fetchWire;
  }
  const mib = (bytes: number): string => (bytes / 1048576).toFixed(1);
  const scaled = (bytes: number | undefined): string => (bytes !== undefined && bytes > 0 ? `of which ${mib(bytes)} MiB moved at the link rate scale with it` : 'all of it scaled with the link rate (the run has no bytes moved)');
  const fetchScaled = (): string => {
    if (partial) return `its wire part priced at the snapshot's whole ${mib(whole)} MiB (the run's samples moved a median of ${mib(moved4)} MiB: their hosts held chunks of an earlier snapshot), which scales with the link rate`;
    return `${scaled(moved4)}${whole === undefined ? ' (the run does not record its snapshot\'s size: whether its samples fetched it whole is unknown)' : ''}`;
  };
  const parts = [
    measured ? 'fork_same_host_1 samples' : 'fork_same_host_1 p50 as every restore (the run has no samples)',
    `${crossMigrated ? 'migration' : 'cross-host'} extra (fork_cross_host_1 - fork_same_host_1) p50, ${scaled(moved)}`,
    fetch !== undefined
      ? `fetch extra (fork_cross_host_4 - fork_same_host_4) p50, ${fetchScaled()}`
      : `fetch extra as the ${crossMigrated ? 'migration' : 'cross-host'} one (the run has no complete fork_cross_host_4 and fork_same_host_4 that fetched)`,
  ];
  const concurrentSlowdown = ([['fork_same_host_4', 4], ['fork_same_host_8', 8]] as const).flatMap(([name, children]) => {
    const r = run.scenarios[name];
    return isComplete(r) && same.p50_ms > 0 ? [{ children, ratio: Math.round((r.p50_ms / same.p50_ms) * 10) / 10 }] : [];
  });
  return {
    sameHostMs: samples, transferMsAtRun: transfer, wireMsAtRun: wire,
    ...(fetch !== undefined ? { fetchMsAtRun: fetch, fetchWireMsAtRun: fetchWire } : {}),
    runLinkGbps: link, runAccel: String(run.env.accel ?? 'unknown'), runDate: String(run.env.date ?? ''), runGitCommit: String(run.env.git_commit ?? ''),
    guestMib: run.env.guest_mib, source: parts.join('; '),
    ...(concurrentSlowdown.length ? { concurrentSlowdown } : {}),
  };
}

function percentile(sorted: readonly number[], p: number): number {
  if (sorted.length === 0) return 0;
  return sorted[Math.min(sorted.length - 1, Math.ceil((p / 100) * sorted.length) - 1)] ?? 0;
}

/**
 * Zipf-ish popularity: of `templates`, template k (0-based) with weight about 1/(k+1), for `u`
 * uniform in [0, 1). (templates + 1) ** u is in [1, templates + 1): every template can be drawn.
 */
export function pickTemplate(templates: number, u: number): number {
  return Math.max(0, Math.min(templates - 1, Math.floor((templates + 1) ** u) - 1));
}

/** What a migrated child takes beyond one on a holder, at `linkGbps`: only the wire time scales. */
export function crossHostExtraMs(model: LatencyModel, linkGbps: number): number {
  return model.transferMsAtRun - model.wireMsAtRun + model.wireMsAtRun * (model.runLinkGbps / linkGbps);
}

/** What a fetch of the snapshot takes beyond a restore on a holder, at `linkGbps`: only the wire time scales. */
export function fetchExtraMs(model: LatencyModel, linkGbps: number): number {
  const ms = model.fetchMsAtRun ?? model.transferMsAtRun;
  const wire = model.fetchWireMsAtRun ?? model.wireMsAtRun;
  return ms - wire + wire * (model.runLinkGbps / linkGbps);
}

/** The options with their defaults: what simulate() runs and formatPlan() prints. */
function withDefaults(o: PlanOptions) {
  const childLifetimeS = o.childLifetimeS ?? 30;
  return {
    childrenPerFork: o.childrenPerFork ?? 1,
    slotsPerHost: o.slotsPerHost ?? 4,
    simulatedSeconds: o.simulatedSeconds ?? 20,
    warmUpSeconds: o.warmUpSeconds ?? childLifetimeS + 10,
    templates: o.templates ?? 50,
    childLifetimeS,
    hostMemoryMib: o.hostMemoryMib ?? 65536,
    linkRatesGbps: o.linkRatesGbps ?? [1, 10, 25, 100],
    maxHosts: o.maxHosts ?? 8192,
    viewRefreshMs: o.viewRefreshMs ?? 20,
    migrateMaxChildren: o.migrateMaxChildren ?? 2,
    seed: o.seed ?? 7,
  };
}

/** A child restored from a local copy holds this share of its guest's memory (the rest is the image's, shared). */
const SHARED_CHILD_MEMORY = 0.3;

/** One fork request of the load: when it arrives, its template, and each child's same-host restore time. */
interface ForkArrival {
  readonly atMs: number;
  readonly template: number;
  readonly baseMs: readonly number[];
}

/**
 * The load, drawn from the options alone (its own RNG, seeded by `seed`), not from the fleet:
 * every fleet size and link rate sees the same forks, so two fleets differ by their placements,
 * not by their luck, which planCapacity's search relies on. Each fork draws the same numbers
 * whether or not it is placed. `parentAt[k]` places template k's parent at the same relative
 * position in every fleet (host floor(parentAt[k] * hosts)).
 */
function drawLoad(model: LatencyModel, o: PlanOptions): { parentAt: number[]; forks: ForkArrival[] } {
  const d = withDefaults(o);
  const rng = xoshiro128ss(d.seed, 0x9e3779b9, 0x85ebca6b, 1);
  const T = (d.warmUpSeconds + d.simulatedSeconds) * 1000;
  const parentAt = Array.from({ length: d.templates }, () => rng.nextFloat());
  const gap = (): number => -Math.log(1 - rng.nextFloat()) * (1000 / o.forksPerSecond);
  const forks: ForkArrival[] = [];
  for (let t = gap(); t < T; t += gap()) {
    const template = pickTemplate(parentAt.length, rng.nextFloat());
    const baseMs = Array.from({ length: d.childrenPerFork }, () => model.sameHostMs[Math.floor(rng.nextFloat() * model.sameHostMs.length)] ?? 0);
    forks.push({ atMs: t, template, baseMs });
  }
  return { parentAt, forks };
}

/**
 * A simulated host's restores. `slotFree[j]`: when restore slot j is next free. `copyAt`:
 * snapshot id -> when the host's copy is complete (0 for a template's first host); a copy
 * under way has a time still ahead.
 */
export interface SimHost {
  readonly slotFree: number[];
  readonly copyAt: Map<string, number>;
}

/**
 * Books a child placed on `host` at `t` in the earliest free slot: when it is ready, and
 * whether it was placed on a transfer. A child's step holds its slot from its start, fetching
 * included. The first child on a host without the snapshot fetches it; later children there
 * (of the same fork, or of forks placed before the copy is complete) wait for that copy rather
 * than restore from bytes that have not arrived. Both were placed on a transfer.
 * With `migrate` (executor's restoreRound: few children on the host) a child on a host that
 * does not hold a complete copy is migrated from a holder instead: it pays `transferMs` itself,
 * waits for no copy, and the host still lacks the snapshot (ADR 0015 item 5).
 */
export function bookChild(host: SimHost, snapshotId: string, t: number, baseMs: number, transferMs: number, migrate = false): { readyAtMs: number; onTransfer: boolean; migrated?: true } {
  const sl = host.slotFree;
  let j = 0;
  for (let q = 1; q < sl.length; q++) if (sl[q]! < sl[j]!) j = q;
  const start = Math.max(t, sl[j]!);
  const copy = host.copyAt.get(snapshotId);
  const migrated = migrate && !(copy !== undefined && copy <= start);
  let readyAtMs: number;
  if (migrated) readyAtMs = start + transferMs + baseMs;
  else if (copy === undefined) {
    host.copyAt.set(snapshotId, start + transferMs);
    readyAtMs = start + transferMs + baseMs;
  } else readyAtMs = Math.max(start, copy) + baseMs;
  sl[j] = readyAtMs;
  return { readyAtMs, onTransfer: copy === undefined || copy > t, ...(migrated ? { migrated } : {}) };
}

/**
 * One simulated run: `hosts` hosts at `linkGbps`. p95, p50, the cross-host fraction and the
 * unplaced children are of the forks that arrived after the warm-up, per child.
 */
export function simulate(model: LatencyModel, hosts: number, linkGbps: number, o: PlanOptions): SimOutcome {
  const d = withDefaults(o);
  const { seed, slotsPerHost: slots, templates, hostMemoryMib: memCap, viewRefreshMs: refresh } = d;
  const life = d.childLifetimeS * 1000;
  const measureFrom = d.warmUpSeconds * 1000;
  const bw = (linkGbps * 1e9) / 8;
  const migrateMs = crossHostExtraMs(model, linkGbps);
  const fetchMs = fetchExtraMs(model, linkGbps);
  const ids = Array.from({ length: hosts }, (_, i) => `h${i}`);
  const sim: SimHost[] = ids.map(() => ({ slotFree: Array.from({ length: slots }, () => 0), copyAt: new Map() }));
  const releases: Array<Array<{ at: number; mib: number }>> = ids.map(() => []);
  const allocMib = new Float64Array(hosts);
  /** Finish times of every child queued or restoring on each host (place()'s inflightOps). */
  const finishes: number[][] = ids.map(() => []);
  // Each template starts on one host (where its parent ran). Its size, as place() sees it, is
  // what moves in the time the simulation charges a copy at this link rate, so place() prices
  // a copy (bytes / link rate) as the simulation charges it: a migration where every fork's
  // hosts get few enough children, else a fetch.
  const copyMs = d.childrenPerFork <= d.migrateMaxChildren ? migrateMs : fetchMs;
  const effectiveBytes = Math.max(1, (copyMs / 1000) * bw);
  const snaps: SnapshotInput[] = Array.from({ length: templates }, (_, i) => ({
    id: `tpl-${i}`, totalBytes: effectiveBytes, chunkBytes: 4 * 1048576,
    vmConfig: { qemuVersion: '8.2.0', machine: 'microvm', cpuModel: 'host', accel: 'kvm', vcpus: 1, memoryMib: model.guestMib },
  }));
  const { parentAt, forks } = drawLoad(model, o);
  for (const [k, s] of snaps.entries()) sim[Math.floor(parentAt[k]! * hosts)]!.copyAt.set(s.id, 0);
  const vmm = { qemuVersion: '8.2.2', machines: ['microvm'], cpuModels: ['host'], accel: 'kvm' as const };
  const sameP50 = percentile([...model.sameHostMs].sort((a, b) => a - b), 50);
  const lat: number[] = [];
  let cross = 0;
  let unplaced = 0;
  let nextView = 0;
  let view = buildFleetView({ revision: 0, observedAtMs: 0, hosts: [], snapshots: snaps });
  for (let req = 0; req < forks.length; req++) {
    const { atMs: t, template, baseMs } = forks[req]!;
    const measured = t >= measureFrom;
    if (t >= nextView) {
      const hs: HostInput[] = ids.map((id, i) => {
        const rel = releases[i]!;
        while (rel.length && rel[0]!.at <= t) allocMib[i] = allocMib[i]! - rel.shift()!.mib;
        const busy = (finishes[i] = finishes[i]!.filter((f) => f > t)).length;
        // Only complete copies are held, as in the real fleet view: services/domain/fleet-view.ts
        // takes a host's holdings from the snapshot's holders (the executor adds a host once the
        // step that fetched it is done) and from the snapshots its heartbeat lists as complete,
        // and sets no partialSnapshots. So to place() a copy under way is neither a holder nor a
        // transfer source, and a child placed there is priced as a new copy. Link loads are
        // not modelled (rx/txLoad 0, and every copy gets the full link rate; see formatPlan).
        const held: string[] = [];
        for (const [sid, at] of sim[i]!.copyAt) if (at <= t) held.push(sid);
        return { id, state: 'ready', cordoned: false, draining: false, capacity: { vcpus: 64, memoryMib: memCap, diskMib: 1e7 }, allocated: { vcpus: 0, memoryMib: Math.max(0, allocMib[i]!), diskMib: 0 }, inflightOps: busy, link: { bandwidthBytesPerS: bw, rxLoadBytesPerS: 0, txLoadBytesPerS: 0 }, vmm, heldSnapshots: held, restoreCostMs: sameP50, restoreSlots: slots };
      });
      view = buildFleetView({ revision: req, observedAtMs: t, hosts: hs, snapshots: snaps });
      nextView = t + refresh;
    }
    const snapshotId = `tpl-${template}`;
    const r = place(view, { kind: 'fork', id: `sim-${req}`, nowMs: t, snapshotId, count: baseMs.length, overlayDiskMib: 64 }, xoshiro128ss(seed, req + 1, 1, 2));
    if (!r.ok) {
      if (measured) unplaced += baseMs.length;
      continue;
    }
    // The executor's migrates() (services/domain/executor.ts restoreRound): the hosts the
    // transfer plan sends to lack the snapshot; where there are at most MIGRATE_MAX_HOSTS of
    // them, one getting at most migrateMaxChildren children migrates them from a holder.
    const lacking = new Set((r.transferPlan?.transfers ?? []).map((x) => x.destinationHostId));
    const perHost = new Map<string, number>();
    for (const p of r.placements) perHost.set(p.hostId, (perHost.get(p.hostId) ?? 0) + 1);
    const migrates = (h: string): boolean => lacking.size <= MIGRATE_MAX_HOSTS && lacking.has(h) && (perHost.get(h) ?? 0) <= d.migrateMaxChildren;
    for (const [k, p] of r.placements.entries()) {
      const i = view.hostIndexById.get(p.hostId)!;
      const base = baseMs[k] ?? 0;
      // Queued at once in the view (the leader's own steps), not only at the next refresh;
      // the columns are updated in place rather than the view rebuilt per request.
      view.cols.inflightOps[i] = (view.cols.inflightOps[i] as number) + 1;
      const migrate = migrates(p.hostId);
      const { readyAtMs: ready, onTransfer, migrated } = bookChild(sim[i]!, snapshotId, t, base, migrate ? migrateMs : fetchMs, migrate);
      finishes[i]!.push(ready);
      if (measured) {
        if (onTransfer) cross++;
        lat.push(ready - t);
      }
      // A migrated child's memory is its own; one restored from the host's copy shares the image's.
      const mib = migrated ? model.guestMib : model.guestMib * SHARED_CHILD_MEMORY;
      allocMib[i] = allocMib[i]! + mib;
      releases[i]!.push({ at: ready + life, mib });
    }
  }
  lat.sort((a, b) => a - b);
  return { hosts, linkGbps, children: lat.length, p50Ms: Math.round(percentile(lat, 50)), p95Ms: Math.round(percentile(lat, 95)), crossHostFraction: lat.length ? Math.round((cross / lat.length) * 1000) / 1000 : 0, unplaced };
}

/**
 * Fewest hosts in [1, maxHosts] that `ok` passes, or null: doubling, then bisection, which
 * assumes that where some hosts meet the target, more do too. Every fleet size sees the same
 * load (drawLoad), so p95 nearly falls as hosts are added; what still differs with the fleet
 * (the hosts place()'s draws land on) can let one count pass by a fluke where the next misses.
 * So an answer must be met by one host more too; a miss there resumes the search above it.
 * Either way the host count below the answer was tried and missed. `stop`, asked before each
 * doubling, ends the search with null where the sizes above are known not to help; it never
 * cuts short a bisection or the confirm, so it cannot override a size that passed.
 */
export function fewestHosts(ok: (hosts: number) => SimOutcome | null, maxHosts: number, stop: () => boolean = () => false): { hosts: number; outcome: SimOutcome } | null {
  // Invariant: every count below lo that was tried missed.
  let lo = 1;
  while (lo <= maxHosts) {
    let hi = lo;
    let best = ok(hi);
    while (!best && hi < maxHosts && !stop()) {
      lo = hi + 1;
      hi = Math.min(maxHosts, hi * 2);
      best = ok(hi);
    }
    if (!best) return null;
    while (lo < hi) {
      const mid = Math.floor((lo + hi) / 2);
      const s = ok(mid);
      if (s) {
        hi = mid;
        best = s;
      } else lo = mid + 1;
    }
    if (hi === maxHosts || ok(hi + 1)) return { hosts: hi, outcome: best };
    lo = hi + 2;
  }
  return null;
}

/**
 * planCapacity's search at one link rate: fewestHosts over `run(h)`, the outcome of h hosts
 * (null: h fails unsimulated), each size run once (simulations are deterministic). From
 * `stopFrom` hosts on, a size that misses where half as many missed ends the doubling if p95
 * did not fall at all, or fell too little per doubling to reach the target by maxHosts at that
 * rate (p95 falls ever more slowly as hosts are added, so the rate is a hopeful one): what holds
 * p95 up then is not the fleet's size, and each larger fleet would take minutes to simulate.
 * Never where a tried size above the half passed: more hosts did help there.
 */
export function searchHosts(run: (hosts: number) => SimOutcome | null, p95TargetMs: number, maxHosts: number, stopFrom: number): Omit<Plan['answers'][number], 'linkGbps'> {
  const tried = new Map<number, SimOutcome | null>();
  const missed = new Map<number, SimOutcome>();
  let noBetterFrom: NoBetterFrom | undefined;
  const ok = (h: number): SimOutcome | null => {
    let r = tried.get(h);
    if (r === undefined) {
      const s = run(h);
      r = s && s.unplaced === 0 && s.p95Ms <= p95TargetMs ? s : null;
      const half = missed.get(h / 2);
      if (s && !r) missed.set(h, s);
      // (Only below maxHosts: at it there is nothing larger left to leave unsimulated.)
      if (s && !r && half && h < maxHosts && h / 2 >= stopFrom && s.unplaced === 0 && half.unplaced === 0 && ![...tried].some(([t, x]) => x && t > h / 2)) {
        const gain = half.p95Ms - s.p95Ms;
        if (gain <= 0 || gain * Math.log2(maxHosts / h) < s.p95Ms - p95TargetMs) noBetterFrom = { hosts: h / 2, p95Ms: half.p95Ms, doubledP95Ms: s.p95Ms };
      }
      tried.set(h, r);
    }
    return r;
  };
  const a = fewestHosts(ok, maxHosts, () => noBetterFrom !== undefined);
  return { hosts: a?.hosts ?? null, outcome: a?.outcome ?? null, ...(!a && noBetterFrom ? { noBetterFrom } : {}) };
}

/** Hosts per template from which searchHosts may stop early (a template's parents on distinct hosts, nearly). */
const HOSTS_PER_TEMPLATE = 8;

/** At most this many children per simulation: the load is drawn up front. */
const MAX_SIMULATED_CHILDREN = 1_000_000;

/**
 * Checks a caller's options (the CLI parses its flags alike): a bad one is a PlanInputError
 * naming its flag, or its field where there is no flag, not a stack trace from place(), an
 * answer from a run of no seconds, or an endless loop of arrivals.
 */
function checkOptions(o: PlanOptions): void {
  const want = (ok: boolean, name: string, what: string, v: unknown): void => {
    if (!ok) throw new PlanInputError(`${name}: want ${what}, got ${String(v)}`);
  };
  const num = (v: number | undefined, name: string, min: number, int = false, above = false): void => {
    if (v !== undefined) want(Number.isFinite(v) && (above ? v > min : v >= min) && (!int || Number.isInteger(v)), name, `${int ? 'an integer' : 'a number'} ${above ? '>' : '>='} ${min}`, v);
  };
  num(o.forksPerSecond, '--forks-per-s', 0, false, true);
  want(o.forksPerSecond !== undefined, '--forks-per-s', 'a number > 0', o.forksPerSecond);
  num(o.p95TargetMs, '--p95-ms', 0, false, true);
  want(o.p95TargetMs !== undefined, '--p95-ms', 'a number > 0', o.p95TargetMs);
  num(o.childrenPerFork, '--fork-n', 1, true);
  want((o.childrenPerFork ?? 1) <= MAX_FORK_COUNT, '--fork-n', `at most ${MAX_FORK_COUNT} (place()'s largest fork)`, o.childrenPerFork);
  num(o.slotsPerHost, '--host-slots', 1, true);
  num(o.simulatedSeconds, '--seconds', 0, false, true);
  num(o.warmUpSeconds, 'warmUpSeconds', 0);
  num(o.templates, 'templates', 1, true);
  num(o.childLifetimeS, 'childLifetimeS', 0);
  num(o.hostMemoryMib, 'hostMemoryMib', 0, false, true);
  num(o.maxHosts, 'maxHosts', 1, true);
  num(o.viewRefreshMs, 'viewRefreshMs', 0);
  num(o.migrateMaxChildren, 'migrateMaxChildren', 0, true);
  const links = o.linkRatesGbps;
  if (links !== undefined) want(links.length > 0 && links.every((g) => Number.isFinite(g) && g > 0), 'linkRatesGbps', 'numbers > 0', `[${links.join(', ')}]`);
  const d = withDefaults(o);
  const children = o.forksPerSecond * d.childrenPerFork * (d.warmUpSeconds + d.simulatedSeconds);
  // The product of several options: name each the caller gave (forks/s always), not one of them.
  const factors = ['--forks-per-s', ...(o.childrenPerFork !== undefined ? ['--fork-n'] : []), ...(o.simulatedSeconds !== undefined ? ['--seconds'] : []), ...(o.warmUpSeconds !== undefined ? ['warmUpSeconds'] : [])];
  want(children <= MAX_SIMULATED_CHILDREN, factors.join(', '), `at most ${MAX_SIMULATED_CHILDREN} children (${o.forksPerSecond} forks/s x ${d.childrenPerFork} children x (${d.warmUpSeconds} s of warm-up + ${d.simulatedSeconds} s); lower one)`, `${Math.round(children)} children`);
}

/**
 * Fewest hosts whose simulated p95 meets the target, per link rate (fewestHosts). A size fails
 * without being simulated where the load alone is too much for it: its restores would keep
 * every slot busy (offered load >= 1: a queue that only grows, which a finite run hides), or
 * the children alive at once, at their shared memory, would fill it. Past HOSTS_PER_TEMPLATE
 * hosts a template, searchHosts may stop early where doubling the fleet did not help p95, or
 * too little to reach the target (a copy's price at this link rate, a popular template's few
 * holders hold it up).
 */
export function planCapacity(run: RunResult, o: PlanOptions): Plan {
  checkOptions(o);
  const model = modelFrom(run);
  // No fleet is faster than a restore on a holder with nothing queued: say so rather than "> maxHosts".
  const floor = percentile([...model.sameHostMs].sort((a, b) => a - b), 95);
  if (o.p95TargetMs < floor) throw new PlanInputError(`--p95-ms: ${o.p95TargetMs} ms is below the run's same-host p95 (${floor} ms, fork_same_host_1), which no fleet size beats`);
  const d = withDefaults(o);
  const mean = model.sameHostMs.reduce((a, b) => a + b, 0) / model.sameHostMs.length;
  const busySlots = (o.forksPerSecond * d.childrenPerFork * mean) / 1000;
  const aliveMib = o.forksPerSecond * d.childrenPerFork * d.childLifetimeS * model.guestMib * SHARED_CHILD_MEMORY;
  const answers: Plan['answers'] = [];
  for (const g of d.linkRatesGbps) {
    const sim = (h: number): SimOutcome | null => (busySlots >= h * d.slotsPerHost || aliveMib >= h * d.hostMemoryMib ? null : simulate(model, h, g, o));
    answers.push({ linkGbps: g, ...searchHosts(sim, o.p95TargetMs, d.maxHosts, HOSTS_PER_TEMPLATE * d.templates) });
  }
  return { request: { ...o }, model, answers };
}

export function formatPlan(p: Plan): string {
  const r = p.request;
  const d = withDefaults(r);
  const m = p.model;
  const slowdown = m.concurrentSlowdown?.length ? ` (in the run, ${m.concurrentSlowdown.map((x) => `fork_same_host_${x.children} children took ${x.ratio}x`).join(' and ')} a fork_same_host_1 p50)` : '';
  const lines = [
    `Capacity plan: ${r.forksPerSecond} forks/s x ${d.childrenPerFork} children, p95 per child <= ${r.p95TargetMs} ms (slots/host ${d.slotsPerHost}, ${d.templates} templates, ${d.warmUpSeconds} s warm-up + ${d.simulatedSeconds} s measured)`,
    `model from the run of ${m.runDate || 'an unknown date'} (git ${m.runGitCommit || 'unknown'}, fleet accel ${m.runAccel}): ${m.source}; same-host median ${percentile([...m.sameHostMs].sort((a, b) => a - b), 50)} ms, migration extra ${Math.round(m.transferMsAtRun)} ms (${Math.round(m.wireMsAtRun)} ms of it wire time), fetch extra ${Math.round(m.fetchMsAtRun ?? m.transferMsAtRun)} ms (${Math.round(m.fetchWireMsAtRun ?? m.wireMsAtRun)} ms wire), at ${m.runLinkGbps} Gbit/s`,
    `assumed: ${d.slotsPerHost} restores at once per host (${r.slotsPerHost === undefined ? "the agents' FF_STEP_CONCURRENCY default; --host-slots to change" : '--host-slots'}), each as fast as one alone: restore times are not scaled with concurrency${slowdown}`,
    `assumed: a host lacking the snapshot that gets at most ${d.migrateMaxChildren} of a fork's children (FF_MIGRATE_MAX_CHILDREN), in a fork sending to at most ${MIGRATE_MAX_HOSTS} such hosts, migrates each and does not become a holder; any other fetches it and holds it (ADR 0015)`,
    `assumed: children live ${d.childLifetimeS} s on hosts of ${d.hostMemoryMib} MiB, holding ${SHARED_CHILD_MEMORY * 100}% of their ${m.guestMib} MiB (migrated: all); sizes whose restores alone keep every slot busy, or whose children fill their memory, fail`,
    'not modelled: link loads: every copy gets the full link rate, however many its source sends at once (optimistic where many children migrate from a template\'s few holders)',
    '',
    'link Gbit/s   hosts     p50 ms   p95 ms   cross-host fraction',
    ...p.answers.map((a) => `${String(a.linkGbps).padEnd(12)} ${String(a.hosts ?? (a.noBetterFrom ? `> ${a.noBetterFrom.hosts * 2}` : `> ${d.maxHosts}`)).padEnd(9)} ${String(a.outcome?.p50Ms ?? '-').padEnd(8)} ${String(a.outcome?.p95Ms ?? '-').padEnd(8)} ${a.outcome?.crossHostFraction ?? '-'}`),
    ...p.answers.flatMap(({ linkGbps: g, noBetterFrom: n }) => (!n ? [] : n.doubledP95Ms >= n.p95Ms
      ? [`${g} Gbit/s: ${n.hosts * 2} hosts missed no better than ${n.hosts} (p95 ${n.doubledP95Ms} ms, ${n.p95Ms} ms at ${n.hosts}); larger fleets were not simulated (p95 may still fall at sizes the doubling skipped)`]
      : [`${g} Gbit/s: p95 fell only from ${n.p95Ms} ms at ${n.hosts} hosts to ${n.doubledP95Ms} ms at ${n.hosts * 2}: at that rate a doubling it would still miss ${r.p95TargetMs} ms at ${d.maxHosts} hosts; larger fleets were not simulated`])),
    '',
  ];
  return lines.join('\n');
}
