// zstd through zstd-napi's native binding, used directly: the package's wrapper `decompress`
// allocates whatever size a frame header claims, while a chunk's plain size is known. The
// verify workers (verify-pool.ts) load the same binding file and follow the same rules.
import { createRequire } from 'node:module';
import type * as ZstdBinding from 'zstd-napi/binding.js';
import { DigestMismatchError } from '../../domain/transfer-errors.ts';

export const ZSTD_BINDING_PATH = createRequire(import.meta.url).resolve('zstd-napi/binding');
/** Level 1: docs/adr/0007-chunk-format.md. */
export const ZSTD_LEVEL = 1;
const zstd = createRequire(import.meta.url)(ZSTD_BINDING_PATH) as typeof ZstdBinding;
let cctx: ZstdBinding.CCtx | undefined;
let dctx: ZstdBinding.DCtx | undefined;
let scratch: Buffer | undefined;

/** Compresses on this thread (~0.4 ms per 256 KiB chunk here); returns a buffer of its own. */
export function zstdCompressSync(plain: Uint8Array): Buffer {
  cctx ??= new zstd.CCtx();
  const bound = zstd.compressBound(plain.length);
  if (!scratch || scratch.length < bound) scratch = Buffer.allocUnsafe(bound);
  const n = cctx.compress(scratch, plain, ZSTD_LEVEL);
  return Buffer.from(scratch.subarray(0, n));
}

/** Decodes one frame of exactly `size` plain bytes, or throws DigestMismatchError. */
export function zstdDecompressSync(digest: string, data: Uint8Array, size: number): Buffer {
  let declared: number | null;
  try {
    declared = zstd.getFrameContentSize(data);
  } catch {
    declared = null;
  }
  if (declared !== size) throw new DigestMismatchError(digest, 'zstd data does not decode (frame content size)');
  dctx ??= new zstd.DCtx();
  const plain = Buffer.allocUnsafe(size);
  let n: number;
  try {
    n = dctx.decompress(plain, data);
  } catch (e) {
    throw new DigestMismatchError(digest, 'zstd data does not decode', { cause: e });
  }
  if (n !== size) throw new DigestMismatchError(digest, `decoded ${n} bytes, expected ${size}`);
  return plain;
}
