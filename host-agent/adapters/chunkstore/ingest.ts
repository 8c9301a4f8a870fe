// Ingest: cut artifact files into fixed-size chunks, skip zero chunks, hash, dedup against
// the store, compress and store new chunks; produce the (unsigned) SnapshotManifest.
// Idempotent: re-ingesting the same files stores nothing new and yields the same manifest.
import { open } from 'node:fs/promises';
import { create } from '@bufbuild/protobuf';
import { timestampFromDate } from '@bufbuild/protobuf/wkt';
import type { Logger } from 'pino';
import { ArtifactSchema, ChunkRefSchema, Codec, SnapshotManifestSchema } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import type { ArtifactKind, ChunkRef, SnapshotManifest } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import type { VmConfig } from '../../../proto/gen/forkfleet/v1/common_pb.ts';
import type { ChunkStore, Clock, EncodedChunk, LiveRoots } from '../../domain/snapshot-store.ts';
import { DigestMismatchError } from '../../domain/transfer-errors.ts';
import { DEFAULT_CHUNK_SIZE, decodeChunk, encodeChunk, isZero, sha256Hex } from './codec.ts';

export interface ArtifactInput {
  readonly kind: ArtifactKind;
  readonly name: string;
  readonly path: string;
  readonly backing?: string;
}

export interface IngestInput {
  readonly snapshotId: string;
  readonly tenantId: string;
  readonly parentSnapshotId?: string;
  readonly sourceSandboxId: string;
  readonly vmConfig?: VmConfig;
  readonly artifacts: readonly ArtifactInput[];
}

export interface IngestDeps {
  readonly chunks: ChunkStore;
  readonly roots: LiveRoots;
  readonly clock: Clock;
  readonly chunkSize?: number;
  /** Chunks hashed/compressed/written concurrently (compression runs on the libuv pool). */
  readonly concurrency?: number;
  readonly log?: Logger;
}

export interface IngestStats {
  logicalBytes: number;
  zeroChunks: number;
  nonZeroChunks: number;
  newChunks: number;
  newStoredBytes: number;
  dedupChunks: number;
  ms: number;
}

/** Whether stored chunk `c` decodes to `plain` (a decode and a compare; no hash, `plain` was hashed). */
async function decodesTo(c: EncodedChunk, plain: Buffer): Promise<boolean> {
  try {
    await decodeChunk(c, plain);
    return true;
  } catch (e) {
    if (e instanceof DigestMismatchError) return false;
    throw e;
  }
}

/**
 * Cuts `input`'s artifacts into the chunk store and returns their manifest (not stored: the
 * caller stores it once signed). The chunks stay pinned against GC until `unpin` is called,
 * which the caller does after storing the manifest (on a failure they are unpinned here).
 */
export async function ingestSnapshot(input: IngestInput, deps: IngestDeps): Promise<{ manifest: SnapshotManifest; stats: IngestStats; unpin: () => void }> {
  const chunkSize = deps.chunkSize ?? DEFAULT_CHUNK_SIZE;
  const concurrency = deps.concurrency ?? 8;
  const t0 = performance.now();
  const stats: IngestStats = { logicalBytes: 0, zeroChunks: 0, nonZeroChunks: 0, newChunks: 0, newStoredBytes: 0, dedupChunks: 0, ms: 0 };
  const pinned: Array<() => void> = [];
  const unpin = (): void => {
    for (const u of pinned.splice(0)) u();
  };
  try {
    const artifacts = [];
    for (const a of input.artifacts) {
      const fh = await open(a.path, 'r');
      try {
        const size = (await fh.stat()).size;
        stats.logicalBytes += size;
        const refs: ChunkRef[] = [];
        const inflight = new Set<Promise<void>>();
        // The first chunk write that failed: a write that fails while the loop reads (no one
        // awaits it then) must still fail the ingest, or its ref goes into a manifest over a
        // chunk that was never stored.
        let failed: { err: unknown } | undefined;
        try {
          for (let index = 0; index * chunkSize < size; index++) {
            if (failed) throw failed.err;
            const len = Math.min(chunkSize, size - index * chunkSize);
            const buf = Buffer.allocUnsafe(len);
            let got = 0;
            while (got < len) {
              const { bytesRead } = await fh.read(buf, got, len - got, index * chunkSize + got);
              // Shorter than it was at the start (changed under the ingest): the rest of `buf` is
              // whatever memory held before, never to be hashed and stored as the snapshot.
              if (bytesRead === 0) throw new Error(`${a.path} ended at byte ${index * chunkSize + got} while it was ingested (it was ${size} bytes)`);
              got += bytesRead;
            }
            if (isZero(buf)) {
              stats.zeroChunks++;
              continue;
            }
            stats.nonZeroChunks++;
            const digest = sha256Hex(buf);
            // Pin before checking the store: GC cannot remove it between check and manifest write.
            pinned.push(deps.roots.pin([digest]));
            const ref = create(ChunkRefSchema, { index: BigInt(index), digest: Buffer.from(digest, 'hex'), size: len, storedSize: len });
            refs.push(ref);
            const p = (async () => {
              // A chunk file renamed into place but not fsynced before an OS crash may be empty,
              // cut short or torn, and sync() below skips it (not written by this run): reused only
              // if it decodes to these bytes, else rewritten from them (ADR 0007, Durability).
              const stored = await deps.chunks.getEncoded(digest);
              if (stored && (await decodesTo(stored, buf))) {
                stats.dedupChunks++;
                ref.storedSize = stored.data.length;
                await deps.chunks.touch(digest);
                return;
              }
              const enc = await encodeChunk(buf, digest);
              ref.storedSize = enc.data.length;
              await deps.chunks.put(enc, { trusted: true });
              stats.newChunks++;
              stats.newStoredBytes += enc.data.length;
            })();
            inflight.add(p);
            p.then(
              () => void inflight.delete(p),
              (e: unknown) => {
                inflight.delete(p);
                failed ??= { err: e };
              },
            );
            if (inflight.size >= concurrency) await Promise.race(inflight).catch(() => undefined);
          }
        } finally {
          // Every write settled before the ingest returns or throws: none runs on after it.
          await Promise.allSettled(inflight);
        }
        if (failed) throw failed.err;
        artifacts.push(create(ArtifactSchema, { kind: a.kind, name: a.name, size: BigInt(size), chunks: refs, backing: a.backing ?? '' }));
      } finally {
        await fh.close();
      }
    }
    // Chunks were written without per-file fsync: make them durable before the caller
    // stores the manifest (the "complete" marker).
    await deps.chunks.sync(artifacts.flatMap((a) => a.chunks.map((c) => Buffer.from(c.digest).toString('hex'))));
    const manifest = create(SnapshotManifestSchema, {
      snapshotId: input.snapshotId,
      tenantId: input.tenantId,
      parentSnapshotId: input.parentSnapshotId ?? '',
      sourceSandboxId: input.sourceSandboxId,
      createdAt: timestampFromDate(deps.clock.now()),
      vmConfig: input.vmConfig,
      chunkSize,
      codec: Codec.ZSTD,
      artifacts,
    });
    stats.ms = Math.round(performance.now() - t0);
    deps.log?.info({ snapshotId: input.snapshotId, ingest: stats }, 'snapshot ingested');
    return { manifest, stats, unpin };
  } catch (e) {
    unpin();
    throw e;
  }
}
