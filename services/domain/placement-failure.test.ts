// The error a failed placement gives its caller (placementFailure): short of room, or no host
// eligible at all for reasons freed capacity does not change.
import { describe, expect, it } from 'vitest';
import { placementFailure } from './executor.ts';

const failed = (filtered: Record<string, number>, o: { placed?: number; feasible?: number } = {}) => placementFailure({ kind: 'fork', placed: o.placed ?? 0, feasible: o.feasible ?? 0, filtered, summary: 'fork of sn-1: no capacity, could place 0 of 1' });

describe('A failed placement', () => {
  it('whereSomeHostWasShortOfRoom_isNoCapacity_retryable', () => {
    expect(failed({ cordoned: 1, insufficient_memory: 2 })).toMatchObject({ kind: 'resource_exhausted', retryable: true });
    // Some placed, or feasible hosts only capped (max_per_host): short of room too.
    expect(failed({ cordoned: 2 }, { placed: 3 })).toMatchObject({ kind: 'resource_exhausted' });
    expect(failed({}, { feasible: 2 })).toMatchObject({ kind: 'resource_exhausted' });
  });

  it('whereNoHostWasEligible_forCordonsOrALocalityNoHostMeets_isFailedPrecondition_notRetryable_andNamesTheReasons', () => {
    // An SRE got "no capacity ... ask for less (--memory)" for a same-host fork whose only holder was cordoned.
    const e = failed({ locality: 2, cordoned: 1 });
    expect(e).toMatchObject({ kind: 'failed_precondition', retryable: false });
    expect(e.message).toBe('no host is eligible for this fork (locality=2, cordoned=1; locality: the placement locality (same or cross host) excludes it)');
    expect(failed({ no_transfer_source: 3 })).toMatchObject({ kind: 'failed_precondition', message: expect.stringContaining('no live host holds the snapshot') });
  });

  it('whereTheHostsThatWouldBeEligibleAreDown_isUnavailable_retryable', () => {
    // A create pinned to a host that is suspect: it may be heard again.
    expect(failed({ not_pinned: 2, host_suspect: 1 })).toMatchObject({ kind: 'unavailable', retryable: true, message: expect.stringContaining('retry once they are back') });
  });
});
