// Test fixture: writes chunks into a store forever (until killed), half by `put` and half by
// `accept` of owned buffers (written on a worker thread). Prints once it has started.
import { FsChunkStore } from './fs-store.ts';
import { encodeChunk } from './codec.ts';
import { markOwned } from './buffers.ts';
import { randomBytesSeeded } from '../../bench/transfer-image.ts';

const store = new FsChunkStore(process.argv[2] ?? '/nonexistent');
async function main(): Promise<void> {
  for (let i = 0; ; i++) {
    await Promise.all(
      Array.from({ length: 8 }, (_, j) =>
        encodeChunk(randomBytesSeeded(256 * 1024, i * 8 + j)).then(async (c) => {
          if (j % 2 === 0) return store.put(c, { trusted: true });
          // As a received chunk: verified and written on a worker thread (verify-pool.ts).
          const data = Buffer.from(c.data);
          markOwned(data);
          await store.accept({ ...c, data });
        }),
      ),
    );
    if (i === 0) process.stdout.write('started\n');
  }
}
void main();
