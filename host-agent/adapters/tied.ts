// Child processes that must not outlive the agent. QEMU is spawned detached on purpose (a
// restarting agent adopts it), but a helper process (a qemu-img convert of a whole disk, a
// RAM-pool fill, a TLS relay) works for the agent that started it: if that agent is killed,
// the helper would go on writing into files the next agent removes at start. `setpriv
// --pdeathsig KILL` (util-linux, on every Debian install; --pdeathsig since 2.33) has the
// kernel kill the helper when the agent's thread that spawned it dies (PR_SET_PDEATHSIG).
// Node spawns from the main thread, whose death is the process's.
import { execFile } from 'node:child_process';
import { existsSync } from 'node:fs';
import { join } from 'node:path';
import { promisify } from 'node:util';

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
