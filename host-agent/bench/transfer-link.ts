// The link side of the transfer benchmarks (transfer.ts, transfer-probe.ts): which link rates
// a run shapes, and how many bytes went over the link.
//
// Wire bytes (ADR 0008, "Wire bytes from tbf's own counter"): the veth carries TSO/GSO packets
// of up to 64 KiB, and its tx counter counts each as its length: the headers of the one packet.
// tbf charges the rate for each such packet as its length plus the headers of every further
// ~1500-byte segment it becomes (`qdisc_pkt_len_init`: (gso_segs - 1) * header length, what the
// kernel calls the bytes sent on the wire), and its byte counter counts the same. So on a shaped
// link the root tbf's counter is what the link carried; the veth's reads ~4% low. Unshaped
// links (rate 0) have no tbf: there the veth counter is the only one.
import { execFileSync } from 'node:child_process';
import type { Fabric, NsHost } from '../adapters/peer/netns-testkit.ts';

/**
 * `--rates`: comma-separated link rates in Gbit/s, each a finite number >= 0 (0: unshaped).
 * Anything else (a unit such as "1gbit", an empty entry, a negative number) is an error that
 * names the value.
 */
export function parseRates(s: string): number[] {
  return s.split(',').map((raw) => {
    const v = raw.trim();
    const g = /^\d+(\.\d+)?$/.test(v) ? Number(v) : NaN;
    if (!Number.isFinite(g) || g < 0) throw new Error(`--rates: "${raw}" is not a link rate in Gbit/s (a number >= 0; 0 = unshaped)`);
    return g;
  });
}

/** The root qdisc of one device, from `tc -s -j qdisc show dev DEV`. */
export interface RootQdisc {
  kind: string;
  /** Bytes the qdisc sent (dequeued), as the qdisc counts them (for tbf: GSO packets with every segment's headers). */
  bytes: number;
  drops: number;
}

/**
 * Parses `tc -s -j qdisc show dev DEV`: the entry marked root. Throws on output that is not
 * tc's JSON, or a root entry without numeric byte counters (tc run without -s).
 */
export function rootQdisc(json: string): RootQdisc {
  let list: unknown;
  try {
    list = JSON.parse(json);
  } catch (e) {
    throw new Error(`tc qdisc JSON: cannot parse ${JSON.stringify(json.slice(0, 200))}`, { cause: e });
  }
  if (!Array.isArray(list)) throw new Error(`tc qdisc JSON: not a list: ${JSON.stringify(json.slice(0, 200))}`);
  const roots = list.filter((q): q is Record<string, unknown> => typeof q === 'object' && q !== null && (q as Record<string, unknown>).root === true);
  if (roots.length !== 1) throw new Error(`tc qdisc JSON: ${roots.length} root qdiscs (one device's output expected): ${JSON.stringify(json.slice(0, 200))}`);
  const root = roots[0]!;
  const { kind, bytes, drops } = root;
  if (typeof kind !== 'string') throw new Error('tc qdisc JSON: the root qdisc has no kind');
  if (typeof bytes !== 'number' || !Number.isSafeInteger(bytes) || bytes < 0) throw new Error(`tc qdisc JSON: the root ${kind} has no byte counter (was tc run with -s?)`);
  return { kind, bytes, drops: typeof drops === 'number' ? drops : 0 };
}

/** The root qdisc of a host's interface, read in its namespace. */
export function readRootQdisc(host: NsHost): RootQdisc {
  return rootQdisc(execFileSync('ip', ['netns', 'exec', host.ns, 'tc', '-s', '-j', 'qdisc', 'show', 'dev', host.ifname]).toString());
}

/**
 * Shapes both hosts' egress to `gbps` (tbf), or with 0 removes the tbf an earlier rate left (and
 * checks that it is gone): a 0 after a 10 used to run on the 10 Gbit link. `read` reads a
 * host's root qdisc (tests pass their own).
 */
export function setLinkRate(fabric: Pick<Fabric, 'shape' | 'unshape'>, hosts: readonly NsHost[], gbps: number, read: (h: NsHost) => RootQdisc = readRootQdisc): void {
  for (const h of hosts) {
    if (gbps > 0) fabric.shape(h, `${gbps}gbit`, gbps >= 10 ? '4mb' : '256kb');
    else {
      if (read(h).kind === 'tbf') fabric.unshape(h);
      if (read(h).kind === 'tbf') throw new Error(`${h.ns}: the tbf of an earlier rate is still the root qdisc after unshape`);
    }
  }
}

/** One host's egress counters at one moment. */
export interface EgressSample {
  /** The root tbf's byte counter; undefined when the root qdisc is not a tbf (unshaped). */
  tbf: number | undefined;
  /** The veth's tx_bytes. */
  veth: number;
}

export function sampleEgress(fabric: Fabric, host: NsHost): EgressSample {
  const q = readRootQdisc(host);
  return { tbf: q.kind === 'tbf' ? q.bytes : undefined, veth: fabric.counters(host).tx };
}

/** Bytes over the link between two samples of the sender's and the receiver's egress. */
export interface WireBytes {
  /** Which counter `forward`/`reverse` come from: the root tbf's (shaped link) or the veth's (unshaped). */
  counter: 'tbf' | 'veth';
  /** Sender to receiver. */
  forward: number;
  /** Receiver to sender (requests, credits, ACKs). */
  reverse: number;
  /** The veths' tx counters over the same span (GSO packets counted with one set of headers each). */
  vethForward: number;
  vethReverse: number;
}

/**
 * Wire bytes between `before` and `after` ([sender, receiver] each). tbf counters are used when
 * both ends were shaped throughout; neither shaped: the veth counters. One end shaped and the
 * other not, or a tbf replaced in between (its counter went back), is an error: the two
 * directions would be counted differently.
 */
export function wireBytes(before: readonly [EgressSample, EgressSample], after: readonly [EgressSample, EgressSample]): WireBytes {
  const all = [...before, ...after];
  const shaped = all.filter((s) => s.tbf !== undefined).length;
  if (shaped !== 0 && shaped !== all.length) throw new Error('wire bytes: the link was shaped on one end or for part of the span only');
  const d = (i: 0 | 1, k: 'tbf' | 'veth'): number => {
    const v = (after[i][k] ?? 0) - (before[i][k] ?? 0);
    if (v < 0) throw new Error(`wire bytes: the ${k} counter went back (${before[i][k]} -> ${after[i][k]}): the qdisc or link was replaced during the span`);
    return v;
  };
  const counter = shaped > 0 ? 'tbf' : 'veth';
  return { counter, forward: d(0, counter), reverse: d(1, counter), vethForward: d(0, 'veth'), vethReverse: d(1, 'veth') };
}
