// Which Exec errors the SDK may retry: an Exec is not deduplicated, so only one after which
// the command cannot have run.
import { status as Status } from '@grpc/grpc-js';
import { describe, expect, it } from 'vitest';
import { RpcError } from '../adapters/grpc/status.ts';
import { ForkfleetError } from '../../proto/errors.ts';
import { EXEC_CALL_SLACK_MS, execNeverStarted, FILE_CALL_TIMEOUT_MS, Forkfleet } from './index.ts';

describe('execNeverStarted', () => {
  it('retriesWhatTheSchedulerAnsweredRetryable_andCallsThatNeverReachedAScheduler_only', () => {
    // The scheduler's own retryable refusal (waking failed, host not answering): not sent.
    expect(execNeverStarted(new RpcError(Status.UNAVAILABLE, 'unavailable', 'host h1 is not answering', true, undefined, undefined, true))).toBe(true);
    // The host had it (its errors reach the client non-retryable).
    expect(execNeverStarted(new RpcError(Status.UNAVAILABLE, 'unavailable', 'guest agent connection closed', false, undefined, undefined, true))).toBe(false);
    // grpc-js could not reach any scheduler.
    expect(execNeverStarted(new RpcError(Status.UNAVAILABLE, 'unavailable', 'No connection established. Last error: connect ECONNREFUSED 127.0.0.1:1', true, undefined, undefined, false))).toBe(true);
    // The call broke off in flight (a replica restarting): the command may be running.
    expect(execNeverStarted(new RpcError(Status.UNAVAILABLE, 'unavailable', 'Connection dropped', true, undefined, undefined, false))).toBe(false);
    expect(execNeverStarted(new RpcError(Status.CANCELLED, 'cancelled', 'cancelled', true, undefined, undefined, true))).toBe(false);
    expect(execNeverStarted(new ForkfleetError('unavailable', 'x', { retryable: true }))).toBe(false);
  });
});

describe('exec call deadline', () => {
  it('exec_carriesADeadlineOfItsCommandTimeoutPlusTheWakeSlack_soAHungSchedulerCannotHoldItForever', async () => {
    const ff = new Forkfleet({ address: '127.0.0.1:1', token: 'ff_test', ca: Buffer.from('-----BEGIN CERTIFICATE-----\n'), tenant: 't1' });
    ff.close();
    const deadlines: number[] = [];
    (ff as unknown as { rpc: unknown }).rpc = {
      exec: (_req: unknown, opts: { deadline?: Date }) => {
        deadlines.push(opts.deadline?.getTime() ?? Number.NaN);
        return (async function* () {})();
      },
    };
    const t0 = Date.now();
    await ff.execStream('sb-x', ['true'], { timeout: '10s' }).result();
    await ff.execStream('sb-x', ['true'], {}).result();
    const t1 = Date.now();
    expect(deadlines).toHaveLength(2);
    expect(deadlines[0]).toBeGreaterThanOrEqual(t0 + 10_000 + EXEC_CALL_SLACK_MS);
    expect(deadlines[0]).toBeLessThanOrEqual(t1 + 10_000 + EXEC_CALL_SLACK_MS);
    // No timeout given: the server's default of 60 s.
    expect(deadlines[1]).toBeGreaterThanOrEqual(t0 + 60_000 + EXEC_CALL_SLACK_MS);
  });
});

describe('file transfer deadline', () => {
  it('readAndWriteFile_allowFiveMinutesPerAttemptByDefault_orTheTimeoutGiven', async () => {
    const ff = new Forkfleet({ address: '127.0.0.1:1', token: 'ff_test', ca: Buffer.from('-----BEGIN CERTIFICATE-----\n'), tenant: 't1' });
    ff.close();
    const seen: Array<number | undefined> = [];
    (ff as unknown as { rpc: unknown }).rpc = {
      writeFile: async (_reqs: unknown, opts: { timeoutMs?: number }) => {
        seen.push(opts.timeoutMs);
        return { bytesWritten: 2n };
      },
      readFile: (_req: unknown, opts: { timeoutMs?: number }) => {
        seen.push(opts.timeoutMs);
        return (async function* () {
          yield { data: Buffer.from('hi') };
        })();
      },
    };
    const sb = ff.sandbox('sb-x');
    await sb.writeFile('/tmp/a', 'hi');
    expect((await sb.readFile('/tmp/a')).toString()).toBe('hi');
    await sb.writeFile('/tmp/a', 'hi', 0o644, { timeoutMs: 1234 });
    expect(seen).toEqual([FILE_CALL_TIMEOUT_MS, FILE_CALL_TIMEOUT_MS, 1234]);
  });
});
