// Host-agent process: wires the QEMU driver, the chunk store, the peer transfer server and
// the NATS bus into an Agent. Configuration: FF_* environment variables (config.ts).
import { createPublicKey } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { rm } from 'node:fs/promises';
import { join } from 'node:path';
import { pino } from 'pino';
import { connectWaiting } from './adapters/nats/connect.ts';
import { compileAgentConfig, sandboxDenyCidrs } from './config.ts';
import { natsServers, readTlsClientFiles } from '../services/config.ts';
import { Agent } from './domain/agent.ts';
import { QemuVmmDriver } from './adapters/qemu/driver.ts';
import { GuestCgroup } from './adapters/qemu/cgroup.ts';
import { followLink, NatsAgentBus } from './adapters/nats/agent-bus.ts';
import { agentConnectOptions, natsTlsOptions } from '../services/adapters/nats/auth.ts';
import { exitWhenClosedForGood } from '../services/adapters/nats/closed.ts';
import { FsJournal } from './adapters/journal/fs-journal.ts';
import { FsChunkStore, FsManifestStore } from './adapters/chunkstore/fs-store.ts';
import { Materialiser } from './adapters/chunkstore/materialise.ts';
import { chunkTransferService, peerServerChannelOptions } from './adapters/peer/server.ts';
import { certificateHostId, peerServerCredentials, readPeerTls, writeQemuTlsDir } from './adapters/peer/tls.ts';
import { ChunkStoreShipper } from './adapters/shipper.ts';
import { ensurePrivateDataDir, lockDataDir } from './adapters/data-dir.ts';
import { findSocat } from './adapters/peer/tls-relay.ts';
import { migrateOutThroughRelay } from './adapters/peer/migrate.ts';
import { LiveRoots } from './domain/snapshot-store.ts';
import { startGrpcServer } from '../services/adapters/grpc/server.ts';
import { PromAgentMetrics, serveMetrics } from './adapters/metrics.ts';
import { cachedImage, cachedImages, ensureImage, recipeHash } from '../deploy/images/build.ts';
import type { ImageName } from '../deploy/images/build.ts';
import { IMAGE_NAMES } from '../deploy/images/names.ts';

/** Page size of x86-64 Linux, the only platform the agent runs on. */
const PAGE_BYTES = 4096;

async function main(): Promise<void> {
  const cfg = compileAgentConfig();
  const log = pino({ level: cfg.logLevel, base: { component: 'host-agent', hostId: cfg.hostId } });
  const trust = new Map([['scheduler-1', createPublicKey(readFileSync(cfg.trustedKeyPath))]]);
  // Read before anything starts: a TLS file that cannot be read fails start-up naming its variable.
  const natsTlsPem = cfg.natsTls ? readTlsClientFiles(cfg.natsTls) : undefined;
  const peerTls = readPeerTls(cfg.peerTls);
  // Root's alone: it holds every tenant's snapshot chunks (an older agent made it 0755).
  if (await ensurePrivateDataDir(cfg.dataDir)) log.warn({ dataDir: cfg.dataDir }, 'the data directory was readable by other users: made it 0700');
  // One agent per data directory, taken before anything under it is removed or adopted: a
  // second agent started beside a running one removed its files in use and killed its VMs.
  const dataDirLock = await lockDataDir(cfg.dataDir);
  // How migration streams between hosts are encrypted (config.ts peerMigrationTls, ADR 0015).
  const socat = peerTls && (cfg.peerMigrationTls === 'on' || cfg.peerMigrationTls === 'relay') ? findSocat() : undefined;
  if (peerTls && cfg.peerMigrationTls === 'relay' && !socat) throw new Error('FF_PEER_MIGRATION_TLS=relay needs socat (apt-get install socat)');
  if (peerTls && cfg.peerMigrationTls === 'on' && !socat) log.warn('socat is not installed: migration streams use QEMU\'s own TLS, about twice as slow (ADR 0015)');
  const migrationTlsDir = peerTls && cfg.peerMigrationTls !== 'off' ? writeQemuTlsDir(join(cfg.dataDir, 'migration-tls'), peerTls) : undefined;
  const relay = socat && migrationTlsDir ? { socat, tlsDir: migrationTlsDir, socketDir: join(cfg.dataDir, 'relay') } : undefined;
  // Relay sockets of an agent that died mid-stream (its relays died with it).
  await rm(join(cfg.dataDir, 'relay'), { recursive: true, force: true });

  // Guests share one CPU weight against the agent and the rest of the host (ADR 0018).
  const guestCgroup = cfg.guestCgroup ? await GuestCgroup.open(cfg.guestCgroup).catch((err: unknown) => {
    if (cfg.guestCgroup?.required) throw err;
    log.warn({ err }, 'guest CPU isolation is off: set FF_GUEST_CGROUP= to silence this, or give the agent a writable cgroup hierarchy');
    return undefined;
  }) : undefined;
  if (guestCgroup) log.info({ cgroup: guestCgroup.dir, version: guestCgroup.version, cpuWeight: guestCgroup.cpuWeight }, 'guests run in their own cgroup');

  // Prometheus /metrics of this agent (FF_METRICS_ADDR), served from before its first heartbeat;
  // made before the connection, whose link it follows.
  const metrics = cfg.metricsAddr ? new PromAgentMetrics() : undefined;
  /** A stop (SIGTERM, SIGINT) is under way. */
  let stopping = false;

  // NATS before the slow part of the start (the accel probe, the chunk store's sync, adopting
  // every VM): an agent that exited while NATS was down was restarted every second
  // (Restart=always) and redid all of it each time; now it waits. The bus takes no work before
  // agent.start() (consumeWork).
  // noAsyncTraces: no stack captured per request (each result and event publish is one), as the
  // scheduler's connection; a timed-out request still fails with a named NatsError.
  const nc = await connectWaiting({
    servers: natsServers('FF_NATS_URL', cfg.natsUrl),
    name: `agent-${cfg.hostId}`,
    maxReconnectAttempts: -1,
    reconnectTimeWait: 250,
    noAsyncTraces: true,
    ...agentConnectOptions(cfg.hostId, cfg.natsNkeyFile || undefined),
    ...natsTlsOptions(natsTlsPem),
  }, log);
  void followLink(nc.status(), log, (up) => metrics?.natsConnected(up));
  // A connection nats.js gave up on (a second auth refusal of the same kind) left the agent
  // running unheard, its host declared lost, and systemd never restarted it: it exits instead
  // (its VMs run on for the next agent to adopt, as at a stop).
  void exitWhenClosedForGood(nc, { log, isStopping: () => stopping });
  const bus = await NatsAgentBus.create(nc, cfg.hostId, log);

  // Every VM runs in a network namespace of its own; egress only by policy (adapters/netns).
  if (cfg.egress.denyCidrs.length === 0) log.warn('FF_EGRESS_DENY_CIDRS is empty: a sandbox allowed egress is refused the subnets this host is on, but can reach etcd, the schedulers and other hosts\' peer ports on networks further away; set it to their networks');
  const driver = new QemuVmmDriver({ root: join(cfg.dataDir, 'vmm'), accel: cfg.accel, logger: log.child({ component: 'vmm' }), egress: { pool: cfg.egress.pool, denyCidrs: sandboxDenyCidrs(cfg) }, standby: cfg.standby, ...(cfg.ram ? { ram: cfg.ram } : {}), ...(guestCgroup ? { guestCgroup } : {}),
    // Migration streams to and from other hosts (ADR 0015) speak the same mutual TLS as the peer service.
    ...(migrationTlsDir ? { migrationTlsDir } : {}),
    // Through relays, a migration source QEMU needs no network: it gets a namespace of its own.
    ...(relay ? { migrationViaUnix: true } : {}),
    // accel auto proves KVM by booting a guest: the tiny image (built once, cached by recipe
    // hash), built only if a probe runs (not when an adopted KVM guest proves KVM).
    ...(cfg.accel === 'auto' ? { probeImage: () => ensureImage('tiny') } : {}) });
  const recovered = await driver.recover('adopt');
  log.info(recovered, 'recovered VMs from a previous run');
  const accel = await driver.resolveAccel();
  log.info({ accel }, 'accelerator chosen');

  const roots = new LiveRoots();
  const chunks = new FsChunkStore(join(cfg.dataDir, 'chunks'));
  // Chunks a killed agent wrote are in the page cache, not yet on disk, and this process's
  // sync() covers only its own writes: ingest and fetches count such chunks as present (and
  // store manifests over them). One file-system sync at start makes them durable first. When
  // it fails, the chunk files whose data never reached the disk are found and removed: exiting
  // instead left them to the next start, whose sync returned 0 (the error is reported once).
  const startSync = await chunks.syncAtStart();
  if (startSync.syncFailed || startSync.removed.length > 0) log.error({ syncFailed: startSync.syncFailed, removedChunks: startSync.removed.length }, 'a start-up sync of the chunk store failed: every chunk file was fsynced on its own, and those whose fsync failed were removed (fetched or ingested again)');
  const manifests = new FsManifestStore(join(cfg.dataDir, 'manifests'), { log });
  const materialiser = new Materialiser({ root: join(cfg.dataDir, 'images'), chunks, manifests, trust, roots, log });
  // Flattened disk layers made while ingesting (shipper.portableDisk): removed once ingested,
  // so anything here was left by an agent killed mid-ingest.
  await rm(join(cfg.dataDir, 'scratch'), { recursive: true, force: true });
  const shipper = new ChunkStoreShipper({
    hostId: cfg.hostId,
    driver,
    driverSnapshotsDir: join(cfg.dataDir, 'vmm', 'snapshots'),
    chunks,
    manifests,
    materialiser,
    roots,
    trust,
    scratchDir: join(cfg.dataDir, 'scratch'),
    log,
    chunkSize: cfg.chunkBytes,
    gcGraceMs: cfg.gcGraceMs,
    peerTls,
    migrationRelay: relay,
  });
  await shipper.load();

  // Restore by migration, source side (ADR 0015): a paused clone of a snapshot held here migrates to the caller.
  // Through a TLS relay, QEMU streams to a unix socket here and the relay carries it to the
  // caller, whose certificate must name the host the call came from (its certificate's CN).
  // Leased from before obtain() until the stream ends: a delete of the snapshot meanwhile keeps
  // its files (VMM directory, image) until then, and a snapshot deleted before is not handed out.
  let migrationsOut = 0;
  const migrate = async (snapshotId: string, target: { host: string; port: number; hostId: string }, signal: AbortSignal): Promise<{ bytes: number; ms: number }> => {
    const lease = shipper.lease(snapshotId, `migrate-out/${target.hostId}/${++migrationsOut}`);
    try {
      const { local } = await shipper.obtain(snapshotId, undefined, () => undefined);
      return await (relay ? migrateOutThroughRelay(relay, target, (to) => driver.migrateOut(local, to, signal), signal) : driver.migrateOut(local, target, signal));
    } finally {
      lease.release();
    }
  };
  // With peer TLS, a caller is the host its certificate names (tls.ts), not what it says.
  // A peer runs up to FF_STEP_CONCURRENCY steps at once (fleets share the setting), each with
  // 2 streams to a source, plus a migration's disk fetch and reconnects whose old stream is
  // still closing: 4 per step + 1, at least the server's default 16.
  const maxStreamsPerCaller = Math.max(16, 4 * (cfg.concurrency + 1));
  const peer = chunkTransferService({ chunks, manifests, trust, clock: { now: () => new Date() }, log, migrate, maxStreamsPerCaller, ...(peerTls ? { callerHostId: certificateHostId } : {}) });
  // Peer requests are small (a ticket, a want of a window of digests): the server's defaults
  // (16 MiB requests, 1000 calls per connection) let one unauthenticated connection hold GiBs.
  const peerServer = await startGrpcServer({ address: cfg.peerAddr, services: [peer.registration], credentials: peerServerCredentials(peerTls), channelOptions: peerServerChannelOptions(maxStreamsPerCaller), onError: (err) => log.debug({ err }, 'peer request failed') });
  const peerAddress = cfg.peerAdvertise || peerServer.address;

  // CPU seconds of a process from /proc/<pid>/stat (utime + stime, in clock ticks of 1/100 s).
  const cpu = (pid: number): number | undefined => {
    try {
      const stat = readFileSync(`/proc/${pid}/stat`, 'utf8');
      const f = stat.slice(stat.lastIndexOf(')') + 2).split(' ');
      return (Number(f[11]) + Number(f[12])) / 100;
    } catch {
      return undefined;
    }
  };
  // Resident memory of a process from /proc/<pid>/statm (resident pages, second field).
  const rss = (pid: number): number | undefined => {
    try {
      return Number(readFileSync(`/proc/${pid}/statm`, 'utf8').split(' ')[1]) * PAGE_BYTES;
    } catch {
      return undefined;
    }
  };
  const metricsServer = metrics ? await serveMetrics(metrics.registry, cfg.metricsAddr, (err) => log.warn({ err }, 'agent metrics server error')) : undefined;
  if (metricsServer) log.info({ address: metricsServer.address }, 'agent metrics at /metrics');
  const agent = new Agent({
    driver,
    cpu,
    rss,
    shipper,
    bus,
    journal: new FsJournal(join(cfg.dataDir, 'journal')),
    images: (name) => ensureImage(name as ImageName),
    imageRecipe: async (name) => (await recipeHash(name as ImageName)).hash,
    imageNames: IMAGE_NAMES,
    cachedImages: () => cachedImages(),
    cachedImage: (name, hash) => cachedImage(name as ImageName, hash),
    clock: { now: () => Date.now() },
    log,
    config: { hostId: cfg.hostId, bootId: cfg.bootId, accel, capacity: cfg.capacity, peerAddress, linkBytesPerSecond: cfg.linkBytesPerSecond, heartbeatMs: cfg.heartbeatMs, concurrency: cfg.concurrency, gcIntervalMs: cfg.gcIntervalMs, journalRetentionMs: cfg.journalRetentionMs, migrateMaxChildren: cfg.migrateMaxChildren, shutdownGraceMs: cfg.shutdownGraceMs },
    qemuVersion: await driver.qemuVersion(),
    ...(metrics ? { metrics } : {}),
  });
  await agent.start();
  process.stdout.write(`${JSON.stringify({ ready: true, hostId: cfg.hostId, peer: peerAddress, accel, ...(metricsServer ? { metrics: metricsServer.address } : {}) })}\n`);

  const stop = (sig: string): void => {
    if (stopping) return;
    stopping = true;
    log.info({ sig }, 'stopping: VMs are left running for the next agent to adopt');
    // Every part is closed even if one before it fails (each failure logged); the exit status says whether all closed cleanly.
    let clean = true;
    const close = async (what: string, f: () => Promise<unknown>): Promise<void> => {
      try {
        await f();
      } catch (err) {
        clean = false;
        log.error({ err }, `stopping: closing the ${what} failed`);
      }
    };
    void (async () => {
      // The agent waits for its running steps first (at most its shutdown grace): they need NATS to report.
      await close('agent', () => agent.stop());
      await close('standby VMs', () => driver.closeStandbys());
      await close('peer server', () => peerServer.close(500));
      await close('NATS connection', () => nc.close());
      // A scraper's kept-alive connection would hold close() until it idles out.
      if (metricsServer) await close('metrics server', () => new Promise((r) => (metricsServer.server.close(r), metricsServer.server.closeAllConnections())));
      // Last: the next agent may take over the data directory once this one has let go of all of it.
      await close('data directory lock', () => dataDirLock.release());
    })()
      .catch((err: unknown) => {
        clean = false;
        log.error({ err }, 'stopping failed');
      })
      .finally(() => process.exit(clean ? 0 : 1));
  };
  process.on('SIGTERM', () => stop('SIGTERM'));
  process.on('SIGINT', () => stop('SIGINT'));
}

main().catch((err: unknown) => {
  process.stderr.write(`host-agent: ${err instanceof Error ? (err.stack ?? err.message) : String(err)}\n`);
  process.exit(1);
});
