import { describe, expect, it } from 'vitest';
import { busyFraction, parseCpuTimes, waitForQuietCpu } from './quiet.ts';
import type { CpuTimes } from './quiet.ts';

describe('parseCpuTimes', () => {
  it('counts idle and iowait as not busy, everything else on the aggregate line as busy', () => {
    const t = parseCpuTimes('cpu  100 5 50 800 20 3 2 10 0 0\ncpu0 50 2 25 400 10 1 1 5 0 0\n');
    expect(t).toEqual({ total: 990, busy: 170 });
  });

  it('fails, naming the file, on text without an aggregate cpu line', () => {
    expect(() => parseCpuTimes('intr 1 2 3\n')).toThrow(/\/proc\/stat/);
  });
});

describe('waitForQuietCpu', () => {
  /** A machine whose busy fraction per window follows `fractions` (100 ticks a window). */
  function machine(fractions: number[]): { read: () => CpuTimes; sleep: (ms: number) => Promise<void>; now: () => number } {
    let t = 0;
    let i = -1;
    const times: CpuTimes = { busy: 0, total: 0 };
    return {
      read: () => {
        if (i >= 0) {
          const f = fractions[Math.min(i, fractions.length - 1)]!;
          times.busy += f * 100;
          times.total += 100;
        }
        i++;
        return { ...times };
      },
      sleep: async (ms) => {
        t += ms;
      },
      now: () => t,
    };
  }

  it('returns at the first window under the threshold, saying how long it waited', async () => {
    const m = machine([0.9, 0.8, 0.2, 0.9]);
    expect(await waitForQuietCpu({ busyBelow: 0.5, windowMs: 500, maxMs: 10_000, ...m })).toEqual({ quiet: true, waitedMs: 1500, busy: 0.2 });
  });

  it('does not wait where the CPU times cannot be read (no /proc/stat), and says why', async () => {
    const out = await waitForQuietCpu({ busyBelow: 0.5, windowMs: 500, maxMs: 8000, read: () => parseCpuTimes('') });
    expect(out).toMatchObject({ quiet: false, waitedMs: 0 });
    expect(out.unreadable).toMatch(/\/proc\/stat/);
  });

  it('ends at once when the run is stopping', async () => {
    const ac = new AbortController();
    const m = machine([0.9]);
    const waiting = waitForQuietCpu({ busyBelow: 0.5, windowMs: 500, maxMs: 60_000, signal: ac.signal, read: m.read });
    ac.abort();
    const t0 = performance.now();
    expect((await waiting).quiet).toBe(false);
    expect(performance.now() - t0).toBeLessThan(400);
  });

  it('gives up after maxMs on a machine that stays busy, and says it was not quiet', async () => {
    const m = machine([0.9]);
    const out = await waitForQuietCpu({ busyBelow: 0.5, windowMs: 500, maxMs: 2000, ...m });
    expect(out.quiet).toBe(false);
    expect(out.waitedMs).toBe(2000);
    expect(busyFraction({ busy: 0, total: 0 }, { busy: 90, total: 100 })).toBe(0.9);
  });
});
