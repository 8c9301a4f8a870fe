// A process running one or more fake host agents (fake-agent.ts) on one NATS connection.
//
//   FF_NATS_URL=nats://127.0.0.1:4222 FF_FAKE_HOSTS=fake-1,fake-2 FF_DATA_DIR=/tmp/ff-fake \
//     node --import tsx loadtest/fake-agent/main.ts
//
// Environment: FF_FAKE_HOSTS (comma-separated host ids, or FF_FAKE_HOST_COUNT + FF_FAKE_HOST_PREFIX),
// FF_DATA_DIR (one sub-directory per host), FF_HEARTBEAT_INTERVAL_MS (500),
// FF_FAKE_VCPUS (64), FF_FAKE_MEMORY_MIB (262144), FF_FAKE_CREATE_MS, FF_FAKE_RESTORE_MS_PER_VM,
// FF_FAKE_SNAPSHOT_MS, FF_FAKE_FETCH_MS, FF_FAKE_DESTROY_MS, FF_FAKE_PAUSE_MS (all 0), FF_STEP_CONCURRENCY (16),
// FF_FAKE_STATE (files, the default: VMs and the step journal survive a restart; memory: they
// do not, and a fake host does no file I/O), FF_FAKE_FAIL_IMAGES=1 (every image build fails,
// after FF_FAKE_CREATE_MS: every create from an image fails there),
// FF_NATS_NKEY_FILE + FF_NATS_INBOX_PREFIX (NATS authorization; see hostGroupPermissions).
// Prints {"ready":true,...} on stdout once every agent consumes work; SIGTERM stops them.
import { join } from 'node:path';
import { connect } from 'nats';
import { pino } from 'pino';
import { startFakeAgent } from './fake-agent.ts';
import { nkeyConnectOptions } from '../../services/adapters/nats/auth.ts';
import type { FakeAgent } from './fake-agent.ts';

const env = process.env;
const num = (name: string, dflt: number): number => {
  const v = Number(env[name] ?? dflt);
  if (!Number.isFinite(v) || v < 0) throw new Error(`${name}: must be a non-negative number, got ${env[name]}`);
  return v;
};

async function main(): Promise<void> {
  const hosts = env.FF_FAKE_HOSTS
    ? env.FF_FAKE_HOSTS.split(',').map((s) => s.trim()).filter(Boolean)
    : Array.from({ length: num('FF_FAKE_HOST_COUNT', 1) }, (_, i) => `${env.FF_FAKE_HOST_PREFIX ?? 'fake'}-${i + 1}`);
  const dataDir = env.FF_DATA_DIR;
  if (!dataDir) throw new Error('FF_DATA_DIR: required');
  const log = pino({ level: env.FF_LOG_LEVEL ?? 'warn', base: { component: 'fake-agent' } });
  const nc = await connect({
    servers: env.FF_NATS_URL ?? 'nats://127.0.0.1:4222',
    name: `fake-agents-${process.pid}`,
    maxReconnectAttempts: -1,
    reconnectTimeWait: 250,
    noAsyncTraces: true, // as the real agent's connection (host-agent/main.ts)
    // With NATS authorization: a user made with hostGroupPermissions(hosts, FF_NATS_INBOX_PREFIX).
    ...(env.FF_NATS_NKEY_FILE ? nkeyConnectOptions(env.FF_NATS_NKEY_FILE) : {}),
    ...(env.FF_NATS_INBOX_PREFIX ? { inboxPrefix: env.FF_NATS_INBOX_PREFIX } : {}),
  });
  const latency = {
    createMs: num('FF_FAKE_CREATE_MS', 0),
    restoreMsPerVm: num('FF_FAKE_RESTORE_MS_PER_VM', 0),
    snapshotMs: num('FF_FAKE_SNAPSHOT_MS', 0),
    fetchMs: num('FF_FAKE_FETCH_MS', 0),
    destroyMs: num('FF_FAKE_DESTROY_MS', 0),
    pauseMs: num('FF_FAKE_PAUSE_MS', 0),
  };
  const agents: FakeAgent[] = [];
  for (const hostId of hosts) {
    agents.push(
      await startFakeAgent(
        nc,
        {
          hostId,
          dataDir: join(dataDir, hostId),
          capacity: { vcpus: num('FF_FAKE_VCPUS', 64), memoryMib: num('FF_FAKE_MEMORY_MIB', 262_144), diskMib: num('FF_FAKE_DISK_MIB', 4_194_304) },
          latency,
          heartbeatMs: num('FF_HEARTBEAT_INTERVAL_MS', 500),
          concurrency: num('FF_STEP_CONCURRENCY', 16),
          state: env.FF_FAKE_STATE === 'memory' ? 'memory' : 'files',
          failImages: env.FF_FAKE_FAIL_IMAGES === '1',
        },
        log.child({ hostId }),
      ),
    );
  }
  process.stdout.write(`${JSON.stringify({ ready: true, hosts })}\n`);
  let stopping = false;
  const stop = (): void => {
    if (stopping) return;
    stopping = true;
    void Promise.allSettled(agents.map((a) => a.stop()))
      .then(() => nc.drain())
      .finally(() => process.exit(0));
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

main().catch((err: unknown) => {
  process.stderr.write(`fake-agent: ${err instanceof Error ? err.stack : String(err)}\n`);
  process.exit(1);
});
