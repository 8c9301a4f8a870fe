// For tests of MigrateSnapshot (migrate.test.ts, tls-relay.int.test.ts): a chunk store in
// `dir` holding snapshot `s1` (1 MiB of memory) and its manifest signed with `key`, so that a
// chunk transfer service over it honours tickets for `s1`.
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { FsChunkStore, FsManifestStore } from '../chunkstore/fs-store.ts';
import { ingestSnapshot } from '../chunkstore/ingest.ts';
import { LiveRoots, systemClock } from '../../domain/snapshot-store.ts';
import { signManifest, type SigningKey } from '../../domain/tickets.ts';
import { ArtifactKind } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';

export async function storeHoldingS1(dir: string, key: SigningKey): Promise<{ chunks: FsChunkStore; manifests: FsManifestStore }> {
  const file = join(dir, 'mem.img');
  writeFileSync(file, Buffer.alloc(1 << 20, 7));
  const deps = { chunks: new FsChunkStore(join(dir, 'A')), manifests: new FsManifestStore(join(dir, 'A')), roots: new LiveRoots(), clock: systemClock };
  const s1 = await ingestSnapshot({ snapshotId: 's1', tenantId: 't', sourceSandboxId: 'sb', artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', path: file }] }, deps);
  await deps.manifests.put('s1', signManifest(s1.manifest, key));
  s1.unpin();
  return { chunks: deps.chunks, manifests: deps.manifests };
}
