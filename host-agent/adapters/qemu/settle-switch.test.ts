// recover() of a VM whose agent died in a template snapshot after the VM switched onto it: the
// replacement QEMU runs the guest from the snapshot's complete files, and only the seal was
// left. A seal that fails then (a full disk) must not cost the VM: it is adopted, still
// `switching`, and its next snapshot seals the snapshot. No QEMU runs: settleSwitch is driven
// through the driver's private steps, with the replacement's liveness stood in for, and the
// full disk through node:fs/promises' writeFile (the seal's image.json).
import { afterAll, beforeEach, describe, expect, it, vi } from 'vitest';
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import type * as FsPromises from 'node:fs/promises';
import type { SnapshotManifest } from '../../domain/vmm.ts';
import { QemuVmmDriver } from './driver.ts';

/** Paths whose every write fails with ENOSPC while they are in it. */
const fullDisk = vi.hoisted(() => new Set<string>());
vi.mock('node:fs/promises', async (importReal) => {
  const real = await importReal<typeof FsPromises>();
  const writeFile = (...a: Parameters<typeof real.writeFile>): ReturnType<typeof real.writeFile> =>
    fullDisk.has(String(a[0])) ? Promise.reject(Object.assign(new Error(`ENOSPC: no space left on device, write '${String(a[0])}'`), { code: 'ENOSPC' })) : real.writeFile(...a);
  return { ...real, writeFile, default: { ...real, writeFile } };
});

const base = mkdtempSync(join(tmpdir(), 'ff-settle-switch-'));
afterAll(() => rmSync(base, { recursive: true, force: true }));
beforeEach(() => fullDisk.clear());

interface Persisted {
  info: { vmId: string; state: string; workdir: string };
  gen: number;
  switching?: { gen: number; manifest: SnapshotManifest };
  [k: string]: unknown;
}
/** The driver's private recovery and seal steps the tests reach. */
interface Internals {
  livePid(workdir: string, gen: number): Promise<number>;
  settleSwitchOrGiveUp(p: Persisted): Promise<Persisted | undefined>;
  sealSwitched(rec: Persisted): Promise<void>;
}

let n = 0;
/**
 * A driver whose root holds a template snapshot with complete files but no manifest, and the
 * vm.json record of the VM that switched onto it: generation 2, its replacement, runs.
 */
function setup(): { driver: QemuVmmDriver; internals: Internals; dir: string; p: Persisted } {
  const root = join(base, `agent-${++n}`);
  const driver = new QemuVmmDriver({ root, accel: 'tcg', logger: pino({ level: 'silent' }), standby: { perSnapshot: 0 } });
  const internals = driver as unknown as Internals;
  internals.livePid = (_workdir, gen) => Promise.resolve(gen === 2 ? 4242 : 0); // the replacement runs
  const id = 'sn-tpl';
  const dir = join(root, 'snapshots', id);
  mkdirSync(dir, { recursive: true });
  for (const f of ['mem.img', 'state.bin', 'disk.qcow2']) writeFileSync(join(dir, f), f);
  const workdir = join(root, 'vms', 'vm1');
  mkdirSync(workdir, { recursive: true });
  const manifest = { schema: 1, snapshotId: id, method: 'shared-file' } as SnapshotManifest;
  const p: Persisted = {
    info: { vmId: 'vm1', state: 'snapshotting', workdir },
    image: { name: 'tiny', disk: '/x', recipeHash: '0123456789abcdef', diskVirtualSize: 64 << 20 },
    kernelArgs: '',
    memPath: join(dir, 'mem.img'),
    memShared: false,
    diskPath: join(workdir, `disk.${id}.qcow2`),
    gen: 2,
    dependsOn: [id],
    switching: { gen: 2, memPath: join(dir, 'mem.img'), diskPath: join(workdir, `disk.${id}.qcow2`), state: 'running', manifest } as Persisted['switching'],
  };
  return { driver, internals, dir, p };
}

describe('settling an interrupted template snapshot', () => {
  it('settleSwitch_whoseSealFailsOnAFullDisk_adoptsTheRunningVm_keepingTheSwitchToSealLater', async () => {
    const { driver, internals, dir, p } = setup();
    fullDisk.add(join(dir, 'image.json.tmp'));
    const adopted = await internals.settleSwitchOrGiveUp(p);
    // Not given up on (the caller would kill the replacement and remove its disk): the VM, on
    // the replacement, in the state its snapshot left it, with the snapshot still to seal.
    expect(adopted).toBeDefined();
    expect(adopted!.gen).toBe(2);
    expect(adopted!.info.state).toBe('running');
    expect(adopted!.switching).toEqual(p.switching);
    expect(existsSync(join(dir, 'manifest.json'))).toBe(false);
    // The disk has room again: the VM's next snapshot seals the one it runs from first.
    fullDisk.clear();
    await internals.sealSwitched(adopted!);
    expect(existsSync(join(dir, 'manifest.json'))).toBe(true);
    expect(adopted!.switching).toBeUndefined();
    await driver.close();
  });

  it('settleSwitch_whoseSealSucceeds_adoptsTheVmWithTheSnapshotSealed', async () => {
    const { driver, internals, dir, p } = setup();
    const adopted = await internals.settleSwitchOrGiveUp(p);
    expect(adopted?.info.state).toBe('running');
    expect(adopted?.switching).toBeUndefined();
    expect(existsSync(join(dir, 'manifest.json'))).toBe(true);
    await driver.close();
  });
});
