import { afterAll, afterEach, beforeAll, describe, expect, it, vi } from 'vitest';
import { closeSync, openSync, readFileSync, rmSync } from 'node:fs';
import type * as NodeFs from 'node:fs';
import { createHash } from 'node:crypto';
import { join } from 'node:path';
import { create } from '@bufbuild/protobuf';
import { nonZeroRuns, PAGE, writeSparse, ZERO_PAGE } from './sparse.ts';
import { FsChunkStore, FsManifestStore } from './fs-store.ts';
import { Materialiser } from './materialise.ts';
import { LiveRoots } from '../../domain/snapshot-store.ts';
import { ArtifactKind, Codec, SnapshotManifestSchema } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { tempDir } from '../../../services/testkit/proc.ts';

/** fs.write as the code under test sees it: the real one unless a test puts its own here. */
const writes = vi.hoisted(() => ({ impl: undefined as undefined | ((...a: unknown[]) => void) }));
vi.mock('node:fs', async (importOriginal) => {
  const real = await importOriginal<typeof NodeFs>();
  const write = (...a: unknown[]): void => void (writes.impl ?? (real.write as (...a: unknown[]) => void))(...a);
  return { ...real, write, default: { ...real, write } };
});

function pages(spec: string): Buffer {
  // One character per page: '0' a zero page, anything else a page with data.
  const b = Buffer.alloc(spec.length * PAGE);
  for (let i = 0; i < spec.length; i++) if (spec[i] !== '0') b[i * PAGE + PAGE - 1] = 1;
  return b;
}

describe('nonZeroRuns', () => {
  it('nonZeroRuns_mergesAdjacentDataPagesAndSkipsZeroPages', () => {
    expect(nonZeroRuns(pages('x0xx00x'), ZERO_PAGE, PAGE)).toEqual([0, PAGE, 2 * PAGE, 4 * PAGE, 6 * PAGE, 7 * PAGE]);
  });

  it('nonZeroRuns_allZeroOrAllData_givesNoRunOrOneRun', () => {
    expect(nonZeroRuns(pages('0000'), ZERO_PAGE, PAGE)).toEqual([]);
    expect(nonZeroRuns(pages('xxxx'), ZERO_PAGE, PAGE)).toEqual([0, 4 * PAGE]);
  });

  it('nonZeroRuns_partialLastPage_countsAsAPage', () => {
    const b = Buffer.alloc(PAGE + 100);
    b[PAGE + 99] = 7;
    expect(nonZeroRuns(b, ZERO_PAGE, PAGE)).toEqual([PAGE, PAGE + 100]);
    expect(nonZeroRuns(Buffer.alloc(PAGE + 100), ZERO_PAGE, PAGE)).toEqual([]);
  });
});

// Image writes go by raw descriptor number: a write still queued when its caller gives up
// and closes the file lands in whatever file opens next under that number. So whoever
// writes an image settles only once every write it started has called back.
describe('image writes settle only after every write', () => {
  let dir: string;
  const fds: number[] = [];
  beforeAll(() => {
    dir = tempDir('ff-sparse-');
  });
  afterEach(() => {
    writes.impl = undefined;
    for (const fd of fds.splice(0)) closeSync(fd);
  });
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  /** The first write fails at once; every other one is written for real 30 ms later. Counts callbacks. */
  async function firstWriteFailsAtOnce(): Promise<{ calls: () => number; fired: () => number }> {
    const real = (await vi.importActual<typeof NodeFs>('node:fs')).write as (...a: unknown[]) => void;
    let calls = 0;
    let fired = 0;
    writes.impl = (...a: unknown[]) => {
      const cb = a[a.length - 1] as (e: Error | null, n?: number) => void;
      if (calls++ === 0) {
        process.nextTick(() => {
          fired++;
          cb(Object.assign(new Error('EIO: injected write failure'), { code: 'EIO' }));
        });
        return;
      }
      setTimeout(
        () =>
          real(...a.slice(0, -1), (e: Error | null, n?: number) => {
            fired++;
            cb(e, n);
          }),
        30,
      );
    };
    return { calls: () => calls, fired: () => fired };
  }

  function openImage(name: string): number {
    const fd = openSync(join(dir, name), 'w+');
    fds.push(fd);
    return fd;
  }

  it('writeSparse_whenItsFirstWriteFailsAtOnce_settlesOnlyAfterEveryOtherWriteCalledBack', async () => {
    const fd = openImage('image-a');
    const w = await firstWriteFailsAtOnce();
    await expect(writeSparse(fd, pages('x0x0x'), 0)).rejects.toThrow(/injected/);
    expect([w.calls(), w.fired()]).toEqual([3, 3]);
  });

  it('acceptInto_inline_whenTheWriteToOnePlaceFailsAtOnce_settlesOnlyAfterTheOtherPlacesAreWritten', async () => {
    const store = new FsChunkStore(join(dir, 'store'), { offload: false });
    const plain = pages('xxxx');
    const digest = createHash('sha256').update(plain).digest('hex');
    const places = [openImage('place-1'), openImage('place-2'), openImage('place-3')].map((fd) => ({ fd, pos: 0 }));
    const w = await firstWriteFailsAtOnce();
    await expect(store.acceptInto({ digest, codec: Codec.NONE, size: plain.length, data: plain }, places)).rejects.toThrow(/injected/);
    expect([w.calls(), w.fired()]).toEqual([3, 3]);
  });

  it('materialiseWhile_whenADeliveredChunksWriteToOneOfItsPlacesFailsAtOnce_failsOnlyAfterItsOtherPlacesAreWritten', async () => {
    const root = join(dir, 'mat');
    const chunks = new FsChunkStore(root, { offload: false });
    const manifests = new FsManifestStore(root);
    const m = new Materialiser({ root, chunks, manifests, trust: new Map(), roots: new LiveRoots(), syncInline: true });
    const plain = pages('xx');
    const digest = createHash('sha256').update(plain).digest();
    // One chunk, three places: memory and disk_0 both begin with it, and disk_0 holds it twice.
    const ref = (index: number) => ({ index: BigInt(index), digest, size: plain.length, storedSize: plain.length });
    const manifest = create(SnapshotManifestSchema, {
      snapshotId: 'sn-a',
      chunkSize: plain.length,
      artifacts: [
        { kind: ArtifactKind.MEMORY, name: 'memory', size: BigInt(plain.length), chunks: [ref(0)] },
        { kind: ArtifactKind.DISK_LAYER, name: 'disk_0', size: BigInt(2 * plain.length), chunks: [ref(0), ref(1)] },
      ],
    });
    const w = await firstWriteFailsAtOnce();
    let settledAt: number | undefined;
    await expect(
      m.materialiseWhile('sn-a', manifest, async (sink) => {
        await sink(digest.toString('hex'), plain).finally(() => (settledAt = w.fired()));
      }),
    ).rejects.toThrow(/injected/);
    expect([w.calls(), settledAt]).toEqual([3, 3]);
    // Nothing was left behind in images/ (the build's temp directory is removed).
    expect(() => readFileSync(join(root, 'images', 'sn-a', 'memory'))).toThrow(/ENOENT/);
  });
});
