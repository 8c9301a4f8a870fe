// Markdown report with SVG charts, from a run's result. Pure: returns strings.
import { renderBars, renderCdf } from './svg.ts';
import type { BarGroup } from './svg.ts';
import type { LatencySummary, SampleSummary } from './hist.ts';
import type { PhaseSummary } from './phases.ts';

/** The version of the result JSON's layout (ADR 0010 lists its fields); a file without one is version 1. */
export const SCHEMA_VERSION = 2;

export interface RunEnv {
  /** The fleet's hosts' accel (kvm or tcg; "mixed" when they differ, "unknown" without hosts). */
  accel: string;
  /** The QEMU-level baselines' accel; absent when they did not start. Ratios to them need it equal to `accel`. */
  baseline_accel?: string;
  /** The QEMU-level baseline guest's boot and setup (ms, on baseline_accel): below the API, so no cold_boot sample. */
  baseline_cold_boot_ms?: number;
  /** Stored bytes of the run's template snapshot: what a fetch onto a host holding none of its chunks moves (the planner reads it). Absent in older runs. */
  snapshot_stored_bytes?: number;
  hosts: number;
  /** The hosts' link rate; null when unknown (a given fleet's hosts report none, or differing ones). */
  link_gbps: number | null;
  guest_mib: number;
  dirty_mib: number;
  date: string;
  git_commit: string;
  api: string;
  mode: string;
  notes: string[];
}

/**
 * What a scenario left behind: `destroy_failures`, its sandboxes that could not be destroyed
 * (tried twice); `leftover_sandboxes`, sandboxes of earlier scenarios still on the fleet when
 * it started (its samples ran beside them). Each only when above 0.
 */
export interface Leftovers {
  destroy_failures?: number;
  leftover_sandboxes?: number;
}

/**
 * `truncated`: the time budget stopped it before all its samples ("3 of 5 samples"). With
 * n = 0 (it failed at its first sample) the percentiles are null.
 */
export type ScenarioResult = (SampleSummary & Leftovers) | { skipped: string } | (SampleSummary & Leftovers & { failed: string }) | (SampleSummary & Leftovers & { truncated: string });

export interface RunResult {
  /** SCHEMA_VERSION when written; absent in a version-1 file. */
  schema_version?: number;
  env: RunEnv;
  scenarios: Record<string, ScenarioResult>;
  samples: Record<string, number[]>;
  /** Per scenario timed through the API: medians of where each sample's time went (phases.ts). */
  phases?: Record<string, PhaseSummary>;
}

const MIB = 1024 * 1024;

/** The phases table: a row per scenario with a breakdown. */
function phaseRows(phases: Record<string, PhaseSummary>): string[] {
  return Object.entries(phases).map(
    ([name, p]) => `| ${name} | ${p.n} | ${p.op_ms} | ${p.to_first_step_ms} | ${p.host_step_ms} | ${p.step_overhead_ms} | ${p.exec_after_op_ms} | ${(p.bytes_moved / MIB).toFixed(1)} | ${p.migrated_samples} |`,
  );
}

export function isSummary(r: ScenarioResult | undefined): r is LatencySummary {
  return r !== undefined && 'n' in r && r.n > 0;
}

/** The scenarios that failed part-way (their samples are partial). */
export function failedNames(s: Record<string, ScenarioResult | undefined>): string[] {
  return Object.entries(s).flatMap(([n, r]) => (r !== undefined && 'failed' in r ? [n] : []));
}

/** The scenarios the time budget stopped early (their samples are fewer than planned). */
export function truncatedNames(s: Record<string, ScenarioResult | undefined>): string[] {
  return Object.entries(s).flatMap(([n, r]) => (r !== undefined && 'truncated' in r ? [n] : []));
}

/**
 * A scenario that ran every sample it was given: the only kind a target is judged on (a failed
 * one's samples are partial; one the time budget stopped may hold a single, cold sample).
 */
export function isComplete(r: ScenarioResult | undefined): r is LatencySummary {
  return isSummary(r) && !('failed' in r) && !('truncated' in r);
}

export const CHART_GROUPS: ReadonlyArray<{ file: string; title: string; names: readonly string[] }> = [
  { file: 'cdf-fork.svg', title: 'Fork latency CDF: same host, cross host, fan-out', names: ['fork_same_host_1', 'fork_same_host_4', 'fork_same_host_8', 'fork_cross_host_1', 'fork_cross_host_4', 'fork_fanout'] },
  { file: 'cdf-resume.svg', title: 'Resume latency CDF', names: ['resume_paused', 'resume_hibernated_warm', 'resume_hibernated_cold'] },
  { file: 'cdf-restore.svg', title: 'Restore latency CDF against baselines', names: ['fork_same_host_1', 'fork_cross_host_1', 'restore_concurrent', 'classic_restore', 'naive_full_copy', 'cold_boot'] },
];

/** A percentile for the table: "-" when there is no sample (never 0 ms). */
const ms = (v: number | null): string => (v === null ? '-' : String(v));

function cell(r: ScenarioResult | undefined): string {
  if (r === undefined) return '| not run | | | | |';
  if ('skipped' in r) return `| skipped: ${r.skipped.replace(/\|/g, '/')} | | | | |`;
  const fail = 'failed' in r ? ` (failed after ${r.n}: ${r.failed.replace(/\|/g, '/').slice(0, 160)})` : 'truncated' in r ? ` (stopped by the time budget: ${r.truncated})` : '';
  const left = [r.destroy_failures ? `${r.destroy_failures} not destroyed` : '', r.leftover_sandboxes ? `ran beside ${r.leftover_sandboxes} left over` : ''].filter(Boolean).join('; ');
  return `| ${r.n}${fail}${left ? ` (${left})` : ''} | ${ms(r.p50_ms)} | ${ms(r.p95_ms)} | ${ms(r.p99_ms)} | ${ms(r.max_ms)} |`;
}

export interface Check {
  what: string;
  target: string;
  value: string;
  /** `value` as a number (a ratio of p50s, or ms), null when a side is missing. */
  measured: number | null;
  ok: boolean | undefined;
}

/** The scenarios measured at the QEMU level in the load-test process, on the baseline guest's accel. */
const BASELINES: ReadonlySet<string> = new Set(['classic_restore', 'naive_full_copy']);

/**
 * The acceptance ratios of issue 7, from one run. `ok` is undefined when a side is missing
 * (skipped, not run, or stopped early by the time budget: too few samples to judge) and false
 * when a side failed: its samples are partial, so no figure is taken from it. A ratio to a
 * baseline is not evaluated (`ok` undefined, the reason in `value`) unless `env` shows the
 * baseline ran on the fleet's accel: a KVM fork against a TCG restore compares nothing.
 */
export function checks(s: Record<string, ScenarioResult>, env?: Pick<RunEnv, 'accel' | 'baseline_accel'>): Check[] {
  const p50 = (n: string): number | undefined => {
    const r = s[n];
    return isComplete(r) ? r.p50_ms : undefined;
  };
  const failedOf = (what: string, target: string, ...names: string[]): Check | undefined => {
    const sides = Object.fromEntries(names.map((n) => [n, s[n]]));
    const f = failedNames(sides);
    if (f.length) return { what, target, value: `failed: ${f.join(', ')}`, measured: null, ok: false };
    const t = truncatedNames(sides);
    return t.length ? { what, target, value: `stopped early (time budget): ${t.join(', ')}`, measured: null, ok: undefined } : undefined;
  };
  const ratio = (what: string, a: string, b: string, max: number, target: string): Check => {
    const failed = failedOf(what, target, a, b);
    if (failed) return failed;
    if (BASELINES.has(b) && isComplete(s[b]) && env?.baseline_accel !== env?.accel) {
      const why = env?.baseline_accel === undefined ? 'the baseline\'s accel is unknown' : `fleet accel ${env.accel}, baseline accel ${env.baseline_accel}`;
      return { what, target, value: `not evaluated: ${why}`, measured: null, ok: undefined };
    }
    const x = p50(a);
    const y = p50(b);
    const v = x !== undefined && y !== undefined && y > 0 ? x / y : undefined;
    return { what, target, value: v === undefined ? 'n/a' : v.toFixed(2), measured: v === undefined ? null : Number(v.toFixed(3)), ok: v === undefined ? undefined : v <= max };
  };
  const rp = p50('resume_paused');
  return [
    ratio('fork_cross_host_1 / fork_same_host_1 (p50)', 'fork_cross_host_1', 'fork_same_host_1', 2.0, '<= 2.0'),
    ratio('fork_same_host_1 / classic_restore (p50)', 'fork_same_host_1', 'classic_restore', 1 / 3, '<= 0.33'),
    failedOf('resume_paused p50', '<= 50 ms', 'resume_paused') ?? { what: 'resume_paused p50', target: '<= 50 ms', value: rp === undefined ? 'n/a' : `${rp} ms`, measured: rp ?? null, ok: rp === undefined ? undefined : rp <= 50 },
    ratio('resume_hibernated_warm / classic_restore (p50)', 'resume_hibernated_warm', 'classic_restore', 0.5, '<= 0.5'),
    ratio('fork_cross_host_1 / naive_full_copy (p50)', 'fork_cross_host_1', 'naive_full_copy', 0.999999, '< 1'),
    ratio('resume_hibernated_cold / naive_full_copy (p50)', 'resume_hibernated_cold', 'naive_full_copy', 0.999999, '< 1'),
  ];
}

export function sameVsCrossBars(s: Record<string, ScenarioResult>): BarGroup[] {
  const groups: BarGroup[] = [];
  for (const n of [1, 4, 8]) {
    const bars: Array<{ name: string; value: number }> = [];
    for (const [name, label] of [[`fork_same_host_${n}`, 'same host p50'], [`fork_cross_host_${n}`, 'cross host p50'], [`fork_same_host_${n}`, 'same host p95'], [`fork_cross_host_${n}`, 'cross host p95']] as const) {
      const r = s[name];
      if (isSummary(r)) bars.push({ name: label, value: label.endsWith('p50') ? r.p50_ms : r.p95_ms });
    }
    if (bars.length) groups.push({ label: `N=${n}`, bars });
  }
  const extra: Array<[string, string]> = [['resume_hibernated_warm', 'same host p50'], ['resume_hibernated_cold', 'cross host p50']];
  const bars = extra.flatMap(([name, label]) => {
    const r = s[name];
    return isSummary(r) ? [{ name: label, value: r.p50_ms }] : [];
  });
  if (bars.length) groups.push({ label: 'wake (hibernated)', bars });
  return groups;
}

export function renderReport(r: RunResult): { markdown: string; files: Record<string, string> } {
  const files: Record<string, string> = {};
  for (const g of CHART_GROUPS) files[g.file] = renderCdf(g.title, g.names.map((name) => ({ name, samples: r.samples[name] ?? [] })));
  files['cdf-all.svg'] = renderCdf('Latency CDF, every scenario', Object.keys(r.scenarios).map((name) => ({ name, samples: r.samples[name] ?? [] })));
  files['same-vs-cross.svg'] = renderBars(`Same host vs cross host at ${r.env.link_gbps ?? 'an unknown'} Gbit/s (ms)`, 'latency, ms', sameVsCrossBars(r.scenarios));
  const e = r.env;
  const md: string[] = [
    '# Forkfleet load test report',
    '',
    `| environment | |`,
    '| --- | --- |',
    `| accel | ${e.accel} |`,
    `| hosts | ${e.hosts} |`,
    `| link | ${e.link_gbps === null ? 'unknown (the hosts report no link rate, or differing ones)' : `${e.link_gbps} Gbit/s per host (tbf on veth)`} |`,
    `| guest | ${e.guest_mib} MiB, ${e.dirty_mib} MiB dirtied + a long-running process |`,
    `| date | ${e.date} |`,
    `| git commit | ${e.git_commit} |`,
    `| API | ${e.api} |`,
    `| mode | ${e.mode} |`,
    '',
    'Latency is measured from the API call until the child (or resumed sandbox) answers an exec',
    'through the API. Baselines `classic_restore` and `naive_full_copy` run at the QEMU level in the',
    'load-test process on the same machine (see docs/adr/0010-loadtest-method.md).',
    '',
    '## Latency per scenario (ms, HDR histogram)',
    '',
    'p95 and p99 are nearest-rank: below 20 samples p95 is the max, below 100 samples p99 is.',
    '',
    '| scenario | n | p50 | p95 | p99 | max |',
    '| --- | --- | --- | --- | --- | --- |',
    ...Object.keys(r.scenarios).map((name) => `| ${name} ${cell(r.scenarios[name])}`),
    '',
    '## Targets (issue 7)',
    '',
    '| check | target | measured | |',
    '| --- | --- | --- | --- |',
    ...checks(r.scenarios, r.env).map((c) => `| ${c.what} | ${c.target} | ${c.value} | ${c.ok === undefined ? 'no data' : c.ok ? 'ok' : 'MISS'} |`),
    '',
    ...(r.phases && Object.keys(r.phases).length
      ? [
          '## Where the time went (medians, ms)',
          '',
          'From each operation\'s host steps (`Operation.steps`): `in scheduler` is the operation from its',
          'record to its final write; `to first step` is queueing and placement before its first host',
          'step; `host step` is the longest step as its host measured it; `step overhead` is that step\'s',
          'time outside the host (NATS both ways, the leader); `exec after op` runs on the load test\'s',
          'clock, from the API answering the finished operation to the last sandbox answering an exec.',
          '',
          '| scenario | n | in scheduler | to first step | host step | step overhead | exec after op | MiB moved | migrated |',
          '| --- | --- | --- | --- | --- | --- | --- | --- | --- |',
          ...phaseRows(r.phases),
          '',
        ]
      : []),
    '## Same host against cross host',
    '',
    '![same vs cross](same-vs-cross.svg)',
    '',
    '## Latency CDFs',
    '',
    ...CHART_GROUPS.flatMap((g) => [`![${g.title}](${g.file})`, '']),
    '![every scenario](cdf-all.svg)',
    '',
  ];
  if (e.notes.length) md.push('## Notes', '', ...e.notes.map((n) => `- ${n}`), '');
  return { markdown: md.join('\n'), files };
}
