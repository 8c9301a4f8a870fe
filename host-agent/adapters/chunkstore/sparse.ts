// Writing a chunk's plain bytes into a sparse image file page by page: all-zero 4 KiB pages
// are left as holes. The bench image's non-zero chunks are a third zero pages (guest pages
// are scattered through RAM; ADR 0008, "Zero pages inside chunks stay holes"), and a hole
// costs the receiver neither a page-cache page nor a disk block, while it reads back as
// zeros exactly like a written zero page. Only for files whose target range is still a
// hole (a new, ftruncated image), which is the only way images are built.
import { write as fsWrite } from 'node:fs';

export const PAGE = 4096;

/** One page of zeros, compared against (never written). */
export const ZERO_PAGE = Buffer.alloc(PAGE);

/**
 * The byte ranges of `buf` that hold a non-zero page, as flat [start, end) pairs; adjacent
 * non-zero pages make one range. A last partial page counts as a page.
 *
 * Self-contained on purpose: the chunk verify worker runs this function's source text
 * (verify-pool.ts), so it uses nothing but its arguments.
 */
export function nonZeroRuns(buf: Uint8Array, zeroPage: Buffer, page: number): number[] {
  const runs: number[] = [];
  let start = -1;
  for (let p = 0; p < buf.length; p += page) {
    const end = Math.min(p + page, buf.length);
    const zero = zeroPage.compare(buf, p, end, 0, end - p) === 0;
    if (!zero && start < 0) start = p;
    else if (zero && start >= 0) {
      runs.push(start, p);
      start = -1;
    }
  }
  if (start >= 0) runs.push(start, buf.length);
  return runs;
}

function pwriteAll(fd: number, buf: Uint8Array, off: number, len: number, pos: number): Promise<void> {
  return new Promise((resolve, reject) =>
    fsWrite(fd, buf, off, len, pos, (e, n) => (e ? reject(e) : n !== len ? reject(new Error(`short image write: ${n} of ${len} bytes`)) : resolve())),
  );
}

/**
 * Awaits every promise, then throws the first failure (in order). Promise.all would reject at
 * the first failure while the other writes are still queued on the libuv pool: the caller may
 * then close the file, and a write still to come lands on whatever file next gets that
 * descriptor number.
 */
export async function allSettledOrThrow(ps: Iterable<Promise<unknown>>): Promise<void> {
  const failed = (await Promise.allSettled(ps)).find((r): r is PromiseRejectedResult => r.status === 'rejected');
  if (failed) throw failed.reason;
}

/**
 * Writes `buf` at `pos` of `fd` (a hole so far), leaving its zero pages as holes. Settles
 * only once every write has: the descriptor is raw, so none may outlive the call.
 */
export async function writeSparse(fd: number, buf: Uint8Array, pos: number): Promise<void> {
  const runs = nonZeroRuns(buf, ZERO_PAGE, PAGE);
  const writes: Array<Promise<void>> = [];
  for (let i = 0; i < runs.length; i += 2) writes.push(pwriteAll(fd, buf, runs[i]!, runs[i + 1]! - runs[i]!, pos + runs[i]!));
  await allSettledOrThrow(writes);
}
