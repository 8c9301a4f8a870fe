import { afterAll, describe, expect, it } from 'vitest';
import { chmodSync, existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { QemuLaunch } from '../adapters/qemu/cmdline.ts';
import type { OverlayFactory } from '../adapters/qemu/process.ts';
import { classicRestore, stopClassicRestores } from './classic.ts';

// No QEMU runs: qemu-system-x86_64 is, on PATH, a script that notes its PID and sleeps (it
// never opens QMP), as a QEMU still reading its save stream would look.
const dir = mkdtempSync(join(tmpdir(), 'ff-classic-test-'));
const pids = join(dir, 'pids');
writeFileSync(join(dir, 'qemu-system-x86_64'), `#!/bin/sh\necho $$ >> ${pids}\nexec sleep 600\n`);
chmodSync(join(dir, 'qemu-system-x86_64'), 0o755);
process.env.PATH = `${dir}:${process.env.PATH ?? ''}`;
writeFileSync(join(dir, 'full.bin'), 'stream');

const launch: QemuLaunch = {
  name: 'x', accel: 'tcg', memoryMib: 64, vcpus: 1, kernel: 'k', initrd: 'i', kernelArgs: '', memPath: join(dir, 'mem'), memShared: false,
  disk: 'd', qmpSocket: 'q', agentSocket: 'a', pidFile: 'p', incoming: true,
};
const overlays = { create: async () => undefined } as unknown as OverlayFactory;
const spec = (name: string): Parameters<typeof classicRestore>[0] => ({ launch, file: join(dir, 'full.bin'), dir: join(dir, name), name, overlays, diskBacking: 'b', diskVirtualSize: 1 });
const alive = (pid: number): boolean => {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
};

afterAll(() => {
  // Should a check fail, its fake QEMU does not outlive the test.
  const left = existsSync(pids) ? readFileSync(pids, 'utf8').trim().split('\n').map(Number) : [];
  for (const pid of left) if (alive(pid)) process.kill(pid, 'SIGKILL');
  rmSync(dir, { recursive: true, force: true });
});

describe('classic restore', () => {
  it('stopClassicRestores_midRestore_killsTheDetachedQemuAndRefusesNewOnes', async () => {
    const restoring = classicRestore(spec('r0'));
    const failed = restoring.then(() => 'restored', (e: unknown) => String(e));
    const t0 = Date.now();
    while (!existsSync(pids) && Date.now() - t0 < 10_000) await new Promise((r) => setTimeout(r, 20));
    const pid = Number(readFileSync(pids, 'utf8').trim());
    expect(alive(pid)).toBe(true);

    await stopClassicRestores();
    expect(alive(pid)).toBe(false);
    expect(existsSync(join(dir, 'r0'))).toBe(false);
    expect(await failed).not.toBe('restored');

    await expect(classicRestore(spec('r1'))).rejects.toThrow(/process is ending/);
    expect(readFileSync(pids, 'utf8').trim().split('\n')).toHaveLength(1);
  });
});
