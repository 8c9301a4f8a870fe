// Consuming a durable JetStream consumer that may vanish under the consumer: deleted (a host
// removed while its agent runs), or lost with its stream (nats-server restarted without its
// store, a stream deleted by hand). nats.js alone would retry "consumer not found" forever.
// Both the host agent's work queue and the scheduler's results queue go through this.
import { setTimeout as sleep } from 'node:timers/promises';
import { ConsumerEvents } from 'nats';
import type { ConsumerMessages, JetStreamClient, JetStreamManager, JsMsg, NatsConnection } from 'nats';

/** How often a consuming process checks that its consumer (and its stream) still exist. */
export const QUEUE_CHECK_MS = 10_000;
/** How long after its consumer went it is made again (see consumeDurable). */
export const RECREATE_AFTER_MS = 500;

export interface DurableConsumeOptions {
  nc: NatsConnection;
  jsm: JetStreamManager;
  js: JetStreamClient;
  stream: string;
  consumer: string;
  maxMessages: number;
  /** Makes the stream(s) and the consumer again; idempotent. Retried with backoff while it fails. */
  ensure: () => Promise<void>;
  /** Each message, one at a time: the next is taken once this one's promise settles. */
  onMessage: (m: JsMsg) => void | Promise<void>;
  /** The consumer is gone (why), and is being made again. */
  onGone: (why: string) => void;
  /** A try to make it again failed (it is tried again). */
  onRetry: (err: unknown) => void;
  checkMs?: number;
}

/** A consumer or its stream is missing: what nats-server answers an info or a pull then. */
export function isGone(e: unknown): boolean {
  return /consumer not found|stream not found/i.test(e instanceof Error ? e.message : String(e));
}

/**
 * Consumes `consumer` until the returned stop is called. When the consumer is deleted or not
 * found (a status event, or a check every `checkMs`), it stops consuming, runs `ensure` (after
 * RECREATE_AFTER_MS, then with backoff while it fails) and consumes anew. In that order: an old
 * iterator still pulling when the new consumer exists could take a message and drop it when
 * stopped (it would come back only after the ack wait).
 */
export async function consumeDurable(o: DurableConsumeOptions): Promise<() => Promise<void>> {
  const open = async (): Promise<ConsumerMessages> => (await o.js.consumers.get(o.stream, o.consumer)).consume({ max_messages: o.maxMessages });
  let closed = false;
  // The loop's waits end at once when the consumer is stopped: a stop during a 30 s backoff
  // (the agent's SIGTERM, say) would otherwise wait it out.
  const stopping = new AbortController();
  const pause = (ms: number): Promise<void> => sleep(ms, undefined, { signal: stopping.signal }).catch(() => undefined);
  let messages: ConsumerMessages;
  try {
    messages = await open();
  } catch (e) {
    // Gone before the first pull (a nats-server that lost its store while no one consumed, a
    // leader starting after the stream was deleted): made once more here, else every start
    // would fail the same way. Anything else, or a second failure, is the caller's to retry.
    if (!isGone(e)) throw e;
    o.onGone((e as Error).message);
    await new Promise((r) => setTimeout(r, RECREATE_AFTER_MS));
    await o.ensure();
    messages = await open();
  }
  // Consecutive rounds that failed consuming before a message came (a pull the server keeps
  // refusing): each waits twice as long before the consumer is made again, up to 30 s.
  let failedRounds = 0;
  const loop = (async () => {
    while (!closed) {
      const current = messages;
      let stopped = false;
      let received = false;
      let failed = false;
      const gone = (why: string): void => {
        if (stopped) return;
        stopped = true;
        o.onGone(why);
        current.stop();
      };
      void (async () => {
        for await (const st of await current.status()) {
          if (st.type === ConsumerEvents.ConsumerDeleted || st.type === ConsumerEvents.ConsumerNotFound) return gone(st.type);
        }
      })().catch(() => undefined);
      const check = setInterval(() => {
        o.jsm.consumers.info(o.stream, o.consumer).then(
          () => undefined,
          (e: unknown) => {
            if (isGone(e)) gone((e as Error).message);
          },
        );
      }, o.checkMs ?? QUEUE_CHECK_MS);
      check.unref();
      try {
        for await (const m of current) {
          received = true;
          await o.onMessage(m);
        }
      } catch (e) {
        // nats.js ends the iterator with an error on some pull failures (a 400 answer, a
        // permissions violation). Consumed anew as when the consumer went: otherwise this loop
        // would end here, unhandled, and nothing would be taken from the queue again.
        failed = true;
        if (!closed) gone(`consuming failed: ${e instanceof Error ? e.message : String(e)}`);
      } finally {
        clearInterval(check);
      }
      if (closed || o.nc.isClosed()) break;
      failedRounds = failed && !received ? failedRounds + 1 : 0;
      // Not at once: the server answers "not found" before it has removed the old consumer's
      // directory, and one made meanwhile can lose its own (ensureWorkConsumer).
      await pause(Math.min(RECREATE_AFTER_MS * 2 ** failedRounds, 30_000));
      for (let delay = 100; !closed && !o.nc.isClosed(); delay = Math.min(delay * 2, 5000)) {
        try {
          await o.ensure();
          messages = await open();
          if (closed) await messages.close(); // closed while it opened
          break;
        } catch (e) {
          o.onRetry(e);
          await pause(delay);
        }
      }
    }
  })();
  return async () => {
    closed = true;
    stopping.abort();
    await messages.close();
    await loop.catch(() => undefined);
  };
}
