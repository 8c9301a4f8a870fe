// A pause whose vm.json write fails (a full disk, EIO). The agent's pauseVm step calls the
// driver only for a VM not paused already; a pause that stopped the guest and then failed to
// record it left the VM paused in memory and running in vm.json: the retry skipped the pause
// and succeeded, and the next agent's recover() resumed the sandbox (a VM recorded running
// runs). No QEMU runs: the pause is driven through the driver's record of a VM, its QMP
// stood in for.
import { afterAll, describe, expect, it } from 'vitest';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
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
    if (driver.get('vm1')?.state !== 'paused') await driver.pause('vm1');
    expect(driver.get('vm1')?.state).toBe('paused');
    // What the next agent's recover() reads: paused, so it is adopted paused, not resumed.
    expect((JSON.parse(readFileSync(join(workdir, 'vm.json'), 'utf8')) as { info: { state: string } }).info.state).toBe('paused');
    expect(qmp).toEqual(['stop']);
    internals.vms.delete('vm1'); // no QEMU to stop
    await driver.close();
  });
});
