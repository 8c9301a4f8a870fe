// One scheduler replica in the test's own process over a real etcd and nats-server that it
// starts (stopped by PID in `stop`), with TLS and an admin client: the set-up of the
// integration tests that drive the Fleet API against fake or real host agents.
import { rmSync } from 'node:fs';
import { tempDir } from './proc.ts';
import { join } from 'node:path';
import { pino } from 'pino';
import { startEtcd } from './etcd.ts';
import type { EtcdCluster } from './etcd.ts';
import { startNats } from './nats.ts';
import type { NatsServer } from './nats.ts';
import { testCredentials } from './credentials.ts';
import type { TestCredentials } from './credentials.ts';
import { compileSchedulerConfig } from '../config.ts';
import type { SchedulerConfig } from '../config.ts';
import { startScheduler } from '../scheduler.ts';
import type { SchedulerHandle, SchedulerSeams } from '../scheduler.ts';
import type { Client } from '../adapters/grpc/rpc.ts';
import { FleetService } from '../../proto/gen/forkfleet/v1/fleet_pb.ts';

export type Fleet = Client<(typeof FleetService)['method']>;

export interface TestScheduler {
  /** A directory of its own (removed by `stop`): signing key, PKI, tokens. */
  readonly dir: string;
  readonly etcd: EtcdCluster;
  readonly nats: NatsServer;
  readonly sched: SchedulerHandle;
  readonly credentials: TestCredentials;
  /** The scheduler's signing key (its public half, `${signingKeyPath}.pub`, is what agents trust). */
  readonly signingKeyPath: string;
  /** An admin client of the API. */
  readonly api: Fleet;
  /** Closes the client and the scheduler, stops NATS and etcd, removes `dir`. */
  stop(): Promise<void>;
}

/** Starts etcd, NATS and a leading scheduler; `config` overrides compileSchedulerConfig's raw options. */
export async function startTestScheduler(o: { prefix: string; config?: Partial<Record<keyof SchedulerConfig, string>>; seams?: SchedulerSeams }): Promise<TestScheduler> {
  const dir = tempDir(o.prefix);
  const [etcd, nats] = await Promise.all([startEtcd(), startNats()]);
  const credentials = testCredentials(dir);
  const signingKeyPath = join(dir, 'signing.pem');
  const sched = await startScheduler(
    compileSchedulerConfig({ grpcAddr: '127.0.0.1:0', etcdEndpoints: etcd.endpoints.join(','), natsUrl: nats.url, signingKeyPath, ...o.config, ...credentials.config }),
    pino({ level: 'warn' }),
    o.seams,
  );
  await sched.leader;
  const api = credentials.client(FleetService, sched.address);
  return {
    dir,
    etcd,
    nats,
    sched,
    credentials,
    signingKeyPath,
    api,
    async stop() {
      api.close();
      await sched.close();
      await nats.stop();
      await etcd.stop();
      rmSync(dir, { recursive: true, force: true });
    },
  };
}
