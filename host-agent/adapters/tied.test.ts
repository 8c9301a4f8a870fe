import { afterEach, describe, expect, it } from 'vitest';
import { spawn } from 'node:child_process';
import { once } from 'node:events';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { isAlive, isGone, killHard } from './qemu/process.ts';
import { noteForReaper, tiedToUs } from './tied.ts';

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

describe('noteForReaper', () => {
  const saved = process.env.FF_REAP_FILE;
  let dir = '';
  afterEach(() => {
    if (saved === undefined) delete process.env.FF_REAP_FILE;
    else process.env.FF_REAP_FILE = saved;
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  it('notesOnlyAbsoluteNormalDirectoriesAtLeastTwoDeep_andLivePidsWithTheirStartTime_andNothingWhenUnset', async () => {
    dir = mkdtempSync(join(tmpdir(), 'ff-note-'));
    const list = join(dir, 'list');
    writeFileSync(list, '');
    delete process.env.FF_REAP_FILE;
    noteForReaper({ dir: '/tmp/unset/x' });
    process.env.FF_REAP_FILE = list;
    // Each of these would be "/" or the temporary directory itself to the watcher's rm.
    for (const d of ['', '/', '/tmp', tmpdir(), 'rel/x', '/tmp/a/../b', '/tmp/a/', '/tmp/a\nb']) noteForReaper({ dir: d });
    noteForReaper({ dir: '/tmp/ff-x/y' });
    noteForReaper({ netns: 'ff-t-abc' }); // no such namespace: nothing noted
    const gone = spawn('true', { stdio: 'ignore' });
    await once(gone, 'exit');
    await new Promise((r) => setTimeout(r, 50)); // reaped by Node
    noteForReaper({ pid: gone.pid! });
    noteForReaper({ pid: process.pid });
    const start = /\) \S+ (?:\S+ ){18}(\d+)/.exec(readFileSync(`/proc/${process.pid}/stat`, 'utf8'))![1];
    expect(readFileSync(list, 'utf8')).toBe(`dir /tmp/ff-x/y\npid ${process.pid} ${start}\n`);
  });
});
