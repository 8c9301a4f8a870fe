// The source side of the transfer benchmarks (transfer.ts, transfer-probe.ts): snapshot s1
// (a booted guest's, transfer-guest.ts, or the synthetic image of transfer-image.ts) ingested
// into a chunk store, its manifest signed by a fresh key whose public half the receiving
// endpoint trusts; the warm-up snapshot `w`; and the long-lived receiver process
// (`endpoint-main.ts fetch-daemon`).
import { closeSync, ftruncateSync, openSync, readFileSync, writeFileSync, writeSync } from 'node:fs';
import { join } from 'node:path';
import { spawn } from 'node:child_process';
import { createInterface } from 'node:readline';
import { readLog, type NsHost } from '../adapters/peer/netns-testkit.ts';
import { FsChunkStore, FsManifestStore } from '../adapters/chunkstore/fs-store.ts';
import { ingestSnapshot } from '../adapters/chunkstore/ingest.ts';
import { LiveRoots, systemClock } from '../domain/snapshot-store.ts';
import { generateSigningKey, signManifest, type SigningKey } from '../domain/tickets.ts';
import { ArtifactKind } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { DEFAULT_IMAGE, writeDiskLayer, writeMemoryImage } from './transfer-image.ts';
import type { BenchArtifact } from './transfer-guest.ts';

/** The synthetic snapshot's files (transfer-image.ts): a memory image and a disk layer. */
export function writeSyntheticSource(dir: string): BenchArtifact[] {
  const mem = join(dir, 'mem.img');
  const disk = join(dir, 'disk0.img');
  writeMemoryImage(mem, DEFAULT_IMAGE);
  writeDiskLayer(disk, 64 * 1024 * 1024, 16 * 1024 * 1024);
  return [
    { kind: ArtifactKind.MEMORY, name: 'memory', path: mem },
    { kind: ArtifactKind.DISK_LAYER, name: 'disk/0', path: disk },
  ];
}

/** Ingests and signs s1 from `artifacts` (default: the synthetic image, written into `dir`). */
export async function prepareSource(dir: string, artifacts: readonly BenchArtifact[] = writeSyntheticSource(dir)) {
  const { signing, trusted } = generateSigningKey('k1');
  /** The public key the receiving endpoint trusts (PEM). */
  const pem = join(dir, 'trust.pem');
  writeFileSync(pem, (trusted.get('k1') as NonNullable<ReturnType<typeof trusted.get>>).export({ type: 'spki', format: 'pem' }));
  const srcRoot = join(dir, 'src');
  const store = { chunks: new FsChunkStore(srcRoot), manifests: new FsManifestStore(srcRoot), roots: new LiveRoots(), clock: systemClock };
  const s1 = await ingestSnapshot({ snapshotId: 's1', tenantId: 't', sourceSandboxId: 'sb1', artifacts: [...artifacts] }, store);
  await store.manifests.put('s1', signManifest(s1.manifest, signing));
  s1.unpin();
  return { artifacts, pem, srcRoot, store, signing, s1 };
}

/**
 * A copy of a sparse image in which every non-zero 4 KiB page carries a different 16-byte
 * stamp (salt, page number) in its first bytes: same size and compressibility, but no chunk
 * in common with the original (the warm-up snapshot must not deduplicate anything).
 */
export function writeVariant(src: string, dst: string, salt: number): void {
  const buf = readFileSync(src);
  const zero = Buffer.alloc(4096);
  const fd = openSync(dst, 'w');
  try {
    ftruncateSync(fd, buf.length);
    for (let p = 0; p * 4096 < buf.length; p++) {
      const page = buf.subarray(p * 4096, (p + 1) * 4096);
      if (page.equals(zero.subarray(0, page.length))) continue;
      page.writeUInt32LE(0x57524d55, 0);
      page.writeUInt32LE(salt, 4);
      page.writeDoubleLE(p, 8);
      writeSync(fd, page, 0, page.length, p * 4096);
    }
  } finally {
    closeSync(fd);
  }
}

/**
 * The warm-up snapshot `w` (transfer.ts, transfer-probe.ts): s1's files with every non-zero
 * page stamped, ingested and signed into the source store. Same size class, no chunk in common.
 */
export async function prepareWarmup(dir: string, artifacts: readonly BenchArtifact[], store: Awaited<ReturnType<typeof prepareSource>>['store'], signing: SigningKey) {
  const variants = artifacts.map((a, i) => {
    const path = join(dir, `warm-${i}.img`);
    writeVariant(a.path, path, i + 1);
    return { ...a, path };
  });
  const w = await ingestSnapshot({ snapshotId: 'w', tenantId: 't', sourceSandboxId: 'sb0', artifacts: variants }, store);
  await store.manifests.put('w', signManifest(w.manifest, signing));
  w.unpin();
  return w;
}

/** The long-lived receiver (`endpoint-main.ts fetch-daemon`) in a namespace: one JSON line per request. */
export function startDaemon(h: NsHost, args: readonly string[], logPath: string): { pid: number; ask: (req: object) => Promise<Record<string, unknown>>; stop: () => Promise<void> } {
  const child = spawn('ip', ['netns', 'exec', h.ns, ...args], { stdio: ['pipe', 'pipe', 'pipe'], env: { ...process.env, UV_THREADPOOL_SIZE: process.env.UV_THREADPOOL_SIZE ?? '16' } });
  const logFd = openSync(logPath, 'a');
  child.stderr.on('data', (b: Buffer) => writeSync(logFd, b));
  const lines = createInterface({ input: child.stdout })[Symbol.asyncIterator]();
  // 'close': the process exited and its stdio is drained (no stderr write after closeSync).
  const exited = new Promise<void>((r) => child.once('close', () => r()));
  const next = async (): Promise<Record<string, unknown>> => {
    const r = await lines.next();
    if (r.done) throw new Error(`fetch-daemon exited: ${readLog(logPath).slice(-2000)}`);
    return JSON.parse(r.value) as Record<string, unknown>;
  };
  const ready = next();
  ready.catch(() => undefined); // reported by the first ask
  return {
    pid: child.pid ?? -1,
    ask: async (req) => {
      await ready;
      child.stdin.write(`${JSON.stringify(req)}\n`);
      return next();
    },
    stop: async () => {
      child.stdin.end();
      const t = setTimeout(() => {
        if (child.pid !== undefined && child.exitCode === null) process.kill(child.pid, 'SIGKILL');
      }, 10_000);
      await exited;
      clearTimeout(t);
      closeSync(logFd);
    },
  };
}

