// Webhook delivery records and the event cursor in etcd (services/domain/webhooks.ts).
//   /ff/v1/webhooks/cursor            last store revision whose events are all recorded
//   /ff/v1/webhooks/deliveries/<id>   DeliveryRec (id = revision-type-tenant-subject-target); delivered and
//                                     failed ones are deleted after FF_RECORD_RETENTION
import { Range } from 'etcd3';
import type { Etcd3 } from 'etcd3';
import type { DeliveryLog, DeliveryRec, DeliveryState } from '../../domain/webhooks.ts';
import { PREFIX } from './keys.ts';

const CURSOR = `${PREFIX}webhooks/cursor`;
const DELIVERIES = `${PREFIX}webhooks/deliveries/`;
/**
 * Records per read of list(): ~0.5 MB at ~1 KB a record. One read of the whole log failed past
 * the client's 4 MiB answer limit (~5,000 records: a fork(256) makes 513 per target), and the
 * leader could then never start its dispatcher.
 */
const LIST_PAGE = 500;

/** The error etcd gives for a read at a revision that compaction removed. */
function isCompacted(e: unknown): boolean {
  return /compacted/i.test(e instanceof Error ? e.message : String(e));
}

export class EtcdDeliveryLog implements DeliveryLog {
  constructor(private readonly client: Etcd3) {}

  async cursor(): Promise<number> {
    const v = await this.client.get(CURSOR).string();
    return v ? Number(v) : 0;
  }

  async setCursor(revision: number): Promise<void> {
    await this.client.put(CURSOR).value(String(revision)).exec();
  }

  async create(rec: DeliveryRec): Promise<boolean> {
    const key = DELIVERIES + rec.id;
    const res = await this.client.if(key, 'Create', '==', 0).then(this.client.put(key).value(JSON.stringify(rec))).commit();
    return res.succeeded;
  }

  async get(id: string): Promise<DeliveryRec | undefined> {
    const v = await this.client.get(DELIVERIES + id).string();
    return v ? (JSON.parse(v) as DeliveryRec) : undefined;
  }

  async update(rec: DeliveryRec): Promise<void> {
    await this.client.put(DELIVERIES + rec.id).value(JSON.stringify(rec)).exec();
  }

  async remove(ids: readonly string[]): Promise<void> {
    // Unguarded: a delivered or failed record is never written again. 100 per transaction,
    // under etcd's default --max-txn-ops of 128.
    for (let i = 0; i < ids.length; i += 100) {
      const batch = ids.slice(i, i + 100);
      await this.client.if(`${PREFIX}__never__`, 'Version', '==', 0).then(...batch.map((id) => this.client.delete().key(DELIVERIES + id))).commit();
    }
  }

  /**
   * Read in pages of LIST_PAGE records (in key order), all at the revision of the first page, so
   * the list is one consistent snapshot; if that revision is compacted away meanwhile, the list
   * starts again.
   */
  async list(filter: { state?: DeliveryState }): Promise<DeliveryRec[]> {
    const end = Range.prefix(DELIVERIES).end;
    for (let attempt = 0; ; attempt++) {
      const out: DeliveryRec[] = [];
      let start = Buffer.from(DELIVERIES);
      let rev: string | undefined;
      try {
        for (;;) {
          const b = this.client.getAll().inRange(new Range(start, end)).limit(LIST_PAGE);
          const res = await (rev ? b.revision(rev) : b).exec();
          for (const kv of res.kvs) {
            const d = JSON.parse(kv.value.toString('utf8')) as DeliveryRec;
            if (!filter.state || d.state === filter.state) out.push(d);
          }
          rev ??= res.header.revision;
          const last = res.kvs[res.kvs.length - 1];
          if (!res.more || !last) break;
          start = Buffer.concat([last.key, Buffer.from([0])]);
        }
      } catch (e) {
        if (attempt < 3 && rev && isCompacted(e)) continue;
        throw e;
      }
      return out.sort((a, b) => a.revision - b.revision || (a.id < b.id ? -1 : 1));
    }
  }

  /**
   * Whether etcd's history at `revision` is compacted away (the leader's Compactor: a floor
   * there keeps nothing).
   */
  async compactedPast(revision: number): Promise<boolean> {
    try {
      await this.client.get(CURSOR).revision(String(revision)).exec();
      return false;
    } catch (e) {
      if (isCompacted(e)) return true;
      throw e;
    }
  }
}
