// WorkBus over NATS (scheduler side): work to hosts through JetStream, results back
// through a durable consumer, heartbeats and events on core subjects, exec and file
// access as request/reply relays.
import { randomBytes } from 'node:crypto';
import { createInbox } from 'nats';
import type { JetStreamClient, JetStreamManager, JsMsg, NatsConnection, Subscription } from 'nats';
import type { Logger } from 'pino';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import { BinaryReader } from '@bufbuild/protobuf/wire';
import { durationFromMs } from '@bufbuild/protobuf/wkt';
import type { LeaderTerm, WorkBus } from '../../domain/ports.ts';
import {
  HeartbeatSchema,
  HostEventSchema,
  HostExecAliveSchema,
  HostExecCancelSchema,
  HostExecOutputSchema,
  HostExecRequestSchema,
  HostFileRequestSchema,
  HostFileResponseSchema,
  HostResultBatchSchema,
  HostResultSchema,
  HostWorkSchema,
} from '../../domain/messages.ts';
import type {
  HeartbeatMsg,
  HostEventMsg,
  HostExecOutputMsg,
  HostExecRequestMsg,
  HostFileRequestMsg,
  HostFileResponseMsg,
  HostResultMsg,
  HostWorkMsg,
} from '../../domain/messages.ts';
import { AsyncQueue } from '../grpc/queue.ts';
import { ForkfleetError } from '../../../proto/errors.ts';
import { ensureResultsConsumer, ensureStreams, RESULTS_CONSUMER, retryOnConsumerStoreRace, STREAM_RESULTS, STREAM_WORK, subjects, workConsumer } from './subjects.ts';
import { JsPublisher } from './js-publisher.ts';
import { consumeDurable } from './durable-consumer.ts';
import { isBatch, RESULT_BATCH_HEADER, settleAfter, SubjectBatcher } from './batcher.ts';

/** On every work message: this scheduler reads result batches (hostwork.proto, "Batches"). */
const WORK_HEADERS = { [RESULT_BATCH_HEADER]: '1' } as const;

/**
 * Exec output a replica holds that its callers have not read, all execs together
 * (NatsWorkBus.exec): one exec may return up to 64 MiB of each stream, in bursts, to a caller
 * on a slower link than the host's, so no single call is capped below that.
 */
export const EXEC_UNREAD_MAX_BYTES = 1 << 30;

/**
 * How often a replica names, per host, the execs whose output it still waits for
 * (HostExecAlive; HostExecRequest.keepalive): a host kills a command its caller has not named
 * for 4 of these, so the commands of a replica that died or lost NATS end within ~20 s instead
 * of running on to their timeout (up to an hour) with nobody to read them.
 */
export const EXEC_KEEPALIVE_MS = 5000;

/** Reply subjects per HostExecAlive message (~60 bytes each: well under any NATS max payload). */
const EXEC_ALIVE_PER_MESSAGE = 1000;

/** Heartbeat field `repeated VmStatus vms` (proto/forkfleet/v1/hostwork.proto). */
const HEARTBEAT_VMS_FIELD = 8;

/**
 * Decodes a heartbeat, leaving its VM list (by far its largest part: one status per VM, and
 * every replica hears every host's heartbeat each interval) as bytes until something reads
 * `vms`: only the leader's lifecycle and reclaim checks do, and only for the latest beat.
 */
export function decodeHeartbeat(data: Uint8Array): HeartbeatMsg {
  const r = new BinaryReader(data);
  // Runs of consecutive fields as [start, end) ranges: an encoder writes a repeated field's
  // entries one after another (protobuf-es does), so the VM list is usually one range, taken
  // without a copy, and the rest two (before and after it).
  const rest: Array<[number, number]> = [];
  const vms: Array<[number, number]> = [];
  while (r.pos < r.len) {
    const start = r.pos;
    const [fieldNo, wireType] = r.tag();
    r.skip(wireType, fieldNo);
    const runs = fieldNo === HEARTBEAT_VMS_FIELD ? vms : rest;
    const last = runs[runs.length - 1];
    if (last && last[1] === start) last[1] = r.pos;
    else runs.push([start, r.pos]);
  }
  if (vms.length === 0) return fromBinary(HeartbeatSchema, data);
  const bytesOf = (runs: Array<[number, number]>): Uint8Array => (runs.length === 1 ? data.subarray(runs[0]![0], runs[0]![1]) : Buffer.concat(runs.map(([a, b]) => data.subarray(a, b))));
  const hb = fromBinary(HeartbeatSchema, bytesOf(rest));
  const vmBytes = bytesOf(vms);
  let decoded: HeartbeatMsg['vms'] | undefined;
  Object.defineProperty(hb, 'vms', {
    enumerable: true,
    configurable: true,
    get: () => (decoded ??= fromBinary(HeartbeatSchema, vmBytes).vms),
    set: (v: HeartbeatMsg['vms']) => (decoded = v),
  });
  return hb;
}

export class NatsWorkBus implements WorkBus {
  private readonly js: JetStreamClient;
  private readonly publisher: JsPublisher;
  private readonly batcher: SubjectBatcher;
  /** Hosts whose last heartbeat said they read work batches (Heartbeat.reads_batches). */
  private readonly batchHosts = new Set<string>();
  private readonly subs: Subscription[] = [];
  private nonce = randomBytes(6).toString('hex');
  /** Exec output received and not yet read by its callers, all execs together (exec()). */
  private execUnread = 0;
  /** The same, by the owner each exec() names (a tenant). */
  private readonly execUnreadBy = new Map<string, number>();
  /** The most of it this replica holds (EXEC_UNREAD_MAX_BYTES); one owner holds at most half. */
  execUnreadMax = EXEC_UNREAD_MAX_BYTES;
  /** HostExecRequest.keepalive of the execs this replica sends (EXEC_KEEPALIVE_MS; tests shorten it). */
  execKeepaliveMs = EXEC_KEEPALIVE_MS;
  /** Reply subjects of the execs waiting for output, by host: named in HostExecAlive every execKeepaliveMs. */
  private readonly execsWaiting = new Map<string, Set<string>>();
  private aliveTimer: ReturnType<typeof setInterval> | undefined;
  /** The interval aliveTimer runs at: the shortest keepalive of the execs waiting when it was set. */
  private aliveEveryMs = Number.POSITIVE_INFINITY;

  /** performance.now() of the last (re)connect; undefined while disconnected. */
  private connectedAt: number | undefined = performance.now();

  /** Asked before host work is published: an error (no longer leading) fails the send instead. */
  private workFence: (() => Error | undefined) | undefined;

  /** The leader term stamped on host work (newTerm); 0 before the first. */
  private term: LeaderTerm = { term: 0n, cluster: 0n };

  private constructor(
    private readonly nc: NatsConnection,
    private readonly jsm: JetStreamManager,
    private readonly streamReplicas: number,
    private readonly log: Logger | undefined,
  ) {
    this.js = nc.jetstream();
    this.publisher = JsPublisher.of(nc);
    this.batcher = new SubjectBatcher(this.publisher, WORK_HEADERS, () => this.workFence?.());
    void (async () => {
      for await (const st of nc.status()) {
        if (st.type === 'disconnect') this.connectedAt = undefined;
        else if (st.type === 'reconnect') this.connectedAt = performance.now();
      }
    })().catch(() => undefined);
  }

  /**
   * Host work goes out only while `fence` returns undefined (the scheduler: while it holds the
   * leader lease), checked when each message is published, not when the step was queued: a
   * deposed leader's queued step could otherwise reach a host after the new leader acted.
   */
  setWorkFence(fence: () => Error | undefined): void {
    this.workFence = fence;
  }

  /**
   * A new sender nonce for work message ids: called when this scheduler starts a leader term.
   * A replica that lost its lease and won it back within JetStream's duplicate window would
   * otherwise send a step again under the id it had used before, and have it dropped.
   * `term` goes into every work message from now on: agents drop work of an older term than
   * they have taken (HostWork.leader_term).
   */
  newTerm(term: LeaderTerm = { term: 0n, cluster: 0n }): void {
    // Work an earlier term queued behind a PubAck is not sent in this one.
    this.batcher.failAll(new ForkfleetError('unavailable', 'host work queued in an earlier leader term is not sent', { retryable: true }));
    this.nonce = randomBytes(6).toString('hex');
    this.term = term;
  }

  connectedForMs(): number {
    return this.connectedAt === undefined || this.nc.isClosed() ? 0 : performance.now() - this.connectedAt;
  }

  /** `streamReplicas`: copies of each JetStream stream (FF_NATS_STREAM_REPLICAS). */
  static async create(nc: NatsConnection, streamReplicas = 1, log?: Logger): Promise<NatsWorkBus> {
    const jsm = await nc.jetstreamManager();
    await ensureStreams(jsm, streamReplicas);
    await ensureResultsConsumer(jsm);
    return new NatsWorkBus(nc, jsm, streamReplicas, log);
  }

  async forgetHost(hostId: string): Promise<void> {
    try {
      await retryOnConsumerStoreRace(() =>
        this.jsm.consumers.delete(STREAM_WORK, workConsumer(hostId)).catch((e: unknown) => {
          // Already gone (never made, or deleted by an earlier call): nothing to do.
          if (!/consumer not found/i.test((e as Error).message)) throw e;
          return true;
        }),
      );
    } catch (e) {
      throw new ForkfleetError('unavailable', `deleting the work queue of host ${hostId}: ${(e as Error).message}`, { cause: e });
    }
    await this.jsm.streams.purge(STREAM_WORK, { filter: subjects.work(hostId) });
  }

  async sendWork(hostId: string, work: HostWorkMsg): Promise<void> {
    // JetStream dedup window: a re-publish of the same step attempt is dropped.
    // The sender's nonce keeps a new leader's re-send of the same attempt from being dropped
    // as a duplicate of the old leader's message (the agent dedups by op + step anyway).
    // The host is part of the id: JetStream dedups per stream, and FF_WORK takes every host's
    // subject (the same op and step can go to two hosts, e.g. a stale-snapshot delete).
    const msgId = `${hostId}/${work.opId}/${work.stepId}/${work.attempt}/${this.nonce}`;
    const { term, cluster, store = 0n } = this.term;
    const bytes = toBinary(HostWorkSchema, term > 0n ? { ...work, leaderTerm: term, leaderCluster: cluster, leaderStore: store } : work);
    // Steps for the same host in the same turn go out as one message (batcher.ts), to hosts
    // that said in their heartbeats that they read batches.
    try {
      if (this.batchHosts.has(hostId)) {
        await this.batcher.publish(subjects.work(hostId), bytes, msgId);
      } else {
        const refused = this.workFence?.();
        if (refused) throw refused;
        await this.publisher.publish(subjects.work(hostId), bytes, { msgId, headers: WORK_HEADERS });
      }
    } catch (e) {
      // No stream takes the work subject (a nats-server that lost its store): made again, so
      // the step's next send gets through.
      if (/no stream takes this subject/.test(e instanceof Error ? e.message : '')) this.repairStreams();
      throw e;
    }
  }

  private repairing = false;
  private repairedAt = 0;

  /** ensureStreams, at most once every 5 s, never twice at once; a failure is logged. */
  private repairStreams(): void {
    if (this.repairing || performance.now() - this.repairedAt < 5000) return;
    this.repairing = true;
    this.log?.warn('a JetStream stream is missing (did nats-server lose its store?): making the streams again');
    ensureStreams(this.jsm, this.streamReplicas)
      .catch((e: unknown) => this.log?.warn({ err: e }, 'could not make the JetStream streams again'))
      .finally(() => {
        this.repairing = false;
        this.repairedAt = performance.now();
      });
  }

  /**
   * Consumes the results queue. A results consumer or stream that is lost (a nats-server that
   * restarted without its store, a stream deleted by hand) is made again, with every stream,
   * and consumed anew (durable-consumer.ts): otherwise no result would come back, and no step
   * could be sent, until the scheduler restarted.
   */
  async consumeResults(onResult: (r: HostResultMsg, ack: () => void, fromHost: string) => void | Promise<void>): Promise<() => Promise<void>> {
    const prefix = subjects.result('');
    const handle = async (m: JsMsg): Promise<void> => {
      let rs: HostResultMsg[];
      try {
        rs = isBatch(m) ? fromBinary(HostResultBatchSchema, m.data).items : [fromBinary(HostResultSchema, m.data)];
      } catch (e) {
        // Undecodable: never redelivered. Said, with where it came from: the steps it answered
        // wait out their timeouts, and a host sending such results needs looking at.
        this.log?.warn({ err: e, subject: m.subject, seq: m.seq, bytes: m.data.length }, 'undecodable result message dropped');
        m.term();
        return;
      }
      // The subject names the host that sent it (its NATS user may publish only there).
      const fromHost = m.subject.startsWith(prefix) ? m.subject.slice(prefix.length) : '';
      const { ack } = settleAfter(rs.length, () => m.ack(), () => m.nak(1000));
      try {
        for (const r of rs) await onResult(r, ack, fromHost);
      } catch {
        m.nak(1000);
      }
    };
    return consumeDurable({
      nc: this.nc,
      jsm: this.jsm,
      js: this.js,
      stream: STREAM_RESULTS,
      consumer: RESULTS_CONSUMER,
      maxMessages: 256,
      ensure: async () => {
        await ensureStreams(this.jsm, this.streamReplicas);
        await ensureResultsConsumer(this.jsm);
      },
      onMessage: handle,
      onGone: (why) => this.log?.warn({ why }, 'the results queue is gone (did nats-server lose its streams?): making the streams and the queue again'),
      onRetry: (e) => this.log?.warn({ err: e }, 'could not consume the results queue again; retrying'),
    });
  }

  onHeartbeat(cb: (hb: HeartbeatMsg) => void): () => void {
    /** When an undecodable heartbeat was last told of, by subject (its host's). */
    const undecodable = new Map<string, number>();
    const sub = this.nc.subscribe(subjects.allHeartbeats, {
      callback: (err, m) => {
        if (err) return;
        let hb: HeartbeatMsg;
        try {
          hb = decodeHeartbeat(m.data);
        } catch (e) {
          // Ignored, and told at most once a minute per host (an agent that sends one sends them all alike).
          const now = performance.now();
          if (now - (undecodable.get(m.subject) ?? Number.NEGATIVE_INFINITY) >= 60_000) {
            undecodable.set(m.subject, now);
            this.log?.warn({ err: e, subject: m.subject }, 'dropped a heartbeat that does not decode: its host is not heard');
          }
          return;
        }
        // The subject names the host that sent it (an agent may publish only on its own):
        // a heartbeat for another host would let one host mark another's VMs gone.
        if (m.subject !== subjects.heartbeat(hb.hostId)) return void this.log?.warn({ subject: m.subject, hostId: hb.hostId }, 'dropped a heartbeat for another host than its subject names');
        if (hb.readsBatches) this.batchHosts.add(hb.hostId);
        else this.batchHosts.delete(hb.hostId);
        try {
          cb(hb);
        } catch {
          /* the handler's failure is not the bus's */
        }
      },
    });
    this.subs.push(sub);
    return () => sub.unsubscribe();
  }

  onHostEvent(cb: (e: HostEventMsg) => void): () => void {
    const sub = this.nc.subscribe(subjects.allEvents, {
      callback: (err, m) => {
        if (err) return;
        try {
          const e = fromBinary(HostEventSchema, m.data);
          // Likewise: a host speaks only for itself.
          if (m.subject === subjects.event(e.hostId)) cb(e);
        } catch {
          /* ignored */
        }
      },
    });
    this.subs.push(sub);
    return () => sub.unsubscribe();
  }

  exec(hostId: string, req: HostExecRequestMsg, opts: { timeoutMs: number; signal?: AbortSignal; owner?: string }): AsyncIterable<HostExecOutputMsg> {
    // Under the host's own exec-output subject: its NATS user may publish there and nowhere
    // else, so a long exec's output stream needs no response-permission window.
    const inbox = createInbox(subjects.execOut(hostId));
    const q = new AsyncQueue<HostExecOutputMsg>();
    // Output that arrived and that the caller has not read yet (the host sends it without
    // flow control): bounded for all calls together (execUnreadMax), or callers that never
    // read could make a replica hold all of their commands' output; and per owner (a tenant)
    // to half of that, or one tenant's unread calls (finished commands whose streams it keeps
    // open) could hold it all, and every other tenant's exec would fail at its first output.
    const owner = opts.owner ?? '';
    const ownerMax = Math.floor(this.execUnreadMax / 2);
    let unread = 0;
    const held = (n: number): void => {
      unread += n;
      this.execUnread += n;
      const mine = (this.execUnreadBy.get(owner) ?? 0) + n;
      if (mine > 0) this.execUnreadBy.set(owner, mine);
      else this.execUnreadBy.delete(owner);
    };
    // Dropped or never to be read (the call failed at the limit, or its caller stopped reading).
    const release = (): void => held(-unread);
    const bytesOf = (o: HostExecOutputMsg): number => (o.payload.case === 'stdout' || o.payload.case === 'stderr' ? o.payload.value.length : 0);
    // The caller is gone before the exit: the host kills the command (HostExecCancel), so a
    // cancelled or abandoned exec leaves nothing running in the guest.
    const cancelOnHost = (): void => {
      try {
        this.nc.publish(subjects.execCancel(hostId), toBinary(HostExecCancelSchema, create(HostExecCancelSchema, { replySubject: inbox })));
      } catch {
        // A closed connection: the host's own timeout for the command still applies.
      }
    };
    // Armed once the request went out (a closed or draining connection refuses the reply
    // subscription, and the publish).
    let timer: ReturnType<typeof setTimeout> | undefined;
    let sub: Subscription | undefined;
    let waiting = false;
    /** The host sent the exit (or an error): nothing runs there for this call any more. */
    let answered = false;
    /** The seq the host's next piece must carry: it numbers them 1, 2, ... (core NATS drops what arrives while a connection is down). */
    let nextSeq = 1n;
    const finish = (): void => {
      clearTimeout(timer);
      sub?.unsubscribe();
      if (waiting) this.stopWaiting(hostId, inbox);
      waiting = false;
    };
    const subscribe = (): Subscription => this.nc.subscribe(inbox, {
      callback: (err, m) => {
        if (q.isEnded) return;
        if (err) {
          finish();
          q.fail(new ForkfleetError('unavailable', `exec relay failed: ${err.message}`, { cause: err, retryable: false }));
          return;
        }
        // An empty message means "no responders" for the initial request.
        if (m.data.length === 0) {
          finish();
          q.fail(new ForkfleetError('unavailable', `host ${hostId} is not answering`));
          return;
        }
        // Decoded inside a try: this callback runs inside nats.js' read loop, and a throw out of
        // it ends that loop, so one bad message would stop every reply, result and heartbeat
        // this replica reads until the connection is found stale.
        let out: HostExecOutputMsg;
        try {
          out = fromBinary(HostExecOutputSchema, m.data);
        } catch (e) {
          finish();
          q.fail(new ForkfleetError('internal', `exec on host ${hostId}: its output did not decode`, { cause: e, retryable: false }));
          cancelOnHost();
          return;
        }
        // Seq 0: the host runs no exec for this call, though this one still waits (its answer to
        // a keepalive naming it, agent-bus.ts NO_SUCH_EXEC): the exit, or the request, was lost in
        // transit (NATS drops what is published while either side is disconnected), or an agent
        // restart forgot the command. A lost tail is never seen by the seq check below: without
        // this the call waited out its whole timeout (up to an hour) for an exit not coming.
        if (out.seq === 0n) {
          finish();
          release();
          const why = out.payload.case === 'error' ? out.payload.value.message : `host ${hostId} runs no exec for this call`;
          q.failNow(new ForkfleetError('unavailable', `exec on host ${hostId}: ${why}; what it printed is not known whole`, { retryable: false }));
          return;
        }
        // A piece missing: the output has a hole (a reconnect or a slow-consumer cut dropped it
        // in transit), and an exit after it would report the call whole. Failed, and the
        // command stopped: the caller cannot know what it missed.
        if (out.seq !== nextSeq) {
          finish();
          release();
          q.failNow(new ForkfleetError('unavailable', `exec on host ${hostId}: output was lost in transit (piece ${nextSeq} missing, piece ${out.seq} came), so the command was stopped; what it printed is not known whole`, { retryable: false }));
          if (out.payload.case !== 'exit' && out.payload.case !== 'error') cancelOnHost();
          return;
        }
        nextSeq++;
        const bytes = bytesOf(out);
        held(bytes);
        // Only output counts against the bounds: an exit (no bytes) always gets through.
        const over = bytes === 0 ? undefined : (this.execUnreadBy.get(owner) ?? 0) > ownerMax ? `more than ${ownerMax} bytes of ${owner ? `tenant ${owner}'s` : 'this scheduler\'s own'} exec output (half of what it may hold)` : this.execUnread > this.execUnreadMax ? `more than ${this.execUnreadMax} bytes of exec output, all calls together,` : undefined;
        if (over) {
          finish();
          release();
          q.failNow(new ForkfleetError('resource_exhausted', `exec output not read: ${over} waited on this scheduler for callers to read it, so the command was stopped`, { retryable: false }));
          cancelOnHost();
          return;
        }
        q.push(out);
        if (out.payload.case === 'exit' || out.payload.case === 'error') {
          answered = true;
          finish();
          q.end();
        }
      },
    });
    try {
      sub = subscribe();
      const keepaliveMs = this.execKeepaliveMs;
      this.nc.publish(subjects.exec(hostId), toBinary(HostExecRequestSchema, create(HostExecRequestSchema, { ...req, keepalive: durationFromMs(keepaliveMs) })), { reply: inbox });
      this.startWaiting(hostId, inbox, keepaliveMs);
      waiting = true;
      timer = setTimeout(() => {
        // After the request went out: the command may have run, so not retryable (Exec is not
        // deduplicated). Only "no responders" above says it never reached the host.
        q.fail(new ForkfleetError('deadline_exceeded', `exec on host ${hostId} timed out after ${opts.timeoutMs} ms`, { retryable: false }));
        finish();
        cancelOnHost();
      }, opts.timeoutMs);
    } catch (e) {
      // The connection is closed or draining: the request did not go out.
      finish();
      q.fail(new ForkfleetError('unavailable', `exec relay to host ${hostId} failed: ${(e as Error).message}`, { cause: e }));
      return q;
    }
    opts.signal?.addEventListener('abort', () => {
      if (!q.isEnded) {
        finish();
        q.fail(new ForkfleetError('cancelled', 'exec cancelled'));
        cancelOnHost();
      }
    });
    return {
      [Symbol.asyncIterator]: () => {
        const it = q[Symbol.asyncIterator]();
        return {
          next: async () => {
            const r = await it.next();
            if (!r.done) held(-bytesOf(r.value));
            return r;
          },
          return: () => {
            release();
            // The caller stopped reading before the exit: as a cancel, the command ends.
            if (!answered && !q.isEnded) {
              finish();
              cancelOnHost();
            }
            return it.return!();
          },
        };
      },
    };
  }

  /** Names this exec in the host's HostExecAlive from now on (execKeepaliveMs apart). */
  private startWaiting(hostId: string, inbox: string, everyMs: number): void {
    let set = this.execsWaiting.get(hostId);
    if (set === undefined) this.execsWaiting.set(hostId, (set = new Set()));
    set.add(inbox);
    // One timer for all: set again when an exec asks for a shorter keepalive than it runs at.
    if (this.aliveTimer !== undefined && everyMs >= this.aliveEveryMs) return;
    clearInterval(this.aliveTimer);
    this.aliveEveryMs = everyMs;
    this.aliveTimer = setInterval(() => this.sendAlive(), everyMs);
    // Not what keeps a process alive: the exec's own timer and subscription are.
    this.aliveTimer.unref?.();
  }

  private stopWaiting(hostId: string, inbox: string): void {
    const set = this.execsWaiting.get(hostId);
    if (!set?.delete(inbox) || set.size > 0) return;
    this.execsWaiting.delete(hostId);
    if (this.execsWaiting.size === 0) {
      clearInterval(this.aliveTimer);
      this.aliveTimer = undefined;
      this.aliveEveryMs = Number.POSITIVE_INFINITY;
    }
  }

  private sendAlive(): void {
    for (const [hostId, set] of this.execsWaiting) {
      const all = [...set];
      for (let i = 0; i < all.length; i += EXEC_ALIVE_PER_MESSAGE) {
        try {
          this.nc.publish(subjects.execAlive(hostId), toBinary(HostExecAliveSchema, create(HostExecAliveSchema, { replySubjects: all.slice(i, i + EXEC_ALIVE_PER_MESSAGE) })));
        } catch {
          // A closed connection: the execs fail on their own (no output reaches this replica),
          // and the host ends their commands once they go unnamed.
          return;
        }
      }
    }
  }

  get maxPayload(): number {
    // What the server told this connection (1 MiB unless configured otherwise).
    return this.nc.info?.max_payload ?? 1 << 20;
  }

  async file(hostId: string, req: HostFileRequestMsg, opts: { timeoutMs: number }): Promise<HostFileResponseMsg> {
    try {
      const m = await this.nc.request(subjects.file(hostId), toBinary(HostFileRequestSchema, req), { timeout: opts.timeoutMs });
      return fromBinary(HostFileResponseSchema, m.data);
    } catch (e) {
      throw new ForkfleetError('unavailable', `file relay to host ${hostId} failed: ${(e as Error).message}`, { cause: e });
    }
  }

  close(): void {
    for (const s of this.subs) s.unsubscribe();
    clearInterval(this.aliveTimer);
    this.aliveTimer = undefined;
  }
}
