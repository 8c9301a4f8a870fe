import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { fieldOf } from '../../services/testkit/fields.ts';
import { DEFAULT_PORTS, hostPort, parseInventory } from './inventory.ts';
import { renderFiles, type Secrets } from './render.ts';

const example = (): Record<string, unknown> => JSON.parse(readFileSync(join(import.meta.dirname, 'inventory.example.json'), 'utf8')) as Record<string, unknown>;


const secrets: Secrets = {
  caCert: 'CA\n',
  schedulerTls: new Map([
    ['sched-1', { cert: 'C1\n', key: 'K1\n' }],
    ['sched-2', { cert: 'C2\n', key: 'K2\n' }],
  ]),
  signingKey: 'SIGN\n',
  signingPub: 'PUB\n',
  nkeys: new Map(['scheduler', 'host-kvm-01', 'host-kvm-02', 'host-kvm-03'].map((id) => [id, { seed: `SEED-${id}`, pub: `PUB-${id}` }])),
  natsRoutePassword: 'route-secret',
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
    ['hosts[0].linkGbps', (j: Record<string, unknown>) => ((j.hosts as Array<Record<string, unknown>>)[0]!.linkGbps = 0)],
    ['installDir', (j: Record<string, unknown>) => (j.installDir = 'relative/path')],
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
    expect(of('cp-3')).toEqual(['etc/default/etcd', 'etc/nats-server.conf', 'etc/systemd/system/nats-server.service.d/forkfleet.conf']);
    expect(of('kvm-02')).toEqual(['etc/forkfleet/agent.env', 'etc/forkfleet/agent/nats.nk', 'etc/forkfleet/agent/trusted.pem', 'etc/systemd/system/forkfleet-agent.service']);
    // A host never receives the signing key, another host's NKey or the schedulers' secrets.
    const kvm = files.filter((f) => f.path.startsWith('machines/kvm-02/')).map((f) => f.content).join('');
    expect(kvm).not.toContain('SIGN');
    expect(kvm).not.toContain('SEED-host-kvm-01');
    expect(kvm).not.toContain('SEED-scheduler');
  });

  it('renderFiles_secretFilesAreRootOnly', () => {
    const secret = files.filter((f) => /signing\.pem$|\.nk$|tls\.key$/.test(f.path));
    // 2 schedulers x (signing key, NKey, TLS key) + 3 hosts' NKeys.
    expect(secret).toHaveLength(9);
    for (const f of secret) expect([f.path, f.mode]).toEqual([f.path, 0o600]);
  });

  it('renderFiles_natsConfig_routesToTheOtherServersAndGivesEachHostItsOwnUser', () => {
    const conf = JSON.parse(file('machines/cp-2/etc/nats-server.conf').replace(/^#.*\n/, '')) as { cluster: { routes: string[] }; authorization: { users: Array<{ nkey: string; permissions?: { publish: { allow: string[] } } }> } };
    expect(conf.cluster.routes).toEqual(['nats-route://forkfleet-route:route-secret@10.0.0.11:6222', 'nats-route://forkfleet-route:route-secret@10.0.0.13:6222']);
    const host = conf.authorization.users.find((u) => u.nkey === 'PUB-host-kvm-03');
    expect(host?.permissions?.publish.allow).toContain('ff.result.kvm-03');
    expect(conf.authorization.users.find((u) => u.nkey === 'PUB-scheduler')?.permissions).toBeUndefined();
  });

  it('renderFiles_unitsNameTheInstallDirectory', () => {
    expect(file('machines/cp-1/etc/systemd/system/forkfleet-scheduler.service')).toContain('ExecStart=/usr/bin/node --import tsx /opt/forkfleet/services/main.ts');
    expect(file('machines/kvm-01/etc/systemd/system/forkfleet-agent.service')).toMatch(/^KillMode=process$/m);
    expect(files.every((f) => !f.content.includes('@INSTALL_DIR@'))).toBe(true);
  });
});
