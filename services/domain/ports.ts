// Ports the scheduler's domain code depends on. Adapters: adapters/etcd (FleetStore),
// adapters/nats (WorkBus). Wiring: services/main.ts.
import type { HostAllocRec, HostRec, OperationRec, SandboxRec, SnapshotRec } from './records.ts';
import type {
  HeartbeatMsg,
  HostEventMsg,
  HostExecOutputMsg,
  HostExecRequestMsg,
  HostFileRequestMsg,
  HostFileResponseMsg,
  HostResultMsg,
  HostWorkMsg,
} from './messages.ts';

export interface Clock {
  now(): number;
}

export const systemClock: Clock = { now: () => Date.now() };

/** A record with the store revision it was read at (the guard for a later write). */
export interface Versioned<T> {
  value: T;
  /** etcd mod revision of the key; 0 means "did not exist". */
  modRevision: number;
}

/** One write in an atomic batch. `expectRevision` guards it (0 = must not exist). */
export type StoreWrite =
  | { kind: 'sandbox'; value: SandboxRec; expectRevision?: number }
  | { kind: 'snapshot'; value: SnapshotRec; expectRevision?: number }
  | { kind: 'op'; value: OperationRec; expectRevision?: number }
  | { kind: 'host'; value: HostRec; expectRevision?: number }
  | { kind: 'alloc'; value: HostAllocRec; expectRevision?: number }
  | { kind: 'idem'; tenantId: string; key: string; opId: string; expectRevision?: number }
  | { kind: 'delete-sandbox'; tenantId: string; id: string; expectRevision?: number }
  | { kind: 'delete-op'; tenantId: string; id: string; expectRevision?: number }
  | { kind: 'delete-snapshot'; tenantId: string; id: string; expectRevision?: number }
  | { kind: 'delete-host'; id: string; expectRevision?: number }
  | { kind: 'delete-alloc'; hostId: string; expectRevision?: number }
  | { kind: 'delete-idem'; tenantId: string; key: string; expectRevision?: number }
  /** Writes nothing: the batch commits only while host `id`'s record is at `expectRevision` (0: absent). */
  | { kind: 'check-host'; id: string; expectRevision: number }
  /** Writes nothing: the batch commits only while snapshot `id`'s record is at `expectRevision`. */
  | { kind: 'check-snapshot'; tenantId: string; id: string; expectRevision: number };

/**
 * Leader fencing: a guard on a whole batch. A batch with a fence commits only while `key` (the
 * leader's election key) still has create revision `createRevision`, that is while the
 * replica that won that election still leads. A leader whose lease lapsed (a stalled event
 * loop) thus cannot write after a standby took over, even before it learns that it lost;
 * the store throws NotLeaderError instead.
 */
export interface LeaderFence {
  readonly key: string;
  readonly createRevision: number;
  /** The id of the etcd cluster the revision is of (decimal), where known. */
  readonly clusterId?: string;
  /** The id of the fleet store the revision is of (decimal), where known: from the store's incarnation, ordered by when it was made (election.ts fleetStoreId). */
  readonly storeId?: string;
}

/** What orders leaders for host agents (HostWork.leader_term / leader_cluster). */
export interface LeaderTerm {
  readonly term: bigint;
  readonly cluster: bigint;
  /** HostWork.leader_store (0: not known). */
  readonly store?: bigint;
}

export interface FleetStore {
  getSandbox(tenantId: string, id: string): Promise<Versioned<SandboxRec> | undefined>;
  listSandboxes(tenantId: string | undefined): Promise<Versioned<SandboxRec>[]>;
  /**
   * Up to `limit` of the tenant's sandboxes whose ids come after `afterId` ('' from the first),
   * in id order, and whether more follow: one page of a list read in pages (ListSandboxes), so
   * paging through N sandboxes reads each once, not N x pages. Absent in fakes: listSandboxes.
   */
  listSandboxesAfter?(tenantId: string, afterId: string, limit: number): Promise<{ records: Versioned<SandboxRec>[]; more: boolean }>;
  getSnapshot(tenantId: string, id: string): Promise<Versioned<SnapshotRec> | undefined>;
  listSnapshots(tenantId: string | undefined): Promise<Versioned<SnapshotRec>[]>;
  getOp(tenantId: string, id: string): Promise<Versioned<OperationRec> | undefined>;
  /** Every tenant's operations, or only `tenantId`'s. */
  listOps(filter: { activeOnly: boolean; tenantId?: string }): Promise<Versioned<OperationRec>[]>;
  getHost(id: string): Promise<Versioned<HostRec> | undefined>;
  listHosts(): Promise<Versioned<HostRec>[]>;
  getAlloc(hostId: string): Promise<Versioned<HostAllocRec>>;
  listAllocs(): Promise<Versioned<HostAllocRec>[]>;
  /** Operation id recorded for an idempotency key, if any. */
  getIdempotent(tenantId: string, key: string): Promise<string | undefined>;
  /**
   * Applies all writes atomically when every guard holds. Returns false on a guard
   * conflict (nothing written): re-read and re-plan.
   */
  commit(writes: readonly StoreWrite[]): Promise<boolean>;
  /**
   * Like `commit`, but returns the store revision the batch was written at (every written
   * key then has that mod revision), or 0 on a guard conflict (nothing written). With
   * `fence`, only while that leadership holds (else NotLeaderError). A batch that was applied
   * and then sent again (its first answer lost) returns the revision it was applied at, when
   * it wrote a sandbox or op record that is still as written and none of its keys went back
   * to an older revision (store.ts). A StoreUnavailableError leaves the outcome unknown.
   */
  commitAt(writes: readonly StoreWrite[], fence?: LeaderFence): Promise<number>;
  /**
   * Calls `onOp` for every operation record written after now (with `only`: just those it
   * accepts, judged by key and revision before the record is decoded). Returns a stop function.
   */
  watchOps(onOp: (op: OperationRec, modRevision: number) => void, opts?: { only?: (tenantId: string, id: string, modRevision: number) => boolean; onError?: WatchBroke }): Promise<() => void>;
  /**
   * Calls `onChange` with every sandbox record now (one consistent list), then with every
   * sandbox record written or deleted after that list, in revision order (the leader's
   * sandbox index). `onError`: the watch broke off, later changes may be missed. Returns a
   * stop function.
   */
  followSandboxes(onChange: (change: SandboxChange) => void, onError?: (e: unknown) => void, opts?: { known?: KnownRecord }): Promise<() => void>;
  /**
   * Calls `onChange` for every host, alloc and snapshot record written after now (the leader's
   * cache). With `known`, a written record that the caller already has at that revision is
   * skipped before it is decoded (the key is `hostId` for hosts and allocs, `<tenant>/<id>` for
   * snapshots).
   */
  watchFleet(onChange: (change: FleetChange) => void, opts?: { known?: (kind: FleetChange['kind'], key: string, modRevision: number) => boolean; onError?: WatchBroke }): Promise<() => void>;
  /**
   * Calls `onChange` for sandbox / snapshot / operation record changes (WatchEvents,
   * webhooks), each with the record's previous value. `fromRevision` replays changes from
   * that store revision on (when the store still has them); default: after now. `onProgress`:
   * a store revision every change up to which has been passed on (or was not a record change),
   * after each batch of changes of any key and on the store's own progress notices.
   */
  watchRecords(onChange: (change: RecordChange) => void, opts?: { fromRevision?: number; onError?: WatchBroke; onProgress?: (revision: number) => void }): Promise<() => void>;
  /**
   * Lists every sandbox, snapshot and operation record at one revision, then follows every
   * change under the store's prefix from the next revision on, in revision order (the quota
   * ledger). `onRevision(rev)`: every change up to store revision `rev` has been delivered
   * (after the list, then after each watch response). `onError`: the watch broke off; later
   * changes may be missed. Returns a stop function.
   */
  followRecords(onChange: (change: FollowedRecord) => void, onRevision: (revision: number) => void, onError: (e: unknown) => void): Promise<() => void>;
  /** The store's current revision (a linearizable read). */
  revision(): Promise<number>;
  /**
   * Drops the history of every key before `revision` (etcd compaction): reads and watches
   * from an older revision fail from then on. A revision already compacted is no error.
   */
  compact(revision: number): Promise<void>;
}

/**
 * Whether an error of the store is one of a read or watch at a revision that compaction
 * removed: etcd's "required revision has been compacted", which the store also uses when
 * etcd cancels a watch without a reason and its start revision is gone.
 */
export function isCompacted(e: unknown): boolean {
  return /compacted/i.test(e instanceof Error ? e.message : String(e));
}

/**
 * A watch broke off for good (etcd cancelled it, e.g. because the revision it would resume
 * from was compacted, ADR 0017): changes after it may be missed, so the caller lists again.
 */
export type WatchBroke = (e: unknown) => void;

/**
 * `known(key, modRevision)`: the caller already holds this record at this revision or a later
 * one (its own commit, applied when it returned), so the watch need not decode it. `key` is
 * `<tenant>/<id>`.
 */
export type KnownRecord = (key: string, modRevision: number) => boolean;

export type FleetChange =
  | { kind: 'host'; value: Versioned<HostRec> }
  | { kind: 'alloc'; value: Versioned<HostAllocRec> }
  | { kind: 'snapshot'; value: Versioned<SnapshotRec> }
  /**
   * A record was deleted at `revision`: a snapshot's that expired (ADR 0017; `key` is
   * `tenantId/id`), or a removed host's record or alloc (`key` is the host id).
   */
  | { kind: 'gone'; of: 'host' | 'alloc' | 'snapshot'; key: string; revision: number };

export type SandboxChange =
  | { kind: 'put'; value: Versioned<SandboxRec> }
  | { kind: 'delete'; tenantId: string; id: string; revision: number };

export type RecordChange =
  | { kind: 'sandbox'; value: SandboxRec; prev?: SandboxRec; revision: number }
  | { kind: 'snapshot'; value: SnapshotRec; prev?: SnapshotRec; revision: number }
  | { kind: 'op'; value: OperationRec; prev?: OperationRec; revision: number };

/** A record as written (`value`) or deleted (no value), by `<tenant>/<id>` (followRecords). */
export type FollowedRecord =
  | { kind: 'sandbox'; key: string; value?: SandboxRec }
  | { kind: 'snapshot'; key: string; value?: SnapshotRec }
  | { kind: 'op'; key: string; value?: OperationRec };

/** Leader election among scheduler replicas. */
export interface LeaderElection {
  /** Resolves when this replica becomes leader. */
  campaign(): Promise<void>;
  /** Called when leadership is lost after it was won. */
  onLost(cb: () => void): void;
  isLeader(): boolean;
  /**
   * The fence of the election this replica won last (kept after it is lost, so late writes
   * of that term fail); undefined before the first win.
   */
  fence(): LeaderFence | undefined;
  resign(): Promise<void>;
}

/** Control traffic between the scheduler and host agents. */
export interface WorkBus {
  /** Durable, at-least-once delivery to one host's work queue. */
  sendWork(hostId: string, work: HostWorkMsg): Promise<void>;
  /** Deletes a removed host's work queue and the work still queued in it (idempotent). */
  forgetHost(hostId: string): Promise<void>;
  /**
   * Results from all hosts; `ack` after the result is recorded. `fromHost` is the host whose
   * subject the result came on (its NATS user may publish only there). Leader only.
   */
  consumeResults(onResult: (r: HostResultMsg, ack: () => void, fromHost: string) => void | Promise<void>): Promise<() => Promise<void>>;
  onHeartbeat(cb: (hb: HeartbeatMsg) => void): () => void;
  onHostEvent(cb: (e: HostEventMsg) => void): () => void;
  /**
   * Relays an exec to a host; yields output pieces, the last being the exit or an error.
   * `owner` (a tenant id): output its callers have not read is bounded per owner too.
   */
  exec(hostId: string, req: HostExecRequestMsg, opts: { timeoutMs: number; signal?: AbortSignal; owner?: string }): AsyncIterable<HostExecOutputMsg>;
  file(hostId: string, req: HostFileRequestMsg, opts: { timeoutMs: number }): Promise<HostFileResponseMsg>;
  /** The largest message the bus carries, bytes (NATS max_payload): relayed requests and answers must fit. */
  readonly maxPayload: number;
  /**
   * How long this process has been connected to the bus without a break, ms (0 while it is
   * disconnected): hosts that went silent while this process heard nothing at all are not
   * lost on that evidence. Optional: a bus that cannot tell counts as always connected.
   */
  connectedForMs?(): number;
  /**
   * A leader term begins: work message ids must not repeat those of an earlier term of this
   * process, and work carries `term` (agents drop work of older terms). Optional.
   */
  newTerm?(term: LeaderTerm): void;
}
