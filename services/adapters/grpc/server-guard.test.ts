// The guard of a gRPC server admits each call from its headers, before grpc-js reads its
// request: over real HTTP/2 on loopback, with a raw node:http2 client that sends a request's
// headers and only part of its message, as a caller that wants the server to buffer would.
import { afterEach, describe, expect, it } from 'vitest';
import { connect } from 'node:http2';
import type { ClientHttp2Session, IncomingHttpHeaders } from 'node:http2';
import { credentials, makeGenericClientConstructor, status as Status } from '@grpc/grpc-js';
import type { Client as RawClient, ServiceError } from '@grpc/grpc-js';
import { service as healthService } from 'grpc-health-check';
import { createClient, register } from './rpc.ts';
import type { CallContext, CallGuard } from './rpc.ts';
import { MAX_CONCURRENT_STREAMS, startGrpcServer } from './server.ts';
import type { RunningGrpcServer } from './server.ts';
import { ApiGuard } from '../../auth/guard.ts';
import { Authenticator } from '../../auth/tokens.ts';
import { UnauthenticatedError } from '../../auth/errors.ts';
import { EchoService } from '../../../proto/gen/forkfleet/testing/v1/echo_pb.ts';
import type { EchoRequest } from '../../../proto/gen/forkfleet/testing/v1/echo_pb.ts';

const ECHO = '/forkfleet.testing.v1.EchoService/Echo';
const ECHO_SERVER_STREAM = '/forkfleet.testing.v1.EchoService/EchoServerStream';

const cleanups: Array<() => unknown> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

/** EchoService on loopback behind `guard`; the echo answers with the caller's tenant. */
async function serve(guard: CallGuard): Promise<RunningGrpcServer> {
  const server = await startGrpcServer({
    address: '127.0.0.1:0',
    guard,
    services: [
      register(EchoService, {
        async echo(req: EchoRequest, ctx: CallContext) {
          return { message: `${ctx.principal?.tenantId}:${req.message}` };
        },
        async *echoServerStream(req: EchoRequest, ctx: CallContext) {
          for (let i = 0; i < req.repeat; i++) yield { message: `${ctx.principal?.tenantId}:${req.message}`, index: i };
        },
        async echoClientStream() {
          return { message: '', index: 0 };
        },
        async *echoBidi() {},
      }),
    ],
  });
  cleanups.push(() => server.close(100));
  return server;
}

async function session(address: string): Promise<ClientHttp2Session> {
  const s = connect(`http://${address}`);
  s.on('error', () => undefined);
  cleanups.push(() => s.destroy());
  await new Promise<void>((resolve) => s.once('remoteSettings', () => resolve()));
  return s;
}

/**
 * Opens a call whose message announces 1 MiB, of which 1,000 bytes are sent, and never ends
 * it: the grpc-status the server answers with, or 'none' after `withinMs`. `reset` resets the
 * stream (the client goes away mid-request).
 */
function partialCall(s: ClientHttp2Session, path: string, authorization?: string): { answer: (withinMs: number) => Promise<string>; reset: () => void } {
  const stream = s.request({ ':method': 'POST', ':path': path, 'content-type': 'application/grpc', te: 'trailers', ...(authorization ? { authorization } : {}) }, { endStream: false });
  stream.on('error', () => undefined);
  let status: string | undefined;
  let told: (() => void) | undefined;
  const note = (h: IncomingHttpHeaders): void => {
    const st = h['grpc-status'];
    if (st !== undefined && status === undefined) {
      status = String(st);
      told?.();
    }
  };
  stream.on('response', note);
  stream.on('trailers', note);
  stream.resume();
  const prefix = Buffer.from([0, 0x00, 0x10, 0x00, 0x00]); // not compressed, 1 MiB
  stream.write(Buffer.concat([prefix, Buffer.alloc(1000, 0x0a)]));
  return {
    answer: (withinMs) =>
      new Promise((resolve) => {
        if (status !== undefined) return resolve(status);
        const t = setTimeout(() => resolve('none'), withinMs);
        told = () => {
          clearTimeout(t);
          resolve(status!);
        };
      }),
    reset: () => stream.close(),
  };
}

function apiGuard(maxStreamsPerCredential = 8): { guard: ApiGuard; token: string } {
  const auth = new Authenticator('', undefined);
  const token = auth.addEphemeral('acme', false, 'test');
  return { guard: new ApiGuard(auth, { maxStreamsPerCredential }), token };
}

describe('the API guard at the gRPC edge', () => {
  it('callWithoutCredentials_isAnsweredUnauthenticatedFromItsHeaders_beforeItsRequestArrives_andConnectionsAreCappedInStreams', async () => {
    const server = await serve(apiGuard().guard);
    const s = await session(server.address);
    expect(s.remoteSettings.maxConcurrentStreams).toBe(MAX_CONCURRENT_STREAMS);
    // Unary and server-streaming handlers run only once the whole request has arrived: the
    // guard answers before, not after the client sent (and the server buffered) its 1 MiB.
    for (const path of [ECHO, ECHO_SERVER_STREAM]) {
      expect(await partialCall(s, path).answer(1000), path).toBe(String(Status.UNAUTHENTICATED));
      expect(await partialCall(s, path, 'Bearer ff_not-a-token').answer(1000), path).toBe(String(Status.UNAUTHENTICATED));
    }
  });

  it('streamOverItsCredentialsCap_isRefusedFromItsHeaders_andOneWhoseClientLeftMidRequest_givesItsSlotBack', async () => {
    const { guard, token } = apiGuard(1);
    const server = await serve(guard);
    const s = await session(server.address);
    // Admitted from its headers: it holds the credential's one stream while its request arrives.
    const first = partialCall(s, ECHO_SERVER_STREAM, `Bearer ${token}`);
    expect(await first.answer(200)).toBe('none');
    expect(await partialCall(s, ECHO_SERVER_STREAM, `Bearer ${token}`).answer(1000)).toBe(String(Status.RESOURCE_EXHAUSTED));
    // Its client goes away before its handler ever ran: the slot is given back.
    first.reset();
    const client = createClient(EchoService, server.address);
    cleanups.push(() => client.close());
    await expect
      .poll(async () => {
        const got: string[] = [];
        try {
          for await (const m of client.echoServerStream({ message: 'hi', repeat: 2 }, { metadata: { authorization: `Bearer ${token}` } })) got.push(m.message);
        } catch (e) {
          return (e as Error).message;
        }
        return got;
      }, { timeout: 3000, interval: 50 })
      .toEqual(['acme:hi', 'acme:hi']);
  });

  it('admittedCalls_reachTheirHandlerAsTheirPrincipal_admittedOnce_andHealthStaysOpenWithoutCredentials', async () => {
    const { guard: real, token } = apiGuard();
    let admits = 0;
    const guard: CallGuard = { admit: (call) => (admits++, real.admit(call)) };
    const server = await serve(guard);
    const client = createClient(EchoService, server.address);
    cleanups.push(() => client.close());
    const md = { metadata: { authorization: `Bearer ${token}` } };
    expect((await client.echo({ message: 'a' }, md)).message).toBe('acme:a');
    const streamed: string[] = [];
    for await (const m of client.echoServerStream({ message: 'b', repeat: 3 }, md)) streamed.push(m.message);
    expect(streamed).toEqual(['acme:b', 'acme:b', 'acme:b']);
    expect(admits).toBe(2);
    await expect(client.echo({ message: 'c' })).rejects.toMatchObject({ code: Status.UNAUTHENTICATED });
    type HealthClient = RawClient & { check(req: { service: string }, cb: (err: ServiceError | null, res?: { status: string }) => void): void };
    const Health = makeGenericClientConstructor(healthService as never, 'Health') as unknown as new (address: string, creds: ReturnType<typeof credentials.createInsecure>) => HealthClient;
    const health = new Health(server.address, credentials.createInsecure());
    cleanups.push(() => health.close());
    expect(await new Promise((resolve, reject) => health.check({ service: '' }, (err, res) => (err ? reject(err) : resolve(res!.status))))).toBe('SERVING');
  });

  it('credentialRevokedWhileItsRequestStillArrives_endsTheCallUnauthenticated_andReleasesItOnce', async () => {
    let revoke: ((err: Error) => void) | undefined;
    let released = 0;
    const guard: CallGuard = { admit: () => ({ principal: { tenantId: 'acme', admin: false, credentialId: 'c1' }, release: () => void released++, onRevoke: (cb) => (revoke = cb) }) };
    const server = await serve(guard);
    const s = await session(server.address);
    const call = partialCall(s, ECHO_SERVER_STREAM, 'Bearer any');
    expect(await call.answer(200)).toBe('none');
    revoke!(new UnauthenticatedError('credential revoked: its token is no longer in the tokens file'));
    expect(await call.answer(1000)).toBe(String(Status.UNAUTHENTICATED));
    await expect.poll(() => released, { timeout: 1000, interval: 10 }).toBe(1);
    await new Promise((r) => setTimeout(r, 50));
    expect(released).toBe(1);
  });
});
