// The one place where project errors become gRPC statuses and back (CONVENTIONS.md §5).
import { Metadata, status as Status } from '@grpc/grpc-js';
import type { ServiceError } from '@grpc/grpc-js';
import { ForkfleetError, isForkfleetError } from '../../../proto/errors.ts';
import type { ErrorKind } from '../../../proto/errors.ts';

const KIND_TO_STATUS: Readonly<Record<ErrorKind, Status>> = {
  invalid_argument: Status.INVALID_ARGUMENT,
  not_found: Status.NOT_FOUND,
  already_exists: Status.ALREADY_EXISTS,
  failed_precondition: Status.FAILED_PRECONDITION,
  resource_exhausted: Status.RESOURCE_EXHAUSTED,
  aborted: Status.ABORTED,
  unavailable: Status.UNAVAILABLE,
  deadline_exceeded: Status.DEADLINE_EXCEEDED,
  unauthenticated: Status.UNAUTHENTICATED,
  permission_denied: Status.PERMISSION_DENIED,
  cancelled: Status.CANCELLED,
  internal: Status.INTERNAL,
};

const STATUS_TO_KIND = new Map<Status, ErrorKind>(
  (Object.entries(KIND_TO_STATUS) as [ErrorKind, Status][]).map(([k, s]) => [s, k]),
);

/** Trailing metadata keys that carry what a status code alone cannot. */
export const META_KIND = 'ff-error-kind';
export const META_FIELD = 'ff-error-field';
export const META_RETRYABLE = 'ff-error-retryable';
/** Whole ms after which a retry can succeed (a rate limit's RateLimitedError.retryAfterMs). */
export const META_RETRY_AFTER = 'ff-retry-after-ms';

export interface GrpcStatusObject {
  code: Status;
  details: string;
  metadata: Metadata;
}

/**
 * `s` with every character outside printable ASCII as a \\uXXXX escape. gRPC metadata values
 * are printable ASCII, and grpc-js throws while answering a call whose error field (which can
 * quote a client's label or env key) has anything else.
 */
export function asciiOnly(s: string): string {
  return s.replace(/[^\x20-\x7e]/g, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`);
}

/**
 * Converts anything a handler threw into a status. Named errors keep their message, except
 * those of kind `internal` (a host's or the executor's unexpected failure, whose text can
 * carry host paths, guest-agent output or Node errors); they and anything else become
 * INTERNAL with a generic message (the cause is logged by the caller, never sent to clients).
 */
export function toGrpcStatus(err: unknown): GrpcStatusObject {
  const metadata = new Metadata();
  if (isForkfleetError(err)) {
    metadata.set(META_KIND, err.kind);
    metadata.set(META_RETRYABLE, String(err.retryable));
    if (err.field !== undefined) metadata.set(META_FIELD, asciiOnly(err.field));
    // An error that knows when a retry can succeed says so: a client that guesses with its
    // own backoff gives up before a rate limit's bucket has refilled.
    const after = (err as { retryAfterMs?: unknown }).retryAfterMs;
    if (typeof after === 'number' && Number.isFinite(after) && after > 0) metadata.set(META_RETRY_AFTER, String(Math.ceil(after)));
    return { code: KIND_TO_STATUS[err.kind], details: err.kind === 'internal' ? 'internal error' : err.message, metadata };
  }
  metadata.set(META_KIND, 'internal');
  metadata.set(META_RETRYABLE, 'false');
  return { code: Status.INTERNAL, details: 'internal error', metadata };
}

/** Error a client sees for a failed call: a ForkfleetError with the server's kind and field. */
export class RpcError extends ForkfleetError {
  readonly code: Status;
  /**
   * The server answered with this error (it carries Forkfleet's error metadata), as opposed to
   * one grpc-js made because no server could be reached or the call broke off.
   */
  readonly answered: boolean;
  /** How long the server said to wait before a retry (META_RETRY_AFTER), ms; undefined when it said nothing. */
  readonly retryAfterMs: number | undefined;
  constructor(code: Status, kind: ErrorKind, message: string, retryable: boolean, field: string | undefined, cause: unknown, answered = false, retryAfterMs?: number) {
    super(kind, message, { retryable, ...(field === undefined ? {} : { field }), cause });
    this.code = code;
    this.answered = answered;
    this.retryAfterMs = retryAfterMs;
  }
}

function firstString(md: Metadata | undefined, key: string): string | undefined {
  const v = md?.get(key)[0];
  return typeof v === 'string' ? v : undefined;
}

export function fromServiceError(err: ServiceError): RpcError {
  const md = err.metadata;
  const kindFromMeta = firstString(md, META_KIND) as ErrorKind | undefined;
  const kind: ErrorKind =
    kindFromMeta !== undefined && kindFromMeta in KIND_TO_STATUS ? kindFromMeta : (STATUS_TO_KIND.get(err.code) ?? 'internal');
  const retryableMeta = firstString(md, META_RETRYABLE);
  const retryable = retryableMeta === undefined ? kind === 'unavailable' || kind === 'aborted' : retryableMeta === 'true';
  const after = Number(firstString(md, META_RETRY_AFTER) ?? Number.NaN);
  return new RpcError(err.code, kind, err.details || err.message, retryable, firstString(md, META_FIELD), err, kindFromMeta !== undefined, Number.isFinite(after) && after >= 0 ? after : undefined);
}
