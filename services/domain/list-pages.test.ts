// ListSandboxes of one tenant, page by page: each page is read from the store from where the
// page before ended (FleetStore.listSandboxesAfter), so paging through N sandboxes reads each
// about once, and the pages hold exactly what one sorted, filtered list would, in id order.
import { describe, expect, it } from 'vitest';
import { Fleet } from './fleet.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import type { FleetStore, Versioned } from './ports.ts';
import type { SandboxRec, SandboxState } from './records.ts';
import { sandboxRecord } from '../testkit/records.ts';

function fleetOver(records: SandboxRec[], paged: boolean): { fleet: Fleet; read: () => number } {
  let read = 0;
  const sorted = [...records].sort((a, b) => (a.id < b.id ? -1 : 1));
  const v = (r: SandboxRec): Versioned<SandboxRec> => ({ value: r, modRevision: 1 });
  const store = {
    listSandboxes: async (tenantId: string | undefined) => {
      const all = sorted.filter((r) => tenantId === undefined || r.tenantId === tenantId);
      read += all.length;
      return all.map(v);
    },
    ...(paged
      ? {
          listSandboxesAfter: async (tenantId: string, afterId: string, limit: number) => {
            const rest = sorted.filter((r) => r.tenantId === tenantId && r.id > afterId);
            read += Math.min(limit, rest.length);
            return { records: rest.slice(0, limit).map(v), more: rest.length > limit };
          },
        }
      : {}),
  } as unknown as FleetStore;
  return { fleet: new Fleet({ store, bus: {} as never, clock: { now: () => 1_000 }, heard: new HeartbeatRegistry(), liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 } }), read: () => read };
}

const id = (i: number): string => `sb-${String(i).padStart(20, 'a').replace(/[0-9]/g, (d) => 'abcdefghij'[Number(d)]!)}`;

describe('ListSandboxes pages', () => {
  // 3,000 of t1's (every third destroyed, every fifth labelled team=b) and 500 of t2's.
  const records = [
    ...Array.from({ length: 3000 }, (_, i) => sandboxRecord({ id: id(i), tenantId: 't1', state: (i % 3 === 0 ? 'destroyed' : 'running') as SandboxState, labels: i % 5 === 0 ? { team: 'b' } : {} })),
    ...Array.from({ length: 500 }, (_, i) => sandboxRecord({ id: id(i), tenantId: 't2' })),
  ];
  const pages = async (fleet: Fleet, labels: Record<string, string>, size: number): Promise<string[][]> => {
    const out: string[][] = [];
    for (let after = ''; ; ) {
      const { items, more } = await fleet.listSandboxPage('t1', [], labels, '', after, size);
      out.push(items.map((s) => s.id));
      if (!more) return out;
      after = items[items.length - 1]!.id;
    }
  };

  it('listSandboxPage_pagingThroughATenant_readsEachRecordAboutOnce_andPagesAsOneSortedFilteredList', async () => {
    for (const labels of [{}, { team: 'b' }] as Array<Record<string, string>>) {
      const paged = fleetOver(records, true);
      const whole = fleetOver(records, false);
      const got = await pages(paged.fleet, labels, 100);
      const want = await pages(whole.fleet, labels, 100);
      expect(got).toEqual(want);
      const ids = got.flat();
      expect(ids).toEqual(records.filter((r) => r.tenantId === 't1' && r.state !== 'destroyed' && (!('team' in labels) || r.labels.team === 'b')).map((r) => r.id).sort());
      expect(got.slice(0, -1).every((p) => p.length === 100)).toBe(true);
      // Every page read the whole tenant before (20 pages x 3,000 unfiltered). Now each record about once.
      expect(whole.read()).toBe(got.length * 3000);
      expect(paged.read()).toBeLessThan(3000 + got.length * 257);
    }
  });

  it('listSandboxPage_ofAPageThatEndsTheList_saysNoMore', async () => {
    const { fleet } = fleetOver(records, true);
    const all = (await pages(fleet, {}, 1000)).flat();
    const last = await fleet.listSandboxPage('t1', [], {}, '', all[all.length - 2]!, 1);
    expect(last).toEqual({ items: [expect.objectContaining({ id: all[all.length - 1] })], more: false });
    expect(await fleet.listSandboxPage('t1', [], {}, '', all[all.length - 1]!, 10)).toEqual({ items: [], more: false });
  });
});
