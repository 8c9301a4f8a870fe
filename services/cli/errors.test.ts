// What the CLI tells a user whose command failed: an accepted operation whose wait gave up
// is followed or waited for again under its key, never submitted twice; a flag that does not
// apply is refused naming it. The SDK's typed gRPC client is replaced by a fake of its
// interface: no server is involved.
import { create } from '@bufbuild/protobuf';
import { status as Status } from '@grpc/grpc-js';
import { afterEach, describe, expect, it, vi } from 'vitest';
import { RpcError } from '../adapters/grpc/status.ts';
import { OperationKind, OperationSchema, OperationState } from '../../proto/gen/forkfleet/v1/fleet_pb.ts';
import { Forkfleet, OperationFailedError } from '../sdk/index.ts';
import type { OperationInfo, SandboxInfo } from '../sdk/index.ts';
import { describeError, main } from './main.ts';

const OP = `op-${'a'.repeat(20)}`;

/** A fork that ended `state`, listing its children in the states given (as GetOperation reads them now). */
function forkThatEnded(state: 'failed' | 'cancelled', children: Array<[string, SandboxInfo['state']]>): OperationFailedError {
  return new OperationFailedError({
    id: OP,
    tenantId: 't1',
    kind: 'fork',
    state,
    targetId: 'sb-src',
    progress: { done: 1, total: children.length, message: '', bytesTransferred: 0 },
    createdAt: undefined,
    updatedAt: undefined,
    error: { kind: state === 'cancelled' ? 'cancelled' : 'unavailable', message: 'host h1 was lost', field: '', retryable: false },
    cancelRequested: state === 'cancelled',
    steps: [],
    stepsOmitted: 0,
    fork: { snapshotId: 'sn-1', summary: '', children: children.map(([id, st]) => ({ id, state: st }) as SandboxInfo) },
  } satisfies OperationInfo);
}

afterEach(() => void vi.restoreAllMocks());

describe('CLI errors', () => {
  it('anAcceptedOperationWhoseWaitGaveUp_saysFollowItOrRepeatWithTheKey_notABareRetry', async () => {
    const ff = new Forkfleet({ address: '127.0.0.1:1', token: 'ff_test', ca: Buffer.from('-----BEGIN CERTIFICATE-----\n'), tenant: 't1', retry: { baseMs: 1, maxMs: 1 } });
    ff.close();
    (ff as unknown as { rpc: unknown }).rpc = {
      createSandbox: async () => create(OperationSchema, { id: OP, tenantId: 't1', kind: OperationKind.CREATE, state: OperationState.RUNNING }),
      waitOperation: async () => {
        throw new RpcError(Status.DEADLINE_EXCEEDED, 'deadline_exceeded', 'Deadline exceeded', true, undefined, undefined, true);
      },
    };
    const e = await ff.create({ image: 'tiny' }, { timeoutMs: 50 }).catch((x: unknown) => x);
    const d = describeError(e, 'a:1', 'cli-k1');
    // Accepted, outcome unknown: 75, not the 69 of a fleet that took nothing, nor a plain API error's 1.
    expect(d).toMatchObject({ operationId: OP, idempotencyKey: 'cli-k1', exitCode: 75 });
    expect(d.hint).toContain(`forkfleet operation get ${OP}`);
    expect(d.hint).toContain('--idempotency-key cli-k1');
    expect(d.hint).not.toMatch(/retry with a larger --timeout|retry in a few seconds/);
  });

  it('aFailedFork_namesOnlyTheChildrenItLeft_notThoseThatFailedOrWereDestroyed', () => {
    const e = forkThatEnded('failed', [['sb-run', 'running'], ['sb-fail', 'failed'], ['sb-gone', 'destroyed'], ['sb-going', 'destroying'], ['sb-lost', 'lost'], ['sb-hib', 'hibernated']]);
    const d = describeError(e, 'a:1');
    expect(d.children).toEqual(['sb-run', 'sb-hib']);
    expect(d.hint).toContain('2 children were left');
    expect(d.hint).not.toMatch(/sb-fail|sb-gone|sb-going|sb-lost/);
    // None left: nothing said about children.
    const none = describeError(forkThatEnded('failed', [['sb-fail', 'failed']]), 'a:1');
    expect(none.children).toBeUndefined();
    expect(none.hint).not.toContain('left');
  });

  it('aCancelledFork_saysNothingOfChildrenLeftRunning', () => {
    // Caught by GetOperation while the cancel still destroys them: one not yet marked.
    const d = describeError(forkThatEnded('cancelled', [['sb-a', 'destroying'], ['sb-b', 'running']]), 'a:1');
    expect(d.children).toBeUndefined();
    expect(d.hint).not.toMatch(/left|running/);
    expect(d.hint).toContain('cancelled');
  });

  it('aLocalFileThatIsMissing_orADirectoryWithNoFleet_isAFailedPrecondition_withAHint_notACliBug', async () => {
    const err: string[] = [];
    vi.spyOn(process.stderr, 'write').mockImplementation((s) => (err.push(String(s)), true));
    expect(await main(['token', 'ls', '--tokens-file', '/nonexistent-ff/tokens.json'])).toBe(1);
    expect(await main(['fleet', 'status', '--dir', '/nonexistent-ff/fleet'])).toBe(1);
    const text = err.join('');
    expect(text).not.toContain('a bug in the CLI');
    expect(text).toMatch(/failed_precondition: .*\/nonexistent-ff\/tokens\.json[^]*hint: a local file or directory/);
    expect(text).toMatch(/failed_precondition: no fleet in \/nonexistent-ff\/fleet[^]*hint: start one with `npm run fleet:up`/);
  });

  it('tokenMint_withBurstButNoRate_isRefusedNamingBurst', async () => {
    const err: string[] = [];
    vi.spyOn(process.stderr, 'write').mockImplementation((s) => (err.push(String(s)), true));
    expect(await main(['token', 'mint', '--tenant', 't1', '--burst', '50', '--tokens-file', '/nonexistent-ff/tokens.json'])).toBe(2);
    expect(err.join('')).toContain('--burst: a burst belongs to a rate limit');
  });
});
