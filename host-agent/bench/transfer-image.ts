// Realistic synthetic guest images for the transfer benchmark and tests.
//
// A booted 256 MiB guest's memory file is mostly zero (untouched pages) with kernel text,
// module text and page-cache pages scattered through it, plus whatever the workload wrote.
// We build: a sparse file of `memBytes`, with ~`kernelBytes` of kernel-like 4 KiB pages taken
// from /boot/vmlinuz-* and /usr/lib/modules (runs of 1..64 pages at random page offsets),
// `randomBytes` of random data and `textBytes` of text (workload data: half compresses).
// A disk layer is built from real binaries under /usr/lib (sparse, 4 KiB aligned).
// Everything is seeded so a run can be repeated.
import { closeSync, fstatSync, ftruncateSync, openSync, readdirSync, readFileSync, readSync, statSync, writeSync, fsyncSync } from 'node:fs';
import { join } from 'node:path';
import { createHash } from 'node:crypto';

const PAGE = 4096;

/** xorshift32: deterministic, fast. */
export function rng(seed: number): () => number {
  let x = seed >>> 0 || 0x9e3779b9;
  return () => {
    x ^= x << 13;
    x >>>= 0;
    x ^= x >>> 17;
    x ^= x << 5;
    x >>>= 0;
    return x / 0x1_0000_0000;
  };
}

/** Pseudo-random bytes (incompressible) from a seed, via sha256 in counter mode. */
export function randomBytesSeeded(n: number, seed: number): Buffer {
  const out = Buffer.allocUnsafe(n);
  let off = 0;
  let ctr = 0;
  const base = Buffer.alloc(8);
  base.writeUInt32LE(seed >>> 0, 0);
  while (off < n) {
    base.writeUInt32LE(ctr++, 4);
    const h = createHash('sha512').update(base).digest();
    off += h.copy(out, off);
  }
  return out;
}

const WORDS = (
  'the of and to in is that for it as with was on be by this are from at or an which have not were but all ' +
  'sandbox agent fork snapshot memory page chunk kernel process thread error return value function const let ' +
  'import export class interface async await promise buffer string number json http request response token'
).split(' ');

/** Log/JSON/source-like text: compresses about 3-4x with lz4. */
export function textBytes(n: number, seed: number): Buffer {
  const r = rng(seed);
  const parts: string[] = [];
  let len = 0;
  let line = 0;
  while (len < n) {
    const words: string[] = [];
    const k = 4 + Math.floor(r() * 12);
    for (let i = 0; i < k; i++) words.push(WORDS[Math.floor(r() * WORDS.length)] ?? 'x');
    const s = `${new Date(1_700_000_000_000 + line * 137).toISOString()} level=${r() < 0.9 ? 'info' : 'warn'} id=${Math.floor(r() * 1e9).toString(16)} msg="${words.join(' ')}"\n`;
    parts.push(s);
    len += s.length;
    line++;
  }
  return Buffer.from(parts.join('')).subarray(0, n);
}

function listFiles(dir: string, out: string[], limit: number): void {
  if (out.length >= limit) return;
  let entries: string[];
  try {
    entries = readdirSync(dir);
  } catch {
    return;
  }
  for (const e of entries.sort()) {
    const p = join(dir, e);
    let st;
    try {
      st = statSync(p);
    } catch {
      continue;
    }
    if (st.isDirectory()) listFiles(p, out, limit);
    else if (st.isFile() && st.size > 0) out.push(p);
    if (out.length >= limit) return;
  }
}

/** `n` bytes of real kernel and module text (uncompressed .ko files and the bzImage). */
export function kernelLikeBytes(n: number): Buffer {
  const files: string[] = [];
  for (const f of readdirSync('/boot')) if (f.startsWith('vmlinuz')) files.push(join('/boot', f));
  for (const m of readdirSync('/usr/lib/modules')) listFiles(join('/usr/lib/modules', m, 'kernel'), files, 20_000);
  const out = Buffer.alloc(n);
  let off = 0;
  for (const f of files) {
    if (off >= n) break;
    if (!f.endsWith('.ko') && !f.includes('vmlinuz')) continue;
    off += readFileSync(f).copy(out, off);
  }
  return out;
}

export interface ImageSpec {
  memBytes: number;
  kernelBytes: number;
  randomBytes: number;
  textBytes: number;
  seed: number;
}

export const DEFAULT_IMAGE: ImageSpec = {
  memBytes: 256 * 1024 * 1024,
  kernelBytes: 40 * 1024 * 1024,
  randomBytes: 32 * 1024 * 1024,
  textBytes: 32 * 1024 * 1024,
  seed: 42,
};

function writeAt(fd: number, buf: Buffer, pos: number): void {
  let done = 0;
  while (done < buf.length) done += writeSync(fd, buf, done, buf.length - done, pos + done);
}

/**
 * Writes a synthetic memory image to `path` (sparse). Kernel pages are scattered in runs;
 * the workload data sits in runs of 16..256 pages (heap-like) at random page offsets.
 */
export function writeMemoryImage(path: string, spec: ImageSpec = DEFAULT_IMAGE): void {
  const r = rng(spec.seed);
  const pages = spec.memBytes / PAGE;
  const fd = openSync(path, 'w');
  try {
    ftruncateSync(fd, spec.memBytes);
    // Low memory: kernel image is contiguous in a real guest (first 16 MiB region).
    const kernel = kernelLikeBytes(spec.kernelBytes);
    const kernelContig = Math.min(kernel.length, 12 * 1024 * 1024);
    writeAt(fd, kernel.subarray(0, kernelContig), 2 * 1024 * 1024);
    // The rest (modules, slab, page cache) scattered in runs of 1..64 pages.
    let off = kernelContig;
    while (off < kernel.length) {
      const run = Math.min((1 + Math.floor(r() * 64)) * PAGE, kernel.length - off);
      const page = Math.floor(r() * (pages - 64));
      writeAt(fd, kernel.subarray(off, off + run), page * PAGE);
      off += run;
    }
    // Workload data: random and text in runs of 16..256 pages.
    for (const [kind, total] of [['random', spec.randomBytes], ['text', spec.textBytes]] as const) {
      const data = kind === 'random' ? randomBytesSeeded(total, spec.seed + 1) : textBytes(total, spec.seed + 2);
      let o = 0;
      while (o < data.length) {
        const run = Math.min((16 + Math.floor(r() * 240)) * PAGE, data.length - o);
        const page = Math.floor(r() * (pages - 256));
        writeAt(fd, data.subarray(o, o + run), page * PAGE);
        o += run;
      }
    }
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
}

/**
 * A child of `parentPath` that changed `changedBytes`: writes runs of 16..256 pages at random
 * page offsets, half random and half text (the workload's new data). The runs may overlap (seed
 * 7 on the 256 MiB image: 16 MiB written, 15.83 MiB of distinct pages), so what the child
 * changed is measured: returns the bytes of the 4 KiB pages that differ from the parent's.
 */
export function writeChildImage(parentPath: string, childPath: string, changedBytes: number, seed: number): number {
  const buf = readFileSync(parentPath);
  const r = rng(seed);
  const pages = buf.length / PAGE;
  const data = Buffer.concat([randomBytesSeeded(changedBytes / 2, seed + 7), textBytes(changedBytes / 2, seed + 8)]);
  /** Pages some run wrote: only these can differ from the parent. */
  const written = new Uint8Array(Math.ceil(pages));
  let o = 0;
  while (o < data.length) {
    const run = Math.min((16 + Math.floor(r() * 240)) * PAGE, data.length - o);
    const page = Math.floor(r() * (pages - 256));
    data.copy(buf, page * PAGE, o, o + run);
    written.fill(1, page, page + Math.ceil(run / PAGE));
    o += run;
  }
  const fd = openSync(childPath, 'w');
  let changed = 0;
  const parent = openSync(parentPath, 'r');
  try {
    ftruncateSync(fd, buf.length);
    // Keep it sparse: write only non-zero pages.
    const zero = Buffer.alloc(PAGE);
    const before = Buffer.alloc(PAGE);
    for (let p = 0; p < pages; p++) {
      const page = buf.subarray(p * PAGE, (p + 1) * PAGE);
      if (!page.equals(zero)) writeAt(fd, page, p * PAGE);
      if (written[p] === 1) {
        before.fill(0);
        readFull(parent, before, page.length, p * PAGE);
        if (!page.equals(before.subarray(0, page.length))) changed += page.length;
      }
    }
    fsyncSync(fd);
  } finally {
    closeSync(fd);
    closeSync(parent);
  }
  return changed;
}

/**
 * Bytes of the 4 KiB pages at which `a` and `b` differ (past the end of the shorter file, a
 * page counts as changed when the longer one's is not all zeros: a sparse image's end reads
 * as zeros). For the diff benchmark: what a child snapshot's memory image changed against its
 * parent's.
 */
export function changedPageBytes(a: string, b: string): number {
  const BLOCK = 256 * PAGE;
  const fa = openSync(a, 'r');
  const fb = openSync(b, 'r');
  try {
    const size = Math.max(fstatSync(fa).size, fstatSync(fb).size);
    const ba = Buffer.alloc(BLOCK);
    const bb = Buffer.alloc(BLOCK);
    let changed = 0;
    for (let off = 0; off < size; off += BLOCK) {
      const len = Math.min(BLOCK, size - off);
      ba.fill(0);
      bb.fill(0);
      readFull(fa, ba, len, off);
      readFull(fb, bb, len, off);
      for (let p = 0; p < len; p += PAGE) {
        const end = Math.min(p + PAGE, len);
        if (!ba.subarray(p, end).equals(bb.subarray(p, end))) changed += end - p;
      }
    }
    return changed;
  } finally {
    closeSync(fa);
    closeSync(fb);
  }
}

/** Reads up to `len` bytes at `pos` (fewer at the end of the file; the rest of `buf` is left as it was). */
function readFull(fd: number, buf: Buffer, len: number, pos: number): void {
  let done = 0;
  while (done < len) {
    const n = readSync(fd, buf, done, len - done, pos + done);
    if (n === 0) return;
    done += n;
  }
}

/** A frozen disk layer: real binaries from /usr/lib laid out 4 KiB aligned, sparse to `sizeBytes`. */
export function writeDiskLayer(path: string, sizeBytes: number, dataBytes: number): void {
  const files: string[] = [];
  listFiles('/usr/lib/x86_64-linux-gnu', files, 5000);
  const fd = openSync(path, 'w');
  try {
    ftruncateSync(fd, sizeBytes);
    let off = 0;
    for (const f of files) {
      if (off >= dataBytes) break;
      const b = readFileSync(f).subarray(0, dataBytes - off);
      writeAt(fd, b, off);
      off += Math.ceil(b.length / PAGE) * PAGE;
    }
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
}
