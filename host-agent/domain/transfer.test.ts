// fetchChunks with in-memory sources (fakes of ChunkSource, our interface) into a real
// FsChunkStore in a temporary directory: what a receiver does when its own side fails.
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { encodeChunk } from '../adapters/chunkstore/codec.ts';
import { FsChunkStore } from '../adapters/chunkstore/fs-store.ts';
import type { DigestHex, EncodedChunk } from './snapshot-store.ts';
import { fetchChunks, type ChunkEvent, type ChunkSink, type ChunkSource } from './transfer.ts';

let tmp: string;
beforeAll(() => {
  tmp = mkdtempSync(join(tmpdir(), 'ff-transfer-'));
});
afterAll(() => rmSync(tmp, { recursive: true, force: true }));

/** A source that answers every want at once from `chunks` (a fresh copy each time: a store may detach the bytes it is given). */
function memorySource(id: string, chunks: ReadonlyMap<DigestHex, EncodedChunk>): ChunkSource {
  return {
    id,
    getManifest: () => Promise.reject(new Error('not used')),
    open() {
      const queue: ChunkEvent[] = [];
      let wake: (() => void) | undefined;
      let closed = false;
      return {
        want(digests) {
          for (const d of digests) {
            const c = chunks.get(d);
            queue.push(c ? { kind: 'chunk', chunk: { ...c, data: Uint8Array.from(c.data) } } : { kind: 'missing', digest: d });
          }
          wake?.();
        },
        events: {
          async *[Symbol.asyncIterator]() {
            while (!closed) {
              const ev = queue.shift();
              if (ev) yield ev;
              else await new Promise<void>((r) => (wake = r));
            }
          },
        },
        close() {
          closed = true;
          wake?.();
        },
      };
    },
  };
}

/** Three 64 KiB chunks of different content, by digest. */
async function threeChunks(): Promise<Map<DigestHex, EncodedChunk>> {
  const chunks = new Map<DigestHex, EncodedChunk>();
  for (let i = 1; i <= 3; i++) {
    const c = await encodeChunk(Buffer.alloc(64 * 1024, i));
    chunks.set(c.digest, c);
  }
  return chunks;
}

describe('fetchChunks', () => {
  it('chunkWhoseLocalWriteFailsOnce_isFetchedAgain_andTheFetchSucceeds', async () => {
    const chunks = await threeChunks();
    const [, second] = [...chunks.keys()];
    const delivered: DigestHex[] = [];
    let failed = false;
    // The image write of the second chunk fails once (EIO, a full disk): a local failure, not the peer's.
    const sink: ChunkSink = async (digest) => {
      if (digest === second && !failed) {
        failed = true;
        throw new Error('EIO: i/o error, write');
      }
      delivered.push(digest);
    };
    const store = new FsChunkStore(join(tmp, 'store'));
    const report = await fetchChunks(chunks.keys(), [memorySource('peer-1', chunks)], store, { onChunk: sink, backoffMs: 1, streamsPerSource: 1 });
    expect(failed).toBe(true);
    expect(report.fetched).toBe(3);
    expect([...delivered].sort()).toEqual([...chunks.keys()].sort());
    expect(await store.missing(chunks.keys())).toEqual([]);
  });

  it('chunkSentWithAnotherSizeThanTheManifests_isRejectedBeforeTheStoreSeesIt_andFetchedFromAnotherSource', async () => {
    const chunks = await threeChunks();
    // Same bytes, but each claims 4 GiB of content: what a decode would allocate.
    const lying = new Map([...chunks].map(([d, c]) => [d, { ...c, size: 0xffffffff }] as const));
    const inner = new FsChunkStore(join(tmp, 'store-sizes'));
    const seen: number[] = [];
    const store = new Proxy(inner, {
      get: (target, key) => {
        const v = Reflect.get(target, key) as unknown;
        if (key !== 'accept' && key !== 'acceptInto') return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v;
        return (c: EncodedChunk, ...rest: unknown[]) => {
          seen.push(c.size);
          return (v as (...a: unknown[]) => unknown).call(target, c, ...rest);
        };
      },
    });
    const sizes = new Map([...chunks].map(([d, c]) => [d, c.size] as const));
    const report = await fetchChunks(chunks.keys(), [memorySource('liar', lying), memorySource('honest', chunks)], store, { sizes, backoffMs: 1, streamsPerSource: 1 });
    expect(report.fetched).toBe(3);
    expect(report.sources.find((s) => s.id === 'liar')?.rejected).toBeGreaterThan(0);
    expect(seen.every((n) => n === 64 * 1024)).toBe(true);
    expect(await inner.missing(chunks.keys())).toEqual([]);
  });

  it('sourceThatGoesSilentWithChunksAsked_isGivenUpOnAfterTheIdleTime_andAnotherSourceSuppliesThem', async () => {
    const chunks = await threeChunks();
    // Takes every want and never answers: a peer cut off with the stream still open.
    const silent: ChunkSource = {
      id: 'silent',
      getManifest: () => Promise.reject(new Error('not used')),
      open() {
        let stop: (() => void) | undefined;
        return {
          want() {},
          events: {
            [Symbol.asyncIterator]: () => ({ next: () => new Promise<IteratorResult<ChunkEvent>>((r) => (stop = () => r({ value: undefined, done: true }))) }),
          },
          close() {
            stop?.();
          },
        };
      },
    };
    const store = new FsChunkStore(join(tmp, 'store-silent'));
    const report = await fetchChunks(chunks.keys(), [silent, memorySource('honest', chunks)], store, { idleMs: 200, backoffMs: 1, streamsPerSource: 1 });
    expect(report.fetched).toBe(3);
    expect(report.sources.find((s) => s.id === 'silent')?.lastError).toMatch(/sent nothing for 200 ms/);
    expect(await store.missing(chunks.keys())).toEqual([]);
  }, 10_000);
});
