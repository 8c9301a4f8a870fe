// Latency histograms: HDR (3 significant digits, microsecond resolution, up to 1 hour) plus
// the raw samples, which the report's CDF plots. Pure: no I/O.
import { build } from 'hdr-histogram-js';
import type { Histogram } from 'hdr-histogram-js';

/** What the JSON reports per scenario with samples. Invariant: n > 0 and p50 <= p95 <= p99 <= max. */
export interface LatencySummary {
  n: number;
  p50_ms: number;
  p95_ms: number;
  p99_ms: number;
  max_ms: number;
}

/** A scenario without a sample (one that failed at its first): no figure, rather than 0 ms, which reads as fast. */
export interface NoSamples {
  n: 0;
  p50_ms: null;
  p95_ms: null;
  p99_ms: null;
  max_ms: null;
}

export type SampleSummary = LatencySummary | NoSamples;

export const NO_SAMPLES: Readonly<NoSamples> = Object.freeze({ n: 0, p50_ms: null, p95_ms: null, p99_ms: null, max_ms: null });

export class LatencyHistogram {
  private readonly h: Histogram = build({ bitBucketSize: 64, lowestDiscernibleValue: 1, highestTrackableValue: 3_600_000_000, numberOfSignificantValueDigits: 3, useWebAssembly: false });
  /** Every recorded sample, ms, in arrival order. */
  readonly samples: number[] = [];

  record(ms: number): void {
    if (!Number.isFinite(ms) || ms < 0) throw new RangeError(`latency must be a finite number >= 0 ms, got ${ms}`);
    this.samples.push(ms);
    this.h.recordValue(Math.max(1, Math.round(ms * 1000)));
  }

  summary(): SampleSummary {
    return summarise(this.h, this.samples);
  }
}

const r1 = (x: number): number => Math.round(x * 10) / 10;

function summarise(h: Histogram, samples: readonly number[]): SampleSummary {
  const n = samples.length;
  if (n === 0) return { ...NO_SAMPLES };
  const at = (p: number): number => r1(h.getValueAtPercentile(p) / 1000);
  // HDR rounds up inside its bucket; the exact max is known, so no percentile may exceed it.
  const max = r1(Math.max(...samples));
  return { n, p50_ms: Math.min(at(50), max), p95_ms: Math.min(at(95), max), p99_ms: Math.min(at(99), max), max_ms: max };
}

/** Points of the empirical CDF: (latency, fraction of samples <= latency), sorted. */
export function cdfPoints(samples: readonly number[]): Array<[number, number]> {
  const s = [...samples].sort((a, b) => a - b);
  return s.map((v, i) => [v, (i + 1) / s.length]);
}
