// The cost model: what one child needs from a host (memory counts shared pages once per
// host per snapshot) and its estimated time to ready on that host.
//
// Memory of c children of a fork of snapshot S on a host h that holds S, where n children of S
// are booked already as shares of its image (HostInput.imageShares):
//   F(n + c) - F(n),  F(k) = k = 0 ? 0 : min(k * S.memoryMib, k * p + S.memoryMib),  p = ceil(S.memoryMib * privateMemoryFraction)
// (never more than c separate guests: a lone restore needs what its create did; with n = 0 this
// is min(c * memoryMib, c * p + memoryMib)). Where S's image is resident (residentImages): c * p.
// On a host that lacks S, and for a restore: c * memoryMib (n = 0 for a restore).
// Disk: c * overlayDiskMib + MiB of chunks h lacks (fetched into its chunk cache).
// A create has no sharing: c * memoryMib, c * diskMib.
import type { PlacementConfig } from './config.ts';
import type { FleetView, HostColumns, PlacementRequest, ScoreBreakdown, SnapshotView, Spread } from './types.ts';

const MIB = 1024 * 1024;

/** Per-request demand, derived once per decision. Invariant: all fields >= 0, vcpus >= 1 or memory > 0. */
export interface Demand {
  readonly kind: PlacementRequest['kind'];
  readonly count: number;
  readonly vcpus: number;
  /** Memory each child uses privately (whole guest for create). */
  readonly privateMemoryMib: number;
  /** Shared memory image paid once per host per snapshot (0 for create). */
  readonly imageMib: number;
  readonly overlayDiskMib: number;
  readonly snapshot: SnapshotView | null;
  /** Host index -> children of the snapshot booked there as shares of its image (Infinity: resident, the image is paid). */
  readonly shares: ReadonlyMap<number, number>;
  /** Hosts holding the snapshot: a fork's children share its image only there (elsewhere each is a whole guest). */
  readonly holders: ReadonlySet<number>;
}

const NONE: ReadonlyMap<number, number> = new Map();
const NO_HOSTS: ReadonlySet<number> = new Set();

export function demandOf(view: FleetView, request: PlacementRequest, snapshot: SnapshotView | null, config: PlacementConfig): Demand {
  if (request.kind === 'create') {
    return {
      kind: 'create',
      count: 1,
      vcpus: request.resources.vcpus,
      privateMemoryMib: request.resources.memoryMib,
      imageMib: 0,
      overlayDiskMib: request.resources.diskMib,
      snapshot: null,
      shares: NONE,
      holders: NO_HOSTS,
    };
  }
  if (snapshot === null) throw new Error('demandOf: fork/restore needs its snapshot');
  return {
    kind: request.kind,
    count: request.kind === 'fork' ? request.count : 1,
    vcpus: snapshot.vmConfig.vcpus,
    privateMemoryMib: Math.ceil(snapshot.vmConfig.memoryMib * config.privateMemoryFraction),
    imageMib: snapshot.vmConfig.memoryMib,
    overlayDiskMib: request.overlayDiskMib,
    snapshot,
    shares: view.residentHosts.get(snapshot.id) ?? NONE,
    holders: view.holderSets.get(snapshot.id) ?? NO_HOSTS,
  };
}

/** Bytes of the snapshot that host lacks, rounded up to whole chunks. 0 for holders and for create. */
export function missingBytes(snapshot: SnapshotView | null, present: number, holds: boolean): number {
  if (snapshot === null || holds) return 0;
  const missing = Math.max(0, snapshot.totalBytes - present);
  return Math.min(snapshot.totalBytes, Math.ceil(missing / snapshot.chunkBytes) * snapshot.chunkBytes);
}

/**
 * Memory c children need on host i (c >= 1): their private pages plus the shared image, but
 * never more than c whole guests. Each child's private pages are at most its guest's memory
 * and the image's page cache is clean (reclaimable), which is how a create of the same guest
 * is charged: so a lone restore needs memoryMib, as its create did, and a sandbox that was
 * created on the largest host can always be woken or moved back onto one like it.
 */
export function memoryFor(d: Demand, i: number, c: number): number {
  if (d.imageMib <= 0) return c * d.privateMemoryMib;
  const [full, shared] = imageLines(d, i);
  return Math.min(full + c * d.imageMib, shared + c * d.privateMemoryMib);
}

/**
 * memoryFor(d, i, c) is the smaller of two lines in c: [fixed part of c whole guests, fixed part
 * of c private shares], F(n + c) - F(n) written out. For n = 0: [0, the image]; resident: the
 * whole-guest line never applies, and the image is paid.
 */
function imageLines(d: Demand, i: number): readonly [number, number] {
  // A fork's children share the image only on a host that holds it (the service books them so:
  // one that fetches may restore each by migration, with RAM of its own); elsewhere, and for
  // any restore, a child is a whole guest's memory (for a lone restore, F(1) is that too), also
  // where the image is resident: the service books such a restore whole.
  if (d.kind === 'fork' && !d.holders.has(i)) return [0, Number.POSITIVE_INFINITY];
  const n = d.kind === 'fork' ? (d.shares.get(i) ?? 0) : 0;
  if (n === Number.POSITIVE_INFINITY) return [Number.POSITIVE_INFINITY, 0];
  const fn = n === 0 ? 0 : Math.min(n * d.imageMib, n * d.privateMemoryMib + d.imageMib);
  return [n * d.imageMib - fn, n * d.privateMemoryMib + d.imageMib - fn];
}

export function diskFor(d: Demand, missing: number, c: number): number {
  return c * d.overlayDiskMib + Math.ceil(missing / MIB);
}

export type ResourceShortfall = 'insufficient_vcpu' | 'insufficient_memory' | 'insufficient_disk';

/**
 * Largest c such that c children fit on the host, or the resource that rules out even one.
 * Invariant used by the planner: c children fit iff c <= room (each resource is monotone in c).
 */
export function roomFor(d: Demand, cols: HostColumns, i: number, missing: number): number | ResourceShortfall {
  const cpu = countThatFits((cols.capVcpus[i] as number) - (cols.allocVcpus[i] as number), 0, d.vcpus);
  if (cpu < 1) return 'insufficient_vcpu';
  const freeMemory = (cols.capMemoryMib[i] as number) - (cols.allocMemoryMib[i] as number);
  // memoryFor is the smaller of two lines in c: c fit when either line fits.
  let mem: number;
  if (d.imageMib > 0) {
    const [full, shared] = imageLines(d, i);
    mem = Math.max(countThatFits(freeMemory, shared, d.privateMemoryMib), countThatFits(freeMemory, full, d.imageMib));
  } else mem = countThatFits(freeMemory, 0, d.privateMemoryMib);
  if (mem < 1) return 'insufficient_memory';
  const disk = countThatFits((cols.capDiskMib[i] as number) - (cols.allocDiskMib[i] as number), Math.ceil(missing / MIB), d.overlayDiskMib);
  if (disk < 1) return 'insufficient_disk';
  return Math.min(cpu, mem, disk);
}

/** Largest c with fixed + c * per <= free (-1 if even fixed does not fit). */
function countThatFits(free: number, fixed: number, per: number): number {
  const x = free - fixed;
  if (x < 0) return -1;
  if (per <= 0) return Number.POSITIVE_INFINITY;
  let c = Math.floor(x / per);
  // Guard float rounding in both directions: c * per <= x < (c + 1) * per.
  if ((c + 1) * per <= x) c++;
  if (c * per > x) c--;
  return c;
}

/** Utilisation (max of vCPU and memory fraction) with c children of this request added. */
function utilisation(d: Demand, cols: HostColumns, i: number, c: number): number {
  const capV = cols.capVcpus[i] as number;
  const capM = cols.capMemoryMib[i] as number;
  const cpu = capV > 0 ? ((cols.allocVcpus[i] as number) + c * d.vcpus) / capV : 1;
  const memAdd = c > 0 ? memoryFor(d, i, c) : 0;
  const mem = capM > 0 ? ((cols.allocMemoryMib[i] as number) + memAdd) / capM : 1;
  return Math.min(1, Math.max(cpu, mem));
}

/**
 * Score of the (j+1)-th child of this request on the host (j siblings already placed there
 * in this plan), given when the host will hold the bytes. Every term is constant or
 * non-decreasing in j, which is what makes greedy selection exact for independent hosts.
 */
export function childScore(d: Demand, cols: HostColumns, i: number, j: number, transferMs: number, spread: Spread, config: PlacementConfig): ScoreBreakdown {
  const restoreMs = restoreCost(d, cols, i, config);
  const queueMs = ((cols.inflightOps[i] as number) + j) * queuePerOp(cols, i, config);
  const loadMs = config.loadWeightMs * utilisation(d, cols, i, j + 1);
  const spreadMs = spread === 'SPREAD' ? config.spreadPenaltyMs * j : 0;
  const packMs = spread === 'PACK' ? config.packWeightMs * (1 - utilisation(d, cols, i, 0)) : 0;
  return { transferMs, restoreMs, queueMs, loadMs, spreadMs, packMs, etaMs: transferMs + restoreMs + queueMs + loadMs + spreadMs + packMs };
}

/** The terms of childScore(...).etaMs after transferMs, in its order of addition (see etaAfter). */
export type EtaTerms = readonly [restoreMs: number, queueMs: number, loadMs: number, spreadMs: number, packMs: number];

/**
 * The ETA terms that do not depend on when the bytes arrive: for a host still waiting for
 * a source, computed once per decision and re-priced with etaAfter() as the transfer plan
 * grows, instead of calling childEta() for every cold host after every opening.
 */
export function etaTerms(d: Demand, cols: HostColumns, i: number, j: number, spread: Spread, config: PlacementConfig): EtaTerms {
  const s = childScore(d, cols, i, j, 0, spread, config);
  return [s.restoreMs, s.queueMs, s.loadMs, s.spreadMs, s.packMs];
}

/** childEta(...) for the host whose etaTerms these are, equal bit for bit (same order of addition). */
export function etaAfter(transferMs: number, t: EtaTerms): number {
  return transferMs + t[0] + t[1] + t[2] + t[3] + t[4];
}

/** childScore(...).etaMs without allocating; same terms, same order of addition, so equal bit for bit. */
export function childEta(d: Demand, cols: HostColumns, i: number, j: number, transferMs: number, spread: Spread, config: PlacementConfig): number {
  return (
    transferMs +
    restoreCost(d, cols, i, config) +
    ((cols.inflightOps[i] as number) + j) * queuePerOp(cols, i, config) +
    config.loadWeightMs * utilisation(d, cols, i, j + 1) +
    (spread === 'SPREAD' ? config.spreadPenaltyMs * j : 0) +
    (spread === 'PACK' ? config.packWeightMs * (1 - utilisation(d, cols, i, 0)) : 0)
  );
}

/** What one op ahead in the host's queue costs a child: its measured restore time per slot, or the default. */
function queuePerOp(cols: HostColumns, i: number, config: PlacementConfig): number {
  const measured = cols.queuePerOpMs[i] as number;
  return Number.isNaN(measured) ? config.perOpQueueMs : measured;
}

function restoreCost(d: Demand, cols: HostColumns, i: number, config: PlacementConfig): number {
  if (d.kind === 'create') return config.bootCostMs;
  const measured = cols.restoreCostMs[i] as number;
  return Number.isNaN(measured) ? config.restoreCostMs : measured;
}
