// The scheduler's NATS bus against a real nats-server: what a host sends it cannot stop it
// reading.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { connect } from 'nats';
import type { NatsConnection } from 'nats';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import { startNats } from '../../testkit/nats.ts';
import type { NatsServer } from '../../testkit/nats.ts';
import { HeartbeatSchema, HostExecCancelSchema, HostExecOutputSchema, HostExecRequestSchema, HostResultSchema } from '../../domain/messages.ts';
import type { HeartbeatMsg, HostResultMsg } from '../../domain/messages.ts';
import { NatsWorkBus } from './bus.ts';
import { ensureResultsConsumer, RESULTS_CONSUMER, STREAM_RESULTS, subjects } from './subjects.ts';
import { rmSync } from 'node:fs';
import { join } from 'node:path';

let server: NatsServer;
let schedNc: NatsConnection;
let hostNc: NatsConnection;
let bus: NatsWorkBus;

beforeAll(async () => {
  server = await startNats();
  schedNc = await connect({ servers: server.url, noAsyncTraces: true });
  hostNc = await connect({ servers: server.url, noAsyncTraces: true });
  bus = await NatsWorkBus.create(schedNc);
});

afterAll(async () => {
  bus?.close();
  await schedNc?.close();
  await hostNc?.close();
  await server?.stop();
});

describe('NatsWorkBus', () => {
  it('exec_whoseHostAnswersUndecodableOutput_failsThatExec_andTheBusKeepsReading', async () => {
    // A host that answers an exec with bytes that are no HostExecOutput.
    const sub = hostNc.subscribe(subjects.exec('h-bad'), {
      callback: (_err, m) => {
        if (m.reply) hostNc.publish(m.reply, Uint8Array.from([0x0a, 0x05, 0x61]));
      },
    });
    await hostNc.flush();
    const beats: HeartbeatMsg[] = [];
    bus.onHeartbeat((hb) => beats.push(hb));

    const read = async (): Promise<unknown> => {
      for await (const _ of bus.exec('h-bad', create(HostExecRequestSchema, { sandboxId: 'sb-1', argv: ['true'] }), { timeoutMs: 5000 })) {
        /* nothing comes */
      }
      return undefined;
    };
    await expect(read()).rejects.toMatchObject({ kind: 'internal', message: expect.stringMatching(/did not decode/) });

    // The replica still hears a host after it: the bad message did not end its read loop.
    hostNc.publish(subjects.heartbeat('h-ok'), toBinary(HeartbeatSchema, create(HeartbeatSchema, { hostId: 'h-ok', bootId: 'b' })));
    const deadline = Date.now() + 3000;
    while (beats.length === 0 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
    expect(beats.map((b) => b.hostId)).toEqual(['h-ok']);
    sub.unsubscribe();
  });

  it('exec_whoseOutputArrivesWithAPieceMissing_failsUnavailable_insteadOfReportingAWholeRun_andCancelsTheCommand', async () => {
    // Core NATS drops what a host sends while the scheduler's connection is down: the exit
    // came after a hole, and the call read as whole (exit 0, nothing truncated).
    const cancels: string[] = [];
    const cancelSub = hostNc.subscribe(subjects.execCancel('h-gap'), { callback: (_e, m) => void cancels.push(fromBinary(HostExecCancelSchema, m.data).replySubject) });
    const sub = hostNc.subscribe(subjects.exec('h-gap'), {
      callback: (_err, m) => {
        if (!m.reply) return;
        for (const out of [
          create(HostExecOutputSchema, { seq: 1n, payload: { case: 'stdout', value: Buffer.from('a') } }),
          create(HostExecOutputSchema, { seq: 3n, payload: { case: 'stdout', value: Buffer.from('c') } }),
          create(HostExecOutputSchema, { seq: 4n, payload: { case: 'exit', value: { exitCode: 0 } } }),
        ])
          hostNc.publish(m.reply, toBinary(HostExecOutputSchema, out));
      },
    });
    await hostNc.flush();
    const got: string[] = [];
    const read = async (): Promise<unknown> => {
      for await (const o of bus.exec('h-gap', create(HostExecRequestSchema, { sandboxId: 'sb-1', argv: ['true'] }), { timeoutMs: 5000 })) got.push(o.payload.case === 'stdout' ? Buffer.from(o.payload.value).toString() : String(o.payload.case));
      return undefined;
    };
    await expect(read()).rejects.toMatchObject({ kind: 'unavailable', retryable: false, message: expect.stringMatching(/piece 2 missing, piece 3 came/) });
    // What came before the hole may or may not have been read; nothing after it was.
    expect(got.filter((g) => g !== 'a')).toEqual([]);
    const deadline = Date.now() + 3000;
    while (cancels.length === 0 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
    expect(cancels).toHaveLength(1);
    sub.unsubscribe();
    cancelSub.unsubscribe();
  });

  it('resultsQueue_whoseStoreDirectoryTheServerLost_isMadeAgain_andResultsArriveAgain', async () => {
    // The state a consumer re-made during its own deletion is left in (nats-server without its
    // PR 7886: streams lost, made again at once): alive, its store directory gone, so every
    // add answers "no such file or directory". The work queues were healed so; the results
    // queue was not, and no result would reach a scheduler again.
    const jsm = await schedNc.jetstreamManager();
    await ensureResultsConsumer(jsm);
    rmSync(join(server.storeDir, 'jetstream', '$G', 'streams', STREAM_RESULTS, 'obs', RESULTS_CONSUMER), { recursive: true, force: true });
    await ensureResultsConsumer(jsm);
    const got: HostResultMsg[] = [];
    const stop = await bus.consumeResults((r, ack) => {
      got.push(r);
      ack();
    });
    try {
      await hostNc.jetstream().publish(subjects.result('h-r'), toBinary(HostResultSchema, create(HostResultSchema, { opId: 'op-after-heal', stepId: 's', hostId: 'h-r', attempt: 1 })));
      const deadline = Date.now() + 10_000;
      while (!got.some((r) => r.opId === 'op-after-heal') && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
      expect(got.map((r) => r.opId)).toContain('op-after-heal');
    } finally {
      await stop();
    }
  });

  it('exec_onAClosedConnection_failsUnavailable_andItsTimeoutDoesNotCrashTheProcess', async () => {
    // A replica whose connection is closed (or draining, at shutdown) cannot subscribe for
    // the reply: the call fails there, and no timer is left to fire on what was never made.
    const nc = await connect({ servers: server.url, noAsyncTraces: true });
    const closedBus = await NatsWorkBus.create(nc);
    await nc.close();
    const read = async (): Promise<unknown> => {
      for await (const _ of closedBus.exec('h-closed', create(HostExecRequestSchema, { sandboxId: 'sb-1', argv: ['true'] }), { timeoutMs: 50 })) {
        /* nothing comes */
      }
      return undefined;
    };
    await expect(read()).rejects.toMatchObject({ kind: 'unavailable', retryable: true, message: expect.stringMatching(/exec relay to host h-closed failed/) });
    // Past the exec's timeout: a timer left armed would throw here, outside any caller.
    await new Promise((r) => setTimeout(r, 200));
  });

  it('consumeResults_whenTheResultsStreamWasLostBeforeItStarts_makesItAgain_andResultsArrive', async () => {
    // A leader that starts after nats-server lost its store (or the stream was deleted) while
    // no replica consumed: it used to fail "stream not found" on every start, on every replica.
    const jsm = await schedNc.jetstreamManager();
    await jsm.streams.delete(STREAM_RESULTS);
    const got: HostResultMsg[] = [];
    const stop = await bus.consumeResults((r, ack) => {
      got.push(r);
      ack();
    });
    try {
      await hostNc.jetstream().publish(subjects.result('h-r'), toBinary(HostResultSchema, create(HostResultSchema, { opId: 'op-after-loss', stepId: 'create', hostId: 'h-r', attempt: 1 })));
      const deadline = Date.now() + 10_000;
      while (got.length === 0 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
      expect(got.map((r) => r.opId)).toEqual(['op-after-loss']);
    } finally {
      await stop();
    }
  });
});
