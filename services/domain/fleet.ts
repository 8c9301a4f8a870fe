// API use cases of the Fleet service. Any scheduler replica serves them: reads go to
// etcd, mutations are recorded as pending operations (with their idempotency key) that the
// leader's Executor carries out. Inputs arrive validated (adapters/grpc/convert.ts).
import { createHash, randomBytes, randomFillSync } from 'node:crypto';
import type { Clock, FleetStore, LeaderFence, StoreWrite, Versioned, WorkBus } from './ports.ts';
import type { HookRec, HostAllocRec, HostRec, OperationKind, OperationRec, OperationState, ResourcesRec, SandboxRec, SandboxState, SnapshotRec } from './records.ts';
import { livenessOf } from './fleet-view.ts';
import type { HeartbeatRegistry, LivenessConfig } from './fleet-view.ts';
import { CANCELLABLE_KINDS, DRAIN_TENANT, isTerminal, PLACEMENT_TXN_MAX_BYTES, sandboxOfOp, sandboxRecordBytes, snapshotsUsedBy } from './records.ts';
import { ConflictError, NotFoundError, RelayedHostError, WrongStateError } from './errors.ts';
import type { HostExecOutputMsg } from './messages.ts';
import { HostExecOutputSchema, HostExecRequestSchema, HostFileRequestSchema } from './messages.ts';
import { create, toBinary } from '@bufbuild/protobuf';
import { ForkfleetError, InvalidArgumentError } from '../../proto/errors.ts';
import { admit, forkNeed, tenantUsage } from './quota.ts';
import type { QuotaOf, TenantQuota, TenantUsage, UsageSource } from './quota.ts';

/** Room left in a relayed NATS message for its protobuf framing and headers. */
const RELAY_HEADROOM = 16 << 10;
/** The most file data one relayed request or answer carries. */
const FILE_PIECE_MAX = 512 << 10;

export type IdPrefix = 'sb' | 'sn' | 'op';

/**
 * Random bytes for ids, drawn from a pool refilled 4 KiB at a time: one `randomBytes(20)` per
 * id was ~6 us of the API's CPU per fork child (a fork(64) makes 64 ids).
 */
const idPool = Buffer.allocUnsafe(4096);
let idPoolAt = idPool.length;

/** Ids: a prefix and 20 base32 characters (100 random bits). */
export function newId(prefix: IdPrefix): string {
  const alphabet = 'abcdefghijklmnopqrstuvwxyz234567';
  if (idPoolAt + 20 > idPool.length) {
    randomFillSync(idPool);
    idPoolAt = 0;
  }
  let s = '';
  for (let i = idPoolAt; i < idPoolAt + 20; i++) s += alphabet[idPool[i]! & 31];
  idPoolAt += 20;
  return `${prefix}-${s}`;
}

/** Sandbox states that do not keep a host from being removed (nothing of theirs runs there). */
const REMOVABLE_WITH: ReadonlySet<SandboxState> = new Set(['lost', 'destroyed', 'failed']);

export interface PlacementPrefs {
  locality: 'ANY' | 'SAME_HOST' | 'CROSS_HOST';
  spread: 'PACK' | 'SPREAD';
  maxPerHost: number;
  hostId: string;
}

export interface CreateInput {
  tenantId: string;
  idempotencyKey: string;
  image: string;
  snapshotId: string;
  resources: ResourcesRec;
  /**
   * Which of `resources` the caller set (the rest are defaults): a restore takes its snapshot's
   * VM size and, unless set, its sandbox's disk. `diskMib` absent: not set.
   */
  resourcesSet?: { vcpus: boolean; memoryMib: boolean; diskMib?: boolean };
  labels: Record<string, string>;
  ttlMs: number | null;
  idleTimeoutMs: number | null;
  afterResume: HookRec[];
  allowEgress: boolean;
  allowCidrs: string[];
  placement: PlacementPrefs;
  hostname: string;
}

export interface ForkInput {
  tenantId: string;
  idempotencyKey: string;
  snapshotId: string;
  sandboxId: string;
  count: number;
  placement: PlacementPrefs;
  labels: Record<string, string>;
  ttlMs: number | null;
  /** The children's idle timeout (0 disables); null: the source sandbox's. */
  idleTimeoutMs: number | null;
  /** The children's after_resume hooks; null: the source sandbox's. */
  afterResume: HookRec[] | null;
  /** Set (by forkSandbox) on the fork of a hibernated sandbox, which forks its hibernation snapshot: that sandbox. */
  hibernatedSandboxId?: string;
  /**
   * Retention of the snapshot a fork of a live sandbox takes (ttlMs null: no TTL); absent:
   * FleetDeps.forkSnapshotTtlMs. Only with `sandboxId`.
   */
  snapshotRetention?: SnapshotRetention;
}

/** A snapshot's retention rule (records.ts SnapshotRec: retentionTtlMs, keepLast). */
export interface SnapshotRetention {
  ttlMs: number | null;
  keepLast: number;
}

export interface SandboxOpInput {
  tenantId: string;
  idempotencyKey: string;
  sandboxId: string;
}

export interface ExecInput {
  tenantId: string;
  sandboxId: string;
  argv: string[];
  env: Record<string, string>;
  cwd: string;
  stdin: Uint8Array;
  timeoutMs: number;
}

export interface FleetDeps {
  store: FleetStore;
  bus: WorkBus;
  clock: Clock;
  heard: HeartbeatRegistry;
  liveness: LivenessConfig;
  /** Per-tenant quotas checked at admission (quota.ts); none when absent. */
  quotas?: QuotaOf;
  /** Where admission reads a tenant's usage (quota-ledger.ts); absent: from the records. */
  usage?: UsageSource;
  /** A tenant's idle timeout for sandboxes that set none (lifecycle.idle_timeout unset). */
  defaultIdleTimeoutMs?: (tenantId: string) => number | undefined;
  /** TTL of the snapshot a fork of a live sandbox takes when the request sets no retention; 0 or absent: kept. */
  forkSnapshotTtlMs?: number;
  /** A tenant's call rate limit (services/auth), for GetTenantUsage; absent: none. */
  rateOf?: (tenantId: string) => { perSecond: number; burst: number } | undefined;
}

export interface HostListing {
  host: HostRec;
  alloc: HostAllocRec | undefined;
  live: { state: HostRec['state']; snapshotCount: number; lastHeartbeatAt: number; memoryUsedBytes: number; chunkStoreBytes: number } | undefined;
}

/** Running time so far: what a TTL counts. Paused and hibernated time is never included. */
export function runningMs(sb: SandboxRec, now: number): number {
  return sb.runningMsBefore + (sb.runningSince === null ? 0 : Math.max(0, now - sb.runningSince));
}

/**
 * A restore's size: the snapshot's VM has its memory and vCPUs already, so they are what is
 * booked (and counted against quotas). A size the caller set that differs is refused, naming
 * the field. The writable disk is the snapshot's sandbox's (`inheritedDiskMib`, as a fork
 * child's is), or more when the caller asks: the restored overlay sits on the snapshot's disk,
 * which cannot shrink, so less is refused. (Disk is a booking only: the agent sizes no overlay
 * by it, so a larger one reserves more of the host's disk for what the guest writes, as on a
 * create from an image.) Unknown (a snapshot recorded before `inherits`, its sandbox's record
 * gone), the caller's disk is taken.
 */
function restoredResources(sn: SnapshotRec, asked: ResourcesRec, set: CreateInput['resourcesSet'], inheritedDiskMib: number | undefined): ResourcesRec {
  const vm = sn.vmConfig;
  if (vm && set?.memoryMib && asked.memoryMib !== vm.memoryMib) throw new InvalidArgumentError('resources.memory_mib', `a restore of ${sn.id} has its VM's ${vm.memoryMib} MiB; leave it unset or ask for that`);
  if (vm && set?.vcpus && asked.vcpus !== vm.vcpus) throw new InvalidArgumentError('resources.vcpus', `a restore of ${sn.id} has its VM's ${vm.vcpus} vCPUs; leave it unset or ask for that`);
  let diskMib = asked.diskMib;
  if (inheritedDiskMib !== undefined) {
    if (!set?.diskMib) diskMib = inheritedDiskMib;
    else if (asked.diskMib < inheritedDiskMib) throw new InvalidArgumentError('resources.disk_mib', `a restore of ${sn.id} has its sandbox's ${inheritedDiskMib} MiB of disk, which cannot shrink under the snapshot; leave it unset or ask for ${inheritedDiskMib} MiB or more`);
  }
  return vm ? { ...asked, memoryMib: vm.memoryMib, vcpus: vm.vcpus, diskMib } : { ...asked, diskMib };
}

/**
 * What a repeat of an idempotency key asks for: one of these kinds of operation, on this
 * target (when known before the operation exists), with these parameters (`digest`,
 * requestDigest; when the caller has any).
 */
interface Repeat {
  kinds: readonly OperationKind[];
  targetId?: string;
  digest?: string;
}

function isRepeatOf(op: OperationRec, r: Repeat): boolean {
  if (!r.kinds.includes(op.kind)) return false;
  if (r.targetId === undefined || op.targetId === r.targetId) return true;
  // A fork of a hibernated sandbox is a fork of its hibernation snapshot (forkSandbox).
  return sandboxOfOp(op) === r.targetId;
}

/** JSON with every object's keys sorted (and undefined members left out), bigints as strings: equal for equal values. */
function canonicalJson(v: unknown): string {
  if (v === undefined || v === null) return 'null';
  if (typeof v === 'bigint') return JSON.stringify(String(v));
  if (v instanceof Uint8Array) return JSON.stringify(Buffer.from(v).toString('base64'));
  if (Array.isArray(v)) return `[${v.map(canonicalJson).join(',')}]`;
  if (typeof v === 'object') {
    const o = v as Record<string, unknown>;
    const members = Object.keys(o)
      .filter((k) => o[k] !== undefined)
      .sort()
      .map((k) => `${JSON.stringify(k)}:${canonicalJson(o[k])}`);
    return `{${members.join(',')}}`;
  }
  return JSON.stringify(v);
}

/**
 * A digest of what a request asks for beside its kind and target (its validated input, less
 * the tenant, key and target), kept on its operation (OperationRec.requestDigest): a repeat of
 * the key that asks for something else (another fork count, a snapshot pinned this time) is
 * refused instead of answered with an operation that did not do it.
 */
export function requestDigest(params: Record<string, unknown>): string {
  return createHash('sha256').update(canonicalJson(params)).digest('base64url').slice(0, 22);
}

/**
 * What a call that woke sandbox `id` answers when the wake `op` did not succeed: the wake's own
 * kind and retryability (its snapshot gone is NOT_FOUND, for good; no host with room is retried),
 * naming the caller's `field`. A retryable answer to a wake that can never succeed made every
 * retry start one more wake (a failed wake puts the sandbox back, with a new key). Kinds a
 * caller must not see from a relay (unauthenticated, permission denied) become internal.
 */
function wakeFailure(id: string, op: OperationRec, field: string): ForkfleetError {
  if (!isTerminal(op.state)) return new ForkfleetError('unavailable', `waking sandbox ${id} takes longer than expected (operation ${op.id} is ${op.state}); retry`, { retryable: true });
  if (op.state !== 'failed' || !op.error) return new ForkfleetError('unavailable', `waking sandbox ${id} ended ${op.state}; retry`, { retryable: true });
  return new RelayedHostError(op.error.kind, `waking sandbox ${id} failed: ${op.error.message}`, { retryable: op.error.retryable, field });
}

/** A file call whose call has ended (cancelled, past its deadline, its credential revoked) goes no further. */
function throwIfEnded(signal: AbortSignal | undefined, message: string): void {
  if (signal?.aborted) throw new ForkfleetError('cancelled', message);
}

/** What an exec or file call on sandbox `id`, recorded in `state`, is refused with (runningSandbox). */
function notRunning(id: string, state: SandboxState, field: string): WrongStateError {
  return new WrongStateError('sandbox', id, state, state === 'paused' ? 'it must be running (ResumeSandbox resumes it)' : 'it must be running', field);
}

/**
 * A host agent's refusals of an exec or file call before any of it ran, because the sandbox's
 * VM was not running when the call got there (host-agent: Agent.callVm; the driver's running(),
 * agentOf() and mustGet(): InvalidVmStateError, VmStillSnapshottingError, VmNotFoundError).
 * Matched by kind and whole text: any other error may come from a call that ran, in part.
 */
const VM_NOT_RUNNING: ReadonlyArray<readonly [string, RegExp]> = [
  ['failed_precondition', /^sandbox \S+ has no VM on host \S+ any more \(it is being recorded lost\)$/],
  // Not "is running; cannot talk to the guest agent": a running VM whose guest agent is not
  // connected (a reopen that failed) stays so; resent, or retried by its caller, it fails again.
  ['failed_precondition', /^vm \S+ is (?!running;)\w+; cannot (exec|read a file|write a file|talk to the guest agent)$/],
  ['unavailable', /^vm \S+ is still being snapshotted after \d+ ms; cannot (exec|read a file|write a file) yet$/],
  ['not_found', /^vm \S+ not found$/],
];

export function vmNotRunning(e: { kind: string; message: string }): boolean {
  return VM_NOT_RUNNING.some(([kind, text]) => e.kind === kind && text.test(e.message));
}

/** `e`, thrown: for `??` (an answer that is the error itself). */
function throwIt(e: unknown): never {
  throw e;
}

/**
 * Renames WriteFile's temporary file ($1) over the path ($2) in the guest: a directory at the
 * path is refused (mv would move the file into it), a symbolic link is written through (its
 * target replaced, the link kept), a file that was there keeps its owner and group, and its
 * permission bits unless the caller set a mode ($3, octal; 0: none set). A new file without a
 * mode gets the guest's default (0666 less the umask), as a file the guest made would.
 */
/** Whether listSandboxes lists `s` for these filters: no state filter means all but destroyed. */
function listed(s: SandboxRec, states: readonly SandboxState[], labels: Record<string, string>, hostId: string): boolean {
  return (states.length ? states.includes(s.state) : s.state !== 'destroyed') && (!hostId || s.hostId === hostId) && Object.entries(labels).every(([k, v]) => s.labels[k] === v);
}

const PUT_IN_PLACE = [
  'p=$2',
  'if [ -d "$p" ]; then rm -f "$1"; echo "$p: is a directory" >&2; exit 1; fi',
  // From the link's directory: busybox's readlink -f resolves a dangling relative target
  // against the current directory.
  'if [ -L "$p" ]; then cd "${p%/*}/" && p=$(readlink -f "$p") || exit 1; fi',
  'if [ -e "$p" ]; then chown "$(stat -c %u:%g "$p")" "$1" || exit 1; fi',
  'if [ "$3" != 0 ]; then m=$3; elif [ -e "$p" ]; then m=$(stat -c %a "$p"); else m=$(printf %o $((0666 & ~0$(umask)))); fi',
  'chmod "$m" "$1" || exit 1',
  'exec mv -f "$1" "$p"',
].join('\n');

export class Fleet {
  constructor(private readonly deps: FleetDeps) {}

  /**
   * The operation a repeat of `key` answers with. A key names one request: used again for
   * another kind of operation or another target, it is refused (INVALID_ARGUMENT on the key)
   * rather than answered with an operation that did something else.
   */
  private async existingOp(tenantId: string, key: string, repeat: Repeat): Promise<OperationRec | undefined> {
    const opId = await this.deps.store.getIdempotent(tenantId, key);
    if (opId === undefined) return undefined;
    const op = (await this.deps.store.getOp(tenantId, opId))?.value;
    if (op && !isRepeatOf(op, repeat)) {
      throw new InvalidArgumentError('idempotency_key', `already used for another request (operation ${op.id}: ${op.kind.replace('_', ' ')} of ${op.targetId}); a different request needs a key of its own`);
    }
    // Operations recorded before requests had digests are compared by kind and target only.
    if (op && repeat.digest !== undefined && op.requestDigest !== undefined && op.requestDigest !== repeat.digest) {
      throw new InvalidArgumentError('idempotency_key', `already used for a ${op.kind.replace('_', ' ')} of ${op.targetId} that asked for something else (operation ${op.id}); a request with other parameters needs a key of its own`);
    }
    return op;
  }

  /**
   * A placement pinned to a host names one the fleet has and that takes new sandboxes: not
   * recorded lost, not cordoned, not draining. Placement would refuse every one of those, but
   * only after the operation (and a fork's child records) had been written and queued. A host
   * that merely has not been heard lately is let through: a replica that just started has
   * heard no host, and the leader decides on liveness when it places.
   */
  private async knownHost(placement: PlacementPrefs | undefined): Promise<void> {
    if (!placement?.hostId) return;
    const h = (await this.deps.store.getHost(placement.hostId))?.value;
    if (!h) throw new InvalidArgumentError('placement.host_id', `no host ${placement.hostId} in this fleet (ListHosts)`);
    if (h.state === 'lost') throw new WrongStateError('host', h.id, 'lost', 'pin a host that is up (ListHosts), or leave placement.host_id unset', 'placement.host_id');
    if (h.draining) throw new WrongStateError('host', h.id, 'draining', 'it takes no new sandboxes; pin another host or leave placement.host_id unset', 'placement.host_id');
    if (h.cordoned) throw new WrongStateError('host', h.id, 'cordoned', 'it takes no new sandboxes; uncordon it (CordonHost with cordon false) or pin another host', 'placement.host_id');
  }

  /** The hosts placement takes for a snapshot's holders: recorded, or saying so in their heartbeats (a fetch just ended). */
  private holdersOf(sn: SnapshotRec): string[] {
    return [...new Set([...sn.hostIds, ...this.deps.heard.holders(sn.id)])];
  }

  /**
   * A pinned host with a locality it can never meet: SAME_HOST on a host that does not hold
   * what the sandboxes start from, CROSS_HOST on one that does. Placement would refuse every
   * host, but only after the operation (and its records) had been written, and a live fork had
   * paused its source to take a snapshot first; and the failure said "no capacity", retryable.
   * `holdersOf`: the snapshot's holders as placement takes them (holdersOf), or a live
   * source's host (its snapshot is taken there); read only for a pin with a locality.
   */
  private pinnedLocality(placement: PlacementPrefs | undefined, holdersOf: () => readonly string[], of: string): void {
    if (!placement?.hostId || placement.locality === 'ANY') return;
    const holders = holdersOf();
    const holds = holders.includes(placement.hostId);
    if (placement.locality === 'SAME_HOST' && !holds) {
      throw new ForkfleetError('failed_precondition', `locality SAME_HOST with placement.host_id ${placement.hostId}: that host does not hold ${of} (${holders.length > 0 ? `held by ${holders.join(', ')}` : 'no host holds it'}); pin a host that does, or leave locality ANY`, { field: 'placement.locality' });
    }
    if (placement.locality === 'CROSS_HOST' && holds) {
      throw new ForkfleetError('failed_precondition', `locality CROSS_HOST with placement.host_id ${placement.hostId}: that host holds ${of}, and CROSS_HOST places only on hosts that do not; pin another host, or leave locality ANY`, { field: 'placement.locality' });
    }
  }

  /**
   * Records a pending operation under its idempotency key, with any records it creates,
   * in one transaction. A repeat of the key returns the first operation unchanged.
   * `checked`: the caller has just looked the key up (the transaction's guard on the key
   * still catches a repeat that raced it). `digest`: the request's (requestDigest), recorded.
   * `fence`: the leader's own operations (Executor.submitOwn) are written only while its
   * leadership holds (else NotLeaderError).
   */
  async submit(tenantId: string, key: string, kind: OperationKind, targetId: string, input: Record<string, unknown>, extra: StoreWrite[] = [], o: { checked?: boolean; digest?: string; fence?: LeaderFence } = {}): Promise<OperationRec> {
    const checked = o.checked ?? false;
    const repeat: Repeat = { kinds: [kind], targetId, ...(o.digest !== undefined ? { digest: o.digest } : {}) };
    const prior = checked ? undefined : await this.existingOp(tenantId, key, repeat);
    if (prior) return prior;
    const now = this.deps.clock.now();
    const op: OperationRec = {
      id: newId('op'),
      tenantId,
      kind,
      state: 'pending',
      createdAt: now,
      updatedAt: now,
      targetId,
      input,
      progress: { done: 0, total: 0, message: 'queued', bytesTransferred: 0 },
      result: null,
      error: null,
      steps: {},
      idempotencyKey: key,
      ...(o.digest !== undefined ? { requestDigest: o.digest } : {}),
    };
    const writes: StoreWrite[] = [{ kind: 'idem', tenantId, key, opId: op.id, expectRevision: 0 }, { kind: 'op', value: op, expectRevision: 0 }, ...extra];
    const ok = o.fence ? (await this.deps.store.commitAt(writes, o.fence)) > 0 : await this.deps.store.commit(writes);
    if (ok) return op;
    const raced = await this.existingOp(tenantId, key, repeat);
    if (raced) return raced;
    throw new ForkfleetError('aborted', 'concurrent change; retry', { retryable: true });
  }

  /**
   * Quota admission. Refused, a call whose key an earlier call committed meanwhile (a client's
   * retry racing its own first attempt, whose pending children the usage now counts) gets that
   * call's operation, not a refusal of work that is in fact running.
   */
  private async admitUnlessRepeated(tenantId: string, key: string, repeat: Repeat, need: Parameters<typeof admit>[2]): Promise<OperationRec | undefined> {
    try {
      await admit(this.deps, tenantId, need);
      return undefined;
    } catch (e) {
      const raced = await this.existingOp(tenantId, key, repeat).catch(() => undefined);
      if (raced) return raced;
      throw e;
    }
  }

  /**
   * Runs `fn` (an admission and the submit that records what it admitted) after the tenant's
   * earlier admissions on this replica have submitted, when the tenant has a sandbox or memory
   * quota. Each check then counts what the ones before it recorded (the ledger reads at etcd's
   * current revision), so concurrent creates and forks cannot all pass on the same usage and
   * overshoot the quota many times over; across replicas the overshoot is at most one request
   * per replica.
   */
  private inAdmissionOrder<T>(tenantId: string, fn: () => Promise<T>): Promise<T> {
    const quota = this.deps.quotas?.(tenantId);
    if (quota?.sandboxes === undefined && quota?.memoryMib === undefined) return fn();
    const run = (this.admitting.get(tenantId) ?? Promise.resolve()).then(fn);
    const tail = run.then(
      () => undefined,
      () => undefined,
    );
    this.admitting.set(tenantId, tail);
    void tail.then(() => {
      if (this.admitting.get(tenantId) === tail) this.admitting.delete(tenantId);
    });
    return run;
  }

  /** The last admission queued per tenant (inAdmissionOrder). */
  private readonly admitting = new Map<string, Promise<void>>();

  /** A hibernated sandbox holds no memory: waking it takes its memory again, within the quota (a waking one counts already). */
  private async admitWake(tenantId: string, sb: SandboxRec): Promise<void> {
    // Its own recorded wake (a second caller of a transparent wake, sharing the first's) is not
    // counted on top of what it asks for.
    if (sb.state === 'hibernated') await admit(this.deps, tenantId, { memoryMib: sb.resources.memoryMib }, sb.id);
  }

  async createSandbox(input: CreateInput): Promise<OperationRec> {
    const { tenantId: _tenant, idempotencyKey: _key, ...asked } = input;
    const digest = requestDigest(asked);
    const prior = await this.existingOp(input.tenantId, input.idempotencyKey, { kinds: ['create'], digest });
    if (prior) return prior;
    await this.knownHost(input.placement);
    // Refused here, as a fork of it is, rather than by a failed operation after the sandbox's records are written.
    const [sn, snRev] = input.snapshotId ? await this.readySnapshot(input.tenantId, input.snapshotId, 'restored') : [undefined, 0];
    if (sn) this.pinnedLocality(input.placement, () => this.holdersOf(sn), `snapshot ${sn.id}`);
    // The disk of the sandbox the snapshot was taken of, as a fork child inherits it (runFork):
    // copied into the snapshot's record, else from that sandbox's record if it is still there.
    const inheritedDiskMib = sn ? (sn.inherits?.resources.diskMib ?? (sn.sourceSandboxId ? (await this.deps.store.getSandbox(input.tenantId, sn.sourceSandboxId))?.value.resources.diskMib : undefined)) : undefined;
    const resources = sn ? restoredResources(sn, input.resources, input.resourcesSet, inheritedDiskMib) : input.resources;
    return this.inAdmissionOrder(input.tenantId, async () => {
      const raced = await this.admitUnlessRepeated(input.tenantId, input.idempotencyKey, { kinds: ['create'], digest }, { sandboxes: 1, memoryMib: resources.memoryMib });
      return raced ?? this.whileReady(input.tenantId, input.snapshotId, 'restored', snRev, (guard) => this.submitCreate(input, resources, digest, guard));
    });
  }

  private submitCreate(input: CreateInput, resources: SandboxRec['resources'], digest: string, guard: StoreWrite[]): Promise<OperationRec> {
    const id = newId('sb');
    const now = this.deps.clock.now();
    const sb: SandboxRec = {
      id,
      tenantId: input.tenantId,
      state: 'pending',
      stateReason: '',
      hostId: '',
      resources,
      image: input.image,
      sourceSnapshotId: input.snapshotId,
      lineageId: id,
      hostname: input.hostname || id,
      labels: input.labels,
      ttlMs: input.ttlMs,
      idleTimeoutMs: input.idleTimeoutMs ?? this.deps.defaultIdleTimeoutMs?.(input.tenantId) ?? null,
      afterResume: input.afterResume,
      allowEgress: input.allowEgress,
      allowCidrs: input.allowCidrs,
      createdAt: now,
      updatedAt: now,
      runningMsBefore: 0,
      runningSince: null,
      hibernationSnapshotId: '',
      opId: '',
    };
    return this.submit(input.tenantId, input.idempotencyKey, 'create', id, { placement: input.placement }, [{ kind: 'sandbox', value: sb, expectRevision: 0 }, ...guard], { checked: true, digest });
  }

  async forkSandbox(input: ForkInput): Promise<OperationRec> {
    // The source is the target (a hibernated sandbox's fork, rewritten below, keeps the digest).
    const { tenantId: _tenant, idempotencyKey: _key, snapshotId: _sn, sandboxId: _sb, hibernatedSandboxId: _hib, ...asked } = input;
    const digest = requestDigest(asked);
    const prior = await this.existingOp(input.tenantId, input.idempotencyKey, { kinds: ['fork'], targetId: input.snapshotId || input.sandboxId, digest });
    if (prior) return prior;
    await this.knownHost(input.placement);
    let lineageId: string;
    let inheritedHooks: HookRec[] | undefined;
    let snRev = 0;
    if (input.snapshotId) {
      const [sn, rev] = await this.readySnapshot(input.tenantId, input.snapshotId, 'forked');
      snRev = rev;
      this.pinnedLocality(input.placement, () => this.holdersOf(sn), `snapshot ${sn.id}`);
      lineageId = sn.lineageId;
      // The children inherit the hooks of the sandbox the snapshot was taken of (runFork):
      // counted here, so a fork too large for one transaction is refused now, not failed
      // after it was accepted.
      if (!input.afterResume) inheritedHooks = sn.inherits?.afterResume ?? (sn.sourceSandboxId ? (await this.deps.store.getSandbox(input.tenantId, sn.sourceSandboxId))?.value.afterResume : undefined);
    } else {
      const sb = await this.getSandbox(input.tenantId, input.sandboxId);
      // A hibernated sandbox is forked from its hibernation snapshot, without waking it.
      // (No snapshot is taken then, so snapshotRetention has nothing to apply to.)
      if (sb.state === 'hibernated' && sb.hibernationSnapshotId) {
        if (input.snapshotRetention) throw new ForkfleetError('failed_precondition', `sandbox ${sb.id} is hibernated: a fork of it starts from its hibernation snapshot ${sb.hibernationSnapshotId} and takes none, so snapshot_retention has nothing to apply to (set that snapshot's own with SetSnapshotRetention)`, { field: 'snapshot_retention' });
        return this.forkSandbox({ ...input, snapshotId: sb.hibernationSnapshotId, sandboxId: '', hibernatedSandboxId: sb.id });
      }
      if (sb.state !== 'running' && sb.state !== 'paused') throw new WrongStateError('sandbox', sb.id, sb.state, 'only a running or paused sandbox can be forked', 'sandbox_id');
      this.pinnedLocality(input.placement, () => [sb.hostId], `sandbox ${sb.id} (its snapshot is taken there)`);
      lineageId = sb.lineageId;
      inheritedHooks = sb.afterResume;
    }
    // Every child record carries the fork's labels and hooks, and all of them go into one
    // transaction (the leader checks again, with what it reads then, before it books anything).
    const perChild = sandboxRecordBytes({ labels: input.labels, afterResume: input.afterResume ?? inheritedHooks ?? [] });
    const fit = Math.floor(PLACEMENT_TXN_MAX_BYTES / perChild);
    if (input.count > fit) throw new InvalidArgumentError('count', `at most ${fit} children with these labels and after_resume hooks (~${perChild} bytes in each child's record; a fork writes all its children in one transaction of at most ${PLACEMENT_TXN_MAX_BYTES} bytes)`);
    return this.inAdmissionOrder(input.tenantId, async () => {
      const raced = await this.admitUnlessRepeated(input.tenantId, input.idempotencyKey, { kinds: ['fork'], targetId: input.snapshotId || input.sandboxId, digest }, forkNeed(this.deps.store, input.tenantId, input, input.count));
      return raced ?? this.whileReady(input.tenantId, input.snapshotId, 'forked', snRev, (guard) => this.submitFork(input, lineageId, digest, guard));
    });
  }

  /** A snapshot (not deleted) and its record's revision; refused unless ready. */
  private async readySnapshot(tenantId: string, id: string, what: 'forked' | 'restored'): Promise<[SnapshotRec, number]> {
    const v = await this.deps.store.getSnapshot(tenantId, id);
    if (!v || v.value.state === 'deleted') throw new NotFoundError('snapshot', id);
    if (v.value.state !== 'ready') throw new WrongStateError('snapshot', id, v.value.state, `only a ready snapshot can be ${what}`, 'snapshot_id');
    return [v.value, v.modRevision];
  }

  /**
   * A create or fork from a snapshot commits guarded by the snapshot record's revision it read
   * ready (`rev`): a delete (retention's, or a user's) marks it deleting and then looks for what
   * uses it, so a request committed before the mark is found (Executor.runDeleteSnapshot) and
   * one after it fails its guard here instead of being accepted and failing once placed. The
   * guard also fails on other changes of the record (a copy recorded, an expiry announced):
   * then the snapshot is read again, and the submit made again under its new revision while it
   * is ready, or refused saying why it no longer is. No snapshot: submitted unguarded.
   */
  private async whileReady(tenantId: string, snapshotId: string, what: 'forked' | 'restored', rev: number, submit: (guard: StoreWrite[]) => Promise<OperationRec>): Promise<OperationRec> {
    if (!snapshotId) return submit([]);
    for (let attempt = 1; ; attempt++) {
      try {
        return await submit([{ kind: 'check-snapshot', tenantId, id: snapshotId, expectRevision: rev }]);
      } catch (e) {
        if (!(e instanceof ForkfleetError) || e.kind !== 'aborted' || attempt >= 5) throw e;
        [, rev] = await this.readySnapshot(tenantId, snapshotId, what);
      }
    }
  }

  private submitFork(input: ForkInput, lineageId: string, digest: string, guard: StoreWrite[]): Promise<OperationRec> {
    const childIds = Array.from({ length: input.count }, () => newId('sb'));
    return this.submit(input.tenantId, input.idempotencyKey, 'fork', input.snapshotId || input.sandboxId, {
      snapshotId: input.snapshotId,
      sandboxId: input.sandboxId,
      count: input.count,
      childIds,
      lineageId,
      placement: input.placement,
      labels: input.labels,
      ttlMs: input.ttlMs,
      idleTimeoutMs: input.idleTimeoutMs,
      afterResume: input.afterResume,
      ...(input.hibernatedSandboxId ? { hibernatedSandboxId: input.hibernatedSandboxId } : {}),
      ...(input.sandboxId ? { snapshotRetention: input.snapshotRetention ?? { ttlMs: this.deps.forkSnapshotTtlMs || null, keepLast: 0 } } : {}),
    }, guard, { checked: true, digest });
  }

  /**
   * A sandbox operation: `kind` (or the kind `choose` picks from the sandbox's state) with the
   * states it may start from.
   */
  private async sandboxOp(kind: OperationKind, input: SandboxOpInput, allowed: readonly SandboxState[], extra: Record<string, unknown> = {}, choose?: (sb: SandboxRec) => [OperationKind, readonly SandboxState[]]): Promise<OperationRec> {
    // The key lookup and the sandbox read go to etcd together (one batched read, not two round trips).
    // A repeat of the key answers with its operation even when the sandbox is gone by now.
    const read = this.getSandbox(input.tenantId, input.sandboxId);
    read.catch(() => undefined);
    const { tenantId: _tenant, idempotencyKey: _key, sandboxId: _sb, ...asked } = input as SandboxOpInput & Record<string, unknown>;
    const digest = requestDigest(asked);
    const prior = await this.existingOp(input.tenantId, input.idempotencyKey, { kinds: kind === 'resume' ? ['resume', 'wake'] : [kind], targetId: input.sandboxId, digest });
    if (prior) return prior;
    const sb = await read;
    if (choose) [kind, allowed] = choose(sb);
    if (!allowed.includes(sb.state)) throw new WrongStateError('sandbox', sb.id, sb.state, `${kind} needs one of: ${allowed.join(', ')}`, 'sandbox_id');
    // A hibernate of a hibernated sandbox takes no snapshot (it copies the one it has to more
    // hosts, and copies count no stored bytes): a tenant at its snapshot_bytes quota may still
    // make them, e.g. before a host is removed.
    if (kind === 'snapshot' || (kind === 'hibernate' && sb.state !== 'hibernated')) await admit(this.deps, input.tenantId, { snapshot: true });
    const submitOp = (): Promise<OperationRec> => this.submit(input.tenantId, input.idempotencyKey, kind, sb.id, extra, [], { checked: true, digest });
    // A wake takes memory again: admitted in order with the tenant's other admissions, as a
    // create is (inAdmissionOrder), or concurrent wakes would all pass on the same usage. The
    // sandbox is read again once this call's turn comes: a wake queued ahead of it may have
    // started meanwhile (waking or running, its memory counted), and this one then joins it
    // (runWake) instead of asking for that memory a second time and being refused.
    let at = sb;
    const op = kind === 'wake' ? await this.inAdmissionOrder(input.tenantId, async () => (await this.admitWake(input.tenantId, (at = await this.getSandbox(input.tenantId, sb.id))), submitOp())) : await submitOp();
    this.readAtSubmit.set(op, at);
    return op;
  }

  /** The sandbox record a sandbox operation was submitted on, by the returned op object (see sandboxAtSubmit). */
  private readonly readAtSubmit = new WeakMap<OperationRec, SandboxRec>();

  /**
   * The target sandbox as read when `op` (an object this Fleet just returned) was submitted:
   * submitting does not write it, so the answer to the call can show it without a read.
   */
  sandboxAtSubmit(op: OperationRec): SandboxRec | undefined {
    return this.readAtSubmit.get(op);
  }

  pauseSandbox(input: SandboxOpInput): Promise<OperationRec> {
    return this.sandboxOp('pause', input, ['running', 'paused']);
  }
  resumeSandbox(input: SandboxOpInput): Promise<OperationRec> {
    // Resuming a hibernated sandbox is a wake: restore from its hibernation snapshot.
    return this.sandboxOp('resume', input, ['running', 'paused'], {}, (sb) => (sb.state === 'hibernated' || sb.state === 'waking' ? ['wake', ['hibernated', 'waking']] : ['resume', ['running', 'paused']]));
  }
  snapshotSandbox(input: SandboxOpInput & { pin: boolean; keepLast: number; retentionTtlMs: number | null; labels: Record<string, string> }): Promise<OperationRec> {
    return this.sandboxOp('snapshot', input, ['running', 'paused'], {
      snapshotId: newId('sn'),
      pin: input.pin,
      keepLast: input.keepLast,
      retentionTtlMs: input.retentionTtlMs,
      labels: input.labels,
    });
  }
  hibernateSandbox(input: SandboxOpInput & { replicas: number }): Promise<OperationRec> {
    return this.sandboxOp('hibernate', input, ['running', 'paused', 'hibernated'], { snapshotId: newId('sn'), replicas: input.replicas });
  }
  destroySandbox(input: SandboxOpInput): Promise<OperationRec> {
    // Any state: a destroy that arrives mid-hibernate or mid-wake runs when that ends.
    return this.sandboxOp('destroy', input, ['pending', 'starting', 'running', 'paused', 'hibernating', 'hibernated', 'waking', 'failed', 'lost', 'destroyed', 'destroying']);
  }

  async getSandbox(tenantId: string, id: string): Promise<SandboxRec> {
    const v = await this.deps.store.getSandbox(tenantId, id);
    if (!v) throw new NotFoundError('sandbox', id);
    return v.value;
  }

  /** The tenant's sandboxes (undefined: every tenant's) that match every filter given; no state filter means all but destroyed. */
  async listSandboxes(tenantId: string | undefined, states: SandboxState[], labels: Record<string, string>, hostId = ''): Promise<SandboxRec[]> {
    const all = (await this.deps.store.listSandboxes(tenantId)).map((v) => v.value);
    return all
      .filter((s) => listed(s, states, labels, hostId))
      .sort((a, b) => a.createdAt - b.createdAt || a.id.localeCompare(b.id));
  }

  /**
   * One page of listSandboxes for one tenant, in id order: up to `size` matching sandboxes with
   * ids after `afterId`, and whether more match. Read from the store a batch at a time from
   * `afterId` on (listSandboxesAfter), so a client paging through N sandboxes makes the store
   * read each about once: every page used to read the tenant's whole prefix (N^2 / size reads).
   */
  async listSandboxPage(tenantId: string, states: SandboxState[], labels: Record<string, string>, hostId: string, afterId: string, size: number): Promise<{ items: SandboxRec[]; more: boolean }> {
    const after = this.deps.store.listSandboxesAfter?.bind(this.deps.store);
    if (!after) {
      const all = (await this.listSandboxes(tenantId, states, labels, hostId)).sort((a, b) => (a.id < b.id ? -1 : a.id > b.id ? 1 : 0)).filter((s) => s.id > afterId);
      return { items: all.slice(0, size), more: all.length > size };
    }
    const items: SandboxRec[] = [];
    // One more than the page, to know whether another follows; batches no smaller than 256 keys.
    const batch = Math.max(256, size + 1);
    for (let from = afterId; ; ) {
      const { records, more } = await after(tenantId, from, batch);
      for (const r of records) {
        if (!listed(r.value, states, labels, hostId)) continue;
        if (items.length === size) return { items, more: true };
        items.push(r.value);
      }
      const last = records[records.length - 1];
      if (!more || !last) return { items, more: false };
      from = last.value.id;
    }
  }

  async getSnapshot(tenantId: string, id: string): Promise<SnapshotRec> {
    const v = await this.deps.store.getSnapshot(tenantId, id);
    if (!v || v.value.state === 'deleted') throw new NotFoundError('snapshot', id);
    return v.value;
  }

  async listSnapshots(tenantId: string, lineageId: string): Promise<SnapshotRec[]> {
    return (await this.deps.store.listSnapshots(tenantId))
      .map((v) => v.value)
      .filter((s) => s.state !== 'deleted' && (!lineageId || s.lineageId === lineageId))
      .sort((a, b) => a.createdAt - b.createdAt);
  }

  /** Read-modify-write of a snapshot record, guarded by its revision. */
  private async updateSnapshot(tenantId: string, id: string, mutate: (s: SnapshotRec) => void): Promise<SnapshotRec> {
    for (let i = 0; i < 10; i++) {
      const v: Versioned<SnapshotRec> | undefined = await this.deps.store.getSnapshot(tenantId, id);
      if (!v || v.value.state === 'deleted') throw new NotFoundError('snapshot', id);
      const next = structuredClone(v.value);
      mutate(next);
      if (await this.deps.store.commit([{ kind: 'snapshot', value: next, expectRevision: v.modRevision }])) return next;
    }
    throw new ForkfleetError('aborted', `snapshot ${id} is changing too often; retry`, { retryable: true });
  }

  pinSnapshot(tenantId: string, id: string, pinned: boolean): Promise<SnapshotRec> {
    return this.updateSnapshot(tenantId, id, (s) => {
      if (pinned && s.state === 'deleting') throw new WrongStateError('snapshot', id, 'deleting', 'it cannot be pinned any more', 'snapshot_id');
      s.pinned = pinned;
    });
  }

  /**
   * A new rule clears an expiry announced under the old one: the next retention pass
   * announces it again, with a full notice, if the new rule wants it gone too. The same rule
   * set again (a retry after a lost answer, a client that syncs its rules) changes nothing:
   * it cleared the expiry too, and one repeated within each notice period kept the snapshot
   * for good.
   */
  setRetention(tenantId: string, id: string, ttlMs: number | null, keepLast: number): Promise<SnapshotRec> {
    return this.updateSnapshot(tenantId, id, (s) => {
      // Being deleted: a rule would keep nothing (as a pin, refused), and a caller would read its
      // success as the snapshot kept.
      if (s.state === 'deleting') throw new WrongStateError('snapshot', id, 'deleting', 'a retention rule cannot keep it any more', 'snapshot_id');
      const same = s.retentionTtlMs === ttlMs && s.keepLast === keepLast;
      s.retentionTtlMs = ttlMs;
      s.keepLast = keepLast;
      if (s.state === 'ready' && !same) s.expiryDueAt = null;
    });
  }

  async deleteSnapshot(tenantId: string, key: string, id: string): Promise<OperationRec> {
    const prior = await this.existingOp(tenantId, key, { kinds: ['delete_snapshot'], targetId: id });
    if (prior) return prior;
    // Refused here, writing nothing, when it cannot be deleted as it is: the operation would
    // only fail, and while it marked the snapshot deleting, forks and restores of it would be
    // refused. (The operation checks again: these can change until it runs.)
    const sn = await this.getSnapshot(tenantId, id);
    if (sn.state === 'creating') throw new WrongStateError('snapshot', id, 'creating', 'delete it once it is ready or failed', 'snapshot_id');
    if (sn.pinned) throw new WrongStateError('snapshot', id, 'pinned', 'unpin it first', 'snapshot_id');
    if (sn.state === 'ready' || sn.state === 'failed') {
      const users = (await this.deps.store.listSandboxes(tenantId)).map((b) => b.value).filter((b) => snapshotsUsedBy(b).includes(id));
      if (users.length > 0) throw new WrongStateError('snapshot', id, 'in use', `sandboxes ${users.slice(0, 5).map((b) => b.id).join(', ')}${users.length > 5 ? ', ...' : ''} use it; destroy them first`, 'snapshot_id');
    }
    return this.submit(tenantId, key, 'delete_snapshot', id, {});
  }

  /**
   * The tenant's quotas and rate limit, and what counts against the quotas now (quota.ts). A
   * tenant without quotas has its records listed: asking the ledger would start its watch over
   * the whole fleet (quota-ledger.ts) on a replica that has no quota to check.
   */
  async tenantUsage(tenantId: string): Promise<{ usage: TenantUsage; quota: TenantQuota; rate: { perSecond: number; burst: number } | undefined }> {
    const quota = this.deps.quotas?.(tenantId) ?? {};
    const limited = quota.sandboxes !== undefined || quota.memoryMib !== undefined || quota.snapshotBytes !== undefined;
    return { usage: await tenantUsage({ store: this.deps.store, usage: limited ? this.deps.usage : undefined }, tenantId), quota, rate: this.deps.rateOf?.(tenantId) };
  }

  async getOperation(tenantId: string, id: string): Promise<OperationRec> {
    const v = await this.deps.store.getOp(tenantId, id);
    if (!v) throw new NotFoundError('operation', id);
    return v.value;
  }

  /**
   * CancelOperation: records that the op should stop, guarded by the revision read (the
   * leader's own writes re-read and keep it). The leader ends the op `cancelled` at its next
   * safe point (Executor: create, fork and drain have them; CANCELLABLE_KINDS).
   */
  async cancelOperation(tenantId: string, id: string): Promise<OperationRec> {
    for (let i = 0; i < 10; i++) {
      const v = await this.deps.store.getOp(tenantId, id);
      if (!v) throw new NotFoundError('operation', id);
      const op = v.value;
      if (op.state === 'cancelled' || (op.cancelRequested && !isTerminal(op.state))) return op;
      if (isTerminal(op.state)) throw new ForkfleetError('failed_precondition', `operation ${id} already ${op.state}: there is nothing to cancel`, { field: 'operation_id' });
      // Not "one host step": a hibernate pauses, snapshots and stops, and may copy replicas; a
      // wake, a snapshot delete and a destroy may take several steps too. Each step is bounded.
      if (!CANCELLABLE_KINDS.has(op.kind)) throw new ForkfleetError('failed_precondition', `a ${op.kind} operation cannot be cancelled (only create, fork and drain can): it ends on its own, each of its host steps bounded by the step timeout and attempts`, { field: 'operation_id' });
      const next: OperationRec = { ...structuredClone(op), cancelRequested: true, updatedAt: this.deps.clock.now() };
      next.progress.message = 'cancelling';
      if (await this.deps.store.commit([{ kind: 'op', value: next, expectRevision: v.modRevision }])) return next;
    }
    throw new ConflictError(`operation ${id}`);
  }

  /**
   * The tenant's operations (undefined: every tenant's; running, and finished ones until
   * retention deletes them) that match every filter given. A fork of a hibernated sandbox is
   * on its hibernation snapshot and on the sandbox the caller named (sandboxOfOp).
   */
  async listOperations(tenantId: string | undefined, filter: { states: OperationState[]; kinds: OperationKind[]; targetId: string }): Promise<OperationRec[]> {
    return (await this.deps.store.listOps({ activeOnly: false, ...(tenantId === undefined ? {} : { tenantId }) }))
      .map((v) => v.value)
      .filter((o) => (!filter.states.length || filter.states.includes(o.state)) && (!filter.kinds.length || filter.kinds.includes(o.kind)) && (!filter.targetId || o.targetId === filter.targetId || sandboxOfOp(o) === filter.targetId));
  }

  /** Waiters per `<tenant>/<op id>`: woken by the op watch, with the record, when that op is written terminal. */
  private readonly opWaiters = new Map<string, Set<(op?: OperationRec) => void>>();
  /** One watch over the op records, started by the first waitOperation (shared by all waiters). */
  private opWatch: Promise<unknown> | undefined;

  private watchTerminalOps(): Promise<unknown> {
    if (this.opWatch) return this.opWatch;
    const watch: Promise<() => void> = this.deps.store
      .watchOps(
        (op) => {
          if (!isTerminal(op.state)) return;
          for (const wake of this.opWaiters.get(`${op.tenantId}/${op.id}`) ?? []) wake(op);
        },
        {
          only: (tenantId, id) => this.opWaiters.has(`${tenantId}/${id}`),
          // Broken off by etcd: the waits go on polling (at most 1 s) and the next one watches again.
          onError: () => {
            if (this.opWatch === watch) this.opWatch = undefined;
            void watch.then((stop) => stop(), () => undefined);
          },
        },
      )
      .catch((e: unknown) => {
        if (this.opWatch === watch) this.opWatch = undefined; // the next wait tries again; this one polls
        throw e;
      });
    this.opWatch = watch;
    return watch;
  }

  /**
   * Returns when the operation is terminal or `timeoutMs` passes (then in its current state).
   * A watch on the op records wakes the wait the moment the op is written terminal, with the
   * record it saw: a terminal record is never written again, so that is the answer, without
   * another read. Without the watch (it failed to start) the wait polls with backoff, as a
   * fallback it also keeps at 1 s.
   */
  async waitOperation(tenantId: string, id: string, timeoutMs: number, signal?: AbortSignal): Promise<OperationRec> {
    const until = this.deps.clock.now() + timeoutMs;
    const key = `${tenantId}/${id}`;
    let wake: (op?: OperationRec) => void = () => undefined;
    let disarm: () => void = () => undefined;
    // Registered before each read, so a terminal write between the read and the wait is not missed.
    const arm = (): Promise<OperationRec | undefined> =>
      new Promise<OperationRec | undefined>((r) => {
        const wakers = this.opWaiters.get(key) ?? new Set<(op?: OperationRec) => void>();
        this.opWaiters.set(key, wakers);
        wakers.add(r);
        wake = r;
        disarm = () => {
          wakers.delete(r);
          if (wakers.size === 0 && this.opWaiters.get(key) === wakers) this.opWaiters.delete(key);
        };
      });
    try {
      // The watch exists before the first read: every later write reaches it.
      const watching = await this.watchTerminalOps().then(
        () => true,
        () => false,
      );
      let delay = 5;
      for (;;) {
        const woken = arm();
        const op = await this.getOperation(tenantId, id);
        if (isTerminal(op.state) || this.deps.clock.now() >= until || signal?.aborted) return op;
        const wait = Math.min(watching ? 1000 : delay, Math.max(1, until - this.deps.clock.now()));
        let timer: ReturnType<typeof setTimeout> | undefined;
        const onAbort = (): void => wake();
        signal?.addEventListener('abort', onAbort, { once: true });
        const seen = await Promise.race([woken, new Promise<undefined>((r) => (timer = setTimeout(() => r(undefined), wait)))]);
        clearTimeout(timer);
        signal?.removeEventListener('abort', onAbort);
        disarm();
        if (seen && isTerminal(seen.state)) return seen;
        delay = Math.min(delay * 2, 100);
      }
    } finally {
      disarm();
    }
  }

  /**
   * Refuses now a sandbox runningSandbox would refuse once it has been given what to write
   * (WriteFile holds up to 64 MiB first): one that is not running and will not be by a wake
   * (paused, destroyed, failed, lost, starting, hibernating with no operation to wait for), or
   * a hibernated one whose wake the tenant's memory quota refuses. A state it may leave
   * meanwhile is decided again when the data is in.
   */
  async checkWritable(tenantId: string, id: string, field: string): Promise<void> {
    const sb = await this.getSandbox(tenantId, id);
    if (sb.state === 'hibernated') await this.admitWake(tenantId, sb);
    else if (sb.state !== 'running' && sb.state !== 'waking' && !(sb.state === 'hibernating' && sb.opId)) throw notRunning(id, sb.state, field);
  }

  /**
   * The sandbox, running. A hibernated one is woken first, transparently: concurrent calls
   * share one wake operation (its idempotency key names the hibernation snapshot), so the
   * caller only sees a slower first call. One still hibernating (its idle timeout just fired)
   * is waited for, then woken. The caller's `signal` ends the waits (CANCELLED).
   * `field`: what a refusal names (WriteFile's sandbox id is in its header).
   */
  private async runningSandbox(tenantId: string, id: string, signal?: AbortSignal, field = 'sandbox_id'): Promise<SandboxRec> {
    const cancelled = (): ForkfleetError => new ForkfleetError('cancelled', `the call was cancelled while sandbox ${id} was being woken`);
    let sb = await this.getSandbox(tenantId, id);
    if (sb.state === 'hibernating' && sb.opId) {
      await this.waitOperation(tenantId, sb.opId, 300_000, signal);
      if (signal?.aborted) throw cancelled();
      sb = await this.getSandbox(tenantId, id);
      if (sb.state === 'hibernating') throw new ForkfleetError('unavailable', `sandbox ${id} is still being hibernated; retry`, { retryable: true });
    }
    if (sb.state === 'hibernated' || sb.state === 'waking') {
      // While waking, the record names the wake in progress; while hibernated, the key is
      // stable (updatedAt does not change until a wake starts), so racing callers share it.
      const asleep = sb;
      // Admitted in order with the tenant's other admissions (inAdmissionOrder), as sandboxOp's wake.
      const opId = asleep.state === 'waking' && asleep.opId ? asleep.opId : await this.inAdmissionOrder(tenantId, () => this.sharedWake(tenantId, asleep));
      if (opId !== undefined) {
        const done = await this.waitOperation(tenantId, opId, 300_000, signal);
        if (signal?.aborted) throw cancelled();
        if (done.state !== 'succeeded') throw wakeFailure(id, done, field);
      }
      sb = await this.getSandbox(tenantId, id);
    }
    if (sb.state !== 'running' || !sb.hostId) throw notRunning(id, sb.state, field);
    return sb;
  }

  /**
   * After sandbox `before`'s host refused a call of it before any of it ran, its VM not running
   * (vmNotRunning). A hibernate (the idle rule's, a drain's) can take the sandbox between
   * runningSandbox's read and the call's arrival, its pause reaching the host first (the idle
   * check cannot count a call not there yet). The same call made a moment later waits for the
   * hibernate and wakes the sandbox: so does this one, once (`resend`), through runningSandbox,
   * which returns the sandbox running for the call to be sent again. The sandbox recorded
   * hibernating, hibernated, waking, or running since (a hibernate that failed, or a wake
   * elsewhere) is resent; refused again after that: UNAVAILABLE, retryable, nothing of the call
   * having run. Still recorded as it was read: held by an operation other than a pause (a
   * drain moving it pauses its VM for the move while the record says running; a resume's step
   * runs it again), or refused for a while only (the host says `unavailable`: a snapshot under
   * way), UNAVAILABLE, retryable, as it passes; otherwise its record has not caught up with its
   * VM (a pause holding it, whose step paused the VM, or a VM gone from its host, being
   * recorded): undefined, the host's refusal is the answer, as before (FAILED_PRECONDITION
   * naming sandbox_id). Recorded paused (by its owner, or by a hibernate that could not resume
   * it), or stopped otherwise, it is runningSandbox's refusal (FAILED_PRECONDITION).
   */
  private async afterRefusal(tenantId: string, before: SandboxRec, refusal: { kind: string; message: string }, signal: AbortSignal | undefined, field: string, resend: boolean): Promise<SandboxRec | undefined> {
    const sb = await this.getSandbox(tenantId, before.id);
    const taken = sb.state === 'hibernating' || sb.state === 'hibernated' || sb.state === 'waking' || (sb.state === 'running' && sb.updatedAt !== before.updatedAt);
    if (taken && resend) return this.runningSandbox(tenantId, before.id, signal, field);
    // Held by its owner's pause (its record is under the sandbox's tenant; a drain's is not):
    // it does not pass, it ends paused. Read only on this rare path.
    const pausing = sb.state === 'running' && sb.opId !== '' && refusal.kind !== 'unavailable' && (await this.deps.store.getOp(tenantId, sb.opId))?.value.kind === 'pause';
    const passes = sb.state === 'running' && ((sb.opId !== '' && !pausing) || refusal.kind === 'unavailable');
    if (taken || passes) throw new ForkfleetError('unavailable', `sandbox ${before.id} was not running when the call reached its host (${refusal.message})${sb.opId ? `, held by operation ${sb.opId}` : ''}; none of it ran: retry`, { retryable: true });
    if (sb.state === 'running') return undefined;
    throw notRunning(before.id, sb.state, field);
  }

  /**
   * `call` on the sandbox running (runningSandbox), made once more on it (afterRefusal) when
   * its host refused its first host request because the VM was not running: `call` is told
   * each answer (`answered`), and a refusal after one is not repeated (a part of it ran).
   */
  private async onRunning<T>(tenantId: string, id: string, signal: AbortSignal | undefined, field: string, call: (sb: SandboxRec, answered: () => void) => Promise<T>): Promise<T> {
    let sb = await this.runningSandbox(tenantId, id, signal, field);
    for (let resend = true; ; resend = false) {
      let answered = false;
      try {
        return await call(sb, () => (answered = true));
      } catch (e) {
        if (answered || !(e instanceof ForkfleetError) || !vmNotRunning(e)) throw e;
        sb = (await this.afterRefusal(tenantId, sb, e, signal, field, resend)) ?? throwIt(e);
      }
    }
  }

  /**
   * The wake runningSandbox waits for, for a call that read sandbox `asleep` hibernated (run
   * in its turn among the tenant's admissions). A call queued behind another that woke it
   * finds that wake, by its key, or the sandbox waking or running by now, its memory counted:
   * admitted again, it asked for that memory on top and was refused (RESOURCE_EXHAUSTED) for
   * a wake that takes nothing more. Only a sandbox still hibernated is admitted. Undefined:
   * no wake to wait for (woken by other means; the caller's state check decides).
   */
  private async sharedWake(tenantId: string, asleep: SandboxRec): Promise<string | undefined> {
    const key = `__wake/${asleep.id}/${asleep.updatedAt}`;
    const [prior, now] = await Promise.all([this.existingOp(tenantId, key, { kinds: ['wake'], targetId: asleep.id }), this.getSandbox(tenantId, asleep.id)]);
    if (prior) return prior.id;
    if (now.state === 'waking' && now.opId) return now.opId;
    if (now.state !== 'hibernated' && now.state !== 'waking') return undefined;
    await this.admitWake(tenantId, now);
    // The key looked up above, unless the sandbox has changed since (woken and hibernated again).
    return (await this.submit(tenantId, `__wake/${now.id}/${now.updatedAt}`, 'wake', now.id, {}, [], { checked: now.updatedAt === asleep.updatedAt })).id;
  }

  async *exec(input: ExecInput, signal?: AbortSignal): AsyncIterable<HostExecOutputMsg> {
    const req = create(HostExecRequestSchema, {
      sandboxId: input.sandboxId,
      argv: input.argv,
      env: input.env,
      cwd: input.cwd,
      stdin: input.stdin,
      timeout: { seconds: BigInt(Math.floor(input.timeoutMs / 1000)), nanos: (input.timeoutMs % 1000) * 1e6 },
    });
    // The request travels as one NATS message: checked before a hibernated sandbox is woken for it.
    const size = toBinary(HostExecRequestSchema, req).length;
    const max = this.deps.bus.maxPayload - RELAY_HEADROOM;
    if (size > max) {
      // Named after the part that takes the most room.
      const parts: Array<[string, number]> = [
        ['stdin', input.stdin.length],
        ['argv', input.argv.reduce((n, a) => n + Buffer.byteLength(a), 0)],
        ['env', Object.entries(input.env).reduce((n, [k, v]) => n + Buffer.byteLength(k) + Buffer.byteLength(v), 0)],
      ];
      const [field] = parts.reduce((a, b) => (b[1] > a[1] ? b : a));
      throw new InvalidArgumentError(field, `the exec request (stdin ${parts[0]![1]}, argv ${parts[1]![1]}, env ${parts[2]![1]} bytes) is ${size} bytes; at most ${max} fit this fleet's relay (NATS max_payload): pass large inputs with WriteFile`);
    }
    let sb = await this.runningSandbox(input.tenantId, input.sandboxId, signal);
    for (let resend = true; ; resend = false) {
      // Gone while the sandbox was woken: the command is not sent at all.
      if (signal?.aborted) throw new ForkfleetError('cancelled', 'exec cancelled before it was sent');
      let first = true;
      let refused: { piece: HostExecOutputMsg; kind: string; message: string } | undefined;
      for await (const m of this.deps.bus.exec(sb.hostId, req, { timeoutMs: input.timeoutMs + 10_000, owner: input.tenantId, ...(signal ? { signal } : {}) })) {
        // Refused before the command started, its VM not running (the host's last message): sent again once woken (afterRefusal).
        if (first && m.payload.case === 'error' && vmNotRunning(m.payload.value)) {
          refused = { piece: m, kind: m.payload.value.kind, message: m.payload.value.message };
          break;
        }
        first = false;
        // The VM went away under a running command (its guest connection dropped): a drain
        // moving it, or a hibernate, says so, rather than an error that reads as a lost host.
        if (m.payload.case === 'error' && m.payload.value.kind === 'unavailable') {
          // At most 3 s of reads (etcd3 retries a store that does not answer for ~40 s): the
          // host's own error then, unexplained, rather than held back.
          const why = await Promise.race([this.whyVmWentAway(input.tenantId, sb).catch(() => undefined), new Promise<undefined>((r) => setTimeout(() => r(undefined), 3000).unref())]);
          if (why) {
            // A destroyed sandbox's: no retry runs the command again (failed_precondition, final).
            yield create(HostExecOutputSchema, { payload: { case: 'error', value: { ...m.payload.value, ...(why.destroyed ? { kind: 'failed_precondition', retryable: false } : {}), message: `${why.message} (${m.payload.value.message})` } } });
            continue;
          }
        }
        yield m;
      }
      if (!refused) return;
      const woken = await this.afterRefusal(input.tenantId, sb, refused, signal, 'sandbox_id', resend);
      // The record has not moved: the host's refusal is the answer.
      if (!woken) {
        yield refused.piece;
        return;
      }
      sb = woken;
    }
  }

  /**
   * Why sandbox `sb` (as it was when a command was sent to it) no longer has its VM on that
   * host, when an operation took it, said for the command's caller: moved to another host or
   * hibernated, or being so (the command may go on, its output lost), or destroyed (a TTL, a
   * destroy call: the command ended with it, `destroyed`). Else undefined (its host or guest
   * failed: the host's error says what it saw).
   */
  private async whyVmWentAway(tenantId: string, sb: SandboxRec): Promise<{ message: string; destroyed?: true } | undefined> {
    const now = (await this.deps.store.getSandbox(tenantId, sb.id))?.value;
    if (!now) return undefined;
    const goesOn = (what: string): { message: string } => ({ message: `${what} while the command ran: it may go on in the sandbox, but its output and exit status are lost` });
    if (now.state === 'destroying' || now.state === 'destroyed') return { message: `sandbox ${sb.id} was destroyed${now.stateReason ? ` (${now.stateReason})` : ''} while the command ran: the command ended with it`, destroyed: true };
    if (now.hostId !== sb.hostId && now.hostId !== '' && (now.state === 'running' || now.state === 'paused')) return goesOn(`sandbox ${sb.id} was moved from host ${sb.hostId} to ${now.hostId}`);
    if (now.state === 'hibernating' || now.state === 'hibernated') return goesOn(`sandbox ${sb.id} was hibernated`);
    if (now.opId === '') return undefined;
    const op = (await this.deps.store.getOp(tenantId, now.opId))?.value ?? (await this.deps.store.getOp(DRAIN_TENANT, now.opId))?.value;
    if (op?.kind === 'drain') return goesOn(`sandbox ${sb.id} is being moved off host ${sb.hostId} by drain ${op.id}`);
    if (op?.kind === 'hibernate') return goesOn(`sandbox ${sb.id} is being hibernated by operation ${op.id}`);
    return undefined;
  }

  /** Bytes of file data per relayed request or answer: what fits a NATS message (at most 512 KiB). */
  private filePiece(): number {
    return Math.max(4096, Math.min(FILE_PIECE_MAX, this.deps.bus.maxPayload - RELAY_HEADROOM));
  }

  /** One relayed file request; the host's error, if any, is thrown. `answered`: told of its success (onRunning). */
  private async fileCall(hostId: string, req: Parameters<WorkBus['file']>[1], answered?: () => void): Promise<Awaited<ReturnType<WorkBus['file']>>> {
    const res = await this.deps.bus.file(hostId, req, { timeoutMs: 30_000 });
    // The guest's refusal of the path (or the mode) names it as the API does: WriteFile's are in its header.
    const field = (res.error?.field === 'path' || res.error?.field === 'mode' || res.error?.field === 'sandbox_id') && req.op.case === 'write' ? `header.${res.error.field}` : res.error?.field;
    // The host's word on whether trying again can help (a full guest disk cannot) is kept.
    if (res.error) throw new RelayedHostError(res.error.kind, res.error.message, { ...(field ? { field } : {}), retryable: res.error.retryable });
    answered?.();
    return res;
  }

  /**
   * A host whose agent predates ranged files (no Heartbeat.ranged_files) gets one message per
   * file. A host this replica has not heard yet (it just started, or the host's heartbeats do
   * not reach it) is not taken for one: its call is UNAVAILABLE, to be retried.
   */
  private ranged(hostId: string): boolean {
    const heard = this.deps.heard.get(hostId);
    if (!heard) throw new ForkfleetError('unavailable', `host ${hostId} has not been heard from by this scheduler yet; retry shortly`, { retryable: true });
    return heard.hb.rangedFiles === true;
  }

  /**
   * Writes the file: one piece that fits the relay straight to the path; more into a temporary
   * file next to it (made 0600 first, then written piece by piece), which a guest script
   * (PUT_IN_PLACE) then renames over `path` with the owner and mode it should have (`mode`, 0:
   * the old file's, or the guest's default). So a failure part-way of a large file (a full
   * guest disk, a lost relay) leaves the old file as it was, and the temporary file is removed
   * (best effort). An agent without ranged files gets one piece, written straight to the path.
   *
   * `signal`: the call's (cancelled, past its deadline, its credential revoked): a wake it
   * waits for goes on, but nothing is written once it aborts (and a part written is removed).
   */
  async writeFile(tenantId: string, sandboxId: string, path: string, mode: number, data: Uint8Array, signal?: AbortSignal): Promise<number> {
    return this.onRunning(tenantId, sandboxId, signal, 'header.sandbox_id', (sb, answered) => this.writeTo(sb, path, mode, data, answered, signal));
  }

  /** writeFile's, on sandbox `sb` running; `answered`: told of each host request answered (onRunning). */
  private async writeTo(sb: SandboxRec, path: string, mode: number, data: Uint8Array, answered: () => void, signal?: AbortSignal): Promise<number> {
    const sandboxId = sb.id;
    const gone = (): void => throwIfEnded(signal, `the call ended before ${path} was written`);
    gone();
    const piece = this.filePiece();
    if (!this.ranged(sb.hostId)) {
      // An older agent truncates on every write and ignores append; `mode` is sent all the same.
      if (data.length > piece) throw new ForkfleetError('failed_precondition', `host ${sb.hostId} runs an agent without ranged file transfer: files over ${piece} bytes need it upgraded`, { field: 'data' });
      return Number((await this.fileCall(sb.hostId, create(HostFileRequestSchema, { sandboxId, path, op: { case: 'write', value: { data, mode } } }), answered)).bytesWritten);
    }
    const write = async (to: string, part: Uint8Array, append: boolean, pieceMode: number): Promise<number> =>
      Number((await this.fileCall(sb.hostId, create(HostFileRequestSchema, { sandboxId, path: to, op: { case: 'write', value: { data: part, mode: pieceMode, append } } }), answered)).bytesWritten);
    // One piece is written in place (the guest agent's open and write; the file keeps its
    // owner, and its mode unless one is given; a write that fails part-way leaves it partial).
    // Staged like larger ones, it sat in a temporary file that the guest agent makes 0666 until
    // renamed over the path, and special files (/proc, /sys, a bind-mounted file) could not be
    // written at all.
    if (data.length <= piece) return write(path, data, false, mode);
    const slash = path.lastIndexOf('/');
    // WRITE_STAGING_NAME_BYTES (adapters/grpc/convert.ts) longer than the file's own name.
    const tmp = `${path.slice(0, slash + 1)}.${path.slice(slash + 1)}.ff-write-${randomBytes(6).toString('hex')}`;
    let written = 0;
    try {
      // Made 0600 (and new: set -C) before any byte goes in: it may be a secret, uploaded over
      // seconds, and the guest agent would make it 0666. PUT_IN_PLACE sets its mode at the end.
      await this.guestCommand(sb.hostId, sandboxId, ['/bin/sh', '-c', 'umask 077 && set -C && : > "$1"', 'ff-stage', tmp], 'header.path', answered);
      for (let off = 0; off < data.length; off += piece) {
        gone();
        written += await write(tmp, data.subarray(off, off + piece), off > 0, 0);
      }
      gone();
      await this.guestCommand(sb.hostId, sandboxId, ['/bin/sh', '-c', PUT_IN_PLACE, 'ff-put', tmp, path, mode.toString(8)], 'header.path', answered);
    } catch (e) {
      await this.guestCommand(sb.hostId, sandboxId, ['/bin/rm', '-f', tmp], 'header.path').catch(() => undefined);
      // A failure in the temporary file is reported against the path the caller named.
      if (e instanceof ForkfleetError && e.field === 'header.path') throw new ForkfleetError(e.kind, e.message.split(tmp).join(path), { field: 'header.path', retryable: e.retryable });
      throw e;
    }
    return written;
  }

  /** Runs a short command in the guest through the exec relay; a non-zero exit is a failed_precondition naming `field`. `answered`: told of its success (onRunning). */
  private async guestCommand(hostId: string, sandboxId: string, argv: string[], field: string, answered?: () => void): Promise<void> {
    const req = create(HostExecRequestSchema, { sandboxId, argv, env: {}, cwd: '', stdin: new Uint8Array(), timeout: { seconds: 30n, nanos: 0 } });
    let stderr = '';
    for await (const m of this.deps.bus.exec(hostId, req, { timeoutMs: 40_000 })) {
      if (m.payload.case === 'stderr') stderr += Buffer.from(m.payload.value).toString('utf8');
      else if (m.payload.case === 'error') throw new RelayedHostError(m.payload.value.kind, m.payload.value.message, { retryable: m.payload.value.retryable });
      else if (m.payload.case === 'exit') {
        if (m.payload.value.exitCode !== 0 || m.payload.value.timedOut) throw new ForkfleetError('failed_precondition', `${argv[0]} in the guest failed (exit ${m.payload.value.exitCode}${m.payload.value.timedOut ? ', timed out' : ''}): ${stderr.trim()}`, { field });
        answered?.();
        return;
      }
    }
    throw new ForkfleetError('unavailable', `${argv[0]} in the guest: the relay ended without its exit`, { retryable: true });
  }

  /**
   * Reads up to `maxBytes` of the file in ranged pieces that fit the relay, until its end.
   * `whole`: the caller asked for the whole file (max_bytes 0),
   * and `maxBytes` is the server's limit: a longer file is refused, not cut short. `hold` is
   * told of each piece before it is kept (it may refuse by throwing).
   */
  /** `signal`: the call's; once it aborts no further piece is read. */
  async readFile(tenantId: string, sandboxId: string, path: string, maxBytes: number, whole = false, hold: (bytes: number) => void = () => undefined, signal?: AbortSignal): Promise<Uint8Array> {
    return this.onRunning(tenantId, sandboxId, signal, 'sandbox_id', (sb, answered) => this.readFrom(sb, path, maxBytes, whole, hold, answered, signal));
  }

  /** readFile's, on sandbox `sb` running; `answered`: told of each host request answered (onRunning). */
  private async readFrom(sb: SandboxRec, path: string, maxBytes: number, whole: boolean, hold: (bytes: number) => void, answered: () => void, signal?: AbortSignal): Promise<Uint8Array> {
    const sandboxId = sb.id;
    const gone = (): void => throwIfEnded(signal, `the call ended while ${path} was read`);
    const piece = this.filePiece();
    if (!this.ranged(sb.hostId)) {
      // An older agent ignores the offset: one request, capped so that its answer fits.
      const want = Math.min(piece, maxBytes);
      const data = (await this.fileCall(sb.hostId, create(HostFileRequestSchema, { sandboxId, path, op: { case: 'read', value: { maxBytes: BigInt(want) } } }), answered)).data;
      if (data.length === want && want < maxBytes) throw new ForkfleetError('failed_precondition', `host ${sb.hostId} runs an agent without ranged file transfer: files over ${piece} bytes need it upgraded`, { field: 'max_bytes' });
      hold(data.length);
      return data;
    }
    const parts: Uint8Array[] = [];
    let got = 0;
    let ended = false;
    while (got < maxBytes) {
      gone();
      const want = Math.min(piece, maxBytes - got);
      const res = await this.fileCall(sb.hostId, create(HostFileRequestSchema, { sandboxId, path, op: { case: 'read', value: { maxBytes: BigInt(want), offset: BigInt(got) } } }), answered);
      hold(res.data.length);
      parts.push(res.data);
      got += res.data.length;
      if (res.eof || res.data.length < want) {
        ended = true;
        break;
      }
    }
    if (whole && !ended) {
      // The limit reached with no end of file seen: one byte more says whether there is more.
      const more = await this.fileCall(sb.hostId, create(HostFileRequestSchema, { sandboxId, path, op: { case: 'read', value: { maxBytes: 1n, offset: BigInt(got) } } }), answered);
      if (more.data.length > 0) throw new ForkfleetError('failed_precondition', `${path} is larger than the ${maxBytes} bytes a ReadFile returns; read a part of it with max_bytes, or split it in the sandbox first`, { field: 'max_bytes' });
    }
    return parts.length === 1 ? parts[0]! : Buffer.concat(parts);
  }

  async listHosts(states: HostRec['state'][]): Promise<HostListing[]> {
    const [hosts, allocs] = await Promise.all([this.deps.store.listHosts(), this.deps.store.listAllocs()]);
    const allocMap = new Map(allocs.map((a) => [a.value.hostId, a.value]));
    const now = this.deps.clock.now();
    return hosts
      .map((h) => {
        const heard = this.deps.heard.get(h.value.id);
        const live = heard
          ? {
              state: livenessOf(heard.heardAt, now, this.deps.liveness),
              snapshotCount: heard.hb.snapshots.filter((s) => s.complete).length,
              lastHeartbeatAt: heard.heardAt,
              memoryUsedBytes: Number(heard.hb.memoryUsedBytes),
              chunkStoreBytes: Number(heard.hb.chunkStoreBytes),
            }
          : undefined;
        return { host: h.value, alloc: allocMap.get(h.value.id), live };
      })
      .filter((h) => states.length === 0 || states.includes(h.live?.state ?? h.host.state))
      .sort((a, b) => a.host.id.localeCompare(b.host.id));
  }

  async cordonHost(hostId: string, cordon: boolean): Promise<HostListing> {
    for (let i = 0; i < 10; i++) {
      const v = await this.deps.store.getHost(hostId);
      if (!v) throw new NotFoundError('host', hostId);
      const next = { ...v.value, cordoned: cordon, draining: cordon ? v.value.draining : false };
      if (await this.deps.store.commit([{ kind: 'host', value: next, expectRevision: v.modRevision }])) {
        const [listing] = (await this.listHosts([])).filter((h) => h.host.id === hostId);
        return listing ?? { host: next, alloc: undefined, live: undefined };
      }
    }
    throw new ForkfleetError('aborted', `host ${hostId} is changing too often; retry`, { retryable: true });
  }

  /**
   * Removes a lost host (decommissioning): its record and alloc in one transaction guarded by
   * the revisions read, then its work queue on NATS. Refused while the host is heard from or
   * recorded as anything but lost, and while a sandbox on it is in a state other than lost,
   * destroyed or failed (drain it first). Lost sandboxes stay lost and can be restored
   * elsewhere; their count is returned. The leader, seeing the records go, forgets the host;
   * if its agent starts again it registers as a new host.
   */
  async removeHost(hostId: string): Promise<{ lostSandboxes: number }> {
    // The host record changes while the leader marks the host lost: re-read and check again.
    for (let attempt = 0; attempt < 5; attempt++) {
      const v = await this.deps.store.getHost(hostId);
      if (!v) throw new NotFoundError('host', hostId);
      const heard = this.deps.heard.get(hostId);
      const live = heard ? livenessOf(heard.heardAt, this.deps.clock.now(), this.deps.liveness) : 'lost';
      if (v.value.state !== 'lost' || live !== 'lost') {
        throw new WrongStateError('host', hostId, live !== 'lost' ? `${live} (heard ${Math.round((this.deps.clock.now() - (heard?.heardAt ?? 0)) / 1000)} s ago)` : v.value.state, 'drain it, stop its agent, and remove it once it is lost', 'host_id');
      }
      const on = (await this.deps.store.listSandboxes(undefined)).map((x) => x.value).filter((sb) => sb.hostId === hostId);
      // A hibernated sandbox needs its snapshot, not the host: one that another live host
      // holds a copy of (a drain without migrate makes that copy) wakes there. A copy on a
      // host that is itself lost (or removed) is no copy.
      const alive = (h: string): boolean => h !== hostId && livenessOf(this.deps.heard.get(h)?.heardAt, this.deps.clock.now(), this.deps.liveness) !== 'lost';
      const busy: SandboxRec[] = [];
      for (const sb of on) {
        if (REMOVABLE_WITH.has(sb.state)) continue;
        if (sb.state === 'hibernated' && sb.hibernationSnapshotId && (await this.deps.store.getSnapshot(sb.tenantId, sb.hibernationSnapshotId))?.value.hostIds.some(alive)) continue;
        busy.push(sb);
      }
      if (busy.length > 0) {
        const hibernated = busy.some((sb) => sb.state === 'hibernated');
        throw new WrongStateError('host', hostId, `still recorded with ${busy.length} sandbox(es) (${busy.slice(0, 3).map((sb) => `${sb.id} ${sb.state}`).join(', ')})`, hibernated ? 'drain it (without --migrate) while its agent runs, so its hibernated sandboxes\' snapshots are copied to another host, or wake or destroy them; wait for the others to end' : 'wait until they are lost or destroyed', 'host_id');
      }
      const alloc = await this.deps.store.getAlloc(hostId);
      const writes: StoreWrite[] = [{ kind: 'delete-host', id: hostId, expectRevision: v.modRevision }];
      if (alloc.modRevision > 0) writes.push({ kind: 'delete-alloc', hostId, expectRevision: alloc.modRevision });
      if (!(await this.deps.store.commit(writes))) continue;
      // After the commit: a removal that loses its race must not cut a host off its queue.
      // If this fails, the leader deletes the queue when it sees the record go; an agent
      // that is in fact still running creates its queue again (agent-bus.ts).
      await this.deps.bus.forgetHost(hostId).catch(() => undefined);
      return { lostSandboxes: on.filter((sb) => sb.state === 'lost').length };
    }
    throw new ConflictError(`host ${hostId}`);
  }

  async drainHost(key: string, hostId: string, migrate: boolean): Promise<OperationRec> {
    const digest = requestDigest({ migrate });
    const prior = await this.existingOp(DRAIN_TENANT, key, { kinds: ['drain'], targetId: hostId, digest });
    if (prior) return prior;
    // The cordon and the drain op commit together: a crash between them cannot leave a host
    // cordoned with nothing draining it. A conflict (the host record changed) re-reads.
    for (let i = 0; i < 10; i++) {
      const v = await this.deps.store.getHost(hostId);
      if (!v) throw new NotFoundError('host', hostId);
      const cordon: StoreWrite = { kind: 'host', value: { ...v.value, cordoned: true }, expectRevision: v.modRevision };
      try {
        return await this.submit(DRAIN_TENANT, key, 'drain', hostId, { migrate }, [cordon], { checked: true, digest });
      } catch (e) {
        if (!(e instanceof ForkfleetError && e.kind === 'aborted')) throw e;
      }
    }
    throw new ForkfleetError('aborted', `host ${hostId} is changing too often; retry`, { retryable: true });
  }
}
