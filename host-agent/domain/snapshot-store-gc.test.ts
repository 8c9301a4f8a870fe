import { describe, expect, it } from 'vitest';
import fc from 'fast-check';
import { collectGarbage, selectExpired, type SnapshotRecord } from './snapshot-store-gc.ts';
import { LiveRoots, type ChunkStore, type DigestHex, type ManifestStore, type SweepStats } from './snapshot-store.ts';

const t = (min: number): Date => new Date(Date.UTC(2026, 0, 1) + min * 60_000);

describe('selectExpired', () => {
  it('selectExpired_keepsLastNPerLineage_andExpiresOlderThanTtl', () => {
    const snaps: SnapshotRecord[] = [
      { snapshotId: 'a1', lineage: 'a', createdAt: t(0), pinned: false },
      { snapshotId: 'a2', lineage: 'a', createdAt: t(10), pinned: false },
      { snapshotId: 'a3', lineage: 'a', createdAt: t(20), pinned: false },
      { snapshotId: 'a0', lineage: 'a', createdAt: t(-100), pinned: true },
      { snapshotId: 'b1', lineage: 'b', createdAt: t(0), pinned: false },
    ];
    expect(selectExpired(snaps, { keepLast: 2 }, t(30))).toEqual(['a1']);
    expect(selectExpired(snaps, { keepLast: 1, ttlMs: 15 * 60_000 }, t(30))).toEqual(['a1', 'a2']);
    expect(selectExpired(snaps, { keepLast: 1, ttlMs: 25 * 60_000 }, t(30))).toEqual(['a1']);
    expect(selectExpired(snaps, { keepLast: 0, ttlMs: 15 * 60_000 }, t(30))).toEqual(['a1', 'a2', 'b1']);
  });

  it('selectExpired_neverExpiresPinnedOrNewestN (property)', () => {
    const rec = fc.record({
      snapshotId: fc.uuid(),
      lineage: fc.constantFrom('a', 'b', 'c'),
      createdAt: fc.integer({ min: 0, max: 1000 }).map(t),
      pinned: fc.boolean(),
    });
    fc.assert(
      fc.property(fc.uniqueArray(rec, { selector: (r) => r.snapshotId, maxLength: 30 }), fc.integer({ min: 0, max: 5 }), fc.option(fc.integer({ min: 0, max: 600 }), { nil: undefined }), (snaps, keepLast, ttlMin) => {
        const expired = new Set(selectExpired(snaps, { keepLast, ttlMs: ttlMin === undefined ? undefined : ttlMin * 60_000 }, t(1000)));
        for (const s of snaps) if (s.pinned) expect(expired.has(s.snapshotId)).toBe(false);
        for (const l of ['a', 'b', 'c']) {
          const kept = snaps.filter((s) => s.lineage === l && !s.pinned && !expired.has(s.snapshotId)).length;
          const total = snaps.filter((s) => s.lineage === l && !s.pinned).length;
          expect(kept).toBeGreaterThanOrEqual(Math.min(keepLast, total));
        }
      }),
    );
  });
});

describe('collectGarbage', () => {
  it('gc_whenAFetchStoresItsManifestAndUnpinsMidSweep_keepsItsOldChunks', async () => {
    // An old chunk (older than the grace period) that a fetch found already here: pinned by
    // the fetch, in no manifest yet when the GC marks. The fetch stores its manifest and
    // unpins while the sweep runs: the chunk must survive.
    const roots = new LiveRoots();
    const old: DigestHex = 'a'.repeat(64);
    const stray: DigestHex = 'b'.repeat(64);
    const unpin = roots.pin([old]);
    const stored = new Map<DigestHex, number>([[old, 0], [stray, 0]]);
    const chunks = {
      async sweep(isLive: (d: DigestHex, mtimeMs: number) => boolean): Promise<SweepStats> {
        let deleted = 0;
        for (const [d, mtime] of [...stored]) {
          if (d === old) unpin(); // the fetch's manifest was stored after the mark: it unpins now
          if (!isLive(d, mtime)) {
            stored.delete(d);
            deleted++;
          }
        }
        return { scanned: 2, deleted, freedBytes: 0, keptBytes: 0 };
      },
    } as unknown as ChunkStore;
    const manifests = { list: async () => [], get: async () => undefined } as unknown as ManifestStore;
    await collectGarbage({ chunks, manifests, roots, clock: { now: () => new Date(Date.UTC(2026, 0, 1)) }, graceMs: 60_000 });
    expect([...stored.keys()]).toEqual([old]);
    // The unpin took effect once the sweep ended: the next GC may take the chunk (its
    // manifest, stored by then, is what keeps it in real life).
    expect(roots.isPinned(old)).toBe(false);
  });

  it('gc_withAManifestThatDoesNotDecode_removesIt_andSweepsOn_butAManifestItCannotReadStopsTheSweep', async () => {
    const stored = new Set<DigestHex>(['c'.repeat(64)]);
    const chunks = {
      async sweep(isLive: (d: DigestHex, mtimeMs: number) => boolean): Promise<SweepStats> {
        for (const d of [...stored]) if (!isLive(d, 0)) stored.delete(d);
        return { scanned: 1, deleted: 0, freedBytes: 0, keptBytes: 0 };
      },
    } as unknown as ChunkStore;
    const deleted: string[] = [];
    const gc = (get: () => Promise<unknown>) =>
      collectGarbage({ chunks, manifests: { list: async () => ['sn-bad'], get, delete: async (id: string) => void deleted.push(id) } as unknown as ManifestStore, roots: new LiveRoots(), clock: { now: () => new Date(Date.UTC(2026, 0, 1)) }, graceMs: 60_000 });
    // Unreadable now (an I/O error): the GC fails and removes nothing.
    await expect(gc(async () => Promise.reject(Object.assign(new Error('EIO: i/o error'), { code: 'EIO' })))).rejects.toThrow(/EIO/);
    expect([deleted, stored.size]).toEqual([[], 1]);
    // Garbage bytes: the manifest goes and the sweep runs.
    const r = await gc(async () => ({ manifest: new Uint8Array([0xff, 0xff, 0xff]) }));
    expect([deleted, stored.size]).toEqual([['sn-bad'], 0]);
    // Named in the result, so the shipper stops reporting the snapshot held.
    expect(r.removedManifests).toEqual(['sn-bad']);
  });
});
