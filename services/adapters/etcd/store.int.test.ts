// EtcdFleetStore against a real etcd: listing a prefix larger than one page, the op
// watch's key filter, compaction and guarded deletes.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { createConnection, createServer } from 'node:net';
import type { Socket } from 'node:net';
import { startEtcd } from '../../testkit/etcd.ts';
import type { EtcdCluster } from '../../testkit/etcd.ts';
import { sleep, waitFor } from '../../testkit/proc.ts';
import { EtcdFleetStore } from './store.ts';
import type { StoreWrite } from '../../domain/ports.ts';
import type { OperationRec, SandboxRec } from '../../domain/records.ts';
import { QuotaLedger } from '../../domain/quota-ledger.ts';
import { EtcdDeliveryLog } from './webhook-log.ts';
import type { DeliveryRec } from '../../domain/webhooks.ts';
import { usageOf } from '../../domain/quota.ts';
import { EtcdLeaderElection } from './election.ts';
import { keys } from './keys.ts';
import { NotLeaderError, StoreFullError, StoreUnavailableError } from '../../domain/errors.ts';
import { StoreDuplicateKeyError, StoreLimitError } from './errors.ts';
import { sandboxRecord } from '../../testkit/records.ts';

/**
 * A TCP relay to `target` ("http://host:port") that can be frozen: from then on it forwards
 * nothing either way and keeps the connections open, as a network partition looks to both
 * ends until a timeout.
 */
async function freezableRelay(target: string): Promise<{ url: string; freeze: () => void; close: () => Promise<void> }> {
  const { hostname, port } = new URL(target);
  const sockets = new Set<Socket>();
  let frozen = false;
  const server = createServer((down) => {
    const up = createConnection({ host: hostname, port: Number(port) });
    for (const [from, to] of [[down, up], [up, down]] as const) {
      sockets.add(from);
      from.on('data', (b) => void (frozen || to.write(b)));
      from.on('error', () => to.destroy());
      from.on('close', () => to.destroy());
    }
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  const a = server.address();
  return {
    url: `http://127.0.0.1:${typeof a === 'object' && a ? a.port : 0}`,
    freeze: () => void (frozen = true),
    close: async () => {
      for (const s of sockets) s.destroy();
      await new Promise((r) => server.close(r));
    },
  };
}

function sandbox(tenantId: string, id: string): SandboxRec {
  return sandboxRecord({ id, tenantId, lineageId: id, hostname: id, labels: { pad: 'x'.repeat(400) }, afterResume: [], allowCidrs: [] });
}

describe('EtcdFleetStore', () => {
  let etcd: EtcdCluster;
  let store: EtcdFleetStore;

  beforeAll(async () => {
    etcd = await startEtcd();
    store = EtcdFleetStore.connect(etcd.endpoints);
  }, 60_000);

  afterAll(async () => {
    store?.close();
    await etcd?.stop();
  });

  it('listSandboxes_whenPrefixSpansManyPages_returnsEveryRecordOnceInKeyOrder', async () => {
    // 1,700 records of ~0.9 KiB: four pages of 500 (the whole fleet's sandboxes outgrow one
    // 4 MiB response at ~6,000). Another tenant's record sits right after this prefix.
    const ids = Array.from({ length: 1700 }, (_, i) => `sb-${String(i).padStart(5, '0')}`);
    for (let i = 0; i < ids.length; i += 100) {
      await store.commit(ids.slice(i, i + 100).map((id): StoreWrite => ({ kind: 'sandbox', value: sandbox('big', id) })));
    }
    await store.commit([{ kind: 'sandbox', value: sandbox('big2', 'sb-other') }]);
    const listed = await store.listSandboxes('big');
    expect(listed.map((v) => v.value.id)).toEqual(ids);
    expect((await store.listSandboxes(undefined)).length).toBe(ids.length + 1);
  }, 60_000);

  it('listSandboxesAfter_readsOneTenantsSandboxesAfterAnIdInIdOrder_upToItsLimit_sayingWhetherMoreFollow', async () => {
    const ids = Array.from({ length: 7 }, (_, i) => `sb-after-${i}`);
    await store.commit([...ids.map((id): StoreWrite => ({ kind: 'sandbox', value: sandbox('after', id) })), { kind: 'sandbox', value: sandbox('after2', 'sb-after-9') }, { kind: 'sandbox', value: sandbox('afte', 'sb-after-8') }]);
    const read = async (after: string, limit: number): Promise<[string[], boolean]> => {
      const r = await store.listSandboxesAfter('after', after, limit);
      return [r.records.map((v) => v.value.id), r.more];
    };
    expect(await read('', 3)).toEqual([ids.slice(0, 3), true]);
    expect(await read(ids[2]!, 3)).toEqual([ids.slice(3, 6), true]);
    expect(await read(ids[5]!, 3)).toEqual([ids.slice(6), false]);
    expect(await read(ids[6]!, 3)).toEqual([[], false]);
    // An id between two: the next one on.
    expect(await read('sb-after-2x', 10)).toEqual([ids.slice(3), false]);
  });

  it('getSandbox_whenManyReadInOneTick_returnsEachRecordOrUndefined', async () => {
    // 250 reads in one tick: three read-only transactions (100 each), missing keys included.
    const ids = Array.from({ length: 200 }, (_, i) => `sb-get-${i}`);
    for (let i = 0; i < ids.length; i += 100) await store.commit(ids.slice(i, i + 100).map((id): StoreWrite => ({ kind: 'sandbox', value: sandbox('gets', id) })));
    const asked = [...ids, ...Array.from({ length: 50 }, (_, i) => `sb-missing-${i}`)];
    const got = await Promise.all(asked.map((id) => store.getSandbox('gets', id)));
    expect(got.map((v) => v?.value.id)).toEqual([...ids, ...Array.from({ length: 50 }, () => undefined)]);
    expect(got.slice(0, 200).every((v) => (v?.modRevision ?? 0) > 0)).toBe(true);
    const [one] = await Promise.all([store.getSandbox('gets', ids[7]!)]);
    expect(one?.value.id).toBe(ids[7]);
  }, 30_000);

  it('followSandboxes_listsEveryRecordThenFollowsPutsAndDeletes', async () => {
    await store.commit([{ kind: 'sandbox', value: sandbox('follow', 'sb-f1') }, { kind: 'sandbox', value: sandbox('follow', 'sb-f2') }]);
    const index = new Map<string, string>();
    const stop = await store.followSandboxes((c) => {
      if (c.kind === 'put') index.set(`${c.value.value.tenantId}/${c.value.value.id}`, c.value.value.state);
      else index.delete(`${c.tenantId}/${c.id}`);
    });
    expect(index.get('follow/sb-f1')).toBe('running');
    await store.commit([{ kind: 'sandbox', value: { ...sandbox('follow', 'sb-f1'), state: 'paused' } }, { kind: 'sandbox', value: sandbox('follow', 'sb-f3') }, { kind: 'delete-sandbox', tenantId: 'follow', id: 'sb-f2' }]);
    await waitFor('the changes', () => Promise.resolve(index.get('follow/sb-f1') === 'paused' && index.has('follow/sb-f3') && !index.has('follow/sb-f2')), 5_000, 10);
    stop();
  }, 30_000);

  it('followSandboxesAndWatchFleet_withKnown_skipRecordsTheCallerHasAtThatRevision', async () => {
    // The caller "has" what it committed itself (the leader's index and cache): those writes
    // are not delivered again; a later write by anyone else is. (A watch event may arrive
    // before the commit's answer, so the test knows the next revision beforehand: nothing
    // else writes to this etcd meanwhile.)
    const alloc = (hostId: string, sandboxes: number): StoreWrite => ({ kind: 'alloc', value: { hostId, allocated: { vcpus: sandboxes, memoryMib: 0, diskMib: 0 }, sandboxes } });
    const next = (await store.commitAt([alloc('h-known-seed', 0)])) + 1;
    const mine = new Map<string, number>([
      ['known/sb-k1', next],
      ['alloc/h-known', next],
    ]);
    const seen: string[] = [];
    const stopSb = await store.followSandboxes(
      (c) => {
        // (The list first delivers every record the other tests wrote.)
        if (c.kind === 'put' && c.value.value.tenantId === 'known') seen.push(`sb:${c.value.value.id}:${c.value.value.state}`);
      },
      undefined,
      { known: (key, rev) => (mine.get(key) ?? -1) >= rev },
    );
    const stopFleet = await store.watchFleet((c) => seen.push(c.kind === 'alloc' ? `alloc:${c.value.value.hostId}:${c.value.value.sandboxes}` : c.kind), {
      known: (kind, key, rev) => (mine.get(`${kind}/${key}`) ?? -1) >= rev,
    });
    expect(await store.commitAt([{ kind: 'sandbox', value: sandbox('known', 'sb-k1') }, alloc('h-known', 1)])).toBe(next);
    await store.commit([{ kind: 'sandbox', value: { ...sandbox('known', 'sb-k1'), state: 'paused' } }, alloc('h-known', 2)]);
    await waitFor('the second writes', () => Promise.resolve(seen.length >= 2), 5_000, 10);
    await sleep(200);
    expect(seen.sort()).toEqual(['alloc:h-known:2', 'sb:sb-k1:paused']);
    stopSb();
    stopFleet();
  }, 30_000);

  it('compact_dropsTheHistoryBeforeItsRevision_andAWatchFromBeforeItReportsItsEnd', async () => {
    const key = 'sb-history';
    const r1 = await store.commitAt([{ kind: 'sandbox', value: sandbox('hist', key) }]);
    const r2 = await store.commitAt([{ kind: 'sandbox', value: { ...sandbox('hist', key), state: 'paused' } }]);
    expect(await store.revision()).toBeGreaterThanOrEqual(r2);
    const at = (rev: number) => store.etcd.get(`/ff/v1/sandboxes/hist/${key}`).revision(String(rev)).json() as Promise<SandboxRec | null>;
    expect((await at(r1))?.state).toBe('running');
    await store.compact(r2);
    await expect(at(r1)).rejects.toThrow(/compacted/i);
    expect((await at(r2))?.state).toBe('paused');
    await store.compact(r2);
    await store.compact(r1);
    // A watch that would resume from a compacted revision is cancelled by etcd: the caller
    // hears of it (and lists again) instead of the process dying on an unheard 'error'.
    const broke: unknown[] = [];
    const stop = await store.watchRecords(() => undefined, { fromRevision: r1, onError: (e) => broke.push(e) });
    await waitFor('the cancelled watch', () => Promise.resolve(broke.length > 0), 5_000, 10);
    // etcd sends the compact revision and no reason text: the store finds out and says so.
    expect(String(broke[0])).toMatch(/required revision has been compacted/i);
    stop();
    // A list after the compaction still reads every record.
    expect((await store.listSandboxes('hist')).map((v) => v.value.state)).toEqual(['paused']);
  }, 30_000);

  it('commitAt_withTheFenceOfAnElectionThatLapsed_throwsNotLeaderAndWritesNothing', async () => {
    // A leader whose lease lapsed (its process stalled) and a standby that won meanwhile.
    const a = new EtcdLeaderElection(store.etcd, 'fence-a', 1);
    await a.campaign();
    const fenceA = a.fence()!;
    expect(fenceA.createRevision).toBeGreaterThan(0);
    const rec = sandbox('fence', 'sb-1');
    expect(await store.commitAt([{ kind: 'sandbox', value: rec, expectRevision: 0 }], fenceA)).toBeGreaterThan(0);
    const v1 = (await store.getSandbox('fence', 'sb-1'))!;
    // A stale guard under a valid fence is a plain conflict (0), not a lost leadership.
    expect(await store.commitAt([{ kind: 'sandbox', value: { ...rec, stateReason: 'stale' }, expectRevision: v1.modRevision - 1 }], fenceA)).toBe(0);

    await store.etcd.delete().key(fenceA.key).exec(); // what etcd does when the lease expires
    const b = new EtcdLeaderElection(store.etcd, 'fence-b', 1);
    await b.campaign();
    await expect(store.commitAt([{ kind: 'sandbox', value: { ...rec, state: 'failed' }, expectRevision: v1.modRevision }], fenceA)).rejects.toBeInstanceOf(NotLeaderError);
    expect((await store.getSandbox('fence', 'sb-1'))!.value.state).toBe('running');
    // The new leader's fence lets the same write through.
    expect(await store.commitAt([{ kind: 'sandbox', value: { ...rec, state: 'failed' }, expectRevision: v1.modRevision }], b.fence()!)).toBeGreaterThan(0);
    await b.resign();
    await a.resign();
  });

  it('fence_storeIdIsKeptByEveryLeaderOfOneStore_andIsNewOnceItsIncarnationKeyIsGone_theClusterIdEtcds', async () => {
    // Leader terms are the fence's create revision: a store made anew (a wiped etcd rebuilt
    // with the same member list and token keeps etcd's cluster id) counts revisions from 1
    // again, and agents that kept a higher term would drop its every step.
    const clusterId = (await store.etcd.get('x').exec()).header.cluster_id;
    const a = new EtcdLeaderElection(store.etcd, 'inc-a', 1);
    await a.campaign();
    const first = a.fence()!.storeId!;
    expect(a.fence()!.clusterId).toBe(clusterId);
    await a.resign();
    const b = new EtcdLeaderElection(store.etcd, 'inc-b', 1);
    await b.campaign();
    expect(b.fence()!.storeId).toBe(first);
    await b.resign();
    expect(first).toMatch(/^[1-9]\d{0,19}$/);
    expect(BigInt(first)).toBeLessThan(2n ** 64n);
    await store.etcd.delete().key(keys.incarnation()).exec();
    await new Promise((r) => setTimeout(r, 1000)); // store ids order by the second a store was made
    const c = new EtcdLeaderElection(store.etcd, 'inc-c', 1);
    await c.campaign();
    expect(BigInt(c.fence()!.storeId!)).toBeGreaterThan(BigInt(first));
    expect(c.fence()!.clusterId).toBe(clusterId);
    await c.resign();
  });

  it('leader_cutOffFromEtcd_stepsDownBeforeAStandbyCanWin', async () => {
    // The leader reaches etcd through a relay that then goes silent: its lease lapses after the
    // TTL and the standby wins. The old leader must have stopped (onLost, isLeader false)
    // before that, or both would act as leader for a while (etcd3 alone reports the loss only
    // after 2 x TTL without an answer).
    const relay = await freezableRelay(etcd.endpoints[0]!);
    const cutOff = EtcdFleetStore.connect([relay.url]);
    const a = new EtcdLeaderElection(cutOff.etcd, 'cut-a', 2);
    const b = new EtcdLeaderElection(store.etcd, 'cut-b', 2);
    try {
      await a.campaign();
      let lostAt = 0;
      a.onLost(() => (lostAt = Date.now()));
      let wonAt = 0;
      const bWon = b.campaign().then(() => (wonAt = Date.now()));
      // Answered keepalives keep the leader: the standby waits through several TTLs.
      await sleep(3000);
      expect(a.isLeader()).toBe(true);
      expect(wonAt).toBe(0);
      const frozenAt = Date.now();
      relay.freeze();
      await bWon;
      expect(lostAt, 'the cut-off leader never stepped down').toBeGreaterThan(0);
      expect(lostAt).toBeGreaterThanOrEqual(frozenAt);
      expect(lostAt).toBeLessThan(wonAt);
      expect(a.isLeader()).toBe(false);
      expect(b.isLeader()).toBe(true);
    } finally {
      await b.resign();
      await relay.close();
      cutOff.close();
    }
  }, 30_000);

  it('commitAt_retriedAfterItApplied_returnsTheRevisionItLandedAt_unlessItsRecordsChangedSince', async () => {
    // etcd3 retries a call whose answer was lost; a transaction etcd had applied then fails
    // its own guards. The store recognises its own writes instead of reporting a conflict.
    const rec = { ...sandbox('replay', 'sb-r1'), updatedAt: 1 };
    const alloc = (sandboxes: number, expectRevision: number): StoreWrite => ({ kind: 'alloc', value: { hostId: 'h-replay', allocated: { vcpus: sandboxes, memoryMib: 256 * sandboxes, diskMib: 0 }, sandboxes }, expectRevision });
    const placement: StoreWrite[] = [{ kind: 'sandbox', value: rec, expectRevision: 0 }, alloc(1, 0)];
    const landed = await store.commitAt(placement);
    expect(landed).toBeGreaterThan(0);
    expect(await store.commitAt(placement)).toBe(landed);
    // Under a fence too (its key is read first in the else branch).
    const e = new EtcdLeaderElection(store.etcd, 'replay-a', 5);
    await e.campaign();
    const second: StoreWrite[] = [{ kind: 'sandbox', value: { ...rec, state: 'paused', updatedAt: 2 }, expectRevision: landed }];
    const at2 = await store.commitAt(second, e.fence()!);
    expect(await store.commitAt(second, e.fence()!)).toBe(at2);
    await e.resign();
    // Once the record moved on, the replay is the conflict it is.
    await store.commit([{ kind: 'sandbox', value: { ...rec, state: 'running', updatedAt: 3 } }]);
    expect(await store.commitAt(second)).toBe(0);
    // Capacity alone cannot be recognised (another change can leave the same value): a conflict.
    const a1 = (await store.getAlloc('h-replay')).modRevision;
    const release: StoreWrite[] = [alloc(0, a1)];
    expect(await store.commitAt(release)).toBeGreaterThan(0);
    expect(await store.commitAt(release)).toBe(0);
    // A capacity record it wrote that changed after it landed does not hide it.
    const rec2 = { ...sandbox('replay', 'sb-r2'), updatedAt: 4 };
    const a2 = (await store.getAlloc('h-replay')).modRevision;
    const booking: StoreWrite[] = [{ kind: 'sandbox', value: rec2, expectRevision: 0 }, alloc(1, a2)];
    const at3 = await store.commitAt(booking);
    await store.commit([alloc(2, at3)]);
    expect(await store.commitAt(booking)).toBe(at3);
    // The same record next to another value than the one that landed with it is not this
    // transaction: a conflict.
    const rec3 = { ...sandbox('replay', 'sb-r3'), updatedAt: 5 };
    const a3 = (await store.getAlloc('h-replay')).modRevision;
    expect(await store.commitAt([{ kind: 'sandbox', value: rec3, expectRevision: 0 }, alloc(3, a3)])).toBeGreaterThan(0);
    expect(await store.commitAt([{ kind: 'sandbox', value: rec3, expectRevision: 0 }, alloc(9, a3)])).toBe(0);
  });

  it('readsAndWrites_whenEtcdIsDown_failWithARetryableStoreUnavailableError', async () => {
    // The API answers UNAVAILABLE (retryable) for these, not INTERNAL.
    const gone = await startEtcd();
    const deadlineMs = 2000; // ETCD_CALL_DEADLINE_MS, shortened for the test
    const s = EtcdFleetStore.connect(gone.endpoints, undefined, '', deadlineMs);
    try {
      await s.getSandbox('t', 'warm-up');
      await gone.stop();
      const read = await s.getSandbox('t', 'sb').catch((e: unknown) => e);
      expect(read).toBeInstanceOf(StoreUnavailableError);
      expect((read as StoreUnavailableError).retryable).toBe(true);
      expect(await s.commitAt([{ kind: 'sandbox', value: sandbox('t', 'sb'), expectRevision: 0 }]).catch((e: unknown) => e)).toBeInstanceOf(StoreUnavailableError);
      expect(await s.listSandboxes('t').catch((e: unknown) => e)).toBeInstanceOf(StoreUnavailableError);
      // Quota admission reads the revision: a raw etcd error there answered INTERNAL.
      expect(await s.revision().catch((e: unknown) => e)).toBeInstanceOf(StoreUnavailableError);
      // A new watch waited for etcd for ever (etcd3 only reconnects): a WaitOperation hung.
      const t0 = Date.now();
      expect(await s.watchOps(() => undefined).catch((e: unknown) => e)).toBeInstanceOf(StoreUnavailableError);
      expect(await s.watchFleet(() => undefined).catch((e: unknown) => e)).toBeInstanceOf(StoreUnavailableError);
      expect(Date.now() - t0).toBeLessThan(2 * deadlineMs + 3000);
    } finally {
      s.close();
      await gone.stop();
    }
  }, 60_000);

  it('writes_whenEtcdsDatabaseIsFull_failWithResourceExhaustedSayingSo_notAnInternalError', async () => {
    // A 1 MiB quota (etcd allows it; the default is 2 GiB): a few hundred KiB of records fill it.
    const small = await startEtcd({ args: ['--quota-backend-bytes', String(1 << 20)] });
    const s = EtcdFleetStore.connect(small.endpoints);
    try {
      const big = (i: number): SandboxRec => ({ ...sandbox('t', `sb-${i}`), labels: { pad: 'x'.repeat(60_000) } });
      let err: unknown;
      for (let i = 0; i < 200 && err === undefined; i++) err = await s.commitAt([{ kind: 'sandbox', value: big(i), expectRevision: 0 }]).then(() => undefined, (e: unknown) => e);
      expect(err).toBeInstanceOf(StoreFullError);
      expect(err).toMatchObject({ kind: 'resource_exhausted', retryable: false });
      expect((err as Error).message).toMatch(/database space is exceeded/);
      // Reads still work.
      expect((await s.getSandbox('t', 'sb-0'))?.value.id).toBe('sb-0');
    } finally {
      s.close();
      await small.stop();
    }
  }, 60_000);

  it('aWatchResumingFromAnOldRevision_andAListPage_overTheDefault4MiBMessage_deliverEveryRecord', async () => {
    // 40 records of ~120 KiB (hooks and labels at the API's caps make records of ~14 KiB; the
    // same bytes in fewer keys keep the test short), one revision each: a watch from before
    // them gets them all in one etcd answer (~9.6 MiB with the previous values), and the list
    // in one page. grpc-js's default receive limit is 4 MiB.
    const fat = (i: number, v: number): SandboxRec => ({ ...sandbox('fat', `sb-fat${i}`), labels: { pad: String(v).repeat(120_000) } });
    const from = await store.revision();
    for (let i = 0; i < 40; i++) await store.commit([{ kind: 'sandbox', value: fat(i, 1) }]);
    for (let i = 0; i < 40; i++) await store.commit([{ kind: 'sandbox', value: fat(i, 2) }]);
    const seen: number[] = [];
    let broke: unknown;
    const stop = await store.watchRecords((c) => void (c.kind === 'sandbox' && c.value.tenantId === 'fat' && seen.push(c.revision)), { fromRevision: from + 1, onError: (e) => void (broke = e) });
    try {
      await waitFor('every change of the 80 writes', async () => seen.length >= 80 || broke !== undefined, 20_000, 50);
      expect(broke).toBeUndefined();
      expect(seen).toHaveLength(80);
    } finally {
      stop();
    }
    expect((await store.listSandboxes('fat')).map((v) => v.value.labels.pad?.[0])).toEqual(Array(40).fill('2'));
  }, 60_000);

  it('aCallToAMemberThatWentSilent_failsRetryably_withinTheCallDeadline', async () => {
    // A member powered off or cut off sends no reset: the call used to wait until TCP gave up.
    const relay = await freezableRelay(etcd.endpoints[0]!);
    const deadlineMs = 2000; // ETCD_CALL_DEADLINE_MS, shortened for the test
    const s = EtcdFleetStore.connect([relay.url], undefined, '', deadlineMs);
    try {
      await s.getSandbox('t', 'warm-up');
      relay.freeze();
      const t0 = Date.now();
      expect(await s.getSandbox('t', 'sb').catch((e: unknown) => e)).toBeInstanceOf(StoreUnavailableError);
      // etcd3 makes a call up to 4 times (its retry policy) before it fails.
      expect(Date.now() - t0).toBeLessThan(4 * deadlineMs + 3000);
    } finally {
      s.close();
      await relay.close();
    }
  }, 60_000);

  it('aSingleMember_backFromARestart_answersTheNextCall_notAfterACircuitBreakersWait', async () => {
    // etcd3's per-member circuit breaker would fail every call for 5 s after three failures,
    // with no other member to send them to.
    const one = await startEtcd();
    const s = EtcdFleetStore.connect(one.endpoints);
    try {
      await s.getSandbox('t', 'warm-up');
      await one.members[0]!.proc.stop();
      for (let i = 0; i < 4; i++) expect(await s.getSandbox('t', 'sb').catch((e: unknown) => e)).toBeInstanceOf(StoreUnavailableError);
      await one.members[0]!.restart();
      expect(await s.getSandbox('t', 'sb')).toBeUndefined();
      expect(await s.commitAt([{ kind: 'sandbox', value: sandbox('t', 'sb'), expectRevision: 0 }])).toBeGreaterThan(0);
    } finally {
      s.close();
      await one.stop();
    }
  }, 60_000);

  it('commit_ofAGuardedOpDeleteWithItsKey_deletesBothOnlyWhileTheOpIsUnchanged', async () => {
    const op = (id: string, state: OperationRec['state']): OperationRec => ({ id, tenantId: 'del', kind: 'create', targetId: 'x', state, input: {}, result: null, error: null, progress: { done: 0, total: 1, message: '', bytesTransferred: 0 }, steps: {}, createdAt: 0, updatedAt: 0, idempotencyKey: `key-${id}` });
    const rev = await store.commitAt([{ kind: 'op', value: op('op-d1', 'succeeded') }, { kind: 'idem', tenantId: 'del', key: 'key-op-d1', opId: 'op-d1' }]);
    // A stale guard (the op changed since it was read): nothing is deleted.
    await store.commit([{ kind: 'op', value: op('op-d1', 'failed') }]);
    expect(await store.commit([{ kind: 'delete-op', tenantId: 'del', id: 'op-d1', expectRevision: rev }, { kind: 'delete-idem', tenantId: 'del', key: 'key-op-d1' }])).toBe(false);
    expect(await store.getIdempotent('del', 'key-op-d1')).toBe('op-d1');
    const cur = (await store.getOp('del', 'op-d1'))!;
    expect(await store.commit([{ kind: 'delete-op', tenantId: 'del', id: 'op-d1', expectRevision: cur.modRevision }, { kind: 'delete-idem', tenantId: 'del', key: 'key-op-d1' }])).toBe(true);
    expect(await store.getOp('del', 'op-d1')).toBeUndefined();
    expect(await store.getIdempotent('del', 'key-op-d1')).toBeUndefined();
  }, 30_000);

  it('quotaLedger_afterEachWrite_matchesTheUsageListedFromTheRecords', async () => {
    // The ledger against a real etcd: each answer, asked as soon as a commit returned, counts
    // exactly what listing the records does (the barrier's wait itself is unit-tested: on
    // loopback the watch event is usually in before the answer's revision read returns).
    const ledger = new QuotaLedger({ store });
    const tenant = 'ledger';
    const listed = async () => {
      const u = usageOf((await store.listSandboxes(tenant)).map((v) => v.value), (await store.listSnapshots(tenant)).map((v) => v.value));
      return { sandboxes: u.sandboxes, memoryMib: u.memoryMib, snapshotBytes: u.snapshotBytes };
    };
    const states: SandboxRec['state'][] = ['pending', 'starting', 'running', 'paused', 'hibernated', 'destroyed', 'failed', 'lost'];
    // Its first answers may be undefined while it starts (it answers no later than its barrier).
    const first = Date.now();
    let u0 = await ledger.usage(tenant);
    while (u0 === undefined && Date.now() - first < 10_000) u0 = await new Promise((r) => setTimeout(r, 50)).then(() => ledger.usage(tenant));
    expect(u0).toMatchObject(await listed());
    for (let i = 0; i < 40; i++) {
      const id = `sb-l${i % 7}`;
      const w: StoreWrite =
        i % 5 === 4
          ? { kind: 'delete-sandbox', tenantId: tenant, id }
          : { kind: 'sandbox', value: { ...sandbox(tenant, id), state: states[(i * 3) % states.length]!, resources: { vcpus: 1, memoryMib: 64 * (1 + (i % 4)), diskMib: 0 } } };
      const writes: StoreWrite[] = [w];
      if (i % 6 === 0) writes.push({ kind: 'snapshot', value: { id: `sn-l${i}`, tenantId: tenant, state: i % 12 === 0 ? 'ready' : 'deleted', storedBytes: 1000 + i } as never });
      await store.commit(writes);
      const u = await ledger.usage(tenant);
      expect(u, `after write ${i}`).toMatchObject(await listed());
    }
    ledger.stop();
  }, 30_000);

  it('followRecords_listsThenFollowsEveryKind_andReportsTheRevisionOfEachChange', async () => {
    await store.commit([{ kind: 'sandbox', value: sandbox('fr', 'sb-fr1') }]);
    const seen: string[] = [];
    let revision = 0;
    const stop = await store.followRecords(
      (c) => c.key.startsWith('fr/') && seen.push(`${c.kind}:${c.key}:${c.value ? 'put' : 'delete'}`),
      (r) => (revision = r),
      () => undefined,
    );
    expect(seen).toEqual(['sandbox:fr/sb-fr1:put']);
    const op: OperationRec = { id: 'op-fr', tenantId: 'fr', kind: 'fork', targetId: 'x', state: 'pending', input: {}, result: null, error: null, progress: { done: 0, total: 1, message: '', bytesTransferred: 0 }, steps: {}, createdAt: 0, updatedAt: 0 };
    const rev = await store.commitAt([{ kind: 'op', value: op }, { kind: 'delete-sandbox', tenantId: 'fr', id: 'sb-fr1' }, { kind: 'alloc', value: { hostId: 'h-fr', allocated: { vcpus: 0, memoryMib: 0, diskMib: 0 }, sandboxes: 0 } }]);
    await waitFor('the changes', () => Promise.resolve(revision >= rev), 5_000, 10);
    expect(seen.sort()).toEqual(['op:fr/op-fr:put', 'sandbox:fr/sb-fr1:delete', 'sandbox:fr/sb-fr1:put'].sort());
    stop();
  }, 30_000);

  it('deliveryLog_remove_deletesJustTheNamedRecords_inBatchesOverTheTxnLimit', async () => {
    const log = new EtcdDeliveryLog(store.etcd);
    const rec = (id: string): DeliveryRec => ({ id, url: 'http://127.0.0.1:1/x', tenantId: 't1', eventType: 'snapshot_created', revision: 1, body: '{}', state: 'delivered', attempts: 1, lastStatus: 204, lastError: '', createdAt: 0, updatedAt: 0, nextAttemptAt: 0, deliveredAt: 0 });
    const ids = Array.from({ length: 250 }, (_, i) => `dl-${i}`);
    for (const id of ids) expect(await log.create(rec(id))).toBe(true);
    await log.remove(ids.slice(0, 240));
    expect((await log.list({})).map((r) => r.id).sort()).toEqual(ids.slice(240).sort());
  }, 30_000);

  it('watchOps_withOnly_deliversJustTheAcceptedOps', async () => {
    const seen: string[] = [];
    const stop = await store.watchOps((op) => seen.push(op.id), { only: (tenantId, id) => tenantId === 't1' && id.endsWith('-a') });
    const op = (tenantId: string, id: string): OperationRec => ({ id, tenantId, kind: 'create', targetId: 'x', state: 'pending', input: {}, result: null, error: null, progress: { done: 0, total: 1, message: '', bytesTransferred: 0 }, steps: {}, createdAt: 0, updatedAt: 0 });
    await store.commit([{ kind: 'op', value: op('t1', 'op-a') }, { kind: 'op', value: op('t1', 'op-b') }, { kind: 'op', value: op('t2', 'op-a') }]);
    await waitFor('the op event', () => Promise.resolve(seen.length > 0), 5_000, 10);
    await sleep(200);
    expect(seen).toEqual(['op-a']);
    stop();
  }, 30_000);

  it('commit_overEtcdsLimits_failsAsANamedErrorThatIsNotRetryable_andWritesNothing', async () => {
    const rec = (id: string, pad = 0): StoreWrite => ({ kind: 'sandbox', value: sandboxRecord({ id, tenantId: 'lim', lineageId: id, hostname: id, labels: pad ? { pad: 'x'.repeat(pad) } : {}, afterResume: [], allowCidrs: [] }) });
    // Over --max-txn-ops (1024 here, as in the fleet): 1,100 writes of ~0.7 KiB.
    const many = await store.commit(Array.from({ length: 1100 }, (_, i) => rec(`sb-${i}`))).catch((e: unknown) => e);
    expect(many).toBeInstanceOf(StoreLimitError);
    expect(many).toMatchObject({ kind: 'failed_precondition', retryable: false, limit: '--max-txn-ops' });
    // Over --max-request-bytes (1.5 MiB): etcd's own refusal, and, past it by more than 512 KiB,
    // etcd's gRPC server's (RESOURCE_EXHAUSTED, which etcd3 took for a full store).
    for (const pad of [1_700_000, 2_600_000]) {
      const big = await store.commit([rec('sb-big', pad)]).catch((e: unknown) => e);
      expect(big).toBeInstanceOf(StoreLimitError);
      expect(big).toMatchObject({ kind: 'failed_precondition', retryable: false, limit: '--max-request-bytes' });
    }
    const twice = await store.commit([rec('sb-twice'), rec('sb-twice')]).catch((e: unknown) => e);
    expect(twice).toBeInstanceOf(StoreDuplicateKeyError);
    expect(twice).toMatchObject({ kind: 'internal', retryable: false });
    expect(await store.listSandboxes('lim')).toEqual([]);
    // The store still answers (no member's circuit opened by the refusals).
    expect(await store.commit([rec('sb-after')])).toBe(true);
  }, 60_000);

  it('checkTxnOps_passesAtEtcdsLimit_andNamesTheFlagPastIt', async () => {
    await store.checkTxnOps(1024); // the harness's --max-txn-ops, as the fleet's
    await expect(store.checkTxnOps(1025)).rejects.toMatchObject({ name: 'StoreLimitError', kind: 'failed_precondition', limit: '--max-txn-ops' });
  }, 30_000);
});
