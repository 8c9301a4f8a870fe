// Whether a PID the fleet wrote down still names the process it started. PIDs are reused: after
// a reboot, or after everything was killed, state.json and QEMU's pid files still hold numbers
// the kernel may have given to unrelated processes, and the fleet runs as root, so signalling
// a bare PID could stop anything on the machine.
//
//  - Processes fleet.ts starts itself: it records their start time (field 22 of
//    /proc/<pid>/stat, clock ticks after boot) and the boot id. A PID names the same process
//    while both still match; a reused PID has a later start time, or the same one in another boot.
//  - QEMUs (their pid files are written by QEMU, with no start time): the process must be a
//    qemu-system binary whose arguments name the directory the pid file is in (as
//    host-agent/adapters/qemu/driver.ts isOurQemu checks: every QEMU it starts gets its
//    -pidfile, sockets and logs in that directory).
//  - Records of an older fleet.ts, without a start time: the process must run exactly the
//    command line the fleet started it with.
// The /proc root is a parameter so that tests can stage processes that cannot be made for real
// (a zombie, a recycled PID).
import { readFileSync } from 'node:fs';
import { basename, join } from 'node:path';

export interface ProcIdentity {
  /** Field 22 of /proc/<pid>/stat; -1: the process had exited before it could be read (never matches). */
  startTime: number;
  /** /proc/sys/kernel/random/boot_id when it was read; empty: unknown (start time alone decides). */
  bootId: string;
}

const PROC = '/proc';

function readText(path: string): string | undefined {
  try {
    return readFileSync(path, 'utf8');
  } catch {
    return undefined;
  }
}

/**
 * The fields of a /proc/<pid>/stat line from field 3 (state) on. Field 2, comm, is in
 * parentheses and may itself hold spaces and parentheses ("(sd-pam)", "a) (b"); the kernel
 * prints nothing after it but numbers and the one-letter state, so the fields resume after
 * the line's last ')'.
 */
function fieldsAfterComm(stat: string): string[] | undefined {
  const close = stat.lastIndexOf(')');
  if (close < 0) return undefined;
  const fields = stat.slice(close + 1).trim().split(/\s+/);
  return fields.length >= 20 ? fields : undefined;
}

/** Field 22 (starttime) of a /proc/<pid>/stat line; undefined if the line is not one. */
export function startTimeOfStat(stat: string): number | undefined {
  const v = fieldsAfterComm(stat)?.[19]; // fields[0] is field 3
  return v !== undefined && /^\d+$/.test(v) ? Number(v) : undefined;
}

/** Field 3 (state: R, S, D, Z, ...) of a /proc/<pid>/stat line. */
export function stateOfStat(stat: string): string | undefined {
  return fieldsAfterComm(stat)?.[0];
}

let cachedBootId: string | undefined;
export function bootId(proc = PROC): string {
  if (proc !== PROC) return (readText(join(proc, 'sys', 'kernel', 'random', 'boot_id')) ?? '').trim();
  cachedBootId ??= (readText(join(PROC, 'sys', 'kernel', 'random', 'boot_id')) ?? '').trim();
  return cachedBootId;
}

/** What identifies `pid` now, to be recorded right after starting it. */
export function identityOf(pid: number, proc = PROC): ProcIdentity {
  const stat = readText(join(proc, String(pid), 'stat'));
  return { startTime: (stat ? startTimeOfStat(stat) : undefined) ?? -1, bootId: bootId(proc) };
}

/**
 * True while `pid` is the process `id` was recorded for, and has not exited. A zombie counts
 * as exited: it can no longer be stopped, only reaped by its parent.
 */
export function isSameProcess(pid: number, id: ProcIdentity, proc = PROC): boolean {
  if (!(Number.isInteger(pid) && pid > 0) || id.startTime < 0) return false;
  if (id.bootId && id.bootId !== bootId(proc)) return false;
  const stat = readText(join(proc, String(pid), 'stat'));
  if (!stat) return false;
  const state = stateOfStat(stat);
  return state !== undefined && state !== 'Z' && state !== 'X' && startTimeOfStat(stat) === id.startTime;
}

/** The arguments `pid` runs with (empty for a zombie or a kernel thread); undefined if it does not exist. */
export function cmdlineOf(pid: number, proc = PROC): string[] | undefined {
  if (!(Number.isInteger(pid) && pid > 0)) return undefined;
  const raw = readText(join(proc, String(pid), 'cmdline'));
  return raw === undefined ? undefined : raw.split('\0').filter((s) => s.length > 0);
}

/**
 * True if `pid` is a QEMU started in one of `dirs`: a qemu-system binary with an argument
 * naming a file in one of them (its -pidfile, QMP socket or log). A dead PID, a zombie
 * (empty command line) or a PID reused by anything else is not.
 */
export function isQemuIn(pid: number, dirs: readonly string[], proc = PROC): boolean {
  const cmd = cmdlineOf(pid, proc);
  if (!cmd?.[0] || !basename(cmd[0]).startsWith('qemu-system-')) return false;
  return cmd.slice(1).some((a) => dirs.some((d) => a.includes(`${d}/`)));
}

/**
 * The command line a process started as `command args` runs with once its wrappers have
 * exec'd: `ip netns exec NS CMD...` becomes CMD..., and `sh -c '...; exec "BIN" ARGS'` becomes
 * BIN ARGS (the quoting the fleet's scripts use: double quotes, no escapes).
 */
export function launchedArgv(command: string, args: readonly string[]): string[] {
  let argv = [command, ...args];
  if (argv[0] === 'ip' && argv[1] === 'netns' && argv[2] === 'exec' && argv.length > 4) argv = argv.slice(4);
  if (argv[0] === 'sh' && argv[1] === '-c' && argv[2] !== undefined) {
    const last = /(?:^|;)\s*exec\s+([^;]+)$/.exec(argv[2])?.[1];
    if (last) argv = [...last.matchAll(/"([^"]*)"|(\S+)/g)].map((t) => t[1] ?? t[2] ?? '');
  }
  return argv;
}

/**
 * For a record without a start time (state.json of an older fleet.ts): true if `pid` runs
 * exactly the command line the fleet started (etcd, nats-server or node with its script). The
 * exact match is stricter than "some etcd": a reused PID that happens to be another etcd, or
 * another fleet's, is not ours to stop.
 */
export function runsLaunchedCommand(pid: number, command: string, args: readonly string[], proc = PROC): boolean {
  const cmd = cmdlineOf(pid, proc);
  const want = launchedArgv(command, args);
  return !!cmd && cmd.length === want.length && cmd.every((a, i) => a === want[i]);
}
