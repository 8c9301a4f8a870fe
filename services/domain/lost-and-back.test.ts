// A sandbox lost in a hibernate whose host comes back with its VM (Executor.markHostLost, then
// vmBack): the executor over a stub store of our own port that takes every guarded write, and a
// submit of our own that records what the leader starts.
import { describe, expect, it } from 'vitest';
import type { ExecutorDeps } from './executor.ts';
import type { StoreWrite } from './ports.ts';
import type { SandboxRec } from './records.ts';
import { leaderExecutor } from '../testkit/executor.ts';
import { sandboxRecord } from '../testkit/records.ts';

interface Internals {
  markHostLost(hostId: string, only?: readonly SandboxRec[]): Promise<void>;
  vmBack(sb: SandboxRec, state: 'running' | 'paused'): Promise<void>;
}

/** The executor as a leader's, its store holding `sb` (each write replaces it), and what it wrote and submitted. */
function leaderOver(sb: SandboxRec): { ex: Internals; record: () => SandboxRec; submitted: string[] } {
  let cur = structuredClone(sb);
  let rev = 5;
  const submitted: string[] = [];
  const store = {
    getSandbox: async () => ({ value: structuredClone(cur), modRevision: rev }),
    getAlloc: async (hostId: string) => ({ value: { hostId, allocated: { vcpus: 0, memoryMib: 0, diskMib: 0 }, sandboxes: 0 }, modRevision: 3 }),
    getHost: async (id: string) => ({ value: { id, state: 'ready', capacity: { vcpus: 64, memoryMib: 65_536, diskMib: 1 << 20 } }, modRevision: 2 }),
    commitAt: async (w: StoreWrite[]) => {
      for (const x of w) if (x.kind === 'sandbox') cur = structuredClone(x.value);
      return ++rev;
    },
  };
  const submit: NonNullable<ExecutorDeps['submit']> = async (tenantId, key, kind, targetId) => {
    submitted.push(`${kind} ${targetId} ${key}`);
    return { id: 'op-r', tenantId, kind, state: 'pending' } as never;
  };
  const ex = leaderExecutor(store, { submit });
  return { ex: ex as unknown as Internals, record: () => cur, submitted };
}

describe('a sandbox lost in a hibernate, its host back', () => {
  it('fromRunning_comesBackPaused_isResumed_andNoLongerHoldsTheHibernateSnapshotInUse', async () => {
    const sb = sandboxRecord({ state: 'hibernating', hostId: 'h1', opId: 'op-h', hibernatingFrom: 'running', hibernatingTo: 'sn-h' });
    const { ex, record, submitted } = leaderOver(sb);
    await ex.markHostLost('h1', [sb]);
    // The op it was lost from under is kept (a drain's migration switches only such a one), until its state changes.
    expect(record()).toMatchObject({ state: 'lost', opId: '', lostFromOp: 'op-h', hibernatingFrom: 'running', hibernatingTo: 'sn-h' });
    // The hibernate had paused the VM: the host reports it paused.
    await ex.vmBack(record(), 'paused');
    expect(record().state).toBe('paused');
    expect(record().lostFromOp).toBeUndefined();
    expect(record().hibernatingTo).toBeUndefined();
    expect(record().hibernatingFrom).toBeUndefined();
    expect(submitted).toEqual([expect.stringMatching(/^resume sb-a __resume-back\/sb-a\//)]);
  });

  it('fromPaused_comesBackPaused_andStaysSo', async () => {
    const sb = sandboxRecord({ state: 'hibernating', hostId: 'h1', opId: 'op-h', hibernatingFrom: 'paused', hibernatingTo: 'sn-h' });
    const { ex, record, submitted } = leaderOver(sb);
    await ex.markHostLost('h1', [sb]);
    await ex.vmBack(record(), 'paused');
    expect(record()).toMatchObject({ state: 'paused' });
    expect(record().hibernatingTo).toBeUndefined();
    expect(submitted).toEqual([]);
  });

  it('aRunningSandboxLostAndBackRunning_isRunning_withNothingSubmitted', async () => {
    const sb = sandboxRecord({ state: 'running', hostId: 'h1' });
    const { ex, record, submitted } = leaderOver(sb);
    await ex.markHostLost('h1', [sb]);
    expect(record().state).toBe('lost');
    await ex.vmBack(record(), 'running');
    expect(record().state).toBe('running');
    expect(submitted).toEqual([]);
  });
});
