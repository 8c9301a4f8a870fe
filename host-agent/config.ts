// Host-agent configuration, compiled once from options and FF_* environment variables
// into a frozen object; a bad value fails start-up naming the variable. Integers are decimal
// digits and durations as services/config.ts parses them; '' is a value, not "unset" (it is
// refused, except where a comment below says what it turns off).
import { cpus, hostname, totalmem } from 'node:os';
import { isIPv4 } from 'node:net';
import { randomUUID } from 'node:crypto';
import { InvalidArgumentError } from '../proto/errors.ts';
import { MAX_CHUNK_BYTES, MAX_TIMER_MS, natsServers, natsTls, parseDurationIn, parseHostPort, parseInteger, parseLogLevel, parseRequired, tlsClientFiles, type TlsClientFiles } from '../services/config.ts';
import type { AccelSetting } from './domain/vmm.ts';
import { parseCidr } from './adapters/netns/egress.ts';
import { DEFAULT_RAM_MOUNT } from './adapters/qemu/ram-pool.ts';

export interface AgentProcessConfig {
  /** FF_HOST_ID: this host's id (a-z, 0-9, -). */
  readonly hostId: string;
  /** FF_DATA_DIR: VMs, snapshots, chunks, journal. Keep it short (unix socket paths). */
  readonly dataDir: string;
  /** FF_NATS_URL: nats:// (or tls://) URLs of one NATS cluster, comma-separated (the client tries each). */
  readonly natsUrl: string;
  /**
   * FF_NATS_CA, FF_NATS_CERT, FF_NATS_KEY (PEM files): TLS to NATS, on with tls:// URLs or any
   * of them (services/config.ts natsTls). CA alone: the servers are verified against it; CERT
   * and KEY: a client certificate, for servers that verify clients. Undefined: plain text,
   * unless the server requires TLS.
   */
  readonly natsTls: TlsClientFiles | undefined;
  /**
   * FF_NATS_NKEY_FILE: this host's NATS user NKey seed (a file, mode 0600). Its NATS user may
   * use only this host's subjects (services/adapters/nats/auth.ts). Empty: no authentication.
   */
  readonly natsNkeyFile: string;
  /** FF_PEER_ADDR: where the ChunkTransfer service listens (host:port; port 0 picks one). */
  readonly peerAddr: string;
  /** FF_PEER_ADVERTISE: the host:port peers dial (port 1-65535); empty: the bound peer address. */
  readonly peerAdvertise: string;
  /**
   * FF_PEER_CA, FF_PEER_CERT, FF_PEER_KEY (PEM files, all three or none): mutual TLS on the
   * peer transfer service, both as its server and when fetching from other hosts
   * (adapters/peer/tls.ts). The certificate is this host's, for server and client use, naming
   * its peer address (IP SAN) and `forkfleet-host-<FF_HOST_ID>` (CN); peers must show one from
   * the same CA, and a ticket is honoured only for the host its certificate names.
   * Undefined: plain text (the caller's host id is then only what it says it is).
   */
  readonly peerTls: TlsClientFiles | undefined;
  /** FF_TRUSTED_KEY: PEM public key of the scheduler (verifies tickets and manifests). */
  readonly trustedKeyPath: string;
  /** FF_ACCEL: kvm | tcg | auto */
  readonly accel: AccelSetting;
  /** FF_CAPACITY_VCPUS / FF_CAPACITY_MEMORY_MIB / FF_CAPACITY_DISK_MIB: what the scheduler may book here. */
  readonly capacity: { vcpus: number; memoryMib: number; diskMib: number };
  /** FF_LINK_BYTES_PER_SECOND: the NIC rate peers can get from this host. */
  readonly linkBytesPerSecond: number;
  /** FF_HEARTBEAT_INTERVAL: at least 100ms. */
  readonly heartbeatMs: number;
  /** FF_STEP_CONCURRENCY: 1-64. */
  readonly concurrency: number;
  /** FF_CHUNK_BYTES: 4096 to 4 MiB (MAX_CHUNK_BYTES). */
  readonly chunkBytes: number;
  /** FF_LOG_LEVEL: a pino level (services/config.ts LOG_LEVELS). */
  readonly logLevel: string;
  /**
   * FF_METRICS_ADDR: Prometheus /metrics of this agent (host:port; port 0 picks a free one):
   * its steps, heartbeat failures and the host's state as its heartbeats report it
   * (adapters/metrics.ts). Empty (the default): not served.
   */
  readonly metricsAddr: string;
  /**
   * Sandboxes whose policy allows egress (host-agent/adapters/netns/egress.ts):
   * FF_EGRESS_POOL, link addresses (one /30 per sandbox, default 100.96.0.0/16);
   * FF_EGRESS_DENY_CIDRS, comma-separated CIDRs no sandbox may reach whatever its policy:
   * set it to the fleet's control-plane networks (etcd, NATS, schedulers, agents' peer ports
   * on other machines). The agent's own namespace is always refused.
   */
  readonly egress: { pool: string; denyCidrs: string[] };
  /** FF_GC_INTERVAL: how often the chunk store is garbage-collected (also after every snapshot delete); at least 1s, or 0s: only after deletes. */
  readonly gcIntervalMs: number;
  /**
   * FF_JOURNAL_RETENTION: step results (the idempotency journal) of ops last written longer
   * ago than this are deleted (default 48h: twice the work stream's 24 h message age, past any
   * redelivery; 0 keeps them forever; else at least 24h: a step redelivered after its result
   * was pruned would run again).
   */
  readonly journalRetentionMs: number;
  /**
   * Standby QEMUs (ADR 0014): FF_STANDBY_MAX on this host in all (0 turns them off),
   * FF_STANDBY_PER_SNAPSHOT kept for a snapshot after a fork of it (at most the fork's size),
   * FF_STANDBY_IDLE: a snapshot's standbys go when it was not forked for this long (at least 1s),
   * FF_INCOMING_STANDBY_QUIET: a VM migrated in is followed by a waiting destination QEMU of
   * its configuration once none has arrived for this long (ADR 0015; 0: at once).
   */
  readonly standby: Readonly<{ max: number; perSnapshot: number; idleMs: number; incomingQuietMs: number }>;
  /** FF_GC_GRACE: unreferenced chunks younger than this survive a GC (at least 1s: chunks being written are unreferenced). */
  readonly gcGraceMs: number;
  /**
   * FF_MIGRATE_MAX_CHILDREN: a restore of at most this many VMs of a snapshot held elsewhere
   * migrates them from a source instead of fetching the snapshot (ADR 0015); 0 turns it off.
   */
  readonly migrateMaxChildren: number;
  /**
   * FF_SHUTDOWN_GRACE: on SIGTERM, how long (from the signal) the agent waits for its work
   * consumer to stop and the steps still running to finish (their results sent) before it
   * exits; a step left is delivered again to the next agent. Under the 30 s systemd allows
   * (TimeoutStopSec), with room for the rest of shutdown.
   */
  readonly shutdownGraceMs: number;
  /**
   * FF_PEER_MIGRATION_TLS (on|relay|qemu|off, default on): with peer TLS (FF_PEER_*), how
   * migration streams are encrypted (ADR 0015, "TLS relays"):
   * - relay: QEMU streams plain text to a unix socket and a socat process per stream carries it
   *   over mutual TLS (OpenSSL); each end checks the other's certificate names the host it
   *   expects. Needs socat; the agent refuses to start without it.
   * - qemu: QEMU's own TLS channel (GnuTLS). It sends each guest page as a TLS record of its own:
   *   on this TCG machine a 140 MB stream took ~1.9x as long as a plain one.
   * - on: relay when socat is installed, else qemu.
   * - off: plain text, for a peer network that is private or encrypted below (WireGuard).
   * relay and qemu speak the same TLS with the same certificates, so hosts can move from one to
   * the other one at a time; off and the others cannot migrate to each other (such restores
   * fetch the snapshot instead). Without peer TLS it changes nothing.
   */
  readonly peerMigrationTls: 'on' | 'relay' | 'qemu' | 'off';
  /**
   * Guest RAM of migrated VMs (ADR 0016): FF_RAM_MOUNT, a tmpfs with huge=always (mounted there
   * when nothing is; empty: off, anonymous RAM); FF_RAM_POOL, free files kept, all sizes;
   * FF_RAM_POOL_MAX_MIB, their total size at most; FF_RAM_POOL_MIB, comma-separated guest
   * sizes (MiB) filled at start, before any restore.
   */
  readonly ram: Readonly<{ mount: string; keep: number; maxMib: number; prefillMib: readonly number[] }> | undefined;
  /**
   * Guest CPU isolation (adapters/qemu/cgroup.ts, ADR 0018): FF_GUEST_CGROUP, the cgroup every
   * QEMU joins, a path below the cgroup root (v2) or the cpu controller (v1); unset:
   * "forkfleet-guests", skipped with a warning where the host has no usable cgroup; set: it must
   * work or the agent does not start; empty: off. FF_GUEST_CPU_WEIGHT, the group's weight on
   * cgroup v2's scale (1-10000; 100, the default, weighs as much as one ordinary process).
   */
  readonly guestCgroup: Readonly<{ path: string; cpuWeight: number; required: boolean }> | undefined;
  readonly bootId: string;
}

/** The cgroup guests join when FF_GUEST_CGROUP is unset. */
export const DEFAULT_GUEST_CGROUP = 'forkfleet-guests';

/** FF_PEER_CA, FF_PEER_CERT and FF_PEER_KEY: all three (mutual TLS) or none (plain text). */
function peerTls(env: NodeJS.ProcessEnv): TlsClientFiles | undefined {
  const files = tlsClientFiles('FF_PEER', env);
  if (files && !files.ca) throw new InvalidArgumentError('FF_PEER_CA', 'is required with FF_PEER_CERT: peers are verified against this CA (mutual TLS)');
  if (files && !files.cert) throw new InvalidArgumentError('FF_PEER_CERT', 'is required with FF_PEER_CA: this host shows its certificate to peers (mutual TLS)');
  return files;
}

function migrationTls(v: string): AgentProcessConfig['peerMigrationTls'] {
  if (v === 'on' || v === 'relay' || v === 'qemu' || v === 'off') return v;
  throw new InvalidArgumentError('FF_PEER_MIGRATION_TLS', `must be on, relay, qemu or off, got ${JSON.stringify(v)}`);
}

export function compileAgentConfig(env: NodeJS.ProcessEnv = process.env): AgentProcessConfig {
  const e = (name: string, dflt: string): string => env[name] ?? dflt;
  // An integer setting (parseInteger: decimal digits, '' refused) or a duration (parseDurationIn).
  const int = (name: string, dflt: string, min: number, max: number): number => parseInteger(name, e(name, dflt), min, max);
  const duration = (name: string, dflt: string, bounds: Parameters<typeof parseDurationIn>[2]): number => parseDurationIn(name, e(name, dflt), bounds);
  const hostId = e('FF_HOST_ID', hostname().toLowerCase().replace(/[^a-z0-9-]/g, '-'));
  if (!/^[a-z0-9][a-z0-9-]{0,62}$/.test(hostId)) throw new InvalidArgumentError('FF_HOST_ID', 'must be 1-63 characters of a-z, 0-9 and -');
  // The API tells ids apart by their prefix (ListOperations' target_id): a host is never named like a sandbox, snapshot or operation.
  if (/^(sb|sn|op)-/.test(hostId)) throw new InvalidArgumentError('FF_HOST_ID', `must not start with sb-, sn- or op- (the prefixes of sandbox, snapshot and operation ids), got ${JSON.stringify(hostId)}`);
  const accel = e('FF_ACCEL', 'auto');
  if (accel !== 'kvm' && accel !== 'tcg' && accel !== 'auto') throw new InvalidArgumentError('FF_ACCEL', 'must be kvm, tcg or auto');
  const peerAddr = parseHostPort('FF_PEER_ADDR', e('FF_PEER_ADDR', '127.0.0.1:0'), true);
  const peerAdvertise = e('FF_PEER_ADVERTISE', '');
  if (peerAdvertise) parseHostPort('FF_PEER_ADVERTISE', peerAdvertise, false);
  const natsUrls = natsServers('FF_NATS_URL', e('FF_NATS_URL', 'nats://127.0.0.1:4222'));
  const guestPath = e('FF_GUEST_CGROUP', DEFAULT_GUEST_CGROUP);
  // Checked whether or not the RAM pool and guest cgroup are on: a bad value is a mistake either way.
  const ramMount = e('FF_RAM_MOUNT', DEFAULT_RAM_MOUNT);
  const ramPool = {
    keep: int('FF_RAM_POOL', '2', 0, 64),
    maxMib: int('FF_RAM_POOL_MAX_MIB', '2048', 0, 1 << 30),
    // '' fills none; an empty item ('256,,512') is a mistake, not skipped.
    prefillMib: e('FF_RAM_POOL_MIB', '') === '' ? [] : e('FF_RAM_POOL_MIB', '').split(',').map((x) => parseInteger('FF_RAM_POOL_MIB', x.trim(), 64, 1 << 20)),
  };
  const cpuWeight = int('FF_GUEST_CPU_WEIGHT', '100', 1, 10_000);
  const cfg: AgentProcessConfig = {
    hostId,
    dataDir: parseRequired('FF_DATA_DIR', e('FF_DATA_DIR', '/var/lib/forkfleet'), 'must name the directory of VMs, snapshots, chunks and the journal'),
    natsUrl: e('FF_NATS_URL', 'nats://127.0.0.1:4222'),
    natsTls: natsTls(natsUrls, env),
    peerTls: peerTls(env),
    natsNkeyFile: e('FF_NATS_NKEY_FILE', ''),
    peerAddr,
    peerAdvertise,
    trustedKeyPath: e('FF_TRUSTED_KEY', ''),
    accel,
    capacity: {
      vcpus: int('FF_CAPACITY_VCPUS', String(cpus().length * 16), 1, 100_000),
      memoryMib: int('FF_CAPACITY_MEMORY_MIB', String(Math.floor((totalmem() / 1048576) * 0.8)), 64, 1 << 30),
      diskMib: int('FF_CAPACITY_DISK_MIB', String(100 * 1024), 1, 1 << 30),
    },
    linkBytesPerSecond: int('FF_LINK_BYTES_PER_SECOND', String(1.25e9), 1, 1e12),
    // 0 (or a few ms) would heartbeat about every millisecond: setInterval runs 0 as 1 ms.
    heartbeatMs: duration('FF_HEARTBEAT_INTERVAL', '1s', { min: 100, max: MAX_TIMER_MS }),
    concurrency: int('FF_STEP_CONCURRENCY', '4', 1, 64),
    chunkBytes: int('FF_CHUNK_BYTES', String(256 * 1024), 4096, MAX_CHUNK_BYTES),
    logLevel: parseLogLevel('FF_LOG_LEVEL', e('FF_LOG_LEVEL', 'info')),
    metricsAddr: e('FF_METRICS_ADDR', '') === '' ? '' : parseHostPort('FF_METRICS_ADDR', e('FF_METRICS_ADDR', ''), true),
    egress: {
      pool: e('FF_EGRESS_POOL', '100.96.0.0/16'),
      denyCidrs: e('FF_EGRESS_DENY_CIDRS', '').split(',').map((x) => x.trim()).filter(Boolean),
    },
    gcIntervalMs: duration('FF_GC_INTERVAL', '5m', { min: 1000, max: MAX_TIMER_MS, zero: 'never: only after snapshot deletes' }),
    journalRetentionMs: duration('FF_JOURNAL_RETENTION', '48h', { min: 24 * 3_600_000, zero: 'keep forever' }),
    gcGraceMs: duration('FF_GC_GRACE', '60s', { min: 1000 }),
    standby: {
      max: int('FF_STANDBY_MAX', '8', 0, 1024),
      perSnapshot: int('FF_STANDBY_PER_SNAPSHOT', '2', 0, 1024),
      idleMs: duration('FF_STANDBY_IDLE', '10m', { min: 1000 }),
      incomingQuietMs: duration('FF_INCOMING_STANDBY_QUIET', '3s', { min: 0, max: MAX_TIMER_MS }),
    },
    migrateMaxChildren: int('FF_MIGRATE_MAX_CHILDREN', '2', 0, 64),
    shutdownGraceMs: duration('FF_SHUTDOWN_GRACE', '20s', { min: 0, max: MAX_TIMER_MS }),
    peerMigrationTls: migrationTls(e('FF_PEER_MIGRATION_TLS', 'on')),
    ram: ramMount ? { mount: ramMount, ...ramPool } : undefined,
    guestCgroup: guestPath ? { path: guestPath, cpuWeight, required: env.FF_GUEST_CGROUP !== undefined } : undefined,
    bootId: randomUUID(),
  };
  const cg = cfg.guestCgroup?.path.replace(/^\//, '');
  if (cg !== undefined && (!/^[A-Za-z0-9_.@-]+(\/[A-Za-z0-9_.@-]+)*$/.test(cg) || cg.split('/').some((p) => p === '.' || p === '..'))) {
    throw new InvalidArgumentError('FF_GUEST_CGROUP', 'must be a cgroup path below the root such as forkfleet-guests, or empty to turn guest isolation off');
  }
  if (parseCidr('FF_EGRESS_POOL', cfg.egress.pool).len > 28) throw new InvalidArgumentError('FF_EGRESS_POOL', 'must be /28 or larger (one /30 per sandbox allowed egress)');
  for (const c of cfg.egress.denyCidrs) parseCidr('FF_EGRESS_DENY_CIDRS', c);
  if (cfg.ram && !cfg.ram.mount.startsWith('/')) throw new InvalidArgumentError('FF_RAM_MOUNT', 'must be an absolute path, or empty to turn the RAM pool off');
  parseRequired('FF_TRUSTED_KEY', cfg.trustedKeyPath, "must name the scheduler's public key (PEM)");
  return Object.freeze(cfg);
}

/**
 * What no sandbox may reach whatever its policy: FF_EGRESS_DENY_CIDRS, plus the NATS servers
 * this agent uses (by IPv4 address), which the agent knows whether or not the operator listed
 * their network. etcd, the schedulers and other hosts' peer ports are not known here: only
 * FF_EGRESS_DENY_CIDRS keeps sandboxes from them (main.ts warns when it is empty).
 */
export function sandboxDenyCidrs(cfg: Pick<AgentProcessConfig, 'natsUrl' | 'egress'>): string[] {
  const nats = cfg.natsUrl
    .split(',')
    .map((u) => {
      try {
        return new URL(u.trim()).hostname;
      } catch {
        return '';
      }
    })
    .filter((h) => isIPv4(h))
    .map((h) => `${h}/32`);
  return [...new Set([...cfg.egress.denyCidrs, ...nats])];
}
