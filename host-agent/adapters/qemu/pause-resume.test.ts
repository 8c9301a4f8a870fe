// Pause and resume around what else holds or left the VM: a pause with a condition (the idle
// rule's) queued behind a snapshot that holds the VM before its state says snapshotting; a
// QEMU that exited before the crash watcher recorded it; a VM adopted running whose guest clock
// is unknown (the previous agent died between a resume's `cont` and its clock refresh). No QEMU
// runs: the driver's record of a VM is driven, its QMP and QEMU steps stood in for.
import { afterAll, describe, expect, it } from 'vitest';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import { ChannelClosedError, VmCrashedError } from '../../errors.ts';
import { QemuVmmDriver } from './driver.ts';
import { runningVmRecord, closeWithoutVm } from './vm-record.fixture.ts';
import type { FakeVmRecord } from './vm-record.fixture.ts';
import type { VmInfo } from '../../domain/vmm.ts';

const base = mkdtempSync(join(tmpdir(), 'ff-pause-resume-'));
afterAll(() => rmSync(base, { recursive: true, force: true }));

/** The driver's private parts the tests reach. */
interface Internals {
  vms: Map<string, unknown>;
  overlays: unknown;
  snapshotViaReceiver(rec: FakeVmRecord, dir: string): Promise<{ pauseMs: number; parent: string | null }>;
  cloneHygiene(rec: FakeVmRecord): Promise<void>;
}

let n = 0;
/**
 * A driver (no standbys) holding a running receiver-method VM whose QMP stands in for a QEMU
 * with a status; `sent` lists the commands sent, `qmp.closed` is what the client says.
 */
function withVm(over: Record<string, unknown> = {}): { driver: QemuVmmDriver; internals: Internals; rec: FakeVmRecord; sent: string[]; qmp: { closed: boolean }; workdir: string } {
  const root = join(base, `agent-${++n}`);
  const driver = new QemuVmmDriver({ root, accel: 'tcg', logger: pino({ level: 'silent' }), standby: { perSnapshot: 0 } });
  const internals = driver as unknown as Internals;
  internals.overlays = { create: () => Promise.resolve() }; // no qemu-img
  const workdir = join(root, 'vms', 'vm1');
  mkdirSync(workdir, { recursive: true });
  const sent: string[] = [];
  const qemu = { status: 'running' };
  const qmp = {
    closed: false,
    execute: (cmd: string): Promise<unknown> => {
      sent.push(cmd);
      if (qmp.closed) return Promise.reject(new ChannelClosedError('QMP'));
      if (cmd === 'query-status') return Promise.resolve({ status: qemu.status });
      if (cmd === 'stop' || cmd === 'cont') qemu.status = cmd === 'stop' ? 'paused' : 'running';
      return Promise.resolve({});
    },
  };
  const rec = runningVmRecord(workdir, { qmp, ...over });
  internals.vms.set('vm1', rec);
  return { driver, internals, rec, sent, qmp, workdir };
}


describe('pause with a condition', () => {
  it('pause_queuedBehindASnapshotThatHoldsTheVmWhileItStillSaysRunning_asksItsConditionOnceTheSnapshotEnds_andARefusalSendsNothing', async () => {
    const { driver, internals, sent, workdir } = withVm();
    // The snapshot has the VM's lock and is still in its first awaits (the version probe):
    // the VM's state says running.
    let probed!: () => void;
    const probing = new Promise<void>((r) => (probed = r));
    let versionAsked = false;
    driver.qemuVersion = async () => {
      versionAsked = true;
      await probing;
      return '7.2.0';
    };
    internals.snapshotViaReceiver = (_r, dir) => {
      for (const f of ['mem.img', 'state.bin', 'disk.qcow2']) writeFileSync(join(dir, f), f);
      return Promise.resolve({ pauseMs: 1, parent: null });
    };
    const snapshot = driver.snapshot('vm1', 'sn1');
    await expect.poll(() => versionAsked).toBe(true);
    expect(driver.get('vm1')?.state).toBe('running');
    // The idle rule's pause comes now; a call made meanwhile makes the VM busy by the time it
    // is asked (the agent's idle judgement).
    const seen: VmInfo[] = [];
    let busy = false;
    const pause = driver.pause('vm1', { refuse: (vm) => (seen.push(vm), busy ? new Error('not idle') : undefined) });
    busy = true;
    probed();
    await snapshot;
    await expect(pause).rejects.toThrow('not idle');
    // Asked once, after the snapshot: nothing recorded or sent for the pause.
    expect(seen.map((v) => v.state)).toEqual(['running']);
    expect(sent).not.toContain('stop');
    expect(driver.get('vm1')?.state).toBe('running');
    expect((JSON.parse(readFileSync(join(workdir, 'vm.json'), 'utf8')) as { info: { state: string } }).info.state).toBe('running');
    // Not refused: paused.
    await driver.pause('vm1', { refuse: () => undefined });
    expect(driver.get('vm1')?.state).toBe('paused');
    await closeWithoutVm(driver);
  });
});

describe('pause and resume of a VM whose QEMU exited', () => {
  it('pauseAndResume_whenQmpClosedBeforeTheCrashWatcherRecordedIt_failAsCrashed_notRetryable', async () => {
    const { driver, sent, qmp } = withVm();
    qmp.closed = true; // QEMU exited; the crash watcher waits for its process (CRASH_EXIT_WAIT_MS)
    const paused = driver.pause('vm1');
    await expect(paused).rejects.toBeInstanceOf(VmCrashedError);
    await expect(paused).rejects.toMatchObject({ retryable: false });
    await expect(driver.resume('vm1')).rejects.toBeInstanceOf(VmCrashedError);
    expect(sent).toEqual([]);
    await closeWithoutVm(driver);
  });

  it('pause_whenQemuExitsDuringItsStop_failsAsCrashed', async () => {
    const { driver, qmp } = withVm();
    const execute = (qmp as unknown as { execute: (cmd: string) => Promise<unknown> }).execute;
    (qmp as unknown as { execute: (cmd: string) => Promise<unknown> }).execute = (cmd) => {
      if (cmd === 'stop') qmp.closed = true;
      return execute(cmd);
    };
    await expect(driver.pause('vm1')).rejects.toBeInstanceOf(VmCrashedError);
    await closeWithoutVm(driver);
  });
});

describe('resume of a VM adopted running', () => {
  it('resume_ofAVmRunningWhoseClockIsUnknown_refreshesItOnce_andOneWhoseClockIsKnownIsLeftAlone', async () => {
    // Adopted: clockBehindMs unknown. The previous agent may have died after the resume's
    // `cont`, before its refresh; the redelivered resume step finds the VM running.
    const { driver, internals, rec, sent } = withVm();
    let refreshes = 0;
    internals.cloneHygiene = (r) => {
      refreshes++;
      r.clockBehindMs = 0;
      return Promise.resolve();
    };
    await driver.resume('vm1');
    expect(sent).toEqual(['query-status']);
    expect(refreshes).toBe(1);
    expect(rec.clockBehindMs).toBe(0);
    // Known since: a resume of the running VM asks QEMU and does nothing else.
    await driver.resume('vm1');
    expect(refreshes).toBe(1);
    expect(sent).toEqual(['query-status', 'query-status']);
    await closeWithoutVm(driver);
  });
});
