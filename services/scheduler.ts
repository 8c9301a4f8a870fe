// Wiring of one scheduler replica: etcd store, NATS bus, heartbeat registry, the Fleet
// API over gRPC, leader election and the leader's executor. main.ts runs it as a process;
// tests may run it in-process.
import { createPrivateKey, createPublicKey, generateKeyPairSync, sign } from 'node:crypto';
import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:http';
import type { Server as HttpServer } from 'node:http';
import { connect } from 'nats';
import type { NatsConnection } from 'nats';
import type { Logger } from 'pino';
import { Registry, Counter, Histogram, Gauge, collectDefaultMetrics } from 'prom-client';
import { natsServers, readTlsClientFiles, type SchedulerConfig } from './config.ts';
import type { FleetStore } from './domain/ports.ts';
import { EtcdFleetStore } from './adapters/etcd/store.ts';
import { StoreLimitError } from './adapters/etcd/errors.ts';
import { EtcdLeaderElection } from './adapters/etcd/election.ts';
import { NatsWorkBus } from './adapters/nats/bus.ts';
import { exitWhenClosedForGood } from './adapters/nats/closed.ts';
import { NotLeaderError } from './domain/errors.ts';
import { LINK_CHECK, natsTlsOptions, nkeyConnectOptions } from './adapters/nats/auth.ts';
import { followReadiness, MAX_CONCURRENT_STREAMS, startGrpcServer } from './adapters/grpc/server.ts';
import { fleetServerCredentials } from './adapters/grpc/tls.ts';
import { Authenticator } from './auth/tokens.ts';
import { ApiGuard } from './auth/guard.ts';
import type { RunningGrpcServer } from './adapters/grpc/server.ts';
import { fleetService, WATCH_PROGRESS_MS } from './adapters/grpc/fleet-service.ts';
import { Fleet } from './domain/fleet.ts';
import { Executor } from './domain/executor.ts';
import { registerFleetGauges } from './fleet-metrics.ts';
import { compactionFloor, DEFAULT_RETRY, WebhookDispatcher } from './domain/webhooks.ts';
import { EtcdDeliveryLog } from './adapters/etcd/webhook-log.ts';
import { Compactor } from './domain/history.ts';
import { QuotaLedger } from './domain/quota-ledger.ts';
import { fetchPoster } from './adapters/http/webhook-poster.ts';
import { HeartbeatRegistry } from './domain/fleet-view.ts';
import { systemClock } from './domain/ports.ts';
import { signTicket } from '../host-agent/domain/tickets.ts';
import { isForkfleetError } from '../proto/errors.ts';
import { dashboardHandler, metricsFromUrls } from './dashboard/handler.ts';
import { isLoopbackHost, metricsAccess } from './metrics-access.ts';
import type { DashboardHandler } from './dashboard/handler.ts';
import type { SigningKey } from '../host-agent/domain/tickets.ts';

export interface SchedulerHandle {
  readonly address: string;
  readonly metricsAddress: string;
  readonly config: SchedulerConfig;
  readonly registry: Registry;
  isLeader(): boolean;
  /** Resolves when this replica has become leader. */
  readonly leader: Promise<void>;
  close(): Promise<void>;
}

/** Loads the Ed25519 signing key, or creates one (mode 0600) when the file is missing. */
export function loadSigningKey(path: string, keyId: string): SigningKey {
  if (path && existsSync(path)) return { keyId, privateKey: createPrivateKey(readFileSync(path)) };
  const { privateKey } = generateKeyPairSync('ed25519');
  if (path) {
    writeFileSync(path, privateKey.export({ type: 'pkcs8', format: 'pem' }), { mode: 0o600 });
    writeFileSync(`${path}.pub`, createPublicKey(privateKey).export({ type: 'spki', format: 'pem' }), { mode: 0o644 });
  }
  return { keyId, privateKey };
}

/**
 * Seconds: a same-host fork's restore on KVM (tens of ms) up to a migration or fetch of a
 * large snapshot, and a step that runs out FF_STEP_TIMEOUT (180 s by default).
 */
export const STEP_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 180];
/** Seconds, submit to finish: a same-host fork on KVM takes tens of ms, a drain or a large migration minutes. */
export const OPERATION_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 180];

/** The Fleet API's health (grpc.health.v1) is checked this often: NOT_SERVING while etcd or NATS is out of reach. */
const READINESS_EVERY_MS = 1000;
/** A readiness check (an etcd read) unanswered for this long has failed. */
const READINESS_TIMEOUT_MS = 2000;

export function schedulerMetrics(registry: Registry): { ops: Counter<'kind' | 'result'>; opSeconds: Histogram<'kind'>; leader: Gauge } {
  return {
    ops: new Counter({ name: 'forkfleet_operations_total', help: 'Operations finished by the leader, by kind and result (succeeded, failed, cancelled).', labelNames: ['kind', 'result'], registers: [registry] }),
    opSeconds: new Histogram({
      name: 'forkfleet_operation_duration_seconds',
      help: 'Time from an operation being recorded to it finishing, by kind.',
      labelNames: ['kind'],
      buckets: OPERATION_BUCKETS,
      registers: [registry],
    }),
    leader: new Gauge({ name: 'forkfleet_scheduler_is_leader', help: '1 when this replica is the leader.', registers: [registry] }),
  };
}

/** Seams for tests in the same process: `executorStore` wraps the store the leader's executor writes through (fault injection). */
export interface SchedulerSeams {
  executorStore?: (store: FleetStore) => FleetStore;
  /** WatchEvents' progress marker interval (fleet-service.ts WATCH_PROGRESS_MS), shorter in tests. */
  watchProgressMs?: number;
  /** Ends the process when its NATS connection closed for good (adapters/nats/closed.ts): process.exit by default. */
  exit?: (code: number) => void;
}

/** WatchEvents' progress period for a compaction interval (0: never compacted): a quarter of it, at most WATCH_PROGRESS_MS, at least 500 ms. */
export function watchProgressFor(compactIntervalMs: number): number {
  if (compactIntervalMs <= 0) return WATCH_PROGRESS_MS;
  return Math.max(500, Math.min(WATCH_PROGRESS_MS, Math.floor(compactIntervalMs / 4)));
}

export async function startScheduler(config: SchedulerConfig, log: Logger, seams: SchedulerSeams = {}): Promise<SchedulerHandle> {
  // Read before anything starts: a TLS file that cannot be read fails start-up naming its variable.
  const etcdTls = config.etcdTls ? readTlsClientFiles(config.etcdTls) : undefined;
  const natsTls = config.natsTls ? readTlsClientFiles(config.natsTls) : undefined;
  // The metrics' series name tenants: with FF_METRICS_TOKEN_FILE, only that token reads them.
  const access = metricsAccess(config.metricsAddr ? config.metricsTokenFile : '', (why) => log.error({ metricsTokenFile: config.metricsTokenFile }, `metrics token file not taken, the token before stays in force: ${why}`));
  const clock = systemClock;
  const registry = new Registry();
  collectDefaultMetrics({ register: registry });
  // prom-client names these gauges *_total, which Prometheus reserves for counters (promtool
  // rejects them); the process is still described by the other default metrics.
  for (const m of ['nodejs_active_handles_total', 'nodejs_active_requests_total', 'nodejs_active_resources_total']) registry.removeSingleMetric(m);
  const metrics = schedulerMetrics(registry);
  const signing = loadSigningKey(config.signingKeyPath, 'scheduler-1');

  const store = EtcdFleetStore.connect([...config.etcdEndpoints], etcdTls, config.etcdServerName);
  // A fork spread wide commits up to 1024 writes at once: an etcd left at its default
  // --max-txn-ops (128) fails those (StoreLimitError, naming the flag). Said at start, not at
  // the first wide fork; the scheduler still starts (etcd may be out of reach just now).
  void store.checkTxnOps().catch((err: unknown) =>
    err instanceof StoreLimitError ? log.error({ err }, 'etcd refuses a transaction of 1024 operations: run it with --max-txn-ops 1024 (services/README.md), or wide forks fail') : log.warn({ err }, 'could not check etcd\'s --max-txn-ops at start-up (etcd out of reach?)'),
  );
  const nc: NatsConnection = await connect({
    servers: natsServers('FF_NATS_URL', config.natsUrl),
    name: `scheduler-${config.id}`,
    maxReconnectAttempts: -1,
    reconnectTimeWait: 250,
    // A silent link noticed within ~10 s (reconcileHosts holds lost transitions only while
    // it knows the link is down).
    ...LINK_CHECK,
    // No stack captured per request (three Error objects per JetStream publish, the largest
    // cost of sending a host step); a timed-out request still fails with a named NatsError.
    noAsyncTraces: true,
    ...(config.natsNkeyFile ? nkeyConnectOptions(config.natsNkeyFile) : {}),
    ...natsTlsOptions(natsTls),
  });
  const bus = await NatsWorkBus.create(nc, config.natsStreamReplicas, log.child({ component: 'nats-bus' }));
  const heard = new HeartbeatRegistry((hostId, err) => log.warn({ hostId, err }, 'a heartbeat whose VM list does not decode: its VMs are not checked until a readable one'));
  bus.onHeartbeat((hb) => heard.record(hb, clock.now()));
  const liveness = { suspectAfterMs: config.suspectAfterMs, lostAfterMs: config.lostAfterMs };

  // The API edge: TLS only, every call authenticated (services/auth), rate- and stream-limited.
  const auth = new Authenticator(config.tokensFile, config.ratePerSecond > 0 ? { perSecond: config.ratePerSecond, burst: config.rateBurst } : undefined, Date.now, (why) =>
    why === undefined ? log.info({ tokensFile: config.tokensFile }, 'tokens file read again: its tokens are in force') : log.error({ tokensFile: config.tokensFile }, `tokens file not taken: ${why}`),
  );
  const guard = new ApiGuard(auth, { maxStreamsPerCredential: config.maxStreamsPerCredential, maxWatchesPerCredential: config.maxWatchesPerCredential });
  // Quota admission reads usage from a ledger a watch keeps (started by the first check that has a quota).
  const usage = new QuotaLedger({ store, log: log.child({ component: 'quota-ledger' }) });
  const fleet = new Fleet({ store, bus, clock, heard, liveness, quotas: (tenantId) => auth.quotaOf(tenantId), usage, defaultIdleTimeoutMs: (tenantId) => auth.idleTimeoutOf(tenantId), forkSnapshotTtlMs: config.forkSnapshotTtlMs, rateOf: (tenantId) => auth.rateOf(tenantId) });
  const grpc: RunningGrpcServer = await startGrpcServer({
    address: config.grpcAddr,
    // A quiet WatchEvents stream's resume point moves with its progress marks (every 1-1.5 x
    // the period); compaction keeps only one FF_ETCD_COMPACT_INTERVAL of history, so with a
    // short interval (ADR 0017's 2-5 s) a 30 s period left nearly every quiet stream that broke
    // unable to resume (FAILED_PRECONDITION on after_revision).
    services: [fleetService({ fleet, store, clock, fileBufferBytes: config.fileBufferBytes, watchProgressMs: seams.watchProgressMs ?? watchProgressFor(config.etcdCompactIntervalMs) })],
    credentials: fleetServerCredentials({ certPem: readFileSync(config.tlsCertPath), keyPem: readFileSync(config.tlsKeyPath) }),
    guard,
    channelOptions: {
      'grpc.max_receive_message_length': config.maxRecvBytes,
      'grpc.max_send_message_length': config.maxSendBytes,
      // Calls open at once per connection: room for one client's streams and long polls, each
      // capped at FF_MAX_STREAMS_PER_CREDENTIAL, and its unary calls beside them.
      'grpc.max_concurrent_streams': Math.max(MAX_CONCURRENT_STREAMS, 2 * config.maxStreamsPerCredential + 64),
    },
    // Client mistakes are the client's news, not ours: only unexpected errors are loud.
    onError: (err, method) => (isForkfleetError(err) && err.kind !== 'internal' ? log.debug({ err: err.message, kind: err.kind, method }, 'request refused') : log.error({ err, method }, 'request failed')),
  });
  log.info({ address: grpc.address }, 'Fleet API listening');
  // Every API call reads or writes etcd, and exec, files and host work go over NATS: while
  // either is out of reach the health service answers NOT_SERVING, so probes and load
  // balancers send calls to replicas that can answer them. One etcd read in flight at a time.
  let etcdProbe: Promise<boolean> | undefined;
  const readiness = followReadiness(
    grpc,
    [
      { name: 'etcd', ready: () => (etcdProbe ??= store.revision().then(() => true, () => false).finally(() => (etcdProbe = undefined))) },
      { name: 'nats', ready: () => bus.connectedForMs() > 0 },
    ],
    {
      everyMs: READINESS_EVERY_MS,
      timeoutMs: READINESS_TIMEOUT_MS,
      onChange: (serving, failing) => (serving ? log.info('etcd and NATS reachable again: health SERVING') : log.warn({ failing }, 'cannot serve (out of reach): health NOT_SERVING')),
    },
  );

  let metricsServer: HttpServer | undefined;
  let dashboard: DashboardHandler | undefined;
  let metricsAddress = '';
  /** The last /metrics collection error told (undefined: the last collection worked). */
  let metricsFailure: string | undefined;
  if (config.metricsAddr) {
    const [h, p] = [config.metricsAddr.slice(0, config.metricsAddr.lastIndexOf(':')), Number(config.metricsAddr.slice(config.metricsAddr.lastIndexOf(':') + 1))];
    // The live dashboard (/dashboard/) is served beside /metrics; only the leader records
    // operation latencies, so FF_DASHBOARD_METRICS may list every replica's metrics URL.
    const peers = (process.env.FF_DASHBOARD_METRICS ?? '').split(',').filter(Boolean);
    if (!config.metricsTokenFile && !isLoopbackHost(h)) log.warn({ metricsAddr: config.metricsAddr }, 'FF_METRICS_TOKEN_FILE is not set: /metrics, with per-tenant series, is open to whoever reaches FF_METRICS_ADDR');
    // The dashboard reads through the API with an admin token that exists only in this process,
    // trusting FF_TLS_CA (without it, what any client trusts: FF_CA, FF_CREDENTIALS, the fleet
    // directory's credentials.json, else the system roots, which a dev certificate then fails).
    const token = auth.addEphemeral('admin', true, `dashboard-${config.id}`);
    if (!config.tlsCaPath) log.warn('FF_TLS_CA is not set: the dashboard trusts what any client does (FF_CA, FF_CREDENTIALS, credentials.json, else the system CAs) when it calls the API');
    dashboard = dashboardHandler({
      api: grpc.address,
      metrics: peers.length ? metricsFromUrls(peers, () => access.header()) : async () => [await registry.metrics()],
      token,
      ...(config.tlsCaPath ? { ca: config.tlsCaPath } : {}),
      // The page shows every tenant's sandboxes: only admin tokens may read it.
      authorize: (t) => {
        try {
          return auth.authenticate(`Bearer ${t}`).admin;
        } catch {
          return false;
        }
      },
    });
    metricsServer = createServer((req, res) => {
      try {
        if (dashboard?.(req, res)) return;
      } catch (e) {
        // A throw in a request listener would end the replica (the leader too).
        log.warn({ err: e, path: req.url?.split('?')[0] }, 'dashboard request failed'); // not its query: it may carry the admin token
        if (!res.headersSent) res.writeHead(500);
        res.end();
        return;
      }
      if (req.url !== '/metrics') {
        res.writeHead(404).end();
        return;
      }
      if (!access.allowed(req.headers.authorization)) {
        res.writeHead(401, { 'www-authenticate': 'Bearer realm="forkfleet-metrics"', 'content-type': 'text/plain' }).end('/metrics needs Authorization: Bearer <the FF_METRICS_TOKEN_FILE token>\n');
        return;
      }
      registry.metrics().then(
        (body) => {
          metricsFailure = undefined;
          res.writeHead(200, { 'content-type': registry.contentType }).end(body);
        },
        (err: unknown) => {
          // Told once per distinct error: a collect that fails does so at every scrape.
          const why = err instanceof Error ? err.message : String(err);
          if (why !== metricsFailure) log.error({ err }, '/metrics could not be collected: answering 500');
          metricsFailure = why;
          res.writeHead(500).end();
        },
      );
    });
    const server = metricsServer;
    try {
      await new Promise<void>((resolve, reject) => {
        server.once('error', reject);
        server.listen(p, h, () => {
          server.off('error', reject);
          resolve();
        });
      });
    } catch (e) {
      // A taken port: said naming the setting, with what was opened closed (an 'error' event
      // nobody listened to ended the process with a raw stack, the API already listening).
      readiness.stop();
      dashboard?.close();
      await grpc.close(0).catch(() => undefined);
      bus.close();
      await nc.close().catch(() => undefined);
      store.close();
      throw new Error(`FF_METRICS_ADDR ${config.metricsAddr}: cannot listen there: ${(e as Error).message}`, { cause: e });
    }
    // Later errors (an accept failing with EMFILE): told, not thrown (an 'error' event nobody
    // listens to would end the replica, the leader too).
    server.on('error', (err) => log.warn({ err }, 'metrics server error'));
    const a = metricsServer.address();
    metricsAddress = typeof a === 'object' && a ? `${h}:${a.port}` : config.metricsAddr;
  }

  const replaced = new Counter({ name: 'forkfleet_fork_children_replaced_total', help: "A fork's children whose host was lost while it started them, or failed their restore for its own reasons: placed again on another host (result=placed) or failed for want of room (result=failed).", labelNames: ['result'], registers: [registry] });
  const stepSeconds = new Histogram({
    name: 'forkfleet_host_step_duration_seconds',
    help: "Host steps, from the leader's first send to the answer reaching it (or the step failing), by action (the HostWork kind, e.g. restore_vms) and result (succeeded, failed).",
    labelNames: ['action', 'result'],
    buckets: STEP_BUCKETS,
    registers: [registry],
  });
  const stepHostSeconds = new Histogram({
    name: 'forkfleet_host_step_host_seconds',
    help: 'Host steps as their host measured them (its start to its answer, of the send it answered), by action; forkfleet_host_step_duration_seconds runs from the first send, so beyond this it holds the time in NATS and in the leader and any earlier sends that went unanswered or failed.',
    labelNames: ['action'],
    buckets: STEP_BUCKETS,
    registers: [registry],
  });
  const stepChildren = new Map<string, { observe(v: number): void }>();
  const stepHostChildren = new Map<string, { observe(v: number): void }>();
  const cached = <T>(m: Map<string, T>, k: string, make: () => T): T => {
    let v = m.get(k);
    if (v === undefined) m.set(k, (v = make()));
    return v;
  };
  const expired = new Counter({ name: 'forkfleet_records_expired_total', help: 'Records of destroyed or failed sandboxes, finished operations and deleted or failed snapshots deleted by the history retention (FF_RECORD_RETENTION), by kind.', labelNames: ['kind'], registers: [registry] });
  const election = new EtcdLeaderElection(store.etcd, config.id, config.electionTtlSeconds);
  bus.setWorkFence(() => (election.isLeader() ? undefined : new NotLeaderError()));
  const executor = new Executor({
    store: seams.executorStore ? seams.executorStore(store) : store,
    fence: () => election.fence(),
    leading: () => election.isLeader(),
    bus,
    clock,
    log: log.child({ component: 'executor' }),
    heard,
    signer: {
      ticket: (snapshotId, destinationHostId, allowMigration) => signTicket({ snapshotId, destinationHostId, expiresAt: new Date(clock.now() + 10 * 60_000), allowMigration }, signing),
      manifest: (bytes) => ({ signature: sign(null, bytes, signing.privateKey), keyId: signing.keyId }),
    },
    config: { liveness, stepTimeoutMs: config.stepTimeoutMs, stepAttempts: config.stepAttempts, chunkBytes: config.chunkBytes, expiryNoticeMs: config.expiryNoticeMs, migrateMaxChildren: config.migrateMaxChildren, recordRetentionMs: config.recordRetentionMs, heldSnapshotCheckMs: config.heldSnapshotCheckMs, strayVmGraceMs: config.strayVmGraceMs },
    submit: (tenantId, key, kind, targetId, input, fence) => fleet.submit(tenantId, key, kind, targetId, input, [], fence ? { fence } : {}),
    quotas: (tenantId) => auth.quotaOf(tenantId),
    usage,
    onFinished: (kind, state, seconds) => {
      metrics.ops.inc({ kind, result: state });
      metrics.opSeconds.observe({ kind }, seconds);
    },
    onChildrenReplaced: (result, children) => replaced.inc({ result }, children),
    onStepEnded: (action, result, seconds, hostSeconds) => {
      // Label children looked up once per action (a fork(64) ends 64 steps).
      if (seconds !== undefined) cached(stepChildren, `${action}/${result}`, () => stepSeconds.labels(action, result)).observe(seconds);
      if (hostSeconds !== undefined) cached(stepHostChildren, action, () => stepHostSeconds.labels(action)).observe(hostSeconds);
    },
    onExpired: (sandboxes, ops, snapshots) => {
      expired.inc({ kind: 'sandbox' }, sandboxes);
      expired.inc({ kind: 'operation' }, ops);
      expired.inc({ kind: 'snapshot' }, snapshots);
    },
  });

  bus.onHostEvent((e) => executor.hostEvent(e));

  // Counts terms of leadership here: a start still waiting when its term ended (onLost ran
  // meanwhile) starts nothing more; executor and webhooks end what they began after their stop().
  // The fleet gauges' memo and the compacted revision are of one term.
  let leaderTerm = 0;
  let closing = false;
  registerFleetGauges(registry, () => executor.gauges(), () => (closing ? -1 : leaderTerm));

  // Webhooks go out from the leader only (services/domain/webhooks.ts).
  // Fenced by the leader's election key, as the executor's writes: a deposed leader's late
  // (retried) write can neither move the cursor back nor rewrite a delivery record.
  const deliveries = new EtcdDeliveryLog(store.etcd, { fence: () => election.fence() });
  const webhookAttempts = new Counter({ name: 'forkfleet_webhook_attempts_total', help: 'Webhook delivery attempts, by outcome (delivered, retry, failed).', labelNames: ['result'], registers: [registry] });
  const webhookLost = new Counter({ name: 'forkfleet_webhook_revisions_lost_total', help: 'etcd revisions whose webhook events were never recorded nor sent: etcd compacted them before the leader recorded them (an outside compaction, or a leader that ran without webhooks).', registers: [registry] });
  const webhookStartFailures = new Counter({ name: 'forkfleet_webhook_start_failures_total', help: 'Starts of the leader\'s webhook dispatcher that failed (it tries again; the leader keeps leading).', registers: [registry] });
  const webhooks = new WebhookDispatcher({
    store,
    deliveries,
    poster: fetchPoster,
    clock,
    log: log.child({ component: 'webhooks' }),
    targets: config.webhooks,
    retry: { ...DEFAULT_RETRY, baseDelayMs: config.webhookRetryBaseMs },
    onAttempt: (result) => webhookAttempts.inc({ result }),
    onEventsLost: (revisions) => webhookLost.inc(revisions),
    onStartFailed: () => webhookStartFailures.inc(),
    retentionMs: config.recordRetentionMs,
  });

  // etcd history is compacted by the leader (domain/history.ts), never past the webhook cursor.
  // Reported by the leader only, and only a figure of its current term: a replica that lost
  // the lead would export its last figure for good (others report 0, as before a compaction).
  let compacted: { revision: number; term: number } | undefined;
  new Gauge({
    name: 'forkfleet_etcd_compacted_revision',
    help: 'The etcd revision the leader last compacted history to (0 on other replicas).',
    registers: [registry],
    collect() {
      this.reset();
      if (compacted && compacted.term === leaderTerm && !closing && election.isLeader()) this.set(compacted.revision);
    },
  });
  const compactor = new Compactor(
    {
      store,
      // The dispatcher replays from cursor + 1 after a restart, with each change's previous
      // value: the history from the cursor on must stay readable (compactionFloor). A cursor
      // that an outside compaction passed holds nothing back (the dispatcher skips the loss).
      ...(config.webhooks.length > 0 ? { floor: () => compactionFloor(deliveries), compactedPast: (rev: number) => store.compactedPast(rev) } : {}),
      // A compaction that ends after its term (compactor.stop() does not wait for it) is not this term's.
      onCompacted: (rev) => {
        if (election.isLeader()) compacted = { revision: rev, term: leaderTerm };
      },
      onHeldBack: (floor, wanted) => log.warn({ floor, wanted }, 'etcd compaction is held back by the webhook cursor (events not recorded for delivery): etcd keeps growing'),
      onError: (err) => log.warn({ err }, 'etcd compaction failed'),
    },
    config.etcdCompactIntervalMs,
  );

  // Leadership lost (lease lapsed, e.g. a stalled event loop): stop executing at once, then
  // campaign again as a standby. Whoever leads next re-runs every open operation from etcd.
  // A campaign that fails (etcd unreachable, say) is tried again: a replica never stops
  // standing for leader while it runs.
  const standFor = (): Promise<void> =>
    election.campaign().catch(async (err: unknown) => {
      if (closing) throw err;
      log.error({ err }, 'leader campaign failed; campaigning again in 1 s');
      await new Promise((r) => setTimeout(r, 1000));
      if (closing) throw err;
      return standFor();
    });
  const campaign = (): Promise<void> =>
    standFor().then(async () => {
      if (closing) return;
      const term = ++leaderTerm;
      const current = (): boolean => term === leaderTerm && !closing && election.isLeader();
      metrics.leader.set(1);
      log.info({ id: config.id }, 'elected leader');
      try {
        await executor.start();
        if (!current()) return;
        // Does not reject: a dispatcher that cannot start (its delivery log unreadable) is logged,
        // counted and tried again by itself; webhooks are not worth the leadership (webhooks.ts).
        await webhooks.start();
        if (!current()) return;
        compactor.start();
      } catch (err) {
        if (term !== leaderTerm) return; // this term's start failed after it ended: onLost took over
        // A leader that could not start (etcd failed it a read, likely just after a failover)
        // would hold the lease and run nothing, and no standby would take over: it steps
        // down and stands again, and whoever wins starts afresh.
        log.error({ err }, 'leader could not start; resigning and campaigning again');
        const stepped = ++leaderTerm; // this term's figures are not reported any more
        // Checked after each wait: a lease lost meanwhile (onLost) stands again by itself, and
        // a second campaign from here would replace its campaign (or this resign end it).
        const takenOver = (): boolean => closing || stepped !== leaderTerm;
        metrics.leader.set(0);
        compactor.stop();
        await Promise.all([executor.stop(), webhooks.stop()]).catch(() => undefined);
        if (takenOver()) return;
        await election.resign();
        if (takenOver()) return;
        await new Promise((r) => setTimeout(r, 1000));
        if (!takenOver()) return campaign();
      }
    });
  election.onLost(() => {
    leaderTerm++;
    metrics.leader.set(0);
    log.error('lost leadership; stepping down and campaigning again');
    compactor.stop();
    void Promise.all([executor.stop(), webhooks.stop()]).then(() => {
      if (!closing) campaign().catch((err: unknown) => log.error({ err }, 'leader campaign failed'));
    });
  });
  const leader = campaign();
  leader.catch((err: unknown) => log.error({ err }, 'leader campaign failed'));
  // A connection nats.js gave up on (closed.ts) left a leader holding the lease that could send
  // no host work nor consume results: the fleet stalled until a restart. It exits instead,
  // resigning first so that a standby takes over at once, not after the lease's TTL.
  void exitWhenClosedForGood(nc, {
    log,
    isStopping: () => closing,
    beforeExit: async () => {
      closing = true;
      metrics.leader.set(0);
      compactor.stop();
      await election.resign();
    },
    ...(seams.exit ? { exit: seams.exit } : {}),
  });

  return {
    address: grpc.address,
    metricsAddress,
    config,
    registry,
    isLeader: () => election.isLeader(),
    leader,
    async close() {
      closing = true;
      // Not leading from here on (resign() does not call onLost): a replica stopping in a
      // rolling restart reported 1 beside the one that took over.
      metrics.leader.set(0);
      // Probes and load balancers hear it first, while the leader's work winds down.
      readiness.stop();
      grpc.setServing('NOT_SERVING');
      compactor.stop();
      usage.stop();
      await Promise.all([executor.stop(), webhooks.stop()]);
      await election.resign();
      await grpc.close(1000);
      bus.close();
      await nc.close().catch(() => undefined);
      store.close();
      dashboard?.close();
      await new Promise<void>((r) => {
        if (!metricsServer) return r();
        metricsServer.close(() => r());
        // A half-sent request (a scanner, a cut link) held close() until Node's header timeout,
        // past a supervisor's stop timeout; the agent's metrics server closes them too.
        metricsServer.closeAllConnections();
      });
    },
  };
}
