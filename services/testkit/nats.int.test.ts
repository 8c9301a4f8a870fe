import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { existsSync } from 'node:fs';
import { AckPolicy, connect, StringCodec } from 'nats';
import type { NatsConnection } from 'nats';
import { startNats } from './nats.ts';
import type { NatsServer } from './nats.ts';
import { createServer } from 'node:net';
import { freePort, pidAlive } from './proc.ts';

const sc = StringCodec();

describe('nats harness (real nats-server with JetStream)', () => {
  let nats: NatsServer;

  beforeAll(async () => {
    nats = await startNats();
  });

  afterAll(async () => {
    await nats?.stop();
  });

  async function consumeOne(nc: NatsConnection): Promise<string> {
    const c = await nc.jetstream().consumers.get('WORK', 'host-a');
    const m = await c.next({ expires: 5000 });
    if (!m) throw new Error('no message');
    m.ack();
    await m.ackAck().catch(() => undefined);
    return sc.decode(m.data);
  }

  it('durableConsumer_whenConsumerRestarts_resumesAfterLastAck', async () => {
    const nc = await connect({ servers: nats.url });
    const jsm = await nc.jetstreamManager();
    await jsm.streams.add({ name: 'WORK', subjects: ['work.>'] });
    await jsm.consumers.add('WORK', { durable_name: 'host-a', ack_policy: AckPolicy.Explicit, filter_subject: 'work.host-a' });
    const js = nc.jetstream();
    for (const n of ['one', 'two', 'three']) {
      const ack = await js.publish('work.host-a', sc.encode(n));
      expect(ack.stream).toBe('WORK');
    }
    expect(await consumeOne(nc)).toBe('one');
    await nc.close();

    // A new connection (the "restarted" consumer) continues where the durable left off.
    const nc2 = await connect({ servers: nats.url });
    expect(await consumeOne(nc2)).toBe('two');
    expect(await consumeOne(nc2)).toBe('three');
    await nc2.close();
  });

  it('durableConsumer_whenServerRestarts_keepsUnackedMessages', async () => {
    const nc = await connect({ servers: nats.url });
    await nc.jetstream().publish('work.host-a', sc.encode('survives'));
    await nc.close();
    await nats.restart();
    const nc2 = await connect({ servers: nats.url });
    expect(await consumeOne(nc2)).toBe('survives');
    await nc2.close();
  });

  it('stop_killsProcessByPidAndRemovesStoreDir', async () => {
    const extra = await startNats();
    const pid = extra.proc.pid;
    expect(pidAlive(pid)).toBe(true);
    await extra.stop();
    expect(pidAlive(pid)).toBe(false);
    expect(existsSync(extra.storeDir)).toBe(false);
  });
});

describe('nats harness start', () => {
  it('start_whenItsFirstPortIsTaken_startsOnFreshPorts', async () => {
    const taken = createServer();
    const takenPort = await freePort();
    await new Promise<void>((r) => taken.listen(takenPort, '127.0.0.1', () => r()));
    let first = true;
    const server = await startNats({
      pickPort: async () => {
        if (!first) return freePort();
        first = false;
        return takenPort;
      },
    });
    try {
      expect(server.port).not.toBe(takenPort);
      const nc = await connect({ servers: server.url });
      await nc.close();
    } finally {
      await server.stop();
      await new Promise((r) => taken.close(r));
    }
  });
});
