// Network namespaces for tests and benchmarks: N "hosts", each in its own namespace,
// joined by veth pairs to a bridge that lives in a separate "switch" namespace, with
// addresses in a private /24 that exists only inside these namespaces. Optional tbf shaping
// on each host's egress. Everything is deleted by `destroy()` (processes by PID first).
import { execFileSync, spawn } from 'node:child_process';
import type { ChildProcess } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { spawnManaged, type ManagedProcess } from '../../../services/testkit/proc.ts';
import { ensurePeerCert } from '../../../deploy/pki/pki.ts';
import { noteForReaper } from '../tied.ts';

/** Agents run with a larger libuv pool: chunk fsyncs then overlap (ext4 commits them together). */
const agentEnv: NodeJS.ProcessEnv = { ...process.env, UV_THREADPOOL_SIZE: process.env.UV_THREADPOOL_SIZE ?? '16' };

function ip(args: readonly string[]): void {
  execFileSync('ip', [...args], { stdio: ['ignore', 'ignore', 'pipe'] });
}

export interface NsHost {
  readonly ns: string;
  /** The host's interface name inside its namespace. */
  readonly ifname: string;
  readonly address: string;
}

export interface Fabric {
  readonly hosts: readonly NsHost[];
  /** Shapes a host's egress with tbf (rate like '1gbit'). */
  shape(host: NsHost, rate: string, burst?: string): void;
  /** Removes the root qdisc (the tbf of shape()) from a host's interface: unshaped again. Fails if there is none to remove. */
  unshape(host: NsHost): void;
  /**
   * tx+rx byte counters of a host's interface (the veth's). The veth carries GSO packets of up
   * to 64 KiB and counts each with one set of headers; on a shaped link the root tbf's own
   * counter (`tc -s -j qdisc show`, host-agent/bench/transfer-link.ts) counts what the link
   * carried (every segment's headers), ~4% more for bulk TCP.
   */
  counters(host: NsHost): { tx: number; rx: number };
  /** A long-running process inside a namespace, tracked by PID (watchdog included). */
  spawn(host: NsHost, name: string, args: readonly string[], logPath: string): ManagedProcess;
  /** Runs a command inside a namespace to completion; resolves with exit code and output. */
  run(host: NsHost, args: readonly string[], timeoutMs?: number): Promise<{ code: number | null; stdout: string; stderr: string }>;
  destroy(): Promise<void>;
}

/** Creates `n` host namespaces on a bridge. Requires root (ip netns). */
export function createFabric(n: number, prefix = 'ff-t'): Fabric {
  const tag = randomBytes(3).toString('hex');
  const sw = `${prefix}-${tag}-sw`;
  const subnet = `10.213.${Math.floor(Math.random() * 250) + 1}`;
  const hosts: NsHost[] = [];
  const procs = new Set<ManagedProcess>();
  const children = new Set<ChildProcess>();
  const created: string[] = [];
  const destroy = async (): Promise<void> => {
    await Promise.all([...procs].map((p) => p.stop(2000)));
    for (const c of children) {
      if (c.pid !== undefined && c.exitCode === null) {
        try {
          process.kill(c.pid, 'SIGKILL');
        } catch {
          /* gone */
        }
      }
    }
    // Deleting a namespace deletes the veth ends inside it (and so their peers).
    for (const ns of created.reverse()) {
      try {
        ip(['netns', 'del', ns]);
      } catch {
        /* already gone */
      }
    }
    created.length = 0;
  };
  try {
    ip(['netns', 'add', sw]);
    created.push(sw);
    noteForReaper({ netns: sw });
    ip(['-n', sw, 'link', 'add', 'br0', 'type', 'bridge']);
    ip(['-n', sw, 'link', 'set', 'br0', 'up']);
    for (let i = 0; i < n; i++) {
      const ns = `${prefix}-${tag}-h${i}`;
      ip(['netns', 'add', ns]);
      created.push(ns);
      noteForReaper({ netns: ns });
      const ifname = 'eth0';
      ip(['-n', ns, 'link', 'add', ifname, 'type', 'veth', 'peer', 'name', `p${i}`, 'netns', sw]);
      ip(['-n', sw, 'link', 'set', `p${i}`, 'master', 'br0']);
      ip(['-n', sw, 'link', 'set', `p${i}`, 'up']);
      const address = `${subnet}.${i + 1}`;
      ip(['-n', ns, 'addr', 'add', `${address}/24`, 'dev', ifname]);
      ip(['-n', ns, 'link', 'set', ifname, 'up']);
      ip(['-n', ns, 'link', 'set', 'lo', 'up']);
      hosts.push({ ns, ifname, address });
    }
  } catch (e) {
    void destroy();
    throw e;
  }
  return {
    hosts,
    shape(host, rate, burst = '256kb') {
      execFileSync('ip', ['netns', 'exec', host.ns, 'tc', 'qdisc', 'replace', 'dev', host.ifname, 'root', 'tbf', 'rate', rate, 'burst', burst, 'latency', '5ms']);
    },
    unshape(host) {
      execFileSync('ip', ['netns', 'exec', host.ns, 'tc', 'qdisc', 'del', 'dev', host.ifname, 'root'], { stdio: ['ignore', 'ignore', 'pipe'] });
    },
    counters(host) {
      const read = (what: string): number =>
        Number(execFileSync('ip', ['netns', 'exec', host.ns, 'cat', `/sys/class/net/${host.ifname}/statistics/${what}`]).toString().trim());
      return { tx: read('tx_bytes'), rx: read('rx_bytes') };
    },
    spawn(host, name, args, logPath) {
      // `ip netns exec` execs the command after setns: the PID is the command's own.
      const p = spawnManaged({ name, command: 'ip', args: ['netns', 'exec', host.ns, ...args], logPath, env: agentEnv });
      procs.add(p);
      void p.exited.then(() => procs.delete(p));
      return p;
    },
    run(host, args, timeoutMs = 60_000) {
      return new Promise((resolve, reject) => {
        const c = spawn('ip', ['netns', 'exec', host.ns, ...args], { stdio: ['ignore', 'pipe', 'pipe'], env: agentEnv });
        children.add(c);
        let stdout = '';
        let stderr = '';
        c.stdout.on('data', (b: Buffer) => (stdout += b.toString()));
        c.stderr.on('data', (b: Buffer) => (stderr += b.toString()));
        const t = setTimeout(() => c.kill('SIGKILL'), timeoutMs);
        c.once('error', reject);
        c.once('exit', (code) => {
          clearTimeout(t);
          children.delete(c);
          resolve({ code, stdout, stderr });
        });
      });
    },
    destroy,
  };
}

/** Reads a log file written by a spawned process (for assertions and failure messages). */
export function readLog(path: string): string {
  try {
    return readFileSync(path, 'utf8');
  } catch {
    return '';
  }
}

/**
 * endpoint-main.ts's --tls-* arguments for `hostId` at `address`: its peer certificate from
 * `ca` (made in `dir` as <name>.crt/.key, where `name` defaults to the host id).
 */
export function endpointTlsArgs(ca: { caCert: string; caKey: string }, dir: string, hostId: string, address: string, name = hostId): string[] {
  const pair = { cert: join(dir, `${name}.crt`), key: join(dir, `${name}.key`) };
  ensurePeerCert(ca, pair, hostId, address);
  return ['--tls-ca', ca.caCert, '--tls-cert', pair.cert, '--tls-key', pair.key];
}
