// down() on staged fleet directories: no namespace is named in these states, so only the
// processes this file starts are signalled, and only files in its own temporary directory are
// touched, besides the RAM mount points of one test (under /run/forkfleet) and the cgroups
// the guests-cgroup tests make (ff-test-*, removed after).
import { spawn } from 'node:child_process';
import type { ChildProcess } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, afterEach, beforeAll, describe, expect, it, vi } from 'vitest';
import { claimableDir, defaultOptions, down, fleetDirOwnership, foundFleet, fromEarlierBoot, guestCgroupFor, ownsGuestCgroup, procAlive, qemuPidsByVm, readState, receiverPids, removeFleetEntries, standbyPids } from './fleet.ts';
import type { FleetState, ProcRecord } from './fleet.ts';
import { identityOf, isSameProcess } from './proc-identity.ts';
import { DEFAULT_RAM_MOUNT } from '../../host-agent/adapters/qemu/ram-pool.ts';
import { cpuHierarchy } from '../../host-agent/adapters/qemu/cgroup.ts';

let tmp: string;
const started: ChildProcess[] = [];

/** A child of this test, ours to signal; resolves `exited` once it is gone and reaped. */
function start(command: string, args: string[], argv0?: string): { pid: number; exited: Promise<void> } {
  const child = spawn(command, args, { stdio: 'ignore', ...(argv0 ? { argv0 } : {}) });
  started.push(child);
  if (child.pid === undefined) throw new Error(`could not start ${command}`);
  const exited = new Promise<void>((r) => (child.exitCode !== null || child.signalCode !== null ? r() : child.once('exit', () => r())));
  return { pid: child.pid, exited };
}

/** A process whose command line looks like a QEMU started in `dir` (node, renamed by argv0). */
async function fakeQemu(dir: string): Promise<{ pid: number; exited: Promise<void> }> {
  const q = start(process.execPath, ['-e', 'setInterval(() => {}, 1000)', '--', '-pidfile', join(dir, 'qemu.0.pid')], 'qemu-system-x86_64');
  mkdirSync(dir, { recursive: true });
  writeFileSync(join(dir, 'qemu.0.pid'), `${q.pid}\n`);
  return q;
}

function record(name: string, pid: number, command: string, args: string[], identity?: { startTime: number; bootId: string }): ProcRecord {
  return { name, kind: 'relay', pid, log: '', command, args, env: {}, ...identity };
}

/** A fleet directory as `up` leaves it, with these processes and host h1 (no namespaces, cgroup or RAM mount). */
function stageFleet(dir: string, procs: ProcRecord[]): FleetState {
  const opts = defaultOptions({ dir, hosts: 1, hostMemoryMib: 1024, agentEnv: { FF_RAM_MOUNT: '' } });
  const state: FleetState = {
    version: 1, startedAt: new Date().toISOString(), options: opts, apiAddresses: [], metricsAddresses: [], etcdEndpoints: [], natsUrl: '', natsMonitor: '',
    netnsBridge: '', namespaces: [], procs, signingKey: join(dir, 'keys', 'signing.pem'), trustedKey: join(dir, 'keys', 'signing.pem.pub'), guestCgroup: '',
    hosts: [{ id: 'h1', netns: 'unused-h1', address: '10.213.77.11', dataDir: join(dir, 'hosts', 'h1'), ifHost: 'fflh1a', ifBridge: 'fflh1b' }],
  };
  for (const d of ['logs', 'keys', 'pki', 'etcd/etcd-1', 'nats', 'nats-keys', 'hosts/h1/vmm/vms', '.own-h1']) mkdirSync(join(dir, d), { recursive: true });
  writeFileSync(join(dir, 'logs', 'etcd-1.log'), 'log\n');
  writeFileSync(join(dir, 'credentials.json'), '{}');
  writeFileSync(join(dir, '.ffleet.json'), JSON.stringify({ fleet: 'forkfleet', createdDir: true }));
  writeFileSync(join(dir, 'state.json'), JSON.stringify(state));
  return state;
}

beforeAll(() => {
  tmp = mkdtempSync(join(tmpdir(), 'ff-teardown-'));
});
afterEach(() => {
  for (const c of started.splice(0)) if (c.exitCode === null && c.signalCode === null) c.kill('SIGKILL');
});
afterAll(() => rmSync(tmp, { recursive: true, force: true }));

describe('down stops only processes that are still the fleet\'s', () => {
  it('down_stopsARecordedProcessWhoseStartTimeStillMatches', async () => {
    const dir = join(tmp, 'live');
    const s = start('sleep', ['30']);
    stageFleet(dir, [record('relay-nats', s.pid, 'sleep', ['30'], identityOf(s.pid))]);
    await down(dir);
    await s.exited;
    expect(existsSync(dir)).toBe(false);
  });

  it('down_whileAnotherLiveProcessHoldsTheDirectorysLock_isRefusedNamingIt_andAStaleLockIsTakenOver', async () => {
    const dir = join(tmp, 'locked');
    const s = start('sleep', ['30']);
    stageFleet(dir, [record('relay-nats', s.pid, 'sleep', ['30'], identityOf(s.pid))]);
    const holder = start('sleep', ['30']);
    writeFileSync(`${dir}.lock`, JSON.stringify({ pid: holder.pid, ...identityOf(holder.pid) }));
    await expect(down(dir)).rejects.toThrow(new RegExp(`pid ${holder.pid}\\) is working on`));
    expect(existsSync(join(dir, 'state.json'))).toBe(true);
    // Its holder killed: the next down takes the lock over, and leaves none behind.
    process.kill(holder.pid, 'SIGKILL');
    await holder.exited;
    await down(dir);
    await s.exited;
    expect([existsSync(dir), existsSync(`${dir}.lock`)]).toEqual([false, false]);
  });

  it('down_removesTheAsideAndStaleLockFilesOfAKilledLocker_butNotThoseOfOneStillRunning', async () => {
    const dir = join(tmp, 'lock-leftovers');
    stageFleet(dir, []);
    const gone = start('true', []);
    await gone.exited;
    const live = start('sleep', ['30']);
    const files = {
      // Killed inside withDirLock: its lock written aside, and a stale lock it had moved out of the way.
      goneAside: `${dir}.lock.${gone.pid}.0123abcd`,
      goneStale: `${dir}.lock.${gone.pid}.0123abcd.stale`,
      // Killed while writing its aside file: only its PID (in the name) tells.
      goneEmpty: `${dir}.lock.${gone.pid}.89abcdef`,
      liveAside: `${dir}.lock.${live.pid}.4567cdef`,
      liveStale: `${dir}.lock.${live.pid}.4567cdef.stale`,
      other: `${dir}.lock.notes`,
    };
    writeFileSync(files.goneAside, JSON.stringify({ pid: gone.pid, startTime: 1, bootId: '' }));
    writeFileSync(files.goneStale, JSON.stringify({ pid: live.pid, ...identityOf(live.pid) }));
    writeFileSync(files.goneEmpty, '');
    writeFileSync(files.liveAside, JSON.stringify({ pid: live.pid, ...identityOf(live.pid) }));
    writeFileSync(files.liveStale, '{}');
    writeFileSync(files.other, 'x');
    await down(dir);
    expect(Object.fromEntries(Object.entries(files).map(([k, f]) => [k, existsSync(f)]))).toEqual({ goneAside: false, goneStale: false, goneEmpty: false, liveAside: true, liveStale: true, other: true });
    for (const f of [files.liveAside, files.liveStale, files.other]) rmSync(f);
  });

  it('pidFile_ofAReusedPid_isNotSignalled', async () => {
    // The recorded start time is not this process's: as after a reboot, its PID went to another.
    const dir = join(tmp, 'reused');
    const s = start('sleep', ['30']);
    const id = identityOf(s.pid);
    const rec = record('etcd-1', s.pid, 'sleep', ['30'], { ...id, startTime: id.startTime - 1 });
    stageFleet(dir, [rec]);
    expect(procAlive(rec)).toBe(false);
    await down(dir);
    expect(isSameProcess(s.pid, id)).toBe(true);
  });

  it('legacyRecordWithoutStartTime_whosePidRunsSomethingElse_isNotSignalled', async () => {
    const dir = join(tmp, 'legacy');
    const s = start('sleep', ['30']);
    const id = identityOf(s.pid);
    stageFleet(dir, [record('etcd-1', s.pid, 'etcd', ['--name', 'etcd-1', '--data-dir', join(dir, 'etcd', 'etcd-1')])]);
    await down(dir);
    expect(isSameProcess(s.pid, id)).toBe(true);
  });

  it('qemuPidFiles_stopReceiversAndStandbys_butNotAReusedPid', async () => {
    const dir = join(tmp, 'qemu');
    stageFleet(dir, []);
    const vmm = join(dir, 'hosts', 'h1', 'vmm');
    const receiver = await fakeQemu(join(vmm, 'snapshots', 's1', '.recv'));
    const standby = await fakeQemu(join(vmm, 'standby', 'sb1'));
    const vm = await fakeQemu(join(vmm, 'vms', 'v1'));
    // A VM's pid file naming a process that is no QEMU of that VM (its PID was reused).
    const other = start('sleep', ['30']);
    const otherId = identityOf(other.pid);
    mkdirSync(join(vmm, 'vms', 'v2'));
    writeFileSync(join(vmm, 'vms', 'v2', 'qemu.0.pid'), `${other.pid}\n`);

    const dataDir = join(dir, 'hosts', 'h1');
    expect(receiverPids(dataDir)).toEqual([receiver.pid]);
    expect(standbyPids(dataDir)).toEqual([standby.pid]);
    expect(qemuPidsByVm(dataDir)).toEqual(new Map([['v1', [vm.pid]], ['v2', []]]));

    await down(dir);
    await Promise.all([receiver.exited, standby.exited, vm.exited]);
    expect(isSameProcess(other.pid, otherId)).toBe(true);
  });

  it('claimedStandbysQemu_namingItsLaunchDirectory_isFoundUnderItsVm', async () => {
    const dir = join(tmp, 'claimed');
    stageFleet(dir, []);
    const vmm = join(dir, 'hosts', 'h1', 'vmm');
    const q = await fakeQemu(join(vmm, 'standby', 'sb2'));
    // A claimed standby's directory becomes the VM's workdir; its QEMU still names the old path.
    mkdirSync(join(vmm, 'vms', 'v3'), { recursive: true });
    writeFileSync(join(vmm, 'vms', 'v3', 'qemu.0.pid'), `${q.pid}\n`);
    writeFileSync(join(vmm, 'vms', 'v3', 'vm.json'), JSON.stringify({ launchDir: join(vmm, 'standby', 'sb2') }));
    expect(qemuPidsByVm(join(dir, 'hosts', 'h1')).get('v3')).toEqual([q.pid]);
    await down(dir);
    await q.exited;
  });
});

describe('the fleet directory', () => {
  it('up_intoANonEmptyDirectoryWithoutAFleet_isRefusedNamingDir', () => {
    const dir = join(tmp, 'srv');
    mkdirSync(join(dir, 'www'), { recursive: true });
    writeFileSync(join(dir, 'state.json'), '{"someone":"else"}');
    expect(fleetDirOwnership(dir)).toBe('foreign');
    expect(() => claimableDir(dir)).toThrow(/--dir .*srv: exists, is not empty and holds no fleet/);
  });

  it('newEmptyOrFleetDirectories_areClaimable', () => {
    expect(claimableDir(join(tmp, 'absent'))).toBe('absent');
    mkdirSync(join(tmp, 'empty'));
    expect(claimableDir(join(tmp, 'empty'))).toBe('empty');
    const dir = join(tmp, 'ours');
    stageFleet(dir, []);
    expect(claimableDir(dir)).toBe('ours');
    expect(readState(dir)?.hosts[0]?.id).toBe('h1');
  });

  it('down_inADirectoryWithOtherFiles_removesOnlyTheFleetsEntries', async () => {
    const dir = join(tmp, 'shared');
    stageFleet(dir, []);
    writeFileSync(join(dir, 'precious.txt'), 'not the fleet\'s');
    mkdirSync(join(dir, 'backups'));
    await down(dir);
    expect(readdirSync(dir).sort()).toEqual(['backups', 'precious.txt']);
  });

  it('failedUp_keepsItsLogs_andTheNextUpOrDownKnowsThemForTheFleets', async () => {
    const dir = join(tmp, 'failed');
    stageFleet(dir, []);
    removeFleetEntries(dir, { keepLogs: true });
    expect(readdirSync(dir).sort()).toEqual(['.ffleet.json', 'logs']);
    expect(existsSync(join(dir, 'logs', 'etcd-1.log'))).toBe(true);
    expect(claimableDir(dir)).toBe('ours');
    await down(dir);
    expect(existsSync(dir)).toBe(false);
  });

  it('directoryThatExistedBeforeUp_staysAfterDown', async () => {
    const dir = join(tmp, 'preexisting');
    stageFleet(dir, []);
    writeFileSync(join(dir, '.ffleet.json'), JSON.stringify({ fleet: 'forkfleet', createdDir: false }));
    await down(dir);
    expect(readdirSync(dir)).toEqual([]);
  });
});

describe('up over a fleet recorded in its directory', () => {
  it('upAgain_returnsAFinishedFleetWhoseProcessesLive_refusesOneMissingAProcess_andRestartsOneThatNeverFinishedOrHasNoneLeft', async () => {
    const dir = join(tmp, 'again');
    const s = start('sleep', ['30']);
    const t = start('sleep', ['30']);
    const state = stageFleet(dir, [record('relay-nats', s.pid, 'sleep', ['30'], identityOf(s.pid)), record('agent-h1', t.pid, 'sleep', ['30'], identityOf(t.pid))]);
    // An up killed before every host was ready left this: its processes run, it never finished.
    expect(foundFleet(state, state.options)).toBe('restart');
    const done = { ...state, complete: true };
    expect(foundFleet(done, state.options)).toBe('up');
    expect(foundFleet(done, { ...state.options, hosts: 2 })).toBe('other-options');
    // Memory given by neither up, worked out from a machine whose memory changed in between (a
    // balloon): the same command, run again, finds the fleet up. Given, it must match.
    const fromRam = { ...done, options: { ...done.options, hostMemoryMib: 4000, hostMemoryFromRam: true as const } };
    expect(foundFleet(fromRam, { ...fromRam.options, hostMemoryMib: 4321 })).toBe('up');
    expect(foundFleet(fromRam, { ...state.options, hostMemoryMib: 4321 })).toBe('other-options');
    // One process killed (the README's kill -9 of an agent): the fleet and its sandboxes are
    // there; up used to take it all down and start a new one without a word.
    process.kill(t.pid, 'SIGKILL');
    await t.exited;
    expect(foundFleet(done, state.options)).toBe('partly-down');
    await down(dir);
    await s.exited;
    // None left (after a reboot): started afresh.
    expect(foundFleet(done, state.options)).toBe('restart');
  });
});

describe('down and RAM mount points', () => {
  it('down_removesItsOwnRamMountPoint_butAnotherAgentsMountOnItsOwnDirectoryStays', async () => {
    // An agent of another fleet, or one deployed on this machine, mounts its RAM tmpfs in its
    // own mount namespace. Removing that directory from here would detach the mount there.
    const others = [DEFAULT_RAM_MOUNT, '/run/forkfleet/ffothr/ram'];
    // Removed after, deepest first, only if this test made them (another's mount point must stay).
    const made = [...others, '/run/forkfleet/ffothr', '/run/forkfleet'].filter((d) => !existsSync(d)).sort((a, b) => b.length - a.length);
    for (const d of others) mkdirSync(d, { recursive: true });
    const holder = spawn('unshare', ['-m', '--propagation', 'private', 'sh', '-c', `${others.map((d) => `mount -t tmpfs none ${d}`).join(' && ')} && echo up && exec sleep 60`], { stdio: ['ignore', 'pipe', 'inherit'] });
    started.push(holder);
    const gone = new Promise<void>((r) => holder.once('exit', () => r()));
    try {
      await new Promise((r, j) => {
        holder.stdout?.once('data', r);
        holder.once('exit', (code) => j(new Error(`the mounting namespace exited (${code})`)));
      });
      const dir = join(tmp, 'ram');
      const state = stageFleet(dir, []);
      writeFileSync(join(dir, 'state.json'), JSON.stringify({ ...state, options: { ...state.options, prefix: 'fftst', agentEnv: {} } }));
      mkdirSync('/run/forkfleet/fftst/ram', { recursive: true });
      await down(dir);
      const mounts = readFileSync(`/proc/${holder.pid}/mountinfo`, 'utf8');
      for (const d of others) expect(mounts).toContain(` ${d} `);
      expect(existsSync('/run/forkfleet/fftst')).toBe(false);
    } finally {
      holder.kill('SIGKILL');
      await gone;
      for (const d of made) {
        try {
          rmdirSync(d);
        } catch {
          /* not empty or gone */
        }
      }
    }
  });
});

/** Where guests cgroups go on this machine (as down() finds it), if this process may make one. */
const CPU_BASE = await cpuHierarchy().then((h) => {
  if (!h) return undefined;
  try {
    const probe = join(h.base, `ff-test-probe-${process.pid}`);
    mkdirSync(probe);
    rmdirSync(probe);
    return h.base;
  } catch {
    return undefined;
  }
});

describe('the guests cgroup', () => {
  it('fromEarlierBoot_followsTheStatesBoot_orForAnOlderStateItsProcesses', () => {
    const p = (bootId?: string): ProcRecord => ({ ...record('p', 1, 'x', []), ...(bootId !== undefined ? { bootId } : {}) });
    expect(fromEarlierBoot({ bootId: 'a', procs: [] }, 'a')).toBe(false);
    expect(fromEarlierBoot({ bootId: 'a', procs: [] }, 'b')).toBe(true);
    expect(fromEarlierBoot({ procs: [p(), p('a')] }, 'b')).toBe(true);
    expect(fromEarlierBoot({ procs: [p('a')] }, 'a')).toBe(false);
    // Nothing says which boot: torn down as before.
    expect(fromEarlierBoot({ procs: [p()] }, 'b')).toBe(false);
  });

  it('ownsGuestCgroup_followsTheRecord_andForAnOlderStateOnlyTheFleetsOwnGroup', () => {
    const options = { prefix: 'ffl' };
    expect(ownsGuestCgroup({ options, guestCgroup: 'forkfleet-guests', guestCgroupOwned: false })).toBe(false);
    expect(ownsGuestCgroup({ options, guestCgroup: 'made/by-up', guestCgroupOwned: true })).toBe(true);
    expect(ownsGuestCgroup({ options, guestCgroup: '', guestCgroupOwned: true })).toBe(false);
    // state.json of an older fleet.ts: no record of who made it.
    expect(ownsGuestCgroup({ options, guestCgroup: 'forkfleet-ffl-guests' })).toBe(true);
    expect(ownsGuestCgroup({ options, guestCgroup: 'forkfleet-guests' })).toBe(false);
  });

  describe.skipIf(!CPU_BASE)('down() on a real cgroup', () => {
    const made: string[] = [];
    afterEach(async () => {
      vi.unstubAllEnvs();
      for (const c of started.splice(0)) {
        if (c.exitCode === null && c.signalCode === null) {
          c.kill('SIGKILL');
          await new Promise((r) => c.once('exit', r));
        }
      }
      for (const d of made.splice(0).reverse()) {
        try {
          rmdirSync(d);
        } catch {
          /* removed by the test */
        }
      }
    });

    /** A cgroup as another agent's (a deployed host's forkfleet-guests), with a process of this test in it. */
    function groupWithMember(name: string): { dir: string; member: { pid: number; exited: Promise<void> } } {
      const dir = join(CPU_BASE!, name);
      mkdirSync(dir);
      made.push(dir);
      const member = start('sleep', ['30']);
      writeFileSync(join(dir, 'cgroup.procs'), String(member.pid));
      return { dir, member };
    }

    it('down_withAGuestsCgroupItDidNotMake_leavesItAndItsMembers', async () => {
      const name = `ff-test-foreign-${process.pid}`;
      const { dir, member } = groupWithMember(name);
      const id = identityOf(member.pid);
      const fleet = join(tmp, 'cg-foreign');
      const state = stageFleet(fleet, []);
      writeFileSync(join(fleet, 'state.json'), JSON.stringify({ ...state, guestCgroup: name, guestCgroupOwned: false }));
      await down(fleet);
      expect(isSameProcess(member.pid, id)).toBe(true);
      expect(existsSync(dir)).toBe(true);
    });

    it('down_withItsOwnGuestsCgroup_killsWhatIsLeftInIt_andRemovesIt', async () => {
      const name = `ff-test-own-${process.pid}`;
      const { dir, member } = groupWithMember(name);
      const fleet = join(tmp, 'cg-own');
      const state = stageFleet(fleet, []);
      writeFileSync(join(fleet, 'state.json'), JSON.stringify({ ...state, guestCgroup: name, guestCgroupOwned: true }));
      await down(fleet);
      await member.exited;
      expect(existsSync(dir)).toBe(false);
    });

    it('down_ofAFleetStartedBeforeAReboot_leavesTheGroupOfItsNameAndItsMembers_whichAreAnotherFleetsNow', async () => {
      // After a reboot the fleet's own group is gone; one of the same name is a fleet's started
      // since with the same prefix. Its directory is still cleared.
      const name = `ff-test-reboot-${process.pid}`;
      const { dir, member } = groupWithMember(name);
      const id = identityOf(member.pid);
      const fleet = join(tmp, 'cg-reboot');
      const state = stageFleet(fleet, []);
      writeFileSync(join(fleet, 'state.json'), JSON.stringify({ ...state, guestCgroup: name, guestCgroupOwned: true, bootId: '00000000-0000-0000-0000-000000000000' }));
      await down(fleet);
      expect(isSameProcess(member.pid, id)).toBe(true);
      expect(existsSync(dir)).toBe(true);
      expect(existsSync(join(fleet, 'state.json'))).toBe(false);
    });

    it('guestCgroupFor_recordsTheGroupBeforeMakingIt_soDownAfterAnUpKilledThenRemovesIt', async () => {
      const name = `ff-test-recorded-${process.pid}`;
      made.push(join(CPU_BASE!, name));
      vi.stubEnv('FF_GUEST_CGROUP', name);
      const fleet = join(tmp, 'cg-recorded');
      const state = stageFleet(fleet, []);
      // As up does: state.json names the group before it exists, and the up is killed once it does.
      const recorded: Array<{ path: string; owned: boolean; existed: boolean }> = [];
      const got = await guestCgroupFor({ prefix: 'ffl' }, (planned) => {
        recorded.push({ ...planned, existed: existsSync(join(CPU_BASE!, name)) });
        writeFileSync(join(fleet, 'state.json'), JSON.stringify({ ...state, guestCgroup: planned.path, guestCgroupOwned: planned.owned }));
      });
      expect(recorded).toEqual([{ path: name, owned: true, existed: false }]);
      expect(got).toEqual({ path: name, owned: true });
      expect(existsSync(join(CPU_BASE!, name))).toBe(true);
      await down(fleet);
      expect(existsSync(join(CPU_BASE!, name))).toBe(false);
    });

    it('guestCgroupFor_aGroupFF_GUEST_CGROUPNamesThatExists_isNotOwned_butOneItMakesIs', async () => {
      const existing = `ff-test-existing-${process.pid}`;
      mkdirSync(join(CPU_BASE!, existing));
      made.push(join(CPU_BASE!, existing));
      vi.stubEnv('FF_GUEST_CGROUP', existing);
      expect(await guestCgroupFor({ prefix: 'ffl' })).toEqual({ path: existing, owned: false });
      const fresh = `ff-test-fresh-${process.pid}`;
      made.push(join(CPU_BASE!, fresh));
      vi.stubEnv('FF_GUEST_CGROUP', fresh);
      expect(await guestCgroupFor({ prefix: 'ffl' })).toEqual({ path: fresh, owned: true });
      expect(existsSync(join(CPU_BASE!, fresh))).toBe(true);
      vi.stubEnv('FF_GUEST_CGROUP', '');
      expect(await guestCgroupFor({ prefix: 'ffl' })).toEqual({ path: '', owned: false });
    });
  });
});
