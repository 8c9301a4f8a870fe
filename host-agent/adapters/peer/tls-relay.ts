// TLS for migration streams outside QEMU (ADR 0015, "TLS relays"). QEMU's own TLS channel
// sends every 4 KiB guest page and every 8-byte page header as a TLS record of its own, one
// sendmsg each (67k syscalls for a 140 MB stream, strace), which made a TLS stream take about
// twice as long as a plain one here. With a relay, QEMU speaks plain text to a unix socket
// on its own host and a socat process (OpenSSL, 256 KiB buffers, 16 KiB records) carries the
// stream between the hosts:
//   source:      QEMU --unix--> socat UNIX-LISTEN  ==TLS==>  socat OPENSSL-LISTEN --unix--> QEMU :destination
// Both ends present their host's certificate (QEMU's tls-creds-x509 directory, tls.ts
// writeQemuTlsDir) and each checks that the other's names the host it expects
// (`forkfleet-host-<id>`): the source the host that asked for the stream, the destination the
// source it asked. The destination also takes a connection only from the source's address.
// Each relay carries one stream, then exits. A relay is our child process and dies with the
// agent (PR_SET_PDEATHSIG through setpriv); it also gives up on its own when its peer does not
// come (accept-timeout) or the stream stalls (-T).
import { spawn, type ChildProcess } from 'node:child_process';
import { writeFileSync } from 'node:fs';
import { isIP } from 'node:net';
import { join } from 'node:path';
import { PEER_CN_PREFIX } from './peer-identity.ts';
import { onPath, tiedToUs } from '../tied.ts';

/** socat's path, or undefined when it is not installed (streams then use QEMU's TLS). */
export function findSocat(): string | undefined {
  return onPath('socat');
}

export interface RelayOptions {
  /** socat's path (findSocat). */
  readonly socat: string;
  /** This host's certificates in QEMU's layout (ca-cert.pem, server-*.pem, client-*.pem). */
  readonly tlsDir: string;
  /** The unix socket on this host: QEMU's end of the stream. */
  readonly unixPath: string;
  /** The host id the other end's certificate must name. */
  readonly peerHostId: string;
  /** How long to wait for the other end's connection (ms). */
  readonly acceptTimeoutMs: number;
  /** A stream with nothing moving for this long is given up (ms; default 60 s). */
  readonly idleTimeoutMs?: number;
}

/** One relay process. */
export interface Relay {
  readonly pid: number;
  /** Resolves when the process has exited (never rejects). */
  readonly exited: Promise<{ code: number | null; peerVerified: boolean; log: string }>;
  /** Ends the process if it still runs; resolves once it has exited. */
  stop(): Promise<void>;
}

// What a value in a socat address may be made of. socat gives meaning to much else: ',' ':'
// and '!!' separate options and addresses, quotes and backslashes are parsed (an unbalanced
// quote made it read past the end of the argument), so this is a list of what is safe rather
// than of what is not. Paths are the agent's own directories; host ids are [a-z0-9-].
const SAFE = /^[A-Za-z0-9._/+-]+$/;

function checkValue(what: string, v: string): string {
  if (!SAFE.test(v)) throw new Error(`TLS relay: ${what} ${JSON.stringify(v)} cannot be passed to socat`);
  return v;
}

function tlsOptions(o: RelayOptions, role: 'server' | 'client'): string {
  const d = checkValue('certificate directory', o.tlsDir);
  return [`cert=${d}/${role}-cert.pem`, `key=${d}/${role}-key.pem`, `cafile=${d}/ca-cert.pem`, 'verify=1', `commonname=${checkValue('host id', PEER_CN_PREFIX + o.peerHostId)}`, 'openssl-min-proto-version=TLS1.2'].join(',');
}

const seconds = (ms: number): string => (Math.max(1, ms) / 1000).toFixed(3);

// OpenSSL settings of the relays (OPENSSL_CONF). No TLS 1.3 session tickets: the server sends
// them after the handshake, and a source QEMU with its own TLS (hosts still on
// FF_PEER_MIGRATION_TLS=qemu) never reads its socket while it streams, so they sat unread and
// its connection was reset at the end (the driver test of mixed ends showed it). Nothing here
// resumes sessions: each relay makes one connection.
const OPENSSL_CNF = `openssl_conf = forkfleet_relay
[forkfleet_relay]
ssl_conf = ssl_sect
[ssl_sect]
system_default = system_default_sect
[system_default_sect]
MinProtocol = TLSv1.2
NumTickets = 0
`;

const confWritten = new Set<string>();

/** The relays' OpenSSL configuration, written next to the certificates once per process. */
function opensslConf(tlsDir: string): string {
  const path = join(tlsDir, 'relay-openssl.cnf');
  if (!confWritten.has(path)) {
    writeFileSync(path, OPENSSL_CNF, { mode: 0o600 });
    confWritten.add(path);
  }
  return path;
}

function start(o: RelayOptions, addresses: [string, string], onLine: (line: string) => void): Relay {
  const args = ['-d', '-d', '-b', '262144', '-T', seconds(o.idleTimeoutMs ?? 60_000), ...addresses];
  const [cmd, argv] = tiedToUs(o.socat, args);
  const env = { ...process.env, OPENSSL_CONF: opensslConf(o.tlsDir) };
  const child: ChildProcess = spawn(cmd, argv, { stdio: ['ignore', 'ignore', 'pipe'], env });
  let log = '';
  let peerVerified = false;
  let partial = '';
  // Listened to before anything else: a spawn that fails (ENOENT, EAGAIN, EMFILE) emits
  // 'error' on the next tick, and an 'error' nobody listens to ends the agent.
  const exited = new Promise<{ code: number | null; peerVerified: boolean; log: string }>((resolve) => {
    child.once('error', (e) => resolve({ code: null, peerVerified, log: log + `${e.message}\n` }));
    child.once('close', (code) => resolve({ code, peerVerified, log }));
  });
  if (child.pid === undefined) throw new Error(`TLS relay: could not start ${o.socat}`);
  child.stderr?.setEncoding('utf8');
  child.stderr?.on('data', (s: string) => {
    const lines = (partial + s).split('\n');
    partial = lines.pop() ?? '';
    for (const line of lines) {
      // Kept for error messages; socat says a few dozen lines per stream.
      if (log.length < 8192) log += `${line}\n`;
      if (line.includes('commonName matches')) peerVerified = true;
      onLine(line);
    }
  });
  return {
    pid: child.pid,
    exited,
    async stop() {
      if (child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
      await exited;
    },
  };
}

/** `host` as socat's bind/range syntax needs it, with the address family option. */
function socatHost(host: string): { pf: string; bind: string; range: string } {
  const v = isIP(host);
  if (v === 4) return { pf: 'pf=ip4', bind: host, range: `${host}/32` };
  if (v === 6) return { pf: 'pf=ip6', bind: `[${host}]`, range: `[${host}]/128` };
  throw new Error(`TLS relay: ${JSON.stringify(host)} is not an IP address`);
}

/**
 * Destination end: listens once on `bindHost` (a free port), takes one connection from
 * `fromHost` whose certificate names `peerHostId`, and relays the stream in plain text to the
 * unix socket at `unixPath` (QEMU's `migrate-incoming unix:`), retrying until it listens.
 * Resolves once listening, with the port. `verified` resolves when the source has connected
 * and proved who it is; it never resolves if the relay ends first.
 */
export async function listenRelay(o: RelayOptions & { readonly bindHost: string; readonly fromHost: string; readonly unixWaitMs?: number }): Promise<Relay & { port: number; verified: Promise<void> }> {
  const b = socatHost(o.bindHost);
  const from = socatHost(o.fromHost);
  const path = checkValue('socket path', o.unixPath);
  let onPort: (p: number) => void = () => undefined;
  let onVerified: () => void = () => undefined;
  const port = new Promise<number>((r) => (onPort = r));
  const verified = new Promise<void>((r) => (onVerified = r));
  const listen = `OPENSSL-LISTEN:0,${b.pf},bind=${b.bind},range=${from.range},backlog=1,accept-timeout=${seconds(o.acceptTimeoutMs)},${tlsOptions(o, 'server')}`;
  // QEMU listens only once the load has started (after the source proved who it is, and this
  // host has its disk layer and QEMU ready, which may take longer than the source took to
  // connect): retried every 10 ms (a failed connect costs microseconds; the stream waits for
  // the first success), for `unixWaitMs`.
  const unix = `UNIX-CONNECT:${path},retry=${Math.ceil((o.unixWaitMs ?? o.acceptTimeoutMs) / 10)},interval=0.01`;
  const relay = start(o, [listen, unix], (line) => {
    const m = / listening on AF=\d+ .*:(\d+)\s*$/.exec(line);
    if (m) onPort(Number(m[1]));
    if (line.includes('commonName matches')) onVerified();
  });
  const p = await Promise.race([port, relay.exited.then((r) => r)]);
  if (typeof p !== 'number') throw new Error(`TLS relay did not listen (exit ${p.code}): ${p.log.trim().split('\n').slice(-3).join(' | ')}`);
  return { ...relay, port: p, verified };
}

/**
 * Source end: listens on the unix socket at `unixPath` for QEMU's connection (`migrate
 * unix:`) and relays it over TLS to `host:port`, whose certificate must name `peerHostId`.
 * Resolves once the unix socket listens.
 */
export async function connectRelay(o: RelayOptions & { readonly host: string; readonly port: number }): Promise<Relay> {
  const h = socatHost(o.host);
  const path = checkValue('socket path', o.unixPath);
  let onListening: () => void = () => undefined;
  const listening = new Promise<void>((r) => (onListening = r));
  const unix = `UNIX-LISTEN:${path},unlink-early,backlog=1,accept-timeout=${seconds(o.acceptTimeoutMs)}`;
  const connect = `OPENSSL-CONNECT:${h.bind}:${o.port},${h.pf},connect-timeout=${seconds(o.acceptTimeoutMs)},${tlsOptions(o, 'client')}`;
  const relay = start(o, [unix, connect], (line) => {
    if (/ listening on AF=1 /.test(line)) onListening();
  });
  const r = await Promise.race([listening.then(() => undefined), relay.exited]);
  if (r) throw new Error(`TLS relay did not listen (exit ${r.code}): ${r.log.trim().split('\n').slice(-3).join(' | ')}`);
  return relay;
}
