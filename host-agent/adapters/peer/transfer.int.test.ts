// Peer transfer between host agents in separate network namespaces (real processes, real
// gRPC, real veth/bridge). Needs root. Every namespace and process is removed in afterAll.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { cpSync, mkdirSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { FsChunkStore, FsManifestStore, overwriteChunkFile } from '../chunkstore/fs-store.ts';
import { ingestSnapshot } from '../chunkstore/ingest.ts';
import { LiveRoots, systemClock } from '../../domain/snapshot-store.ts';
import { encodeSignedTicket, generateSigningKey, signManifest, signTicket, type SigningKey } from '../../domain/tickets.ts';
import { ArtifactKind } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { tempDir, waitFor, sleep } from '../../../services/testkit/proc.ts';
import type { ManagedProcess } from '../../../services/testkit/proc.ts';
import { writeMemoryImage, randomBytesSeeded } from '../../bench/transfer-image.ts';
import { createFabric, endpointTlsArgs, readLog, type Fabric, type NsHost } from './netns-testkit.ts';
import { ensureCa } from '../../../deploy/pki/pki.ts';

const ENDPOINT = resolve(fileURLToPath(new URL('.', import.meta.url)), 'endpoint-main.ts');
const NODE = [process.execPath, '--import', 'tsx', ENDPOINT];
const PORT = 7443;

interface FetchOut {
  ok: boolean;
  stored: number;
  report?: { requested: number; fetched: number; rejected: number; sources: Array<{ id: string; chunks: number; rejected: number }> };
  error?: { kind: string; message: string };
  materialised?: { files: Record<string, string> };
  /** The fetch process's stderr (not part of its report). */
  stderr: string;
}

let fabric: Fabric;
let dir: string;
let key: SigningKey;
let pem: string;
let A: NsHost, B: NsHost, R: NsHost;
let memPath: string;
let totalChunks: number;
const servers = new Map<string, ManagedProcess>();

function ticket(snapshotId: string, dest: string, opts: { key?: SigningKey; expiresAt?: Date } = {}): string {
  const t = signTicket({ snapshotId, destinationHostId: dest, expiresAt: opts.expiresAt ?? new Date(Date.now() + 300_000) }, opts.key ?? key);
  return Buffer.from(encodeSignedTicket(t)).toString('base64');
}

async function startServer(host: NsHost, root: string, extra: readonly string[] = [], port = PORT): Promise<ManagedProcess> {
  const logPath = join(dir, `${host.ns}-${servers.size}-${Date.now()}.log`);
  const p = fabric.spawn(host, `chunk-server-${host.ns}`, [...NODE, 'serve', '--root', root, '--listen', `${host.address}:${port}`, '--trust', pem, ...extra], logPath);
  await waitFor(`server in ${host.ns}`, async () => readLog(logPath).includes('"listening"'), 30_000, 50);
  if (port === PORT) servers.set(host.ns, p);
  return p;
}

/** --tls-* arguments with a peer certificate of `ca` for `hostId` at `address` (as deploy/ issues them). */
const peerCert = (ca: { caCert: string; caKey: string }, name: string, hostId: string, address: string): string[] => endpointTlsArgs(ca, join(dir, 'tls'), hostId, address, name);

function fetchArgs(root: string, snapshotId: string, tk: string, sources: readonly NsHost[], hostId = 'hostR', port = PORT): string[] {
  return [...NODE, 'fetch', '--root', root, '--host-id', hostId, '--snapshot', snapshotId, '--ticket', tk, '--sources', sources.map((s) => `${s.address}:${port}`).join(','), '--trust', pem, '--materialise'];
}

async function fetch(root: string, snapshotId: string, tk: string, sources: readonly NsHost[], hostId = 'hostR', extra: readonly string[] = [], port = PORT): Promise<FetchOut> {
  const r = await fabric.run(R, [...fetchArgs(root, snapshotId, tk, sources, hostId, port), ...extra], 90_000);
  const line = r.stdout.trim().split('\n').pop() ?? '';
  if (!line.startsWith('{')) throw new Error(`fetch produced no report (code ${r.code}): ${r.stderr.slice(-3000)}`);
  return { ...(JSON.parse(line) as Omit<FetchOut, 'stderr'>), stderr: r.stderr };
}

beforeAll(async () => {
  dir = tempDir('ff-peer-int-');
  fabric = createFabric(3);
  [A, B, R] = fabric.hosts as [NsHost, NsHost, NsHost];
  const gen = generateSigningKey('k1');
  key = gen.signing;
  pem = join(dir, 'trust.pem');
  writeFileSync(pem, gen.trusted.get('k1')!.export({ type: 'spki', format: 'pem' }));
  // 48 MiB guest: 4 MiB kernel-like pages, 12 MiB random, 6 MiB text; rest zero.
  memPath = join(dir, 'mem.img');
  writeMemoryImage(memPath, { memBytes: 48 << 20, kernelBytes: 4 << 20, randomBytes: 12 << 20, textBytes: 6 << 20, seed: 5 });
  const other = join(dir, 'other.img');
  writeFileSync(other, randomBytesSeeded(1 << 20, 77));
  const rootA = join(dir, 'A');
  const deps = { chunks: new FsChunkStore(rootA), manifests: new FsManifestStore(rootA), roots: new LiveRoots(), clock: systemClock };
  const s1 = await ingestSnapshot({ snapshotId: 's1', tenantId: 't', sourceSandboxId: 'sb', artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', path: memPath }] }, deps);
  await deps.manifests.put('s1', signManifest(s1.manifest, key));
  s1.unpin();
  const s2 = await ingestSnapshot({ snapshotId: 'other', tenantId: 't', sourceSandboxId: 'sb2', artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', path: other }] }, deps);
  await deps.manifests.put('other', signManifest(s2.manifest, key));
  s2.unpin();
  totalChunks = new Set(s1.manifest.artifacts.flatMap((a) => a.chunks.map((c) => Buffer.from(c.digest).toString('hex')))).size;
  // Host B holds the same snapshot (e.g. it received it earlier).
  cpSync(rootA, join(dir, 'B'), { recursive: true });
  await startServer(A, rootA);
  await startServer(B, join(dir, 'B'));
}, 120_000);

afterAll(async () => {
  await fabric?.destroy();
  if (dir) rmSync(dir, { recursive: true, force: true });
});

describe('peer transfer between network namespaces', () => {
  it('fetch_betweenNamespaces_materialisesByteIdenticalImage', async () => {
    const out = await fetch(join(dir, 'R1'), 's1', ticket('s1', 'hostR'), [A]);
    expect(out.error).toBeUndefined();
    expect(out.ok).toBe(true);
    expect(out.report?.fetched).toBe(totalChunks);
    const img = readFileSync(out.materialised!.files.memory!);
    expect(img.equals(readFileSync(memPath))).toBe(true);
    // Idempotent: fetching again transfers nothing.
    const again = await fetch(join(dir, 'R1'), 's1', ticket('s1', 'hostR'), [A]);
    expect(again.ok).toBe(true);
    expect(again.report?.requested).toBe(0);
  });

  it('fetch_withoutValidTicket_isRefusedAndNothingIsServed', async () => {
    const stranger = generateSigningKey('k1').signing; // same key id, different key
    const cases: Array<[string, string]> = [
      ['bad signature', ticket('s1', 'hostR', { key: stranger })],
      ['expired', ticket('s1', 'hostR', { expiresAt: new Date(Date.now() - 1000) })],
      ['wrong destination', ticket('s1', 'someOtherHost')],
      ['wrong snapshot', ticket('other', 'hostR')],
    ];
    for (const [what, tk] of cases) {
      const out = await fetch(join(dir, `R-deny-${what.replace(/ /g, '-')}`), 's1', tk, [A]);
      expect(out.ok, what).toBe(false);
      expect(['permission_denied', 'unauthenticated'], `${what}: ${out.error?.message}`).toContain(out.error?.kind);
      expect(out.stored, what).toBe(0);
    }
  });

  it('fetch_overMutualTls_worksForTheHostItsCertificateNames_andNoOneElse', async () => {
    mkdirSync(join(dir, 'tls'), { recursive: true });
    const ca = { caCert: join(dir, 'tls', 'ca.crt'), caKey: join(dir, 'tls', 'ca.key') };
    ensureCa(ca.caCert, ca.caKey);
    const other = { caCert: join(dir, 'tls', 'other-ca.crt'), caKey: join(dir, 'tls', 'other-ca.key') };
    ensureCa(other.caCert, other.caKey, '/CN=Another CA');
    const tlsPort = PORT + 1;
    const server = await startServer(A, join(dir, 'A'), peerCert(ca, 'A', 'hostA', A.address), tlsPort);
    try {
      // The host the ticket names, with its certificate: byte-identical, as in plain text.
      const ok = await fetch(join(dir, 'R-tls'), 's1', ticket('s1', 'hostR'), [A], 'hostR', peerCert(ca, 'R', 'hostR', R.address), tlsPort);
      expect(ok.error).toBeUndefined();
      expect(ok.report?.fetched).toBe(totalChunks);
      expect(readFileSync(ok.materialised!.files.memory!).equals(readFileSync(memPath))).toBe(true);
      // Peers are dialed by IP address, which TLS does not allow as the server name (SNI).
      expect(ok.stderr).not.toContain('DeprecationWarning');
      // Another host of the fleet with hostR's ticket, saying it is hostR: its certificate says otherwise.
      const impostor = await fetch(join(dir, 'R-tls-impostor'), 's1', ticket('s1', 'hostR'), [A], 'hostR', peerCert(ca, 'X', 'hostX', R.address), tlsPort);
      expect(impostor.ok).toBe(false);
      expect(['permission_denied', 'unauthenticated'], impostor.error?.message).toContain(impostor.error?.kind);
      expect(impostor.stored).toBe(0);
      // A certificate of another CA, or none (plain text): no TLS session, nothing served.
      const stranger = await fetch(join(dir, 'R-tls-stranger'), 's1', ticket('s1', 'hostR'), [A], 'hostR', peerCert(other, 'R-other', 'hostR', R.address), tlsPort);
      const plain = await fetch(join(dir, 'R-tls-plain'), 's1', ticket('s1', 'hostR'), [A], 'hostR', [], tlsPort);
      for (const [what, out] of [['another CA', stranger], ['plain text', plain]] as const) {
        expect(out.ok, what).toBe(false);
        expect(out.error?.kind, `${what}: ${out.error?.message}`).toBe('unavailable');
        expect(out.stored, what).toBe(0);
      }
    } finally {
      await server.stop(3000);
    }
    // A source whose certificate (of the fleet's CA) was issued for another address: the
    // receiver refuses it before asking for anything.
    const misnamed = await startServer(A, join(dir, 'A'), peerCert(ca, 'A-as-B', 'hostA', B.address), tlsPort);
    try {
      const out = await fetch(join(dir, 'R-tls-misnamed'), 's1', ticket('s1', 'hostR'), [A], 'hostR', peerCert(ca, 'R', 'hostR', R.address), tlsPort);
      expect(out.ok).toBe(false);
      expect(out.error?.kind, out.error?.message).toBe('unavailable');
      expect(out.stored).toBe(0);
    } finally {
      await misnamed.stop(3000);
    }
  });

  it('fetch_whenChunkCorruptOnOneSource_rejectsItAndRefetchesFromAnother', async () => {
    // Corrupt every chunk on B (same length, flipped bytes): whatever B sends is rejected.
    const storeB = new FsChunkStore(join(dir, 'B'));
    for (const d of await storeB.list()) {
      const raw = readFileSync(storeB.pathOf(d));
      for (let i = 16; i < raw.length; i += 97) raw[i] = (raw[i] ?? 0) ^ 0xff;
      await overwriteChunkFile(storeB, d, raw);
    }
    // A slower than B: B's copies arrive (and are verified, and rejected) first. With A as fast,
    // A could take every chunk B was asked for (tail hedging) before B's copies came, which
    // are then dropped unverified as late copies, and nothing was rejected.
    fabric.shape(A, '200mbit', '64kb');
    const out = await fetch(join(dir, 'R3'), 's1', ticket('s1', 'hostR'), [B, A]).finally(() => fabric.shape(A, '10gbit', '4mb'));
    expect(out.error).toBeUndefined();
    expect(out.report!.rejected).toBeGreaterThan(0);
    const fromA = out.report!.sources.filter((s) => s.id.includes(A.address)).reduce((n, s) => n + s.chunks, 0);
    expect(fromA).toBe(totalChunks);
    expect(readFileSync(out.materialised!.files.memory!).equals(readFileSync(memPath))).toBe(true);
  });

  it('fetch_whenSenderKilledMidTransfer_retrySendsOnlyMissingChunks', async () => {
    // Slow A's egress so the kill lands mid-transfer.
    fabric.shape(A, '40mbit', '64kb');
    const root = join(dir, 'R2');
    const chunkCount = (): number => {
      try {
        return readdirSync(join(root, 'chunks')).reduce((n, sub) => n + readdirSync(join(root, 'chunks', sub)).length, 0);
      } catch {
        return 0;
      }
    };
    const first = fetch(root, 's1', ticket('s1', 'hostR'), [A]);
    await waitFor('some chunks to arrive', async () => chunkCount() >= 8, 60_000, 20);
    servers.get(A.ns)!.kill(); // SIGKILL by PID
    const out1 = await first;
    expect(out1.ok).toBe(false);
    const storedAfterKill = out1.stored;
    expect(storedAfterKill).toBeGreaterThan(0);
    expect(storedAfterKill).toBeLessThan(totalChunks);

    fabric.shape(A, '10gbit', '4mb');
    await sleep(100);
    const server = await startServer(A, join(dir, 'A'));
    const out2 = await fetch(root, 's1', ticket('s1', 'hostR'), [A]);
    expect(out2.error).toBeUndefined();
    expect(out2.report!.requested).toBe(totalChunks - storedAfterKill);
    expect(out2.report!.fetched).toBe(totalChunks - storedAfterKill);
    expect(readFileSync(out2.materialised!.files.memory!).equals(readFileSync(memPath))).toBe(true);
    // The restarted sender served exactly the missing chunks.
    await server.stop(3000);
    const stats = /"chunksServed":(\d+)/.exec(readLog(server.logPath!));
    expect(Number(stats?.[1])).toBe(totalChunks - storedAfterKill);
  });
});
