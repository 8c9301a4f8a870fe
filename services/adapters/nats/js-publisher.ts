// JetStream publishes that share one reply subscription. nats.js's `js.publish()` makes a
// core request per message (a request object, a timer, a mux entry), and every request that
// ends well builds a NatsError("cancelled") with a stack trace that nobody reads: 3.5% of the
// leader's and 4% of the fake agents' CPU in bench:placement. Here a publish is one PUB with
// a reply subject `<inbox>.<token>`; the server's PubAck comes back on the one wildcard
// subscription, is matched by token, and deadlines are swept four times a second.
// The protocol is JetStream's own: a PubAck is `{"stream","seq","duplicate"}` or
// `{"error":{"code","err_code","description"}}`; a 503 status with no body means that no
// stream takes the subject. Both scheduler and agents use it (the agent's inbox prefix is one
// its NATS user may subscribe to, auth.ts).
import { createInbox, headers as natsHeaders } from 'nats';
import type { Msg, NatsConnection, NatsError, Subscription } from 'nats';
import { ForkfleetError } from '../../../proto/errors.ts';

export interface PubAck {
  readonly stream: string;
  readonly seq: number;
  readonly duplicate: boolean;
}

interface Pending {
  readonly subject: string;
  readonly deadline: number;
  readonly resolve: (a: PubAck) => void;
  readonly reject: (e: unknown) => void;
}

/** nats.js's own default for a JetStream publish. */
const DEFAULT_TIMEOUT_MS = 5000;

/** One publisher per connection (the fake agents run a hundred hosts on one). */
const shared = new WeakMap<NatsConnection, JsPublisher>();

export class JsPublisher {
  /**
   * The publisher of `nc`, made on first use with the connection's own inbox prefix (nats.js
   * keeps its options on the connection object; an agent's NATS user may subscribe only
   * under its prefix), closed when the connection closes.
   */
  static of(nc: NatsConnection): JsPublisher {
    let p = shared.get(nc);
    if (!p) {
      const inboxPrefix = (nc as { options?: { inboxPrefix?: string } }).options?.inboxPrefix;
      const made = new JsPublisher(nc, inboxPrefix ? { inboxPrefix } : {});
      shared.set(nc, (p = made));
      void nc.closed().then(() => made.close());
    }
    return p;
  }

  private readonly inbox: string;
  private readonly pending = new Map<string, Pending>();
  private readonly sub: Subscription;
  private readonly sweeper: ReturnType<typeof setInterval>;
  private readonly timeoutMs: number;
  private seq = 0;
  private closed = false;

  constructor(
    private readonly nc: NatsConnection,
    opts: { inboxPrefix?: string; timeoutMs?: number } = {},
  ) {
    this.timeoutMs = opts.timeoutMs ?? DEFAULT_TIMEOUT_MS;
    this.inbox = createInbox(opts.inboxPrefix);
    this.sub = nc.subscribe(`${this.inbox}.*`, { callback: (err, m) => this.onReply(err, m) });
    // Deadlines on the monotonic clock: a wall clock stepped back (an NTP correction) would keep a
    // publish whose PubAck was lost pending that much longer, and every send queued behind it.
    this.sweeper = setInterval(() => this.expire(performance.now()), 250);
    this.sweeper.unref();
  }

  /**
   * Publishes to a subject a stream captures and resolves with the server's PubAck. `msgId`
   * sets `Nats-Msg-Id`: the stream drops a second message with the same id within its
   * duplicate window (the PubAck then says `duplicate`). `headers` are set as given.
   */
  publish(subject: string, data: Uint8Array, opts: { msgId?: string; headers?: Readonly<Record<string, string>> } = {}): Promise<PubAck> {
    if (this.closed) return Promise.reject(new ForkfleetError('unavailable', `JetStream publish to ${subject}: the publisher is closed`));
    const token = (this.seq++).toString(36);
    return new Promise<PubAck>((resolve, reject) => {
      this.pending.set(token, { subject, deadline: performance.now() + this.timeoutMs, resolve, reject });
      let h: ReturnType<typeof natsHeaders> | undefined;
      if (opts.msgId || opts.headers) {
        h = natsHeaders();
        if (opts.msgId) h.set('Nats-Msg-Id', opts.msgId);
        for (const [k, v] of Object.entries(opts.headers ?? {})) h.set(k, v);
      }
      try {
        this.nc.publish(subject, data, { reply: `${this.inbox}.${token}`, ...(h ? { headers: h } : {}) });
      } catch (e) {
        this.pending.delete(token);
        // Larger than the server takes: every retry would fail alike, so not "unavailable".
        if ((e as { code?: string }).code === 'MAX_PAYLOAD_EXCEEDED') reject(new ForkfleetError('resource_exhausted', `JetStream publish to ${subject}: ${data.length} bytes is more than the NATS server's max_payload of ${this.nc.info?.max_payload ?? '?'} bytes`, { cause: e, retryable: false }));
        else reject(new ForkfleetError('unavailable', `JetStream publish to ${subject} failed: ${(e as Error).message}`, { cause: e }));
      }
    });
  }

  private onReply(err: NatsError | null, m: Msg): void {
    if (err) {
      this.failAll(new ForkfleetError('unavailable', `JetStream acks subscription failed: ${err.message}`, { cause: err }));
      return;
    }
    const token = m.subject.slice(this.inbox.length + 1);
    const p = this.pending.get(token);
    if (!p) return; // expired meanwhile
    this.pending.delete(token);
    if (m.data.length === 0) {
      const status = m.headers?.code === 503 ? 'no stream takes this subject (no responders)' : `empty reply ${m.headers?.status ?? ''}`.trim();
      p.reject(new ForkfleetError('unavailable', `JetStream publish to ${p.subject}: ${status}`));
      return;
    }
    let ack: { stream?: string; seq?: number; duplicate?: boolean; error?: { code?: number; err_code?: number; description?: string } };
    try {
      ack = JSON.parse(Buffer.from(m.data.buffer, m.data.byteOffset, m.data.byteLength).toString('utf8')) as typeof ack;
    } catch {
      p.reject(new ForkfleetError('unavailable', `JetStream publish to ${p.subject}: undecodable PubAck`));
      return;
    }
    if (ack.error) p.reject(new ForkfleetError('unavailable', `JetStream refused a publish to ${p.subject}: ${ack.error.description ?? 'error'} (${ack.error.code ?? '?'}/${ack.error.err_code ?? '?'})`));
    else p.resolve({ stream: ack.stream ?? '', seq: ack.seq ?? 0, duplicate: ack.duplicate === true });
  }

  private expire(now: number): void {
    for (const [token, p] of this.pending) {
      if (p.deadline > now) continue;
      this.pending.delete(token);
      p.reject(new ForkfleetError('deadline_exceeded', `JetStream publish to ${p.subject}: no PubAck within ${this.timeoutMs} ms`));
    }
  }

  private failAll(e: unknown): void {
    const all = [...this.pending.values()];
    this.pending.clear();
    for (const p of all) p.reject(e);
  }

  /** Fails what is still waiting for its PubAck and stops listening. */
  close(): void {
    if (this.closed) return;
    this.closed = true;
    clearInterval(this.sweeper);
    this.failAll(new ForkfleetError('unavailable', 'JetStream publisher closed before the PubAck'));
    this.sub.unsubscribe();
  }
}
