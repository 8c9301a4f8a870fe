import { afterEach, describe, expect, it, vi } from 'vitest';
import { mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, utimesSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { FsJournal, TEMP_SUFFIX } from './fs-journal.ts';
import { MemoryJournal } from './memory-journal.ts';
import type * as FsPromises from 'node:fs/promises';

/** Runs before the journal's next rm (then clears itself): a put arriving while prune removes. */
let beforeRm: (() => Promise<void>) | undefined;
/** The journal's next writeFile writes half its data, then fails with this error (a full disk); cleared once used. */
let writeFails: Error | undefined;
/** The journal's next rename fails with this error (an I/O error); cleared once used. */
let renameFails: Error | undefined;
vi.mock('node:fs/promises', async (importOriginal) => {
  const fs = await importOriginal<typeof FsPromises>();
  return {
    ...fs,
    rm: async (...args: Parameters<typeof fs.rm>) => (await beforeRm?.(), fs.rm(...args)),
    writeFile: async (...args: Parameters<typeof fs.writeFile>) => {
      const e = writeFails;
      if (!e) return fs.writeFile(...args);
      writeFails = undefined;
      await fs.writeFile(args[0], (args[1] as Uint8Array).subarray(0, 1));
      throw e;
    },
    rename: async (...args: Parameters<typeof fs.rename>) => {
      const e = renameFails;
      if (!e) return fs.rename(...args);
      renameFails = undefined;
      throw e;
    },
  };
});

const dirs: string[] = [];
afterEach(() => {
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
});

describe('journal prune', () => {
  it('fsJournal_prune_dropsOnlyOpsLastWrittenBeforeTheCutoff', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'ff-journal-'));
    dirs.push(dir);
    const j = new FsJournal(dir);
    await j.put('op-old', 'restore/h1', new Uint8Array([1]));
    await j.put('op-new', 'restore/h1', new Uint8Array([2]));
    const hourAgo = new Date(Date.now() - 3_600_000);
    utimesSync(join(dir, 'op-old'), hourAgo, hourAgo);
    expect(await j.prune(Date.now() - 60_000)).toBe(1);
    expect(readdirSync(dir)).toEqual(['op-new']);
    expect(readdirSync(join(dir, 'op-new'))).toHaveLength(1);
    expect(await j.get('op-old', 'restore/h1')).toBeUndefined();
    expect([...(await j.get('op-new', 'restore/h1'))!]).toEqual([2]);
    // A pruned op written again is journalled again (its directory is made anew).
    await j.put('op-old', 'restore/h1', new Uint8Array([3]));
    expect([...(await j.get('op-old', 'restore/h1'))!]).toEqual([3]);
  });

  it('fsJournal_aPutToAnOldOpWhilePruneRemovesIt_isKept', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'ff-journal-'));
    dirs.push(dir);
    const j = new FsJournal(dir);
    // An op last written long ago (a sandbox's VM owner record) is written again just as a
    // prune has found it old and is about to remove it: the new result must survive.
    await j.put('op-a', 'claim', new Uint8Array([1]));
    const dayAgo = new Date(Date.now() - 86_400_000);
    utimesSync(join(dir, 'op-a'), dayAgo, dayAgo);
    let put: Promise<void> | undefined;
    beforeRm = async () => {
      beforeRm = undefined;
      put = j.put('op-a', 'claim', new Uint8Array([2]));
      await new Promise((r) => setTimeout(r, 50));
    };
    await j.prune(Date.now() - 60_000);
    await put;
    expect([...((await j.get('op-a', 'claim')) ?? [])]).toEqual([2]);
  });

  it('fsJournal_whenOpened_removesTempFilesEarlierProcessesLeft_alsoOnesWithThisPid_withoutAnyPrune', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'ff-journal-'));
    dirs.push(dir);
    mkdirSync(join(dir, 'op-a'));
    mkdirSync(join(dir, 'op-b'));
    writeFileSync(join(dir, 'op-a', 'x.bin'), 'kept: a result');
    // A killed writer with another pid; one with this pid (an agent that is PID 1 in its
    // container every start), in the old name and the new; and this process's own.
    writeFileSync(join(dir, 'op-a', 'x.bin.tmp-999999'), 'half');
    writeFileSync(join(dir, 'op-a', `y.bin.tmp-${process.pid}`), 'half');
    writeFileSync(join(dir, 'op-b', `z.bin.tmp-${process.pid}.0123456789ab`), 'half');
    writeFileSync(join(dir, 'op-b', `w.bin${TEMP_SUFFIX}`), 'this process is writing it');
    writeFileSync(join(dir, 'leader-term'), '1 2\n');
    // Journal retention 0: the agent never prunes. Opening the journal is enough.
    const j = new FsJournal(dir);
    await j.swept;
    expect(readdirSync(join(dir, 'op-a'))).toEqual(['x.bin']);
    expect(readdirSync(join(dir, 'op-b'))).toEqual([`w.bin${TEMP_SUFFIX}`]);
    expect(await j.leaderTerm()).toEqual({ cluster: 1n, term: 2n, at: expect.any(Number) });
    // Its own temp files are named so that the next process removes them.
    expect(TEMP_SUFFIX).toMatch(new RegExp(`^\\.tmp-${process.pid}\\.[0-9a-f]{12}$`));
  });

  it('fsJournal_putsWhileTheOpeningSweepRuns_areKept', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'ff-journal-'));
    dirs.push(dir);
    for (let i = 0; i < 50; i++) {
      mkdirSync(join(dir, `op-${i}`));
      writeFileSync(join(dir, `op-${i}`, 'x.bin.tmp-999999'), 'half');
    }
    const j = new FsJournal(dir);
    await Promise.all(Array.from({ length: 50 }, (_, i) => j.put(`op-${i}`, 'restore/h1', new Uint8Array([i]))));
    await j.swept;
    for (let i = 0; i < 50; i++) expect([...(await j.get(`op-${i}`, 'restore/h1'))!]).toEqual([i]);
    for (let i = 0; i < 50; i++) expect(readdirSync(join(dir, `op-${i}`))).toHaveLength(1);
  });

  it('fsJournal_opIdsLongerThanAFileNameAllows_areJournalledAndPruned_andUnsafeOnesRefused', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'ff-journal-'));
    dirs.push(dir);
    const j = new FsJournal(dir);
    // A stray VM's stop: stray-<63-character host id>-<sandbox id>-<epoch ms>.
    const long = `stray-${'h'.repeat(63)}-sb-aaaaaaaaaaaaaaaaaaaa-1796312483823`;
    const other = `${long.slice(0, -1)}4`;
    await j.put(long, `stop/sb-aaaaaaaaaaaaaaaaaaaa`, new Uint8Array([7]));
    await j.put(other, `stop/sb-aaaaaaaaaaaaaaaaaaaa`, new Uint8Array([8]));
    expect([...(await j.get(long, 'stop/sb-aaaaaaaaaaaaaaaaaaaa'))!]).toEqual([7]);
    expect([...(await j.get(other, 'stop/sb-aaaaaaaaaaaaaaaaaaaa'))!]).toEqual([8]);
    await j.put('op-a', 'x'.repeat(300), new Uint8Array([9]));
    expect([...(await j.get('op-a', 'x'.repeat(300)))!]).toEqual([9]);
    const hourAgo = new Date(Date.now() - 3_600_000);
    for (const d of readdirSync(dir)) utimesSync(join(dir, d), hourAgo, hourAgo);
    expect(await j.prune(Date.now() - 60_000)).toBe(3);
    await j.put(long, 'again', new Uint8Array([1]));
    expect([...(await j.get(long, 'again'))!]).toEqual([1]);
    await expect(j.get('../etc', 's')).rejects.toThrow(/bad op id/);
  });

  it('fsJournal_putWhoseWriteOrRenameFails_rejectsWithThatError_andLeavesNoTempFile', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'ff-journal-'));
    dirs.push(dir);
    const j = new FsJournal(dir);
    await j.put('op-a', 'restore/h1', new Uint8Array([1, 2]));
    const enospc = Object.assign(new Error('ENOSPC: no space left on device, write'), { code: 'ENOSPC' });
    writeFails = enospc;
    await expect(j.put('op-a', 'restore/h2', new Uint8Array([3, 4]))).rejects.toBe(enospc);
    const eio = Object.assign(new Error('EIO: i/o error, rename'), { code: 'EIO' });
    renameFails = eio;
    await expect(j.put('op-a', 'restore/h1', new Uint8Array([5, 6]))).rejects.toBe(eio);
    // Only the result written before: no partial temp file waits for the next agent start.
    expect(readdirSync(join(dir, 'op-a'))).toEqual([`${Buffer.from('restore/h1').toString('base64url')}.bin`]);
    expect([...(await j.get('op-a', 'restore/h1'))!]).toEqual([1, 2]);
    expect(await j.get('op-a', 'restore/h2')).toBeUndefined();
  });

  it('memoryJournal_prune_dropsTheOldestOpsOnly', async () => {
    const j = new MemoryJournal();
    await j.put('op-a', 's1', new Uint8Array([1]));
    await j.put('op-a', 's2', new Uint8Array([1]));
    const cut = Date.now() + 1;
    await new Promise((r) => setTimeout(r, 5));
    await j.put('op-b', 's1', new Uint8Array([2]));
    expect(await j.prune(cut)).toBe(1);
    expect(await j.get('op-a', 's1')).toBeUndefined();
    expect(await j.get('op-b', 's1')).toEqual(new Uint8Array([2]));
  });
});

describe('journal leader term', () => {
  it('fsJournal_leaderTerm_isNoneAtFirst_keptAcrossInstancesAndPrunes_andAFileHoldingNoTermIsAnError', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'ff-journal-'));
    dirs.push(dir);
    expect(await new FsJournal(join(dir, 'not-made-yet')).leaderTerm()).toBeUndefined();
    const j = new FsJournal(join(dir, 'j'));
    await j.setLeaderTerm({ term: 18_446_744_073_709_551_615n, cluster: 14_841_639_068_965_178_418n });
    await j.setLeaderTerm({ term: 42n, cluster: 14_841_639_068_965_178_418n });
    await j.put('op-old', 'create', new Uint8Array([1]));
    expect(await j.prune(Date.now() + 60_000)).toBe(1); // every op goes; the term stays
    expect(await new FsJournal(join(dir, 'j')).leaderTerm()).toEqual({ term: 42n, cluster: 14_841_639_068_965_178_418n, at: expect.any(Number) });
    writeFileSync(join(dir, 'j', 'leader-term'), '42\n');
    await expect(j.leaderTerm()).rejects.toThrow(/holds no leader term/);
  });

  it('fsJournal_leaderTerm_keepsTheStoreWithTheTerm_andARecordWithoutOne_asAnAgentBeforeStoresWroteIt_loadsWithNone', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'ff-journal-'));
    dirs.push(dir);
    const j = new FsJournal(dir);
    writeFileSync(join(dir, 'leader-term'), '7 10\n'); // kept by an agent before stores
    utimesSync(join(dir, 'leader-term'), 1_700_000_000, 1_700_000_000);
    // When it was written: its store existed by then (a store made later is newer).
    expect(await j.leaderTerm()).toEqual({ cluster: 7n, term: 10n, at: 1_700_000_000_000 });
    await j.setLeaderTerm({ term: 2n, cluster: 9n, store: 18_446_744_073_709_551_615n });
    expect(await new FsJournal(dir).leaderTerm()).toEqual({ term: 2n, cluster: 9n, store: 18_446_744_073_709_551_615n });
    expect(readFileSync(join(dir, 'leader-term'), 'utf8')).toBe('9 2 18446744073709551615\n');
    // No store known: written as the version before wrote it.
    await j.setLeaderTerm({ term: 3n, cluster: 9n, at: 5 });
    expect(readFileSync(join(dir, 'leader-term'), 'utf8')).toBe('9 3\n');
    expect((await j.leaderTerm())?.at).toBeGreaterThan(Date.now() - 60_000);
    writeFileSync(join(dir, 'leader-term'), '9 3 7,\n');
    await expect(j.leaderTerm()).rejects.toThrow(/holds no leader term/);
  });
});
