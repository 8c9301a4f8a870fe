// The gRPC edge's error mapping, both ways: what a client can tell from a status besides its
// code travels in trailing metadata.
import { status as Status } from '@grpc/grpc-js';
import type { ServiceError } from '@grpc/grpc-js';
import { describe, expect, it } from 'vitest';
import { RateLimitedError, TooManyStreamsError } from '../../auth/errors.ts';
import { fromServiceError, META_RETRY_AFTER, toGrpcStatus } from './status.ts';

/** What a client's call gets for the status the server answered with. */
const roundTrip = (err: unknown) => {
  const st = toGrpcStatus(err);
  return fromServiceError(Object.assign(new Error(st.details), { code: st.code, details: st.details, metadata: st.metadata }) as ServiceError);
};

describe('gRPC status mapping', () => {
  it('aRateLimitRefusal_carriesTheServersRetryAfterToTheClient', () => {
    const e = roundTrip(new RateLimitedError('t1', 10, 20, 800));
    expect(e).toMatchObject({ code: Status.RESOURCE_EXHAUSTED, kind: 'resource_exhausted', field: 'rate', retryable: true, answered: true, retryAfterMs: 800 });
    expect(toGrpcStatus(new RateLimitedError('t1', 10, 20, 0.4)).metadata.get(META_RETRY_AFTER)).toEqual(['1']);
  });

  it('anErrorThatNamesNoWait_carriesNone', () => {
    expect(roundTrip(new TooManyStreamsError(8)).retryAfterMs).toBeUndefined();
    expect(toGrpcStatus(new TooManyStreamsError(8)).metadata.get(META_RETRY_AFTER)).toEqual([]);
  });
});
