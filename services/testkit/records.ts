// Record fixtures for unit tests: a valid record, with the fields a test cares about set.
import type { SnapshotRec } from '../domain/records.ts';

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
