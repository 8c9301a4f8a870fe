// A VM's QEMU that exits while snapshot() runs: the crash watcher records the VM crashed
// between snapshot()'s awaits. Before the snapshot starts, the caller hears that the VM crashed
// and no directory is left; once the snapshot is sealed, it is complete and valid, so it is
// returned and the VM stays crashed. And removeGenFiles takes every file of a generation.
// No QEMU runs: the snapshot is driven through the driver's record of a VM, with its QEMU
// steps (the version probe, the receiver's stream) stood in for.
import { afterAll, describe, expect, it } from 'vitest';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import { VmCrashedError } from '../../errors.ts';
import { QemuVmmDriver } from './driver.ts';
import { runningVmRecord } from './vm-record.fixture.ts';
import type { FakeVmRecord } from './vm-record.fixture.ts';

const base = mkdtempSync(join(tmpdir(), 'ff-snapshot-crash-'));
afterAll(() => rmSync(base, { recursive: true, force: true }));

type FakeRec = FakeVmRecord & { unsealed?: unknown };
/** The driver's private parts the tests reach. */
interface Internals {
  vms: Map<string, unknown>;
  overlays: unknown;
  snapshotViaReceiver(rec: FakeRec, dir: string): Promise<{ pauseMs: number; parent: string | null }>;
  removeGenFiles(workdir: string, gen: number): Promise<void>;
  persist(rec: FakeRec): Promise<void>;
}

let n = 0;
/** A driver (no standbys: none is started) holding a running receiver-method VM record. */
function setup(): { root: string; driver: QemuVmmDriver; internals: Internals; rec: FakeRec } {
  const root = join(base, `agent-${++n}`);
  const driver = new QemuVmmDriver({ root, accel: 'tcg', logger: pino({ level: 'silent' }), standby: { perSnapshot: 0 } });
  const internals = driver as unknown as Internals;
  internals.overlays = { create: () => Promise.resolve() }; // no qemu-img
  const workdir = join(root, 'vms', 'vm1');
  mkdirSync(workdir, { recursive: true });
  const rec: FakeRec = runningVmRecord(workdir);
  internals.vms.set('vm1', rec);
  return { root, driver, internals, rec };
}

async function teardown(driver: QemuVmmDriver, internals: Internals): Promise<void> {
  internals.vms.delete('vm1'); // no QEMU to stop
  await driver.close();
}

describe('snapshot when the VM crashes', () => {
  it('snapshot_whenTheVmCrashesBeforeItStarts_throwsVmCrashed_andLeavesNoDirectory', async () => {
    const { root, driver, internals, rec } = setup();
    // The crash watcher runs during an await before the snapshot starts.
    driver.qemuVersion = () => {
      rec.info.state = 'crashed';
      return Promise.resolve('7.2.0');
    };
    await expect(driver.snapshot('vm1', 'sn1')).rejects.toBeInstanceOf(VmCrashedError);
    expect(existsSync(join(root, 'snapshots', 'sn1'))).toBe(false);
    expect(rec.info.state).toBe('crashed');
    await teardown(driver, internals);
  });

  it('snapshot_whenTheVmCrashesOnceItsFilesAreComplete_returnsTheSealedSnapshot_andTheVmStaysCrashed', async () => {
    const { root, driver, internals, rec } = setup();
    driver.qemuVersion = () => Promise.resolve('7.2.0');
    internals.snapshotViaReceiver = (r, dir) => {
      for (const f of ['mem.img', 'state.bin', 'disk.qcow2']) writeFileSync(join(dir, f), f);
      // The receiver has every byte; the source's QEMU exits before the seal.
      r.info.state = 'crashed';
      return Promise.resolve({ pauseMs: 1, parent: null });
    };
    const snap = await driver.snapshot('vm1', 'sn1');
    expect(snap.manifest.snapshotId).toBe('sn1');
    expect(existsSync(join(root, 'snapshots', 'sn1', 'manifest.json'))).toBe(true);
    expect(rec.info.state).toBe('crashed');
    // A sealed snapshot is never recorded as unsealed (a destroy would remove its directory).
    expect(rec.unsealed).toBeUndefined();
    await teardown(driver, internals);
  });

  it('snapshot_whenWhatFollowsItsSealFails_neverRecordsTheSealedSnapshotAsUnsealed', async () => {
    const { root, driver, internals, rec } = setup();
    driver.qemuVersion = () => Promise.resolve('7.2.0');
    internals.snapshotViaReceiver = (_r, dir) => {
      for (const f of ['mem.img', 'state.bin', 'disk.qcow2']) writeFileSync(join(dir, f), f);
      return Promise.resolve({ pauseMs: 1, parent: null });
    };
    internals.persist = () => Promise.reject(new Error('ENOSPC: vm.json'));
    await expect(driver.snapshot('vm1', 'sn1')).rejects.toThrow(/ENOSPC/);
    expect(existsSync(join(root, 'snapshots', 'sn1', 'manifest.json'))).toBe(true);
    expect(rec.unsealed).toBeUndefined();
    await teardown(driver, internals);
  });
});

describe('removeGenFiles', () => {
  it('removeGenFiles_removesTheGenerationsIncomingMigrationSocket_andKeepsOtherGenerations', async () => {
    const { driver, internals, rec } = setup();
    const { workdir } = rec.info;
    for (const f of ['qmp.2.sock', 'qga.2.sock', 'mig-in.2.sock', 'qemu.2.pid', 'qemu.2.log', 'mig-in.3.sock']) writeFileSync(join(workdir, f), '');
    await internals.removeGenFiles(workdir, 2);
    expect(readdirSync(workdir)).toEqual(['mig-in.3.sock']);
    await teardown(driver, internals);
  });
});
