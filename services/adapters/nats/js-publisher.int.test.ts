// JetStream publishes through one shared reply subscription, against a real nats-server.
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { connect, RetentionPolicy } from 'nats';
import type { NatsConnection } from 'nats';
import { startNats } from '../../testkit/nats.ts';
import type { NatsServer } from '../../testkit/nats.ts';
import { JsPublisher } from './js-publisher.ts';

let server: NatsServer;
let nc: NatsConnection;

beforeAll(async () => {
  server = await startNats();
  nc = await connect({ servers: server.url, noAsyncTraces: true });
  const jsm = await nc.jetstreamManager();
  await jsm.streams.add({ name: 'T', subjects: ['t.>'], retention: RetentionPolicy.Limits, duplicate_window: 60e9 });
});

afterAll(async () => {
  await nc?.close();
  await server?.stop();
});

describe('JsPublisher', () => {
  it('publish_manyAtOnce_eachResolvesWithItsOwnStreamSequence', async () => {
    const acks = await Promise.all(Array.from({ length: 200 }, (_, i) => JsPublisher.of(nc).publish(`t.${i % 7}`, Buffer.from(`m${i}`))));
    expect(new Set(acks.map((a) => a.seq)).size).toBe(200);
    expect(acks.every((a) => a.stream === 'T' && !a.duplicate)).toBe(true);
    const info = await (await nc.jetstreamManager()).streams.info('T');
    expect(info.state.messages).toBeGreaterThanOrEqual(200);
  });

  it('publish_sameMsgIdTwice_secondIsADuplicateAndNotStored', async () => {
    const p = JsPublisher.of(nc);
    const a = await p.publish('t.dup', Buffer.from('x'), { msgId: 'op-1/step-1/1/n' });
    const b = await p.publish('t.dup', Buffer.from('x'), { msgId: 'op-1/step-1/1/n' });
    expect(a.duplicate).toBe(false);
    expect(b).toEqual({ stream: 'T', seq: a.seq, duplicate: true });
  });

  it('publish_toASubjectNoStreamTakes_failsAsUnavailable', async () => {
    await expect(JsPublisher.of(nc).publish('nostream.here', Buffer.from('x'))).rejects.toMatchObject({ kind: 'unavailable', message: expect.stringContaining('no responders') });
  });

  it('publish_ofMoreThanTheServersMaxPayload_failsAsResourceExhaustedNamingBothSizes_notUnavailable', async () => {
    const max = nc.info!.max_payload;
    await expect(JsPublisher.of(nc).publish('t.big', new Uint8Array(max + 1))).rejects.toMatchObject({ kind: 'resource_exhausted', retryable: false, message: expect.stringContaining(`${max + 1} bytes is more than the NATS server's max_payload of ${max} bytes`) });
  });

  it('publish_whenNoPubAckComes_failsAtItsDeadline_andClose_failsWhatWaits', async () => {
    // A plain subscriber answers nothing on this subject: no stream, but a responder exists.
    const mute = nc.subscribe('mute.>', { callback: () => undefined });
    const p = new JsPublisher(nc, { timeoutMs: 300 });
    const t0 = Date.now();
    await expect(p.publish('mute.a', Buffer.from('x'))).rejects.toMatchObject({ kind: 'deadline_exceeded' });
    expect(Date.now() - t0).toBeGreaterThanOrEqual(300);
    const waiting = p.publish('mute.b', Buffer.from('x'));
    p.close();
    await expect(waiting).rejects.toMatchObject({ kind: 'unavailable' });
    await expect(p.publish('t.after', Buffer.from('x'))).rejects.toMatchObject({ kind: 'unavailable' });
    mute.unsubscribe();
  });

  it('publish_whenNoPubAckComes_failsAtItsDeadline_evenIfTheWallClockStepsBack', async () => {
    const mute = nc.subscribe('mute.>', { callback: () => undefined });
    const p = new JsPublisher(nc, { timeoutMs: 300 });
    const wall = Date.now.bind(Date);
    try {
      const waiting = p.publish('mute.c', Buffer.from('x'));
      // An NTP correction of an hour backwards right after the publish.
      vi.spyOn(Date, 'now').mockImplementation(() => wall() - 3_600_000);
      const outcome = await Promise.race([waiting.then(() => 'acked', (e: { kind?: string }) => e.kind), new Promise((r) => setTimeout(() => r('still pending after 3 s'), 3000))]);
      expect(outcome).toBe('deadline_exceeded');
    } finally {
      vi.restoreAllMocks();
      p.close();
      mute.unsubscribe();
    }
  });

  it('of_sameConnection_givesOnePublisher', () => {
    expect(JsPublisher.of(nc)).toBe(JsPublisher.of(nc));
  });
});
