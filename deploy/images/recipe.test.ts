// The tiny image's recipe hash covers the shared libraries build-tiny.sh copies with qemu-ga
// (ldd's closure), so an update of one of them (libc, glib) builds the image again.
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { closureDigest, packageVersions, recipeInputs } from './build.ts';
import { IMAGE_NAMES } from './names.ts';

describe('image recipe inputs', () => {
  it('closureDigest_ofQemuGa_namesEachLibraryItLoads_withItsContentDigest', async () => {
    const lines = (await closureDigest('/usr/sbin/qemu-ga')).trim().split('\n');
    for (const lib of ['libglib-2.0.so.0', 'libc.so.6', 'ld-linux-x86-64.so.2']) expect(lines.some((l) => l.includes(lib))).toBe(true);
    for (const l of lines) expect(l).toMatch(/^\/\S+ [0-9a-f]{64}$/);
    // The same closure digests the same: the hash is stable between runs.
    expect(await closureDigest('/usr/sbin/qemu-ga')).toBe(lines.join('\n') + '\n');
  });

  it.each(IMAGE_NAMES)('recipe %s_namesThePackageOfEachToolThatWritesTheImagesBytes', (name) => {
    const { script, packages } = recipeInputs(name);
    const text = readFileSync(join(import.meta.dirname, script), 'utf8');
    // A new version of one of these can change the image, so its version is in the recipe hash.
    // xz unpacks the kernel: missing, the build would say only that the extraction failed.
    const tools: Array<[RegExp, string]> = [[/\bcpio --null -o\b/, 'cpio'], [/\bmkext4\.sh\b/, 'e2fsprogs'], [/\bqemu-img convert\b/, 'qemu-utils'], [/\/bin\/busybox\b/, 'busybox-static'], [/\bxz -dc\b/, 'xz-utils'], [/\bzstd -qdc\b/, 'zstd']];
    for (const [call, pkg] of tools) if (call.test(text)) expect([name, pkg, packages.includes(pkg)]).toEqual([name, pkg, true]);
    expect(text).toMatch(/\bcpio --null -o\b/);
  });

  it('packageVersions_withAPackageMissing_failsNamingTheImageAndOnlyTheMissingPackages', async () => {
    const err = await packageVersions('tiny', ['cpio', 'forkfleet-no-such-package']).catch((e: unknown) => e as Error);
    expect(err).toBeInstanceOf(Error);
    expect((err as Error).message).toBe('image tiny build failed: missing Debian packages forkfleet-no-such-package (apt-get install forkfleet-no-such-package)');
  });

  it('closureDigest_ofAMissingBinary_failsNamingIt', async () => {
    await expect(closureDigest('/nonexistent/qemu-ga')).rejects.toThrow(/ldd \/nonexistent\/qemu-ga failed/);
  });
});
