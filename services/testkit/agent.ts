// Starts a real host-agent process (node --import tsx host-agent/main.ts) for integration
// tests, optionally inside a network namespace, with its own data directory.
import { execFileSync } from 'node:child_process';
import { join, resolve } from 'node:path';
import { readFileSync, rmSync } from 'node:fs';
import { spawnManaged, tempDir, waitFor } from './proc.ts';
import { qemuPids, standbyPids } from '../../deploy/fleet/fleet.ts';
import type { ManagedProcess } from './proc.ts';

const ROOT = resolve(import.meta.dirname, '..', '..');

function tmpfsMounted(path: string): boolean {
  return readFileSync('/proc/self/mountinfo', 'utf8').split('\n').some((l) => l.split(' ')[4] === path);
}

export interface AgentProcess {
  readonly hostId: string;
  readonly dataDir: string;
  proc: ManagedProcess;
  readonly logPath: string;
  /** Starts it again with the same id and data directory (after a kill). */
  restart(): Promise<void>;
  stop(): Promise<void>;
  /** PIDs of QEMU processes the agent's VMs run in (from their pid files). */
  qemuPids(): number[];
  /** Stops the agent, kills every QEMU it left by PID and removes its data directory. */
  teardown(): Promise<void>;
}

export interface StartAgentOptions {
  hostId: string;
  natsUrl: string;
  trustedKeyPath: string;
  /** Short: unix socket paths must stay under 107 bytes. */
  dataDir?: string;
  peerAddr?: string;
  netns?: string;
  env?: Record<string, string>;
  logDir?: string;
}

export async function startAgent(o: StartAgentOptions): Promise<AgentProcess> {
  // Only one made here is the reaper's: a caller's data directory is the caller's to keep or remove.
  const dataDir = o.dataDir ?? tempDir(`ffa-${o.hostId}-`);
  // The agent's RAM tmpfs (ADR 0016) is its own, inside its data directory: teardown unmounts it.
  const ramMount = join(dataDir, 'ram');
  const logPath = join(o.logDir ?? dataDir, `agent-${o.hostId}.log`);
  const env: NodeJS.ProcessEnv = {
    ...process.env,
    FF_HOST_ID: o.hostId,
    FF_DATA_DIR: dataDir,
    FF_NATS_URL: o.natsUrl,
    FF_TRUSTED_KEY: o.trustedKeyPath,
    FF_ACCEL: 'auto',
    FF_PEER_ADDR: o.peerAddr ?? '127.0.0.1:0',
    FF_HEARTBEAT_INTERVAL: '500ms',
    FF_LOG_LEVEL: 'info',
    FF_RAM_MOUNT: ramMount,
    // No guests cgroup (ADR 0018): it would outlive the test; cgroup.int and the fleet e2e cover it.
    FF_GUEST_CGROUP: '',
    // Tests stop agents mid-step on purpose: a short wait for running steps (the default is 20 s).
    FF_SHUTDOWN_GRACE: '2s',
    ...o.env,
  };
  const launch = (): ManagedProcess => {
    const node = [process.execPath, '--import', 'tsx', join(ROOT, 'host-agent', 'main.ts')];
    const [command, ...args] = o.netns ? ['ip', 'netns', 'exec', o.netns, ...node] : node;
    return spawnManaged({ name: `agent-${o.hostId}`, command: command!, args, env, logPath, watchdog: true });
  };
  const ready = async (p: ManagedProcess): Promise<void> =>
    waitFor(`agent ${o.hostId} ready`, async () => {
      if (p.child.exitCode !== null) throw new Error(`agent ${o.hostId} exited: ${readFileSync(logPath, 'utf8').slice(-2000)}`);
      return readFileSync(logPath, 'utf8').includes('"ready":true');
    }, 60_000, 100);
  let first: ManagedProcess;
  try {
    first = launch();
  } catch (e) {
    // Not started (e.g. its log directory is missing): the data directory made for it goes too.
    if (!o.dataDir) rmSync(dataDir, { recursive: true, force: true });
    throw e;
  }
  const agent: AgentProcess = {
    hostId: o.hostId,
    dataDir,
    logPath,
    proc: first,
    async restart() {
      await agent.proc.stop();
      agent.proc = launch();
      await ready(agent.proc);
    },
    async stop() {
      await agent.proc.stop(10_000);
    },
    qemuPids() {
      return qemuPids(dataDir);
    },
    async teardown() {
      await agent.stop();
      for (const pid of [...agent.qemuPids(), ...standbyPids(dataDir)]) {
        try {
          process.kill(pid, 'SIGKILL');
        } catch {
          /* gone */
        }
      }
      // Mounted in this mount namespace only when the agent ran outside a network namespace.
      if (tmpfsMounted(ramMount)) execFileSync('umount', [ramMount]);
      rmSync(dataDir, { recursive: true, force: true });
    },
  };
  await ready(agent.proc);
  return agent;
}
