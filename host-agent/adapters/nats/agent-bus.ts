// AgentBus over NATS: a durable JetStream consumer of this host's work subject, results
// and events published to JetStream, heartbeats on core NATS, exec and file request/reply.
import { ErrorCode } from 'nats';
import type { ConsumerMessages, JetStreamClient, JetStreamManager, NatsConnection, NatsError, Subscription } from 'nats';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import type { Logger } from 'pino';
import type { AgentBus, WorkControl } from '../../domain/agent.ts';
import {
  HeartbeatSchema,
  HostEventSchema,
  HostExecOutputSchema,
  HostExecRequestSchema,
  HostFileRequestSchema,
  HostFileResponseSchema,
  HostResultSchema,
  HostWorkBatchSchema,
  HostWorkSchema,
} from '../../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type { Heartbeat, HostEvent, HostExecOutput, HostExecRequest, HostFileRequest, HostFileResponse, HostResult, HostWork } from '../../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { ensureStreams, ensureWorkConsumer, STREAM_EVENTS, STREAM_RESULTS, STREAM_WORK, subjects, workConsumer } from '../../../services/adapters/nats/subjects.ts';
import { JsPublisher } from '../../../services/adapters/nats/js-publisher.ts';
import { ackAfter, isBatch, SubjectBatcher } from '../../../services/adapters/nats/batcher.ts';

async function waitForStreams(jsm: JetStreamManager, timeoutMs: number): Promise<void> {
  const until = Date.now() + timeoutMs;
  for (let delay = 100; ; delay = Math.min(delay * 2, 2000)) {
    const ok = await Promise.all([STREAM_WORK, STREAM_RESULTS, STREAM_EVENTS].map((s) => jsm.streams.info(s))).then(
      () => true,
      (e: unknown) => {
        // Not "the scheduler has not created them yet" but wrong credentials: fail now.
        if ((e as NatsError).code === ErrorCode.PermissionsViolation) throw new Error(`NATS refused reading the JetStream streams (permissions violation): is FF_NATS_NKEY_FILE this host's key?`, { cause: e });
        return false;
      },
    );
    if (ok) return;
    if (Date.now() + delay > until) throw new Error(`JetStream streams ${STREAM_WORK}, ${STREAM_RESULTS}, ${STREAM_EVENTS} do not exist after ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, delay));
  }
}

export class NatsAgentBus implements AgentBus {
  private readonly js: JetStreamClient;
  private readonly publisher: JsPublisher;
  private readonly batcher: SubjectBatcher;
  private readonly subs: Subscription[] = [];

  private constructor(
    private readonly nc: NatsConnection,
    private readonly hostId: string,
    private readonly log: Logger,
  ) {
    this.js = nc.jetstream();
    this.publisher = JsPublisher.of(nc);
    this.batcher = new SubjectBatcher(this.publisher);
  }

  /**
   * Creates the streams if this connection may (no NATS authorization), else waits until the
   * scheduler has created them (an agent's NATS user may only read stream info), then creates
   * or re-attaches this host's durable work consumer.
   */
  static async create(nc: NatsConnection, hostId: string, log: Logger, opts: { streamWaitMs?: number } = {}): Promise<NatsAgentBus> {
    const jsm = await nc.jetstreamManager();
    try {
      await ensureStreams(jsm);
    } catch (e) {
      log.info({ err: e }, 'cannot create the JetStream streams here; waiting for the scheduler to create them');
      await waitForStreams(jsm, opts.streamWaitMs ?? Number.POSITIVE_INFINITY);
    }
    await ensureWorkConsumer(jsm, hostId);
    return new NatsAgentBus(nc, hostId, log);
  }

  async consumeWork(onWork: (w: HostWork, ctl: WorkControl) => Promise<void>): Promise<() => Promise<void>> {
    const consumer = await this.js.consumers.get(STREAM_WORK, workConsumer(this.hostId));
    const messages: ConsumerMessages = await consumer.consume({ max_messages: 16 });
    const pending = new Set<Promise<void>>();
    const loop = (async () => {
      for await (const m of messages) {
        let ws: HostWork[];
        try {
          ws = isBatch(m) ? fromBinary(HostWorkBatchSchema, m.data).items : [fromBinary(HostWorkSchema, m.data)];
        } catch (e) {
          this.log.warn({ err: e }, 'undecodable work message dropped');
          m.term();
          continue;
        }
        // A batch is acked when every step in it is (each step acks when its result is out).
        const ctl: WorkControl = { ack: ackAfter(ws.length, () => m.ack()), working: () => m.working() };
        for (const w of ws) {
          const p = onWork(w, ctl).catch((e: unknown) => this.log.error({ err: e }, 'work handler failed'));
          pending.add(p);
          void p.finally(() => pending.delete(p));
        }
      }
    })();
    return async () => {
      await messages.close();
      await loop.catch(() => undefined);
    };
  }

  async publishResult(r: HostResult): Promise<void> {
    // Results that are ready in the same turn go out as one message (batcher.ts).
    await this.batcher.publish(subjects.result(this.hostId), toBinary(HostResultSchema, r));
  }

  publishHeartbeat(hb: Heartbeat): void {
    this.nc.publish(subjects.heartbeat(this.hostId), toBinary(HeartbeatSchema, hb));
  }

  publishEvent(e: HostEvent): void {
    this.publisher.publish(subjects.event(this.hostId), toBinary(HostEventSchema, e)).catch((err: unknown) => this.log.debug({ err }, 'event publish failed'));
  }

  serveExec(handler: (req: HostExecRequest, emit: (out: HostExecOutput) => void) => Promise<void>): () => void {
    const sub = this.nc.subscribe(subjects.exec(this.hostId), {
      callback: (err, m) => {
        if (err || !m.reply) return;
        const reply = m.reply;
        let req: HostExecRequest;
        try {
          req = fromBinary(HostExecRequestSchema, m.data);
        } catch {
          this.nc.publish(reply, toBinary(HostExecOutputSchema, create(HostExecOutputSchema, { seq: 1n, payload: { case: 'error', value: { kind: 'invalid_argument', message: 'undecodable exec request' } } })));
          return;
        }
        void handler(req, (out) => this.nc.publish(reply, toBinary(HostExecOutputSchema, out)));
      },
    });
    this.subs.push(sub);
    return () => sub.unsubscribe();
  }

  serveFile(handler: (req: HostFileRequest) => Promise<HostFileResponse>): () => void {
    const sub = this.nc.subscribe(subjects.file(this.hostId), {
      callback: (err, m) => {
        if (err || !m.reply) return;
        let req: HostFileRequest;
        try {
          req = fromBinary(HostFileRequestSchema, m.data);
        } catch {
          m.respond(toBinary(HostFileResponseSchema, create(HostFileResponseSchema, { error: { kind: 'invalid_argument', message: 'undecodable file request' } })));
          return;
        }
        void handler(req).then((res) => m.respond(toBinary(HostFileResponseSchema, res)));
      },
    });
    this.subs.push(sub);
    return () => sub.unsubscribe();
  }
}
