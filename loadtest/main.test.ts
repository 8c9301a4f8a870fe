// The load test's command line: --help prints the usage and starts nothing; an option it does
// not know, or a bad value, ends at once with one line naming it (exit 2), not a stack trace.
// The script is run as `npm run loadtest` runs it; every case ends before any fleet starts.
// Then the run's helpers, imported (main.ts runs main() only as a script).
import { spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { describe, expect, it } from 'vitest';
import { MODE_DEFAULTS, baselineEnv, baselinePrepared, compileConfig } from './main.ts';

const MAIN = resolve(import.meta.dirname, 'main.ts');
const run = (...args: string[]) => spawnSync(process.execPath, ['--import', 'tsx', MAIN, ...args], { encoding: 'utf8', timeout: 60_000 });

describe('loadtest command line', () => {
  it('help_printsTheUsage_andExitsZero', () => {
    const r = run('--quick', '--help');
    expect(r.status).toBe(0);
    expect(r.stdout).toMatch(/^usage: npm run loadtest -- \[--quick\]/);
    expect(r.stdout).toContain('--plan --forks-per-s X --p95-ms Y --from FILE');
  });

  it('help_printsTheDefaultsTheRunTakes_inBothModes', () => {
    // Before, it printed --samples 5, --duration 60s and --budget 200s for either mode.
    const r = run('--help');
    const full = compileConfig({});
    const quick = compileConfig({ quick: true });
    expect([full.samples, full.durationMs, full.budgetMs, quick.samples, quick.durationMs, quick.budgetMs]).toEqual([10, 300_000, 3_600_000, 3, 40_000, 200_000]);
    expect(MODE_DEFAULTS.full).toMatchObject({ samples: 10, duration: '300s', budget: '3600s' });
    for (const flag of ['--samples 10]', '--duration 300s]', '--budget 3600s]', '--op-timeout 300s]']) expect(r.stdout).toContain(`[${flag}`);
    expect(r.stdout).toContain("--quick's defaults: --samples 3 --duration 40s --budget 200s --op-timeout 45s");
  });

  it('anUnknownOption_endsWithOneLineNamingIt_exit2', () => {
    const r = run('--quick', '--hostz', '3');
    expect(r.status).toBe(2);
    expect(r.stderr.trim().split('\n')).toEqual([expect.stringMatching(/^loadtest: .*'--hostz'.*\(npm run loadtest -- --help\)$/)]);
  });

  it('aBadValue_endsWithOneLineNamingTheOption_exit2', () => {
    const r = run('--hosts', '0');
    expect(r.status).toBe(2);
    expect(r.stderr.trim().split('\n')).toEqual([expect.stringMatching(/^loadtest: --hosts: want an integer >= 1, got "0" \(npm run loadtest -- --help\)$/)]);
  });
  it('plan_aBadOrMissingValue_endsWithOneLineNamingTheFlag_exit2', () => {
    // Before: --seconds 0 answered 1 host at p95 0, --fork-n 2.5 ran as 2, --forks-per-s
    // Infinity never ended, and the rest ended in stack traces (place()'s field, ENOENT).
    const dir = mkdtempSync(join(tmpdir(), 'ff-plan-'));
    try {
      const from = join(dir, 'run.json');
      writeFileSync(from, JSON.stringify({
        env: { accel: 'tcg', hosts: 3, link_gbps: 10, guest_mib: 256, dirty_mib: 64, date: '', git_commit: '', api: '', mode: 'quick', notes: [] },
        scenarios: { fork_same_host_1: { n: 3, p50_ms: 200, p95_ms: 260, p99_ms: 260, max_ms: 260 }, fork_cross_host_1: { n: 3, p50_ms: 300, p95_ms: 380, p99_ms: 380, max_ms: 380 } },
        samples: { fork_same_host_1: [180, 200, 260] },
      }));
      const ok = ['--forks-per-s', '5', '--p95-ms', '1000', '--from', from];
      const cases: Array<[string[], RegExp]> = [
        [['--seconds', '0'], /--seconds: want an integer >= 1, got "0"/],
        [['--seconds', 'abc'], /--seconds: want an integer >= 1, got "abc"/],
        [['--fork-n', '2.5'], /--fork-n: want an integer >= 1, got "2.5"/],
        [['--host-slots', '0'], /--host-slots: want an integer >= 1, got "0"/],
        [['--forks-per-s', '0'], /--forks-per-s: want a number > 0, got "0"/],
        [['--forks-per-s', 'Infinity'], /--forks-per-s: want a number > 0, got "Infinity"/],
        [['--p95-ms', '250'], /--p95-ms: 250 ms is below the run's same-host p95 \(260 ms/],
        [['--from', join(dir, 'none.json')], /--from: cannot read .*none\.json: ENOENT/],
      ];
      for (const [bad, msg] of cases) {
        const args = [...ok];
        const at = args.indexOf(bad[0]!);
        if (at >= 0) args.splice(at, 2);
        const r = run('--plan', ...args, ...bad);
        expect([r.status, r.stderr.trim().split('\n')], bad.join(' ')).toEqual([2, [expect.stringMatching(new RegExp(`^loadtest: .*${msg.source}.* \\(npm run loadtest -- --help\\)$`))]]);
      }
      const missing = run('--plan', '--forks-per-s', '5', '--from', from);
      expect([missing.status, missing.stderr.trim()]).toEqual([2, expect.stringMatching(/^loadtest: --plan needs --forks-per-s X --p95-ms Y --from FILE/)]);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  }, 120_000);
});

describe('loadtest run order and env', () => {
  it('baselinePrepared_waitsForThePreparationToEnd_andAFailedOneIsReportedByItsAwaiterNotHere', async () => {
    // The timed scenarios begin only after it: the baseline guest's boot, dirtying, snapshot
    // and save used to run beside fork_same_host_1/4/8 and resume_paused.
    let finish!: () => void;
    const prep = new Promise<void>((r) => (finish = r));
    let ended = false;
    const waited = baselinePrepared(prep).then(() => (ended = true));
    await new Promise((r) => setTimeout(r, 20));
    expect(ended).toBe(false);
    finish();
    await waited;
    expect(ended).toBe(true);
    // Failed: no throw here; the baselines' own await rethrows it and reports them failed.
    const failed = Promise.reject(new Error('boot failed'));
    await expect(baselinePrepared(failed)).resolves.toBeGreaterThanOrEqual(0);
    await expect(failed).rejects.toThrow('boot failed');
    await expect(baselinePrepared(undefined)).resolves.toBeGreaterThanOrEqual(0);
  });

  it('baselinePrepared_endsWhenTheRunIsStopped_withoutWaitingOutThePreparation', async () => {
    // Ctrl-C during the wait: the run's undo waits for its loop, and the preparation can take minutes.
    const stop = new AbortController();
    const waited = baselinePrepared(new Promise<void>(() => undefined), stop.signal);
    setTimeout(() => stop.abort(), 20);
    await expect(waited).resolves.toBeGreaterThanOrEqual(0);
    const stoppedBefore = new AbortController();
    stoppedBefore.abort();
    await expect(baselinePrepared(new Promise<void>(() => undefined), stoppedBefore.signal)).resolves.toBeGreaterThanOrEqual(0);
  });

  it('baselineEnv_recordsTheBaselineGuestsBootAsItsOwnEnvField', () => {
    expect(baselineEnv({ accel: 'tcg', coldBootMs: 8123.456 })).toEqual({ baseline_accel: 'tcg', baseline_cold_boot_ms: 8123.5 });
    expect(baselineEnv(undefined)).toEqual({});
  });
});
