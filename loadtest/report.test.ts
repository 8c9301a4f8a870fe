import { describe, expect, it } from 'vitest';
import { checks, renderReport } from './report.ts';
import type { RunResult } from './report.ts';

const base: RunResult = {
  env: { accel: 'tcg', hosts: 3, link_gbps: 10, guest_mib: 256, dirty_mib: 64, date: '2025-01-01T00:00:00Z', git_commit: 'abc1234', api: '127.0.0.1:19700', mode: 'quick', notes: ['a note'] },
  scenarios: {
    fork_same_host_1: { n: 3, p50_ms: 100, p95_ms: 120, p99_ms: 120, max_ms: 120 },
    fork_cross_host_1: { n: 3, p50_ms: 150, p95_ms: 170, p99_ms: 170, max_ms: 170 },
    classic_restore: { n: 3, p50_ms: 600, p95_ms: 700, p99_ms: 700, max_ms: 700 },
    naive_full_copy: { n: 3, p50_ms: 900, p95_ms: 950, p99_ms: 950, max_ms: 950 },
    resume_paused: { n: 5, p50_ms: 20, p95_ms: 30, p99_ms: 30, max_ms: 30 },
    resume_hibernated_warm: { skipped: 'HibernateSandbox not supported' },
  },
  samples: { fork_same_host_1: [90, 100, 120], fork_cross_host_1: [140, 150, 170], classic_restore: [500, 600, 700], naive_full_copy: [850, 900, 950], resume_paused: [10, 15, 20, 25, 30] },
};

describe('report', () => {
  it('checks_computeRatiosAndLeaveMissingSidesUndecided', () => {
    const c = Object.fromEntries(checks(base.scenarios).map((x) => [x.what, x]));
    expect(c['fork_cross_host_1 / fork_same_host_1 (p50)']).toMatchObject({ value: '1.50', measured: 1.5, ok: true });
    expect(c['fork_same_host_1 / classic_restore (p50)']).toMatchObject({ value: '0.17', ok: true });
    expect(c['resume_hibernated_warm / classic_restore (p50)']).toMatchObject({ measured: null, ok: undefined });
    expect(c['resume_paused p50']?.ok).toBe(true);
  });

  it('checks_ofAScenarioThatFailed_missTheTarget_insteadOfJudgingItsPartialSamples', () => {
    const s = { ...base.scenarios, fork_cross_host_1: { n: 1, p50_ms: 110, p95_ms: 110, p99_ms: 110, max_ms: 110, failed: 'exec timed out' }, resume_paused: { n: 2, p50_ms: 10, p95_ms: 10, p99_ms: 10, max_ms: 10, failed: 'x' } };
    const c = Object.fromEntries(checks(s).map((x) => [x.what, x]));
    expect(c['fork_cross_host_1 / fork_same_host_1 (p50)']).toMatchObject({ value: 'failed: fork_cross_host_1', measured: null, ok: false });
    expect(c['resume_paused p50']).toMatchObject({ value: 'failed: resume_paused', ok: false });
    expect(c['fork_same_host_1 / classic_restore (p50)']?.ok).toBe(true);
  });

  it('checks_ofAScenarioTheTimeBudgetStopped_areUndecided_notJudgedOnItsFewSamples', () => {
    // One cold sample of the baseline would make the fork look 6x faster than it is.
    const s = { ...base.scenarios, classic_restore: { n: 1, p50_ms: 888, p95_ms: 888, p99_ms: 888, max_ms: 888, truncated: '1 of 5 samples' } };
    const c = Object.fromEntries(checks(s).map((x) => [x.what, x]));
    expect(c['fork_same_host_1 / classic_restore (p50)']).toMatchObject({ value: 'stopped early (time budget): classic_restore', measured: null, ok: undefined });
    expect(c['fork_cross_host_1 / fork_same_host_1 (p50)']?.ok).toBe(true);
    expect(renderReport({ ...base, scenarios: s }).markdown).toContain('| classic_restore | 1 (stopped by the time budget: 1 of 5 samples) |');
  });

  it('renderReport_writesEnvironmentTableAndEveryChart', () => {
    const { markdown, files } = renderReport(base);
    for (const s of ['| accel | tcg |', '| hosts | 3 |', '10 Gbit/s', '256 MiB, 64 MiB dirtied', 'abc1234', 'skipped: HibernateSandbox not supported', 'a note']) expect(markdown).toContain(s);
    for (const f of Object.keys(files)) expect(markdown).toContain(`(${f})`);
    expect(files['same-vs-cross.svg']).toContain('cross host p50');
    expect(files['cdf-fork.svg']).toContain('fork_cross_host_1 (n=3)');
    expect(markdown).not.toContain('Where the time went');
  });

  it('renderReport_withAnUnknownLinkRate_saysSo', () => {
    const { markdown, files } = renderReport({ ...base, env: { ...base.env, link_gbps: null } });
    expect(markdown).toContain('| link | unknown (the hosts report no link rate, or differing ones) |');
    expect(files['same-vs-cross.svg']).not.toContain('null');
  });

  it('renderReport_withPhases_tablesWhereEachScenariosTimeWent', () => {
    const { markdown } = renderReport({ ...base, phases: { fork_cross_host_1: { n: 5, op_ms: 2400, to_first_step_ms: 12, host_step_ms: 2300, step_overhead_ms: 30, exec_after_op_ms: 150, bytes_moved: 180 * 1024 * 1024, migrated_samples: 5 } } });
    expect(markdown).toContain('## Where the time went (medians, ms)');
    expect(markdown).toContain('| fork_cross_host_1 | 5 | 2400 | 12 | 2300 | 30 | 150 | 180.0 | 5 |');
  });
});

describe('report: scenarios without samples, leftovers and accel', () => {
  it('renderReport_aScenarioThatFailedAtItsFirstSample_showsNoFigures_notZeroMs', () => {
    const s = { ...base.scenarios, fork_cross_host_1: { n: 0, p50_ms: null, p95_ms: null, p99_ms: null, max_ms: null, failed: 'exec timed out' } } as RunResult['scenarios'];
    const { markdown, files } = renderReport({ ...base, scenarios: s });
    expect(markdown).toContain('| fork_cross_host_1 | 0 (failed after 0: exec timed out) | - | - | - | - |');
    expect(markdown).not.toMatch(/\| null \|/);
    expect(files['same-vs-cross.svg']).not.toContain('cross host p50');
    expect(Object.fromEntries(checks(s).map((x) => [x.what, x]))['fork_cross_host_1 / fork_same_host_1 (p50)']).toMatchObject({ measured: null, ok: false });
  });

  it('renderReport_aScenarioThatLeftSandboxesBehind_saysSo', () => {
    const s = { ...base.scenarios, fork_same_host_1: { n: 3, p50_ms: 100, p95_ms: 120, p99_ms: 120, max_ms: 120, destroy_failures: 2 }, classic_restore: { n: 3, p50_ms: 600, p95_ms: 700, p99_ms: 700, max_ms: 700, leftover_sandboxes: 2 } };
    const { markdown } = renderReport({ ...base, scenarios: s });
    expect(markdown).toContain('| fork_same_host_1 | 3 (2 not destroyed) | 100 |');
    expect(markdown).toContain('| classic_restore | 3 (ran beside 2 left over) | 600 |');
  });

  it('checks_againstABaselineOnAnotherAccel_areNotEvaluated_andSayWhy', () => {
    const c = Object.fromEntries(checks(base.scenarios, { accel: 'kvm', baseline_accel: 'tcg' }).map((x) => [x.what, x]));
    for (const w of ['fork_same_host_1 / classic_restore (p50)', 'fork_cross_host_1 / naive_full_copy (p50)']) expect(c[w]).toMatchObject({ value: 'not evaluated: fleet accel kvm, baseline accel tcg', measured: null, ok: undefined });
    // A ratio of two fleet scenarios is judged as ever.
    expect(c['fork_cross_host_1 / fork_same_host_1 (p50)']?.ok).toBe(true);
    const same = Object.fromEntries(checks(base.scenarios, { accel: 'tcg', baseline_accel: 'tcg' }).map((x) => [x.what, x]));
    expect(same['fork_same_host_1 / classic_restore (p50)']).toMatchObject({ value: '0.17', ok: true });
    const unknown = Object.fromEntries(checks(base.scenarios, { accel: 'tcg' }).map((x) => [x.what, x]));
    expect(unknown['fork_same_host_1 / classic_restore (p50)']).toMatchObject({ value: "not evaluated: the baseline's accel is unknown", ok: undefined });
  });

  it('renderReport_judgesTheBaselineRatiosWithTheRunsAccels', () => {
    const { markdown } = renderReport({ ...base, env: { ...base.env, accel: 'kvm', baseline_accel: 'tcg' } });
    expect(markdown).toContain('| fork_same_host_1 / classic_restore (p50) | <= 0.33 | not evaluated: fleet accel kvm, baseline accel tcg | no data |');
  });
});
