// Capacity planning: the load-test scenarios against a simulated fleet of thousands of hosts.
// A discrete-event simulation: forks arrive (Poisson, seeded, the same for every fleet size),
// the real placement library (scheduler/ place()) picks hosts from a fleet view refreshed every
// `viewRefreshMs` of simulated time, and each child's time to ready is drawn from a measured run:
//   - on a host holding the snapshot: a fork_same_host_1 sample;
//   - on a host that lacks it: a fork_same_host_1 sample + the measured cross-host part
//     (fork_cross_host_1 p50 - fork_same_host_1 p50) for the copy. Later children there wait
//     for that copy, and the host is reported as holding the snapshot once it is complete.
//     Of that part only the wire time (the bytes a cross-host fork moved, at the run's link
//     rate) scales with the simulated link rate; the rest (migration, TLS, CPU) stays as measured;
//   - plus queueing: a host restores at most `slotsPerHost` children at once.
// Hosts report what agents report: their restore time (the model's same-host median) and
// their slots, which price a host's queue in place(); and the placements made since the last
// refresh count in the queue at once, as the leader counts the steps it has sent.
// Answers "how many hosts at what link rate for X forks/s at p95 <= Y ms". Pure, seeded.
import { buildFleetView, place, xoshiro128ss } from '../scheduler/index.ts';
import type { HostInput, SnapshotInput } from '../scheduler/index.ts';
import type { RunResult } from './report.ts';
import { SCHEMA_VERSION, isComplete } from './report.ts';

export interface PlanOptions {
  forksPerSecond: number;
  p95TargetMs: number;
  /** Children per fork request. */
  childrenPerFork?: number;
  /** Concurrent restores a host runs; more wait in its queue. */
  slotsPerHost?: number;
  simulatedSeconds?: number;
  /** Distinct templates (snapshots) forks are drawn from, Zipf-ish popularity. */
  templates?: number;
  /** How long a child lives (holds memory) before it is destroyed. */
  childLifetimeS?: number;
  hostMemoryMib?: number;
  linkRatesGbps?: readonly number[];
  maxHosts?: number;
  viewRefreshMs?: number;
  seed?: number;
}

export interface LatencyModel {
  sameHostMs: readonly number[];
  /** What a cross-host fork took beyond a same-host one (p50s), at the run's link rate, ms. */
  transferMsAtRun: number;
  /** The part of transferMsAtRun that is wire time (bytes moved / run link rate): it scales with the link. */
  wireMsAtRun: number;
  runLinkGbps: number;
  guestMib: number;
  source: string;
}

export interface SimOutcome {
  hosts: number;
  linkGbps: number;
  children: number;
  p50Ms: number;
  p95Ms: number;
  crossHostFraction: number;
  unplaced: number;
}

export interface Plan {
  request: Required<Pick<PlanOptions, 'forksPerSecond' | 'p95TargetMs'>> & PlanOptions;
  model: LatencyModel;
  /** Per link rate: the fewest hosts meeting the target, or null if none up to maxHosts. */
  answers: Array<{ linkGbps: number; hosts: number | null; outcome: SimOutcome | null }>;
}

export function modelFrom(run: RunResult): LatencyModel {
  // Versions 1 and 2 read alike here (a scenario without samples is no data in both: isComplete needs n > 0).
  if ((run.schema_version ?? 1) > SCHEMA_VERSION) throw new Error(`--from: the run's schema_version ${run.schema_version} is newer than this planner reads (${SCHEMA_VERSION})`);
  const same = run.scenarios.fork_same_host_1;
  const cross = run.scenarios.fork_cross_host_1;
  if (!isComplete(same)) throw new Error(`--from: the run has no complete fork_same_host_1 (${same && 'failed' in same ? `it failed: ${same.failed}` : 'no samples'})`);
  // Without it a cross-host fork has no price: a plan that took it as free would be optimistic.
  if (!isComplete(cross)) throw new Error(`--from: the run has no complete fork_cross_host_1 (${cross && 'failed' in cross ? `it failed: ${cross.failed}` : cross && 'truncated' in cross ? `stopped early: ${cross.truncated}` : 'no samples'}), so a fork on a host lacking the snapshot cannot be priced`);
  const samples = run.samples?.fork_same_host_1?.length ? run.samples.fork_same_host_1 : [same.p50_ms];
  const transfer = Math.max(0, cross.p50_ms - same.p50_ms);
  // The wire part is scaled by the run's link rate (its hosts' reported one with --api).
  const link = run.env.link_gbps;
  if (link === null || !(link > 0)) throw new Error('--from: the run\'s link rate is unknown (its hosts reported none, or differing ones), so its transfer time cannot be scaled to other link rates');
  const moved = run.phases?.fork_cross_host_1?.bytes_moved;
  const wire = moved !== undefined && moved > 0 ? Math.min(transfer, ((moved * 8) / (link * 1e9)) * 1000) : transfer;
  const source =
    moved !== undefined && moved > 0
      ? `fork_same_host_1 samples + (fork_cross_host_1 - fork_same_host_1) p50, of which ${(moved / 1048576).toFixed(1)} MiB moved at the link rate scale with it`
      : 'fork_same_host_1 samples + (fork_cross_host_1 - fork_same_host_1) p50, all of it scaled with the link rate (the run has no bytes moved)';
  return { sameHostMs: samples, transferMsAtRun: transfer, wireMsAtRun: wire, runLinkGbps: link, guestMib: run.env.guest_mib, source };
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

/** What a fork on a host lacking the snapshot takes beyond one on a holder, at `linkGbps`: only the wire time scales. */
export function crossHostExtraMs(model: LatencyModel, linkGbps: number): number {
  return model.transferMsAtRun - model.wireMsAtRun + model.wireMsAtRun * (model.runLinkGbps / linkGbps);
}

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
  const rng = xoshiro128ss(o.seed ?? 7, 0x9e3779b9, 0x85ebca6b, 1);
  const n = o.childrenPerFork ?? 1;
  const T = (o.simulatedSeconds ?? 20) * 1000;
  const parentAt = Array.from({ length: o.templates ?? 50 }, () => rng.nextFloat());
  const gap = (): number => -Math.log(1 - rng.nextFloat()) * (1000 / o.forksPerSecond);
  const forks: ForkArrival[] = [];
  for (let t = gap(); t < T; t += gap()) {
    const template = pickTemplate(parentAt.length, rng.nextFloat());
    const baseMs = Array.from({ length: n }, () => model.sameHostMs[Math.floor(rng.nextFloat() * model.sameHostMs.length)] ?? 0);
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
 */
export function bookChild(host: SimHost, snapshotId: string, t: number, baseMs: number, transferMs: number): { readyAtMs: number; onTransfer: boolean } {
  const sl = host.slotFree;
  let j = 0;
  for (let q = 1; q < sl.length; q++) if (sl[q]! < sl[j]!) j = q;
  const start = Math.max(t, sl[j]!);
  const copy = host.copyAt.get(snapshotId);
  let readyAtMs: number;
  if (copy === undefined) {
    host.copyAt.set(snapshotId, start + transferMs);
    readyAtMs = start + transferMs + baseMs;
  } else readyAtMs = Math.max(start, copy) + baseMs;
  sl[j] = readyAtMs;
  return { readyAtMs, onTransfer: copy === undefined || copy > t };
}

/** One simulated run: `hosts` hosts at `linkGbps`. */
export function simulate(model: LatencyModel, hosts: number, linkGbps: number, o: PlanOptions): SimOutcome {
  const seed = o.seed ?? 7;
  const slots = o.slotsPerHost ?? 8;
  const templates = o.templates ?? 50;
  const life = (o.childLifetimeS ?? 30) * 1000;
  const memCap = o.hostMemoryMib ?? 65536;
  const refresh = o.viewRefreshMs ?? 20;
  const bw = (linkGbps * 1e9) / 8;
  const transferMs = crossHostExtraMs(model, linkGbps);
  const ids = Array.from({ length: hosts }, (_, i) => `h${i}`);
  const sim: SimHost[] = ids.map(() => ({ slotFree: Array.from({ length: slots }, () => 0), copyAt: new Map() }));
  const releases: Array<Array<{ at: number; mib: number }>> = ids.map(() => []);
  const allocMib = new Float64Array(hosts);
  /** Finish times of every child queued or restoring on each host (place()'s inflightOps). */
  const finishes: number[][] = ids.map(() => []);
  // Each template starts on one host (where its parent ran). Its size, as place() sees it, is
  // what moves in the time the simulation charges a copy at this link rate, so place() prices
  // a copy (bytes / link rate) as the simulation charges it.
  const effectiveBytes = Math.max(1, (transferMs / 1000) * bw);
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
    if (t >= nextView) {
      const hs: HostInput[] = ids.map((id, i) => {
        const rel = releases[i]!;
        while (rel.length && rel[0]!.at <= t) allocMib[i] = allocMib[i]! - rel.shift()!.mib;
        const busy = (finishes[i] = finishes[i]!.filter((f) => f > t)).length;
        // Only complete copies are held, as in the real fleet view: services/domain/fleet-view.ts
        // takes a host's holdings from the snapshot's holders (the executor adds a host once the
        // step that fetched it is done) and from the snapshots its heartbeat lists as complete,
        // and sets no partialSnapshots. So to place() a copy under way is neither a holder nor a
        // transfer source, and a child placed there is priced as a new copy.
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
      unplaced += baseMs.length;
      continue;
    }
    for (const [k, p] of r.placements.entries()) {
      const i = view.hostIndexById.get(p.hostId)!;
      const base = baseMs[k] ?? 0;
      // Queued at once in the view (the leader's own steps), not only at the next refresh;
      // the columns are updated in place rather than the view rebuilt per request.
      view.cols.inflightOps[i] = (view.cols.inflightOps[i] as number) + 1;
      const { readyAtMs: ready, onTransfer } = bookChild(sim[i]!, snapshotId, t, base, transferMs);
      if (onTransfer) cross++;
      finishes[i]!.push(ready);
      lat.push(ready - t);
      allocMib[i] = allocMib[i]! + model.guestMib * 0.3;
      releases[i]!.push({ at: ready + life, mib: model.guestMib * 0.3 });
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
 * Either way the host count below the answer was tried and missed.
 */
export function fewestHosts(ok: (hosts: number) => SimOutcome | null, maxHosts: number): { hosts: number; outcome: SimOutcome } | null {
  // Invariant: every count below lo that was tried missed.
  let lo = 1;
  while (lo <= maxHosts) {
    let hi = lo;
    let best = ok(hi);
    while (!best && hi < maxHosts) {
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

/** Fewest hosts whose simulated p95 meets the target, per link rate (fewestHosts). */
export function planCapacity(run: RunResult, o: PlanOptions): Plan {
  if (!(o.forksPerSecond > 0)) throw new Error('--forks-per-s: want a number > 0');
  if (!(o.p95TargetMs > 0)) throw new Error('--p95-ms: want a number > 0');
  const model = modelFrom(run);
  const maxHosts = o.maxHosts ?? 8192;
  const answers: Plan['answers'] = [];
  for (const g of o.linkRatesGbps ?? [1, 10, 25, 100]) {
    // Simulations are deterministic: each count is simulated once.
    const tried = new Map<number, SimOutcome | null>();
    const ok = (h: number): SimOutcome | null => {
      let r = tried.get(h);
      if (r === undefined) {
        const s = simulate(model, h, g, o);
        tried.set(h, (r = s.unplaced === 0 && s.p95Ms <= o.p95TargetMs ? s : null));
      }
      return r;
    };
    const a = fewestHosts(ok, maxHosts);
    answers.push({ linkGbps: g, hosts: a?.hosts ?? null, outcome: a?.outcome ?? null });
  }
  return { request: { ...o }, model, answers };
}

export function formatPlan(p: Plan): string {
  const r = p.request;
  const lines = [
    `Capacity plan: ${r.forksPerSecond} forks/s x ${r.childrenPerFork ?? 1} children, p95 <= ${r.p95TargetMs} ms (slots/host ${r.slotsPerHost ?? 8}, ${r.templates ?? 50} templates, ${r.simulatedSeconds ?? 20} s simulated)`,
    `model: ${p.model.source}; same-host median ${percentile([...p.model.sameHostMs].sort((a, b) => a - b), 50)} ms, cross-host extra ${Math.round(p.model.transferMsAtRun)} ms at ${p.model.runLinkGbps} Gbit/s (${Math.round(p.model.wireMsAtRun)} ms of it wire time)`,
    '',
    'link Gbit/s   hosts     p50 ms   p95 ms   cross-host fraction',
    ...p.answers.map((a) => `${String(a.linkGbps).padEnd(12)} ${String(a.hosts ?? `> ${r.maxHosts ?? 8192}`).padEnd(9)} ${String(a.outcome?.p50Ms ?? '-').padEnd(8)} ${String(a.outcome?.p95Ms ?? '-').padEnd(8)} ${a.outcome?.crossHostFraction ?? '-'}`),
    '',
  ];
  return lines.join('\n');
}
