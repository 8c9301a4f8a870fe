import { describe, expect, it } from 'vitest';
import { agentNetworks, ALWAYS_DENIED, dnsResolvers, EgressManager, exec, parseCidr, sandboxRuleset } from './egress.ts';
import { inNewNetns } from './netns.ts';

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
      '5: ffe0    inet 100.96.0.1/30 scope global ffe0\\       valid_lft forever preferred_lft forever',
      '',
    ].join('\n');
    expect(agentNetworks(out)).toEqual(['127.0.0.0/8', '192.168.1.0/24', '10.20.0.0/16', '10.8.0.1/32', '10.8.0.2/32', '172.31.0.9/32', '172.31.0.0/24', '100.96.0.0/30']);
  });
  it('alwaysDenied_coversEveryCloudsInstanceMetadataAddress', () => {
    const inside = (ip: string, cidr: string): boolean => {
      const c = parseCidr('t', cidr);
      return (parseCidr('t', `${ip}/32`).base & (c.len === 0 ? 0 : (0xffffffff << (32 - c.len)) >>> 0)) >>> 0 === c.base;
    };
    // AWS, GCP, Azure, OpenStack, DigitalOcean, Oracle: 169.254.169.254; Alibaba: 100.100.100.200.
    for (const ip of ['169.254.169.254', '100.100.100.200']) expect(ALWAYS_DENIED.some((c) => inside(ip, c)), ip).toBe(true);
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
