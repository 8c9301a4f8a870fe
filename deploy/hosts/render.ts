// Renders a real deployment from an inventory (inventory.ts): per machine, the files to copy
// onto its root file system, plus the secrets that tie the fleet together.
//
//   npm run deploy:render -- --inventory deploy/hosts/inventory.example.json --out DIR
//
// DIR/secrets/   the CA (its key never leaves here), the schedulers' signing key, NATS NKeys,
//                the NATS route password and the tokens file. Kept between renders: render
//                again after editing the inventory (a new host, a new scheduler) and only
//                what is missing is made; nothing is rotated.
// DIR/machines/<machine>/   everything that machine needs, laid out from / (copy with
//                `rsync -a DIR/machines/<machine>/ root@<machine>:/`):
//   etc/default/etcd                      an etcd member (Debian's etcd.service reads it)
//   etc/nats-server.conf                  a NATS server (Debian's nats-server.service reads it)
//   etc/systemd/system/nats-server.service.d/forkfleet.conf
//   etc/forkfleet/scheduler.env, etc/forkfleet/scheduler/*, etc/forkfleet/tokens.json,
//   etc/systemd/system/forkfleet-scheduler.service
//   etc/forkfleet/agent.env, etc/forkfleet/agent/*, etc/systemd/system/forkfleet-agent.service
// DIR/credentials.json   an admin token and the CA for the CLI and SDK (FF_CREDENTIALS=...)
// DIR/INSTALL.md         the steps, per machine, in order
//
// The renderer is split in two: `renderFiles` is pure (inventory + secrets -> files) and is
// what the tests check; `render` makes or reuses the secrets and writes the files.
import { chmodSync, existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, join, relative, resolve } from 'node:path';
import { createPublicKey, generateKeyPairSync, randomBytes } from 'node:crypto';
import { isIP } from 'node:net';
import { parseArgs } from 'node:util';
import { createNkeyFile, hostPermissions, type NatsUser } from '../../services/adapters/nats/auth.ts';
import { mintToken } from '../../services/auth/tokens.ts';
import { ensureCa, ensureServerCert } from '../pki/pki.ts';
import { hostPort, parseInventory, type Inventory } from './inventory.ts';

const UNITS = resolve(import.meta.dirname, 'units');

/** What ties the fleet together; made once per DIR/secrets (`ensureSecrets`). */
export interface Secrets {
  readonly caCert: string;
  /** PEM of each scheduler's TLS certificate and key, by scheduler name. */
  readonly schedulerTls: ReadonlyMap<string, { cert: string; key: string }>;
  readonly signingKey: string;
  readonly signingPub: string;
  /** NATS user NKeys: "scheduler" and "host-<id>". */
  readonly nkeys: ReadonlyMap<string, { seed: string; pub: string }>;
  readonly natsRoutePassword: string;
  /** The tokens file (digests only). */
  readonly tokensJson: string;
}

export interface RenderedFile {
  /** Relative to DIR: "machines/<machine>/etc/..." or a top-level file. */
  readonly path: string;
  readonly content: string;
  readonly mode: number;
}

/** Where a scheduler's secrets are once systemd has loaded them (LoadCredential in its unit). */
export const SCHEDULER_CREDENTIALS = '/run/credentials/forkfleet-scheduler.service';

const env = (vars: Record<string, string>, header: string): string =>
  `# ${header}\n# Rendered by deploy/hosts/render.ts; variables: services/config.ts and host-agent/config.ts.\n${Object.entries(vars)
    .map(([k, v]) => `${k}=${v}`)
    .join('\n')}\n`;

const unit = (name: string, inv: Inventory): string => readFileSync(join(UNITS, name), 'utf8').replaceAll('@INSTALL_DIR@', inv.installDir);

const san = (a: string): string => (isIP(a) ? `IP:${a}` : `DNS:${a}`);

/** Every machine's files, from the inventory and the secrets. Pure. */
export function renderFiles(inv: Inventory, s: Secrets): RenderedFile[] {
  const out: RenderedFile[] = [];
  const put = (machine: string, path: string, content: string, mode = 0o644): void => void out.push({ path: `machines/${machine}/${path}`, content, mode });
  const p = inv.ports;
  const etcdEndpoints = inv.etcd.map((m) => `http://${hostPort(m.address, p.etcdClient)}`).join(',');
  const natsUrls = inv.nats.map((m) => `nats://${hostPort(m.address, p.natsClient)}`).join(',');
  const replicas = inv.nats.length >= 3 ? 3 : 1;

  // etcd: Debian's etcd.service reads /etc/default/etcd (ETCD_* are etcd's flags).
  const initialCluster = inv.etcd.map((m) => `${m.name}=http://${hostPort(m.address, p.etcdPeer)}`).join(',');
  for (const m of inv.etcd) {
    put(m.machine, 'etc/default/etcd', env({
      ETCD_NAME: m.name,
      ETCD_DATA_DIR: '/var/lib/etcd/forkfleet',
      ETCD_LISTEN_CLIENT_URLS: `http://${hostPort(m.address, p.etcdClient)}`,
      ETCD_ADVERTISE_CLIENT_URLS: `http://${hostPort(m.address, p.etcdClient)}`,
      ETCD_LISTEN_PEER_URLS: `http://${hostPort(m.address, p.etcdPeer)}`,
      ETCD_INITIAL_ADVERTISE_PEER_URLS: `http://${hostPort(m.address, p.etcdPeer)}`,
      ETCD_INITIAL_CLUSTER: initialCluster,
      ETCD_INITIAL_CLUSTER_STATE: 'new',
      ETCD_INITIAL_CLUSTER_TOKEN: `forkfleet-${inv.name}`,
      // A fork of 256 children is one transaction of ~520 operations (services/adapters/etcd/keys.ts).
      ETCD_MAX_TXN_OPS: '1024',
      // ~1.2 KiB per child created within FF_RECORD_RETENTION, plus the live fleet (ADR 0017).
      ETCD_QUOTA_BACKEND_BYTES: String(8 * 2 ** 30),
    }, `etcd member ${m.name} of Forkfleet cluster ${inv.name}`));
  }

  // NATS: one config per server; JetStream, a cluster when there are several, NKey users.
  const users: NatsUser[] = [{ nkey: s.nkeys.get('scheduler')!.pub }, ...inv.hosts.map((h) => ({ nkey: s.nkeys.get(`host-${h.id}`)!.pub, permissions: hostPermissions(h.id) }))];
  for (const m of inv.nats) {
    const conf: Record<string, unknown> = {
      server_name: m.name,
      host: m.address,
      port: p.natsClient,
      http: hostPort(m.address, p.natsMonitor),
      jetstream: { store_dir: '/var/lib/nats/jetstream' },
      authorization: { users: users.map((u) => (u.permissions ? { nkey: u.nkey, permissions: u.permissions } : { nkey: u.nkey })) },
    };
    if (inv.nats.length > 1) {
      conf.cluster = {
        name: `forkfleet-${inv.name}`,
        listen: hostPort(m.address, p.natsCluster),
        authorization: { user: 'forkfleet-route', password: s.natsRoutePassword },
        routes: inv.nats.filter((o) => o !== m).map((o) => `nats-route://forkfleet-route:${s.natsRoutePassword}@${hostPort(o.address, p.natsCluster)}`),
      };
    }
    put(m.machine, 'etc/nats-server.conf', `# NATS server ${m.name} of Forkfleet cluster ${inv.name}. Rendered by deploy/hosts/render.ts.\n${JSON.stringify(conf, null, 2)}\n`, 0o640);
    put(m.machine, 'etc/systemd/system/nats-server.service.d/forkfleet.conf', unit('nats-server.forkfleet.conf', inv));
  }

  // Schedulers.
  for (const m of inv.schedulers) {
    const tls = s.schedulerTls.get(m.name)!;
    put(m.machine, 'etc/forkfleet/scheduler.env', env({
      FF_SCHEDULER_ID: m.name,
      FF_GRPC_ADDR: hostPort(m.address, p.api),
      FF_METRICS_ADDR: hostPort(m.address, p.metrics),
      FF_ETCD_ENDPOINTS: etcdEndpoints,
      FF_NATS_URL: natsUrls,
      FF_NATS_STREAM_REPLICAS: String(replicas),
      FF_NATS_NKEY_FILE: `${SCHEDULER_CREDENTIALS}/nats.nk`,
      FF_SIGNING_KEY: `${SCHEDULER_CREDENTIALS}/signing.pem`,
      FF_TLS_CERT: `${SCHEDULER_CREDENTIALS}/tls.crt`,
      FF_TLS_KEY: `${SCHEDULER_CREDENTIALS}/tls.key`,
      FF_TLS_CA: `${SCHEDULER_CREDENTIALS}/ca.crt`,
      FF_TOKENS_FILE: '/etc/forkfleet/tokens.json',
      FF_DASHBOARD_METRICS: inv.schedulers.map((o) => `http://${hostPort(o.address, p.metrics)}/metrics`).join(','),
      FF_LOG_LEVEL: 'info',
    }, `scheduler replica ${m.name} of Forkfleet cluster ${inv.name}`));
    put(m.machine, 'etc/forkfleet/scheduler/signing.pem', s.signingKey, 0o600);
    put(m.machine, 'etc/forkfleet/scheduler/nats.nk', `${s.nkeys.get('scheduler')!.seed}\n`, 0o600);
    put(m.machine, 'etc/forkfleet/scheduler/tls.crt', tls.cert, 0o600);
    put(m.machine, 'etc/forkfleet/scheduler/tls.key', tls.key, 0o600);
    put(m.machine, 'etc/forkfleet/scheduler/ca.crt', s.caCert, 0o600);
    // Digests only; re-read when it changes (mint tokens with `forkfleet token mint`).
    put(m.machine, 'etc/forkfleet/tokens.json', s.tokensJson, 0o644);
    put(m.machine, 'etc/systemd/system/forkfleet-scheduler.service', unit('forkfleet-scheduler.service', inv));
  }

  // Host agents.
  for (const h of inv.hosts) {
    put(h.machine, 'etc/forkfleet/agent.env', env({
      FF_HOST_ID: h.id,
      FF_DATA_DIR: '/var/lib/forkfleet',
      FF_NATS_URL: natsUrls,
      FF_NATS_NKEY_FILE: '/etc/forkfleet/agent/nats.nk',
      FF_TRUSTED_KEY: '/etc/forkfleet/agent/trusted.pem',
      FF_PEER_ADDR: hostPort(h.address, p.peer),
      FF_ACCEL: 'auto',
      FF_LINK_BYTES_PER_SECOND: String(Math.round((h.linkGbps * 1e9) / 8)),
      ...(h.vcpus !== undefined ? { FF_CAPACITY_VCPUS: String(h.vcpus) } : {}),
      ...(h.memoryMib !== undefined ? { FF_CAPACITY_MEMORY_MIB: String(h.memoryMib) } : {}),
      ...(h.diskMib !== undefined ? { FF_CAPACITY_DISK_MIB: String(h.diskMib) } : {}),
      // Sandboxes allowed egress never reach the control plane or other hosts' peer ports.
      FF_EGRESS_DENY_CIDRS: inv.controlCidrs.join(','),
      FF_GUEST_CGROUP: 'forkfleet-guests',
      FF_LOG_LEVEL: 'info',
    }, `host agent ${h.id} of Forkfleet cluster ${inv.name}`));
    put(h.machine, 'etc/forkfleet/agent/nats.nk', `${s.nkeys.get(`host-${h.id}`)!.seed}\n`, 0o600);
    put(h.machine, 'etc/forkfleet/agent/trusted.pem', s.signingPub, 0o644);
    put(h.machine, 'etc/systemd/system/forkfleet-agent.service', unit('forkfleet-agent.service', inv));
  }

  const apis = inv.schedulers.map((m) => hostPort(m.address, p.api)).join(',');
  out.push({ path: 'INSTALL.md', content: installGuide(inv, apis), mode: 0o644 });
  return out;
}

function installGuide(inv: Inventory, apis: string): string {
  const machines = (role: (m: string) => boolean): string[] => [...new Set([...inv.etcd, ...inv.nats, ...inv.schedulers, ...inv.hosts].map((e) => e.machine))].filter(role);
  const has = (list: ReadonlyArray<{ machine: string }>) => (m: string): boolean => list.some((e) => e.machine === m);
  const lines = [
    `# Installing Forkfleet cluster ${inv.name}`,
    '',
    'Rendered by `deploy/hosts/render.ts`. The README section "Deploying on real hosts" explains the layout, ports and prerequisites.',
    '',
    '1. On every machine, as root: Debian 12 with Node.js 20 and npm; the repository checked out at',
    `   \`${inv.installDir}\`; then \`bash ${inv.installDir}/deploy/setup.sh\` (Debian packages and npm dependencies).`,
    '2. Copy each machine\'s directory onto it: `rsync -a machines/<machine>/ root@<machine>:/`.',
    `3. etcd members (${machines(has(inv.etcd)).join(', ')}): \`systemctl enable --now etcd\` on all of them within a minute (the first waits for a quorum).`,
    `4. NATS servers (${machines(has(inv.nats)).join(', ')}): \`chown root:nats /etc/nats-server.conf && systemctl daemon-reload && systemctl enable --now nats-server\`.`,
    `5. Schedulers (${machines(has(inv.schedulers)).join(', ')}): \`systemctl daemon-reload && systemctl enable --now forkfleet-scheduler\`.`,
    `6. Hosts (${machines(has(inv.hosts)).join(', ')}): \`systemctl daemon-reload && systemctl enable --now forkfleet-agent\`.`,
    `7. From your workstation: \`FF_CREDENTIALS=$PWD/credentials.json FF_API=${apis} npm run forkfleet -- hosts ls\`.`,
    '',
    'Render again after changing the inventory: secrets are kept, so only new machines\' files and the',
    'NATS configs (one user per host) change. Copy those and `systemctl reload nats-server`.',
    '',
  ];
  return lines.join('\n');
}

const read = (p: string): string => readFileSync(p, 'utf8');

/** Makes what is missing under `dir` (mode 0700) and reads it all back. */
export function ensureSecrets(dir: string, inv: Inventory): { secrets: Secrets; adminCredentials: string | undefined } {
  mkdirSync(join(dir, 'nkeys'), { recursive: true, mode: 0o700 });
  chmodSync(dir, 0o700);
  const ca = { caCert: join(dir, 'ca.crt'), caKey: join(dir, 'ca.key') };
  ensureCa(ca.caCert, ca.caKey, `/CN=Forkfleet ${inv.name} CA`);
  const schedulerTls = new Map<string, { cert: string; key: string }>();
  for (const m of inv.schedulers) {
    const cert = { serverCert: join(dir, `scheduler-${m.name}.crt`), serverKey: join(dir, `scheduler-${m.name}.key`) };
    ensureServerCert(ca, cert, [...new Set([san(m.address), ...m.dns.map((d) => `DNS:${d}`), 'DNS:localhost', 'IP:127.0.0.1'])], `forkfleet-scheduler-${m.name}`);
    schedulerTls.set(m.name, { cert: read(cert.serverCert), key: read(cert.serverKey) });
  }
  const signing = join(dir, 'signing.pem');
  if (!existsSync(signing)) {
    const { privateKey } = generateKeyPairSync('ed25519');
    writeFileSync(signing, privateKey.export({ type: 'pkcs8', format: 'pem' }), { mode: 0o600 });
  }
  const signingPub = createPublicKey(read(signing)).export({ type: 'spki', format: 'pem' }).toString();
  const nkeys = new Map<string, { seed: string; pub: string }>();
  for (const id of ['scheduler', ...inv.hosts.map((h) => `host-${h.id}`)]) {
    const f = join(dir, 'nkeys', `${id}.nk`);
    const pubFile = `${f}.pub`;
    if (!existsSync(f) || !existsSync(pubFile)) writeFileSync(pubFile, `${createNkeyFile(f).publicKey}\n`, { mode: 0o644 });
    nkeys.set(id, { seed: read(f).trim(), pub: read(pubFile).trim() });
  }
  const routeFile = join(dir, 'nats-route-password');
  if (!existsSync(routeFile)) writeFileSync(routeFile, randomBytes(24).toString('base64url'), { mode: 0o600 });
  const tokens = join(dir, 'tokens.json');
  // The first render mints an admin token; it is shown only in DIR/credentials.json.
  const adminToken = existsSync(tokens) ? undefined : mintToken(tokens, { tenant: 'admin', admin: true, name: `${inv.name}-admin` });
  return {
    secrets: { caCert: read(ca.caCert), schedulerTls, signingKey: read(signing), signingPub, nkeys, natsRoutePassword: read(routeFile).trim(), tokensJson: read(tokens) },
    adminCredentials: adminToken === undefined ? undefined : `${JSON.stringify({ token: adminToken, ca: 'secrets/ca.crt' }, null, 2)}\n`,
  };
}

/** Renders `inv` into `out`: secrets made or reused, every file written. Returns the files written. */
export function render(inv: Inventory, out: string): string[] {
  const { secrets, adminCredentials } = ensureSecrets(join(out, 'secrets'), inv);
  const files = renderFiles(inv, secrets);
  if (adminCredentials) files.push({ path: 'credentials.json', content: adminCredentials, mode: 0o600 });
  for (const f of files) {
    const p = join(out, f.path);
    mkdirSync(dirname(p), { recursive: true });
    writeFileSync(p, f.content, { mode: f.mode });
    chmodSync(p, f.mode);
  }
  return files.map((f) => f.path);
}

if (process.argv[1] && resolve(process.argv[1]) === resolve(import.meta.filename)) {
  const { values } = parseArgs({ options: { inventory: { type: 'string' }, out: { type: 'string' } } });
  if (!values.inventory || !values.out) {
    process.stderr.write('usage: npm run deploy:render -- --inventory FILE.json --out DIR\n');
    process.exit(2);
  }
  try {
    const inv = parseInventory(JSON.parse(readFileSync(values.inventory, 'utf8')));
    const written = render(inv, resolve(values.out));
    const machines = [...new Set(written.filter((w) => w.startsWith('machines/')).map((w) => w.split('/')[1]))];
    process.stdout.write(`rendered cluster ${inv.name} into ${values.out}: ${machines.length} machines (${machines.join(', ')}); next: ${relative(process.cwd(), join(resolve(values.out), 'INSTALL.md'))}\n`);
  } catch (e) {
    process.stderr.write(`deploy:render: ${(e as Error).message}\n`);
    process.exit(2);
  }
}
