// Named errors of the scheduler service (CONVENTIONS.md §5). Kinds map to gRPC codes at the edge.
import { ForkfleetError, isErrorKind } from '../../proto/errors.ts';

export class NotFoundError extends ForkfleetError {
  constructor(what: 'sandbox' | 'snapshot' | 'operation' | 'host', id: string) {
    super('not_found', `${what} ${id} not found`);
  }
}

export class WrongStateError extends ForkfleetError {
  constructor(what: string, id: string, state: string, wanted: string, field?: string) {
    super('failed_precondition', `${what} ${id} is ${state}; ${wanted}`, field === undefined ? {} : { field });
  }
}

export class NoCapacityError extends ForkfleetError {
  constructor(summary: string) {
    super('resource_exhausted', `no host can take this: ${summary}`, { retryable: true });
  }
}

/**
 * No host was eligible at all, for reasons that freed capacity does not change (cordoned or
 * draining hosts, a locality or pin no host meets, no live host to copy the snapshot from, an
 * incompatible VMM): answered as "no capacity" with "ask for less", it sent users after the
 * wrong fix. Unavailable and retryable when hosts that are down would have been eligible (a
 * suspect host may be heard again), else failed_precondition.
 */
export class NoEligibleHostError extends ForkfleetError {
  constructor(what: string, reasons: string, hostsDown: boolean) {
    super(hostsDown ? 'unavailable' : 'failed_precondition', `no host is eligible for this ${what} (${reasons})${hostsDown ? '; some are down, retry once they are back' : ''}`, { retryable: hostsDown });
  }
}

/**
 * A sandbox larger than any host of the fleet, even empty: no retry can place it (a
 * retryable NoCapacityError would have clients retry forever). `field` is the resource.
 */
export class LargerThanAnyHostError extends ForkfleetError {
  constructor(field: string, asked: number, largest: number, unit: string) {
    super('resource_exhausted', `${field}: ${asked} ${unit} is more than any host of the fleet has in all (the largest has ${largest} ${unit})`, { retryable: false, field });
  }
}

export class ConflictError extends ForkfleetError {
  constructor(what: string) {
    super('aborted', `concurrent change to ${what}; retry`, { retryable: true });
  }
}

/**
 * The fleet store (etcd) did not answer: a member down, a raft election under way. Retryable:
 * API calls that change anything carry idempotency keys, so a client's retry of one whose
 * write did land finds its operation instead of making another.
 */
export class StoreUnavailableError extends ForkfleetError {
  constructor(what: string, cause: unknown) {
    // The etcd client's text (member addresses, its internals) stays in `cause`, for the log.
    super('unavailable', `the fleet store is unavailable (${what}); retry`, { retryable: true, cause });
  }
}

/**
 * etcd refused a request as over a limit: its database is full ("mvcc: database space
 * exceeded", its NOSPACE alarm: writes fail until an operator compacts and defragments it or
 * raises --quota-backend-bytes) or it has too many requests in flight (which passes: retryable).
 */
export class StoreFullError extends ForkfleetError {
  constructor(what: string, cause: unknown) {
    const msg = cause instanceof Error ? cause.message : String(cause);
    const full = /space exceeded|nospace/i.test(msg);
    super('resource_exhausted', full ? `the fleet store is full (${what}): etcd's database space is exceeded; an operator must compact and defragment etcd or raise its quota` : `the fleet store is over its request limit (${what}): ${msg}; retry`, { retryable: !full, cause });
  }
}

/** A leader's fenced write found that another replica leads now (ports.ts LeaderFence). */
export class NotLeaderError extends ForkfleetError {
  constructor() {
    super('unavailable', 'this scheduler replica no longer leads; the new leader re-runs the operation', { retryable: true });
  }
}

export class HostStepError extends ForkfleetError {
  /**
   * The host's own text when the error is `internal` (an unexpected failure on the host: its
   * text can carry host paths, QEMU or guest-agent output): kept for the operator (the
   * operation record's `error.detail` and the scheduler's log), left out of `message`, which
   * tenants read. Undefined for named errors, whose message says it all.
   */
  readonly detail: string | undefined;
  /**
   * The part of the step's work the host says was at fault (its error's `field`: the fetch
   * plan's sources when no source could deliver the snapshot, say): not the host's own failure.
   * Kept off the error's `field`, which names a field of the tenant's request.
   */
  readonly workField: string;
  constructor(hostId: string, step: string, kind: string, message: string, retryable: boolean, workField = '') {
    // The kinds a host's failure keeps; others (a ticket the peer refused, permission_denied,
    // say) are the host's problem, not the caller's request: internal, their text kept.
    const kept = ['invalid_argument', 'not_found', 'failed_precondition', 'resource_exhausted', 'unavailable', 'deadline_exceeded'].includes(kind);
    // A named error's text says what went wrong; an unexpected one's (kind internal, or none
    // the project knows) may carry host paths or QEMU output.
    const named = kind !== 'internal' && isErrorKind(kind);
    super(
      (kept ? kind : 'internal') as ForkfleetError['kind'],
      named ? `host ${hostId}: ${step}: ${message}` : `host ${hostId}: ${step}: internal error on the host (its agent's log and the scheduler's have the cause)`,
      { retryable },
    );
    this.detail = named ? undefined : `host ${hostId}: ${step}: ${message}`;
    this.workField = workField;
  }
}

/**
 * A host's answer to a relayed call (Exec, ReadFile, WriteFile) that failed. The guest's own
 * refusals (a path, a full disk, a command that timed out) keep their kind, text and field. A
 * kind this scheduler does not know (a newer agent's) has no status code to answer with, and
 * the host's authentication kinds are about the host, not the caller's credential: both are
 * `internal`, whose text tenants never read (toGrpcStatus). It keeps more kinds than
 * HostStepError: a relayed call's answer is about the caller's own request, a step's failure
 * about the scheduler's work. The same holds for the failed wake such a call started for a
 * hibernated sandbox (fleet.ts, wakeFailure).
 */
export class RelayedHostError extends ForkfleetError {
  constructor(kind: string, message: string, opts: { retryable: boolean; field?: string }) {
    const kept = isErrorKind(kind) && kind !== 'unauthenticated' && kind !== 'permission_denied';
    super(kept ? kind : 'internal', message, { retryable: opts.retryable, ...(kept && opts.field ? { field: opts.field } : {}) });
  }
}

/** The host a step went to was marked lost (its heartbeats stopped) before it answered. */
export class HostLostError extends ForkfleetError {
  constructor(hostId: string, step: string) {
    super('unavailable', `host ${hostId} was lost (its heartbeats stopped) before it finished ${step}`, { retryable: true });
  }
}

export class StepTimeoutError extends ForkfleetError {
  /**
   * No send of the step by this run of it reached the bus (NATS down or unreachable from this
   * replica): the host had it at most from an earlier run (a leader before a failover).
   */
  readonly neverSent: boolean;
  constructor(hostId: string, step: string, ms: number, neverSent = false) {
    super('deadline_exceeded', neverSent ? `this scheduler could not send ${step} to host ${hostId} over the work bus within ${ms} ms` : `host ${hostId} did not finish ${step} within ${ms} ms`, { retryable: true });
    this.neverSent = neverSent;
  }
}

/** A CancelOperation call stopped the operation at one of its safe points (Executor). */
export class OperationCancelledError extends ForkfleetError {
  constructor(what = 'cancelled by a CancelOperation call') {
    super('cancelled', what, { retryable: false });
  }
}
