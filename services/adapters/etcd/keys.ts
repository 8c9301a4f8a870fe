// etcd key layout. Everything lives under one prefix; values are small JSON records
// (services/domain/records.ts). etcd holds no bulk data: manifests and chunks stay on hosts.
//
//   /ff/v1/hosts/<hostId>                 HostRec       written on register, cordon, state change
//   /ff/v1/alloc/<hostId>                 HostAllocRec  capacity booked; guarded by mod revision
//   /ff/v1/sandboxes/<tenant>/<sandboxId> SandboxRec
//   /ff/v1/snapshots/<tenant>/<snapId>    SnapshotRec   (manifest stays on holding hosts)
//   /ff/v1/ops/<tenant>/<opId>            OperationRec
//   /ff/v1/idem/<tenant>/<sha256(key)>    opId          idempotency keys
//   /ff/v1/incarnation                    <ms>.<hex>    written once per store; in leader terms (election.ts)
//   election//ff/v1/election/<lease>       scheduler leader election (etcd3 Election puts its own
//                                         `election/` first: outside /ff/v1/, see services/README.md)
//
// A fork of N children writes N sandbox records, the op and the touched alloc records in
// one transaction; with records of ~1 KiB, N = 256 stays far below etcd's 1.5 MiB request
// limit. etcd's default of 128 operations per transaction is raised to 1024
// (--max-txn-ops) by the harness and the fleet; the API caps a fork at 256 children.
import { createHash } from 'node:crypto';

export const PREFIX = '/ff/v1/';

export const keys = {
  host: (id: string) => `${PREFIX}hosts/${id}`,
  hosts: () => `${PREFIX}hosts/`,
  alloc: (hostId: string) => `${PREFIX}alloc/${hostId}`,
  allocs: () => `${PREFIX}alloc/`,
  sandbox: (tenant: string, id: string) => `${PREFIX}sandboxes/${tenant}/${id}`,
  sandboxes: (tenant?: string) => `${PREFIX}sandboxes/${tenant === undefined ? '' : `${tenant}/`}`,
  snapshot: (tenant: string, id: string) => `${PREFIX}snapshots/${tenant}/${id}`,
  snapshots: (tenant?: string) => `${PREFIX}snapshots/${tenant === undefined ? '' : `${tenant}/`}`,
  op: (tenant: string, id: string) => `${PREFIX}ops/${tenant}/${id}`,
  ops: (tenant?: string) => `${PREFIX}ops/${tenant === undefined ? '' : `${tenant}/`}`,
  idem: (tenant: string, key: string) => `${PREFIX}idem/${tenant}/${createHash('sha256').update(key).digest('hex').slice(0, 32)}`,
  election: () => `${PREFIX}election`,
  incarnation: () => `${PREFIX}incarnation`,
};
