// The Forkfleet TypeScript SDK: a typed, promise-based wrapper over the public gRPC API
// (proto/forkfleet/v1/fleet.proto). Generated protobuf types stop here: callers see plain
// objects with string states, numbers instead of bigints, and async iterators for streams.
//
//   const ff = new Forkfleet({ address: '127.0.0.1:17700' });   // TLS; token and CA from FF_TOKEN / FF_CA or the fleet's credentials.json
//   const sb = await ff.create({ image: 'tiny' });
//   for await (const chunk of sb.exec(['sh', '-c', 'echo hi; exit 3'])) {   // lazy: runs when iterated
//     if (chunk.stream === 'exit') console.log('exit', chunk.exitCode);     // the last chunk: no data
//     else process.stdout.write(chunk.data);                               // stdout / stderr, live
//   }
//   const { stdout } = await sb.run(['uname', '-a']);
//   const kids = await sb.fork(8);
//   await Promise.all(kids.map((k) => k.destroy()));
//
// Retries: only errors the server marks retryable (RpcError.retryable) are retried, with
// exponential backoff and full jitter. A mutating call generates its idempotency key once
// and reuses it on every attempt, so a retry never does the work twice.
import { randomUUID } from 'node:crypto';
import { createClient } from '../adapters/grpc/rpc.ts';
import { fleetChannelCredentials, fleetChannelOptions } from '../adapters/grpc/tls.ts';
import { resolveClientCredentials } from '../auth/client-credentials.ts';
import type { CallOptions as RpcCallOptions, Client } from '../adapters/grpc/rpc.ts';
import { RpcError } from '../adapters/grpc/status.ts';
import { ForkfleetError, InvalidArgumentError } from '../../proto/errors.ts';
import type { ErrorKind } from '../../proto/errors.ts';
import { EventType, FleetService, HostState, OperationKind, OperationState, OperationStepState, SandboxState, SnapshotState } from '../../proto/gen/forkfleet/v1/fleet_pb.ts';
import type {
  Event as PbEvent,
  Host as PbHost,
  Operation as PbOperation,
  Sandbox as PbSandbox,
  Snapshot as PbSnapshot,
} from '../../proto/gen/forkfleet/v1/fleet_pb.ts';
import { Locality, Spread } from '../../proto/gen/forkfleet/v1/common_pb.ts';

export { RpcError, ForkfleetError };
export type { ErrorKind };

type FleetClient = Client<(typeof FleetService)['method']>;

// ---------------------------------------------------------------- plain data types

/** What list() can filter by. */
export const SANDBOX_STATES = ['pending', 'starting', 'running', 'paused', 'hibernating', 'hibernated', 'waking', 'destroying', 'destroyed', 'failed', 'lost'] as const;
export type SandboxStateName = (typeof SANDBOX_STATES)[number] | 'unspecified';
export type SnapshotStateName = 'creating' | 'ready' | 'deleting' | 'deleted' | 'failed' | 'unspecified';
export type OperationStateName = (typeof OPERATION_STATES)[number] | 'unspecified';
/** What listOperations can filter by. */
export const OPERATION_STATES = ['pending', 'running', 'succeeded', 'failed', 'cancelled'] as const;
export const OPERATION_KINDS = ['create', 'pause', 'resume', 'hibernate', 'wake', 'snapshot', 'fork', 'destroy', 'delete_snapshot', 'drain'] as const;
export type OperationKindName = (typeof OPERATION_KINDS)[number];
export type HostStateName = 'ready' | 'suspect' | 'lost' | 'unspecified';

export interface ResourcesInfo {
  vcpus: number;
  memoryMib: number;
  diskMib: number;
}

export interface SandboxInfo {
  id: string;
  tenantId: string;
  state: SandboxStateName;
  stateReason: string;
  hostId: string;
  image: string;
  sourceSnapshotId: string;
  lineageId: string;
  hostname: string;
  labels: Record<string, string>;
  resources: ResourcesInfo;
  createdAt: string | undefined;
  updatedAt: string | undefined;
  hibernationSnapshotId: string;
  /** Its lifecycle: TTL (of running time) and idle timeout, ms; null when it has none. */
  ttlMs: number | null;
  idleTimeoutMs: number | null;
  /** Running time so far (what the TTL counts), ms. */
  runningMs: number;
}

export interface SnapshotInfo {
  id: string;
  tenantId: string;
  state: SnapshotStateName;
  sourceSandboxId: string;
  parentSnapshotId: string;
  lineageId: string;
  createdAt: string | undefined;
  /** When retention deletes it; unset when it is pinned, has no retention, or is out of its TTL but still in use (deleted, after a notice, once unused). */
  expiresAt: string | undefined;
  pinned: boolean;
  /** Its retention rule: a TTL (ms) and keep_last (0: none). */
  retention: { ttlMs: number | undefined; keepLast: number };
  logicalBytes: number;
  storedBytes: number;
  hostIds: string[];
  labels: Record<string, string>;
}

export interface HostInfo {
  id: string;
  state: HostStateName;
  cordoned: boolean;
  draining: boolean;
  capacity: ResourcesInfo;
  allocated: ResourcesInfo;
  sandboxCount: number;
  snapshotCount: number;
  accel: 'kvm' | 'tcg' | 'unspecified';
  peerAddress: string;
  lastHeartbeat: string | undefined;
  linkBytesPerSecond: number;
}

/** A tenant's quotas and rate limit, and what counts against the quotas now (GetTenantUsage). */
export interface UsageInfo {
  tenantId: string;
  sandboxes: number;
  memoryMib: number;
  snapshotBytes: number;
  /** Unset: no limit. */
  quota: { sandboxes?: number; memoryMib?: number; snapshotBytes?: number };
  /** Calls per second and burst; 0: no limit. */
  ratePerSecond: number;
  rateBurst: number;
}

export interface ProgressInfo {
  done: number;
  total: number;
  message: string;
  bytesTransferred: number;
}

/** One host step of an operation: what a host was asked to do, when, and how long it took there. */
export interface OperationStepInfo {
  stepId: string;
  hostId: string;
  /** HostWork kind, e.g. 'restore_vms', 'snapshot_vm', 'create_vm'. */
  action: string;
  state: 'running' | 'succeeded' | 'failed' | 'unspecified';
  attempt: number;
  /** Unset for a step an earlier scheduler leader sent. */
  sentAt: string | undefined;
  finishedAt: string | undefined;
  /** As the host measured it; undefined until it answered. */
  hostMs: number | undefined;
  /** The source VM's pause (snapshot of a running sandbox). */
  pauseMs: number | undefined;
  bytesFetched: number;
  restoredByMigration: boolean;
}

export interface OperationInfo {
  id: string;
  tenantId: string;
  kind: string;
  state: OperationStateName;
  targetId: string;
  progress: ProgressInfo;
  createdAt: string | undefined;
  updatedAt: string | undefined;
  error: { kind: string; message: string; field: string; retryable: boolean } | undefined;
  /** A cancelOperation call asked it to stop (it ends `cancelled` at its next safe point, or ended otherwise). */
  cancelRequested: boolean;
  /** Its host steps, in the order they were sent: complete once it has ended (while it runs, as of its last progress write). */
  steps: OperationStepInfo[];
  /** Ended steps left out of `steps` (the earliest first) in an operation with very many. */
  stepsOmitted: number;
  sandbox?: SandboxInfo;
  snapshot?: SnapshotInfo;
  fork?: { snapshotId: string; children: SandboxInfo[]; summary: string };
}

export interface EventInfo {
  revision: number;
  type: string;
  tenantId: string;
  time: string | undefined;
  sandboxId: string;
  snapshotId: string;
  hostId: string;
  operationId: string;
  sandboxState: SandboxStateName;
  message: string;
}

export type ExecChunk = { stream: 'stdout' | 'stderr'; data: Uint8Array } | { stream: 'exit'; exitCode: number; signal: number; timedOut: boolean; durationMs: number; outputTruncated: boolean };

// ---------------------------------------------------------------- errors

/** A long-running operation ended FAILED or CANCELLED. Carries the server's error info. */
export class OperationFailedError extends ForkfleetError {
  readonly operation: OperationInfo;
  constructor(op: OperationInfo) {
    const kind = (op.error?.kind || 'internal') as ErrorKind;
    const field = op.error?.field || undefined;
    super(kind, `operation ${op.id} (${op.kind}) ${op.state}: ${op.error?.message ?? 'no reason given'}`, { retryable: op.error?.retryable ?? false, ...(field ? { field } : {}) });
    this.operation = op;
  }
}

// ---------------------------------------------------------------- conversion

const lower = (s: string | undefined): string => (s ?? 'UNSPECIFIED').toLowerCase();
/** The proto enum value of a lower-case name (`field` names the filter when the name is unknown). */
function enumValue<E extends Record<string, string | number>>(e: E, name: string, field: string): number {
  const v = e[name.toUpperCase() as keyof E];
  if (typeof v !== 'number' || v === 0) throw new ForkfleetError('invalid_argument', `${field}: unknown value ${JSON.stringify(name)}`, { field });
  return v;
}
const num = (v: bigint | number | undefined): number => Number(v ?? 0);
const ts = (t: { seconds: bigint; nanos: number } | undefined): string | undefined => (t ? new Date(Number(t.seconds) * 1000 + Math.floor(t.nanos / 1e6)).toISOString() : undefined);
const res = (r: { vcpus: number; memoryMib: bigint; diskMib: bigint } | undefined): ResourcesInfo => ({ vcpus: r?.vcpus ?? 0, memoryMib: num(r?.memoryMib), diskMib: num(r?.diskMib) });
const msOf = (d: { seconds: bigint; nanos: number } | undefined): number | null => (d ? Number(d.seconds) * 1000 + Math.floor(d.nanos / 1e6) : null);

function toSandbox(s: PbSandbox): SandboxInfo {
  return {
    id: s.id,
    tenantId: s.tenantId,
    state: lower(SandboxState[s.state]) as SandboxStateName,
    stateReason: s.stateReason,
    hostId: s.hostId,
    image: s.image,
    sourceSnapshotId: s.sourceSnapshotId,
    lineageId: s.lineageId,
    hostname: s.hostname,
    labels: { ...s.labels },
    resources: res(s.resources),
    createdAt: ts(s.createdAt),
    updatedAt: ts(s.updatedAt),
    hibernationSnapshotId: s.hibernationSnapshotId,
    ttlMs: msOf(s.lifecycle?.ttl),
    idleTimeoutMs: msOf(s.lifecycle?.idleTimeout),
    runningMs: msOf(s.runningTime) ?? 0,
  };
}

function toSnapshot(s: PbSnapshot): SnapshotInfo {
  return {
    id: s.id,
    tenantId: s.tenantId,
    state: lower(SnapshotState[s.state]) as SnapshotStateName,
    sourceSandboxId: s.sourceSandboxId,
    parentSnapshotId: s.parentSnapshotId,
    lineageId: s.lineageId,
    createdAt: ts(s.createdAt),
    expiresAt: ts(s.expiresAt),
    pinned: s.pinned,
    retention: { ttlMs: s.retention?.ttl ? Number(s.retention.ttl.seconds) * 1000 + Math.floor(s.retention.ttl.nanos / 1e6) : undefined, keepLast: s.retention?.keepLast ?? 0 },
    logicalBytes: num(s.logicalBytes),
    storedBytes: num(s.storedBytes),
    hostIds: [...s.hostIds],
    labels: { ...s.labels },
  };
}

function toHost(h: PbHost): HostInfo {
  return {
    id: h.id,
    state: lower(HostState[h.state]) as HostStateName,
    cordoned: h.cordoned,
    draining: h.draining,
    capacity: res(h.capacity),
    allocated: res(h.allocated),
    sandboxCount: h.sandboxCount,
    snapshotCount: h.snapshotCount,
    accel: h.accel === 1 ? 'kvm' : h.accel === 2 ? 'tcg' : 'unspecified',
    peerAddress: h.peerAddress,
    lastHeartbeat: ts(h.lastHeartbeat),
    linkBytesPerSecond: num(h.linkBytesPerSecond),
  };
}

function toOperation(o: PbOperation): OperationInfo {
  const out: OperationInfo = {
    id: o.id,
    tenantId: o.tenantId,
    kind: lower(OperationKind[o.kind]),
    state: lower(OperationState[o.state]) as OperationStateName,
    targetId: o.targetId,
    progress: { done: o.progress?.done ?? 0, total: o.progress?.total ?? 0, message: o.progress?.message ?? '', bytesTransferred: num(o.progress?.bytesTransferred) },
    createdAt: ts(o.createdAt),
    updatedAt: ts(o.updatedAt),
    error: o.error ? { kind: o.error.kind, message: o.error.message, field: o.error.field, retryable: o.error.retryable } : undefined,
    cancelRequested: o.cancelRequested,
    steps: o.steps.map((st) => ({
      stepId: st.stepId,
      hostId: st.hostId,
      action: st.action,
      state: lower(OperationStepState[st.state]) as OperationStepInfo['state'],
      attempt: st.attempt,
      sentAt: ts(st.sentAt),
      finishedAt: ts(st.finishedAt),
      hostMs: msOf(st.hostDuration) ?? undefined,
      pauseMs: msOf(st.pause) ?? undefined,
      bytesFetched: num(st.bytesFetched),
      restoredByMigration: st.restoredByMigration,
    })),
    stepsOmitted: o.stepsOmitted,
  };
  if (o.result.case === 'sandbox') out.sandbox = toSandbox(o.result.value);
  else if (o.result.case === 'snapshot') out.snapshot = toSnapshot(o.result.value);
  else if (o.result.case === 'fork') out.fork = { snapshotId: o.result.value.snapshotId, children: o.result.value.children.map(toSandbox), summary: o.result.value.explanation?.summary ?? '' };
  return out;
}

/** A watch stream up at least this long before it broke was working: its break starts the retries afresh. */
const WATCH_HEALTHY_MS = 10_000;

function toEvent(e: PbEvent): EventInfo {
  return {
    revision: num(e.revision),
    type: lower(EventType[e.type]),
    tenantId: e.tenantId,
    time: ts(e.time),
    sandboxId: e.sandboxId,
    snapshotId: e.snapshotId,
    hostId: e.hostId,
    operationId: e.operationId,
    sandboxState: lower(SandboxState[e.sandboxState]) as SandboxStateName,
    message: e.message,
  };
}

/**
 * An Exec error after which the command cannot have run: a retryable error the scheduler
 * answered itself, or a call grpc-js could not get to any scheduler.
 */
export function execNeverStarted(e: unknown): boolean {
  if (!(e instanceof RpcError)) return false;
  if (e.answered) return e.retryable && e.kind !== 'cancelled';
  // No connection to any scheduler: refused, unreachable, or its name does not resolve.
  return e.kind === 'unavailable' && /No connection established|Name resolution failed/i.test(e.message);
}

/** Errors worth another attempt: the server marked them retryable (a cancel is not). */
const retryable = (e: unknown): boolean => e instanceof ForkfleetError && e.retryable && e.kind !== 'cancelled';

/** The tenant's rate limit refused the call (RateLimitedError on the server): it succeeds once the bucket has refilled. */
const rateLimited = (e: unknown): boolean => e instanceof ForkfleetError && e.retryable && e.kind === 'resource_exhausted' && e.field === 'rate';

/**
 * Refusals that pass once other calls end, none of them this call's fault: the rate limit, and
 * the scheduler's bounds on what it holds at once (file bytes: `data`, `max_bytes`; streams
 * per credential: `streams`). Many calls at once (a file written to 64 children) meet them
 * as a matter of course, and each gets through in turn within RATE_LIMIT_WAIT_MS.
 */
const BUSY_FIELDS: ReadonlySet<string> = new Set(['rate', 'data', 'max_bytes', 'streams']);
const heldBack = (e: unknown): boolean => e instanceof ForkfleetError && e.retryable && e.kind === 'resource_exhausted' && BUSY_FIELDS.has(e.field ?? '');

/**
 * How long the server said to wait before a retry, ms (0: it said nothing). A scheduler that
 * sends no ff-retry-after-ms says it only in a rate limit's message ("retry in N ms").
 */
export function retryAfterOf(e: unknown): number {
  if (e instanceof RpcError && e.retryAfterMs !== undefined) return e.retryAfterMs;
  const m = rateLimited(e) ? /retry in (\d+(?:\.\d+)?) ms/.exec((e as Error).message) : null;
  return m ? Number(m[1]) : 0;
}

/**
 * A stream the scheduler reset (RST_STREAM ENHANCE_YOUR_CALM, which grpc-js reports as
 * RESOURCE_EXHAUSTED with none of our metadata): one whose client took none of its messages
 * for a minute (rpc.ts STREAM_STALL_MS; a process paused, or its event loop blocked). A watch
 * resumes from its own revision, as after the in-band RESOURCE_EXHAUSTED it could not read.
 */
const streamReset = (e: unknown): boolean => e instanceof RpcError && !e.answered && e.kind === 'resource_exhausted';
/**
 * This client's own deadline ran out before any answer: the request may or may not have
 * reached the scheduler. Worth another attempt when it carries an idempotency key (the
 * scheduler does the work once), never otherwise.
 */
const unansweredDeadline = (e: unknown): boolean => e instanceof RpcError && !e.answered && e.kind === 'deadline_exceeded';

/**
 * No scheduler could be reached (the call never got an answer: connection refused or reset,
 * e.g. while one restarts), as opposed to one that answered UNAVAILABLE. A failed TLS handshake
 * is left out: waiting does not mend a wrong CA.
 */
const unreachable = (e: unknown): boolean => e instanceof RpcError && !e.answered && e.kind === 'unavailable' && !/certificate|ssl|tls|altname|handshake/i.test(e.message);

/** `floorMs` plus a random share of a window that doubles with `n` (from `baseMs`, at most `maxMs`): full jitter. */
function fullJitterMs(floorMs: number, baseMs: number, maxMs: number, n: number): number {
  return floorMs + Math.random() * Math.min(maxMs, baseMs * 2 ** Math.min(30, n));
}

/**
 * One call's retries: how long to wait before asking again, or that it is time to give up.
 * Ordinary retryable errors get `attempts`; three kinds of trouble get a time allowance
 * instead (RetryOptions): a scheduler that answers UNAVAILABLE (outageWaitMs), none reachable
 * (unreachableWaitMs), and a refusal by the rate limit or one of the scheduler's bounds
 * (heldBack: rateLimitWaitMs, counting the wait ahead). A spell of such trouble is one, whichever
 * of the three kinds come and in whatever order (a scheduler restarting is unreachable, then
 * answers UNAVAILABLE, then unreachable again): its allowance runs from its first error, the
 * largest of those of the kinds seen in it, and its backoff grows throughout. A spell ends
 * only with another error (an ordinary one, which counts against `attempts`, so spells cannot
 * follow one another without end): the next spell gets its whole allowance, and does not use
 * up the attempts of the conflict (ABORTED) that may come between. An allowance of 0 makes its
 * kind count against `attempts`. Backoff is exponential with full jitter, plus the wait the
 * server named.
 */
class Backoff {
  private spell: { since: number; n: number; allowanceMs: number } | undefined;
  private failures = 0;

  constructor(private readonly o: Readonly<RetryOptions>) {}

  /** The ms to wait after `e` before asking again; undefined once its allowance (or the attempts) is spent. Call only for errors worth retrying. */
  next(e: unknown, now = Date.now()): number | undefined {
    const o = this.o;
    const kind =
      o.outageWaitMs > 0 && e instanceof RpcError && e.answered && e.kind === 'unavailable' ? 'outage' : o.unreachableWaitMs > 0 && unreachable(e) ? 'unreachable' : o.rateLimitWaitMs > 0 && heldBack(e) ? 'limited' : undefined;
    if (kind) {
      const allowanceMs = kind === 'outage' ? o.outageWaitMs : kind === 'unreachable' ? o.unreachableWaitMs : o.rateLimitWaitMs;
      this.spell = this.spell ? { since: this.spell.since, n: this.spell.n + 1, allowanceMs: Math.max(this.spell.allowanceMs, allowanceMs) } : { since: now, n: 1, allowanceMs };
    } else {
      this.spell = undefined;
      this.failures++;
    }
    const ms = fullJitterMs(retryAfterOf(e), o.baseMs, o.maxMs, (this.spell?.n ?? this.failures) - 1);
    const sp = this.spell;
    // A refusal counts the wait ahead (the server named it: asking sooner is refused again).
    const spent = !sp ? this.failures >= o.attempts : kind === 'limited' ? now + ms - sp.since > sp.allowanceMs : now - sp.since >= sp.allowanceMs;
    return spent ? undefined : ms;
  }

  /** Starts over (a stream that stayed up a while: the breaks before it no longer count). */
  reset(): void {
    this.spell = undefined;
    this.failures = 0;
  }
}

/** What an error of a call that submitted an operation names (submit): its key, and its operation once accepted. */
const submittedBy = new WeakMap<object, { key: string; opId?: string }>();

/**
 * The operation an error of `wait` (or of a call that submitted one and then waited) is
 * about: it was accepted and may still be running, so follow it (`operation(id)`, `wait(id)`)
 * rather than submitting the work again. Undefined when no operation had been accepted.
 */
export function operationIdOf(e: unknown): string | undefined {
  return typeof e === 'object' && e !== null ? submittedBy.get(e)?.opId : undefined;
}

/**
 * The idempotency key a failed mutating call (create, fork, pause, ...) was sent with, also
 * when no answer came before it ended (its `signal` aborted, its deadline passed, the
 * scheduler could not be reached): the scheduler may have accepted it. Submitting the same
 * call again with `{ idempotencyKey }` answers that operation if it was accepted (then follow
 * or cancel it: `operation(id)`, `cancelOperation(id)`) and submits it otherwise.
 */
export function idempotencyKeyOf(e: unknown): string | undefined {
  return typeof e === 'object' && e !== null ? submittedBy.get(e)?.key : undefined;
}

/**
 * A thrown value this call's ids can be attached to: an abort's reason may be a string or a
 * number, and an object reason is the signal's, shared by every call it aborts (64 forks
 * under one episode's signal): each call gets an error of its own, the reason as its cause.
 */
function asError(e: unknown, signal: AbortSignal | undefined): object {
  const shared = signal?.aborted === true && e === signal.reason;
  if (typeof e === 'object' && e !== null && !shared) return e;
  return new ForkfleetError('cancelled', `cancelled: ${e instanceof Error ? e.message : String(e)}`, { cause: e });
}

/**
 * How long a call is asked again while the scheduler answers UNAVAILABLE (retry), and how long
 * `wait` keeps polling through nothing but retryable errors, before either gives up.
 */
export const WAIT_OUTAGE_MS = 60_000;

/**
 * How long a call is asked again while no scheduler can be reached at all (connection refused
 * or reset: a scheduler restarting opens its port only once it has its etcd and NATS), past
 * `attempts`. A TLS failure (a wrong CA, an expired certificate) is no restart: it gets
 * `attempts` only.
 */
export const WAIT_UNREACHABLE_MS = 30_000;

/**
 * How long a call refused by the tenant's rate limit (or held back by a bound of the
 * scheduler's, see heldBack) is asked again (each time after the wait the server names),
 * past `attempts`: many calls at once (64 destroys under a rate of 10/s, a file written to 64
 * children) all get through in turn rather than most failing after a few seconds of backoff.
 */
export const RATE_LIMIT_WAIT_MS = 60_000;

/**
 * A protobuf Duration from milliseconds, whole nanoseconds (1.005 s is 1 s + 5,000,000 ns,
 * not 4,999,999.999...: a fraction fails to encode, and grpc-js would report that as INTERNAL).
 * A negative or non-finite value is refused, naming `field`.
 */
export function durationOf(ms: number, field = 'duration'): { seconds: bigint; nanos: number } {
  if (!Number.isFinite(ms) || ms < 0) throw new ForkfleetError('invalid_argument', `${field}: want a duration of 0 or more, got ${ms}`, { field });
  const ns = BigInt(Math.round(ms * 1e6));
  return { seconds: ns / 1_000_000_000n, nanos: Number(ns % 1_000_000_000n) };
}

/** Parses '10s', '500ms', '2m', '1h', '0' or a number of milliseconds. */
export function parseDuration(v: string | number, field = 'duration'): number {
  if (typeof v === 'number') return v;
  if (v.trim() === '0') return 0;
  const m = /^(\d+(?:\.\d+)?)(ms|s|m|h)$/.exec(v.trim());
  if (!m) throw new ForkfleetError('invalid_argument', `${field}: want a duration like 500ms, 10s, 2m or 1h, got ${JSON.stringify(v)}`, { field });
  return Number(m[1]) * { ms: 1, s: 1000, m: 60_000, h: 3_600_000 }[m[2] as 'ms' | 's' | 'm' | 'h'];
}

/**
 * A whole-number option (`undefined`: 0, the field's default) checked before it is sent: a
 * fraction, NaN or a negative number from JavaScript would fail to encode (grpc-js reports that
 * as INTERNAL, naming nothing) or be wrapped. Refused naming `field`.
 */
function wholeIn(v: number | undefined, field: string, max = Number.MAX_SAFE_INTEGER): number {
  if (v === undefined) return 0;
  if (typeof v !== 'number' || !Number.isInteger(v) || v < 0 || v > max) throw new InvalidArgumentError(field, `want a whole number from 0 to ${max}, got ${typeof v === 'number' ? v : JSON.stringify(v)}`);
  return v;
}
const UINT32_MAX = 0xffff_ffff;

/** A duration option (`'90s'` or ms) as a protobuf Duration; a bad one is refused naming `field`. */
function durationIn(v: string | number, field: string): { seconds: bigint; nanos: number } {
  return durationOf(parseDuration(v, field), field);
}

// ---------------------------------------------------------------- options

export interface RetryOptions {
  /** Total attempts, first included. Default 5. */
  attempts: number;
  /** First backoff, doubled each attempt, with full jitter. Default 200 ms. */
  baseMs: number;
  /** Longest backoff. Default 5000 ms. */
  maxMs: number;
  /**
   * How long a call the tenant's rate limit refuses (or a bound of the scheduler's holds back:
   * file bytes, streams per credential) is asked again, past `attempts`. Default
   * RATE_LIMIT_WAIT_MS; 0: as often as `attempts` allows (a client that must fail fast).
   */
  rateLimitWaitMs: number;
  /**
   * How long a call is asked again, past `attempts`, while the scheduler answers UNAVAILABLE
   * (its etcd or NATS is away). Default WAIT_OUTAGE_MS; 0: as often as `attempts` allows.
   */
  outageWaitMs: number;
  /**
   * How long a call is asked again, past `attempts`, while no scheduler can be reached (e.g.
   * one restarting). Default WAIT_UNREACHABLE_MS; 0: as often as `attempts` allows.
   */
  unreachableWaitMs: number;
}

const RETRY_DEFAULTS: Readonly<RetryOptions> = { attempts: 5, baseMs: 200, maxMs: 5000, rateLimitWaitMs: RATE_LIMIT_WAIT_MS, outageWaitMs: WAIT_OUTAGE_MS, unreachableWaitMs: WAIT_UNREACHABLE_MS };

/**
 * `retry` merged field by field over the defaults: a field given as undefined (usual without
 * exactOptionalPropertyTypes) keeps its default instead of making the retries endless or the
 * backoff NaN. A bad value is refused naming it.
 */
function retryOptions(r: Partial<RetryOptions> = {}): Readonly<RetryOptions> {
  const out = { ...RETRY_DEFAULTS };
  for (const k of Object.keys(RETRY_DEFAULTS) as Array<keyof RetryOptions>) {
    const v: unknown = r[k];
    if (v === undefined) continue;
    const ok = typeof v === 'number' && Number.isFinite(v) && (k === 'attempts' ? Number.isInteger(v) && v >= 1 : v >= 0);
    if (!ok) throw new ForkfleetError('invalid_argument', `retry.${k}: want ${k === 'attempts' ? 'a whole number of 1 or more' : 'a finite number of ms, 0 or more'}, got ${typeof v === 'number' ? v : JSON.stringify(v)}`, { field: `retry.${k}` });
    out[k] = v as number;
  }
  return Object.freeze(out);
}

export interface ForkfleetOptions {
  /**
   * host:port of a scheduler replica, or several (an array, or comma-separated; the client
   * fails over between them). Several must be IP literals of one family, '10.0.0.1:17700' or
   * '[fd00::1]:17700' (a host name in a list is refused): for names, give one name that
   * resolves to every scheduler.
   */
  address: string | string[];
  /**
   * Default FF_TENANT, else the credentials file's tenant, else '' (the credential's own
   * tenant: the server resolves it). Only admin credentials may name another tenant.
   */
  tenant?: string;
  /**
   * Bearer token. Default: a credentials file named on purpose (credentialsFile, FF_CREDENTIALS),
   * else FF_TOKEN, else the local fleet's credentials file (services/auth/client-credentials.ts).
   */
  token?: string;
  /** CA certificate to trust: a PEM file path or PEM text. Default as `token` (FF_CA in FF_TOKEN's place), else the system roots. */
  ca?: string | Buffer;
  /** JSON credentials file ({token, ca, tenant}). Default FF_CREDENTIALS, else <FF_FLEET_DIR or /var/lib/ffleet>/credentials.json. */
  credentialsFile?: string;
  /** Per-attempt deadline of unary calls. Default 30 s. */
  timeoutMs?: number;
  retry?: Partial<RetryOptions>;
}

export interface CallOpts {
  signal?: AbortSignal;
  /** Per-attempt deadline; for operations, how long to wait for them to finish (default 10 min). */
  timeoutMs?: number;
  /**
   * When the whole call must be over, its retries included (`timeoutMs` is per attempt, and
   * a scheduler that answers UNAVAILABLE is asked again for up to WAIT_OUTAGE_MS): each
   * attempt's deadline is cut to it, no retry waits past it, and a wait for an operation ends at it.
   */
  deadline?: Date;
  /** Reuse a key of your own, e.g. to make a whole script restartable. */
  idempotencyKey?: string;
  /**
   * Called whenever the operation's progress is polled: about once a second. Without it the
   * wait long-polls in 30 s windows (one call per 30 s instead of one per second): leave it
   * out when nothing shows the progress.
   */
  onProgress?: (op: OperationInfo) => void;
  /**
   * Called once the fleet has accepted the operation, before the wait for it: its id, to
   * follow (`operation(id)`, `wait(id)`) or cancel (`cancelOperation(id)`) it if the wait is
   * abandoned (the process interrupted). An error it throws is ignored.
   */
  onAccepted?: (op: OperationInfo) => void;
}

export interface CreateOptions {
  image?: string;
  snapshotId?: string;
  vcpus?: number;
  memoryMib?: number;
  diskMib?: number;
  labels?: Record<string, string>;
  hostname?: string;
  /** Sandbox TTL, e.g. '1h'. */
  ttl?: string | number;
  idleTimeout?: string | number;
  allowEgress?: boolean;
  hostId?: string;
}

export interface ForkOptions {
  locality?: 'any' | 'same_host' | 'cross_host';
  spread?: 'pack' | 'spread';
  maxPerHost?: number;
  labels?: Record<string, string>;
  ttl?: string | number;
  /** The children's idle timeout ('0' or 0 disables); unset: the source sandbox's. */
  idleTimeout?: string | number;
  /**
   * Forking a live sandbox: retention of the snapshot it takes. Unset: the fleet's default
   * TTL (FF_FORK_SNAPSHOT_TTL, 24h); `{}` keeps it. Not allowed with a snapshot as source.
   */
  snapshotRetention?: { ttl?: string | number; keepLast?: number };
}

export interface ExecOptions {
  /**
   * Variables ADDED to the guest's own environment (PATH, HOME, ... stay, unless named here):
   * names of 1-128 characters of A-Z, a-z, 0-9 and _, not starting with a digit. Names
   * starting `_ff_` or `FFE_` are the guest exec wrapper's and are refused (invalid_argument,
   * field `env["NAME"]`).
   */
  env?: Record<string, string>;
  cwd?: string;
  stdin?: string | Uint8Array;
  /**
   * Kill the command after this long ('60s' by default on the server). The call itself ends
   * with deadline_exceeded if no exit has come EXEC_CALL_SLACK_MS (5.5 min: a hibernated
   * sandbox is woken first) after that, e.g. its scheduler hangs with the stream open.
   */
  timeout?: string | number;
  signal?: AbortSignal;
}

/**
 * A file transfer's deadline per attempt when the call gives none: the whole stream, up to
 * 64 MiB through the guest agent, which takes far longer than a unary call's 30 s under TCG.
 */
export const FILE_CALL_TIMEOUT_MS = 300_000;

/** The server's exec timeout when none is given (ExecRequest.timeout). */
const EXEC_DEFAULT_TIMEOUT_MS = 60_000;
/** An exec call's deadline past its command's timeout: the scheduler's wait for a wake (300 s) plus 30 s. */
export const EXEC_CALL_SLACK_MS = 330_000;

export interface ExecResult {
  stdout: string;
  stderr: string;
  exitCode: number;
  signal: number;
  timedOut: boolean;
  durationMs: number;
  /** stdout or stderr had more than an exec returns (64 MiB each): what followed is missing. */
  outputTruncated: boolean;
}

/**
 * An exec, started lazily: nothing is sent to the fleet until it is iterated or result() is
 * called (`sb.exec(['touch', '/x'])` alone runs nothing; `await sb.run([...])` does). Iterate
 * it for output; the last chunk is the exit. It runs once: iterate it or call result(), once.
 */
export interface ExecStream extends AsyncIterable<ExecChunk> {
  /**
   * Runs it, collects everything and resolves with the result. Do not also iterate. When the
   * call fails after output came (the host lost, the connection dropped, the deadline passed),
   * the error carries what came before it: execOutputOf(e).
   */
  result(): Promise<ExecResult>;
}

/** What an exec printed before its call failed (ExecStream.result()). */
export interface ExecPartialOutput {
  stdout: string;
  stderr: string;
}
const partialOutputOf = new WeakMap<object, ExecPartialOutput>();

/**
 * The output an exec's result() had collected when its call failed part-way (the host lost,
 * the connection dropped, its deadline): the command may have run on, or to its end, with no
 * exit seen. Undefined for any other error, or one thrown before any output came.
 */
export function execOutputOf(e: unknown): ExecPartialOutput | undefined {
  return typeof e === 'object' && e !== null ? partialOutputOf.get(e) : undefined;
}

/** @internal Sleeps `ms`, or until `signal` aborts (rejecting with its reason); leaves no listener on the signal behind (exported for its test). */
export const sleep = (ms: number, signal?: AbortSignal): Promise<void> =>
  new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const onAbort = (): void => {
      clearTimeout(t);
      reject(signal!.reason);
    };
    const t = setTimeout(() => {
      signal?.removeEventListener('abort', onAbort);
      resolve();
    }, ms);
    signal?.addEventListener('abort', onAbort, { once: true });
  });

/** A new idempotency key: unique per logical call, reused across its retries. */
export function newIdempotencyKey(prefix = 'sdk'): string {
  return `${prefix}-${randomUUID()}`;
}

function target(address: string | string[]): string {
  const list = Array.isArray(address) ? address : address.split(',').map((a) => a.trim()).filter(Boolean);
  if (list.length === 0) throw new ForkfleetError('invalid_argument', 'address: want host:port', { field: 'address' });
  if (list.length === 1) return list[0]!;
  // grpc-js takes a list of addresses only as IP literals (the ipv4: or ipv6: scheme), and
  // picks the first that answers; a list with a host name would fail every call UNAVAILABLE.
  const v4 = list.every((a) => /^\d{1,3}(\.\d{1,3}){3}:\d+$/.test(a));
  const v6 = list.every((a) => /^\[[0-9a-fA-F:.]+\]:\d+$/.test(a));
  if (!v4 && !v6) throw new ForkfleetError('invalid_argument', `address: a list of schedulers must be IPv4 (a.b.c.d:port) or IPv6 ([addr]:port) addresses, all of one family; for host names give one name that resolves to every scheduler, got ${JSON.stringify(list.join(','))}`, { field: 'address' });
  return `${v4 ? 'ipv4' : 'ipv6'}:${list.join(',')}`;
}

/**
 * Refuses a token a request header cannot carry (a space, a control character such as the
 * trailing \r of a file with CRLF line endings, a non-ASCII character): grpc-js would fail
 * every call with a message that quotes the whole header, token included. The error names
 * `token` and where it came from (`source`: options, FF_TOKEN or the credentials file), never
 * the token itself.
 */
function checkToken(token: unknown, source: string): void {
  if (token === undefined) return;
  if (typeof token === 'string' && /^[\x21-\x7e]+$/.test(token)) return;
  const from = source === 'options' ? 'the token option' : source === 'FF_TOKEN' ? 'FF_TOKEN' : `"token" in ${source}`;
  throw new InvalidArgumentError('token', `${from} is not a token a request header can carry: want printable ASCII without spaces or control characters (a line ending from a file with CRLF lines, \\r, is a common cause)${typeof token === 'string' ? '' : `, got a ${typeof token}`}`);
}

// ---------------------------------------------------------------- client

export class Forkfleet {
  readonly tenant: string;
  readonly address: string;
  /** The raw typed gRPC client, for calls this SDK does not wrap. */
  readonly rpc: FleetClient;
  private readonly timeoutMs: number;
  private readonly retryOpts: Readonly<RetryOptions>;

  constructor(opts: ForkfleetOptions) {
    const creds = resolveClientCredentials({
      ...(opts.token !== undefined ? { token: opts.token } : {}),
      ...(opts.ca !== undefined ? { ca: opts.ca } : {}),
      ...(opts.credentialsFile !== undefined ? { credentialsFile: opts.credentialsFile } : {}),
    });
    checkToken(creds.token, creds.source);
    this.tenant = opts.tenant ?? process.env.FF_TENANT ?? creds.tenant ?? '';
    this.address = target(opts.address);
    // TLS always; the token rides on every call as "authorization: Bearer ...".
    this.rpc = createClient(FleetService, this.address, fleetChannelCredentials(creds), fleetChannelOptions(this.address));
    this.timeoutMs = opts.timeoutMs ?? 30_000;
    this.retryOpts = retryOptions(opts.retry);
  }

  close(): void {
    this.rpc.close();
  }

  /**
   * Runs `fn` until it succeeds, retrying only errors marked retryable: `attempts` times, except
   * that a scheduler that answers UNAVAILABLE (its etcd or NATS is away, e.g. restarting) is
   * asked again for up to `outageWaitMs`, one that cannot be reached for up to
   * `unreachableWaitMs`, and a call refused by the rate limit for up to `rateLimitWaitMs`, each
   * time after the wait the server named; such errors in a row, of whichever of these kinds,
   * share one allowance from the first of them (the largest of their kinds'). Never past
   * `opts.deadline`. A mutating call keeps its idempotency key throughout.
   */
  async retry<T>(fn: (o: RpcCallOptions) => Promise<T>, opts: CallOpts = {}, keyed = false): Promise<T> {
    const until = opts.deadline?.getTime() ?? Infinity;
    const backoff = new Backoff(this.retryOpts);
    for (;;) {
      try {
        return await fn(this.rpcOpts(opts, until));
      } catch (e) {
        if (!(retryable(e) || (keyed && unansweredDeadline(e))) || opts.signal?.aborted) throw e;
        const now = Date.now();
        const ms = backoff.next(e, now);
        if (ms === undefined || now + ms >= until) throw e;
        await sleep(ms, opts.signal);
      }
    }
  }

  /** One call's options: its deadline (the client's per-call one unless given, cut to `until`) and signal. */
  private rpcOpts(opts: CallOpts, until = Infinity): RpcCallOptions {
    const timeoutMs = Math.max(0, Math.min(opts.timeoutMs ?? this.timeoutMs, until - Date.now()));
    return { timeoutMs, ...(opts.signal ? { signal: opts.signal } : {}) };
  }

  private key(opts: CallOpts): string {
    return opts.idempotencyKey ?? newIdempotencyKey();
  }

  /**
   * Follows an operation until it is done, reporting progress; throws OperationFailedError on
   * failure. `tenant`: the operation's tenant, when it is not this client's (a host drain is
   * the `admin` tenant's).
   */
  async wait(operationId: string, opts: CallOpts = {}, tenant = this.tenant): Promise<OperationInfo> {
    const until = Math.min(Date.now() + (opts.timeoutMs ?? 600_000), opts.deadline?.getTime() ?? Infinity);
    // With a progress callback poll once a second; without, long-poll in 30 s windows.
    const windowMs = opts.onProgress ? 1000 : 30_000;
    // The operation goes on without this client: a scheduler or its store that is briefly
    // unreachable (retryable errors, e.g. while etcd restarts) does not end the wait. Polling
    // goes on until WAIT_OUTAGE_MS of nothing but such errors, then the last one is thrown.
    let failingSince = 0;
    /** Polls refused or unanswered in a row: the pause before the next grows (with jitter), as retry()'s does. */
    let failures = 0;
    let polled = false;
    for (;;) {
      const left = until - Date.now();
      // The scheduler answers a poll a margin (500 ms) before its deadline: with no more than
      // that left a poll would come back at once, and the next at once again, flooding the
      // scheduler (and the tenant's rate budget) until the deadline. One poll was answered:
      // wait it out.
      if (polled && left > 0 && left <= 600) {
        await sleep(left, opts.signal);
        continue;
      }
      if (left <= 0) throw new ForkfleetError('deadline_exceeded', `operation ${operationId} not done ${opts.deadline && opts.deadline.getTime() === until ? `by ${opts.deadline.toISOString()}` : `after ${opts.timeoutMs ?? 600_000} ms`}; follow it with GetOperation`, { retryable: false });
      const w = Math.max(1, Math.min(windowMs, left));
      let pb: PbOperation;
      try {
        // Retried by this loop (not by retry(), whose outage allowance would outlast `until`).
        // The poll's own deadline is 10 s past its window (room for the answer), but never past
        // `until`: a poll the scheduler took and never answered ends by the wait's deadline, not
        // 10 s after it (the scheduler answers a margin before the deadline it is given).
        const pollMs = Math.max(1, Math.min(w + 10_000, until - Date.now()));
        pb = await this.rpc.waitOperation({ tenantId: tenant, operationId, timeout: durationOf(w) }, { timeoutMs: pollMs, ...(opts.signal ? { signal: opts.signal } : {}) });
        polled = true;
      } catch (e) {
        // A poll the rate limit (or a bound of the scheduler's: the credential's streams at
        // their cap) refused is no outage (the scheduler answered, and lets it through in
        // turn): only the wait's own limit ends those, as it ends a slow operation.
        const limited = heldBack(e);
        if (!limited) failingSince ||= Date.now();
        // Its own deadline with no answer (a scheduler that stalled, or a connection cut off
        // that keepalive has not noticed yet) is an outage too: WaitOperation only reads.
        if (!(retryable(e) || unansweredDeadline(e)) || opts.signal?.aborted || (!limited && Date.now() - failingSince >= WAIT_OUTAGE_MS)) throw e;
        // Full jitter over a growing window: many waits of one client (a fork's 64 children, a
        // destroy of many) do not poll a recovering scheduler in step, once a second each.
        const pauseMs = fullJitterMs(Math.max(250, retryAfterOf(e)), 1000, 5000, failures++);
        await sleep(Math.min(pauseMs, Math.max(0, until - Date.now())), opts.signal);
        continue;
      }
      failingSince = 0;
      failures = 0;
      const op = toOperation(pb);
      opts.onProgress?.(op);
      if (op.state === 'succeeded') return op;
      if (op.state === 'failed' || op.state === 'cancelled') throw new OperationFailedError(op);
    }
  }

  async operation(operationId: string, opts: CallOpts = {}): Promise<OperationInfo> {
    return toOperation(await this.retry((o) => this.rpc.getOperation({ tenantId: this.tenant, operationId }, o), opts));
  }

  /**
   * Asks a running create, fork or drain to stop (CancelOperation): it ends `cancelled` at its
   * next safe point, undoing what it started (a fork destroys the children that started; see
   * proto/forkfleet/v1/fleet.proto). Returns the operation as the call left it (wait() on it
   * then throws OperationFailedError with state `cancelled`). Asking again is harmless.
   * `tenant`: another tenant's (admin credentials only; a drain is the `admin` tenant's).
   */
  async cancelOperation(operationId: string, opts: CallOpts = {}, tenant = this.tenant): Promise<OperationInfo> {
    return toOperation(await this.retry((o) => this.rpc.cancelOperation({ tenantId: tenant, operationId }, o), opts));
  }

  /**
   * The tenant's operations, newest first: the running ones and the finished ones the
   * scheduler still keeps (FF_RECORD_RETENTION, 1 h by default). Every filter given must
   * match; `limit` stops after that many (default: all). `tenant`: another tenant's, and
   * `allTenants`: every tenant's (admin credentials only; a host drain is the `admin` tenant's).
   */
  async listOperations(filter: { states?: OperationStateName[]; kinds?: OperationKindName[]; targetId?: string; limit?: number; allTenants?: boolean } = {}, opts: CallOpts = {}, tenant = this.tenant): Promise<OperationInfo[]> {
    const states = (filter.states ?? []).map((s, i) => enumValue(OperationState, s, `states[${i}]`));
    const kinds = (filter.kinds ?? []).map((k, i) => enumValue(OperationKind, k, `kinds[${i}]`));
    if (filter.limit !== undefined && !(typeof filter.limit === 'number' && filter.limit >= 0)) throw new InvalidArgumentError('limit', `want a number of 0 or more, got ${String(filter.limit)}`);
    const limit = Math.floor(filter.limit ?? Infinity);
    const out: OperationInfo[] = [];
    if (limit <= 0) return out;
    let pageToken = '';
    do {
      const pageSize = Math.min(100, limit - out.length);
      const r = await this.retry((o) => this.rpc.listOperations({ tenantId: filter.allTenants ? '' : tenant, allTenants: filter.allTenants ?? false, states, kinds, targetId: filter.targetId ?? '', pageSize, pageToken }, o), opts);
      out.push(...r.operations.map(toOperation));
      pageToken = r.nextPageToken;
    } while (pageToken && out.length < limit);
    return out;
  }

  /** The tenant's quotas and rate limit, and what counts against the quotas now. `tenant`: another's (admin credentials only). */
  async usage(opts: CallOpts = {}, tenant = this.tenant): Promise<UsageInfo> {
    const u = await this.retry((o) => this.rpc.getTenantUsage({ tenantId: tenant }, o), opts);
    const q = u.quota;
    return {
      tenantId: u.tenantId,
      sandboxes: u.sandboxes,
      memoryMib: num(u.memoryMib),
      snapshotBytes: num(u.snapshotBytes),
      quota: {
        ...(q?.sandboxes !== undefined ? { sandboxes: q.sandboxes } : {}),
        ...(q?.memoryMib !== undefined ? { memoryMib: num(q.memoryMib) } : {}),
        ...(q?.snapshotBytes !== undefined ? { snapshotBytes: num(q.snapshotBytes) } : {}),
      },
      ratePerSecond: u.ratePerSecond,
      rateBurst: u.rateBurst,
    };
  }

  /**
   * Submits a mutating call (one key for all attempts, so an attempt whose answer was lost,
   * even to this client's own deadline, is retried without doing the work twice) and waits
   * for its operation. An error after the operation was accepted names it (operationIdOf).
   */
  private async submit(call: (key: string, o: RpcCallOptions) => Promise<PbOperation>, opts: CallOpts): Promise<OperationInfo> {
    const key = this.key(opts);
    let opId: string | undefined;
    try {
      const op = await this.retry((o) => call(key, o), { ...opts, timeoutMs: this.timeoutMs }, true);
      opId = op.id;
      if (opts.onAccepted) {
        try {
          opts.onAccepted(toOperation(op));
        } catch {
          // The caller's bookkeeping: it does not fail the call.
        }
      }
      return await this.wait(op.id, opts, op.tenantId || this.tenant);
    } catch (e) {
      const err = asError(e, opts.signal);
      submittedBy.set(err, opId ? { key, opId } : { key });
      throw err;
    }
  }

  // --- sandboxes

  async create(spec: CreateOptions, opts: CallOpts = {}): Promise<Sandbox> {
    // One source (the request's oneof): both given would send one and drop the other unsaid.
    if (spec.image && spec.snapshotId) throw new InvalidArgumentError('source', 'set image or snapshot_id, not both');
    if (!spec.image && !spec.snapshotId) spec = { ...spec, image: 'tiny' };
    const source = spec.snapshotId ? { case: 'snapshotId' as const, value: spec.snapshotId } : { case: 'image' as const, value: spec.image! };
    const op = await this.submit(
      (idempotencyKey, o) =>
        this.rpc.createSandbox(
          {
            tenantId: this.tenant,
            idempotencyKey,
            source,
            resources: { vcpus: wholeIn(spec.vcpus, 'resources.vcpus', UINT32_MAX), memoryMib: BigInt(wholeIn(spec.memoryMib, 'resources.memory_mib')), diskMib: BigInt(wholeIn(spec.diskMib, 'resources.disk_mib')) },
            labels: spec.labels ?? {},
            hostname: spec.hostname ?? '',
            ...(spec.ttl !== undefined || spec.idleTimeout !== undefined
              ? { lifecycle: { ...(spec.ttl !== undefined ? { ttl: durationIn(spec.ttl, 'lifecycle.ttl') } : {}), ...(spec.idleTimeout !== undefined ? { idleTimeout: durationIn(spec.idleTimeout, 'lifecycle.idle_timeout') } : {}) } }
              : {}),
            ...(spec.allowEgress !== undefined ? { network: { allowEgress: spec.allowEgress } } : {}),
            ...(spec.hostId ? { placement: { hostId: spec.hostId } } : {}),
          },
          o,
        ),
      opts,
    );
    if (!op.sandbox) throw new ForkfleetError('internal', `operation ${op.id} succeeded without a sandbox`);
    return new Sandbox(this, op.sandbox);
  }

  /** A handle on an existing sandbox (no call is made). */
  sandbox(id: string): Sandbox {
    return new Sandbox(this, id);
  }

  async get(sandboxId: string, opts: CallOpts = {}): Promise<SandboxInfo> {
    return toSandbox(await this.retry((o) => this.rpc.getSandbox({ tenantId: this.tenant, sandboxId }, o), opts));
  }

  /**
   * Sandboxes matching every filter given (no states: all but destroyed). `hostId`: only those
   * on that host; `allTenants`: every tenant's, not this client's (admin credentials only).
   */
  async list(filter: { states?: SandboxStateName[]; labels?: Record<string, string>; hostId?: string; allTenants?: boolean } = {}, opts: CallOpts = {}): Promise<SandboxInfo[]> {
    const states = (filter.states ?? []).map((s, i) => enumValue(SandboxState, s, `states[${i}]`));
    const out: SandboxInfo[] = [];
    let pageToken = '';
    do {
      const r = await this.retry((o) => this.rpc.listSandboxes({ tenantId: filter.allTenants ? '' : this.tenant, allTenants: filter.allTenants ?? false, states, labels: filter.labels ?? {}, hostId: filter.hostId ?? '', pageSize: 500, pageToken }, o), opts);
      out.push(...r.sandboxes.map(toSandbox));
      pageToken = r.nextPageToken;
    } while (pageToken);
    return out;
  }

  /** N copy-on-write children of a snapshot or of a live sandbox (snapshotted first). */
  async fork(source: { snapshotId: string } | { sandboxId: string }, count: number, fo: ForkOptions = {}, opts: CallOpts = {}): Promise<{ snapshotId: string; children: Sandbox[]; operation: OperationInfo }> {
    const src = 'snapshotId' in source ? { case: 'snapshotId' as const, value: source.snapshotId } : { case: 'sandboxId' as const, value: source.sandboxId };
    const locality = ({ any: Locality.ANY, same_host: Locality.SAME_HOST, cross_host: Locality.CROSS_HOST } as Record<string, Locality>)[fo.locality ?? 'any'];
    const spread = fo.spread ? ({ pack: Spread.PACK, spread: Spread.SPREAD } as Record<string, Spread>)[fo.spread] : Spread.UNSPECIFIED;
    // A misspelt value from JavaScript (no types to catch it) was sent as UNSPECIFIED, which
    // the fleet takes as ANY / PACK: refused here, naming it.
    if (locality === undefined) throw new InvalidArgumentError('locality', `${JSON.stringify(fo.locality)} is not one of any, same_host, cross_host`);
    if (spread === undefined) throw new InvalidArgumentError('spread', `${JSON.stringify(fo.spread)} is not one of pack, spread`);
    const op = await this.submit(
      (idempotencyKey, o) =>
        this.rpc.forkSandbox(
          {
            tenantId: this.tenant,
            idempotencyKey,
            source: src,
            count: wholeIn(count, 'count', UINT32_MAX),
            placement: { locality, spread, maxPerHost: wholeIn(fo.maxPerHost, 'placement.max_per_host', UINT32_MAX) },
            labels: fo.labels ?? {},
            ...(fo.ttl !== undefined || fo.idleTimeout !== undefined
              ? { lifecycle: { ...(fo.ttl !== undefined ? { ttl: durationIn(fo.ttl, 'lifecycle.ttl') } : {}), ...(fo.idleTimeout !== undefined ? { idleTimeout: durationIn(fo.idleTimeout, 'lifecycle.idle_timeout') } : {}) } }
              : {}),
            ...(fo.snapshotRetention ? { snapshotRetention: { ...(fo.snapshotRetention.ttl !== undefined ? { ttl: durationIn(fo.snapshotRetention.ttl, 'snapshot_retention.ttl') } : {}), keepLast: wholeIn(fo.snapshotRetention.keepLast, 'snapshot_retention.keep_last', UINT32_MAX) } } : {}),
          },
          o,
        ),
      opts,
    );
    const children = (op.fork?.children ?? []).map((c) => new Sandbox(this, c));
    return { snapshotId: op.fork?.snapshotId ?? '', children, operation: op };
  }

  /**
   * Lifecycle events of the tenant (or one sandbox), as they happen. Break out of the loop to
   * stop. A stream that breaks is resumed without a gap or a repeat: one store revision can
   * carry several events (a fork's children are written together), so it resumes after the
   * last revision it saw whole and skips the events of the next one it yielded already.
   * A watch from now (no afterRevision) starts with a progress marker at the store's revision
   * then, so a break even before its first event resumes exactly (a scheduler older than that
   * sends none: events between such a break and the reconnect are missed). A resume point
   * the store no longer has (it compacts every FF_ETCD_COMPACT_INTERVAL, 5 min by default;
   * the server needs that revision itself, where the previous values of the changes after it
   * are read) fails FAILED_PRECONDITION on after_revision: read the current state, then watch
   * again.
   */
  async *watch(filter: { sandboxId?: string; types?: string[]; afterRevision?: number; signal?: AbortSignal } = {}): AsyncGenerator<EventInfo> {
    const types = (filter.types ?? []).map((t, i) => enumValue(EventType, t, `types[${i}]`));
    /** Every event up to this revision was yielded. */
    let after = wholeIn(filter.afterRevision, 'after_revision');
    /** The revision of the last event yielded (maybe not all of its events yet), and those yielded of it. */
    let current = after;
    let yielded = new Set<string>();
    const backoff = new Backoff(this.retryOpts);
    for (;;) {
      const started = Date.now();
      try {
        for await (const e of this.rpc.watchEvents({ tenantId: this.tenant, sandboxId: filter.sandboxId ?? '', types, afterRevision: BigInt(after) }, filter.signal ? { signal: filter.signal } : {})) {
          backoff.reset();
          const ev = toEvent(e);
          if (ev.revision <= after) continue;
          // A progress marker (type 0, not a name: a type this SDK does not know also reads
          // 'unspecified', and is an event): every event up to its revision came before it. Not
          // an event; it moves the resume point, so a quiet watch does not fall behind what
          // the store keeps.
          if (e.type === EventType.UNSPECIFIED) {
            after = current = ev.revision;
            yielded = new Set();
            continue;
          }
          const key = JSON.stringify([ev.type, ev.sandboxId, ev.snapshotId, ev.hostId, ev.operationId, ev.sandboxState, ev.message]);
          if (ev.revision === current) {
            if (yielded.has(key)) continue; // replayed after a break inside this revision
          } else {
            // A later revision: every event before it came first (the stream is in revision
            // order), also in a watch from now whose first event this is. ev.revision - 1, not
            // the last revision yielded (`current`): both resume without a gap, and the server
            // refuses a resume point compaction has removed, so the newer one lasts longer.
            after = Math.max(after, ev.revision - 1);
            current = ev.revision;
            yielded = new Set();
          }
          yielded.add(key);
          yield ev;
        }
        return;
      } catch (e) {
        if (!(e instanceof ForkfleetError && (e.retryable || streamReset(e))) || filter.signal?.aborted) throw e;
        // A stream that stayed up a while counts as working, events or not: only breaks in a
        // row use up the attempts (and the allowances: a restarting scheduler, the credential's
        // watches at their cap).
        if (Date.now() - started >= WATCH_HEALTHY_MS) backoff.reset();
        const ms = backoff.next(e);
        if (ms === undefined) throw e;
        await sleep(ms, filter.signal);
      }
    }
  }

  // --- snapshots

  readonly snapshots = {
    list: async (lineageId = '', opts: CallOpts = {}): Promise<SnapshotInfo[]> => {
      const out: SnapshotInfo[] = [];
      let pageToken = '';
      do {
        const r = await this.retry((o) => this.rpc.listSnapshots({ tenantId: this.tenant, lineageId, pageSize: 500, pageToken }, o), opts);
        out.push(...r.snapshots.map(toSnapshot));
        pageToken = r.nextPageToken;
      } while (pageToken);
      return out;
    },
    get: async (snapshotId: string, opts: CallOpts = {}): Promise<SnapshotInfo> => toSnapshot(await this.retry((o) => this.rpc.getSnapshot({ tenantId: this.tenant, snapshotId }, o), opts)),
    pin: async (snapshotId: string, opts: CallOpts = {}): Promise<SnapshotInfo> => {
      const idempotencyKey = this.key(opts);
      return toSnapshot(await this.retry((o) => this.rpc.pinSnapshot({ tenantId: this.tenant, idempotencyKey, snapshotId }, o), opts, true));
    },
    unpin: async (snapshotId: string, opts: CallOpts = {}): Promise<SnapshotInfo> => {
      const idempotencyKey = this.key(opts);
      return toSnapshot(await this.retry((o) => this.rpc.unpinSnapshot({ tenantId: this.tenant, idempotencyKey, snapshotId }, o), opts, true));
    },
    delete: async (snapshotId: string, opts: CallOpts = {}): Promise<OperationInfo> =>
      this.submit((idempotencyKey, o) => this.rpc.deleteSnapshot({ tenantId: this.tenant, idempotencyKey, snapshotId }, o), opts),
  };

  // --- hosts (admin)

  readonly hosts = {
    list: async (opts: CallOpts = {}): Promise<HostInfo[]> => (await this.retry((o) => this.rpc.listHosts({}, o), opts)).hosts.map(toHost),
    cordon: async (hostId: string, cordon = true, opts: CallOpts = {}): Promise<HostInfo> => {
      const idempotencyKey = this.key(opts);
      return toHost(await this.retry((o) => this.rpc.cordonHost({ idempotencyKey, hostId, cordon }, o), opts, true));
    },
    drain: async (hostId: string, migrate = false, opts: CallOpts = {}): Promise<OperationInfo> =>
      this.submit((idempotencyKey, o) => this.rpc.drainHost({ idempotencyKey, hostId, migrate }, o), opts),
    /** Removes a lost host (decommissioning); resolves with how many lost sandboxes were recorded on it. */
    remove: async (hostId: string, opts: CallOpts = {}): Promise<{ lostSandboxes: number }> => {
      // Once: RemoveHost carries no idempotency key, and a repeat of one that landed (its
      // answer lost) is NOT_FOUND, which would hide that it worked.
      const r = await this.rpc.removeHost({ hostId }, this.rpcOpts(opts, opts.deadline?.getTime()));
      return { lostSandboxes: r.lostSandboxes };
    },
  };

  // --- used by Sandbox

  /** @internal */
  sandboxOp(kind: 'pause' | 'resume' | 'hibernate' | 'destroy', sandboxId: string, opts: CallOpts, replicas = 0): Promise<OperationInfo> {
    return this.submit((idempotencyKey, o) => {
      const req = { tenantId: this.tenant, idempotencyKey, sandboxId };
      if (kind === 'pause') return this.rpc.pauseSandbox(req, o);
      if (kind === 'resume') return this.rpc.resumeSandbox(req, o);
      if (kind === 'hibernate') return this.rpc.hibernateSandbox({ ...req, replicas }, o);
      return this.rpc.destroySandbox(req, o);
    }, opts);
  }

  /** @internal */
  async snapshotOf(sandboxId: string, spec: { pin?: boolean; labels?: Record<string, string>; ttl?: string | number; keepLast?: number }, opts: CallOpts): Promise<SnapshotInfo> {
    const op = await this.submit(
      (idempotencyKey, o) =>
        this.rpc.snapshotSandbox(
          {
            tenantId: this.tenant,
            idempotencyKey,
            sandboxId,
            pin: spec.pin ?? false,
            labels: spec.labels ?? {},
            ...(spec.ttl !== undefined || spec.keepLast !== undefined
              ? { retention: { ...(spec.ttl !== undefined ? { ttl: durationIn(spec.ttl, 'retention.ttl') } : {}), keepLast: wholeIn(spec.keepLast, 'retention.keep_last', UINT32_MAX) } }
              : {}),
          },
          o,
        ),
      opts,
    );
    if (!op.snapshot) throw new ForkfleetError('internal', `operation ${op.id} succeeded without a snapshot`);
    return op.snapshot;
  }

  /** @internal */
  execStream(sandboxId: string, argv: string[], eo: ExecOptions): ExecStream {
    const idempotencyKey = newIdempotencyKey('exec');
    const ff = { rpc: this.rpc, tenant: this.tenant, retryOpts: this.retryOpts };
    async function* run(): AsyncGenerator<ExecChunk> {
      // The command's timeout, parsed once; one deadline for the call and its retries.
      const timeoutMs = eo.timeout !== undefined ? parseDuration(eo.timeout, 'timeout') : undefined;
      const deadline = new Date(Date.now() + (timeoutMs ?? EXEC_DEFAULT_TIMEOUT_MS) + EXEC_CALL_SLACK_MS);
      // The same allowances as retry().
      const backoff = new Backoff(ff.retryOpts);
      for (;;) {
        let got = false;
        try {
          const stream = ff.rpc.exec(
            {
              tenantId: ff.tenant,
              idempotencyKey,
              sandboxId,
              argv,
              env: eo.env ?? {},
              cwd: eo.cwd ?? '',
              stdin: typeof eo.stdin === 'string' ? Buffer.from(eo.stdin) : (eo.stdin ?? new Uint8Array()),
              ...(timeoutMs !== undefined ? { timeout: durationOf(timeoutMs, 'timeout') } : {}),
            },
            { deadline, ...(eo.signal ? { signal: eo.signal } : {}) },
          );
          for await (const r of stream) {
            got = true;
            if (r.payload.case === 'stdout' || r.payload.case === 'stderr') yield { stream: r.payload.case, data: r.payload.value };
            else if (r.payload.case === 'exit') {
              const x = r.payload.value;
              yield { stream: 'exit', exitCode: x.exitCode, signal: x.signal, timedOut: x.timedOut, durationMs: x.duration ? Number(x.duration.seconds) * 1000 + x.duration.nanos / 1e6 : 0, outputTruncated: x.outputTruncated };
            }
          }
          return;
        } catch (e) {
          // An Exec is not deduplicated (its key is not recorded): retried only when the
          // command cannot have started, i.e. no output came and either the scheduler said so
          // (a retryable error it answered: the host's errors never are) or the call never
          // reached a scheduler. A call that broke off in flight may have started it.
          if (got || !execNeverStarted(e) || eo.signal?.aborted) throw e;
          const now = Date.now();
          const ms = backoff.next(e, now);
          if (ms === undefined || now + ms >= deadline.getTime()) throw e;
          await sleep(ms, eo.signal);
        }
      }
    }
    const it = run();
    return {
      [Symbol.asyncIterator]: () => it,
      async result(): Promise<ExecResult> {
        const out: Buffer[] = [];
        const err: Buffer[] = [];
        const r: ExecResult = { stdout: '', stderr: '', exitCode: -1, signal: 0, timedOut: false, durationMs: 0, outputTruncated: false };
        let exited = false;
        try {
          for await (const c of it) {
            if (c.stream === 'stdout') out.push(Buffer.from(c.data));
            else if (c.stream === 'stderr') err.push(Buffer.from(c.data));
            else if (c.stream === 'exit') {
              exited = true;
              Object.assign(r, { exitCode: c.exitCode, signal: c.signal, timedOut: c.timedOut, durationMs: c.durationMs, outputTruncated: c.outputTruncated });
            }
          }
        } catch (e) {
          // The exit came, then the call failed (the connection dropped as it ended): the
          // command's result is whole (the exit is the stream's last message), so it is returned.
          if (!exited) {
            // Output came, then the call failed: keep it with the error (execOutputOf).
            if ((out.length > 0 || err.length > 0) && typeof e === 'object' && e !== null) partialOutputOf.set(e, { stdout: Buffer.concat(out).toString(), stderr: Buffer.concat(err).toString() });
            throw e;
          }
        }
        r.stdout = Buffer.concat(out).toString();
        r.stderr = Buffer.concat(err).toString();
        return r;
      },
    };
  }
}

/** A sandbox handle. `info` is the last state the SDK saw (refresh() re-reads it). */
export class Sandbox {
  readonly id: string;
  info: SandboxInfo | undefined;
  private readonly ff: Forkfleet;

  constructor(ff: Forkfleet, src: string | SandboxInfo) {
    this.ff = ff;
    this.id = typeof src === 'string' ? src : src.id;
    this.info = typeof src === 'string' ? undefined : src;
  }

  async refresh(opts: CallOpts = {}): Promise<SandboxInfo> {
    this.info = await this.ff.get(this.id, opts);
    return this.info;
  }

  /**
   * argv in the guest, as a stream started lazily: nothing runs until it is iterated (live
   * output) or its result() is called. To run a command and wait for it, use run().
   */
  exec(argv: string[], opts: ExecOptions = {}): ExecStream {
    return this.ff.execStream(this.id, argv, opts);
  }

  /** Runs argv in the guest now and collects its output (exec(argv).result()). */
  run(argv: string[], opts: ExecOptions = {}): Promise<ExecResult> {
    return this.exec(argv, opts).result();
  }

  /** Runs a shell script and collects its output. */
  sh(script: string, opts: ExecOptions = {}): Promise<ExecResult> {
    return this.run(['/bin/sh', '-c', script], opts);
  }

  async writeFile(path: string, data: string | Uint8Array, mode = 0o644, opts: CallOpts = {}): Promise<number> {
    const idempotencyKey = newIdempotencyKey('write');
    const bytes = typeof data === 'string' ? Buffer.from(data) : Buffer.from(data);
    const chunks: Array<{ payload: { case: 'header'; value: { tenantId: string; idempotencyKey: string; sandboxId: string; path: string; mode: number } } | { case: 'data'; value: Uint8Array } }> = [
      { payload: { case: 'header', value: { tenantId: this.ff.tenant, idempotencyKey, sandboxId: this.id, path, mode } } },
    ];
    for (let i = 0; i < bytes.length; i += 256 * 1024) chunks.push({ payload: { case: 'data', value: bytes.subarray(i, i + 256 * 1024) } });
    const r = await this.ff.retry((o) => this.ff.rpc.writeFile(chunks, o), { ...opts, timeoutMs: opts.timeoutMs ?? FILE_CALL_TIMEOUT_MS });
    return Number(r.bytesWritten);
  }

  async readFile(path: string, opts: CallOpts & { maxBytes?: number } = {}): Promise<Buffer> {
    return this.ff.retry(async (o) => {
      const parts: Buffer[] = [];
      for await (const r of this.ff.rpc.readFile({ tenantId: this.ff.tenant, sandboxId: this.id, path, maxBytes: BigInt(wholeIn(opts.maxBytes, 'max_bytes')) }, o)) parts.push(Buffer.from(r.data));
      return Buffer.concat(parts);
    }, { ...opts, timeoutMs: opts.timeoutMs ?? FILE_CALL_TIMEOUT_MS });
  }

  private async op(kind: 'pause' | 'resume' | 'hibernate' | 'destroy', opts: CallOpts, replicas = 0): Promise<Sandbox> {
    const op = await this.ff.sandboxOp(kind, this.id, opts, replicas);
    // A hibernation's result is its snapshot, not the sandbox: read the sandbox again, or
    // `info` would still show the state from before the call.
    if (op.sandbox) this.info = op.sandbox;
    else if (kind === 'destroy') this.info = this.info ? { ...this.info, state: 'destroyed' } : undefined;
    // The read gets the client's per-call deadline (opts.timeoutMs is the operation's wait), and
    // one that fails leaves `info` unset rather than failing an operation that succeeded.
    // The call's `deadline` bounds the read too (its retries through an outage included).
    else this.info = await this.ff.get(this.id, { ...(opts.signal ? { signal: opts.signal } : {}), ...(opts.deadline ? { deadline: opts.deadline } : {}) }).catch(() => undefined);
    return this;
  }

  pause(opts: CallOpts = {}): Promise<Sandbox> {
    return this.op('pause', opts);
  }
  resume(opts: CallOpts = {}): Promise<Sandbox> {
    return this.op('resume', opts);
  }
  hibernate(opts: CallOpts & { replicas?: number } = {}): Promise<Sandbox> {
    return this.op('hibernate', opts, opts.replicas ?? 0);
  }
  destroy(opts: CallOpts = {}): Promise<Sandbox> {
    return this.op('destroy', opts);
  }

  snapshot(spec: { pin?: boolean; labels?: Record<string, string>; ttl?: string | number; keepLast?: number } = {}, opts: CallOpts = {}): Promise<SnapshotInfo> {
    return this.ff.snapshotOf(this.id, spec, opts);
  }

  /** N children of this live sandbox (it is snapshotted first and keeps running). */
  async fork(count: number, fo: ForkOptions = {}, opts: CallOpts = {}): Promise<Sandbox[]> {
    return (await this.ff.fork({ sandboxId: this.id }, count, fo, opts)).children;
  }

  toJSON(): SandboxInfo | { id: string } {
    return this.info ?? { id: this.id };
  }
}

/** Checks a Forkfleet webhook's `forkfleet-signature` header against the raw body (services/README.md). */
export { verifyWebhookSignature } from '../domain/webhooks.ts';
