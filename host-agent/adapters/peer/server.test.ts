// ChunkTransferService's FetchChunks handler called directly (no gRPC), over a real chunk
// store holding `s1`, with a clock the test moves: what a stream does when its ticket expires
// while it is open.
import { mkdtempSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { Metadata } from '@grpc/grpc-js';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { FetchChunksRequest } from '../../../proto/gen/forkfleet/v1/transfer_pb.ts';
import type { CallContext } from '../../../services/adapters/grpc/rpc.ts';
import { tempDir } from '../../../services/testkit/proc.ts';
import { manifestDigests, type ChunkStore } from '../../domain/snapshot-store.ts';
import { TicketInvalidError } from '../../domain/transfer-errors.ts';
import { ForkfleetError } from '../../../proto/errors.ts';
import { decodeManifestUnverified, generateSigningKey, signTicket } from '../../domain/tickets.ts';
import { storeHoldingS1 } from './migrate-testkit.ts';
import { chunkTransferService, STREAM_GRACE_MS } from './server.ts';

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

function callContext(signal: AbortSignal): CallContext {
  return { signal, deadline: undefined, metadata: new Metadata(), peer: '127.0.0.1:5123', method: '/forkfleet.v1.ChunkTransferService/FetchChunks', principal: undefined, peerCertificate: () => undefined };
}

/** A FetchChunks stream on a store holding s1, opened at t0 with a ticket for 60 s; `at` moves the clock. */
async function openStream(credit: number, o: { chunks?: (real: ChunkStore) => ChunkStore; openWithinMs?: number; noOpen?: boolean; streamGraceMs?: number } = {}) {
  const { signing, trusted } = generateSigningKey('k1');
  const deps = await storeHoldingS1(mkdtempSync(join(dir, 's-')), signing);
  const signed = await deps.manifests.get('s1');
  if (!signed) throw new Error('no manifest for s1');
  const [digest] = [...manifestDigests(decodeManifestUnverified(signed))];
  if (!digest) throw new Error('s1 has no chunks');
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
});
