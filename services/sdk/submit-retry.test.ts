// What the SDK does when a call gets no answer before its own deadline: a keyed (mutating)
// call is asked again with the same idempotency key, a read is not; and an error after the
// fleet accepted an operation names that operation, and every error of a mutating call names
// its idempotency key (also one aborted before any answer). The typed gRPC client is replaced by a
// fake of its interface: no server is involved.
import { create } from '@bufbuild/protobuf';
import { status as Status } from '@grpc/grpc-js';
import { describe, expect, it } from 'vitest';
import { RpcError } from '../adapters/grpc/status.ts';
import { OperationKind, OperationSchema, OperationState, SandboxSchema, SandboxState } from '../../proto/gen/forkfleet/v1/fleet_pb.ts';
import { Forkfleet, idempotencyKeyOf, operationIdOf } from './index.ts';

const OP = `op-${'a'.repeat(20)}`;
const SB = `sb-${'b'.repeat(20)}`;
const noAnswer = (): RpcError => new RpcError(Status.DEADLINE_EXCEEDED, 'deadline_exceeded', 'Deadline exceeded after 30.000s', false, undefined, undefined, false);
const outage = (): RpcError => new RpcError(Status.UNAVAILABLE, 'unavailable', 'fleet store is unavailable', true, undefined, undefined, true);

function client(rpc: Record<string, (req: Record<string, unknown>, o?: { signal?: AbortSignal }) => Promise<unknown>>): Forkfleet {
  const ff = new Forkfleet({ address: '127.0.0.1:1', token: 'ff_test', ca: Buffer.from('-----BEGIN CERTIFICATE-----\n'), tenant: 't1', retry: { baseMs: 1, maxMs: 1 } });
  ff.close();
  (ff as unknown as { rpc: unknown }).rpc = rpc;
  return ff;
}

describe('SDK retries of calls that got no answer', () => {
  it('create_whoseFirstAttemptGotNoAnswerInTime_isAskedAgainWithTheSameKey_andReturnsTheSandbox', async () => {
    const keys: unknown[] = [];
    const ff = client({
      createSandbox: async (req) => {
        keys.push(req.idempotencyKey);
        if (keys.length === 1) throw noAnswer();
        return create(OperationSchema, { id: OP, tenantId: 't1', kind: OperationKind.CREATE, state: OperationState.RUNNING });
      },
      waitOperation: async () => create(OperationSchema, { id: OP, tenantId: 't1', kind: OperationKind.CREATE, state: OperationState.SUCCEEDED, result: { case: 'sandbox', value: create(SandboxSchema, { id: SB, tenantId: 't1', state: SandboxState.RUNNING }) } }),
    });
    const sb = await ff.create({ image: 'tiny' }, { idempotencyKey: 'k-1' });
    expect(sb.id).toBe(SB);
    expect(keys).toEqual(['k-1', 'k-1']);
  });

  it('fork_withAMisspeltLocalityOrSpread_isRefusedNamingIt_andSendsNothing', async () => {
    let sent = 0;
    const ff = client({ forkSandbox: async () => (sent++, create(OperationSchema, { id: OP, tenantId: 't1', kind: OperationKind.FORK, state: OperationState.RUNNING })) });
    // From JavaScript, no types catch these; they went out as UNSPECIFIED (taken as any / pack).
    await expect(ff.fork({ snapshotId: 'sn-1' }, 2, { locality: 'crosshost' as never })).rejects.toMatchObject({ kind: 'invalid_argument', field: 'locality' });
    await expect(ff.fork({ snapshotId: 'sn-1' }, 2, { spread: 'spreaded' as never })).rejects.toMatchObject({ kind: 'invalid_argument', field: 'spread' });
    expect(sent).toBe(0);
  });

  it('read_thatGotNoAnswerInTime_isNotAskedAgain', async () => {
    let calls = 0;
    const ff = client({
      getSandbox: async () => {
        calls++;
        throw noAnswer();
      },
    });
    await expect(ff.get(SB)).rejects.toMatchObject({ kind: 'deadline_exceeded' });
    expect(calls).toBe(1);
  });

  it('wait_whoseLongPollGotNoAnswerBeforeItsOwnDeadline_pollsAgain_andReturnsTheResult', async () => {
    let polls = 0;
    const ff = client({
      createSandbox: async () => create(OperationSchema, { id: OP, tenantId: 't1', kind: OperationKind.CREATE, state: OperationState.RUNNING }),
      waitOperation: async () => {
        // The first poll went to a scheduler that stalled: no answer before the call's deadline.
        if (++polls === 1) throw noAnswer();
        return create(OperationSchema, { id: OP, tenantId: 't1', kind: OperationKind.CREATE, state: OperationState.SUCCEEDED, result: { case: 'sandbox', value: create(SandboxSchema, { id: SB, tenantId: 't1', state: SandboxState.RUNNING }) } });
      },
    });
    expect((await ff.create({ image: 'tiny' })).id).toBe(SB);
    expect(polls).toBe(2);
  });

  it('waitThatGivesUpOnAnAcceptedOperation_throwsAnErrorThatNamesTheOperation', async () => {
    const ff = client({
      createSandbox: async () => create(OperationSchema, { id: OP, tenantId: 't1', kind: OperationKind.CREATE, state: OperationState.RUNNING }),
      waitOperation: async () => {
        throw outage();
      },
    });
    // The wait's own limit (timeoutMs) ends it before the outage allowance would.
    const e = await ff.create({ image: 'tiny' }, { timeoutMs: 50 }).catch((x: unknown) => x);
    expect(e).toMatchObject({ kind: expect.stringMatching(/unavailable|deadline_exceeded/) });
    expect(operationIdOf(e)).toBe(OP);
    expect(operationIdOf(noAnswer())).toBeUndefined();
  });
  it('create_abortedBeforeAnyAnswer_throwsAnErrorCarryingTheKeyItWasSentWith_soItCanBeFoundAgain', async () => {
    // The scheduler may have accepted it: the caller re-submits with the key to learn the
    // operation (and cancel it), instead of leaving 64 children running unseen.
    const keys: unknown[] = [];
    const ff = client({
      createSandbox: (req, o) => {
        keys.push(req.idempotencyKey);
        return new Promise((_, reject) => o?.signal?.addEventListener('abort', () => reject(new RpcError(Status.CANCELLED, 'cancelled', 'Cancelled on client', false, undefined, undefined, false))));
      },
    });
    const ac = new AbortController();
    const p = ff.create({ image: 'tiny' }, { signal: ac.signal }).catch((x: unknown) => x);
    setTimeout(() => ac.abort(), 20);
    const e = await p;
    expect(keys).toHaveLength(1);
    expect(idempotencyKeyOf(e)).toBe(keys[0]);
    expect(operationIdOf(e)).toBeUndefined();
  });

  it('wait_abortedWithAStringReason_throwsAnErrorNamingTheOperationAndKey', async () => {
    const ff = client({
      createSandbox: async () => create(OperationSchema, { id: OP, tenantId: 't1', kind: OperationKind.CREATE, state: OperationState.RUNNING }),
      waitOperation: (_req, o) => new Promise((_, reject) => o?.signal?.addEventListener('abort', () => reject(o.signal!.reason))),
    });
    const ac = new AbortController();
    const p = ff.create({ image: 'tiny' }, { signal: ac.signal, idempotencyKey: 'episode-7' }).catch((x: unknown) => x);
    setTimeout(() => ac.abort('episode timeout'), 20);
    const e = await p;
    expect(e).toMatchObject({ kind: 'cancelled' });
    expect(operationIdOf(e)).toBe(OP);
    expect(idempotencyKeyOf(e)).toBe('episode-7');
  });
  it('creates_abortedTogetherByOneSignalWhileWaitingOutRefusals_eachThrowTheirOwnErrorWithTheirOwnKey', async () => {
    // The signal's reason is one object: attached to it, every call's key was the last one's.
    const ff = client({
      createSandbox: async () => {
        throw new RpcError(Status.RESOURCE_EXHAUSTED, 'resource_exhausted', 'rate limit of tenant t1: 1 requests/s (burst 1); retry in 10000 ms', true, 'rate', undefined, true, 10_000);
      },
    });
    const ac = new AbortController();
    const calls = ['k0', 'k1', 'k2'].map((k) => ff.create({ image: 'tiny' }, { signal: ac.signal, idempotencyKey: k }).catch((x: unknown) => x));
    setTimeout(() => ac.abort(), 50);
    const errors = await Promise.all(calls);
    expect(errors.map((e) => idempotencyKeyOf(e))).toEqual(['k0', 'k1', 'k2']);
    expect(new Set(errors).size).toBe(3);
    for (const e of errors) expect(e).toMatchObject({ kind: 'cancelled' });
  });
});
