// Ingest over a store an OS crash left behind: a chunk file renamed into place but never
// fsynced may be empty, cut short or torn (ADR 0007, Durability). Reusing it would store a
// manifest, the "complete" marker, over a chunk that does not decode.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { readFileSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { FsChunkStore, overwriteChunkFile } from './fs-store.ts';
import { ingestSnapshot } from './ingest.ts';
import { HEADER } from './chunk-file.ts';
import { LiveRoots, systemClock } from '../../domain/snapshot-store.ts';
import { ArtifactKind, Codec } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { tempDir } from '../../../services/testkit/proc.ts';
import { randomBytesSeeded, textBytes } from '../../bench/transfer-image.ts';

const CS = 256 * 1024;
let dir: string;

beforeAll(() => {
  dir = tempDir('ff-ingest-');
});
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe('ingestSnapshot', () => {
  it('ingest_overTornChunkFile_rewritesIt', async () => {
    const chunks = new FsChunkStore(join(dir, 'store'));
    const deps = { chunks, roots: new LiveRoots(), clock: systemClock, chunkSize: CS };
    const mem = join(dir, 'mem.img');
    // Compressible chunks (zstd) and random ones (stored raw); one of each is left intact.
    writeFileSync(mem, Buffer.concat([textBytes(CS, 1), textBytes(CS, 2), randomBytesSeeded(CS, 3), textBytes(CS, 4), randomBytesSeeded(CS, 5), textBytes(CS, 6)]));
    const artifacts = [{ kind: ArtifactKind.MEMORY, name: 'memory', path: mem }];
    const first = await ingestSnapshot({ snapshotId: 's1', tenantId: 't', sourceSandboxId: 'sb', artifacts }, deps);
    first.unpin();
    const digests = first.manifest.artifacts[0]!.chunks.map((c) => Buffer.from(c.digest).toString('hex'));
    const [empty, cut, rawTorn, zstdTorn, intactRaw, intactZstd] = digests as [string, string, string, string, string, string];
    const fileOf = (d: string): Buffer => readFileSync(chunks.pathOf(d));
    expect(fileOf(rawTorn).readUInt8(4)).toBe(Codec.NONE);
    expect(fileOf(zstdTorn).readUInt8(4)).toBe(Codec.ZSTD);
    // What an OS crash before sync() can leave: no data, data cut short, and the full length
    // with a valid header whose data blocks never reached the disk (read back as zeros).
    await overwriteChunkFile(chunks, empty, Buffer.alloc(0));
    await overwriteChunkFile(chunks, cut, fileOf(cut).subarray(0, HEADER + 100));
    for (const d of [rawTorn, zstdTorn]) {
      const f = fileOf(d);
      f.fill(0, HEADER + 4096);
      await overwriteChunkFile(chunks, d, f);
    }

    const second = await ingestSnapshot({ snapshotId: 's2', tenantId: 't', sourceSandboxId: 'sb', artifacts }, deps);
    second.unpin();
    expect(second.stats.newChunks).toBe(4);
    expect(second.stats.dedupChunks).toBe(2);
    const content = readFileSync(mem);
    for (const [i, d] of [empty, cut, rawTorn, zstdTorn, intactRaw, intactZstd].entries()) {
      expect((await chunks.readVerified(d)).equals(content.subarray(i * CS, (i + 1) * CS))).toBe(true);
    }
    // The manifest's stored sizes are those of the chunk files now in place.
    for (const ref of second.manifest.artifacts[0]!.chunks) {
      expect(ref.storedSize).toBe((await chunks.getEncoded(Buffer.from(ref.digest).toString('hex')))!.data.length);
    }
  });

  it('ingest_whenAChunkFailsWhileLaterChunksAreRead_failsInsteadOfReturningAManifestThatNamesIt', async () => {
    const store = new FsChunkStore(join(dir, 'store-eio'));
    // The store fails the second chunk at once (EIO looking it up), while the ingest goes on
    // reading the next ones: fewer chunks than the write concurrency, so nothing awaits that
    // chunk's write until the artifact ends.
    let lookups = 0;
    const chunks = new Proxy(store, {
      get: (target, key) =>
        key === 'getEncoded'
          ? async (...args: Parameters<FsChunkStore['getEncoded']>) => {
              if (++lookups === 2) throw Object.assign(new Error('EIO: i/o error, read'), { code: 'EIO' });
              return target.getEncoded(...args);
            }
          : (Reflect.get(target, key) as unknown),
    });
    const mem = join(dir, 'mem-eio.img');
    writeFileSync(mem, Buffer.concat([textBytes(CS, 11), textBytes(CS, 12), randomBytesSeeded(CS, 13), textBytes(CS, 14)]));
    const ingest = ingestSnapshot({ snapshotId: 's-eio', tenantId: 't', sourceSandboxId: 'sb', artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', path: mem }] }, { chunks, roots: new LiveRoots(), clock: systemClock, chunkSize: CS });
    await expect(ingest).rejects.toThrow(/EIO/);
  });
});
