import { describe, expect, it } from 'vitest';
import { durationFromMs } from '@bufbuild/protobuf/wkt';
import { EXEC_KEEPALIVE_MISSES, execKeepaliveMs } from './agent-bus.ts';
import { MAX_TIMER_MS } from '../../../services/config.ts';

describe('execKeepaliveMs', () => {
  it('noKeepalive_orANonPositiveOne_meansNoLease', () => {
    expect(execKeepaliveMs(undefined)).toBe(0);
    expect(execKeepaliveMs(durationFromMs(0))).toBe(0);
    expect(execKeepaliveMs(durationFromMs(-5000))).toBe(0);
  });

  it('aShortKeepalive_isReadAsTheShortestTheAgentTakes', () => {
    expect(execKeepaliveMs(durationFromMs(1))).toBe(50);
    expect(execKeepaliveMs(durationFromMs(5000))).toBe(5000);
  });

  it('aKeepaliveLongerThanATimerCanWaitForItsMisses_isCappedSoTheLeaseTimerStillFiresLate', () => {
    // 7 days: EXEC_KEEPALIVE_MISSES of them exceed 2^31-1 ms, which Node fires after 1 ms.
    const ms = execKeepaliveMs(durationFromMs(7 * 24 * 3600 * 1000));
    expect(ms * EXEC_KEEPALIVE_MISSES).toBeLessThanOrEqual(MAX_TIMER_MS);
    expect(ms).toBeGreaterThan(6 * 24 * 3600 * 1000);
  });
});
