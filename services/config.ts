// Scheduler configuration, compiled once at start-up from options and environment
// variables into a frozen object (CONVENTIONS.md §6). A bad value fails start-up with the
// variable's name and the reason. Integers are decimal digits (parseInteger), durations
// parseDuration's (with a minimum each, parseDurationIn), addresses host:port; '' is a value,
// not "unset": refused, except where a setting's comment says what it turns off.
import { hostname } from 'node:os';
import { readFileSync } from 'node:fs';
import { InvalidArgumentError } from '../proto/errors.ts';
import { parseWebhookTargets } from './domain/webhooks.ts';
import type { WebhookTarget } from './domain/webhooks.ts';

const UNITS: Record<string, number> = { ms: 1, s: 1000, m: 60_000, h: 3_600_000 };

/** `on` or `off` (absent: `dflt`); anything else fails naming `field`. */
export function parseOnOff(field: string, v: string | undefined, dflt: boolean): boolean {
  if (v === undefined) return dflt;
  if (v !== 'on' && v !== 'off') throw new InvalidArgumentError(field, `on or off, got ${JSON.stringify(v)}`);
  return v === 'on';
}

/**
 * Parses '250ms', '10s', '1.5m', '1h' (or a bare number of milliseconds), exactly as written:
 * no surrounding spaces, and '' is refused (not 0).
 */
export function parseDuration(field: string, v: string): number {
  const m = /^(\d+(?:\.\d+)?)(ms|s|m|h)?$/.exec(v);
  const ms = m ? Math.round(Number(m[1]) * (UNITS[m[2] ?? 'ms'] ?? 1)) : NaN;
  if (!Number.isSafeInteger(ms)) throw new InvalidArgumentError(field, `must be a duration such as '500ms', '10s' or '5m', got ${JSON.stringify(v)}`);
  return ms;
}

/**
 * The largest FF_CHUNK_BYTES (agents and scheduler). A chunk travels host to host as one gRPC
 * message, which a peer accepts up to 16 MiB (peer/client.ts; an incompressible chunk is stored
 * and sent whole), and a source reads up to 16 chunks ahead per stream: 4 MiB keeps both well
 * inside (64 MiB chunks could never be fetched, and held 1 GiB per stream).
 */
export const MAX_CHUNK_BYTES = 4 << 20;

/**
 * The longest delay Node.js timers take (2^31-1 ms, about 24.8 days): setTimeout and
 * setInterval run a longer one after 1 ms. The bound of every duration that sets a timer.
 */
export const MAX_TIMER_MS = 2 ** 31 - 1;

/** '1s', '100ms', '5m': `ms` as a duration setting is written. */
function formatMs(ms: number): string {
  if (ms === MAX_TIMER_MS) return `${ms}ms (about 24.8 days, the longest timer Node.js runs)`;
  if (ms > 0 && ms % 3_600_000 === 0) return `${ms / 3_600_000}h`;
  if (ms > 0 && ms % 60_000 === 0) return `${ms / 60_000}m`;
  if (ms > 0 && ms % 1000 === 0) return `${ms / 1000}s`;
  return `${ms}ms`;
}

/** The values a duration setting may take. */
export interface DurationBounds {
  /** The shortest, in milliseconds (0 aside: see `zero`). */
  readonly min: number;
  /** The longest, in milliseconds (default: no bound); MAX_TIMER_MS for one that sets a timer. */
  readonly max?: number;
  /** Set when 0 is accepted as well, below `min`: what it means ('never', 'keep forever'). */
  readonly zero?: string;
}

/** A duration setting (parseDuration) within `bounds`; anything else fails naming `field`. */
export function parseDurationIn(field: string, v: string, bounds: DurationBounds): number {
  const ms = parseDuration(field, v);
  if (ms === 0 && bounds.zero !== undefined) return 0;
  if (ms < bounds.min) throw new InvalidArgumentError(field, `must be ${bounds.zero !== undefined ? `0s (${bounds.zero}) or ` : ''}at least ${formatMs(bounds.min)}, got ${JSON.stringify(v)}`);
  if (bounds.max !== undefined && ms > bounds.max) throw new InvalidArgumentError(field, `must be at most ${formatMs(bounds.max)}, got ${JSON.stringify(v)}`);
  return ms;
}

/**
 * An integer setting in [min, max], written as plain decimal digits: '', ' 5', '0x10', '1e3',
 * '+5' and '5.0' are refused (Number() would make '' and ' ' 0, which turns many settings off).
 */
export function parseInteger(field: string, v: string, min: number, max: number = Number.MAX_SAFE_INTEGER): number {
  const n = /^\d+$/.test(v) ? Number(v) : NaN;
  if (!Number.isSafeInteger(n) || n < min || n > max) {
    throw new InvalidArgumentError(field, `must be an integer ${max === Number.MAX_SAFE_INTEGER ? `>= ${min}` : `in [${min}, ${max}]`} (decimal digits), got ${JSON.stringify(v)}`);
  }
  return n;
}

/** A non-negative decimal number setting ('200', '0.5'), plain digits as parseInteger; at least `min`. */
export function parseDecimal(field: string, v: string, min: number): number {
  const n = /^\d+(?:\.\d+)?$/.test(v) ? Number(v) : NaN;
  if (!Number.isFinite(n) || n < min) throw new InvalidArgumentError(field, `must be a number >= ${min} such as '200' or '0.5', got ${JSON.stringify(v)}`);
  return n;
}

/**
 * A host:port setting: the host an IPv4 address or a name (no spaces or colons, as
 * deploy/hosts/inventory.ts renders them), the port decimal in [0, 65535], or in [1, 65535]
 * unless `portZero` (where 0 asks the OS for a free port when listening).
 */
export function parseHostPort(field: string, v: string, portZero: boolean): string {
  const m = /^[^\s:]+:(\d{1,5})$/.exec(v);
  const port = m ? Number(m[1]) : NaN;
  const lo = portZero ? 0 : 1;
  if (!(port >= lo && port <= 65535)) throw new InvalidArgumentError(field, `must be host:port with a port in [${lo}, 65535]${portZero ? ' (0: any free port)' : ''}, got ${JSON.stringify(v)}`);
  return v;
}

/** pino's levels, for FF_LOG_LEVEL (pino refuses any other, with an error naming no variable). */
export const LOG_LEVELS = ['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent'] as const;

/** A FF_LOG_LEVEL value: one of LOG_LEVELS, lower case as pino takes it. */
export function parseLogLevel(field: string, v: string): (typeof LOG_LEVELS)[number] {
  const level = LOG_LEVELS.find((l) => l === v);
  if (level === undefined) throw new InvalidArgumentError(field, `must be one of ${LOG_LEVELS.join(', ')}, got ${JSON.stringify(v)}`);
  return level;
}

/** A setting that must name something: '' and spaces alone fail naming `field` (`what`: why it is needed). */
export function parseRequired(field: string, v: string, what: string): string {
  if (v.trim() === '') throw new InvalidArgumentError(field, what);
  return v;
}

const SIZE_UNITS: Record<string, number> = { '': 1, b: 1, kib: 1024, mib: 1024 ** 2, gib: 1024 ** 3 };

/**
 * The servers of FF_NATS_URL: one nats:// or tls:// URL or several, comma-separated (the
 * servers of one cluster). Throws InvalidArgumentError naming `field` otherwise.
 */
export function natsServers(field: string, v: string): string[] {
  const urls = v.split(',').map((u) => u.trim());
  if (!urls.every((u) => /^(nats|tls):\/\/\S+$/.test(u))) throw new InvalidArgumentError(field, 'must be a nats:// or tls:// URL, or several separated by commas (servers of one cluster)');
  return urls;
}

/**
 * A TLS client's PEM files: <prefix>_CA, the CA the servers' certificates chain to ('': the
 * system roots); <prefix>_CERT and <prefix>_KEY, a client certificate (chain) and its private
 * key, both set or both ''.
 */
export interface TlsClientFiles {
  /** Which variables name the files (FF_ETCD_CA, ... or FF_NATS_CA, ...). */
  readonly prefix: 'FF_ETCD' | 'FF_NATS' | 'FF_PEER';
  readonly ca: string;
  readonly cert: string;
  readonly key: string;
}

/** <prefix>_CA, _CERT and _KEY from `env`; undefined when none is set. */
export function tlsClientFiles(prefix: TlsClientFiles['prefix'], env: NodeJS.ProcessEnv): TlsClientFiles | undefined {
  const ca = env[`${prefix}_CA`] ?? '';
  const cert = env[`${prefix}_CERT`] ?? '';
  const key = env[`${prefix}_KEY`] ?? '';
  if (cert && !key) throw new InvalidArgumentError(`${prefix}_KEY`, `is required with ${prefix}_CERT (the client certificate's private key, PEM)`);
  if (key && !cert) throw new InvalidArgumentError(`${prefix}_CERT`, `is required with ${prefix}_KEY (the client certificate, PEM)`);
  return ca || cert ? Object.freeze({ prefix, ca, cert, key }) : undefined;
}

/**
 * TLS to etcd: on with https:// endpoints (verified against the system roots unless FF_ETCD_CA
 * is set) or with FF_ETCD_CA / FF_ETCD_CERT + FF_ETCD_KEY; undefined: plain text. An http://
 * endpoint with TLS files set is a mistake, and so is a list mixing http:// and https://.
 */
export function etcdTls(endpoints: readonly string[], env: NodeJS.ProcessEnv): TlsClientFiles | undefined {
  const files = tlsClientFiles('FF_ETCD', env);
  const https = endpoints.some((u) => /^https:\/\//i.test(u));
  const http = endpoints.some((u) => /^http:\/\//i.test(u));
  if (https && http) throw new InvalidArgumentError('FF_ETCD_ENDPOINTS', 'mixes http:// and https:// endpoints: the members of one cluster speak one or the other');
  if (files && http) throw new InvalidArgumentError('FF_ETCD_ENDPOINTS', `is http:// (plain text) while ${files.cert ? 'FF_ETCD_CERT' : 'FF_ETCD_CA'} is set: use https:// endpoints`);
  return files ?? (https ? Object.freeze({ prefix: 'FF_ETCD', ca: '', cert: '', key: '' } as const) : undefined);
}

/** FF_ETCD_SERVER_NAME (SchedulerConfig.etcdServerName): a DNS name, and only with TLS to etcd. */
function etcdServerName(endpoints: readonly string[], env: NodeJS.ProcessEnv): string {
  const name = env.FF_ETCD_SERVER_NAME ?? '';
  if (!name) return '';
  if (!/^(?=.{1,253}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*$/i.test(name)) throw new InvalidArgumentError('FF_ETCD_SERVER_NAME', `must be a DNS name, got ${JSON.stringify(name)}`);
  if (!etcdTls(endpoints, env)) throw new InvalidArgumentError('FF_ETCD_SERVER_NAME', 'is a TLS setting, but etcd is spoken to in plain text: use https:// endpoints');
  return name;
}

/**
 * TLS to NATS: on with tls:// URLs in FF_NATS_URL (verified against the system roots unless
 * FF_NATS_CA is set) or with FF_NATS_CA / FF_NATS_CERT + FF_NATS_KEY; the client then refuses a
 * server that does not speak TLS. Undefined: as the server asks (nats.js upgrades when a server
 * requires TLS, and verifies it against the system roots).
 */
export function natsTls(urls: readonly string[], env: NodeJS.ProcessEnv): TlsClientFiles | undefined {
  return tlsClientFiles('FF_NATS', env) ?? (urls.some((u) => u.startsWith('tls://')) ? Object.freeze({ prefix: 'FF_NATS', ca: '', cert: '', key: '' } as const) : undefined);
}

/** The PEM contents of a TLS client's files, read once at start-up. */
export interface TlsClientPem {
  /** Undefined: the system roots. */
  readonly ca: Buffer | undefined;
  /** Undefined (with `key`): no client certificate. */
  readonly cert: Buffer | undefined;
  readonly key: Buffer | undefined;
}

/** Reads `files`; one that cannot be read fails naming its variable. */
export function readTlsClientFiles(files: TlsClientFiles): TlsClientPem {
  const read = (suffix: 'CA' | 'CERT' | 'KEY', path: string): Buffer | undefined => {
    if (!path) return undefined;
    try {
      return readFileSync(path);
    } catch (e) {
      throw new InvalidArgumentError(`${files.prefix}_${suffix}`, `cannot read ${path}: ${(e as Error).message}`, { cause: e });
    }
  };
  return { ca: read('CA', files.ca), cert: read('CERT', files.cert), key: read('KEY', files.key) };
}

/** Parses '4MiB', '512KiB' or a bare number of bytes (no surrounding spaces; '' is refused). */
export function parseBytes(field: string, v: string): number {
  const m = /^(\d+)\s*(b|kib|mib|gib)?$/i.exec(v);
  const n = m ? Number(m[1]) * (SIZE_UNITS[(m[2] ?? '').toLowerCase()] ?? 1) : NaN;
  if (!Number.isSafeInteger(n)) throw new InvalidArgumentError(field, `must be a size such as '4MiB' or a number of bytes, got ${JSON.stringify(v)}`);
  return n;
}

export interface SchedulerConfig {
  /** FF_SCHEDULER_ID: this replica's name in the leader election. */
  readonly id: string;
  /** FF_GRPC_ADDR: where the Fleet API listens (host:port; port 0 picks a free one). */
  readonly grpcAddr: string;
  /** FF_ETCD_ENDPOINTS: comma-separated etcd client URLs (http://, or https:// for TLS). */
  readonly etcdEndpoints: readonly string[];
  /**
   * FF_ETCD_CA, FF_ETCD_CERT, FF_ETCD_KEY (PEM files): TLS to etcd (etcdTls). CA alone: the
   * members' certificates are verified against it; CERT and KEY: the client certificate a
   * member with client-certificate authentication asks for. Undefined: plain text.
   */
  readonly etcdTls: TlsClientFiles | undefined;
  /**
   * FF_ETCD_SERVER_NAME: with TLS, the DNS name the members' certificates are checked against
   * and the one sent as the TLS server name, instead of the endpoint's host. For endpoints
   * that are IP addresses (Node warns, DEP0123, when an IP is the server name);
   * deploy/hosts issues the members' certificates with `etcd.forkfleet` and sets it. '': the
   * endpoint's host.
   */
  readonly etcdServerName: string;
  /** FF_NATS_URL: nats:// (or tls://) URLs of one NATS cluster, comma-separated (the client tries each). */
  readonly natsUrl: string;
  /** FF_NATS_CA, FF_NATS_CERT, FF_NATS_KEY (PEM files): TLS to NATS, as etcdTls (natsTls). */
  readonly natsTls: TlsClientFiles | undefined;
  /**
   * FF_NATS_STREAM_REPLICAS: copies of each JetStream stream (work, results, events), 1-5. Set
   * it to 3 with a NATS cluster of 3 or more servers so that losing one loses no work; an
   * existing stream with fewer is grown to it.
   */
  readonly natsStreamReplicas: number;
  /** FF_NATS_NKEY_FILE: the scheduler's NATS NKey seed (a NATS server with authorization needs it); empty: none. */
  readonly natsNkeyFile: string;
  /** FF_HOST_SUSPECT_AFTER: heartbeat age that makes a host suspect (at least 1s). */
  readonly suspectAfterMs: number;
  /** FF_HOST_LOST_AFTER: heartbeat age that makes a host lost (longer than FF_HOST_SUSPECT_AFTER). */
  readonly lostAfterMs: number;
  /** FF_STEP_TIMEOUT: how long one host step may run before it is re-sent (at least 1s); each send's HostWork.deadline is a little before it. */
  readonly stepTimeoutMs: number;
  /** FF_STEP_ATTEMPTS: 1-20. */
  readonly stepAttempts: number;
  /**
   * FF_STRAY_VM_GRACE: a VM that a host reports and no sandbox record places there (its
   * sandbox lives elsewhere, is destroyed, failed, hibernated or gone) is stopped once it has
   * been so this long. 0: derived, 2 x FF_STEP_TIMEOUT x FF_STEP_ATTEMPTS + 60 s (19 min
   * with the defaults: the only steps that make a VM before its record says so, a
   * migration's restore and pause, are over by then).
   */
  readonly strayVmGraceMs: number;
  /** FF_SIGNING_KEY: PEM file with the Ed25519 key that signs tickets and manifests; generated when missing. */
  readonly signingKeyPath: string;
  /** FF_METRICS_ADDR: Prometheus /metrics (host:port; port 0 picks a free one); empty disables. */
  readonly metricsAddr: string;
  /**
   * FF_METRICS_TOKEN_FILE: a file holding the bearer token /metrics requires; read again when
   * it changes. Empty: /metrics is open (services/metrics-access.ts).
   */
  readonly metricsTokenFile: string;
  /** FF_LOG_LEVEL: a pino level (LOG_LEVELS). */
  readonly logLevel: string;
  /** FF_CHUNK_BYTES: chunk size of the snapshot store (for transfer estimates), 4096 to MAX_CHUNK_BYTES as the agents'. */
  readonly chunkBytes: number;
  /**
   * FF_MIGRATE_MAX_CHILDREN: in a small fork spread, a host with at most this many children
   * restores them by migration (ADR 0015); set it to the agents' value. 0: never.
   */
  readonly migrateMaxChildren: number;
  /**
   * FF_ELECTION_TTL: lease TTL of the leader election, whole seconds. A killed leader's
   * lease lapses after about this long and a standby takes over (measured: ~1.2-2 s with
   * '1s'). Shorter is faster failover; the leader must keep its lease alive, so an event
   * loop stalled longer than this makes it step down.
   */
  readonly electionTtlSeconds: number;
  /** FF_TLS_CERT: PEM certificate (chain) the Fleet API serves. Required: the API speaks TLS only. */
  readonly tlsCertPath: string;
  /** FF_TLS_KEY: PEM private key of FF_TLS_CERT. Required. */
  readonly tlsKeyPath: string;
  /** FF_TLS_CA: PEM of the CA that signed FF_TLS_CERT; the scheduler's own clients (the dashboard) trust it. Empty: what any client trusts (FF_CA, FF_CREDENTIALS, <FF_FLEET_DIR>/credentials.json, else the system roots). */
  readonly tlsCaPath: string;
  /** FF_TOKENS_FILE: per-tenant bearer tokens, hashed (services/auth/tokens.ts). Required. */
  readonly tokensFile: string;
  /** FF_GRPC_MAX_RECV: largest request message the API accepts ('4MiB'). */
  readonly maxRecvBytes: number;
  /** FF_GRPC_MAX_SEND: largest response message the API sends ('16MiB'). */
  readonly maxSendBytes: number;
  /** FF_MAX_STREAMS_PER_CREDENTIAL: concurrent streaming calls (exec, files, watch) per credential, at least 1. */
  readonly maxStreamsPerCredential: number;
  /** FF_MAX_WATCHES_PER_CREDENTIAL: WatchEvents streams open at once per credential (within the streams above), at least 1. */
  readonly maxWatchesPerCredential: number;
  /** FF_FILE_BUFFER_MAX: file bytes (WriteFile uploads, ReadFile answers) this replica holds at once, all callers together ('512MiB'). */
  readonly fileBufferBytes: number;
  /** FF_RATE_PER_S: default per-tenant request rate (a tenant's `rate` in the tokens file overrides it), a decimal number such as 0.5; 0 disables ('' is refused). */
  readonly ratePerSecond: number;
  /** FF_RATE_BURST: default per-tenant burst, at least 1. */
  readonly rateBurst: number;
  /** FF_SNAPSHOT_EXPIRY_NOTICE: how long before a retention deletion SNAPSHOT_EXPIRING is announced; at least 1s, or 0s: no notice. */
  readonly expiryNoticeMs: number;
  /** FF_WEBHOOKS: JSON `[{url, secret, tenant?, types?}]`, or `@FILE` to read it from a file; empty: none. */
  readonly webhooks: readonly WebhookTarget[];
  /** FF_WEBHOOK_RETRY_BASE: first retry delay of a failed webhook delivery (doubling, up to 5m, 8 attempts); at least 100ms. */
  readonly webhookRetryBaseMs: number;
  /**
   * FF_RECORD_RETENTION: records of destroyed or failed sandboxes, of finished operations
   * (with their idempotency keys) and of deleted or failed snapshots are deleted this long
   * after their last change; 0s keeps them forever (etcd then grows without bound). ADR 0017.
   */
  readonly recordRetentionMs: number;
  /**
   * FF_FORK_SNAPSHOT_TTL: retention TTL of the snapshot a fork of a live sandbox takes, when
   * the request sets none (ForkSandboxRequest.snapshot_retention); 0s keeps them.
   */
  readonly forkSnapshotTtlMs: number;
  /** FF_ETCD_COMPACT_INTERVAL: the leader compacts etcd's history this often, keeping one interval of it; 0s: never (etcd's own --auto-compaction must then do it). */
  readonly etcdCompactIntervalMs: number;
  /** FF_HELD_SNAPSHOT_CHECK: how often the leader looks for deleted snapshots that hosts still hold, and has them deleted there (at least 1s). */
  readonly heldSnapshotCheckMs: number;
}

export function compileSchedulerConfig(raw: Partial<Record<keyof SchedulerConfig, string>> = {}, env: NodeJS.ProcessEnv = process.env): SchedulerConfig {
  const get = (key: keyof SchedulerConfig, envName: string, dflt: string): [string, string] => [envName, raw[key] ?? env[envName] ?? dflt];
  const [sid, id] = get('id', 'FF_SCHEDULER_ID', `${hostname()}-${process.pid}`);
  // The CLI's and the README's default API address (services/cli/hints.ts defaultApi): a scheduler started without FF_GRPC_ADDR is reached by a CLI given no --api.
  const [ga, grpcAddr] = get('grpcAddr', 'FF_GRPC_ADDR', '127.0.0.1:17700');
  const [, etcd] = get('etcdEndpoints', 'FF_ETCD_ENDPOINTS', 'http://127.0.0.1:2379');
  const [nu, natsUrl] = get('natsUrl', 'FF_NATS_URL', 'nats://127.0.0.1:4222');
  const [, natsNkeyFile] = get('natsNkeyFile', 'FF_NATS_NKEY_FILE', '');
  const [nr, natsReplicas] = get('natsStreamReplicas', 'FF_NATS_STREAM_REPLICAS', '1');
  const [sa, suspect] = get('suspectAfterMs', 'FF_HOST_SUSPECT_AFTER', '5s');
  // Marking a host lost marks its sandboxes lost: the grace period must outlast a busy
  // host's stall (seen: 10 s agent stalls on a 2-core TCG host running 10+ guests).
  const [la, lost] = get('lostAfterMs', 'FF_HOST_LOST_AFTER', '30s');
  const [st, step] = get('stepTimeoutMs', 'FF_STEP_TIMEOUT', '180s');
  const [sat, attempts] = get('stepAttempts', 'FF_STEP_ATTEMPTS', '3');
  const [sg, strayGrace] = get('strayVmGraceMs', 'FF_STRAY_VM_GRACE', '0s');
  const [, keyPath] = get('signingKeyPath', 'FF_SIGNING_KEY', '');
  const [ma, metricsAddr] = get('metricsAddr', 'FF_METRICS_ADDR', '');
  const [, metricsTokenFile] = get('metricsTokenFile', 'FF_METRICS_TOKEN_FILE', '');
  const [ll, logLevel] = get('logLevel', 'FF_LOG_LEVEL', 'info');
  const [cb, chunk] = get('chunkBytes', 'FF_CHUNK_BYTES', String(256 * 1024));
  const [mm, migrateMax] = get('migrateMaxChildren', 'FF_MIGRATE_MAX_CHILDREN', '2');
  const [et, electionTtl] = get('electionTtlSeconds', 'FF_ELECTION_TTL', '2s');
  const [tc, tlsCert] = get('tlsCertPath', 'FF_TLS_CERT', '');
  const [tk, tlsKey] = get('tlsKeyPath', 'FF_TLS_KEY', '');
  const [, tlsCa] = get('tlsCaPath', 'FF_TLS_CA', '');
  const [tf, tokens] = get('tokensFile', 'FF_TOKENS_FILE', '');
  const [mr, maxRecv] = get('maxRecvBytes', 'FF_GRPC_MAX_RECV', '4MiB');
  const [ms, maxSend] = get('maxSendBytes', 'FF_GRPC_MAX_SEND', '16MiB');
  // Defaults sized so that an RL step passes unthrottled: fork(256) (the API cap), then one
  // exec stream per child, all at once.
  const [mst, maxStreams] = get('maxStreamsPerCredential', 'FF_MAX_STREAMS_PER_CREDENTIAL', '512');
  // Each watch reads every change in the fleet (its filter applies after): a handful per
  // credential serve a client; hundreds would make every write cost a replica hundreds of decodes.
  const [mw, maxWatches] = get('maxWatchesPerCredential', 'FF_MAX_WATCHES_PER_CREDENTIAL', '16');
  const [fb, fileBuffer] = get('fileBufferBytes', 'FF_FILE_BUFFER_MAX', '512MiB');
  const [rp, ratePerS] = get('ratePerSecond', 'FF_RATE_PER_S', '200');
  const [rb, rateBurst] = get('rateBurst', 'FF_RATE_BURST', '600');
  const [en, expiryNotice] = get('expiryNoticeMs', 'FF_SNAPSHOT_EXPIRY_NOTICE', '10m');
  const [wh, webhooks] = get('webhooks', 'FF_WEBHOOKS', '');
  const [wr, webhookRetry] = get('webhookRetryBaseMs', 'FF_WEBHOOK_RETRY_BASE', '1s');
  const [rr, recordRetention] = get('recordRetentionMs', 'FF_RECORD_RETENTION', '1h');
  const [fst, forkSnapshotTtl] = get('forkSnapshotTtlMs', 'FF_FORK_SNAPSHOT_TTL', '24h');
  const [ci, compactInterval] = get('etcdCompactIntervalMs', 'FF_ETCD_COMPACT_INTERVAL', '5m');
  const [hs, heldCheck] = get('heldSnapshotCheckMs', 'FF_HELD_SNAPSHOT_CHECK', '30s');
  parseRequired(tc, tlsCert, 'is required: the Fleet API serves TLS only (a dev CA and certificate: node --import tsx deploy/pki/pki.ts DIR)');
  parseRequired(tk, tlsKey, 'is required with FF_TLS_CERT');
  parseRequired(tf, tokens, 'is required: per-tenant bearer tokens (mint one: npm run forkfleet -- token mint --tenant NAME --tokens-file FILE)');
  parseRequired(sid, id, "must name this replica in the leader election (default: the host's name and the process id)");
  const etcdEndpoints = etcd.split(',').map((s) => s.trim()).filter(Boolean);
  if (etcdEndpoints.length === 0) throw new InvalidArgumentError('FF_ETCD_ENDPOINTS', 'must list at least one endpoint');
  const natsUrls = natsServers(nu, natsUrl);
  const suspectAfterMs = parseDurationIn(sa, suspect, { min: 1000 });
  const stepTimeoutMs = parseDurationIn(st, step, { min: 1000, max: MAX_TIMER_MS });
  const cfg: SchedulerConfig = {
    id,
    grpcAddr: parseHostPort(ga, grpcAddr, true),
    etcdEndpoints,
    etcdTls: etcdTls(etcdEndpoints, env),
    etcdServerName: etcdServerName(etcdEndpoints, env),
    natsUrl,
    natsTls: natsTls(natsUrls, env),
    natsStreamReplicas: parseInteger(nr, natsReplicas, 1, 5),
    natsNkeyFile,
    suspectAfterMs,
    lostAfterMs: parseDurationIn(la, lost, { min: 1000 }),
    stepTimeoutMs,
    stepAttempts: parseInteger(sat, attempts, 1, 20),
    strayVmGraceMs: parseDurationIn(sg, strayGrace, { min: 1000, zero: 'derived from the step timeout' }),
    signingKeyPath: keyPath,
    metricsAddr: metricsAddr ? parseHostPort(ma, metricsAddr, true) : '',
    metricsTokenFile,
    logLevel: parseLogLevel(ll, logLevel),
    chunkBytes: parseInteger(cb, chunk, 4096, MAX_CHUNK_BYTES),
    migrateMaxChildren: parseInteger(mm, migrateMax, 0, 64),
    electionTtlSeconds: parseDurationIn(et, electionTtl, { min: 1000, max: MAX_TIMER_MS }) / 1000,
    tlsCertPath: tlsCert,
    tlsKeyPath: tlsKey,
    tlsCaPath: tlsCa,
    tokensFile: tokens,
    maxRecvBytes: parseBytes(mr, maxRecv),
    maxSendBytes: parseBytes(ms, maxSend),
    maxStreamsPerCredential: parseInteger(mst, maxStreams, 1),
    maxWatchesPerCredential: parseInteger(mw, maxWatches, 1),
    fileBufferBytes: parseBytes(fb, fileBuffer),
    ratePerSecond: parseDecimal(rp, ratePerS, 0),
    rateBurst: parseInteger(rb, rateBurst, 1),
    expiryNoticeMs: parseDurationIn(en, expiryNotice, { min: 1000, zero: 'no notice: announced as it is deleted' }),
    webhooks: webhooks ? parseWebhookTargets(wh, webhooks.startsWith('@') ? readFileSync(webhooks.slice(1), 'utf8') : webhooks) : [],
    webhookRetryBaseMs: parseDurationIn(wr, webhookRetry, { min: 100, max: MAX_TIMER_MS }),
    recordRetentionMs: parseDurationIn(rr, recordRetention, { min: 1000, zero: 'keep forever' }),
    forkSnapshotTtlMs: parseDurationIn(fst, forkSnapshotTtl, { min: 1000, zero: 'keep them' }),
    etcdCompactIntervalMs: parseDurationIn(ci, compactInterval, { min: 1000, max: MAX_TIMER_MS, zero: 'never' }),
    heldSnapshotCheckMs: parseDurationIn(hs, heldCheck, { min: 1000, max: MAX_TIMER_MS }),
  };
  if (cfg.maxRecvBytes < 64 * 1024) throw new InvalidArgumentError(mr, 'must be at least 64KiB');
  if (cfg.maxSendBytes < 64 * 1024) throw new InvalidArgumentError(ms, 'must be at least 64KiB');
  // Forkfleet's clients take answers up to 64 MiB (CLIENT_MAX_RECEIVE_BYTES, adapters/grpc/tls.ts).
  if (cfg.maxSendBytes > 64 << 20) throw new InvalidArgumentError(ms, 'must be at most 64MiB (the largest answer the SDK and CLI take)');
  // Smaller, and a file of the API's largest size could never be read or written.
  if (cfg.fileBufferBytes < 64 << 20) throw new InvalidArgumentError(fb, 'must be at least 64MiB (the largest file the API moves)');
  if (!(cfg.lostAfterMs > cfg.suspectAfterMs)) throw new InvalidArgumentError(la, `must be longer than FF_HOST_SUSPECT_AFTER (${suspect}), got ${JSON.stringify(lost)}`);
  if (!Number.isInteger(cfg.electionTtlSeconds)) throw new InvalidArgumentError(et, `must be a whole number of seconds, at least 1s, got ${JSON.stringify(electionTtl)}`);
  return Object.freeze(cfg);
}
