import { describe, expect, it } from 'vitest';
import { parseMetrics, quantile } from './metrics.ts';

const TEXT = `# HELP forkfleet_operation_duration_seconds x
# TYPE forkfleet_operation_duration_seconds histogram
forkfleet_operation_duration_seconds_bucket{le="0.5",kind="fork"} 1
forkfleet_operation_duration_seconds_bucket{le="1",kind="fork"} 3
forkfleet_operation_duration_seconds_bucket{le="+Inf",kind="fork"} 4
forkfleet_operation_duration_seconds_sum{kind="fork"} 5.5
forkfleet_operation_duration_seconds_count{kind="fork"} 4
forkfleet_operations_total{kind="fork",result="succeeded"} 4
forkfleet_scheduler_is_leader 1
`;

describe('parseMetrics', () => {
  it('parseMetrics_withTwoReplicas_sumsHistogramsAndCountsLeaders', () => {
    const v = parseMetrics([TEXT, TEXT.replace('forkfleet_scheduler_is_leader 1', 'forkfleet_scheduler_is_leader 0')]);
    expect(v.durations.fork).toEqual({ le: [0.5, 1, Infinity], cumulative: [2, 6, 8], count: 8, sum: 11 });
    expect(v.operations).toEqual([{ kind: 'fork', result: 'succeeded', value: 8 }]);
    expect(v.leaders).toBe(1);
  });

  it('quantile_interpolatesInsideTheBucket_likeHistogramQuantile', () => {
    const h = parseMetrics([TEXT]).durations.fork!;
    expect(quantile(h, 0.5)).toBeCloseTo(0.75);
    expect(quantile(h, 0.99)).toBe(1);
    expect(quantile({ le: [1], cumulative: [0], count: 0, sum: 0 }, 0.5)).toBeUndefined();
  });
});
