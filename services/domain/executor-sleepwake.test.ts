// Hibernate, wake and destroy as they meet failures and each other (Executor.runHibernate,
// runWake, settleEndedWake, runDestroy), and a create from a snapshot, whose restore is a
// wake's (runCreate): the executor as a leader's over a stub store of our own port that keeps
// one sandbox and one op, guarded by their revisions, and stub host steps.
import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { HostResultSchema } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type { ExecutorDeps } from './executor.ts';
import type { StoreWrite, Versioned } from './ports.ts';
import type { OperationRec, SandboxRec, SnapshotRec } from './records.ts';
import { ConflictError, HostLostError, HostStepError, NoCapacityError, StepTimeoutError, StoreUnavailableError, WrongStateError } from './errors.ts';
import { leaderExecutor } from '../testkit/executor.ts';
import { sandboxRecord, snapshotRecord } from '../testkit/records.ts';

interface Internals {
  ops: Map<string, Versioned<OperationRec>>;
  running: Map<string, Promise<void>>;
  step: (op: OperationRec, stepId: string, hostId: string, work: unknown) => Promise<unknown>;
  placeAndBook: (op: OperationRec, snapshot: unknown, request: unknown, records: (res: unknown) => { writes: StoreWrite[]; opUpdate?: (o: OperationRec) => void }) => Promise<unknown>;
  fetchPlan: () => object | undefined;
  addHolder: (tenantId: string, snapshotId: string, hostId: string) => Promise<void>;
  markSnapshotFailed: (rec: SnapshotRec) => Promise<void>;
  runWake(op: OperationRec): Promise<void>;
  runCreate(op: OperationRec): Promise<void>;
  runHibernate(op: OperationRec): Promise<void>;
  runDestroy(op: OperationRec): Promise<void>;
  runPauseResume(op: OperationRec): Promise<void>;
  reconcileLifecycles(sandboxes?: ReadonlyArray<Versioned<SandboxRec>>): Promise<void>;
  settleEndedWake(sb: SandboxRec, ended: OperationRec | undefined): Promise<void>;
  sendHostWork: (hostId: string, opId: string, tenantId: string, stepId: string) => Promise<void>;
}

const opRecord = (id: string, kind: OperationRec['kind'], input: Record<string, unknown> = {}): OperationRec => ({ id, tenantId: 't1', kind, state: 'running', createdAt: 0, updatedAt: 0, targetId: 'sb-a', input, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {} });

/**
 * A leader over a store holding `sb` and `op` (each write replaces them; a write guarded by an
 * older revision is refused) and snapshot `snap`. `o.failCommit` may throw to fail a commit;
 * `o.getSandbox` replaces the sandbox read; `o.now` the clock; the first `o.failSubmits`
 * submits of the executor's own operations fail as the store's (an etcd blip).
 */
function leaderOver(sb: SandboxRec, op: OperationRec, snap?: SnapshotRec, o: { failCommit?: (w: StoreWrite[]) => void; getSandbox?: (w: World) => Versioned<SandboxRec>; now?: () => number; failSubmits?: number } = {}) {
  const w: World = { sb: structuredClone(sb), sbRev: 5, op: structuredClone(op), opRev: 5, rev: 5, allocs: [], submitted: [] };
  const store = {
    getSandbox: async () => (o.getSandbox ? o.getSandbox(w) : { value: structuredClone(w.sb), modRevision: w.sbRev }),
    getOp: async () => ({ value: structuredClone(w.op), modRevision: w.opRev }),
    getSnapshot: async () => snap && { value: snap, modRevision: 3 },
    getAlloc: async (hostId: string) => ({ value: { hostId, allocated: { vcpus: 4, memoryMib: 1024, diskMib: 4096 }, sandboxes: 2 }, modRevision: 4 }),
    getIdempotent: async () => undefined,
    commitAt: async (ws: StoreWrite[]) => {
      o.failCommit?.(ws);
      for (const x of ws) {
        if (x.kind === 'sandbox' && x.expectRevision !== w.sbRev) return 0;
        if (x.kind === 'op' && x.expectRevision !== w.opRev) return 0;
      }
      w.rev++;
      for (const x of ws) {
        if (x.kind === 'sandbox') [w.sb, w.sbRev] = [structuredClone(x.value), w.rev];
        if (x.kind === 'op') [w.op, w.opRev] = [structuredClone(x.value), w.rev];
        if (x.kind === 'alloc') w.allocs.push(x.value.hostId);
      }
      return w.rev;
    },
  };
  let failSubmits = o.failSubmits ?? 0;
  const submit: NonNullable<ExecutorDeps['submit']> = async (tenantId, key, kind, targetId) => {
    if (failSubmits-- > 0) throw new StoreUnavailableError('submit', new Error('etcd blip'));
    w.submitted.push(`${kind} ${targetId} ${key}`);
    return { id: 'op-r', tenantId, kind, state: 'pending' } as never;
  };
  const ex = leaderExecutor(store, { submit, ...(o.now ? { clock: { now: o.now } } : {}) }) as unknown as Internals;
  ex.ops.set(w.op.id, { value: structuredClone(w.op), modRevision: w.opRev });
  return { w, ex };
}

interface World {
  sb: SandboxRec;
  sbRev: number;
  op: OperationRec;
  opRev: number;
  rev: number;
  /** Hosts whose booking a write changed, in order. */
  allocs: string[];
  /** Operations of the executor's own submitted: `<kind> <target> <key>`. */
  submitted: string[];
}

describe('a wake placed off the host that holds its hibernation snapshot', () => {
  /** A wake of sb-a, hibernated on A (the only holder of sn-h), that placement puts on B. */
  const wakeOntoB = () => {
    const snap = snapshotRecord({ id: 'sn-h', tenantId: 't1', hostIds: ['A'], takenOn: 'A' });
    const { w, ex } = leaderOver(sandboxRecord({ state: 'hibernated', hostId: 'A', hibernationSnapshotId: 'sn-h', runningSince: null }), opRecord('op-w', 'wake'), snap);
    ex.placeAndBook = async (_op, _snapshot, _request, records) => {
      const r = records({ placements: [{ hostId: 'B' }], transferPlan: { transfers: [{ sourceHostId: 'A', destinationHostId: 'B' }] } });
      r.opUpdate?.(w.op);
      w.opRev = ++w.rev;
      for (const x of r.writes) if (x.kind === 'sandbox') [w.sb, w.sbRev] = [structuredClone(x.value), w.rev];
      return { result: {}, revision: w.rev };
    };
    ex.fetchPlan = () => ({ fetch: 'from A' });
    return { w, ex };
  };

  it('thatFails_leavesItHibernatedOnTheHostItWasPlacedOff_notOnOneThatLacksItsSnapshot', async () => {
    const { w, ex } = wakeOntoB();
    ex.step = async () => {
      throw new HostStepError('B', 'wake/B', 'unavailable', 'fetch from A failed', true);
    };
    await ex.runWake(w.op);
    expect(w.op.state).toBe('failed');
    // Hibernated on A, which RemoveHost(A) sees as holding it; B's booking released.
    expect(w.sb).toMatchObject({ state: 'hibernated', hostId: 'A', opId: '' });
    expect(w.allocs).toEqual(['B']);
  });

  it('thatEndedWithoutSettlingIt_isHibernatedAgainOnTheHostItWasPlacedOff', async () => {
    const { w, ex } = leaderOver(sandboxRecord({ state: 'waking', hostId: 'B', hibernationSnapshotId: 'sn-h', runningSince: null, opId: 'op-w' }), opRecord('op-x', 'destroy'));
    const ended = { ...opRecord('op-w', 'wake', { bookedHost: 'B', hostBefore: 'A', transferSource: 'A' }), state: 'failed' } as OperationRec;
    await ex.settleEndedWake(structuredClone(w.sb), ended);
    expect(w.sb).toMatchObject({ state: 'hibernated', hostId: 'A', opId: '' });
    expect(w.allocs).toEqual(['B']);
  });

  it('whoseHostCannotBeRecordedAsAHolderOfTheSnapshot_runsTheSandbox_theRecordBeingBookkeeping', async () => {
    const { w, ex } = wakeOntoB();
    ex.step = async () => create(HostResultSchema, { hostId: 'B', vms: [{ sandboxId: 'sb-a' }] });
    // The snapshot record changed under every try (20 conflicts): B is not recorded as a holder.
    ex.addHolder = async () => {
      throw new ConflictError("snapshot sn-h's holders");
    };
    await ex.runWake(w.op);
    expect(w.op.state).toBe('succeeded');
    expect(w.sb).toMatchObject({ state: 'running', hostId: 'B', opId: '' });
  });
});

describe('a wake that finds its sandbox taken by another wake', () => {
  it('eachTimeItLooks_failsRetryableUnavailable_notAnInternalError', async () => {
    let reads = 0;
    // Hibernated at each look, and taken by another wake at each claim's write.
    const { w, ex } = leaderOver(sandboxRecord({ state: 'hibernated', hibernationSnapshotId: 'sn-h', runningSince: null }), opRecord('op-w', 'wake'), undefined, {
      getSandbox: (x) => ({ value: reads++ % 2 === 0 ? structuredClone(x.sb) : { ...structuredClone(x.sb), state: 'waking', opId: 'op-other' }, modRevision: x.sbRev }),
    });
    await expect(ex.runWake(w.op)).rejects.toMatchObject({ kind: 'unavailable', retryable: true, message: expect.stringContaining('operation op-other took the sandbox first') });
    expect(reads).toBe(8);
  });
});

describe('a create from a snapshot, placed on a host that fetches it', () => {
  /** The create of sb-a from sn-a (held by A only), placed on B: its record starting there. */
  const restoreOnB = (snap = snapshotRecord({ hostIds: ['A'], takenOn: 'A' })) => {
    const { w, ex } = leaderOver(sandboxRecord({ state: 'starting', hostId: 'B', sourceSnapshotId: 'sn-a', runningSince: null, opId: 'op-c' }), opRecord('op-c', 'create'), snap);
    ex.fetchPlan = () => ({ fetch: 'from A' });
    const steps: string[] = [];
    ex.step = async (_op, id, hostId) => (steps.push(`${id}@${hostId}`), create(HostResultSchema, { hostId, vms: [{ sandboxId: 'sb-a' }] }));
    return { w, ex, steps };
  };

  it('whoseHostCannotBeRecordedAsAHolderOfTheSnapshot_runsTheSandbox_theRecordBeingBookkeeping', async () => {
    const { w, ex } = restoreOnB();
    // The snapshot record changed under every try (20 conflicts): B is not recorded as a holder.
    ex.addHolder = async () => {
      throw new ConflictError("snapshot sn-a's holders");
    };
    await ex.runCreate(w.op);
    expect(w.op.state).toBe('succeeded');
    expect(w.sb).toMatchObject({ state: 'running', hostId: 'B', opId: '' });
  });

  it('whoseSnapshotADeleteHasMarkedDeletingMeanwhile_startsTheSandbox_whichThatDeleteFindsUsingIt', async () => {
    const { w, ex, steps } = restoreOnB(snapshotRecord({ hostIds: ['A'], takenOn: 'A', state: 'deleting', deletingFrom: 'ready', deletingBy: 'op-del' }));
    ex.addHolder = async () => undefined;
    await ex.runCreate(w.op);
    expect(steps).toEqual(['create@B']);
    expect(w.op.state).toBe('succeeded');
    expect(w.sb).toMatchObject({ state: 'running', hostId: 'B', opId: '' });
  });

  it('whoseSnapshotIsDeletedOrFailed_failsTheSandbox_asNotFound', async () => {
    for (const state of ['deleted', 'failed'] as const) {
      const { w, ex, steps } = restoreOnB(snapshotRecord({ hostIds: [], state }));
      await expect(ex.runCreate(w.op), state).rejects.toMatchObject({ kind: 'not_found' });
      expect(steps, state).toEqual([]);
      expect(w.sb.state, state).toBe('failed');
    }
  });
});

describe('a create whose start fails on its host', () => {
  /** The create of sb-a from the tiny image, placed on A; placement puts it on each of `hosts` in turn; `fails(host)` answers that host's step. */
  const createOnA = (fails: (hostId: string) => Error | undefined, o: { hosts?: string[]; input?: Record<string, unknown>; sb?: Partial<SandboxRec> } = {}) => {
    const { w, ex } = leaderOver(sandboxRecord({ state: 'starting', hostId: 'A', runningSince: null, opId: 'op-c', ...o.sb }), opRecord('op-c', 'create', o.input));
    const steps: string[] = [];
    const avoided: unknown[] = [];
    const released: string[] = [];
    const stops: string[] = [];
    const hosts = [...(o.hosts ?? ['B', 'C'])];
    ex.placeAndBook = async (_op, _snapshot, request, records) => {
      avoided.push((request as () => { preferences: { avoidHostIds?: string[] } })().preferences.avoidHostIds);
      const hostId = hosts.shift();
      if (!hostId) throw new NoCapacityError('no host has room');
      const r = records({ placements: [{ hostId }], explanation: { summary: `placed on ${hostId}` } });
      r.opUpdate?.(w.op);
      w.opRev = ++w.rev;
      for (const x of r.writes) {
        if (x.kind === 'sandbox') [w.sb, w.sbRev] = [structuredClone(x.value), w.rev];
        if (x.kind === 'alloc') released.push(x.value.hostId);
      }
      return { result: {}, revision: w.rev };
    };
    ex.step = async (_op, id, hostId) => {
      steps.push(`${id}@${hostId}`);
      const e = fails(hostId);
      if (e) throw e;
      return create(HostResultSchema, { hostId, vms: [{ sandboxId: 'sb-a' }] });
    };
    ex.sendHostWork = async (hostId, _opId, _tenantId, stepId) => void stops.push(`${stepId}@${hostId}`);
    return { w, ex, steps, avoided, released, stops };
  };
  const hostFailure = (hostId: string): HostStepError => new HostStepError(hostId, 'create', 'internal', `image build failed on ${hostId}`, false);

  it('forTheHostsReasons_isPlacedOnAnotherHost_offTheFailedOne_whichIsReleasedAndToldToStopIt', async () => {
    const { w, ex, steps, avoided, released, stops } = createOnA((h) => (h === 'A' ? hostFailure(h) : undefined));
    await ex.runCreate(w.op);
    expect(steps).toEqual(['create@A', 'create/B@B']);
    expect(avoided).toEqual([['A']]);
    expect(released).toEqual(['A']);
    expect(stops).toEqual(['stop-replaced/sb-a@A']);
    expect(w.op.state).toBe('succeeded');
    expect(w.op.input).toMatchObject({ startFailedOn: ['A'] });
    expect(w.sb).toMatchObject({ state: 'running', hostId: 'B', opId: '' });
    // A counts as failing for placement (executor-failed-starts.test.ts), for creates from an
    // image only (its failure was the host's image build); B, which started it, does not.
    const failed = (ex as unknown as { failedStarts: Map<string, object> }).failedStarts;
    expect([...failed.keys()]).toEqual(['A']);
    expect(Object.keys(failed.get('A')!)).toEqual(['image']);
  });

  it('thatTimedOut_countsItsHostAsFailingEveryKindOfStart_aTimeoutSaysNothingOfWhatItWas', async () => {
    const { w, ex } = createOnA((h) => (h === 'A' ? new StepTimeoutError('A', 'create', 1000) : undefined));
    await ex.runCreate(w.op);
    const failed = (ex as unknown as { failedStarts: Map<string, object> }).failedStarts;
    expect(Object.keys(failed.get('A')!).sort()).toEqual(['image', 'restore']);
  });

  it('thatTimesOutOrWhoseHostIsLost_isPlacedOnAnotherHostToo', async () => {
    for (const e of [new StepTimeoutError('A', 'create', 1000), new HostLostError('A', 'create')]) {
      const { w, ex, steps } = createOnA((h) => (h === 'A' ? e : undefined));
      await ex.runCreate(w.op);
      expect(steps, e.name).toEqual(['create@A', 'create/B@B']);
      expect(w.sb, e.name).toMatchObject({ state: 'running', hostId: 'B' });
    }
  });

  it('forTheRequestsReasons_failsTheSandbox_withoutTryingAnotherHost', async () => {
    const { w, ex, steps, avoided } = createOnA(() => new HostStepError('A', 'create', 'invalid_argument', 'no such image', false));
    await expect(ex.runCreate(w.op)).rejects.toMatchObject({ kind: 'invalid_argument' });
    expect(steps).toEqual(['create@A']);
    expect(avoided).toEqual([]);
    expect(w.sb).toMatchObject({ state: 'failed', hostId: 'A' });
  });

  it('onEveryHostItTries_failsAfterThree_withTheLastHostsError', async () => {
    const { w, ex, steps, avoided } = createOnA((h) => hostFailure(h), { hosts: ['B', 'C', 'D'] });
    await expect(ex.runCreate(w.op)).rejects.toMatchObject({ detail: 'host C: create: image build failed on C' });
    expect(steps).toEqual(['create@A', 'create/B@B', 'create/C@C']);
    expect(avoided).toEqual([['A'], ['A', 'B']]);
    expect(w.sb).toMatchObject({ state: 'failed', hostId: 'C' });
  });

  it('thatNoOtherHostCanTake_failsWithItsHostsError_notNoCapacity', async () => {
    const { w, ex } = createOnA((h) => hostFailure(h), { hosts: [] });
    await expect(ex.runCreate(w.op)).rejects.toMatchObject({ detail: 'host A: create: image build failed on A' });
    expect(w.sb).toMatchObject({ state: 'failed', hostId: 'A' });
  });

  it('pinnedToItsHost_failsThere_withoutTryingAnother', async () => {
    const { w, ex, steps, avoided } = createOnA((h) => hostFailure(h), { input: { placement: { hostId: 'A' } } });
    await expect(ex.runCreate(w.op)).rejects.toMatchObject({ detail: 'host A: create: image build failed on A' });
    expect(steps).toEqual(['create@A']);
    expect(avoided).toEqual([]);
  });

  it('runAgainAfterAFailoverOnceMoved_sendsTheNewHostsOwnStep_andAvoidsEveryHostItFailedOn', async () => {
    const { w, ex, steps, avoided } = createOnA((h) => hostFailure(h), { input: { startFailedOn: ['A'] }, sb: { hostId: 'B' }, hosts: ['C'] });
    await expect(ex.runCreate(w.op)).rejects.toMatchObject({ detail: 'host C: create: image build failed on C' });
    expect(steps).toEqual(['create/B@B', 'create/C@C']);
    expect(avoided).toEqual([['A', 'B']]);
  });

  it('runAgainAfterAFailoverOnceMoved_tellsTheHostItWasMovedOffToGiveItUpAgain', async () => {
    // The first run may have died between its move's commit and its stop to A.
    const { w, ex, steps, stops } = createOnA(() => undefined, { input: { startFailedOn: ['A'] }, sb: { hostId: 'B' } });
    await ex.runCreate(w.op);
    expect(steps).toEqual(['create/B@B']);
    expect(stops).toEqual(['stop-replaced/sb-a@A']);
    expect(w.sb).toMatchObject({ state: 'running', hostId: 'B' });
  });

  it('whoseSourcesCouldNotDeliverItsSnapshot_orWhoseStepNeverReachedTheBus_failsThere_withoutTryingAnotherHost', async () => {
    for (const e of [new HostStepError('A', 'create', 'unavailable', '3 chunk(s) unavailable from every source: x', true, 'fetch.sources'), new StepTimeoutError('A', 'create', 1000, true)]) {
      const { w, ex, steps, avoided } = createOnA(() => e);
      await expect(ex.runCreate(w.op), e.message).rejects.toBe(e);
      expect(steps, e.message).toEqual(['create@A']);
      expect(avoided, e.message).toEqual([]);
      expect(w.sb.state, e.message).toBe('failed');
    }
  });

  it('movedToAnotherHost_recordsTheNewPlacementsExplanation', async () => {
    const { w, ex } = createOnA((h) => (h === 'A' ? hostFailure(h) : undefined));
    await ex.runCreate(w.op);
    expect(w.op.result).toMatchObject({ explanation: { summary: 'placed on B' } });
  });
});

describe('a hibernate whose snapshot fails', () => {
  const idleHibernate = (): OperationRec => opRecord('op-h', 'hibernate', { snapshotId: 'sn-h', reason: 'idle' });

  /** A leader running an idle hibernate of sb-a whose snapshot and resume-after-failure steps time out. */
  const snapshotAndResumeFail = (o: Parameters<typeof leaderOver>[3] = {}) => {
    const { w, ex } = leaderOver(sandboxRecord({ idleTimeoutMs: 60_000 }), idleHibernate(), undefined, o);
    ex.step = async (_op, id) => {
      if (id === 'pause') return {};
      throw new StepTimeoutError('h1', id, 1000);
    };
    ex.markSnapshotFailed = async () => undefined;
    return { w, ex };
  };
  const pass = (ex: Internals, sb: SandboxRec): Promise<void> => ex.reconcileLifecycles([{ value: structuredClone(sb), modRevision: 1 }]);

  it('andWhoseResumeFailsToo_leavesItPausedOwedAResume_whichTheLifecyclePassSubmits_evenIfItsFirstSubmitFails', async () => {
    // The first submit of a resume for it fails (an etcd blip, as a lead lost between the
    // settle and the submit would): the resume is not lost with it.
    const { w, ex } = snapshotAndResumeFail({ failSubmits: 1 });
    await ex.runHibernate(w.op);
    expect(w.op.state).toBe('failed');
    expect(w.sb).toMatchObject({ state: 'paused', opId: '', resumeOwed: 'op-h' });
    await pass(ex, w.sb).catch(() => undefined);
    await pass(ex, w.sb).catch(() => undefined);
    expect(w.submitted).toEqual(['resume sb-a __resume-after-hibernate/op-h']);
  });

  it('andWhoseResumeFailsToo_butWhichMovedOnOnceSettled_getsNoResume', async () => {
    const { w, ex } = snapshotAndResumeFail();
    await ex.runHibernate(w.op);
    // Its host is found lost right after the settle wrote it paused: no resume while lost.
    await pass(ex, { ...w.sb, state: 'lost' });
    // Taken by another operation (a drain): none while it holds it.
    await pass(ex, { ...w.sb, opId: 'op-d' });
    expect(w.submitted).toEqual([]);
  });

  it('andWhoseResumeFailsToo_thenPausedResumedOrDestroyedByItsOwner_isOwedNoResume', async () => {
    for (const kind of ['pause', 'resume', 'destroy'] as const) {
      const { w, ex } = snapshotAndResumeFail();
      await ex.runHibernate(w.op);
      expect(w.sb.resumeOwed).toBe('op-h');
      // Its owner's operation: the host's steps succeed now.
      w.op = opRecord(`op-${kind}`, kind);
      ex.ops.set(w.op.id, { value: structuredClone(w.op), modRevision: w.opRev });
      ex.step = async () => ({ vms: [] });
      await (kind === 'destroy' ? ex.runDestroy(w.op) : ex.runPauseResume(w.op));
      expect(w.op.state, kind).toBe('succeeded');
      expect(w.sb.state, kind).toBe(kind === 'pause' ? 'paused' : kind === 'resume' ? 'running' : 'destroyed');
      expect(w.sb.resumeOwed, kind).toBeUndefined();
      await pass(ex, w.sb);
      expect(w.submitted, kind).toEqual([]);
    }
  });

  it('andWhoseResumeFailsToo_whoseOwedResumeRunsAfterItsOwnerPausedIt_leavesItPaused', async () => {
    // The pass submitted the resume; the owner's pause ran first (one at a time per sandbox).
    const { w, ex } = leaderOver(sandboxRecord({ state: 'paused', runningSince: null }), opRecord('op-r', 'resume', { resumeOwed: 'op-h' }));
    const steps: string[] = [];
    ex.step = async (_op, id) => (steps.push(id), { vms: [] });
    await ex.runPauseResume(w.op);
    expect(w.op.state).toBe('succeeded');
    expect(w.sb.state).toBe('paused');
    expect(steps).toEqual([]);
  });

  it('anOwedResumeThatFindsItHibernatingOrLost_failsForTheRuleToSubmitAnother_insteadOfUsingUpItsKey', async () => {
    for (const state of ['hibernating', 'lost'] as const) {
      const { w, ex } = leaderOver(sandboxRecord({ state, runningSince: null, resumeOwed: 'op-h', ...(state === 'hibernating' ? { opId: 'op-d' } : {}) }), opRecord('op-r', 'resume', { resumeOwed: 'op-h' }));
      ex.step = async () => ({ vms: [] });
      await expect(ex.runPauseResume(w.op), state).rejects.toBeInstanceOf(WrongStateError);
      expect(w.op.state, state).not.toBe('succeeded');
      expect(w.sb.resumeOwed, state).toBe('op-h');
    }
  });

  it('anOwnersPauseOfARunningSandboxStillMarked_clearsTheMark', async () => {
    // A mark left by a leader that did not clear it (an older version): the owner's pause ends it.
    const { w, ex } = leaderOver(sandboxRecord({ resumeOwed: 'op-h' }), opRecord('op-p', 'pause', {}));
    ex.step = async () => ({ vms: [] });
    await ex.runPauseResume(w.op);
    expect(w.sb.state).toBe('paused');
    expect(w.sb.resumeOwed).toBeUndefined();
  });

  it('ofOneOwedAResume_thatFailsToo_leavesItPausedStillOwed', async () => {
    // A drain's hibernate of it (from paused: nothing to pause or resume) fails at its snapshot.
    const { w, ex } = leaderOver(sandboxRecord({ state: 'paused', runningSince: null, resumeOwed: 'op-h0' }), opRecord('op-h', 'hibernate', { snapshotId: 'sn-h', reason: 'drain' }));
    ex.step = async (_op, id) => {
      throw new StepTimeoutError('h1', id, 1000);
    };
    ex.markSnapshotFailed = async () => undefined;
    await ex.runHibernate(w.op);
    expect(w.sb).toMatchObject({ state: 'paused', opId: '', resumeOwed: 'op-h0' });
  });

  it('runAgainAfterItResumedTheVmButCouldNotRecordItsFailure_sendsNoPauseOrSnapshotAgain_resumesAndSettles', async () => {
    // The host's journal answers a pause sent again under the same step id without pausing:
    // the run again snapshotted (and hibernated) a guest that ran.
    let failOnce = true;
    const { w, ex } = leaderOver(sandboxRecord({ idleTimeoutMs: 60_000 }), idleHibernate(), undefined, {
      failCommit: (ws) => {
        if (failOnce && ws.some((x) => x.kind === 'op' && x.value.state === 'failed')) {
          failOnce = false;
          throw new StoreUnavailableError('commit', new Error('etcd blip'));
        }
      },
    });
    const steps: string[] = [];
    let snapshots = 0;
    ex.step = async (_op, id) => {
      steps.push(id);
      if (id.startsWith('snapshot/') && snapshots++ === 0) throw new HostStepError('h1', id, 'unavailable', 'transient', true);
      return {};
    };
    ex.markSnapshotFailed = async () => undefined;
    await expect(ex.runHibernate(w.op)).rejects.toBeInstanceOf(StoreUnavailableError);
    expect(steps).toEqual(['pause', 'snapshot/sn-h', 'resume-after-failure']);
    // run() runs it again from its record read afresh.
    ex.ops.delete(w.op.id);
    await ex.runHibernate(structuredClone(w.op));
    expect(steps.slice(3)).toEqual(['resume-after-failure']);
    expect(w.sb).toMatchObject({ state: 'running', opId: '' });
    expect(w.sb.stateReason).toMatch(/^hibernate failed: .*transient/);
    expect(w.op).toMatchObject({ state: 'failed', error: { kind: 'unavailable', retryable: true } });
  });
});

describe('a destroy that a hibernate overtakes', () => {
  it('betweenItsReadAndItsWrite_waitsForThatHibernate_andDestroysWhatItLeft', async () => {
    let reads = 0;
    const { w, ex } = leaderOver(sandboxRecord({ hostId: 'A' }), opRecord('op-d', 'destroy'), undefined, {
      getSandbox: (cur) => {
        // Its first read finds it running; the idle rule's hibernate takes it before the write
        // and ends (hibernated) a little later.
        if (cur.sb.state === 'running' && reads++ === 1) {
          [cur.sb, cur.sbRev] = [{ ...cur.sb, state: 'hibernating', opId: 'op-h', hibernatingFrom: 'running', runningSince: null }, ++cur.rev];
          ex.running.set('op-h', new Promise<void>(() => undefined));
          setTimeout(() => {
            [cur.sb, cur.sbRev] = [{ ...cur.sb, state: 'hibernated', opId: '', hibernationSnapshotId: 'sn-h' }, ++cur.rev];
            delete cur.sb.hibernatingFrom;
            ex.running.delete('op-h');
          }, 20);
        }
        return { value: structuredClone(cur.sb), modRevision: cur.sbRev };
      },
    });
    await ex.runDestroy(w.op);
    expect(w.sb.state).toBe('destroyed');
    expect(w.op.state).toBe('succeeded');
  });

  it('thatStillHoldsItAfterTheStepTimeout_failsTheDestroyAsRetryable', async () => {
    let now = 1_000_000;
    const { w, ex } = leaderOver(sandboxRecord({ state: 'hibernating', opId: 'op-h', hibernatingFrom: 'running', runningSince: null }), opRecord('op-d', 'destroy'), undefined, { now: () => (now += 600) });
    ex.running.set('op-h', new Promise<void>(() => undefined));
    await expect(ex.runDestroy(w.op)).rejects.toMatchObject({ kind: 'unavailable', retryable: true });
    expect(w.sb.state).toBe('hibernating');
  });
});
