// fork(N) is all or nothing, but what it undoes is only what it made: a child whose id is
// already taken fails without touching the VM or workdir that holds it; and a driver that
// was closed makes no VM. No QEMU runs: the fork fails before anything is started.
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import { afterAll, describe, expect, it } from 'vitest';
import { VmAlreadyExistsError } from '../../errors.ts';
import type { SnapshotManifest } from '../../domain/vmm.ts';
import { fingerprint } from './cmdline.ts';
import { QemuVmmDriver } from './driver.ts';

const dir = mkdtempSync(join(tmpdir(), 'ff-fork-cleanup-'));
const driver = new QemuVmmDriver({ root: join(dir, 'agent'), accel: 'tcg', logger: pino({ level: 'silent' }) });
afterAll(async () => {
  await driver.close();
  rmSync(dir, { recursive: true, force: true });
});

async function manifestOf(id: string, qemuVersion: string): Promise<SnapshotManifest> {
  return {
    schema: 1,
    snapshotId: id,
    parentSnapshotId: null,
    sourceVmId: 'src',
    createdAt: new Date(0).toISOString(),
    config: fingerprint('tcg', 128, 1, qemuVersion),
    image: { name: 'tiny', recipeHash: '0123456789abcdef', kernelArgs: '' },
    files: { memory: 'mem.img', deviceState: 'state.bin', disk: 'disk.qcow2' },
    diskVirtualSize: 64 << 20,
    method: 'receiver',
    sourcePauseMs: 0,
  };
}

describe('fork cleanup', () => {
  it('fork_afterTheDriverClosed_isRefusedAndMakesNoWorkdir', async () => {
    const root = join(dir, 'closed-agent');
    const closed = new QemuVmmDriver({ root, accel: 'tcg', logger: pino({ level: 'silent' }) });
    const manifest = await manifestOf('sn-2', await closed.qemuVersion());
    await closed.close();
    await expect(closed.fork({ dir: join(dir, 'snapshots', 'sn-2'), manifest }, [{ vmId: 'sb-late' }])).rejects.toThrow(/closing/);
    expect(existsSync(join(root, 'vms', 'sb-late'))).toBe(false);
  });

  it('fork_ofAChildWhoseIdAnotherRestoreHolds_failsAndLeavesThatRestoresWorkdir', async () => {
    // Another restore of sb-busy is under way: its workdir exists, its VM not registered yet.
    const busy = join(dir, 'agent', 'vms', 'sb-busy');
    mkdirSync(busy, { recursive: true });
    writeFileSync(join(busy, 'disk.qcow2'), 'the other restore\'s disk');
    const sdir = join(dir, 'snapshots', 'sn-1');
    mkdirSync(sdir, { recursive: true });
    const manifest = await manifestOf('sn-1', await driver.qemuVersion());
    await expect(driver.fork({ dir: sdir, manifest }, [{ vmId: 'sb-busy' }])).rejects.toBeInstanceOf(VmAlreadyExistsError);
    expect(existsSync(join(busy, 'disk.qcow2'))).toBe(true);
  });
});
