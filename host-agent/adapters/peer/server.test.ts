// ChunkTransferService's handlers called directly (no gRPC), over a real chunk store holding
// `s1`, with a clock the test moves: what a stream does when its ticket expires while it is
// open, what a caller with too many calls open gets, what a failed manifest read answers. And
// over real gRPC, with a plain node:http2 client: a stream whose client stops reading.
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import http2 from 'node:http2';
import { join } from 'node:path';
import { Metadata } from '@grpc/grpc-js';
import { create, toBinary } from '@bufbuild/protobuf';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { FetchChunksRequestSchema, type FetchChunksRequest, type SignedTicket } from '../../../proto/gen/forkfleet/v1/transfer_pb.ts';
import { ArtifactKind, SnapshotManifestSchema } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import type { CallContext } from '../../../services/adapters/grpc/rpc.ts';
import { startGrpcServer } from '../../../services/adapters/grpc/server.ts';
import { tempDir } from '../../../services/testkit/proc.ts';
import { FsChunkStore, FsManifestStore } from '../chunkstore/fs-store.ts';
import { ingestSnapshot } from '../chunkstore/ingest.ts';
import { LiveRoots, manifestDigests, systemClock, type ChunkStore, type ManifestStore } from '../../domain/snapshot-store.ts';
import { TicketInvalidError } from '../../domain/transfer-errors.ts';
import { ForkfleetError } from '../../../proto/errors.ts';
import { decodeManifestUnverified, generateSigningKey, signManifest, signTicket } from '../../domain/tickets.ts';
import { storeHoldingS1 } from './migrate-testkit.ts';
import { CallerBusyError, chunkTransferService, HOST_ID_METADATA, MAX_PENDING_WANTS, PEER_MAX_REQUEST_BYTES, peerServerChannelOptions, STREAM_GRACE_MS, type ChunkServerDeps } from './server.ts';

let dir: string;
beforeAll(() => {
  dir = tempDir('ff-chunk-server-');
});
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** Requests the test pushes one at a time, as a receiver sends them. */
function requestQueue(): { reqs: AsyncIterable<FetchChunksRequest>; push(r: FetchChunksRequest['payload']): void } {
  const queue: FetchChunksRequest[] = [];
  let wake: (() => void) | undefined;
  return {
    reqs: {
      async *[Symbol.asyncIterator]() {
        while (true) {
          const r = queue.shift();
          if (r) yield r;
          else await new Promise<void>((w) => (wake = w));
        }
      },
    },
    push(payload) {
      queue.push({ payload } as FetchChunksRequest);
      wake?.();
    },
  };
}

function callContext(signal: AbortSignal, callerHostId?: string): CallContext {
  const metadata = new Metadata();
  if (callerHostId) metadata.set(HOST_ID_METADATA, callerHostId);
  return { signal, deadline: undefined, metadata, peer: '127.0.0.1:5123', method: '/forkfleet.v1.ChunkTransferService/FetchChunks', principal: undefined, peerCertificate: () => undefined };
}

/** A new store holding s1 under a new signing key 'k1', and one of s1's chunk digests. */
async function s1Fixture() {
  const { signing, trusted } = generateSigningKey('k1');
  const deps = await storeHoldingS1(mkdtempSync(join(dir, 's-')), signing);
  const signed = await deps.manifests.get('s1');
  if (!signed) throw new Error('no manifest for s1');
  const [digest] = [...manifestDigests(decodeManifestUnverified(signed))];
  if (!digest) throw new Error('s1 has no chunks');
  return { signing, trusted, deps, digest };
}

/** A FetchChunks stream on a store holding s1, opened at t0 with a ticket for 60 s; `at` moves the clock. */
async function openStream(credit: number, o: { chunks?: (real: ChunkStore) => ChunkStore; openWithinMs?: number; noOpen?: boolean; streamGraceMs?: number } = {}) {
  const { signing, trusted, deps, digest } = await s1Fixture();
  const t0 = new Date('2026-01-01T00:00:00Z');
  let now = t0;
  const { registration, stats } = chunkTransferService({ ...deps, chunks: o.chunks?.(deps.chunks) ?? deps.chunks, trust: trusted, clock: { now: () => now }, callerHostId: () => 'hostR', ...(o.openWithinMs ? { openWithinMs: o.openWithinMs } : {}), ...(o.streamGraceMs ? { streamGraceMs: o.streamGraceMs } : {}) });
  const fetchChunks = registration.handlers.fetchChunks as unknown as (reqs: AsyncIterable<FetchChunksRequest>, ctx: CallContext) => AsyncIterable<{ payload: { case: string } }>;
  const stop = new AbortController();
  const q = requestQueue();
  const ticket = signTicket({ snapshotId: 's1', destinationHostId: 'hostR', expiresAt: new Date(t0.getTime() + 60_000) }, signing);
  if (!o.noOpen) q.push({ case: 'open', value: { ticket, credit } as never });
  const out = fetchChunks(q.reqs, callContext(stop.signal))[Symbol.asyncIterator]();
  return {
    stats,
    out,
    want: () => q.push({ case: 'want', value: { digests: [Buffer.from(digest, 'hex')] } as never }),
    credit: (n: number) => q.push({ case: 'credit', value: n }),
    at: (ms: number) => void (now = new Date(t0.getTime() + ms)),
    /** The stream's next outcome: a message, or what it threw. */
    next: () => out.next().then((r) => r, (e: unknown) => e),
    close: () => stop.abort(),
  };
}

function expectExpired(end: unknown): void {
  expect(end).toBeInstanceOf(TicketInvalidError);
  expect((end as TicketInvalidError).kind).toBe('permission_denied');
  expect((end as Error).message).toMatch(/expired/);
}

describe('ChunkTransferService.fetchChunks', () => {
  it('fetchChunks_ofAStreamOpenedInTime_servesPastTheTicketsExpiryForTheGrace_thenRefusesTheNextWant_withPermissionDenied', async () => {
    const s = await openStream(8);
    try {
      // Before the expiry: served.
      s.want();
      expect((await s.out.next()).value?.payload.case).toBe('chunk');
      // Past the expiry but within the grace (a long transfer): still served.
      s.at(61_000);
      s.want();
      expect((await s.out.next()).value?.payload.case).toBe('chunk');
      // Past the grace, on the same stream: the next want is refused and nothing is sent.
      s.at(61_000 + STREAM_GRACE_MS);
      s.want();
      expectExpired(await s.next());
      expect(s.stats.chunksServed).toBe(2);
      expect(s.stats.refused).toBe(1);
    } finally {
      s.close();
    }
  });

  it('fetchChunks_ofAStreamThatSendsNoOpenMessage_endsItWithInvalidArgument_afterTheOpenTime', async () => {
    const s = await openStream(8, { noOpen: true, openWithinMs: 100 });
    try {
      const end = await s.next();
      expect(end).toBeInstanceOf(ForkfleetError);
      expect(end).toMatchObject({ kind: 'invalid_argument', field: 'payload' });
    } finally {
      s.close();
    }
  });

  it('fetchChunks_whoseChunkReadFailsOnTheSource_endsTheStreamRetryably_soTheReceiverTriesThisSourceAgain', async () => {
    const s = await openStream(8, {
      chunks: (real) =>
        new Proxy(real, {
          get: (t, k) => (k === 'getEncodedForSend' || k === 'getEncoded' ? () => Promise.reject(Object.assign(new Error("EMFILE: too many open files, open '/var/lib/forkfleet/chunks/ab/abcd'"), { code: 'EMFILE' })) : Reflect.get(t, k, t)),
        }),
    });
    try {
      s.want();
      const end = await s.next();
      expect(end).toBeInstanceOf(ForkfleetError);
      expect(end).toMatchObject({ kind: 'resource_exhausted', retryable: true, message: expect.stringMatching(/EMFILE/) });
      // The code only: the error's own text names the source host's paths.
      expect((end as Error).message).not.toMatch(/\/var\/lib/);
    } finally {
      s.close();
    }
  });

  it('fetchChunks_ofAStreamThatAsksForNothingMore_endsItWithPermissionDenied_onceTheGraceAfterItsTicketsExpiryIsOver', async () => {
    const s = await openStream(8, { streamGraceMs: 50 });
    try {
      s.at(59_990); // opened 10 ms before the ticket's expiry
      const end = s.next();
      await new Promise((r) => setTimeout(r, 100));
      s.at(61_000); // its grace is over; the stream sent nothing since its open
      expectExpired(await end);
    } finally {
      s.close();
    }
  });

  it('fetchChunks_wantsAskedBeforeTheExpiry_areNotServedAfterItsGrace', async () => {
    // Asked in time, but no credit to send them until after the expiry.
    const s = await openStream(0);
    try {
      s.want();
      s.want();
      const first = s.next();
      await new Promise((r) => setTimeout(r, 20));
      s.at(61_000 + STREAM_GRACE_MS);
      s.credit(2);
      expectExpired(await first);
      expect(s.stats.chunksServed).toBe(0);
    } finally {
      s.close();
    }
  });

  it('fetchChunks_wantsRepeatingADigestStillPending_readAndSendItOnce', async () => {
    let reads = 0;
    const s = await openStream(0, {
      chunks: (real) =>
        new Proxy(real, {
          get: (t, k) => {
            const v = Reflect.get(t, k, t) as unknown;
            if ((k !== 'getEncodedForSend' && k !== 'getEncoded') || typeof v !== 'function') return v;
            return (d: string) => {
              reads++;
              return (v as (d: string) => unknown).call(t, d);
            };
          },
        }),
    });
    try {
      // One ticket must not buy a read per repeat: 2000 asks of one chunk are one want.
      for (let i = 0; i < 2000; i++) s.want();
      await new Promise((r) => setTimeout(r, 20));
      s.credit(100);
      expect((await s.out.next()).value?.payload.case).toBe('chunk');
      const more = await Promise.race([s.next(), new Promise((r) => setTimeout(() => r('nothing'), 100))]);
      expect(more).toBe('nothing');
      expect(reads).toBe(1);
      expect(s.stats.chunksServed).toBe(1);
    } finally {
      s.close();
    }
  });

  it('fetchChunks_askingForMoreThanMaxPendingWantsNotYetSent_endsItWithInvalidArgument', async () => {
    // A snapshot of more chunks than the cap (the old cap grew with the manifest: 2 x its chunks).
    const { signing, trusted, deps } = await s1Fixture();
    const digests = Array.from({ length: MAX_PENDING_WANTS + 1 }, () => randomBytes(32));
    const big = signManifest(create(SnapshotManifestSchema, { snapshotId: 's1', chunkSize: 4096, artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', size: BigInt(digests.length * 4096), chunks: digests.map((digest, i) => ({ index: BigInt(i), digest, size: 4096, storedSize: 4096 })) }] }), signing);
    const { registration } = chunkTransferService({ ...deps, manifests: { ...(deps.manifests as ManifestStore), get: () => Promise.resolve(big) }, trust: trusted, clock: systemClock, callerHostId: () => 'hostR' });
    const fetchChunks = registration.handlers.fetchChunks as unknown as (reqs: AsyncIterable<FetchChunksRequest>, ctx: CallContext) => AsyncIterable<{ payload: { case: string } }>;
    const stop = new AbortController();
    const q = requestQueue();
    q.push({ case: 'open', value: { ticket: signTicket({ snapshotId: 's1', destinationHostId: 'hostR', expiresAt: new Date(Date.now() + 60_000) }, signing), credit: 0 } as never });
    const out = fetchChunks(q.reqs, callContext(stop.signal))[Symbol.asyncIterator]();
    try {
      q.push({ case: 'want', value: { digests: digests.slice(0, MAX_PENDING_WANTS) } as never });
      q.push({ case: 'want', value: { digests: digests.slice(MAX_PENDING_WANTS) } as never });
      const end = await out.next().then((r) => r, (e: unknown) => e);
      expect(end).toMatchObject({ kind: 'invalid_argument', field: 'want.digests' });
    } finally {
      stop.abort();
    }
  });
});

/** A service over a store holding s1 (the caller's host id read from its metadata, as by default), and tickets for s1. */
async function serviceOverS1(o: Partial<Omit<ChunkServerDeps, 'manifests'>> & { manifests?: (real: ManifestStore) => ManifestStore } = {}) {
  const { signing, trusted, deps, digest } = await s1Fixture();
  const { manifests: wrap, ...rest } = o;
  const { registration, stats } = chunkTransferService({ ...deps, trust: trusted, clock: systemClock, ...rest, manifests: wrap?.(deps.manifests) ?? deps.manifests });
  const handlers = registration.handlers as unknown as {
    getManifest(req: { ticket: SignedTicket }, ctx: CallContext): Promise<unknown>;
    migrateSnapshot(req: { ticket: SignedTicket; port: number }, ctx: CallContext): Promise<unknown>;
    fetchChunks(reqs: AsyncIterable<FetchChunksRequest>, ctx: CallContext): AsyncIterable<{ payload: { case: string } }>;
  };
  const ticket = (dest: string, allowMigration = false) => signTicket({ snapshotId: 's1', destinationHostId: dest, expiresAt: new Date(Date.now() + 60_000), allowMigration }, signing);
  /** A FetchChunks stream of `caller`, opened (credit 8): `want` asks for s1's first chunk. */
  const stream = (caller: string) => {
    const stop = new AbortController();
    const q = requestQueue();
    q.push({ case: 'open', value: { ticket: ticket(caller), credit: 8 } as never });
    const out = handlers.fetchChunks(q.reqs, callContext(stop.signal, caller))[Symbol.asyncIterator]();
    return {
      out,
      want: () => q.push({ case: 'want', value: { digests: [Buffer.from(digest, 'hex')] } as never }),
      next: () => out.next().then((r) => r, (e: unknown) => e),
      /** Cancels the call, and lets the handler see it (grpc-js asks for the next message at once). */
      close: async () => {
        stop.abort();
        await out.next().catch(() => undefined);
      },
    };
  };
  return { stats, handlers, ticket, stream };
}

/** A manifest store wrapper (serviceOverS1's `manifests`) whose reads wait until `finish()`; `reading()` counts the reads begun. */
function hangingManifests(): { wrap: (real: ManifestStore) => ManifestStore; reading: () => number; finish: () => void } {
  let reading = 0;
  let finish: () => void = () => undefined;
  const finished = new Promise<void>((r) => (finish = r));
  return {
    wrap: (real) => ({
      ...real,
      get: async (id) => {
        reading++;
        await finished;
        return real.get(id);
      },
    }),
    reading: () => reading,
    finish: () => finish(),
  };
}

describe('ChunkTransferService: calls open per caller host', () => {
  it('migrateSnapshot_pastTheCallersCapOfOpenMigrations_isResourceExhaustedAndRetryable_whileOtherCallersAreServed', async () => {
    let started = 0;
    let finish: () => void = () => undefined;
    const finished = new Promise<void>((r) => (finish = r));
    const s = await serviceOverS1({
      maxMigrationsPerCaller: 2,
      migrate: async () => {
        started++;
        await finished;
        return { bytes: 1, ms: 1 };
      },
    });
    const call = (caller: string) => s.handlers.migrateSnapshot({ ticket: s.ticket(caller, true), port: 4000 }, callContext(new AbortController().signal, caller));
    const open = [call('hostR'), call('hostR')];
    while (started < 2) await new Promise((r) => setTimeout(r, 5));
    await expect(call('hostR')).rejects.toMatchObject({ kind: 'resource_exhausted', retryable: true, message: expect.stringContaining('hostR') });
    // Another host's call is served: the cap is per caller.
    const other = call('hostQ');
    await new Promise((r) => setTimeout(r, 20));
    expect(started).toBe(3);
    expect(s.stats.busy).toBe(1);
    expect(s.stats.refused).toBe(0);
    finish();
    await Promise.all([...open, other]);
    // Ended calls give their places back.
    await expect(call('hostR')).resolves.toMatchObject({ millis: 1 });
  });

  it('migrateSnapshot_pastTheCallersCapWhileItsManifestReadsHang_isResourceExhaustedWithoutReadingTheManifest', async () => {
    // A caller with a ticket cannot pile up manifest reads: its calls are counted before the read.
    const hang = hangingManifests();
    const s = await serviceOverS1({
      maxMigrationsPerCaller: 2,
      migrate: async () => ({ bytes: 1, ms: 1 }),
      manifests: hang.wrap,
    });
    const call = (caller: string) => s.handlers.migrateSnapshot({ ticket: s.ticket(caller, true), port: 4000 }, callContext(new AbortController().signal, caller));
    const open = [call('hostR'), call('hostR')];
    while (hang.reading() < 2) await new Promise((r) => setTimeout(r, 5));
    // Refused at once, not left waiting on a read of its own.
    const over = await Promise.race([call('hostR').catch((e: unknown) => e), new Promise((r) => setTimeout(() => r('still waiting'), 1000))]);
    expect(over).toMatchObject({ kind: 'resource_exhausted', retryable: true });
    expect(hang.reading()).toBe(2);
    expect(s.stats.busy).toBe(1);
    hang.finish();
    await Promise.all(open);
    // Ended calls give their places back.
    await expect(call('hostR')).resolves.toMatchObject({ millis: 1 });
  });

  it('fetchChunks_pastTheCallersCapOfOpenStreams_isResourceExhaustedAndRetryable_andAStreamThatEndedGivesItsPlaceBack', async () => {
    const s = await serviceOverS1({ maxStreamsPerCaller: 3 });
    const open = [s.stream('hostR'), s.stream('hostR'), s.stream('hostR')];
    // Each is being served.
    for (const st of open) {
      st.want();
      expect((await st.out.next()).value?.payload.case).toBe('chunk');
    }
    const over = s.stream('hostR');
    const refused = await over.next();
    expect(refused).toBeInstanceOf(CallerBusyError);
    expect(refused).toMatchObject({ kind: 'resource_exhausted', retryable: true });
    // Another host is served meanwhile.
    const other = s.stream('hostQ');
    other.want();
    expect((await other.out.next()).value?.payload.case).toBe('chunk');
    // One ends (its client cancelled): a new one of the same host is served.
    await open[0]?.close();
    const again = s.stream('hostR');
    again.want();
    expect((await again.out.next()).value?.payload.case).toBe('chunk');
    for (const st of [...open.slice(1), other, again]) await st.close();
  });

  it('fetchChunks_pastTheCallersCapWhileItsManifestReadsHang_isResourceExhaustedWithoutReadingTheManifest', async () => {
    const hang = hangingManifests();
    const s = await serviceOverS1({
      maxStreamsPerCaller: 2,
      manifests: hang.wrap,
    });
    const open = [s.stream('hostR'), s.stream('hostR')];
    const firsts = open.map((st) => st.next());
    while (hang.reading() < 2) await new Promise((r) => setTimeout(r, 5));
    // Refused at once, not left waiting on a read of its own.
    const over = await Promise.race([s.stream('hostR').next(), new Promise((r) => setTimeout(() => r('still waiting'), 1000))]);
    expect(over).toMatchObject({ kind: 'resource_exhausted', retryable: true });
    expect(hang.reading()).toBe(2);
    hang.finish();
    for (const st of open) st.want();
    for (const f of firsts) expect(((await f) as IteratorResult<{ payload: { case: string } }>).value?.payload.case).toBe('chunk');
    for (const st of open) await st.close();
  });

  it('getManifest_pastTheCallersCapOfOpenReads_isResourceExhaustedAndRetryable_andAnEndedReadGivesItsPlaceBack', async () => {
    const hang = hangingManifests();
    const s = await serviceOverS1({
      manifests: hang.wrap,
    });
    const call = (caller: string) => s.handlers.getManifest({ ticket: s.ticket(caller) }, callContext(new AbortController().signal, caller));
    const open = Array.from({ length: 4 }, () => call('hostR')); // the default cap
    while (hang.reading() < 4) await new Promise((r) => setTimeout(r, 5));
    await expect(call('hostR')).rejects.toMatchObject({ kind: 'resource_exhausted', retryable: true, message: expect.stringContaining('hostR') });
    // Another host's call is served: the cap is per caller.
    const other = call('hostQ');
    while (hang.reading() < 5) await new Promise((r) => setTimeout(r, 5));
    expect(s.stats.busy).toBe(1);
    hang.finish();
    await Promise.all([...open, other]);
    await expect(call('hostR')).resolves.toMatchObject({ manifest: expect.anything() });
  });

  it('aCallWithABadTicket_whileItsCallerIsAtItsCap_isRefusedForItsTicket_notAsBusyAndRetryable', async () => {
    // A busy refusal says "retry": a caller whose ticket can never pass would retry for ever.
    const hang = hangingManifests();
    const s = await serviceOverS1({ maxMigrationsPerCaller: 1, maxStreamsPerCaller: 1, migrate: async () => ({ bytes: 1, ms: 1 }), manifests: hang.wrap });
    const ctx = () => callContext(new AbortController().signal, 'hostR');
    const open = [
      ...Array.from({ length: 4 }, () => s.handlers.getManifest({ ticket: s.ticket('hostR') }, ctx())),
      s.handlers.migrateSnapshot({ ticket: s.ticket('hostR', true), port: 4000 }, ctx()),
    ];
    const stream = s.stream('hostR');
    const first = stream.next();
    while (hang.reading() < 6) await new Promise((r) => setTimeout(r, 5));
    // Tickets for another host, and one that allows fetching only, at each cap.
    await expect(s.handlers.getManifest({ ticket: s.ticket('hostQ') }, ctx())).rejects.toMatchObject({ kind: 'permission_denied' });
    await expect(s.handlers.migrateSnapshot({ ticket: s.ticket('hostR'), port: 4000 }, ctx())).rejects.toMatchObject({ kind: 'permission_denied', message: expect.stringContaining('fetching chunks only') });
    const q = requestQueue();
    q.push({ case: 'open', value: { ticket: s.ticket('hostQ'), credit: 8 } as never });
    const bad = await s.handlers.fetchChunks(q.reqs, ctx())[Symbol.asyncIterator]().next().then((r) => r, (e: unknown) => e);
    expect(bad).toBeInstanceOf(TicketInvalidError);
    expect(s.stats.busy).toBe(0);
    expect(s.stats.refused).toBe(3);
    hang.finish();
    await Promise.all(open);
    stream.want();
    expect(((await first) as IteratorResult<{ payload: { case: string } }>).value?.payload.case).toBe('chunk');
    await stream.close();
  });

  it('fetchChunks_pastTheCapOfStreamsWaitingForTheirOpenMessage_isResourceExhaustedAndRetryable_andOneThatOpenedGivesItsPlaceBack', async () => {
    const s = await serviceOverS1({ maxOpening: 2 });
    const stop = new AbortController();
    // Streams of anyone (no ticket shown yet, so no caller is known): counted together.
    const waiting = [0, 1].map((i) => {
      const q = requestQueue();
      const out = s.handlers.fetchChunks(q.reqs, callContext(stop.signal, `host${i}`))[Symbol.asyncIterator]();
      return { q, next: out.next().then((r) => r, (e: unknown) => e) };
    });
    await new Promise((r) => setTimeout(r, 10));
    const over = await s.handlers.fetchChunks(requestQueue().reqs, callContext(stop.signal, 'hostX'))[Symbol.asyncIterator]().next().then((r) => r, (e: unknown) => e);
    expect(over).toBeInstanceOf(ForkfleetError);
    expect(over).toMatchObject({ kind: 'resource_exhausted', retryable: true });
    // One sends its open message: a new stream may wait.
    waiting[0]?.q.push({ case: 'open', value: { ticket: s.ticket('host0'), credit: 8 } as never });
    await new Promise((r) => setTimeout(r, 20));
    const q = requestQueue();
    q.push({ case: 'open', value: { ticket: s.ticket('hostY'), credit: 8 } as never });
    const next = s.handlers.fetchChunks(q.reqs, callContext(stop.signal, 'hostY'))[Symbol.asyncIterator]().next();
    await expect(Promise.race([next.then(() => 'ended', () => 'refused'), new Promise((r) => setTimeout(() => r('serving'), 50))])).resolves.toBe('serving');
    stop.abort();
  });
});

describe('ChunkTransferService: a manifest read that fails on the source', () => {
  const eio = (real: ManifestStore): ManifestStore => ({
    ...real,
    get: () => Promise.reject(Object.assign(new Error("EIO: i/o error, open '/var/lib/forkfleet/manifests/s1'"), { code: 'EIO' })),
  });

  it('getManifest_whoseManifestReadFailsWithAPassingError_isRetryableUnavailable_andNotCountedRefused', async () => {
    const s = await serviceOverS1({ manifests: eio });
    const err = await s.handlers.getManifest({ ticket: s.ticket('hostR') }, callContext(new AbortController().signal, 'hostR')).then(() => undefined, (e: unknown) => e);
    expect(err).toBeInstanceOf(ForkfleetError);
    expect(err).toMatchObject({ kind: 'unavailable', retryable: true, message: expect.stringMatching(/EIO/) });
    // The code only: the error's own text names the source host's paths.
    expect((err as Error).message).not.toMatch(/\/var\/lib/);
    expect(s.stats.refused).toBe(0);
  });

  it('fetchChunks_whoseManifestReadFailsWithAPassingError_endsRetryably_andIsNotCountedRefused', async () => {
    const s = await serviceOverS1({ manifests: eio });
    const st = s.stream('hostR');
    const end = await st.next();
    expect(end).toMatchObject({ kind: 'unavailable', retryable: true });
    expect(s.stats.refused).toBe(0);
  });
});

/** One gRPC message (length-prefixed) of a FetchChunks request, as a client writes it. */
function grpcFrame(payload: FetchChunksRequest['payload']): Buffer {
  const msg = Buffer.from(toBinary(FetchChunksRequestSchema, create(FetchChunksRequestSchema, { payload } as never)));
  const head = Buffer.alloc(5);
  head.writeUInt32BE(msg.length, 1);
  return Buffer.concat([head, msg]);
}

describe('ChunkTransferService.fetchChunks over gRPC', () => {
  it('fetchChunks_whoseClientStopsReading_isEndedWithinSecondsOfItsTicketsGrace_insteadOfHeldOpenForEver', async () => {
    // Chunks that do not compress (4 MiB of random bytes), asked for far past what the client's
    // 64 KiB window takes: the server's writes wait on a client that never reads.
    const { signing, trusted } = generateSigningKey('k1');
    const root = mkdtempSync(join(dir, 'noread-'));
    writeFileSync(join(root, 'mem.img'), randomBytes(4 << 20));
    const chunks = new FsChunkStore(join(root, 'A'));
    const manifests = new FsManifestStore(join(root, 'A'));
    const s1 = await ingestSnapshot({ snapshotId: 's1', tenantId: 't', sourceSandboxId: 'sb', artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', path: join(root, 'mem.img') }] }, { chunks, roots: new LiveRoots(), clock: systemClock });
    await manifests.put('s1', signManifest(s1.manifest, signing));
    s1.unpin();
    const digests = [...manifestDigests(s1.manifest)];
    const graceMs = 200;
    const { registration, stats } = chunkTransferService({ chunks, manifests, trust: trusted, clock: systemClock, streamGraceMs: graceMs });
    const server = await startGrpcServer({ address: '127.0.0.1:0', services: [registration] });
    const session = http2.connect(`http://${server.address}`, { settings: { initialWindowSize: 65_535 } });
    session.on('error', () => undefined);
    try {
      const expiresAt = Date.now() + 300;
      const ticket = signTicket({ snapshotId: 's1', destinationHostId: 'hostR', expiresAt: new Date(expiresAt) }, signing);
      const st = session.request({ ':method': 'POST', ':path': '/forkfleet.v1.ChunkTransferService/FetchChunks', 'content-type': 'application/grpc', te: 'trailers', [HOST_ID_METADATA]: 'hostR' });
      st.on('error', () => undefined);
      const closed = new Promise<number>((r) => st.once('close', () => r(Date.now())));
      st.pause(); // never reads: never gives the window back
      st.write(grpcFrame({ case: 'open', value: { ticket, credit: 100_000 } as never }));
      st.write(grpcFrame({ case: 'want', value: { digests: Array.from({ length: 1000 }, (_, i) => Buffer.from(digests[i % digests.length] as string, 'hex')) } as never }));
      const graceOver = expiresAt + graceMs;
      const end = await Promise.race([closed, new Promise<undefined>((r) => setTimeout(() => r(undefined), graceOver + 4_000 - Date.now()))]);
      expect(end, 'the stream was still open 4 s after its ticket\'s grace').toBeDefined();
      expect((end as number) - graceOver).toBeLessThan(2_500);
      expect(stats.refused).toBe(1);
    } finally {
      session.destroy();
      await server.close(100);
    }
  }, 15_000);

  it.each(['GetManifest', 'FetchChunks'])('%s_whoseRequestDeclaresMoreThanThePeerCap_isRefusedResourceExhausted_beforeItIsReceived', async (method) => {
    // No ticket needed to send bytes: the cap holds before any is checked.
    const { trusted } = generateSigningKey('k1');
    const nothing = { get: () => Promise.resolve(undefined), getEncoded: () => Promise.resolve(undefined) } as unknown as ChunkStore & ManifestStore;
    const { registration } = chunkTransferService({ chunks: nothing, manifests: nothing, trust: trusted, clock: systemClock });
    const server = await startGrpcServer({ address: '127.0.0.1:0', services: [registration], channelOptions: peerServerChannelOptions(16) });
    const session = http2.connect(`http://${server.address}`);
    session.on('error', () => undefined);
    try {
      await new Promise((r) => session.once('remoteSettings', r));
      // A connection opens at most this many calls at once (not the 1000 of the API server).
      expect(session.remoteSettings.maxConcurrentStreams).toBe(64);
      const st = session.request({ ':method': 'POST', ':path': `/forkfleet.v1.ChunkTransferService/${method}`, 'content-type': 'application/grpc', te: 'trailers' });
      st.on('error', () => undefined);
      st.resume();
      const status = new Promise<string | undefined>((r) => {
        st.once('trailers', (t) => r(String(t['grpc-status'])));
        st.once('response', (h) => h['grpc-status'] !== undefined && r(String(h['grpc-status'])));
      });
      // Declares a message of 1 MiB (the API server's cap is 16 MiB) and sends part of it.
      const head = Buffer.alloc(5);
      head.writeUInt32BE(1 << 20, 1);
      st.write(head);
      st.write(Buffer.alloc(PEER_MAX_REQUEST_BYTES, 1));
      const got = await Promise.race([status, new Promise<string>((r) => setTimeout(() => r('still waiting for the rest'), 2_000))]);
      expect(got).toBe('8'); // RESOURCE_EXHAUSTED
    } finally {
      session.destroy();
      await server.close(100);
    }
  });
});
