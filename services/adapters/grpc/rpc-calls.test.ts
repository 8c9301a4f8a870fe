// What a call holds on the server, and for how long: the bridge's side of a grpc-js call
// (rpc.ts), given calls shaped as grpc-js hands them to a handler.
import { afterEach, describe, expect, it, vi } from 'vitest';
import { EventEmitter } from 'node:events';
import { constants as http2Constants } from 'node:http2';
import { Readable, Writable } from 'node:stream';
import { create, toBinary } from '@bufbuild/protobuf';
import type { MessageInitShape } from '@bufbuild/protobuf';
import { Metadata, status as Status } from '@grpc/grpc-js';
import { grpcHandlers, register } from './rpc.ts';
import type { CallContext, CallGuard } from './rpc.ts';
import { UnauthenticatedError } from '../../auth/errors.ts';
import { ForkfleetError } from '../../../proto/errors.ts';
import { EchoRequestSchema, EchoService } from '../../../proto/gen/forkfleet/testing/v1/echo_pb.ts';
import type { EchoRequest } from '../../../proto/gen/forkfleet/testing/v1/echo_pb.ts';

type Answer = { code: number; details: string } | null;
type Handlers = Record<string, (call: unknown, cb?: (err: Answer, res?: unknown) => void) => void>;

const def = register(EchoService, {} as never).definition as unknown as Record<string, { requestDeserialize: (b: Buffer) => unknown }>;
/** A request as grpc-js hands it over: through requestDeserialize. */
const request = (init: MessageInitShape<typeof EchoRequestSchema>): unknown => def.echo!.requestDeserialize(Buffer.from(toBinary(EchoRequestSchema, create(EchoRequestSchema, init))));

/** What every grpc-js server call offers a handler. */
const surface = (deadline: number) => ({ metadata: new Metadata(), getPeer: () => 'test', getDeadline: () => deadline, getAuthContext: () => ({}) });

/** EchoService with only the methods a test gives; the others fail when called. */
function echo(impl: Partial<Record<'echo' | 'echoServerStream' | 'echoClientStream' | 'echoBidi', unknown>>, guard?: CallGuard): Handlers {
  const all = { echo: () => Promise.reject(new Error('not here')), echoServerStream: () => Promise.reject(new Error('not here')), echoClientStream: () => Promise.reject(new Error('not here')), echoBidi: () => Promise.reject(new Error('not here')), ...impl };
  return grpcHandlers(register(EchoService, all as never), () => {}, guard) as Handlers;
}

const answer = (h: Handlers, method: string, call: unknown): Promise<Answer> => new Promise((resolve) => h[method]!(call, (e) => resolve(e)));

afterEach(() => {
  vi.useRealTimers();
});

describe('a server stream whose client does not read', () => {
  it('serverStream_whoseClientReadsNothing_pullsAtMostAboutAMebibyteFromItsHandler_andTheRestOnceTheClientReads', async () => {
    const piece = 'x'.repeat(512 * 1024);
    let pulled = 0;
    const h = echo({
      async *echoServerStream() {
        for (let i = 0; i < 40; i++) {
          pulled++;
          yield { message: piece, index: i };
        }
      },
    });
    // grpc-js's call: an object-mode Writable whose writes are done once HTTP/2 has sent them,
    // which it does not while the client's window is full.
    let reading = false;
    const unsent: Array<() => void> = [];
    let written = 0;
    const call = Object.assign(
      new Writable({
        objectMode: true,
        write(_chunk, _enc, cb: () => void) {
          const send = (): void => {
            written++;
            cb();
          };
          if (reading) setImmediate(send);
          else unsent.push(send);
        },
      }),
      { request: request({}), ...surface(Infinity) },
    );
    const finished = new Promise((resolve) => call.once('finish', resolve));
    h.echoServerStream!(call);
    await new Promise((r) => setTimeout(r, 50));
    // What the handler gave up waits in grpc-js's buffer, counted by nobody (exec output is
    // let go by the bus's count once pulled): UNSENT_MAX_BYTES (1 MiB) and the piece that
    // passed it, not the 16 pieces grpc-js's buffer takes before write() says it is full.
    expect(pulled).toBeLessThanOrEqual(3);
    expect(written).toBe(0);
    // The client reads: everything goes, and the stream ends.
    reading = true;
    for (const send of unsent.splice(0)) send();
    await finished;
    expect([pulled, written]).toEqual([40, 40]);
  });
});

/**
 * grpc-js's call for a server stream (ServerWritableStreamImpl over its HTTP/2 stream), whose
 * client takes a message only when the test says (`take`): an object-mode Writable whose writes
 * are done once HTTP/2 has sent them, which it does not while the client's window is full; an
 * 'error' is the call's status, sent after those messages (grpc-js's 'error' listener ends the
 * call and the status goes in _final), after which, or after a reset of its HTTP/2 stream
 * (kept where grpc-js keeps it, `call.call.stream`), grpc-js cancels the call.
 */
function http2Call() {
  const unsent: Array<() => void> = [];
  const seen: { answered: Answer | undefined; sent: Answer | undefined; rstCode: number | undefined; taken: number } = { answered: undefined, sent: undefined, rstCode: undefined, taken: 0 };
  let status: Answer = { code: Status.OK, details: 'OK' };
  const stream = {
    closed: false,
    rstCode: undefined as number | undefined,
    sentTrailers: undefined,
    close(code: number) {
      stream.closed = true;
      seen.rstCode = stream.rstCode = code;
      cancelled();
    },
  };
  const call = Object.assign(
    new Writable({
      objectMode: true,
      write(_chunk, _enc, cb: () => void) {
        unsent.push(() => {
          seen.taken++;
          cb();
        });
      },
      final(cb: () => void) {
        cb();
        seen.sent = status;
        cancelled();
      },
    }),
    { request: request({}), ...surface(Infinity), cancelled: false, call: { stream } },
  );
  const cancelled = (): void => {
    if (call.cancelled) return;
    call.cancelled = true;
    call.emit('cancelled', 'cancelled');
    call.destroy();
  };
  call.on('error', (st: Answer) => {
    seen.answered = st;
    status = st;
    call.end();
  });
  // grpc-js's Writable hands HTTP/2 one message at a time: the next once the one before is done.
  const take = (n: number): void => {
    for (let i = 0; i < n; i++) unsent.shift()?.();
  };
  return { call, seen, take };
}

/** A guard that admits every call and counts the releases of their admissions. */
function countingGuard(): { guard: CallGuard; released: () => number } {
  let released = 0;
  return { guard: { admit: () => ({ principal: { tenantId: 't1', admin: false, credentialId: 'c1' }, release: () => void released++ }) }, released: () => released };
}

describe('a server stream whose client stops reading', () => {
  it('serverStream_whoseClientStopsReading_whileItsHandlerWouldFail_isAnsweredResourceExhaustedAfterTheStallBound_itsSlotGivenBack_andItsStreamReset', async () => {
    vi.useFakeTimers();
    const { guard, released } = countingGuard();
    let signal: AbortSignal | undefined;
    let returned = false;
    const h = echo(
      {
        // As WatchEvents: more than grpc-js's 16 messages it buffers, then its own failure (its
        // queue gave up), which writeAll, waiting for the client's window, never pulls.
        async *echoServerStream(_req: EchoRequest, ctx: CallContext) {
          signal = ctx.signal;
          try {
            for (let i = 0; i < 40; i++) yield { message: 'event', index: i };
            throw new ForkfleetError('resource_exhausted', '4096 events wait unread');
          } finally {
            returned = true;
          }
        },
      },
      guard,
    );
    const { call, seen, take } = http2Call();
    h.echoServerStream!(call);
    await vi.advanceTimersByTimeAsync(0);
    take(3);
    await vi.advanceTimersByTimeAsync(59_000);
    // Before the bound: the call waits for its client.
    expect({ released: released(), answered: seen.answered, rstCode: seen.rstCode }).toEqual({ released: 0, answered: undefined, rstCode: undefined });
    await vi.advanceTimersByTimeAsync(1_000);
    // The client took nothing for 60 s: the call is answered, its slot given back, its handler ended.
    expect(seen.answered).toMatchObject({ code: Status.RESOURCE_EXHAUSTED, details: expect.stringMatching(/took none of this stream's messages/) });
    expect(released()).toBe(1);
    expect(signal?.aborted).toBe(true);
    expect(returned).toBe(true);
    // Nor does it take the status: the stream is reset (gRPC clients report RESOURCE_EXHAUSTED).
    await vi.advanceTimersByTimeAsync(1_000);
    expect(seen.rstCode).toBe(http2Constants.NGHTTP2_ENHANCE_YOUR_CALM);
    expect(call.cancelled).toBe(true);
    expect([seen.taken, seen.sent, released()]).toEqual([3, undefined, 1]);
  });

  it('serverStream_whoseHandlerFailsBehindMessagesItsClientDoesNotTake_isResetOnceTheClientTookNoneForTheStallBound', async () => {
    vi.useFakeTimers();
    const { guard, released } = countingGuard();
    const h = echo(
      {
        async *echoServerStream() {
          yield { message: 'a', index: 0 };
          yield { message: 'b', index: 1 };
          throw new ForkfleetError('unavailable', "the store's event stream broke off");
        },
      },
      guard,
    );
    const { call, seen } = http2Call();
    h.echoServerStream!(call);
    await vi.advanceTimersByTimeAsync(59_000);
    // Answered with the handler's error, queued behind the 2 messages; its slot given back.
    expect(seen.answered).toMatchObject({ code: Status.UNAVAILABLE });
    expect([released(), seen.rstCode, call.cancelled]).toEqual([1, undefined, false]);
    await vi.advanceTimersByTimeAsync(1_000);
    expect(seen.rstCode).toBe(http2Constants.NGHTTP2_ENHANCE_YOUR_CALM);
    expect(call.cancelled).toBe(true);
  });

  it('serverStream_whoseClientReadsSlowlyButTakesAMessageWithinEachStallBound_getsEveryMessageAndTheHandlersErrorWhole', async () => {
    vi.useFakeTimers();
    const { guard, released } = countingGuard();
    let aborted: boolean | undefined;
    const h = echo(
      {
        async *echoServerStream(_req: EchoRequest, ctx: CallContext) {
          for (let i = 0; i < 40; i++) yield { message: 'event', index: i };
          aborted = ctx.signal.aborted;
          throw new ForkfleetError('resource_exhausted', '4096 events wait unread: resume with after_revision 7');
        },
      },
      guard,
    );
    const { call, seen, take } = http2Call();
    h.echoServerStream!(call);
    // One message every 50 s: 40 minutes for the 40, each within the 60 s bound.
    for (let i = 0; i < 40; i++) {
      await vi.advanceTimersByTimeAsync(50_000);
      expect(seen.rstCode).toBeUndefined();
      take(1);
    }
    await vi.advanceTimersByTimeAsync(0);
    expect(seen.taken).toBe(40);
    expect(seen.sent).toMatchObject({ code: Status.RESOURCE_EXHAUSTED, details: expect.stringMatching(/after_revision 7/) });
    expect([seen.rstCode, aborted, released()]).toEqual([undefined, false, 1]);
  });
});

describe('a call answered before its deadline', () => {
  it('unaryAndClientStreamingCalls_answeredBeforeTheirDeadline_leaveNoDeadlineTimerBehind', async () => {
    vi.useFakeTimers();
    const h = echo({
      echo: async (req: EchoRequest) => ({ message: req.message }),
      async echoClientStream(reqs: AsyncIterable<EchoRequest>) {
        let n = 0;
        for await (const _ of reqs) n++;
        return { index: n };
      },
    });
    // A client's deadline an hour away (some set a day): the call is answered at once.
    const hour = Date.now() + 3_600_000;
    expect(await answer(h, 'echo', Object.assign(new EventEmitter(), { request: request({ message: 'hi' }), ...surface(hour) }))).toBeNull();
    expect(vi.getTimerCount()).toBe(0);
    const upload = Object.assign(new Readable({ objectMode: true, read() {} }), surface(hour));
    upload.push(request({ message: 'a' }));
    upload.push(null);
    expect(await answer(h, 'echoClientStream', upload)).toBeNull();
    expect(vi.getTimerCount()).toBe(0);
  });
});

describe('a long poll whose credential is revoked', () => {
  it('longPoll_whoseCredentialIsRevoked_isAnsweredUnauthenticated_itsHandlerCancelled_andItsSlotGivenBackOnce', async () => {
    let revoke: ((err: Error) => void) | undefined;
    let released = 0;
    const guard: CallGuard = { admit: () => ({ principal: { tenantId: 't1', admin: false, credentialId: 'c1' }, release: () => void released++, onRevoke: (cb) => (revoke = cb) }) };
    let cancelled: unknown;
    const h = echo(
      {
        // A WaitOperation: waits until its operation ends, or its call does.
        echo: (_req: EchoRequest, ctx: CallContext) =>
          new Promise((resolve) =>
            ctx.signal.addEventListener('abort', () => {
              cancelled = ctx.signal.reason;
              resolve({ message: 'the operation as it is' });
            }),
          ),
      },
      guard,
    );
    const answered = answer(h, 'echo', Object.assign(new EventEmitter(), { request: request({}), ...surface(Infinity) }));
    await new Promise((r) => setTimeout(r, 10));
    revoke!(new UnauthenticatedError('credential revoked: its token is no longer in the tokens file'));
    expect(await Promise.race([answered, new Promise((r) => setTimeout(() => r('still waiting'), 2000))])).toMatchObject({ code: Status.UNAUTHENTICATED, details: expect.stringMatching(/credential revoked/) });
    expect(cancelled).toBeInstanceOf(UnauthenticatedError);
    await new Promise((r) => setTimeout(r, 10));
    expect(released).toBe(1);
  });
});
