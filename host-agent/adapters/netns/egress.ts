// Egress for sandboxes whose policy allows it (NetworkPolicy {allow_egress, allow_cidrs}).
//
// A sandbox's QEMU runs in a network namespace of its own (netns.ts). With egress allowed its
// slirp runs with restrict=off, and the agent links that namespace to the agent's namespace
// (the host's, or `agentNetns`) with a veth pair and a /30 from `pool`:
//
//   guest eth0 10.0.2.15 -> slirp (QEMU's sockets, sandbox netns)
//     sandbox netns: eth0 <pool+4n+2>/30, default via <pool+4n+1>; nftables output chain:
//       accept the host's resolvers on port 53 (dnsResolvers);
//       drop "denied": 127/8, 169.254/16, cloud platform addresses (ALWAYS_DENIED), the pool,
//       the host's networks (hostNetworks: every subnet the agent namespace is connected to,
//       every destination it has a route for but the default, every gateway), denyCidrs;
//       accept allow_cidrs (empty: any); drop everything else (IPv6 included)
//     agent netns:   ffe<n> <pool+4n+1>/30; nftables table ip ff_egress, written again at
//                    every attach (a firewall reload may have flushed it; the host's networks
//                    may have changed):
//       input   iifname "ffe*" drop              (nothing in the agent's namespace: etcd, NATS,
//                                                  scheduler, peer ports, the agent itself)
//       forward iifname != "ffe*" oifname != "ffe*" drop (only if the agent turned
//                                                  ip_forward on: the host routed nothing before)
//               iifname "ffe*" oifname "ffe*" drop (sandbox to sandbox)
//               oifname "ffe*": only replies to what the sandbox opened
//               iifname "ffe*": the resolvers on port 53, then drop "denied" (set @denied), by
//                                                  the destination after any DNAT of the host's
//                                                  (kube-proxy) and by the original one
//       postrouting ip saddr <pool> oifname != "ffe*" masquerade
//
// The sandbox-side filter is authoritative and sits where the guest cannot touch it (outside
// the VM); the agent-side rules are a second layer, and the only one that sees where the host's
// own DNAT sends a packet. The veth dies with the sandbox namespace, i.e. with the QEMU process,
// so destroy, crash and agent restart leave no link behind. Link indexes go round: the next
// ffe<n> not present after the last one handed out in this namespace (kept on /run, so an
// agent restart goes on from there), so a freed /30 is reused as late as the pool allows: the
// agent namespace's conntrack entries of a gone sandbox's flows (masquerade, established TCP
// lives for days) outlive its link, and a late reply to one is forwarded to whoever holds that
// address next. (Deleting them needs conntrack-tools or netlink; neither is installed by
// deploy/setup.sh nor reachable from Node without a native module.)
import { execFile, spawn } from 'node:child_process';
import { mkdir, readFile, stat, writeFile } from 'node:fs/promises';
import { dirname } from 'node:path';
import { promisify } from 'node:util';
import type { Logger } from 'pino';
import { ForkfleetError, InvalidArgumentError } from '../../../proto/errors.ts';
import type { NetworkPolicySpec } from '../../domain/vmm.ts';
import { EgressRefusedError } from './errors.ts';
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
  /** Where the agent keeps the link index it handed out last (default under /run: linkCursorOf). */
  linkCursor?: string;
  /** The resolv.conf whose nameservers egress sandboxes may ask on port 53 (default /etc/resolv.conf; dnsResolvers). */
  resolvConf?: string;
  /** Where the manager says what it changed on the host (e.g. that it turned IP forwarding on). */
  logger?: Pick<Logger, 'info' | 'warn' | 'error'>;
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

const inCidr = (ip: string, c: Cidr): boolean => {
  const n = parseCidr('address', `${ip}/32`).base;
  const mask = c.len === 0 ? 0 : (~0 << (32 - c.len)) >>> 0;
  return ((n & mask) >>> 0) === c.base;
};

/**
 * Always refused from a sandbox, besides the host's networks and denyCidrs: loopback,
 * link-local (the metadata service of AWS, GCP, Azure and OpenStack at 169.254.169.254),
 * Alibaba Cloud's metadata address, Azure's WireServer (168.63.129.16: the VM agent's and
 * extensions' endpoint, and the host's health probe source; on no subnet of the host's, so
 * before it was reached on every port; see DNS_ONLY_DENIED), "this network" and multicast.
 */
export const ALWAYS_DENIED = ['127.0.0.0/8', '169.254.0.0/16', '100.100.100.200/32', '168.63.129.16/32', '0.0.0.0/8', '224.0.0.0/4'];
/**
 * Of ALWAYS_DENIED, the addresses that are also a cloud's DNS resolver (Azure's WireServer is
 * its VMs' default resolver): asked on port 53 all the same when the host's resolv.conf names
 * them (dnsResolvers), since slirp forwards the guest's DNS there and egress sandboxes on Azure
 * would resolve no name otherwise. Every other port on them stays dropped.
 */
export const DNS_ONLY_DENIED = ['168.63.129.16/32'];
/**
 * The private ranges (RFC 1918, and RFC 6598's shared space, which tailnets and some clouds
 * use) in which an address of the host's with no network around it (a /32, as a cloud's DHCP
 * hands out) means a private network whose extent the host does not know (hostNetworks). A
 * public /32 is the host's address on the internet; the machines near it are not the fleet's
 * for that (other hosts on public addresses are FF_EGRESS_DENY_CIDRS's to name).
 */
export const PRIVATE_RANGES = ['10.0.0.0/8', '172.16.0.0/12', '192.168.0.0/16', '100.64.0.0/10'];
export const HOST_LINK_PREFIX = 'ffe';
/** Where an agent records that it turned ip_forward on in the network namespace of inode `nsInode` (on /run, a tmpfs: a reboot clears it, as the sysctl). */
export const forwardMarkerOf = (nsInode: number | string): string => `/run/forkfleet/ip-forward-by-agent.${nsInode}`;
/**
 * Where agents keep the link index handed out last in the network namespace of inode `nsInode`,
 * so a restarted agent goes on after it instead of after the highest link still present (with
 * none present, from ffe0: the /30 of a sandbox destroyed a moment before, whose flows'
 * conntrack entries live on). On /run: a reboot clears conntrack too.
 */
export const linkCursorOf = (nsInode: number | string): string => `/run/forkfleet/egress-last-link.${nsInode}`;
/** Marks the agent-side rule that keeps forwarding to the sandbox links, found again by a restarted agent. */
export const FORWARD_GUARD_COMMENT = 'ff: ip_forward was off, only sandbox links are forwarded';

/** A link of the agent's own (a sandbox's host end): its addresses and routes are in the pool. */
const isHostLink = (dev: string | undefined): boolean => dev !== undefined && new RegExp(`^${HOST_LINK_PREFIX}\\d+$`).test(dev);

/**
 * What a sandbox may never reach in the agent's namespace, from `ip -o -4 addr show` there:
 * every subnet it is connected to, as its network address (a host's LAN holds etcd and the
 * other hosts' peer ports), and for a point-to-point address the local address and the
 * peer's prefix. Not the sandboxes' own links (the pool is denied whole). Pure; exported for
 * unit tests.
 */
export function agentNetworks(ipAddrShow: string): string[] {
  const out = new Set<string>();
  for (const l of ipAddrShow.split('\n')) {
    const m = /^\d+:\s+([^\s@]+)\S*\s+inet (\d+\.\d+\.\d+\.\d+)(?:\/(\d+))?(?: peer (\d+\.\d+\.\d+\.\d+)(?:\/(\d+))?)?/.exec(l);
    if (!m || isHostLink(m[1])) continue;
    if (m[4] === undefined) {
      out.add(cidrText(parseCidr('agent address', `${m[2]}/${m[3] ?? '32'}`)));
    } else {
      out.add(`${m[2]}/32`);
      out.add(cidrText(parseCidr('agent address', `${m[4]}/${m[5] ?? '32'}`)));
    }
  }
  return [...out];
}

const ROUTE_TYPES = 'unicast|local|broadcast|multicast|anycast|throw|unreachable|prohibit|blackhole|nat';

/**
 * The networks the agent's namespace routes somewhere, from `ip -o -4 route show table all`
 * there: the destination of every route but the default ones, and every gateway (of the
 * default routes too), as /32. A host's address says nothing of a network it reaches through
 * a router: a Hetzner private network (10.0.0.2/32, 10.0.0.0/16 via 10.0.0.1), a Kubernetes
 * node's routes to the other nodes' pods, a VPN's subnets. All tables, not only main: one that
 * no rule uses costs a needless deny entry, a policy-routed one left out would open its
 * networks. Routes over the sandboxes' own links are left out (the pool is denied whole). A
 * host that splits its default route (0.0.0.0/1 and 128.0.0.0/1, as OpenVPN's def1 does) has
 * the whole internet denied: safe, but no egress. Pure; exported for unit tests.
 */
export function routedNetworks(ipRouteShow: string): string[] {
  const out = new Set<string>();
  for (const l of ipRouteShow.split('\n')) {
    // With -o a multipath route is one line, its nexthops after "\\"; any over a sandbox link
    // marks the whole route as ours.
    if ([...l.matchAll(/\bdev (\S+)/g)].some((d) => isHostLink(d[1]))) continue;
    const m = new RegExp(`^(?:(?:${ROUTE_TYPES})\\s+)?(default|\\d+\\.\\d+\\.\\d+\\.\\d+(?:/\\d+)?)(?=\\s|$)`).exec(l.trim());
    if (!m) continue;
    if (m[1] !== 'default') {
      const c = parseCidr('route', m[1]!.includes('/') ? m[1]! : `${m[1]}/32`);
      if (c.len > 0) out.add(cidrText(c));
    }
    for (const g of l.matchAll(/\bvia (?:inet )?(\d+\.\d+\.\d+\.\d+)(?=\s|$)/g)) out.add(`${g[1]}/32`);
  }
  return [...out];
}

/** An address of the host's in a private range with no network around it (hostNetworks). */
export interface AddressWithoutNetwork {
  address: string;
  dev: string;
}

/**
 * The host's networks as a sandbox must never reach them (agentNetworks and routedNetworks),
 * and the host's private addresses that lie in none of them but their own /32
 * (`withoutNetwork`): a cloud's DHCP gives a VM a /32 and an on-link route to its gateway only
 * (GCE: 10.128.0.5/32, "10.128.0.1 dev ens4 scope link", default via it), so the rest of the
 * VPC (etcd, NATS, the schedulers, other hosts) is reached through the default route and
 * appears nowhere in the host's tables. attach refuses egress on such a host unless
 * FF_EGRESS_DENY_CIDRS covers the address. Pure; exported for unit tests.
 */
export function hostNetworks(ipAddrShow: string, ipRouteShow: string): { networks: string[]; withoutNetwork: AddressWithoutNetwork[] } {
  const networks = [...new Set([...agentNetworks(ipAddrShow), ...routedNetworks(ipRouteShow)])];
  const wide = networks.map((c) => parseCidr('network', c)).filter((c) => c.len < 32);
  const privateRanges = PRIVATE_RANGES.map((c) => parseCidr('private', c));
  const withoutNetwork: AddressWithoutNetwork[] = [];
  for (const l of ipAddrShow.split('\n')) {
    const m = /^\d+:\s+([^\s@]+)\S*\s+inet (\d+\.\d+\.\d+\.\d+)(?:\/(\d+))?\s(.*)$/.exec(l);
    if (!m || isHostLink(m[1]) || (m[3] ?? '32') !== '32' || /\bpeer\b/.test(m[4]!) || !/\bscope global\b/.test(m[4]!)) continue;
    const address = m[2]!;
    if (!privateRanges.some((c) => inCidr(address, c)) || wide.some((c) => inCidr(address, c))) continue;
    withoutNetwork.push({ address, dev: m[1]! });
  }
  return { networks, withoutNetwork };
}

/**
 * `cidrs` without those inside another of them (pure; exported for unit tests). Every entry is
 * a drop, so leaving out a covered one changes nothing but the length of the list: with it the
 * sandboxes' own /30s, which every later sandbox's filter listed one rule each before, go in
 * the pool's rule. Networks nest or are disjoint, so what is left never overlaps (an nftables
 * interval set refuses overlapping elements).
 */
export function outermost(cidrs: string[]): string[] {
  const all = [...new Set(cidrs.map((c) => cidrText(parseCidr('cidr', c))))].map((c) => parseCidr('cidr', c));
  return all.filter((a) => !all.some((b) => b.len < a.len && inCidr(ip4(a.base), b))).map(cidrText);
}

/**
 * The resolvers an egress sandbox may ask on port 53 although the deny list covers them (pure;
 * exported for unit tests): the IPv4 nameservers of the host's resolv.conf, which slirp
 * forwards the guest's DNS to. A resolver on the host's LAN (a cloud VPC's, a router's) is
 * inside the agent's subnets, which are denied; without this, egress sandboxes there could
 * resolve no name. Not one in `denied` (what the operator denies, FF_EGRESS_DENY_CIDRS, and the
 * pool) or always denied (loopback, link-local: unreachable from a sandbox namespace anyway),
 * but for the platform resolvers of DNS_ONLY_DENIED; and, for a sandbox with an allow list,
 * only one inside it.
 */
export function dnsResolvers(resolvConf: string, opts: { denied: string[]; allow: string[] }): string[] {
  const out = new Set<string>();
  const never = [...ALWAYS_DENIED.filter((c) => !DNS_ONLY_DENIED.includes(c)), ...opts.denied].map((c) => parseCidr('denied', c));
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

const dnsAccept = (prefix: string, resolvers: string[]): string[] =>
  resolvers.flatMap((r) => [`    ${prefix}ip daddr ${r} udp dport 53 accept`, `    ${prefix}ip daddr ${r} tcp dport 53 accept`]);

/** The nftables ruleset of a sandbox namespace (pure; exported for unit tests). */
export function sandboxRuleset(allow: string[], deny: string[], resolvers: string[] = []): string {
  const lines = [
    'table inet ff_egress {',
    '  chain out {',
    '    type filter hook output priority 0; policy drop;',
    ...dnsAccept('', resolvers),
    ...deny.map((c) => `    ip daddr ${c} drop`),
    ...(allow.length === 0 ? ['    meta nfproto ipv4 accept'] : allow.map((c) => `    ip daddr ${c} accept`)),
    '  }',
    '}',
  ];
  return `${lines.join('\n')}\n`;
}

/**
 * The agent namespace's table ip ff_egress, as one `nft -f` that replaces it whole (pure;
 * exported for unit tests). `denied` is what the sandboxes' own filters drop (outermost, so no
 * two elements of the interval set overlap), checked again here on the destination after the
 * host's PREROUTING DNAT (kube-proxy's, a port forward), which the sandbox's output chain
 * never sees, and on the original one (a second layer should the sandbox's filter be gone).
 * `resolvers` are the host's, asked on port 53 only.
 */
export function agentRuleset(o: { guard: boolean; pool: string; denied: string[]; resolvers: string[] }): string {
  const ffe = `"${HOST_LINK_PREFIX}*"`;
  return [
    'table ip ff_egress {}',
    'delete table ip ff_egress',
    'table ip ff_egress {',
    '  set denied {',
    '    type ipv4_addr; flags interval;',
    `    elements = { ${o.denied.join(', ')} }`,
    '  }',
    '  chain input {',
    '    type filter hook input priority 0; policy accept;',
    `    iifname ${ffe} drop`,
    '  }',
    '  chain forward {',
    '    type filter hook forward priority 0; policy accept;',
    ...(o.guard ? [`    iifname != ${ffe} oifname != ${ffe} drop comment "${FORWARD_GUARD_COMMENT}"`] : []),
    `    iifname ${ffe} oifname ${ffe} drop`,
    `    oifname ${ffe} ct state established,related accept`,
    `    oifname ${ffe} drop`,
    ...dnsAccept(`iifname ${ffe} `, o.resolvers),
    `    iifname ${ffe} ip daddr @denied drop`,
    `    iifname ${ffe} ct original ip daddr @denied drop`,
    '  }',
    '  chain post {',
    '    type nat hook postrouting priority 100; policy accept;',
    `    ip saddr ${o.pool} oifname != ${ffe} masquerade`,
    '  }',
    '}',
    '',
  ].join('\n');
}

/** What the agent's namespace looked like at one attach (EgressManager.applyAgentSideNow). */
interface HostView {
  /** outermost: ALWAYS_DENIED, the pool, the host's networks, denyCidrs. */
  denied: string[];
  withoutNetwork: AddressWithoutNetwork[];
  resolvConf: string;
}

export class EgressManager {
  private readonly pool: Cidr;
  private readonly deny: Cidr[];
  private lock: Promise<unknown> = Promise.resolve();
  /** Serialises the agent-side table's writes: each reads the sysctl and the table the last one left. */
  private agentLock: Promise<unknown> = Promise.resolve();
  /** A write queued behind agentLock and not started yet, which later callers share (applyAgentSideNow). */
  private agentQueued: Promise<HostView> | undefined;
  /** The link index handed out last (undefined: none yet; then linkCursor's, else after the highest present). */
  private lastLink: number | undefined;
  private cursorWarned = false;

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

  /** The agent namespace's inode: files on /run are per namespace (agents of a local fleet each have one of their own). */
  private nsInode(): Promise<string> {
    return stat(this.opts.agentNetns ?? '/proc/self/ns/net').then((st) => String(st.ino), () => 'unknown');
  }

  /** Says that this agent turned ip_forward on in its namespace since boot (applyAgentSideNow): on /run, a tmpfs. */
  private async forwardMarker(): Promise<string> {
    return this.opts.forwardMarker ?? forwardMarkerOf(await this.nsInode());
  }

  private async linkCursor(): Promise<string> {
    return this.opts.linkCursor ?? linkCursorOf(await this.nsInode());
  }

  /**
   * The host's networks and resolvers as they are now, and the agent-side table written from
   * them (one atomic `nft -f` that replaces the table whole, so the same twice is the same), at
   * every attach: a firewall reload (`systemctl reload nftables` runs Debian's nftables.conf,
   * which begins with `flush ruleset`) removed the table, and with it the masquerade, the input
   * drop and the forwarding guard, until the agent restarted; and a network added since (a new
   * bridge, a route) is denied to the sandboxes attached after it.
   *
   * Into a sandbox's link goes nothing but replies to what the sandbox opened: without that,
   * any machine on the host's network that routes the pool through the host reached into
   * sandbox namespaces past allow_cidrs.
   *
   * Forwarding between the host's other networks: when ip_forward was on before, it is left to
   * the host's own firewall (a container runtime's, say). When it was off, the agent turns it
   * on for the sandboxes only: the forward chain drops what goes neither from nor to a sandbox
   * link, so the host does not start routing between its other interfaces. That rule is marked
   * (FORWARD_GUARD_COMMENT) and kept by a later write, which finds forwarding on; and the
   * agent records that it turned forwarding on (forwardMarker, on /run), so its guard comes back
   * after a firewall reload flushed the table too. (A container runtime started later on such a
   * host has its forwarded traffic dropped too: turn forwarding on in the host's sysctl.d
   * instead.) The table is in place before forwarding is turned on, so a failure between the
   * two leaves forwarding off, and a retry sees it off.
   *
   * Callers while a write runs share the next one, which starts after they asked: a fork of
   * many children with egress costs two writes, not one per child in a row.
   */
  private applyAgentSideNow(): Promise<HostView> {
    if (this.agentQueued) return this.agentQueued;
    const next = this.agentLock.then(async (): Promise<HostView> => {
      this.agentQueued = undefined;
      const [addrs, routes, resolvConf] = await Promise.all([
        this.agent('ip', ['-o', '-4', 'addr', 'show']),
        this.agent('ip', ['-o', '-4', 'route', 'show', 'table', 'all']),
        readFile(this.opts.resolvConf ?? '/etc/resolv.conf', 'utf8').catch(() => ''),
      ]);
      // The host's networks, not only its addresses: with no FF_EGRESS_DENY_CIDRS a sandbox
      // reached every other machine on the host's LAN, and on a network the host routes to. A
      // sandbox's own /30 is in the pool, dropped too: its output chain sees the destination of
      // what slirp sends, never the gateway it goes through (which is ARP, outside table inet).
      const host = hostNetworks(addrs, routes);
      const denied = outermost([...ALWAYS_DENIED, cidrText(this.pool), ...host.networks, ...this.deny.map(cidrText)]);
      const wasOn = (await this.agent('sysctl', ['-n', 'net.ipv4.ip_forward'])).trim() === '1';
      const previous = wasOn ? await this.agent('nft', ['list', 'table', 'ip', 'ff_egress']).catch(() => '') : '';
      // The agent turned it on since boot (the marker is on a tmpfs: a reboot clears it with the
      // sysctl), though a firewall reload has flushed the table and its guard since.
      const marker = await this.forwardMarker();
      const guard = !wasOn || previous.includes(FORWARD_GUARD_COMMENT) || (await stat(marker).then(() => true, () => false));
      // Every resolver any sandbox may ask (an allow list narrows it in the sandbox's own filter).
      const resolvers = dnsResolvers(resolvConf, { denied: [cidrText(this.pool), ...this.deny.map(cidrText)], allow: [] });
      await this.agent('nft', ['-f', '-'], agentRuleset({ guard, pool: cidrText(this.pool), denied, resolvers }));
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
      return { denied, withoutNetwork: host.withoutNetwork, resolvConf };
    });
    this.agentQueued = next;
    this.agentLock = next.catch(() => undefined);
    return next;
  }

  /**
   * The host's private addresses whose network neither the host's tables nor denyCidrs cover
   * (hostNetworks): a sandbox would reach the rest of that network (a cloud VPC with etcd,
   * NATS, the schedulers and the other hosts).
   */
  private unguarded(view: HostView): AddressWithoutNetwork[] {
    return view.withoutNetwork.filter((a) => !this.deny.some((c) => c.len < 32 && inCidr(a.address, c)));
  }

  private static describe(open: AddressWithoutNetwork[]): string {
    return `${open.map((a) => `${a.address}/32 on ${a.dev}`).join(', ')} ${open.length === 1 ? 'is an address' : 'are addresses'} in a private range with no network around it in the host's addresses or routes (a cloud's DHCP /32?), so a sandbox allowed egress would reach the rest of that network (etcd, NATS, schedulers, other hosts); name it in FF_EGRESS_DENY_CIDRS`;
  }

  /**
   * Applies the agent-side table again (replacing what is there), e.g. for adopted sandboxes.
   * Says (error) when the host has an address whose network it does not know: sandboxes
   * already running keep their egress, new ones are refused (attach).
   */
  async applyAgentSide(): Promise<void> {
    const open = this.unguarded(await this.applyAgentSideNow());
    if (open.length > 0) this.opts.logger?.error({ addresses: open }, `egress sandboxes running here may reach more than they should: ${EgressManager.describe(open)}`);
  }

  /**
   * Links the network namespace of `pid` (a QEMU started in a new namespace) to the agent's
   * and installs `policy`. Call before the guest runs. The link goes away with the process.
   * Refused (EgressRefusedError, before any link is made) on a host with a private address
   * whose network it cannot tell: the safe side of not knowing what to deny is no egress, and
   * the error says which CIDR the operator must deny.
   */
  async attach(pid: number, policy: NetworkPolicySpec): Promise<{ link: string; sandboxAddress: string }> {
    EgressManager.validate(policy);
    const [view] = await Promise.all([this.applyAgentSideNow(), ownNetns(pid)]);
    const open = this.unguarded(view);
    if (open.length > 0) throw new EgressRefusedError(EgressManager.describe(open));
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
    const allow = policy.allowCidrs.map((c, i) => cidrText(parseAllowCidr(`network.allow_cidrs[${i}]`, c)));
    const sb = (cmd: string, args: string[], input?: string): Promise<string> => exec('nsenter', [`--net=/proc/${pid}/ns/net`, '--', cmd, ...args], input);
    // The filter first, so the link is never up without it.
    // DNS to the host's resolvers, which may sit on a denied subnet (dnsResolvers).
    const resolvers = dnsResolvers(view.resolvConf, { denied: [cidrText(this.pool), ...this.deny.map(cidrText)], allow });
    await sb('nft', ['-f', '-'], sandboxRuleset(allow, view.denied, resolvers));
    await sb('ip', ['addr', 'add', `${sbIp}/30`, 'dev', 'eth0']);
    await sb('ip', ['link', 'set', 'eth0', 'up']);
    await sb('ip', ['route', 'add', 'default', 'via', hostIp]);
    return { link, sandboxAddress: sbIp };
  }

  /**
   * The next free ffe<n> after the last one handed out (round, so a freed /30 is reused as late
   * as possible: see the header), created as a veth whose peer (eth0) is in `pid`'s namespace.
   * The last one is this manager's, else the one recorded in linkCursor by an agent before it
   * (a restart), else the highest present.
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
      const cursor = await this.linkCursor();
      const text = (await readFile(cursor, 'utf8').catch(() => '')).trim();
      const recorded = text === '' ? NaN : Number(text);
      const last = this.lastLink ?? (Number.isInteger(recorded) && recorded >= 0 && recorded < max ? recorded : used.size ? Math.max(...used) : -1);
      for (let i = 1; i <= max; i++) {
        const n = (last + i) % max;
        if (used.has(n)) continue;
        try {
          await this.agent('ip', ['link', 'add', `${HOST_LINK_PREFIX}${n}`, 'type', 'veth', 'peer', 'name', 'eth0', 'netns', String(pid)]);
          this.lastLink = n;
          await mkdir(dirname(cursor), { recursive: true })
            .then(() => writeFile(cursor, `${n}\n`))
            .catch((err: unknown) => {
              if (!this.cursorWarned) this.opts.logger?.warn({ err, cursor }, 'could not record the egress link handed out last: a restarted agent may hand out the /30 of a sandbox just gone');
              this.cursorWarned = true;
            });
          return n;
        } catch (e) {
          if (/exists/i.test(String((e as Error).message))) continue; // another agent took it
          throw e;
        }
      }
      // Retryable: a link frees when an egress sandbox here ends (placement may also pick another host).
      throw new ForkfleetError('resource_exhausted', `egress pool ${cidrText(this.pool)} of this host is exhausted (${max} sandboxes with egress run here; FF_EGRESS_POOL sets its size)`, { retryable: true });
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
