import { spawn } from 'node:child_process';
import type { ChildProcess } from 'node:child_process';
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { identityOf, isQemuIn, isSameProcess, launchedArgv, runsLaunchedCommand, startTimeOfStat, stateOfStat } from './proc-identity.ts';

/** A /proc/<pid>/stat line: `comm` as given, state, then fields 4..52 with 22 = startTime. */
function statLine(pid: number, comm: string, state: string, startTime: number): string {
  const rest = Array.from({ length: 49 }, (_, i) => (i + 4 === 22 ? String(startTime) : String(i + 4)));
  return `${pid} (${comm}) ${state} ${rest.join(' ')}\n`;
}

/** A staged /proc: processes that cannot be made for real here (a zombie, a recycled PID). */
function fakeProc(root: string, bootId: string, procs: Array<{ pid: number; stat?: string; cmdline?: string[] }>): string {
  mkdirSync(join(root, 'sys', 'kernel', 'random'), { recursive: true });
  writeFileSync(join(root, 'sys', 'kernel', 'random', 'boot_id'), `${bootId}\n`);
  for (const p of procs) {
    mkdirSync(join(root, String(p.pid)), { recursive: true });
    if (p.stat) writeFileSync(join(root, String(p.pid), 'stat'), p.stat);
    writeFileSync(join(root, String(p.pid), 'cmdline'), p.cmdline ? `${p.cmdline.join('\0')}\0` : '');
  }
  return root;
}

/** Starts `sleep 30` (ours to signal) and resolves once it has exited and been reaped. */
function startSleep(): { child: ChildProcess; pid: number; exited: Promise<void> } {
  const child = spawn('sleep', ['30'], { stdio: 'ignore' });
  const exited = new Promise<void>((r) => child.once('exit', () => r()));
  if (child.pid === undefined) throw new Error('could not start sleep');
  return { child, pid: child.pid, exited };
}

let tmp: string;
beforeAll(() => {
  tmp = mkdtempSync(join(tmpdir(), 'ff-proc-identity-'));
});
afterAll(() => rmSync(tmp, { recursive: true, force: true }));

describe('reading /proc/<pid>/stat', () => {
  it('startTime_whenCommHasSpacesAndParentheses_isReadAfterTheLastParenthesis', () => {
    const line = statLine(4242, 'a) (b c) 7 8', 'S', 987_654);
    expect(startTimeOfStat(line)).toBe(987_654);
    expect(stateOfStat(line)).toBe('S');
  });

  it('startTime_ofATruncatedLine_isUnknown', () => {
    expect(startTimeOfStat('4242 (sleep) S 1 2 3')).toBeUndefined();
    expect(startTimeOfStat('not a stat line')).toBeUndefined();
  });
});

describe('isSameProcess (a recorded PID still names the process the fleet started)', () => {
  it('currentProcess_matchesItsOwnRecordedIdentity', () => {
    const id = identityOf(process.pid);
    expect(id.startTime).toBeGreaterThan(0);
    expect(isSameProcess(process.pid, id)).toBe(true);
  });

  it('recordedPid_withAnotherStartTime_isNotTreatedAsOurs', () => {
    const id = identityOf(process.pid);
    expect(isSameProcess(process.pid, { ...id, startTime: id.startTime + 1 })).toBe(false);
  });

  it('recordedPid_fromAnotherBoot_isNotTreatedAsOurs', () => {
    const id = identityOf(process.pid);
    expect(isSameProcess(process.pid, { ...id, bootId: '00000000-0000-0000-0000-000000000000' })).toBe(false);
  });

  it('startedChild_matchesWhileItRuns_andNotAfterItExited', async () => {
    const s = startSleep();
    try {
      const id = identityOf(s.pid);
      expect(isSameProcess(s.pid, id)).toBe(true);
      process.kill(s.pid, 'SIGTERM');
      await s.exited;
      expect(isSameProcess(s.pid, id)).toBe(false);
    } finally {
      s.child.kill('SIGKILL');
    }
  });

  it('processThatExitedBeforeItsStartTimeWasRead_neverMatches', () => {
    expect(isSameProcess(process.pid, { startTime: -1, bootId: '' })).toBe(false);
  });

  it('zombie_withTheRecordedStartTime_isNotAlive', () => {
    const proc = fakeProc(join(tmp, 'zombie'), 'boot-1', [{ pid: 500, stat: statLine(500, 'etcd', 'Z', 1234) }]);
    expect(isSameProcess(500, { startTime: 1234, bootId: 'boot-1' }, proc)).toBe(false);
    writeFileSync(join(proc, '500', 'stat'), statLine(500, 'etcd', 'S', 1234));
    expect(isSameProcess(500, { startTime: 1234, bootId: 'boot-1' }, proc)).toBe(true);
  });
});

describe('isQemuIn (a pid file QEMU wrote still names that QEMU)', () => {
  const dir = '/var/lib/ffleet/hosts/h1/vmm/snapshots/s1/.recv';
  const qemu = (pidFileDir: string): string[] => ['qemu-system-x86_64', '-name', 'ff-recv-s1', '-pidfile', `${pidFileDir}/qemu.0.pid`, '-qmp', `unix:${pidFileDir}/qmp.0.sock,server=on,wait=off`];

  it('qemuSystemBinary_namingThePidFilesDirectory_isOurs', () => {
    const proc = fakeProc(join(tmp, 'qemu-ours'), 'b', [{ pid: 700, cmdline: qemu(dir) }]);
    expect(isQemuIn(700, [dir], proc)).toBe(true);
  });

  it('qemu_ofAnotherDirectory_isNotOurs', () => {
    // Another VM, and one whose id merely starts with this one's.
    const proc = fakeProc(join(tmp, 'qemu-other'), 'b', [
      { pid: 701, cmdline: qemu('/var/lib/ffleet/hosts/h2/vmm/vms/v1') },
      { pid: 702, cmdline: qemu('/var/lib/ffleet/hosts/h1/vmm/vms/v10') },
    ]);
    expect(isQemuIn(701, ['/var/lib/ffleet/hosts/h1/vmm/vms/v1'], proc)).toBe(false);
    expect(isQemuIn(702, ['/var/lib/ffleet/hosts/h1/vmm/vms/v1'], proc)).toBe(false);
  });

  it('reusedPid_runningAnotherProgramThatNamesTheDirectory_isNotOurs', () => {
    const proc = fakeProc(join(tmp, 'qemu-reused'), 'b', [{ pid: 703, cmdline: ['tail', '-f', `${dir}/qemu.log`] }]);
    expect(isQemuIn(703, [dir], proc)).toBe(false);
  });

  it('zombieQemu_withItsEmptyCommandLine_isNotOurs', () => {
    const proc = fakeProc(join(tmp, 'qemu-zombie'), 'b', [{ pid: 704, cmdline: [] }]);
    expect(isQemuIn(704, [dir], proc)).toBe(false);
  });

  it('liveChildThatIsNoQemu_isNotOurs', async () => {
    const s = startSleep();
    try {
      expect(isQemuIn(s.pid, [dir])).toBe(false);
    } finally {
      s.child.kill('SIGKILL');
      await s.exited;
    }
  });
});

describe('records of an older fleet.ts (no start time): the command line decides', () => {
  it('launchedArgv_unwrapsIpNetnsExecAndTheAgentScriptsExec', () => {
    expect(launchedArgv('ip', ['netns', 'exec', 'ffl-h1', '/usr/bin/node', '--import', 'tsx', '/repo/deploy/fleet/relay.ts', 'tcp:127.0.0.1:4222=unix:/d/nats.sock'])).toEqual([
      '/usr/bin/node', '--import', 'tsx', '/repo/deploy/fleet/relay.ts', 'tcp:127.0.0.1:4222=unix:/d/nats.sock',
    ]);
    const script = 'set -e; mount --bind "/d/hosts/h1" "/d/.own-h1"; mkdir -p "/d/hosts/h1"; exec "/usr/bin/node" --import tsx "/repo/host-agent/main.ts"';
    expect(launchedArgv('ip', ['netns', 'exec', 'ffl-h1', 'sh', '-c', script])).toEqual(['/usr/bin/node', '--import', 'tsx', '/repo/host-agent/main.ts']);
    expect(launchedArgv('etcd', ['--name', 'etcd-1'])).toEqual(['etcd', '--name', 'etcd-1']);
  });

  it('legacyRecord_whosePidRunsWhatTheFleetStarted_isOurs_andOneRunningSomethingElseIsNot', async () => {
    const s = startSleep();
    try {
      expect(runsLaunchedCommand(s.pid, 'sleep', ['30'])).toBe(true);
      expect(runsLaunchedCommand(s.pid, 'etcd', ['--name', 'etcd-1', '--data-dir', '/var/lib/ffleet/etcd/etcd-1'])).toBe(false);
      expect(runsLaunchedCommand(s.pid, 'sleep', ['31'])).toBe(false);
    } finally {
      s.child.kill('SIGKILL');
      await s.exited;
    }
    expect(runsLaunchedCommand(s.pid, 'sleep', ['30'])).toBe(false);
  });
});
