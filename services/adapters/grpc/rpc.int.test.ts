import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { credentials, status as Status } from '@grpc/grpc-js';
import { HealthImplementation } from 'grpc-health-check';
import { EchoService } from '../../../proto/gen/forkfleet/testing/v1/echo_pb.ts';
import type { EchoRequest } from '../../../proto/gen/forkfleet/testing/v1/echo_pb.ts';
import { ForkfleetError, InvalidArgumentError } from '../../../proto/errors.ts';
import type { ErrorKind } from '../../../proto/errors.ts';
import { createClient, register } from './rpc.ts';
import { waitFor } from '../../testkit/proc.ts';
import type { Client, CallContext } from './rpc.ts';
import { AsyncQueue } from './queue.ts';
import { RpcError } from './status.ts';
import { startGrpcServer } from './server.ts';
import type { RunningGrpcServer } from './server.ts';

function maybeFail(req: EchoRequest): void {
  if (req.failWith === 'invalid_argument') throw new InvalidArgumentError('message', 'must not be empty');
  if (req.failWith === 'plain') throw new Error('secret internal detail');
  if (req.failWith) throw new ForkfleetError(req.failWith as ErrorKind, `failed with ${req.failWith}`);
}

function delay(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    const t = setTimeout(resolve, ms);
    signal.addEventListener('abort', () => {
      clearTimeout(t);
      reject(signal.reason);
    });
  });
}

describe('gRPC adapter: protobuf-es services on grpc-js', () => {
  let server: RunningGrpcServer;
  let client: Client<(typeof EchoService)['method']>;
  const cancelledOnServer: string[] = [];
  const clientStreamsSettled: string[] = [];
  const errorsSeen: unknown[] = [];

  beforeAll(async () => {
    server = await startGrpcServer({
      address: '127.0.0.1:0',
      onError: (e) => errorsSeen.push(e),
      services: [
        register(EchoService, {
          async echo(req: EchoRequest, ctx: CallContext) {
            maybeFail(req);
            if (req.delayMs) {
              try {
                await delay(req.delayMs, ctx.signal);
              } catch (e) {
                cancelledOnServer.push(req.message);
                throw e;
              }
            }
            return { message: req.message };
          },
          async *echoServerStream(req: EchoRequest) {
            maybeFail(req);
            for (let i = 0; i < req.repeat; i++) yield { message: req.message, index: i };
          },
          async echoClientStream(reqs: AsyncIterable<EchoRequest>) {
            const parts: string[] = [];
            try {
              for await (const r of reqs) {
                maybeFail(r);
                parts.push(r.message);
              }
            } finally {
              // What a handler holds for the stream (an upload's pieces) is let go on every path.
              clientStreamsSettled.push(parts.join('+'));
            }
            return { message: parts.join('+'), index: parts.length };
          },
          async *echoBidi(reqs: AsyncIterable<EchoRequest>) {
            let i = 0;
            const seen: string[] = [];
            try {
              for await (const r of reqs) {
                maybeFail(r);
                seen.push(r.message);
                yield { message: r.message.toUpperCase(), index: i++ };
              }
            } finally {
              clientStreamsSettled.push(seen.join('+'));
            }
          },
        }),
      ],
    });
    client = createClient(EchoService, server.address);
  });

  afterAll(async () => {
    client?.close();
    await server?.close();
  });

  it('unary_roundTrip_returnsTypedMessage', async () => {
    const res = await client.echo({ message: 'hi' });
    expect(res.$typeName).toBe('forkfleet.testing.v1.EchoResponse');
    expect(res.message).toBe('hi');
  });

  it('serverStream_roundTrip_yieldsEveryMessageInOrder', async () => {
    const got: number[] = [];
    for await (const r of client.echoServerStream({ message: 'x', repeat: 5 })) got.push(r.index);
    expect(got).toEqual([0, 1, 2, 3, 4]);
  });

  it('clientStream_roundTrip_receivesAllRequests', async () => {
    const res = await client.echoClientStream([{ message: 'a' }, { message: 'b' }, { message: 'c' }]);
    expect(res.message).toBe('a+b+c');
    expect(res.index).toBe(3);
  });

  it('bidi_roundTrip_answersEachRequestAsItArrives', async () => {
    const q = new AsyncQueue<{ message: string }>();
    const replies: string[] = [];
    q.push({ message: 'first' });
    for await (const r of client.echoBidi(q)) {
      replies.push(r.message);
      if (replies.length === 1) q.push({ message: 'second' }); // sent only after the first reply
      else q.end();
    }
    expect(replies).toEqual(['FIRST', 'SECOND']);
  });

  it('namedError_invalidArgument_arrivesAsInvalidArgumentWithField', async () => {
    const err = await client.echo({ message: '', failWith: 'invalid_argument' }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(RpcError);
    const e = err as RpcError;
    expect(e.code).toBe(Status.INVALID_ARGUMENT);
    expect(e.kind).toBe('invalid_argument');
    expect(e.field).toBe('message');
    expect(e.message).toContain('message: must not be empty');
  });

  it.each([
    ['not_found', Status.NOT_FOUND],
    ['resource_exhausted', Status.RESOURCE_EXHAUSTED],
    ['failed_precondition', Status.FAILED_PRECONDITION],
    ['unavailable', Status.UNAVAILABLE],
    ['aborted', Status.ABORTED],
    ['unauthenticated', Status.UNAUTHENTICATED],
  ] as const)('namedError_%s_mapsToStatus_andSaysTheServerAnswered', async (kind, code) => {
    const e = (await client.echo({ message: 'x', failWith: kind }).catch((x: unknown) => x)) as RpcError;
    expect(e.code).toBe(code);
    expect(e.kind).toBe(kind);
    expect(e.answered).toBe(true);
  });

  it('noServerAtTheAddress_isUnavailableThatNoServerAnswered', async () => {
    const nowhere = createClient(EchoService, '127.0.0.1:1');
    try {
      const e = (await nowhere.echo({ message: 'x' }, { timeoutMs: 2000 }).catch((x: unknown) => x)) as RpcError;
      expect([e.code, e.kind, e.answered]).toEqual([Status.UNAVAILABLE, 'unavailable', false]);
    } finally {
      nowhere.close();
    }
  });

  it('namedError_inServerStream_arrivesAsStatus', async () => {
    const it = client.echoServerStream({ message: 'x', repeat: 2, failWith: 'not_found' });
    const err = await (async () => {
      for await (const _ of it) {
        /* none */
      }
    })().catch((e: unknown) => e);
    expect((err as RpcError).code).toBe(Status.NOT_FOUND);
  });

  it('unnamedError_becomesInternalWithoutLeakingDetail', async () => {
    const e = (await client.echo({ message: 'x', failWith: 'plain' }).catch((x: unknown) => x)) as RpcError;
    expect(e.code).toBe(Status.INTERNAL);
    expect(e.message).not.toContain('secret');
    expect(errorsSeen.some((x) => x instanceof Error && x.message === 'secret internal detail')).toBe(true);
  });

  it('namedErrorOfKindInternal_isSentWithAGenericMessage_itsDetailOnlyLogged', async () => {
    const e = (await client.echo({ message: 'x', failWith: 'internal' }).catch((x: unknown) => x)) as RpcError;
    expect([e.code, e.kind, e.message]).toEqual([Status.INTERNAL, 'internal', 'internal error']);
    expect(errorsSeen.some((x) => x instanceof Error && x.message === 'failed with internal')).toBe(true);
  });

  it('deadline_whenServerIsSlow_failsWithDeadlineExceededAndCancelsHandler', async () => {
    const e = (await client.echo({ message: 'slow', delayMs: 2000 }, { timeoutMs: 100 }).catch((x: unknown) => x)) as RpcError;
    expect(e.code).toBe(Status.DEADLINE_EXCEEDED);
    expect(e.kind).toBe('deadline_exceeded');
    await new Promise((r) => setTimeout(r, 200));
    expect(cancelledOnServer).toContain('slow');
  });

  it('abortSignal_cancelsCallOnBothSides', async () => {
    const ac = new AbortController();
    const p = client.echo({ message: 'aborted', delayMs: 2000 }, { signal: ac.signal }).catch((x: unknown) => x);
    setTimeout(() => ac.abort(), 50);
    const e = (await p) as RpcError;
    expect(e.code).toBe(Status.CANCELLED);
    await new Promise((r) => setTimeout(r, 200));
    expect(cancelledOnServer).toContain('aborted');
  });

  it('close_cancelsTheCallsInFlight_aSlowUnaryAndAnOpenBidiStream', async () => {
    const own = createClient(EchoService, server.address);
    const slow = own.echo({ message: 'closed-slow', delayMs: 5000 }).catch((x: unknown) => x);
    // A stream whose requests never end: the server waits on it until the client goes.
    let endRequests: () => void = () => undefined;
    const requests = (async function* () {
      yield { message: 'first' };
      await new Promise<void>((r) => (endRequests = r));
    })();
    const stream = own.echoBidi(requests)[Symbol.asyncIterator]();
    expect((await stream.next()).value).toMatchObject({ message: 'FIRST' });
    const next = stream.next().catch((x: unknown) => x);
    await new Promise((r) => setTimeout(r, 50));
    const t0 = Date.now();
    own.close();
    expect(((await slow) as RpcError).code).toBe(Status.CANCELLED);
    expect(((await next) as RpcError).code).toBe(Status.CANCELLED);
    expect(Date.now() - t0).toBeLessThan(1000);
    endRequests();
    await new Promise((r) => setTimeout(r, 200));
    expect(cancelledOnServer).toContain('closed-slow');
  });

  it('bidiStream_whoseClientGoesAwayMidStream_endsTheHandlersLoop_soItsFinallyRuns', async () => {
    const ac = new AbortController();
    let more: () => void = () => undefined;
    const reqs = (async function* () {
      yield { message: 'bidi-gone-1' };
      await new Promise<void>((r) => (more = r));
    })();
    const it = client.echoBidi(reqs, { signal: ac.signal })[Symbol.asyncIterator]();
    expect((await it.next()).value).toMatchObject({ message: 'BIDI-GONE-1' });
    ac.abort();
    await it.next().catch(() => undefined);
    await waitFor('the handler let go', async () => clientStreamsSettled.includes('bidi-gone-1'), 5_000, 20);
    more();
  });

  it('clientStream_whoseClientGoesAwayMidStream_endsTheHandlersLoop_soItsFinallyRuns', async () => {
    const ac = new AbortController();
    let more: () => void = () => undefined;
    const reqs = (async function* () {
      yield { message: 'gone-1' };
      await new Promise<void>((r) => (more = r));
      yield { message: 'never' };
    })();
    const call = client.echoClientStream(reqs, { signal: ac.signal }).catch((x: unknown) => x);
    await new Promise((r) => setTimeout(r, 100));
    ac.abort();
    expect(((await call) as RpcError).code).toBe(Status.CANCELLED);
    await waitFor('the handler let go', async () => clientStreamsSettled.includes('gone-1'), 5_000, 20);
    more();
  });

  it('health_reportsServingForTheService', async () => {
    const { service: healthService } = await import('grpc-health-check');
    const { makeGenericClientConstructor } = await import('@grpc/grpc-js');
    const Ctor = makeGenericClientConstructor(healthService, 'Health');
    const hc = new Ctor(server.address, credentials.createInsecure()) as unknown as {
      check(req: { service: string }, cb: (err: Error | null, res: { status: string }) => void): void;
      close(): void;
    };
    const res = await new Promise<{ status: string }>((resolve, reject) =>
      hc.check({ service: 'forkfleet.testing.v1.EchoService' }, (err, r) => (err ? reject(err) : resolve(r))),
    );
    hc.close();
    expect(res.status).toBe('SERVING');
    expect(server.health).toBeInstanceOf(HealthImplementation);
  });

  it('reflection_letsBufCurlListAndCallMethods', async () => {
    const { execFile } = await import('node:child_process');
    const { promisify } = await import('node:util');
    const run = promisify(execFile);
    const base = ['curl', '--protocol', 'grpc', '--http2-prior-knowledge'];
    const list = await run('npx', ['buf', ...base, '--list-methods', `http://${server.address}`]);
    expect(list.stdout).toContain('forkfleet.testing.v1.EchoService/Echo');
    const call = await run('npx', ['buf', ...base, '-d', '{"message":"via buf"}', `http://${server.address}/forkfleet.testing.v1.EchoService/Echo`]);
    expect(JSON.parse(call.stdout)).toEqual({ message: 'via buf' });
  });
});

describe('a server stream that ends in an error while its client reads slowly', () => {
  it('handlerError_afterMessagesASlowClientHasYetToRead_reachesItAsTheStatus_notAsAReset', async () => {
    // 20 messages of 60 KB, more than the client takes in ahead of its reads (its HTTP/2
    // window and its stream's buffer, ~10 of them here), then the handler's error; the client
    // takes its first 2 2.5 s apart, slower than rpc.ts's reset of a stalled ended call.
    const server = await startGrpcServer({
      address: '127.0.0.1:0',
      services: [
        register(EchoService, {
          async echo() {
            return {};
          },
          async *echoServerStream(req: EchoRequest) {
            for (let i = 0; i < req.repeat; i++) yield { message: req.message, index: i };
            throw new ForkfleetError('resource_exhausted', 'events wait unread: resume from where you read');
          },
          async echoClientStream() {
            return {};
          },
          async *echoBidi() {},
        }),
      ],
    });
    const slow = createClient(EchoService, server.address);
    try {
      const got: number[] = [];
      const err = await (async () => {
        for await (const m of slow.echoServerStream({ message: 'x'.repeat(60_000), repeat: 20 })) {
          got.push(m.index);
          if (got.length <= 2) await new Promise((r) => setTimeout(r, 2500));
        }
      })().catch((e: unknown) => e);
      // Read in order past the slow ones; a grpc-js client hands over the status when it
      // arrives, so the last messages it had not yet taken in may be missing (a WatchEvents
      // client resumes from the revision it read: nothing is lost to it).
      expect(got.length).toBeGreaterThan(2);
      expect(got).toEqual([...Array(got.length).keys()]);
      expect(err).toMatchObject({ kind: 'resource_exhausted', retryable: true });
    } finally {
      slow.close();
      await server.close();
    }
  }, 30_000);
});
