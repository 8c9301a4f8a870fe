// A pause whose vm.json write fails (a full disk, EIO). A pause that stopped the guest and then
// failed to record it left the VM paused in memory and running in vm.json: the retry (the
// agent's pauseVm step then called the driver only for a VM not paused already) skipped the
// pause and succeeded, and the next agent's recover() resumed the sandbox (a VM recorded
// running runs). And a `stop` or `cont` that times out but is carried out by QEMU afterwards:
// the driver's record said the opposite of QEMU, and the pause or resume meant to put it right
// was a no-op. No QEMU runs: the pause is driven through the driver's record of a VM, its QMP
// stood in for.
import { afterAll, describe, expect, it } from 'vitest';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import { QmpTimeoutError } from '../../errors.ts';
import { QemuVmmDriver } from './driver.ts';
import { runningVmRecord } from './vm-record.fixture.ts';

const base = mkdtempSync(join(tmpdir(), 'ff-pause-persist-'));
afterAll(() => rmSync(base, { recursive: true, force: true }));

/** The driver's private parts the test reaches. */
interface Internals {
  vms: Map<string, unknown>;
  persist(rec: unknown, ...rest: unknown[]): Promise<void>;
}

describe('pause when vm.json cannot be written', () => {
  it('pause_whoseVmJsonWriteFailsOnce_isRetriedByTheAgent_andLeavesTheVmRecordedPaused', async () => {
    const root = join(base, 'agent');
    const driver = new QemuVmmDriver({ root, accel: 'tcg', logger: pino({ level: 'silent' }), standby: { perSnapshot: 0 } });
    const internals = driver as unknown as Internals;
    const workdir = join(root, 'vms', 'vm1');
    mkdirSync(workdir, { recursive: true });
    const qmp: string[] = [];
    const rec = runningVmRecord(workdir, { qmp: { closed: false, execute: (cmd: string) => (qmp.push(cmd), Promise.resolve({})) } });
    internals.vms.set('vm1', rec);
    writeFileSync(join(workdir, 'vm.json'), JSON.stringify({ info: rec.info }));
    const persist = internals.persist.bind(driver);
    let fail = 1;
    internals.persist = (r, ...rest) => (fail-- > 0 ? Promise.reject(new Error('ENOSPC: no space left on device')) : persist(r, ...rest));
    await expect(driver.pause('vm1')).rejects.toThrow(/ENOSPC/);
    // Failed as a whole: the guest runs, as vm.json and the driver both still say.
    expect(qmp).toEqual([]);
    expect(driver.get('vm1')?.state).toBe('running');
    // The step fails retryable; its retry, as the agent's pauseVm runs it.
    await driver.pause('vm1');
    expect(driver.get('vm1')?.state).toBe('paused');
    // What the next agent's recover() reads: paused, so it is adopted paused, not resumed.
    expect((JSON.parse(readFileSync(join(workdir, 'vm.json'), 'utf8')) as { info: { state: string } }).info.state).toBe('paused');
    expect(qmp).toEqual(['stop']);
    internals.vms.delete('vm1'); // no QEMU to stop
    await driver.close();
  });
});

/**
 * A driver holding a running VM whose QMP stands in for a QEMU with a status: `late` names the
 * commands (stop, cont) that time out though QEMU carries them out, and `busy` how many
 * query-status after them time out as well (QEMU still busy). `sent` lists what was sent.
 */
function withQemu(name: string, late: string[], busy = 0): { driver: QemuVmmDriver; internals: Internals; sent: string[]; qemu: { status: string } } {
  const root = join(base, name);
  const driver = new QemuVmmDriver({ root, accel: 'tcg', logger: pino({ level: 'silent' }), standby: { perSnapshot: 0 } });
  const internals = driver as unknown as Internals;
  const workdir = join(root, 'vms', 'vm1');
  mkdirSync(workdir, { recursive: true });
  const sent: string[] = [];
  const qemu = { status: 'running' };
  const execute = (cmd: string): Promise<unknown> => {
    sent.push(cmd);
    if (cmd === 'query-status') return busy-- > 0 ? Promise.reject(new QmpTimeoutError(cmd, 10_000)) : Promise.resolve({ status: qemu.status });
    if (cmd === 'stop' || cmd === 'cont') qemu.status = cmd === 'stop' ? 'paused' : 'running';
    return late.includes(cmd) ? Promise.reject(new QmpTimeoutError(cmd, 10_000)) : Promise.resolve({});
  };
  internals.vms.set('vm1', runningVmRecord(workdir, { qmp: { closed: false, execute } }));
  return { driver, internals, sent, qemu };
}

describe('pause and resume when QEMU carries out a command that timed out', () => {
  it('pause_whoseStopTimesOutButQemuStopsTheVm_recordsItPaused_andAResumeContinuesIt', async () => {
    const { driver, internals, sent, qemu } = withQemu('late-stop', ['stop']);
    await driver.pause('vm1');
    expect(driver.get('vm1')?.state).toBe('paused');
    await driver.resume('vm1');
    expect(sent).toEqual(['stop', 'query-status', 'cont']);
    expect([driver.get('vm1')?.state, qemu.status]).toEqual(['running', 'running']);
    internals.vms.delete('vm1');
    await driver.close();
  });

  it('resume_ofAVmRecordedRunningThatALateStopPaused_continuesIt', async () => {
    // The stop times out, and so does the query-status after it: the pause fails, the VM
    // recorded running, QEMU paused. The hibernate's resume-after-failure comes next.
    const { driver, internals, sent, qemu } = withQemu('late-stop-busy', ['stop'], 1);
    await expect(driver.pause('vm1')).rejects.toBeInstanceOf(QmpTimeoutError);
    expect([driver.get('vm1')?.state, qemu.status]).toEqual(['running', 'paused']);
    // As the agent's resumeVm runs it: the driver is called whatever its record says.
    await driver.resume('vm1');
    expect(sent).toEqual(['stop', 'query-status', 'query-status', 'cont']);
    expect([driver.get('vm1')?.state, qemu.status]).toEqual(['running', 'running']);
    // Running in both: a resume asks, and sends nothing more.
    await driver.resume('vm1');
    expect(sent.slice(4)).toEqual(['query-status']);
    internals.vms.delete('vm1');
    await driver.close();
  });

  it('pause_ofAVmRecordedPausedThatALateContRuns_stopsIt', async () => {
    const { driver, internals, sent, qemu } = withQemu('late-cont', ['cont'], 1);
    await driver.pause('vm1');
    // The cont times out, QEMU runs the guest, and the query-status after it times out too.
    await expect(driver.resume('vm1')).rejects.toBeInstanceOf(QmpTimeoutError);
    expect([driver.get('vm1')?.state, qemu.status]).toEqual(['paused', 'running']);
    await driver.pause('vm1');
    expect(sent).toEqual(['stop', 'cont', 'query-status', 'query-status', 'stop']);
    expect([driver.get('vm1')?.state, qemu.status]).toEqual(['paused', 'paused']);
    internals.vms.delete('vm1');
    await driver.close();
  });

  it('resume_whoseContTimesOutButQemuRunsTheVm_recordsItRunning', async () => {
    const { driver, internals, sent, qemu } = withQemu('late-cont-answered', ['cont']);
    await driver.pause('vm1');
    await driver.resume('vm1');
    expect(sent).toEqual(['stop', 'cont', 'query-status']);
    expect([driver.get('vm1')?.state, qemu.status]).toEqual(['running', 'running']);
    internals.vms.delete('vm1');
    await driver.close();
  });
});
