// Child processes that must not outlive the agent. QEMU is spawned detached on purpose (a
// restarting agent adopts it), but a helper process (a qemu-img convert of a whole disk, a
// RAM-pool fill, a TLS relay) works for the agent that started it: if that agent is killed,
// the helper would go on writing into files the next agent removes at start. `setpriv
// --pdeathsig KILL` (util-linux, on every Debian install; --pdeathsig since 2.33) has the
// kernel kill the helper when the agent's thread that spawned it dies (PR_SET_PDEATHSIG).
// Node spawns from the main thread, whose death is the process's.
import { execFile } from 'node:child_process';
import { appendFileSync, existsSync, statSync } from 'node:fs';
import { isAbsolute, join, normalize } from 'node:path';
import { tmpdir } from 'node:os';
import { promisify } from 'node:util';
import { identityOf } from '../../deploy/fleet/proc-identity.ts';

/** `name`'s path on PATH, or undefined. */
export function onPath(name: string): string | undefined {
  for (const dir of (process.env.PATH ?? '/usr/bin:/bin').split(':')) {
    if (dir && existsSync(join(dir, name))) return join(dir, name);
  }
  return undefined;
}

const SETPRIV = onPath('setpriv');

/**
 * The command line that runs `cmd args` as a child that dies with this process. Without
 * setpriv (not a Debian host) the command runs as is, untied.
 */
export function tiedToUs(cmd: string, args: readonly string[]): [string, string[]] {
  return SETPRIV ? [SETPRIV, ['--pdeathsig', 'KILL', '--', cmd, ...args]] : [cmd, [...args]];
}

const execFileAsync = promisify(execFile);

/** execFile of a command tied to this process (tiedToUs). */
export function runTied(cmd: string, args: readonly string[]): Promise<{ stdout: string; stderr: string }> {
  const [c, a] = tiedToUs(cmd, args);
  return execFileAsync(c, a, { encoding: 'utf8' });
}

/**
 * Test runs only. A test process that sets FF_REAP_FILE (services/testkit/reaper.ts) has a
 * watcher undo, once that process is gone, what it made and did not undo itself: a Ctrl-C, a
 * crash or a timeout skips every afterAll. What is meant to outlive the process that made it
 * notes itself here: QEMUs (spawned detached, so a restarted agent can adopt them), a fleet's
 * daemons and namespaces. One line per thing, appended (a write under PIPE_BUF is atomic, so
 * agents and fleets of one test can share the file). FF_REAP_FILE unset (a real deployment):
 * nothing is written. Never throws: a note that cannot be written costs only the cleanup.
 */
export function noteForReaper(what: { pid: number; startTime?: number } | { netns: string } | { dir: string }): void {
  const file = process.env.FF_REAP_FILE;
  if (!file) return;
  let line: string;
  if ('pid' in what) {
    // The start time makes the watcher's kill safe: a PID reused by then names another process.
    // Given by a caller that has read it already.
    const startTime = what.startTime ?? identityOf(what.pid).startTime;
    if (startTime < 0) return; // exited already
    line = `pid ${what.pid} ${startTime}`;
  } else if ('netns' in what) {
    // With its inode and change time (whole seconds, as stat -c %Z prints it): the watcher
    // deletes the namespace only while the name is still that one. Seconds pass between a test
    // process's end and its watcher's deletes, and the next test file (vitest does not wait for
    // the last worker) may have made a namespace of that name. The kernel hands a freed
    // namespace's inode number out again at once: the time tells the new one apart.
    let id: string;
    try {
      const st = statSync(`/run/netns/${what.netns}`);
      id = `${st.ino}:${Math.floor(st.ctimeMs / 1000)}`;
    } catch {
      return; // none of that name: nothing to undo
    }
    line = `netns ${what.netns} ${id}`;
  }
  else {
    // A directory the watcher may delete whole: an absolute, normal path at least two deep,
    // never the temporary directory itself (an empty or relative one would be "/" to it).
    const d = what.dir;
    if (!isAbsolute(d) || normalize(d) !== d || d.endsWith('/') || d.split('/').filter(Boolean).length < 2 || d === tmpdir()) return;
    line = `dir ${d}`;
  }
  if (line.includes('\n')) return;
  try {
    appendFileSync(file, `${line}\n`);
  } catch {
    /* the watcher's list is gone: nothing to note into */
  }
}
