// Scheduler configuration, compiled once at start-up from options and environment
// variables into a frozen object (CONVENTIONS.md §6). A bad value fails start-up with the
// variable's name and the reason.
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

/** Parses '250ms', '10s', '5m', '1h' (or a bare number of milliseconds). */
export function parseDuration(field: string, v: string): number {
  const m = /^(\d+(?:\.\d+)?)(ms|s|m|h)?$/.exec(v.trim());
  if (!m) throw new InvalidArgumentError(field, `must be a duration such as '500ms', '10s' or '5m', got ${JSON.stringify(v)}`);
  return Math.round(Number(m[1]) * (UNITS[m[2] ?? 'ms'] ?? 1));
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

/** Parses '4MiB', '512KiB' or a bare number of bytes. */
export function parseBytes(field: string, v: string): number {
  const m = /^(\d+)\s*(b|kib|mib|gib)?$/i.exec(v.trim());
  const n = m ? Number(m[1]) * (SIZE_UNITS[(m[2] ?? '').toLowerCase()] ?? 1) : NaN;
  if (!Number.isSafeInteger(n)) throw new InvalidArgumentError(field, `must be a size such as '4MiB' or a number of bytes, got ${JSON.stringify(v)}`);
  return n;
}

function addr(field: string, v: string): string {
  if (!/^[^\s:]+:\d{1,5}$/.test(v)) throw new InvalidArgumentError(field, `must be host:port, got ${JSON.stringify(v)}`);
  return v;
}

export interface SchedulerConfig {
  /** FF_SCHEDULER_ID: this replica's name in the leader election. */
  readonly id: string;
  /** FF_GRPC_ADDR: where the Fleet API listens. */
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
  /** FF_HOST_SUSPECT_AFTER: heartbeat age that makes a host suspect. */
  readonly suspectAfterMs: number;
  /** FF_HOST_LOST_AFTER: heartbeat age that makes a host lost. */
  readonly lostAfterMs: number;
  /** FF_STEP_TIMEOUT: how long one host step may run before it is re-sent. */
  readonly stepTimeoutMs: number;
  /** FF_STEP_ATTEMPTS */
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
  /** FF_METRICS_ADDR: Prometheus /metrics; empty disables. */
  readonly metricsAddr: string;
  /** FF_LOG_LEVEL */
  readonly logLevel: string;
  /** FF_CHUNK_BYTES: chunk size of the snapshot store (for transfer estimates). */
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
  /** FF_TLS_CA: PEM of the CA that signed FF_TLS_CERT; the scheduler's own clients (the dashboard) trust it. Empty: system roots. */
  readonly tlsCaPath: string;
  /** FF_TOKENS_FILE: per-tenant bearer tokens, hashed (services/auth/tokens.ts). Required. */
  readonly tokensFile: string;
  /** FF_GRPC_MAX_RECV: largest request message the API accepts ('4MiB'). */
  readonly maxRecvBytes: number;
  /** FF_GRPC_MAX_SEND: largest response message the API sends ('16MiB'). */
  readonly maxSendBytes: number;
  /** FF_MAX_STREAMS_PER_CREDENTIAL: concurrent streaming calls (exec, files, watch) per credential. */
  readonly maxStreamsPerCredential: number;
  /** FF_RATE_PER_S: default per-tenant request rate (a tenant's `rate` in the tokens file overrides it); 0 disables. */
  readonly ratePerSecond: number;
  /** FF_RATE_BURST: default per-tenant burst. */
  readonly rateBurst: number;
  /** FF_SNAPSHOT_EXPIRY_NOTICE: how long before a retention deletion SNAPSHOT_EXPIRING is announced. */
  readonly expiryNoticeMs: number;
  /** FF_WEBHOOKS: JSON `[{url, secret, tenant?, types?}]`, or `@FILE` to read it from a file; empty: none. */
  readonly webhooks: readonly WebhookTarget[];
  /** FF_WEBHOOK_RETRY_BASE: first retry delay of a failed webhook delivery (doubling, up to 5m, 8 attempts). */
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
  /** FF_HELD_SNAPSHOT_CHECK: how often the leader looks for deleted snapshots that hosts still hold, and has them deleted there. */
  readonly heldSnapshotCheckMs: number;
}

export function compileSchedulerConfig(raw: Partial<Record<keyof SchedulerConfig, string>> = {}, env: NodeJS.ProcessEnv = process.env): SchedulerConfig {
  const get = (key: keyof SchedulerConfig, envName: string, dflt: string): [string, string] => [envName, raw[key] ?? env[envName] ?? dflt];
  const [, id] = get('id', 'FF_SCHEDULER_ID', `${hostname()}-${process.pid}`);
  const [ga, grpcAddr] = get('grpcAddr', 'FF_GRPC_ADDR', '127.0.0.1:7700');
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
  const [, metricsAddr] = get('metricsAddr', 'FF_METRICS_ADDR', '');
  const [, logLevel] = get('logLevel', 'FF_LOG_LEVEL', 'info');
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
  const [rp, ratePerS] = get('ratePerSecond', 'FF_RATE_PER_S', '200');
  const [rb, rateBurst] = get('rateBurst', 'FF_RATE_BURST', '600');
  const [en, expiryNotice] = get('expiryNoticeMs', 'FF_SNAPSHOT_EXPIRY_NOTICE', '10m');
  const [wh, webhooks] = get('webhooks', 'FF_WEBHOOKS', '');
  const [wr, webhookRetry] = get('webhookRetryBaseMs', 'FF_WEBHOOK_RETRY_BASE', '1s');
  const [rr, recordRetention] = get('recordRetentionMs', 'FF_RECORD_RETENTION', '1h');
  const [fst, forkSnapshotTtl] = get('forkSnapshotTtlMs', 'FF_FORK_SNAPSHOT_TTL', '24h');
  const [ci, compactInterval] = get('etcdCompactIntervalMs', 'FF_ETCD_COMPACT_INTERVAL', '5m');
  const [hs, heldCheck] = get('heldSnapshotCheckMs', 'FF_HELD_SNAPSHOT_CHECK', '30s');
  if (!tlsCert) throw new InvalidArgumentError(tc, 'is required: the Fleet API serves TLS only (a dev CA and certificate: node --import tsx deploy/pki/pki.ts DIR)');
  if (!tlsKey) throw new InvalidArgumentError(tk, 'is required with FF_TLS_CERT');
  if (!tokens) throw new InvalidArgumentError(tf, 'is required: per-tenant bearer tokens (mint one: npm run forkfleet -- token mint --tenant NAME --tokens-file FILE)');
  const etcdEndpoints = etcd.split(',').map((s) => s.trim()).filter(Boolean);
  if (etcdEndpoints.length === 0) throw new InvalidArgumentError('FF_ETCD_ENDPOINTS', 'must list at least one endpoint');
  if (!/^[1-5]$/.test(natsReplicas)) throw new InvalidArgumentError(nr, `must be an integer in [1, 5], got ${JSON.stringify(natsReplicas)}`);
  const natsUrls = natsServers(nu, natsUrl);
  const cfg: SchedulerConfig = {
    id,
    grpcAddr: addr(ga, grpcAddr),
    etcdEndpoints,
    etcdTls: etcdTls(etcdEndpoints, env),
    etcdServerName: etcdServerName(etcdEndpoints, env),
    natsUrl,
    natsTls: natsTls(natsUrls, env),
    natsStreamReplicas: Number(natsReplicas),
    natsNkeyFile,
    suspectAfterMs: parseDuration(sa, suspect),
    lostAfterMs: parseDuration(la, lost),
    stepTimeoutMs: parseDuration(st, step),
    stepAttempts: Number(attempts),
    strayVmGraceMs: parseDuration(sg, strayGrace),
    signingKeyPath: keyPath,
    metricsAddr: metricsAddr ? addr('FF_METRICS_ADDR', metricsAddr) : '',
    logLevel,
    chunkBytes: Number(chunk),
    migrateMaxChildren: Number(migrateMax),
    electionTtlSeconds: parseDuration(et, electionTtl) / 1000,
    tlsCertPath: tlsCert,
    tlsKeyPath: tlsKey,
    tlsCaPath: tlsCa,
    tokensFile: tokens,
    maxRecvBytes: parseBytes(mr, maxRecv),
    maxSendBytes: parseBytes(ms, maxSend),
    maxStreamsPerCredential: Number(maxStreams),
    ratePerSecond: Number(ratePerS),
    rateBurst: Number(rateBurst),
    expiryNoticeMs: parseDuration(en, expiryNotice),
    webhooks: webhooks ? parseWebhookTargets(wh, webhooks.startsWith('@') ? readFileSync(webhooks.slice(1), 'utf8') : webhooks) : [],
    webhookRetryBaseMs: parseDuration(wr, webhookRetry),
    recordRetentionMs: parseDuration(rr, recordRetention),
    forkSnapshotTtlMs: parseDuration(fst, forkSnapshotTtl),
    etcdCompactIntervalMs: parseDuration(ci, compactInterval),
    heldSnapshotCheckMs: parseDuration(hs, heldCheck),
  };
  if (cfg.maxRecvBytes < 64 * 1024) throw new InvalidArgumentError(mr, 'must be at least 64KiB');
  if (cfg.maxSendBytes < 64 * 1024) throw new InvalidArgumentError(ms, 'must be at least 64KiB');
  if (!Number.isInteger(cfg.maxStreamsPerCredential) || cfg.maxStreamsPerCredential < 1) throw new InvalidArgumentError(mst, 'must be an integer >= 1');
  if (!(cfg.ratePerSecond >= 0)) throw new InvalidArgumentError(rp, 'must be a number >= 0 (0: no default limit)');
  if (!Number.isInteger(cfg.rateBurst) || cfg.rateBurst < 1) throw new InvalidArgumentError(rb, 'must be an integer >= 1');
  if (!Number.isInteger(cfg.electionTtlSeconds) || cfg.electionTtlSeconds < 1) throw new InvalidArgumentError(et, 'must be a whole number of seconds, at least 1s');
  if (cfg.recordRetentionMs !== 0 && cfg.recordRetentionMs < 1000) throw new InvalidArgumentError(rr, 'must be 0s (keep forever) or at least 1s');
  if (cfg.forkSnapshotTtlMs !== 0 && cfg.forkSnapshotTtlMs < 1000) throw new InvalidArgumentError(fst, 'must be 0s (keep them) or at least 1s');
  if (cfg.etcdCompactIntervalMs !== 0 && cfg.etcdCompactIntervalMs < 1000) throw new InvalidArgumentError(ci, 'must be 0s (never) or at least 1s');
  if (cfg.heldSnapshotCheckMs < 1000) throw new InvalidArgumentError(hs, 'must be at least 1s');
  if (!(cfg.lostAfterMs > cfg.suspectAfterMs)) throw new InvalidArgumentError(la, 'must be longer than FF_HOST_SUSPECT_AFTER');
  if (!Number.isInteger(cfg.stepAttempts) || cfg.stepAttempts < 1 || cfg.stepAttempts > 20) throw new InvalidArgumentError(sat, 'must be an integer in [1, 20]');
  if (cfg.strayVmGraceMs !== 0 && cfg.strayVmGraceMs < 1000) throw new InvalidArgumentError(sg, 'must be 0s (derived from the step timeout) or at least 1s');
  if (!Number.isInteger(cfg.chunkBytes) || cfg.chunkBytes < 4096) throw new InvalidArgumentError(cb, 'must be an integer >= 4096');
  if (!Number.isInteger(cfg.migrateMaxChildren) || cfg.migrateMaxChildren < 0 || cfg.migrateMaxChildren > 64) throw new InvalidArgumentError(mm, 'must be an integer in [0, 64]');
  return Object.freeze(cfg);
}
