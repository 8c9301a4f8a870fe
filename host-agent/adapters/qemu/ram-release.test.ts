// A VM's RAM file (ADR 0016) recorded in its vm.json is removed with the VM even when the
// agent that reaps it runs without the RAM pool, or with the pool on another mount. No QEMU:
// the VM's QEMU is gone, as after a host agent was killed and its VMs died meanwhile.
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import { afterAll, describe, expect, it } from 'vitest';
import { QemuVmmDriver } from './driver.ts';
import { ramFileOf } from './ram-pool.ts';

const dir = mkdtempSync(join(tmpdir(), 'ff-ram-release-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe('RAM files of reaped VMs', () => {
  it('recover_ofAVmWhoseQemuIsGone_removesTheRamFileItsVmJsonNames_withoutAPool', async () => {
    const root = join(dir, 'agent');
    const oldPool = join(dir, 'old-mount', 'pool');
    mkdirSync(oldPool, { recursive: true });
    const ramFile = ramFileOf(oldPool, 'sb-gone');
    writeFileSync(ramFile, Buffer.alloc(4096));
    // Someone else's file next to it, not named after this VM: left alone.
    const other = join(oldPool, 'vm-sb-other.ram');
    writeFileSync(other, 'x');
    const workdir = join(root, 'vms', 'sb-gone');
    mkdirSync(workdir, { recursive: true });
    writeFileSync(join(workdir, 'vm.json'), JSON.stringify({ vmId: 'sb-gone', gen: 0, ramFile }));
    const driver = new QemuVmmDriver({ root, accel: 'tcg', logger: pino({ level: 'silent' }) });
    const report = await driver.recover('adopt');
    expect(report.reaped).toEqual(['sb-gone']);
    expect(existsSync(workdir)).toBe(false);
    expect(existsSync(ramFile)).toBe(false);
    expect(existsSync(other)).toBe(true);
    await driver.close();
  });

  it('recover_ofAVmJsonNamingAFileNotNamedAfterTheVm_removesNothingOutsideTheWorkdir', async () => {
    const root = join(dir, 'agent2');
    const victim = join(dir, 'precious.ram');
    writeFileSync(victim, 'keep');
    const workdir = join(root, 'vms', 'sb-x');
    mkdirSync(workdir, { recursive: true });
    writeFileSync(join(workdir, 'vm.json'), JSON.stringify({ vmId: 'sb-x', gen: 0, ramFile: victim }));
    const driver = new QemuVmmDriver({ root, accel: 'tcg', logger: pino({ level: 'silent' }) });
    await driver.recover('adopt');
    expect(existsSync(victim)).toBe(true);
    await driver.close();
  });
});
