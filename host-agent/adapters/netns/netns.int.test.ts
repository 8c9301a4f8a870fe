// ownNetns: the guard that keeps egress setup out of the agent's own network namespace while
// a QEMU started through `unshare --net` has not yet unshared (real unshare, root).
import { spawn } from 'node:child_process';
import { afterEach, describe, expect, it } from 'vitest';
import { isAlive, killHard } from '../qemu/process.ts';
import { netnsOf, ownNetns, UNSHARE } from './netns.ts';

const started: number[] = [];
afterEach(() => {
  for (const pid of started.splice(0)) if (isAlive(pid)) killHard(pid);
});

/** `sh` that waits `delayS` seconds in this namespace, then execs `rest`. */
function late(delayS: number, rest: string): number {
  const p = spawn('sh', ['-c', `sleep ${delayS}; exec ${rest}`], { stdio: 'ignore' });
  p.on('error', () => undefined);
  started.push(p.pid!);
  return p.pid!;
}

describe('ownNetns', () => {
  it('ownNetns_ofAProcessThatUnsharesLate_waitsUntilItHasANamespaceOtherThanOurs', async () => {
    const pid = late(0.4, `${UNSHARE} --net -- sleep 30`);
    const mine = await netnsOf('self');
    expect(await netnsOf(pid)).toBe(mine);
    const ns = await ownNetns(pid);
    expect(ns).not.toBe(mine);
    expect(await netnsOf(pid)).toBe(ns);
  });

  it('ownNetns_ofAProcessThatExitsWithoutUnsharing_rejects', async () => {
    const pid = late(0.2, 'true');
    await expect(ownNetns(pid)).rejects.toThrow(/exited before/);
  });

  it('ownNetns_ofAProcessThatNeverUnshares_rejectsAfterTheTimeout', async () => {
    const pid = late(0, 'sleep 30');
    await expect(ownNetns(pid, 300)).rejects.toThrow(/still shares/);
  });
});
