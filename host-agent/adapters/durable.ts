// Making files durable: fsync of files and the directories that name them, a write that
// survives an OS crash whole or not at all (writeFileDurable), and directories published
// before their fsync and made durable in the background (DeferredSync). A rename
// alone is atomic against a process kill, not against a power loss: without the fsyncs the
// new name can survive with no data behind it.
import { randomUUID } from 'node:crypto';
import { readdirSync, readFileSync, rmSync } from 'node:fs';
import { mkdir, open, readdir, rename, unlink, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import type { Logger } from 'pino';
import { oneAtATime } from '../domain/one-at-a-time.ts';

/**
 * Opening a file for its fsync failed (EMFILE, ENFILE, ENOMEM...): nothing was written back,
 * so nothing was lost, and a later fsync of the file is as good as this one would have been.
 * Any other failure of fsyncPath/fsyncAll (the fsync itself, or the close after it: NFS
 * reports writeback errors there) must be taken as a loss: Linux reports a writeback error
 * once, and the next fsync of the file returns 0 though its data never reached the disk.
 * Carries the errno `code`, so a step that meets it is answered as the errno would be.
 */
export class FsyncOpenError extends Error {
  readonly code: string | undefined;
  constructor(
    readonly path: string,
    options: { cause: unknown },
  ) {
    const code = (options.cause as { code?: unknown } | null)?.code;
    super(`opening a file for its fsync failed${typeof code === 'string' ? ` (${code})` : ''}`, options);
    this.name = 'FsyncOpenError';
    this.code = typeof code === 'string' ? code : undefined;
  }
}

/** fsync of one file or directory (a directory: the names in it); a path gone since is skipped. */
export async function fsyncPath(p: string): Promise<void> {
  let fh;
  try {
    fh = await open(p, 'r');
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === 'ENOENT') return; // removed since: nothing to make durable
    throw new FsyncOpenError(p, { cause: e });
  }
  try {
    await fh.sync();
  } catch (e) {
    // The fsync's error, not a close error after it.
    await fh.close().catch(() => undefined);
    throw e;
  }
  await fh.close();
}

/**
 * fsyncs `paths` (files, then the directories that hold them) with bounded concurrency. Every
 * path is tried; when some failed, throws a loss (any error but FsyncOpenError) before an
 * open failure: the first error alone could hide another worker's writeback error.
 */
export async function fsyncAll(paths: Iterable<string>, concurrency = 16): Promise<void> {
  const files = [...paths];
  const dirs = [...new Set(files.map((f) => dirname(f)))];
  const errors: unknown[] = [];
  for (const list of [files, dirs]) {
    let next = 0;
    const worker = async (): Promise<void> => {
      while (next < list.length) await fsyncPath(list[next++] as string).catch((e: unknown) => void errors.push(e));
    };
    await Promise.all(Array.from({ length: Math.min(concurrency, list.length) }, worker));
  }
  if (errors.length > 0) throw errors.find((e) => !(e instanceof FsyncOpenError)) ?? errors[0];
}

/** Writes of writeFileDurable under way, by path. */
const writing = new Map<string, Promise<unknown>>();

/**
 * Writes `path` so that after a crash of the process or the OS it holds `data` or its old
 * content. Writes of one path in this process go one after another: they share the temp file
 * `<path>.tmp` (whose fixed name a later write replaces), and two at once wrote it together
 * and one's rename failed with ENOENT (two deletes of one snapshot failed one of them).
 */
export function writeFileDurable(path: string, data: string | Uint8Array, mode = 0o644): Promise<void> {
  return oneAtATime(writing, path, () => writeFileDurableNow(path, data, mode));
}

async function writeFileDurableNow(path: string, data: string | Uint8Array, mode: number): Promise<void> {
  const tmp = `${path}.tmp`;
  const fh = await open(tmp, 'w', mode);
  try {
    try {
      await fh.writeFile(data);
      await fh.sync();
    } finally {
      await fh.close();
    }
    await rename(tmp, path);
  } catch (e) {
    // No temp file left behind by a failed write (a full disk), as chunk-store writes leave none.
    await unlink(tmp).catch(() => undefined);
    throw e;
  }
  await fsyncPath(dirname(path));
}

/** This process's stand-in for an unreadable boot id (see bootId). */
let unknownBoot: string | undefined;

/**
 * The kernel's boot id: it changes when the OS restarts (a crash included). When it cannot be
 * read (no /proc), a random value of this process, which no marker of another process
 * matches: a constant matched every marker left before a reboot, and images never fsynced
 * before an OS crash were trusted. Markers of earlier processes then always count as another
 * boot's (their directories are discarded and rebuilt). Logged once per process.
 */
function bootId(log?: Logger): string {
  const path = '/proc/sys/kernel/random/boot_id';
  let id = '';
  let err: unknown;
  try {
    id = readFileSync(path, 'utf8').trim();
  } catch (e) {
    err = e;
  }
  if (id !== '') return id;
  if (unknownBoot === undefined) {
    unknownBoot = `unknown-${randomUUID()}`;
    const why = err === undefined ? 'it is empty' : String((err as Error).message ?? err);
    const msg = `the boot id (${path}) cannot be read (${why}): directories marked unsynced by an earlier process are discarded at start, as after an OS crash`;
    if (log) log.warn({ bootId: unknownBoot }, msg);
    else process.emitWarning(msg);
  }
  return unknownBoot;
}

/**
 * Directories published before they are fsynced (readers get them from the page cache, which
 * a process crash keeps), made durable in the background, safely across an OS crash: a marker
 * `<markerDir>/<id>` holding the boot id is made durable before the directory is published
 * (`mark`) and removed once a background fsync of the directory finished (`later`). At start
 * (`recover`), a marker of this boot means "still in the page cache": synced again; a marker
 * of another boot means the directory may be torn: the caller discards it. A background fsync
 * that fails discards the directory at once (see `later`).
 */
export class DeferredSync {
  private readonly syncing = new Set<Promise<void>>();
  /** The newest mark of each id in this process: an older one's fsync must not drop its marker. */
  private readonly marks = new Map<string, number>();
  private seq = 0;

  constructor(
    private readonly markerDir: string,
    private readonly log?: Logger,
    readonly boot = bootId(log),
  ) {}

  /** Before `id`'s directory is published. Written in place: a torn marker reads as another boot's. */
  async mark(id: string): Promise<void> {
    const marker = join(this.markerDir, id);
    this.marks.set(id, ++this.seq);
    await mkdir(this.markerDir, { recursive: true });
    await writeFile(marker, this.boot);
    await fsyncAll([marker]);
  }

  /**
   * After it is published: fsyncs every file in `dir` and `dir` itself in the background, then
   * drops the marker. When that fsync fails, `discard` removes the directory (its readers get
   * it from the page cache, then, evicted, from blocks that may never have been written) and
   * the marker goes: a fsync reports a writeback error only once, so a second one (recover()
   * in this boot) would return 0 and the directory would pass for durable. Without `discard`,
   * or when it fails, the marker is made one no boot matches: recover() discards the directory.
   */
  later(id: string, dir: string, discard?: () => void | Promise<void>): void {
    const mine = this.marks.get(id);
    const marker = join(this.markerDir, id);
    const p = (async () => {
      const files = await readdir(dir).catch((e: unknown) => {
        if ((e as NodeJS.ErrnoException).code === 'ENOENT') return [] as string[]; // removed since: nothing to make durable
        throw e;
      });
      await fsyncAll([...files.map((f) => join(dir, f)), join(dir, '.')]);
      // Marked again meanwhile (the directory removed and rebuilt): that mark's fsync drops it.
      if (this.marks.get(id) !== mine) return;
      this.marks.delete(id);
      await unlink(marker).catch(() => undefined);
    })().catch(async (e: unknown) => {
      try {
        if (!discard) throw e;
        // Whatever is there now, also a newer build's (which files failed is not known).
        await discard();
        this.log?.warn({ id, err: (e as Error).message }, 'background fsync failed: directory discarded');
      } catch (err) {
        this.log?.error({ id, err: (e as Error).message, discard: err === e ? undefined : (err as Error).message }, 'background fsync failed: directory discarded at the next start');
        await writeFile(marker, 'fsync failed')
          .then(() => fsyncAll([marker]))
          .catch(() => undefined);
        return;
      }
      // A newer mark's own fsync drops the marker (it finds nothing now).
      const now = this.marks.get(id);
      if (now !== undefined && now !== mine) return;
      this.marks.delete(id);
      await unlink(marker).catch(() => undefined);
    });
    this.syncing.add(p);
    void p.finally(() => this.syncing.delete(p));
  }

  /**
   * At start: ids marked in this boot are synced again (`dirOf`; discarded if that fails, see
   * `later`); for ids marked in another boot, `discard` runs (it removes the directory), then
   * the marker goes. Returns those ids.
   */
  recover(dirOf: (id: string) => string, discard: (id: string) => void): string[] {
    const torn: string[] = [];
    let ids: string[] = [];
    try {
      ids = readdirSync(this.markerDir);
    } catch {
      return []; // never marked anything
    }
    for (const id of ids) {
      let boot = '';
      try {
        boot = readFileSync(join(this.markerDir, id), 'utf8');
      } catch {
        /* unreadable marker: another boot's */
      }
      if (boot === this.boot) {
        this.later(id, dirOf(id), () => discard(id));
      } else {
        discard(id);
        rmSync(join(this.markerDir, id), { force: true });
        torn.push(id);
      }
    }
    return torn;
  }

  /** Resolves when every background fsync started so far has finished. */
  async flush(): Promise<void> {
    while (this.syncing.size > 0) await Promise.allSettled([...this.syncing]);
  }
}
