// Renders a real deployment from an inventory (inventory.ts): per machine, the files to copy
// onto its root file system, plus the secrets that tie the fleet together.
//
//   npm run deploy:render -- --inventory deploy/hosts/inventory.example.json --out DIR
//
// DIR/secrets/   the CAs (their keys never leave here), every TLS certificate and key, the
//                schedulers' signing key, NATS NKeys, the NATS route password and the tokens
//                file. Kept between renders: render again after editing the inventory (a new
//                host, a new scheduler) and only what is missing is made; nothing is rotated
//                (a certificate is re-issued only in its last 30 days or when its address changed).
// DIR/machines/<machine>/   everything that machine needs, laid out from / (copy with
//                COPY_COMMAND below, which keeps existing directories' owner and mode):
//   etc/default/etcd                      an etcd member (Debian's etcd.service reads it)
//   etc/forkfleet/etcd/*, etc/systemd/system/etcd.service.d/forkfleet.conf   its TLS files
//   etc/nats-server.conf                  a NATS server (Debian's nats-server.service reads it)
//   etc/forkfleet/nats/*, etc/systemd/system/nats-server.service.d/forkfleet.conf
//   etc/forkfleet/scheduler.env, etc/forkfleet/scheduler/*, etc/forkfleet/tokens.json,
//   etc/systemd/system/forkfleet-scheduler.service
//   etc/forkfleet/agent.env, etc/forkfleet/agent/*, etc/systemd/system/forkfleet-agent.service
//
// Control-plane TLS: etcd serves clients and peers over TLS and admits only client
// certificates of its own CA (secrets/etcd/), which signs nothing but the members' and the
// schedulers' etcd certificates: no other machine's key opens etcd. NATS serves clients and
// routes over TLS and verifies client certificates of the fleet CA (secrets/ca.crt, which
// also signs the schedulers' API certificates); NKeys still decide who may do what there.
// Private keys reach etcd, nats-server and the schedulers through systemd's LoadCredential
// (the files stay root's, mode 0600); the agent, root itself, reads its own.
// DIR/credentials.json   an admin token and the CA for the CLI and SDK (FF_CREDENTIALS=...)
// DIR/INSTALL.md         the steps, per machine, in order
//
// The renderer is split in two: `renderFiles` is pure (inventory + secrets -> files) and is
// what the tests check; `render` makes or reuses the secrets and writes the files.
import { chmodSync, existsSync, mkdirSync, readFileSync, writeFileSync } from 'node:fs';
import { dirname, join, relative, resolve } from 'node:path';
import { createPublicKey, generateKeyPairSync, randomBytes } from 'node:crypto';
import { parseArgs } from 'node:util';
import { nkeys as natsNkeys } from 'nats';
import { createNkeyFile, hostPermissions, natsAuthorization, type NatsUser } from '../../services/adapters/nats/auth.ts';
import { mintToken, parseTokensFile } from '../../services/auth/tokens.ts';
import { ensureCa, ensureCert, ensureServerCert, type CertUse } from '../pki/pki.ts';
import { peerCertificateCn } from '../../host-agent/adapters/peer/peer-identity.ts';
import { hostPort, parseInventory, type Inventory } from './inventory.ts';
import { enterUserCwd } from '../user-cwd.ts';

const UNITS = resolve(import.meta.dirname, 'units');
/** The repository this renders from, on the operator's workstation (INSTALL.md's last step runs its CLI). */
const REPO = resolve(import.meta.dirname, '..', '..');

/** PEM of a certificate and its private key. */
export interface CertPair {
  readonly cert: string;
  readonly key: string;
}

/** What ties the fleet together; made once per DIR/secrets (`ensureSecrets`). */
export interface Secrets {
  /** The fleet CA: the schedulers' API certificates, NATS servers' and NATS clients' certificates. */
  readonly caCert: string;
  /** PEM of each scheduler's TLS certificate and key, by scheduler name. */
  readonly schedulerTls: ReadonlyMap<string, CertPair>;
  /** etcd's own CA: it signs only the members' and the schedulers' etcd certificates. */
  readonly etcdCaCert: string;
  /** Each etcd member's certificate for clients and peers (server and client), by member name. */
  readonly etcdMemberTls: ReadonlyMap<string, CertPair>;
  /** Each scheduler's etcd client certificate, by scheduler name. */
  readonly etcdClientTls: ReadonlyMap<string, CertPair>;
  /** Each NATS server's certificate for clients and routes (server and client), by server name. */
  readonly natsServerTls: ReadonlyMap<string, CertPair>;
  /** NATS client certificates: "scheduler-<name>" and "host-<id>". */
  readonly natsClientTls: ReadonlyMap<string, CertPair>;
  /** Each host's peer transfer certificate (server and client: mutual TLS between agents), by host id. */
  readonly peerTls: ReadonlyMap<string, CertPair>;
  readonly signingKey: string;
  readonly signingPub: string;
  /** NATS user NKeys: "scheduler" and "host-<id>". */
  readonly nkeys: ReadonlyMap<string, { seed: string; pub: string }>;
  readonly natsRoutePassword: string;
  /** The bearer token the schedulers' /metrics require (FF_METRICS_TOKEN_FILE): for Prometheus. */
  readonly metricsToken: string;
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
/** Where an etcd member's TLS files are once systemd has loaded them (units/etcd.forkfleet.conf). */
export const ETCD_CREDENTIALS = '/run/credentials/etcd.service';
/** Where a NATS server's TLS files are once systemd has loaded them (units/nats-server.forkfleet.conf). */
export const NATS_CREDENTIALS = '/run/credentials/nats-server.service';
/** The CN of every etcd member's certificate: the peer port admits these only. */
const ETCD_MEMBER_CN = 'forkfleet-etcd-member';
/**
 * A DNS name every etcd member's certificate carries besides its IP address. The schedulers
 * dial members by IP and check them against this name (FF_ETCD_SERVER_NAME), so no IP address
 * goes out as the TLS server name. Only the deployment's own etcd CA signs member certificates.
 */
export const ETCD_SERVER_NAME = 'etcd.forkfleet';

const env = (vars: Record<string, string>, header: string): string =>
  `# ${header}\n# Rendered by deploy/hosts/render.ts; variables: services/config.ts and host-agent/config.ts.\n${Object.entries(vars)
    .map(([k, v]) => `${k}=${v}`)
    .join('\n')}\n`;

const unit = (name: string, inv: Inventory): string => readFileSync(join(UNITS, name), 'utf8').replaceAll('@INSTALL_DIR@', inv.installDir).replaceAll('@NODE@', inv.node);

/** An etcd member's client URL (TLS). */
const etcdClientUrl = (inv: Inventory, m: { address: string }): string => `https://${hostPort(m.address, inv.ports.etcdClient)}`;

/** Every machine's files, from the inventory and the secrets. Pure. */
export function renderFiles(inv: Inventory, s: Secrets): RenderedFile[] {
  const out: RenderedFile[] = [];
  const put = (machine: string, path: string, content: string, mode = 0o644): void => void out.push({ path: `machines/${machine}/${path}`, content, mode });
  const p = inv.ports;
  const etcdClient = (m: { address: string }): string => etcdClientUrl(inv, m);
  const etcdPeer = (m: { address: string }): string => `https://${hostPort(m.address, p.etcdPeer)}`;
  const etcdEndpoints = inv.etcd.map(etcdClient).join(',');
  const natsUrls = inv.nats.map((m) => `tls://${hostPort(m.address, p.natsClient)}`).join(',');
  const replicas = inv.nats.length >= 3 ? 3 : 1;

  // etcd: Debian's etcd.service reads /etc/default/etcd (ETCD_* are etcd's flags). Clients and
  // peers speak TLS and must show a certificate of etcd's CA; the member's own certificate
  // serves both listeners and dials the other members. On the peer port only members' (CN
  // ETCD_MEMBER_CN) are admitted. etcd would also match a peer's certificate against the
  // address its connection comes from, which is the kernel's choice of source address (not
  // the inventory's on a machine with several, nor on the test's loopback aliases): that check
  // is off, the CA and the CN carry the trust.
  const initialCluster = inv.etcd.map((m) => `${m.name}=${etcdPeer(m)}`).join(',');
  for (const m of inv.etcd) {
    const tls = s.etcdMemberTls.get(m.name)!;
    const files = {
      ETCD_TRUSTED_CA_FILE: `${ETCD_CREDENTIALS}/ca.crt`,
      ETCD_CERT_FILE: `${ETCD_CREDENTIALS}/member.crt`,
      ETCD_KEY_FILE: `${ETCD_CREDENTIALS}/member.key`,
    };
    put(m.machine, 'etc/default/etcd', env({
      ETCD_NAME: m.name,
      ETCD_DATA_DIR: '/var/lib/etcd/forkfleet',
      ETCD_LISTEN_CLIENT_URLS: etcdClient(m),
      ETCD_ADVERTISE_CLIENT_URLS: etcdClient(m),
      ETCD_LISTEN_PEER_URLS: etcdPeer(m),
      ETCD_INITIAL_ADVERTISE_PEER_URLS: etcdPeer(m),
      ETCD_INITIAL_CLUSTER: initialCluster,
      ETCD_INITIAL_CLUSTER_STATE: 'new',
      ETCD_INITIAL_CLUSTER_TOKEN: `forkfleet-${inv.name}`,
      // A fork of 256 children spread over 256 hosts is one transaction of ~772 compares (services/README.md).
      ETCD_MAX_TXN_OPS: '1024',
      // ~1.2 KiB per child created within FF_RECORD_RETENTION, plus the live fleet (ADR 0017).
      ETCD_QUOTA_BACKEND_BYTES: String(8 * 2 ** 30),
      ...files,
      ETCD_CLIENT_CERT_AUTH: 'true',
      ETCD_PEER_TRUSTED_CA_FILE: files.ETCD_TRUSTED_CA_FILE,
      ETCD_PEER_CERT_FILE: files.ETCD_CERT_FILE,
      ETCD_PEER_KEY_FILE: files.ETCD_KEY_FILE,
      ETCD_PEER_CLIENT_CERT_AUTH: 'true',
      ETCD_PEER_CERT_ALLOWED_CN: ETCD_MEMBER_CN,
      ETCD_EXPERIMENTAL_PEER_SKIP_CLIENT_SAN_VERIFICATION: 'true',
    }, `etcd member ${m.name} of Forkfleet cluster ${inv.name}`));
    put(m.machine, 'etc/forkfleet/etcd/ca.crt', s.etcdCaCert);
    put(m.machine, 'etc/forkfleet/etcd/member.crt', tls.cert);
    put(m.machine, 'etc/forkfleet/etcd/member.key', tls.key, 0o600);
    put(m.machine, 'etc/systemd/system/etcd.service.d/forkfleet.conf', unit('etcd.forkfleet.conf', inv));
  }

  // NATS: one config per server; JetStream, a cluster when there are several, NKey users.
  const users: NatsUser[] = [{ nkey: s.nkeys.get('scheduler')!.pub }, ...inv.hosts.map((h) => ({ nkey: s.nkeys.get(`host-${h.id}`)!.pub, permissions: hostPermissions(h.id) }))];
  // Clients and routes speak TLS and show a certificate of the fleet CA (`verify`: no TLS
  // session, hence no NKey challenge, without one); the NKey user still decides what a client
  // may do. The monitoring port stays plain HTTP (health and statistics).
  const natsListenerTls = {
    cert_file: `${NATS_CREDENTIALS}/server.crt`,
    key_file: `${NATS_CREDENTIALS}/server.key`,
    ca_file: `${NATS_CREDENTIALS}/ca.crt`,
    verify: true,
  };
  for (const m of inv.nats) {
    const tls = s.natsServerTls.get(m.name)!;
    const conf: Record<string, unknown> = {
      server_name: m.name,
      host: m.address,
      port: p.natsClient,
      http: hostPort(m.address, p.natsMonitor),
      tls: natsListenerTls,
      jetstream: { store_dir: '/var/lib/nats/jetstream' },
      // A snapshot step's result and a cross-host restore's work carry the snapshot's manifest
      // (~48 bytes per 256 KiB chunk that is not zero): the default 1 MiB carries ~5 GiB of
      // a VM's non-zero memory and disk, 8 MiB (NATS's recommended ceiling) ~40 GiB. A larger
      // one fails its step at once, naming the limit (js-publisher.ts).
      max_payload: 8 * 1024 * 1024,
      authorization: natsAuthorization(users),
    };
    if (inv.nats.length > 1) {
      conf.cluster = {
        name: `forkfleet-${inv.name}`,
        listen: hostPort(m.address, p.natsCluster),
        // Routes dial the other servers' addresses: their certificates name them (IP SANs).
        tls: natsListenerTls,
        authorization: { user: 'forkfleet-route', password: s.natsRoutePassword },
        routes: inv.nats.filter((o) => o !== m).map((o) => `nats-route://forkfleet-route:${s.natsRoutePassword}@${hostPort(o.address, p.natsCluster)}`),
      };
    }
    put(m.machine, 'etc/nats-server.conf', `# NATS server ${m.name} of Forkfleet cluster ${inv.name}. Rendered by deploy/hosts/render.ts.\n${JSON.stringify(conf, null, 2)}\n`, 0o640);
    put(m.machine, 'etc/forkfleet/nats/ca.crt', s.caCert);
    put(m.machine, 'etc/forkfleet/nats/server.crt', tls.cert);
    put(m.machine, 'etc/forkfleet/nats/server.key', tls.key, 0o600);
    put(m.machine, 'etc/systemd/system/nats-server.service.d/forkfleet.conf', unit('nats-server.forkfleet.conf', inv));
  }

  // Schedulers. The dashboard lists the sandboxes of FF_DASHBOARD_TENANTS only: every tenant
  // the tokens file has a token for, the first admin's (what credentials.json's CLI creates)
  // among them. A tenant minted later shows once rendered again (scheduler.env changes).
  const tenants = [...new Set(parseTokensFile(s.tokensJson, 'secrets/tokens.json').map((e) => e.tenant))];
  for (const m of inv.schedulers) {
    const tls = s.schedulerTls.get(m.name)!;
    const etcdTls = s.etcdClientTls.get(m.name)!;
    const natsTls = s.natsClientTls.get(`scheduler-${m.name}`)!;
    put(m.machine, 'etc/forkfleet/scheduler.env', env({
      FF_SCHEDULER_ID: m.name,
      FF_GRPC_ADDR: hostPort(m.address, p.api),
      FF_METRICS_ADDR: hostPort(m.address, p.metrics),
      // Its series name tenants: scrapes carry this token (OUT/secrets/metrics.token).
      FF_METRICS_TOKEN_FILE: `${SCHEDULER_CREDENTIALS}/metrics.token`,
      FF_ETCD_ENDPOINTS: etcdEndpoints,
      FF_ETCD_CA: `${SCHEDULER_CREDENTIALS}/etcd-ca.crt`,
      FF_ETCD_CERT: `${SCHEDULER_CREDENTIALS}/etcd.crt`,
      FF_ETCD_KEY: `${SCHEDULER_CREDENTIALS}/etcd.key`,
      FF_ETCD_SERVER_NAME: ETCD_SERVER_NAME,
      FF_NATS_URL: natsUrls,
      FF_NATS_CA: `${SCHEDULER_CREDENTIALS}/ca.crt`,
      FF_NATS_CERT: `${SCHEDULER_CREDENTIALS}/nats.crt`,
      FF_NATS_KEY: `${SCHEDULER_CREDENTIALS}/nats.key`,
      FF_NATS_STREAM_REPLICAS: String(replicas),
      FF_NATS_NKEY_FILE: `${SCHEDULER_CREDENTIALS}/nats.nk`,
      FF_SIGNING_KEY: `${SCHEDULER_CREDENTIALS}/signing.pem`,
      FF_TLS_CERT: `${SCHEDULER_CREDENTIALS}/tls.crt`,
      FF_TLS_KEY: `${SCHEDULER_CREDENTIALS}/tls.key`,
      FF_TLS_CA: `${SCHEDULER_CREDENTIALS}/ca.crt`,
      FF_TOKENS_FILE: '/etc/forkfleet/tokens.json',
      FF_DASHBOARD_METRICS: inv.schedulers.map((o) => `http://${hostPort(o.address, p.metrics)}/metrics`).join(','),
      ...(tenants.length > 0 ? { FF_DASHBOARD_TENANTS: tenants.join(',') } : {}),
      FF_LOG_LEVEL: 'info',
    }, `scheduler replica ${m.name} of Forkfleet cluster ${inv.name}`));
    put(m.machine, 'etc/forkfleet/scheduler/signing.pem', s.signingKey, 0o600);
    put(m.machine, 'etc/forkfleet/scheduler/nats.nk', `${s.nkeys.get('scheduler')!.seed}\n`, 0o600);
    put(m.machine, 'etc/forkfleet/scheduler/metrics.token', `${s.metricsToken}\n`, 0o600);
    put(m.machine, 'etc/forkfleet/scheduler/tls.crt', tls.cert, 0o600);
    put(m.machine, 'etc/forkfleet/scheduler/tls.key', tls.key, 0o600);
    put(m.machine, 'etc/forkfleet/scheduler/ca.crt', s.caCert, 0o600);
    put(m.machine, 'etc/forkfleet/scheduler/etcd-ca.crt', s.etcdCaCert, 0o600);
    put(m.machine, 'etc/forkfleet/scheduler/etcd.crt', etcdTls.cert, 0o600);
    put(m.machine, 'etc/forkfleet/scheduler/etcd.key', etcdTls.key, 0o600);
    put(m.machine, 'etc/forkfleet/scheduler/nats.crt', natsTls.cert, 0o600);
    put(m.machine, 'etc/forkfleet/scheduler/nats.key', natsTls.key, 0o600);
    // Digests only; re-read when it changes (mint tokens with `forkfleet token mint`).
    put(m.machine, 'etc/forkfleet/tokens.json', s.tokensJson, 0o644);
    put(m.machine, 'etc/systemd/system/forkfleet-scheduler.service', unit('forkfleet-scheduler.service', inv));
  }

  // Host agents: root, they read their files in place. A host gets nothing of etcd's.
  for (const h of inv.hosts) {
    const natsTls = s.natsClientTls.get(`host-${h.id}`)!;
    put(h.machine, 'etc/forkfleet/agent.env', env({
      FF_HOST_ID: h.id,
      FF_DATA_DIR: '/var/lib/forkfleet',
      FF_NATS_URL: natsUrls,
      FF_NATS_NKEY_FILE: '/etc/forkfleet/agent/nats.nk',
      FF_NATS_CA: '/etc/forkfleet/agent/ca.crt',
      FF_NATS_CERT: '/etc/forkfleet/agent/nats.crt',
      FF_NATS_KEY: '/etc/forkfleet/agent/nats.key',
      FF_TRUSTED_KEY: '/etc/forkfleet/agent/trusted.pem',
      FF_PEER_ADDR: hostPort(h.address, p.peer),
      FF_METRICS_ADDR: hostPort(h.address, p.agentMetrics),
      FF_PEER_CA: '/etc/forkfleet/agent/ca.crt',
      FF_PEER_CERT: '/etc/forkfleet/agent/peer.crt',
      FF_PEER_KEY: '/etc/forkfleet/agent/peer.key',
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
    put(h.machine, 'etc/forkfleet/agent/ca.crt', s.caCert, 0o644);
    put(h.machine, 'etc/forkfleet/agent/nats.crt', natsTls.cert, 0o644);
    put(h.machine, 'etc/forkfleet/agent/nats.key', natsTls.key, 0o600);
    put(h.machine, 'etc/forkfleet/agent/peer.crt', s.peerTls.get(h.id)!.cert, 0o644);
    put(h.machine, 'etc/forkfleet/agent/peer.key', s.peerTls.get(h.id)!.key, 0o600);
    put(h.machine, 'etc/systemd/system/forkfleet-agent.service', unit('forkfleet-agent.service', inv));
  }

  const apis = inv.schedulers.map((m) => hostPort(m.address, p.api)).join(',');
  out.push({ path: 'INSTALL.md', content: installGuide(inv, apis), mode: 0o644 });
  return out;
}

/** etcdctl on an etcd member, as root: the member's own certificate is a client certificate etcd admits. */
const etcdctl = (inv: Inventory): string =>
  `etcdctl --cacert /etc/forkfleet/etcd/ca.crt --cert /etc/forkfleet/etcd/member.crt --key /etc/forkfleet/etcd/member.key --endpoints ${inv.etcd.map((m) => etcdClientUrl(inv, m)).join(',')}`;

/** How to copy a machine's files onto it: as root, existing directories (/, /etc) keep their owner and mode. */
export const COPY_COMMAND = "tar -C machines/<machine> -cf - etc | ssh root@<machine> 'tar -C / --no-same-owner --no-overwrite-dir -xf -'";

function installGuide(inv: Inventory, apis: string): string {
  const all = [...new Set([...inv.etcd, ...inv.nats, ...inv.schedulers, ...inv.hosts].map((e) => e.machine))];
  const runs = (list: ReadonlyArray<{ machine: string }>) => (m: string): boolean => list.some((e) => e.machine === m);
  const of = (list: ReadonlyArray<{ machine: string }>): string => all.filter(runs(list)).join(', ');
  // setup.sh installs every package on every machine (a development superset) and disables the
  // services of those it installed; a machine that had one of them before keeps its own
  // service as it was. Each machine makes sure the ones it does not run are off.
  const unused = all.map((m) => `   - ${m}: \`systemctl disable --now prometheus${runs(inv.etcd)(m) ? '' : ' etcd'}${runs(inv.nats)(m) ? '' : ' nats-server'}\``);
  const lines = [
    `# Installing Forkfleet cluster ${inv.name}`,
    '',
    'Rendered by `deploy/hosts/render.ts`. The README section "Deploying on real hosts" explains the layout, ports and prerequisites.',
    '',
    '1. On every machine, as root: Debian 12 with Node.js 20.19+ (or 22.12+) and npm; the repository checked out at',
    `   \`${inv.installDir}\`; then \`bash ${inv.installDir}/deploy/setup.sh\` (Debian packages and npm dependencies).`,
    '2. Make sure the services a machine does not run are off (setup.sh installs them all and disables those it installed; a package that was there before keeps its service as it was):',
    ...unused,
    `3. Copy each machine's files onto it, as root (existing directories keep their owner and mode): \`${COPY_COMMAND}\`.`,
    `4. etcd members (${of(inv.etcd)}): \`systemctl daemon-reload && systemctl enable etcd && systemctl restart etcd\` on all of them within a minute (the first waits for a quorum).`,
    `   Check from any of them: \`${etcdctl(inv)} endpoint health\`.`,
    // The copy makes /etc/nats-server.conf (0640) root:root each time; its drop-in gives it to group nats at each start and reload.
    `5. NATS servers (${of(inv.nats)}): \`systemctl daemon-reload && systemctl enable nats-server && systemctl restart nats-server\`.`,
    `6. Schedulers (${of(inv.schedulers)}): \`systemctl daemon-reload && systemctl enable --now forkfleet-scheduler\`.`,
    `7. Hosts (${of(inv.hosts)}): \`systemctl daemon-reload && systemctl enable --now forkfleet-agent\`.`,
    `8. From your workstation, in this directory: \`FF_CREDENTIALS=$PWD/credentials.json FF_API=${apis} npm --prefix ${REPO} run forkfleet -- hosts ls\``,
    `   (\`--prefix\`: the repository you rendered from; npm runs scripts there).`,
    '',
    'Render again after adding hosts or schedulers: the secrets are kept, so only the new machines\' files,',
    'the NATS configs (one user per host) and, with a new scheduler, every scheduler\'s `scheduler.env` (its',
    'dashboard reads every scheduler\'s metrics: copy it and restart the schedulers one at a time) change; copy those as in step 3, then on the NATS servers',
    '`systemctl daemon-reload && systemctl reload nats-server` (the reload gives the copied config, which the copy',
    'leaves root:root, back to the group nats first: see its drop-in). The etcd',
    'membership is fixed by the first start (`ETCD_INITIAL_CLUSTER_STATE=new`): change it on a member with',
    `\`${etcdctl(inv)} member add ...\` and \`ETCD_INITIAL_CLUSTER_STATE=existing\` on the new member, not by rendering`,
    '(a member added to the inventory gets its certificate when you render; set that before its first start).',
    '',
    'etcd, NATS clients and NATS routes speak TLS with client certificates (the README section "Deploying on',
    'real hosts" says what is and is not encrypted). systemd hands the keys to etcd, nats-server and the',
    'schedulers when they start. Certificates are valid for 825 days; a render re-issues one in its last 30',
    'days or when its address changed: then copy the files and restart the services whose certificates changed.',
    '',
    `The schedulers' \`/metrics\` (port ${inv.ports.metrics}) name tenants, so they answer only a scrape that carries the bearer token in`,
    '`secrets/metrics.token`: in Prometheus, `authorization: { credentials_file: <a copy of that file> }`',
    'in the job\'s scrape config; to rotate it, write the new token into that file and each scheduler machine\'s',
    '`/etc/forkfleet/scheduler/metrics.token` and restart the schedulers (systemd hands them a copy at start).',
    'The agents\' `/metrics` need none (counts and sizes only).',
    '',
  ];
  return lines.join('\n');
}

const read = (p: string): string => readFileSync(p, 'utf8');

/**
 * Makes what is missing under `dir` (mode 0700) and reads it all back. The first call also
 * writes `dir`/../credentials.json (the admin token, shown nowhere else).
 */
export function ensureSecrets(dir: string, inv: Inventory): Secrets {
  for (const d of ['nkeys', 'etcd', 'nats']) mkdirSync(join(dir, d), { recursive: true, mode: 0o700 });
  chmodSync(dir, 0o700);
  const ca = { caCert: join(dir, 'ca.crt'), caKey: join(dir, 'ca.key') };
  ensureCa(ca.caCert, ca.caKey, `/CN=Forkfleet ${inv.name} CA`);
  const schedulerTls = new Map<string, CertPair>();
  for (const m of inv.schedulers) {
    const cert = { serverCert: join(dir, `scheduler-${m.name}.crt`), serverKey: join(dir, `scheduler-${m.name}.key`) };
    ensureServerCert(ca, cert, [...new Set([`IP:${m.address}`, ...m.dns.map((d) => `DNS:${d}`), 'DNS:localhost', 'IP:127.0.0.1'])], `forkfleet-scheduler-${m.name}`);
    schedulerTls.set(m.name, { cert: read(cert.serverCert), key: read(cert.serverKey) });
  }
  // One certificate per process and role, named <dir>/<file>.crt|.key; servers' name their IPv4 address.
  const issue = (signer: { caCert: string; caKey: string }, file: string, cn: string, use: CertUse, address?: string, dns: readonly string[] = []): CertPair => {
    const pair = { cert: join(dir, `${file}.crt`), key: join(dir, `${file}.key`) };
    ensureCert(signer, pair, { sans: [...(address ? [`IP:${address}`] : []), ...dns.map((d) => `DNS:${d}`)], cn, use });
    return { cert: read(pair.cert), key: read(pair.key) };
  };
  const etcdCa = { caCert: join(dir, 'etcd', 'ca.crt'), caKey: join(dir, 'etcd', 'ca.key') };
  ensureCa(etcdCa.caCert, etcdCa.caKey, `/CN=Forkfleet ${inv.name} etcd CA`);
  const etcdMemberTls = new Map(inv.etcd.map((m) => [m.name, issue(etcdCa, `etcd/member-${m.name}`, ETCD_MEMBER_CN, 'server+client', m.address, [ETCD_SERVER_NAME])] as const));
  const etcdClientTls = new Map(inv.schedulers.map((m) => [m.name, issue(etcdCa, `etcd/client-scheduler-${m.name}`, `forkfleet-scheduler-${m.name}`, 'client')] as const));
  const natsServerTls = new Map(inv.nats.map((m) => [m.name, issue(ca, `nats/server-${m.name}`, `forkfleet-nats-${m.name}`, 'server+client', m.address)] as const));
  const natsClientTls = new Map([
    ...inv.schedulers.map((m) => [`scheduler-${m.name}`, issue(ca, `nats/client-scheduler-${m.name}`, `forkfleet-scheduler-${m.name}`, 'client')] as const),
    ...inv.hosts.map((h) => [`host-${h.id}`, issue(ca, `nats/client-host-${h.id}`, `forkfleet-host-${h.id}`, 'client')] as const),
  ]);
  // Peer transfer (host-agent/adapters/peer/tls.ts): named by the host's id (CN) and address.
  mkdirSync(join(dir, 'peer'), { recursive: true, mode: 0o700 });
  const peerTls = new Map(inv.hosts.map((h) => [h.id, issue(ca, `peer/host-${h.id}`, peerCertificateCn(h.id), 'server+client', h.address)] as const));
  const signing = join(dir, 'signing.pem');
  if (!existsSync(signing)) {
    const { privateKey } = generateKeyPairSync('ed25519');
    writeFileSync(signing, privateKey.export({ type: 'pkcs8', format: 'pem' }), { mode: 0o600 });
  }
  const signingPub = createPublicKey(read(signing)).export({ type: 'spki', format: 'pem' }).toString();
  const nkeys = new Map<string, { seed: string; pub: string }>();
  for (const id of ['scheduler', ...inv.hosts.map((h) => `host-${h.id}`)]) {
    const f = join(dir, 'nkeys', `${id}.nk`);
    if (!existsSync(f)) createNkeyFile(f);
    const seed = read(f).trim();
    nkeys.set(id, { seed, pub: natsNkeys.fromSeed(new TextEncoder().encode(seed)).getPublicKey() });
  }
  const routeFile = join(dir, 'nats-route-password');
  if (!existsSync(routeFile)) writeFileSync(routeFile, randomBytes(24).toString('base64url'), { mode: 0o600 });
  const metricsTokenFile = join(dir, 'metrics.token');
  if (!existsSync(metricsTokenFile)) writeFileSync(metricsTokenFile, `${randomBytes(32).toString('base64url')}\n`, { mode: 0o600 });
  const tokens = join(dir, 'tokens.json');
  // The first render mints an admin token. Only its digest is kept, so the token itself goes
  // into DIR/credentials.json at once, before anything else can fail.
  if (!existsSync(tokens)) {
    const token = mintToken(tokens, { tenant: 'admin', admin: true, name: `${inv.name}-admin` });
    writeFileSync(join(dir, '..', 'credentials.json'), `${JSON.stringify({ token, ca: 'secrets/ca.crt' }, null, 2)}\n`, { mode: 0o600 });
  }
  return {
    caCert: read(ca.caCert),
    schedulerTls,
    etcdCaCert: read(etcdCa.caCert),
    etcdMemberTls,
    etcdClientTls,
    natsServerTls,
    natsClientTls,
    peerTls,
    signingKey: read(signing),
    signingPub,
    nkeys,
    natsRoutePassword: read(routeFile).trim(),
    metricsToken: read(metricsTokenFile).trim(),
    tokensJson: read(tokens),
  };
}

/** Renders `inv` into `out`: secrets made or reused, every file written. Returns the files written. */
export function render(inv: Inventory, out: string): string[] {
  mkdirSync(out, { recursive: true });
  const files = renderFiles(inv, ensureSecrets(join(out, 'secrets'), inv));
  for (const f of files) {
    const p = join(out, f.path);
    // Directories 0755 whatever the umask: they are copied onto the machines' own /etc.
    for (let d = dirname(p); d.length > out.length; d = dirname(d)) {
      mkdirSync(d, { recursive: true });
      chmodSync(d, 0o755);
    }
    writeFileSync(p, f.content, { mode: f.mode });
    chmodSync(p, f.mode);
  }
  return files.map((f) => f.path);
}

if (process.argv[1] && resolve(process.argv[1]) === resolve(import.meta.filename)) {
  enterUserCwd(['deploy:render']);
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
