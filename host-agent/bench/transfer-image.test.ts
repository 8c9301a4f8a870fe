import { afterAll, describe, expect, it } from 'vitest';
import { closeSync, ftruncateSync, mkdtempSync, openSync, rmSync, writeFileSync, writeSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { changedPageBytes, randomBytesSeeded, writeChildImage } from './transfer-image.ts';

const dir = mkdtempSync(join(tmpdir(), 'ff-transfer-image-test-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** A sparse parent of `mib` MiB with random data in its first quarter. */
function parent(name: string, mib: number): string {
  const path = join(dir, name);
  const fd = openSync(path, 'w');
  try {
    ftruncateSync(fd, mib << 20);
    writeSync(fd, randomBytesSeeded(mib << 18, 3), 0, mib << 18, 0);
  } finally {
    closeSync(fd);
  }
  return path;
}

describe('diff image', () => {
  it('writeChildImage_runsThatOverlap_returnsTheDistinctChangedPages_notTheBytesWritten', () => {
    // 2 MiB in runs of 16..256 pages into 1024 pages: runs overlap (seed 7 on the bench's 256 MiB
    // image: 16 MiB written, 15.83 MiB of distinct pages).
    const p = parent('p.img', 4);
    const c = join(dir, 'c.img');
    const changed = writeChildImage(p, c, 2 << 20, 7);
    expect(changed).toBe(changedPageBytes(p, c));
    expect(changed).toBeLessThan(2 << 20);
    expect(changed % 4096).toBe(0);
  });

  it('changedPageBytes_countsEachDifferingPageOnce_andAShorterFilesEndAsZeros', () => {
    const a = join(dir, 'a.img');
    const b = join(dir, 'b.img');
    const base = Buffer.alloc(5 * 4096);
    writeFileSync(a, base);
    const other = Buffer.from(base);
    other[0] = 1; // page 0
    other[4096 + 10] = 1; // page 1, twice
    other[4096 + 20] = 2;
    writeFileSync(b, Buffer.concat([other, Buffer.alloc(4096), Buffer.from([7])])); // a zero page past a's end, then one byte
    expect(changedPageBytes(a, a)).toBe(0);
    expect(changedPageBytes(a, b)).toBe(2 * 4096 + 1);
    expect(changedPageBytes(b, a)).toBe(2 * 4096 + 1);
  });
});
