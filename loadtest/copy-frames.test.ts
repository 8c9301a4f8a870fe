import { describe, expect, it } from 'vitest';
import { FrameReader, type FileSink } from './copy-frames.ts';

/** The sender's stream (copy-main.ts send): per file u16 name length, name, u64 size, bytes; then u16 0. */
function stream(files: ReadonlyArray<readonly [string, Buffer]>): Buffer {
  const parts: Buffer[] = [];
  for (const [name, data] of files) {
    const n = Buffer.from(name);
    const head = Buffer.alloc(2 + n.length + 8);
    head.writeUInt16BE(n.length, 0);
    n.copy(head, 2);
    head.writeBigUInt64BE(BigInt(data.length), 2 + n.length);
    parts.push(head, data);
  }
  parts.push(Buffer.alloc(2));
  return Buffer.concat(parts);
}

/** A reader whose sinks keep every buffer they were given. */
function recording(): { reader: FrameReader; got: Map<string, Buffer[]>; ended: string[] } {
  const got = new Map<string, Buffer[]>();
  const ended: string[] = [];
  const reader = new FrameReader((name): FileSink => {
    const bufs: Buffer[] = [];
    got.set(name, bufs);
    return { write: async (b) => void bufs.push(b), end: async () => void ended.push(name) };
  });
  return { reader, got, ended };
}

const FILES = [['full.bin', Buffer.from('0123456789abcdef'.repeat(4))], ['empty', Buffer.alloc(0)], ['disk.qcow2', Buffer.from('disk-layer')]] as const;

describe('naive copy stream', () => {
  it('frameReader_fileBytes_areWrittenAsViewsOfTheReceivedChunk_notCopies', async () => {
    // On an ArrayBuffer of its own (small Buffers share Node's pool, where a copy could land too).
    const raw = stream(FILES);
    const s = Buffer.from(raw.buffer.slice(raw.byteOffset, raw.byteOffset + raw.length));
    const { reader, got } = recording();
    await reader.push(s);
    reader.finish();
    const written = [...got.values()].flat();
    expect(written.length).toBeGreaterThan(0);
    for (const b of written) expect(b.buffer).toBe(s.buffer);
  });

  it('frameReader_streamCutAnywhereIntoThreeChunks_givesEveryFileWhole', async () => {
    const s = stream(FILES);
    for (let i = 0; i <= s.length; i++) {
      for (let j = i; j <= s.length; j += 3) {
        const { reader, got, ended } = recording();
        for (const c of [s.subarray(0, i), s.subarray(i, j), s.subarray(j)]) await reader.push(c);
        reader.finish();
        expect(reader.files).toEqual(FILES.map(([n]) => n));
        expect(ended).toEqual(FILES.map(([n]) => n));
        for (const [name, data] of FILES) expect(Buffer.concat(got.get(name)!).equals(data)).toBe(true);
      }
    }
  });

  it('frameReader_withoutTheEndMarker_orCutInAFile_isNoSample', async () => {
    const s = stream(FILES);
    for (const cut of [s.length - 2, s.length - 1, 20]) {
      const { reader } = recording();
      await reader.push(s.subarray(0, cut));
      expect(() => reader.finish()).toThrow(/stream was cut/);
    }
  });
});
