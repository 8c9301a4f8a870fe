// Starts a real nats-server with JetStream for integration tests: free loopback ports,
// a temporary store directory, stopped by PID.
import { rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { createNkeyFile, hostPermissions, natsServerAuthConfig } from '../adapters/nats/auth.ts';
import type { NatsPermissions } from '../adapters/nats/auth.ts';
import { freePort, onFreshPorts, spawnManaged, tempDir, waitReady } from './proc.ts';
import type { ManagedProcess } from './proc.ts';

export interface NatsServer {
  readonly url: string;
  readonly port: number;
  readonly monitorPort: number;
  readonly storeDir: string;
  proc: ManagedProcess;
  /** Set when started with `auth`: NKey seed files (mode 0600) for the scheduler and each host. */
  readonly auth?: { schedulerSeedFile: string; hostSeedFile: (hostId: string) => string };
  /** Stops the server (SIGTERM) and starts it again on the same port and store, after `downMs` (0). */
  restart(downMs?: number): Promise<void>;
  stop(): Promise<void>;
}

/** Generous: a loaded CI machine (TCG guests on 2 cores) can take seconds to start it. */
const READY_MS = 20_000;

async function ready(monitorPort: number): Promise<boolean> {
  const res = await fetch(`http://127.0.0.1:${monitorPort}/healthz?js-enabled-only=true`, { signal: AbortSignal.timeout(500) });
  return res.ok;
}

/**
 * `auth.hosts`: turn on NKey authentication with the production permissions
 * (services/adapters/nats/auth.ts): a scheduler user with full rights and one user per host.
 * Without it the server is open, as before.
 */
export async function startNats(opts: {
  binary?: string;
  logDir?: string;
  /** `permissions`: a host user's rights (default hostPermissions; tests give an older config's). */
  auth?: { hosts: string[]; permissions?: (hostId: string) => NatsPermissions };
  /** Where ports come from (default freePort); tests use it to hand out a taken one. */
  pickPort?: () => Promise<number>;
} = {}): Promise<NatsServer> {
  const pickPort = opts.pickPort ?? (() => freePort());
  const dir = tempDir('ff-nats-');
  const storeDir = join(dir, 'js');
  const confArgs: string[] = [];
  let auth: NatsServer['auth'];
  if (opts.auth) {
    const sched = createNkeyFile(join(dir, 'scheduler.nk'));
    const hosts = new Map(opts.auth.hosts.map((h) => [h, createNkeyFile(join(dir, `host-${h}.nk`))]));
    const conf = join(dir, 'auth.conf');
    writeFileSync(conf, natsServerAuthConfig([{ nkey: sched.publicKey }, ...[...hosts].map(([h, c]) => ({ nkey: c.publicKey, permissions: (opts.auth!.permissions ?? hostPermissions)(h) }))]), { mode: 0o600 });
    confArgs.push('-c', conf);
    auth = {
      schedulerSeedFile: sched.seedFile,
      hostSeedFile: (h) => {
        const c = hosts.get(h);
        if (!c) throw new Error(`startNats: no credential for host ${h} (pass it in auth.hosts)`);
        return c.seedFile;
      },
    };
  }
  const launch = (port: number, monitorPort: number): ManagedProcess =>
    spawnManaged({
      name: 'nats-server',
      command: opts.binary ?? 'nats-server',
      args: [...confArgs, '-js', '-a', '127.0.0.1', '-p', String(port), '-m', String(monitorPort), '-sd', storeDir],
      // The directory survives a restart; server.stop() removes it (and the watchdog, if we die).
      dir,
      // Its own directory: nats-server writes a lost consumer's meta.inf relative to its
      // working directory (ensureWorkConsumer), which must not be the repository.
      cwd: dir,
      removeDirOnStop: false,
      logPath: opts.logDir ? join(opts.logDir, 'nats.log') : join(dir, 'nats.log'),
    });
  const started = await onFreshPorts(async () => {
    const port = await pickPort();
    const monitorPort = await pickPort();
    const proc = launch(port, monitorPort);
    try {
      await waitReady(proc, 'nats-server ready', () => ready(monitorPort), READY_MS);
    } catch (e) {
      await proc.stop();
      throw e;
    }
    return { port, monitorPort, proc };
  }).catch((e: unknown) => {
    rmSync(dir, { recursive: true, force: true });
    throw e;
  });
  const { port, monitorPort } = started;
  const server: NatsServer = {
    url: `nats://127.0.0.1:${port}`,
    port,
    monitorPort,
    storeDir,
    ...(auth ? { auth } : {}),
    proc: started.proc,
    async restart(downMs = 0) {
      await server.proc.stop();
      if (downMs > 0) await new Promise((r) => setTimeout(r, downMs));
      server.proc = launch(port, monitorPort);
      await waitReady(server.proc, 'nats-server ready after restart', () => ready(monitorPort), READY_MS);
    },
    async stop() {
      await server.proc.stop();
      rmSync(dir, { recursive: true, force: true });
    },
  };
  return server;
}
