// The chunk store on a real file system: ingest, diff sharing, sparse materialise, verify
// on read, GC reachability, and crash safety of chunk writes (kill -9 of a writer).
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { openSync, readFileSync, readdirSync, rmSync, statSync, writeFileSync, closeSync, ftruncateSync, writeSync, utimesSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { spawn } from 'node:child_process';
import { FsChunkStore, FsManifestStore, overwriteChunkFile } from './fs-store.ts';
import { ingestSnapshot, type ArtifactInput } from './ingest.ts';
import { Materialiser } from './materialise.ts';
import { LiveRoots, manifestDigests, systemClock } from '../../domain/snapshot-store.ts';
import { collectGarbage, deleteSnapshot } from '../../domain/snapshot-store-gc.ts';
import { generateSigningKey, signManifest } from '../../domain/tickets.ts';
import { ChunkCorruptError, DigestMismatchError, SnapshotLeasedError, ManifestInvalidError } from '../../domain/transfer-errors.ts';
import { encodeChunk, sha256Hex } from './codec.ts';
import { markOwned } from './buffers.ts';
import { DIRECT_ALIGN } from './chunk-file.ts';
import { ArtifactKind, Codec } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { compressSync as lz4Compress } from 'lz4-napi';
import { tempDir, sleep } from '../../../services/testkit/proc.ts';
import { randomBytesSeeded, textBytes } from '../../bench/transfer-image.ts';

const CS = 256 * 1024;
let dir: string;
const { signing, trusted } = generateSigningKey('k1');

/** A sparse image: `blocks` maps chunk index -> content. */
function image(path: string, size: number, blocks: Record<number, Buffer>): void {
  const fd = openSync(path, 'w');
  ftruncateSync(fd, size);
  for (const [i, b] of Object.entries(blocks)) writeSync(fd, b, 0, b.length, Number(i) * CS);
  closeSync(fd);
}

function setup(name: string) {
  const root = join(dir, name);
  const chunks = new FsChunkStore(root);
  const manifests = new FsManifestStore(root);
  const roots = new LiveRoots();
  const mat = new Materialiser({ root, chunks, manifests, roots, trust: trusted });
  const ingest = async (snapshotId: string, artifacts: ArtifactInput[], parent?: string) => {
    const r = await ingestSnapshot({ snapshotId, tenantId: 't', sourceSandboxId: 'sb', parentSnapshotId: parent, artifacts }, { chunks, roots, clock: systemClock, chunkSize: CS });
    await manifests.put(snapshotId, signManifest(r.manifest, signing));
    r.unpin();
    return r;
  };
  return { root, chunks, manifests, roots, mat, ingest };
}

beforeAll(() => {
  dir = tempDir('ff-chunkstore-int-');
});
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe('content-addressed snapshot store', () => {
  it('ingest_thenMaterialise_isByteIdenticalSparseAndCached', async () => {
    const s = setup('rt');
    const mem = join(dir, 'rt.img');
    image(mem, 16 * CS + 1000, { 1: randomBytesSeeded(CS, 1), 5: textBytes(CS, 2), 16: textBytes(1000, 3) });
    const disk = join(dir, 'rt-disk.img');
    writeFileSync(disk, textBytes(3 * CS, 4));
    const { manifest, stats } = await s.ingest('s1', [{ kind: ArtifactKind.MEMORY, name: 'memory', path: mem }, { kind: ArtifactKind.DISK_LAYER, name: 'disk/0', path: disk }]);
    expect(stats.zeroChunks).toBe(14);
    expect(manifest.artifacts[0]!.chunks.map((c) => Number(c.index))).toEqual([1, 5, 16]);
    const m1 = await s.mat.materialise('s1');
    expect(m1.built).toBe(true);
    expect(readFileSync(m1.files.memory!).equals(readFileSync(mem))).toBe(true);
    expect(readFileSync(m1.files['disk/0']!).equals(readFileSync(disk))).toBe(true);
    // Sparse: only the three non-zero chunks are allocated.
    expect(statSync(m1.files.memory!).blocks * 512).toBeLessThanOrEqual(4 * CS);
    const m2 = await s.mat.materialise('s1');
    expect(m2.built).toBe(false);
    expect(m2.files.memory).toBe(m1.files.memory);
  });

  it('ingest_ofChild_storesOnlyChangedChunks', async () => {
    const s = setup('diff');
    const blocks: Record<number, Buffer> = {};
    for (let i = 0; i < 12; i++) blocks[i] = randomBytesSeeded(CS, 10 + i);
    const parent = join(dir, 'p.img');
    image(parent, 32 * CS, blocks);
    const child = join(dir, 'c.img');
    image(child, 32 * CS, { ...blocks, 3: randomBytesSeeded(CS, 99), 20: textBytes(CS, 5) });
    const p = await s.ingest('p', [{ kind: ArtifactKind.MEMORY, name: 'memory', path: parent }]);
    const c = await s.ingest('c', [{ kind: ArtifactKind.MEMORY, name: 'memory', path: child }], 'p');
    expect(p.stats.newChunks).toBe(12);
    expect(c.stats.newChunks).toBe(2);
    expect(c.stats.dedupChunks).toBe(11);
    expect(c.manifest.parentSnapshotId).toBe('p');
    expect((await s.chunks.list()).length).toBe(14);
    // Re-ingesting is idempotent.
    expect((await s.ingest('c', [{ kind: ArtifactKind.MEMORY, name: 'memory', path: child }], 'p')).stats.newChunks).toBe(0);
  });

  it('materialise_whenStoredChunkCorrupt_refusesAndRemovesIt', async () => {
    const s = setup('corrupt');
    const mem = join(dir, 'corrupt.img');
    image(mem, 4 * CS, { 0: textBytes(CS, 8), 2: randomBytesSeeded(CS, 9) });
    const { manifest } = await s.ingest('s1', [{ kind: ArtifactKind.MEMORY, name: 'memory', path: mem }]);
    const victim = Buffer.from(manifest.artifacts[0]!.chunks[1]!.digest).toString('hex');
    const raw = readFileSync(s.chunks.pathOf(victim));
    raw[100] = (raw[100] ?? 0) ^ 1;
    await overwriteChunkFile(s.chunks, victim, raw);
    await expect(s.mat.materialise('s1')).rejects.toBeInstanceOf(ChunkCorruptError);
    expect(await s.chunks.has(victim)).toBe(false);
    expect(readdirSync(join(s.root, 'images'))).toEqual([]);
  });

  it('materialise_whenAStoredChunkCannotBeRead_failsOnlyAfterEveryImageWriteStopped', async () => {
    const s = setup('eio');
    const mem = join(dir, 'eio.img');
    const blocks: Record<number, Buffer> = {};
    for (let i = 0; i < 32; i++) blocks[i] = textBytes(CS, 100 + i);
    image(mem, 32 * CS, blocks);
    const { manifest } = await s.ingest('s1', [{ kind: ArtifactKind.MEMORY, name: 'memory', path: mem }]);
    const victim = Buffer.from(manifest.artifacts[0]!.chunks[0]!.digest).toString('hex');
    // The first chunk fails at once (EIO); the others read slowly. Reads still running when
    // materialise gives up would write by descriptor number into handles it has closed.
    let active = 0;
    const chunks = new Proxy(s.chunks, {
      get: (target, key) => {
        const v = Reflect.get(target, key) as unknown;
        if (key !== 'readVerified') return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v;
        return async (digest: string) => {
          if (digest === victim) throw Object.assign(new Error('EIO: i/o error, read'), { code: 'EIO' });
          active++;
          try {
            await sleep(20);
            return await target.readVerified(digest);
          } finally {
            active--;
          }
        };
      },
    });
    const mat = new Materialiser({ root: s.root, chunks, manifests: s.manifests, roots: s.roots, trust: trusted });
    let activeAtFailure = -1;
    await expect(mat.materialise('s1').catch((e: unknown) => {
      activeAtFailure = active;
      throw e;
    })).rejects.toThrow(/EIO/);
    expect(activeAtFailure).toBe(0);
    expect(readdirSync(join(s.root, 'images'))).toEqual([]);
  });

  it('materialise_whenManifestTampered_refuses', async () => {
    const s = setup('tamper');
    const mem = join(dir, 'tamper.img');
    image(mem, 2 * CS, { 0: textBytes(CS, 1) });
    await s.ingest('s1', [{ kind: ArtifactKind.MEMORY, name: 'memory', path: mem }]);
    const signed = (await s.manifests.get('s1'))!;
    const bytes = Uint8Array.from(signed.manifest);
    bytes[bytes.length - 2] = (bytes[bytes.length - 2] ?? 0) ^ 1;
    await s.manifests.put('s1', { ...signed, manifest: bytes });
    await expect(s.mat.materialise('s1')).rejects.toBeInstanceOf(ManifestInvalidError);
  });

  it('prune_keepsAnImageLeasedWhileItRuns_andRemovesItOnceTheLeaseIsReleased', async () => {
    const s = setup('lease-prune');
    const mem = join(dir, 'lease-prune.img');
    image(mem, 2 * CS, { 0: textBytes(CS, 5) });
    await s.ingest('s1', [{ kind: ArtifactKind.MEMORY, name: 'memory', path: mem }]);
    await s.mat.materialise('s1');
    // No manifest (a fetch not durable yet): the image stays only while something uses it.
    await s.manifests.delete('s1');
    // A restore leases it while the prune runs (after the prune listed what to keep).
    let lease: { release(): void } | undefined;
    expect(await s.mat.prune((id) => ((lease ??= s.roots.lease(id, 'restore/op-1')), false))).toEqual([]);
    expect(readdirSync(join(s.root, 'images'))).toEqual(['s1']);
    lease!.release();
    expect(await s.mat.prune()).toEqual(['s1']);
  });

  it('gc_afterDeletingSnapshot_freesExactlyTheChunksNothingElseReaches', async () => {
    const s = setup('gc');
    const base: Record<number, Buffer> = {};
    for (let i = 0; i < 6; i++) base[i] = randomBytesSeeded(CS, 200 + i);
    const paths = ['g1', 'g2', 'g3', 'g4'].map((n) => join(dir, `${n}.img`)) as [string, string, string, string];
    image(paths[0], 8 * CS, base); // s1
    image(paths[1], 8 * CS, { ...base, 0: randomBytesSeeded(CS, 300), 6: randomBytesSeeded(CS, 301) }); // s2 child of s1
    image(paths[2], 8 * CS, { 1: base[1]!, 7: randomBytesSeeded(CS, 302) }); // s3, leased by a VM
    image(paths[3], 8 * CS, { 2: base[2]!, 5: randomBytesSeeded(CS, 303) }); // s4, pinned in flight (no manifest yet)
    const r1 = await s.ingest('s1', [{ kind: ArtifactKind.MEMORY, name: 'memory', path: paths[0] }]);
    const r2 = await s.ingest('s2', [{ kind: ArtifactKind.MEMORY, name: 'memory', path: paths[1] }], 's1');
    const r3 = await s.ingest('s3', [{ kind: ArtifactKind.MEMORY, name: 'memory', path: paths[2] }]);
    const r4 = await ingestSnapshot({ snapshotId: 's4', tenantId: 't', sourceSandboxId: 'sb', artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', path: paths[3] }] }, { chunks: s.chunks, roots: s.roots, clock: systemClock, chunkSize: CS });
    r4.unpin();
    const unpin = s.roots.pin(manifestDigests(r4.manifest));
    const vm = await s.mat.acquire('s3', 'vm-1');
    // Age every chunk past the grace period.
    const old = new Date(Date.now() - 3_600_000);
    for (const d of await s.chunks.list()) utimesSync(s.chunks.pathOf(d), old, old);

    await expect(deleteSnapshot('s3', s)).rejects.toBeInstanceOf(SnapshotLeasedError);
    await deleteSnapshot('s1', s);
    const before = new Set(await s.chunks.list());
    const gc = await collectGarbage({ ...s, clock: systemClock, graceMs: 60_000 });
    const after = new Set(await s.chunks.list());
    const reachable = new Set([...manifestDigests(r2.manifest), ...manifestDigests(r3.manifest), ...manifestDigests(r4.manifest)]);
    const expectedFreed = [...manifestDigests(r1.manifest)].filter((d) => !reachable.has(d)).sort();
    const freed = [...before].filter((d) => !after.has(d)).sort();
    expect(freed).toEqual(expectedFreed);
    expect(freed.length).toBe(1); // s1's chunk 0; chunks 1..5 are shared with s2/s3/s4
    expect(gc.deleted).toBe(1);
    expect(readFileSync(vm.files.memory!).equals(readFileSync(paths[2]))).toBe(true);

    // Once nothing reaches them, the rest go too; new chunks within the grace period stay.
    vm.lease.release();
    unpin();
    await deleteSnapshot('s2', s);
    await deleteSnapshot('s3', s);
    expect((await s.mat.prune()).sort()).toEqual(['s3']);
    await collectGarbage({ ...s, clock: systemClock, graceMs: 60_000 });
    expect(await s.chunks.list()).toEqual([]);
  });

  it('accept_ofOwnedChunk_verifiesOnWorkerStoresAndRejectsMismatch', async () => {
    const store = new FsChunkStore(join(dir, 'offload'));
    const plain = Buffer.concat([textBytes(CS / 2, 3), randomBytesSeeded(CS / 2, 4)]);
    const good = await encodeChunk(plain);
    const data = Buffer.from(good.data);
    markOwned(data);
    const got = await store.accept({ ...good, data });
    expect(data.length).toBe(0); // handed to the worker
    expect(got.equals(plain)).toBe(true);
    expect((await store.readVerified(good.digest)).equals(plain)).toBe(true);
    // Wrong content for the digest, undecodable data, and a frame whose size is not the
    // chunk's: rejected, nothing stored.
    for (const bad of [
      { ...good, digest: sha256Hex(Buffer.from('other')) },
      { ...good, digest: sha256Hex(Buffer.from('x')), data: Buffer.alloc(good.data.length, 0xff) },
      { ...good, digest: sha256Hex(Buffer.from('y')), size: 4096 },
      { ...good, digest: sha256Hex(Buffer.from('z')), codec: Codec.LZ4 },
    ]) {
      const owned = Buffer.from(bad.data);
      markOwned(owned);
      await expect(store.accept({ ...bad, data: owned })).rejects.toBeInstanceOf(DigestMismatchError);
      expect(await store.has(bad.digest)).toBe(false);
    }
    // A chunk an older peer sends as lz4 is still taken.
    const text = textBytes(CS, 5);
    const lz4 = Buffer.from(lz4Compress(text));
    markOwned(lz4);
    expect((await store.accept({ digest: sha256Hex(text), codec: Codec.LZ4, size: CS, data: lz4 })).equals(text)).toBe(true);
    expect(readdirSync(join(dir, 'offload', 'tmp'))).toEqual([]);
  });

  it('sync_calledWhileAnotherSyncOrAWorkersAcceptRuns_resolvesOnlyAfterIt', async () => {
    // A second fetch or ingest that finds chunks present relies on their durability: its
    // sync() (with nothing of its own to fsync) must not end before theirs.
    const store = new FsChunkStore(join(dir, 'sync-order'));
    const order: string[] = [];
    for (let i = 0; i < 64; i++) await store.put(await encodeChunk(randomBytesSeeded(CS, 100 + i)));
    const first = store.sync().then(() => order.push('first'));
    const second = store.sync().then(() => order.push('second'));
    await Promise.all([first, second]);
    expect(order).toEqual(['first', 'second']);
    // A chunk a verify worker is storing: sync() waits until it is in place and synced.
    const c = await encodeChunk(randomBytesSeeded(CS, 200));
    const data = Buffer.from(c.data);
    markOwned(data);
    const accepted = store.accept({ ...c, data }).then(() => order.push('accepted'));
    await store.sync().then(() => order.push('synced'));
    await accepted;
    expect(order.slice(2)).toEqual(['accepted', 'synced']);
  });

  it('acceptInto_onWorkerOrInline_storesChunkAndWritesEveryPlaceOrNothingOnMismatch', async () => {
    const store = new FsChunkStore(join(dir, 'place'));
    const plain = Buffer.concat([textBytes(CS / 2, 5), randomBytesSeeded(CS / 2, 6)]);
    const good = await encodeChunk(plain);
    const img = join(dir, 'place.img');
    const fd = openSync(img, 'w+');
    try {
      ftruncateSync(fd, 4 * CS);
      // Owned (verified and placed on a worker), then shared (inline): each at two places.
      const owned = Buffer.from(good.data);
      markOwned(owned);
      await store.acceptInto({ ...good, data: owned }, [{ fd, pos: 0 }, { fd, pos: 2 * CS }]);
      expect(owned.length).toBe(0);
      await store.acceptInto({ ...good, data: Buffer.from(good.data) }, [{ fd, pos: CS }, { fd, pos: 3 * CS }]);
      const got = readFileSync(img);
      for (let i = 0; i < 4; i++) expect(got.subarray(i * CS, (i + 1) * CS).equals(plain)).toBe(true);
      expect((await store.readVerified(good.digest)).equals(plain)).toBe(true);
      // Wrong content for the digest: rejected, nothing stored, the place left alone.
      ftruncateSync(fd, 0);
      ftruncateSync(fd, CS);
      const bad = Buffer.from(good.data);
      markOwned(bad);
      const other = sha256Hex(Buffer.from('other'));
      await expect(store.acceptInto({ ...good, digest: other, data: bad }, [{ fd, pos: 0 }])).rejects.toBeInstanceOf(DigestMismatchError);
      await expect(store.acceptInto({ ...good, digest: other, data: Buffer.from(good.data) }, [{ fd, pos: 0 }])).rejects.toBeInstanceOf(DigestMismatchError);
      expect(await store.has(other)).toBe(false);
      expect(readFileSync(img).equals(Buffer.alloc(CS))).toBe(true);
    } finally {
      closeSync(fd);
    }
  });

  it('acceptInto_chunkWithZeroPages_leavesThemAsHolesAndReadsBackIdentical', async () => {
    const store = new FsChunkStore(join(dir, 'holes'));
    // Pages 0-1 text, 2-29 zero, 30 random, 31-63 zero: 3 of 64 pages hold data.
    const plain = Buffer.alloc(CS);
    textBytes(2 * 4096, 8).copy(plain, 0);
    randomBytesSeeded(4096, 9).copy(plain, 30 * 4096);
    const good = await encodeChunk(plain);
    const img = join(dir, 'holes.img');
    const fd = openSync(img, 'w+');
    try {
      ftruncateSync(fd, 2 * CS);
      const owned = Buffer.from(good.data);
      markOwned(owned);
      await store.acceptInto({ ...good, data: owned }, [{ fd, pos: 0 }]); // on a worker
      await store.acceptInto({ ...good, data: Buffer.from(good.data) }, [{ fd, pos: CS }]); // inline
    } finally {
      closeSync(fd);
    }
    const got = readFileSync(img);
    expect(got.subarray(0, CS).equals(plain)).toBe(true);
    expect(got.subarray(CS).equals(plain)).toBe(true);
    // 6 data pages in all; ext4 allocates in 4 KiB blocks (st_blocks counts 512 B units).
    expect(statSync(img).blocks * 512).toBeLessThanOrEqual(6 * 4096);
  });

  it('accept_onAWorker_writesTheChunkFilePaddedForDirectIo_andEveryReaderTakesIt', async () => {
    // A received chunk (owned: verified on a worker) goes to disk with O_DIRECT, zero-padded
    // to DIRECT_ALIGN bytes; the header's data length says where the data ends.
    const store = new FsChunkStore(join(dir, 'direct'));
    const plain = Buffer.concat([textBytes(CS / 2, 11), randomBytesSeeded(CS / 2 - 1000, 12), Buffer.alloc(1000)]);
    const good = await encodeChunk(plain);
    expect((16 + good.data.length) % DIRECT_ALIGN).not.toBe(0); // so there is padding
    const owned = Buffer.from(good.data);
    markOwned(owned);
    expect((await store.accept({ ...good, data: owned })).equals(plain)).toBe(true);
    const size = statSync(store.pathOf(good.digest)).size;
    expect(size % DIRECT_ALIGN).toBe(0);
    expect(size - 16 - good.data.length).toBeGreaterThan(0);
    expect((await store.readVerified(good.digest)).equals(plain)).toBe(true);
    const sent = await store.getEncodedForSend(good.digest);
    expect(sent && Buffer.from(sent.data).equals(good.data)).toBe(true);
    // A file cut inside its data is still not a chunk.
    await overwriteChunkFile(store, good.digest, readFileSync(store.pathOf(good.digest)).subarray(0, 16 + good.data.length - 1));
    await expect(store.readVerified(good.digest)).rejects.toBeInstanceOf(ChunkCorruptError);
  });

  it('put_whenWriterKilledMidWrite_leavesNoChunkThatPassesAsValid', async () => {
    const root = join(dir, 'crash');
    const writer = resolve(fileURLToPath(new URL('.', import.meta.url)), 'crash-writer.fixture.ts');
    const child = spawn(process.execPath, ['--import', 'tsx', writer, root], { stdio: ['ignore', 'pipe', 'inherit'] });
    let started = false;
    child.stdout.on('data', () => (started = true));
    try {
      const until = Date.now() + 30_000;
      while (!started && Date.now() < until) await sleep(20);
      expect(started).toBe(true);
      await sleep(300);
    } finally {
      if (child.pid !== undefined) process.kill(child.pid, 'SIGKILL');
    }
    await new Promise((r) => child.once('exit', r));
    const store = new FsChunkStore(root); // reopening clears leftover temp files
    const digests = await store.list();
    expect(digests.length).toBeGreaterThan(0);
    for (const d of digests) await expect(store.readVerified(d)).resolves.toBeInstanceOf(Buffer);
    expect(readdirSync(join(root, 'tmp'))).toEqual([]);
  });
});
