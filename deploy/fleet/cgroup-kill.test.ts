// killCgroup on a cgroup v2 group this test makes (under the unified hierarchy, when the
// machine has one) with one process of its own in it.
import { spawn, type ChildProcess } from 'node:child_process';
import { once } from 'node:events';
import { existsSync, mkdirSync, rmdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { killCgroup } from './fleet.ts';

const UNIFIED = ['/sys/fs/cgroup/unified', '/sys/fs/cgroup'].find((d) => existsSync(join(d, 'cgroup.controllers')));

describe.skipIf(!UNIFIED || !existsSync(join(UNIFIED, 'cgroup.procs')))('killCgroup', () => {
  const dirs: string[] = [];
  const children: ChildProcess[] = [];
  afterEach(async () => {
    for (const c of children.splice(0)) {
      if (c.exitCode === null && c.signalCode === null) {
        c.kill('SIGKILL');
        await once(c, 'exit');
      }
    }
    for (const d of dirs.splice(0)) if (existsSync(d)) rmdirSync(d);
  });

  it('killsEveryMemberOfTheGroup_withoutReadingTheirPids', async () => {
    const dir = join(UNIFIED!, `ff-kill-test-${process.pid}`);
    mkdirSync(dir);
    dirs.push(dir);
    const child = spawn('sleep', ['60'], { stdio: 'ignore' });
    children.push(child);
    const exited = once(child, 'exit');
    writeFileSync(join(dir, 'cgroup.procs'), String(child.pid));
    expect(killCgroup(dir)).toBe(true);
    const [, signal] = (await exited) as [number | null, string | null];
    expect(signal).toBe('SIGKILL');
  });

  it('isFalseWhereTheGroupHasNoKillFile', () => {
    expect(killCgroup(join(UNIFIED!, `ff-no-such-group-${process.pid}`))).toBe(false);
  });
});
