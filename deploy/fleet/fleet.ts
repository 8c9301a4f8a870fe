// The local multi-host fleet: real etcd, NATS with JetStream, two scheduler replicas and N
// host agents, each agent in its own network namespace with its own address, data
// directory (other agents' directories are hidden by a private mount namespace) and a
// tbf-shaped link to a shared bridge.
//
//   node --import tsx deploy/fleet/fleet.ts up [--hosts 3] [--etcd 1|3] [--link 10gbit] ...
//   node --import tsx deploy/fleet/fleet.ts status [--json]
//   node --import tsx deploy/fleet/fleet.ts restart NAME
//   node --import tsx deploy/fleet/fleet.ts down
// (every flag: USAGE below, or --help)
// An up that fails, or that Ctrl-C, SIGTERM or SIGHUP stops, removes what it started once its
// steps in flight have settled, keeping logs/ (bringup.ts); stopped, it exits 130, 143 or 129.
//
// Layout (--dir or FF_FLEET_DIR, default /var/lib/ffleet; a new or empty directory, or one
// holding a fleet: `down` removes exactly the entries below, and the directory if up made it):
//   .ffleet.json          marks the directory as the fleet's (kept, with logs/, by a failed up)
//   state.json            every process (by PID and start time), namespace and address this fleet made
//   logs/<process>.log
//   keys/signing.pem(.pub) the schedulers' Ed25519 key; agents trust a copy of the .pub
//                         (hosts/<id>/trusted.pem)
//   pki/, keys/tokens.json, credentials.json (admin), dev-credentials.json (tenant dev):
//                         the API's TLS and tokens (deploy/fleet/api-credentials.ts)
//   etcd/<member>/, nats/  control-plane data
//   nats-keys/            NATS config and the schedulers' NKey seed (hidden from agents)
//   hosts/<id>/nats.nk    that host's NATS NKey seed: it may use only its own subjects
//   hosts/<hostId>/       one agent's data (VMs, snapshots, chunks, journal)
//   nats.sock             the NATS relay socket agents reach from their namespaces
//   .own-<hostId>/        where an agent's mount namespace moves its own directory from
// An agent sees only its own hosts/<id>/ of these, besides the marker, state.json and nats.sock
// (agentMountCommands).
//
// Network: namespace <prefix>-net holds bridge br0 (no address); namespace <prefix>-<host>
// holds eth0 = 10.213.77.<10+i>/24. The control plane listens on the root namespace's
// loopback; agents reach NATS through a unix-socket relay, so no address exists outside
// the fleet's own namespaces. Peer chunk transfers cross the shaped veth links.
import { spawn, execFileSync } from 'node:child_process';
import { closeSync, copyFileSync, existsSync, linkSync, mkdirSync, openSync, readFileSync, readdirSync, renameSync, rmdirSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { createConnection } from 'node:net';
import { basename, dirname, join, resolve } from 'node:path';
import { totalmem } from 'node:os';
import { parseArgs } from 'node:util';
import { createPublicKey, generateKeyPairSync, randomBytes } from 'node:crypto';
import { createNkeyFile, hostPermissions, natsServerAuthConfig } from '../../services/adapters/nats/auth.ts';
import type { NatsUser } from '../../services/adapters/nats/auth.ts';
import { DEFAULT_RAM_MOUNT, ramDirFor } from '../../host-agent/adapters/qemu/ram-pool.ts';
import { forwardMarkerOf, HOST_LINK_PREFIX, linkCursorOf } from '../../host-agent/adapters/netns/egress.ts';
import { cpuHierarchy, GuestCgroup } from '../../host-agent/adapters/qemu/cgroup.ts';
import { apiCredentialPaths, fleetApiClient, fleetDashboardTenants, makeApiCredentials, schedulerApiEnv } from './api-credentials.ts';
import { ensurePeerCert } from '../pki/pki.ts';
import { bootId, cmdlineOf, identityOf, isQemuIn, isSameProcess, runsLaunchedCommand } from './proc-identity.ts';
import { InvalidArgumentError } from '../../proto/errors.ts';
import { allSteps, guardedStart, throwIfStopped } from './bringup.ts';
import type { SignalSource, StartEnd } from './bringup.ts';
import { enterUserCwd } from '../user-cwd.ts';
import { noteForReaper } from '../../host-agent/adapters/tied.ts';
import { FleetInterruptedError, FleetPartlyDownError, NoFleetError } from './errors.ts';

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
  /**
   * hostMemoryMib was not given: 70% of the machine's memory over the hosts, worked out at each
   * up. Memory a balloon or hotplug changes in between then does not make the same command, run
   * again, find "a fleet with other options" (foundFleet).
   */
  hostMemoryFromRam?: true;
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
  /**
   * Start time (field 22 of /proc/<pid>/stat) and boot id when the fleet started it: the PID
   * is this process only while they match (proc-identity.ts). Absent in a state.json of an
   * older fleet.ts; then the command line decides.
   */
  startTime?: number;
  bootId?: string;
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
  /** The cgroup the agents put their guests in (ADR 0018); empty: none. */
  guestCgroup?: string;
  /**
   * Whether guestCgroup is this fleet's own, which down() removes, killing what is left in it:
   * the fleet's per-prefix group, or one named by FF_GUEST_CGROUP that up made. One that existed
   * (a deployed agent's forkfleet-guests, another fleet's) is left, and so are its members; the
   * fleet's own QEMUs are stopped by their pid files either way. Absent (an older fleet.ts):
   * only the per-prefix group counts as its own.
   */
  guestCgroupOwned?: boolean;
  /**
   * Every host reported ready: up finished. An up killed midway (Ctrl-C, a dropped session)
   * leaves its processes running without it, and the next up starts afresh instead of taking
   * them for a fleet that is up.
   */
  complete?: boolean;
  /**
   * The boot the fleet was started in (/proc/sys/kernel/random/boot_id). After a reboot its
   * namespaces, cgroup and RAM mounts are gone, and the names may be another fleet's by now
   * (one started since with the same prefix): a teardown then leaves them alone. Absent (an
   * older fleet.ts): the boot of its processes.
   */
  bootId?: string;
}

const DEFAULT_FLEET_DIR = '/var/lib/ffleet';

/**
 * The fleet directory, absolute: processes started with another working directory
 * (nats-server runs in its store) are given paths in it. An empty FF_FLEET_DIR is unset.
 */
export function fleetDir(dir?: string): string {
  return resolve(dir || process.env.FF_FLEET_DIR || DEFAULT_FLEET_DIR);
}

export function defaultOptions(over: Partial<FleetOptions> = {}): FleetOptions {
  const hosts = over.hosts ?? 3;
  return {
    hosts,
    etcd: over.etcd ?? 1,
    link: over.link ?? '10gbit',
    dir: fleetDir(over.dir),
    prefix: over.prefix ?? 'ffl',
    basePort: over.basePort ?? 17700,
    hostMemoryMib: over.hostMemoryMib ?? Math.floor((totalmem() / 1048576) * 0.7 / hosts),
    ...(over.hostMemoryMib === undefined ? { hostMemoryFromRam: true as const } : {}),
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

/**
 * Whether some process has this PID: not whether it is the fleet's (procAlive, and the QEMU
 * scans below, check that). For a PID just taken from a check of identity.
 */
export function pidAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
}

/**
 * Whether the fleet's process `rec` still runs: its PID names the process the fleet started,
 * not a later one the kernel gave the same PID (after a reboot or a kill -9 of everything).
 */
export function procAlive(rec: Pick<ProcRecord, 'pid' | 'startTime' | 'bootId' | 'command' | 'args'>): boolean {
  if (rec.startTime !== undefined) return isSameProcess(rec.pid, { startTime: rec.startTime, bootId: rec.bootId ?? '' });
  return runsLaunchedCommand(rec.pid, rec.command, rec.args);
}

/** Says so when a recorded PID now names some other process, which is left alone. */
function reportReused(what: string, pid: number): void {
  if (!pidAlive(pid)) return;
  const cmd = (cmdlineOf(pid) ?? []).join(' ').slice(0, 120);
  process.stderr.write(`fleet: pid ${pid} (${what}) now belongs to another process${cmd ? ` (${cmd})` : ''}: not signalled\n`);
}

function signal(pid: number, sig: NodeJS.Signals): boolean {
  try {
    process.kill(pid, sig);
    return true;
  } catch {
    return false; // gone
  }
}

/**
 * SIGTERM, then SIGKILL after graceMs, to `pid` while `ours()` says it is still the process
 * meant: checked again before each signal, so a PID freed and reused meanwhile is spared.
 */
async function stopProcess(what: string, pid: number, ours: () => boolean, graceMs: number): Promise<void> {
  if (!ours()) return reportReused(what, pid);
  if (!signal(pid, 'SIGTERM')) return;
  const until = Date.now() + graceMs;
  while (Date.now() < until && ours()) await new Promise((r) => setTimeout(r, 50));
  if (!ours()) return;
  signal(pid, 'SIGKILL');
  // Bounded: a process stuck in the kernel (D state) may outlive SIGKILL for a while.
  const killedBy = Date.now() + 10_000;
  while (ours()) {
    if (Date.now() > killedBy) {
      process.stderr.write(`fleet: pid ${pid} (${what}) still there 10 s after SIGKILL\n`);
      return;
    }
    await new Promise((r) => setTimeout(r, 20));
  }
}

/** Stops one of the fleet's recorded processes, if its PID is still that process. */
/**
 * How long an agent has to stop after SIGTERM before it is killed: longer than its own
 * FF_SHUTDOWN_GRACE (20 s), within which it lets its running steps end; killed sooner, a QEMU
 * it was starting (before its pid file) could escape down's sweep.
 */
const AGENT_STOP_GRACE_MS = 25_000;
/** The same for the other processes. */
const STOP_GRACE_MS = 8000;
const stopGraceOf = (kind: ProcRecord['kind']): number => (kind === 'agent' ? AGENT_STOP_GRACE_MS : STOP_GRACE_MS);

function stopRecorded(rec: ProcRecord, graceMs: number): Promise<void> {
  return stopProcess(rec.name, rec.pid, () => procAlive(rec), graceMs);
}

function statePath(dir: string): string {
  return join(dir, 'state.json');
}

function readJson(path: string): unknown {
  try {
    return JSON.parse(readFileSync(path, 'utf8'));
  } catch {
    return undefined; // missing, or not JSON: not ours either way
  }
}

function isFleetState(x: unknown): x is FleetState {
  const s = x as Partial<FleetState> | null | undefined;
  return !!s && typeof s === 'object' && s.version === 1 && typeof s.options === 'object' && Array.isArray(s.procs) && Array.isArray(s.hosts) && Array.isArray(s.namespaces);
}

/** The state of the fleet in `dir`; undefined if there is none (a state.json that is not a fleet's included). */
export function readState(dir: string): FleetState | undefined {
  const s = readJson(statePath(fleetDir(dir)));
  return isFleetState(s) ? s : undefined;
}

/**
 * Marks a directory as a fleet's from the first thing `up` does to it until `down` is done:
 * a failed `up` leaves it beside the logs it keeps, so the next `up` or `down` knows them for
 * the fleet's. createdDir: `up` made the directory itself, so `down` removes it too.
 */
const MARKER = '.ffleet.json';
interface DirMarker {
  fleet: 'forkfleet';
  createdDir: boolean;
}

function readMarker(dir: string): DirMarker | undefined {
  const m = readJson(join(dir, MARKER)) as Partial<DirMarker> | undefined;
  return m && typeof m === 'object' && m.fleet === 'forkfleet' ? { fleet: 'forkfleet', createdDir: m.createdDir !== false } : undefined;
}

/**
 * What the fleet puts at the top of its directory (the layout above), and so all that `down`
 * removes: never anything else that is there.
 */
export const FLEET_ENTRIES: ReadonlySet<string> = new Set([MARKER, 'state.json', 'state.json.tmp', 'logs', 'keys', 'pki', 'credentials.json', 'dev-credentials.json', 'etcd', 'nats', 'nats-keys', 'nats.sock', 'hosts']);
const isFleetEntry = (name: string): boolean => FLEET_ENTRIES.has(name) || /^\.own-h\d+$/.test(name);

/**
 * Whose `dir` is: absent or empty (free for a new fleet), ours (a fleet's state, or what a
 * failed `up` left) or foreign (anything else: `up` refuses it, since `down` would remove
 * whatever of its entries have the names the fleet uses).
 */
export function fleetDirOwnership(dir: string): 'absent' | 'empty' | 'ours' | 'foreign' {
  let entries: string[];
  try {
    entries = readdirSync(dir);
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === 'ENOENT') return 'absent';
    throw new Error(`--dir ${dir}: ${(e as Error).message}`, { cause: e });
  }
  if (entries.length === 0) return 'empty';
  return readMarker(dir) || readState(dir) ? 'ours' : 'foreign';
}

/** fleetDirOwnership for `up`: a foreign directory is refused, naming --dir. */
export function claimableDir(dir: string): 'absent' | 'empty' | 'ours' {
  const owner = fleetDirOwnership(dir);
  if (owner === 'foreign') {
    throw new Error(`--dir ${dir}: exists, is not empty and holds no fleet (no state.json or ${MARKER} of fleet.ts); fleet:down removes what a fleet puts in its directory, so name a new or empty one`);
  }
  return owner;
}

/**
 * Removes the fleet's own entries from `dir` (all but logs/ and the marker when keepLogs),
 * then the directory if `up` made it and nothing else is in it.
 */
export function removeFleetEntries(dir: string, opts: { keepLogs?: boolean } = {}): void {
  const marker = readMarker(dir);
  let entries: string[];
  try {
    entries = readdirSync(dir);
  } catch {
    return; // gone already
  }
  // The marker last: until then an interrupted teardown leaves a directory the next one knows.
  for (const name of entries.filter((n) => isFleetEntry(n) && n !== MARKER)) {
    if (opts.keepLogs && name === 'logs') continue;
    rmSync(join(dir, name), { recursive: true, force: true });
  }
  if (opts.keepLogs) return;
  rmSync(join(dir, MARKER), { force: true });
  // A state.json of an older fleet.ts has no marker; that version removed the whole directory.
  if (marker?.createdDir ?? true) {
    try {
      rmdirSync(dir);
    } catch {
      /* not empty: someone else's files are in it too */
    }
  }
}

function saveState(s: FleetState): void {
  const p = statePath(s.options.dir);
  writeFileSync(`${p}.tmp`, JSON.stringify(s, null, 2));
  // In this process: a `mv` child shares the terminal's process group, and a Ctrl-C then
  // killed it between a spawn and its record.
  renameSync(`${p}.tmp`, p);
}

/**
 * Saves the state that now records `proc`, a process just started; if that fails, the process
 * (its whole group: it was started detached, as a group leader) is killed before the error
 * goes on. A process state.json does not name is one no teardown would stop.
 */
function saveStarted(s: FleetState, proc: { pid: number }): void {
  try {
    saveState(s);
  } catch (e) {
    try {
      process.kill(-proc.pid, 'SIGKILL');
    } catch {
      /* gone already */
    }
    throw e;
  }
}

/** Bytes per second of a tc rate such as "10gbit" or "500mbit". */
export function linkBytesPerSecond(rate: string): number {
  const m = /^(\d+(?:\.\d+)?)(k|m|g)?bit$/i.exec(rate);
  if (!m) throw new InvalidArgumentError('--link', `want a rate like 10gbit, 1gbit or 500mbit, got ${JSON.stringify(rate)}`);
  const mult = { k: 1e3, m: 1e6, g: 1e9 }[(m[2] ?? '').toLowerCase() as 'k' | 'm' | 'g'] ?? 1;
  return (Number(m[1]) * mult) / 8;
}

function tbfArgs(rate: string): string[] {
  const bps = linkBytesPerSecond(rate);
  // The bucket must hold at least one timer tick of traffic at this rate.
  const burst = Math.max(256 * 1024, Math.ceil(bps / 100));
  return ['root', 'tbf', 'rate', rate, 'burst', String(burst), 'latency', '5ms'];
}

/** Whether something accepts a TCP connection on host:port now. */
function listens(host: string, port: number): Promise<boolean> {
  return new Promise((resolvePromise) => {
    const s = createConnection(port, host);
    s.once('connect', () => (s.destroy(), resolvePromise(true)));
    s.once('error', () => (s.destroy(), resolvePromise(false)));
  });
}

async function waitPort(host: string, port: number, timeoutMs: number, abort?: AbortSignal): Promise<void> {
  const until = Date.now() + timeoutMs;
  while (!(await listens(host, port))) {
    throwIfStopped(abort);
    if (Date.now() > until) throw new Error(`nothing listens on ${host}:${port} after ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 50));
  }
}

/**
 * Refuses a port something already listens on (another fleet with the same --base-port, a
 * machine's own etcd): the fleet's process would exit on EADDRINUSE while waitPort found the
 * other one listening, and the fleet would run against that.
 */
async function assertPortsFree(what: string, ports: readonly number[]): Promise<void> {
  for (const port of ports) {
    if (await listens('127.0.0.1', port)) throw new Error(`${what}: port ${port} on 127.0.0.1 is already in use (another fleet? choose --base-port)`);
  }
}

/**
 * Every port the fleet's control plane listens on (the layout startEtcd, startNats and
 * startSchedulers use), with what listens there.
 */
export function fleetPorts(opts: Pick<FleetOptions, 'basePort' | 'etcd'>): Array<{ port: number; what: string }> {
  const b = opts.basePort;
  const etcd = Array.from({ length: opts.etcd }, (_, i) => [
    { port: b + 20 + i, what: `etcd-${i + 1} clients` },
    { port: b + 30 + i, what: `etcd-${i + 1} peers` },
  ]).flat();
  return [
    { port: b, what: 'scheduler-1 API' },
    { port: b + 1, what: 'scheduler-2 API' },
    { port: b + 10, what: 'scheduler-1 metrics' },
    { port: b + 11, what: 'scheduler-2 metrics' },
    ...etcd,
    { port: b + 40, what: 'NATS clients' },
    { port: b + 41, what: 'NATS monitoring' },
  ];
}

/**
 * Refuses, before up makes anything, a fleet whose ports are taken: every busy one is named
 * (found later, its step would fail with etcd and NATS already started).
 */
export async function checkFleetPortsFree(opts: Pick<FleetOptions, 'basePort' | 'etcd'>): Promise<void> {
  const busy: string[] = [];
  for (const p of fleetPorts(opts)) if (await listens('127.0.0.1', p.port)) busy.push(`${p.port} (${p.what})`);
  if (busy.length > 0) throw new Error(`ports already in use on 127.0.0.1: ${busy.join(', ')}; the fleet listens on ${opts.basePort}..${opts.basePort + 41} (another fleet? choose --base-port)`);
}

/** waitPort for a process the fleet launched, which must still be the one listening (it did not exit). */
async function waitListening(rec: ProcRecord, port: number, timeoutMs: number, abort: AbortSignal): Promise<void> {
  await waitPort('127.0.0.1', port, timeoutMs, abort);
  if (!procAlive(rec)) throw new Error(`${rec.name} exited (see ${rec.log})`);
}

async function waitLog(path: string, needle: string, timeoutMs: number, rec: ProcRecord, abort: AbortSignal): Promise<void> {
  const until = Date.now() + timeoutMs;
  while (Date.now() < until) {
    throwIfStopped(abort);
    if (existsSync(path) && readFileSync(path, 'utf8').includes(needle)) return;
    if (!procAlive(rec)) throw new Error(`process ${rec.pid} (${rec.name}) exited; see ${path}:\n${existsSync(path) ? readFileSync(path, 'utf8').slice(-1500) : ''}`);
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`timed out waiting for "${needle}" in ${path}`);
}

/**
 * Starts a process detached, and reads its start time at once: it is our child (not reaped
 * yet even if it has exited already), so its PID cannot have been reused.
 */
function spawnDetached(log: string, command: string, args: string[], env: Record<string, string>, cwd = ROOT): { pid: number; startTime: number; bootId: string } {
  const fd = openSync(log, 'a');
  let child: ReturnType<typeof spawn>;
  try {
    child = spawn(command, args, { detached: true, stdio: ['ignore', fd, fd], env: { ...process.env, ...env }, cwd });
  } finally {
    closeSync(fd);
  }
  // A spawn that fails (ENOENT, EAGAIN) emits 'error' on the next tick: unheard, that ended
  // fleet.ts before its cleanup stopped what it had started.
  child.on('error', () => undefined);
  child.unref();
  if (child.pid === undefined) throw new Error(`could not start ${command} (not installed? run deploy/setup.sh)`);
  const id = identityOf(child.pid);
  noteForReaper({ pid: child.pid, startTime: id.startTime });
  return { pid: child.pid, ...id };
}

/**
 * Starts one of the fleet's processes and records it in state.json before anything else can
 * run. Refused once the start is being stopped: the teardown may have read state.json already.
 */
export function launch(state: FleetState, abort: AbortSignal, rec: Omit<ProcRecord, 'pid' | 'log' | 'command' | 'args' | 'env'>, command: string, args: string[], env: Record<string, string> = {}): ProcRecord {
  throwIfStopped(abort);
  const log = join(state.options.dir, 'logs', `${rec.name}.log`);
  const full: ProcRecord = { ...rec, ...spawnDetached(log, command, args, env, rec.cwd), log, command, args, env };
  state.procs.push(full);
  try {
    saveStarted(state, full);
  } catch (e) {
    state.procs.pop();
    throw e;
  }
  return full;
}

/**
 * Stops one of the fleet's processes (if it runs) and starts it again the way it was
 * started, waiting until it is ready. For fault tests and operators.
 */
export async function restartProcess(dir: string, name: string): Promise<ProcRecord> {
  return withDirLock(fleetDir(dir), () => restartLocked(dir, name));
}

async function restartLocked(dir: string, name: string): Promise<ProcRecord> {
  const state = readState(fleetDir(dir));
  const rec = state?.procs.find((p) => p.name === name);
  if (!state || !rec) throw new Error(`no process ${name} in the fleet at ${fleetDir(dir)}`);
  await stopRecorded(rec, stopGraceOf(rec.kind));
  Object.assign(rec, spawnDetached(rec.log, rec.command, rec.args, rec.env, rec.cwd));
  saveStarted(state, rec);
  if (rec.kind === 'agent' || rec.kind === 'scheduler') {
    const lines = readFileSync(rec.log, 'utf8').split('\n').length;
    const until = Date.now() + 120_000;
    for (;;) {
      const fresh = readFileSync(rec.log, 'utf8').split('\n').slice(lines - 1);
      if (fresh.some((l) => l.includes('"ready":true'))) break;
      if (!procAlive(rec)) throw new Error(`${name} exited on restart; see ${rec.log}`);
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

/**
 * Makes a network namespace, recorded first: a kill in between leaves a record down() acts on
 * (deleting one never made is a no-op there), not a namespace no one knows of. One that could
 * not be made (it exists: another fleet's, with the same prefix) comes out of the record
 * again, so this fleet's cleanup does not delete it.
 */
function addNamespace(state: FleetState, name: string): void {
  state.namespaces.push(name);
  saveState(state);
  try {
    sh('ip', ['netns', 'add', name]);
    noteForReaper({ netns: name });
  } catch (e) {
    state.namespaces = state.namespaces.filter((n) => n !== name);
    saveState(state);
    throw e;
  }
}

/**
 * Makes a host's data directory (if it is not there) owner-only, as its agent wants it: made
 * with the umask's 0755, every agent's start would make it 0700 itself and log a WARN
 * ("readable by other users", host-agent's ensurePrivateDataDir). It holds the host's NATS
 * seed and peer key, and its guests' memory and disks.
 */
export function makeHostDataDir(dataDir: string): void {
  mkdirSync(dataDir, { recursive: true, mode: 0o700 });
}

function makeNetwork(state: FleetState): void {
  const { prefix, hosts, link } = state.options;
  const net = `${prefix}-net`;
  state.netnsBridge = net;
  addNamespace(state, net);
  sh('ip', ['-n', net, 'link', 'add', 'br0', 'type', 'bridge']);
  sh('ip', ['-n', net, 'link', 'set', 'br0', 'up']);
  sh('ip', ['-n', net, 'link', 'set', 'lo', 'up']);
  for (let i = 1; i <= hosts; i++) {
    const id = `h${i}`;
    const ns = `${prefix}-${id}`;
    const { ifHost, ifBridge } = linkNames(prefix, id);
    addNamespace(state, ns);
    // Made in its namespaces at once: no end is ever left in the root namespace, where down()
    // (which deletes the namespaces) would not find it.
    sh('ip', ['link', 'add', ifHost, 'netns', ns, 'type', 'veth', 'peer', 'name', ifBridge, 'netns', net]);
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
    makeHostDataDir(dataDir);
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

async function startEtcd(state: FleetState, abort: AbortSignal): Promise<void> {
  const { etcd, basePort } = state.options;
  const members = Array.from({ length: etcd }, (_, i) => ({ name: `etcd-${i + 1}`, client: basePort + 20 + i, peer: basePort + 30 + i }));
  const initial = members.map((m) => `${m.name}=http://127.0.0.1:${m.peer}`).join(',');
  await assertPortsFree('etcd', members.flatMap((m) => [m.client, m.peer]));
  const recs: ProcRecord[] = [];
  for (const m of members) {
    const data = join(state.options.dir, 'etcd', m.name);
    mkdirSync(data, { recursive: true });
    recs.push(launch(state, abort, { name: m.name, kind: 'etcd' }, 'etcd', [
      '--name', m.name, '--data-dir', data,
      '--listen-client-urls', `http://127.0.0.1:${m.client}`, '--advertise-client-urls', `http://127.0.0.1:${m.client}`,
      '--listen-peer-urls', `http://127.0.0.1:${m.peer}`, '--initial-advertise-peer-urls', `http://127.0.0.1:${m.peer}`,
      '--initial-cluster', initial, '--initial-cluster-state', 'new',
      '--heartbeat-interval', '10', '--election-timeout', '100', '--max-txn-ops', '1024', '--log-level', 'warn',
    ]));
  }
  state.etcdEndpoints = members.map((m) => `http://127.0.0.1:${m.client}`);
  for (const [i, m] of members.entries()) await waitListening(recs[i]!, m.client, 15_000, abort);
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
    makeHostDataDir(h.dataDir);
    users.push({ nkey: createNkeyFile(hostNatsSeed(h)).publicKey, permissions: hostPermissions(h.id) });
  }
  const conf = natsServerAuthConfig(users);
  const path = join(dir, 'nats.conf');
  writeFileSync(path, conf, { mode: 0o600 });
  return path;
}

async function startNats(state: FleetState, abort: AbortSignal): Promise<void> {
  const port = state.options.basePort + 40;
  const monitor = port + 1;
  const store = join(state.options.dir, 'nats');
  mkdirSync(store, { recursive: true });
  const conf = makeNatsAuth(state);
  await assertPortsFree('nats-server', [port, monitor]);
  // Its store as working directory: nats-server writes a lost consumer's meta.inf relative to it.
  const nats = launch(state, abort, { name: 'nats', kind: 'nats', cwd: store }, 'nats-server', ['-c', conf, '-js', '-a', '127.0.0.1', '-p', String(port), '-m', String(monitor), '-sd', store]);
  state.natsUrl = `nats://127.0.0.1:${port}`;
  state.natsMonitor = `http://127.0.0.1:${monitor}`;
  await waitListening(nats, port, 10_000, abort);
  const sock = join(state.options.dir, 'nats.sock');
  const r = launch(state, abort, { name: 'relay-nats', kind: 'relay' }, NODE, tsx('deploy/fleet/relay.ts', `unix:${sock}=tcp:127.0.0.1:${port}`));
  await waitLog(r.log, 'relay ready', 15_000, r, abort);
}

async function startSchedulers(state: FleetState, abort: AbortSignal): Promise<void> {
  for (let i = 0; i < 2; i++) {
    const api = `127.0.0.1:${state.options.basePort + i}`;
    const metrics = `127.0.0.1:${state.options.basePort + 10 + i}`;
    const p = launch(state, abort, { name: `scheduler-${i + 1}`, kind: 'scheduler' }, NODE, tsx('services/main.ts'), {
      FF_SCHEDULER_ID: `scheduler-${i + 1}`,
      FF_GRPC_ADDR: api,
      FF_METRICS_ADDR: metrics,
      FF_ETCD_ENDPOINTS: state.etcdEndpoints.join(','),
      FF_NATS_URL: state.natsUrl,
      FF_NATS_NKEY_FILE: join(natsKeysDir(state), 'scheduler.nk'),
      FF_SIGNING_KEY: state.signingKey,
      FF_DASHBOARD_METRICS: [0, 1].map((j) => `http://127.0.0.1:${state.options.basePort + 10 + j}/metrics`).join(','),
      FF_DASHBOARD_TENANTS: fleetDashboardTenants(),
      ...schedulerApiEnv(state.options.dir),
      ...state.options.schedulerEnv,
    });
    await waitLog(p.log, '"ready":true', 60_000, p, abort);
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
/** `s` as one word of a POSIX shell command line, whatever it holds ($, `, ", \\, spaces). */
export function shQuote(s: string): string {
  return `'${s.replace(/'/g, `'\\''`)}'`;
}

export function cgroupMountCommands(mounts = readFileSync('/proc/self/mounts', 'utf8')): string[] {
  const rows = mounts.split('\n').map((l) => l.split(' '));
  if (rows.some((m) => m[1] === '/sys/fs/cgroup' && m[2] === 'cgroup2')) return ['mount -t cgroup2 cgroup2 /sys/fs/cgroup'];
  const cpu = rows.find((m) => m[2] === 'cgroup' && (m[3] ?? '').split(',').includes('cpu'));
  if (!cpu?.[1]) return [];
  const controllers = (cpu[3] ?? '').split(',').filter((o) => o === 'cpu' || o === 'cpuacct').join(',');
  return [
    'mount -t tmpfs -o size=64k,mode=0755 ff-cgroup /sys/fs/cgroup',
    `mkdir -p ${shQuote(cpu[1])}`,
    `mount -t cgroup -o ${controllers} cgroup ${shQuote(cpu[1])}`,
    // Co-mounted hierarchies are reached as /sys/fs/cgroup/cpu too (a symlink on Debian).
    ...(cpu[1] === '/sys/fs/cgroup/cpu' ? [] : [`ln -s ${shQuote(cpu[1])} /sys/fs/cgroup/cpu`]),
  ];
}

/** The guests' cgroup a fleet makes for itself when FF_GUEST_CGROUP does not name one. */
const ownGuestCgroup = (prefix: string): string => `forkfleet-${prefix}-guests`;

/**
 * The guests' cgroup of a fleet's agents: FF_GUEST_CGROUP when set (empty: off), else one per
 * fleet. It is made here, as the agents will (so they reuse it); where that fails, guests run
 * without CPU isolation and this says why on stderr. owned: the fleet's to remove at down, as
 * FleetState.guestCgroupOwned says (a group FF_GUEST_CGROUP names that existed already is not).
 * `record` is called with what it is about to make, before it makes it: up saves it in
 * state.json first, so a `down` after an up killed right then still removes the group.
 */
export async function guestCgroupFor(opts: Pick<FleetOptions, 'prefix' | 'agentEnv'>, record: (planned: { path: string; owned: boolean }) => void = () => undefined): Promise<{ path: string; owned: boolean }> {
  const named = opts.agentEnv?.FF_GUEST_CGROUP ?? process.env.FF_GUEST_CGROUP;
  const chosen = named ?? ownGuestCgroup(opts.prefix);
  if (!chosen) return { path: '', owned: false };
  const h = cgroupMountCommands().length === 0 ? undefined : await cpuHierarchy();
  const existed = h !== undefined && existsSync(join(h.base, chosen));
  const owned = named === undefined || !existed;
  if (h) record({ path: chosen, owned });
  const why = !h ? 'no cgroup hierarchy with the cpu controller' : await GuestCgroup.open({ path: chosen, cpuWeight: 100 }).then(() => '', (e: unknown) => (e as Error).message);
  if (why) {
    // Made, then failed (its weight not written): no fleet will remove it later.
    if (h && !existed) {
      try {
        rmdirSync(join(h.base, chosen));
      } catch {
        /* not made */
      }
    }
    process.stderr.write(`fleet: guests run without CPU isolation (ADR 0018): ${why}\n`);
  }
  return why ? { path: '', owned: false } : { path: chosen, owned };
}

/** Whether down() removes the fleet's guests cgroup (FleetState.guestCgroupOwned). */
export function ownsGuestCgroup(s: Pick<FleetState, 'guestCgroup' | 'guestCgroupOwned'> & { options: Pick<FleetOptions, 'prefix'> }): boolean {
  return !!s.guestCgroup && (s.guestCgroupOwned ?? s.guestCgroup === ownGuestCgroup(s.options.prefix));
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
  makeHostDataDir(h.dataDir);
  ensurePeerCert({ caCert: ca.caCert, caKey: join(ca.pki, 'ca.key') }, { cert: files.cert, key: files.key }, h.id, h.address);
  copyFileSync(ca.caCert, files.ca);
  return { FF_PEER_CA: files.ca, FF_PEER_CERT: files.cert, FF_PEER_KEY: files.key };
}

/**
 * What an agent's mount namespace hides of the fleet directory (startAgent): every entry of
 * FLEET_ENTRIES but these, which hold no secret: the directory's marker, state.json (PIDs,
 * paths and options; rewritten by rename, which a mount over it would not survive), and the
 * NATS relay's socket (a connection through it still needs the host's NKey).
 */
export const AGENT_VISIBLE_ENTRIES: ReadonlySet<string> = new Set([MARKER, 'state.json', 'state.json.tmp', 'nats.sock']);
/** Directories covered by an empty tmpfs (hosts/: the agent's own directory is bound back into it). */
export const AGENT_HIDDEN_DIRS: readonly string[] = ['hosts', 'keys', 'pki', 'etcd', 'nats', 'nats-keys', 'logs'];
/** Files covered by /dev/null: the admin's and tenant dev's API tokens. */
export const AGENT_HIDDEN_FILES: readonly string[] = ['credentials.json', 'dev-credentials.json'];

/**
 * Shell commands that, in an agent's fresh mount namespace, hide the fleet directory `dir`
 * from it but for its own data directory (moved back from `stash`, where it is bound first):
 * the schedulers' signing key (keys/signing.pem), the dev CA's and the API's keys (pki/), the
 * NATS config and seeds, etcd's and NATS's data, every process's logs, the API tokens and
 * other agents' directories. The agent reads only files in its own directory (agentEnv).
 * An entry not there yet is skipped. (The agent is root and could unmount them: this keeps
 * a bug or a compromised guest-facing path from reading what is not the agent's, as the
 * deployed agent has none of it on its machine; it is not a boundary against root.)
 */
export function agentMountCommands(dir: string, dataDir: string, stash: string): string[] {
  // Every path quoted as one word: a --dir (or checkout) with $, ` or " in its name.
  const q = (name: string): string => shQuote(join(dir, name));
  return [
    `mount --bind ${shQuote(dataDir)} ${shQuote(stash)}`,
    ...AGENT_HIDDEN_DIRS.map((d) => `[ ! -d ${q(d)} ] || mount -t tmpfs -o size=1m,mode=${d === 'hosts' ? '0755' : '0700'} ff-${d} ${q(d)}`),
    ...AGENT_HIDDEN_FILES.map((f) => `[ ! -e ${q(f)} ] || mount --bind /dev/null ${q(f)}`),
    `mkdir -p ${shQuote(dataDir)}`,
    `mount --move ${shQuote(stash)} ${shQuote(dataDir)}`,
  ];
}

/** The copy of the schedulers' public key an agent trusts (FF_TRUSTED_KEY): in its own directory, since keys/ is hidden from it. */
export const agentTrustedKey = (h: Pick<HostRecord, 'dataDir'>): string => join(h.dataDir, 'trusted.pem');

/**
 * An agent's environment. Every file it names is in the host's own data directory, the only
 * part of the fleet directory the agent sees (agentMountCommands), or outside the fleet
 * directory (the RAM mount).
 */
export function agentEnv(state: FleetState, h: HostRecord, peerTls: Record<string, string>): Record<string, string> {
  return {
    FF_HOST_ID: h.id,
    FF_DATA_DIR: h.dataDir,
    FF_NATS_URL: 'nats://127.0.0.1:4222',
    FF_NATS_NKEY_FILE: hostNatsSeed(h),
    // Sandboxes allowed egress never reach the fleet network (other agents' peer ports).
    FF_EGRESS_DENY_CIDRS: '10.213.77.0/24',
    FF_PEER_ADDR: `${h.address}:7800`,
    // Its /metrics in its namespace (a rendered deployment's port), reachable from the fleet's bridge.
    FF_METRICS_ADDR: `${h.address}:17711`,
    ...peerTls,
    FF_TRUSTED_KEY: agentTrustedKey(h),
    FF_ACCEL: process.env.FF_ACCEL ?? 'auto',
    FF_LINK_BYTES_PER_SECOND: String(Math.round(linkBytesPerSecond(state.options.link))),
    FF_CAPACITY_MEMORY_MIB: String(state.options.hostMemoryMib),
    FF_HEARTBEAT_INTERVAL: '500ms',
    FF_GUEST_CGROUP: state.guestCgroup ?? '',
    FF_RAM_MOUNT: fleetRamMount(state.options),
    // As the systemd unit sets it (and bench:transfer's endpoints run with it).
    UV_THREADPOOL_SIZE: process.env.UV_THREADPOOL_SIZE ?? '16',
    ...state.options.agentEnv,
  };
}

/**
 * The agent runs in its host's network namespace. `ip netns exec` also gives it a mount
 * namespace of its own; there the fleet directory is hidden from it but for its own
 * directory (agentMountCommands), so an agent cannot read or write another agent's files,
 * nor the control plane's keys and data.
 */
async function startAgent(state: FleetState, h: HostRecord, abort: AbortSignal): Promise<void> {
  const stash = join(state.options.dir, `.own-${h.id}`);
  mkdirSync(stash, { recursive: true });
  const peerTls = state.options.peerTls === false ? {} : makePeerCert(state, h);
  makeHostDataDir(h.dataDir);
  copyFileSync(state.trustedKey, agentTrustedKey(h));
  const sock = join(state.options.dir, 'nats.sock');
  const relay = launch(state, abort, { name: `relay-${h.id}`, kind: 'relay', host: h.id, netns: h.netns }, ...inNetns(h.netns, NODE, tsx('deploy/fleet/relay.ts', `tcp:127.0.0.1:4222=unix:${sock}`)));
  await waitLog(relay.log, 'relay ready', 15_000, relay, abort);
  const script = [
    'set -e',
    ...agentMountCommands(state.options.dir, h.dataDir, stash),
    ...(state.guestCgroup ? cgroupMountCommands() : []),
    `exec ${shQuote(NODE)} --import tsx ${shQuote(join(ROOT, 'host-agent', 'main.ts'))}`,
  ].join('; ');
  const p = launch(state, abort, { name: `agent-${h.id}`, kind: 'agent', host: h.id, netns: h.netns }, ...inNetns(h.netns, 'sh', ['-c', script]), agentEnv(state, h, peerTls));
  await waitLog(p.log, '"ready":true', 120_000, p, abort);
}

/** The fleet is up when the scheduler reports every host ready (registered from its heartbeats). */
async function waitHostsReady(state: FleetState, timeoutMs: number, abort: AbortSignal): Promise<void> {
  const { HostState } = await import('../../proto/gen/forkfleet/v1/fleet_pb.ts');
  const api = await fleetApiClient(state.options.dir, state.apiAddresses[0]!);
  const until = Date.now() + timeoutMs;
  /** The API's last refusal: a TLS or credential problem would otherwise look like hosts that never came. */
  let lastError: unknown;
  try {
    for (;;) {
      throwIfStopped(abort);
      const hosts = await api.listHosts({}, { timeoutMs: 3000 }).then(
        (r) => ((lastError = undefined), r.hosts),
        (e: unknown) => ((lastError = e), []),
      );
      if (hosts.length === state.hosts.length && hosts.every((h) => h.state === HostState.READY)) return;
      if (Date.now() > until) throw new Error(`only ${hosts.length} of ${state.hosts.length} hosts registered ready after ${timeoutMs} ms${lastError ? `; the API's last answer: ${lastError instanceof Error ? lastError.message : String(lastError)}` : ''}`);
      await new Promise((r) => setTimeout(r, 200));
    }
  } finally {
    api.close();
  }
}

/** The lowest and highest --base-port: the fleet listens on base-port .. base-port + 41. */
const BASE_PORT_RANGE = [1024, 65535 - 41] as const;

/**
 * Where this fleet's agents mount their RAM tmpfs (FF_RAM_MOUNT): one directory per fleet,
 * /run/forkfleet/<prefix>/ram, unless agentEnv names one. Each agent mounts it in its own
 * mount namespace (ip netns exec), on this one directory: removing it (down) detaches every
 * mount on it in every namespace, so fleets must never share it.
 */
function fleetRamMount(opts: FleetOptions): string {
  return opts.agentEnv?.FF_RAM_MOUNT ?? join(dirname(DEFAULT_RAM_MOUNT), opts.prefix, 'ram');
}

/** Interface names of host `id`'s veth pair: its end in the host namespace, and the bridge's. */
function linkNames(prefix: string, id: string): { ifHost: string; ifBridge: string } {
  return { ifHost: `${prefix}${id}a`, ifBridge: `${prefix}${id}b` };
}

/** Checks options before anything is made; each error names the flag. */
export function validateOptions(opts: FleetOptions): void {
  if (!/^[a-z]{1,6}$/.test(opts.prefix)) throw new InvalidArgumentError('--prefix', `1-6 lowercase letters, got ${JSON.stringify(opts.prefix)}`);
  // An agent's egress firewall (host-agent/adapters/netns/egress.ts) drops all input from
  // links named ffe*, its sandboxes' veths; the fleet's own link in that namespace must not
  // match, or the agent is cut off from its peers.
  const clash = Array.from({ length: Math.max(1, opts.hosts) }, (_, i) => linkNames(opts.prefix, `h${i + 1}`).ifHost).find((n) => n.startsWith(HOST_LINK_PREFIX));
  if (clash) throw new InvalidArgumentError('--prefix', `${JSON.stringify(opts.prefix)} names the hosts' links ${clash}..., and the agents' egress firewall drops every link named ${HOST_LINK_PREFIX}* (host-agent/adapters/netns/egress.ts): choose a prefix that does not start with ${HOST_LINK_PREFIX}`);
  if (!(Number.isInteger(opts.hosts) && opts.hosts >= 1 && opts.hosts <= 32)) throw new InvalidArgumentError('--hosts', `an integer 1..32, got ${opts.hosts}`);
  if (opts.etcd !== 1 && opts.etcd !== 3) throw new InvalidArgumentError('--etcd', `1 or 3, got ${String(opts.etcd)}`);
  if (!(Number.isInteger(opts.basePort) && opts.basePort >= BASE_PORT_RANGE[0] && opts.basePort <= BASE_PORT_RANGE[1])) throw new InvalidArgumentError('--base-port', `an integer ${BASE_PORT_RANGE[0]}..${BASE_PORT_RANGE[1]} (the fleet listens on base-port .. base-port + 41), got ${opts.basePort}`);
  if (!(Number.isInteger(opts.hostMemoryMib) && opts.hostMemoryMib >= 1)) throw new InvalidArgumentError('hostMemoryMib', `a positive integer, got ${opts.hostMemoryMib}`);
  linkBytesPerSecond(opts.link);
}

/**
 * What up makes of the fleet recorded in its directory: `up` as asked (every process alive,
 * the up finished, the same options), up with `other-options`, `partly-down` (the up finished,
 * some processes run and some do not: an agent that crashed or was killed), or to be taken
 * down and started afresh (`restart`: an up that never finished, or no process left, as after
 * a reboot).
 */
export function foundFleet(existing: FleetState, opts: FleetOptions): 'up' | 'other-options' | 'partly-down' | 'restart' {
  if (existing.complete !== true || existing.procs.length === 0) return 'restart';
  const alive = existing.procs.filter(procAlive).length;
  if (alive === 0) return 'restart';
  if (alive < existing.procs.length) return 'partly-down';
  // Memory worked out from the machine's on both ups is the same choice, whatever it came to.
  const asked = existing.options.hostMemoryFromRam && opts.hostMemoryFromRam ? { ...opts, hostMemoryMib: existing.options.hostMemoryMib } : opts;
  return JSON.stringify(existing.options) === JSON.stringify(asked) ? 'up' : 'other-options';
}

/** What a fleet directory's lock file holds: its holder, as procAlive identifies a process. */
interface LockHolder {
  pid: number;
  startTime: number;
  bootId: string;
}

function readHolderText(path: string): string | undefined {
  try {
    return readFileSync(path, 'utf8');
  } catch {
    return undefined;
  }
}

function parseHolder(text: string): LockHolder | undefined {
  try {
    return JSON.parse(text) as LockHolder;
  } catch {
    return undefined;
  }
}

/**
 * Removes the files a withDirLock killed midway left beside the lock `path`: its own lock
 * written aside (`<path>.<pid>.<8 hex>`, holding its writer's identity) and a stale lock it had
 * moved out of the way (that name + `.stale`), once their writer is gone: judged by the identity
 * in the aside file, or where that cannot be read, by whether the PID runs at all (a reused PID
 * keeps them; they are small and the next run after it removes them).
 */
function removeStaleLockFiles(path: string): void {
  const prefix = `${basename(path)}.`;
  let names: string[];
  try {
    names = readdirSync(dirname(path));
  } catch {
    return;
  }
  for (const name of names) {
    const m = name.startsWith(prefix) ? /^(\d+)\.[0-9a-f]{8}(?:\.stale)?$/.exec(name.slice(prefix.length)) : null;
    if (!m) continue;
    const pid = Number(m[1]);
    const writer = parseHolder(readHolderText(join(dirname(path), name.replace(/\.stale$/, ''))) ?? '');
    const gone = writer && writer.pid === pid ? !isSameProcess(pid, writer) : !pidAlive(pid);
    if (gone) rmSync(join(dirname(path), name), { force: true });
  }
}

/**
 * Runs `fn` holding `<dir>.lock` (beside the directory, which down removes): one up, down or
 * restart per fleet directory at a time. A second one while the first works would find the
 * fleet incomplete, take it down as a failed start and start its own, and the first, failing,
 * would tear down what the second recorded. The lock file appears whole (written aside, then
 * linked into place, which fails if one exists); a lock whose holder is gone (killed) is
 * taken over; the holder removes only its own.
 */
async function withDirLock<T>(dir: string, fn: () => Promise<T>): Promise<T> {
  const path = `${dir}.lock`;
  mkdirSync(dirname(path), { recursive: true });
  removeStaleLockFiles(path);
  const me: LockHolder = { pid: process.pid, ...identityOf(process.pid) };
  const mine = JSON.stringify(me);
  const aside = `${path}.${process.pid}.${randomBytes(4).toString('hex')}`;
  writeFileSync(aside, mine);
  try {
    for (let tries = 0; ; tries++) {
      try {
        linkSync(aside, path);
        break;
      } catch (e) {
        if ((e as NodeJS.ErrnoException).code !== 'EEXIST' || tries >= 3) throw e;
        const held = readHolderText(path);
        if (held === undefined) continue; // released meanwhile: link again
        const holder = parseHolder(held);
        if (holder && isSameProcess(holder.pid, holder)) throw new Error(`another fleet up, down or restart (pid ${holder.pid}${holder.pid === process.pid ? ', this process' : ''}) is working on ${dir}: wait for it to finish`);
        // Stale: taken out of the way by a rename (atomic: of two takers, one moves it), then
        // checked; a lock that was not the stale one (another taker's, linked in meanwhile)
        // goes back.
        const moved = `${aside}.stale`;
        try {
          renameSync(path, moved);
        } catch {
          continue; // gone meanwhile: link again
        }
        if (readHolderText(moved) !== held) {
          try {
            linkSync(moved, path);
          } catch {
            // a third one took the place: its lock stands, this one is stale to it in turn
          }
        }
        rmSync(moved, { force: true });
      }
    }
  } finally {
    rmSync(aside, { force: true });
  }
  try {
    return await fn();
  } finally {
    if (readHolderText(path) === mine) rmSync(path, { force: true });
  }
}

/**
 * Starts a fleet (or finds it up as asked). A start that fails, or that SIGINT, SIGTERM or
 * SIGHUP stops, takes down what it made once its steps still in flight have settled
 * (bringup.ts), keeping the logs; stopped by a signal, it throws a FleetInterruptedError
 * (exitCode 130, 143 or 129). `signals`: where those come from.
 */
export async function up(given: FleetOptions, signals: SignalSource = process): Promise<FleetState> {
  const dir = fleetDir(given.dir);
  return withDirLock(dir, () => upLocked({ ...given, dir }, signals));
}

const messageOf = (e: unknown): string => (e instanceof Error ? e.message : String(e));

async function upLocked(given: FleetOptions, signals: SignalSource): Promise<FleetState> {
  const opts: FleetOptions = { ...given, dir: fleetDir(given.dir) };
  validateOptions(opts);
  const owner = claimableDir(opts.dir);
  const existing = readState(opts.dir);
  if (existing) {
    const found = foundFleet(existing, opts);
    // Up already, as asked: nothing to do (the Quick start's command may be run twice).
    if (found === 'up') return existing;
    if (found === 'other-options') throw new Error(`a fleet with other options is up in ${opts.dir} (since ${existing.startedAt}): run fleet:down first`);
    // Partly alive (an agent that crashed or was killed): its sandboxes and snapshots are
    // there, so it is not wiped for a new one without being asked. Started afresh only when
    // no process is left (after a reboot) or the up never finished.
    if (found === 'partly-down') {
      const dead = existing.procs.filter((p) => !procAlive(p));
      const dirFlag = opts.dir === resolve(DEFAULT_FLEET_DIR) ? '' : ` --dir ${opts.dir}`;
      throw new FleetPartlyDownError(
        `the fleet in ${opts.dir} (up since ${existing.startedAt}) has processes that are not running: ${dead.map((p) => `${p.name} (pid ${p.pid})`).join(', ')}. ` +
          `Start one again with \`npm run fleet:restart -- ${dead[0]!.name}${dirFlag}\`, or take the fleet down with \`npm run fleet:down${dirFlag ? ` --${dirFlag}` : ''}\` (its sandboxes and snapshots go) and run fleet:up again`,
      );
    }
  }
  const logs = join(opts.dir, 'logs');
  const kept = `(the fleet's logs are kept in ${logs}; fleet:down removes them)`;
  /** This start has marked the directory as the fleet's: from then on what it made is torn down if it does not finish. */
  let marked = false;
  const cleanup = async (end: StartEnd): Promise<void> => {
    if (!marked) return;
    if (end.signal === undefined) process.stderr.write(`fleet: start failed, cleaning up (the logs stay in ${logs}): ${messageOf(end.error)}\n`);
    await teardown(opts.dir, { keepLogs: true }).catch((t: unknown) => void process.stderr.write(`fleet: cleaning up failed too: ${messageOf(t)}\n`));
  };
  const onSignal = (sig: string): void => {
    // The terminal is gone: writes to it fail, and must not end the teardown.
    if (sig === 'SIGHUP') for (const out of [process.stdout, process.stderr]) out.on('error', () => undefined);
    process.stderr.write(`fleet: ${sig}: stopping the start, then stopping and removing what it started (the logs stay); ${sig} again ends fleet.ts at once (then npm run fleet:down)\n`);
  };
  try {
    return await guardedStart(
      async (abort) => {
        // A dead or partly dead fleet, or the logs of a failed up: cleared so this fleet starts
        // afresh. (teardown, not down: this up holds the directory's lock.)
        if (owner === 'ours') await teardown(opts.dir);
        throwIfStopped(abort);
        for (const ns of sh('ip', ['netns', 'list']).split('\n').map((l) => l.split(' ')[0])) {
          // Another fleet's, most likely (this directory's own was cleared above): taking it
          // down, or deleting the namespace, would break that fleet.
          if (ns && ns.startsWith(`${opts.prefix}-`)) throw new Error(`network namespace ${ns} already exists: another fleet (or one whose directory is gone) uses the prefix ${opts.prefix}; start this one with another --prefix (and --base-port), or take that one down with fleet:down --dir <its directory>`);
        }
        await checkFleetPortsFree(opts);
        throwIfStopped(abort);
        const createdDir = !existsSync(opts.dir);
        mkdirSync(opts.dir, { recursive: true });
        writeFileSync(join(opts.dir, MARKER), `${JSON.stringify({ fleet: 'forkfleet', createdDir } satisfies DirMarker)}\n`);
        marked = true;
        mkdirSync(logs, { recursive: true });
        const state: FleetState = {
          version: 1,
          startedAt: new Date().toISOString(),
          bootId: bootId(),
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
          guestCgroup: '',
          guestCgroupOwned: false,
        };
        // The group is in state.json before it exists: an up killed in between leaves nothing
        // that down does not find.
        const cgroup = await guestCgroupFor(opts, (planned) => {
          state.guestCgroup = planned.path;
          state.guestCgroupOwned = planned.owned;
          saveState(state);
        });
        state.guestCgroup = cgroup.path;
        state.guestCgroupOwned = cgroup.owned;
        saveState(state);
        return bringUp(state, abort);
      },
      cleanup,
      { signals, onSignal },
    );
  } catch (e) {
    if (e instanceof FleetInterruptedError) {
      const failing = e.cause === undefined ? '' : ` (it was failing: ${messageOf(e.cause)})`;
      throw new FleetInterruptedError(e.signal, `start stopped by ${e.signal}${marked ? `: what it had started is stopped and removed${failing}\n${kept}` : failing}`, { cause: e });
    }
    if (!marked) throw e;
    // The logs stay: the error names files in them, and they say why.
    throw new Error(`${messageOf(e)}\n${kept}`, { cause: e });
  }
}

/**
 * The start's steps, from the guest image to every host ready. Each refuses to begin once
 * `abort` fires, and every wait ends then; upLocked's cleanup removes what they made.
 */
async function bringUp(state: FleetState, abort: AbortSignal): Promise<FleetState> {
  const opts = state.options;
  const { ensureImage } = await import('../images/build.ts');
  const step = (s: string): void => {
    throwIfStopped(abort);
    process.stderr.write(`fleet: ${s}\n`);
  };
  step('guest image');
  await ensureImage('tiny');
  step(`network: ${opts.hosts} host namespaces on a bridge, links shaped to ${opts.link}`);
  makeNetwork(state);
  makeKeys(state);
  makeApiCredentials(opts.dir);
  step(`etcd (${opts.etcd} member${opts.etcd > 1 ? 's' : ''}) and NATS`);
  // Side by side: one failing stops the other, and both settle before the cleanup reads state.json.
  await allSteps(abort, [(a) => startEtcd(state, a), (a) => startNats(state, a)]);
  step('2 scheduler replicas');
  await startSchedulers(state, abort);
  step(`${opts.hosts} host agents`);
  await allSteps(abort, state.hosts.map((h) => (a: AbortSignal) => startAgent(state, h, a)));
  saveState(state);
  await waitHostsReady(state, 60_000, abort);
  throwIfStopped(abort);
  state.complete = true;
  saveState(state);
  return state;
}

/** A QEMU pid file, with the directories the QEMU it names must have been started in. */
interface QemuPidFile {
  pid: number;
  /** The pid file's directory, and a claimed standby's launch directory (driver.ts VmPersisted.launchDir). */
  dirs: string[];
}

/** The pid files (qemu.<gen>.pid, written by QEMU) in `dir`; undefined if it is no directory. */
function qemuPidFilesIn(dir: string, extraDirs: string[] = []): QemuPidFile[] | undefined {
  let files: string[];
  try {
    files = readdirSync(dir);
  } catch {
    return undefined;
  }
  return files.filter((f) => /^qemu\..*pid$/.test(f)).flatMap((f) => readPidFile(join(dir, f)).map((pid) => ({ pid, dirs: [dir, ...extraDirs] })));
}

function subdirs(dir: string): string[] {
  try {
    return readdirSync(dir);
  } catch {
    return [];
  }
}

/** A VM's pid files: vms/<vmId>/qemu.<gen>.pid; a claimed standby's QEMU names its standby directory. */
function vmPidFiles(dataDir: string, vm: string): QemuPidFile[] | undefined {
  const dir = join(dataDir, 'vmm', 'vms', vm);
  const launchDir = (readJson(join(dir, 'vm.json')) as { launchDir?: unknown } | undefined)?.launchDir;
  return qemuPidFilesIn(dir, typeof launchDir === 'string' ? [launchDir] : []);
}

/** Standbys' pid files: standby/<id>/qemu.0.pid (a paused QEMU no sandbox owns yet, ADR 0014). */
function standbyPidFiles(dataDir: string): QemuPidFile[] {
  const dir = join(dataDir, 'vmm', 'standby');
  // A claimed standby's symlink to a destroyed VM, or one still starting, has no pid file.
  return subdirs(dir).flatMap((s) => readPidFile(join(dir, s, 'qemu.0.pid')).map((pid) => ({ pid, dirs: [join(dir, s)] })));
}

/** Snapshot receivers' pid files: snapshots/<id>/.recv/qemu.<gen>.pid (driver.ts snapshotViaReceiver). */
function receiverPidFiles(dataDir: string): QemuPidFile[] {
  const dir = join(dataDir, 'vmm', 'snapshots');
  return subdirs(dir).flatMap((s) => qemuPidFilesIn(join(dir, s, '.recv')) ?? []);
}

/** The PIDs of those pid files that still name their QEMU (not a process that reused the PID). */
const running = (files: QemuPidFile[]): number[] => [...new Set(files.filter((f) => isQemuIn(f.pid, f.dirs)).map((f) => f.pid))];

/** QEMUs running for an agent's VMs, by VM (one pid file per QEMU generation). Every VM directory has an entry. */
export function qemuPidsByVm(dataDir: string): Map<string, number[]> {
  const out = new Map<string, number[]>();
  const vms = join(dataDir, 'vmm', 'vms');
  if (!existsSync(vms)) return out;
  for (const vm of readdirSync(vms)) {
    const files = vmPidFiles(dataDir, vm);
    if (files) out.set(vm, running(files));
  }
  return out;
}

/** Every QEMU running for an agent's VMs. */
export function qemuPids(dataDir: string): number[] {
  return [...qemuPidsByVm(dataDir).values()].flat();
}

/**
 * The agent's standby QEMUs that run (paused processes no sandbox owns yet, ADR 0014). A
 * stopping agent ends them itself; this is for tearing down after an agent was killed.
 */
export function standbyPids(dataDir: string): number[] {
  return running(standbyPidFiles(dataDir));
}

/** The agent's snapshot receiver QEMUs that run (a snapshot of a clone the agent died in). */
export function receiverPids(dataDir: string): number[] {
  return running(receiverPidFiles(dataDir));
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
 * started that the stops above missed. It is killed through `cgroup.kill` (cgroup v2, Linux
 * 5.14+: the kernel kills the group's members, so no PID read here can have been reused by
 * then); on an older kernel, by the PIDs `cgroup.procs` lists (live members only). Only the
 * group itself goes, not parents of a nested FF_GUEST_CGROUP.
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
    if (!killCgroup(dir)) {
      for (const pid of procs.split('\n').filter(Boolean).map(Number)) {
        try {
          process.kill(pid, 'SIGKILL');
        } catch {
          /* exited meanwhile */
        }
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

/** SIGKILLs every member of a cgroup v2 group by its `cgroup.kill`; false where there is none. */
export function killCgroup(dir: string): boolean {
  try {
    writeFileSync(join(dir, 'cgroup.kill'), '1');
    return true;
  } catch {
    return false;
  }
}

/** Stops the fleet's processes and removes its namespaces and cgroup. */
/** Whether the fleet was started in an earlier boot than this one (FleetState.bootId). */
export function fromEarlierBoot(state: Pick<FleetState, 'bootId' | 'procs'>, now = bootId()): boolean {
  const then = state.bootId ?? state.procs.find((p) => p.bootId)?.bootId;
  return then !== undefined && then !== '' && then !== now;
}

async function stopFleet(state: FleetState): Promise<void> {
  // Started before a reboot: none of its processes, namespaces, cgroup or mounts exist now,
  // and a namespace or cgroup of the same name is another fleet's. Only its files go.
  if (fromEarlierBoot(state)) return;
  const order: ProcRecord['kind'][] = ['agent', 'scheduler', 'relay', 'nats', 'etcd'];
  for (const kind of order) {
    const procs = state.procs.filter((p) => p.kind === kind);
    // etcd members one at a time (all at once makes the last one hang).
    if (kind === 'etcd') for (const p of procs) await stopRecorded(p, 5000);
    else await Promise.all(procs.map((p) => stopRecorded(p, stopGraceOf(kind))));
    if (kind === 'agent') {
      // Agents leave VMs running for a restarted agent to adopt; down ends them too, and any
      // standby or snapshot receiver a killed agent left. Each PID only while it is still the
      // QEMU its pid file was written for.
      for (const h of state.hosts) {
        const seen = new Set<number>();
        for (const f of [...subdirs(join(h.dataDir, 'vmm', 'vms')).flatMap((vm) => vmPidFiles(h.dataDir, vm) ?? []), ...standbyPidFiles(h.dataDir), ...receiverPidFiles(h.dataDir)]) {
          if (seen.has(f.pid)) continue; // a claimed standby's: under vms/ and standby/
          seen.add(f.pid);
          await stopProcess(`a QEMU of ${h.id}`, f.pid, () => isQemuIn(f.pid, f.dirs), 2000);
        }
      }
      // Agents mount their RAM tmpfs in their own mount namespace (gone with them); when one
      // was already mounted on the machine, their files are in it: remove them.
      const ramMount = fleetRamMount(state.options);
      if (ramMount) {
        for (const h of state.hosts) rmSync(ramDirFor(ramMount, join(h.dataDir, 'vmm')), { recursive: true, force: true });
        // The mount point the agents made, when it is this fleet's own (/run/forkfleet/<prefix>/ram,
        // then its parents while empty): a directory named in agentEnv may be anyone's mount.
        const own = state.options.agentEnv?.FF_RAM_MOUNT === undefined;
        for (const d of own ? [ramMount, dirname(ramMount), dirname(dirname(ramMount))] : [ramMount]) {
          try {
            rmdirSync(d);
          } catch {
            /* in use, mounted or not ours */
          }
        }
      }
    }
  }
  for (const ns of [...state.namespaces].reverse()) {
    // What an agent recorded of its namespace under /run (egress.ts: it turned ip_forward on
    // there, the last egress link it handed out), keyed by the namespace's inode: gone with
    // the namespace.
    try {
      const ino = statSync(`/run/netns/${ns}`).ino;
      for (const f of [forwardMarkerOf(ino), linkCursorOf(ino)]) rmSync(f, { force: true });
    } catch {
      /* no such namespace (any more) */
    }
    sh('ip', ['netns', 'del', ns], { allowFail: true });
  }
  try {
    rmdirSync(dirname(forwardMarkerOf(0))); // when no other agent's marker is left in it
  } catch {
    /* not empty, or not there */
  }
  // Another's group (FF_GUEST_CGROUP named one that existed) stays, with its members: this
  // fleet's QEMUs in it were stopped above, by their pid files.
  if (ownsGuestCgroup(state)) await removeGuestCgroup(state.guestCgroup!);
}

/** down, or a failed up's cleanup (which keeps the logs). False: no fleet (nor a failed up's logs) was in `dir`. */
async function teardown(dir: string, opts: { keepLogs?: boolean } = {}): Promise<boolean> {
  const state = readState(dir);
  if (state) await stopFleet(state);
  else if (!readMarker(dir)) return false;
  removeFleetEntries(dir, opts);
  return true;
}

/**
 * Stops the fleet in `dir` and removes what it made: its processes (each only while its PID
 * is still that process), namespaces, cgroup, and its entries in the directory (never other
 * files there; the directory itself if `up` made it).
 */
export async function down(dir: string): Promise<boolean> {
  const d = fleetDir(dir);
  return withDirLock(d, () => teardown(d));
}

export async function status(dir: string): Promise<{ state: FleetState; procs: Array<ProcRecord & { alive: boolean }>; hosts: unknown[] }> {
  dir = fleetDir(dir);
  const state = readState(dir);
  if (!state) {
    const failed = readMarker(dir) && existsSync(join(dir, 'logs')) ? ` (the logs of a start that failed are in ${join(dir, 'logs')})` : '';
    throw new NoFleetError(`no fleet in ${dir}${failed}: start one with npm run fleet:up`);
  }
  const procs = state.procs.map((p) => ({ ...p, alive: procAlive(p) }));
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

export const USAGE = `usage: fleet.ts COMMAND [flags]
  up                   start a fleet: etcd, NATS, 2 schedulers and N host agents in network namespaces
    --hosts N          host agents, 1-32 (default 3)
    --etcd 1|3         etcd members (default 1)
    --link RATE        each host's shaped link, e.g. 10gbit, 1gbit, 500mbit (default 10gbit)
    --prefix P         namespace and link name prefix: 1-6 lowercase letters, not starting with ${HOST_LINK_PREFIX} (default ffl)
    --base-port N      first port of the control plane, which listens on N .. N+41; ${BASE_PORT_RANGE[0]}-${BASE_PORT_RANGE[1]} (default 17700)
    --peer-tls on|off  mutual TLS between the agents (default on)
  status [--json]      the fleet's processes and hosts
  restart NAME         stop one process (names: status) and start it again as it was started
  down                 stop everything and remove what the fleet made
flags of every command:
  --dir DIR            the fleet's directory: new, empty or a fleet's (default $FF_FLEET_DIR, else ${DEFAULT_FLEET_DIR})
  -h, --help           this text
`;

/** A command line fleet.ts cannot run; the message names the flag. */
export class UsageError extends Error {
  override name = 'UsageError';
}

export type CliCommand =
  | { cmd: 'help' }
  | { cmd: 'up'; opts: FleetOptions }
  | { cmd: 'status'; dir: string; json: boolean }
  | { cmd: 'restart'; dir: string; name: string }
  | { cmd: 'down'; dir: string };

const FLAGS = {
  dir: { type: 'string' },
  hosts: { type: 'string' },
  etcd: { type: 'string' },
  link: { type: 'string' },
  prefix: { type: 'string' },
  'base-port': { type: 'string' },
  'peer-tls': { type: 'string' },
  json: { type: 'boolean' },
  help: { type: 'boolean', short: 'h' },
} as const;

/** The flags each command takes besides --dir and --help. */
const COMMAND_FLAGS: Record<Exclude<CliCommand['cmd'], 'help'>, readonly (keyof typeof FLAGS)[]> = {
  up: ['hosts', 'etcd', 'link', 'prefix', 'base-port', 'peer-tls'],
  status: ['json'],
  restart: [],
  down: [],
};

/** A whole decimal number within min..max: Number() alone also takes '2.5', '0x10', '' and ' 3'. */
function intFlag(flag: string, v: string | undefined, min: number, max: number, dflt: number): number {
  if (v === undefined) return dflt;
  const n = /^\d{1,6}$/.test(v) ? Number(v) : NaN;
  if (!(n >= min && n <= max)) throw new UsageError(`--${flag}: an integer ${min}..${max}, got ${JSON.stringify(v)}`);
  return n;
}

/** Parses fleet.ts's arguments strictly: unknown flags, missing values, stray words and bad numbers are errors. */
export function parseCli(argv: string[]): CliCommand {
  let parsed: ReturnType<typeof parseArgs<{ args: string[]; options: typeof FLAGS; strict: true; allowPositionals: true }>>;
  try {
    parsed = parseArgs({ args: argv, options: FLAGS, strict: true, allowPositionals: true });
  } catch (e) {
    throw new UsageError((e as Error).message, { cause: e });
  }
  const { values: v, positionals } = parsed;
  if (v.help) return { cmd: 'help' };
  const [cmd, ...rest] = positionals;
  if (cmd !== 'up' && cmd !== 'status' && cmd !== 'restart' && cmd !== 'down') throw new UsageError(cmd === undefined ? 'a command: up, status, restart or down' : `unknown command ${JSON.stringify(cmd)}: up, status, restart or down`);
  for (const flag of Object.keys(v) as (keyof typeof FLAGS)[]) {
    if (flag !== 'dir' && !COMMAND_FLAGS[cmd].includes(flag)) throw new UsageError(`--${flag}: not a flag of ${cmd}`);
  }
  if (cmd === 'restart' && rest.length !== 1) throw new UsageError('restart: one process name (fleet.ts status lists them)');
  if (cmd !== 'restart' && rest.length > 0) throw new UsageError(`${cmd}: unexpected argument ${JSON.stringify(rest[0])}`);
  if (v.dir === '') throw new UsageError('--dir: empty');
  const dir = fleetDir(v.dir);
  if (cmd === 'status') return { cmd, dir, json: v.json ?? false };
  if (cmd === 'restart') return { cmd, dir, name: rest[0]! };
  if (cmd === 'down') return { cmd, dir };
  const etcd = intFlag('etcd', v.etcd, 1, 3, 1);
  if (etcd !== 1 && etcd !== 3) throw new UsageError(`--etcd: 1 or 3, got ${etcd}`);
  const peerTls = v['peer-tls'];
  if (peerTls !== undefined && peerTls !== 'on' && peerTls !== 'off') throw new UsageError(`--peer-tls: on or off, got ${JSON.stringify(peerTls)}`);
  const opts = defaultOptions({
    hosts: intFlag('hosts', v.hosts, 1, 32, 3),
    etcd,
    ...(v.link !== undefined ? { link: v.link } : {}),
    dir,
    ...(v.prefix !== undefined ? { prefix: v.prefix } : {}),
    basePort: intFlag('base-port', v['base-port'], BASE_PORT_RANGE[0], BASE_PORT_RANGE[1], 17700),
    peerTls: peerTls !== 'off',
  });
  try {
    validateOptions(opts);
  } catch (e) {
    throw new UsageError((e as Error).message, { cause: e });
  }
  return { cmd, opts };
}

/** What fleet:up prints once the fleet is up: where everything is, and how to use it. */
export function upSummary(s: Pick<FleetState, 'hosts' | 'apiAddresses' | 'metricsAddresses'>, opts: Pick<FleetOptions, 'dir' | 'link' | 'etcd' | 'peerTls'>): string {
  const { dir } = opts;
  const api = s.apiAddresses[0]!;
  // Clients find the default directory's credentials on their own; another one's with FF_FLEET_DIR.
  const own = dir !== resolve(DEFAULT_FLEET_DIR);
  return [
    `Forkfleet is up: ${s.hosts.length} hosts (${s.hosts.map((h) => `${h.id}=${h.address}`).join(', ')}), links ${opts.link}, etcd x${opts.etcd}, 2 schedulers; between agents ${opts.peerTls ? 'mutual TLS' : 'plain text (--peer-tls off)'}.`,
    `  API (gRPC over TLS):   ${s.apiAddresses.join(' and ')}   CA ${apiCredentialPaths(dir).caCert}`,
    `  credentials:           ${apiCredentialPaths(dir).credentials} (admin; the CLI and SDK find it${own ? ` with FF_FLEET_DIR=${dir}` : ''}), ${apiCredentialPaths(dir).devCredentials} (tenant dev: FF_CREDENTIALS=...)`,
    `  metrics:               ${s.metricsAddresses.map((m) => `http://${m}/metrics`).join(' ')}`,
    `  dashboard:             http://${s.metricsAddresses[0]}/dashboard/#token=<the admin token in credentials.json> (admin only)`,
    `  CLI:                   npm run forkfleet -- sandbox create --image tiny   (see services/cli/README.md)`,
    `  logs:                  ${join(dir, 'logs')}`,
    '',
    'Try it:',
    `  TOKEN=$(node -p 'require("${apiCredentialPaths(dir).credentials}").token')`,
    `  npx buf curl --protocol grpc --cacert ${apiCredentialPaths(dir).caCert} -H "authorization: Bearer $TOKEN" https://${api}/forkfleet.v1.FleetService/ListHosts`,
    `  npx buf curl --protocol grpc --cacert ${apiCredentialPaths(dir).caCert} -H "authorization: Bearer $TOKEN" -d '{"tenantId":"demo","idempotencyKey":"first","image":"tiny"}' https://${api}/forkfleet.v1.FleetService/CreateSandbox`,
    ...(own ? [`  export FF_FLEET_DIR=${dir}     # for the CLI, the SDK and the fleet commands below`] : []),
    '  npm run fleet:status      npm run test:e2e      npm run fleet:down',
    '',
  ].join('\n');
}

async function cli(argv: string[]): Promise<void> {
  const c = parseCli(argv);
  if (c.cmd === 'help') {
    process.stdout.write(USAGE);
  } else if (c.cmd === 'up') {
    process.stdout.write(upSummary(await up(c.opts), c.opts));
  } else if (c.cmd === 'down') {
    if (await down(c.dir)) process.stdout.write('fleet is down: its processes stopped, namespaces, links and files removed\n');
    else process.stdout.write(`fleet: nothing to stop in ${fleetDir(c.dir)} (no fleet was started there)\n`);
  } else if (c.cmd === 'status') {
    const { dir } = c;
    const st = await status(dir);
    if (c.json) {
      process.stdout.write(`${JSON.stringify({ procs: st.procs, hosts: st.hosts, api: st.state.apiAddresses }, null, 2)}\n`);
      return;
    }
    process.stdout.write(`fleet in ${dir}, up since ${st.state.startedAt}; API ${st.state.apiAddresses.join(', ')}\n\nprocesses:\n`);
    for (const p of st.procs) process.stdout.write(`  ${p.alive ? 'up  ' : 'DOWN'} ${p.name.padEnd(14)} pid ${String(p.pid).padEnd(8)} ${p.netns ? `netns ${p.netns}` : ''}\n`);
    process.stdout.write('\nhosts (from the scheduler):\n');
    if (st.hosts.length === 0) process.stdout.write('  (API not answering)\n');
    for (const h of st.hosts) process.stdout.write(`  ${JSON.stringify(h)}\n`);
  } else {
    const rec = await restartProcess(c.dir, c.name);
    process.stdout.write(`${rec.name} restarted: pid ${rec.pid}\n`);
  }
}

if (process.argv[1] && resolve(process.argv[1]) === resolve(import.meta.filename)) {
  enterUserCwd(['fleet:up', 'fleet:status', 'fleet:restart', 'fleet:down']);
  cli(process.argv.slice(2)).then(
    () => process.exit(0),
    (e: unknown) => {
      process.stderr.write(`fleet: ${e instanceof Error ? e.message : String(e)}\n`);
      if (e instanceof UsageError) process.stderr.write(`\n${USAGE}`);
      // Stopped by a signal (its start cleaned up): 128 + the signal's number, as a shell reports it.
      process.exit(e instanceof UsageError ? 2 : e instanceof FleetInterruptedError ? e.exitCode : 1);
    },
  );
}
