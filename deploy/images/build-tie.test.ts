// An image build dies with the process that started it, with everything it started, and the
// next build removes the temp dir a killed builder left.
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, afterEach, describe, expect, it, vi } from 'vitest';
import { buildCommand, removeAbandonedBuilds } from './build.ts';
import { isAlive, isGone, killHard } from '../../host-agent/adapters/qemu/process.ts';

const dir = mkdtempSync(join(tmpdir(), 'ff-build-tie-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

async function until(cond: () => boolean, ms: number): Promise<boolean> {
  const end = Date.now() + ms;
  while (Date.now() < end) {
    if (cond()) return true;
    await new Promise((r) => setTimeout(r, 20));
  }
  return cond();
}

describe('image builds', () => {
  const pids: number[] = [];
  afterEach(() => {
    for (const p of pids.splice(0)) killHard(p);
  });

  it('buildOfAKilledBuilder_diesWithEverythingItStarted', async () => {
    // The "build": a grandchild that records its PID (as this machine sees it) and sleeps.
    const script = join(dir, 'build.sh');
    const pidFile = join(dir, 'grandchild.pid');
    writeFileSync(script, `sh -c 'read -r pid _ < /proc/self/stat; echo $pid > ${pidFile}; exec sleep 60' &\nwait\n`);
    const [cmd, args] = buildCommand([script]);
    // A stand-in for the agent: starts the build and waits to be killed.
    const parent = spawn(process.execPath, ['-e', `require('node:child_process').spawn(${JSON.stringify(cmd)}, ${JSON.stringify(args)}, { stdio: 'ignore' }); setInterval(() => {}, 1000);`], { stdio: 'ignore' });
    pids.push(parent.pid as number);
    expect(await until(() => existsSync(pidFile) && readFileSync(pidFile, 'utf8').trim() !== '', 10_000)).toBe(true);
    const grandchild = Number(readFileSync(pidFile, 'utf8').trim());
    pids.push(grandchild);
    expect(isAlive(grandchild)).toBe(true);
    const exited = once(parent, 'exit');
    killHard(parent.pid as number);
    await exited;
    // Gone, or a zombie waiting for PID 1 to reap it (orphans go there).
    expect(await until(() => isGone(grandchild), 5000)).toBe(true);
  }, 30_000);

  it('removeAbandonedBuilds_removesTheTempDirsOfBuildersThatAreGone_only', async () => {
    const root = join(dir, 'images');
    const gone = spawn('true');
    await once(gone, 'exit');
    const names = {
      abandoned: `.tiny-0123456789abcdef.build-${gone.pid}-AbC123`,
      running: `.tiny-0123456789abcdef.build-${process.pid}-XyZ789`,
      image: 'tiny-0123456789abcdef',
    };
    for (const n of Object.values(names)) mkdirSync(join(root, n, 'sub'), { recursive: true });
    expect(await removeAbandonedBuilds(root)).toEqual([names.abandoned]);
    expect(existsSync(join(root, names.abandoned))).toBe(false);
    expect(existsSync(join(root, names.running))).toBe(true);
    expect(existsSync(join(root, names.image))).toBe(true);
  });

  it('removeAbandonedBuilds_whenTheBuildersPidIsAProcessItMayNotSignal_leavesItsDir', async () => {
    // Root's build seen by an agent that is not root: kill(pid, 0) fails with EPERM, the PID is in use.
    const root = join(dir, 'images-eperm');
    const gone = spawn('true');
    await once(gone, 'exit');
    const pid = gone.pid as number;
    const name = `.tiny-0123456789abcdef.build-${pid}-AbC123`;
    mkdirSync(join(root, name, 'sub'), { recursive: true });
    const realKill = process.kill.bind(process);
    const kill = vi.spyOn(process, 'kill').mockImplementation((p, sig) => {
      if (p === pid) throw Object.assign(new Error('kill EPERM'), { code: 'EPERM' });
      return realKill(p, sig);
    });
    try {
      expect(await removeAbandonedBuilds(root)).toEqual([]);
    } finally {
      kill.mockRestore();
    }
    expect(existsSync(join(root, name))).toBe(true);
  });
});
