// Control-plane isolation (issue #9): host agents authenticate to a real nats-server with their
// own NKey and may use only their own subjects; the scheduler user has full rights.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { AckPolicy, connect, createInbox, ErrorCode } from 'nats';
import type { NatsConnection, NatsError } from 'nats';
import { create, toBinary } from '@bufbuild/protobuf';
import { durationFromMs } from '@bufbuild/protobuf/wkt';
import { pino } from 'pino';
import { startNats } from '../../../services/testkit/nats.ts';
import type { NatsServer } from '../../../services/testkit/nats.ts';
import { EXEC_UNREAD_MAX_BYTES, NatsWorkBus } from '../../../services/adapters/nats/bus.ts';
import { agentConnectOptions, hostPermissions, nkeyConnectOptions } from '../../../services/adapters/nats/auth.ts';
import { STREAM_EVENTS, STREAM_RESULTS, STREAM_WORK, subjects, WORK_ACK_WAIT_MS, workConsumer } from '../../../services/adapters/nats/subjects.ts';
import { NatsAgentBus } from './agent-bus.ts';
import type { WorkControl } from '../../domain/agent.ts';
import { BATCH_HEADER } from '../../../services/adapters/nats/batcher.ts';
import { headers as natsHeaders } from 'nats';
import { JsPublisher } from '../../../services/adapters/nats/js-publisher.ts';
import { HeartbeatSchema, HostEventSchema, HostExecOutputSchema, HostFileRequestSchema, HostFileResponseSchema, HostExecRequestSchema, HostResultSchema, HostWorkBatchSchema, HostWorkSchema } from '../../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type { HostResultMsg, HeartbeatMsg, HostWorkMsg } from '../../../services/domain/messages.ts';

import { startAgent, type AgentProcess } from '../../../services/testkit/agent.ts';
import { spawn } from 'node:child_process';
import { generateKeyPairSync } from 'node:crypto';
import { mkdirSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { tempDir } from '../../../services/testkit/proc.ts';

const log = pino({ level: 'silent' });

function waitUntil<T>(what: string, get: () => T | undefined, ms = 10_000): Promise<T> {
  return new Promise((resolve, reject) => {
    const until = Date.now() + ms;
    const t = setInterval(() => {
      const v = get();
      if (v !== undefined) {
        clearInterval(t);
        resolve(v);
      } else if (Date.now() > until) {
        clearInterval(t);
        reject(new Error(`timed out waiting for ${what}`));
      }
    }, 20);
  });
}

/** Permission violations the server reported on this connection (operation + subject). */
function violations(nc: NatsConnection): string[] {
  const out: string[] = [];
  void (async () => {
    for await (const s of nc.status()) {
      if (s.permissionContext) out.push(`${s.permissionContext.operation} ${s.permissionContext.subject}`);
    }
  })();
  return out;
}

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

describe('NATS authorization: each host agent may use only its own subjects', () => {
  let nats: NatsServer;
  let sched: NatsConnection;
  let bus: NatsWorkBus;
  let agentA: NatsConnection;
  let busA: NatsAgentBus;
  const results: HostResultMsg[] = [];
  /** The host each result came from, by `${opId}/${stepId}` (consumeResults' `fromHost`). */
  const resultHosts = new Map<string, string>();
  const heartbeats: HeartbeatMsg[] = [];
  let stopResults: (() => Promise<void>) | undefined;

  const agentConn = (hostId: string, credOf = hostId): Promise<NatsConnection> =>
    connect({ servers: nats.url, name: `agent-${hostId}`, ...agentConnectOptions(hostId, nats.auth!.hostSeedFile(credOf)) });

  /** A new agent connection for `hostId` makes its bus, consumes, and receives the work of `opId`. */
  const newAgentReceives = async (hostId: string, opId: string): Promise<void> => {
    const conn = await agentConn(hostId);
    try {
      const b = await NatsAgentBus.create(conn, hostId, log, { streamWaitMs: 5000 });
      const got: HostWorkMsg[] = [];
      const stop = await b.consumeWork(async (w, ctl) => {
        got.push(w);
        ctl.ack();
      });
      try {
        await waitUntil(`${opId} on ${hostId}`, () => got.find((w) => w.opId === opId));
      } finally {
        await stop();
      }
    } finally {
      await conn.close();
    }
  };

  beforeAll(async () => {
    nats = await startNats({ auth: { hosts: ['host-a', 'host-b'] } });
    sched = await connect({ servers: nats.url, name: 'scheduler', ...nkeyConnectOptions(nats.auth!.schedulerSeedFile) });
    bus = await NatsWorkBus.create(sched);
    stopResults = await bus.consumeResults((r, ack, fromHost) => {
      results.push(r);
      resultHosts.set(`${r.opId}/${r.stepId}`, fromHost);
      ack();
    });
    bus.onHeartbeat((hb) => heartbeats.push(hb));
    agentA = await agentConn('host-a');
    busA = await NatsAgentBus.create(agentA, 'host-a', log, { streamWaitMs: 5000 });
  });

  afterAll(async () => {
    await stopResults?.();
    bus?.close();
    await agentA?.close().catch(() => undefined);
    await sched?.close().catch(() => undefined);
    await nats?.stop();
  });

  it('ownSubjects_whenAgentUsesItsCredential_workResultsHeartbeatsAndRelaysFlow', async () => {
    const got: HostWorkMsg[] = [];
    const stop = await busA.consumeWork(async (w, ctl) => {
      got.push(w);
      ctl.working();
      ctl.ack();
      await busA.publishResult(create(HostResultSchema, { opId: w.opId, stepId: w.stepId, hostId: 'host-a', attempt: w.attempt }));
    });
    await bus.sendWork('host-a', create(HostWorkSchema, { opId: 'op-own', stepId: 'create', attempt: 1 }));
    await waitUntil('work on host-a', () => got.find((w) => w.opId === 'op-own'));
    const r = await waitUntil('result from host-a', () => results.find((x) => x.opId === 'op-own'));
    expect(r.hostId).toBe('host-a');

    busA.publishHeartbeat(create(HeartbeatSchema, { hostId: 'host-a', seq: 7n }));
    await waitUntil('heartbeat from host-a', () => heartbeats.find((h) => h.hostId === 'host-a' && h.seq === 7n));
    const events: string[] = [];
    const unEvents = bus.onHostEvent((e) => events.push(`${e.hostId}/${e.message}`));
    await new Promise((r) => setTimeout(r, 100));
    busA.publishEvent(create(HostEventSchema, { hostId: 'host-a', message: 'own-event' }));
    await waitUntil('event from host-a', () => events.find((e) => e === 'host-a/own-event'));
    unEvents();

    // Exec relay: several replies to one request (allow_responses), then the exit.
    const unserve = busA.serveExec(async (_req, emit) => {
      emit(create(HostExecOutputSchema, { seq: 1n, payload: { case: 'stdout', value: new TextEncoder().encode('hi\n') } }));
      emit(create(HostExecOutputSchema, { seq: 2n, payload: { case: 'stdout', value: new TextEncoder().encode('there\n') } }));
      emit(create(HostExecOutputSchema, { seq: 3n, payload: { case: 'exit', value: { exitCode: 0 } } }));
    });
    await agentA.flush();
    const outs: string[] = [];
    for await (const o of bus.exec('host-a', create(HostExecRequestSchema, { sandboxId: 's', argv: ['true'] }), { timeoutMs: 5000 })) outs.push(o.payload.case ?? '');
    expect(outs).toEqual(['stdout', 'stdout', 'exit']);
    unserve();
    // File relay: one reply.
    const unserveFile = busA.serveFile(async (req) => create(HostFileResponseSchema, { data: new TextEncoder().encode(`read ${req.path}`) }));
    await agentA.flush(); // the subscription is registered on the server
    const res = await bus.file('host-a', create(HostFileRequestSchema, { sandboxId: 's', path: '/etc/hostname' }), { timeoutMs: 5000 });
    expect(new TextDecoder().decode(res.data)).toBe('read /etc/hostname');
    unserveFile();
    await stop();
  });

  it('heartbeatOrEventForAnotherHost_onAHostsOwnSubject_isDropped_soOneHostCannotSpeakForAnother', async () => {
    const events: string[] = [];
    const stopEvents = bus.onHostEvent((e) => events.push(`${e.hostId}/${e.message}`));
    // The subscription is registered on the server before host-a publishes (another
    // connection): otherwise its events can reach the server first and go to no one.
    await sched.flush();
    try {
      // host-a's credential may publish only on its own subjects, and does: naming host-b inside.
      agentA.publish(subjects.heartbeat('host-a'), toBinary(HeartbeatSchema, create(HeartbeatSchema, { hostId: 'host-b', seq: 100n })));
      agentA.publish(subjects.event('host-a'), toBinary(HostEventSchema, create(HostEventSchema, { hostId: 'host-b', message: 'forged' })));
      agentA.publish(subjects.heartbeat('host-a'), toBinary(HeartbeatSchema, create(HeartbeatSchema, { hostId: 'host-a', seq: 101n })));
      agentA.publish(subjects.event('host-a'), toBinary(HostEventSchema, create(HostEventSchema, { hostId: 'host-a', message: 'own' })));
      await waitUntil('host-a heartbeat 101', () => heartbeats.find((h) => h.hostId === 'host-a' && h.seq === 101n));
      await waitUntil('host-a event', () => events.find((e) => e === 'host-a/own'));
      expect(heartbeats.filter((h) => h.hostId === 'host-b')).toEqual([]);
      expect(events).toEqual(['host-a/own']);
    } finally {
      stopEvents();
    }
  });

  it('sendWork_manyStepsInOneTurn_goAsOneMessage_andEachResultComesBackFromItsHost', async () => {
    const jsm = await sched.jetstreamManager();
    const seq = async (stream: string): Promise<number> => (await jsm.streams.info(stream)).state.last_seq;
    const [work0, results0] = [await seq(STREAM_WORK), await seq(STREAM_RESULTS)];
    const got: HostWorkMsg[] = [];
    const stop = await busA.consumeWork(async (w, ctl) => {
      got.push(w);
      await busA.publishResult(create(HostResultSchema, { opId: w.opId, stepId: w.stepId, hostId: 'host-a', attempt: w.attempt }));
      ctl.ack();
    });
    // The scheduler batches only to a host whose heartbeat says it reads batches (the bus sets it).
    busA.publishHeartbeat(create(HeartbeatSchema, { hostId: 'host-a', seq: 8n }));
    await waitUntil('host-a heartbeat 8', () => heartbeats.find((h) => h.hostId === 'host-a' && h.seq === 8n && h.readsBatches));
    const steps = Array.from({ length: 10 }, (_, i) => `fork/${i}`);
    await Promise.all(steps.map((stepId) => bus.sendWork('host-a', create(HostWorkSchema, { opId: 'op-batch', stepId, attempt: 1 }))));
    await waitUntil('every step of the batch answered', () => (steps.every((s) => resultHosts.has(`op-batch/${s}`)) ? true : undefined));
    expect(got.filter((w) => w.opId === 'op-batch').map((w) => w.stepId)).toEqual(steps);
    expect(steps.map((s) => resultHosts.get(`op-batch/${s}`))).toEqual(steps.map(() => 'host-a'));
    // Ten steps sent in one turn were one stored message, and their ten results (ready in
    // the same turn on the agent) one or two more.
    expect(await seq(STREAM_WORK)).toBe(work0 + 1);
    expect((await seq(STREAM_RESULTS)) - results0).toBeLessThanOrEqual(2);
    // The batch was acked once all ten were: the work queue holds nothing for host-a.
    const ackPending = async (): Promise<number> => (await jsm.consumers.info(STREAM_WORK, workConsumer('host-a'))).num_ack_pending;
    for (let i = 0; i < 50 && (await ackPending()) > 0; i++) await sleep(100);
    expect(await ackPending()).toBe(0);
    await stop();
  });

  it('batches_onlyToPeersThatSayTheyReadThem_anOldAgentGetsSingleSteps_anOldSchedulerSingleResults', async () => {
    const jsm = await sched.jetstreamManager();
    const seq = async (stream: string): Promise<number> => (await jsm.streams.info(stream)).state.last_seq;
    const stop = await busA.consumeWork(async (w, ctl) => {
      await busA.publishResult(create(HostResultSchema, { opId: w.opId, stepId: w.stepId, hostId: 'host-a', attempt: w.attempt }));
      ctl.ack();
    });
    const answered = (op: string, n: number): Promise<boolean> => waitUntil(`${op} answered`, () => (Array.from({ length: n }, (_, i) => resultHosts.has(`${op}/s${i}`)).every(Boolean) ? true : undefined));
    // An agent whose heartbeat does not say reads_batches (an older agent): one message per step.
    agentA.publish(subjects.heartbeat('host-a'), toBinary(HeartbeatSchema, create(HeartbeatSchema, { hostId: 'host-a', seq: 9n })));
    await waitUntil('host-a heartbeat 9', () => heartbeats.find((h) => h.hostId === 'host-a' && h.seq === 9n));
    let w0 = await seq(STREAM_WORK);
    await Promise.all(Array.from({ length: 5 }, (_, i) => bus.sendWork('host-a', create(HostWorkSchema, { opId: 'op-old-agent', stepId: `s${i}`, attempt: 1 }))));
    await answered('op-old-agent', 5);
    expect(await seq(STREAM_WORK)).toBe(w0 + 5);
    // Work without the Ff-Result-Batch header (an older scheduler): one result message per step.
    w0 = await seq(STREAM_WORK);
    const r0 = await seq(STREAM_RESULTS);
    const raw = JsPublisher.of(sched);
    await Promise.all(Array.from({ length: 5 }, (_, i) => raw.publish(subjects.work('host-a'), toBinary(HostWorkSchema, create(HostWorkSchema, { opId: 'op-old-sched', stepId: `s${i}`, attempt: 1 })))));
    await answered('op-old-sched', 5);
    expect((await seq(STREAM_RESULTS)) - r0).toBe(5);
    busA.publishHeartbeat(create(HeartbeatSchema, { hostId: 'host-a', seq: 10n }));
    await waitUntil('host-a heartbeat 10', () => heartbeats.find((h) => h.hostId === 'host-a' && h.seq === 10n));
    await stop();
  });

  it('workBatch_whoseStepsEachKeepItAlive_sendsOneInProgressAckPerMessage_notOnePerStep', async () => {
    // 16 steps in one message, each keeping it alive as the agent does (every 5 s per step):
    // one +WPI per message and interval, not 16.
    const acks: string[] = [];
    const ackSub = sched.subscribe(`$JS.ACK.${STREAM_WORK}.>`, { callback: (_e, m) => acks.push(new TextDecoder().decode(m.data)) });
    await sched.flush();
    let steps = 0;
    let release!: () => void;
    const released = new Promise<void>((r) => (release = r));
    const stop = await busA.consumeWork(async (w, ctl) => {
      if (!w.opId.startsWith('op-wpi-')) return void ctl.ack();
      steps++;
      for (let i = 0; i < 3; i++) ctl.working();
      await released;
      ctl.ack();
    });
    try {
      const items = Array.from({ length: 16 }, (_, i) => create(HostWorkSchema, { opId: `op-wpi-${i}`, stepId: 'create', attempt: 1 }));
      const h = natsHeaders();
      h.set(BATCH_HEADER, '1');
      await sched.jetstream().publish(subjects.work('host-a'), toBinary(HostWorkBatchSchema, create(HostWorkBatchSchema, { items })), { headers: h });
      await waitUntil('every step delivered', () => (steps === 16 ? true : undefined));
      await sched.flush();
      await sleep(200);
      expect(acks.filter((a) => a.startsWith('+WPI'))).toHaveLength(1);
      release();
      await waitUntil('the batch acked', () => (acks.some((a) => a.startsWith('+ACK')) ? true : undefined));
    } finally {
      release();
      ackSub.unsubscribe();
      await stop();
    }
  });

  it('workGivenBackAfterItsConsumerStopped_isDeliveredToTheNextConsumerAtOnce_notAfterItsAckWait', async () => {
    // An agent stopping with steps still waiting for a slot gives them back once its delivery
    // has ended (Agent.stop): the next agent must not wait out the ack wait for them.
    let held: WorkControl | undefined;
    const stop = await busA.consumeWork(async (w, ctl) => {
      if (w.opId !== 'op-given-back') return void ctl.ack();
      held = ctl;
    });
    let stopped = false;
    try {
      await bus.sendWork('host-a', create(HostWorkSchema, { opId: 'op-given-back', stepId: 'create', attempt: 1 }));
      const ctl = await waitUntil('the step delivered', () => held);
      await stop();
      stopped = true;
      ctl.release();
      // newAgentReceives waits at most 10 s, a third of the ack wait.
      expect(WORK_ACK_WAIT_MS).toBeGreaterThanOrEqual(30_000);
      await newAgentReceives('host-a', 'op-given-back');
    } finally {
      if (!stopped) await stop();
    }
  });

  it('workQueue_deletedUnderARunningAgent_isCreatedAgainAndWorkFlows', async () => {
    const got: HostWorkMsg[] = [];
    const stop = await busA.consumeWork(async (w, ctl) => {
      got.push(w);
      ctl.ack();
    });
    // Stopped whatever happens: a consumer left running would take the next test's work.
    try {
      await bus.forgetHost('host-a');
      const jsm = await sched.jetstreamManager();
      for (let i = 0; i < 100; i++) {
        if (await jsm.consumers.info(STREAM_WORK, workConsumer('host-a')).then(() => true, () => false)) break;
        await sleep(100);
      }
      await bus.sendWork('host-a', create(HostWorkSchema, { opId: 'op-after-removal', stepId: 'create', attempt: 1 }));
      await waitUntil('work after the queue came back', () => got.find((w) => w.opId === 'op-after-removal'));
    } finally {
      await stop();
    }
  });

  it('workQueue_whoseStoreDirectoryTheServerLost_isMadeAgainByTheAgent_andItsQueuedWorkStillArrives', async () => {
    // The state a consumer re-made during its own deletion is left in (nats-server without its
    // PR 7886): alive, but its store directory gone, so every add answers "no such file".
    await bus.sendWork('host-a', create(HostWorkSchema, { opId: 'op-before-heal', stepId: 'create', attempt: 1 }));
    rmSync(join(nats.storeDir, 'jetstream', '$G', 'streams', STREAM_WORK, 'obs', workConsumer('host-a')), { recursive: true, force: true });
    await newAgentReceives('host-a', 'op-before-heal');
  });

  it('streamsLost_underARunningSchedulerAndAgent_areMadeAgain_andWorkAndResultsFlowAgain', async () => {
    // A nats-server that lost its JetStream store (or streams deleted by hand): the scheduler
    // makes the streams and its results queue again, the agent its work queue, and a step
    // sent again gets through, and its result back. Before, both waited forever.
    const got: HostWorkMsg[] = [];
    const stop = await busA.consumeWork(async (w, ctl) => {
      got.push(w);
      ctl.ack();
      await busA.publishResult(create(HostResultSchema, { opId: w.opId, stepId: w.stepId, hostId: 'host-a', attempt: w.attempt }));
    });
    try {
      const jsm = await sched.jetstreamManager();
      for (const stream of [STREAM_WORK, STREAM_RESULTS, STREAM_EVENTS]) await jsm.streams.delete(stream);
      // As the executor does: a step whose send failed is sent again.
      const until = Date.now() + 30_000;
      for (;;) {
        const sent = await bus.sendWork('host-a', create(HostWorkSchema, { opId: 'op-after-streams-lost', stepId: 'create', attempt: 1 })).then(() => true, (e: unknown) => {
          if (Date.now() > until) throw e;
          return false;
        });
        if (sent) break;
        await sleep(500);
      }
      await waitUntil('work after the streams came back', () => got.find((w) => w.opId === 'op-after-streams-lost'), 40_000);
      await waitUntil('its result', () => results.find((r) => r.opId === 'op-after-streams-lost'), 40_000);
    } finally {
      await stop();
    }
  }, 90_000);

  it('exec_whoseCallerDoesNotRead_failsResourceExhaustedOnceTooMuchOutputWaits_theCommandIsCancelled_andItsBytesAreReleased', async () => {
    let cancelled = false;
    const unserve = busA.serveExec(async (req, emit, signal) => {
      // 4 MiB of output, more than the 1 MiB this replica may hold unread (all calls together).
      for (let i = 1; i <= 16 && !signal.aborted; i++) {
        emit(create(HostExecOutputSchema, { seq: BigInt(i), payload: { case: 'stdout', value: new Uint8Array(256 * 1024) } }));
        await new Promise((r) => setTimeout(r, 10));
      }
      if (req.argv[0] === 'cat') return void emit(create(HostExecOutputSchema, { seq: 17n, payload: { case: 'exit', value: { exitCode: 0 } } }));
      await new Promise<void>((r) => {
        if (signal.aborted) return r();
        signal.addEventListener('abort', () => r());
        setTimeout(r, 5000);
      });
      cancelled = signal.aborted;
    });
    await agentA.flush();
    bus.execUnreadMax = 1 << 20;
    try {
      const it = bus.exec('host-a', create(HostExecRequestSchema, { sandboxId: 's', argv: ['yes'] }), { timeoutMs: 10_000 })[Symbol.asyncIterator]();
      await waitUntil('the command cancelled by the scheduler', () => cancelled || undefined);
      const err = await (async () => {
        for (;;) if ((await it.next()).done) return undefined;
      })().catch((e: unknown) => e as { kind?: string; message: string });
      expect(err?.kind).toBe('resource_exhausted');
      // What the failed call held is released: a caller that reads as output comes gets all 4 MiB.
      let got = 0;
      for await (const o of bus.exec('host-a', create(HostExecRequestSchema, { sandboxId: 's', argv: ['cat'] }), { timeoutMs: 10_000 })) if (o.payload.case === 'stdout') got += o.payload.value.length;
      expect(got).toBe(4 << 20);
    } finally {
      bus.execUnreadMax = EXEC_UNREAD_MAX_BYTES;
      unserve();
    }
  });

  it('exec_ofATenantWhoseOwnCallsHoldUnreadOutput_isNotRefused_theCallsOfTheTenantHoldingItAre', async () => {
    // argv[0]: KiB of output, in 64 KiB pieces, then the exit.
    let running = 0;
    const unserve = busA.serveExec(async (req, emit, signal) => {
      running++;
      const pieces = Number(req.argv[0]) / 64;
      for (let i = 1; i <= pieces && !signal.aborted; i++) {
        emit(create(HostExecOutputSchema, { seq: BigInt(i), payload: { case: 'stdout', value: new Uint8Array(64 * 1024) } }));
        await new Promise((r) => setTimeout(r, 5));
      }
      if (!signal.aborted) emit(create(HostExecOutputSchema, { seq: BigInt(pieces + 1), payload: { case: 'exit', value: { exitCode: 0 } } }));
      running--;
    });
    await agentA.flush();
    bus.execUnreadMax = 1 << 20;
    try {
      // Tenant a runs a command whose 1000 KiB of output it never reads (the stream stays open):
      // under the 1 MiB a replica holds, but more than the half one tenant may hold.
      const a = bus.exec('host-a', create(HostExecRequestSchema, { sandboxId: 's', argv: ['1000'] }), { timeoutMs: 10_000, owner: 'a' })[Symbol.asyncIterator]();
      await waitUntil('the command of tenant a to end', () => (running === 0 ? true : undefined));
      await sleep(200);
      // Tenant b's exec gets all of its output. It used to fail at its first piece: tenant
      // a's unread output had filled what the replica holds for every tenant.
      let got = 0;
      let exit: number | undefined;
      for await (const o of bus.exec('host-a', create(HostExecRequestSchema, { sandboxId: 's', argv: ['256'] }), { timeoutMs: 10_000, owner: 'b' })) {
        if (o.payload.case === 'stdout') got += o.payload.value.length;
        if (o.payload.case === 'exit') exit = o.payload.value.exitCode;
      }
      expect({ got, exit }).toEqual({ got: 256 * 1024, exit: 0 });
      // Tenant a's call is the one refused, naming its tenant.
      const err = await (async () => {
        for (;;) if ((await a.next()).done) return undefined;
      })().catch((e: unknown) => e as { kind?: string; message: string });
      expect(err).toMatchObject({ kind: 'resource_exhausted', message: expect.stringContaining("tenant a's exec output") });
    } finally {
      bus.execUnreadMax = EXEC_UNREAD_MAX_BYTES;
      unserve();
    }
  });

  it('exec_whenNoAgentServesTheHost_failsFastAsUnavailable', async () => {
    const t0 = Date.now();
    const err = await (async () => {
      for await (const _ of bus.exec('host-b', create(HostExecRequestSchema, { sandboxId: 's', argv: ['true'] }), { timeoutMs: 10_000 })) void _;
    })().then(
      () => undefined,
      (e: unknown) => e as { kind?: string; message: string },
    );
    expect(err?.message).toMatch(/not answering/);
    expect(Date.now() - t0).toBeLessThan(5000);
  });

  /** Serves execs that run until aborted or `runMs` passed; says which ended how. */
  const serveUntilAborted = (runMs: number): { ended: Map<string, 'killed' | 'exited'>; stop: () => void } => {
    const ended = new Map<string, 'killed' | 'exited'>();
    const stop = busA.serveExec(async (req, emit, signal) => {
      await new Promise<void>((r) => {
        const t = setTimeout(r, runMs);
        signal.addEventListener('abort', () => {
          clearTimeout(t);
          r();
        });
      });
      ended.set(req.argv[0]!, signal.aborted ? 'killed' : 'exited');
      if (!signal.aborted) emit(create(HostExecOutputSchema, { seq: 1n, payload: { case: 'exit', value: { exitCode: 0 } } }));
    });
    return { ended, stop };
  };

  it('exec_whoseCallerIsGoneWithoutACancel_isKilledOnceFourKeepaliveIntervalsPassUnnamed_anExecWithoutKeepaliveRunsOn', async () => {
    // A scheduler replica that dies (or loses NATS) sends no cancel: the command used to run
    // on to its timeout, up to an hour, with nobody to read its output.
    const { ended, stop } = serveUntilAborted(1500);
    await agentA.flush();
    try {
      const t0 = performance.now();
      const send = (name: string, keepaliveMs?: number): void =>
        sched.publish(subjects.exec('host-a'), toBinary(HostExecRequestSchema, create(HostExecRequestSchema, { sandboxId: 's', argv: [name], ...(keepaliveMs ? { keepalive: durationFromMs(keepaliveMs) } : {}) })), { reply: createInbox(subjects.execOut('host-a')) });
      send('leased', 100);
      send('old-scheduler'); // no keepalive asked: ends at its exit, as before
      await waitUntil('the leased command killed', () => ended.get('leased'));
      const killedAfter = performance.now() - t0;
      expect(ended.get('leased')).toBe('killed');
      expect(killedAfter).toBeGreaterThanOrEqual(390);
      expect(killedAfter).toBeLessThan(1400);
      await waitUntil('the other command to end', () => ended.get('old-scheduler'));
      expect(ended.get('old-scheduler')).toBe('exited');
    } finally {
      stop();
    }
  });

  it('exec_onAHostWhoseNatsConfigPredatesKeepalives_isNotKilledForTheirSilence_andTheAgentSaysWhy', async () => {
    // Agents upgraded before the NATS config was rendered again: their user may not subscribe to
    // ff.execalive.<host>, so no keepalive ever arrives; commands must not all die at 4 intervals.
    const old = await startNats({ auth: { hosts: ['host-old'], permissions: (h) => ({ ...hostPermissions(h), subscribe: { allow: hostPermissions(h).subscribe.allow.filter((x) => x !== subjects.execAlive(h)) } }) } });
    const said: string[] = [];
    const oldLog = pino({ level: 'error' }, { write: (x: string) => void said.push(x) });
    const sch = await connect({ servers: old.url, ...nkeyConnectOptions(old.auth!.schedulerSeedFile) });
    const oldBus = await NatsWorkBus.create(sch);
    const ag = await connect({ servers: old.url, ...agentConnectOptions('host-old', old.auth!.hostSeedFile('host-old')) });
    try {
      const agBus = await NatsAgentBus.create(ag, 'host-old', oldLog, { streamWaitMs: 5000 });
      let ended: string | undefined;
      agBus.serveExec(async (_req, emit, signal) => {
        await new Promise<void>((r) => {
          const t = setTimeout(r, 1200);
          signal.addEventListener('abort', () => (clearTimeout(t), r()));
        });
        ended = signal.aborted ? 'killed' : 'exited';
        if (!signal.aborted) emit(create(HostExecOutputSchema, { seq: 1n, payload: { case: 'exit', value: { exitCode: 0 } } }));
      });
      await ag.flush();
      oldBus.execKeepaliveMs = 100;
      const outs: string[] = [];
      for await (const o of oldBus.exec('host-old', create(HostExecRequestSchema, { sandboxId: 's', argv: ['long'] }), { timeoutMs: 10_000 })) outs.push(o.payload.case ?? '');
      expect({ outs, ended }).toEqual({ outs: ['exit'], ended: 'exited' });
      expect(said.join('')).toMatch(/exec keepalives cannot be received/);
      oldBus.close();
    } finally {
      await ag.close().catch(() => undefined);
      await sch.close().catch(() => undefined);
      await old.stop();
    }
  });

  it('exec_whoseCallerWaits_isNamedEveryKeepalive_andRunsPastItsLeaseToItsExit', async () => {
    // Runs for 5 keepalive intervals (its lease is 4), with room for a stalled event loop on a busy machine.
    const { ended, stop } = serveUntilAborted(2500);
    await agentA.flush();
    bus.execKeepaliveMs = 500;
    try {
      const outs: string[] = [];
      for await (const o of bus.exec('host-a', create(HostExecRequestSchema, { sandboxId: 's', argv: ['long'] }), { timeoutMs: 10_000 })) outs.push(o.payload.case ?? '');
      expect(outs).toEqual(['exit']);
      expect(ended.get('long')).toBe('exited');
    } finally {
      bus.execKeepaliveMs = 5000;
      stop();
    }
  });

  it('exec_whoseCallerStopsReadingBeforeTheExit_isCancelledOnTheHost', async () => {
    const { ended, stop } = serveUntilAborted(5000);
    await agentA.flush();
    try {
      const it = bus.exec('host-a', create(HostExecRequestSchema, { sandboxId: 's', argv: ['abandoned'] }), { timeoutMs: 10_000 })[Symbol.asyncIterator]();
      await sleep(200);
      await it.return!();
      await waitUntil('the abandoned command killed', () => ended.get('abandoned'), 3000);
      expect(ended.get('abandoned')).toBe('killed');
    } finally {
      stop();
    }
  });

  it('publishAsOtherHost_whenAgentAPublishesHostBSubjects_isRefused', async () => {
    const seen = violations(agentA);
    agentA.publish(subjects.heartbeat('host-b'), toBinary(HeartbeatSchema, create(HeartbeatSchema, { hostId: 'host-b', seq: 99n })));
    const err = await agentA
      .jetstream()
      .publish(subjects.result('host-b'), toBinary(HostResultSchema, create(HostResultSchema, { opId: 'op-forged', hostId: 'host-b' })))
      .then(() => undefined, (e: unknown) => e as NatsError);
    expect(err?.code).toBe(ErrorCode.PermissionsViolation);
    // Neither an exec answer for another host nor work for it may be injected either, nor
    // an exec cancel, even for its own host (only the scheduler sends those).
    agentA.publish(subjects.work('host-b'), new Uint8Array([1]));
    agentA.publish(`${subjects.execOut('host-b')}.X`, new Uint8Array([1]));
    agentA.publish(subjects.execCancel('host-a'), new Uint8Array([1]));
    await waitUntil('five publish violations', () => (seen.length >= 5 ? seen : undefined));
    expect(seen).toEqual(
      expect.arrayContaining([
        `publish ${subjects.heartbeat('host-b')}`,
        `publish ${subjects.result('host-b')}`,
        `publish ${subjects.work('host-b')}`,
        `publish ${subjects.execOut('host-b')}.X`,
        `publish ${subjects.execCancel('host-a')}`,
      ]),
    );
    await sleep(300);
    expect(heartbeats.some((h) => h.hostId === 'host-b')).toBe(false);
    expect(results.some((r) => r.opId === 'op-forged')).toBe(false);
    expect((await agentA.flush().then(() => 'open'))).toBe('open'); // refused, not disconnected
  });

  it('subscribeToOtherHost_whenAgentASubscribesOrPullsHostBWork_isRefused', async () => {
    const subErr = (subject: string): Promise<NatsError | undefined> =>
      new Promise((resolve) => {
        agentA.subscribe(subject, { callback: (err) => resolve(err ?? undefined) });
        setTimeout(() => resolve(undefined), 3000);
      });
    for (const s of [subjects.exec('host-b'), subjects.execCancel('host-b'), subjects.execAlive('host-b'), subjects.file('host-b'), subjects.work('host-b'), subjects.allResults, '_INBOX.>', '>']) {
      expect((await subErr(s))?.code, s).toBe(ErrorCode.PermissionsViolation);
    }
    // Host B's durable consumer: not readable, not pullable; no consumer of B's work can be made.
    const jsm = await agentA.jetstreamManager({ checkAPI: false });
    const refused = async (p: Promise<unknown>): Promise<string | undefined> => p.then(() => undefined, (e: unknown) => (e as NatsError).code);
    await bus.sendWork('host-b', create(HostWorkSchema, { opId: 'op-for-b', stepId: 'create', attempt: 1 }));
    expect(await refused(jsm.consumers.info(STREAM_WORK, workConsumer('host-b')))).toBe(ErrorCode.PermissionsViolation);
    expect(await refused(agentA.jetstream().consumers.get(STREAM_WORK, workConsumer('host-b')))).toBe(ErrorCode.PermissionsViolation);
    expect(await refused(jsm.consumers.add(STREAM_WORK, { durable_name: workConsumer('host-a'), ack_policy: AckPolicy.Explicit, filter_subject: subjects.work('host-b') }))).toBe(ErrorCode.PermissionsViolation);
    expect(await refused(jsm.consumers.add(STREAM_WORK, { durable_name: 'sneaky', ack_policy: AckPolicy.Explicit, filter_subject: subjects.work('host-b') }))).toBe(ErrorCode.PermissionsViolation);
    expect(await refused(NatsAgentBus.create(agentA, 'host-b', log, { streamWaitMs: 1000 }))).toBeDefined();
    // The work for B is still there for B.
    await newAgentReceives('host-b', 'op-for-b');
  });

  it('durableWork_whenAgentReconnectsWithItsCredential_resumesUnackedWork', async () => {
    await bus.sendWork('host-a', create(HostWorkSchema, { opId: 'op-while-away', stepId: 'create', attempt: 1 }));
    await newAgentReceives('host-a', 'op-while-away');
  });

  it('agentProcess_withFF_NATS_NKEY_FILE_heartbeatsAsItselfAndAnotherHostsKeyCannotStartIt', async () => {
    const dir = tempDir('ffnk-');
    const keyPath = join(dir, 'trusted.pem');
    const { publicKey } = generateKeyPairSync('ed25519');
    writeFileSync(keyPath, publicKey.export({ type: 'spki', format: 'pem' }));
    const env = { FF_ACCEL: 'tcg', FF_LOG_LEVEL: 'warn' };
    for (const d of ['a', 'b']) mkdirSync(join(dir, d));
    let agent: AgentProcess | undefined;
    try {
      agent = await startAgent({ hostId: 'host-b', natsUrl: nats.url, trustedKeyPath: keyPath, dataDir: join(dir, 'b'), env: { ...env, FF_NATS_NKEY_FILE: nats.auth!.hostSeedFile('host-b') } });
      await waitUntil('heartbeat from the host-b agent process', () => heartbeats.find((h) => h.hostId === 'host-b'), 20_000);
      await agent.teardown();
      agent = undefined;
      // host-a's identity with host-b's key: its consumer and inbox are not host-b's, so it stops.
      const p = spawn(process.execPath, ['--import', 'tsx', 'host-agent/main.ts'], {
        cwd: new URL('../../../', import.meta.url).pathname,
        env: { ...process.env, ...env, FF_HOST_ID: 'host-a', FF_DATA_DIR: join(dir, 'a'), FF_RAM_MOUNT: '', FF_GUEST_CGROUP: '', FF_NATS_URL: nats.url, FF_TRUSTED_KEY: keyPath, FF_NATS_NKEY_FILE: nats.auth!.hostSeedFile('host-b') },
        stdio: ['ignore', 'ignore', 'pipe'],
      });
      let stderr = '';
      p.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
      const code = await new Promise<number | string>((resolve) => {
        const t = setTimeout(() => {
          p.kill('SIGKILL');
          resolve('still running after 30 s');
        }, 30_000);
        p.on('exit', (c) => {
          clearTimeout(t);
          resolve(c ?? 'signal');
        });
      });
      const wrong = `exit ${code}: ${stderr.split('\n')[0]}`;
      expect(wrong).toMatch(/^exit 1/);
      expect(wrong).toMatch(/[Pp]ermissions [Vv]iolation|PERMISSIONS_VIOLATION/);
    } finally {
      await agent?.teardown();
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it('credentials_whenMissingOrAnotherHosts_connectionIsRefusedOrConfined', async () => {
    const noCreds = await connect({ servers: nats.url, maxReconnectAttempts: 0 }).then(
      async (nc) => {
        await nc.close();
        return undefined;
      },
      (e: unknown) => (e as NatsError).code,
    );
    expect(noCreds).toBe(ErrorCode.AuthorizationViolation);
    // host-b's key with host-a's inbox prefix: B's permissions do not include A's inbox.
    const mixed = await connect({ servers: nats.url, ...agentConnectOptions('host-a', nats.auth!.hostSeedFile('host-b')) });
    try {
      const err = await mixed.request(subjects.heartbeat('host-b'), new Uint8Array(), { timeout: 2000 }).then(() => undefined, (e: unknown) => (e as NatsError).code);
      expect(err).toBe(ErrorCode.PermissionsViolation);
    } finally {
      await mixed.close();
    }
  });
});
