// The RAM pool's limits (keep, maxMib) under files that come back at the same time: VMs
// destroyed together, a fill that ends while a VM's file comes back. Free files are host memory
// (huge-page tmpfs) the scheduler does not count, so the pool must never keep more than its
// limits. No tmpfs is needed: the pool is made on a plain directory (open() would mount one).
// Renames are held until every racer has checked for room, as they are when the disk is slow.
import { afterAll, afterEach, describe, expect, it, vi } from 'vitest';
import type * as FsPromises from 'node:fs/promises';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import { RamPool, ramFileOf, type RamPoolOptions } from './ram-pool.ts';

const gate = vi.hoisted(() => ({ held: Promise.resolve() }));
vi.mock('node:fs/promises', async (importReal) => {
  const real = await importReal<typeof FsPromises>();
  const rename: typeof real.rename = async (from, to) => {
    await gate.held;
    return real.rename(from, to);
  };
  return { ...real, rename, default: { ...real, rename } };
});

/** Holds every rename until the returned function is called. */
function holdRenames(): () => void {
  let release!: () => void;
  gate.held = new Promise((r) => (release = r));
  return release;
}

const base = mkdtempSync(join(tmpdir(), 'ff-ram-pool-'));
afterAll(() => rmSync(base, { recursive: true, force: true }));
afterEach(() => {
  gate.held = Promise.resolve();
});

/** The pool's private parts the tests drive. */
interface PoolInternals {
  filled(path: string, mib: number, n: string, code: number | null, ms: number): Promise<void>;
}

let n = 0;
function pool(o: Partial<RamPoolOptions> = {}): { pool: RamPool; dir: string } {
  const dir = join(base, `pool-${++n}`);
  mkdirSync(dir);
  // The constructor is private (open() mounts the tmpfs first).
  const Ctor = RamPool as unknown as new (dir: string, o: RamPoolOptions) => RamPool;
  return { pool: new Ctor(dir, { mount: dir, keep: 1, maxMib: 1, logger: pino({ level: 'silent' }), ...o }), dir };
}

const MIB = 1048576;
const freeFiles = (dir: string): string[] => readdirSync(dir).filter((f) => f.startsWith('free-'));

describe('RamPool limits', () => {
  it('recycle_ofVmsDestroyedTogether_keepsNoMoreThanKeepAndMaxMib', async () => {
    const { pool: p, dir } = pool({ keep: 1, maxMib: 1 });
    for (const id of ['a', 'b', 'c']) writeFileSync(ramFileOf(dir, id), Buffer.alloc(MIB));
    const release = holdRenames();
    const recycled = Promise.all(['a', 'b', 'c'].map((id) => p.recycle(id)));
    await new Promise((r) => setTimeout(r, 50)); // every recycle has checked for room
    release();
    await recycled;
    expect(p.size).toBe(1);
    expect(freeFiles(dir)).toHaveLength(1);
    expect(readdirSync(dir).filter((f) => f.startsWith('vm-'))).toEqual([]);
  });

  it('filled_whileAVmsFileIsRecycled_keepsNoMoreThanKeepAndMaxMib', async () => {
    const { pool: p, dir } = pool({ keep: 1, maxMib: 1 });
    writeFileSync(ramFileOf(dir, 'a'), Buffer.alloc(MIB));
    const fill = join(dir, '.fill-1-abc');
    writeFileSync(fill, Buffer.alloc(MIB));
    const release = holdRenames();
    const both = Promise.all([(p as unknown as PoolInternals).filled(fill, 1, 'abc', 0, 0), p.recycle('a')]);
    await new Promise((r) => setTimeout(r, 50));
    release();
    await both;
    expect(p.size).toBe(1);
    expect(freeFiles(dir)).toHaveLength(1);
    expect(readdirSync(dir).filter((f) => !f.startsWith('free-'))).toEqual([]);
  });

  it('take_byAnIncomingStandby_countsItsFileInKeepAndMaxMib_untilAVmAdoptsIt', async () => {
    // Each limit on its own: the other leaves room for two files.
    for (const limits of [{ keep: 2, maxMib: 1 }, { keep: 1, maxMib: 2 }]) {
      const { pool: p, dir } = pool(limits);
      const fill = async (n: string): Promise<void> => {
        writeFileSync(join(dir, `.fill-1-${n}`), Buffer.alloc(MIB));
        await (p as unknown as PoolInternals).filled(join(dir, `.fill-1-${n}`), 1, n, 0, 0);
      };
      await fill('a1');
      expect(await p.take('incoming-a', 1, { waitForFill: true })).toEqual({ path: ramFileOf(dir, 'incoming-a'), filled: true });
      // The standby's file is host memory no VM books: a free one beside it went over the limits.
      await fill('b2');
      expect(freeFiles(dir)).toEqual([]);
      // Once a VM has it, the scheduler books it: the pool has its room again.
      p.adopted('incoming-a');
      await fill('c3');
      expect(freeFiles(dir)).toHaveLength(1);
      await p.close();
    }
  });
});

describe('RamPool close', () => {
  it('close_whileARecycledFileIsBeingRenamedIn_leavesNoFileBehind', async () => {
    const { pool: p, dir } = pool({ keep: 1, maxMib: 1 });
    writeFileSync(ramFileOf(dir, 'a'), Buffer.alloc(MIB));
    const release = holdRenames();
    const recycled = p.recycle('a');
    await new Promise((r) => setTimeout(r, 50)); // the recycle has found room and is renaming
    const closed = p.close();
    await new Promise((r) => setTimeout(r, 50)); // a close() that did not wait has removed the free files by now
    release();
    await Promise.all([closed, recycled]);
    // A free file left after close() pinned tmpfs memory nothing counts or removes.
    expect(existsSync(dir) ? readdirSync(dir) : []).toEqual([]);
    expect(p.size).toBe(0);
  });
});
