import { afterEach, describe, expect, it } from 'vitest';
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { readFileSync } from 'node:fs';
import { isAlive, isGone, killHard } from './qemu/process.ts';
import { tiedToUs } from './tied.ts';

// A stand-in for the agent: a Node process that spawns the given command line, prints the
// child's PID, and waits to be killed.
const PARENT = `
const { spawn } = require('node:child_process');
const [cmd, args] = JSON.parse(process.argv[1]);
const c = spawn(cmd, args, { stdio: 'ignore' });
process.stdout.write(String(c.pid) + '\\n');
setInterval(() => {}, 1000);
`;

async function parentWith(cmdline: [string, string[]]): Promise<{ parent: number; child: number }> {
  const p = spawn(process.execPath, ['-e', PARENT, JSON.stringify(cmdline)], { stdio: ['ignore', 'pipe', 'inherit'] });
  const [line] = (await once(p.stdout, 'data')) as [Buffer];
  return { parent: p.pid as number, child: Number(line.toString().trim()) };
}

/** Exited within `ms`: gone, or a zombie (an orphan's reaper, PID 1, may take its time). */
async function goneWithin(pid: number, ms: number): Promise<boolean> {
  const end = Date.now() + ms;
  while (Date.now() < end) {
    if (isGone(pid)) return true;
    await new Promise((r) => setTimeout(r, 20));
  }
  return isGone(pid);
}

describe('tiedToUs', () => {
  const started: number[] = [];
  afterEach(() => {
    for (const pid of started.splice(0)) killHard(pid);
  });

  it('childOfAKilledParent_diesWithIt', async () => {
    const { parent, child } = await parentWith(tiedToUs('sleep', ['60']));
    started.push(parent, child);
    expect(isAlive(child)).toBe(true);
    killHard(parent);
    expect(await goneWithin(child, 5000)).toBe(true);
  });

  it('untiedChildOfAKilledParent_outlivesIt', async () => {
    // The control: what the tie prevents (the orphan is killed by PID afterwards).
    const { parent, child } = await parentWith(['sleep', ['60']]);
    started.push(parent, child);
    killHard(parent);
    expect(await goneWithin(parent, 5000)).toBe(true);
    expect(isAlive(child)).toBe(true);
  });

  it('keepsThePidThroughTheExecs_soStoppingTheChildStopsTheCommand', async () => {
    const [cmd, args] = tiedToUs('nice', ['-n', '19', 'sleep', '60']);
    const c = spawn(cmd, args, { stdio: 'ignore' });
    started.push(c.pid as number);
    await new Promise((r) => setTimeout(r, 200));
    expect(readFileSync(`/proc/${c.pid}/comm`, 'utf8').trim()).toBe('sleep');
    c.kill('SIGKILL');
    await once(c, 'exit');
  });
});
