import { describe, expect, it } from 'vitest';
import { admit, checkQuota, usageOf } from './quota.ts';
import type { OperationRec, SandboxRec, SnapshotRec } from './records.ts';
import type { FleetStore } from './ports.ts';

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

  it('usageOf_countsLiveSandboxes_memoryOnlyOfThoseHoldingCapacity_andStoredSnapshotBytes', () => {
    const u = usageOf(
      [sb('running', 256), sb('pending', 128), sb('hibernated', 512), sb('destroyed', 1024), sb('failed', 64), sb('lost', 64), sb('paused', 100)],
      [sn('ready', 1000), sn('creating', 10), sn('deleted', 5000), sn('failed', 7)],
    );
    expect(u).toEqual({ sandboxes: 4, memoryMib: 484, snapshotBytes: 1010 });
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
});
