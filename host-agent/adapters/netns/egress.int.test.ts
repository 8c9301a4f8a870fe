// EgressManager against real namespaces, links and nftables (root), without QEMU: a sandbox is
// stood in for by `unshare --net -- sleep`, and what it can reach is tried from its namespace
// with node (the sandbox-side filter is an output chain there, which slirp's sockets go through
// just the same). Every namespace is made by this test; nothing changes in the root namespace.
//
//   AG  "the agent's namespace": up0 198.51.100.1/24 (the host's LAN), o0 10.77.0.1/24 (another
//       network of the host's, e.g. a bridge), default via 198.51.100.2, ip_forward off;
//   LAN the LAN: 198.51.100.2 (its router) and 198.51.100.7 (another machine: etcd, a peer
//       port) with a listener, and 203.0.113.10 ("the internet", beyond the router) with one;
//   OTH the other network: 10.77.0.2 with a listener, default via 10.77.0.1.
import { execFile, spawn } from 'node:child_process';
import { readdirSync, rmdirSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { promisify } from 'node:util';
import { pino } from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { isAlive, killHard } from '../qemu/process.ts';
import { EgressManager, FORWARD_GUARD_COMMENT, forwardMarkerOf } from './egress.ts';
import { tempDir } from '../../../services/testkit/proc.ts';
import { noteForReaper } from '../tied.ts';

const run = promisify(execFile);
const tag = Math.random().toString(36).slice(2, 7);
const AG = `ffeg-ag-${tag}`;
const LAN = `ffeg-lan-${tag}`;
const OTH = `ffeg-oth-${tag}`;
const PORT = 8080;
const made: string[] = [];
const pids: number[] = [];
const logs: string[] = [];
const logger = pino({ level: 'info' }, { write: (s: string) => void logs.push(s) });
/** Where the agent records that it turned ip_forward on in AG (by AG's inode; known once AG exists). */
let FORWARD_MARKER = '';
const opts = { agentNetns: `/run/netns/${AG}`, logger };

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
  noteForReaper({ pid: p.pid! });
  return p.pid!;
}

async function gone(pid: number, link: string): Promise<void> {
  killHard(pid);
  const until = Date.now() + 5000;
  while (Date.now() < until && (await ip('-n', AG, '-o', 'link', 'show')).includes(`${link}@`)) await new Promise((r) => setTimeout(r, 20));
  expect(await ip('-n', AG, '-o', 'link', 'show')).not.toContain(`${link}@`);
}

beforeAll(async () => {
  for (const ns of [AG, LAN, OTH]) {
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
  for (const a of ['198.51.100.2/24', '198.51.100.7/24', '198.51.100.53/24', '203.0.113.10/24']) await ip('-n', LAN, 'addr', 'add', a, 'dev', 'lan0');
  await ip('-n', LAN, 'link', 'set', 'lan0', 'up');
  await ip('-n', LAN, 'route', 'add', '10.77.0.0/24', 'via', '198.51.100.1');
  await ip('-n', OTH, 'addr', 'add', '10.77.0.2/24', 'dev', 'o1');
  await ip('-n', OTH, 'link', 'set', 'o1', 'up');
  await ip('-n', OTH, 'route', 'add', 'default', 'via', '10.77.0.1');
  await inNs(AG, 'sysctl', '-q', '-w', 'net.ipv4.ip_forward=0');
  FORWARD_MARKER = forwardMarkerOf(statSync(`/run/netns/${AG}`).ino);
  await listeners(LAN, [['198.51.100.7', 'lan-machine'], ['203.0.113.10', 'internet']]);
  await listeners(OTH, [['10.77.0.2', 'other-network']]);
  // The host's resolver, on its LAN (a cloud VPC's or a router's): DNS on 53, something else on PORT.
  await listeners(LAN, [['198.51.100.53', 'resolver-dns']], 53);
  await listeners(LAN, [['198.51.100.53', 'resolver-other']]);
});

afterAll(async () => {
  if (FORWARD_MARKER) {
    rmSync(FORWARD_MARKER, { force: true });
    // Its directory too, unless another agent's marker is in it.
    if (readdirSync(dirname(FORWARD_MARKER)).length === 0) rmdirSync(dirname(FORWARD_MARKER));
  }
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
    // A restarted agent goes on after the highest link present (the second sandbox's), not from
    // the lowest free one (the first's). (Freed links above the highest present are reused
    // first after a restart: the agent keeps no state.)
    const third = sandbox();
    const c = await new EgressManager(opts).attach(third, { allowEgress: true, allowCidrs: [] });
    const index = (l: string): number => Number(l.slice(3));
    expect(index(c.link)).toBe(index(b.link) + 1);
    expect(c.sandboxAddress).not.toBe(a.sandboxAddress);
  });

  it('attach_theAgentEndOfALinkHasNoIpv6Address', async () => {
    const sb = sandbox();
    const { link } = await new EgressManager(opts).attach(sb, { allowEgress: true, allowCidrs: [] });
    expect((await inNs(AG, 'sysctl', '-n', `net.ipv6.conf.${link}.disable_ipv6`)).trim()).toBe('1');
    expect(await ip('-n', AG, '-6', '-o', 'addr', 'show', 'dev', link)).toBe('');
  });
});
