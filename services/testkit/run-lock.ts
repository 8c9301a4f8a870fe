// One int/e2e test run at a time on a machine. Their fleets live in fixed directories on fixed
// ports (/var/lib/ffleet-e2e on 16700, /var/lib/ffleet-ui on 20700, ...), and a test's
// beforeAll takes down whatever fleet it finds there: a second `npm test` started while one runs
// would tear down the first run's fleet under it, and both would fail in ways that do not say
// why. The second run now stops at once, naming the first.
//
// The lock is a file naming the vitest process that holds it, with that process's start time;
// it is held while that process lives. The run removes it at its end (releaseTestRunLock); a
// run that is killed leaves a file the next run finds stale and takes over.
import { linkSync, mkdirSync, readFileSync, renameSync, rmSync, writeFileSync } from 'node:fs';
import { dirname } from 'node:path';
import { identityOf, isSameProcess, type ProcIdentity } from '../../deploy/fleet/proc-identity.ts';

export const RUN_LOCK = process.env.FORKFLEET_TEST_LOCK ?? '/run/lock/forkfleet-tests.lock';

export class TestRunLockedError extends Error {}

interface Holder extends ProcIdentity {
  pid: number;
  cwd: string;
}

function readHolder(path: string): Holder | undefined {
  try {
    const h = JSON.parse(readFileSync(path, 'utf8')) as Partial<Holder>;
    return typeof h.pid === 'number' && typeof h.startTime === 'number' ? { pid: h.pid, startTime: h.startTime, bootId: h.bootId ?? '', cwd: h.cwd ?? '?' } : undefined;
  } catch {
    return undefined; // gone, or being written
  }
}

/**
 * Takes the lock for this process, or throws TestRunLockedError naming the live process that
 * holds it. Taking it again from the same process (a second project's setup) is a no-op.
 */
export function takeTestRunLock(path = RUN_LOCK): void {
  const me: Holder = { pid: process.pid, ...identityOf(process.pid), cwd: process.cwd() };
  mkdirSync(dirname(path), { recursive: true });
  for (let attempt = 0; attempt < 5; attempt++) {
    try {
      writeFileSync(path, JSON.stringify(me), { flag: 'wx' });
      return;
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code !== 'EEXIST') throw e;
    }
    const held = readHolder(path);
    if (held && held.pid === me.pid && held.startTime === me.startTime) return;
    if (held && isSameProcess(held.pid, held)) {
      throw new TestRunLockedError(
        `another test run holds ${path}: process ${held.pid} in ${held.cwd}. Its fleets use the same fixed directories and ports; wait for it to end or stop it, then run again`,
      );
    }
    if (!held && attempt < 2) {
      // Just created by a run starting now, its holder not written yet: look again.
      Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, 100);
      continue;
    }
    // Stale (its process is gone): moved aside first, so that of two runs finding it stale
    // together only one removes it (the other's rename fails) before both try to create anew.
    const aside = `${path}.stale.${me.pid}`;
    try {
      renameSync(path, aside);
    } catch {
      continue; // the other run moved it first
    }
    // What was moved is a live run's (the other run took it between our read and our rename):
    // put back (a link: never over a newer one).
    const moved = readHolder(aside);
    if (moved && (moved.pid !== held?.pid || moved.startTime !== held.startTime) && isSameProcess(moved.pid, moved)) {
      try {
        linkSync(aside, path);
      } catch {
        /* a newer one is there */
      }
    }
    rmSync(aside, { force: true });
  }
  throw new TestRunLockedError(`could not take ${path}: it keeps changing hands; is another test run starting?`);
}

/** Removes the lock if it is this process's (a second project's teardown finds it gone). */
export function releaseTestRunLock(path = RUN_LOCK): void {
  const held = readHolder(path);
  if (held && held.pid === process.pid && held.startTime === identityOf(process.pid).startTime) rmSync(path, { force: true });
}
