// vitest globalSetup of the int and e2e tiers (vitest.config.ts): one such run at a time on a
// machine (run-lock.ts). Runs in vitest's own process, which holds the lock until the run ends
// (vitest calls every project's teardown once all tests are done).
import { releaseTestRunLock, takeTestRunLock } from './run-lock.ts';

export default function setup(): () => void {
  takeTestRunLock();
  return () => releaseTestRunLock();
}
