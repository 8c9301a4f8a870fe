// The scheduler's leadership loop (startScheduler): a leader that could not start steps down
// and stands again, and a lost lease makes it stand again too. Run here in-process with every
// adapter and the executor replaced by stand-ins (our own modules); the real ones are in the
// int tier (fleet-failover.int.test.ts).
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it, vi } from 'vitest';
import pino from 'pino';
import { compileSchedulerConfig } from './config.ts';
import { startScheduler } from './scheduler.ts';

const fakes = vi.hoisted(() => {
  const state = {
    campaigns: 0,
    resigns: 0,
    leading: false,
    lostCbs: [] as Array<() => void>,
    starts: 0,
    stops: 0,
    releaseFirstStop: (): void => undefined,
  };
  class FakeElection {
    // The first campaign wins at once; later ones stand (never elected here).
    campaign(): Promise<void> {
      state.campaigns++;
      if (state.campaigns > 1) return new Promise(() => undefined);
      state.leading = true;
      return Promise.resolve();
    }
    isLeader(): boolean {
      return state.leading;
    }
    fence(): undefined {
      return undefined;
    }
    onLost(cb: () => void): void {
      state.lostCbs.push(cb);
    }
    async resign(): Promise<void> {
      state.resigns++;
      state.leading = false;
    }
  }
  class FakeExecutor {
    // The first start fails (a read refused just after a failover); the first stop takes a while.
    async start(): Promise<void> {
      if (++state.starts === 1) throw new Error('etcd read failed');
    }
    stop(): Promise<void> {
      if (++state.stops > 1) return Promise.resolve();
      return new Promise<void>((r) => (state.releaseFirstStop = r));
    }
    gauges(): undefined {
      return undefined;
    }
    hostEvent(): void {}
  }
  const idle = class {
    start(): Promise<void> {
      return Promise.resolve();
    }
    stop(): Promise<void> {
      return Promise.resolve();
    }
  };
  return { state, FakeElection, FakeExecutor, idle };
});

vi.mock('nats', async (orig) => ({ ...(await orig<object>()), connect: async () => ({ close: async () => undefined, closed: () => new Promise(() => undefined) }) }));
vi.mock('./adapters/etcd/store.ts', async (orig) => ({
  ...(await orig<object>()),
  EtcdFleetStore: { connect: () => ({ etcd: {}, checkTxnOps: async () => 1024, revision: async () => 1, close: () => undefined }) },
}));
vi.mock('./adapters/etcd/election.ts', async (orig) => ({ ...(await orig<object>()), EtcdLeaderElection: fakes.FakeElection }));
vi.mock('./adapters/nats/bus.ts', async (orig) => ({
  ...(await orig<object>()),
  NatsWorkBus: { create: async () => ({ onHeartbeat: () => undefined, onHostEvent: () => undefined, setWorkFence: () => undefined, connectedForMs: () => 1, close: () => undefined }) },
}));
vi.mock('./adapters/grpc/server.ts', async (orig) => ({
  ...(await orig<object>()),
  startGrpcServer: async () => ({ address: '127.0.0.1:1', setServing: () => undefined, close: async () => undefined }),
  followReadiness: () => ({ stop: () => undefined }),
}));
vi.mock('./adapters/grpc/tls.ts', async (orig) => ({ ...(await orig<object>()), fleetServerCredentials: () => ({}) }));
vi.mock('./auth/tokens.ts', async (orig) => ({ ...(await orig<object>()), Authenticator: class {} }));
vi.mock('./auth/guard.ts', async (orig) => ({ ...(await orig<object>()), ApiGuard: class {} }));
vi.mock('./adapters/grpc/fleet-service.ts', async (orig) => ({ ...(await orig<object>()), fleetService: () => ({}) }));
vi.mock('./domain/fleet.ts', async (orig) => ({ ...(await orig<object>()), Fleet: class {} }));
vi.mock('./domain/quota-ledger.ts', async (orig) => ({ ...(await orig<object>()), QuotaLedger: class { stop(): void {} } }));
vi.mock('./domain/executor.ts', async (orig) => ({ ...(await orig<object>()), Executor: fakes.FakeExecutor }));
vi.mock('./domain/webhooks.ts', async (orig) => ({ ...(await orig<object>()), WebhookDispatcher: fakes.idle }));
vi.mock('./adapters/etcd/webhook-log.ts', async (orig) => ({ ...(await orig<object>()), EtcdDeliveryLog: class {} }));
vi.mock('./domain/history.ts', async (orig) => ({ ...(await orig<object>()), Compactor: class { start(): void {} stop(): void {} } }));

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

describe('scheduler leadership', () => {
  let close: (() => Promise<void>) | undefined;
  let dir: string | undefined;
  afterEach(async () => {
    await close?.();
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  it('leaderThatCouldNotStart_whenItsLeaseIsLostWhileItStops_standsAgainOnce_withoutResigningTheNewCampaign', async () => {
    dir = mkdtempSync(join(tmpdir(), 'ff-leadership-'));
    for (const f of ['cert.pem', 'key.pem', 'tokens.json']) writeFileSync(join(dir, f), '');
    const config = compileSchedulerConfig({ tlsCertPath: join(dir, 'cert.pem'), tlsKeyPath: join(dir, 'key.pem'), tokensFile: join(dir, 'tokens.json'), signingKeyPath: join(dir, 'signing.pem'), metricsAddr: '' }, {});
    const handle = await startScheduler(config, pino({ level: 'silent' }));
    close = () => handle.close();
    const s = fakes.state;
    // Elected, the start failed: it steps down and is stopping the executor.
    await vi.waitFor(() => expect(s.stops).toBe(1));
    // Meanwhile the lease runs out: onLost stops again and stands for leader.
    s.leading = false;
    for (const cb of s.lostCbs) cb();
    await vi.waitFor(() => expect(s.campaigns).toBe(2));
    // The failed start's step-down goes on: onLost took over, so neither a resign (which would
    // end the new campaign) nor a second campaign (which would replace it).
    s.releaseFirstStop();
    await sleep(1300);
    expect(s.campaigns).toBe(2);
    expect(s.resigns).toBe(0);
  });
});
