import { describe, expect, it } from 'vitest';
import { agentNetworks, agentRuleset, ALWAYS_DENIED, dnsResolvers, EgressManager, exec, hostNetworks, outermost, parseCidr, routedNetworks, sandboxRuleset } from './egress.ts';
import { inNewNetns } from './netns.ts';

const inside = (ip: string, cidr: string): boolean => {
  const c = parseCidr('t', cidr);
  return (parseCidr('t', `${ip}/32`).base & (c.len === 0 ? 0 : (0xffffffff << (32 - c.len)) >>> 0)) >>> 0 === c.base;
};

/**
 * What the output chain of a sandbox's ruleset (sandboxRuleset) does with a packet, rule by
 * rule as nftables would: only the rule forms sandboxRuleset writes are understood, and any
 * other line fails the test rather than being skipped.
 */
function verdict(ruleset: string, p: { daddr: string; proto: 'tcp' | 'udp'; dport: number }): 'accept' | 'drop' {
  let policy: 'accept' | 'drop' | undefined;
  for (const raw of ruleset.split('\n')) {
    const l = raw.trim();
    if (l === '' || l === '}' || /^(table|chain) /.test(l)) continue;
    const pol = /^type filter hook output priority 0; policy (accept|drop);$/.exec(l);
    if (pol) {
      policy = pol[1] as 'accept' | 'drop';
      continue;
    }
    if (l === 'meta nfproto ipv4 accept') return 'accept';
    const m = /^ip daddr (\S+)(?: (tcp|udp) dport (\d+))? (accept|drop)$/.exec(l);
    if (!m) throw new Error(`verdict does not know the rule ${JSON.stringify(l)}`);
    const cidr = m[1]!.includes('/') ? m[1]! : `${m[1]}/32`;
    if (inside(p.daddr, cidr) && (m[2] === undefined || (m[2] === p.proto && Number(m[3]) === p.dport))) return m[4] as 'accept' | 'drop';
  }
  if (!policy) throw new Error('no policy in the ruleset');
  return policy;
}

// `ip -o -4 addr show` and `ip -o -4 route show table all` as they look on a GCE VM (DHCP hands
// out a /32 and an on-link route to the gateway; the VPC is behind the default route) and on a
// Hetzner Cloud server (public /32 with an on-link gateway, private network 10.0.0.2/32 with
// 10.0.0.0/16 via 10.0.0.1), each with one sandbox link.
const GCE = {
  addr: [
    '1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever',
    '2: ens4    inet 10.128.0.5/32 brd 10.128.0.5 scope global dynamic ens4\\       valid_lft 3000sec preferred_lft 3000sec',
    '7: ffe3    inet 100.96.0.13/30 scope global ffe3\\       valid_lft forever preferred_lft forever',
  ].join('\n'),
  route: [
    'default via 10.128.0.1 dev ens4 proto dhcp src 10.128.0.5 metric 100 ',
    '10.128.0.1 dev ens4 proto dhcp scope link src 10.128.0.5 metric 100 ',
    '100.96.0.12/30 dev ffe3 proto kernel scope link src 100.96.0.13 ',
    'local 10.128.0.5 dev ens4 table local proto kernel scope host src 10.128.0.5 ',
    'local 100.96.0.13 dev ffe3 table local proto kernel scope host src 100.96.0.13 ',
    'broadcast 100.96.0.15 dev ffe3 table local proto kernel scope link src 100.96.0.13 ',
    'local 127.0.0.0/8 dev lo table local proto kernel scope host src 127.0.0.1 ',
    'broadcast 127.255.255.255 dev lo table local proto kernel scope link src 127.0.0.1 ',
    '',
  ].join('\n'),
};
const HETZNER = {
  addr: [
    '1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever',
    '2: eth0    inet 95.217.1.2/32 brd 95.217.1.2 scope global dynamic eth0\\       valid_lft 86000sec preferred_lft 86000sec',
    '3: enp7s0    inet 10.0.0.2/32 brd 10.0.0.2 scope global dynamic enp7s0\\       valid_lft 86000sec preferred_lft 86000sec',
    '6: ffe0@if2    inet 100.96.0.1/30 scope global ffe0\\       valid_lft forever preferred_lft forever',
  ].join('\n'),
  route: [
    'default via 172.31.1.1 dev eth0 proto dhcp src 95.217.1.2 metric 100 ',
    '10.0.0.0/16 via 10.0.0.1 dev enp7s0 proto dhcp src 10.0.0.2 metric 1003 ',
    '10.0.0.1 dev enp7s0 proto dhcp scope link src 10.0.0.2 metric 1003 ',
    '172.31.1.1 dev eth0 proto dhcp scope link src 95.217.1.2 metric 100 ',
    '100.96.0.0/30 dev ffe0 proto kernel scope link src 100.96.0.1 ',
    'local 10.0.0.2 dev enp7s0 table local proto kernel scope host src 10.0.0.2 ',
    'local 95.217.1.2 dev eth0 table local proto kernel scope host src 95.217.1.2 ',
    '',
  ].join('\n'),
};

describe('egress helpers', () => {
  it('parseCidr_whenHostBitsSet_masksToTheNetwork', () => {
    expect(parseCidr('f', '10.1.2.3/8')).toEqual({ base: 0x0a000000, len: 8 });
    expect(parseCidr('f', '192.168.1.7')).toEqual({ base: 0xc0a80107, len: 32 });
    expect(parseCidr('f', '0.0.0.0/0')).toEqual({ base: 0, len: 0 });
  });
  it('parseCidr_whenNotIpv4Cidr_namesTheField', () => {
    for (const bad of ['fe80::/10', '10.0.0.0/33', '256.1.1.1/8', 'x', '1.2.3/8']) expect(() => parseCidr('network.allowCidrs', bad)).toThrow(/network.allowCidrs/);
  });
  it('validate_whenAnAllowCidrIsLooserThanTheApiAccepts_rejectsItNamingItsIndex', () => {
    const ok = ['198.18.0.0/24', '0.0.0.0/0', '10.1.2.3/32', '255.255.255.255/32'];
    expect(() => EgressManager.validate({ allowEgress: true, allowCidrs: ok })).not.toThrow();
    // What services/adapters/grpc/convert.ts (IPV4_CIDR) refuses: no prefix, leading zeros, blanks.
    for (const bad of ['10.0.0.1', '010.0.0.0/8', '10.0.0.0/08', ' 10.0.0.0/8', '10.0.0.0/8 ', '10.0.0.0/33', '256.0.0.0/8', 'fe80::/10']) {
      expect(() => EgressManager.validate({ allowEgress: true, allowCidrs: ['198.18.0.0/24', bad] }), bad).toThrow(/^network\.allow_cidrs\[1\]: /);
    }
  });
  it('agentNetworks_keepsEachSubnetsPrefixAsItsNetworkAddress', () => {
    const out = [
      '1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever',
      '2: eth0    inet 192.168.1.23/24 brd 192.168.1.255 scope global eth0\\       valid_lft forever preferred_lft forever',
      '2: eth0    inet 10.20.30.40/16 scope global secondary eth0\\       valid_lft forever preferred_lft forever',
      '3: wg0    inet 10.8.0.1 peer 10.8.0.2/32 scope global wg0\\       valid_lft forever preferred_lft forever',
      '4: tun1    inet 172.31.0.9 peer 172.31.0.0/24 scope global tun1',
      '',
    ].join('\n');
    expect(agentNetworks(out)).toEqual(['127.0.0.0/8', '192.168.1.0/24', '10.20.0.0/16', '10.8.0.1/32', '10.8.0.2/32', '172.31.0.9/32', '172.31.0.0/24']);
  });
  it('agentNetworks_leavesOutTheSandboxesOwnLinks_whichThePoolRuleCovers', () => {
    const out = ['2: eth0    inet 192.168.1.23/24 brd 192.168.1.255 scope global eth0', '5: ffe0    inet 100.96.0.1/30 scope global ffe0', '6: ffe12@if3    inet 100.96.0.49/30 scope global ffe12', ''].join('\n');
    expect(agentNetworks(out)).toEqual(['192.168.1.0/24']);
  });
  it('routedNetworks_areEveryRoutesDestinationButDefault_andEveryGateway_inEveryTable_butTheSandboxLinks', () => {
    const out = [
      'default via 192.0.2.1 dev eth0 proto static ',
      '10.0.0.0/16 via 10.0.0.1 dev enp7s0 proto dhcp src 10.0.0.2 metric 1003 ',
      '10.0.0.1 dev enp7s0 proto dhcp scope link src 10.0.0.2 metric 1003 ',
      '10.244.1.0/24 via 10.0.0.3 dev enp7s0 proto bird ',
      '10.9.0.0/16 proto static \\\tnexthop via 10.0.0.7 dev enp7s0 weight 1 \\\tnexthop via 192.0.2.9 dev eth0 weight 1 ',
      '10.55.0.0/16 via 172.20.0.1 dev wg0 table 100 ',
      'default dev wg0 table 51820 scope link ',
      'blackhole 10.66.0.0/16 ',
      'unreachable default table 200 metric 4278198272 ',
      '100.96.0.4/30 dev ffe1 proto kernel scope link src 100.96.0.5 ',
      'local 100.96.0.5 dev ffe1 table local proto kernel scope host src 100.96.0.5 ',
      'local 10.0.0.2 dev enp7s0 table local proto kernel scope host src 10.0.0.2 ',
      '',
    ].join('\n');
    expect(routedNetworks(out).sort()).toEqual(
      ['192.0.2.1/32', '10.0.0.0/16', '10.0.0.1/32', '10.244.1.0/24', '10.0.0.3/32', '10.9.0.0/16', '10.0.0.7/32', '192.0.2.9/32', '10.55.0.0/16', '172.20.0.1/32', '10.66.0.0/16', '10.0.0.2/32'].sort(),
    );
  });
  it('hostNetworks_onAHetznerLikeHost_denyThePrivateNetworkBehindItsRouter_andItsGateways', () => {
    const { networks, withoutNetwork } = hostNetworks(HETZNER.addr, HETZNER.route);
    const denied = outermost([...ALWAYS_DENIED, '100.96.0.0/16', ...networks]);
    // Another server on the private network (etcd, NATS, another host), its router and the
    // public side's gateway; not the internet.
    for (const ip of ['10.0.0.5', '10.0.200.9', '10.0.0.1', '172.31.1.1', '10.0.0.2', '95.217.1.2']) expect(denied.some((c) => inside(ip, c)), ip).toBe(true);
    for (const ip of ['95.217.1.3', '203.0.113.10', '10.1.0.5']) expect(denied.some((c) => inside(ip, c)), ip).toBe(false);
    // The private /32 lies in a routed /16; the public one is the host's on the internet.
    expect(withoutNetwork).toEqual([]);
  });
  it('hostNetworks_onAGceLikeHost_namesItsPrivateSlash32AsAnAddressWithoutNetwork', () => {
    const { networks, withoutNetwork } = hostNetworks(GCE.addr, GCE.route);
    expect(networks).toEqual(expect.arrayContaining(['10.128.0.5/32', '10.128.0.1/32']));
    expect(networks.some((c) => c.startsWith('100.96.'))).toBe(false);
    // The rest of the VPC is behind the default route: nothing the host has says where it ends.
    expect(withoutNetwork).toEqual([{ address: '10.128.0.5', dev: 'ens4' }]);
  });
  it('outermost_leavesOutNetworksInsideAnother_suchAsTheSandboxLinksInsideThePool', () => {
    expect(outermost(['100.96.0.0/16', '100.96.0.4/30', '10.0.0.1/32', '10.0.0.0/16', '10.0.0.0/16', '192.0.2.7/32', '100.96.0.8/30', '10.1.2.3/8'])).toEqual(['100.96.0.0/16', '192.0.2.7/32', '10.0.0.0/8']);
  });
  it('alwaysDenied_coversEveryCloudsInstanceMetadataAddress', () => {
    // AWS, GCP, Azure, OpenStack, DigitalOcean, Oracle: 169.254.169.254; Alibaba: 100.100.100.200;
    // Azure's WireServer (VM agent, extensions; also its DNS resolver): 168.63.129.16.
    for (const ip of ['169.254.169.254', '100.100.100.200', '168.63.129.16']) expect(ALWAYS_DENIED.some((c) => inside(ip, c)), ip).toBe(true);
  });
  it('sandboxRuleset_onAzure_dropsTheWireServerOnEveryPortBut53_whichOnlyAResolverOnItOpens', () => {
    const deny = outermost([...ALWAYS_DENIED, '100.96.0.0/16', '10.0.0.0/24']);
    const asResolver = sandboxRuleset([], deny, dnsResolvers('nameserver 168.63.129.16\nsearch x.internal.cloudapp.net\n', { denied: ['100.96.0.0/16'], allow: [] }));
    expect(verdict(asResolver, { daddr: '168.63.129.16', proto: 'udp', dport: 53 })).toBe('accept');
    expect(verdict(asResolver, { daddr: '168.63.129.16', proto: 'tcp', dport: 53 })).toBe('accept');
    for (const dport of [80, 32526, 8080]) expect(verdict(asResolver, { daddr: '168.63.129.16', proto: 'tcp', dport }), String(dport)).toBe('drop');
    // Not the host's resolver: port 53 is closed too; the internet stays open.
    const notResolver = sandboxRuleset([], deny, dnsResolvers('nameserver 10.0.0.2\n', { denied: ['100.96.0.0/16'], allow: [] }));
    expect(verdict(notResolver, { daddr: '168.63.129.16', proto: 'udp', dport: 53 })).toBe('drop');
    expect(verdict(notResolver, { daddr: '10.0.0.2', proto: 'udp', dport: 53 })).toBe('accept');
    expect(verdict(notResolver, { daddr: '10.0.0.2', proto: 'tcp', dport: 22 })).toBe('drop');
    expect(verdict(notResolver, { daddr: '203.0.113.10', proto: 'tcp', dport: 443 })).toBe('accept');
  });
  it('dnsResolvers_keepsAzuresWireServer_unlessTheOperatorDeniesItOrAnAllowListLeavesItOut', () => {
    const conf = 'nameserver 168.63.129.16\n';
    expect(dnsResolvers(conf, { denied: [], allow: [] })).toEqual(['168.63.129.16']);
    expect(dnsResolvers(conf, { denied: ['168.63.0.0/16'], allow: [] })).toEqual([]);
    expect(dnsResolvers(conf, { denied: [], allow: ['203.0.113.0/24'] })).toEqual([]);
    // Every other always-denied resolver stays left out.
    expect(dnsResolvers('nameserver 169.254.169.254\nnameserver 127.0.0.53\n', { denied: [], allow: [] })).toEqual([]);
  });
  it('agentRuleset_dropsTheDeniedNetworksFromTheSandboxLinks_afterTheHostsDnat_andBeforeIt_butTheResolversOnPort53', () => {
    const r = agentRuleset({ guard: false, pool: '100.96.0.0/16', denied: ['127.0.0.0/8', '10.0.0.0/16', '192.0.2.1/32'], resolvers: ['10.0.0.2'] });
    expect(r).toMatch(/set denied \{\s+type ipv4_addr; flags interval;\s+elements = \{ 127\.0\.0\.0\/8, 10\.0\.0\.0\/16, 192\.0\.2\.1\/32 \}/);
    const forward = r.slice(r.indexOf('chain forward'), r.indexOf('chain post'));
    const at = (rule: string): number => {
      expect(forward).toContain(rule);
      return forward.indexOf(rule);
    };
    expect(at('iifname "ffe*" ip daddr 10.0.0.2 udp dport 53 accept')).toBeLessThan(at('iifname "ffe*" ip daddr @denied drop'));
    expect(at('iifname "ffe*" ip daddr 10.0.0.2 tcp dport 53 accept')).toBeLessThan(at('iifname "ffe*" ct original ip daddr @denied drop'));
    // Replies into a link are let through before (they come from wherever the sandbox went).
    expect(at('oifname "ffe*" ct state established,related accept')).toBeLessThan(at('iifname "ffe*" ip daddr @denied drop'));
    expect(r).not.toContain('comment');
    expect(agentRuleset({ guard: true, pool: '100.96.0.0/16', denied: ['127.0.0.0/8'], resolvers: [] })).toContain('iifname != "ffe*" oifname != "ffe*" drop comment');
  });

  it('sandboxRuleset_denyComesBeforeAllowAndDefaultIsDrop', () => {
    const r = sandboxRuleset(['198.18.0.0/24'], ['127.0.0.0/8', '198.18.0.1/32']);
    expect(r).toContain('policy drop;');
    expect(r.indexOf('ip daddr 198.18.0.1/32 drop')).toBeLessThan(r.indexOf('ip daddr 198.18.0.0/24 accept'));
    expect(sandboxRuleset([], ['127.0.0.0/8'])).toContain('meta nfproto ipv4 accept');
  });
  it('dnsResolvers_areTheHostsIpv4Nameservers_butNoneTheOperatorDeniedOrAnAllowListLeavesOut', () => {
    const conf = ['# comment', 'nameserver 10.0.0.2', 'nameserver 127.0.0.53', 'nameserver 192.0.2.9 # ops', 'nameserver fd00::1', 'nameserver 010.0.0.3', 'search x', ' nameserver 10.0.0.2', ''].join('\n');
    expect(dnsResolvers(conf, { denied: ALWAYS_DENIED, allow: [] })).toEqual(['10.0.0.2', '192.0.2.9']);
    expect(dnsResolvers(conf, { denied: [...ALWAYS_DENIED, '192.0.2.0/24'], allow: [] })).toEqual(['10.0.0.2']);
    expect(dnsResolvers(conf, { denied: ALWAYS_DENIED, allow: ['192.0.2.0/24'] })).toEqual(['192.0.2.9']);
  });
  it('sandboxRuleset_resolversOnPort53ComeBeforeTheDenyList', () => {
    expect(verdict(sandboxRuleset([], ['10.0.0.0/16'], ['10.0.0.2']), { daddr: '10.0.0.2', proto: 'udp', dport: 53 })).toBe('accept');
    const r = sandboxRuleset([], ['10.0.0.0/16'], ['10.0.0.2']);
    expect(r.indexOf('ip daddr 10.0.0.2 udp dport 53 accept')).toBeLessThan(r.indexOf('ip daddr 10.0.0.0/16 drop'));
    expect(r).toContain('ip daddr 10.0.0.2 tcp dport 53 accept');
    expect(r).not.toMatch(/ip daddr 10\.0\.0\.2 accept/);
  });
  it('inNewNetns_execsTheBinaryThroughUnshare', () => {
    expect(inNewNetns('qemu', ['-m', '1'])).toEqual({ command: 'unshare', args: ['--net', '--', 'qemu', '-m', '1'] });
  });
});

describe('egress commands', () => {
  it('exec_whenTheCommandHangs_killsItAndFailsAfterTheTimeout', async () => {
    const t0 = Date.now();
    await expect(exec('sleep', ['30'], undefined, 300)).rejects.toThrow(/sleep 30: killed after 300 ms/);
    await expect(exec('sleep', ['30'], 'input', 300)).rejects.toThrow(/sleep 30: killed after 300 ms/);
    expect(Date.now() - t0).toBeLessThan(10_000);
  });
  it('exec_whenTheCommandFails_namesItAndItsStderr', async () => {
    await expect(exec('sh', ['-c', 'echo nope >&2; exit 3'])).rejects.toThrow(/sh -c .*: nope/);
    await expect(exec('sh', ['-c', 'cat >/dev/null; echo bad >&2; exit 2'], 'x')).rejects.toThrow(/exit 2: bad/);
    await expect(exec('sh', ['-c', 'cat'], 'hello')).resolves.toBe('hello');
  });
});
