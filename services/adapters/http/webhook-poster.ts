// WebhookPoster over Node's fetch (undici): one POST with a timeout.
import type { WebhookPoster } from '../../domain/webhooks.ts';

export const fetchPoster: WebhookPoster = {
  async post(url, body, headers, timeoutMs) {
    const res = await fetch(url, { method: 'POST', body, headers, signal: AbortSignal.timeout(timeoutMs), redirect: 'manual' });
    await res.arrayBuffer().catch(() => undefined);
    return res.status;
  },
};
