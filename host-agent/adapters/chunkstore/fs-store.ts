// Host-local content-addressed store on a file system.
//
// Layout under `root`:
//   chunks/ab/abcdef...      one file per chunk: 16-byte header + stored data
//   manifests/<id>.manifest  SignedManifest bytes
//   tmp/                     temp files; linked (chunks) or renamed (manifests) into place
//
// A chunk file is written to tmp/ and linked into place *without* fsync, never over a chunk
// file that is there and valid (see `place`); `sync()` later makes every chunk file this
// process placed since the last sync durable in one batch (callers sync before they store a
// manifest, the "complete" marker). A kill -9 of the writer leaves either no
// file or a complete one (the page cache survives a process crash); an OS crash can leave
// a torn or empty chunk file, but reads used for restores decode and hash (readVerified),
// so a damaged file never passes as valid. A chunk file whose fsync failed is removed, never
// fsynced again (see `lost`). See docs/adr/0007-chunk-format.md.
import { mkdirSync, readdirSync, statSync, unlinkSync } from 'node:fs';
import { link, open, readFile, rename, rm, stat, unlink, utimes, writeFile, readdir } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { randomBytes } from 'node:crypto';
import type { Logger } from 'pino';
import type { SignedManifest } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import type { ChunkStore, DigestHex, EncodedChunk, ManifestStore, SweepStats } from '../../domain/snapshot-store.ts';
import { ChunkCorruptError, ChunkLostError, ChunkMissingError, DigestMismatchError } from '../../domain/transfer-errors.ts';
import { decodeSignedManifest, encodeSignedManifest } from '../../domain/tickets.ts';
import { InvalidArgumentError } from '../../../proto/errors.ts';
import { decodeChunk } from './codec.ts';
import { acceptOffloaded, type OffloadedFile, type OffloadedResult } from './verify-pool.ts';
import { allSettledOrThrow, writeSparse } from './sparse.ts';
import { encodeHeader, HEADER, parseChunkFile } from './chunk-file.ts';
import { isOwned, markHeadroom, markRecyclable } from './buffers.ts';
import { isAlive } from '../qemu/process.ts';
import { FsyncOpenError, fsyncAll, fsyncPath } from '../durable.ts';

/** Spare bytes before each chunk file read (room for a gRPC message header; see getEncoded). */
const READ_HEADROOM = 48;
const HEX64 = /^[0-9a-f]{64}$/;
/** In the store's root while a failed start-up sync's check of every chunk file is not done (syncAtStart). */
const START_SYNC_FAILED = 'start-sync-failed';
const execFileAsync = promisify(execFile);

function checkDigest(d: string): void {
  if (!HEX64.test(d)) throw new InvalidArgumentError('digest', 'must be 64 lowercase hex characters');
}

function isNotFound(e: unknown): boolean {
  return (e as NodeJS.ErrnoException).code === 'ENOENT';
}

let tmpSeq = 0;
const tmpPrefix = `${process.pid}.${randomBytes(4).toString('hex')}`;

function tmpPathIn(tmpDir: string): string {
  return join(tmpDir, `${tmpPrefix}.${tmpSeq++}.tmp`);
}

/** `parts` without their first `n` bytes. */
function afterBytes(parts: readonly Uint8Array[], n: number): Uint8Array[] {
  const out: Uint8Array[] = [];
  for (const p of parts) {
    if (n >= p.length) {
      n -= p.length;
      continue;
    }
    out.push(n > 0 ? p.subarray(n) : p);
    n = 0;
  }
  return out;
}

function errnoOf(e: unknown): string | undefined {
  return (e as NodeJS.ErrnoException).code;
}

/** Writes `parts` to the new file `tmp` (removed again if that fails). */
async function writeTemp(tmp: string, parts: readonly Uint8Array[], fsync: boolean): Promise<void> {
  const fh = await open(tmp, 'w');
  try {
    try {
      // One writev syscall for header + data, as a rule. A short write (the disk or a quota
      // nearly full, a file size limit) reports fewer bytes and no error: the rest is written
      // again, which then fails with the error itself (ENOSPC, EFBIG). Renamed into place cut
      // short, a chunk or manifest would pass for stored.
      for (let rest = parts.filter((p) => p.length > 0); rest.length > 0; ) {
        const { bytesWritten } = await fh.writev(rest as Uint8Array[]);
        if (bytesWritten <= 0) throw Object.assign(new Error(`no bytes written to ${tmp}`), { code: 'ENOSPC' });
        rest = afterBytes(rest, bytesWritten);
      }
      if (fsync) await fh.sync();
    } finally {
      await fh.close();
    }
  } catch (e) {
    // Temp files are only cleared when a store opens: retries after ENOSPC would pile them up.
    await unlink(tmp).catch(() => undefined);
    throw e;
  }
}

/** Writes `final` through a temp file renamed over it (a manifest: a new one replaces the old). */
async function writeFileVia(tmpDir: string, final: string, parts: readonly Uint8Array[], fsync: boolean): Promise<void> {
  const tmp = tmpPathIn(tmpDir);
  await writeTemp(tmp, parts, fsync);
  try {
    await rename(tmp, final);
  } catch (e) {
    await unlink(tmp).catch(() => undefined);
    throw e;
  }
}

/** Where a chunk's plain bytes go: offsets in files open for writing (by fd). */
export type ImagePlaces = ReadonlyArray<{ readonly fd: number; readonly pos: number }>;

export interface FsChunkStoreOptions {
  /**
   * fsync each chunk before it is placed (default false): slow (~5 ms a chunk here). Without
   * it, chunks become durable at the next `sync()`, which callers run before storing a
   * manifest.
   */
  fsyncEach?: boolean;
  /** @deprecated old name of `fsyncEach`. */
  fsync?: boolean;
  /**
   * `accept` of a chunk whose buffer is owned (buffers.ts `markOwned`, as the peer client
   * marks received chunks) decodes, hashes and writes on a worker thread (default true).
   */
  offload?: boolean;
}

export class FsChunkStore implements ChunkStore {
  readonly root: string;
  private readonly chunksDir: string;
  private readonly tmpDir: string;
  private readonly fsyncEach: boolean;
  private readonly offload: boolean;
  /**
   * Chunk files this process placed (made) since the last `sync()`: only those. A file that
   * was there already is never replaced while valid (`place`), so a sync whose fsync fails
   * removes only files of its own batch, never a durable chunk a stored manifest needs.
   */
  private unsynced = new Set<string>();
  /** Chunks a verify worker is storing now: placed there, counted in `unsynced` once it answers. */
  private readonly offloaded = new Set<Promise<unknown>>();
  /** The last `sync()` called (settled either way): the next one runs after it. */
  private syncing: Promise<unknown> = Promise.resolve();
  /**
   * Chunk files removed because their fsync failed, by path: the error, when, and whether a
   * new file was placed there since. Linux reports a writeback error to one fsync only: the
   * next fsync of the file returns 0 though its data never reached the disk, and the page
   * cache serves it whole until it is evicted (then the old blocks). So such a file is never
   * fsynced again: removed, it reads as missing and an ingest or fetch writes it anew (a new
   * file, which the next sync fsyncs). A caller may have found it present before the removal
   * and call sync() after it (to store a manifest naming it): so a sync() that needs a chunk
   * listed here fails. A path leaves the list once a new file there was fsynced, or when a
   * GC finds nothing needs the chunk (sweep: callers pin a chunk before they look for it).
   */
  private readonly lost = new Map<string, { err: unknown; rewritten: boolean }>();

  constructor(root: string, opts: FsChunkStoreOptions = {}) {
    this.root = root;
    this.chunksDir = join(root, 'chunks');
    this.tmpDir = join(root, 'tmp');
    this.fsyncEach = opts.fsyncEach ?? opts.fsync ?? false;
    this.offload = opts.offload ?? true;
    mkdirSync(this.tmpDir, { recursive: true });
    for (let i = 0; i < 256; i++) mkdirSync(join(this.chunksDir, i.toString(16).padStart(2, '0')), { recursive: true });
    // Leftover temp files from a killed writer are never valid chunks.
    for (const f of readdirSync(this.tmpDir)) unlinkSync(join(this.tmpDir, f));
  }

  pathOf(digest: DigestHex): string {
    return join(this.chunksDir, digest.slice(0, 2), digest);
  }

  async has(digest: DigestHex): Promise<boolean> {
    checkDigest(digest);
    try {
      await stat(this.pathOf(digest));
      return true;
    } catch (e) {
      if (isNotFound(e)) return false;
      throw e;
    }
  }

  /**
   * stat(2) of each chunk file, synchronously in batches of 128 (a few ms each) with the
   * event loop free in between: one libuv pool round trip per digest cost 30-500 ms for a
   * 600-chunk snapshot here, on the transfer's critical path. A file too short to hold a
   * header (an OS crash before its sync) counts as missing and stays until a fetch places a
   * verified copy there (`place` moves it aside first): removing it here could remove that
   * copy instead, had a verify worker placed it since the stat. A longer torn one is found
   * when it is read (readVerified).
   */
  async missing(digests: Iterable<DigestHex>): Promise<DigestHex[]> {
    const uniq = [...new Set(digests)];
    const out: DigestHex[] = [];
    for (let i = 0; i < uniq.length; i++) {
      if (i > 0 && i % 128 === 0) await new Promise<void>((r) => setImmediate(r));
      const d = uniq[i] as DigestHex;
      checkDigest(d);
      const st = statSync(this.pathOf(d), { throwIfNoEntry: false });
      if (st && st.size >= HEADER) continue;
      out.push(d);
    }
    return out;
  }

  async put(chunk: EncodedChunk, opts: { trusted?: boolean } = {}): Promise<void> {
    checkDigest(chunk.digest);
    if (!opts.trusted) await decodeChunk(chunk);
    await this.write(chunk);
  }

  async accept(chunk: EncodedChunk): Promise<Buffer> {
    checkDigest(chunk.digest);
    if (this.offload && isOwned(chunk.data)) {
      // Verified (decode + SHA-256) before the temp file is written, on a worker; `chunk.data`
      // is detached by this call. See verify-pool.ts.
      const plain = await this.trackOffloaded(chunk.digest, (tmp, final) => acceptOffloaded({ ...chunk, tmp, final, fsync: this.fsyncEach }));
      return plain as Buffer;
    }
    const plain = await decodeChunk(chunk);
    await this.write(chunk);
    return plain;
  }

  /**
   * `accept`, and the plain bytes written at `places` (positions in open image files, see
   * Materialiser): on the verify worker when the chunk goes there, so the bytes never come
   * back to the calling thread. Resolves when the chunk is stored and every place written.
   */
  async acceptInto(chunk: EncodedChunk, places: ImagePlaces): Promise<void> {
    checkDigest(chunk.digest);
    if (this.offload && isOwned(chunk.data)) {
      await this.trackOffloaded(chunk.digest, (tmp, final) => acceptOffloaded({ ...chunk, tmp, final, fsync: this.fsyncEach, places }));
      return;
    }
    const plain = await this.accept(chunk);
    // Every place written (or failed) before this settles: the caller's image handles may close next.
    await allSettledOrThrow(places.map((p) => writeSparse(p.fd, plain, p.pos)));
  }

  private async write(chunk: EncodedChunk): Promise<void> {
    const final = this.pathOf(chunk.digest);
    const tmp = tmpPathIn(this.tmpDir);
    await writeTemp(tmp, [encodeHeader(chunk), chunk.data], this.fsyncEach);
    await this.place(tmp, final, chunk.digest);
  }

  /**
   * Puts the verified chunk file `tmp` at `final` with link(2), which never replaces a file
   * there, then removes the name `tmp`. rename(2) replaced one: a second copy renamed over a
   * chunk whose manifest was stored (durable), and whose sync then failed, removed that
   * chunk (sync removes its batch's files). Only a file there that is not a valid chunk (torn
   * by an OS crash before its sync) is replaced: moved aside and checked again first, as
   * quarantine does. When `tmp` went in, it is listed for the next sync at once (made), before
   * the temp name is removed: from the link on, another caller can find the chunk present and
   * sync() for its manifest, and that sync must fsync it. When a valid chunk file was there,
   * it is kept (durable, or made by this process and fsynced by the sync that lists it). `tmp`
   * is removed either way.
   *
   * Cost: link + unlink of the temp name is one syscall more than a rename, and both do the
   * same two directory updates; Node has no renameat2(RENAME_NOREPLACE), and a stat before a
   * rename costs the same syscall and could still replace a file placed in between.
   */
  private async place(tmp: string, final: string, digest: DigestHex): Promise<void> {
    try {
      for (;;) {
        try {
          await link(tmp, final);
          this.made(final);
          return;
        } catch (e) {
          if (errnoOf(e) !== 'EEXIST') throw e;
        }
        if (await this.holdsValid(final, digest)) return;
        // Then linked again: a valid copy another caller put there since the check is found so.
        await this.setAside(final, digest);
      }
    } finally {
      await unlink(tmp).catch(() => undefined);
    }
  }

  /** Whether `path` holds a whole chunk file whose data decodes to the content of `digest`. */
  private async holdsValid(path: string, digest: DigestHex): Promise<boolean> {
    let buf: Buffer;
    try {
      buf = await readFile(path);
    } catch (e) {
      if (isNotFound(e)) return false;
      throw e;
    }
    const f = parseChunkFile(buf);
    return f !== undefined && (await decodeChunk({ digest, ...f }).then(() => true, () => false));
  }

  /**
   * Removes the chunk file at `path`, found invalid. Not by path: a verified copy may have been
   * placed there since it was read, and that copy counts as stored. So the file is moved aside
   * first and checked again there; a copy that verifies is linked back (unless another file
   * was placed there meanwhile: never over one).
   */
  private async setAside(path: string, digest: DigestHex): Promise<void> {
    const aside = tmpPathIn(this.tmpDir);
    try {
      await rename(path, aside);
    } catch (e) {
      if (isNotFound(e)) return;
      throw e;
    }
    try {
      if (await this.holdsValid(aside, digest)) {
        await link(aside, path).catch((e: unknown) => {
          if (errnoOf(e) !== 'EEXIST') throw e;
        });
      }
    } finally {
      await unlink(aside).catch(() => undefined);
    }
  }

  /**
   * A chunk file this process made at `final` (or maybe: a worker that died): fsynced by the
   * next sync(), which finds a lost one there again (sync checks it is there).
   */
  private made(final: string): void {
    this.unsynced.add(final);
    const l = this.lost.get(final);
    if (l) l.rewritten = true;
  }

  /**
   * A worker's accept: its file is in place before the worker answers, so until then a
   * concurrent `has()` can find it while `unsynced` does not list it yet; sync() waits for it.
   * The worker says where it left the file (verify-pool.ts `OffloadedFile`): linked at `final`
   * (listed, also when an image write failed after), not written (a digest mismatch), or a
   * valid temp file left because a file was at `final` already (placed here, as `write` does).
   * A worker that died may have linked its file: listed (sync skips a listed file that is not
   * there).
   */
  private trackOffloaded(digest: DigestHex, start: (tmp: string, final: string) => Promise<OffloadedResult>): Promise<Buffer | undefined> {
    const tmp = tmpPathIn(this.tmpDir);
    const final = this.pathOf(digest);
    const settle = async (file: OffloadedFile | undefined): Promise<void> => {
      if (file === 'new' || file === undefined) this.made(final);
      else if (file === 'exists') await this.place(tmp, final, digest);
    };
    const tracked = start(tmp, final).then(
      async (r) => {
        await settle(r.file);
        return r.plain;
      },
      async (e: unknown) => {
        if (!(e instanceof DigestMismatchError)) await settle((e as { file?: OffloadedFile }).file).catch(() => undefined);
        throw e;
      },
    );
    const settled = tracked.catch(() => undefined);
    this.offloaded.add(settled);
    void settled.then(() => this.offloaded.delete(settled));
    return tracked;
  }

  /**
   * Makes every chunk stored before this call durable, including those another caller's
   * sync is fsyncing right now and those a verify worker is still storing: a caller may
   * store a manifest over chunks it found already present (ADR 0007, Durability). Fails with
   * the error of a fsync that failed, and then (ChunkLostError, retryable) while a chunk of
   * `needs` that fsync removed was not written again (see `lost`; without `needs`, any).
   */
  sync(needs?: Iterable<DigestHex>): Promise<void> {
    // One after another, each after the worker accepts in flight at its call.
    const accepting = [...this.offloaded];
    const run = this.syncing.then(async () => {
      await Promise.all(accepting);
      const batch = this.unsynced;
      this.unsynced = new Set();
      // Lost files written again (still there now): found once this batch is fsynced.
      const found = [...batch].filter((p) => this.lost.get(p)?.rewritten && statSync(p, { throwIfNoEntry: false }));
      try {
        await fsyncAll(batch);
      } catch (e) {
        if (e instanceof FsyncOpenError) {
          // Opening a file for its fsync failed (EMFILE, ENOMEM), and no fsync did: nothing was
          // lost, the next sync fsyncs the batch.
          for (const p of batch) this.unsynced.add(p);
          throw e;
        }
        // Which file failed is not known (the directories' fsyncs too): none is trusted. Removed
        // in this turn, together with the listing; a file placed since goes too (listed). Only
        // files this process made are listed (`place` never replaces a valid chunk file), so
        // no durable chunk that a stored manifest needs goes with them.
        for (const p of batch) {
          this.lost.set(p, { err: e, rewritten: false });
          try {
            unlinkSync(p);
          } catch {
            // Gone already, or not removable (a read-only file system): listed all the same,
            // so no sync that needs it passes until a new file is placed there and fsynced.
          }
        }
        throw e;
      }
      for (const p of found) this.lost.delete(p);
      if (this.lost.size === 0) return;
      // Only the caller's own chunks matter: a manifest over a chunk it found present before
      // the removal. Failing every sync of the host instead stopped every snapshot and fetch
      // there until a GC, or for good while a stored manifest still named the chunk.
      const lost = needs === undefined ? [...this.lost.keys()] : [...new Set(needs)].map((d) => this.pathOf(d)).filter((p) => this.lost.has(p));
      if (lost.length > 0) throw new ChunkLostError(lost.map((p) => basename(p)), { cause: this.lost.get(lost[0] as string)?.err });
    });
    this.syncing = run.catch(() => undefined);
    return run;
  }

  async getEncoded(digest: DigestHex): Promise<EncodedChunk | undefined> {
    checkDigest(digest);
    let buf: Buffer;
    try {
      buf = await this.readChunkFile(this.pathOf(digest));
    } catch (e) {
      if (isNotFound(e)) return undefined;
      throw e;
    }
    // Truncated or foreign: not a chunk. Serve as missing; readVerified removes it.
    const f = parseChunkFile(buf);
    // `data` may have headroom (see readChunkFile): peer/wire.ts puts its header there.
    return f && { digest, ...f };
  }

  /**
   * Like getEncoded, for a serializer that copies the bytes out at once (peer/wire.ts): the
   * chunk is read into a pooled buffer that goes back to the pool when the serializer calls
   * `recycleAfterCopy` (buffers.ts). A fresh 256 KiB buffer costs ~1 ms of page faults here
   * (nested virtualisation), more than reading the chunk; see ADR 0008.
   */
  async getEncodedForSend(digest: DigestHex): Promise<EncodedChunk | undefined> {
    checkDigest(digest);
    let buf: Buffer;
    try {
      buf = await this.readChunkFile(this.pathOf(digest), true);
    } catch (e) {
      if (isNotFound(e)) return undefined;
      throw e;
    }
    const f = parseChunkFile(buf);
    return f && { digest, ...f };
  }

  /** Free read buffers for getEncodedForSend (each READ_HEADROOM + readHint bytes). */
  private readPool: Buffer[] = [];
  private static readonly READ_POOL_MAX = 64;

  /**
   * open + one pread + close (three pool round trips; readFile adds an fstat and a second
   * read). The buffer is sized for the largest chunk seen; a bigger file falls back. The
   * file is read READ_HEADROOM bytes into a fresh (or, with `pooled`, a recycled) buffer
   * (see getEncoded).
   */
  private readHint = HEADER + 256 * 1024 + 4096;
  private async readChunkFile(path: string, pooled = false): Promise<Buffer> {
    const fh = await open(path, 'r');
    try {
      // Read once: another read may raise readHint while this one waits, and a file that
      // filled this read's buffer would then pass for whole.
      const hint = this.readHint;
      const size = READ_HEADROOM + hint;
      let buf = pooled ? this.readPool.pop() : undefined;
      if (!buf || buf.length !== size) buf = Buffer.allocUnsafeSlow(size);
      const { bytesRead } = await fh.read(buf, READ_HEADROOM, hint, 0);
      if (bytesRead < hint) {
        // A buffer of this read alone: a serializer may write its message header into the
        // bytes before the chunk's data (READ_HEADROOM + the chunk header) instead of
        // copying the data (buffers.ts).
        markHeadroom(buf);
        const view = buf.subarray(READ_HEADROOM, READ_HEADROOM + bytesRead);
        if (pooled) {
          const b = buf;
          markRecyclable(view, () => {
            if (this.readPool.length < FsChunkStore.READ_POOL_MAX && b.length === READ_HEADROOM + this.readHint) this.readPool.push(b);
          });
        }
        return view;
      }
    } finally {
      await fh.close();
    }
    const whole = await readFile(path);
    this.readHint = Math.max(this.readHint, whole.length + 4096);
    return whole;
  }

  async readVerified(digest: DigestHex): Promise<Buffer> {
    const c = await this.getEncoded(digest);
    if (!c) {
      if (await this.has(digest)) {
        await this.quarantine(digest);
        throw new ChunkCorruptError([digest]);
      }
      throw new ChunkMissingError([digest]);
    }
    try {
      return await decodeChunk(c);
    } catch (e) {
      await this.quarantine(digest);
      throw new ChunkCorruptError([digest], { cause: e });
    }
  }

  /** Removes a chunk file that failed verification (see setAside: a verified copy placed since stays). */
  private async quarantine(digest: DigestHex): Promise<void> {
    await this.setAside(this.pathOf(digest), digest);
  }

  /**
   * At start, before anything uses the store: makes durable the chunk files a previous process
   * wrote and never synced (killed: the page cache kept them, its list of them went with it;
   * this process's sync() covers only its own files, while ingest and fetches count such files
   * present and store manifests over them). `syncfs` syncs the file system (`sync -f`).
   *
   * When that fails, which files lost data is not known, and a later start's sync returns 0
   * (the file system reports a writeback error once). So a marker is written, then every chunk
   * file is fsynced on its own: a file keeps its own writeback error apart from the file
   * system's (Linux, errseq), and reports it to the first fsync of that file even after
   * syncfs reported it. A file whose fsync fails lost data: removed (read as missing, fetched
   * or ingested again; a stored manifest naming it is incomplete). The marker goes once every
   * file was checked, so a start that finds it (the check was cut short) checks again. An
   * inode evicted since its error took the error with it: its stale content is found only
   * when read (readVerified).
   */
  async syncAtStart(syncfs: () => Promise<unknown> = () => execFileAsync('sync', ['-f', this.root])): Promise<{ syncFailed: boolean; removed: DigestHex[] }> {
    const marker = join(this.root, START_SYNC_FAILED);
    let syncFailed = false;
    try {
      await syncfs();
      if (!statSync(marker, { throwIfNoEntry: false })) return { syncFailed, removed: [] };
    } catch (e) {
      if (errnoOf(e) === 'ENOENT') throw e; // no `sync` program: nothing was synced or checked
      syncFailed = true;
      // Not fsynced: it matters while the page cache lives (after an OS crash the errors are gone).
      await writeFile(marker, `${String((e as Error).message ?? e)}\n`).catch(() => undefined);
    }
    const files: string[] = [];
    for (const sub of await readdir(this.chunksDir)) for (const n of await readdir(join(this.chunksDir, sub))) if (HEX64.test(n)) files.push(join(this.chunksDir, sub, n));
    const removed: DigestHex[] = [];
    let unopened: unknown;
    let next = 0;
    const check = async (): Promise<void> => {
      for (let p = files[next++]; p !== undefined; p = files[next++]) {
        const path = p;
        await fsyncPath(path).catch(async (e: unknown) => {
          if (e instanceof FsyncOpenError) {
            unopened ??= e; // not checked: the marker stays
            return;
          }
          removed.push(basename(path));
          await unlink(path).catch(() => undefined);
        });
      }
    };
    await Promise.all(Array.from({ length: Math.min(16, files.length) }, check));
    if (unopened !== undefined) throw unopened;
    await rm(marker, { force: true });
    return { syncFailed, removed };
  }

  async touch(digest: DigestHex): Promise<void> {
    const now = new Date();
    await utimes(this.pathOf(digest), now, now).catch((e: unknown) => {
      if (!isNotFound(e)) throw e;
    });
  }

  async sweep(isLive: (digest: DigestHex, mtimeMs: number) => boolean): Promise<SweepStats> {
    let scanned = 0;
    let deleted = 0;
    let freedBytes = 0;
    let keptBytes = 0;
    for (const sub of await readdir(this.chunksDir)) {
      const dir = join(this.chunksDir, sub);
      for (const name of await readdir(dir)) {
        if (!HEX64.test(name)) continue;
        // Before the check: most chunks are live, and a big store's sweep of a directory must not
        // hold the event loop throughout.
        if (++scanned % 512 === 0) await new Promise<void>((r) => setImmediate(r));
        const p = join(dir, name);
        // Check and unlink synchronously: no other JS runs between them, so a digest that
        // concurrent code pinned (or a manifest that was marked) is never removed.
        try {
          const st = statSync(p);
          if (isLive(name, st.mtimeMs)) {
            keptBytes += st.size;
            continue;
          }
          unlinkSync(p);
          deleted++;
          freedBytes += st.size;
        } catch (e) {
          if (!isNotFound(e)) throw e;
        }
      }
    }
    // A chunk lost to a failed fsync (sync) that no manifest names and nothing pins: no caller
    // can have found it present and still store a manifest over it (each pins first). Judged
    // without the grace of new files (mtime 0): it is no file, and its loss is not new data.
    for (const p of this.lost.keys()) if (!isLive(basename(p), 0)) this.lost.delete(p);
    return { scanned, deleted, freedBytes, keptBytes };
  }

  /** Digests of every stored chunk (tests and diagnostics). */
  async list(): Promise<DigestHex[]> {
    const out: DigestHex[] = [];
    for (const sub of await readdir(this.chunksDir)) for (const n of await readdir(join(this.chunksDir, sub))) if (HEX64.test(n)) out.push(n);
    return out.sort();
  }
}

const SNAPSHOT_ID = /^[A-Za-z0-9._-]{1,128}$/;

function isSnapshotId(id: string): boolean {
  return SNAPSHOT_ID.test(id) && !id.startsWith('.');
}

function checkSnapshotId(id: string): void {
  if (!isSnapshotId(id)) throw new InvalidArgumentError('snapshot_id', 'must match [A-Za-z0-9._-]{1,128}');
}

export interface FsManifestStoreOptions {
  /** Told, once per name, of a `.manifest` file list() skips because its name is no snapshot id. */
  readonly log?: Pick<Logger, 'warn'>;
}

export class FsManifestStore implements ManifestStore {
  private readonly dir: string;
  private readonly tmpDir: string;
  private readonly log: Pick<Logger, 'warn'> | undefined;
  /** Names list() skipped and already logged. */
  private readonly strays = new Set<string>();

  constructor(root: string, opts: FsManifestStoreOptions = {}) {
    this.log = opts.log;
    this.dir = join(root, 'manifests');
    this.tmpDir = join(root, 'tmp');
    mkdirSync(this.dir, { recursive: true });
    mkdirSync(this.tmpDir, { recursive: true });
    // Left by a writer killed mid-put (its pid and a nonce of its own lead the name, tmpPathIn):
    // never a manifest, the rename makes one. Another live process's are left alone (a store
    // sharing this root); a file with this process's pid but another nonce is an earlier
    // process's that had the same pid (an agent that is PID 1 in its container every start).
    for (const f of readdirSync(this.tmpDir)) {
      const pid = Number(/^(\d+)\./.exec(f)?.[1] ?? 0);
      if (f.endsWith('.tmp') && pid > 0 && !f.startsWith(`${tmpPrefix}.`) && (pid === process.pid || !isAlive(pid))) unlinkSync(join(this.tmpDir, f));
    }
  }

  private pathOf(id: string): string {
    checkSnapshotId(id);
    return join(this.dir, `${id}.manifest`);
  }

  async put(snapshotId: string, signed: SignedManifest): Promise<void> {
    await writeFileVia(this.tmpDir, this.pathOf(snapshotId), [encodeSignedManifest(signed)], true);
    // The rename itself, durable: "manifest present" means complete, also after an OS crash.
    await fsyncPath(dirname(this.pathOf(snapshotId)));
  }

  async get(snapshotId: string): Promise<SignedManifest | undefined> {
    try {
      return decodeSignedManifest(await readFile(this.pathOf(snapshotId)));
    } catch (e) {
      if (isNotFound(e)) return undefined;
      throw e;
    }
  }

  async delete(snapshotId: string): Promise<void> {
    await rm(this.pathOf(snapshotId), { force: true });
    // Durable before a GC unlinks the chunks: after an OS crash the manifest must not be back
    // without them.
    await fsyncPath(this.dir);
  }

  /**
   * Ids of the stored manifests, each one that get() and delete() accept. A `.manifest` file
   * whose name is no snapshot id (`snap:1.manifest`, `.manifest`: an operator's copy or
   * restore) is no manifest put() wrote and none get() serves: skipped. Listed, it made get()
   * and delete() throw InvalidArgumentError; the GC took that for a manifest that does not
   * decode, its delete threw again, and every GC after failed: nothing freed, ever. So is
   * anything but a file or a link to one (a directory named `x.manifest`: its read fails
   * EISDIR, which the GC takes for an I/O error that may pass, and gives up on every pass).
   */
  async list(): Promise<string[]> {
    const ids: string[] = [];
    for (const d of await readdir(this.dir, { withFileTypes: true })) {
      const f = d.name;
      if (!f.endsWith('.manifest')) continue;
      if (!d.isFile() && !d.isSymbolicLink()) {
        if (!this.strays.has(f)) {
          this.strays.add(f);
          this.log?.warn({ file: join(this.dir, f) }, 'something in the manifest store that is not a file: ignored (not a manifest); remove it');
        }
        continue;
      }
      const id = f.slice(0, -'.manifest'.length);
      if (isSnapshotId(id)) ids.push(id);
      else if (!this.strays.has(f)) {
        this.strays.add(f);
        this.log?.warn({ file: join(this.dir, f) }, 'a file in the manifest store whose name is no snapshot id: ignored (not a manifest); remove it');
      }
    }
    return ids.sort();
  }
}

/** Test helper surface: raw write of a chunk file's bytes (fault injection). */
export async function overwriteChunkFile(store: FsChunkStore, digest: DigestHex, bytes: Uint8Array): Promise<void> {
  await writeFile(store.pathOf(digest), bytes);
}
