// Migration streams through TLS relays (tls-relay.ts, ADR 0015 "TLS relays"), with real socat
// processes, a real gRPC MigrateSnapshot over mutual TLS and certificates of one dev CA, on
// loopback. QEMU's two ends are stood in for by what QEMU does with the unix sockets: the
// source writes a stream into the relay's socket, the destination listens on its own and
// reads (the driver's side is tested against real QEMU in adapters/qemu/driver.int.test.ts).
import net from 'node:net';
import { createHash, randomBytes } from 'node:crypto';
import { existsSync, mkdirSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { generateSigningKey, signTicket, type SigningKey, type TrustedKeys } from '../../domain/tickets.ts';
import type { MigrationStream } from '../../domain/vmm.ts';
import { startGrpcServer, type RunningGrpcServer } from '../../../services/adapters/grpc/server.ts';
import { tempDir } from '../../../services/testkit/proc.ts';
import { devPeerTls } from '../../../deploy/pki/pki.ts';
import { chunkTransferService } from './server.ts';
import { certificateHostId, peerServerCredentials, writeQemuTlsDir, type PeerTls } from './tls.ts';
import { storeHoldingS1 } from './migrate-testkit.ts';
import { migrateFrom, migrateOutThroughRelay, type MigrationRelaySettings } from './migrate.ts';
import { findSocat, listenRelay } from './tls-relay.ts';

const socat = findSocat();
let dir: string;
let key: SigningKey;
let trust: TrustedKeys;
let source: RunningGrpcServer;
const tls: Record<string, PeerTls> = {};
const relays: Record<string, MigrationRelaySettings> = {};
/** The stream the source's "QEMU" sends. */
const payload = randomBytes(8 << 20);
const sha = (b: Buffer): string => createHash('sha256').update(b).digest('hex');

/** Socat processes whose arguments name this test's directory (ours alone). */
function ourRelays(): number[] {
  return readdirSync('/proc')
    .filter((p) => /^\d+$/.test(p))
    .filter((p) => {
      try {
        const argv = readFileSync(`/proc/${p}/cmdline`, 'utf8');
        return argv.includes('socat') && argv.includes(dir);
      } catch {
        return false;
      }
    })
    .map(Number);
}

/**
 * What the destination's QEMU does with a relay's stream: listens on the unix socket and reads
 * one connection (pausing `delayMs` after each read: a slow reader).
 */
const reader = (delayMs: number) => async (stream: MigrationStream): Promise<Buffer> => {
  if (stream instanceof net.Socket) throw new Error('expected a relay stream');
  const server = net.createServer();
  const accepted = new Promise<net.Socket>((r) => server.once('connection', r));
  await new Promise<void>((r) => server.listen(stream.unixPath, r));
  try {
    const conn = await accepted;
    const parts: Buffer[] = [];
    for await (const b of conn) {
      parts.push(b as Buffer);
      if (delayMs > 0) await new Promise((r) => setTimeout(r, delayMs));
    }
    return Buffer.concat(parts);
  } finally {
    server.close();
  }
};
const readStream = reader(0);

/** What the source's QEMU does (`migrate unix:`): connects to the relay's socket and writes the stream. */
async function sendStream(to: { unixPath: string }): Promise<{ bytes: number; ms: number }> {
  const c = net.createConnection(to.unixPath);
  await new Promise<void>((resolve, reject) => c.once('connect', resolve).once('error', reject));
  await new Promise<void>((resolve) => c.end(payload, resolve));
  await new Promise((r) => c.once('close', r));
  return { bytes: payload.length, ms: 1 };
}

const ticket = (dest: string) => signTicket({ snapshotId: 's1', destinationHostId: dest, expiresAt: new Date(Date.now() + 60_000), allowMigration: true }, key);

describe.skipIf(!socat)('TLS relays for migration streams', () => {
  beforeAll(async () => {
    dir = tempDir('ff-relay-');
    const gen = generateSigningKey('k1');
    key = gen.signing;
    trust = gen.trusted;
    for (const h of ['src', 'dst']) {
      tls[h] = devPeerTls(join(dir, 'pki'), h, '127.0.0.1');
      relays[h] = { socat: socat!, tlsDir: writeQemuTlsDir(join(dir, `tls-${h}`), tls[h]!), socketDir: join(dir, `relay-${h}`) };
    }
    const deps = await storeHoldingS1(dir, key);
    // The source host as main.ts wires it: the caller is the host its certificate names.
    const migrate = (_id: string, target: { host: string; port: number; hostId: string }) => migrateOutThroughRelay(relays.src!, target, sendStream);
    const svc = chunkTransferService({ chunks: deps.chunks, manifests: deps.manifests, trust, clock: { now: () => new Date() }, migrate, callerHostId: certificateHostId });
    source = await startGrpcServer({ address: '127.0.0.1:0', services: [svc.registration], credentials: peerServerCredentials(tls.src) });
  });

  afterAll(async () => {
    await source?.close(100);
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  it('migrateFrom_throughRelays_deliversTheStreamByteForByte_andLeavesNoRelayProcessOrSocket', async () => {
    const r = await migrateFrom({ sourceAddress: source.address, ticket: ticket('dst'), hostId: 'dst', listenHost: '127.0.0.1', tls: tls.dst, relay: { ...relays.dst!, sourceHostId: 'src' } }, readStream);
    expect(r.result.length).toBe(payload.length);
    expect(sha(r.result)).toBe(sha(payload));
    expect(r.bytes).toBe(payload.length);
    expect(ourRelays()).toEqual([]);
    expect(readdirSync(relays.dst!.socketDir)).toEqual([]);
    expect(readdirSync(relays.src!.socketDir)).toEqual([]);
  });

  it('migrateOutThroughRelay_whoseSourceClosesAtOnceAsQemuDoes_deliversAllOfItToASlowReader_beforeItAnswers', async () => {
    // QEMU reports "completed" once the stream is in the unix socket and closes it; the relay
    // may still hold the end of it while the destination reads. 32 MiB, read slowly.
    const big = randomBytes(32 << 20);
    const writeAndLeave = async (to: { unixPath: string }): Promise<{ bytes: number; ms: number }> => {
      const c = net.createConnection(to.unixPath);
      await new Promise<void>((resolve, reject) => c.once('connect', resolve).once('error', reject));
      await new Promise<void>((resolve) => c.end(big, resolve));
      c.destroy();
      return { bytes: big.length, ms: 1 };
    };
    let answered = 0;
    const migrate = async (_id: string, target: { host: string; port: number; hostId: string }) => {
      const r = await migrateOutThroughRelay(relays.src!, target, writeAndLeave);
      answered = Date.now();
      return r;
    };
    mkdirSync(join(dir, 'slow'));
    const deps = await storeHoldingS1(join(dir, 'slow'), key);
    const svc = chunkTransferService({ chunks: deps.chunks, manifests: deps.manifests, trust, clock: { now: () => new Date() }, migrate, callerHostId: certificateHostId });
    const src = await startGrpcServer({ address: '127.0.0.1:0', services: [svc.registration], credentials: peerServerCredentials(tls.src) });
    try {
      let readAll = 0;
      const slowRead = async (stream: MigrationStream): Promise<Buffer> => {
        const got = await reader(1)(stream);
        readAll = Date.now();
        return got;
      };
      const r = await migrateFrom({ sourceAddress: src.address, ticket: ticket('dst'), hostId: 'dst', listenHost: '127.0.0.1', tls: tls.dst, relay: { ...relays.dst!, sourceHostId: 'src' } }, slowRead);
      expect(r.result.length).toBe(big.length);
      expect(sha(r.result)).toBe(sha(big));
      expect(r.sourceError).toBeUndefined();
      // The source answered once the destination had it all, not when its own side was written.
      expect(answered).toBeGreaterThanOrEqual(readAll);
      expect(ourRelays()).toEqual([]);
    } finally {
      await src.close(100);
    }
  });

  it('migrateFrom_whenTheSourceIsNotTheHostTheDestinationExpects_refusesItsStream_andLoadNeverRuns', async () => {
    // The destination asked for host "other"; "src" answers and connects with its own certificate.
    let loaded = false;
    const t0 = Date.now();
    await expect(
      migrateFrom({ sourceAddress: source.address, ticket: ticket('dst'), hostId: 'dst', listenHost: '127.0.0.1', tls: tls.dst, connectTimeoutMs: 3_000, relay: { ...relays.dst!, sourceHostId: 'other' } }, async (s) => ((loaded = true), readStream(s))),
    ).rejects.toMatchObject({ kind: expect.stringMatching(/deadline_exceeded|unavailable|internal/) });
    expect(loaded).toBe(false);
    expect(Date.now() - t0).toBeLessThan(10_000);
    expect(ourRelays()).toEqual([]);
  });

  it('migrateFrom_throughRelays_whenTheCallerHasAlreadyGivenUp_failsAtOnce_andLoadNeverRuns', async () => {
    let loaded = false;
    const t0 = Date.now();
    await expect(
      migrateFrom({ sourceAddress: source.address, ticket: ticket('dst'), hostId: 'dst', listenHost: '127.0.0.1', tls: tls.dst, signal: AbortSignal.abort(new Error('preparation failed')), relay: { ...relays.dst!, sourceHostId: 'src' } }, async (s) => ((loaded = true), readStream(s))),
    ).rejects.toThrow('preparation failed');
    expect(loaded).toBe(false);
    expect(Date.now() - t0).toBeLessThan(5_000);
    expect(ourRelays()).toEqual([]);
  });

  it('listenRelay_refusesAConnectionFromAnotherAddress_andKeepsListeningForTheSource', async () => {
    const unixPath = join(dir, 'range.sock');
    const relay = await listenRelay({ ...relays.dst!, unixPath, peerHostId: 'src', acceptTimeoutMs: 5_000, bindHost: '127.0.0.1', fromHost: '127.0.0.1' });
    try {
      let verified = false;
      void relay.verified.then(() => (verified = true));
      // The right certificate from the wrong address (127.0.0.2, also loopback) gets no handshake.
      const tlsConnect = (from: string) =>
        new Promise<void>((resolve) => {
          const c = net.connect({ host: '127.0.0.1', port: relay.port, localAddress: from });
          c.on('error', () => resolve());
          c.on('close', () => resolve());
          c.on('connect', () => {
            // A real TLS client is not needed: the address is checked before the handshake.
            setTimeout(() => c.destroy(), 300);
          });
        });
      await tlsConnect('127.0.0.2');
      expect(verified).toBe(false);
      expect(existsSync(unixPath)).toBe(false);
      // Still listening: the source itself then gets through (as migrateFrom's first test shows end to end).
      const again = await net.connect({ host: '127.0.0.1', port: relay.port });
      await new Promise<void>((resolve, reject) => again.once('connect', resolve).once('error', reject));
      again.destroy();
    } finally {
      await relay.stop();
    }
    expect(ourRelays()).toEqual([]);
  });
});
