import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { afterEach, describe, expect, it, vi } from 'vitest';
import pino from 'pino';
import { backoffMs, DEFAULT_RETRY, MAX_PENDING_PER_TARGET, MAX_POSTS_PER_URL, MAX_QUEUED_CHANGES, parseWebhookTargets, signWebhook, verifyWebhookSignature, WebhookDispatcher, withoutWebhookUrl } from './webhooks.ts';
import type { DeliveryLog, DeliveryRec, DeliveryState, WebhookPoster } from './webhooks.ts';
import type { FleetStore, RecordChange } from './ports.ts';
import type { SnapshotRec } from './records.ts';
import { fetchPoster } from '../adapters/http/webhook-poster.ts';
import { sandboxRecord } from '../testkit/records.ts';

const SECRET = 'a-secret-of-enough-length';

class MemoryLog implements DeliveryLog {
  readonly recs = new Map<string, DeliveryRec>();
  cur = 0;
  /** The next create throws (etcd unavailable), writing nothing. */
  failNextCreate = false;
  /** So many next updates, and lists, throw (etcd unavailable). */
  failUpdates = 0;
  failLists = 0;
  cursorWrites = 0;
  async get(id: string) {
    return this.recs.get(id);
  }
  async cursor() {
    return this.cur;
  }
  async setCursor(r: number) {
    this.cursorWrites++;
    this.cur = r;
  }
  async create(rec: DeliveryRec) {
    if (this.failNextCreate) {
      this.failNextCreate = false;
      throw new Error('etcd unavailable');
    }
    if (this.recs.has(rec.id)) return false;
    this.recs.set(rec.id, rec);
    return true;
  }
  async update(rec: DeliveryRec) {
    if (this.failUpdates > 0) {
      this.failUpdates--;
      throw new Error('etcd unavailable');
    }
    this.recs.set(rec.id, rec);
  }
  async list(f: { state?: DeliveryState }) {
    if (this.failLists > 0) {
      this.failLists--;
      throw new Error('etcd unavailable');
    }
    return [...this.recs.values()].filter((r) => !f.state || r.state === f.state);
  }
  async remove(ids: readonly string[]) {
    for (const id of ids) this.recs.delete(id);
  }
}

function sandboxCreated(revision: number, id: string): RecordChange {
  return { kind: 'sandbox', value: sandboxRecord({ id, state: 'starting', updatedAt: 1 }), revision };
}

function snapshotChange(revision: number, prev: Partial<SnapshotRec> | undefined, next: Partial<SnapshotRec>): RecordChange {
  const base = { id: 'sn-1', tenantId: 't1', state: 'ready', sourceSandboxId: 'sb-1', lineageId: 'sb-1' } as SnapshotRec;
  return { kind: 'snapshot', value: { ...base, ...next }, ...(prev ? { prev: { ...base, ...prev } } : {}), revision };
}

interface Received {
  body: string;
  signature: string;
  delivery: string;
}

async function receiver(failFirst: number): Promise<{ url: string; got: Received[]; close: () => Promise<void> }> {
  const got: Received[] = [];
  let calls = 0;
  const srv = createServer((req, res) => {
    let body = '';
    req.on('data', (c: Buffer) => (body += c.toString('utf8')));
    req.on('end', () => {
      calls += 1;
      got.push({ body, signature: String(req.headers['forkfleet-signature']), delivery: String(req.headers['forkfleet-delivery']) });
      res.writeHead(calls <= failFirst ? 503 : 204).end();
    });
  });
  await new Promise<void>((r) => srv.listen(0, '127.0.0.1', () => r()));
  const port = (srv.address() as AddressInfo).port;
  return { url: `http://127.0.0.1:${port}/hook`, got, close: () => new Promise((r) => srv.close(() => r())) };
}

async function until(cond: () => boolean, ms = 5000): Promise<void> {
  const end = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > end) throw new Error('condition not met in time');
    await new Promise((r) => setTimeout(r, 10));
  }
}

describe('webhook signatures', () => {
  it('signature_verifiesForTheSignedBodyOnly', () => {
    const now = 1_800_000_000;
    const h = signWebhook(SECRET, '{"a":1}', now);
    expect(verifyWebhookSignature(SECRET, '{"a":1}', h, now)).toBe(true);
    expect(verifyWebhookSignature(SECRET, '{"a":2}', h, now)).toBe(false);
    expect(verifyWebhookSignature('another-secret-entirely', '{"a":1}', h, now)).toBe(false);
    expect(verifyWebhookSignature(SECRET, '{"a":1}', h, now + 301)).toBe(false);
    expect(verifyWebhookSignature(SECRET, '{"a":1}', 't=x,v1=zz', now)).toBe(false);
  });

  it('backoff_doublesUpToTheCap', () => {
    expect([1, 2, 3, 4].map((n) => backoffMs(n, DEFAULT_RETRY))).toEqual([1000, 2000, 4000, 8000]);
    expect(backoffMs(30, DEFAULT_RETRY)).toBe(DEFAULT_RETRY.maxDelayMs);
  });

  it('targets_badEntriesNameTheField', () => {
    expect(() => parseWebhookTargets('FF_WEBHOOKS', '[{"url":"ftp://x","secret":"0123456789abcdef"}]')).toThrow(/FF_WEBHOOKS\[0\]\.url/);
    expect(() => parseWebhookTargets('FF_WEBHOOKS', '[{"url":"http://x","secret":"short"}]')).toThrow(/FF_WEBHOOKS\[0\]\.secret/);
    expect(() => parseWebhookTargets('FF_WEBHOOKS', '[{"url":"http://x","secret":"0123456789abcdef","types":["nope"]}]')).toThrow(/types/);
    // Anything that would quietly widen a tenant's hook to every tenant's events is refused.
    expect(() => parseWebhookTargets('FF_WEBHOOKS', '[{"url":"http://x","secret":"0123456789abcdef","tenant_id":"t1"}]')).toThrow(/FF_WEBHOOKS\[0\]\.tenant_id: unknown key/);
    expect(() => parseWebhookTargets('FF_WEBHOOKS', '[{"url":"http://x","secret":"0123456789abcdef","tenant":["t1"]}]')).toThrow(/FF_WEBHOOKS\[0\]\.tenant/);
    expect(() => parseWebhookTargets('FF_WEBHOOKS', '[{"url":"http://x","secret":"0123456789abcdef","tenant":""}]')).toThrow(/FF_WEBHOOKS\[0\]\.tenant/);
    expect(() => parseWebhookTargets('FF_WEBHOOKS', '[{"url":"http://x","secret":"0123456789abcdef","types":"sandbox_created"}]')).toThrow(/FF_WEBHOOKS\[0\]\.types/);
    expect(() => parseWebhookTargets('FF_WEBHOOKS', '["http://x"]')).toThrow(/FF_WEBHOOKS\[0\]/);
    // URLs fetch refuses, or whose credentials would land in each failed delivery's error.
    expect(() => parseWebhookTargets('FF_WEBHOOKS', '[{"url":"http://[::1","secret":"0123456789abcdef"}]')).toThrow(/FF_WEBHOOKS\[0\]\.url/);
    expect(() => parseWebhookTargets('FF_WEBHOOKS', '[{"url":"http://user:pw@x/h","secret":"0123456789abcdef"}]')).toThrow(/FF_WEBHOOKS\[0\]\.url: must not carry a user name or password/);
    // Two targets of one url and tenant would share their deliveries (and one secret).
    expect(() => parseWebhookTargets('FF_WEBHOOKS', '[{"url":"http://x/h","secret":"0123456789abcdef","types":["sandbox_created"]},{"url":"http://x/h","secret":"fedcba9876543210","types":["sandbox_created","sandbox_destroyed"]}]')).toThrow(/FF_WEBHOOKS\[1\]: has the url and tenant of FF_WEBHOOKS\[0\]/);
    expect(() => parseWebhookTargets('FF_WEBHOOKS', '[{"url":"http://x/h","secret":"0123456789abcdef"},{"url":"http://x/h","secret":"fedcba9876543210","types":["sandbox_destroyed"]}]')).toThrow(/FF_WEBHOOKS\[1\]: has the url and tenant of FF_WEBHOOKS\[0\]/);
    // Types that do not overlap: each event goes to the one target of its type.
    expect(parseWebhookTargets('FF_WEBHOOKS', '[{"url":"http://x/h","secret":"0123456789abcdef","types":["sandbox_created"]},{"url":"http://x/h","secret":"fedcba9876543210","types":["sandbox_destroyed"]}]')).toHaveLength(2);
    expect(parseWebhookTargets('FF_WEBHOOKS', '[{"url":"http://x/h","secret":"0123456789abcdef","tenant":"t1","types":["snapshot_expired"]}]')).toEqual([
      { url: 'http://x/h', secret: '0123456789abcdef', tenantId: 't1', types: ['snapshot_expired'] },
    ]);
  });
});

describe('WebhookDispatcher', () => {
  const cleanups: Array<() => Promise<void>> = [];
  afterEach(async () => {
    for (const c of cleanups.splice(0)) await c();
  });

  async function dispatcherWith(failFirst: number, types: string[] = [], over: { retentionMs?: number; log?: MemoryLog; now?: () => number; targets?: (url: string) => object[]; poster?: WebhookPoster; logger?: pino.Logger } = {}) {
    const rx = await receiver(failFirst);
    const log = over.log ?? new MemoryLog();
    // The store's history: a watch from a revision replays what came since, then follows.
    const history: RecordChange[] = [];
    let watching: ((ch: RecordChange) => void) | undefined;
    const emit = (ch: RecordChange): void => {
      history.push(ch);
      watching?.(ch);
    };
    const d = new WebhookDispatcher({
      store: {
        revision: async () => history.at(-1)?.revision ?? 0,
        watchRecords: async (cb, opts) => {
          const from = opts?.fromRevision;
          if (from !== undefined) for (const ch of history.filter((c) => c.revision >= from)) cb(ch);
          watching = cb;
          return () => {
            if (watching === cb) watching = undefined;
          };
        },
      },
      deliveries: log,
      poster: over.poster ?? fetchPoster,
      clock: { now: over.now ?? (() => Date.now()) },
      log: over.logger ?? pino({ level: 'silent' }),
      targets: parseWebhookTargets('t', JSON.stringify(over.targets?.(rx.url) ?? [{ url: rx.url, secret: SECRET, types }])),
      retry: { maxAttempts: 4, baseDelayMs: 20, maxDelayMs: 100, timeoutMs: 2000 },
      ...(over.retentionMs ? { retentionMs: over.retentionMs } : {}),
    });
    await d.start();
    cleanups.push(async () => {
      await d.stop();
      await rx.close();
    });
    return { rx, log, d, emit };
  }

  it('stopWhileStartStillLists_startSchedulesNothingAndOpensNoWatch', async () => {
    // Leadership lost while the new leader was still listing the delivery log: the replica
    // that no longer leads must not deliver, nor follow the events.
    const rx = await receiver(0);
    cleanups.push(() => rx.close());
    const log = new MemoryLog();
    log.recs.set('waiting', { id: 'waiting', url: rx.url, tenantId: 't1', eventType: 'snapshot_created', revision: 1, body: '{}', state: 'pending', attempts: 0, lastStatus: 0, lastError: '', createdAt: 0, updatedAt: 0, nextAttemptAt: 0, deliveredAt: null });
    let release!: () => void;
    const listed = new Promise<void>((r) => (release = r));
    const list = log.list.bind(log);
    log.list = async (f) => {
      await listed;
      return list(f);
    };
    let watches = 0;
    const d = new WebhookDispatcher({
      store: {
        revision: async () => 0,
        watchRecords: async () => {
          watches++;
          return () => undefined;
        },
      },
      deliveries: log,
      poster: fetchPoster,
      clock: { now: () => Date.now() },
      log: pino({ level: 'silent' }),
      targets: parseWebhookTargets('t', JSON.stringify([{ url: rx.url, secret: SECRET }])),
      retry: { maxAttempts: 4, baseDelayMs: 20, maxDelayMs: 100, timeoutMs: 2000 },
      retentionMs: 1000,
    });
    const starting = d.start();
    await d.stop();
    release();
    await starting;
    await new Promise((r) => setTimeout(r, 300));
    expect(watches).toBe(0);
    expect(rx.got).toHaveLength(0);
    expect(log.recs.get('waiting')?.state).toBe('pending');
  });

  it('expire_deletesDeliveredAndFailedRecordsPastTheRetention_andKeepsPendingAndRecentOnes', async () => {
    let now = 1_000_000;
    const log = new MemoryLog();
    const rec = (id: string, state: DeliveryState, updatedAt: number): DeliveryRec => ({ id, url: 'http://127.0.0.1:1/x', tenantId: 't1', eventType: 'snapshot_created', revision: 1, body: '{}', state, attempts: 1, lastStatus: 204, lastError: '', createdAt: 0, updatedAt, nextAttemptAt: now + 3_600_000, deliveredAt: null });
    // From an earlier leader: listed at start.
    for (const r of [rec('old-delivered', 'delivered', now - 5000), rec('old-failed', 'failed', now - 5000), rec('recent', 'delivered', now - 10), rec('waiting', 'pending', now - 5000)]) log.recs.set(r.id, r);
    const { d } = await dispatcherWith(0, [], { retentionMs: 1000, log, now: () => now });
    expect(await d.expire()).toBe(2);
    expect([...log.recs.keys()].sort()).toEqual(['recent', 'waiting']);
    now += 2000;
    expect(await d.expire()).toBe(1);
    expect([...log.recs.keys()]).toEqual(['waiting']);
  });

  it('expire_ofARecordThisLeaderDelivered_deletesItAfterTheRetention', async () => {
    let now = Date.now();
    const { log, d, emit } = await dispatcherWith(0, [], { retentionMs: 1000, now: () => now });
    emit(snapshotChange(7, undefined, {}));
    await until(() => [...log.recs.values()].some((r) => r.state === 'delivered'));
    expect(await d.expire()).toBe(0);
    now += 1001;
    expect(await d.expire()).toBe(1);
    expect(log.recs.size).toBe(0);
  });

  it('failingReceiver_getsRetriesUntilItAccepts_andTheDeliveryIsRecorded', async () => {
    const { rx, log, emit } = await dispatcherWith(2);
    emit(snapshotChange(7, undefined, {}));
    await until(() => [...log.recs.values()].some((r) => r.state === 'delivered'));
    const rec = [...log.recs.values()][0]!;
    expect(rec).toMatchObject({ state: 'delivered', attempts: 3, lastStatus: 204, eventType: 'snapshot_created', revision: 7 });
    expect(rx.got).toHaveLength(3);
    // Every attempt is the same delivery, signed over the exact body.
    expect(new Set(rx.got.map((g) => g.delivery))).toEqual(new Set([rec.id]));
    for (const g of rx.got) expect(verifyWebhookSignature(SECRET, g.body, g.signature, Math.floor(Date.now() / 1000))).toBe(true);
    expect(JSON.parse(rx.got[0]!.body)).toMatchObject({ type: 'snapshot_created', snapshotId: 'sn-1', tenantId: 't1' });
    expect(log.cur).toBe(6);
  });

  it('twoTargetsWithOneUrl_anOperatorsAndATenants_eachDeliveryIsSignedWithItsOwnTargetsSecret', async () => {
    const TENANT_SECRET = 'the-tenants-own-secret-0123';
    const { rx, log, emit } = await dispatcherWith(0, [], { targets: (url) => [{ url, secret: SECRET }, { url, secret: TENANT_SECRET, tenant: 't1' }] });
    emit(snapshotChange(7, undefined, {}));
    await until(() => [...log.recs.values()].filter((r) => r.state === 'delivered').length === 2);
    const now = Math.floor(Date.now() / 1000);
    const bySecret = (secret: string) => rx.got.filter((g) => verifyWebhookSignature(secret, g.body, g.signature, now)).length;
    expect([bySecret(SECRET), bySecret(TENANT_SECRET)]).toEqual([1, 1]);
  });

  it('twoTargetsWithOneUrlAndTenant_ofDifferentTypes_eachDeliveryIsSignedWithTheSecretOfItsTypesTarget', async () => {
    const OTHER = 'the-other-targets-secret-0123';
    const { rx, log, emit } = await dispatcherWith(0, [], { targets: (url) => [{ url, secret: SECRET, types: ['sandbox_created'] }, { url, secret: OTHER, types: ['snapshot_created'] }] });
    emit(sandboxCreated(7, 'sb-typed'));
    emit(snapshotChange(8, undefined, {}));
    await until(() => [...log.recs.values()].filter((r) => r.state === 'delivered').length === 2);
    const now = Math.floor(Date.now() / 1000);
    const typeSignedWith = (secret: string) => rx.got.filter((g) => verifyWebhookSignature(secret, g.body, g.signature, now)).map((g) => (JSON.parse(g.body) as { type: string }).type);
    expect([typeSignedWith(SECRET), typeSignedWith(OTHER)]).toEqual([['sandbox_created'], ['snapshot_created']]);
  });

  it('receiverThatNeverAccepts_isMarkedFailedAfterTheLastAttempt', async () => {
    const { rx, log, emit } = await dispatcherWith(100);
    emit(snapshotChange(9, undefined, {}));
    await until(() => [...log.recs.values()].some((r) => r.state === 'failed'));
    expect([...log.recs.values()][0]).toMatchObject({ attempts: 4, lastStatus: 503, lastError: 'HTTP 503' });
    expect(rx.got).toHaveLength(4);
  });

  it('deliveryThatFailsForGood_logsOnlyTheTargetsOrigin_andNoErrorTextKeepsItsSecretPathOrQuery', async () => {
    // Slack-style: the path is the credential; so is a ?token=.
    const url = 'http://127.0.0.1:9/services/T0001/B0002/XXXXsecretXXXX?token=s3cr3t-t0ken';
    const lines: string[] = [];
    const logger = pino({ level: 'warn' }, { write: (l: string) => void lines.push(l) });
    let attempt = 0;
    // A poster whose errors quote the URL, whole or its path.
    const poster: WebhookPoster = {
      post: async (u) => {
        attempt++;
        const p = new URL(u);
        throw new Error(attempt % 2 ? `POST ${u} failed: connect ECONNREFUSED` : `no route to ${p.pathname}${p.search}`);
      },
    };
    const { log, emit } = await dispatcherWith(0, [], { targets: () => [{ url, secret: SECRET }], poster, logger });
    emit(snapshotChange(9, undefined, {}));
    await until(() => [...log.recs.values()].some((r) => r.state === 'failed'));
    const rec = [...log.recs.values()][0]!;
    expect(rec.lastError).toBe('no route to /…');
    const failed = lines.find((l) => l.includes('failed for good'))!;
    expect(JSON.parse(failed)).toMatchObject({ origin: 'http://127.0.0.1:9', deliveryId: rec.id, lastError: 'no route to /…' });
    for (const text of [...lines, ...[...log.recs.values()].map((r) => r.lastError)]) {
      expect(text).not.toContain('XXXXsecretXXXX');
      expect(text).not.toContain('s3cr3t-t0ken');
    }
    expect(withoutWebhookUrl(`POST ${url} failed`, url)).toBe('POST http://127.0.0.1:9/… failed');
    // A short path is no secret, and scrubbing it would mangle other words.
    expect(withoutWebhookUrl('POST http://h/x failed at /x/y', 'http://h/x')).toBe('POST http://h/… failed at /x/y');
  });

  it('expiringAndExpired_areSentOnceAtTheirTransition', async () => {
    const { rx, log, emit } = await dispatcherWith(0, ['snapshot_expiring', 'snapshot_expired']);
    emit(snapshotChange(10, {}, { expiryDueAt: 1000 }));
    emit(snapshotChange(11, { expiryDueAt: 1000 }, { expiryDueAt: 1000, hostIds: ['h2'] }));
    emit(snapshotChange(12, { expiryDueAt: 1000 }, { state: 'deleted', deletedReason: 'expired' }));
    await until(() => [...log.recs.values()].filter((r) => r.state === 'delivered').length === 2);
    expect(rx.got.map((g) => (JSON.parse(g.body) as { type: string }).type).sort()).toEqual(['snapshot_expired', 'snapshot_expiring']);
  });

  it('eventsOfOneTransaction_eachGetTheirOwnDelivery', async () => {
    // A fork's children are written in one transaction: three sandbox_created at one revision.
    const { rx, log, emit } = await dispatcherWith(0, ['sandbox_created']);
    for (const id of ['sb-c1', 'sb-c2', 'sb-c3']) emit(sandboxCreated(9, id));
    await until(() => [...log.recs.values()].filter((r) => r.state === 'delivered').length === 3);
    expect(rx.got.map((g) => (JSON.parse(g.body) as { sandboxId: string }).sandboxId).sort()).toEqual(['sb-c1', 'sb-c2', 'sb-c3']);
    expect(new Set(rx.got.map((g) => g.delivery)).size).toBe(3);
  });

  it('recordThatFails_isRecordedAgainFromTheCursor_andTheCursorNeverPassesIt', async () => {
    const { rx, log, emit } = await dispatcherWith(0, ['sandbox_created']);
    emit(sandboxCreated(5, 'sb-first'));
    await until(() => log.cur === 4);
    // etcd fails the record of revision 7; revision 8 arrives behind it.
    log.failNextCreate = true;
    emit(sandboxCreated(7, 'sb-lost'));
    emit(sandboxCreated(8, 'sb-after'));
    await until(() => [...log.recs.values()].filter((r) => r.state === 'delivered').length === 3);
    expect(rx.got.map((g) => (JSON.parse(g.body) as { sandboxId: string }).sandboxId).sort()).toEqual(['sb-after', 'sb-first', 'sb-lost']);
    expect(log.cur).toBe(7);
  });

  it('recordThatFailsBeforeAnyCursor_isFollowedAgainFromItsOwnRevision', async () => {
    const { rx, log, emit } = await dispatcherWith(0, ['sandbox_created']);
    log.failNextCreate = true;
    emit(sandboxCreated(3, 'sb-very-first'));
    await until(() => [...log.recs.values()].some((r) => r.state === 'delivered'));
    expect(rx.got.map((g) => (JSON.parse(g.body) as { sandboxId: string }).sandboxId)).toEqual(['sb-very-first']);
  });

  it('pendingDeliveryWrittenBehindThisLeadersBack_isAttemptedWhenItsEventIsReplayed', async () => {
    // Its create landed but the answer was lost (or a deposed leader wrote it after this one
    // listed the log): the record is there, pending, and nothing here has scheduled it.
    const log = new MemoryLog();
    const { rx, emit } = await dispatcherWith(0, ['sandbox_created'], { log });
    const first = sandboxCreated(6, 'sb-behind');
    emit(sandboxCreated(5, 'sb-x'));
    await until(() => log.cur === 4);
    const id = [...log.recs.keys()][0]!.replace('sb-x', 'sb-behind').replace(/^5-/, '6-');
    log.recs.set(id, { id, url: rx.url, tenantId: 't1', eventType: 'sandbox_created', revision: 6, body: '{"replayed":true}', state: 'pending', attempts: 1, lastStatus: 0, lastError: 'timeout', createdAt: 0, updatedAt: 0, nextAttemptAt: 0, deliveredAt: null });
    emit(first);
    await until(() => log.recs.get(id)?.state === 'delivered');
    expect(rx.got.filter((g) => g.delivery === id)).toHaveLength(1);
  });
});

/**
 * A store of our own port: a watch from a revision replays what came since, then follows; one
 * from a revision at or below `compactedThrough` is made and then cancelled, as etcd does.
 */
function fakeStore(opts: { compactedThrough?: number; revision?: number } = {}) {
  const history: RecordChange[] = [];
  let watching: ((ch: RecordChange) => void) | undefined;
  let progress: ((revision: number) => void) | undefined;
  let broke: ((e: unknown) => void) | undefined;
  const froms: Array<number | undefined> = [];
  let revision = opts.revision ?? 0;
  const store: Pick<FleetStore, 'watchRecords' | 'revision'> = {
    revision: async () => revision,
    watchRecords: async (cb, o) => {
      const from = o?.fromRevision;
      if (from !== undefined && from <= (opts.compactedThrough ?? 0)) {
        void Promise.resolve().then(() => o?.onError?.(new Error(`watch from revision ${from}: required revision has been compacted`)));
        return () => undefined;
      }
      if (from !== undefined) for (const ch of history.filter((c) => c.revision >= from)) cb(ch);
      watching = cb;
      progress = o?.onProgress;
      broke = o?.onError;
      froms.push(from);
      return () => {
        if (watching === cb) watching = undefined;
      };
    },
  };
  const emit = (ch: RecordChange): void => {
    history.push(ch);
    revision = Math.max(revision, ch.revision);
    watching?.(ch);
  };
  /** A write that is no record change (a host's heartbeat time, or the cursor's own write): only progress. */
  const other = (): number => {
    revision++;
    progress?.(revision);
    return revision;
  };
  /** etcd cancels the current watch (the store names it compacted when its start is, by now). */
  const cancel = (e: unknown): void => broke?.(e);
  return { store, emit, other, cancel, froms, isWatching: () => watching !== undefined };
}

/** A poster of our own port: answers in turn (then 200), and counts the POSTs. */
function fakePoster(answers: Array<number | Promise<number>> = []) {
  const posts: string[] = [];
  return {
    posts,
    post: async (_url: string, _body: string, headers: Record<string, string>) => {
      posts.push(headers['forkfleet-delivery'] ?? '');
      return answers.shift() ?? 200;
    },
  };
}

describe('WebhookDispatcher, with fakes of its ports', () => {
  const stops: Array<() => Promise<void>> = [];
  afterEach(async () => {
    for (const s of stops.splice(0)) await s();
    vi.useRealTimers();
  });

  function dispatcher(store: Pick<FleetStore, 'watchRecords' | 'revision'>, log: MemoryLog, poster: WebhookPoster, over: { types?: string[]; onEventsLost?: (n: number) => void; onStartFailed?: () => void; onAttempt?: (result: 'delivered' | 'retry' | 'failed') => void; now?: () => number } = {}) {
    const d = new WebhookDispatcher({
      store,
      deliveries: log,
      poster,
      clock: { now: over.now ?? (() => Date.now()) },
      log: pino({ level: 'silent' }),
      targets: parseWebhookTargets('t', JSON.stringify([{ url: 'http://hook.test/x', secret: SECRET, types: over.types ?? ['sandbox_created'] }])),
      retry: { maxAttempts: 4, baseDelayMs: 20, maxDelayMs: 100, timeoutMs: 2000 },
      ...(over.onEventsLost ? { onEventsLost: over.onEventsLost } : {}),
      ...(over.onStartFailed ? { onStartFailed: over.onStartFailed } : {}),
      ...(over.onAttempt ? { onAttempt: over.onAttempt } : {}),
    });
    stops.push(() => d.stop());
    return d;
  }

  it('cursorThatEtcdCompactedPast_isMovedToTheCurrentRevision_theLossIsCounted_andLaterEventsAreDelivered', async () => {
    // A leader that ran without webhooks (or etcd's own auto-compaction) compacted through 100;
    // the cursor says 50. Following from 51 is cancelled every time.
    const { store, emit } = fakeStore({ compactedThrough: 100, revision: 150 });
    const log = new MemoryLog();
    log.cur = 50;
    const poster = fakePoster();
    const lost: number[] = [];
    await dispatcher(store, log, poster, { onEventsLost: (n) => lost.push(n) }).start();
    await until(() => log.cur === 150, 3000);
    expect(lost).toEqual([100]); // revisions 51..150
    emit(sandboxCreated(200, 'sb-later'));
    await until(() => poster.posts.length === 1, 3000);
    await until(() => [...log.recs.values()].some((r) => r.revision === 200 && r.state === 'delivered'), 3000);
  });

  it('deliveryADeposedLeaderRecordsAfterTheNewLeaderListedTheLog_andCursorMovedPastIt_isStillAttempted', async () => {
    // The record the deposed leader writes: made by a dispatcher of its own, for revision 6.
    const before = fakeStore();
    const theirs = new MemoryLog();
    await dispatcher(before.store, theirs, fakePoster([500, 500, 500, 500])).start();
    before.emit(sandboxCreated(6, 'sb-behind'));
    await until(() => theirs.recs.size === 1);
    const rec = { ...[...theirs.recs.values()][0]!, state: 'pending' as const, nextAttemptAt: 0 };
    // This leader's store has seen revision 6; the log's cursor is at 4 when it starts. While
    // it lists the log, the deposed leader writes the pending delivery and moves the cursor to 6.
    const { store, emit } = fakeStore();
    emit(sandboxCreated(6, 'sb-behind'));
    const log = new MemoryLog();
    log.cur = 4;
    const list = log.list.bind(log);
    log.list = async (f) => {
      const listed = await list(f);
      log.recs.set(rec.id, rec);
      log.cur = 6;
      return listed;
    };
    const poster = fakePoster();
    await dispatcher(store, log, poster).start();
    // Followed from the cursor it read before the list (5), the event is replayed and the
    // delivery found there is attempted; from 7, nothing would ever attempt it.
    await until(() => log.recs.get(rec.id)?.state === 'delivered', 3000);
    expect(poster.posts).toEqual([rec.id]);
  });

  it('stopAndStartWhileFollowReadsTheCursor_leaveOneWatchOpen_andNoneOnceStopped', async () => {
    const { store } = fakeStore();
    let open = 0;
    const counted: typeof store = {
      revision: store.revision,
      watchRecords: async (cb, o) => {
        const stop = await store.watchRecords(cb, o);
        open++;
        let stopped = false;
        return () => {
          if (!stopped) open--;
          stopped = true;
          stop();
        };
      },
    };
    // Leadership lost and won again while the first start reads the cursor (an etcd blip).
    const log = new MemoryLog();
    let release!: () => void;
    const held = new Promise<void>((r) => (release = r));
    const cursor = log.cursor.bind(log);
    let reads = 0;
    log.cursor = async () => {
      if (reads++ === 0) await held;
      return cursor();
    };
    const d = dispatcher(counted, log, fakePoster());
    const first = d.start();
    await new Promise((r) => setTimeout(r, 20));
    await d.stop();
    await d.start();
    release();
    await first;
    await new Promise((r) => setTimeout(r, 50));
    expect(open).toBe(1);
    await d.stop();
    expect(open).toBe(0);
  });

  it('startWhoseLogCannotBeListed_doesNotReject_andStartsAgainLater', async () => {
    vi.useFakeTimers();
    const { store, emit } = fakeStore();
    const log = new MemoryLog();
    log.failLists = 1;
    const poster = fakePoster();
    let failed = 0;
    const d = dispatcher(store, log, poster, { onStartFailed: () => failed++ });
    await d.start();
    expect(failed).toBe(1);
    await vi.advanceTimersByTimeAsync(1000);
    emit(sandboxCreated(5, 'sb-after-restart'));
    await vi.advanceTimersByTimeAsync(100);
    expect(poster.posts).toHaveLength(1);
    expect([...log.recs.values()].map((r) => r.state)).toEqual(['delivered']);
  });

  it('attemptWhoseRecordWriteFails_isWrittenAgainWithBackoff_andRetriedUntilDelivered', async () => {
    vi.useFakeTimers();
    const { store, emit } = fakeStore();
    const log = new MemoryLog();
    const poster = fakePoster([500, 200]);
    await dispatcher(store, log, poster).start();
    // The first attempt's outcome (HTTP 500, retry) fails to be written once: an etcd blip.
    log.failUpdates = 1;
    emit(sandboxCreated(5, 'sb-blip'));
    await vi.advanceTimersByTimeAsync(1000);
    expect(poster.posts).toHaveLength(2);
    expect([...log.recs.values()]).toMatchObject([{ state: 'delivered', attempts: 2, lastStatus: 200 }]);
  });

  it('reElectedWhileAPostIsInFlight_theEarlierTermsOutcomeIsDropped_oneRetryChainPerDelivery', async () => {
    vi.useFakeTimers();
    const { store, emit } = fakeStore();
    const log = new MemoryLog();
    let answer!: (status: number) => void;
    const poster = fakePoster([new Promise<number>((r) => (answer = r))]);
    const d = dispatcher(store, log, poster);
    await d.start();
    emit(sandboxCreated(5, 'sb-inflight'));
    await vi.advanceTimersByTimeAsync(0);
    expect(poster.posts).toHaveLength(1); // held
    // Leadership lost and won again: the new term lists the pending record and delivers it.
    await d.stop();
    await d.start();
    await vi.advanceTimersByTimeAsync(0);
    expect(poster.posts).toHaveLength(2);
    // The first term's POST answers at last, 500: no retry of it, and the record stays delivered.
    answer(500);
    await vi.advanceTimersByTimeAsync(500);
    expect(poster.posts).toHaveLength(2);
    expect([...log.recs.values()]).toMatchObject([{ state: 'delivered', attempts: 1 }]);
  });

  it('writesThatAreNoRecordChange_moveTheCursorToo_butItsOwnWriteDoesNotMoveItAgain', async () => {
    // An idle fleet: only host records change (heartbeat times). The cursor is the compaction
    // floor, so it must follow them, or etcd's history grows for good.
    const { store, other } = fakeStore({ revision: 100 });
    const log = new MemoryLog();
    log.cur = 100;
    const cursorWrite = log.setCursor.bind(log);
    // The cursor's own write is a store write too, reported as progress like any other.
    log.setCursor = async (r: number) => {
      await cursorWrite(r);
      other();
    };
    await dispatcher(store, log, fakePoster(), { types: ['snapshot_expired'] }).start();
    for (let i = 0; i < 5; i++) other();
    await until(() => log.cur >= 105, 3000);
    // Settled (a write left for later is made within a second), each cursor write is one
    // revision past the value it wrote: nothing more follows.
    await new Promise((r) => setTimeout(r, 1500));
    const [writes, cur] = [log.cursorWrites, log.cur];
    await new Promise((r) => setTimeout(r, 1500));
    expect(log.cursorWrites).toBe(writes);
    expect(log.cur).toBe(cur);
    expect(writes).toBeLessThanOrEqual(3);
  });

  it('aWatchCancelledAfterItPassedChangesOn_followsAgainFromTheCursor_notSkippingToNowAsIfItsCursorWereCompacted', async () => {
    // The leader compacts up to the cursor as it moves, so a watch that has run a while has its
    // start compacted: a cancel then (etcd lost its leader, say) is reported "compacted" too.
    const { store, other, cancel, froms } = fakeStore({ revision: 100 });
    const log = new MemoryLog();
    log.cur = 100;
    let lost = 0;
    await dispatcher(store, log, fakePoster(), { types: ['snapshot_expired'], onEventsLost: (n) => (lost += n) }).start();
    for (let i = 0; i < 3; i++) other();
    await until(() => log.cur > 100, 3000);
    const cursor = log.cur;
    cancel(new Error('watch from revision 101: required revision has been compacted'));
    await until(() => froms.length === 2, 3000);
    expect(froms).toEqual([101, cursor + 1]);
    expect(lost).toBe(0);
  });

  it('changesThatMatchNoTarget_writeTheCursorAtMostOncePerRevision_andItCatchesUpAfterABurst', async () => {
    const { store, emit } = fakeStore({ revision: 100 });
    const log = new MemoryLog();
    log.cur = 100;
    const poster = fakePoster();
    await dispatcher(store, log, poster, { types: ['snapshot_expired'] }).start();
    // 1,000 changes over 10 revisions (transactions of 100 records), none for the one target.
    for (let r = 101; r <= 110; r++) for (let i = 0; i < 100; i++) emit(sandboxCreated(r, `sb-${r}-${i}`));
    // Every revision below the last is complete: the cursor gets there (after at most a second).
    await until(() => log.cur === 109, 3000);
    expect(log.cursorWrites).toBeLessThanOrEqual(10);
    expect(poster.posts).toHaveLength(0);
  });

  it('aBacklogPastMaxQueuedChanges_dropsTheWatch_recordsWhatWasQueued_thenFollowsFromTheCursor_andMakesEveryDeliveryOnce', async () => {
    const { store, emit, froms, isWatching } = fakeStore({ revision: 100 });
    const log = new MemoryLog();
    log.cur = 100;
    // The fleet changes faster than deliveries are recorded: creates wait until released.
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    const create = log.create.bind(log);
    log.create = async (rec) => (await gate, create(rec));
    const poster = fakePoster();
    await dispatcher(store, log, poster).start();
    const n = MAX_QUEUED_CHANGES + 500;
    for (let i = 0; i < n; i++) emit(sandboxCreated(101 + i, `sb-${i}`));
    // Before, all n waited in memory and the watch went on passing more.
    expect(isWatching()).toBe(false);
    release();
    await until(() => poster.posts.length === n, 15_000);
    expect(new Set(poster.posts).size).toBe(n);
    expect(log.recs.size).toBe(n);
    expect(froms.length).toBeGreaterThanOrEqual(2);
    expect(isWatching()).toBe(true);
  }, 30_000);

  it('manyDeliveriesAtOnce_postAtMostMaxPostsPerUrlAtATime_andAllArrive', async () => {
    const { store, emit } = fakeStore({ revision: 100 });
    const log = new MemoryLog();
    log.cur = 100;
    let inFlight = 0;
    let most = 0;
    const posts: string[] = [];
    const poster = {
      posts,
      post: async (_url: string, _body: string, headers: Record<string, string>) => {
        most = Math.max(most, ++inFlight);
        await new Promise((r) => setTimeout(r, 5));
        inFlight--;
        posts.push(headers['forkfleet-delivery'] ?? '');
        return 200;
      },
    };
    await dispatcher(store, log, poster).start();
    // A fork(100): one transaction, 100 children.
    for (let i = 0; i < 100; i++) emit(sandboxCreated(101, `sb-${i}`));
    await until(() => posts.length === 100, 10_000);
    expect(most).toBe(MAX_POSTS_PER_URL);
  });

  it('oneTenantsBacklogAtAUrl_doesNotHoldBackAnotherTenantsEvent_theFreedSlotsGoToTheTenantsInTurn', async () => {
    // The operator's hook gets every tenant's events: t1 forks 200 children, then t2 makes one
    // sandbox. Served in arrival order, t2's event waited for all of t1's.
    const { store, emit } = fakeStore({ revision: 100 });
    const log = new MemoryLog();
    log.cur = 100;
    const posts: string[] = [];
    const poster = {
      posts,
      post: async (_url: string, _body: string, headers: Record<string, string>) => {
        await new Promise((r) => setTimeout(r, 2));
        posts.push(headers['forkfleet-delivery'] ?? '');
        return 200;
      },
    };
    await dispatcher(store, log, poster).start();
    for (let i = 0; i < 200; i++) emit({ kind: 'sandbox', value: sandboxRecord({ id: `sb-${i}`, tenantId: 't1', state: 'starting', updatedAt: 1 }), revision: 101 });
    emit({ kind: 'sandbox', value: sandboxRecord({ id: 'sb-other', tenantId: 't2', state: 'starting', updatedAt: 1 }), revision: 102 });
    await until(() => posts.length === 201, 10_000);
    const at = posts.findIndex((id) => id.includes('-t2-sb-other-'));
    expect(at).toBeGreaterThanOrEqual(0);
    // At most every slot's POST in flight, and one more of t1's, before it.
    expect(at).toBeLessThanOrEqual(MAX_POSTS_PER_URL + 1);
  });

  it('receiverThatHoldsEveryPost_keepsAtMostMaxPendingPerTargetPending_theRestAreRecordedFailedBacklogFullUnsent_andNewOnesArePendingOnceItHasRoom', async () => {
    const { store, emit } = fakeStore({ revision: 100 });
    const log = new MemoryLog();
    log.cur = 100;
    // The receiver holds every POST (until the test lets them go); posts that wait for a slot are not sent.
    const held: Array<(status: number) => void> = [];
    let holding = true;
    const posts: string[] = [];
    const poster = {
      posts,
      post: (_url: string, _body: string, headers: Record<string, string>) => {
        posts.push(headers['forkfleet-delivery'] ?? '');
        return holding ? new Promise<number>((r) => held.push(r)) : Promise.resolve(200);
      },
    };
    const failed: number[] = [];
    await dispatcher(store, log, poster, { onAttempt: (r) => void (r === 'failed' && failed.push(1)) }).start();
    const n = 5 * MAX_PENDING_PER_TARGET;
    // In batches below MAX_QUEUED_CHANGES, each recorded before the next (the cursor reaches it).
    for (let i = 0; i < n; i += 500) {
      for (let j = i; j < i + 500; j++) emit(sandboxCreated(101 + j, `sb-${j}`));
      await until(() => log.cur >= 100 + i + 499, 10_000);
    }
    const byState = (state: DeliveryState): DeliveryRec[] => [...log.recs.values()].filter((r) => r.state === state);
    expect(log.recs.size).toBe(n);
    expect(byState('pending')).toHaveLength(MAX_PENDING_PER_TARGET);
    const full = byState('failed');
    expect(full).toHaveLength(n - MAX_PENDING_PER_TARGET);
    expect(full.every((r) => r.attempts === 0 && /^backlog full/.test(r.lastError) && r.body === '')).toBe(true);
    expect(failed).toHaveLength(n - MAX_PENDING_PER_TARGET);
    // Only the first deliveries are pending (those past the cap were never attempted), and MAX_POSTS_PER_URL are in flight.
    expect(new Set(full.map((r) => r.id)).has(posts[0]!)).toBe(false);
    expect(posts).toHaveLength(MAX_POSTS_PER_URL);
    // The receiver answers again: the backlog drains, and a new event is delivered, not failed.
    holding = false;
    for (const r of held.splice(0)) r(200);
    await until(() => byState('pending').length === 0, 20_000);
    emit(sandboxCreated(101 + n, 'sb-after'));
    await until(() => [...log.recs.values()].some((r) => r.revision === 101 + n && r.state === 'delivered'), 5000);
    expect(byState('delivered')).toHaveLength(MAX_PENDING_PER_TARGET + 1);
  }, 60_000);

  it('deliveryThatWaitsForASlotPastTheFreshnessWindow_isSignedWhenItIsSent_andItsSignatureVerifies', async () => {
    // A slow receiver holds MAX_POSTS_PER_URL POSTs; the next delivery waits 10 minutes for a
    // slot. Signed before it waited, its `t` was past verifyWebhookSignature's 300 s when sent:
    // the receiver answered 401 to it, and to every retry.
    let now = Date.now();
    const { store, emit } = fakeStore({ revision: 100 });
    const log = new MemoryLog();
    log.cur = 100;
    const held: Array<(status: number) => void> = [];
    const verified: boolean[] = [];
    const poster = {
      post: (_url: string, body: string, headers: Record<string, string>) => {
        verified.push(verifyWebhookSignature(SECRET, body, headers['forkfleet-signature'] ?? '', Math.floor(now / 1000)));
        return new Promise<number>((r) => held.push(r));
      },
    };
    await dispatcher(store, log, poster, { now: () => now }).start();
    for (let i = 0; i <= MAX_POSTS_PER_URL; i++) emit(sandboxCreated(101, `sb-${i}`));
    await until(() => held.length === MAX_POSTS_PER_URL && log.recs.size === MAX_POSTS_PER_URL + 1, 5000);
    // Its attempt has begun and waits for a slot.
    await new Promise((r) => setTimeout(r, 50));
    expect(held).toHaveLength(MAX_POSTS_PER_URL);
    now += 10 * 60_000;
    held.shift()!(200);
    await until(() => verified.length === MAX_POSTS_PER_URL + 1, 5000);
    expect(verified).toEqual(new Array<boolean>(MAX_POSTS_PER_URL + 1).fill(true));
    for (const r of held.splice(0)) r(200);
  });

  it('postsWaitingForASlotWhenTheLeaderStops_areNotSent_byTheRunThatStopped', async () => {
    // The next leader lists the same pending deliveries and sends them: a deposed leader that
    // went on sending its backlog as slots freed sent every one twice.
    const { store, emit } = fakeStore({ revision: 100 });
    const log = new MemoryLog();
    log.cur = 100;
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    const posts: string[] = [];
    const poster = {
      posts,
      post: async (_url: string, _body: string, headers: Record<string, string>) => {
        posts.push(headers['forkfleet-delivery'] ?? '');
        await gate;
        return 200;
      },
    };
    const d = dispatcher(store, log, poster);
    await d.start();
    for (let i = 0; i < 40; i++) emit(sandboxCreated(101, `sb-${i}`));
    await until(() => posts.length === MAX_POSTS_PER_URL, 5000);
    await d.stop();
    release();
    await new Promise((r) => setTimeout(r, 200));
    expect(posts).toHaveLength(MAX_POSTS_PER_URL);
  });
});
