// Child-process plumbing for test harnesses and the local fleet: free ports, temporary
// directories, readiness polling, and a watchdog so that a server we started is stopped
// by PID even when the process that started it is killed.
import { spawn } from 'node:child_process';
import type { ChildProcess } from 'node:child_process';
import { createServer } from 'node:net';
import { mkdtempSync, rmSync, openSync, closeSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { noteForReaper } from '../../host-agent/adapters/tied.ts';

/** The kernel's ephemeral port range (net.ipv4.ip_local_port_range). */
function ephemeralRange(): [number, number] {
  try {
    const [lo, hi] = readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/).map(Number);
    if (lo && hi) return [lo, hi];
  } catch {
    /* not Linux: fall through */
  }
  return [32768, 60999];
}

function bindable(port: number, host: string): Promise<number | undefined> {
  return new Promise((resolve) => {
    const srv = createServer();
    srv.unref();
    srv.once('error', () => resolve(undefined));
    srv.listen(port, host, () => {
      const addr = srv.address();
      const got = typeof addr === 'object' && addr ? addr.port : undefined;
      srv.close(() => resolve(got));
    });
  });
}

/**
 * A free TCP port on `host`. It is drawn below the kernel's ephemeral range, so that between
 * this check and the server's own bind no outgoing connection (of any process: test files
 * run in parallel) can be given the port; port 0 would hand out exactly those ports.
 */
export async function freePort(host = '127.0.0.1'): Promise<number> {
  const [lo] = ephemeralRange();
  const base = 10_000;
  if (lo - base >= 1000) {
    for (let i = 0; i < 50; i++) {
      const got = await bindable(base + Math.floor(Math.random() * (lo - base)), host);
      if (got !== undefined) return got;
    }
  }
  const got = await bindable(0, host);
  if (got === undefined) throw new Error(`freePort: cannot bind on ${host}`);
  return got;
}

/** A new directory under the system's temporary directory, removed by the reaper (reaper.ts) if the test process dies first. */
export function tempDir(prefix: string): string {
  const dir = mkdtempSync(join(tmpdir(), prefix));
  noteForReaper({ dir });
  return dir;
}

export function sleep(ms: number): Promise<void> {
  return new Promise((r) => setTimeout(r, ms));
}

/**
 * Polls `probe` until it returns true or `timeoutMs` passes. `giveUp`, checked before each
 * probe, ends the wait at once with the error it returns (a server that exited, say).
 */
export async function waitFor(what: string, probe: () => Promise<boolean>, timeoutMs: number, intervalMs = 20, giveUp?: () => Error | undefined): Promise<void> {
  const until = Date.now() + timeoutMs;
  let lastErr: unknown;
  while (Date.now() < until) {
    const fatal = giveUp?.();
    if (fatal) throw fatal;
    try {
      if (await probe()) return;
    } catch (e) {
      lastErr = e;
    }
    await sleep(intervalMs);
  }
  throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`, { cause: lastErr });
}

/** The last `bytes` of a log file, or a note that there is none. */
export function logTail(path: string | undefined, bytes = 2000): string {
  if (!path) return '(no log)';
  try {
    const text = readFileSync(path, 'utf8');
    return text.length > bytes ? `…${text.slice(-bytes)}` : text || '(empty log)';
  } catch {
    return `(no log at ${path})`;
  }
}

/** `proc` exited before it answered its readiness probe. */
export class ExitedBeforeReadyError extends Error {}

/**
 * Starts a server (`start` picks its ports, launches it and waits until it is ready), again
 * on fresh ports when it exits before it is ready: a port can still be taken between
 * freePort and the server's own bind. At most `tries` starts.
 */
export async function onFreshPorts<T>(start: () => Promise<T>, tries = 3): Promise<T> {
  for (let attempt = 1; ; attempt++) {
    try {
      return await start();
    } catch (e) {
      if (!(e instanceof ExitedBeforeReadyError) || attempt >= tries) throw e;
    }
  }
}

/**
 * Like waitFor, for a server we started: fails at once, with the tail of its log, if the
 * process exits first (a port taken after all, a bad flag), instead of polling to the timeout.
 */
export async function waitReady(proc: ManagedProcess, what: string, probe: () => Promise<boolean>, timeoutMs: number, intervalMs = 20): Promise<void> {
  let code: number | null | undefined;
  let gone = false;
  void proc.exited.then((c) => {
    code = c;
    gone = true;
  });
  const exitedFirst = (): Error | undefined => (gone ? new ExitedBeforeReadyError(`${proc.name} (pid ${proc.pid}) exited with code ${String(code)} before ${what}; its log ends:\n${logTail(proc.logPath)}`) : undefined);
  await waitFor(what, probe, timeoutMs, intervalMs, exitedFirst).catch((e: unknown) => {
    if (!(e instanceof ExitedBeforeReadyError) && e instanceof Error) e.message += `; ${proc.name}'s log ends:\n${logTail(proc.logPath)}`;
    throw e;
  });
}

/** CPU (utime + stime, all threads, in ms: 10 ms ticks) and minor page faults of a process, from /proc. */
export function procCpu(pid: number): { ms: number; faults: number } {
  const f = readFileSync(`/proc/${pid}/stat`, 'utf8');
  const rest = f.slice(f.lastIndexOf(')') + 2).split(' ');
  return { ms: (Number(rest[11]) + Number(rest[12])) * 10, faults: Number(rest[7]) };
}

export function pidAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

export interface ManagedProcess {
  readonly name: string;
  readonly pid: number;
  readonly child: ChildProcess;
  /** Directory removed when the process stops (if any). */
  readonly dir: string | undefined;
  readonly logPath: string | undefined;
  /** Resolves when the process has exited. */
  readonly exited: Promise<number | null>;
  /** SIGTERM, then SIGKILL after `graceMs`; waits for exit; removes `dir`. Idempotent. */
  stop(graceMs?: number): Promise<void>;
  /** SIGKILL now (fault injection); does not remove `dir`. */
  kill(): void;
}

const live = new Set<ManagedProcess>();
let exitHookInstalled = false;

function installExitHook(): void {
  if (exitHookInstalled) return;
  exitHookInstalled = true;
  // Synchronous last resort on normal exit: kill by PID, remove directories.
  process.once('exit', () => {
    for (const p of live) {
      try {
        process.kill(p.pid, 'SIGKILL');
      } catch {
        /* already gone */
      }
      if (p.dir) rmSync(p.dir, { recursive: true, force: true });
    }
  });
}

export interface SpawnManagedOptions {
  name: string;
  command: string;
  args: readonly string[];
  /** Removed after the process stops. */
  dir?: string;
  /** stdout and stderr go here (append); otherwise they are discarded. */
  logPath?: string;
  env?: NodeJS.ProcessEnv;
  /** Working directory (default: this process's). */
  cwd?: string;
  /** When false, stop() leaves `dir` in place (e.g. for a restart); default true. */
  removeDirOnStop?: boolean;
  /** When true (default), a watchdog kills the process and removes `dir` if we die first. */
  watchdog?: boolean;
}

/**
 * Starts a long-running server process. It is tracked by PID; a detached watchdog shell
 * (itself tracked by PID) kills it with SIGKILL and removes its directory if this Node
 * process disappears without stopping it, e.g. when a test run is interrupted.
 */
export function spawnManaged(opts: SpawnManagedOptions): ManagedProcess {
  installExitHook();
  const fd = opts.logPath ? openSync(opts.logPath, 'a') : undefined;
  const child = spawn(opts.command, [...opts.args], {
    stdio: ['ignore', fd ?? 'ignore', fd ?? 'ignore'],
    env: opts.env ?? process.env,
    ...(opts.cwd ? { cwd: opts.cwd } : {}),
  });
  if (fd !== undefined) closeSync(fd);
  if (child.pid === undefined) throw new Error(`${opts.name}: failed to start ${opts.command}`);
  const pid = child.pid;
  // Its own watchdog (below) also ends it, but only within a second: the reaper's first pass
  // ends it before it can start more (an agent's QEMUs).
  noteForReaper({ pid });
  const exited = new Promise<number | null>((resolve) => {
    if (child.exitCode !== null) resolve(child.exitCode);
    else child.once('exit', (code) => resolve(code));
  });
  child.once('error', () => {});

  let watchdogPid: number | undefined;
  let wd: ChildProcess | undefined;
  if (opts.watchdog ?? true) {
    // $1 = our pid, $2 = server pid, $3 = dir to remove (may be empty). The server is known by
    // its start time (field 22 of /proc/<pid>/stat) too: once it has exited and been reaped,
    // its PID may be another process's, which must not be killed (nor the directory removed).
    const script =
      'st() { awk \'{print $22}\' "/proc/$2/stat" 2>/dev/null; }; s0=$(st "$@"); [ -n "$s0" ] || exit 0; ' +
      'ours() { [ "$(st "$@")" = "$s0" ]; }; ' +
      'while kill -0 "$1" 2>/dev/null && ours "$@"; do sleep 1; done; if ours "$@"; then kill -9 "$2"; sleep 0.2; [ -n "$3" ] && rm -rf "$3"; fi';
    wd = spawn('sh', ['-c', script, 'ff-watchdog', String(process.pid), String(pid), opts.dir ?? ''], {
      detached: true,
      stdio: 'ignore',
    });
    wd.unref();
    watchdogPid = wd.pid;
  }

  let stopping: Promise<void> | undefined;
  const proc: ManagedProcess = {
    name: opts.name,
    pid,
    child,
    dir: opts.dir,
    logPath: opts.logPath,
    exited,
    kill() {
      // Only while it is our unreaped child: a reaped PID may be another process's by now.
      if (child.exitCode !== null || child.signalCode !== null) return;
      try {
        process.kill(pid, 'SIGKILL');
      } catch {
        /* gone */
      }
    },
    stop(graceMs = 5000) {
      stopping ??= (async () => {
        if (child.exitCode === null && child.signalCode === null) {
          try {
            process.kill(pid, 'SIGTERM');
          } catch {
            /* gone */
          }
          const t = setTimeout(() => {
            try {
              process.kill(pid, 'SIGKILL');
            } catch {
              /* gone */
            }
          }, graceMs);
          await exited;
          clearTimeout(t);
        }
        // The watchdog ends on its own once the server is gone: killed only while it runs.
        if (watchdogPid !== undefined && wd?.exitCode === null && wd.signalCode === null) {
          try {
            process.kill(watchdogPid, 'SIGKILL');
          } catch {
            /* gone */
          }
        }
        if (opts.dir && (opts.removeDirOnStop ?? true)) rmSync(opts.dir, { recursive: true, force: true });
        live.delete(proc);
      })();
      return stopping;
    },
  };
  live.add(proc);
  return proc;
}
