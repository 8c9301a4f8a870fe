import { describe, expect, it } from 'vitest';
import { timestampMs } from '@bufbuild/protobuf/wkt';
import { toSnapshot } from './convert.ts';
import type { SnapshotRec } from '../../domain/records.ts';

const base: SnapshotRec = {
  id: 'sn-a',
  tenantId: 't',
  state: 'ready',
  sourceSandboxId: 'sb-a',
  parentSnapshotId: '',
  lineageId: 'sb-a',
  createdAt: 1_000_000,
  pinned: false,
  retentionTtlMs: null,
  keepLast: 1,
  logicalBytes: 0,
  storedBytes: 0,
  hostIds: ['h1'],
  vmConfig: null,
  labels: {},
  manifestSignature: '',
  manifestKeyId: '',
};

describe('toSnapshot expires_at', () => {
  it('keepLastExpiryAnnounced_isTheAnnouncedTime', () => {
    const sn = toSnapshot({ ...base, expiryDueAt: 2_000_000 });
    expect(sn.expiresAt && timestampMs(sn.expiresAt)).toBe(2_000_000);
  });

  it('ttlOnly_isCreatedPlusTtl_andNoRetention_isUnset', () => {
    const withTtl = toSnapshot({ ...base, keepLast: 0, retentionTtlMs: 60_000 });
    expect(withTtl.expiresAt && timestampMs(withTtl.expiresAt)).toBe(1_060_000);
    expect(toSnapshot({ ...base, keepLast: 0 }).expiresAt).toBeUndefined();
    expect(toSnapshot({ ...base, expiryDueAt: null }).expiresAt).toBeUndefined();
  });
});
