// The inventory of a real deployment: which machine runs which part of Forkfleet. Pure: it
// parses and checks the JSON (every error names its field) and fills in the defaults.
//
//   {
//     "name": "prod",                                    cluster name: etcd token, NATS cluster
//     "installDir": "/opt/forkfleet",                    where the repository is checked out on every machine
//     "node": "/usr/bin/node",                           Node.js 20.19+ (or 22.12+) on every machine (optional; e.g. /usr/local/bin/node)
//     "etcd":       [{ "name": "etcd-1", "address": "10.0.0.11" }, ...],     1, 3 or 5 members
//     "nats":       [{ "name": "nats-1", "address": "10.0.0.11" }, ...],     1 or 3+ servers (JetStream)
//     "schedulers": [{ "name": "sched-1", "address": "10.0.0.11", "dns": ["api.forkfleet.internal"] }, ...],
//     "hosts":      [{ "id": "kvm-01", "address": "10.0.1.21", "linkGbps": 25 }, ...],
//     "controlCidrs": ["10.0.0.0/24", "10.0.1.0/24"],    networks no sandbox may reach (FF_EGRESS_DENY_CIDRS);
//                                                        required, and every address above must be in one
//     Addresses are IPv4: where each process listens. The etcd membership is fixed by the first
//     render (ETCD_INITIAL_CLUSTER_STATE=new): grow it with `etcdctl member add`, not here.
//     "ports": { "api": 17700, ... }                     optional; defaults below
//   }
//
// Any entry may name the `machine` it runs on (default: its address); the renderer writes one
// directory per machine with everything that machine needs. An address is one machine's, and
// no two ports bound on one address may be the same. A key not named here is refused (a
// misspelt one would otherwise be dropped unnoticed), as is an installDir or node under /home,
// /root or /run/user (the scheduler's unit has ProtectHome=yes).
import { isIP } from 'node:net';
import { posix } from 'node:path';
import { InvalidArgumentError } from '../../proto/errors.ts';
import { parseCidr } from '../../host-agent/adapters/netns/egress.ts';

export interface Ports {
  readonly etcdClient: number;
  readonly etcdPeer: number;
  readonly natsClient: number;
  readonly natsCluster: number;
  readonly natsMonitor: number;
  /** Schedulers' gRPC API (TLS). */
  readonly api: number;
  /** Schedulers' /metrics and dashboard. */
  readonly metrics: number;
  /** Host agents' /metrics. */
  readonly agentMetrics: number;
  /** Host agents' peer ChunkTransfer service. */
  readonly peer: number;
}

export const DEFAULT_PORTS: Ports = Object.freeze({ etcdClient: 2379, etcdPeer: 2380, natsClient: 4222, natsCluster: 6222, natsMonitor: 8222, api: 17700, metrics: 17710, agentMetrics: 17711, peer: 7800 });

export interface Member {
  readonly name: string;
  readonly address: string;
  readonly machine: string;
}

export interface SchedulerEntry extends Member {
  /** Extra DNS names on its TLS certificate (its address is always on it). */
  readonly dns: readonly string[];
}

export interface HostEntry {
  readonly id: string;
  readonly address: string;
  readonly machine: string;
  /** FF_LINK_BYTES_PER_SECOND, from the NIC's rate. */
  readonly linkGbps: number;
  /** FF_CAPACITY_*: unset lets the agent size them from the machine. */
  readonly vcpus: number | undefined;
  readonly memoryMib: number | undefined;
  readonly diskMib: number | undefined;
}

export interface Inventory {
  readonly name: string;
  readonly installDir: string;
  /** Node.js on every machine: the units' ExecStart. */
  readonly node: string;
  readonly etcd: readonly Member[];
  readonly nats: readonly Member[];
  readonly schedulers: readonly SchedulerEntry[];
  readonly hosts: readonly HostEntry[];
  readonly controlCidrs: readonly string[];
  readonly ports: Ports;
}

const NAME = /^[a-z0-9][a-z0-9-]{0,62}$/;
const DNS = /^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$/;

type Json = Record<string, unknown>;

function obj(v: unknown, field: string): Json {
  if (typeof v !== 'object' || v === null || Array.isArray(v)) throw new InvalidArgumentError(field, 'must be an object');
  return v as Json;
}

function str(o: Json, key: string, field: string, re?: RegExp, why?: string): string {
  const v = o[key];
  const f = field ? `${field}.${key}` : key;
  if (typeof v !== 'string' || v === '') throw new InvalidArgumentError(f, 'must be a non-empty string');
  if (re && !re.test(v)) throw new InvalidArgumentError(f, why ?? `must match ${re}`);
  return v;
}

/**
 * Where the process listens and others reach it: an IPv4 address. etcd binds only to IP
 * addresses, and the processes' host:port settings take IPv4 (names go in a scheduler's `dns`).
 */
function address(o: Json, field: string): string {
  const v = str(o, 'address', field);
  if (isIP(v) !== 4) throw new InvalidArgumentError(`${field}.address`, `must be an IPv4 address, got ${JSON.stringify(v)}`);
  return v;
}

function optInt(o: Json, key: string, field: string, min: number, max: number): number | undefined {
  const v = o[key];
  if (v === undefined) return undefined;
  if (typeof v !== 'number' || !Number.isInteger(v) || v < min || v > max) throw new InvalidArgumentError(`${field}.${key}`, `must be an integer in [${min}, ${max}]`);
  return v;
}

function list(root: Json, key: string, min: number): Json[] {
  const v = root[key];
  if (!Array.isArray(v) || v.length < min) throw new InvalidArgumentError(key, `must be a list of at least ${min}`);
  return v.map((e, i) => obj(e, `${key}[${i}]`));
}

/** Refuses a second item with the same key, naming it (`${field}[i]`, plus `.${sub}` when given). */
function unique<T>(items: readonly T[], key: (t: T) => string, field: string, sub?: string): void {
  const seen = new Set<string>();
  items.forEach((t, i) => {
    const k = key(t);
    if (seen.has(k)) throw new InvalidArgumentError(`${field}[${i}]${sub ? `.${sub}` : ''}`, `${JSON.stringify(k)} appears twice`);
    seen.add(k);
  });
}

/** Refuses a key of `o` not in `keys`, naming it (a misspelt one would be dropped unnoticed). */
function onlyKeys(o: Json, keys: readonly string[], field: string, what: string): void {
  for (const k of Object.keys(o)) {
    if (keys.includes(k)) continue;
    const near = keys.find((x) => x.toLowerCase() === k.toLowerCase());
    throw new InvalidArgumentError(field ? `${field}.${k}` : k, `is not a field of ${what}${near ? `: did you mean ${near}?` : ''} (${keys.join(', ')})`);
  }
}

const ROOT_KEYS = ['name', 'installDir', 'node', 'etcd', 'nats', 'schedulers', 'hosts', 'controlCidrs', 'ports'] as const;
const MEMBER_KEYS = ['name', 'address', 'machine'] as const;
const SCHEDULER_KEYS = [...MEMBER_KEYS, 'dns'] as const;
const HOST_KEYS = ['id', 'address', 'machine', 'linkGbps', 'vcpus', 'memoryMib', 'diskMib'] as const;

/**
 * Directories the scheduler's unit cannot see: ProtectHome=yes (units/forkfleet-scheduler.service)
 * makes them empty and inaccessible to it, so an installDir or node there fails its start.
 */
const PROTECTED_HOME = ['/home', '/root', '/run/user'] as const;

/** An absolute path every unit's ExecStart can use: no spaces or quotes, and not where ProtectHome hides it. */
function unitPath(root: Json, key: 'installDir' | 'node', fallback: string): string {
  if (root[key] === undefined) return fallback;
  const v = str(root, key, '', /^\/[^\s"'$\\]*$/, 'must be an absolute path without spaces or quotes');
  const norm = posix.normalize(v);
  const hidden = PROTECTED_HOME.find((d) => norm === d || norm.startsWith(`${d}/`));
  if (hidden) throw new InvalidArgumentError(key, `${v} is under ${hidden}, which the scheduler's unit cannot see (ProtectHome=yes hides /home, /root and /run/user from it): put it elsewhere, e.g. ${key === 'node' ? '/usr/local/bin/node' : '/opt/forkfleet'}`);
  return v;
}

function member(o: Json, field: string, keys: readonly string[] = MEMBER_KEYS, what = 'a member'): Member {
  onlyKeys(o, keys, field, what);
  const name = str(o, 'name', field, NAME, 'must be 1-63 characters of a-z, 0-9 and -');
  const addr = address(o, field);
  const machine = o.machine === undefined ? addr : str(o, 'machine', field, DNS, 'must be a host name');
  return { name, address: addr, machine };
}

/** Parses an inventory (the JSON's value). Throws InvalidArgumentError naming the field. */
export function parseInventory(raw: unknown): Inventory {
  const root = obj(raw, 'inventory');
  onlyKeys(root, ROOT_KEYS, '', 'the inventory');
  const name = str(root, 'name', '', NAME, 'must be 1-63 characters of a-z, 0-9 and -');
  const installDir = unitPath(root, 'installDir', '/opt/forkfleet');
  const node = unitPath(root, 'node', '/usr/bin/node');
  const etcd = list(root, 'etcd', 1).map((o, i) => member(o, `etcd[${i}]`));
  if (![1, 3, 5, 7].includes(etcd.length)) throw new InvalidArgumentError('etcd', `needs 1, 3, 5 or 7 members (an odd number keeps a quorum), got ${etcd.length}`);
  const nats = list(root, 'nats', 1).map((o, i) => member(o, `nats[${i}]`));
  if (nats.length === 2) throw new InvalidArgumentError('nats', 'needs 1 server, or 3 or more (JetStream replicates over a majority)');
  const schedulers = list(root, 'schedulers', 1).map((o, i): SchedulerEntry => {
    const m = member(o, `schedulers[${i}]`, SCHEDULER_KEYS, 'a scheduler');
    const dnsRaw = o.dns ?? [];
    if (!Array.isArray(dnsRaw) || dnsRaw.some((d) => typeof d !== 'string' || !DNS.test(d))) throw new InvalidArgumentError(`schedulers[${i}].dns`, 'must be a list of DNS names');
    return { ...m, dns: dnsRaw as string[] };
  });
  const hosts = list(root, 'hosts', 1).map((o, i): HostEntry => {
    const field = `hosts[${i}]`;
    onlyKeys(o, HOST_KEYS, field, 'a host');
    const id = str(o, 'id', field, NAME, 'must be 1-63 characters of a-z, 0-9 and - (the host id)');
    const addr = address(o, field);
    const linkGbps = o.linkGbps === undefined ? 10 : o.linkGbps;
    if (typeof linkGbps !== 'number' || !(linkGbps > 0 && linkGbps <= 1000)) throw new InvalidArgumentError(`${field}.linkGbps`, 'must be a number in (0, 1000]');
    return {
      id,
      address: addr,
      machine: o.machine === undefined ? addr : str(o, 'machine', field, DNS, 'must be a host name'),
      linkGbps,
      vcpus: optInt(o, 'vcpus', field, 1, 100_000),
      memoryMib: optInt(o, 'memoryMib', field, 64, 1 << 30),
      diskMib: optInt(o, 'diskMib', field, 1, 1 << 30),
    };
  });
  unique(etcd, (m) => m.name, 'etcd');
  unique(etcd, (m) => m.address, 'etcd', 'address');
  unique(nats, (m) => m.name, 'nats');
  unique(nats, (m) => m.address, 'nats', 'address');
  unique(schedulers, (m) => m.name, 'schedulers');
  unique(schedulers, (m) => m.address, 'schedulers', 'address');
  unique(hosts, (h) => h.id, 'hosts');
  unique(hosts, (h) => h.address, 'hosts', 'address');
  // One of each role per machine: each role is one systemd unit and one set of files there.
  unique(etcd, (m) => m.machine, 'etcd');
  unique(nats, (m) => m.machine, 'nats');
  unique(schedulers, (m) => m.machine, 'schedulers');
  unique(hosts, (h) => h.machine, 'hosts');
  const roles: Array<[string, ReadonlyArray<{ address: string; machine: string }>]> = [['etcd', etcd], ['nats', nats], ['schedulers', schedulers], ['hosts', hosts]];
  // One address is one machine: two machines' directories would each get a process listening on it.
  const machineAt = new Map<string, { machine: string; field: string }>();
  for (const [role, list] of roles) {
    list.forEach((m, i) => {
      const first = machineAt.get(m.address);
      if (first && first.machine !== m.machine) throw new InvalidArgumentError(`${role}[${i}].machine`, `is ${JSON.stringify(m.machine)}, but ${first.field} on the same address ${m.address} is on machine ${JSON.stringify(first.machine)} (a machine defaults to the entry's address): one address is one machine`);
      if (!first) machineAt.set(m.address, { machine: m.machine, field: `${role}[${i}]` });
    });
  }
  const cidrs = root.controlCidrs ?? [];
  if (!Array.isArray(cidrs) || cidrs.some((c) => typeof c !== 'string' || !/^(\d{1,3}\.){3}\d{1,3}\/\d{1,2}$/.test(c) || isIP(c.split('/')[0]!) !== 4 || Number(c.split('/')[1]) > 32)) throw new InvalidArgumentError('controlCidrs', 'must be a list of IPv4 CIDRs such as 10.0.0.0/24');
  // Every address of the control plane must be in them: a sandbox allowed egress on one host
  // could otherwise reach etcd, NATS, a scheduler or another host's peer port.
  if (cidrs.length === 0) throw new InvalidArgumentError('controlCidrs', 'required: the networks of every address here, which no sandbox allowed egress may reach (FF_EGRESS_DENY_CIDRS)');
  const within = (addr: string): boolean => (cidrs as string[]).some((c) => inCidr(addr, c));
  for (const [role, list] of roles) {
    list.forEach((m, i) => {
      if (!within(m.address)) throw new InvalidArgumentError(`${role}[${i}].address`, `${m.address} is in none of controlCidrs (${(cidrs as string[]).join(', ')}): a sandbox allowed egress could reach it`);
    });
  }
  const portsRaw = root.ports === undefined ? {} : obj(root.ports, 'ports');
  const ports = { ...DEFAULT_PORTS } as Record<keyof Ports, number>;
  for (const [k, v] of Object.entries(portsRaw)) {
    if (!Object.hasOwn(DEFAULT_PORTS, k)) throw new InvalidArgumentError(`ports.${k}`, `is not a port of Forkfleet (${Object.keys(DEFAULT_PORTS).join(', ')})`);
    if (typeof v !== 'number' || !Number.isInteger(v) || v < 1 || v > 65535) throw new InvalidArgumentError(`ports.${k}`, 'must be an integer in [1, 65535]');
    ports[k as keyof Ports] = v;
  }
  // What each role's process binds on its address (render.ts): no two may be one port where
  // they meet, in one process or in two roles on one address, or one of them cannot listen and
  // restarts for ever. Named: the port the inventory sets (a default one only if both are).
  const binds: Array<[string, ReadonlyArray<{ address: string }>, ReadonlyArray<keyof Ports>]> = [
    ['etcd', etcd, ['etcdClient', 'etcdPeer']],
    // The cluster port only with routes to other servers (render.ts).
    ['nats', nats, nats.length > 1 ? ['natsClient', 'natsCluster', 'natsMonitor'] : ['natsClient', 'natsMonitor']],
    ['schedulers', schedulers, ['api', 'metrics']],
    ['hosts', hosts, ['peer', 'agentMetrics']],
  ];
  const bound = new Map<string, { key: keyof Ports; field: string }>();
  for (const [role, list, keys] of binds) {
    list.forEach((m, i) => {
      for (const key of keys) {
        const at = hostPort(m.address, ports[key]);
        const first = bound.get(at);
        if (!first) {
          bound.set(at, { key, field: `${role}[${i}]` });
          continue;
        }
        const [named, other] = Object.hasOwn(portsRaw, first.key) && !Object.hasOwn(portsRaw, key) ? [first.key, key] : [key, first.key];
        const who = first.field === `${role}[${i}]` ? `${first.field} listens on both` : `${first.field} and ${role}[${i}] both listen on it`;
        throw new InvalidArgumentError(`ports.${named}`, `is ${ports[key]}, as is ports.${other}, and ${who} at ${m.address}: give them different ports`);
      }
    });
  }
  return Object.freeze({ name, installDir, node, etcd, nats, schedulers, hosts, controlCidrs: cidrs as string[], ports: Object.freeze(ports) });
}

/** Whether IPv4 `addr` is in `cidr` (both checked by the parser): its prefix of that length is the CIDR's. */
function inCidr(addr: string, cidr: string): boolean {
  const c = parseCidr('controlCidrs', cidr);
  return parseCidr('controlCidrs', `${addr}/${c.len}`).base === c.base;
}

/** host:port of an inventory address (IPv4). */
export function hostPort(addr: string, port: number): string {
  return `${addr}:${port}`;
}
