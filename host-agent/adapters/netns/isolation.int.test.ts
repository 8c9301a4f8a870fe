// Sandbox isolation (issue #9), proven from inside real guests: each sandbox's QEMU runs in a
// network namespace of its own and the guest's NIC (slirp, restrict=on) is up, yet etcd, NATS,
// a scheduler stand-in, a peer port stand-in and another sandbox are all unreachable from it.
// One template is booted (256 MiB, the tiny image) and the sandboxes are forked from its snapshot.
import { execFile, spawn } from 'node:child_process';
import { rm } from 'node:fs/promises';
import { connect, createServer, type Server } from 'node:net';
import { networkInterfaces } from 'node:os';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { pino } from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ensureImage } from '../../../deploy/images/build.ts';
import { startEtcd, type EtcdCluster } from '../../../services/testkit/etcd.ts';
import { startNats, type NatsServer } from '../../../services/testkit/nats.ts';
import { waitFor, tempDir } from '../../../services/testkit/proc.ts';
import { noteForReaper } from '../tied.ts';
import type { LocalSnapshot } from '../../domain/vmm.ts';
import { QemuVmmDriver } from '../qemu/driver.ts';
import { isAlive, killHard } from '../qemu/process.ts';
import { netnsOf } from './netns.ts';

const run = promisify(execFile);
const logger = pino({ level: process.env.LOG_LEVEL ?? 'warn' });
const MEM = 256;
/** slirp's address for "the host" as the guest sees it: without isolation, the host's loopback. */
const SLIRP_HOST = '10.0.2.2';
const GUEST_IP = '10.0.2.15';

let root: string;
let driver: QemuVmmDriver;
let snap: LocalSnapshot;
let etcd: EtcdCluster;
let nats: NatsServer;
const listeners: Server[] = [];
const hits: string[] = [];
let schedulerPort = 0;
let peerPort = 0;

// Egress fixture, all in namespaces this test creates (nothing changes in the root namespace):
//   AG = the "agent's namespace" (where the driver puts the host ends and the NAT), with
//        198.51.100.1/24 (the host's LAN) and 198.18.0.1/32 on its uplink, default via
//        198.51.100.2, and a control-plane stand-in listening on every address;
//   UP = the LAN's router, 198.51.100.2 (another machine on the host's LAN, with a listener),
//        and beyond it "the outside": 198.18.0.2 (allowed), 198.18.0.3 (allowed range, but in
//        the driver's deny list), 198.19.0.1 (outside allow_cidrs), each with a listener.
const tag = Math.random().toString(36).slice(2, 7);
const AG = `ffit-ag-${tag}`;
const UP = `ffit-up-${tag}`;
const EG_PORT = 8080;
const namespacesMade: string[] = [];
const TEMPLATE_POLICY = { allowEgress: true, allowCidrs: ['198.18.0.0/24'] };
let tplBefore: { pid: number; ns: string; reached: string };
const helperPids: number[] = [];

async function ip(...args: string[]): Promise<string> {
  return (await run('ip', args)).stdout;
}

/** Listeners inside namespace `ns` (a name, or a QEMU's pid), a node process stopped by PID in afterAll; its pid. */
async function nsListeners(ns: string | number, specs: Array<[string, string]>): Promise<number> {
  const code = `const net=require('node:net');const specs=JSON.parse(process.argv[1]);let n=0;for(const [host,name] of specs){net.createServer((s)=>s.end('FF-REACHED '+name+'\\n')).listen(${EG_PORT},host,()=>{if(++n===specs.length)console.log('ready')})}`;
  const enter = typeof ns === 'number' ? ['nsenter', `--net=/proc/${ns}/ns/net`, '--'] : ['ip', 'netns', 'exec', ns];
  const child = spawn(enter[0]!, [...enter.slice(1), process.execPath, '-e', code, JSON.stringify(specs)], { stdio: ['ignore', 'pipe', 'inherit'] });
  if (child.pid) helperPids.push(child.pid);
  await new Promise<void>((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`listeners in ${ns} not ready`)), 10_000);
    child.stdout.on('data', (d: Buffer) => {
      if (d.toString().includes('ready')) {
        clearTimeout(t);
        resolve();
      }
    });
    child.on('exit', (c) => reject(new Error(`listeners in ${ns} exited ${c}`)));
  });
  return child.pid!;
}

async function makeEgressFixture(): Promise<void> {
  for (const ns of [AG, UP]) {
    await ip('netns', 'add', ns);
    namespacesMade.push(ns);
    noteForReaper({ netns: ns });
    await ip('-n', ns, 'link', 'set', 'lo', 'up');
  }
  await ip('-n', AG, 'link', 'add', 'up0', 'type', 'veth', 'peer', 'name', 'up1', 'netns', UP);
  await ip('-n', AG, 'addr', 'add', '198.51.100.1/24', 'dev', 'up0');
  await ip('-n', AG, 'addr', 'add', '198.18.0.1/32', 'dev', 'up0');
  await ip('-n', AG, 'link', 'set', 'up0', 'up');
  await ip('-n', AG, 'route', 'add', 'default', 'via', '198.51.100.2');
  for (const a of ['198.51.100.2/24', '198.18.0.2/24', '198.18.0.3/24', '198.19.0.1/24']) await ip('-n', UP, 'addr', 'add', a, 'dev', 'up1');
  await ip('-n', UP, 'link', 'set', 'up1', 'up');
  await nsListeners(UP, [['198.51.100.2', 'lan-neighbour'], ['198.18.0.2', 'allowed'], ['198.18.0.3', 'denied-by-agent'], ['198.19.0.1', 'outside-allow-list']]);
  await nsListeners(AG, [['0.0.0.0', 'agent-namespace']]);
}

/** The sandbox end of a VM's egress link and its gateway (the host end), read in its namespace. */
async function linkOf(vmId: string): Promise<{ address: string; gateway: string }> {
  const inside = (...args: string[]): Promise<string> => run('nsenter', [`--net=/proc/${driver.get(vmId)!.pid}/ns/net`, '--', 'ip', ...args]).then((r) => r.stdout);
  const address = /inet (\d+\.\d+\.\d+\.\d+)\//.exec(await inside('-o', '-4', 'addr', 'show', 'dev', 'eth0'))?.[1];
  const gateway = /default via (\d+\.\d+\.\d+\.\d+)/.exec(await inside('-4', 'route', 'show', 'default'))?.[1];
  if (!address || !gateway) throw new Error(`${vmId} has no egress link`);
  return { address, gateway };
}

async function sh(vmId: string, script: string, timeoutMs = 30_000): Promise<{ code: number; out: string; err: string }> {
  const r = await driver.exec(vmId, { path: '/bin/sh', args: ['-c', script], timeoutMs });
  return { code: r.exitCode, out: r.stdout.toString().trim(), err: r.stderr.toString().trim() };
}

/** A TCP listener that answers "FF-REACHED <name>" and records who connected. */
function listener(name: string, host: string): Promise<{ server: Server; port: number }> {
  return new Promise((resolve, reject) => {
    const server = createServer((s) => {
      hits.push(name);
      s.end(`FF-REACHED ${name}\n`);
    });
    server.on('error', reject);
    server.listen(0, host, () => {
      const a = server.address();
      listeners.push(server);
      resolve({ server, port: typeof a === 'object' && a ? a.port : 0 });
    });
  });
}

/**
 * Tries a TCP connection from inside the guest with busybox nc (2 s connect timeout, 5 s in
 * all). Returns what the guest saw: `reached` when any byte came back or the connection stayed
 * open, `refused`/`timeout` otherwise.
 */
async function probe(vmId: string, host: string, port: number): Promise<{ verdict: 'reached' | 'refused' | 'timeout' | 'other'; detail: string }> {
  const r = await sh(vmId, `timeout 5 nc -w 2 ${host} ${port} </dev/null; echo "rc=$?"`, 20_000);
  const detail = `${r.out} | ${r.err}`;
  if (/FF-REACHED|INFO \{|rc=143|rc=0/.test(r.out)) return { verdict: 'reached', detail };
  if (/refused/i.test(r.err)) return { verdict: 'refused', detail };
  if (/timed out|timeout/i.test(r.err)) return { verdict: 'timeout', detail };
  return { verdict: 'other', detail };
}

/** Reads what a listener says, from the test process (the host side). */
function hostRead(host: string, port: number): Promise<string> {
  return new Promise((resolve, reject) => {
    let got = '';
    const s = connect(port, host);
    s.setTimeout(3000, () => s.destroy(new Error('timeout')));
    s.on('data', (d: Buffer) => (got += d.toString()));
    s.on('end', () => resolve(got));
    s.on('error', reject);
  });
}

/** Where the agents of this test record that they turned ip_forward on in AG: in the test's directory, not the machine's /run. */
const forwardMarker = (): string => join(root, 'ip-forward-by-agent');

function hostAddresses(): string[] {
  return Object.values(networkInterfaces())
    .flat()
    .filter((a): a is NonNullable<typeof a> => !!a && a.family === 'IPv4' && !a.internal)
    .map((a) => a.address);
}

beforeAll(async () => {
  [etcd, nats] = await Promise.all([startEtcd(), startNats()]);
  // The scheduler's gRPC port stand-in on loopback; the agents' peer port stand-in on every address.
  schedulerPort = (await listener('scheduler', '127.0.0.1')).port;
  peerPort = (await listener('peer', '0.0.0.0')).port;
  await makeEgressFixture();
  const image = await ensureImage('tiny');
  root = tempDir('ffn-');
  driver = new QemuVmmDriver({ root, accel: 'tcg', logger, egress: { agentNetns: `/run/netns/${AG}`, denyCidrs: ['198.18.0.3/32'], forwardMarker: forwardMarker() } });
  // The template may have egress (allow 198.18.0.0/24): its snapshot replaces its QEMU process,
  // so the replacement must get a namespace and link of its own. Its clones get their own policy.
  const tpl = await driver.create({ vmId: 'tpl', image, memoryMib: MEM, vcpus: 1, hostname: 'tpl', network: TEMPLATE_POLICY });
  // The guest reports its NIC's operstate as up only once the kernel's link watch has run, up
  // to ~1 s after init brought the link up (it still read 'down' right after create in 4 of 4
  // runs here): a snapshot taken before that gives children whose eth0 starts 'down'.
  await waitFor('template eth0 up', async () => (await sh('tpl', 'cat /sys/class/net/eth0/operstate')).out === 'up', 10_000, 50);
  tplBefore = { pid: tpl.pid, ns: (await netnsOf(tpl.pid))!, reached: (await probe('tpl', '198.18.0.2', EG_PORT)).verdict };
  snap = await driver.snapshot('tpl', 'snap-net');
  await driver.fork(snap, [
    { vmId: 'sb1', hostname: 'sb1', sandboxId: 'sb1' },
    { vmId: 'sb2', hostname: 'sb2', sandboxId: 'sb2' },
  ]);
});

afterAll(async () => {
  await driver?.close().catch(() => undefined);
  for (const vm of driver?.list() ?? []) if (vm.pid > 0 && isAlive(vm.pid)) killHard(vm.pid);
  if (root) await rm(root, { recursive: true, force: true });
  for (const l of listeners) l.close();
  for (const pid of helperPids) killHard(pid);
  for (const ns of namespacesMade) await ip('netns', 'del', ns).catch(() => undefined);
  await Promise.all([etcd?.stop(), nats?.stop()]);
});

describe('sandbox network isolation (real QEMU guests)', () => {
  it('netns_whenSandboxesForkedFromOneSnapshot_eachQemuHasItsOwnNamespace', async () => {
    const mine = await netnsOf('self');
    const ns = await Promise.all(['tpl', 'sb1', 'sb2'].map((id) => netnsOf(driver.get(id)!.pid)));
    expect(ns.every((n) => n?.startsWith('net:['))).toBe(true);
    expect(new Set([mine, ...ns]).size).toBe(4);
    // The NIC is part of the device set the snapshot manifest records (restore refuses a mismatch).
    expect(snap.manifest.config.devices).toContain('virtio-net-device:user');
    // The namespace is empty: only a loopback device, and it is down.
    const { stdout } = await run('nsenter', [`--net=/proc/${driver.get('sb1')!.pid}/ns/net`, '--', 'ip', '-o', 'link']);
    expect(stdout.trim().split('\n')).toHaveLength(1);
    expect(stdout).toMatch(/^1: lo: <LOOPBACK>/);
  });

  it('nic_insideGuest_isUpWithItsAddressAndReachesItsOwnSlirpGateway', async () => {
    expect((await sh('sb1', 'cat /sys/class/net/eth0/operstate')).out).toBe('up');
    expect((await sh('sb1', 'ip -o -4 addr show dev eth0')).out).toContain(`${GUEST_IP}/24`);
    // Positive controls, so the unreachable verdicts below cannot come from a dead NIC or a
    // broken probe: ICMP to slirp's gateway answers, and a guest reaches its own listener
    // through its NIC address.
    const ping = await sh('sb1', `ping -c 1 -W 3 ${SLIRP_HOST}`);
    expect(ping.code, ping.out + ping.err).toBe(0);
    await sh('sb1', `(echo FF-REACHED self | nc -l -p 9999) >/dev/null 2>&1 &`);
    await new Promise((r) => setTimeout(r, 300));
    expect((await probe('sb1', GUEST_IP, 9999)).verdict).toBe('reached');
  });

  it('controlPlane_fromInsideGuest_etcdNatsSchedulerAndPeerPortsAreUnreachable', async () => {
    const natsPort = nats.port;
    const etcdPort = Number(new URL(etcd.endpoints[0]!).port);
    const targets: Array<[string, string, number]> = [
      ['etcd', SLIRP_HOST, etcdPort],
      ['nats', SLIRP_HOST, natsPort],
      ['nats-monitor', SLIRP_HOST, nats.monitorPort],
      ['scheduler', SLIRP_HOST, schedulerPort],
      ['peer', SLIRP_HOST, peerPort],
      ...hostAddresses().map((a): [string, string, number] => [`peer@${a}`, a, peerPort]),
    ];
    // The listeners do answer when asked from where they are meant to be reached.
    for (const [name, port] of [['scheduler', schedulerPort], ['peer', peerPort]] as const) expect(await hostRead('127.0.0.1', port)).toBe(`FF-REACHED ${name}\n`);
    hits.length = 0;
    const seen: Record<string, string> = {};
    for (const [name, host, port] of targets) {
      const p = await probe('sb1', host, port);
      seen[`${name} ${host}:${port}`] = p.verdict === 'reached' ? `REACHED (${p.detail})` : 'unreachable';
    }
    expect(Object.values(seen).every((v) => v === 'unreachable'), JSON.stringify(seen, null, 2)).toBe(true);
    expect(hits).toEqual([]);
    // Plain HTTP too (etcd's health endpoint, the NATS monitor).
    const wget = await sh('sb1', `wget -q -T 3 -O- http://${SLIRP_HOST}:${etcdPort}/health; echo "rc=$?"; wget -q -T 3 -O- http://${SLIRP_HOST}:${nats.monitorPort}/healthz; echo "rc=$?"`);
    expect(wget.out).not.toMatch(/health|ok/i);
  });

  it('otherSandbox_fromInsideGuest_isUnreachable', async () => {
    // sb2 listens; sb1 tries every address sb2 could have: the shared guest address is sb1's
    // own (each slirp network is private), the slirp host alias and the host's addresses lead
    // nowhere.
    await sh('sb2', `(while true; do echo FF-REACHED sb2 | nc -l -p 7000; done) >/dev/null 2>&1 &`);
    await new Promise((r) => setTimeout(r, 300));
    expect((await probe('sb2', GUEST_IP, 7000)).verdict).toBe('reached'); // sb2's listener works
    for (const host of [GUEST_IP, SLIRP_HOST, ...hostAddresses()]) {
      const p = await probe('sb1', host, 7000);
      expect(p.verdict, `${host}: ${p.detail}`).not.toBe('reached');
    }
  });

  it('destroy_whenSandboxDestroyed_itsNamespaceIsGone', async () => {
    // The namespace is anonymous (no /run/netns file, no bind mount): only its QEMU holds it, so
    // it is freed once that process is gone. (For egress sandboxes the test below also sees the
    // link vanish, which happens only when the namespace is dismantled.)
    const pid = driver.get('sb2')!.pid;
    expect(await netnsOf(pid)).toMatch(/^net:\[\d+\]$/);
    await driver.destroy('sb2');
    const until = Date.now() + 3000;
    while (Date.now() < until && (await netnsOf(pid)) !== undefined) await new Promise((r) => setTimeout(r, 20));
    expect(await netnsOf(pid)).toBeUndefined();
    expect(isAlive(pid)).toBe(false);
  });
});

describe('sandbox egress by policy (veth + NAT into a namespace this test made)', () => {
  const allowedOnly = { allowEgress: true, allowCidrs: ['198.18.0.0/24'] };

  it('egress_whenPolicyAllowsCidr_onlyThatCidrIsReachableAndNeverTheControlPlane', async () => {
    const [vm] = await driver.fork(snap, [{ vmId: 'eg1', sandboxId: 'eg1', network: allowedOnly }]);
    expect(vm?.state).toBe('running');
    const verdicts: Record<string, string> = {};
    const { gateway } = await linkOf('eg1');
    expect(gateway).toMatch(/^100\.96\./);
    for (const host of ['198.18.0.2', '198.18.0.3', '198.19.0.1', '198.18.0.1', '198.51.100.2', gateway, SLIRP_HOST]) {
      verdicts[host === gateway ? 'own gateway' : host] = (await probe('eg1', host, EG_PORT)).verdict === 'reached' ? 'reached' : 'unreachable';
    }
    const etcdPort = Number(new URL(etcd.endpoints[0]!).port);
    for (const [name, port] of [['etcd', etcdPort], ['nats', nats.port], ['scheduler', schedulerPort], ['peer', peerPort]] as const) {
      verdicts[`${name}@${SLIRP_HOST}`] = (await probe('eg1', SLIRP_HOST, port)).verdict === 'reached' ? 'reached' : 'unreachable';
    }
    expect(verdicts).toEqual({
      '198.18.0.2': 'reached', // allowed by the policy
      '198.18.0.3': 'unreachable', // in allow_cidrs, but on the driver's deny list (control plane elsewhere)
      '198.19.0.1': 'unreachable', // not in allow_cidrs
      '198.18.0.1': 'unreachable', // the agent's own namespace, although in allow_cidrs
      '198.51.100.2': 'unreachable', // another machine on the agent namespace's LAN
      'own gateway': 'unreachable', // the host end of its own link
      [SLIRP_HOST]: 'unreachable',
      [`etcd@${SLIRP_HOST}`]: 'unreachable',
      [`nats@${SLIRP_HOST}`]: 'unreachable',
      [`scheduler@${SLIRP_HOST}`]: 'unreachable',
      [`peer@${SLIRP_HOST}`]: 'unreachable',
    });
    // The sandbox without egress (same snapshot) still reaches nothing.
    expect((await probe('sb1', '198.18.0.2', EG_PORT)).verdict).not.toBe('reached');
  });

  it('egress_whenAllowListEmpty_anyOutsideAddressButStillNoControlPlane', async () => {
    await driver.fork(snap, [{ vmId: 'eg2', sandboxId: 'eg2', network: { allowEgress: true, allowCidrs: [] } }]);
    expect((await probe('eg2', '198.19.0.1', EG_PORT)).verdict).toBe('reached');
    expect((await probe('eg2', '198.18.0.2', EG_PORT)).verdict).toBe('reached');
    expect((await probe('eg2', '198.18.0.3', EG_PORT)).verdict).not.toBe('reached');
    expect((await probe('eg2', '198.18.0.1', EG_PORT)).verdict).not.toBe('reached');
    // Another machine on the agent namespace's LAN (etcd, another host's peer port), although
    // FF_EGRESS_DENY_CIDRS does not name it: the agent's connected subnets are refused whole.
    expect((await probe('eg2', '198.51.100.2', EG_PORT)).verdict).not.toBe('reached');
    // eg1's end of its link (nothing listens in a sandbox namespace, so this shows no more than
    // that the address leads nowhere; the agent-side forward rule is the second layer).
    await sh('eg1', `(while true; do echo FF-REACHED eg1 | nc -l -p 7001; done) >/dev/null 2>&1 &`);
    expect((await probe('eg2', (await linkOf('eg1')).address, 7001)).verdict).not.toBe('reached');
  });

  it('egress_aMachineThatRoutesThePoolThroughTheHost_cannotOpenAConnectionIntoASandboxNamespace', async () => {
    // "The outside" routes the link pool through the agent's namespace, as any machine on a
    // host's network can: only replies to what the sandbox opened may go in.
    const vm = driver.list().find((v) => v.vmId === 'eg1')!;
    const addr = (await linkOf('eg1')).address;
    expect(addr).toMatch(/^100\.96\./);
    // Stopped at the end: it would keep the namespace (and its link) after the sandbox goes.
    const listenerPid = await nsListeners(vm.pid, [['0.0.0.0', 'sandbox-namespace']]);
    await ip('-n', UP, 'route', 'add', '100.96.0.0/16', 'via', '198.51.100.1');
    try {
      const code = `const s=require('node:net').connect(${EG_PORT},process.argv[1]);s.on('data',(d)=>{process.stdout.write(d);process.exit(0)});s.on('error',(e)=>{console.log(e.code);process.exit(0)});setTimeout(()=>{console.log('timeout');process.exit(0)},3000)`;
      const got = (await run('ip', ['netns', 'exec', UP, process.execPath, '-e', code, addr])).stdout;
      expect(got).not.toContain('FF-REACHED');
      // The sandbox's own connections out still work (replies go in).
      expect((await probe('eg1', '198.18.0.2', EG_PORT)).verdict).toBe('reached');
    } finally {
      await ip('-n', UP, 'route', 'del', '100.96.0.0/16', 'via', '198.51.100.1').catch(() => undefined);
      killHard(listenerPid);
    }
  });

  it('egress_whenBootedTemplateSnapshotted_replacementProcessGetsItsOwnNamespaceAndThePolicy', async () => {
    // A booted VM's snapshot replaces its QEMU process (a new generation): the new process has a
    // new namespace and link, with the same policy; the old link went with the old process.
    expect(tplBefore.reached).toBe('reached');
    const pid1 = driver.get('tpl')!.pid;
    expect(pid1).not.toBe(tplBefore.pid);
    expect(isAlive(tplBefore.pid)).toBe(false);
    expect(await netnsOf(pid1)).not.toBe(tplBefore.ns);
    expect((await probe('tpl', '198.18.0.2', EG_PORT)).verdict).toBe('reached');
    expect((await probe('tpl', '198.19.0.1', EG_PORT)).verdict).not.toBe('reached');
    expect((await probe('tpl', '198.18.0.1', EG_PORT)).verdict).not.toBe('reached');
    // One link per live egress process: tpl, eg1, eg2.
    expect((await ip('-n', AG, '-o', 'link', 'show')).match(/ffe\d+@/g) ?? []).toHaveLength(3);
  });

  it('egress_whenSandboxesDestroyed_theirLinksAreGone', async () => {
    const before = await ip('-n', AG, '-o', 'link', 'show');
    expect(before).toMatch(/ffe\d+@/);
    await driver.destroy('eg1');
    await driver.destroy('eg2');
    // Only the template's link is left (the kernel tears a namespace down asynchronously).
    const links = async (): Promise<number> => ((await ip('-n', AG, '-o', 'link', 'show')).match(/ffe\d+@/g) ?? []).length;
    const until = Date.now() + 3000;
    while (Date.now() < until && (await links()) !== 1) await new Promise((r) => setTimeout(r, 50));
    expect(await links()).toBe(1);
  });
});

describe('agent restart', () => {
  it('recover_whenAgentRestarts_adoptedSandboxKeepsItsNamespaceAndReapedOnesLeaveNothing', async () => {
    // A previous agent (own root) left an egress sandbox behind; the next one reaps it.
    const other = tempDir('ffn-r-');
    try {
      const egress = { agentNetns: `/run/netns/${AG}`, forwardMarker: forwardMarker() };
      const previous = new QemuVmmDriver({ root: other, accel: 'tcg', logger, egress });
      const [vm] = await previous.fork(snap, [{ vmId: 'orphan', network: { allowEgress: true, allowCidrs: [] } }]);
      const ns = (await netnsOf(vm!.pid))!;
      const links = async (): Promise<number> => ((await ip('-n', AG, '-o', 'link', 'show')).match(/ffe\d+@/g) ?? []).length;
      expect(await links()).toBe(2); // the template's and the orphan's
      previous.detach();
      const next = new QemuVmmDriver({ root: other, accel: 'tcg', logger, egress });
      expect(await next.recover('reap')).toEqual({ adopted: [], reaped: ['orphan'] });
      const until = Date.now() + 3000;
      while (Date.now() < until && (await links()) !== 1) await new Promise((r) => setTimeout(r, 50));
      expect(await links()).toBe(1);
      expect(await netnsOf(vm!.pid), `${ns} still held`).toBeUndefined();
    } finally {
      await rm(other, { recursive: true, force: true });
    }
    // This agent restarts: sb1 is adopted with the same process and namespace, still isolated.
    const pid = driver.get('sb1')!.pid;
    const ns = await netnsOf(pid);
    // Meanwhile the host's firewall was reloaded (flush ruleset): the agent-side rules are gone
    // until the next agent puts them back for the egress VMs it adopts (the template).
    await run('ip', ['netns', 'exec', AG, 'nft', 'delete', 'table', 'ip', 'ff_egress']);
    driver.detach();
    const restarted = new QemuVmmDriver({ root, accel: 'tcg', logger, egress: { agentNetns: `/run/netns/${AG}`, denyCidrs: ['198.18.0.3/32'], forwardMarker: forwardMarker() } });
    const report = await restarted.recover('adopt');
    driver = restarted;
    expect(report.adopted).toContain('sb1');
    expect(driver.get('sb1')!.pid).toBe(pid);
    expect(await netnsOf(pid)).toBe(ns);
    expect((await run('ip', ['netns', 'exec', AG, 'nft', 'list', 'tables'])).stdout).toContain('table ip ff_egress');
    expect((await probe('sb1', SLIRP_HOST, schedulerPort)).verdict).not.toBe('reached');
    expect((await sh('sb1', 'cat /sys/class/net/eth0/operstate')).out).toBe('up');
  });
});
