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
  /** Concurrent streaming calls (Exec, ReadFile, WriteFile, WatchEvents) per credential; long polls (WaitOperation) are capped at as many, counted apart. */
  maxStreamsPerCredential: number;
  /**
   * WatchEvents streams per tenant credential, within the streams above (default 16; admin
   * credentials are not capped). Each reads every change in the fleet before its filter:
   * hundreds open would make every write cost the replica hundreds of decodes.
   */
  maxWatchesPerCredential?: number;
  now?: () => number;
}

/** Streaming calls that read every change in the fleet, capped apart (maxWatchesPerCredential). */
const WATCHES: ReadonlySet<string> = new Set(['/forkfleet.v1.FleetService/WatchEvents']);

/** Unary calls that may wait long for an answer (WaitOperation: up to its timeout, 10 minutes at most). */
const LONG_POLLS: ReadonlySet<string> = new Set(['/forkfleet.v1.FleetService/WaitOperation']);

/** How often open streaming calls and long polls are checked against the tokens file while any is open. */
export const REVOCATION_CHECK_MS = 1000;

export class ApiGuard {
  private readonly rate: RateLimiter;
  private readonly streams: ConcurrencyLimiter;
  private readonly longPolls: ConcurrencyLimiter;
  private readonly watches: ConcurrencyLimiter;
  private readonly now: () => number;
  /** The open streaming calls and long polls, by credential id: the principal each was admitted as, and what revokes it. */
  private readonly live = new Map<string, Set<{ principal: Principal; revoke: (err: Error) => void }>>();
  private sweeper: NodeJS.Timeout | undefined;

  constructor(readonly auth: Authenticator, opts: ApiGuardOptions) {
    this.rate = new RateLimiter((tenant) => auth.rateOf(tenant));
    this.streams = new ConcurrencyLimiter(opts.maxStreamsPerCredential);
    this.longPolls = new ConcurrencyLimiter(opts.maxStreamsPerCredential);
    this.watches = new ConcurrencyLimiter(opts.maxWatchesPerCredential ?? 16);
    this.now = opts.now ?? Date.now;
  }

  /** An admitted call ended by its credential's revocation; its release gives back `frees` and stops watching. */
  private revocable(principal: Principal, ...frees: Array<(() => void) | undefined>): { principal: Principal; onRevoke: (cb: (err: Error) => void) => void; release: () => void } {
    const { onRevoke, forget } = this.watchRevocation(principal);
    return {
      principal,
      onRevoke,
      release: () => {
        forget();
        for (const f of frees) f?.();
      },
    };
  }

  /**
   * A streaming call's credential removed from the tokens file while the call is open (an
   * exec session, a watch, a long poll) ends the call UNAUTHENTICATED within about
   * REVOCATION_CHECK_MS: a revoked token must not keep reading a sandbox it was cut off from.
   * So does an entry edited to another `tenant`, or whose `admin` was taken away or given: the
   * entry keeps its credential id, and the call must not go on as the principal it was admitted as.
   */
  private watchRevocation(principal: Principal): { onRevoke: (cb: (err: Error) => void) => void; forget: () => void } {
    const credentialId = principal.credentialId;
    let cb: ((err: Error) => void) | undefined;
    const set = this.live.get(credentialId) ?? new Set();
    this.live.set(credentialId, set);
    const entry = { principal, revoke: (err: Error): void => cb?.(err) };
    set.add(entry);
    this.sweeper ??= setInterval(() => this.sweep(), REVOCATION_CHECK_MS).unref();
    return {
      onRevoke: (f) => (cb = f),
      forget: () => {
        set.delete(entry);
        if (set.size === 0 && this.live.get(credentialId) === set) this.live.delete(credentialId);
        if (this.live.size === 0 && this.sweeper) {
          clearInterval(this.sweeper);
          this.sweeper = undefined;
        }
      },
    };
  }

  private sweep(): void {
    for (const [id, set] of this.live) {
      const now = this.auth.principalOf(id);
      if (!now) {
        this.live.delete(id);
        const err = new UnauthenticatedError('credential revoked: its token is no longer in the tokens file');
        for (const { revoke } of set) revoke(err);
        continue;
      }
      for (const entry of set) {
        const was = entry.principal;
        if (was.tenantId === now.tenantId && was.admin === now.admin) continue;
        set.delete(entry);
        const what = was.tenantId !== now.tenantId ? `its tenant is now ${now.tenantId}, not ${was.tenantId}` : now.admin ? 'it is an admin credential now' : 'it is no longer an admin credential';
        entry.revoke(new UnauthenticatedError(`credential changed in the tokens file since the call was admitted: ${what}; call again`));
      }
      if (set.size === 0) this.live.delete(id);
    }
    if (this.live.size === 0 && this.sweeper) {
      clearInterval(this.sweeper);
      this.sweeper = undefined;
    }
  }

  admit(call: { metadata: HeaderSource; streaming: boolean; method?: string }): { principal: Principal; release?: () => void; onRevoke?: (cb: (err: Error) => void) => void } {
    const values = call.metadata.get('authorization');
    if (values.length > 1) throw new UnauthenticatedError('more than one authorization header');
    const header = values[0];
    const principal = this.auth.authenticate(typeof header === 'string' ? header : undefined);
    const wait = this.rate.take(principal.tenantId, this.now());
    if (wait > 0) {
      const spec = this.auth.rateOf(principal.tenantId)!;
      throw new RateLimitedError(principal.tenantId, spec.perSecond, spec.burst, wait);
    }
    // A long poll holds the server as a stream does: capped the same way, on its own count
    // (a step that waits for 256 operations and runs 256 execs takes both in full).
    if (!call.streaming) {
      if (call.method === undefined || !LONG_POLLS.has(call.method)) return { principal };
      const free = this.longPolls.acquire(principal.credentialId);
      if (!free) throw new TooManyStreamsError(this.longPolls.max);
      // Ended by a revocation too: a WaitOperation may wait up to 10 minutes.
      return this.revocable(principal, free);
    }
    // Admin credentials (operators, the dashboard's one watch per tenant) are not capped.
    const watch = !principal.admin && call.method !== undefined && WATCHES.has(call.method);
    const freeWatch = watch ? this.watches.acquire(principal.credentialId) : undefined;
    if (watch && !freeWatch) throw new TooManyStreamsError(this.watches.max, 'event watches (FF_MAX_WATCHES_PER_CREDENTIAL)');
    const free = this.streams.acquire(principal.credentialId);
    if (!free) {
      freeWatch?.();
      throw new TooManyStreamsError(this.streams.max);
    }
    return this.revocable(principal, free, freeWatch);
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

/** Fleet operations (hosts, cordon, drain) need an admin credential. `field`: the request field that asks for it, named in the error. */
export function requireAdmin(principal: Principal, what: string, field?: string): void {
  if (!principal.admin) throw new PermissionDeniedError(`${what} needs an admin credential`, field);
}
