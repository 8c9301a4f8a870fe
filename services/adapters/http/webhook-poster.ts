// WebhookPoster over Node's fetch (undici): one POST with a timeout.
import type { WebhookPoster } from '../../domain/webhooks.ts';

export const fetchPoster: WebhookPoster = {
  async post(url, body, headers, timeoutMs) {
    const res = await fetch(url, { method: 'POST', body, headers, signal: AbortSignal.timeout(timeoutMs), redirect: 'manual' });
    // Only the status counts. The body is not read: a receiver that answers with a large or
    // endless one would otherwise hold the attempt until its timeout, buffered in memory.
    await res.body?.cancel().catch(() => undefined);
    return res.status;
  },
};
