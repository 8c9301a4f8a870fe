// Test fixture: writes chunks into a store forever (until killed). Prints once it has started.
import { FsChunkStore } from './fs-store.ts';
import { encodeChunk } from './codec.ts';
import { randomBytesSeeded } from '../../bench/transfer-image.ts';

const store = new FsChunkStore(process.argv[2] ?? '/nonexistent');
async function main(): Promise<void> {
  for (let i = 0; ; i++) {
    await Promise.all(Array.from({ length: 8 }, (_, j) => encodeChunk(randomBytesSeeded(256 * 1024, i * 8 + j)).then((c) => store.put(c, { trusted: true }))));
    if (i === 0) process.stdout.write('started\n');
  }
}
void main();
