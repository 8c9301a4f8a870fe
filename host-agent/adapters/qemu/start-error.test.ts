// What a QEMU that did not start is reported as (qemuDidNotStart): its log's last lines, or,
// when it wrote none, what the wait for it met.
import { describe, expect, it } from 'vitest';
import { qemuDidNotStart } from './driver.ts';
import { QmpTimeoutError } from '../../errors.ts';

describe('a QEMU that did not start', () => {
  it('withAnEmptyLog_saysWhatTheWaitMet_notAnEmptyReason', () => {
    // Seen on a loaded host: standbys "failed to start" with "QEMU did not start: " and nothing after.
    const e = qemuDidNotStart('', new QmpTimeoutError('connect /x/qmp.sock', 10_000));
    expect(e.message).toMatch(/^QEMU did not start: its log is empty; .*connect \/x\/qmp\.sock/);
  });

  it('withALog_givesItsLastThreeLines', () => {
    const e = qemuDidNotStart('a\nb\nc\nqemu-system-x86_64: -object memory-backend-file: No space left on device\n', new Error('closed'));
    expect(e.message).toBe('QEMU did not start: b | c | qemu-system-x86_64: -object memory-backend-file: No space left on device');
  });
});
