// Hand-written protobuf wire codec for FetchChunksResponse, the one hot message of peer
// transfer (one per 256 KiB chunk). Byte-compatible with the generated code (proto3
// encoding of forkfleet.v1.FetchChunksResponse), but:
// - serialize copies the chunk data once (header + data into one buffer); the generic path
//   (create + toBinary + Buffer.from) copied it three times. When the chunk was read into a
//   buffer with scratch bytes before it (FsChunkStore.getEncoded), the header goes there
//   and the data is not copied at all (grpc-js still copies once into its frame);
// - deserialize returns views into the received buffer (no copy of digest or data).
// Requests (open, want, credit) are small and keep the generated code.
import type { Codec } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { headroomOf, recycleAfterCopy } from '../chunkstore/buffers.ts';

/** What the server yields and the client receives. `data`/`digest` may be views. */
export type WireResponse =
  | { readonly payload: { readonly case: 'chunk'; readonly value: { readonly digest: Uint8Array; readonly codec: Codec; readonly size: number; readonly data: Uint8Array } } }
  | { readonly payload: { readonly case: 'missing'; readonly value: Uint8Array } }
  | { readonly payload: { readonly case: undefined; readonly value?: undefined } };

function varintLen(n: number): number {
  let l = 1;
  while (n >= 0x80) {
    n = Math.floor(n / 128);
    l++;
  }
  return l;
}

function putVarint(buf: Buffer, off: number, n: number): number {
  while (n >= 0x80) {
    buf[off++] = (n & 0x7f) | 0x80;
    n = Math.floor(n / 128);
  }
  buf[off++] = n;
  return off;
}

function putBytesField(buf: Buffer, off: number, tag: number, b: Uint8Array): number {
  buf[off++] = tag;
  off = putVarint(buf, off, b.length);
  buf.set(b, off);
  return off + b.length;
}

/**
 * Encodes one response. With a recyclable chunk buffer (buffers.ts) the result may be a view
 * of that buffer, valid only until the current synchronous work ends (grpc-js copies it at
 * once); the buffer then goes back to its pool.
 */
export function serializeResponse(v: WireResponse): Buffer {
  const p = v.payload;
  if (p.case === 'missing') {
    const out = Buffer.allocUnsafe(1 + varintLen(p.value.length) + p.value.length);
    putBytesField(out, 0, 0x12, p.value);
    return out;
  }
  if (p.case !== 'chunk') return Buffer.alloc(0);
  const c = p.value;
  // ChunkData: 1 digest (bytes), 2 codec (enum), 3 size (uint32), 4 data (bytes). proto3
  // omits zero scalars and empty bytes.
  let inner = 0;
  if (c.digest.length) inner += 1 + varintLen(c.digest.length) + c.digest.length;
  if (c.codec) inner += 1 + varintLen(c.codec);
  if (c.size) inner += 1 + varintLen(c.size);
  if (c.data.length) inner += 1 + varintLen(c.data.length) + c.data.length;
  const total = 1 + varintLen(inner) + inner;
  // The chunk file reader leaves scratch bytes before `data` (chunkstore/buffers.ts): write
  // the header there and send header + data as one view, with no copy of the data.
  const head = total - c.data.length;
  const inPlace = c.data.length > 0 && headroomOf(c.data) >= head;
  const out = inPlace ? Buffer.from(c.data.buffer, c.data.byteOffset - head, total) : Buffer.allocUnsafe(total);
  let o = 0;
  out[o++] = 0x0a;
  o = putVarint(out, o, inner);
  if (c.digest.length) o = putBytesField(out, o, 0x0a, c.digest);
  if (c.codec) {
    out[o++] = 0x10;
    o = putVarint(out, o, c.codec);
  }
  if (c.size) {
    out[o++] = 0x18;
    o = putVarint(out, o, c.size);
  }
  if (c.data.length) {
    if (inPlace) {
      out[o++] = 0x22;
      o = putVarint(out, o, c.data.length);
      if (o !== head) throw new Error(`wire: header is ${o} bytes, expected ${head}`);
    } else o = putBytesField(out, o, 0x22, c.data);
    // A pooled read buffer (FsChunkStore.getEncodedForSend) is free once grpc-js copied the
    // returned view into its frame buffer, which it does right after this returns.
    recycleAfterCopy(c.data);
  }
  return out;
}

class Reader {
  pos: number;
  constructor(
    readonly buf: Buffer,
    start: number,
    readonly end: number,
  ) {
    this.pos = start;
  }
  varint(): number {
    let n = 0;
    let mul = 1;
    for (let i = 0; i < 10; i++) {
      if (this.pos >= this.end) throw new Error('truncated varint');
      const b = this.buf[this.pos++] as number;
      n += (b & 0x7f) * mul;
      if (b < 0x80) return n;
      mul *= 128;
    }
    throw new Error('varint too long');
  }
  bytes(): Buffer {
    const len = this.varint();
    if (this.pos + len > this.end) throw new Error('truncated bytes field');
    const b = this.buf.subarray(this.pos, this.pos + len);
    this.pos += len;
    return b;
  }
  skip(wireType: number): void {
    switch (wireType) {
      case 0:
        this.varint();
        return;
      case 1:
        this.pos += 8;
        return;
      case 2:
        this.pos += this.varint();
        return;
      case 5:
        this.pos += 4;
        return;
      default:
        throw new Error(`unsupported wire type ${wireType}`);
    }
  }
}

const EMPTY = new Uint8Array(0);

export function deserializeResponse(buf: Buffer): WireResponse {
  const r = new Reader(buf, 0, buf.length);
  let out: WireResponse = { payload: { case: undefined } };
  while (r.pos < r.end) {
    const key = r.varint();
    const field = Math.floor(key / 8);
    const wt = key & 7;
    if (field === 1 && wt === 2) {
      const len = r.varint();
      const end = r.pos + len;
      if (end > r.end) throw new Error('truncated ChunkData');
      const c = new Reader(buf, r.pos, end);
      let digest: Uint8Array = EMPTY;
      let codec = 0;
      let size = 0;
      let data: Uint8Array = EMPTY;
      while (c.pos < c.end) {
        const k = c.varint();
        const f = Math.floor(k / 8);
        const w = k & 7;
        if (f === 1 && w === 2) digest = c.bytes();
        else if (f === 2 && w === 0) codec = c.varint();
        else if (f === 3 && w === 0) size = c.varint() >>> 0;
        else if (f === 4 && w === 2) data = c.bytes();
        else c.skip(w);
      }
      r.pos = end;
      out = { payload: { case: 'chunk', value: { digest, codec: codec as Codec, size, data } } };
    } else if (field === 2 && wt === 2) {
      out = { payload: { case: 'missing', value: r.bytes() } };
    } else {
      r.skip(wt);
    }
  }
  return out;
}
