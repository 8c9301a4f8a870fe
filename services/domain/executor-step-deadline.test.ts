// A host step still running at its send's deadline: the agent answers deadline_exceeded
// (retryable) and runs on (host-agent/domain/agent.ts runStep). That answer is not the step's
// result: the Executor sends the step again, and the new send gets the run's result. The
// Executor against stub ports of our own (every store method not named answers at once with nothing).
import { describe, expect, it } from 'vitest';
import pino from 'pino';
import { create } from '@bufbuild/protobuf';
import { durationFromMs } from '@bufbuild/protobuf/wkt';
import { Executor } from './executor.ts';
import type { ExecutorDeps } from './executor.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import { HostResultSchema, type HostWork } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type { OperationRec } from './records.ts';
import { ForkfleetError } from '../../proto/errors.ts';

function stub<T>(methods: Record<string, unknown>): T {
  return new Proxy(methods, { get: (target, key) => (key in target ? target[key as string] : key === 'then' ? undefined : async () => []) }) as T;
}

/** Runs one pause step on host h1 whose sends the host answers with `answer(send)`; returns the step's outcome and the sends. */
async function stepAnswered(answer: (w: HostWork) => { kind?: string; attempt?: number; extra?: object } | undefined, attempts = 3, o: { stepTimeoutMs?: number; publishFails?: () => Error } = {}): Promise<{ outcome: unknown; sends: HostWork[]; ex: Executor }> {
  const sends: HostWork[] = [];
  const ref: { ex?: Executor } = {};
  const sendWork = async (_hostId: string, w: HostWork): Promise<void> => {
    if (o.publishFails) throw o.publishFails();
    sends.push(w);
    const a = answer(w);
    if (!a) return;
    const r = create(HostResultSchema, { opId: w.opId, stepId: w.stepId, hostId: 'h1', attempt: a.attempt ?? w.attempt, ...a.extra, ...(a.kind ? { error: { kind: a.kind, message: `${a.kind} (test)`, retryable: true } } : {}) });
    setTimeout(() => ref.ex?.onResult(r, 'h1'), 5);
  };
  const ex = new Executor({
    store: stub<ExecutorDeps['store']>({}),
    bus: stub<ExecutorDeps['bus']>({ sendWork }),
    clock: { now: () => Date.now() },
    log: pino({ level: 'silent' }),
    heard: new HeartbeatRegistry(),
    signer: stub({}),
    config: { liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 }, stepTimeoutMs: o.stepTimeoutMs ?? 2000, stepAttempts: attempts, chunkBytes: 1 << 18 },
  });
  ref.ex = ex;
  const inner = ex as unknown as { active: boolean; step(op: OperationRec, stepId: string, hostId: string, work: HostWork['work']): Promise<unknown> };
  inner.active = true;
  const op = { id: 'op-1', tenantId: 't', kind: 'pause' } as OperationRec;
  const outcome = await inner.step(op, 'pause/sb-1', 'h1', { case: 'pauseVm', value: { sandboxId: 'sb-1' } as never }).then(
    (r) => r,
    (e: unknown) => e,
  );
  return { outcome, sends, ex };
}

describe('Executor host step answered at its deadline', () => {
  it('isSentAgain_andTheNextSendsResultIsTheSteps_notAFailure', async () => {
    const { outcome, sends } = await stepAnswered((w) => (w.attempt === 1 ? { kind: 'deadline_exceeded' } : {}));
    expect(outcome).toMatchObject({ $typeName: 'forkfleet.v1.HostResult', stepId: 'pause/sb-1' });
    expect((outcome as { error?: unknown }).error).toBeUndefined();
    expect(sends.map((w) => w.attempt)).toEqual([1, 2]);
    // Each send carries a deadline before the Executor's own wait for it ends.
    for (const w of sends) expect(w.deadline).toBeDefined();
  });

  it('anEarlierSendsLateDeadlineAnswer_countsNoAttempt', async () => {
    // Every send is answered once as if it were send 1's late answer; the 3rd send is answered for real.
    const { outcome, sends } = await stepAnswered((w) => (w.attempt < 3 ? { kind: 'deadline_exceeded', attempt: 0 } : {}), 1);
    expect(outcome).toMatchObject({ $typeName: 'forkfleet.v1.HostResult', attempt: 3 });
    expect((outcome as { error?: unknown }).error).toBeUndefined();
    expect(sends).toHaveLength(3);
  });

  it('whenEverySendIsAnsweredAtItsDeadline_failsAsATimeoutAfterItsAttempts', async () => {
    const { outcome, sends } = await stepAnswered(() => ({ kind: 'deadline_exceeded' }));
    expect(outcome).toMatchObject({ kind: 'deadline_exceeded' });
    expect((outcome as Error).message).toMatch(/did not finish/);
    expect(sends).toHaveLength(3);
  });
});

describe('A host step that cannot be sent', () => {
  it('becauseNoPublishReachesTheBus_failsAsATimeoutThatSaysItNeverLeft_notTheHostsFault', async () => {
    const { outcome, sends } = await stepAnswered(() => ({}), 1, { stepTimeoutMs: 300, publishFails: () => new Error('NATS connection closed') });
    expect(sends).toHaveLength(0);
    expect(outcome).toMatchObject({ kind: 'deadline_exceeded', neverSent: true });
    expect((outcome as Error).message).toMatch(/could not send pause\/sb-1 to host h1 over the work bus/);
  });

  it('becauseItIsLargerThanTheBusCarries_failsAtOnce_namingTheWorkAtFault', async () => {
    const { outcome } = await stepAnswered(() => ({}), 3, { publishFails: () => new ForkfleetError('resource_exhausted', 'message of 9 MiB over max_payload') });
    expect(outcome).toMatchObject({ kind: 'resource_exhausted', workField: 'work' });
  });
});

describe('A host step that fetched a snapshot', () => {
  it('pricesTheHostsFetchRateOverTheFetchAlone_notOverTheWholeStepWithItsRestores', async () => {
    const MIB = 1024 * 1024;
    const rate = async (extra: object): Promise<number | undefined> => {
      const { ex } = await stepAnswered(() => ({ extra: { bytesFetched: BigInt(80 * MIB), duration: durationFromMs(2000), ...extra } }));
      return (ex as unknown as { fetchRates: { current(now: number): ReadonlyMap<string, number> } }).fetchRates.current(Date.now()).get('h1');
    };
    // 80 MiB fetched in 500 ms of a 2 s step (the rest restored its VMs): 160 MiB/s.
    expect(await rate({ fetch: durationFromMs(500) })).toBeCloseTo(160 * MIB, -3);
    // An agent that does not say: over the whole step, as before.
    expect(await rate({})).toBeCloseTo(40 * MIB, -3);
  });
});
