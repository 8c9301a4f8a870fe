// The base disk's digest end to end, against real QEMU: the reproducible tiny image boots and
// mounts its data disk, a snapshot records the digest of the base disk its layer overlays,
// and a restore on the host that built that disk passes the check.
import { readFile, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { pino } from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ensureImage } from '../../../deploy/images/build.ts';
import { fileSha256 } from '../../../deploy/images/meta.ts';
import type { GuestImage } from '../../domain/vmm.ts';
import { QemuVmmDriver } from './driver.ts';
import { tempDir } from '../../../services/testkit/proc.ts';

let root: string;
let image: GuestImage;
let driver: QemuVmmDriver;

async function sh(vmId: string, script: string): Promise<string> {
  const r = await driver.exec(vmId, { path: '/bin/sh', args: ['-c', script], timeoutMs: 30_000 });
  if (r.exitCode !== 0) throw new Error(`${vmId}: ${script}: exit ${r.exitCode} ${r.stderr.toString()}`);
  return r.stdout.toString().trim();
}

beforeAll(async () => {
  image = await ensureImage('tiny');
  root = tempDir('ffd-');
  driver = new QemuVmmDriver({ root, accel: 'tcg', logger: pino({ level: 'warn' }), standby: { perSnapshot: 0 } });
});

afterAll(async () => {
  await driver?.close().catch(() => undefined);
  if (root) await rm(root, { recursive: true, force: true });
});

describe('base disk digest (real QEMU)', () => {
  it('snapshot_recordsTheBaseDisksDigest_andARestoreOverThatDiskSucceeds', async () => {
    expect(image.diskSha256).toBe(await fileSha256(image.disk));
    await driver.create({ vmId: 'dg', image, memoryMib: 128, vcpus: 1, hostname: 'dg' });
    expect(await sh('dg', 'cat /data/README')).toBe('forkfleet tiny data disk');
    await sh('dg', 'echo written > /data/marker && sync');
    const snap = await driver.snapshot('dg', 'snap-dg');
    expect(snap.manifest.image.diskSha256).toBe(image.diskSha256);
    const stored = JSON.parse(await readFile(join(snap.dir, 'manifest.json'), 'utf8')) as { image: { diskSha256?: string } };
    expect(stored.image.diskSha256).toBe(image.diskSha256);
    const vm = await driver.restore(snap, { vmId: 'dg-r', hostname: 'dg-r' });
    expect(vm.state).toBe('running');
    expect(await sh('dg-r', 'echo 3 > /proc/sys/vm/drop_caches; cat /data/marker /data/README')).toBe('written\nforkfleet tiny data disk');
    // The restored VM's own snapshot keeps the digest (its image is the snapshot's).
    const again = await driver.snapshot('dg-r', 'snap-dg-r');
    expect(again.manifest.image.diskSha256).toBe(image.diskSha256);
  });
});
