// The reaper (reaper.ts) undoes what a test process left behind once that process is gone:
// killed (a Ctrl-C skips every afterAll) or ended without undoing it. Real processes, a real
// network namespace and real directories.
import { spawn, execFileSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { waitFor } from './proc.ts';
import { isGone } from '../../host-agent/adapters/qemu/process.ts';

const FIXTURE = join(import.meta.dirname, 'reaper-fixture.ts');

interface Made {
  list: string;
  watcherPid: number;
  left: number;
  reused: number;
  dir: string;
  /** Where a process the test process started writes the PID it notes after the test process is gone. */
  late: string;
  /** That process. */
  noter: number;
}

/** Runs and is not a zombie. */
const runs = (pid: number): boolean => !isGone(pid);
const namespaces = (): string[] => execFileSync('ip', ['netns', 'list']).toString().split('\n').map((l) => l.split(' ')[0]!);

const cleanup: Array<() => void> = [];
afterEach(() => {
  for (const c of cleanup.splice(0)) c();
});

/** Starts the fixture process; resolves with what it made and the process. */
async function startFixture(ns: string, how: 'wait' | 'exit'): Promise<{ made: Made; pid: number }> {
  const child = spawn(process.execPath, ['--import', 'tsx', FIXTURE, ns, how], { stdio: ['ignore', 'pipe', 'pipe'] });
  let out = '';
  let err = '';
  child.stdout.on('data', (d: Buffer) => (out += d.toString()));
  child.stderr.on('data', (d: Buffer) => (err += d.toString()));
  await waitFor('the fixture to report', async () => out.includes('\n'), 30_000, 20, () => (child.exitCode !== null && !out.includes('\n') ? new Error(`fixture exited ${child.exitCode}: ${err}`) : undefined));
  const made = JSON.parse(out.split('\n')[0]!) as Made;
  cleanup.push(() => {
    for (const pid of [made.noter, made.left, made.reused, made.watcherPid, child.pid!]) {
      try {
        process.kill(pid, 'SIGKILL');
      } catch {
        /* gone */
      }
    }
    try {
      execFileSync('ip', ['netns', 'del', ns], { stdio: 'ignore' });
    } catch {
      /* gone */
    }
    try {
      process.kill(Number(readFileSync(made.late, 'utf8')), 'SIGKILL');
    } catch {
      /* none, or gone */
    }
    execFileSync('rm', ['-rf', made.dir, dirname(made.list), made.late]);
  });
  return { made, pid: child.pid! };
}

describe('test-process reaper', () => {
  for (const how of ['killed', 'exited'] as const) {
    it(`testProcess${how === 'killed' ? 'KilledWithSigkill' : 'ExitedWithoutUndoing'}_reaperKillsNotedProcesses_deletesNotedNamespaceAndDirectories_sparesAReusedPid`, async () => {
      const ns = `ff-reap-${randomBytes(3).toString('hex')}`;
      const { made, pid } = await startFixture(ns, how === 'killed' ? 'wait' : 'exit');
      expect(made.watcherPid).toBeGreaterThan(0);
      if (how === 'killed') {
        expect(runs(made.left) && namespaces().includes(ns) && existsSync(made.dir)).toBe(true);
        process.kill(pid, 'SIGKILL');
      }
      // The watcher polls once a second, then waits half a second between killing and deleting.
      await waitFor('the reaper to finish', async () => !runs(made.watcherPid), 15_000, 100);
      expect(runs(made.left)).toBe(false);
      expect(namespaces()).not.toContain(ns);
      expect(existsSync(made.dir)).toBe(false);
      expect(existsSync(dirname(made.list))).toBe(false);
      // Its noted start time is not this process's: left alone.
      expect(runs(made.reused)).toBe(true);
      // Noted after the watcher's first pass: found on its next look at the list.
      const late = Number(readFileSync(made.late, 'utf8'));
      expect(late).toBeGreaterThan(0);
      expect(runs(late)).toBe(false);
    });
  }

  it('aNamespaceMadeAgainUnderTheNotedNameAfterTheTestProcessEnded_isLeftAlone', async () => {
    // The next test file's fleet (vitest does not wait for the last worker to end) makes its
    // namespaces while this one's watcher is still at work: same prefix, same names.
    const ns = `ff-reap-${randomBytes(3).toString('hex')}`;
    const { made, pid } = await startFixture(ns, 'wait');
    process.kill(pid, 'SIGKILL');
    execFileSync('ip', ['netns', 'del', ns]);
    // Long enough for the old namespace to be freed (its inode number is then handed out again
    // at once, to the new one) and to be made in a later second.
    await new Promise((r) => setTimeout(r, 1200));
    execFileSync('ip', ['netns', 'add', ns]);
    await waitFor('the reaper to finish', async () => !runs(made.watcherPid), 15_000, 100);
    expect(runs(made.left)).toBe(false);
    expect(namespaces()).toContain(ns);
  });

  it('testProcessAlive_reaperWaits_andDoesNothing', async () => {
    const ns = `ff-reap-${randomBytes(3).toString('hex')}`;
    const { made } = await startFixture(ns, 'wait');
    await new Promise((r) => setTimeout(r, 2500));
    expect(runs(made.watcherPid)).toBe(true);
    expect(runs(made.left)).toBe(true);
    expect(namespaces()).toContain(ns);
    expect(existsSync(made.dir)).toBe(true);
  });
});
