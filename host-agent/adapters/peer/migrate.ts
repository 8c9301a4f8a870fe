// Restore by migration, the destination's end of the wire (ADR 0015): a one-shot listener on
// this host's peer address, and the MigrateSnapshot call that makes the source host's QEMU
// connect to it. The accepted connection is handed on unread: the destination's QEMU reads
// the stream itself, so the bytes never pass through this process.
import net from 'node:net';
import { lookup } from 'node:dns/promises';
import { randomBytes } from 'node:crypto';
import { mkdir, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { ChunkTransferService } from '../../../proto/gen/forkfleet/v1/transfer_pb.ts';
import type { SignedTicket } from '../../../proto/gen/forkfleet/v1/transfer_pb.ts';
import { createClient } from '../../../services/adapters/grpc/rpc.ts';
import { HOST_ID_METADATA, plainAddress } from './server.ts';
import { peerChannel, type PeerTls } from './tls.ts';
import { hostOfAddress } from '../../domain/agent.ts';
import { ForkfleetError } from '../../../proto/errors.ts';
import type { MigrationStream } from '../../domain/vmm.ts';
import { connectRelay, listenRelay } from './tls-relay.ts';

export interface MigrateFromOptions {
  /** host:port of the source's ChunkTransferService. */
  readonly sourceAddress: string;
  readonly ticket: SignedTicket;
  /** This host's id: the ticket's destination. */
  readonly hostId: string;
  /** This host's address on the peer network (where the listener binds). */
  readonly listenHost: string;
  /**
   * The MigrateSnapshot call's deadline (default DEFAULT_MIGRATE_CALL_MS): a backstop only. A
   * stream takes as long as the VM's RAM needs (32 GiB at 2 Gbit/s is over two minutes); the
   * source fails it when it stops moving (the driver's MIGRATION_STREAM_WAIT), and its failed
   * answer ends this end's wait too.
   */
  readonly timeoutMs?: number;
  /**
   * How long the source may take to connect (default DEFAULT_MIGRATE_CONNECT_MS). It only has
   * to start or claim a QEMU, whatever the VM's size, so this is far shorter than `timeoutMs`:
   * a source that accepted the call but never connects is given up on, and the caller moves
   * on to the next source or to the fetch, instead of waiting out the whole exchange.
   */
  readonly connectTimeoutMs?: number;
  /** Ends the wait for the source's connection (the caller gave up, e.g. its own preparation failed). */
  readonly signal?: AbortSignal;
  /**
   * Mutual TLS for the MigrateSnapshot call (tls.ts). The stream's own TLS is QEMU's
   * (QemuDriverOptions.migrationTlsDir), or with `relay` a TLS relay's.
   */
  readonly tls?: PeerTls | undefined;
  /**
   * The stream comes through a TLS relay (tls-relay.ts) instead of a connection QEMU reads
   * itself: it listens here for the source, which must present the certificate of
   * `sourceHostId`, and hands `load` the unix socket (`socketDir`, a new name) that the
   * relay connects to once QEMU listens on it.
   */
  readonly relay?: (MigrationRelaySettings & { readonly sourceHostId: string }) | undefined;
}

export interface MigrateFromReport<T> {
  readonly result: T;
  /** Stream bytes the source sent (0 when its answer failed after the stream was loaded). */
  readonly bytes: number;
  /** The source's time, from the request to the stream sent. */
  readonly sourceMs: number;
  /**
   * The source's answer failed after the stream had been loaded (QEMU checked the stream
   * whole): the VM stands, and this says why the answer did not come.
   */
  readonly sourceError?: string;
}

/** Default time a migration source has to connect after accepting MigrateSnapshot. */
export const DEFAULT_MIGRATE_CONNECT_MS = 20_000;

/**
 * How long a destination may take to start reading the stream: its disk layer fetched and
 * written, its QEMU started. The source's stream waits unread meanwhile (in socket buffers, or
 * in the relays). The source allows as much from its `migrate` before it takes a stream that
 * moves nothing as stalled (the driver's MIGRATION_STREAM_WAIT.startMs); this host's relay
 * waits as long for its QEMU, from when the source has connected (so the source's window ends
 * first, and its failed answer ends this host's wait).
 */
export const MIGRATION_START_MS = 120_000;

/**
 * Default deadline of the MigrateSnapshot call: past the source's own cap on a stream
 * (MIGRATION_STREAM_WAIT.maxMs, 30 min) plus its start, so the source's failure, which says
 * why, comes first. A stream that stops moving is failed by the source long before.
 */
export const DEFAULT_MIGRATE_CALL_MS = 35 * 60_000;

/**
 * Asks the source to migrate the ticket's snapshot to a one-shot listener here and hands the
 * connection, unread, to `load`. Only a connection from the source's address is taken; the
 * listener closes at the first one. With `o.relay` a TLS relay listens instead, and `load`
 * gets the unix socket it relays to once the source has also proved which host it is.
 * Fails (and `load` never runs) when the source refuses or fails before it connects.
 * `load`'s `sourceGone` aborts when the source reports that its end failed after it connected
 * (so the load need not wait for a stream that will not come).
 */
export async function migrateFrom<T>(o: MigrateFromOptions, load: (conn: MigrationStream, sourceGone: AbortSignal) => Promise<T>): Promise<MigrateFromReport<T>> {
  const connectMs = o.connectTimeoutMs ?? DEFAULT_MIGRATE_CONNECT_MS;
  const timeoutMs = o.timeoutMs ?? DEFAULT_MIGRATE_CALL_MS;
  if (o.signal?.aborted) throw o.signal.reason instanceof Error ? o.signal.reason : new Error(String(o.signal.reason));
  const peer = peerChannel(o.tls, o.sourceAddress);
  const client = createClient(ChunkTransferService, o.sourceAddress, peer.credentials, peer.options);
  const ac = new AbortController();
  let inbound: Inbound | undefined;
  try {
    inbound = o.relay ? await relayOnce(o, o.relay, connectMs) : await listenOnce(o, connectMs);
    const call = client.migrateSnapshot({ ticket: o.ticket, port: inbound.port }, { timeoutMs, signal: ac.signal, metadata: { [HOST_ID_METADATA]: o.hostId } });
    // The source failing before it connects, the inbound end giving up, or the caller giving
    // up, ends the wait for its connection; failing after, the load's wait for its stream.
    // Once the stream is loaded, nothing of theirs matters.
    const sourceGone = new AbortController();
    let loaded = false;
    const fail = (e: unknown): void => {
      if (loaded) return;
      ac.abort(e);
      sourceGone.abort(e);
    };
    call.catch(fail);
    void inbound.failed.then(fail);
    const connected = inbound.arrived;
    if (o.signal?.aborted) ac.abort(o.signal.reason);
    o.signal?.addEventListener('abort', () => ac.abort(o.signal?.reason), { once: true, signal: ac.signal });
    const arrived = new Promise<MigrationStream>((resolve, reject) => {
      void connected.then(resolve);
      if (ac.signal.aborted) reject(ac.signal.reason as Error);
      else ac.signal.addEventListener('abort', () => reject(ac.signal.reason as Error), { once: true });
    });
    const result = await arrived.then((conn) => load(conn, sourceGone.signal));
    loaded = true;
    // QEMU loaded the whole stream and checked it: the VM stands whatever the source's answer
    // says now (a reset connection, a relay that ended late), and is not thrown away for it.
    const res = await call.then(
      (r) => ({ bytes: Number(r.bytes), sourceMs: r.millis }),
      (e: unknown) => ({ bytes: 0, sourceMs: 0, sourceError: e instanceof Error ? e.message : String(e) }),
    );
    return { result, ...res };
  } finally {
    ac.abort(new Error('migration finished'));
    client.close();
    await inbound?.close();
  }
}

/** Where a source's stream comes in (migrateFrom). */
interface Inbound {
  /** What MigrateSnapshot asks the source to connect to. */
  readonly port: number;
  /** The stream, once the source has connected (and, through a relay, proved who it is). */
  readonly arrived: Promise<MigrationStream>;
  /** Resolves with why, if this end gives up on its own before the stream is loaded. */
  readonly failed: Promise<Error>;
  close(): Promise<void>;
}

/**
 * The addresses of `host`: itself when it is an IP address, else every address a lookup gives
 * (FF_PEER_ADVERTISE may name a host; a connection from it comes from one of its addresses,
 * and compared with the name it never matched, so every restore by migration from such a
 * source waited out the connect timeout and fell back to a fetch). Restricted to `family`
 * when given. A name that does not resolve fails retryably: the caller moves on to its next
 * source.
 */
async function addressesOf(host: string, what: string, family?: 4 | 6): Promise<string[]> {
  const plain = plainAddress(host);
  if (net.isIP(plain)) return [plain];
  let found: Array<{ address: string; family: number }>;
  try {
    found = await lookup(host, { all: true, verbatim: true });
  } catch (e) {
    throw new ForkfleetError('unavailable', `${what} ${JSON.stringify(host)} does not resolve: ${(e as Error).message}`, { retryable: true, cause: e });
  }
  const out = [...new Set(found.filter((a) => family === undefined || a.family === family).map((a) => plainAddress(a.address)))];
  if (out.length === 0) throw new ForkfleetError('unavailable', `${what} ${JSON.stringify(host)} has no IPv${family ?? ''} address`, { retryable: true });
  return out;
}

/** A one-shot listener that hands the source's connection on, unread (QEMU reads it itself). */
async function listenOnce(o: MigrateFromOptions, connectMs: number): Promise<Inbound> {
  const sourceHosts = new Set(await addressesOf(hostOfAddress(o.sourceAddress), 'migration source host'));
  const server = net.createServer({ pauseOnConnect: true });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen({ host: o.listenHost, port: 0, backlog: 1 }, () => {
      server.off('error', reject);
      resolve();
    });
  });
  let noConnect: NodeJS.Timeout | undefined;
  const failed = new Promise<Error>((resolve) => {
    noConnect = setTimeout(() => resolve(new ForkfleetError('deadline_exceeded', `migration source ${o.sourceAddress} did not connect within ${connectMs} ms`, { retryable: true })), connectMs);
    // A failed accept (EMFILE) is an 'error' on the server: this end gives up, and the agent lives.
    server.on('error', (e) => resolve(new ForkfleetError('unavailable', `migration listener failed: ${e.message}`, { retryable: true })));
  });
  const arrived = new Promise<net.Socket>((resolve) => {
    server.on('connection', (c) => {
      if (!c.remoteAddress || !sourceHosts.has(plainAddress(c.remoteAddress))) {
        c.destroy();
        return;
      }
      clearTimeout(noConnect);
      server.close();
      resolve(c);
    });
  });
  return {
    port: (server.address() as net.AddressInfo).port,
    arrived,
    failed,
    close: async () => {
      clearTimeout(noConnect);
      server.close();
    },
  };
}

/**
 * A TLS relay (tls-relay.ts) listening for the source; the stream arrives on a new unix socket
 * under `r.socketDir`, which QEMU listens on and the relay connects to.
 */
async function relayOnce(o: MigrateFromOptions, r: NonNullable<MigrateFromOptions['relay']>, connectMs: number): Promise<Inbound> {
  const unixPath = join(r.socketDir, `in-${randomBytes(6).toString('hex')}.sock`);
  await mkdir(r.socketDir, { recursive: true, mode: 0o700 });
  // socat takes IP addresses only: names (FF_PEER_ADVERTISE may be one) are looked up here. Its
  // range takes one address: the source's first of the family this end listens on (the
  // source's certificate is what proves it; the range only narrows who may try).
  const [bindHost] = await addressesOf(o.listenHost, "this host's peer address");
  if (bindHost === undefined) throw new ForkfleetError('unavailable', `no address to listen on for ${o.listenHost}`, { retryable: true });
  const [fromHost] = await addressesOf(hostOfAddress(o.sourceAddress), 'migration source host', net.isIP(bindHost) === 6 ? 6 : 4);
  if (fromHost === undefined) throw new ForkfleetError('unavailable', `no address for ${o.sourceAddress}`, { retryable: true });
  // The stream waits in the relay until this host's QEMU listens, for as long as this host may
  // take to start reading it.
  const relay = await listenRelay({ socat: r.socat, tlsDir: r.tlsDir, unixPath, peerHostId: r.sourceHostId, acceptTimeoutMs: connectMs, unixWaitMs: MIGRATION_START_MS, bindHost, fromHost });
  const late = (): Error => new ForkfleetError('deadline_exceeded', `migration source ${o.sourceAddress} did not connect as host ${r.sourceHostId} within ${connectMs} ms`, { retryable: true });
  // socat's accept-timeout starts again after each refused connection, and its TLS handshake
  // has none: the source has connectMs from here to prove who it is, whatever socat does.
  let noConnect: NodeJS.Timeout | undefined;
  const failed = new Promise<Error>((resolve) => {
    noConnect = setTimeout(() => resolve(late()), connectMs);
    void relay.verified.then(() => clearTimeout(noConnect));
    // Ending before the source connected (in time, from its address, as the source host), or
    // with an error (the stream broke). One that carried a whole stream exits 0, maybe before
    // QEMU has finished loading it or the source's call answered: that is no failure.
    void relay.exited.then((x) => {
      if (x.peerVerified && x.code === 0) return;
      clearTimeout(noConnect);
      resolve(x.peerVerified ? new ForkfleetError('unavailable', `the migration stream's relay ended (exit ${x.code})`, { retryable: true }) : late());
    });
  });
  return {
    port: relay.port,
    arrived: relay.verified.then(() => ({ unixPath })),
    failed,
    close: async () => {
      clearTimeout(noConnect);
      await relay.stop();
      await rm(unixPath, { force: true });
    },
  };
}

/** A host's TLS relay settings for migration streams (ChunkStoreShipper's migrationRelay). */
export interface MigrationRelaySettings {
  readonly socat: string;
  readonly tlsDir: string;
  readonly socketDir: string;
}

/**
 * Source end of a stream through a TLS relay: the relay listens on a new unix socket here and
 * carries what `send` streams into it (QEMU's `migrate unix:`) to `target`, whose certificate
 * must name `target.hostId` (the host the ticket and the call's certificate named).
 */
export async function migrateOutThroughRelay<R>(r: MigrationRelaySettings, target: { host: string; port: number; hostId: string }, send: (to: { unixPath: string }) => Promise<R>, signal?: AbortSignal): Promise<R> {
  await mkdir(r.socketDir, { recursive: true, mode: 0o700 });
  const unixPath = join(r.socketDir, `out-${randomBytes(6).toString('hex')}.sock`);
  const relay = await connectRelay({ ...r, unixPath, host: target.host, port: target.port, peerHostId: target.hostId, acceptTimeoutMs: 30_000, idleTimeoutMs: SOURCE_RELAY_IDLE_MS });
  const stop = (): void => void relay.stop();
  signal?.addEventListener('abort', stop, { once: true });
  try {
    const sent = await send({ unixPath });
    // QEMU's "completed" means it wrote the stream into the unix socket; the relay may still
    // hold the end of it (its buffer, the socket queues) while the destination reads. It
    // exits once the destination has read all and closed: killing it now cut streams short.
    // It gives up by itself after SOURCE_RELAY_IDLE_MS without progress (-T). How it exits says
    // nothing more: a destination QEMU with its own TLS resets the connection once it has
    // loaded the stream (exit 1, "Connection reset by peer"), and whether a stream loaded is
    // the destination's to tell (QEMU checks it whole).
    await relay.exited;
    return sent;
  } finally {
    signal?.removeEventListener('abort', stop);
    await relay.stop();
    await rm(unixPath, { force: true });
  }
}

/**
 * The source's relay gives up on a stream that moves nothing for this long (socat -T). Its
 * stream waits for the destination to start reading, which may take up to MIGRATION_START_MS
 * after the TLS handshake (the destination's relay reads nothing until its QEMU listens):
 * 60 s cut such streams. A stall once the stream moves is the source QEMU's wait's to catch
 * (MIGRATION_STREAM_WAIT), which ends the relay with it.
 */
export const SOURCE_RELAY_IDLE_MS = MIGRATION_START_MS + 30_000;
