// Ed25519 tickets and manifest signatures. The scheduler holds the private key and signs;
// host agents hold only public keys (by key id) and verify. Signatures cover the exact
// serialized bytes, so a verifier never re-serializes before checking.
import { generateKeyPairSync, sign, verify, randomUUID } from 'node:crypto';
import type { KeyObject } from 'node:crypto';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import { timestampDate, timestampFromDate } from '@bufbuild/protobuf/wkt';
import { SignedTicketSchema, TransferTicketSchema } from '../../proto/gen/forkfleet/v1/transfer_pb.ts';
import type { SignedTicket } from '../../proto/gen/forkfleet/v1/transfer_pb.ts';
import { SignedManifestSchema, SnapshotManifestSchema } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import type { SignedManifest, SnapshotManifest } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { ManifestInvalidError, TicketInvalidError } from './transfer-errors.ts';

/** Public keys a host trusts, by key id. */
export type TrustedKeys = ReadonlyMap<string, KeyObject>;

export interface SigningKey {
  readonly keyId: string;
  readonly privateKey: KeyObject;
}

export interface TicketClaims {
  readonly ticketId: string;
  readonly snapshotId: string;
  readonly destinationHostId: string;
  readonly expiresAt: Date;
  /** The destination may restore by migration (MigrateSnapshot), not only fetch chunks. */
  readonly allowMigration: boolean;
}

export function generateSigningKey(keyId: string): { signing: SigningKey; trusted: TrustedKeys } {
  const { privateKey, publicKey } = generateKeyPairSync('ed25519');
  return { signing: { keyId, privateKey }, trusted: new Map([[keyId, publicKey]]) };
}

export function signTicket(claims: Omit<TicketClaims, 'ticketId' | 'allowMigration'> & { ticketId?: string; allowMigration?: boolean }, key: SigningKey): SignedTicket {
  const ticket = toBinary(
    TransferTicketSchema,
    create(TransferTicketSchema, {
      snapshotId: claims.snapshotId,
      destinationHostId: claims.destinationHostId,
      expiresAt: timestampFromDate(claims.expiresAt),
      ticketId: claims.ticketId ?? randomUUID(),
      allowMigration: claims.allowMigration ?? false,
    }),
  );
  return create(SignedTicketSchema, { ticket, signature: sign(null, ticket, key.privateKey), keyId: key.keyId });
}

function checkSignature(data: Uint8Array, signature: Uint8Array, keyId: string, trust: TrustedKeys): string | undefined {
  const pub = trust.get(keyId);
  if (!pub) return `unknown key id ${JSON.stringify(keyId)}`;
  if (signature.length !== 64) return 'bad signature length';
  try {
    return verify(null, data, pub, signature) ? undefined : 'bad signature';
  } catch (e) {
    return `signature check failed: ${(e as Error).message}`;
  }
}

export interface TicketExpectation {
  readonly now: Date;
  /** The host presenting the ticket; must equal the ticket's destination. */
  readonly destinationHostId: string;
  /** When set, the ticket must be for this snapshot. */
  readonly snapshotId?: string;
}

/** Verifies signature, expiry, destination and (optionally) snapshot. Throws TicketInvalidError. */
export function verifyTicket(signed: SignedTicket | undefined, trust: TrustedKeys, expect: TicketExpectation): TicketClaims {
  if (!signed || signed.ticket.length === 0) throw new TicketInvalidError('no ticket');
  const bad = checkSignature(signed.ticket, signed.signature, signed.keyId, trust);
  if (bad) throw new TicketInvalidError(bad);
  let t;
  try {
    t = fromBinary(TransferTicketSchema, signed.ticket);
  } catch (e) {
    throw new TicketInvalidError('undecodable ticket', { cause: e });
  }
  // The same key signs manifests, whose bytes may decode as a ticket: one carrying fields no
  // ticket has (a manifest's VM config, chunk size) is no ticket the scheduler issued.
  if ((t.$unknown?.length ?? 0) > 0) throw new TicketInvalidError('fields no ticket has');
  if (!t.expiresAt) throw new TicketInvalidError('no expiry');
  const expiresAt = timestampDate(t.expiresAt);
  assertTicketLive({ expiresAt }, expect.now);
  if (t.destinationHostId !== expect.destinationHostId) {
    throw new TicketInvalidError(`issued for host ${JSON.stringify(t.destinationHostId)}, presented by ${JSON.stringify(expect.destinationHostId)}`);
  }
  if (expect.snapshotId !== undefined && t.snapshotId !== expect.snapshotId) {
    throw new TicketInvalidError(`issued for snapshot ${JSON.stringify(t.snapshotId)}, not ${JSON.stringify(expect.snapshotId)}`);
  }
  return { ticketId: t.ticketId, snapshotId: t.snapshotId, destinationHostId: t.destinationHostId, expiresAt, allowMigration: t.allowMigration };
}

/**
 * Throws TicketInvalidError once the ticket has expired at `now`. verifyTicket checks it when a
 * call opens; a stream that outlives its ticket checks it again on each request it serves.
 */
export function assertTicketLive(claims: Pick<TicketClaims, 'expiresAt'>, now: Date): void {
  if (claims.expiresAt.getTime() <= now.getTime()) throw new TicketInvalidError(`expired at ${claims.expiresAt.toISOString()}`);
}

export function signManifest(manifest: SnapshotManifest, key: SigningKey): SignedManifest {
  const bytes = toBinary(SnapshotManifestSchema, manifest);
  return create(SignedManifestSchema, { manifest: bytes, signature: sign(null, bytes, key.privateKey), keyId: key.keyId });
}

/** Verifies the signature over the exact bytes, then decodes. Throws ManifestInvalidError. */
export function verifyManifest(signed: SignedManifest | undefined, trust: TrustedKeys, expectSnapshotId?: string): SnapshotManifest {
  if (!signed || signed.manifest.length === 0) throw new ManifestInvalidError('no manifest');
  const bad = checkSignature(signed.manifest, signed.signature, signed.keyId, trust);
  if (bad) throw new ManifestInvalidError(bad);
  let m: SnapshotManifest;
  try {
    m = fromBinary(SnapshotManifestSchema, signed.manifest);
  } catch (e) {
    throw new ManifestInvalidError('undecodable manifest', { cause: e });
  }
  if (expectSnapshotId !== undefined && m.snapshotId !== expectSnapshotId) {
    throw new ManifestInvalidError(`manifest is for ${JSON.stringify(m.snapshotId)}, not ${JSON.stringify(expectSnapshotId)}`);
  }
  // The same key signs tickets, whose bytes may decode as a manifest: a ticket's fields 1-4 are
  // a manifest's snapshot, tenant, parent and source ids when its expiry's bytes happen to be
  // UTF-8 (some expiries from 2029 on). A ticket has no artifacts (field 9), every snapshot
  // has: one without is no manifest an agent signed. (Unknown fields are kept, unlike in
  // verifyTicket: a manifest outlives its agent's version, and a newer agent's may carry more.)
  if (m.snapshotId === '') throw new ManifestInvalidError('no snapshot id');
  if (m.artifacts.length === 0) throw new ManifestInvalidError('no artifacts');
  return m;
}

/** Decodes without verifying: only for local bookkeeping (GC marking) of manifests already verified on the way in. */
export function decodeManifestUnverified(signed: SignedManifest): SnapshotManifest {
  return fromBinary(SnapshotManifestSchema, signed.manifest);
}

export function encodeSignedManifest(m: SignedManifest): Uint8Array {
  return toBinary(SignedManifestSchema, m);
}

export function decodeSignedManifest(b: Uint8Array): SignedManifest {
  return fromBinary(SignedManifestSchema, b);
}

export function encodeSignedTicket(t: SignedTicket): Uint8Array {
  return toBinary(SignedTicketSchema, t);
}

export function decodeSignedTicket(b: Uint8Array): SignedTicket {
  return fromBinary(SignedTicketSchema, b);
}
