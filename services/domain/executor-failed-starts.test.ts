// Placement after creates failed on a host for its own reasons (Executor.failedStarts): the
// Executor against stub ports of our own, placing through its real placement group and the
// placement library.
import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { HeartbeatRegistry } from './fleet-view.ts';
import { HeartbeatSchema } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type { HostRec, OperationRec } from './records.ts';
import type { PlacementRequest, PlacementResult } from '../../scheduler/index.ts';
import { leaderExecutor } from '../testkit/executor.ts';

const host = (id: string, vcpus: number, now: number): HostRec => ({ id, state: 'ready', cordoned: false, draining: false, capacity: { vcpus, memoryMib: 16_384, diskMib: 100_000 }, accel: 'tcg', qemuVersion: '7.2.0', cpuModel: 'max', machine: 'microvm', peerAddress: '10.0.0.1:7000', linkBytesPerSecond: 1.25e8, labels: {}, registeredAt: 0, lastHeartbeatAt: now, bootId: 'b' });

/** An Executor over hosts a and b (`vcpus` each) whose clock reads `clock.now`; `placedOn` places one create of `vcpus` vCPUs and answers its host. */
function executor(vcpus: { a: number; b: number }, clock: { now: number }) {
  const store = {
    getOp: async (_t: string, id: string) => ({ value: { id, tenantId: 't', kind: 'create', state: 'running', input: {}, progress: { done: 0, total: 1, message: '', bytesTransferred: 0 }, steps: {} } as unknown as OperationRec, modRevision: 4 }),
    commitAt: async () => 10,
  };
  const heard = new HeartbeatRegistry();
  for (const h of ['a', 'b']) heard.record(create(HeartbeatSchema, { hostId: h, bootId: 'b', restoreSlots: 4, restoreCostMs: 300 }), clock.now);
  const ex = leaderExecutor(store, { heard, clock: { now: () => clock.now }, config: { liveness: { suspectAfterMs: 3_600_000, lostAfterMs: 7_200_000 }, stepTimeoutMs: 100, stepAttempts: 1, chunkBytes: 1 << 18 } });
  const inner = ex as unknown as {
    failedStarts: Map<string, { image?: { count: number; at: number }; restore?: { count: number; at: number } }>;
    startWorked(hostId: string, kind: 'image' | 'restore'): void;
    cache: { apply(c: unknown): void; load(): Promise<void> };
    placeAndBook(op: OperationRec, snapshot: undefined, request: () => PlacementRequest, records: () => { perChild: { res: { vcpus: number; memoryMib: number; diskMib: number } }; writes: [] }): Promise<{ result: Extract<PlacementResult, { ok: true }> }>;
  };
  inner.cache.apply({ kind: 'host', value: { value: host('a', vcpus.a, clock.now), modRevision: 1 } });
  inner.cache.apply({ kind: 'host', value: { value: host('b', vcpus.b, clock.now), modRevision: 1 } });
  inner.cache.load = async () => undefined;
  const placedOn = async (opId: string, cpus = 1): Promise<string> => {
    const res = { vcpus: cpus, memoryMib: 256, diskMib: 0 };
    const { result } = await inner.placeAndBook({ id: opId, tenantId: 't', kind: 'create' } as OperationRec, undefined, () => ({ kind: 'create', id: opId, nowMs: clock.now, resources: res, preferences: {} }), () => ({ perChild: { res }, writes: [] }));
    return result.placements[0]!.hostId;
  };
  return { placedOn, failedStarts: inner.failedStarts, startWorked: (h: string, k: 'image' | 'restore') => inner.startWorked(h, k) };
}

const opIds = Array.from({ length: 8 }, (_, i) => `op-${i}`);

describe('placement after creates failed on a host', () => {
  it('goesToAnotherHostWithRoom_whileTheFailuresAreRecent', async () => {
    const clock = { now: 10_000_000 };
    const ex = executor({ a: 16, b: 16 }, clock);
    // Without failures both hosts are picked (spread by seed), so the test can tell.
    expect(new Set(await Promise.all(opIds.map((id) => ex.placedOn(id))))).toEqual(new Set(['a', 'b']));
    ex.failedStarts.set('a', { image: { count: 2, at: clock.now - 1000 } });
    expect(new Set(await Promise.all(opIds.map((id) => ex.placedOn(id))))).toEqual(new Set(['b']));
  });

  it('ofAnotherKind_restoresFailedThere_doNotMoveCreatesFromAnImage_norDoesAWorkingRestoreClearFailedImageBuilds', async () => {
    const clock = { now: 10_000_000 };
    const ex = executor({ a: 16, b: 16 }, clock);
    ex.failedStarts.set('a', { restore: { count: 3, at: clock.now - 1000 } });
    expect(new Set(await Promise.all(opIds.map((id) => ex.placedOn(id))))).toEqual(new Set(['a', 'b']));
    // A host that cannot build an image restores well: a wake or fork there leaves its image failures counted.
    ex.failedStarts.set('a', { image: { count: 2, at: clock.now - 1000 } });
    ex.startWorked('a', 'restore');
    expect(new Set(await Promise.all(opIds.map((id) => ex.placedOn(`${id}-x`))))).toEqual(new Set(['b']));
    ex.startWorked('a', 'image');
    expect(ex.failedStarts.has('a')).toBe(false);
  });

  it('stillGoesThere_whenNoOtherHostHasRoom', async () => {
    const clock = { now: 10_000_000 };
    const ex = executor({ a: 16, b: 1 }, clock);
    ex.failedStarts.set('a', { image: { count: 3, at: clock.now - 1000 } });
    expect(await ex.placedOn('op-big', 2)).toBe('a');
  });

  it('forgetsThemFiveMinutesAfterTheLast', async () => {
    const clock = { now: 10_000_000 };
    const ex = executor({ a: 16, b: 16 }, clock);
    ex.failedStarts.set('a', { image: { count: 3, at: clock.now - 5 * 60_000 - 1 } });
    expect(new Set(await Promise.all(opIds.map((id) => ex.placedOn(id))))).toEqual(new Set(['a', 'b']));
    expect(ex.failedStarts.has('a')).toBe(false);
  });
});
