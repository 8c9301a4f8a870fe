// What a sandbox books on its host, and how fork children share their snapshot's memory image.
//
// A fork child placed on a host that holds its snapshot maps the host's copy of the memory
// image copy-on-write (share=off): the pages it has not written are the image's page cache, one
// copy per host. So n children of snapshot S on one host book, in memory, what the placement
// library prices them at (scheduler/cost.ts memoryFor):
//
//   F(n) = 0 for n = 0, else min(n * memoryMib, n * privateMib + memoryMib)
//
// (never more than n whole guests; privateMib = ceil(memoryMib * privateMemoryFraction), the
// placement config's, which the service does not change). The host's alloc record keeps n per
// snapshot (HostAllocRec.images) and its allocated.memoryMib includes F(n) for each; a child
// booked or released there moves n by one and the memory by the difference. The child's record
// names the share it holds (SandboxRec.imageShare), so a release takes back what its booking
// added, whichever path releases it. vCPUs and disk are booked per child as for any sandbox.
//
// Invariant (kept by every commit of this leader): for each host, allocated.memoryMib is the sum
// of resources.memoryMib over its capacity-holding sandboxes without a share, plus F(n) over
// its images; images[S] is the number of its capacity-holding sandboxes whose share is S.
// bookedFor() computes the record that invariant gives, for tests and audits.
import type { HostAllocRec, ResourcesRec, SandboxRec } from './records.ts';

/** What a sandbox holds on its host: its resources, with its memory as a share of `imageShare`'s image when set. */
export interface Booking {
  readonly res: ResourcesRec;
  /** Snapshot whose memory image the sandbox's VM maps copy-on-write on its host (a fork child). */
  readonly imageShare?: string;
}

export function bookingOf(sb: Pick<SandboxRec, 'resources' | 'imageShare'>): Booking {
  return sb.imageShare ? { res: sb.resources, imageShare: sb.imageShare } : { res: sb.resources };
}

/** A child's private pages under this model: ceil(memoryMib * privateMemoryFraction), at most its whole memory. */
export function privateMibOf(memoryMib: number, privateMemoryFraction: number): number {
  return Math.min(memoryMib, Math.ceil(memoryMib * privateMemoryFraction));
}

/** Memory n children of one image of `memoryMib` book together (F above). */
export function sharedMemoryMib(memoryMib: number, privateMemoryFraction: number, n: number): number {
  return n <= 0 ? 0 : Math.min(n * memoryMib, n * privateMibOf(memoryMib, privateMemoryFraction) + memoryMib);
}

function clamp(n: number): number {
  return Math.max(0, n);
}

/**
 * `alloc` with one sandbox's booking added (`sign` 1) or taken back (-1). Never below zero.
 *
 * A share taken back from an image the record does not list gives back the child's private
 * pages only. Only this leader's code books shares, and it lists each; an entry is missing when
 * a scheduler of an earlier version rewrote the record (dropping `images`, keeping the memory
 * they book). Its memory is then kept booked a little too high (by at most one image per
 * snapshot), never given back twice.
 */
export function applyBooking(alloc: HostAllocRec, b: Booking, sign: 1 | -1, privateMemoryFraction: number): HostAllocRec {
  let memoryDelta = sign * b.res.memoryMib;
  let images = alloc.images;
  if (b.imageShare) {
    const n = alloc.images?.[b.imageShare] ?? 0;
    if (sign === -1 && n === 0) memoryDelta = -privateMibOf(b.res.memoryMib, privateMemoryFraction);
    else {
      const next = clamp(n + sign);
      memoryDelta = sharedMemoryMib(b.res.memoryMib, privateMemoryFraction, next) - sharedMemoryMib(b.res.memoryMib, privateMemoryFraction, n);
      const { [b.imageShare]: _old, ...rest } = alloc.images ?? {};
      images = next > 0 ? { ...rest, [b.imageShare]: next } : rest;
    }
  }
  const out: HostAllocRec = {
    hostId: alloc.hostId,
    allocated: {
      vcpus: clamp(alloc.allocated.vcpus + sign * b.res.vcpus),
      memoryMib: clamp(alloc.allocated.memoryMib + memoryDelta),
      diskMib: clamp(alloc.allocated.diskMib + sign * b.res.diskMib),
    },
    sandboxes: clamp(alloc.sandboxes + sign),
  };
  if (images && Object.keys(images).length > 0) out.images = images;
  return out;
}

/** The alloc record of `hostId` that the invariant above gives for these sandboxes (those that hold capacity on it; the caller filters). */
export function bookedFor(hostId: string, sandboxes: readonly Pick<SandboxRec, 'resources' | 'imageShare'>[], privateMemoryFraction: number): HostAllocRec {
  let a: HostAllocRec = { hostId, allocated: { vcpus: 0, memoryMib: 0, diskMib: 0 }, sandboxes: 0 };
  for (const s of sandboxes) a = applyBooking(a, bookingOf(s), 1, privateMemoryFraction);
  return a;
}
