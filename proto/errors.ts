// Error kinds are part of the API contract: every named error in the project extends
// ForkfleetError and carries one kind. The gRPC edge (services/adapters/grpc) is the only
// place that maps kinds to status codes (CONVENTIONS.md §5).
//
// Each package keeps its own errors.ts of named subclasses; this file holds only the base.

/** Every error kind, as the API's ErrorInfo.kind and the gRPC status mapping know them. */
export const ERROR_KINDS = [
  'invalid_argument', // bad input; `field` names the offending field
  'not_found',
  'already_exists',
  'failed_precondition', // valid request, wrong state (e.g. exec on a destroyed sandbox)
  'resource_exhausted', // no capacity, quota or rate limit
  'aborted', // optimistic-concurrency conflict; the caller may re-read and retry
  'unavailable', // transient: a peer, host or dependency is down
  'deadline_exceeded',
  'unauthenticated',
  'permission_denied',
  'cancelled',
  'internal',
] as const;

export type ErrorKind = (typeof ERROR_KINDS)[number];

const KINDS: ReadonlySet<string> = new Set(ERROR_KINDS);

/** Whether `kind` (a string off the wire) is one of ERROR_KINDS. */
export function isErrorKind(kind: string): kind is ErrorKind {
  return KINDS.has(kind);
}

export interface ForkfleetErrorOptions {
  cause?: unknown;
  /** Whether repeating the same call may succeed. Defaults by kind (see defaultRetryable). */
  retryable?: boolean;
  /** For invalid_argument: the request field at fault, in proto field-path form ("resources.memory_mib"). */
  field?: string;
}

const RETRYABLE_BY_DEFAULT: ReadonlySet<ErrorKind> = new Set(['aborted', 'unavailable', 'deadline_exceeded', 'resource_exhausted']);

export function defaultRetryable(kind: ErrorKind): boolean {
  return RETRYABLE_BY_DEFAULT.has(kind);
}

export class ForkfleetError extends Error {
  readonly kind: ErrorKind;
  readonly retryable: boolean;
  readonly field: string | undefined;

  constructor(kind: ErrorKind, message: string, options: ForkfleetErrorOptions = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = new.target.name;
    this.kind = kind;
    this.retryable = options.retryable ?? defaultRetryable(kind);
    this.field = options.field;
  }
}

/** Bad input. The message says what is wrong; `field` names where. */
export class InvalidArgumentError extends ForkfleetError {
  constructor(field: string, reason: string, options: Omit<ForkfleetErrorOptions, 'field'> = {}) {
    super('invalid_argument', `${field}: ${reason}`, { ...options, field });
  }
}

export function isForkfleetError(e: unknown): e is ForkfleetError {
  return e instanceof ForkfleetError;
}
