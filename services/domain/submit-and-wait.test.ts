// Operations the leader submits itself and waits for (a cancelled fork's destroys, a drain's
// hibernations): the executor over stub ports of our own.
import { describe, expect, it } from 'vitest';
import type { Executor } from './executor.ts';
import type { OperationRec } from './records.ts';
import { leaderExecutor } from '../testkit/executor.ts';

describe('An operation the leader submits and waits for', () => {
  it('whileThisLeaderRunsIt_isNotReadFromTheStore_andIsReadOnceItsRunEnds', async () => {
    // A cancelled fork of 256 children waits for 256 destroys: polled from etcd every 250 ms
    // each, that was ~1,000 reads a second for as long as the destroys ran.
    let state: OperationRec['state'] = 'running';
    let reads = 0;
    const op = (): OperationRec => ({ id: 'op-d', tenantId: 't', kind: 'destroy', state, targetId: 'sb-1' }) as unknown as OperationRec;
    const ex: Executor = leaderExecutor({
      getOp: async () => {
        reads++;
        return { value: op(), modRevision: 7 };
      },
      getIdempotent: async () => 'op-d',
    }, { submit: async () => op() });
    let endRun: () => void = () => undefined;
    const run = new Promise<void>((r) => (endRun = r));
    const inner = ex as unknown as { running: Map<string, Promise<void>>; submitAndWait(t: string, key: string, kind: string, target: string, input: object): Promise<string | undefined> };
    inner.running.set('op-d', run);
    const waited = inner.submitAndWait('t', 'k', 'destroy', 'sb-1', {});
    await new Promise((r) => setTimeout(r, 1200));
    expect(reads).toBe(0);
    state = 'succeeded';
    inner.running.delete('op-d');
    endRun();
    await expect(waited).resolves.toBeUndefined();
    expect(reads).toBe(1);
  });

  it('whileThisLeaderRunsIt_endsNotLeader_whenThisReplicaStopsLeading_withoutWaitingForTheRun', async () => {
    const ex: Executor = leaderExecutor({ getOp: async () => ({ value: { id: 'op-d', tenantId: 't', kind: 'destroy', state: 'running' }, modRevision: 7 }) }, { submit: async () => ({ id: 'op-d' }) as unknown as OperationRec });
    const inner = ex as unknown as { running: Map<string, Promise<void>>; submitAndWait(t: string, key: string, kind: string, target: string, input: object): Promise<string | undefined> };
    inner.running.set('op-d', new Promise<void>(() => undefined)); // a run that never ends
    const waited = inner.submitAndWait('t', 'k', 'destroy', 'sb-1', {}).then(() => 'resolved', (e: unknown) => (e as Error).name);
    await new Promise((r) => setTimeout(r, 50));
    await ex.stop();
    expect(await waited).toBe('NotLeaderError');
  });
});
