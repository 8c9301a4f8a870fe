// Integration test of the `debian` guest image (deploy/images/build-debian.sh) on real QEMU.
// Opt-in with FF_TEST_DEBIAN=1: building the image (mmdebstrap, needs the machine's apt
// sources) plus booting it under TCG takes well over a minute on this machine (ADR 0009), too
// long for the default int suite (3 min 46 s measured, most of it mmdebstrap). Once the image
// is cached, the file runs in ~8 s (boot, python3 and git, snapshot + fork).
import { readdir, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { pino } from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ensureImage } from '../../../deploy/images/build.ts';
import { QemuVmmDriver } from './driver.ts';
import { tempDir } from '../../../services/testkit/proc.ts';

const enabled = process.env.FF_TEST_DEBIAN === '1';
const logger = pino({ level: process.env.LOG_LEVEL ?? 'warn' });
let root: string;
let driver: QemuVmmDriver;

async function run(vmId: string, path: string, args: string[]): Promise<string> {
  const r = await driver.exec(vmId, { path, args, timeoutMs: 60_000 });
  if (r.exitCode !== 0) throw new Error(`${vmId}: ${path} ${args.join(' ')}: exit ${r.exitCode} ${r.stderr.toString()}`);
  return r.stdout.toString().trim();
}

describe.skipIf(!enabled)('debian image (FF_TEST_DEBIAN=1)', () => {
  beforeAll(async () => {
    const image = await ensureImage('debian');
    root = tempDir('ffd-');
    driver = new QemuVmmDriver({ root, accel: 'tcg', logger });
    await driver.create({ vmId: 'deb', image, memoryMib: 256, vcpus: 1, hostname: 'deb' });
  }, 600_000);

  afterAll(async () => {
    await driver?.close().catch(() => undefined);
    if (root) await rm(root, { recursive: true, force: true });
  });

  it('debian_whenBooted_runsPython3AndGitThroughExec', async () => {
    expect(await run('deb', '/usr/bin/python3', ['-c', 'print(6*7)'])).toBe('42');
    expect(await run('deb', '/usr/bin/git', ['--version'])).toMatch(/^git version 2\.\d+/);
    expect(await run('deb', '/bin/hostname', [])).toBe('deb');
  });

  it('debian_whenForked_childIsCleanAndRunsPython', async () => {
    const snap = await driver.snapshot('deb', 'deb-snap');
    const [child] = await driver.fork(snap, [{ vmId: 'deb-c', hostname: 'deb-c', sandboxId: 'sb-deb-c' }]);
    expect(child?.state).toBe('running');
    expect(await run('deb-c', '/bin/hostname', [])).toBe('deb-c');
    expect(await run('deb-c', '/bin/cat', ['/run/forkfleet/sandbox-id'])).toBe('sb-deb-c');
    expect(await run('deb-c', '/usr/bin/python3', ['-c', 'import os; print(len(os.urandom(8)))'])).toBe('8');
    await driver.destroy('deb-c');
    await driver.destroy('deb');
    await driver.deleteSnapshot(snap);
    expect(await readdir(join(root, 'vms'))).toEqual([]);
  });
});
