// Chunk encoding: zstd level 1 (zstd-napi's native binding), or none when it doesn't help.
// Chosen by measurement: docs/adr/0007-chunk-format.md. Chunks stored as lz4 (lz4-napi) by
// earlier versions still decode.
import { createHash } from 'node:crypto';
import { uncompress as lz4Uncompress } from 'lz4-napi';
import { Codec } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import type { EncodedChunk } from '../../domain/snapshot-store.ts';
import { DigestMismatchError } from '../../domain/transfer-errors.ts';
import { compressOffloaded } from './verify-pool.ts';
import { zstdDecompressSync } from './zstd.ts';
import { maxStoredSize } from './chunk-file.ts';

export const DEFAULT_CHUNK_SIZE = 256 * 1024;

export function sha256Hex(data: Uint8Array): string {
  return createHash('sha256').update(data).digest('hex');
}

/**
 * True when every byte is zero (memcmp against a shared zero buffer). One buffer, of the
 * largest length asked about, not one per length: the last chunk of a file (a device state,
 * whose size varies) may have any length, and one buffer each grew without bound.
 */
let zeros = Buffer.alloc(0);
export function isZero(buf: Buffer): boolean {
  if (buf.length > zeros.length) zeros = Buffer.alloc(buf.length);
  return buf.equals(zeros.subarray(0, buf.length));
}

/**
 * Compresses with zstd on the chunk worker pool (so both cores work and the event loop does
 * not stall); stores the chunk uncompressed (CODEC_NONE) when compression saves less than 1/16.
 */
export async function encodeChunk(plain: Buffer, digest?: string): Promise<EncodedChunk> {
  const d = digest ?? sha256Hex(plain);
  const c = await compressOffloaded(plain);
  if (c.length < plain.length - (plain.length >> 4)) return { digest: d, codec: Codec.ZSTD, size: plain.length, data: c };
  return { digest: d, codec: Codec.NONE, size: plain.length, data: plain };
}

/** Throws DigestMismatchError when `chunk.data` is longer than any encoding of its plain size (chunk-file.ts maxStoredSize). */
export function checkStoredSize(chunk: Pick<EncodedChunk, 'digest' | 'size' | 'data'>): void {
  const max = maxStoredSize(chunk.size);
  if (chunk.data.length > max) throw new DigestMismatchError(chunk.digest, `${chunk.data.length} bytes of data for ${chunk.size} plain bytes (at most ${max})`);
}

/**
 * Decodes and checks length and digest. Throws DigestMismatchError. Given `known`, bytes that
 * hash to the digest, compares with them instead of hashing.
 */
export async function decodeChunk(chunk: EncodedChunk, known?: Buffer): Promise<Buffer> {
  checkStoredSize(chunk);
  let plain: Buffer;
  switch (chunk.codec) {
    case Codec.NONE:
      plain = Buffer.from(chunk.data.buffer, chunk.data.byteOffset, chunk.data.byteLength);
      break;
    case Codec.LZ4:
      // The block starts with the plain length (u32 LE, lz4-napi's format): check it first,
      // or a garbage prefix from a peer makes lz4 allocate up to 4 GiB before failing.
      if (chunk.data.length < 4 || Buffer.from(chunk.data.buffer, chunk.data.byteOffset, 4).readUInt32LE(0) !== chunk.size) {
        throw new DigestMismatchError(chunk.digest, 'lz4 data does not decode (length prefix)');
      }
      try {
        plain = await lz4Uncompress(chunk.data);
      } catch (e) {
        throw new DigestMismatchError(chunk.digest, 'lz4 data does not decode', { cause: e });
      }
      break;
    case Codec.ZSTD:
      plain = zstdDecompressSync(chunk.digest, chunk.data, chunk.size);
      break;
    default:
      throw new DigestMismatchError(chunk.digest, `unsupported codec ${chunk.codec}`);
  }
  if (plain.length !== chunk.size) throw new DigestMismatchError(chunk.digest, `decoded ${plain.length} bytes, expected ${chunk.size}`);
  if (known) {
    if (!plain.equals(known)) throw new DigestMismatchError(chunk.digest, 'content differs from the expected bytes');
    return plain;
  }
  const got = sha256Hex(plain);
  if (got !== chunk.digest) throw new DigestMismatchError(chunk.digest, `content hashes to ${got.slice(0, 16)}`);
  return plain;
}
