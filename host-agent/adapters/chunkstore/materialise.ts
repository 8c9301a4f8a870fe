// Materialise a snapshot's artifacts from the chunk store into plain files, verifying the
// manifest signature and every chunk digest. Files are sparse (ftruncate to size, write only
// listed chunks), built in a temp directory and renamed into place, then kept read-only:
// every same-host fork maps the same memory image (page cache shared). Zero pages inside
// chunks stay holes too (sparse.ts). Idempotent: a second call returns the cached
// directory; concurrent calls share one build.
//
// `materialiseWhile` builds the image while its chunks arrive from peers: each verified
// chunk's plain bytes go straight to index*chunkSize, and only the chunks that were already
// stored here are read back from the store at the end.
//
// Durability: an image is renamed into place *before* it is fsynced (the VMM reads it from
// the page cache, which a process crash keeps). A marker `images-unsynced/<id>` holding the
// kernel boot id is made durable first and removed once a background fsync of the image
// finished. After an OS crash (different boot id) an image with a marker is discarded and
// rebuilt from verified chunks, so a torn image is never restored. An image whose background
// fsync failed is discarded at once (rebuilt on demand): fsync reports the error only once.
import { mkdirSync, readdirSync, renameSync, rmSync } from 'node:fs';
import { lstat, open, readdir, rename, rm, stat, mkdir, writeFile } from 'node:fs/promises';
import type { FileHandle } from 'node:fs/promises';
import { join } from 'node:path';
import { randomBytes } from 'node:crypto';
import type { Logger } from 'pino';
import type { SnapshotManifest } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import type { ChunkStore, DigestHex, LiveRoots, Lease, ManifestStore } from '../../domain/snapshot-store.ts';
import type { ChunkPlacer, ChunkSink } from '../../domain/transfer.ts';
import { ChunkCorruptError, ManifestNotFoundError } from '../../domain/transfer-errors.ts';
import { verifyManifest, type TrustedKeys } from '../../domain/tickets.ts';
import { type ImagePlaces } from './fs-store.ts';
import { DeferredSync } from '../durable.ts';
import { allSettledOrThrow, writeSparse } from './sparse.ts';

export interface MaterialisedSnapshot {
  readonly snapshotId: string;
  readonly dir: string;
  /** Artifact name -> file path ("memory" -> .../memory). */
  readonly files: Readonly<Record<string, string>>;
  /** True when this call built it; false when it was cached. */
  readonly built: boolean;
  readonly ms: number;
}

export interface MaterialiserDeps {
  readonly root: string;
  readonly chunks: ChunkStore;
  readonly manifests: ManifestStore;
  readonly trust: TrustedKeys;
  readonly roots: LiveRoots;
  readonly concurrency?: number;
  readonly log?: Logger;
  /** fsync images before renaming them into place, instead of in the background (default false). */
  readonly syncInline?: boolean;
}

function fileName(artifactName: string): string {
  return artifactName.replace(/[^A-Za-z0-9._-]/g, '_');
}

export class Materialiser {
  private readonly imagesDir: string;
  private readonly tmpDir: string;
  private readonly building = new Map<string, Promise<MaterialisedSnapshot>>();
  /** Images prune() is moving out of images/, by id: a build waits for that before it looks for a cached one. */
  private readonly pruning = new Map<string, Promise<unknown>>();
  private readonly unsynced: DeferredSync;
  /** Allocated bytes of the images built since diskBytes() counted (builtBytesSince). */
  private builtSince = 0;

  constructor(private readonly deps: MaterialiserDeps) {
    this.imagesDir = join(deps.root, 'images');
    this.tmpDir = join(deps.root, 'images-tmp');
    mkdirSync(this.imagesDir, { recursive: true });
    rmSync(this.tmpDir, { recursive: true, force: true });
    mkdirSync(this.tmpDir, { recursive: true });
    // Same boot: the page cache holds the whole image, it is synced again. Written before an
    // OS crash and never fsynced: may be torn, removed (rebuilt on demand).
    this.unsynced = new DeferredSync(join(deps.root, 'images-unsynced'), deps.log);
    this.unsynced.recover(
      (id) => join(this.imagesDir, id),
      (id) => this.discard(id),
    );
  }

  /**
   * Removes an image that may be torn or whose fsync failed (rebuilt on demand). Out of
   * images/ in one rename first, as prune() does, and synchronously: no build in between
   * takes a half-removed image for cached.
   */
  private discard(id: string): void {
    const doomed = join(this.tmpDir, `discarded-${id}-${randomBytes(4).toString('hex')}`);
    try {
      renameSync(join(this.imagesDir, id), doomed);
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code === 'ENOENT') return;
      throw e;
    }
    rmSync(doomed, { recursive: true, force: true });
  }

  /** Resolves when every background image fsync started so far has finished. */
  async flush(): Promise<void> {
    await this.unsynced.flush();
  }

  /** Materialises and leases: the image stays until `lease.release()` and a GC. */
  async acquire(snapshotId: string, holder: string): Promise<MaterialisedSnapshot & { lease: Lease }> {
    const lease = this.deps.roots.lease(snapshotId, holder);
    try {
      return { ...(await this.materialise(snapshotId)), lease };
    } catch (e) {
      lease.release();
      throw e;
    }
  }

  materialise(snapshotId: string): Promise<MaterialisedSnapshot> {
    let p = this.building.get(snapshotId);
    if (!p) {
      p = (async () => {
        const signed = await this.deps.manifests.get(snapshotId);
        if (!signed) throw new ManifestNotFoundError(snapshotId);
        return this.build(snapshotId, verifyManifest(signed, this.deps.trust, snapshotId));
      })().finally(() => this.building.delete(snapshotId));
      this.building.set(snapshotId, p);
    }
    return p;
  }

  /**
   * Builds the image of `manifest` (already verified by the caller) while `fill` delivers
   * chunks: `fill(sink)` must hand every chunk it fetches to `sink`. When `fill` resolves,
   * chunks it did not deliver are read (verified) from the store. With a cached image,
   * `fill` still runs (with a sink that ignores its input) and the cached directory is
   * returned. Concurrent `materialise(snapshotId)` calls share this build.
   */
  materialiseWhile(snapshotId: string, manifest: SnapshotManifest, fill: (sink: ChunkSink) => Promise<void>): Promise<MaterialisedSnapshot> {
    const prev = this.building.get(snapshotId);
    const p = (async () => {
      if (prev) await prev.catch(() => undefined);
      return this.build(snapshotId, manifest, fill);
    })().finally(() => {
      if (this.building.get(snapshotId) === p) this.building.delete(snapshotId);
    });
    this.building.set(snapshotId, p);
    return p;
  }

  private async build(snapshotId: string, manifest: SnapshotManifest, fill?: (sink: ChunkSink) => Promise<void>): Promise<MaterialisedSnapshot> {
    const t0 = performance.now();
    const final = join(this.imagesDir, snapshotId);
    const files: Record<string, string> = {};
    for (const a of manifest.artifacts) files[a.name] = join(final, fileName(a.name));
    let cached = false;
    // Being pruned (decided before this build began): gone once the rename lands, not cached.
    await this.pruning.get(snapshotId);
    try {
      await stat(final);
      cached = true;
    } catch {
      /* not cached: build it */
    }
    if (cached) {
      if (fill) await fill(async () => {});
      return { snapshotId, dir: final, files, built: false, ms: Math.round(performance.now() - t0) };
    }
    const tmp = join(this.tmpDir, `${snapshotId}.${randomBytes(4).toString('hex')}`);
    await mkdir(tmp, { recursive: true });
    const corrupt: string[] = [];
    const handles: FileHandle[] = [];
    let received = 0;
    try {
      // Where each digest goes (a digest may repeat within and across artifacts).
      const places = new Map<DigestHex, Array<{ fh: FileHandle; pos: number }>>();
      for (const a of manifest.artifacts) {
        const fh = await open(join(tmp, fileName(a.name)), 'w');
        handles.push(fh);
        await fh.truncate(Number(a.size));
        for (const ref of a.chunks) {
          const digest = Buffer.from(ref.digest).toString('hex');
          let l = places.get(digest);
          if (!l) places.set(digest, (l = []));
          l.push({ fh, pos: Number(ref.index) * manifest.chunkSize });
        }
      }
      // Small metadata files (the VMM's manifest.json, ...) travel in the manifest.
      for (const [name, data] of Object.entries(manifest.metadata)) {
        if (name in files) continue;
        await writeFile(join(tmp, fileName(name)), data, { mode: 0o444 });
      }
      const written = new Set<DigestHex>();
      const put = async (digest: DigestHex, plain: Buffer): Promise<void> => {
        const l = places.get(digest);
        if (!l || written.has(digest)) return;
        written.add(digest);
        try {
          // Every place written (or failed) before this settles: the handles may close next.
          await allSettledOrThrow(l.map((p) => writeSparse(p.fh.fd, plain, p.pos)));
        } catch (e) {
          written.delete(digest); // not in the image: a second delivery writes it (else a hole of zeros)
          throw e;
        }
      };
      if (fill) {
        // The store may write a received chunk's bytes into the image itself (from its verify
        // worker: FsChunkStore.acceptInto), so they need not come back to this thread.
        const placer: ChunkPlacer = {
          placesOf: (digest): ImagePlaces | undefined => {
            const l = places.get(digest);
            return l && !written.has(digest) ? l.map((p) => ({ fd: p.fh.fd, pos: p.pos })) : undefined;
          },
          placed: (digest) => {
            if (written.has(digest)) return;
            written.add(digest);
            received++;
          },
        };
        const sink = async (digest: DigestHex, plain: Buffer): Promise<void> => {
          received++;
          await put(digest, plain);
        };
        await fill(Object.assign(sink, { placer }));
      }
      // Whatever was not delivered comes from the local store.
      const rest = [...places.keys()].filter((d) => !written.has(d));
      let next = 0;
      // The first failure stops every worker, and all of them have stopped before it is
      // thrown: the handles are closed then, and a worker still writing by descriptor number
      // could write into whatever file the next open() is given that number.
      let failed: { err: unknown } | undefined;
      const worker = async (): Promise<void> => {
        while (next < rest.length && !failed) {
          const digest = rest[next++] as DigestHex;
          try {
            await put(digest, await this.deps.chunks.readVerified(digest));
          } catch (e) {
            if (e instanceof ChunkCorruptError) corrupt.push(...e.digests);
            else failed ??= { err: e };
          }
        }
      };
      await Promise.all(Array.from({ length: this.deps.concurrency ?? 8 }, worker));
      if (failed) throw failed.err;
      if (corrupt.length > 0) throw new ChunkCorruptError(corrupt);
      if (this.deps.syncInline) await Promise.all(handles.map((fh) => fh.sync()));
      // The memory image must never be written again (VMM-NOTES gotcha 3).
      await Promise.all(handles.map((fh) => fh.chmod(0o444)));
      await Promise.all(handles.splice(0).map((fh) => fh.close()));
      if (!this.deps.syncInline) await this.unsynced.mark(snapshotId);
      try {
        await rename(tmp, final);
      } catch (e) {
        // Another process built it first: theirs is as good as ours.
        if ((e as NodeJS.ErrnoException).code !== 'ENOTEMPTY' && (e as NodeJS.ErrnoException).code !== 'EEXIST') throw e;
        await rm(tmp, { recursive: true, force: true });
        return { snapshotId, dir: final, files, built: false, ms: Math.round(performance.now() - t0) };
      }
      if (!this.deps.syncInline) this.unsynced.later(snapshotId, final, () => this.discard(snapshotId));
    } catch (e) {
      await Promise.allSettled(handles.map((fh) => fh.close()));
      await rm(tmp, { recursive: true, force: true });
      throw e;
    }
    const ms = Math.round(performance.now() - t0);
    this.builtSince += await allocatedBytes(final).catch(() => 0);
    this.deps.log?.info({ snapshotId, ms, chunksReceivedWhileBuilding: received }, 'snapshot materialised');
    return { snapshotId, dir: final, files, built: true, ms };
  }

  /**
   * The disk the cached images take now (their allocated blocks: images are sparse). Images
   * built from now on are counted by builtBytesSince() until the next call. A heartbeat adds
   * them to the chunk store's figure: an image is about as large as the snapshot's non-zero
   * memory and disk, uncompressed, beside its compressed chunks, and is kept while the host
   * holds the snapshot; counted nowhere, a host holding many looked emptier than it was.
   */
  async diskBytes(): Promise<number> {
    this.builtSince = 0;
    let total = 0;
    for (const id of await readdir(this.imagesDir).catch(() => [] as string[])) total += await allocatedBytes(join(this.imagesDir, id)).catch(() => 0);
    return total;
  }

  /** Disk the images built since diskBytes() last counted take (allocated blocks). */
  builtBytesSince(): number {
    return this.builtSince;
  }

  /**
   * Removes images of snapshots that have no manifest, no lease and are not in `inUse` (e.g.
   * a disk layer a later local snapshot is backed by). Returns removed ids.
   */
  async prune(inUse: (snapshotId: string) => boolean = () => false): Promise<string[]> {
    const keep = new Set([...(await this.deps.manifests.list()), ...this.deps.roots.leasedSnapshots()]);
    const removed: string[] = [];
    for (const id of readdirSync(this.imagesDir)) {
      if (keep.has(id) || this.building.has(id) || inUse(id)) continue;
      // Stored since the list above (a fetch's manifest lands after its image)?
      if (await this.deps.manifests.get(id)) continue;
      // Checked again in the same turn as the rename below: a build or use that starts after
      // it finds no image and makes a new one. A lease taken since the list above (a restore
      // that is about to map the image) keeps it too.
      if (this.building.has(id) || inUse(id) || this.deps.roots.holders(id).length > 0) continue;
      // Out of images/ in one rename first: a kill during the recursive rm must not leave a
      // partial image where a cache hit would take it for whole (images-tmp/ is wiped at start).
      const doomed = join(this.tmpDir, `pruned-${id}-${randomBytes(4).toString('hex')}`);
      // Registered in the turn of the check: a build that starts before the rename lands
      // would otherwise find the image and return a directory about to vanish.
      const moving = rename(join(this.imagesDir, id), doomed);
      const settled = moving.catch(() => undefined);
      this.pruning.set(id, settled);
      try {
        await moving;
      } catch (e) {
        if ((e as NodeJS.ErrnoException).code === 'ENOENT') continue; // gone meanwhile
        throw e;
      } finally {
        if (this.pruning.get(id) === settled) this.pruning.delete(id);
      }
      await rm(doomed, { recursive: true, force: true });
      removed.push(id);
    }
    return removed;
  }
}

/** The bytes the files in `dir` take on disk (allocated blocks; a sparse file's holes take none). */
async function allocatedBytes(dir: string): Promise<number> {
  let total = 0;
  for (const f of await readdir(dir)) total += (await lstat(join(dir, f))).blocks * 512;
  return total;
}
