// NatsWorkBus.onHeartbeat over a NatsConnection of our own making: what it does with a
// heartbeat that does not decode (a real server passes any bytes on; bus.int.test.ts runs the
// heartbeats against one).
import { afterEach, describe, expect, it, vi } from 'vitest';
import pino from 'pino';
import type { NatsConnection, Status } from 'nats';
import { AsyncQueue } from '../grpc/queue.ts';
import { NatsWorkBus } from './bus.ts';
import { subjects } from './subjects.ts';

describe('NatsWorkBus.onHeartbeat', () => {
  afterEach(() => void vi.useRealTimers());

  it('heartbeatThatDoesNotDecode_isDropped_andToldAtMostOnceAMinutePerHost', async () => {
    vi.useFakeTimers({ toFake: ['performance'] });
    const subs = new Map<string, (err: Error | null, m: { data: Uint8Array; subject: string }) => void>();
    const nc = {
      subscribe: (subject: string, opts: { callback: (err: Error | null, m: { data: Uint8Array; subject: string }) => void }) => {
        subs.set(subject, opts.callback);
        return { unsubscribe: () => void subs.delete(subject) };
      },
      publish: () => undefined,
      status: () => new AsyncQueue<Status>(),
      jetstream: () => ({}),
      closed: () => new Promise(() => undefined),
      isClosed: () => false,
      options: {},
    } as unknown as NatsConnection;
    const warned: Array<{ msg: string; subject: string }> = [];
    const log = pino({ level: 'warn' }, { write: (s: string) => void warned.push(JSON.parse(s)) });
    const bus = new (NatsWorkBus as unknown as new (nc: NatsConnection, jsm: unknown, streamReplicas: number, log: pino.Logger) => NatsWorkBus)(nc, {}, 1, log);
    const heard: string[] = [];
    bus.onHeartbeat((hb) => void heard.push(hb.hostId));
    const beat = (hostId: string): void => subs.get(subjects.allHeartbeats)?.(null, { subject: subjects.heartbeat(hostId), data: new Uint8Array([0x42, 0xff, 0xff]) });
    try {
      for (let i = 0; i < 5; i++) beat('h1');
      beat('h2');
      expect(warned.map((w) => w.subject)).toEqual([subjects.heartbeat('h1'), subjects.heartbeat('h2')]);
      expect(warned[0]?.msg).toMatch(/heartbeat that does not decode/);
      vi.advanceTimersByTime(30_000);
      beat('h1');
      expect(warned).toHaveLength(2);
      vi.advanceTimersByTime(30_000);
      beat('h1');
      expect(warned).toHaveLength(3);
      expect(heard).toEqual([]);
    } finally {
      bus.close();
    }
  });
});
