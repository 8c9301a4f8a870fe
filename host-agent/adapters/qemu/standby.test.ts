import { pino } from 'pino';
import { afterEach, describe, expect, it, vi } from 'vitest';
import type { LocalSnapshot } from '../../domain/vmm.ts';
import type { QmpClient } from '../qmp/client.ts';
import type { QemuProcess } from './process.ts';
import { CLAIM_WAIT_MS, StandbyPool, type Standby, type StandbyPolicy, type Urgency } from './standby.ts';

const log = pino({ level: 'silent' });
const snap = (id: string): LocalSnapshot => ({ dir: `/s/${id}`, manifest: { snapshotId: id } as LocalSnapshot['manifest'] });

/**
 * A pool over fake launches (our own port): each launch waits for `release()` unless `instant`;
 * `urged` lists the snapshots of launches a claim made urgent.
 */
function harness(policy: Partial<StandbyPolicy> = {}, o: { instant?: boolean; fail?: boolean; failFrom?: number; discardFails?: boolean } = {}) {
  let n = 0;
  let now = 0;
  const launched: Standby[] = [];
  const discarded: string[] = [];
  const pending: Array<() => void> = [];
  const closers = new Map<string, () => void>();
  const urged: string[] = [];
  const launch = async (s: LocalSnapshot, urgency: Urgency): Promise<Standby> => {
    urgency.onUrgent(() => urged.push(s.manifest.snapshotId));
    if (!o.instant) await new Promise<void>((r) => pending.push(r));
    if (o.fail || (o.failFrom !== undefined && n + 1 >= o.failFrom)) throw new Error('qemu did not start');
    const id = `standby-${++n}`;
    const qmp = { onClosed: (f: () => void) => closers.set(id, f), close: () => undefined } as unknown as QmpClient;
    const sb: Standby = { id, snapshotId: s.manifest.snapshotId, workdir: `/w/${id}`, proc: { pid: 1000 + n } as QemuProcess, qmp, readyAt: now };
    launched.push(sb);
    return sb;
  };
  const pool = new StandbyPool({ max: 8, perSnapshot: 2, idleMs: 60_000, incomingQuietMs: 3000, ...policy }, launch,
    async (s) => {
      discarded.push(s.id);
      if (o.discardFails) throw Object.assign(new Error('EIO: i/o error, rm'), { code: 'EIO' });
    },
    log,
    { now: () => now },
  );
  const release = async (): Promise<void> => {
    pending.shift()?.();
    await new Promise((r) => setImmediate(r));
  };
  return { pool, launched, discarded, release, closers, urged, advance: (ms: number) => (now += ms) };
}

describe('StandbyPool', () => {
  afterEach(() => vi.useRealTimers());

  it('demand_whenForkOfFour_keepsPerSnapshotCapAndHostMax', async () => {
    const h = harness({ perSnapshot: 2, max: 3 }, { instant: true });
    h.pool.demand(snap('a'), 4);
    expect(await h.pool.warm(snap('a'), 1)).toBe(2); // resolves when the fill is done; the demand's 2 stand
    expect(await h.pool.warm(snap('b'), 5)).toBe(1); // host-wide max 3
    expect(h.pool.size).toBe(3);
    await h.pool.close();
    expect(h.discarded.sort()).toEqual(h.launched.map((s) => s.id).sort());
  });

  it('claim_whenNoneReadyButOneStarting_waitsForItInsteadOfReturningNothing', async () => {
    const h = harness();
    const warming = h.pool.warm(snap('a'), 1);
    await new Promise((r) => setImmediate(r));
    const claimed = h.pool.claim('a');
    await h.release();
    const s = await claimed;
    expect(s?.id).toBe('standby-1');
    // warm() keeps its promise of one ready standby: it starts a replacement for the claimed one.
    await h.release();
    expect(await warming).toBe(1);
    expect(h.pool.size).toBe(1);
    expect(await h.pool.claim('b')).toBeUndefined();
    await h.pool.close();
  });

  it('claim_whenSeveralChildrenAndOneStarting_onlyOneWaitsTheOthersSpawnAtOnce', async () => {
    const h = harness();
    const warming = h.pool.warm(snap('a'), 1);
    await new Promise((r) => setImmediate(r));
    const first = h.pool.claim('a');
    expect(await h.pool.claim('a')).toBeUndefined();
    await h.release();
    expect((await first)?.id).toBe('standby-1');
    await h.release();
    await warming;
    await h.pool.close();
  });

  it('claim_whenToldNotToWait_returnsNothingWhileOneStartsAndTheReadyOneAfter', async () => {
    const h = harness();
    const warming = h.pool.warm(snap('a'), 1);
    await new Promise((r) => setImmediate(r));
    expect(await h.pool.claim('a', { waitForLaunching: false })).toBeUndefined();
    await h.release();
    expect(await warming).toBe(1);
    expect((await h.pool.claim('a', { waitForLaunching: false }))?.id).toBe('standby-1');
    await h.pool.close();
  });

  it('claim_whenTheStandbyStartingIsLate_raisesItsPriority_givesUpAfterTheLimit_andItGoesToReady', async () => {
    // At nice 19 behind busy guests a standby took ~2 min to start where a spawn takes ~0.5 s.
    vi.useFakeTimers({ toFake: ['setTimeout', 'clearTimeout'] });
    const h = harness();
    const warming = h.pool.warm(snap('a'), 1);
    await new Promise((r) => setImmediate(r));
    let claimed: Standby | undefined | 'waiting' = 'waiting';
    void h.pool.claim('a').then((s) => (claimed = s));
    expect(h.urged).toEqual(['a']);
    await vi.advanceTimersByTimeAsync(CLAIM_WAIT_MS - 1);
    expect(claimed).toBe('waiting');
    await vi.advanceTimersByTimeAsync(1);
    expect(claimed).toBeUndefined(); // the caller spawns
    await h.release();
    expect(await warming).toBe(1);
    expect((await h.pool.claim('a'))?.id).toBe('standby-1');
    await h.pool.close();
  });

  it('claim_whenItsSignalAbortsWhileTheStandbyStarts_returnsNothingAtOnce_andItGoesToReady', async () => {
    const h = harness();
    const warming = h.pool.warm(snap('a'), 1);
    await new Promise((r) => setImmediate(r));
    const ac = new AbortController();
    const claimed = h.pool.claim('a', { signal: ac.signal });
    ac.abort();
    expect(await claimed).toBeUndefined();
    await h.release();
    expect(await warming).toBe(1);
    expect((await h.pool.claim('a'))?.id).toBe('standby-1');
    await h.pool.close();
  });

  it('demandWhenQuiet_duringABurst_startsNothingUntilTheSnapshotIsQuiet_thenOne', async () => {
    vi.useFakeTimers();
    const h = harness({ perSnapshot: 2 }, { instant: true });
    h.pool.demandWhenQuiet(snap('a'), 1, 3000);
    await vi.advanceTimersByTimeAsync(2000);
    h.pool.demandWhenQuiet(snap('a'), 1, 3000);
    await vi.advanceTimersByTimeAsync(2000);
    expect(h.launched).toHaveLength(0);
    await vi.advanceTimersByTimeAsync(1000);
    expect(h.launched).toHaveLength(1);
    expect(h.pool.size).toBe(1);
    // A demand still held back when the pool closes never starts.
    h.pool.demandWhenQuiet(snap('b'), 1, 3000);
    await h.pool.close();
    await vi.advanceTimersByTimeAsync(5000);
    expect(h.launched).toHaveLength(1);
  });

  it('drop_whenLaunchFinishesAfterwards_discardsItAndStopsRefilling', async () => {
    const h = harness();
    const warming = h.pool.warm(snap('a'), 2);
    await new Promise((r) => setImmediate(r));
    await h.pool.drop('a');
    await h.release();
    await warming;
    expect(h.discarded).toEqual(['standby-1']);
    expect(h.launched).toHaveLength(1);
    expect(h.pool.size).toBe(0);
    await h.pool.close();
  });

  it('standby_whenItsQemuExitsOnItsOwn_isForgottenAndDiscarded', async () => {
    const h = harness({}, { instant: true });
    await h.pool.warm(snap('a'), 2);
    h.closers.get('standby-1')?.();
    expect(h.pool.size).toBe(1);
    expect(h.discarded).toEqual(['standby-1']);
    expect((await h.pool.claim('a'))?.id).toBe('standby-2');
    await h.pool.close();
  });

  it('warm_whenLaunchFails_givesUpWithoutRetryLoop', async () => {
    const h = harness({}, { instant: true, fail: true });
    expect(await h.pool.warm(snap('a'), 3)).toBe(0);
    expect(h.pool.size).toBe(0);
    await h.pool.close();
  });

  it('expiry_ofAStandbyWhoseSiblingFailedToStart_stillDiscardsIt', async () => {
    vi.useFakeTimers();
    const h = harness({ idleMs: 4000 }, { instant: true, failFrom: 2 });
    expect(await h.pool.warm(snap('a'), 2)).toBe(1);
    expect(h.pool.size).toBe(1);
    h.advance(5000);
    await vi.advanceTimersByTimeAsync(1000);
    expect(h.pool.size).toBe(0);
    expect(h.discarded).toEqual(['standby-1']);
    await h.pool.close();
  });

  it('expiry_whenSnapshotNotForkedForIdleTime_discardsItsStandbys', async () => {
    vi.useFakeTimers();
    const h = harness({ idleMs: 4000 }, { instant: true });
    await h.pool.warm(snap('a'), 2);
    h.advance(5000);
    await vi.advanceTimersByTimeAsync(1000);
    expect(h.pool.size).toBe(0);
    expect(h.discarded.sort()).toEqual(['standby-1', 'standby-2']);
    await h.pool.close();
  });

  it('aRemovalThatFails_whenItsQemuExitsOrItExpires_isLogged_notAnUnhandledRejection', async () => {
    // An unhandled rejection ends the agent (and every step it runs).
    vi.useFakeTimers();
    const unhandled: unknown[] = [];
    const onUnhandled = (e: unknown): void => void unhandled.push(e);
    process.on('unhandledRejection', onUnhandled);
    try {
      const h = harness({ idleMs: 4000 }, { instant: true, discardFails: true });
      await h.pool.warm(snap('a'), 2);
      h.closers.get('standby-1')?.(); // exits on its own
      h.advance(5000);
      await vi.advanceTimersByTimeAsync(1000); // the other expires
      await vi.advanceTimersByTimeAsync(10);
      expect(h.discarded.sort()).toEqual(['standby-1', 'standby-2']);
      expect(unhandled).toEqual([]);
    } finally {
      process.off('unhandledRejection', onUnhandled);
    }
  });
});
