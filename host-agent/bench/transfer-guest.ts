// The transfer benchmark's default content: snapshots of a real booted guest.
//
// A 256 MiB `tiny` guest (1 vCPU; accel from FF_ACCEL, default auto, as the agent) boots, and its workload puts
// 64 MiB into guest RAM (tmpfs): 32 MiB from the guest's /dev/urandom and 32 MiB of log-like
// text (transfer-image.ts textBytes, written through the guest agent). The VMM driver
// snapshots it (s1). A child forked from s1 then writes 16 MiB (8 MiB random, 8 MiB text) and
// is snapshotted too (s2, parent s1): the diff snapshot. Both are the driver's own snapshot
// files (memory image, device state, qcow2 disk layer), the artifacts the agent's shipper
// ingests. The child's layer is flattened onto the image's base disk, as the shipper does for
// a snapshot that leaves the host.
import { execFile } from 'node:child_process';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { pino } from 'pino';
import { ensureImage } from '../../deploy/images/build.ts';
import { QemuVmmDriver } from '../adapters/qemu/driver.ts';
import type { AccelSetting, LocalSnapshot } from '../domain/vmm.ts';
import { ArtifactKind } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { textBytes } from './transfer-image.ts';

const run = promisify(execFile);
const MiB = 1024 * 1024;

export interface BenchArtifact {
  kind: ArtifactKind;
  name: string;
  path: string;
}

export interface GuestSnapshots {
  s1: BenchArtifact[];
  s2: BenchArtifact[];
  /** Bytes the child's workload wrote after the fork (the diff's "changed" bytes). */
  changedBytes: number;
  accel: string;
  bootMs: number;
}

function artifacts(snap: LocalSnapshot, disk: string): BenchArtifact[] {
  const f = snap.manifest.files;
  return [
    { kind: ArtifactKind.MEMORY, name: f.memory, path: join(snap.dir, f.memory) },
    { kind: ArtifactKind.DEVICE_STATE, name: f.deviceState, path: join(snap.dir, f.deviceState) },
    { kind: ArtifactKind.DISK_LAYER, name: f.disk, path: disk },
  ];
}

/** The drivers of snapshotBootedGuest calls under way (their QEMUs are detached). */
const drivers = new Set<QemuVmmDriver>();

/** Stops the VMs of every snapshotBootedGuest under way: a benchmark stopped by Ctrl-C would leave them running. */
export async function closeBootedGuests(): Promise<void> {
  await Promise.all([...drivers].map((d) => d.close()));
}

/**
 * Boots the guest under `dir`/vmm, takes s1 and s2 and stops every VM before returning; the
 * snapshot files stay under `dir`.
 */
export async function snapshotBootedGuest(dir: string, log: (line: string) => void): Promise<GuestSnapshots> {
  const setting = process.env.FF_ACCEL ?? 'auto';
  if (setting !== 'auto' && setting !== 'kvm' && setting !== 'tcg') throw new Error(`FF_ACCEL: "${setting}" is not kvm, tcg or auto`);
  const image = await ensureImage('tiny');
  const logger = pino({ level: process.env.LOG_LEVEL ?? 'warn' });
  const driver = new QemuVmmDriver({ root: join(dir, 'vmm'), accel: setting as AccelSetting, logger, probeImage: image, autoProbeDeadlineMs: 10_000, standby: { max: 0, perSnapshot: 0 } });
  drivers.add(driver);
  try {
    const accel = await driver.resolveAccel();
    const tpl = await driver.create({ vmId: 'tpl', image, memoryMib: 256, vcpus: 1 });
    const sh = async (vmId: string, s: string): Promise<void> => {
      const r = await driver.exec(vmId, { path: '/bin/sh', args: ['-c', s], timeoutMs: 300_000 });
      if (r.exitCode !== 0) throw new Error(`${vmId}: ${s}: exit ${r.exitCode}: ${r.stderr.toString()}`);
    };
    const workload = async (vmId: string, name: string, bytes: number, seed: number): Promise<void> => {
      await sh(vmId, `head -c ${bytes / 2} /dev/urandom > /dev/shm/${name}.bin`);
      await driver.writeFile(vmId, `/dev/shm/${name}.log`, textBytes(bytes / 2, seed));
      await sh(vmId, 'sync');
    };
    let t = performance.now();
    await workload('tpl', 'workload', 64 * MiB, 1);
    log(`guest booted in ${tpl.readyMs.toFixed(0)} ms (${accel}); workload written in ${(performance.now() - t).toFixed(0)} ms`);
    const s1 = await driver.snapshot('tpl', 's1');
    await driver.destroy('tpl');

    await driver.fork(s1, [{ vmId: 'child' }]);
    t = performance.now();
    await workload('child', 'child', 16 * MiB, 2);
    const s2 = await driver.snapshot('child', 's2');
    await driver.destroy('child');
    log(`child wrote 16 MiB and was snapshotted in ${(performance.now() - t).toFixed(0)} ms`);

    const imageDisk = (JSON.parse(await readFile(join(s2.dir, 'image.json'), 'utf8')) as { disk: string }).disk;
    const s2Disk = join(dir, 's2.disk.qcow2');
    await run('qemu-img', ['convert', '-U', '-O', 'qcow2', '-B', imageDisk, '-F', 'qcow2', join(s2.dir, s2.manifest.files.disk), s2Disk]);
    return { s1: artifacts(s1, join(s1.dir, s1.manifest.files.disk)), s2: artifacts(s2, s2Disk), changedBytes: 16 * MiB, accel, bootMs: tpl.readyMs };
  } finally {
    drivers.delete(driver);
    await driver.close();
  }
}
