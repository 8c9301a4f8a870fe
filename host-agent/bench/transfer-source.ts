// The source side of the transfer benchmarks (transfer.ts, transfer-probe.ts): the synthetic
// image of transfer-image.ts ingested as snapshot s1 into a chunk store, its manifest signed by
// a fresh key whose public half the receiving endpoint trusts.
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { FsChunkStore, FsManifestStore } from '../adapters/chunkstore/fs-store.ts';
import { ingestSnapshot } from '../adapters/chunkstore/ingest.ts';
import { LiveRoots, systemClock } from '../domain/snapshot-store.ts';
import { generateSigningKey, signManifest } from '../domain/tickets.ts';
import { ArtifactKind } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { DEFAULT_IMAGE, writeDiskLayer, writeMemoryImage } from './transfer-image.ts';

export async function prepareSource(dir: string) {
  const mem = join(dir, 'mem.img');
  const disk = join(dir, 'disk0.img');
  writeMemoryImage(mem, DEFAULT_IMAGE);
  writeDiskLayer(disk, 64 * 1024 * 1024, 16 * 1024 * 1024);
  const { signing, trusted } = generateSigningKey('k1');
  /** The public key the receiving endpoint trusts (PEM). */
  const pem = join(dir, 'trust.pem');
  writeFileSync(pem, (trusted.get('k1') as NonNullable<ReturnType<typeof trusted.get>>).export({ type: 'spki', format: 'pem' }));
  const srcRoot = join(dir, 'src');
  const store = { chunks: new FsChunkStore(srcRoot), manifests: new FsManifestStore(srcRoot), roots: new LiveRoots(), clock: systemClock };
  const s1 = await ingestSnapshot(
    { snapshotId: 's1', tenantId: 't', sourceSandboxId: 'sb1', artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', path: mem }, { kind: ArtifactKind.DISK_LAYER, name: 'disk/0', path: disk }] },
    store,
  );
  await store.manifests.put('s1', signManifest(s1.manifest, signing));
  return { mem, disk, pem, srcRoot, store, signing, s1 };
}
