// Named errors of the snapshot store and peer transfer (CONVENTIONS.md §5). Each carries a
// kind (mapped to a gRPC status only at the gRPC edge) and whether a retry may help.
import { ForkfleetError, type ForkfleetErrorOptions } from '../../proto/errors.ts';

/** Received chunk bytes do not hash to the digest they were sent under. Fetch elsewhere. */
export class DigestMismatchError extends ForkfleetError {
  readonly digest: string;
  constructor(digest: string, detail: string, options: ForkfleetErrorOptions = {}) {
    super('internal', `chunk ${digest.slice(0, 16)}: ${detail}`, { retryable: true, ...options });
    this.digest = digest;
  }
}

/** A stored chunk failed verification on read (torn write, disk corruption). It was quarantined. */
export class ChunkCorruptError extends ForkfleetError {
  readonly digests: readonly string[];
  constructor(digests: readonly string[], options: ForkfleetErrorOptions = {}) {
    super('unavailable', `${digests.length} stored chunk(s) failed verification and were removed; fetch them again`, { retryable: true, ...options });
    this.digests = digests;
  }
}

export class ChunkMissingError extends ForkfleetError {
  readonly digests: readonly string[];
  constructor(digests: readonly string[], options: ForkfleetErrorOptions = {}) {
    super('not_found', `${digests.length} chunk(s) missing from the store (first ${digests[0]?.slice(0, 16) ?? '-'})`, { retryable: true, ...options });
    this.digests = digests;
  }
}

/**
 * Chunks a manifest about to be stored names were lost to a failed fsync here (removed, never
 * fsynced again): retryable, a retry writes them anew.
 */
export class ChunkLostError extends ForkfleetError {
  readonly digests: readonly string[];
  constructor(digests: readonly string[], options: ForkfleetErrorOptions = {}) {
    super('unavailable', `${digests.length} chunk(s) were lost to a failed fsync on this host (first ${digests[0]?.slice(0, 16) ?? '-'}); a retry writes them again`, { retryable: true, ...options });
    this.digests = digests;
  }
}

/**
 * No source could deliver these chunks (all failed, lacked them or sent corrupt data). With
 * field `fetch.sources` when the sources failed it, not this host (fetchChunks: a source
 * answered and could not deliver, and no write here failed): the scheduler does not place the
 * sandboxes on another host for it (executor.ts startFailedOnHost).
 */
export class ChunksUnavailableError extends ForkfleetError {
  readonly digests: readonly string[];
  constructor(digests: readonly string[], detail: string, options: ForkfleetErrorOptions = {}) {
    super('unavailable', `${digests.length} chunk(s) unavailable from every source: ${detail}`, { retryable: true, ...options });
    this.digests = digests;
  }
}

/** Ticket missing, badly signed, expired, or for another snapshot or destination. */
export class TicketInvalidError extends ForkfleetError {
  constructor(reason: string, options: ForkfleetErrorOptions = {}) {
    super('permission_denied', `transfer ticket rejected: ${reason}`, { retryable: false, ...options });
  }
}

/** A manifest's signature does not verify, or it is not the snapshot that was asked for. */
export class ManifestInvalidError extends ForkfleetError {
  constructor(reason: string, options: ForkfleetErrorOptions = {}) {
    super('permission_denied', `manifest rejected: ${reason}`, { retryable: false, ...options });
  }
}

export class ManifestNotFoundError extends ForkfleetError {
  constructor(snapshotId: string) {
    super('not_found', `no manifest for snapshot ${snapshotId}`);
  }
}

/** A snapshot cannot be deleted while a VM maps its image or a transfer is reading it. */
export class SnapshotLeasedError extends ForkfleetError {
  constructor(snapshotId: string, holders: readonly string[]) {
    super('failed_precondition', `snapshot ${snapshotId} is leased by ${holders.join(', ')}`);
  }
}
