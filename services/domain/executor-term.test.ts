// Executor.start() against stores that answer when the test says: leadership that ends while
// the new leader is still starting (its lease lapsed during a long list) must leave no leader
// work running on the replica. The store and bus are stubs of our own ports: every method
// not named here answers at once with nothing.
import type { AsyncLocalStorage } from 'node:async_hooks';
import { describe, expect, it } from 'vitest';
import pino from 'pino';
import { Executor, leaderTerm } from './executor.ts';
import type { ExecutorDeps } from './executor.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import { NotLeaderError } from './errors.ts';
import type { HostResultMsg } from './messages.ts';
import { HostResultSchema } from './messages.ts';
import { create, toBinary } from '@bufbuild/protobuf';
import type { HostRec, OperationRec } from './records.ts';
import type { Versioned } from './ports.ts';
import { sandboxRecord } from '../testkit/records.ts';
import { waitFor } from '../testkit/proc.ts';

/** A port stub: the named methods, and for every other one an async function answering []. */
function stub<T>(methods: Record<string, unknown>): T {
  return new Proxy(methods, { get: (target, key) => (key in target ? target[key as string] : key === 'then' ? undefined : async () => []) }) as T;
}

/** Operations the executor would submit itself: none in these tests. */
const NO_SUBMIT: Partial<ExecutorDeps> = {
  submit: async () => {
    throw new Error('not in this test');
  },
};

/** An executor over `store` with these tests' quiet defaults: `bus` (default: consumes no results), `config` added to the base one, `extra` deps. */
function executorOf(store: ExecutorDeps['store'], o: { bus?: ExecutorDeps['bus']; log?: ExecutorDeps['log']; config?: Partial<ExecutorDeps['config']>; extra?: Partial<ExecutorDeps> } = {}): Executor {
  return new Executor({
    store,
    bus: o.bus ?? stub({ consumeResults: async () => async () => undefined }),
    clock: { now: () => Date.now() },
    log: o.log ?? pino({ level: 'silent' }),
    heard: new HeartbeatRegistry(),
    signer: stub({}),
    config: { liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 }, stepTimeoutMs: 1000, stepAttempts: 1, chunkBytes: 1 << 18, ...o.config },
    ...o.extra,
  });
}

describe('Executor terms', () => {
  it('stopWhileStartListsOperations_leavesNoWatchNoConsumerAndNoPeriodicPass', async () => {
    let releaseOps!: () => void;
    const opsListed = new Promise<void>((r) => (releaseOps = r));
    const open = new Set<string>();
    let passes = 0;
    const watch = (name: string) => async () => {
      open.add(name);
      return () => void open.delete(name);
    };
    const store = stub<ExecutorDeps['store']>({
      watchFleet: watch('fleet'),
      watchOps: watch('ops'),
      followSandboxes: watch('sandboxes'),
      listOps: async () => {
        await opsListed;
        return [];
      },
      listSandboxes: async () => {
        passes++;
        return [];
      },
      listHosts: async () => {
        passes++;
        return [];
      },
    });
    const bus = stub<ExecutorDeps['bus']>({
      consumeResults: async () => {
        open.add('results');
        return async () => void open.delete('results');
      },
    });
    const ex = executorOf(store, { bus, config: { heldSnapshotCheckMs: 100 }, extra: NO_SUBMIT });
    const starting = ex.start();
    await new Promise((r) => setTimeout(r, 50));
    await ex.stop();
    const before = passes;
    releaseOps();
    await starting;
    // Longer than every pass's period (host reconcile 1 s, lifecycle 2 s, held check 100 ms).
    await new Promise((r) => setTimeout(r, 2500));
    expect([...open]).toEqual([]);
    expect(passes).toBe(before);
  }, 10_000);

  it('resultFromAHost_whileTheLeaseHasRunOut_isNotTaken_soItGoesToWhoeverLeads', async () => {
    let leading = true;
    let onResult: ((r: HostResultMsg, ack: () => void, fromHost: string) => void | Promise<void>) | undefined;
    const ex = executorOf(stub({ watchFleet: async () => () => undefined, watchOps: async () => () => undefined, followSandboxes: async () => () => undefined }), {
      bus: stub({
        consumeResults: async (cb: typeof onResult) => {
          onResult = cb;
          return async () => undefined;
        },
      }),
      extra: { leading: () => leading },
    });
    await ex.start();
    try {
      const r = create(HostResultSchema, { opId: 'op-1', stepId: 's1' });
      let acks = 0;
      leading = false;
      expect(() => onResult!(r, () => acks++, 'h1')).toThrow(NotLeaderError);
      expect(acks).toBe(0);
      leading = true;
      await onResult!(r, () => acks++, 'h1');
      expect(acks).toBe(1);
    } finally {
      await ex.stop();
    }
  });

  it('resultsNobodyWaitsFor_areKeptAsCopiesOfTheirOwn_andNoMoreThan64MiBOfThem', async () => {
    const ex = executorOf(stub({}));
    // 1 MiB manifests, each a view into a larger received buffer (as a batch's items are).
    const big = (i: number): HostResultMsg => {
      const received = new Uint8Array(2 << 20);
      return create(HostResultSchema, { opId: `op-${i}`, stepId: 's', manifest: { manifest: received.subarray(0, 1 << 20), signature: new Uint8Array(64), keyId: 'k' } });
    };
    const first = big(0);
    ex.onResult(first, 'h1');
    for (let i = 1; i < 100; i++) ex.onResult(big(i), 'h1');
    const held = ex as unknown as { early: Map<string, { result: HostResultMsg }>; earlyBytes: number };
    expect(held.earlyBytes).toBeLessThanOrEqual(64 << 20);
    expect(held.early.size).toBeLessThan(100);
    // The newest are the ones kept, and none holds on to the buffer it was received in.
    const newest = [...held.early.values()].at(-1)!.result;
    expect(newest.opId).toBe('op-99');
    expect(newest.manifest!.manifest.buffer.byteLength).toBe(toBinary(HostResultSchema, newest).length);
    expect(held.early.has('op-0/s')).toBe(false);
  });

  it('leaderTerm_ofHostWork_isTheFencesCreateRevisionEtcdClusterAndStore_noneWithoutAFence_andOlderThanAnyForAFenceWhoseKeyWasGone', () => {
    expect(leaderTerm({ key: 'k', createRevision: 4711, clusterId: '14841639068965178418', storeId: '18446744073709551615' })).toEqual({ term: 4711n, cluster: 14841639068965178418n, store: 18446744073709551615n });
    expect(leaderTerm(undefined)).toEqual({ term: 0n, cluster: 0n, store: 0n });
    expect(leaderTerm({ key: 'k', createRevision: -1, clusterId: '7' })).toEqual({ term: 1n, cluster: 7n, store: 0n });
    // An id that is not a uint64 is none (the proto field could not carry it).
    expect(leaderTerm({ key: 'k', createRevision: 9, clusterId: '99999999999999999999', storeId: '18446744073709551616' })).toEqual({ term: 9n, cluster: 0n, store: 0n });
  });

  it('opWhoseRunnerCrashed_evenItsFailureUnrecordable_runsAgainLaterInTheSameTerm_andEnds', async () => {
    // An op of a kind this scheduler does not run: it fails at once. Every write conflicts
    // (20 tries each) until the runner has crashed, then lands.
    const op = { id: 'op-x', tenantId: 't1', kind: 'bogus', state: 'running', createdAt: 0, updatedAt: 0, targetId: 'sb-x', input: {}, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {} };
    let crashed = false;
    const written: string[] = [];
    const log = pino({ level: 'error' }, { write: (line: string) => void (line.includes('operation runner crashed') && (crashed = true)) });
    const store = stub<ExecutorDeps['store']>({
      watchFleet: async () => () => undefined,
      watchOps: async () => () => undefined,
      followSandboxes: async () => () => undefined,
      listOps: async () => [{ value: op, modRevision: 1 }],
      getOp: async () => ({ value: op, modRevision: 1 }),
      commitAt: async (writes: Array<{ kind: string; value?: { state?: string } }>) => {
        if (!crashed) return 0;
        for (const w of writes) if (w.kind === 'op') written.push(w.value!.state!);
        return 2;
      },
    });
    const ex = executorOf(store, { log, config: { crashedRerunMs: 50 } });
    await ex.start();
    try {
      await waitFor('the op written failed', async () => written.includes('failed'), 5000, 20);
      expect(crashed).toBe(true);
    } finally {
      await ex.stop();
    }
  });

  it('anOpWhoseEarlierTermRunnerOutlivedStop_isRunAgainWhenThatRunnerEnds_inTheNewTerm', async () => {
    // The runner waits on etcd longer than stop() waits for it (2 s); the replica leads again
    // meanwhile, and its listing skips the op (still running here). Before, once the old
    // runner ended (its commit refused: an earlier term), nothing ran the op until the next
    // change of leader.
    const op: OperationRec = {
      id: 'op-destroy-1', tenantId: 't1', kind: 'destroy', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'sb-1', input: {},
      progress: { done: 0, total: 1, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {},
    };
    let releaseFirstRead!: () => void;
    const firstRead = new Promise<void>((r) => (releaseFirstRead = r));
    let reads = 0;
    const committed: Array<Record<string, unknown>> = [];
    const store = stub<ExecutorDeps['store']>({
      watchFleet: async () => () => undefined,
      watchOps: async () => () => undefined,
      followSandboxes: async () => () => undefined,
      listOps: async () => [{ value: op, modRevision: 2 }],
      getOp: async () => ({ value: op, modRevision: 2 }),
      getSandbox: async () => {
        if (++reads === 1) await firstRead;
        return { value: sandboxRecord({ id: 'sb-1', tenantId: 't1', state: 'destroyed' }), modRevision: 3 };
      },
      commitAt: async (writes: Array<{ kind: string; value: Record<string, unknown> }>) => {
        for (const w of writes) if (w.kind === 'op') committed.push(w.value);
        return 10;
      },
    });
    const ex = executorOf(store, { config: { heldSnapshotCheckMs: 60_000 }, extra: NO_SUBMIT });
    try {
      await ex.start();
      await waitFor('the runner reading the sandbox', async () => reads === 1, 5000);
      await ex.stop(); // gives up on the runner after 2 s
      await ex.start();
      releaseFirstRead();
      await waitFor('the op written succeeded', async () => committed.some((o) => o.id === op.id && o.state === 'succeeded'), 5000);
    } finally {
      await ex.stop();
    }
  }, 20_000);

  describe('a clean-up send (sendHostWork) whose first try failed, retried after stop() and start()', () => {
    /** An executor whose bus refuses the first sendWork and records every one; `send` is sendHostWork. */
    const setUp = () => {
      const sent: string[] = [];
      const ex = executorOf(stub({ watchFleet: async () => () => undefined, watchOps: async () => () => undefined, followSandboxes: async () => () => undefined }), {
        bus: stub({
          consumeResults: async () => async () => undefined,
          sendWork: async (hostId: string, w: { stepId: string }) => {
            sent.push(`${hostId}/${w.stepId}`);
            if (sent.length === 1) throw new Error('NATS is restarting');
          },
        }),
        config: { heldSnapshotCheckMs: 60_000 },
        extra: NO_SUBMIT,
      });
      const inner = ex as unknown as { term: number; runnerTerm: AsyncLocalStorage<number>; sendHostWork: (hostId: string, opId: string, tenantId: string, stepId: string, work: unknown, failed: string) => Promise<void> };
      const send = (): Promise<void> => inner.sendHostWork('h1', 'op-1', 't1', 'stop/sb-1', { case: 'destroyVm', value: { sandboxId: 'sb-1' } }, 'could not stop');
      return { ex, inner, sent, send };
    };

    it('sendHostWork_fromARunnerOfAnEarlierTerm_sendsNothingMoreInTheNewTerm', async () => {
      const { ex, inner, sent, send } = setUp();
      try {
        await ex.start();
        const earlier = inner.term;
        const sending = inner.runnerTerm.run(earlier, send);
        await waitFor('the first send', async () => sent.length === 1, 5000, 5);
        // The replica loses its lease and wins it back while the retry sleeps (500 ms).
        await ex.stop();
        await ex.start();
        await sending;
        // And a first send from that runner, in the new term (as its `void this.sendHostWork`s).
        await inner.runnerTerm.run(earlier, send);
        // Before, both went out stamped with the new term (the bus stamps at send time).
        expect(sent).toEqual(['h1/stop/sb-1']);
      } finally {
        await ex.stop();
      }
    });

    it('sendHostWork_outsideARunner_sendsNothingMoreOnceItsTermHasEnded', async () => {
      const { ex, sent, send } = setUp();
      try {
        await ex.start();
        const sending = send();
        await waitFor('the first send', async () => sent.length === 1, 5000, 5);
        await ex.stop();
        await ex.start();
        await sending;
        expect(sent).toEqual(['h1/stop/sb-1']);
      } finally {
        await ex.stop();
      }
    });

    it('sendHostWork_inTheCurrentTerm_isRetriedUntilItGoesOut', async () => {
      const { ex, inner, sent, send } = setUp();
      try {
        await ex.start();
        await inner.runnerTerm.run(inner.term, send);
        await send(); // and outside a runner (reconcile passes driven by heartbeats)
        expect(sent).toEqual(['h1/stop/sb-1', 'h1/stop/sb-1', 'h1/stop/sb-1']);
      } finally {
        await ex.stop();
      }
    });
  });

  it('gauges_reportNothingUntilTheTermHasLoadedTheFleet_neitherZeroHostsOfAFirstTermNorAnEarlierTermsFigures', async () => {
    const host = (id: string): HostRec => ({ id, state: 'ready', cordoned: false, draining: false, capacity: { vcpus: 8, memoryMib: 4096, diskMib: 10_000 } }) as HostRec;
    let hosts: Array<Versioned<HostRec>> = [{ value: host('a'), modRevision: 1 }];
    let release!: () => void;
    let listed = false;
    const gate = (): void => {
      listed = false;
      const p = new Promise<void>((r) => (release = r));
      store.listHosts = async () => {
        listed = true;
        await p;
        return hosts;
      };
    };
    const store = stub<ExecutorDeps['store']>({
      watchFleet: async () => () => undefined,
      watchOps: async () => () => undefined,
      followSandboxes: async () => () => undefined,
      revision: async () => 5,
      listHosts: async () => hosts,
    });
    const ex = executorOf(store);
    try {
      // A first term, its fleet still being listed: no figures (not 0 ready hosts).
      gate();
      let starting = ex.start();
      await waitFor('hosts listed', async () => listed, 5000, 5);
      expect(ex.gauges()).toBeUndefined();
      release();
      await starting;
      expect([...ex.gauges()!.hosts.keys()]).toEqual(['a']);
      await ex.stop();
      expect(ex.gauges()).toBeUndefined();
      // Leading again after host a was removed: not the last term's figures while it lists.
      hosts = [];
      gate();
      starting = ex.start();
      await waitFor('hosts listed again', async () => listed, 5000, 5);
      expect(ex.gauges()).toBeUndefined();
      release();
      await starting;
      expect([...ex.gauges()!.hosts.keys()]).toEqual([]);
    } finally {
      release();
      await ex.stop();
    }
  });
});
