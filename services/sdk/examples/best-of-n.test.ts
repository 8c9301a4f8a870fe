// The best-of-n example leaves nothing behind when it fails: neither the parent nor the
// children of a fork the fleet accepted but whose wait then failed. The typed gRPC client is
// replaced by a fake of its interface: no server is involved.
import { create } from '@bufbuild/protobuf';
import { status as Status } from '@grpc/grpc-js';
import { describe, expect, it } from 'vitest';
import { RpcError } from '../../adapters/grpc/status.ts';
import { OperationKind, OperationSchema, OperationState, SandboxSchema, SandboxState } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import { Forkfleet } from '../index.ts';
import { bestOfN } from './best-of-n.ts';

const PARENT = `sb-${'p'.repeat(20)}`;
const KIDS = [`sb-${'c'.repeat(20)}`, `sb-${'d'.repeat(20)}`, `sb-${'e'.repeat(20)}`];
const CREATE_OP = `op-${'a'.repeat(20)}`;
const FORK_OP = `op-${'f'.repeat(20)}`;
const sandbox = (id: string, state: SandboxState) => create(SandboxSchema, { id, tenantId: 't1', state });

/** A fleet where the fork is accepted and goes on, but the client's first wait for it fails. */
function fleet(fork: { cancel: 'refused' | 'accepted' }) {
  const calls = { cancelled: [] as string[], destroyed: [] as string[], forkWaits: 0 };
  let cancelRequested = false;
  const forkOp = (state: OperationState, children: Array<[string, SandboxState]>) =>
    create(OperationSchema, { id: FORK_OP, tenantId: 't1', kind: OperationKind.FORK, state, cancelRequested, result: { case: 'fork', value: { snapshotId: `sn-${'s'.repeat(20)}`, children: children.map(([id, st]) => sandbox(id, st)) } } });
  const rpc = {
    createSandbox: async () => create(OperationSchema, { id: CREATE_OP, tenantId: 't1', kind: OperationKind.CREATE, state: OperationState.RUNNING }),
    writeFile: async () => ({ bytesWritten: 10n }),
    forkSandbox: async () => forkOp(OperationState.RUNNING, []),
    cancelOperation: async (req: { operationId: string }) => {
      calls.cancelled.push(req.operationId);
      // It ended (succeeded) before the cancel came: the fleet refuses it and keeps the children.
      if (fork.cancel === 'refused') throw new RpcError(Status.FAILED_PRECONDITION, 'failed_precondition', `operation ${req.operationId} has ended`, false, undefined, undefined, true);
      cancelRequested = true;
      return forkOp(OperationState.RUNNING, []);
    },
    waitOperation: async (req: { operationId: string }) => {
      if (req.operationId === CREATE_OP) return create(OperationSchema, { id: CREATE_OP, tenantId: 't1', kind: OperationKind.CREATE, state: OperationState.SUCCEEDED, result: { case: 'sandbox', value: sandbox(PARENT, SandboxState.RUNNING) } });
      if (req.operationId === FORK_OP) {
        // The example's own wait fails in a way that is not the operation's failure.
        if (++calls.forkWaits === 1) throw new RpcError(Status.INTERNAL, 'internal', 'internal error', false, undefined, undefined, true);
        if (cancelRequested) return forkOp(OperationState.CANCELLED, [[KIDS[0]!, SandboxState.DESTROYING], [KIDS[1]!, SandboxState.DESTROYED], [KIDS[2]!, SandboxState.FAILED]]);
        return forkOp(OperationState.SUCCEEDED, KIDS.map((id) => [id, SandboxState.RUNNING]));
      }
      const id = req.operationId.slice('op-destroy-'.length);
      return create(OperationSchema, { id: req.operationId, tenantId: 't1', kind: OperationKind.DESTROY, state: OperationState.SUCCEEDED, result: { case: 'sandbox', value: sandbox(id, SandboxState.DESTROYED) } });
    },
    destroySandbox: async (req: { sandboxId: string }) => {
      calls.destroyed.push(req.sandboxId);
      return create(OperationSchema, { id: `op-destroy-${req.sandboxId}`, tenantId: 't1', kind: OperationKind.DESTROY, state: OperationState.RUNNING });
    },
  };
  const ff = new Forkfleet({ address: '127.0.0.1:1', token: 'ff_test', ca: Buffer.from('-----BEGIN CERTIFICATE-----\n'), tenant: 't1', retry: { baseMs: 1, maxMs: 1 } });
  ff.close();
  (ff as unknown as { rpc: unknown }).rpc = rpc;
  return { ff, calls };
}

describe('best-of-n example', () => {
  it('aForkWhoseWaitFailed_butThatFinished_hasItsChildrenDestroyed_withTheParent', async () => {
    const { ff, calls } = fleet({ cancel: 'refused' });
    await expect(bestOfN(ff, { n: 3 })).rejects.toMatchObject({ kind: 'internal' });
    expect([...calls.destroyed].sort()).toEqual([PARENT, ...KIDS].sort());
    expect(calls.cancelled).toEqual([FORK_OP]);
  });

  it('aForkWhoseWaitFailed_whileItRan_isCancelled_andOnlyWhatTheCancelLeftIsDestroyed', async () => {
    const { ff, calls } = fleet({ cancel: 'accepted' });
    await expect(bestOfN(ff, { n: 3 })).rejects.toMatchObject({ kind: 'internal' });
    // The cancel destroyed the children that started; the one that failed is destroyed here (its record goes).
    expect([...calls.destroyed].sort()).toEqual([PARENT, KIDS[2]!].sort());
    expect(calls.cancelled).toEqual([FORK_OP]);
  });
});
