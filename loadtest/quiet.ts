// Waiting for a quiet CPU before a scenario starts. After a scenario the fleet still works in
// the background for a few seconds (agents launch standby QEMUs after 3 s without starts,
// refill their RAM pools, reap destroyed VMs): a scenario started at once pays for it in its
// first samples. Seen in the QEMU-level baselines, which ran straight after the last fleet
// scenario: classic_restore 855 and 823 ms, then 350-368 ms. Every scenario, fleet or
// baseline, waits the same way, so that neither side of a ratio starts on a busier machine.
// The wait is bounded: on a machine that other work keeps busy it gives up and says so.
import { readFileSync } from 'node:fs';

/** The machine's CPU time so far, from /proc/stat's first line, in clock ticks. */
export interface CpuTimes {
  busy: number;
  total: number;
}

/** Parses /proc/stat: `cpu user nice system idle iowait irq softirq steal ...`. */
export function parseCpuTimes(stat: string): CpuTimes {
  const line = stat.split('\n').find((l) => l.startsWith('cpu '));
  if (!line) throw new Error('/proc/stat: no aggregate cpu line');
  const f = line.trim().split(/\s+/).slice(1, 9).map(Number);
  if (f.length < 5 || f.some((x) => !Number.isFinite(x))) throw new Error(`/proc/stat: cannot read "${line}"`);
  const total = f.reduce((a, b) => a + b, 0);
  // idle + iowait are not busy.
  const idle = f[3]! + f[4]!;
  return { busy: total - idle, total };
}

/** The busy fraction of the machine's CPU between two readings (0 when no tick passed). */
export function busyFraction(a: CpuTimes, b: CpuTimes): number {
  const dt = b.total - a.total;
  return dt > 0 ? Math.min(1, Math.max(0, (b.busy - a.busy) / dt)) : 0;
}

export interface QuietOptions {
  /** Quiet: the busy fraction over one window is under this. */
  busyBelow: number;
  windowMs: number;
  /** Gives up after this long. */
  maxMs: number;
  /** Ends the wait at once (the run is stopping). */
  signal?: AbortSignal;
  read?: () => CpuTimes;
  sleep?: (ms: number) => Promise<void>;
  now?: () => number;
}

/**
 * How a wait ended: quiet or not, after how long, and the last window's busy fraction;
 * `unreadable`: the CPU times could not be read (no /proc/stat: not Linux), so it did not wait.
 */
export interface QuietOutcome {
  quiet: boolean;
  waitedMs: number;
  busy: number;
  unreadable?: string;
}

/** Waits until one window's busy fraction is under `busyBelow`, `maxMs` have passed, or `signal` is aborted. */
export async function waitForQuietCpu(o: QuietOptions): Promise<QuietOutcome> {
  const read = o.read ?? (() => parseCpuTimes(readFileSync('/proc/stat', 'utf8')));
  const sleep =
    o.sleep ??
    ((ms: number) =>
      new Promise<void>((r) => {
        const t = setTimeout(done, ms);
        function done(): void {
          clearTimeout(t);
          o.signal?.removeEventListener('abort', done);
          r();
        }
        o.signal?.addEventListener('abort', done);
      }));
  const now = o.now ?? (() => performance.now());
  const t0 = now();
  let prev: CpuTimes;
  try {
    prev = read();
  } catch (e) {
    return { quiet: false, waitedMs: 0, busy: 0, unreadable: e instanceof Error ? e.message : String(e) };
  }
  for (;;) {
    if (o.signal?.aborted) return { quiet: false, waitedMs: Math.round(now() - t0), busy: 0 };
    await sleep(o.windowMs);
    if (o.signal?.aborted) return { quiet: false, waitedMs: Math.round(now() - t0), busy: 0 };
    const cur = read();
    const busy = busyFraction(prev, cur);
    const waitedMs = Math.round(now() - t0);
    if (busy < o.busyBelow) return { quiet: true, waitedMs, busy };
    if (waitedMs >= o.maxMs) return { quiet: false, waitedMs, busy };
    prev = cur;
  }
}
