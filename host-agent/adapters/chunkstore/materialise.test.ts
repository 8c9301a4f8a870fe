// Materialiser images whose background fsync fails. The fsync is made to fail through
// node:fs/promises' open (the one ../durable.ts fsyncs with), once per path, as Linux reports
// a writeback error once: a second fsync of the same file returns 0.
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { existsSync, readdirSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { create } from '@bufbuild/protobuf';
import { FsChunkStore, FsManifestStore } from './fs-store.ts';
import { Materialiser } from './materialise.ts';
import { encodeChunk } from './codec.ts';
import { LiveRoots } from '../../domain/snapshot-store.ts';
import { ArtifactKind, SnapshotManifestSchema } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { tempDir } from '../../../services/testkit/proc.ts';
import { textBytes } from '../../bench/transfer-image.ts';
import { failOnce } from '../fsync-fault.ts';

vi.mock('node:fs/promises', async (real) => (await import('../fsync-fault.ts')).failingFsync(await real()));

const CS = 64 * 1024;
let dir: string;
beforeAll(() => {
  dir = tempDir('ff-materialise-');
});
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe('Materialiser', () => {
  it('build_whoseBackgroundImageFsyncFails_discardsTheImage_andTheNextBuildMakesItAgain', async () => {
    // The marker stayed and the image too: served from the page cache until evicted, and after
    // an agent restart fsynced again (0 this time) and taken for durable.
    const root = join(dir, 'fsync-fails');
    const chunks = new FsChunkStore(root, { offload: false });
    const manifests = new FsManifestStore(root);
    const plain = textBytes(CS, 3);
    const c = await encodeChunk(plain);
    await chunks.put(c);
    const manifest = create(SnapshotManifestSchema, {
      snapshotId: 'sn-a',
      chunkSize: CS,
      artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', size: BigInt(CS), chunks: [{ index: 0n, digest: Buffer.from(c.digest, 'hex'), size: CS, storedSize: c.data.length }] }],
    });
    const deps = { root, chunks, manifests, trust: new Map(), roots: new LiveRoots() };
    const m = new Materialiser(deps);
    failOnce.add(join(root, 'images', 'sn-a', 'memory'));
    expect((await m.materialiseWhile('sn-a', manifest, async () => {})).built).toBe(true);
    await m.flush();
    expect(readdirSync(join(root, 'images'))).toEqual([]);
    expect(readdirSync(join(root, 'images-unsynced'))).toEqual([]);
    // Restarted in the same boot: nothing passes for durable; a restore builds the image anew.
    const restarted = new Materialiser(deps);
    await restarted.flush();
    expect(existsSync(join(root, 'images', 'sn-a'))).toBe(false);
    const again = await restarted.materialiseWhile('sn-a', manifest, async () => {});
    expect(again.built).toBe(true);
    await restarted.flush();
    expect(readdirSync(join(root, 'images'))).toEqual(['sn-a']);
    expect(readdirSync(join(root, 'images-unsynced'))).toEqual([]);
  });

  it('diskBytes_countsTheBlocksTheCachedImagesTake_sparseHolesNot_andBuildsSinceAreCountedUntilTheNextCount', async () => {
    const root = join(dir, 'disk-bytes');
    const chunks = new FsChunkStore(root, { offload: false });
    const manifests = new FsManifestStore(root);
    const c = await encodeChunk(textBytes(CS, 5));
    await chunks.put(c);
    // 16 chunks of memory, one of them not zero: the image is sparse around it.
    const manifest = create(SnapshotManifestSchema, {
      snapshotId: 'sn-b',
      chunkSize: CS,
      artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', size: BigInt(16 * CS), chunks: [{ index: 3n, digest: Buffer.from(c.digest, 'hex'), size: CS, storedSize: c.data.length }] }],
    });
    const m = new Materialiser({ root, chunks, manifests, trust: new Map(), roots: new LiveRoots() });
    expect(await m.diskBytes()).toBe(0);
    await m.materialiseWhile('sn-b', manifest, async () => {});
    await m.flush();
    const since = m.builtBytesSince();
    expect(since).toBeGreaterThanOrEqual(CS);
    expect(since).toBeLessThan(4 * CS);
    expect(await m.diskBytes()).toBe(since);
    expect(m.builtBytesSince()).toBe(0);
    // Its manifest was never stored: the next prune removes it, and the count with it.
    expect(await m.prune()).toEqual(['sn-b']);
    expect(await m.diskBytes()).toBe(0);
  });
});
