import { describe, expect, it } from 'vitest';
import fc from 'fast-check';
import { HIBERNATION_LABEL, PURPOSE_LABEL, planRetention } from './retention.ts';
import { eventsOf } from './events.ts';
import type { SandboxRec, SnapshotRec } from './records.ts';
import { snapshotRecord } from '../testkit/records.ts';

const MIN = 60_000;
const NOTICE = 5 * MIN;

function snap(id: string, createdMin: number, over: Partial<SnapshotRec> = {}): SnapshotRec {
  return snapshotRecord({ id, createdAt: createdMin * MIN, ...over });
}

function sandbox(id: string, over: Partial<SandboxRec>): SandboxRec {
  const base = { id, tenantId: 't1', state: 'running', sourceSnapshotId: '', hibernationSnapshotId: '' } as unknown as SandboxRec;
  return { ...base, ...over };
}

const ids = (l: readonly SnapshotRec[]) => l.map((s) => s.id).sort();

describe('planRetention', () => {
  it('keepLast_whenLineageHasMore_announcesTheOldestWithFullNotice', () => {
    const snaps = [snap('s1', 1, { keepLast: 2 }), snap('s2', 2, { keepLast: 2 }), snap('s3', 3, { keepLast: 2 })];
    const p = planRetention(snaps, [], 10 * MIN, NOTICE);
    expect(p.announce.map((a) => [a.snapshot.id, a.dueAt])).toEqual([['s1', 10 * MIN + NOTICE]]);
    expect(p.expire).toEqual([]);
  });

  it('announcedSnapshot_isDeletedOnlyWhenItsDueTimeHasPassed', () => {
    const snaps = [snap('s1', 1, { keepLast: 1, expiryDueAt: 20 * MIN }), snap('s2', 2, { keepLast: 1 })];
    expect(planRetention(snaps, [], 19 * MIN, NOTICE).expire).toEqual([]);
    expect(ids(planRetention(snaps, [], 20 * MIN, NOTICE).expire)).toEqual(['s1']);
  });

  it('ttl_isAnnouncedNoticeBeforeAndDeletedAtTheTtl', () => {
    const s = snap('s1', 0, { retentionTtlMs: 60 * MIN });
    expect(planRetention([s], [], 54 * MIN, NOTICE).announce).toEqual([]);
    expect(planRetention([s], [], 55 * MIN, NOTICE).announce.map((a) => a.dueAt)).toEqual([60 * MIN]);
    const announced = { ...s, expiryDueAt: 60 * MIN };
    expect(planRetention([announced], [], 59 * MIN, NOTICE).expire).toEqual([]);
    expect(ids(planRetention([announced], [], 60 * MIN, NOTICE).expire)).toEqual(['s1']);
  });

  it('pinnedSnapshot_neverExpiresAndItsAnnouncementIsWithdrawn', () => {
    const snaps = [snap('s1', 1, { keepLast: 1, pinned: true, expiryDueAt: 5 * MIN }), snap('s2', 2, { keepLast: 1 })];
    const p = planRetention(snaps, [], 100 * MIN, NOTICE);
    expect(p.expire).toEqual([]);
    expect(p.announce).toEqual([]);
    expect(ids(p.withdraw)).toEqual(['s1']);
  });

  it('snapshotARunningForkIsAboutToPlaceFrom_isHeldLikeOneASandboxUses', () => {
    // Fork A's snapshot s1 is ready, fork B's newer s2 pushes it out of keep_last 1, and A has
    // not placed its children yet: no child record names s1.
    const snaps = [snap('s1', 1, { keepLast: 1, expiryDueAt: 5 * MIN }), snap('s2', 2, { keepLast: 1 })];
    const p = planRetention(snaps, [], 100 * MIN, NOTICE, new Map([['s1', ['op-fork-a']]]));
    expect(p.expire).toEqual([]);
    expect(p.announce).toEqual([]);
    expect(p.held.get('s1')).toEqual(['op-fork-a']);
    expect(ids(planRetention(snaps, [], 100 * MIN, NOTICE).expire)).toEqual(['s1']);
  });

  it('snapshotALiveSandboxUses_isHeldUntilTheSandboxIsGone', () => {
    const snaps = [snap('s1', 1, { keepLast: 1, expiryDueAt: 5 * MIN }), snap('s2', 2, { keepLast: 1 })];
    const child = sandbox('sb-child', { sourceSnapshotId: 's1' });
    const p = planRetention(snaps, [child], 100 * MIN, NOTICE);
    expect(p.expire).toEqual([]);
    expect(p.held.get('s1')).toEqual(['sb-child']);
    expect(ids(planRetention(snaps, [{ ...child, state: 'destroyed' }], 100 * MIN, NOTICE).expire)).toEqual(['s1']);
    const hib = sandbox('sb-h', { state: 'hibernated', hibernationSnapshotId: 's1' });
    expect(planRetention(snaps, [hib], 100 * MIN, NOTICE).expire).toEqual([]);
  });

  it('snapshotInUse_isNotAnnouncedUntilItIsFree', () => {
    const snaps = [snap('s1', 1, { keepLast: 1 }), snap('s2', 2, { keepLast: 1 })];
    const child = sandbox('sb-child', { sourceSnapshotId: 's1' });
    expect(planRetention(snaps, [child], 100 * MIN, NOTICE).announce).toEqual([]);
    expect(planRetention(snaps, [{ ...child, state: 'destroyed' }], 100 * MIN, NOTICE).announce.map((x) => x.snapshot.id)).toEqual(['s1']);
  });

  it('announcedSnapshot_thatComesIntoUse_hasItsAnnouncementWithdrawn_soWhenFreeItGetsAFullNoticeAgain', () => {
    const snaps = [snap('s1', 1, { keepLast: 1, expiryDueAt: 20 * MIN }), snap('s2', 2, { keepLast: 1 })];
    const child = sandbox('sb-child', { sourceSnapshotId: 's1' });
    expect(ids(planRetention(snaps, [child], 16 * MIN, NOTICE).withdraw)).toEqual(['s1']);
    // Withdrawn, then free weeks later: announced anew, not deleted at once.
    const freed = planRetention([{ ...snaps[0]!, expiryDueAt: null }, snaps[1]!], [{ ...child, state: 'destroyed' }], 30 * 24 * 60 * MIN, NOTICE);
    expect(freed.expire).toEqual([]);
    expect(freed.announce.map((a) => [a.snapshot.id, a.dueAt])).toEqual([['s1', 30 * 24 * 60 * MIN + NOTICE]]);
  });

  it('announcedSnapshot_thatComesIntoUse_tellsTheWithdrawalByAnEvent_andIsAnnouncedAgainOnceFree', () => {
    // The eval-farm case: a TTL 2 s snapshot, announced; a fork's child restores from it; the
    // child is destroyed. Each pass's plan applied as the leader applies it (reconcileRetention).
    const S = 1_000;
    let sn = snap('s1', 0, { retentionTtlMs: 2 * S });
    const child = sandbox('sb-child', { sourceSnapshotId: 's1' });
    const seen: string[] = [];
    const pass = (sandboxes: SandboxRec[], now: number) => {
      const p = planRetention([sn], sandboxes, now, NOTICE);
      const next = p.announce[0] ? { ...sn, expiryDueAt: p.announce[0].dueAt } : p.withdraw[0] ? { ...sn, expiryDueAt: null } : sn;
      seen.push(...eventsOf({ kind: 'snapshot', prev: sn, value: next, revision: 1 }, now).map((e) => e.type));
      sn = next;
    };
    pass([], 1 * S);
    pass([child], 4 * S);
    pass([child], 6 * S);
    pass([{ ...child, state: 'destroyed' }], 8 * S);
    expect(seen).toEqual(['snapshot_expiring', 'snapshot_expiry_withdrawn', 'snapshot_expiring']);
    expect(sn.expiryDueAt).toBe(8 * S + NOTICE);
  });

  it('ttlSnapshotFreedAfterItsTtl_getsTheFullNoticeFromWhenItIsFree', () => {
    // Its TTL (60 min) passed while a sandbox restored from it; it is free at 100 min.
    const s = snap('s1', 0, { retentionTtlMs: 60 * MIN });
    const child = sandbox('sb-child', { sourceSnapshotId: 's1' });
    expect(planRetention([s], [child], 100 * MIN, NOTICE).announce).toEqual([]);
    expect(planRetention([s], [{ ...child, state: 'destroyed' }], 100 * MIN, NOTICE).announce.map((a) => a.dueAt)).toEqual([100 * MIN + NOTICE]);
  });

  it('lineagesAndTenants_areCountedSeparately', () => {
    const snaps = [snap('a1', 1, { keepLast: 1 }), snap('b1', 2, { keepLast: 1, lineageId: 'sb-b' }), snap('c1', 3, { keepLast: 1, tenantId: 't2' })];
    expect(planRetention(snaps, [], 10 * MIN, NOTICE).announce).toEqual([]);
  });

  it('keepLast_countsOnlySnapshotsOfItsKindWithAKeepLastRule_soHibernationForkAndUnruledSnapshotsNeverPushAUsersOneOut', () => {
    const hib = { [HIBERNATION_LABEL]: 'sb-1' };
    const snaps = [
      snap('u1', 1, { keepLast: 2 }),
      snap('u2', 2, { keepLast: 2 }),
      // What the system took since, in the same lineage: a hibernation, a fork's snapshot of
      // the live sandbox (a TTL), a migration's; and a user snapshot without keep_last.
      snap('h1', 3, { keepLast: 1, labels: hib }),
      snap('f1', 4, { retentionTtlMs: 24 * 60 * MIN }),
      snap('m1', 5, { retentionTtlMs: 24 * 60 * MIN, labels: { 'forkfleet.io/purpose': 'migration' } }),
      snap('n1', 6),
    ];
    const sbs = [sandbox('sb-1', { state: 'hibernated', hibernationSnapshotId: 'h1' })];
    expect(planRetention(snaps, sbs, 10 * MIN, NOTICE).announce).toEqual([]);
    // A third user snapshot with keep_last 2 does push the oldest out; a second hibernation pushes the first.
    const more = [...snaps, snap('u3', 7, { keepLast: 2 }), snap('h2', 8, { keepLast: 1, labels: hib })];
    const woke = [sandbox('sb-1', { state: 'hibernated', hibernationSnapshotId: 'h2' })];
    expect(planRetention(more, woke, 10 * MIN, NOTICE).announce.map((a) => a.snapshot.id).sort()).toEqual(['h1', 'u1']);
  });

  it('forkSnapshotsWithKeepLast_countOnlyAgainstEachOther_soTheyNeverPushAUsersSnapshotOut', () => {
    const fork = { [PURPOSE_LABEL]: 'fork' };
    const snaps = [
      snap('u1', 1, { keepLast: 3 }),
      snap('u2', 2, { keepLast: 3 }),
      snap('u3', 3, { keepLast: 3 }),
      // Forks of the live sandbox since, capped with snapshot_retention { keep_last: 3 }.
      ...[4, 5, 6, 7].map((m) => snap(`f${m}`, m, { keepLast: 3, labels: fork })),
    ];
    // The oldest fork snapshot goes; every user snapshot stays.
    expect(planRetention(snaps, [], 10 * MIN, NOTICE).announce.map((a) => a.snapshot.id)).toEqual(['f4']);
  });

  it('hibernationSnapshot_ofASandboxThatIsGone_expiresWithFullNotice_whileOneOfALiveSandboxIsKept', () => {
    const snaps = [snap('h1', 1, { keepLast: 1, labels: { [HIBERNATION_LABEL]: 'sb-gone' } }), snap('h2', 1, { keepLast: 1, labels: { [HIBERNATION_LABEL]: 'sb-here' } })];
    const sbs = [sandbox('sb-gone', { state: 'destroyed', hibernationSnapshotId: 'h1' }), sandbox('sb-here', { state: 'running', hibernationSnapshotId: '' })];
    const p = planRetention(snaps, sbs, 10 * MIN, NOTICE);
    expect(p.announce.map((a) => [a.snapshot.id, a.dueAt])).toEqual([['h1', 10 * MIN + NOTICE]]);
    // Its record expired from the history too: the same.
    expect(planRetention(snaps, [sbs[1]!], 10 * MIN, NOTICE).announce.map((a) => a.snapshot.id)).toEqual(['h1']);
  });

  it('anyFleet_neverDeletesPinnedUsedOrNewestKeepLast', () => {
    const rec = fc.record({
      lineage: fc.constantFrom('l1', 'l2'),
      created: fc.integer({ min: 0, max: 1000 }),
      pinned: fc.boolean(),
      keepLast: fc.integer({ min: 0, max: 4 }),
      ttlMin: fc.option(fc.integer({ min: 1, max: 600 }), { nil: null }),
      announcedAtMin: fc.option(fc.integer({ min: 0, max: 1200 }), { nil: null }),
      used: fc.boolean(),
    });
    fc.assert(
      fc.property(fc.array(rec, { maxLength: 25 }), fc.integer({ min: 0, max: 1200 }), (rs, nowMin) => {
        const snaps = rs.map((r, i) =>
          snap(`s${i}`, r.created, { lineageId: r.lineage, pinned: r.pinned, keepLast: r.keepLast, retentionTtlMs: r.ttlMin === null ? null : r.ttlMin * MIN, expiryDueAt: r.announcedAtMin === null ? null : r.announcedAtMin * MIN }),
        );
        const sbs = rs.flatMap((r, i) => (r.used ? [sandbox(`sb${i}`, { sourceSnapshotId: `s${i}` })] : []));
        const p = planRetention(snaps, sbs, nowMin * MIN, NOTICE);
        for (const sn of p.expire) {
          const r = rs[Number(sn.id.slice(1))]!;
          expect(r.pinned).toBe(false);
          expect(r.used).toBe(false);
          // Only an announcement whose time has come leads to a deletion.
          expect(sn.expiryDueAt).not.toBeNull();
          expect(sn.expiryDueAt!).toBeLessThanOrEqual(nowMin * MIN);
          // Nothing without a TTL is deleted from inside its keep-last window.
          if (r.ttlMin === null) {
            const newer = snaps.filter((o) => o.lineageId === sn.lineageId && !o.pinned && (o.createdAt > sn.createdAt || (o.createdAt === sn.createdAt && o.id < sn.id)));
            expect(r.keepLast).toBeGreaterThan(0);
            expect(newer.length).toBeGreaterThanOrEqual(r.keepLast);
          }
        }
        for (const a of p.announce) expect(a.dueAt).toBeGreaterThanOrEqual(nowMin * MIN);
      }),
      { numRuns: 500 },
    );
  });
});
