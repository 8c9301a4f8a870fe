import { describe, expect, it } from 'vitest';
import { LatencyHistogram, cdfPoints } from './hist.ts';

describe('LatencyHistogram', () => {
  it('summary_whenEmpty_reportsNullPercentiles_notZeroMs', () => {
    // 0 ms would read as the fastest scenario of the run.
    expect(new LatencyHistogram().summary()).toEqual({ n: 0, p50_ms: null, p95_ms: null, p99_ms: null, max_ms: null });
  });

  it('summary_ofOneToHundred_givesPercentilesWithinHdrPrecision', () => {
    const h = new LatencyHistogram();
    for (let i = 1; i <= 100; i++) h.record(i);
    const s = h.summary();
    expect(s.n).toBe(100);
    expect(s.p50_ms).toBeCloseTo(50, 0);
    expect(s.p95_ms).toBeCloseTo(95, 0);
    expect(s.p99_ms).toBeCloseTo(99, 0);
    expect(s.max_ms).toBe(100);
  });

  it('summary_neverReportsAPercentileAboveTheExactMax', () => {
    const h = new LatencyHistogram();
    for (const v of [1234.56, 1234.5, 17.25]) h.record(v);
    const s = h.summary();
    if (s.max_ms === null) throw new Error('no samples');
    expect(s.max_ms).toBe(1234.6);
    expect(s.p99_ms).toBeLessThanOrEqual(s.max_ms);
    expect(s.p50_ms).toBeLessThanOrEqual(s.p95_ms);
  });

  it('record_withNegativeOrNaN_throws', () => {
    const h = new LatencyHistogram();
    expect(() => h.record(-1)).toThrow(RangeError);
    expect(() => h.record(Number.NaN)).toThrow(RangeError);
  });
});

describe('cdfPoints', () => {
  it('sortsAndEndsAtOne', () => {
    expect(cdfPoints([30, 10, 20, 40])).toEqual([[10, 0.25], [20, 0.5], [30, 0.75], [40, 1]]);
  });
});
