// The naive full-copy baseline's stream (copy-main.ts), receiving side. Per file: u16 name
// length, name, u64 size, the bytes; an empty name (u16 0) ends the stream.
//
// File bytes go to their sink as views of the received chunks, never copied: the baseline is
// a plain copy, and a copy of every chunk in the receiver (Buffer.concat of what was left and
// the new chunk, as copy-main did before) made it slower than the copy it stands for. Only a
// header split across two chunks is joined (its few bytes).

/** Where one file's bytes go. `write` resolves when the sink takes more (back-pressure). */
export interface FileSink {
  write(bytes: Buffer): Promise<void>;
  end(): Promise<void>;
}

export class FrameReader {
  /** The bytes of a header that began in an earlier chunk (empty otherwise). */
  private head: Buffer = Buffer.alloc(0);
  private sink: FileSink | undefined;
  /** Bytes of the current file still to come. */
  private left = 0n;
  private ended = false;
  /** Names of the files begun, in order. */
  readonly files: string[] = [];

  constructor(private readonly open: (name: string) => FileSink) {}

  /** Header bytes `h` needs in all: 2 until its name length is known, then the whole header. */
  private static need(h: Buffer): number {
    if (h.length < 2) return 2;
    const n = h.readUInt16BE(0);
    return n === 0 ? 2 : 2 + n + 8;
  }

  async push(chunk: Buffer): Promise<void> {
    let buf = chunk;
    while (buf.length > 0) {
      if (this.sink) {
        const take = this.left < BigInt(buf.length) ? Number(this.left) : buf.length;
        await this.sink.write(buf.subarray(0, take));
        buf = buf.subarray(take);
        this.left -= BigInt(take);
        if (this.left === 0n) await this.endFile();
        continue;
      }
      if (this.ended) throw new Error(`the stream went on after its end marker (${buf.length} bytes)`);
      let h: Buffer;
      if (this.head.length === 0 && buf.length >= FrameReader.need(buf)) {
        h = buf.subarray(0, FrameReader.need(buf));
        buf = buf.subarray(h.length);
      } else {
        // A header split across chunks: gather just its bytes.
        const take = Math.min(FrameReader.need(this.head) - this.head.length, buf.length);
        this.head = Buffer.concat([this.head, buf.subarray(0, take)]);
        buf = buf.subarray(take);
        if (this.head.length < FrameReader.need(this.head)) continue;
        h = this.head;
        this.head = Buffer.alloc(0);
      }
      const n = h.readUInt16BE(0);
      if (n === 0) {
        this.ended = true;
        continue;
      }
      const name = h.subarray(2, 2 + n).toString();
      this.left = h.readBigUInt64BE(2 + n);
      this.files.push(name);
      this.sink = this.open(name);
      if (this.left === 0n) await this.endFile();
    }
  }

  private async endFile(): Promise<void> {
    const s = this.sink!;
    this.sink = undefined;
    await s.end();
  }

  /** After the last chunk: throws unless the stream ended with its end marker after whole files (a sender that died mid-stream closes it too). */
  finish(): void {
    if (!this.ended || this.sink !== undefined || this.left !== 0n || this.head.length > 0) {
      throw new Error(`the stream was cut: ${this.files.length} file(s) begun, ${this.left} bytes of the last missing, end marker ${this.ended ? 'seen' : 'not seen'}`);
    }
  }
}
