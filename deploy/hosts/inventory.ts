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
// directory per machine with everything that machine needs.
import { isIP } from 'node:net';
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

function unique<T>(items: readonly T[], key: (t: T) => string, field: string): void {
  const seen = new Set<string>();
  items.forEach((t, i) => {
    const k = key(t);
    if (seen.has(k)) throw new InvalidArgumentError(`${field}[${i}]`, `${JSON.stringify(k)} appears twice`);
    seen.add(k);
  });
}

function member(o: Json, field: string): Member {
  const name = str(o, 'name', field, NAME, 'must be 1-63 characters of a-z, 0-9 and -');
  const addr = address(o, field);
  const machine = o.machine === undefined ? addr : str(o, 'machine', field, DNS, 'must be a host name');
  return { name, address: addr, machine };
}

/** Parses an inventory (the JSON's value). Throws InvalidArgumentError naming the field. */
export function parseInventory(raw: unknown): Inventory {
  const root = obj(raw, 'inventory');
  const name = str(root, 'name', '', NAME, 'must be 1-63 characters of a-z, 0-9 and -');
  const installDir = root.installDir === undefined ? '/opt/forkfleet' : str(root, 'installDir', '', /^\/[^\s"'$\\]*$/, 'must be an absolute path without spaces or quotes');
  const node = root.node === undefined ? '/usr/bin/node' : str(root, 'node', '', /^\/[^\s"'$\\]*$/, 'must be an absolute path without spaces or quotes');
  const etcd = list(root, 'etcd', 1).map((o, i) => member(o, `etcd[${i}]`));
  if (![1, 3, 5, 7].includes(etcd.length)) throw new InvalidArgumentError('etcd', `needs 1, 3, 5 or 7 members (an odd number keeps a quorum), got ${etcd.length}`);
  const nats = list(root, 'nats', 1).map((o, i) => member(o, `nats[${i}]`));
  if (nats.length === 2) throw new InvalidArgumentError('nats', 'needs 1 server, or 3 or more (JetStream replicates over a majority)');
  const schedulers = list(root, 'schedulers', 1).map((o, i): SchedulerEntry => {
    const m = member(o, `schedulers[${i}]`);
    const dnsRaw = o.dns ?? [];
    if (!Array.isArray(dnsRaw) || dnsRaw.some((d) => typeof d !== 'string' || !DNS.test(d))) throw new InvalidArgumentError(`schedulers[${i}].dns`, 'must be a list of DNS names');
    return { ...m, dns: dnsRaw as string[] };
  });
  const hosts = list(root, 'hosts', 1).map((o, i): HostEntry => {
    const field = `hosts[${i}]`;
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
  unique(etcd, (m) => m.address, 'etcd');
  unique(nats, (m) => m.name, 'nats');
  unique(nats, (m) => m.address, 'nats');
  unique(schedulers, (m) => m.name, 'schedulers');
  unique(schedulers, (m) => m.address, 'schedulers');
  unique(hosts, (h) => h.id, 'hosts');
  // One of each role per machine: each role is one systemd unit and one set of files there.
  unique(etcd, (m) => m.machine, 'etcd');
  unique(nats, (m) => m.machine, 'nats');
  unique(schedulers, (m) => m.machine, 'schedulers');
  unique(hosts, (h) => h.machine, 'hosts');
  const cidrs = root.controlCidrs ?? [];
  if (!Array.isArray(cidrs) || cidrs.some((c) => typeof c !== 'string' || !/^(\d{1,3}\.){3}\d{1,3}\/\d{1,2}$/.test(c) || isIP(c.split('/')[0]!) !== 4 || Number(c.split('/')[1]) > 32)) throw new InvalidArgumentError('controlCidrs', 'must be a list of IPv4 CIDRs such as 10.0.0.0/24');
  // Every address of the control plane must be in them: a sandbox allowed egress on one host
  // could otherwise reach etcd, NATS, a scheduler or another host's peer port.
  if (cidrs.length === 0) throw new InvalidArgumentError('controlCidrs', 'required: the networks of every address here, which no sandbox allowed egress may reach (FF_EGRESS_DENY_CIDRS)');
  const within = (addr: string): boolean => (cidrs as string[]).some((c) => inCidr(addr, c));
  const roles: Array<[string, ReadonlyArray<{ address: string }>]> = [['etcd', etcd], ['nats', nats], ['schedulers', schedulers], ['hosts', hosts]];
  for (const [role, list] of roles) {
    list.forEach((m, i) => {
      if (!within(m.address)) throw new InvalidArgumentError(`${role}[${i}].address`, `${m.address} is in none of controlCidrs (${(cidrs as string[]).join(', ')}): a sandbox allowed egress could reach it`);
    });
  }
  const portsRaw = root.ports === undefined ? {} : obj(root.ports, 'ports');
  const ports = { ...DEFAULT_PORTS } as Record<keyof Ports, number>;
  for (const [k, v] of Object.entries(portsRaw)) {
    if (!(k in DEFAULT_PORTS)) throw new InvalidArgumentError(`ports.${k}`, `is not a port of Forkfleet (${Object.keys(DEFAULT_PORTS).join(', ')})`);
    if (typeof v !== 'number' || !Number.isInteger(v) || v < 1 || v > 65535) throw new InvalidArgumentError(`ports.${k}`, 'must be an integer in [1, 65535]');
    ports[k as keyof Ports] = v;
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
