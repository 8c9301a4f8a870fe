// What the scheduler knows about hosts between etcd reads: the last heartbeat of each
// host (held in memory by every replica) merged with the etcd records (cordon, drain,
// booked capacity). Liveness is derived from heartbeat age.
import type { HeartbeatMsg } from './messages.ts';
import type { HostAllocRec, HostRec, HostState, SnapshotRec } from './records.ts';
import { vmConfigFault, type FleetViewInput, type HostInput, type SnapshotInput } from '../../scheduler/index.ts';

export interface LivenessConfig {
  /** Heartbeats older than this make a host suspect. */
  suspectAfterMs: number;
  /** Heartbeats older than this make a host lost. */
  lostAfterMs: number;
}

export interface HeardHost {
  hb: HeartbeatMsg;
  /** Local receive time (ms), on the wall clock as it reads now (see HeartbeatRegistry). */
  readonly heardAt: number;
  /** When this replica first heard the host's current boot id after another one (ms, as heardAt); 0 if it never saw it change. */
  readonly bootChangedAt: number;
}

/** How far the wall clock is ahead of the monotonic one: it changes only when the wall clock is stepped. */
const wallOffset = (): number => Date.now() - performance.now();

/**
 * A heartbeat and when it was heard. The times are kept with the wall clock's offset from the
 * monotonic clock at the time, and read back shifted by any step of the wall clock since
 * (an NTP correction, an operator's `date -s`): ages taken against the wall clock's `now`
 * stay true. Without this, a step forward of more than FF_HOST_LOST_AFTER marked every host
 * lost at once, with all their sandboxes, and a step back kept dead hosts ready for as long.
 */
class Heard implements HeardHost {
  private readonly offset = wallOffset();
  constructor(
    readonly hb: HeartbeatMsg,
    private readonly at: number,
    private readonly bootAt: number,
  ) {}
  get heardAt(): number {
    return this.at + this.stepped();
  }
  get bootChangedAt(): number {
    return this.bootAt === 0 ? 0 : this.bootAt + this.stepped();
  }
  /** The wall clock's steps since this was heard (ms); under a second is read jitter, not a step. */
  private stepped(): number {
    const d = wallOffset() - this.offset;
    return Math.abs(d) < 1000 ? 0 : Math.round(d);
  }
}

export function livenessOf(heardAt: number | undefined, now: number, cfg: LivenessConfig): HostState {
  if (heardAt === undefined) return 'lost';
  const age = now - heardAt;
  if (age > cfg.lostAfterMs) return 'lost';
  if (age > cfg.suspectAfterMs) return 'suspect';
  return 'ready';
}

type VmStatusMsg = HeartbeatMsg['vms'][number];

export class HeartbeatRegistry {
  private readonly hosts = new Map<string, HeardHost>();

  /** `onUnreadable`: told once per heartbeat whose VM list does not decode (see vms()). */
  constructor(private readonly onUnreadable?: (hostId: string, err: unknown) => void) {}

  record(hb: HeartbeatMsg, now: number): { isNew: boolean; restarted: boolean } {
    const prev = this.hosts.get(hb.hostId);
    const restarted = prev !== undefined && prev.hb.bootId !== hb.bootId;
    this.hosts.set(hb.hostId, new Heard(hb, now, restarted ? now : (prev?.bootChangedAt ?? 0)));
    return { isNew: prev === undefined, restarted };
  }

  get(hostId: string): HeardHost | undefined {
    return this.hosts.get(hostId);
  }

  /** Drops a host's last heartbeat (a removed host that stays silent). */
  forget(hostId: string): void {
    this.hosts.delete(hostId);
  }

  /**
   * A VM's status in the host's last heartbeat. Indexed once per heartbeat: the lifecycle
   * rules ask for every sandbox on a host, and a scan of the VM list each time was
   * quadratic in the VMs per host. Null when that heartbeat's VM list does not decode (vms()).
   */
  vm(hostId: string, sandboxId: string): VmStatusMsg | undefined | null {
    const hb = this.hosts.get(hostId)?.hb;
    if (!hb) return undefined;
    let idx = vmIndex.get(hb);
    if (idx === undefined) {
      const vms = this.vmsOf(hb);
      vmIndex.set(hb, (idx = vms ? new Map(vms.map((v) => [v.sandboxId, v])) : null));
    }
    return idx === null ? null : idx.get(sandboxId);
  }

  /**
   * The VMs the host's last heartbeat lists: undefined when it was not heard, or when that
   * list does not decode. The bus decodes it only when read (decodeHeartbeat), after the
   * beat was taken in, so a malformed one shows here; nothing may be decided from it (read as
   * "no VMs", every sandbox of the host would look gone), and one host's bad beat must not
   * throw out of a check that goes over the whole fleet. vm() answers null for it.
   */
  vms(hostId: string): readonly VmStatusMsg[] | undefined {
    const hb = this.hosts.get(hostId)?.hb;
    return hb ? this.vmsOf(hb) : undefined;
  }

  private vmsOf(hb: HeartbeatMsg): readonly VmStatusMsg[] | undefined {
    try {
      return hb.vms;
    } catch (e) {
      if (!unreadable.has(hb)) {
        unreadable.add(hb);
        this.onUnreadable?.(hb.hostId, e);
      }
      return undefined;
    }
  }

  /** Whether the host's last heartbeat lists `snapshotId` as complete (indexed once per heartbeat). */
  holds(hostId: string, snapshotId: string): boolean {
    const hb = this.hosts.get(hostId)?.hb;
    return hb ? completeSnapshots(hb).has(snapshotId) : false;
  }

  all(): HeardHost[] {
    return [...this.hosts.values()];
  }

  /** Hosts whose snapshot list contains `snapshotId` as complete. */
  holders(snapshotId: string): string[] {
    const out: string[] = [];
    for (const h of this.hosts.values()) if (completeSnapshots(h.hb).has(snapshotId)) out.push(h.hb.hostId);
    return out;
  }
}

/** Per-heartbeat indexes (a heartbeat message is never changed once recorded). */
const vmIndex = new WeakMap<HeartbeatMsg, Map<string, VmStatusMsg> | null>();
const unreadable = new WeakSet<HeartbeatMsg>();
const snapshotIndex = new WeakMap<HeartbeatMsg, Set<string>>();
const imageIndex = new WeakMap<HeartbeatMsg, Readonly<Record<string, string>>>();

/**
 * The images a heartbeat says its host has built, `<name>-<recipeHash>` -> base disk sha256
 * (HostVmm.images); undefined for an agent that says nothing (none built, or one that
 * predates the field): nothing is known then.
 */
export function builtImages(hb: HeartbeatMsg): Readonly<Record<string, string>> | undefined {
  if (hb.images.length === 0) return undefined;
  let m = imageIndex.get(hb);
  if (!m) {
    const out: Record<string, string> = {};
    for (const i of hb.images) if (i.name && i.recipeHash && i.diskSha256) out[`${i.name}-${i.recipeHash}`] = i.diskSha256;
    imageIndex.set(hb, (m = out));
  }
  return m;
}

const recipeIndex = new WeakMap<HeartbeatMsg, Readonly<Record<string, string>>>();

/**
 * The recipe a heartbeat's host builds each image by now, image name -> recipe hash
 * (HostVmm.recipes); undefined for an agent that says none (one that predates HostImage.current).
 */
export function currentRecipes(hb: HeartbeatMsg): Readonly<Record<string, string>> | undefined {
  let m = recipeIndex.get(hb);
  if (!m) {
    const out: Record<string, string> = {};
    for (const i of hb.images) if (i.current && i.name && i.recipeHash) out[i.name] = i.recipeHash;
    recipeIndex.set(hb, (m = out));
  }
  return Object.keys(m).length > 0 ? m : undefined;
}

function completeSnapshots(hb: HeartbeatMsg): Set<string> {
  let set = snapshotIndex.get(hb);
  if (!set) snapshotIndex.set(hb, (set = new Set(hb.snapshots.filter((s) => s.complete).map((s) => s.snapshotId))));
  return set;
}

/** The lower median of `values` (the smaller middle one of an even count); undefined when empty. */
function lowerMedian(values: number[]): number | undefined {
  if (values.length === 0) return undefined;
  values.sort((a, b) => a - b);
  return values[(values.length - 1) >> 1];
}

/** Samples older than this no longer price a host's fetches (as restore_cost_ms, ADR 0006). */
export const FETCH_RATE_WINDOW_MS = 10 * 60_000;
/** Samples kept per host: its last few fetches. */
const FETCH_RATE_SAMPLES = 8;

/**
 * Bytes per second each host got on its last fetches of a snapshot for a restore, over the
 * last FETCH_RATE_WINDOW_MS. A host's rate is the median of its samples in the window. Old
 * samples drop out: a host that placement avoided after one slow fetch gets no new samples,
 * and would otherwise keep that price for good; a host that left the fleet is forgotten.
 */
export class FetchRates {
  private readonly byHost = new Map<string, { at: number; rate: number }[]>();

  note(hostId: string, bytesPerS: number, now: number): void {
    if (!(bytesPerS > 0) || !Number.isFinite(bytesPerS)) return;
    let samples = this.byHost.get(hostId);
    if (!samples) this.byHost.set(hostId, (samples = []));
    samples.push({ at: now, rate: bytesPerS });
    if (samples.length > FETCH_RATE_SAMPLES) samples.shift();
  }

  /** Each host's rate now; hosts with no sample in the window are left out (and forgotten). */
  current(now: number): Map<string, number> {
    const out = new Map<string, number>();
    for (const [hostId, samples] of this.byHost) {
      const live = samples.filter((s) => now - s.at <= FETCH_RATE_WINDOW_MS);
      if (live.length === 0) { this.byHost.delete(hostId); continue; }
      if (live.length < samples.length) this.byHost.set(hostId, live);
      out.set(hostId, lowerMedian(live.map((s) => s.rate)) as number);
    }
    return out;
  }
}

/** How long a planned copy counts as link load at most (LinkLoads). */
const LINK_LOAD_MAX_MS = 10 * 60_000;

/**
 * How long after its planned end a copy's bytes still count on its destination's disk
 * (LinkLoads.pendingDiskMib): until a heartbeat after the copy ended counts them in the host's
 * chunk store, a few seconds, longer when the copy ran late.
 */
const PENDING_DISK_GRACE_MS = 15_000;

/** A planned transfer's link use and the disk it takes, as LinkLoads keeps it. */
interface LinkUse {
  readonly src: string;
  readonly dst: string;
  /** Bytes per second it takes of the source's uplink and the destination's downlink. */
  readonly rate: number;
  /** When it is planned to end (ms, the scheduler's clock). */
  readonly until: number;
  /** Stored bytes it copies onto the destination's disk. */
  readonly bytes: number;
  /** Until when those bytes count on that disk (until + PENDING_DISK_GRACE_MS). */
  readonly diskUntil: number;
}

/**
 * The transfers this leader planned and expects still to run: each takes its planned rate of
 * its source's uplink and its destination's downlink until its planned end. Placement sees
 * them as link load (HostLink rx/txLoadBytesPerS): two forks decided a moment apart both saw
 * the one holder's uplink idle, and planned their copies from it at its full rate. Their bytes
 * count on their destinations' disks too (pendingDiskMib) until heartbeats count them: a
 * booking holds only a sandbox's overlay, so two wakes decided a moment apart each saw the
 * disk a cold host had before either copy, and both copied there, past its capacity.
 */
export class LinkLoads {
  private uses: LinkUse[] = [];

  /** Adds the transfers of a plan decided at `now` (their times are from then); returns them, for `remove`. */
  add(transfers: ReadonlyArray<{ sourceHostId: string; destinationHostId: string; bytes: number; startMs: number; readyAtMs: number }>, now: number): readonly LinkUse[] {
    const added: LinkUse[] = [];
    for (const t of transfers) {
      if (!(t.bytes > 0)) continue;
      const ms = t.readyAtMs - t.startMs;
      const timed = ms > 0 && Number.isFinite(ms);
      // At most LINK_LOAD_MAX_MS: a copy planned over a link priced near nothing would count for days.
      const until = now + (timed ? Math.min(t.readyAtMs, LINK_LOAD_MAX_MS) : 0);
      added.push({ src: t.sourceHostId, dst: t.destinationHostId, rate: timed ? (t.bytes * 1000) / ms : 0, until, bytes: t.bytes, diskUntil: until + PENDING_DISK_GRACE_MS });
    }
    this.uses.push(...added);
    return added;
  }

  /** Takes back transfers `add` returned (their plan was not committed). */
  remove(added: readonly LinkUse[]): void {
    const gone = new Set(added);
    this.uses = this.uses.filter((u) => !gone.has(u));
  }

  /** Per host, the bytes per second its planned transfers take inbound (rx) and outbound (tx) now; ended ones are forgotten. */
  current(now: number): Map<string, { rx: number; tx: number }> {
    this.uses = this.uses.filter((u) => u.diskUntil > now);
    const out = new Map<string, { rx: number; tx: number }>();
    const at = (id: string): { rx: number; tx: number } => {
      let l = out.get(id);
      if (!l) out.set(id, (l = { rx: 0, tx: 0 }));
      return l;
    };
    for (const u of this.uses) {
      if (u.until <= now || u.rate === 0) continue;
      at(u.src).tx += u.rate;
      at(u.dst).rx += u.rate;
    }
    return out;
  }

  /** Per destination host, the MiB its planned copies write to its disk that its heartbeats may not count yet. */
  pendingDiskMib(now: number): Map<string, number> {
    const bytes = new Map<string, number>();
    for (const u of this.uses) if (u.diskUntil > now) bytes.set(u.dst, (bytes.get(u.dst) ?? 0) + u.bytes);
    return new Map([...bytes].map(([h, b]) => [h, Math.ceil(b / (1024 * 1024))]));
  }
}

/** How long a host's word that it stored a snapshot is kept for a wait that begins after it came (SnapshotStoredSignals). */
const STORED_SIGNAL_KEEP_MS = 10 * 60_000;

/**
 * Hosts' word that a snapshot they fetched for a restore is stored, durably, there
 * (HOST_EVENT_TYPE_SNAPSHOT_STORED): a relay of a fork's transfer tree can serve onward from
 * then on. Its next wave waited for the relay's whole restore step before, which also starts
 * the relay's own children and runs their after_resume hooks: every wave added the relay's
 * restores and its slowest hook, none of it in the plan. Best effort: a wait also ends with
 * the relay's step (the caller races them), so a lost event costs only that.
 */
export class SnapshotStoredSignals {
  private readonly waiting = new Map<string, Set<() => void>>();
  /** When each `<op>/<host>/<snapshot>` was said stored (a wait that begins after the word). */
  private readonly heardAt = new Map<string, number>();

  /** `opId`: the operation whose step fetched it (a word of another op's fetch, since deleted there, says nothing of this one's). */
  heard(opId: string, hostId: string, snapshotId: string, now: number): void {
    const key = `${opId}/${hostId}/${snapshotId}`;
    this.heardAt.delete(key);
    this.heardAt.set(key, now);
    // Oldest first (Map order): forget what no wait can still want.
    for (const [k, at] of this.heardAt) {
      if (now - at <= STORED_SIGNAL_KEEP_MS) break;
      this.heardAt.delete(k);
    }
    const ws = this.waiting.get(key);
    this.waiting.delete(key);
    for (const w of ws ?? []) w();
  }

  /** Resolves once `hostId` says it stored `snapshotId` for `opId` (at once if it said so already); `cancel` drops the wait. */
  when(opId: string, hostId: string, snapshotId: string): { stored: Promise<void>; cancel: () => void } {
    const key = `${opId}/${hostId}/${snapshotId}`;
    if (this.heardAt.has(key)) return { stored: Promise.resolve(), cancel: () => undefined };
    let done!: () => void;
    const stored = new Promise<void>((r) => (done = r));
    let ws = this.waiting.get(key);
    if (!ws) this.waiting.set(key, (ws = new Set()));
    ws.add(done);
    return {
      stored,
      cancel: () => {
        const cur = this.waiting.get(key);
        cur?.delete(done);
        if (cur?.size === 0) this.waiting.delete(key);
      },
    };
  }
}

/** The most of a link planned transfers count as taken: a link never looks wholly taken (its transfers may end early). */
const MAX_LINK_LOAD = 0.9;

/** Builds the placement library's input from etcd records plus heartbeats. */
/**
 * The hosts in id order. The library breaks ties and samples by a host's place in the view:
 * in the cache's order (registration order on a long-running leader, key order after a load
 * or a failover) the same decision came out differently on two replicas, and a decision did
 * not replay from its explanation after a restart. Sorted only when not already (the leader
 * passes FleetCache.hostsById(), sorted once per host that comes or goes).
 */
function byId(hosts: readonly HostRec[]): readonly HostRec[] {
  for (let i = 1; i < hosts.length; i++) {
    if ((hosts[i - 1] as HostRec).id > (hosts[i] as HostRec).id) return [...hosts].sort((a, b) => (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
  }
  return hosts;
}

/**
 * A host's booked resources plus the disk its snapshot store takes (its last heartbeat's
 * chunk_store_bytes and image_cache_bytes: the chunks, and the materialised images of the
 * snapshots restored there) and `pendingMib`, copies planned there that no heartbeat counts
 * yet. Bookings hold only the sandboxes' overlays, while placement asks a host that lacks a
 * snapshot for the MiB it must fetch too: the chunks fetched before (wake replicas, fan-out
 * relays, drain copies) were never subtracted, and wake after wake went to a host whose disk
 * they had filled. Added to what is allocated, not taken from the capacity: a create asking for
 * more than the cache leaves is "no capacity" for now, not larger than any host.
 */
function withChunkCache(allocated: HostAllocRec['allocated'], storeBytes: bigint, pendingMib = 0): HostAllocRec['allocated'] {
  const cacheMib = Math.ceil(Number(storeBytes) / (1024 * 1024)) + pendingMib;
  return cacheMib > 0 ? { ...allocated, diskMib: allocated.diskMib + cacheMib } : allocated;
}

export function fleetViewInput(args: {
  hosts: readonly HostRec[];
  allocs: ReadonlyMap<string, HostAllocRec>;
  heard: HeartbeatRegistry;
  /** The snapshots the placements decided over this view read (the rest are not in the view). */
  snapshots: readonly SnapshotRec[];
  revision: number;
  now: number;
  liveness: LivenessConfig;
  /** Chunk size used by the snapshot store. */
  chunkBytes: number;
  /**
   * Host steps this scheduler has sent and not yet seen finish, per host. A host's queue is
   * the larger of this and its last heartbeat's count: the leader knows its own steps at
   * once, a heartbeat only up to a second later.
   */
  ownInflight?: ReadonlyMap<string, number>;
  /**
   * Bytes per second hosts got fetching a snapshot for a restore (Executor.noteFetchRate). A
   * host's bandwidth is the lower of its link's rate and this, or, not measured yet, the
   * fleet's median of it: on a link of 10 Gbit/s a fetch here moves ~100 MB/s (CPU-bound
   * TLS, migration, decode), and priced at the link's rate, moving a snapshot looked nearly
   * free, so a wake went to a cold host over its warm holder.
   */
  fetchRates?: ReadonlyMap<string, number>;
  /** Link load of the transfers this leader planned that still run (LinkLoads.current). */
  linkLoads?: ReadonlyMap<string, { rx: number; tx: number }>;
  /** Disk the copies this leader planned take on their destinations, not yet in their heartbeats (LinkLoads.pendingDiskMib). */
  pendingDiskMib?: ReadonlyMap<string, number>;
}): FleetViewInput {
  // Which of `snapshots` each host holds, by its record or its last heartbeat: one pass over
  // the snapshots' holders, then an indexed lookup per host and snapshot (not every host
  // against every snapshot, nor every snapshot a heartbeat lists).
  const viewIds = new Set(args.snapshots.map((s) => s.id));
  const recorded = new Map<string, string[]>();
  for (const s of args.snapshots) {
    for (const h of s.hostIds) {
      const list = recorded.get(h);
      if (list) list.push(s.id);
      else recorded.set(h, [s.id]);
    }
  }
  // A host that has not restored anything yet is priced like the fleet's measured hosts (the
  // median of their restore_cost_ms), not at config.restoreCostMs: a static default below
  // what this fleet's restores take (TCG: ~250 ms against 150) made every unmeasured host look
  // cheaper than a warm holder, and a wake or fork went cold, moving the snapshot, for nothing.
  const measured: number[] = [];
  for (const h of args.hosts) {
    const hb = args.heard.get(h.id)?.hb;
    if (hb && hb.restoreCostMs > 0 && hb.restoreSlots > 0) measured.push(hb.restoreCostMs);
  }
  const fleetRestoreMs = lowerMedian(measured);
  const fleetFetchRate = lowerMedian([...(args.fetchRates?.values() ?? [])].filter((r) => r > 0)) ?? Number.POSITIVE_INFINITY;
  const hosts: HostInput[] = byId(args.hosts).map((h) => {
    const heard = args.heard.get(h.id);
    const alloc = args.allocs.get(h.id);
    // A host recorded lost stays lost here until the host pass takes it back (within a
    // second of its heartbeats returning, reclaiming what it had): a step sent to it before
    // that fails at once as sent to a lost host.
    const live = h.state === 'lost' ? 'lost' : livenessOf(heard?.heardAt, args.now, args.liveness);
    // An agent that is stopping heartbeats on while its steps finish: nothing new goes there.
    const state = live === 'ready' && heard?.hb.stopping ? 'suspect' : live;
    const bandwidth = Math.max(1, Math.min(h.linkBytesPerSecond, args.fetchRates?.get(h.id) ?? fleetFetchRate));
    const load = args.linkLoads?.get(h.id);
    const held = new Set<string>(recorded.get(h.id));
    // Children booked as shares of each image here (image-shares.ts): placement prices more of them by the count.
    const shares = alloc?.images && Object.keys(alloc.images).length > 0 ? alloc.images : undefined;
    if (heard) {
      // The smaller side drives the intersection of the host's heard holdings and the view's snapshots.
      const hs = completeSnapshots(heard.hb);
      const [small, large] = hs.size < viewIds.size ? [hs, viewIds] : [viewIds, hs];
      for (const id of small) if (large.has(id)) held.add(id);
    }
    return {
      id: h.id,
      state,
      cordoned: h.cordoned,
      draining: h.draining,
      capacity: h.capacity,
      allocated: withChunkCache(alloc?.allocated ?? { vcpus: 0, memoryMib: 0, diskMib: 0 }, (heard?.hb.chunkStoreBytes ?? 0n) + (heard?.hb.imageCacheBytes ?? 0n), args.pendingDiskMib?.get(h.id)),
      inflightOps: Math.max(heard?.hb.inflightOps ?? 0, args.ownInflight?.get(h.id) ?? 0),
      // The host's measured restore time and its slots price its queue (scheduler/README.md).
      ...(heard && heard.hb.restoreSlots > 0 && (heard.hb.restoreCostMs > 0 || fleetRestoreMs !== undefined) ? { restoreCostMs: heard.hb.restoreCostMs > 0 ? heard.hb.restoreCostMs : fleetRestoreMs, restoreSlots: heard.hb.restoreSlots } : {}),
      link: { bandwidthBytesPerS: bandwidth, rxLoadBytesPerS: Math.min(load?.rx ?? 0, MAX_LINK_LOAD * bandwidth), txLoadBytesPerS: Math.min(load?.tx ?? 0, MAX_LINK_LOAD * bandwidth) },
      vmm: { qemuVersion: h.qemuVersion, machines: [h.machine], cpuModels: [h.cpuModel], accel: h.accel, ...(heard && builtImages(heard.hb) ? { images: builtImages(heard.hb) } : {}), ...(heard && currentRecipes(heard.hb) ? { recipes: currentRecipes(heard.hb) } : {}) },
      heldSnapshots: [...held],
      ...(shares ? { imageShares: shares } : {}),
    };
  });
  const snapshots: SnapshotInput[] = args.snapshots
    // One record that buildFleetView would refuse (no vCPUs, memory not a number: none the
    // agents write) is left out, not let fail every placement of the fleet.
    .filter((s) => s.state === 'ready' && s.vmConfig !== null && vmConfigFault(s.vmConfig) === undefined)
    .map((s) => {
      const vc = s.vmConfig!;
      return {
        id: s.id,
        totalBytes: Math.max(s.storedBytes, 1),
        chunkBytes: args.chunkBytes,
        vmConfig: {
          qemuVersion: vc.qemuVersion,
          machine: vc.machine,
          cpuModel: vc.cpuModel,
          accel: vc.accel,
          vcpus: vc.vcpus,
          memoryMib: vc.memoryMib,
          ...(vc.imageRecipeHash && vc.imageDiskSha256 ? { baseImage: { key: `${vc.image}-${vc.imageRecipeHash}`, diskSha256: vc.imageDiskSha256 } } : {}),
        },
      };
    });
  return { revision: args.revision, observedAtMs: args.now, hosts, snapshots };
}

