import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { fieldOf } from '../../services/testkit/fields.ts';
import { DEFAULT_PORTS, hostPort, parseInventory } from './inventory.ts';
import { renderFiles, type Secrets } from './render.ts';

const example = (): Record<string, unknown> => JSON.parse(readFileSync(join(import.meta.dirname, 'inventory.example.json'), 'utf8')) as Record<string, unknown>;


const pairs = (ids: string[], tag: string): Map<string, { cert: string; key: string }> => new Map(ids.map((id) => [id, { cert: `${tag}-CERT-${id}\n`, key: `${tag}-KEY-${id}\n` }]));

const secrets: Secrets = {
  caCert: 'CA\n',
  schedulerTls: new Map([
    ['sched-1', { cert: 'C1\n', key: 'K1\n' }],
    ['sched-2', { cert: 'C2\n', key: 'K2\n' }],
  ]),
  etcdCaCert: 'ETCD-CA\n',
  etcdMemberTls: pairs(['etcd-1', 'etcd-2', 'etcd-3'], 'ETCD-MEMBER'),
  etcdClientTls: pairs(['sched-1', 'sched-2'], 'ETCD-CLIENT'),
  natsServerTls: pairs(['nats-1', 'nats-2', 'nats-3'], 'NATS-SERVER'),
  natsClientTls: pairs(['scheduler-sched-1', 'scheduler-sched-2', 'host-kvm-01', 'host-kvm-02', 'host-kvm-03'], 'NATS-CLIENT'),
  peerTls: pairs(['kvm-01', 'kvm-02', 'kvm-03'], 'PEER'),
  signingKey: 'SIGN\n',
  signingPub: 'PUB\n',
  nkeys: new Map(['scheduler', 'host-kvm-01', 'host-kvm-02', 'host-kvm-03'].map((id) => [id, { seed: `SEED-${id}`, pub: `PUB-${id}` }])),
  natsRoutePassword: 'route-secret',
  metricsToken: 'METRICS-TOKEN',
  tokensJson: '{"tokens":[]}\n',
};

describe('inventory', () => {
  it('parseInventory_ofTheExample_fillsDefaultPortsAndMachines', () => {
    const inv = parseInventory(example());
    expect(inv.ports).toEqual(DEFAULT_PORTS);
    expect(inv.etcd.map((m) => m.machine)).toEqual(['cp-1', 'cp-2', 'cp-3']);
    expect(inv.hosts[2]?.memoryMib).toBe(480000);
    expect(inv.hosts[0]?.vcpus).toBeUndefined();
  });

  it.each([
    ['etcd', (j: Record<string, unknown>) => (j.etcd = (j.etcd as unknown[]).slice(0, 2))],
    ['nats', (j: Record<string, unknown>) => (j.nats = (j.nats as unknown[]).slice(0, 2))],
    ['hosts[1]', (j: Record<string, unknown>) => ((j.hosts as Array<Record<string, unknown>>)[1]!.id = 'kvm-01')],
    ['hosts[0].address', (j: Record<string, unknown>) => ((j.hosts as Array<Record<string, unknown>>)[0]!.address = 'not an address!')],
    ['schedulers[1]', (j: Record<string, unknown>) => ((j.schedulers as Array<Record<string, unknown>>)[1]!.machine = 'cp-1')],
    ['ports.bogus', (j: Record<string, unknown>) => (j.ports = { bogus: 1 })],
    ['ports.api', (j: Record<string, unknown>) => (j.ports = { api: 70000 })],
    ['controlCidrs', (j: Record<string, unknown>) => (j.controlCidrs = ['10.0.0.0'])],
    ['controlCidrs', (j: Record<string, unknown>) => (j.controlCidrs = [])],
    // An address outside every control network: a sandbox allowed egress could reach it.
    ['hosts[2].address', (j: Record<string, unknown>) => ((j.hosts as Array<Record<string, unknown>>)[2]!.address = '10.0.2.23')],
    ['etcd[0].address', (j: Record<string, unknown>) => (j.controlCidrs = ['10.0.0.12/31', '10.0.1.0/24'])],
    ['hosts[0].linkGbps', (j: Record<string, unknown>) => ((j.hosts as Array<Record<string, unknown>>)[0]!.linkGbps = 0)],
    ['installDir', (j: Record<string, unknown>) => (j.installDir = 'relative/path')],
    ['node', (j: Record<string, unknown>) => (j.node = 'node')],
  ])('parseInventory_whenBad_namesTheField %s', (field, spoil) => {
    const j = example();
    spoil(j);
    expect(fieldOf(() => parseInventory(j))).toBe(field);
  });

  it('parseInventory_ofANameOrIpv6Address_refusesIt_etcdAndTheProcessesBindToIpv4', () => {
    for (const a of ['cp-1.example.internal', 'fd00::1']) {
      const j = example();
      (j.etcd as Array<Record<string, unknown>>)[0]!.address = a;
      expect(fieldOf(() => parseInventory(j))).toBe('etcd[0].address');
    }
    expect(hostPort('10.0.0.1', 2379)).toBe('10.0.0.1:2379');
  });

  type Entry = Record<string, unknown>;
  const role = (j: Record<string, unknown>, r: string): Entry[] => j[r] as Entry[];

  it.each([
    // One process's two ports: its second listener cannot bind, and systemd restarts it for ever.
    ['ports.api', { api: 17710 }],
    ['ports.metrics', { metrics: 17700 }],
    ['ports.etcdPeer', { etcdPeer: 2379 }],
    ['ports.natsMonitor', { natsMonitor: 6222 }],
    ['ports.peer', { peer: 17711 }],
    // Two roles on one address (cp-1 runs etcd, NATS and a scheduler on 10.0.0.11).
    ['ports.natsClient', { natsClient: 2380 }],
    ['ports.metrics', { metrics: 8222 }],
  ])('parseInventory_withTwoPortsBoundOnOneAddressEqual_refusesNamingThePortItSets %s', (field, ports) => {
    const j = example();
    j.ports = ports;
    expect(fieldOf(() => parseInventory(j))).toBe(field);
  });

  it('parseInventory_withASchedulerAndAHostAgentOnOneAddress_refusesTheirMetricsOnOnePort', () => {
    const j = example();
    Object.assign(role(j, 'hosts')[0]!, { address: '10.0.0.11', machine: 'cp-1' });
    // With the default ports they live side by side (17710 and 17711).
    expect(parseInventory(j).hosts[0]?.machine).toBe('cp-1');
    expect(fieldOf(() => parseInventory({ ...j, ports: { agentMetrics: 17710 } }))).toBe('ports.agentMetrics');
    expect(() => parseInventory({ ...j, ports: { agentMetrics: 17710 } })).toThrow(/ports\.metrics.*schedulers\[0\] and hosts\[0\] both listen on it at 10\.0\.0\.11/);
    // The same port on different addresses is no collision.
    expect(fieldOf(() => parseInventory({ ...example(), ports: { agentMetrics: 17710 } }))).toBeUndefined();
  });

  it('parseInventory_withOneNatsServer_letsItsUnboundClusterPortEqualAnother', () => {
    const j = example();
    j.nats = role(j, 'nats').slice(0, 1);
    j.ports = { natsCluster: 4222 };
    expect(parseInventory(j).ports.natsCluster).toBe(4222);
  });

  it('parseInventory_withTwoHostsOnOneAddress_refusesNamingTheSecond', () => {
    const j = example();
    role(j, 'hosts')[1]!.address = '10.0.1.21';
    expect(fieldOf(() => parseInventory(j))).toBe('hosts[1].address');
  });

  it('parseInventory_withOneAddressOnTwoMachinesAcrossRoles_refusesNamingTheLatersMachine', () => {
    const named = example();
    role(named, 'hosts')[0]!.address = '10.0.0.11'; // etcd[0]'s, machine cp-1; this one says kvm-01
    expect(fieldOf(() => parseInventory(named))).toBe('hosts[0].machine');
    const byDefault = example();
    delete role(byDefault, 'schedulers')[0]!.machine; // machine 10.0.0.11, where etcd[0] says cp-1
    expect(fieldOf(() => parseInventory(byDefault))).toBe('schedulers[0].machine');
    expect(() => parseInventory(byDefault)).toThrow(/etcd\[0\] on the same address 10\.0\.0\.11 is on machine "cp-1"/);
  });

  it.each([
    ['installDir', '/home/ops/forkfleet'],
    ['installDir', '/root/forkfleet'],
    ['installDir', '/opt/../home/forkfleet'],
    ['node', '/root/.nvm/versions/node/v20.19.0/bin/node'],
    ['node', '/run/user/1000/fnm/node'],
    ['node', '/home'],
  ])('parseInventory_withAUnitPathWhereProtectHomeHidesIt_refusesSayingWhy %s %s', (key, path) => {
    const j = { ...example(), [key]: path };
    expect(fieldOf(() => parseInventory(j))).toBe(key);
    expect(() => parseInventory(j)).toThrow(/ProtectHome/);
  });

  it('parseInventory_withAUnitPathBesideTheProtectedOnes_takesIt', () => {
    const inv = parseInventory({ ...example(), installDir: '/homes/forkfleet', node: '/run/node/bin/node' });
    expect([inv.installDir, inv.node]).toEqual(['/homes/forkfleet', '/run/node/bin/node']);
  });

  it.each([
    ['nodes', (j: Record<string, unknown>) => (j.nodes = '/usr/local/bin/node')],
    ['hosts[2].memoryMB', (j: Record<string, unknown>) => (role(j, 'hosts')[2]!.memoryMB = 480000)],
    ['hosts[0].linkgbps', (j: Record<string, unknown>) => (role(j, 'hosts')[0]!.linkgbps = 100)],
    ['etcd[1].adress', (j: Record<string, unknown>) => (role(j, 'etcd')[1]!.adress = '10.0.0.12')],
    ['nats[0].dns', (j: Record<string, unknown>) => (role(j, 'nats')[0]!.dns = ['nats.internal'])],
    ['schedulers[1].dnsNames', (j: Record<string, unknown>) => (role(j, 'schedulers')[1]!.dnsNames = ['api.internal'])],
  ])('parseInventory_withAnUnknownKey_refusesNamingIt %s', (field, spoil) => {
    const j = example();
    spoil(j);
    expect(fieldOf(() => parseInventory(j))).toBe(field);
  });

  it('parseInventory_withAMiscasedKey_suggestsTheKnownOne', () => {
    const j = example();
    role(j, 'hosts')[2]!.memoryMIB = 1024;
    expect(() => parseInventory(j)).toThrow(/hosts\[2\]\.memoryMIB: .*did you mean memoryMib\?/);
  });
});

describe('renderFiles', () => {
  const files = renderFiles(parseInventory(example()), secrets);
  const file = (p: string): string => {
    const f = files.find((x) => x.path === p);
    if (!f) throw new Error(`not rendered: ${p}`);
    return f.content;
  };

  it('renderFiles_givesEachMachineOnlyItsRolesFiles', () => {
    const of = (m: string): string[] => files.filter((f) => f.path.startsWith(`machines/${m}/`)).map((f) => f.path.slice(`machines/${m}/`.length)).sort();
    expect(of('cp-3')).toEqual([
      'etc/default/etcd',
      'etc/forkfleet/etcd/ca.crt',
      'etc/forkfleet/etcd/member.crt',
      'etc/forkfleet/etcd/member.key',
      'etc/forkfleet/nats/ca.crt',
      'etc/forkfleet/nats/server.crt',
      'etc/forkfleet/nats/server.key',
      'etc/nats-server.conf',
      'etc/systemd/system/etcd.service.d/forkfleet.conf',
      'etc/systemd/system/nats-server.service.d/forkfleet.conf',
    ]);
    expect(of('kvm-02')).toEqual([
      'etc/forkfleet/agent.env',
      'etc/forkfleet/agent/ca.crt',
      'etc/forkfleet/agent/nats.crt',
      'etc/forkfleet/agent/nats.key',
      'etc/forkfleet/agent/nats.nk',
      'etc/forkfleet/agent/peer.crt',
      'etc/forkfleet/agent/peer.key',
      'etc/forkfleet/agent/trusted.pem',
      'etc/systemd/system/forkfleet-agent.service',
    ]);
    // A host never receives the signing key, another host's NKey or key, the schedulers'
    // secrets, or anything of etcd's (its CA signs only what etcd admits).
    const kvm = files.filter((f) => f.path.startsWith('machines/kvm-02/')).map((f) => f.content).join('');
    for (const other of ['SIGN', 'METRICS-TOKEN', 'SEED-host-kvm-01', 'SEED-scheduler', 'NATS-CLIENT-KEY-host-kvm-01', 'NATS-CLIENT-KEY-scheduler', 'PEER-KEY-kvm-01', 'ETCD']) expect(kvm).not.toContain(other);
    expect(kvm).toContain('NATS-CLIENT-KEY-host-kvm-02');
    expect(kvm).toContain('PEER-KEY-kvm-02');
  });

  it('renderFiles_secretFilesAreRootOnly', () => {
    const secret = files.filter((f) => /signing\.pem$|\.nk$|\.key$|metrics\.token$/.test(f.path));
    // 2 schedulers x (signing key, NKey, API, etcd and NATS TLS keys, metrics token) + 3 hosts x
    // (NKey, NATS TLS key, peer TLS key) + 3 etcd members' keys + 3 NATS servers' keys.
    expect(secret).toHaveLength(27);
    for (const f of secret) expect([f.path, f.mode]).toEqual([f.path, 0o600]);
  });

  it('renderFiles_etcdSpeaksOnlyTlsAndAdmitsOnlyClientCertificatesOfItsOwnCa', () => {
    const etcd = Object.fromEntries(file('machines/cp-2/etc/default/etcd').split('\n').filter((l) => /^ETCD_/.test(l)).map((l) => l.split(/=(.*)/s).slice(0, 2) as [string, string]));
    for (const k of ['ETCD_LISTEN_CLIENT_URLS', 'ETCD_ADVERTISE_CLIENT_URLS', 'ETCD_LISTEN_PEER_URLS', 'ETCD_INITIAL_ADVERTISE_PEER_URLS']) expect(etcd[k]).toMatch(/^https:\/\/10\.0\.0\.12:\d+$/);
    expect(etcd.ETCD_INITIAL_CLUSTER!.split(',').every((m) => /=https:\/\//.test(m))).toBe(true);
    expect(etcd).toMatchObject({ ETCD_CLIENT_CERT_AUTH: 'true', ETCD_PEER_CLIENT_CERT_AUTH: 'true', ETCD_TRUSTED_CA_FILE: '/run/credentials/etcd.service/ca.crt', ETCD_PEER_TRUSTED_CA_FILE: '/run/credentials/etcd.service/ca.crt' });
    expect(file('machines/cp-2/etc/forkfleet/etcd/ca.crt')).toBe('ETCD-CA\n');
    expect(file('machines/cp-2/etc/forkfleet/etcd/member.key')).toBe('ETCD-MEMBER-KEY-etcd-2\n');
    // The drop-in hands the member its files: every ETCD_*_FILE is one of its credentials.
    const dropIn = file('machines/cp-2/etc/systemd/system/etcd.service.d/forkfleet.conf');
    for (const [k, v] of Object.entries(etcd)) if (k.endsWith('_FILE')) expect(dropIn).toContain(`LoadCredential=${v.slice('/run/credentials/etcd.service/'.length)}:/etc/forkfleet/etcd/`);
    const sched = file('machines/cp-1/etc/forkfleet/scheduler.env');
    expect(sched).toMatch(/^FF_ETCD_ENDPOINTS=https:\/\/10\.0\.0\.11:2379,https:\/\/10\.0\.0\.12:2379,https:\/\/10\.0\.0\.13:2379$/m);
    expect(sched).toMatch(/^FF_ETCD_CERT=\/run\/credentials\/forkfleet-scheduler\.service\/etcd\.crt$/m);
    expect(file('machines/cp-1/etc/forkfleet/scheduler/etcd.key')).toBe('ETCD-CLIENT-KEY-sched-1\n');
    // /metrics names tenants: the scheduler requires the token its unit hands it.
    expect(sched).toMatch(/^FF_METRICS_TOKEN_FILE=\/run\/credentials\/forkfleet-scheduler\.service\/metrics\.token$/m);
    expect(file('machines/cp-1/etc/systemd/system/forkfleet-scheduler.service')).toMatch(/^LoadCredential=metrics\.token:\/etc\/forkfleet\/scheduler\/metrics\.token$/m);
    expect(file('machines/cp-1/etc/forkfleet/scheduler/metrics.token')).toBe('METRICS-TOKEN\n');
  });

  it('renderFiles_natsConfig_routesToTheOtherServersOverTlsAndGivesEachHostItsOwnUser', () => {
    type Tls = { cert_file: string; key_file: string; ca_file: string; verify: boolean };
    const conf = JSON.parse(file('machines/cp-2/etc/nats-server.conf').replace(/^#.*\n/, '')) as { tls: Tls; cluster: { routes: string[]; tls: Tls }; authorization: { users: Array<{ nkey: string; permissions?: { publish: { allow: string[] } } }> } };
    expect(conf.cluster.routes).toEqual(['nats-route://forkfleet-route:route-secret@10.0.0.11:6222', 'nats-route://forkfleet-route:route-secret@10.0.0.13:6222']);
    const tls = { cert_file: '/run/credentials/nats-server.service/server.crt', key_file: '/run/credentials/nats-server.service/server.key', ca_file: '/run/credentials/nats-server.service/ca.crt', verify: true };
    expect(conf.tls).toMatchObject(tls);
    expect(conf.cluster.tls).toMatchObject(tls);
    expect(file('machines/cp-2/etc/forkfleet/nats/server.key')).toBe('NATS-SERVER-KEY-nats-2\n');
    expect(file('machines/cp-2/etc/systemd/system/nats-server.service.d/forkfleet.conf')).toMatch(/^LoadCredential=server\.key:\/etc\/forkfleet\/nats\/server\.key$/m);
    // Processes dial tls:// with the fleet CA and their own client certificate.
    const agent = file('machines/kvm-03/etc/forkfleet/agent.env');
    expect(agent).toMatch(/^FF_NATS_URL=tls:\/\/10\.0\.0\.11:4222,tls:\/\/10\.0\.0\.12:4222,tls:\/\/10\.0\.0\.13:4222$/m);
    expect(agent).toMatch(/^FF_NATS_KEY=\/etc\/forkfleet\/agent\/nats\.key$/m);
    // Its own /metrics, on its address, beside a scheduler's on the same machine.
    expect(agent).toMatch(/^FF_METRICS_ADDR=\d+\.\d+\.\d+\.\d+:17711$/m);
    expect(file('machines/kvm-03/etc/forkfleet/agent/ca.crt')).toBe('CA\n');
    const host = conf.authorization.users.find((u) => u.nkey === 'PUB-host-kvm-03');
    expect(host?.permissions?.publish.allow).toContain('ff.result.kvm-03');
    expect(conf.authorization.users.find((u) => u.nkey === 'PUB-scheduler')?.permissions).toBeUndefined();
  });

  /** A unit file's directives: "Section.Key" -> every value given, in order (an empty one resets the list, as systemd does). */
  const directives = (text: string): Map<string, string[]> => {
    const out = new Map<string, string[]>();
    let section = '';
    for (const line of text.split('\n')) {
      const sec = /^\[(\w+)\]$/.exec(line);
      if (sec) section = sec[1]!;
      const kv = /^(\w+)=(.*)$/.exec(line);
      if (!kv) continue;
      const key = `${section}.${kv[1]!}`;
      out.set(key, kv[2] === '' ? [] : [...(out.get(key) ?? []), kv[2]!]);
    }
    return out;
  };

  it('renderFiles_natsConfig_isGivenBackToGroupNatsAtEveryStartAndReload_sinceEachCopyMakesItRootRoot', () => {
    expect(files.find((f) => f.path === 'machines/cp-1/etc/nats-server.conf')?.mode).toBe(0o640);
    const d = directives(file('machines/cp-1/etc/systemd/system/nats-server.service.d/forkfleet.conf'));
    const chown = '+/bin/chown root:nats /etc/nats-server.conf';
    expect(d.get('Service.ExecStartPre')).toEqual([chown]);
    // Debian's ExecReload (kill -s HUP) replaced: the group first, then the signal.
    expect(d.get('Service.ExecReload')).toEqual([chown, '/bin/kill -s HUP $MAINPID']);
    // INSTALL.md: the copy is the same tar every time, and a re-render's reload follows a daemon-reload (a changed drop-in).
    const install = file('INSTALL.md');
    expect(install).not.toMatch(/chown/);
    expect(install).toContain('copy those as in step 3, then on the NATS servers\n`systemctl daemon-reload && systemctl reload nats-server`');
  });

  it('renderFiles_controlPlaneUnits_waitForTheNetwork_andRestartWithoutGivingUp', () => {
    for (const [unitFile, restart] of [['etcd.service.d/forkfleet.conf', 'on-failure'], ['nats-server.service.d/forkfleet.conf', 'always']] as const) {
      const d = directives(file(`machines/cp-2/etc/systemd/system/${unitFile}`));
      expect([unitFile, d.get('Unit.After'), d.get('Unit.Wants'), d.get('Service.Restart'), d.get('Service.RestartSec')]).toEqual([unitFile, ['network-online.target'], ['network-online.target'], [restart], ['2s']]);
    }
    // A cold boot of the whole cluster: the schedulers and agents exit until etcd and NATS are
    // up, and systemd must not mark them failed after its default 5 starts in 10 s.
    const sched = directives(file('machines/cp-1/etc/systemd/system/forkfleet-scheduler.service'));
    const agent = directives(file('machines/kvm-01/etc/systemd/system/forkfleet-agent.service'));
    for (const d of [sched, agent]) {
      expect(d.get('Unit.StartLimitIntervalSec')).toEqual(['0']);
      expect(d.get('Service.Restart')).toEqual(['always']);
    }
    expect(sched.get('Unit.After')?.join(' ').split(' ')).toEqual(expect.arrayContaining(['network-online.target', 'etcd.service', 'nats-server.service']));
    expect(agent.get('Unit.After')?.join(' ').split(' ')).toEqual(expect.arrayContaining(['network-online.target', 'nats-server.service']));
  });

  it('renderFiles_agentUnit_createsFilesOwnerOnly_soTenantsSnapshotChunksAreNotWorldReadable', () => {
    // FF_DATA_DIR (/var/lib/forkfleet) holds every tenant's memory and disk chunks, made by the
    // agent and its QEMUs (root both): nothing there for other local users.
    const agent = directives(file('machines/kvm-01/etc/systemd/system/forkfleet-agent.service'));
    expect(agent.get('Service.UMask')).toEqual(['0077']);
  });

  it('renderFiles_unitsNameTheInstallDirectoryAndNode', () => {
    expect(file('machines/cp-1/etc/systemd/system/forkfleet-scheduler.service')).toContain('ExecStart=/usr/bin/node --import tsx /opt/forkfleet/services/main.ts');
    expect(file('machines/kvm-01/etc/systemd/system/forkfleet-agent.service')).toMatch(/^KillMode=process$/m);
    expect(files.every((f) => !f.content.includes('@INSTALL_DIR@') && !f.content.includes('@NODE@'))).toBe(true);
    // Node.js installed elsewhere than Debian's path (Debian 12's own nodejs is 18).
    const elsewhere = renderFiles(parseInventory({ ...example(), node: '/usr/local/bin/node' }), secrets);
    expect(elsewhere.find((f) => f.path === 'machines/kvm-01/etc/systemd/system/forkfleet-agent.service')?.content).toContain('ExecStart=/usr/local/bin/node --import tsx /opt/forkfleet/host-agent/main.ts');
  });

  it('renderFiles_dashboardTenants_areEveryTenantTheTokensFileHasATokenFor', () => {
    const entry = (tenant: string, digit: string, admin = false): object => ({ tenant, token_sha256: digit.repeat(64), admin, name: `${tenant}-${digit}` });
    // The first render's admin token (credentials.json): what the CLI creates is tenant admin's.
    const tokensJson = JSON.stringify({ tokens: [entry('admin', 'a', true), entry('acme', 'b'), entry('acme', 'c')] });
    const minted = renderFiles(parseInventory(example()), { ...secrets, tokensJson });
    for (const m of ['cp-1', 'cp-2']) expect(minted.find((f) => f.path === `machines/${m}/etc/forkfleet/scheduler.env`)?.content).toMatch(/^FF_DASHBOARD_TENANTS=admin,acme$/m);
    // No token yet: the scheduler's own default.
    expect(file('machines/cp-1/etc/forkfleet/scheduler.env')).not.toMatch(/FF_DASHBOARD_TENANTS/);
  });
});
