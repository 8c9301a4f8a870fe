// The tiny image's recipe hash covers the shared libraries build-tiny.sh copies with qemu-ga
// (ldd's closure), so an update of one of them (libc, glib) builds the image again.
import { describe, expect, it } from 'vitest';
import { closureDigest } from './build.ts';

describe('image recipe inputs', () => {
  it('closureDigest_ofQemuGa_namesEachLibraryItLoads_withItsContentDigest', async () => {
    const lines = (await closureDigest('/usr/sbin/qemu-ga')).trim().split('\n');
    for (const lib of ['libglib-2.0.so.0', 'libc.so.6', 'ld-linux-x86-64.so.2']) expect(lines.some((l) => l.includes(lib))).toBe(true);
    for (const l of lines) expect(l).toMatch(/^\/\S+ [0-9a-f]{64}$/);
    // The same closure digests the same: the hash is stable between runs.
    expect(await closureDigest('/usr/sbin/qemu-ga')).toBe(lines.join('\n') + '\n');
  });

  it('closureDigest_ofAMissingBinary_failsNamingIt', async () => {
    await expect(closureDigest('/nonexistent/qemu-ga')).rejects.toThrow(/ldd \/nonexistent\/qemu-ga failed/);
  });
});
