// Fleet resends an exec or file call once after a hibernate took the sandbox, and only when the
// host's refusal proves none of the call ran (fleet.ts vmNotRunning, matched on the agent's
// texts). These are those texts as the agent's own error classes write them: a change there
// that no longer matches fails here, not by quietly ending the resend.
import { describe, expect, it } from 'vitest';
import { InvalidVmStateError, VmCrashedError, VmNotFoundError, VmStillSnapshottingError } from '../../host-agent/errors.ts';
import { vmNotRunning } from './fleet.ts';

describe('the host refusals that prove a call did not run', () => {
  it.each([
    ['a paused VM', new InvalidVmStateError('sb-1', 'paused', 'exec')],
    ['a stopped VM, file read', new InvalidVmStateError('sb-1', 'stopped', 'read a file')],
    ['a VM whose guest agent is not connected', new InvalidVmStateError('sb-1', 'paused', 'talk to the guest agent')],
    ['a VM still in a snapshot', new VmStillSnapshottingError('sb-1', 5000, 'write a file')],
    ['a VM no longer on the host', new VmNotFoundError('sb-1')],
  ])('vmNotRunning_matchesTheAgentsRefusalOf_%s', (_what, e) => {
    expect(vmNotRunning(e)).toBe(true);
  });

  it('vmNotRunning_doesNotMatchAGuestFailureACrashOrARunningVmWithoutItsGuestAgent', () => {
    expect(vmNotRunning(new VmCrashedError('sb-1', 'QEMU exited'))).toBe(false);
    // Running, its guest agent not connected: not a hibernate's doing, and not one that passes.
    expect(vmNotRunning(new InvalidVmStateError('sb-1', 'running', 'talk to the guest agent'))).toBe(false);
    expect(vmNotRunning({ kind: 'failed_precondition', message: 'vm sb-1 is paused; cannot exec; and then some' })).toBe(false);
    expect(vmNotRunning({ kind: 'internal', message: 'vm sb-1 not found' })).toBe(false);
  });
});
