import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { HeartbeatSchema } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { fleetViewInput, HeartbeatRegistry } from './fleet-view.ts';
import type { HostRec } from './records.ts';

const host = (id: string): HostRec => ({
  id, state: 'ready', cordoned: false, draining: false, capacity: { vcpus: 8, memoryMib: 8192, diskMib: 100_000 }, accel: 'tcg', qemuVersion: '7.2.0',
  cpuModel: 'max', machine: 'microvm', peerAddress: '', linkBytesPerSecond: 1.25e9, labels: {}, registeredAt: 0, lastHeartbeatAt: 0, bootId: 'b',
});

function input(ownInflight?: Map<string, number>) {
  const heard = new HeartbeatRegistry();
  heard.record(create(HeartbeatSchema, { hostId: 'measured', bootId: 'b', inflightOps: 2, restoreSlots: 4, restoreCostMs: 320 }), 1_000);
  heard.record(create(HeartbeatSchema, { hostId: 'new', bootId: 'b', inflightOps: 0, restoreSlots: 4, restoreCostMs: 0 }), 1_000);
  return fleetViewInput({
    hosts: [host('measured'), host('new')], allocs: new Map(), heard, snapshots: [], revision: 1, now: 1_000,
    liveness: { suspectAfterMs: 5_000, lostAfterMs: 15_000 }, chunkBytes: 262_144, ...(ownInflight ? { ownInflight } : {}),
  }).hosts;
}

describe('fleetViewInput', () => {
  it('hosts_thatReportRestoreCostAndSlots_carryThemAndOthersFallBackToTheDefaults', () => {
    const [measured, fresh] = input();
    expect(measured).toMatchObject({ restoreCostMs: 320, restoreSlots: 4, inflightOps: 2 });
    // No restore measured yet: placement uses its configured defaults for this host.
    expect(fresh?.restoreCostMs).toBeUndefined();
    expect(fresh?.restoreSlots).toBeUndefined();
  });

  it('inflightOps_isTheLargerOfTheHeartbeatsAndTheLeadersOwnStepsInFlight', () => {
    const [measured, fresh] = input(new Map([['measured', 1], ['new', 3]]));
    expect(measured?.inflightOps).toBe(2); // the heartbeat already counts the leader's step
    expect(fresh?.inflightOps).toBe(3); // sent since the host's last heartbeat
  });
});
