// Sealing a VMM snapshot directory (manifest.json, written last, means complete) when the
// fsync of its files fails. Linux reports a writeback error to one fsync only: the next fsync
// of the same file returns 0 though its data never reached the disk. So a snapshot whose seal
// fsync failed must never be sealed by a later try (snapshot()'s catch, the VM's next
// snapshot, recover()). No QEMU runs: the seal is driven through the driver's record of a VM.
// The fsync is made to fail through node:fs/promises' open (the one ../durable.ts uses).
import { afterAll, beforeEach, describe, expect, it, vi } from 'vitest';
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import type { SnapshotManifest } from '../../domain/vmm.ts';
import { failOnce, openFailsOnce } from '../fsync-fault.ts';
import { QemuVmmDriver } from './driver.ts';

vi.mock('node:fs/promises', async (real) => (await import('../fsync-fault.ts')).failingFsync(await real()));

const base = mkdtempSync(join(tmpdir(), 'ff-seal-'));
afterAll(() => rmSync(base, { recursive: true, force: true }));
beforeEach(() => {
  failOnce.clear();
  openFailsOnce.clear();
});

/** The driver's private seal steps, as snapshot() and recover() call them. */
interface Sealing {
  sealSwitched(rec: unknown): Promise<void>;
  sealUnsealed(rec: unknown): Promise<void>;
}
const sealing = (d: QemuVmmDriver): Sealing => d as unknown as Sealing;

let n = 0;
/** A driver whose root holds snapshots/<id> with complete files, and a VM record that depends on it. */
function setup(method: 'shared-file' | 'receiver'): { root: string; driver: QemuVmmDriver; dir: string; rec: Record<string, unknown> } {
  const root = join(base, `agent-${++n}`);
  const driver = new QemuVmmDriver({ root, accel: 'tcg', logger: pino({ level: 'silent' }) });
  const id = `sn-${n}`;
  const dir = join(root, 'snapshots', id);
  mkdirSync(dir, { recursive: true });
  for (const f of ['mem.img', 'state.bin', 'disk.qcow2']) writeFileSync(join(dir, f), f);
  const workdir = join(root, 'vms', 'vm1');
  mkdirSync(workdir, { recursive: true });
  const manifest = { schema: 1, snapshotId: id, method } as SnapshotManifest;
  const rec: Record<string, unknown> = { gen: 2, image: { name: 'tiny', disk: '/x' }, info: { vmId: 'vm1', workdir }, dependsOn: [id] };
  if (method === 'shared-file') rec.switching = { gen: 2, memPath: join(dir, 'mem.img'), diskPath: join(workdir, 'disk.2.qcow2'), state: 'running', manifest };
  else rec.unsealed = manifest;
  return { root, driver, dir, rec };
}

describe('snapshot seal', () => {
  it('sealSwitched_afterTheSealsFsyncFailed_refusesEveryLaterTry_andNeverWritesTheManifest', async () => {
    // snapshot()'s seal fails (EIO); its catch sealed the switched snapshot again, and that
    // fsync returned 0: manifest.json over a mem.img that never reached the disk.
    const { root, driver, dir, rec } = setup('shared-file');
    failOnce.add(join(dir, 'mem.img'));
    await expect(sealing(driver).sealSwitched(rec)).rejects.toThrow(/EIO/);
    await expect(sealing(driver).sealSwitched(rec)).rejects.toThrow(/never sealed/);
    expect(existsSync(join(dir, 'manifest.json'))).toBe(false);
    expect(rec.switching).toBeDefined(); // still named in vm.json: destroy removes the directory
    // A restarted agent (recover(), the VM's next snapshot) refuses it too: a fresh module, so
    // only the directory's mark tells it.
    vi.resetModules();
    const { QemuVmmDriver: Restarted } = await import('./driver.ts');
    expect(Restarted).not.toBe(QemuVmmDriver);
    const next = new Restarted({ root, accel: 'tcg', logger: pino({ level: 'silent' }) });
    await expect(sealing(next).sealSwitched(rec)).rejects.toThrow(/never sealed/);
    expect(existsSync(join(dir, 'manifest.json'))).toBe(false);
    // With no VM left that runs from it, recover() sweeps it (it has no manifest).
    await next.recover('reap');
    expect(existsSync(dir)).toBe(false);
    await next.close();
    await driver.close();
  });

  it('sealUnsealed_ofACloneSnapshotWhoseSealFsyncFailed_refusesIt_andNeverWritesTheManifest', async () => {
    const { driver, dir, rec } = setup('receiver');
    failOnce.add(join(dir, 'disk.qcow2'));
    await expect(sealing(driver).sealUnsealed(rec)).rejects.toThrow(/EIO/);
    await expect(sealing(driver).sealUnsealed(rec)).rejects.toThrow(/never sealed/);
    expect(existsSync(join(dir, 'manifest.json'))).toBe(false);
    expect(rec.unsealed).toBeDefined();
    await driver.close();
  });

  it('sealSwitched_whenOpeningAFileForItsFsyncFailed_sealsOnTheNextTry', async () => {
    // EMFILE: nothing was written back, so nothing was lost; the next seal's fsync is a real one.
    const { driver, dir, rec } = setup('shared-file');
    openFailsOnce.add(join(dir, 'state.bin'));
    await expect(sealing(driver).sealSwitched(rec)).rejects.toThrow(/EMFILE/);
    await sealing(driver).sealSwitched(rec);
    expect(existsSync(join(dir, 'manifest.json'))).toBe(true);
    expect(rec.switching).toBeUndefined();
    await driver.close();
  });
});
