// QEMU processes: spawn detached (so a restarting agent can adopt them), wait for exit whether
// or not they are our children, and find live QEMUs belonging to a workdir.
import { spawn, execFile, type ChildProcess } from 'node:child_process';
import { openSync, closeSync, readFileSync } from 'node:fs';
import { readFile, writeFile } from 'node:fs/promises';
import { promisify } from 'node:util';
import { ForkfleetError } from '../../../proto/errors.ts';
import { noteForReaper } from '../tied.ts';

const run = promisify(execFile);

export interface QemuProcess {
  pid: number;
  /** Set when this agent spawned it; undefined for an adopted process. */
  child: ChildProcess | undefined;
  /** Resolves once the process is gone. */
  exited: Promise<void>;
  /** True once `exited` has resolved: its PID may belong to another process by now. */
  gone: boolean;
  /** Stops watching an adopted process that is not kept after all (its poll timer); `exited` then never resolves. */
  unwatch?: () => void;
}

/**
 * Spawn QEMU detached, stdout/stderr to `logPath`. `extraFds` are inherited as fd 3, 4, ...
 * (e.g. a migration stream for `migrate-incoming fd:3`); the caller closes its copies.
 */
export function spawnQemu(binary: string, args: string[], logPath: string, extraFds: number[] = []): QemuProcess {
  const fd = openSync(logPath, 'a');
  let child: ChildProcess;
  try {
    child = spawn(binary, args, { detached: true, stdio: ['ignore', fd, fd, ...extraFds] });
  } finally {
    closeSync(fd);
  }
  // A spawn that fails (EMFILE, EAGAIN, ENOENT) emits 'error' on the next tick: without a
  // listener by then, that is an uncaught exception and the whole agent exits.
  child.on('error', () => undefined);
  if (child.pid === undefined) throw new ForkfleetError('unavailable', `could not start ${binary} (out of processes or file descriptors on the host, or the binary is missing)`, { retryable: true });
  child.unref();
  noteForReaper({ pid: child.pid });
  const p: QemuProcess = { pid: child.pid, child, exited: Promise.resolve(), gone: false };
  p.exited = new Promise<void>((resolve) => {
    const end = (): void => {
      p.gone = true;
      resolve();
    };
    if (child.exitCode !== null || child.signalCode !== null) end();
    else child.once('exit', end);
  });
  return p;
}

export function isAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

/** For a process that is not our child: poll until it is gone. */
export function adoptProcess(pid: number): QemuProcess {
  const p: QemuProcess = { pid, child: undefined, exited: Promise.resolve(), gone: false };
  p.exited = new Promise<void>((resolve) => {
    const t = setInterval(() => {
      if (!isAlive(pid) || isZombie(pid)) {
        clearInterval(t);
        p.gone = true;
        resolve();
      }
    }, 20);
    t.unref();
    p.unwatch = () => clearInterval(t);
  });
  return p;
}

/** The process has exited: no such PID, or a zombie no one has reaped yet. */
export function isGone(pid: number): boolean {
  return !isAlive(pid) || isZombie(pid);
}

function isZombie(pid: number): boolean {
  try {
    // Synchronous read is fine: a tiny procfs file, polled only for adopted processes.
    return /\) Z /.test(readFileSync(`/proc/${pid}/stat`, 'utf8'));
  } catch {
    return true;
  }
}

/**
 * Killed already: a zombie, or SIGKILL pending (sent, not yet acted on: a process on a busy CPU
 * runs on for a moment after kill(2) returns). Such a QEMU is as good as gone, not a VM to keep.
 */
export function isKilled(pid: number): boolean {
  if (isZombie(pid)) return true;
  try {
    return sigkillPending(readFileSync(`/proc/${pid}/status`, 'utf8'));
  } catch {
    return true;
  }
}

/** Whether a /proc/<pid>/status text shows SIGKILL pending: SigPnd (the thread's) or ShdPnd (the process's), hex masks; SIGKILL is bit 8. */
export function sigkillPending(status: string): boolean {
  return [...status.matchAll(/^(?:SigPnd|ShdPnd):\s*([0-9a-f]+)$/gm)].some((m) => (BigInt(`0x${m[1]}`) & 0x100n) !== 0n);
}

export function killHard(pid: number): void {
  try {
    process.kill(pid, 'SIGKILL');
  } catch {
    // already gone
  }
}

/** The process's command line, or undefined if it is gone. */
export async function cmdlineOf(pid: number): Promise<string[] | undefined> {
  try {
    const raw = await readFile(`/proc/${pid}/cmdline`, 'utf8');
    return raw.split('\0').filter((s) => s.length > 0);
  } catch {
    return undefined;
  }
}

export async function qemuImgCreateOverlay(backing: string, overlay: string, virtualSize: number): Promise<void> {
  // -u: don't open the backing chain (it may be held open by a running QEMU); the size is known.
  await run('qemu-img', ['create', '-q', '-f', 'qcow2', '-u', '-b', backing, '-F', 'qcow2', overlay, String(virtualSize)]);
}

/** Points a qcow2 layer at another backing file without touching data (-u: header only). */
export async function qemuImgRebaseUnsafe(layer: string, backing: string): Promise<void> {
  await run('qemu-img', ['rebase', '-u', '-f', 'qcow2', '-b', backing, '-F', 'qcow2', layer]);
}

/**
 * Creates qcow2 overlays. An empty overlay is a pure function of (backing path, backing format,
 * virtual size), so the first one for a backing file is made by `qemu-img` and later ones are
 * byte copies of it from memory: no process spawn (tens to hundreds of ms under load) per clone.
 */
export class OverlayFactory {
  static readonly MAX_TEMPLATES = 64;
  private readonly templates = new Map<string, Promise<Buffer>>();

  async create(backing: string, overlay: string, virtualSize: number): Promise<void> {
    const key = `${backing}\0${virtualSize}`;
    let tpl = this.templates.get(key);
    if (!tpl) {
      tpl = qemuImgCreateOverlay(backing, overlay, virtualSize).then(() => readFile(overlay));
      this.templates.set(key, tpl);
      // Bounded: ~200 KB per template; the oldest snapshot's is dropped first.
      if (this.templates.size > OverlayFactory.MAX_TEMPLATES) this.templates.delete(this.templates.keys().next().value as string);
      tpl.catch(() => this.templates.delete(key));
      await tpl;
      return;
    }
    // 'wx': never overwrite an existing file (a disk some VM may use).
    await writeFile(overlay, await tpl, { flag: 'wx' });
  }
}

export async function qemuVersion(binary: string): Promise<string> {
  const { stdout } = await run(binary, ['--version']);
  const m = /version (\d+\.\d+\.\d+)/.exec(stdout);
  if (!m?.[1]) throw new Error(`cannot parse ${binary} --version: ${stdout}`);
  return m[1];
}

/**
 * SIGKILL and wait until the process is gone. Holds the event loop open while waiting: our
 * QEMU children are unref'd (they outlive the agent), so a bare `await exited` could let a CLI
 * exit before its cleanup ran.
 */
export async function killAndWait(p: QemuProcess): Promise<void> {
  // One that exited already (a crashed VM destroyed later) is not signalled: its PID may
  // have been given to an unrelated process since.
  if (p.gone) return;
  const keep = setInterval(() => undefined, 50);
  try {
    killHard(p.pid);
    await p.exited;
  } finally {
    clearInterval(keep);
  }
}
