// The scheduler's leadership loop (startScheduler): a leader that could not start steps down
// and stands again, and a lost lease makes it stand again too; and how a replica ends: by
// close() (a rolling restart), or by itself when its NATS connection closed for good; and what
// its metrics say meanwhile. Run here in-process with every adapter and the executor replaced
// by stand-ins (our own modules); the real ones are in the int tier (fleet-failover.int.test.ts).
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import pino from 'pino';
import { Gauge } from 'prom-client';
import { compileSchedulerConfig } from './config.ts';
import { startScheduler } from './scheduler.ts';
import type { SchedulerSeams } from './scheduler.ts';

// One set of stand-ins for every test; `state` is reset before each (beforeEach below).
const fakes = vi.hoisted(() => {
  const fresh = () => ({
    /**
     * How the executor behaves: 'starts' at once; 'failsToStart': its first start fails (a read
     * refused just after a failover) and its first stop waits for releaseFirstStop().
     */
    executor: 'starts' as 'starts' | 'failsToStart',
    campaigns: 0,
    resigns: 0,
    leading: false,
    lostCbs: [] as Array<() => void>,
    starts: 0,
    stops: 0,
    releaseFirstStop: (): void => undefined,
    /** Closes the NATS connection of the replica started last, with this error (else it stays open). */
    closeNats: (_err: Error): void => undefined,
  });
  const state = fresh();
  const reset = (): void => void Object.assign(state, fresh());
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
    // Does not call onLost (as the etcd election's does not).
    async resign(): Promise<void> {
      state.resigns++;
      state.leading = false;
    }
  }
  class FakeExecutor {
    async start(): Promise<void> {
      if (++state.starts === 1 && state.executor === 'failsToStart') throw new Error('etcd read failed');
    }
    stop(): Promise<void> {
      if (++state.stops > 1 || state.executor === 'starts') return Promise.resolve();
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
  const connect = async (): Promise<object> => {
    let closeWith = (_err: Error): void => undefined;
    const closed = new Promise<Error>((r) => (closeWith = r));
    state.closeNats = closeWith;
    return { close: async () => undefined, closed: () => closed };
  };
  return { state, reset, FakeElection, FakeExecutor, idle, connect };
});

vi.mock('nats', async (orig) => ({ ...(await orig<object>()), connect: fakes.connect }));
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
vi.mock('./auth/tokens.ts', async (orig) => ({ ...(await orig<object>()), Authenticator: class { addEphemeral(): string { return 'dashboard-token'; } } }));
vi.mock('./auth/guard.ts', async (orig) => ({ ...(await orig<object>()), ApiGuard: class {} }));
vi.mock('./adapters/grpc/fleet-service.ts', async (orig) => ({ ...(await orig<object>()), fleetService: () => ({}) }));
vi.mock('./dashboard/handler.ts', async (orig) => ({ ...(await orig<object>()), dashboardHandler: () => Object.assign(() => false, { close: () => undefined }) }));
vi.mock('./domain/fleet.ts', async (orig) => ({ ...(await orig<object>()), Fleet: class {} }));
vi.mock('./domain/quota-ledger.ts', async (orig) => ({ ...(await orig<object>()), QuotaLedger: class { stop(): void {} } }));
vi.mock('./domain/executor.ts', async (orig) => ({ ...(await orig<object>()), Executor: fakes.FakeExecutor }));
vi.mock('./domain/webhooks.ts', async (orig) => ({ ...(await orig<object>()), WebhookDispatcher: fakes.idle }));
vi.mock('./adapters/etcd/webhook-log.ts', async (orig) => ({ ...(await orig<object>()), EtcdDeliveryLog: class {} }));
vi.mock('./domain/history.ts', async (orig) => ({ ...(await orig<object>()), Compactor: class { start(): void {} stop(): void {} } }));

const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

/** The value of one sample in Prometheus text (`name{labels} value`), undefined if absent. */
const sample = (text: string, series: string): number | undefined => {
  const line = text.split('\n').find((l) => l.startsWith(`${series} `));
  return line === undefined ? undefined : Number(line.slice(series.length + 1));
};

let close: (() => Promise<void>) | undefined;
let dir = '';
beforeEach(() => {
  dir = mkdtempSync(join(tmpdir(), 'ff-leadership-'));
  for (const f of ['cert.pem', 'key.pem', 'tokens.json']) writeFileSync(join(dir, f), '');
  fakes.reset();
});
afterEach(async () => {
  await close?.();
  close = undefined;
  rmSync(dir, { recursive: true, force: true });
});
/** A replica, started; `lines` gets what it logs. */
const start = async (o: { metricsAddr?: string; seams?: SchedulerSeams } = {}) => {
  const lines: Array<{ level: number; msg: string }> = [];
  const config = compileSchedulerConfig({ tlsCertPath: join(dir, 'cert.pem'), tlsKeyPath: join(dir, 'key.pem'), tokensFile: join(dir, 'tokens.json'), signingKeyPath: join(dir, 'signing.pem'), metricsAddr: o.metricsAddr ?? '' }, {});
  const handle = await startScheduler(config, pino({ level: 'info' }, { write: (s: string) => void lines.push(JSON.parse(s)) }), o.seams);
  close = () => handle.close();
  return { handle, lines };
};
/** A replica that leads. */
const startLeading = async (o: Parameters<typeof start>[0] = {}) => {
  const started = await start(o);
  await started.handle.leader;
  return started;
};

describe('scheduler leadership', () => {
  it('leaderThatCouldNotStart_whenItsLeaseIsLostWhileItStops_standsAgainOnce_withoutResigningTheNewCampaign', async () => {
    const s = fakes.state;
    s.executor = 'failsToStart';
    await start();
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

describe('scheduler replica ending', () => {
  it('isLeaderGauge_afterCloseResigned_reads0_notTheOneOfTheTermThatEnded', async () => {
    const { handle } = await startLeading();
    expect(sample(await handle.registry.metrics(), 'forkfleet_scheduler_is_leader')).toBe(1);
    await handle.close();
    close = undefined;
    expect(fakes.state.resigns).toBe(1);
    expect(sample(await handle.registry.metrics(), 'forkfleet_scheduler_is_leader')).toBe(0);
  });

  it('leader_whoseNatsConnectionClosedForGood_resignsAndExits1', async () => {
    const exits: number[] = [];
    const { handle, lines } = await startLeading({ seams: { exit: (code) => void exits.push(code) } });
    fakes.state.closeNats(new Error('Authorization Violation'));
    await vi.waitFor(() => expect(exits).toEqual([1]));
    expect(fakes.state.resigns).toBe(1);
    expect(handle.isLeader()).toBe(false);
    expect(sample(await handle.registry.metrics(), 'forkfleet_scheduler_is_leader')).toBe(0);
    expect(lines.some((l) => l.level === 60 && /closed for good/.test(l.msg))).toBe(true);
  });

  it('natsConnectionClosedByClose_exitsNot', async () => {
    const exits: number[] = [];
    const { handle } = await startLeading({ seams: { exit: (code) => void exits.push(code) } });
    await handle.close();
    close = undefined;
    fakes.state.closeNats(new Error('closed'));
    await sleep(50);
    expect(exits).toEqual([]);
  });

  it('metricsThatCannotBeCollected_answer500_andTheErrorIsLoggedOncePerDistinctError', async () => {
    const { handle, lines } = await startLeading({ metricsAddr: '127.0.0.1:0' });
    let why = 'collect failed: cache gone';
    new Gauge({ name: 'test_broken', help: 'fails', registers: [handle.registry], collect: () => Promise.reject(new Error(why)) });
    const scrape = async (): Promise<number> => (await fetch(`http://${handle.metricsAddress}/metrics`)).status;
    expect([await scrape(), await scrape()]).toEqual([500, 500]);
    why = 'collect failed: another reason';
    expect(await scrape()).toBe(500);
    expect(lines.filter((l) => /metrics could not be collected/.test(l.msg)).length).toBe(2);
  });

  it('hostStepHostSecondsHelp_doesNotCallTheDifferenceNatsAndTheLeaderOnly_theDurationRunsFromTheFirstSend', async () => {
    const { handle } = await startLeading();
    const help = (await handle.registry.metrics()).split('\n').find((l) => l.startsWith('# HELP forkfleet_host_step_host_seconds '));
    expect(help).toMatch(/from the first send/);
    expect(help).toMatch(/earlier sends/);
    expect(help).not.toMatch(/minus this is the time in NATS and in the leader\./);
  });
});
