// Webhooks: fleet events (services/domain/events.ts) POSTed to user endpoints, signed with
// HMAC-SHA256, retried with exponential backoff, and every delivery recorded in the store.
//
// Only the leader dispatches. Before an event is attempted, its delivery record is written
// (id = revision + type + the record it is about + target, so a re-run never creates a
// second one) and the watch
// cursor advanced; a new leader resumes from the cursor and retries every delivery still
// pending. Delivery is therefore at least once: receivers dedupe on `forkfleet-delivery`.
//
// Signature (header `forkfleet-signature`): `t=<unix seconds>,v1=<hex HMAC-SHA256(secret,
// "<t>.<body>")>`. verifyWebhookSignature checks it in constant time, with a freshness window.
import { createHash, createHmac, timingSafeEqual } from 'node:crypto';
import type { Logger } from 'pino';
import type { Clock, FleetStore } from './ports.ts';
import { EVENT_TYPES, eventsOf } from './events.ts';
import type { FleetEvent, FleetEventType } from './events.ts';
import { InvalidArgumentError } from '../../proto/errors.ts';
import { TENANT_ID_RE } from './records.ts';

export interface WebhookTarget {
  readonly url: string;
  readonly secret: string;
  /** Only this tenant's events; empty: every tenant's (an operator's hook). */
  readonly tenantId: string;
  /** Only these event types; empty: all. */
  readonly types: readonly FleetEventType[];
}

export type DeliveryState = 'pending' | 'delivered' | 'failed';

export interface DeliveryRec {
  id: string;
  url: string;
  tenantId: string;
  eventType: FleetEventType;
  revision: number;
  /** The exact JSON body sent (and signed). */
  body: string;
  state: DeliveryState;
  attempts: number;
  /** HTTP status of the last attempt; 0 when it got no response. */
  lastStatus: number;
  lastError: string;
  createdAt: number;
  updatedAt: number;
  nextAttemptAt: number;
  deliveredAt: number | null;
}

/** Where delivery records and the event cursor live (adapters/etcd/webhook-log.ts). */
export interface DeliveryLog {
  cursor(): Promise<number>;
  setCursor(revision: number): Promise<void>;
  /** Writes the record unless one with its id exists; false when it did. */
  create(rec: DeliveryRec): Promise<boolean>;
  get(id: string): Promise<DeliveryRec | undefined>;
  update(rec: DeliveryRec): Promise<void>;
  list(filter: { state?: DeliveryState }): Promise<DeliveryRec[]>;
  /** Deletes delivery records (delivered or failed ones, which never change again). */
  remove(ids: readonly string[]): Promise<void>;
}

/** Sends one request; resolves with the HTTP status, rejects when there was no response. */
export interface WebhookPoster {
  post(url: string, body: string, headers: Record<string, string>, timeoutMs: number): Promise<number>;
}

export interface RetryPolicy {
  readonly maxAttempts: number;
  readonly baseDelayMs: number;
  readonly maxDelayMs: number;
  readonly timeoutMs: number;
}

export const DEFAULT_RETRY: RetryPolicy = { maxAttempts: 8, baseDelayMs: 1000, maxDelayMs: 5 * 60_000, timeoutMs: 5000 };

/** Delay before attempt `n + 1` after `n` failed attempts. */
export function backoffMs(n: number, p: RetryPolicy): number {
  return Math.min(p.maxDelayMs, p.baseDelayMs * 2 ** Math.max(0, n - 1));
}

export function signWebhook(secret: string, body: string, unixSeconds: number): string {
  const mac = createHmac('sha256', secret).update(`${unixSeconds}.${body}`).digest('hex');
  return `t=${unixSeconds},v1=${mac}`;
}

/** True when `header` is a valid signature of `body` made within `toleranceSeconds` of now. */
export function verifyWebhookSignature(secret: string, body: string, header: string, nowSeconds: number, toleranceSeconds = 300): boolean {
  const parts = new Map(header.split(',').map((kv) => kv.split('=', 2) as [string, string]));
  const t = Number(parts.get('t'));
  const v1 = parts.get('v1') ?? '';
  if (!Number.isInteger(t) || Math.abs(nowSeconds - t) > toleranceSeconds || !/^[0-9a-f]{64}$/.test(v1)) return false;
  const want = Buffer.from(createHmac('sha256', secret).update(`${t}.${body}`).digest('hex'));
  return timingSafeEqual(want, Buffer.from(v1));
}

const TARGET_KEYS: ReadonlySet<string> = new Set(['url', 'secret', 'tenant', 'types']);

/** Parses the FF_WEBHOOKS JSON: `[{url, secret, tenant?, types?}]`. */
export function parseWebhookTargets(field: string, json: string): WebhookTarget[] {
  let raw: unknown;
  try {
    raw = JSON.parse(json);
  } catch (e) {
    throw new InvalidArgumentError(field, `must be JSON: ${(e as Error).message}`);
  }
  if (!Array.isArray(raw)) throw new InvalidArgumentError(field, 'must be a JSON array of {url, secret, tenant?, types?}');
  return raw.map((r: unknown, i) => {
    if (typeof r !== 'object' || r === null || Array.isArray(r)) throw new InvalidArgumentError(`${field}[${i}]`, 'must be an object {url, secret, tenant?, types?}');
    const o = r as Record<string, unknown>;
    // A misspelt key (`tenant_id`) must not leave `tenant` unset: that means every tenant's events.
    for (const k of Object.keys(o)) if (!TARGET_KEYS.has(k)) throw new InvalidArgumentError(`${field}[${i}].${k}`, 'unknown key; the keys are url, secret, tenant, types');
    const url = typeof o.url === 'string' ? o.url : '';
    if (!/^https?:\/\/[^\s]+$/.test(url)) throw new InvalidArgumentError(`${field}[${i}].url`, 'must be an http(s) URL');
    const secret = typeof o.secret === 'string' ? o.secret : '';
    if (secret.length < 16) throw new InvalidArgumentError(`${field}[${i}].secret`, 'must be at least 16 characters');
    if (o.types !== undefined && !Array.isArray(o.types)) throw new InvalidArgumentError(`${field}[${i}].types`, `must be an array of event types (absent: all); one of ${EVENT_TYPES.join(', ')}`);
    const types = (o.types ?? []) as unknown[];
    for (const t of types) if (!(EVENT_TYPES as readonly unknown[]).includes(t)) throw new InvalidArgumentError(`${field}[${i}].types`, `unknown event type ${JSON.stringify(t)}; one of ${EVENT_TYPES.join(', ')}`);
    // Absent: an operator's hook, every tenant's events. Present: one tenant id.
    if (o.tenant !== undefined && (typeof o.tenant !== 'string' || !TENANT_ID_RE.test(o.tenant))) throw new InvalidArgumentError(`${field}[${i}].tenant`, 'must be a tenant id (absent: every tenant\'s events, an operator\'s hook)');
    return { url, secret, tenantId: (o.tenant as string | undefined) ?? '', types: types as FleetEventType[] };
  });
}

export interface WebhookDispatcherDeps {
  store: Pick<FleetStore, 'watchRecords'>;
  deliveries: DeliveryLog;
  poster: WebhookPoster;
  clock: Clock;
  log: Logger;
  targets: readonly WebhookTarget[];
  retry?: RetryPolicy;
  /** Observability: every finished attempt. */
  onAttempt?: (result: 'delivered' | 'retry' | 'failed') => void;
  /**
   * Delivered and failed delivery records are deleted this long after their last attempt
   * (FF_RECORD_RETENTION, ADR 0017); 0 or absent: kept forever.
   */
  retentionMs?: number;
}

/**
 * A delivery's id: the event (revision, type and the record it is about: one transaction
 * writes many records at one revision, e.g. a fork's children) and the target. A re-run of
 * the same change makes the same id, so a replay never creates a second delivery.
 */
function deliveryId(ev: FleetEvent, t: WebhookTarget): string {
  // A snapshot's events also name its source sandbox: the subject is the snapshot.
  const subject = ev.type.startsWith('snapshot_') ? ev.snapshotId : ev.type === 'operation_done' ? ev.operationId : ev.sandboxId;
  return `${ev.revision}-${ev.type}-${ev.tenantId}-${subject}-${targetKey(t)}`;
}

function targetKey(t: WebhookTarget): string {
  return createHash('sha256').update(t.url).update('\0').update(t.tenantId).digest('hex').slice(0, 12);
}

export class WebhookDispatcher {
  private stopWatch: (() => void) | undefined;
  private readonly timers = new Set<NodeJS.Timeout>();
  private chain: Promise<void> = Promise.resolve();
  private active = false;
  private readonly retry: RetryPolicy;
  /**
   * Delivered and failed records, by id, with the time of their last attempt, until they
   * expire. Kept only with a retention (without one nothing expires, and the map would grow
   * with every event).
   */
  private readonly finished = new Map<string, number>();
  /** Pending deliveries this leader has scheduled or is attempting. */
  private readonly owned = new Set<string>();
  /** The current watch (follow); changes of an older one are not recorded. */
  private generation = 0;

  constructor(private readonly deps: WebhookDispatcherDeps) {
    this.retry = deps.retry ?? DEFAULT_RETRY;
  }

  /** On becoming leader: resume pending deliveries, then follow events from the cursor. */
  async start(): Promise<void> {
    if (this.deps.targets.length === 0) return;
    this.active = true;
    const run = ++this.runs;
    this.finished.clear();
    this.owned.clear();
    const listed = await this.deps.deliveries.list({});
    // stop() came while this listed (leadership lost mid-start): nothing is scheduled.
    if (run !== this.runs) return;
    for (const d of listed) {
      if (d.state === 'pending') this.schedule(d, Math.max(0, d.nextAttemptAt - this.deps.clock.now()));
      else this.noteFinished(d);
    }
    const retention = this.deps.retentionMs ?? 0;
    if (retention > 0) {
      const t = setInterval(() => {
        this.chain = this.chain.then(async () => void (await this.expire())).catch((e: unknown) => this.deps.log.warn({ err: e }, 'expiring webhook delivery records failed'));
      }, Math.min(30_000, Math.max(500, retention / 2)));
      t.unref();
      this.timers.add(t);
    }
    await this.follow();
  }

  /** Counts start() and stop() calls: a start that a stop overtook does nothing more. */
  private runs = 0;

  /**
   * Follows record changes from the cursor on. A watch that etcd breaks off is followed again
   * from the cursor a second later, once what was already queued is recorded (the cursor is
   * never compacted away: ADR 0017).
   */
  private async follow(failedAt?: number): Promise<void> {
    const cursor = await this.deps.deliveries.cursor();
    if (!this.active) return; // stopped meanwhile
    // No cursor yet (nothing recorded since the fleet began): a change whose record failed is
    // followed again from its own revision, not from now.
    const fromRevision = cursor > 0 ? cursor + 1 : failedAt;
    // Changes of this watch are recorded only while it is the current one: after a failed
    // record, the changes queued behind it must not move the cursor past the one that failed.
    const generation = ++this.generation;
    const watch: { stop?: () => void } = {};
    const again = (e: unknown, what: string, at?: number): void => {
      if (!this.active || generation !== this.generation) return;
      this.generation++;
      this.deps.log.warn({ err: e }, `${what}; following again from the cursor`);
      watch.stop?.();
      if (this.stopWatch === watch.stop) this.stopWatch = undefined;
      this.followAgain(at ?? failedAt);
    };
    const stop = await this.deps.store.watchRecords(
      (ch) => {
        const events = eventsOf(ch, this.deps.clock.now());
        this.chain = this.chain
          .then(() => (generation === this.generation ? this.record(events, ch.revision) : undefined))
          .catch((e: unknown) => again(e, 'recording webhook deliveries failed', ch.revision));
      },
      {
        ...(fromRevision !== undefined ? { fromRevision } : {}),
        onError: (e) => again(e, 'the event watch broke off'),
      },
    );
    watch.stop = stop;
    if (generation === this.generation && this.active) this.stopWatch = stop;
    else stop();
  }

  /** Follows again from the cursor a second from now, and again after each failure. */
  private followAgain(failedAt: number | undefined): void {
    const t = setTimeout(() => {
      this.timers.delete(t);
      this.chain = this.chain.then(() => (this.active && !this.stopWatch ? this.follow(failedAt) : undefined)).catch((err: unknown) => {
        this.deps.log.warn({ err }, 'following the events again failed; trying again');
        if (this.active && !this.stopWatch) this.followAgain(failedAt);
      });
    }, 1000);
    t.unref();
    this.timers.add(t);
  }

  /** Deletes the delivered and failed records whose last attempt is older than the retention. */
  async expire(): Promise<number> {
    const cutoff = this.deps.clock.now() - (this.deps.retentionMs ?? 0);
    if (!this.active || !this.deps.retentionMs) return 0;
    const due = [...this.finished].filter(([, at]) => at <= cutoff).map(([id]) => id);
    for (let i = 0; i < due.length; i += 100) {
      const ids = due.slice(i, i + 100);
      await this.deps.deliveries.remove(ids);
      for (const id of ids) this.finished.delete(id);
    }
    return due.length;
  }

  async stop(): Promise<void> {
    this.active = false;
    this.runs++;
    this.generation++;
    this.stopWatch?.();
    for (const t of this.timers) clearTimeout(t);
    this.timers.clear();
    await this.chain;
  }

  private async record(events: FleetEvent[], revision: number): Promise<void> {
    const now = this.deps.clock.now();
    for (const ev of events) {
      for (const t of this.deps.targets) {
        if (t.tenantId && t.tenantId !== ev.tenantId) continue;
        if (t.types.length && !t.types.includes(ev.type)) continue;
        const id = deliveryId(ev, t);
        const body = JSON.stringify({ id, ...ev, time: new Date(ev.time).toISOString() });
        const rec: DeliveryRec = { id, url: t.url, tenantId: ev.tenantId, eventType: ev.type, revision: ev.revision, body, state: 'pending', attempts: 0, lastStatus: 0, lastError: '', createdAt: now, updatedAt: now, nextAttemptAt: now, deliveredAt: null };
        if (await this.deps.deliveries.create(rec)) this.schedule(rec, 0);
        else if (!this.owned.has(id) && !this.finished.has(id)) {
          // Written, but not by a create this leader saw succeed (its answer was lost, or a
          // deposed leader wrote it after this one listed the log): nobody here would retry it.
          const there = await this.deps.deliveries.get(id);
          if (there?.state === 'pending') this.schedule(there, Math.max(0, there.nextAttemptAt - now));
          else if (there) this.noteFinished(there);
        }
      }
    }
    // Every revision below this one is complete (changes arrive in revision order); this
    // one may have more changes to come, so a restart replays it (creates are idempotent).
    await this.deps.deliveries.setCursor(revision - 1);
  }

  private noteFinished(rec: DeliveryRec): void {
    if (this.deps.retentionMs) this.finished.set(rec.id, rec.updatedAt);
  }

  private schedule(rec: DeliveryRec, delayMs: number): void {
    if (!this.active) return;
    this.owned.add(rec.id);
    const t = setTimeout(() => {
      this.timers.delete(t);
      void this.attempt(rec).catch((e: unknown) => this.deps.log.warn({ err: e, deliveryId: rec.id }, 'webhook attempt bookkeeping failed'));
    }, delayMs);
    t.unref();
    this.timers.add(t);
  }

  private async attempt(rec: DeliveryRec): Promise<void> {
    // The target the delivery was made for (its id ends with that target's key): not the first
    // with its URL, which may be another target's with another secret.
    const target = this.deps.targets.find((t) => t.url === rec.url && rec.id.endsWith(`-${targetKey(t)}`));
    const now = this.deps.clock.now();
    const next: DeliveryRec = { ...rec, attempts: rec.attempts + 1, updatedAt: now };
    if (!target) {
      Object.assign(next, { state: 'failed', lastError: 'webhook no longer configured' });
      await this.deps.deliveries.update(next);
      this.owned.delete(next.id);
      this.noteFinished(next);
      return;
    }
    const headers = {
      'content-type': 'application/json',
      'forkfleet-delivery': rec.id,
      'forkfleet-event': rec.eventType,
      'forkfleet-attempt': String(next.attempts),
      'forkfleet-signature': signWebhook(target.secret, rec.body, Math.floor(now / 1000)),
    };
    try {
      next.lastStatus = await this.deps.poster.post(rec.url, rec.body, headers, this.retry.timeoutMs);
      next.lastError = next.lastStatus >= 200 && next.lastStatus < 300 ? '' : `HTTP ${next.lastStatus}`;
    } catch (e) {
      next.lastStatus = 0;
      next.lastError = e instanceof Error ? e.message : String(e);
    }
    if (!this.active) return; // a new leader retries it
    if (!next.lastError) {
      next.state = 'delivered';
      next.deliveredAt = this.deps.clock.now();
      this.deps.onAttempt?.('delivered');
    } else if (next.attempts >= this.retry.maxAttempts) {
      next.state = 'failed';
      this.deps.onAttempt?.('failed');
      this.deps.log.warn({ deliveryId: rec.id, url: rec.url, attempts: next.attempts, lastError: next.lastError }, 'webhook delivery failed for good');
    } else {
      next.nextAttemptAt = this.deps.clock.now() + backoffMs(next.attempts, this.retry);
      this.deps.onAttempt?.('retry');
    }
    await this.deps.deliveries.update(next);
    if (next.state === 'pending') this.schedule(next, next.nextAttemptAt - this.deps.clock.now());
    else {
      this.owned.delete(next.id);
      this.noteFinished(next);
    }
  }
}
