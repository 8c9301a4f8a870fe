// Making files durable: fsync of files and the directories that name them, and a write that
// survives an OS crash whole or not at all (temp file, fsync, rename, fsync of the directory).
// A rename alone is atomic against a process kill, not against a power loss: without the
// fsyncs the new name can survive with no data behind it.
import { open, rename } from 'node:fs/promises';
import { dirname } from 'node:path';

async function fsyncPath(p: string): Promise<void> {
  let fh;
  try {
    fh = await open(p, 'r');
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === 'ENOENT') return; // removed since: nothing to make durable
    throw e;
  }
  try {
    await fh.sync();
  } finally {
    await fh.close();
  }
}

/** fsyncs `paths` (files, then the directories that hold them) with bounded concurrency. */
export async function fsyncAll(paths: Iterable<string>, concurrency = 16): Promise<void> {
  const files = [...paths];
  const dirs = [...new Set(files.map((f) => dirname(f)))];
  for (const list of [files, dirs]) {
    let next = 0;
    const worker = async (): Promise<void> => {
      while (next < list.length) await fsyncPath(list[next++] as string);
    };
    await Promise.all(Array.from({ length: Math.min(concurrency, list.length) }, worker));
  }
}

/** Writes `path` so that after a crash of the process or the OS it holds `data` or its old content. */
export async function writeFileDurable(path: string, data: string | Uint8Array, mode = 0o644): Promise<void> {
  const tmp = `${path}.tmp`;
  const fh = await open(tmp, 'w', mode);
  try {
    await fh.writeFile(data);
    await fh.sync();
  } finally {
    await fh.close();
  }
  await rename(tmp, path);
  await fsyncPath(dirname(path));
}
