// The int/e2e test-run lock (run-lock.ts), on a scratch path with real processes as holders.
import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, beforeEach, describe, expect, it } from 'vitest';
import { identityOf } from '../../deploy/fleet/proc-identity.ts';
import { releaseTestRunLock, takeTestRunLock, TestRunLockedError } from './run-lock.ts';

describe('test-run lock', () => {
  let dir: string;
  let lock: string;
  const children: ChildProcess[] = [];
  beforeEach(() => {
    dir = mkdtempSync(join(tmpdir(), 'ff-runlock-'));
    lock = join(dir, 'sub', 'tests.lock');
  });
  afterEach(() => {
    for (const c of children.splice(0)) c.kill('SIGKILL');
    rmSync(dir, { recursive: true, force: true });
  });
  const holder = (pid: number, startTime: number): string => JSON.stringify({ pid, startTime, bootId: '', cwd: '/somewhere/else' });

  it('takeTestRunLock_free_takesIt_andTakingItAgainFromTheSameProcessIsANoOp', () => {
    takeTestRunLock(lock);
    const first = readFileSync(lock, 'utf8');
    expect(JSON.parse(first)).toMatchObject({ pid: process.pid, startTime: identityOf(process.pid).startTime });
    takeTestRunLock(lock);
    expect(readFileSync(lock, 'utf8')).toBe(first);
  });

  it('takeTestRunLock_heldByALiveProcess_refusesNamingItsPidAndDirectory_andLeavesItsLock', () => {
    const other = spawn('sleep', ['30'], { stdio: 'ignore' });
    children.push(other);
    takeTestRunLock(lock); // makes the directory
    writeFileSync(lock, holder(other.pid!, identityOf(other.pid!).startTime));
    expect(() => takeTestRunLock(lock)).toThrow(TestRunLockedError);
    expect(() => takeTestRunLock(lock)).toThrow(`process ${other.pid} in /somewhere/else`);
    expect(JSON.parse(readFileSync(lock, 'utf8'))).toMatchObject({ pid: other.pid });
  });

  it('takeTestRunLock_leftByAProcessThatIsGone_orWhosePidWasReused_takesItOver', async () => {
    const gone = spawn('true', { stdio: 'ignore' });
    await new Promise((r) => gone.once('exit', r));
    takeTestRunLock(lock);
    for (const stale of [holder(gone.pid!, 12345), holder(process.pid, 1), 'not json']) {
      writeFileSync(lock, stale);
      takeTestRunLock(lock);
      expect(JSON.parse(readFileSync(lock, 'utf8'))).toMatchObject({ pid: process.pid });
    }
    expect(existsSync(`${lock}.stale.${process.pid}`)).toBe(false);
  });

  it('releaseTestRunLock_removesOnlyThisProcesssLock', () => {
    const other = spawn('sleep', ['30'], { stdio: 'ignore' });
    children.push(other);
    takeTestRunLock(lock);
    releaseTestRunLock(lock);
    expect(existsSync(lock)).toBe(false);
    releaseTestRunLock(lock); // gone already: nothing to do
    writeFileSync(lock, holder(other.pid!, identityOf(other.pid!).startTime));
    releaseTestRunLock(lock);
    expect(JSON.parse(readFileSync(lock, 'utf8'))).toMatchObject({ pid: other.pid });
  });
});
