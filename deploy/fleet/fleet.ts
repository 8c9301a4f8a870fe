// The local multi-host fleet: real etcd, NATS with JetStream, two scheduler replicas and N
// host agents, each agent in its own network namespace with its own address, data
// directory (other agents' directories are hidden by a private mount namespace) and a
// tbf-shaped link to a shared bridge.
//
//   node --import tsx deploy/fleet/fleet.ts up [--hosts 3] [--etcd 1|3] [--link 10gbit]
//   node --import tsx deploy/fleet/fleet.ts status [--json]
//   node --import tsx deploy/fleet/fleet.ts down
//
// Layout (FF_FLEET_DIR, default /var/lib/ffleet):
//   state.json            every process (by PID), namespace and address this fleet made
//   logs/<process>.log
//   keys/signing.pem(.pub) the schedulers' Ed25519 key; agents trust the .pub
//   pki/, keys/tokens.json, credentials.json (admin), dev-credentials.json (tenant dev):
//                         the API's TLS and tokens (deploy/fleet/api-credentials.ts)
//   etcd/<member>/, nats/  control-plane data
//   nats-keys/            NATS config and the schedulers' NKey seed (hidden from agents)
//   hosts/<id>/nats.nk    that host's NATS NKey seed: it may use only its own subjects
//   hosts/<hostId>/       one agent's data (VMs, snapshots, chunks, journal)
//   nats.sock             the NATS relay socket agents reach from their namespaces
//
// Network: namespace <prefix>-net holds bridge br0 (no address); namespace <prefix>-<host>
// holds eth0 = 10.213.77.<10+i>/24. The control plane listens on the root namespace's
// loopback; agents reach NATS through a unix-socket relay, so no address exists outside
// the fleet's own namespaces. Peer chunk transfers cross the shaped veth links.
import { spawn, execFileSync } from 'node:child_process';
import { closeSync, copyFileSync, existsSync, mkdirSync, openSync, readFileSync, readdirSync, rmdirSync, rmSync, writeFileSync } from 'node:fs';
import { createConnection } from 'node:net';
import { dirname, join, resolve } from 'node:path';
import { totalmem } from 'node:os';
import { createPublicKey, generateKeyPairSync } from 'node:crypto';
import { createNkeyFile, hostPermissions, natsServerAuthConfig } from '../../services/adapters/nats/auth.ts';
import type { NatsUser } from '../../services/adapters/nats/auth.ts';
import { DEFAULT_RAM_MOUNT, ramDirFor } from '../../host-agent/adapters/qemu/ram-pool.ts';
import { cpuHierarchy, GuestCgroup } from '../../host-agent/adapters/qemu/cgroup.ts';
import { apiCredentialPaths, fleetApiClient, makeApiCredentials, schedulerApiEnv } from './api-credentials.ts';
import { ensurePeerCert } from '../pki/pki.ts';
import { parseOnOff } from '../../services/config.ts';

const ROOT = resolve(import.meta.dirname, '..', '..');
const NODE = process.execPath;

export interface FleetOptions {
  hosts: number;
  etcd: 1 | 3;
  /** tbf rate, e.g. "10gbit", "1gbit", "500mbit". */
  link: string;
  dir: string;
  /** Namespace and interface name prefix (<= 6 characters). */
  prefix: string;
  basePort: number;
  /** Per-agent memory capacity the scheduler may book, MiB. */
  hostMemoryMib: number;
  /** Mutual TLS between the agents (peer transfers and migration streams; default on). */
  peerTls: boolean;
  /** Extra FF_* environment for the schedulers and the agents (tests tune timings with it). */
  schedulerEnv?: Record<string, string>;
  agentEnv?: Record<string, string>;
}

export interface ProcRecord {
  name: string;
  kind: 'etcd' | 'nats' | 'relay' | 'scheduler' | 'agent';
  pid: number;
  log: string;
  host?: string;
  netns?: string;
  /** How it was started, so that a fault test can start it again. */
  command: string;
  args: string[];
  env: Record<string, string>;
  /** Working directory, when not the repository (nats-server: its store). */
  cwd?: string;
}

export interface HostRecord {
  id: string;
  netns: string;
  address: string;
  dataDir: string;
  /** veth end inside the host namespace, and its peer on the bridge. */
  ifHost: string;
  ifBridge: string;
}

export interface FleetState {
  version: 1;
  startedAt: string;
  options: FleetOptions;
  apiAddresses: string[];
  metricsAddresses: string[];
  etcdEndpoints: string[];
  natsUrl: string;
  natsMonitor: string;
  netnsBridge: string;
  namespaces: string[];
  hosts: HostRecord[];
  procs: ProcRecord[];
  signingKey: string;
  trustedKey: string;
  /** The cgroup the agents put their guests in (ADR 0018), removed by down(); empty: none. */
  guestCgroup?: string;
}

export function defaultOptions(over: Partial<FleetOptions> = {}): FleetOptions {
  const hosts = over.hosts ?? 3;
  return {
    hosts,
    etcd: over.etcd ?? 1,
    link: over.link ?? '10gbit',
    dir: over.dir ?? process.env.FF_FLEET_DIR ?? '/var/lib/ffleet',
    prefix: over.prefix ?? 'ffl',
    basePort: over.basePort ?? 17700,
    hostMemoryMib: over.hostMemoryMib ?? Math.floor((totalmem() / 1048576) * 0.7 / hosts),
    peerTls: over.peerTls ?? true,
    ...(over.schedulerEnv ? { schedulerEnv: over.schedulerEnv } : {}),
    ...(over.agentEnv ? { agentEnv: over.agentEnv } : {}),
  };
}

function sh(cmd: string, args: string[], opts: { allowFail?: boolean } = {}): string {
  try {
    return execFileSync(cmd, args, { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });
  } catch (e) {
    if (opts.allowFail) return '';
    const err = e as { stderr?: string; message: string };
    throw new Error(`${cmd} ${args.join(' ')}: ${err.stderr?.trim() || err.message}`, { cause: e });
  }
}

export function pidAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

function statePath(dir: string): string {
  return join(dir, 'state.json');
}

export function readState(dir: string): FleetState | undefined {
  const p = statePath(dir);
  if (!existsSync(p)) return undefined;
  return JSON.parse(readFileSync(p, 'utf8')) as FleetState;
}

function saveState(s: FleetState): void {
  const p = statePath(s.options.dir);
  writeFileSync(`${p}.tmp`, JSON.stringify(s, null, 2));
  execFileSync('mv', ['-f', `${p}.tmp`, p]);
}

/** Bytes per second of a tc rate such as "10gbit" or "500mbit". */
export function linkBytesPerSecond(rate: string): number {
  const m = /^(\d+(?:\.\d+)?)(k|m|g)?bit$/i.exec(rate);
  if (!m) throw new Error(`--link: want a rate like 10gbit, 1gbit or 500mbit, got ${JSON.stringify(rate)}`);
  const mult = { k: 1e3, m: 1e6, g: 1e9 }[(m[2] ?? '').toLowerCase() as 'k' | 'm' | 'g'] ?? 1;
  return (Number(m[1]) * mult) / 8;
}

function tbfArgs(rate: string): string[] {
  const bps = linkBytesPerSecond(rate);
  // The bucket must hold at least one timer tick of traffic at this rate.
  const burst = Math.max(256 * 1024, Math.ceil(bps / 100));
  return ['root', 'tbf', 'rate', rate, 'burst', String(burst), 'latency', '5ms'];
}

function waitPort(host: string, port: number, timeoutMs: number): Promise<void> {
  const until = Date.now() + timeoutMs;
  return new Promise((resolvePromise, reject) => {
    const attempt = (): void => {
      const s = createConnection(port, host);
      s.once('connect', () => {
        s.destroy();
        resolvePromise();
      });
      s.once('error', () => {
        s.destroy();
        if (Date.now() > until) reject(new Error(`nothing listens on ${host}:${port} after ${timeoutMs} ms`));
        else setTimeout(attempt, 50);
      });
    };
    attempt();
  });
}

async function waitLog(path: string, needle: string, timeoutMs: number, pid: number): Promise<void> {
  const until = Date.now() + timeoutMs;
  while (Date.now() < until) {
    if (existsSync(path) && readFileSync(path, 'utf8').includes(needle)) return;
    if (!pidAlive(pid)) throw new Error(`process ${pid} exited; see ${path}:\n${existsSync(path) ? readFileSync(path, 'utf8').slice(-1500) : ''}`);
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`timed out waiting for "${needle}" in ${path}`);
}

function spawnDetached(log: string, command: string, args: string[], env: Record<string, string>, cwd = ROOT): number {
  const fd = openSync(log, 'a');
  const child = spawn(command, args, { detached: true, stdio: ['ignore', fd, fd], env: { ...process.env, ...env }, cwd });
  closeSync(fd);
  child.unref();
  if (child.pid === undefined) throw new Error(`could not start ${command}`);
  return child.pid;
}

function launch(state: FleetState, rec: Omit<ProcRecord, 'pid' | 'log' | 'command' | 'args' | 'env'>, command: string, args: string[], env: Record<string, string> = {}): ProcRecord {
  const log = join(state.options.dir, 'logs', `${rec.name}.log`);
  const full: ProcRecord = { ...rec, pid: spawnDetached(log, command, args, env, rec.cwd), log, command, args, env };
  state.procs.push(full);
  saveState(state);
  return full;
}

/**
 * Stops one of the fleet's processes (if it runs) and starts it again the way it was
 * started, waiting until it is ready. For fault tests and operators.
 */
export async function restartProcess(dir: string, name: string): Promise<ProcRecord> {
  const state = readState(dir);
  const rec = state?.procs.find((p) => p.name === name);
  if (!state || !rec) throw new Error(`no process ${name} in the fleet at ${dir}`);
  await stopPid(rec.pid, 8000);
  rec.pid = spawnDetached(rec.log, rec.command, rec.args, rec.env, rec.cwd);
  saveState(state);
  if (rec.kind === 'agent' || rec.kind === 'scheduler') {
    const lines = readFileSync(rec.log, 'utf8').split('\n').length;
    const until = Date.now() + 120_000;
    for (;;) {
      const fresh = readFileSync(rec.log, 'utf8').split('\n').slice(lines - 1);
      if (fresh.some((l) => l.includes('"ready":true'))) break;
      if (!pidAlive(rec.pid)) throw new Error(`${name} exited on restart; see ${rec.log}`);
      if (Date.now() > until) throw new Error(`${name} not ready after restart`);
      await new Promise((r) => setTimeout(r, 100));
    }
  } else if (rec.kind === 'etcd' || rec.kind === 'nats') {
    const url = rec.args[rec.args.indexOf(rec.kind === 'etcd' ? '--listen-client-urls' : '-p') + 1] ?? '';
    const port = Number(rec.kind === 'etcd' ? url.slice(url.lastIndexOf(':') + 1) : url);
    await waitPort('127.0.0.1', port, 15_000);
  }
  return rec;
}

function tsx(script: string, ...args: string[]): string[] {
  return ['--import', 'tsx', join(ROOT, script), ...args];
}

function inNetns(ns: string, command: string, args: string[]): [string, string[]] {
  return ['ip', ['netns', 'exec', ns, command, ...args]];
}

function makeNetwork(state: FleetState): void {
  const { prefix, hosts, link } = state.options;
  const net = `${prefix}-net`;
  state.netnsBridge = net;
  sh('ip', ['netns', 'add', net]);
  state.namespaces.push(net);
  saveState(state);
  sh('ip', ['-n', net, 'link', 'add', 'br0', 'type', 'bridge']);
  sh('ip', ['-n', net, 'link', 'set', 'br0', 'up']);
  sh('ip', ['-n', net, 'link', 'set', 'lo', 'up']);
  for (let i = 1; i <= hosts; i++) {
    const id = `h${i}`;
    const ns = `${prefix}-${id}`;
    const ifHost = `${prefix}${id}a`;
    const ifBridge = `${prefix}${id}b`;
    sh('ip', ['netns', 'add', ns]);
    state.namespaces.push(ns);
    saveState(state);
    sh('ip', ['link', 'add', ifHost, 'type', 'veth', 'peer', 'name', ifBridge]);
    sh('ip', ['link', 'set', ifHost, 'netns', ns]);
    sh('ip', ['link', 'set', ifBridge, 'netns', net]);
    const address = `10.213.77.${10 + i}`;
    sh('ip', ['-n', ns, 'addr', 'add', `${address}/24`, 'dev', ifHost]);
    sh('ip', ['-n', ns, 'link', 'set', ifHost, 'up']);
    sh('ip', ['-n', ns, 'link', 'set', 'lo', 'up']);
    sh('ip', ['-n', net, 'link', 'set', ifBridge, 'master', 'br0']);
    sh('ip', ['-n', net, 'link', 'set', ifBridge, 'up']);
    // Shape both directions: host egress on its own end, host ingress on the bridge end.
    sh('tc', ['-n', ns, 'qdisc', 'add', 'dev', ifHost, ...tbfArgs(link)]);
    sh('tc', ['-n', net, 'qdisc', 'add', 'dev', ifBridge, ...tbfArgs(link)]);
    const dataDir = join(state.options.dir, 'hosts', id);
    mkdirSync(dataDir, { recursive: true });
    state.hosts.push({ id, netns: ns, address, dataDir, ifHost, ifBridge });
    saveState(state);
  }
}

function makeKeys(state: FleetState): void {
  const dir = join(state.options.dir, 'keys');
  mkdirSync(dir, { recursive: true, mode: 0o700 });
  const { privateKey } = generateKeyPairSync('ed25519');
  writeFileSync(state.signingKey, privateKey.export({ type: 'pkcs8', format: 'pem' }), { mode: 0o600 });
  writeFileSync(state.trustedKey, createPublicKey(privateKey).export({ type: 'spki', format: 'pem' }), { mode: 0o644 });
}

async function startEtcd(state: FleetState): Promise<void> {
  const { etcd, basePort } = state.options;
  const members = Array.from({ length: etcd }, (_, i) => ({ name: `etcd-${i + 1}`, client: basePort + 20 + i, peer: basePort + 30 + i }));
  const initial = members.map((m) => `${m.name}=http://127.0.0.1:${m.peer}`).join(',');
  for (const m of members) {
    const data = join(state.options.dir, 'etcd', m.name);
    mkdirSync(data, { recursive: true });
    launch(state, { name: m.name, kind: 'etcd' }, 'etcd', [
      '--name', m.name, '--data-dir', data,
      '--listen-client-urls', `http://127.0.0.1:${m.client}`, '--advertise-client-urls', `http://127.0.0.1:${m.client}`,
      '--listen-peer-urls', `http://127.0.0.1:${m.peer}`, '--initial-advertise-peer-urls', `http://127.0.0.1:${m.peer}`,
      '--initial-cluster', initial, '--initial-cluster-state', 'new',
      '--heartbeat-interval', '10', '--election-timeout', '100', '--max-txn-ops', '1024', '--log-level', 'warn',
    ]);
  }
  state.etcdEndpoints = members.map((m) => `http://127.0.0.1:${m.client}`);
  for (const m of members) await waitPort('127.0.0.1', m.client, 15_000);
}

/** NATS secrets: hidden from the agents by a tmpfs in their mount namespace (startAgent). */
const natsKeysDir = (state: FleetState): string => join(state.options.dir, 'nats-keys');
/** A host's NKey seed sits in its own data directory, the only fleet directory its agent sees. */
const hostNatsSeed = (h: HostRecord): string => join(h.dataDir, 'nats.nk');

/** NKeys for the schedulers (full rights) and for each host (only its own subjects). */
function makeNatsAuth(state: FleetState): string {
  const dir = natsKeysDir(state);
  mkdirSync(dir, { recursive: true, mode: 0o700 });
  const users: NatsUser[] = [{ nkey: createNkeyFile(join(dir, 'scheduler.nk')).publicKey }];
  for (const h of state.hosts) {
    mkdirSync(h.dataDir, { recursive: true });
    users.push({ nkey: createNkeyFile(hostNatsSeed(h)).publicKey, permissions: hostPermissions(h.id) });
  }
  const conf = natsServerAuthConfig(users);
  const path = join(dir, 'nats.conf');
  writeFileSync(path, conf, { mode: 0o600 });
  return path;
}

async function startNats(state: FleetState): Promise<void> {
  const port = state.options.basePort + 40;
  const monitor = port + 1;
  const store = join(state.options.dir, 'nats');
  mkdirSync(store, { recursive: true });
  const conf = makeNatsAuth(state);
  // Its store as working directory: nats-server writes a lost consumer's meta.inf relative to it.
  launch(state, { name: 'nats', kind: 'nats', cwd: store }, 'nats-server', ['-c', conf, '-js', '-a', '127.0.0.1', '-p', String(port), '-m', String(monitor), '-sd', store]);
  state.natsUrl = `nats://127.0.0.1:${port}`;
  state.natsMonitor = `http://127.0.0.1:${monitor}`;
  await waitPort('127.0.0.1', port, 10_000);
  const sock = join(state.options.dir, 'nats.sock');
  const r = launch(state, { name: 'relay-nats', kind: 'relay' }, NODE, tsx('deploy/fleet/relay.ts', `unix:${sock}=tcp:127.0.0.1:${port}`));
  await waitLog(r.log, 'relay ready', 15_000, r.pid);
}

async function startSchedulers(state: FleetState): Promise<void> {
  for (let i = 0; i < 2; i++) {
    const api = `127.0.0.1:${state.options.basePort + i}`;
    const metrics = `127.0.0.1:${state.options.basePort + 10 + i}`;
    const p = launch(state, { name: `scheduler-${i + 1}`, kind: 'scheduler' }, NODE, tsx('services/main.ts'), {
      FF_SCHEDULER_ID: `scheduler-${i + 1}`,
      FF_GRPC_ADDR: api,
      FF_METRICS_ADDR: metrics,
      FF_ETCD_ENDPOINTS: state.etcdEndpoints.join(','),
      FF_NATS_URL: state.natsUrl,
      FF_NATS_NKEY_FILE: join(natsKeysDir(state), 'scheduler.nk'),
      FF_SIGNING_KEY: state.signingKey,
      FF_DASHBOARD_METRICS: [0, 1].map((j) => `http://127.0.0.1:${state.options.basePort + 10 + j}/metrics`).join(','),
      FF_DASHBOARD_TENANTS: process.env.FF_DASHBOARD_TENANTS ?? 'default,demo,dev',
      ...schedulerApiEnv(state.options.dir),
      ...state.options.schedulerEnv,
    });
    await waitLog(p.log, '"ready":true', 60_000, p.pid);
    state.apiAddresses.push(api);
    state.metricsAddresses.push(metrics);
    saveState(state);
  }
}

/**
 * Shell commands that mount the machine's cgroup hierarchy with the cpu controller at its usual
 * place inside an agent's mount namespace: `ip netns exec` mounts a fresh /sys there, without
 * /sys/fs/cgroup's mounts, and the agent's guests join a cgroup of that hierarchy (ADR 0018).
 */
export function cgroupMountCommands(mounts = readFileSync('/proc/self/mounts', 'utf8')): string[] {
  const rows = mounts.split('\n').map((l) => l.split(' '));
  if (rows.some((m) => m[1] === '/sys/fs/cgroup' && m[2] === 'cgroup2')) return ['mount -t cgroup2 cgroup2 /sys/fs/cgroup'];
  const cpu = rows.find((m) => m[2] === 'cgroup' && (m[3] ?? '').split(',').includes('cpu'));
  if (!cpu?.[1]) return [];
  const controllers = (cpu[3] ?? '').split(',').filter((o) => o === 'cpu' || o === 'cpuacct').join(',');
  return [
    'mount -t tmpfs -o size=64k,mode=0755 ff-cgroup /sys/fs/cgroup',
    `mkdir -p "${cpu[1]}"`,
    `mount -t cgroup -o ${controllers} cgroup "${cpu[1]}"`,
    // Co-mounted hierarchies are reached as /sys/fs/cgroup/cpu too (a symlink on Debian).
    ...(cpu[1] === '/sys/fs/cgroup/cpu' ? [] : ['ln -s "' + cpu[1] + '" /sys/fs/cgroup/cpu']),
  ];
}

/**
 * The guests' cgroup of a fleet's agents: FF_GUEST_CGROUP when set (empty: off), else one per
 * fleet. It is made here, as the agents will (so they reuse it); where that fails, guests run
 * without CPU isolation and this says why on stderr.
 */
async function guestCgroupFor(opts: FleetOptions): Promise<string> {
  const chosen = opts.agentEnv?.FF_GUEST_CGROUP ?? process.env.FF_GUEST_CGROUP ?? `forkfleet-${opts.prefix}-guests`;
  if (!chosen) return '';
  const why = cgroupMountCommands().length === 0 ? 'no cgroup hierarchy with the cpu controller' : await GuestCgroup.open({ path: chosen, cpuWeight: 100 }).then(() => '', (e: unknown) => (e as Error).message);
  if (why) process.stderr.write(`fleet: guests run without CPU isolation (ADR 0018): ${why}\n`);
  return why ? '' : chosen;
}

/** Where a host's peer TLS files are (makePeerCert writes them): the fleet's CA, its certificate and key. */
export function peerCertFiles(h: { dataDir: string }): { ca: string; cert: string; key: string } {
  return { ca: join(h.dataDir, 'peer-ca.crt'), cert: join(h.dataDir, 'peer.crt'), key: join(h.dataDir, 'peer.key') };
}

/**
 * The host's peer certificate (mutual TLS between agents, host-agent/adapters/peer/tls.ts),
 * from the fleet's dev CA: CN forkfleet-host-<id>, its peer address as IP SAN. The key, the
 * certificate and a copy of the CA's certificate live in the host's own directory, which only
 * its agent sees. Returns the agent's FF_PEER_* variables.
 */
function makePeerCert(state: FleetState, h: HostRecord): Record<string, string> {
  const ca = apiCredentialPaths(state.options.dir);
  const files = peerCertFiles(h);
  mkdirSync(h.dataDir, { recursive: true });
  ensurePeerCert({ caCert: ca.caCert, caKey: join(ca.pki, 'ca.key') }, { cert: files.cert, key: files.key }, h.id, h.address);
  copyFileSync(ca.caCert, files.ca);
  return { FF_PEER_CA: files.ca, FF_PEER_CERT: files.cert, FF_PEER_KEY: files.key };
}

/**
 * The agent runs in its host's network namespace. `ip netns exec` also gives it a mount
 * namespace of its own; there the fleet's hosts/ directory is covered by an empty tmpfs
 * and only the agent's own directory is bound back, so an agent cannot read or write
 * another agent's files.
 */
async function startAgent(state: FleetState, h: HostRecord): Promise<void> {
  const hostsDir = join(state.options.dir, 'hosts');
  const stash = join(state.options.dir, `.own-${h.id}`);
  mkdirSync(stash, { recursive: true });
  const peerTls = state.options.peerTls === false ? {} : makePeerCert(state, h);
  const sock = join(state.options.dir, 'nats.sock');
  const relay = launch(state, { name: `relay-${h.id}`, kind: 'relay', host: h.id, netns: h.netns }, ...inNetns(h.netns, NODE, tsx('deploy/fleet/relay.ts', `tcp:127.0.0.1:4222=unix:${sock}`)));
  await waitLog(relay.log, 'relay ready', 15_000, relay.pid);
  const script = [
    'set -e',
    `mount --bind "${h.dataDir}" "${stash}"`,
    `mount -t tmpfs -o size=1m,mode=0755 ff-hosts "${hostsDir}"`,
    `mount -t tmpfs -o size=1m,mode=0700 ff-nats-keys "${natsKeysDir(state)}"`,
    // The dev CA's key and the API's key are not the agent's either (it has the CA's certificate).
    `mount -t tmpfs -o size=1m,mode=0700 ff-pki "${apiCredentialPaths(state.options.dir).pki}"`,
    `mkdir -p "${h.dataDir}"`,
    `mount --move "${stash}" "${h.dataDir}"`,
    ...(state.guestCgroup ? cgroupMountCommands() : []),
    `exec "${NODE}" --import tsx "${join(ROOT, 'host-agent', 'main.ts')}"`,
  ].join('; ');
  const p = launch(state, { name: `agent-${h.id}`, kind: 'agent', host: h.id, netns: h.netns }, ...inNetns(h.netns, 'sh', ['-c', script]), {
    FF_HOST_ID: h.id,
    FF_DATA_DIR: h.dataDir,
    FF_NATS_URL: 'nats://127.0.0.1:4222',
    FF_NATS_NKEY_FILE: hostNatsSeed(h),
    // Sandboxes allowed egress never reach the fleet network (other agents' peer ports).
    FF_EGRESS_DENY_CIDRS: '10.213.77.0/24',
    FF_PEER_ADDR: `${h.address}:7800`,
    ...peerTls,
    FF_TRUSTED_KEY: state.trustedKey,
    FF_ACCEL: process.env.FF_ACCEL ?? 'auto',
    FF_LINK_BYTES_PER_SECOND: String(Math.round(linkBytesPerSecond(state.options.link))),
    FF_CAPACITY_MEMORY_MIB: String(state.options.hostMemoryMib),
    FF_HEARTBEAT_INTERVAL: '500ms',
    FF_GUEST_CGROUP: state.guestCgroup ?? '',
    ...state.options.agentEnv,
  });
  await waitLog(p.log, '"ready":true', 120_000, p.pid);
}

/** The fleet is up when the scheduler reports every host ready (registered from its heartbeats). */
async function waitHostsReady(state: FleetState, timeoutMs: number): Promise<void> {
  const { HostState } = await import('../../proto/gen/forkfleet/v1/fleet_pb.ts');
  const api = await fleetApiClient(state.options.dir, state.apiAddresses[0]!);
  const until = Date.now() + timeoutMs;
  try {
    for (;;) {
      const hosts = await api.listHosts({}, { timeoutMs: 3000 }).then((r) => r.hosts, () => []);
      if (hosts.length === state.hosts.length && hosts.every((h) => h.state === HostState.READY)) return;
      if (Date.now() > until) throw new Error(`only ${hosts.length} of ${state.hosts.length} hosts registered ready after ${timeoutMs} ms`);
      await new Promise((r) => setTimeout(r, 200));
    }
  } finally {
    api.close();
  }
}

export async function up(opts: FleetOptions): Promise<FleetState> {
  if (!/^[a-z]{1,6}$/.test(opts.prefix)) throw new Error('--prefix: 1-6 lowercase letters');
  if (!(opts.hosts >= 1 && opts.hosts <= 32)) throw new Error('--hosts: 1..32');
  linkBytesPerSecond(opts.link);
  const existing = readState(opts.dir);
  if (existing) {
    const alive = existing.procs.filter((p) => pidAlive(p.pid));
    if (alive.length > 0) throw new Error(`a fleet is already up in ${opts.dir} (since ${existing.startedAt}, ${alive.length} processes alive): run fleet:down first`);
    await down(opts.dir);
  }
  for (const ns of sh('ip', ['netns', 'list']).split('\n').map((l) => l.split(' ')[0])) {
    if (ns && ns.startsWith(`${opts.prefix}-`)) throw new Error(`network namespace ${ns} already exists; run fleet:down or delete it`);
  }
  mkdirSync(join(opts.dir, 'logs'), { recursive: true });
  const state: FleetState = {
    version: 1,
    startedAt: new Date().toISOString(),
    options: opts,
    apiAddresses: [],
    metricsAddresses: [],
    etcdEndpoints: [],
    natsUrl: '',
    natsMonitor: '',
    netnsBridge: '',
    namespaces: [],
    hosts: [],
    procs: [],
    signingKey: join(opts.dir, 'keys', 'signing.pem'),
    trustedKey: join(opts.dir, 'keys', 'signing.pem.pub'),
    guestCgroup: await guestCgroupFor(opts),
  };
  saveState(state);
  try {
    const { ensureImage } = await import('../images/build.ts');
    const step = (s: string): void => void process.stderr.write(`fleet: ${s}\n`);
    step('guest image');
    await ensureImage('tiny');
    step(`network: ${opts.hosts} host namespaces on a bridge, links shaped to ${opts.link}`);
    makeNetwork(state);
    makeKeys(state);
    makeApiCredentials(opts.dir);
    step(`etcd (${opts.etcd} member${opts.etcd > 1 ? 's' : ''}) and NATS`);
    await Promise.all([startEtcd(state), startNats(state)]);
    step('2 scheduler replicas');
    await startSchedulers(state);
    step(`${opts.hosts} host agents`);
    await Promise.all(state.hosts.map((h) => startAgent(state, h)));
    saveState(state);
    await waitHostsReady(state, 60_000);
    return state;
  } catch (e) {
    process.stderr.write(`fleet: start failed, cleaning up: ${(e as Error).message}\n`);
    await down(opts.dir);
    throw e;
  }
}

async function stopPid(pid: number, graceMs: number): Promise<void> {
  if (!pidAlive(pid)) return;
  try {
    process.kill(pid, 'SIGTERM');
  } catch {
    return;
  }
  const until = Date.now() + graceMs;
  while (Date.now() < until && pidAlive(pid)) await new Promise((r) => setTimeout(r, 50));
  if (pidAlive(pid)) {
    try {
      process.kill(pid, 'SIGKILL');
    } catch {
      /* gone */
    }
    while (pidAlive(pid)) await new Promise((r) => setTimeout(r, 20));
  }
}

/** QEMU PIDs recorded in an agent's data directory, by VM (one pid file per QEMU generation). */
export function qemuPidsByVm(dataDir: string): Map<string, number[]> {
  const vms = join(dataDir, 'vmm', 'vms');
  const out = new Map<string, number[]>();
  if (!existsSync(vms)) return out;
  for (const vm of readdirSync(vms)) {
    let files: string[] = [];
    try {
      files = readdirSync(join(vms, vm));
    } catch {
      continue;
    }
    out.set(vm, files.filter((f) => /^qemu\..*pid$/.test(f)).flatMap((f) => readPidFile(join(vms, vm, f))));
  }
  return out;
}

/** Every QEMU PID recorded in an agent's data directory: its VMs'. */
export function qemuPids(dataDir: string): number[] {
  return [...qemuPidsByVm(dataDir).values()].flat();
}

/**
 * PIDs of the agent's standby QEMUs (paused processes no sandbox owns yet, ADR 0014). A
 * stopping agent ends them itself; this is for tearing down after an agent was killed.
 */
export function standbyPids(dataDir: string): number[] {
  const dir = join(dataDir, 'vmm', 'standby');
  if (!existsSync(dir)) return [];
  // A claimed standby's symlink to a destroyed VM, or one still starting, has no pid file.
  return readdirSync(dir).flatMap((s) => readPidFile(join(dir, s, 'qemu.0.pid')));
}

/** The PID a QEMU pid file names: none if the file is missing or holds no plausible PID. */
function readPidFile(path: string): number[] {
  let pid: number;
  try {
    pid = Number(readFileSync(path, 'utf8').trim());
  } catch {
    return [];
  }
  return Number.isInteger(pid) && pid > 1 ? [pid] : [];
}

/**
 * Removes the fleet's guests cgroup. Whatever is still in it is a QEMU this fleet's agents
 * started that the stops above missed (a receiver of a snapshot, say): it is killed by PID
 * first. Only the group itself goes, not parents of a nested FF_GUEST_CGROUP.
 */
async function removeGuestCgroup(path: string): Promise<void> {
  const h = await cpuHierarchy();
  if (!h) return;
  const dir = join(h.base, path);
  for (let attempt = 0; attempt < 50; attempt++) {
    let procs: string;
    try {
      procs = readFileSync(join(dir, 'cgroup.procs'), 'utf8');
    } catch {
      return; // gone already
    }
    for (const pid of procs.split('\n').filter(Boolean).map(Number)) {
      try {
        process.kill(pid, 'SIGKILL');
      } catch {
        /* exited meanwhile */
      }
    }
    try {
      rmdirSync(dir);
      return;
    } catch {
      await new Promise((r) => setTimeout(r, 100)); // the killed ones are still leaving it
    }
  }
  process.stderr.write(`fleet: could not remove cgroup ${dir}\n`);
}

export async function down(dir: string): Promise<void> {
  const state = readState(dir);
  if (!state) {
    process.stderr.write(`fleet: nothing to stop in ${dir}\n`);
    return;
  }
  const order: ProcRecord['kind'][] = ['agent', 'scheduler', 'relay', 'nats', 'etcd'];
  for (const kind of order) {
    const procs = state.procs.filter((p) => p.kind === kind);
    // etcd members one at a time (all at once makes the last one hang).
    if (kind === 'etcd') for (const p of procs) await stopPid(p.pid, 5000);
    else await Promise.all(procs.map((p) => stopPid(p.pid, 8000)));
    if (kind === 'agent') {
      // Agents leave VMs running for a restarted agent to adopt; down ends them too.
      for (const h of state.hosts) for (const pid of [...qemuPids(h.dataDir), ...standbyPids(h.dataDir)]) await stopPid(pid, 2000);
      // Agents mount their RAM tmpfs in their own mount namespace (gone with them); when one
      // was already mounted on the machine, their files are in it: remove them.
      const ramMount = state.options.agentEnv?.FF_RAM_MOUNT ?? DEFAULT_RAM_MOUNT;
      if (ramMount) {
        for (const h of state.hosts) rmSync(ramDirFor(ramMount, join(h.dataDir, 'vmm')), { recursive: true, force: true });
        // The mount point the agents made (empty unless another fleet or a mount uses it).
        for (const d of ramMount === DEFAULT_RAM_MOUNT ? [ramMount, dirname(ramMount)] : [ramMount]) {
          try {
            rmdirSync(d);
          } catch {
            /* in use, mounted or not ours */
          }
        }
      }
    }
  }
  for (const ns of [...state.namespaces].reverse()) sh('ip', ['netns', 'del', ns], { allowFail: true });
  if (state.guestCgroup) await removeGuestCgroup(state.guestCgroup);
  rmSync(dir, { recursive: true, force: true });
}

export async function status(dir: string): Promise<{ state: FleetState; procs: Array<ProcRecord & { alive: boolean }>; hosts: unknown[] }> {
  const state = readState(dir);
  if (!state) throw new Error(`no fleet in ${dir}: start one with npm run fleet:up`);
  const procs = state.procs.map((p) => ({ ...p, alive: pidAlive(p.pid) }));
  let hosts: unknown[] = [];
  try {
    const { HostState } = await import('../../proto/gen/forkfleet/v1/fleet_pb.ts');
    for (const addr of state.apiAddresses) {
      const api = await fleetApiClient(dir, addr);
      try {
        const res = await api.listHosts({}, { timeoutMs: 3000 });
        hosts = res.hosts.map((h) => ({
          id: h.id,
          state: HostState[h.state],
          cordoned: h.cordoned,
          sandboxes: h.sandboxCount,
          snapshots: h.snapshotCount,
          memoryMib: `${h.allocated?.memoryMib ?? 0n}/${h.capacity?.memoryMib ?? 0n}`,
          peer: h.peerAddress,
          accel: h.accel === 1 ? 'kvm' : 'tcg',
        }));
        break;
      } catch {
        /* try the other replica */
      } finally {
        api.close();
      }
    }
  } catch {
    /* API unreachable: report processes only */
  }
  return { state, procs, hosts };
}

function arg(argv: string[], name: string): string | undefined {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 ? argv[i + 1] : undefined;
}

async function cli(argv: string[]): Promise<void> {
  const [cmd] = argv;
  const dir = arg(argv, 'dir') ?? process.env.FF_FLEET_DIR ?? '/var/lib/ffleet';
  if (cmd === 'up') {
    const etcd = Number(arg(argv, 'etcd') ?? 1);
    if (etcd !== 1 && etcd !== 3) throw new Error('--etcd: 1 or 3');
    const opts = defaultOptions({
      hosts: Number(arg(argv, 'hosts') ?? 3),
      etcd,
      link: arg(argv, 'link') ?? '10gbit',
      dir,
      ...(arg(argv, 'prefix') ? { prefix: arg(argv, 'prefix')! } : {}),
      ...(arg(argv, 'base-port') ? { basePort: Number(arg(argv, 'base-port')) } : {}),
      peerTls: parseOnOff('--peer-tls', arg(argv, 'peer-tls'), true),
    });
    const s = await up(opts);
    const api = s.apiAddresses[0]!;
    process.stdout.write(
      [
        `Forkfleet is up: ${s.hosts.length} hosts (${s.hosts.map((h) => `${h.id}=${h.address}`).join(', ')}), links ${opts.link}, etcd x${opts.etcd}, 2 schedulers; between agents ${opts.peerTls ? 'mutual TLS' : 'plain text (--peer-tls off)'}.`,
        `  API (gRPC over TLS):   ${s.apiAddresses.join(' and ')}   CA ${apiCredentialPaths(dir).caCert}`,
        `  credentials:           ${apiCredentialPaths(dir).credentials} (admin; the CLI and SDK find it), ${apiCredentialPaths(dir).devCredentials} (tenant dev: FF_CREDENTIALS=...)`,
        `  metrics:               ${s.metricsAddresses.map((m) => `http://${m}/metrics`).join(' ')}`,
        `  dashboard:             http://${s.metricsAddresses[0]}/dashboard/#token=<the admin token in credentials.json> (admin only)`,
        `  CLI:                   npm run forkfleet -- sandbox create --image tiny   (see services/cli/README.md)`,
        `  logs:                  ${join(dir, 'logs')}`,
        '',
        'Try it:',
        `  TOKEN=$(node -p 'require("${apiCredentialPaths(dir).credentials}").token')`,
        `  npx buf curl --protocol grpc --cacert ${apiCredentialPaths(dir).caCert} -H "authorization: Bearer $TOKEN" https://${api}/forkfleet.v1.FleetService/ListHosts`,
        `  npx buf curl --protocol grpc --cacert ${apiCredentialPaths(dir).caCert} -H "authorization: Bearer $TOKEN" -d '{"tenantId":"demo","idempotencyKey":"first","image":"tiny"}' https://${api}/forkfleet.v1.FleetService/CreateSandbox`,
        '  npm run fleet:status      npm run test:e2e      npm run fleet:down',
        '',
      ].join('\n'),
    );
  } else if (cmd === 'down') {
    await down(dir);
    process.stdout.write('fleet is down: processes stopped by PID, namespaces and links removed\n');
  } else if (cmd === 'status') {
    const st = await status(dir);
    if (argv.includes('--json')) {
      process.stdout.write(`${JSON.stringify({ procs: st.procs, hosts: st.hosts, api: st.state.apiAddresses }, null, 2)}\n`);
      return;
    }
    process.stdout.write(`fleet in ${dir}, up since ${st.state.startedAt}; API ${st.state.apiAddresses.join(', ')}\n\nprocesses:\n`);
    for (const p of st.procs) process.stdout.write(`  ${p.alive ? 'up  ' : 'DOWN'} ${p.name.padEnd(14)} pid ${String(p.pid).padEnd(8)} ${p.netns ? `netns ${p.netns}` : ''}\n`);
    process.stdout.write('\nhosts (from the scheduler):\n');
    if (st.hosts.length === 0) process.stdout.write('  (API not answering)\n');
    for (const h of st.hosts) process.stdout.write(`  ${JSON.stringify(h)}\n`);
  } else if (cmd === 'restart' && argv[1] && !argv[1].startsWith('--')) {
    const rec = await restartProcess(dir, argv[1]);
    process.stdout.write(`${rec.name} restarted: pid ${rec.pid}\n`);
  } else {
    process.stderr.write('usage: fleet.ts up [--hosts N] [--etcd 1|3] [--link RATE] | status [--json] | restart NAME | down   (--dir DIR)\n');
    process.exit(2);
  }
}

if (process.argv[1] && resolve(process.argv[1]) === resolve(import.meta.filename)) {
  cli(process.argv.slice(2)).then(
    () => process.exit(0),
    (e: unknown) => {
      process.stderr.write(`fleet: ${e instanceof Error ? e.message : String(e)}\n`);
      process.exit(1);
    },
  );
}
