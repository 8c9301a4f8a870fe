import { describe, expect, it } from 'vitest';
import { defaultApi, exitCodeFor, hintFor } from './hints.ts';

describe('CLI hints', () => {
  it('hintFor_invalidArgument_namesTheFlag', () => {
    expect(hintFor({ kind: 'invalid_argument', message: 'x', field: 'resources.memory_mib' }, 'a:1')).toContain('--memory');
    expect(exitCodeFor({ kind: 'invalid_argument', message: 'x' })).toBe(2);
  });
  it('hintFor_notFoundAndUnavailable_sayWhatToDoNext', () => {
    expect(hintFor({ kind: 'not_found', message: 'x' }, 'a:1')).toContain('forkfleet sandbox ls');
    expect(hintFor({ kind: 'unavailable', message: 'x' }, 'a:1')).toContain('npm run fleet:up');
    // The scheduler answered; its etcd did not.
    expect(hintFor({ kind: 'unavailable', message: 'the fleet store is unavailable (read): Execution prevented because the circuit breaker is open; retry' }, 'a:1')).toMatch(/cannot reach etcd.*operation ls/);
    expect(hintFor({ kind: 'unavailable', message: 'No connection established. Last error: Error: unable to verify the first certificate' }, 'a:1')).toContain('FF_CA');
    expect(hintFor({ kind: 'unauthenticated', message: 'no credentials' }, 'a:1')).toContain('FF_TOKEN');
    expect(hintFor({ kind: 'permission_denied', message: 'x', field: 'tenant_id' }, 'a:1')).toContain('drop --tenant');
    expect(hintFor({ kind: 'permission_denied', message: 'x' }, 'a:1')).toContain('admin credential');
    expect(hintFor({ kind: 'resource_exhausted', message: 'x', field: 'quotas.sandboxes' }, 'a:1')).toContain('quota');
    expect(hintFor({ kind: 'resource_exhausted', message: 'x', field: 'rate' }, 'a:1')).toContain('too many requests');
    expect(exitCodeFor({ kind: 'unavailable', message: 'x' })).toBe(69);
    // Answered by the scheduler (a host or guest behind it failed): reachable, so not 69, and no 'is the fleet up?'.
    const behind = { kind: 'unavailable', message: 'host h1 is not answering', answered: true };
    expect(exitCodeFor(behind)).toBe(1);
    expect(hintFor(behind, 'a:1')).not.toContain('fleet:up');
    expect(hintFor(behind, 'a:1')).toContain('forkfleet hosts ls');
  });
  it('hintFor_anOperationThatFailedOnTheFleet_pointsAtItsSandboxesAndHosts_notAtTheConnection', () => {
    const lost = { kind: 'unavailable', message: 'operation op-1 (fork) failed: 4 of 6 children started; host h1 was lost', retryable: true, operation: true };
    expect(hintFor(lost, 'a:1')).toContain('forkfleet hosts ls');
    expect(hintFor(lost, 'a:1')).not.toContain('fleet:up');
    expect(hintFor(lost, 'a:1')).toContain('again may succeed');
    expect(exitCodeFor(lost)).toBe(1);
    expect(hintFor({ kind: 'deadline_exceeded', message: 'x', operation: true }, 'a:1')).not.toContain('larger --timeout');
    // A failed operation whose kind says what the caller must change keeps that kind's hint.
    expect(hintFor({ kind: 'resource_exhausted', message: 'x', operation: true }, 'a:1')).toContain('no capacity');
  });
  it('hintFor_aCancelledOperation_saysItWasCancelledAndWhereToSeeWhatItUndid_notThatTheCallWas', () => {
    expect(hintFor({ kind: 'cancelled', message: 'operation op-1 (fork) cancelled: cancelled by a CancelOperation call', operation: true }, 'a:1')).toContain('forkfleet operation get');
    expect(hintFor({ kind: 'cancelled', message: 'cancelled by client' }, 'a:1')).toBe('the call was cancelled');
  });
  it('hintFor_aPausedSandbox_saysHowToResumeIt_andOtherWrongStatesHowToSeeIt', () => {
    expect(hintFor({ kind: 'failed_precondition', message: 'sandbox sb-abc123 is paused; it must be running' }, 'a:1')).toContain('forkfleet sandbox resume sb-abc123');
    expect(hintFor({ kind: 'failed_precondition', message: 'snapshot sn-1 is deleting' }, 'a:1')).toContain('forkfleet sandbox get');
    expect(hintFor({ kind: 'invalid_argument', message: 'x', field: 'snapshot_retention.ttl' }, 'a:1')).toContain('--snapshot-ttl');
    expect(hintFor({ kind: 'invalid_argument', message: 'x', field: 'lifecycle.idle_timeout' }, 'a:1')).toContain('--idle-timeout');
  });
  it('hintFor_aFieldOfTheClisOwn_namesTheFlagItself', () => {
    expect(hintFor({ kind: 'invalid_argument', message: 'x', field: '--idempotency-key' }, 'a:1')).toBe('check --idempotency-key');
    expect(hintFor({ kind: 'invalid_argument', message: 'x', field: '--memory' }, 'a:1')).toBe('check --memory');
    expect(hintFor({ kind: 'invalid_argument', message: 'x', field: 'lineage_x' }, 'a:1')).toBe('check field lineage_x');
  });
  it('exitCodeFor_acceptedWorkWhoseOutcomeIsUnknown_is75_evenWhenTheFleetIsUnreachable', () => {
    expect(exitCodeFor({ kind: 'unavailable', message: 'x', accepted: true })).toBe(75);
    expect(exitCodeFor({ kind: 'deadline_exceeded', message: 'x', accepted: true })).toBe(75);
    expect(exitCodeFor({ kind: 'unavailable', message: 'x' })).toBe(69);
  });
  it('defaultApi_prefersFF_API_thenTheLocalFleet_thenTheDefaultPort', () => {
    expect(defaultApi({ FF_API: 'h:1' })).toBe('h:1');
    expect(defaultApi({ FF_FLEET_DIR: '/nonexistent-ffui' })).toBe('127.0.0.1:17700');
  });
});
