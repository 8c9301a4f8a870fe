// Scheduler configuration, compiled once at start-up from options and environment
// variables into a frozen object (CONVENTIONS.md §6). A bad value fails start-up with the
// variable's name and the reason.
import { hostname } from 'node:os';
import { InvalidArgumentError } from '../proto/errors.ts';

const UNITS: Record<string, number> = { ms: 1, s: 1000, m: 60_000, h: 3_600_000 };

/** Parses '250ms', '10s', '5m', '1h' (or a bare number of milliseconds). */
export function parseDuration(field: string, v: string): number {
  const m = /^(\d+(?:\.\d+)?)(ms|s|m|h)?$/.exec(v.trim());
  if (!m) throw new InvalidArgumentError(field, `must be a duration such as '500ms', '10s' or '5m', got ${JSON.stringify(v)}`);
  return Math.round(Number(m[1]) * (UNITS[m[2] ?? 'ms'] ?? 1));
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
  /** FF_ETCD_ENDPOINTS: comma-separated etcd client URLs. */
  readonly etcdEndpoints: readonly string[];
  /** FF_NATS_URL */
  readonly natsUrl: string;
  /** FF_HOST_SUSPECT_AFTER: heartbeat age that makes a host suspect. */
  readonly suspectAfterMs: number;
  /** FF_HOST_LOST_AFTER: heartbeat age that makes a host lost. */
  readonly lostAfterMs: number;
  /** FF_STEP_TIMEOUT: how long one host step may run before it is re-sent. */
  readonly stepTimeoutMs: number;
  /** FF_STEP_ATTEMPTS */
  readonly stepAttempts: number;
  /** FF_SIGNING_KEY: PEM file with the Ed25519 key that signs tickets and manifests; generated when missing. */
  readonly signingKeyPath: string;
  /** FF_METRICS_ADDR: Prometheus /metrics; empty disables. */
  readonly metricsAddr: string;
  /** FF_LOG_LEVEL */
  readonly logLevel: string;
  /** FF_CHUNK_BYTES: chunk size of the snapshot store (for transfer estimates). */
  readonly chunkBytes: number;
  /**
   * FF_ELECTION_TTL: lease TTL of the leader election, whole seconds. A killed leader's
   * lease lapses after about this long and a standby takes over (measured: ~1.2-2 s with
   * '1s'). Shorter is faster failover; the leader must keep its lease alive, so an event
   * loop stalled longer than this makes it step down.
   */
  readonly electionTtlSeconds: number;
}

export function compileSchedulerConfig(raw: Partial<Record<keyof SchedulerConfig, string>> = {}, env: NodeJS.ProcessEnv = process.env): SchedulerConfig {
  const get = (key: keyof SchedulerConfig, envName: string, dflt: string): [string, string] => [envName, raw[key] ?? env[envName] ?? dflt];
  const [, id] = get('id', 'FF_SCHEDULER_ID', `${hostname()}-${process.pid}`);
  const [ga, grpcAddr] = get('grpcAddr', 'FF_GRPC_ADDR', '127.0.0.1:7700');
  const [, etcd] = get('etcdEndpoints', 'FF_ETCD_ENDPOINTS', 'http://127.0.0.1:2379');
  const [nu, natsUrl] = get('natsUrl', 'FF_NATS_URL', 'nats://127.0.0.1:4222');
  const [sa, suspect] = get('suspectAfterMs', 'FF_HOST_SUSPECT_AFTER', '5s');
  // Marking a host lost marks its sandboxes lost: the grace period must outlast a busy
  // host's stall (seen: 10 s agent stalls on a 2-core TCG host running 10+ guests).
  const [la, lost] = get('lostAfterMs', 'FF_HOST_LOST_AFTER', '30s');
  const [st, step] = get('stepTimeoutMs', 'FF_STEP_TIMEOUT', '180s');
  const [sat, attempts] = get('stepAttempts', 'FF_STEP_ATTEMPTS', '3');
  const [, keyPath] = get('signingKeyPath', 'FF_SIGNING_KEY', '');
  const [, metricsAddr] = get('metricsAddr', 'FF_METRICS_ADDR', '');
  const [, logLevel] = get('logLevel', 'FF_LOG_LEVEL', 'info');
  const [cb, chunk] = get('chunkBytes', 'FF_CHUNK_BYTES', String(256 * 1024));
  const [et, electionTtl] = get('electionTtlSeconds', 'FF_ELECTION_TTL', '2s');
  const etcdEndpoints = etcd.split(',').map((s) => s.trim()).filter(Boolean);
  if (etcdEndpoints.length === 0) throw new InvalidArgumentError('FF_ETCD_ENDPOINTS', 'must list at least one endpoint');
  if (!/^nats:\/\//.test(natsUrl)) throw new InvalidArgumentError(nu, 'must be a nats:// URL');
  const cfg: SchedulerConfig = {
    id,
    grpcAddr: addr(ga, grpcAddr),
    etcdEndpoints,
    natsUrl,
    suspectAfterMs: parseDuration(sa, suspect),
    lostAfterMs: parseDuration(la, lost),
    stepTimeoutMs: parseDuration(st, step),
    stepAttempts: Number(attempts),
    signingKeyPath: keyPath,
    metricsAddr: metricsAddr ? addr('FF_METRICS_ADDR', metricsAddr) : '',
    logLevel,
    chunkBytes: Number(chunk),
    electionTtlSeconds: parseDuration(et, electionTtl) / 1000,
  };
  if (!Number.isInteger(cfg.electionTtlSeconds) || cfg.electionTtlSeconds < 1) throw new InvalidArgumentError(et, 'must be a whole number of seconds, at least 1s');
  if (!(cfg.lostAfterMs > cfg.suspectAfterMs)) throw new InvalidArgumentError(la, 'must be longer than FF_HOST_SUSPECT_AFTER');
  if (!Number.isInteger(cfg.stepAttempts) || cfg.stepAttempts < 1 || cfg.stepAttempts > 20) throw new InvalidArgumentError(sat, 'must be an integer in [1, 20]');
  if (!Number.isInteger(cfg.chunkBytes) || cfg.chunkBytes < 4096) throw new InvalidArgumentError(cb, 'must be an integer >= 4096');
  return Object.freeze(cfg);
}
