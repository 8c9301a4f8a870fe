import { describe, expect, it } from 'vitest';
import { applyBooking, bookedFor, bookingOf, sharedMemoryMib } from './image-shares.ts';
import type { HostAllocRec } from './records.ts';

const FRACTION = 48 / 256;
const res = { vcpus: 1, memoryMib: 256, diskMib: 1024 };
const empty: HostAllocRec = { hostId: 'h', allocated: { vcpus: 0, memoryMib: 0, diskMib: 0 }, sandboxes: 0 };
const child = { res, imageShare: 'sn-a' };

function times(a: HostAllocRec, n: number, sign: 1 | -1, b = child): HostAllocRec {
  for (let i = 0; i < n; i++) a = applyBooking(a, b, sign, FRACTION);
  return a;
}

describe('image shares', () => {
  it('childrenOfOneImage_bookAWholeGuestAlone_thenTheImageOncePlusTheirPrivatePages', () => {
    expect(times(empty, 1, 1).allocated.memoryMib).toBe(256);
    expect(times(empty, 2, 1).allocated.memoryMib).toBe(256 + 2 * 48);
    const eight = times(empty, 8, 1);
    expect(eight.allocated).toEqual({ vcpus: 8, memoryMib: 256 + 8 * 48, diskMib: 8 * 1024 });
    expect(eight.sandboxes).toBe(8);
    expect(eight.images).toEqual({ 'sn-a': 8 });
    expect(sharedMemoryMib(256, FRACTION, 8)).toBe(256 + 8 * 48);
  });

  it('releasingEveryChild_inAnyOrderWithOtherSandboxes_returnsTheAllocToWhatItWas', () => {
    const whole = { res: { vcpus: 2, memoryMib: 512, diskMib: 100 } };
    const base = applyBooking(empty, whole, 1, FRACTION);
    let a = times(base, 5, 1);
    a = applyBooking(a, { res, imageShare: 'sn-b' }, 1, FRACTION);
    a = applyBooking(a, { res, imageShare: 'sn-b' }, -1, FRACTION);
    a = times(a, 5, -1);
    expect(a).toEqual(base);
    expect(a.images).toBeUndefined();
  });

  it('aShareTheAllocDoesNotList_givesBackItsPrivatePagesOnly_neverMemoryBookedForOthers', () => {
    // Eight children booked as shares (640 MiB) and a 512 MiB guest; then a scheduler of an
    // earlier version rewrote the record without `images`, keeping what they book.
    const eight = applyBooking(times(empty, 8, 1), { res: { vcpus: 1, memoryMib: 512, diskMib: 0 } }, 1, FRACTION);
    const rewritten: HostAllocRec = { hostId: 'h', allocated: eight.allocated, sandboxes: eight.sandboxes };
    const after = times(rewritten, 8, -1);
    // 512 stays booked for the other guest, and the image's 256 with it (over, not under).
    expect(after.allocated.memoryMib).toBe(512 + 256);
    expect(after.allocated.vcpus).toBe(1);
  });

  it('bookedFor_givesWhatTheSameBookingsOneByOneGive_andPlacementSeesTheCounts', () => {
    const sandboxes = [{ resources: res, imageShare: 'sn-a' }, { resources: res }, { resources: res, imageShare: 'sn-a' }, { resources: res, imageShare: 'sn-c' }];
    let a = empty;
    for (const s of sandboxes) a = applyBooking(a, bookingOf(s), 1, FRACTION);
    expect(bookedFor('h', sandboxes, FRACTION)).toEqual(a);
    expect(a.allocated.memoryMib).toBe(256 + 2 * 48 + 256 + 256);
    expect(a.images).toEqual({ 'sn-a': 2, 'sn-c': 1 });
  });

});
