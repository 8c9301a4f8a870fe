// What a sandbox books on its host, and how fork children share their snapshot's memory image.
//
// A fork child maps its snapshot's memory image copy-on-write (share=off): the pages it has not
// written are the image's page cache, one copy per host. So n children of snapshot S on one host
// book, in memory, what the placement library prices them at (scheduler/cost.ts memoryFor):
//
//   F(n) = 0 for n = 0, else min(n * memoryMib, n * privateMib + memoryMib)
//
// (never more than n whole guests; privateMib = ceil(memoryMib * privateMemoryFraction)). The
// host's alloc record keeps n per snapshot (HostAllocRec.images) and its allocated.memoryMib
// includes F(n) for each; a child booked or released there moves n by one and the memory by the
// difference. The child's record names the share it holds (SandboxRec.imageShare), so a release
// takes back exactly what its booking added, whichever path releases it. vCPUs and disk are
// booked per child as for any sandbox.
//
// Invariant (kept by every commit): for each host, allocated.memoryMib is the sum of
// resources.memoryMib over its capacity-holding sandboxes without a share, plus F(n) over its
// images; images[S].children is the number of its capacity-holding sandboxes whose share is S.
// bookedFor() computes the record that invariant gives, for tests and audits.
import type { HostAllocRec, ImageShareRec, ResourcesRec, SandboxRec } from './records.ts';

/** What a sandbox holds on its host: its resources, with its memory as a share of `imageShare`'s image when set. */
export interface Booking {
  readonly res: ResourcesRec;
  /** Snapshot whose memory image the sandbox's VM maps copy-on-write on its host (a fork child). */
  readonly imageShare?: string;
}

export function bookingOf(sb: Pick<SandboxRec, 'resources' | 'imageShare'>): Booking {
  return sb.imageShare ? { res: sb.resources, imageShare: sb.imageShare } : { res: sb.resources };
}

/** Memory n children of one image book together (F above). */
export function sharedMemoryMib(e: Pick<ImageShareRec, 'memoryMib' | 'privateMib'>, n: number): number {
  return n <= 0 ? 0 : Math.min(n * e.memoryMib, n * e.privateMib + e.memoryMib);
}

/** A child's private pages under this model: ceil(memoryMib * privateMemoryFraction), at most its whole memory. */
export function privateMibOf(memoryMib: number, privateMemoryFraction: number): number {
  return Math.min(memoryMib, Math.ceil(memoryMib * privateMemoryFraction));
}

function clamp(n: number): number {
  return Math.max(0, n);
}

/**
 * `alloc` with one sandbox's booking added (`sign` 1) or taken back (-1). A share taken back
 * from an image the record does not list (booked before shares were kept, or an alloc written
 * by an older leader) gives back its whole memory, as it was booked then. Never below zero.
 */
export function applyBooking(alloc: HostAllocRec, b: Booking, sign: 1 | -1, privateMemoryFraction: number): HostAllocRec {
  let memoryDelta = sign * b.res.memoryMib;
  let images = alloc.images;
  if (b.imageShare) {
    const cur = alloc.images?.[b.imageShare];
    if (sign === 1 || cur) {
      const e: ImageShareRec = cur ?? { children: 0, memoryMib: b.res.memoryMib, privateMib: privateMibOf(b.res.memoryMib, privateMemoryFraction) };
      const n = clamp(e.children + sign);
      memoryDelta = sharedMemoryMib(e, n) - sharedMemoryMib(e, e.children);
      const { [b.imageShare]: _old, ...rest } = alloc.images ?? {};
      images = n > 0 ? { ...rest, [b.imageShare]: { ...e, children: n } } : rest;
    }
  }
  const next: HostAllocRec = {
    hostId: alloc.hostId,
    allocated: {
      vcpus: clamp(alloc.allocated.vcpus + sign * b.res.vcpus),
      memoryMib: clamp(alloc.allocated.memoryMib + memoryDelta),
      diskMib: clamp(alloc.allocated.diskMib + sign * b.res.diskMib),
    },
    sandboxes: clamp(alloc.sandboxes + sign),
  };
  if (images && Object.keys(images).length > 0) next.images = images;
  return next;
}

/**
 * The alloc record of `hostId` that the invariant above gives for these sandboxes (those that
 * hold capacity on it; the caller filters). Images keep the sizes of the first child listed.
 */
export function bookedFor(hostId: string, sandboxes: readonly Pick<SandboxRec, 'resources' | 'imageShare'>[], privateMemoryFraction: number): HostAllocRec {
  let a: HostAllocRec = { hostId, allocated: { vcpus: 0, memoryMib: 0, diskMib: 0 }, sandboxes: 0 };
  for (const s of sandboxes) a = applyBooking(a, bookingOf(s), 1, privateMemoryFraction);
  return a;
}

/** Children booked per image on a host (HostInput.imageShares for the placement library). */
export function imageSharesOf(alloc: HostAllocRec | undefined): Record<string, number> | undefined {
  if (!alloc?.images) return undefined;
  const out: Record<string, number> = {};
  for (const [id, e] of Object.entries(alloc.images)) if (e.children > 0) out[id] = e.children;
  return Object.keys(out).length > 0 ? out : undefined;
}
