// SetSnapshotRetention and PinSnapshot against a snapshot's state: the Fleet over a stub store of
// our own holding one snapshot record (and taking every guarded write).
import { describe, expect, it } from 'vitest';
import { Fleet } from './fleet.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import type { FleetStore, StoreWrite } from './ports.ts';
import type { SnapshotRec } from './records.ts';
import { snapshotRecord } from '../testkit/records.ts';

function fleetOver(sn: SnapshotRec): { fleet: Fleet; writes: StoreWrite[] } {
  const writes: StoreWrite[] = [];
  const store = {
    getSnapshot: async () => ({ value: sn, modRevision: 2 }),
    commit: async (w: StoreWrite[]) => {
      writes.push(...w);
      return true;
    },
  } as unknown as FleetStore;
  return { fleet: new Fleet({ store, bus: {} as never, clock: { now: () => 1_000 }, heard: new HeartbeatRegistry(), liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 } }), writes };
}

describe('snapshot rules', () => {
  it('setRetention_onASnapshotBeingDeleted_isFailedPreconditionNamingSnapshotId_andWritesNothing', async () => {
    const { fleet, writes } = fleetOver(snapshotRecord({ id: 'sn-a', tenantId: 't1', state: 'deleting' }));
    await expect(fleet.setRetention('t1', 'sn-a', 60_000, 3)).rejects.toMatchObject({ kind: 'failed_precondition', field: 'snapshot_id' });
    expect(writes).toEqual([]);
  });

  it('setRetention_onAReadySnapshot_recordsTheRule', async () => {
    const { fleet, writes } = fleetOver(snapshotRecord({ id: 'sn-a', tenantId: 't1', state: 'ready' }));
    await fleet.setRetention('t1', 'sn-a', 60_000, 3);
    expect(writes).toEqual([expect.objectContaining({ kind: 'snapshot', value: expect.objectContaining({ retentionTtlMs: 60_000, keepLast: 3 }) })]);
  });
});
