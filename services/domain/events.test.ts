import { describe, expect, it } from 'vitest';
import { eventsOf } from './events.ts';
import type { RecordChange } from './ports.ts';
import type { OperationRec, SandboxRec, SnapshotRec } from './records.ts';
import { snapshotRecord } from '../testkit/records.ts';

const sb = (over: Partial<SandboxRec>): SandboxRec => ({ id: 'sb-1', tenantId: 't', state: 'running', stateReason: '', hostId: 'h1', sourceSnapshotId: '', ...over }) as SandboxRec;
const types = (ch: RecordChange) => eventsOf(ch, 0).map((e) => e.type);

describe('eventsOf', () => {
  it('sandboxTransitions_giveOneEventEach_andRewritesWithoutStateChangeGiveNone', () => {
    expect(types({ kind: 'sandbox', value: sb({ state: 'pending' }), revision: 1 })).toEqual(['sandbox_created']);
    expect(types({ kind: 'sandbox', prev: sb({ state: 'hibernating' }), value: sb({ state: 'hibernated' }), revision: 2 })).toEqual(['sandbox_hibernated']);
    expect(types({ kind: 'sandbox', prev: sb({ state: 'waking' }), value: sb({ state: 'running' }), revision: 3 })).toEqual(['sandbox_woken']);
    expect(types({ kind: 'sandbox', prev: sb({ state: 'starting', sourceSnapshotId: 'sn-1' }), value: sb({ state: 'running', sourceSnapshotId: 'sn-1' }), revision: 4 })).toEqual(['sandbox_restored']);
    expect(types({ kind: 'sandbox', prev: sb({ state: 'starting' }), value: sb({ state: 'running' }), revision: 5 })).toEqual(['sandbox_state_changed']);
    expect(types({ kind: 'sandbox', prev: sb({ state: 'destroying' }), value: sb({ state: 'destroyed' }), revision: 6 })).toEqual(['sandbox_destroyed']);
    expect(types({ kind: 'sandbox', prev: sb({}), value: sb({ hostId: 'h2' }), revision: 7 })).toEqual([]);
  });

  it('eventTime_isWhenTheRecordChanged_soAReplayedEventKeepsIt_elseNow', () => {
    const at = (ch: RecordChange) => eventsOf(ch, 9_000).map((e) => e.time);
    expect(at({ kind: 'sandbox', prev: sb({ state: 'running' }), value: sb({ state: 'paused', updatedAt: 1_234 }), revision: 8 })).toEqual([1_234]);
    expect(at({ kind: 'op', prev: { id: 'op-1', tenantId: 't', state: 'running', targetId: 'sb-1', error: null, updatedAt: 1_000 } as OperationRec, value: { id: 'op-1', tenantId: 't', state: 'failed', targetId: 'sb-1', error: null, updatedAt: 2_000 } as OperationRec, revision: 9 })).toEqual([2_000]);
    // A record without a time of change (as a snapshot's): the time it was seen.
    expect(at({ kind: 'sandbox', value: sb({ state: 'pending' }), revision: 10 })).toEqual([9_000]);
  });

  it('operationDone_isEmittedOnceAtTheTerminalTransition', () => {
    const op = (state: OperationRec['state']) => ({ id: 'op-1', tenantId: 't', state, targetId: 'sb-1', error: null }) as OperationRec;
    expect(types({ kind: 'op', prev: op('running'), value: op('succeeded'), revision: 1 })).toEqual(['operation_done']);
    expect(types({ kind: 'op', prev: op('succeeded'), value: op('succeeded'), revision: 2 })).toEqual([]);
    expect(types({ kind: 'op', prev: op('pending'), value: op('running'), revision: 3 })).toEqual([]);
  });

  it('operationDone_ofAForkOfAHibernatedSandbox_namesTheSandboxTheCallerForked_andItsSnapshot', () => {
    const op = (state: OperationRec['state']) => ({ id: 'op-1', tenantId: 't', kind: 'fork', state, targetId: 'sn-hib', input: { snapshotId: 'sn-hib', hibernatedSandboxId: 'sb-1' }, error: null }) as unknown as OperationRec;
    expect(eventsOf({ kind: 'op', prev: op('running'), value: op('succeeded'), revision: 1 }, 0)).toEqual([expect.objectContaining({ type: 'operation_done', sandboxId: 'sb-1', snapshotId: 'sn-hib' })]);
  });

  it('snapshotExpiryWithdrawn_whenAnAnnouncedExpiryIsCleared_onlyThen', () => {
    const announced = snapshotRecord({ keepLast: 1, expiryDueAt: 60_000 });
    expect(types({ kind: 'snapshot', prev: announced, value: { ...announced, expiryDueAt: null }, revision: 1 })).toEqual(['snapshot_expiry_withdrawn']);
    // Never announced (a retention set without one): nothing to withdraw.
    expect(types({ kind: 'snapshot', prev: snapshotRecord({}), value: snapshotRecord({ expiryDueAt: null }), revision: 2 })).toEqual([]);
    // Deleted as announced: snapshot_expired says so, not a withdrawal.
    expect(types({ kind: 'snapshot', prev: { ...announced, state: 'deleting' }, value: { ...announced, state: 'deleted', deletedReason: 'expired' }, revision: 3 })).toEqual(['snapshot_expired']);
    const withdrawn = (value: SnapshotRec) => eventsOf({ kind: 'snapshot', prev: announced, value, revision: 4 }, 0)[0]?.message;
    expect(withdrawn({ ...announced, pinned: true, expiryDueAt: null })).toBe('expiry at 1970-01-01T00:01:00.000Z withdrawn: pinned');
    expect(withdrawn({ ...announced, keepLast: 3, expiryDueAt: null })).toMatch(/withdrawn: retention changed$/);
    expect(withdrawn({ ...announced, expiryDueAt: null })).toMatch(/withdrawn: in use by a sandbox, or back inside its keep_last window$/);
  });

  it('snapshotEventTime_isTheTimeTheRecordKeepsOfWhatItReports_soAReplayKeepsIt_elseWhenSeen', () => {
    const at = (prev: SnapshotRec, value: SnapshotRec) => eventsOf({ kind: 'snapshot', prev, value, revision: 1 }, 9_000).map((e) => [e.type, e.time]);
    expect(at(snapshotRecord({ state: 'creating', createdAt: 1_000 }), snapshotRecord({ createdAt: 1_000 }))).toEqual([['snapshot_created', 1_000]]);
    expect(at(snapshotRecord({ state: 'deleting', deletedReason: 'expired' }), snapshotRecord({ state: 'deleted', deletedReason: 'expired', endedAt: 5_000 }))).toEqual([['snapshot_expired', 5_000]]);
    // Written before endedAt: when seen.
    expect(at(snapshotRecord({ state: 'deleting' }), snapshotRecord({ state: 'deleted', deletedReason: 'expired' }))).toEqual([['snapshot_expired', 9_000]]);
    // The record keeps the deletion's time, not the announcement's: when seen.
    expect(at(snapshotRecord({ createdAt: 1_000 }), snapshotRecord({ createdAt: 1_000, expiryDueAt: 8_000 }))).toEqual([['snapshot_expiring', 9_000]]);
  });

  it('snapshotCreated_onceWhenItBecomesReady_notWhenARefusedDeletePutsItBack', () => {
    expect(types({ kind: 'snapshot', prev: snapshotRecord({ state: 'creating' }), value: snapshotRecord({ state: 'ready' }), revision: 1 })).toEqual(['snapshot_created']);
    expect(types({ kind: 'snapshot', prev: snapshotRecord({ state: 'ready' }), value: snapshotRecord({ state: 'deleting', deletingFrom: 'ready' }), revision: 2 })).toEqual([]);
    expect(types({ kind: 'snapshot', prev: snapshotRecord({ state: 'deleting', deletingFrom: 'ready' }), value: snapshotRecord({ state: 'ready' }), revision: 3 })).toEqual([]);
  });
});
