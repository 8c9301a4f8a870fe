// The leader's lifecycle rules (Executor.reconcileLifecycles) against a submit of our own
// that records what the rules start. The store is a stub of our port: the rules get the
// sandboxes handed in, and every store method answers at once with nothing.
import { describe, expect, it } from 'vitest';
import pino from 'pino';
import { Executor, LIFECYCLE_RETRY_MS } from './executor.ts';
import type { ExecutorDeps } from './executor.ts';
import { Fleet } from './fleet.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import type { LeaderFence, StoreWrite } from './ports.ts';
import { leaderExecutor } from '../testkit/executor.ts';
import type { OperationRec, SandboxRec } from './records.ts';
import { sandboxRecord, snapshotRecord } from '../testkit/records.ts';

/** A port stub: the named methods, and for every other one an async function answering []. */
function stub<T>(methods: Record<string, unknown>): T {
  return new Proxy(methods, { get: (target, key) => (key in target ? target[key as string] : key === 'then' ? undefined : async () => []) }) as T;
}

/** An executor whose submit keeps one operation per key, in the state `ends(key)` gives it. */
function rules(ends: (key: string) => OperationRec['state'], heard = new HeartbeatRegistry(), store: Record<string, unknown> = {}): { ex: Executor; started: string[]; clock: { t: number } } {
  const ops = new Map<string, OperationRec>();
  const started: string[] = [];
  const clock = { t: 1_000_000 };
  const submit: NonNullable<ExecutorDeps['submit']> = async (tenantId, key, kind, targetId, input) => {
    let op = ops.get(key);
    if (!op) {
      started.push(key);
      op = { id: `op-${ops.size}`, tenantId, kind, state: ends(key), createdAt: clock.t, updatedAt: clock.t, targetId, input, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {}, idempotencyKey: key };
      ops.set(key, op);
    }
    return op;
  };
  const ex = new Executor({
    store: stub(store),
    bus: stub({}),
    clock: { now: () => clock.t },
    log: pino({ level: 'silent' }),
    heard,
    signer: stub({}),
    config: { liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 }, stepTimeoutMs: 1000, stepAttempts: 1, chunkBytes: 1 << 18 },
    submit,
  });
  // As a leader's (start() sets it): a stopped executor writes nothing.
  (ex as unknown as { active: boolean }).active = true;
  return { ex, started, clock };
}

const pass = (ex: Executor, sb: SandboxRec): Promise<void> => ex.reconcileLifecycles([{ value: sb, modRevision: 1 }]);

describe('Lifecycle rules', () => {
  it('ttlDestroyThatFailedBeforeTakingTheSandbox_isStartedAgainOncePerRetryPeriod_notBlockedUntilItsRecordExpires', async () => {
    // Every destroy fails before it takes the sandbox (a store outage, say): it stays running.
    const { ex, started, clock } = rules(() => 'failed');
    const sb = sandboxRecord({ ttlMs: 5000, runningSince: clock.t - 6000 });
    await pass(ex, sb);
    expect(started).toEqual([`__ttl/sb-a`, `__ttl/sb-a/retry/${Math.floor(clock.t / LIFECYCLE_RETRY_MS)}`]);
    // Passes within the same period start nothing more.
    clock.t += 2000;
    await pass(ex, sb);
    expect(started).toHaveLength(2);
    // The next period, one more.
    clock.t += LIFECYCLE_RETRY_MS;
    await pass(ex, sb);
    expect(started).toHaveLength(3);
    expect(started[2]).toBe(`__ttl/sb-a/retry/${Math.floor(clock.t / LIFECYCLE_RETRY_MS)}`);
  });

  it('aRulePassOfAnExecutorThatStoppedLeading_submitsNothing_andSaysItIsNotTheLeader', async () => {
    // A pass that outlived its term (stop() while it waited on the store) decided from an old
    // view: the rule's submit is refused, not made.
    const { ex, started, clock } = rules(() => 'pending');
    (ex as unknown as { active: boolean }).active = false;
    await expect(pass(ex, sandboxRecord({ ttlMs: 5000, runningSince: clock.t - 6000 }))).rejects.toMatchObject({ name: 'NotLeaderError' });
    expect(started).toEqual([]);
  });

  it('aRulesOperation_isWrittenUnderTheLeadersFence_soALeaseLostWhileItsKeyIsReadWritesNothing', async () => {
    // Wired as the scheduler wires it: the executor's submit is Fleet.submit. The store applies
    // the fence (etcd: the election key's create revision must still be this one).
    const fence: LeaderFence = { key: 'election/leader/1', createRevision: 7 };
    const written: Array<{ fence: LeaderFence | undefined; kinds: string[] }> = [];
    const store = stub<ExecutorDeps['store']>({
      getIdempotent: async () => undefined,
      commit: async (w: StoreWrite[]) => (written.push({ fence: undefined, kinds: w.map((x) => x.kind) }), true),
      commitAt: async (w: StoreWrite[], f?: LeaderFence) => (written.push({ fence: f, kinds: w.map((x) => x.kind) }), 9),
    });
    const fleet = new Fleet({ store, bus: stub({}), clock: { now: () => 1_000_000 }, heard: new HeartbeatRegistry(), liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 } });
    const ex = leaderExecutor({}, {
      store,
      fence: () => fence,
      submit: (tenantId, key, kind, targetId, input, f) => fleet.submit(tenantId, key, kind, targetId, input, [], f ? { fence: f } : {}),
    });
    await pass(ex, sandboxRecord({ ttlMs: 5000, runningSince: 1_000_000 - 6000 }));
    expect(written).toEqual([{ fence, kinds: ['idem', 'op'] }]);
  });

  it('ttlDestroyStillRunningOrSucceeded_startsNoOther', async () => {
    for (const state of ['pending', 'running', 'succeeded'] as const) {
      const { ex, started, clock } = rules(() => state);
      const sb = sandboxRecord({ ttlMs: 5000, runningSince: clock.t - 6000 });
      await pass(ex, sb);
      clock.t += LIFECYCLE_RETRY_MS;
      await pass(ex, sb);
      expect(started).toEqual(['__ttl/sb-a']);
    }
  });

  it('idleHibernateThatFailedBeforeTakingTheSandbox_isStartedAgainNextPeriod', async () => {
    // The host reports the VM idle for a minute.
    const heard = new HeartbeatRegistry();
    heard.vm = () => ({ idle: { seconds: 60n, nanos: 0 } }) as ReturnType<HeartbeatRegistry['vm']>;
    const { ex, started, clock } = rules(() => 'failed', heard);
    const sb = sandboxRecord({ idleTimeoutMs: 5000, runningSince: clock.t - 60_000 });
    await pass(ex, sb);
    expect(started).toEqual([`__idle/sb-a/${sb.runningSince}`, `__idle/sb-a/${sb.runningSince}/retry/${Math.floor(clock.t / LIFECYCLE_RETRY_MS)}`]);
    clock.t += LIFECYCLE_RETRY_MS;
    await pass(ex, sb);
    expect(started).toHaveLength(3);
  });

  it('sandboxAFailedHibernateLeftPaused_whoseResumesFail_isResumedAgainOncePerRetryPeriod', async () => {
    // Its host's trouble outlasts a step deadline: every resume sent to it fails.
    const { ex, started, clock } = rules(() => 'failed');
    const sb = sandboxRecord({ state: 'paused', runningSince: null, resumeOwed: 'op-h' });
    await pass(ex, sb);
    expect(started).toEqual(['__resume-after-hibernate/op-h', `__resume-after-hibernate/op-h/retry/${Math.floor(clock.t / LIFECYCLE_RETRY_MS)}`]);
    clock.t += 2000;
    await pass(ex, sb);
    expect(started).toHaveLength(2);
    clock.t += LIFECYCLE_RETRY_MS;
    await pass(ex, sb);
    expect(started).toHaveLength(3);
    // One its owner paused is left paused.
    await pass(ex, sandboxRecord({ state: 'paused', runningSince: null }));
    expect(started).toHaveLength(3);
  });

  it('redestroyOfASandboxLeftDestroying_thatFailedBeforeTakingIt_isStartedAgainNextPeriod', async () => {
    // The destroy that left it destroying has ended; each destroy started for it fails at once.
    const ended = { value: { state: 'failed', input: { reason: 'ttl' } }, modRevision: 1 };
    const { ex, started, clock } = rules(() => 'failed', new HeartbeatRegistry(), { getOp: async () => ended });
    const sb = sandboxRecord({ state: 'destroying', opId: 'op-old' });
    await pass(ex, sb);
    expect(started).toEqual(['__redestroy/op-old', `__redestroy/op-old/retry/${Math.floor(clock.t / LIFECYCLE_RETRY_MS)}`]);
    await pass(ex, sb);
    expect(started).toHaveLength(2);
    clock.t += LIFECYCLE_RETRY_MS;
    await pass(ex, sb);
    expect(started).toHaveLength(3);
  });

  it('sandboxLeftStartingByAnOpThatEnded_isFailedWithWhy_andItsBookingReleased_oneMovedOnMeanwhileIsLeft', async () => {
    const ended = { value: { kind: 'create', state: 'failed', input: {} }, modRevision: 1 };
    const starting = sandboxRecord({ state: 'starting', opId: 'op-old', hostId: 'h1', resources: { vcpus: 1, memoryMib: 256, diskMib: 1024 } });
    let current = starting;
    const writes: Array<{ kind: string; value?: unknown }> = [];
    const store = {
      getOp: async () => ended,
      getSandbox: async () => ({ value: current, modRevision: 5 }),
      getAlloc: async () => ({ value: { hostId: 'h1', allocated: { vcpus: 3, memoryMib: 1024, diskMib: 4096 }, sandboxes: 3 }, modRevision: 4 }),
      commitAt: async (w: typeof writes) => (writes.push(...w), 6),
    };
    const { ex } = rules(() => 'failed', new HeartbeatRegistry(), store);
    await pass(ex, starting);
    const sbw = writes.find((w) => w.kind === 'sandbox')?.value as SandboxRec;
    expect(sbw).toMatchObject({ state: 'failed', opId: '' });
    expect(sbw.stateReason).toMatch(/its create op-old ended \(failed\) without starting it/);
    expect(writes.find((w) => w.kind === 'alloc')?.value).toMatchObject({ allocated: { vcpus: 2, memoryMib: 768, diskMib: 3072 }, sandboxes: 2 });
    // Its record moved on (running, under another op) by the time the write reads it: left as it is.
    writes.length = 0;
    current = { ...starting, state: 'running', opId: '' };
    await pass(ex, starting);
    expect(writes).toEqual([]);
  });

  it('sandboxLeftHibernatingByAnOpThatEndedBeforeItsSnapshot_getsAHibernateOfItsOwn_oneWhoseOpStillRunsIsLeft', async () => {
    let state: OperationRec['state'] = 'failed';
    const sb = sandboxRecord({ state: 'hibernating', opId: 'op-old', hibernatingTo: 'sn-x' });
    const store = { getOp: async () => ({ value: { kind: 'hibernate', state, input: { snapshotId: 'sn-x' } }, modRevision: 1 }), getSandbox: async () => ({ value: sb, modRevision: 5 }), getSnapshot: async () => ({ value: snapshotRecord({ id: 'sn-x', state: 'creating' }), modRevision: 3 }) };
    const { ex, started } = rules(() => 'running', new HeartbeatRegistry(), store);
    await pass(ex, sb);
    expect(started).toEqual(['__rehibernate/op-old']);
    state = 'running';
    const other = rules(() => 'running', new HeartbeatRegistry(), store);
    await pass(other.ex, sb);
    expect(other.started).toEqual([]);
  });

  it('sandboxLeftHibernatingByAnOpThatEndedAfterItsSnapshot_isHibernatedFromThatSnapshot_andItsBookingReleased', async () => {
    const sb = sandboxRecord({ state: 'hibernating', opId: 'op-old', hibernatingTo: 'sn-x', hibernatingFrom: 'running' });
    const writes: Array<{ kind: string; value?: unknown }> = [];
    const store = {
      getOp: async () => ({ value: { kind: 'hibernate', state: 'failed', input: { snapshotId: 'sn-x' } }, modRevision: 1 }),
      getSandbox: async () => ({ value: sb, modRevision: 5 }),
      getSnapshot: async () => ({ value: snapshotRecord({ id: 'sn-x', state: 'ready' }), modRevision: 3 }),
      getAlloc: async () => ({ value: { hostId: 'h1', allocated: { vcpus: 1, memoryMib: 256, diskMib: 1024 }, sandboxes: 1 }, modRevision: 4 }),
      commitAt: async (w: typeof writes) => (writes.push(...w), 6),
    };
    const { ex, started } = rules(() => 'running', new HeartbeatRegistry(), store);
    await pass(ex, sb);
    // Not a new hibernate: that would pause a VM the ended one stopped, and drop its snapshot.
    expect(started).toEqual([]);
    const sbw = writes.find((w) => w.kind === 'sandbox')?.value as SandboxRec;
    expect(sbw).toMatchObject({ state: 'hibernated', hibernationSnapshotId: 'sn-x', opId: '' });
    expect(sbw.hibernatingTo).toBeUndefined();
    expect(writes.find((w) => w.kind === 'alloc')?.value).toMatchObject({ allocated: { vcpus: 0, memoryMib: 0, diskMib: 0 }, sandboxes: 0 });
  });
});

describe('The TTL rule, for a sandbox that no longer runs', () => {
  const hibernated = (id: string, o: Partial<SandboxRec>) => sandboxRecord({ id, state: 'hibernated', stateReason: 'idle', ttlMs: 45_000, runningSince: null, runningMsBefore: 30_000, hostId: '', hibernationSnapshotId: `sn-${id}`, ...o });

  it('destroysOneTheSystemHibernatedLongerThanItsWholeTtlAgo_whateverItsReasonSays_andLeavesOneHibernatedLately', async () => {
    // An eval harness crashed: its children hibernated after their idle timeout and, their
    // running time no longer growing, kept a quota slot and a snapshot each for good.
    const { ex, started, clock } = rules(() => 'running');
    await pass(ex, hibernated('sb-late', { updatedAt: clock.t - 44_000 }));
    await pass(ex, hibernated('sb-old', { updatedAt: clock.t - 46_000 }));
    // Its wake failed since (no capacity) and the harness died: the reason says so now.
    await pass(ex, hibernated('sb-wake-failed', { stateReason: 'wake failed: no host can take this', updatedAt: clock.t - 46_000 }));
    expect(started).toEqual(['__ttl/sb-old', '__ttl/sb-wake-failed']);
  });

  it('leavesOneTheUserPausedOrHibernated_oneWithoutATtl_andOneForkedFromSince', async () => {
    const { ex, started, clock } = rules(() => 'running');
    const old = clock.t - 3_600_000;
    await pass(ex, hibernated('sb-user', { stateReason: '', hibernatedOnRequest: true, updatedAt: old }));
    await pass(ex, sandboxRecord({ id: 'sb-paused', state: 'paused', ttlMs: 45_000, runningSince: null, updatedAt: old }));
    await pass(ex, hibernated('sb-nottl', { ttlMs: null, updatedAt: old }));
    // A template its idle timeout hibernated, still forked from (a fork never wakes it).
    const template = hibernated('sb-tpl', { updatedAt: old });
    const child = sandboxRecord({ id: 'sb-child', sourceSnapshotId: 'sn-sb-tpl', createdAt: clock.t - 10_000 });
    await ex.reconcileLifecycles([{ value: template, modRevision: 1 }, { value: child, modRevision: 1 }]);
    expect(started).toEqual([]);
  });
});
