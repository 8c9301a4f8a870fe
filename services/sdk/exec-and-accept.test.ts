// What a caller gets from an exec that breaks off part-way (the output so far, with the
// error), when an exec starts (lazily; run() at once), and the id of an accepted operation
// before its wait ends (onAccepted). The typed gRPC client is replaced by a fake: no server.
import { create } from '@bufbuild/protobuf';
import { status as Status } from '@grpc/grpc-js';
import { describe, expect, it } from 'vitest';
import { RpcError } from '../adapters/grpc/status.ts';
import { OperationKind, OperationSchema, OperationState } from '../../proto/gen/forkfleet/v1/fleet_pb.ts';
import { execOutputOf, Forkfleet } from './index.ts';
import type { OperationInfo } from './index.ts';

function fakeClient(rpc: Record<string, unknown>): Forkfleet {
  const ff = new Forkfleet({ address: '127.0.0.1:1', token: 'ff_test', ca: Buffer.from('-----BEGIN CERTIFICATE-----\n'), tenant: 't1', retry: { baseMs: 1, maxMs: 1 } });
  ff.close();
  (ff as unknown as { rpc: unknown }).rpc = rpc;
  return ff;
}

const dropped = (): RpcError => new RpcError(Status.UNAVAILABLE, 'unavailable', 'Connection dropped', true, undefined, undefined, false);

describe('exec', () => {
  it('result_whenTheStreamBreaksOffAfterOutput_rejectsWithTheOutputSoFarOnTheError', async () => {
    const ff = fakeClient({
      exec: () =>
        (async function* () {
          yield { payload: { case: 'stdout', value: Buffer.from('step 1 done\n') } };
          yield { payload: { case: 'stderr', value: Buffer.from('warn\n') } };
          throw dropped();
        })(),
    });
    const e = await ff.sandbox('sb-x').exec(['sh', '-c', 'work']).result().catch((x: unknown) => x);
    expect(e).toBeInstanceOf(RpcError);
    expect(execOutputOf(e)).toEqual({ stdout: 'step 1 done\n', stderr: 'warn\n' });
  });

  it('result_whenTheStreamFailsAfterTheExitCame_resolvesWithTheCommandsResult', async () => {
    const ff = fakeClient({
      exec: () =>
        (async function* () {
          yield { payload: { case: 'stdout', value: Buffer.from('done\n') } };
          yield { payload: { case: 'exit', value: { exitCode: 3, signal: 0, timedOut: false, outputTruncated: false } } };
          throw dropped();
        })(),
    });
    await expect(ff.sandbox('sb-x').run(['work'])).resolves.toMatchObject({ stdout: 'done\n', exitCode: 3, signal: 0 });
  });

  it('result_whenItFailsBeforeAnyOutput_hasNoPartialOutput', async () => {
    const ff = fakeClient({
      exec: () => ({
        [Symbol.asyncIterator]: () => ({ next: () => Promise.reject(new RpcError(Status.NOT_FOUND, 'not_found', 'sandbox sb-x not found', false, undefined, undefined, true)) }),
      }),
    });
    const e = await ff.sandbox('sb-x').exec(['true']).result().catch((x: unknown) => x);
    expect(e).toBeInstanceOf(RpcError);
    expect(execOutputOf(e)).toBeUndefined();
  });

  it('exec_isLazy_butRun_startsTheCommandAtOnce', async () => {
    let calls = 0;
    const ff = fakeClient({
      exec: () => {
        calls++;
        return (async function* () {
          yield { payload: { case: 'stdout', value: Buffer.from('ok\n') } };
          yield { payload: { case: 'exit', value: { exitCode: 0, signal: 0, timedOut: false, outputTruncated: false } } };
        })();
      },
    });
    const sb = ff.sandbox('sb-x');
    sb.exec(['touch', '/x']);
    await new Promise((r) => setTimeout(r, 10));
    expect(calls).toBe(0); // documented: nothing runs until it is iterated
    expect(await sb.run(['echo', 'ok'])).toMatchObject({ stdout: 'ok\n', exitCode: 0 });
    expect(calls).toBe(1);
  });
});

describe('onAccepted', () => {
  it('submit_callsOnAcceptedWithTheOperation_beforeItsWaitEnds', async () => {
    const OP = `op-${'b'.repeat(20)}`;
    let release!: () => void;
    const released = new Promise<void>((r) => (release = r));
    const ff = fakeClient({
      forkSandbox: async () => create(OperationSchema, { id: OP, tenantId: 't1', kind: OperationKind.FORK, state: OperationState.RUNNING }),
      waitOperation: async () => {
        await released;
        return create(OperationSchema, { id: OP, tenantId: 't1', kind: OperationKind.FORK, state: OperationState.SUCCEEDED });
      },
    });
    const accepted: OperationInfo[] = [];
    const done = ff.fork({ snapshotId: 'sn-1' }, 2, {}, { onAccepted: (op) => accepted.push(op) });
    await new Promise((r) => setTimeout(r, 20));
    expect(accepted.map((o) => [o.id, o.kind, o.state])).toEqual([[OP, 'fork', 'running']]);
    release();
    expect((await done).operation.id).toBe(OP);
    expect(accepted).toHaveLength(1);
  });
});
