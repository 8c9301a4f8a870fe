// FleetStore over etcd (etcd3 client). Every guarded write compares the key's mod
// revision it read; a batch is one transaction.
import { Etcd3 } from 'etcd3';
import type { IKeyValue } from 'etcd3';
import type { FleetChange, FleetStore, RecordChange, StoreWrite, Versioned } from '../../domain/ports.ts';
import type { HostAllocRec, HostRec, OperationRec, SandboxRec, SnapshotRec } from '../../domain/records.ts';
import { isTerminal } from '../../domain/records.ts';
import { keys, PREFIX } from './keys.ts';

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

  private async getPrefix<T>(prefix: string): Promise<Versioned<T>[]> {
    const res = await this.client.getAll().prefix(prefix).exec();
    return res.kvs.map((kv) => decode<T>(kv));
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
    const all = await this.getPrefix<OperationRec>(keys.ops());
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

  async watchOps(onOp: (op: OperationRec, modRevision: number) => void): Promise<() => void> {
    const w = await this.client.watch().prefix(keys.ops()).create();
    w.on('put', (kv) => {
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
