// How long the SDK keeps asking: ordinary retryable errors get `attempts`, a scheduler that
// answers UNAVAILABLE (an etcd restart) and the tenant's rate limit (or a bound of the scheduler's on
// file bytes or streams held at once) each get a time allowance
// of their own, a rate-limited call waits at least as long as the server said, and a call's
// `deadline` bounds it all. The typed gRPC client is replaced by a fake of its interface, and
// the clock by vitest's fake timers: no server is involved, and no test waits in real time.
import { create } from '@bufbuild/protobuf';
import { status as Status } from '@grpc/grpc-js';
import { afterEach, describe, expect, it, vi } from 'vitest';
import { RpcError } from '../adapters/grpc/status.ts';
import { OperationKind, OperationSchema, OperationState, SandboxSchema, SandboxState, SnapshotSchema } from '../../proto/gen/forkfleet/v1/fleet_pb.ts';
import { Forkfleet } from './index.ts';
import type { RetryOptions } from './index.ts';

const OP = `op-${'a'.repeat(20)}`;
const SB = `sb-${'b'.repeat(20)}`;
const outage = (): RpcError => new RpcError(Status.UNAVAILABLE, 'unavailable', 'fleet store is unavailable', true, undefined, undefined, true);
const conflict = (): RpcError => new RpcError(Status.ABORTED, 'aborted', 'concurrent change; retry', true, undefined, undefined, true);
const unreachable = (): RpcError => new RpcError(Status.UNAVAILABLE, 'unavailable', 'No connection established. Last error: connect ECONNREFUSED 127.0.0.1:1', true, undefined, undefined, false);
/** As fromServiceError makes it from a RateLimitedError's status; `retryAfterMs` undefined: a scheduler that says it in the message only. */
const rateLimited = (retryAfterMs: number | undefined): RpcError =>
  new RpcError(Status.RESOURCE_EXHAUSTED, 'resource_exhausted', 'rate limit of tenant t1: 10 requests/s (burst 20); retry in 800 ms', true, 'rate', undefined, true, retryAfterMs);
const running = (kind: OperationKind) => create(OperationSchema, { id: OP, tenantId: 't1', kind, state: OperationState.RUNNING });
const succeeded = (kind: OperationKind) =>
  create(OperationSchema, { id: OP, tenantId: 't1', kind, state: OperationState.SUCCEEDED, result: { case: 'sandbox', value: create(SandboxSchema, { id: SB, tenantId: 't1', state: kind === OperationKind.DESTROY ? SandboxState.DESTROYED : SandboxState.RUNNING }) } });

function client(rpc: Record<string, unknown>, retry: Partial<RetryOptions> = { baseMs: 1, maxMs: 1 }): Forkfleet {
  const ff = new Forkfleet({ address: '127.0.0.1:1', token: 'ff_test', ca: Buffer.from('-----BEGIN CERTIFICATE-----\n'), tenant: 't1', retry });
  ff.close();
  (ff as unknown as { rpc: unknown }).rpc = rpc;
  return ff;
}

/** `p` settled, the fake clock run on as far as it needs (never past `limitMs` of it). */
async function settle<T>(p: Promise<T>, limitMs = 600_000): Promise<{ value?: T; error?: unknown; tookMs: number }> {
  const t0 = Date.now();
  let done: { value?: T; error?: unknown } | undefined;
  p.then((value) => (done = { value }), (error: unknown) => (done = { error }));
  while (!done && Date.now() - t0 < limitMs) await vi.advanceTimersByTimeAsync(10);
  return { ...done, tookMs: Date.now() - t0 };
}

afterEach(() => void vi.useRealTimers());

describe('SDK retry allowances', () => {
  it('waitsPollingThroughAnOutage_backOffWithJitter_insteadOfEveryOneOnceASecondInStep', async () => {
    vi.useFakeTimers();
    const t0 = Date.now();
    const polls = new Map<string, number[]>();
    const ff = client({
      waitOperation: async (req: { operationId: string }) => {
        polls.set(req.operationId, [...(polls.get(req.operationId) ?? []), Date.now() - t0]);
        if (Date.now() - t0 < 30_000) throw outage(); // a 30 s etcd restart
        return create(OperationSchema, { id: req.operationId, tenantId: 't1', kind: OperationKind.DESTROY, state: OperationState.SUCCEEDED });
      },
    });
    const all = await settle(Promise.all(Array.from({ length: 16 }, (_, i) => ff.wait(`op-${String(i).padStart(20, 'a')}`))));
    expect(all.error).toBeUndefined();
    // Once a second each was 31 polls per wait, the 16 of them in step.
    const per = [...polls.values()];
    expect(per.reduce((n, p) => n + p.length, 0) / per.length).toBeLessThan(16);
    const seconds = per.map((p) => p[1]!);
    expect(Math.max(...seconds) - Math.min(...seconds)).toBeGreaterThan(200);
  });

  it('create_whoseConflictComesAfterALongOutage_isStillRetried_andReturnsTheSandbox', async () => {
    let calls = 0;
    const ff = client({
      createSandbox: async () => {
        calls++;
        if (calls <= 6) throw outage(); // etcd restarting: more answers than `attempts`
        if (calls === 7) throw conflict();
        return running(OperationKind.CREATE);
      },
      waitOperation: async () => succeeded(OperationKind.CREATE),
    });
    expect((await ff.create({ image: 'tiny' })).id).toBe(SB);
    expect(calls).toBe(8);
  });

  it('aSecondOutageInOneCall_getsTheWholeOutageAllowance_notWhatTheFirstLeft', async () => {
    vi.useFakeTimers();
    const t0 = Date.now();
    let conflicted = false;
    const ff = client(
      {
        createSandbox: async () => {
          const at = Date.now() - t0;
          // 50 s of outage, a conflict, then 50 s more of outage: each under WAIT_OUTAGE_MS (60 s).
          if (at < 50_000) throw outage();
          if (!conflicted) {
            conflicted = true;
            throw conflict();
          }
          if (at < 101_000) throw outage();
          return running(OperationKind.CREATE);
        },
        waitOperation: async () => succeeded(OperationKind.CREATE),
      },
      { baseMs: 500, maxMs: 1000 },
    );
    const r = await settle(ff.create({ image: 'tiny' }));
    expect(r.error).toBeUndefined();
    expect(r.value?.id).toBe(SB);
    expect(conflicted).toBe(true);
  });

  it('destroy_refusedByTheRateLimitForTwoSeconds_waitsWhatTheServerSaysEachTime_andSucceeds', async () => {
    vi.useFakeTimers();
    const t0 = Date.now();
    const asked: number[] = [];
    const ff = client({
      destroySandbox: async () => {
        asked.push(Date.now() - t0);
        if (Date.now() - t0 < 2_000) throw rateLimited(800);
        return running(OperationKind.DESTROY);
      },
      waitOperation: async () => succeeded(OperationKind.DESTROY),
    });
    const r = await settle(ff.sandbox(SB).destroy());
    expect(r.error).toBeUndefined();
    expect(r.value?.info?.state).toBe('destroyed');
    // Never sooner than the server's 800 ms after a refusal.
    for (let i = 1; i < asked.length; i++) expect(asked[i]! - asked[i - 1]!).toBeGreaterThanOrEqual(800);
  });

  it('aClientWithNoRateLimitAllowance_givesUpAfterItsAttempts_asTheDashboardMust', async () => {
    // The dashboard polls with attempts 1 to fail fast: a minute of rate-limit retries would
    // hang each poll.
    vi.useFakeTimers();
    let asked = 0;
    const ff = client(
      {
        getSandbox: async () => {
          asked++;
          throw rateLimited(800);
        },
      },
      { attempts: 1, rateLimitWaitMs: 0 },
    );
    const r = await settle(ff.sandbox(SB).refresh());
    expect(r.error).toMatchObject({ kind: 'resource_exhausted', field: 'rate' });
    expect(asked).toBe(1);
  });

  it('aWaitWhosePollsTheRateLimitRefusesForLongerThanTheOutageAllowance_goesOnUntilTheOperationEnds', async () => {
    vi.useFakeTimers();
    const t0 = Date.now();
    const ff = client({
      destroySandbox: async () => running(OperationKind.DESTROY),
      waitOperation: async () => {
        // Refused for 70 s: longer than WAIT_OUTAGE_MS, which bounds polls that get no answer.
        if (Date.now() - t0 < 70_000) throw rateLimited(800);
        return succeeded(OperationKind.DESTROY);
      },
    });
    const r = await settle(ff.sandbox(SB).destroy());
    expect(r.error).toBeUndefined();
    expect(r.value?.info?.state).toBe('destroyed');
  });

  it('aRateLimitSaidOnlyInTheMessage_isWaitedOutToo', async () => {
    vi.useFakeTimers();
    const t0 = Date.now();
    const ff = client({
      destroySandbox: async () => {
        if (Date.now() - t0 < 2_000) throw rateLimited(undefined);
        return running(OperationKind.DESTROY);
      },
      waitOperation: async () => succeeded(OperationKind.DESTROY),
    });
    expect((await settle(ff.sandbox(SB).destroy())).error).toBeUndefined();
  });

  it('exec_refusedByTheRateLimitForTwoSeconds_isRetriedAfterTheServersWait_andRuns', async () => {
    vi.useFakeTimers();
    const t0 = Date.now();
    const ff = client({
      exec: () =>
        (async function* () {
          if (Date.now() - t0 < 2_000) throw rateLimited(800);
          yield { payload: { case: 'exit', value: { exitCode: 3, signal: 0, timedOut: false, outputTruncated: false } } };
        })(),
    });
    const r = await settle(ff.sandbox(SB).sh('exit 3'));
    expect(r.error).toBeUndefined();
    expect(r.value?.exitCode).toBe(3);
  });

  it('writeFile_heldBackByTheSchedulersFileBudgetForTenSeconds_isAskedAgainUntilItFits_notJustItsAttempts', async () => {
    // 64 children each given a file at once: the scheduler holds at most so many bytes for
    // file calls and refuses the rest (retryable, field data) until earlier ones end.
    vi.useFakeTimers();
    const t0 = Date.now();
    let asked = 0;
    const ff = client(
      {
        writeFile: async () => {
          asked++;
          if (Date.now() - t0 < 10_000) throw new RpcError(Status.RESOURCE_EXHAUSTED, 'resource_exhausted', 'this scheduler holds 536870912 of its 536870912 bytes for file transfers (FF_FILE_BUFFER_MAX); retry shortly', true, 'data', undefined, true);
          return { bytesWritten: 5n };
        },
      },
      { baseMs: 200, maxMs: 1000 },
    );
    const r = await settle(ff.sandbox(SB).writeFile('/tmp/x', 'hello'));
    expect(r.error).toBeUndefined();
    expect(r.value).toBe(5);
    expect(asked).toBeGreaterThan(5);
  });

  /** The first event of a watch whose stream fails with `err()` for its first ten seconds. */
  async function watchFailingTenSeconds(err: () => RpcError): Promise<{ value?: { revision: number } | undefined; error?: unknown }> {
    vi.useFakeTimers();
    const t0 = Date.now();
    const ff = client(
      {
        watchEvents: () =>
          (async function* () {
            if (Date.now() - t0 < 10_000) throw err();
            yield { revision: 7n, type: 1, sandboxId: SB, operationId: '', at: undefined, detail: {} };
          })(),
      },
      { baseMs: 200, maxMs: 1000 },
    );
    const first = async () => {
      for await (const ev of ff.watch()) return ev;
      return undefined;
    };
    return settle(first());
  }

  it('watch_refusedAtTheCredentialsStreamCapForTenSeconds_isAskedAgain_thenYields', async () => {
    const r = await watchFailingTenSeconds(() => new RpcError(Status.RESOURCE_EXHAUSTED, 'resource_exhausted', 'at most 16 concurrent event watches per credential; close one first', true, 'streams', undefined, true));
    expect(r.error).toBeUndefined();
    expect(r.value?.revision).toBe(7);
  });

  it('watch_whoseStreamTheSchedulerResetForAClientThatStoppedReading_resumes_thenYields', async () => {
    // RST_STREAM ENHANCE_YOUR_CALM: grpc-js reports RESOURCE_EXHAUSTED, with none of our metadata.
    const asked: bigint[] = [];
    const ff = client({
      watchEvents: (req: { afterRevision: bigint }) =>
        (async function* () {
          asked.push(req.afterRevision);
          if (asked.length === 1) {
            yield { revision: 5n, type: 1, sandboxId: SB, operationId: '', at: undefined, detail: {} };
            throw new RpcError(Status.RESOURCE_EXHAUSTED, 'resource_exhausted', 'Bandwidth exhausted or memory limit exceeded', false, undefined, undefined, false);
          }
          yield { revision: 7n, type: 1, sandboxId: SB, operationId: '', at: undefined, detail: {} };
        })(),
    });
    const got: number[] = [];
    for await (const ev of ff.watch()) {
      got.push(ev.revision);
      if (got.length === 2) break;
    }
    expect(got).toEqual([5, 7]);
    // Resumed after the last event it had read.
    expect(asked).toEqual([0n, 4n]);
  });

  it('watch_whileTheSchedulerRestartsForTenSeconds_isAskedAgain_thenYields', async () => {
    const r = await watchFailingTenSeconds(unreachable);
    expect(r.error).toBeUndefined();
    expect(r.value?.revision).toBe(7);
  });

  it('aRefusalForAQuota_isNotAskedAgain', async () => {
    vi.useFakeTimers();
    let asked = 0;
    const ff = client({
      writeFile: async () => {
        asked++;
        throw new RpcError(Status.RESOURCE_EXHAUSTED, 'resource_exhausted', 'quota sandboxes of tenant t1 exceeded', false, 'quotas.sandboxes', undefined, true);
      },
    });
    const r = await settle(ff.sandbox(SB).writeFile('/tmp/x', 'hello'));
    expect(r.error).toMatchObject({ field: 'quotas.sandboxes' });
    expect(asked).toBe(1);
  });

  it('readFile_withADeadline_givesUpAtIt_thoughTheSchedulerKeepsAnsweringUnavailable', async () => {
    vi.useFakeTimers();
    const timeouts: number[] = [];
    const ff = client({
      readFile: (_req: unknown, o: { timeoutMs: number }) => {
        timeouts.push(o.timeoutMs);
        return { [Symbol.asyncIterator]: () => ({ next: () => Promise.reject(outage()) }) };
      },
    }, { baseMs: 100, maxMs: 500 });
    const r = await settle(ff.sandbox(SB).readFile('/etc/hostname', { timeoutMs: 2_000, deadline: new Date(Date.now() + 3_000) }));
    expect(r.error).toMatchObject({ kind: 'unavailable' });
    // The deadline, not the outage allowance (WAIT_OUTAGE_MS, 60 s), ended it.
    expect(r.tookMs).toBeLessThanOrEqual(3_000);
    expect(timeouts.length).toBeGreaterThan(1);
    // No attempt was given longer than what was left of the deadline.
    expect(timeouts.at(-1)!).toBeLessThan(2_000);
  });

  it('retryOptionsGivenAsUndefined_keepTheirDefaults_soRetriesStillEnd', async () => {
    let calls = 0;
    const ff = client(
      {
        getSandbox: async () => {
          // A loop that does not end (the bug) is stopped here, and shows as 50 calls.
          if (++calls >= 50) throw new RpcError(Status.INTERNAL, 'internal', 'stop', false, undefined, undefined, true);
          throw conflict();
        },
      },
      { attempts: undefined, baseMs: undefined, maxMs: 1 },
    );
    await expect(ff.get(SB)).rejects.toMatchObject({ kind: 'aborted' });
    expect(calls).toBe(5);
  });

  it('create_whileTheSchedulerRestartsForTenSeconds_connectionRefused_isAskedAgainAndReturnsTheSandbox', async () => {
    // A restarting scheduler opens its port only once it has etcd and NATS: until then every
    // call is refused before any answer. Its attempts alone (5, ~1.5 s) would end the script.
    vi.useFakeTimers();
    const t0 = Date.now();
    let calls = 0;
    const ff = client(
      {
        createSandbox: async () => {
          calls++;
          if (Date.now() - t0 < 10_000) throw unreachable();
          return running(OperationKind.CREATE);
        },
        waitOperation: async () => succeeded(OperationKind.CREATE),
      },
      { baseMs: 200, maxMs: 1000 },
    );
    const r = await settle(ff.create({ image: 'tiny' }));
    expect(r.error).toBeUndefined();
    expect(r.value?.id).toBe(SB);
    expect(calls).toBeGreaterThan(5);
  });

  it('aSchedulerUnreachableForLongerThanItsAllowance_isGivenUpAfterIt', async () => {
    vi.useFakeTimers();
    const ff = client({ getSandbox: async () => Promise.reject(unreachable()) }, { baseMs: 200, maxMs: 1000, unreachableWaitMs: 5_000 });
    const r = await settle(ff.get(SB));
    expect(r.error).toMatchObject({ kind: 'unavailable' });
    expect(r.tookMs).toBeGreaterThanOrEqual(5_000);
    expect(r.tookMs).toBeLessThan(7_000);
  });

  it('aTlsHandshakeThatFails_isNotWaitedOut_onlyItsAttempts', async () => {
    // A wrong CA does not mend with time: the caller hears of it after the attempts.
    let calls = 0;
    const tls = (): RpcError => new RpcError(Status.UNAVAILABLE, 'unavailable', 'No connection established. Last error: Error: self-signed certificate in certificate chain', true, undefined, undefined, false);
    const ff = client({ getSandbox: async () => (calls++, Promise.reject(tls())) });
    await expect(ff.get(SB)).rejects.toMatchObject({ kind: 'unavailable' });
    expect(calls).toBe(5);
  });

  it('aClientWithNoOutageAllowances_givesUpAfterItsAttempts_whetherTheSchedulerAnswersUnavailableOrCannotBeReached', async () => {
    // The dashboard's polls must fail fast through an etcd restart, not hang for a minute.
    for (const err of [outage, unreachable]) {
      let calls = 0;
      const ff = client({ getSandbox: async () => (calls++, Promise.reject(err())) }, { attempts: 2, baseMs: 1, maxMs: 1, outageWaitMs: 0, unreachableWaitMs: 0 });
      await expect(ff.get(SB)).rejects.toMatchObject({ kind: 'unavailable' });
      expect(calls, err.name).toBe(2);
    }
  });

  it('badRetryOptions_areRefusedNamingTheOption', () => {
    const make = (retry: Partial<RetryOptions>): unknown => {
      try {
        client({}, retry);
        return undefined;
      } catch (e) {
        return e;
      }
    };
    expect(make({ attempts: 0 })).toMatchObject({ kind: 'invalid_argument', field: 'retry.attempts' });
    expect(make({ attempts: Infinity })).toMatchObject({ kind: 'invalid_argument', field: 'retry.attempts' });
    expect(make({ attempts: 2.5 })).toMatchObject({ kind: 'invalid_argument', field: 'retry.attempts' });
    expect(make({ baseMs: Number.NaN })).toMatchObject({ kind: 'invalid_argument', field: 'retry.baseMs', message: expect.stringContaining('retry.baseMs') });
    expect(make({ maxMs: -1 })).toMatchObject({ kind: 'invalid_argument', field: 'retry.maxMs' });
    expect(make({ maxMs: '5s' as unknown as number })).toMatchObject({ kind: 'invalid_argument', field: 'retry.maxMs' });
    expect(make({ attempts: 3, baseMs: 0, maxMs: 0 })).toBeUndefined();
  });
});

describe('SDK retry allowances of kinds that alternate', () => {
  afterEach(() => void vi.restoreAllMocks());

  it('anOutageAndAnUnreachableSchedulerThatAlternate_shareOneAllowance_andAreGivenUpWithinTheLargest', async () => {
    // A scheduler restarting over and over: refused, then answering UNAVAILABLE, then refused...
    vi.useFakeTimers();
    let calls = 0;
    const ff = client({ getSandbox: async () => Promise.reject(++calls % 2 ? outage() : unreachable()) }, { baseMs: 200, maxMs: 1000 });
    const r = await settle(ff.get(SB), 200_000);
    expect(r.error).toMatchObject({ kind: 'unavailable' });
    // WAIT_OUTAGE_MS (60 s), the larger of the two allowances, counted from the first error
    // (plus at most one backoff, maxMs, begun inside it).
    expect(r.tookMs).toBeGreaterThanOrEqual(30_000);
    expect(r.tookMs).toBeLessThanOrEqual(61_100);
  });

  it('anOutageAndRateLimitRefusalsThatAlternate_growTheBackoffAcrossKinds_andAreGivenUpWithinTheAllowance', async () => {
    vi.useFakeTimers();
    vi.spyOn(Math, 'random').mockReturnValue(0.999); // the jitter's whole range: the backoff as it grows
    const t0 = Date.now();
    const asked: number[] = [];
    const ff = client(
      {
        getSandbox: async () => {
          asked.push(Date.now() - t0);
          throw asked.length % 2 ? outage() : rateLimited(100);
        },
      },
      { baseMs: 100, maxMs: 5000 },
    );
    const r = await settle(ff.get(SB), 200_000);
    expect(r.error).toMatchObject({ kind: expect.stringMatching(/unavailable|resource_exhausted/) });
    // The allowance (60 s) from the first error, plus at most one backoff (maxMs) begun inside it.
    expect(r.tookMs).toBeLessThanOrEqual(65_100);
    const gaps = asked.slice(1).map((t, i) => t - asked[i]!);
    // Doubled on every error whatever its kind, up to maxMs: not restarted at baseMs by each change of kind.
    expect(Math.max(...gaps)).toBeGreaterThanOrEqual(4_000);
    expect(asked.length).toBeLessThan(30);
  });
});

describe('SDK waits and deadlines', () => {
  it('aWaitWhosePollsAreRefusedAtTheCredentialsStreamCapForLongerThanTheOutageAllowance_goesOnUntilTheOperationEnds', async () => {
    // Many waits at once (the credential's streams at their cap) are held back, not an outage:
    // the SDK README promises them the rate limit's treatment.
    vi.useFakeTimers();
    const t0 = Date.now();
    let polls = 0;
    const ff = client({
      createSandbox: async () => running(OperationKind.CREATE),
      waitOperation: async () => {
        polls++;
        if (Date.now() - t0 < 90_000) throw new RpcError(Status.RESOURCE_EXHAUSTED, 'resource_exhausted', 'at most 512 concurrent streaming calls per credential; close one first', true, 'streams', undefined, true);
        return succeeded(OperationKind.CREATE);
      },
    });
    const r = await settle(ff.create({ image: 'tiny' }, { timeoutMs: 600_000 }));
    expect(r.error).toBeUndefined();
    expect(r.value?.id).toBe(SB);
    // Polled throughout the 90 s, its pauses growing to at most ~5 s apart.
    expect(polls).toBeGreaterThan(15);
    expect(r.tookMs).toBeGreaterThanOrEqual(90_000);
  });

  it('hibernate_withADeadline_endsByIt_thoughTheReadOfTheSandboxAfterItMeetsAnOutage', async () => {
    vi.useFakeTimers();
    let reads = 0;
    const ff = client(
      {
        hibernateSandbox: async () => running(OperationKind.HIBERNATE),
        waitOperation: async () => create(OperationSchema, { id: OP, tenantId: 't1', kind: OperationKind.HIBERNATE, state: OperationState.SUCCEEDED, result: { case: 'snapshot', value: create(SnapshotSchema, { id: 'sn-1' }) } }),
        getSandbox: async () => {
          reads++;
          throw outage();
        },
      },
      { baseMs: 100, maxMs: 500 },
    );
    const r = await settle(ff.sandbox(SB).hibernate({ deadline: new Date(Date.now() + 2_000) }));
    // The hibernation succeeded: the read that failed leaves `info` unset, within the deadline.
    expect(r.error).toBeUndefined();
    expect(r.value?.info).toBeUndefined();
    expect(reads).toBeGreaterThan(1);
    expect(r.tookMs).toBeLessThanOrEqual(2_000);
  });

  it('wait_withADeadline_givesEachPollNoLongerThanWhatIsLeftOfIt_soAPollNeverAnsweredEndsByTheDeadline', async () => {
    vi.useFakeTimers();
    const deadline = Date.now() + 45_000;
    const polls: Array<{ at: number; timeoutMs: number }> = [];
    const ff = client({
      // A scheduler that takes each poll and never answers: the call ends at its own deadline, unanswered.
      waitOperation: (_req: unknown, o: { timeoutMs: number }) => {
        polls.push({ at: Date.now(), timeoutMs: o.timeoutMs });
        return new Promise((_res, rej) => setTimeout(() => rej(new RpcError(Status.DEADLINE_EXCEEDED, 'deadline_exceeded', 'Deadline exceeded', true, undefined, undefined, false)), o.timeoutMs));
      },
    });
    const r = await settle(ff.wait(OP, { deadline: new Date(deadline) }));
    expect(r.error).toMatchObject({ kind: 'deadline_exceeded' });
    expect(polls.length).toBeGreaterThan(1);
    for (const p of polls) expect(p.at + p.timeoutMs).toBeLessThanOrEqual(deadline);
    // By the deadline (to settle()'s 10 ms steps), not 10 s past it.
    expect(r.tookMs).toBeLessThanOrEqual(45_010);
  });

  it('wait_nearItsDeadline_doesNotPollAgainAndAgain_whenTheSchedulerAnswersAMarginBeforeEachPollsDeadline', async () => {
    vi.useFakeTimers();
    let polls = 0;
    const ff = client({
      // As the scheduler answers (fleet-service.ts): with the op as it is, at the window asked
      // for or 500 ms before the poll's own deadline, whichever is first.
      waitOperation: (req: { timeout?: { seconds: bigint; nanos: number } }, o: { timeoutMs: number }) => {
        polls++;
        const asked = Number(req.timeout?.seconds ?? 0n) * 1000 + (req.timeout?.nanos ?? 0) / 1e6;
        return new Promise((res) => setTimeout(() => res(running(OperationKind.CREATE)), Math.max(0, Math.min(asked, o.timeoutMs - 500))));
      },
    });
    const r = await settle(ff.wait(OP, { timeoutMs: 3000 }));
    expect(r.error).toMatchObject({ kind: 'deadline_exceeded' });
    // One held poll, perhaps a second: not one every tick of the last half second.
    expect(polls).toBeLessThanOrEqual(3);
    expect(r.tookMs).toBeLessThanOrEqual(3010);
  });

  it('create_givenBothAnImageAndASnapshot_isRefusedNamingSource_andSendsNothing', async () => {
    let calls = 0;
    const ff = client({ createSandbox: async () => (calls++, running(OperationKind.CREATE)), waitOperation: async () => succeeded(OperationKind.CREATE) });
    await expect(ff.create({ image: 'debian', snapshotId: 'sn-1' })).rejects.toMatchObject({ kind: 'invalid_argument', field: 'source' });
    expect(calls).toBe(0);
  });

  it('hostsRemove_withADeadline_givesItsCallNoLongerThanWhatIsLeftOfIt', async () => {
    let seen: { timeoutMs?: number } | undefined;
    const ff = client({
      removeHost: async (_req: unknown, o: { timeoutMs?: number }) => {
        seen = o;
        return { lostSandboxes: 2 };
      },
    });
    expect(await ff.hosts.remove('h1', { deadline: new Date(Date.now() + 500) })).toEqual({ lostSandboxes: 2 });
    expect(seen?.timeoutMs).toBeGreaterThan(0);
    expect(seen?.timeoutMs).toBeLessThanOrEqual(500);
  });
});
