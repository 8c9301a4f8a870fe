// The image cache: a cache hit is checked (image.json parses and names files that exist with
// the sizes it records) and an entry that fails is built again; concurrent callers in one
// process share one build; and builds are reproducible, so two hosts' builds of one recipe
// hash have the same base disk (a snapshot's disk layer overlays the restoring host's own).
// The tiny image builds in a few seconds, so these build it for real.
import { mkdirSync, readdirSync, readFileSync, rmSync, statSync, truncateSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { cachedImages, ensureImage } from './build.ts';
import { checkImageDir, fileSha256 } from './meta.ts';
import { tempDir } from '../../services/testkit/proc.ts';

const dir = tempDir('ff-image-cache-');
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const BUILD_MS = 120_000;

/** A hand-made cache entry: files of the given sizes and an image.json recording `sizes`. */
function entry(name: string, files: Record<string, number>, meta: Record<string, unknown> = {}): string {
  const d = join(dir, 'fixtures', name);
  mkdirSync(d, { recursive: true });
  for (const [f, n] of Object.entries(files)) writeFileSync(join(d, f), Buffer.alloc(n));
  const sizes = { vmlinux: 10, 'initramfs.cpio': 20, 'disk.qcow2': 30 };
  writeFileSync(
    join(d, 'image.json'),
    JSON.stringify({ name: 'tiny', kernelVersion: 'k', kernel: 'vmlinux', initrd: 'initramfs.cpio', disk: 'disk.qcow2', readyMarker: 'R', diskSha256: 'c'.repeat(64), diskVirtualSize: 1 << 20, sizes, ...meta }),
  );
  return d;
}

describe('image cache entries', () => {
  it('checkImageDir_ofAWholeEntry_returnsItsMeta', async () => {
    const d = entry('whole', { vmlinux: 10, 'initramfs.cpio': 20, 'disk.qcow2': 30 });
    const r = await checkImageDir(d);
    expect('meta' in r && r.meta.diskSha256).toBe('c'.repeat(64));
  });

  it('checkImageDir_ofAnEntryWithATruncatedOrMissingFile_orATornImageJson_saysWhy', async () => {
    const cases: [string, string, RegExp][] = [
      ['short', entry('short', { vmlinux: 10, 'initramfs.cpio': 20, 'disk.qcow2': 0 }), /disk.qcow2 has 0 bytes, image.json says 30/],
      ['missing', entry('missing', { vmlinux: 10, 'initramfs.cpio': 20 }), /disk.qcow2 missing/],
      ['nosizes', entry('nosizes', { vmlinux: 10, 'initramfs.cpio': 20, 'disk.qcow2': 30 }, { sizes: undefined }), /no sizes/],
      ['nodigest', entry('nodigest', { vmlinux: 10, 'initramfs.cpio': 20, 'disk.qcow2': 30 }, { diskSha256: undefined }), /no diskSha256/],
      ['escape', entry('escape', { vmlinux: 10, 'initramfs.cpio': 20, 'disk.qcow2': 30 }, { disk: '../whole/disk.qcow2' }), /disk is not a file name/],
    ];
    const torn = entry('torn', { vmlinux: 10, 'initramfs.cpio': 20, 'disk.qcow2': 30 });
    writeFileSync(join(torn, 'image.json'), '{"name":"tiny","ker');
    cases.push(['torn', torn, /does not parse/], ['empty', join(dir, 'fixtures', 'nothing'), /image.json: ENOENT/]);
    for (const [, d, why] of cases) {
      const r = await checkImageDir(d);
      expect('invalid' in r && r.invalid).toMatch(why);
    }
  });

  it(
    'ensureImage_whenTheCachedDiskIsTruncatedOrImageJsonTorn_buildsTheEntryAgain_andKeepsAWholeOne_andCachedImagesListsOnlyWholeEntries',
    async () => {
      const cacheDir = join(dir, 'rebuild');
      const first = await ensureImage('tiny', { cacheDir });
      const size = statSync(first.disk).size;
      const digest = await fileSha256(first.disk);
      expect(first.diskSha256).toBe(digest);

      // A whole entry is used as it is.
      const ino = statSync(first.disk).ino;
      expect((await ensureImage('tiny', { cacheDir })).disk).toBe(first.disk);
      expect(statSync(first.disk).ino).toBe(ino);

      // What an agent lists in its heartbeats from its start.
      expect(await cachedImages({ cacheDir })).toEqual([{ name: 'tiny', recipeHash: first.recipeHash, diskSha256: digest }]);

      // What a power loss before the data reached the disk can leave: the name, short files.
      truncateSync(first.disk, 4096);
      expect(await cachedImages({ cacheDir })).toEqual([]);
      const again = await ensureImage('tiny', { cacheDir });
      expect(again.disk).toBe(first.disk);
      expect(statSync(again.disk).size).toBe(size);
      expect(await fileSha256(again.disk)).toBe(digest);

      writeFileSync(join(cacheDir, 'images', `tiny-${first.recipeHash}`, 'image.json'), '');
      const third = await ensureImage('tiny', { cacheDir });
      expect(await fileSha256(third.disk)).toBe(digest);
      expect(JSON.parse(readFileSync(join(cacheDir, 'images', `tiny-${first.recipeHash}`, 'image.json'), 'utf8'))).toMatchObject({ diskSha256: digest });
      // Nothing left over: no temp or broken entries beside it.
      expect(readdirSync(join(cacheDir, 'images'))).toEqual([`tiny-${first.recipeHash}`]);
    },
    BUILD_MS,
  );

  it(
    'ensureImage_calledConcurrentlyOnAColdCache_runsOneBuild',
    async () => {
      const cacheDir = join(dir, 'single-flight');
      const root = join(cacheDir, 'images');
      // Every build makes a temp dir named .tiny-<hash>.build-<pid>-...: record those seen.
      const seen = new Set<string>();
      let done = false;
      const watch = (async () => {
        while (!done) {
          try {
            for (const n of readdirSync(root)) if (n.includes('.build-')) seen.add(n);
          } catch {
            // not made yet
          }
          await new Promise((r) => setTimeout(r, 10));
        }
      })();
      try {
        const images = await Promise.all([1, 2, 3].map(() => ensureImage('tiny', { cacheDir })));
        expect(new Set(images.map((i) => i.disk)).size).toBe(1);
      } finally {
        done = true;
        await watch;
      }
      expect([...seen]).toHaveLength(1);
    },
    BUILD_MS,
  );

  it(
    'ensureImage_twiceIntoTwoCacheDirs_buildsTheSameBytes',
    async () => {
      const a = await ensureImage('tiny', { cacheDir: join(dir, 'host-a') });
      // Later, so that anything taken from the clock would differ.
      await new Promise((r) => setTimeout(r, 1100));
      const b = await ensureImage('tiny', { cacheDir: join(dir, 'host-b') });
      expect(a.recipeHash).toBe(b.recipeHash);
      expect(a.disk).not.toBe(b.disk);
      expect(await fileSha256(a.disk)).toBe(await fileSha256(b.disk));
      expect(a.diskSha256).toBe(b.diskSha256);
      for (const f of ['kernel', 'initrd'] as const) expect(await fileSha256(a[f])).toBe(await fileSha256(b[f]));
    },
    BUILD_MS,
  );
});
