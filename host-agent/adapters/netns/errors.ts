// Named errors of the sandbox network adapters (CONVENTIONS.md §5). host-agent/errors.ts holds
// the agent's domain errors; these are the ones only egress.ts raises.
import { ForkfleetError, type ForkfleetErrorOptions } from '../../../proto/errors.ts';

/**
 * Egress cannot be given safely on this host as it is configured (e.g. an address whose network
 * the host does not know, so the deny list cannot cover it). Not retryable: the same request
 * fails until the operator changes the host's configuration (FF_EGRESS_DENY_CIDRS).
 */
export class EgressRefusedError extends ForkfleetError {
  constructor(reason: string, options: ForkfleetErrorOptions = {}) {
    super('failed_precondition', `egress refused on this host: ${reason}`, { retryable: false, ...options });
  }
}
