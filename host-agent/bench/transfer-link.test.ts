import { describe, expect, it } from 'vitest';
import type { NsHost } from '../adapters/peer/netns-testkit.ts';
import { parseRates, rootQdisc, setLinkRate, wireBytes, type RootQdisc } from './transfer-link.ts';

// `tc -s -j qdisc show dev eth0` (iproute2 6.1) on a veth shaped by the bench's tbf, after a
// 40 MiB TCP send: tbf counted 43,855,352 bytes where the veth's tx_bytes grew by 41,986,670.
const TBF = '[{"kind":"tbf","handle":"8352:","root":true,"refcnt":3,"options":{"rate":125000000,"burst":262125,"lat":5000},"bytes":43855352,"packets":28974,"drops":0,"overlimits":1896,"requeues":0,"backlog":0,"qlen":0}]';
// The same veth unshaped (its default qdisc).
const NOQUEUE = '[{"kind":"noqueue","handle":"0:","root":true,"refcnt":2,"options":{},"bytes":0,"packets":0,"drops":0,"overlimits":0,"requeues":0,"backlog":0,"qlen":0}]';

describe('tc qdisc counters', () => {
  it('rootQdisc_tbfRoot_givesItsByteCounter', () => {
    expect(rootQdisc(TBF)).toEqual({ kind: 'tbf', bytes: 43_855_352, drops: 0 });
  });

  it('rootQdisc_unshapedVeth_givesNoqueue', () => {
    expect(rootQdisc(NOQUEUE).kind).toBe('noqueue');
  });

  it('rootQdisc_tbfWithAChildShown_takesTheRootOnly', () => {
    const withChild = `[${TBF.slice(1, -1)},{"kind":"bfifo","handle":"0:","parent":"8352:1","options":{"limit":262125},"bytes":7,"packets":1,"drops":0,"overlimits":0,"requeues":0,"backlog":0,"qlen":0}]`;
    expect(rootQdisc(withChild).bytes).toBe(43_855_352);
  });

  it('rootQdisc_withoutStatistics_orNotTcJson_throws', () => {
    // `tc -j qdisc show` without -s has no byte counter.
    expect(() => rootQdisc('[{"kind":"tbf","handle":"8352:","root":true,"refcnt":3,"options":{}}]')).toThrow(/no byte counter/);
    expect(() => rootQdisc('qdisc tbf 8352: root refcnt 3')).toThrow(/cannot parse/);
    expect(() => rootQdisc('{"kind":"tbf"}')).toThrow(/not a list/);
    expect(() => rootQdisc('[]')).toThrow(/0 root qdiscs/);
  });
});

describe('wire bytes', () => {
  it('wireBytes_shapedLink_countsTbfBytesPerDirection_andKeepsTheVethFigures', () => {
    const w = wireBytes([{ tbf: 100, veth: 1000 }, { tbf: 50, veth: 500 }], [{ tbf: 43_855_452, veth: 41_987_670 }, { tbf: 90_050, veth: 88_500 }]);
    expect(w).toEqual({ counter: 'tbf', forward: 43_855_352, reverse: 90_000, vethForward: 41_986_670, vethReverse: 88_000 });
  });

  it('wireBytes_unshapedLink_countsTheVeths', () => {
    const w = wireBytes([{ tbf: undefined, veth: 10 }, { tbf: undefined, veth: 20 }], [{ tbf: undefined, veth: 110 }, { tbf: undefined, veth: 25 }]);
    expect(w).toEqual({ counter: 'veth', forward: 100, reverse: 5, vethForward: 100, vethReverse: 5 });
  });

  it('wireBytes_shapedOnOneEndOrPartOfTheSpan_orACounterThatWentBack_throws', () => {
    expect(() => wireBytes([{ tbf: 0, veth: 0 }, { tbf: undefined, veth: 0 }], [{ tbf: 1, veth: 1 }, { tbf: undefined, veth: 1 }])).toThrow(/one end/);
    expect(() => wireBytes([{ tbf: 5, veth: 0 }, { tbf: 5, veth: 0 }], [{ tbf: 1, veth: 1 }, { tbf: 9, veth: 1 }])).toThrow(/went back/);
  });
});

describe('--rates', () => {
  it('parseRates_numbersAtOrAboveZero_areTheRates', () => {
    expect(parseRates('1,10')).toEqual([1, 10]);
    expect(parseRates('10, 0')).toEqual([10, 0]);
    expect(parseRates('0.5')).toEqual([0.5]);
  });

  it('parseRates_aUnitAnEmptyEntryOrANegative_isRefusedByName', () => {
    expect(() => parseRates('1gbit,10gbit')).toThrow(/"1gbit"/);
    expect(() => parseRates('1,,10')).toThrow(/"" is not a link rate/);
    expect(() => parseRates('-1')).toThrow(/"-1"/);
    expect(() => parseRates('Infinity')).toThrow(/"Infinity"/);
    expect(() => parseRates('1e400')).toThrow(/"1e400"/);
  });
});

describe('link rate', () => {
  /** Two hosts whose root qdisc shape()/unshape() set as tc would. */
  function fakeLink(): { hosts: NsHost[]; root: Map<string, string>; fabric: Parameters<typeof setLinkRate>[0]; read: (h: NsHost) => RootQdisc } {
    const hosts = [{ ns: 'h0', ifname: 'eth0', address: '10.0.0.1' }, { ns: 'h1', ifname: 'eth0', address: '10.0.0.2' }];
    const root = new Map(hosts.map((h) => [h.ns, 'noqueue']));
    return {
      hosts,
      root,
      fabric: {
        shape: (h, rate) => void root.set(h.ns, `tbf ${rate}`),
        unshape: (h) => void root.set(h.ns, 'noqueue'),
      },
      read: (h) => ({ kind: root.get(h.ns)!.split(' ')[0]!, bytes: 0, drops: 0 }),
    };
  }

  it('setLinkRate_zeroAfterAShapedRate_removesTheTbfFromBothEnds', () => {
    const l = fakeLink();
    setLinkRate(l.fabric, l.hosts, 10, l.read);
    expect([...l.root.values()]).toEqual(['tbf 10gbit', 'tbf 10gbit']);
    setLinkRate(l.fabric, l.hosts, 0, l.read);
    expect([...l.root.values()]).toEqual(['noqueue', 'noqueue']);
  });

  it('setLinkRate_zeroOnAnUnshapedLink_leavesItAsItIs', () => {
    const l = fakeLink();
    let unshaped = 0;
    setLinkRate({ ...l.fabric, unshape: () => void unshaped++ }, l.hosts, 0, l.read);
    expect(unshaped).toBe(0);
  });
});
