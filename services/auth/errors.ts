// Named errors of the API's authentication, authorisation and admission limits. The gRPC
// edge maps their kinds to UNAUTHENTICATED, PERMISSION_DENIED and RESOURCE_EXHAUSTED.
import { ForkfleetError } from '../../proto/errors.ts';

/** No credential, or one the server does not know. Never says which. */
export class UnauthenticatedError extends ForkfleetError {
  constructor(reason: string) {
    super('unauthenticated', `${reason}; send "authorization: Bearer <token>" over TLS`, { retryable: false });
  }
}

/** A known credential asked for something it may not do. `field` names the request field at fault, if one is. */
export class PermissionDeniedError extends ForkfleetError {
  constructor(message: string, field?: string) {
    super('permission_denied', message, { retryable: false, ...(field === undefined ? {} : { field }) });
  }
}

/** The tenant's request rate is over its token bucket; retrying after `retryAfterMs` succeeds. */
export class RateLimitedError extends ForkfleetError {
  readonly retryAfterMs: number;
  constructor(tenantId: string, perSecond: number, burst: number, retryAfterMs: number) {
    super('resource_exhausted', `rate limit of tenant ${tenantId}: ${perSecond} requests/s (burst ${burst}); retry in ${retryAfterMs} ms`, { retryable: true, field: 'rate' });
    this.retryAfterMs = retryAfterMs;
  }
}

/** The credential already has its maximum of streaming calls open. Retryable once one ends. */
export class TooManyStreamsError extends ForkfleetError {
  constructor(max: number, what = 'streaming calls') {
    super('resource_exhausted', `at most ${max} concurrent ${what} per credential; close one first`, { retryable: true, field: 'streams' });
  }
}
