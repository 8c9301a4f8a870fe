import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { SnapshotManifestSchema } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { generateSigningKey, signManifest, signTicket, verifyManifest, verifyTicket } from './tickets.ts';
import { ManifestInvalidError, TicketInvalidError } from './transfer-errors.ts';

const now = new Date('2026-01-01T00:00:00Z');
const { signing, trusted } = generateSigningKey('k1');
const valid = signTicket({ snapshotId: 's1', destinationHostId: 'h2', expiresAt: new Date(now.getTime() + 60_000) }, signing);

describe('transfer tickets', () => {
  it('verifyTicket_whenValid_returnsClaims', () => {
    const c = verifyTicket(valid, trusted, { now, destinationHostId: 'h2', snapshotId: 's1' });
    expect(c.snapshotId).toBe('s1');
    expect(c.destinationHostId).toBe('h2');
  });

  it.each([
    ['expired', () => verifyTicket(valid, trusted, { now: new Date(now.getTime() + 61_000), destinationHostId: 'h2' })],
    ['wrong destination', () => verifyTicket(valid, trusted, { now, destinationHostId: 'h3' })],
    ['wrong snapshot', () => verifyTicket(valid, trusted, { now, destinationHostId: 'h2', snapshotId: 's2' })],
    ['unknown key id', () => verifyTicket({ ...valid, keyId: 'k9' }, trusted, { now, destinationHostId: 'h2' })],
    ['missing', () => verifyTicket(undefined, trusted, { now, destinationHostId: 'h2' })],
    ['tampered bytes', () => {
      const t = Uint8Array.from(valid.ticket);
      t[t.length - 1] = (t[t.length - 1] ?? 0) ^ 1;
      return verifyTicket({ ...valid, ticket: t }, trusted, { now, destinationHostId: 'h2' });
    }],
    ['signed by another key', () => {
      const other = generateSigningKey('k1').signing;
      const t = signTicket({ snapshotId: 's1', destinationHostId: 'h2', expiresAt: new Date(now.getTime() + 60_000) }, other);
      return verifyTicket(t, trusted, { now, destinationHostId: 'h2' });
    }],
  ])('verifyTicket_when%s_throwsPermissionDenied', (_what, f) => {
    expect(f).toThrow(TicketInvalidError);
    try {
      f();
    } catch (e) {
      expect((e as TicketInvalidError).kind).toBe('permission_denied');
    }
  });

  it('verifyManifest_whenTampered_refuses', () => {
    const m = create(SnapshotManifestSchema, { snapshotId: 's1', chunkSize: 262144 });
    const signed = signManifest(m, signing);
    expect(verifyManifest(signed, trusted, 's1').snapshotId).toBe('s1');
    const bytes = Uint8Array.from(signed.manifest);
    bytes[bytes.length - 1] = (bytes[bytes.length - 1] ?? 0) ^ 1;
    expect(() => verifyManifest({ ...signed, manifest: bytes }, trusted, 's1')).toThrow(ManifestInvalidError);
    expect(() => verifyManifest(signed, trusted, 's2')).toThrow(ManifestInvalidError);
  });
});
