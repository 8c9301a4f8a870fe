// Materialise a snapshot's artifacts from the chunk store into plain files, verifying the
// manifest signature and every chunk digest. Files are sparse (ftruncate to size, write only
// listed chunks), built in a temp directory and renamed into place, then kept read-only:
// every same-host fork maps the same memory image (page cache shared). Idempotent: a
// second call returns the cached directory; concurrent calls share one build.
import { mkdirSync, readdirSync, rmSync } from 'node:fs';
import { chmod, open, rename, rm, stat, mkdir } from 'node:fs/promises';
import { join } from 'node:path';
import { randomBytes } from 'node:crypto';
import type { Logger } from 'pino';
import type { ChunkStore, LiveRoots, Lease, ManifestStore } from '../../domain/snapshot-store.ts';
import { ChunkCorruptError, ManifestNotFoundError } from '../../domain/transfer-errors.ts';
import { verifyManifest, type TrustedKeys } from '../../domain/tickets.ts';

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
}

function fileName(artifactName: string): string {
  return artifactName.replace(/[^A-Za-z0-9._-]/g, '_');
}

export class Materialiser {
  private readonly imagesDir: string;
  private readonly tmpDir: string;
  private readonly building = new Map<string, Promise<MaterialisedSnapshot>>();

  constructor(private readonly deps: MaterialiserDeps) {
    this.imagesDir = join(deps.root, 'images');
    this.tmpDir = join(deps.root, 'images-tmp');
    mkdirSync(this.imagesDir, { recursive: true });
    rmSync(this.tmpDir, { recursive: true, force: true });
    mkdirSync(this.tmpDir, { recursive: true });
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
      p = this.build(snapshotId).finally(() => this.building.delete(snapshotId));
      this.building.set(snapshotId, p);
    }
    return p;
  }

  private async build(snapshotId: string): Promise<MaterialisedSnapshot> {
    const t0 = performance.now();
    const signed = await this.deps.manifests.get(snapshotId);
    if (!signed) throw new ManifestNotFoundError(snapshotId);
    const manifest = verifyManifest(signed, this.deps.trust, snapshotId);
    const final = join(this.imagesDir, snapshotId);
    const files: Record<string, string> = {};
    for (const a of manifest.artifacts) files[a.name] = join(final, fileName(a.name));
    try {
      await stat(final);
      return { snapshotId, dir: final, files, built: false, ms: Math.round(performance.now() - t0) };
    } catch {
      /* not cached: build it */
    }
    const tmp = join(this.tmpDir, `${snapshotId}.${randomBytes(4).toString('hex')}`);
    await mkdir(tmp, { recursive: true });
    const corrupt: string[] = [];
    try {
      const concurrency = this.deps.concurrency ?? 8;
      for (const a of manifest.artifacts) {
        const fh = await open(join(tmp, fileName(a.name)), 'w');
        try {
          await fh.truncate(Number(a.size));
          const refs = a.chunks;
          let next = 0;
          const worker = async (): Promise<void> => {
            while (next < refs.length) {
              const ref = refs[next++];
              if (!ref) break;
              const digest = Buffer.from(ref.digest).toString('hex');
              try {
                const plain = await this.deps.chunks.readVerified(digest);
                await fh.write(plain, 0, plain.length, Number(ref.index) * manifest.chunkSize);
              } catch (e) {
                if (e instanceof ChunkCorruptError) corrupt.push(...e.digests);
                else throw e;
              }
            }
          };
          await Promise.all(Array.from({ length: concurrency }, worker));
          await fh.sync();
        } finally {
          await fh.close();
        }
        // The memory image must never be written again (VMM-NOTES gotcha 3).
        await chmod(join(tmp, fileName(a.name)), 0o444);
      }
      if (corrupt.length > 0) throw new ChunkCorruptError(corrupt);
      try {
        await rename(tmp, final);
      } catch (e) {
        // Another process built it first: theirs is as good as ours.
        if ((e as NodeJS.ErrnoException).code !== 'ENOTEMPTY' && (e as NodeJS.ErrnoException).code !== 'EEXIST') throw e;
        await rm(tmp, { recursive: true, force: true });
        return { snapshotId, dir: final, files, built: false, ms: Math.round(performance.now() - t0) };
      }
    } catch (e) {
      await rm(tmp, { recursive: true, force: true });
      throw e;
    }
    const ms = Math.round(performance.now() - t0);
    this.deps.log?.info({ snapshotId, ms }, 'snapshot materialised');
    return { snapshotId, dir: final, files, built: true, ms };
  }

  /** Removes images of snapshots that have no manifest and no lease. Returns removed ids. */
  async prune(): Promise<string[]> {
    const keep = new Set([...(await this.deps.manifests.list()), ...this.deps.roots.leasedSnapshots()]);
    const removed: string[] = [];
    for (const id of readdirSync(this.imagesDir)) {
      if (keep.has(id) || this.building.has(id)) continue;
      await rm(join(this.imagesDir, id), { recursive: true, force: true });
      removed.push(id);
    }
    return removed;
  }
}
