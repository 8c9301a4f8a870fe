// FleetStore over etcd (etcd3 client). Every guarded write compares the key's mod
// revision it read; a batch is one transaction.
import { Etcd3, Range } from 'etcd3';
import type { IKeyValue } from 'etcd3';
import type { FleetChange, FleetStore, RecordChange, StoreWrite, Versioned } from '../../domain/ports.ts';
import type { HostAllocRec, HostRec, OperationRec, SandboxRec, SnapshotRec } from '../../domain/records.ts';
import { isTerminal } from '../../domain/records.ts';
import { keys, PREFIX } from './keys.ts';

/**
 * Keys per page when listing a prefix. One range response must stay under the client's
 * 4 MiB gRPC receive limit (a whole fleet's sandboxes do not: 6,000 records already exceed
 * it, and the failing calls then open the client's circuit breaker for every other call).
 * Records stay under 2 KiB, except a fork's op (up to ~40 KiB with its step log).
 */
const LIST_PAGE = 500;
const LIST_PAGE_OPS = 50;

function decode<T>(kv: IKeyValue): Versioned<T> {
  return { value: JSON.parse(kv.value.toString('utf8')) as T, modRevision: Number(kv.mod_revision) };
}

function keyOf(w: StoreWrite): string {
  switch (w.kind) {
    case 'sandbox':
      return keys.sandbox(w.value.tenantId, w.value.id);
    case 'snapshot':
      return keys.snapshot(w.value.tenantId, w.value.id);
    case 'op':
      return keys.op(w.value.tenantId, w.value.id);
    case 'host':
      return keys.host(w.value.id);
    case 'alloc':
      return keys.alloc(w.value.hostId);
    case 'idem':
      return keys.idem(w.tenantId, w.key);
    case 'delete-sandbox':
      return keys.sandbox(w.tenantId, w.id);
  }
}

function valueOf(w: StoreWrite): string | undefined {
  switch (w.kind) {
    case 'idem':
      return w.opId;
    case 'delete-sandbox':
      return undefined;
    default:
      return JSON.stringify(w.value);
  }
}

export class EtcdFleetStore implements FleetStore {
  constructor(private readonly client: Etcd3) {}

  static connect(endpoints: string[]): EtcdFleetStore {
    return new EtcdFleetStore(new Etcd3({ hosts: endpoints, dialTimeout: 3000 }));
  }

  get etcd(): Etcd3 {
    return this.client;
  }

  close(): void {
    this.client.close();
  }

  private async getOne<T>(key: string): Promise<Versioned<T> | undefined> {
    const res = await this.client.get(key).exec();
    const kv = res.kvs[0];
    return kv ? decode<T>(kv) : undefined;
  }

  /**
   * Every record under `prefix`, read in pages of `page` keys (in key order), all at the
   * revision of the first page, so the list is one consistent snapshot as before. If that
   * revision is compacted away meanwhile, the list starts again.
   */
  private async getPrefix<T>(prefix: string, page = LIST_PAGE): Promise<Versioned<T>[]> {
    const end = Range.prefix(prefix).end;
    for (let attempt = 0; ; attempt++) {
      const out: Versioned<T>[] = [];
      let start = Buffer.from(prefix);
      let rev: string | undefined;
      try {
        for (;;) {
          const b = this.client.getAll().inRange(new Range(start, end)).limit(page);
          const res = await (rev ? b.revision(rev) : b).exec();
          for (const kv of res.kvs) out.push(decode<T>(kv));
          const last = res.kvs[res.kvs.length - 1];
          if (!res.more || !last) return out;
          rev ??= res.header.revision;
          start = Buffer.concat([last.key, Buffer.from([0])]);
        }
      } catch (e) {
        if (attempt < 3 && rev && /compacted/i.test(e instanceof Error ? e.message : String(e))) continue;
        throw e;
      }
    }
  }

  getSandbox(tenantId: string, id: string): Promise<Versioned<SandboxRec> | undefined> {
    return this.getOne(keys.sandbox(tenantId, id));
  }
  listSandboxes(tenantId: string | undefined): Promise<Versioned<SandboxRec>[]> {
    return this.getPrefix(keys.sandboxes(tenantId));
  }
  getSnapshot(tenantId: string, id: string): Promise<Versioned<SnapshotRec> | undefined> {
    return this.getOne(keys.snapshot(tenantId, id));
  }
  listSnapshots(tenantId: string | undefined): Promise<Versioned<SnapshotRec>[]> {
    return this.getPrefix(keys.snapshots(tenantId));
  }
  getOp(tenantId: string, id: string): Promise<Versioned<OperationRec> | undefined> {
    return this.getOne(keys.op(tenantId, id));
  }
  async listOps(filter: { activeOnly: boolean }): Promise<Versioned<OperationRec>[]> {
    const all = await this.getPrefix<OperationRec>(keys.ops(), LIST_PAGE_OPS);
    return filter.activeOnly ? all.filter((o) => !isTerminal(o.value.state)) : all;
  }
  getHost(id: string): Promise<Versioned<HostRec> | undefined> {
    return this.getOne(keys.host(id));
  }
  listHosts(): Promise<Versioned<HostRec>[]> {
    return this.getPrefix(keys.hosts());
  }
  async getAlloc(hostId: string): Promise<Versioned<HostAllocRec>> {
    return (
      (await this.getOne<HostAllocRec>(keys.alloc(hostId))) ?? {
        value: { hostId, allocated: { vcpus: 0, memoryMib: 0, diskMib: 0 }, sandboxes: 0 },
        modRevision: 0,
      }
    );
  }
  listAllocs(): Promise<Versioned<HostAllocRec>[]> {
    return this.getPrefix(keys.allocs());
  }
  async getIdempotent(tenantId: string, key: string): Promise<string | undefined> {
    const v = await this.client.get(keys.idem(tenantId, key)).string();
    return v ?? undefined;
  }

  async commit(writes: readonly StoreWrite[]): Promise<boolean> {
    return (await this.commitAt(writes)) > 0;
  }

  async commitAt(writes: readonly StoreWrite[]): Promise<number> {
    if (writes.length === 0) return 1;
    const ns = this.client;
    let txn = ns.if(PREFIX + '__never__', 'Version', '==', 0); // always-true seed compare
    for (const w of writes) {
      if (w.expectRevision !== undefined) txn = txn.and(keyOf(w), 'Mod', '==', w.expectRevision);
    }
    const ops = writes.map((w) => {
      const v = valueOf(w);
      return v === undefined ? ns.delete().key(keyOf(w)) : ns.put(keyOf(w)).value(v);
    });
    const res = await txn.then(...ops).commit();
    return res.succeeded ? Number(res.header.revision) : 0;
  }

  async watchOps(onOp: (op: OperationRec, modRevision: number) => void, opts: { only?: (tenantId: string, id: string) => boolean } = {}): Promise<() => void> {
    const prefix = keys.ops();
    const w = await this.client.watch().prefix(prefix).create();
    const only = opts.only;
    w.on('put', (kv) => {
      if (only) {
        // <prefix><tenant>/<id>: filter by key, so unwanted records are never decoded.
        const rest = kv.key.toString('utf8').slice(prefix.length);
        const slash = rest.lastIndexOf('/');
        if (!only(rest.slice(0, slash), rest.slice(slash + 1))) return;
      }
      const d = decode<OperationRec>(kv);
      onOp(d.value, d.modRevision);
    });
    return () => void w.cancel();
  }

  async watchFleet(onChange: (c: FleetChange) => void): Promise<() => void> {
    const watchers = await Promise.all([
      this.client.watch().prefix(keys.hosts()).create(),
      this.client.watch().prefix(keys.allocs()).create(),
      this.client.watch().prefix(keys.snapshots()).create(),
    ]);
    const kinds = ['host', 'alloc', 'snapshot'] as const;
    watchers.forEach((w, i) => {
      const kind = kinds[i] as (typeof kinds)[number];
      w.on('put', (kv) => onChange({ kind, value: decode<never>(kv) } as FleetChange));
    });
    return () => {
      for (const w of watchers) void w.cancel();
    };
  }

  async watchRecords(onChange: (c: RecordChange) => void, opts: { fromRevision?: number } = {}): Promise<() => void> {
    // One watcher over the whole prefix, so changes arrive in revision order across kinds
    // (the webhook cursor relies on it).
    const b = this.client.watch().prefix(PREFIX).withPreviousKV();
    const w = await (opts.fromRevision ? b.startRevision(String(opts.fromRevision)) : b).create();
    const kinds = [
      [keys.sandboxes(), 'sandbox'],
      [keys.snapshots(), 'snapshot'],
      [keys.ops(), 'op'],
    ] as const;
    w.on('put', (kv, previous) => {
      const key = kv.key.toString('utf8');
      const kind = kinds.find(([p]) => key.startsWith(p))?.[1];
      if (!kind) return;
      const d = decode<never>(kv);
      const prev = previous && previous.value.length > 0 ? (decode<never>(previous).value as unknown) : undefined;
      onChange({ kind, value: d.value, revision: d.modRevision, ...(prev ? { prev } : {}) } as RecordChange);
    });
    return () => void w.cancel();
  }
}
