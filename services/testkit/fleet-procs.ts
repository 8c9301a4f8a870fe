// Scheduler replicas and fake host agents as separate processes, for failover tests and
// scale runs: services/main.ts and loadtest/fake-agent/main.ts, configured through FF_*
// environment variables, tracked and stopped by PID.
import { existsSync, mkdirSync, readFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { freePort, spawnManaged, waitFor } from './proc.ts';
import type { ManagedProcess } from './proc.ts';
import { fakeVmsIn } from '../../loadtest/fake-agent/driver.ts';
import type { VmInfo } from '../../host-agent/domain/vmm.ts';
import { testCredentials } from './credentials.ts';
import type { TestCredentials } from './credentials.ts';

const ROOT = resolve(import.meta.dirname, '..', '..');

export interface SchedulerProcess {
  readonly id: string;
  readonly api: string;
  readonly metrics: string;
  readonly proc: ManagedProcess;
  /** TLS and the admin token of this scheduler's API (shared by every scheduler in `dir`). */
  readonly credentials: TestCredentials;
  isLeader(): Promise<boolean>;
}

export async function startSchedulerProcess(o: { id: string; dir: string; etcdEndpoints: string[]; natsUrl: string; signingKeyPath: string; env?: Record<string, string>; nodeArgs?: string[] }): Promise<SchedulerProcess> {
  const api = `127.0.0.1:${await freePort()}`;
  const metrics = `127.0.0.1:${await freePort()}`;
  const logPath = join(o.dir, `scheduler-${o.id}.log`);
  const credentials = testCredentials(o.dir);
  const proc = spawnManaged({
    name: `scheduler-${o.id}`,
    command: process.execPath,
    // nodeArgs: e.g. ['--cpu-prof', '--cpu-prof-dir=DIR'] to profile a replica.
    args: [...(o.nodeArgs ?? []), '--import', 'tsx', join(ROOT, 'services', 'main.ts')],
    env: {
      ...process.env,
      FF_SCHEDULER_ID: o.id,
      FF_GRPC_ADDR: api,
      FF_METRICS_ADDR: metrics,
      FF_ETCD_ENDPOINTS: o.etcdEndpoints.join(','),
      FF_NATS_URL: o.natsUrl,
      FF_SIGNING_KEY: o.signingKeyPath,
      FF_LOG_LEVEL: 'info',
      ...credentials.env,
      ...o.env,
    },
    logPath,
  });
  await waitFor(`scheduler ${o.id} ready`, async () => {
    if (proc.child.exitCode !== null) throw new Error(`scheduler ${o.id} exited: ${readFileSync(logPath, 'utf8').slice(-2000)}`);
    return existsSync(logPath) && readFileSync(logPath, 'utf8').includes('"ready":true');
  }, 30_000, 50);
  return {
    id: o.id,
    api,
    metrics,
    proc,
    credentials,
    async isLeader() {
      try {
        const res = await fetch(`http://${metrics}/metrics`, { signal: AbortSignal.timeout(2000) });
        return /^forkfleet_scheduler_is_leader 1$/m.test(await res.text());
      } catch {
        return false; // busy or gone: not (known to be) the leader
      }
    },
  };
}

export interface FakeAgentsProcess {
  readonly hosts: string[];
  readonly dataDir: string;
  proc: ManagedProcess;
  /** The simulated VMs each host holds (read from the agents' data directories). */
  vms(): Map<string, VmInfo[]>;
  /** SIGKILL, then start again with the same host ids and data (journal, VMs). */
  restart(): Promise<void>;
  stop(): Promise<void>;
}

export async function startFakeAgents(o: { hosts: string[]; dataDir: string; natsUrl: string; logDir: string; env?: Record<string, string>; nodeArgs?: string[] }): Promise<FakeAgentsProcess> {
  mkdirSync(o.dataDir, { recursive: true });
  const logPath = join(o.logDir, `fake-agents-${o.hosts[0]}.log`);
  const launch = (): ManagedProcess =>
    spawnManaged({
      name: `fake-agents-${o.hosts[0]}`,
      command: process.execPath,
      args: [...(o.nodeArgs ?? []), '--import', 'tsx', join(ROOT, 'loadtest', 'fake-agent', 'main.ts')],
      env: { ...process.env, FF_FAKE_HOSTS: o.hosts.join(','), FF_DATA_DIR: o.dataDir, FF_NATS_URL: o.natsUrl, FF_HEARTBEAT_INTERVAL_MS: '250', ...o.env },
      logPath,
    });
  const ready = async (p: ManagedProcess, after: number): Promise<void> =>
    waitFor(`fake agents ${o.hosts[0]}.. ready`, async () => {
      if (p.child.exitCode !== null) throw new Error(`fake agents exited: ${readFileSync(logPath, 'utf8').slice(-2000)}`);
      return readFileSync(logPath, 'utf8').slice(after).includes('"ready":true');
    }, 60_000, 50);
  const size = (): number => (existsSync(logPath) ? readFileSync(logPath).length : 0);
  const start0 = size();
  const fa: FakeAgentsProcess = {
    hosts: o.hosts,
    dataDir: o.dataDir,
    proc: launch(),
    vms() {
      return new Map(o.hosts.map((h) => [h, fakeVmsIn(join(o.dataDir, h, 'vmm'))]));
    },
    async restart() {
      fa.proc.kill();
      await fa.proc.exited;
      await fa.proc.stop();
      const at = size();
      fa.proc = launch();
      await ready(fa.proc, at);
    },
    stop: () => fa.proc.stop(),
  };
  await ready(fa.proc, start0);
  return fa;
}
