import { describe, expect, it } from 'vitest';
import { commitPurge, Compactor, expiredRecords, finishedOpOf } from './history.ts';
import type { StoreWrite, Versioned } from './ports.ts';
import type { OperationRec, SandboxRec, SandboxState, SnapshotRec, SnapshotState } from './records.ts';

const H = 3_600_000;
const NOW = 100 * H;

function sb(id: string, state: SandboxState, updatedAt: number, rev = 7): Versioned<SandboxRec> {
  return { value: { id, tenantId: 't1', state, updatedAt } as SandboxRec, modRevision: rev };
}

function op(id: string, state: OperationRec['state'], updatedAt: number, idempotencyKey?: string): Versioned<OperationRec> {
  return { value: { id, tenantId: 't1', state, updatedAt, ...(idempotencyKey ? { idempotencyKey } : {}) } as OperationRec, modRevision: 9 };
}

function sn(id: string, state: SnapshotState, endedAt: number | undefined, createdAt = 0, rev = 5): Versioned<SnapshotRec> {
  return { value: { id, tenantId: 't1', state, createdAt, ...(endedAt === undefined ? {} : { endedAt }) } as SnapshotRec, modRevision: rev };
}

describe('expiredRecords', () => {
  it('expiredRecords_ofDeletedAndFailedSnapshotsPastRetention_deletesTheirRecordsGuardedByRevision', () => {
    const plan = expiredRecords({ snapshots: [sn('d', 'deleted', NOW - 2 * H, 0, 21), sn('f', 'failed', NOW - 2 * H, 0, 22)] }, NOW, H);
    expect(plan.writes).toEqual([
      [{ kind: 'delete-snapshot', tenantId: 't1', id: 'd', expectRevision: 21 }],
      [{ kind: 'delete-snapshot', tenantId: 't1', id: 'f', expectRevision: 22 }],
    ]);
    expect(plan.snapshots).toBe(2);
  });

  it('expiredRecords_keepsLiveAndRecentlyDeletedSnapshots_andAgesOldRecordsWithoutEndedAtByCreation', () => {
    const live = (['creating', 'ready', 'deleting'] as const).map((s, i) => sn(`l${i}`, s, 0));
    // Deleted a moment ago, though created long ago: kept for the retention.
    const recent = sn('r', 'deleted', NOW - H + 1, 0);
    // A record from before endedAt existed: its creation time stands in.
    const legacyOld = sn('o', 'deleted', undefined, NOW - 2 * H);
    const legacyNew = sn('n', 'deleted', undefined, NOW - 1);
    expect(expiredRecords({ snapshots: [...live, recent, legacyOld, legacyNew] }, NOW, H).writes).toEqual([[{ kind: 'delete-snapshot', tenantId: 't1', id: 'o', expectRevision: 5 }]]);
  });

  it('expiredRecords_ofDestroyedAndFailedSandboxesPastRetention_deletesThemGuardedByTheirRevision', () => {
    const plan = expiredRecords({ sandboxes: [sb('a', 'destroyed', NOW - 2 * H, 11), sb('b', 'failed', NOW - 2 * H, 12)] }, NOW, H);
    expect(plan.writes).toEqual([
      [{ kind: 'delete-sandbox', tenantId: 't1', id: 'a', expectRevision: 11 }],
      [{ kind: 'delete-sandbox', tenantId: 't1', id: 'b', expectRevision: 12 }],
    ]);
    expect(plan.sandboxes).toBe(2);
  });

  it('expiredRecords_keepsLiveLostAndRecentlyDestroyedSandboxes', () => {
    const states: SandboxState[] = ['pending', 'starting', 'running', 'paused', 'hibernating', 'hibernated', 'waking', 'destroying', 'lost'];
    const old = states.map((s, i) => sb(`x${i}`, s, 0));
    const recent = sb('r', 'destroyed', NOW - H + 1);
    expect(expiredRecords({ sandboxes: [...old, recent] }, NOW, H).writes).toEqual([]);
  });

  it('expiredRecords_ofAFinishedOpPastRetention_deletesItWithItsIdempotencyKey', () => {
    const f = finishedOpOf(op('op-1', 'succeeded', NOW - 2 * H, 'key-1'))!;
    expect(expiredRecords({ ops: [f] }, NOW, H).writes).toEqual([
      [
        { kind: 'delete-op', tenantId: 't1', id: 'op-1', expectRevision: 9 },
        { kind: 'delete-idem', tenantId: 't1', key: 'key-1' },
      ],
    ]);
  });

  it('finishedOpOf_anUnfinishedOp_isUndefined', () => {
    expect(finishedOpOf(op('op-1', 'running', 0))).toBeUndefined();
    expect(finishedOpOf(op('op-2', 'pending', 0))).toBeUndefined();
    expect(finishedOpOf(op('op-3', 'failed', 0))?.id).toBe('op-3');
  });

  it('expiredRecords_withAMaximum_stopsThere', () => {
    const many = Array.from({ length: 10 }, (_, i) => sb(`s${i}`, 'destroyed', 0));
    const ops = Array.from({ length: 10 }, (_, i) => finishedOpOf(op(`o${i}`, 'succeeded', 0, `k${i}`))!);
    const snaps = Array.from({ length: 10 }, (_, i) => sn(`n${i}`, 'deleted', 0));
    const plan = expiredRecords({ sandboxes: many, ops, snapshots: snaps }, NOW, H, 12);
    expect(plan.sandboxes + plan.ops + plan.snapshots).toBe(12);
    expect(plan.writes).toHaveLength(12);
  });
});

describe('commitPurge', () => {
  it('commitPurge_whenOneGuardFailsInABatch_stillDeletesEveryOtherRecord', async () => {
    const gone = new Set<string>();
    const changed = 'c';
    // A store of our own port: a batch commits only if every guarded record is unchanged.
    const store = {
      commit: async (writes: readonly StoreWrite[]) => {
        const ids = writes.map((w) => (w.kind === 'delete-sandbox' ? w.id : ''));
        if (ids.includes(changed)) return false;
        for (const id of ids) gone.add(id);
        return true;
      },
    };
    const groups = ['a', 'b', changed, 'd'].map((id) => [{ kind: 'delete-sandbox', tenantId: 't1', id, expectRevision: 1 } as StoreWrite]);
    expect(await commitPurge(store, groups)).toBe(3);
    expect([...gone].sort()).toEqual(['a', 'b', 'd']);
  });

  it('commitPurge_ofManyRecords_usesTransactionsOfAtMost50Writes', async () => {
    const sizes: number[] = [];
    const store = {
      commit: async (writes: readonly StoreWrite[]) => {
        sizes.push(writes.length);
        return true;
      },
    };
    const groups = Array.from({ length: 120 }, (_, i) => [{ kind: 'delete-op', tenantId: 't', id: `o${i}` } as StoreWrite, { kind: 'delete-idem', tenantId: 't', key: `k${i}` } as StoreWrite]);
    expect(await commitPurge(store, groups)).toBe(120);
    expect(Math.max(...sizes)).toBeLessThanOrEqual(50);
    expect(sizes.reduce((a, b) => a + b, 0)).toBe(240);
  });
});

describe('Compactor', () => {
  function fakeStore(revisions: number[]) {
    const compacted: number[] = [];
    return {
      compacted,
      store: {
        revision: async () => revisions.shift() ?? 0,
        compact: async (r: number) => void compacted.push(r),
      },
    };
  }

  it('tick_compactsToTheRevisionReadOneIntervalEarlier', async () => {
    const f = fakeStore([100, 250, 400]);
    const c = new Compactor({ store: f.store }, 0);
    expect(await c.tick()).toBe(0); // first tick only reads
    expect(await c.tick()).toBe(100);
    expect(await c.tick()).toBe(250);
    expect(f.compacted).toEqual([100, 250]);
  });

  it('tick_neverCompactsPastTheFloor', async () => {
    const f = fakeStore([100, 250]);
    const c = new Compactor({ store: f.store, floor: async () => 42 }, 0);
    await c.tick();
    expect(await c.tick()).toBe(42);
    expect(f.compacted).toEqual([42]);
  });

  it('tick_withAFloorThatEtcdCompactedPastAlready_compactsToTheTarget', async () => {
    // The webhook cursor says 51, but etcd was compacted to 100 by someone else (its own
    // auto-compaction, an operator, a leader without webhooks): compact(51) reports success
    // and does nothing, so holding to that floor would stop compaction for good.
    const f = fakeStore([500, 600]);
    const c = new Compactor({ store: f.store, floor: async () => 51, compactedPast: async (r) => r < 100 }, 0);
    await c.tick();
    expect(await c.tick()).toBe(500);
    expect(f.compacted).toEqual([500]);
  });

  it('tick_withAFloorStillReadable_holdsToIt', async () => {
    const f = fakeStore([500, 600]);
    const c = new Compactor({ store: f.store, floor: async () => 100, compactedPast: async (r) => r < 100 }, 0);
    await c.tick();
    expect(await c.tick()).toBe(100);
  });

  it('tick_whenTheStoreFails_reportsTheErrorAndCompactsNothing', async () => {
    const errors: unknown[] = [];
    const c = new Compactor({ store: { revision: async () => 5, compact: async () => Promise.reject(new Error('etcd down')) }, onError: (e) => errors.push(e) }, 0);
    await c.tick();
    expect(await c.tick()).toBe(0);
    expect(errors).toHaveLength(1);
  });
});
