// spawnQemu when the process cannot be started at all (the binary missing here; EMFILE and
// EAGAIN take the same path): the caller gets a retryable error, and the agent lives on.
// isKilled: a process that is killed already (a zombie; SIGKILL pending, which a test cannot
// hold on cue) is not taken for a live QEMU by recover().
import { spawn } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { isAlive, isKilled, spawnQemu } from './process.ts';

describe('spawnQemu', () => {
  it('aSpawnThatFails_throwsRetryableUnavailable_andLeavesNoUncaughtError', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'ff-spawn-'));
    const uncaught: unknown[] = [];
    const onUncaught = (e: unknown): void => void uncaught.push(e);
    process.on('uncaughtException', onUncaught);
    try {
      expect(() => spawnQemu(join(dir, 'no-such-qemu'), [], join(dir, 'log'))).toThrow(expect.objectContaining({ kind: 'unavailable', retryable: true }));
      // The failed spawn's 'error' event comes on a later tick.
      await new Promise((r) => setTimeout(r, 50));
      expect(uncaught).toEqual([]);
    } finally {
      process.off('uncaughtException', onUncaught);
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe('isKilled', () => {
  it('ofAZombie_isTrue_ofARunningProcess_false_andOfOneGone_true', async () => {
    // `true` ends at once; its parent (now `sleep`, by exec) never waits for it: a zombie.
    const parent = spawn('/bin/sh', ['-c', 'true & echo $!; exec sleep 30'], { stdio: ['ignore', 'pipe', 'ignore'] });
    try {
      const zombie = Number((await new Promise<string>((r) => parent.stdout.once('data', (d: Buffer) => r(d.toString())))).trim());
      await new Promise((r) => setTimeout(r, 200));
      expect(isAlive(zombie)).toBe(true);
      expect(isKilled(zombie)).toBe(true);
      expect(isKilled(parent.pid!)).toBe(false);
    } finally {
      parent.kill('SIGKILL');
    }
    await new Promise((r) => parent.once('exit', r));
    expect(isKilled(parent.pid!)).toBe(true);
  });
});
