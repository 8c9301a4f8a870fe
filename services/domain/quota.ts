// Per-tenant quotas, checked at admission (CreateSandbox, ForkSandbox, SnapshotSandbox,
// HibernateSandbox, and the memory of a wake: explicit, or by a call to a hibernated sandbox) against what the tenant's records in the store add up to. A check is
// a read, not a reservation: Fleet runs one tenant's create and fork admissions one at a
// time per replica (inAdmissionOrder) when the tenant has a sandbox or memory quota, so those
// overshoot only by replicas racing each other (one request each). Concurrent wakes, and the
// snapshot_bytes check (a snapshot's size is not known until it is taken), can overshoot by
// what is admitted at once. Forks recorded but not yet placed count with
// their children, so a burst of fork calls cannot slip past the quota before placement.
// Quotas come from the tokens file (services/auth). The usage comes from the replica's ledger
// (quota-ledger.ts), which a watch keeps, or, when it cannot answer, from listing the records.
import type { FleetStore } from './ports.ts';
import type { OperationRec, SandboxRec, SandboxState, SnapshotRec } from './records.ts';
import { HOLDS_CAPACITY } from './records.ts';
import { PURPOSE_LABEL } from './retention.ts';
import { ForkfleetError } from '../../proto/errors.ts';

export interface TenantQuota {
  /** Sandboxes that are not destroyed, failed or lost. */
  readonly sandboxes?: number;
  /** MiB of the tenant's sandboxes that hold capacity or are about to (pending, waking). */
  readonly memoryMib?: number;
  /** Stored bytes of the tenant's snapshots that are not deleted or failed (nor a drain's, takenByADrain). */
  readonly snapshotBytes?: number;
}

export type QuotaOf = (tenantId: string) => TenantQuota | undefined;

export interface TenantUsage {
  sandboxes: number;
  memoryMib: number;
  snapshotBytes: number;
}

/** What an admission adds: sandboxes and their memory, or one more snapshot. */
export interface QuotaNeed {
  sandboxes?: number;
  memoryMib?: number;
  /** A new snapshot: admitted while stored bytes are under the quota (its size is not known yet). */
  snapshot?: boolean;
}

const NOT_COUNTED: ReadonlySet<SandboxState> = new Set(['destroyed', 'failed', 'lost']);
const MEMORY_STATES: ReadonlySet<SandboxState> = new Set([...HOLDS_CAPACITY, 'pending', 'waking']);

export class QuotaExceededError extends ForkfleetError {
  constructor(tenantId: string, quota: string, used: number, asked: number, limit: number, unit: string) {
    super('resource_exhausted', `quota ${quota} of tenant ${tenantId} exceeded: ${used}${unit} in use + ${asked}${unit} asked > ${limit}${unit}; free some first`, { retryable: false, field: `quotas.${quota}` });
  }
}

/** What one sandbox adds to its tenant's usage: whether it counts, and the memory it holds. */
export function sandboxUsage(s: SandboxRec): { counted: boolean; memoryMib: number } {
  return { counted: !NOT_COUNTED.has(s.state), memoryMib: MEMORY_STATES.has(s.state) ? s.resources.memoryMib : 0 };
}

/**
 * Retention TTL of the snapshot a drain takes to move a sandbox (migrate): it is needed
 * only while the drain runs (the moved VM maps its image on the new host, which that host
 * keeps while the VM runs). Without one it was kept forever, one per sandbox moved.
 */
export const MIGRATION_SNAPSHOT_TTL_MS = 24 * 3_600_000;

/**
 * A snapshot a drain took to move a sandbox, as the drain left it: an operator's doing, not
 * its tenant's, so it does not count against the tenant's snapshot_bytes (a tenant near its
 * quota was refused snapshots and hibernations for a day after a drain). Known by its label,
 * which only the scheduler sets (the API refuses keys starting forkfleet.io/). Once its tenant
 * keeps it (pins it, or gives it a longer TTL) it is the tenant's snapshot and counts.
 */
function takenByADrain(s: SnapshotRec): boolean {
  return s.labels?.[PURPOSE_LABEL] === 'migration' && !s.pinned && s.retentionTtlMs !== null && s.retentionTtlMs <= MIGRATION_SNAPSHOT_TTL_MS;
}

/** The stored bytes one snapshot adds to its tenant's usage (the ledger's and a listing's alike). */
export function snapshotUsageBytes(s: SnapshotRec): number {
  return s.state !== 'deleted' && s.state !== 'failed' && !takenByADrain(s) ? s.storedBytes : 0;
}

export function usageOf(sandboxes: readonly SandboxRec[], snapshots: readonly SnapshotRec[]): TenantUsage {
  const u: TenantUsage = { sandboxes: 0, memoryMib: 0, snapshotBytes: 0 };
  for (const s of sandboxes) {
    const x = sandboxUsage(s);
    if (x.counted) u.sandboxes++;
    u.memoryMib += x.memoryMib;
  }
  for (const s of snapshots) u.snapshotBytes += snapshotUsageBytes(s);
  return u;
}

/** Throws QuotaExceededError (naming the quota and the numbers) when `need` does not fit. Pure. */
export function checkQuota(tenantId: string, quota: TenantQuota, usage: TenantUsage, need: QuotaNeed): void {
  const n = need.sandboxes ?? 0;
  if (quota.sandboxes !== undefined && n > 0 && usage.sandboxes + n > quota.sandboxes) throw new QuotaExceededError(tenantId, 'sandboxes', usage.sandboxes, n, quota.sandboxes, '');
  const m = need.memoryMib ?? 0;
  if (quota.memoryMib !== undefined && m > 0 && usage.memoryMib + m > quota.memoryMib) throw new QuotaExceededError(tenantId, 'memory_mib', usage.memoryMib, m, quota.memoryMib, ' MiB');
  if (quota.snapshotBytes !== undefined && need.snapshot && usage.snapshotBytes >= quota.snapshotBytes) throw new QuotaExceededError(tenantId, 'snapshot_bytes', usage.snapshotBytes, 0, quota.snapshotBytes, ' B');
}

/** Per-tenant usage kept up to date (quota-ledger.ts); undefined when it cannot answer now. */
export interface UsageSource {
  /** `exceptWakeOf`: a sandbox whose recorded wake is not counted (the wake being admitted itself). */
  usage(tenantId: string, exceptWakeOf?: string): Promise<(TenantUsage & { pendingSandboxes: number; pendingMemoryMib: number }) | undefined>;
}

/**
 * Checks `need` against the tenant's quota; nothing to do without one. The usage comes from
 * the ledger when there is one and it can answer, else from the tenant's records.
 */
export async function admit(deps: { store: FleetStore; quotas?: QuotaOf | undefined; usage?: UsageSource | undefined }, tenantId: string, need: QuotaNeed | (() => Promise<QuotaNeed>), exceptWakeOf?: string): Promise<void> {
  const quota = deps.quotas?.(tenantId);
  if (!quota || (quota.sandboxes === undefined && quota.memoryMib === undefined && quota.snapshotBytes === undefined)) return;
  const [usage, n] = await Promise.all([tenantUsage(deps, tenantId, { snapshots: quota.snapshotBytes !== undefined, ...(exceptWakeOf ? { exceptWakeOf } : {}) }), typeof need === 'function' ? need() : Promise.resolve(need)]);
  return checkQuota(tenantId, quota, usage, n);
}

/**
 * What counts against the tenant's quotas now, forks admitted but not yet placed included:
 * from the ledger when it can answer, else from the tenant's records. `snapshots: false`
 * leaves snapshot bytes out of a listing (0) when no quota needs them.
 */
export async function tenantUsage(deps: { store: FleetStore; usage?: UsageSource | undefined }, tenantId: string, o: { snapshots: boolean; exceptWakeOf?: string } = { snapshots: true }): Promise<TenantUsage> {
  const fromLedger = await deps.usage?.usage(tenantId, o.exceptWakeOf);
  if (fromLedger) {
    const { pendingSandboxes, pendingMemoryMib, ...usage } = fromLedger;
    usage.sandboxes += pendingSandboxes;
    usage.memoryMib += pendingMemoryMib;
    return usage;
  }
  return listedUsage(deps.store, tenantId, o.snapshots, o.exceptWakeOf);
}

/**
 * The tenant's usage read from its records (and every open operation), with forks not yet
 * placed. The lists are read at different revisions, so the open forks are read first and
 * each counts the children the sandbox list, read after, lacks: a placement that commits in
 * between is then counted once (as records), never twice or not at all.
 */
async function listedUsage(store: FleetStore, tenantId: string, snapshots: boolean, exceptWakeOf?: string): Promise<TenantUsage> {
  const open = (await store.listOps({ activeOnly: true, tenantId })).map((v) => v.value);
  const forks = open.filter((o) => o.kind === 'fork');
  const [sbs, sns] = await Promise.all([store.listSandboxes(tenantId), snapshots ? store.listSnapshots(tenantId) : Promise.resolve([])]);
  const usage = usageOf(sbs.map((v) => v.value), sns.map((v) => v.value));
  // A wake not yet started (its sandbox still hibernated) takes the sandbox's memory again.
  const waking = new Set(open.filter((o) => o.kind === 'wake' && o.targetId !== exceptWakeOf).map((o) => o.targetId));
  for (const { value: s } of sbs) if (waking.has(s.id) && s.state === 'hibernated') usage.memoryMib += s.resources.memoryMib;
  // Children of forks not yet placed have no records yet, but they are coming.
  const pending = await pendingForks(store, tenantId, forks, new Set(sbs.map((v) => v.value.id)));
  usage.sandboxes += pending.sandboxes ?? 0;
  usage.memoryMib += pending.memoryMib ?? 0;
  return usage;
}

/** What the tenant's open forks will add: each child with no record among `listed` (all of a fork's, when its op names none). */
async function pendingForks(store: FleetStore, tenantId: string, forks: readonly OperationRec[], listed: ReadonlySet<string>): Promise<QuotaNeed> {
  const needs = await Promise.all(forks.map((o) => {
    const i = o.input as { snapshotId?: string; sandboxId?: string; count?: number; childIds?: string[] };
    const coming = i.childIds ? i.childIds.filter((id) => !listed.has(id)).length : o.result?.sandboxIds ? 0 : (i.count ?? 0);
    return coming === 0 ? Promise.resolve({ sandboxes: 0, memoryMib: 0 }) : forkNeed(store, tenantId, { snapshotId: i.snapshotId ?? '', sandboxId: i.sandboxId ?? '' }, coming)();
  }));
  return needs.reduce<{ sandboxes: number; memoryMib: number }>((a, x) => ({ sandboxes: a.sandboxes + (x.sandboxes ?? 0), memoryMib: a.memoryMib + (x.memoryMib ?? 0) }), { sandboxes: 0, memoryMib: 0 });
}

/** A fork's need: `count` sandboxes of the source's memory (the snapshot's VM, or the sandbox's resources). */
export function forkNeed(store: FleetStore, tenantId: string, source: { snapshotId: string; sandboxId: string }, count: number): () => Promise<QuotaNeed> {
  return async () => {
    let mib = 0;
    if (source.snapshotId) mib = (await store.getSnapshot(tenantId, source.snapshotId))?.value.vmConfig?.memoryMib ?? 0;
    else if (source.sandboxId) mib = (await store.getSandbox(tenantId, source.sandboxId))?.value.resources.memoryMib ?? 0;
    // A fork of a live sandbox takes a snapshot of it first: that needs room under the
    // snapshot_bytes quota, as SnapshotSandbox does. A fork of a stored snapshot takes none.
    return { sandboxes: count, memoryMib: count * mib, snapshot: !source.snapshotId && !!source.sandboxId };
  };
}
