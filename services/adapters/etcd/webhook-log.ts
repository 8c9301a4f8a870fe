// Webhook delivery records and the event cursor in etcd (services/domain/webhooks.ts).
//   /ff/v1/webhooks/cursor            last store revision whose events are all recorded
//   /ff/v1/webhooks/deliveries/<id>   DeliveryRec (id = revision-type-tenant-subject-target); delivered and
//                                     failed ones are deleted after FF_RECORD_RETENTION
//
// Every write is guarded, since a deposed leader's write can land late (etcd3 sends a call
// again whose answer was lost, after a new leader has taken over):
// - the cursor only moves forward (setCursor): it is the compaction floor too (compactionFloor);
// - a record is written over only while it is pending, and never by an earlier attempt's
//   outcome (update): a late `pending` must not undo a `delivered`, nor bring back a finished
//   record that retention deleted;
// - with a leader fence (`fence`, the scheduler's election), a write passes only while that
//   election key is still there (NotLeaderError otherwise), as the executor's writes do.
import type { Etcd3, IKeyValue } from 'etcd3';
import type { LeaderFence } from '../../domain/ports.ts';
import type { DeliveryLog, DeliveryRec, DeliveryState } from '../../domain/webhooks.ts';
import { NotLeaderError } from '../../domain/errors.ts';
import { PREFIX } from './keys.ts';
import { readPrefixAt } from './store.ts';

const CURSOR = `${PREFIX}webhooks/cursor`;
const DELIVERIES = `${PREFIX}webhooks/deliveries/`;
/**
 * Records per read of list(): ~0.5 MB at ~1 KB a record. One read of the whole log failed past
 * the client's 4 MiB answer limit (~5,000 records: a fork(256) makes 513 per target), and the
 * leader could then never start its dispatcher.
 */
const LIST_PAGE = 500;

/**
 * Whether `next` may be written over `there`, the record in etcd: only a pending one is written
 * over (a delivered or failed record never changes again), and never by the outcome of an
 * earlier attempt than the one it records.
 */
export function supersedes(next: DeliveryRec, there: DeliveryRec): boolean {
  return there.state === 'pending' && next.attempts >= there.attempts;
}

export class EtcdDeliveryLog implements DeliveryLog {
  /** The cursor as last read or written here, with its mod revision (the guard of its next write). */
  private cursorSeen: { value: number; modRevision: string } | undefined;

  /**
   * `fence`: the leader's fence (LeaderElection.fence), checked by every write; undefined (or
   * a provider that gives none): writes are not fenced.
   */
  constructor(
    private readonly client: Etcd3,
    private readonly opts: { fence?: () => LeaderFence | undefined } = {},
  ) {}

  async cursor(): Promise<number> {
    const kv = (await this.client.get(CURSOR).exec()).kvs[0];
    return this.noteCursor(kv).value;
  }

  private noteCursor(kv: IKeyValue | undefined): { value: number; modRevision: string } {
    const seen = { value: kv ? Number(kv.value.toString('utf8')) : 0, modRevision: kv ? kv.mod_revision : '0' };
    this.cursorSeen = seen;
    return seen;
  }

  /**
   * Moves the cursor to `revision`, unless it is there or past it already: written only over
   * the value it was read at (its mod revision; 0: absent), read again when that changed.
   */
  async setCursor(revision: number): Promise<void> {
    let seen = this.cursorSeen ?? this.noteCursor((await this.client.get(CURSOR).exec()).kvs[0]);
    for (;;) {
      if (seen.value >= revision) return;
      const fence = this.opts.fence?.();
      let txn = this.client.if(CURSOR, 'Mod', '==', seen.modRevision);
      if (fence) txn = txn.and(fence.key, 'Create', '==', fence.createRevision);
      const res = await txn
        .then(this.client.put(CURSOR).value(String(revision)))
        .else(this.client.get(CURSOR), ...(fence ? [this.client.get(fence.key)] : []))
        .commit();
      if (res.succeeded) {
        this.cursorSeen = { value: revision, modRevision: res.header.revision };
        return;
      }
      notFenced(fence, res.responses[1]?.response_range?.kvs[0]);
      seen = this.noteCursor(res.responses[0]?.response_range?.kvs[0]);
    }
  }

  async create(rec: DeliveryRec): Promise<boolean> {
    const key = DELIVERIES + rec.id;
    const fence = this.opts.fence?.();
    let txn = this.client.if(key, 'Create', '==', 0);
    if (fence) txn = txn.and(fence.key, 'Create', '==', fence.createRevision);
    const res = await (fence ? txn.then(this.client.put(key).value(JSON.stringify(rec))).else(this.client.get(fence.key)) : txn.then(this.client.put(key).value(JSON.stringify(rec)))).commit();
    if (!res.succeeded && fence) notFenced(fence, res.responses[0]?.response_range?.kvs[0]);
    return res.succeeded;
  }

  async get(id: string): Promise<DeliveryRec | undefined> {
    const v = await this.client.get(DELIVERIES + id).string();
    return v ? (JSON.parse(v) as DeliveryRec) : undefined;
  }

  /**
   * Writes `rec` over the record there if it supersedes it (supersedes), guarded by the mod
   * revision it was read at, and read again when that changed. Left alone otherwise, and when
   * the record is gone (retention deletes only finished ones).
   */
  async update(rec: DeliveryRec): Promise<void> {
    const key = DELIVERIES + rec.id;
    const value = JSON.stringify(rec);
    let kv = (await this.client.get(key).exec()).kvs[0];
    for (;;) {
      // Equal bytes: written already (a retry of a write whose answer was lost).
      if (!kv || kv.value.toString('utf8') === value || !supersedes(rec, JSON.parse(kv.value.toString('utf8')) as DeliveryRec)) return;
      const fence = this.opts.fence?.();
      let txn = this.client.if(key, 'Mod', '==', kv.mod_revision);
      if (fence) txn = txn.and(fence.key, 'Create', '==', fence.createRevision);
      const res = await txn
        .then(this.client.put(key).value(value))
        .else(this.client.get(key), ...(fence ? [this.client.get(fence.key)] : []))
        .commit();
      if (res.succeeded) return;
      notFenced(fence, res.responses[1]?.response_range?.kvs[0]);
      kv = res.responses[0]?.response_range?.kvs[0];
    }
  }

  async remove(ids: readonly string[]): Promise<void> {
    // Unguarded but for the fence: a delivered or failed record is never written again
    // (update). 100 per transaction, under etcd's default --max-txn-ops of 128.
    for (let i = 0; i < ids.length; i += 100) {
      const batch = ids.slice(i, i + 100);
      const fence = this.opts.fence?.();
      const txn = fence ? this.client.if(fence.key, 'Create', '==', fence.createRevision) : this.client.if(`${PREFIX}__never__`, 'Version', '==', 0);
      const res = await txn.then(...batch.map((id) => this.client.delete().key(DELIVERIES + id))).commit();
      if (!res.succeeded) throw new NotLeaderError();
    }
  }

  /** Read in pages of LIST_PAGE records at one revision (readPrefixAt). */
  async list(filter: { state?: DeliveryState }): Promise<DeliveryRec[]> {
    const { kvs } = await readPrefixAt(this.client, DELIVERIES, LIST_PAGE);
    return kvs
      .map((kv) => JSON.parse(kv.value.toString('utf8')) as DeliveryRec)
      .filter((d) => !filter.state || d.state === filter.state)
      .sort((a, b) => a.revision - b.revision || (a.id < b.id ? -1 : 1));
  }
}

/** Throws NotLeaderError when a write's `fence` failed: `got` is its election key as the write's transaction read it. */
function notFenced(fence: LeaderFence | undefined, got: IKeyValue | undefined): void {
  if (fence && Number(got?.create_revision ?? 0) !== fence.createRevision) throw new NotLeaderError();
}
