// Restore by migration, the destination's end of the wire (ADR 0015): a one-shot listener on
// this host's peer address, and the MigrateSnapshot call that makes the source host's QEMU
// connect to it. The accepted connection is handed on unread: the destination's QEMU reads
// the stream itself, so the bytes never pass through this process.
import net from 'node:net';
import { ChunkTransferService } from '../../../proto/gen/forkfleet/v1/transfer_pb.ts';
import type { SignedTicket } from '../../../proto/gen/forkfleet/v1/transfer_pb.ts';
import { createClient } from '../../../services/adapters/grpc/rpc.ts';
import { HOST_ID_METADATA, plainAddress } from './server.ts';
import { hostOfAddress } from '../../domain/agent.ts';

export interface MigrateFromOptions {
  /** host:port of the source's ChunkTransferService. */
  readonly sourceAddress: string;
  readonly ticket: SignedTicket;
  /** This host's id: the ticket's destination. */
  readonly hostId: string;
  /** This host's address on the peer network (where the listener binds). */
  readonly listenHost: string;
  /** Whole exchange, from the call to the loaded VM (default 120 s). */
  readonly timeoutMs?: number;
  /** Ends the wait for the source's connection (the caller gave up, e.g. its own preparation failed). */
  readonly signal?: AbortSignal;
}

export interface MigrateFromReport<T> {
  readonly result: T;
  /** Stream bytes the source sent. */
  readonly bytes: number;
  /** The source's time, from the request to the stream sent. */
  readonly sourceMs: number;
}

/**
 * Asks the source to migrate the ticket's snapshot to a one-shot listener here and hands the
 * connection, unread, to `load`. Only a connection from the source's address is taken; the
 * listener closes at the first one. Fails (and `load` never runs) when the source refuses
 * or fails before it connects.
 */
export async function migrateFrom<T>(o: MigrateFromOptions, load: (conn: net.Socket) => Promise<T>): Promise<MigrateFromReport<T>> {
  const sourceHost = plainAddress(hostOfAddress(o.sourceAddress));
  const server = net.createServer({ pauseOnConnect: true });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen({ host: o.listenHost, port: 0, backlog: 1 }, () => {
      server.off('error', reject);
      resolve();
    });
  });
  const ac = new AbortController();
  const client = createClient(ChunkTransferService, o.sourceAddress);
  try {
    const accepted = new Promise<net.Socket>((resolve, reject) => {
      server.on('connection', (c) => {
        if (!c.remoteAddress || plainAddress(c.remoteAddress) !== sourceHost) {
          c.destroy();
          return;
        }
        server.close();
        resolve(c);
      });
      ac.signal.addEventListener('abort', () => reject(ac.signal.reason as Error), { once: true });
    });
    const port = (server.address() as net.AddressInfo).port;
    const call = client.migrateSnapshot({ ticket: o.ticket, port }, { timeoutMs: o.timeoutMs ?? 120_000, signal: ac.signal, metadata: { [HOST_ID_METADATA]: o.hostId } });
    // The source failing before it connects, or the caller giving up, ends the wait for its connection.
    call.catch((e: unknown) => ac.abort(e));
    if (o.signal?.aborted) ac.abort(o.signal.reason);
    o.signal?.addEventListener('abort', () => ac.abort(o.signal?.reason), { once: true, signal: ac.signal });
    const result = await accepted.then(load);
    const res = await call;
    return { result, bytes: Number(res.bytes), sourceMs: res.millis };
  } finally {
    ac.abort(new Error('migration finished'));
    server.close();
    client.close();
  }
}
