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
  it('hintFor_aMapEntrysField_namesTheFlagOfItsMap', () => {
    expect(hintFor({ kind: 'invalid_argument', message: 'x', field: 'env["FFE_X"]' }, 'a:1')).toBe('check --env');
    expect(hintFor({ kind: 'invalid_argument', message: 'x', field: 'labels["team"]' }, 'a:1')).toBe('check --label');
    expect(hintFor({ kind: 'invalid_argument', message: 'x', field: 'argv[0]' }, 'a:1')).toBe('check the command after --');
    // Unknown: the field as the server named it, entry and all.
    expect(hintFor({ kind: 'invalid_argument', message: 'x', field: 'other["k"]' }, 'a:1')).toBe('check field other["k"]');
  });
  it('hintFor_aWorkingDirectoryThatIsNotThere_namesCwd_notSandboxLs', () => {
    const h = hintFor({ kind: 'not_found', message: 'cwd: /nope: no such directory (in the guest)', field: 'cwd' }, 'a:1');
    expect(h).toContain('--cwd');
    expect(h).not.toContain('sandbox ls');
    expect(hintFor({ kind: 'failed_precondition', message: 'cwd: /root: the guest refuses to enter it (in the guest)', field: 'cwd' }, 'a:1')).toBe('check --cwd');
    // A sandbox that is not there: still the list.
    expect(hintFor({ kind: 'not_found', message: 'sandbox sb-1 not found', field: 'sandbox_id' }, 'a:1')).toContain('forkfleet sandbox ls');
  });
  it('hintFor_aRevisionCompactedAway_namesAfter', () => {
    const h = hintFor({ kind: 'failed_precondition', message: 'revision 5 is compacted away: read the current state, then watch from now (after_revision 0)', field: 'after_revision' }, 'a:1');
    expect(h).toContain('--after');
    expect(h).not.toContain('wrong state');
    expect(hintFor({ kind: 'invalid_argument', message: 'x', field: 'after_revision' }, 'a:1')).toBe('check --after');
  });
  it('hintFor_execOutputNotRead_isAboutTheReader_notCapacity', () => {
    const h = hintFor({ kind: 'resource_exhausted', message: 'exec output not read: more than 33554432 bytes of tenant t1\'s exec output (half of what it may hold) waited on this scheduler for callers to read it, so the command was stopped' }, 'a:1');
    expect(h).toContain('sandbox cp');
    expect(h).not.toMatch(/no capacity|add hosts/);
    expect(hintFor({ kind: 'resource_exhausted', message: '4096 events wait unread: read faster, or resume with after_revision 9' }, 'a:1')).toContain('--after');
  });
  it('hintFor_aCreateLargerThanAnyHost_namesTheFlagOfTheResourceItNames_andNoCapacityNamesNone', () => {
    const larger = (field: string): string => hintFor({ kind: 'resource_exhausted', message: `${field}: 128 vCPUs is more than any host of the fleet has in all (the largest has 8 vCPUs)`, field, retryable: false, operation: true }, 'a:1');
    expect(larger('resources.vcpus')).toContain('ask for less with --vcpus');
    expect(larger('resources.memory_mib')).toContain('ask for less with --memory');
    expect(larger('resources.disk_mib')).toContain("ask for less with the SDK's diskMib");
    for (const f of ['resources.vcpus', 'resources.disk_mib']) expect(larger(f)).not.toContain('--memory');
    // No resource named (no host has room now): nothing about asking for less.
    const full = hintFor({ kind: 'resource_exhausted', message: 'no host can take this: 3 hosts full', retryable: true }, 'a:1');
    expect(full).toContain('no capacity');
    expect(full).not.toMatch(/ask for less|--memory|--vcpus/);
  });
  it('hintFor_stdinOverTheLimit_fromTheServerOrTheCli_pointsAtSandboxCp', () => {
    for (const field of ['stdin', '--stdin']) expect(hintFor({ kind: 'invalid_argument', message: 'stdin: at most 1048576 bytes', field }, 'a:1')).toMatch(/^check --stdin \(at most 1 MiB\): .*`forkfleet sandbox cp /);
  });
  it('hintFor_alreadyExists_offersANewIdempotencyKey_onlyToACommandThatSendsOne', () => {
    expect(hintFor({ kind: 'already_exists', message: 'x', keyed: true }, 'a:1')).toContain('--idempotency-key');
    expect(hintFor({ kind: 'already_exists', message: 'x' }, 'a:1')).not.toContain('--idempotency-key');
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

describe('hintFor a placement no host was eligible for', () => {
  it('saysToUncordonWaitForOrAddAHost_notToFreeCapacityOrCheckTheSandboxsState', () => {
    // An SRE's same-host fork with its holder cordoned was told "no capacity ... ask for less
    // (--memory)"; as failed_precondition it was told the sandbox was in the wrong state.
    for (const e of [
      { kind: 'failed_precondition', message: 'no host is eligible for this fork (locality=2, cordoned=1)', operation: true, retryable: false },
      { kind: 'unavailable', message: 'no host is eligible for this create (not_pinned=2, host_suspect=1); some are down, retry once they are back', operation: true, retryable: true },
      { kind: 'failed_precondition', message: 'moved 0 of 1 sandboxes off h2; S1: no other host can take it now (cordoned=2); it was not paused or snapshotted', operation: true, retryable: false },
    ]) {
      const h = hintFor(e, 'a:1');
      expect(h).toContain('forkfleet hosts cordon HOST --undo');
      expect(h).not.toMatch(/no capacity|wrong state|--memory/);
    }
  });
});

describe('hintFor a resource_exhausted file call', () => {
  it('hintFor_aFullGuestFileSystem_saysToFreeSpaceInTheSandboxOrUseALargerDisk_notToAddHosts', () => {
    // An eval user copying 60 MiB into a 31 MB guest file system was told "no capacity: ... add hosts".
    for (const field of ['header.path', 'path']) {
      const h = hintFor({ kind: 'resource_exhausted', message: '/data/big.bin: the guest file system is full (in the guest)', field, retryable: false }, 'a:1');
      expect(h).toContain("the sandbox's file system is full");
      expect(h).toContain('diskMib');
      expect(h).not.toMatch(/no capacity|add hosts|sandbox destroy/);
    }
  });
  it('hintFor_theSchedulersFileBufferFull_saysToLetOtherCopiesEnd_notToAddHostsOrFreeGuestSpace', () => {
    for (const field of ['data', 'max_bytes']) {
      const h = hintFor({ kind: 'resource_exhausted', message: "tenant t1's file transfers hold 268435456 of the 268435456 bytes one tenant may hold on this scheduler (half of FF_FILE_BUFFER_MAX); retry once they end", field, retryable: true }, 'a:1');
      expect(h).toContain('FF_FILE_BUFFER_MAX');
      expect(h).toContain('sandbox cp');
      expect(h).not.toMatch(/no capacity|add hosts|file system is full/);
    }
  });
});
