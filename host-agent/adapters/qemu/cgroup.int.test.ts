// Guest CPU isolation on the machine's real cgroup hierarchy (v1 here, v2 on most hosts):
// the group is made with its weight, processes join it, and every QEMU a driver starts is in
// it from its first moments (ADR 0018). The groups are removed afterwards.
import { spawn } from 'node:child_process';
import { readFile, rm, rmdir } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { randomBytes } from 'node:crypto';
import { pino } from 'pino';
import { afterAll, describe, expect, it } from 'vitest';
import { ensureImage } from '../../../deploy/images/build.ts';
import { HostSetupError } from '../../errors.ts';
import { GuestCgroup, sharesForWeight } from './cgroup.ts';
import { QemuVmmDriver } from './driver.ts';
import { tempDir } from '../../../services/testkit/proc.ts';

const made: GuestCgroup[] = [];
const name = (): string => `ff-test-${randomBytes(4).toString('hex')}`;
let root: string | undefined;
let driver: QemuVmmDriver | undefined;

afterAll(async () => {
  await driver?.close().catch(() => undefined);
  if (root) await rm(root, { recursive: true, force: true });
  // A group can go once its processes have: retry while the last ones exit.
  for (const g of made) {
    for (let i = 0; i < 50; i++) {
      const ok = await rmdir(g.dir).then(() => true, (e: NodeJS.ErrnoException) => e.code === 'ENOENT');
      if (ok) break;
      await new Promise((r) => setTimeout(r, 100));
    }
  }
});

async function open(cpuWeight: number): Promise<GuestCgroup> {
  const g = await GuestCgroup.open({ path: name(), cpuWeight });
  made.push(g);
  return g;
}

describe('GuestCgroup (real cgroup hierarchy)', () => {
  it('open_makesTheGroupWithItsWeight', async () => {
    const g = await open(50);
    const weight = g.version === 'v2' ? await readFile(join(g.dir, 'cpu.weight'), 'utf8') : await readFile(join(g.dir, 'cpu.shares'), 'utf8');
    expect(Number(weight)).toBe(g.version === 'v2' ? 50 : sharesForWeight(50));
    // Opening it again (an agent restart) reuses it.
    const again = await GuestCgroup.open({ path: g.procPath, cpuWeight: 50 });
    expect(again.dir).toBe(g.dir);
  });

  it('add_movesAProcess_andWhatItStartsAfterwardsIsBornInTheGroup', async () => {
    const g = await open(100);
    // It forks its sleep only once told to, after the move.
    const child = spawn('sh', ['-c', 'read go; sleep 30 & wait'], { stdio: ['pipe', 'ignore', 'ignore'] });
    try {
      await g.add(child.pid!);
      expect(await g.holds(child.pid!)).toBe(true);
      child.stdin!.write('go\n');
      await new Promise((r) => setTimeout(r, 200));
      const procs = (await readFile(join(g.dir, 'cgroup.procs'), 'utf8')).trim().split('\n').map(Number);
      expect(procs).toContain(child.pid);
      expect(procs).toHaveLength(2);
    } finally {
      child.kill('SIGKILL');
      for (const pid of (await readFile(join(g.dir, 'cgroup.procs'), 'utf8')).trim().split('\n').filter(Boolean).map(Number)) {
        try {
          process.kill(pid, 'SIGKILL'); // the sleep this test started
        } catch {
          /* gone */
        }
      }
    }
  });

  it('add_ofAProcessThatExited_isNoError', async () => {
    const g = await open(100);
    const child = spawn('true');
    await new Promise((r) => child.once('exit', r));
    await new Promise((r) => setTimeout(r, 50)); // reaped
    await expect(g.add(child.pid!)).resolves.toBeUndefined();
  });

  it('open_whenPathLeavesTheHierarchyOrWeightIsOutOfRange_refusesWithAHostSetupError', async () => {
    await expect(GuestCgroup.open({ path: '../escape', cpuWeight: 100 })).rejects.toBeInstanceOf(HostSetupError);
    await expect(GuestCgroup.open({ path: name(), cpuWeight: 0 })).rejects.toBeInstanceOf(HostSetupError);
    await expect(GuestCgroup.open({ path: 'x', cpuWeight: 100, root: join(tmpdir(), 'no-cgroup-here') })).rejects.toThrow(/no cgroup v2 hierarchy and no v1 cpu controller/);
  });

  it('driver_withGuestCgroup_everyQemuItStartsIsInTheGroup', async () => {
    const g = await open(100);
    root = tempDir('ffcg-');
    driver = new QemuVmmDriver({ root, accel: 'tcg', logger: pino({ level: 'warn' }), standby: { max: 0 }, guestCgroup: g });
    const vm = await driver.create({ vmId: 'cg', image: await ensureImage('tiny'), memoryMib: 128, vcpus: 1, hostname: 'cg' });
    expect(vm.pid).toBeGreaterThan(0);
    expect(await g.holds(vm.pid)).toBe(true);
    // All of QEMU's threads (vCPU, I/O, RCU) are in it, not only the main one.
    const tasks = g.version === 'v1' ? (await readFile(join(g.dir, 'tasks'), 'utf8')).trim().split('\n').length : (await readFile(join(g.dir, 'cgroup.threads'), 'utf8').catch(() => '')).trim().split('\n').length;
    expect(tasks).toBeGreaterThan(1);
    await driver.destroy('cg');
  });
});
