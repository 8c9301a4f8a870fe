// What a scheduler replica tells probes and load balancers (grpc.health.v1) and Prometheus
// while etcd or NATS is out of reach. Real etcd (frozen with SIGSTOP: it neither answers nor
// closes its connections, as over a partition) and a real nats-server (stopped for a while).
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { rmSync } from 'node:fs';
import { connect, createServer } from 'node:net';
import type { AddressInfo } from 'node:net';
import { join } from 'node:path';
import { pino } from 'pino';
import { makeGenericClientConstructor } from '@grpc/grpc-js';
import type { ChannelCredentials, ClientOptions, Client as GrpcClient, ServiceError } from '@grpc/grpc-js';
import { service as healthService } from 'grpc-health-check';
import type { ServingStatus } from 'grpc-health-check';
import { startEtcd } from './testkit/etcd.ts';
import type { EtcdCluster } from './testkit/etcd.ts';
import { startNats } from './testkit/nats.ts';
import type { NatsServer } from './testkit/nats.ts';
import { waitFor, tempDir } from './testkit/proc.ts';
import { testCredentials } from './testkit/credentials.ts';
import { compileSchedulerConfig } from './config.ts';
import { startScheduler } from './scheduler.ts';
import type { SchedulerHandle } from './scheduler.ts';
import { fleetChannelCredentials, fleetChannelOptions } from './adapters/grpc/tls.ts';

type HealthClient = GrpcClient & { check(req: { service: string }, opts: { deadline: number }, cb: (err: ServiceError | null, res?: { status: ServingStatus }) => void): void };
const HealthClientCtor = makeGenericClientConstructor(healthService as never, 'Health') as unknown as new (address: string, creds: ChannelCredentials, options: ClientOptions) => HealthClient;

describe('scheduler health and leader-only metrics (real etcd, NATS)', () => {
  let etcd: EtcdCluster;
  let nats: NatsServer;
  let dir: string;
  let sched: SchedulerHandle;
  let health: HealthClient;
  let frozen = false;

  const status = (): Promise<ServingStatus | string> =>
    new Promise((resolve) => health.check({ service: '' }, { deadline: Date.now() + 2000 }, (err, res) => resolve(err ? `error ${err.code}` : res!.status)));
  const compactedRevision = async (): Promise<number> => Number(/^forkfleet_etcd_compacted_revision (\S+)$/m.exec(await sched.registry.metrics())?.[1]);
  const freeze = (on: boolean): void => {
    frozen = on;
    process.kill(etcd.members[0]!.proc.pid, on ? 'SIGSTOP' : 'SIGCONT');
  };

  beforeAll(async () => {
    dir = tempDir('ff-health-');
    [etcd, nats] = await Promise.all([startEtcd(), startNats()]);
    const creds = testCredentials(dir);
    sched = await startScheduler(
      compileSchedulerConfig({ grpcAddr: '127.0.0.1:0', etcdEndpoints: etcd.endpoints.join(','), natsUrl: nats.url, signingKeyPath: join(dir, 'signing.pem'), etcdCompactIntervalMs: '1s', ...creds.config }),
      pino({ level: 'silent' }),
    );
    await sched.leader;
    health = new HealthClientCtor(sched.address, fleetChannelCredentials({ caPem: creds.caPem }), fleetChannelOptions(sched.address));
  }, 60_000);

  afterAll(async () => {
    if (frozen) freeze(false);
    health?.close();
    await sched?.close();
    await nats?.stop();
    await etcd?.stop();
    if (dir) rmSync(dir, { recursive: true, force: true });
  }, 60_000);

  it('etcdOutOfReach_healthIsNotServing_theDeposedLeaderExportsNoCompactedRevision_andBothComeBackWithEtcd', async () => {
    expect(await status()).toBe('SERVING');
    await waitFor('the leader compacted etcd', async () => (await compactedRevision()) > 0, 10_000, 100);
    freeze(true);
    try {
      await waitFor('health NOT_SERVING', async () => (await status()) === 'NOT_SERVING', 10_000, 100);
      // Its lease ran out unanswered: it stepped down, and its last figure is not exported.
      await waitFor('leadership lost', async () => !sched.isLeader(), 10_000, 50);
      expect(await compactedRevision()).toBe(0);
    } finally {
      freeze(false);
    }
    await waitFor('health SERVING again', async () => (await status()) === 'SERVING', 15_000, 100);
    await waitFor('leading again', async () => sched.isLeader(), 15_000, 50);
  }, 60_000);

  it('metricsPort_takenAlready_failsStartUpNamingFF_METRICS_ADDR_andAHalfSentRequestThereDoesNotHoldItsClose', async () => {
    const taken = createServer();
    await new Promise<void>((r) => taken.listen(0, '127.0.0.1', r));
    const port = (taken.address() as AddressInfo).port;
    const creds = testCredentials(join(dir, 'second'));
    const config = (metricsAddr: string) => compileSchedulerConfig({ id: 'health-2', grpcAddr: '127.0.0.1:0', metricsAddr, etcdEndpoints: etcd.endpoints.join(','), natsUrl: nats.url, signingKeyPath: join(dir, 'signing.pem'), ...creds.config });
    try {
      // It used to end the process (an 'error' event nobody listened to), the API already up.
      await expect(startScheduler(config(`127.0.0.1:${port}`), pino({ level: 'silent' }))).rejects.toThrow(/FF_METRICS_ADDR 127\.0\.0\.1:\d+: cannot listen there: .*EADDRINUSE/);
    } finally {
      taken.close();
    }
    const second = await startScheduler(config('127.0.0.1:0'), pino({ level: 'silent' }));
    const [h, p] = second.metricsAddress.split(':');
    const half = connect(Number(p), h);
    await new Promise<void>((r) => half.on('connect', () => r()));
    half.write('GET /metr');
    const t0 = Date.now();
    await second.close();
    // Before, close() waited for that request until Node's header timeout (60 s).
    expect(Date.now() - t0).toBeLessThan(10_000);
    half.destroy();
  }, 60_000);

  it('natsOutOfReach_healthIsNotServingWhileItIsDown_andServingOnceReconnected', async () => {
    expect(await status()).toBe('SERVING');
    const seen = new Set<string>();
    let watching = true;
    const watcher = (async () => {
      while (watching) {
        seen.add(await status());
        await new Promise((r) => setTimeout(r, 100));
      }
    })();
    await nats.restart(4000);
    await waitFor('health SERVING again', async () => (await status()) === 'SERVING', 15_000, 100);
    watching = false;
    await watcher;
    expect(seen).toContain('NOT_SERVING');
  }, 60_000);
});
