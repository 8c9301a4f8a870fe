// MigrateSnapshot over real gRPC on loopback (ADR 0015): the ticket check, the target being
// the caller's own address, and the destination handing the source's connection on unread.
// The source's QEMU is replaced by a function that connects and writes (the driver's side
// is tested against real QEMU in adapters/qemu/driver.int.test.ts).
import net from 'node:net';
import { mkdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { FsChunkStore, FsManifestStore } from '../chunkstore/fs-store.ts';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { generateSigningKey, signTicket, type SigningKey, type TrustedKeys } from '../../domain/tickets.ts';
import { ChunkTransferService } from '../../../proto/gen/forkfleet/v1/transfer_pb.ts';
import { startGrpcServer, type RunningGrpcServer } from '../../../services/adapters/grpc/server.ts';
import { createClient } from '../../../services/adapters/grpc/rpc.ts';
import { tempDir } from '../../../services/testkit/proc.ts';
import type { CallContext } from '../../../services/adapters/grpc/rpc.ts';
import { chunkTransferService, HOST_ID_METADATA, peerHost } from './server.ts';
import { storeHoldingS1 } from './migrate-testkit.ts';
import { MIGRATION_START_MS, migrateFrom, migrateOutThroughRelay } from './migrate.ts';
import type { MigrationStream } from '../../domain/vmm.ts';

let dir: string;
let key: SigningKey;
let trust: TrustedKeys;
let withMigrate: RunningGrpcServer;
let without: RunningGrpcServer;
const targets: Array<{ host: string; port: number }> = [];

/** Stands in for the driver's migrateOut: connects to the target and sends a fixed stream. */
async function fakeMigrate(_snapshotId: string, target: { host: string; port: number }): Promise<{ bytes: number; ms: number }> {
  targets.push(target);
  const c = net.createConnection(target.port, target.host);
  await new Promise<void>((resolve, reject) => c.once('connect', resolve).once('error', reject));
  await new Promise<void>((resolve) => c.end('the-migration-stream', resolve));
  return { bytes: 20, ms: 1 };
}

const ticket = (dest: string, k = key, allowMigration = true) => signTicket({ snapshotId: 's1', destinationHostId: dest, expiresAt: new Date(Date.now() + 60_000), allowMigration }, k);

/** What QEMU does with a stream: reads an accepted connection, or listens on the relay's unix socket and reads the first. */
async function readAll(stream: MigrationStream): Promise<string> {
  let conn: net.Socket;
  if (stream instanceof net.Socket) conn = stream;
  else {
    const server = net.createServer();
    const accepted = new Promise<net.Socket>((r) => server.once('connection', r));
    await new Promise<void>((r) => server.listen(stream.unixPath, r));
    conn = await accepted;
    server.close();
  }
  conn.resume();
  let s = '';
  for await (const b of conn) s += (b as Buffer).toString();
  return s;
}

beforeAll(async () => {
  dir = tempDir('ff-migrate-');
  const gen = generateSigningKey('k1');
  key = gen.signing;
  trust = gen.trusted;
  const deps = await storeHoldingS1(dir, key);
  const svc = (migrate?: typeof fakeMigrate) => chunkTransferService({ chunks: deps.chunks, manifests: deps.manifests, trust, clock: { now: () => new Date() }, ...(migrate ? { migrate } : {}) }).registration;
  withMigrate = await startGrpcServer({ address: '127.0.0.1:0', services: [svc(fakeMigrate)] });
  without = await startGrpcServer({ address: '127.0.0.1:0', services: [svc()] });
});

afterAll(async () => {
  await withMigrate?.close(100);
  await without?.close(100);
  if (dir) rmSync(dir, { recursive: true, force: true });
});

describe('MigrateSnapshot', () => {
  it('migrateFrom_withValidTicket_sourceConnectsToTheCallersAddressAndTheStreamReachesLoadUnread', async () => {
    const r = await migrateFrom({ sourceAddress: withMigrate.address, ticket: ticket('hostR'), hostId: 'hostR', listenHost: '127.0.0.1' }, readAll);
    expect(r.result).toBe('the-migration-stream');
    expect(r.bytes).toBe(20);
    expect(targets.at(-1)?.host).toBe('127.0.0.1');
  });

  it('migrateFrom_aSourceAdvertisedByHostName_takesItsConnectionFromAnAddressTheNameResolvesTo', async () => {
    // FF_PEER_ADVERTISE may name a host: the source's connection comes from one of its addresses.
    const port = withMigrate.address.split(':').at(-1);
    const r = await migrateFrom({ sourceAddress: `localhost:${port}`, ticket: ticket('hostR'), hostId: 'hostR', listenHost: '127.0.0.1', connectTimeoutMs: 3_000 }, readAll);
    expect(r.result).toBe('the-migration-stream');
    expect(r.bytes).toBe(20);
  });

  it('migrateFrom_aSourceWhoseHostNameDoesNotResolve_failsRetryablyBeforeAskingIt_soTheCallerTriesTheNext', async () => {
    const calls = targets.length;
    await expect(migrateFrom({ sourceAddress: 'no-such-host.invalid:5000', ticket: ticket('hostR'), hostId: 'hostR', listenHost: '127.0.0.1' }, readAll)).rejects.toMatchObject({ kind: 'unavailable', retryable: true });
    expect(targets.length).toBe(calls);
  });

  it('migrateFrom_withoutValidTicket_isRefusedAndLoadNeverRuns', async () => {
    const stranger = generateSigningKey('k1').signing;
    let loaded = false;
    const load = async (c: MigrationStream): Promise<string> => {
      loaded = true;
      return readAll(c);
    };
    const calls = targets.length;
    for (const t of [ticket('hostR', stranger), ticket('someOtherHost')]) {
      await expect(migrateFrom({ sourceAddress: withMigrate.address, ticket: t, hostId: 'hostR', listenHost: '127.0.0.1' }, load)).rejects.toMatchObject({ kind: expect.stringMatching(/permission_denied|unauthenticated/) });
    }
    expect(loaded).toBe(false);
    expect(targets.length).toBe(calls);
  });

  it('migrateSnapshot_withAFetchOnlyTicket_isPermissionDenied_andTheSourceStartsNoMigration', async () => {
    // A drain's copy or a fan-out relay gets a ticket to fetch only: its destination must end
    // up holding the snapshot, and the source must not start a QEMU for it.
    let loaded = false;
    const calls = targets.length;
    await expect(migrateFrom({ sourceAddress: withMigrate.address, ticket: ticket('hostR', key, false), hostId: 'hostR', listenHost: '127.0.0.1' }, async (c) => ((loaded = true), readAll(c)))).rejects.toMatchObject({
      kind: 'permission_denied',
      message: expect.stringContaining('not migration'),
    });
    expect(loaded).toBe(false);
    expect(targets.length).toBe(calls);
  });

  it('fetchChunks_wantOfADigestThatIsNot32Bytes_isInvalidArgumentNamingIt', async () => {
    // The same service serves chunks: a malformed want is the caller's error, not a ticket's.
    const client = createClient(ChunkTransferService, withMigrate.address);
    try {
      async function* reqs() {
        yield { payload: { case: 'open' as const, value: { ticket: ticket('hostR'), credit: 4 } } };
        yield { payload: { case: 'want' as const, value: { digests: [new Uint8Array(32), new Uint8Array(5)] } } };
      }
      const call = client.fetchChunks(reqs(), { metadata: { [HOST_ID_METADATA]: 'hostR' } });
      const got = await (async () => {
        for await (const _ of call) void _;
      })().then(() => undefined, (e: unknown) => e as { kind?: string; field?: string });
      expect(got).toMatchObject({ kind: 'invalid_argument', field: 'want.digests[1]' });
    } finally {
      client.close();
    }
  });

  /** A source that accepts MigrateSnapshot and connects only when released. */
  async function slowSource(): Promise<{ server: RunningGrpcServer; release: () => void }> {
    let release = (): void => undefined;
    const late = new Promise<void>((r) => (release = r));
    const slowMigrate = async (id: string, target: { host: string; port: number }) => {
      await late;
      return fakeMigrate(id, target).catch(() => ({ bytes: 0, ms: 0 }));
    };
    const server = await startGrpcServer({ address: '127.0.0.1:0', services: [chunkTransferService({ chunks: new FsChunkStore(join(dir, 'A')), manifests: new FsManifestStore(join(dir, 'A')), trust, clock: { now: () => new Date() }, migrate: slowMigrate }).registration] });
    return { server, release };
  }

  it('migrateFrom_whenTheCallerGivesUpBeforeTheSourceConnects_endsTheWaitAndLoadNeverRuns', async () => {
    const { server: slow, release } = await slowSource();
    try {
      let loaded = false;
      const gaveUp = new AbortController();
      setTimeout(() => gaveUp.abort(new Error('preparation failed')), 50);
      const t0 = Date.now();
      await expect(
        migrateFrom({ sourceAddress: slow.address, ticket: ticket('hostR'), hostId: 'hostR', listenHost: '127.0.0.1', signal: gaveUp.signal }, async (c) => ((loaded = true), readAll(c))),
      ).rejects.toThrow('preparation failed');
      expect(Date.now() - t0).toBeLessThan(5_000);
      expect(loaded).toBe(false);
    } finally {
      release();
      await slow.close(100);
    }
  });

  it('migrateFrom_whenTheSourceAcceptsButNeverConnects_givesUpAfterTheConnectTimeoutAndLoadNeverRuns', async () => {
    const { server: slow, release } = await slowSource();
    try {
      let loaded = false;
      const t0 = Date.now();
      await expect(
        migrateFrom({ sourceAddress: slow.address, ticket: ticket('hostR'), hostId: 'hostR', listenHost: '127.0.0.1', connectTimeoutMs: 150 }, async (c) => ((loaded = true), readAll(c))),
      ).rejects.toMatchObject({ kind: 'deadline_exceeded', message: expect.stringContaining('did not connect within 150 ms') });
      expect(Date.now() - t0).toBeLessThan(5_000);
      expect(loaded).toBe(false);
    } finally {
      release();
      await slow.close(100);
    }
  });

  it('migrateSnapshot_onAHostThatCannotMigrate_failsPreconditionSoTheCallerFetches', async () => {
    await expect(migrateFrom({ sourceAddress: without.address, ticket: ticket('hostR'), hostId: 'hostR', listenHost: '127.0.0.1' }, readAll)).rejects.toMatchObject({ kind: 'failed_precondition' });
  });

  it('migrateSnapshot_withPortZero_isInvalidArgumentNamingPort', async () => {
    const client = createClient(ChunkTransferService, withMigrate.address);
    try {
      await expect(client.migrateSnapshot({ ticket: ticket('hostR'), port: 0 }, { metadata: { [HOST_ID_METADATA]: 'hostR' } })).rejects.toMatchObject({ kind: 'invalid_argument', message: expect.stringContaining('port') });
    } finally {
      client.close();
    }
  });

  it('migrateFrom_byDefault_givesTheSourcesCallFarMoreThanTwoMinutes_soALargeVmsStreamIsNotCutOff', async () => {
    // 32 GiB at 2 Gbit/s streams for over two minutes: the source fails a stream that stops
    // moving, and the call's deadline is only a backstop far beyond that.
    const reg = chunkTransferService({ chunks: new FsChunkStore(join(dir, 'A')), manifests: new FsManifestStore(join(dir, 'A')), trust, clock: { now: () => new Date() }, migrate: fakeMigrate }).registration;
    const serve = reg.handlers.migrateSnapshot as unknown as (req: unknown, ctx: CallContext) => Promise<unknown>;
    const deadlines: Array<Date | undefined> = [];
    const server = await startGrpcServer({
      address: '127.0.0.1:0',
      services: [{ ...reg, handlers: { ...reg.handlers, migrateSnapshot: (req: unknown, ctx: CallContext) => (deadlines.push(ctx.deadline), serve(req, ctx)) } }],
    });
    try {
      const t0 = Date.now();
      const r = await migrateFrom({ sourceAddress: server.address, ticket: ticket('hostR'), hostId: 'hostR', listenHost: '127.0.0.1' }, readAll);
      expect(r.result).toBe('the-migration-stream');
      expect(deadlines).toHaveLength(1);
      expect((deadlines[0]?.getTime() ?? Infinity) - t0).toBeGreaterThan(20 * 60_000);
    } finally {
      await server.close(100);
    }
  });

  it('migrateOutThroughRelay_theSourcesRelay_waitsIdleForAsLongAsTheDestinationMayTakeToStartReading', async () => {
    // The destination's relay reads nothing until its QEMU listens (its disk layer, its QEMU
    // start: up to MIGRATION_START_MS): the source's relay, its buffers full meanwhile, must
    // not give up sooner (socat -T). A stand-in for socat notes its arguments.
    const relayDir = join(dir, 'relay-args');
    mkdirSync(relayDir, { recursive: true });
    const socat = join(relayDir, 'socat');
    writeFileSync(socat, `#!/bin/sh\nprintf '%s\\n' "$@" > "$0.args"\necho '2026/01/01 00:00:00 socat[1] N listening on AF=1 "x"' >&2\n`, { mode: 0o755 });
    const sent = await migrateOutThroughRelay({ socat, tlsDir: relayDir, socketDir: join(relayDir, 'sock') }, { host: '127.0.0.1', port: 4000, hostId: 'hostR' }, async () => 'sent');
    expect(sent).toBe('sent');
    const args = readFileSync(`${socat}.args`, 'utf8').split('\n');
    const idle = Number(args[args.indexOf('-T') + 1]) * 1000;
    expect(idle).toBeGreaterThanOrEqual(MIGRATION_START_MS);
  });

  it('migrateFrom_throughARelay_hasItWaitForThisHostsQemuForTheStartWindow_notTheCallsWholeDeadline', async () => {
    // The stream waits in the destination's relay until this host's QEMU listens: for as long
    // as the source waits for it to start reading, not for the call's backstop of half an hour.
    // A stand-in for socat notes its arguments, says it listens, and waits to be stopped.
    const relayDir = join(dir, 'relay-in');
    mkdirSync(relayDir, { recursive: true });
    const socat = join(relayDir, 'socat');
    writeFileSync(socat, `#!/bin/sh\nprintf '%s\\n' "$@" > "$0.args"\necho '2026/01/01 00:00:00 socat[1] N listening on AF=2 127.0.0.1:1' >&2\nexec sleep 30\n`, { mode: 0o755 });
    const relay = { socat, tlsDir: relayDir, socketDir: join(relayDir, 'sock'), sourceHostId: 'hostA' };
    await expect(migrateFrom({ sourceAddress: withMigrate.address, ticket: ticket('hostR'), hostId: 'hostR', listenHost: '127.0.0.1', connectTimeoutMs: 200, relay }, readAll)).rejects.toThrow();
    const unix = readFileSync(`${socat}.args`, 'utf8').split('\n').find((a) => a.startsWith('UNIX-CONNECT:'));
    const retries = Number(/retry=(\d+)/.exec(unix ?? '')?.[1]);
    expect(retries * 10).toBeGreaterThanOrEqual(MIGRATION_START_MS);
    expect(retries * 10).toBeLessThan(MIGRATION_START_MS + 1000);
  });

  it('peerHost_readsTheAddressOfEveryGrpcPeerForm', () => {
    expect(peerHost('10.0.0.2:5123')).toBe('10.0.0.2');
    expect(peerHost('ipv4:10.0.0.2:5123')).toBe('10.0.0.2');
    expect(peerHost('[fd00::2]:5123')).toBe('fd00::2');
    expect(peerHost('[::ffff:10.0.0.2]:5123')).toBe('10.0.0.2');
    expect(peerHost('unix:/tmp/x.sock')).toBeUndefined();
  });
});
