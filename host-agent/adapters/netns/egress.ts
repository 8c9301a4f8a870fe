// Egress for sandboxes whose policy allows it (NetworkPolicy {allow_egress, allow_cidrs}).
//
// A sandbox's QEMU runs in a network namespace of its own (netns.ts). With egress allowed its
// slirp runs with restrict=off, and the agent links that namespace to the agent's namespace
// (the host's, or `agentNetns`) with a veth pair and a /30 from `pool`:
//
//   guest eth0 10.0.2.15 -> slirp (QEMU's sockets, sandbox netns)
//     sandbox netns: eth0 <pool+4n+2>/30, default via <pool+4n+1>; nftables output chain:
//       drop 127/8, 169.254/16, the pool, every subnet the agent namespace is connected to
//       (the host's LAN: etcd, other hosts' peer ports) and its own addresses, denyCidrs;
//       accept allow_cidrs (empty: any); drop everything else (IPv6 included)
//     agent netns:   ffe<n> <pool+4n+1>/30; nftables table ip ff_egress:
//       input   iifname "ffe*" drop              (nothing in the agent's namespace: etcd, NATS,
//                                                  scheduler, peer ports, the agent itself)
//       forward iifname != "ffe*" oifname != "ffe*" drop (only if the agent turned
//                                                  ip_forward on: the host routed nothing before)
//               iifname "ffe*" oifname "ffe*" drop (sandbox to sandbox)
//               iifname "ffe*" ip daddr <denyCidrs> drop (the control plane on other machines)
//       postrouting ip saddr <pool> oifname != "ffe*" masquerade
//
// The sandbox-side filter is authoritative and sits where the guest cannot touch it (outside
// the VM); the agent-side rules are a second layer. The veth dies with the sandbox namespace,
// i.e. with the QEMU process, so destroy, crash and agent restart leave no link behind. Link
// indexes go round: the next ffe<n> not present after the last one this manager handed out
// (after the highest present when it starts), so a freed /30 is reused as late as the pool
// allows: the agent namespace's conntrack entries of a gone sandbox's flows (masquerade,
// established TCP lives for days) outlive its link, and a late reply to one is forwarded to
// whoever holds that address next. (Deleting them needs conntrack-tools or netlink; neither
// is installed by deploy/setup.sh nor reachable from Node without a native module.)
import { execFile, spawn } from 'node:child_process';
import { mkdir, readFile, stat, writeFile } from 'node:fs/promises';
import { dirname } from 'node:path';
import { promisify } from 'node:util';
import type { Logger } from 'pino';
import { InvalidArgumentError } from '../../../proto/errors.ts';
import type { NetworkPolicySpec } from '../../domain/vmm.ts';
import { ownNetns } from './netns.ts';

const run = promisify(execFile);

/**
 * How long one `ip`/`nft`/`nsenter` call may take before it is killed (SIGKILL) and the step
 * fails. They take milliseconds; one stuck on a kernel lock would otherwise hold the agent's
 * egress lock, and with it every later sandbox with egress, for ever.
 */
export const COMMAND_TIMEOUT_MS = 30_000;

export interface EgressOptions {
  /** The namespace holding the host ends and the NAT (a path such as /run/netns/x); default: the agent's own. */
  agentNetns?: string;
  /** Link addresses, one /30 per sandbox process. Default 100.96.0.0/16 (16384 links). */
  pool?: string;
  /** Never reachable from a sandbox, whatever its allow_cidrs (e.g. etcd, NATS, schedulers elsewhere). */
  denyCidrs?: string[];
  /** Where the agent records that it turned ip_forward on (default under /run, cleared by a reboot as the sysctl is). */
  forwardMarker?: string;
  /** The resolv.conf whose nameservers egress sandboxes may ask on port 53 (default /etc/resolv.conf; dnsResolvers). */
  resolvConf?: string;
  /** Where the manager says what it changed on the host (e.g. that it turned IP forwarding on). */
  logger?: Pick<Logger, 'info' | 'warn'>;
}

interface Cidr {
  base: number;
  len: number;
}

export function parseCidr(field: string, s: string): Cidr {
  const m = /^(\d{1,3})\.(\d{1,3})\.(\d{1,3})\.(\d{1,3})(?:\/(\d{1,2}))?$/.exec(s.trim());
  if (!m) throw new InvalidArgumentError(field, `not an IPv4 CIDR: ${JSON.stringify(s)}`);
  const oct = m.slice(1, 5).map(Number);
  if (oct.some((o) => o > 255)) throw new InvalidArgumentError(field, `not an IPv4 CIDR: ${JSON.stringify(s)}`);
  const len = m[5] === undefined ? 32 : Number(m[5]);
  if (len > 32) throw new InvalidArgumentError(field, `prefix length > 32: ${JSON.stringify(s)}`);
  const addr = ((oct[0]! << 24) | (oct[1]! << 16) | (oct[2]! << 8) | oct[3]!) >>> 0;
  const mask = len === 0 ? 0 : (0xffffffff << (32 - len)) >>> 0;
  return { base: (addr & mask) >>> 0, len };
}

/**
 * A CIDR of a sandbox's allow_cidrs, as strict as the API (services/adapters/grpc/convert.ts
 * IPV4_CIDR): a prefix length is required, no leading zeros, no blanks.
 */
const STRICT_IPV4_CIDR = /^(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(\.(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}\/(3[0-2]|[12]?\d)$/;

export function parseAllowCidr(field: string, s: string): Cidr {
  if (!STRICT_IPV4_CIDR.test(s)) throw new InvalidArgumentError(field, `must be an IPv4 CIDR such as 203.0.113.0/24, got ${JSON.stringify(s.slice(0, 64))}`);
  return parseCidr(field, s);
}

const ip4 = (n: number): string => [n >>> 24, (n >>> 16) & 255, (n >>> 8) & 255, n & 255].join('.');
const cidrText = (c: Cidr): string => `${ip4(c.base)}/${c.len}`;

/**
 * Always refused from a sandbox, besides the agent namespace's own addresses and denyCidrs:
 * loopback, link-local (the metadata service of AWS, GCP, Azure and OpenStack at
 * 169.254.169.254), Alibaba Cloud's metadata address, "this network" and multicast.
 */
export const ALWAYS_DENIED = ['127.0.0.0/8', '169.254.0.0/16', '100.100.100.200/32', '0.0.0.0/8', '224.0.0.0/4'];
export const HOST_LINK_PREFIX = 'ffe';
/** Where an agent records that it turned ip_forward on in the network namespace of inode `nsInode` (on /run, a tmpfs: a reboot clears it, as the sysctl). */
export const forwardMarkerOf = (nsInode: number | string): string => `/run/forkfleet/ip-forward-by-agent.${nsInode}`;
/** Marks the agent-side rule that keeps forwarding to the sandbox links, found again by a restarted agent. */
export const FORWARD_GUARD_COMMENT = 'ff: ip_forward was off, only sandbox links are forwarded';

/**
 * What a sandbox may never reach in the agent's namespace, from `ip -o -4 addr show` there:
 * every subnet it is connected to, as its network address (a host's LAN holds etcd and the
 * other hosts' peer ports), and for a point-to-point address the local address and the
 * peer's prefix. Pure; exported for unit tests.
 */
export function agentNetworks(ipAddrShow: string): string[] {
  const out = new Set<string>();
  for (const l of ipAddrShow.split('\n')) {
    const m = /\binet (\d+\.\d+\.\d+\.\d+)(?:\/(\d+))?(?: peer (\d+\.\d+\.\d+\.\d+)(?:\/(\d+))?)?/.exec(l);
    if (!m) continue;
    if (m[3] === undefined) {
      out.add(cidrText(parseCidr('agent address', `${m[1]}/${m[2] ?? '32'}`)));
    } else {
      out.add(`${m[1]}/32`);
      out.add(cidrText(parseCidr('agent address', `${m[3]}/${m[4] ?? '32'}`)));
    }
  }
  return [...out];
}

const inCidr = (ip: string, c: Cidr): boolean => {
  const n = parseCidr('address', `${ip}/32`).base;
  const mask = c.len === 0 ? 0 : (~0 << (32 - c.len)) >>> 0;
  return ((n & mask) >>> 0) === c.base;
};

/**
 * The resolvers an egress sandbox may ask on port 53 although the deny list covers them (pure;
 * exported for unit tests): the IPv4 nameservers of the host's resolv.conf, which slirp
 * forwards the guest's DNS to. A resolver on the host's LAN (a cloud VPC's, a router's) is
 * inside the agent's subnets, which are denied; without this, egress sandboxes there could
 * resolve no name. Not one the operator denied (FF_EGRESS_DENY_CIDRS) or that is always
 * denied (loopback, link-local: unreachable from a sandbox namespace anyway), and, for a
 * sandbox with an allow list, only one inside it.
 */
export function dnsResolvers(resolvConf: string, opts: { denied: string[]; allow: string[] }): string[] {
  const out = new Set<string>();
  const never = opts.denied.map((c) => parseCidr('denied', c));
  const allow = opts.allow.map((c) => parseCidr('allow', c));
  for (const l of resolvConf.split('\n')) {
    const m = /^\s*nameserver\s+(\d+\.\d+\.\d+\.\d+)\s*(?:#.*)?$/.exec(l);
    if (!m || !STRICT_IPV4_CIDR.test(`${m[1]}/32`)) continue;
    const ip = m[1]!;
    if (never.some((c) => inCidr(ip, c))) continue;
    if (allow.length > 0 && !allow.some((c) => inCidr(ip, c))) continue;
    out.add(ip);
  }
  return [...out];
}

/** The nftables ruleset of a sandbox namespace (pure; exported for unit tests). */
export function sandboxRuleset(allow: string[], deny: string[], resolvers: string[] = []): string {
  const lines = [
    'table inet ff_egress {',
    '  chain out {',
    '    type filter hook output priority 0; policy drop;',
    ...resolvers.flatMap((r) => [`    ip daddr ${r} udp dport 53 accept`, `    ip daddr ${r} tcp dport 53 accept`]),
    ...deny.map((c) => `    ip daddr ${c} drop`),
    ...(allow.length === 0 ? ['    meta nfproto ipv4 accept'] : allow.map((c) => `    ip daddr ${c} accept`)),
    '  }',
    '}',
  ];
  return `${lines.join('\n')}\n`;
}

export class EgressManager {
  private readonly pool: Cidr;
  private readonly deny: Cidr[];
  private lock: Promise<unknown> = Promise.resolve();
  private agentSetup: Promise<void> | undefined;
  /** The link index handed out last (undefined: none yet; the first goes after the highest present). */
  private lastLink: number | undefined;

  constructor(private readonly opts: EgressOptions = {}) {
    this.pool = parseCidr('egress.pool', opts.pool ?? '100.96.0.0/16');
    if (this.pool.len > 28) throw new InvalidArgumentError('egress.pool', 'must be /28 or larger');
    this.deny = (opts.denyCidrs ?? []).map((c) => parseCidr('egress.denyCidrs', c));
  }

  /** Validates a policy's CIDRs (the step fails before any QEMU starts). */
  static validate(policy: NetworkPolicySpec): void {
    policy.allowCidrs.forEach((c, i) => parseAllowCidr(`network.allow_cidrs[${i}]`, c));
  }

  private inAgentNs(cmd: string, args: string[]): [string, string[]] {
    return this.opts.agentNetns ? ['nsenter', [`--net=${this.opts.agentNetns}`, '--', cmd, ...args]] : [cmd, args];
  }

  private async agent(cmd: string, args: string[], input?: string): Promise<string> {
    const [c, a] = this.inAgentNs(cmd, args);
    return exec(c, a, input);
  }

  /**
   * Forwarding and the agent-side table, once per manager (idempotent, atomic replace).
   * Into a sandbox's link goes nothing but replies to what the sandbox opened: without that,
   * any machine on the host's network that routes the pool through the host reached into
   * sandbox namespaces past allow_cidrs.
   *
   * Forwarding between the host's other networks: when ip_forward was on before, it is left to
   * the host's own firewall (a container runtime's, say). When it was off, the agent turns it
   * on for the sandboxes only: the forward chain drops what goes neither from nor to a sandbox
   * link, so the host does not start routing between its other interfaces. That rule is marked
   * (FORWARD_GUARD_COMMENT) and kept by a restarted agent, which finds forwarding on; and the
   * agent records that it turned forwarding on (forwardMarker, on /run), so its guard comes back
   * after a firewall reload flushed the table too. (A
   * container runtime started later on such a host has its forwarded traffic dropped too: turn
   * forwarding on in the host's sysctl.d instead.) The table is in place before forwarding is
   * turned on, so a failure between the two leaves forwarding off, and a retry sees it off.
   */
  /** Says that this agent turned ip_forward on in its namespace since boot (ensureAgentSide): on /run, a tmpfs. */
  private async forwardMarker(): Promise<string> {
    if (this.opts.forwardMarker) return this.opts.forwardMarker;
    // By the namespace's inode (/run is the machine's, and agents of a local fleet each have a
    // namespace of their own).
    return forwardMarkerOf(await stat(this.opts.agentNetns ?? '/proc/self/ns/net').then((st) => String(st.ino), () => 'unknown'));
  }

  private ensureAgentSide(): Promise<void> {
    this.agentSetup ??= (async () => {
      const wasOn = (await this.agent('sysctl', ['-n', 'net.ipv4.ip_forward'])).trim() === '1';
      const previous = wasOn ? await this.agent('nft', ['list', 'table', 'ip', 'ff_egress']).catch(() => '') : '';
      // The agent turned it on since boot (the marker is on a tmpfs: a reboot clears it with the
      // sysctl), though a firewall reload has flushed the table and its guard since.
      const marker = await this.forwardMarker();
      const guard = !wasOn || previous.includes(FORWARD_GUARD_COMMENT) || (await stat(marker).then(() => true, () => false));
      const deny = this.deny.map((c) => `    iifname "${HOST_LINK_PREFIX}*" ip daddr ${cidrText(c)} drop`);
      await this.agent('nft', ['-f', '-'], [
        'table ip ff_egress {}',
        'delete table ip ff_egress',
        'table ip ff_egress {',
        '  chain input {',
        '    type filter hook input priority 0; policy accept;',
        `    iifname "${HOST_LINK_PREFIX}*" drop`,
        '  }',
        '  chain forward {',
        '    type filter hook forward priority 0; policy accept;',
        ...(guard ? [`    iifname != "${HOST_LINK_PREFIX}*" oifname != "${HOST_LINK_PREFIX}*" drop comment "${FORWARD_GUARD_COMMENT}"`] : []),
        `    iifname "${HOST_LINK_PREFIX}*" oifname "${HOST_LINK_PREFIX}*" drop`,
        `    oifname "${HOST_LINK_PREFIX}*" ct state established,related accept`,
        `    oifname "${HOST_LINK_PREFIX}*" drop`,
        ...deny,
        '  }',
        '  chain post {',
        '    type nat hook postrouting priority 100; policy accept;',
        `    ip saddr ${cidrText(this.pool)} oifname != "${HOST_LINK_PREFIX}*" masquerade`,
        '  }',
        '}',
        '',
      ].join('\n'));
      if (!wasOn) {
        await this.agent('sysctl', ['-q', '-w', 'net.ipv4.ip_forward=1']);
        await mkdir(dirname(marker), { recursive: true })
          .then(() => writeFile(marker, `net.ipv4.ip_forward was 0; turned on by the Forkfleet agent for sandbox links only (${new Date().toISOString()})\n`))
          .catch((err: unknown) => this.opts.logger?.warn({ err, marker }, 'could not record that the agent turned ip_forward on: after a firewall reload, a restarted agent will not restore its guard'));
        this.opts.logger?.warn(
          { agentNetns: this.opts.agentNetns ?? 'own' },
          'turned net.ipv4.ip_forward on for sandbox egress (it was off); table ip ff_egress forwards nothing but traffic from and to the sandbox links',
        );
      }
    })();
    this.agentSetup.catch(() => (this.agentSetup = undefined));
    return this.agentSetup;
  }

  /** Applies the agent-side table again (replacing what is there), e.g. for adopted sandboxes. */
  applyAgentSide(): Promise<void> {
    this.agentSetup = undefined;
    return this.ensureAgentSide();
  }

  /**
   * Links the network namespace of `pid` (a QEMU started in a new namespace) to the agent's
   * and installs `policy`. Call before the guest runs. The link goes away with the process.
   */
  async attach(pid: number, policy: NetworkPolicySpec): Promise<{ link: string; sandboxAddress: string }> {
    EgressManager.validate(policy);
    await Promise.all([this.ensureAgentSide(), ownNetns(pid)]);
    const n = await this.createLink(pid);
    const link = `${HOST_LINK_PREFIX}${n}`;
    const hostIp = ip4(this.pool.base + 4 * n + 1);
    const sbIp = ip4(this.pool.base + 4 * n + 2);
    await this.agent('ip', ['addr', 'add', `${hostIp}/30`, 'dev', link]);
    // No IPv6 on the link (before it is up, so it never gets a link-local address): table ip
    // ff_egress filters IPv4 only, and an fe80:: address would let a sandbox namespace that lost
    // its own filter reach the agent's [::] listeners (etcd, NATS, sshd) over it.
    // (-e: a kernel booted without IPv6 has no such key, and nothing to disable.)
    await this.agent('sysctl', ['-e', '-q', '-w', `net.ipv6.conf.${link}.disable_ipv6=1`]);
    await this.agent('ip', ['link', 'set', link, 'up']);
    // Every subnet of the agent's namespace, not only its addresses: with no FF_EGRESS_DENY_CIDRS
    // the sandbox reached every other machine on the host's LAN. Its own /30 is in the pool,
    // dropped too: the output chain sees the destination of what slirp sends, never the
    // gateway it goes through (which is ARP, outside table inet).
    const agentNets = agentNetworks(await this.agent('ip', ['-o', '-4', 'addr', 'show']));
    const deny = [...new Set([...ALWAYS_DENIED, cidrText(this.pool), ...agentNets, ...this.deny.map(cidrText)])];
    const allow = policy.allowCidrs.map((c, i) => cidrText(parseAllowCidr(`network.allow_cidrs[${i}]`, c)));
    const sb = (cmd: string, args: string[], input?: string): Promise<string> => exec('nsenter', [`--net=/proc/${pid}/ns/net`, '--', cmd, ...args], input);
    // The filter first, so the link is never up without it.
    // DNS to the host's resolvers, which may sit on a denied subnet (dnsResolvers).
    const resolvers = dnsResolvers(await readFile(this.opts.resolvConf ?? '/etc/resolv.conf', 'utf8').catch(() => ''), { denied: [...ALWAYS_DENIED, cidrText(this.pool), ...this.deny.map(cidrText)], allow });
    await sb('nft', ['-f', '-'], sandboxRuleset(allow, deny, resolvers));
    await sb('ip', ['addr', 'add', `${sbIp}/30`, 'dev', 'eth0']);
    await sb('ip', ['link', 'set', 'eth0', 'up']);
    await sb('ip', ['route', 'add', 'default', 'via', hostIp]);
    return { link, sandboxAddress: sbIp };
  }

  /**
   * The next free ffe<n> after the last one handed out (round, so a freed /30 is reused as late
   * as possible: see the header), created as a veth whose peer (eth0) is in `pid`'s namespace.
   */
  private createLink(pid: number): Promise<number> {
    const next = this.lock.then(async () => {
      const max = 2 ** (32 - this.pool.len) / 4;
      const used = new Set(
        (await this.agent('ip', ['-o', 'link', 'show']))
          .split('\n')
          .map((l) => new RegExp(`^\\d+: ${HOST_LINK_PREFIX}(\\d+)[@:]`).exec(l)?.[1])
          .filter((x): x is string => !!x)
          .map(Number)
          .filter((n) => n < max),
      );
      const last = this.lastLink ?? (used.size ? Math.max(...used) : -1);
      for (let i = 1; i <= max; i++) {
        const n = (last + i) % max;
        if (used.has(n)) continue;
        try {
          await this.agent('ip', ['link', 'add', `${HOST_LINK_PREFIX}${n}`, 'type', 'veth', 'peer', 'name', 'eth0', 'netns', String(pid)]);
          this.lastLink = n;
          return n;
        } catch (e) {
          if (/exists/i.test(String((e as Error).message))) continue; // another agent took it
          throw e;
        }
      }
      throw new Error(`egress pool ${cidrText(this.pool)} exhausted (${max} links)`);
    });
    this.lock = next.catch(() => undefined);
    return next;
  }
}

/** Runs `cmd args` (with `input` on its stdin), its stdout; killed after `timeoutMs`. */
export function exec(cmd: string, args: string[], input?: string, timeoutMs = COMMAND_TIMEOUT_MS): Promise<string> {
  const what = `${cmd} ${args.join(' ')}`;
  if (input === undefined) {
    return run(cmd, args, { encoding: 'utf8', timeout: timeoutMs, killSignal: 'SIGKILL' }).then(
      (r) => r.stdout,
      (e: unknown) => {
        const killed = (e as { killed?: boolean }).killed === true;
        throw new Error(killed ? `${what}: killed after ${timeoutMs} ms` : `${what}: ${((e as { stderr?: string }).stderr ?? String(e)).trim()}`, { cause: e });
      },
    );
  }
  return new Promise((resolve, reject) => {
    const p = spawn(cmd, args, { stdio: ['pipe', 'pipe', 'pipe'], timeout: timeoutMs, killSignal: 'SIGKILL' });
    let out = '';
    let err = '';
    p.stdout.on('data', (d: Buffer) => (out += d.toString()));
    p.stderr.on('data', (d: Buffer) => (err += d.toString()));
    p.stdin.on('error', () => undefined); // a command that exits without reading its input; 'close' reports it
    p.on('error', reject);
    p.on('close', (code, signal) => {
      if (code === 0) resolve(out);
      else reject(new Error(p.killed && signal === 'SIGKILL' ? `${what}: killed after ${timeoutMs} ms` : `${what}: exit ${code ?? signal}: ${err.trim()}`));
    });
    p.stdin.end(input);
  });
}
