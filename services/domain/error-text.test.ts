// What tenants read of a failure: a named error's message; an unexpected one only as such,
// its own text (host paths, QEMU or etcd output) kept for the operator.
import { describe, expect, it } from 'vitest';
import { HostStepError, RelayedHostError, StoreUnavailableError } from './errors.ts';
import { toGrpcStatus } from '../adapters/grpc/status.ts';
import { status as Status } from '@grpc/grpc-js';
import { errorOf } from './executor.ts';

const RAW = "ENOENT: no such file or directory, open '/var/lib/ffleet/vms/sb-1/mem.img'";

describe('error texts tenants read', () => {
  it('hostStepError_ofAnInternalFailure_saysSoWithoutTheHostsText_andKeepsItAsDetail', () => {
    const e = new HostStepError('h1', 'create', 'internal', RAW, false);
    expect(e.kind).toBe('internal');
    expect(e.message).toBe("host h1: create: internal error on the host (its agent's log and the scheduler's have the cause)");
    expect(e.message).not.toContain('/var/lib');
    expect(errorOf(e)).toEqual({ kind: 'internal', message: e.message, retryable: false, detail: `host h1: create: ${RAW}` });
  });

  it('hostStepError_ofAKindThatIsNotAProjectKind_isInternal_andHidesItsText', () => {
    const e = new HostStepError('h1', 'fork/2', 'weird', RAW, true);
    expect(e.kind).toBe('internal');
    expect(e.message).not.toContain('ENOENT');
  });

  it('hostStepError_ofANamedKindTheSchedulerTakesAsInternal_keepsTheHostsMessage', () => {
    const e = new HostStepError('h1', 'restore/h1', 'permission_denied', 'ticket expired at 2026-12-05T10:00:00.000Z', false);
    expect(e.kind).toBe('internal');
    expect(e.message).toBe('host h1: restore/h1: ticket expired at 2026-12-05T10:00:00.000Z');
  });

  it('hostStepError_ofANamedKind_keepsTheHostsMessage', () => {
    const e = new HostStepError('h1', 'create', 'resource_exhausted', 'no room for 4 vCPUs', true);
    expect(e.message).toBe('host h1: create: no room for 4 vCPUs');
    expect(errorOf(e)).toEqual({ kind: 'resource_exhausted', message: e.message, retryable: true });
  });

  it('relayedHostError_ofTheGuestsRefusal_keepsKindFieldAndText', () => {
    const e = new RelayedHostError('invalid_argument', 'not a regular file: /etc', { retryable: false, field: 'path' });
    expect([e.kind, e.field, e.message]).toEqual(['invalid_argument', 'path', 'not a regular file: /etc']);
    expect(toGrpcStatus(e).code).toBe(Status.INVALID_ARGUMENT);
  });

  it('relayedHostError_ofAKindThisSchedulerDoesNotKnow_answersInternalWithoutTheHostsText', () => {
    // A newer agent's kind has no status code: answered as it came, the status had none.
    const e = new RelayedHostError('quota_exceeded', RAW, { retryable: true, field: 'path' });
    expect([e.kind, e.field]).toEqual(['internal', undefined]);
    const st = toGrpcStatus(e);
    expect([st.code, st.details]).toEqual([Status.INTERNAL, 'internal error']);
  });

  it('relayedHostError_ofTheHostsAuthenticationKinds_isInternal_notTheCallersCredential', () => {
    for (const kind of ['permission_denied', 'unauthenticated']) expect(new RelayedHostError(kind, 'ticket expired', { retryable: false }).kind).toBe('internal');
  });

  it('errorOf_anExceptionThatIsNotAProjectError_recordsAGenericMessage_andTheTextAsDetail', () => {
    expect(errorOf(new TypeError("Cannot read properties of undefined (reading 'hostId')"))).toEqual({
      kind: 'internal',
      message: 'internal error in the scheduler (its log has the cause)',
      retryable: false,
      detail: "Cannot read properties of undefined (reading 'hostId')",
    });
  });

  it('storeUnavailable_saysWhatWasBeingDone_butNotTheEtcdClientsText', () => {
    const e = new StoreUnavailableError('reading sandbox sb-1', new Error('14 UNAVAILABLE: connect ECONNREFUSED 10.0.0.5:2379'));
    expect(e.message).toBe('the fleet store is unavailable (reading sandbox sb-1); retry');
    expect(e.retryable).toBe(true);
    expect((e.cause as Error).message).toContain('10.0.0.5:2379');
  });
});
