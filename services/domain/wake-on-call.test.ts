// What Exec, ReadFile and WriteFile answer when the sandbox they name is hibernated (or being
// hibernated) and the wake they start for it does not succeed.
import { describe, expect, it } from 'vitest';
import type { OperationError, OperationRec, SandboxRec } from './records.ts';
import type { FleetStore } from './ports.ts';
import { Fleet } from './fleet.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import { sandboxRecord } from '../testkit/records.ts';

/** A Fleet over one sandbox (as `sandbox()` is now), whose operations all read as `op()`; `submitted()`: wakes started. */
function fleetOver(sandbox: () => SandboxRec, op: () => Partial<OperationRec>, now: () => number = () => Date.now()): { fleet: Fleet; submitted: () => number } {
  let n = 0;
  const store = {
    getIdempotent: async () => undefined,
    getSandbox: async () => ({ value: sandbox(), modRevision: 3 }),
    listSandboxes: async () => [{ value: sandbox(), modRevision: 3 }],
    listSnapshots: async () => [],
    listOps: async () => [],
    getOp: async (tenantId: string, id: string) => ({ value: { id, tenantId, kind: 'wake', error: null, ...op() }, modRevision: 4 }),
    watchOps: async () => () => undefined,
    commit: async () => {
      n++;
      return true;
    },
  } as unknown as FleetStore;
  const fleet = new Fleet({ store, bus: {} as never, clock: { now }, heard: new HeartbeatRegistry(), liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 } });
  return { fleet, submitted: () => n };
}

const hibernated = (): SandboxRec => sandboxRecord({ state: 'hibernated', hostId: '', opId: '', updatedAt: 5 });
const failedWith = (error: OperationError) => (): Partial<OperationRec> => ({ state: 'failed', error });
const read = (f: Fleet): Promise<unknown> => f.readFile('t1', 'sb-a', '/etc/hostname', 1024);

describe('a call on a hibernated sandbox whose wake does not succeed', () => {
  it('answers_theWakesOwnKindAndRetryability_namingTheSandbox_soAWakeThatCanNeverSucceedIsNotRetried', async () => {
    // The hibernation snapshot is gone: a retry would start one more wake that fails the same way.
    const gone = fleetOver(hibernated, failedWith({ kind: 'not_found', message: 'snapshot sn-x not found', retryable: false, field: 'snapshot_id' }));
    await expect(read(gone.fleet)).rejects.toMatchObject({ kind: 'not_found', retryable: false, field: 'sandbox_id', message: expect.stringMatching(/^waking sandbox sb-a failed: snapshot sn-x not found/) });
    expect(gone.submitted()).toBe(1);
    // No host with room now: retryable, as the wake said.
    const full = fleetOver(hibernated, failedWith({ kind: 'resource_exhausted', message: 'no host has room', retryable: true }));
    await expect(read(full.fleet)).rejects.toMatchObject({ kind: 'resource_exhausted', retryable: true });
    // WriteFile names its header's field.
    await expect(full.fleet.writeFile('t1', 'sb-a', '/tmp/x', 0o644, new Uint8Array(1))).rejects.toMatchObject({ field: 'header.sandbox_id' });
  });

  it('neverRelays_anAuthenticationKindFromTheWake_asTheCallersOwn', async () => {
    const f = fleetOver(hibernated, failedWith({ kind: 'permission_denied', message: 'host refused', retryable: false }));
    await expect(read(f.fleet)).rejects.toMatchObject({ kind: 'internal', retryable: false });
  });

  it('isUnavailableAndRetryable_whenTheWakeWasCancelled_orStillRuns_orTheSandboxIsStillBeingHibernated', async () => {
    await expect(read(fleetOver(hibernated, () => ({ state: 'cancelled' })).fleet)).rejects.toMatchObject({ kind: 'unavailable', retryable: true });
    // A clock that moves 301 s per reading: the wait for the wake gives up at once.
    let t = 0;
    const slow = fleetOver(hibernated, () => ({ state: 'running' }), () => (t += 301_000));
    await expect(read(slow.fleet)).rejects.toMatchObject({ kind: 'unavailable', retryable: true, message: expect.stringMatching(/takes longer than expected/) });
    // Still hibernating once the wait for its hibernate ended: it will be hibernated, then woken.
    const hibernating = fleetOver(() => sandboxRecord({ state: 'hibernating', opId: 'op-h' }), () => ({ state: 'succeeded' }));
    await expect(read(hibernating.fleet)).rejects.toMatchObject({ kind: 'unavailable', retryable: true, message: expect.stringMatching(/still being hibernated/) });
    expect(hibernating.submitted()).toBe(0);
  });
});
