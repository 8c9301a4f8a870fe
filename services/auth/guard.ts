// The API edge's admission of a call, before any handler runs: resolve the credential to a
// principal (UNAUTHENTICATED otherwise), then the tenant's token-bucket rate limit and the
// credential's cap on concurrent streaming calls (RESOURCE_EXHAUSTED, retryable). Also the
// tenancy rules handlers apply to a request's `tenant_id`.
import type { Authenticator, Principal } from './tokens.ts';
import { ConcurrencyLimiter, RateLimiter } from './limits.ts';
import { PermissionDeniedError, RateLimitedError, TooManyStreamsError, UnauthenticatedError } from './errors.ts';

/** The part of grpc-js Metadata the guard reads. */
export interface HeaderSource {
  get(key: string): Array<string | Buffer>;
}

export interface ApiGuardOptions {
  /** Concurrent streaming calls (Exec, ReadFile, WriteFile, WatchEvents) per credential. */
  maxStreamsPerCredential: number;
  now?: () => number;
}

export class ApiGuard {
  private readonly rate: RateLimiter;
  private readonly streams: ConcurrencyLimiter;
  private readonly now: () => number;

  constructor(readonly auth: Authenticator, opts: ApiGuardOptions) {
    this.rate = new RateLimiter((tenant) => auth.rateOf(tenant));
    this.streams = new ConcurrencyLimiter(opts.maxStreamsPerCredential);
    this.now = opts.now ?? Date.now;
  }

  admit(call: { metadata: HeaderSource; streaming: boolean }): { principal: Principal; release?: () => void } {
    const values = call.metadata.get('authorization');
    if (values.length > 1) throw new UnauthenticatedError('more than one authorization header');
    const header = values[0];
    const principal = this.auth.authenticate(typeof header === 'string' ? header : undefined);
    const wait = this.rate.take(principal.tenantId, this.now());
    if (wait > 0) {
      const spec = this.auth.rateOf(principal.tenantId)!;
      throw new RateLimitedError(principal.tenantId, spec.perSecond, spec.burst, wait);
    }
    if (!call.streaming) return { principal };
    const release = this.streams.acquire(principal.credentialId);
    if (!release) throw new TooManyStreamsError(this.streams.max);
    return { principal, release };
  }
}

/**
 * The tenant a request acts for. Empty `requested` means the credential's tenant; another
 * tenant than the credential's is PERMISSION_DENIED naming the field, except for admin
 * credentials, which may act for any tenant. `requested` must already be a valid tenant id
 * when not empty.
 */
export function tenantFor(principal: Principal, requested: string, field = 'tenant_id'): string {
  if (requested === '' || requested === principal.tenantId) return principal.tenantId;
  if (principal.admin) return requested;
  throw new PermissionDeniedError(`${field}: this credential acts for tenant ${principal.tenantId} only; omit ${field} or set it to ${principal.tenantId}`, field);
}

/** Fleet operations (hosts, cordon, drain) need an admin credential. */
export function requireAdmin(principal: Principal, what: string): void {
  if (!principal.admin) throw new PermissionDeniedError(`${what} needs an admin credential`);
}
