// Retention (which snapshots expire) and chunk garbage collection (mark and sweep).
import type { Logger } from 'pino';
import type { ChunkStore, Clock, DigestHex, LiveRoots, ManifestStore, SweepStats } from './snapshot-store.ts';
import { manifestDigests } from './snapshot-store.ts';
import { decodeManifestUnverified } from './tickets.ts';

export interface SnapshotRecord {
  readonly snapshotId: string;
  /** Lineage key: the sandbox the snapshot was taken from. */
  readonly lineage: string;
  readonly createdAt: Date;
  readonly pinned: boolean;
}

export interface RetentionPolicy {
  /** Keep at least the newest N snapshots of each lineage (pinned ones don't count). */
  readonly keepLast: number;
  /** Snapshots older than this expire, unless among the newest `keepLast`. Undefined: no TTL. */
  readonly ttlMs?: number;
}

/**
 * Which snapshots expire under `policy` at `now`. Pure. Per lineage, unpinned snapshots are
 * ordered newest first; the first `keepLast` are kept; of the rest, those older than the TTL
 * expire (all of them when there is no TTL). Pinned snapshots never expire. Deleting a parent
 * never breaks a child: a child's manifest lists every chunk it needs.
 */
export function selectExpired(snapshots: readonly SnapshotRecord[], policy: RetentionPolicy, now: Date): string[] {
  const byLineage = new Map<string, SnapshotRecord[]>();
  for (const s of snapshots) {
    if (s.pinned) continue;
    const l = byLineage.get(s.lineage) ?? [];
    l.push(s);
    byLineage.set(s.lineage, l);
  }
  const out: string[] = [];
  for (const list of byLineage.values()) {
    list.sort((a, b) => b.createdAt.getTime() - a.createdAt.getTime() || (a.snapshotId < b.snapshotId ? -1 : 1));
    for (const s of list.slice(Math.max(0, policy.keepLast))) {
      if (policy.ttlMs === undefined || now.getTime() - s.createdAt.getTime() > policy.ttlMs) out.push(s.snapshotId);
    }
  }
  return out.sort();
}

export interface GcDeps {
  readonly chunks: ChunkStore;
  readonly manifests: ManifestStore;
  readonly roots: LiveRoots;
  readonly clock: Clock;
  /** Chunks written less than this long ago are kept even when nothing reaches them. */
  readonly graceMs: number;
  readonly log?: Logger;
}

export interface GcResult extends SweepStats {
  readonly liveChunks: number;
  readonly manifests: number;
  /** Manifests this run removed because they did not decode (the host no longer holds those snapshots). */
  readonly removedManifests: readonly string[];
}

/**
 * Mark from every stored manifest, then sweep every chunk that is not marked, not pinned by
 * an in-flight ingest or transfer, and older than the grace period. A lease keeps no chunk:
 * the host's delete (ChunkStoreShipper.remove) removes a leased snapshot's manifest as well.
 * What a lease keeps is the snapshot's files, its materialised image and its VMM directory
 * (Materialiser.prune and the shipper's GC skip leased snapshots), which is what its holder
 * reads. An image being built from stored chunks is not kept by anything here: its builder pins
 * the manifest's chunks around the build (ChunkStoreShipper.obtain), as a fetch does its own.
 */
export async function collectGarbage(deps: GcDeps): Promise<GcResult> {
  // A manifest stored after the mark below is not in `live`: its chunks stay pinned (their
  // owners' unpins wait) until the sweep ends.
  const endSweep = deps.roots.beginSweep();
  const live = new Set<DigestHex>();
  const removedManifests: string[] = [];
  let ids: string[];
  let stats: SweepStats;
  try {
    ids = await deps.manifests.list();
    for (const id of ids) {
      let digests: Set<DigestHex>;
      try {
        const signed = await deps.manifests.get(id);
        if (!signed) continue;
        digests = manifestDigests(decodeManifestUnverified(signed));
      } catch (e) {
        // A read that failed (EIO, EMFILE) may work next time: no sweep now, nothing lost.
        if (typeof (e as NodeJS.ErrnoException).code === 'string') throw e;
        // A manifest that does not decode restores nothing (every restore verifies it) and
        // would stop every GC here for good: it goes, and the chunks only it named with the
        // sweep. The host then no longer reports the snapshot, and the scheduler drops it from
        // the snapshot's holders.
        deps.log?.error({ snapshotId: id, err: String(e) }, 'a stored manifest does not decode: removed');
        await deps.manifests.delete(id);
        removedManifests.push(id);
        continue;
      }
      for (const d of digests) live.add(d);
    }
    const cutoff = deps.clock.now().getTime() - deps.graceMs;
    stats = await deps.chunks.sweep((d, mtimeMs) => live.has(d) || deps.roots.isPinned(d) || mtimeMs > cutoff);
  } finally {
    endSweep();
  }
  const result = { ...stats, liveChunks: live.size, manifests: ids.length, removedManifests };
  deps.log?.info({ gc: result }, 'chunk gc done');
  return result;
}

/**
 * Deletes a snapshot's manifest unless a lease is held on it (SnapshotLeasedError). Its chunks
 * go at the next GC. Not what the agent's delete step runs: that is ChunkStoreShipper.remove,
 * which deletes a leased snapshot too (the scheduler's delete is final) and only leaves its
 * files until the lease is released.
 */
export async function deleteSnapshot(snapshotId: string, deps: Pick<GcDeps, 'manifests' | 'roots'>): Promise<void> {
  deps.roots.assertNotLeased(snapshotId);
  await deps.manifests.delete(snapshotId);
}
