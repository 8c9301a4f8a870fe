// Benchmark: quota admission latency against the size of a tenant's history.
//
//   npm run bench:quota -- [--json FILE] [--records 1000,5000,20000] [--calls 50]
//
// A real etcd holds `records` sandbox records of one tenant (90% destroyed, the rest
// running) plus one finished op per 64 of them, as an RL tenant's history looks. Then
// `calls` admissions (a fork of 8 from a snapshot) run one after another, each right after
// a write, two ways:
//   listed  the tenant's records and every operation read per call (quota.ts without a ledger)
//   ledger  the replica's QuotaLedger (quota-ledger.ts): a revision read, then the watch barrier
// Prints { runs: [ { records, listed_ms: {p50, p99}, ledger_ms: {p50, p99}, ledger_start_ms } ] }.
import { writeFileSync } from 'node:fs';
import { startEtcd } from '../testkit/etcd.ts';
import { EtcdFleetStore } from '../adapters/etcd/store.ts';
import { admit, forkNeed } from '../domain/quota.ts';
import { QuotaLedger } from '../domain/quota-ledger.ts';
import type { StoreWrite } from '../domain/ports.ts';
import type { OperationRec, SandboxRec, SnapshotRec } from '../domain/records.ts';

function arg(name: string, dflt: string): string {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 && process.argv[i + 1] !== undefined ? process.argv[i + 1]! : dflt;
}

const SIZES = arg('records', '1000,5000,20000').split(',').map(Number);
const CALLS = Number(arg('calls', '50'));

const pct = (xs: number[], p: number): number => {
  const s = [...xs].sort((a, b) => a - b);
  return Number((s[Math.max(0, Math.ceil((p / 100) * s.length) - 1)] ?? 0).toFixed(2));
};

function sandbox(tenantId: string, id: string, state: SandboxRec['state']): SandboxRec {
  return { id, tenantId, state, stateReason: '', hostId: 'h1', resources: { vcpus: 1, memoryMib: 256, diskMib: 1024 }, image: 'tiny', sourceSnapshotId: 'sn-bench', lineageId: id, hostname: id, labels: {}, ttlMs: null, idleTimeoutMs: null, afterResume: [], allowEgress: false, allowCidrs: [], createdAt: 0, updatedAt: 0, runningMsBefore: 0, runningSince: null, hibernationSnapshotId: '', opId: '' };
}

const etcd = await startEtcd();
const store = EtcdFleetStore.connect(etcd.endpoints);
const runs: Array<Record<string, unknown>> = [];
try {
  const snap = { id: 'sn-bench', tenantId: '', state: 'ready', storedBytes: 0, vmConfig: { memoryMib: 256 } } as unknown as SnapshotRec;
  for (const [n, records] of SIZES.entries()) {
    let written = 0;
    const tenantId = `bench-${n}`;
    await store.commit([{ kind: 'snapshot', value: { ...snap, tenantId } }]);
    for (; written < records; written += 100) {
      const batch: StoreWrite[] = Array.from({ length: Math.min(100, records - written) }, (_, i) => {
        const k = written + i;
        return { kind: 'sandbox', value: sandbox(tenantId, `sb-${k}`, k % 10 === 0 ? 'running' : 'destroyed') };
      });
      await store.commit(batch);
      if (written % 6400 < 100) {
        const ops: StoreWrite[] = Array.from({ length: 100 }, (_, i) => ({ kind: 'op', value: { id: `op-${written}-${i}`, tenantId, kind: 'fork', state: 'succeeded', createdAt: 0, updatedAt: 0, targetId: 'sn-bench', input: { snapshotId: 'sn-bench', count: 64 }, progress: { done: 64, total: 64, message: '', bytesTransferred: 0 }, result: { sandboxIds: [] }, error: null, steps: {} } satisfies OperationRec }));
        await store.commit(ops);
      }
    }
    const quotas = () => ({ sandboxes: 1_000_000, memoryMib: 1_000_000_000 });
    const ledger = new QuotaLedger({ store });
    const t0 = performance.now();
    await ledger.usage(tenantId);
    const ledgerStartMs = Number((performance.now() - t0).toFixed(1));
    const time = async (usage: QuotaLedger | undefined): Promise<number[]> => {
      const ms: number[] = [];
      for (let i = 0; i < CALLS; i++) {
        // A write just before each check, as in a stream of calls from the same tenant.
        await store.commit([{ kind: 'sandbox', value: sandbox(tenantId, `sb-new-${i}-${usage ? 'l' : 'n'}`, 'pending') }]);
        const t = performance.now();
        await admit({ store, quotas, usage }, tenantId, forkNeed(store, tenantId, { snapshotId: 'sn-bench', sandboxId: '' }, 8));
        ms.push(performance.now() - t);
      }
      return ms;
    };
    const listed = await time(undefined);
    const viaLedger = await time(ledger);
    ledger.stop();
    runs.push({ records, listed_ms: { p50: pct(listed, 50), p99: pct(listed, 99) }, ledger_ms: { p50: pct(viaLedger, 50), p99: pct(viaLedger, 99) }, ledger_start_ms: ledgerStartMs });
  }
  const out = `${JSON.stringify({ calls: CALLS, runs }, null, 2)}\n`;
  process.stdout.write(out);
  const json = arg('json', '');
  if (json) writeFileSync(json, out);
} finally {
  store.close();
  await etcd.stop();
}
