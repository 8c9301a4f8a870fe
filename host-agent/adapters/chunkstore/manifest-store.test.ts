import { afterEach, describe, expect, it, vi } from 'vitest';
import { spawn, spawnSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { create, toBinary } from '@bufbuild/protobuf';
import type { Logger } from 'pino';
import { FsChunkStore, FsManifestStore } from './fs-store.ts';
import { ingestSnapshot } from './ingest.ts';
import { collectGarbage } from '../../domain/snapshot-store-gc.ts';
import { LiveRoots, manifestDigests, systemClock } from '../../domain/snapshot-store.ts';
import { ArtifactKind, SignedManifestSchema, SnapshotManifestSchema } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';

const dirs: string[] = [];
afterEach(() => {
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
});

describe('FsManifestStore', () => {
  it('open_removesTempFilesOfAKilledWriter_evenOneThatHadThisProcesssPid_andLeavesALiveProcesssOnes', () => {
    const root = mkdtempSync(join(tmpdir(), 'ff-manifests-'));
    dirs.push(root);
    new FsManifestStore(root);
    const dead = spawnSync('true').pid; // exited: its pid names a writer that is gone
    const live = spawn('sleep', ['30'], { stdio: 'ignore' });
    try {
      writeFileSync(join(root, 'tmp', `${dead}.abcd.1.tmp`), 'half a manifest');
      writeFileSync(join(root, 'tmp', `${live.pid}.abcd.2.tmp`), 'being written');
      // An earlier process with this same pid (an agent that is PID 1 in its container each start).
      writeFileSync(join(root, 'tmp', `${process.pid}.abcd.3.tmp`), 'half a manifest');
      new FsManifestStore(root);
      expect(readdirSync(join(root, 'tmp'))).toEqual([`${live.pid}.abcd.2.tmp`]);
    } finally {
      live.kill();
    }
  });

  it('gc_withFilesInTheManifestStoreWhoseNamesAreNoSnapshotIds_orADirectory_passesEveryTime_sweepsWhatNoManifestReaches_andLogsEachNameOnce', async () => {
    // An operator's copy or restore left them: get() and delete() refuse such names, and the
    // GC, which took the refusal for a manifest that does not decode and deleted it, failed
    // then and every time after.
    const root = mkdtempSync(join(tmpdir(), 'ff-manifests-'));
    dirs.push(root);
    const CS = 64 * 1024;
    const warn = vi.fn();
    const chunks = new FsChunkStore(root, { offload: false });
    const manifests = new FsManifestStore(root, { log: { warn } as unknown as Logger });
    const roots = new LiveRoots();
    const ingest = async (id: string, fill: number) => {
      const mem = join(root, `${id}.mem`);
      writeFileSync(mem, Buffer.alloc(CS, fill));
      const r = await ingestSnapshot({ snapshotId: id, tenantId: 't', sourceSandboxId: 'sb', artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', path: mem }] }, { chunks, roots, clock: systemClock, chunkSize: CS });
      r.unpin();
      return r.manifest;
    };
    const kept = await ingest('sn-kept', 1);
    await manifests.put('sn-kept', create(SignedManifestSchema, { manifest: toBinary(SnapshotManifestSchema, kept) }));
    await ingest('sn-unreferenced', 2); // its chunk is in no stored manifest
    expect(await chunks.list()).toHaveLength(2);
    for (const name of ['snap:1.manifest', '.manifest', '..manifest']) writeFileSync(join(root, 'manifests', name), 'not a manifest');
    mkdirSync(join(root, 'manifests', 'sn-dir.manifest')); // a valid id, but no file
    // An hour on: every chunk is past the grace period.
    const gc = () => collectGarbage({ chunks, manifests, roots, clock: { now: () => new Date(Date.now() + 3_600_000) }, graceMs: 60_000 });
    const first = await gc();
    expect(first).toMatchObject({ manifests: 1, deleted: 1, removedManifests: [] });
    expect(await chunks.list()).toEqual([...manifestDigests(kept)]);
    // The next pass too (the strays are still there), and the next unreferenced chunk goes.
    await ingest('sn-later', 3);
    expect(await gc()).toMatchObject({ manifests: 1, deleted: 1, removedManifests: [] });
    expect(await chunks.list()).toEqual([...manifestDigests(kept)]);
    expect(await manifests.list()).toEqual(['sn-kept']);
    // Left where they are, for the operator, and named once each.
    expect(readdirSync(join(root, 'manifests')).sort()).toEqual(['..manifest', '.manifest', 'sn-dir.manifest', 'sn-kept.manifest', 'snap:1.manifest']);
    expect(warn.mock.calls.map(([o]) => (o as { file: string }).file).sort()).toEqual(['..manifest', '.manifest', 'sn-dir.manifest', 'snap:1.manifest'].map((n) => join(root, 'manifests', n)));
  });
});
