// A rendered deployment (deploy/hosts/render.ts) runs as rendered: a 3-member etcd cluster
// started from its /etc/default/etcd files, a 3-server NATS cluster from its
// nats-server.conf files, and two scheduler replicas from their scheduler.env files, each on
// its own loopback address (127.0.0.x) as if on its own machine. Only the paths that name
// the machine's file system (data directories, systemd's credentials directory) are
// rewritten to this test's directory. The systemd units pass `systemd-analyze verify`.
import { spawnSync } from 'node:child_process';
import { mkdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { connect, ErrorCode, RetentionPolicy, type NatsConnection } from 'nats';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { freePort, spawnManaged, tempDir, waitFor, type ManagedProcess } from '../../services/testkit/proc.ts';
import { nkeyConnectOptions, agentConnectOptions } from '../../services/adapters/nats/auth.ts';
import { STREAM_RESULTS, STREAM_WORK, subjects } from '../../services/adapters/nats/subjects.ts';
import { compileAgentConfig } from '../../host-agent/config.ts';
import { compileSchedulerConfig } from '../../services/config.ts';
import { fleetApiClient } from '../fleet/api-credentials.ts';
import { parseInventory, type Inventory } from './inventory.ts';
import { render, SCHEDULER_CREDENTIALS } from './render.ts';

const ROOT = resolve(import.meta.dirname, '..', '..');

/** KEY=VALUE lines of an EnvironmentFile (comments skipped). */
function envFile(path: string): Record<string, string> {
  const out: Record<string, string> = {};
  for (const line of readFileSync(path, 'utf8').split('\n')) {
    const m = /^([A-Z][A-Z0-9_]*)=(.*)$/.exec(line);
    if (m) out[m[1]!] = m[2]!;
  }
  return out;
}

let dir: string;
let out: string;
let inv: Inventory;
const procs: ManagedProcess[] = [];
const machine = (m: string): string => join(out, 'machines', m);

beforeAll(async () => {
  dir = tempDir('ff-render-');
  out = join(dir, 'out');
  // Every member of a role uses the same port on its own address, as on real machines.
  const [etcdClient, etcdPeer, natsClient, natsCluster, natsMonitor, api, metrics] = await Promise.all(Array.from({ length: 7 }, () => freePort()));
  inv = parseInventory({
    name: 'itest',
    installDir: ROOT,
    etcd: [1, 2, 3].map((i) => ({ name: `etcd-${i}`, address: `127.0.0.${10 + i}`, machine: `cp-${i}` })),
    nats: [1, 2, 3].map((i) => ({ name: `nats-${i}`, address: `127.0.0.${20 + i}`, machine: `cp-${i}` })),
    schedulers: [1, 2].map((i) => ({ name: `sched-${i}`, address: `127.0.0.${30 + i}`, machine: `cp-${i}` })),
    hosts: [1, 2].map((i) => ({ id: `kvm-0${i}`, address: `127.0.0.${40 + i}`, linkGbps: 25 })),
    controlCidrs: ['127.0.0.0/8'],
    ports: { etcdClient, etcdPeer, natsClient, natsCluster, natsMonitor, api, metrics },
  });
  render(inv, out);

  // etcd members: the rendered ETCD_* variables, with a data directory of this test's.
  for (const [i, m] of inv.etcd.entries()) {
    const env = { ...envFile(join(machine(m.machine), 'etc/default/etcd')), ETCD_DATA_DIR: join(dir, `etcd-${i}`), ETCD_LOG_LEVEL: 'warn' };
    procs.push(spawnManaged({ name: m.name, command: 'etcd', args: [], env: { PATH: process.env.PATH, ...env }, logPath: join(dir, `${m.name}.log`) }));
  }
  // NATS servers: the rendered config, with a JetStream store of this test's.
  for (const [i, m] of inv.nats.entries()) {
    const text = readFileSync(join(machine(m.machine), 'etc/nats-server.conf'), 'utf8').replace(/^#.*\n/, '');
    const conf = JSON.parse(text) as { jetstream: { store_dir: string } };
    conf.jetstream.store_dir = join(dir, `js-${i}`);
    const path = join(dir, `nats-${i}.conf`);
    writeFileSync(path, JSON.stringify(conf));
    procs.push(spawnManaged({ name: m.name, command: 'nats-server', args: ['-c', path], logPath: join(dir, `${m.name}.log`) }));
  }
  await Promise.all(inv.etcd.map((m) => waitFor(`${m.name} healthy`, async () => fetch(`http://${m.address}:${etcdClient}/health`).then((r) => r.ok, () => false), 30_000, 100)));
  await Promise.all(inv.nats.map((m) => waitFor(`${m.name} ready`, async () => fetch(`http://${m.address}:${natsMonitor}/healthz`).then((r) => r.ok, () => false), 30_000, 100)));
  // A work stream made earlier with one copy (an older config): the schedulers must grow it.
  await waitFor('JetStream cluster has a leader', async () => {
    const nc = await nats(join(machine('cp-1'), 'etc/forkfleet/scheduler/nats.nk'));
    try {
      await (await nc.jetstreamManager()).streams.add({ name: STREAM_WORK, subjects: ['ff.work.*'], retention: RetentionPolicy.Workqueue, num_replicas: 1 });
      return true;
    } catch {
      return false;
    } finally {
      await nc.close();
    }
  }, 30_000, 250);

  // Schedulers: the rendered scheduler.env; systemd's credentials directory is the rendered
  // directory its LoadCredential lines read from, and the tokens file is the rendered one.
  for (const m of inv.schedulers) {
    const root = machine(m.machine);
    const env = Object.fromEntries(Object.entries(envFile(join(root, 'etc/forkfleet/scheduler.env'))).map(([k, v]) => [k, v.replaceAll(SCHEDULER_CREDENTIALS, join(root, 'etc/forkfleet/scheduler')).replaceAll('/etc/forkfleet/tokens.json', join(root, 'etc/forkfleet/tokens.json'))]));
    const logPath = join(dir, `${m.name}.log`);
    const p = spawnManaged({ name: m.name, command: process.execPath, args: ['--import', 'tsx', join(ROOT, 'services', 'main.ts')], env: { ...process.env, ...env, FF_ELECTION_TTL: '1s' }, logPath, cwd: ROOT });
    procs.push(p);
    await waitFor(`${m.name} ready`, async () => {
      if (p.child.exitCode !== null) throw new Error(`${m.name} exited: ${readFileSync(logPath, 'utf8').slice(-1500)}`);
      return readFileSync(logPath, 'utf8').includes('"ready":true');
    }, 60_000, 100);
  }
}, 180_000);

afterAll(async () => {
  // Schedulers first, then NATS, then etcd members one at a time.
  for (const p of [...procs].reverse()) await p.stop(5000);
  if (dir) rmSync(dir, { recursive: true, force: true });
});

async function nats(seedFile: string, extra: Parameters<typeof connect>[0] = {}): Promise<NatsConnection> {
  return connect({ servers: inv.nats.map((m) => `nats://${m.address}:${inv.ports.natsClient}`), ...nkeyConnectOptions(seedFile), ...extra });
}

describe('a rendered deployment', () => {
  it('render_ofThreeControlMachines_schedulersServeTheApiOverTlsWithTheRenderedAdminToken', async () => {
    for (const m of inv.schedulers) {
      const api = await fleetApiClient(out, `${m.address}:${inv.ports.api}`);
      try {
        expect((await api.listHosts({}, { timeoutMs: 10_000 })).hosts).toEqual([]);
      } finally {
        api.close();
      }
    }
    // Exactly one replica leads (the rendered etcd cluster holds the election).
    const leaders = await Promise.all(inv.schedulers.map(async (m) => /^forkfleet_scheduler_is_leader 1$/m.test(await (await fetch(`http://${m.address}:${inv.ports.metrics}/metrics`)).text())));
    expect(leaders.filter(Boolean)).toHaveLength(1);
  });

  it('render_ofThreeNatsServers_streamsAreReplicatedThreeTimes_andAnEarlierSingleCopyStreamGrows', async () => {
    const nc = await nats(join(machine('cp-1'), 'etc/forkfleet/scheduler/nats.nk'));
    try {
      const jsm = await nc.jetstreamManager();
      for (const s of [STREAM_WORK, STREAM_RESULTS]) expect((await jsm.streams.info(s)).config.num_replicas).toBe(3);
    } finally {
      await nc.close();
    }
  });

  it('render_hostNkey_readsItsQueueButCannotActForAnotherHost', async () => {
    const seed = join(machine('127.0.0.41'), 'etc/forkfleet/agent/nats.nk');
    expect(statSync(seed).mode & 0o777).toBe(0o600);
    const nc = await nats(seed, { inboxPrefix: agentConnectOptions('kvm-01', undefined).inboxPrefix });
    try {
      const jsm = await nc.jetstreamManager();
      expect((await jsm.streams.info(STREAM_WORK)).config.name).toBe(STREAM_WORK);
      // The server refuses the publish and says so on the connection (nats.js: an error status).
      const denied = new Promise<string>((res) => {
        void (async () => {
          for await (const st of nc.status()) if (st.type === 'error') res(String(st.data));
        })();
      });
      nc.publish(subjects.result('kvm-02'), new Uint8Array([1]));
      const said = await Promise.race([denied, new Promise<string>((r) => setTimeout(() => r('nothing within 5 s'), 5000))]);
      expect(said).toBe(ErrorCode.PermissionsViolation);
    } finally {
      await nc.close().catch(() => undefined);
    }
  });

  it('render_envFiles_compileThroughTheProcessesConfigValidation', () => {
    for (const h of inv.hosts) {
      const env = envFile(join(machine(h.machine), 'etc/forkfleet/agent.env'));
      const cfg = compileAgentConfig(env);
      expect(cfg.hostId).toBe(h.id);
      expect(cfg.peerAddr).toBe(`${h.address}:${inv.ports.peer}`);
      expect(cfg.linkBytesPerSecond).toBe(3_125_000_000);
      expect(cfg.guestCgroup).toMatchObject({ path: 'forkfleet-guests', required: true });
    }
    const s = compileSchedulerConfig({}, envFile(join(machine('cp-1'), 'etc/forkfleet/scheduler.env')));
    expect(s.natsStreamReplicas).toBe(3);
    expect(s.etcdEndpoints).toHaveLength(3);
  });

  it('render_systemdUnits_passSystemdAnalyzeVerify', () => {
    // Verified as installed: the unit under /etc/systemd/system/ of a scratch root.
    for (const [m, u] of [['cp-1', 'forkfleet-scheduler.service'], ['127.0.0.41', 'forkfleet-agent.service']] as const) {
      const unitDir = join(dir, 'verify', m);
      mkdirSync(unitDir, { recursive: true });
      const path = join(unitDir, u);
      writeFileSync(path, readFileSync(join(machine(m), 'etc/systemd/system', u)));
      // A directive it cannot parse is only a warning on stderr, with exit status 0: both count.
      const r = spawnSync('systemd-analyze', ['verify', path], { encoding: 'utf8' });
      expect({ unit: u, status: r.status, stderr: r.stderr.trim() }).toEqual({ unit: u, status: 0, stderr: '' });
    }
  });

  it('render_again_keepsEverySecretAndChangesNoFile', () => {
    const files = ['machines/cp-1/etc/forkfleet/scheduler/signing.pem', 'machines/cp-1/etc/nats-server.conf', 'machines/127.0.0.42/etc/forkfleet/agent/nats.nk', 'machines/cp-2/etc/forkfleet/scheduler/tls.crt'];
    const before = files.map((f) => readFileSync(join(out, f), 'utf8'));
    const credentials = readFileSync(join(out, 'credentials.json'), 'utf8');
    render(inv, out);
    expect(files.map((f) => readFileSync(join(out, f), 'utf8'))).toEqual(before);
    // The admin token is minted once: the credentials and the tokens file stay as they were.
    expect(readFileSync(join(out, 'credentials.json'), 'utf8')).toBe(credentials);
    expect(JSON.parse(readFileSync(join(out, 'secrets/tokens.json'), 'utf8')).tokens).toHaveLength(1);
    // Directories are 0755 whatever the umask: they land on the machines' /etc.
    expect(statSync(join(out, 'machines/cp-1/etc/forkfleet')).mode & 0o777).toBe(0o755);
  });
});
