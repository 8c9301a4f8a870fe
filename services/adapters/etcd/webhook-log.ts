// Webhook delivery records and the event cursor in etcd (services/domain/webhooks.ts).
//   /ff/v1/webhooks/cursor            last store revision whose events are all recorded
//   /ff/v1/webhooks/deliveries/<id>   DeliveryRec (id = revision-type-tenant-subject-target); delivered and
//                                     failed ones are deleted after FF_RECORD_RETENTION
import type { Etcd3 } from 'etcd3';
import type { DeliveryLog, DeliveryRec, DeliveryState } from '../../domain/webhooks.ts';
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

  /** Read in pages of LIST_PAGE records at one revision (readPrefixAt). */
  async list(filter: { state?: DeliveryState }): Promise<DeliveryRec[]> {
    const { kvs } = await readPrefixAt(this.client, DELIVERIES, LIST_PAGE);
    return kvs
      .map((kv) => JSON.parse(kv.value.toString('utf8')) as DeliveryRec)
      .filter((d) => !filter.state || d.state === filter.state)
      .sort((a, b) => a.revision - b.revision || (a.id < b.id ? -1 : 1));
  }
}
