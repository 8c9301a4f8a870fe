import { describe, expect, it } from 'vitest';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { ExitedBeforeReadyError, freePort, spawnManaged, tempDir, waitReady } from './proc.ts';

describe('process harness', () => {
  it('freePort_isBelowTheKernelsEphemeralRange_soNoOutgoingConnectionCanTakeIt', async () => {
    const [lo] = readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/).map(Number);
    for (let i = 0; i < 20; i++) {
      const p = await freePort();
      expect(p).toBeGreaterThanOrEqual(10_000);
      expect(p).toBeLessThan(lo ?? 32768);
    }
  });

  it('waitReady_whenTheServerExitsFirst_failsAtOnceWithItsLogTail', async () => {
    const dir = tempDir('ff-proc-');
    const proc = spawnManaged({ name: 'doomed', command: 'sh', args: ['-c', 'echo "bind: address already in use"; exit 3'], dir, logPath: join(dir, 'log') });
    const t0 = Date.now();
    const err = await waitReady(proc, 'doomed ready', async () => false, 20_000).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(ExitedBeforeReadyError);
    expect(String(err)).toMatch(/exited with code 3 before doomed ready/);
    expect(String(err)).toMatch(/address already in use/);
    expect(Date.now() - t0).toBeLessThan(5000);
    await proc.stop();
  });

  it('waitReady_whenTheServerNeverAnswers_timesOutWithItsLogTail', async () => {
    const dir = tempDir('ff-proc-');
    const proc = spawnManaged({ name: 'mute', command: 'sh', args: ['-c', 'echo still starting; exec sleep 30'], dir, logPath: join(dir, 'log') });
    const err = await waitReady(proc, 'mute ready', async () => false, 500).catch((e: unknown) => e);
    expect(err).not.toBeInstanceOf(ExitedBeforeReadyError);
    expect(String(err)).toMatch(/timed out after 500 ms waiting for mute ready; mute's log ends:\nstill starting/);
    await proc.stop();
  });
});
