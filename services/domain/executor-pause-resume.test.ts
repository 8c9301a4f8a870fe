// Pause and resume as they meet other operations (Executor.runPauseResume and its hold on the
// sandbox): the executor as a leader's over a stub store of our own port that keeps one sandbox
// and the operation records, each guarded by its revision, and stub host steps.
import { describe, expect, it } from 'vitest';
import type { ExecutorDeps } from './executor.ts';
import type { StoreWrite, Versioned } from './ports.ts';
import type { OperationRec, SandboxRec, SnapshotRec } from './records.ts';
import { HostStepError, WrongStateError } from './errors.ts';
import { leaderExecutor } from '../testkit/executor.ts';
import { sandboxRecord } from '../testkit/records.ts';

interface Internals {
  running: Map<string, Promise<void>>;
  step: (op: OperationRec, stepId: string, hostId: string, work: { case: string }) => Promise<unknown>;
  runOnce(tenantId: string, opId: string): Promise<void>;
  runPauseResume(op: OperationRec): Promise<void>;
  runDestroy(op: OperationRec): Promise<void>;
  runHibernate(op: OperationRec): Promise<void>;
  migrate(op: OperationRec, sb: SandboxRec): Promise<void>;
  cache: { hosts: Map<string, { value: unknown; modRevision: number }> };
  reconcileLifecycles(sandboxes?: ReadonlyArray<Versioned<SandboxRec>>): Promise<void>;
}

const opRecord = (id: string, kind: OperationRec['kind'], over: Partial<OperationRec> = {}): OperationRec => ({ id, tenantId: 't1', kind, state: 'running', createdAt: 0, updatedAt: 0, targetId: 'sb-a', input: {}, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {}, ...over });

interface World {
  sb: SandboxRec;
  sbRev: number;
  /** Operation records by `<tenant>/<id>` (a drain's is under `admin`). */
  ops: Map<string, { value: OperationRec; rev: number }>;
  rev: number;
  /** Snapshot records by id, as the sandbox's. */
  snaps: Map<string, { value: SnapshotRec; rev: number }>;
  /** Host steps sent: `<step>:<work> (held by <opId>)`, the sandbox's holder when it went out. */
  steps: string[];
  /** Operations of the executor's own submitted: `<kind> <key>`. */
  submitted: string[];
}

/**
 * A leader over a store holding `sb` and `ops`, whose writes are guarded by revision.
 * `o.afterFirstRead` changes the world right after the first read of the sandbox (another
 * operation that takes it between a pause's or resume's read and its write).
 */
function leaderOver(sb: SandboxRec, ops: OperationRec[], o: { afterFirstRead?: (w: World) => void; afterGetOp?: (id: string) => void; afterRead?: (n: number) => void; deps?: Partial<ExecutorDeps> } = {}) {
  const w: World = { sb: structuredClone(sb), sbRev: 5, ops: new Map(ops.map((op) => [`${op.tenantId}/${op.id}`, { value: structuredClone(op), rev: 5 }])), rev: 5, snaps: new Map(), steps: [], submitted: [] };
  let reads = 0;
  const store = {
    getSandbox: async () => {
      const v = { value: structuredClone(w.sb), modRevision: w.sbRev };
      o.afterRead?.(reads);
      if (reads++ === 0) o.afterFirstRead?.(w);
      return v;
    },
    getOp: async (tenantId: string, id: string) => {
      const x = w.ops.get(`${tenantId}/${id}`);
      o.afterGetOp?.(id);
      return x && { value: structuredClone(x.value), modRevision: x.rev };
    },
    getAlloc: async (hostId: string) => ({ value: { hostId, allocated: { vcpus: 4, memoryMib: 1024, diskMib: 4096 }, sandboxes: 2 }, modRevision: 4 }),
    getIdempotent: async () => undefined,
    getSnapshot: async (_tenantId: string, id: string) => {
      const x = w.snaps.get(id);
      return x && { value: structuredClone(x.value), modRevision: x.rev };
    },
    commitAt: async (ws: StoreWrite[]) => {
      for (const x of ws) {
        if (x.kind === 'sandbox' && x.expectRevision !== w.sbRev) return 0;
        if (x.kind === 'op' && x.expectRevision !== (w.ops.get(`${x.value.tenantId}/${x.value.id}`)?.rev ?? 0)) return 0;
        if (x.kind === 'snapshot' && x.expectRevision !== (w.snaps.get(x.value.id)?.rev ?? 0)) return 0;
      }
      w.rev++;
      for (const x of ws) {
        if (x.kind === 'sandbox') [w.sb, w.sbRev] = [structuredClone(x.value), w.rev];
        if (x.kind === 'op') w.ops.set(`${x.value.tenantId}/${x.value.id}`, { value: structuredClone(x.value), rev: w.rev });
        if (x.kind === 'snapshot') w.snaps.set(x.value.id, { value: structuredClone(x.value), rev: w.rev });
      }
      return w.rev;
    },
  };
  const submit: NonNullable<ExecutorDeps['submit']> = async (tenantId, key, kind) => {
    w.submitted.push(`${kind} ${key}`);
    return { id: 'op-new', tenantId, kind, state: 'pending' } as never;
  };
  const ex = leaderExecutor(store, { submit, ...o.deps }) as unknown as Internals;
  ex.step = async (_op, stepId, _hostId, work) => (w.steps.push(`${stepId}:${work.case} (held by ${w.sb.opId || 'none'})`), { vms: [] });
  const op = (id: string): OperationRec => w.ops.get(`t1/${id}`)!.value;
  return { w, ex, op };
}

/** Another operation takes sb-a: a hibernate (it pauses the VM for its snapshot) or a drain's migration (likewise, its record saying running). */
const hibernateTakes = (w: World): void => void ([w.sb, w.sbRev] = [{ ...w.sb, state: 'hibernating', opId: 'op-h', hibernatingFrom: 'running', runningSince: null }, ++w.rev]);
const drainClaims = (w: World): void => void ([w.sb, w.sbRev] = [{ ...w.sb, opId: 'op-d' }, ++w.rev]);
/** The drain op-d of host h1: recorded under the admin tenant, as Fleet.drainHost submits it. */
const drainOp = (over: Partial<OperationRec> = {}): OperationRec => opRecord('op-d', 'drain', { tenantId: 'admin', targetId: 'h1', input: { migrate: true }, ...over });

describe('a pause or resume', () => {
  it('holdsItsSandboxWhileItsStepRuns_andLetsGoInItsFinalWrite', async () => {
    for (const [kind, state] of [['pause', 'running'], ['resume', 'paused'], ['resume', 'running']] as const) {
      const { w, ex, op } = leaderOver(sandboxRecord({ state }), [opRecord('op-1', kind)]);
      await ex.runPauseResume(op('op-1'));
      expect(w.steps, `${kind} of ${state}`).toEqual([`${kind}:${kind}Vm (held by op-1)`]);
      expect(op('op-1').state, `${kind} of ${state}`).toBe('succeeded');
      expect(w.sb, `${kind} of ${state}`).toMatchObject({ state: kind === 'pause' ? 'paused' : 'running', opId: '' });
    }
  });

  it('whoseStepFails_letsGoOfItsSandboxInTheWriteThatFailsIt', async () => {
    const { w, ex, op } = leaderOver(sandboxRecord(), [opRecord('op-p', 'pause')]);
    let heldBy = '';
    ex.step = async (_op, stepId) => {
      heldBy = w.sb.opId;
      throw new HostStepError('h1', stepId, 'internal', 'qmp went away', false);
    };
    await ex.runOnce('t1', 'op-p');
    expect(heldBy).toBe('op-p');
    expect(op('op-p').state).toBe('failed');
    expect(w.sb).toMatchObject({ state: 'running', opId: '' });
  });

  it('ofASandboxAHibernateTookAfterItsRead_sendsNoStep_soTheGuestDoesNotRunOnPastTheSnapshot', async () => {
    // The resume read it running (a no-op but for its step, which resumes the VM); the idle
    // rule's hibernate took it and paused the VM before the resume's step went out.
    const { w, ex, op } = leaderOver(sandboxRecord(), [opRecord('op-r', 'resume')], { afterFirstRead: hibernateTakes });
    await expect(ex.runPauseResume(op('op-r'))).rejects.toBeInstanceOf(WrongStateError);
    expect(w.steps).toEqual([]);
    expect(w.sb).toMatchObject({ state: 'hibernating', opId: 'op-h' });
  });

  it('ofASandboxADrainsMigrationClaimedAfterItsRead_sendsNoStep_andIsRefusedAsRetryable', async () => {
    // The migration paused the source VM for its snapshot: a resume sent now would let the
    // guest do work that the switch to the copy then throws away.
    for (const kind of ['resume', 'pause'] as const) {
      const { w, ex, op } = leaderOver(sandboxRecord(), [opRecord('op-1', kind), drainOp()], { afterFirstRead: drainClaims });
      await expect(ex.runPauseResume(op('op-1')), kind).rejects.toMatchObject({ kind: 'unavailable', retryable: true });
      expect(w.steps, kind).toEqual([]);
      expect(w.sb.opId, kind).toBe('op-d');
    }
  });

  it('ofASandboxADrainHolds_isRefusedAsUnavailableAndRetryable_notAsAFailedPrecondition', async () => {
    for (const kind of ['resume', 'pause'] as const) {
      const { w, ex, op } = leaderOver(sandboxRecord({ opId: 'op-d' }), [opRecord('op-1', kind), drainOp()]);
      await ex.runOnce('t1', 'op-1');
      expect(op('op-1'), kind).toMatchObject({ state: 'failed', error: { kind: 'unavailable', retryable: true } });
      expect(op('op-1').error?.message, kind).toMatch(/operation op-d is at work on it.*retry$/);
      expect(w.sb.opId, kind).toBe('op-d');
    }
  });

  it('takesItsSandboxOverFromAnEarlierPauseOrResumeThatHoldsItButNoLongerRuns', async () => {
    // op-p's runner crashed after its hold (it runs again later, or is superseded by this one).
    const { w, ex, op } = leaderOver(sandboxRecord({ opId: 'op-p' }), [opRecord('op-p', 'pause'), opRecord('op-r', 'resume', { createdAt: 1 })]);
    await ex.runPauseResume(op('op-r'));
    expect(w.steps).toEqual(['resume:resumeVm (held by op-r)']);
    expect(w.sb).toMatchObject({ state: 'running', opId: '' });
  });

  it('takesItsSandboxOverFromAHolderWhoseRecordIsGone_butNotFromADrain', async () => {
    // The holder's record expired (a long stay on a scheduler from before these holds, whose
    // last write kept them); a drain's record is under the admin tenant, and is found there.
    const { w, ex, op } = leaderOver(sandboxRecord({ opId: 'op-gone' }), [opRecord('op-r', 'resume')]);
    await ex.runPauseResume(op('op-r'));
    expect(w.steps).toEqual(['resume:resumeVm (held by op-r)']);
    expect(w.sb.opId).toBe('');
    const drained = leaderOver(sandboxRecord({ opId: 'op-d' }), [opRecord('op-r', 'resume'), drainOp()]);
    await expect(drained.ex.runPauseResume(drained.op('op-r'))).rejects.toMatchObject({ kind: 'unavailable', retryable: true });
    expect(drained.w.sb.opId).toBe('op-d');
  });

  it('leavesTheSandboxsUpdatedAtAlone_inItsHoldAndItsRelease_whenItChangesNoState', async () => {
    // The VM check trusts no heartbeat for a few seconds after updatedAt: a resume asked every
    // few seconds of a dead VM would keep it from ever being found lost.
    const failing = leaderOver(sandboxRecord({ updatedAt: 1 }), [opRecord('op-r', 'resume')]);
    let heldBy = '';
    failing.ex.step = async (_op, stepId) => {
      heldBy = failing.w.sb.opId;
      throw new HostStepError('h1', stepId, 'not_found', 'no such vm', false);
    };
    await failing.ex.runOnce('t1', 'op-r');
    expect(heldBy).toBe('op-r');
    expect(failing.op('op-r').state).toBe('failed');
    expect(failing.w.sb).toMatchObject({ state: 'running', opId: '', updatedAt: 1 });
    const noop = leaderOver(sandboxRecord({ updatedAt: 1 }), [opRecord('op-r', 'resume')]);
    await noop.ex.runOnce('t1', 'op-r');
    expect(noop.op('op-r').state).toBe('succeeded');
    expect(noop.w.sb).toMatchObject({ state: 'running', opId: '', updatedAt: 1 });
  });

  it('thatADestroyOvertakesDuringItsStep_failsWithoutUndoingTheDestroy', async () => {
    // A destroy goes on over a pause's hold, as over a drain's: the pause's write finds it taken.
    const { w, ex, op } = leaderOver(sandboxRecord(), [opRecord('op-p', 'pause'), opRecord('op-x', 'destroy', { createdAt: 1 })]);
    const step = ex.step;
    ex.step = async (o, stepId, hostId, work) => {
      if (o.id === 'op-p') await ex.runDestroy(op('op-x'));
      return step(o, stepId, hostId, work);
    };
    await ex.runOnce('t1', 'op-p');
    expect(op('op-x').state).toBe('succeeded');
    expect(op('op-p').state).toBe('failed');
    expect(w.sb).toMatchObject({ state: 'destroyed', opId: '' });
  });
});

describe('the lifecycle pass, over a sandbox a pause or resume holds', () => {
  const pass = (ex: Internals, sb: SandboxRec): Promise<void> => ex.reconcileLifecycles([{ value: structuredClone(sb), modRevision: 5 }]);

  it('thatEndedHoldingIt_letsGoOfIt', async () => {
    // A pause run to its end by a scheduler from before the holds: its last write kept it.
    const { w, ex } = leaderOver(sandboxRecord({ state: 'paused', runningSince: null, opId: 'op-p' }), [opRecord('op-p', 'pause', { state: 'succeeded' })]);
    await pass(ex, w.sb);
    expect(w.sb).toMatchObject({ state: 'paused', opId: '' });
  });

  it('whoseHolderRecordIsGone_letsGoOfIt', async () => {
    // Expired by retention while a scheduler from before these holds (which kept them) led.
    const { w, ex } = leaderOver(sandboxRecord({ state: 'paused', runningSince: null, opId: 'op-gone' }), []);
    await pass(ex, w.sb);
    expect(w.sb).toMatchObject({ state: 'paused', opId: '' });
  });

  it('thatStillRuns_orADrainHolds_leavesItHeld_andStartsNoRuleOnIt', async () => {
    // Its TTL is up: the destroy waits for the next pass after the hold ends.
    const ttlUp = { ttlMs: 1, runningSince: 0 };
    const { w, ex } = leaderOver(sandboxRecord({ ...ttlUp, opId: 'op-r' }), [opRecord('op-r', 'resume')]);
    ex.running.set('op-r', new Promise<void>(() => undefined));
    await pass(ex, w.sb);
    expect(w.sb.opId).toBe('op-r');
    const drained = leaderOver(sandboxRecord({ ...ttlUp, opId: 'op-d' }), [opRecord('op-d', 'drain', { tenantId: 'admin', state: 'failed' })]);
    await pass(drained.ex, drained.w.sb);
    expect(drained.w.sb.opId).toBe('op-d');
    expect([...w.submitted, ...drained.w.submitted]).toEqual([]);
  });
});

describe('a hibernate or a drain\'s migration, over a sandbox a pause or resume holds', () => {
  /**
   * Resume op-r of running sb-a, run as a leader runs it (listed as running), whose step starts
   * `other` and lets it run for 100 ms before it answers: what `other` did by then, and its end.
   */
  async function duringAResumeStep(l: ReturnType<typeof leaderOver>, other: () => Promise<void>) {
    let started: Promise<unknown> | undefined;
    let during: string[] = [];
    const step = l.ex.step;
    l.ex.step = async (o, stepId, hostId, work) => {
      if (o.id === 'op-r') {
        started = other().then(
          () => undefined,
          (e: unknown) => e,
        );
        await new Promise((r) => setTimeout(r, 100));
        during = [...l.w.steps];
      }
      return step(o, stepId, hostId, work);
    };
    l.ex.running.set('op-r', new Promise<void>(() => undefined));
    await l.ex.runOnce('t1', 'op-r');
    l.ex.running.delete('op-r');
    return { during, error: await started };
  }

  it('hibernate_waitsForTheHoldToEnd_andHibernatesTheSandbox_notRefusedAsAFailedPrecondition', async () => {
    const l = leaderOver(sandboxRecord(), [opRecord('op-r', 'resume'), opRecord('op-h', 'hibernate', { createdAt: 1, input: { snapshotId: 'sn-h' } })]);
    const { during, error } = await duringAResumeStep(l, () => l.ex.runHibernate(l.op('op-h')));
    expect(error).toBeUndefined();
    expect(during).toEqual([]);
    expect(l.op('op-r').state).toBe('succeeded');
    expect(l.w.steps[0]).toBe('resume:resumeVm (held by op-r)');
    expect(l.w.steps[1]).toBe('pause:pauseVm (held by op-h)');
    expect(l.w.sb).toMatchObject({ state: 'hibernated', opId: '' });
  });

  it('destroyOfTheTtlRule_recordsWhyFromDestroying_soACommandItCutsOffIsToldWhy', async () => {
    // The exec's 'connection closed' comes while the VM stops: the record then says destroying.
    let during = '';
    const l = leaderOver(sandboxRecord(), [opRecord('op-x', 'destroy', { input: { reason: 'ttl' } })]);
    const step = l.ex.step;
    l.ex.step = async (o, stepId, hostId, work) => ((during = `${l.w.sb.state} (${l.w.sb.stateReason})`), step(o, stepId, hostId, work));
    await l.ex.runDestroy(l.op('op-x'));
    expect(during).toBe('destroying (ttl)');
  });

  it('hibernateOfTheIdleRule_recordsWhyInTheSandboxsStateReason_asATtlDestroyDoes', async () => {
    // An eval harness saw `destroyed(ttl)` next to `hibernated()`: no word of its idle timeout.
    const l = leaderOver(sandboxRecord(), [opRecord('op-h', 'hibernate', { input: { snapshotId: 'sn-h', reason: 'idle' } })]);
    await l.ex.runHibernate(l.op('op-h'));
    expect(l.w.sb).toMatchObject({ state: 'hibernated', stateReason: 'idle' });
    expect(l.w.sb.hibernatedOnRequest).toBeUndefined();
    // A user's: marked, for the TTL rule to leave it.
    const u = leaderOver(sandboxRecord(), [opRecord('op-h', 'hibernate', { input: { snapshotId: 'sn-h' } })]);
    await u.ex.runHibernate(u.op('op-h'));
    expect(u.w.sb).toMatchObject({ state: 'hibernated', stateReason: '', hibernatedOnRequest: true });
  });

  it('drainMigration_waitsForTheHoldToEnd_andClaimsTheSandbox', async () => {
    const l = leaderOver(sandboxRecord(), [opRecord('op-r', 'resume'), drainOp()]);
    l.ex.cache.hosts.set('h1', { value: { id: 'h1', cordoned: true, draining: true }, modRevision: 1 });
    const drain = l.w.ops.get('admin/op-d')!.value;
    // Its pause step fails: the migration is undone there (its claim ended), past the claim.
    const step = l.ex.step;
    const failPause = async (o: OperationRec, stepId: string, hostId: string, work: { case: string }): Promise<unknown> => {
      await step(o, stepId, hostId, work);
      if (o.id === 'op-d') throw new HostStepError('h1', stepId, 'internal', 'qmp went away', false);
      return { vms: [] };
    };
    l.ex.step = failPause;
    const { during, error } = await duringAResumeStep(l, () => l.ex.migrate(drain, sandboxRecord()));
    expect(during).toEqual([]);
    expect(l.w.steps[0]).toBe('resume:resumeVm (held by op-r)');
    expect(l.w.steps[1]).toBe('migrate/sb-a/pause-unless-calls/0:pauseVm (held by op-d)');
    expect(error).toBeInstanceOf(HostStepError);
    expect(l.w.sb.opId).toBe('');
  });

  it('takesTheSandboxOverFromAPauseOrResumeThatHoldsItButNoLongerRuns', async () => {
    // op-p's runner crashed holding it.
    const h = leaderOver(sandboxRecord({ opId: 'op-p' }), [opRecord('op-p', 'pause'), opRecord('op-h', 'hibernate', { createdAt: 1, input: { snapshotId: 'sn-h' } })]);
    await h.ex.runHibernate(h.op('op-h'));
    expect(h.w.steps[0]).toBe('pause:pauseVm (held by op-h)');
    expect(h.w.sb).toMatchObject({ state: 'hibernated', opId: '' });
    const d = leaderOver(sandboxRecord({ opId: 'op-p' }), [opRecord('op-p', 'pause'), drainOp()]);
    d.ex.cache.hosts.set('h1', { value: { id: 'h1', cordoned: true, draining: true }, modRevision: 1 });
    d.ex.step = async (o, stepId) => (d.w.steps.push(`${stepId} (held by ${d.w.sb.opId})`), Promise.reject(new HostStepError('h1', stepId, 'internal', 'qmp went away', false)));
    await expect(d.ex.migrate(d.w.ops.get('admin/op-d')!.value, d.w.sb)).rejects.toBeInstanceOf(HostStepError);
    expect(d.w.steps[0]).toBe('migrate/sb-a/pause-unless-calls/0 (held by op-d)');
  });

  it('doesNotTakeItOver_fromAStoppedPauseOrResumeThatRunsAgainBeforeItsWrite', async () => {
    // op-p's runner had crashed; it runs again (rerunLater) between the hibernate's look and
    // its write. Taken over then, its resume step could run a guest paused for the snapshot.
    let t = 0;
    const box: { ex?: Internals } = {};
    let looked = false;
    const l = leaderOver(sandboxRecord({ opId: 'op-p' }), [opRecord('op-p', 'resume'), opRecord('op-h', 'hibernate', { input: { snapshotId: 'sn-h' } })], {
      // The hibernate looked at the holder (not running): the read its write builds on comes next.
      afterGetOp: (id) => void (id === 'op-p' && (looked = true)),
      afterRead: () => void (looked && box.ex?.running.set('op-p', new Promise<void>(() => undefined))),
      deps: { clock: { now: () => (t += 10_000) } },
    });
    box.ex = l.ex;
    await expect(l.ex.runHibernate(l.op('op-h'))).rejects.toMatchObject({ kind: 'unavailable', retryable: true });
    expect(l.w.steps).toEqual([]);
    expect(l.w.sb).toMatchObject({ state: 'running', opId: 'op-p' });
  });

  it('hibernate_whoseSandboxIsTakenEachTimeItLooks_isRefusedUnavailableAndRetryable_notAnInternalError', async () => {
    // Pauses and resumes asked in a loop: between each look and its write another one takes it.
    const box: { w?: World } = {};
    const l = leaderOver(sandboxRecord(), [opRecord('op-h', 'hibernate', { input: { snapshotId: 'sn-h' } })], {
      afterRead: (n) => {
        const w = box.w;
        if (!w || n % 2 !== 0) return;
        [w.sb, w.sbRev] = [{ ...w.sb, opId: `op-x${n / 2 + 1}` }, ++w.rev];
      },
    });
    box.w = l.w;
    await expect(l.ex.runHibernate(l.op('op-h'))).rejects.toMatchObject({ kind: 'unavailable', retryable: true, message: expect.stringMatching(/each time this hibernate looked/) });
    expect(l.w.steps).toEqual([]);
  });

  it('isRefusedAsUnavailableAndRetryable_whenThePauseOrResumeStillHoldsItAfterItsStepsTime', async () => {
    // A clock that moves 10 s a reading: the wait (one step of 1 s here) gives up at once.
    let t = 0;
    for (const kind of ['hibernate', 'drain'] as const) {
      const l = leaderOver(sandboxRecord({ opId: 'op-r' }), [opRecord('op-r', 'resume'), opRecord('op-h', 'hibernate', { input: { snapshotId: 'sn-h' } }), drainOp()], { deps: { clock: { now: () => (t += 10_000) } } });
      l.ex.cache.hosts.set('h1', { value: { id: 'h1', cordoned: true, draining: true }, modRevision: 1 });
      l.ex.running.set('op-r', new Promise<void>(() => undefined));
      const run = kind === 'hibernate' ? l.ex.runHibernate(l.op('op-h')) : l.ex.migrate(l.w.ops.get('admin/op-d')!.value, l.w.sb);
      await expect(run, kind).rejects.toMatchObject({ kind: 'unavailable', retryable: true, message: expect.stringMatching(/resume op-r is still at work on it; retry$/) });
      expect(l.w.steps, kind).toEqual([]);
      expect(l.w.sb.opId, kind).toBe('op-r');
    }
  });

  it('isStillRefusedAsAFailedPrecondition_whenADrainHoldsIt', async () => {
    const l = leaderOver(sandboxRecord({ opId: 'op-d' }), [opRecord('op-h', 'hibernate', { input: { snapshotId: 'sn-h' } }), drainOp()]);
    await expect(l.ex.runHibernate(l.op('op-h'))).rejects.toBeInstanceOf(WrongStateError);
    expect(l.w.sb.opId).toBe('op-d');
  });
});
