// FleetService handlers: validate, convert, call the use case (CONVENTIONS.md §10).
import { create } from '@bufbuild/protobuf';
import { FleetService } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import type {
  CordonHostRequest,
  RemoveHostRequest,
  CreateSandboxRequest,
  DeleteSnapshotRequest,
  DestroySandboxRequest,
  DrainHostRequest,
  ExecRequest,
  ForkSandboxRequest,
  GetOperationRequest,
  GetTenantUsageRequest,
  ListOperationsRequest,
  GetSandboxRequest,
  GetSnapshotRequest,
  HibernateSandboxRequest,
  ListHostsRequest,
  ListSandboxesRequest,
  ListSnapshotsRequest,
  PauseSandboxRequest,
  PinSnapshotRequest,
  ReadFileRequest,
  ResumeSandboxRequest,
  SetSnapshotRetentionRequest,
  SnapshotSandboxRequest,
  UnpinSnapshotRequest,
  WaitOperationRequest,
  CancelOperationRequest,
  WatchEventsRequest,
  WriteFileRequest,
} from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import { EventSchema, EventType } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import { Spread } from '../../../proto/gen/forkfleet/v1/common_pb.ts';
import { InvalidArgumentError, ForkfleetError } from '../../../proto/errors.ts';
import type { Fleet } from '../../domain/fleet.ts';
import type { Clock, FleetStore } from '../../domain/ports.ts';
import { isCompacted } from '../../domain/ports.ts';
import { eventsOf } from '../../domain/events.ts';
import type { OperationRec } from '../../domain/records.ts';
import { register } from './rpc.ts';
import type { CallContext, ServiceRegistration } from './rpc.ts';
import { AsyncQueue } from './queue.ts';
import * as c from './convert.ts';
import { requireAdmin, tenantFor } from '../../auth/guard.ts';
import { PermissionDeniedError, UnauthenticatedError } from '../../auth/errors.ts';
import { RelayedHostError } from '../../domain/errors.ts';

/**
 * Events a WatchEvents stream holds for a client that does not read them (flow control holds
 * the writes) before it ends the stream with RESOURCE_EXHAUSTED: ~1 MB per stream.
 */
const WATCH_EVENTS_MAX_QUEUED = 4096;

/**
 * A WatchEvents stream that sent nothing for this long gets a progress marker (an Event with
 * only its revision set): every event of the watch up to that revision was sent. Without it a
 * watch whose filter matches rarely keeps an old resume point, which the store compacts away
 * (every 5 min by default): a stream that broke then could not be resumed.
 */
export const WATCH_PROGRESS_MS = 30_000;

/**
 * How long a WriteFile may go without a message from its client before it is ended
 * (RESOURCE_EXHAUSTED, as a stream whose client stops reading is: STREAM_STALL_MS in rpc.ts),
 * the file budget it held given back and nothing written. A hung client stays connected
 * (keepalive pings are answered by its HTTP/2 library, not by it), and rpc.ts watches only
 * what goes to the client: its upload held its budget for as long as the connection lasted.
 */
export const WRITE_FILE_IDLE_MS = 60_000;

/** How long before a WaitOperation call's deadline it answers with the operation as it is. */
const WAIT_ANSWER_MARGIN_MS = 500;

export interface FleetServiceDeps {
  fleet: Fleet;
  store: FleetStore;
  clock: Clock;
  /** File bytes held at once for WriteFile and ReadFile, all calls together (FF_FILE_BUFFER_MAX). */
  fileBufferBytes?: number;
  /** WATCH_PROGRESS_MS, for tests. */
  watchProgressMs?: number;
  /** WRITE_FILE_IDLE_MS, for tests. */
  writeFileIdleMs?: number;
}

/** Sandboxes (fork children) the operations of one ListOperations page answer with, at most. */
const OPS_PAGE_MAX_SANDBOXES = 1024;

/**
 * Bytes a replica may hold at once for file calls. A WriteFile is held whole until its last
 * piece (it goes to the host as one message), a ReadFile until its caller has read it: without
 * a bound, a few hundred callers could make a replica hold their files at once and run it out of
 * memory for every tenant. One tenant holds at most `tenantShare` of it (half, or one largest
 * file if that is more), so one tenant alone cannot take it all; two can. What bounds how long
 * they keep it is time: an upload that sends nothing for WRITE_FILE_IDLE_MS, and a reader that
 * takes nothing for STREAM_STALL_MS (rpc.ts), are ended and give back what they held.
 */
export class ByteBudget {
  private used = 0;
  private readonly byTenant = new Map<string, number>();
  readonly tenantShare: number;
  constructor(readonly limit: number, largestFile = 0) {
    this.tenantShare = Math.max(Math.floor(limit / 2), Math.min(limit, largestFile));
  }
  /** Takes `n` bytes for `tenant`, or throws RESOURCE_EXHAUSTED (retryable, naming `field`) if they do not fit. */
  take(tenant: string, n: number, field: string): void {
    const mine = this.byTenant.get(tenant) ?? 0;
    if (mine + n > this.tenantShare) throw new ForkfleetError('resource_exhausted', `tenant ${tenant}'s file transfers hold ${mine} of the ${this.tenantShare} bytes one tenant may hold on this scheduler (half of FF_FILE_BUFFER_MAX); retry once they end`, { retryable: true, field });
    if (this.used + n > this.limit) throw new ForkfleetError('resource_exhausted', `this scheduler holds ${this.used} of its ${this.limit} bytes for file transfers (FF_FILE_BUFFER_MAX); retry shortly`, { retryable: true, field });
    this.used += n;
    this.byTenant.set(tenant, mine + n);
  }
  give(tenant: string, n: number): void {
    this.used = Math.max(0, this.used - n);
    const left = (this.byTenant.get(tenant) ?? 0) - n;
    if (left > 0) this.byTenant.set(tenant, left);
    else this.byTenant.delete(tenant);
  }
  get inUse(): number {
    return this.used;
  }
}

/**
 * A WriteFile's pieces, held until the last one. Pieces under BLOCK/4 are copied into shared
 * blocks, empty ones dropped: kept one array each, a stream of millions of tiny or empty
 * pieces cost ~100 bytes of heap per piece that the byte budget never saw (a 64 MiB file in
 * one-byte pieces is gigabytes of heap). A block sealed less than half full is copied to its
 * size, so small and large pieces taking turns hold at most about twice what they count.
 */
export class FilePieces {
  static readonly BLOCK = 64 * 1024;
  private readonly parts: Uint8Array[] = [];
  private block: Uint8Array | undefined;
  private fill = 0;
  /** Arrays held (for tests): at most about size / (BLOCK/4) + 2. */
  get arrays(): number {
    return this.parts.length + (this.block ? 1 : 0);
  }
  add(piece: Uint8Array): void {
    if (piece.length === 0) return;
    if (piece.length >= FilePieces.BLOCK / 4) {
      this.seal();
      this.parts.push(piece);
      return;
    }
    if (this.block && this.fill + piece.length > this.block.length) this.seal();
    this.block ??= new Uint8Array(FilePieces.BLOCK);
    this.block.set(piece, this.fill);
    this.fill += piece.length;
  }
  /** The whole file; the pieces are let go. */
  join(): Buffer {
    this.seal();
    const whole = Buffer.concat(this.parts);
    this.parts.length = 0;
    return whole;
  }
  /** Keeps the filled part of the block: a copy when it is less than half (a view would keep all 64 KiB alive for a few bytes). */
  private seal(): void {
    if (this.block && this.fill > 0) this.parts.push(this.fill < FilePieces.BLOCK / 2 ? this.block.slice(0, this.fill) : this.block.subarray(0, this.fill));
    this.block = undefined;
    this.fill = 0;
  }
}

/** The iterator's next item; or, once `stop` aborts, its reason (a read still pending is left to the call's end). */
function nextUnless<T>(it: AsyncIterator<T>, stop: AbortSignal): Promise<IteratorResult<T>> {
  if (stop.aborted) return Promise.reject(stop.reason as Error);
  return new Promise((resolve, reject) => {
    const onStop = (): void => reject(stop.reason as Error);
    stop.addEventListener('abort', onStop, { once: true });
    it.next().then(resolve, reject).finally(() => stop.removeEventListener('abort', onStop));
  });
}

/** Reads the records an operation's result refers to, for the response (a just-submitted sandbox op's target is at hand). */
async function opResponse(deps: FleetServiceDeps, op: OperationRec): ReturnType<typeof c.toOperation> extends infer T ? Promise<T> : never {
  const ids = op.result?.sandboxIds ?? (op.kind !== 'fork' && op.targetId.startsWith('sb-') ? [op.targetId] : []);
  const known = deps.fleet.sandboxAtSubmit(op);
  // Only a kind whose answer shows it: a fork's (its source, or the snapshot it took) was read
  // for every ForkSandbox, GetOperation and WaitOperation answer and not used.
  const snapId = c.SNAPSHOT_RESULT_KINDS.has(op.kind) ? (op.result?.snapshotId ?? (op.targetId.startsWith('sn-') ? op.targetId : undefined)) : undefined;
  // Issued in the same tick, so the store sends them to etcd as one batched read.
  const [sbs, snap] = await Promise.all([
    Promise.all(ids.map((id) => (known?.id === id ? { value: known } : deps.store.getSandbox(op.tenantId, id)))),
    snapId ? deps.store.getSnapshot(op.tenantId, snapId) : undefined,
  ]);
  const sandboxes = sbs.flatMap((v) => (v ? [v.value] : []));
  return c.toOperation(op, { sandboxes, snapshot: snap?.value }, deps.clock.now());
}

function sandboxOpInput(req: { tenantId: string; idempotencyKey: string; sandboxId: string }, tenantId: string): { tenantId: string; idempotencyKey: string; sandboxId: string } {
  return { tenantId, idempotencyKey: c.idemKey(req.idempotencyKey), sandboxId: c.id('sb', req.sandboxId, 'sandbox_id') };
}

export function fleetService(deps: FleetServiceDeps): ServiceRegistration {
  const { fleet } = deps;
  const files = new ByteBudget(deps.fileBufferBytes ?? 512 << 20, c.LIMITS.maxFileBytes);
  const op = (o: OperationRec) => opResponse(deps, o);
  // Served only behind a CallGuard (services/auth/guard.ts) that sets ctx.principal; a call
  // without one is refused (fail closed). A request's tenant is its tenant_id checked
  // against the caller's credential: empty means the credential's own tenant.
  const principal = (ctx: CallContext): NonNullable<CallContext['principal']> => {
    if (!ctx.principal) throw new UnauthenticatedError('no credentials');
    return ctx.principal;
  };
  const tenant = (v: string, ctx: CallContext, field = 'tenant_id'): string => tenantFor(principal(ctx), v === '' ? '' : c.tenant(v, field), field);
  const admin = (ctx: CallContext, what: string, field?: string): void => requireAdmin(principal(ctx), what, field);
  /** A list of every tenant's records: admin only, and with no tenant_id. */
  const allTenants = (req: { tenantId: string; allTenants: boolean }, ctx: CallContext, rpc: string): boolean => {
    if (!req.allTenants) return false;
    admin(ctx, `${rpc} with all_tenants`, 'all_tenants');
    if (req.tenantId) throw new InvalidArgumentError('tenant_id', 'must be empty with all_tenants');
    return true;
  };
  // Pinning a sandbox to a named host is for operators (tests, debugging a host), not tenants.
  // Locality is relative to the hosts that hold a snapshot: a sandbox booted from an image has none.
  const imagePlacement = (source: string | undefined, p: ReturnType<typeof c.placement>): ReturnType<typeof c.placement> => {
    if (source === 'image' && p.locality !== 'ANY') throw new InvalidArgumentError('placement.locality', 'means where a snapshot is held; a sandbox booted from an image has none (leave it unset, or set placement.host_id)');
    return p;
  };
  // A create places one sandbox: spread and max_per_host say how a fork's children share hosts.
  const createPlacement = (p: CreateSandboxRequest['placement']): void => {
    if ((p?.spread ?? Spread.UNSPECIFIED) !== Spread.UNSPECIFIED) throw new InvalidArgumentError('placement.spread', 'only for a fork (how its children share hosts); a create places one sandbox: leave it unset');
    if ((p?.maxPerHost ?? 0) !== 0) throw new InvalidArgumentError('placement.max_per_host', 'only for a fork (how many of its children one host may take); a create places one sandbox: leave it unset');
  };
  const placementFor = (p: Parameters<typeof c.placement>[0], ctx: CallContext): ReturnType<typeof c.placement> => {
    const out = c.placement(p);
    if (out.hostId && !principal(ctx).admin) throw new PermissionDeniedError('placement.host_id needs an admin credential', 'placement.host_id');
    return out;
  };
  return register(FleetService, {
    async createSandbox(req: CreateSandboxRequest, ctx: CallContext) {
      const tenantId = tenant(req.tenantId, ctx);
      const key = c.idemKey(req.idempotencyKey);
      if (req.source.case === undefined) throw new InvalidArgumentError('source', 'set image or snapshot_id');
      const lc = c.lifecycle(req.lifecycle);
      createPlacement(req.placement);
      return op(
        await fleet.createSandbox({
          tenantId,
          idempotencyKey: key,
          image: req.source.case === 'image' ? c.image(req.source.value) : '',
          snapshotId: req.source.case === 'snapshotId' ? c.id('sn', req.source.value, 'snapshot_id') : '',
          resources: c.resources(req.resources),
          // diskMib only when set: the request digest of a create without it stays as it was.
          resourcesSet: { vcpus: (req.resources?.vcpus ?? 0) !== 0, memoryMib: (req.resources?.memoryMib ?? 0n) !== 0n, ...((req.resources?.diskMib ?? 0n) !== 0n ? { diskMib: true } : {}) },
          labels: c.labels(req.labels),
          ttlMs: lc.ttlMs,
          idleTimeoutMs: lc.idleTimeoutMs,
          afterResume: lc.afterResume,
          ...c.network(req.network),
          placement: imagePlacement(req.source.case, placementFor(req.placement, ctx)),
          hostname: c.hostname(req.hostname),
        }),
      );
    },
    async getSandbox(req: GetSandboxRequest, ctx: CallContext) {
      return c.toSandbox(await fleet.getSandbox(tenant(req.tenantId, ctx), c.id('sb', req.sandboxId, 'sandbox_id')), deps.clock.now());
    },
    async listSandboxes(req: ListSandboxesRequest, ctx: CallContext) {
      const after = c.pageToken(req.pageToken, c.SANDBOXES_BY_ID);
      const states = c.enumFilter(req.states, 'states', c.sandboxState);
      const hostId = req.hostId ? c.hostId(req.hostId) : '';
      const labels = c.labels(req.labels, 'labels', true);
      if (allTenants(req, ctx, 'ListSandboxes')) {
        const all = await fleet.listSandboxes(undefined, states, labels, hostId);
        const { items, nextPageToken } = c.page(all, req.pageSize, after, c.SANDBOXES_BY_ID);
        return { sandboxes: items.map((s) => c.toSandbox(s, deps.clock.now())), nextPageToken };
      }
      // One tenant's: read from the page's start on, not the whole list for every page.
      const { items, more } = await fleet.listSandboxPage(tenant(req.tenantId, ctx), states, labels, hostId, after, c.pageSizeOf(req.pageSize, c.SANDBOXES_BY_ID));
      const last = items[items.length - 1];
      return { sandboxes: items.map((s) => c.toSandbox(s, deps.clock.now())), nextPageToken: more && last ? c.tokenOf(last, c.SANDBOXES_BY_ID) : '' };
    },
    async *exec(req: ExecRequest, ctx: CallContext) {
      const tenantId = tenant(req.tenantId, ctx);
      if (req.idempotencyKey) c.idemKey(req.idempotencyKey);
      if (req.stdin.length > c.LIMITS.maxStdinBytes) throw new InvalidArgumentError('stdin', `at most ${c.LIMITS.maxStdinBytes} bytes`);
      if (req.cwd) c.guestPath(req.cwd, 'cwd');
      const timeoutMs = c.durationMs(req.timeout, 'timeout', { min: 1, max: c.LIMITS.maxExecTimeoutMs }) ?? c.LIMITS.defaultExecTimeoutMs;
      const input = { tenantId, sandboxId: c.id('sb', req.sandboxId, 'sandbox_id'), argv: c.argv(req.argv), env: c.env(req.env), cwd: req.cwd, stdin: req.stdin, timeoutMs };
      for await (const out of fleet.exec(input, ctx.signal)) {
        switch (out.payload.case) {
          case 'stdout':
            yield { payload: { case: 'stdout' as const, value: out.payload.value } };
            break;
          case 'stderr':
            yield { payload: { case: 'stderr' as const, value: out.payload.value } };
            break;
          case 'exit':
            yield { payload: { case: 'exit' as const, value: { exitCode: out.payload.value.exitCode, signal: out.payload.value.signal, timedOut: out.payload.value.timedOut, outputTruncated: out.payload.value.outputTruncated, duration: c.durationOfMs(out.payload.value.durationMs) } } };
            return;
          case 'error':
            // The host had the request: the command may have started (a guest channel that
            // broke mid-run), and an Exec is not deduplicated, so a retry could run it twice.
            // Not retryable whatever the host's error says; the caller decides. (Its refusal
            // before the command started, the VM not running, gets here only when the sandbox's
            // record has not moved, nothing holds it and the host did not call it passing
            // (unavailable): Fleet.exec re-sends the others or answers them retryable.)
            throw new RelayedHostError(out.payload.value.kind, out.payload.value.message, { retryable: false, ...(out.payload.value.field ? { field: out.payload.value.field } : {}) });
        }
      }
    },
    async writeFile(reqs: AsyncIterable<WriteFileRequest>, ctx: CallContext) {
      let header: { tenantId: string; sandboxId: string; path: string; mode: number } | undefined;
      const parts = new FilePieces();
      let size = 0;
      let held = 0;
      // The header's check reads etcd (seconds, when it is slow): data is read on meanwhile and
      // taken from the budget as it comes. Left unread, it would wait in the call's buffers
      // (dozens of messages of up to FF_GRPC_MAX_RECV each), held by the replica but counted
      // nowhere. A refusal ends the call at once, the stream still open.
      let checked: Promise<void> = Promise.resolve();
      const refused = new AbortController();
      // A client that sends nothing for idleMs is ended as refused (its budget given back once,
      // below); the timer restarts with each message, and stops once the last one is in.
      const idleMs = deps.writeFileIdleMs ?? WRITE_FILE_IDLE_MS;
      const idle = setTimeout(() => refused.abort(new ForkfleetError('resource_exhausted', `WriteFile: the upload sent nothing for ${idleMs / 1000}s: send its pieces as they come, then call again`)), idleMs);
      idle.unref();
      const it = reqs[Symbol.asyncIterator]();
      try {
        for (let next = await nextUnless(it, refused.signal); !next.done; next = await nextUnless(it, refused.signal)) {
          idle.refresh();
          const r = next.value;
          if (r.payload.case === 'header') {
            if (header) throw new InvalidArgumentError('header', 'sent twice');
            const h = r.payload.value;
            if (h.mode > 0o7777) throw new InvalidArgumentError('header.mode', 'permission bits: at most 07777 (0: the guest default)');
            header = { tenantId: tenant(h.tenantId, ctx, 'header.tenant_id'), sandboxId: c.id('sb', h.sandboxId, 'header.sandbox_id'), path: c.guestFilePath(h.path, 'header.path', true), mode: h.mode };
            if (h.idempotencyKey) c.idemKey(h.idempotencyKey, 'header.idempotency_key');
            // A sandbox that does not exist, or that will not run to take the file, is refused
            // as soon as this says so, whatever data has come by then.
            checked = fleet.checkWritable(header.tenantId, header.sandboxId, 'header.sandbox_id');
            checked.catch((e: unknown) => refused.abort(e));
          } else if (r.payload.case === 'data') {
            if (!header) throw new InvalidArgumentError('header', 'the first message must be the header');
            size += r.payload.value.length;
            if (size > c.LIMITS.maxFileBytes) throw new InvalidArgumentError('data', `files are at most ${c.LIMITS.maxFileBytes} bytes`);
            files.take(header.tenantId, r.payload.value.length, 'data');
            held += r.payload.value.length;
            parts.add(r.payload.value);
          } else {
            throw new InvalidArgumentError('payload', 'set header or data');
          }
        }
        clearTimeout(idle);
        if (!header) throw new InvalidArgumentError('header', 'missing');
        await checked;
        // The pieces go as soon as they are joined: the file is held once, not twice.
        const whole = parts.join();
        const written = await fleet.writeFile(header.tenantId, header.sandboxId, header.path, header.mode, whole, ctx.signal);
        return { bytesWritten: BigInt(written) };
      } finally {
        clearTimeout(idle);
        // As a for-await does: the request stream is let go (a read still pending ends with the call).
        void it.return?.().catch(() => undefined);
        if (header) files.give(header.tenantId, held);
      }
    },
    async *readFile(req: ReadFileRequest, ctx: CallContext) {
      const max = req.maxBytes === 0n ? c.LIMITS.maxFileBytes : Number(req.maxBytes);
      if (!(max > 0 && max <= c.LIMITS.maxFileBytes)) throw new InvalidArgumentError('max_bytes', `must be at most ${c.LIMITS.maxFileBytes}`);
      // Held from the first piece read until the caller has read it all (or gone): refused,
      // piece by piece, when the replica holds too much.
      let held = 0;
      const tenantId = tenant(req.tenantId, ctx);
      try {
        const data = await fleet.readFile(tenantId, c.id('sb', req.sandboxId, 'sandbox_id'), c.guestFilePath(req.path), max, req.maxBytes === 0n, (n) => {
          files.take(tenantId, n, 'max_bytes');
          held += n;
        }, ctx.signal);
        const piece = 256 * 1024;
        for (let off = 0; off < data.length; off += piece) yield { data: data.subarray(off, off + piece) };
        if (data.length === 0) yield { data: new Uint8Array() };
      } finally {
        files.give(tenantId, held);
      }
    },
    async pauseSandbox(req: PauseSandboxRequest, ctx: CallContext) {
      return op(await fleet.pauseSandbox(sandboxOpInput(req, tenant(req.tenantId, ctx))));
    },
    async resumeSandbox(req: ResumeSandboxRequest, ctx: CallContext) {
      return op(await fleet.resumeSandbox(sandboxOpInput(req, tenant(req.tenantId, ctx))));
    },
    async hibernateSandbox(req: HibernateSandboxRequest, ctx: CallContext) {
      if (req.replicas > c.LIMITS.maxReplicas) throw new InvalidArgumentError('replicas', `at most ${c.LIMITS.maxReplicas}`);
      return op(await fleet.hibernateSandbox({ ...sandboxOpInput(req, tenant(req.tenantId, ctx)), replicas: req.replicas }));
    },
    async snapshotSandbox(req: SnapshotSandboxRequest, ctx: CallContext) {
      if ((req.retention?.keepLast ?? 0) > c.LIMITS.maxKeepLast) throw new InvalidArgumentError('retention.keep_last', `at most ${c.LIMITS.maxKeepLast}`);
      return op(
        await fleet.snapshotSandbox({
          ...sandboxOpInput(req, tenant(req.tenantId, ctx)),
          pin: req.pin,
          keepLast: req.retention?.keepLast ?? 0,
          retentionTtlMs: c.durationMs(req.retention?.ttl, 'retention.ttl', { min: 1000 }),
          labels: c.labels(req.labels),
        }),
      );
    },
    async forkSandbox(req: ForkSandboxRequest, ctx: CallContext) {
      const tenantId = tenant(req.tenantId, ctx);
      const key = c.idemKey(req.idempotencyKey);
      if (req.source.case === undefined) throw new InvalidArgumentError('source', 'set snapshot_id or sandbox_id');
      if (req.count < 1 || req.count > c.LIMITS.maxForkCount) throw new InvalidArgumentError('count', `must be between 1 and ${c.LIMITS.maxForkCount}`);
      const sr = req.snapshotRetention;
      if (sr && req.source.case === 'snapshotId') throw new InvalidArgumentError('snapshot_retention', 'only a fork of a live sandbox (sandbox_id) takes a snapshot; set a snapshot\'s own retention with SetSnapshotRetention');
      if ((sr?.keepLast ?? 0) > c.LIMITS.maxKeepLast) throw new InvalidArgumentError('snapshot_retention.keep_last', `at most ${c.LIMITS.maxKeepLast}`);
      const snapshotRetention = sr ? { ttlMs: c.durationMs(sr.ttl, 'snapshot_retention.ttl', { min: 1000 }), keepLast: sr.keepLast } : undefined;
      const placement = placementFor(req.placement, ctx);
      // Pinned to one host, the children can never be placed if fewer than all of them may go there.
      if (placement.hostId && placement.maxPerHost > 0 && placement.maxPerHost < req.count) throw new InvalidArgumentError('placement.max_per_host', `${placement.maxPerHost} per host with placement.host_id set cannot place ${req.count} children`);
      return op(
        await fleet.forkSandbox({
          tenantId,
          idempotencyKey: key,
          snapshotId: req.source.case === 'snapshotId' ? c.id('sn', req.source.value, 'snapshot_id') : '',
          sandboxId: req.source.case === 'sandboxId' ? c.id('sb', req.source.value, 'sandbox_id') : '',
          count: req.count,
          placement,
          labels: c.labels(req.labels),
          ...(({ ttlMs, idleTimeoutMs, afterResume }) => ({ ttlMs, idleTimeoutMs, afterResume: afterResume.length ? afterResume : null }))(c.lifecycle(req.lifecycle)),
          ...(snapshotRetention ? { snapshotRetention } : {}),
        }),
      );
    },
    async destroySandbox(req: DestroySandboxRequest, ctx: CallContext) {
      return op(await fleet.destroySandbox(sandboxOpInput(req, tenant(req.tenantId, ctx))));
    },
    watchEvents(req: WatchEventsRequest, ctx: CallContext) {
      const tenantId = tenant(req.tenantId, ctx);
      const sandboxId = req.sandboxId ? c.id('sb', req.sandboxId, 'sandbox_id') : '';
      c.enumFilter(req.types, 'types', (t, field) => {
        if (!(t in EventType) || t === EventType.UNSPECIFIED) throw new InvalidArgumentError(field, `unknown event type ${t}`);
        // Reserved in the proto: a filter for it would wait on a stream that never carries one.
        if (t === EventType.HOST_STATE_CHANGED) throw new InvalidArgumentError(field, 'HOST_STATE_CHANGED is never emitted to a tenant: ListHosts and the forkfleet_hosts metric carry host states');
      });
      const types = new Set(req.types);
      if (req.afterRevision < 0n || req.afterRevision > BigInt(Number.MAX_SAFE_INTEGER)) throw new InvalidArgumentError('after_revision', 'a store revision (0: from now)');
      const after = Number(req.afterRevision);
      const q = new AsyncQueue<ReturnType<typeof c.toEvent>>();
      let stop: (() => void) | undefined;
      /**
       * The store revision the stream replays after: `after`, or for a watch from now the store's
       * revision when it began, sent at once as a progress marker (below).
       */
      let from = after;
      /** The revision of the last event (or progress marker) queued: the stream ends only between revisions, so a client resumes exactly. */
      let lastQueued = after;
      /** The store revision the watch has gone past: every change up to it was looked at (other tenants' and kinds' too). */
      let passed = after;
      /**
       * Whether the store's watch passed anything on (a change of any key, or its progress). A
       * cancel reported as "compacted" is about the watch's start only before that: one that has
       * run a while is cancelled so when compaction overtakes it, and then the last revision
       * queued may still be a good resume point (the webhook dispatcher tells them apart alike).
       */
      let delivered = false;
      let queuedAt = Date.now();
      const progressMs = deps.watchProgressMs ?? WATCH_PROGRESS_MS;
      const mark = (revision: number): void => {
        q.push(create(EventSchema, { revision: BigInt(revision), tenantId }));
        lastQueued = revision;
        queuedAt = Date.now();
      };
      const progress = setInterval(() => {
        if (q.isEnded) return void clearInterval(progress);
        if (passed <= lastQueued || q.size > 0 || Date.now() - queuedAt < progressMs) return;
        mark(passed);
      }, Math.max(10, progressMs >> 1));
      // A resumed watch replays every change after `after` (from the store's history), then goes on.
      const broke = (e: unknown): void => {
        clearInterval(progress);
        stop?.();
        if (q.isEnded) return;
        if (after > 0 && !delivered && isCompacted(e)) q.fail(new ForkfleetError('failed_precondition', `revision ${after} is compacted away: read the current state, then watch from now (after_revision 0)`, { field: 'after_revision' }));
        else q.fail(new ForkfleetError('unavailable', `the store's event stream broke off: resume with after_revision ${lastQueued}`, { cause: e }));
      };
      const start = async (): Promise<void> => {
        const now = await deps.store.revision();
        // A revision the store has not reached (one from another etcd cluster, or one restored
        // from an older backup) would silently skip every event up to it.
        if (after > now) throw new InvalidArgumentError('after_revision', `revision ${after} is ahead of the store (at ${now}): it comes from another store, or one restored since`);
        // A sandbox the tenant does not have (a typo, another tenant's id) would hold a stream
        // slot for good with nothing ever to send. A resume may follow one whose record went.
        if (sandboxId && after === 0 && !(await deps.store.getSandbox(tenantId, sandboxId))) throw new ForkfleetError('not_found', `sandbox ${sandboxId} not found`, { field: 'sandbox_id' });
        // From now is from the store's revision now, told to the client at once: a stream that
        // breaks before its first event then resumes from there, not from "now" again (which
        // lost what happened while it was down).
        if (after === 0 && now > 0 && !q.isEnded) {
          from = passed = now;
          mark(now);
        }
      };
      void start()
        .then(() =>
          // From `from` itself, not the revision after it, and its changes skipped: etcd tells a
          // change from a create by the previous value it reads at the revision before the
          // change, so replaying the changes after `from` needs `from` still in the store's
          // history. A watch from a compacted revision is cancelled ("compacted", below); one
          // from the revision after it opened, and a sandbox destroyed there came out as
          // sandbox_created (ADR 0017).
          deps.store.watchRecords(
            (ch) => {
              delivered = true;
              // The call ended (cancelled, or failed below): etcd may still deliver until its cancel lands.
              if (q.isEnded || ch.value.tenantId !== tenantId || ch.revision <= from) return;
              // A client that does not read (HTTP/2 flow control holds the writes) must not grow
              // this replica's memory without bound: its stream ends at a revision boundary.
              if (ch.revision > lastQueued && q.size >= WATCH_EVENTS_MAX_QUEUED) {
                stop?.();
                clearInterval(progress);
                q.fail(new ForkfleetError('resource_exhausted', `${q.size} events wait unread: read faster, or resume with after_revision ${lastQueued}`));
                return;
              }
              for (const e of eventsOf(ch, deps.clock.now())) {
                const ev = c.toEvent(e);
                if (sandboxId && ev.sandboxId !== sandboxId) continue;
                if (types.size && !types.has(ev.type)) continue;
                q.push(ev);
                lastQueued = ch.revision;
                queuedAt = Date.now();
              }
            },
            {
              ...(from > 0 ? { fromRevision: from } : {}),
              onError: broke,
              onProgress: (rev) => {
                delivered = true;
                passed = Math.max(passed, rev);
              },
            },
          ),
        )
        .then(
          (s) => {
            stop = s;
            if (ctx.signal.aborted || q.isEnded) s();
          },
          (e: unknown) => (e instanceof InvalidArgumentError || (e instanceof ForkfleetError && e.kind === 'not_found') ? (clearInterval(progress), q.fail(e)) : broke(e)),
        );
      ctx.signal.addEventListener('abort', () => {
        clearInterval(progress);
        stop?.();
        q.end();
      });
      return q;
    },
    async getSnapshot(req: GetSnapshotRequest, ctx: CallContext) {
      return c.toSnapshot(await fleet.getSnapshot(tenant(req.tenantId, ctx), c.id('sn', req.snapshotId, 'snapshot_id')));
    },
    async listSnapshots(req: ListSnapshotsRequest, ctx: CallContext) {
      const after = c.pageToken(req.pageToken, c.SNAPSHOTS_BY_ID);
      const lineage = req.lineageId ? c.id('sb', req.lineageId, 'lineage_id') : '';
      const all = await fleet.listSnapshots(tenant(req.tenantId, ctx), lineage);
      const { items, nextPageToken } = c.page(all, req.pageSize, after, c.SNAPSHOTS_BY_ID);
      return { snapshots: items.map((x) => c.toSnapshot(x)), nextPageToken };
    },
    async pinSnapshot(req: PinSnapshotRequest, ctx: CallContext) {
      c.idemKey(req.idempotencyKey);
      return c.toSnapshot(await fleet.pinSnapshot(tenant(req.tenantId, ctx), c.id('sn', req.snapshotId, 'snapshot_id'), true));
    },
    async unpinSnapshot(req: UnpinSnapshotRequest, ctx: CallContext) {
      c.idemKey(req.idempotencyKey);
      return c.toSnapshot(await fleet.pinSnapshot(tenant(req.tenantId, ctx), c.id('sn', req.snapshotId, 'snapshot_id'), false));
    },
    async setSnapshotRetention(req: SetSnapshotRetentionRequest, ctx: CallContext) {
      c.idemKey(req.idempotencyKey);
      // Unset would read as "keep forever" (no ttl, no keep_last): that must be asked for, as an empty Retention.
      if (!req.retention) throw new InvalidArgumentError('retention', 'required: the retention to set (an empty one keeps the snapshot until it is deleted)');
      const keepLast = req.retention.keepLast;
      if (keepLast > c.LIMITS.maxKeepLast) throw new InvalidArgumentError('retention.keep_last', `at most ${c.LIMITS.maxKeepLast}`);
      return c.toSnapshot(await fleet.setRetention(tenant(req.tenantId, ctx), c.id('sn', req.snapshotId, 'snapshot_id'), c.durationMs(req.retention.ttl, 'retention.ttl', { min: 1000 }), keepLast));
    },
    async deleteSnapshot(req: DeleteSnapshotRequest, ctx: CallContext) {
      return op(await fleet.deleteSnapshot(tenant(req.tenantId, ctx), c.idemKey(req.idempotencyKey), c.id('sn', req.snapshotId, 'snapshot_id')));
    },
    async listHosts(req: ListHostsRequest, ctx: CallContext) {
      admin(ctx, 'ListHosts');
      const states = c.enumFilter(req.states, 'states', c.hostState);
      return { hosts: (await fleet.listHosts(states)).map((h) => c.toHost(h.host, h.alloc, h.live)) };
    },
    async cordonHost(req: CordonHostRequest, ctx: CallContext) {
      admin(ctx, 'CordonHost');
      c.idemKey(req.idempotencyKey);
      const h = await fleet.cordonHost(c.hostId(req.hostId), req.cordon);
      return c.toHost(h.host, h.alloc, h.live);
    },
    async drainHost(req: DrainHostRequest, ctx: CallContext) {
      admin(ctx, 'DrainHost');
      return op(await fleet.drainHost(c.idemKey(req.idempotencyKey), c.hostId(req.hostId), req.migrate));
    },
    async removeHost(req: RemoveHostRequest, ctx: CallContext) {
      admin(ctx, 'RemoveHost');
      return fleet.removeHost(c.hostId(req.hostId));
    },
    async getTenantUsage(req: GetTenantUsageRequest, ctx: CallContext) {
      const tenantId = tenant(req.tenantId, ctx);
      const { usage, quota, rate } = await fleet.tenantUsage(tenantId);
      return {
        tenantId,
        sandboxes: usage.sandboxes,
        memoryMib: BigInt(usage.memoryMib),
        snapshotBytes: BigInt(usage.snapshotBytes),
        quota: {
          ...(quota.sandboxes !== undefined ? { sandboxes: quota.sandboxes } : {}),
          ...(quota.memoryMib !== undefined ? { memoryMib: BigInt(quota.memoryMib) } : {}),
          ...(quota.snapshotBytes !== undefined ? { snapshotBytes: BigInt(quota.snapshotBytes) } : {}),
        },
        ratePerSecond: rate?.perSecond ?? 0,
        rateBurst: rate?.burst ?? 0,
      };
    },
    async getOperation(req: GetOperationRequest, ctx: CallContext) {
      return op(await fleet.getOperation(tenant(req.tenantId, ctx), c.id('op', req.operationId, 'operation_id')));
    },
    async listOperations(req: ListOperationsRequest, ctx: CallContext) {
      const tenantId = allTenants(req, ctx, 'ListOperations') ? undefined : tenant(req.tenantId, ctx);
      const filter = {
        states: c.enumFilter(req.states, 'states', c.operationState),
        kinds: c.enumFilter(req.kinds, 'kinds', c.operationKind),
        targetId: req.targetId ? c.operationTarget(req.targetId, 'target_id') : '',
      };
      const after = c.pageToken(req.pageToken, c.NEWEST_OPERATION_FIRST);
      // Each fork in the page answers with its children, each read from the store: a page holds
      // at most OPS_PAGE_MAX_SANDBOXES of them (100 forks of 256 would be 25,600 reads and an
      // answer over the send limit).
      const { items, nextPageToken } = c.page(await fleet.listOperations(tenantId, filter), req.pageSize, after, c.NEWEST_OPERATION_FIRST, {
        weight: (o) => o.result?.sandboxIds?.length ?? 0,
        max: OPS_PAGE_MAX_SANDBOXES,
      });
      return { operations: await Promise.all(items.map(op)), nextPageToken };
    },
    async cancelOperation(req: CancelOperationRequest, ctx: CallContext) {
      return op(await fleet.cancelOperation(tenant(req.tenantId, ctx), c.id('op', req.operationId, 'operation_id')));
    },
    async waitOperation(req: WaitOperationRequest, ctx: CallContext) {
      const asked = c.durationMs(req.timeout, 'timeout', { max: c.LIMITS.maxWaitMs }) ?? c.LIMITS.defaultWaitMs;
      // Within the call's own deadline (less a margin for the answer): a client with a shorter
      // deadline than `timeout` gets the operation as it is then, not DEADLINE_EXCEEDED.
      const timeoutMs = ctx.deadline ? Math.max(0, Math.min(asked, ctx.deadline.getTime() - Date.now() - WAIT_ANSWER_MARGIN_MS)) : asked;
      return op(await fleet.waitOperation(tenant(req.tenantId, ctx), c.id('op', req.operationId, 'operation_id'), timeoutMs, ctx.signal));
    },
  });
}
