// Per-subject batching of JetStream publishes (hostwork.proto, "Batches"). What is published
// to one subject in one turn of the event loop goes out as one message: the items' encoded
// bytes framed as the `repeated items = 1` field of a HostWorkBatch or HostResultBatch (the
// wire form of that field is exactly "tag, length, bytes" per item, so items are not encoded
// twice) with the header `Ff-Batch: 1`. A turn with one item for a subject sends it as it
// is, without the header. In bench:placement a leader's concurrent forks send tens of
// restore steps to each of a hundred hosts at once: one JetStream message per step was a
// PUB, a stored message, a PubAck, a delivery and an ack each, on both sides.
import { createHash } from 'node:crypto';
import { BinaryWriter, WireType } from '@bufbuild/protobuf/wire';
import type { JsMsg } from 'nats';
import type { JsPublisher } from './js-publisher.ts';

export const BATCH_HEADER = 'Ff-Batch';
/** On work messages from a scheduler that reads HostResultBatch: the agent may batch the results of these steps. */
export const RESULT_BATCH_HEADER = 'Ff-Result-Batch';

/** Items per message at most: a restore step for 64 VMs is ~10-20 KiB encoded. */
const MAX_ITEMS = 64;
/** Bytes per message at most, well under nats-server's default max_payload of 1 MiB. */
const MAX_BYTES = 256 * 1024;

interface Queued {
  readonly bytes: Uint8Array;
  readonly msgId: string | undefined;
  readonly resolve: () => void;
  readonly reject: (e: unknown) => void;
}

/** The message body of a batch: `items` as field 1 of a `repeated` message field. */
export function frameBatch(items: readonly Uint8Array[]): Uint8Array {
  const w = new BinaryWriter();
  for (const b of items) w.tag(1, WireType.LengthDelimited).bytes(b);
  return w.finish();
}

/** Whether a received message is a batch (else it is one item). */
export function isBatch(m: Pick<JsMsg, 'headers'>): boolean {
  return m.headers?.get(BATCH_HEADER) === '1';
}

/**
 * How a message of `n` items is settled: once every item is, it is acked, or, when an item
 * was given back untaken (`release`), handed back at once for redelivery (nak) rather than
 * left to its ack wait. An item that is never settled leaves the message to be redelivered
 * whole after that wait (the receivers dedup by op + step, and answer a finished one from
 * their journal).
 */
export function settleAfter(n: number, ack: () => void, nak: () => void): { ack: () => void; release: () => void } {
  if (n === 0) {
    ack(); // an empty batch: nothing to wait for (never redelivered)
    return { ack: () => undefined, release: () => undefined };
  }
  let left = n;
  let released = false;
  const settle = (): void => {
    if (--left === 0) (released ? nak : ack)();
  };
  return {
    ack: settle,
    release: () => {
      released = true;
      settle();
    },
  };
}

/**
 * Group publish per subject: while one message to a subject waits for its PubAck, what is
 * published there meanwhile queues and goes out as the next message when that PubAck comes
 * (at most MAX_ITEMS / MAX_BYTES each). An idle subject sends at the end of the current turn:
 * batching adds no wait when there is nothing to batch with.
 */
export class SubjectBatcher {
  private readonly subjects = new Map<string, { items: Queued[]; inFlight: boolean }>();
  private readonly due = new Set<string>();
  private scheduled = false;

  /**
   * `headers`: set on every message this batcher sends, batch or single. `mayPublish`, when
   * given, is asked just before each message goes out: an error it returns fails every item
   * queued for the subject instead. An item waits here for the PubAck of the message ahead of
   * it (up to seconds), so a check its caller made when it queued the item (a scheduler's
   * lease) can be stale by the time it would be sent.
   */
  constructor(
    private readonly publisher: JsPublisher,
    private readonly headers: Readonly<Record<string, string>> = {},
    private readonly mayPublish?: () => Error | undefined,
  ) {}

  /**
   * Publishes `bytes` to `subject`, in one message with what else is queued there. Resolves
   * when the message's PubAck arrives; a failed publish fails every item in it (callers
   * re-publish, and the re-publish is batched anew). `msgId` is the item's JetStream dedup
   * id: a batch's id is a digest of its items' ids (the same items published again together
   * are dropped as a duplicate).
   */
  publish(subject: string, bytes: Uint8Array, msgId?: string): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      let st = this.subjects.get(subject);
      if (!st) this.subjects.set(subject, (st = { items: [], inFlight: false }));
      st.items.push({ bytes, msgId, resolve, reject });
      if (st.inFlight) return; // sent when the PubAck in flight comes
      this.due.add(subject);
      if (!this.scheduled) {
        this.scheduled = true;
        setImmediate(() => this.flush());
      }
    });
  }

  /**
   * Fails every item still queued (not the messages in flight) with `e`: a scheduler starting
   * a new leader term drops what the earlier term queued, which would go out once the PubAck
   * ahead of it came, with the earlier term's stamp and after the fence said yes again.
   */
  failAll(e: unknown): void {
    for (const [subject, st] of this.subjects) {
      for (const x of st.items.splice(0)) x.reject(e);
      if (!st.inFlight) this.subjects.delete(subject);
    }
    this.due.clear();
  }

  private flush(): void {
    this.scheduled = false;
    const due = [...this.due];
    this.due.clear();
    for (const subject of due) this.sendNext(subject);
  }

  private sendNext(subject: string): void {
    const st = this.subjects.get(subject);
    if (!st || st.inFlight) return;
    if (st.items.length === 0) {
      this.subjects.delete(subject);
      return;
    }
    const refused = this.mayPublish?.();
    if (refused) {
      for (const x of st.items.splice(0)) x.reject(refused);
      this.subjects.delete(subject);
      return;
    }
    const q: Queued[] = [];
    let bytes = 0;
    while (st.items.length > 0 && q.length < MAX_ITEMS && (q.length === 0 || bytes + st.items[0]!.bytes.length <= MAX_BYTES)) {
      const x = st.items.shift()!;
      q.push(x);
      bytes += x.bytes.length;
    }
    st.inFlight = true;
    let sent: Promise<unknown>;
    if (q.length === 1) {
      const one = q[0]!;
      sent = this.publisher.publish(subject, one.bytes, { ...(one.msgId ? { msgId: one.msgId } : {}), headers: this.headers });
    } else {
      // JetStream dedups per stream, and one stream takes every host's subject: the subject
      // is part of the id.
      const ids = q.map((x) => x.msgId);
      const msgId = ids.every((id) => id !== undefined) ? `batch/${createHash('sha1').update(subject).update('\n').update(ids.join('\n')).digest('hex')}` : undefined;
      sent = this.publisher.publish(subject, frameBatch(q.map((x) => x.bytes)), { ...(msgId ? { msgId } : {}), headers: { ...this.headers, [BATCH_HEADER]: '1' } });
    }
    sent.then(
      () => q.forEach((x) => x.resolve()),
      (e: unknown) => q.forEach((x) => x.reject(e)),
    ).finally(() => {
      st.inFlight = false;
      this.sendNext(subject);
    });
  }
}
