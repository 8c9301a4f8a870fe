// Named errors of the etcd adapter (CONVENTIONS.md §5). The retryable ones the domain knows
// (StoreUnavailableError, StoreFullError, NotLeaderError) live in services/domain/errors.ts.
import { ForkfleetError } from '../../../proto/errors.ts';

/**
 * etcd refused a request that no retry can get through: it is over one of etcd's configured
 * limits, so the same request fails the same way until an operator raises the limit.
 * `failed_precondition`, not retryable: the fleet store is not configured as the fleet needs
 * (services/README.md, "etcd key layout"), which a client's retry does not change.
 */
export class StoreLimitError extends ForkfleetError {
  /** The etcd flag whose limit the request is over. */
  readonly limit: '--max-txn-ops' | '--max-request-bytes';
  constructor(what: string, limit: '--max-txn-ops' | '--max-request-bytes', cause: unknown) {
    super(
      'failed_precondition',
      limit === '--max-txn-ops'
        ? `the fleet store refused a transaction with more operations than etcd allows (${what}): etcd must run with --max-txn-ops 1024 (its default is 128; services/README.md)`
        : `the fleet store refused a request larger than etcd allows (${what}): it is over etcd's --max-request-bytes (1.5 MiB by default)`,
      { retryable: false, cause },
    );
    this.limit = limit;
  }
}

/**
 * etcd refused a transaction that names one key in two of its writes: a bug in the
 * transaction's making, never mended by a retry. `internal`: its text is for the log.
 */
export class StoreDuplicateKeyError extends ForkfleetError {
  constructor(what: string, cause: unknown) {
    super('internal', `the fleet store refused a transaction that writes one key twice (${what})`, { retryable: false, cause });
  }
}
