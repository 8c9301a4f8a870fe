// Starts a real etcd (Debian's etcd-server) for integration tests: free loopback ports,
// a temporary data directory, stopped by PID.
import { rmSync } from 'node:fs';
import { join } from 'node:path';
import { freePort, onFreshPorts, spawnManaged, tempDir, waitReady } from './proc.ts';
import type { ManagedProcess } from './proc.ts';

export interface EtcdMember {
  readonly name: string;
  readonly clientUrl: string;
  readonly peerUrl: string;
  /** The running process (a new one after restart()). */
  proc: ManagedProcess;
  /** Stops the member and starts it again on its data directory and ports; resolves when healthy. */
  restart(): Promise<void>;
}

export interface EtcdCluster {
  readonly members: readonly EtcdMember[];
  /** Client endpoints of all members. */
  readonly endpoints: string[];
  stop(): Promise<void>;
}

async function healthy(clientUrl: string): Promise<boolean> {
  const res = await fetch(`${clientUrl}/health`, { signal: AbortSignal.timeout(500) });
  if (!res.ok) return false;
  const body = (await res.json()) as { health?: string };
  return body.health === 'true';
}

/** Starts a cluster of `size` members (1 or 3 typically) on loopback. */
/** `args`: more etcd flags, e.g. a small --quota-backend-bytes. */
export async function startEtcd(opts: { size?: number; binary?: string; logDir?: string; args?: string[] } = {}): Promise<EtcdCluster> {
  return onFreshPorts(() => startEtcdOnce(opts));
}

async function startEtcdOnce(opts: { size?: number; binary?: string; logDir?: string; args?: string[] } = {}): Promise<EtcdCluster> {
  const size = opts.size ?? 1;
  const specs: Array<{ name: string; clientPort: number; peerPort: number }> = [];
  for (let i = 0; i < size; i++) specs.push({ name: `n${i + 1}`, clientPort: await freePort(), peerPort: await freePort() });
  const initialCluster = specs.map((s) => `${s.name}=http://127.0.0.1:${s.peerPort}`).join(',');
  const members: EtcdMember[] = specs.map((s) => {
    const dir = tempDir(`ff-etcd-${s.name}-`);
    const clientUrl = `http://127.0.0.1:${s.clientPort}`;
    const peerUrl = `http://127.0.0.1:${s.peerPort}`;
    const launch = (): ManagedProcess => spawnManaged({
      name: `etcd-${s.name}`,
      command: opts.binary ?? 'etcd',
      args: [
        '--name', s.name,
        '--data-dir', join(dir, 'data'),
        '--listen-client-urls', clientUrl,
        '--advertise-client-urls', clientUrl,
        '--listen-peer-urls', peerUrl,
        '--initial-advertise-peer-urls', peerUrl,
        '--initial-cluster', initialCluster,
        '--initial-cluster-state', 'new',
        '--heartbeat-interval', '10',
        '--election-timeout', '100',
        '--max-txn-ops', '1024',
        '--logger', 'zap',
        '--log-level', 'error',
        ...(opts.args ?? []),
      ],
      dir,
      // The cluster removes it at stop(): a restart keeps the data.
      removeDirOnStop: false,
      logPath: opts.logDir ? join(opts.logDir, `etcd-${s.name}.log`) : join(dir, 'etcd.log'),
    });
    const m: EtcdMember = {
      name: s.name,
      clientUrl,
      peerUrl,
      proc: launch(),
      async restart() {
        await m.proc.stop();
        m.proc = launch();
        await waitReady(m.proc, `etcd ${s.name} healthy again`, () => healthy(clientUrl), 15_000);
      },
    };
    return m;
  });
  const cluster: EtcdCluster = {
    members,
    endpoints: members.map((m) => m.clientUrl),
    async stop() {
      // One at a time: stopping all members at once makes the last one hang (VMM-NOTES).
      for (const m of members) await m.proc.stop();
      for (const m of members) if (m.proc.dir) rmSync(m.proc.dir, { recursive: true, force: true });
    },
  };
  try {
    await Promise.all(members.map((m) => waitReady(m.proc, `etcd ${m.name} healthy`, () => healthy(m.clientUrl), 20_000)));
  } catch (e) {
    await cluster.stop();
    throw e;
  }
  return cluster;
}
