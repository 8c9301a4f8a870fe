// CancelOperation of a kind with no safe points (not create, fork or drain): refused, and the
// refusal says what holds for such an operation, several host steps as many are.
import { describe, expect, it } from 'vitest';
import { Fleet } from './fleet.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import type { FleetStore } from './ports.ts';
import type { OperationRec } from './records.ts';

function fleetWith(op: Partial<OperationRec>): Fleet {
  const store = { getOp: async () => ({ value: { id: 'op-1', tenantId: 't', state: 'running', ...op }, modRevision: 3 }) } as unknown as FleetStore;
  return new Fleet({ store, bus: {} as never, clock: { now: () => 1_000 }, heard: new HeartbeatRegistry(), liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 } });
}

describe('CancelOperation of a kind that cannot be cancelled', () => {
  it('ofARunningHibernate_isFailedPrecondition_namingTheKindsThatCanBe_notCallingItOneHostStep', async () => {
    // A hibernate pauses, snapshots and stops the VM, and may copy replicas: not one host step.
    const e = await fleetWith({ kind: 'hibernate' })
      .cancelOperation('t', 'op-1')
      .then(
        () => undefined,
        (err: unknown) => err as { kind: string; field?: string; message: string },
      );
    expect([e?.kind, e?.field]).toEqual(['failed_precondition', 'operation_id']);
    expect(e?.message).toBe('a hibernate operation cannot be cancelled (only create, fork and drain can): it ends on its own, each of its host steps bounded by the step timeout and attempts');
  });
});
