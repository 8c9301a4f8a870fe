// FsChunkStore and FsManifestStore on what goes wrong: files an OS crash cut short, image
// writes and renames that fail, and which files and directories get fsynced. The fsync
// helpers (our own, ../durable.ts) are wrapped to record what they were asked to sync.
import { afterAll, beforeAll, beforeEach, describe, expect, it, vi } from 'vitest';
import { closeSync, existsSync, mkdirSync, openSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { execFileSync } from 'node:child_process';
import { open } from 'node:fs/promises';
import { join } from 'node:path';
import { FsChunkStore, FsManifestStore, overwriteChunkFile } from './fs-store.ts';
import { encodeChunk } from './codec.ts';
import { ChunkCorruptError, ChunkLostError, DigestMismatchError } from '../../domain/transfer-errors.ts';
import { markOwned } from './buffers.ts';
import { create } from '@bufbuild/protobuf';
import { Codec, SignedManifestSchema } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { tempDir } from '../../../services/testkit/proc.ts';
import type * as Durable from '../durable.ts';
import { randomBytesSeeded, textBytes } from '../../bench/transfer-image.ts';

const synced = vi.hoisted(() => [] as string[]);
/** Paths whose next fsync fails (EIO). As on Linux, the error is reported once: the fsync after it returns 0. */
const failOnce = vi.hoisted(() => new Set<string>());
/** Paths whose next open for an fsync fails (EMFILE): nothing was written back or lost. */
const openFailsOnce = vi.hoisted(() => new Set<string>());
vi.mock('../durable.ts', async (importOriginal) => {
  const real = await importOriginal<typeof Durable>();
  return {
    ...real,
    fsyncPath: async (p: string) => {
      synced.push(p);
      await real.fsyncPath(p);
    },
    fsyncAll: async (paths: Iterable<string>, concurrency?: number) => {
      const list = [...paths];
      synced.push(...list);
      const unopened = list.filter((p) => openFailsOnce.delete(p));
      if (unopened.length > 0) throw new real.FsyncOpenError(unopened[0]!, { cause: Object.assign(new Error(`EMFILE: too many open files, open '${unopened[0]}'`), { code: 'EMFILE' }) });
      const failing = list.filter((p) => failOnce.delete(p));
      if (failing.length > 0) throw Object.assign(new Error(`EIO: i/o error, fsync '${failing[0]}'`), { code: 'EIO' });
      await real.fsyncAll(list, concurrency);
    },
  };
});

const CS = 256 * 1024;
let dir: string;

beforeAll(() => {
  dir = tempDir('ff-fs-store-');
});
afterAll(() => rmSync(dir, { recursive: true, force: true }));
beforeEach(() => {
  synced.length = 0;
  failOnce.clear();
  openFailsOnce.clear();
});

describe('FsChunkStore', () => {
  it('missing_ofEmptyOrHeaderlessChunkFile_countsItMissingUntilAFetchStoresAVerifiedCopyOverIt', async () => {
    const store = new FsChunkStore(join(dir, 'missing'));
    const [empty, short, whole] = await Promise.all([1, 2, 3].map((i) => encodeChunk(textBytes(CS, i))));
    for (const c of [empty!, short!, whole!]) await store.put(c);
    await overwriteChunkFile(store, empty!.digest, Buffer.alloc(0));
    await overwriteChunkFile(store, short!.digest, Buffer.from('FFC1'));
    expect(await store.missing([empty!.digest, short!.digest, whole!.digest])).toEqual([empty!.digest, short!.digest]);
    await expect(store.readVerified(short!.digest)).rejects.toBeInstanceOf(ChunkCorruptError);
    // What a fetch does with a missing chunk: a verified copy renamed over the torn file.
    await store.accept(empty!);
    expect(await store.missing([empty!.digest, short!.digest, whole!.digest])).toEqual([short!.digest]);
    expect((await store.readVerified(empty!.digest)).equals(textBytes(CS, 1))).toBe(true);
  });

  it('accept_ofAValidZstdFrameFollowedByMegabytesOfSkippableFrames_isRejectedAsADigestMismatch_andStoresNothing', async () => {
    const store = new FsChunkStore(join(dir, 'bloated'));
    const plain = textBytes(CS, 8);
    const enc = await encodeChunk(plain);
    expect(enc.codec).toBe(Codec.ZSTD);
    // A skippable frame (magic 0x184D2A50, u32 LE length): zstd decodes past it to the same
    // plain bytes and digest, so only the size of the data gives it away.
    const skippable = Buffer.alloc(8 + 8 * 1024 * 1024);
    skippable.writeUInt32LE(0x184d2a50, 0);
    skippable.writeUInt32LE(8 * 1024 * 1024, 4);
    const bloated = () => {
      const data = new Uint8Array(enc.data.length + skippable.length);
      data.set(enc.data, 0);
      data.set(skippable, enc.data.length);
      return { ...enc, data };
    };
    // Verified here, and on a verify worker (a received chunk's buffer is owned).
    await expect(store.accept(bloated())).rejects.toBeInstanceOf(DigestMismatchError);
    const owned = bloated();
    markOwned(owned.data);
    await expect(store.accept(owned)).rejects.toBeInstanceOf(DigestMismatchError);
    expect(await store.has(enc.digest)).toBe(false);
    // The chunk as it was encoded still goes in.
    expect((await store.accept(enc)).equals(plain)).toBe(true);
  });

  it('accept_ofAChunkWhoseCodecIsNoneWeKnow_isRejectedAsADigestMismatch_onEitherPath_andStoresNothing', async () => {
    // A peer's codec is any varint: one past a byte once failed the owned path's header write
    // (a RangeError, blamed on this host's disk, so the same source was asked again).
    const store = new FsChunkStore(join(dir, 'codec'));
    const enc = await encodeChunk(textBytes(CS, 12));
    for (const codec of [0, 4, 255, 256, 2 ** 31]) {
      await expect(store.accept({ ...enc, codec: codec as Codec })).rejects.toBeInstanceOf(DigestMismatchError);
      const owned = { ...enc, codec: codec as Codec, data: Uint8Array.from(enc.data) };
      markOwned(owned.data);
      await expect(store.accept(owned)).rejects.toBeInstanceOf(DigestMismatchError);
    }
    expect(await store.has(enc.digest)).toBe(false);
  });

  it('readVerified_ofACorruptFileAFetchReplacedMeanwhile_keepsTheVerifiedCopy', async () => {
    // The read sees the corrupt file; before the store removes it, a fetch places a verified
    // copy into place (and counts it stored). Only the corrupt bytes may go.
    const good = await encodeChunk(textBytes(CS, 9));
    class Racing extends FsChunkStore {
      override async getEncoded(d: string): Promise<Awaited<ReturnType<FsChunkStore['getEncoded']>>> {
        const stale = await super.getEncoded(d);
        await this.put(good);
        return stale;
      }
    }
    const store = new Racing(join(dir, 'quarantine-race'));
    await store.put(good);
    await overwriteChunkFile(store, good.digest, Buffer.concat([Buffer.from(readFileSync(store.pathOf(good.digest))).subarray(0, 64), Buffer.alloc(4096, 7)]));
    await expect(store.readVerified(good.digest)).rejects.toBeInstanceOf(ChunkCorruptError);
    expect(await store.missing([good.digest])).toEqual([]);
    expect((await FsChunkStore.prototype.readVerified.call(store, good.digest)).equals(textBytes(CS, 9))).toBe(true);
  });

  it('readVerified_ofAChunkLargerThanAnyReadSoFar_whileAnotherReadRaisesTheReadSize_returnsItWhole', async () => {
    // FF_CHUNK_BYTES above the default: the first reads after a start outgrow the store's read
    // size, and the first to learn a file's size raises it while others are still reading.
    const plain = randomBytesSeeded(1 << 20, 41);
    const c = await encodeChunk(plain);
    const store = new FsChunkStore(join(dir, 'read-size'));
    await store.put(c);
    const probe = await open(store.pathOf(c.digest), 'r');
    const fileHandle = Object.getPrototypeOf(probe) as { read: (...a: unknown[]) => Promise<{ bytesRead: number }> };
    await probe.close();
    const realRead = fileHandle.read;
    const read = vi.spyOn(fileHandle, 'read').mockImplementationOnce(async function (this: unknown, ...a: unknown[]) {
      const r = await realRead.apply(this, a);
      (store as unknown as { readHint: number }).readHint += 4 << 20; // another read's fallback, done meanwhile
      return r;
    });
    try {
      expect((await store.readVerified(c.digest)).equals(plain)).toBe(true);
      expect(read).toHaveBeenCalled();
    } finally {
      read.mockRestore();
    }
  });

  it('readVerified_ofACorruptFile_removesItAndLeavesNothingAside', async () => {
    const store = new FsChunkStore(join(dir, 'quarantine'));
    const c = await encodeChunk(textBytes(CS, 10));
    await store.put(c);
    await overwriteChunkFile(store, c.digest, Buffer.concat([Buffer.from(readFileSync(store.pathOf(c.digest))).subarray(0, 64), Buffer.alloc(4096, 7)]));
    await expect(store.readVerified(c.digest)).rejects.toBeInstanceOf(ChunkCorruptError);
    expect(existsSync(store.pathOf(c.digest))).toBe(false);
    expect(readdirSync(join(dir, 'quarantine', 'tmp'))).toEqual([]);
  });

  it('acceptInto_whenTheImageWriteFailsAfterTheChunkIsInPlace_nextSyncStillFsyncsTheChunk', async () => {
    const store = new FsChunkStore(join(dir, 'place-fails'));
    const c = await encodeChunk(randomBytesSeeded(CS, 7));
    const img = join(dir, 'place-fails.img');
    writeFileSync(img, Buffer.alloc(CS));
    // Open read-only: the verify worker's image write fails (EBADF) after its rename.
    const fd = openSync(img, 'r');
    try {
      const data = Buffer.from(c.data);
      markOwned(data);
      await expect(store.acceptInto({ ...c, data }, [{ fd, pos: 0 }])).rejects.toThrow(/writing image/);
    } finally {
      closeSync(fd);
    }
    expect(await store.has(c.digest)).toBe(true);
    await store.sync();
    expect(synced).toContain(store.pathOf(c.digest));
  });

  it('sync_whenAChunksFsyncFails_removesTheChunk_andNoSyncThatNeedsItPassesUntilItIsWrittenAgain_whileOthersDo', async () => {
    // An ingest's sync fails; its retry found the chunk present (read from the page cache) and
    // the fsync of the same file again returned 0: a manifest was stored over a chunk never on disk.
    const store = new FsChunkStore(join(dir, 'fsync-fails'), { offload: false });
    const c = await encodeChunk(textBytes(CS, 20));
    await store.put(c);
    failOnce.add(store.pathOf(c.digest));
    await expect(store.sync()).rejects.toThrow(/EIO/);
    expect(await store.missing([c.digest])).toEqual([c.digest]);
    expect(await store.getEncoded(c.digest)).toBeUndefined();
    await expect(store.sync([c.digest])).rejects.toBeInstanceOf(ChunkLostError);
    await expect(store.sync()).rejects.toBeInstanceOf(ChunkLostError);
    // A sync for a manifest that does not name it passes: one failed fsync stopped every
    // snapshot and fetch of the host before.
    const other = await encodeChunk(textBytes(CS, 24));
    await store.put(other);
    await store.sync([other.digest]);
    // Written again (a new file), then fsynced: durable, and syncs pass again.
    await store.put(c);
    synced.length = 0;
    await store.sync();
    expect(synced).toContain(store.pathOf(c.digest));
    expect((await store.readVerified(c.digest)).equals(textBytes(CS, 20))).toBe(true);
    await store.sync();
  });

  // Fetch A stored chunk d, synced it and stored its manifest. Fetch B's copy of d was renamed
  // over it; B's sync then failed (a writeback error of its own batch) and removed every file
  // of that batch, d included, which A's complete snapshot needs.
  for (const offload of [false, true]) {
    it(`sync_whoseFsyncFails_afterASecondCopyOfADurableChunkWasPut${offload ? 'OnAVerifyWorker' : ''}_keepsThatChunk`, async () => {
      const root = join(dir, `second-copy-${offload}`);
      const store = new FsChunkStore(root, { offload });
      const [d, e] = await Promise.all([30, 31].map((i) => encodeChunk(randomBytesSeeded(CS, i + (offload ? 10 : 0)))));
      await store.put(d!);
      await store.sync([d!.digest]); // A: durable; its manifest is stored now
      // B: a copy of d (a received buffer goes to a verify worker) and a chunk of its own.
      const copy = { ...d!, data: Uint8Array.from(d!.data) };
      if (offload) markOwned(copy.data);
      await store.accept(copy);
      await store.accept(e!);
      failOnce.add(store.pathOf(e!.digest));
      await expect(store.sync([d!.digest, e!.digest])).rejects.toThrow(/EIO/);
      expect(await store.missing([d!.digest, e!.digest])).toEqual([e!.digest]);
      expect((await store.readVerified(d!.digest)).equals(randomBytesSeeded(CS, 30 + (offload ? 10 : 0)))).toBe(true);
      expect(readdirSync(join(root, 'tmp'))).toEqual([]);
    });
  }

  it('accept_onAWorker_overAChunkFileWithAWholeHeaderAndTornData_replacesIt', async () => {
    // An OS crash before its sync: the header made it to disk, the data did not. A chunk file
    // that is there is kept only if it is valid; this one is replaced by the verified copy.
    const root = join(dir, 'torn-replaced');
    const store = new FsChunkStore(root);
    const c = await encodeChunk(randomBytesSeeded(CS, 33));
    await store.put(c);
    const file = readFileSync(store.pathOf(c.digest));
    await overwriteChunkFile(store, c.digest, Buffer.concat([file.subarray(0, 16), Buffer.alloc(file.length - 16)]));
    const copy = { ...c, data: Uint8Array.from(c.data) };
    markOwned(copy.data);
    await store.accept(copy);
    expect((await store.readVerified(c.digest)).equals(randomBytesSeeded(CS, 33))).toBe(true);
    expect(readdirSync(join(root, 'tmp'))).toEqual([]);
    // Made by this process: the next sync fsyncs it.
    synced.length = 0;
    await store.sync([c.digest]);
    expect(synced).toContain(store.pathOf(c.digest));
  });

  it('sync_calledWhileAnotherSyncsFsyncFails_failsToo_forItsCallerMayHaveFoundTheChunkPresent', async () => {
    const store = new FsChunkStore(join(dir, 'fsync-fails-shared'), { offload: false });
    const [a, b] = await Promise.all([21, 22].map((i) => encodeChunk(textBytes(CS, i))));
    await store.put(a!);
    failOnce.add(store.pathOf(a!.digest));
    const first = store.sync();
    // Another fetch found `a` present (it fetched only `b`) and syncs before storing its manifest.
    await store.put(b!);
    const second = store.sync();
    await expect(first).rejects.toThrow();
    await expect(second).rejects.toBeInstanceOf(ChunkLostError);
    expect(await store.missing([a!.digest, b!.digest])).toEqual([a!.digest]);
  });

  it('sync_whoseOpenForAnFsyncFails_losesNothing_andTheNextSyncFsyncsTheChunk', async () => {
    // EMFILE, ENOMEM: no writeback error happened, the file is whole; taken for a loss, a busy
    // agent's every chunk of that batch was removed.
    const store = new FsChunkStore(join(dir, 'fsync-open-fails'), { offload: false });
    const c = await encodeChunk(textBytes(CS, 25));
    await store.put(c);
    openFailsOnce.add(store.pathOf(c.digest));
    await expect(store.sync([c.digest])).rejects.toThrow(/EMFILE/);
    expect(await store.missing([c.digest])).toEqual([]);
    synced.length = 0;
    await store.sync([c.digest]);
    expect(synced).toContain(store.pathOf(c.digest));
  });

  it('sweep_ofAChunkLostToAFailedFsyncThatNothingNeeds_letsSyncsPassAgain', async () => {
    const store = new FsChunkStore(join(dir, 'fsync-fails-swept'), { offload: false });
    const c = await encodeChunk(textBytes(CS, 23));
    await store.put(c);
    failOnce.add(store.pathOf(c.digest));
    await expect(store.sync()).rejects.toThrow();
    // Pinned (a fetch that may have found it present and will sync): still lost.
    await store.sweep(() => true);
    await expect(store.sync()).rejects.toBeInstanceOf(ChunkLostError);
    await store.sweep((d) => d !== c.digest);
    await store.sync();
  });

  it('sweep_ofADirectoryOfLiveChunks_letsOtherWorkRunEvery512Chunks', async () => {
    // Most chunks are live: skipped without yielding, a big store held the event loop for a
    // whole directory's sweep.
    const store = new FsChunkStore(join(dir, 'sweep-yields'), { offload: false });
    const n = 2000;
    for (let i = 0; i < n; i++) writeFileSync(store.pathOf(`ab${i.toString(16).padStart(62, '0')}`), '');
    let checks = 0;
    let checksWhenOtherWorkRan: number | undefined;
    const stats = await store.sweep(() => {
      if (checks++ === 0) setImmediate(() => (checksWhenOtherWorkRan = checks));
      return true;
    });
    expect(stats).toMatchObject({ scanned: n, deleted: 0 });
    expect(checksWhenOtherWorkRan).toBeLessThanOrEqual(512);
  });

  it('put_whenTheFileSystemTakesOnlyPartOfTheChunk_failsWithItsError_andLeavesNoChunkAndNoTempFile', () => {
    // A file size limit cuts the write short without an error, as a nearly full disk does:
    // the chunk used to be renamed into place truncated and stored as present.
    const root = join(dir, 'short-write');
    const fixture = join(import.meta.dirname, 'short-write.fixture.ts');
    const out = execFileSync('bash', ['-c', 'ulimit -f 128 && exec "$0" --import tsx "$1" "$2"', process.execPath, fixture, root], { encoding: 'utf8' });
    const r = JSON.parse(out) as { put: string; digest: string; missing: string[] };
    expect(r.put).toBe('failed: EFBIG');
    expect(r.missing).toEqual([r.digest]);
    expect(existsSync(new FsChunkStore(root).pathOf(r.digest))).toBe(false);
    expect(readdirSync(join(root, 'tmp'))).toEqual([]);
  });

  it('put_whenTheRenameFails_leavesNoTempFile', async () => {
    const root = join(dir, 'rename-fails');
    const store = new FsChunkStore(root);
    const c = await encodeChunk(textBytes(CS, 9));
    // A directory where the chunk file goes: rename(2) of a file onto it fails (EISDIR).
    mkdirSync(join(store.pathOf(c.digest), 'x'), { recursive: true });
    await expect(store.put(c)).rejects.toThrow();
    expect(readdirSync(join(root, 'tmp'))).toEqual([]);
  });
});

describe('FsManifestStore', () => {
  it('delete_ofAManifest_fsyncsTheManifestsDirectory', async () => {
    const root = join(dir, 'manifests');
    const manifests = new FsManifestStore(root);
    await manifests.put('s1', create(SignedManifestSchema, { manifest: Buffer.from('m') }));
    synced.length = 0;
    await manifests.delete('s1');
    expect(await manifests.get('s1')).toBeUndefined();
    expect(synced).toContain(join(root, 'manifests'));
  });
});
