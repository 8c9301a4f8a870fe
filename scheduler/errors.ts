// Named errors of the placement library (CONVENTIONS.md §5). place() itself returns
// failures as values; these let the service turn a failed PlacementResult into an error
// the gRPC edge maps (resource_exhausted -> RESOURCE_EXHAUSTED, not_found -> NOT_FOUND).
import { ForkfleetError } from '../proto/errors.ts';
import type { Explanation, PlacementResult } from './types.ts';

/** No host (or set of hosts) can take the request now. Retryable: capacity frees up. */
export class NoCapacityError extends ForkfleetError {
  constructor(readonly explanation: Explanation, options: { cause?: unknown } = {}) {
    super('resource_exhausted', explanation.summary, { ...options, retryable: true });
  }
}

/** The request names a snapshot the fleet view does not have. Not retryable as is. */
export class UnknownSnapshotError extends ForkfleetError {
  constructor(readonly snapshotId: string, readonly explanation: Explanation) {
    super('not_found', `snapshot ${snapshotId} not found`, { retryable: false });
  }
}

/** The error for a failed result, or null when it succeeded. */
export function placementError(result: PlacementResult, snapshotId = ''): NoCapacityError | UnknownSnapshotError | null {
  if (result.ok) return null;
  return result.reason === 'no_capacity' ? new NoCapacityError(result.explanation) : new UnknownSnapshotError(snapshotId, result.explanation);
}
