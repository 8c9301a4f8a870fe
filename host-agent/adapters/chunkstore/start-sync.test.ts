// The start-up sync of a chunk store (FsChunkStore.syncAtStart) that a killed agent left
// chunk files to, never synced. When the file system's sync fails, the agent used to exit,
// and its next start's sync returned 0 (the error is reported once): chunk files whose data
// never reached the disk then counted as present. The fsync is made to fail through
// node:fs/promises' open (the one ../durable.ts fsyncs with), once per path, as on Linux.
import { afterAll, beforeAll, beforeEach, describe, expect, it, vi } from 'vitest';
import { existsSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { FsChunkStore } from './fs-store.ts';
import { encodeChunk } from './codec.ts';
import { tempDir } from '../../../services/testkit/proc.ts';
import { textBytes } from '../../bench/transfer-image.ts';
import { FsyncOpenError } from '../durable.ts';
import { failOnce, openFailsOnce } from '../fsync-fault.ts';

vi.mock('node:fs/promises', async (real) => (await import('../fsync-fault.ts')).failingFsync(await real()));

const CS = 64 * 1024;
let dir: string;
beforeAll(() => {
  dir = tempDir('ff-start-sync-');
});
afterAll(() => rmSync(dir, { recursive: true, force: true }));
beforeEach(() => {
  failOnce.clear();
  openFailsOnce.clear();
});

/** `sync -f` reporting a writeback error (exit status 1). */
const syncFails = (): Promise<never> => Promise.reject(Object.assign(new Error("sync: error syncing '/data/chunks': Input/output error"), { code: 1 }));
const syncPasses = (): Promise<void> => Promise.resolve();

/** A store a killed agent wrote two chunks to, without a sync. */
async function leftByAKilledAgent(name: string): Promise<{ root: string; lost: string; kept: string }> {
  const root = join(dir, name);
  const killed = new FsChunkStore(root, { offload: false });
  const [a, b] = await Promise.all([1, 2].map((i) => encodeChunk(textBytes(CS, i))));
  await killed.put(a!);
  await killed.put(b!);
  return { root, lost: a!.digest, kept: b!.digest };
}

describe('FsChunkStore.syncAtStart', () => {
  it('syncAtStart_whenTheFileSystemSyncFails_removesTheChunkFilesWhoseOwnFsyncFails_andKeepsTheRest', async () => {
    const { root, lost, kept } = await leftByAKilledAgent('fails');
    const store = new FsChunkStore(root, { offload: false });
    failOnce.add(store.pathOf(lost)); // its writeback failed: its own fsync still reports it
    expect(await store.syncAtStart(syncFails)).toEqual({ syncFailed: true, removed: [lost] });
    expect(await store.missing([lost, kept])).toEqual([lost]);
    expect(existsSync(join(root, 'start-sync-failed'))).toBe(false);
    // The next start's sync passes: nothing more to check.
    expect(await new FsChunkStore(root, { offload: false }).syncAtStart(syncPasses)).toEqual({ syncFailed: false, removed: [] });
  });

  it('syncAtStart_afterAStartWhoseCheckWasCutShort_checksAgainThoughTheSyncNowPasses', async () => {
    const { root, lost, kept } = await leftByAKilledAgent('cut-short');
    writeFileSync(join(root, 'start-sync-failed'), 'EIO');
    const store = new FsChunkStore(root, { offload: false });
    failOnce.add(store.pathOf(lost));
    expect((await store.syncAtStart(syncPasses)).removed).toEqual([lost]);
    expect(await store.missing([lost, kept])).toEqual([lost]);
  });

  it('syncAtStart_whenAChunkFileCannotBeOpenedForItsFsync_failsAndLeavesTheCheckToTheNextStart', async () => {
    // EMFILE: the file was not checked, so nothing is known about it; not taken for lost.
    const { root, lost, kept } = await leftByAKilledAgent('unopened');
    const store = new FsChunkStore(root, { offload: false });
    openFailsOnce.add(store.pathOf(kept));
    await expect(store.syncAtStart(syncFails)).rejects.toBeInstanceOf(FsyncOpenError);
    expect(existsSync(join(root, 'start-sync-failed'))).toBe(true);
    failOnce.add(store.pathOf(lost));
    expect((await new FsChunkStore(root, { offload: false }).syncAtStart(syncPasses)).removed).toEqual([lost]);
    expect(await store.missing([lost, kept])).toEqual([lost]);
  });

  it('syncAtStart_whenTheSyncPasses_fsyncsNoChunkFile', async () => {
    const { root, lost } = await leftByAKilledAgent('passes');
    const store = new FsChunkStore(root, { offload: false });
    failOnce.add(store.pathOf(lost));
    expect(await store.syncAtStart(syncPasses)).toEqual({ syncFailed: false, removed: [] });
    expect(failOnce.has(store.pathOf(lost))).toBe(true); // never opened for an fsync
  });
});
