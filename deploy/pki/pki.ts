// Dev PKI: a private CA and a server certificate for the scheduler's TLS endpoint, made with
// the `openssl` CLI (Debian package `openssl`, installed by deploy/setup.sh). Idempotent:
// an existing CA is reused; a certificate is re-issued only when it is missing, was not
// signed by this CA, lacks a wanted SAN or extended key usage, has another CN, or expires
// within 30 days. Keys are written mode 0600. deploy/hosts/render.ts also issues client
// certificates (etcd, NATS) and certificates that are both (etcd members and NATS servers
// dial their peers with theirs).
//
//   node --import tsx deploy/pki/pki.ts DIR [--san DNS:name|IP:addr ...]
//
// DIR/ca.crt (give it to clients: FF_CA / FF_TLS_CA), DIR/ca.key, DIR/server.crt, DIR/server.key.
import { execFileSync } from 'node:child_process';
import { chmodSync, existsSync, mkdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { X509Certificate } from 'node:crypto';
import { join, resolve } from 'node:path';
import { peerCertificateCn } from '../../host-agent/adapters/peer/peer-identity.ts';

export const DEFAULT_SANS: readonly string[] = ['DNS:localhost', 'IP:127.0.0.1', 'IP:::1'];

export interface DevPki {
  readonly dir: string;
  readonly caCert: string;
  readonly caKey: string;
  readonly serverCert: string;
  readonly serverKey: string;
}

function openssl(args: string[]): void {
  try {
    execFileSync('openssl', args, { stdio: ['ignore', 'ignore', 'pipe'] });
  } catch (e) {
    const err = e as { stderr?: Buffer; message: string };
    throw new Error(`openssl ${args[0]} failed: ${err.stderr?.toString().trim() || err.message}`, { cause: e });
  }
}

/** SANs of a certificate in openssl's form ("DNS:localhost", "IP:127.0.0.1", "IP:::1"). */
function sansOf(cert: X509Certificate): Set<string> {
  const out = new Set<string>();
  for (const part of (cert.subjectAltName ?? '').split(',')) {
    const [kind, value] = part.trim().split(/:(.*)/s);
    if (!kind || value === undefined) continue;
    // Node prints IPv6 expanded (0:0:0:0:0:0:0:1); normalise the loopback we ask for.
    out.add(`${kind === 'IP Address' ? 'IP' : kind}:${value === '0:0:0:0:0:0:0:1' ? '::1' : value}`);
  }
  return out;
}

/** A certificate is re-issued when it expires within this long (they are issued for 825 days). */
export const RENEW_BEFORE_MS = 30 * 86_400_000;

/** What a certificate is for: its extended key usages (a TLS server, a TLS client, or both). */
export type CertUse = 'server' | 'client' | 'server+client';

const EKU: Record<CertUse, { names: string; oids: readonly string[] }> = {
  server: { names: 'serverAuth', oids: ['1.3.6.1.5.5.7.3.1'] },
  client: { names: 'clientAuth', oids: ['1.3.6.1.5.5.7.3.2'] },
  'server+client': { names: 'serverAuth,clientAuth', oids: ['1.3.6.1.5.5.7.3.1', '1.3.6.1.5.5.7.3.2'] },
};

function certOk(ca: { caCert: string }, cert: { cert: string; key: string }, o: { sans: readonly string[]; cn: string; use: CertUse }): boolean {
  if (!existsSync(cert.cert) || !existsSync(cert.key)) return false;
  try {
    const caCert = new X509Certificate(readFileSync(ca.caCert));
    const c = new X509Certificate(readFileSync(cert.cert));
    if (!c.verify(caCert.publicKey) || Date.parse(c.validTo) < Date.now() + RENEW_BEFORE_MS) return false;
    const have = sansOf(c);
    const usages = c.keyUsage ?? [];
    return o.sans.every((s) => have.has(s)) && EKU[o.use].oids.every((oid) => usages.includes(oid)) && c.subject.split('\n').includes(`CN=${o.cn}`);
  } catch {
    return false;
  }
}

/** Makes (or reuses) a CA: `caCert` and `caKey` (0600) in their directory. */
export function ensureCa(caCert: string, caKey: string, subject = '/CN=Forkfleet dev CA'): void {
  if (existsSync(caCert) && existsSync(caKey)) return;
  openssl(['req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes', '-keyout', caKey, '-out', caCert, '-days', '3650',
    '-subj', subject, '-addext', 'basicConstraints=critical,CA:TRUE', '-addext', 'keyUsage=critical,keyCertSign,cRLSign']);
  chmodSync(caKey, 0o600);
}

/**
 * Issues (or keeps) a certificate signed by the CA for `use`, with these SANs ("DNS:name",
 * "IP:addr"; a client certificate may have none) and this CN: re-issued only when missing, not
 * signed by this CA, expiring within RENEW_BEFORE_MS, lacking a SAN or the usage, or of another
 * CN. The key is written mode 0600.
 */
export function ensureCert(ca: { caCert: string; caKey: string }, cert: { cert: string; key: string }, o: { sans: readonly string[]; cn: string; use: CertUse }): void {
  for (const s of o.sans) if (!/^(DNS:[A-Za-z0-9.*-]+|IP:[0-9a-fA-F.:]+)$/.test(s)) throw new Error(`SAN ${JSON.stringify(s)}: want DNS:name or IP:address`);
  if (!/^[A-Za-z0-9 ._-]+$/.test(o.cn)) throw new Error(`CN ${JSON.stringify(o.cn)}: want letters, digits, space, '.', '_' or '-'`);
  if (certOk(ca, cert, o)) return;
  const csr = `${cert.cert}.csr`;
  const ext = `${cert.cert}.ext`;
  writeFileSync(ext, `basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=${EKU[o.use].names}\n${o.sans.length ? `subjectAltName=${o.sans.join(',')}\n` : ''}`);
  try {
    openssl(['req', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes', '-keyout', cert.key, '-out', csr, '-subj', `/CN=${o.cn}`]);
    chmodSync(cert.key, 0o600);
    openssl(['x509', '-req', '-in', csr, '-CA', ca.caCert, '-CAkey', ca.caKey, '-set_serial', `0x${Date.now().toString(16)}${Math.floor(Math.random() * 65536).toString(16)}`, '-days', '825', '-extfile', ext, '-out', cert.cert]);
  } finally {
    rmSync(csr, { force: true });
    rmSync(ext, { force: true });
  }
}

/**
 * A host's peer certificate (mutual TLS between agents, host-agent/adapters/peer/tls.ts):
 * server and client use, CN forkfleet-host-<hostId>, its peer `address` as IP SAN.
 */
export function ensurePeerCert(ca: { caCert: string; caKey: string }, cert: { cert: string; key: string }, hostId: string, address: string): void {
  ensureCert(ca, cert, { sans: [`IP:${address}`], cn: peerCertificateCn(hostId), use: 'server+client' });
}

/**
 * A dev CA in `dir` (made once) and a peer certificate of it for `hostId` at `address`, read
 * back as PEM (the shape of host-agent's PeerTls): for tests and benchmarks that play hosts.
 */
export function devPeerTls(dir: string, hostId: string, address: string): { ca: Buffer; cert: Buffer; key: Buffer } {
  mkdirSync(dir, { recursive: true });
  const ca = { caCert: join(dir, 'ca.crt'), caKey: join(dir, 'ca.key') };
  ensureCa(ca.caCert, ca.caKey);
  const pair = { cert: join(dir, `${hostId}.crt`), key: join(dir, `${hostId}.key`) };
  ensurePeerCert(ca, pair, hostId, address);
  return { ca: readFileSync(ca.caCert), cert: readFileSync(pair.cert), key: readFileSync(pair.key) };
}

/** A TLS server certificate for these SANs (ensureCert with use 'server'). */
export function ensureServerCert(ca: { caCert: string; caKey: string }, cert: { serverCert: string; serverKey: string }, sans: readonly string[], cn = 'forkfleet-scheduler'): void {
  ensureCert(ca, { cert: cert.serverCert, key: cert.serverKey }, { sans, cn, use: 'server' });
}

/** Makes (or reuses) the dev CA and server certificate in `dir`. */
export function ensureDevPki(dir: string, extraSans: readonly string[] = []): DevPki {
  mkdirSync(dir, { recursive: true, mode: 0o700 });
  const p: DevPki = { dir, caCert: join(dir, 'ca.crt'), caKey: join(dir, 'ca.key'), serverCert: join(dir, 'server.crt'), serverKey: join(dir, 'server.key') };
  const sans = [...new Set([...DEFAULT_SANS, ...extraSans])];
  if (!existsSync(p.caCert) || !existsSync(p.caKey)) rmSync(p.serverCert, { force: true });
  ensureCa(p.caCert, p.caKey);
  ensureServerCert(p, p, sans);
  return p;
}

if (process.argv[1] && resolve(process.argv[1]) === resolve(import.meta.filename)) {
  const [dir, ...rest] = process.argv.slice(2);
  if (!dir) {
    process.stderr.write('usage: pki.ts DIR [--san DNS:name|IP:addr ...]\n');
    process.exit(2);
  }
  const sans = rest.flatMap((a, i) => (rest[i - 1] === '--san' ? [a] : []));
  try {
    process.stdout.write(`${JSON.stringify(ensureDevPki(dir, sans))}\n`);
  } catch (e) {
    process.stderr.write(`pki.ts: ${e instanceof Error ? e.message : String(e)}\n`);
    process.exit(1);
  }
}
