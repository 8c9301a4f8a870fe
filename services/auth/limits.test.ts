import { describe, expect, it } from 'vitest';
import { ConcurrencyLimiter, RateLimiter, TokenBucket } from './limits.ts';

describe('TokenBucket', () => {
  it('take_fromFullBucket_admitsBurstThenSaysHowLongToWait', () => {
    const b = new TokenBucket({ perSecond: 10, burst: 3 }, 0);
    expect([b.take(0), b.take(0), b.take(0)]).toEqual([0, 0, 0]);
    expect(b.take(0)).toBe(100);
  });

  it('take_afterWaiting_refillsAtTheRateButNeverAboveBurst', () => {
    const b = new TokenBucket({ perSecond: 10, burst: 2 }, 0);
    b.take(0);
    b.take(0);
    expect(b.take(50)).toBe(50); // half a token
    expect(b.take(100)).toBe(0);
    expect(b.take(60_000)).toBe(0);
    expect(b.take(60_000)).toBe(0);
    expect(b.take(60_000)).toBeGreaterThan(0); // refilled to 2, not 600
  });

  it('take_withClockGoingBackwards_neverAddsTokens', () => {
    const b = new TokenBucket({ perSecond: 1, burst: 1 }, 1000);
    expect(b.take(1000)).toBe(0);
    expect(b.take(0)).toBeGreaterThan(0);
  });
});

describe('RateLimiter', () => {
  it('take_keepsOneBucketPerKey_andLeavesKeysWithoutSpecUnlimited', () => {
    const r = new RateLimiter((k) => (k === 'slow' ? { perSecond: 1, burst: 1 } : undefined));
    expect(r.take('slow', 0)).toBe(0);
    expect(r.take('slow', 0)).toBe(1000);
    for (let i = 0; i < 1000; i++) expect(r.take('free', 0)).toBe(0);
  });
});

describe('ConcurrencyLimiter', () => {
  it('acquire_overMax_isRefusedUntilOneIsReleased_andReleaseIsIdempotent', () => {
    const c = new ConcurrencyLimiter(2);
    const a = c.acquire('k')!;
    const b = c.acquire('k')!;
    expect(c.acquire('k')).toBeUndefined();
    expect(c.acquire('other')).toBeDefined();
    a();
    a();
    expect(c.count('k')).toBe(1);
    expect(c.acquire('k')).toBeDefined();
    b();
    expect(c.count('k')).toBe(1);
  });
});
