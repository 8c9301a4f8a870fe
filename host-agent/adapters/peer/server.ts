// ChunkTransferService: how a host agent serves snapshot chunks to its peers. Thin gRPC
// handlers: check the ticket, convert, read the store. Every call needs a ticket the
// scheduler signed for this snapshot and for the calling host; otherwise nothing is served.
// A FetchChunks stream opened in time serves nothing later than STREAM_GRACE_MS past its
// ticket's expiry: each want and each chunk sent checks it again, and a quiet stream ends
// then too (permission_denied), also when its client has stopped reading (ctx.end: the
// handler is then paused at a `yield`). Its open message must come within openWithinMs (30 s).
//
// Each caller host has at most maxMigrationsPerCaller MigrateSnapshot calls (each may start a
// QEMU here), maxManifestReadsPerCaller GetManifest calls and maxStreamsPerCaller FetchChunks
// streams served at once; past that a call fails resource_exhausted (retryable). Its ticket is
// checked first: one that can never pass is refused as such, never as busy. Before any
// ticket is shown, at most maxOpening FetchChunks streams (of all callers) wait for their open
// message, and the server takes requests of at most PEER_MAX_REQUEST_BYTES and
// peerMaxConcurrentStreams calls per connection (peerServerChannelOptions): grpc-js's defaults
// let one unauthenticated connection hold 1000 calls of up to 16 MiB each.
//
// The caller's host id comes from `callerHostId(ctx)`. The default reads the `ff-host-id`
// metadata; with mutual TLS (FF_PEER_*) the agent takes it from the caller's certificate
// (tls.ts certificateHostId).
import type { Logger } from 'pino';
import type { MessageInitShape } from '@bufbuild/protobuf';
import { ChunkTransferService } from '../../../proto/gen/forkfleet/v1/transfer_pb.ts';
import type { FetchChunksRequest, FetchChunksResponseSchema } from '../../../proto/gen/forkfleet/v1/transfer_pb.ts';
import { register } from '../../../services/adapters/grpc/rpc.ts';
import type { CallContext, ServiceRegistration } from '../../../services/adapters/grpc/rpc.ts';
import { isIP } from 'node:net';
import { ForkfleetError, InvalidArgumentError } from '../../../proto/errors.ts';
import { MAX_TIMER_MS } from '../../../services/config.ts';
import type { ChunkStore, Clock, DigestHex, EncodedChunk, ManifestStore } from '../../domain/snapshot-store.ts';
import { manifestDigests } from '../../domain/snapshot-store.ts';
import { ManifestNotFoundError, TicketInvalidError } from '../../domain/transfer-errors.ts';
import { passingSystemError } from '../../errors.ts';
import { assertTicketLive, decodeManifestUnverified, verifyTicket, type TrustedKeys } from '../../domain/tickets.ts';
import { hostOfAddress } from '../../domain/agent.ts';
import { serializeResponse, type WireResponse } from './wire.ts';
import { ConcurrencyLimiter } from '../../../services/auth/limits.ts';

export const HOST_ID_METADATA = 'ff-host-id';

/**
 * The largest request a peer sends (grpc.max_receive_message_length): a ticket is ~200 bytes,
 * a want of a receiver's window (64 digests) ~2.3 KiB; 64 KiB takes a want of ~1900. A larger
 * one is refused resource_exhausted from its length prefix, before it is buffered or decoded.
 */
export const PEER_MAX_REQUEST_BYTES = 64 * 1024;

/** Chunks asked for on one stream and not yet sent, at most (a receiver asks for about its window, 64, and as many hedged). */
export const MAX_PENDING_WANTS = 4096;

/**
 * Calls open at once on one peer connection (grpc.max_concurrent_streams; a client queues those
 * past it): a caller's FetchChunks streams, migrations and manifest reads, and a few more
 * (health checks, streams whose end the server has not seen yet), at least 64.
 */
export function peerMaxConcurrentStreams(maxStreamsPerCaller = 16): number {
  return Math.max(64, maxStreamsPerCaller + 16);
}

/** The peer server's channel options (startGrpcServer's channelOptions): see PEER_MAX_REQUEST_BYTES and peerMaxConcurrentStreams. */
export function peerServerChannelOptions(maxStreamsPerCaller?: number): { 'grpc.max_receive_message_length': number; 'grpc.max_concurrent_streams': number } {
  return { 'grpc.max_receive_message_length': PEER_MAX_REQUEST_BYTES, 'grpc.max_concurrent_streams': peerMaxConcurrentStreams(maxStreamsPerCaller) };
}

export interface ChunkServerDeps {
  readonly chunks: ChunkStore;
  readonly manifests: ManifestStore;
  readonly trust: TrustedKeys;
  readonly clock: Clock;
  readonly log?: Logger;
  readonly callerHostId?: (ctx: CallContext) => string;
  /** Chunk reads started ahead of sending (bounded by the caller's credit; default 16). */
  readonly prefetch?: number;
  /**
   * How long a FetchChunks stream may take to send its first (open) message (default 30 s):
   * until then nobody has shown a ticket, and a stream that sends nothing would stay open.
   */
  readonly openWithinMs?: number;
  /** STREAM_GRACE_MS unless set (tests). */
  readonly streamGraceMs?: number;
  /**
   * MigrateSnapshot calls served at once per caller host (default 4). A destination migrates
   * at most FF_MIGRATE_MAX_CHILDREN (2) VMs of one restore step at once, all from the source
   * that took the snapshot: 4 is two such steps at once. A call over it is refused
   * (resource_exhausted, retryable): the destination tries its next source or fetches.
   */
  readonly maxMigrationsPerCaller?: number;
  /**
   * FetchChunks streams served at once per caller host (default 16). A receiver opens
   * streamsPerSource (2) per source per fetch, and runs at most FF_STEP_CONCURRENCY (default
   * 4) steps at once, each with one fetch (a restore by migration's disk layer is one more):
   * 8 to 10 at the defaults; 16 leaves room for a stream whose end the server has not seen yet
   * when its receiver reconnects. A stream over it is refused (resource_exhausted,
   * retryable): the receiver's other streams go on, and it tries this one again.
   */
  readonly maxStreamsPerCaller?: number;
  /**
   * GetManifest calls served at once per caller host (default 4): a receiver reads a
   * snapshot's manifest once per fetch, from one source. A call over it is refused
   * (resource_exhausted, retryable).
   */
  readonly maxManifestReadsPerCaller?: number;
  /**
   * FetchChunks streams of all callers waiting for their open message at once (default 256):
   * until it comes nobody has shown a ticket (nor is counted in maxStreamsPerCaller), and each
   * may hold a partial request of up to PEER_MAX_REQUEST_BYTES for openWithinMs. A stream over
   * it is refused (resource_exhausted, retryable).
   */
  readonly maxOpening?: number;
  /** Observes every chunk served (metrics, tests). */
  readonly onServed?: (digest: DigestHex, bytes: number) => void;
  /**
   * Restore by migration (ADR 0015): migrate a paused clone of the snapshot to `target`.
   * Absent: MigrateSnapshot is refused and callers fetch chunks instead.
   */
  readonly migrate?: (snapshotId: string, target: { host: string; port: number; hostId: string }, signal: AbortSignal) => Promise<{ bytes: number; ms: number }>;
}

export interface ChunkServerStats {
  chunksServed: number;
  bytesServed: number;
  refused: number;
  /** Calls refused because their caller had as many open as it may (CallerBusyError). */
  busy: number;
}

/** A caller host has as many calls of a kind open here as it may: retry once one has ended. */
export class CallerBusyError extends ForkfleetError {
  constructor(callerHostId: string, what: string, max: number) {
    super('resource_exhausted', `host ${JSON.stringify(callerHostId)} has ${max} ${what} open on this host, the most it may; retry once one has ended`, { retryable: true });
  }
}

type Response = MessageInitShape<typeof FetchChunksResponseSchema>;

/** The IP address in a grpc-js peer string ("10.0.0.2:5123", "[fd00::2]:5123", "ipv4:..."). */
export function peerHost(peer: string): string | undefined {
  const host = hostOfAddress(peer.replace(/^ipv[46]:/, ''));
  return isIP(host) ? plainAddress(host) : undefined;
}

/**
 * How long past its ticket's expiry a FetchChunks stream opened in time is still served. The
 * scheduler signs a step's ticket once (10 minutes) and re-sends the step with it, so a
 * transfer under way when the ticket expires goes on; a stream kept open with the ticket
 * (a leaked one, say) ends within this.
 */
export const STREAM_GRACE_MS = 10 * 60_000;

/** An IPv4-mapped IPv6 address ("::ffff:10.0.0.2") as the IPv4 address; others unchanged. */
export function plainAddress(ip: string): string {
  return ip.startsWith('::ffff:') && isIP(ip.slice(7)) === 4 ? ip.slice(7) : ip;
}

function defaultCallerHostId(ctx: CallContext): string {
  const v = ctx.metadata.get(HOST_ID_METADATA)[0];
  return typeof v === 'string' ? v : '';
}

class Notifier {
  private waiters: Array<() => void> = [];
  notify(): void {
    for (const w of this.waiters.splice(0)) w();
  }
  wait(): Promise<void> {
    return new Promise((r) => this.waiters.push(r));
  }
}

export function chunkTransferService(deps: ChunkServerDeps): { registration: ServiceRegistration; stats: ChunkServerStats } {
  const stats: ChunkServerStats = { chunksServed: 0, bytesServed: 0, refused: 0, busy: 0 };
  const caller = deps.callerHostId ?? defaultCallerHostId;
  const prefetch = deps.prefetch ?? 16;
  // FsChunkStore reads into pooled buffers that serializeResponse recycles (buffers.ts).
  const forSend = (deps.chunks as Partial<{ getEncodedForSend(d: DigestHex): Promise<EncodedChunk | undefined> }>).getEncodedForSend;
  const readForSend = forSend ? forSend.bind(deps.chunks) : (d: DigestHex) => deps.chunks.getEncoded(d);

  // Calls of one kind open per caller host (ConcurrencyLimiter: at most `max` each).
  const migrations = { what: 'snapshot migrations', open: new ConcurrencyLimiter(deps.maxMigrationsPerCaller ?? 4) };
  const streams = { what: 'chunk streams', open: new ConcurrencyLimiter(deps.maxStreamsPerCaller ?? 16) };
  const manifestReads = { what: 'manifest reads', open: new ConcurrencyLimiter(deps.maxManifestReadsPerCaller ?? 4) };
  const maxOpening = deps.maxOpening ?? 256;
  let opening = 0;
  /** Counts a call of ctx's caller in `slots` (CallerBusyError when it has its most open); returns its release. */
  const takeSlot = (slots: { what: string; open: ConcurrencyLimiter }, ctx: CallContext): (() => void) => {
    const host = caller(ctx);
    const release = slots.open.acquire(host);
    if (release) return release;
    const e = new CallerBusyError(host, slots.what, slots.open.max);
    stats.busy++;
    deps.log?.warn({ peer: ctx.peer, callerHostId: host, err: e.message }, 'peer call refused: its caller has too many open');
    throw e;
  };

  const refuse = (e: unknown, ctx: CallContext): never => {
    stats.refused++;
    deps.log?.warn({ peer: ctx.peer, err: (e as Error).message }, 'chunk transfer refused');
    throw e;
  };

  /** The ticket's claims, checked before the caller's slot is taken: a bad ticket is refused as such, never as busy. */
  const checked = (ticket: Parameters<typeof verifyTicket>[0], ctx: CallContext): ReturnType<typeof verifyTicket> => {
    try {
      return verifyTicket(ticket, deps.trust, { now: deps.clock.now(), destinationHostId: caller(ctx) });
    } catch (e) {
      return refuse(e, ctx);
    }
  };

  const manifestOf = async (claims: ReturnType<typeof verifyTicket>, ctx: CallContext) => {
    // This host failing to read its own manifest (EIO, EMFILE) refuses nothing: one that may
    // pass is retryable, as a failed chunk read is, so the receiver tries this source again
    // (an internal error makes it give the source up).
    const signed = await deps.manifests.get(claims.snapshotId).catch((e: unknown) => {
      deps.log?.warn({ peer: ctx.peer, snapshotId: claims.snapshotId, err: (e as Error).message }, 'reading a manifest to serve failed');
      throw passingSystemError(e, `reading the manifest of ${claims.snapshotId}`) ?? e;
    });
    return signed ?? refuse(new ManifestNotFoundError(claims.snapshotId), ctx);
  };

  const registration = register(ChunkTransferService, {
    async getManifest(req, ctx) {
      // Counted while its manifest is read (a slow disk, a manifest of many chunks): the
      // caller's calls otherwise pile up here without bound.
      const claims = checked(req.ticket, ctx);
      const release = takeSlot(manifestReads, ctx);
      try {
        return { manifest: await manifestOf(claims, ctx) };
      } finally {
        release();
      }
    },

    async migrateSnapshot(req, ctx) {
      const claims = checked(req.ticket, ctx);
      // Only a ticket the scheduler signed for migration starts a QEMU here: a fetch-only one
      // (a drain's copy or a fan-out relay, which must end up holding the snapshot) is refused.
      if (!claims.allowMigration) {
        stats.refused++;
        deps.log?.warn({ peer: ctx.peer, snapshotId: claims.snapshotId }, 'migration refused: the ticket allows fetching only');
        throw new TicketInvalidError('the ticket allows fetching chunks only, not migration');
      }
      // Counted from before its manifest is read, as getManifest's reads are: the caller's
      // calls otherwise pile up on a slow manifest read without bound.
      const release = takeSlot(migrations, ctx);
      try {
        await manifestOf(claims, ctx);
        const migrate = deps.migrate;
        if (!migrate) throw new ForkfleetError('failed_precondition', 'this host does not migrate snapshots out; fetch the chunks');
        if (!Number.isInteger(req.port) || req.port < 1 || req.port > 65535) throw new InvalidArgumentError('port', 'must be 1..65535');
        // The stream goes only to the address the call came from: a ticket holder cannot aim it elsewhere.
        const host = peerHost(ctx.peer);
        if (!host) throw new ForkfleetError('failed_precondition', `cannot tell the caller's address from ${ctx.peer}`);
        // hostId: the caller the ticket was checked against (with peer TLS, its certificate's CN).
        // The caller's cancel (it gave up waiting) stops the stream.
        const r = await migrate(claims.snapshotId, { host, port: req.port, hostId: caller(ctx) }, ctx.signal);
        deps.log?.info({ snapshotId: claims.snapshotId, to: `${host}:${req.port}`, bytes: r.bytes, ms: r.ms }, 'snapshot migrated to a peer');
        return { bytes: BigInt(r.bytes), millis: r.ms };
      } finally {
        release();
      }
    },

    async *fetchChunks(reqs: AsyncIterable<FetchChunksRequest>, ctx: CallContext): AsyncIterable<Response> {
      const it = reqs[Symbol.asyncIterator]();
      const openWithinMs = deps.openWithinMs ?? 30_000;
      let timer: ReturnType<typeof setTimeout> | undefined;
      if (opening >= maxOpening) {
        stats.busy++;
        deps.log?.warn({ peer: ctx.peer, maxOpening }, 'chunk stream refused: too many streams wait for their open message');
        throw new ForkfleetError('resource_exhausted', `${maxOpening} chunk streams wait for their open message on this host, the most it takes; retry`, { retryable: true });
      }
      opening++;
      const first = await Promise.race([
        it.next(),
        new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new InvalidArgumentError('payload', `no open message within ${openWithinMs} ms`)), openWithinMs))),
      ]).finally(() => {
        opening--;
        clearTimeout(timer);
      });
      if (first.done || first.value.payload.case !== 'open') throw new InvalidArgumentError('payload', 'the first message must be open');
      const open = first.value.payload.value;
      // Counted from before its manifest is read, as the other calls are: a caller's streams
      // otherwise pile up on a slow manifest read without bound.
      const claims = checked(open.ticket, ctx);
      const release = takeSlot(streams, ctx);
      try {
        yield* serve(it, claims, await manifestOf(claims, ctx), open.credit, ctx);
      } finally {
        release();
      }
    },
  });

  /** A FetchChunks stream once its open message was authorised: the wants it reads, the chunks it sends. */
  async function* serve(it: AsyncIterator<FetchChunksRequest>, claims: ReturnType<typeof verifyTicket>, signed: NonNullable<Awaited<ReturnType<ManifestStore['get']>>>, openCredit: number, ctx: CallContext): AsyncGenerator<Response> {
    const allowed = manifestDigests(decodeManifestUnverified(signed));
    let credit = openCredit;
    // Asked for and not yet sent, each once: a digest asked for again while pending is one want.
    const wants = new Set<DigestHex>();
    let ended = false;
    let failure: unknown;
    const changed = new Notifier();
    // A stream that fails (its ticket's grace over, a bad request) ends at once, also while
    // the handler waits at a `yield` for a client that takes nothing (ctx.end): the checks
    // below run only when it is resumed, which such a client never does.
    const fail = (e: unknown): void => {
      failure ??= e;
      changed.notify();
      ctx.end?.(e);
    };
    // A cancelled call wakes the loop below, which then ends (and gives back its caller's slot).
    const onAbort = (): void => changed.notify();
    ctx.signal.addEventListener('abort', onAbort, { once: true });
    // The ticket is checked again on each want and before each chunk is sent: a stream opened
    // before its ticket's expiry serves nothing STREAM_GRACE_MS after it.
    let expired = false;
    const graceMs = deps.streamGraceMs ?? STREAM_GRACE_MS;
    const live = (): void => {
      try {
        assertTicketLive(claims, new Date(deps.clock.now().getTime() - graceMs));
      } catch (e) {
        if (!expired) {
          expired = true;
          stats.refused++;
          deps.log?.warn({ peer: ctx.peer, snapshotId: claims.snapshotId, err: (e as Error).message }, 'chunk stream ended: ticket expired');
        }
        throw e;
      }
    };

    // And when it is quiet: a stream that asks for nothing more would stay open past the
    // grace (HTTP/2 pings keep it), holding the ticket's snapshot readable for ever.
    let expiry: ReturnType<typeof setTimeout> | undefined;
    const checkExpiry = (): void => {
      try {
        live();
      } catch (e) {
        fail(e);
        return;
      }
      const ms = claims.expiresAt.getTime() + graceMs - deps.clock.now().getTime();
      expiry = setTimeout(checkExpiry, Math.min(MAX_TIMER_MS, Math.max(0, ms) + 1));
    };
    checkExpiry();

    void (async () => {
      try {
        for (let r = await it.next(); !r.done; r = await it.next()) {
          const p = r.value.payload;
          if (p.case === 'credit') credit += p.value;
          else if (p.case === 'want') {
            live();
            // A receiver asks for each chunk it lacks once (again only after a 'missing'), about
            // its window at a time; more than this waiting is not a receiver, and each would
            // cost a read.
            p.value.digests.forEach((b, i) => {
              if (b.length !== 32) throw new InvalidArgumentError(`want.digests[${i}]`, `a SHA-256 digest is 32 bytes, got ${b.length}`);
            });
            const asked = new Set<DigestHex>();
            for (const b of p.value.digests) {
              const d = Buffer.from(b).toString('hex');
              if (!allowed.has(d)) {
                stats.refused++;
                throw new TicketInvalidError(`chunk ${d.slice(0, 16)} is not part of snapshot ${claims.snapshotId}`);
              }
              if (!wants.has(d)) asked.add(d);
            }
            if (wants.size + asked.size > MAX_PENDING_WANTS) throw new InvalidArgumentError('want.digests', `more than ${MAX_PENDING_WANTS} chunks asked for and not yet sent`);
            for (const d of asked) wants.add(d);
          } else if (p.case === 'open') throw new InvalidArgumentError('payload', 'open sent twice');
          changed.notify();
        }
        ended = true;
        changed.notify();
      } catch (e) {
        fail(e);
      }
    })();

    const ahead: Array<{ digest: DigestHex; read: Promise<EncodedChunk | undefined> }> = [];
    try {
      while (true) {
        if (failure !== undefined && !ended) throw failure;
        if (ctx.signal.aborted) return;
        if (ahead.length > 0 || wants.size > 0) live();
        while (ahead.length < prefetch && ahead.length < credit && wants.size > 0) {
          const digest = wants.values().next().value as DigestHex;
          wants.delete(digest);
          const read = readForSend(digest);
          // Reads still ahead when the stream ends (an error, the caller gone) are never awaited:
          // one failing then must not be an unhandled rejection, which ends the agent.
          read.catch(() => undefined);
          ahead.push({ digest, read });
        }
        const next = ahead.shift();
        if (next) {
          // A read that failed here with an error that may pass (EIO, EMFILE) is retryable:
          // the receiver tries this source again (an internal error makes it give it up).
          const c = await next.read.catch((e: unknown) => {
            deps.log?.warn({ peer: ctx.peer, digest: next.digest, err: (e as Error).message }, 'reading a chunk to send failed');
            throw passingSystemError(e, `reading chunk ${next.digest.slice(0, 16)}`) ?? e;
          });
          if (!c) {
            yield { payload: { case: 'missing', value: Buffer.from(next.digest, 'hex') } };
            continue;
          }
          credit--;
          stats.chunksServed++;
          stats.bytesServed += c.data.length;
          deps.onServed?.(c.digest, c.data.length);
          // `data` is a view of a (pooled) read buffer; serializeResponse writes the message
          // header in front of it, grpc-js copies it once and the buffer goes back to the pool.
          yield { payload: { case: 'chunk', value: { digest: Buffer.from(c.digest, 'hex'), codec: c.codec, size: c.size, data: c.data } } };
          continue;
        }
        if ((ended || failure !== undefined) && wants.size === 0) {
          if (failure !== undefined) throw failure;
          return;
        }
        await changed.wait();
      }
    } finally {
      clearTimeout(expiry);
      ctx.signal.removeEventListener('abort', onAbort);
    }
  }
  // The hot message skips the generic create + toBinary + Buffer.from path (three copies of
  // each chunk) for a byte-compatible hand-written encoder (one copy): see wire.ts.
  const fetchDef = registration.definition.fetchChunks;
  if (!fetchDef) throw new Error('ChunkTransferService has no fetchChunks method');
  const definition: ServiceRegistration['definition'] = { ...registration.definition, fetchChunks: { ...fetchDef, responseSerialize: (v: unknown) => serializeResponse(v as WireResponse) } };
  return { registration: { ...registration, definition }, stats };
}
