// A VM's QEMU that exits while snapshot() runs: the crash watcher records the VM crashed
// between snapshot()'s awaits. Before the snapshot starts, the caller hears that the VM crashed
// and no directory is left; once the snapshot is sealed, it is complete and valid, so it is
// returned and the VM stays crashed. A template snapshot whose replacement QEMU fails after the
// source was killed keeps its complete files, sealed. And removeGenFiles takes every file of a
// generation. No QEMU runs: the snapshot is driven through the driver's record of a VM, with
// its QEMU steps (the version probe, the receiver's stream, the source's QMP and process, the
// replacement) stood in for.
import { afterAll, describe, expect, it } from 'vitest';
import { spawn } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import { VmCrashedError } from '../../errors.ts';
import { QemuVmmDriver } from './driver.ts';
import { runningVmRecord, closeWithoutVm } from './vm-record.fixture.ts';
import type { FakeVmRecord } from './vm-record.fixture.ts';
import type { SnapshotManifest } from '../../domain/vmm.ts';

const base = mkdtempSync(join(tmpdir(), 'ff-snapshot-crash-'));
afterAll(() => rmSync(base, { recursive: true, force: true }));

type FakeRec = FakeVmRecord & { unsealed?: unknown };
/** The driver's private parts the tests reach. */
interface Internals {
  vms: Map<string, unknown>;
  overlays: unknown;
  snapshotViaReceiver(rec: FakeRec, dir: string): Promise<{ pauseMs: number; parent: string | null }>;
  snapshotSharedFile(rec: FakeRec, dir: string, draft: SnapshotManifest): Promise<unknown>;
  switchToReplacement(rec: FakeRec, repl: unknown, feed: (file: string) => Promise<void>, o: Record<string, unknown>, moveAgent: () => void): Promise<unknown>;
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


describe('snapshot when the VM crashes', () => {
  it('snapshot_whenTheVmCrashesBeforeItStarts_throwsVmCrashed_andLeavesNoDirectory', async () => {
    const { root, driver, rec } = setup();
    // The crash watcher runs during an await before the snapshot starts.
    driver.qemuVersion = () => {
      rec.info.state = 'crashed';
      return Promise.resolve('7.2.0');
    };
    await expect(driver.snapshot('vm1', 'sn1')).rejects.toBeInstanceOf(VmCrashedError);
    expect(existsSync(join(root, 'snapshots', 'sn1'))).toBe(false);
    expect(rec.info.state).toBe('crashed');
    await closeWithoutVm(driver);
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
    await closeWithoutVm(driver);
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
    await closeWithoutVm(driver);
  });
});

describe('template snapshot whose replacement fails', () => {
  it('snapshot_whoseReplacementFailsAfterTheSourceWasKilled_keepsItsCompleteFilesSealed_andItsRetryReturnsThem', async () => {
    const { root, driver, internals, rec } = setup();
    driver.qemuVersion = () => Promise.resolve('7.2.0');
    // The source QEMU: a process of this test's own (killed by the switch), and a QMP whose
    // migrate streams the device state and completes.
    const child = spawn('sleep', ['60'], { stdio: 'ignore' });
    const exited = new Promise<void>((r) => child.once('exit', () => r()));
    const proc = { pid: child.pid!, child, exited, gone: false };
    const qmp = {
      closed: false,
      mark: 0,
      execute: async (cmd: string, args: { uri?: string } = {}) => {
        if (cmd === 'migrate') net.createConnection(args.uri!.replace(/^unix:/, '')).end('device state');
        return {};
      },
      waitEvent: async () => ({ event: 'MIGRATION', data: { status: 'completed' }, timestampMs: 0 }),
      eventsSince: () => [],
      close: () => undefined,
    };
    void exited.then(() => ((proc.gone = true), (qmp.closed = true)));
    Object.assign(rec, { memShared: true, proc, qmp });
    // What snapshotSharedFile does before the switch (the memory file renamed into the
    // snapshot, the disk linked), then its switch onto a replacement whose load fails.
    internals.snapshotSharedFile = (r, dir, draft) => {
      for (const f of ['mem.img', 'disk.qcow2']) writeFileSync(join(dir, f), f);
      r.switching = { gen: 2, memPath: join(dir, 'mem.img'), diskPath: join(r.info.workdir, 'disk.sn1.qcow2'), state: 'running', manifest: draft };
      const repl = { proc: { pid: 0, child: undefined, exited: Promise.resolve(), gone: true }, qmp: { mark: 0 } };
      const o = { stateBin: join(dir, 'state.bin'), memImg: join(dir, 'mem.img'), newDisk: join(r.info.workdir, 'disk.sn1.qcow2'), newGen: 2, snapshotId: 'sn1', keepPaused: false, parent: null, undo: () => Promise.resolve(), draft, execsRunning: true };
      return internals.switchToReplacement.call(driver, r, repl, () => Promise.reject(new Error('replacement failed to load the device state')), o, () => undefined);
    };
    await expect(driver.snapshot('vm1', 'sn1')).rejects.toThrow(/replacement failed/);
    expect(rec.info.state).toBe('crashed');
    const dir = join(root, 'snapshots', 'sn1');
    expect(readFileSync(join(dir, 'state.bin'), 'utf8')).toBe('device state');
    expect(existsSync(join(dir, 'mem.img'))).toBe(true);
    expect(existsSync(join(dir, 'manifest.json'))).toBe(true);
    // The step's retry gets it (a hibernate can finish), execs that ran in the guest noted.
    const snap = await driver.snapshot('vm1', 'sn1');
    expect(snap.manifest).toMatchObject({ snapshotId: 'sn1', method: 'shared-file', guestExecsRunning: true });
    // Owned as any sealed snapshot: the crashed VM, destroyed, names it not; it is deleted
    // when the scheduler deletes it (no VM uses it).
    await driver.destroy('vm1');
    expect(await driver.snapshotsInUse()).not.toContain('sn1');
    await driver.deleteSnapshot(snap);
    expect(existsSync(dir)).toBe(false);
    await driver.close();
  });
});

describe('removeGenFiles', () => {
  it('removeGenFiles_removesTheGenerationsIncomingMigrationSocket_andKeepsOtherGenerations', async () => {
    const { driver, internals, rec } = setup();
    const { workdir } = rec.info;
    for (const f of ['qmp.2.sock', 'qga.2.sock', 'mig-in.2.sock', 'qemu.2.pid', 'qemu.2.log', 'mig-in.3.sock']) writeFileSync(join(workdir, f), '');
    await internals.removeGenFiles(workdir, 2);
    expect(readdirSync(workdir)).toEqual(['mig-in.3.sock']);
    await closeWithoutVm(driver);
  });
});
