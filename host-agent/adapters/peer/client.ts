// A peer host agent as a ChunkSource: GetManifest and the FetchChunks bidi stream with
// credit-based flow control. Credits go back as the consumer takes chunks, so a slow disk on
// the receiver slows the sender instead of buffering without bound.
import type { MessageInitShape } from '@bufbuild/protobuf';
import { ChunkTransferService } from '../../../proto/gen/forkfleet/v1/transfer_pb.ts';
import type { FetchChunksRequestSchema, SignedTicket } from '../../../proto/gen/forkfleet/v1/transfer_pb.ts';
import type { SignedManifest } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { createClient, type Client } from '../../../services/adapters/grpc/rpc.ts';
import { AsyncQueue } from '../../../services/adapters/grpc/queue.ts';
import type { ChunkEvent, ChunkSession, ChunkSource } from '../../domain/transfer.ts';
import type { DigestHex } from '../../domain/snapshot-store.ts';
import { ManifestNotFoundError } from '../../domain/transfer-errors.ts';
import { HOST_ID_METADATA } from './server.ts';

type Req = MessageInitShape<typeof FetchChunksRequestSchema>;

export interface PeerChunkSourceOptions {
  /** Name in reports and logs. */
  readonly id: string;
  /** host:port of the peer's ChunkTransferService. */
  readonly address: string;
  readonly ticket: SignedTicket;
  /** This host's id: must be the ticket's destination. */
  readonly hostId: string;
  /** Chunks the peer may send ahead of consumption (default 32). */
  readonly credit?: number;
  readonly manifestTimeoutMs?: number;
}

export class PeerChunkSource implements ChunkSource {
  readonly id: string;
  private readonly client: Client<(typeof ChunkTransferService)['method']>;

  constructor(private readonly opts: PeerChunkSourceOptions) {
    this.id = opts.id;
    this.client = createClient(ChunkTransferService, opts.address, undefined, {
      'grpc.max_receive_message_length': 16 * 1024 * 1024,
      // Big HTTP/2 receive windows: the default 64 KiB window over a link with a few ms of
      // queueing delay (tbf latency 5ms) caps a stream near 100 Mbit/s.
      'grpc-node.flow_control_window': 16 * 1024 * 1024,
    });
  }

  async getManifest(signal?: AbortSignal): Promise<SignedManifest> {
    const res = await this.client.getManifest(
      { ticket: this.opts.ticket },
      { signal, timeoutMs: this.opts.manifestTimeoutMs ?? 10_000, metadata: { [HOST_ID_METADATA]: this.opts.hostId } },
    );
    if (!res.manifest) throw new ManifestNotFoundError('(empty GetManifest response)');
    return res.manifest;
  }

  open(signal?: AbortSignal): ChunkSession {
    const credit = this.opts.credit ?? 32;
    const q = new AsyncQueue<Req>();
    const ac = new AbortController();
    const onAbort = (): void => ac.abort();
    signal?.addEventListener('abort', onAbort, { once: true });
    q.push({ payload: { case: 'open', value: { ticket: this.opts.ticket, credit } } });
    const resps = this.client.fetchChunks(q, { signal: ac.signal, metadata: { [HOST_ID_METADATA]: this.opts.hostId } });
    const close = (): void => {
      if (!q.isEnded) q.end();
      ac.abort();
      signal?.removeEventListener('abort', onAbort);
    };
    async function* events(): AsyncGenerator<ChunkEvent> {
      let consumed = 0;
      for await (const r of resps) {
        const p = r.payload;
        if (p.case === 'missing') {
          yield { kind: 'missing', digest: Buffer.from(p.value).toString('hex') };
        } else if (p.case === 'chunk') {
          const c = p.value;
          yield { kind: 'chunk', chunk: { digest: Buffer.from(c.digest).toString('hex'), codec: c.codec, size: c.size, data: c.data } };
          // The consumer took it: the peer may send one more.
          if (++consumed >= Math.max(1, credit >> 2) && !q.isEnded) {
            q.push({ payload: { case: 'credit', value: consumed } });
            consumed = 0;
          }
        }
      }
    }
    return {
      want: (digests: readonly DigestHex[]) => {
        if (!q.isEnded) q.push({ payload: { case: 'want', value: { digests: digests.map((d) => Buffer.from(d, 'hex')) } } });
      },
      events: events(),
      close,
    };
  }

  close(): void {
    this.client.close();
  }
}
