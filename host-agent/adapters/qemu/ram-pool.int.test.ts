// The RAM pool against real tmpfs mounts (mounted by the tests under their own temp dir and
// unmounted at the end): huge pages, filled files, reaping and cleanup.
import { execFileSync } from 'node:child_process';
import { mkdir, readdir, rm, stat, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { pino } from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { waitFor, tempDir } from '../../../services/testkit/proc.ts';
import { RamPool, ramDirFor, tmpfsOptions } from './ram-pool.ts';

const logger = pino({ level: process.env.LOG_LEVEL ?? 'warn' });
let base: string;
const mounted: string[] = [];

beforeAll(async () => {
  base = tempDir('ffram-');
});

afterAll(async () => {
  // Every mount goes, also when a failed test left a fill writing into one ("target is busy"):
  // that one is detached (lazy unmount) and freed when the writer ends.
  const failed: unknown[] = [];
  for (const m of mounted.reverse()) {
    try {
      execFileSync('umount', [m], { stdio: 'pipe' });
    } catch {
      try {
        execFileSync('umount', ['-l', m], { stdio: 'pipe' });
      } catch (e) {
        // Every other mount still goes; the failure is reported after.
        failed.push(e);
      }
    }
  }
  await rm(base, { recursive: true, force: true });
  if (failed.length > 0) throw failed[0];
});

async function openPool(name: string, keep: number, o: { recycleWaitMs?: number } = {}): Promise<{ pool: RamPool; mount: string }> {
  const mount = join(base, name);
  const pool = await RamPool.open(join(base, `root-${name}`), { mount, keep, maxMib: 1024, logger, ...o });
  if ((await tmpfsOptions(mount)) && !mounted.includes(mount)) mounted.push(mount);
  if (!pool) throw new Error('pool did not open');
  return { pool, mount };
}

describe('RamPool (real tmpfs)', () => {
  it('open_whenNothingIsMounted_mountsAHugePageTmpfs_andTwoRootsGetTwoDirectories', async () => {
    const { pool, mount } = await openPool('a', 0);
    expect(await tmpfsOptions(mount)).toContain('huge=always');
    expect(pool.dir).toBe(ramDirFor(mount, join(base, 'root-a')));
    expect(ramDirFor(mount, join(base, 'root-b'))).not.toBe(pool.dir);
    await pool.close();
    expect(await readdir(mount)).toEqual([]);
  });

  it('open_whenTheMountIsATmpfsWithoutHugePages_refusesSoVmsKeepAnonymousRam', async () => {
    const mount = join(base, 'plain');
    await mkdir(mount);
    execFileSync('mount', ['-t', 'tmpfs', '-o', 'size=16m', 'ff-test-plain', mount]);
    mounted.push(mount);
    expect(await RamPool.open(join(base, 'root-plain'), { mount, keep: 1, maxMib: 1024, logger })).toBeUndefined();
  });

  it('take_withWaitForFill_whenNoFreeFileAndNoneComesBack_fillsOneAndHandsItOutFilled', async () => {
    const { pool, mount } = await openPool('w', 1, { recycleWaitMs: 50 });
    const t = await pool.take('sb1', 8, { waitForFill: true });
    expect(t).toEqual({ path: join(pool.dir, 'vm-sb1.ram'), filled: true });
    expect((await stat(t.path)).size).toBe(8 << 20);
    expect(pool.size).toBe(0);
    await pool.release('sb1');
    await pool.close();
    expect(await readdir(mount)).toEqual([]);
  });

  it('close_whileAFinishedFillIsBeingMadeAFreeFile_leavesNothingBehind', async () => {
    const { pool, mount } = await openPool('z', 1);
    // close() in the moment a fill's process has ended and its file is being renamed into a
    // free one (a take that got its file, then a release and a close, met it now and then).
    const internals = pool as unknown as { filled: (...a: unknown[]) => Promise<void> };
    const filled = internals.filled.bind(pool);
    let closing: Promise<void> | undefined;
    internals.filled = (...a) => {
      const settled = filled(...a);
      closing ??= pool.close();
      return settled;
    };
    // A take with no free file remembers the size (QEMU makes the VM's file); refill fills one.
    expect(await pool.take('vm', 8)).toEqual({ path: join(pool.dir, 'vm-vm.ram'), filled: false });
    pool.refill();
    await waitFor('the fill to end', async () => closing !== undefined, 10_000, 1);
    await closing;
    expect(await readdir(mount)).toEqual([]);
  });

  it('take_withWaitForFill_whenAVmsFileComesBackWithinTheWait_takesItAndFillsNothing', async () => {
    const { pool, mount } = await openPool('q', 1);
    const old = join(pool.dir, 'vm-old.ram');
    await writeFile(old, Buffer.alloc(8 << 20, 1));
    const ino = (await stat(old)).ino;
    try {
      const taking = pool.take('sb', 8, { waitForFill: true });
      await pool.recycle('old');
      const t = await taking;
      expect(t).toEqual({ path: join(pool.dir, 'vm-sb.ram'), filled: true });
      expect((await stat(t.path)).ino).toBe(ino);
      // No fill ran or runs: the only file is the one taken.
      expect(await readdir(pool.dir)).toEqual(['vm-sb.ram']);
      await pool.release('sb');
    } finally {
      await pool.close();
    }
    expect(await readdir(mount)).toEqual([]);
  });

  it('take_withWaitForFill_whenAVmsFileComesBackDuringTheFill_takesThatFileWithoutWaitingForTheFill', async () => {
    const { pool, mount } = await openPool('r', 1, { recycleWaitMs: 0 });
    // A gone VM's file, written (so its pages exist), given back while the standby waits.
    const old = join(pool.dir, 'vm-old.ram');
    await writeFile(old, Buffer.alloc(128 << 20, 1));
    const ino = (await stat(old)).ino;
    const filling = async (): Promise<boolean> => (await readdir(pool.dir)).some((f) => f.startsWith('.fill-128-'));
    try {
      const taking = pool.take('sb', 128, { waitForFill: true });
      await waitFor('the fill to start', filling, 10_000, 1);
      await pool.recycle('old');
      const t = await taking;
      // The fill is still running (it renames its file when done): the take did not wait for it.
      expect(await filling()).toBe(true);
      expect(t).toEqual({ path: join(pool.dir, 'vm-sb.ram'), filled: true });
      expect((await stat(t.path)).ino).toBe(ino);
      await pool.release('sb');
    } finally {
      await pool.close();
    }
    expect(await readdir(mount)).toEqual([]);
  });

  it('take_afterARefill_handsOutAFilledFileOfThatSize_andReleaseRemovesIt', async () => {
    const { pool } = await openPool('b', 1);
    // Nothing filled yet: a path QEMU will create, and the size is remembered for the fill.
    const first = await pool.take('vm1', 8);
    expect(first).toEqual({ path: join(pool.dir, 'vm-vm1.ram'), filled: false });
    pool.refill();
    await waitFor('a filled file', async () => pool.size === 1, 20_000, 20);
    const free = (await readdir(pool.dir)).filter((f) => f.startsWith('free-8-'));
    expect(free).toHaveLength(1);
    const second = await pool.take('vm2', 8);
    expect(second).toEqual({ path: join(pool.dir, 'vm-vm2.ram'), filled: true });
    const st = await stat(second.path);
    // Written, not sparse: its pages exist before any VM touches them.
    expect(st.size).toBe(8 << 20);
    expect(st.blocks * 512).toBeGreaterThanOrEqual(8 << 20);
    // Another size finds nothing filled.
    expect((await pool.take('vm3', 4)).filled).toBe(false);
    await pool.release('vm2');
    await expect(stat(second.path)).rejects.toThrow();
    await pool.release('vm-never-had-one');
    await pool.close();
  });

  it('recycle_whenAVmIsGone_itsFileServesTheNextVmOfThatSize_untilThePoolIsFull', async () => {
    const { pool } = await openPool('e', 1);
    const a = await pool.take('a', 2);
    const b = await pool.take('b', 2);
    for (const p of [a.path, b.path]) await writeFile(p, Buffer.alloc(2 << 20, 7));
    await pool.recycle('a');
    await pool.recycle('b');
    // The pool keeps one: a's file is free now, b's is gone.
    expect(pool.size).toBe(1);
    await expect(stat(b.path)).rejects.toThrow();
    expect(await pool.take('c', 2)).toEqual({ path: join(pool.dir, 'vm-c.ram'), filled: true });
    // With a file free for that size, no fill starts.
    await pool.recycle('c');
    pool.refill();
    expect((await readdir(pool.dir)).filter((f) => f.startsWith('.fill-'))).toEqual([]);
    await pool.recycle('never-had-one');
    await pool.close();
  });

  it('refill_whenARecycledFileTookTheRoomDuringTheFill_dropsTheFilledFile', async () => {
    const { pool } = await openPool('h', 1);
    try {
      // A fill big enough to still run while a small VM's file comes back. It starts
      // asynchronously (a loaded machine took longer than the steps below): waited for.
      await pool.take('big', 512);
      pool.refill();
      const filling = async (): Promise<boolean> => (await readdir(pool.dir)).some((f) => f.startsWith('.fill-512-'));
      await waitFor('the fill started', filling, 10_000, 5);
      const a = await pool.take('a', 4);
      await writeFile(a.path, Buffer.alloc(4 << 20, 1));
      await pool.recycle('a');
      expect(pool.size).toBe(1);
      expect(await filling()).toBe(true);
      await waitFor('the fill ended', async () => !(await readdir(pool.dir)).some((f) => f.startsWith('.fill-')), 30_000, 20);
      await new Promise((r) => setTimeout(r, 50));
      expect(pool.size).toBe(1);
      expect((await readdir(pool.dir)).filter((f) => f.startsWith('free-'))).toEqual([expect.stringMatching(/^free-4-/)]);
    } finally {
      await pool.close(); // stops a fill still running, or the tmpfs cannot be unmounted
    }
  });

  it('recycleAndRefill_keepNoFileThatWouldTakeThePoolOverItsSizeCap', async () => {
    const mount = join(base, 'g');
    const pool = (await RamPool.open(join(base, 'root-g'), { mount, keep: 4, maxMib: 6, logger }))!;
    mounted.push(mount);
    const big = await pool.take('big', 8);
    await writeFile(big.path, Buffer.alloc(8 << 20));
    await pool.recycle('big');
    await expect(stat(big.path)).rejects.toThrow();
    expect(pool.size).toBe(0);
    // Not filled either; a size within the cap is.
    pool.refill();
    expect((await readdir(pool.dir)).filter((f) => f.startsWith('.fill-'))).toEqual([]);
    await pool.take('small', 4);
    pool.refill();
    await waitFor('the small size filled', async () => pool.size === 1, 20_000, 20);
    await pool.close();
  });

  it('open_afterACrash_dropsPartialFills_keepsFilledFiles_andReapRemovesOnlyGoneVmsFiles', async () => {
    const { pool } = await openPool('c', 1);
    await pool.take('keep', 4);
    pool.refill();
    await waitFor('a filled file', async () => pool.size === 1, 20_000, 20);
    // What a killed agent leaves: a live VM's file, a gone VM's file, a half-done fill.
    await writeFile(join(pool.dir, 'vm-keep.ram'), '');
    await writeFile(join(pool.dir, 'vm-gone.ram'), '');
    await writeFile(join(pool.dir, '.fill-4-abc'), '');
    const again = await RamPool.open(join(base, 'root-c'), { mount: join(base, 'c'), keep: 1, maxMib: 1024, logger });
    expect(again?.size).toBe(1);
    expect(await again?.reap(new Set(['keep']))).toEqual(['gone']);
    expect((await readdir(pool.dir)).sort()).toEqual([expect.stringMatching(/^free-4-[0-9a-f]+\.ram$/), 'vm-keep.ram']);
    await again?.release('keep');
    await again?.close();
    await expect(stat(pool.dir)).rejects.toThrow();
  });

  it('open_afterAnAgentWithLargerLimits_removesTheFreeFilesOverThisOnesKeepAndSize_largestFirst', async () => {
    const mount = join(base, 'k');
    const pool = await RamPool.open(join(base, 'root-k'), { mount, keep: 3, maxMib: 1024, prefillMib: [2, 4, 8], logger });
    mounted.push(mount);
    await waitFor('three sizes filled', async () => pool?.size === 3, 20_000, 20);
    // The agent is killed and starts again with a smaller pool: two files at most, 8 MiB in all.
    const again = await RamPool.open(join(base, 'root-k'), { mount, keep: 2, maxMib: 8, logger });
    expect(again?.size).toBe(2);
    expect((await readdir(again!.dir)).map((f) => f.replace(/-[0-9a-f]+\.ram$/, '')).sort()).toEqual(['free-2', 'free-4']);
    await again?.close();
  });

  it('open_withPrefillSizes_fillsOneFileOfEachBeforeAnyRestoreAsks', async () => {
    const mount = join(base, 'f');
    const pool = await RamPool.open(join(base, 'root-f'), { mount, keep: 2, maxMib: 1024, prefillMib: [4, 2], logger });
    mounted.push(mount);
    await waitFor('both sizes filled', async () => pool?.size === 2, 20_000, 20);
    expect((await readdir(pool!.dir)).map((f) => f.replace(/-[0-9a-f]+\.ram$/, '')).sort()).toEqual(['free-2', 'free-4']);
    expect((await pool!.take('x', 2)).filled).toBe(true);
    await pool!.close();
  });

  it('close_duringAFill_stopsItAndLeavesNothing', async () => {
    const { pool, mount } = await openPool('d', 2);
    await pool.take('x', 512);
    pool.refill();
    await pool.close();
    expect(await readdir(mount)).toEqual([]);
  });
});
