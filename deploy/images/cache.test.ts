// The image cache when the file system fails (cache.int.test.ts builds real images): an entry
// whose files cannot be read now (EIO, EMFILE, EACCES) is an error, never a reason to remove
// it (running VMs overlay its disk, snapshots name it); and the housekeeping of abandoned
// build dirs never fails the image asked for. Faults are injected per path into
// node:fs/promises; everything else reaches the real file system.
import type * as FsPromises from 'node:fs/promises';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, afterEach, describe, expect, it, vi } from 'vitest';
import { cachedImage, cachedImages, ensureImage, recipeHash, removeAbandonedBuilds } from './build.ts';
import { checkImageDir } from './meta.ts';

/** Per operation, the paths that fail and the errno code they fail with. */
const faults = vi.hoisted(() => ({ readFile: new Map<string, string>(), stat: new Map<string, string>(), rm: new Map<string, string>() }));

vi.mock('node:fs/promises', async (importOriginal) => {
  const fs = await importOriginal<typeof FsPromises>();
  const failing = <A extends unknown[], R>(op: keyof typeof faults, f: (p: never, ...rest: A) => Promise<R>) =>
    (async (p: unknown, ...rest: A): Promise<R> => {
      const code = faults[op].get(String(p));
      if (code) throw Object.assign(new Error(`${code}: injected, ${op} '${String(p)}'`), { code });
      return f(p as never, ...rest);
    }) as unknown as typeof f;
  const mocked = { ...fs, readFile: failing('readFile', fs.readFile), stat: failing('stat', fs.stat), rm: failing('rm', fs.rm) };
  return { ...mocked, default: mocked };
});

const dir = mkdtempSync(join(tmpdir(), 'ff-image-cache-unit-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
afterEach(() => {
  for (const m of Object.values(faults)) m.clear();
});

/** A whole-looking cache entry at `d`: its files and an image.json recording their sizes. */
function entry(d: string): string {
  mkdirSync(d, { recursive: true });
  const sizes = { vmlinux: 10, 'initramfs.cpio': 20, 'disk.qcow2': 30 };
  for (const [f, n] of Object.entries(sizes)) writeFileSync(join(d, f), Buffer.alloc(n));
  writeFileSync(
    join(d, 'image.json'),
    JSON.stringify({ name: 'tiny', kernelVersion: 'k', kernel: 'vmlinux', initrd: 'initramfs.cpio', disk: 'disk.qcow2', readyMarker: 'R', diskSha256: 'c'.repeat(64), diskVirtualSize: 1 << 20, sizes }),
  );
  return d;
}

describe('image cache entries that cannot be read', () => {
  it('cachedImage_tellsAWholeEntry_aMissingOne_andOneThatCannotBeReadNow_apart', async () => {
    const cacheDir = join(dir, 'one');
    const d = entry(join(cacheDir, 'images', 'tiny-0123456789abcdef'));
    expect(await cachedImage('tiny', '0123456789abcdef', { cacheDir })).toBe('whole');
    faults.readFile.set(join(d, 'image.json'), 'EIO');
    expect(await cachedImage('tiny', '0123456789abcdef', { cacheDir })).toBe('unknown');
    faults.readFile.clear();
    expect(await cachedImage('tiny', 'fedcba9876543210', { cacheDir })).toBe('missing');
  });

  it('checkImageDir_whenAFileCannotBeReadForAnotherReasonThanItsAbsence_throws_andAMissingOneIsInvalid', async () => {
    const d = entry(join(dir, 'eio'));
    expect('meta' in (await checkImageDir(d))).toBe(true);
    faults.readFile.set(join(d, 'image.json'), 'EIO');
    await expect(checkImageDir(d)).rejects.toMatchObject({ code: 'EIO' });
    faults.readFile.clear();
    faults.stat.set(join(d, 'disk.qcow2'), 'EACCES');
    await expect(checkImageDir(d)).rejects.toMatchObject({ code: 'EACCES' });
    faults.stat.clear();
    // Absent: the entry is not whole (its caller builds it again).
    rmSync(join(d, 'disk.qcow2'));
    expect(await checkImageDir(d)).toEqual({ invalid: 'disk.qcow2 missing' });
    expect(await checkImageDir(join(dir, 'nothing'))).toEqual({ invalid: 'image.json: ENOENT' });
  });

  it('ensureImage_whenTheCacheEntryCannotBeRead_failsNamingIt_andLeavesTheEntry_andCachedImagesLeavesItOut', async () => {
    const cacheDir = join(dir, 'ensure');
    const opts = { cacheDir, kernelVersion: 'k' };
    const { hash } = await recipeHash('tiny', opts);
    const d = entry(join(cacheDir, 'images', `tiny-${hash}`));
    expect(await cachedImages({ cacheDir })).toEqual([{ name: 'tiny', recipeHash: hash, diskSha256: 'c'.repeat(64) }]);
    faults.readFile.set(join(d, 'image.json'), 'EMFILE');
    expect(await cachedImages({ cacheDir })).toEqual([]);
    await expect(ensureImage('tiny', opts)).rejects.toThrow(/image tiny build failed: the cache entry .* cannot be read \(left as it is\)/);
    expect(readdirSync(join(cacheDir, 'images'))).toEqual([`tiny-${hash}`]);
    expect(readdirSync(d).sort()).toEqual(['disk.qcow2', 'image.json', 'initramfs.cpio', 'vmlinux']);
    // Once it can be read again, it is the image.
    faults.readFile.clear();
    expect((await ensureImage('tiny', opts)).disk).toBe(join(d, 'disk.qcow2'));
  });
});

describe('abandoned builds', () => {
  it('removeAbandonedBuilds_whenADirCannotBeRemoved_warnsAndGoesOn_withoutFailing', async () => {
    const root = join(dir, 'abandoned');
    // PIDs no process has (above the kernel's pid_max).
    const stuck = `.tiny-0123456789abcdef.build-4194305-AbC123`;
    const other = `.tiny-0123456789abcdef.build-4194306-XyZ789`;
    for (const n of [stuck, other]) mkdirSync(join(root, n, 'sub'), { recursive: true });
    faults.rm.set(join(root, stuck), 'EACCES');
    const warn = vi.spyOn(process, 'emitWarning').mockImplementation(() => undefined);
    try {
      expect(await removeAbandonedBuilds(root)).toEqual([other]);
      expect(warn).toHaveBeenCalledWith(expect.stringContaining(`the abandoned image build ${join(root, stuck)} could not be removed: EACCES`));
    } finally {
      warn.mockRestore();
    }
    expect(existsSync(join(root, stuck))).toBe(true);
    expect(existsSync(join(root, other))).toBe(false);
  });
});
