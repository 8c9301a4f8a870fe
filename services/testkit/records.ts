// Record fixtures for unit tests: a valid record, with the fields a test cares about set.
import type { SandboxRec, SnapshotRec } from '../domain/records.ts';

/** A ready snapshot of sandbox sb-a on host h1 (tenant t1), no retention, with `over` applied. */
export function snapshotRecord(over: Partial<SnapshotRec> = {}): SnapshotRec {
  return {
    id: 'sn-a',
    tenantId: 't1',
    state: 'ready',
    sourceSandboxId: 'sb-a',
    parentSnapshotId: '',
    lineageId: 'sb-a',
    createdAt: 0,
    pinned: false,
    retentionTtlMs: null,
    keepLast: 0,
    logicalBytes: 0,
    storedBytes: 0,
    hostIds: ['h1'],
    vmConfig: null,
    labels: {},
    manifestSignature: '',
    manifestKeyId: '',
    ...over,
  };
}

/** A running sandbox sb-a on host h1 (tenant t1), with `over` applied. */
export function sandboxRecord(over: Partial<SandboxRec> = {}): SandboxRec {
  return {
    id: 'sb-a',
    tenantId: 't1',
    state: 'running',
    stateReason: '',
    hostId: 'h1',
    resources: { vcpus: 1, memoryMib: 256, diskMib: 1024 },
    image: 'tiny',
    sourceSnapshotId: '',
    lineageId: 'sb-a',
    hostname: 'sb-a',
    labels: {},
    ttlMs: null,
    idleTimeoutMs: null,
    allowEgress: false,
    createdAt: 0,
    updatedAt: 0,
    runningMsBefore: 0,
    runningSince: 0,
    hibernationSnapshotId: '',
    opId: '',
    ...over,
  };
}
