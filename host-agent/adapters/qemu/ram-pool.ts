// Guest RAM for VMs restored by migration (ADR 0016): files on a huge-page tmpfs, kept in a
// pool.
//
// A migrated VM's RAM is written page by page by the incoming stream. In anonymous memory of a
// fresh QEMU that costs the kernel a new page for every fault, and on a host whose free memory
// goes back to a hypervisor (free page reporting, as on this nested dev machine) ~1 s of system
// time per 256 MiB, on the restore's critical path. A file on a `huge=always` tmpfs whose
// pages exist already maps into QEMU (share=on, align=2M) with one fault per 2 MiB, ~5 ms for
// 256 MiB. The VM's memory then is that file. When the VM goes, its file goes back to the pool
// (up to `keep`): its pages stay allocated, so the next migrated VM of that size finds memory
// that is already there, without a fill. Reusing a file that held another VM's memory is safe
// because a precopy migration writes every page of guest RAM before the guest runs: non-zero
// pages with their data, zero pages by a marker the destination turns into a memset of any
// page that is not zero already (QEMU's ram_handle_zero); a VM whose load fails never runs.
// When no file of a size is free, one is written with zeros in the background (`dd`, nice 19).
//
// Layout: <mount>/<key>/ (key: a digest of the driver's root, so agents sharing a machine never
//   share files)
//   vm-<vmId>.ram      the RAM of a live VM (the driver recycles or removes it with the VM's workdir)
//   free-<mib>-<n>.ram a file no VM uses: written with zeros, or the RAM of a VM that is gone
//   .fill-<mib>-<n>    a fill in progress (a crash leaves it; open() removes it)
// Invariants: a file is free or belongs to exactly one VM, never both (take() renames);
// free files plus the filled ones incoming standbys hold <= keep and their sizes add up to
// <= maxMib; at most one fill runs at a time; a file is recycled only once its QEMU is gone.
import { EventEmitter } from 'node:events';
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import { mkdir, readdir, readFile, rename, rm, rmdir, stat } from 'node:fs/promises';
import { join } from 'node:path';
import { promisify } from 'node:util';
import type { Logger } from 'pino';
import { tiedToUs } from '../tied.ts';

const run = promisify(execFile);

export interface RamPoolOptions {
  /** The huge-page tmpfs (FF_RAM_MOUNT). Mounted here when nothing is. */
  mount: string;
  /** Free files kept, all sizes together (FF_RAM_POOL). 0: files are made on demand and removed after. */
  keep: number;
  /** Their total size at most, MiB (FF_RAM_POOL_MAX_MIB): a bigger guest's RAM is never kept or filled. */
  maxMib: number;
  /** Guest sizes (MiB) filled at open, before any restore asks (FF_RAM_POOL_MIB). */
  prefillMib?: readonly number[];
  /**
   * How long `take(..., { waitForFill })` waits for a gone VM's file before it starts a fill
   * (default RECYCLE_WAIT_MS).
   */
  recycleWaitMs?: number;
  logger: Logger;
}

/**
 * A standby's wait for a gone VM's file before it fills one: VMs of a size that just migrated
 * in tend to go soon (a rollout's children), and a fill costs ~1 s of CPU per 256 MiB here.
 */
export const RECYCLE_WAIT_MS = 2000;

/** FF_RAM_MOUNT's default. */
export const DEFAULT_RAM_MOUNT = '/run/forkfleet/ram';

/** The directory a driver rooted at `root` keeps its RAM files in (also for fleet:down's sweep). */
export function ramDirFor(mount: string, root: string): string {
  return join(mount, createHash('sha256').update(root).digest('hex').slice(0, 16));
}

/** The file that is (or will be) the RAM of `vmId`. */
export function ramFileOf(dir: string, vmId: string): string {
  return join(dir, `vm-${vmId}.ram`);
}

/** Options of the tmpfs mounted at `path`, or undefined when no tmpfs is mounted exactly there. */
export async function tmpfsOptions(path: string): Promise<string[] | undefined> {
  const mounts = await readFile('/proc/self/mountinfo', 'utf8');
  let found: string[] | undefined;
  for (const line of mounts.split('\n')) {
    const [pre, post] = line.split(' - ');
    const fields = pre?.split(' ') ?? [];
    const rest = post?.split(' ') ?? [];
    // The last mount at a path is the one that shows.
    if (fields[4] === path) found = rest[0] === 'tmpfs' ? (rest[2] ?? '').split(',') : undefined;
  }
  return found;
}

export class RamPool {
  /** Free files by size (MiB), oldest first. */
  private readonly free = new Map<number, string[]>();
  /** Sizes asked for, most recent last: what fills make. */
  private readonly demand: number[] = [];
  private filling: { child: ChildProcess; path: string; mib: number; done: Promise<void> } | undefined;
  /**
   * Fills not yet settled (`filling` is cleared as soon as a fill's process ends, while its file
   * is still being made a free one: filled()) and free files on their way in (addFree); close()
   * waits for these, or one landing after it had removed the free files was left behind.
   */
  private readonly settling = new Set<Promise<void>>();
  /** 'free' (mib): a free file of that size was added (filled or given back). */
  private readonly arrivals = new EventEmitter();
  private closed = false;
  /**
   * Free files on their way in (a recycle's or a fill's rename under way), counted by roomFor
   * as if they were in `free` already: room is taken when it is checked, before the await, so
   * VMs destroyed together cannot all find the same room free and keep more than the limits.
   */
  private readonly adding = { files: 0, mib: 0 };
  /**
   * Filled files taken by incoming standbys (`take(..., { waitForFill })`), by standby id: MiB.
   * Counted by roomFor like free ones until the standby's VM adopts the file (adopted()) or it
   * comes back (recycle, release): a standby belongs to no VM, so no scheduler books its RAM,
   * and without them refill made free files again in the room they took.
   */
  private readonly held = new Map<string, number>();

  private constructor(
    readonly dir: string,
    private readonly o: RamPoolOptions,
  ) {}

  /**
   * The pool of a driver rooted at `root`, or undefined (logged) when there is no huge-page
   * tmpfs at `mount` and one cannot be mounted: VMs then get anonymous RAM, as before.
   * A tmpfs without huge pages is refused: its 4 KiB faults cost more than anonymous THP.
   */
  static async open(root: string, o: RamPoolOptions): Promise<RamPool | undefined> {
    try {
      let opts = await tmpfsOptions(o.mount);
      if (!opts) {
        await mkdir(o.mount, { recursive: true, mode: 0o700 });
        // size=100%: the scheduler books host memory; the mount must never be the tighter limit
        // (a full tmpfs would fault the guest's RAM with SIGBUS).
        await run('mount', ['-t', 'tmpfs', '-o', 'huge=always,size=100%,mode=0700', 'forkfleet-ram', o.mount]);
        opts = await tmpfsOptions(o.mount);
      }
      if (!opts?.includes('huge=always')) {
        o.logger.warn({ mount: o.mount, options: opts?.join(',') }, 'RAM pool off: the mount is not a tmpfs with huge=always');
        return undefined;
      }
      const pool = new RamPool(ramDirFor(o.mount, root), o);
      await mkdir(pool.dir, { recursive: true, mode: 0o700 });
      for (const f of await readdir(pool.dir)) {
        const m = /^free-(\d+)-[0-9a-f]+\.ram$/.exec(f);
        if (m) pool.freeOf(Number(m[1])).push(join(pool.dir, f));
        else if (f.startsWith('.fill-')) await rm(join(pool.dir, f), { force: true });
      }
      // Left by an agent with other settings (a larger FF_RAM_POOL, a larger keep): only what
      // fits this one's is kept. The rest would pin host RAM that nothing counts.
      await pool.trim();
      pool.demand.push(...(o.prefillMib ?? []));
      pool.refill();
      return pool;
    } catch (e) {
      o.logger.warn({ mount: o.mount, err: String(e) }, 'RAM pool off: no huge-page tmpfs');
      return undefined;
    }
  }

  /** Removes free files, the largest first, until they fit `keep` and `maxMib`. */
  private async trim(): Promise<void> {
    const total = (): number => [...this.free].reduce((n, [m, l]) => n + m * l.length, 0);
    while (this.size > 0 && (this.size > this.o.keep || total() > this.o.maxMib)) {
      const largest = Math.max(...[...this.free].filter(([, l]) => l.length > 0).map(([m]) => m));
      const f = this.freeOf(largest).pop()!;
      await rm(f, { force: true });
      this.o.logger.info({ file: f, keep: this.o.keep, maxMib: this.o.maxMib }, 'RAM pool: a free file left by an earlier agent is over this one\'s limits: removed');
    }
  }

  /** Whether one more free file of `mib` stays within `keep` and `maxMib` (counting those being added and those standbys hold). */
  private roomFor(mib: number): boolean {
    let total = this.adding.mib;
    for (const [m, l] of this.free) total += m * l.length;
    for (const m of this.held.values()) total += m;
    return this.size + this.adding.files + this.held.size < this.o.keep && total + mib <= this.o.maxMib;
  }

  /**
   * Renames `from` to the free file `to` (of `mib`) and adds it to the pool; false if the rename
   * failed. The caller has checked roomFor in the same synchronous step: the room is held from
   * there until the file is in `free` (or the rename failed).
   */
  private addFree(from: string, to: string, mib: number): Promise<boolean> {
    this.adding.files++;
    this.adding.mib += mib;
    const added = rename(from, to).then(() => true, () => false).then((ok) => {
      this.adding.files--;
      this.adding.mib -= mib;
      if (ok) {
        this.freeOf(mib).push(to);
        this.arrivals.emit('free', mib);
      }
      return ok;
    });
    this.settle(added);
    return added;
  }

  /** Has close() wait for `p` (which never rejects). */
  private settle(p: Promise<unknown>): void {
    const settled = p.then(() => undefined);
    this.settling.add(settled);
    void settled.then(() => this.settling.delete(settled));
  }

  /** Filled files ready now, all sizes. */
  get size(): number {
    let n = 0;
    for (const l of this.free.values()) n += l.length;
    return n;
  }

  /**
   * The RAM file for `vmId` (size `mib`): a free one when there is one of that size, else a path
   * QEMU creates. The size is remembered for `refill()`, which the caller makes once the VM is
   * loaded, so a fill never competes with the load. `waitForFill`: the taker is an incoming
   * standby (see `held`).
   */
  async take(vmId: string, mib: number, o: { waitForFill?: boolean } = {}): Promise<{ path: string; filled: boolean }> {
    const path = ramFileOf(this.dir, vmId);
    this.demand.push(mib);
    if (this.demand.length > 8) this.demand.shift();
    // Background work (an incoming standby) waits for a filled file: a gone VM's file given
    // back (or a fill already running) for a while, then one filled for it, unless a VM's
    // file comes back first.
    if (o.waitForFill && this.freeOf(mib).length === 0) {
      await this.arrival(mib, this.o.recycleWaitMs ?? RECYCLE_WAIT_MS);
      if (this.freeOf(mib).length === 0 && !this.closed) {
        this.refill();
        if (this.filling?.mib === mib) await this.arrival(mib);
      }
    }
    const list = this.freeOf(mib);
    let filled = false;
    while (list.length > 0 && !filled) {
      const f = list.shift()!;
      // Only an incoming standby waits for a fill: its file stays counted (see `held`), from
      // the moment it leaves `free`.
      if (o.waitForFill) this.held.set(vmId, mib);
      filled = await rename(f, path).then(() => true, () => false);
    }
    if (!filled) this.held.delete(vmId);
    return { path, filled };
  }

  /** The incoming standby `id` became a VM (its file renamed after it): the scheduler books that RAM now. */
  adopted(id: string): void {
    this.held.delete(id);
  }

  /**
   * Resolves when a free file of `mib` arrives, when the fill running now (if it is of that
   * size) ends, or after `ms`.
   */
  private arrival(mib: number, ms?: number): Promise<void> {
    const fill = this.filling?.mib === mib ? this.filling : undefined;
    return new Promise((resolve) => {
      const onFree = (m: number): void => {
        if (m === mib) done();
      };
      const done = (): void => {
        clearTimeout(timer);
        this.arrivals.off('free', onFree);
        resolve();
      };
      const timer = ms === undefined ? undefined : setTimeout(done, ms);
      this.arrivals.on('free', onFree);
      void fill?.done.then(done);
    });
  }

  /** Removes the RAM file of `vmId` (its VM is gone); nothing if there is none. */
  async release(vmId: string): Promise<void> {
    this.held.delete(vmId);
    await rm(ramFileOf(this.dir, vmId), { force: true });
  }

  /**
   * The RAM file of `vmId`, whose QEMU has exited, goes back to the pool while that keeps it
   * within `keep` files and `maxMib`; otherwise it is removed. Nothing if there is none.
   */
  async recycle(vmId: string): Promise<void> {
    // A standby's file stops being held even when it is gone already (claimed and renamed).
    this.held.delete(vmId);
    const path = ramFileOf(this.dir, vmId);
    const st = await stat(path).catch(() => undefined);
    if (!st) return;
    const mib = st.size / 1048576;
    if (!this.closed && Number.isInteger(mib) && mib > 0 && this.roomFor(mib)) {
      const free = join(this.dir, `free-${mib}-${randomBytes(6).toString('hex')}.ram`);
      if (await this.addFree(path, free, mib)) return;
    }
    await rm(path, { force: true });
  }

  /** Removes every VM file whose VM is not in `live` (after an agent restart). */
  async reap(live: ReadonlySet<string>): Promise<string[]> {
    const reaped: string[] = [];
    for (const f of await readdir(this.dir).catch(() => [] as string[])) {
      const m = /^vm-(.+)\.ram$/.exec(f);
      if (m && !live.has(m[1]!)) {
        await rm(join(this.dir, f), { force: true });
        reaped.push(m[1]!);
      }
    }
    return reaped;
  }

  /** Stops a fill, removes the free files and, once no VM file is left, the directory. */
  async close(): Promise<void> {
    this.closed = true;
    this.filling?.child.kill('SIGKILL');
    // Also a fill whose process has ended, and a fill's or a recycled file's rename into a free
    // one: a close() in that moment removed the free files before it landed, and it was left
    // behind. Each started before `closed` was set (both check it in the same synchronous step).
    await Promise.all(this.settling);
    for (const l of this.free.values()) for (const p of l.splice(0)) await rm(p, { force: true });
    await rmdir(this.dir).catch(() => undefined);
  }

  private freeOf(mib: number): string[] {
    let l = this.free.get(mib);
    if (!l) this.free.set(mib, (l = []));
    return l;
  }

  /**
   * One fill at a time, in the background at nice 19 (a `dd` of zeros: writing is what makes
   * the pages, so a later mapping only faults them in), of the most recently asked size that
   * has no free file and fits within `keep` and `maxMib`. Files of VMs that are gone come back
   * by `recycle`, so in a steady state nothing is filled: on a host whose free memory goes
   * back to the hypervisor a fill costs ~1 s of CPU per 256 MiB that nice does not hold back.
   */
  refill(): void {
    if (this.closed || this.filling) return;
    const mib = [...this.demand].reverse().find((m) => this.freeOf(m).length === 0 && m > 0 && this.roomFor(m));
    if (mib === undefined) return;
    const n = randomBytes(6).toString('hex');
    const path = join(this.dir, `.fill-${mib}-${n}`);
    // Tied to the agent, which removes a killed agent's .fill files at start.
    const child = spawn(...tiedToUs('nice', ['-n', '19', 'dd', 'if=/dev/zero', `of=${path}`, 'bs=1M', `count=${mib}`, 'status=none']), { stdio: 'ignore' });
    const t0 = Date.now();
    const done = new Promise<void>((resolve) => {
      let ended = false;
      const end = (code: number | null): void => {
        if (ended) return;
        ended = true;
        // Settles whatever filled() meets (a failed rename or rm): close() and take({waitForFill}) wait on it.
        void this.filled(path, mib, n, code, Date.now() - t0).then(resolve, (e: unknown) => {
          this.o.logger.warn({ mib, err: String(e) }, 'RAM pool fill failed');
          resolve();
        });
      };
      child.on('error', () => end(null));
      child.once('close', end);
    });
    this.filling = { child, path, mib, done };
    this.settle(done);
  }

  private async filled(path: string, mib: number, n: string, code: number | null, ms: number): Promise<void> {
    this.filling = undefined;
    if (code !== 0 || this.closed) {
      await rm(path, { force: true });
      if (!this.closed) this.o.logger.warn({ mib, code }, 'RAM pool fill failed');
      return;
    }
    // A recycled file may have taken the room while this one was being written.
    if (!this.roomFor(mib)) {
      await rm(path, { force: true });
      return;
    }
    const free = join(this.dir, `free-${mib}-${n}.ram`);
    if (await this.addFree(path, free, mib)) {
      this.o.logger.debug({ mib, ms, ready: this.size }, 'RAM pool file filled');
    }
    this.refill();
  }
}
