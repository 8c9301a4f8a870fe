// Receiving a chunk off the main thread: decode (zstd, or lz4 from older stores), SHA-256,
// compare, then write the chunk file (temp, then link(2) into place and unlink of the temp
// name: never over a file there, see FsChunkStore.place) on a small pool of worker threads.
// The agent's event loop then only parses gRPC frames and schedules; the per-chunk CPU (hash,
// decode, five fs syscalls: open, write, close, link, unlink) runs on the second core. The
// same workers zstd-compress chunks for ingest (`compressOffloaded`). See
// docs/adr/0008-peer-chunk-transfer.md (issue 4 targets). With
// `places` (FsChunkStore.acceptInto: a fetch that materialises an image) the worker also
// writes the plain bytes into the image, asynchronously on the libuv pool, and they never
// come back to the main thread (ADR 0008, "Warm receiver").
//
// Zero-copy hand-off: the chunk's ArrayBuffer is *transferred* to the worker (and the plain
// bytes transferred back), so only buffers that belong to this chunk alone may go this way.
// A producer says so with `markOwned(data)` (buffers.ts; the peer client does it for each received
// message: grpc-js allocates one buffer per message). Anything else is verified inline by
// the caller, as before. After a transfer the caller's `data` view is detached (length 0).
//
// The guarantees do not change: the digest (and that the data is no longer than its plain
// size allows: chunk-file.ts maxStoredSize) is checked before the temp file is written, a
// mismatch is a DigestMismatchError (the caller rejects the chunk and fetches it elsewhere),
// and a kill -9 leaves at most a temp file (the store removes those when it opens).
import { Worker } from 'node:worker_threads';
import { createRequire } from 'node:module';
import { availableParallelism } from 'node:os';
import { Codec } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { DigestMismatchError } from '../../domain/transfer-errors.ts';
import { PAGE, nonZeroRuns } from './sparse.ts';
import { DIRECT_ALIGN, encodeHeader, maxStoredSize } from './chunk-file.ts';
import { ZSTD_BINDING_PATH, ZSTD_LEVEL, zstdDecodeExact } from './zstd.ts';

/**
 * Where a worker's accept left the chunk file: 'new', linked at `final` (a file of this
 * process); 'exists', a file was at `final` already, and the verified temp file `tmp` is left
 * for the caller (FsChunkStore.place: kept if valid, else replaced); 'none', nothing written.
 */
export type OffloadedFile = 'new' | 'exists' | 'none';

export interface OffloadedResult {
  /** The plain bytes; undefined when they were written at `places` instead. */
  readonly plain: Buffer | undefined;
  readonly file: Exclude<OffloadedFile, 'none'>;
}

export interface OffloadedAccept {
  readonly digest: string;
  readonly codec: Codec;
  readonly size: number;
  /** Detached by the call. */
  readonly data: Uint8Array;
  readonly tmp: string;
  readonly final: string;
  readonly fsync: boolean;
  /**
   * Also write the plain bytes at these (fd, offset) places (an image being materialised),
   * asynchronously on the libuv pool from the worker; the plain bytes then stay in the worker.
   */
  readonly places?: ReadonlyArray<{ readonly fd: number; readonly pos: number }>;
}

// Plain JS, run with `eval` and no execArgv (no tsx loader in the worker: it would cost
// ~1 s of CPU to start). Codec values: NONE = 1, LZ4 = 2, ZSTD = 3 (proto/forkfleet/v1/snapshot.proto).
const WORKER_SOURCE = `
'use strict';
const { parentPort, workerData } = require('node:worker_threads');
const { createHash } = require('node:crypto');
const fs = require('node:fs');
const lz4 = require(workerData.lz4);
const zstd = require(workerData.zstd); // the native binding, as zstd.ts uses it
const dctx = new zstd.DCtx();
const cctx = new zstd.CCtx();
let cscratch = Buffer.alloc(0);
const PAGE = ${PAGE};
const ZERO_PAGE = Buffer.alloc(PAGE);
// tsx compiles with keepNames, which wraps nested functions in __name(fn, name).
const __name = (f) => f;
const nonZeroRuns = ${nonZeroRuns.toString()};
const zstdDecodeExact = ${zstdDecodeExact.toString()};
// Received chunk files are written with O_DIRECT, padded with zeros to DIRECT_ALIGN (the
// store's reader allows that padding): they skip the page cache, which would hold a second,
// compressed copy of bytes the materialised image already holds, and on this machine every
// fresh page-cache page costs a host page fault (ADR 0008, "Chunk files skip the page
// cache"). O_DIRECT needs an aligned buffer: a WebAssembly memory starts on a page boundary.
// A file system that refuses O_DIRECT (EINVAL) gets buffered writes from then on.
const DIRECT_ALIGN = ${DIRECT_ALIGN};
// Decode buffers of the image path, reused once every image write of their chunk is done:
// a new 256 KiB buffer per chunk cost ~64 first-touch page faults each (ADR 0008, "Decode
// buffers reused"). Only exact sizes are reused; a few are kept.
const PLAIN_POOL_MAX = 32;
const plainPool = [];
function takePlain(size) {
  for (let i = plainPool.length - 1; i >= 0; i--) if (plainPool[i].length === size) return plainPool.splice(i, 1)[0];
  return undefined;
}
function givePlain(b) {
  if (plainPool.length < PLAIN_POOL_MAX) plainPool.push(b);
}
const O_DIRECT = fs.constants.O_DIRECT;
const noDirect = new Set();
let directMem = new WebAssembly.Memory({ initial: 5 });
function writeDirect(m, h) {
  const dir = m.tmp.slice(0, m.tmp.lastIndexOf('/'));
  if (!O_DIRECT || noDirect.has(dir)) return false;
  const len = h.length + m.data.length;
  const padded = Math.ceil(len / DIRECT_ALIGN) * DIRECT_ALIGN;
  if (directMem.buffer.byteLength < padded) directMem.grow(Math.ceil((padded - directMem.buffer.byteLength) / 65536));
  const buf = new Uint8Array(directMem.buffer, 0, padded);
  buf.set(h, 0);
  buf.set(m.data, h.length);
  buf.fill(0, len);
  let fd;
  try {
    fd = fs.openSync(m.tmp, fs.constants.O_WRONLY | fs.constants.O_CREAT | fs.constants.O_TRUNC | O_DIRECT, 0o644);
  } catch (e) {
    if (e && e.code === 'EINVAL') { noDirect.add(dir); return false; }
    throw e;
  }
  let written = true;
  try {
    const n = fs.writeSync(fd, buf, 0, padded, 0);
    if (n !== padded) throw new Error('short chunk write: ' + n + ' of ' + padded + ' bytes');
    if (m.fsync) fs.fsyncSync(fd);
  } catch (e) {
    if (!(e && e.code === 'EINVAL')) throw e;
    noDirect.add(dir); // the caller rewrites the file buffered
    written = false;
  } finally {
    fs.closeSync(fd);
  }
  return written;
}
parentPort.on('message', (m) => {
  if (m.compress) {
    // encodeChunk (codec.ts): zstd at ZSTD_LEVEL; the result goes back in a buffer of its own.
    try {
      const bound = zstd.compressBound(m.compress.length);
      if (cscratch.length < bound) cscratch = Buffer.allocUnsafe(bound);
      const n = cctx.compress(cscratch, m.compress, ${ZSTD_LEVEL});
      const out = new Uint8Array(n);
      out.set(cscratch.subarray(0, n));
      return parentPort.postMessage({ id: m.id, compressed: out }, [out.buffer]);
    } catch (e) {
      return parentPort.postMessage({ id: m.id, error: 'zstd compress: ' + String(e && e.message || e) });
    }
  }
  let plain;
  // Where the chunk file went (OffloadedFile).
  let file = 'new';
  // A decode buffer that stays in this worker (image path): back to the pool when done with.
  let own;
  const answer = (r) => {
    if (own) givePlain(own);
    return parentPort.postMessage(r);
  };
  try {
    if (m.codec === 1) plain = m.data;
    else if (m.codec === 2) {
      // lz4-napi's block format starts with the plain length (u32 LE): check it before
      // decoding, or a garbage prefix makes lz4 allocate up to 4 GiB.
      if (m.data.length < 4 || (m.data[0] | (m.data[1] << 8) | (m.data[2] << 16)) + m.data[3] * 16777216 !== m.size) return parentPort.postMessage({ id: m.id, mismatch: 'lz4 data does not decode (length prefix)' });
      try { plain = lz4.uncompressSync(m.data); } catch (e) { return parentPort.postMessage({ id: m.id, mismatch: 'lz4 data does not decode' }); }
    } else if (m.codec === 3) {
      // Decode into exactly the chunk's size: a frame that claims or holds more fails (zstd.ts).
      // Into a reused buffer only when the bytes stay here (written into an image); else
      // they are transferred back and the buffer is gone.
      const stays = m.places && m.places.length > 0;
      const reuse = stays ? takePlain(m.size) : undefined;
      const r = zstdDecodeExact(zstd, dctx, m.data, m.size, reuse);
      if (typeof r === 'string') {
        if (reuse) givePlain(reuse);
        return parentPort.postMessage({ id: m.id, mismatch: r });
      }
      plain = r;
      if (stays) own = r;
    } else return parentPort.postMessage({ id: m.id, mismatch: 'unsupported codec ' + m.codec });
    if (plain.length !== m.size) return answer({ id: m.id, mismatch: 'decoded ' + plain.length + ' bytes, expected ' + m.size });
    const got = createHash('sha256').update(plain).digest('hex');
    if (got !== m.digest) return answer({ id: m.id, mismatch: 'content hashes to ' + got.slice(0, 16) });
    const h = m.header; // chunk-file.ts encodeHeader, made by the caller
    if (!writeDirect(m, h)) {
      const fd = fs.openSync(m.tmp, 'w');
      try {
        const n = fs.writevSync(fd, [h, m.data]);
        if (n !== h.length + m.data.length) throw new Error('short chunk write: ' + n + ' of ' + (h.length + m.data.length) + ' bytes');
        if (m.fsync) fs.fsyncSync(fd);
      } finally {
        fs.closeSync(fd);
      }
    }
    // Never over a file there (a durable chunk another fetch stored): the caller decides.
    try {
      fs.linkSync(m.tmp, m.final);
    } catch (e) {
      if (!(e && e.code === 'EEXIST')) throw e;
      file = 'exists';
    }
    if (file === 'new') try { fs.unlinkSync(m.tmp); } catch {} // in place; a temp left goes when the store opens
  } catch (e) {
    try { fs.unlinkSync(m.tmp); } catch {}
    return answer({ id: m.id, error: String(e && e.message || e), code: e && e.code, file: 'none' });
  }
  if (m.places && m.places.length > 0) {
    // Image writes on the libuv pool; this thread goes on with the next chunk meanwhile.
    // Only the non-zero pages are written: the image is sparse (sparse.ts).
    const runs = nonZeroRuns(plain, ZERO_PAGE, PAGE);
    let left = m.places.length * (runs.length / 2);
    if (left === 0) return answer({ id: m.id, placed: true, file });
    let failed;
    const done = (e, n, len) => {
      if (!failed && (e || n !== len)) failed = e || new Error('short image write: ' + n + ' of ' + len + ' bytes');
      if (--left > 0) return;
      // Every write is done: the kernel has copied the bytes.
      if (own) givePlain(own);
      if (failed) parentPort.postMessage({ id: m.id, error: 'writing image: ' + String(failed.message || failed), code: failed.code, file });
      else parentPort.postMessage({ id: m.id, placed: true, file });
    };
    for (const p of m.places) {
      for (let i = 0; i < runs.length; i += 2) {
        const len = runs[i + 1] - runs[i];
        fs.write(p.fd, plain, runs[i], len, p.pos + runs[i], (e, n) => done(e, n, len));
      }
    }
    return;
  }
  const transfer = plain.buffer === m.data.buffer ? [m.data.buffer] : [plain.buffer, m.data.buffer];
  parentPort.postMessage({ id: m.id, plain, file }, transfer);
});
`;

interface Reply {
  id: number;
  plain?: Uint8Array;
  compressed?: Uint8Array;
  placed?: boolean;
  mismatch?: string;
  error?: string;
  code?: string;
  file?: OffloadedFile;
}

interface Slot {
  worker: Worker;
  pending: Map<number, { digest: string; resolve: (r: Reply) => void; reject: (e: unknown) => void }>;
}

let slots: Slot[] | undefined;
let seq = 0;
const lz4Path = createRequire(import.meta.url).resolve('lz4-napi');

function spawn(): Slot {
  const worker = new Worker(WORKER_SOURCE, { eval: true, execArgv: [], workerData: { lz4: lz4Path, zstd: ZSTD_BINDING_PATH }, env: {} });
  const slot: Slot = { worker, pending: new Map() };
  worker.unref();
  const fail = (e: unknown): void => {
    if (slots) slots = slots.filter((s) => s !== slot);
    for (const p of slot.pending.values()) p.reject(e instanceof Error ? e : new Error(`chunk verify worker exited: ${String(e)}`));
    slot.pending.clear();
  };
  worker.on('error', fail);
  worker.on('exit', (code) => fail(new Error(`chunk verify worker exited with code ${code}`)));
  worker.on('message', (r: Reply) => {
    const p = slot.pending.get(r.id);
    if (!p) return;
    slot.pending.delete(r.id);
    if (slot.pending.size === 0) worker.unref();
    if (r.plain || r.compressed || r.placed) p.resolve(r);
    else if (r.mismatch !== undefined) p.reject(new DigestMismatchError(p.digest, r.mismatch));
    // `file`: where the chunk file was left (OffloadedFile); a worker that died says nothing.
    else p.reject(Object.assign(new Error(`${p.digest ? `storing chunk ${p.digest.slice(0, 16)}` : 'chunk worker'}: ${r.error ?? 'unknown error'}`), { code: r.code, file: r.file }));
  });
  return slot;
}

function pick(): Slot {
  const size = Math.max(1, Math.min(4, availableParallelism()));
  if (!slots) slots = [];
  let best: Slot | undefined;
  for (const s of slots) if (!best || s.pending.size < best.pending.size) best = s;
  if (!best || (best.pending.size > 0 && slots.length < size)) {
    best = spawn();
    slots.push(best);
  }
  return best;
}

/**
 * Verifies `c` and writes its chunk file on a worker thread; resolves with the plain bytes
 * (undefined once they are written at `c.places` too, when given) and where the chunk file
 * went (`file`). A failure carries `file` too, unless the worker died.
 * `c.data` must be owned (`isOwned`): it is detached.
 */
export function acceptOffloaded(c: OffloadedAccept): Promise<OffloadedResult> {
  // Longer than any encoding of its size (padded with zstd skippable frames, say): rejected
  // here, as decodeChunk does (codec.ts), before it costs the worker a copy.
  if (c.data.length > maxStoredSize(c.size)) return Promise.reject(new DigestMismatchError(c.digest, `${c.data.length} bytes of data for ${c.size} plain bytes (at most ${maxStoredSize(c.size)})`));
  // A peer's codec is any varint; one past a byte cannot even go in the chunk file's header.
  if (c.codec !== Codec.NONE && c.codec !== Codec.LZ4 && c.codec !== Codec.ZSTD) return Promise.reject(new DigestMismatchError(c.digest, `unsupported codec ${c.codec}`));
  const slot = pick();
  const id = seq++;
  return new Promise<OffloadedResult>((resolve, reject) => {
    const done = (r: Reply): void => resolve({ plain: r.plain && Buffer.from(r.plain.buffer, r.plain.byteOffset, r.plain.byteLength), file: r.file === 'exists' ? 'exists' : 'new' });
    slot.pending.set(id, { digest: c.digest, resolve: done, reject });
    if (slot.pending.size === 1) slot.worker.ref();
    try {
      // The header is made before `data` is detached (transferred).
      const header = encodeHeader(c);
      slot.worker.postMessage({ id, digest: c.digest, codec: c.codec, size: c.size, header, data: c.data, tmp: c.tmp, final: c.final, fsync: c.fsync, places: c.places }, [c.data.buffer as ArrayBuffer]);
    } catch (e) {
      slot.pending.delete(id);
      if (slot.pending.size === 0) slot.worker.unref();
      reject(Object.assign(e as Error, { file: 'none' }));
    }
  });
}

/** zstd-compresses `plain` (copied, not detached) on a worker thread (codec.ts encodeChunk). */
export function compressOffloaded(plain: Uint8Array): Promise<Buffer> {
  const slot = pick();
  const id = seq++;
  return new Promise<Buffer>((resolve, reject) => {
    slot.pending.set(id, { digest: '', resolve: (r) => resolve(Buffer.from(r.compressed!.buffer, r.compressed!.byteOffset, r.compressed!.byteLength)), reject });
    if (slot.pending.size === 1) slot.worker.ref();
    try {
      // Structured clone copies a view's whole ArrayBuffer: a slice of a bigger one goes alone.
      const own = plain.byteOffset === 0 && plain.byteLength === plain.buffer.byteLength ? plain : plain.slice();
      slot.worker.postMessage({ id, compress: own });
    } catch (e) {
      slot.pending.delete(id);
      if (slot.pending.size === 0) slot.worker.unref();
      reject(e);
    }
  });
}
