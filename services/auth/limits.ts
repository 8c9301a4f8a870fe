// Admission limits at the API edge, pure (the clock is passed in): a token bucket per
// tenant and a count of open streaming calls per credential.

export interface RateSpec {
  /** Sustained requests per second. */
  readonly perSecond: number;
  /** Requests allowed at once from a full bucket. */
  readonly burst: number;
}

/** A token bucket. Invariant: 0 <= tokens <= burst. */
export class TokenBucket {
  private tokens: number;
  private at: number;
  constructor(readonly spec: RateSpec, now: number) {
    this.tokens = spec.burst;
    this.at = now;
  }

  /** Takes one token; returns 0 when taken, else the ms until one is available. */
  take(now: number): number {
    const { perSecond, burst } = this.spec;
    this.tokens = Math.min(burst, this.tokens + (Math.max(0, now - this.at) * perSecond) / 1000);
    this.at = Math.max(this.at, now);
    if (this.tokens >= 1) {
      this.tokens -= 1;
      return 0;
    }
    return Math.max(1, Math.ceil(((1 - this.tokens) * 1000) / perSecond));
  }
}

/** Token buckets by key (tenant), created on first use. */
export class RateLimiter {
  private readonly buckets = new Map<string, TokenBucket>();
  constructor(private readonly specOf: (key: string) => RateSpec | undefined) {}

  /** 0 when admitted, else how long to wait (ms). A key without a spec is not limited. */
  take(key: string, now: number): number {
    const spec = this.specOf(key);
    if (!spec) return 0;
    let b = this.buckets.get(key);
    if (!b || b.spec.perSecond !== spec.perSecond || b.spec.burst !== spec.burst) {
      b = new TokenBucket(spec, now);
      this.buckets.set(key, b);
    }
    return b.take(now);
  }
}

/** Open streaming calls per key (credential). Invariant: every count is in [1, max]. */
export class ConcurrencyLimiter {
  private readonly open = new Map<string, number>();
  constructor(readonly max: number) {}

  /** A release function (idempotent) when admitted; undefined when `key` is at its maximum. */
  acquire(key: string): (() => void) | undefined {
    const n = this.open.get(key) ?? 0;
    if (n >= this.max) return undefined;
    this.open.set(key, n + 1);
    let released = false;
    return () => {
      if (released) return;
      released = true;
      const left = (this.open.get(key) ?? 1) - 1;
      if (left <= 0) this.open.delete(key);
      else this.open.set(key, left);
    };
  }

  count(key: string): number {
    return this.open.get(key) ?? 0;
  }
}
