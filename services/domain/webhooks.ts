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
// "<t>.<body>")>`, `t` the time the POST is sent. verifyWebhookSignature checks it in constant
// time, with a freshness window.
import { createHash, createHmac, timingSafeEqual } from 'node:crypto';
import type { Logger } from 'pino';
import type { Clock, FleetStore } from './ports.ts';
import { isCompacted } from './ports.ts';
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
  const seen = new Map<string, Array<{ index: number; types: unknown[] }>>();
  return raw.map((r: unknown, i) => {
    if (typeof r !== 'object' || r === null || Array.isArray(r)) throw new InvalidArgumentError(`${field}[${i}]`, 'must be an object {url, secret, tenant?, types?}');
    const o = r as Record<string, unknown>;
    // A misspelt key (`tenant_id`) must not leave `tenant` unset: that means every tenant's events.
    for (const k of Object.keys(o)) if (!TARGET_KEYS.has(k)) throw new InvalidArgumentError(`${field}[${i}].${k}`, 'unknown key; the keys are url, secret, tenant, types');
    const url = typeof o.url === 'string' ? o.url : '';
    // Parsed as fetch will parse it: one it refuses (`http://[::1`) failed every delivery, and
    // credentials in it were written into each failed delivery's error in etcd.
    let parsed: URL | undefined;
    try {
      parsed = /^https?:\/\/[^\s]+$/.test(url) ? new URL(url) : undefined;
    } catch {
      parsed = undefined;
    }
    if (!parsed) throw new InvalidArgumentError(`${field}[${i}].url`, 'must be an http(s) URL');
    if (parsed.username || parsed.password) throw new InvalidArgumentError(`${field}[${i}].url`, 'must not carry a user name or password: deliveries are signed with the secret');
    const secret = typeof o.secret === 'string' ? o.secret : '';
    if (secret.length < 16) throw new InvalidArgumentError(`${field}[${i}].secret`, 'must be at least 16 characters');
    if (o.types !== undefined && !Array.isArray(o.types)) throw new InvalidArgumentError(`${field}[${i}].types`, `must be an array of event types (absent: all); one of ${EVENT_TYPES.join(', ')}`);
    const types = (o.types ?? []) as unknown[];
    for (const t of types) if (!(EVENT_TYPES as readonly unknown[]).includes(t)) throw new InvalidArgumentError(`${field}[${i}].types`, `unknown event type ${JSON.stringify(t)}; one of ${EVENT_TYPES.join(', ')}`);
    // Absent: an operator's hook, every tenant's events. Present: one tenant id.
    if (o.tenant !== undefined && (typeof o.tenant !== 'string' || !TENANT_ID_RE.test(o.tenant))) throw new InvalidArgumentError(`${field}[${i}].tenant`, 'must be a tenant id (absent: every tenant\'s events, an operator\'s hook)');
    const tenantId = (o.tenant as string | undefined) ?? '';
    // A delivery's id names the target by url and tenant (targetKey) and the event's type: two
    // targets alike there whose types overlap (no types: all) would share deliveries, one
    // signed with the other's secret, the other never sent.
    const key = `${url}\0${tenantId}`;
    const earlier = (seen.get(key) ?? []).find((e) => e.types.length === 0 || types.length === 0 || e.types.some((t) => types.includes(t)));
    if (earlier) throw new InvalidArgumentError(`${field}[${i}]`, `has the url and tenant of ${field}[${earlier.index}], and events of the same types: give one target those types instead`);
    seen.set(key, [...(seen.get(key) ?? []), { index: i, types }]);
    return { url, secret, tenantId, types: types as FleetEventType[] };
  });
}

export interface WebhookDispatcherDeps {
  store: Pick<FleetStore, 'watchRecords' | 'revision'>;
  deliveries: DeliveryLog;
  poster: WebhookPoster;
  clock: Clock;
  log: Logger;
  targets: readonly WebhookTarget[];
  retry?: RetryPolicy;
  /** Observability: every finished attempt. */
  onAttempt?: (result: 'delivered' | 'retry' | 'failed') => void;
  /**
   * Observability: etcd compacted away `revisions` store revisions before their events were
   * recorded (they are skipped, and their events never sent).
   */
  onEventsLost?: (revisions: number) => void;
  /** Observability: a start failed (it is tried again while the dispatcher runs). */
  onStartFailed?: () => void;
  /**
   * Delivered and failed delivery records are deleted this long after their last attempt
   * (FF_RECORD_RETENTION, ADR 0017); 0 or absent: kept forever.
   */
  retentionMs?: number;
}

/**
 * The oldest store revision etcd compaction must keep while webhooks are configured: the
 * cursor. A dispatcher replays from cursor + 1, and a change there is told apart from a
 * create by its previous value, which etcd reads at the revision before it (cursor): compacted
 * to cursor + 1, a sandbox destroyed there would come back as sandbox_created (ADR 0017).
 * Undefined: no cursor yet, no floor.
 */
export async function compactionFloor(deliveries: Pick<DeliveryLog, 'cursor'>): Promise<number | undefined> {
  const cursor = await deliveries.cursor();
  return cursor > 0 ? cursor : undefined;
}

/** A change that matches no target moves the cursor at most this often (one etcd write each, ADR 0011). */
const CURSOR_EVERY_MS = 1000;

/**
 * Record changes passed on by the watch and not yet recorded, at most: past it the watch is
 * dropped and followed again from the cursor (which moves only past recorded revisions), so a
 * fleet that changes faster than deliveries are recorded (a fork(256) is 513 events per
 * target) does not queue its changes here without bound, and etcd stops sending them.
 */
export const MAX_QUEUED_CHANGES = 1000;

/** POSTs in flight to one URL, at most: the others wait their turn (a fork(256) made 513 at once, and as many again on each retry round while the receiver was down). */
export const MAX_POSTS_PER_URL = 16;

/**
 * Pending deliveries of one target this leader holds, at most. Past it, a new delivery is
 * recorded `failed` at once, never attempted, its lastError 'backlog full' (and counted as a
 * failed attempt). A receiver that holds each POST for the timeout (or a fleet that changes
 * faster than it answers) let pending records, each with its event's body, pile up in etcd
 * and in the leader's heap without bound, until etcd's quota stopped every tenant's writes.
 * Failed records expire with FF_RECORD_RETENTION like any other. It also bounds the POSTs
 * waiting for a slot of a URL (posting): each is one of its targets' pending deliveries.
 */
export const MAX_PENDING_PER_TARGET = 10_000;

/** First retry of a start that failed; doubling up to START_RETRY_MAX_MS. */
const START_RETRY_MS = 1000;
const START_RETRY_MAX_MS = 60_000;

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

/** The targetKey a delivery id ends with (deliveryId). */
function targetKeyOf(deliveryId: string): string {
  return deliveryId.slice(deliveryId.lastIndexOf('-') + 1);
}

/**
 * A target URL as logs may name it: scheme://host:port only. Its path and query may be the
 * credential (Slack-style hooks, `?token=`), which must not reach the logs.
 */
export function webhookOrigin(url: string): string {
  try {
    return new URL(url).origin;
  } catch {
    return '(not a URL)';
  }
}

/** `text` (a poster's error message, say) with the target URL, or its path and query, replaced by the origin and an ellipsis. */
export function withoutWebhookUrl(text: string, url: string): string {
  const forms = new Set([url]);
  let origin = '';
  try {
    const u = new URL(url);
    origin = u.origin;
    forms.add(u.href);
    // A path or query too short to be a secret is left alone (it would mangle other words).
    for (const part of [`${u.pathname}${u.search}`, u.search]) if (part.length >= 8) forms.add(part);
  } catch {
    // Targets are parsed at start-up (parseWebhookTargets): only the URL as given to scrub.
  }
  let out = text;
  // Longest first: the whole URL before its path alone.
  for (const f of [...forms].sort((a, b) => b.length - a.length)) out = out.split(f).join(f.startsWith('/') || f.startsWith('?') ? '/…' : `${origin}/…`);
  return out;
}

/**
 * The POSTs to one URL: at most MAX_POSTS_PER_URL in flight, the others waiting. A freed slot
 * goes to the tenants with waiting POSTs in turn (round robin), each tenant's in their order:
 * one URL can serve many tenants (an operator's hook gets every tenant's events), and one
 * tenant's backlog (a fork(256) whose receiver is slow) must not hold back another's events.
 */
class UrlSlots {
  private inFlight = 0;
  /** Waiting POSTs by tenant, each told whether to go; the Map's order is the turn (a tenant just served goes last). */
  private readonly waiting = new Map<string, Array<(go: boolean) => void>>();

  /** Resolves true when the POST may go (it holds a slot), false when it was turned away. */
  take(tenantId: string): Promise<boolean> {
    if (this.inFlight < MAX_POSTS_PER_URL) {
      this.inFlight++;
      return Promise.resolve(true);
    }
    return new Promise<boolean>((go) => {
      const q = this.waiting.get(tenantId);
      if (q) q.push(go);
      else this.waiting.set(tenantId, [go]);
    });
  }

  /** A POST ended: its slot goes, as it is, to the next tenant's first waiting POST, else it is freed. True when nothing is left in flight or waiting. */
  pass(): boolean {
    const turn = this.waiting.entries().next();
    if (turn.done) return --this.inFlight === 0;
    const [tenantId, q] = turn.value;
    const go = q.shift()!;
    this.waiting.delete(tenantId);
    if (q.length > 0) this.waiting.set(tenantId, q);
    go(true);
    return false;
  }

  /** Turns every waiting POST away (its run ended). */
  turnAway(): void {
    const waiting = [...this.waiting.values()].flat();
    this.waiting.clear();
    for (const go of waiting) go(false);
  }
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
  /**
   * How many of `owned` are each target's (by targetKey, which ends a delivery's id): at most
   * MAX_PENDING_PER_TARGET, but for pending records a start found in the log.
   */
  private readonly pendingOf = new Map<string, number>();
  /** Targets whose backlog is full, told once until it has room again. */
  private readonly full = new Set<string>();
  /**
   * POSTs in flight to each URL and those waiting for one of its slots (posting), each told
   * whether to go. Each waiting one is a pending delivery of the current run (halt() turns the
   * others away): at most MAX_PENDING_PER_TARGET per target of the URL.
   */
  private readonly posts = new Map<string, UrlSlots>();
  /** The current watch (follow); changes of an older one are not recorded. */
  private generation = 0;
  /** The cursor as last written (or read), and when it was written. */
  private cursorWritten = 0;
  private cursorWrittenAt = 0;
  /** Every revision up to this one has its deliveries recorded (the cursor may lag behind it). */
  private recorded = 0;
  /** A later write of the cursor is due (a change that matched no target did not write it). */
  private cursorLater: NodeJS.Timeout | undefined;

  constructor(private readonly deps: WebhookDispatcherDeps) {
    this.retry = deps.retry ?? DEFAULT_RETRY;
  }

  /**
   * On becoming leader: resume pending deliveries, then follow events from the cursor. A start
   * that fails (etcd failed a read) does not reject: it is logged, counted and tried again
   * until stop(). Webhooks are not worth the leadership: resigning would not mend etcd, every
   * next leader would fail alike (say, a delivery log too large to read), and nothing is lost
   * meanwhile, since compaction keeps the cursor's history (compactionFloor).
   */
  async start(): Promise<void> {
    if (this.deps.targets.length === 0) return;
    this.active = true;
    await this.begin(++this.runs, START_RETRY_MS);
  }

  /**
   * Counts start() and stop() calls, and starts tried again: a start that a stop overtook does
   * nothing more, and an attempt begun in an earlier run keeps no result (the later run lists
   * its record and attempts it itself).
   */
  private runs = 0;

  private async begin(run: number, retryMs: number): Promise<void> {
    this.finished.clear();
    this.owned.clear();
    this.pendingOf.clear();
    this.full.clear();
    try {
      // The cursor is read before the log is listed, not after: a deposed leader that still
      // records a delivery after this list and then moves the cursor past its event would have
      // this leader follow from beyond it, and the pending delivery would have no one to
      // attempt it. From the cursor read first, its event is replayed, and record() takes up
      // the delivery found there.
      const cursor = await this.deps.deliveries.cursor();
      if (run !== this.runs) return;
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
      await this.follow(undefined, cursor);
    } catch (e) {
      if (run !== this.runs || !this.active) return;
      this.deps.log.error({ err: e }, `the webhook dispatcher could not start; trying again in ${retryMs} ms`);
      this.deps.onStartFailed?.();
      // What this run began goes: its timers, its watch, and (a new run) its attempts' results.
      const next = ++this.runs;
      this.halt();
      const t = setTimeout(() => {
        this.timers.delete(t);
        if (next === this.runs) void this.begin(next, Math.min(START_RETRY_MAX_MS, 2 * retryMs));
      }, retryMs);
      t.unref();
      this.timers.add(t);
    }
  }

  /** Stops the watch and every timer (deliveries, expiry, retries). */
  private halt(): void {
    this.generation++;
    this.stopWatch?.();
    this.stopWatch = undefined;
    for (const t of this.timers) clearTimeout(t);
    this.timers.clear();
    this.cursorLater = undefined;
    // POSTs waiting for a slot are of the run that ended (each would be skipped at its turn):
    // turned away now, so re-elections while a receiver hangs do not stack their backlogs here.
    for (const slot of this.posts.values()) slot.turnAway();
  }

  /**
   * Follows record changes from the cursor on. A watch that etcd breaks off is followed again
   * from the cursor a second later, once what was already queued is recorded (the cursor is
   * never compacted away by the leader: ADR 0017). One that etcd cancels because its start was
   * compacted anyway is moved past the loss (skipCompacted).
   */
  private async follow(failedAt?: number, cursorRead?: number): Promise<void> {
    const run = this.runs;
    const cursor = cursorRead ?? (await this.deps.deliveries.cursor());
    // Stopped meanwhile, or stopped and started again: the later run follows on its own.
    if (!this.active || run !== this.runs) return;
    this.cursorWritten = this.recorded = cursor;
    // No cursor yet (nothing recorded since the fleet began): a change whose record failed is
    // followed again from its own revision, not from now.
    const fromRevision = cursor > 0 ? cursor + 1 : failedAt;
    // Changes of this watch are recorded only while it is the current one: after a failed
    // record, the changes queued behind it must not move the cursor past the one that failed.
    const generation = ++this.generation;
    const watch: { stop?: () => void } = {};
    /**
     * Whether this watch passed anything on. The store reports any cancel of a watch whose start
     * is compacted by now as "compacted", and a watch that has run a while has its start
     * compacted by this leader (the floor follows the cursor): only one cancelled before it
     * passed anything on was cancelled for its start, the others follow again from the cursor.
     */
    let delivered = false;
    /** Revisions of the changes passed on and not recorded yet, oldest first (MAX_QUEUED_CHANGES). */
    const queued: number[] = [];
    /** Dropped changes for a backlog past MAX_QUEUED_CHANGES: passes on nothing more. */
    let backlogged = false;
    const again = (e: unknown, what: string, at?: number): void => {
      if (!this.active || generation !== this.generation) return;
      this.generation++;
      watch.stop?.();
      if (this.stopWatch === watch.stop) this.stopWatch = undefined;
      if (at === undefined && fromRevision !== undefined && !delivered && isCompacted(e)) return this.skipCompacted(fromRevision, e);
      this.deps.log.warn({ err: e }, `${what}; following again from the cursor`);
      this.followAgain(at ?? failedAt);
    };
    const stop = await this.deps.store.watchRecords(
      (ch) => {
        delivered = true;
        if (generation !== this.generation || backlogged) return;
        if (queued.length >= MAX_QUEUED_CHANGES) {
          // This watch goes; the changes queued are still recorded (moving the cursor), and
          // the ones after them, from this one on, are followed again from the cursor once
          // they are. Nothing of this watch moves the cursor past this change any more.
          backlogged = true;
          watch.stop?.();
          if (this.stopWatch === watch.stop) this.stopWatch = undefined;
          this.deps.log.warn({ queued: queued.length, revision: ch.revision }, 'webhook deliveries are recorded slower than the fleet changes; following again from the cursor once those queued are recorded');
          this.followAgain(queued[0]);
          return;
        }
        queued.push(ch.revision);
        const events = eventsOf(ch, this.deps.clock.now());
        this.chain = this.chain
          .then(() => (generation === this.generation ? this.record(events, ch.revision) : undefined))
          .catch((e: unknown) => again(e, 'recording webhook deliveries failed', ch.revision))
          .finally(() => void queued.shift());
      },
      {
        ...(fromRevision !== undefined ? { fromRevision } : {}),
        onError: (e) => again(e, 'the event watch broke off'),
        // Every change up to `p` has been passed on (host and alloc writes included, which
        // make no event): once those queued are recorded, the cursor may move there. Without
        // it, a fleet whose only writes were host heartbeats (every 10 s per host) kept the
        // cursor, and so every compaction, where the last sandbox change left it.
        onProgress: (p) => {
          delivered = true;
          if (backlogged) return; // past a change this watch dropped
          this.chain = this.chain.then(() => (generation === this.generation ? this.progressed(p) : undefined)).catch((e: unknown) => this.deps.log.warn({ err: e }, 'writing the webhook cursor failed; the next change writes it'));
        },
      },
    );
    watch.stop = stop;
    if (generation === this.generation && this.active && run === this.runs && !backlogged) {
      // A watch of an earlier generation still open (a follow that overtook it) is followed no
      // more: it goes, not left open for the process's life.
      if (this.stopWatch !== stop) this.stopWatch?.();
      this.stopWatch = stop;
    } else stop();
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

  /**
   * etcd compacted the history from `from` on before its events were recorded (etcd's own
   * --auto-compaction, an operator's compact, a leader that ran without webhooks). A watch
   * from there is cancelled every time, so following again from the cursor would never record
   * another event, and the cursor would hold the leader's compaction back for good. Those
   * events are lost: say so (an error log and onEventsLost), move the cursor to the store's
   * current revision and follow from there. etcd does not say which revision it compacted to,
   * so the changes between that and now are skipped too.
   */
  private skipCompacted(from: number, e: unknown): void {
    this.chain = this.chain
      .then(async () => {
        if (!this.active || this.stopWatch) return;
        const now = await this.deps.store.revision();
        if (!this.active || this.stopWatch) return;
        this.deps.log.error({ err: e, fromRevision: from, toRevision: now }, 'etcd compacted the store history before its webhook events were recorded: the events of these revisions are lost; following from the current revision');
        this.deps.onEventsLost?.(Math.max(0, now - from + 1));
        await this.writeCursor(now);
        await this.follow();
      })
      .catch((err: unknown) => {
        this.deps.log.warn({ err }, 'following the events again failed; trying again');
        if (this.active && !this.stopWatch) this.followAgain(undefined);
      });
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
    this.halt();
    await this.chain;
  }

  private async record(events: FleetEvent[], revision: number): Promise<void> {
    const now = this.deps.clock.now();
    let matched = false;
    for (const ev of events) {
      for (const t of this.deps.targets) {
        if (t.tenantId && t.tenantId !== ev.tenantId) continue;
        if (t.types.length && !t.types.includes(ev.type)) continue;
        matched = true;
        const id = deliveryId(ev, t);
        const body = JSON.stringify({ id, ...ev, time: new Date(ev.time).toISOString() });
        const rec: DeliveryRec = { id, url: t.url, tenantId: ev.tenantId, eventType: ev.type, revision: ev.revision, body, state: 'pending', attempts: 0, lastStatus: 0, lastError: '', createdAt: now, updatedAt: now, nextAttemptAt: now, deliveredAt: null };
        // Past the target's backlog, recorded failed at once (MAX_PENDING_PER_TARGET). A
        // replayed event whose delivery this leader holds already is no new one.
        const key = targetKey(t);
        const backlog = this.pendingOf.get(key) ?? 0;
        const full = backlog >= MAX_PENDING_PER_TARGET && !this.owned.has(id);
        // Without its body: it is never sent, and the record only says what was not.
        if (full) Object.assign(rec, { state: 'failed', body: '', lastError: `backlog full: ${backlog} deliveries to this target are pending (at most ${MAX_PENDING_PER_TARGET}); not attempted` });
        if (await this.deps.deliveries.create(rec)) {
          if (!full) this.schedule(rec, 0);
          else {
            this.noteFinished(rec);
            this.deps.onAttempt?.('failed');
            if (!this.full.has(key)) {
              this.full.add(key);
              this.deps.log.warn({ origin: webhookOrigin(t.url), target: key, pending: backlog }, 'a webhook target has a full backlog of pending deliveries: new ones are recorded failed, unsent, until it has room');
            }
          }
        } else if (!this.owned.has(id) && !this.finished.has(id)) {
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
    const complete = revision - 1;
    this.recorded = Math.max(this.recorded, complete);
    // The cursor is there already: another change of this revision wrote it (a fork's
    // children are one transaction), one write per revision.
    if (complete <= this.cursorWritten) return;
    // A change that matched no target has nothing to replay: it moves the cursor at most every
    // CURSOR_EVERY_MS (a busy fleet made one etcd write per record change). A matching one
    // writes it, so a new leader replays little.
    if (matched || now - this.cursorWrittenAt >= CURSOR_EVERY_MS) await this.writeCursor(complete);
    else this.writeCursorLater();
  }

  /**
   * Every change up to store revision `p` is recorded. The cursor's own write is a change
   * too, reported as progress one revision past the value written: that alone moves nothing,
   * or each cursor write would be followed by another, once a second for good.
   */
  private async progressed(p: number): Promise<void> {
    if (p <= this.cursorWritten + 1) return;
    this.recorded = Math.max(this.recorded, p);
    if (this.deps.clock.now() - this.cursorWrittenAt >= CURSOR_EVERY_MS) await this.writeCursor(p);
    else this.writeCursorLater();
  }

  private async writeCursor(revision: number): Promise<void> {
    this.recorded = Math.max(this.recorded, revision);
    await this.deps.deliveries.setCursor(revision);
    this.cursorWritten = Math.max(this.cursorWritten, revision);
    this.cursorWrittenAt = this.deps.clock.now();
  }

  /**
   * Writes the cursor CURSOR_EVERY_MS from now, as far as the changes recorded by then reach,
   * so that the last changes of a burst do not leave it behind (it is the compaction floor).
   * `recorded` only moves when a change's deliveries are all recorded, in revision order, so
   * it is safe to write whichever watch recorded them.
   */
  private writeCursorLater(): void {
    if (this.cursorLater) return;
    const t = setTimeout(() => {
      this.timers.delete(t);
      if (this.cursorLater === t) this.cursorLater = undefined;
      this.chain = this.chain
        .then(() => (this.active && this.recorded > this.cursorWritten ? this.writeCursor(this.recorded) : undefined))
        .catch((e: unknown) => this.deps.log.warn({ err: e }, 'writing the webhook cursor failed; the next change writes it'));
    }, CURSOR_EVERY_MS);
    t.unref();
    this.timers.add(t);
    this.cursorLater = t;
  }

  private noteFinished(rec: DeliveryRec): void {
    if (this.deps.retentionMs) this.finished.set(rec.id, rec.updatedAt);
  }

  private schedule(rec: DeliveryRec, delayMs: number): void {
    if (!this.active) return;
    const run = this.runs;
    if (!this.owned.has(rec.id)) {
      this.owned.add(rec.id);
      const key = targetKeyOf(rec.id);
      this.pendingOf.set(key, (this.pendingOf.get(key) ?? 0) + 1);
    }
    const t = setTimeout(() => {
      this.timers.delete(t);
      if (run !== this.runs) return;
      void this.attempt(rec, run).catch((e: unknown) => this.deps.log.warn({ err: e, deliveryId: rec.id }, 'webhook attempt bookkeeping failed'));
    }, Math.max(0, delayMs));
    t.unref();
    this.timers.add(t);
  }

  private async attempt(rec: DeliveryRec, run: number): Promise<void> {
    // The target the delivery was made for (its id ends with that target's key): not the first
    // with its URL, which may be another target's with another secret.
    // Targets of one url and tenant have types that do not overlap (parseWebhookTargets): the
    // event's type picks the one.
    const target = this.deps.targets.find((t) => t.url === rec.url && rec.id.endsWith(`-${targetKey(t)}`) && (t.types.length === 0 || t.types.includes(rec.eventType)));
    const now = this.deps.clock.now();
    const next: DeliveryRec = { ...rec, attempts: rec.attempts + 1, updatedAt: now };
    if (!target) {
      Object.assign(next, { state: 'failed', lastError: 'webhook no longer configured' });
      await this.save(next, run);
      return;
    }
    // Signed when its slot comes, not now: behind a backlog at the URL (MAX_POSTS_PER_URL) the
    // wait can pass the receiver's freshness window (verifyWebhookSignature, 300 s), and a stale
    // `t` is refused (401) on every attempt, retries included.
    const headers = (): Record<string, string> => ({
      'content-type': 'application/json',
      'forkfleet-delivery': rec.id,
      'forkfleet-event': rec.eventType,
      'forkfleet-attempt': String(next.attempts),
      'forkfleet-signature': signWebhook(target.secret, rec.body, Math.floor(this.deps.clock.now() / 1000)),
    });
    try {
      const status = await this.posting(rec.url, rec.tenantId, run, () => this.deps.poster.post(rec.url, rec.body, headers(), this.retry.timeoutMs));
      // Stopped (or stopped and started again) while it waited for a slot: not sent by this run.
      if (status === undefined) return;
      next.lastStatus = status;
      next.lastError = next.lastStatus >= 200 && next.lastStatus < 300 ? '' : `HTTP ${next.lastStatus}`;
    } catch (e) {
      next.lastStatus = 0;
      // The message may quote the URL (a poster's own, or a fetch error's cause), and the record is read back and logged.
      next.lastError = withoutWebhookUrl(e instanceof Error ? e.message : String(e), rec.url);
    }
    // Stopped (a new leader retries it), or stopped and started again while this was in flight:
    // that run listed the record and attempts it itself, and a second retry chain here would
    // send it twice more and could write an older outcome over its own.
    if (!this.active || run !== this.runs) return;
    if (!next.lastError) {
      next.state = 'delivered';
      next.deliveredAt = this.deps.clock.now();
      this.deps.onAttempt?.('delivered');
    } else if (next.attempts >= this.retry.maxAttempts) {
      next.state = 'failed';
      this.deps.onAttempt?.('failed');
      // The origin only (the path may be the credential); the delivery id ends with the target's key.
      this.deps.log.warn({ deliveryId: rec.id, origin: webhookOrigin(rec.url), target: targetKey(target), attempts: next.attempts, lastError: next.lastError }, 'webhook delivery failed for good');
    } else {
      next.nextAttemptAt = this.deps.clock.now() + backoffMs(next.attempts, this.retry);
      this.deps.onAttempt?.('retry');
    }
    await this.save(next, run);
  }

  /**
   * Runs `post` (a delivery of `tenantId`'s event) once fewer than MAX_POSTS_PER_URL POSTs to
   * `url` are in flight, its tenant's waiting POSTs in turn with other tenants' (UrlSlots);
   * undefined (not sent) when run `run` has ended by the time its turn comes: a deposed leader
   * would send its whole backlog, which the next leader sends too.
   */
  private async posting<T>(url: string, tenantId: string, run: number, post: () => Promise<T>): Promise<T | undefined> {
    let slot = this.posts.get(url);
    if (!slot) this.posts.set(url, (slot = new UrlSlots()));
    // Turned away (halt): its run ended, and it holds no slot.
    if (!(await slot.take(tenantId))) return undefined;
    try {
      if (!this.active || run !== this.runs) return undefined;
      return await post();
    } finally {
      if (slot.pass()) this.posts.delete(url);
    }
  }

  /**
   * Records an attempt's outcome, then schedules the next attempt or notes the delivery
   * finished. A write that fails (an etcd blip) is tried again with backoff, the outcome kept
   * here meanwhile: else the delivery stayed owned with nothing scheduled, and was never
   * retried while this leader led.
   */
  private async save(next: DeliveryRec, run: number, failures = 0): Promise<void> {
    try {
      await this.deps.deliveries.update(next);
    } catch (e) {
      if (run !== this.runs) return; // a later run (or leader) lists the record again
      const delay = backoffMs(failures + 1, this.retry);
      this.deps.log.warn({ err: e, deliveryId: next.id }, `recording a webhook attempt failed; writing it again in ${delay} ms`);
      const t = setTimeout(() => {
        this.timers.delete(t);
        if (run === this.runs) void this.save(next, run, failures + 1).catch((err: unknown) => this.deps.log.warn({ err, deliveryId: next.id }, 'webhook attempt bookkeeping failed'));
      }, delay);
      t.unref();
      this.timers.add(t);
      return;
    }
    if (run !== this.runs) return;
    if (next.state === 'pending') this.schedule(next, next.nextAttemptAt - this.deps.clock.now());
    else {
      this.disown(next.id);
      this.noteFinished(next);
    }
  }

  /** A delivery this leader held is finished: one fewer pending for its target. */
  private disown(id: string): void {
    if (!this.owned.delete(id)) return;
    const key = targetKeyOf(id);
    const n = (this.pendingOf.get(key) ?? 1) - 1;
    if (n > 0) this.pendingOf.set(key, n);
    else this.pendingOf.delete(key);
    if (n < MAX_PENDING_PER_TARGET && this.full.delete(key)) this.deps.log.info({ target: key, pending: n }, 'webhook target has room for pending deliveries again');
  }
}
