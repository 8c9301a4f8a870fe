// The leader's operation executor. It carries out pending operations: places them with
// the pure placement library, commits the placement with revision guards (capacity is
// never double-booked), sends host steps over the WorkBus and records their results.
//
// Recovery: every decision is written to etcd before the step is sent, and steps are
// idempotent on the agents (keyed by op id + step id). A new leader re-runs every
// non-terminal operation: committed placements are not redone, sent steps are re-sent
// (the agent answers a repeat from its journal), and nothing is lost or duplicated.
import { AsyncLocalStorage } from 'node:async_hooks';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import { admit, MIGRATION_SNAPSHOT_TTL_MS, QuotaExceededError } from './quota.ts';
import type { QuotaOf, UsageSource } from './quota.ts';
import { durationMs, timestampFromMs } from '@bufbuild/protobuf/wkt';
import type { Logger } from 'pino';
import type { Clock, FleetChange, FleetStore, LeaderFence, LeaderTerm, StoreWrite, Versioned, WorkBus } from './ports.ts';
import { DRAIN_TENANT } from './records.ts';
import type { FinalOperationState, HookRec, HostAllocRec, HostRec, OperationError, OperationRec, ResourcesRec, SandboxRec, SandboxState, SnapshotRec, StepRec } from './records.ts';
import { canTransition, HOLDS_CAPACITY, isTerminal, PLACEMENT_TXN_MAX_BYTES, SANDBOX_RECORD_BASE_BYTES, sandboxRecordBytes, snapshotsUsedBy } from './records.ts';
import type { HostEventMsg, HostResultMsg, HostWorkMsg } from './messages.ts';
import { HostResultSchema, HostWorkSchema, VmSpecSchema } from './messages.ts';
import { HostEventType as PbHostEventType, VmState as PbVmState } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { FetchRates, LinkLoads, SnapshotStoredSignals, fleetViewInput, livenessOf } from './fleet-view.ts';
import type { LivenessConfig, HeartbeatRegistry } from './fleet-view.ts';
import { ConflictError, HostLostError, HostStepError, LargerThanAnyHostError, NoCapacityError, NoEligibleHostError, NotFoundError, NotLeaderError, OperationCancelledError, StepTimeoutError, StoreFullError, StoreUnavailableError, WrongStateError } from './errors.ts';
import { buildFleetView, DEFAULT_PLACEMENT_CONFIG, place, rngForRequest } from '../../scheduler/index.ts';
import { applyBooking, bookingOf } from './image-shares.ts';
import { capSteps, STEPS_KEPT } from './step-log.ts';
import type { Booking } from './image-shares.ts';
import type { Explanation, FleetView, PlacementConfig, PlacementRequest, PlacementResult } from '../../scheduler/index.ts';
import type { PlacementPrefs } from './fleet.ts';
import { newId } from './fleet.ts';
import { HIBERNATION_LABEL, PURPOSE_LABEL, planRetention } from './retention.ts';
import { fleetGauges } from './fleet-gauges.ts';
import type { FleetGauges } from './fleet-gauges.ts';
import { commitPurge, EXPIRING_SNAPSHOT_STATES, expiredRecords, finishedOpOf } from './history.ts';
import type { FinishedOp } from './history.ts';
import { ForkfleetError, InvalidArgumentError, isErrorKind, isForkfleetError } from '../../proto/errors.ts';
import { SnapshotManifestSchema } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { Accel } from '../../proto/gen/forkfleet/v1/common_pb.ts';
import type { SignedTicket } from '../../proto/gen/forkfleet/v1/transfer_pb.ts';

/** A fork that spreads to more hosts lacking the snapshot than this follows the transfer plan only (no migration). */
export const MIGRATE_MAX_HOSTS = 4;
/** How many times a fork's child is placed again after the host starting it was lost. */
const FORK_REPLACEMENTS = 2;
/** How many hosts a create tries before it fails: one whose start failed there for the host's reasons is placed on another (createHostsTried). */
const CREATE_HOSTS = 3;
/**
 * A host whose starts of one kind failed lately for its own reasons (startFailedOnHost) is
 * placed on, for placements of that kind, as if this many steps were queued there per failure
 * (up to FAILED_STARTS_COUNTED of them), for FAILED_STARTS_MS after the last one or until a
 * start of that kind succeeds there: placement prefers other hosts while they have room, and
 * uses it when none has. Without it a host that failed every start (an image it cannot build)
 * looked the emptiest, its bookings released, and took most new creates. Kinds: `image` (a
 * create from an image) and `restore` (from a snapshot: a create, a fork, a wake, a drain's
 * move); a host that cannot build an image restores well, and a wake there says nothing of
 * its image builds.
 */
const FAILED_START_QUEUE = 4;
const FAILED_STARTS_COUNTED = 3;
const FAILED_STARTS_MS = 5 * 60_000;
type StartKind = 'image' | 'restore';

/** A fork's children placed again (op input `replaced`): how often, by which placement (its name), and the hosts they were taken off (never placed back there). */
export type Replacements = Record<string, { times: number; by: string; from?: string[] }>;
function replacedAgain(before: Replacements[string] | undefined, by: string, from: string): Replacements[string] {
  return { times: (before?.times ?? 0) + 1, by, from: [...new Set([...(before?.from ?? []), from])] };
}
/** How often the leader checks sandboxes against their hosts' heartbeats (reconcileVms). */
const VM_CHECK_MS = 2000;
/** Heartbeats received this soon after a sandbox's last change may not list its VM yet (or two heartbeat intervals, if longer). */
const VM_CHECK_GRACE_MS = 3000;
/**
 * The longest heartbeat interval (Heartbeat.interval) the VM check believes: a host that says
 * more would switch the check off for its VMs (two intervals are its grace), and one whose
 * beats come that rarely is lost between them anyway (FF_HOST_LOST_AFTER, 30 s by default).
 */
const HEARTBEAT_INTERVAL_MAX_MS = 60_000;
/**
 * The longest text of a host's (an after_resume hook's report) that a sandbox's state_reason
 * carries: tenants read it in the API and in events; the scheduler's log has it whole.
 */
const HOST_REASON_MAX_CHARS = 200;

/**
 * A host's text as a tenant may read it (hostReasonForTenant): controls and line or paragraph
 * separators (a terminal escape, a forged line) become a space, format characters (bidi
 * overrides, zero-width characters) go, and it is cut to HOST_REASON_MAX_CHARS characters.
 */
function hostReasonForTenant(text: string): string {
  const clean = text.replace(/[\p{Cc}\p{Zl}\p{Zp}]+/gu, ' ').replace(/\p{Cf}/gu, '').trim();
  const chars = [...clean];
  return chars.length <= HOST_REASON_MAX_CHARS ? clean : `${chars.slice(0, HOST_REASON_MAX_CHARS - 1).join('').trimEnd()}\u2026`;
}

export interface ExecutorConfig {
  liveness: LivenessConfig;
  /** How long one host step may take before it is re-sent. */
  stepTimeoutMs: number;
  stepAttempts: number;
  chunkBytes: number;
  placement?: PlacementConfig;
  /** How long before a retention deletion its SNAPSHOT_EXPIRING event is sent (default 10 min). */
  expiryNoticeMs?: number;
  /**
   * A fork's host with at most this many children restores them by migration from a holder
   * (ADR 0015; FF_MIGRATE_MAX_CHILDREN, as on the agents; default 2), so it neither waits for
   * nor serves a transfer wave.
   */
  migrateMaxChildren?: number;
  /**
   * Records of destroyed or failed sandboxes, of finished operations (with their idempotency
   * keys) and of deleted or failed snapshots are deleted this long after their last change
   * (history.ts; FF_RECORD_RETENTION). 0 or absent: kept forever.
   */
  recordRetentionMs?: number;
  /** How often reconcileHeldSnapshots runs (FF_HELD_SNAPSHOT_CHECK; default 30 s). */
  heldSnapshotCheckMs?: number;
  /** How long a VM stays stray before it is stopped (reconcileStrayVms; FF_STRAY_VM_GRACE). 0 or absent: 2 x stepTimeoutMs x stepAttempts + 60 s. */
  strayVmGraceMs?: number;
  /** How long after its runner crashed an op runs again (rerunLater). Absent: CRASHED_RERUN_MS. */
  crashedRerunMs?: number;
  /** How long a drain waits for the calls running in a sandbox before it pauses it to move it (pauseForMove). Absent: DRAIN_CALL_GRACE_MS; 0: no wait. */
  drainCallGraceMs?: number;
}

/** The scheduler's signing key at work (host-agent/domain/tickets.ts). */
export interface Signer {
  /** A ticket for one destination to fetch one snapshot, and with `allowMigration` to restore it by migration from a holder. */
  ticket(snapshotId: string, destinationHostId: string, allowMigration: boolean): SignedTicket;
  /** A signature over a manifest's exact bytes. */
  manifest(bytes: Uint8Array): { signature: Uint8Array; keyId: string };
}

export interface ExecutorDeps {
  store: FleetStore;
  bus: WorkBus;
  clock: Clock;
  log: Logger;
  heard: HeartbeatRegistry;
  signer: Signer;
  config: ExecutorConfig;
  /**
   * Records a new operation (Fleet.submit): the leader's own reconcilers start work through it.
   * `fence`: this replica's leadership (ExecutorDeps.fence), which the write is guarded by.
   */
  submit?: (tenantId: string, key: string, kind: OperationRec['kind'], targetId: string, input: Record<string, unknown>, fence?: LeaderFence) => Promise<OperationRec>;
  /** Observability hook: every finished operation (adapters turn it into metrics). */
  onFinished?: (kind: OperationRec['kind'], state: FinalOperationState, seconds: number) => void;
  /** Observability hook: a fork's children placed again after their host was lost (`placed`), or failed for want of room (`failed`). */
  onChildrenReplaced?: (result: 'placed' | 'failed', children: number) => void;
  /** A host step ended: seconds from this leader's first send (undefined if an earlier leader sent it) and as its host measured it (undefined without an answer). */
  onStepEnded?: (action: string, result: 'succeeded' | 'failed', seconds: number | undefined, hostSeconds: number | undefined) => void;
  /** Observability hook: records deleted by the history retention (history.ts), per pass. */
  onExpired?: (sandboxes: number, ops: number, snapshots: number) => void;
  /**
   * The fence of this replica's leadership (LeaderElection.fence), added to every write the
   * executor commits: a replica that lost the lead without noticing yet (a stalled event
   * loop) cannot overwrite what the new leader did; its writes throw NotLeaderError.
   */
  fence?: () => LeaderFence | undefined;
  /**
   * Whether this replica still holds its leadership's lease (LeaderElection.isLeader), checked
   * before every message to a host and every result taken: after a stall, a replica that has
   * lost the lead without noticing yet neither sends work nor consumes the new leader's answers.
   */
  leading?: () => boolean;
  /**
   * Per-tenant quotas and where usage is read (quota.ts), for what the executor books on its
   * own: a lost sandbox whose host comes back with its VM counts again, so it is taken back
   * only within its tenant's quota. Absent: no quotas.
   */
  quotas?: QuotaOf;
  usage?: UsageSource;
}

/** What a step's waiter is woken with when its host is marked lost (reconcileHosts). */
const HOST_LOST = Symbol('host lost');
/** What a step's waiter is woken with when its host's agent restarted (reconcileHosts): send the step again now. */
const HOST_RESTARTED = Symbol('host restarted');
/** Re-sends of one step on its host's restarts that do not count as attempts (an agent in a crash loop then uses them up). */
const FREE_RESENDS = 3;
/** A step waiting for its result; `hostId`: the host it was sent to, the only one whose answer counts. */
type Waiter = { hostId: string; resolve: (r: HostResultMsg | typeof HOST_LOST | typeof HOST_RESTARTED | undefined) => void };

function hooksOf(sb: SandboxRec): Array<{ argv: string[]; timeout: { seconds: bigint; nanos: number } }> {
  return (sb.afterResume ?? []).map((h) => ({ argv: h.argv, timeout: { seconds: BigInt(Math.floor(h.timeoutMs / 1000)), nanos: (h.timeoutMs % 1000) * 1e6 } }));
}

const ZERO: ResourcesRec = { vcpus: 0, memoryMib: 0, diskMib: 0 };

/**
 * What a fork's children of `snapshotId` book on each host of its placement: a share of the
 * snapshot's memory image on a host that holds it (it restores from its local image,
 * copy-on-write), a whole guest elsewhere (a host that fetches may restore by migration, ADR
 * 0015, each child with memory of its own). `imageShare` is what the child's record says.
 */
function forkBookings(res: Extract<PlacementResult, { ok: true }>, snapshotId: string, resources: ResourcesRec): { imageShare: (hostId: string) => string | undefined; booking: (hostId: string) => Booking } {
  const holders = new Set(res.placements.filter((p) => p.holdsSnapshot).map((p) => p.hostId));
  return {
    imageShare: (hostId) => (holders.has(hostId) ? snapshotId : undefined),
    booking: (hostId) => (holders.has(hostId) ? { res: resources, imageShare: snapshotId } : { res: resources }),
  };
}

/**
 * The term host work carries (HostWork.leader_term): the fence's create revision, which grows
 * with every leader of one etcd cluster, that cluster's id and the fleet store's (leader_store,
 * 0 where not known). None (0) without a fence; 1,
 * older than any real term, for a fence whose key was already gone (no write passes it either).
 */
export function leaderTerm(fence: LeaderFence | undefined): LeaderTerm {
  const u64 = (v: string | undefined): bigint => {
    const id = v && /^\d{1,20}$/.test(v) ? BigInt(v) : 0n;
    return id <= 0xffff_ffff_ffff_ffffn ? id : 0n;
  };
  const cluster = u64(fence?.clusterId);
  const store = u64(fence?.storeId);
  if (!fence) return { term: 0n, cluster, store };
  return { term: fence.createRevision > 0 ? BigInt(fence.createRevision) : 1n, cluster, store };
}

/**
 * An operation's error as recorded. Named errors keep their message; an unexpected failure (an
 * exception here, a host's internal error) says only that, its own text going to `detail`
 * (OperationError): tenants read the message, in the operation and in sandbox state reasons.
 */
export function errorOf(e: unknown): OperationError {
  // An internal error's text is the scheduler's (a host's answer it could not use, say): kept in
  // `detail`, which the API does not return (the record and the log keep it), as the synchronous
  // path (status.ts) keeps it from the caller; its message is the generic one. A HostStepError's
  // message is written for tenants already (its host's text is in its detail).
  if (isForkfleetError(e) && e.kind === 'internal' && !(e instanceof HostStepError)) return { kind: 'internal', message: 'internal error in the scheduler (its log has the cause)', retryable: e.retryable, detail: e.message };
  if (isForkfleetError(e)) {
    const detail = e instanceof HostStepError ? e.detail : undefined;
    return { kind: e.kind, message: e.message, retryable: e.retryable, ...(e.field ? { field: e.field } : {}), ...(detail ? { detail } : {}) };
  }
  return { kind: 'internal', message: 'internal error in the scheduler (its log has the cause)', retryable: false, detail: e instanceof Error ? e.message : String(e) };
}

/** The explanation kept in the op record: its summary numbers, not per-host details (records stay small). */
function compactExplanation(e: unknown): unknown {
  if (!e || typeof e !== 'object') return e;
  const { summary, examined, feasible, filtered, makespanMs, meanEtaMs, sampled, chosen } = e as Record<string, unknown>;
  const choices = Array.isArray(chosen)
    ? (chosen as Array<{ hostId: string; children: number; lastChild?: { etaMs: number; restoreMs: number; transferMs: number; queueMs: number } }>).map((c) => ({
        hostId: c.hostId,
        children: c.children,
        ...(c.lastChild ? { lastChild: { etaMs: Math.round(c.lastChild.etaMs), restoreMs: Math.round(c.lastChild.restoreMs), transferMs: Math.round(c.lastChild.transferMs), queueMs: Math.round(c.lastChild.queueMs) } } : {}),
      }))
    : [];
  return { summary, examined, feasible, filtered, makespanMs, meanEtaMs, sampled, chosen: choices };
}

/** A placement waiting to be decided (Executor.placeAndBook). */
interface PlaceJob {
  op: OperationRec;
  /** The snapshot the placement restores from, if any: the view holds only the group's snapshots. */
  snapshot: { tenantId: string; id: string } | undefined;
  request: (view: ReturnType<typeof buildFleetView>) => PlacementRequest;
  /** perChild: what each child books on its host (a function of the host: a fork child on a holder books a share of the image). */
  records: (result: Extract<PlacementResult, { ok: true }>) => { perChild: Booking | ((hostId: string) => Booking); writes: StoreWrite[]; opUpdate?: (o: OperationRec) => void };
  /**
   * Before the job is planned again after its commit conflicted: re-reads the records its
   * writes are guarded by (a child destroyed meanwhile), so that the retry is not doomed to
   * the same conflict. Throws when the job has nothing left to place.
   */
  refresh?: () => Promise<void>;
  /** The term of the runner that asked (runnerTerm): a job of an earlier term is refused, not booked. */
  term: number | undefined;
  resolve: (p: Placed) => void;
  reject: (e: unknown) => void;
}

type Placed = { result: Extract<PlacementResult, { ok: true }>; revision: number };

/**
 * Placements decided together and committed in one transaction: at most this many jobs and
 * writes (a fork of 64 is ~130 writes). etcd must allow that many operations per transaction
 * (--max-txn-ops, raised to 1024 by the harness and the fleet, see adapters/etcd/keys.ts); a
 * single job larger than the cap still goes alone, as before.
 */
const PLACE_GROUP_MAX_JOBS = 16;
const PLACE_GROUP_MAX_WRITES = 500;

/** The agent's answer to a send still running at its HostWork.deadline (agent.ts runStep): not the step's result. */
function isDeadlineAnswer(r: HostResultMsg): boolean {
  return r.error?.kind === 'deadline_exceeded' && r.error.retryable;
}

/** How much sooner than a send's wait here ends its HostWork.deadline is (at most a tenth of the wait). */
const DEADLINE_MARGIN_MS = 5000;

/** Record bytes a job's writes put, estimated: its sandbox records by their labels and hooks, anything else as a small record. */
function writeBytes(writes: readonly StoreWrite[]): number {
  let n = 0;
  for (const w of writes) n += w.kind === 'sandbox' ? sandboxRecordBytes(w.value) : SANDBOX_RECORD_BASE_BYTES;
  return n;
}

/** A capacity record's JSON, at most, once a placement has added one image to it. */
function allocRecordBytes(a: HostAllocRec | undefined): number {
  return 200 + (a?.images ? JSON.stringify(a.images).length : 0) + 48;
}

/** The store key a write touches (its kind and id), to keep one transaction from writing a key twice. */
export function writeKey(w: StoreWrite): string {
  switch (w.kind) {
    case 'sandbox':
    case 'snapshot':
    case 'op':
      return `${w.kind}/${w.value.tenantId}/${w.value.id}`;
    case 'host':
      return `host/${w.value.id}`;
    case 'alloc':
      return `alloc/${w.value.hostId}`;
    case 'idem':
      return `idem/${w.tenantId}/${w.key}`;
    case 'delete-sandbox':
      return `sandbox/${w.tenantId}/${w.id}`;
    case 'delete-op':
      return `op/${w.tenantId}/${w.id}`;
    case 'delete-snapshot':
      return `snapshot/${w.tenantId}/${w.id}`;
    case 'delete-host':
      return `host/${w.id}`;
    case 'check-host':
      return `check/host/${w.id}`;
    case 'check-snapshot':
      return `check/snapshot/${w.tenantId}/${w.id}`;
    case 'delete-alloc':
      return `alloc/${w.hostId}`;
    case 'delete-idem':
      return `idem/${w.tenantId}/${w.key}`;
  }
}

/** The host work that stops (destroys) a sandbox's VM on its host. */
function stopVm(sandboxId: string): HostWorkMsg['work'] {
  return { case: 'destroyVm', value: { sandboxId } as never };
}

/**
 * The host work that pauses a sandbox's VM (a no-op on a paused one). `onlyIfIdleMs`: the idle
 * rule's pause, refused by the host when the VM was busy within that many ms (PauseVmWork).
 */
function pauseVm(sandboxId: string, onlyIfIdleMs = 0, unlessCalls = false): HostWorkMsg['work'] {
  return { case: 'pauseVm', value: { sandboxId, onlyIfIdleMs: BigInt(onlyIfIdleMs), unlessCalls } as never };
}

/**
 * What a wake op records in its input once placed (runWake): the host it booked, the host it
 * fetches the snapshot from, and the host the sandbox hibernated on (a failed wake goes back there).
 */
interface WakeInput {
  bookedHost?: string;
  transferSource?: string;
  hostBefore?: string;
}

/** The host work that resumes a sandbox's VM (on a running one, only a check that QEMU runs it: driver.resume), then runs `afterResume`. */
function resumeVm(sandboxId: string, afterResume: ReturnType<typeof hooksOf> = []): HostWorkMsg['work'] {
  return { case: 'resumeVm', value: { sandboxId, afterResume } as never };
}

/** States a sandbox on a lost host cannot keep (markHostLost). Not `starting`: its op's step fails it (failSandbox), releasing its booking. */
const LOSABLE: ReadonlySet<SandboxState> = new Set<SandboxState>(['running', 'paused', 'hibernating', 'destroying']);

/** States a sandbox's operation holds it in until it moves it on: if the op ends without doing so, the lifecycle pass settles it (settleEndedOwner). */
const LEFT_BY_ENDED_OP: ReadonlySet<SandboxState> = new Set<SandboxState>(['destroying', 'starting', 'waking', 'hibernating']);

/** After a failed hibernate, the idle rule waits this long before it tries again. */
const IDLE_RETRY_AFTER_FAILURE_MS = 10 * 60_000;

/**
 * A lifecycle rule whose operation ended without acting on the sandbox (it failed before it
 * took it: a store outage, another operation that took the sandbox first) submits another
 * at most this often. Its key is the rule's own until then: repeated passes start nothing.
 */
export const LIFECYCLE_RETRY_MS = 60_000;

/**
 * The operation id of the stops sent to a host that came back: one per return (the
 * heartbeat it came back with). An agent answers an (operation, step) it has done from its
 * journal without doing it again, and JetStream drops a message id it saw in the last two
 * minutes: with the same id for every return of a host that did not reboot, the stop of a
 * sandbox's stale VM on its second return was answered "done" and the VM left running.
 */
function reclaimOpId(hostId: string, hb: { bootId: string; seq: bigint }): string {
  return `reclaim-${hostId}-${hb.bootId.slice(0, 8)}-${hb.seq}`;
}

/**
 * A create asking for more of a resource than any host of the view has in all: it will never
 * be placed. Undefined when some host could take it empty, or the fleet has no hosts yet.
 * (Forks and restores are sized by their snapshot, which a host once ran.)
 */
function largerThanAnyHost(view: FleetView, req: PlacementRequest): LargerThanAnyHostError | undefined {
  if (req.kind !== 'create' || view.hosts.length === 0) return undefined;
  const dims = [
    ['resources.vcpus', req.resources.vcpus, view.cols.capVcpus, 'vCPUs'],
    ['resources.memory_mib', req.resources.memoryMib, view.cols.capMemoryMib, 'MiB of memory'],
    ['resources.disk_mib', req.resources.diskMib, view.cols.capDiskMib, 'MiB of disk'],
  ] as const;
  for (const [field, asked, cap, unit] of dims) {
    let largest = 0;
    for (const c of cap) largest = Math.max(largest, c);
    if (asked > largest) return new LargerThanAnyHostError(field, asked, largest, unit);
  }
  return undefined;
}

/** Filter reasons about a host's free room: a placement that met one is short of capacity. */
const CAPACITY_REASONS: ReadonlySet<string> = new Set(['insufficient_vcpu', 'insufficient_memory', 'insufficient_disk', 'no_inbound_bandwidth']);
/** What the filter reasons that do not say it themselves mean, for NoEligibleHostError's message. */
const FILTER_MEANING: Readonly<Record<string, string>> = {
  no_transfer_source: 'no live host holds the snapshot to copy it from (its holders are lost or were removed)',
  locality: 'the placement locality (same or cross host) excludes it',
  not_pinned: 'not the host the request names',
  vmm_incompatible: "its QEMU, accelerator or CPU model cannot restore the snapshot's",
};

/**
 * The error of a failed placement (after largerThanAnyHost): no capacity (retryable) when it
 * placed some, or some host was short of room or only capped; otherwise no host was eligible
 * at all (NoEligibleHostError), for reasons no freed capacity changes.
 */
export function placementFailure(x: Pick<Explanation, 'kind' | 'placed' | 'feasible' | 'filtered' | 'summary'>): NoCapacityError | NoEligibleHostError {
  const filtered = filterReasons(x.filtered);
  if (x.placed > 0 || x.feasible > 0 || filtered.length === 0 || filtered.some(([r]) => CAPACITY_REASONS.has(r))) return new NoCapacityError(x.summary);
  const reasons = reasonList(filtered) + filtered.flatMap(([r]) => (FILTER_MEANING[r] ? [`; ${r}: ${FILTER_MEANING[r]}`] : [])).join('');
  return new NoEligibleHostError(x.kind, reasons, filtered.some(([r]) => r === 'host_suspect' || r === 'host_lost'));
}

/** A placement's filter reasons that filtered some host, most hosts first (less `except`). */
function filterReasons(filtered: Explanation['filtered'], except?: string): Array<[string, number]> {
  return Object.entries(filtered)
    .flatMap(([r, n]): Array<[string, number]> => (r !== except && (n ?? 0) > 0 ? [[r, n ?? 0]] : []))
    .sort((a, b) => b[1] - a[1]);
}

/** `cordoned=2, locality=1`. */
function reasonList(reasons: ReadonlyArray<[string, number]>): string {
  return reasons.map(([r, n]) => `${r}=${n}`).join(', ');
}

/**
 * A start that failed this way may have, or may still make, a VM on its host: one not answered
 * in time or whose host went silent; one whose host answered a retryable failure, which the
 * agent journals for that send only, so another send of the same step (a re-send after an agent
 * restart, a new leader's) would run it again; or any failed restore step that a restarted agent
 * ran again, which keeps the VMs the first run had made and restores only the rest. Such a
 * start's failure is followed by a stop (a no-op where there is no VM), which the agent also
 * records as "given up", so a later copy is refused.
 */
function givenUpMayStillStart(e: unknown): boolean {
  return e instanceof StepTimeoutError || e instanceof HostLostError || e instanceof HostStepError;
}

/**
 * A start that failed for its host's reasons, which another host may not share: no answer in
 * time, the host lost, or the host's own failure (an image it could not build, QEMU that would
 * not start, its disk full). Not one the request itself caused (invalid_argument, not_found,
 * failed_precondition): every host would refuse it the same; nor one whose host names a part of
 * the work at fault (workField: the fetch plan's sources, a step too large for the bus), nor a
 * step no send of which reached the bus (NATS down: no other host would get it either).
 */
function startFailedOnHost(e: unknown): boolean {
  if (e instanceof StepTimeoutError) return !e.neverSent;
  if (e instanceof HostLostError) return true;
  return e instanceof HostStepError && e.workField === '' && ['internal', 'unavailable', 'resource_exhausted', 'deadline_exceeded'].includes(e.kind);
}

/**
 * Whether a restore step left its host holding the snapshot, to be recorded among its holders:
 * it fetched the snapshot (this run sent a fetch plan, or the host's answer says it fetched: a
 * run again after a failover sends none to a host whose heartbeats say it holds the snapshot
 * by then, and the host answers from its journal), and neither migrated its VMs (nothing
 * stored) nor failed to store the fetch durably. Without the answer's word, a fork that the
 * leader's death interrupted left its fetching hosts out of the snapshot's record for good.
 */
function storedThere(planned: boolean, r: Pick<HostResultMsg, 'bytesFetched' | 'restoredByMigration' | 'snapshotNotHeld'>): boolean {
  return (planned || r.bytesFetched > 0n) && !r.restoredByMigration && !r.snapshotNotHeld;
}

/**
 * A fork's restore round's failed hosts: whose children are placed again (`stranded`, with `why`
 * each host failed them) and whose fail (`failing`). Placed again, up to FORK_REPLACEMENTS
 * times each: children of a host that was lost, or whose restore step failed for the host's own
 * reasons (startFailedOnHost; not a step that answered, whose VMs run, nor one that never went
 * out). `hostFaults`: the failures that were so (placement prefers other hosts for a while).
 */
export function sortFailedRestores<F extends { hostId: string; children: ReadonlyArray<{ rec: { id: string } }>; error: unknown; stepFailed: boolean }>(failed: readonly F[], replaced: Replacements): { stranded: F[]; why: Map<string, string>; failing: F[]; hostFaults: F[] } {
  const out = { stranded: [] as F[], why: new Map<string, string>(), failing: [] as F[], hostFaults: [] as F[] };
  for (const f of failed) {
    const lost = f.error instanceof HostLostError;
    const hostFault = lost || (f.stepFailed && startFailedOnHost(f.error));
    if (hostFault) out.hostFaults.push(f);
    if (hostFault && f.children.every((c) => (replaced[c.rec.id]?.times ?? 0) < FORK_REPLACEMENTS)) {
      out.stranded.push(f);
      out.why.set(f.hostId, lost ? 'was lost' : 'failed their restore');
    } else out.failing.push(f);
  }
  return out;
}

/** The hosts a create's start failed on so far, as its op records them (placeCreateAgain). */
function createHostsTried(op: OperationRec): string[] {
  const hosts = (op.input as { startFailedOn?: unknown }).startFailedOn;
  return Array.isArray(hosts) ? hosts.filter((h): h is string => typeof h === 'string') : [];
}

/** A lost sandbox's VM came back on a host that has since been booked full: it is not taken back (capacityIfRoom). */
class NoRoomToReclaimError extends Error {
  constructor(hostId: string, booked: ResourcesRec, capacity: ResourcesRec | undefined) {
    super(`host ${hostId} has no room to take it back (booked ${JSON.stringify(booked)} of ${capacity ? JSON.stringify(capacity) : 'an unknown capacity'})`);
  }
}

/** A wake, a hibernate or a drain's migration found its sandbox taken by another operation in its guarded write: it looks again (waits for that one, or is refused). */
class OwnedByOtherOpError extends Error {
  constructor(opId: string) {
    super(`operation ${opId} took the sandbox first`);
  }
}

/**
 * What an op that found its sandbox taken by another one each time it looked ends with
 * (pauses and resumes asked in a loop, say): UNAVAILABLE, retryable, not an internal error.
 */
function takenEachTime(kind: string, sandboxId: string, e: OwnedByOtherOpError): ForkfleetError {
  return new ForkfleetError('unavailable', `sandbox ${sandboxId} was taken by another operation each time this ${kind} looked (${e.message}); retry`, { retryable: true });
}

/** States a drain waits out before it lists what to move: booked on the host and on their way. */
const DRAIN_WAITS_FOR: ReadonlySet<SandboxState> = new Set(['starting', 'waking', 'hibernating']);

/**
 * Whether `holder` (Executor.holderOf) of a running or paused sandbox holds it as a pause or a
 * resume does, for its step only: one of those, or one whose record is gone (expired while a
 * scheduler from before these holds, whose last write keeps them, still led). The only other
 * holder of such a sandbox is a drain, whose record is found.
 */
function isVmStateHold(holder: OperationRec | undefined): boolean {
  return holder === undefined || holder.kind === 'pause' || holder.kind === 'resume';
}

/** A record a reconciler listed changed before its guarded write: that write is skipped. */
class MovedOnError extends Error {
  constructor(id: string, state: string, hostId: string) {
    super(`sandbox ${id} is ${state} on ${hostId || 'no host'} now`);
  }
}

/** A host that still holds a deleted snapshot is asked again after this long (reconcileHeldSnapshots). */
const HELD_GC_RETRY_MS = 10 * 60_000;
/** Stale-snapshot deletes sent per pass at most. */
const HELD_GC_MAX = 200;

/**
 * How long a live host's heartbeats must lack a snapshot its record says it holds before the
 * record drops it (pruneHolders): longer than a heartbeat sent just before the snapshot was
 * stored takes to arrive.
 */
const NOT_HELD_GRACE_MS = 5000;

/**
 * How long a snapshot must stay `creating` with no unfinished operation taking it before it is
 * marked failed (failOrphanedSnapshots): longer than a crashed runner waits to run again
 * (CRASHED_RERUN_MS) and than a store outage's retries between two runs of one operation.
 */
const ORPHANED_SNAPSHOT_GRACE_MS = 5 * 60_000;

/**
 * How long a drain run waits, in all, for the exec and file calls running in the sandboxes it
 * moves to end before it pauses their VMs all the same (pauseForMove): a command paused under
 * way runs on in the moved VM, but its caller's stream is cut and its output lost.
 */
const DRAIN_CALL_GRACE_MS = 60_000;

/** Deletes the leader's cache remembers (FleetCache.gone). */
const GONE_RECORDS_MAX = 100_000;
/** Results kept for a step nobody waits for yet (Executor.early): at most this many... */
const EARLY_RESULTS_MAX = 10_000;
/** ...and at most this many bytes of them (a result carries up to a NATS message's 1 MiB). */
const EARLY_RESULTS_MAX_BYTES = 64 * 1024 * 1024;

/** Writes per group-committed transaction: etcd's default --max-txn-ops is 128 (compares count too, plus the seed compare). */
const GROUP_COMMIT_MAX_WRITES = 100;

/** Sandboxes of a lost host marked per transaction (markHostLost): with the host's booking, GROUP_COMMIT_MAX_WRITES writes. */
const LOST_BATCH = GROUP_COMMIT_MAX_WRITES - 1;

/** Fetches smaller than this do not count towards a host's measured fetch rate (noteFetchRate). */
const FETCH_RATE_MIN_BYTES = 16 * 1024 * 1024;

/** Backoff of an op run again after the fleet store failed under it (run()). */
const STORE_RETRY_FIRST_MS = 250;
const STORE_RETRY_MAX_MS = 4000;
/** Backoff cap while etcd is full (StoreFullError): an operator has to act, which takes minutes. */
const STORE_FULL_RETRY_MAX_MS = 30_000;

/** An op whose runner crashed (an error not even its failure could be recorded past) is run again this much later. */
const CRASHED_RERUN_MS = 30_000;
/** Executor.vmStateLatest: pruned, once it holds PRUNE_AT, of entries noted longer ago than this many crashed-op rerun delays. */
const VM_STATE_LATEST_KEEP_RERUNS = 20;
const VM_STATE_LATEST_PRUNE_AT = 10_000;

/** The most a valid Duration holds (google/protobuf/duration.proto: about 10,000 years). */
const DURATION_MAX_SECONDS = 315_576_000_000n;

/**
 * A time a host's answer reports (HostResult.duration, pause, fetch), in ms; undefined when
 * absent, negative or not a valid Duration (nanos out of range, or of the other sign), which a
 * host cannot have measured: taken, it was served as an invalid Duration in
 * OperationStep.host_duration, and a negative fetch time priced the host's link as boundless.
 */
function hostReportedMs(d: HostResultMsg['duration']): number | undefined {
  if (!d || d.seconds < 0n || d.seconds > DURATION_MAX_SECONDS || d.nanos < 0 || d.nanos > 999_999_999) return undefined;
  return Math.round(durationMs(d));
}

/** Whether a host's answer reports a time that is there but not one (hostReportedMs). */
function hasBadTime(r: HostResultMsg): boolean {
  return [r.duration, r.pause, r.fetch].some((d) => d !== undefined && hostReportedMs(d) === undefined);
}

/** Adds what a host's answer says of a step's time and bytes to its entry in the op's step log. */
function addHostReport(st: StepRec, r: HostResultMsg): void {
  const hostMs = hostReportedMs(r.duration);
  if (hostMs !== undefined) st.hostMs = hostMs;
  const pauseMs = hostReportedMs(r.pause);
  if (pauseMs !== undefined) st.pauseMs = pauseMs;
  if (r.bytesFetched > 0n) st.bytesFetched = Number(r.bytesFetched);
  if (r.restoredByMigration) st.migrated = true;
}

const ACTION_NAMES = new Map<string, string>();

/** A HostWork kind as its proto field is named (restoreVms -> restore_vms): the API and the metrics show it so. */
function actionName(workCase: string | undefined): string {
  const c = workCase ?? '';
  let name = ACTION_NAMES.get(c);
  if (name === undefined) ACTION_NAMES.set(c, (name = c.replace(/[A-Z]/g, (x) => `_${x.toLowerCase()}`)));
  return name;
}

/**
 * A step as this leader saw it, over what the record says: this leader's view wins (a step it
 * sent again is running again, whatever an earlier answer said), but the first send time
 * stays (an earlier leader's, or an earlier run's).
 */
function mergeStep(recorded: StepRec | undefined, seen: StepRec): StepRec {
  const sentAt = recorded?.sentAt !== undefined && seen.sentAt !== undefined ? Math.min(recorded.sentAt, seen.sentAt) : (recorded?.sentAt ?? seen.sentAt);
  return sentAt !== undefined ? { ...seen, sentAt } : seen;
}

function stepKey(opId: string, stepId: string): string {
  return `${opId}/${stepId}`;
}

/**
 * The leader's copy of hosts, booked capacity and snapshots: listed once when it becomes
 * leader, then kept current by a watch and by the leader's own commits (a record is only
 * replaced by a newer revision). Placement reads it instead of listing the fleet per
 * decision; the commit is still guarded by the revisions read, so a stale entry costs a
 * conflict and a refresh, never a double booking.
 */
export class FleetCache {
  readonly hosts = new Map<string, Versioned<HostRec>>();
  readonly allocs = new Map<string, Versioned<HostAllocRec>>();
  readonly snapshots = new Map<string, Versioned<SnapshotRec>>();
  /**
   * Records deleted (expired snapshots, removed hosts' records and allocs), by map and key:
   * the revision of the delete. A copy from before it (a watch event or a list still in
   * flight) is not taken back in. Bounded: the oldest go first.
   */
  private readonly gone = new Map<string, number>();
  /** The hosts' ids in order (hostsById), until a host comes or goes. */
  private hostOrder: string[] | undefined;

  /**
   * The cached hosts in id order, as placement decides over them (fleetViewInput): sorted
   * again only when a host came or went, not per decision (a leader's map is in registration
   * order).
   */
  hostsById(): Array<Versioned<HostRec>> {
    this.hostOrder ??= [...this.hosts.keys()].sort();
    return this.hostOrder.flatMap((id) => this.hosts.get(id) ?? []);
  }

  apply(c: FleetChange): void {
    switch (c.kind) {
      case 'host': {
        const known = this.hosts.has(c.value.value.id);
        this.put('host', this.hosts, c.value.value.id, c.value);
        if (!known && this.hosts.has(c.value.value.id)) this.hostOrder = undefined;
        return;
      }
      case 'alloc':
        return this.put('alloc', this.allocs, c.value.value.hostId, c.value);
      case 'snapshot':
        return this.put('snapshot', this.snapshots, `${c.value.value.tenantId}/${c.value.value.id}`, c.value);
      case 'gone': {
        const m: Map<string, Versioned<unknown>> = this.mapOf(c.of);
        const cur = m.get(c.key);
        if (cur && cur.modRevision < c.revision) {
          m.delete(c.key);
          if (c.of === 'host') this.hostOrder = undefined;
        }
        this.remember(`${c.of}/${c.key}`, c.revision);
        return;
      }
    }
  }

  private mapOf(kind: 'host' | 'alloc' | 'snapshot'): Map<string, Versioned<unknown>> {
    return kind === 'host' ? this.hosts : kind === 'alloc' ? this.allocs : this.snapshots;
  }

  /** Stores `v` under `k` unless the map already has it at a later revision, or it was deleted after `v`. */
  private put<T>(kind: 'host' | 'alloc' | 'snapshot', m: Map<string, Versioned<T>>, k: string, v: Versioned<T>): void {
    if ((this.gone.get(`${kind}/${k}`) ?? -1) < v.modRevision) putNewer(m, k, v);
  }

  async load(store: FleetStore): Promise<void> {
    // The store's revision before the lists: a cached record written at or before it that the
    // lists lack was deleted. (The newest listed record alone is no bound: an empty list, or a
    // deleted record that was the newest of its kind, would stay cached for good, as would a
    // record a replica leading again kept from its last term.)
    const before = await store.revision();
    const [hosts, allocs, snaps] = await Promise.all([store.listHosts(), store.listAllocs(), store.listSnapshots(undefined)]);
    for (const value of hosts) this.apply({ kind: 'host', value });
    for (const value of allocs) this.apply({ kind: 'alloc', value });
    for (const value of snaps) this.apply({ kind: 'snapshot', value });
    // A relist (after a broken watch) also drops what was deleted meanwhile: a cached entry
    // that the list lacks and that is older than the list is gone.
    this.dropMissing('host', hosts.map((v) => [v.value.id, v.modRevision]), before);
    this.dropMissing('alloc', allocs.map((v) => [v.value.hostId, v.modRevision]), before);
    this.dropMissing('snapshot', snaps.map((v) => [`${v.value.tenantId}/${v.value.id}`, v.modRevision]), before);
  }

  private dropMissing(kind: 'host' | 'alloc' | 'snapshot', listed: ReadonlyArray<readonly [string, number]>, before: number): void {
    const rev = listed.reduce((m, [, r]) => Math.max(m, r), before);
    const keys = new Set(listed.map(([k]) => k));
    const m = this.mapOf(kind);
    for (const [k, v] of m) {
      if (keys.has(k) || v.modRevision > rev) continue;
      m.delete(k);
      if (kind === 'host') this.hostOrder = undefined;
      // Remembered at the copy's own revision: a late copy of it stays out, a newer write gets in.
      this.remember(`${kind}/${k}`, v.modRevision);
    }
  }

  private remember(g: string, revision: number): void {
    this.gone.set(g, Math.max(revision, this.gone.get(g) ?? 0));
    if (this.gone.size > GONE_RECORDS_MAX) this.gone.delete(this.gone.keys().next().value as string);
  }

  snapshot(tenantId: string, id: string): Versioned<SnapshotRec> | undefined {
    return this.snapshots.get(`${tenantId}/${id}`);
  }

  /** Whether the cache holds this record at `modRevision` or later (the watch need not decode it). */
  knows(kind: FleetChange['kind'], key: string, modRevision: number): boolean {
    if (kind === 'gone') return false;
    if ((this.gone.get(`${kind}/${key}`) ?? -1) >= modRevision) return true;
    return holds(this.mapOf(kind), key, modRevision);
  }
}

/** Stores `v` under `k` unless the map already has a later revision of it. */
function putNewer<T>(m: Map<string, Versioned<T>>, k: string, v: Versioned<T>): void {
  const cur = m.get(k);
  if (!cur || cur.modRevision < v.modRevision) m.set(k, v);
}

/** Whether the map has `k` at `modRevision` or later. */
function holds(m: ReadonlyMap<string, Versioned<unknown>>, k: string, modRevision: number): boolean {
  return (m.get(k)?.modRevision ?? -1) >= modRevision;
}

interface DrainInput {
  migrate: boolean;
  /**
   * sandboxId -> where its migration stands (recorded before each step so a re-run resumes).
   * A failed attempt is undone and retired (snapshotId ''): a re-run of the drain starts a new
   * attempt, with a new snapshot and step ids of its own (migrationStep).
   */
  migrations?: Record<string, MigrationRec>;
  /** Without migrate: sandboxId -> [tenantId, id] of the hibernate operation it submitted (recorded first, so a re-run waits for the same ones). */
  hibernations?: Record<string, [string, string]>;
}

interface MigrationRec {
  snapshotId: string;
  toHostId?: string;
  wasPaused: boolean;
  /** 0 (or absent) for the first attempt. */
  attempt?: number;
  /**
   * The sandbox's record was switched to toHostId (in the transaction that switched it): the
   * move is done and its booking there is the sandbox's own, whatever the sandbox does next (a
   * hibernation releases it, a wake books elsewhere). A re-run never releases it again.
   */
  switched?: boolean;
}

/**
 * The step id of a drain migration's `step`, per attempt: an agent answers a step id it ran
 * from its journal, so a second attempt must not reuse the first's ('paused' for a VM that
 * runs again, 'running' for a copy that was destroyed).
 */
function migrationStep(sandboxId: string, m: Pick<MigrationRec, 'attempt'>, step: string): string {
  return `migrate/${sandboxId}${m.attempt ? `/${m.attempt}` : ''}/${step}`;
}

/** What a drain's copySnapshotsOff did: the copies it could not make, and how many of how many it made before it ended (or was cancelled). */
interface CopiedOff {
  uncopied: string[];
  copied: number;
  of: number;
  cancelled: boolean;
  /** The kind of the uncopied ones' cause: failed_precondition when no host could take a copy at all, unavailable when copies failed. */
  kind: OperationError['kind'];
}

/** How far a drain cancelled during its copies got, for its message. */
function copiedOff(off: Omit<CopiedOff, 'uncopied'>, hostId: string): string {
  return `copied ${off.copied} of ${off.of} snapshots off ${hostId}`;
}

/** A sandbox a drain did not wait for (cancelled meanwhile, or its steps' time ran out), as the drain names it. */
function stillOnItsWay(sb: SandboxRec): string {
  return `${sb.id}: still ${sb.state} here`;
}

/**
 * The error a drain that left sandboxes or snapshots behind ends with, its kind from the kinds
 * of its causes: the one they all share (no host eligible: failed_precondition; none with
 * room: resource_exhausted), else unavailable. Never internal: what a drain could not move or
 * copy is the fleet's state, which `message` names cause by cause, not a fault of the
 * scheduler's (an internal cause, a host's say, counts as unavailable). Retryable unless no
 * host is eligible: run again, such a drain fails the same way until a host is uncordoned or
 * added.
 */
function drainFailure(message: string, kinds: ReadonlyArray<OperationError['kind']>): OperationError {
  const causes = new Set(kinds.map((k) => (k === 'internal' ? 'unavailable' : k)));
  const kind = causes.size === 1 ? [...causes][0]! : 'unavailable';
  return { kind, message, retryable: kind !== 'failed_precondition' };
}

/**
 * The kind a sandbox's failed move gives its drain (drainFailure): its placement's (no host
 * eligible, none with room: as placementFailure or moveRefusal said); anything else
 * (a WrongStateError of a sandbox another op held or that moved on, a host's failure) is one a
 * drain run again may get past: unavailable.
 */
function drainCause(e: unknown): OperationError['kind'] {
  const placement = [e, e instanceof Error ? e.cause : undefined].find((x): x is ForkfleetError => x instanceof NoEligibleHostError || x instanceof NoCapacityError);
  return placement?.kind ?? 'unavailable';
}

/** Per snapshot, when the newest sandbox restored from it was made. */
function newestChildren(sandboxes: ReadonlyArray<Versioned<SandboxRec>>): Map<string, number> {
  const newest = new Map<string, number>();
  for (const { value: c } of sandboxes) if (c.sourceSnapshotId && c.createdAt > (newest.get(c.sourceSnapshotId) ?? 0)) newest.set(c.sourceSnapshotId, c.createdAt);
  return newest;
}

/** A drain's progress as its sandboxes end: `<verb> done of total sandboxes <where>`, and how many could not be, then `then`. */
function drainProgress(o: OperationRec, verb: 'moved' | 'hibernated', where: string, done: number, total: number, failed: number, then = ''): void {
  o.progress = { ...o.progress, done, total, message: `${verb} ${done} of ${total} sandboxes ${where}${failed ? ` (${failed} could not be)` : ''}${then}` };
}

/** A failed migration's record once undone: the next attempt starts afresh. */
function retired(m: Pick<MigrationRec, 'attempt'>): MigrationRec {
  return { snapshotId: '', wasPaused: false, attempt: (m.attempt ?? 0) + 1 };
}

/**
 * Snapshot id -> the unfinished operations that will start sandboxes from it before any
 * sandbox record names it (a fork between its acceptance and its children's records, a fork of
 * a live sandbox between its snapshot and its children). A delete's own operation names the
 * snapshot it deletes: not a user.
 */
function snapshotsOfOps(ops: Iterable<OperationRec>): Map<string, string[]> {
  const users = new Map<string, string[]>();
  for (const o of ops) {
    if (isTerminal(o.state) || o.kind === 'delete_snapshot' || o.result?.sandboxIds) continue;
    const input = o.input as { snapshotId?: unknown; forkSnapshotId?: unknown } | null;
    for (const id of [input?.snapshotId, input?.forkSnapshotId]) if (typeof id === 'string' && id) users.set(id, [...(users.get(id) ?? []), o.id]);
  }
  return users;
}

export class Executor {
  readonly cache = new FleetCache();
  /** Operations this leader runs, at the revision it last wrote or saw (saves a read per update). */
  private readonly ops = new Map<string, Versioned<OperationRec>>();
  /** Op record updates run one after another per op, so they never conflict with each other. */
  private readonly opChains = new Map<string, Promise<unknown>>();
  /** Host steps per op, kept in memory and written once with the op's final state. */
  private readonly stepLog = new Map<string, OperationRec['steps']>();
  /** Per op in stepLog: the ended steps its record no longer keeps (step-log.ts capSteps). */
  private readonly stepsOmitted = new Map<string, Set<string>>();
  /** Placements waiting: decided one group at a time, never two groups at once (no self-inflicted conflicts). */
  private readonly placeQueue: PlaceJob[] = [];
  private placeRunning = false;
  private readonly running = new Map<string, Promise<void>>();
  /** Per sandbox (`tenant/id`): the last pause or resume queued to run (maybeRun runs them one at a time). */
  private readonly vmStateTurns = new Map<string, Promise<void>>();
  /**
   * `tenant/sandbox` -> creation time of the latest pause or resume of it started this term
   * (rerunLater), and when that was noted: entries older than 20 rerun delays go once
   * the map holds VM_STATE_LATEST_PRUNE_AT (a crashed op runs again CRASHED_RERUN_MS after its
   * crash), or every sandbox ever paused or resumed in a long term would stay in it.
   */
  private readonly vmStateLatest = new Map<string, { createdAt: number; notedAt: number }>();
  private vmStatePrunedAt = 0;
  /** `tenant/sandbox` of lost sandboxes being taken back now (vmBack: one at a time each). */
  private readonly reclaiming = new Set<string>();
  /**
   * Ops this leader finished, with the revision of their final write (the latest 10,000): a
   * watch event that arrives after the run ended carries an older, unfinished copy, which
   * must not start the op again (run() trusts the watch's copy instead of reading etcd).
   */
  private readonly finishedAt = new Map<string, number>();
  private readonly waiters = new Map<string, Waiter>();
  /**
   * Results that arrived before anyone waited for them (e.g. right after a failover), each in a
   * copy of its own (a received result's bytes are views of its NATS message, which may be a
   * batch): the latest EARLY_RESULTS_MAX, and no more than EARLY_RESULTS_MAX_BYTES of them.
   */
  private readonly early = new Map<string, { result: HostResultMsg; fromHost: string; bytes: number }>();
  private earlyBytes = 0;
  /** Sends so far of each step sent without waiting for its answer (sendHostWork), by op + step; the oldest 10,000. */
  private readonly hostWorkSends = new Map<string, number>();
  /** Host steps sent and not yet finished, per host: placement counts them at once (fleetViewInput's ownInflight). */
  private readonly stepsInFlight = new Map<string, number>();
  /** Starts that failed lately on each host for its own reasons, by kind, and when the last did (FAILED_START_QUEUE). */
  private readonly failedStarts = new Map<string, Partial<Record<StartKind, { count: number; at: number }>>>();
  private stops: Array<() => void | Promise<void>> = [];
  /** Runners waiting out a backoff (pause()): woken when this replica stops leading. */
  private readonly sleepers = new Set<() => void>();
  private active = false;
  /** Batches waiting for the next group commit (commitGrouped). */
  private readonly groupQueue: Array<{ writes: StoreWrite[]; term: number | undefined; resolve: (rev: number) => void; reject: (e: unknown) => void }> = [];
  private groupFlushing = false;
  /** Hosts waiting to be recorded as holders, per `<tenant>/<snapshot>` (addHolder). */
  private readonly holderQueue = new Map<string, { hosts: Set<string>; done: Array<{ settle: (error: unknown) => void }> }>();
  private readonly holderFlushing = new Set<string>();
  /** Every sandbox record, by `<tenant>/<id>`, kept by a watch while leading (the lifecycle rules read it). */
  private readonly sandboxIndex = new Map<string, Versioned<SandboxRec>>();
  private sandboxIndexReady = false;
  /**
   * Finished operations with an idempotency key, by `<tenant>/<id>`, until their records
   * expire (history.ts): from the leader's start-up list, its own final writes and the op watch.
   */
  private readonly finishedOps = new Map<string, FinishedOp>();
  /** `${hostId}/${snapshotId}` -> when that host was last asked to delete a stale snapshot. */
  private readonly heldGcAt = new Map<string, number>();
  /** `${host}/${snapshot}` -> when a live host's heartbeat first lacked a snapshot its record says it holds (pruneHolders). */
  private readonly notHeldSince = new Map<string, number>();
  /** `<tenant>/<snapshot>` -> when a creating snapshot was first seen that no unfinished op takes (failOrphanedSnapshots). */
  private readonly orphanedSince = new Map<string, number>();
  /** Sandboxes whose VM their host's heartbeat did not list: `<tenant>/<id>` -> that heartbeat (reconcileVms). */
  private readonly vmMissing = new Map<string, { bootId: string; seq: bigint }>();
  /** What warnOnce has logged, by `<host>/<what>`: one entry per host and kind of odd report. */
  private readonly warned = new Set<string>();
  /** `host/sandbox` -> when reconcileStrayVms first saw that VM stray (this term). */
  private readonly strays = new Map<string, number>();
  /** Counts start() and stop(): a watch started in an earlier term of leadership is ignored. */
  private term = 0;
  /**
   * Bytes per second hosts got on their last fetches of a snapshot for a restore (bytes over
   * the step's whole host time, restore included; over the last 10 minutes): placement prices
   * a transfer by what hosts get, not by their links' rate (fleetViewInput).
   */
  private readonly fetchRates = new FetchRates();
  /** Transfers of committed placements still running by their plan: link load for the next decisions. */
  private readonly linkLoads = new LinkLoads();
  /** Hosts' word that a snapshot they fetched is stored there (hostEvent): a fork's next wave copies from a relay from then on. */
  private readonly stored = new SnapshotStoredSignals();
  /** The term an operation runner was started in (maybeRun): commit() refuses a runner of an earlier term. */
  private readonly runnerTerm = new AsyncLocalStorage<number>();
  /** When this replica became leader (hosts it never heard from are silent since then). */
  private termStartedAt = 0;
  /** reconcileHosts is holding back lost transitions for want of a bus connection (logged once per spell). */
  private holdingLost = false;
  /** Counts sandbox index follows within a term: a broken follow's late events are ignored. */
  private sandboxGen = 0;

  constructor(private readonly deps: ExecutorDeps) {}

  get log(): Logger {
    return this.deps.log;
  }

  /**
   * The term (this.term) whose start() has loaded the fleet cache: the gauges report only then.
   * Before, the cache is empty (a first term: 0 ready hosts, an alert during a failover) or
   * holds an earlier term's records. A later term (stop() counts one) no longer matches it.
   */
  private gaugesTerm: number | undefined;

  /** A host's event (the bus's, every replica hears them): what the executor acts on is kept, the rest ignored. */
  hostEvent(e: HostEventMsg): void {
    if (e.type === PbHostEventType.SNAPSHOT_STORED && e.snapshotId) this.stored.heard(e.opId, e.hostId, e.snapshotId, this.deps.clock.now());
  }

  /** The fleet's gauges from this leader's caches (fleet-gauges.ts); undefined while it does not lead or has not loaded them yet in this term. */
  gauges(): FleetGauges | undefined {
    if (!this.active || this.gaugesTerm !== this.term) return undefined;
    return fleetGauges({
      hosts: [...this.cache.hosts.values()].map((v) => v.value),
      allocs: new Map([...this.cache.allocs].map(([k, v]) => [k, v.value])),
      heard: this.deps.heard,
      now: this.deps.clock.now(),
      liveness: this.deps.config.liveness,
      sandboxes: this.sandboxIndexReady ? [...this.sandboxIndex.values()].map((v) => v.value) : undefined,
      snapshots: [...this.cache.snapshots.values()].map((v) => v.value),
    });
  }

  /** Called when this replica becomes leader. */
  async start(): Promise<void> {
    this.active = true;
    const term = ++this.term;
    this.termStartedAt = this.deps.clock.now();
    this.deps.bus.newTerm?.(leaderTerm(this.deps.fence?.()));
    // stop() may come while this waits on NATS or etcd (the lease lapsed mid-start): from then
    // on nothing more is started in this term, and what it started afterwards stops at once
    // (addStop), so a replica that no longer leads runs no leader work.
    const current = (): boolean => this.active && term === this.term;
    const stopResults = await this.deps.bus.consumeResults((r, ack, fromHost) => {
      // Not ours to take (redelivered to whoever leads): a throw naks it.
      if (!this.leading()) throw new NotLeaderError();
      this.onResult(r, fromHost);
      ack();
    });
    this.addStop(term, stopResults);
    // Records this leader committed are in the cache already (commit()): not decoded again.
    // A watch that etcd breaks off (ADR 0017: a resume from a compacted revision) is opened
    // again and its records listed again (keepWatching).
    await this.keepWatching(
      term,
      'fleet',
      (onError) =>
        this.deps.store.watchFleet(
          (c) => {
            this.cache.apply(c);
            // A removed host (RemoveHost deletes its queue too; this covers a failure there).
            if (c.kind === 'gone' && c.of === 'host') void this.deps.bus.forgetHost(c.key).catch((e: unknown) => this.log.warn({ err: e, hostId: c.key }, 'could not delete a removed host\'s work queue'));
          },
          { known: (kind, key, rev) => this.cache.knows(kind, key, rev), onError },
        ),
      () => this.cache.load(this.deps.store),
    );
    if (!current()) return;
    await this.cache.load(this.deps.store);
    if (!current()) return;
    this.gaugesTerm = term;
    // The writes of an op this leader runs that it committed itself are skipped undecoded
    // (commit keeps its copy at that revision). Another's (a CancelOperation from an API
    // replica) are taken: the op reads its cancel from the copy.
    // Oldest first: operations that must run in order (maybeRun) are started in it.
    const listOps = async (): Promise<void> => {
      for (const v of (await this.deps.store.listOps({ activeOnly: false })).sort((a, b) => a.value.createdAt - b.value.createdAt)) this.onOp(v);
    };
    const ownWrite = (id: string, rev: number): boolean => this.running.has(id) && Math.max(this.ops.get(id)?.modRevision ?? 0, this.finishedAt.get(id) ?? 0) >= rev;
    await this.keepWatching(term, 'operation', (onError) => this.deps.store.watchOps((op, rev) => this.onOp({ value: op, modRevision: rev }), { only: (_tenantId, id, rev) => !ownWrite(id, rev), onError }), listOps);
    if (!current()) return;
    this.finishedOps.clear();
    await listOps();
    if (!current()) return;
    // The sandboxes, listed once and then followed by a watch: the lifecycle rules read this
    // index instead of listing the largest prefix in etcd every 2 s (a list that grows with
    // the fleet, where the watch costs only what changes).
    this.followSandboxIndex(term);
    // One pass at a time: an overlapping pass would write host records with guards the
    // running pass is about to make stale (every such write conflicts).
    this.every(1000, 'host reconcile', () => this.reconcileHosts());
    if (this.deps.submit) {
      this.every(2000, 'lifecycle reconcile', async () => {
        const sbs = this.sandboxIndexReady ? [...this.sandboxIndex.values()] : await this.deps.store.listSandboxes(undefined);
        await this.reconcileLifecycles(sbs);
        await this.reconcileRetention(sbs);
      });
    }
    const retention = this.deps.config.recordRetentionMs ?? 0;
    if (retention > 0) this.every(Math.min(30_000, Math.max(500, retention / 2)), 'expiring old records', () => this.expireHistory());
    this.every(this.deps.config.heldSnapshotCheckMs ?? 30_000, 'held snapshot check', async () => {
      this.reconcileHeldSnapshots();
      await this.pruneHolders();
      await this.failOrphanedSnapshots();
    });
    this.every(VM_CHECK_MS, 'vm reconcile', async () => {
      await this.reconcileVms();
      await this.reconcileStrayVms();
    });
  }

  /** Logs `msg` the first time `key` (`<host>/<what>`) comes up in this process, never again. */
  private warnOnce(key: string, fields: Record<string, unknown>, msg: string): void {
    if (this.warned.has(key)) return;
    this.warned.add(key);
    this.log.warn(fields, msg);
  }

  /** A host's heartbeat interval as the VM check takes it: 1 s unset, at most HEARTBEAT_INTERVAL_MAX_MS. */
  private heartbeatIntervalMs(hostId: string, interval: { seconds: bigint } | undefined): number {
    const ms = Number(interval?.seconds ?? 1n) * 1000;
    if (ms <= HEARTBEAT_INTERVAL_MAX_MS) return ms;
    this.warnOnce(`${hostId}/interval`, { hostId, intervalSeconds: String(interval?.seconds) }, `a host says it heartbeats less often than every ${HEARTBEAT_INTERVAL_MAX_MS / 1000} s; its VMs are checked as if it were that (logged once per host)`);
    return HEARTBEAT_INTERVAL_MAX_MS;
  }

  /**
   * Sandboxes against their hosts' heartbeats, so no VM disappears without a record of it: a
   * running or paused sandbox (no operation at work on it) whose VM its live host reports
   * crashed or stopped, or leaves out of two heartbeats in a row (its agent restarted and
   * reaped it, say), becomes lost, its capacity released, with the reason (a
   * SANDBOX_STATE_CHANGED event carries it); the host is told to clean a dead VM up. A lost
   * sandbox whose VM its own ready host reports alive again is running again, re-booked.
   * Heartbeats from the first moments after a sandbox's last change are not trusted to list
   * it yet.
   */
  async reconcileVms(): Promise<void> {
    if (!this.sandboxIndexReady) return;
    const now = this.deps.clock.now();
    const missingNow = new Set<string>();
    for (const [key, { value: sb }] of this.sandboxIndex) {
      const watched = ((sb.state === 'running' || sb.state === 'paused') && !sb.opId) || sb.state === 'lost';
      if (!watched || !sb.hostId) continue;
      const heard = this.deps.heard.get(sb.hostId);
      if (!heard || livenessOf(heard.heardAt, now, this.deps.config.liveness) !== 'ready') continue;
      const graceMs = Math.max(VM_CHECK_GRACE_MS, 2 * this.heartbeatIntervalMs(sb.hostId, heard.hb.interval));
      if (heard.heardAt < sb.updatedAt + graceMs) continue;
      const vm = this.deps.heard.vm(sb.hostId, sb.id);
      if (vm === null) continue; // its host's last VM list did not decode: nothing to go by
      const alive = vm !== undefined && (vm.state === PbVmState.RUNNING || vm.state === PbVmState.PAUSED || vm.state === PbVmState.STARTING);
      if (sb.state === 'lost') {
        // A host coming back from lost is reclaimReturnedHost's (reconcileHosts) until its record says ready.
        if (alive && vm.state !== PbVmState.STARTING && this.cache.hosts.get(sb.hostId)?.value.state === 'ready') await this.vmBack(sb, vm.state === PbVmState.PAUSED ? 'paused' : 'running');
        continue;
      }
      if (alive) continue;
      if (vm) {
        // The host's own account of the death (QEMU's or its driver's text: host paths, its
        // internals) is the operator's, logged, not the tenant's, as a host's internal error is
        // (HostStepError).
        const reason = `its VM ${vm.state === PbVmState.CRASHED ? 'crashed' : 'stopped'} on host ${sb.hostId}${vm.reason ? " (its host's account of it is in the scheduler's log)" : ''}`;
        // The host still keeps the dead VM's directory, network namespace and record: gone with it.
        // One op per death (the agent answers a repeated op + step from its journal).
        if (await this.vmGone(sb, reason, vm.reason)) await this.sendHostWork(sb.hostId, `vm-gone-${sb.id}-${sb.updatedAt}`, sb.tenantId, `stop/${sb.id}`, stopVm(sb.id), 'could not clean up a dead VM');
        continue;
      }
      // Gone from one heartbeat: wait for the next one to say the same.
      missingNow.add(key);
      const first = this.vmMissing.get(key);
      if (!first) this.vmMissing.set(key, { bootId: heard.hb.bootId, seq: heard.hb.seq });
      if (!first || (first.bootId === heard.hb.bootId && first.seq >= heard.hb.seq)) continue;
      const restarted = first.bootId !== heard.hb.bootId || heard.bootChangedAt > sb.updatedAt;
      await this.vmGone(sb, `host ${sb.hostId} no longer runs its VM${restarted ? ' (its agent restarted)' : ''}`);
    }
    for (const key of this.vmMissing.keys()) if (!missingNow.has(key)) this.vmMissing.delete(key);
  }

  /**
   * Hosts' VMs against the sandbox records, the other way round from reconcileVms, so no VM
   * runs on without a record of it: a VM that a ready host reports and that no record places
   * there (its sandbox lives on another host, is destroyed, failed or hibernated, or has no
   * record) is stopped once it has been so for the grace period. Only a migration makes a
   * VM before its record says so (create, fork and wake record the host when they book it):
   * its restore and pause-dest steps, each within stepTimeoutMs x stepAttempts, so the
   * default grace is twice that plus a minute. A migration this leader runs is also skipped
   * outright (its drain's recorded destination), and its clock starts again after. A VM
   * left behind by a crash or a failover at the wrong moment (a drain's source VM, a restore
   * that finished after its op gave up) goes this way.
   */
  async reconcileStrayVms(): Promise<void> {
    if (!this.sandboxIndexReady) return;
    const term = this.term;
    const now = this.deps.clock.now();
    const cfg = this.deps.config;
    const grace = cfg.strayVmGraceMs || 2 * cfg.stepTimeoutMs * cfg.stepAttempts + 60_000;
    const byId = new Map<string, SandboxRec>();
    for (const { value } of this.sandboxIndex.values()) byId.set(value.id, value);
    // Where the drains this leader runs make VMs ahead of their records.
    const making = new Set<string>();
    for (const { value: op } of this.ops.values()) {
      if (op.kind !== 'drain') continue;
      for (const [id, m] of Object.entries((op.input as unknown as DrainInput).migrations ?? {})) if (m.toHostId) making.add(`${m.toHostId}/${id}`);
    }
    const seen = new Set<string>();
    for (const h of this.deps.heard.all()) {
      const hostId = h.hb.hostId;
      if (livenessOf(h.heardAt, now, cfg.liveness) !== 'ready' || this.cache.hosts.get(hostId)?.value.state === 'lost') continue;
      for (const vm of this.deps.heard.vms(hostId) ?? []) {
        if (this.term !== term || !this.active) return; // stepped down meanwhile: the next term starts its own clocks
        const sb = byId.get(vm.sandboxId);
        if (sb && sb.hostId === hostId && sb.state !== 'destroyed' && sb.state !== 'failed' && sb.state !== 'hibernated') continue;
        const k = `${hostId}/${vm.sandboxId}`;
        if (making.has(k)) continue;
        seen.add(k);
        const first = this.strays.get(k);
        if (first === undefined) {
          this.strays.set(k, now);
          continue;
        }
        if (now - first < grace) continue;
        // Sent again after another grace if the VM is still there.
        this.strays.set(k, now);
        this.log.warn({ hostId, sandboxId: vm.sandboxId, sandbox: sb ? `${sb.state} on ${sb.hostId || 'no host'}` : 'no record', strayForMs: now - first }, 'a host runs a VM that no sandbox record places there: stopping it');
        await this.sendHostWork(hostId, `stray-${hostId}-${vm.sandboxId}-${first}`, sb?.tenantId ?? 'system', `stop/${vm.sandboxId}`, stopVm(vm.sandboxId), 'could not stop a stray VM');
      }
    }
    for (const k of this.strays.keys()) if (!seen.has(k)) this.strays.delete(k);
  }

  /**
   * A sandbox whose VM is gone: lost, capacity released; false if an operation took it up
   * meanwhile. `hostReason`: what the host said of it (VmStatus.reason), for the log only.
   */
  private async vmGone(sb: SandboxRec, reason: string, hostReason = ''): Promise<boolean> {
    if ((await this.vmStateChange(sb, (s) => (s.state === 'running' || s.state === 'paused') && !s.opId, 'lost', reason, -1)) !== true) return false;
    this.vmMissing.delete(`${sb.tenantId}/${sb.id}`);
    this.log.warn({ sandboxId: sb.id, tenantId: sb.tenantId, hostId: sb.hostId, reason, ...(hostReason ? { hostReason } : {}) }, 'sandbox lost: its VM is gone');
    return true;
  }

  /**
   * Why a lost sandbox may not count against its tenant's quota again (it does not while
   * lost): the quota's refusal, or undefined when it fits. A failed read throws.
   */
  private quotaRefusal(sb: SandboxRec): Promise<QuotaExceededError | undefined> {
    return admit({ store: this.deps.store, quotas: this.deps.quotas, usage: this.deps.usage }, sb.tenantId, { sandboxes: 1, memoryMib: sb.resources.memoryMib }).then(
      () => undefined,
      (e: unknown) => {
        if (e instanceof QuotaExceededError) return e;
        throw e;
      },
    );
  }

  /**
   * A lost sandbox whose VM its host reports alive again is running (or paused) again, booked
   * again, but only if the host still has room for it: its bookings were released when it was
   * marked lost, and placements may have filled the host since (its record says ready before
   * the reclaim runs). One that no longer fits stays lost and its VM is stopped, so capacity
   * is never booked twice and no VM runs without a record placing it.
   */
  private async vmBack(sb: SandboxRec, state: 'running' | 'paused'): Promise<void> {
    // The host pass (reclaimReturnedHost) and the VM pass (reconcileVms) may both find it, the
    // first from an older list: one at a time, each from the record as it is now.
    const key = `${sb.tenantId}/${sb.id}`;
    if (this.reclaiming.has(key)) return;
    this.reclaiming.add(key);
    try {
      const cur = (await this.deps.store.getSandbox(sb.tenantId, sb.id))?.value;
      if (!cur || cur.state !== 'lost' || cur.hostId !== sb.hostId) return;
      // Lost sandboxes do not count against their tenant's quota: replacements may have been
      // created since. One that no longer fits is not taken back (its VM stops, as for no room).
      const overQuota = await this.quotaRefusal(cur);
      if (overQuota) {
        this.log.warn({ sandboxId: cur.id, hostId: cur.hostId, tenantId: cur.tenantId, err: overQuota.message }, 'lost sandbox not reclaimed: its tenant is at its quota; stopping its VM');
        await this.sendHostWork(cur.hostId, `over-quota-${cur.id}-${cur.updatedAt}`, cur.tenantId, `stop/${cur.id}`, stopVm(cur.id), 'could not stop a VM that came back over its tenant\'s quota');
        return;
      }
      // Lost in a hibernate: the hibernate ended with the host's loss, and its snapshot is no
      // longer the sandbox's to keep in use (snapshotsUsedBy), as when a hibernate fails.
      const r = await this.vmStateChange(cur, (s) => s.state === 'lost', state, '', 1, (s) => {
        delete s.hibernatingTo;
        delete s.hibernatingFrom;
      });
      if (r === true) {
        this.log.warn({ sandboxId: cur.id, hostId: cur.hostId }, 'lost sandbox reclaimed: its host reports its VM alive');
        // A hibernate pauses the VM first: one that was running when its hibernate began comes
        // back paused, and would stay so (calls refused, never idle-hibernated again) though
        // nobody asked for a pause. It is resumed, as a failed hibernate resumes it.
        if (state === 'paused' && cur.hibernatingFrom === 'running') {
          await this.submitOwn(cur.tenantId, `__resume-back/${cur.id}/${cur.updatedAt}`, 'resume', cur.id, {}).catch((e: unknown) => this.log.warn({ err: e, sandboxId: cur.id }, 'could not resume a sandbox that came back paused from a hibernate its host lost'));
        }
        return;
      }
      if (!(r instanceof NoRoomToReclaimError)) return;
      this.log.warn({ sandboxId: cur.id, hostId: cur.hostId, err: r.message }, 'lost sandbox not reclaimed: its host was booked full meanwhile; stopping its VM');
      // The record is left as it is (lost, with its reason): the same op + step on every pass
      // until the VM is gone, which the agent answers from its journal once it has stopped it
      // (each pass's send is a new attempt: a retryable failure is journalled for its send only).
      await this.sendHostWork(cur.hostId, `no-room-${cur.id}-${cur.updatedAt}`, cur.tenantId, `stop/${cur.id}`, stopVm(cur.id), 'could not stop a VM that came back to a full host');
    } catch (e) {
      // A failed read (the store, the quota ledger): the next pass tries again; the passes that
      // call this go on with their other hosts and VMs.
      this.log.warn({ err: e, sandboxId: sb.id, hostId: sb.hostId }, 'could not take a lost sandbox back; trying on the next pass');
    } finally {
      this.reclaiming.delete(key);
    }
  }

  /**
   * The guarded write of vmGone / vmBack: the state change and the capacity it books (+1) or
   * releases (-1) on the sandbox's host, in one transaction. False, writing nothing, when the
   * record moved on meanwhile (`still` fails or the host changed).
   */
  private async vmStateChange(sb: SandboxRec, still: (s: SandboxRec) => boolean, state: SandboxState, reason: string, sign: 1 | -1, also?: (s: SandboxRec) => void): Promise<boolean | NoRoomToReclaimError> {
    const now = this.deps.clock.now();
    try {
      await this.updateSandbox(
        sb.tenantId,
        sb.id,
        (s) => {
          if (!still(s) || s.hostId !== sb.hostId) throw new ConflictError(`sandbox ${sb.id} changed`);
          this.setState(s, state, now, reason);
          also?.(s);
        },
        (_next, before) => (sign === 1 ? this.capacityIfRoom(sb.hostId, bookingOf(before)) : this.capacity(sb.hostId, bookingOf(before), sign))(),
      );
      return true;
    } catch (e) {
      if (e instanceof NoRoomToReclaimError) return e;
      if (!(e instanceof ConflictError)) this.log.warn({ err: e, sandboxId: sb.id, to: state }, 'could not record that a sandbox\'s VM went or came back');
      return false;
    }
  }

  /**
   * One host step sent without waiting for its result (clean-ups; the agent dedups by op and
   * step). The send is retried a few times (a NATS restart fails the publishes of a few
   * seconds): such a stop is sent once, and a lost one leaves a VM running with no record.
   * Only in the term it was decided in: the bus stamps work with the term current when it is
   * sent (NatsWorkBus.newTerm), so a send from a runner that outlived stop(), or a retry that
   * slept across a stop() and start(), would carry an earlier term's decision past the agent's
   * term check (a stop of a VM the new term started there).
   */
  private async sendHostWork(hostId: string, opId: string, tenantId: string, stepId: string, work: HostWorkMsg['work'], failed: string): Promise<void> {
    const term = this.term;
    // Each call is a new attempt: a pass that sends the same op + step again (a stop of a VM
    // that came back to a full host, until it is gone) gets a final answer from the agent's
    // journal, but a retryable failure the agent journalled answers only the send it failed
    // (agent.ts), so the next pass's stop runs again.
    const key = stepKey(opId, stepId);
    const attempt = (this.hostWorkSends.get(key) ?? 0) + 1;
    this.hostWorkSends.delete(key);
    this.hostWorkSends.set(key, attempt);
    if (this.hostWorkSends.size > 10_000) this.hostWorkSends.delete(this.hostWorkSends.keys().next().value as string);
    // Nobody waits for its answer, but the agent frees the step's slot by this deadline should it hang.
    const msg = create(HostWorkSchema, { opId, stepId, attempt, tenantId, work, deadline: timestampFromMs(this.deps.clock.now() + this.deps.config.stepTimeoutMs) });
    for (let i = 0; ; i++) {
      if (!this.leading() || !this.currentRunner() || term !== this.term) return void this.log.warn({ hostId, opId, stepId }, `${failed}: no longer leading (in the term it was decided in)`);
      try {
        return await this.deps.bus.sendWork(hostId, msg);
      } catch (e) {
        if (i >= 4 || !this.active) return void this.log.warn({ err: e, hostId, opId, stepId }, failed);
        await new Promise((r) => setTimeout(r, 500 * 2 ** i));
      }
    }
  }

  /**
   * Loads the sandbox index in the background (a new leader's first job is running
   * operations); until it is ready, the rules list the sandboxes. A broken watch makes the
   * index not ready, and it is listed and followed again a second later, for this term.
   */
  private followSandboxIndex(term: number): void {
    if (term !== this.term || !this.active) return;
    this.sandboxIndex.clear();
    this.sandboxIndexReady = false;
    const gen = ++this.sandboxGen;
    const current = (): boolean => gen === this.sandboxGen && term === this.term;
    let stopWatch: (() => void) | undefined;
    this.deps.store
      .followSandboxes(
        (c) => {
          if (!current()) return;
          if (c.kind === 'put') this.indexSandbox(c.value);
          else this.sandboxIndex.delete(`${c.tenantId}/${c.id}`);
        },
        (e) => {
          if (!current()) return;
          this.sandboxIndexReady = false;
          this.sandboxGen++; // ignore whatever the broken watch still delivers
          stopWatch?.(); // a resumed stream (after a disconnect) is not trusted, nor kept
          this.log.warn({ err: e }, 'the sandbox watch broke off; the lifecycle rules list the sandboxes until it is followed again');
          setTimeout(() => this.followSandboxIndex(term), 1000).unref();
        },
        // This leader's own sandbox writes are indexed when they commit (commit()): the watch
        // skips them undecoded (two per forked child: most of what it would decode).
        { known: (key, rev) => holds(this.sandboxIndex, key, rev) },
      )
      .then(
        (stop) => {
          if (!current() || !this.active) return stop();
          stopWatch = stop;
          this.stops.push(stop);
          this.sandboxIndexReady = true;
        },
        (e: unknown) => {
          this.log.warn({ err: e }, 'could not follow the sandbox records; the lifecycle rules list them instead, and it is tried again');
          if (current()) setTimeout(() => this.followSandboxIndex(term), 1000).unref();
        },
      );
  }

  /**
   * Opens a watch for this term. When etcd breaks it off, it is opened again a second later
   * and `relist` reads what it may have missed, until the term ends.
   */
  private async keepWatching(term: number, what: string, open: (onError: (e: unknown) => void) => Promise<() => void>, relist: () => Promise<void>): Promise<void> {
    let stop: (() => void) | undefined;
    let ended = false;
    this.addStop(term, () => {
      ended = true;
      stop?.();
    });
    const live = (): boolean => !ended && term === this.term && this.active;
    // One reopen at a time: the watchers of one open (watchFleet has three) break together,
    // and each says so.
    let reopening = false;
    const reopen = async (): Promise<void> => {
      reopening = false;
      if (!live()) return;
      try {
        const s = await open(onError);
        if (!live()) return s();
        stop = s;
        await relist();
      } catch (e) {
        onError(e);
      }
    };
    const onError = (e: unknown): void => {
      if (!live() || reopening) return;
      reopening = true;
      this.log.warn({ err: e }, `the ${what} watch broke off; watching again and listing`);
      stop?.();
      stop = undefined;
      setTimeout(() => void reopen(), 1000).unref();
    };
    const first = await open(onError);
    // Stopped while it opened (the term ended): closed here, not left open.
    if (live()) stop = first;
    else first();
  }

  /**
   * Throws NotLeaderError when stopped, or in a runner of an earlier term: stop() waits only
   * 2 s for runners, and this replica may lead again while one still waits on the store. Such
   * a runner must neither write, nor book (placeAndBook), nor send a step; the new term runs
   * its op again once it ends (maybeRun).
   */
  private assertCurrentRunner(): void {
    if (!this.currentRunner()) throw new NotLeaderError();
  }

  /** Whether running, and not in a runner of an earlier term (assertCurrentRunner). */
  private currentRunner(): boolean {
    const runnerTerm = this.runnerTerm.getStore();
    return this.active && (runnerTerm === undefined || runnerTerm === this.term);
  }

  /** Executing (started, not stopped) and still holding the lease (ExecutorDeps.leading). */
  private leading(): boolean {
    return this.active && (this.deps.leading?.() ?? true);
  }

  /** Registers what stop() ends; one of a term that already ended is ended at once. */
  private addStop(term: number, stop: () => void | Promise<void>): void {
    if (this.active && term === this.term) {
      this.stops.push(stop);
      return;
    }
    void (async () => stop())().catch((e: unknown) => this.log.warn({ err: e }, 'stopping what a start that was stopped meanwhile had begun failed'));
  }

  /**
   * Runs `pass` every `ms` while leading, never two at once; a failed pass is logged. A pass
   * commits only in the term it started in (runnerTerm, as op runners): one that stop() left
   * waiting on the store, resumed after this replica leads again, would otherwise write what
   * it decided from the earlier term's view under the new term's fence.
   */
  private every(ms: number, what: string, pass: () => Promise<unknown>): void {
    let busy = false;
    const t = setInterval(() => {
      // A replica whose lease ran out (stopped by the watchdog next) starts no pass: its
      // submits and host work would act on a view the new leader may have changed.
      if (busy || !this.leading()) return;
      busy = true;
      this.runnerTerm
        .run(this.term, pass)
        .catch((e: unknown) => this.log.warn({ err: e }, `${what} failed`))
        .finally(() => (busy = false));
    }, ms);
    this.stops.push(() => clearInterval(t));
  }

  /** An op record from the start-up list or the watch: run it, or remember it finished. */
  private onOp(v: Versioned<OperationRec>): void {
    const f = finishedOpOf(v);
    if (f) this.noteFinished(f);
    else this.maybeRun(v.value, v.modRevision);
  }

  /**
   * Remembers a finished op until its record expires. Only one with its idempotency key:
   * deleting an op of an older record (no key recorded) would leave its key pointing at
   * nothing, and a retry of that key could never submit.
   */
  private noteFinished(f: FinishedOp): void {
    // Kept for expireHistory only: with retention off (records kept for good) nothing reads
    // them, and the map grew by every finished op for as long as this replica led.
    if (f.idempotencyKey && (this.deps.config.recordRetentionMs ?? 0) > 0) this.finishedOps.set(`${f.tenantId}/${f.id}`, f);
  }

  /**
   * Deletes the records that the history retention expires (history.ts), each guarded by the
   * revision the leader holds. At most 100,000 a pass (a pass every 30 s keeps up with ~3,000
   * expiring records a second; a longer backlog, e.g. the first pass after an upgrade, takes
   * several passes).
   */
  async expireHistory(): Promise<{ sandboxes: number; ops: number; snapshots: number }> {
    const retention = this.deps.config.recordRetentionMs ?? 0;
    if (!this.active || retention <= 0) return { sandboxes: 0, ops: 0, snapshots: 0 };
    const plan = expiredRecords(
      { sandboxes: this.sandboxIndexReady ? this.sandboxIndex.values() : [], ops: this.finishedOps.values(), snapshots: this.cache.snapshots.values() },
      this.deps.clock.now(),
      retention,
      100_000,
    );
    if (plan.writes.length === 0) return { sandboxes: 0, ops: 0, snapshots: 0 };
    // Counted as committed, not as planned: a record whose guard keeps failing is planned on
    // every pass and would be counted on every pass.
    const done = { sandboxes: 0, ops: 0, snapshots: 0 };
    await commitPurge(
      {
        commit: async (w) => {
          if ((await this.commit([...w])) === 0) return false;
          for (const x of w) {
            if (x.kind === 'delete-sandbox') done.sandboxes++;
            else if (x.kind === 'delete-op') done.ops++;
            else if (x.kind === 'delete-snapshot') done.snapshots++;
          }
          return true;
        },
      },
      plan.writes,
    );
    // A delete whose guard failed: the record changed; the watch brings its new copy back.
    for (const g of plan.writes) {
      const w = g[0]!;
      if (w.kind === 'delete-op') this.finishedOps.delete(`${w.tenantId}/${w.id}`);
    }
    const notDeleted = plan.sandboxes + plan.ops + plan.snapshots - (done.sandboxes + done.ops + done.snapshots);
    this.log.info({ ...done, ...(notDeleted > 0 ? { changedMeanwhile: notDeleted } : {}), retentionMs: retention }, 'expired old records');
    this.deps.onExpired?.(done.sandboxes, done.ops, done.snapshots);
    return done;
  }

  async stop(): Promise<void> {
    this.active = false;
    for (const s of this.stops.splice(0)) await s();
    this.ops.clear();
    this.finishedOps.clear();
    // Seen orphaned in this term: a later term starts its grace afresh.
    this.orphanedSince.clear();
    this.term++;
    this.sandboxIndexReady = false;
    this.sandboxIndex.clear();
    this.strays.clear();
    // Misses seen in an earlier term (by heartbeat seq) would make one miss in the next count as two.
    this.vmMissing.clear();
    this.vmStateLatest.clear();
    // Waiting runners would only time out: wake them so they end now; the next leader
    // re-runs their operations from etcd.
    for (const [k, w] of this.waiters) {
      this.waiters.delete(k);
      w.resolve(undefined);
    }
    for (const wake of [...this.sleepers]) wake();
    await Promise.race([Promise.allSettled([...this.running.values()]), new Promise((r) => setTimeout(r, 2000))]);
  }

  /**
   * A step's result, from the host whose subject it came on. A result for a step that was
   * sent to another host is dropped: a host's agent cannot answer for another host's steps.
   */
  onResult(r: HostResultMsg, fromHost: string): void {
    const key = stepKey(r.opId, r.stepId);
    const w = this.waiters.get(key);
    if (w && w.hostId !== fromHost) {
      this.log.warn({ opId: r.opId, stepId: r.stepId, hostId: w.hostId, fromHost }, 'dropped a step result from a host the step was not sent to');
      return;
    }
    if (w) {
      this.waiters.delete(key);
      w.resolve(r);
    } else if (this.hostWorkSends.has(key)) {
      // The answer to a clean-up this leader sent without waiting (sendHostWork): nobody reads it.
    } else {
      const encoded = toBinary(HostResultSchema, r);
      this.takeEarly(key);
      this.early.set(key, { result: fromBinary(HostResultSchema, encoded), fromHost, bytes: encoded.length });
      this.earlyBytes += encoded.length;
      while (this.early.size > EARLY_RESULTS_MAX || this.earlyBytes > EARLY_RESULTS_MAX_BYTES) this.takeEarly(this.early.keys().next().value as string);
    }
  }

  /** Removes and returns the early result kept under `key`. */
  private takeEarly(key: string): { result: HostResultMsg; fromHost: string } | undefined {
    const e = this.early.get(key);
    if (!e) return undefined;
    this.early.delete(key);
    this.earlyBytes -= e.bytes;
    return e;
  }

  /** Reads the op and runs it in this term (unless it ended); a failed read tries again later (rerunLater). */
  private runAgain(tenantId: string, opId: string): void {
    const term = this.term;
    this.deps.store.getOp(tenantId, opId).then(
      (v) => {
        if (v && term === this.term && !isTerminal(v.value.state)) this.maybeRun(v.value, v.modRevision);
      },
      (e: unknown) => {
        this.log.warn({ err: e, opId }, 'could not read an operation an earlier term was running; trying later');
        this.rerunLater(tenantId, opId);
      },
    );
  }

  /**
   * An op whose runner crashed is still recorded active, and nothing else would start it
   * again in this term (the watch delivers only changes; a new term lists every active op):
   * read afresh and run again CRASHED_RERUN_MS later, as a new leader would run it.
   */
  private rerunLater(tenantId: string, opId: string): void {
    const term = this.term;
    const t = setTimeout(() => {
      // Not run again here: the crashed run's step log (kept for the rerun, maybeRun) goes.
      const dropped = (): void => {
        if (!this.running.has(opId)) {
          this.stepLog.delete(opId);
          this.stepsOmitted.delete(opId);
        }
      };
      if (term !== this.term || !this.active) return dropped();
      this.deps.store.getOp(tenantId, opId).then(
        (v) => {
          if (!v || term !== this.term || isTerminal(v.value.state)) return dropped();
          const op = v.value;
          // A pause or resume of a sandbox that a later one has run past meanwhile: run now, it
          // would undo that one (pauses and resumes of a sandbox run in the order they came).
          if ((op.kind === 'pause' || op.kind === 'resume') && (this.vmStateLatest.get(`${op.tenantId}/${op.targetId}`)?.createdAt ?? 0) > op.createdAt) {
            dropped();
            void this.finish(op, null, { kind: 'aborted', message: `a later pause or resume of ${op.targetId} ran while this one was waiting to run again after its runner crashed; call it again if it is still wanted`, retryable: false }, undefined, this.vmStateHoldEnded(op)).catch((e: unknown) => {
              this.log.warn({ err: e, opId }, 'could not end a superseded operation; trying later');
              this.rerunLater(tenantId, opId);
            });
            return;
          }
          this.maybeRun(op, v.modRevision);
        },
        (e: unknown) => {
          this.log.warn({ err: e, opId }, 'could not read a crashed operation to run it again; trying later');
          this.rerunLater(tenantId, opId);
        },
      );
    }, this.deps.config.crashedRerunMs ?? CRASHED_RERUN_MS);
    t.unref();
  }

  private maybeRun(op: OperationRec, modRevision: number): void {
    if (!this.active || isTerminal(op.state)) return;
    if (modRevision <= (this.finishedAt.get(op.id) ?? 0)) return;
    const cur = this.ops.get(op.id);
    if (!cur || cur.modRevision < modRevision) this.ops.set(op.id, { value: op, modRevision });
    if (this.running.has(op.id)) return;
    // Pauses and resumes of one sandbox run one after another, in the order they come (their
    // creation order: the watch's, and a new leader lists them so). Run together, a resume
    // that found the record still running would ask nothing of the VM while the pause before
    // it paused it, and the pause's write would leave the record paused after the resume.
    const turn = op.kind === 'pause' || op.kind === 'resume' ? `${op.tenantId}/${op.targetId}` : undefined;
    const before = turn === undefined ? undefined : this.vmStateTurns.get(turn);
    if (turn !== undefined) this.noteVmStateTurn(turn, op.createdAt);
    let crashed = false;
    const term = this.term;
    const runOp = (): Promise<void> => this.runnerTerm.run(term, () => this.run(op.tenantId, op.id));
    const p = (before ? before.then(runOp) : runOp())
      .catch((e: unknown) => {
        crashed = true;
        this.log.error({ err: e, opId: op.id, rerunInMs: this.deps.config.crashedRerunMs ?? CRASHED_RERUN_MS }, 'operation runner crashed; it runs again later');
      })
      .finally(() => {
        this.running.delete(op.id);
        this.ops.delete(op.id);
        this.opChains.delete(op.id);
        // A crashed runner's step log stays for its rerun (rerunLater), whose sends of a step
        // count on from it: numbered from 1 again, a send would carry the message id of one
        // this run made, and JetStream (which keeps ids for its duplicate window, minutes, past
        // the rerun delay) would drop it, leaving the step to wait out its whole timeout.
        // Only the counts: a step's latency (onStepEnded) is timed from the rerun's own first send.
        if (!crashed) {
          this.stepLog.delete(op.id);
          this.stepsOmitted.delete(op.id);
        } else for (const st of Object.values(this.stepLog.get(op.id) ?? {})) delete st.sentAt;
        if (turn !== undefined && this.vmStateTurns.get(turn) === p) this.vmStateTurns.delete(turn);
        if (crashed) this.rerunLater(op.tenantId, op.id);
        // A runner of an earlier term that outlived its stop() while this replica leads again:
        // the new term's listing skipped the op (still running here then), and nothing else
        // would run it until the next change of leader.
        else if (term !== this.term && this.active) this.runAgain(op.tenantId, op.id);
      });
    this.running.set(op.id, p);
    if (turn !== undefined) this.vmStateTurns.set(turn, p);
  }

  private noteVmStateTurn(turn: string, createdAt: number): void {
    const now = performance.now();
    this.vmStateLatest.set(turn, { createdAt: Math.max(this.vmStateLatest.get(turn)?.createdAt ?? 0, createdAt), notedAt: now });
    // At most once a minute: a map of PRUNE_AT recent entries is not scanned on every call.
    if (this.vmStateLatest.size < VM_STATE_LATEST_PRUNE_AT || now - this.vmStatePrunedAt < 60_000) return;
    this.vmStatePrunedAt = now;
    const keepMs = VM_STATE_LATEST_KEEP_RERUNS * (this.deps.config.crashedRerunMs ?? CRASHED_RERUN_MS);
    for (const [k, v] of this.vmStateLatest) if (now - v.notedAt > keepMs) this.vmStateLatest.delete(k);
  }

  /** A sandbox record at a revision, unless the index already has a later one. */
  private indexSandbox(v: Versioned<SandboxRec>): void {
    putNewer(this.sandboxIndex, `${v.value.tenantId}/${v.value.id}`, v);
  }

  /**
   * Commits a batch; on success the leader's caches and sandbox index take the written records
   * at the new revision (so records given to commit are never changed afterwards).
   */
  private async commit(writes: StoreWrite[]): Promise<number> {
    // Stopped (stepping down, shutting down): nothing more is written, though the election key
    // still stands until the replica resigns. A runner that stop() woke (its step "timed out")
    // would otherwise record an outcome it never saw, e.g. a sandbox hibernated whose VM stop
    // was never sent; the next leader runs the op again from what etcd says.
    // So is a runner of an earlier term of this replica (stop() waits 2 s for runners, and the
    // replica may lead again while one of them still waits on the store).
    this.assertCurrentRunner();
    const rev = await this.deps.store.commitAt(writes, this.deps.fence?.());
    if (rev > 0) {
      for (const w of writes) {
        if (w.kind === 'host' || w.kind === 'alloc' || w.kind === 'snapshot') this.cache.apply({ kind: w.kind, value: { value: w.value, modRevision: rev } } as FleetChange);
        else if (w.kind === 'sandbox' && this.active) this.indexSandbox({ value: w.value, modRevision: rev });
        else if (w.kind === 'delete-sandbox') this.sandboxIndex.delete(`${w.tenantId}/${w.id}`);
        else if (w.kind === 'delete-op') this.finishedOps.delete(`${w.tenantId}/${w.id}`);
        else if (w.kind === 'delete-snapshot') this.cache.apply({ kind: 'gone', of: 'snapshot', key: `${w.tenantId}/${w.id}`, revision: rev });
        else if (w.kind === 'op' && isTerminal(w.value.state)) {
          const f = finishedOpOf({ value: w.value, modRevision: rev });
          if (f && this.active) this.noteFinished(f);
          this.finishedAt.set(w.value.id, rev);
          if (this.finishedAt.size > 10_000) this.finishedAt.delete(this.finishedAt.keys().next().value as string);
        } else if (w.kind === 'op' && this.running.has(w.value.id) && (this.ops.get(w.value.id)?.modRevision ?? 0) < rev) {
          // Unless the op watch brought a later write first (a cancel, whose reply raced this one's).
          this.ops.set(w.value.id, { value: w.value, modRevision: rev });
        }
      }
    }
    return rev;
  }

  private async readSnapshot(tenantId: string, id: string): Promise<Versioned<SnapshotRec> | undefined> {
    return this.cache.snapshot(tenantId, id) ?? (await this.deps.store.getSnapshot(tenantId, id));
  }

  // ---------------------------------------------------------------- records

  /**
   * Read-modify-write of an op record, after this op's earlier updates. `extra(attempt)` adds
   * writes to the same transaction (attempt 0 may use revisions read before; a conflict
   * retries with attempt + 1, which must read again).
   */
  private updateOp(tenantId: string, id: string, mutate: (op: OperationRec) => void, extra?: (attempt: number) => Promise<StoreWrite[]>): Promise<OperationRec> {
    const prev = this.opChains.get(id) ?? Promise.resolve();
    const next = prev.catch(() => undefined).then(() => this.updateOpNow(tenantId, id, mutate, extra));
    this.opChains.set(id, next);
    return next;
  }

  private async updateOpNow(tenantId: string, id: string, mutate: (op: OperationRec) => void, extra?: (attempt: number) => Promise<StoreWrite[]>): Promise<OperationRec> {
    for (let i = 0; i < 20; i++) {
      // First try the revision this leader last wrote or saw; after a conflict, re-read.
      const v = (i === 0 ? this.ops.get(id) : undefined) ?? (await this.deps.store.getOp(tenantId, id));
      if (!v) throw new NotFoundError('operation', id);
      const next = structuredClone(v.value);
      mutate(next);
      // An ended op stays ended: a write from a run that started off a stale copy (a late
      // watch event after the final write's answer was lost) must not make it running again.
      if (isTerminal(v.value.state) && !isTerminal(next.state)) throw new WrongStateError('operation', id, v.value.state, 'it has ended');
      // Every write of a running op carries its step log (at most once a second for progress).
      for (const [stepId, st] of Object.entries(this.stepLog.get(id) ?? {})) next.steps[stepId] = mergeStep(next.steps[stepId], st);
      // The record keeps the latest ended steps only (an op with thousands of steps stays small).
      if (Object.keys(next.steps).length > STEPS_KEPT) {
        const omitted = this.stepsOmitted.get(id) ?? new Set<string>();
        this.stepsOmitted.set(id, omitted);
        capSteps(next, omitted);
      }
      next.updatedAt = this.deps.clock.now();
      const more = extra ? await extra(i) : [];
      if (await this.commit([{ kind: 'op', value: next, expectRevision: v.modRevision }, ...more])) return next;
    }
    throw new ConflictError(`operation ${id}`);
  }

  private async updateSandbox(
    tenantId: string,
    id: string,
    mutate: (sb: SandboxRec) => void,
    extra?: (sb: SandboxRec, before: SandboxRec) => StoreWrite[] | Promise<StoreWrite[]>,
  ): Promise<SandboxRec> {
    const write = this.sandboxWrite({ tenantId, id }, mutate, undefined, extra);
    for (let i = 0; i < 20; i++) {
      const writes = await write(i);
      if (await this.commit(writes)) return (writes[0] as Extract<StoreWrite, { kind: 'sandbox' }>).value;
    }
    throw new ConflictError(`sandbox ${id}`);
  }

  /**
   * The guarded write that applies `mutate` to a sandbox, as an `updateOp` extra (with
   * `also`'s writes, e.g. the capacity it releases): the first attempt builds on `known` when
   * given (read before the host step: no read on the way to the answer), a retry after a
   * conflict reads the record again. The sandbox write comes first. updateSandbox commits it
   * on its own. `touch` false leaves updatedAt as it was (a write that changes no state).
   */
  private sandboxWrite(
    ref: { tenantId: string; id: string },
    mutate: (sb: SandboxRec) => void,
    known?: Versioned<SandboxRec>,
    also?: (sb: SandboxRec, before: SandboxRec) => StoreWrite[] | Promise<StoreWrite[]>,
    touch = true,
  ): (attempt: number) => Promise<StoreWrite[]> {
    const { tenantId, id } = ref;
    return async (attempt) => {
      const v = attempt === 0 && known ? known : await this.deps.store.getSandbox(tenantId, id);
      if (!v) throw new NotFoundError('sandbox', id);
      const next = structuredClone(v.value);
      mutate(next);
      if (!canTransition(v.value.state, next.state)) throw new WrongStateError('sandbox', id, v.value.state, `cannot become ${next.state}`);
      if (touch) next.updatedAt = this.deps.clock.now();
      return [{ kind: 'sandbox', value: next, expectRevision: v.modRevision }, ...(also ? await also(next, v.value) : [])];
    };
  }

  /**
   * The write that books (`sign` 1) or releases (-1) a sandbox's capacity on its host, guarded by
   * the alloc's revision: passed as `updateSandbox`'s extra so the state change and the booking
   * commit together, and no reader or crash ever sees one without the other.
   */
  private capacity(hostId: string, booking: Booking, sign: 1 | -1): () => Promise<StoreWrite[]> {
    return async () => {
      if (!hostId) return [];
      const a = await this.deps.store.getAlloc(hostId);
      return [{ kind: 'alloc', value: applyBooking(a.value, booking, sign, this.privateMemoryFraction), expectRevision: a.modRevision }];
    };
  }

  /** Private pages of a fork child as a fraction of its memory (PlacementConfig): what its share of an image books. */
  private get privateMemoryFraction(): number {
    return (this.deps.config.placement ?? DEFAULT_PLACEMENT_CONFIG).privateMemoryFraction;
  }

  /**
   * capacity(hostId, res, +1) for a booking no placement made (a lost sandbox taken back):
   * throws NoRoomToReclaimError when what the host has booked plus `res` exceeds its
   * capacity (its record, as the guarded write reads it) in any resource.
   */
  private capacityIfRoom(hostId: string, booking: Booking): () => Promise<StoreWrite[]> {
    const book = this.capacity(hostId, booking, 1);
    return async () => {
      const writes = await book();
      const alloc = writes.find((w) => w.kind === 'alloc');
      const cap = (await this.deps.store.getHost(hostId))?.value.capacity;
      const booked = alloc ? (alloc.value as HostAllocRec).allocated : booking.res;
      if (!cap || booked.vcpus > cap.vcpus || booked.memoryMib > cap.memoryMib || booked.diskMib > cap.diskMib) throw new NoRoomToReclaimError(hostId, booked, cap);
      return writes;
    };
  }

  /**
   * Whether an error ends this run of an operation rather than a part of it: the lead lost (this
   * replica stepped down, or its fence failed) or the store's outcome unknown. The operation
   * runs again (run(), or the next leader), so nothing is undone or recorded as failed for it.
   */
  private endsTheRun(e: unknown): boolean {
    return !this.active || e instanceof StoreUnavailableError || e instanceof NotLeaderError;
  }

  /** Moves a sandbox to `state`, keeping the running-time clock and the host's booked capacity right. */
  private setState(sb: SandboxRec, state: SandboxState, now: number, reason = ''): void {
    delete sb.lostFromOp;
    // A resume owed stays owed while the sandbox is paused or may come back paused (a hibernate
    // of it that fails, its host's return): any other state (running, hibernated, destroyed)
    // settles it. The changes that can meet a marked sandbox come here (pending->starting and
    // hibernated->waking are set directly: neither state carries a mark).
    if (state !== 'paused' && state !== 'hibernating' && state !== 'lost') delete sb.resumeOwed;
    if (sb.state === 'running' && state !== 'running' && sb.runningSince !== null) {
      sb.runningMsBefore += Math.max(0, now - sb.runningSince);
      sb.runningSince = null;
    }
    if (state === 'running' && sb.runningSince === null) sb.runningSince = now;
    if (state === 'running' || state === 'paused') delete sb.hibernatedOnRequest;
    sb.state = state;
    sb.stateReason = reason;
  }

  /**
   * Writes the op's final state; `extra` (see updateOp) commits in the same transaction, e.g.
   * the sandbox state the op ends in, so the answer costs one write, not two. `doneMessage`
   * is the progress message of a success (default "done").
   */
  private async finish(
    op: OperationRec,
    result: OperationRec['result'],
    error: OperationError | null,
    progressDone?: number,
    extra?: (attempt: number) => Promise<StoreWrite[]>,
    doneMessage = 'done',
  ): Promise<void> {
    // Only the leader finishes operations: one that stepped down leaves them to the next.
    if (!this.active) return;
    let state: FinalOperationState = 'succeeded';
    await this.updateOp(
      op.tenantId,
      op.id,
      (o) => {
        // `cancelled` only for an op whose cancel was asked for (a host's error of that kind fails it).
        o.state = state = !error ? 'succeeded' : error.kind === 'cancelled' && o.cancelRequested ? 'cancelled' : 'failed';
        // Keep what placement recorded (the explanation) next to the final result.
        o.result = result ? { ...(o.result ?? {}), ...result } : null;
        // A one-sandbox op (create, wake) that succeeded did its one unit.
        if (progressDone !== undefined) o.progress.done = progressDone;
        else if (!error) o.progress.done = o.progress.total;
        o.error = error;
        o.progress.message = error ? error.message : doneMessage;
      },
      extra,
    );
    this.log.info({ opId: op.id, kind: op.kind, ok: !error, error: error?.message, ...(error?.detail ? { detail: error.detail } : {}) }, 'operation finished');
    this.deps.onFinished?.(op.kind, state, (this.deps.clock.now() - op.createdAt) / 1000);
  }

  /** Whether CancelOperation asked `opId` to stop (the op watch and this leader's writes keep the copy current). */
  private cancelRequested(opId: string): boolean {
    return this.ops.get(opId)?.value.cancelRequested === true;
  }

  /** A safe point of a cancellable op (CANCELLABLE_KINDS): throws OperationCancelledError if it was asked to stop. */
  private stopIfCancelled(op: OperationRec, what?: string): void {
    if (this.cancelRequested(op.id)) throw new OperationCancelledError(what);
  }

  /**
   * Submits (idempotently, by `key`) an operation of this scheduler's own and waits for it
   * to end. Resolves with undefined when it succeeded, else with why not.
   * `needed`, for a key an earlier run may have submitted: history expiry deletes a finished
   * operation with its key FF_RECORD_RETENTION after it ended, and the submit would then start
   * a new one against a target that moved on since (a sandbox woken on another host, or
   * destroyed and its record expired). With no operation under the key, it is submitted only
   * if `needed()` says the work is still to do; otherwise it resolves with undefined (done).
   */
  private async submitAndWait(tenantId: string, key: string, kind: OperationRec['kind'], targetId: string, input: Record<string, unknown>, needed?: () => Promise<boolean>): Promise<string | undefined> {
    if (!this.deps.submit) throw new ForkfleetError('internal', `this scheduler cannot submit operations: it needs to for a ${kind} of its own`);
    if (needed && (await this.deps.store.getIdempotent(tenantId, key)) === undefined && !(await needed())) return undefined;
    const h = await this.submitOwn(tenantId, key, kind, targetId, input);
    for (;;) {
      // Read once this leader no longer runs it (ended, or not yet seen by its watch): a
      // cancelled fork of 256 children read 256 records from etcd 4 times a second meanwhile.
      // Or until this replica stops leading (stop() wakes every sleeper): the read below says so.
      const run = this.running.get(h.id);
      if (run && this.active) {
        let wake: () => void = () => undefined;
        const stopped = new Promise<void>((r) => (wake = r));
        this.sleepers.add(wake);
        await Promise.race([run, stopped]).finally(() => this.sleepers.delete(wake));
      }
      const cur = (await this.deps.store.getOp(tenantId, h.id))?.value;
      if (!this.active) throw new NotLeaderError();
      if (!cur) return `its ${kind} operation ${h.id} is gone`;
      if (isTerminal(cur.state)) return cur.state === 'succeeded' ? undefined : `${cur.error?.message ?? cur.state}`;
      await this.pause(250);
    }
  }

  /**
   * Submits an operation of this scheduler's own (a rule's, retention's, a drain's or a
   * cancel's), as the current leader only. The submit is a write of its own, not through
   * commit(): without this check a pass or a runner that outlived its term (stopped while it
   * waited on the store, or a lease that ran out under it) went on submitting what it decided
   * from its old view, e.g. idle-hibernating a sandbox the new leader had seen become busy.
   */
  private submitOwn(tenantId: string, key: string, kind: OperationRec['kind'], targetId: string, input: Record<string, unknown>): Promise<OperationRec> {
    const submit = this.deps.submit;
    if (!submit) return Promise.reject(new ForkfleetError('internal', `this scheduler cannot submit operations: it needs to for a ${kind} of its own`));
    if (!this.currentRunner() || !this.leading()) return Promise.reject(new NotLeaderError());
    // Fenced too: the check above is at the call, and the submit reads the key before it
    // writes (a read that stalls past the lease would otherwise write for a deposed leader).
    return submit(tenantId, key, kind, targetId, input, this.deps.fence?.());
  }

  /**
   * The end of a cancelled create or fork whose sandboxes started: each is destroyed by a
   * destroy operation of its own, keyed by this op and the sandbox (a re-run after a
   * failover waits for the same ones), then the op ends `cancelled` saying so. A key whose
   * destroy expired with it (a re-run over FF_RECORD_RETENTION later) is submitted again only
   * for a sandbox not destroyed: one whose record is gone too would fail "not found".
   */
  private async destroyForCancel(op: OperationRec, result: OperationRec['result'], sandboxIds: readonly string[], progressDone?: number): Promise<void> {
    const alive = async (id: string): Promise<boolean> => {
      const sb = (await this.deps.store.getSandbox(op.tenantId, id))?.value;
      return sb !== undefined && sb.state !== 'destroyed';
    };
    const ends = await Promise.all(sandboxIds.map(async (id) => ({ id, error: await this.submitAndWait(op.tenantId, `__cancel/${op.id}/${id}`, 'destroy', id, { reason: `${op.kind} ${op.id} cancelled` }, () => alive(id)) })));
    const failed = ends.filter((e) => e.error !== undefined).map((e) => `${e.id}: destroy failed: ${e.error}`);
    const what = sandboxIds.length === 0 ? undefined : `cancelled by a CancelOperation call; destroyed ${sandboxIds.length - failed.length} of the ${sandboxIds.length} sandboxes it had started${failed.length ? `; ${failed.join('; ')}` : ''}`;
    await this.finish(op, result, errorOf(new OperationCancelledError(what)), progressDone);
  }

  // ---------------------------------------------------------------- host steps

  /**
   * Sends one step to a host and waits for its result, re-sending on timeout (the agent
   * dedups by op + step). The step is recorded in the operation before it is sent.
   */
  private async step(op: OperationRec, stepId: string, hostId: string, work: HostWorkMsg['work'], timeoutMs = this.deps.config.stepTimeoutMs): Promise<HostResultMsg> {
    this.stepsInFlight.set(hostId, (this.stepsInFlight.get(hostId) ?? 0) + 1);
    try {
      return await this.stepOnHost(op, stepId, hostId, work, timeoutMs);
    } finally {
      const n = (this.stepsInFlight.get(hostId) ?? 1) - 1;
      if (n > 0) this.stepsInFlight.set(hostId, n);
      else this.stepsInFlight.delete(hostId);
    }
  }

  private async stepOnHost(op: OperationRec, stepId: string, hostId: string, work: HostWorkMsg['work'], timeoutMs: number): Promise<HostResultMsg> {
    const key = stepKey(op.id, stepId);
    let freeResends = FREE_RESENDS;
    // Every send is numbered (HostWork.attempt, and so its JetStream message id: a re-send
    // with the id of the first would be dropped as a duplicate); `attempt` counts against
    // FF_STEP_ATTEMPTS. The step's sends so far (an op run again in this process after the
    // store failed under it sends the same step again) count on from the step log: numbered
    // from 1 again, the new send would carry an earlier one's message id and be dropped.
    // The step's decision (which host does what) is already in etcd (the placement or the
    // sandbox record); the step log is written with the op's progress and final state, not per step.
    const log = this.stepLog.get(op.id) ?? {};
    this.stepLog.set(op.id, log);
    let sends = log[stepId]?.attempt ?? 0;
    /** Whether a send of this run reached the bus (a step none of whose sends did never left this replica). */
    let delivered = false;
    const action = actionName(work.case);
    /** Records the step's end; `attempt` there counts its sends. */
    const ended = (r: HostResultMsg | undefined, attempt = sends): void => {
      const now = this.deps.clock.now();
      const st: StepRec = { hostId, action, status: !r || r.error ? 'failed' : 'done', attempt, endedAt: now };
      const sentAt = log[stepId]?.sentAt;
      if (sentAt !== undefined) st.sentAt = sentAt;
      if (r) addHostReport(st, r);
      if (r && hasBadTime(r)) this.warnOnce(`${hostId}/times`, { hostId, opId: op.id, stepId, duration: r.duration, pause: r.pause, fetch: r.fetch }, 'a host reported a negative or invalid step time; such times are ignored (logged once per host)');
      // Over the fetch alone where the host says how long it took (the step's whole time also
      // counts the restore of each of its VMs: the more children, the slower the host's link
      // looked, for 10 minutes).
      const fetchMs = hostReportedMs(r?.fetch) ?? st.hostMs;
      if (r && !r.error && st.bytesFetched && fetchMs) this.noteFetchRate(hostId, st.bytesFetched, fetchMs);
      log[stepId] = st;
      this.deps.onStepEnded?.(action, st.status === 'done' ? 'succeeded' : 'failed', st.sentAt !== undefined ? (now - st.sentAt) / 1000 : undefined, st.hostMs !== undefined ? st.hostMs / 1000 : undefined);
    };
    for (let attempt = 1; attempt <= this.deps.config.stepAttempts; attempt++) {
      this.assertCurrentRunner();
      const early = this.takeEarly(key);
      if (early) {
        if (isDeadlineAnswer(early.result)) {
          // A send's answer at its deadline (below): the step still ran then; this send asks again.
        } else if (early.fromHost === hostId) {
          // An answer to a send of an earlier leader (this one may not have sent it yet).
          ended(early.result, Math.max(1, sends));
          return this.checkResult(early.result, hostId, stepId);
        } else this.log.warn({ opId: op.id, stepId, hostId, fromHost: early.fromHost }, 'dropped a step result from a host the step was not sent to');
      }
      // A lost host will not answer: fail now, not after every attempt's timeout. (A host
      // that becomes lost while the step waits wakes the waiter: failStepsOn.)
      if (this.cache.hosts.get(hostId)?.value.state === 'lost') {
        ended(undefined);
        throw new HostLostError(hostId, stepId);
      }
      log[stepId] = { hostId, action, status: 'sent', attempt: sends + 1, sentAt: log[stepId]?.sentAt ?? this.deps.clock.now() };
      const result = new Promise<HostResultMsg | typeof HOST_LOST | typeof HOST_RESTARTED | undefined>((resolve) => {
        const waiter: Waiter = {
          hostId,
          resolve: (r) => {
            clearTimeout(t);
            resolve(r);
          },
        };
        const t = setTimeout(() => {
          // Only its own: a rerun of the op (its runner crashed while this waited) waits on the same key.
          if (this.waiters.get(key) === waiter) this.waiters.delete(key);
          resolve(undefined);
        }, timeoutMs);
        this.waiters.set(key, waiter);
      });
      // The agent answers by a little before this send stops being waited for, also when the
      // step hangs there (deadline_exceeded, below): the answer then ends this send's wait, not
      // the next one's.
      const msg = create(HostWorkSchema, { opId: op.id, stepId, attempt: ++sends, tenantId: op.tenantId, work, deadline: timestampFromMs(this.deps.clock.now() + timeoutMs - Math.min(DEADLINE_MARGIN_MS, timeoutMs / 10)) });
      // A publish can fail while NATS is restarting or the connection is re-established:
      // retry it with backoff rather than waiting out the whole step timeout. Sent alone, the
      // retry has the same message id and JetStream drops it if the failed publish was in fact
      // stored; sent in a batch (batcher.ts) it may not, and the agent dedups by op + step.
      let settled = false;
      void result.then(() => (settled = true));
      // (Not from a runner of an earlier term: a re-send would carry this term's stamp.)
      for (let i = 0, delay = 250; !settled && this.leading() && this.currentRunner(); i++, delay = Math.min(delay * 2, 2000)) {
        try {
          await this.deps.bus.sendWork(hostId, msg);
          delivered = true;
          break;
        } catch (e) {
          if (e instanceof ForkfleetError && e.kind === 'resource_exhausted') {
            // Larger than the bus carries (a very large snapshot's manifest): no send will get
            // through, so the step fails now, saying why, instead of after every attempt.
            // (`work`: the step's own size failed it, not the host.)
            this.waiters.get(key)?.resolve(create(HostResultSchema, { opId: op.id, stepId, hostId, attempt: sends, error: { kind: 'resource_exhausted', message: `the step cannot be sent to host ${hostId}: ${e.message}`, retryable: false, field: 'work' } }));
            break;
          }
          this.log.warn({ err: e, opId: op.id, stepId, hostId, try: i + 1 }, 'sending work failed; retrying');
          await new Promise((r) => setTimeout(r, delay));
        }
      }
      const r = await result;
      if (!this.active) throw new StepTimeoutError(hostId, stepId, 0);
      if (r === HOST_LOST) {
        ended(undefined);
        throw new HostLostError(hostId, stepId);
      }
      if (r === HOST_RESTARTED) {
        // The agent that had the step died with it; its work message would come back only
        // after JetStream's ack wait (30 s). Sent again now, it runs at once (the agent
        // answers a step it finished from its journal, so nothing is done twice).
        this.log.info({ opId: op.id, stepId, hostId, attempt }, 'host agent restarted during a step; re-sending it');
        if (freeResends-- > 0) attempt--;
        continue;
      }
      if (r && isDeadlineAnswer(r)) {
        // The agent's answer at a send's deadline: the step still runs there (agent.ts
        // runStep), as after a timeout here. Sent again, the new send waits for that run. One
        // of an earlier send (late, or redelivered after the agent restarted) counts no attempt.
        this.log.warn({ opId: op.id, stepId, hostId, attempt, answered: r.attempt }, 'host step still running at its deadline; re-sending');
        if (r.attempt !== sends && freeResends-- > 0) attempt--;
        continue;
      }
      if (r && r.error?.retryable && r.attempt !== sends) {
        // A retryable failure of an earlier send (late, or redelivered): the agent journals
        // those for their own send only, so this send may still succeed there. Not the step's
        // answer: sent again (the agent's run of it, if any, answers the new send), with no
        // attempt counted, as for a deadline answer.
        this.log.warn({ opId: op.id, stepId, hostId, attempt, answered: r.attempt, kind: r.error.kind }, 'a retryable failure of an earlier send of a host step came late; waiting for the latest send');
        if (freeResends-- > 0) attempt--;
        continue;
      }
      if (r) {
        ended(r);
        return this.checkResult(r, hostId, stepId);
      }
      this.log.warn({ opId: op.id, stepId, hostId, attempt }, 'host step timed out; re-sending');
    }
    ended(undefined);
    throw new StepTimeoutError(hostId, stepId, timeoutMs * this.deps.config.stepAttempts, !delivered);
  }

  /**
   * A host that takes new work now: heard lately, and its agent not stopping (it heartbeats on
   * through its shutdown grace, taking nothing: a copy sent there waited for the next agent).
   */
  private takesWork(hostId: string, now: number): boolean {
    const heard = this.deps.heard.get(hostId);
    return livenessOf(heard?.heardAt, now, this.deps.config.liveness) === 'ready' && heard?.hb.stopping !== true;
  }

  private checkResult(r: HostResultMsg, hostId: string, stepId: string): HostResultMsg {
    if (r.error) throw new HostStepError(hostId, stepId, r.error.kind, r.error.message, r.error.retryable, r.error.field);
    return r;
  }

  // ---------------------------------------------------------------- placement

  private noteFetchRate(hostId: string, bytes: number, hostMs: number): void {
    // A small fetch (most chunks there already) says more about the restore than the transfer.
    if (bytes < FETCH_RATE_MIN_BYTES) return;
    this.fetchRates.note(hostId, (bytes * 1000) / Math.max(1, hostMs), this.deps.clock.now());
  }

  /**
   * Decides a placement over the leader's cache and commits it, with the capacity it books
   * and the records it creates (and the op's own update, when given), in one transaction
   * guarded by the revisions the decision read. Placements are decided one at a time; the
   * ones that queue up while a commit is in flight are decided together (each seeing what
   * the earlier ones booked, exactly as one after another) and committed in one transaction.
   */
  private placeAndBook(op: OperationRec, snapshot: PlaceJob['snapshot'], request: PlaceJob['request'], records: PlaceJob['records'], refresh?: PlaceJob['refresh']): Promise<Placed> {
    return new Promise<Placed>((resolve, reject) => {
      this.placeQueue.push({ op, snapshot, request, records, term: this.runnerTerm.getStore(), resolve, reject, ...(refresh ? { refresh } : {}) });
      // Outside the caller's runner term: the loop serves every runner's jobs, of later terms too.
      if (!this.placeRunning) void this.runnerTerm.exit(() => this.runPlacements());
    });
  }

  private async runPlacements(): Promise<void> {
    this.placeRunning = true;
    try {
      while (this.placeQueue.length > 0) {
        const jobs = this.placeQueue.splice(0, PLACE_GROUP_MAX_JOBS).filter((j) => {
          if (j.term === undefined || j.term === this.term) return true;
          j.reject(new NotLeaderError());
          return false;
        });
        if (jobs.length > 0) await this.placeGroup(jobs);
      }
    } finally {
      this.placeRunning = false;
    }
  }

  /** Places and commits a group of jobs; settles every job it takes (jobs over the size cap go back to the queue). */
  private async placeGroup(jobs: PlaceJob[]): Promise<void> {
    let pending = jobs;
    /** Jobs handed back to the queue: settled by a later group, never by this one. */
    const requeued = new Set<PlaceJob>();
    try {
      for (let attempt = 0; attempt < 10 && pending.length > 0; attempt++) {
        // After a conflict the cache may lag the store: refresh it before re-planning.
        if (attempt > 0) await this.cache.load(this.deps.store);
        const now = this.deps.clock.now();
        const hosts = this.cache.hostsById();
        const revision = Math.max(0, ...hosts.map((h) => h.modRevision), ...[...this.cache.allocs.values()].map((a) => a.modRevision));
        // Booked capacity as this group plans it: each job sees what the earlier ones booked.
        const allocs = new Map([...this.cache.allocs].map(([k, v]) => [k, v.value]));
        // The revisions the plan reads, taken with it: the cache may move on during the awaits below.
        const allocRevs = new Map([...this.cache.allocs].map(([k, v]) => [k, v.modRevision]));
        // And of the host records: a host cordoned, drained or lost since (a cordon is written
        // by an API replica, and reaches this cache by a watch) fails the commit.
        const hostRevs = new Map(hosts.map((h) => [h.value.id, h.modRevision]));
        // And of the records of the snapshots placed from, which must be ready: a delete marks
        // one `deleting` before it looks for sandboxes that use it (runDeleteSnapshot), so a
        // placement either lands before that mark, and the delete finds its sandboxes, or
        // fails its commit and is decided again over the reloaded cache, where it fails.
        const snapshotChecks = new Map<string, StoreWrite>();
        // Only the snapshots this group places from: a view over every snapshot the fleet has
        // cost O(hosts x snapshots) per decision.
        const snapshots = [...new Map(pending.flatMap((j) => (j.snapshot ? [this.cache.snapshot(j.snapshot.tenantId, j.snapshot.id)?.value] : [])).filter((x): x is SnapshotRec => x !== undefined).map((x) => [x.id, x])).values()];
        // Steps in flight per host, plus one per host for each job this group places there
        // (its step is sent after the commit): later jobs of the group see that queue too.
        const inflight = new Map(this.stepsInFlight);
        const failing = this.failingHosts(now);
        const touched = new Set<string>();
        const planned: Array<{ job: PlaceJob; result: Extract<PlacementResult, { ok: true }>; writes: StoreWrite[] }> = [];
        let writeCount = 0;
        let groupBytes = 0;
        const groupKeys = new Set<string>();
        const overflow: PlaceJob[] = [];
        // The link load of this group's plans, taken back if the group does not commit.
        const groupLinkUse: Array<ReturnType<LinkLoads['add']>> = [];
        for (const job of pending) {
          if (overflow.length > 0) {
            overflow.push(job);
            continue;
          }
          try {
            let snapshotCheck: StoreWrite | undefined;
            let viewSnapshots = snapshots;
            if (job.snapshot) {
              const { tenantId, id } = job.snapshot;
              const sv = await this.readSnapshot(tenantId, id);
              if (!sv || sv.value.state !== 'ready') throw new WrongStateError('snapshot', id, sv?.value.state ?? 'gone', 'only a ready snapshot can be restored', 'snapshot_id');
              snapshotCheck = { kind: 'check-snapshot', tenantId, id, expectRevision: sv.modRevision };
              // Decided over the record just read (its commit is guarded by it), not the cache's
              // copy, which may lag it or lack it: placed over that, a ready snapshot was
              // "unknown", and the job failed as a retryable "no capacity".
              viewSnapshots = [...snapshots.filter((x) => x.tenantId !== tenantId || x.id !== id), sv.value];
            }
            // Hosts that failed starts of this job's kind lately: as if steps were queued there.
            const penalties = failing[job.snapshot ? 'restore' : 'image'];
            const ownInflight = penalties.size === 0 ? inflight : new Map(inflight);
            for (const [h, n] of penalties) ownInflight.set(h, (ownInflight.get(h) ?? 0) + n);
            const view = buildFleetView(fleetViewInput({ hosts: hosts.map((h) => h.value), allocs, heard: this.deps.heard, snapshots: viewSnapshots, revision, now, liveness: this.deps.config.liveness, chunkBytes: this.deps.config.chunkBytes, ownInflight, fetchRates: this.fetchRates.current(now), linkLoads: this.linkLoads.current(now), pendingDiskMib: this.linkLoads.pendingDiskMib(now) }));
            const req = job.request(view);
            // Seeded by the request's id (each migration of a drain has its own), as the library
            // documents, so the first attempt's decision replays from its explanation.
            const result = place(view, req, rngForRequest(attempt === 0 ? req.id : `${req.id}/${attempt}`), this.deps.config.placement);
            if (!result.ok && result.reason === 'unknown_snapshot') throw new WrongStateError('snapshot', job.snapshot?.id ?? '', 'recorded without a VM configuration', 'it cannot be restored', 'snapshot_id');
            if (!result.ok) throw largerThanAnyHost(view, req) ?? placementFailure(result.explanation);
            const { perChild, writes, opUpdate } = job.records(result);
            const perHost = new Map<string, number>();
            for (const p of result.placements) perHost.set(p.hostId, (perHost.get(p.hostId) ?? 0) + 1);
            const fresh = [...perHost.keys()].filter((h) => !touched.has(h));
            const newHosts = fresh.length;
            // Each new host adds its capacity write and its record's guard.
            const size = writes.length + 2 * newHosts + (opUpdate ? 1 : 0);
            const recordBytes = writeBytes(writes);
            // The API refuses forks whose children cannot fit one transaction; one whose
            // inherited hooks make it too large anyway fails here, before it books anything.
            // (Its records alone, as the API counts them: the capacity records fit in the room
            // PLACEMENT_TXN_MAX_BYTES leaves below etcd's request limit.)
            if (recordBytes > PLACEMENT_TXN_MAX_BYTES) throw new InvalidArgumentError('count', `this placement writes ~${recordBytes} bytes of records (${writes.length} writes) in one transaction; at most ${PLACEMENT_TXN_MAX_BYTES} fit: fewer children, or smaller labels and after_resume hooks`);
            // A group of placements counts its hosts' capacity records too: one count per image
            // shared there (images), which on a host running children of many snapshots is no
            // longer a few dozen bytes.
            let bytes = recordBytes;
            for (const h of fresh) bytes += allocRecordBytes(allocs.get(h));
            // A transaction writes a key once: a job that writes a record an earlier job of the
            // group writes (two operations on one sandbox) waits for the next group, where its
            // guard decides, as when placements ran one at a time.
            const jobKeys = [...writes.map(writeKey), ...(opUpdate ? [`op/${job.op.tenantId}/${job.op.id}`] : [])];
            // Capacity records too: the group writes one per host it books (allocWrites below),
            // so a job that writes one itself (a release off a lost host) and a job that books
            // that host wait for different groups.
            const booksReleased = [...perHost.keys()].some((h) => groupKeys.has(`alloc/${h}`));
            const releasesBooked = jobKeys.some((k) => k.startsWith('alloc/') && touched.has(k.slice('alloc/'.length)));
            if (planned.length > 0 && (writeCount + size > PLACE_GROUP_MAX_WRITES || groupBytes + bytes > PLACEMENT_TXN_MAX_BYTES || jobKeys.some((k) => groupKeys.has(k)) || booksReleased || releasesBooked)) {
              overflow.push(job); // decided again in the next group
              continue;
            }
            for (const k of jobKeys) groupKeys.add(k);
            const opWrites: StoreWrite[] = [];
            if (opUpdate) {
              // The op's own updates (run() marks it running without waiting) land first: this
              // write is guarded by the revision they leave.
              await this.opChains.get(job.op.id)?.catch(() => undefined);
              const cur = (attempt === 0 ? this.ops.get(job.op.id) : undefined) ?? (await this.deps.store.getOp(job.op.tenantId, job.op.id));
              if (!cur) throw new NotFoundError('operation', job.op.id);
              // A fork or create cancelled while it waited for its placement (or on the re-read
              // after a conflict with the cancel's own write): nothing is placed or booked. Not a
              // fork placing children again after a host loss (its restore round fails them, as
              // cancelled), nor a drain's migration under way (a cancel lets it end as it ends).
              if (cur.value.cancelRequested && (cur.value.kind === 'fork' || cur.value.kind === 'create') && !cur.value.result?.sandboxIds) throw new OperationCancelledError();
              const next = structuredClone(cur.value);
              opUpdate(next);
              next.updatedAt = now;
              opWrites.push({ kind: 'op', value: next, expectRevision: cur.modRevision });
            }
            // Book capacity on every chosen host.
            for (const [hostId, n] of perHost) {
              let alloc = allocs.get(hostId) ?? { hostId, allocated: ZERO, sandboxes: 0 };
              const booking = typeof perChild === 'function' ? perChild(hostId) : perChild;
              for (let i = 0; i < n; i++) alloc = applyBooking(alloc, booking, 1, this.privateMemoryFraction);
              allocs.set(hostId, alloc);
              inflight.set(hostId, (inflight.get(hostId) ?? 0) + 1);
              touched.add(hostId);
            }
            if (snapshotCheck) snapshotChecks.set(writeKey(snapshotCheck), snapshotCheck);
            planned.push({ job, result, writes: [...writes, ...opWrites] });
            // Later jobs of the group, and later groups, see its copies on the links.
            groupLinkUse.push(this.linkLoads.add(result.transferPlan?.transfers ?? [], now));
            writeCount += size;
            groupBytes += bytes;
          } catch (e) {
            // This job alone fails (no capacity, its op is gone, ...); it booked nothing yet.
            job.reject(e);
          }
        }
        for (const job of overflow) requeued.add(job);
        if (overflow.length > 0) this.placeQueue.unshift(...overflow);
        if (planned.length === 0) return;
        // One write per touched host's capacity, guarded by the alloc revision this plan read.
        const allocWrites: StoreWrite[] = [...touched].map((hostId) => ({ kind: 'alloc', value: allocs.get(hostId)!, expectRevision: allocRevs.get(hostId) ?? 0 }));
        const hostChecks: StoreWrite[] = [...touched].map((id) => ({ kind: 'check-host', id, expectRevision: hostRevs.get(id) ?? 0 }));
        const rev = await this.commit([...allocWrites, ...hostChecks, ...snapshotChecks.values(), ...planned.flatMap((p) => p.writes)]).catch((e: unknown) => {
          for (const u of groupLinkUse) this.linkLoads.remove(u);
          throw e;
        });
        if (rev) {
          for (const p of planned) p.job.resolve({ result: p.result, revision: rev });
          return;
        }
        for (const u of groupLinkUse) this.linkLoads.remove(u);
        this.log.debug({ opIds: planned.map((p) => p.job.op.id), attempt }, 'placement commit conflicted; re-planning');
        if (planned.length > 1) {
          // The conflict may be one job's own guard (a record its caller read that changed
          // since, or a placement of it that landed already): re-planned together, that job
          // would fail the whole group every time. Each job is placed on its own instead and
          // fails, if it does, alone.
          pending = [];
          for (const p of planned) await this.placeGroup([p.job]);
          return;
        }
        // A job's own records may be what changed: it re-reads them first (a job with nothing
        // left to place ends here). A store failure fails the group, below.
        const again: PlaceJob[] = [];
        for (const p of planned) {
          try {
            await p.job.refresh?.();
            again.push(p.job);
          } catch (e) {
            if (e instanceof StoreUnavailableError) throw e;
            p.job.reject(e);
          }
        }
        pending = again;
      }
      for (const job of pending) job.reject(new ConflictError('host capacity (too many concurrent placements)'));
    } catch (e) {
      // The store failed (a cache reload or the commit): the jobs of this group fail with it.
      for (const job of pending) if (!requeued.has(job)) job.reject(e);
    }
  }

  /**
   * What a host that lacks a snapshot needs to fetch it: its sources (the planned source
   * first, then every other holder that is not lost), a ticket for this destination and the
   * scheduler's manifest signature; undefined when the host already holds it. `migrate`:
   * the host may restore by migration from a source instead (ADR 0015) and then does not hold
   * the snapshot afterwards; off where it must hold it (a drain, a fan-out relay).
   */
  private fetchPlan(sn: SnapshotRec, hostId: string, plannedSource?: string, migrate = true): object | undefined {
    const heardHolds = this.deps.heard.holds(hostId, sn.id);
    if (sn.hostIds.includes(hostId) || heardHolds) return undefined;
    const now = this.deps.clock.now();
    const alive = (h: string): boolean => livenessOf(this.deps.heard.get(h)?.heardAt, now, this.deps.config.liveness) !== 'lost';
    const holders = [...new Set([...(plannedSource ? [plannedSource] : []), ...sn.hostIds, ...this.deps.heard.holders(sn.id)])].filter((h) => h !== hostId);
    const sources = [...holders.filter(alive), ...holders.filter((h) => !alive(h))];
    if (sources.length === 0) throw new WrongStateError('snapshot', sn.id, 'held by no host', `host ${hostId} cannot fetch it`);
    return {
      snapshotId: sn.id,
      // A migration (unverifiable RAM and device state) only from the host that took the
      // snapshot, while it is recorded holding it: never from one that merely says so in its
      // heartbeat, nor from one that copied it (a relay, a drain's copy, a wake replica). Each
      // could stream a VM of its own making as the snapshot (chunks are verified, a migration
      // stream is not); the host that took it ran the guest it was taken of anyway.
      sources: sources.map((h) => ({ hostId: h, address: this.cache.hosts.get(h)?.value.peerAddress ?? '', mayMigrate: migrate && h === sn.takenOn && sn.hostIds.includes(h) })),
      ticket: this.deps.signer.ticket(sn.id, hostId, migrate),
      manifest: { signature: Buffer.from(sn.manifestSignature, 'base64'), keyId: sn.manifestKeyId },
      allowMigration: migrate,
    };
  }

  /**
   * Group commit: batches that arrive while a transaction is in flight are merged into the
   * next one (each write keeps its own revision guard; at most GROUP_COMMIT_MAX_WRITES writes
   * per transaction, under etcd's default --max-txn-ops of 128 with the seed compare). When
   * the merged transaction conflicts, every batch is committed again on its own, so one
   * batch's stale guard never fails another's. Resolves each batch's own outcome (its
   * revision, or 0 on a conflict). Used for the sandbox records a fork's host steps mark
   * running: tens of hosts answer within milliseconds, and one transaction each was the
   * leader's largest etcd cost.
   */
  private commitGrouped(writes: StoreWrite[]): Promise<number> {
    return new Promise<number>((resolve, reject) => {
      this.groupQueue.push({ writes, term: this.runnerTerm.getStore(), resolve, reject });
      if (!this.groupFlushing) void this.runnerTerm.exit(() => this.flushGroups());
    });
  }

  private async flushGroups(): Promise<void> {
    this.groupFlushing = true;
    try {
      while (this.groupQueue.length > 0) {
        const batch: typeof this.groupQueue = [];
        let n = 0;
        while (this.groupQueue.length > 0 && (batch.length === 0 || n + this.groupQueue[0]!.writes.length <= GROUP_COMMIT_MAX_WRITES)) {
          const b = this.groupQueue.shift()!;
          // A batch of a runner of an earlier term writes nothing (commit's own check cannot
          // see it: the flush runs outside every runner's term).
          if (b.term !== undefined && b.term !== this.term) {
            b.reject(new NotLeaderError());
            continue;
          }
          batch.push(b);
          n += b.writes.length;
        }
        if (batch.length === 0) continue;
        try {
          const rev = batch.length === 1 ? 0 : await this.commit(batch.flatMap((b) => b.writes));
          if (rev) {
            for (const b of batch) b.resolve(rev);
            continue;
          }
          // One batch alone, or the merged commit conflicted: each batch on its own.
          await Promise.all(batch.map((b) => this.commit(b.writes).then(b.resolve, b.reject)));
        } catch (e) {
          for (const b of batch) b.reject(e);
        }
      }
    } finally {
      this.groupFlushing = false;
    }
  }

  /**
   * Marks sandboxes that a host step started as running, in one transaction guarded by the
   * revisions the caller knows (group-committed with other hosts' batches); falls back to one
   * guarded update each after a conflict.
   */
  /** Marks the children running; resolves with the ids it did (not those that moved on meanwhile). */
  private async markRunning(sbs: ReadonlyArray<{ rec: SandboxRec; rev: number }>): Promise<string[]> {
    const now = this.deps.clock.now();
    const writes: StoreWrite[] = sbs.map(({ rec, rev }) => {
      // A shallow copy: only top-level fields change (setState, opId, updatedAt).
      const next = { ...rec };
      this.setState(next, 'running', now, rec.stateReason);
      next.opId = '';
      next.updatedAt = now;
      return { kind: 'sandbox', value: next, expectRevision: rev };
    });
    if (writes.length && (await this.commitGrouped(writes))) return sbs.map((c) => c.rec.id);
    const marked: string[] = [];
    for (const { rec } of sbs) {
      try {
        await this.updateSandbox(rec.tenantId, rec.id, (s) => {
          this.setState(s, 'running', now, rec.stateReason);
          s.opId = '';
        });
        marked.push(rec.id);
      } catch (e) {
        if (!(e instanceof WrongStateError) && !(e instanceof NotFoundError)) throw e;
        // Moved on while its restore ran (destroyed by its user, failed by a timeout): the
        // other children still become running. Its VM, which the restore made after a
        // destroy may have found nothing to stop, is stopped (a no-op if it went already).
        this.log.info({ sandboxId: rec.id, hostId: rec.hostId, err: (e as Error).message }, 'child moved on during its restore; stopping its VM');
        void this.sendHostWork(rec.hostId, `moved-on-${rec.id}`, rec.tenantId, `stop/${rec.id}`, stopVm(rec.id), 'could not stop the VM of a child that moved on during its restore');
      }
    }
    return marked;
  }

  private prefs(p: PlacementPrefs | undefined): PlacementRequest['preferences'] {
    if (!p) return {};
    return {
      locality: p.locality,
      spread: p.spread,
      ...(p.maxPerHost ? { maxPerHost: p.maxPerHost } : {}),
      ...(p.hostId ? { pinnedHostId: p.hostId } : {}),
    };
  }

  // ---------------------------------------------------------------- operations

  private async run(tenantId: string, opId: string): Promise<void> {
    // The store failing under a step (etcd unreachable, or a write whose answer was lost)
    // does not fail the op: its outcome is unknown, and the op is still recorded as running.
    // It runs again, from its record read afresh, as the next leader would run it: every
    // kind is written to be re-run. Until the store answers or this replica stops leading.
    for (let attempt = 0; ; attempt++) {
      try {
        return await this.runOnce(tenantId, opId);
      } catch (e) {
        // A full etcd reaches here only when even the op's failure could not be recorded
        // (runOnce fails the op on it): it runs again too, more slowly, once an operator has
        // made room. A write too large for etcd fails the op in runOnce and ends there.
        if (!(e instanceof StoreUnavailableError || e instanceof StoreFullError) || !this.active) throw e;
        // Jittered, so the ops that waited out one outage do not all run again at once.
        const delay = Math.round(Math.min(e instanceof StoreFullError ? STORE_FULL_RETRY_MAX_MS : STORE_RETRY_MAX_MS, STORE_RETRY_FIRST_MS * 2 ** attempt) * (0.5 + Math.random() / 2));
        this.log.warn({ err: e, opId, attempt: attempt + 1, retryInMs: delay }, 'the fleet store failed under an operation; running it again');
        await this.pause(delay);
        if (!this.active) return;
        this.ops.delete(opId);
      }
    }
  }

  /** Sleeps `ms`, or until this replica stops leading (stop() wakes every sleeper). */
  private pause(ms: number): Promise<void> {
    return new Promise((resolve) => {
      const wake = (): void => {
        clearTimeout(t);
        this.sleepers.delete(wake);
        resolve();
      };
      const t = setTimeout(wake, ms);
      this.sleepers.add(wake);
    });
  }

  private async runOnce(tenantId: string, opId: string): Promise<void> {
    // The copy maybeRun just took from this term's watch or list (stop() drops every copy, so
    // none is left from an earlier term); a copy that is stale by now only costs the first
    // guarded write a re-read. Without one, read etcd.
    const v = this.ops.get(opId) ?? (await this.deps.store.getOp(tenantId, opId));
    if (!v) return;
    if (isTerminal(v.value.state)) {
      // Ended (its final write landed though its answer was lost, say): older copies that
      // the watch may still deliver do not start it again (maybeRun).
      this.finishedAt.set(opId, Math.max(this.finishedAt.get(opId) ?? 0, v.modRevision));
      return;
    }
    this.ops.set(opId, v);
    let op = v.value;
    if (op.state === 'pending') {
      // Recorded while the work goes on, not before it: later updates of this op queue
      // behind this one (updateOp), and a crash in between leaves a pending op that the next
      // leader runs again, as it would a running one.
      this.updateOp(tenantId, opId, (o) => (o.state = 'running')).catch((e: unknown) => this.log.warn({ err: e, opId }, 'could not mark the operation running'));
      op = { ...op, state: 'running' };
    }
    try {
      switch (op.kind) {
        case 'create':
          return await this.runCreate(op);
        case 'fork':
          return await this.runFork(op);
        case 'snapshot':
          return await this.runSnapshot(op);
        case 'pause':
        case 'resume':
          return await this.runPauseResume(op);
        case 'hibernate':
          return await this.runHibernate(op);
        case 'wake':
          return await this.runWake(op);
        case 'destroy':
          return await this.runDestroy(op);
        case 'delete_snapshot':
          return await this.runDeleteSnapshot(op);
        case 'drain':
          return await this.runDrain(op);
        default:
          return await this.finish(op, null, { kind: 'failed_precondition', message: `operation kind ${op.kind} is not supported by this scheduler version`, retryable: false });
      }
    } catch (e) {
      // Stepping down is not a failure: the next leader re-runs the operation. A fenced write
      // may find the lead gone before this replica learns it (its writes fail from then on).
      if (!this.active || e instanceof NotLeaderError) return;
      // The store's outcome is unknown: run() runs the op again (failing it would need the store too).
      if (e instanceof StoreUnavailableError) throw e;
      this.log.warn({ err: e, opId: op.id, kind: op.kind }, 'operation failed');
      // A fork that placed its children keeps listing them (each in the state it ended in).
      const placed = op.kind === 'fork' ? this.ops.get(op.id)?.value.result?.sandboxIds : undefined;
      // A pause or resume lets go of its sandbox in the same write (vmStateHoldEnded).
      const ended = op.kind === 'drain' ? this.drainEnded(op) : op.kind === 'pause' || op.kind === 'resume' ? this.vmStateHoldEnded(op) : undefined;
      await this.finish(op, placed ? { sandboxIds: placed } : null, errorOf(e), undefined, ended);
    }
  }

  private vmSpec(sb: SandboxRec): ReturnType<typeof create<typeof VmSpecSchema>> {
    return create(VmSpecSchema, {
      sandboxId: sb.id,
      hostname: sb.hostname,
      resources: { vcpus: sb.resources.vcpus, memoryMib: BigInt(sb.resources.memoryMib), diskMib: BigInt(sb.resources.diskMib) },
      network: { allowEgress: sb.allowEgress, allowCidrs: sb.allowCidrs ?? [] },
      afterResume: hooksOf(sb),
    });
  }

  /**
   * The stateReason a restore or resume leaves: the agent's report of a failed
   * after_resume hook (the sandbox runs regardless), else empty.
   */
  private hookReport(r: HostResultMsg | undefined, sandboxId: string): string {
    const report = r?.vms.find((v) => v.sandboxId === sandboxId)?.reason ?? '';
    if (!report) return '';
    // Whole in the log; in the state reason, as a tenant may read a host's text.
    this.log.warn({ sandboxId, hostId: r?.hostId, opId: r?.opId, report }, 'after_resume hook failed');
    return hostReasonForTenant(report);
  }

  private async runCreate(op: OperationRec): Promise<void> {
    const v = await this.deps.store.getSandbox(op.tenantId, op.targetId);
    if (!v) throw new NotFoundError('sandbox', op.targetId);
    let sb = v.value;
    // Cancelled before it was placed: nothing was booked; the sandbox fails.
    if (sb.state === 'pending' && this.cancelRequested(op.id)) return void (await this.failAndSettle(op, new OperationCancelledError(), 'pending', () => 'failed'));
    const prefs = (op.input as { placement?: PlacementPrefs }).placement;
    /** Placement's request for this sandbox, kept off `avoid` (hosts its start failed on). */
    const request = (avoid: readonly string[]) => (): PlacementRequest => {
      const preferences = { ...this.prefs(prefs), ...(avoid.length > 0 ? { avoidHostIds: avoid } : {}) };
      return sb.sourceSnapshotId
        ? { kind: 'restore', id: op.id, nowMs: this.deps.clock.now(), snapshotId: sb.sourceSnapshotId, overlayDiskMib: sb.resources.diskMib, preferences }
        : { kind: 'create', id: op.id, nowMs: this.deps.clock.now(), resources: sb.resources, preferences };
    };
    const snapshotRef = sb.sourceSnapshotId ? { tenantId: sb.tenantId, id: sb.sourceSnapshotId } : undefined;
    if (sb.state === 'pending') {
      const sandboxRev = v.modRevision;
      const placed = this.placeAndBook(
        op,
        snapshotRef,
        request([]),
        (res) => {
          const next = structuredClone(sb);
          next.state = 'starting';
          next.hostId = res.placements[0]!.hostId;
          next.opId = op.id;
          next.updatedAt = this.deps.clock.now();
          sb = next;
          const source = res.transferPlan?.transfers.find((t) => t.destinationHostId === next.hostId)?.sourceHostId;
          return {
            perChild: { res: sb.resources },
            writes: [{ kind: 'sandbox', value: next, expectRevision: sandboxRev }],
            opUpdate: (o) => {
              o.result = { explanation: compactExplanation(res.explanation) };
              if (source) (o.input as { transferSource?: string }).transferSource = source;
              o.progress = { done: 0, total: 1, message: `booting on ${next.hostId}`, bytesTransferred: 0 };
            },
          };
        },
      );
      const ok = await placed.then(
        () => true,
        async (e: unknown) => {
          // A placement commit whose answer was lost may have landed all the same (see
          // runFork): then the sandbox is starting, booked, on behalf of this op.
          const now = await this.deps.store.getSandbox(op.tenantId, op.targetId);
          if (now?.value.state === 'starting' && now.value.opId === op.id) {
            sb = now.value;
            return true;
          }
          // No host could take it (or the snapshot it starts from is gone): nothing was booked.
          return this.failAndSettle(op, e, 'pending', () => 'failed');
        },
      );
      if (!ok) return;
    }
    // Cancelled, and a re-run after a failover finds it past its step: failed at a safe point
    // (the op ends cancelled), or started (running, or already being destroyed by this
    // cancel: its keyed destroy op is waited for again).
    if (this.cancelRequested(op.id) && sb.state !== 'starting') {
      if (sb.state === 'failed') return this.finish(op, { sandboxIds: [sb.id] }, errorOf(new OperationCancelledError()));
      return this.destroyForCancel(op, { sandboxIds: [sb.id] }, [sb.id]);
    }
    if (sb.state !== 'starting') {
      // Already past this point (re-run after a failover).
      return this.finish(op, { sandboxIds: [sb.id] }, sb.state === 'running' ? null : { kind: 'failed_precondition', message: `sandbox is ${sb.state}`, retryable: false });
    }
    /** The host fetched the snapshot for this start and holds it now (storedThere). */
    let fetched = false;
    /** Hosts this op's start failed on before (recorded with each move off one: a re-run knows them). */
    let tried = createHostsTried(op);
    const startKind: StartKind = sb.sourceSnapshotId ? 'restore' : 'image';
    // A run again after a move (a failover, or a store outage under its commit): the hosts it
    // was moved off are told to give it up once more. The first run told them after its
    // commit, and may have died (or lost the commit's answer) before it did: a host that timed
    // out would otherwise run its queued start and make a second, unbooked VM.
    for (const h of tried) if (h !== sb.hostId) this.giveUpOn(h, op, sb.id);
    for (;;) {
      try {
        // Cancelled after it was placed, before its step: the sandbox fails and its booking goes (below).
        this.stopIfCancelled(op);
        let work: HostWorkMsg['work'];
        if (sb.sourceSnapshotId) {
          // A restore on a host that lacks the snapshot needs sources, a ticket and the
          // manifest signature, exactly like a fork's cold hosts.
          // Placed (its placement was guarded by the snapshot's record), it goes on while the
          // record is there in any state but deleted or failed, as a fork's placed children do: a
          // delete that marked it `deleting` meanwhile finds this sandbox using it and keeps it.
          const snv = await this.readSnapshot(sb.tenantId, sb.sourceSnapshotId);
          if (!snv || snv.value.state === 'deleted' || snv.value.state === 'failed') throw new NotFoundError('snapshot', sb.sourceSnapshotId);
          const fetch = this.fetchPlan(snv.value, sb.hostId, (op.input as { transferSource?: string }).transferSource);
          fetched = fetch !== undefined;
          work = { case: 'restoreVms', value: { snapshotId: sb.sourceSnapshotId, vms: [this.vmSpec(sb)], ...(fetch ? { fetch } : {}) } as never };
        } else {
          work = { case: 'createVm', value: { vm: this.vmSpec(sb), image: sb.image } as never };
        }
        // A step of its own per host (the first one's is 'create'): each host's journal answers its own.
        const r = await this.step(op, tried.length === 0 ? 'create' : `create/${sb.hostId}`, sb.hostId, work);
        fetched = !!sb.sourceSnapshotId && storedThere(fetched, r);
        this.startWorked(sb.hostId, startKind);
        break;
      } catch (e) {
        // A store that failed under the step's preparation fails nothing: the op runs again. A
        // cancel before the step may follow a step an earlier run sent (a failover, or a store
        // outage after it): its VM is stopped (a stop of a VM never made does nothing).
        if (!this.active || e instanceof StoreUnavailableError) throw e;
        let end = e;
        const hostsFault = startFailedOnHost(e);
        if (hostsFault) this.noteFailedStart(sb.hostId, startKind, e);
        if (hostsFault && tried.length + 1 < CREATE_HOSTS && !prefs?.hostId && !this.cancelRequested(op.id)) {
          const moved = await this.placeCreateAgain(op, sb, e, snapshotRef, request([...tried, sb.hostId])).catch((again: unknown) => {
            // Cancelled meanwhile: it ends so. No other host could take it: it ends on its host's failure.
            if (!this.active || again instanceof StoreUnavailableError) throw again;
            if (again instanceof OperationCancelledError) end = again;
            else this.log.warn({ err: again, opId: op.id, sandboxId: sb.id, hostId: sb.hostId }, 'a start failed on its host, and the sandbox could not be placed on another');
            return undefined;
          });
          if (moved) {
            tried = [...tried, sb.hostId];
            sb = moved;
            fetched = false;
            continue;
          }
        }
        await this.failSandbox(sb, end, end instanceof OperationCancelledError);
        throw end;
      }
    }
    // Bookkeeping, as for a fork or a wake: the VM runs whatever this meets.
    if (fetched) await this.addHolderKeptBy(op, sb.sourceSnapshotId, sb.hostId);
    if (this.cancelRequested(op.id)) {
      // Cancelled while it started: it runs (recorded so, with no op on it), then is destroyed.
      const now = this.deps.clock.now();
      await this.updateSandbox(sb.tenantId, sb.id, (s) => {
        if (s.state !== 'starting' || s.opId !== op.id) return;
        this.setState(s, 'running', now);
        s.opId = '';
      });
      return this.destroyForCancel(op, { sandboxIds: [sb.id] }, [sb.id]);
    }
    await this.finishRunning(op, sb);
  }

  /**
   * A start of `kind` failed on `hostId` for the host's own reasons (`e`): placement prefers
   * other hosts for such starts for a while (FAILED_START_QUEUE). A failure of the whole host
   * (no answer in time, the host lost, a step still running at its deadline) counts for every
   * kind: it says nothing of what the start was.
   */
  private noteFailedStart(hostId: string, kind: StartKind, e: unknown): void {
    const wholeHost = e instanceof StepTimeoutError || e instanceof HostLostError || (e instanceof HostStepError && e.kind === 'deadline_exceeded');
    const f = this.failedStarts.get(hostId) ?? {};
    for (const k of wholeHost ? (['image', 'restore'] as const) : [kind]) f[k] = { count: (f[k]?.count ?? 0) + 1, at: this.deps.clock.now() };
    this.failedStarts.set(hostId, f);
  }

  /** A start of `kind` worked on `hostId`: its earlier failures of that kind no longer count. */
  private startWorked(hostId: string, kind: StartKind): void {
    const f = this.failedStarts.get(hostId);
    if (!f?.[kind]) return;
    delete f[kind];
    if (!f.image && !f.restore) this.failedStarts.delete(hostId);
  }

  /** Per kind of start, the queued steps placement counts on each host that failed such starts lately (FAILED_START_QUEUE); forgets old failures. */
  private failingHosts(now: number): Record<StartKind, Map<string, number>> {
    const out: Record<StartKind, Map<string, number>> = { image: new Map(), restore: new Map() };
    for (const [hostId, f] of this.failedStarts) {
      for (const kind of ['image', 'restore'] as const) {
        const k = f[kind];
        if (k && k.at > now - FAILED_STARTS_MS) out[kind].set(hostId, FAILED_START_QUEUE * Math.min(k.count, FAILED_STARTS_COUNTED));
        else delete f[kind];
      }
      if (!f.image && !f.restore) this.failedStarts.delete(hostId);
    }
    return out;
  }

  /**
   * Tells `hostId`, which a sandbox of `op` was taken off (placed on another host after that
   * host was lost or failed its start), to give it up: a start of it still queued or running
   * there makes no VM, or stops the one it made (a give-up stop, agent.ts). Not waited for.
   */
  private giveUpOn(hostId: string, op: OperationRec, sandboxId: string): void {
    void this.sendHostWork(hostId, op.id, op.tenantId, `stop-replaced/${sandboxId}`, stopVm(sandboxId), 'could not tell a host to give up a sandbox placed on another');
  }

  /**
   * A create whose start failed on its host for the host's reasons (startFailedOnHost) is
   * placed on another, off every host it failed on (`request` avoids them), in one
   * transaction: the sandbox record moves there (starting, this op's), the failed host's
   * booking goes, and the op's input records the hosts (createHostsTried), so that a re-run
   * after a failover avoids them too. The failed host is then told to stop the VM, as a lost fork child's is (a start given
   * up on may yet run there). Undefined when the sandbox moved on meanwhile (a destroy): the
   * caller fails it as before. Rejects when no other host can take it.
   */
  private async placeCreateAgain(op: OperationRec, sb: SandboxRec, e: unknown, snapshot: PlaceJob['snapshot'], request: PlaceJob['request']): Promise<SandboxRec | undefined> {
    const from = sb.hostId;
    const still = async (): Promise<Versioned<SandboxRec> | undefined> => {
      const v = await this.deps.store.getSandbox(op.tenantId, sb.id);
      return v && v.value.state === 'starting' && v.value.hostId === from && v.value.opId === op.id ? v : undefined;
    };
    let cur = await still();
    if (!cur) return undefined;
    const message = errorOf(e).message;
    this.log.warn({ opId: op.id, sandboxId: sb.id, hostId: from, err: e }, 'a start failed on its host: placing the sandbox on another');
    let next: SandboxRec | undefined;
    await this.placeAndBook(
      op,
      snapshot,
      request,
      (res) => {
        const now = this.deps.clock.now();
        next = { ...cur!.value, hostId: res.placements[0]!.hostId, stateReason: `its start on host ${from} failed (${message}): placed on another`, updatedAt: now };
        const placedOn = next.hostId;
        const source = res.transferPlan?.transfers.find((t) => t.destinationHostId === placedOn)?.sourceHostId;
        // The failed host's booking, taken off as the cache has it (a stale revision conflicts
        // and the group is planned again on a reloaded cache).
        const a = this.cache.allocs.get(from);
        const release: StoreWrite = { kind: 'alloc', value: applyBooking(a?.value ?? { hostId: from, allocated: ZERO, sandboxes: 0 }, bookingOf(cur!.value), -1, this.privateMemoryFraction), expectRevision: a?.modRevision ?? 0 };
        return {
          perChild: { res: next.resources },
          writes: [{ kind: 'sandbox', value: next, expectRevision: cur!.modRevision }, release],
          opUpdate: (o) => {
            // The decision the sandbox runs by now.
            o.result = { ...o.result, explanation: compactExplanation(res.explanation) };
            const input = o.input as { transferSource?: string; startFailedOn?: string[] };
            input.startFailedOn = [...createHostsTried(o), from];
            if (source) input.transferSource = source;
            else delete input.transferSource;
            o.progress = { done: 0, total: 1, message: `booting on ${placedOn} (its start on ${from} failed)`, bytesTransferred: 0 };
          },
        };
      },
      // The sandbox changed meanwhile (destroyed by its user, say): nothing is left to place.
      async () => {
        cur = await still();
        if (!cur) throw new WrongStateError('sandbox', sb.id, 'moved on', 'its start failed, and it changed since');
      },
    );
    this.giveUpOn(from, op, sb.id);
    return next;
  }

  /**
   * Fails `op` and, in the same transaction, moves its sandbox from the transitional state
   * `from` the op put it in to `to(record)`, if it is still there and the op's own: a failed
   * create, hibernate or wake never leaves a sandbox that no call can move on (a hibernating
   * one refuses hibernate, resume and destroy; a pending one counts against quota). `also`
   * (the record as read, and the one to write, which it may finish) adds writes to the same
   * transaction. Returns
   * false for the callers' `placed.then(...)`. Rethrows when this replica no longer leads
   * (the next leader re-runs the op instead) and when the store failed (StoreUnavailableError:
   * run() runs the op again).
   */
  private async failAndSettle(op: OperationRec, e: unknown, from: SandboxState, to: (sb: SandboxRec) => SandboxState, also?: (sb: SandboxRec, next: SandboxRec) => Promise<StoreWrite[]>, reason?: string): Promise<false> {
    // Stepped down, or the store's outcome is unknown: the op runs again (run()), not failed.
    if (!this.active || e instanceof StoreUnavailableError) throw e;
    this.log.warn({ err: e, opId: op.id, kind: op.kind }, 'operation failed');
    const error = errorOf(e);
    await this.finish(op, null, error, undefined, async () => {
      const v = await this.deps.store.getSandbox(op.tenantId, op.targetId);
      if (!v || v.value.state !== from || (v.value.opId !== '' && v.value.opId !== op.id)) return [];
      const next = structuredClone(v.value);
      const now = this.deps.clock.now();
      this.setState(next, to(v.value), now, reason ?? (e instanceof OperationCancelledError ? `${op.kind} cancelled` : `${op.kind} failed: ${error.message}`));
      next.opId = '';
      next.updatedAt = now;
      delete next.hibernatingFrom;
      delete next.hibernatingTo;
      const more = also ? await also(v.value, next) : [];
      return [{ kind: 'sandbox', value: next, expectRevision: v.modRevision }, ...more];
    });
    return false;
  }

  /**
   * A failed wake's settle: back to hibernated, releasing the booking its op recorded, if
   * any (a placement commit that failed with an unknown outcome may have landed; a re-run
   * finds bookedHost set), and on the host it was placed off (hostBefore): the warm
   * location of its snapshot, which the host it was placed on may not hold (RemoveHost of
   * the one that does would otherwise not see it). Read from the op now, not from the copy
   * the run started with.
   */
  private async settleWake(op: OperationRec, e: unknown): Promise<false> {
    let booked: { hostId: string; sb: SandboxRec } | undefined;
    const r = await this.failAndSettle(op, e, 'waking', () => 'hibernated', async (sb, next) => {
      const { bookedHost: hostId, hostBefore } = ((await this.deps.store.getOp(op.tenantId, op.id))?.value.input ?? {}) as WakeInput;
      if (hostBefore !== undefined) next.hostId = hostBefore;
      booked = hostId ? { hostId, sb } : undefined;
      return hostId ? this.capacity(hostId, bookingOf(sb), -1)() : [];
    });
    // A restore that did not answer in time (or whose host went) may still start its VM: it
    // is told to stop it, and not to start it if it has not yet (the agent's gave-up list), as
    // a failed start is. The sandbox is hibernated again and its booking released.
    if (booked && this.active && givenUpMayStillStart(e)) {
      void this.sendHostWork(booked.hostId, op.id, booked.sb.tenantId, `stop-unanswered/${booked.sb.id}`, stopVm(booked.sb.id), 'could not stop the VM of a wake given up on');
    }
    return r;
  }

  /**
   * Read-modify-write of a snapshot record, guarded by the revision read (read again on a
   * conflict, up to 20 times). `next` gives the record to write, or undefined to leave it as
   * it is. Resolves with the record as it then is; undefined if there is none.
   */
  private async updateSnapshotRec(tenantId: string, id: string, next: (cur: SnapshotRec) => SnapshotRec | undefined | Promise<SnapshotRec | undefined>): Promise<SnapshotRec | undefined> {
    for (let i = 0; i < 20; i++) {
      const cur = await this.deps.store.getSnapshot(tenantId, id);
      if (!cur) return undefined;
      const n = await next(cur.value);
      if (!n) return cur.value;
      if (await this.commit([{ kind: 'snapshot', value: n, expectRevision: cur.modRevision }])) return n;
    }
    throw new ConflictError(`snapshot ${id}`);
  }

  /** Ends a create or a wake: the sandbox runs (on `hostId`, when given) and the op succeeds, in one transaction. */
  private async finishRunning(op: OperationRec, sb: SandboxRec, reason = '', hostId?: string): Promise<void> {
    const now = this.deps.clock.now();
    try {
      await this.finish(
        op,
        { sandboxIds: [sb.id] },
        null,
        undefined,
        this.sandboxWrite(sb, (s) => {
          this.setState(s, 'running', now, reason);
          if (hostId !== undefined) s.hostId = hostId;
          s.opId = '';
        }),
      );
    } catch (e) {
      // The VM runs, but the record moved on while it started (destroyed, say, by a destroy
      // its host ran before this start, after an agent restart): nothing owns that VM, so it
      // is stopped now rather than by the stray-VM check, minutes later (as markRunning does
      // for a fork's children).
      const where = hostId ?? sb.hostId;
      if (where && (e instanceof WrongStateError || e instanceof NotFoundError)) {
        const cur = await this.deps.store.getSandbox(sb.tenantId, sb.id).catch(() => 'unknown' as const);
        if (cur !== 'unknown' && (!cur || cur.value.state === 'destroyed' || cur.value.hostId !== where)) {
          void this.sendHostWork(where, op.id, sb.tenantId, `stop-moved-on/${sb.id}`, stopVm(sb.id), 'could not stop the VM of a sandbox that moved on while it started');
        }
      }
      throw e;
    }
  }

  /** A placed fork that cannot go on: its children still starting fail (each stopped on its host, where a restore may have begun). */
  private async failStartingChildren(op: OperationRec, e: unknown): Promise<void> {
    for (const id of (this.ops.get(op.id)?.value ?? op).result?.sandboxIds ?? []) {
      const v = await this.deps.store.getSandbox(op.tenantId, id);
      if (v?.value.state === 'starting' && v.value.opId === op.id) await this.failSandbox(v.value, e, true);
    }
  }

  private async failSandbox(sb: SandboxRec, e: unknown, stop = false): Promise<void> {
    const now = this.deps.clock.now();
    const message = errorOf(e).message;
    const hostId = sb.hostId;
    // A start that failed on its host holds no VM (the agent cleans up its own half-made VM in
    // the step), so its booking goes with the state change. One given up on here (no answer in
    // time, or the host went silent) may still be running there: its VM is stopped as soon as
    // the host gets to it (a destroy waits for the steps making that VM), not left for the
    // stray-VM check, minutes later and unbooked meanwhile.
    // The stop goes out after the record's write commits: a deposed leader (its write fails
    // NotLeaderError) must not stop a VM the new leader has just started from the journal.
    let deposed = false;
    let storeFailed: StoreUnavailableError | undefined;
    await this.updateSandbox(
      sb.tenantId,
      sb.id,
      (s) => {
        this.setState(s, 'failed', now, message);
        s.opId = '';
      },
      (_next, before) => this.capacity(hostId, bookingOf(before), -1)(),
    ).catch(async (err: unknown) => {
      if (err instanceof NotLeaderError) {
        deposed = true;
        return;
      }
      // The store failed under the write (applied or not): the op runs again (run()) and
      // finds the sandbox failed or still starting, instead of ending with it starting and
      // booked, which nothing would ever move on. Thrown once the stop below is sent: a run
      // again that finds the write applied sends none.
      if (err instanceof StoreUnavailableError) {
        storeFailed = err;
        return;
      }
      // Whoever moved the record on (a destroy) releases its booking, or did. A record that is
      // gone was ended (destroyed or failed, which released it) and then expired by the history
      // retention, the only delete of sandbox records: nothing is released here (a release
      // here took the booking off sandboxes placed on the host since).
      this.log.warn({ err, sandboxId: sb.id }, 'could not mark sandbox failed');
    });
    if (hostId && !deposed && this.active && (stop || givenUpMayStillStart(e))) {
      void this.sendHostWork(hostId, sb.opId || `failed-${sb.id}`, sb.tenantId, `stop-unanswered/${sb.id}`, stopVm(sb.id), 'could not stop the VM of a start given up on');
    }
    if (storeFailed) throw storeFailed;
  }

  private async runSnapshot(op: OperationRec): Promise<void> {
    const input = op.input as { snapshotId: string; pin?: boolean; keepLast?: number; retentionTtlMs?: number | null; labels?: Record<string, string> };
    const sn = await this.snapshotOf(op, op.targetId, input.snapshotId, input);
    await this.finish(op, { snapshotId: sn.id }, null);
  }

  /** Takes a snapshot of a live sandbox on its host and records it. Idempotent per snapshot id. */
  private async snapshotOf(op: OperationRec, sandboxId: string, snapshotId: string, opts: { pin?: boolean; keepLast?: number; retentionTtlMs?: number | null; labels?: Record<string, string> }, tenantId = op.tenantId): Promise<SnapshotRec> {
    const existing = await this.deps.store.getSnapshot(tenantId, snapshotId);
    if (existing?.value.state === 'ready') return existing.value;
    if (existing && (existing.value.state === 'deleting' || existing.value.state === 'deleted')) throw new WrongStateError('snapshot', snapshotId, existing.value.state, 'it was deleted before it was taken');
    const sbv = await this.deps.store.getSandbox(tenantId, sandboxId);
    const unfit = !sbv ? new NotFoundError('sandbox', sandboxId) : sbv.value.state !== 'running' && sbv.value.state !== 'paused' && sbv.value.state !== 'hibernating' ? new WrongStateError('sandbox', sbv.value.id, sbv.value.state, 'only a running or paused sandbox can be snapshotted') : undefined;
    if (unfit) {
      // A re-run (a new leader) of an op whose snapshot an earlier run began, its sandbox gone
      // or changed since: that snapshot will not be finished.
      if (existing?.value.state === 'creating') await this.markSnapshotFailed(existing.value);
      throw unfit;
    }
    const sb = sbv!.value;
    const now = this.deps.clock.now();
    // A re-run (a new leader, or a retry) of a snapshot whose record says failed takes it up
    // again as creating: a failed record is final only for an op that gave up.
    const again: SnapshotRec | undefined = existing ? { ...existing.value, state: 'creating' } : undefined;
    if (again) delete again.endedAt;
    const rec: SnapshotRec = again ?? {
      id: snapshotId,
      tenantId,
      state: 'creating',
      sourceSandboxId: sb.id,
      parentSnapshotId: sb.sourceSnapshotId,
      lineageId: sb.lineageId,
      createdAt: now,
      pinned: opts.pin ?? false,
      retentionTtlMs: opts.retentionTtlMs ?? null,
      keepLast: opts.keepLast ?? 0,
      logicalBytes: 0,
      storedBytes: 0,
      hostIds: [],
      vmConfig: null,
      labels: opts.labels ?? {},
      manifestSignature: '',
      manifestKeyId: '',
      // The host it is taken on, from its first write: a re-run goes there (below).
      takenOn: sb.hostId,
      inherits: { resources: sb.resources, image: sb.image, idleTimeoutMs: sb.idleTimeoutMs, afterResume: sb.afterResume ?? [], allowEgress: sb.allowEgress, allowCidrs: sb.allowCidrs ?? [] },
    };
    let recRev = existing ? (existing.value.state === 'creating' ? existing.modRevision : await this.commit([{ kind: 'snapshot', value: rec, expectRevision: existing.modRevision }])) : await this.commit([{ kind: 'snapshot', value: rec, expectRevision: 0 }]);
    if (!recRev) {
      // etcd3 retries a write whose answer was lost, and the retry of one that landed fails
      // its own guard: the record there, as written, is ours. Failing here would leave it
      // 'creating' for good (no op finishes it; it can neither expire nor be deleted).
      const there = await this.deps.store.getSnapshot(tenantId, snapshotId);
      if (there?.value.state !== 'creating' || JSON.stringify(there.value) !== JSON.stringify(rec)) throw new ConflictError(`snapshot ${snapshotId}`);
      recRev = there.modRevision;
    }
    // Where its first run began it (a record from before `takenOn`: where the sandbox is). A
    // re-run after the sandbox moved (a drain) goes there too: its journal answers a step it
    // did, and one it did not fails (the VM is gone from it). Sent where the sandbox is now, a
    // second snapshot was taken under the same id, the first host keeping the first one.
    const on = rec.takenOn ?? sb.hostId;
    try {
      // Begun on a host since removed: it cannot be finished. (A lost one fails the step.)
      if (on !== sb.hostId && !this.cache.hosts.has(on)) throw new WrongStateError('snapshot', snapshotId, 'creating', `it was begun on host ${on}, which is gone (the sandbox is on ${sb.hostId || 'no host'} now); take another`);
      const r = await this.step(op, `snapshot/${snapshotId}`, on, { case: 'snapshotVm', value: { sandboxId: sb.id, snapshotId, parentSnapshotId: sb.sourceSnapshotId } as never });
      const ready: SnapshotRec = { ...rec, state: 'ready', hostIds: [on], takenOn: on };
      if (r.manifest && r.manifest.manifest.length > 0) {
        // Signed only as this snapshot's manifest: the key signs tickets too, and bytes a host
        // chose (a ticket for another tenant's snapshot, say) must not come back signed.
        const m = fromBinary(SnapshotManifestSchema, r.manifest.manifest);
        if (m.snapshotId !== snapshotId || (m.tenantId !== '' && m.tenantId !== tenantId)) throw new ForkfleetError('internal', `host ${on} answered the snapshot step of ${snapshotId} with the manifest of another snapshot (${JSON.stringify(m.snapshotId)})`, { retryable: false });
        const sig = this.deps.signer.manifest(r.manifest.manifest);
        ready.manifestSignature = Buffer.from(sig.signature).toString('base64');
        ready.manifestKeyId = sig.keyId;
        const vc = m.vmConfig;
        if (vc) {
          ready.vmConfig = {
            machine: vc.machine,
            memoryMib: Number(vc.memoryMib),
            vcpus: vc.vcpus,
            devices: vc.devices,
            qemuVersion: vc.qemuVersion,
            accel: vc.accel === Accel.KVM ? 'kvm' : 'tcg',
            cpuModel: vc.cpuModel,
            image: vc.image,
            ...(vc.imageDigest ? { imageRecipeHash: vc.imageDigest } : {}),
            ...(vc.imageDiskSha256 ? { imageDiskSha256: vc.imageDiskSha256 } : {}),
          };
        }
        let logical = 0;
        let stored = 0;
        for (const a of m.artifacts) {
          logical += Number(a.size);
          for (const c of a.chunks) stored += c.storedSize;
        }
        ready.logicalBytes = logical;
        ready.storedBytes = stored;
      }
      // Onto the record as it is now: a pin or a retention set while it was taken stays, and
      // a snapshot deleted meanwhile is not brought back.
      const changed = (state: string): WrongStateError => new WrongStateError('snapshot', rec.id, state, 'it changed while it was taken');
      const done = await this.updateSnapshotRec(rec.tenantId, rec.id, (cur) => {
        // Ready by this very write, whose answer was lost: etcd3 sent it again, and the retry
        // failed its guard (the record moved on, to what it wrote). Done, not "changed".
        if (cur.state === 'ready' && cur.manifestSignature === ready.manifestSignature && cur.hostIds.includes(on)) return undefined;
        if (cur.state !== 'creating') throw changed(cur.state);
        return { ...cur, state: 'ready', hostIds: [on], takenOn: on, manifestSignature: ready.manifestSignature, manifestKeyId: ready.manifestKeyId, vmConfig: ready.vmConfig, logicalBytes: ready.logicalBytes, storedBytes: ready.storedBytes };
      });
      if (!done) throw changed('gone');
      return done;
    } catch (e) {
      // A snapshot that will not become ready is failed, whatever failed after its record was
      // written (the step, the signature, the ready write).
      await this.markSnapshotFailed(rec);
      throw e;
    }
  }

  /**
   * A creating snapshot that will not become ready is marked failed, or it would stay
   * creating, which nothing expires and a delete refuses. A leader that stepped down leaves
   * the op to the next one, which takes the snapshot up again: writing failed now could land
   * after that (and a host would be told to delete what is about to be ready).
   */
  private async markSnapshotFailed(rec: SnapshotRec): Promise<void> {
    let last: unknown;
    for (let i = 0; i < 5 && this.active; i++) {
      try {
        await this.updateSnapshotRec(rec.tenantId, rec.id, (cur) => (cur.state === 'creating' ? { ...cur, state: 'failed', endedAt: this.deps.clock.now() } : undefined));
        return;
      } catch (w) {
        if (w instanceof NotLeaderError) return;
        last = w;
        this.log.warn({ err: w, snapshotId: rec.id }, 'could not mark a snapshot failed');
        await new Promise((r) => setTimeout(r, 200));
      }
    }
    // Not marked (the store was out longer than the tries): the op must not end on the
    // caller's error, or nothing would ever finish this creating record. As a store failure,
    // the op runs again (run()), and its re-run takes the snapshot up again or marks it failed.
    // A full store keeps its own (slower) retry; any other error ends the op on the caller's.
    if (!this.active) return;
    if (last instanceof StoreUnavailableError || last instanceof StoreFullError) throw last;
    if (last instanceof ConflictError) throw new StoreUnavailableError(`marking snapshot ${rec.id} failed`, last);
  }

  /**
   * Pause or resume. The op holds its sandbox (opId) from before its step to its final write,
   * as a drain's migration and a hibernate do: a drain and a hibernate refuse one it holds, the
   * TTL and idle rules and the VM check leave it alone, and its step never goes to a VM another
   * operation holds (a resume would run a guest that a drain or a hibernate paused for its
   * snapshot on past that snapshot; a drain's switch then drops what it did).
   */
  private async runPauseResume(op: OperationRec): Promise<void> {
    const sbv = await this.deps.store.getSandbox(op.tenantId, op.targetId);
    if (!sbv) throw new NotFoundError('sandbox', op.targetId);
    const sb = sbv.value;
    const target: SandboxState = op.kind === 'pause' ? 'paused' : 'running';
    // The lifecycle pass's resume of one a failed hibernate left paused: only while that resume
    // is still owed. Its owner's pause or resume that ran before it (pauses and resumes of a
    // sandbox run one at a time) settled it, and is not undone.
    // Still owed but not paused now (a drain's hibernate holds it, its host was found lost: the
    // states that keep the mark): failed, not finished, so that the pass submits another once
    // it is paused again (a finished one would use up the rule's key).
    const owed = op.kind === 'resume' ? op.input.resumeOwed : undefined;
    if (owed !== undefined && sb.resumeOwed !== owed) return this.finish(op, { sandboxIds: [sb.id] }, null, undefined, this.vmStateHoldEnded(op, sbv), `not resumed: it is ${sb.state}, and no longer owed a resume`);
    if (owed !== undefined && sb.state !== 'paused') throw new WrongStateError('sandbox', sb.id, sb.state, 'it is owed a resume once it is paused again');
    // Held from here on (a re-run finds it held already): its state as the hold's write found it.
    const held = await this.holdForVmState(op, sbv);
    const cur = held.value;
    if (cur.state !== target) {
      const r = await this.step(op, op.kind, cur.hostId, op.kind === 'pause' ? pauseVm(cur.id) : resumeVm(cur.id, hooksOf(cur)));
      const now = this.deps.clock.now();
      const report = op.kind === 'resume' ? this.hookReport(r, cur.id) : '';
      return this.finish(
        op,
        { sandboxIds: [cur.id] },
        null,
        undefined,
        this.sandboxWrite(
          cur,
          (s) => {
            // Taken from it meanwhile (a destroy; its host lost, which ends every hold): that one's now.
            if ((s.state !== 'running' && s.state !== 'paused') || s.opId !== op.id) throw new WrongStateError('sandbox', s.id, s.state, `${op.kind} lost the race to another operation (${s.opId || 'none'})`);
            this.setState(s, target, now, report);
            s.opId = '';
            // Paused by its owner's asking: no resume is owed it any more (setState keeps the mark through paused).
            if (op.kind === 'pause') delete s.resumeOwed;
          },
          held,
        ),
      );
    }
    // The record says so already; the VM may not (a step that failed after its VM changed,
    // e.g. the agent could not write the VM's state file): the step puts it right, or is a
    // no-op on the host. A resume the record already shows runs no hooks.
    if (cur.hostId) await this.step(op, op.kind, cur.hostId, op.kind === 'pause' ? pauseVm(cur.id) : resumeVm(cur.id));
    // Its owner pauses one a failed hibernate left paused: it is paused by their asking now,
    // and the lifecycle pass no longer resumes it.
    await this.finish(op, { sandboxIds: [cur.id] }, null, undefined, this.vmStateHoldEnded(op, held, (s) => void delete s.resumeOwed));
  }

  /**
   * A pause's or resume's hold on its sandbox (opId), taken in a guarded write before its
   * step: the record as written. Only a running or paused sandbox that no other operation is
   * at work on: one that a drain holds (its VM paused for the move while the record says
   * running) is refused, UNAVAILABLE and retryable, as it passes. Taken over from a pause or
   * resume that holds it but is not at work on it (its runner crashed: pauses and resumes of
   * a sandbox run one at a time, so one holding it is not running). The write changes no
   * state: updatedAt stays (the VM check goes by it, and the idle rule's back-off after a failed
   * hibernate: a resume asked every few seconds of a dead VM would keep it from being found).
   */
  private async holdForVmState(op: OperationRec, known: Versioned<SandboxRec>): Promise<Versioned<SandboxRec>> {
    let v: Versioned<SandboxRec> | undefined = known;
    for (let i = 0; i < 20; i++) {
      if (i > 0) v = await this.deps.store.getSandbox(op.tenantId, op.targetId);
      if (!v) throw new NotFoundError('sandbox', op.targetId);
      const s = v.value;
      if (s.state !== 'running' && s.state !== 'paused') throw new WrongStateError('sandbox', s.id, s.state, `cannot ${op.kind}`);
      if (s.opId === op.id) return v;
      // Taken over from a pause or resume that no runner here runs (ended, or crashed and
      // waiting to run again); one that runs, or a drain, keeps it.
      if (s.opId !== '' && (this.running.has(s.opId) || !isVmStateHold(await this.holderOf(s)))) {
        throw new ForkfleetError('unavailable', `sandbox ${s.id} is ${s.state} but operation ${s.opId} is at work on it (a drain moving it to another host pauses its VM for the move); ${op.kind} it once that ends: retry`, { retryable: true });
      }
      const next = structuredClone(s);
      next.opId = op.id;
      const rev = await this.commit([{ kind: 'sandbox', value: next, expectRevision: v.modRevision }]);
      if (rev) return { value: next, modRevision: rev };
    }
    throw new ConflictError(`sandbox ${op.targetId}`);
  }

  /**
   * The record of the operation holding sandbox `s` (opId): under the sandbox's tenant, or a
   * drain's under DRAIN_TENANT. Undefined when there is none (expired by retention).
   */
  private async holderOf(s: SandboxRec): Promise<OperationRec | undefined> {
    return (await this.deps.store.getOp(s.tenantId, s.opId))?.value ?? (await this.deps.store.getOp(DRAIN_TENANT, s.opId))?.value;
  }

  /**
   * For a hibernate or a drain's migration about to take a running or paused sandbox (`known`
   * as last read, or read here): the pause or resume holding it that it may take it over from
   * ('' for none), one that no longer runs (not in `running`). One that runs holds it for
   * its step only, and is waited for (polled, for at most what that step may take); still
   * holding it then, UNAVAILABLE, retryable. Held by another operation (a drain moving it):
   * refused (WrongStateError, `then` saying what to do), as before these holds.
   */
  private async afterVmStateHold(op: OperationRec, ref: { tenantId: string; id: string }, known: SandboxRec | undefined, then: string): Promise<string> {
    let s = known ?? (await this.deps.store.getSandbox(ref.tenantId, ref.id))?.value;
    const until = this.stepsDeadline();
    for (;;) {
      if (!s || (s.state !== 'running' && s.state !== 'paused') || s.opId === '' || s.opId === op.id) return '';
      const holder = await this.holderOf(s);
      if (!isVmStateHold(holder)) throw new WrongStateError('sandbox', s.id, s.state, `operation ${s.opId} is at work on it; ${then}`);
      if (!this.running.has(s.opId)) return s.opId;
      if (!this.active || this.deps.clock.now() >= until) throw new ForkfleetError('unavailable', `sandbox ${s.id} is ${s.state} but its ${holder?.kind ?? 'operation'} ${s.opId} is still at work on it; retry`, { retryable: true });
      await new Promise((r) => setTimeout(r, 250));
      s = (await this.deps.store.getSandbox(ref.tenantId, ref.id))?.value;
    }
  }

  /**
   * The write that ends a pause's or resume's hold on its sandbox, as an `updateOp` extra (with
   * `settle` applied to the record): none when it does not hold it (never took it, or it was
   * taken from it: a destroy, its host lost). The first attempt builds on `known` when given.
   * Like the hold, it leaves updatedAt as it was.
   */
  private vmStateHoldEnded(op: OperationRec, known?: Versioned<SandboxRec>, settle?: (s: SandboxRec) => void): (attempt: number) => Promise<StoreWrite[]> {
    const write = this.sandboxWrite(
      { tenantId: op.tenantId, id: op.targetId },
      (s) => {
        if (s.opId !== op.id) throw new MovedOnError(s.id, s.state, s.hostId);
        settle?.(s);
        s.opId = '';
      },
      known,
      undefined,
      false,
    );
    return (attempt) =>
      write(attempt).catch((e: unknown) => {
        if (e instanceof MovedOnError || e instanceof NotFoundError) return [];
        throw e;
      });
  }

  /**
   * Hibernate: snapshot the sandbox, stop its QEMU and give its CPU and RAM back. The
   * snapshot stays on the host (and on `replicas` more hosts), so the next call wakes it.
   * Re-runnable at every point: the snapshot and the VM stop are idempotent steps.
   */
  private async runHibernate(op: OperationRec, tries = 0): Promise<void> {
    /** failedBeforeResume: the failure an earlier run of it recorded before it resumed the VM (below). */
    const input = op.input as { snapshotId: string; replicas?: number; failedBeforeResume?: OperationError };
    // Likewise a second hibernate of a sandbox another one owns: it then finds it hibernated.
    const after = await this.afterOtherOp(op, 'hibernating');
    let sb = after.v?.value;
    if (!sb) throw new NotFoundError('sandbox', op.targetId);
    // Run again after it had recorded the sandbox hibernated (a lost lead or a store outage
    // while it copied replicas): its snapshot is ready and the sandbox left `hibernating`
    // through this op. Its work is done, whatever happened since: a wake since then is not
    // undone (its steps would be answered from the journal of the first run, without pausing
    // or stopping the woken VM, and the sandbox recorded hibernated in the older snapshot).
    if (sb.state === 'running' || sb.state === 'paused' || sb.state === 'hibernated') {
      const own = await this.readSnapshot(op.tenantId, input.snapshotId);
      if (own?.value.state === 'ready') return this.finish(op, { sandboxIds: [sb.id], snapshotId: input.snapshotId }, null);
    }
    if (sb.state === 'hibernated') {
      // Hibernated already: replicas asked for now are copies of the snapshot it has, made
      // up to that many hosts besides the ones that hold it (the op says when fewer were made).
      const held = (await this.readSnapshot(sb.tenantId, sb.hibernationSnapshotId))?.value;
      const short = held && (input.replicas ?? 0) > 0 ? await this.replicate(op, held, input.replicas ?? 0, 'hibernated already') : undefined;
      return this.finish(op, { sandboxIds: [sb.id], snapshotId: sb.hibernationSnapshotId }, null, undefined, undefined, short);
    }
    if (sb.state === 'running' || sb.state === 'paused' || (sb.state === 'hibernating' && after.ended !== '')) {
      // A pause or resume holding it (for its step only) is waited for, or taken over from
      // once it no longer runs; a drain moving it refuses this.
      const takeOver = sb.state === 'running' || sb.state === 'paused' ? await this.afterVmStateHold(op, sb, sb, 'hibernate it once that ends') : '';
      try {
        sb = await this.updateSandbox(sb.tenantId, sb.id, (s) => {
          if (s.state === 'hibernating' && s.opId !== '' && s.opId !== op.id && s.opId !== after.ended) throw new OwnedByOtherOpError(s.opId);
          if (s.state === 'hibernating') {
            // Taken over from an operation that ended without settling it: its own now.
            s.opId = op.id;
            s.hibernatingTo = input.snapshotId;
            return;
          }
          // Running or paused, taken by another operation since the look above, or the stopped
          // pause/resume taken over from run again meanwhile (rerunLater): looked at again.
          if (s.opId !== '' && s.opId !== op.id && (s.opId !== takeOver || this.running.has(takeOver))) throw new OwnedByOtherOpError(s.opId);
          s.hibernatingFrom = s.state === 'paused' ? 'paused' : 'running';
          // In use from now on: a delete of the snapshot, once it exists, is refused.
          s.hibernatingTo = input.snapshotId;
          this.setState(s, 'hibernating', this.deps.clock.now());
          s.opId = op.id;
        });
      } catch (e) {
        // Another operation took it between the read and the write: this one waits for it
        // (another hibernate, a pause or resume), or is refused (a drain).
        if (!(e instanceof OwnedByOtherOpError)) throw e;
        if (tries >= 3) throw takenEachTime('hibernate', sb.id, e);
        return this.runHibernate(op, tries + 1);
      }
    }
    if (sb.state !== 'hibernating') {
      // A re-run (a new leader) whose first run began the snapshot (its record creating), the
      // sandbox moved on since (its host lost, say): nothing else would end that record, which
      // could then neither expire nor be deleted (as snapshotOf does for the other kinds).
      const own = await this.deps.store.getSnapshot(op.tenantId, input.snapshotId);
      if (own?.value.state === 'creating') await this.markSnapshotFailed(own.value);
      throw new WrongStateError('sandbox', sb.id, sb.state, 'only a running or paused sandbox can hibernate');
    }
    // The VM is paused first and stays paused through the snapshot until it stops: a guest
    // that ran on after its snapshot (a running VM is resumed once the snapshot is taken)
    // would do work, and answer calls, that the hibernated sandbox then never had.
    const paused = sb.hibernatingFrom !== 'paused';
    let sn: SnapshotRec;
    try {
      // An earlier run failed and began resuming the VM: this one ends as that one would have
      // (the resume sent again, which the host's journal answers if it was done). Going on from
      // the pause, which the journal answers without pausing again, would snapshot a guest
      // that runs, and hibernate it in that snapshot.
      const f = input.failedBeforeResume;
      if (f) throw new ForkfleetError(isErrorKind(f.kind) ? f.kind : 'internal', f.message, { retryable: f.retryable });
      // The idle rule's hibernate pauses only a VM that is still idle: a call may have begun
      // since the heartbeat the rule went by.
      if (paused) await this.step(op, 'pause', sb.hostId, pauseVm(sb.id, op.input.reason === 'idle' ? (sb.idleTimeoutMs ?? 0) : 0));
      // keep_last 1 among this sandbox's hibernation snapshots: an older one is pruned once
      // no live sandbox uses it (the current one is in use while the sandbox lives).
      sn = await this.snapshotOf(op, sb.id, input.snapshotId, { keepLast: 1, labels: { [HIBERNATION_LABEL]: sb.id } });
    } catch (e) {
      // Back to what it was: its VM and booking are still there (a VM the stop step did end
      // after all is found missing by the VM check, which records it lost), running again if
      // it was paused here. Not when the op runs again (a lost lead, a store outage): its next
      // run goes on from the pause, which its journal answers without pausing again. Once
      // the resume may have been sent, the op records so first: a run again then resumes and
      // settles too (above).
      // The idle rule's pause refused (the VM was busy since the rule judged it): nothing was
      // paused, and nothing failed. Not recorded as a failed hibernate, which would keep the
      // rule off the sandbox for IDLE_RETRY_AFTER_FAILURE_MS: it hibernates once idle again.
      const notIdle = e instanceof HostStepError && e.kind === 'failed_precondition' && / is not idle: /.test(e.message);
      let resumed = !paused || notIdle;
      if (paused && !notIdle && this.active && !(e instanceof StoreUnavailableError) && !(e instanceof NotLeaderError)) {
        if (!input.failedBeforeResume) await this.updateOp(op.tenantId, op.id, (o) => void ((o.input as typeof input).failedBeforeResume = errorOf(e)));
        resumed = await this.step(op, 'resume-after-failure', sb.hostId, resumeVm(sb.id)).then(
          () => true,
          (r: unknown) => (this.log.warn({ err: r, sandboxId: sb.id }, 'could not resume a sandbox whose hibernation failed; it stays paused'), false),
        );
      }
      // Running when its hibernate began, paused now though nobody asked for a pause (calls
      // refused, its TTL and idle time stopped, its capacity held for good): the settling write
      // records that it is owed a resume (resumeOwed). The lifecycle pass resumes it while it
      // stays paused and free, again once per LIFECYCLE_RETRY_MS while such a resume fails (its
      // host's trouble may outlast a step deadline). None is submitted from here as well: one
      // whose submit failed (a store error, a lead lost after the settle) was lost for good,
      // this op having ended, and the pass submits it within its 2 s anyway.
      await this.failAndSettle(
        op,
        e,
        'hibernating',
        (cur) => (resumed ? (cur.hibernatingFrom ?? 'running') : 'paused'),
        async (_cur, next) => {
          if (!resumed) next.resumeOwed = op.id;
          return [];
        },
        notIdle ? 'not hibernated: busy again when the idle hibernation began' : undefined,
      );
      return;
    }
    try {
      await this.step(op, 'stop', sb.hostId, stopVm(sb.id));
    } catch (e) {
      // The snapshot is complete and the VM has not run since it was taken: the sandbox is
      // hibernated all the same (rolling back would leave a VM that may be stopped already
      // recorded as running, and the snapshot unused). A VM still there is stopped later: by
      // this stop sent once more, or as a stray (a hibernated sandbox runs no VM).
      this.log.warn({ err: e, sandboxId: sb.id, hostId: sb.hostId }, 'stopping the hibernated sandbox\'s VM failed; it is hibernated from its snapshot, and its VM is stopped later');
      await this.sendHostWork(sb.hostId, `${op.id}-stop-again`, sb.tenantId, `stop/${sb.id}`, stopVm(sb.id), 'could not stop a hibernated sandbox\'s VM');
    }
    // The VM is gone: the snapshot is the sandbox now, recorded before anything else can
    // happen to it (its host lost while the replicas below are copied marks a hibernated
    // sandbox nothing; a sandbox lost meanwhile keeps its booking released and gets the
    // snapshot to be restored from, not an older one).
    const recorded = await this.updateSandbox(
      sb.tenantId,
      sb.id,
      (s) => {
        s.hibernationSnapshotId = sn.id;
        delete s.hibernatingTo;
        if (s.state === 'lost') return;
        // Why, as a TTL destroy says 'ttl': the idle rule's, a drain's (a user's: none). A
        // user's is marked for the TTL rule to leave (one settled again keeps its mark).
        const why = (op.input as { reason?: unknown }).reason;
        this.setState(s, 'hibernated', this.deps.clock.now(), why === 'idle' || why === 'drain' ? why : '');
        if (why === undefined) s.hibernatedOnRequest = true;
        else if (why === 'idle' || why === 'drain') delete s.hibernatedOnRequest;
        s.opId = '';
        delete s.hibernatingFrom;
      },
      (_next, before) => (before.state === 'hibernating' ? this.capacity(sb.hostId, bookingOf(before), -1)() : Promise.resolve([])),
    );
    if (recorded.state === 'lost') throw new HostLostError(sb.hostId, `hibernating sandbox ${sb.id} (it is lost; snapshot ${sn.id}, taken before its VM stopped, is what restores it)`);
    const short = (input.replicas ?? 0) > 0 ? await this.replicate(op, sn, input.replicas ?? 0, 'hibernated') : undefined;
    await this.finish(op, { sandboxIds: [sb.id], snapshotId: sn.id }, null, undefined, undefined, short);
  }

  /**
   * Durability of a hibernation snapshot: copies it, best effort (it is safe on its holders
   * already), until `wanted` hosts besides its first holder hold it. A host that fails its
   * copy is replaced by the next ready one. Answers the op's message when fewer copies than
   * asked for exist (`what` begins it), else undefined.
   */
  private async replicate(op: OperationRec, sn: SnapshotRec, wanted: number, what: string): Promise<string | undefined> {
    const source = sn.hostIds[0] ?? '';
    const now = this.deps.clock.now();
    const others = [...this.cache.hosts.values()].map((h) => h.value).filter((h) => h.id !== source && !h.cordoned && !h.draining && this.takesWork(h.id, now));
    let made = sn.hostIds.filter((h) => h !== source).length;
    let failed = 0;
    for (const h of others) {
      if (made >= wanted) break;
      if (sn.hostIds.includes(h.id)) continue;
      try {
        const fetch = this.fetchPlan(sn, h.id, source, false);
        if (fetch) {
          await this.step(op, `replicate/${h.id}`, h.id, { case: 'fetchSnapshot', value: fetch as never });
          await this.addHolder(sn.tenantId, sn.id, h.id);
        }
        made++;
      } catch (e) {
        failed++;
        this.log.warn({ err: e, snapshotId: sn.id, hostId: h.id }, 'hibernation replica failed');
      }
    }
    if (made >= wanted) return undefined;
    this.log.warn({ opId: op.id, snapshotId: sn.id, wanted, made, failed, candidates: others.length }, 'fewer hibernation replicas than asked for');
    return `${what}; ${made} of ${wanted} replicas of snapshot ${sn.id} made (${others.length} other ready host(s)${failed ? `, ${failed} copy(ies) failed` : ''})`;
  }

  /**
   * Wake: restore a hibernated sandbox from its hibernation snapshot under the same id,
   * on its own host when there is room (placement prefers holders), otherwise on another
   * host that fetches the snapshot. Capacity is booked with the placement; a failed wake
   * returns the sandbox to hibernated and releases it.
   */
  private async runWake(op: OperationRec, tries = 0): Promise<void> {
    // A second wake (another idempotency key, an exec's wake) of a sandbox another wake owns
    // waits for that one, and then finds it running: one placement, one booking, one VM.
    const after = await this.afterOtherOp(op, 'waking');
    let v = after.v;
    if (!v) throw new NotFoundError('sandbox', op.targetId);
    let sb = v.value;
    if (sb.state === 'running') return this.finish(op, { sandboxIds: [sb.id] }, null);
    // Taken over from a wake that ended without settling the sandbox: the host it booked (and
    // its source) become this op's, recorded with the claim, so this wake restores there or
    // releases it; placing again would book a second host and leave the first booked for good.
    let inherited: WakeInput = {};
    if (sb.state === 'waking' && after.ended !== '') {
      const ended = (await this.deps.store.getOp(op.tenantId, after.ended))?.value.input as WakeInput | undefined;
      if (ended?.bookedHost && !(op.input as WakeInput).bookedHost) inherited = { bookedHost: ended.bookedHost, ...(ended.transferSource ? { transferSource: ended.transferSource } : {}), ...(ended.hostBefore !== undefined ? { hostBefore: ended.hostBefore } : {}) };
    }
    // Not a lost one (only a wake left over from before its host was lost finds it so): its
    // hibernation snapshot is older than the VM it ran since, which may come back with its host.
    if (sb.state === 'hibernated' || (sb.state === 'waking' && after.ended !== '')) {
      try {
        const claim = (s: SandboxRec): void => {
          if (s.state === 'waking' && s.opId !== '' && s.opId !== op.id && s.opId !== after.ended) throw new OwnedByOtherOpError(s.opId);
          // The ended wake's booking is this op's only while that wake still holds the sandbox
          // (a destroy may have settled it meanwhile, releasing it): else read again.
          if (inherited.bookedHost && !(s.state === 'waking' && s.opId === after.ended)) throw new OwnedByOtherOpError(s.opId || 'none');
          s.state = 'waking';
          s.opId = op.id;
        };
        if (inherited.bookedHost) {
          const write = this.sandboxWrite({ tenantId: sb.tenantId, id: sb.id }, claim);
          const o = await this.updateOp(op.tenantId, op.id, (x) => Object.assign(x.input, inherited), write);
          op = { ...op, input: o.input };
          sb = (await this.deps.store.getSandbox(op.tenantId, op.targetId))?.value ?? sb;
        } else {
          sb = await this.updateSandbox(sb.tenantId, sb.id, claim);
        }
      } catch (e) {
        // Another wake took it between the read and the write: this one waits for it.
        if (!(e instanceof OwnedByOtherOpError)) throw e;
        if (tries >= 3) throw takenEachTime('wake', sb.id, e);
        return this.runWake(op, tries + 1);
      }
      v = await this.deps.store.getSandbox(op.tenantId, op.targetId);
    }
    if (sb.state !== 'waking' || !v) throw new WrongStateError('sandbox', sb.id, sb.state, 'only a hibernated sandbox can be woken');
    const snapshotId = sb.hibernationSnapshotId || sb.sourceSnapshotId;
    const input = op.input as WakeInput;
    const snv = await this.readSnapshot(sb.tenantId, snapshotId);
    let hostId = input.bookedHost ?? '';
    if (!snv || snv.value.state !== 'ready') {
      await this.settleWake(op, new NotFoundError('snapshot', snapshotId));
      return;
    }
    if (!hostId) {
      const rev = v.modRevision;
      const before = sb;
      const placed = this.placeAndBook(
        op,
        { tenantId: before.tenantId, id: snapshotId },
        () => ({ kind: 'restore', id: op.id, nowMs: this.deps.clock.now(), snapshotId, overlayDiskMib: before.resources.diskMib, preferences: {} }),
        (res) => {
          const next = structuredClone(before);
          hostId = res.placements[0]!.hostId;
          next.hostId = hostId;
          next.updatedAt = this.deps.clock.now();
          sb = next;
          const source = res.transferPlan?.transfers.find((t) => t.destinationHostId === hostId)?.sourceHostId;
          // A wake restores the sandbox's own hibernation snapshot: a whole guest, not a share.
          delete next.imageShare;
          return {
            perChild: { res: before.resources },
            writes: [{ kind: 'sandbox', value: next, expectRevision: rev }],
            opUpdate: (o) => {
              const recorded = o.input as WakeInput;
              recorded.bookedHost = hostId;
              // Where it hibernated: a failed wake puts it back there (settleWake).
              recorded.hostBefore = before.hostId;
              if (source) recorded.transferSource = source;
              o.progress = { done: 0, total: 1, message: `waking on ${hostId}`, bytesTransferred: 0 };
            },
          };
        },
      );
      // No host could take it: it goes back to sleep.
      if (!(await placed.then(() => true, (e: unknown) => this.settleWake(op, e)))) return;
    }
    let woke: HostResultMsg;
    let fetch: ReturnType<Executor['fetchPlan']>;
    try {
      fetch = this.fetchPlan(snv.value, hostId, input.transferSource);
      woke = await this.step(op, `wake/${hostId}`, hostId, { case: 'restoreVms', value: { snapshotId, vms: [this.vmSpec(sb)], ...(fetch ? { fetch } : {}) } as never });
      this.startWorked(hostId, 'restore');
    } catch (e) {
      // Back to hibernated with its booking released, in the transaction that fails the op:
      // a re-run after a failover finds the op finished, not a booking to release again.
      if (!this.active) throw e;
      await this.settleWake(op, e);
      return;
    }
    // Bookkeeping, as for a fork (restoreRound): the VM runs, and the host's heartbeats say it
    // holds the snapshot. Failing the op here left the sandbox waking with its VM up, which the
    // lifecycle pass then stopped and hibernated again. A store out or a lost lead still ends the run.
    if (storedThere(fetch !== undefined, woke)) await this.addHolderKeptBy(op, snapshotId, hostId);
    await this.finishRunning(op, sb, this.hookReport(woke, sb.id), hostId);
  }

  /** Now plus the longest a host step may take with all its attempts: how long to wait for another operation's steps. */
  private stepsDeadline(): number {
    return this.deps.clock.now() + this.deps.config.stepTimeoutMs * this.deps.config.stepAttempts;
  }

  /**
   * The sandbox, once no other operation holds it in `state` (polled, for at most what that
   * operation's steps may take): the record as it then is, which may still be in `state` and
   * owned by it (the caller's own checks refuse it then).
   */
  private async afterOtherOp(op: OperationRec, state: 'waking' | 'hibernating'): Promise<{ v: Versioned<SandboxRec> | undefined; ended: string }> {
    let v = await this.deps.store.getSandbox(op.tenantId, op.targetId);
    const until = this.stepsDeadline();
    const held = (): boolean => !!v && v.value.state === state && v.value.opId !== '' && v.value.opId !== op.id;
    while (held() && this.active && this.deps.clock.now() < until) {
      // An owner that ended without settling the sandbox (failed by an unexpected error) is
      // waited for no longer: this op takes the sandbox over from it.
      const owner = (await this.deps.store.getOp(op.tenantId, v!.value.opId))?.value;
      if (!owner || isTerminal(owner.state)) return { v, ended: v!.value.opId };
      await new Promise((r) => setTimeout(r, 250));
      v = await this.deps.store.getSandbox(op.tenantId, op.targetId);
    }
    if (held()) throw new WrongStateError('sandbox', v!.value.id, v!.value.state, `operation ${v!.value.opId} is still at work on it; retry`);
    return { v, ended: '' };
  }

  /**
   * A wake that ended without settling its sandbox (failed by an unexpected error) left it
   * `waking` and its chosen host booked: undone as that wake's own failure would have
   * (settleWake): the booking released and the sandbox hibernated again, on the host it was
   * placed off, in one write, and the host told to stop the VM the restore may have made,
   * and not to start it.
   */
  private async settleEndedWake(sb: SandboxRec, ended: OperationRec | undefined): Promise<void> {
    const endedId = sb.opId;
    const { bookedHost, hostBefore } = (ended?.input ?? {}) as WakeInput;
    if (!ended) this.log.warn({ sandboxId: sb.id, opId: endedId }, 'the wake that holds this sandbox is gone: a host it may have booked cannot be known, and stays booked');
    try {
      await this.updateSandbox(
        sb.tenantId,
        sb.id,
        (s) => {
          if (s.state !== 'waking' || s.opId !== endedId) throw new MovedOnError(s.id, s.state, s.hostId);
          this.setState(s, 'hibernated', this.deps.clock.now(), `its wake ${endedId} ended without settling it`);
          if (hostBefore !== undefined) s.hostId = hostBefore;
          s.opId = '';
        },
        (_next, before) => (bookedHost ? this.capacity(bookedHost, bookingOf(before), -1)() : []),
      );
    } catch (e) {
      if (e instanceof MovedOnError) return; // taken over meanwhile (another wake): the caller reads it again
      throw e;
    }
    if (bookedHost) void this.sendHostWork(bookedHost, endedId, sb.tenantId, `stop-unanswered/${sb.id}`, stopVm(sb.id), 'could not stop the VM of a wake that ended unsettled');
  }

  /**
   * `until`: the end of its wait for a hibernate or wake that holds the sandbox (stepsDeadline,
   * from its first read), kept when one took it between its read and its write (it waits again).
   */
  private async runDestroy(op: OperationRec, until = this.stepsDeadline()): Promise<void> {
    // Why, when this scheduler destroys it itself (a cancelled create or fork): kept as the state's reason.
    const reason = typeof op.input.reason === 'string' ? op.input.reason : '';
    let sbv = await this.deps.store.getSandbox(op.tenantId, op.targetId);
    // A hibernate or wake in flight owns the VM: let it finish (it is bounded by its steps'
    // timeouts), then destroy what it left.
    /** The hibernate that holds it ended without settling it (an error past its steps): destroyed as it is. */
    let endedHibernate = '';
    while (sbv && (sbv.value.state === 'hibernating' || sbv.value.state === 'waking') && this.active && this.deps.clock.now() < until) {
      // An owner this leader runs has not ended: its record is read only for one it does not.
      if (sbv.value.opId !== '' && !this.running.has(sbv.value.opId)) {
        const owner = (await this.deps.store.getOp(sbv.value.tenantId, sbv.value.opId))?.value;
        // Its wake ended without settling it: waited for, it would keep it waking for good.
        if (sbv.value.state === 'waking' && (!owner || isTerminal(owner.state))) {
          await this.settleEndedWake(sbv.value, owner);
          sbv = await this.deps.store.getSandbox(op.tenantId, op.targetId);
          continue;
        }
        // Likewise a hibernate: nothing else would end it. It still holds its booking, and
        // maybe its VM (stopped below; a stop of a VM that is gone does nothing).
        if (sbv.value.state === 'hibernating' && (!owner || isTerminal(owner.state))) {
          endedHibernate = sbv.value.opId;
          break;
        }
      }
      await new Promise((r) => setTimeout(r, 250));
      sbv = await this.deps.store.getSandbox(op.tenantId, op.targetId);
    }
    if (!sbv) throw new NotFoundError('sandbox', op.targetId);
    const sb = sbv.value;
    // Retryable: the destroy was accepted in this state (Fleet.destroySandbox), and the other
    // operation ends by its steps' timeouts.
    if ((sb.state === 'hibernating' && endedHibernate === '') || sb.state === 'waking') throw new ForkfleetError('unavailable', `sandbox ${sb.id} is ${sb.state}: operation ${sb.opId || '(none)'} is still at work on it after the step timeout; retry the destroy`, { retryable: true });
    if (sb.state === 'destroyed') {
      // An earlier run of this op may have written `destroyed` (a failed or lost sandbox) and
      // stopped before it told the host (a store outage, a failover): told now (stopping a
      // VM that is gone does nothing; a removed host is not sent anything).
      if (sb.hostId && this.cache.hosts.has(sb.hostId)) await this.sendHostWork(sb.hostId, op.id, sb.tenantId, 'destroy/again', stopVm(sb.id), 'could not tell the host to stop a destroyed sandbox\'s VM');
      return this.finish(op, { sandboxIds: [sb.id] }, null);
    }
    // The record as the guarded write found it: host, resources and state may have changed
    // since the read above (a lost sandbox reclaimed, a pending one placed by its create).
    let cur = sb;
    if (sb.state === 'destroying' && sb.opId !== op.id) {
      // Another destroy's, which ended without finishing it (or one running: both stop the same
      // VM and only the write that takes it from destroying releases its booking): this one's now.
      cur = await this.updateSandbox(sb.tenantId, sb.id, (s) => {
        if (s.state === 'destroying') s.opId = op.id;
      });
      if (cur.state !== 'destroying') return this.finish(op, { sandboxIds: [cur.id] }, null);
    }
    if (sb.state !== 'destroying') {
      // A sandbox with no booking (lost, hibernated, failed, pending) is destroyed in that one
      // write: `destroying` always means "VM and booking still there", so a re-run of this op
      // after a failover releases only what is held (a lost sandbox's booking went when it
      // was marked lost, a failed one's when it failed).
      let before: SandboxState = sb.state;
      try {
        cur = await this.updateSandbox(sb.tenantId, sb.id, (s) => {
          before = s.state;
          // Taken over meanwhile by a hibernate that runs (or a wake): not this destroy's to end
          // now. It waits for that one (to the same deadline), as for one it found at work.
          if ((s.state === 'hibernating' || s.state === 'waking') && !(s.state === 'hibernating' && s.opId === endedHibernate && endedHibernate !== '')) throw new OwnedByOtherOpError(s.opId || 'none');
          if (s.state === 'hibernating') {
            delete s.hibernatingFrom;
            delete s.hibernatingTo;
            s.opId = '';
          }
          if (HOLDS_CAPACITY.has(s.state)) {
            // Named, so that if this op ends without destroying it the lifecycle pass knows to
            // start another (reconcileLifecycles).
            s.opId = op.id;
            // With its reason from now on (a TTL's, a cancel's): a command the destroy cuts off
            // is told why while the VM stops (Fleet.whyVmWentAway).
            return this.setState(s, 'destroying', this.deps.clock.now(), reason);
          }
          this.setState(s, 'destroyed', this.deps.clock.now(), reason);
          s.opId = '';
        });
      } catch (e) {
        if (!(e instanceof OwnedByOtherOpError)) throw e;
        return this.runDestroy(op, until);
      }
      if (!HOLDS_CAPACITY.has(before)) {
        // A failed start may still have made its VM (a step that timed out here and finished
        // there), and a lost one may be back: its host is told to stop it, without waiting
        // (the host may be gone; its queue keeps the step until it returns or is removed).
        if ((before === 'failed' || before === 'lost') && cur.hostId) await this.sendHostWork(cur.hostId, op.id, cur.tenantId, `destroy/${before}`, stopVm(cur.id), `could not tell the host to stop a ${before} sandbox's VM`);
        return this.finish(op, { sandboxIds: [cur.id] }, null);
      }
    }
    const { hostId } = cur;
    if (hostId && this.cache.hosts.get(hostId)?.value.state === 'lost') {
      // Its host is lost: no answer will come. The VM went with the host, or is stopped when
      // the host returns (the queued step, and reclaimReturnedHost for a destroyed sandbox).
      await this.sendHostWork(hostId, op.id, cur.tenantId, 'destroy/lost-host', stopVm(cur.id), 'could not queue the destroy of a VM on a lost host');
    } else if (hostId) {
      try {
        await this.step(op, 'destroy', hostId, stopVm(cur.id));
      } catch (e) {
        // The host was lost meanwhile, and markHostLost destroyed the sandbox: done.
        if ((await this.deps.store.getSandbox(cur.tenantId, cur.id))?.value.state !== 'destroyed') throw e;
        return this.finish(op, { sandboxIds: [cur.id] }, null);
      }
    }
    await this.finish(
      op,
      { sandboxIds: [cur.id] },
      null,
      undefined,
      this.sandboxWrite(
        cur,
        (s) => {
          this.setState(s, 'destroyed', this.deps.clock.now(), reason);
          s.opId = '';
        },
        undefined,
        // Only what this write takes from `destroying` is released: a concurrent destroy that
        // finished first, or a failing start that released when it wrote `failed`, did it.
        async (_next, prev) => (prev.state === 'destroying' ? this.capacity(hostId, bookingOf(prev), -1)() : []),
      ),
    );
  }

  private async runDeleteSnapshot(op: OperationRec): Promise<void> {
    const v = await this.deps.store.getSnapshot(op.tenantId, op.targetId);
    if (!v) throw new NotFoundError('snapshot', op.targetId);
    if (v.value.state === 'deleted') return this.finish(op, { snapshotId: v.value.id }, null);
    const reason = (op.input as { reason?: string }).reason === 'expired' ? 'expired' : 'deleted';
    // `deleting` is written guarded by the revision the checks read: a pin, or a snapshot
    // that became ready, in between makes them run again. Retention's delete (planned from
    // the leader's cache, perhaps by an earlier leader) goes on only while the record is
    // still announced and due: a retention set since clears the announcement (SetSnapshotRetention),
    // and a pass that found it no longer due (back in its window, say) withdrew it.
    let kept = false;
    const sn = await this.updateSnapshotRec(op.tenantId, op.targetId, (cur) => {
      if (cur.state === 'deleted' || cur.state === 'deleting') return undefined;
      if (cur.state === 'creating') throw new WrongStateError('snapshot', cur.id, 'creating', 'delete it once it is ready or failed');
      if (cur.pinned) throw new WrongStateError('snapshot', cur.id, 'pinned', 'unpin it first');
      if (reason === 'expired' && (cur.expiryDueAt === undefined || cur.expiryDueAt === null || cur.expiryDueAt > this.deps.clock.now())) {
        kept = true;
        return undefined;
      }
      return { ...cur, state: 'deleting', deletingFrom: cur.state === 'failed' ? 'failed' : 'ready', deletingBy: op.id };
    });
    if (!sn) throw new NotFoundError('snapshot', op.targetId);
    if (kept) return this.finish(op, { snapshotId: sn.id }, null, undefined, undefined, 'kept: retention no longer wants it deleted (its expiry was withdrawn, or moved later)');
    if (sn.state === 'deleted') return this.finish(op, { snapshotId: sn.id }, null);
    // Nothing live loses its snapshot: a sandbox restored from it maps its memory image, a
    // hibernated one lives in it. They are looked for only once the mark is written: a
    // placement from this snapshot is guarded by its record (placeGroup), so one that
    // commits after the mark fails, and one that committed before it is found here. While
    // `deletingFrom` is set the delete may still go back; a re-run (its first run may have
    // died between the mark and the look) looks again. Once nothing was found it is cleared
    // before any host deletes a byte, so a re-run after that never puts back a snapshot whose
    // bytes may be gone (a create that failed against the mark is a user it would find).
    if (sn.deletingFrom !== undefined) {
      // Operations too: a fork of the snapshot accepted before the mark has no child records
      // yet (its guard on the snapshot's revision refuses one after it, Fleet.whileReady).
      const [sbs, ops] = await Promise.all([this.deps.store.listSandboxes(op.tenantId), this.deps.store.listOps({ activeOnly: true, tenantId: op.tenantId })]);
      const users = sbs.map((b) => b.value).filter((b) => snapshotsUsedBy(b).includes(sn.id));
      const opUsers = snapshotsOfOps(ops.map((o) => o.value)).get(sn.id) ?? [];
      if (users.length > 0 || opUsers.length > 0) {
        // Back to the state it had: nothing was deleted yet.
        await this.updateSnapshotRec(op.tenantId, op.targetId, (cur) => {
          // Only the mark it looked under: a later delete's mark is that delete's to undo.
          if (cur.state !== 'deleting' || cur.deletingFrom === undefined || cur.deletingBy !== sn.deletingBy) return undefined;
          const { deletingFrom, deletingBy: _by, ...rest } = cur;
          return { ...rest, state: deletingFrom };
        });
        if (users.length === 0) throw new WrongStateError('snapshot', sn.id, 'in use', `operations ${opUsers.slice(0, 5).join(', ')}${opUsers.length > 5 ? ', ...' : ''} will start sandboxes from it; delete it once they have ended and their sandboxes are destroyed`);
        throw new WrongStateError('snapshot', sn.id, 'in use', `sandboxes ${users.slice(0, 5).map((b) => b.id).join(', ')}${users.length > 5 ? ', ...' : ''} use it; destroy them first`);
      }
      await this.updateSnapshotRec(op.tenantId, op.targetId, (cur) => {
        // Put back meanwhile by another delete that found users (then pinned or forked from,
        // perhaps): this delete's look is stale, and it must not go on to delete the bytes.
        if (cur.state !== 'deleting') throw new WrongStateError('snapshot', cur.id, cur.state, 'another delete found it in use and put it back while this one looked; retry');
        // Marked again since (put back, forked from, marked by another delete): this look is
        // stale too; the later mark's delete looks for itself.
        if (cur.deletingFrom !== undefined && cur.deletingBy !== sn.deletingBy) throw new WrongStateError('snapshot', cur.id, cur.state, 'another delete marked it again while this one looked; retry');
        if (cur.deletingFrom === undefined) return undefined;
        const { deletingFrom: _gone, ...rest } = cur;
        return rest;
      });
    }
    await Promise.all(sn.hostIds.map((h) => this.step(op, `delete/${h}`, h, { case: 'deleteSnapshot', value: { snapshotId: sn.id } as never }).catch((e: unknown) => this.log.warn({ err: e, hostId: h }, 'snapshot delete on host failed'))));
    await this.updateSnapshotRec(op.tenantId, op.targetId, (cur) => (cur.state === 'deleted' ? undefined : { ...cur, state: 'deleted', hostIds: [], deletedReason: reason, endedAt: this.deps.clock.now() }));
    await this.finish(op, { snapshotId: sn.id }, null);
  }

  private async runFork(op: OperationRec): Promise<void> {
    const input = op.input as {
      snapshotId: string;
      sandboxId: string;
      count: number;
      childIds: string[];
      lineageId: string;
      placement?: PlacementPrefs;
      labels?: Record<string, string>;
      ttlMs?: number | null;
      afterResume?: HookRec[] | null;
      idleTimeoutMs?: number | null;
      forkSnapshotId?: string;
      /** Absent in ops submitted before it existed: kept. */
      snapshotRetention?: { ttlMs: number | null; keepLast: number };
    };
    // 1. The snapshot: given, or taken now from the live sandbox. Its id is recorded before it
    //    is taken, so a re-run (a new leader) takes up the same snapshot: done already, or
    //    still to finish (snapshotOf resumes a creating record; the agent answers the repeated
    //    step from its journal or joins the run in progress).
    let snapshotId = input.snapshotId;
    const placedBefore = !!(this.ops.get(op.id)?.value ?? op).result?.sandboxIds;
    // Cancelled before its children were placed: none are. A snapshot of a live source that
    // an earlier run started is finished first (below), so its record does not stay
    // `creating`; it stays, with its retention.
    if (!placedBefore && !input.forkSnapshotId) this.stopIfCancelled(op);
    if (!snapshotId && placedBefore && input.forkSnapshotId) {
      // Its children are placed from that snapshot already (a re-run): it is not taken again,
      // whatever its record says now.
      snapshotId = input.forkSnapshotId;
    } else if (!snapshotId) {
      const id = input.forkSnapshotId || newId('sn');
      if (!input.forkSnapshotId) {
        await this.updateOp(op.tenantId, op.id, (o) => {
          (o.input as { forkSnapshotId?: string }).forkSnapshotId = id;
          o.progress.message = 'snapshotting source';
        });
      }
      // Labelled: its keep_last counts only against other forks' snapshots (retention.ts).
      snapshotId = (await this.snapshotOf(op, input.sandboxId, id, { retentionTtlMs: input.snapshotRetention?.ttlMs ?? null, keepLast: input.snapshotRetention?.keepLast ?? 0, labels: { [PURPOSE_LABEL]: 'fork' } })).id;
    }
    const snv = await this.readSnapshot(op.tenantId, snapshotId);
    // A re-run whose children are placed (they are booked, and `starting`) goes on while the
    // snapshot's record is there in any state: a delete that began meanwhile finds them using
    // it and keeps it. Gone (or failed), its children fail rather than stay starting for good.
    const usable = snv && (snv.value.state === 'ready' || (placedBefore && snv.value.state !== 'deleted' && snv.value.state !== 'failed'));
    if (!usable) {
      const gone = new NotFoundError('snapshot', snapshotId);
      if (placedBefore) await this.failStartingChildren(op, gone);
      throw gone;
    }
    const sn = snv.value;
    // What the children inherit: copied into the snapshot's record when it was taken (the
    // source sandbox's own record may be gone by now), else from that record.
    const source = sn.inherits ?? (sn.sourceSandboxId ? (await this.deps.store.getSandbox(op.tenantId, sn.sourceSandboxId))?.value : undefined);
    const resources: ResourcesRec = source?.resources ?? { vcpus: sn.vmConfig?.vcpus ?? 1, memoryMib: sn.vmConfig?.memoryMib ?? 256, diskMib: 1024 };

    // 2. Placement, committed with the children's records and the op's plan in one
    //    transaction: either all of it exists (op.result is set) or none of it does.
    const opNow = this.ops.get(op.id)?.value ?? op;
    if (!opNow.result?.sandboxIds) this.stopIfCancelled(op);
    let children: Array<{ rec: SandboxRec; rev: number }>;
    let transfers: Array<{ sourceHostId: string; destinationHostId: string; wave: number }> = [];
    if (!opNow.result?.sandboxIds) {
      const now = this.deps.clock.now();
      let made: SandboxRec[] = [];
      const placed = await this.placeAndBook(
        op,
        { tenantId: op.tenantId, id: snapshotId },
        () => ({ kind: 'fork', id: op.id, nowMs: now, snapshotId, count: input.count, overlayDiskMib: resources.diskMib, preferences: this.prefs(input.placement) }),
        (res) => {
          const shares = forkBookings(res, snapshotId, resources);
          made = res.placements.map((p) => {
            const id = input.childIds[p.childIndex]!;
            const imageShare = shares.imageShare(p.hostId);
            return {
              id,
              tenantId: op.tenantId,
              state: 'starting',
              stateReason: '',
              hostId: p.hostId,
              resources,
              image: source?.image ?? '',
              sourceSnapshotId: snapshotId,
              lineageId: input.lineageId,
              hostname: id,
              labels: input.labels ?? {},
              ttlMs: input.ttlMs ?? null,
              idleTimeoutMs: input.idleTimeoutMs ?? source?.idleTimeoutMs ?? null,
              afterResume: input.afterResume ?? source?.afterResume ?? [],
              allowEgress: source?.allowEgress ?? false,
              allowCidrs: source?.allowCidrs ?? [],
              createdAt: now,
              updatedAt: now,
              runningMsBefore: 0,
              runningSince: null,
              hibernationSnapshotId: '',
              opId: op.id,
              ...(imageShare ? { imageShare } : {}),
            } satisfies SandboxRec;
          });
          const plan = (res.transferPlan?.transfers ?? []).map((t) => ({ sourceHostId: t.sourceHostId, destinationHostId: t.destinationHostId, wave: t.wave }));
          return {
            perChild: shares.booking,
            writes: made.map((sb) => ({ kind: 'sandbox', value: sb, expectRevision: 0 }) as StoreWrite),
            opUpdate: (o) => {
              (o.input as { transfers?: unknown }).transfers = plan;
              o.result = { sandboxIds: made.map((c) => c.id), snapshotId, explanation: compactExplanation(res.explanation) };
              o.progress = { done: 0, total: made.length, message: 'restoring children', bytesTransferred: 0 };
            },
          };
        },
      ).catch(async (e: unknown) => {
        // A placement commit whose answer was lost may have landed all the same (etcd3
        // retried it and it then conflicted with itself, or etcd stopped answering): the op
        // record says. If it did, its children exist and hold their booking.
        const landed = (await this.deps.store.getOp(op.tenantId, op.id))?.value;
        if (!landed?.result?.sandboxIds) throw e;
        this.log.info({ opId: op.id, err: e }, 'the placement commit had landed; going on with its children');
        return landed;
      });
      if ('revision' in placed) {
        children = made.map((rec) => ({ rec, rev: placed.revision }));
        transfers = ((this.ops.get(op.id)?.value.input as { transfers?: typeof transfers } | undefined)?.transfers ?? []);
      } else ({ children, transfers } = await this.childrenOf(op, placed));
    } else ({ children, transfers } = await this.childrenOf(op, opNow));

    // 3. One restore step per host, in transfer waves (restoreRound). Children a host that
    //    was lost meanwhile was starting, or whose restore failed there for the host's own
    //    reasons (sortFailedRestores), are placed again on other hosts (replaceChildren), up
    //    to FORK_REPLACEMENTS times each: a fork of 64 whose host dies mid-way, or cannot
    //    restore (a full disk), still ends with 64 children when the fleet has room for them.
    const replaced: Replacements = { ...((this.ops.get(op.id)?.value ?? opNow).input as { replaced?: Replacements }).replaced };
    // A run again (a failover, a store failure) after children were placed again: the hosts they
    // were taken off are told to give them up once more. The first run sent that after its
    // commit, and may have died (or lost the commit's answer) before it did: a host that came
    // back would then run its queued restore and start a second VM of the child.
    for (const c of children) {
      if (c.rec.state !== 'starting') continue;
      for (const from of replaced[c.rec.id]?.from ?? []) {
        if (from !== c.rec.hostId) this.giveUpOn(from, op, c.rec.id);
      }
    }
    /**
     * Children that started (a VM was made for them): a cancelled fork destroys them. A re-run
     * after a failover counts those it finds past `starting` (its cancel may have been
     * destroying them: their destroy ops, keyed, are waited for again).
     */
    const started = new Set(children.filter((c) => c.rec.state !== 'starting' && c.rec.state !== 'failed').map((c) => c.rec.id));
    let runningCount = children.filter((c) => c.rec.state === 'running').length;
    const progress = { lastAt: this.deps.clock.now() };
    const onRunning = (ids: readonly string[]): void => {
      for (const id of ids) started.add(id);
      runningCount += ids.length;
      // Progress is written at most once a second (and with the final state), not per host.
      if (this.deps.clock.now() - progress.lastAt < 1000) return;
      progress.lastAt = this.deps.clock.now();
      const d = runningCount;
      void this.updateOp(op.tenantId, op.id, (o) => {
        o.progress.done = Math.max(o.progress.done, d);
      }).catch(() => undefined);
    };
    const failures: unknown[] = [];
    /** Where each live child is (or is being started): a child placed again keeps to maxPerHost with its siblings. */
    const hostOf = new Map(children.filter((c) => c.rec.state === 'starting' || c.rec.state === 'running').map((c) => [c.rec.id, c.rec.hostId]));
    /** The op fails with the host's error; its children fail too if their start did (a step that answered made their VMs). */
    const fail = async (f: { children: Array<{ rec: SandboxRec }>; error: unknown; stepFailed: boolean }): Promise<void> => {
      failures.push(f.error);
      if (!f.stepFailed) return;
      for (const c of f.children) {
        hostOf.delete(c.rec.id);
        // A cancel that kept a step from going out may follow one that went out in an earlier
        // run of this op (a failover): its VMs may run. A stop of a VM never made does nothing.
        await this.failSandbox(c.rec, f.error, f.error instanceof OperationCancelledError);
      }
    };
    let batch = children.filter((c) => c.rec.state === 'starting');
    let plan = transfers;
    while (batch.length > 0) {
      // Children placed again are restored in a step of their own, named by the placement that
      // moved them (so a re-run sends the same step): a host that restored others for this op
      // would otherwise answer with that result.
      const byPlacement = new Map<string, typeof batch>();
      for (const c of batch) byPlacement.set(replaced[c.rec.id]?.by ?? '', [...(byPlacement.get(replaced[c.rec.id]?.by ?? '') ?? []), c]);
      const failed = (await Promise.all([...byPlacement].map(([by, b]) => this.restoreRound(op, snapshotId, sn, b, plan, by, onRunning)))).flat();
      if (!this.active) return;
      // A host that failed: its children fail, unless the host was lost or failed their restore
      // for its own reasons, and they can be placed again. A host whose children could not be
      // marked running (the store failed) is left as it is: the fork runs again (run()),
      // finding the others running and that host's restore answered already.
      const { stranded, why, failing, hostFaults } = sortFailedRestores(failed.filter((f) => !(f.error instanceof StoreUnavailableError)), replaced);
      for (const f of hostFaults) this.noteFailedStart(f.hostId, 'restore', f.error);
      for (const f of failing) await fail(f);
      const unknown = failed.find((f) => f.error instanceof StoreUnavailableError);
      if (unknown) throw unknown.error;
      const moving = stranded.flatMap((f) => f.children);
      const movingIds = new Set(moving.map((c) => c.rec.id));
      const siblings = new Map<string, number>();
      for (const [id, h] of hostOf) if (!movingIds.has(id)) siblings.set(h, (siblings.get(h) ?? 0) + 1);
      const again = moving.length > 0 ? await this.replaceChildren(op, snapshotId, resources, input.placement, moving, siblings, replaced, why) : undefined;
      if (moving.length > 0) this.deps.onChildrenReplaced?.(again ? 'placed' : 'failed', again ? again.children.length : moving.length);
      // No live host had room for them (or they moved on): they fail as their host did.
      if (!again) {
        for (const f of stranded) await fail(f);
        break;
      }
      for (const c of again.children) hostOf.set(c.rec.id, c.rec.hostId);
      batch = again.children;
      plan = again.transfers;
    }
    const result = { sandboxIds: children.map((c) => c.rec.id), snapshotId };
    const total = children.length;
    if (this.cancelRequested(op.id)) return this.destroyForCancel(op, result, [...started], runningCount);
    if (failures.length > 0) {
      const first = errorOf(failures[0]);
      // Retryable only when nothing started: a caller that retries a partly started fork
      // (with a new key) would start a second set beside the running children.
      return this.finish(op, result, { ...first, message: `${runningCount} of ${total} children started; ${first.message}`, retryable: first.retryable && runningCount === 0 }, runningCount);
    }
    // Children that an earlier run of this op failed (before a failover or a store outage)
    // fail the op as they did then, though this run had nothing left to do for them.
    const failedBefore = children.find((c) => c.rec.state === 'failed');
    if (failedBefore) return this.finish(op, result, { kind: 'unavailable', message: `${runningCount} of ${total} children started; child ${failedBefore.rec.id}: ${failedBefore.rec.stateReason}`, retryable: false }, runningCount);
    await this.finish(op, result, null, runningCount);
  }

  /**
   * Restores a batch of a fork's children, one step per host, in transfer waves: a host that
   * fetches from another destination starts after that destination holds the snapshot.
   * Resolves with the hosts that failed, their children still `starting`: where the step
   * failed the caller fails them or places them again; where it answered (`stepFailed`
   * false) their VMs run and only marking them running failed.
   */
  private async restoreRound(
    op: OperationRec,
    snapshotId: string,
    sn: SnapshotRec,
    batch: Array<{ rec: SandboxRec; rev: number }>,
    transfers: Array<{ sourceHostId: string; destinationHostId: string; wave: number }>,
    /** The placement that put this batch where it is: '' for the fork's own, else replaceChildren's. */
    placedBy: string,
    onRunning: (ids: readonly string[]) => void,
  ): Promise<Array<{ hostId: string; children: Array<{ rec: SandboxRec; rev: number }>; error: unknown; stepFailed: boolean }>> {
    const byHost = new Map<string, Array<{ rec: SandboxRec; rev: number }>>();
    for (const c of batch) byHost.set(c.rec.hostId, [...(byHost.get(c.rec.hostId) ?? []), c]);
    // In a small spread, a host with few children migrates them from a holder (ADR 0015): it
    // starts at once and never serves onward, so the transfer plan's waves apply only among
    // the other hosts. A host that does serve onward must hold the snapshot afterwards: no
    // migration there. A wide fan-out keeps the plan's tree: one migration stream per child
    // from the holders would overload their uplinks.
    const migrateMax = this.deps.config.migrateMaxChildren ?? 2;
    const lacking = new Set(transfers.map((t) => t.destinationHostId));
    // Never where the children are booked as shares of the image (placed on a holder, which
    // restores from its local copy): migrated, each would hold memory of its own.
    const migrates = (h: string): boolean => lacking.size <= MIGRATE_MAX_HOSTS && lacking.has(h) && (byHost.get(h)?.length ?? 0) <= migrateMax && !(byHost.get(h) ?? []).some((c) => c.rec.imageShare);
    const sourceOf = new Map(transfers.filter((t) => !migrates(t.destinationHostId) && !migrates(t.sourceHostId)).map((t) => [t.destinationHostId, t.sourceHostId]));
    // Plans made at different times (a placement again after a host loss, merged into the op's
    // transfers) may name each other as sources, X from Y and Y from X: each would wait for the
    // other for good (and runHost recursed until the stack overflowed). A host on such a cycle
    // fetches from whichever holders there are instead of waiting.
    for (const h of [...sourceOf.keys()]) {
      const seen = new Set<string>();
      for (let cur = sourceOf.get(h); cur !== undefined && !seen.has(cur); cur = sourceOf.get(cur)) {
        if (cur === h) {
          sourceOf.delete(h);
          break;
        }
        seen.add(cur);
      }
    }
    const done = new Map<string, Promise<boolean>>();
    /** Hosts whose restore step failed (not what came after it: marking the children running). */
    const stepFailed = new Set<string>();
    /** Children a host's answer did not list: it did not start them (it had been told to give them up). */
    const notStarted: Array<{ hostId: string; children: Array<{ rec: SandboxRec; rev: number }>; error: unknown; stepFailed: boolean }> = [];
    const runHost = (hostId: string): Promise<boolean> => {
      const existingRun = done.get(hostId);
      if (existingRun) return existingRun;
      const p = (async () => {
        const src = sourceOf.get(hostId);
        // Only a source that copies the snapshot in this round itself (a relay) is waited for.
        // A holder serves at once, whatever its own children's restore: a fork of 64 that put
        // 20 children on the holder had the other hosts' copies start only after those 20 had
        // restored (4.6-9.2 s of each such fork on the local TCG fleet).
        if (src && byHost.has(src) && lacking.has(src)) {
          // The relay serves onward once the snapshot is stored there (its SNAPSHOT_STORED),
          // or, should that word not come, once its step has ended.
          const stored = this.stored.when(op.id, src, snapshotId);
          try {
            await Promise.race([runHost(src).catch(() => false), stored.stored]);
          } finally {
            stored.cancel();
          }
        }
        const mine = byHost.get(hostId) ?? [];
        const vms = mine.map((c) => this.vmSpec(c.rec));
        const stepId = placedBy ? `restore/${hostId}/${placedBy}` : `restore/${hostId}`;
        let restored: HostResultMsg;
        let fetch: ReturnType<Executor['fetchPlan']>;
        try {
          // What fails before the step is sent (the snapshot's record, a fetch plan with no
          // holder left) fails the children too: left `starting`, they would keep their
          // booking with nothing to end them.
          const current = (await this.readSnapshot(op.tenantId, snapshotId))?.value ?? sn;
          fetch = this.fetchPlan(current, hostId, src, migrates(hostId));
          // Cancelled: a step not sent yet (a later wave's) is not sent; its children fail.
          this.stopIfCancelled(op);
          restored = await this.step(op, stepId, hostId, { case: 'restoreVms', value: { snapshotId, vms, ...(fetch ? { fetch } : {}) } as never });
          // A start that worked there: its failed restores no longer count (noteFailedStart).
          this.startWorked(hostId, 'restore');
        } catch (e) {
          stepFailed.add(hostId);
          throw e;
        }
        // Only the children the host says it runs: one it had been told to stop for this op
        // (a child placed there again after it was moved off) is skipped there, and recorded
        // running it would be a sandbox with no VM.
        const listed = new Set(restored.vms.map((v) => v.sandboxId));
        const started = mine.filter((c) => listed.has(c.rec.id));
        const skipped = mine.filter((c) => !listed.has(c.rec.id));
        if (skipped.length > 0) notStarted.push({ hostId, children: skipped, error: new HostStepError(hostId, stepId, 'failed_precondition', `host ${hostId} did not start ${skipped.map((c) => c.rec.id).join(', ')} (it had been told to give ${skipped.length === 1 ? 'it' : 'them'} up)`, false), stepFailed: true });
        // Counted as started only if recorded running (not a child destroyed while it restored).
        onRunning(started.length > 0 ? await this.markRunning(started.map((c) => ({ ...c, rec: { ...c.rec, stateReason: this.hookReport(restored, c.rec.id) } }))) : []);
        // Bookkeeping, whatever it meets (the snapshot's record changing under every try, a
        // full store): the children run, and the host's heartbeats say it holds the snapshot.
        // It failed the fork (not retryable, every child running) before. A store out or a lost
        // lead still ends the round, as every write of it does.
        if (storedThere(fetch !== undefined, restored)) await this.addHolderKeptBy(op, snapshotId, hostId);
        return true;
      })();
      done.set(hostId, p);
      return p;
    };
    const hosts = [...byHost.keys()];
    const outcomes = await Promise.allSettled(hosts.map((h) => runHost(h)));
    return [...outcomes.flatMap((o, i) => (o.status === 'rejected' ? [{ hostId: hosts[i]!, children: byHost.get(hosts[i]!)!, error: o.reason as unknown, stepFailed: stepFailed.has(hosts[i]!) }] : [])), ...notStarted];
  }

  /**
   * Places a fork's children again, off the lost host(s) that were starting them: their
   * records move to the new hosts (still `starting`), the lost hosts' booking for them is
   * released and the new hosts' taken, with the op's transfer plan and replacement counts,
   * in one transaction. Resolves undefined when no live host has room (the caller fails the
   * children, as before) or when the records moved on (a destroy).
   */
  private async replaceChildren(
    op: OperationRec,
    snapshotId: string,
    resources: ResourcesRec,
    prefs: PlacementPrefs | undefined,
    stranded: Array<{ rec: SandboxRec; rev: number }>,
    siblingsPerHost: ReadonlyMap<string, number>,
    replaced: Replacements,
    /** Why each host the children are taken off could not start them ('was lost', 'failed their restore'). */
    why: ReadonlyMap<string, string> = new Map(),
  ): Promise<{ children: Array<{ rec: SandboxRec; rev: number }>; transfers: Array<{ sourceHostId: string; destinationHostId: string; wave: number }> } | undefined> {
    // Only records still as the restore left them: starting, on the host that failed them, for this op.
    const stillStranded = async (of: readonly SandboxRec[]): Promise<Array<Versioned<SandboxRec>>> =>
      (await Promise.all(of.map((c) => this.deps.store.getSandbox(op.tenantId, c.id)))).filter(
        (v, i): v is Versioned<SandboxRec> => v !== undefined && v.value.state === 'starting' && v.value.hostId === of[i]!.hostId && v.value.opId === op.id,
      );
    let fresh = await stillStranded(stranded.map((c) => c.rec));
    if (fresh.length === 0) return undefined;
    const fromHosts = [...new Set(fresh.map((v) => v.value.hostId))];
    const whyOf = (h: string): string => `host ${h} ${why.get(h) ?? 'was lost'}`;
    this.log.warn({ opId: op.id, hosts: fromHosts.map(whyOf), children: fresh.length }, 'placing children again: the host starting them was lost or failed their restore');
    const now = this.deps.clock.now();
    // Names this placement in the op record and in the step ids of its restores.
    const by = `again-${newId('op').slice(3, 11)}`;
    let made: Array<{ rec: SandboxRec; rev: number; from: string }> = [];
    let plan: Array<{ sourceHostId: string; destinationHostId: string; wave: number }> = [];
    try {
      const placed = await this.placeAndBook(
        op,
        { tenantId: op.tenantId, id: snapshotId },
        // Never back onto a lost host (it may be back by the time this runs): it has been told
        // to give these children up (stop-replaced below) and would skip their restore.
        // Nor onto a host an earlier placement took one of them off: back, it was told then to
        // give that child up too.
        () => ({ kind: 'fork', id: op.id, nowMs: now, snapshotId, count: fresh.length, overlayDiskMib: resources.diskMib, siblingsPerHost, preferences: { ...this.prefs(prefs), avoidHostIds: [...new Set([...fromHosts, ...fresh.flatMap((v) => replaced[v.value.id]?.from ?? [])])] } }),
        (res) => {
          const shares = forkBookings(res, snapshotId, resources);
          made = res.placements.map((p) => {
            const v = fresh[p.childIndex]!;
            const rec: SandboxRec = { ...v.value, hostId: p.hostId, stateReason: `placed again: ${whyOf(v.value.hostId)}`, updatedAt: now };
            const imageShare = shares.imageShare(p.hostId);
            if (imageShare) rec.imageShare = imageShare;
            else delete rec.imageShare;
            return { rec, rev: v.modRevision, from: v.value.hostId };
          });
          plan = (res.transferPlan?.transfers ?? []).map((t) => ({ sourceHostId: t.sourceHostId, destinationHostId: t.destinationHostId, wave: t.wave }));
          // The lost hosts' booking for these children, taken off as the cache has it (a stale
          // revision conflicts and the group is planned again on a reloaded cache).
          const release: StoreWrite[] = [...new Set(fresh.map((v) => v.value.hostId))].map((h) => {
            const a = this.cache.allocs.get(h);
            let alloc: HostAllocRec = a?.value ?? { hostId: h, allocated: ZERO, sandboxes: 0 };
            for (const v of fresh) if (v.value.hostId === h) alloc = applyBooking(alloc, bookingOf(v.value), -1, this.privateMemoryFraction);
            return { kind: 'alloc', value: alloc, expectRevision: a?.modRevision ?? 0 };
          });
          const dests = new Set(plan.map((t) => t.destinationHostId));
          return {
            perChild: shares.booking,
            writes: [...made.map((m) => ({ kind: 'sandbox', value: m.rec, expectRevision: m.rev }) as StoreWrite), ...release],
            opUpdate: (o) => {
              const inp = o.input as { transfers?: typeof plan; replaced?: Replacements };
              // Earlier transfers into a new destination, or out of one (it may have restored by
              // migration, holding nothing to serve) or out of a lost host, are dropped.
              inp.transfers = [...(inp.transfers ?? []).filter((t) => !dests.has(t.destinationHostId) && !dests.has(t.sourceHostId) && !fromHosts.includes(t.sourceHostId)), ...plan];
              inp.replaced = { ...inp.replaced, ...Object.fromEntries(made.map((m) => [m.rec.id, replacedAgain(inp.replaced?.[m.rec.id], by, m.from)])) };
              o.progress.message = `placing ${made.length} children again: ${fromHosts.map(whyOf).join('; ')}`;
            },
          };
        },
        // A child changed meanwhile (destroyed by its user, say) fails the guard on its record
        // every time: the others are placed again without it.
        async () => {
          fresh = await stillStranded(fresh.map((v) => v.value));
          if (fresh.length === 0) throw new WrongStateError('fork', op.id, 'its stranded children moved on', 'none is left to place again');
        },
      );
      for (const m of made) replaced[m.rec.id] = replacedAgain(replaced[m.rec.id], by, m.from);
      // The lost host may only be away: back, its agent would run the restore still queued for
      // it and start a second VM of each child. A stop of this op, queued behind that restore,
      // ends any it made, and one that arrives first makes the agent skip them (agent.ts).
      for (const v of fresh) this.giveUpOn(v.value.hostId, op, v.value.id);
      return { children: made.map((m) => ({ rec: m.rec, rev: placed.revision })), transfers: plan };
    } catch (e) {
      if (e instanceof StoreUnavailableError) throw e;
      this.log.warn({ opId: op.id, err: e }, 'could not place the lost host\'s children again');
      return undefined;
    }
  }

  /** A fork's children as placed (a re-run after a failover, say): the placement stands; what is left is finished. */
  private async childrenOf(op: OperationRec, placed: OperationRec): Promise<{ children: Array<{ rec: SandboxRec; rev: number }>; transfers: Array<{ sourceHostId: string; destinationHostId: string; wave: number }> }> {
    const existing = await Promise.all((placed.result?.sandboxIds ?? []).map((id) => this.deps.store.getSandbox(op.tenantId, id)));
    return {
      children: existing.filter((e): e is Versioned<SandboxRec> => e !== undefined).map((e) => ({ rec: e.value, rev: e.modRevision })),
      transfers: (placed.input as { transfers?: Array<{ sourceHostId: string; destinationHostId: string; wave: number }> }).transfers ?? [],
    };
  }

  /**
   * addHolder for a host that fetched the snapshot for `op`'s VMs (a create, a fork, a wake),
   * which run whatever this meets: bookkeeping (the host's heartbeats say it holds the
   * snapshot), logged; only what ends the run (a store out, a lost lead) is thrown.
   */
  private addHolderKeptBy(op: OperationRec, snapshotId: string, hostId: string): Promise<void> {
    return this.addHolder(op.tenantId, snapshotId, hostId).catch((e: unknown) => {
      if (this.endsTheRun(e)) throw e;
      this.log.warn({ err: e, opId: op.id, snapshotId, hostId }, `could not record a host as a holder of the snapshot it fetched for a ${op.kind}: its heartbeats will say so`);
    });
  }

  /**
   * Records that a host now holds a snapshot. Hosts added while an update of the same
   * snapshot record is in flight go into the next one together: a fork that spreads a
   * snapshot to 64 hosts makes a few guarded writes of the record, not 64 racing ones that
   * conflict with each other.
   */
  private addHolder(tenantId: string, snapshotId: string, hostId: string): Promise<void> {
    const k = `${tenantId}/${snapshotId}`;
    return new Promise<void>((resolve, reject) => {
      const q = this.holderQueue.get(k) ?? { hosts: new Set<string>(), done: [] };
      this.holderQueue.set(k, q);
      q.hosts.add(hostId);
      q.done.push({ settle: (e) => (e === undefined ? resolve() : reject(e)) });
      // Outside the caller's runner term (as flushGroups): a flush begun by a runner of an earlier
      // term would fail every host queued behind it, this term's forks' too, as not leader.
      if (!this.holderFlushing.has(k)) void this.runnerTerm.exit(() => this.flushHolders(tenantId, snapshotId));
    });
  }

  private async flushHolders(tenantId: string, snapshotId: string): Promise<void> {
    const k = `${tenantId}/${snapshotId}`;
    this.holderFlushing.add(k);
    try {
      for (let q = this.holderQueue.get(k); q; q = this.holderQueue.get(k)) {
        this.holderQueue.delete(k);
        let error: unknown;
        try {
          let recorded = false;
          for (let i = 0; i < 20 && !recorded; i++) {
            const v = await this.deps.store.getSnapshot(tenantId, snapshotId);
            const add = v ? [...q.hosts].filter((h) => !v.value.hostIds.includes(h)) : [];
            if (!v || add.length === 0) recorded = true;
            else recorded = (await this.commit([{ kind: 'snapshot', value: { ...v.value, hostIds: [...v.value.hostIds, ...add] }, expectRevision: v.modRevision }])) > 0;
          }
          // Every try conflicted: the hosts are not recorded, and their callers are told so.
          if (!recorded) throw new ConflictError(`snapshot ${snapshotId}'s holders`);
        } catch (e) {
          error = e;
        }
        for (const d of q.done) d.settle(error);
      }
    } finally {
      this.holderFlushing.delete(k);
    }
  }

  // ---------------------------------------------------------------- drain

  /**
   * Drain: the host is cordoned (no new placements) and marked draining until the drain
   * ends (drainEnded). With
   * `migrate`, every running or paused sandbox on it moves to another host: pause it,
   * snapshot it, book capacity elsewhere, restore it there under the same sandbox id,
   * switch the record (host and capacity) in one transaction, then destroy the source VM.
   * Without `migrate`, they are hibernated in place and their snapshots copied to another
   * host (drainByHibernating).
   * Progress per sandbox is recorded in the op's input before each step, so a new leader
   * resumes a half-done migration instead of repeating it. A sandbox no other host could take
   * now is not paused or snapshotted at all (moveRefusal). The op's progress counts the
   * sandboxes moved of those to move; a drain that left any (or a snapshot) behind fails with
   * its causes' kind (drainFailure).
   */
  private async runDrain(op: OperationRec): Promise<void> {
    const hostId = op.targetId;
    const input = op.input as unknown as DrainInput;
    for (let i = 0; i < 10; i++) {
      const h = await this.deps.store.getHost(hostId);
      if (!h) throw new NotFoundError('host', hostId);
      if (h.value.cordoned && h.value.draining) break;
      // The drain was asked with the cordon (DrainHost writes both): a host not cordoned now was
      // uncordoned since, and a run of the drain (again, after a failover) must not cordon it
      // back over the admin. It still settles what an earlier run began (a migration it
      // booked, a sandbox it claimed and paused): migrate() finishes or undoes those, and
      // refuses the others (not draining).
      if (!h.value.cordoned) break;
      if (await this.commit([{ kind: 'host', value: { ...h.value, cordoned: true, draining: true }, expectRevision: h.modRevision }])) break;
    }
    // Sandboxes booked here before the cordon that are still on their way (a fork's children
    // starting, a wake, a hibernate) are waited for, as long as their steps may take: listed
    // now, they would be skipped, and would then run on the drained host. Not once the drain is
    // cancelled: it then moves or hibernates none of them (named below, as not settled).
    let listed = (await this.deps.store.listSandboxes(undefined)).map((v) => v.value);
    const settling = (): SandboxRec[] => listed.filter((sb) => sb.hostId === hostId && DRAIN_WAITS_FOR.has(sb.state));
    const until = this.stepsDeadline();
    while (settling().length > 0 && this.active && this.deps.clock.now() < until && !this.cancelRequested(op.id)) {
      await new Promise((r) => setTimeout(r, 1000));
      listed = (await this.deps.store.listSandboxes(undefined)).map((v) => v.value);
    }
    const unsettled = settling();
    const onHost = listed.filter((sb) => sb.hostId === hostId && (sb.state === 'running' || sb.state === 'paused'));
    if (!input.migrate) return this.drainByHibernating(op, hostId, onHost, unsettled);
    const moved: string[] = [];
    const failures: string[] = unsettled.map(stillOnItsWay);
    // The kinds of the failures that are errors caught (a migration's), for the drain's own
    // (drainFailure); any other failure counts as unavailable.
    const causes: Array<OperationError['kind']> = [];
    // An earlier run of this drain (before a failover or a store outage) that switched a
    // sandbox's record may have stopped before it destroyed the source VM: done now (the
    // agent answers a repeated step from its journal).
    const recorded = (this.ops.get(op.id)?.value.input as unknown as DrainInput | undefined)?.migrations ?? {};
    let earlier = 0;
    // Switched: marked so since the switch marks it; a record from before that, when the
    // sandbox is still where it was moved to.
    const wasSwitched = (id: string, m: MigrationRec): boolean => m.switched === true || listed.find((s) => s.id === id)?.hostId === m.toHostId;
    for (const [id, m] of Object.entries(recorded)) {
      if (!m.toHostId || m.toHostId === hostId || !wasSwitched(id, m)) continue;
      earlier++;
      moved.push(id);
      // Back on this host since (uncordoned meanwhile, then woken here): its VM here is the
      // sandbox now, not the source the move left behind.
      if (listed.find((s) => s.id === id)?.hostId === hostId) continue;
      try {
        await this.step(op, migrationStep(id, m, 'destroy-source'), hostId, stopVm(id));
      } catch (e) {
        // The sandbox is on its new host either way; a source VM left behind is a stray VM
        // (reconcileStrayVms stops it).
        this.log.warn({ err: e, opId: op.id, sandboxId: id, hostId }, 'could not stop the source VM of a sandbox an earlier run of this drain moved');
      }
    }
    // A migration an earlier run booked a host for, whose sandbox has since left this host
    // other than by the drain's switch (destroyed by its user, say): its booking on the
    // destination is released and the copy its restore may make there is stopped. Skipped,
    // both stayed for good (nothing else releases a migration's booking).
    // Not one that switched: a sandbox moved off by this drain may since have hibernated (its
    // booking on the destination released) and woken elsewhere; releasing "the migration's
    // booking" then would release capacity a second time.
    for (const [id, m] of Object.entries(recorded)) {
      if (!m.toHostId || m.toHostId === hostId || wasSwitched(id, m)) continue;
      const cur = listed.find((s) => s.id === id);
      if (cur && cur.hostId === hostId && (cur.state === 'running' || cur.state === 'paused')) {
        // Still here and still claimed: the migration is seen through below. Here but no longer
        // claimed: this host was lost (which ends every claim) and came back, and the sandbox was
        // taken back and may have run on since the migration's snapshot. Restoring that snapshot
        // would throw its work away: the attempt is undone (booking released, copy stopped,
        // retired) and the sandbox migrated anew below, with a snapshot of its own.
        if (cur.opId === op.id) continue;
        await this.undoMigrationCopy(op, cur, m.toHostId, migrationStep(id, m, 'undo-dest'), 'could not stop the copy of a migration whose sandbox was taken back by its returning host');
        // Paused by the migration, taken back so: running again (and migrated as running).
        // (The next attempt goes by the record it claims: running.)
        if (!m.wasPaused) await this.resumeTakenBack(op, cur, migrationStep(id, m, 'resume-taken-back'));
        continue;
      }
      if (!cur) {
        this.log.warn({ opId: op.id, sandboxId: id, hostId: m.toHostId }, 'a migrated sandbox\'s record is gone: its booking on the destination cannot be priced and stays');
        continue;
      }
      // Lost here (its VM died, or this host was lost, which ends the claim) while the copy was
      // made: the copy is the sandbox now, as migrate() switches to it when its source is lost
      // during the restore (within its tenant's quota), not removed. The restore is sent again
      // under its step id (the agent answers from its journal, or runs it if it never got it);
      // the migration is undone only if that fails or the switch is refused.
      if (cur.state === 'lost' && cur.hostId === hostId) {
        earlier++;
        try {
          const sn = (await this.readSnapshot(cur.tenantId, m.snapshotId))?.value;
          if (sn?.state !== 'ready') {
            await this.undoMigrationCopy(op, cur, m.toHostId, migrationStep(id, m, 'undo-dest'), 'could not stop the copy of a migration whose snapshot is gone');
            failures.push(`${id}: lost on ${hostId} during its migration, and its snapshot ${m.snapshotId} is ${sn?.state ?? 'gone'}: the copy was removed`);
            continue;
          }
          // Lost: no source VM to run again, no claim to end.
          await this.restoreAndSwitch(op, cur, m, sn, { resumeSource: async () => undefined, unclaim: async () => undefined });
          moved.push(id);
        } catch (e) {
          if (this.endsTheRun(e)) throw e;
          this.log.warn({ err: e, opId: op.id, sandboxId: id }, 'could not switch a sandbox lost during its migration to its copy');
          failures.push(`${id}: ${e instanceof Error ? e.message : String(e)}`);
          causes.push(drainCause(e));
        }
        continue;
      }
      await this.undoMigrationCopy(op, cur, m.toHostId, migrationStep(id, m, 'undo-dest'), 'could not stop the copy of a migration whose sandbox moved on');
      failures.push(`${id}: ${cur.state} on ${cur.hostId || 'no host'}: it moved on during its migration; the copy was removed`);
    }
    /** The sandboxes to move: those here now, and those an earlier run moved already. */
    const total = onHost.length + earlier;
    // Cancelled: the migration under way ends as it ends; no further one, and no (further)
    // snapshot copied off (`copied`: how many copySnapshotsOff made before the cancel).
    const cancelled = (copied = 'copied no snapshot off'): Promise<void> | undefined => {
      if (!this.cancelRequested(op.id)) return undefined;
      const what = `cancelled by a CancelOperation call: moved ${moved.length} of ${total} sandboxes off ${hostId}, ${copied}${failures.length ? `; ${failures.join('; ')}` : ''}`;
      return this.finish(op, { sandboxIds: moved }, errorOf(new OperationCancelledError(what)), moved.length, this.drainEnded(op));
    };
    // A sandbox an earlier run of this drain claimed (a failover mid-migration) goes first and
    // is seen through even when the drain was cancelled meanwhile: its source VM may be paused
    // and a host booked for it, which only its migration (or that migration's undo) settles.
    onHost.sort((a, b) => Number(b.opId === op.id) - Number(a.opId === op.id));
    // Progress: how many of the sandboxes to move are moved, of them all (the final write's
    // done and total too), written as each move ends (one op write next to the several each
    // migration makes) and before the copies off, so `operation get` follows the drain. Best
    // effort: the final write says it again.
    let notMoved = 0;
    const progress = (then = ''): void => {
      // As it is now, not when the write (queued behind the op's others) runs.
      const [done, failed] = [moved.length, notMoved];
      void this.updateOp(op.tenantId, op.id, (o) => drainProgress(o, 'moved', `off ${hostId}`, done, total, failed, then)).catch(() => undefined);
    };
    progress();
    // How long the pauses may wait, in all, for calls running in the sandboxes (pauseForMove).
    const callWait = { leftMs: this.deps.config.drainCallGraceMs ?? DRAIN_CALL_GRACE_MS };
    for (const sb of onHost) {
      if (sb.opId !== op.id) {
        const stop = cancelled();
        if (stop) return stop;
      }
      try {
        // No move of it under way (not claimed by this drain, no host booked for it): some
        // other host must be able to take it now, or its migration would pause and snapshot it
        // only to fail its booking (moveRefusal).
        const booked = (this.ops.get(op.id)?.value.input as unknown as DrainInput | undefined)?.migrations?.[sb.id]?.toHostId;
        const refused = sb.opId !== op.id && !booked ? this.moveRefusal(op, sb) : undefined;
        if (refused) throw refused;
        await this.migrate(op, sb, callWait);
        moved.push(sb.id);
      } catch (e) {
        // Not a failed migration: the drain runs again, with the choices it recorded.
        if (this.endsTheRun(e)) throw e;
        this.log.warn({ err: e, opId: op.id, sandboxId: sb.id }, 'migration failed; the sandbox stays on the draining host');
        failures.push(`${sb.id}: ${e instanceof Error ? e.message : String(e)}`);
        causes.push(drainCause(e));
        notMoved++;
      }
      progress();
    }
    const stop = cancelled();
    if (stop) return stop;
    // A sandbox that came onto this host during the drain (another drain's migration that had
    // booked it here before this host's cordon, and switched since) was not moved by this run:
    // named, so the drain does not report the host drained while it runs there.
    const seen = new Set([...onHost.map((sb) => sb.id), ...moved]);
    for (const { value: sb } of await this.deps.store.listSandboxes(undefined)) {
      if (sb.hostId === hostId && (sb.state === 'running' || sb.state === 'paused') && !seen.has(sb.id)) failures.push(`${sb.id}: came onto ${hostId} during the drain; drain it again`);
    }
    progress('; copying off the snapshots no uncordoned host holds');
    const { uncopied, ...off } = await this.copySnapshotsOff(op, hostId);
    if (off.cancelled) {
      failures.push(...uncopied);
      return cancelled(copiedOff(off, hostId));
    }
    if (failures.length || uncopied.length) {
      const kinds = [...causes, ...(failures.length > causes.length ? ['unavailable' as const] : []), ...(uncopied.length ? [off.kind] : [])];
      return this.finish(op, { sandboxIds: moved }, drainFailure(`moved ${moved.length} of ${total} sandboxes off ${hostId}; ${[...failures, ...uncopied].join('; ')}`, kinds), moved.length, this.drainEnded(op));
    }
    await this.finish(op, { sandboxIds: moved }, null, moved.length, this.drainEnded(op));
  }

  /**
   * The end of a drain, in the transaction of its final state: the host stays cordoned and
   * is no longer `draining` (so `hosts ls` tells a drained host from one being drained; the
   * operation says how it went), unless another drain of the same host is still at work.
   */
  private drainEnded(op: OperationRec): (attempt: number) => Promise<StoreWrite[]> {
    return async () => {
      for (const { value: o } of this.ops.values()) if (o.kind === 'drain' && o.targetId === op.targetId && o.id !== op.id && !isTerminal(o.state)) return [];
      const h = await this.deps.store.getHost(op.targetId);
      return h?.value.draining ? [{ kind: 'host', value: { ...h.value, draining: false }, expectRevision: h.modRevision }] : [];
    };
  }

  /**
   * Drain without migrate: every running or paused sandbox on the host is hibernated in
   * place (a hibernate operation of its own, under its tenant, keyed by this drain and the
   * sandbox), which gives its CPU and RAM back. Then every hibernated sandbox of the host
   * whose snapshot no other live host holds (these, and any that idled into hibernation
   * earlier) gets a copy of it on another ready host, so the host can be removed and the
   * next call wakes the sandbox there. The drain fails, naming them, for sandboxes that
   * could not be hibernated or copied; running it again retries those.
   */
  private async drainByHibernating(op: OperationRec, hostId: string, onHost: SandboxRec[], unsettled: readonly SandboxRec[] = []): Promise<void> {
    if (!this.deps.submit) throw new ForkfleetError('internal', 'this scheduler cannot submit operations: a drain without migrate needs it');
    const recorded = { ...((this.ops.get(op.id)?.value.input as unknown as DrainInput | undefined)?.hibernations ?? {}) };
    // Those this drain hibernates itself (an earlier run's, before a failover) are waited for
    // below, and named only if still on their way after it (a key that expired is not waited for).
    const failures: string[] = unsettled.filter((sb) => !recorded[sb.id]).map(stillOnItsWay);
    const ownUnsettled = unsettled.filter((sb) => recorded[sb.id]);
    // Cancelled: the hibernations already submitted end as they end; no new ones. Nor on a host
    // the admin uncordoned since (a run again after a failover): its sandboxes stay, named.
    const host = (await this.deps.store.getHost(hostId))?.value;
    const uncordoned = !host?.cordoned;
    const fresh = this.cancelRequested(op.id) || uncordoned ? [] : onHost.filter((sb) => !recorded[sb.id]);
    const earlier = new Set(Object.keys(recorded));
    if (uncordoned) for (const sb of onHost) if (!recorded[sb.id]) failures.push(`${sb.id}: not hibernated: ${hostId} was uncordoned during the drain`);
    if (fresh.length > 0) {
      // Recorded before submitting: a re-run (failover) waits for these, not new ones.
      const keyed = Object.fromEntries(fresh.map((sb) => [sb.id, [sb.tenantId, `__drain/${op.id}/${sb.id}`] as [string, string]]));
      await this.updateOp(op.tenantId, op.id, (o) => {
        const inp = o.input as unknown as DrainInput;
        inp.hibernations = { ...(inp.hibernations ?? {}), ...keyed };
      });
      Object.assign(recorded, keyed);
    }
    // Submit (idempotent by key), then wait for each to end. An earlier run's key whose
    // hibernate ended over FF_RECORD_RETENTION ago expired with it: submitted again, it would
    // hibernate the sandbox wherever it runs now (woken on another host since) or fail for one
    // destroyed since. So it is submitted again only for a sandbox still running or paused on
    // this host; any other left the host, which is what the drain is for.
    const stillHere = async (tenantId: string, sandboxId: string): Promise<boolean> => {
      const sb = (await this.deps.store.getSandbox(tenantId, sandboxId))?.value;
      return sb?.hostId === hostId && (sb.state === 'running' || sb.state === 'paused');
    };
    // Progress as a migrating drain writes it (runDrain): how many of the sandboxes to hibernate
    // are hibernated, of them all, written as each hibernate ends and before the copies off.
    const total = Object.keys(recorded).length;
    let hibernated = 0;
    let notHibernated = 0;
    const progress = (then = ''): void => {
      const [done, failed] = [hibernated, notHibernated];
      void this.updateOp(op.tenantId, op.id, (o) => drainProgress(o, 'hibernated', `on ${hostId}`, done, total, failed, then)).catch(() => undefined);
    };
    progress();
    const ends = await Promise.all(
      Object.entries(recorded).map(async ([sandboxId, [tenantId, key]]) => {
        const error = await this.submitAndWait(tenantId, key, 'hibernate', sandboxId, { snapshotId: newId('sn'), replicas: 0, reason: 'drain' }, earlier.has(sandboxId) ? () => stillHere(tenantId, sandboxId) : undefined);
        if (error === undefined) hibernated++;
        else notHibernated++;
        progress();
        return { sandboxId, error };
      }),
    );
    for (const e of ends) if (e.error !== undefined) failures.push(`${e.sandboxId}: hibernate failed: ${e.error}`);
    for (const sb of ownUnsettled) {
      const now = (await this.deps.store.getSandbox(sb.tenantId, sb.id))?.value;
      if (now?.hostId === hostId && DRAIN_WAITS_FOR.has(now.state)) failures.push(stillOnItsWay(now));
    }
    const done = ends.filter((e) => e.error === undefined).map((e) => e.sandboxId);
    const cancelled = (copied = 'copied no snapshot off'): Promise<void> => {
      const what = `cancelled by a CancelOperation call: hibernated ${done.length} of ${onHost.length} sandboxes on ${hostId}, ${copied}${failures.length ? `; ${failures.join('; ')}` : ''}`;
      return this.finish(op, { sandboxIds: done }, errorOf(new OperationCancelledError(what)), done.length, this.drainEnded(op));
    };
    if (this.cancelRequested(op.id)) return cancelled();
    // Hibernated sandboxes need their snapshots: copied below with every other one only this host holds.
    const snapshots = (await this.deps.store.listSnapshots(undefined)).map((v) => v.value);
    const recordedSnapshots = new Set(snapshots.map((sn) => `${sn.tenantId}/${sn.id}`));
    for (const sb of (await this.deps.store.listSandboxes(undefined)).map((v) => v.value)) {
      if (sb.hostId === hostId && sb.state === 'hibernated' && !recordedSnapshots.has(`${sb.tenantId}/${sb.hibernationSnapshotId}`)) failures.push(`${sb.id}: its hibernation snapshot ${sb.hibernationSnapshotId || '(none)'} is gone`);
      // One that came onto the host meanwhile (another drain's migration booked here before the
      // cordon, a lost sandbox taken back when its host returned) was not hibernated by this run:
      // named, so the drain does not report the host drained while it runs there.
      if (sb.hostId === hostId && (sb.state === 'running' || sb.state === 'paused') && !recorded[sb.id] && !uncordoned) failures.push(`${sb.id}: came onto ${hostId} during the drain; drain it again`);
    }
    progress('; copying off the snapshots no uncordoned host holds');
    const { uncopied, ...off } = await this.copySnapshotsOff(op, hostId, snapshots);
    failures.push(...uncopied);
    if (off.cancelled) return cancelled(copiedOff(off, hostId));
    if (failures.length) return this.finish(op, { sandboxIds: done }, { kind: 'unavailable', message: `hibernated ${done.length} of ${ends.length} sandboxes on ${hostId}; ${failures.join('; ')}`, retryable: true }, done.length, this.drainEnded(op));
    await this.finish(op, { sandboxIds: done }, null, done.length, this.drainEnded(op));
  }

  /**
   * The end of every drain: each ready snapshot that no other live uncordoned host holds (a
   * hibernated sandbox's, a fork's source, a user's) gets a copy on another ready host, round robin,
   * so removing the drained host loses no snapshot. A copy that fails is tried on the next
   * host, until one makes it or every one has failed it (as replicate() does); a host that
   * failed a copy another host then made (a full disk, say: the fault is the host's, not the
   * snapshot's) is skipped for the rest of the drain, so the snapshots after it do not each
   * wait out its failure. Returns what could not be copied, and how many of how many were.
   * With no host to copy to, none is tried: one line names them all, with the cordoned or
   * draining hosts that also hold them (failed_precondition, not a failed copy).
   * A cancel (CancelOperation) stops it before its next copy (the one under way finishes):
   * `cancelled`, and the drain ends so, as fleet.proto's CancelOperationRequest says.
   * `snapshots`: every snapshot record, when the caller has just listed them.
   */
  private async copySnapshotsOff(op: OperationRec, hostId: string, snapshots?: readonly SnapshotRec[]): Promise<CopiedOff> {
    const failures: string[] = [];
    let copied = 0;
    let cancelled = false;
    const now = this.deps.clock.now();
    const live = (h: string): boolean => this.cache.hosts.has(h) && this.cache.hosts.get(h)?.value.state !== 'lost' && livenessOf(this.deps.heard.get(h)?.heardAt, now, this.deps.config.liveness) !== 'lost';
    const targets = [...this.cache.hosts.values()].map((h) => h.value).filter((h) => h.id !== hostId && !h.cordoned && !h.draining && h.state === 'ready' && this.takesWork(h.id, now));
    // A copy on a cordoned or draining host does not count: that host may be on its way out
    // too (two hosts drained that hold a snapshot between them each left it to the other, and
    // removing both lost it).
    const keeps = (h: string): boolean => live(h) && !this.cache.hosts.get(h)?.value.cordoned && !this.cache.hosts.get(h)?.value.draining;
    const only = (snapshots ?? (await this.deps.store.listSnapshots(undefined)).map((v) => v.value)).filter((sn) => sn.state === 'ready' && sn.hostIds.includes(hostId) && !sn.hostIds.some((h) => h !== hostId && keeps(h)));
    // The next host in the rotation, and the hosts skipped for the rest of the drain.
    let cursor = 0;
    const skipped = new Set<string>();
    // Snapshots in a row that no host could copy: the fault is likely the drained host's (its
    // disk or peer server), and trying each of the rest on every host could take hours
    // (each try up to FF_STEP_TIMEOUT x FF_STEP_ATTEMPTS). After two, each is tried on one
    // host only, until one copy succeeds (a re-run meets the same order: no snapshot is left
    // untried for good behind two that cannot be copied).
    let failedEverywhere = 0;
    // No host to copy to (every other one cordoned, draining, down or gone): one line for them
    // all, saying truthfully who holds each. One also on a live cordoned or draining host is
    // held there still, yet not kept (above): that host may be on its way out too.
    if (targets.length === 0 && only.length > 0) {
      if (this.cancelRequested(op.id)) return { uncopied: [], copied: 0, of: only.length, cancelled: true, kind: 'failed_precondition' };
      const alsoOn = (sn: SnapshotRec): string[] => sn.hostIds.filter((h) => h !== hostId && live(h));
      const named = only.map((sn) => (alsoOn(sn).length > 0 ? `${sn.id} (also on ${alsoOn(sn).join(', ')})` : sn.id));
      const holders = only.some((sn) => alsoOn(sn).length > 0) ? `${hostId} and cordoned or draining hosts` : hostId;
      failures.push(`no uncordoned host is ready to take a copy of the ${only.length === 1 ? 'snapshot' : `${only.length} snapshots`} held only by ${holders}: ${named.join(', ')}`);
      // An uncordoned host that is there but cannot take work just now (suspect, its agent
      // restarting) may in seconds: a drain run again then copies them (unavailable, retryable).
      const soon = [...this.cache.hosts.values()].some(({ value: h }) => h.id !== hostId && !h.cordoned && !h.draining && live(h.id));
      return { uncopied: failures, copied: 0, of: only.length, cancelled: false, kind: soon ? 'unavailable' : 'failed_precondition' };
    }
    for (const sn of only) {
      if (this.cancelRequested(op.id)) {
        cancelled = true;
        break;
      }
      const failed: string[] = [];
      const errors: string[] = [];
      const tries = failedEverywhere >= 2 ? 1 : targets.length;
      for (let i = 0, tried = 0; i < targets.length && tried < tries; i++) {
        const at = (cursor + i) % targets.length;
        const to = targets[at]!;
        if (skipped.has(to.id)) continue;
        // Nor is a failed copy tried on another host.
        if (this.cancelRequested(op.id)) {
          cancelled = true;
          break;
        }
        tried++;
        try {
          const fetch = this.fetchPlan(sn, to.id, hostId, false);
          if (fetch) await this.step(op, `replicate/${sn.id}/${to.id}`, to.id, { case: 'fetchSnapshot', value: fetch as never });
          await this.addHolder(sn.tenantId, sn.id, to.id);
          copied++;
          cursor = at + 1;
          for (const h of failed) skipped.add(h);
          errors.length = 0;
          break;
        } catch (e) {
          if (this.endsTheRun(e)) throw e;
          failed.push(to.id);
          errors.push(`to ${to.id}: ${e instanceof Error ? e.message : String(e)}`);
          // One try each: the next snapshot goes to the next host.
          if (tries === 1) cursor = at + 1;
        }
      }
      // Every host tried failed it: the snapshot's own fault (or its source's) as much as
      // theirs, so none is skipped for the next one.
      if (errors.length) failures.push(`copying snapshot ${sn.id} off ${hostId} failed ${errors.join(', ')}`);
      if (cancelled) break;
      failedEverywhere = errors.length ? failedEverywhere + 1 : 0;
    }
    return { uncopied: failures, copied, of: only.length, cancelled, kind: 'unavailable' };
  }

  /**
   * Why no host but `sb`'s own could take it now, or undefined when one could: asked before
   * its migration pauses and snapshots it, which froze each guest ~1.4 s and kept a migration
   * snapshot for a day for moves that then failed their booking (no capacity) one after
   * another. Pure, over the leader's cache: a placement of a create of its resources, its
   * host avoided. That is looser than the restore placeAndBook decides later (same host
   * state, cordon and drain checks; no VMM, image or transfer check; the snapshot's vCPUs and
   * memory are the sandbox's, and a restore's disk is its overlay plus the chunks it lacks),
   * so it never refuses a move that would have fit; one it lets through may still fail its
   * booking. The error's kind is placementFailure's; its message, the hosts filtered and why.
   */
  private moveRefusal(op: OperationRec, sb: SandboxRec): ForkfleetError | undefined {
    const now = this.deps.clock.now();
    const allocs = new Map([...this.cache.allocs].map(([k, v]) => [k, v.value]));
    const view = buildFleetView(fleetViewInput({ hosts: this.cache.hostsById().map((h) => h.value), allocs, heard: this.deps.heard, snapshots: [], revision: 0, now, liveness: this.deps.config.liveness, chunkBytes: this.deps.config.chunkBytes }));
    const req: PlacementRequest = { kind: 'create', id: `${op.id}/${sb.id}/precheck`, nowMs: now, resources: sb.resources, preferences: { avoidHostIds: [sb.hostId] } };
    const result = place(view, req, rngForRequest(req.id), this.deps.config.placement);
    if (result.ok) return undefined;
    const why = placementFailure(result.explanation);
    // Its own host (avoided) is not among the reasons: the others are.
    const reasons = reasonList(filterReasons(result.explanation.filtered, 'avoided'));
    return new ForkfleetError(why.kind, `no other host can take it now (${reasons || 'no other host'}); it was not paused or snapshotted`, { retryable: why.retryable, cause: why });
  }

  /**
   * A drain's pause of sandbox `sb` before its move: first only while no exec or file call
   * runs in it (PauseVmWork.unless_calls), asked again every second while `callWait` lasts, so
   * that a command under way ends before the move rather than being cut off from its caller;
   * then at once, whatever runs (a sandbox that is never without a call would hold the drain for
   * good). `callWait` is shared by the drain run's moves (DRAIN_CALL_GRACE_MS in all), charged
   * only with the time spent waiting: it moves its sandboxes one after another, and a wait per
   * sandbox would add up. Each ask is a step of its own (the agent journals a refusal under its
   * step id). A cancel of the drain, or its host uncordoned, while it waits undoes the move as
   * one not yet booked.
   */
  private async pauseForMove(op: OperationRec, sb: SandboxRec, stepId: (step: string) => string, callWait: { leftMs: number }): Promise<void> {
    for (let i = 0; callWait.leftMs > 0; i++) {
      try {
        await this.step(op, stepId(`pause-unless-calls/${i}`), sb.hostId, pauseVm(sb.id, 0, true));
        return;
      } catch (e) {
        if (!(e instanceof HostStepError && e.workField === 'unless_calls')) throw e;
        if (i === 0) this.log.info({ opId: op.id, sandboxId: sb.id, waitMs: callWait.leftMs }, 'drain waits for the calls running in a sandbox before it moves it');
        const t0 = this.deps.clock.now();
        await this.pause(Math.min(1000, callWait.leftMs));
        callWait.leftMs -= Math.max(1, this.deps.clock.now() - t0);
        if (!this.active) throw new NotLeaderError();
        if (this.cancelRequested(op.id)) throw new WrongStateError('sandbox', sb.id, 'claimed by a cancelled drain', 'it was waiting for its calls to end before its move: undone');
        const h = this.cache.hosts.get(sb.hostId)?.value;
        if (!h?.cordoned || !h.draining) throw new WrongStateError('host', sb.hostId, 'not draining', 'it was uncordoned during its drain: the drain stops');
      }
    }
    await this.step(op, stepId('pause'), sb.hostId, pauseVm(sb.id));
  }

  /** `callWait`: how long its pause may still wait for calls running in the sandbox (pauseForMove; shared by the drain run's moves). */
  private async migrate(op: OperationRec, sb: SandboxRec, callWait = { leftMs: this.deps.config.drainCallGraceMs ?? DRAIN_CALL_GRACE_MS }): Promise<void> {
    const from = sb.hostId;
    const record = (m: MigrationRec): Promise<OperationRec> =>
      this.updateOp(op.tenantId, op.id, (o) => {
        const inp = o.input as unknown as DrainInput;
        inp.migrations = { ...(inp.migrations ?? {}), [sb.id]: m };
      });
    let m = (this.ops.get(op.id)?.value.input as unknown as DrainInput | undefined)?.migrations?.[sb.id];
    if (!m?.snapshotId) {
      // First attempt, or one after an attempt that failed and was undone (retired).
      m = { snapshotId: newId('sn'), wasPaused: sb.state === 'paused', ...(m?.attempt ? { attempt: m.attempt } : {}) };
      await record(m);
    }
    const stepId = (step: string): string => migrationStep(sb.id, m!, step);
    // A host uncordoned during its drain (cordonHost false clears draining too) is not
    // drained further: placement could choose it, and the switch would then stop the VM the
    // sandbox had "moved" to on that same host.
    const notDraining = (): WrongStateError => new WrongStateError('host', from, 'not draining', 'it was uncordoned during its drain: the drain stops');
    /** An undo: the source VM (paused for the snapshot) runs again, best effort. */
    const resumeSource = async (): Promise<void> => {
      if (!m!.wasPaused) await this.step(op, stepId('resume'), from, resumeVm(sb.id)).catch(() => undefined);
    };
    const h = this.cache.hosts.get(from)?.value;
    const undrained = !m.toHostId && (!h?.cordoned || !h.draining);
    // One an earlier run claimed (and maybe paused) is undone below, not left claimed; so is
    // one whose drain was cancelled before a host was booked for it (nothing to see through).
    if (undrained && sb.opId !== op.id) throw notDraining();
    const cancelledUnbooked = !m.toHostId && this.cancelRequested(op.id);
    // 0. Claimed for the move (its record stays running or paused): a resume, a hibernate,
    //    the TTL and idle rules and the VM check leave a sandbox another op is at work on
    //    alone, so nothing runs the paused source on after its snapshot, work the switch
    //    would then throw away. The switch, or an undo, ends the claim.
    //    A pause or resume holding it (for its step only) is waited for, or taken over from
    //    once it no longer runs (afterVmStateHold); another drain's claim refuses this one.
    let claimed: SandboxRec | undefined;
    for (let i = 0; !claimed; i++) {
      const takeOver = await this.afterVmStateHold(op, sb, i === 0 ? sb : undefined, 'the drain moves it when run again');
      claimed = await this.updateSandbox(sb.tenantId, sb.id, (s) => {
        if (s.opId === op.id) return;
        if (s.hostId !== from || (s.state !== 'running' && s.state !== 'paused')) throw new WrongStateError('sandbox', s.id, `${s.state} on ${s.hostId || 'no host'}`, 'it moved on before its migration began');
        // Taken since the look above, or the stopped pause/resume taken over from run again
        // meanwhile: looked at again.
        if (s.opId !== '' && (s.opId !== takeOver || this.running.has(takeOver))) throw new OwnedByOtherOpError(s.opId);
        s.opId = op.id;
      }).catch((e: unknown) => {
        if (!(e instanceof OwnedByOtherOpError) || i >= 2) throw e;
        return undefined;
      });
    }
    // Paused or running as the claimed record has it, not as the drain's list had it (its user
    // may have resumed or paused it since, while the drain moved others): nothing changes it
    // while it is claimed, and the move keeps it so (a record that says paused but a VM that
    // ran on would lose the work done after the snapshot).
    if (m.wasPaused !== (claimed.state === 'paused')) {
      m = { ...m, wasPaused: claimed.state === 'paused' };
      await record(m);
    }
    const unclaim = (): Promise<unknown> =>
      this.updateSandbox(sb.tenantId, sb.id, (s) => {
        if (s.opId !== op.id) throw new MovedOnError(s.id, s.state, s.hostId);
        s.opId = '';
      }).catch((e: unknown) => {
        // The store failed: the op runs again and ends the claim then (left behind, it would
        // keep every later operation and the VM check off the sandbox for good).
        if (e instanceof StoreUnavailableError) throw e;
        if (!(e instanceof MovedOnError)) this.log.warn({ err: e, sandboxId: sb.id }, 'could not end a migration\'s claim on its sandbox');
      });
    let sn: SnapshotRec;
    try {
      if (undrained) throw notDraining();
      if (cancelledUnbooked) throw new WrongStateError('sandbox', sb.id, 'claimed by a cancelled drain', 'its migration had no host booked yet: undone');
      // 1. Freeze and snapshot the source (a paused VM's memory no longer changes).
      // A move an earlier run booked a host for had paused the VM then: no wait for calls.
      if (!m.wasPaused) await this.pauseForMove(op, sb, stepId, m.toHostId ? { leftMs: 0 } : callWait);
      sn = await this.snapshotOf(op, sb.id, m.snapshotId, { labels: { [PURPOSE_LABEL]: 'migration' }, retentionTtlMs: MIGRATION_SNAPSHOT_TTL_MS }, sb.tenantId);
      // 2. Book capacity on another host (this one is cordoned and draining) and record the choice.
      if (!m.toHostId) {
        let chosen = '';
        const snap = sn;
        await this.placeAndBook(
          op,
          { tenantId: snap.tenantId, id: snap.id },
          () => ({ kind: 'restore', id: `${op.id}/${sb.id}`, nowMs: this.deps.clock.now(), snapshotId: snap.id, overlayDiskMib: sb.resources.diskMib, preferences: {} }),
          (res) => {
            chosen = res.placements[0]!.hostId;
            // Only an uncordoned host can be chosen; the job fails here, before anything is booked.
            if (chosen === from) throw notDraining();
            const mm = { ...m!, toHostId: chosen };
            return {
              perChild: { res: sb.resources },
              writes: [],
              opUpdate: (o) => {
                const inp = o.input as unknown as DrainInput;
                inp.migrations = { ...(inp.migrations ?? {}), [sb.id]: mm };
              },
            };
          },
        );
        m = { ...m, toHostId: chosen };
      }
    } catch (e) {
      // Nothing is booked and no copy made: the source runs again (it stayed paused, with its
      // record saying running). Not after a lost lead or a failed store: the op runs again.
      if (this.endsTheRun(e)) throw e;
      // The snapshot an earlier run began (the leader failed over during its step), undone here
      // before this run took it up (the drain cancelled, the host uncordoned since): failed, as
      // runHibernate does, or it would stay creating for good (retired, nothing finishes it; a
      // creating snapshot neither expires nor can be deleted, and its host keeps its files). The
      // VM stays on this host. Before the retire: a store failure here leaves the migration
      // recorded and claimed, and the drain run again undoes it again.
      const own = m.snapshotId ? await this.deps.store.getSnapshot(sb.tenantId, m.snapshotId) : undefined;
      if (own?.value.state === 'creating') await this.markSnapshotFailed(own.value);
      // Retired first: should the drain run again (a failover, a store outage later in it),
      // this sandbox is snapshotted anew, not restored from what it was before it ran again.
      // The claim ends whatever else fails here: a claim left behind would keep every later
      // operation and the VM check off the sandbox for good.
      try {
        await record(retired(m));
        await resumeSource();
      } finally {
        await unclaim();
      }
      throw e;
    }
    await this.restoreAndSwitch(op, sb, m, sn, { resumeSource, unclaim });
  }

  /**
   * A migration's steps once its sandbox is snapshotted (`sn`) and a host booked for it
   * (`m.toHostId`): restore the copy there, switch the record to it, destroy the source VM.
   * `sb` is the sandbox as it was on the drained host. `undo`: what a failed restore or a lost
   * destination also undoes besides the copy (the paused source run again, the claim ended).
   */
  private async restoreAndSwitch(op: OperationRec, sb: SandboxRec, m: MigrationRec, sn: SnapshotRec, undo: { resumeSource: () => Promise<void>; unclaim: () => Promise<unknown> }): Promise<void> {
    const from = sb.hostId;
    const stepId = (step: string): string => migrationStep(sb.id, m, step);
    const { resumeSource, unclaim } = undo;
    const to = m.toHostId!;
    // 3. Restore under the same sandbox id on the new host (fetching the snapshot there).
    try {
      // The snapshot must end up on the new host (the old one is going away): fetch, never migrate.
      const fetch = this.fetchPlan((await this.readSnapshot(sb.tenantId, sn.id))?.value ?? sn, to, from, false);
      const restored = await this.step(op, stepId('restore'), to, { case: 'restoreVms', value: { snapshotId: sn.id, vms: [this.vmSpec(sb)], ...(fetch ? { fetch } : {}) } as never });
      if (storedThere(fetch !== undefined, restored)) await this.addHolder(sb.tenantId, sn.id, to);
      if (m.wasPaused) await this.step(op, stepId('pause-dest'), to, pauseVm(sb.id));
    } catch (e) {
      // A leader that stepped down undoes nothing: the next one finds the booking and the
      // choice recorded, and restores there again. Nor does a store that failed: the drain
      // runs again (run()) and does the same.
      if (!this.active || e instanceof StoreUnavailableError) throw e;
      // Undo: release the booking, stop a copy the restore may have made after all (a step
      // that timed out here and finished there), let the source run again.
      try {
        await this.undoMigrationCopy(op, sb, to, stepId('undo-dest'), 'could not stop the copy of a migration that failed');
        await resumeSource();
      } finally {
        await unclaim();
      }
      throw e;
    }
    // 4. Switch the record, release the source's capacity and mark the migration switched, in
    //    one transaction (a re-run goes by that mark, not by where the sandbox is by then).
    let movedOn: SandboxRec | undefined;
    let destinationLost = false;
    let overQuota: QuotaExceededError | undefined;
    try {
      await this.updateMigration(
        op,
        sb.id,
        (mm) => ({ ...mm, switched: true }),
        async () => {
          const [v, a] = await Promise.all([this.deps.store.getSandbox(sb.tenantId, sb.id), this.deps.store.getAlloc(from)]);
          if (!v) throw new NotFoundError('sandbox', sb.id);
          // Switched already (a write whose answer was lost): only the mark is written.
          if (v.value.hostId === to) return [];
          // Running or paused here but no longer claimed: this host was lost (ending the claim)
          // and came back with the VM, which was taken back and may have run on since the
          // snapshot the copy was restored from. The copy is not the sandbox. Nor is it of one
          // lost other than from under this migration (taken back so, then lost again).
          if (v.value.hostId !== from || !['running', 'paused', 'lost'].includes(v.value.state) || (v.value.state === 'lost' ? v.value.lostFromOp !== op.id : v.value.opId !== op.id)) {
            movedOn = v.value;
            throw new WrongStateError('sandbox', sb.id, `${v.value.state} on ${v.value.hostId || 'no host'}`, 'it moved on during its migration; the copy was removed');
          }
          // The destination lost since its restore answered: the copy went with it, and the
          // source VM (on a live host) is the sandbox still. Undone below, not switched onto a
          // lost host (and the source then destroyed).
          if (this.cache.hosts.get(to)?.value.state === 'lost') {
            destinationLost = true;
            throw new HostLostError(to, `the copy of sandbox ${sb.id}: the migration is undone`);
          }
          // Its source VM died meanwhile: a lost sandbox no longer counts against its
          // tenant's quota, and replacements may have been made since. Switched onto its copy
          // only within the quota, as a lost sandbox whose VM comes back is taken back (vmBack).
          overQuota = v.value.state === 'lost' ? await this.quotaRefusal(v.value) : undefined;
          if (overQuota) throw overQuota;
          const next = structuredClone(v.value);
          next.hostId = to;
          if (next.opId === op.id) next.opId = '';
          this.setState(next, m.wasPaused ? 'paused' : 'running', this.deps.clock.now(), `migrated from ${from}`);
          next.updatedAt = this.deps.clock.now();
          // A source VM that died meanwhile made the sandbox lost and released its capacity there
          // already (reconcileVms): the restored copy on `to` is the sandbox; nothing more to release.
          const release = v.value.state !== 'lost';
          // Booked on `to` as a whole guest (its placement above): it maps no image there.
          delete next.imageShare;
          const alloc = applyBooking(a.value, bookingOf(v.value), -1, this.privateMemoryFraction);
          return [{ kind: 'sandbox', value: next, expectRevision: v.modRevision }, ...(release ? [{ kind: 'alloc', value: alloc, expectRevision: a.modRevision } as StoreWrite] : [])];
        },
      );
    } catch (e) {
      if (movedOn) {
        // Moved on while it was copied (destroyed by its user or its TTL, say): the copy on
        // `to` is not the sandbox. Its booking goes and its VM is stopped.
        if (!this.active) throw new NotLeaderError();
        await this.unbookMigration(op, sb, to);
        await this.step(op, stepId('destroy-dest'), to, stopVm(sb.id)).catch((err: unknown) => this.log.warn({ err, sandboxId: sb.id, hostId: to }, 'could not stop the copy of a sandbox that moved on during its migration'));
        // Taken back by its returning host paused, as this migration had paused it: running again.
        if (!m.wasPaused) await this.resumeTakenBack(op, movedOn, stepId('resume-taken-back'));
        throw e;
      }
      if (overQuota) {
        // Stays lost, with its record: its copy on `to` goes, and its booking there.
        if (!this.active) throw new NotLeaderError();
        await this.unbookMigration(op, sb, to);
        await this.step(op, stepId('destroy-dest'), to, stopVm(sb.id)).catch((err: unknown) => this.log.warn({ err, sandboxId: sb.id, hostId: to }, "could not stop the copy of a lost sandbox over its tenant's quota"));
        throw e;
      }
      if (destinationLost) {
        if (!this.active) throw new NotLeaderError();
        // As a failed restore is undone: booking released, the copy told to stop (queued for
        // the lost host, should it come back), the source run again, the claim ended.
        try {
          await this.undoMigrationCopy(op, sb, to, stepId('undo-dest'), 'could not stop the copy of a migration whose destination was lost');
          await resumeSource();
        } finally {
          await unclaim();
        }
        throw e;
      }
      // Still on `from` after every try: its VM there is the sandbox, so it is not stopped. The
      // drain runs again from its record (the copy and its booking on `to` are recorded) and
      // switches then.
      if (e instanceof ConflictError) throw new StoreUnavailableError(`switching sandbox ${sb.id} to ${to}`, new ConflictError(`sandbox ${sb.id}, the capacity of ${from} or the drain's record (kept changing)`));
      throw e;
    }
    // 5. The source VM is no longer the sandbox. The move is done whether or not it stops now:
    //    one left behind (its host lost, the step timed out) is a stray VM, which
    //    reconcileStrayVms stops, as for an earlier run's source above (runDrain).
    await this.step(op, stepId('destroy-source'), from, stopVm(sb.id)).catch((e: unknown) => {
      if (!this.active) throw e;
      this.log.warn({ err: e, opId: op.id, sandboxId: sb.id, hostId: from }, 'could not stop the source VM of a sandbox the drain moved');
    });
  }

  /**
   * A sandbox a migration had paused (it ran when claimed), taken back paused and unclaimed by
   * its returning host (a host loss ends every claim) while that migration is undone: its VM
   * is resumed and its record made running again, as its user left it. Best effort (logged):
   * one that changed meanwhile (its user paused, resumed or destroyed it) is left as it is.
   */
  private async resumeTakenBack(op: OperationRec, sb: SandboxRec, stepId: string): Promise<void> {
    if (sb.state !== 'paused' || sb.opId !== '' || !sb.hostId) return;
    try {
      await this.step(op, stepId, sb.hostId, resumeVm(sb.id));
      await this.updateSandbox(sb.tenantId, sb.id, (s) => {
        if (s.hostId !== sb.hostId || s.state !== 'paused' || s.opId !== '') throw new MovedOnError(s.id, s.state, s.hostId);
        this.setState(s, 'running', this.deps.clock.now(), 'running again: a migration that had paused it was undone');
      });
    } catch (e) {
      if (e instanceof NotLeaderError || !this.active) throw e;
      if (!(e instanceof MovedOnError)) this.log.warn({ err: e, opId: op.id, sandboxId: sb.id }, 'could not resume a sandbox a migration had paused, taken back paused by its returning host');
    }
  }

  /**
   * A migration's copy undone: its booking on `to` released and the attempt retired
   * (unbookMigration), and `to` told to stop the copy its restore may have made (queued: `to`
   * may be away; not where the sandbox itself is).
   */
  private async undoMigrationCopy(op: OperationRec, sb: SandboxRec, to: string, stepId: string, why: string): Promise<void> {
    await this.unbookMigration(op, sb, to);
    if (to !== sb.hostId) await this.sendHostWork(to, op.id, sb.tenantId, stepId, stopVm(sb.id), why);
  }

  /**
   * Releases a migration's booking on `to` and forgets the choice, in one transaction: a
   * re-run then books again instead of restoring onto a host with no booking.
   */
  private async unbookMigration(op: OperationRec, sb: SandboxRec, to: string): Promise<void> {
    // Undone: retired, so a re-run of the drain makes a new attempt (a new snapshot).
    await this.updateMigration(op, sb.id, retired, this.capacity(to, { res: sb.resources }, -1));
  }

  /** Changes the drain's record of `sandboxId`'s migration (when it has one), with `extra`'s writes in the same transaction. */
  private updateMigration(op: OperationRec, sandboxId: string, change: (m: MigrationRec) => MigrationRec, extra?: (attempt: number) => Promise<StoreWrite[]>): Promise<OperationRec> {
    return this.updateOp(
      op.tenantId,
      op.id,
      (o) => {
        const inp = o.input as unknown as DrainInput;
        const mm = inp.migrations?.[sandboxId];
        if (mm) inp.migrations = { ...inp.migrations, [sandboxId]: change(mm) };
      },
      extra,
    );
  }

  // ---------------------------------------------------------------- hosts

  /**
   * Tells hosts to delete snapshots they still hold whose record is deleted, failed or gone
   * (expired, ADR 0017): a host that was away or failed its step when the snapshot was
   * deleted would keep the chunks forever (a failed snapshot's, once it failed
   * HELD_GC_RETRY_MS ago and no unfinished op takes it: a re-run of its op may take it up
   * again). Only ready hosts are asked, each (host, snapshot) at most once per
   * HELD_GC_RETRY_MS and at most HELD_GC_MAX per pass; the agent's delete is
   * idempotent. Ready, creating and deleting snapshots are never touched: their records are
   * in the leader's cache from before any host holds them (a snapshot's record is written
   * before its step). Returns how many deletes were sent.
   */
  reconcileHeldSnapshots(): number {
    if (!this.active) return 0;
    const now = this.deps.clock.now();
    const byId = new Map<string, SnapshotRec>();
    for (const v of this.cache.snapshots.values()) byId.set(v.value.id, v.value);
    for (const [k, at] of this.heldGcAt) if (at <= now - HELD_GC_RETRY_MS) this.heldGcAt.delete(k);
    let sent = 0;
    /** Snapshots the live ops take (made once, on the first failed record met). */
    let taking: Set<string> | undefined;
    for (const heard of this.deps.heard.all()) {
      const hostId = heard.hb.hostId;
      if (this.cache.hosts.get(hostId)?.value.state !== 'ready' || livenessOf(heard.heardAt, now, this.deps.config.liveness) !== 'ready') continue;
      for (const held of heard.hb.snapshots) {
        const rec = byId.get(held.snapshotId);
        if ((rec && !EXPIRING_SNAPSHOT_STATES.has(rec.state)) || sent >= HELD_GC_MAX) continue;
        // A failed snapshot may yet be taken up again by a re-run of its op: only old ones, and
        // none whose op still runs (one run again after a long store outage): its step, answered
        // from the host's journal, would find the files gone.
        if (rec?.state === 'failed' && ((rec.endedAt ?? 0) > now - HELD_GC_RETRY_MS || (taking ??= this.snapshotsOfLiveOps()).has(rec.id))) continue;
        const k = `${hostId}/${held.snapshotId}`;
        if (this.heldGcAt.has(k)) continue;
        this.heldGcAt.set(k, now);
        sent++;
        // The op id changes per retry window, so a later retry is not answered from the
        // agent's journal of the earlier one.
        const opId = `gc-${Math.floor(now / HELD_GC_RETRY_MS)}`;
        this.log.warn({ hostId, snapshotId: held.snapshotId, record: rec?.state ?? 'gone' }, 'host holds a snapshot that is deleted: deleting it there');
        void this.deps.bus
          .sendWork(hostId, create(HostWorkSchema, { opId, stepId: `delete/${held.snapshotId}`, attempt: 1, tenantId: rec?.tenantId ?? 'system', work: { case: 'deleteSnapshot', value: { snapshotId: held.snapshotId } as never } }))
          .catch((e: unknown) => this.log.warn({ err: e, hostId, snapshotId: held.snapshotId }, 'could not ask a host to delete a stale snapshot'));
      }
    }
    return sent;
  }

  /**
   * The snapshots this leader's unfinished ops take or took (snapshotOf's callers: a snapshot
   * or hibernate op's, a fork's of a sandbox, a drain's migrations'): a re-run of one takes a
   * failed record up again.
   */
  private snapshotsOfLiveOps(): Set<string> {
    const ids = new Set<string>();
    for (const { value: op } of this.ops.values()) {
      const input = op.input as { snapshotId?: unknown; forkSnapshotId?: unknown; migrations?: Record<string, { snapshotId?: unknown }> };
      if ((op.kind === 'snapshot' || op.kind === 'hibernate') && typeof input.snapshotId === 'string') ids.add(input.snapshotId);
      if (op.kind === 'fork' && typeof input.forkSnapshotId === 'string') ids.add(input.forkSnapshotId);
      if (op.kind === 'drain') for (const m of Object.values(input.migrations ?? {})) if (typeof m.snapshotId === 'string') ids.add(m.snapshotId);
    }
    return ids;
  }

  /**
   * Marks failed a snapshot left `creating` that no unfinished operation takes any more, once it
   * has been so for ORPHANED_SNAPSHOT_GRACE_MS across passes: the op that took it ended without
   * finishing or failing it (each such path found so far was fixed on its own: a hibernate or a
   * drain run again after its sandbox moved on, a drain cancelled meanwhile; this catches the
   * next). Left creating, it could neither expire nor be deleted, and its host kept its files
   * for good; failed, retention deletes it (reconcileHeldSnapshots) and a re-run of its op, if
   * one comes after all, takes it up again (snapshotOf). Returns how many it marked.
   */
  async failOrphanedSnapshots(): Promise<number> {
    if (!this.active) return 0;
    const now = this.deps.clock.now();
    let taking: Set<string> | undefined;
    const seen = new Set<string>();
    const due: SnapshotRec[] = [];
    for (const v of this.cache.snapshots.values()) {
      const sn = v.value;
      if (sn.state !== 'creating' || (taking ??= this.snapshotsOfLiveOps()).has(sn.id)) continue;
      const k = `${sn.tenantId}/${sn.id}`;
      seen.add(k);
      const since = this.orphanedSince.get(k);
      if (since === undefined) this.orphanedSince.set(k, now);
      else if (now - since >= ORPHANED_SNAPSHOT_GRACE_MS) due.push(sn);
    }
    for (const k of this.orphanedSince.keys()) if (!seen.has(k)) this.orphanedSince.delete(k);
    // A runner whose op record this leader does not hold (run() re-reading it through a store
    // outage) or an op waiting to run again after its runner crashed (its step log kept): what
    // it takes is unknown, so nothing is marked while there is one.
    if ([...this.running.keys()].some((id) => !this.ops.has(id)) || [...this.stepLog.keys()].some((id) => !this.running.has(id))) return 0;
    let marked = 0;
    for (const sn of due) {
      // Asked again before each mark: an op may have taken it up since the pass began.
      if (this.snapshotsOfLiveOps().has(sn.id)) continue;
      this.log.warn({ snapshotId: sn.id, tenantId: sn.tenantId, takenOn: sn.takenOn }, 'snapshot left creating by an operation that ended: marking it failed');
      try {
        await this.markSnapshotFailed(sn);
        marked++;
      } catch (e) {
        this.log.warn({ err: e, snapshotId: sn.id }, 'could not mark a snapshot left creating failed; trying at the next pass');
      }
    }
    return marked;
  }

  /**
   * Drops a host from a ready snapshot's holders once its heartbeats have stopped listing the
   * snapshot as complete for NOT_HELD_GRACE_MS, across two passes: a chunk there was found
   * corrupt or missing (the agent stops counting itself a holder until it has fetched them
   * again), or the host came back with its disk replaced. While the record still named it,
   * placement preferred that host and sent it no fetch plan, so every restore there failed.
   * Hosts not heard lately are left to the host reconciler; a removed host (its record gone) is
   * dropped at the first pass. Returns how many holders it dropped.
   */
  async pruneHolders(): Promise<number> {
    if (!this.active) return 0;
    const now = this.deps.clock.now();
    const lacking = (hostId: string, snapshotId: string): boolean => {
      const heard = this.deps.heard.get(hostId);
      return heard !== undefined && livenessOf(heard.heardAt, now, this.deps.config.liveness) === 'ready' && !this.deps.heard.holds(hostId, snapshotId);
    };
    const seen = new Set<string>();
    /** Snapshots with the hosts due to be dropped from their holders. */
    const drop: Array<{ sn: SnapshotRec; hosts: Set<string> }> = [];
    for (const v of this.cache.snapshots.values()) {
      const sn = v.value;
      if (sn.state !== 'ready') continue;
      const hosts = new Set<string>();
      for (const h of sn.hostIds) {
        // A removed host (RemoveHost deleted its record) holds nothing any more: it was listed
        // for good, never heard again, and placement counted it as a source.
        if (!this.cache.hosts.has(h)) {
          hosts.add(h);
          continue;
        }
        if (!lacking(h, sn.id)) continue;
        const k = `${h}/${sn.id}`;
        seen.add(k);
        const since = this.notHeldSince.get(k);
        if (since === undefined) this.notHeldSince.set(k, now);
        else if (now - since >= NOT_HELD_GRACE_MS) hosts.add(h);
      }
      if (hosts.size > 0) drop.push({ sn, hosts });
    }
    for (const k of this.notHeldSince.keys()) if (!seen.has(k)) this.notHeldSince.delete(k);
    let dropped = 0;
    for (const { sn, hosts } of drop) {
      let gone: string[] = [];
      try {
        await this.updateSnapshotRec(sn.tenantId, sn.id, (cur) => {
          gone = cur.state === 'ready' ? cur.hostIds.filter((h) => hosts.has(h)) : [];
          return gone.length === 0 ? undefined : { ...cur, hostIds: cur.hostIds.filter((h) => !gone.includes(h)) };
        });
        if (gone.length > 0) this.log.warn({ snapshotId: sn.id, hostIds: gone }, 'hosts no longer report a snapshot complete: dropped from its holders');
        dropped += gone.length;
      } catch (e) {
        this.log.warn({ err: e, snapshotId: sn.id }, 'could not drop hosts that no longer hold a snapshot from its holders');
      }
    }
    return dropped;
  }

  /** Registers new hosts and moves silent ones to suspect, then lost (their sandboxes become lost). */
  async reconcileHosts(): Promise<void> {
    const now = this.deps.clock.now();
    const recs = this.cache.hosts;
    const writes: Array<{ next: HostRec; cur: Versioned<HostRec> | undefined }> = [];
    // Silence this leader may have caused: while its own bus connection is down, and until
    // it has been up for the lost threshold again, no host is lost for not being heard (they
    // go suspect at most): a NATS outage, or this replica cut off from NATS, would otherwise
    // mark every host lost and every sandbox with it. Hosts that really died are lost once
    // the connection has been back that long.
    const linkedMs = this.deps.bus.connectedForMs?.() ?? Number.POSITIVE_INFINITY;
    const mayLose = linkedMs > this.deps.config.liveness.lostAfterMs;
    if (!mayLose && !this.holdingLost && linkedMs === 0) this.log.warn('not connected to NATS: no host is marked lost until the connection has been back for the lost threshold');
    this.holdingLost = !mayLose;
    for (const heard of this.deps.heard.all()) {
      const hb = heard.hb;
      const cur = recs.get(hb.hostId);
      const silent = now - heard.heardAt > this.deps.config.liveness.lostAfterMs ? 'lost' : now - heard.heardAt > this.deps.config.liveness.suspectAfterMs ? 'suspect' : 'ready';
      const state = silent === 'lost' && !mayLose ? (cur?.value.state === 'lost' ? 'lost' : 'suspect') : silent;
      // No record and silent: a removed host (RemoveHost), heard last before it went. Its
      // next heartbeat registers it anew.
      if (!cur && state !== 'ready') {
        this.deps.heard.forget(hb.hostId);
        continue;
      }
      const next: HostRec = {
        id: hb.hostId,
        state,
        cordoned: cur?.value.cordoned ?? false,
        draining: cur?.value.draining ?? false,
        capacity: { vcpus: hb.capacity?.vcpus ?? 0, memoryMib: Number(hb.capacity?.memoryMib ?? 0n), diskMib: Number(hb.capacity?.diskMib ?? 0n) },
        accel: hb.accel === Accel.KVM ? 'kvm' : 'tcg',
        qemuVersion: hb.qemuVersion,
        cpuModel: hb.cpuModel,
        machine: hb.machine,
        peerAddress: hb.peerAddress,
        linkBytesPerSecond: Number(hb.linkBytesPerSecond),
        labels: cur?.value.labels ?? {},
        registeredAt: cur?.value.registeredAt ?? now,
        lastHeartbeatAt: cur?.value.lastHeartbeatAt ?? now,
        bootId: hb.bootId,
      };
      const changed = !cur || cur.value.state !== next.state || cur.value.bootId !== next.bootId || cur.value.peerAddress !== next.peerAddress || JSON.stringify(cur.value.capacity) !== JSON.stringify(next.capacity);
      // Heartbeat times are written only with a state change, or every 10 s while the host
      // is heard (a silent host's record is not rewritten: nothing new to say).
      if (changed || (heard.heardAt > next.lastHeartbeatAt && now - next.lastHeartbeatAt > 10_000)) {
        next.lastHeartbeatAt = heard.heardAt;
        writes.push({ next, cur });
      }
    }
    // A host this leader never heard from (it died before a failover, or before the
    // schedulers restarted) is silent since this term began: it goes suspect, then lost, as
    // one heard and then silent does; without this it stayed ready with its sandboxes running.
    if (this.termStartedAt > 0) {
      for (const cur of recs.values()) {
        if (cur.value.state === 'lost' || this.deps.heard.get(cur.value.id)) continue;
        const silentMs = now - this.termStartedAt;
        const state = silentMs > this.deps.config.liveness.lostAfterMs && mayLose ? 'lost' : silentMs > this.deps.config.liveness.suspectAfterMs ? 'suspect' : cur.value.state;
        if (state !== cur.value.state) writes.push({ next: { ...cur.value, state }, cur });
      }
    }
    // The pass's host records go out group-committed (each keeps its own guard), not one
    // transaction per host; then each state change is acted on, one host at a time.
    const landed = await Promise.all(writes.map(({ next, cur }) => this.commitGrouped([{ kind: 'host', value: next, expectRevision: cur?.modRevision ?? 0 }])));
    for (const [i, { next, cur }] of writes.entries()) {
      // A write that lost its guard (a cordon landed in the same moment, say) changed nothing:
      // not acted on; the next pass, a second later, reads the record again and decides anew.
      if (!landed[i]) continue;
      const state = next.state;
      if (cur && cur.value.state !== state) this.log.warn({ hostId: next.id, from: cur.value.state, to: state }, 'host state changed');
      // A new boot id: the agent restarted. Steps it had in hand died with it.
      if (cur && state === 'ready' && cur.value.bootId !== next.bootId) this.resendStepsOn(next.id);
      // One host's follow-up failing (a store blip under its list) leaves the other hosts'
      // to run: their records changed in this pass, and the next pass does not act on them
      // again (a rack lost at once made every host after the first wait out step timeouts).
      try {
        if (state === 'lost' && cur?.value.state !== 'lost') {
          // Its sandboxes first (a destroy whose step then fails finds its sandbox destroyed);
          // the steps fail even if that write fails: the next pass sees the host lost already.
          try {
            await this.markHostLost(next.id);
          } finally {
            this.failStepsOn(next.id);
          }
        }
        // A lost host back, or a new one that already runs VMs (a removed host whose agent
        // started again): its lost sandboxes are reclaimed and stray VMs stopped.
        if (state === 'ready' && (cur?.value.state === 'lost' || (!cur && (this.deps.heard.vms(next.id)?.length ?? 0) > 0))) await this.reclaimReturnedHost(next.id);
      } catch (e) {
        if (e instanceof NotLeaderError || !this.active) throw e;
        this.log.warn({ err: e, hostId: next.id, state }, 'could not act on a host\'s change of state; the other hosts\' go on');
      }
    }
    // Marking a lost host's sandboxes happens on the pass that sees it go lost; one that did
    // not finish (a leader that died in between, a failed list or write) is done again here,
    // for as long as the index shows one of its sandboxes in a state a lost host cannot keep.
    if (this.sandboxIndexReady) {
      const changedNow = new Set(writes.map((w) => w.next.id));
      const lost = new Set<string>();
      for (const h of recs.values()) if (h.value.state === 'lost' && !changedNow.has(h.value.id)) lost.add(h.value.id);
      if (lost.size > 0) {
        const stale = new Map<string, SandboxRec[]>();
        for (const v of this.sandboxIndex.values()) if (lost.has(v.value.hostId) && LOSABLE.has(v.value.state)) stale.set(v.value.hostId, [...(stale.get(v.value.hostId) ?? []), v.value]);
        for (const [hostId, sbs] of stale) {
          this.log.warn({ hostId, sandboxes: sbs.length }, 'a lost host still has sandboxes that are not marked lost: marking them');
          // Those the index shows, not a list of every sandbox: this runs every pass until done.
          await this.markHostLost(hostId, sbs).catch((e: unknown) => this.log.warn({ err: e, hostId }, 'could not mark a lost host\'s sandboxes lost'));
        }
      }
    }
  }

  /**
   * Lifecycle rules, on the leader: a sandbox whose running time reached its TTL is
   * destroyed (paused and hibernated time never counts), one idle for its idle_timeout (no
   * calls, guest CPU under the agent's threshold) is hibernated, and one a failed hibernate
   * left paused (resumeOwed) is resumed.
   * Each rule submits an operation under a key derived from the sandbox's state, so
   * repeating the check never starts the same work twice (one that failed is started again
   * once per LIFECYCLE_RETRY_MS: submitRule).
   */
  async reconcileLifecycles(sandboxes?: ReadonlyArray<Versioned<SandboxRec>>): Promise<void> {
    if (!this.deps.submit) return;
    const now = this.deps.clock.now();
    const all = sandboxes ?? (await this.deps.store.listSandboxes(undefined));
    /** When each snapshot's newest child was made (the TTL rule's "used"), made at the first sandbox that needs it. */
    let lastForked: Map<string, number> | undefined;
    for (const { value: sb } of all) {
      if (LEFT_BY_ENDED_OP.has(sb.state) && sb.opId && !this.running.has(sb.opId)) {
        // Its operation may have ended without moving it on (a host step that failed, a last
        // write that failed while the op's own failure landed): nothing else looks at it
        // again, and it holds its booking and maybe its VM.
        const owner = (await this.deps.store.getOp(sb.tenantId, sb.opId))?.value;
        if (!owner || isTerminal(owner.state)) await this.settleEndedOwner(sb, owner, now).catch((e: unknown) => this.log.warn({ err: e, sandboxId: sb.id, opId: sb.opId }, 'could not settle a sandbox its operation left behind'));
        continue;
      }
      // A pause or resume holds it for its step only, and lets go in the write that ends it: one
      // that ended holding it all the same (run to its end by a scheduler from before these
      // holds, whose last write keeps them) is let go of here, or the VM check and these rules
      // would leave the sandbox alone for good; so is one whose record is gone (expired during a
      // long stay on such a scheduler). One that runs, or another operation (a drain, whose
      // record is under DRAIN_TENANT: holderOf), keeps it.
      if ((sb.state === 'running' || sb.state === 'paused') && sb.opId && !this.running.has(sb.opId)) {
        const ownerId = sb.opId;
        const owner = await this.holderOf(sb);
        if (isVmStateHold(owner) && (!owner || isTerminal(owner.state))) {
          await this.updateSandbox(sb.tenantId, sb.id, (s) => {
            if (s.opId !== ownerId || (s.state !== 'running' && s.state !== 'paused')) throw new MovedOnError(s.id, s.state, s.hostId);
            s.opId = '';
          }).catch((e: unknown) => void (e instanceof MovedOnError || this.log.warn({ err: e, sandboxId: sb.id, opId: ownerId }, 'could not let go of a sandbox an ended pause or resume held')));
        }
        continue;
      }
      // Left paused by a hibernate that failed and could not resume it (resumeOwed), though its
      // owner never paused it. Keyed by that hibernate: one resume per such pause, and while
      // they fail (a host still in trouble), one more per LIFECYCLE_RETRY_MS.
      if (sb.state === 'paused' && sb.resumeOwed && !sb.opId) {
        await this.submitRule(sb, `__resume-after-hibernate/${sb.resumeOwed}`, 'resume', { resumeOwed: sb.resumeOwed }, now);
        continue;
      }
      // A sandbox with a TTL that the system hibernated (its idle timeout, a drain; whatever a
      // failed wake since wrote as its reason) and nothing used since, for longer than its
      // whole TTL: forgotten (a harness that crashed). Its running time no longer
      // grows, so the TTL alone never ended it, and it kept its quota slot and hibernation
      // snapshot for good. Used: a fork from it (which takes its hibernation snapshot and never
      // wakes it) counts as use. A pause or hibernate the user asked for is kept, as before.
      if (sb.state === 'hibernated' && !sb.hibernatedOnRequest && !sb.opId && sb.ttlMs !== null && now - sb.updatedAt >= sb.ttlMs) {
        lastForked ??= newestChildren(all);
        if (now - Math.max(sb.updatedAt, lastForked.get(sb.hibernationSnapshotId) ?? 0) >= sb.ttlMs) await this.submitRule(sb, `__ttl/${sb.id}`, 'destroy', { reason: 'ttl' }, now);
        continue;
      }
      if (sb.state !== 'running' || sb.opId) continue;
      const ran = sb.runningMsBefore + (sb.runningSince === null ? 0 : now - sb.runningSince);
      if (sb.ttlMs !== null && ran >= sb.ttlMs) {
        await this.submitRule(sb, `__ttl/${sb.id}`, 'destroy', { reason: 'ttl' }, now);
        continue;
      }
      // A hibernate that failed (failAndSettle) is not tried again at once: the VM stays as
      // idle as it was, and every attempt pauses it for a snapshot.
      if (sb.idleTimeoutMs && !(sb.stateReason.startsWith('hibernate failed') && now - sb.updatedAt < IDLE_RETRY_AFTER_FAILURE_MS)) {
        const vm = this.deps.heard.vm(sb.hostId, sb.id);
        // Never more than it has been running since its last start, wake or resume: a host's
        // idle figure from before (an agent that kept a VM's last activity) does not count.
        const idleMs = Math.min(vm?.idle ? Number(vm.idle.seconds) * 1000 + Math.floor(vm.idle.nanos / 1e6) : 0, sb.runningSince === null ? 0 : now - sb.runningSince);
        if (idleMs >= sb.idleTimeoutMs) await this.submitRule(sb, `__idle/${sb.id}/${sb.runningSince ?? 0}`, 'hibernate', { snapshotId: newId('sn'), replicas: 0, reason: 'idle' }, now);
      }
    }
  }

  /**
   * A sandbox whose operation ended (or whose record expired) with it still in that op's
   * transitional state. Each case acts on the record as a guarded write finds it (the pass's
   * copy may be stale). Destroying: another destroy goes on from there (one per ended
   * destroy, so a host that keeps failing it is tried again once per step deadline).
   * Starting: failed, its booking released and its VM (if the host made one) stopped.
   * Waking: hibernated again (settleEndedWake). Hibernating with the ended hibernate's
   * snapshot ready: hibernated from it (the VM has not run since it was taken),
   * as that hibernate's last write would have, and its VM stopped; before the snapshot, a
   * hibernate of its own takes it over (runHibernate) and finishes it.
   */
  private async settleEndedOwner(sb: SandboxRec, owner: OperationRec | undefined, now: number): Promise<void> {
    const endedId = sb.opId;
    if (sb.state === 'destroying') {
      const why = (owner?.input as { reason?: unknown } | undefined)?.reason;
      return this.submitRule(sb, `__redestroy/${endedId}`, 'destroy', typeof why === 'string' ? { reason: why } : {}, now);
    }
    this.log.warn({ sandboxId: sb.id, state: sb.state, opId: endedId, opState: owner?.state ?? 'gone' }, 'a sandbox\'s operation ended without settling it: settling it');
    if (sb.state === 'waking') return this.settleEndedWake(sb, owner);
    let to: SandboxState = 'failed';
    let why = `its ${owner?.kind ?? 'operation'} ${endedId} ended (${owner?.state ?? 'its record is gone'}) without starting it`;
    let snapshotId = '';
    if (sb.state === 'hibernating') {
      const fresh = (await this.deps.store.getSandbox(sb.tenantId, sb.id))?.value;
      if (fresh?.state !== 'hibernating' || fresh.opId !== endedId) return;
      snapshotId = fresh.hibernatingTo ?? (owner?.input as { snapshotId?: unknown } | undefined)?.snapshotId?.toString() ?? '';
      const snap = snapshotId ? (await this.readSnapshot(fresh.tenantId, snapshotId))?.value : undefined;
      if (snap?.state !== 'ready') return this.submitRule(fresh, `__rehibernate/${endedId}`, 'hibernate', { snapshotId: newId('sn'), replicas: 0, reason: 'settle' }, now);
      to = 'hibernated';
      why = `its hibernate ${endedId} ended before recording it hibernated`;
    }
    const from = sb.state;
    let hostId = '';
    try {
      await this.updateSandbox(
        sb.tenantId,
        sb.id,
        (s) => {
          if (s.state !== from || s.opId !== endedId) throw new MovedOnError(s.id, s.state, s.hostId);
          hostId = s.hostId;
          if (to === 'hibernated') {
            s.hibernationSnapshotId = snapshotId;
            delete s.hibernatingTo;
            delete s.hibernatingFrom;
          }
          this.setState(s, to, this.deps.clock.now(), why);
          s.opId = '';
        },
        (_next, before) => this.capacity(before.hostId, bookingOf(before), -1)(),
      );
    } catch (e) {
      if (e instanceof MovedOnError) return;
      throw e;
    }
    if (hostId) void this.sendHostWork(hostId, endedId, sb.tenantId, `stop-unanswered/${sb.id}`, stopVm(sb.id), `could not stop the VM of a sandbox its ${owner?.kind ?? 'operation'} left ${from}`);
  }

  /**
   * Submits a lifecycle rule's operation for a sandbox the rule found as it acts on it (running
   * and free; destroying or hibernating, its operation ended). The operation under the rule's key may have
   * failed without taking the sandbox (it is still so, or the rule would not be here): then under a key of the
   * current LIFECYCLE_RETRY_MS period, so a failure does not block the rule until the
   * failed operation's record expires, and a rule that keeps failing starts one operation
   * a period, not one a pass.
   */
  private async submitRule(sb: SandboxRec, key: string, kind: OperationRec['kind'], input: Record<string, unknown>, now: number): Promise<void> {
    const first = await this.submitOwn(sb.tenantId, key, kind, sb.id, input);
    if (first.state === 'failed' || first.state === 'cancelled') await this.submitOwn(sb.tenantId, `${key}/retry/${Math.floor(now / LIFECYCLE_RETRY_MS)}`, kind, sb.id, input);
  }

  /**
   * Snapshot retention (services/domain/retention.ts), on the leader: announce expiries
   * (the record's expiryDueAt is the SNAPSHOT_EXPIRING event), withdraw ones no longer
   * due or now in use (clearing it is the SNAPSHOT_EXPIRY_WITHDRAWN event), and delete due
   * snapshots that no live sandbox uses, through a delete_snapshot operation keyed per
   * snapshot (repeating the check never deletes twice).
   */
  async reconcileRetention(sandboxes?: ReadonlyArray<Versioned<SandboxRec>>): Promise<void> {
    if (!this.deps.submit) return;
    const now = this.deps.clock.now();
    // While leading, the snapshots come from the cache a watch keeps (a stale entry only makes
    // its guarded write conflict until the next pass), not from listing every snapshot every 2 s.
    const [snaps, sbs] = await Promise.all([this.active ? [...this.cache.snapshots.values()] : this.deps.store.listSnapshots(undefined), sandboxes ?? this.deps.store.listSandboxes(undefined)]);
    const rev = new Map(snaps.map((v) => [v.value.id, v.modRevision]));
    const opUsers = snapshotsOfOps([...this.ops.values()].map((v) => v.value));
    const plan = planRetention(
      snaps.map((v) => v.value),
      sbs.map((v) => v.value),
      now,
      this.deps.config.expiryNoticeMs ?? 10 * 60_000,
      opUsers,
    );
    for (const { snapshot, dueAt } of plan.announce) {
      if (await this.commit([{ kind: 'snapshot', value: { ...snapshot, expiryDueAt: dueAt }, expectRevision: rev.get(snapshot.id) ?? 0 }]))
        this.log.info({ snapshotId: snapshot.id, tenantId: snapshot.tenantId, dueAt: new Date(dueAt).toISOString() }, 'snapshot expiry announced');
    }
    for (const sn of plan.withdraw) {
      if (await this.commit([{ kind: 'snapshot', value: { ...sn, expiryDueAt: null }, expectRevision: rev.get(sn.id) ?? 0 }]))
        this.log.info({ snapshotId: sn.id, tenantId: sn.tenantId, usedBy: plan.held.get(sn.id) }, 'snapshot expiry withdrawn');
    }
    // Keyed by the record's revision too: passes over the same record never delete twice, and
    // a delete that found the snapshot in use after all (a fork placed meanwhile) puts it back
    // at a new revision, so its next expiry is a new operation, not that failed one again.
    for (const sn of plan.expire) await this.submitOwn(sn.tenantId, `__expire/${sn.id}/${rev.get(sn.id) ?? 0}`, 'delete_snapshot', sn.id, { reason: 'expired' });
    for (const [id, by] of plan.held) this.log.debug({ snapshotId: id, usedBy: by }, 'expired snapshot kept while sandboxes use it');
  }

  /**
   * A lost host came back (it was only unreachable, or its agent restarted and adopted its
   * VMs). Sandboxes still marked lost whose VM it reports running are theirs again, with
   * their capacity re-booked; a VM whose sandbox has meanwhile been restored elsewhere or
   * destroyed is stopped, so no sandbox ends up running twice.
   */
  private async reclaimReturnedHost(hostId: string): Promise<void> {
    const hb = this.deps.heard.get(hostId)?.hb;
    const vms = this.deps.heard.vms(hostId);
    if (!hb || !vms) return;
    const byId = new Map((await this.deps.store.listSandboxes(undefined)).map((v) => [v.value.id, v.value]));
    for (const vm of vms) {
      const sb = byId.get(vm.sandboxId);
      const alive = vm.state === PbVmState.RUNNING || vm.state === PbVmState.PAUSED;
      if (sb && sb.state === 'lost' && sb.hostId === hostId && alive) {
        // Guarded like reconcileVms' own reclaim, which may get there first: booked once.
        await this.vmBack(sb, vm.state === PbVmState.PAUSED ? 'paused' : 'running');
      } else if (!sb || sb.hostId !== hostId || sb.state === 'destroyed' || sb.state === 'failed' || sb.state === 'hibernated') {
        await this.sendHostWork(hostId, reclaimOpId(hostId, hb), sb?.tenantId ?? 'system', `stop/${vm.sandboxId}`, stopVm(vm.sandboxId), 'could not stop a stale VM');
        this.log.warn({ hostId, sandboxId: vm.sandboxId }, 'host returned with a VM whose sandbox lives elsewhere or is gone: stopping it');
      }
    }
  }

  /**
   * Wakes every step waiting on a host that was just marked lost: each fails with
   * HostLostError at once instead of waiting out FF_STEP_TIMEOUT x FF_STEP_ATTEMPTS (a fork
   * of 64 whose one host died would otherwise hang for minutes). Its op then does what a
   * timed-out step makes it do: a fork fails that host's children (their bookings released)
   * and finishes with the others. A result the host sends if it comes back is dropped, and
   * a VM it made for a failed child is stopped as a stray (reclaimReturnedHost).
   */
  private failStepsOn(hostId: string): void {
    this.wakeStepsOn(hostId, HOST_LOST);
  }

  /**
   * Wakes every step waiting on a host whose agent restarted: each is sent again at once
   * (stepOnHost), instead of waiting for JetStream to redeliver the message the dead agent
   * held (its ack wait, 30 s) or for the step's timeout.
   */
  private resendStepsOn(hostId: string): void {
    this.wakeStepsOn(hostId, HOST_RESTARTED);
  }

  private wakeStepsOn(hostId: string, why: typeof HOST_LOST | typeof HOST_RESTARTED): void {
    for (const [k, w] of this.waiters) {
      if (w.hostId !== hostId) continue;
      this.waiters.delete(k);
      w.resolve(why);
    }
  }

  /**
   * A lost host's sandboxes: those with a VM there become lost (a destroying one destroyed),
   * and their bookings are released. Each is re-checked in its guarded write (the list may be
   * stale: a drain or a VM check may have moved it meanwhile), and releases what that write
   * found booked.
   */
  private async markHostLost(hostId: string, only?: readonly SandboxRec[]): Promise<void> {
    const now = this.deps.clock.now();
    const lose = (s: SandboxRec): void => {
      if (s.hostId !== hostId || !LOSABLE.has(s.state)) throw new MovedOnError(s.id, s.state, s.hostId);
      const hibernating = s.state === 'hibernating';
      if (s.state === 'destroying') this.setState(s, 'destroyed', now, `host ${hostId} lost`);
      else {
        this.setState(s, 'lost', now, `host ${hostId} lost`);
        if (s.opId) s.lostFromOp = s.opId;
      }
      // The op at work on it (a hibernate, a pause) can no longer finish: its later writes
      // check the state. Left set, a VM that comes back with its host would be taken
      // back as running but still look busy, and nothing would watch it again.
      s.opId = '';
      // Lost in a hibernate: what it was before stays, so a VM that comes back paused (the
      // hibernate's pause) from running is resumed (vmBack).
      if (!hibernating) delete s.hibernatingFrom;
    };
    const todo = (only ?? (await this.deps.store.listSandboxes(undefined)).map((v) => v.value)).filter((sb) => sb.hostId === hostId && LOSABLE.has(sb.state));
    // A batch per transaction (with the host's booking, released once): a host of thousands
    // of sandboxes is marked in seconds, and the host pass that waits for it moves on. A batch
    // that conflicts (one of them changed meanwhile) is marked one by one.
    for (let i = 0; i < todo.length; i += LOST_BATCH) {
      const batch = todo.slice(i, i + LOST_BATCH);
      const together = batch.length > 1 && (await this.markLostTogether(hostId, batch, lose).catch((e: unknown) => void this.log.warn({ err: e, hostId, sandboxes: batch.length }, 'could not mark a batch of sandboxes lost at once: one by one')));
      if (together) continue;
      for (const sb of batch) {
        await this.updateSandbox(sb.tenantId, sb.id, lose, (_next, before) => this.capacity(hostId, bookingOf(before), -1)()).catch((e: unknown) => {
          if (e instanceof MovedOnError) this.log.debug({ hostId, sandboxId: sb.id, err: e.message }, 'sandbox moved on before its host was marked lost');
          else this.log.warn({ err: e, hostId, sandboxId: sb.id }, 'could not mark sandbox lost');
        });
      }
    }
  }

  /**
   * markHostLost for a batch in one guarded transaction: each sandbox as it reads now (one that
   * moved on is left alone) and the host's booking less theirs. False when a guard failed.
   */
  private async markLostTogether(hostId: string, batch: readonly SandboxRec[], lose: (s: SandboxRec) => void): Promise<boolean> {
    // Read in one turn: one read-only transaction (store.ts batches point reads).
    const read = await Promise.all(batch.map((sb) => this.deps.store.getSandbox(sb.tenantId, sb.id)));
    const writes: StoreWrite[] = [];
    const released: SandboxRec[] = [];
    for (const v of read) {
      if (!v || v.value.hostId !== hostId || !LOSABLE.has(v.value.state)) continue;
      // The write updateSandbox would make from this read (a transition it refuses throws: one by one then).
      writes.push(...(await this.sandboxWrite(v.value, lose, v)(0)));
      released.push(v.value);
    }
    if (writes.length === 0) return true;
    const a = await this.deps.store.getAlloc(hostId);
    const alloc = released.reduce((acc, sb) => applyBooking(acc, bookingOf(sb), -1, this.privateMemoryFraction), a.value);
    writes.push({ kind: 'alloc', value: alloc, expectRevision: a.modRevision });
    return (await this.commit(writes)) > 0;
  }
}
