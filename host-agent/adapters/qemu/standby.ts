// Standby QEMUs (ADR 0014): per snapshot, a few QEMU processes already started with the
// snapshot's memory image mapped and its device state loaded, paused before their first guest
// instruction. A fork or restore of that snapshot claims one and only has to `cont` it, resync
// the guest agent and run clone hygiene: the QEMU start (~130-200 ms of relocation and page
// faults here) and the device-state load are out of its path.
//
// A standby never ran a guest instruction, so a child made from one is exactly the snapshot's
// state, like a freshly spawned one. Invariants: a standby is in `ready` of at most one snapshot
// or being handed out, never both; ready standbys plus the one starting <= max host-wide.
import type { Logger } from 'pino';
import type { Clock, LocalSnapshot } from '../../domain/vmm.ts';
import type { QmpClient } from '../qmp/client.ts';
import type { QemuProcess } from './process.ts';

export interface Standby {
  /** Its directory's name under standby/ (the directory becomes the claiming VM's workdir). */
  id: string;
  /** The pool's key: the snapshot's id (an incoming standby's: its launch configuration's key). */
  snapshotId: string;
  workdir: string;
  proc: QemuProcess;
  qmp: QmpClient;
  readyAt: number;
  /** An incoming standby's RAM file was filled (ADR 0016) when it started. */
  ramFilled?: boolean;
}

export interface StandbyPolicy {
  /** Standbys on this host, all snapshots together (FF_STANDBY_MAX). 0 turns standbys off. */
  max: number;
  /**
   * After a fork of N children from a snapshot, keep min(N, perSnapshot) standbys of it
   * (FF_STANDBY_PER_SNAPSHOT). 0: only explicit warm() requests make standbys.
   */
  perSnapshot: number;
  /** A snapshot's standbys go when it was not forked for this long (FF_STANDBY_IDLE). */
  idleMs: number;
  /**
   * An incoming standby (ADR 0015) starts once no VM of its configuration migrated in for
   * this long (FF_INCOMING_STANDBY_QUIET); 0 starts one right after each migration.
   */
  incomingQuietMs: number;
}

export const DEFAULT_STANDBY_POLICY: Readonly<StandbyPolicy> = Object.freeze({ max: 8, perSnapshot: 2, idleMs: 10 * 60_000, incomingQuietMs: 3000 });

/**
 * How long a claim waits for the standby being started before it gives up (its caller then
 * spawns a QEMU of its own): about one spawn and load of a child here (~0.5 s on a busy host,
 * ADR 0014). At nice 19 behind busy guests a standby was seen to take ~2 min to start; the
 * claim raises it to nice 0, and one still later goes to `ready` for the next claim.
 */
export const CLAIM_WAIT_MS = 500;

/**
 * A launch's priority: background work (nice 19) until a claim waits for it, then urgent. The
 * launch starts its process at nice 0 when it is urgent already, and has `onUrgent` renice the
 * process it started.
 */
export class Urgency {
  private hooks: Array<() => void> | undefined = [];

  get urgent(): boolean {
    return this.hooks === undefined;
  }

  /** Runs `f` once the launch is urgent: at once if it is already. */
  onUrgent(f: () => void): void {
    if (this.hooks) this.hooks.push(f);
    else f();
  }

  urge(): void {
    const hooks = this.hooks ?? [];
    this.hooks = undefined;
    for (const f of hooks) f();
  }
}

/** What a pool makes standbys of: a snapshot, or anything keyed like one (`manifest.snapshotId`). */
export interface StandbyTemplate {
  manifest: { snapshotId: string };
}

interface Want<T> {
  snapshot: T;
  count: number;
  lastUse: number;
}

export class StandbyPool<T extends StandbyTemplate = LocalSnapshot> {
  private readonly ready = new Map<string, Standby[]>();
  private readonly wants = new Map<string, Want<T>>();
  /** The launch in progress (one at a time), its snapshot, whether a claim already waited for it, and its priority. */
  private launching: { snapshotId: string; done: Promise<unknown>; awaited: boolean; urgency: Urgency } | undefined;
  private loop: Promise<void> | undefined;
  private closed = false;
  private readonly timer: NodeJS.Timeout;
  /** Demands held back until their snapshot has been quiet for a while (demandWhenQuiet). */
  private readonly quiet = new Map<string, NodeJS.Timeout>();

  constructor(
    private readonly policy: StandbyPolicy,
    private readonly launch: (snapshot: T, urgency: Urgency) => Promise<Standby>,
    private readonly discard: (s: Standby) => Promise<void>,
    private readonly log: Logger,
    private readonly clock: Clock,
  ) {
    // A failed removal (EIO, EBUSY) is logged: a rejection nobody handles would end the agent.
    this.timer = setInterval(() => void this.expire().catch((e: unknown) => this.log.warn({ err: String(e) }, 'removing idle standbys failed')), Math.max(1000, Math.min(60_000, policy.idleMs / 4)));
    this.timer.unref();
  }

  get size(): number {
    let n = 0;
    for (const l of this.ready.values()) n += l.length;
    return n;
  }

  /**
   * A standby of the snapshot for a fork (the caller owns it from now on): a ready one, else
   * the one being started for it, which is further along than a new spawn (only one claim
   * waits for it; the other children of a fork spawn at once); undefined if neither. The wait
   * raises the launch to nice 0 and lasts at most CLAIM_WAIT_MS, or until `signal` aborts:
   * then undefined, and the standby goes to `ready` when it is.
   */
  async claim(snapshotId: string, o: { waitForLaunching?: boolean; signal?: AbortSignal } = {}): Promise<Standby | undefined> {
    const s = this.take(snapshotId);
    const l = this.launching;
    if (s || l?.snapshotId !== snapshotId || l.awaited || o.waitForLaunching === false || o.signal?.aborted) return s;
    l.awaited = true;
    l.urgency.urge();
    const ended = await new Promise<'launched' | 'late' | 'aborted'>((resolve) => {
      const end = (why: 'launched' | 'late' | 'aborted'): void => {
        clearTimeout(timer);
        o.signal?.removeEventListener('abort', abort);
        resolve(why);
      };
      const abort = (): void => end('aborted');
      const timer = setTimeout(() => end('late'), CLAIM_WAIT_MS);
      o.signal?.addEventListener('abort', abort, { once: true });
      void l.done.then(() => end('launched'), () => end('launched'));
    });
    return ended === 'launched' ? this.take(snapshotId) : undefined;
  }

  /** Takes a ready standby of the snapshot, or undefined. */
  private take(snapshotId: string): Standby | undefined {
    const w = this.wants.get(snapshotId);
    if (w) w.lastUse = this.clock.now();
    const list = this.ready.get(snapshotId);
    const s = list?.shift();
    if (list && list.length === 0) this.ready.delete(snapshotId);
    return s;
  }

  /**
   * Demand for n children of the snapshot (a fork of n, or 1 for a snapshot just taken): keep
   * min(n, perSnapshot) standbys of it, started in the background.
   */
  demand(snapshot: T, n: number): void {
    if (this.policy.perSnapshot <= 0) return;
    void this.warm(snapshot, Math.min(n, this.policy.perSnapshot)).catch((e: unknown) => this.log.warn({ snapshotId: snapshot.manifest.snapshotId, err: String(e) }, 'warming standbys failed'));
  }

  /**
   * demand(snapshot, n) once no further call for the snapshot came for `quietMs`: a burst of
   * restores starts no standby between its restores, where it would take CPU from the next
   * one, and leaves one ready for the next burst.
   */
  demandWhenQuiet(snapshot: T, n: number, quietMs: number): void {
    if (this.closed || this.policy.perSnapshot <= 0) return;
    const id = snapshot.manifest.snapshotId;
    clearTimeout(this.quiet.get(id));
    const t = setTimeout(() => {
      this.quiet.delete(id);
      this.demand(snapshot, n);
    }, quietMs);
    t.unref();
    this.quiet.set(id, t);
  }

  /**
   * Asks for `count` standbys of the snapshot (capped by the host-wide max) and resolves when
   * the pool has done what it can: the number of ready standbys of the snapshot.
   */
  async warm(snapshot: T, count: number): Promise<number> {
    const id = snapshot.manifest.snapshotId;
    if (this.closed || this.policy.max <= 0 || count <= 0) return this.ready.get(id)?.length ?? 0;
    const w = this.wants.get(id);
    if (w) {
      w.count = Math.max(w.count, count);
      w.lastUse = this.clock.now();
    } else this.wants.set(id, { snapshot, count, lastUse: this.clock.now() });
    // A loop that had just decided to stop (its `finally` not run yet) would not see this
    // want: after it ends, start another while the want is unmet and there is room.
    for (let i = 0; i < 3 && !this.closed; i++) {
      this.loop ??= this.fill().finally(() => (this.loop = undefined));
      await this.loop;
      const want = this.wants.get(id);
      if (!want || (this.ready.get(id)?.length ?? 0) >= want.count || this.size + (this.launching ? 1 : 0) >= this.policy.max) break;
    }
    return this.ready.get(id)?.length ?? 0;
  }

  /** One standby at a time: starting QEMUs in parallel would only compete with live forks for CPU. */
  private async fill(): Promise<void> {
    for (;;) {
      if (this.closed) return;
      const next = [...this.wants.values()].find((w) => (this.ready.get(w.snapshot.manifest.snapshotId)?.length ?? 0) < w.count);
      // size counts the ready standbys; the one about to start keeps size + 1 <= max.
      if (!next || this.size >= this.policy.max) return;
      const id = next.snapshot.manifest.snapshotId;
      try {
        const urgency = new Urgency();
        const launched = this.launch(next.snapshot, urgency);
        this.launching = { snapshotId: id, done: launched, awaited: false, urgency };
        const s = await launched;
        if (this.closed || this.wants.get(id) !== next) {
          await this.discard(s);
          continue;
        }
        s.qmp.onClosed(() => this.forget(s));
        const list = this.ready.get(id) ?? [];
        list.push(s);
        this.ready.set(id, list);
        this.log.debug({ snapshotId: id, standby: s.id, ready: list.length }, 'standby ready');
      } catch (e) {
        // A snapshot that cannot be restored here is not retried in a loop. Its want stays for
        // the standbys already ready (capped at them), so they still expire when the snapshot
        // goes unused: without a want, expire() never saw them, and they held a QEMU, the
        // snapshot's image and a slot of the host-wide max until the agent stopped.
        this.log.warn({ snapshotId: id, err: String(e) }, 'standby failed to start');
        const have = this.ready.get(id)?.length ?? 0;
        if (this.wants.get(id) === next && have > 0) next.count = have;
        else this.wants.delete(id);
      } finally {
        this.launching = undefined;
      }
    }
  }

  private clearQuiet(): void {
    for (const t of this.quiet.values()) clearTimeout(t);
    this.quiet.clear();
  }

  /** A standby whose QEMU went away on its own. */
  private forget(s: Standby): void {
    const list = this.ready.get(s.snapshotId);
    const i = list?.indexOf(s) ?? -1;
    if (list && i >= 0) {
      list.splice(i, 1);
      this.log.warn({ snapshotId: s.snapshotId, standby: s.id, pid: s.proc.pid }, 'standby QEMU exited');
      void this.discard(s).catch((e: unknown) => this.log.warn({ standby: s.id, err: String(e) }, 'removing an exited standby failed'));
    }
  }

  /** Stops and removes the snapshot's standbys (before its files go) and stops refilling them. */
  async drop(snapshotId: string): Promise<void> {
    this.wants.delete(snapshotId);
    const list = this.ready.get(snapshotId) ?? [];
    this.ready.delete(snapshotId);
    await Promise.all(list.map((s) => this.discard(s)));
  }

  private async expire(): Promise<void> {
    const now = this.clock.now();
    for (const [id, w] of this.wants) if (now - w.lastUse >= this.policy.idleMs) await this.drop(id);
  }

  /** Stops managing standbys without stopping their processes (an agent handing over to the next; its recover reaps them). */
  abandon(): void {
    this.closed = true;
    clearInterval(this.timer);
    this.clearQuiet();
    const all = [...this.ready.values()].flat();
    this.ready.clear();
    this.wants.clear();
    for (const s of all) s.qmp.close();
  }

  async close(): Promise<void> {
    this.closed = true;
    clearInterval(this.timer);
    this.clearQuiet();
    await this.loop?.catch(() => undefined);
    await Promise.all([...this.ready.keys()].map((id) => this.drop(id)));
  }
}
