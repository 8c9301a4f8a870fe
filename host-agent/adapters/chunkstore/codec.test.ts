import { describe, expect, it } from 'vitest';
import fc from 'fast-check';
import { Codec } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { compressSync as lz4Compress } from 'lz4-napi';
import { decodeChunk, encodeChunk, isZero, sha256Hex } from './codec.ts';
import { DigestMismatchError } from '../../domain/transfer-errors.ts';
import { randomBytesSeeded, textBytes } from '../../bench/transfer-image.ts';

describe('chunk codec', () => {
  it('encodeChunk_roundTripsAnyContent (property)', async () => {
    await fc.assert(
      fc.asyncProperty(fc.uint8Array({ maxLength: 70_000 }), async (bytes) => {
        const plain = Buffer.from(bytes);
        const enc = await encodeChunk(plain);
        expect(enc.digest).toBe(sha256Hex(plain));
        expect((await decodeChunk(enc)).equals(plain)).toBe(true);
      }),
      { numRuns: 60 },
    );
  });

  it('encodeChunk_whenIncompressible_storesUncompressed', async () => {
    expect((await encodeChunk(randomBytesSeeded(262144, 1))).codec).toBe(Codec.NONE);
    const text = await encodeChunk(textBytes(262144, 1));
    expect(text.codec).toBe(Codec.ZSTD);
    expect(text.data.length).toBeLessThan(262144 / 2);
  });

  it('decodeChunk_ofAnLz4ChunkFromAnOlderStore_returnsThePlainBytes', async () => {
    const plain = textBytes(262144, 5);
    const chunk = { digest: sha256Hex(plain), codec: Codec.LZ4, size: plain.length, data: lz4Compress(plain) };
    expect((await decodeChunk(chunk)).equals(plain)).toBe(true);
  });

  it('decodeChunk_whenZstdFrameClaimsAnotherSize_throwsDigestMismatchWithoutDecoding', async () => {
    const enc = await encodeChunk(textBytes(262144, 6));
    // The same data declared as a smaller chunk: the frame's content size no longer matches.
    await expect(decodeChunk({ ...enc, size: 262144 - 4096 })).rejects.toThrow(/frame content size/);
    // Much smaller: more data than any encoding of that size takes, refused before zstd looks.
    await expect(decodeChunk({ ...enc, size: 4096 })).rejects.toThrow(/at most/);
    // A frame that holds more than the chunk's size cannot overrun the output buffer either.
    const big = await encodeChunk(textBytes(1 << 20, 7));
    await expect(decodeChunk({ ...big, size: 262144 })).rejects.toBeInstanceOf(DigestMismatchError);
  });

  it('decodeChunk_ofAZstdFramePaddedWithSkippableFrames_throwsDigestMismatch', async () => {
    const plain = textBytes(262144, 9);
    const enc = await encodeChunk(plain);
    // Skippable frames (magic 0x184D2A50, u32 LE length) after the frame decode to nothing:
    // same plain bytes, same digest, but far more data than the chunk's size allows.
    const skippable = Buffer.alloc(8 + (1 << 20));
    skippable.writeUInt32LE(0x184d2a50, 0);
    skippable.writeUInt32LE(1 << 20, 4);
    await expect(decodeChunk({ ...enc, data: Buffer.concat([enc.data, skippable]) })).rejects.toBeInstanceOf(DigestMismatchError);
    // Uncompressed data is exactly the chunk's size; lz4 at its worst fits the bound too.
    const random = randomBytesSeeded(262144, 10);
    expect((await decodeChunk({ digest: sha256Hex(random), codec: Codec.LZ4, size: random.length, data: lz4Compress(random) })).equals(random)).toBe(true);
  });

  it('decodeChunk_whenBytesFlipped_throwsDigestMismatch', async () => {
    for (const plain of [randomBytesSeeded(4096, 2), textBytes(65536, 3)]) {
      const enc = await encodeChunk(plain);
      const data = Buffer.from(enc.data);
      data[data.length >> 1] = (data[data.length >> 1] ?? 0) ^ 0x55;
      await expect(decodeChunk({ ...enc, data })).rejects.toBeInstanceOf(DigestMismatchError);
    }
  });

  it('decodeChunk_whenLz4LengthPrefixWrong_throwsDigestMismatchWithoutDecoding', async () => {
    const plain = textBytes(262144, 4);
    const enc = { digest: sha256Hex(plain), codec: Codec.LZ4, size: plain.length, data: lz4Compress(plain) };
    const t0 = performance.now();
    await expect(decodeChunk({ ...enc, data: Buffer.alloc(enc.data.length, 0xff) })).rejects.toBeInstanceOf(DigestMismatchError);
    expect(performance.now() - t0).toBeLessThan(1000); // no 4 GiB allocation attempt
  });

  it('isZero_detectsZeroBuffers', () => {
    expect(isZero(Buffer.alloc(262144))).toBe(true);
    const b = Buffer.alloc(262144);
    b[262143] = 1;
    expect(isZero(b)).toBe(false);
  });

  it('isZero_ofTailChunksOfEveryLength_isRight_andKeepsOneZeroBufferNotOneForEachLength', () => {
    // The last chunk of a file of any size (a device state's) is of any length: one zero
    // buffer per length held ~128 KiB for each, for the agent's life (~256 MB for 2,000).
    const chunk = Buffer.alloc(262144);
    const before = process.memoryUsage().arrayBuffers;
    for (let i = 1; i <= 2000; i++) expect(isZero(chunk.subarray(0, 262144 - i * 97))).toBe(true);
    expect(process.memoryUsage().arrayBuffers - before).toBeLessThan(16 << 20);
    expect(isZero(Buffer.from([0, 0, 0]))).toBe(true);
    expect(isZero(Buffer.from([0, 0, 1]))).toBe(false);
    expect(isZero(Buffer.alloc(0))).toBe(true);
  });
});
