// What a call holds on the server, and for how long: the bridge's side of a grpc-js call
// (rpc.ts), given calls shaped as grpc-js hands them to a handler.
import { afterEach, describe, expect, it, vi } from 'vitest';
import { EventEmitter } from 'node:events';
import { Readable, Writable } from 'node:stream';
import { create, toBinary } from '@bufbuild/protobuf';
import type { MessageInitShape } from '@bufbuild/protobuf';
import { Metadata, status as Status } from '@grpc/grpc-js';
import { grpcHandlers, register } from './rpc.ts';
import type { CallContext, CallGuard } from './rpc.ts';
import { UnauthenticatedError } from '../../auth/errors.ts';
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
