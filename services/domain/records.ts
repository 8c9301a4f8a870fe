// Fleet state as stored in etcd (services/adapters/etcd/keys.ts has the key layout).
// Records are small JSON documents; bulk data (manifests, chunks) lives on hosts.
// Times are epoch milliseconds. Every record carries its tenant.

export interface ResourcesRec {
  vcpus: number;
  memoryMib: number;
  diskMib: number;
}

/**
 * Sandbox lifecycle. Transitions (anything else is a bug and is refused):
 *   pending     -> starting | failed | destroyed
 *   starting    -> running | failed | destroying
 *   running     -> paused | hibernating | destroying | failed | lost
 *   paused      -> running | hibernating | destroying | lost
 *   hibernating -> hibernated | running | failed | lost | destroying
 *   hibernated  -> waking | destroyed
 *   waking      -> running | failed | hibernated | destroying
 *   destroying  -> destroyed | failed
 *   failed      -> destroyed
 *   lost        -> running | paused (its host came back) | waking | destroyed
 *   destroyed   -> (terminal)
 * (SANDBOX_TRANSITIONS below is the table the code checks; a state that holds no VM or
 * booking is destroyed in one write, never `destroying`.)
 * Invariant: hostId is set in every state that owns a VM (starting, running, paused,
 * hibernating, destroying) and capacity is booked on that host exactly then, and while
 * waking once the wake has been placed. A hibernated sandbox keeps its last hostId as
 * the warm location of its hibernation snapshot, and books nothing.
 */
export type SandboxState =
  | 'pending'
  | 'starting'
  | 'running'
  | 'paused'
  | 'hibernating'
  | 'hibernated'
  | 'waking'
  | 'destroying'
  | 'destroyed'
  | 'failed'
  | 'lost';

export const SANDBOX_TRANSITIONS: Readonly<Record<SandboxState, readonly SandboxState[]>> = {
  pending: ['starting', 'failed', 'destroyed'],
  starting: ['running', 'failed', 'destroying'],
  running: ['paused', 'hibernating', 'destroying', 'failed', 'lost'],
  paused: ['running', 'hibernating', 'destroying', 'lost'],
  hibernating: ['hibernated', 'running', 'failed', 'lost', 'destroying'],
  hibernated: ['waking', 'destroyed'],
  waking: ['running', 'failed', 'hibernated', 'destroying'],
  destroying: ['destroyed', 'failed'],
  failed: ['destroyed'],
  lost: ['running', 'paused', 'waking', 'destroyed'],
  destroyed: [],
};

/**
 * States in which the sandbox holds a VM and booked capacity on `hostId`. Only these become
 * `destroying`; the others are destroyed in one write (Executor.runDestroy).
 */
export const HOLDS_CAPACITY: ReadonlySet<SandboxState> = new Set(['starting', 'running', 'paused', 'hibernating', 'destroying']);

export function canTransition(from: SandboxState, to: SandboxState): boolean {
  return from === to || SANDBOX_TRANSITIONS[from].includes(to);
}

export interface SandboxRec {
  id: string;
  tenantId: string;
  state: SandboxState;
  stateReason: string;
  hostId: string;
  resources: ResourcesRec;
  image: string;
  sourceSnapshotId: string;
  lineageId: string;
  hostname: string;
  labels: Record<string, string>;
  ttlMs: number | null;
  idleTimeoutMs: number | null;
  allowEgress: boolean;
  /** With allowEgress: the only CIDRs the guest may reach (empty: any, except the control plane). */
  allowCidrs?: string[];
  createdAt: number;
  updatedAt: number;
  /** Running time accumulated before `runningSince`. */
  runningMsBefore: number;
  /** When the sandbox last entered `running`; null when not running. TTL counts only running time. */
  runningSince: number | null;
  hibernationSnapshotId: string;
  /**
   * Hibernated because its user asked (HibernateSandbox), not by its idle timeout or a drain:
   * the TTL rule leaves such a sandbox hibernated however long. Cleared once it runs or is
   * paused again; absent on records written before the field (taken as not asked for).
   */
  hibernatedOnRequest?: true;
  /**
   * While hibernating (or lost in it): the state it came from, which a failed hibernate returns
   * it to, and a VM that comes back with its host is resumed to (Executor.vmBack).
   */
  hibernatingFrom?: 'running' | 'paused';
  /**
   * Lost with its host while an operation held it (opId): that operation, which the loss ended.
   * A drain's migration switches a lost sandbox to its copy only if it was lost from under that
   * migration; one taken back since and lost again may have run on past the copy's snapshot.
   * Cleared by any change of state.
   */
  lostFromOp?: string;
  /**
   * While hibernating (or lost in it): the snapshot it is being hibernated into, in use from
   * before it exists until hibernationSnapshotId names it (snapshotsUsedBy).
   */
  hibernatingTo?: string;
  /**
   * Paused by a hibernate (this id) that failed and could not resume the VM, though its owner
   * never paused it: the lifecycle pass resumes it while it is paused and no operation holds
   * it, again once per LIFECYCLE_RETRY_MS until a resume succeeds (Executor.reconcileLifecycles).
   * Kept through hibernating (a hibernate of it that fails returns it paused) and lost (its VM
   * may come back paused); cleared by any other state and by its owner's pause
   * (Executor.setState, runPauseResume). Absent on records written before the field: none owed.
   */
  resumeOwed?: string;
  /** User steps run in the guest after every resume, wake and restore (before it is reported ready). */
  afterResume?: HookRec[];
  /** Operation that currently owns the sandbox (one at a time); empty when idle. */
  opId: string;
  /**
   * A fork child placed on a host that held this snapshot: its VM maps the snapshot's memory
   * image copy-on-write there, and its memory is booked as a share of that image
   * (HostAllocRec.images, image-shares.ts), not whole. It keeps mapping it after a snapshot of
   * it (ADR 0003: the copy is made by a receiver; the VM goes on) and while paused. Cleared
   * when it is booked whole: moved to another host by a drain, woken from hibernation, or
   * placed again on a host that fetches the snapshot.
   */
  imageShare?: string;
}

/** A user step run in the guest, e.g. refreshing credentials after a wake. */
export interface HookRec {
  argv: string[];
  timeoutMs: number;
}

export type SnapshotState = 'creating' | 'ready' | 'deleting' | 'deleted' | 'failed';

export interface SnapshotRec {
  id: string;
  tenantId: string;
  state: SnapshotState;
  sourceSandboxId: string;
  parentSnapshotId: string;
  lineageId: string;
  createdAt: number;
  pinned: boolean;
  retentionTtlMs: number | null;
  keepLast: number;
  logicalBytes: number;
  storedBytes: number;
  /** Hosts that hold every chunk. */
  hostIds: string[];
  /**
   * The host that took the snapshot: the only one a restore may migrate from (ADR 0015; a
   * migration stream is loaded unverified, and any other holder got its copy from elsewhere).
   * Absent on records written before the field: no host is migrated from.
   */
  takenOn?: string;
  vmConfig: {
    machine: string;
    memoryMib: number;
    vcpus: number;
    devices: string[];
    qemuVersion: string;
    accel: 'kvm' | 'tcg';
    cpuModel: string;
    image: string;
    /** The image's recipe hash and its base disk's sha256 on the source host (VmConfig.image_digest, image_disk_sha256); absent on records written before them. */
    imageRecipeHash?: string;
    imageDiskSha256?: string;
  } | null;
  labels: Record<string, string>;
  /** Scheduler signature (base64) over the manifest bytes the source host produced; restores verify it. */
  manifestSignature: string;
  manifestKeyId: string;
  /**
   * Set when retention has selected the snapshot for deletion and the expiry has been
   * announced (the SNAPSHOT_EXPIRING event): when it will be deleted. Absent or null: not
   * expiring. Deletion waits while a live sandbox still restores from or hibernates in it.
   */
  expiryDueAt?: number | null;
  /**
   * The state a `deleting` snapshot had before: it goes back to it when its delete finds that
   * sandboxes still use it. Cleared once the delete found none, before any host deletes its
   * bytes (from then on it never goes back); absent on records written before the field.
   */
  deletingFrom?: 'ready' | 'failed';
  /**
   * The delete operation whose mark `deletingFrom` is: a delete that looked for users under
   * one mark does not undo or clear a later one. Absent on records written before the field.
   */
  deletingBy?: string;
  /**
   * What a fork's children inherit from the sandbox the snapshot was taken of, copied when it
   * was taken: that sandbox's record goes with the history retention once it is destroyed,
   * and forks made later must still get its disk size, egress policy and hooks. Absent on
   * records written before the field (a fork then reads the sandbox's record, if any).
   */
  inherits?: { resources: ResourcesRec; image: string; idleTimeoutMs: number | null; afterResume: HookRec[]; allowEgress: boolean; allowCidrs: string[] };
  /** Why a deleted snapshot was deleted: by a user call, or by retention. */
  deletedReason?: 'deleted' | 'expired';
  /**
   * When the snapshot became deleted or failed (ms): its record expires FF_RECORD_RETENTION
   * later (ADR 0017). Absent on records written before the field and on live snapshots.
   */
  endedAt?: number;
}

export type HostState = 'ready' | 'suspect' | 'lost';

export interface HostRec {
  id: string;
  state: HostState;
  cordoned: boolean;
  draining: boolean;
  capacity: ResourcesRec;
  accel: 'kvm' | 'tcg';
  qemuVersion: string;
  cpuModel: string;
  machine: string;
  peerAddress: string;
  linkBytesPerSecond: number;
  labels: Record<string, string>;
  registeredAt: number;
  lastHeartbeatAt: number;
  bootId: string;
}

/**
 * Capacity booked on a host by the scheduler (not what the agent reports). Guarded by
 * its mod revision in every placement commit, so two commits can never both book the
 * last slot.
 */
export interface HostAllocRec {
  hostId: string;
  /** Includes the memory of `images` (image-shares.ts: what n children of one image book). */
  allocated: ResourcesRec;
  sandboxes: number;
  /**
   * Snapshot id -> how many fork children booked here share its memory image (>= 1; absent:
   * none). Their memory, sharedMemoryMib(memoryMib, privateMemoryFraction, n) of each child's
   * memoryMib, is in `allocated` (image-shares.ts). Kept to one number per snapshot: the record
   * is written with every placement on the host.
   */
  images?: Record<string, number>;
}

export type OperationKind = 'create' | 'pause' | 'resume' | 'hibernate' | 'wake' | 'snapshot' | 'fork' | 'destroy' | 'delete_snapshot' | 'drain';

/**
 * pending -> running -> succeeded | failed | cancelled. An operation is done exactly when
 * its state is terminal; `result` is set only on success, `error` only on failure.
 */
export type OperationState = 'pending' | 'running' | 'succeeded' | 'failed' | 'cancelled';
/** The states an operation ends in (isTerminal). */
export type FinalOperationState = Exclude<OperationState, 'pending' | 'running'>;

export interface OperationError {
  kind: string;
  /** What the API answers (Operation.error.message): never an unexpected failure's own text. */
  message: string;
  retryable: boolean;
  field?: string;
  /**
   * For the operator only (this record in etcd, the scheduler's log; no API field shows it): the
   * text of an unexpected failure (a host's internal error, an exception in the scheduler),
   * which can carry host paths, QEMU, etcd or guest-agent output.
   */
  detail?: string;
}

/** One host step of an op, as the leader saw it (Operation.steps). Times are ms since the epoch. */
export interface StepRec {
  hostId: string;
  status: 'sent' | 'done' | 'failed';
  attempt: number;
  /** HostWork kind as its proto field is named, e.g. 'restore_vms'. Absent in records written before it was kept. */
  action?: string;
  /** When it was first sent, as recorded by the leader that sent it (or an earlier one); absent when the leader that sent it died before recording it. */
  sentAt?: number;
  /** The answer (or the failure) reached the leader. */
  endedAt?: number;
  /** As the host measured it (HostResult.duration / pause). */
  hostMs?: number;
  pauseMs?: number;
  bytesFetched?: number;
  migrated?: boolean;
}

export interface OperationRec {
  id: string;
  tenantId: string;
  kind: OperationKind;
  state: OperationState;
  createdAt: number;
  updatedAt: number;
  targetId: string;
  /** Kind-specific input, validated before the record is written. */
  input: Record<string, unknown>;
  progress: { done: number; total: number; message: string; bytesTransferred: number };
  result: { sandboxIds?: string[]; snapshotId?: string; explanation?: unknown } | null;
  error: OperationError | null;
  /** Host steps dispatched: stepId -> host, status and timings (written with progress and the final state). */
  steps: Record<string, StepRec>;
  /** Ended steps dropped from `steps` (the earliest first) to keep the record small (step-log.ts capSteps). */
  stepsOmitted?: number;
  /** The idempotency key it was submitted with: deleted with the record when it expires (history.ts). */
  idempotencyKey?: string;
  /** What the request asked for beside kind and target (fleet.ts requestDigest): a repeat of the key must ask the same. */
  requestDigest?: string;
  /** CancelOperation asked it to stop: the leader ends it `cancelled` at its next safe point (executor.ts). */
  cancelRequested?: boolean;
}

/** The tenant a drain's operation is recorded under (Fleet.drainHost), not its sandboxes'. */
export const DRAIN_TENANT = 'admin';

/** Kinds with safe points to stop at (CancelOperation); the others end on their own, each host step bounded. */
export const CANCELLABLE_KINDS: ReadonlySet<OperationKind> = new Set(['create', 'fork', 'drain']);

/**
 * The sandbox an operation acts on as its caller named it: its target, but for a fork of a
 * hibernated sandbox, whose target is that sandbox's hibernation snapshot (the fork starts
 * from it, Fleet.forkSandbox) and whose input names the sandbox. '' when it acts on none.
 */
export function sandboxOfOp(o: Pick<OperationRec, 'kind' | 'targetId' | 'input'>): string {
  if (o.targetId.startsWith('sb-')) return o.targetId;
  const hibernated = o.kind === 'fork' ? (o.input as { hibernatedSandboxId?: unknown } | null)?.hibernatedSandboxId : undefined;
  return typeof hibernated === 'string' ? hibernated : '';
}

export function isTerminal(s: OperationState): boolean {
  return s === 'succeeded' || s === 'failed' || s === 'cancelled';
}

/**
 * Record bytes one placement transaction writes, at most: under etcd's default request limit
 * (--max-request-bytes, 1.5 MiB), with room for the op's plan, the hosts' capacity records and
 * the keys. A fork writes all its children in one transaction, so this caps count x child size.
 */
export const PLACEMENT_TXN_MAX_BYTES = 1_000_000;

/** A tenant id: 1-63 characters of a-z, 0-9 and -, starting with a letter or digit (API, tokens, webhooks). */
export const TENANT_ID_RE = /^[a-z0-9][a-z0-9-]{0,62}$/;
/** A sandbox record's JSON without its labels and hooks, at most (ids, state, resources, times: ~700 bytes). */
export const SANDBOX_RECORD_BASE_BYTES = 1024;

const jsonSizes = new WeakMap<object, number>();

/** A sandbox record's size as stored, estimated: its labels and hooks (measured once per object: a fork's children share them) plus the rest. */
export function sandboxRecordBytes(sb: Pick<SandboxRec, 'labels' | 'afterResume'>): number {
  const size = (v: object): number => {
    let n = jsonSizes.get(v);
    if (n === undefined) jsonSizes.set(v, (n = Buffer.byteLength(JSON.stringify(v))));
    return n;
  };
  return SANDBOX_RECORD_BASE_BYTES + size(sb.labels) + (sb.afterResume ? size(sb.afterResume) : 0);
}

/**
 * The snapshots a sandbox needs: the one it was forked or restored from, the one it is
 * hibernated in, and the one a hibernate is taking of it. A delete refuses them and retention
 * keeps them while the sandbox lives. None for a destroyed sandbox.
 */
export function snapshotsUsedBy(sb: SandboxRec): string[] {
  if (sb.state === 'destroyed') return [];
  return [...new Set([sb.sourceSnapshotId, sb.hibernationSnapshotId, sb.hibernatingTo ?? ''])].filter((id) => id !== '');
}
