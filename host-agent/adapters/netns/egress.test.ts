import { describe, expect, it } from 'vitest';
import { ALWAYS_DENIED, exec, parseCidr, sandboxRuleset } from './egress.ts';
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
