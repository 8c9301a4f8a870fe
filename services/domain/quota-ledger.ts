// Per-tenant usage for quota admission (quota.ts), kept by a watch instead of listed per
// call. Listing a tenant's sandboxes and every operation on each admission cost 28 / 57 /
// 233 ms at 1k / 5k / 20k records (the list grows with history, not with what runs); the
// ledger answers in about one etcd round trip whatever the count.
//
// It lists every sandbox, snapshot and operation record once, then follows every change
// under the store's prefix (FleetStore.followRecords) and keeps, per record, what it adds to
// its tenant's usage. Read barrier: an answer first reads etcd's current revision and waits
// until the watch has delivered every change up to it, so a check sees every write committed
// before it began, as a fresh list would (a sandbox created by the call just before is
// counted). When the ledger cannot catch up in time (etcd shared with writers outside the
// prefix, a broken watch), `usage` answers undefined and admission lists as before.
//
// Started on the first admission that has a quota (or GetTenantUsage of a tenant with one): a
// replica with no quotas never watches. Starting (the list of every record, then opening the
// watch) can take seconds, up to etcd's call deadline when the watch cannot open: an answer
// waits for it no longer than for the barrier (undefined meanwhile, so admission lists) while
// it goes on in the background, and a start that failed is not tried again for `restartMs`,
// so a burst of admissions does not list the whole fleet and wait out a deadline once each.
import type { Logger } from 'pino';
import type { FleetStore, FollowedRecord } from './ports.ts';
import type { OperationRec } from './records.ts';
import { isTerminal } from './records.ts';
import { sandboxUsage, snapshotUsageBytes } from './quota.ts';
import type { TenantUsage } from './quota.ts';

/** A tenant's usage, and what its forks that are recorded but not yet placed will add. */
export interface LedgerUsage extends TenantUsage {
  pendingSandboxes: number;
  pendingMemoryMib: number;
}

interface Tally {
  sandboxes: number;
  memoryMib: number;
  snapshotBytes: number;
}

/** A fork not placed yet: `count` children of the memory of its source (looked up when asked). */
interface PendingFork {
  tenantId: string;
  count: number;
  snapshotKey: string;
  sandboxKey: string;
}

export class QuotaLedger {
  private readonly tallies = new Map<string, Tally>();
  /** What each record adds now, by `<tenant>/<id>`. */
  private readonly sandboxes = new Map<string, { tenantId: string; counted: boolean; memoryMib: number; resourcesMib: number }>();
  private readonly snapshots = new Map<string, { tenantId: string; bytes: number; memoryMib: number }>();
  private readonly forks = new Map<string, PendingFork>();
  /** Wakes recorded and not ended, by op key: their sandbox's record, `<tenant>/<id>`. */
  private readonly wakes = new Map<string, string>();
  /** Every change up to this store revision is applied. */
  private revision = 0;
  private waiters: Array<{ revision: number; resolve: () => void }> = [];
  private starting: Promise<void> | undefined;
  /** After a failed start: no new one before this time (Date.now()). */
  private restartAt = 0;
  /** Counts follows: callbacks of an earlier one are ignored. */
  private gen = 0;
  private stopFollow: (() => void) | undefined;

  constructor(
    private readonly deps: { store: Pick<FleetStore, 'followRecords' | 'revision'>; log?: Logger },
    /** How long an answer waits for the watch to start, and then to reach etcd's revision, before giving up. */
    private readonly barrierMs = 1000,
    /** How long after a failed start the next one waits (answers are undefined meanwhile). */
    private readonly restartMs = 5000,
  ) {}

  /**
   * The tenant's usage as of now (every write committed before the call), or undefined when
   * the ledger cannot say in time: the caller then reads the records itself.
   */
  async usage(tenantId: string, exceptWakeOf?: string): Promise<LedgerUsage | undefined> {
    if (!(await this.started())) return undefined;
    const target = await this.deps.store.revision();
    if (!(await this.reached(target))) return undefined;
    const t = this.tallies.get(tenantId) ?? { sandboxes: 0, memoryMib: 0, snapshotBytes: 0 };
    let pendingSandboxes = 0;
    let pendingMemoryMib = 0;
    for (const f of this.forks.values()) {
      if (f.tenantId !== tenantId) continue;
      pendingSandboxes += f.count;
      const mib = f.snapshotKey ? (this.snapshots.get(f.snapshotKey)?.memoryMib ?? 0) : (this.sandboxes.get(f.sandboxKey)?.resourcesMib ?? 0);
      pendingMemoryMib += f.count * mib;
    }
    // A wake recorded but not yet started (its sandbox still hibernated, holding no memory)
    // takes the sandbox's memory again: counted from now, once per sandbox, so a call right
    // after a ResumeSandbox does not pass on the memory the wake is about to take.
    const waking = new Set<string>();
    for (const key of this.wakes.values()) {
      const s = this.sandboxes.get(key);
      if (!s || s.tenantId !== tenantId || s.memoryMib > 0 || !s.counted || waking.has(key) || key === `${tenantId}/${exceptWakeOf}`) continue;
      waking.add(key);
      pendingMemoryMib += s.resourcesMib;
    }
    return { ...t, pendingSandboxes, pendingMemoryMib };
  }

  stop(): void {
    this.gen++;
    this.stopFollow?.();
    this.stopFollow = undefined;
    this.starting = undefined;
    this.reset();
  }

  /**
   * Lists and starts following once; after a broken watch, starts again on the next call, and
   * after a failed start, on the first call `restartMs` later. False when not started within
   * `barrierMs` (the start goes on: a later call finds it done).
   */
  private async started(): Promise<boolean> {
    if (!this.starting) {
      if (Date.now() < this.restartAt) return false;
      // A follow started before a stop() is cancelled when it arrives and never feeds this one.
      const gen = ++this.gen;
      const s = this.deps.store
        .followRecords(
          (c) => gen === this.gen && this.apply(c),
          (rev) => gen === this.gen && this.advance(rev),
          (e) => {
            if (gen !== this.gen) return;
            this.deps.log?.warn({ err: e }, 'the quota ledger watch broke off; admission lists records until it restarts');
            this.stop();
          },
        )
        .then((stop) => {
          if (gen === this.gen) this.stopFollow = stop;
          else stop();
        });
      this.starting = s;
      // Handled here, once, not by each caller: they may all have stopped waiting.
      s.catch((e: unknown) => {
        if (this.starting !== s) return;
        this.deps.log?.warn({ err: e }, `the quota ledger could not start; admission lists records, and it starts again in ${this.restartMs} ms`);
        // The list may have been taken in before the watch failed: the next start lists again,
        // and a record gone by then must not keep the share this one gave it.
        this.stop();
        this.restartAt = Date.now() + this.restartMs;
      });
    }
    const s = this.starting;
    let timer: ReturnType<typeof setTimeout> | undefined;
    const late = new Promise<boolean>((resolve) => (timer = setTimeout(() => resolve(false), this.barrierMs)));
    const ok = await Promise.race([
      s.then(
        () => this.starting === s,
        () => false,
      ),
      late,
    ]);
    clearTimeout(timer);
    return ok;
  }

  private reset(): void {
    this.tallies.clear();
    this.sandboxes.clear();
    this.snapshots.clear();
    this.forks.clear();
    this.wakes.clear();
    this.revision = 0;
    for (const w of this.waiters.splice(0)) w.resolve();
  }

  private reached(revision: number): Promise<boolean> {
    if (this.revision >= revision) return Promise.resolve(true);
    return new Promise<boolean>((resolve) => {
      const w = {
        revision,
        resolve: () => {
          clearTimeout(timer);
          resolve(this.revision >= revision);
        },
      };
      const timer = setTimeout(() => {
        this.waiters = this.waiters.filter((x) => x !== w);
        resolve(false);
      }, this.barrierMs);
      this.waiters.push(w);
    });
  }

  private advance(revision: number): void {
    if (revision <= this.revision) return;
    this.revision = revision;
    const due = this.waiters.filter((w) => w.revision <= revision);
    if (due.length === 0) return;
    this.waiters = this.waiters.filter((w) => w.revision > revision);
    for (const w of due) w.resolve();
  }

  private tally(tenantId: string): Tally {
    let t = this.tallies.get(tenantId);
    if (!t) this.tallies.set(tenantId, (t = { sandboxes: 0, memoryMib: 0, snapshotBytes: 0 }));
    return t;
  }

  /** Replaces what the record at `key` added with what its new value adds. */
  apply(c: FollowedRecord): void {
    if (c.kind === 'sandbox') {
      const old = this.sandboxes.get(c.key);
      if (old) {
        const t = this.tally(old.tenantId);
        t.sandboxes -= old.counted ? 1 : 0;
        t.memoryMib -= old.memoryMib;
        this.sandboxes.delete(c.key);
      }
      if (c.value) {
        const u = sandboxUsage(c.value);
        const t = this.tally(c.value.tenantId);
        t.sandboxes += u.counted ? 1 : 0;
        t.memoryMib += u.memoryMib;
        this.sandboxes.set(c.key, { tenantId: c.value.tenantId, counted: u.counted, memoryMib: u.memoryMib, resourcesMib: c.value.resources.memoryMib });
      }
    } else if (c.kind === 'snapshot') {
      const old = this.snapshots.get(c.key);
      if (old) {
        this.tally(old.tenantId).snapshotBytes -= old.bytes;
        this.snapshots.delete(c.key);
      }
      if (c.value) {
        const bytes = snapshotUsageBytes(c.value);
        this.tally(c.value.tenantId).snapshotBytes += bytes;
        this.snapshots.set(c.key, { tenantId: c.value.tenantId, bytes, memoryMib: c.value.vmConfig?.memoryMib ?? 0 });
      }
    } else {
      const pending = c.value ? pendingForkOf(c.value) : undefined;
      if (pending) this.forks.set(c.key, pending);
      else this.forks.delete(c.key);
      if (c.value?.kind === 'wake' && !isTerminal(c.value.state)) this.wakes.set(c.key, `${c.value.tenantId}/${c.value.targetId}`);
      else this.wakes.delete(c.key);
    }
  }
}

/** A fork that is recorded but not placed: its children have no records yet, but they are coming. */
function pendingForkOf(op: OperationRec): PendingFork | undefined {
  if (op.kind !== 'fork' || isTerminal(op.state) || op.result?.sandboxIds) return undefined;
  const i = op.input as { snapshotId?: string; sandboxId?: string; count?: number };
  return { tenantId: op.tenantId, count: i.count ?? 0, snapshotKey: i.snapshotId ? `${op.tenantId}/${i.snapshotId}` : '', sandboxKey: i.sandboxId ? `${op.tenantId}/${i.sandboxId}` : '' };
}
