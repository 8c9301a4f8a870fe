// The chunk file format (ADR 0007): a 16-byte header, then the encoded data.
//   u32 LE magic "FFC1" | u8 codec | 3 bytes zero | u32 LE plain size | u32 LE data length
// Files written with O_DIRECT (received chunks, verify-pool.ts) are zero-padded after the
// data to a multiple of DIRECT_ALIGN; the data length in the header says where data ends.
import type { Codec } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';

const MAGIC = 0x31434646; // "FFC1" little-endian
export const HEADER = 16;
/**
 * O_DIRECT's size and memory alignment: 4096 suits 512-byte and 4 KiB-sector disks alike
 * (a chunk file then takes ~2 KiB more disk on average, nothing more on the wire).
 */
export const DIRECT_ALIGN = 4096;

/**
 * The most stored (encoded) bytes a chunk of `size` plain bytes can take: zstd's worst case
 * (ZSTD_compressBound: size + size/256 + at most 64) and lz4's (size + size/255 + 16, after
 * lz4-napi's 4-byte length prefix) both fit; uncompressed data is `size` itself. Received data
 * longer than this is rejected unread (a DigestMismatchError): zstd skips skippable frames, so a
 * valid frame padded with megabytes of them decodes to the right bytes and digest, and would
 * be stored and served on as it came.
 */
export function maxStoredSize(size: number): number {
  return size + (size >>> 7) + 128;
}

/** The header of a chunk file holding `c` (a buffer of its own: it may be sent to a worker). */
export function encodeHeader(c: { readonly codec: Codec; readonly size: number; readonly data: Uint8Array }): Buffer {
  const h = Buffer.alloc(HEADER);
  h.writeUInt32LE(MAGIC, 0);
  h.writeUInt8(c.codec, 4);
  h.writeUInt32LE(c.size, 8);
  h.writeUInt32LE(c.data.length, 12);
  return h;
}

export interface ParsedChunkFile {
  readonly codec: Codec;
  readonly size: number;
  /** A view of `buf` (keeps whatever headroom `buf` has before it). */
  readonly data: Buffer;
}

/** The header and data of a chunk file's bytes, or undefined when they are not a whole chunk file (truncated, foreign). */
export function parseChunkFile(buf: Buffer): ParsedChunkFile | undefined {
  if (buf.length < HEADER || buf.readUInt32LE(0) !== MAGIC) return undefined;
  const dataLen = buf.readUInt32LE(12);
  const padding = buf.length - HEADER - dataLen;
  if (padding < 0 || padding >= DIRECT_ALIGN) return undefined;
  return { codec: buf.readUInt8(4) as Codec, size: buf.readUInt32LE(8), data: buf.subarray(HEADER, HEADER + dataLen) };
}
