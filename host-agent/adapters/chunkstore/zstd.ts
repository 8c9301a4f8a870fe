// zstd through zstd-napi's native binding, used directly: the package's wrapper `decompress`
// allocates whatever size a frame header claims, while a chunk's plain size is known.
// Compression runs on the verify workers (verify-pool.ts compressOffloaded); the workers
// decode with the same `zstdDecodeExact` (its source text) as this thread.
import { createRequire } from 'node:module';
import type * as ZstdBinding from 'zstd-napi/binding.js';
import { DigestMismatchError } from '../../domain/transfer-errors.ts';

export const ZSTD_BINDING_PATH = createRequire(import.meta.url).resolve('zstd-napi/binding');
/** Level 1: docs/adr/0007-chunk-format.md. */
export const ZSTD_LEVEL = 1;
const zstd = createRequire(import.meta.url)(ZSTD_BINDING_PATH) as typeof ZstdBinding;
let dctx: ZstdBinding.DCtx | undefined;

/**
 * Decodes one frame of exactly `size` plain bytes into `out` (a buffer of exactly `size`
 * bytes) or, without it, into a new buffer; returns why not (a string) when the frame
 * declares another size, does not decode, or decodes to another size.
 *
 * Self-contained on purpose: the verify worker runs this function's source text, so it uses
 * nothing but its arguments.
 */
export function zstdDecodeExact(binding: Pick<typeof ZstdBinding, 'getFrameContentSize'>, ctx: Pick<ZstdBinding.DCtx, 'decompress'>, data: Uint8Array, size: number, out?: Buffer): Buffer | string {
  let declared: number | null = null;
  try {
    declared = binding.getFrameContentSize(data);
  } catch {
    // not a frame header
  }
  if (declared !== size) return 'zstd data does not decode (frame content size)';
  const plain = out !== undefined && out.length === size ? out : Buffer.allocUnsafe(size);
  let n: number;
  try {
    n = ctx.decompress(plain, data);
  } catch {
    return 'zstd data does not decode';
  }
  return n === size ? plain : `decoded ${n} bytes, expected ${size}`;
}

/** Decodes one frame of exactly `size` plain bytes, or throws DigestMismatchError. */
export function zstdDecompressSync(digest: string, data: Uint8Array, size: number): Buffer {
  const r = zstdDecodeExact(zstd, (dctx ??= new zstd.DCtx()), data, size);
  if (typeof r === 'string') throw new DigestMismatchError(digest, r);
  return r;
}
