// EgressManager against real namespaces, links and nftables (root), without QEMU: a sandbox is
// stood in for by `unshare --net -- sleep`, and what it can reach is tried from its namespace
// with node (the sandbox-side filter is an output chain there, which slirp's sockets go through
// just the same). Every namespace is made by this test; nothing changes in the root namespace.
//
//   AG  "the agent's namespace": up0 198.51.100.1/24 (the host's LAN), o0 10.77.0.1/24 (another
//       network of the host's, e.g. a bridge), default via 198.51.100.2, ip_forward off;
//   LAN the LAN: 198.51.100.2 (its router) and 198.51.100.7 (another machine: etcd, a peer
//       port) with a listener, and 203.0.113.10 ("the internet", beyond the router) with one,
//       and 168.63.129.16 (Azure's WireServer, beyond the router too) with DNS and another port;
//   OTH the other network: 10.77.0.2 with a listener, default via 10.77.0.1.
// And a host on a network it knows only by its routes (a Hetzner private network, a cloud's DHCP):
//   AGR "the agent's namespace": r0 10.88.0.2/32, "10.88.0.1 dev r0 scope link", 10.88.0.0/16
//       via 10.88.0.1, default via 10.88.0.1, ip_forward off;
//   VPC its network: 10.88.0.1 (the router) and 10.88.0.5 (another machine) with listeners, and
//       203.0.113.10 ("the internet", beyond the router) with one.
import { execFile, spawn } from 'node:child_process';
import { existsSync, readdirSync, rmdirSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { promisify } from 'node:util';
import { pino } from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { isAlive, killHard } from '../qemu/process.ts';
import { EgressManager, exec, FORWARD_GUARD_COMMENT, forwardMarkerOf, linkCursorOf } from './egress.ts';
import { tempDir } from '../../../services/testkit/proc.ts';
import { noteForReaper } from '../tied.ts';

const run = promisify(execFile);
const tag = Math.random().toString(36).slice(2, 7);
const AG = `ffeg-ag-${tag}`;
const LAN = `ffeg-lan-${tag}`;
const OTH = `ffeg-oth-${tag}`;
const AGR = `ffeg-agr-${tag}`;
const VPC = `ffeg-vpc-${tag}`;
const PORT = 8080;
const made: string[] = [];
const pids: number[] = [];
/** The sandbox stand-ins (also in pids). */
const sandboxes: number[] = [];
/** What the managers write on /run for the namespaces made here (forward markers, link cursors). */
const runFiles: string[] = [];
const logs: string[] = [];
const logger = pino({ level: 'info' }, { write: (s: string) => void logs.push(s) });
/** Where the agent records that it turned ip_forward on in AG (by AG's inode; known once AG exists). */
let FORWARD_MARKER = '';
const opts = { agentNetns: `/run/netns/${AG}`, logger };
const routedOpts = { agentNetns: `/run/netns/${AGR}`, logger };

async function ip(...args: string[]): Promise<string> {
  return (await run('ip', args)).stdout;
}

async function inNs(ns: string, cmd: string, ...args: string[]): Promise<string> {
  return (await run('ip', ['netns', 'exec', ns, cmd, ...args])).stdout;
}

/** Listeners answering "FF-REACHED <name>" in namespace `ns`; resolves once they listen. */
async function listeners(ns: string, specs: Array<[string, string]>, port = PORT): Promise<void> {
  const code = `const net=require('node:net');const specs=JSON.parse(process.argv[1]);let n=0;for(const [host,name] of specs){net.createServer((s)=>s.end('FF-REACHED '+name+'\\n')).listen(${port},host,()=>{if(++n===specs.length)console.log('ready')})}`;
  const child = spawn('ip', ['netns', 'exec', ns, process.execPath, '-e', code, JSON.stringify(specs)], { stdio: ['ignore', 'pipe', 'inherit'] });
  pids.push(child.pid!);
  await new Promise<void>((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`listeners in ${ns} not ready`)), 10_000);
    child.stdout.on('data', (d: Buffer) => d.toString().includes('ready') && (clearTimeout(t), resolve()));
    child.on('exit', (c) => reject(new Error(`listeners in ${ns} exited ${c}`)));
  });
}

/** What a TCP connection to host:PORT from `enter` (a command prefix into a namespace) got: the listener's name, or why not. */
async function reach(enter: string[], host: string, port = PORT): Promise<string> {
  const code = `const s=require('node:net').connect(${port},process.argv[1]);s.on('data',(d)=>{process.stdout.write(String(d).trim());process.exit(0)});s.on('error',(e)=>{console.log(e.code);process.exit(0)});setTimeout(()=>{console.log('timeout');process.exit(0)},1500)`;
  return (await run(enter[0]!, [...enter.slice(1), process.execPath, '-e', code, host])).stdout.trim();
}
const fromNs = (ns: string): string[] => ['ip', 'netns', 'exec', ns];
const fromPid = (pid: number): string[] => ['nsenter', `--net=/proc/${pid}/ns/net`, '--'];

/** A stand-in for a sandbox's QEMU: a process in a new, empty network namespace. */
function sandbox(): number {
  const p = spawn('unshare', ['--net', '--', 'sleep', '600'], { stdio: 'ignore' });
  pids.push(p.pid!);
  sandboxes.push(p.pid!);
  noteForReaper({ pid: p.pid! });
  return p.pid!;
}

async function gone(pid: number, link: string): Promise<void> {
  killHard(pid);
  const until = Date.now() + 5000;
  while (Date.now() < until && (await ip('-n', AG, '-o', 'link', 'show')).includes(`${link}@`)) await new Promise((r) => setTimeout(r, 20));
  expect(await ip('-n', AG, '-o', 'link', 'show')).not.toContain(`${link}@`);
}

/** The index of a link (ffe<n>). */
const index = (l: string): number => Number(l.slice(3));

beforeAll(async () => {
  for (const ns of [AG, LAN, OTH, AGR, VPC]) {
    await ip('netns', 'add', ns);
    made.push(ns);
    noteForReaper({ netns: ns });
    await ip('-n', ns, 'link', 'set', 'lo', 'up');
  }
  await ip('-n', AG, 'link', 'add', 'up0', 'type', 'veth', 'peer', 'name', 'lan0', 'netns', LAN);
  await ip('-n', AG, 'link', 'add', 'o0', 'type', 'veth', 'peer', 'name', 'o1', 'netns', OTH);
  await ip('-n', AG, 'addr', 'add', '198.51.100.1/24', 'dev', 'up0');
  await ip('-n', AG, 'addr', 'add', '10.77.0.1/24', 'dev', 'o0');
  for (const l of ['up0', 'o0']) await ip('-n', AG, 'link', 'set', l, 'up');
  await ip('-n', AG, 'route', 'add', 'default', 'via', '198.51.100.2');
  for (const a of ['198.51.100.2/24', '198.51.100.7/24', '198.51.100.53/24', '203.0.113.10/24', '168.63.129.16/32']) await ip('-n', LAN, 'addr', 'add', a, 'dev', 'lan0');
  await ip('-n', LAN, 'link', 'set', 'lan0', 'up');
  await ip('-n', LAN, 'route', 'add', '10.77.0.0/24', 'via', '198.51.100.1');
  await ip('-n', OTH, 'addr', 'add', '10.77.0.2/24', 'dev', 'o1');
  await ip('-n', OTH, 'link', 'set', 'o1', 'up');
  await ip('-n', OTH, 'route', 'add', 'default', 'via', '10.77.0.1');
  await inNs(AG, 'sysctl', '-q', '-w', 'net.ipv4.ip_forward=0');
  FORWARD_MARKER = forwardMarkerOf(statSync(`/run/netns/${AG}`).ino);
  for (const ns of [AG, AGR]) runFiles.push(forwardMarkerOf(statSync(`/run/netns/${ns}`).ino), linkCursorOf(statSync(`/run/netns/${ns}`).ino));
  await ip('-n', AGR, 'link', 'add', 'r0', 'type', 'veth', 'peer', 'name', 'r1', 'netns', VPC);
  await ip('-n', AGR, 'addr', 'add', '10.88.0.2/32', 'dev', 'r0');
  await ip('-n', AGR, 'link', 'set', 'r0', 'up');
  await ip('-n', AGR, 'route', 'add', '10.88.0.1', 'dev', 'r0', 'scope', 'link');
  await ip('-n', AGR, 'route', 'add', '10.88.0.0/16', 'via', '10.88.0.1', 'dev', 'r0');
  await ip('-n', AGR, 'route', 'add', 'default', 'via', '10.88.0.1', 'dev', 'r0');
  for (const a of ['10.88.0.1/16', '10.88.0.5/16', '203.0.113.10/24']) await ip('-n', VPC, 'addr', 'add', a, 'dev', 'r1');
  await ip('-n', VPC, 'link', 'set', 'r1', 'up');
  await inNs(AGR, 'sysctl', '-q', '-w', 'net.ipv4.ip_forward=0');
  await listeners(VPC, [['10.88.0.1', 'vpc-router'], ['10.88.0.5', 'vpc-machine'], ['203.0.113.10', 'internet']]);
  await listeners(LAN, [['198.51.100.7', 'lan-machine'], ['203.0.113.10', 'internet']]);
  await listeners(OTH, [['10.77.0.2', 'other-network']]);
  // The host's resolver, on its LAN (a cloud VPC's or a router's): DNS on 53, something else on PORT.
  await listeners(LAN, [['198.51.100.53', 'resolver-dns']], 53);
  await listeners(LAN, [['198.51.100.53', 'resolver-other']]);
  await listeners(LAN, [['168.63.129.16', 'wireserver-dns']], 53);
  await listeners(LAN, [['168.63.129.16', 'wireserver']]);
});

afterAll(async () => {
  for (const f of runFiles) rmSync(f, { force: true });
  // Their directory too, unless another agent's file is in it.
  const runDir = dirname(forwardMarkerOf(0));
  if (existsSync(runDir) && readdirSync(runDir).length === 0) rmdirSync(runDir);
  for (const pid of pids) if (isAlive(pid)) killHard(pid);
  for (const ns of made) {
    if (ns.startsWith('dir:')) rmSync(ns.slice(4), { recursive: true, force: true });
    else await ip('netns', 'del', ns).catch(() => undefined);
  }
});

describe('egress (EgressManager, real namespaces)', () => {
  it('forwarding_whenItWasOff_agentTurnsItOnForTheSandboxLinksOnly', async () => {
    const sb = sandbox();
    await new EgressManager(opts).attach(sb, { allowEgress: true, allowCidrs: [] });
    expect((await inNs(AG, 'sysctl', '-n', 'net.ipv4.ip_forward')).trim()).toBe('1');
    // The sandbox's traffic is forwarded; the host's other networks are not routed to each other.
    expect(await reach(fromPid(sb), '203.0.113.10')).toBe('FF-REACHED internet');
    expect(await reach(fromNs(LAN), '10.77.0.2')).not.toContain('FF-REACHED');
    expect(logs.join('')).toMatch(/turned net\.ipv4\.ip_forward on/);
    // A restarted agent finds forwarding on, and keeps the rule: it was the one that turned it on.
    logs.length = 0;
    await new EgressManager(opts).applyAgentSide();
    expect(await inNs(AG, 'nft', 'list', 'table', 'ip', 'ff_egress')).toContain(FORWARD_GUARD_COMMENT);
    expect(await reach(fromNs(LAN), '10.77.0.2')).not.toContain('FF-REACHED');
    expect(logs.join('')).not.toMatch(/ip_forward/);
  });

  it('forwarding_turnedOnByTheAgent_keepsItsGuardAfterAFirewallReloadFlushedTheTable_andAnAgentRestart', async () => {
    await inNs(AG, 'nft', 'delete', 'table', 'ip', 'ff_egress');
    expect(await reach(fromNs(LAN), '10.77.0.2')).toBe('FF-REACHED other-network');
    await new EgressManager(opts).applyAgentSide();
    expect(await inNs(AG, 'nft', 'list', 'table', 'ip', 'ff_egress')).toContain(FORWARD_GUARD_COMMENT);
    expect(await reach(fromNs(LAN), '10.77.0.2')).not.toContain('FF-REACHED');
  });

  it('forwarding_whenItWasOnBefore_theHostsRoutingIsLeftAlone', async () => {
    // Forwarding on, no table of ours that says we turned it on, and no record of it (the host
    // turned it on itself).
    rmSync(FORWARD_MARKER, { force: true });
    await inNs(AG, 'nft', 'delete', 'table', 'ip', 'ff_egress');
    await new EgressManager(opts).applyAgentSide();
    expect(await inNs(AG, 'nft', 'list', 'table', 'ip', 'ff_egress')).not.toContain(FORWARD_GUARD_COMMENT);
    expect(await reach(fromNs(LAN), '10.77.0.2')).toBe('FF-REACHED other-network');
  });

  it('attach_sandboxAsksTheHostsResolverOnItsDeniedLanOnPort53Only_unlessItsAllowListLeavesTheResolverOut', async () => {
    const dir = tempDir('ffeg-');
    made.push(`dir:${dir}`);
    const resolvConf = join(dir, 'resolv.conf');
    writeFileSync(resolvConf, '# written by the test\nnameserver 198.51.100.53\nnameserver 127.0.0.53\nsearch example.internal\n');
    const m = new EgressManager({ ...opts, resolvConf });
    const open = sandbox();
    await m.attach(open, { allowEgress: true, allowCidrs: [] });
    expect(await reach(fromPid(open), '198.51.100.53', 53)).toBe('FF-REACHED resolver-dns');
    expect(await reach(fromPid(open), '198.51.100.53')).not.toContain('FF-REACHED');
    expect(await reach(fromPid(open), '198.51.100.7')).not.toContain('FF-REACHED');
    // An allow list that leaves the resolver out keeps it out.
    const narrow = sandbox();
    await m.attach(narrow, { allowEgress: true, allowCidrs: ['203.0.113.0/24'] });
    expect(await reach(fromPid(narrow), '203.0.113.10')).toBe('FF-REACHED internet');
    expect(await reach(fromPid(narrow), '198.51.100.53', 53)).not.toContain('FF-REACHED');
  });

  it('attach_withAnyAllowList_sandboxReachesBeyondTheRouterButNoMachineOnTheAgentsSubnets', async () => {
    const m = new EgressManager(opts);
    const open = sandbox();
    await m.attach(open, { allowEgress: true, allowCidrs: [] });
    expect(await reach(fromPid(open), '203.0.113.10')).toBe('FF-REACHED internet');
    // Another machine on the host's LAN (etcd, another host's peer port) and another network of
    // the host's: not reachable, although FF_EGRESS_DENY_CIDRS is empty.
    expect(await reach(fromPid(open), '198.51.100.7')).not.toContain('FF-REACHED');
    expect(await reach(fromPid(open), '10.77.0.2')).not.toContain('FF-REACHED');
    // Not even when allow_cidrs names them: the deny list comes first.
    const named = sandbox();
    await m.attach(named, { allowEgress: true, allowCidrs: ['198.51.100.0/24', '203.0.113.0/24'] });
    expect(await reach(fromPid(named), '203.0.113.10')).toBe('FF-REACHED internet');
    expect(await reach(fromPid(named), '198.51.100.7')).not.toContain('FF-REACHED');
  });

  it('attach_afterASandboxIsGone_theNextOneGetsAnotherAddress', async () => {
    // Conntrack entries of the gone sandbox's flows outlive its link: its /30 is not handed out
    // again while others are free.
    const m = new EgressManager(opts);
    const first = sandbox();
    const a = await m.attach(first, { allowEgress: true, allowCidrs: [] });
    await gone(first, a.link);
    const second = sandbox();
    const b = await m.attach(second, { allowEgress: true, allowCidrs: [] });
    expect(b.sandboxAddress).not.toBe(a.sandboxAddress);
    expect(await reach(fromPid(second), '203.0.113.10')).toBe('FF-REACHED internet');
    // A restarted agent goes on after the last link handed out (the second sandbox's), not from
    // the lowest free one (the first's).
    const third = sandbox();
    const c = await new EgressManager(opts).attach(third, { allowEgress: true, allowCidrs: [] });
    expect(index(c.link)).toBe(index(b.link) + 1);
    expect(c.sandboxAddress).not.toBe(a.sandboxAddress);
  });

  it('attach_whenThePoolIsFull_isResourceExhaustedAndRetryable_sayingSo', async () => {
    // A /28 holds four links (links of other sandboxes in this namespace take some of them).
    const m = new EgressManager({ ...opts, pool: '100.97.0.0/28' });
    let refusal: unknown;
    for (let i = 0; i < 5 && refusal === undefined; i++) refusal = await m.attach(sandbox(), { allowEgress: true, allowCidrs: [] }).then(() => undefined, (e: unknown) => e);
    expect(refusal).toMatchObject({ kind: 'resource_exhausted', retryable: true, message: expect.stringMatching(/egress pool 100\.97\.0\.0\/28 of this host is exhausted/) });
  });

  it('attach_theAgentEndOfALinkHasNoIpv6Address', async () => {
    const sb = sandbox();
    const { link } = await new EgressManager(opts).attach(sb, { allowEgress: true, allowCidrs: [] });
    expect((await inNs(AG, 'sysctl', '-n', `net.ipv6.conf.${link}.disable_ipv6`)).trim()).toBe('1');
    expect(await ip('-n', AG, '-6', '-o', 'addr', 'show', 'dev', link)).toBe('');
  });

  it('attach_onAHostWithASlash32AndARoutedPrivateNetwork_sandboxReachesNeitherThatNetworkNorItsRouter', async () => {
    // 10.88.0.2/32 on its own says nothing of 10.88.0.0/16, which the host routes to.
    const sb = sandbox();
    await new EgressManager(routedOpts).attach(sb, { allowEgress: true, allowCidrs: [] });
    expect(await reach(fromPid(sb), '203.0.113.10')).toBe('FF-REACHED internet');
    expect(await reach(fromPid(sb), '10.88.0.5')).not.toContain('FF-REACHED');
    expect(await reach(fromPid(sb), '10.88.0.1')).not.toContain('FF-REACHED');
  });

  it('attach_onAHostWithAPrivateSlash32InNoNetworkItKnows_isRefusedUntilFF_EGRESS_DENY_CIDRSCoversIt', async () => {
    // GCE's DHCP: 10.128.0.5/32 and an on-link route to the gateway; the rest of the VPC is
    // behind the default route.
    await ip('-n', AGR, 'link', 'add', 'g0', 'type', 'veth', 'peer', 'name', 'g1', 'netns', VPC);
    try {
      await ip('-n', AGR, 'addr', 'add', '10.128.0.5/32', 'dev', 'g0');
      await ip('-n', AGR, 'link', 'set', 'g0', 'up');
      await ip('-n', AGR, 'route', 'add', '10.128.0.1', 'dev', 'g0', 'scope', 'link');
      const refused = sandbox();
      await expect(new EgressManager(routedOpts).attach(refused, { allowEgress: true, allowCidrs: [] })).rejects.toThrow(/10\.128\.0\.5\/32 on g0 .*FF_EGRESS_DENY_CIDRS/);
      // Before any link is made.
      expect(await run('nsenter', [`--net=/proc/${refused}/ns/net`, '--', 'ip', '-o', 'link', 'show']).then((r) => r.stdout)).not.toContain('eth0');
      // A restarted agent with sandboxes already running says so.
      logs.length = 0;
      await new EgressManager(routedOpts).applyAgentSide();
      expect(logs.join('')).toMatch(/"level":50.*10\.128\.0\.5\/32 on g0/);
      const covered = sandbox();
      const { link } = await new EgressManager({ ...routedOpts, denyCidrs: ['10.128.0.0/20'] }).attach(covered, { allowEgress: true, allowCidrs: [] });
      expect(link).toMatch(/^ffe\d+$/);
      expect(await reach(fromPid(covered), '203.0.113.10')).toBe('FF-REACHED internet');
    } finally {
      await ip('-n', AGR, 'link', 'del', 'g0');
    }
  });

  it('attach_onAzure_sandboxAsksTheWireServerOnPort53Only_andOnNoPortWhenItIsNotTheHostsResolver', async () => {
    const dir = tempDir('ffeg-');
    made.push(`dir:${dir}`);
    const resolvConf = join(dir, 'resolv.conf');
    writeFileSync(resolvConf, 'nameserver 168.63.129.16\nsearch abc.internal.cloudapp.net\n');
    const azure = sandbox();
    await new EgressManager({ ...opts, resolvConf }).attach(azure, { allowEgress: true, allowCidrs: [] });
    expect(await reach(fromPid(azure), '168.63.129.16', 53)).toBe('FF-REACHED wireserver-dns');
    expect(await reach(fromPid(azure), '168.63.129.16')).not.toContain('FF-REACHED');
    expect(await reach(fromPid(azure), '203.0.113.10')).toBe('FF-REACHED internet');
    writeFileSync(resolvConf, 'nameserver 198.51.100.53\n');
    const other = sandbox();
    await new EgressManager({ ...opts, resolvConf }).attach(other, { allowEgress: true, allowCidrs: [] });
    expect(await reach(fromPid(other), '168.63.129.16', 53)).not.toContain('FF-REACHED');
    expect(await reach(fromPid(other), '168.63.129.16')).not.toContain('FF-REACHED');
  });

  it('attach_afterAFirewallReloadFlushedTheAgentSideTable_writesItAgain', async () => {
    const m = new EgressManager(opts);
    await m.attach(sandbox(), { allowEgress: true, allowCidrs: [] });
    // `systemctl reload nftables`: Debian's nftables.conf begins with `flush ruleset`.
    await inNs(AG, 'nft', 'delete', 'table', 'ip', 'ff_egress');
    // Two at once, as a fork's children come: they share the write.
    const next = [sandbox(), sandbox()];
    await Promise.all(next.map((pid) => m.attach(pid, { allowEgress: true, allowCidrs: [] })));
    const table = await inNs(AG, 'nft', 'list', 'table', 'ip', 'ff_egress');
    expect(table).toContain('iifname "ffe*" drop');
    expect(table).toContain('masquerade');
    for (const pid of next) expect(await reach(fromPid(pid), '203.0.113.10')).toBe('FF-REACHED internet');
  });

  it('attach_whenTheHostsDnatSendsASandboxsPacketIntoTheHostsNetworks_theAgentSideDropsIt', async () => {
    // kube-proxy's or a port forward's DNAT in PREROUTING: the sandbox's own filter sees only
    // the address it sent to. 192.0.2.80 goes to another machine on the LAN; 198.51.100.99 (on
    // the LAN, denied) goes to the internet, for a sandbox whose own filter is gone.
    const dnat = [
      'table ip fftest_dnat {',
      '  chain pre {',
      '    type nat hook prerouting priority -100; policy accept;',
      `    iifname "ffe*" ip daddr 192.0.2.80 tcp dport ${PORT} dnat to 198.51.100.7`,
      `    iifname "ffe*" ip daddr 198.51.100.99 tcp dport ${PORT} dnat to 203.0.113.10`,
      '  }',
      '}',
      '',
    ].join('\n');
    await exec('ip', ['netns', 'exec', AG, 'nft', '-f', '-'], dnat);
    try {
      const m = new EgressManager(opts);
      const sb = sandbox();
      await m.attach(sb, { allowEgress: true, allowCidrs: [] });
      expect(await reach(fromPid(sb), '203.0.113.10')).toBe('FF-REACHED internet');
      expect(await reach(fromPid(sb), '192.0.2.80')).not.toContain('FF-REACHED');
      // The agent side is a second layer: a sandbox whose own filter is gone reaches neither the
      // host's networks nor, through the DNAT, anything by a denied address.
      const bare = sandbox();
      await m.attach(bare, { allowEgress: true, allowCidrs: [] });
      await run('nsenter', [`--net=/proc/${bare}/ns/net`, '--', 'nft', 'delete', 'table', 'inet', 'ff_egress']);
      expect(await reach(fromPid(bare), '203.0.113.10')).toBe('FF-REACHED internet');
      expect(await reach(fromPid(bare), '198.51.100.7')).not.toContain('FF-REACHED');
      expect(await reach(fromPid(bare), '198.51.100.99')).not.toContain('FF-REACHED');
    } finally {
      await inNs(AG, 'nft', 'delete', 'table', 'ip', 'fftest_dnat');
    }
  });

  it('attach_aSandboxsFilterDeniesThePoolOnce_notEveryOtherSandboxsLinkOneRuleEach', async () => {
    const m = new EgressManager(opts);
    await m.attach(sandbox(), { allowEgress: true, allowCidrs: [] });
    const sb = sandbox();
    await m.attach(sb, { allowEgress: true, allowCidrs: [] });
    const filter = (await run('nsenter', [`--net=/proc/${sb}/ns/net`, '--', 'nft', 'list', 'table', 'inet', 'ff_egress'])).stdout;
    expect(filter).toContain('ip daddr 100.96.0.0/16 drop');
    expect(filter).not.toMatch(/100\.96\.\d+\.\d+\/30/);
  });

  it('attach_afterAnAgentRestartWithNoLinkLeft_goesOnAfterTheLastLinkHandedOut', async () => {
    // Every sandbox here gone: with no link present, a restarted agent started at ffe0 again,
    // the /30 of a sandbox gone a moment before (whose flows' conntrack entries live on).
    for (const pid of sandboxes) if (isAlive(pid)) killHard(pid);
    const until = Date.now() + 10_000;
    while (Date.now() < until && (await ip('-n', AG, '-o', 'link', 'show')).includes(': ffe')) await new Promise((r) => setTimeout(r, 50));
    expect(await ip('-n', AG, '-o', 'link', 'show')).not.toContain(': ffe');
    const first = sandbox();
    const a = await new EgressManager(opts).attach(first, { allowEgress: true, allowCidrs: [] });
    await gone(first, a.link);
    const b = await new EgressManager(opts).attach(sandbox(), { allowEgress: true, allowCidrs: [] });
    expect(index(b.link)).toBe(index(a.link) + 1);
  });
});
