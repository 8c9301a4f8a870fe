// What an operation that runs again (a failover, a store outage) finds: a drain that had moved
// a sandbox off its host (the move is done, whatever the sandbox did since), a snapshot that
// could not be marked failed (the op must run again, not end). The Executor against stub ports
// of our own (every store method not named answers at once with nothing).
import { describe, expect, it, vi } from 'vitest';
import type { Mock } from 'vitest';
import pino from 'pino';
import { Executor, sortFailedRestores } from './executor.ts';
import type { ExecutorDeps } from './executor.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import { create, toBinary } from '@bufbuild/protobuf';
import { SnapshotManifestSchema } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { HeartbeatSchema, HostEventSchema, HostEventType, HostResultSchema } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type { HostRec, OperationRec, SandboxRec, SnapshotRec } from './records.ts';
import { ConflictError, HostLostError, HostStepError, NotLeaderError, OperationCancelledError, StepTimeoutError, StoreFullError, StoreUnavailableError, WrongStateError } from './errors.ts';
import type { StoreWrite } from './ports.ts';
import { leaderExecutor } from '../testkit/executor.ts';

function stub<T>(methods: Record<string, unknown>): T {
  return new Proxy(methods, { get: (target, key) => (key in target ? target[key as string] : key === 'then' ? undefined : async () => []) }) as T;
}

/** An Executor over stub ports: the methods given, every other one answering nothing. */
function executorOver(store: Record<string, unknown>, o: { bus?: Record<string, unknown>; heard?: HeartbeatRegistry; now?: () => number; stepAttempts?: number; quotas?: ExecutorDeps['quotas']; usage?: ExecutorDeps['usage'] } = {}): Executor {
  return new Executor({
    ...(o.quotas ? { quotas: o.quotas } : {}),
    ...(o.usage ? { usage: o.usage } : {}),
    store: stub<ExecutorDeps['store']>(store),
    bus: stub<ExecutorDeps['bus']>(o.bus ?? {}),
    clock: { now: o.now ?? (() => Date.now()) },
    log: pino({ level: 'silent' }),
    heard: o.heard ?? new HeartbeatRegistry(),
    signer: stub({}),
    config: { liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 }, stepTimeoutMs: 100, stepAttempts: o.stepAttempts ?? 1, chunkBytes: 1 << 18 },
  });
}

const res = { vcpus: 2, memoryMib: 512, diskMib: 1024 };
const sandbox = (id: string, hostId: string, state: SandboxRec['state']): SandboxRec =>
  ({ id, tenantId: 't', state, stateReason: '', hostId, resources: res, image: 'tiny', sourceSnapshotId: '', lineageId: 'l', hostname: id, labels: {}, ttlMs: null, idleTimeoutMs: null, allowEgress: false, createdAt: 1, updatedAt: 1, runningMsBefore: 0, runningSince: 1, hibernationSnapshotId: '', opId: '' }) as unknown as SandboxRec;

/**
 * Runs drain op-d1 of host F again, its record saying `migrations`, with the sandboxes `listed`;
 * returns every write committed. With `o.answered`, hosts answer those steps (at once, done), no
 * other, and the sandboxes' and snapshots' records can be read (`o.creating`: snapshots whose
 * record says creating, the others ready); `o.quota`: the tenant's sandbox quota and how many
 * it uses; `o.cancelled`: the drain was asked to stop (CancelOperation), F known cordoned and
 * draining (so a migration stops for the cancel, not for a host the leader does not know).
 */
async function drainAgain(migrations: Record<string, unknown>, listed: SandboxRec[], sent: string[] = [], o: { answered?: string[]; creating?: string[]; quota?: { sandboxes: number; inUse: number }; cancelled?: boolean; holders?: string[]; heard?: HeartbeatRegistry; bytesFetched?: bigint } = {}): Promise<StoreWrite[]> {
  const op = { id: 'op-d1', tenantId: 'admin', kind: 'drain', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'F', input: { migrate: true, migrations }, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {}, ...(o.cancelled ? { cancelRequested: true } : {}) } as unknown as OperationRec;
  let rev = 10;
  const writes: StoreWrite[] = [];
  const store = {
    getHost: async (id: string) => ({ value: { id, state: 'ready', cordoned: true, draining: true, capacity: res }, modRevision: 5 }),
    listSandboxes: async () => listed.map((value) => ({ value, modRevision: 20 })),
    getOp: async () => ({ value: structuredClone(op), modRevision: rev }),
    getAlloc: async (hostId: string) => ({ value: { hostId, allocated: { vcpus: 8, memoryMib: 4096, diskMib: 8192 }, sandboxes: 4 }, modRevision: 30 }),
    // With hosts that answer: the sandboxes listed, and each migration's snapshot, ready on F and T.
    ...(o.answered
      ? {
          getSandbox: async (_t: string, id: string) => {
            const value = listed.find((sb) => sb.id === id);
            return value && { value: structuredClone(value), modRevision: 20 };
          },
          getSnapshot: async (tenantId: string, id: string) => ({ value: { id, tenantId, ...(o.creating?.includes(id) ? { state: 'creating', hostIds: [], takenOn: 'F' } : { state: 'ready', hostIds: o.holders ?? ['F', 'T'] }), labels: {}, manifestSignature: '', manifestKeyId: '' }, modRevision: 3 }),
        }
      : {}),
    commitAt: async (w: StoreWrite[]) => {
      writes.push(...w);
      return ++rev;
    },
  };
  const ref: { ex?: Executor } = {};
  const sendWork = async (hostId: string, w: { opId: string; stepId: string; attempt: number }): Promise<void> => {
    sent.push(`${w.stepId}@${hostId}`);
    if (o.answered?.includes(w.stepId)) setTimeout(() => ref.ex!.onResult(create(HostResultSchema, { opId: w.opId, stepId: w.stepId, hostId, attempt: w.attempt, bytesFetched: o.bytesFetched ?? 0n }), hostId), 1);
  };
  const quota = o.quota;
  const ex = executorOver(store, { bus: { sendWork }, ...(o.heard ? { heard: o.heard } : {}), ...(quota ? { quotas: () => ({ sandboxes: quota.sandboxes }), usage: { usage: async () => ({ sandboxes: quota.inUse, memoryMib: 0, snapshotBytes: 0, pendingSandboxes: 0, pendingMemoryMib: 0 }) } } : {}) });
  ref.ex = ex;
  const inner = ex as unknown as { active: boolean; ops: Map<string, unknown>; cache: { hosts: Map<string, unknown> }; runDrain(op: OperationRec): Promise<void> };
  inner.active = true;
  inner.ops.set(op.id, { value: op, modRevision: rev });
  if (o.cancelled) inner.cache.hosts.set('F', { value: { id: 'F', state: 'ready', cordoned: true, draining: true, capacity: res }, modRevision: 5 });
  await inner.runDrain(op).catch(() => undefined);
  return writes;
}

describe('Executor drain, run again', () => {
  it('aSandboxItMovedThatSinceHibernatedAndWokeElsewhere_releasesNothingOnTheHostItWasMovedTo', async () => {
    // S1 was moved F -> T (switched), then hibernated on T (its booking there released) and
    // woken on U. The old re-run saw it "not on T" and released T's booking a second time.
    const writes = await drainAgain({ S1: { snapshotId: 'sn-1', toHostId: 'T', wasPaused: false, switched: true } }, [sandbox('S1', 'U', 'running')]);
    expect(writes.filter((w) => w.kind === 'alloc').map((w) => (w as Extract<StoreWrite, { kind: 'alloc' }>).value.hostId)).toEqual([]);
    const ops = writes.filter((w): w is Extract<StoreWrite, { kind: 'op' }> => w.kind === 'op');
    expect(ops.at(-1)?.value.error ?? null).toBeNull();
  });

  it('aSandboxItMovedThatIsBackOnTheDrainedHostSince_keepsItsVmThere_noSourceStopIsSent', async () => {
    // Moved F -> T, the host uncordoned meanwhile, the sandbox woken on F again: its VM on F is
    // the sandbox now. The other one, still on T, gets its source VM on F stopped.
    const sent: string[] = [];
    await drainAgain({ S1: { snapshotId: 'sn-1', toHostId: 'T', wasPaused: false, switched: true }, S3: { snapshotId: 'sn-3', toHostId: 'T', wasPaused: false, switched: true } }, [sandbox('S1', 'F', 'running'), sandbox('S3', 'T', 'running')], sent);
    expect(sent.filter((st) => st.endsWith('@F'))).toEqual([expect.stringContaining('S3')]);
  });

  it('aMigrationThatNeverSwitched_whoseSandboxWasDestroyedMeanwhile_releasesItsBookingOnTheDestinationOnce', async () => {
    const writes = await drainAgain({ S2: { snapshotId: 'sn-2', toHostId: 'T', wasPaused: false } }, [sandbox('S2', '', 'destroyed')]);
    const allocs = writes.filter((w): w is Extract<StoreWrite, { kind: 'alloc' }> => w.kind === 'alloc');
    expect(allocs.map((w) => [w.value.hostId, w.value.allocated.vcpus])).toEqual([['T', 6]]);
  });

  it('cancelledWhileAnEarlierRunTookItsMigrationSnapshot_undoesTheMigration_andMarksThatSnapshotFailed_notLeftCreatingForGood', async () => {
    // The first run claimed and paused S1 and began snapshot sn-m; the leader failed over during
    // the snapshot step, and the drain was cancelled. The re-run undoes the migration before it
    // takes the snapshot up: nothing else would ever finish or fail sn-m (creating is neither
    // expired nor deletable), and its host would keep its files for good.
    const sent: string[] = [];
    const writes = await drainAgain({ S1: { snapshotId: 'sn-m', wasPaused: false } }, [{ ...sandbox('S1', 'F', 'running'), opId: 'op-d1' }], sent, { answered: ['migrate/S1/resume'], creating: ['sn-m'], cancelled: true });
    const snapshots = writes.filter((w): w is Extract<StoreWrite, { kind: 'snapshot' }> => w.kind === 'snapshot');
    expect(snapshots.map((w) => [w.value.id, w.value.state])).toEqual([['sn-m', 'failed']]);
    // Undone as before: no snapshot step sent, the source resumed, the drain cancelled.
    expect(sent).toEqual(['migrate/S1/resume@F']);
    const final = writes.flatMap((w) => (w.kind === 'op' ? [w.value as OperationRec] : [])).at(-1);
    expect(final?.state).toBe('cancelled');
  });
});

describe('Executor drain run again, the move it restores', () => {
  it('recordsTheNewHostAsAHolder_whenItsAnswerSaysItFetched_thoughThisRunSentItNoFetchPlan', async () => {
    // The first run's restore on T fetched sn-1 there before the leader failed over: T's
    // heartbeats list it, so this run sends T no fetch plan, and T answers from its journal.
    // The record left T out for good (F, the drained host, its only holder), as fork's did.
    const heard = new HeartbeatRegistry();
    heard.record(create(HeartbeatSchema, { hostId: 'T', bootId: 'b', restoreSlots: 4, snapshots: [{ snapshotId: 'sn-1', complete: true }] }), Date.now());
    const sent: string[] = [];
    const writes = await drainAgain({ S1: { snapshotId: 'sn-1', toHostId: 'T', wasPaused: false } }, [{ ...sandbox('S1', 'F', 'running'), opId: 'op-d1' }], sent, { answered: ['migrate/S1/pause', 'migrate/S1/restore', 'migrate/S1/stop-source'], holders: ['F'], heard, bytesFetched: 70_000_000n });
    expect(sent).toContain('migrate/S1/restore@T');
    const snapshots = writes.filter((w): w is Extract<StoreWrite, { kind: 'snapshot' }> => w.kind === 'snapshot');
    expect(snapshots.map((w) => w.value.hostIds)).toContainEqual(expect.arrayContaining(['F', 'T']));
  });
});

describe('Executor snapshot that will not become ready', () => {
  /** markSnapshotFailed against a store whose every read of the snapshot throws `err()`: its rejection, or 'resolved'. */
  const marking = async (err: () => Error): Promise<unknown> => {
    const ex = executorOver({
      getSnapshot: async () => {
        throw err();
      },
    });
    const inner = ex as unknown as { active: boolean; markSnapshotFailed(rec: SnapshotRec): Promise<void> };
    inner.active = true;
    return inner.markSnapshotFailed({ id: 'sn-1', tenantId: 't', state: 'creating' } as unknown as SnapshotRec).then(() => 'resolved', (e: unknown) => e);
  };

  it('whenTheStoreStaysOutWhileItIsMarkedFailed_failsAsAStoreFailure_soTheOpRunsAgainInsteadOfEndingWithTheRecordCreating', async () => {
    expect(await marking(() => new StoreUnavailableError('read', new Error('etcd down')))).toBeInstanceOf(StoreUnavailableError);
  });

  it('aFullStore_keepsItsOwnErrorAndSlowerRetry_andAnErrorThatIsNoStoreFailure_endsTheOpOnTheCallersError', async () => {
    expect(await marking(() => new StoreFullError('snapshot sn-1', new Error('etcdserver: mvcc: database space exceeded')))).toBeInstanceOf(StoreFullError);
    expect(await marking(() => new Error('undecodable record'))).toBe('resolved');
  });
});

/** Runs drain op `id` of host F (recording no migrations; `cancelRequested`: cancelled already) over stub ports; returns every write committed. */
async function drainOnce(id: string, host: { cordoned: boolean; draining: boolean }, listSandboxes: () => Promise<Array<{ value: SandboxRec; modRevision: number }>> = async () => [], cancelRequested = false): Promise<StoreWrite[]> {
  const op = { id, tenantId: 'admin', kind: 'drain', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'F', input: { migrate: true, migrations: {} }, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {}, cancelRequested } as unknown as OperationRec;
  const writes: StoreWrite[] = [];
  const ex = executorOver({
    getHost: async (hostId: string) => ({ value: { id: hostId, state: 'ready', ...host, capacity: res }, modRevision: 5 }),
    listSandboxes,
    getOp: async () => ({ value: structuredClone(op), modRevision: 10 }),
    commitAt: async (w: StoreWrite[]) => (writes.push(...w), 11),
  });
  const inner = ex as unknown as { active: boolean; ops: Map<string, unknown>; runDrain(op: OperationRec): Promise<void> };
  inner.active = true;
  inner.ops.set(op.id, { value: op, modRevision: 10 });
  await inner.runDrain(op);
  return writes;
}

describe('A drain run again', () => {
  it('ofAHostTheAdminUncordonedMeanwhile_doesNotCordonItBack', async () => {
    const writes = await drainOnce('op-d2', { cordoned: false, draining: false });
    expect(writes.filter((w) => w.kind === 'host' && (w.value as { cordoned: boolean }).cordoned)).toEqual([]);
  });
});

describe('A drain', () => {
  it('ofAHostASandboxCameOntoWhileItRan_namesIt_insteadOfReportingTheHostDrained', async () => {
    // Another drain had booked F for X before F's cordon, and switched X onto F meanwhile.
    let lists = 0;
    const writes = await drainOnce('op-d3', { cordoned: true, draining: true }, async () => (++lists === 1 ? [] : [{ value: sandbox('X', 'F', 'running'), modRevision: 20 }]));
    const final = writes.flatMap((w) => (w.kind === 'op' ? [w.value as OperationRec] : [])).at(-1);
    expect(final?.error?.message).toMatch(/X: came onto F during the drain/);
  });
});

describe('A snapshot step', () => {
  it('whoseHostAnswersTheManifestOfAnotherSnapshot_isNotSigned_andTheSnapshotFails', async () => {
    // The key that signs manifests signs tickets too: bytes a host chose (a ticket for another
    // tenant's snapshot, which decodes as a manifest) must not come back signed.
    const signed: Uint8Array[] = [];
    const writes: StoreWrite[] = [];
    let rev = 3;
    const ex = new Executor({
      store: stub<ExecutorDeps['store']>({
        getSandbox: async () => ({ value: sandbox('sb-1', 'h1', 'running'), modRevision: 2 }),
        getSnapshot: async () => (writes.length ? { value: writes.filter((w) => w.kind === 'snapshot').at(-1)!.value, modRevision: rev } : undefined),
        commitAt: async (w: StoreWrite[]) => (writes.push(...w), ++rev),
      }),
      bus: stub<ExecutorDeps['bus']>({}),
      clock: { now: () => Date.now() },
      log: pino({ level: 'silent' }),
      heard: new HeartbeatRegistry(),
      signer: { ticket: () => undefined as never, manifest: (b: Uint8Array) => (signed.push(b), { signature: new Uint8Array(64), keyId: 'k1' }) },
      config: { liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 }, stepTimeoutMs: 100, stepAttempts: 1, chunkBytes: 1 << 18 },
    });
    const other = toBinary(SnapshotManifestSchema, create(SnapshotManifestSchema, { snapshotId: 'sn-victim', tenantId: 'h2' }));
    const inner = ex as unknown as { active: boolean; step: () => Promise<unknown>; snapshotOf(op: OperationRec, sandboxId: string, snapshotId: string, opts: object): Promise<unknown> };
    inner.active = true;
    inner.step = async () => ({ manifest: { manifest: other }, vms: [] });
    const op = { id: 'op-s1', tenantId: 't', kind: 'snapshot', state: 'running', targetId: 'sb-1', input: {} } as unknown as OperationRec;
    await expect(inner.snapshotOf(op, 'sb-1', 'sn-mine', {})).rejects.toThrow(/with the manifest of another snapshot \("sn-victim"\)/);
    expect(signed).toEqual([]);
    expect(writes.filter((w) => w.kind === 'snapshot').map((w) => (w as { value: SnapshotRec }).value.state).at(-1)).toBe('failed');
  });
});

describe('A snapshot, and the host it is taken on', () => {
  /**
   * snapshotOf of sn-1 for sb-1, which is on h2 now, over a snapshot record `snap` (undefined:
   * none yet); the hosts in the leader's cache are `hosts`. The steps sent, the snapshot records
   * written, and what it ended with.
   */
  const snapshotAgain = async (snap: Partial<SnapshotRec> | undefined, hosts: string[]) => {
    let rec: SnapshotRec | undefined = snap && ({ id: 'sn-1', tenantId: 't', state: 'creating', hostIds: [], labels: {}, manifestSignature: '', manifestKeyId: '', ...snap } as SnapshotRec);
    let rev = 10;
    const written: SnapshotRec[] = [];
    const ex = executorOver({
      getSandbox: async () => ({ value: sandbox('sb-1', 'h2', 'running'), modRevision: 5 }),
      getSnapshot: async () => rec && { value: rec, modRevision: rev },
      commitAt: async (w: StoreWrite[]) => {
        for (const x of w) if (x.kind === 'snapshot') written.push((rec = x.value));
        return ++rev;
      },
    });
    for (const id of hosts) ex.cache.hosts.set(id, { value: { id, state: 'ready' } as HostRec, modRevision: 1 });
    const inner = ex as unknown as { active: boolean; step: (op: OperationRec, stepId: string, hostId: string) => Promise<unknown>; snapshotOf(op: OperationRec, sandboxId: string, snapshotId: string, opts: object): Promise<SnapshotRec> };
    inner.active = true;
    const sent: string[] = [];
    inner.step = async (_op, stepId, hostId) => (sent.push(`${stepId}@${hostId}`), { vms: [] });
    const op = { id: 'op-s', tenantId: 't', kind: 'snapshot', state: 'running', targetId: 'sb-1', input: { snapshotId: 'sn-1' } } as unknown as OperationRec;
    const out = await inner.snapshotOf(op, 'sb-1', 'sn-1', {}).catch((e: unknown) => e);
    return { sent, rec, written, out };
  };

  it('runAgainAfterItsSandboxMoved_sendsItsStepToTheHostItsFirstRunBeganItOn_andRecordsItThere_notASecondSnapshotWhereTheSandboxIsNow', async () => {
    // The first run's step was done on h1 and its ready write lost; a drain moved sb-1 to h2 since.
    const { sent, rec } = await snapshotAgain({ takenOn: 'h1' }, ['h1', 'h2']);
    expect(sent).toEqual(['snapshot/sn-1@h1']);
    expect(rec).toMatchObject({ state: 'ready', hostIds: ['h1'], takenOn: 'h1' });
  });

  it('runAgainAfterTheHostItsFirstRunBeganItOnWasRemoved_failsTheSnapshot_andSendsNoStep', async () => {
    const { sent, rec, out } = await snapshotAgain({ takenOn: 'h1' }, ['h2']);
    expect(out).toMatchObject({ kind: 'failed_precondition', message: expect.stringContaining('begun on host h1, which is gone') });
    expect(sent).toEqual([]);
    expect(rec?.state).toBe('failed');
  });

  it('isRecordedInItsFirstWrite_beforeItsStep', async () => {
    const { sent, written } = await snapshotAgain(undefined, ['h2']);
    expect(sent).toEqual(['snapshot/sn-1@h2']);
    expect(written.map((r) => [r.state, r.takenOn])).toEqual([
      ['creating', 'h2'],
      ['ready', 'h2'],
    ]);
  });
});

describe('A fetch plan', () => {
  it('letsAMigrationComeOnlyFromTheHostThatTookTheSnapshot_notFromAHostThatCopiedItNorOneThatOnlySaysItHoldsIt', () => {
    // A host's heartbeat claim, or a copy it fetched (a relay, a drain's copy, a wake
    // replica), is enough for chunks (each verified against the signed manifest) but not for
    // a migration stream, which the destination loads unverified.
    const now = Date.now();
    const heard = new HeartbeatRegistry();
    for (const h of ['B', 'R', 'X']) heard.record(create(HeartbeatSchema, { hostId: h, bootId: 'b', snapshots: h === 'X' ? [{ snapshotId: 'sn-1', complete: true }] : [] }), now);
    const ex = executorOver({}, { heard, now: () => now });
    const signer = { ticket: () => ({}) };
    (ex as unknown as { deps: { signer: unknown } }).deps.signer = signer;
    const plan = (sn: SnapshotRec) => (ex as unknown as { fetchPlan(sn: SnapshotRec, hostId: string, planned?: string, migrate?: boolean): { sources: Array<{ hostId: string; mayMigrate: boolean }> } }).fetchPlan(sn, 'C', 'X', true).sources.map((x) => [x.hostId, x.mayMigrate]);
    const sn = { id: 'sn-1', tenantId: 't', state: 'ready', hostIds: ['B', 'R'], takenOn: 'B', manifestSignature: '', manifestKeyId: '' } as unknown as SnapshotRec;
    expect(plan(sn)).toEqual([
      ['X', false],
      ['B', true],
      ['R', false],
    ]);
    // The host that took it no longer holds it, or a record from before the field: none.
    expect(plan({ ...sn, hostIds: ['R'] })).toEqual([
      ['X', false],
      ['R', false],
    ]);
    const { takenOn: _, ...older } = sn;
    expect(plan(older as SnapshotRec).every(([, may]) => may === false)).toBe(true);
  });
});

describe('A hibernate run again', () => {
  it('whoseSandboxWasLostSinceItsFirstRunBeganTheSnapshot_marksThatSnapshotFailed_notLeftCreatingForGood', async () => {
    // The first run wrote the snapshot's record (creating) and sent its step; the leader failed
    // over, and the host was declared lost meanwhile. The re-run refused the lost sandbox and
    // left the record creating: no op would end it, and it could neither expire nor be deleted.
    const op = { id: 'op-h1', tenantId: 't', kind: 'hibernate', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'sb-1', input: { snapshotId: 'sn-h1' }, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {} } as unknown as OperationRec;
    const snapshot = { id: 'sn-h1', tenantId: 't', state: 'creating' } as unknown as SnapshotRec;
    const writes: StoreWrite[] = [];
    const ex = executorOver({
      getSandbox: async () => ({ value: sandbox('sb-1', 'h1', 'lost'), modRevision: 7 }),
      getSnapshot: async () => ({ value: snapshot, modRevision: 8 }),
      commitAt: async (w: StoreWrite[]) => (writes.push(...w), 9),
    });
    const inner = ex as unknown as { active: boolean; runHibernate(op: OperationRec): Promise<void> };
    inner.active = true;
    await expect(inner.runHibernate(op)).rejects.toThrow(/only a running or paused sandbox can hibernate/);
    expect(writes.map((w) => [w.kind, ...('value' in w ? [(w.value as { id: string }).id, (w.value as { state: string }).state] : [])])).toEqual([['snapshot', 'sn-h1', 'failed']]);
  });
});

describe('A hibernate of the idle rule', () => {
  it('pausesTheVmOnlyIfItIsIdleStill_whileAUsersHibernatePausesItWhatever', async () => {
    // The rule judged from a heartbeat up to a second old: the host pauses only a VM with no
    // call or guest CPU within the idle timeout (a call that began since would be cut off).
    const pauses: bigint[] = [];
    for (const reason of ['idle', '']) {
      const op = { id: `op-h-${reason}`, tenantId: 't', kind: 'hibernate', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'sb-1', input: { snapshotId: 'sn-h1', ...(reason ? { reason } : {}) }, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {} } as unknown as OperationRec;
      let sb = { ...sandbox('sb-1', 'h1', 'running'), idleTimeoutMs: 600_000 } as SandboxRec;
      let rev = 7;
      const ex = executorOver({
        getSandbox: async () => ({ value: structuredClone(sb), modRevision: rev }),
        getSnapshot: async () => undefined,
        commitAt: async (w: StoreWrite[]) => {
          for (const x of w) if (x.kind === 'sandbox') sb = x.value;
          return ++rev;
        },
      });
      const inner = ex as unknown as { active: boolean; step: (op: unknown, id: string, hostId: string, work: { case: string; value: { onlyIfIdleMs?: bigint } }) => Promise<unknown>; runHibernate(op: OperationRec): Promise<void> };
      inner.active = true;
      inner.step = async (_op, id, _h, work) => {
        if (id === 'pause' && work.case === 'pauseVm') pauses.push(work.value.onlyIfIdleMs ?? 0n);
        throw new Error('the host is not there in this test');
      };
      await inner.runHibernate(op).catch(() => undefined);
    }
    expect(pauses).toEqual([600_000n, 0n]);
  });

  it('whosePauseTheHostRefusesAsBusy_leavesTheSandboxRunning_sendsNoResume_andRecordsNoFailedHibernate', async () => {
    // A failed hibernate keeps the rule off the sandbox for IDLE_RETRY_AFTER_FAILURE_MS (10 min):
    // a sandbox busy again is not one whose hibernation failed.
    const op = { id: 'op-h-idle', tenantId: 't', kind: 'hibernate', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'sb-1', input: { snapshotId: 'sn-h1', reason: 'idle' }, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {} } as unknown as OperationRec;
    let sb = { ...sandbox('sb-1', 'h1', 'running'), idleTimeoutMs: 600_000 } as SandboxRec;
    let rev = 7;
    const ex = executorOver({
      getSandbox: async () => ({ value: structuredClone(sb), modRevision: rev }),
      getSnapshot: async () => undefined,
      getOp: async () => ({ value: structuredClone(op), modRevision: rev }),
      commitAt: async (w: StoreWrite[]) => {
        for (const x of w) if (x.kind === 'sandbox') sb = x.value;
        return ++rev;
      },
    });
    const steps: string[] = [];
    const inner = ex as unknown as { active: boolean; ops: Map<string, unknown>; step: (op: unknown, id: string) => Promise<unknown>; runHibernate(op: OperationRec): Promise<void> };
    inner.active = true;
    inner.ops.set(op.id, { value: op, modRevision: rev });
    inner.step = async (_op, id) => {
      steps.push(id);
      throw new HostStepError('h1', 'pause', 'failed_precondition', 'sandbox sb-1 is not idle: busy (a call or guest CPU) 0 s ago, under its idle timeout of 600 s; not paused for the idle hibernation', false);
    };
    await inner.runHibernate(op);
    expect(steps).toEqual(['pause']);
    expect(sb.state).toBe('running');
    expect(sb.stateReason.startsWith('hibernate failed')).toBe(false);
  });
});

describe('Executor stopped', () => {
  it('writesNothingOnceStopped_thoughTheElectionKeyStillStands_soARunnerItWokeCannotRecordWhatItNeverSaw', async () => {
    // stop() wakes runners waiting on host steps (as timed out); one that went on to record
    // its outcome (a hibernate whose VM stop was never sent, recorded hibernated) used to commit.
    let commits = 0;
    const ex = executorOver({ watchFleet: async () => () => undefined, watchOps: async () => () => undefined, followSandboxes: async () => () => undefined, commitAt: async () => ++commits }, { bus: { consumeResults: async () => async () => undefined } });
    await ex.start();
    await ex.stop();
    const before = commits;
    const inner = ex as unknown as { commit(writes: StoreWrite[]): Promise<number> };
    await expect(inner.commit([{ kind: 'alloc', value: { hostId: 'h1', allocated: res, sandboxes: 1 }, expectRevision: 1 }])).rejects.toBeInstanceOf(NotLeaderError);
    expect(commits).toBe(before);
  });

  it('leadingAgain_stillRefusesTheWritesOfARunnerOfItsEarlierTerm', async () => {
    let commits = 0;
    const ex = executorOver({ watchFleet: async () => () => undefined, watchOps: async () => () => undefined, followSandboxes: async () => () => undefined, commitAt: async () => ++commits }, { bus: { consumeResults: async () => async () => undefined } });
    const inner = ex as unknown as { term: number; runnerTerm: { run<T>(t: number, f: () => T): T }; commit(writes: StoreWrite[]): Promise<number> };
    const write: StoreWrite[] = [{ kind: 'alloc', value: { hostId: 'h1', allocated: res, sandboxes: 1 }, expectRevision: 1 }];
    await ex.start();
    const first = inner.term;
    await ex.stop();
    await ex.start();
    try {
      await expect(inner.runnerTerm.run(first, () => inner.commit(write))).rejects.toBeInstanceOf(NotLeaderError);
      expect(await inner.runnerTerm.run(inner.term, () => inner.commit(write))).toBeGreaterThan(0);
    } finally {
      await ex.stop();
    }
  });
});

describe('Executor fork children placed again', () => {
  const now = 1_000_000;
  const host = (id: string, state: HostRec['state']): HostRec => ({ id, state, cordoned: false, draining: false, capacity: { vcpus: 16, memoryMib: 16_384, diskMib: 100_000 }, accel: 'tcg', qemuVersion: '7.2.0', cpuModel: 'max', machine: 'microvm', peerAddress: '10.0.0.1:7000', linkBytesPerSecond: 1.25e9, labels: {}, registeredAt: 0, lastHeartbeatAt: now, bootId: 'b' });

  /**
   * replaceChildren of fork op-fork's children `ids`, starting on lost host `gone`, in a fleet of
   * `hosts` (ready) where `holders` hold the snapshot; `changeFirst`'s record changes right after
   * it is first read. Returns where they went, what was committed and how often the cache reloaded.
   */
  async function placeAgain(o: { ids: string[]; hosts: string[]; holders: string[]; replaced?: Record<string, unknown>; changeFirst?: string; why?: ReadonlyMap<string, string> }): Promise<{ again: string[] | undefined; placed: string[]; loads: number; reasons: string[] }> {
    const child = (id: string): SandboxRec => ({ ...sandbox(id, 'gone', 'starting'), opId: 'op-fork' });
    const records = new Map<string, { value: SandboxRec; modRevision: number }>(o.ids.map((id) => [id, { value: child(id), modRevision: 7 }]));
    const snap = { id: 'sn-1', tenantId: 't', state: 'ready', hostIds: o.holders, storedBytes: 1 << 30, logicalBytes: 1 << 30, labels: {}, vmConfig: { machine: 'microvm', memoryMib: 512, vcpus: 2, devices: [], qemuVersion: '7.2.0', accel: 'tcg', cpuModel: 'max', image: 'tiny' } } as unknown as SnapshotRec;
    const op = { id: 'op-fork', tenantId: 't', kind: 'fork', state: 'running', input: { replaced: o.replaced ?? {} }, progress: { done: 0, total: 3, message: '', bytesTransferred: 0 }, steps: {} } as unknown as OperationRec;
    let reads = 0;
    let loads = 0;
    const placed: string[] = [];
    const store = {
      getSandbox: async (_t: string, id: string) => {
        const r = records.get(id);
        // Destroyed by its user right after its first read.
        if (id === o.changeFirst && reads++ === 0) records.set(id, { value: { ...r!.value, state: 'destroyed', hostId: '', opId: '' }, modRevision: 9 });
        return r;
      },
      getSnapshot: async () => ({ value: snap, modRevision: 3 }),
      getOp: async () => ({ value: structuredClone(op), modRevision: 4 }),
      commitAt: async (writes: StoreWrite[]) => {
        for (const w of writes) if (w.kind === 'sandbox' && w.expectRevision !== records.get(w.value.id)?.modRevision) return 0;
        for (const w of writes) if (w.kind === 'sandbox') placed.push(`${w.value.id}@${w.value.hostId}`);
        return 20;
      },
    };
    const heard = new HeartbeatRegistry();
    for (const h of [...o.hosts, 'gone']) heard.record(create(HeartbeatSchema, { hostId: h, bootId: 'b', restoreSlots: 4, snapshots: o.holders.includes(h) ? [{ snapshotId: 'sn-1', complete: true }] : [] }), now);
    const ex = executorOver(store, { bus: { sendWork: async () => undefined }, heard, now: () => now });
    const inner = ex as unknown as {
      active: boolean;
      cache: { apply(c: unknown): void; load(): Promise<void> };
      replaceChildren(op: OperationRec, snapshotId: string, resources: SandboxRec['resources'], prefs: undefined, stranded: Array<{ rec: SandboxRec; rev: number }>, siblings: ReadonlyMap<string, number>, replaced: Record<string, unknown>, why?: ReadonlyMap<string, string>): Promise<{ children: Array<{ rec: SandboxRec }> } | undefined>;
    };
    inner.active = true;
    for (const h of o.hosts) inner.cache.apply({ kind: 'host', value: { value: host(h, 'ready'), modRevision: 1 } });
    inner.cache.apply({ kind: 'host', value: { value: host('gone', 'lost'), modRevision: 1 } });
    inner.cache.apply({ kind: 'alloc', value: { value: { hostId: 'gone', allocated: { vcpus: 6, memoryMib: 1536, diskMib: 3072 }, sandboxes: 3 }, modRevision: 2 } });
    inner.cache.apply({ kind: 'snapshot', value: { value: snap, modRevision: 3 } });
    // A reload after a conflict (counted) leaves the cache as set up here.
    inner.cache.load = async () => {
      loads++;
    };
    const again = await inner.replaceChildren(op, 'sn-1', res, undefined, [...records.values()].map((r) => ({ rec: r.value, rev: r.modRevision })), new Map(), { ...(o.replaced ?? {}) }, o.why);
    return { again: again?.children.map((c) => `${c.rec.id}@${c.rec.hostId}`).sort(), placed: placed.sort(), loads, reasons: again?.children.map((c) => c.rec.stateReason) ?? [] };
  }

  it('oneOfThemChangedMeanwhile_theOthersArePlacedAgainWithoutIt_afterOneConflict_notFailedAfterTenReloads', async () => {
    // X1..X3 were starting on `gone` (lost). Before the placement commits, X1 is destroyed:
    // its guard fails every attempt made with the revision read first.
    const r = await placeAgain({ ids: ['X1', 'X2', 'X3'], hosts: ['live'], holders: ['live'], changeFirst: 'X1' });
    expect(r.again).toEqual(['X2@live', 'X3@live']);
    expect(r.placed).toEqual(['X2@live', 'X3@live']);
    expect(r.loads).toBeLessThanOrEqual(2);
  });

  it('takenOffAHostThatFailedTheirRestore_sayWhyInTheirRecords', async () => {
    const r = await placeAgain({ ids: ['X'], hosts: ['live'], holders: ['live'], why: new Map([['gone', 'failed their restore']]) });
    expect(r.again).toEqual(['X@live']);
    expect(r.reasons).toEqual(['placed again: host gone failed their restore']);
  });

  it('aChildPlacedAgainBefore_isNeverPlacedBackOnTheHostItWasFirstTakenOff_thoughThatHostHoldsTheSnapshot', async () => {
    // X was taken off `old` once (told there to give it up), then `gone` was lost too.
    const r = await placeAgain({ ids: ['X'], hosts: ['old', 'other'], holders: ['old'], replaced: { X: { times: 1, by: 'again-1', from: ['old'] } } });
    expect(r.again).toEqual(['X@other']);
    // Without that record, `old` (which holds the snapshot) is where it goes.
    expect((await placeAgain({ ids: ['X'], hosts: ['old', 'other'], holders: ['old'] })).again).toEqual(['X@old']);
  });
});

describe('A fork restore round that failed on some hosts', () => {
  const round = (hostId: string, error: unknown, stepFailed = true, ids = [`${hostId}-1`]) => ({ hostId, children: ids.map((id) => ({ rec: { id } })), error, stepFailed });

  it('placesAgainTheChildrenOfLostHostsAndOfHostsThatFailedTheirRestoreForTheirOwnReasons_failsTheOthers', () => {
    const r = sortFailedRestores(
      [
        round('lost', new HostLostError('lost', 'restore/lost')),
        round('broken', new HostStepError('broken', 'restore/broken', 'internal', 'qemu died', false)),
        round('slow', new StepTimeoutError('slow', 'restore/slow', 1000)),
        round('refused', new HostStepError('refused', 'restore/refused', 'failed_precondition', 'told to give it up', false)),
        // Its step answered (its VMs run): only marking them running failed.
        round('answered', new HostStepError('answered', 'restore/answered', 'internal', 'x', false), false),
        // Failed before its step went out (no holder left to fetch from): restoreRound marks it
        // stepFailed too, but the error is no host's.
        round('unsent', new WrongStateError('snapshot', 'sn-1', 'held by no host', 'cannot fetch it')),
        // No source could deliver the snapshot (the host names the fetch plan's sources).
        round('sourceless', new HostStepError('sourceless', 'restore/sourceless', 'unavailable', '3 chunk(s) unavailable from every source: ...', true, 'fetch.sources')),
        // NATS was down: no send reached the host.
        round('unsendable', new StepTimeoutError('unsendable', 'restore/unsendable', 1000, true)),
      ],
      {},
    );
    expect(r.stranded.map((f) => f.hostId)).toEqual(['lost', 'broken', 'slow']);
    expect(Object.fromEntries(r.why)).toEqual({ lost: 'was lost', broken: 'failed their restore', slow: 'failed their restore' });
    expect(r.failing.map((f) => f.hostId)).toEqual(['refused', 'answered', 'unsent', 'sourceless', 'unsendable']);
    expect(r.hostFaults.map((f) => f.hostId)).toEqual(['lost', 'broken', 'slow']);
  });

  it('failsTheChildrenOfAHostOnceAnyOfThemWasPlacedAgainTwice', () => {
    const r = sortFailedRestores([round('broken', new HostStepError('broken', 'restore/broken', 'unavailable', 'disk full', true), true, ['A', 'B'])], { B: { times: 2, by: 'again-2', from: ['x', 'y'] } });
    expect(r.stranded).toEqual([]);
    expect(r.failing.map((f) => f.hostId)).toEqual(['broken']);
    expect(r.hostFaults.map((f) => f.hostId)).toEqual(['broken']);
  });
});

describe('A sandbox failed after its record expired', () => {
  it('releasesNoBooking_becauseTheDestroyOrFailureThatEndedItReleasedItsOwn', async () => {
    // Records are deleted only by the history expiry, of destroyed or failed sandboxes, whose
    // ending released their booking; releasing again took it off sandboxes booked since.
    const writes: StoreWrite[] = [];
    const store = {
      getSandbox: async () => undefined,
      getAlloc: async (hostId: string) => ({ value: { hostId, allocated: { vcpus: 8, memoryMib: 4096, diskMib: 8192 }, sandboxes: 4 }, modRevision: 30 }),
      commitAt: async (w: StoreWrite[]) => {
        writes.push(...w);
        return 40;
      },
    };
    const ex = executorOver(store, { bus: { sendWork: async () => undefined } });
    const inner = ex as unknown as { active: boolean; failSandbox(sb: SandboxRec, e: unknown, stop?: boolean): Promise<void> };
    inner.active = true;
    await inner.failSandbox(sandbox('sb-gone', 'H', 'starting'), new Error('restore failed'));
    expect(writes.filter((w) => w.kind === 'alloc')).toEqual([]);
  });
});

describe('A host that takes new work (replica and drain-copy targets)', () => {
  it('isOneHeardLately_whoseAgentIsNotStopping', () => {
    const now = Date.now();
    const heard = new HeartbeatRegistry();
    heard.record(create(HeartbeatSchema, { hostId: 'up', bootId: 'b' }), now);
    heard.record(create(HeartbeatSchema, { hostId: 'stopping', bootId: 'b', stopping: true }), now);
    heard.record(create(HeartbeatSchema, { hostId: 'silent', bootId: 'b' }), now - 60_000);
    const ex = executorOver({}, { heard, now: () => now }) as unknown as { takesWork(hostId: string, now: number): boolean };
    expect(['up', 'stopping', 'silent', 'never'].map((h) => ex.takesWork(h, now))).toEqual([true, false, false, false]);
  });
});

describe('Executor drain, snapshots only drained hosts hold', () => {
  it('twoHostsDrainedThatHoldASnapshotBetweenThem_eachCopiesItToAHostThatStays', async () => {
    const now = Date.now();
    const heard = new HeartbeatRegistry();
    for (const h of ['F', 'G', 'R']) heard.record(create(HeartbeatSchema, { hostId: h, bootId: 'b' }), now);
    const sn = { id: 'sn-user', tenantId: 't', state: 'ready', hostIds: ['F', 'G'], manifestSignature: '', manifestKeyId: '' } as unknown as SnapshotRec;
    let rev = 1;
    const ex = executorOver({ getSnapshot: async () => ({ value: structuredClone(sn), modRevision: rev }), commitAt: async () => ++rev }, { heard, now: () => now });
    const host = (id: string, drained: boolean): HostRec => ({ id, state: 'ready', cordoned: drained, draining: drained, capacity: res, peerAddress: `${id}:1` }) as unknown as HostRec;
    const inner = ex as unknown as { active: boolean; cache: { hosts: Map<string, unknown> }; step: (op: unknown, id: string) => Promise<unknown>; copySnapshotsOff(op: OperationRec, hostId: string, s: SnapshotRec[]): Promise<{ uncopied: string[] }> };
    for (const [id, d] of [['F', true], ['G', true], ['R', false]] as const) inner.cache.hosts.set(id, { value: host(id, d), modRevision: 1 });
    const steps: string[] = [];
    inner.active = true;
    inner.step = async (_op, id) => (steps.push(id), {});
    const op = { id: 'op-d', tenantId: 'admin' } as unknown as OperationRec;
    expect((await inner.copySnapshotsOff(op, 'F', [sn])).uncopied).toEqual([]);
    expect((await inner.copySnapshotsOff(op, 'G', [sn])).uncopied).toEqual([]);
    expect(steps).toEqual(['replicate/sn-user/R', 'replicate/sn-user/R']);
  });

  /** copySnapshotsOff of drained host F, holding `ids` alone, to ready hosts BAD and GOOD; `fails` says which copies fail. The steps sent and what it returned. */
  async function copyOff(ids: string[], fails: (snapshotId: string, hostId: string) => boolean): Promise<{ steps: string[]; uncopied: string[] }> {
    const now = Date.now();
    const heard = new HeartbeatRegistry();
    for (const h of ['F', 'BAD', 'GOOD']) heard.record(create(HeartbeatSchema, { hostId: h, bootId: 'b' }), now);
    const sns = ids.map((id) => ({ id, tenantId: 't', state: 'ready', hostIds: ['F'], manifestSignature: '', manifestKeyId: '' }) as unknown as SnapshotRec);
    let rev = 1;
    const ex = executorOver({ getSnapshot: async (_t: string, id: string) => ({ value: structuredClone(sns.find((s) => s.id === id)), modRevision: rev }), commitAt: async () => ++rev }, { heard, now: () => now });
    const host = (id: string, drained: boolean): HostRec => ({ id, state: 'ready', cordoned: drained, draining: drained, capacity: res, peerAddress: `${id}:1` }) as unknown as HostRec;
    const inner = ex as unknown as { active: boolean; cache: { hosts: Map<string, unknown> }; step: (op: unknown, id: string, hostId: string) => Promise<unknown>; copySnapshotsOff(op: OperationRec, hostId: string, s: SnapshotRec[]): Promise<{ uncopied: string[] }> };
    for (const [id, d] of [['F', true], ['BAD', false], ['GOOD', false]] as const) inner.cache.hosts.set(id, { value: host(id, d), modRevision: 1 });
    const steps: string[] = [];
    inner.active = true;
    inner.step = async (_op, id, hostId) => {
      steps.push(id);
      if (fails(id.split('/')[1]!, hostId)) throw new HostStepError(hostId, id, 'resource_exhausted', 'no space left on device', false);
      return {};
    };
    const { uncopied } = await inner.copySnapshotsOff({ id: 'op-d', tenantId: 'admin' } as unknown as OperationRec, 'F', sns);
    return { steps, uncopied };
  }

  it('aHostWhoseCopiesFail_isLeftForTheNextHost_forThatSnapshotAndTheRestOfTheDrain', async () => {
    // BAD's disk is full. Each snapshot went to BAD by the round robin, a failed one was never
    // tried elsewhere, and GOOD was never asked: the drain could not copy them off, run again.
    const r = await copyOff(['sn-1', 'sn-2', 'sn-3'], (_sn, h) => h === 'BAD');
    expect(r.uncopied).toEqual([]);
    expect(r.steps).toEqual(['replicate/sn-1/BAD', 'replicate/sn-1/GOOD', 'replicate/sn-2/GOOD', 'replicate/sn-3/GOOD']);
  });

  it('aSnapshotNoHostCouldCopy_isNamed_andSkipsNoHost_forTheSnapshotsAfterIt', async () => {
    // sn-1 fails everywhere (its own fault, or its source's): the hosts are still asked for sn-2.
    const r = await copyOff(['sn-1', 'sn-2'], (sn) => sn === 'sn-1');
    expect(r.uncopied).toEqual([expect.stringMatching(/^copying snapshot sn-1 off F failed to BAD: .*, to GOOD: /)]);
    expect(r.steps).toEqual(['replicate/sn-1/BAD', 'replicate/sn-1/GOOD', 'replicate/sn-2/BAD']);
  });

  it('snapshotsAfterTwoInARowThatNoHostCouldCopy_areTriedOnOneHostEach_untilOneIsCopied', async () => {
    // The drained host's own fault (its disk, its peer server): each of the rest would wait out
    // every host's step timeout in turn. But a snapshot that can be copied is still copied.
    const r = await copyOff(['sn-1', 'sn-2', 'sn-3', 'sn-4', 'sn-5'], (sn, to) => sn !== 'sn-4' || to !== 'GOOD');
    expect(r.steps).toEqual(['replicate/sn-1/BAD', 'replicate/sn-1/GOOD', 'replicate/sn-2/BAD', 'replicate/sn-2/GOOD', 'replicate/sn-3/BAD', 'replicate/sn-4/GOOD', 'replicate/sn-5/BAD', 'replicate/sn-5/GOOD']);
    expect(r.uncopied).toHaveLength(4);
    expect(r.uncopied.join('\n')).not.toMatch(/sn-4/);
  });
});

describe('Executor drain cancelled while it waits for the sandboxes starting on its host', () => {
  it('waitsNoLonger_movesNoneOfThem_andEndsCancelled_namingThem', async () => {
    let lists = 0;
    // X stays starting on F (its fork's step runs on) for as long as the drain would wait.
    const writes = await drainOnce('op-d', { cordoned: true, draining: true }, async () => (++lists, [{ value: sandbox('X', 'F', 'starting'), modRevision: 20 }]), true);
    // Listed once: not listed again while waiting (each wait a second, up to the steps' timeout).
    expect(lists).toBe(1);
    const final = writes.flatMap((w) => (w.kind === 'op' ? [w.value as OperationRec] : [])).at(-1);
    expect(final?.state).toBe('cancelled');
    expect(final?.error?.message).toContain('X: still starting here');
  });
});

describe('Executor drain cancelled while it copies snapshots off', () => {
  /**
   * Drain op-d of host F (`migrate` or not), nothing on it to move, three ready snapshots only F
   * holds and one ready host R to copy them to; a CancelOperation arrives during the first copy.
   * The copies sent, and the op's and the host's last writes.
   */
  async function cancelledDuringCopy(migrate: boolean): Promise<{ steps: string[]; final: OperationRec | undefined; host: HostRec | undefined }> {
    const op = { id: 'op-d', tenantId: 'admin', kind: 'drain', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'F', input: { migrate }, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {} } as unknown as OperationRec;
    const now = 1_000_000;
    const heard = new HeartbeatRegistry();
    for (const h of ['F', 'R']) heard.record(create(HeartbeatSchema, { hostId: h, bootId: 'b' }), now);
    const sns = ['sn-1', 'sn-2', 'sn-3'].map((id) => ({ id, tenantId: 't', state: 'ready', hostIds: ['F'], manifestSignature: '', manifestKeyId: '' }) as unknown as SnapshotRec);
    const host = (id: string, drained: boolean): HostRec => ({ id, state: 'ready', cordoned: drained, draining: drained, capacity: res, peerAddress: `${id}:1` }) as unknown as HostRec;
    const writes: StoreWrite[] = [];
    let rev = 10;
    const ex = leaderExecutor(
      {
        getHost: async (id: string) => ({ value: host(id, id === 'F'), modRevision: 5 }),
        listSnapshots: async () => sns.map((value) => ({ value: structuredClone(value), modRevision: 3 })),
        getSnapshot: async (_t: string, id: string) => ({ value: structuredClone(sns.find((sn) => sn.id === id)), modRevision: 3 }),
        getOp: async () => ({ value: structuredClone(op), modRevision: rev }),
        commitAt: async (w: StoreWrite[]) => (writes.push(...w), ++rev),
      },
      { heard, submit: async () => ({ id: 'op-h', state: 'succeeded' }) as unknown as OperationRec },
    );
    const inner = ex as unknown as { ops: Map<string, { value: OperationRec; modRevision: number }>; cache: { hosts: Map<string, unknown> }; step: (op: unknown, id: string) => Promise<unknown>; runDrain(op: OperationRec): Promise<void> };
    for (const id of ['F', 'R']) inner.cache.hosts.set(id, { value: host(id, id === 'F'), modRevision: 5 });
    inner.ops.set(op.id, { value: op, modRevision: rev });
    const steps: string[] = [];
    inner.step = async (_op, id) => {
      steps.push(id);
      // Recorded in the op (CancelOperation), which the op watch then shows the leader.
      op.cancelRequested = true;
      inner.ops.get(op.id)!.value.cancelRequested = true;
      return {};
    };
    await inner.runDrain(op);
    return { steps, final: writes.flatMap((w) => (w.kind === 'op' ? [w.value as OperationRec] : [])).at(-1), host: writes.flatMap((w) => (w.kind === 'host' ? [w.value as HostRec] : [])).at(-1) };
  }

  it.each([
    ['aMigratingDrain', true],
    ['aHibernatingDrain', false],
  ])('%s_cancelledDuringItsFirstCopy_copiesNoFurtherSnapshotOff_andEndsCancelled_sayingHowManyItCopied', async (_name, migrate) => {
    const { steps, final, host } = await cancelledDuringCopy(migrate);
    expect(steps).toEqual(['replicate/sn-1/R']);
    expect(final?.state).toBe('cancelled');
    expect(final?.error?.message).toContain('copied 1 of 3 snapshots off F');
    // Ended as a cancelled drain ends: still cordoned, no longer draining.
    expect([host?.cordoned, host?.draining]).toEqual([true, false]);
  });
});

describe('Executor host pass', () => {
  it('oneLostHostWhoseSandboxesCannotBeMarked_doesNotStopTheOtherLostHostsStepsFailing', async () => {
    let now = 1_000_000;
    const heard = new HeartbeatRegistry();
    for (const h of ['A', 'B']) heard.record(create(HeartbeatSchema, { hostId: h, bootId: 'b' }), now);
    let rev = 1;
    const ex = executorOver({ commitAt: async () => ++rev }, { heard, now: () => now, bus: { connectedForMs: () => Number.POSITIVE_INFINITY } });
    const inner = ex as unknown as { active: boolean; cache: { hosts: Map<string, unknown> }; markHostLost: (h: string) => Promise<void>; failStepsOn: (h: string) => void };
    for (const id of ['A', 'B']) inner.cache.hosts.set(id, { value: { id, state: 'ready', cordoned: false, draining: false, capacity: { vcpus: 0, memoryMib: 0, diskMib: 0 }, bootId: 'b', peerAddress: '', labels: {}, registeredAt: 1, lastHeartbeatAt: now }, modRevision: 1 });
    inner.active = true;
    const failed: string[] = [];
    inner.markHostLost = async (h) => {
      if (h === 'A') throw new StoreUnavailableError('listing sandboxes', new Error('blip'));
    };
    inner.failStepsOn = (h) => void failed.push(h);
    now += 20_000; // both silent past FF_HOST_LOST_AFTER (15 s here)
    await ex.reconcileHosts();
    expect(failed.sort()).toEqual(['A', 'B']);
  });
});

describe('Executor drain without migrate', () => {
  /** Runs drain op-d of host F (no migrate) over a host record and the sandboxes each list returns; the op's last write and the hibernations submitted. */
  async function hibernatingDrain(host: { cordoned: boolean; draining: boolean }, lists: (n: number) => SandboxRec[]): Promise<{ final: OperationRec | undefined; submitted: string[] }> {
    const op = { id: 'op-d', tenantId: 'admin', kind: 'drain', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'F', input: { migrate: false }, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {} } as unknown as OperationRec;
    const writes: StoreWrite[] = [];
    const submitted: string[] = [];
    let n = 0;
    let rev = 10;
    const ex = new Executor({
      store: stub<ExecutorDeps['store']>({
        getHost: async (id: string) => ({ value: { id, state: 'ready', ...host, capacity: res }, modRevision: 5 }),
        listSandboxes: async () => lists(++n).map((value) => ({ value, modRevision: 20 })),
        listSnapshots: async () => [{ value: { id: 'sn-h', tenantId: 't', state: 'creating', hostIds: ['F'] }, modRevision: 3 }],
        getOp: async (_t: string, id: string) => (id === op.id ? { value: structuredClone(op), modRevision: rev } : { value: { id, state: 'succeeded' }, modRevision: 1 }),
        commitAt: async (w: StoreWrite[]) => (writes.push(...w), ++rev),
      }),
      bus: stub<ExecutorDeps['bus']>({}),
      clock: { now: () => Date.now() },
      log: pino({ level: 'silent' }),
      heard: new HeartbeatRegistry(),
      signer: stub({}),
      config: { liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 }, stepTimeoutMs: 100, stepAttempts: 1, chunkBytes: 1 << 18 },
      submit: async (_t, key, kind, targetId) => (submitted.push(`${kind}:${targetId}`), { id: `op-${key}`, state: 'pending' }) as unknown as OperationRec,
    });
    const inner = ex as unknown as { active: boolean; ops: Map<string, unknown>; runDrain(op: OperationRec): Promise<void> };
    inner.active = true;
    inner.ops.set(op.id, { value: op, modRevision: rev });
    await inner.runDrain(op);
    return { final: writes.flatMap((w) => (w.kind === 'op' ? [w.value] : [])).at(-1), submitted };
  }

  it('aSandboxThatCameOntoTheHostDuringTheDrain_isNamed_theHostIsNotReportedDrained', async () => {
    const { final, submitted } = await hibernatingDrain({ cordoned: true, draining: true }, (n) =>
      n === 1 ? [sandbox('S1', 'F', 'running')] : [{ ...sandbox('S1', 'F', 'hibernated'), hibernationSnapshotId: 'sn-h' }, sandbox('X', 'F', 'running')],
    );
    expect(submitted).toEqual(['hibernate:S1']);
    expect(final?.state).toBe('failed');
    expect(final?.error?.message).toContain('X: came onto F during the drain');
  });

  it('ofAHostTheAdminUncordonedBeforeItRan_hibernatesNothing_andNamesWhatStays', async () => {
    const { final, submitted } = await hibernatingDrain({ cordoned: false, draining: false }, () => [sandbox('S1', 'F', 'running')]);
    expect(submitted).toEqual([]);
    expect(final?.error?.message).toContain('S1: not hibernated: F was uncordoned during the drain');
  });
});

describe('Executor drain without migrate, run again after its hibernate expired', () => {
  // The first run hibernated sb-1 (key __drain/op-d/sb-1); copying the host's snapshots off
  // took over FF_RECORD_RETENTION, history expiry deleted that hibernate with its key, and the
  // leader failed over. The re-run submitted the key again, which made a new hibernate.
  /** Re-runs drain op-d of host F with sb-1 `now` (undefined: its record is gone); the submits and the op's last write. */
  /** `o.cancelRequested`: the drain was cancelled; `o.keyAlive`: its hibernate's key has not expired, and sb-1 is `o.after` once that hibernate ended. */
  async function drainAgainAfterExpiry(now: SandboxRec | undefined, o: { cancelRequested?: boolean; keyAlive?: boolean; after?: SandboxRec } = {}): Promise<{ submit: Mock<NonNullable<ExecutorDeps['submit']>>; final: OperationRec | undefined }> {
    const cancelRequested = o.cancelRequested ?? false;
    let hibernateEnded = false;
    const op = { id: 'op-d', tenantId: 'admin', kind: 'drain', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'F', input: { migrate: false, hibernations: { 'sb-1': ['t', '__drain/op-d/sb-1'] } }, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {}, cancelRequested } as unknown as OperationRec;
    const writes: StoreWrite[] = [];
    let rev = 10;
    const submit = vi.fn<NonNullable<ExecutorDeps['submit']>>(async (_t, key) => ((hibernateEnded = true), { id: `op-${key}`, state: 'pending' }) as unknown as OperationRec);
    const ex = leaderExecutor(
      {
        getHost: async (id: string) => ({ value: { id, state: 'ready', cordoned: true, draining: true, capacity: res }, modRevision: 5 }),
        listSandboxes: async () => (now ? [{ value: now, modRevision: 20 }] : []),
        getSandbox: async () => {
          const cur = hibernateEnded && o.after ? o.after : now;
          return cur && { value: structuredClone(cur), modRevision: 20 };
        },
        getIdempotent: async (_t: string, key: string) => (o.keyAlive ? ({ opId: `op-${key}` } as never) : undefined),
        getOp: async (_t: string, id: string) => (id === op.id ? { value: structuredClone(op), modRevision: rev } : { value: { id, state: 'succeeded' }, modRevision: 1 }),
        commitAt: async (w: StoreWrite[]) => (writes.push(...w), ++rev),
      },
      { submit },
    );
    const inner = ex as unknown as { ops: Map<string, unknown>; runDrain(op: OperationRec): Promise<void> };
    inner.ops.set(op.id, { value: op, modRevision: rev });
    await inner.runDrain(op);
    return { submit, final: writes.flatMap((w) => (w.kind === 'op' ? [w.value] : [])).at(-1) };
  }

  it('aSandboxWokenOnAnotherHostSince_isNotHibernatedAgain_andCountsAsGoneFromTheHost', async () => {
    const { submit, final } = await drainAgainAfterExpiry(sandbox('sb-1', 'G', 'running'));
    expect(submit).not.toHaveBeenCalled();
    expect(final?.state).toBe('succeeded');
  });

  it('aSandboxDestroyedSinceWhoseRecordExpired_isNotSubmitted_andDoesNotFailTheDrain', async () => {
    const { submit, final } = await drainAgainAfterExpiry(undefined);
    expect(submit).not.toHaveBeenCalled();
    expect(final?.state).toBe('succeeded');
  });

  it('cancelled_whileItsOwnHibernateOfASandboxRuns_waitsForIt_andDoesNotNameThatSandboxAsLeftOnItsWay', async () => {
    // sb-1 is hibernating by this drain's own hibernate (an earlier run's, before a failover):
    // the cancel ends the wait for sandboxes on their way, but that one the drain waits for itself.
    const { final } = await drainAgainAfterExpiry(sandbox('sb-1', 'F', 'hibernating'), { cancelRequested: true, keyAlive: true, after: sandbox('sb-1', 'F', 'hibernated') });
    expect(final?.state).toBe('cancelled');
    expect(final?.error?.message).not.toContain('sb-1: still hibernating');
  });

  it('cancelled_withASandboxItOnceHibernatedNowOnItsWayByAnotherOp_namesIt', async () => {
    // Its own hibernate's key expired: sb-1 hibernating now is another op's doing, not waited for.
    const { final } = await drainAgainAfterExpiry(sandbox('sb-1', 'F', 'hibernating'), { cancelRequested: true });
    expect(final?.state).toBe('cancelled');
    expect(final?.error?.message).toContain('sb-1: still hibernating here');
  });

  it('aSandboxStillRunningOnTheDrainedHost_isHibernated', async () => {
    const { submit, final } = await drainAgainAfterExpiry(sandbox('sb-1', 'F', 'running'));
    expect(submit.mock.calls.map((c) => [c[1], c[2], c[3]])).toEqual([['__drain/op-d/sb-1', 'hibernate', 'sb-1']]);
    expect(final?.state).toBe('succeeded');
  });
});

describe('Executor cancelled fork, run again after its destroys expired', () => {
  it('destroysOnlyTheChildrenNotDestroyedYet_andNamesNoneAsFailed', async () => {
    // Its destroys (keys __cancel/op-f/<child>) ended over FF_RECORD_RETENTION ago and expired
    // with their keys: c1's record has expired too, c2 is destroyed, c3 was never destroyed.
    const op = { id: 'op-f', tenantId: 't', kind: 'fork', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'src', input: {}, cancelRequested: true, progress: { done: 0, total: 3, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {} } as unknown as OperationRec;
    const sbs: Record<string, SandboxRec> = { c2: sandbox('c2', '', 'destroyed'), c3: sandbox('c3', 'h1', 'running') };
    const writes: StoreWrite[] = [];
    let rev = 10;
    const submit = vi.fn<NonNullable<ExecutorDeps['submit']>>(async (_t, key) => ({ id: `op-${key}`, state: 'pending' }) as unknown as OperationRec);
    const ex = leaderExecutor(
      {
        getSandbox: async (_t: string, id: string) => sbs[id] && { value: structuredClone(sbs[id]), modRevision: 20 },
        getIdempotent: async () => undefined,
        getOp: async (_t: string, id: string) => (id === op.id ? { value: structuredClone(op), modRevision: rev } : { value: { id, state: 'succeeded' }, modRevision: 1 }),
        commitAt: async (w: StoreWrite[]) => (writes.push(...w), ++rev),
      },
      { submit },
    );
    const inner = ex as unknown as { ops: Map<string, unknown>; destroyForCancel(op: OperationRec, result: OperationRec['result'], ids: readonly string[]): Promise<void> };
    inner.ops.set(op.id, { value: op, modRevision: rev });
    await inner.destroyForCancel(op, { sandboxIds: ['c1', 'c2', 'c3'] }, ['c1', 'c2', 'c3']);
    expect(submit.mock.calls.map((c) => [c[1], c[2], c[3]])).toEqual([['__cancel/op-f/c3', 'destroy', 'c3']]);
    const final = writes.flatMap((w) => (w.kind === 'op' ? [w.value] : [])).at(-1);
    expect(final?.state).toBe('cancelled');
    expect(final?.error?.message).toContain('destroyed 3 of the 3 sandboxes');
  });
});

describe('Executor drain, run again after the sandbox it was moving was lost', () => {
  // An earlier run booked T for S1 and restored its copy there; then F's VM of S1 was lost (the
  // claim ended) and the leader failed over. The re-run took "lost" as moved on and removed the
  // only live copy, where the first run would have switched to it.
  it('aCopyWhoseRestoreHadSucceeded_becomesTheSandbox_notRemoved', async () => {
    const sent: string[] = [];
    const writes = await drainAgain({ S1: { snapshotId: 'sn-1', toHostId: 'T', wasPaused: false } }, [{ ...sandbox('S1', 'F', 'lost'), lostFromOp: 'op-d1' }], sent, { answered: ['migrate/S1/restore'] });
    expect(sent).toContain('migrate/S1/restore@T');
    expect(sent.filter((st) => st.includes('undo-dest') || st.includes('destroy-dest'))).toEqual([]);
    const sbs = writes.filter((w): w is Extract<StoreWrite, { kind: 'sandbox' }> => w.kind === 'sandbox');
    expect(sbs.map((w) => [w.value.id, w.value.hostId, w.value.state])).toEqual([['S1', 'T', 'running']]);
    // Its capacity on F went when it was lost; T's booking is its own now.
    expect(writes.filter((w) => w.kind === 'alloc')).toEqual([]);
    // Marked switched (in the switch's transaction): a run again only stops the source VM.
    const marks = writes.flatMap((w) => (w.kind === 'op' ? [(w.value.input as { migrations: Record<string, { switched?: boolean }> }).migrations['S1']?.switched] : []));
    expect(marks).toContain(true);
  });

  it('aCopyWhoseRestoreHadSucceeded_overItsTenantsQuotaNow_isRemoved_andTheSandboxStaysLost', async () => {
    const sent: string[] = [];
    const writes = await drainAgain({ S1: { snapshotId: 'sn-1', toHostId: 'T', wasPaused: false } }, [{ ...sandbox('S1', 'F', 'lost'), lostFromOp: 'op-d1' }], sent, { answered: ['migrate/S1/restore'], quota: { sandboxes: 1, inUse: 1 } });
    expect(sent).toContain('migrate/S1/destroy-dest@T');
    expect(writes.filter((w) => w.kind === 'sandbox')).toEqual([]);
    const allocs = writes.filter((w): w is Extract<StoreWrite, { kind: 'alloc' }> => w.kind === 'alloc');
    expect(allocs.map((w) => [w.value.hostId, w.value.allocated.vcpus])).toEqual([['T', 6]]);
  });

  it('aCopyWhoseRestoreFails_isUndone', async () => {
    const sent: string[] = [];
    const writes = await drainAgain({ S1: { snapshotId: 'sn-1', toHostId: 'T', wasPaused: false } }, [{ ...sandbox('S1', 'F', 'lost'), lostFromOp: 'op-d1' }], sent, { answered: [] });
    expect(sent).toContain('migrate/S1/restore@T');
    expect(sent).toContain('migrate/S1/undo-dest@T');
    expect(writes.filter((w) => w.kind === 'sandbox')).toEqual([]);
    const allocs = writes.filter((w): w is Extract<StoreWrite, { kind: 'alloc' }> => w.kind === 'alloc');
    expect(allocs.map((w) => [w.value.hostId, w.value.allocated.vcpus])).toEqual([['T', 6]]);
  });
});

describe('Executor drain, run again after its host was lost and came back', () => {
  it('aMigrationBookedBeforeTheLoss_whoseSandboxWasTakenBackUnclaimed_isUndone_notRestoredFromItsOldSnapshot', async () => {
    // S1's migration F -> T had booked T and taken sn-1; F was lost (ending the drain's claim)
    // and came back, and S1 was taken back, unclaimed: its user may have resumed it since.
    const sent: string[] = [];
    const writes = await drainAgain({ S1: { snapshotId: 'sn-1', toHostId: 'T', wasPaused: false } }, [{ ...sandbox('S1', 'F', 'paused'), opId: '' }], sent);
    const allocs = writes.filter((w): w is Extract<StoreWrite, { kind: 'alloc' }> => w.kind === 'alloc');
    expect(allocs.map((w) => [w.value.hostId, w.value.allocated.vcpus])).toEqual([['T', 6]]);
    expect(sent).toContainEqual(expect.stringMatching(/^.*S1.*undo-dest.*@T$/));
    // Paused by that migration (it ran when claimed), taken back paused: told to run again.
    expect(sent).toContainEqual(expect.stringMatching(/^.*S1.*resume-taken-back.*@F$/));
    // The attempt is retired: a new one takes a snapshot of its own.
    const ops = writes.filter((w): w is Extract<StoreWrite, { kind: 'op' }> => w.kind === 'op');
    const migrations = ops.map((w) => (w.value.input as { migrations?: Record<string, { snapshotId: string; toHostId?: string }> }).migrations?.['S1']);
    expect(migrations.some((m) => m !== undefined && m.snapshotId === '' && m.toHostId === undefined)).toBe(true);
  });
});

describe('Executor drain, its host lost and back during a migration', () => {
  /**
   * Runs migrate() of S1 (running on F, claimed by drain op-d1, its copy to restore on T, its
   * snapshot ready), calling `onRestore` when the restore step on T is sent; every step answers
   * at once. What the sandbox record became, the steps sent (and host work), the hosts whose
   * capacity was written, and how migrate() ended.
   */
  async function migrateWhile(onRestore: (ctx: { setSandbox: (f: (sb: SandboxRec) => SandboxRec) => void; setHost: (id: string, state: string) => void }) => void, quota?: { sandboxes: number; inUse: number }): Promise<{ sb: SandboxRec; steps: string[]; allocs: string[]; outcome: unknown }> {
    const op = { id: 'op-d1', tenantId: 'admin', kind: 'drain', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'F', input: { migrate: true, migrations: { S1: { snapshotId: 'sn-1', toHostId: 'T', wasPaused: false } } }, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {} } as unknown as OperationRec;
    let rev = 10;
    let sb: SandboxRec = { ...sandbox('S1', 'F', 'running'), opId: '' };
    const sn = { id: 'sn-1', tenantId: 't', state: 'ready', hostIds: ['F', 'T'], manifestSignature: '', manifestKeyId: '' } as unknown as SnapshotRec;
    const allocs: string[] = [];
    const store = {
      getOp: async () => ({ value: structuredClone(op), modRevision: rev }),
      getSandbox: async () => ({ value: structuredClone(sb), modRevision: rev }),
      getSnapshot: async () => ({ value: sn, modRevision: 3 }),
      getAlloc: async (hostId: string) => ({ value: { hostId, allocated: { vcpus: 8, memoryMib: 4096, diskMib: 8192 }, sandboxes: 4 }, modRevision: 30 }),
      commitAt: async (w: StoreWrite[]) => {
        for (const x of w) if (x.kind === 'sandbox') sb = x.value;
        for (const x of w) if (x.kind === 'alloc') allocs.push(x.value.hostId);
        return ++rev;
      },
    };
    const steps: string[] = [];
    const ex = executorOver(store, {
      bus: { sendWork: async (hostId: string, w: { stepId: string }) => void steps.push(`${w.stepId}@${hostId}`) },
      ...(quota
        ? {
            quotas: () => ({ sandboxes: quota.sandboxes }),
            usage: { usage: async () => ({ sandboxes: quota.inUse, memoryMib: 0, snapshotBytes: 0, pendingSandboxes: 0, pendingMemoryMib: 0 }) },
          }
        : {}),
    });
    const inner = ex as unknown as { active: boolean; ops: Map<string, unknown>; cache: { hosts: Map<string, unknown> }; step: (op: unknown, id: string, hostId: string) => Promise<unknown>; migrate(op: OperationRec, sb: SandboxRec): Promise<void> };
    inner.active = true;
    inner.ops.set(op.id, { value: op, modRevision: rev });
    const setHost = (id: string, state: string): void => void inner.cache.hosts.set(id, { value: { id, state, cordoned: id === 'F', draining: id === 'F' }, modRevision: 2 });
    setHost('F', 'ready');
    inner.step = async (_op, id, hostId) => {
      steps.push(`${id}@${hostId}`);
      if (id.endsWith('/restore')) onRestore({ setSandbox: (f) => (sb = f(sb)), setHost });
      return { vms: [{ sandboxId: 'S1' }] };
    };
    const outcome = await inner.migrate(op, sb).then(
      () => 'switched',
      (e: unknown) => e,
    );
    return { sb, steps, allocs, outcome };
  }

  it('theSwitch_ofASandboxTakenBackUnclaimedWhileItsCopyWasRestored_removesTheCopy_andKeepsTheSourceVm', async () => {
    // While the copy is restored on T, F is lost (the claim ends) and comes back: the VM is
    // taken back as it runs, unclaimed, and its user goes on using it.
    const r = await migrateWhile(({ setSandbox }) => setSandbox((sb) => ({ ...sb, state: 'running', opId: '' })));
    expect(String(r.outcome)).toMatch(/moved on during its migration/);
    expect(r.sb.hostId).toBe('F');
    expect(r.steps).toContain('migrate/S1/destroy-dest@T');
    expect(r.steps.filter((s) => s.includes('destroy-source') || s.includes('resume-taken-back'))).toEqual([]);
  });

  it('theSwitch_ofASandboxTakenBackPausedAsTheMigrationLeftIt_removesTheCopy_andRunsTheSourceAgain', async () => {
    const r = await migrateWhile(({ setSandbox }) => setSandbox((sb) => ({ ...sb, state: 'paused', opId: '' })));
    expect(String(r.outcome)).toMatch(/moved on during its migration/);
    expect(r.steps).toContain('migrate/S1/destroy-dest@T');
    expect(r.steps).toContain('migrate/S1/resume-taken-back@F');
    expect(r.steps.filter((s) => s.includes('destroy-source'))).toEqual([]);
    expect(r.sb).toMatchObject({ hostId: 'F', state: 'running', opId: '' });
  });

  it('theSwitch_ofASandboxLostWhileItsCopyWasRestored_whoseTenantMadeAReplacementUpToItsQuota_removesTheCopy_andKeepsItLost', async () => {
    // F's VM died while the copy was restored (the sandbox lost, its claim ended); a lost
    // sandbox does not count against the quota, and its tenant used the room since.
    const r = await migrateWhile(({ setSandbox }) => setSandbox((sb) => ({ ...sb, state: 'lost', opId: '', lostFromOp: 'op-d1' })), { sandboxes: 1, inUse: 1 });
    expect(String(r.outcome)).toMatch(/quota/);
    expect(r.sb).toMatchObject({ hostId: 'F', state: 'lost' });
    expect(r.allocs).toEqual(['T']); // the booking on T released
    expect(r.steps).toContain('migrate/S1/destroy-dest@T');
    expect(r.steps.filter((s) => s.includes('destroy-source'))).toEqual([]);
  });

  it('theSwitch_ofASandboxLostWhileItsCopyWasRestored_withinItsTenantsQuota_makesTheCopyTheSandbox', async () => {
    const r = await migrateWhile(({ setSandbox }) => setSandbox((sb) => ({ ...sb, state: 'lost', opId: '', lostFromOp: 'op-d1' })), { sandboxes: 2, inUse: 1 });
    expect(r.outcome).toBe('switched');
    expect(r.sb).toMatchObject({ hostId: 'T', state: 'running' });
    expect(r.allocs).toEqual([]); // released on F when it was lost; booked on T already
  });

  it('theSwitch_ofASandboxLostOtherThanFromUnderThisMigration_removesTheCopy_andKeepsItLost', async () => {
    // F lost (ending the claim), back: the sandbox taken back, run on, then lost again,
    // unclaimed. The copy is of before it ran on: not the sandbox.
    const r = await migrateWhile(({ setSandbox }) => setSandbox((sb) => ({ ...sb, state: 'lost', opId: '' })), { sandboxes: 2, inUse: 1 });
    expect(String(r.outcome)).toMatch(/moved on during its migration/);
    expect(r.sb).toMatchObject({ hostId: 'F', state: 'lost' });
    expect(r.steps).toContain('migrate/S1/destroy-dest@T');
  });

  it('theSwitch_ontoADestinationLostAfterItsRestoreAnswered_isUndone_theSourceRunsOnUnclaimed', async () => {
    // The restore answered; then T's heartbeats stop and it is marked lost.
    const r = await migrateWhile(({ setHost }) => setHost('T', 'lost'));
    expect(String(r.outcome)).toMatch(/host T was lost/);
    expect(r.sb).toMatchObject({ hostId: 'F', opId: '' });
    expect(r.allocs).toEqual(['T']); // the booking on T released; F's kept
    expect(r.steps).toContain('migrate/S1/resume@F');
    expect(r.steps).toContain('migrate/S1/undo-dest@T');
    expect(r.steps.filter((s) => s.includes('destroy-source'))).toEqual([]);
  });
});

describe('Executor operation errors', () => {
  it('anInternalErrorsText_goesToDetail_theRecordsMessageIsTheGenericOne', async () => {
    const { errorOf } = await import('./executor.ts');
    const { ForkfleetError } = await import('../../proto/errors.ts');
    const e = errorOf(new ForkfleetError('internal', 'host h answered with the manifest of another snapshot ("sn-b")', { retryable: false }));
    expect(e).toEqual({ kind: 'internal', message: 'internal error in the scheduler (its log has the cause)', retryable: false, detail: 'host h answered with the manifest of another snapshot ("sn-b")' });
    const { StepTimeoutError } = await import('./errors.ts');
    const t = new StepTimeoutError('h', 'restore', 5);
    expect(errorOf(t).message).toBe(t.message);
  });
});

describe('Executor fork cancelled while queued for placement', () => {
  const now = 1_000_000;
const host = (id: string): HostRec => ({ id, state: 'ready', cordoned: false, draining: false, capacity: { vcpus: 16, memoryMib: 16_384, diskMib: 100_000 }, accel: 'tcg', qemuVersion: '7.2.0', cpuModel: 'max', machine: 'microvm', peerAddress: '10.0.0.1:7000', linkBytesPerSecond: 1.25e8, labels: {}, registeredAt: 0, lastHeartbeatAt: now, bootId: 'b' });
const snap = { id: 'sn-1', tenantId: 't', state: 'ready', hostIds: ['h1'], storedBytes: 256 << 20, logicalBytes: 256 << 20, labels: {}, vmConfig: { machine: 'microvm', memoryMib: 256, vcpus: 1, devices: [], qemuVersion: '7.2.0', accel: 'tcg', cpuModel: 'max', image: 'tiny' }, inherits: { resources: { vcpus: 1, memoryMib: 256, diskMib: 1024 }, image: 'tiny', idleTimeoutMs: null, afterResume: [], allowEgress: false, allowCidrs: [] } } as unknown as SnapshotRec;

  it('aForkCancelledWhileItsPlacementCommits_placesNoChild_andBooksNothing', async () => {
  const op = { id: 'op-f', tenantId: 't', kind: 'fork', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'src', input: { snapshotId: 'sn-1', sandboxId: 'src', count: 2, childIds: ['c1', 'c2'], lineageId: 'l' }, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {} } as unknown as OperationRec;
  let opRec = { value: structuredClone(op), modRevision: 4 };
  const sbs = new Map<string, { value: SandboxRec; modRevision: number }>();
  let rev = 10;
  const writes: StoreWrite[] = [];
  const sent: string[] = [];
  let first = true;
  const ref: { inner?: { ops: Map<string, unknown> } } = {};
  const store = {
    getSnapshot: async () => ({ value: snap, modRevision: 3 }),
    getOp: async () => structuredClone(opRec),
    getSandbox: async (_t: string, id: string) => sbs.get(id),
    getAlloc: async (hostId: string) => ({ value: { hostId, allocated: { vcpus: 2, memoryMib: 512, diskMib: 2048 }, sandboxes: 2 }, modRevision: 30 }),
    commitAt: async (w: StoreWrite[]) => {
      const opW = w.find((x) => x.kind === 'op') as Extract<StoreWrite, { kind: 'op' }> | undefined;
      if (first && opW && w.some((x) => x.kind === 'sandbox')) {
        // The user's CancelOperation landed just before the placement commit: its op guard fails.
        first = false;
        opRec = { value: { ...structuredClone(opRec.value), cancelRequested: true } as OperationRec, modRevision: 5 };
        ref.inner!.ops.set(op.id, structuredClone(opRec)); // as the op watch delivers it
        return 0;
      }
      if (opW && opW.expectRevision !== opRec.modRevision) return 0;
      rev++;
      writes.push(...w);
      for (const x of w) if (x.kind === 'sandbox') sbs.set(x.value.id, { value: x.value, modRevision: rev });
      if (opW) opRec = { value: opW.value, modRevision: rev };
      return rev;
    },
  };
  const heard = new HeartbeatRegistry();
  heard.record(create(HeartbeatSchema, { hostId: 'h1', bootId: 'b', restoreSlots: 4, snapshots: [{ snapshotId: 'sn-1', complete: true }] }), now);
  const ex = new Executor({
    store: stub<ExecutorDeps['store']>(store),
    bus: stub<ExecutorDeps['bus']>({ sendWork: async (h: string, w: { stepId: string }) => void sent.push(`${w.stepId}@${h}`) }),
    clock: { now: () => now },
    log: pino({ level: 'silent' }),
    heard,
    signer: stub({}),
    config: { liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 }, stepTimeoutMs: 100, stepAttempts: 1, chunkBytes: 1 << 18 },
  });
  const inner = ex as unknown as { active: boolean; ops: Map<string, unknown>; running: Map<string, unknown>; cache: { apply(c: unknown): void; load: () => Promise<void> }; runFork(op: OperationRec): Promise<void> };
  ref.inner = inner;
  inner.active = true;
  inner.cache.apply({ kind: 'host', value: { value: host('h1'), modRevision: 1 } });
  inner.cache.apply({ kind: 'snapshot', value: { value: snap, modRevision: 3 } });
  inner.cache.load = async () => undefined;
  inner.ops.set(op.id, structuredClone(opRec));
  inner.running.set(op.id, Promise.resolve());
  const err = await inner.runFork(op).then(() => undefined, (e: unknown) => e);
  const sbWrites = writes.filter((w) => w.kind === 'sandbox');
    expect(err).toBeInstanceOf(OperationCancelledError);
    expect(sbWrites).toEqual([]);
    expect(writes.filter((w) => w.kind === 'alloc')).toEqual([]);
    expect(sent).toEqual([]);
  });
});

describe('Executor restore round', () => {
  it('ofAPlanWhoseHostsNameEachOtherAsSources_sendsOneRestorePerHostAndEnds', async () => {
    const now = Date.now();
    const snap = { id: 'sn-1', tenantId: 't', state: 'ready', hostIds: ['H'], manifestSignature: '', manifestKeyId: '' } as unknown as SnapshotRec;
    const sends: string[] = [];
    const heard = new HeartbeatRegistry();
    for (const h of ['H', 'X', 'Y']) heard.record(create(HeartbeatSchema, { hostId: h, bootId: 'b', restoreSlots: 4, snapshots: h === 'H' ? [{ snapshotId: 'sn-1', complete: true }] : [] }), now);
    const ex = new Executor({
      store: stub<ExecutorDeps['store']>({ getSnapshot: async () => ({ value: snap, modRevision: 3 }) }),
      bus: stub<ExecutorDeps['bus']>({ sendWork: async (h: string, w: { stepId: string }) => void sends.push(`${w.stepId}@${h}`) }),
      clock: { now: () => Date.now() },
      log: pino({ level: 'silent' }),
      heard,
      signer: stub({ ticket: () => ({}) }),
      config: { liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 }, stepTimeoutMs: 50, stepAttempts: 1, chunkBytes: 1 << 18 },
    });
    const inner = ex as unknown as { active: boolean; restoreRound(...a: unknown[]): Promise<Array<{ hostId: string }>> };
    inner.active = true;
    const kid = (id: string, hostId: string): { rec: SandboxRec; rev: number } => ({ rec: { id, tenantId: 't', hostId, resources: { vcpus: 1, memoryMib: 256, diskMib: 1024 }, hostname: id, allowEgress: false, afterResume: [] } as unknown as SandboxRec, rev: 1 });
    const batch = ['X', 'Y'].flatMap((h) => [1, 2, 3].map((i) => kid(`${h.toLowerCase()}${i}`, h)));
    const op = { id: 'op-f', tenantId: 't', kind: 'fork' } as OperationRec;
    // X -> Y from a first placement, Y -> X from a placement again after a host loss.
    const failed = await inner.restoreRound(op, 'sn-1', snap, batch, [{ sourceHostId: 'X', destinationHostId: 'Y', wave: 2 }, { sourceHostId: 'Y', destinationHostId: 'X', wave: 1 }], 'again-1', () => undefined);
    // No host answers here: each step times out once; what matters is one send per host, and an end.
    expect(sends.sort()).toEqual(['restore/X/again-1@X', 'restore/Y/again-1@Y']);
    expect(failed.map((f) => f.hostId).sort()).toEqual(['X', 'Y']);
  });
});

/** An executor for restore rounds of snapshot sn-1, which host H holds, with `hosts` heard from (no store, no bus: tests stub its steps). */
function roundExecutor(hosts: string[]): { snap: SnapshotRec; ex: Executor } {
  const snap = { id: 'sn-1', tenantId: 't', state: 'ready', hostIds: ['H'], manifestSignature: '', manifestKeyId: '' } as unknown as SnapshotRec;
  const heard = new HeartbeatRegistry();
  for (const h of hosts) heard.record(create(HeartbeatSchema, { hostId: h, bootId: 'b', restoreSlots: 4, snapshots: h === 'H' ? [{ snapshotId: 'sn-1', complete: true }] : [] }), Date.now());
  const ex = new Executor({
    store: stub<ExecutorDeps['store']>({ getSnapshot: async () => ({ value: snap, modRevision: 3 }) }),
    bus: stub<ExecutorDeps['bus']>({}),
    clock: { now: () => Date.now() },
    log: pino({ level: 'silent' }),
    heard,
    signer: stub({ ticket: () => ({}) }),
    config: { liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 }, stepTimeoutMs: 60_000, stepAttempts: 1, chunkBytes: 1 << 18 },
  });
  return { snap, ex };
}

describe('Executor restore round, its children running', () => {
  it('whoseHostCannotBeRecordedAsAHolderOfTheSnapshot_failsNoChild_theRecordBeingBookkeeping', async () => {
    const { snap, ex } = roundExecutor(['H', 'X']);
    const inner = ex as unknown as {
      active: boolean;
      step: (op: unknown, id: string, hostId: string) => Promise<unknown>;
      markRunning: (sbs: ReadonlyArray<{ rec: SandboxRec }>) => Promise<string[]>;
      addHolder: (tenantId: string, snapshotId: string, hostId: string) => Promise<void>;
      restoreRound(...a: unknown[]): Promise<Array<{ hostId: string }>>;
    };
    inner.active = true;
    const kids = [1, 2, 3].map((i) => ({ rec: { id: `x${i}`, tenantId: 't', hostId: 'X', resources: { vcpus: 1, memoryMib: 256, diskMib: 1024 }, hostname: `x${i}`, allowEgress: false, afterResume: [] } as unknown as SandboxRec, rev: 1 }));
    inner.step = async () => create(HostResultSchema, { vms: kids.map((k) => ({ sandboxId: k.rec.id })) });
    inner.markRunning = async (sbs) => sbs.map((s) => s.rec.id);
    // The snapshot record changed under every try (20 conflicts): X is not recorded as a holder.
    inner.addHolder = async () => {
      throw new ConflictError("snapshot sn-1's holders");
    };
    const running: string[] = [];
    const failed = await inner.restoreRound({ id: 'op-f', tenantId: 't', kind: 'fork' } as OperationRec, 'sn-1', snap, kids, [{ sourceHostId: 'H', destinationHostId: 'X', wave: 1 }], '', (ids: string[]) => void running.push(...ids));
    expect(failed).toEqual([]);
    expect(running).toEqual(['x1', 'x2', 'x3']);
  });
});

describe('Executor restore round of a transfer tree', () => {
  /**
   * A restore round over `hosts` (H holds sn-1; roundExecutor) whose step on `gated` lasts until
   * `release()`, every step failing after: `sends` lists the hosts in the order their steps went.
   * Three children on each host of `on`: hosts with fewer would restore theirs by migration,
   * outside the transfer plan.
   */
  const gatedRound = (hosts: string[], gated: string, on: string[], transfers: Array<{ sourceHostId: string; destinationHostId: string; wave: number }>) => {
    const { snap, ex } = roundExecutor(hosts);
    const inner = ex as unknown as { active: boolean; step: (op: unknown, id: string, hostId: string) => Promise<unknown>; restoreRound(...a: unknown[]): Promise<Array<{ hostId: string }>> };
    inner.active = true;
    const sends: string[] = [];
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    inner.step = async (_op, _id, hostId) => {
      sends.push(hostId);
      if (hostId === gated) await gate;
      throw new Error(`no agent on ${hostId} in this test`);
    };
    const kid = (id: string, hostId: string): { rec: SandboxRec; rev: number } => ({ rec: { id, tenantId: 't', hostId, resources: { vcpus: 1, memoryMib: 256, diskMib: 1024 }, hostname: id, allowEgress: false, afterResume: [] } as unknown as SandboxRec, rev: 1 });
    const batch = on.flatMap((h) => [1, 2, 3].map((i) => kid(`${h.toLowerCase()}${i}`, h)));
    const round = inner.restoreRound({ id: 'op-f', tenantId: 't', kind: 'fork' } as OperationRec, 'sn-1', snap, batch, transfers, '', () => undefined);
    return { ex, sends, release, round };
  };

  it('aSecondWaveHost_startsItsCopyOnceItsRelaySaysTheSnapshotIsStored_notOnlyOnceTheRelaysWholeStepHasEnded', async () => {
    // H holds sn-1; R copies it from H (wave 1) and L from R (wave 2). R's step goes on (its
    // children restore, their hooks run) long after the snapshot is stored there.
    const { ex, sends, release, round } = gatedRound(['H', 'R', 'L'], 'R', ['R', 'L'], [{ sourceHostId: 'H', destinationHostId: 'R', wave: 1 }, { sourceHostId: 'R', destinationHostId: 'L', wave: 2 }]);
    try {
      await vi.waitFor(() => expect(sends).toEqual(['R']));
      // R's word of another op's fetch (since deleted there, perhaps) says nothing of this one's.
      ex.hostEvent(create(HostEventSchema, { hostId: 'R', type: HostEventType.SNAPSHOT_STORED, snapshotId: 'sn-1', opId: 'op-earlier' }));
      await new Promise((r) => setTimeout(r, 30));
      expect(sends).toEqual(['R']); // L waits for its source
      ex.hostEvent(create(HostEventSchema, { hostId: 'R', type: HostEventType.SNAPSHOT_STORED, snapshotId: 'sn-1', opId: 'op-f' }));
      await vi.waitFor(() => expect(sends).toEqual(['R', 'L']));
    } finally {
      release();
      await round;
    }
  });

  it('aHostCopyingFromTheHolder_startsAtOnce_notAfterTheHoldersOwnChildrenHaveRestored', async () => {
    // H holds sn-1 and restores its own children; X copies sn-1 from H (wave 1). H's step
    // fetches nothing and never says SNAPSHOT_STORED for this op: X waited for H's whole step
    // (seconds for a fork of 64 that puts 20 children on H), though H could serve at once.
    const { sends, release, round } = gatedRound(['H', 'X'], 'H', ['H', 'X'], [{ sourceHostId: 'H', destinationHostId: 'X', wave: 1 }]);
    try {
      await vi.waitFor(() => expect(new Set(sends)).toEqual(new Set(['H', 'X'])));
    } finally {
      release();
      await round;
    }
  });
});

describe('Executor restore round: the holders it records', () => {
  const roundOver = (answer: { bytesFetched: bigint; restoredByMigration?: boolean }) => {
    const { snap, ex } = roundExecutor(['H', 'X']);
    // X fetched sn-1 in a run of this fork before a failover: its heartbeats say it holds it.
    (ex as unknown as { deps: { heard: HeartbeatRegistry } }).deps.heard.record(create(HeartbeatSchema, { hostId: 'X', bootId: 'b', restoreSlots: 4, snapshots: [{ snapshotId: 'sn-1', complete: true }] }), Date.now());
    const inner = ex as unknown as {
      active: boolean;
      step: (op: unknown, id: string, hostId: string, work: { value: { fetch?: unknown } }) => Promise<unknown>;
      markRunning: (sbs: ReadonlyArray<{ rec: SandboxRec }>) => Promise<string[]>;
      addHolder: (tenantId: string, snapshotId: string, hostId: string) => Promise<void>;
      restoreRound(...a: unknown[]): Promise<Array<{ hostId: string }>>;
    };
    inner.active = true;
    const kids = [1, 2, 3].map((i) => ({ rec: { id: `x${i}`, tenantId: 't', hostId: 'X', resources: { vcpus: 1, memoryMib: 256, diskMib: 1024 }, hostname: `x${i}`, allowEgress: false, afterResume: [] } as unknown as SandboxRec, rev: 1 }));
    const sent: unknown[] = [];
    // The host answers from its journal: the result of the step it ran for the first run.
    inner.step = async (_op, _id, _hostId, work) => {
      sent.push(work.value.fetch);
      return create(HostResultSchema, { vms: kids.map((k) => ({ sandboxId: k.rec.id })), bytesFetched: answer.bytesFetched, restoredByMigration: answer.restoredByMigration ?? false });
    };
    inner.markRunning = async (sbs) => sbs.map((x) => x.rec.id);
    const holders: string[] = [];
    inner.addHolder = async (_t, _s, h) => void holders.push(h);
    const run = () => inner.restoreRound({ id: 'op-f', tenantId: 't', kind: 'fork' } as OperationRec, 'sn-1', snap, kids, [{ sourceHostId: 'H', destinationHostId: 'X', wave: 1 }], '', () => undefined);
    return { run, sent, holders };
  };

  it('aRunAgainThatSendsNoFetchPlan_recordsTheHostAsAHolder_whenItsAnswerSaysItFetched', async () => {
    const { run, sent, holders } = roundOver({ bytesFetched: 70_000_000n });
    expect(await run()).toEqual([]);
    expect(sent).toEqual([undefined]);
    expect(holders).toEqual(['X']);
  });

  it('recordsNoHolder_whenTheAnswerSaysItsVmsCameByMigration', async () => {
    const { run, holders } = roundOver({ bytesFetched: 140_000_000n, restoredByMigration: true });
    expect(await run()).toEqual([]);
    expect(holders).toEqual([]);
  });
});

describe('Executor fork run again', () => {
  const now = 1_000_000;
  const host = (id: string, state: HostRec['state']): HostRec => ({ id, state, cordoned: false, draining: false, capacity: { vcpus: 16, memoryMib: 16_384, diskMib: 100_000 }, accel: 'tcg', qemuVersion: '7.2.0', cpuModel: 'max', machine: 'microvm', peerAddress: '10.0.0.1:7000', linkBytesPerSecond: 1.25e8, labels: {}, registeredAt: 0, lastHeartbeatAt: now, bootId: 'b' });
const snap = { id: 'sn-1', tenantId: 't', state: 'ready', hostIds: ['live'], storedBytes: 256 << 20, logicalBytes: 256 << 20, labels: {}, vmConfig: { machine: 'microvm', memoryMib: 256, vcpus: 1, devices: [], qemuVersion: '7.2.0', accel: 'tcg', cpuModel: 'max', image: 'tiny' }, inherits: { resources: { vcpus: 1, memoryMib: 256, diskMib: 1024 }, image: 'tiny', idleTimeoutMs: null, afterResume: [], allowEgress: false, allowCidrs: [] } } as unknown as SnapshotRec;

  it('runAgainAfterItsChildrenWerePlacedAgain_tellsTheHostsTheyWereTakenOffToGiveThemUpAgain', async () => {
  const op = { id: 'op-f', tenantId: 't', kind: 'fork', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'src', input: { snapshotId: 'sn-1', sandboxId: 'src', count: 1, childIds: ['X'], lineageId: 'l', transfers: [], replaced: { X: { times: 1, by: 'again-1', from: ['gone'] } } }, progress: { done: 0, total: 1, message: '', bytesTransferred: 0 }, result: { sandboxIds: ['X'], snapshotId: 'sn-1' }, error: null, steps: {} } as unknown as OperationRec;
  let opRec = { value: structuredClone(op), modRevision: 40 };
  const x: SandboxRec = { id: 'X', tenantId: 't', state: 'starting', stateReason: 'placed again', hostId: 'live', resources: { vcpus: 1, memoryMib: 256, diskMib: 1024 }, image: 'tiny', sourceSnapshotId: 'sn-1', lineageId: 'l', hostname: 'X', labels: {}, ttlMs: null, idleTimeoutMs: null, allowEgress: false, createdAt: 1, updatedAt: 1, runningMsBefore: 0, runningSince: null, hibernationSnapshotId: '', opId: 'op-f' } as unknown as SandboxRec;
  const sbs = new Map([[ 'X', { value: x, modRevision: 40 } ]]);
  let rev = 50;
  const sent: string[] = [];
  const ref: { ex?: Executor } = {};
  const store = {
    getSnapshot: async () => ({ value: snap, modRevision: 3 }),
    getOp: async () => structuredClone(opRec),
    getSandbox: async (_t: string, id: string) => sbs.get(id),
    commitAt: async (w: StoreWrite[]) => {
      rev++;
      for (const s of w) if (s.kind === 'sandbox') sbs.set(s.value.id, { value: s.value, modRevision: rev });
      for (const s of w) if (s.kind === 'op') opRec = { value: s.value, modRevision: rev };
      return rev;
    },
  };
  const heard = new HeartbeatRegistry();
  heard.record(create(HeartbeatSchema, { hostId: 'live', bootId: 'b', restoreSlots: 4, snapshots: [{ snapshotId: 'sn-1', complete: true }] }), now);
  const sendWork = async (h: string, w: { opId: string; stepId: string; attempt: number }) => {
    sent.push(`${w.stepId}@${h}`);
    if (w.stepId.startsWith('restore/')) setTimeout(() => ref.ex!.onResult(create(HostResultSchema, { opId: w.opId, stepId: w.stepId, hostId: h, attempt: w.attempt, vms: [{ sandboxId: 'X' }] as never }), h), 5);
  };
  const ex = new Executor({
    store: stub<ExecutorDeps['store']>(store),
    bus: stub<ExecutorDeps['bus']>({ sendWork }),
    clock: { now: () => now },
    log: pino({ level: 'silent' }),
    heard,
    signer: stub({}),
    config: { liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 }, stepTimeoutMs: 1000, stepAttempts: 1, chunkBytes: 1 << 18 },
  });
  ref.ex = ex;
  const inner = ex as unknown as { active: boolean; ops: Map<string, unknown>; running: Map<string, unknown>; cache: { apply(c: unknown): void }; runFork(op: OperationRec): Promise<void> };
  inner.active = true;
  inner.cache.apply({ kind: 'host', value: { value: host('live', 'ready'), modRevision: 1 } });
  inner.cache.apply({ kind: 'host', value: { value: host('gone', 'lost'), modRevision: 1 } });
  inner.cache.apply({ kind: 'snapshot', value: { value: snap, modRevision: 3 } });
  inner.ops.set(op.id, structuredClone(opRec));
  inner.running.set(op.id, Promise.resolve());
  await inner.runFork(structuredClone(op));
    expect(sent).toContain('stop-replaced/X@gone');
    expect(sbs.get('X')!.value.state).toBe('running');
  });
});

describe('Executor host step', () => {
  it('aRetryableFailureOfAnEarlierSendComingLate_doesNotEndTheWait_theLatestSendsAnswerDoes', async () => {
    const sends: number[] = [];
    const ref: { ex?: Executor } = {};
    const answer = (w: { opId: string; stepId: string }, attempt: number, error?: { kind: string; message: string; retryable: boolean }): void =>
      ref.ex!.onResult(create(HostResultSchema, { opId: w.opId, stepId: w.stepId, hostId: 'h1', attempt, ...(error ? { error } : {}) }), 'h1');
    const sendWork = async (_h: string, w: { opId: string; stepId: string; attempt: number }): Promise<void> => {
      sends.push(w.attempt);
      // Send 1 is not answered in time; send 2 is running when send 1's retryable failure
      // arrives late, and then succeeds.
      if (w.attempt === 2) {
        setTimeout(() => answer(w, 1, { kind: 'unavailable', message: 'the chunk store was busy', retryable: true }), 5);
        setTimeout(() => answer(w, 2), 40);
      }
    };
    const ex = executorOver({}, { bus: { sendWork }, stepAttempts: 2 });
    ref.ex = ex;
    const inner = ex as unknown as { active: boolean; ops: Map<string, unknown>; step(op: OperationRec, stepId: string, hostId: string, work: unknown): Promise<{ error?: unknown }> };
    inner.active = true;
    const op = { id: 'op-s', tenantId: 't', kind: 'pause', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'sb-1', input: {}, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {} } as unknown as OperationRec;
    inner.ops.set(op.id, { value: op, modRevision: 1 });
    // Two attempts of 100 ms: send 1 times out, send 2 is the last one counted.
    const r = await inner.step(op, 'pause', 'h1', { case: 'pauseVm', value: { sandboxId: 'sb-1' } });
    expect(r.error).toBeUndefined();
    expect(sends.slice(0, 2)).toEqual([1, 2]);
  });
});
