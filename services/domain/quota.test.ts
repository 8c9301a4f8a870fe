import { describe, expect, it } from 'vitest';
import { admit, checkQuota, MIGRATION_SNAPSHOT_TTL_MS, usageOf } from './quota.ts';
import { QuotaLedger } from './quota-ledger.ts';
import type { OperationRec, SandboxRec, SnapshotRec } from './records.ts';
import type { FleetStore, FollowedRecord } from './ports.ts';
import { Fleet } from './fleet.ts';
import { HeartbeatRegistry } from './fleet-view.ts';

const sb = (state: SandboxRec['state'], memoryMib: number): SandboxRec => ({ state, resources: { vcpus: 1, memoryMib, diskMib: 0 } }) as unknown as SandboxRec;
const sn = (state: SnapshotRec['state'], storedBytes: number): SnapshotRec => ({ state, storedBytes }) as unknown as SnapshotRec;
const err = (f: () => void): { kind: string; field: string | undefined; message: string; retryable: boolean } | undefined => {
  try {
    f();
    return undefined;
  } catch (e) {
    return e as { kind: string; field: string | undefined; message: string; retryable: boolean };
  }
};

/**
 * A Fleet over a store of one sandbox (as `sandbox()` returns it now) and one stored snapshot,
 * with a snapshot_bytes quota the snapshot fills; `submitted()`: operations recorded.
 */
function fleetOverOne(sandbox: () => SandboxRec, stored: SnapshotRec): { fleet: Fleet; submitted: () => number } {
  let n = 0;
  const store = {
    getIdempotent: async () => undefined,
    getSandbox: async () => ({ value: sandbox(), modRevision: 3 }),
    getSnapshot: async () => ({ value: stored, modRevision: 3 }),
    listSandboxes: async () => [{ value: sandbox(), modRevision: 3 }],
    listSnapshots: async () => [{ value: stored, modRevision: 3 }],
    listOps: async () => [],
    commit: async () => {
      n++;
      return true;
    },
  } as unknown as FleetStore;
  const fleet = new Fleet({ store, bus: {} as never, clock: { now: () => Date.now() }, heard: new HeartbeatRegistry(), liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 }, quotas: () => ({ snapshotBytes: 1000 }) });
  return { fleet, submitted: () => n };
}

describe('quotas', () => {
  it('admit_countsChildrenOfForksNotYetPlaced', async () => {
    const running = { id: 'sb-a', tenantId: 't', state: 'running', resources: { vcpus: 1, memoryMib: 256, diskMib: 0 } } as unknown as SandboxRec;
    const fork = (id: string, placed: boolean) => ({ id, tenantId: 't', kind: 'fork', state: 'running', input: { sandboxId: 'sb-a', snapshotId: '', count: 3 }, result: placed ? { sandboxIds: ['x'] } : null }) as unknown as OperationRec;
    const store = (ops: OperationRec[]) =>
      ({
        listSandboxes: async () => [{ value: running, modRevision: 1 }],
        listSnapshots: async () => [],
        // As the store: one tenant's when asked for one (its key prefix).
        listOps: async (o: { tenantId?: string }) => ops.filter((v) => o.tenantId === undefined || v.tenantId === o.tenantId).map((value) => ({ value, modRevision: 1 })),
        getSandbox: async () => ({ value: running, modRevision: 1 }),
      }) as unknown as FleetStore;
    const quotas = () => ({ sandboxes: 5 });
    // 1 running + 3 coming from an unplaced fork + 1 asked = 5: fits; one more does not.
    await expect(admit({ store: store([fork('op-1', false)]), quotas }, 't', { sandboxes: 1 })).resolves.toBeUndefined();
    await expect(admit({ store: store([fork('op-1', false)]), quotas }, 't', { sandboxes: 2 })).rejects.toMatchObject({ kind: 'resource_exhausted', field: 'quotas.sandboxes' });
    // A placed fork's children are counted from their records instead.
    await expect(admit({ store: store([fork('op-1', true)]), quotas }, 't', { sandboxes: 4 })).resolves.toBeUndefined();
    // Another tenant's unplaced fork counts against that tenant only.
    await expect(admit({ store: store([{ ...fork('op-2', false), tenantId: 'u' }]), quotas }, 't', { sandboxes: 4 })).resolves.toBeUndefined();
  });

  it('admit_whenAForksPlacementCommitsBetweenItsListReads_countsItsChildrenOnce', async () => {
    // The listings are read at different revisions: the fork's op may say unplaced while the
    // sandbox list already has its children, or say placed while the list does not have them
    // yet. Either way its 3 children count once: 1 running + 3 + 1 asked = 5 fits, 2 do not.
    const running = { id: 'sb-a', tenantId: 't', state: 'running', resources: { vcpus: 1, memoryMib: 256, diskMib: 0 } } as unknown as SandboxRec;
    const kids = ['c1', 'c2', 'c3'].map((id) => ({ ...running, id, state: 'starting' }) as SandboxRec);
    const fork = (placed: boolean) => ({ id: 'op-1', tenantId: 't', kind: 'fork', state: 'running', input: { sandboxId: 'sb-a', snapshotId: '', count: 3, childIds: kids.map((k) => k.id) }, result: placed ? { sandboxIds: kids.map((k) => k.id) } : null }) as unknown as OperationRec;
    const store = (op: OperationRec, listed: SandboxRec[]) =>
      ({
        listSandboxes: async () => listed.map((value) => ({ value, modRevision: 1 })),
        listSnapshots: async () => [],
        listOps: async () => [{ value: op, modRevision: 1 }],
        getSandbox: async () => ({ value: running, modRevision: 1 }),
      }) as unknown as FleetStore;
    const quotas = () => ({ sandboxes: 5 });
    for (const [op, listed] of [[fork(false), [running, ...kids]], [fork(true), [running]]] as const) {
      await expect(admit({ store: store(op, [...listed]), quotas }, 't', { sandboxes: 1 })).resolves.toBeUndefined();
      await expect(admit({ store: store(op, [...listed]), quotas }, 't', { sandboxes: 2 })).rejects.toMatchObject({ kind: 'resource_exhausted', field: 'quotas.sandboxes' });
    }
  });

  it('usageOf_countsLiveSandboxes_memoryOnlyOfThoseHoldingCapacity_andStoredSnapshotBytes', () => {
    const u = usageOf(
      [sb('running', 256), sb('pending', 128), sb('hibernated', 512), sb('destroyed', 1024), sb('failed', 64), sb('lost', 64), sb('paused', 100)],
      [sn('ready', 1000), sn('creating', 10), sn('deleted', 5000), sn('failed', 7)],
    );
    expect(u).toEqual({ sandboxes: 4, memoryMib: 484, snapshotBytes: 1010 });
  });

  // A drain with migrate snapshots each sandbox it moves under the sandbox's tenant, kept a
  // day: counted, it filled the tenant's snapshot_bytes, and SnapshotSandbox and
  // HibernateSandbox were refused for an operator's action the tenant never asked for.
  const migration = (over: Partial<SnapshotRec> = {}): SnapshotRec =>
    ({ id: 'sn-m', tenantId: 't', state: 'ready', lineageId: 'ln', storedBytes: 1000, labels: { 'forkfleet.io/purpose': 'migration' }, pinned: false, retentionTtlMs: MIGRATION_SNAPSHOT_TTL_MS, keepLast: 0, vmConfig: { memoryMib: 128 }, ...over }) as unknown as SnapshotRec;

  it('usageOf_leavesOutTheSnapshotsADrainTookToMoveSandboxes_untilTheTenantKeepsOneAsItsOwn', () => {
    expect(usageOf([], [migration(), sn('ready', 10)]).snapshotBytes).toBe(10);
    // Pinned, or given a longer TTL, by its tenant: the tenant's snapshot now.
    expect(usageOf([], [migration({ pinned: true })]).snapshotBytes).toBe(1000);
    expect(usageOf([], [migration({ retentionTtlMs: null })]).snapshotBytes).toBe(1000);
    expect(usageOf([], [migration({ retentionTtlMs: 30 * 24 * 3_600_000 })]).snapshotBytes).toBe(1000);
    // Another purpose (a fork's snapshot of a live sandbox, which its tenant asked for) counts.
    expect(usageOf([], [migration({ labels: { 'forkfleet.io/purpose': 'fork' } })]).snapshotBytes).toBe(1000);
  });

  it('snapshotSandbox_ofATenantWhoseOnlyStoredBytesAreADrainsMigrationSnapshot_isAdmitted', async () => {
    const live = { id: 'sb-live', tenantId: 't', state: 'running', lineageId: 'ln', resources: { vcpus: 1, memoryMib: 128, diskMib: 0 }, opId: '' } as unknown as SandboxRec;
    const input = { tenantId: 't', idempotencyKey: 'k', sandboxId: 'sb-live', pin: false, keepLast: 0, retentionTtlMs: null, labels: {} };
    const drained = fleetOverOne(() => live, migration());
    await expect(drained.fleet.snapshotSandbox(input)).resolves.toMatchObject({ kind: 'snapshot' });
    const kept = fleetOverOne(() => live, migration({ pinned: true }));
    await expect(kept.fleet.snapshotSandbox(input)).rejects.toMatchObject({ kind: 'resource_exhausted', field: 'quotas.snapshot_bytes' });
  });

  it('theLedger_countsADrainsMigrationSnapshotOnlyOnceItsTenantPinsIt_andNoLongerOnceDeleted', async () => {
    let onChange: ((c: FollowedRecord) => void) | undefined;
    let rev = 10;
    const store = {
      followRecords: async (change: (c: FollowedRecord) => void, onRevision: (r: number) => void) => {
        onChange = (c) => (change(c), onRevision(++rev));
        change({ kind: 'snapshot', key: 't/sn-m', value: migration() });
        onRevision(rev);
        return () => undefined;
      },
      revision: async () => rev,
    };
    const ledger = new QuotaLedger({ store });
    const bytes = async (): Promise<number | undefined> => (await ledger.usage('t'))?.snapshotBytes;
    expect(await bytes()).toBe(0);
    onChange!({ kind: 'snapshot', key: 't/sn-m', value: migration({ pinned: true }) });
    expect(await bytes()).toBe(1000);
    onChange!({ kind: 'snapshot', key: 't/sn-m', value: migration({ state: 'deleted' }) });
    expect(await bytes()).toBe(0);
  });

  it('checkQuota_overSandboxCount_isResourceExhaustedNamingQuotaAndNumbers', () => {
    const e = err(() => checkQuota('acme', { sandboxes: 5 }, { sandboxes: 4, memoryMib: 0, snapshotBytes: 0 }, { sandboxes: 2 }));
    expect(e).toMatchObject({ kind: 'resource_exhausted', field: 'quotas.sandboxes', retryable: false });
    expect(e?.message).toContain('4');
    expect(e?.message).toContain('+ 2');
    expect(e?.message).toContain('> 5');
    expect(err(() => checkQuota('acme', { sandboxes: 5 }, { sandboxes: 4, memoryMib: 0, snapshotBytes: 0 }, { sandboxes: 1 }))).toBeUndefined();
  });

  it('checkQuota_forkTimesMemoryOverQuota_isRefused', () => {
    const e = err(() => checkQuota('acme', { memoryMib: 1024 }, { sandboxes: 1, memoryMib: 256, snapshotBytes: 0 }, { sandboxes: 4, memoryMib: 4 * 256 }));
    expect(e).toMatchObject({ kind: 'resource_exhausted', field: 'quotas.memory_mib' });
    expect(e?.message).toMatch(/256 MiB in use \+ 1024 MiB asked > 1024 MiB/);
  });

  it('checkQuota_snapshotWhileStoredBytesAtQuota_isRefused_andUnderQuotaIsAdmitted', () => {
    expect(err(() => checkQuota('acme', { snapshotBytes: 1000 }, { sandboxes: 0, memoryMib: 0, snapshotBytes: 1000 }, { snapshot: true }))).toMatchObject({ field: 'quotas.snapshot_bytes' });
    expect(err(() => checkQuota('acme', { snapshotBytes: 1000 }, { sandboxes: 0, memoryMib: 0, snapshotBytes: 999 }, { snapshot: true }))).toBeUndefined();
    expect(err(() => checkQuota('acme', { snapshotBytes: 0 }, { sandboxes: 9, memoryMib: 9, snapshotBytes: 0 }, { sandboxes: 1, memoryMib: 1 }))).toBeUndefined();
  });

  it('createSandbox_refusedByQuotaAfterItsFirstAttemptCommitted_returnsThatAttemptsOperation', async () => {
    // A client's retry looked its key up before its first attempt committed; by the time it
    // is admitted, the first attempt's sandbox counts against the quota.
    const first = { id: 'op-first', tenantId: 't', kind: 'create', targetId: 'sb-first', state: 'running' } as unknown as OperationRec;
    let lookups = 0;
    const running = { id: 'sb-first', tenantId: 't', state: 'starting', resources: { vcpus: 1, memoryMib: 256, diskMib: 0 } } as unknown as SandboxRec;
    const store = {
      getIdempotent: async () => (lookups++ === 0 ? undefined : first.id),
      getOp: async () => ({ value: first, modRevision: 5 }),
      listSandboxes: async () => [{ value: running, modRevision: 4 }],
      listSnapshots: async () => [],
      listOps: async () => [{ value: first, modRevision: 5 }],
    } as unknown as FleetStore;
    const fleet = new Fleet({ store, bus: {} as never, clock: { now: () => Date.now() }, heard: new HeartbeatRegistry(), liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 }, quotas: () => ({ sandboxes: 1 }) });
    const input = { tenantId: 't', idempotencyKey: 'k1', image: 'tiny', snapshotId: '', resources: { vcpus: 1, memoryMib: 256, diskMib: 0 }, labels: {}, ttlMs: null, idleTimeoutMs: null, afterResume: [], allowEgress: false, allowCidrs: [], placement: {}, hostname: '' };
    await expect(fleet.createSandbox(input as never)).resolves.toMatchObject({ id: 'op-first' });
    // A different key is refused as before.
    lookups = 0;
    store.getIdempotent = async () => undefined;
    await expect(fleet.createSandbox({ ...input, idempotencyKey: 'k2' } as never)).rejects.toMatchObject({ kind: 'resource_exhausted', field: 'quotas.sandboxes' });
  });

  it('resumeOfAHibernatedSandbox_overTheMemoryQuota_isRefusedNamingIt_andWithinItIsSubmitted', async () => {
    // A hibernated sandbox holds no memory; the tenant started another meanwhile.
    const hib = { id: 'sb-hib', tenantId: 't', state: 'hibernated', resources: { vcpus: 1, memoryMib: 256, diskMib: 0 }, opId: '' } as unknown as SandboxRec;
    const other = { id: 'sb-run', tenantId: 't', state: 'running', resources: { vcpus: 1, memoryMib: 256, diskMib: 0 } } as unknown as SandboxRec;
    let submitted = 0;
    const store = {
      getIdempotent: async () => undefined,
      getSandbox: async () => ({ value: hib, modRevision: 3 }),
      listSandboxes: async () => [hib, other].map((value) => ({ value, modRevision: 3 })),
      listSnapshots: async () => [],
      listOps: async () => [],
      commit: async () => {
        submitted++;
        return true;
      },
    } as unknown as FleetStore;
    const fleetWith = (memoryMib: number): Fleet => new Fleet({ store, bus: {} as never, clock: { now: () => Date.now() }, heard: new HeartbeatRegistry(), liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 }, quotas: () => ({ memoryMib }) });
    await expect(fleetWith(256).resumeSandbox({ tenantId: 't', idempotencyKey: 'k', sandboxId: 'sb-hib' })).rejects.toMatchObject({ kind: 'resource_exhausted', field: 'quotas.memory_mib' });
    expect(submitted).toBe(0);
    await expect(fleetWith(512).resumeSandbox({ tenantId: 't', idempotencyKey: 'k', sandboxId: 'sb-hib' })).resolves.toMatchObject({ kind: 'wake' });
    expect(submitted).toBe(1);
  });

  it('forkOfALiveSandbox_whileSnapshotBytesAreAtQuota_isRefusedNamingIt_andAForkOfAStoredSnapshotIsNot', async () => {
    // A fork of a live sandbox snapshots it first; the tenant's stored snapshots fill the quota.
    const live = { id: 'sb-live', tenantId: 't', state: 'running', lineageId: 'ln', resources: { vcpus: 1, memoryMib: 128, diskMib: 0 }, opId: '' } as unknown as SandboxRec;
    const stored = { id: 'sn-1', tenantId: 't', state: 'ready', lineageId: 'ln', storedBytes: 1000, vmConfig: { memoryMib: 128 } } as unknown as SnapshotRec;
    const { fleet, submitted } = fleetOverOne(() => live, stored);
    const fork = { tenantId: 't', idempotencyKey: 'k', count: 2, labels: {}, placement: undefined } as never;
    await expect(fleet.forkSandbox({ ...(fork as object), sandboxId: 'sb-live', snapshotId: '' } as never)).rejects.toMatchObject({ kind: 'resource_exhausted', field: 'quotas.snapshot_bytes' });
    expect(submitted()).toBe(0);
    await expect(fleet.forkSandbox({ ...(fork as object), sandboxId: '', snapshotId: 'sn-1' } as never)).resolves.toMatchObject({ kind: 'fork' });
    expect(submitted()).toBe(1);
  });

  it('hibernateOfAHibernatedSandbox_whileSnapshotBytesAreAtQuota_isAdmitted_itOnlyCopiesTheSnapshotItHas', async () => {
    const stored = { id: 'sn-h', tenantId: 't', state: 'ready', lineageId: 'ln', storedBytes: 1000, vmConfig: { memoryMib: 128 } } as unknown as SnapshotRec;
    const sb = (state: SandboxRec['state']) => ({ id: 'sb-h', tenantId: 't', state, lineageId: 'ln', hibernationSnapshotId: 'sn-h', resources: { vcpus: 1, memoryMib: 128, diskMib: 0 }, opId: '' }) as unknown as SandboxRec;
    let current = sb('hibernated');
    const { fleet, submitted } = fleetOverOne(() => current, stored);
    await expect(fleet.hibernateSandbox({ tenantId: 't', idempotencyKey: 'k1', sandboxId: 'sb-h', replicas: 2 } as never)).resolves.toMatchObject({ kind: 'hibernate' });
    expect(submitted()).toBe(1);
    // A running one would take a new snapshot: refused at the quota.
    current = sb('running');
    await expect(fleet.hibernateSandbox({ tenantId: 't', idempotencyKey: 'k2', sandboxId: 'sb-h', replicas: 0 } as never)).rejects.toMatchObject({ kind: 'resource_exhausted', field: 'quotas.snapshot_bytes' });
    expect(submitted()).toBe(1);
  });

  it('concurrentCreatesAndForks_ofOneTenant_admitOnlyWhatFitsTheQuota_notEachOnTheSameUsage', async () => {
    // Ten creates and two forks of 2 at once, quota 5 sandboxes: each check must count what
    // the ones before it recorded. (Every call used to read the same usage and pass.)
    const sandboxes: SandboxRec[] = [];
    const ops: OperationRec[] = [];
    const source = { id: 'sn-1', tenantId: 't', state: 'ready', lineageId: 'ln', storedBytes: 0, vmConfig: { memoryMib: 128 } } as unknown as SnapshotRec;
    const later = <T>(v: T): Promise<T> => new Promise((r) => setTimeout(() => r(v), 2));
    const store = {
      getIdempotent: async () => undefined,
      getSnapshot: async () => later({ value: source, modRevision: 1 }),
      listSandboxes: async () => later(sandboxes.map((value) => ({ value, modRevision: 1 }))),
      listSnapshots: async () => later([]),
      listOps: async () => later(ops.map((value) => ({ value, modRevision: 1 }))),
      commit: async (writes: Array<{ kind: string; value: unknown }>) => {
        await later(undefined);
        for (const w of writes) {
          if (w.kind === 'sandbox') sandboxes.push(w.value as SandboxRec);
          if (w.kind === 'op') ops.push(w.value as OperationRec);
        }
        return true;
      },
    } as unknown as FleetStore;
    const fleet = new Fleet({ store, bus: {} as never, clock: { now: () => Date.now() }, heard: new HeartbeatRegistry(), liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 }, quotas: () => ({ sandboxes: 5 }) });
    const create = { tenantId: 't', image: 'tiny', snapshotId: '', resources: { vcpus: 1, memoryMib: 128, diskMib: 0 }, labels: {}, ttlMs: null, idleTimeoutMs: null, afterResume: [], allowEgress: false, allowCidrs: [], placement: {}, hostname: '' };
    const fork = { tenantId: 't', snapshotId: 'sn-1', sandboxId: '', count: 2, labels: {}, placement: undefined };
    const calls = [
      ...Array.from({ length: 10 }, (_, i) => fleet.createSandbox({ ...create, idempotencyKey: `c${i}` } as never)),
      ...Array.from({ length: 2 }, (_, i) => fleet.forkSandbox({ ...fork, idempotencyKey: `f${i}` } as never)),
    ];
    const settled = await Promise.allSettled(calls);
    const admitted = settled.filter((r) => r.status === 'fulfilled').length;
    const refused = settled.filter((r) => r.status === 'rejected').map((r) => (r as PromiseRejectedResult).reason as { field?: string });
    expect(refused.every((e) => e.field === 'quotas.sandboxes')).toBe(true);
    // What was admitted fits: pending creates count 1 each, open forks 2 each.
    const counted = sandboxes.length + ops.filter((o) => o.kind === 'fork').length * 2;
    expect(counted).toBeLessThanOrEqual(5);
    expect(counted).toBeGreaterThanOrEqual(4);
    expect(admitted).toBeGreaterThan(0);
  });
});
