// The webhook delivery log and dispatcher against a real etcd: a log larger than one etcd
// answer, a cursor that etcd compacted past, and compaction that keeps a replayed change's
// previous value (services/domain/webhooks.ts, ADR 0011 and 0017).
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import pino from 'pino';
import { startEtcd } from '../../testkit/etcd.ts';
import type { EtcdCluster } from '../../testkit/etcd.ts';
import { waitFor } from '../../testkit/proc.ts';
import { sandboxRecord } from '../../testkit/records.ts';
import { EtcdFleetStore } from './store.ts';
import { EtcdDeliveryLog } from './webhook-log.ts';
import { PREFIX } from './keys.ts';
import { compactionFloor, parseWebhookTargets, WebhookDispatcher } from '../../domain/webhooks.ts';
import type { DeliveryRec, WebhookPoster } from '../../domain/webhooks.ts';
import { Compactor } from '../../domain/history.ts';
import { NotLeaderError } from '../../domain/errors.ts';
import { EtcdLeaderElection } from './election.ts';

const DELIVERIES = `${PREFIX}webhooks/deliveries/`;

describe('EtcdDeliveryLog and WebhookDispatcher (real etcd)', () => {
  let etcd: EtcdCluster;
  let store: EtcdFleetStore;
  let log: EtcdDeliveryLog;

  /** A poster of our own port that answers 200 and keeps what it was sent. */
  const poster = (): WebhookPoster & { sent: Array<{ type: string; sandboxId: string; revision: number }> } => {
    const sent: Array<{ type: string; sandboxId: string; revision: number }> = [];
    return {
      sent,
      post: async (_url, body) => {
        sent.push(JSON.parse(body) as { type: string; sandboxId: string; revision: number });
        return 200;
      },
    };
  };
  const dispatcher = (p: WebhookPoster, onEventsLost?: (n: number) => void): WebhookDispatcher =>
    new WebhookDispatcher({
      store,
      deliveries: log,
      poster: p,
      clock: { now: () => Date.now() },
      log: pino({ level: 'silent' }),
      targets: parseWebhookTargets('t', JSON.stringify([{ url: 'http://hook.test/x', secret: 'a-secret-of-enough-length', types: ['sandbox_created', 'sandbox_destroyed'] }])),
      retry: { maxAttempts: 4, baseDelayMs: 20, maxDelayMs: 100, timeoutMs: 2000 },
      ...(onEventsLost ? { onEventsLost } : {}),
    });

  beforeAll(async () => {
    etcd = await startEtcd();
    store = EtcdFleetStore.connect(etcd.endpoints);
    log = new EtcdDeliveryLog(store.etcd);
  }, 60_000);

  afterAll(async () => {
    store?.close();
    await etcd?.stop();
  }, 30_000);

  it('list_ofALogLargerThanOneEtcdAnswer_readsEveryRecord', async () => {
    // 6,000 records of ~1 KB (a fork(256) makes 513 per target): past the client's 4 MiB answer.
    const rec = (i: number): DeliveryRec => ({ id: `big-${String(i).padStart(5, '0')}`, url: 'http://hook.test/x', tenantId: 't1', eventType: 'sandbox_created', revision: i, body: 'x'.repeat(900), state: i % 2 ? 'pending' : 'delivered', attempts: 0, lastStatus: 0, lastError: '', createdAt: 0, updatedAt: 0, nextAttemptAt: 0, deliveredAt: null });
    for (let i = 0; i < 6000; i += 500) {
      await store.etcd.if(`${PREFIX}__never__`, 'Version', '==', 0).then(...Array.from({ length: 500 }, (_, j) => store.etcd.put(DELIVERIES + rec(i + j).id).value(JSON.stringify(rec(i + j))))).commit();
    }
    try {
      const all = await log.list({});
      expect(all).toHaveLength(6000);
      expect(new Set(all.map((r) => r.id)).size).toBe(6000);
      expect(all.map((r) => r.revision)).toEqual(Array.from({ length: 6000 }, (_, i) => i));
      expect(await log.list({ state: 'pending' })).toHaveLength(3000);
    } finally {
      await store.etcd.delete().prefix(DELIVERIES).exec();
    }
  }, 60_000);

  it('dispatcher_whenEtcdCompactedPastItsCursor_skipsToNow_countsTheLoss_andDeliversLaterEvents', async () => {
    await log.setCursor(await store.revision());
    // Changes the dispatcher never saw, then a compaction past them (etcd's own, or a leader's
    // without webhooks).
    for (const id of ['sb-unseen-1', 'sb-unseen-2']) expect(await store.commit([{ kind: 'sandbox', value: sandboxRecord({ id, lineageId: id, hostname: id }) }])).toBe(true);
    const compactedTo = await store.revision();
    await store.compact(compactedTo);
    const p = poster();
    const lost: number[] = [];
    const d = dispatcher(p, (n) => lost.push(n));
    try {
      await d.start();
      // Following from the cursor is cancelled as compacted: the cursor moves on, past the loss.
      await waitFor('the cursor moved past the compaction', async () => (await log.cursor()) >= compactedTo, 10_000, 20);
      expect(lost).toHaveLength(1);
      expect(lost[0]).toBeGreaterThanOrEqual(2);
      expect(await store.commit([{ kind: 'sandbox', value: sandboxRecord({ id: 'sb-later', lineageId: 'sb-later', hostname: 'sb-later' }) }])).toBe(true);
      await waitFor('the later event delivered', async () => (await log.list({ state: 'delivered' })).length === 1, 10_000, 20);
      expect(p.sent.map((e) => [e.type, e.sandboxId])).toEqual([['sandbox_created', 'sb-later']]);
    } finally {
      await d.stop();
    }
  }, 60_000);

  it('compaction_toTheWebhookFloor_keepsAReplayedChangesPreviousValue_soADestroyIsNotSentAsACreate', async () => {
    await log.setCursor(await store.revision());
    const p = poster();
    const first = dispatcher(p);
    await first.start();
    const sb = sandboxRecord({ id: 'sb-replayed', lineageId: 'sb-replayed', hostname: 'sb-replayed' });
    const created = await store.commitAt([{ kind: 'sandbox', value: sb, expectRevision: 0 }]);
    const destroyedAt = await store.commitAt([{ kind: 'sandbox', value: { ...sb, state: 'destroyed', updatedAt: Date.now() }, expectRevision: created }]);
    // Recorded: the cursor is just below the destroy (the revision may have more changes to come).
    await waitFor('the destroy recorded', async () => (await log.cursor()) === destroyedAt - 1, 10_000, 20);
    await first.stop();
    // The leader compacts as the scheduler wires it: never past compactionFloor.
    const compactor = new Compactor({ store, floor: () => compactionFloor(log), compactedPast: (r) => store.compactedPast(r) }, 0);
    await compactor.tick();
    expect(await compactor.tick()).toBeGreaterThan(0);
    // A new leader replays from the cursor: the destroy still has its previous value.
    const next = dispatcher(p);
    try {
      await next.start();
      expect(await store.commit([{ kind: 'sandbox', value: sandboxRecord({ id: 'sb-marker', lineageId: 'sb-marker', hostname: 'sb-marker' }) }])).toBe(true);
      await waitFor('the marker delivered', () => Promise.resolve(p.sent.some((e) => e.sandboxId === 'sb-marker')), 10_000, 20);
      const about = (await log.list({})).filter((r) => r.revision === destroyedAt).map((r) => r.eventType);
      expect(about).toEqual(['sandbox_destroyed']);
      expect(p.sent.filter((e) => e.sandboxId === 'sb-replayed').map((e) => e.type)).toEqual(['sandbox_created', 'sandbox_destroyed']);
    } finally {
      await next.stop();
    }
  }, 60_000);

  const delivery = (id: string, over: Partial<DeliveryRec> = {}): DeliveryRec => ({ id, url: 'http://hook.test/x', tenantId: 't1', eventType: 'sandbox_created', revision: 1, body: '{}', state: 'pending', attempts: 0, lastStatus: 0, lastError: '', createdAt: 0, updatedAt: 0, nextAttemptAt: 0, deliveredAt: null, ...over });

  it('setCursor_neverMovesTheCursorBack_soADeposedLeadersLateWriteLeavesItAndTheCompactionFloor', async () => {
    const at = await store.revision();
    // A deposed leader's log that read the cursor before the new leader moved it, and one
    // that never read it: both write an older revision late.
    const stale = new EtcdDeliveryLog(store.etcd);
    await stale.cursor();
    await log.setCursor(at);
    await stale.setCursor(at - 1);
    await new EtcdDeliveryLog(store.etcd).setCursor(at - 2);
    expect(await log.cursor()).toBe(at);
    expect(await compactionFloor(log)).toBe(at);
    // Forward still moves it, from any of them.
    await stale.setCursor(at + 1);
    expect(await log.cursor()).toBe(at + 1);
    await log.setCursor(at + 2);
    expect(await new EtcdDeliveryLog(store.etcd).cursor()).toBe(at + 2);
  }, 30_000);

  it('update_neverWritesOverAFinishedRecord_norWithAnEarlierAttempt_norBringsBackARemovedOne', async () => {
    const id = 'guarded-1';
    expect(await log.create(delivery(id))).toBe(true);
    await log.update(delivery(id, { attempts: 2, lastError: 'HTTP 503', nextAttemptAt: 5 }));
    // The first attempt's outcome, late.
    await log.update(delivery(id, { attempts: 1, lastError: 'HTTP 502', nextAttemptAt: 2 }));
    expect(await log.get(id)).toMatchObject({ state: 'pending', attempts: 2, lastError: 'HTTP 503' });
    await log.update(delivery(id, { attempts: 3, state: 'delivered', lastStatus: 204, deliveredAt: 7 }));
    // A deposed leader's outcome of the same attempt, late: the delivery stays delivered.
    await log.update(delivery(id, { attempts: 3, lastError: 'HTTP 503', nextAttemptAt: 9 }));
    expect(await log.get(id)).toMatchObject({ state: 'delivered', attempts: 3, deliveredAt: 7 });
    // Retention deleted the finished record: a late write does not bring it back.
    await log.remove([id]);
    await log.update(delivery(id, { attempts: 4, lastError: 'HTTP 503' }));
    expect(await log.get(id)).toBeUndefined();
  }, 30_000);

  it('writes_withTheFenceOfALeadershipThatEnded_failAsNotLeader_andChangeNothing', async () => {
    const election = new EtcdLeaderElection(store.etcd, 'webhook-log-test', 2);
    await election.campaign();
    const fenced = new EtcdDeliveryLog(store.etcd, { fence: () => election.fence() });
    const at = await fenced.cursor();
    expect(await fenced.create(delivery('fenced-1'))).toBe(true);
    expect(await fenced.create(delivery('fenced-1'))).toBe(false);
    await fenced.update(delivery('fenced-1', { attempts: 1, lastError: 'HTTP 503' }));
    await fenced.setCursor(at + 1);
    expect(await log.cursor()).toBe(at + 1);
    await election.resign();
    await expect(fenced.create(delivery('fenced-2'))).rejects.toBeInstanceOf(NotLeaderError);
    await expect(fenced.create(delivery('fenced-1'))).rejects.toBeInstanceOf(NotLeaderError);
    await expect(fenced.update(delivery('fenced-1', { attempts: 2, state: 'delivered' }))).rejects.toBeInstanceOf(NotLeaderError);
    await expect(fenced.setCursor(at + 5)).rejects.toBeInstanceOf(NotLeaderError);
    await expect(fenced.remove(['fenced-1'])).rejects.toBeInstanceOf(NotLeaderError);
    expect(await log.get('fenced-2')).toBeUndefined();
    expect(await log.get('fenced-1')).toMatchObject({ state: 'pending', attempts: 1 });
    expect(await log.cursor()).toBe(at + 1);
  }, 30_000);
});
