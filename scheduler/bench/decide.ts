// Benchmark: how fast place() decides on simulated fleets of 100, 1000 and 10000 hosts.
// Prints JSON { decide: { "<hosts>": { per_s, p50_us, p99_us, ... } }, decisions_per_size,
// warmup_decisions, ... } (issue 5: the pure placement). Per fleet size, `warmup_decisions`
// untimed decisions (min(500, DECISIONS)) run first on the same view, then `decisions_per_size`
// timed ones.
//
// Fleets come from the deterministic generator in fleet.ts (~5% of hosts hold each
// snapshot). The view is built once per fleet and only place() is timed: the scheduler's
// leader also builds a view (O(hosts)) for each decision, from its cache, which this figure
// leaves out. Requests mix fork(1), fork(8) and fork(64) with varied locality/spread
// preferences.
//
//   npm run bench:decide            # defaults
//   DECISIONS=5000 npm run bench:decide
import { loadavg } from 'node:os';
import { performance } from 'node:perf_hooks';
import { place } from '../place.ts';
import { rngForRequest, type Rng } from '../rng.ts';
import { generateFleet, pick, SNAPSHOTS } from './fleet.ts';
import type { FleetView, ForkRequest } from '../types.ts';

const SIZES = [100, 1000, 10_000] as const;
const DECISIONS = Number(process.env.DECISIONS ?? 3000);
const WARMUP = Math.min(500, DECISIONS);

function request(i: number, rng: Rng): ForkRequest {
  const count = pick(rng, [1, 8, 64]);
  return {
    kind: 'fork',
    id: `op-bench-${i}`,
    nowMs: 1_700_000_000_000 + i,
    snapshotId: pick(rng, SNAPSHOTS).id,
    count,
    overlayDiskMib: 1024,
    preferences: { locality: rng.nextFloat() < 0.9 ? 'ANY' : 'CROSS_HOST', spread: rng.nextFloat() < 0.7 ? 'PACK' : 'SPREAD' },
  };
}

interface Stats {
  per_s: number;
  p50_us: number;
  p99_us: number;
  /** Mean CPU time per decision (user+sys): unlike p99 wall time, not inflated by other processes. */
  cpu_us_mean: number;
  placed_ratio: number;
  sampled_ratio: number;
}

function measure(view: FleetView): Stats {
  const rng = rngForRequest(`bench-requests-${view.hosts.length}`);
  const reqs = Array.from({ length: DECISIONS + WARMUP }, (_, i) => request(i, rng));
  for (let i = 0; i < WARMUP; i++) {
    const r = reqs[i] as ForkRequest;
    place(view, r, rngForRequest(r.id));
  }
  const times = new Float64Array(DECISIONS);
  let placed = 0;
  let sampled = 0;
  const cpu0 = process.cpuUsage();
  const t0 = performance.now();
  for (let i = 0; i < DECISIONS; i++) {
    const r = reqs[WARMUP + i] as ForkRequest;
    const s = performance.now();
    const res = place(view, r, rngForRequest(r.id));
    times[i] = performance.now() - s;
    if (res.ok) placed++;
    if (res.explanation.sampled) sampled++;
  }
  const totalMs = performance.now() - t0;
  const cpu = process.cpuUsage(cpu0);
  times.sort();
  const q = (p: number): number => Math.round((times[Math.max(0, Math.ceil(p * DECISIONS) - 1)] ?? 0) * 1000);
  return {
    per_s: Math.round((DECISIONS / totalMs) * 1000),
    p50_us: q(0.5),
    p99_us: q(0.99),
    cpu_us_mean: Math.round((cpu.user + cpu.system) / DECISIONS),
    placed_ratio: Number((placed / DECISIONS).toFixed(3)),
    sampled_ratio: Number((sampled / DECISIONS).toFixed(3)),
  };
}

const decide: Record<string, Stats> = {};
for (const n of SIZES) decide[String(n)] = measure(generateFleet(n));
const load1 = Number((loadavg()[0] ?? 0).toFixed(2));
process.stdout.write(`${JSON.stringify({ decide, decisions_per_size: DECISIONS, warmup_decisions: WARMUP, node: process.version, loadavg_1m: load1 }, null, 2)}\n`);
