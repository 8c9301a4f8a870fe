import { ForkfleetError } from '../../../proto/errors.ts';

/**
 * A push-driven async iterable: producers push, one consumer iterates. Used to feed
 * request streams (client and bidi calls) from code that reacts to responses, e.g. sending
 * flow-control credits as chunks arrive.
 */
export class AsyncQueue<T> implements AsyncIterable<T> {
  // Invariant: at most one of `items` and `waiters` is non-empty.
  private readonly items: T[] = [];
  private readonly waiters: Array<{ resolve: (r: IteratorResult<T>) => void; reject: (e: unknown) => void }> = [];
  private ended = false;
  private failure: { error: unknown } | undefined;

  push(item: T): void {
    if (this.ended) throw new Error('AsyncQueue: push after end');
    const w = this.waiters.shift();
    if (w) w.resolve({ value: item, done: false });
    else this.items.push(item);
  }

  /** No more items; the consumer finishes after draining what was pushed. */
  end(): void {
    this.ended = true;
    for (const w of this.waiters.splice(0)) w.resolve({ value: undefined, done: true });
  }

  /** The consumer's next read throws `error` (after draining queued items). */
  fail(error: unknown): void {
    this.failure = { error };
    this.ended = true;
    for (const w of this.waiters.splice(0)) w.reject(error);
  }

  /** As fail(), but what was pushed and not yet read is dropped: the consumer's next read throws. */
  failNow(error: unknown): void {
    this.items.length = 0;
    this.fail(error);
  }

  get isEnded(): boolean {
    return this.ended;
  }

  /** Items pushed and not yet read. */
  get size(): number {
    return this.items.length;
  }

  [Symbol.asyncIterator](): AsyncIterator<T> {
    return {
      next: () => {
        if (this.items.length > 0) return Promise.resolve({ value: this.items.shift() as T, done: false });
        if (this.failure) return Promise.reject(this.failure.error);
        if (this.ended) return Promise.resolve({ value: undefined, done: true });
        return new Promise((resolve, reject) => this.waiters.push({ resolve, reject }));
      },
      return: () => {
        this.ended = true;
        this.items.length = 0;
        return Promise.resolve({ value: undefined, done: true });
      },
    };
  }
}

/**
 * Iterates an object-mode Readable without destroying it at the end. Node's own async
 * iterator destroys the stream when the read side ends, which on a gRPC server duplex call
 * would also kill the write side before the handler has sent its last messages and status.
 */
export function readableItems<T>(stream: NodeJS.ReadableStream & NodeJS.EventEmitter, highWater = 64): AsyncIterable<T> {
  const q = new AsyncQueue<T>();
  let buffered = 0;
  stream.on('data', (item: T) => {
    if (q.isEnded) return;
    q.push(item);
    if (++buffered >= highWater) stream.pause();
  });
  stream.once('end', () => {
    if (!q.isEnded) q.end();
  });
  stream.once('error', (e: unknown) => {
    if (!q.isEnded) q.fail(e);
  });
  // A call the client cancelled (or lost) is destroyed without 'end' or 'error': the reader
  // would wait for ever, and whatever it holds (an upload's pieces) with it.
  stream.once('close', () => {
    if (!q.isEnded) q.fail(new ForkfleetError('cancelled', 'the client went away before the end of its stream'));
  });
  return {
    [Symbol.asyncIterator]() {
      const inner = q[Symbol.asyncIterator]();
      return {
        async next() {
          const r = await inner.next();
          if (!r.done && --buffered < highWater && stream.isPaused()) stream.resume();
          return r;
        },
        return() {
          stream.pause();
          return inner.return ? inner.return() : Promise.resolve({ value: undefined, done: true });
        },
      };
    },
  };
}
