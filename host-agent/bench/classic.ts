// The classic-restore baseline shared by bench:vmm and the load test's QEMU-level baselines:
// QEMU's ordinary restore, what libvirt's `virsh restore` does. A new QEMU with anonymous RAM
// reads the whole full-RAM save stream (passed as an inherited fd, as libvirt passes one),
// continues, and is ready when the guest agent answers an exec. Same host mechanics as a fork
// child (overlay copy, pipelined QMP, same agent waits), so the two differ only in what the
// stream holds and where RAM lives (ADR 0009).
import { mkdir, open, rm } from 'node:fs/promises';
import { join } from 'node:path';
import { GuestAgentClient } from '../adapters/guest/client.ts';
import { qemuArgs, type QemuLaunch } from '../adapters/qemu/cmdline.ts';
import { incomingAndWait, setCaps } from '../adapters/qemu/driver.ts';
import { killAndWait, killHard, spawnQemu, type OverlayFactory, type QemuProcess } from '../adapters/qemu/process.ts';
import { QmpClient } from '../adapters/qmp/client.ts';

export interface ClassicRestoreSpec {
  /** The launch the stream was saved from (saveFullRamStream). */
  launch: QemuLaunch;
  /** The full-RAM save stream. */
  file: string;
  /** A fresh directory for this VM (created here, removed by stop()). */
  dir: string;
  name: string;
  overlays: OverlayFactory;
  diskBacking: string;
  diskVirtualSize: number;
}

/**
 * The stop() of every VM classicRestore started and nobody stopped yet, from its spawn on: the
 * QEMUs are detached and no VMM driver knows them, so a run stopped by Ctrl-C (mid-restore,
 * before any caller holds the handle) stops them with stopClassicRestores().
 */
const live = new Set<() => Promise<void>>();
let ending = false;

/** Stops every classic-restore VM still running; from then on classicRestore starts none (the process is ending). */
export async function stopClassicRestores(): Promise<void> {
  ending = true;
  await Promise.all([...live].map((stop) => stop()));
}

/** Restores one VM; ms from the start until it answered an exec. stop() kills it and removes its directory. */
export async function classicRestore(s: ClassicRestoreSpec): Promise<{ ms: number; stop: () => Promise<void> }> {
  await mkdir(s.dir);
  const disk = join(s.dir, 'disk.qcow2');
  const l: QemuLaunch = {
    ...s.launch, anonymousRam: true, disk, incoming: true, name: s.name,
    qmpSocket: join(s.dir, 'qmp.sock'), agentSocket: join(s.dir, 'qga.sock'), pidFile: join(s.dir, 'pid'),
  };
  let proc: QemuProcess | undefined;
  // Once: stopClassicRestores() and the restore's own failure path may both call it.
  let stopped: Promise<void> | undefined;
  const stop = (): Promise<void> =>
    (stopped ??= (async () => {
      if (proc) await killAndWait(proc).catch(() => killHard(proc!.pid));
      live.delete(stop);
      await rm(s.dir, { recursive: true, force: true });
    })());
  const t0 = performance.now();
  try {
    await s.overlays.create(s.diskBacking, disk, s.diskVirtualSize);
    const stream = await open(s.file, 'r');
    try {
      if (ending) throw new Error('classic restore: not started, the process is ending (stopClassicRestores)');
      proc = spawnQemu('qemu-system-x86_64', qemuArgs(l), join(s.dir, 'qemu.log'), [stream.fd]);
      live.add(stop);
    } finally {
      await stream.close();
    }
    const qmp = await QmpClient.connectWithRetry(l.qmpSocket, 10_000, () => !proc!.gone);
    await Promise.all([setCaps(qmp, { events: true, 'x-ignore-shared': false }), incomingAndWait(qmp, 'fd:3')]);
    await qmp.execute('cont');
    const ga = await GuestAgentClient.connect(l.agentSocket);
    await ga.sync(60_000, 250);
    await ga.exec({ path: '/bin/true' });
    const ms = performance.now() - t0;
    ga.close();
    qmp.close();
    return { ms, stop };
  } catch (e) {
    await stop();
    throw e;
  }
}
