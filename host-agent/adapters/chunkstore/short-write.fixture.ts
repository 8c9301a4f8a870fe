// Test fixture: puts one chunk of 256 KiB (incompressible) into the store at argv[2], run
// under a file size limit below the chunk's size (the caller's `ulimit -f`), and prints how
// the put ended as one JSON line.
import { FsChunkStore } from './fs-store.ts';
import { encodeChunk } from './codec.ts';
import { randomBytesSeeded } from '../../bench/transfer-image.ts';

const store = new FsChunkStore(process.argv[2] ?? '/nonexistent');
const c = await encodeChunk(randomBytesSeeded(256 * 1024, 7));
const put = await store.put(c, { trusted: true }).then(
  () => 'stored',
  (e: unknown) => `failed: ${(e as NodeJS.ErrnoException).code ?? String(e)}`,
);
process.stdout.write(`${JSON.stringify({ put, digest: c.digest, missing: await store.missing([c.digest]) })}\n`);
