// AgentBus over NATS: a durable JetStream consumer of this host's work subject, results
// and events published to JetStream, heartbeats on core NATS, exec and file request/reply.
import { ErrorCode } from 'nats';
import type { JetStreamClient, JetStreamManager, JsMsg, NatsConnection, NatsError, Status, Subscription } from 'nats';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import { durationMs } from '@bufbuild/protobuf/wkt';
import type { Duration } from '@bufbuild/protobuf/wkt';
import type { Logger } from 'pino';
import type { AgentBus, WorkControl } from '../../domain/agent.ts';
import {
  HeartbeatSchema,
  HostEventSchema,
  HostExecAliveSchema,
  HostExecCancelSchema,
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
import { isBatch, RESULT_BATCH_HEADER, settleAfter, SubjectBatcher } from '../../../services/adapters/nats/batcher.ts';
import { consumeDurable } from '../../../services/adapters/nats/durable-consumer.ts';
import { MAX_TIMER_MS } from '../../../services/config.ts';

/**
 * HostExecRequest.keepalive intervals without a HostExecAlive after which an exec's command is
 * killed: 4 x 5 s, longer than a silent link takes to be noticed (LINK_CHECK's 2 missed pings 5 s
 * apart), after which the lease waits for the reconnect.
 */
export const EXEC_KEEPALIVE_MISSES = 4;

/**
 * The answer to a keepalive that names an exec this host does not run (seq 0: outside the
 * call's sequence). Its caller still waits, so the exit never reached it: it was published while
 * either side's NATS connection was down (nats.js and the server drop what is sent meanwhile),
 * or the request never arrived, or an agent restart forgot the command. Told now, the call ends
 * UNAVAILABLE instead of waiting out its whole timeout (up to an hour). A caller that has had
 * the exit no longer names it.
 */
const NO_SUCH_EXEC = (hostId: string): Uint8Array =>
  toBinary(HostExecOutputSchema, create(HostExecOutputSchema, { seq: 0n, payload: { case: 'error', value: { kind: 'unavailable', message: `host ${hostId} runs no exec for this call: it ended and its exit was lost in transit (a NATS reconnect), or its request never arrived` } } }));
/** How soon a refused keepalive subscription is asked for again. */
const ALIVE_RETRY_MS = 60_000;
/** The shortest keepalive interval an agent takes (a shorter one is read as this). */
const EXEC_KEEPALIVE_MIN_MS = 50;

/**
 * The keepalive interval an exec's lease runs on, in ms (0: no lease): the request's, at least
 * EXEC_KEEPALIVE_MIN_MS, and at most what a timer can wait for EXEC_KEEPALIVE_MISSES of them
 * (Node fires a longer setTimeout after 1 ms, which re-armed the lease check every millisecond).
 */
export function execKeepaliveMs(keepalive: Duration | undefined): number {
  if (!keepalive) return 0;
  const ms = durationMs(keepalive);
  if (!(ms > 0)) return 0;
  return Math.min(Math.floor(MAX_TIMER_MS / EXEC_KEEPALIVE_MISSES), Math.max(EXEC_KEEPALIVE_MIN_MS, ms));
}

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

/**
 * Tells of the agent's NATS link, which nothing else did: nats.js buffers what is published while
 * the link is down (heartbeats do not fail), and a server's error (a permissions violation) was
 * seen by no one. Each disconnect and server error is logged at warn (a refusal naming what was
 * refused), each reconnect at info; `onLink` hears whether the link is up: up from the start
 * (`status` is of a connection just made), down for good once the connection has closed.
 */
export async function followLink(status: AsyncIterable<Status>, log: Logger, onLink: (up: boolean) => void): Promise<void> {
  onLink(true);
  try {
    for await (const st of status) {
      if (st.type === 'disconnect') {
        onLink(false);
        log.warn({ server: st.data }, 'NATS connection lost: reconnecting (heartbeats and results are held back until then)');
      } else if (st.type === 'reconnect') {
        onLink(true);
        log.info({ server: st.data }, 'NATS connection back');
      } else if (st.type === 'error') {
        log.warn({ code: st.data, ...(st.permissionContext ? { operation: st.permissionContext.operation, subject: st.permissionContext.subject } : {}) }, 'the NATS server reported an error');
      }
    }
  } finally {
    onLink(false);
  }
}

/**
 * In-progress acks of one work message go out at most this often (the work consumer's ack wait
 * is WORK_ACK_WAIT_MS, 30 s; the agent calls working() for each of its steps every 5 s).
 */
export const WORKING_MIN_INTERVAL_MS = 2_000;

export class NatsAgentBus implements AgentBus {
  private readonly js: JetStreamClient;
  private readonly publisher: JsPublisher;
  private readonly batcher: SubjectBatcher;
  /** `${opId}/${stepId}` of steps whose scheduler reads result batches. */
  private readonly batchable = new Set<string>();
  private readonly subs: Subscription[] = [];

  private constructor(
    private readonly nc: NatsConnection,
    private readonly jsm: JetStreamManager,
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
    return new NatsAgentBus(nc, jsm, hostId, log);
  }

  async consumeWork(onWork: (w: HostWork, ctl: WorkControl) => Promise<void>): Promise<() => Promise<void>> {
    const pending = new Set<Promise<void>>();
    const handle = (m: JsMsg): void => {
      let ws: HostWork[];
      try {
        ws = isBatch(m) ? fromBinary(HostWorkBatchSchema, m.data).items : [fromBinary(HostWorkSchema, m.data)];
      } catch (e) {
        this.log.warn({ err: e }, 'undecodable work message dropped');
        m.term();
        return;
      }
      // A batch is acked when every step in it is (each step acks when its result is out).
      // Every step of a batch keeps the one message alive (agent.ts, every 5 s): at most one
      // in-progress ack per message per WORKING_MIN_INTERVAL_MS goes out, not one per step.
      let lastWorking = Number.NEGATIVE_INFINITY;
      const working = (): void => {
        const now = performance.now();
        if (now - lastWorking < WORKING_MIN_INTERVAL_MS) return;
        lastWorking = now;
        m.working();
      };
      const ctl: WorkControl = { ...settleAfter(ws.length, () => m.ack(), () => m.nak()), working };
      // A scheduler that reads result batches says so on its work (hostwork.proto, "Batches").
      if (m.headers?.get(RESULT_BATCH_HEADER) === '1') for (const w of ws) this.markBatchable(`${w.opId}/${w.stepId}`);
      for (const w of ws) {
        const p = onWork(w, ctl).catch((e: unknown) => this.log.error({ err: e }, 'work handler failed'));
        pending.add(p);
        void p.finally(() => pending.delete(p));
      }
    };
    // The durable consumer can be deleted under a running agent (RemoveHost of a host that
    // only looked gone, e.g. across a partition), or lost with its stream (a nats-server that
    // lost its store): it is made again, with the streams if this agent may make them (else
    // it waits for the scheduler to), and consumed anew. The leader registers the host again
    // from its heartbeats.
    return consumeDurable({
      nc: this.nc,
      jsm: this.jsm,
      js: this.js,
      stream: STREAM_WORK,
      consumer: workConsumer(this.hostId),
      maxMessages: 16,
      ensure: async () => {
        await ensureStreams(this.jsm).catch(() => undefined); // no permission: the scheduler makes them
        await ensureWorkConsumer(this.jsm, this.hostId);
      },
      onMessage: handle,
      onGone: (why) => this.log.warn({ why }, "this host's work queue is gone (the host was removed, or the server lost its streams?): creating it again"),
      onRetry: (e) => this.log.warn({ err: e }, 'could not consume the work queue again; retrying'),
    });
  }

  async publishResult(r: HostResult): Promise<void> {
    // Results that are ready in the same turn go out as one message (batcher.ts), when the
    // scheduler that sent the step reads batches.
    const key = `${r.opId}/${r.stepId}`;
    const bytes = toBinary(HostResultSchema, r);
    if (this.batchable.delete(key)) await this.batcher.publish(subjects.result(this.hostId), bytes);
    else await this.publisher.publish(subjects.result(this.hostId), bytes);
  }

  private markBatchable(key: string): void {
    this.batchable.add(key);
    // Steps whose result never goes out (a crash mid-step is redelivered and marked again).
    if (this.batchable.size > 10_000) this.batchable.delete(this.batchable.values().next().value as string);
  }

  publishHeartbeat(hb: Heartbeat): void {
    // This bus reads work batches (hostwork.proto, "Batches"); its agent serves ranged files.
    this.nc.publish(subjects.heartbeat(this.hostId), toBinary(HeartbeatSchema, { ...hb, readsBatches: true, rangedFiles: true }));
  }

  publishEvent(e: HostEvent): void {
    this.publisher.publish(subjects.event(this.hostId), toBinary(HostEventSchema, e)).catch((err: unknown) => this.log.debug({ err }, 'event publish failed'));
  }

  /**
   * Publishes a relay answer. One that NATS refuses (over its max_payload: publish throws)
   * goes out as the error `tooBig` makes instead; this must never throw out of a callback,
   * which would end the agent.
   */
  private reply(subject: string, data: Uint8Array, tooBig: () => Uint8Array): void {
    try {
      this.nc.publish(subject, data);
    } catch (e) {
      this.log.warn({ err: e, bytes: data.length }, 'relay answer refused by NATS');
      try {
        this.nc.publish(subject, tooBig());
      } catch (e2) {
        this.log.warn({ err: e2 }, 'relay error answer refused by NATS');
      }
    }
  }

  serveExec(handler: (req: HostExecRequest, emit: (out: HostExecOutput) => void, signal: AbortSignal) => Promise<void>): () => void {
    // Execs in progress by their reply subject (unique per call), aborted by a HostExecCancel
    // from the scheduler (only it may publish there: auth.ts), or when a caller that asked for
    // keepalives (HostExecRequest.keepalive) has not named the exec for EXEC_KEEPALIVE_MISSES intervals.
    const running = new Map<string, { ac: AbortController; heard: number }>();
    // Execs that sent output (or their exit) while this agent's connection was down, by reply
    // subject, ended ones too: nats.js drops what is published while disconnected, and a lost
    // exit leaves the caller waiting out its whole timeout (up to an hour). At the reconnect each
    // gets an error piece with the next seq (its caller fails the call; a hole before it shows as
    // a missing seq anyway), and a command still running is killed: nobody reads it any more.
    const sentWhileDown = new Map<string, { ac: AbortController; nextSeq: bigint; closed: boolean }>();
    // Keepalives cannot be heard while this agent's own connection is down, nor at all when the
    // server refuses their subscription (a NATS config rendered before ff.execalive.<host>
    // existed): no command is killed for their silence then. A reconnect counts as hearing
    // every exec, so one that its caller still waits for survives the agent's own outage.
    let linkDown = false;
    let aliveRefused = false;
    let served = true;
    /** listenAlive, below (the status loop starts first). */
    let relisten = (): void => undefined;
    /** Every exec counts as heard now (a reconnect; keepalives listened to again). */
    const heardAll = (): void => {
      const now = performance.now();
      for (const session of running.values()) session.heard = now;
    };
    const status = this.nc.status();
    void (async () => {
      for await (const st of status) {
        if (st.type === 'disconnect') linkDown = true;
        else if (st.type === 'reconnect') {
          linkDown = false;
          heardAll();
          for (const [reply, session] of sentWhileDown) {
            session.closed = true;
            this.log.warn({ replySubject: reply }, 'exec output sent while the NATS connection was down may have been lost: ending the call, and its command if still running');
            const lost = toBinary(HostExecOutputSchema, create(HostExecOutputSchema, { seq: session.nextSeq, payload: { case: 'error', value: { kind: 'unavailable', message: 'output this host sent while its NATS connection was down may have been lost, so the command was stopped; what it printed is not known whole' } } }));
            this.reply(reply, lost, () => lost);
            session.ac.abort();
          }
          sentWhileDown.clear();
          // A refused keepalive subscription is gone for good (nats.js drops it): asked again
          // on each reconnect (a NATS reload with a config rendered since, say).
          if (aliveRefused && served) relisten();
        }
      }
    })().catch(() => undefined);
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
        const ac = new AbortController();
        const session = { ac, heard: performance.now(), nextSeq: 1n, closed: false };
        running.set(reply, session);
        const keepaliveMs = execKeepaliveMs(req.keepalive);
        let lease: ReturnType<typeof setTimeout> | undefined;
        const checkLease = (): void => {
          if (aliveRefused) return;
          if (linkDown) session.heard = performance.now();
          const silentMs = performance.now() - session.heard;
          if (silentMs < EXEC_KEEPALIVE_MISSES * keepaliveMs) {
            lease = setTimeout(checkLease, EXEC_KEEPALIVE_MISSES * keepaliveMs - silentMs);
            return;
          }
          this.log.warn({ replySubject: reply, sandboxId: req.sandboxId, silentMs: Math.round(silentMs) }, 'exec caller gone (no keepalive names it): killing the command');
          ac.abort();
        };
        if (keepaliveMs > 0) lease = setTimeout(checkLease, EXEC_KEEPALIVE_MISSES * keepaliveMs);
        const emit = (out: HostExecOutput): void => {
          // Ended at a reconnect (sentWhileDown): its caller has had its error.
          if (session.closed) return;
          session.nextSeq = out.seq + 1n;
          if (linkDown) sentWhileDown.set(reply, session);
          this.reply(reply, toBinary(HostExecOutputSchema, out), () => toBinary(HostExecOutputSchema, create(HostExecOutputSchema, { seq: out.seq, payload: { case: 'error', value: { kind: 'internal', message: 'an exec output piece did not fit a NATS message' } } })));
        };
        void handler(req, emit, ac.signal)
          .catch((e: unknown) => this.log.warn({ err: e }, 'exec relay failed'))
          .finally(() => {
            clearTimeout(lease);
            running.delete(reply);
          });
      },
    });
    const cancels = this.nc.subscribe(subjects.execCancel(this.hostId), {
      callback: (err, m) => {
        if (err) return;
        try {
          const replySubject = fromBinary(HostExecCancelSchema, m.data).replySubject;
          const ac = running.get(replySubject)?.ac;
          if (!ac) return; // it has exited already
          this.log.info({ replySubject }, 'exec cancelled by its caller: killing the command');
          ac.abort();
        } catch (e) {
          this.log.warn({ err: e }, 'undecodable exec cancel ignored');
        }
      },
    });
    let alive: Subscription | undefined;
    let retryAlive: ReturnType<typeof setTimeout> | undefined;
    const listenAlive = (): void => {
      clearTimeout(retryAlive);
      alive?.unsubscribe();
      // Taken as listened to until the server says otherwise (a refusal comes within a round
      // trip): every exec counts as heard from here, so none is killed for the gap before.
      if (aliveRefused) heardAll();
      aliveRefused = false;
      alive = this.nc.subscribe(subjects.execAlive(this.hostId), {
        callback: (err, m) => {
          if (err) {
            if (!aliveRefused) this.log.error({ err, subject: subjects.execAlive(this.hostId) }, "exec keepalives cannot be received (render the NATS config again and reload NATS: this host's user may not subscribe to them; asked again every minute): commands are not ended when their caller goes silent");
            aliveRefused = true;
            // nats.js drops a refused subscription: asked again in a while, and on a reconnect.
            retryAlive = setTimeout(() => served && listenAlive(), ALIVE_RETRY_MS);
            retryAlive.unref?.();
            return;
          }
          try {
            const now = performance.now();
            for (const r of fromBinary(HostExecAliveSchema, m.data).replySubjects) {
              const session = running.get(r);
              if (session) session.heard = now;
              else this.nc.publish(r, NO_SUCH_EXEC(this.hostId));
            }
          } catch (e) {
            this.log.warn({ err: e }, 'undecodable exec keepalive ignored');
          }
        },
      });
    };
    relisten = listenAlive;
    listenAlive();
    this.subs.push(sub, cancels);
    return () => {
      served = false;
      clearTimeout(retryAlive);
      (status as { stop?: () => void }).stop?.();
      sub.unsubscribe();
      cancels.unsubscribe();
      alive?.unsubscribe();
    };
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
        void handler(req)
          .then((res) => this.reply(m.reply!, toBinary(HostFileResponseSchema, res), () => toBinary(HostFileResponseSchema, create(HostFileResponseSchema, { error: { kind: 'invalid_argument', field: 'max_bytes', message: `the answer is larger than the ${this.nc.info?.max_payload ?? 0}-byte NATS message limit: read in smaller pieces` } }))))
          .catch((e: unknown) => this.log.warn({ err: e }, 'file relay failed'));
      },
    });
    this.subs.push(sub);
    return () => sub.unsubscribe();
  }
}
