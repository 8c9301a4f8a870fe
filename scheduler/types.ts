// Data model of the pure placement library: what place() reads (FleetView, built from
// FleetViewInput by buildFleetView) and what it returns (PlacementResult).
//
// Units are in the names: *Mib (mebibytes), *Bytes, *BytesPerS, *Ms (milliseconds).
// Nothing here holds a clock: time comes in as numbers (request.nowMs, view.observedAtMs).

/** Host lifecycle as the leader sees it (lease-based). Only `ready` hosts take new VMs or serve bytes. */
export type HostState = 'ready' | 'suspect' | 'lost';
export type Accel = 'kvm' | 'tcg';

/** Allocatable resources. Invariant: every field is a finite number >= 0. */
export interface Resources {
  readonly vcpus: number;
  readonly memoryMib: number;
  readonly diskMib: number;
}

/** What a host's QEMU can run. A snapshot restores only on a host whose profile is compatible (see feasibility.ts). */
export interface HostVmm {
  /** e.g. "8.2.2" */
  readonly qemuVersion: string;
  /** Machine types this QEMU supports, e.g. ["pc-q35-8.2", "microvm"]. */
  readonly machines: readonly string[];
  /** CPU models this host can expose, e.g. ["host", "Skylake-Server-v4"]. */
  readonly cpuModels: readonly string[];
  readonly accel: Accel;
  /**
   * The guest images this host has built: `<name>-<recipeHash>` -> sha256 of the base disk.
   * Undefined when the host does not say (nothing is known, nothing is left out).
   */
  readonly images?: Readonly<Record<string, string>>;
  /**
   * The recipe hash the host builds each image by now, by image name: a snapshot over another
   * recipe's build, which the host has not built, cannot restore there (its agent builds only
   * its own recipe). Undefined when the host does not say.
   */
  readonly recipes?: Readonly<Record<string, string>>;
}

/** Network link of a host. Loads are what is already in flight, outside the plan being made. */
export interface HostLink {
  readonly bandwidthBytesPerS: number;
  /** Inbound transfer load already on the link. Available inbound = bandwidth - rxLoad. */
  readonly rxLoadBytesPerS: number;
  /** Outbound transfer load already on the link. Available outbound = bandwidth - txLoad. */
  readonly txLoadBytesPerS: number;
}

/** One host as read from etcd (plain data). */
export interface HostInput {
  readonly id: string;
  readonly state: HostState;
  readonly cordoned: boolean;
  readonly draining: boolean;
  readonly capacity: Resources;
  /**
   * Already committed to VMs on this host. Invariant (expected of the view, not enforced):
   * allocated <= capacity per field; the memory of every resident image (residentImages)
   * is included in allocated.memoryMib.
   */
  readonly allocated: Resources;
  /** Queued plus running host-agent operations. */
  readonly inflightOps: number;
  readonly link: HostLink;
  readonly vmm: HostVmm;
  /** Snapshots whose every chunk is in this host's chunk cache. Such a host can serve them to peers. */
  readonly heldSnapshots: readonly string[];
  /** Snapshots partly present: snapshot id -> bytes present (< totalBytes). Not a transfer source. */
  readonly partialSnapshots?: Readonly<Record<string, number>>;
  /**
   * Snapshots whose memory image is mapped by at least one running VM on this host. Their
   * page cache is already paid for (counted in allocated.memoryMib), so new children of
   * that snapshot here cost only their private working set.
   */
  readonly residentImages?: readonly string[];
  /**
   * Fork children already booked here as shares of a snapshot's memory image: snapshot id ->
   * how many (services/domain/image-shares.ts). n such children book
   * min(n * memoryMib, n * privateMemoryMib + memoryMib) together, so c more cost the difference
   * that c makes to that (a fork only; a create or restore books a whole guest). A snapshot
   * also in residentImages is priced as resident.
   */
  readonly imageShares?: Readonly<Record<string, number>>;
  /** Measured restore cost on this host; falls back to config.restoreCostMs. */
  readonly restoreCostMs?: number;
  /**
   * Restores (host-agent steps) this host runs at once. With `restoreCostMs` it prices the
   * queue: each op queued or in flight, and each sibling placed before a child, costs
   * restoreCostMs / restoreSlots. Without both, config.perOpQueueMs applies.
   */
  readonly restoreSlots?: number;
}

/** The VM configuration recorded in a snapshot manifest (DESIGN.md decision 3). */
export interface VmConfig {
  readonly qemuVersion: string;
  readonly machine: string;
  readonly cpuModel: string;
  readonly accel: Accel;
  readonly vcpus: number;
  readonly memoryMib: number;
  /**
   * The image build the snapshot's disk layer overlays: `key` is `<name>-<recipeHash>`,
   * `diskSha256` its base disk's digest on the source host. A host whose build of that image
   * has another digest cannot restore it (its file system would read as corrupt).
   */
  readonly baseImage?: { readonly key: string; readonly diskSha256: string };
}

export interface SnapshotInput {
  readonly id: string;
  /** Stored (compressed, zero chunks left out) bytes of memory + disk chunks: what a cold host must fetch. */
  readonly totalBytes: number;
  /** Chunk size; transfers move whole chunks, so missing bytes are rounded up to it. */
  readonly chunkBytes: number;
  readonly vmConfig: VmConfig;
}

export interface FleetViewInput {
  /** etcd revision the view was read at; the leader commits guarded by it. */
  readonly revision: number;
  readonly observedAtMs: number;
  readonly hosts: readonly HostInput[];
  readonly snapshots: readonly SnapshotInput[];
}

/** A host in a built view. Invariant: view.hosts[h.index] === h. */
export interface HostView extends HostInput {
  readonly index: number;
  /** Index into FleetView.vmmProfiles; hosts with identical HostVmm share one profile. */
  readonly vmmProfile: number;
}

export type SnapshotView = SnapshotInput;

/**
 * The numbers place() reads per host, as columns indexed by host index. Hot loops touch
 * hundreds of scattered hosts per decision; contiguous typed arrays keep that in cache
 * where walking 10 000 host objects would not. Invariant: every column has hosts.length
 * entries and column[h.index] mirrors hosts[h.index].
 */
export interface HostColumns {
  /** 0 ready, 1 suspect, 2 lost. */
  readonly state: Uint8Array;
  readonly cordoned: Uint8Array;
  readonly draining: Uint8Array;
  readonly vmmProfile: Int32Array;
  readonly capVcpus: Float64Array;
  readonly capMemoryMib: Float64Array;
  readonly capDiskMib: Float64Array;
  readonly allocVcpus: Float64Array;
  readonly allocMemoryMib: Float64Array;
  readonly allocDiskMib: Float64Array;
  readonly inflightOps: Float64Array;
  /** NaN where the host has no measurement (config.restoreCostMs applies). */
  readonly restoreCostMs: Float64Array;
  /** restoreCostMs / restoreSlots; NaN where the host reports either not (config.perOpQueueMs applies). */
  readonly queuePerOpMs: Float64Array;
  /** Available inbound bytes/s: bandwidth - rxLoad. */
  readonly downlink: Float64Array;
  /** Available outbound bytes/s: bandwidth - txLoad. */
  readonly uplink: Float64Array;
}

/**
 * Immutable, indexed fleet state. Built once per etcd read (O(hosts + holdings)); place()
 * reads it and never mutates it, so many decisions can share one view.
 */
export interface FleetView {
  readonly revision: number;
  readonly observedAtMs: number;
  readonly hosts: readonly HostView[];
  readonly hostIndexById: ReadonlyMap<string, number>;
  readonly snapshots: ReadonlyMap<string, SnapshotView>;
  /** snapshot id -> indexes of hosts holding it fully, ascending. Invariant: subset of hosts, no duplicates. */
  readonly holders: ReadonlyMap<string, readonly number[]>;
  readonly cols: HostColumns;
  /**
   * snapshot id -> host index -> fork children booked there as shares of its image
   * (HostInput.imageShares); Infinity where it is resident (HostInput.residentImages).
   */
  readonly residentHosts: ReadonlyMap<string, ReadonlyMap<number, number>>;
  /** Same as holders, as sets, for O(1) membership. */
  readonly holderSets: ReadonlyMap<string, ReadonlySet<number>>;
  /** snapshot id -> host index -> bytes present (partial holders only; full holders are not listed). */
  readonly partialHolders: ReadonlyMap<string, ReadonlyMap<number, number>>;
  /** Distinct VMM profiles; usually a handful, so compatibility is decided per profile, not per host. */
  readonly vmmProfiles: readonly HostVmm[];
}

// ---------------------------------------------------------------- requests

/** SAME_HOST: only hosts already holding the snapshot (no transfer). CROSS_HOST: only hosts that do not hold it (forces a transfer; used by load tests). ANY: the cost model decides. */
export type Locality = 'SAME_HOST' | 'CROSS_HOST' | 'ANY';
/** PACK: prefer fuller hosts (density). SPREAD: penalise siblings on one host and prefer emptier hosts. */
export type Spread = 'PACK' | 'SPREAD';

export interface PlacementPreferences {
  readonly locality?: Locality;
  readonly spread?: Spread;
  /** Hard cap on children of this request per host. */
  readonly maxPerHost?: number;
  /** Only this host is a candidate. */
  readonly pinnedHostId?: string;
  /**
   * These hosts are not candidates: the ones a sandbox is being moved off (a fork's children
   * placed again after the host starting them was lost, which may be back by then).
   */
  readonly avoidHostIds?: readonly string[];
}

interface RequestBase {
  /** Operation id. Seeds the RNG so the decision can be replayed. */
  readonly id: string;
  readonly nowMs: number;
  readonly preferences?: PlacementPreferences;
}

/** What a create (boot from image) needs of the host's VMM. Unset fields match anything. */
export interface VmmRequirement {
  readonly accel?: Accel;
  readonly machine?: string;
  readonly cpuModel?: string;
  /** Minimum QEMU version, e.g. "8.2.0". */
  readonly minQemuVersion?: string;
}

/** Boot one new VM from a base image. No snapshot, no sharing, no transfer. */
export interface CreateRequest extends RequestBase {
  readonly kind: 'create';
  readonly resources: Resources;
  readonly vmm?: VmmRequirement;
}

/** fork(N): N copy-on-write children of one snapshot. vCPUs and memory come from the snapshot's VM config. */
export interface ForkRequest extends RequestBase {
  readonly kind: 'fork';
  readonly snapshotId: string;
  readonly count: number;
  /** qcow2 overlay reservation per child. */
  readonly overlayDiskMib: number;
  /**
   * Children of the same fork already on hosts, by host id: a fork placing some children
   * again (the host starting them was lost). They count against preferences.maxPerHost.
   */
  readonly siblingsPerHost?: ReadonlyMap<string, number>;
}

/** Wake a hibernated sandbox: one VM from its snapshot. */
export interface RestoreRequest extends RequestBase {
  readonly kind: 'restore';
  readonly snapshotId: string;
  readonly overlayDiskMib: number;
}

export type PlacementRequest = CreateRequest | ForkRequest | RestoreRequest;

// ---------------------------------------------------------------- results

/** Why a host was not a candidate. Each filtered host is counted once, under the first check it failed. */
export type FilterReason =
  | 'host_lost'
  | 'host_suspect'
  | 'cordoned'
  | 'draining'
  | 'not_pinned'
  | 'avoided'
  | 'locality'
  | 'vmm_incompatible'
  | 'insufficient_vcpu'
  | 'insufficient_memory'
  | 'insufficient_disk'
  | 'no_inbound_bandwidth'
  | 'no_transfer_source';

/**
 * A child's estimated time to ready and its parts, in ms. Invariant: etaMs is the sum of
 * the other fields. For one host the j-th child's etaMs never decreases with j.
 */
export interface ScoreBreakdown {
  /** When the host will hold all bytes (0 for holders); includes waiting for the source's own copy. */
  readonly transferMs: number;
  readonly restoreMs: number;
  /** (inflightOps + siblings placed before on this host) * (restoreCostMs / restoreSlots, or perOpQueueMs). */
  readonly queueMs: number;
  /** loadWeightMs * utilisation after this child (max of vCPU and memory fractions). */
  readonly loadMs: number;
  /** SPREAD only: spreadPenaltyMs * siblings placed before on this host. */
  readonly spreadMs: number;
  /** PACK only: packWeightMs * (1 - utilisation before the plan). */
  readonly packMs: number;
  readonly etaMs: number;
}

export interface Placement {
  readonly childIndex: number;
  readonly hostId: string;
  readonly holdsSnapshot: boolean;
  readonly score: ScoreBreakdown;
}

export interface Transfer {
  readonly snapshotId: string;
  readonly sourceHostId: string;
  readonly destinationHostId: string;
  /** Bytes the destination lacks, rounded up to whole chunks. */
  readonly bytes: number;
  /** 1 = source is an original holder; k+1 = source received its copy in wave k. */
  readonly wave: number;
  readonly startMs: number;
  readonly readyAtMs: number;
}

/** Invariants: each source appears in at most maxFanOut transfers; a source of wave k+1 is a destination of wave k whose readyAtMs <= this transfer's startMs. */
export interface TransferPlan {
  readonly snapshotId: string;
  readonly maxFanOut: number;
  readonly transfers: readonly Transfer[];
}

export interface HostChoice {
  readonly hostId: string;
  readonly children: number;
  readonly holdsSnapshot: boolean;
  /** Breakdown of the last (worst) child placed here. */
  readonly lastChild: ScoreBreakdown;
}

export interface Explanation {
  readonly requestId: string;
  readonly kind: PlacementRequest['kind'];
  readonly decidedAtMs: number;
  readonly viewRevision: number;
  readonly fleetSize: number;
  /** Hosts run through the feasibility checks (all of them unless sampled). */
  readonly examined: number;
  /** Hosts that passed every check. */
  readonly feasible: number;
  readonly sampled: boolean;
  /** Sampling could not place every child, so every host was examined. */
  readonly fallbackFullScan: boolean;
  readonly filtered: Readonly<Partial<Record<FilterReason, number>>>;
  readonly requested: number;
  readonly placed: number;
  readonly chosen: readonly HostChoice[];
  /** Time until the last child is ready (max etaMs); 0 when nothing was placed. */
  readonly makespanMs: number;
  readonly meanEtaMs: number;
  readonly summary: string;
}

export type PlacementResult =
  | {
      readonly ok: true;
      readonly placements: readonly Placement[];
      /** null for create, or when every child lands on a holder. */
      readonly transferPlan: TransferPlan | null;
      readonly explanation: Explanation;
    }
  | {
      readonly ok: false;
      readonly reason: 'no_capacity' | 'unknown_snapshot';
      readonly explanation: Explanation;
    };
