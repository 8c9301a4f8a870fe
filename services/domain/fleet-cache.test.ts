import { describe, expect, it } from 'vitest';
import { FleetCache } from './executor.ts';
import type { Versioned } from './ports.ts';
import type { HostRec, SnapshotRec } from './records.ts';

const snap = (id: string, state: SnapshotRec['state'], modRevision: number): Versioned<SnapshotRec> => ({ value: { id, tenantId: 't1', state } as SnapshotRec, modRevision });

describe('FleetCache snapshots', () => {
  it('goneSnapshot_removesTheRecord_andAnOlderCopyArrivingLaterIsNotTakenBackIn', () => {
    const c = new FleetCache();
    c.apply({ kind: 'snapshot', value: snap('sn-a', 'deleted', 10) });
    c.apply({ kind: 'gone', of: 'snapshot', key: 't1/sn-a', revision: 12 });
    expect(c.snapshot('t1', 'sn-a')).toBeUndefined();
    // A watch event or a list from before the delete, late: still gone, and known.
    c.apply({ kind: 'snapshot', value: snap('sn-a', 'deleted', 10) });
    expect(c.snapshot('t1', 'sn-a')).toBeUndefined();
    expect(c.knows('snapshot', 't1/sn-a', 11)).toBe(true);
    // A record written again after the delete (a new revision) is taken.
    c.apply({ kind: 'snapshot', value: snap('sn-a', 'ready', 13) });
    expect(c.snapshot('t1', 'sn-a')?.modRevision).toBe(13);
  });

  it('goneSnapshot_ofAnOlderRevisionThanTheCachedRecord_keepsTheRecord', () => {
    const c = new FleetCache();
    c.apply({ kind: 'snapshot', value: snap('sn-b', 'ready', 20) });
    c.apply({ kind: 'gone', of: 'snapshot', key: 't1/sn-b', revision: 15 });
    expect(c.snapshot('t1', 'sn-b')?.modRevision).toBe(20);
  });

  it('load_afterRecordsWereDeleted_dropsThemButKeepsOnesNewerThanTheList', async () => {
    const c = new FleetCache();
    c.apply({ kind: 'snapshot', value: snap('sn-old', 'deleted', 5) });
    c.apply({ kind: 'snapshot', value: snap('sn-new', 'ready', 50) }); // written after the list was read
    const store = { revision: async () => 20, listHosts: async () => [], listAllocs: async () => [], listSnapshots: async () => [snap('sn-kept', 'ready', 20)] } as unknown as Parameters<FleetCache['load']>[0];
    await c.load(store);
    expect(c.snapshot('t1', 'sn-old')).toBeUndefined();
    expect(c.snapshot('t1', 'sn-kept')?.modRevision).toBe(20);
    expect(c.snapshot('t1', 'sn-new')?.modRevision).toBe(50);
  });

  it('load_ofAnEmptyList_dropsCachedRecordsOlderThanTheStoresRevision_asALeaderAgainHasFromItsLastTerm', async () => {
    // Deleted while another replica led (expired, then its record purged): nothing listed is
    // newer than it, so only the store's revision tells that it is gone.
    const c = new FleetCache();
    c.apply({ kind: 'snapshot', value: snap('sn-x', 'ready', 30) });
    c.apply({ kind: 'snapshot', value: snap('sn-y', 'ready', 35) });
    const store = { revision: async () => 40, listHosts: async () => [], listAllocs: async () => [], listSnapshots: async () => [snap('sn-old', 'ready', 10)] } as unknown as Parameters<FleetCache['load']>[0];
    await c.load(store);
    expect(c.snapshot('t1', 'sn-x')).toBeUndefined();
    expect(c.snapshot('t1', 'sn-y')).toBeUndefined();
    expect(c.snapshot('t1', 'sn-old')?.modRevision).toBe(10);
  });
});

describe('FleetCache hosts', () => {
  const host = (id: string, modRevision: number): Versioned<HostRec> => ({ value: { id, state: 'ready' } as HostRec, modRevision });

  it('hostsById_listsTheHostsInIdOrder_whateverOrderTheyRegisteredIn_andFollowsHostsThatComeAndGo', () => {
    const c = new FleetCache();
    for (const [id, rev] of [['h3', 1], ['h1', 2], ['h2', 3]] as const) c.apply({ kind: 'host', value: host(id, rev) });
    expect(c.hostsById().map((h) => h.value.id)).toEqual(['h1', 'h2', 'h3']);
    // A host's record written again: its new revision, in its place.
    c.apply({ kind: 'host', value: host('h2', 9) });
    expect(c.hostsById().map((h) => [h.value.id, h.modRevision])).toEqual([['h1', 2], ['h2', 9], ['h3', 1]]);
    c.apply({ kind: 'host', value: host('h0', 10) });
    c.apply({ kind: 'gone', of: 'host', key: 'h3', revision: 11 });
    expect(c.hostsById().map((h) => h.value.id)).toEqual(['h0', 'h1', 'h2']);
  });
});
