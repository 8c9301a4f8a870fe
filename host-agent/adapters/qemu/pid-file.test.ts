// A QEMU's pid file exists from its spawn, before QEMU itself writes it (-pidfile): an agent
// killed in that window must not leave a QEMU that its next start cannot find to reap. No
// QEMU here: a stand-in script that never writes its pid file nor answers QMP.
import { chmodSync, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import { afterAll, describe, expect, it } from 'vitest';
import { QemuVmmDriver } from './driver.ts';
import { isAlive } from './process.ts';
import type { QemuLaunch } from './cmdline.ts';

const dir = mkdtempSync(join(tmpdir(), 'ff-pid-file-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

async function until<T>(what: string, get: () => T | undefined, ms = 5000): Promise<T> {
  for (const end = Date.now() + ms; Date.now() < end; await new Promise((r) => setTimeout(r, 20))) {
    const v = get();
    if (v !== undefined) return v;
  }
  throw new Error(`timed out waiting for ${what}`);
}

describe('QEMU pid files', () => {
  it('spawn_writesThePidFileAtOnce_soAnAgentKilledBeforeQemuWritesIt_hasItsNextStartReapThatQemu', async () => {
    const fake = join(dir, 'fake-qemu');
    writeFileSync(fake, '#!/bin/sh\nwhile :; do sleep 1; done\n');
    chmodSync(fake, 0o755);
    const root = join(dir, 'agent');
    const workdir = join(root, 'vms', 'sb-window');
    mkdirSync(workdir, { recursive: true });
    const launch: QemuLaunch = {
      name: 'ff-sb-window', accel: 'tcg', memoryMib: 128, vcpus: 1, kernel: '/k', initrd: '/i', kernelArgs: '',
      memPath: join(workdir, 'mem.0.img'), memShared: false, disk: join(workdir, 'disk.qcow2'),
      qmpSocket: join(workdir, 'qmp.0.sock'), agentSocket: join(workdir, 'qga.0.sock'), pidFile: join(workdir, 'qemu.0.pid'), incoming: false,
    };
    const logger = pino({ level: 'silent' });
    const first = new QemuVmmDriver({ root, accel: 'tcg', qemuBinary: fake, logger });
    // The start waits for QMP, which never answers: the agent "dies" while it waits.
    const starting = (first as unknown as { spawnAndConnect(l: QemuLaunch, logPath: string): Promise<unknown> }).spawnAndConnect(launch, join(workdir, 'qemu.0.log'));
    const failed = starting.then(() => undefined, (e: unknown) => e);
    const next = new QemuVmmDriver({ root, accel: 'tcg', qemuBinary: fake, logger });
    try {
      const pid = await until('the pid file', () => (existsSync(launch.pidFile) ? Number(readFileSync(launch.pidFile, 'utf8').trim()) : undefined));
      expect(isAlive(pid)).toBe(true);
      // The next agent start finds it by its pid file and reaps it with its workdir.
      const report = await next.recover('reap');
      expect(report.reaped).toContain('sb-window');
      await until('the stand-in QEMU gone', () => (isAlive(pid) ? undefined : true));
      expect(existsSync(workdir)).toBe(false);
      expect(await failed).toBeInstanceOf(Error);
    } finally {
      // On a failure, the stand-in ends with the first driver's wait for QMP (it kills what it started).
      await failed;
      await next.close();
      await first.close();
    }
  });
});
