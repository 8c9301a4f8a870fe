// FleetStore over etcd (etcd3 client). Every guarded write compares the key's mod
// revision it read; a batch is one transaction.
import { rootCertificates } from 'node:tls';
import { circuitBreaker, ConsecutiveBreaker, handleWhen, noop, retry } from 'cockatiel';
import type { IPolicy } from 'cockatiel';
import { InterceptingCall } from '@grpc/grpc-js';
import type { CallOptions, Interceptor } from '@grpc/grpc-js';
import { Etcd3, GRPCCancelledError, GRPCDeadlineExceededError, GRPCInternalError, GRPCResourceExhastedError, GRPCUnavailableError, isRecoverableError, Range } from 'etcd3';
import type { CallContext } from 'etcd3';
import type { IKeyValue, IWatchResponse, Watcher, WatchBuilder } from 'etcd3';
import { once } from 'node:events';
import { WatchManager } from 'etcd3/lib/watch.js';
import { ConnectionPool } from 'etcd3/lib/connection-pool.js';
import type { FleetChange, FleetStore, FollowedRecord, KnownRecord, LeaderFence, RecordChange, SandboxChange, StoreWrite, Versioned, WatchBroke } from '../../domain/ports.ts';
import { isCompacted } from '../../domain/ports.ts';
import type { HostAllocRec, HostRec, OperationRec, SandboxRec, SnapshotRec } from '../../domain/records.ts';
import { isTerminal } from '../../domain/records.ts';
import { keys, PREFIX } from './keys.ts';
import { NotLeaderError, StoreFullError, StoreUnavailableError } from '../../domain/errors.ts';
import type { TlsClientPem } from '../../config.ts';
import { StoreDuplicateKeyError, StoreLimitError } from './errors.ts';

/**
 * Keys per page when listing a prefix: bounds what one range response holds in memory (records
 * stay under 2 KiB, up to ~14 KiB with the largest hooks and labels the API takes; a fork's op
 * up to ~40 KiB with its step log). The client takes messages of any size (ETCD_CHANNEL).
 */
const LIST_PAGE = 500;
const LIST_PAGE_OPS = 50;
/** Point reads per read-only transaction: under etcd's default --max-txn-ops of 128 (with the seed compare). */
const GET_BATCH = 100;

/**
 * Every watcher gets an 'error' listener: etcd3 emits 'error' when etcd cancels a watch (a
 * resume from a compacted revision after a reconnect, ADR 0017), and an EventEmitter
 * 'error' without a listener throws out of the gRPC stream and kills the process.
 *
 * Reports a watch that broke: etcd cancelled it ('error'), or its stream dropped
 * ('disconnected'). etcd3 resumes a dropped stream from the last response's header revision,
 * which may be past events not delivered yet (a watch still catching up from its start
 * revision): a follower that must see every change (a cache, an index, the ops to run, the
 * events) starts over (lists again) instead of trusting the resumed stream.
 * `onDisconnected` defaults to `onError`.
 */
function onBroken(w: Watcher, onError: WatchBroke | undefined, onDisconnected: WatchBroke | undefined = onError): void {
  w.on('error', (e) => {
    cancelled.add(w);
    onError?.(e);
  });
  if (onDisconnected) w.on('disconnected', (e: unknown) => onDisconnected(e ?? new Error('watch stream disconnected')));
}

/**
 * etcd3 (1.1.2, the newest) throws from its watch stream's 'data' handler, "Failed to find
 * watcher for IWatchResponse", when an answer arrives for a watcher it no longer tracks. That
 * happens around a reconnect after compaction: etcd cancels a watch that resumes from a
 * compacted revision, its caller cancels the sibling watches to list again, and a cancel
 * answer comes for a watcher the library has already dropped. The throw escapes the gRPC
 * stream and ends the process (seen in services/history.int.test.ts). An answer for a watcher
 * that is gone needs nothing done, so it is dropped here instead.
 */
function dropAnswersForGoneWatchers(): void {
  const proto = WatchManager.prototype as unknown as { handleResponse: (this: { watchers: Array<{ id: string | null }> }, res: IWatchResponse) => void; __ffPatched?: boolean };
  if (proto.__ffPatched) return;
  const handle = proto.handleResponse;
  proto.handleResponse = function (res) {
    if (!this.watchers.some((w) => w.id === res.watch_id)) return;
    handle.call(this, res);
  };
  proto.__ffPatched = true;
}
dropAnswersForGoneWatchers();

/**
 * etcd3 takes a stream's 'error' for a failure of its member (ConnectionPool.markFailed) and,
 * for a "recoverable" one (CANCELLED among them), closes every gRPC client it has to that
 * member. Its own cancel of a stream raises CANCELLED "Cancelled on client": the watch stream
 * it ends when its last watcher goes (a standby's wait for election, once elected), a lease
 * keepalive it stops. The closed channel's connection stays up for the streams still on it
 * (the election lease's keepalive, the new leader's watches) until its next keepalive ping,
 * refused on the closing session, makes grpc-js drop them all ~10 s later: every failover
 * broke the new leader's watches (it listed everything again) and its lease's keepalive. A
 * cancel this client made is no failure of the member: ignored here.
 */
function ignoreOwnCancels(): void {
  const proto = ConnectionPool.prototype as unknown as { markFailed: (this: unknown, resource: unknown, error: Error) => void; __ffPatched?: boolean };
  if (proto.__ffPatched) return;
  const markFailed = proto.markFailed;
  proto.markFailed = function (resource, error) {
    if (ownCancel(error)) return;
    markFailed.call(this, resource, error);
  };
  proto.__ffPatched = true;
}
ignoreOwnCancels();

/** A gRPC call this process cancelled itself (grpc-js's status for a local cancel). */
function ownCancel(error: unknown): boolean {
  const e = error as { code?: unknown; details?: unknown } | null;
  return typeof e === 'object' && e !== null && e.code === 1 && e.details === 'Cancelled on client';
}

/** Watchers etcd has cancelled (their 'error' came). */
const cancelled = new WeakSet<Watcher>();

/**
 * Cancels a watcher, unless etcd already did: etcd3 would send a cancel request for a watch
 * etcd no longer has, and keep the watcher among its closers until the next reconnect.
 */
function cancel(w: Watcher): void {
  if (cancelled.has(w)) return;
  cancelled.add(w);
  void w.cancel();
}

/**
 * Watchers of `builders` once etcd has confirmed each. etcd3's create() waits for that for ever
 * (an unreachable etcd only makes its stream reconnect, never an 'error'): a caller, e.g. an
 * API call's first WaitOperation or quota admission, hung until etcd came back. Given up on
 * after `ms`, the watchers opened so far cancelled, as StoreUnavailableError (retryable).
 */
async function openWatches(builders: readonly WatchBuilder[], ms: number): Promise<Watcher[]> {
  const watchers = builders.map((b) => b.watcher());
  const ac = new AbortController();
  let t: NodeJS.Timeout | undefined;
  const given = new Promise<never>((_, reject) => {
    t = setTimeout(() => reject(new StoreUnavailableError('watch', new Error(`etcd did not open a watch within ${ms} ms`))), ms);
  });
  // An 'error' of one watcher while the others open (once() stops listening to it when it is
  // connected) would have no listener, which ends the process: held here, and thrown.
  const errors: unknown[] = [];
  const onError = watchers.map((w) => (e: unknown): void => {
    cancelled.add(w); // etcd dropped it: no cancel request for it (cancel)
    errors.push(e);
  });
  watchers.forEach((w, i) => w.on('error', onError[i]!));
  try {
    // events.once rejects on the watcher's 'error' (etcd refused it) and lets go at the abort.
    const opened = watchers.map((w) => once(w, 'connected', { signal: ac.signal }));
    for (const o of opened) o.catch(() => undefined); // settled after the race when given up on
    await Promise.race([Promise.all(opened), given]);
    if (errors.length > 0) throw errors[0];
    return watchers;
  } catch (e) {
    for (const w of watchers) {
      // Given up on: an answer etcd still sends it (a create refused late, say) is an 'error'
      // with nobody left to hear it, which would end the process.
      w.on('error', () => undefined);
      cancel(w);
    }
    throw storeError('watch', e);
  } finally {
    clearTimeout(t);
    ac.abort();
    watchers.forEach((w, i) => w.off('error', onError[i]!));
  }
}

/**
 * The etcd limit a refused request is over, told by etcd's message: no retry gets it through.
 * - "etcdserver: too many operations in txn request" (INVALID_ARGUMENT): over --max-txn-ops.
 * - "etcdserver: request is too large" (INVALID_ARGUMENT): over --max-request-bytes.
 * - "grpc: received message larger than max (N vs. M)" (RESOURCE_EXHAUSTED): etcd's gRPC
 *   server refuses a message over --max-request-bytes + 512 KiB before etcd sees it.
 * - "etcdserver: duplicate key given in txn request" (INVALID_ARGUMENT): two writes of one key.
 */
function refusal(e: unknown): '--max-txn-ops' | '--max-request-bytes' | 'duplicate-key' | undefined {
  const msg = e instanceof Error ? e.message : '';
  if (msg.includes('too many operations in txn request')) return '--max-txn-ops';
  if (msg.includes('request is too large') || /received message (after decompression )?larger than max/.test(msg)) return '--max-request-bytes';
  if (msg.includes('duplicate key given in txn request')) return 'duplicate-key';
  return undefined;
}

/**
 * etcd's "not now" errors (a member gone, no raft leader, a request that timed out) as a
 * named, retryable error: the API answers UNAVAILABLE, not INTERNAL, and clients retry. A
 * request over one of etcd's limits (refusal) as a named error that is not retryable. Others
 * pass unchanged (compaction is told apart by its message, isCompacted).
 */
function storeError(what: string, e: unknown): unknown {
  // etcd3's circuit breakers (cockatiel) refuse calls to members that failed just before.
  const brokenCircuit = typeof e === 'object' && e !== null && (e as { isBrokenCircuitError?: unknown }).isBrokenCircuitError === true;
  const refused = refusal(e);
  if (refused === 'duplicate-key') return new StoreDuplicateKeyError(what, e);
  if (refused) return new StoreLimitError(what, refused, e);
  // Over etcd's request rate (too many requests) or its space quota (StoreFullError tells which).
  if (e instanceof GRPCResourceExhastedError) return new StoreFullError(what, e);
  return brokenCircuit || e instanceof GRPCUnavailableError || e instanceof GRPCDeadlineExceededError || e instanceof GRPCInternalError || e instanceof GRPCCancelledError ? new StoreUnavailableError(what, e) : e;
}

/**
 * Every key under `prefix`, read in pages of `page` keys, all at one store revision (`at`, or
 * the first page's), so the list is one consistent snapshot however long, and no one answer
 * holds a whole large prefix in memory at once. If the first page's revision is compacted
 * away meanwhile, the list starts again (three times). Errors pass unchanged.
 */
export async function readPrefixAt(client: Etcd3, prefix: string, page: number, at?: string): Promise<{ kvs: IKeyValue[]; revision: string }> {
  const end = Range.prefix(prefix).end;
  for (let attempt = 0; ; attempt++) {
    const kvs: IKeyValue[] = [];
    let start = Buffer.from(prefix);
    let rev: string | undefined = at;
    try {
      for (;;) {
        const b = client.getAll().inRange(new Range(start, end)).limit(page);
        const res = await (rev ? b.revision(rev) : b).exec();
        kvs.push(...res.kvs);
        const last = res.kvs[res.kvs.length - 1];
        rev ??= res.header.revision;
        if (!res.more || !last) return { kvs, revision: rev };
        start = Buffer.concat([last.key, Buffer.from([0])]);
      }
    } catch (e) {
      if (attempt < 3 && rev && !at && isCompacted(e)) continue;
      throw e;
    }
  }
}

function decode<T>(kv: IKeyValue): Versioned<T> {
  return { value: JSON.parse(kv.value.toString('utf8')) as T, modRevision: Number(kv.mod_revision) };
}

function keyOf(w: StoreWrite): string {
  switch (w.kind) {
    case 'sandbox':
      return keys.sandbox(w.value.tenantId, w.value.id);
    case 'snapshot':
      return keys.snapshot(w.value.tenantId, w.value.id);
    case 'op':
      return keys.op(w.value.tenantId, w.value.id);
    case 'host':
      return keys.host(w.value.id);
    case 'alloc':
      return keys.alloc(w.value.hostId);
    case 'idem':
      return keys.idem(w.tenantId, w.key);
    case 'delete-sandbox':
      return keys.sandbox(w.tenantId, w.id);
    case 'delete-op':
      return keys.op(w.tenantId, w.id);
    case 'delete-snapshot':
    case 'check-snapshot':
      return keys.snapshot(w.tenantId, w.id);
    case 'delete-host':
    case 'check-host':
      return keys.host(w.id);
    case 'delete-alloc':
      return keys.alloc(w.hostId);
    case 'delete-idem':
      return keys.idem(w.tenantId, w.key);
  }
}

/** What a write puts (a string), deletes (undefined) or leaves alone (null: a guard only). */
function valueOf(w: StoreWrite): string | undefined | null {
  switch (w.kind) {
    case 'check-host':
    case 'check-snapshot':
      return null;
    case 'idem':
      return w.opId;
    case 'delete-sandbox':
    case 'delete-op':
    case 'delete-snapshot':
    case 'delete-host':
    case 'delete-alloc':
    case 'delete-idem':
      return undefined;
    default:
      return JSON.stringify(w.value);
  }
}

/**
 * The etcd client's channel settings.
 * - Receive limit: grpc-js refuses any message over 4 MiB by default, and etcd sends a watch
 *   that resumes from an older revision up to 1,000 revisions' events in one message (with
 *   every key's previous value): a webhook dispatcher or a WatchEvents resuming behind a busy
 *   fleet got RESOURCE_EXHAUSTED, which ends the one watch stream every watcher of the client
 *   shares, and the same resume failed the same way again, for ever (holding compaction back
 *   at its cursor). A list page of large records (hooks, labels) could exceed it too, and the
 *   leader's start failed on every replica. The limit is Go clientv3's (math.MaxInt32).
 * - Keepalive pings (only while calls are open; etcd's --grpc-keepalive-min-time is 5 s): a
 *   member powered off or cut off sends no reset, and without pings the calls on it (a
 *   standby's wait for the leader's key to go, a lease grant) hung until TCP gave up.
 */
const ETCD_CHANNEL = {
  'grpc.max_receive_message_length': 2 ** 31 - 1,
  'grpc.keepalive_time_ms': 10_000,
  'grpc.keepalive_timeout_ms': 5_000,
};

/**
 * Each attempt of a unary etcd call ends after this: longer than etcd's own request timeout
 * (5 s + 2 x its election timeout, ~7 s by default), so a slow but live member answers itself,
 * and a member that went silent (no reset ever comes; keepalive covers calls on an open
 * connection, not one that never finishes its handshake) fails the call. etcd3 makes up to 4
 * attempts, each to another member where there is one. Streams (watches, lease keep-alives)
 * have no deadline.
 */
const ETCD_CALL_DEADLINE_MS = 10_000;

/**
 * etcd's require-leader metadata (`hasleader: true`, Go clientv3's WithRequireLeader, which
 * etcdctl and Kubernetes set on their watches). A member that lost its raft leader (cut off
 * from the others of a 3-member cluster) refuses a new watch that carries it, and ends an open
 * one (UNAVAILABLE, "etcdserver: no leader") once it has had no leader for 3 election
 * timeouts. Without it such a member keeps a watch stream open and silent for as long as it
 * has no leader, answering keepalive pings: nothing looked broken, and e.g. the leader's op
 * watch never saw the ops submitted through replicas on the other members. etcd3 reports the
 * stream's end as 'disconnected' to each of its watchers (onBroken: the callers list again and
 * watch again) and opens the stream again with backoff, each time on a member picked at random
 * (the one without a leader refuses it at once while it has none).
 * A call interceptor given in the Watch calls' own options (etcdCallOptions): etcd3 names the
 * service there, so no other call carries the metadata (services/adapters/etcd/store.test.ts
 * checks both on the wire).
 */
const requireLeader: Interceptor = (options, nextCall) =>
  new InterceptingCall(nextCall(options), {
    start(metadata, listener, next) {
      // A copy: with etcd authentication, etcd3 hands every call the same metadata object.
      const md = metadata.clone();
      md.set('hasleader', 'true');
      next(md, listener);
    },
  });

/**
 * Each etcd call's options: a Watch stream requires a leader (requireLeader); other streams
 * (lease keep-alives) have no deadline; a unary call has `callDeadlineMs` per attempt.
 */
export function etcdCallOptions(callDeadlineMs: number): (ctx: CallContext) => CallOptions {
  return (ctx) => (ctx.service === 'Watch' ? { interceptors: [requireLeader] } : ctx.isStream ? {} : { deadline: Date.now() + callDeadlineMs });
}

/**
 * Which failures etcd3's fault handling takes as the member's (retried elsewhere, counted by
 * the member's circuit breaker): its own choice (isRecoverableError), less a request over an
 * etcd limit (refusal). etcd3 takes every RESOURCE_EXHAUSTED as transient, so a request over
 * --max-request-bytes was sent 4 times, and counted against the member's breaker each time.
 */
const memberFault = handleWhen((e) => typeof e === 'object' && e !== null && isRecoverableError(e) && refusal(e) === undefined);

/**
 * etcd3's fault handling (its defaults, with memberFault). A circuit breaker on each member:
 * after 3 failures in a row it fails every call to that member for 5 s, so that calls go to
 * the others. With one member there are no others, and the breaker only kept the fleet
 * failing ~2.9 s after etcd was back (a restart); without it, the first read after etcd is
 * healthy again succeeds.
 */
function faultHandling(members: number): { global: IPolicy; host: () => IPolicy } {
  return {
    global: retry(memberFault, { maxAttempts: 3 }),
    host: members === 1 ? () => noop : () => circuitBreaker(memberFault, { halfOpenAfter: 5000, breaker: new ConsecutiveBreaker(3) }),
  };
}

export class EtcdFleetStore implements FleetStore {
  /** `watchOpenMs`: how long a new watch may wait for etcd (openWatches). */
  constructor(
    private readonly client: Etcd3,
    private readonly watchOpenMs = ETCD_CALL_DEADLINE_MS,
  ) {}

  /** One watcher, once etcd has it (openWatches). */
  private async openWatch(b: WatchBuilder): Promise<Watcher> {
    return (await openWatches([b], this.watchOpenMs))[0]!;
  }

  /**
   * A client of these endpoints. With `tls` it speaks TLS: the members are verified against
   * `tls.ca` (else the system roots), and `tls.cert` / `tls.key` is the client certificate a
   * member with client-certificate authentication asks for. Without it: plain text, or TLS
   * against the system roots when the endpoints are https:// (etcd3's own choice). `serverName`
   * (with `tls`): the name the members' certificates are checked against and sent as the TLS
   * server name, instead of each endpoint's host. `callDeadlineMs`: each unary call attempt's
   * deadline (ETCD_CALL_DEADLINE_MS; tests shorten it).
   */
  static connect(endpoints: string[], tls?: TlsClientPem, serverName = '', callDeadlineMs = ETCD_CALL_DEADLINE_MS): EtcdFleetStore {
    const credentials = tls ? { rootCertificate: tls.ca ?? Buffer.from(rootCertificates.join('\n')), ...(tls.cert && tls.key ? { certChain: tls.cert, privateKey: tls.key } : {}) } : undefined;
    const grpcOptions = { grpcOptions: { ...ETCD_CHANNEL, ...(tls && serverName ? { 'grpc.ssl_target_name_override': serverName } : {}) } };
    return new EtcdFleetStore(new Etcd3({ hosts: endpoints, dialTimeout: 3000, defaultCallOptions: etcdCallOptions(callDeadlineMs), ...(credentials ? { credentials } : {}), ...grpcOptions, faultHandling: faultHandling(endpoints.length) }), callDeadlineMs);
  }

  get etcd(): Etcd3 {
    return this.client;
  }

  /**
   * Fails with StoreLimitError when etcd's --max-txn-ops is under `ops` (a fork's placement
   * needs up to ~N + 2 x hosts + 4, services/README.md): for a start-up check, so that an etcd
   * left at its default of 128 is named at once, not by the first wide fork. One read-only
   * transaction of `ops` reads of a key that never exists (etcd counts a transaction's
   * compares and each branch's operations apart: this fills the then branch).
   */
  async checkTxnOps(ops = 1024): Promise<void> {
    const never = PREFIX + '__never__';
    try {
      await this.client.if(never, 'Version', '==', 0).then(...Array.from({ length: ops }, () => this.client.get(never))).commit();
    } catch (e) {
      throw storeError('start-up check of --max-txn-ops', e);
    }
  }

  close(): void {
    this.client.close();
  }

  /** Point reads asked for in the same turn of the event loop, read together (see getOne). */
  private pendingGets: Array<{ key: string; resolve: (kv: IKeyValue | undefined) => void; reject: (e: unknown) => void }> = [];

  /**
   * One key's record. Reads asked for in the same turn of the event loop (a fork's 64
   * children read with Promise.all, or the reads of several API calls handled together) go
   * to etcd as one read-only transaction of up to GET_BATCH range requests instead of one
   * call each: the same linearizable reads, all at one revision.
   */
  private async getOne<T>(key: string): Promise<Versioned<T> | undefined> {
    const kv = await this.getKv(key);
    return kv ? decode<T>(kv) : undefined;
  }

  private getKv(key: string): Promise<IKeyValue | undefined> {
    return new Promise<IKeyValue | undefined>((resolve, reject) => {
      if (this.pendingGets.push({ key, resolve, reject }) === 1) setImmediate(() => this.flushGets());
    });
  }

  private flushGets(): void {
    const all = this.pendingGets;
    this.pendingGets = [];
    for (let i = 0; i < all.length; i += GET_BATCH) {
      const batch = all.slice(i, i + GET_BATCH);
      const read: Promise<Array<IKeyValue | undefined>> =
        batch.length === 1
          ? this.client.get(batch[0]!.key).exec().then((res) => [res.kvs[0]])
          : this.client
              .if(PREFIX + '__never__', 'Version', '==', 0) // always-true seed compare
              .then(...batch.map((g) => this.client.get(g.key)))
              .commit()
              .then((res) => batch.map((_, j) => res.responses[j]?.response_range.kvs[0]));
      read.then(
        (kvs) => batch.forEach((g, j) => g.resolve(kvs[j])),
        (e: unknown) => batch.forEach((g) => g.reject(storeError('read', e))),
      );
    }
  }

  /**
   * Every record under `prefix`, read in pages of `page` keys (in key order), all at the
   * revision of the first page, so the list is one consistent snapshot as before. If that
   * revision is compacted away meanwhile, the list starts again.
   */
  private async getPrefix<T>(prefix: string, page = LIST_PAGE): Promise<Versioned<T>[]> {
    return (await this.getPrefixAt<T>(prefix, page)).records;
  }

  /** getPrefix, with the store revision the list was read at (`at`: that revision, no retry). */
  private async getPrefixAt<T>(prefix: string, page = LIST_PAGE, at?: string): Promise<{ records: Versioned<T>[]; revision: string }> {
    try {
      const { kvs, revision } = await readPrefixAt(this.client, prefix, page, at);
      return { records: kvs.map((kv) => decode<T>(kv)), revision };
    } catch (e) {
      throw storeError('list', e);
    }
  }

  getSandbox(tenantId: string, id: string): Promise<Versioned<SandboxRec> | undefined> {
    return this.getOne(keys.sandbox(tenantId, id));
  }
  listSandboxes(tenantId: string | undefined): Promise<Versioned<SandboxRec>[]> {
    return this.getPrefix(keys.sandboxes(tenantId));
  }
  async listSandboxesAfter(tenantId: string, afterId: string, limit: number): Promise<{ records: Versioned<SandboxRec>[]; more: boolean }> {
    const prefix = keys.sandboxes(tenantId);
    const start = afterId ? Buffer.concat([Buffer.from(prefix + afterId), Buffer.from([0])]) : Buffer.from(prefix);
    try {
      const res = await this.client.getAll().inRange(new Range(start, Range.prefix(prefix).end)).limit(limit).exec();
      return { records: res.kvs.map((kv) => decode<SandboxRec>(kv)), more: res.more };
    } catch (e) {
      throw storeError('list', e);
    }
  }
  getSnapshot(tenantId: string, id: string): Promise<Versioned<SnapshotRec> | undefined> {
    return this.getOne(keys.snapshot(tenantId, id));
  }
  listSnapshots(tenantId: string | undefined): Promise<Versioned<SnapshotRec>[]> {
    return this.getPrefix(keys.snapshots(tenantId));
  }
  getOp(tenantId: string, id: string): Promise<Versioned<OperationRec> | undefined> {
    return this.getOne(keys.op(tenantId, id));
  }
  async listOps(filter: { activeOnly: boolean; tenantId?: string }): Promise<Versioned<OperationRec>[]> {
    const all = await this.getPrefix<OperationRec>(keys.ops(filter.tenantId), LIST_PAGE_OPS);
    return filter.activeOnly ? all.filter((o) => !isTerminal(o.value.state)) : all;
  }
  getHost(id: string): Promise<Versioned<HostRec> | undefined> {
    return this.getOne(keys.host(id));
  }
  listHosts(): Promise<Versioned<HostRec>[]> {
    return this.getPrefix(keys.hosts());
  }
  async getAlloc(hostId: string): Promise<Versioned<HostAllocRec>> {
    return (
      (await this.getOne<HostAllocRec>(keys.alloc(hostId))) ?? {
        value: { hostId, allocated: { vcpus: 0, memoryMib: 0, diskMib: 0 }, sandboxes: 0 },
        modRevision: 0,
      }
    );
  }
  listAllocs(): Promise<Versioned<HostAllocRec>[]> {
    return this.getPrefix(keys.allocs());
  }
  async getIdempotent(tenantId: string, key: string): Promise<string | undefined> {
    return (await this.getKv(keys.idem(tenantId, key)))?.value.toString('utf8');
  }

  async commit(writes: readonly StoreWrite[]): Promise<boolean> {
    return (await this.commitAt(writes)) > 0;
  }

  async commitAt(writes: readonly StoreWrite[], fence?: LeaderFence): Promise<number> {
    if (writes.length === 0) return 1;
    const ns = this.client;
    let txn = ns.if(PREFIX + '__never__', 'Version', '==', 0); // always-true seed compare
    if (fence) txn = txn.and(fence.key, 'Create', '==', fence.createRevision);
    for (const w of writes) {
      if (w.expectRevision !== undefined) txn = txn.and(keyOf(w), 'Mod', '==', w.expectRevision);
    }
    // Each value is serialised once: a fork's txn carries its children's whole records.
    const changes: StoreWrite[] = [];
    const values: Array<string | undefined> = [];
    for (const w of writes) {
      const v = valueOf(w);
      if (v === null) continue;
      changes.push(w);
      values.push(v);
    }
    const ops = changes.map((w, i) => {
      const v = values[i];
      return v === undefined ? ns.delete().key(keyOf(w)) : ns.put(keyOf(w)).value(v);
    });
    // When a guard fails, the else branch reads, at that same revision, the fence key (a lost
    // leadership is not a conflict) and every key this transaction puts. etcd3 retries a call
    // whose answer was lost (its retry policy: unavailable, internal, cancelled), and a retry
    // of a transaction etcd had applied fails its own guards. Such a transaction is
    // recognised, and the revision it landed at returned instead of a false conflict (a
    // placement retried on that conflict would find its own children in the way and fail,
    // leaving them booked and starting forever), when:
    // - a sandbox or op record it puts is there exactly as written, at some revision R (those
    //   records carry the time of the write: a different change does not leave equal bytes);
    // - every key it puts is as written at R, or was changed or deleted after R (capacity
    //   records change all the time).
    // Anything else is a conflict.
    const puts = changes.flatMap((w, i) => (values[i] === undefined ? [] : [{ key: keyOf(w), value: values[i]!, recognisable: w.kind === 'sandbox' || w.kind === 'op' }]));
    const recognisable = puts.some((p) => p.recognisable);
    const reads = [...(fence ? [ns.get(fence.key)] : []), ...(recognisable ? puts.map((p) => ns.get(p.key)) : [])];
    const res = await (reads.length > 0 ? txn.then(...ops).else(...reads) : txn.then(...ops)).commit().catch((e: unknown) => {
      // A write etcd did not answer may or may not have been applied: the error says so
      // (unavailable, retryable), and the caller's guards decide what a retry does.
      throw storeError('write', e);
    });
    if (res.succeeded) return Number(res.header.revision);
    if (recognisable) {
      const got = res.responses.slice(fence ? 1 : 0).map((r) => r.response_range?.kvs[0]);
      const same = (i: number): boolean => got[i] !== undefined && got[i]!.value.toString() === puts[i]!.value;
      const mark = puts.findIndex((p, i) => p.recognisable && same(i));
      const at = mark >= 0 ? Number(got[mark]!.mod_revision) : 0;
      if (at > 0 && puts.every((_, i) => got[i] === undefined || (Number(got[i]!.mod_revision) === at ? same(i) : Number(got[i]!.mod_revision) > at))) return at;
    }
    if (fence && Number(res.responses[0]?.response_range?.kvs[0]?.create_revision ?? 0) !== fence.createRevision) throw new NotLeaderError();
    return 0;
  }

  async followRecords(onChange: (c: FollowedRecord) => void, onRevision: (revision: number) => void, onError: (e: unknown) => void): Promise<() => void> {
    const kinds = [
      [keys.sandboxes(), 'sandbox'],
      [keys.snapshots(), 'snapshot'],
      [keys.ops(), 'op'],
    ] as const;
    // The three lists at one revision (the first one's; a compaction meanwhile starts over).
    let lists: Array<{ records: Versioned<never>[]; revision: string }> = [];
    for (let attempt = 0; ; attempt++) {
      try {
        const first = await this.getPrefixAt<never>(kinds[0][0]);
        lists = [first, ...(await Promise.all(kinds.slice(1).map(([p]) => this.getPrefixAt<never>(p, p === keys.ops() ? LIST_PAGE_OPS : LIST_PAGE, first.revision))))];
        break;
      } catch (e) {
        if (attempt < 3 && isCompacted(e)) continue;
        throw e;
      }
    }
    const revision = Number(lists[0]!.revision);
    kinds.forEach(([, kind], i) => {
      for (const v of lists[i]!.records) {
        const rec = v.value as { tenantId: string; id: string };
        onChange({ kind, key: `${rec.tenantId}/${rec.id}`, value: v.value } as FollowedRecord);
      }
    });
    onRevision(revision);
    // Every key under the prefix, so every revision made by the fleet is seen (onRevision).
    const w = await this.openWatch(this.client.watch().prefix(PREFIX).startRevision(String(revision + 1)));
    const change = (kv: IKeyValue, deleted: boolean): void => {
      const key = kv.key.toString('utf8');
      const k = kinds.find(([p]) => key.startsWith(p));
      if (!k) return;
      const rest = key.slice(k[0].length);
      onChange({ kind: k[1], key: rest, ...(deleted ? {} : { value: decode<never>(kv).value }) } as FollowedRecord);
    };
    w.on('put', (kv) => change(kv, false));
    w.on('delete', (kv) => change(kv, true));
    // After the response's put/delete events (emitted first, by the watcher's own listener).
    w.on('data', (res) => {
      const last = res.events[res.events.length - 1];
      if (last) onRevision(Number(last.kv.mod_revision));
    });
    onBroken(w, onError);
    return () => cancel(w);
  }

  /** Whether etcd no longer has revision `rev` (compaction removed it). */
  async compactedPast(rev: number): Promise<boolean> {
    try {
      await this.client.get(PREFIX + '__never__').revision(String(rev)).exec();
      return false;
    } catch (e) {
      return isCompacted(e);
    }
  }

  async revision(): Promise<number> {
    // A read of a key that never exists: the answer's header carries the store revision.
    // Classified as every other read: quota admission asks for it, and a raw etcd error
    // there answered INTERNAL (not retried) during an etcd blip.
    try {
      return Number((await this.client.get(PREFIX + '__never__').exec()).header.revision);
    } catch (e) {
      throw storeError('read', e);
    }
  }

  async compact(revision: number): Promise<void> {
    try {
      await this.client.kv.compact({ revision: String(revision) });
    } catch (e) {
      // Compacted already (by us, another replica or etcd's own auto-compaction): done.
      if (isCompacted(e)) return;
      throw storeError('compact', e);
    }
  }

  async watchOps(onOp: (op: OperationRec, modRevision: number) => void, opts: { only?: (tenantId: string, id: string, modRevision: number) => boolean; onError?: WatchBroke } = {}): Promise<() => void> {
    const prefix = keys.ops();
    const w = await this.openWatch(this.client.watch().prefix(prefix));
    onBroken(w, opts.onError);
    const only = opts.only;
    w.on('put', (kv) => {
      if (only) {
        // <prefix><tenant>/<id>: filter by key, so unwanted records are never decoded.
        const rest = kv.key.toString('utf8').slice(prefix.length);
        const slash = rest.lastIndexOf('/');
        if (!only(rest.slice(0, slash), rest.slice(slash + 1), Number(kv.mod_revision))) return;
      }
      const d = decode<OperationRec>(kv);
      onOp(d.value, d.modRevision);
    });
    return () => cancel(w);
  }

  async followSandboxes(onChange: (c: SandboxChange) => void, onError: (e: unknown) => void = () => undefined, opts: { known?: KnownRecord } = {}): Promise<() => void> {
    const prefix = keys.sandboxes();
    const { records, revision } = await this.getPrefixAt<SandboxRec>(prefix);
    for (const value of records) onChange({ kind: 'put', value });
    // From the revision after the list's: no change is missed or seen twice.
    const w = await this.openWatch(this.client.watch().prefix(prefix).startRevision(String(Number(revision) + 1)));
    // etcd cancelled the watch (e.g. its start revision was compacted): changes may be missed from here on.
    onBroken(w, onError);
    const known = opts.known;
    w.on('put', (kv) => {
      if (known && known(kv.key.toString('utf8').slice(prefix.length), Number(kv.mod_revision))) return;
      onChange({ kind: 'put', value: decode<SandboxRec>(kv) });
    });
    w.on('delete', (kv) => {
      // <prefix><tenant>/<id>
      const rest = kv.key.toString('utf8').slice(prefix.length);
      const slash = rest.lastIndexOf('/');
      onChange({ kind: 'delete', tenantId: rest.slice(0, slash), id: rest.slice(slash + 1), revision: Number(kv.mod_revision) });
    });
    return () => cancel(w);
  }

  async watchFleet(onChange: (c: FleetChange) => void, opts: { known?: (kind: FleetChange['kind'], key: string, modRevision: number) => boolean; onError?: WatchBroke } = {}): Promise<() => void> {
    const prefixes = [keys.hosts(), keys.allocs(), keys.snapshots()] as const;
    const watchers = await openWatches(prefixes.map((p) => this.client.watch().prefix(p)), this.watchOpenMs);
    for (const w of watchers) onBroken(w, opts.onError);
    const kinds = ['host', 'alloc', 'snapshot'] as const;
    const known = opts.known;
    watchers.forEach((w, i) => {
      const kind = kinds[i] as (typeof kinds)[number];
      const prefix = prefixes[i] as string;
      w.on('put', (kv) => {
        if (known && known(kind, kv.key.toString('utf8').slice(prefix.length), Number(kv.mod_revision))) return;
        onChange({ kind, value: decode<never>(kv) } as FleetChange);
      });
      // Snapshot records expire (ADR 0017); a removed host's record and alloc go (RemoveHost).
      w.on('delete', (kv) => onChange({ kind: 'gone', of: kind, key: kv.key.toString('utf8').slice(prefix.length), revision: Number(kv.mod_revision) }));
    });
    return () => {
      for (const w of watchers) cancel(w);
    };
  }

  async watchRecords(onChange: (c: RecordChange) => void, opts: { fromRevision?: number; onError?: WatchBroke; onProgress?: (revision: number) => void } = {}): Promise<() => void> {
    // One watcher over the whole prefix, so changes arrive in revision order across kinds
    // (the webhook cursor relies on it).
    const b = this.client.watch().prefix(PREFIX).withPreviousKV();
    const w = await this.openWatch(opts.fromRevision ? b.startRevision(String(opts.fromRevision)) : b);
    const from = opts.fromRevision;
    // etcd cancels a watch from a compacted revision with an empty reason: a read at that
    // revision says whether that was why, so the caller can tell (isCompacted) and say so.
    onBroken(w, from ? (e) => void this.compactedPast(from).then((gone) => opts.onError?.(gone && !isCompacted(e) ? new Error(`watch from revision ${from}: required revision has been compacted`) : e)) : opts.onError, opts.onError);
    const kinds = [
      [keys.sandboxes(), 'sandbox'],
      [keys.snapshots(), 'snapshot'],
      [keys.ops(), 'op'],
    ] as const;
    w.on('put', (kv, previous) => {
      const key = kv.key.toString('utf8');
      const kind = kinds.find(([p]) => key.startsWith(p))?.[1];
      if (!kind) return;
      const d = decode<never>(kv);
      const prev = previous && previous.value.length > 0 ? (decode<never>(previous).value as unknown) : undefined;
      onChange({ kind, value: d.value, revision: d.modRevision, ...(prev ? { prev } : {}) } as RecordChange);
    });
    const onProgress = opts.onProgress;
    // After the watcher's own 'data' listener has emitted the response's puts (it was added
    // first): the stream is in revision order, so every change up to the response's last one
    // has been passed on; a response without events is etcd's progress notice, whose header
    // revision says the same.
    if (onProgress) w.on('data', (res) => onProgress(res.events.length ? Math.max(...res.events.map((e) => Number(e.kv.mod_revision))) : Number(res.header.revision)));
    return () => cancel(w);
  }
}
