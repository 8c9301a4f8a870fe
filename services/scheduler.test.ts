// The scheduler's latency histograms: buckets fine enough for a same-host fork on KVM (tens
// of ms) and wide enough for a host step that runs out its timeout.
import { describe, expect, it } from 'vitest';
import { Registry } from 'prom-client';
import { compileSchedulerConfig } from './config.ts';
import { OPERATION_BUCKETS, schedulerMetrics, STEP_BUCKETS, watchProgressFor } from './scheduler.ts';

describe('scheduler metrics', () => {
  it('operationDuration_ofASameHostForkInTensOfMs_landsInABucketOfItsOwn_notWithEverythingUnder50ms', async () => {
    const registry = new Registry();
    const m = schedulerMetrics(registry);
    for (const s of [0.004, 0.008, 0.02, 0.04]) m.opSeconds.observe({ kind: 'fork' }, s);
    const text = await registry.metrics();
    const bucket = (le: string): number => Number(new RegExp(`^forkfleet_operation_duration_seconds_bucket\\{le="${le}",kind="fork"\\} (\\d+)$`, 'm').exec(text)?.[1]);
    expect([bucket('0.005'), bucket('0.01'), bucket('0.025'), bucket('0.05')]).toEqual([1, 2, 3, 4]);
  });

  it('stepBuckets_reachTheDefaultStepTimeout_andOperationBucketsRiseInOrder', () => {
    const defaults = compileSchedulerConfig({ tlsCertPath: '/x/cert.pem', tlsKeyPath: '/x/key.pem', tokensFile: '/x/tokens.json' });
    expect(STEP_BUCKETS.at(-1)).toBeGreaterThanOrEqual(defaults.stepTimeoutMs / 1000);
    expect(STEP_BUCKETS).toContain(120);
    for (const b of [STEP_BUCKETS, OPERATION_BUCKETS]) expect([...b].sort((x, y) => x - y)).toEqual(b);
    expect(OPERATION_BUCKETS[0]).toBeLessThanOrEqual(0.005);
  });
});

describe('watch progress period', () => {
  it('watchProgressFor_keepsAQuietStreamsResumePointWithinOneCompactionInterval', () => {
    // A quiet stream's resume point lags by up to 1.5 periods: within the one interval of history kept.
    for (const interval of [1000, 2000, 5000, 60_000, 300_000]) expect(1.5 * watchProgressFor(interval)).toBeLessThan(interval);
    expect(watchProgressFor(300_000)).toBe(30_000);
    expect(watchProgressFor(0)).toBe(30_000); // never compacted
  });
});
