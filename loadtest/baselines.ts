// Baselines measured at the QEMU level in the load-test process, on the same machine:
//   classic_restore: QEMU's ordinary save/restore with all of RAM in the stream (what
//     `virsh save` / `virsh restore` do), reusing the VMM benchmark's building blocks
//     (host-agent/bench/vmm.ts): driver, migrateAndWait, incomingAndWait, OverlayFactory.
//   naive_full_copy: a cross-host restore that first copies the whole saved memory stream
//     and the disk over a TCP stream between two of the fleet's host namespaces (so at the
//     fleet's shaped link rate; over mutual TLS with the hosts' peer certificates exactly when
//     the fleet's migration streams are encrypted), then does the classic restore from the copy.
// Both restore onto a qcow2 overlay from OverlayFactory, which runs `qemu-img create` once per
// backing path (a process spawn: tens to hundreds of ms under load) and copies that overlay's
// bytes afterwards. So each baseline's overlay is made once, untimed, before its first sample
// (primeOverlay), and every naive sample receives into the same directory (naiveDir, emptied
// between samples): the backing path of its restore is the same each time. (Each naive sample
// used to receive into a new directory and pay qemu-img inside its timer, and classic_restore
// paid it in its first sample.)
import { mkdir, rm, stat } from 'node:fs/promises';
import { spawn } from 'node:child_process';
import type { ChildProcess } from 'node:child_process';
import { createInterface } from 'node:readline';
import { join, resolve } from 'node:path';
import type { Logger } from 'pino';
import type { AccelSetting, LocalSnapshot } from '../host-agent/domain/vmm.ts';
import type { QemuLaunch } from '../host-agent/adapters/qemu/cmdline.ts';
import { QemuVmmDriver, saveFullRamStream } from '../host-agent/adapters/qemu/driver.ts';
import { OverlayFactory } from '../host-agent/adapters/qemu/process.ts';
import { classicRestore, stopClassicRestores } from '../host-agent/bench/classic.ts';
import { ensureImage } from '../deploy/images/build.ts';
import { setupScript } from './workload.ts';

const ROOT = resolve(import.meta.dirname, '..');

export interface LocalBaseline {
  driver: QemuVmmDriver;
  accel: string;
  snap: LocalSnapshot;
  /** The full-RAM migration stream (virsh save's file). */
  classicFile: string;
  launch: QemuLaunch;
  dir: string;
  overlays: OverlayFactory;
  /** Boot to agent-answers plus the setup, ms (a cold_boot sample measured below the API). */
  coldBootMs: number;
}

/** Boots a guest with the template's setup, snapshots it, and saves a clone the classic way. */
export async function prepareLocalBaseline(o: { root: string; accel: AccelSetting; guestMib: number; dirtyMib: number; logger: Logger; signal?: AbortSignal }): Promise<LocalBaseline> {
  const image = await ensureImage('tiny');
  // No standbys: none may start (and share the CPUs) while the fleet's scenarios are measured.
  const driver = new QemuVmmDriver({ root: o.root, accel: o.accel, logger: o.logger, probeImage: image, autoProbeDeadlineMs: 10_000, standby: { max: 0, perSnapshot: 0 } });
  // A stopped run (Ctrl-C) ends the preparation by closing the driver (its VMs stopped): its
  // teardown waits for this, and the preparation takes minutes under TCG.
  const onAbort = (): void => void driver.close().catch(() => undefined);
  o.signal?.addEventListener('abort', onAbort, { once: true });
  try {
    if (o.signal?.aborted) throw new Error('the run was stopped before the baseline guest was prepared');
    return await prepare(driver, image, o);
  } catch (e) {
    await driver.close().catch(() => undefined);
    throw e;
  } finally {
    o.signal?.removeEventListener('abort', onAbort);
  }
}

async function prepare(driver: QemuVmmDriver, image: Awaited<ReturnType<typeof ensureImage>>, o: { root: string; guestMib: number; dirtyMib: number }): Promise<LocalBaseline> {
  const accel = await driver.resolveAccel();
  const t0 = performance.now();
  await driver.create({ vmId: 'tpl', image, memoryMib: o.guestMib, vcpus: 1 });
  const r = await driver.exec('tpl', { path: '/bin/sh', args: ['-c', setupScript(o.dirtyMib)], timeoutMs: 300_000 });
  if (r.exitCode !== 0) throw new Error(`template setup failed: ${r.stderr.toString()}`);
  const coldBootMs = performance.now() - t0;
  const snap = await driver.snapshot('tpl', 'lt-snap');
  await driver.destroy('tpl');
  const dir = join(o.root, 'classic');
  await mkdir(dir, { recursive: true });
  const classicFile = join(dir, 'full.bin');
  const launch = await saveFullRamStream(driver, snap, classicFile);
  const b: LocalBaseline = { driver, accel, snap, classicFile, launch, dir, overlays: new OverlayFactory(), coldBootMs };
  // classic_restore's overlay, before its first (timed) sample.
  await primeOverlay(b, join(snap.dir, 'disk.qcow2'));
  return b;
}

let seq = 0;
let primes = 0;

/**
 * Makes the overlay factory's template for `backing`, untimed: every later restore onto it gets
 * a byte copy instead of a `qemu-img create` (OverlayFactory). `qemu-img create -u` does not
 * open the backing file, so it need not exist yet (the naive copy's disk arrives per sample).
 */
export async function primeOverlay(b: Pick<LocalBaseline, 'dir' | 'overlays' | 'snap'>, backing: string): Promise<void> {
  const scratch = join(b.dir, `overlay-prime-${primes++}.qcow2`);
  try {
    await b.overlays.create(backing, scratch, b.snap.manifest.diskVirtualSize);
  } finally {
    await rm(scratch, { force: true });
  }
}

/** Where every naive_full_copy sample receives the copy (emptied before and after each): one path, so its restore's overlay backing is the same every sample. */
export function naiveDir(b: Pick<LocalBaseline, 'dir'>): string {
  return join(b.dir, 'naive');
}

/**
 * One classic restore: new QEMU with anonymous RAM reads the whole stream from `file` (passed
 * as an fd, as libvirt does), continues, and is ready when the guest agent answers an exec.
 * Returns ms from spawn to that answer; the VM is killed afterwards.
 */
export async function classicRestoreOnce(b: LocalBaseline, file = b.classicFile, diskBacking = join(b.snap.dir, 'disk.qcow2')): Promise<number> {
  const n = seq++;
  const r = await classicRestore({ launch: b.launch, file, dir: join(b.dir, `r${n}`), name: `lt-classic-${n}`, overlays: b.overlays, diskBacking, diskVirtualSize: b.snap.manifest.diskVirtualSize });
  await r.stop();
  return r.ms;
}

/**
 * Stops the baselines' QEMUs: every classic restore still running (their QEMUs are detached and
 * the driver does not know them; one is mid-restore when Ctrl-C lands in classic_restore or
 * naive_full_copy), then the driver's VMs.
 */
export async function closeLocalBaseline(b: LocalBaseline | undefined): Promise<void> {
  await stopClassicRestores();
  await b?.driver.close();
}

function lines(child: ChildProcess): AsyncIterator<string> {
  return createInterface({ input: child.stdout! })[Symbol.asyncIterator]();
}

async function nextJson(it: AsyncIterator<string>, what: string): Promise<Record<string, unknown>> {
  const r = await it.next();
  if (r.done) throw new Error(`${what}: exited without output`);
  return JSON.parse(r.value) as Record<string, unknown>;
}

/** SIGTERM to the child's PID, resolved once it has exited (at once if it already has, by a code or a signal). */
function stop(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null || child.pid === undefined) return Promise.resolve();
  const gone = new Promise<void>((r) => child.once('exit', () => r()));
  child.kill('SIGTERM');
  return gone;
}

export interface CopyPath {
  /** Network namespaces of the sending and receiving host; undefined = root namespace loopback. */
  fromNetns?: string;
  toNetns?: string;
  fromAddress: string;
  port: number;
  /** The sending and receiving hosts' peer TLS files (CA, certificate, key): the copy is then mutual TLS. */
  tls?: { from: readonly [string, string, string]; to: readonly [string, string, string] };
}

function nodeIn(netns: string | undefined, args: string[]): ChildProcess {
  const cmd = [process.execPath, '--import', 'tsx', join(ROOT, 'loadtest', 'copy-main.ts'), ...args];
  const [bin, ...rest] = netns ? ['ip', 'netns', 'exec', netns, ...cmd] : cmd;
  return spawn(bin!, rest, { stdio: ['pipe', 'pipe', 'inherit'], cwd: ROOT });
}

/**
 * Starts the sender and primes the restore's overlay (neither timed). Returns a function that
 * runs one timed copy + classic restore. `register` gets the sender's stop right after its
 * spawn (synchronously, before the first await), so a teardown in the window before it listens
 * stops it too; the sender is also stopped when it fails to start. The returned `close` is the
 * same stop (safe twice). `restore` is classicRestoreOnce (tests pass their own).
 */
export async function startNaive(
  b: LocalBaseline,
  path: CopyPath,
  register: (stop: () => Promise<void>) => void,
  restore: (b: LocalBaseline, file: string, diskBacking: string) => Promise<number> = classicRestoreOnce,
): Promise<{ once: () => Promise<{ ms: number; copyMs: number; bytes: number }>; close: () => Promise<void> }> {
  const disk = join(b.snap.dir, 'disk.qcow2');
  const server = nodeIn(path.fromNetns, ['serve', '--listen', `${path.fromAddress}:${path.port}`, '--files', `${b.classicFile},${disk}`, ...(path.tls ? ['--tls', path.tls.from.join(',')] : [])]);
  const close = (): Promise<void> => stop(server);
  register(close);
  const out = naiveDir(b);
  const copiedDisk = join(out, 'disk.qcow2');
  try {
    await nextJson(lines(server), 'naive copy server');
    await primeOverlay(b, copiedDisk);
  } catch (e) {
    await close();
    throw e;
  }
  return {
    once: async () => {
      await rm(out, { recursive: true, force: true });
      await mkdir(out);
      const recv = nodeIn(path.toNetns, ['recv', '--connect', `${path.fromAddress}:${path.port}`, '--out', out, ...(path.tls ? ['--tls', path.tls.to.join(',')] : [])]);
      try {
        const it = lines(recv);
        await nextJson(it, 'naive copy receiver');
        // Timed from here: the copy, then the restore from the copied files.
        const t0 = performance.now();
        recv.stdin!.write('go\n');
        const res = await nextJson(it, 'naive copy receiver');
        const copyMs = performance.now() - t0;
        await stat(copiedDisk);
        const restoreMs = await restore(b, join(out, 'full.bin'), copiedDisk);
        return { ms: copyMs + restoreMs, copyMs, bytes: Number(res.bytes) };
      } finally {
        await stop(recv);
        await rm(out, { recursive: true, force: true });
      }
    },
    close,
  };
}
