// bench:vmm's target ratios, which its JSON carries as `ratios` (before, only its console
// table had them). The benchmark itself boots QEMU and is not run here.
import { describe, expect, it } from 'vitest';
import { benchRatios } from './vmm.ts';

describe('bench:vmm ratios', () => {
  it('benchRatios_givesTheTableRatiosForTheJson_nullWhereASideIsMissing', () => {
    const fork = { '1': { all_ready_ms: 120 }, '8': { all_ready_ms: 900 } };
    const classic = { '1': { all_ready_ms: 400 }, '8': { all_ready_ms: 2000 } };
    expect(benchRatios(fork, classic, { rss: 800, pss: 300 })).toEqual({ fork1_classic1: 0.3, fork8_classic8: 0.45, pss_rss_8: 0.38 });
    // Not Infinity or NaN (what the table's division printed) where a side is missing or 0.
    expect(benchRatios({ '1': { all_ready_ms: 120 } }, { '1': { all_ready_ms: 0 } }, { rss: 0, pss: 0 })).toEqual({ fork1_classic1: null, fork8_classic8: null, pss_rss_8: null });
  });
});
