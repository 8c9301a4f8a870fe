// A rendered deployment (deploy/hosts/render.ts) runs as rendered: a 3-member etcd cluster
// started from its /etc/default/etcd files, a 3-server NATS cluster from its
// nats-server.conf files, and two scheduler replicas from their scheduler.env files, each on
// its own loopback address (127.0.0.x) as if on its own machine. Only the paths that name
// the machine's file system (data directories, the agent's /etc/forkfleet) are rewritten to
// this test's directory, and systemd's credentials directories are made from the units'
// LoadCredential lines as systemd makes them. etcd and NATS speak TLS only, with client
// certificates. The systemd units pass `systemd-analyze verify`.
import { spawnSync } from 'node:child_process';
import { copyFileSync, mkdirSync, readFileSync, rmSync, statSync, symlinkSync, writeFileSync } from 'node:fs';
import { get as httpsGet } from 'node:https';
import { connect as tcpConnect } from 'node:net';
import { join, resolve } from 'node:path';
import { X509Certificate } from 'node:crypto';
import { Etcd3 } from 'etcd3';
import { connect, ErrorCode, RetentionPolicy, type ConnectionOptions, type NatsConnection } from 'nats';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { freePort, spawnManaged, tempDir, waitFor, type ManagedProcess } from '../../services/testkit/proc.ts';
import { nkeyConnectOptions, agentConnectOptions, natsTlsOptions } from '../../services/adapters/nats/auth.ts';
import { STREAM_RESULTS, STREAM_WORK, subjects } from '../../services/adapters/nats/subjects.ts';
import { compileAgentConfig } from '../../host-agent/config.ts';
import { peerCertificateCn } from '../../host-agent/adapters/peer/peer-identity.ts';
import { compileSchedulerConfig, natsTls, readTlsClientFiles } from '../../services/config.ts';
import { fleetApiClient } from '../fleet/api-credentials.ts';
import { parseInventory, type Inventory } from './inventory.ts';
import { ETCD_CREDENTIALS, ETCD_SERVER_NAME, NATS_CREDENTIALS, render, SCHEDULER_CREDENTIALS } from './render.ts';

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

/**
 * What systemd makes of a unit's LoadCredential=ID:PATH lines: a directory holding a copy of
 * each PATH (on the machine `root`) named ID, in this test's directory. Returns it.
 */
function loadCredentials(unitPath: string, root: string, into: string): string {
  mkdirSync(into, { recursive: true, mode: 0o700 });
  for (const m of readFileSync(unitPath, 'utf8').matchAll(/^LoadCredential=([^:\s]+):(\S+)$/gm)) copyFileSync(join(root, m[2]!), join(into, m[1]!));
  return into;
}

/** Rewrites every value of `env` that names `from` to name `to` instead. */
const rebase = (env: Record<string, string>, from: string, to: string): Record<string, string> => Object.fromEntries(Object.entries(env).map(([k, v]) => [k, v.replaceAll(from, to)]));

let dir: string;
let out: string;
let inv: Inventory;
const procs: ManagedProcess[] = [];
const machine = (m: string): string => join(out, 'machines', m);
/** Every file the first render wrote: path, content and mode. */
let firstRender: Array<[string, string, number]>;
const snapshot = (files: string[]): Array<[string, string, number]> => files.map((f) => [f, readFileSync(join(out, f), 'utf8'), statSync(join(out, f)).mode & 0o777]);
/** Each scheduler's environment as its process sees it (credentials and tokens file rebased). */
const schedulerEnv = new Map<string, Record<string, string>>();
/** The agent of host kvm-01's environment, its /etc/forkfleet rebased onto its machine directory. */
const agentEnv = (): Record<string, string> => rebase(envFile(join(machine('127.0.0.41'), 'etc/forkfleet/agent.env')), '/etc/forkfleet/', `${join(machine('127.0.0.41'), 'etc/forkfleet')}/`);

beforeAll(async () => {
  dir = tempDir('ff-render-');
  out = join(dir, 'out');
  // Every member of a role uses the same port on its own address, as on real machines.
  const [etcdClient, etcdPeer, natsClient, natsCluster, natsMonitor, api, metrics] = await Promise.all(Array.from({ length: 7 }, () => freePort()));
  // The checkout through a link of this test's: one under /home, which the scheduler's unit
  // cannot see (ProtectHome), is refused as an installDir, though these processes run from it.
  const installDir = join(dir, 'install');
  symlinkSync(ROOT, installDir);
  inv = parseInventory({
    name: 'itest',
    installDir,
    etcd: [1, 2, 3].map((i) => ({ name: `etcd-${i}`, address: `127.0.0.${10 + i}`, machine: `cp-${i}` })),
    nats: [1, 2, 3].map((i) => ({ name: `nats-${i}`, address: `127.0.0.${20 + i}`, machine: `cp-${i}` })),
    schedulers: [1, 2].map((i) => ({ name: `sched-${i}`, address: `127.0.0.${30 + i}`, machine: `cp-${i}` })),
    hosts: [1, 2].map((i) => ({ id: `kvm-0${i}`, address: `127.0.0.${40 + i}`, linkGbps: 25 })),
    controlCidrs: ['127.0.0.0/8'],
    ports: { etcdClient, etcdPeer, natsClient, natsCluster, natsMonitor, api, metrics },
  });
  firstRender = snapshot(render(inv, out));

  // etcd members: the rendered ETCD_* variables, with a data directory of this test's and the
  // TLS files their drop-in hands over.
  for (const [i, m] of inv.etcd.entries()) {
    const root = machine(m.machine);
    const creds = loadCredentials(join(root, 'etc/systemd/system/etcd.service.d/forkfleet.conf'), root, join(dir, 'credentials', m.machine, 'etcd.service'));
    const env = { ...rebase(envFile(join(root, 'etc/default/etcd')), ETCD_CREDENTIALS, creds), ETCD_DATA_DIR: join(dir, `etcd-${i}`), ETCD_LOG_LEVEL: 'warn' };
    procs.push(spawnManaged({ name: m.name, command: 'etcd', args: [], env: { PATH: process.env.PATH, ...env }, logPath: join(dir, `${m.name}.log`) }));
  }
  // NATS servers: the rendered config, with a JetStream store of this test's and the TLS files
  // their drop-in hands over.
  for (const [i, m] of inv.nats.entries()) {
    const root = machine(m.machine);
    const creds = loadCredentials(join(root, 'etc/systemd/system/nats-server.service.d/forkfleet.conf'), root, join(dir, 'credentials', m.machine, 'nats-server.service'));
    const text = readFileSync(join(root, 'etc/nats-server.conf'), 'utf8').replace(/^#.*\n/, '').replaceAll(NATS_CREDENTIALS, creds);
    const conf = JSON.parse(text) as { jetstream: { store_dir: string } };
    conf.jetstream.store_dir = join(dir, `js-${i}`);
    const path = join(dir, `nats-${i}.conf`);
    writeFileSync(path, JSON.stringify(conf));
    procs.push(spawnManaged({ name: m.name, command: 'nats-server', args: ['-c', path], logPath: join(dir, `${m.name}.log`) }));
  }
  // Schedulers' environments: the rendered scheduler.env; systemd's credentials directory is
  // made from their unit's LoadCredential lines, and the tokens file is the rendered one.
  for (const m of inv.schedulers) {
    const root = machine(m.machine);
    const creds = loadCredentials(join(root, 'etc/systemd/system/forkfleet-scheduler.service'), root, join(dir, 'credentials', m.machine, 'forkfleet-scheduler.service'));
    schedulerEnv.set(m.name, rebase(rebase(envFile(join(root, 'etc/forkfleet/scheduler.env')), SCHEDULER_CREDENTIALS, creds), '/etc/forkfleet/tokens.json', join(root, 'etc/forkfleet/tokens.json')));
  }
  await Promise.all(inv.etcd.map((m) => waitFor(`${m.name} healthy`, () => etcdHealthy(m.address, schedulerEnv.get('sched-1')!), 30_000, 100)));
  await Promise.all(inv.nats.map((m) => waitFor(`${m.name} ready`, async () => fetch(`http://${m.address}:${natsMonitor}/healthz`).then((r) => r.ok, () => false), 30_000, 100)));
  // A work stream made earlier with one copy (an older config): the schedulers must grow it.
  await waitFor('JetStream cluster has a leader', async () => {
    const nc = await nats(schedulerEnv.get('sched-1')!);
    try {
      await (await nc.jetstreamManager()).streams.add({ name: STREAM_WORK, subjects: ['ff.work.*'], retention: RetentionPolicy.Workqueue, num_replicas: 1 });
      return true;
    } catch {
      return false;
    } finally {
      await nc.close();
    }
  }, 30_000, 250);

  for (const m of inv.schedulers) {
    const logPath = join(dir, `${m.name}.log`);
    const p = spawnManaged({ name: m.name, command: process.execPath, args: ['--import', 'tsx', join(ROOT, 'services', 'main.ts')], env: { ...process.env, ...schedulerEnv.get(m.name)!, FF_ELECTION_TTL: '1s' }, logPath, cwd: ROOT });
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

/** A NATS connection as a process with this environment makes it: its URLs, NKey and TLS files. */
async function nats(env: Record<string, string>, extra: ConnectionOptions = {}): Promise<NatsConnection> {
  const tls = natsTls(env.FF_NATS_URL!.split(','), env);
  return connect({ servers: env.FF_NATS_URL!.split(','), ...nkeyConnectOptions(env.FF_NATS_NKEY_FILE!), ...natsTlsOptions(tls ? readTlsClientFiles(tls) : undefined), ...extra });
}

/**
 * How a TLS server that wants a client certificate turns a client away: its alert (Go sends
 * "bad certificate", OpenSSL's alert 42), or, when the connection is closed before the client
 * has read the alert, a reset.
 */
const REFUSED_HANDSHAKE = /bad certificate|certificate required|ECONNRESET/;

/** The status of an https GET with these PEM files, or the error's message. */
function httpsStatus(url: string, files: { ca: string; cert: string; key: string }): Promise<number | string> {
  return new Promise((res) => {
    const req = httpsGet(url, { ca: readFileSync(files.ca), cert: readFileSync(files.cert), key: readFileSync(files.key), timeout: 2000 }, (r) => {
      r.resume();
      res(r.statusCode ?? 0);
    });
    req.on('error', (e) => res(e.message));
    req.on('timeout', () => req.destroy());
  });
}

/** etcd's /health over https, with the client certificate of a scheduler's environment. */
async function etcdHealthy(address: string, env: Record<string, string>): Promise<boolean> {
  return (await httpsStatus(`https://${address}:${inv.ports.etcdClient}/health`, { ca: env.FF_ETCD_CA!, cert: env.FF_ETCD_CERT!, key: env.FF_ETCD_KEY! })) === 200;
}

/**
 * What a NATS port does with a client that speaks plain text (CONNECT, then PING, in clear):
 * the INFO it sent first, if any, and whether it ever answered PONG before closing.
 */
function plainTextSession(address: string, port: number): Promise<{ info: Record<string, unknown> | undefined; pong: boolean }> {
  return new Promise((res) => {
    const sock = tcpConnect(port, address, () => sock.write('CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n'));
    let got = '';
    const timer = setTimeout(() => sock.destroy(), 10_000);
    sock.on('data', (b) => (got += b.toString('latin1')));
    sock.on('error', () => undefined);
    sock.on('close', () => {
      clearTimeout(timer);
      const info = /^INFO (\{.*\}) ?\r\n/.exec(got)?.[1];
      res({ info: info ? (JSON.parse(info) as Record<string, unknown>) : undefined, pong: got.includes('PONG') });
    });
  });
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
    // Their /metrics (per-tenant series) answer only the rendered metrics token.
    const authorization = `Bearer ${readFileSync(join(out, 'secrets/metrics.token'), 'utf8').trim()}`;
    const leaders = await Promise.all(inv.schedulers.map(async (m) => /^forkfleet_scheduler_is_leader 1$/m.test(await (await fetch(`http://${m.address}:${inv.ports.metrics}/metrics`, { headers: { authorization } })).text())));
    expect(leaders.filter(Boolean)).toHaveLength(1);
    for (const m of inv.schedulers) expect((await fetch(`http://${m.address}:${inv.ports.metrics}/metrics`)).status).toBe(401);
    // They reach etcd by IP address over TLS without Node's warning about an IP address as
    // the TLS server name (DEP0123): they send FF_ETCD_SERVER_NAME, which the members' certificates carry.
    for (const m of inv.schedulers) expect(readFileSync(join(dir, `${m.name}.log`), 'utf8')).not.toMatch(/DEP0123|TLS ServerName/);
  });

  it('render_ofThreeNatsServers_streamsAreReplicatedThreeTimes_andAnEarlierSingleCopyStreamGrows', async () => {
    const nc = await nats(schedulerEnv.get('sched-1')!);
    try {
      const jsm = await nc.jetstreamManager();
      for (const s of [STREAM_WORK, STREAM_RESULTS]) expect((await jsm.streams.info(s)).config.num_replicas).toBe(3);
    } finally {
      await nc.close();
    }
  });

  it('render_hostNkey_readsItsQueueButCannotActForAnotherHost', async () => {
    const env = agentEnv();
    expect(statSync(env.FF_NATS_NKEY_FILE!).mode & 0o777).toBe(0o600);
    const nc = await nats(env, { inboxPrefix: agentConnectOptions('kvm-01', undefined).inboxPrefix });
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
    expect(s.etcdTls).toMatchObject({ ca: `${SCHEDULER_CREDENTIALS}/etcd-ca.crt`, cert: `${SCHEDULER_CREDENTIALS}/etcd.crt` });
    expect(s.natsTls).toMatchObject({ ca: `${SCHEDULER_CREDENTIALS}/ca.crt`, cert: `${SCHEDULER_CREDENTIALS}/nats.crt` });
    expect(compileAgentConfig(envFile(join(machine('127.0.0.41'), 'etc/forkfleet/agent.env'))).natsTls).toMatchObject({ ca: '/etc/forkfleet/agent/ca.crt', cert: '/etc/forkfleet/agent/nats.crt' });
  });

  it('render_peerCertificates_nameEachHostByIdAndAddress_forMutualTlsBetweenAgents', () => {
    const ca = new X509Certificate(readFileSync(join(out, 'secrets', 'ca.crt')));
    for (const h of inv.hosts) {
      const cfg = compileAgentConfig(envFile(join(machine(h.machine), 'etc/forkfleet/agent.env')));
      expect(cfg.peerTls).toEqual({ prefix: 'FF_PEER', ca: '/etc/forkfleet/agent/ca.crt', cert: '/etc/forkfleet/agent/peer.crt', key: '/etc/forkfleet/agent/peer.key' });
      const cert = new X509Certificate(readFileSync(join(machine(h.machine), 'etc/forkfleet/agent/peer.crt')));
      expect(cert.verify(ca.publicKey)).toBe(true);
      expect(cert.subject).toContain(`CN=${peerCertificateCn(h.id)}`);
      expect(cert.subjectAltName).toBe(`IP Address:${h.address}`);
      expect(cert.keyUsage).toEqual(expect.arrayContaining(['1.3.6.1.5.5.7.3.1', '1.3.6.1.5.5.7.3.2']));
      expect(statSync(join(machine(h.machine), 'etc/forkfleet/agent/peer.key')).mode & 0o777).toBe(0o600);
    }
  });

  it('render_etcd_refusesPlainTextAndClientsWithoutAClientCertificate', async () => {
    const env = schedulerEnv.get('sched-1')!;
    const member = `${inv.etcd[0]!.address}:${inv.ports.etcdClient}`;
    // The rendered client certificate is what lets the schedulers in (positive control).
    // Checked against the name the schedulers use (FF_ETCD_SERVER_NAME), as they check it.
    const grpcOptions = { 'grpc.ssl_target_name_override': env.FF_ETCD_SERVER_NAME! };
    expect(env.FF_ETCD_SERVER_NAME).toBe(ETCD_SERVER_NAME);
    const ok = new Etcd3({ hosts: `https://${member}`, grpcOptions, credentials: { rootCertificate: readFileSync(env.FF_ETCD_CA!), certChain: readFileSync(env.FF_ETCD_CERT!), privateKey: readFileSync(env.FF_ETCD_KEY!) } });
    const plain = new Etcd3({ hosts: `http://${member}`, dialTimeout: 2000 });
    const noCert = new Etcd3({ hosts: `https://${member}`, dialTimeout: 2000, grpcOptions, credentials: { rootCertificate: readFileSync(env.FF_ETCD_CA!) } });
    try {
      await ok.put('ff-render-test').value('1');
      await expect(plain.get('ff-render-test').string()).rejects.toThrow(/UNAVAILABLE/);
      await expect(noCert.get('ff-render-test').string()).rejects.toThrow(REFUSED_HANDSHAKE);
    } finally {
      for (const c of [ok, plain, noCert]) c.close();
    }
    // HTTP in clear gets no answer from the API either.
    expect(await fetch(`http://${member}/health`).then((r) => r.ok, () => false)).toBe(false);
    // The peer port admits members' certificates only, not a scheduler's.
    const peer = `https://${inv.etcd[0]!.address}:${inv.ports.etcdPeer}/version`;
    const etcdDir = join(machine(inv.etcd[0]!.machine), 'etc/forkfleet/etcd');
    expect(await httpsStatus(peer, { ca: env.FF_ETCD_CA!, cert: join(etcdDir, 'member.crt'), key: join(etcdDir, 'member.key') })).toBe(200);
    expect(await httpsStatus(peer, { ca: env.FF_ETCD_CA!, cert: env.FF_ETCD_CERT!, key: env.FF_ETCD_KEY! })).toMatch(REFUSED_HANDSHAKE);
  });

  it('render_nats_refusesPlainTextOnClientAndRoutePorts_andTlsClientsWithoutACertificate', async () => {
    // The client port says it requires TLS, then fails the handshake on the plain text; the
    // route port speaks TLS from its first byte. Neither ever answers.
    const [client, route] = await Promise.all([inv.ports.natsClient, inv.ports.natsCluster].map((port) => plainTextSession(inv.nats[1]!.address, port)));
    expect({ tlsRequired: client!.info?.tls_required, pong: client!.pong }).toEqual({ tlsRequired: true, pong: false });
    expect({ info: route!.info, pong: route!.pong }).toEqual({ info: undefined, pong: false });
    // The CA and a valid NKey, but no client certificate: the TLS handshake fails.
    const env = schedulerEnv.get('sched-1')!;
    const refused = await nats({ ...env, FF_NATS_CERT: '', FF_NATS_KEY: '' }, { maxReconnectAttempts: 0, reconnect: false, timeout: 5000 }).then(
      async (nc) => {
        await nc.close();
        return 'connected';
      },
      (e: unknown) => String(e),
    );
    expect(refused).toMatch(REFUSED_HANDSHAKE);
    // With its certificate, the same client gets in.
    await (await nats(env, { maxReconnectAttempts: 0, reconnect: false, timeout: 5000 })).close();
  });

  it('render_systemdUnits_passSystemdAnalyzeVerify', () => {
    // Verified as installed: the unit, or Debian's unit with the rendered drop-in, side by side in a scratch directory.
    for (const [m, u] of [['cp-1', 'forkfleet-scheduler.service'], ['127.0.0.41', 'forkfleet-agent.service'], ['cp-1', 'etcd.service'], ['cp-1', 'nats-server.service']] as const) {
      const unitDir = join(dir, 'verify', m, u);
      mkdirSync(unitDir, { recursive: true });
      const path = join(unitDir, u);
      const dropIn = join(machine(m), 'etc/systemd/system', `${u}.d`, 'forkfleet.conf');
      if (u === 'etcd.service' || u === 'nats-server.service') {
        writeFileSync(path, readFileSync(join('/lib/systemd/system', u)));
        mkdirSync(`${path}.d`);
        writeFileSync(join(`${path}.d`, 'forkfleet.conf'), readFileSync(dropIn));
      } else {
        writeFileSync(path, readFileSync(join(machine(m), 'etc/systemd/system', u)));
      }
      // A directive it cannot parse is only a warning on stderr, with exit status 0: both count.
      const r = spawnSync('systemd-analyze', ['verify', path], { encoding: 'utf8' });
      expect({ unit: u, status: r.status, stderr: r.stderr.trim() }).toEqual({ unit: u, status: 0, stderr: '' });
    }
  });

  it('render_again_keepsEverySecretAndChangesNoFile', () => {
    expect(firstRender.map(([f]) => f)).toEqual(expect.arrayContaining(['machines/cp-1/etc/forkfleet/scheduler/signing.pem', 'machines/cp-1/etc/forkfleet/etcd/member.key', 'machines/127.0.0.42/etc/forkfleet/agent/nats.key']));
    const credentials = readFileSync(join(out, 'credentials.json'), 'utf8');
    // The same files, each with the same content and mode, as the first render's.
    expect(snapshot(render(inv, out))).toEqual(firstRender);
    // The admin token is minted once: the credentials and the tokens file stay as they were.
    expect(readFileSync(join(out, 'credentials.json'), 'utf8')).toBe(credentials);
    expect(JSON.parse(readFileSync(join(out, 'secrets/tokens.json'), 'utf8')).tokens).toHaveLength(1);
    // Directories are 0755 whatever the umask: they land on the machines' /etc.
    expect(statSync(join(out, 'machines/cp-1/etc/forkfleet')).mode & 0o777).toBe(0o755);
  });
});
