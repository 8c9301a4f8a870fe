// A peer host agent as a ChunkSource: GetManifest and the FetchChunks bidi stream with
// credit-based flow control. Credits go back as the consumer takes chunks, so a slow disk on
// the receiver slows the sender instead of buffering without bound.
//
// FetchChunks uses grpc-js directly (the generic bridge in services/adapters/grpc/rpc.ts
// copies every message through fromBinary): responses are decoded by wire.ts into views of
// the received buffer, requests are written to the call as they are made.
import { Client as GrpcClient, Metadata } from '@grpc/grpc-js';
import type { ClientDuplexStream, ServiceError } from '@grpc/grpc-js';
import { create, toBinary } from '@bufbuild/protobuf';
import type { MessageInitShape } from '@bufbuild/protobuf';
import { ChunkTransferService, FetchChunksRequestSchema } from '../../../proto/gen/forkfleet/v1/transfer_pb.ts';
import type { SignedTicket } from '../../../proto/gen/forkfleet/v1/transfer_pb.ts';
import type { SignedManifest } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { createClient, type Client } from '../../../services/adapters/grpc/rpc.ts';
import { fromServiceError } from '../../../services/adapters/grpc/status.ts';
import { deserializeResponse, type WireResponse } from './wire.ts';
import { markOwned } from '../chunkstore/buffers.ts';
import type { ChunkEvent, ChunkSession, ChunkSource } from '../../domain/transfer.ts';
import type { DigestHex } from '../../domain/snapshot-store.ts';
import { ManifestNotFoundError } from '../../domain/transfer-errors.ts';
import { HOST_ID_METADATA } from './server.ts';
import { peerChannel, type PeerTls } from './tls.ts';

type Req = MessageInitShape<typeof FetchChunksRequestSchema>;

export interface PeerChunkSourceOptions {
  /** Name in reports and logs. */
  readonly id: string;
  /** host:port of the peer's ChunkTransferService. */
  readonly address: string;
  readonly ticket: SignedTicket;
  /** This host's id: must be the ticket's destination. */
  readonly hostId: string;
  /** Chunks the peer may send ahead of consumption (default 64). */
  readonly credit?: number;
  readonly manifestTimeoutMs?: number;
  /** Mutual TLS (tls.ts); absent: plain text. */
  readonly tls?: PeerTls | undefined;
}

/** gRPC (5) + protobuf headers of one chunk message: digest, codec, size, lengths (< 64). */
const OWNED_SLACK = 128;

const FETCH_PATH = `/${ChunkTransferService.typeName}/${ChunkTransferService.method.fetchChunks.name}`;
const serializeRequest = (r: Req): Buffer => Buffer.from(toBinary(FetchChunksRequestSchema, create(FetchChunksRequestSchema, r)));

export class PeerChunkSource implements ChunkSource {
  readonly id: string;
  private readonly client: Client<(typeof ChunkTransferService)['method']>;
  private readonly raw: GrpcClient;

  constructor(private readonly opts: PeerChunkSourceOptions) {
    this.id = opts.id;
    const peer = peerChannel(opts.tls, opts.address);
    const channelOptions = {
      ...peer.options,
      'grpc.max_receive_message_length': 16 * 1024 * 1024,
      // Big HTTP/2 receive windows: the default 64 KiB window over a link with a few ms of
      // queueing delay (tbf latency 5ms) caps a stream near 100 Mbit/s.
      'grpc-node.flow_control_window': 16 * 1024 * 1024,
    };
    this.client = createClient(ChunkTransferService, opts.address, peer.credentials, channelOptions);
    this.raw = new GrpcClient(opts.address, peer.credentials, channelOptions);
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
    const credit = this.opts.credit ?? 64;
    const md = new Metadata();
    md.set(HOST_ID_METADATA, this.opts.hostId);
    const call: ClientDuplexStream<Req, WireResponse> = this.raw.makeBidiStreamRequest(FETCH_PATH, serializeRequest, deserializeResponse, md, {});
    // Errors reach the consumer through the events iterator. A session closed (cancelled)
    // while nobody iterates would otherwise emit an unhandled 'error' and kill the agent.
    call.on('error', () => undefined);
    let ended = false;
    const send = (r: Req): void => {
      // Requests are small and bounded (wants <= window, credits <= chunks received), so
      // ignoring write backpressure buffers at most a few KiB.
      if (!ended) call.write(r);
    };
    const onAbort = (): void => call.cancel();
    if (signal?.aborted) call.cancel();
    else signal?.addEventListener('abort', onAbort, { once: true });
    send({ payload: { case: 'open', value: { ticket: this.opts.ticket, credit } } });
    const close = (): void => {
      if (!ended) {
        ended = true;
        call.end();
      }
      call.cancel();
      signal?.removeEventListener('abort', onAbort);
    };
    async function* events(): AsyncGenerator<ChunkEvent> {
      let consumed = 0;
      try {
        for await (const r of call as AsyncIterable<WireResponse>) {
          const p = r.payload;
          if (p.case === 'missing') {
            yield { kind: 'missing', digest: Buffer.from(p.value).toString('hex') };
          } else if (p.case === 'chunk') {
            const c = p.value;
            // `data` is a view of the message buffer grpc-js allocated for this message alone
            // (a few header bytes besides): the store may hand it to a worker (detaching it).
            if (c.data.buffer.byteLength - c.data.byteLength <= OWNED_SLACK) markOwned(c.data);
            yield { kind: 'chunk', chunk: { digest: Buffer.from(c.digest).toString('hex'), codec: c.codec, size: c.size, data: c.data } };
            // The consumer took it: the peer may send one more (returned in quarters).
            if (++consumed >= Math.max(1, credit >> 2)) {
              send({ payload: { case: 'credit', value: consumed } });
              consumed = 0;
            }
          }
        }
      } catch (err) {
        throw fromServiceError(err as ServiceError);
      } finally {
        close();
      }
    }
    return {
      want: (digests: readonly DigestHex[]) => {
        send({ payload: { case: 'want', value: { digests: digests.map((d) => Buffer.from(d, 'hex')) } } });
      },
      events: events(),
      close,
    };
  }

  close(): void {
    this.client.close();
    this.raw.close();
  }
}
