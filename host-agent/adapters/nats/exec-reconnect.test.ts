// NatsAgentBus.serveExec across a loss of this agent's own NATS connection, over a
// NatsConnection of our own making: a real server cannot be made to drop what an agent
// publishes while disconnected on cue (agent-bus.int.test.ts runs the relay against one).
import { describe, expect, it } from 'vitest';
import pino from 'pino';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import type { NatsConnection, Status } from 'nats';
import { ErrorInfoSchema } from '../../../proto/gen/forkfleet/v1/common_pb.ts';
import { HostExecAliveSchema, HostExecExitSchema, HostExecOutputSchema, HostExecRequestSchema } from '../../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type { HostExecOutput, HostExecRequest } from '../../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { AsyncQueue } from '../../../services/adapters/grpc/queue.ts';
import { subjects } from '../../../services/adapters/nats/subjects.ts';
import { NatsAgentBus } from './agent-bus.ts';

type Handler = (req: HostExecRequest, emit: (out: HostExecOutput) => void, signal: AbortSignal) => Promise<void>;

/** An agent bus over a fake connection: `request` sends an exec, `status` a status event, `answers` what went to a reply subject. */
function agentBus(handler: Handler) {
  const subs = new Map<string, (err: Error | null, m: { data: Uint8Array; subject: string; reply?: string }) => void>();
  const published: Array<{ subject: string; data: Uint8Array }> = [];
  const statuses = new AsyncQueue<Status>();
  const nc = {
    subscribe: (subject: string, opts: { callback: (err: Error | null, m: { data: Uint8Array; subject: string; reply?: string }) => void }) => {
      subs.set(subject, opts.callback);
      return { unsubscribe: () => void subs.delete(subject) };
    },
    publish: (subject: string, data: Uint8Array) => void published.push({ subject, data }),
    status: () => statuses,
    jetstream: () => ({}),
    closed: () => new Promise(() => undefined),
    isClosed: () => false,
    options: {},
  };
  const bus = new (NatsAgentBus as unknown as new (nc: NatsConnection, jsm: unknown, hostId: string, log: pino.Logger) => NatsAgentBus)(nc as unknown as NatsConnection, {}, 'h1', pino({ level: 'silent' }));
  const stop = bus.serveExec(handler);
  return {
    stop,
    request: (reply: string) => subs.get(subjects.exec('h1'))!(null, { subject: subjects.exec('h1'), reply, data: toBinary(HostExecRequestSchema, create(HostExecRequestSchema, { sandboxId: 'sb-1', argv: ['true'] })) }),
    keepalive: (...replies: string[]) => subs.get(subjects.execAlive('h1'))!(null, { subject: subjects.execAlive('h1'), data: toBinary(HostExecAliveSchema, create(HostExecAliveSchema, { replySubjects: replies })) }),
    status: async (type: 'disconnect' | 'reconnect') => {
      statuses.push({ type, data: '' } as Status);
      await new Promise((r) => setImmediate(r)); // the bus reads it
    },
    answers: (reply: string) => published.filter((p) => p.subject === reply).map((p) => fromBinary(HostExecOutputSchema, p.data)).map((o) => `${o.seq}:${o.payload.case}${o.payload.case === 'error' ? `:${o.payload.value.kind}` : ''}`),
  };
}

/** A handler the test drives: `emit` sends a piece (numbered as the agent does), `end` returns from it. */
function driven() {
  let emitTo!: (out: HostExecOutput) => void;
  let end!: () => void;
  let signal!: AbortSignal;
  let seq = 0n;
  const handler: Handler = (_req, emit, s) => {
    emitTo = emit;
    signal = s;
    return new Promise<void>((r) => (end = r));
  };
  return {
    handler,
    emit: (payload: HostExecOutput['payload']) => emitTo(create(HostExecOutputSchema, { seq: ++seq, payload })),
    end: () => end(),
    get signal() {
      return signal;
    },
  };
}

/** `body` with a driven handler served by an agent bus, stopped after it. */
async function served(body: (h: ReturnType<typeof driven>, a: ReturnType<typeof agentBus>) => Promise<void>): Promise<void> {
  const h = driven();
  const a = agentBus(h.handler);
  try {
    await body(h, a);
  } finally {
    a.stop();
  }
}

const stdout: HostExecOutput['payload'] = { case: 'stdout', value: new TextEncoder().encode('hi') };
const exit: HostExecOutput['payload'] = { case: 'exit', value: create(HostExecExitSchema, { exitCode: 0 }) };

describe('NatsAgentBus.serveExec across a reconnect', () => {
  it('serveExec_whenTheExitWentOutWhileTheLinkWasDown_sendsAnErrorWithTheNextSeqAtTheReconnect', () =>
    served(async (h, a) => {
      a.request('_INBOX.r1');
      h.emit(stdout);
      await a.status('disconnect');
      h.emit(exit);
      h.end();
      await new Promise((r) => setImmediate(r));
      await a.status('reconnect');
      // Before, the exit (dropped by nats.js) was the last word: the caller waited out its timeout.
      expect(a.answers('_INBOX.r1')).toEqual(['1:stdout', '2:exit', '3:error:unavailable']);
    }));

  it('serveExec_whenOutputWentOutWhileTheLinkWasDown_killsTheCommandAtTheReconnect_andSendsNothingAfterTheError', () =>
    served(async (h, a) => {
      a.request('_INBOX.r1');
      await a.status('disconnect');
      h.emit(stdout);
      await a.status('reconnect');
      expect(h.signal.aborted).toBe(true);
      h.emit({ case: 'error', value: create(ErrorInfoSchema, { kind: 'cancelled', message: 'killed' }) });
      h.end();
      expect(a.answers('_INBOX.r1')).toEqual(['1:stdout', '2:error:unavailable']);
    }));

  it('serveExec_whenNothingWentOutWhileTheLinkWasDown_leavesTheCommandRunning', () =>
    served(async (h, a) => {
      a.request('_INBOX.r1');
      h.emit(stdout);
      await a.status('disconnect');
      await a.status('reconnect');
      expect(h.signal.aborted).toBe(false);
      h.emit(exit);
      h.end();
      expect(a.answers('_INBOX.r1')).toEqual(['1:stdout', '2:exit']);
    }));

  it('keepalive_namingAnExecThisHostDoesNotRun_isAnsweredOnItsReplySubject_withAnErrorOutsideTheSequence', () =>
    served(async (h, a) => {
      a.request('_INBOX.r1');
      h.emit(stdout);
      // r1 runs; r0 ended here (its exit lost on the way) or never arrived.
      a.keepalive('_INBOX.r0', '_INBOX.r1');
      expect(a.answers('_INBOX.r0')).toEqual(['0:error:unavailable']);
      expect(a.answers('_INBOX.r1')).toEqual(['1:stdout']);
      h.emit(exit);
      h.end();
      await new Promise((r) => setImmediate(r));
      // Ended here: its caller naming it still is told so.
      a.keepalive('_INBOX.r1');
      expect(a.answers('_INBOX.r1')).toEqual(['1:stdout', '2:exit', '0:error:unavailable']);
    }));
});
