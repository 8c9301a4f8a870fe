// accel=auto on a host with /dev/kvm: the choice is kept until the agent restarts, so one failed
// probe must not make a KVM host TCG. A KVM guest adopted from the previous run proves KVM
// without a probe; a probe that misses its deadline is tried once more. No QEMU runs: /dev/kvm
// is stood in for, and so are the probe guests' boots.
import { afterAll, describe, expect, it, vi } from 'vitest';
import type * as FsPromises from 'node:fs/promises';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import type { GuestImage } from '../../domain/vmm.ts';
import { QemuVmmDriver } from './driver.ts';
import { runningVmRecord } from './vm-record.fixture.ts';

// /dev/kvm is there and usable, whatever the machine running the test has.
vi.mock('node:fs/promises', async (importReal) => {
  const real = await importReal<typeof FsPromises>();
  const access: typeof real.access = (path, mode) => (path === '/dev/kvm' ? Promise.resolve() : real.access(path, mode));
  return { ...real, access, default: { ...real, access } };
});

const base = mkdtempSync(join(tmpdir(), 'ff-accel-'));
afterAll(() => rmSync(base, { recursive: true, force: true }));

/** The driver's private parts the tests reach. */
interface Internals {
  vms: Map<string, unknown>;
  boot(spec: { vmId: string; image?: unknown }, accel: string, deadlineMs: number): Promise<unknown>;
  destroy(vmId: string): Promise<void>;
}

const probeImage = { name: 'tiny', recipeHash: '0123456789abcdef', kernel: '/k', initrd: '/i', disk: '/d', diskVirtualSize: 64 << 20 } as GuestImage;

let n = 0;
/**
 * An accel=auto driver whose probe boots fail (`fails` of them, then boot; all when Infinity);
 * `probes` lists the VMs booted, `destroyed` those destroyed.
 */
function autoDriver(fails: number, image: GuestImage | (() => Promise<GuestImage>) = probeImage): { driver: QemuVmmDriver; internals: Internals; probes: string[]; destroyed: string[] } {
  const root = join(base, `agent-${++n}`);
  const driver = new QemuVmmDriver({ root, accel: 'auto', probeImage: image, logger: pino({ level: 'silent' }), standby: { perSnapshot: 0 } });
  const internals = driver as unknown as Internals;
  const probes: string[] = [];
  const destroyed: string[] = [];
  internals.boot = (spec, accel) => {
    if ((spec as { image?: unknown }).image !== probeImage) return Promise.reject(new Error('booted something else than the probe image'));
    probes.push(`${spec.vmId} ${accel}`);
    return probes.length <= fails ? Promise.reject(new Error('did not become ready within 15000 ms')) : Promise.resolve({});
  };
  internals.destroy = (vmId) => {
    destroyed.push(vmId);
    return Promise.resolve();
  };
  return { driver, internals, probes, destroyed };
}

describe('accel auto', () => {
  it('resolveAccel_whenAnAdoptedGuestRunsUnderKvm_choosesKvmWithoutAProbe', async () => {
    const { driver, internals, probes } = autoDriver(Infinity);
    const rec = runningVmRecord(join(base, 'vm1'));
    internals.vms.set('vm1', { ...rec, info: { ...rec.info, accel: 'kvm', state: 'paused' } });
    expect(await driver.resolveAccel()).toBe('kvm');
    expect(probes).toEqual([]);
  });

  it('resolveAccel_whenTheFirstProbeMissesItsDeadline_probesOnceMoreAndChoosesKvm', async () => {
    const { driver, probes, destroyed } = autoDriver(1);
    expect(await driver.resolveAccel()).toBe('kvm');
    expect(probes.map((p) => p.split(' ')[1])).toEqual(['kvm', 'kvm']);
    // Both probe guests are gone, each under its own id.
    expect(destroyed).toEqual(probes.map((p) => p.split(' ')[0]));
    expect(new Set(destroyed).size).toBe(2);
  });

  it('resolveAccel_whenEveryProbeFails_andNoKvmGuestRuns_choosesTcg', async () => {
    const { driver, internals, probes } = autoDriver(Infinity);
    // A TCG guest, and a KVM one that crashed: neither proves KVM.
    const rec = runningVmRecord(join(base, 'vm1'));
    internals.vms.set('vm1', rec);
    internals.vms.set('vm2', { ...rec, info: { ...rec.info, vmId: 'vm2', accel: 'kvm', state: 'crashed' } });
    expect(await driver.resolveAccel()).toBe('tcg');
    expect(probes).toHaveLength(2);
  });

  it('resolveAccel_buildsTheProbeImageOnlyWhenItProbes', async () => {
    // An adopted KVM guest proves KVM: the image (a build that may take minutes, before the
    // agent's first heartbeat) is not asked for.
    let built = 0;
    const build = (): Promise<GuestImage> => (built++, Promise.resolve(probeImage));
    const adopted = autoDriver(Infinity, build);
    const rec = runningVmRecord(join(base, 'vm1'));
    adopted.internals.vms.set('vm1', { ...rec, info: { ...rec.info, accel: 'kvm' } });
    expect(await adopted.driver.resolveAccel()).toBe('kvm');
    expect(built).toBe(0);
    // No guest to go by: built once, and the probe boots it.
    const fresh = autoDriver(0, build);
    expect(await fresh.driver.resolveAccel()).toBe('kvm');
    expect(built).toBe(1);
    expect(fresh.probes).toHaveLength(1);
  });
});
