// Deleting what hosts still hold of failed, deleted or expired snapshots
// (Executor.reconcileHeldSnapshots): the executor over stubs of our own ports, its cache and
// live ops set as a leader's would be.
import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { HeartbeatSchema } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type { HostWorkMsg } from './messages.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import type { HostRec, OperationRec, SnapshotRec } from './records.ts';
import { leaderExecutor, stubPort } from '../testkit/executor.ts';
import { snapshotRecord } from '../testkit/records.ts';

const NOW = 1_000_000_000;
const host: HostRec = { id: 'h1', state: 'ready', cordoned: false, draining: false, capacity: { vcpus: 16, memoryMib: 16_384, diskMib: 100_000 }, accel: 'tcg', qemuVersion: '7.2.0', cpuModel: 'max', machine: 'microvm', peerAddress: '10.0.0.1:7000', linkBytesPerSecond: 1.25e8, labels: {}, registeredAt: 0, lastHeartbeatAt: NOW, bootId: 'b' };

/** One pass over host h1, which holds snapshot sn-a whose record is `rec`, with `ops` unfinished; the snapshots it was told to delete. */
function pass(rec: SnapshotRec, ops: OperationRec[] = []): string[] {
  const heard = new HeartbeatRegistry();
  heard.record(create(HeartbeatSchema, { hostId: 'h1', bootId: 'b', seq: 1n, snapshots: [{ snapshotId: rec.id, complete: true }] }), NOW);
  const deleted: string[] = [];
  const bus = stubPort({ sendWork: async (_host: string, w: HostWorkMsg) => void (w.work.case === 'deleteSnapshot' && deleted.push(w.work.value.snapshotId)) });
  const ex = leaderExecutor({}, { heard, bus: bus as never, clock: { now: () => NOW } });
  ex.cache.hosts.set('h1', { value: host, modRevision: 1 });
  ex.cache.snapshots.set(`t1/${rec.id}`, { value: rec, modRevision: 2 });
  const live = (ex as unknown as { ops: Map<string, { value: OperationRec; modRevision: number }> }).ops;
  for (const op of ops) live.set(op.id, { value: op, modRevision: 3 });
  ex.reconcileHeldSnapshots();
  return deleted;
}

const op = (kind: OperationRec['kind'], input: Record<string, unknown>): OperationRec => ({ id: `op-${kind}`, tenantId: 't1', kind, state: 'running', targetId: 'sb-a', input, createdAt: 0, updatedAt: 0, progress: { done: 0, total: 1, message: '', bytesTransferred: 0 }, result: null, error: null }) as unknown as OperationRec;
const failedLongAgo = snapshotRecord({ state: 'failed', endedAt: NOW - 3_600_000 });

describe('reconcileHeldSnapshots', () => {
  it('failedLongAgo_noOpTakesIt_isDeletedOnTheHost', () => {
    expect(pass(failedLongAgo)).toEqual(['sn-a']);
  });

  it('failedLately_isKept_forAReRunOfItsOp', () => {
    expect(pass(snapshotRecord({ state: 'failed', endedAt: NOW - 1000 }))).toEqual([]);
  });

  it('failedLongAgo_whileItsSnapshotOrHibernateOpStillRuns_isKept_soTheReRunFindsItsFiles', () => {
    expect(pass(failedLongAgo, [op('snapshot', { snapshotId: 'sn-a' })])).toEqual([]);
    expect(pass(failedLongAgo, [op('hibernate', { snapshotId: 'sn-a' })])).toEqual([]);
  });

  it('failedLongAgo_whileAForkOrDrainThatTakesItStillRuns_isKept', () => {
    expect(pass(failedLongAgo, [op('fork', { sandboxId: 'sb-a', forkSnapshotId: 'sn-a' })])).toEqual([]);
    expect(pass(failedLongAgo, [op('drain', { migrations: { 'sb-a': { snapshotId: 'sn-a' } } })])).toEqual([]);
  });

  it('failedLongAgo_whileAnotherSnapshotsOpRuns_isDeleted', () => {
    expect(pass(failedLongAgo, [op('snapshot', { snapshotId: 'sn-b' })])).toEqual(['sn-a']);
  });

  it('deleted_whileAnOpNamesIt_isDeletedOnTheHost', () => {
    expect(pass(snapshotRecord({ state: 'deleted' }), [op('snapshot', { snapshotId: 'sn-a' })])).toEqual(['sn-a']);
  });
});

describe('failOrphanedSnapshots', () => {
  /** A leader whose cache holds `rec`, with `ops` unfinished; `at` moves its clock; `failed()` the snapshots it wrote failed. */
  function leader(rec: SnapshotRec, ops: OperationRec[] = []) {
    let now = NOW;
    const written: SnapshotRec[] = [];
    const ex = leaderExecutor(
      {
        getSnapshot: async () => ({ value: rec, modRevision: 2 }),
        commitAt: async (ws: Array<{ kind: string; value: SnapshotRec }>) => {
          for (const w of ws) if (w.kind === 'snapshot') written.push(w.value);
          return 9;
        },
      },
      { clock: { now: () => now } },
    );
    ex.cache.snapshots.set(`t1/${rec.id}`, { value: rec, modRevision: 2 });
    const live = (ex as unknown as { ops: Map<string, { value: OperationRec; modRevision: number }> }).ops;
    for (const o of ops) live.set(o.id, { value: o, modRevision: 3 });
    return { ex, at: (ms: number) => void (now = NOW + ms), failed: () => written.filter((s) => s.state === 'failed').map((s) => s.id) };
  }
  const creating = snapshotRecord({ state: 'creating' });

  it('leftCreatingWithNoOpTakingIt_isMarkedFailed_onlyOnceItHasBeenSoForTheGrace', async () => {
    // The op that took it ended without finishing or failing it (a path not yet found): left
    // creating, it could neither expire nor be deleted, and its host kept its files for good.
    const l = leader(creating);
    expect(await l.ex.failOrphanedSnapshots()).toBe(0);
    l.at(4 * 60_000);
    expect(await l.ex.failOrphanedSnapshots()).toBe(0);
    l.at(5 * 60_000);
    expect(await l.ex.failOrphanedSnapshots()).toBe(1);
    expect(l.failed()).toEqual(['sn-a']);
  });

  it('creating_whileAnOpThatTakesItIsUnfinished_isLeftAlone_andItsGraceStartsAgainAfter', async () => {
    const ops = [op('fork', { sandboxId: 'sb-a', forkSnapshotId: 'sn-a' })];
    const l = leader(creating, ops);
    await l.ex.failOrphanedSnapshots();
    l.at(10 * 60_000);
    expect(await l.ex.failOrphanedSnapshots()).toBe(0);
    // Its op ended: seen orphaned from now on, not from the first pass.
    (l.ex as unknown as { ops: Map<string, unknown> }).ops.clear();
    expect(await l.ex.failOrphanedSnapshots()).toBe(0);
    l.at(14 * 60_000);
    expect(await l.ex.failOrphanedSnapshots()).toBe(0);
    l.at(15 * 60_000);
    expect(await l.ex.failOrphanedSnapshots()).toBe(1);
  });

  it('readyOrFailed_isNeverMarked', async () => {
    for (const state of ['ready', 'failed'] as const) {
      const l = leader(snapshotRecord({ state }));
      await l.ex.failOrphanedSnapshots();
      l.at(60 * 60_000);
      expect(await l.ex.failOrphanedSnapshots()).toBe(0);
    }
  });

  it('isNotMarked_whileARunnerWhoseOpRecordTheLeaderDoesNotHoldRuns_orAnOpWaitsToRunAgain', async () => {
    // run() re-reading its op through a store outage (out of `ops`), or an op whose runner
    // crashed, waiting to run again (its step log kept): either may take the snapshot.
    const l = leader(creating);
    const inner = l.ex as unknown as { running: Map<string, Promise<void>>; stepLog: Map<string, object> };
    await l.ex.failOrphanedSnapshots();
    l.at(10 * 60_000);
    inner.running.set('op-h', new Promise<void>(() => undefined));
    expect(await l.ex.failOrphanedSnapshots()).toBe(0);
    inner.running.clear();
    inner.stepLog.set('op-h', {});
    expect(await l.ex.failOrphanedSnapshots()).toBe(0);
    inner.stepLog.clear();
    expect(await l.ex.failOrphanedSnapshots()).toBe(1);
  });

  it('startsItsGraceAfresh_inALaterTermOfTheSameReplica', async () => {
    const l = leader(creating);
    await l.ex.failOrphanedSnapshots();
    await l.ex.stop();
    (l.ex as unknown as { active: boolean }).active = true;
    l.at(10 * 60_000);
    expect(await l.ex.failOrphanedSnapshots()).toBe(0);
  });
});
