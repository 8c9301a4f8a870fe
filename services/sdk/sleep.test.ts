// The SDK's backoff sleep: an orchestrator shares one AbortSignal across many calls and their
// retries, so a sleep must not leave a listener on it.
import { getEventListeners } from 'node:events';
import { describe, expect, it } from 'vitest';
import { sleep } from './index.ts';

describe('sdk sleep', () => {
  it('sleep_thatRunsItsCourse_leavesNoAbortListenerOnTheSharedSignal', async () => {
    const ac = new AbortController();
    await Promise.all(Array.from({ length: 20 }, () => sleep(5, ac.signal)));
    expect(getEventListeners(ac.signal, 'abort')).toHaveLength(0);
  });

  it('sleep_whoseSignalAborts_rejectsWithItsReason', async () => {
    const ac = new AbortController();
    const s = sleep(10_000, ac.signal);
    ac.abort(new Error('stop'));
    await expect(s).rejects.toThrow('stop');
  });
});
