// spawnQemu when the process cannot be started at all (the binary missing here; EMFILE and
// EAGAIN take the same path): the caller gets a retryable error, and the agent lives on.
// isKilled: a process that is killed already (a zombie; SIGKILL pending, which a test cannot
// hold on cue) is not taken for a live QEMU by recover().
import { spawn } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { isAlive, isKilled, sigkillPending, spawnQemu } from './process.ts';

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
    // The child ends a second later; its parent (by then `sleep 30`, by exec) never waits for
    // it: a zombie. (A child that ended at once was at times reaped by the shell before its
    // exec, and its /proc entry was gone.)
    const parent = spawn('/bin/sh', ['-c', 'sleep 1 & echo $!; exec sleep 30'], { stdio: ['ignore', 'pipe', 'ignore'] });
    try {
      const zombie = Number((await new Promise<string>((r) => parent.stdout.once('data', (d: Buffer) => r(d.toString())))).trim());
      // Until the child has ended (a busy machine may take a while to run it).
      for (let i = 0; i < 200 && !/\) Z /.test(readFileSync(`/proc/${zombie}/stat`, 'utf8')); i++) await new Promise((r) => setTimeout(r, 50));
      expect(isAlive(zombie)).toBe(true);
      expect(isKilled(zombie)).toBe(true);
      expect(isKilled(parent.pid!)).toBe(false);
    } finally {
      parent.kill('SIGKILL');
    }
    await new Promise((r) => parent.once('exit', r));
    // Reaped by its parent (this process): /proc has no such process, which counts as killed.
    expect(isAlive(parent.pid!)).toBe(false);
    expect(isKilled(parent.pid!)).toBe(true);
  });
});

describe('sigkillPending', () => {
  const status = (sig: string, shd: string): string => `Name:\tqemu-system-x86\nState:\tS (sleeping)\nSigQ:\t0/94299\nSigPnd:\t${sig}\nShdPnd:\t${shd}\nSigBlk:\t0000000000000100\n`;
  it('readsSigkillInTheProcessOrTheThreadMask_andNoOtherSignal', () => {
    expect(sigkillPending(status('0000000000000000', '0000000000000100'))).toBe(true);
    expect(sigkillPending(status('0000000000000100', '0000000000000000'))).toBe(true);
    // SIGTERM (bit 14) pending, SIGKILL only in the blocked mask (which it cannot be): not killed.
    expect(sigkillPending(status('0000000000004000', '0000000000004000'))).toBe(false);
    expect(sigkillPending(status('0000000000000000', '0000000000000000'))).toBe(false);
  });
});
