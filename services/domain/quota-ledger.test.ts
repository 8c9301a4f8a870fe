import { describe, expect, it } from 'vitest';
import { QuotaLedger } from './quota-ledger.ts';
import { Fleet } from './fleet.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import type { FleetStore, FollowedRecord } from './ports.ts';
import type { OperationRec, SandboxRec, SnapshotRec } from './records.ts';

const sb = (id: string, state: SandboxRec['state'], memoryMib = 256, tenantId = 't'): SandboxRec => ({ id, tenantId, state, resources: { vcpus: 1, memoryMib, diskMib: 0 } }) as unknown as SandboxRec;
const sn = (id: string, state: SnapshotRec['state'], storedBytes: number, memoryMib = 512): SnapshotRec => ({ id, tenantId: 't', state, storedBytes, vmConfig: { memoryMib } }) as unknown as SnapshotRec;
const fork = (id: string, over: Partial<OperationRec> & { input?: Record<string, unknown> }): OperationRec => ({ id, tenantId: 't', kind: 'fork', state: 'pending', result: null, input: { snapshotId: 'sn-1', sandboxId: '', count: 4 }, ...over }) as unknown as OperationRec;

/** A store of our own port: the test decides what the list holds, what the watch delivers and etcd's revision. */
function fakeStore(initial: FollowedRecord[]) {
  const s = {
    current: 10,
    onChange: undefined as ((c: FollowedRecord) => void) | undefined,
    onRevision: undefined as ((r: number) => void) | undefined,
    onError: undefined as ((e: unknown) => void) | undefined,
    follows: 0,
    async followRecords(onChange: (c: FollowedRecord) => void, onRevision: (r: number) => void, onError: (e: unknown) => void) {
      s.follows++;
      s.onChange = onChange;
      s.onRevision = onRevision;
      s.onError = onError;
      for (const c of initial) onChange(c);
      onRevision(s.current);
      return () => undefined;
    },
    async revision() {
      return s.current;
    },
    /** A write at the next revision, delivered by the watch. */
    write(c: FollowedRecord) {
      s.current++;
      s.onChange?.(c);
      s.onRevision?.(s.current);
    },
  };
  return s;
}

describe('QuotaLedger', () => {
  it('usage_countsWhatTheListedRecordsAddUp_likeUsageOf', async () => {
    const store = fakeStore([
      { kind: 'sandbox', key: 't/a', value: sb('a', 'running', 256) },
      { kind: 'sandbox', key: 't/b', value: sb('b', 'hibernated', 512) },
      { kind: 'sandbox', key: 't/c', value: sb('c', 'destroyed', 1024) },
      { kind: 'sandbox', key: 'u/d', value: sb('d', 'running', 64, 'u') },
      { kind: 'snapshot', key: 't/sn-1', value: sn('sn-1', 'ready', 1000) },
      { kind: 'snapshot', key: 't/sn-2', value: sn('sn-2', 'deleted', 5000) },
    ]);
    const l = new QuotaLedger({ store });
    expect(await l.usage('t')).toEqual({ sandboxes: 2, memoryMib: 256, snapshotBytes: 1000, pendingSandboxes: 0, pendingMemoryMib: 0 });
    expect(await l.usage('u')).toMatchObject({ sandboxes: 1, memoryMib: 64 });
    expect(await l.usage('nobody')).toMatchObject({ sandboxes: 0, memoryMib: 0, snapshotBytes: 0 });
  });

  it('usage_afterAStartWhoseWatchFailedAfterItsList_doesNotKeepTheSharesOfRecordsGoneSince', async () => {
    const store = fakeStore([{ kind: 'sandbox', key: 't/a', value: sb('a', 'running', 256) }]);
    store.followRecords = async (onChange, onRevision) => {
      // The list is handed over, then the watch cannot be created (its revision compacted, say).
      onChange({ kind: 'sandbox', key: 't/a', value: sb('a', 'running', 256) });
      onRevision(store.current);
      throw new Error('watch create failed');
    };
    const l = new QuotaLedger({ store }, 1000, 0); // started again on the next call
    expect(await l.usage('t')).toBeUndefined(); // the caller lists records itself
    // Sandbox a was destroyed and its record expired before the next start.
    store.followRecords = async (_onChange, onRevision) => {
      onRevision(store.current);
      return () => undefined;
    };
    expect(await l.usage('t')).toMatchObject({ sandboxes: 0, memoryMib: 0 });
  });

  it('usage_followsStateChangesAndDeletes_withoutCountingARecordTwice', async () => {
    const store = fakeStore([{ kind: 'sandbox', key: 't/a', value: sb('a', 'running', 256) }]);
    const l = new QuotaLedger({ store });
    await l.usage('t');
    store.write({ kind: 'sandbox', key: 't/a', value: sb('a', 'paused', 256) });
    store.write({ kind: 'sandbox', key: 't/b', value: sb('b', 'pending', 128) });
    expect(await l.usage('t')).toMatchObject({ sandboxes: 2, memoryMib: 384 });
    store.write({ kind: 'sandbox', key: 't/a', value: sb('a', 'destroyed', 256) });
    store.write({ kind: 'sandbox', key: 't/b' }); // deleted
    expect(await l.usage('t')).toMatchObject({ sandboxes: 0, memoryMib: 0 });
  });

  it('usage_countsForksNotYetPlaced_atTheirSourcesMemory_untilPlaced', async () => {
    const store = fakeStore([
      { kind: 'snapshot', key: 't/sn-1', value: sn('sn-1', 'ready', 0, 512) },
      { kind: 'sandbox', key: 't/src', value: sb('src', 'running', 128) },
    ]);
    const l = new QuotaLedger({ store });
    await l.usage('t'); // started: it lists, then follows
    store.write({ kind: 'op', key: 't/op-1', value: fork('op-1', {}) });
    store.write({ kind: 'op', key: 't/op-2', value: fork('op-2', { input: { snapshotId: '', sandboxId: 'src', count: 2 } }) });
    expect(await l.usage('t')).toMatchObject({ pendingSandboxes: 6, pendingMemoryMib: 4 * 512 + 2 * 128 });
    // Placed (its children now have records) or finished: no longer pending.
    store.write({ kind: 'op', key: 't/op-1', value: fork('op-1', { state: 'running', result: { sandboxIds: ['x'] } }) });
    store.write({ kind: 'op', key: 't/op-2', value: fork('op-2', { state: 'failed' }) });
    expect(await l.usage('t')).toMatchObject({ pendingSandboxes: 0, pendingMemoryMib: 0 });
  });

  it('usage_countsAWakeRecordedButNotStarted_atItsSandboxsMemory_onceAndNotForTheWakeBeingAdmitted', async () => {
    // ResumeSandbox(H) records a wake; H stays hibernated (holding no memory) until the leader
    // starts it. A create right after it must see the memory the wake is about to take.
    const store = fakeStore([
      { kind: 'sandbox', key: 't/a', value: sb('a', 'running', 512) },
      { kind: 'sandbox', key: 't/h', value: sb('h', 'hibernated', 512) },
    ]);
    const l = new QuotaLedger({ store });
    expect(await l.usage('t')).toMatchObject({ memoryMib: 512, pendingMemoryMib: 0 });
    const wake = (id: string, state: OperationRec['state']): FollowedRecord => ({ kind: 'op', key: `t/${id}`, value: { id, tenantId: 't', kind: 'wake', state, targetId: 'h', input: {}, result: null } as unknown as OperationRec });
    store.write(wake('op-w1', 'pending'));
    store.write(wake('op-w2', 'pending')); // a second wake of the same sandbox counts once
    expect(await l.usage('t')).toMatchObject({ memoryMib: 512, pendingMemoryMib: 512 });
    // The admission of a wake of h itself does not count h's recorded wake on top.
    expect(await l.usage('t', 'h')).toMatchObject({ pendingMemoryMib: 0 });
    // Started: the sandbox holds its memory itself (waking), and the wake adds nothing more.
    store.write({ kind: 'sandbox', key: 't/h', value: sb('h', 'waking', 512) });
    expect(await l.usage('t')).toMatchObject({ memoryMib: 1024, pendingMemoryMib: 0 });
    store.write(wake('op-w1', 'succeeded'));
    store.write(wake('op-w2', 'failed'));
    store.write({ kind: 'sandbox', key: 't/h', value: sb('h', 'hibernated', 512) });
    expect(await l.usage('t')).toMatchObject({ memoryMib: 512, pendingMemoryMib: 0 });
  });

  it('usage_waitsUntilTheWatchHasDeliveredEtcdsCurrentRevision', async () => {
    const store = fakeStore([]);
    const l = new QuotaLedger({ store });
    await l.usage('t');
    // A write committed (etcd is at revision 11) whose watch event has not arrived yet.
    store.current = 11;
    const asked = l.usage('t');
    await new Promise((r) => setTimeout(r, 20));
    store.onChange?.({ kind: 'sandbox', key: 't/a', value: sb('a', 'pending', 256) });
    store.onRevision?.(11);
    expect(await asked).toMatchObject({ sandboxes: 1, memoryMib: 256 });
  });

  it('usage_whenTheWatchCannotCatchUpInTime_isUndefined_soAdmissionListsInstead', async () => {
    const store = fakeStore([]);
    const l = new QuotaLedger({ store }, 50);
    await l.usage('t');
    store.current = 99; // a revision the watch never delivers (a writer outside the prefix)
    expect(await l.usage('t')).toBeUndefined();
  });

  it('usage_afterTheWatchBrokeOff_listsAndFollowsAgain', async () => {
    const store = fakeStore([{ kind: 'sandbox', key: 't/a', value: sb('a', 'running') }]);
    const l = new QuotaLedger({ store });
    expect(await l.usage('t')).toMatchObject({ sandboxes: 1 });
    store.onError?.(new Error('watch cancelled: compacted'));
    expect(await l.usage('t')).toMatchObject({ sandboxes: 1 });
    expect(store.follows).toBe(2);
  });

  it('usage_whileTheStartTakesLongerThanTheBarrier_isUndefinedWithinIt_andTheStartGoesOnForLaterCalls', async () => {
    // Listing the whole fleet and opening the watch can take seconds (up to etcd's call
    // deadline when the watch cannot open): an admission does not wait for it.
    const store = fakeStore([{ kind: 'sandbox', key: 't/a', value: sb('a', 'running', 256) }]);
    const follow = store.followRecords;
    let release: () => void = () => undefined;
    store.followRecords = async (onChange, onRevision, onError) => {
      await new Promise<void>((r) => (release = r));
      return follow(onChange, onRevision, onError);
    };
    const l = new QuotaLedger({ store }, 50);
    const stuck = new Promise((r) => setTimeout(() => r('still waiting after 1 s'), 1000));
    expect(await Promise.race([l.usage('t'), stuck])).toBeUndefined(); // the caller lists records itself
    expect(await Promise.race([l.usage('t'), stuck])).toBeUndefined();
    release();
    await new Promise((r) => setTimeout(r, 10));
    expect(await l.usage('t')).toMatchObject({ sandboxes: 1, memoryMib: 256 });
    expect(store.follows).toBe(1);
  });

  it('usage_afterAFailedStart_doesNotStartAgainUntilTheRestartDelayHasPassed', async () => {
    // A watch that cannot open while reads work: each start lists every record of the fleet.
    const store = fakeStore([{ kind: 'sandbox', key: 't/a', value: sb('a', 'running', 256) }]);
    const follow = store.followRecords;
    let failing = true;
    store.followRecords = async (onChange, onRevision, onError) => {
      if (failing) {
        store.follows++;
        throw new Error('watch create: deadline exceeded');
      }
      return follow(onChange, onRevision, onError);
    };
    const l = new QuotaLedger({ store }, 1000, 200);
    for (let i = 0; i < 5; i++) expect(await l.usage('t')).toBeUndefined();
    expect(store.follows).toBe(1);
    failing = false;
    await new Promise((r) => setTimeout(r, 250));
    expect(await l.usage('t')).toMatchObject({ sandboxes: 1 });
    expect(store.follows).toBe(2);
  });

  it('getTenantUsage_ofATenantWithoutQuotas_listsItsRecords_withoutStartingTheLedger', async () => {
    // The ledger watches the whole fleet: a replica with no quotas never starts it.
    const running = { id: 'a', tenantId: 't', state: 'running', resources: { vcpus: 1, memoryMib: 256, diskMib: 0 } } as unknown as SandboxRec;
    const store = Object.assign(fakeStore([]), {
      listSandboxes: async () => [{ value: running, modRevision: 1 }],
      listSnapshots: async () => [],
      listOps: async () => [],
    });
    const usage = new QuotaLedger({ store });
    const fleet = (quota: { memoryMib?: number }): Fleet =>
      new Fleet({ store: store as unknown as FleetStore, bus: {} as never, clock: { now: () => 0 }, heard: new HeartbeatRegistry(), liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 }, quotas: () => quota, usage });
    expect((await fleet({}).tenantUsage('t')).usage).toMatchObject({ sandboxes: 1, memoryMib: 256 });
    expect(store.follows).toBe(0);
    // With a quota, GetTenantUsage reads what admission reads: the ledger (whose list holds no
    // record here, so the answer shows where it came from).
    expect((await fleet({ memoryMib: 1024 }).tenantUsage('t')).usage).toMatchObject({ sandboxes: 0, memoryMib: 0 });
    expect(store.follows).toBe(1);
  });
});
