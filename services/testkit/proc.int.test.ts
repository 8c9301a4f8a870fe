import { describe, expect, it } from 'vitest';
import { spawnSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
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

  it('watchdog_whenTheTestProcessDiesWithoutStoppingItsServer_killsTheServerAndRemovesItsDirectory', async () => {
    // A test process that starts a server and exits at once, as an interrupted run does.
    const dir = tempDir('ff-proc-');
    const code = `const { spawnManaged } = await import(${JSON.stringify(join(import.meta.dirname, 'proc.ts'))}); const p = spawnManaged({ name: 'orphan', command: 'sleep', args: ['300'], dir: ${JSON.stringify(dir)} }); console.log(p.pid); process.exit(0);`;
    const r = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', code], { encoding: 'utf8', cwd: join(import.meta.dirname, '..', '..') });
    const pid = Number(r.stdout.trim());
    expect(pid, r.stderr).toBeGreaterThan(0);
    const alive = (): boolean => {
      try {
        process.kill(pid, 0);
        return true;
      } catch {
        return false;
      }
    };
    const until = Date.now() + 10_000;
    while ((alive() || existsSync(dir)) && Date.now() < until) await new Promise((res) => setTimeout(res, 100));
    expect(alive()).toBe(false);
    expect(existsSync(dir)).toBe(false);
  });
});
