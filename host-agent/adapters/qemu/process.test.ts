// spawnQemu when the process cannot be started at all (the binary missing here; EMFILE and
// EAGAIN take the same path): the caller gets a retryable error, and the agent lives on.
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { spawnQemu } from './process.ts';

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
