// A small typed bridge between protobuf-es v2 service descriptors and @grpc/grpc-js:
// serialise with toBinary/fromBinary, route by `/${service.typeName}/${method.name}`, and
// present the four call kinds as promises and async iterables, with deadlines and
// cancellation. Generated types stop here and in the per-service convert.ts files.
import { constants as http2Constants } from 'node:http2';
import { Client as GrpcClient, Metadata, ServerInterceptingCall, credentials as grpcCredentials } from '@grpc/grpc-js';
import type {
  CallOptions as GrpcCallOptions,
  ChannelCredentials,
  ClientDuplexStream,
  ClientOptions,
  ClientReadableStream,
  ClientWritableStream,
  MethodDefinition,
  ServerDuplexStream,
  ServerInterceptor,
  ServerReadableStream,
  ServerUnaryCall,
  ServerWritableStream,
  ServiceDefinition,
  ServiceError,
  sendUnaryData,
} from '@grpc/grpc-js';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import type { DescMethod, DescService, MessageInitShape, MessageShape } from '@bufbuild/protobuf';
import type { GenService, GenServiceMethods } from '@bufbuild/protobuf/codegenv2';
import { fromServiceError, toGrpcStatus } from './status.ts';
import { readableItems } from './queue.ts';
import { ForkfleetError, InvalidArgumentError } from '../../../proto/errors.ts';
import type { Principal } from '../../auth/tokens.ts';
import type { PeerCertificate } from 'node:tls';

type MethodShape = GenServiceMethods[string];
type In<M extends MethodShape> = MessageShape<M['input']>;
type InInit<M extends MethodShape> = MessageInitShape<M['input']>;
type Out<M extends MethodShape> = MessageShape<M['output']>;
type OutInit<M extends MethodShape> = MessageInitShape<M['output']>;

/** What a handler knows about its call. */
export interface CallContext {
  /**
   * Aborted when the client cancels, disconnects or its deadline passes; on a streaming call
   * also when its client took none of its messages for STREAM_STALL_MS (a client that stopped
   * reading): the call is answered RESOURCE_EXHAUSTED then, and this is the reason.
   */
  readonly signal: AbortSignal;
  readonly deadline: Date | undefined;
  readonly metadata: Metadata;
  readonly peer: string;
  readonly method: string;
  /** Who is calling, when the server has a CallGuard; undefined on an unguarded server. */
  readonly principal: Principal | undefined;
  /**
   * The client's TLS certificate, on a server that asks for one (mutual TLS). A call, not a
   * field: grpc-js builds the certificate object anew on each ask, and most handlers never do.
   */
  peerCertificate(): PeerCertificate | undefined;
  /**
   * Streaming calls only (undefined on unary ones): ends the call now with `err` as its status,
   * also while its writes wait for a client that takes nothing (its HTTP/2 window full: the
   * handler is then paused at a `yield`, and no check of its own runs). The handler's iteration
   * is returned at that `yield` (its finally blocks run); a handler waiting on anything else
   * must stop itself as well. A status the client does not take either is followed by a reset
   * (failStreaming).
   */
  readonly end?: (err: unknown) => void;
}

/**
 * Runs before every handler of a guarded server (authentication, rate and stream limits).
 * Throws to refuse the call; `release` (for streaming calls) runs once when the call ends.
 * `onRevoke` (streaming calls and long polls) registers what ends the call when its credential is revoked.
 */
export interface CallGuard {
  admit(call: { metadata: Metadata; method: string; streaming: boolean; peer: string }): { principal: Principal; release?: () => void; onRevoke?: (cb: (err: Error) => void) => void };
}

export type Handler<M extends MethodShape> = M['methodKind'] extends 'unary'
  ? (req: In<M>, ctx: CallContext) => Promise<OutInit<M>>
  : M['methodKind'] extends 'server_streaming'
    ? (req: In<M>, ctx: CallContext) => AsyncIterable<OutInit<M>>
    : M['methodKind'] extends 'client_streaming'
      ? (reqs: AsyncIterable<In<M>>, ctx: CallContext) => Promise<OutInit<M>>
      : (reqs: AsyncIterable<In<M>>, ctx: CallContext) => AsyncIterable<OutInit<M>>;

export type ServiceImpl<S extends GenServiceMethods> = { [K in keyof S]: Handler<S[K]> };

export interface CallOptions {
  /** Relative deadline. */
  timeoutMs?: number;
  deadline?: Date;
  /** Aborting cancels the call; the caller sees a `cancelled` error. */
  signal?: AbortSignal;
  metadata?: Record<string, string>;
}

export type ClientMethod<M extends MethodShape> = M['methodKind'] extends 'unary'
  ? (req: InInit<M>, opts?: CallOptions) => Promise<Out<M>>
  : M['methodKind'] extends 'server_streaming'
    ? (req: InInit<M>, opts?: CallOptions) => AsyncIterable<Out<M>>
    : M['methodKind'] extends 'client_streaming'
      ? (reqs: AsyncIterable<InInit<M>> | Iterable<InInit<M>>, opts?: CallOptions) => Promise<Out<M>>
      : (reqs: AsyncIterable<InInit<M>> | Iterable<InInit<M>>, opts?: CallOptions) => AsyncIterable<Out<M>>;

export type Client<S extends GenServiceMethods> = { [K in keyof S]: ClientMethod<S[K]> } & {
  /** Closes the channel. Calls in flight are cancelled. */
  close(): void;
};

/** A service and its implementation, type-checked together, then erased for the server. */
export interface ServiceRegistration {
  readonly service: DescService;
  readonly definition: ServiceDefinition;
  readonly handlers: Record<string, (...args: never[]) => unknown>;
}

export type ErrorHook = (err: unknown, method: string) => void;

export function methodPath(m: DescMethod): string {
  return `/${m.parent.typeName}/${m.name}`;
}

/**
 * A request whose bytes did not parse. grpc-js would answer INTERNAL for a throwing
 * deserializer; instead the handler wrapper answers INVALID_ARGUMENT (the client sent bad
 * bytes, the server is fine).
 */
class Undecodable {
  constructor(readonly error: unknown) {}
}

/**
 * A request's bytes as grpc-js hands them over (requestDeserialize): parsed only once the call
 * is admitted (decodeRequest), so an unauthenticated or rate-limited caller's body is never
 * decoded (a 4 MiB body of packed zeros is a 4-million-element array).
 */
class Encoded {
  constructor(readonly bytes: Buffer) {}
}

function decodeRequest(m: DescMethod, x: unknown): unknown {
  if (!(x instanceof Encoded)) return x;
  try {
    return fromBinary(m.input, x.bytes);
  } catch (e) {
    return new Undecodable(e);
  }
}

function undecodableError(u: Undecodable): InvalidArgumentError {
  return new InvalidArgumentError('request', `not a valid encoding: ${u.error instanceof Error ? u.error.message : String(u.error)}`);
}

/** Request stream items, decoded as they are read, failing the iteration on an undecodable message. */
async function* decodedItems(m: DescMethod, items: AsyncIterable<unknown>): AsyncGenerator<unknown> {
  for await (const item of items) {
    const decoded = decodeRequest(m, item);
    if (decoded instanceof Undecodable) throw undecodableError(decoded);
    yield decoded;
  }
}

function methodDefinition(m: DescMethod): MethodDefinition<unknown, unknown> {
  return {
    path: methodPath(m),
    requestStream: m.methodKind === 'client_streaming' || m.methodKind === 'bidi_streaming',
    responseStream: m.methodKind === 'server_streaming' || m.methodKind === 'bidi_streaming',
    requestSerialize: (v: unknown) => Buffer.from(toBinary(m.input, create(m.input, v as MessageInitShape<typeof m.input>))),
    requestDeserialize: (b: Buffer) => new Encoded(b),
    responseSerialize: (v: unknown) => Buffer.from(toBinary(m.output, create(m.output, v as MessageInitShape<typeof m.output>))),
    responseDeserialize: (b: Buffer) => fromBinary(m.output, b),
    originalName: m.localName,
  };
}

/** The grpc-js service definition for a protobuf-es service descriptor. */
export function serviceDefinition(svc: DescService): ServiceDefinition {
  const def: Record<string, MethodDefinition<unknown, unknown>> = {};
  for (const m of svc.methods) def[m.localName] = methodDefinition(m);
  return def as ServiceDefinition;
}

export function register<S extends GenServiceMethods>(service: GenService<S>, impl: ServiceImpl<S>): ServiceRegistration {
  return {
    service,
    definition: serviceDefinition(service),
    handlers: impl as unknown as Record<string, (...args: never[]) => unknown>,
  };
}

type AnyServerCall =
  | ServerUnaryCall<unknown, unknown>
  | ServerReadableStream<unknown, unknown>
  | ServerWritableStream<unknown, unknown>
  | ServerDuplexStream<unknown, unknown>;

/**
 * The handler's context, and `done`: called when the handler has settled. The deadline's timer
 * is cleared then, or when the call ends first (grpc-js emits 'cancelled' after every status
 * too); it would otherwise hold the call's context until the client's deadline (hours, for
 * some clients) after the call was answered. `ended`: aborted by the context's `end` (a
 * streaming call's; never aborted for a unary one). `cancel`: aborts the context's signal with
 * `reason` (a call the server ends itself: a client that stopped reading).
 */
function contextOf(call: AnyServerCall, method: string, principal?: Principal, revoked?: AbortSignal, streaming = false): { ctx: CallContext; done: () => void; ended: AbortSignal; cancel: (reason: unknown) => void } {
  const ac = new AbortController();
  const endAc = new AbortController();
  let t: NodeJS.Timeout | undefined;
  const done = (): void => clearTimeout(t);
  const cancel = (reason: unknown): void => {
    done();
    if (!ac.signal.aborted) ac.abort(reason);
  };
  const abort = (): void => {
    done();
    if (!ac.signal.aborted) ac.abort(new Error(`${method}: cancelled by client`));
  };
  const emitter = call as unknown as NodeJS.EventEmitter;
  emitter.once('cancelled', abort);
  revoked?.addEventListener('abort', () => ac.signal.aborted || ac.abort(revoked.reason), { once: true });
  const d = call.getDeadline();
  let deadline: Date | undefined;
  if (d instanceof Date) deadline = d;
  else if (typeof d === 'number' && Number.isFinite(d)) deadline = new Date(d);
  if (deadline) {
    const ms = deadline.getTime() - Date.now();
    t = setTimeout(abort, Math.max(0, ms));
    t.unref();
  }
  const ctx: CallContext = {
    signal: ac.signal,
    deadline,
    metadata: call.metadata,
    peer: call.getPeer(),
    method,
    principal,
    peerCertificate: () => call.getAuthContext().sslPeerCertificate,
    ...(streaming
      ? {
          end: (err: unknown): void => {
            if (!endAc.signal.aborted) endAc.abort(err);
          },
        }
      : {}),
  };
  return { ctx, done, ended: endAc.signal, cancel };
}

/**
 * Bytes of a streaming call's messages written and not yet sent (their write not done: the
 * client's HTTP/2 window is full) past which writeAll reads no more from the handler. grpc-js's
 * send buffer counts messages, not bytes (write() returns false at 16 of them): 16 Exec output
 * pieces of 512 KiB each would wait there, let go by the bus's count of unread output
 * (EXEC_UNREAD_MAX_BYTES), for each call whose client does not read.
 */
const UNSENT_MAX_BYTES = 1 << 20;

/**
 * About the bytes a message takes on the wire: its bytes and string fields, a few levels down
 * (a oneof's payload, a chunk's data), which are what make one large. Not the encoding itself:
 * a service may serialize its own way (the peer chunk server), and only when grpc-js sends.
 */
function approxBytes(v: unknown, depth = 0): number {
  if (typeof v === 'string') return v.length;
  if (v instanceof Uint8Array) return v.byteLength;
  if (typeof v !== 'object' || v === null || depth >= 4) return 0;
  let n = 0;
  for (const x of Array.isArray(v) ? (v as unknown[]) : Object.values(v)) n += approxBytes(x, depth + 1);
  return n;
}

/**
 * How long a streaming call's client may take none of its messages, while some wait for it,
 * before the call is ended (ClientProgress): answered RESOURCE_EXHAUSTED, its handler's signal
 * aborted and its iteration returned, its guard slot given back, and its HTTP/2 stream reset
 * (RST_STREAM ENHANCE_YOUR_CALM, which gRPC clients report as RESOURCE_EXHAUSTED) should the
 * client not take that status within STALLED_STATUS_MS either. A client that stopped reading
 * but stays connected (its HTTP/2 library answers pings) otherwise kept the call for good: its
 * stream, its guard slot (a tenant has 16 watch streams), what its handler holds for it (a
 * WatchEvents queue of up to 4,096 events, whose own RESOURCE_EXHAUSTED waited behind messages
 * the client never took) and up to UNSENT_MAX_BYTES unsent. A call answered already (its end,
 * or its handler's error, waiting behind what the client has yet to take) is reset after as long
 * without progress. A slow reader that takes a message within each such period is never cut off
 * (progress is counted in whole messages: a single message must go within it).
 */
const STREAM_STALL_MS = 60_000;

/**
 * How long a streaming call that was ended (ctx.end, a revoked credential) or stalled may go
 * without the client taking one of its messages before its HTTP/2 stream is reset. The status
 * goes out after the messages written before it, which a client that does not read (its window
 * full) never takes: the call, its stream and those messages (up to UNSENT_MAX_BYTES and
 * grpc-js's 16) stayed for as long as the connection did, pinged alive. Progress is counted in
 * whole messages: a client that reads less than one a second is reset too (it gets CANCELLED,
 * or RESOURCE_EXHAUSTED after a stall, not the status). A handler's own error, or its end, is
 * reset only after STREAM_STALL_MS without progress: a slow reader (a WatchEvents client behind,
 * told resource_exhausted to resume) must get it whole.
 */
const STALLED_STATUS_MS = 1_000;

/**
 * What the client of a streaming call has taken of its messages (a write is done once HTTP/2
 * has sent it, which it does not while the client's window is full), and the watch that calls
 * `stalled` once the client has taken none of them for `bound` ms while some wait:
 * STREAM_STALL_MS, or STALLED_STATUS_MS from `hasten` on. One timer, armed only while messages
 * wait, re-armed at most once per bound however many messages go; `stop` (the call is over)
 * clears it.
 */
class ClientProgress {
  /** Messages written and not yet taken. */
  private waiting = 0;
  /** When the client last took a message, or when the first of those waiting was written. */
  private since = 0;
  private bound = STREAM_STALL_MS;
  private timer: NodeJS.Timeout | undefined;

  constructor(
    private readonly call: { readonly cancelled: boolean },
    private readonly stalled: () => void,
  ) {}

  /** A message was handed to grpc-js. */
  written(): void {
    if (this.waiting++ === 0) this.since = performance.now();
    if (!this.timer) this.arm();
  }

  /** The client took a message (its write is done). */
  taken(): void {
    this.waiting = Math.max(0, this.waiting - 1);
    this.since = performance.now();
  }

  /** From now on the client must take a message within STALLED_STATUS_MS. */
  hasten(): void {
    this.bound = STALLED_STATUS_MS;
    this.since = performance.now();
    this.arm();
  }

  stop(): void {
    clearTimeout(this.timer);
    this.timer = undefined;
  }

  private arm(): void {
    this.stop();
    // grpc-js sets `cancelled` (and emits 'cancelled') once the status went out, or the call is gone.
    if (this.waiting === 0 || this.call.cancelled) return;
    this.timer = setTimeout(() => this.check(), Math.max(0, this.since + this.bound - performance.now()));
    this.timer.unref();
  }

  private check(): void {
    this.timer = undefined;
    if (this.waiting === 0 || this.call.cancelled) return;
    if (performance.now() - this.since < this.bound) this.arm();
    else this.stalled();
  }
}

/**
 * Writes what the handler yields, as the client takes it. Stops (and returns) once the call is
 * cancelled (its signal aborted: also when `progress` found the client stalled); throws
 * `ended`'s reason once the handler ended the call (ctx.end), also while it waits for the
 * client's window. `progress` is told of each write handed over and each the client took.
 */
async function writeAll(
  call: ServerWritableStream<unknown, unknown> | ServerDuplexStream<unknown, unknown>,
  out: AsyncIterable<unknown>,
  signal: AbortSignal,
  ended: AbortSignal,
  progress: ClientProgress,
): Promise<void> {
  let unsent = 0;
  let wake: (() => void) | undefined;
  for await (const msg of out) {
    if (signal.aborted) return;
    if (ended.aborted) throw ended.reason;
    const bytes = approxBytes(msg);
    unsent += bytes;
    progress.written();
    call.write(msg, () => {
      unsent -= bytes;
      progress.taken();
      wake?.();
    });
    while (call.writableNeedDrain || unsent > UNSENT_MAX_BYTES) {
      if (signal.aborted) return;
      if (ended.aborted) throw ended.reason;
      await new Promise<void>((resolve) => {
        const done = (): void => {
          wake = undefined;
          call.off('drain', done);
          signal.removeEventListener('abort', done);
          ended.removeEventListener('abort', done);
          resolve();
        };
        wake = done;
        call.on('drain', done);
        signal.addEventListener('abort', done);
        ended.addEventListener('abort', done);
      });
    }
  }
  if (ended.aborted && !signal.aborted) throw ended.reason;
}

/** Duck type of node:http2's ServerHttp2Stream (the module does not export the class). */
function isHttp2Stream(s: unknown): s is { closed: boolean; close(code?: number): void } {
  return typeof s === 'object' && s !== null && typeof (s as { close?: unknown }).close === 'function' && 'rstCode' in s && 'sentTrailers' in s;
}

/**
 * Resets a server call's HTTP/2 stream (RST_STREAM `code`, CANCEL unless told; grpc-js then
 * cancels the call, which frees its messages). grpc-js has no API for it: its call object keeps
 * the stream at `call.call(.nextCall)*.stream` (1.10 to 1.14). Not found there (another
 * grpc-js), the call is destroyed instead: its queued messages go, its stream stays until the
 * connection does.
 */
function resetStream(call: AnyServerCall, code: number = http2Constants.NGHTTP2_CANCEL): void {
  let c: unknown = (call as unknown as { call?: unknown }).call;
  for (let i = 0; i < 8 && typeof c === 'object' && c !== null; i++) {
    const s = (c as { stream?: unknown }).stream;
    if (isHttp2Stream(s)) {
      if (!s.closed) s.close(code);
      return;
    }
    c = (c as { nextCall?: unknown }).nextCall;
  }
  (call as unknown as { destroy(): void }).destroy();
}

/** A call the guard admitted: who calls, what gives back what it holds (once), and its revocation. */
interface Admission {
  principal: Principal | undefined;
  release: () => void;
  revoked: AbortSignal;
}

/** The guard's verdict as an Admission: a release that runs once, and a signal aborted by a revocation. */
function admissionOf(a: ReturnType<CallGuard['admit']>): Admission {
  const revoked = new AbortController();
  let done = false;
  const release = (): void => {
    if (done) return;
    done = true;
    a.release?.();
  };
  a.onRevoke?.((err) => revoked.abort(err));
  return { principal: a.principal, release, revoked: revoked.signal };
}

/**
 * Calls admitted by guardInterceptor from their headers, by the metadata grpc-js then hands
 * their handler (the same object), until the handler takes them (admitCall).
 */
const admittedFromHeaders = new WeakMap<Metadata, Admission>();

/**
 * Admits each call of `paths` through `guard` from its headers, before any of its messages is
 * read: grpc-js runs a unary or server-streaming handler only once the whole request arrived
 * (up to grpc.max_receive_message_length), so a guard run there let any caller, credentials or
 * none, have the server buffer that much per stream first. A refused call is answered with the
 * guard's status at once, its messages never read; an admitted one goes on to its handler,
 * which takes the admission (admitCall). Its release runs when the call ends, however it ends:
 * also when its handler never runs (a client gone mid-request). A credential revoked before the
 * handler took the call (a request still arriving) ends it here.
 */
export function guardInterceptor(guard: CallGuard, paths: ReadonlySet<string>, onError: ErrorHook = () => {}): ServerInterceptor {
  return (method, call) => {
    if (!paths.has(method.path)) return new ServerInterceptingCall(call);
    const streaming = method.requestStream || method.responseStream;
    const fail = (err: unknown): ReturnType<typeof toGrpcStatus> => {
      onError(err, method.path);
      return toGrpcStatus(err);
    };
    let admitted: Admission | undefined;
    return new ServerInterceptingCall(call, {
      start: (next) =>
        next({
          onReceiveMetadata: (metadata, pass) => {
            let a: Admission;
            try {
              a = admissionOf(guard.admit({ metadata, method: method.path, streaming, peer: call.getPeer() }));
            } catch (err) {
              call.sendStatus(fail(err));
              return;
            }
            admitted = a;
            a.revoked.addEventListener(
              'abort',
              () => {
                if (admittedFromHeaders.get(metadata) !== a) return; // its handler has it, and ends it
                admittedFromHeaders.delete(metadata);
                a.release();
                call.sendStatus(fail(a.revoked.reason));
              },
              { once: true },
            );
            admittedFromHeaders.set(metadata, a);
            pass(metadata);
          },
          // grpc-js tells every end of a call here: its status sent, a reset, the connection gone.
          onCancel: () => admitted?.release(),
        }),
    });
  };
}

/**
 * Admits a call: the admission guardInterceptor made from its headers, or else (a server
 * without the interceptor) `guard`'s verdict now. Its release runs once, when the call ends
 * however it ends (finished, failed, cancelled, connection closed).
 */
function admitCall(guard: CallGuard | undefined, call: AnyServerCall, method: string, streaming: boolean): Admission {
  // One in the map is not revoked: a revocation takes it out (guardInterceptor).
  let a = admittedFromHeaders.get(call.metadata);
  if (a) admittedFromHeaders.delete(call.metadata);
  else if (!guard) return { principal: undefined, release: () => {}, revoked: new AbortController().signal };
  else a = admissionOf(guard.admit({ metadata: call.metadata, method, streaming, peer: call.getPeer() }));
  const emitter = call as unknown as NodeJS.EventEmitter;
  emitter.once('cancelled', a.release);
  emitter.once('close', a.release);
  return a;
}

/**
 * Ends a streaming call or a long poll with its credential's revocation error when the guard
 * revokes it (the handler's context is aborted too, through `contextOf`'s `revoked`): `answer`
 * fails the call, unless it has been answered already.
 */
function endOnRevoke(admitted: ReturnType<typeof admitCall>, answer: (err: unknown) => void): void {
  admitted.revoked.addEventListener(
    'abort',
    () => {
      admitted.release();
      answer(admitted.revoked.reason);
    },
    { once: true },
  );
}

/** A call with a single answer: `cb` runs once, for whichever of the handler and a revocation answers first. */
function answerOnce(cb: sendUnaryData<unknown>, fail: (err: unknown) => ReturnType<typeof toGrpcStatus>): (err: unknown, res?: unknown) => void {
  let answered = false;
  return (err, res) => {
    if (answered) return;
    answered = true;
    if (err === null) cb(null, res);
    else cb(fail(err));
  };
}

/** Builds grpc-js handlers that run `impl`, map thrown errors once, and honour cancellation. */
export function grpcHandlers(reg: ServiceRegistration, onError: ErrorHook = () => {}, guard?: CallGuard): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  for (const m of reg.service.methods) {
    const fn = reg.handlers[m.localName] as unknown as (a: unknown, ctx: CallContext) => unknown;
    const name = methodPath(m);
    if (typeof fn !== 'function') throw new Error(`service ${reg.service.typeName}: no handler for ${m.name}`);
    const fail = (err: unknown): ReturnType<typeof toGrpcStatus> => {
      onError(err, name);
      return toGrpcStatus(err);
    };
    // The guard's verdict, or undefined after `refuse` has answered the call with its error.
    const admitOr = (call: AnyServerCall, streaming: boolean, refuse: (status: ReturnType<typeof toGrpcStatus>) => void): ReturnType<typeof admitCall> | undefined => {
      try {
        return admitCall(guard, call, name, streaming);
      } catch (err) {
        refuse(fail(err));
        return undefined;
      }
    };
    switch (m.methodKind) {
      case 'unary':
        out[m.localName] = (call: ServerUnaryCall<unknown, unknown>, cb: sendUnaryData<unknown>) => {
          const admitted = admitOr(call, false, (st) => cb(st));
          if (!admitted) return;
          const answer = answerOnce(cb, fail);
          // A long poll (ApiGuard) is ended by its credential's revocation, as a stream is.
          endOnRevoke(admitted, answer);
          const { ctx, done } = contextOf(call, name, admitted.principal, admitted.revoked);
          const request = decodeRequest(m, call.request);
          if (request instanceof Undecodable) {
            done();
            admitted.release();
            answer(undecodableError(request));
            return;
          }
          // A long poll holds a stream slot (ApiGuard): given back once it is answered.
          (fn(request, ctx) as Promise<unknown>).then(
            (res) => {
              done();
              admitted.release();
              answer(null, res);
            },
            (err: unknown) => {
              done();
              admitted.release();
              answer(err);
            },
          );
        };
        break;
      case 'client_streaming':
        out[m.localName] = (call: ServerReadableStream<unknown, unknown>, cb: sendUnaryData<unknown>) => {
          const admitted = admitOr(call, true, (st) => cb(st));
          if (!admitted) return;
          const answer = answerOnce(cb, fail);
          endOnRevoke(admitted, answer);
          const { ctx, done } = contextOf(call, name, admitted.principal, admitted.revoked);
          (fn(decodedItems(m, readableItems(call)), ctx) as Promise<unknown>).then(
            (res) => {
              done();
              admitted.release();
              answer(null, res);
            },
            (err: unknown) => {
              done();
              admitted.release();
              answer(err);
            },
          );
        };
        break;
      case 'server_streaming':
      case 'bidi_streaming':
        out[m.localName] = (call: ServerWritableStream<unknown, unknown> | ServerDuplexStream<unknown, unknown>) => {
          const admitted = admitOr(call, true, (st) => call.emit('error', st));
          if (!admitted) return;
          let answered = false;
          // The reset that follows a status the client does not take: CANCEL for a call ended by
          // its handler or its credential (ADR 0008), ENHANCE_YOUR_CALM for a client that stopped
          // reading (its gRPC library reports RESOURCE_EXHAUSTED).
          let resetCode: number = http2Constants.NGHTTP2_ENHANCE_YOUR_CALM;
          // Answers the call once: its end (err undefined) or err's status, either after what the
          // client has yet to take. `soon`: reset should the client take none of that within
          // STALLED_STATUS_MS (else within STREAM_STALL_MS, `progress`).
          const answer = (err: unknown, soon: boolean): void => {
            if (!answered) {
              answered = true;
              if (err === undefined) call.end();
              else call.emit('error', fail(err));
            }
            if (soon) progress.hasten();
          };
          const progress = new ClientProgress(call, () => {
            if (answered) {
              resetStream(call, resetCode);
              return;
            }
            // A client that stopped reading: nothing of the handler's can reach it, its own
            // failure included (queued behind the messages the client does not take, or not even
            // pulled: writeAll waits for the client's window). The call ends now.
            const err = new ForkfleetError('resource_exhausted', `${name}: the client took none of this stream's messages for ${STREAM_STALL_MS / 1000}s: read them as they come, then call again`);
            answer(err, true);
            admitted.release();
            cancel(err);
          });
          const emitter = call as unknown as NodeJS.EventEmitter;
          emitter.once('cancelled', () => progress.stop());
          emitter.once('close', () => progress.stop());
          endOnRevoke(admitted, (err) => {
            resetCode = http2Constants.NGHTTP2_CANCEL;
            answer(err, true);
          });
          const { ctx, done, ended, cancel } = contextOf(call, name, admitted.principal, admitted.revoked, true);
          const input = m.methodKind === 'server_streaming' ? decodeRequest(m, (call as ServerWritableStream<unknown, unknown>).request)
              : decodedItems(m, readableItems(call as ServerDuplexStream<unknown, unknown>));
          if (input instanceof Undecodable) {
            done();
            admitted.release();
            answer(undecodableError(input), false);
            return;
          }
          let iterable: AsyncIterable<unknown>;
          try {
            iterable = fn(input, ctx) as AsyncIterable<unknown>;
          } catch (err) {
            done();
            admitted.release();
            answer(err, false);
            return;
          }
          writeAll(call, iterable, ctx.signal, ended, progress).then(
            () => {
              done();
              admitted.release();
              if (!ctx.signal.aborted) answer(undefined, false);
            },
            (err: unknown) => {
              done();
              admitted.release();
              if (ctx.signal.aborted) return;
              // Ended by the handler (ctx.end: a stream it gives up on, such as a ticket past its
              // grace): reset should the client not take the status within STALLED_STATUS_MS. A
              // handler's own error goes as any status does, after what the client has yet to
              // read: a slow reader (a WatchEvents client behind, told resource_exhausted to
              // resume) must get it whole; one that takes nothing for STREAM_STALL_MS is reset.
              if (ended.aborted) resetCode = http2Constants.NGHTTP2_CANCEL;
              answer(err, ended.aborted);
            },
          );
        };
        break;
    }
  }
  return out;
}

function grpcCallOptions(opts: CallOptions | undefined): { options: GrpcCallOptions; metadata: Metadata } {
  const metadata = new Metadata();
  for (const [k, v] of Object.entries(opts?.metadata ?? {})) metadata.set(k, v);
  const options: GrpcCallOptions = {};
  if (opts?.deadline) options.deadline = opts.deadline;
  else if (opts?.timeoutMs !== undefined) options.deadline = new Date(Date.now() + opts.timeoutMs);
  return { options, metadata };
}

function bindSignal(call: { cancel(): void }, signal: AbortSignal | undefined): () => void {
  if (!signal) return () => {};
  if (signal.aborted) {
    call.cancel();
    return () => {};
  }
  const onAbort = (): void => call.cancel();
  signal.addEventListener('abort', onAbort, { once: true });
  return () => signal.removeEventListener('abort', onAbort);
}

async function pump(call: ClientWritableStream<unknown> | ClientDuplexStream<unknown, unknown>, reqs: AsyncIterable<unknown> | Iterable<unknown>): Promise<void> {
  try {
    for await (const r of reqs) {
      if (!call.write(r)) await new Promise<void>((resolve) => call.once('drain', resolve));
    }
    call.end();
  } catch (err) {
    call.cancel();
    throw err;
  }
}

async function* readAll<T>(stream: ClientReadableStream<T> | ClientDuplexStream<unknown, T>, unbind: () => void): AsyncGenerator<T> {
  try {
    for await (const msg of stream) yield msg as T;
  } catch (err) {
    throw fromServiceError(err as ServiceError);
  } finally {
    unbind();
    // Ending early (break / return) cancels the call so the server stops sending.
    stream.cancel();
  }
}

/**
 * A typed client for `service` at `address` (host:port). Insecure credentials by default
 * (peer transfers, tests); the Fleet API serves TLS only: pass fleetChannelCredentials and
 * fleetChannelOptions (tls.ts).
 */
export function createClient<S extends GenServiceMethods>(
  service: GenService<S>,
  address: string,
  credentials: ChannelCredentials = grpcCredentials.createInsecure(),
  options: ClientOptions = {},
): Client<S> {
  const raw = new GrpcClient(address, credentials, options);
  // grpc-js's close() lets calls already started run on (a watch stream, a long wait would
  // keep the process alive after close): they are cancelled here, as Client.close promises.
  const live = new Set<{ cancel(): void }>();
  const track = <C extends { cancel(): void; on(ev: 'status', f: () => void): unknown }>(call: C): C => {
    live.add(call);
    call.on('status', () => live.delete(call));
    return call;
  };
  const client: Record<string, unknown> = {
    close: () => {
      for (const c of [...live]) c.cancel();
      live.clear();
      raw.close();
    },
  };
  for (const m of (service as DescService).methods) {
    const def = methodDefinition(m);
    const path = def.path;
    switch (m.methodKind) {
      case 'unary':
        client[m.localName] = (req: unknown, opts?: CallOptions) =>
          new Promise((resolve, reject) => {
            const { options: o, metadata } = grpcCallOptions(opts);
            let unbind = (): void => {};
            const call = track(raw.makeUnaryRequest(path, def.requestSerialize, def.responseDeserialize, req, metadata, o, (err, res) => {
              unbind();
              if (err) reject(fromServiceError(err));
              else resolve(res);
            }));
            unbind = bindSignal(call, opts?.signal);
          });
        break;
      case 'server_streaming':
        client[m.localName] = (req: unknown, opts?: CallOptions) => {
          const { options: o, metadata } = grpcCallOptions(opts);
          const call = track(raw.makeServerStreamRequest(path, def.requestSerialize, def.responseDeserialize, req, metadata, o));
          // readAll's iterator reports errors; this keeps an error on a call that is never
          // iterated from becoming an unhandled 'error' event that kills the process.
          call.on('error', () => undefined);
          return readAll(call, bindSignal(call, opts?.signal));
        };
        break;
      case 'client_streaming':
        client[m.localName] = (reqs: AsyncIterable<unknown> | Iterable<unknown>, opts?: CallOptions) =>
          new Promise((resolve, reject) => {
            const { options: o, metadata } = grpcCallOptions(opts);
            let unbind = (): void => {};
            const call = track(raw.makeClientStreamRequest(path, def.requestSerialize, def.responseDeserialize, metadata, o, (err, res) => {
              unbind();
              if (err) reject(fromServiceError(err));
              else resolve(res);
            }));
            unbind = bindSignal(call, opts?.signal);
            pump(call, reqs).catch(reject);
          });
        break;
      case 'bidi_streaming':
        client[m.localName] = (reqs: AsyncIterable<unknown> | Iterable<unknown>, opts?: CallOptions) => {
          const { options: o, metadata } = grpcCallOptions(opts);
          const call = track(raw.makeBidiStreamRequest(path, def.requestSerialize, def.responseDeserialize, metadata, o));
          call.on('error', () => undefined); // see server_streaming above
          // A failure producing requests cancels the call; the reader then sees CANCELLED.
          pump(call, reqs).catch(() => {});
          return readAll(call, bindSignal(call, opts?.signal));
        };
        break;
    }
  }
  return client as Client<S>;
}
