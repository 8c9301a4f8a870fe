// Bounded fleet history in etcd (ADR 0017). Without this the store only grows:
//   - etcd keeps every revision of every key until it is compacted. A committed fork child
//     costs ~2.3 KB of etcd database (bench:placement), so at a few thousand children a
//     second the default 2 GiB backend quota fills within minutes, etcd raises its NOSPACE
//     alarm and refuses every write: the whole fleet stops.
//   - records of destroyed sandboxes and finished operations (and their idempotency keys)
//     were kept forever, and every scan that lists them (leader start, quota admission,
//     ListSandboxes) grew with the fleet's whole past.
// So the leader
//   - compacts etcd every `compactEveryMs` down to the revision it read one interval earlier
//     (at least one interval of history stays, as the Kubernetes API server does it), never
//     past `floor()` (the webhook cursor: events not yet recorded for delivery stay
//     replayable) unless that floor is compacted away already (nothing left to keep);
//   - deletes the records of sandboxes that are destroyed or failed, and of operations that
//     are finished, `retentionMs` after their last change. An operation's idempotency key
//     goes with it: a retry of the same key within the retention window gets the same
//     operation back, a later one starts a new operation. Lost sandboxes are kept (their
//     host may come back, or the user restores them);
//   - deletes the records of snapshots that are deleted or failed `retentionMs` after they
//     became so (every hibernation and every fork of a live sandbox makes a snapshot: their
//     records were the last thing that grew without bound). Ready snapshots are kept: the
//     retention rules (keep-last-N, TTL, pins) decide when they go.
import type { FleetStore, StoreWrite, Versioned } from './ports.ts';
import type { OperationRec, SandboxRec, SandboxState, SnapshotRec, SnapshotState } from './records.ts';
import { isTerminal } from './records.ts';

/** Sandbox states whose records expire: nothing runs, books capacity or can come back. */
export const EXPIRING_SANDBOX_STATES: ReadonlySet<SandboxState> = new Set(['destroyed', 'failed']);

/** Snapshot states whose records expire: no host holds the snapshot for use any more. */
export const EXPIRING_SNAPSHOT_STATES: ReadonlySet<SnapshotState> = new Set(['deleted', 'failed']);

/** What the leader knows of a finished operation, enough to delete it and its key. */
export interface FinishedOp {
  readonly tenantId: string;
  readonly id: string;
  /** The user's idempotency key (absent on records written before it was recorded). */
  readonly idempotencyKey?: string | undefined;
  readonly updatedAt: number;
  readonly modRevision: number;
}

export function finishedOpOf(v: Versioned<OperationRec>): FinishedOp | undefined {
  const op = v.value;
  if (!isTerminal(op.state)) return undefined;
  return { tenantId: op.tenantId, id: op.id, idempotencyKey: op.idempotencyKey, updatedAt: op.updatedAt, modRevision: v.modRevision };
}

/**
 * The deletes that expire records older than `retentionMs` at `now`, each guarded by the
 * revision it was read at (a record changed since is not deleted). At most `max` records.
 * A snapshot's age counts from `endedAt` (records written before that field: from
 * `createdAt`). Pure.
 */
export function expiredRecords(
  records: { sandboxes?: Iterable<Versioned<SandboxRec>>; ops?: Iterable<FinishedOp>; snapshots?: Iterable<Versioned<SnapshotRec>> },
  now: number,
  retentionMs: number,
  max = Infinity,
): { writes: StoreWrite[][]; sandboxes: number; ops: number; snapshots: number } {
  const cutoff = now - retentionMs;
  const writes: StoreWrite[][] = [];
  let nSb = 0;
  let nOps = 0;
  let nSn = 0;
  for (const v of records.sandboxes ?? []) {
    if (writes.length >= max) break;
    const sb = v.value;
    if (!EXPIRING_SANDBOX_STATES.has(sb.state) || sb.updatedAt > cutoff) continue;
    writes.push([{ kind: 'delete-sandbox', tenantId: sb.tenantId, id: sb.id, expectRevision: v.modRevision }]);
    nSb++;
  }
  for (const op of records.ops ?? []) {
    if (writes.length >= max) break;
    if (op.updatedAt > cutoff) continue;
    // The op and its key go together; the key is not guarded (it never changes once written).
    const del: StoreWrite[] = [{ kind: 'delete-op', tenantId: op.tenantId, id: op.id, expectRevision: op.modRevision }];
    if (op.idempotencyKey) del.push({ kind: 'delete-idem', tenantId: op.tenantId, key: op.idempotencyKey });
    writes.push(del);
    nOps++;
  }
  for (const v of records.snapshots ?? []) {
    if (writes.length >= max) break;
    const sn = v.value;
    if (!EXPIRING_SNAPSHOT_STATES.has(sn.state) || (sn.endedAt ?? sn.createdAt) > cutoff) continue;
    writes.push([{ kind: 'delete-snapshot', tenantId: sn.tenantId, id: sn.id, expectRevision: v.modRevision }]);
    nSn++;
  }
  return { writes, sandboxes: nSb, ops: nOps, snapshots: nSn };
}

/** Deletes per transaction: under etcd's default --max-txn-ops of 128 with their guards. */
const PURGE_BATCH = 50;

/**
 * Commits `groups` (each group is one record's deletes) in transactions of up to PURGE_BATCH
 * writes. A transaction whose guards no longer hold (a record changed or went meanwhile) is
 * retried group by group, so one changed record never keeps the others. Returns how many
 * groups were deleted.
 */
export async function commitPurge(store: Pick<FleetStore, 'commit'>, groups: readonly StoreWrite[][]): Promise<number> {
  let deleted = 0;
  for (let i = 0; i < groups.length; ) {
    const batch: StoreWrite[][] = [];
    let n = 0;
    while (i < groups.length && (batch.length === 0 || n + groups[i]!.length <= PURGE_BATCH)) {
      n += groups[i]!.length;
      batch.push(groups[i++]!);
    }
    if (await store.commit(batch.flat())) {
      deleted += batch.length;
      continue;
    }
    for (const g of batch) if (await store.commit(g)) deleted++;
  }
  return deleted;
}

export interface CompactorDeps {
  readonly store: Pick<FleetStore, 'revision' | 'compact'>;
  /** Compaction never goes past this revision (the webhook cursor); undefined: no floor. */
  readonly floor?: () => Promise<number | undefined>;
  /**
   * Whether the store's history at `revision` is compacted away already (a read there fails).
   * A floor there keeps nothing readable, so it is ignored: etcd reports a compaction to an
   * older revision as done, and such a floor (the cursor of a dispatcher that fell behind an
   * outside compaction) would otherwise hold every compaction back for good.
   */
  readonly compactedPast?: (revision: number) => Promise<boolean>;
  readonly onCompacted?: (revision: number) => void;
  /** The floor has held compaction below the revision it would reach for more than an interval. */
  readonly onHeldBack?: (floor: number, wanted: number) => void;
  readonly onError?: (e: unknown) => void;
}

/**
 * Leader-only etcd compaction: every tick, compact to the revision read at the previous
 * tick, so at least one interval of history is always kept (watchers that fall behind by
 * less than that resume where they were).
 */
export class Compactor {
  private timer: NodeJS.Timeout | undefined;
  private previous = 0;
  private busy = false;
  /** Counts start() and stop(): a tick still awaiting when leadership ends does nothing more. */
  private term = 0;
  /** When the floor first held compaction back (0: it does not). */
  private heldSince = 0;

  constructor(
    private readonly deps: CompactorDeps,
    private readonly everyMs: number,
  ) {}

  start(): void {
    if (this.everyMs <= 0 || this.timer) return;
    this.term++;
    this.previous = 0;
    this.heldSince = 0;
    this.timer = setInterval(() => void this.tick(), this.everyMs);
    this.timer.unref();
    void this.tick();
  }

  stop(): void {
    this.term++;
    if (this.timer) clearInterval(this.timer);
    this.timer = undefined;
  }

  /** One step: compacts to the revision the previous step read (bounded by the floor), then reads the current one. Returns the revision compacted to, or 0. */
  async tick(): Promise<number> {
    if (this.busy) return 0;
    this.busy = true;
    const term = this.term;
    try {
      const target = this.previous;
      const now = await this.deps.store.revision();
      if (term !== this.term) return 0;
      this.previous = now;
      if (target <= 0) return 0;
      let floor = this.deps.floor ? await this.deps.floor() : undefined;
      if (term !== this.term) return 0;
      if (floor !== undefined && floor < target && this.deps.compactedPast && (await this.deps.compactedPast(floor))) floor = undefined;
      if (term !== this.term) return 0;
      const to = floor === undefined ? target : Math.min(target, floor);
      // A floor that holds compaction back (webhook events not recorded) lets etcd grow: say so.
      if (to < target) {
        this.heldSince ||= Date.now();
        if (Date.now() - this.heldSince > this.everyMs) this.deps.onHeldBack?.(to, target);
      } else this.heldSince = 0;
      if (to <= 0) return 0;
      await this.deps.store.compact(to);
      this.deps.onCompacted?.(to);
      return to;
    } catch (e) {
      this.deps.onError?.(e);
      return 0;
    } finally {
      this.busy = false;
    }
  }
}
