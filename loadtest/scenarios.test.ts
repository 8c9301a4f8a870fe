import { describe, expect, it } from 'vitest';
import { Driver, OperationKind, childrenPerHost, misplaced, newLedger } from './scenarios.ts';
import { RunStopped } from './interrupt.ts';
import type { Api } from './scenarios.ts';
import { OperationState } from '../proto/gen/forkfleet/v1/fleet_pb.ts';

/**
 * The fleet API as far as the driver uses it for a fork. The fork's children exist (with the
 * fork's labels) once it is submitted; its operation stays RUNNING until cancelled, or for
 * good when `hangs`. Destroys succeed at once.
 */
function fakeApi(o: { hangs: boolean }) {
  const sandboxes = new Map<string, Record<string, string>>();
  const cancelled: string[] = [];
  const destroyed: string[] = [];
  let release: (() => void) | undefined;
  const forkDone = new Promise<void>((r) => (release = r));
  let n = 0;
  const api = {
    forkSandbox: async (req: { count: number; labels: Record<string, string> }) => {
      for (let i = 0; i < req.count; i++) sandboxes.set(`sb-${n++}`, req.labels);
      return { id: 'op-fork', kind: OperationKind.FORK };
    },
    destroySandbox: async (req: { sandboxId: string }) => {
      destroyed.push(req.sandboxId);
      sandboxes.delete(req.sandboxId);
      return { id: `op-d-${req.sandboxId}`, kind: OperationKind.DESTROY };
    },
    cancelOperation: async (req: { operationId: string }) => {
      cancelled.push(req.operationId);
      release!();
      return { id: req.operationId };
    },
    waitOperation: async (req: { operationId: string }) => {
      if (req.operationId !== 'op-fork') return { id: req.operationId, state: OperationState.SUCCEEDED, result: { case: undefined } };
      if (o.hangs) await forkDone;
      return { id: 'op-fork', kind: OperationKind.FORK, state: cancelled.length ? OperationState.CANCELLED : OperationState.RUNNING, result: { case: undefined } };
    },
    listSandboxes: async (req: { labels: Record<string, string>; pageToken: string }) => ({
      sandboxes: [...sandboxes].filter(([, l]) => Object.entries(req.labels).every(([k, v]) => l[k] === v)).map(([id]) => ({ id })),
      nextPageToken: '',
    }),
  };
  return { api: api as unknown as Api, sandboxes, cancelled, destroyed };
}

describe('load-test driver', () => {
  it('fork_whenItsOperationTimesOut_cancelsItAndDestroysTheChildrenItMade', async () => {
    const f = fakeApi({ hangs: false });
    const d = new Driver(f.api, 1000);
    await expect(d.fork('snap-1', 2, {})).rejects.toThrow(/RUNNING after 1000 ms/);
    expect(f.cancelled).toEqual(['op-fork']);
    expect(f.destroyed.sort()).toEqual(['sb-0', 'sb-1']);
    expect(f.sandboxes.size).toBe(0);
  });

  it('tidy_whileAForkIsUnderWay_cancelsItAndDestroysWhatItMade', async () => {
    const f = fakeApi({ hangs: true });
    const d = new Driver(f.api, 1000);
    const forking = d.fork('snap-1', 3, {}).catch(() => undefined);
    await new Promise((r) => setTimeout(r, 20));
    await d.tidy();
    expect(f.cancelled).toContain('op-fork');
    expect(f.sandboxes.size).toBe(0);
    await forking;
  });
});

/**
 * A fleet API whose forks succeed at once, placing child i on `hostsOfChildren[i]`; hibernate,
 * resume, exec and destroy as `o` says. Waits honour the call's AbortSignal, as the real client's.
 */
function fleetApi(o: { hostsOfChildren?: string[]; hibernate?: 'fails' | 'ok'; destroyFailures?: number; destroyNotFound?: boolean; forkHangs?: boolean } = {}) {
  const sandboxes = new Map<string, { labels: Record<string, string>; hostId: string }>();
  const calls: string[] = [];
  let destroyFailuresLeft = o.destroyFailures ?? 0;
  let n = 0;
  let forkOp: { id: string; children: Array<{ id: string; hostId: string }>; cancelled: boolean } | undefined;
  const aborted = (signal: AbortSignal | undefined): Promise<never> =>
    new Promise((_r, j) => {
      if (signal?.aborted) j(new Error('cancelled'));
      signal?.addEventListener('abort', () => j(new Error('cancelled')), { once: true });
    });
  const api = {
    forkSandbox: async (req: { count: number; labels: Record<string, string> }) => {
      calls.push('fork');
      const children = Array.from({ length: req.count }, (_, i) => ({ id: `sb-${n++}`, hostId: o.hostsOfChildren?.[i] ?? 'h1' }));
      for (const c of children) sandboxes.set(c.id, { labels: req.labels, hostId: c.hostId });
      forkOp = { id: 'op-fork', children, cancelled: false };
      return { id: 'op-fork', kind: OperationKind.FORK };
    },
    hibernateSandbox: async (req: { sandboxId: string }) => {
      calls.push(`hibernate ${req.sandboxId}`);
      return { id: o.hibernate === 'fails' ? 'op-hibernate-fails' : 'op-ok', kind: OperationKind.HIBERNATE };
    },
    resumeSandbox: async () => ({ id: 'op-ok', kind: OperationKind.RESUME }),
    getSandbox: async (req: { sandboxId: string }) => ({ id: req.sandboxId, hostId: 'h2' }),
    cordonHost: async (req: { hostId: string; cordon: boolean }) => {
      calls.push(`${req.cordon ? 'cordon' : 'uncordon'} ${req.hostId}`);
      return {};
    },
    destroySandbox: async (req: { sandboxId: string }) => {
      calls.push(`destroy ${req.sandboxId}`);
      if (o.destroyNotFound) throw Object.assign(new Error(`sandbox ${req.sandboxId} not found`), { kind: 'not_found' });
      if (destroyFailuresLeft > 0) {
        destroyFailuresLeft--;
        throw new Error('host unreachable');
      }
      sandboxes.delete(req.sandboxId);
      return { id: 'op-ok', kind: OperationKind.DESTROY };
    },
    cancelOperation: async (req: { operationId: string }) => {
      calls.push(`cancel ${req.operationId}`);
      if (forkOp && req.operationId === forkOp.id) {
        forkOp.cancelled = true;
        for (const c of forkOp.children) sandboxes.delete(c.id);
      }
      return { id: req.operationId };
    },
    waitOperation: async (req: { operationId: string }, opts?: { signal?: AbortSignal }) => {
      if (req.operationId === 'op-hibernate-fails') return { id: req.operationId, kind: OperationKind.HIBERNATE, state: OperationState.FAILED, error: { message: 'hibernate failed: disk full' }, result: { case: undefined } };
      if (req.operationId === 'op-fork') {
        if (o.forkHangs && !forkOp?.cancelled) await aborted(opts?.signal);
        if (forkOp?.cancelled) return { id: 'op-fork', kind: OperationKind.FORK, state: OperationState.CANCELLED, result: { case: undefined } };
        return { id: 'op-fork', kind: OperationKind.FORK, state: OperationState.SUCCEEDED, steps: [], result: { case: 'fork', value: { children: forkOp!.children } } };
      }
      return { id: req.operationId, state: OperationState.SUCCEEDED, steps: [], result: { case: undefined } };
    },
    exec: async function* () {
      yield { payload: { case: 'exit', value: { exitCode: 0 } } };
    },
    listSandboxes: async (req: { labels: Record<string, string> }) => ({
      sandboxes: [...sandboxes].filter(([, s]) => Object.entries(req.labels).every(([k, v]) => s.labels[k] === v)).map(([id]) => ({ id })),
      nextPageToken: '',
    }),
  };
  return { api: api as unknown as Api, sandboxes, calls };
}

describe('where a fork put its children', () => {
  it('misplaced_sameHost_namesEveryChildOffTheHolders', () => {
    const want = { holders: ['h1', 'h2'], on: 'holder' as const };
    expect(misplaced(want, [{ id: 'a', hostId: 'h1' }, { id: 'b', hostId: 'h2' }])).toBeUndefined();
    expect(misplaced(want, [{ id: 'a', hostId: 'h1' }, { id: 'b', hostId: 'h3' }])).toMatch(/1 of 2 children on a host that did not hold the snapshot \(b on h3; holders before the fork: h1, h2\)/);
  });

  it('misplaced_crossHost_namesEveryChildOnAHolder', () => {
    const want = { holders: ['h1'], on: 'non-holder' as const };
    expect(misplaced(want, [{ id: 'a', hostId: 'h2' }, { id: 'b', hostId: 'h3' }])).toBeUndefined();
    expect(misplaced(want, [{ id: 'a', hostId: 'h1' }])).toMatch(/1 of 1 children on a host that already held the snapshot \(a on h1/);
  });

  it('childrenPerHost_countsEachHost_andMarksTheHolders', () => {
    expect(childrenPerHost([{ hostId: 'h2' }, { hostId: 'h1' }, { hostId: 'h2' }], ['h1'])).toBe('h1 1 (holder), h2 2');
  });

  it('fork_crossHost_whenAChildLandsOnAHolder_failsTheSample_andDestroysItsChildren', async () => {
    const f = fleetApi({ hostsOfChildren: ['h2', 'h1'] });
    const d = new Driver(f.api, 1000);
    await expect(d.fork('snap-1', 2, {}, { holders: ['h1'], on: 'non-holder' })).rejects.toThrow(/1 of 2 children on a host that already held/);
    expect(f.sandboxes.size).toBe(0);
  });

  it('fork_sameHost_withEveryChildOnAHolder_isASample', async () => {
    const f = fleetApi({ hostsOfChildren: ['h1', 'h1'] });
    const r = await new Driver(f.api, 1000).fork('snap-1', 2, {}, { holders: ['h1'], on: 'holder' });
    expect(r.ms).toHaveLength(2);
  });
});

describe('hibernated wake', () => {
  it('wakeHibernated_whenTheHibernateFails_destroysTheChild_andTellsTheCaller', async () => {
    const f = fleetApi({ hibernate: 'fails' });
    const seen: unknown[] = [];
    await expect(new Driver(f.api, 1000).wakeHibernated('snap-1', true, (e) => seen.push(e))).rejects.toThrow(/hibernate failed: disk full/);
    expect(seen).toHaveLength(1);
    // The child would otherwise run under the baselines a ratio divides by.
    expect(f.sandboxes.size).toBe(0);
    expect(f.calls.filter((c) => c.startsWith('cordon'))).toEqual([]);
  });

  it('wakeHibernated_cold_cordonsItsHost_thenUncordonsIt_andDestroysTheChild', async () => {
    const f = fleetApi({ hostsOfChildren: ['h1'] });
    const d = new Driver(f.api, 1000);
    expect(await d.wakeHibernated('snap-1', true)).toBeGreaterThanOrEqual(0);
    expect(f.calls.filter((c) => /cordon/.test(c))).toEqual(['cordon h1', 'uncordon h1']);
    expect(f.sandboxes.size).toBe(0);
    expect(d.ledger.cordoned.size).toBe(0);
  });
});

describe('destroying what a sample made', () => {
  it('destroyAll_retriesAFailedDestroyOnce', async () => {
    const f = fleetApi({ destroyFailures: 1 });
    const d = new Driver(f.api, 1000);
    await d.fork('snap-1', 1, {});
    await d.destroyAll(['sb-0']);
    expect(f.calls.filter((c) => c.startsWith('destroy'))).toEqual(['destroy sb-0', 'destroy sb-0']);
    expect(f.sandboxes.size).toBe(0);
    expect(d.ledger.undestroyed.size).toBe(0);
  });

  it('destroyAll_whenBothTriesFail_recordsTheSandboxAsUndestroyed_untilALaterDestroySucceeds', async () => {
    const f = fleetApi({ destroyFailures: 2 });
    const d = new Driver(f.api, 1000);
    await d.fork('snap-1', 1, {});
    await d.destroyAll(['sb-0']);
    expect([...d.ledger.undestroyed]).toEqual([['sb-0', 'host unreachable']]);
    expect(d.ledger.sandboxes.has('sb-0')).toBe(true);
    await d.destroyAll(['sb-0']);
    expect(d.ledger.undestroyed.size).toBe(0);
    expect(d.ledger.sandboxes.size).toBe(0);
  });

  it('destroyAll_ofASandboxAlreadyGone_isNotAFailure', async () => {
    const d = new Driver(fleetApi({ destroyNotFound: true }).api, 1000);
    await d.destroyAll(['sb-9']);
    expect(d.ledger.undestroyed.size).toBe(0);
  });
});

describe('a stopped run', () => {
  it('fork_afterTheRunStopped_submitsNothing', async () => {
    const ac = new AbortController();
    const f = fleetApi();
    const d = new Driver(f.api, 1000, newLedger(ac.signal));
    ac.abort();
    await expect(d.fork('snap-1', 1, {})).rejects.toBeInstanceOf(RunStopped);
    expect(f.calls).toEqual([]);
  });

  it('cordon_afterTheRunStopped_isRefused_butAnUncordonGoesAhead', async () => {
    const ac = new AbortController();
    const f = fleetApi();
    const d = new Driver(f.api, 1000, newLedger(ac.signal));
    ac.abort();
    await expect(d.cordon('h1', true)).rejects.toBeInstanceOf(RunStopped);
    expect(d.ledger.cordoned.size).toBe(0);
    await d.cordon('h1', false);
    expect(f.calls).toEqual(['uncordon h1']);
  });

  it('fork_whenTheRunStopsWhileItsOperationRuns_endsAtOnce_cancelsIt_andDestroysWhatItMade', async () => {
    const ac = new AbortController();
    const f = fleetApi({ forkHangs: true });
    // An op timeout far beyond the test's: only the stop can end the wait.
    const d = new Driver(f.api, 600_000, newLedger(ac.signal));
    const forking = d.fork('snap-1', 2, {});
    await new Promise((r) => setTimeout(r, 20));
    ac.abort();
    await expect(forking).rejects.toBeInstanceOf(RunStopped);
    expect(f.calls).toContain('cancel op-fork');
    expect(f.sandboxes.size).toBe(0);
    expect(d.ledger.ops.size).toBe(0);
  });
});
