import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { DeferredSync, FsyncOpenError, fsyncAll, writeFileDurable } from './durable.ts';
import { failOnce, openFailsOnce } from './fsync-fault.ts';
import { passingSystemError } from '../errors.ts';
import type { Logger } from 'pino';
import type * as NodeFs from 'node:fs';

vi.mock('node:fs/promises', async (real) => (await import('./fsync-fault.ts')).failingFsync(await real()));
/** While set, the kernel's boot id cannot be read (a container without /proc). */
const bootIdUnreadable = vi.hoisted(() => ({ on: false }));
vi.mock('node:fs', async (importOriginal) => {
  const real = await importOriginal<typeof NodeFs>();
  const readFileSync = ((p: unknown, ...a: unknown[]) => {
    if (bootIdUnreadable.on && p === '/proc/sys/kernel/random/boot_id') throw Object.assign(new Error(`ENOENT: no such file or directory, open '${p}'`), { code: 'ENOENT' });
    return (real.readFileSync as (...x: unknown[]) => unknown)(p, ...a);
  }) as typeof real.readFileSync;
  return { ...real, readFileSync, default: { ...real, readFileSync } };
});

describe('DeferredSync', () => {
  let root: string;
  let markers: string;
  const dirOf = (id: string): string => join(root, 'data', id);
  const publish = (id: string): void => {
    mkdirSync(dirOf(id), { recursive: true });
    writeFileSync(join(dirOf(id), 'f'), id);
  };

  beforeEach(() => {
    root = mkdtempSync(join(tmpdir(), 'ffds-'));
    markers = join(root, 'unsynced');
    failOnce.clear();
  });
  afterEach(() => rmSync(root, { recursive: true, force: true }));

  it('mark_thenLater_leavesAMarkerWithTheBootIdUntilTheBackgroundFsyncEnds', async () => {
    const s = new DeferredSync(markers, undefined, 'boot-1');
    await s.mark('a');
    expect(readFileSync(join(markers, 'a'), 'utf8')).toBe('boot-1');
    publish('a');
    s.later('a', dirOf('a'));
    await s.flush();
    expect(readdirSync(markers)).toEqual([]);
    expect(readFileSync(join(dirOf('a'), 'f'), 'utf8')).toBe('a');
  });

  it('later_ofADirectoryRemovedMeanwhile_stillDropsItsMarker', async () => {
    const s = new DeferredSync(markers, undefined, 'boot-1');
    await s.mark('gone');
    s.later('gone', dirOf('gone'));
    await s.flush();
    expect(readdirSync(markers)).toEqual([]);
  });

  it('later_ofAnOlderMark_leavesTheMarkerOfANewerOne', async () => {
    // Published, then removed and rebuilt (marked again) while the first fsync still ran.
    const s = new DeferredSync(markers, undefined, 'boot-1');
    await s.mark('a');
    publish('a');
    s.later('a', dirOf('a'));
    await s.mark('a');
    await s.flush();
    expect(readdirSync(markers)).toEqual(['a']);
    s.later('a', dirOf('a'));
    await s.flush();
    expect(readdirSync(markers)).toEqual([]);
  });

  it('recover_discardsWhatAnotherBootMarked_syncsAgainWhatThisBootMarked_andKeepsTheRest', async () => {
    // Before an OS crash: 'torn' was marked and never synced. After it (boot-2): 'fresh' was
    // marked by an agent that died before its fsync ended; 'done' has no marker.
    await new DeferredSync(markers, undefined, 'boot-1').mark('torn');
    await new DeferredSync(markers, undefined, 'boot-2').mark('fresh');
    for (const id of ['torn', 'fresh', 'done']) publish(id);
    const discarded: string[] = [];
    const s = new DeferredSync(markers, undefined, 'boot-2');
    const torn = s.recover(dirOf, (id) => {
      discarded.push(id);
      rmSync(dirOf(id), { recursive: true, force: true });
    });
    await s.flush();
    expect(torn).toEqual(['torn']);
    expect(discarded).toEqual(['torn']);
    expect(readdirSync(markers)).toEqual([]);
    expect(['torn', 'fresh', 'done'].map((id) => existsSync(dirOf(id)))).toEqual([false, true, true]);
  });

  it('later_whenTheBackgroundFsyncFails_discardsTheDirectory_soNoLaterRecoverTakesItForDurable', async () => {
    // The marker stayed, and recover() in the same boot fsynced the files again: 0 this time
    // (the writeback error is reported once), the marker went and the image passed as durable.
    const s = new DeferredSync(markers, undefined, 'boot-1');
    await s.mark('a');
    publish('a');
    failOnce.add(join(dirOf('a'), 'f'));
    s.later('a', dirOf('a'), () => rmSync(dirOf('a'), { recursive: true, force: true }));
    await s.flush();
    expect(existsSync(dirOf('a'))).toBe(false);
    const restarted = new DeferredSync(markers, undefined, 'boot-1');
    restarted.recover(dirOf, (id) => rmSync(dirOf(id), { recursive: true, force: true }));
    await restarted.flush();
    expect(existsSync(dirOf('a'))).toBe(false);
    expect(readdirSync(markers)).toEqual([]);
  });

  it('later_whenTheBackgroundFsyncFailsAndNothingDiscards_leavesAMarkerThatRecoverDiscardsInTheSameBoot', async () => {
    const s = new DeferredSync(markers, undefined, 'boot-1');
    await s.mark('a');
    publish('a');
    failOnce.add(join(dirOf('a'), 'f'));
    s.later('a', dirOf('a'));
    await s.flush();
    const discarded: string[] = [];
    const restarted = new DeferredSync(markers, undefined, 'boot-1');
    expect(restarted.recover(dirOf, (id) => discarded.push(id))).toEqual(['a']);
    expect(discarded).toEqual(['a']);
  });

  it('recover_whenTheBootIdCannotBeRead_discardsWhatEarlierProcessesMarked_andSaysSoOnce', () => {
    // The fallback was the constant 'unknown': every boot matched the markers left before a
    // reboot, and images never fsynced before an OS crash were trusted.
    mkdirSync(markers, { recursive: true });
    writeFileSync(join(markers, 'old'), 'unknown'); // an earlier version's fallback
    writeFileSync(join(markers, 'other'), 'unknown-2f1d6c0e-0000-4000-8000-000000000000'); // another process's
    for (const id of ['old', 'other']) publish(id);
    bootIdUnreadable.on = true;
    try {
      const warn = vi.fn();
      const log = { warn } as unknown as Logger;
      const s = new DeferredSync(markers, log);
      const again = new DeferredSync(markers, log);
      expect(s.boot).not.toBe('unknown');
      expect(again.boot).toBe(s.boot); // one value per process: its own markers match
      expect(warn).toHaveBeenCalledTimes(1);
      const discarded: string[] = [];
      expect(s.recover(dirOf, (id) => discarded.push(id)).sort()).toEqual(['old', 'other']);
      expect(discarded.sort()).toEqual(['old', 'other']);
    } finally {
      bootIdUnreadable.on = false;
    }
  });

  it('recover_withNoMarkerDirectory_findsNothing', () => {
    expect(new DeferredSync(markers).recover(dirOf, () => undefined)).toEqual([]);
  });
});

describe('writeFileDurable', () => {
  it('writesOfOnePathAtOnce_allSucceed_andTheLastOneIsWhatTheFileHolds', async () => {
    const root = mkdtempSync(join(tmpdir(), 'ffwd-'));
    try {
      const path = join(root, 'state');
      // They shared one temp file: one's rename found it gone (ENOENT) and failed.
      await Promise.all(Array.from({ length: 20 }, (_, i) => writeFileDurable(path, `write ${i}`)));
      expect(readFileSync(path, 'utf8')).toBe('write 19');
      expect(readdirSync(root)).toEqual(['state']);
    } finally {
      rmSync(root, { recursive: true, force: true });
    }
  });

  it('writeFileDurable_whenTheRenameOrTheFsyncFails_leavesNoTempFile', async () => {
    const root = mkdtempSync(join(tmpdir(), 'ffwd-'));
    try {
      const path = join(root, 'state');
      // A directory where the file goes: the rename fails (EISDIR); so does a fsync (EIO).
      mkdirSync(join(path, 'x'), { recursive: true });
      await expect(writeFileDurable(path, 'a')).rejects.toThrow();
      expect(readdirSync(root)).toEqual(['state']);
      rmSync(path, { recursive: true });
      failOnce.add(`${path}.tmp`);
      await expect(writeFileDurable(path, 'b')).rejects.toThrow(/EIO/);
      expect(readdirSync(root)).toEqual([]);
    } finally {
      rmSync(root, { recursive: true, force: true });
    }
  });
});

describe('fsyncAll', () => {
  it('whenOneFileCannotBeOpenedAndAnothersFsyncFails_throwsTheFsyncsError_whichAStepAnswersRetryable', async () => {
    // The first error alone (an open's EMFILE) hid another worker's writeback error: the chunk
    // store took nothing for lost and fsynced the file again, which then returned 0.
    const root = mkdtempSync(join(tmpdir(), 'ff-fsyncall-'));
    try {
      const [a, b] = ['a', 'b'].map((n) => join(root, n));
      for (const f of [a!, b!]) writeFileSync(f, f);
      openFailsOnce.add(a!);
      failOnce.add(b!);
      const err = await fsyncAll([a!, b!]).then(() => undefined, (e: unknown) => e);
      expect(err).not.toBeInstanceOf(FsyncOpenError);
      expect((err as { code?: string }).code).toBe('EIO');
      // Answered as its errno: retryable, the host path left out.
      expect(passingSystemError(err, 'storing chunks')).toMatchObject({ kind: 'unavailable', retryable: true });
      openFailsOnce.add(a!);
      await expect(fsyncAll([a!])).rejects.toBeInstanceOf(FsyncOpenError);
    } finally {
      rmSync(root, { recursive: true, force: true });
    }
  });
});
