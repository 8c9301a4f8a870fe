// The hand-written FetchChunksResponse codec must be byte-compatible with the generated one.
import { describe, expect, it } from 'vitest';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import { FetchChunksResponseSchema } from '../../../proto/gen/forkfleet/v1/transfer_pb.ts';
import { Codec } from '../../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { deserializeResponse, serializeResponse } from './wire.ts';
import { markHeadroom, markRecyclable } from '../chunkstore/buffers.ts';

const digest = Buffer.alloc(32, 7);

describe('FetchChunksResponse wire codec', () => {
  it('serialize_chunk_matchesGeneratedEncoding', () => {
    for (const [codec, size, len] of [[Codec.LZ4, 256 * 1024, 70_001], [Codec.NONE, 262_144, 262_144], [Codec.NONE, 0, 0]] as const) {
      const data = Buffer.alloc(len, 3);
      const v = { payload: { case: 'chunk' as const, value: { digest, codec, size, data } } };
      const ours = serializeResponse(v);
      const theirs = toBinary(FetchChunksResponseSchema, create(FetchChunksResponseSchema, v));
      expect(Buffer.compare(ours, Buffer.from(theirs))).toBe(0);
    }
  });

  it('serialize_chunkWithHeadroom_writesHeaderInPlaceAndMatchesGeneratedEncoding', () => {
    for (const [room, len] of [[64, 70_001], [64, 262_144], [10, 1000]] as const) {
      const backing = Buffer.alloc(room + len, 5);
      const data = backing.subarray(room);
      markHeadroom(data);
      const v = { payload: { case: 'chunk' as const, value: { digest, codec: Codec.LZ4, size: 256 * 1024, data } } };
      const theirs = Buffer.from(toBinary(FetchChunksResponseSchema, create(FetchChunksResponseSchema, v)));
      const ours = serializeResponse(v);
      expect(Buffer.compare(ours, theirs)).toBe(0);
      // Enough room: a view of the same memory (no copy of the data); too little: a copy.
      expect(ours.buffer === backing.buffer).toBe(room >= theirs.length - len);
    }
  });

  it('serialize_pooledChunk_releasesBufferOnlyAfterTheSynchronousCopy', async () => {
    const backing = Buffer.alloc(64 + 1000, 9);
    const data = backing.subarray(64);
    markHeadroom(data);
    let released = 0;
    markRecyclable(data, () => released++);
    const ours = serializeResponse({ payload: { case: 'chunk', value: { digest, codec: Codec.NONE, size: 1000, data } } });
    // grpc-js copies the returned view right after this returns: still ours until then.
    expect(released).toBe(0);
    const copy = Buffer.from(ours);
    await Promise.resolve();
    expect(released).toBe(1);
    expect(fromBinary(FetchChunksResponseSchema, copy).payload.case).toBe('chunk');
    // Once only.
    serializeResponse({ payload: { case: 'chunk', value: { digest, codec: Codec.NONE, size: 1000, data } } });
    await Promise.resolve();
    expect(released).toBe(1);
  });

  it('serialize_missing_matchesGeneratedEncoding', () => {
    const v = { payload: { case: 'missing' as const, value: digest } };
    expect(Buffer.compare(serializeResponse(v), Buffer.from(toBinary(FetchChunksResponseSchema, create(FetchChunksResponseSchema, v))))).toBe(0);
  });

  it('deserialize_generatedEncoding_givesSameFieldsAsViews', () => {
    const data = Buffer.from('hello chunk');
    const bytes = Buffer.from(toBinary(FetchChunksResponseSchema, create(FetchChunksResponseSchema, { payload: { case: 'chunk', value: { digest, codec: Codec.LZ4, size: 99, data } } })));
    const r = deserializeResponse(bytes);
    expect(r.payload.case).toBe('chunk');
    if (r.payload.case !== 'chunk') return;
    expect(Buffer.from(r.payload.value.digest).equals(digest)).toBe(true);
    expect(Buffer.from(r.payload.value.data).equals(data)).toBe(true);
    expect(r.payload.value.codec).toBe(Codec.LZ4);
    expect(r.payload.value.size).toBe(99);
    expect(r.payload.value.data.buffer).toBe(bytes.buffer);
    const m = deserializeResponse(Buffer.from(toBinary(FetchChunksResponseSchema, create(FetchChunksResponseSchema, { payload: { case: 'missing', value: digest } }))));
    expect(m.payload.case).toBe('missing');
    expect(fromBinary(FetchChunksResponseSchema, serializeResponse(m)).payload.case).toBe('missing');
  });

  it('deserialize_truncated_throws', () => {
    const bytes = serializeResponse({ payload: { case: 'chunk', value: { digest, codec: Codec.NONE, size: 10, data: Buffer.alloc(10) } } });
    expect(() => deserializeResponse(bytes.subarray(0, bytes.length - 3))).toThrow();
  });
});
