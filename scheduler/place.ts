// place(): the pure placement function (DESIGN.md decision 5).
//
//   view -> candidates (all hosts, or holders + power-of-k sample) -> feasibility
//        -> rank (estimated time to ready per child) -> select (greedy, child by child)
//        -> transfer plan (tree, fan-out capped) -> explanation
//
// No await, no I/O, no clock: time comes from request.nowMs and the view; randomness only
// from the rng argument (rngForRequest(request.id) to make a decision replayable).
import { InvalidArgumentError } from '../proto/errors.ts';
import { DEFAULT_PLACEMENT_CONFIG, type PlacementConfig } from './config.ts';
import { childEta, childScore, demandOf, etaAfter, etaTerms, type Demand, type EtaTerms } from './cost.ts';
import { canServe, SourcePool } from './transfer.ts';
import { evaluateHost, type Candidate, type DecisionContext } from './feasibility.ts';
import { buildExplanation, type Tally } from './explain.ts';
import { MinHeap } from './heap.ts';
import type { Rng } from './rng.ts';
import type {
  FilterReason,
  FleetView,
  HostColumns,
  Placement,
  PlacementRequest,
  PlacementResult,
  ScoreBreakdown,
  Spread,
  TransferPlan,
} from './types.ts';

/** Largest fork the library accepts; the service enforces tenant quotas separately. */
export const MAX_FORK_COUNT = 4096;

/** A candidate host during one plan. Invariant: 0 <= placed <= cap; transferMs is set iff opened. */
interface Slot {
  readonly cand: Candidate;
  /** min(room, maxPerHost): children this plan may put here. */
  readonly cap: number;
  readonly tie: number;
  placed: number;
  opened: boolean;
  /** When the host holds the bytes (0 if it needs none). */
  transferMs: number;
  /** ETA of the next child here; +Infinity once full. For an unopened slot, as if opened now. */
  nextEta: number;
  /** An unopened slot's first-child ETA terms other than the transfer (priced once; see coldTerms). */
  terms: EtaTerms | null;
  /** An unopened slot's first-child ETA less its source's ready time, at least (see coldFloor). */
  floor: number;
}

/** Total order used for every choice: ETA, then a seeded per-host tie key, then host index. */
function slotLess(a: Slot, b: Slot): boolean {
  if (a.nextEta !== b.nextEta) return a.nextEta < b.nextEta;
  if (a.tie !== b.tie) return a.tie < b.tie;
  return a.cand.index < b.cand.index;
}

/** Children the candidates could take, sources aside. */
function roomFor(cands: readonly Candidate[], perHost: (index: number) => number): number {
  let n = 0;
  for (const c of cands) n += Math.max(0, Math.min(c.room, perHost(c.index)));
  return n;
}

/** roomFirst's order of cold hosts (see greedy): one that can serve others, then more room, then slotLess. */
function roomier(cols: HostColumns, a: Slot, b: Slot): boolean {
  const sa = canServe(cols, a.cand.index);
  if (sa !== canServe(cols, b.cand.index)) return sa;
  if (a.cap !== b.cap) return a.cap > b.cap;
  return slotLess(a, b);
}

/** Per-host tie key from the decision's seed: random across decisions, stable within one. */
function tieKey(seed: number, index: number): number {
  let z = (seed ^ Math.imul(index + 1, 0x9e3779b1)) >>> 0;
  z = Math.imul(z ^ (z >>> 16), 0x85ebca6b);
  z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35);
  return (z ^ (z >>> 16)) >>> 0;
}

/**
 * Mutable state of one plan: assignments so far and the transfer tree. Used by the greedy
 * selector and by estimateAssignment(), so both price a host identically.
 * Invariant: a host's capacity use is (its allocated) + (children assigned here), and
 * assign() refuses a child beyond slot.cap, so a plan never over-commits a host.
 */
class PlanBuilder {
  readonly placements: Placement[] = [];
  private pool: SourcePool | null = null;

  /** `maxOpens`: at most this many slots will be opened (the children to place): the source pool needs no more holders. */
  constructor(
    private readonly ctx: DecisionContext,
    private readonly config: PlacementConfig,
    private readonly spread: Spread,
    private readonly maxOpens: number,
  ) {}

  get demand(): Demand {
    return this.ctx.demand;
  }

  get cols(): HostColumns {
    return this.ctx.view.cols;
  }

  needsTransfer(slot: Slot): boolean {
    return !slot.cand.holds && slot.cand.missingBytes > 0;
  }

  private sources(): SourcePool {
    if (this.pool === null) {
      const snap = this.ctx.demand.snapshot;
      if (snap === null) throw new Error('PlanBuilder: transfer without a snapshot');
      this.pool = new SourcePool(snap.id, snap.totalBytes, this.config.maxFanOut, this.ctx.view, this.ctx.view.holders.get(snap.id) ?? [], this.maxOpens);
    }
    return this.pool;
  }

  /** Arrival time of the bytes if the slot were opened now; Infinity without a source. */
  previewArrival(slot: Slot): number {
    if (!this.needsTransfer(slot)) return 0;
    return this.sources().readyAtIfOpened(slot.cand.index, slot.cand.missingBytes);
  }

  /** First-child ETA on a host that needs no bytes (same value open() then computes). */
  firstEtaWarm(c: Candidate): number {
    return childEta(this.ctx.demand, this.ctx.view.cols, c.index, 0, 0, this.spread, this.config);
  }

  /** The slot's first-child ETA terms after the transfer: previewing it is then etaAfter(arrival, terms). */
  coldTerms(slot: Slot): EtaTerms {
    return (slot.terms ??= etaTerms(this.ctx.demand, this.ctx.view.cols, slot.cand.index, 0, this.spread, this.config));
  }

  /**
   * A cold slot's first-child ETA is never below (source's ready time) + this floor, whichever
   * source serves it: its bytes cannot arrive faster than over its own downlink.
   */
  coldFloor(slot: Slot): number {
    const t = this.coldTerms(slot);
    return (slot.cand.missingBytes * 1000) / (this.ctx.view.cols.downlink[slot.cand.index] as number) + (t[0] + t[1] + t[2] + t[3] + t[4]);
  }

  /** When the source the next cold host would get holds the bytes; Infinity when none can serve. */
  nextSourceReadyAt(): number {
    return this.sources().nextReadyAtMs();
  }

  eta(slot: Slot, j: number): number {
    return childEta(this.ctx.demand, this.ctx.view.cols, slot.cand.index, j, slot.transferMs, this.spread, this.config);
  }

  /** Opens the slot (committing its transfer, if any). False if no source can serve it. */
  open(slot: Slot): boolean {
    if (slot.opened) return true;
    if (this.needsTransfer(slot)) {
      const t = this.sources().commit(slot.cand.index, slot.cand.missingBytes);
      if (t === null) return false;
      slot.transferMs = t.readyAtMs;
    } else {
      slot.transferMs = 0;
    }
    slot.opened = true;
    slot.nextEta = this.eta(slot, 0);
    return true;
  }

  score(slot: Slot, j: number): ScoreBreakdown {
    return childScore(this.ctx.demand, this.ctx.view.cols, slot.cand.index, j, slot.transferMs, this.spread, this.config);
  }

  /** Places one child on an opened slot with room. */
  assign(slot: Slot): void {
    if (!slot.opened || slot.placed >= slot.cap) throw new Error('PlanBuilder.assign: slot not open or full');
    this.placements.push({
      childIndex: this.placements.length,
      hostId: slot.cand.host.id,
      holdsSnapshot: slot.cand.holds,
      score: this.score(slot, slot.placed),
    });
    slot.placed++;
    slot.nextEta = slot.placed < slot.cap ? this.eta(slot, slot.placed) : Number.POSITIVE_INFINITY;
  }

  transferPlan(): TransferPlan | null {
    const snap = this.ctx.demand.snapshot;
    if (snap === null || this.pool === null || this.pool.transfers.length === 0) return null;
    return { snapshotId: snap.id, maxFanOut: this.config.maxFanOut, transfers: [...this.pool.transfers] };
  }
}

function validate(request: PlacementRequest): void {
  if (typeof request.id !== 'string' || request.id.length === 0) throw new InvalidArgumentError('id', 'must be a non-empty string');
  if (!Number.isFinite(request.nowMs)) throw new InvalidArgumentError('now_ms', 'must be a finite number');
  if (request.kind === 'create') {
    const r = request.resources;
    if (!(Number.isInteger(r.vcpus) && r.vcpus >= 1)) throw new InvalidArgumentError('resources.vcpus', 'must be an integer >= 1');
    if (!(r.memoryMib > 0 && Number.isFinite(r.memoryMib))) throw new InvalidArgumentError('resources.memory_mib', 'must be > 0');
    if (!(r.diskMib >= 0 && Number.isFinite(r.diskMib))) throw new InvalidArgumentError('resources.disk_mib', 'must be >= 0');
  } else {
    if (request.snapshotId.length === 0) throw new InvalidArgumentError('snapshot_id', 'must be non-empty');
    if (!(request.overlayDiskMib >= 0 && Number.isFinite(request.overlayDiskMib))) throw new InvalidArgumentError('overlay_disk_mib', 'must be >= 0');
    if (request.kind === 'fork' && !(Number.isInteger(request.count) && request.count >= 1 && request.count <= MAX_FORK_COUNT)) {
      throw new InvalidArgumentError('count', `must be an integer in [1, ${MAX_FORK_COUNT}]`);
    }
  }
  const max = request.preferences?.maxPerHost;
  if (max !== undefined && !(Number.isInteger(max) && max >= 1)) throw new InvalidArgumentError('preferences.max_per_host', 'must be an integer >= 1');
}

const NO_HOSTS: ReadonlySet<number> = new Set();

interface Context {
  readonly ctx: DecisionContext;
  readonly spread: Spread;
  /** Children this request may put on the host at this index: maxPerHost less the fork's siblings there. */
  readonly perHost: (index: number) => number;
}

/** Builds the per-decision context, or null if the request names a snapshot the view lacks. */
function contextFor(view: FleetView, request: PlacementRequest, config: PlacementConfig): Context | null {
  validate(request);
  const snapshot = request.kind === 'create' ? null : (view.snapshots.get(request.snapshotId) ?? null);
  if (request.kind !== 'create' && snapshot === null) return null;
  const demand = demandOf(view, request, snapshot, config);
  const prefs = request.preferences ?? {};
  const holderList = snapshot === null ? [] : (view.holders.get(snapshot.id) ?? []);
  const pinnedId = prefs.pinnedHostId;
  const ctx: DecisionContext = {
    view,
    demand,
    locality: prefs.locality ?? 'ANY',
    pinnedIndex: pinnedId === undefined ? -1 : (view.hostIndexById.get(pinnedId) ?? -2),
    avoided: prefs.avoidHostIds === undefined || prefs.avoidHostIds.length === 0 ? NO_HOSTS : new Set(prefs.avoidHostIds.flatMap((id) => view.hostIndexById.get(id) ?? [])),
    holderSet: snapshot === null ? NO_HOSTS : (view.holderSets.get(snapshot.id) ?? NO_HOSTS),
    partial: snapshot === null ? undefined : view.partialHolders.get(snapshot.id),
    hasSource: holderList.some((i) => canServe(view.cols, i)),
    compat: new Uint8Array(view.vmmProfiles.length),
    vmmRequirement: request.kind === 'create' ? request.vmm : undefined,
  };
  const maxPerHost = prefs.maxPerHost ?? Number.POSITIVE_INFINITY;
  const siblings = request.kind === 'fork' ? request.siblingsPerHost : undefined;
  const perHost = siblings === undefined || siblings.size === 0 ? () => maxPerHost : (index: number) => maxPerHost - (siblings.get(view.hosts[index]?.id ?? '') ?? 0);
  return { ctx, spread: prefs.spread ?? 'PACK', perHost };
}

function makeSlot(cand: Candidate, perHost: number, tie: number): Slot {
  return { cand, cap: Math.min(cand.room, perHost), tie, placed: 0, opened: false, transferMs: 0, nextEta: Number.POSITIVE_INFINITY, terms: null, floor: 0 };
}

/**
 * Greedy selection: each child goes where its estimated time to ready is smallest. Hosts
 * that need no bytes (holders) are open from the start; a cold host is opened (its
 * transfer committed to the best source) only when its first child is the best choice, so
 * holders fill first while they have room and their ETA is better. Per host the score is
 * non-decreasing in siblings placed, so for hosts whose costs do not interact this picks
 * the N cheapest child slots, which minimises both the sum and the max of ETAs.
 *
 * Pruning (exact): only the `count` best warm hosts by first-child ETA can ever be chosen.
 * Before each of the `count` picks at most count-1 hosts have been touched, so one of those
 * best hosts still offers its first child, which orders before any pruned host's.
 *
 * `roomFirst`: the cold host to open next is one that can serve others in turn, then the one
 * with the most room, then the best ETA. When sources are scarce (each serves maxFanOut
 * hosts, and a host that cannot upload serves none), opening the cheapest cold host first can
 * spend the last source on a host that cannot pass the bytes on, or has room for one child,
 * while another goes without: a fork that fits fails as "no capacity". A host that serves
 * never leaves fewer sources than it took. place() runs this pass only when the first fell short.
 */
function greedy(plan: PlanBuilder, cands: readonly Candidate[], count: number, perHost: (index: number) => number, seed: number, roomFirst = false): void {
  // Warm hosts: rank by first-child ETA without allocating, keep the best `count`.
  const warm: Candidate[] = [];
  const unopened: Slot[] = [];
  for (const c of cands) {
    if (perHost(c.index) <= 0) continue; // the fork's siblings there already fill maxPerHost
    if (!c.holds && c.missingBytes > 0) unopened.push(makeSlot(c, perHost(c.index), tieKey(seed, c.index)));
    else warm.push(c);
  }
  const eta0 = new Float64Array(warm.length);
  const ties = new Uint32Array(warm.length);
  const order: number[] = [];
  for (let k = 0; k < warm.length; k++) {
    const c = warm[k] as Candidate;
    eta0[k] = plan.firstEtaWarm(c);
    ties[k] = tieKey(seed, c.index);
    order.push(k);
  }
  if (order.length > count) {
    order.sort((a, b) => (eta0[a] as number) - (eta0[b] as number) || (ties[a] as number) - (ties[b] as number) || (warm[a] as Candidate).index - (warm[b] as Candidate).index);
    order.length = count;
  }
  // Cold hosts in order of their ETA floor: a re-pricing pass stops at the first that cannot win.
  for (const s of unopened) s.floor = plan.coldFloor(s);
  unopened.sort((a, b) => a.floor - b.floor);
  const open = new MinHeap<Slot>(slotLess);
  for (const k of order) {
    const s = makeSlot(warm[k] as Candidate, perHost((warm[k] as Candidate).index), ties[k] as number);
    plan.open(s);
    open.push(s);
  }

  let bestCold: Slot | null = null;
  let coldDirty = true;
  for (let child = 0; child < count; child++) {
    if (coldDirty) {
      // The pool changed (or this is the first pick): re-price the cold hosts as if opened now
      // (only the arrival changes: the other terms are priced once, and etaAfter equals eta(s, 0)),
      // until a host's floor is above the best ETA found (a margin covers rounding: the floor
      // adds the same numbers in another order).
      bestCold = null;
      const readyAt = unopened.length > 0 ? plan.nextSourceReadyAt() : Number.POSITIVE_INFINITY;
      for (const s of unopened) {
        if (readyAt === Number.POSITIVE_INFINITY) break;
        if (!roomFirst && bestCold !== null && readyAt + s.floor - bestCold.nextEta > 1e-9 * (Math.abs(bestCold.nextEta) + 1)) break;
        const arrival = plan.previewArrival(s);
        if (arrival === Number.POSITIVE_INFINITY) continue;
        s.transferMs = arrival;
        s.nextEta = etaAfter(arrival, plan.coldTerms(s));
        if (bestCold === null || (roomFirst ? roomier(plan.cols, s, bestCold) : slotLess(s, bestCold))) bestCold = s;
      }
      coldDirty = false;
    }
    const warm = open.peek();
    if (bestCold !== null && (warm === undefined || slotLess(bestCold, warm))) {
      const s = bestCold;
      unopened.splice(unopened.indexOf(s), 1);
      bestCold = null;
      coldDirty = true;
      if (!plan.open(s)) break;
      plan.assign(s);
      if (s.placed < s.cap) open.push(s);
    } else if (warm !== undefined) {
      open.pop();
      plan.assign(warm);
      if (warm.placed < warm.cap) open.push(warm);
    } else {
      break;
    }
  }
}

interface Examined {
  readonly cands: Candidate[];
  readonly tally: Tally;
}

function newTally(): Tally {
  return { examined: 0, filtered: {} };
}

function examine(ctx: DecisionContext, index: number, out: Examined): boolean {
  if (index < 0 || index >= ctx.view.hosts.length) return false;
  out.tally.examined++;
  const r = evaluateHost(index, ctx);
  if (typeof r === 'string') {
    out.tally.filtered[r] = (out.tally.filtered[r] ?? 0) + 1;
    return false;
  }
  out.cands.push(r);
  return true;
}

function fullScan(ctx: DecisionContext): Examined {
  const out: Examined = { cands: [], tally: newTally() };
  for (let i = 0; i < ctx.view.hosts.length; i++) examine(ctx, i, out);
  return out;
}

/**
 * Examines every host in `list` when it has at most 2 * want, else random ones from it until
 * `want` feasible are found or want * sampleAttemptsPerHost draws are spent.
 */
function examineSome(ctx: DecisionContext, list: readonly number[], want: number, config: PlacementConfig, rng: Rng, out: Examined): void {
  if (list.length <= 2 * want) {
    for (const i of list) examine(ctx, i, out);
    return;
  }
  const drawn = new Set<number>();
  let attempts = want * config.sampleAttemptsPerHost;
  let found = 0;
  while (found < want && attempts-- > 0) {
    const k = rng.nextInt(list.length);
    if (drawn.has(k)) continue;
    drawn.add(k);
    if (examine(ctx, list[k] as number, out)) found++;
  }
}

/**
 * Power-of-k candidates: the snapshot's full holders, then its partial holders (each set
 * whole when it has at most 2 * want hosts, else a sample of `want` feasible ones), plus
 * random other hosts until want = max(sampleK, sampleFactor * count) feasible ones are found
 * or the draw budget is spent. O(k) instead of O(hosts): a snapshot held by 5% of 10,000
 * hosts costs no more to place than one held by 100.
 */
function sample(ctx: DecisionContext, count: number, config: PlacementConfig, rng: Rng): Examined {
  const out: Examined = { cands: [], tally: newTally() };
  const snap = ctx.demand.snapshot;
  const want = Math.max(config.sampleK, Math.ceil(config.sampleFactor * count));
  if (snap !== null) {
    examineSome(ctx, ctx.view.holders.get(snap.id) ?? [], want, config, rng, out);
    if (ctx.partial !== undefined) examineSome(ctx, [...ctx.partial.keys()], want, config, rng, out); // partial holders are never full holders
  }
  if (snap !== null && ctx.locality === 'SAME_HOST') return out;
  const n = ctx.view.hosts.length;
  let attempts = want * config.sampleAttemptsPerHost;
  let found = 0;
  const drawn = new Set<number>();
  while (found < want && attempts-- > 0) {
    const i = rng.nextInt(n);
    if (drawn.has(i) || ctx.holderSet.has(i) || ctx.partial?.has(i) === true) continue;
    drawn.add(i);
    if (examine(ctx, i, out)) found++;
  }
  return out;
}

/**
 * Decides where a request's VMs go. Pure: same (view, request, rng state, config) gives the
 * same result. Never throws for lack of capacity (returns ok: false with an explanation);
 * throws InvalidArgumentError for malformed requests.
 */
export function place(view: FleetView, request: PlacementRequest, rng: Rng, config: PlacementConfig = DEFAULT_PLACEMENT_CONFIG): PlacementResult {
  const c = contextFor(view, request, config);
  const count = request.kind === 'fork' ? request.count : 1;
  if (c === null) {
    const explanation = buildExplanation({ view, request, tally: newTally(), feasible: 0, sampled: false, fallbackFullScan: false, requested: count, placements: [], unknownSnapshot: true });
    return { ok: false, reason: 'unknown_snapshot', explanation };
  }
  const { ctx, spread, perHost } = c;
  const n = view.hosts.length;

  let ex: Examined;
  let sampled = false;
  if (ctx.pinnedIndex !== -1) {
    ex = { cands: [], tally: newTally() };
    if (ctx.pinnedIndex >= 0) examine(ctx, ctx.pinnedIndex, ex);
    const others = ctx.pinnedIndex >= 0 ? n - 1 : n;
    if (others > 0) {
      ex.tally.filtered.not_pinned = (ex.tally.filtered.not_pinned ?? 0) + others;
      ex.tally.examined += others;
    }
  } else if (n > config.samplingThreshold) {
    ex = sample(ctx, count, config, rng);
    sampled = true;
  } else {
    ex = fullScan(ctx);
  }

  const seed = rng.nextU32();
  let plan = new PlanBuilder(ctx, config, spread, count);
  greedy(plan, ex.cands, count, perHost, seed);
  let fallbackFullScan = false;
  if (sampled && plan.placements.length < count) {
    // The sample was too small or unlucky; a miss must not become a false "no capacity".
    fallbackFullScan = true;
    ex = fullScan(ctx);
    plan = new PlanBuilder(ctx, config, spread, count);
    greedy(plan, ex.cands, count, perHost, seed);
  }
  if (plan.placements.length < count && roomFor(ex.cands, perHost) >= count) {
    // Short, though the candidates have room: maybe by spending scarce sources on hosts that
    // cannot pass the bytes on or take few children (greedy's roomFirst). Not when the room
    // itself is short: no pass can place it, and this one prices every cold host per pick.
    const roomy = new PlanBuilder(ctx, config, spread, count);
    greedy(roomy, ex.cands, count, perHost, seed, true);
    if (roomy.placements.length > plan.placements.length) plan = roomy;
  }

  const ok = plan.placements.length === count;
  const explanation = buildExplanation({
    view,
    request,
    tally: ex.tally,
    feasible: ex.cands.length,
    sampled,
    fallbackFullScan,
    requested: count,
    placements: plan.placements,
    unknownSnapshot: false,
  });
  if (!ok) return { ok: false, reason: 'no_capacity', explanation };
  return { ok: true, placements: plan.placements, transferPlan: plan.transferPlan(), explanation };
}

export type AssignmentEstimate =
  | { readonly ok: true; readonly placements: readonly Placement[]; readonly transferPlan: TransferPlan | null; readonly makespanMs: number; readonly sumEtaMs: number }
  | { readonly ok: false; readonly hostId: string; readonly reason: FilterReason | 'unknown_host' | 'unknown_snapshot' | 'host_full' | 'no_transfer_source' };

/**
 * Prices a given assignment (child i goes to hostIds[i]) with exactly the cost model and
 * transfer planner place() uses; cold hosts are opened in order of first appearance. For
 * "what-if" runs and for checking place() against alternatives. Reports the first
 * infeasible child instead of over-committing.
 */
export function estimateAssignment(
  view: FleetView,
  request: PlacementRequest,
  hostIds: readonly string[],
  config: PlacementConfig = DEFAULT_PLACEMENT_CONFIG,
): AssignmentEstimate {
  const c = contextFor(view, request, config);
  if (c === null) return { ok: false, hostId: '', reason: 'unknown_snapshot' };
  const plan = new PlanBuilder(c.ctx, config, c.spread, hostIds.length);
  const slots = new Map<string, Slot>();
  for (const id of hostIds) {
    let slot = slots.get(id);
    if (slot === undefined) {
      const idx = view.hostIndexById.get(id);
      const host = idx === undefined ? undefined : view.hosts[idx];
      if (host === undefined) return { ok: false, hostId: id, reason: 'unknown_host' };
      const r = evaluateHost(idx as number, c.ctx);
      if (typeof r === 'string') return { ok: false, hostId: id, reason: r };
      slot = makeSlot(r, c.perHost(idx as number), 0);
      slots.set(id, slot);
      if (!plan.open(slot)) return { ok: false, hostId: id, reason: 'no_transfer_source' };
    }
    if (slot.placed >= slot.cap) return { ok: false, hostId: id, reason: 'host_full' };
    plan.assign(slot);
  }
  let makespanMs = 0;
  let sumEtaMs = 0;
  for (const p of plan.placements) {
    makespanMs = Math.max(makespanMs, p.score.etaMs);
    sumEtaMs += p.score.etaMs;
  }
  return { ok: true, placements: plan.placements, transferPlan: plan.transferPlan(), makespanMs, sumEtaMs };
}
