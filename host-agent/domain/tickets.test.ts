import { describe, expect, it } from 'vitest';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import { ArtifactKind, SignedManifestSchema, SnapshotManifestSchema } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { VmConfigSchema } from '../../proto/gen/forkfleet/v1/common_pb.ts';
import { TransferTicketSchema } from '../../proto/gen/forkfleet/v1/transfer_pb.ts';
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
    ['a signed manifest whose bytes decode as a ticket', () => {
      // The same key signs manifests: a host could send bytes that are a ticket (fields 1-4)
      // plus manifest-only fields (6, 7) as its snapshot's manifest. Signed, they must not pass.
      // An expiry whose Timestamp bytes are valid UTF-8 (as the manifest's parent_snapshot_id, field 3): 2029-07-30.
      const ticket = toBinary(TransferTicketSchema, create(TransferTicketSchema, { snapshotId: 's1', destinationHostId: 'h2', expiresAt: { seconds: 1880129602n, nanos: 0 }, ticketId: 't' }));
      const extra = toBinary(SnapshotManifestSchema, create(SnapshotManifestSchema, { vmConfig: create(VmConfigSchema, { machine: 'microvm', memoryMib: 256n, vcpus: 1 }), chunkSize: 262144 }));
      const bytes = new Uint8Array([...ticket, ...extra]);
      expect(fromBinary(SnapshotManifestSchema, bytes).vmConfig?.memoryMib).toBe(256n); // it is a usable manifest too
      const m = signManifest(fromBinary(SnapshotManifestSchema, bytes), signing);
      return verifyTicket({ $typeName: 'forkfleet.v1.SignedTicket', ticket: bytes, signature: m.signature, keyId: m.keyId }, trusted, { now, destinationHostId: 'h2' });
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
    const m = create(SnapshotManifestSchema, { snapshotId: 's1', chunkSize: 262144, artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', size: 0n }] });
    const signed = signManifest(m, signing);
    expect(verifyManifest(signed, trusted, 's1').snapshotId).toBe('s1');
    const bytes = Uint8Array.from(signed.manifest);
    bytes[bytes.length - 1] = (bytes[bytes.length - 1] ?? 0) ^ 1;
    expect(() => verifyManifest({ ...signed, manifest: bytes }, trusted, 's1')).toThrow(ManifestInvalidError);
    expect(() => verifyManifest(signed, trusted, 's2')).toThrow(ManifestInvalidError);
  });

  it('verifyManifest_ofASignedTicketWhoseBytesDecodeAsAManifest_refuses', () => {
    // The same key signs tickets. An expiry whose Timestamp bytes are valid UTF-8 (2029-07-30)
    // makes a ticket's bytes a manifest for its snapshot (ids in fields 1-4), with no artifacts.
    const t = signTicket({ snapshotId: 's1', destinationHostId: 'h2', expiresAt: new Date(1880129602_000) }, signing);
    expect(fromBinary(SnapshotManifestSchema, t.ticket).snapshotId).toBe('s1'); // it does decode
    const asManifest = create(SignedManifestSchema, { manifest: t.ticket, signature: t.signature, keyId: t.keyId });
    expect(() => verifyManifest(asManifest, trusted, 's1')).toThrow(ManifestInvalidError);
    expect(() => verifyManifest(asManifest, trusted)).toThrow(ManifestInvalidError);
  });

  it('verifyManifest_withoutASnapshotId_refuses_evenWithNoIdExpected', () => {
    const signed = signManifest(create(SnapshotManifestSchema, { chunkSize: 262144, artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', size: 0n }] }), signing);
    expect(() => verifyManifest(signed, trusted)).toThrow(ManifestInvalidError);
  });
});
