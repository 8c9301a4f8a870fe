// The host agent: carries out the scheduler's work on this host, reports results and
// heartbeats, and relays exec and file calls into guests.
//
// Every step is idempotent (CONVENTIONS.md §4, DESIGN.md decision 6): it is journalled by
// (op id, step id) once done, and a redelivered step answers from the journal. A step
// interrupted by a crash is measured again (does the VM or snapshot already exist?) before
// anything is done, so a retry neither duplicates nor loses a VM.
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import { durationFromMs, timestampMs } from '@bufbuild/protobuf/wkt';
import type { Duration } from '@bufbuild/protobuf/wkt';
import type { Logger } from 'pino';
import type { VmmDriver, VmInfo, LocalSnapshot, GuestImage, Clock, NetworkPolicySpec, IncomingSource, CloneSpec, MigrationStream } from './vmm.ts';
import {
  HeartbeatSchema,
  HostEventSchema,
  HostResultSchema,
  VmStatusSchema,
} from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type {
  FetchSnapshotWork,
  Heartbeat,
  HostEvent,
  HostExecOutput,
  HostExecRequest,
  HostFileRequest,
  HostFileResponse,
  HostResult,
  HostWork,
  VmSpec,
  VmStatus,
  HeldSnapshot,
} from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { VmState as PbVmState, HostEventType } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { Accel, ErrorInfoSchema } from '../../proto/gen/forkfleet/v1/common_pb.ts';
import type { SignedManifest } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import type { GuestHook } from '../../proto/gen/forkfleet/v1/common_pb.ts';
import { ForkfleetError, isForkfleetError } from '../../proto/errors.ts';
import { CallsRunningError, passingSystemError } from '../errors.ts';
import { oneAtATime } from './one-at-a-time.ts';
import { MAX_TIMER_MS } from '../../services/config.ts';

/** `host` of a "host:port" or "[v6]:port" address. */
export function hostOfAddress(address: string): string {
  const m = /^\[([^\]]+)\]:\d+$/.exec(address) ?? /^(.+):\d+$/.exec(address);
  return m?.[1] ?? address;
}

/** Control-plane transport of the agent (adapters/nats). */
export interface AgentBus {
  consumeWork(onWork: (w: HostWork, ctl: WorkControl) => Promise<void>): Promise<() => Promise<void>>;
  publishResult(r: HostResult): Promise<void>;
  /** May throw (NATS refuses it: a closed connection, a message over max_payload): the agent logs it and beats on. */
  publishHeartbeat(hb: Heartbeat): void;
  publishEvent(e: HostEvent): void;
  /** `signal` aborts when the exec's caller is gone (HostExecCancel): the command is killed. */
  serveExec(handler: (req: HostExecRequest, emit: (out: HostExecOutput) => void, signal: AbortSignal) => Promise<void>): () => void;
  serveFile(handler: (req: HostFileRequest) => Promise<HostFileResponse>): () => void;
}

export interface WorkControl {
  ack(): void;
  /**
   * Gives the step back untaken (the agent stops before it could start it): its message is
   * delivered again at once once every step of it is settled, not after its ack wait, so the
   * next agent takes it without waiting.
   */
  release(): void;
  /** Tells the bus the step is still being worked on (extends the redelivery timer). */
  working(): void;
}

/** Step results kept across agent restarts, keyed by op id and step id. */
export interface Journal {
  get(opId: string, stepId: string): Promise<Uint8Array | undefined>;
  put(opId: string, stepId: string, result: Uint8Array): Promise<void>;
  /** Drops the results of ops last written before `olderThanMs` (epoch ms); how many went. */
  prune?(olderThanMs: number): Promise<number>;
  /**
   * The newest leader term whose work this host took (HostWork.leader_term and
   * leader_cluster), as kept by setLeaderTerm; undefined when none was. Optional: without
   * both, the agent knows terms only since it started.
   */
  leaderTerm?(): Promise<LeaderTerm | undefined>;
  /** Keeps `term` across restarts, with its store (called only when the term, or its store, changed). */
  setLeaderTerm?(term: LeaderTerm): Promise<void>;
}

/** A scheduler leader's term: the revision of its election in the etcd cluster `cluster`, of the fleet store `store`. */
export interface LeaderTerm {
  readonly term: bigint;
  readonly cluster: bigint;
  /** HostWork.leader_store of the work the term came with (ordered: a store made later is larger); absent or 0: not known (a scheduler before it). */
  readonly store?: bigint;
  /**
   * With no store known: when the term was taken (epoch ms; for a record kept by an agent
   * before stores, when it was written). The term's store existed then, so work of a store
   * made later (storeMadeAtMs) is of a newer store.
   */
  readonly at?: number;
}

/** When a fleet store was made (epoch ms, to the second): the high 34 bits of its id (election.ts fleetStoreId). */
export function storeMadeAtMs(store: bigint): number {
  return Number(store >> 30n) * 1000;
}

/** A snapshot held elsewhere, ready for a restore by migration; `release` unpins its fetched disk chunks. */
export type IncomingSnapshot = IncomingSource & { bytesFetched: number; release(): void };

/** How snapshots become portable (chunk store) and arrive from peers (adapters/chunkstore, adapters/peer). */
export interface SnapshotShipper {
  /** Cuts a local snapshot into the content-addressed store; returns its manifest (unsigned envelope). */
  ingest(local: LocalSnapshot): Promise<SignedManifest>;
  /** The local snapshot directory, fetching missing chunks from peers and materialising first when needed. */
  obtain(snapshotId: string, fetch: FetchSnapshotWork | undefined, onProgress: (done: number, total: number) => void): Promise<{ local: LocalSnapshot; bytesFetched: number }>;
  /** A replica or a drain: fetches missing chunks from peers and stores the snapshot, building no image (a restore here builds it). */
  replicate?(snapshotId: string, fetch: FetchSnapshotWork): Promise<{ bytesFetched: number }>;
  /**
   * Resolves once a fetch that `obtain` returned before it was durable (chunks fsynced,
   * manifest stored: the host then holds the snapshot, also after a crash) is; rejects if that
   * failed. At once when none is in flight.
   */
  durable?(snapshotId: string): Promise<void>;
  held(): HeldSnapshot[];
  /** Deletes the snapshot here; what still uses it keeps its files until the next GC after. */
  remove(snapshotId: string): Promise<void>;
  /** Frees what nothing reaches any more (chunks, images, deleted snapshots' directories). */
  collectGarbage(): Promise<unknown>;
  /** Bytes the chunk store held after the last GC. */
  storedBytes(): number;
  /** Bytes the snapshot images materialised here take beside the chunks (heartbeat image_cache_bytes). Absent: not said. */
  imageBytes?(): number;
  /** Restore by migration (ADR 0015), optional: is the snapshot on this host? */
  holds?(snapshotId: string): Promise<boolean>;
  /**
   * Keeps the snapshot's files (its materialised image) from GC until release: taken by a
   * restore from before obtain() until its VMs run from them (the driver then counts them as
   * users), since an image whose fetch is not durable yet is otherwise only kept while in use.
   */
  lease?(snapshotId: string, holder: string): { release(): void };
  /** Restore by migration: the verified manifest and the disk layer of a snapshot held elsewhere. */
  incomingSource?(snapshotId: string, fetch: FetchSnapshotWork): Promise<IncomingSnapshot>;
  /** Restore by migration: a source's stream, arriving on a connection to `listenHost`, handed to `load`. */
  migrateFrom?<T>(fetch: FetchSnapshotWork, listenHost: string, load: (conn: MigrationStream, sourceGone: AbortSignal) => Promise<T>, signal?: AbortSignal): Promise<{ result: T; bytes: number }>;
}

export interface AgentConfig {
  hostId: string;
  bootId: string;
  /**
   * The accelerator this host runs VMs with (the driver resolved it at start): what heartbeats
   * report, with or without VMs, and what placement matches snapshots against.
   */
  accel: 'kvm' | 'tcg';
  capacity: { vcpus: number; memoryMib: number; diskMib: number };
  peerAddress: string;
  linkBytesPerSecond: number;
  heartbeatMs: number;
  /** Steps run at once. */
  concurrency: number;
  /** How often the chunk store is garbage-collected (it also runs after every snapshot delete). 0: never. */
  gcIntervalMs?: number;
  /** FF_JOURNAL_RETENTION: step results of ops older than this are pruned (0: kept forever). */
  journalRetentionMs?: number;
  /**
   * Restore by migration (ADR 0015): a restore step of at most this many VMs of a snapshot
   * held elsewhere migrates each from a source instead of fetching the snapshot (default 2;
   * 0: never). Larger steps fetch once and fork locally.
   */
  migrateMaxChildren?: number;
  /**
   * How long stop() waits for the steps still running to finish (their results sent) before
   * it stops all the same; a step left then is delivered again to the next agent, which
   * measures before it acts. Default 20 s (FF_SHUTDOWN_GRACE): under the 30 s a container
   * runtime or systemd commonly allows between SIGTERM and SIGKILL, with room for the rest.
   */
  shutdownGraceMs?: number;
  /**
   * The first wait before a step result whose publish failed is published again (then twice
   * and four times as long; default 1000 ms). See publishResult.
   */
  resultRetryMs?: number;
  /**
   * The least time a step is given before its deadline answers it (HostWork.deadline, set by
   * the scheduler to when it stops waiting for that send): a host clock behind the
   * scheduler's would otherwise answer every step late before it could run. Default 10 s.
   */
  stepDeadlineFloorMs?: number;
}

/** Resident memory of a process in bytes, or undefined when it is gone. */
export type RssProbe = (pid: number) => number | undefined;

/** CPU seconds a process has used so far (user + system), or undefined when it is gone. */
export type CpuProbe = (pid: number) => number | undefined;

export interface AgentDeps {
  driver: VmmDriver;
  /** For idle detection (adapters read /proc). Absent: idleness is judged by calls only. */
  cpu?: CpuProbe;
  /** For the memory the host's VMs use (heartbeat; adapters read /proc). */
  rss?: RssProbe;
  /** Guest CPU (fraction of one core) under which a VM counts as idle. Default 0.15. */
  idleCpuThreshold?: number;
  shipper: SnapshotShipper;
  bus: AgentBus;
  journal: Journal;
  images: (name: string) => Promise<GuestImage>;
  /** This host's recipe hash for an image name (cheaper than `images`: nothing built). Absent: not checked. */
  imageRecipe?: (name: string) => Promise<string>;
  /**
   * The images whose recipe here (imageRecipe) heartbeats list as current from the start, built
   * or not (HostImage.current): placement then sends no restore of a snapshot over another
   * recipe's build, which this agent would refuse, here. Absent: none listed.
   */
  imageNames?: readonly string[];
  /** The builds already in this host's image cache, listed in heartbeats from the start. Absent: none known until built. */
  cachedImages?: () => Promise<ReadonlyArray<{ name: string; recipeHash: string; diskSha256: string }>>;
  /** One cache entry: whole, gone (or torn), or not to be told now (a read error). */
  cachedImage?: (name: string, recipeHash: string) => Promise<'whole' | 'missing' | 'unknown'>;
  clock: Clock;
  log: Logger;
  config: AgentConfig;
  qemuVersion: string;
  /** What the agent reports to its metrics (adapters/metrics.ts). Absent: nothing. */
  metrics?: AgentMetrics;
}

/** The agent's own figures, for an operator's monitoring (adapters/metrics.ts exports them). */
export interface AgentMetrics {
  /** Every heartbeat the agent builds: the host's state as it reports it to the schedulers. */
  heartbeat(hb: Heartbeat): void;
  /** A heartbeat that could not be built or sent. */
  heartbeatFailed(): void;
  /** A step this agent ran (not one answered again from its journal): its kind, its error kind if it failed, and how long it took. */
  step(kind: string, errorKind: string | undefined, ms: number): void;
}

/** The shortest window a guest's CPU baseline moves over (idleMs). */
const CPU_SAMPLE_MIN_MS = 1000;
/** Guest CPU seconds a shorter window may show without counting as busy: two /proc ticks (one at each end). */
const CPU_TICKS_ALLOWANCE_S = 0.02;
/** Local restores the heartbeat's restore_cost_ms is the median of. */
const RESTORE_SAMPLES = 32;
/**
 * A restore sample older than this no longer counts. Placement prices a host by its samples
 * and avoids a slow one, so a host that was slow for a while would get no new samples and
 * keep its old price for good; aged out, it reports none and is priced like a new host
 * (the scheduler's default), so it gets restores again and measures itself anew.
 */
export const RESTORE_SAMPLE_MAX_AGE_MS = 10 * 60_000;

const VM_STATE: Record<VmInfo['state'], PbVmState> = {
  starting: PbVmState.STARTING,
  running: PbVmState.RUNNING,
  paused: PbVmState.PAUSED,
  snapshotting: PbVmState.RUNNING,
  crashed: PbVmState.CRASHED,
  destroying: PbVmState.STOPPED,
  destroyed: PbVmState.STOPPED,
};

/** A journal read that failed (a disk error): retryable, so the scheduler tries the step again. */
function journalUnreadable(e: unknown): ForkfleetError {
  return new ForkfleetError('unavailable', `the host's step journal is unreadable: ${e instanceof Error ? e.message : String(e)}`, { retryable: true, cause: e });
}

/** A journal write a step cannot go on without that failed (a disk error): retryable, as journalUnreadable. */
function journalUnwritable(e: unknown): ForkfleetError {
  return new ForkfleetError('unavailable', `the host's step journal cannot be written: ${e instanceof Error ? e.message : String(e)}`, { retryable: true, cause: e });
}

function errorInfo(e: unknown): { kind: string; message: string; retryable: boolean; field: string } {
  if (isForkfleetError(e)) return { kind: e.kind, message: e.message, retryable: e.retryable, field: e.field ?? '' };
  // A full disk, too many open files, an I/O error: retryable (as `internal` it was final, and
  // every later send of the step got the same failure). The step's log line has the whole error.
  const passing = passingSystemError(e, 'a system call of the step');
  if (passing) return errorInfo(passing);
  return { kind: 'internal', message: e instanceof Error ? e.message : String(e), retryable: false, field: '' };
}

/**
 * The sources a restore may migrate from: reachable ones the scheduler marks so
 * (PeerSource.may_migrate: the host that took the snapshot). A stream is loaded as it comes,
 * unverified; any other source serves verified chunks, never a migration.
 */
export function migrationSources(fetch: FetchSnapshotWork): FetchSnapshotWork['sources'] {
  return fetch.sources.filter((s) => s.address && s.mayMigrate);
}

export class Agent {
  /** What start() set up, undone by stop() in reverse (the work consumer apart: stopConsuming). */
  private readonly stops: Array<() => void | Promise<void>> = [];
  /** Ends the delivery of work (the bus's consumer); the first thing stop() undoes. */
  private stopConsuming: (() => Promise<void>) | undefined;
  /** Set by stop(): no step is taken or started any more (onWork, startQueued). */
  private closed = false;
  private closing: Promise<void> | undefined;
  /** Settling of each step run that holds a slot or shares one (onWork), for stop() to wait for. */
  private readonly running = new Set<Promise<void>>();
  /** Heartbeats that could not go out (beat): whether the last one did not, and how many since the last logged. */
  private readonly heartbeatFailures = { failing: false, unlogged: 0, loggedAt: Number.NEGATIVE_INFINITY };
  /**
   * The guest images this agent has built or found in its cache (image()), by
   * `<name>-<recipeHash>`: the heartbeat lists them (Heartbeat.images), and a restore of a
   * snapshot whose image is here needs no recipe hash (~100 ms) first, only a look at its cache
   * entry (baseImageFor).
   */
  private readonly built = new Map<string, { name: string; recipeHash: string; diskSha256: string }>();
  /** The recipe hash this host builds each of deps.imageNames by (those whose recipe could be read), from start(). */
  private readonly recipes = new Map<string, string>();
  /** Per `<name>-<recipeHash>` a snapshot overlays: the look for (or build of) it under way or done (baseImageFor). */
  private readonly baseImages = new Map<string, Promise<void>>();
  /** The heartbeat interval, ended first when stopping (shutdown). */
  private heartbeatTimer: ReturnType<typeof setInterval> | undefined;
  private inflight = 0;
  private seq = 0n;
  /**
   * Time to ready of the first child of each recent local restore step (at most
   * RESTORE_SAMPLES, none older than RESTORE_SAMPLE_MAX_AGE_MS, oldest first): what a restore costs here with nothing else of its step
   * alongside. The heartbeat reports the median, which placement uses to price this host's
   * queue.
   */
  private readonly restoreSamples: Array<{ ms: number; at: number }> = [];
  /** Delivered steps waiting for a slot: `run` starts one, `drop` gives it back to the bus (stop()); `w`, for noteStop. */
  private readonly queue: Array<{ w: HostWork; run: () => Promise<void>; drop: () => void }> = [];
  private readonly inProgress = new Map<string, Promise<HostResult>>();
  /** Writes of a step's journal entry, one at a time per step (journalInTurn). */
  private readonly sharing = new Map<string, Promise<unknown>>();
  /** Sandboxes whose VM running create or restore steps make: each step's op and settling (act). */
  private readonly making = new Map<string, Set<{ opId: string; settled: Promise<void> }>>();
  /** Sandboxes whose VM running destroy steps stop: each step's settling (runStep). */
  private readonly stopping = new Map<string, Set<Promise<void>>>();
  /** Per running step (`${opId}/${stepId}`): the steps delivered before it that it waits for before it acts on its VMs (runStep). */
  private readonly after = new Map<string, Array<Promise<void>>>();
  /**
   * `${opId}/${sandboxId}` of starts the scheduler gave up on here (a stop-unanswered,
   * stop-moved-on or stop-replaced step was delivered): a create or restore of that op that
   * comes after it (a redelivery after an agent restart) does not make that VM. In memory,
   * bounded; after a restart the stops' `#given-up` records (written on delivery) and
   * journalled results say the same (gaveUpOn).
   */
  private readonly gaveUp = new Set<string>();
  /** Restores by migration under way, by `<op>/<vm>`: rememberGaveUp ends them (restoreByMigration). */
  private readonly migratingIn = new Map<string, AbortController>();
  /**
   * Per sandbox: the op whose create or restore made its VM here or last found it running and
   * took it (claim). Also kept in the journal (ownerOf), so that it outlives a restart; in
   * memory, bounded (one evicted is read from the journal again).
   */
  private readonly owners = new Map<string, string>();
  /**
   * Per guarded stop being delivered (`${opId}/${stepId}`): the owners of its sandbox's VM it
   * may end, as they were when it came (noteStop); cleared when its run settles.
   */
  private readonly stopNotes = new Map<string, Promise<StopNote>>();
  /** Per sandbox: a stop being noted, which a claim waits for (so the note sees the owner before it). */
  private readonly noting = new Map<string, Promise<unknown>>();
  /** Keep-alives of delivered steps (running or waiting for a slot), cleared by stop(). */
  private readonly keepAlives = new Set<ReturnType<typeof setInterval>>();
  /** Per VM: when it was last busy (a call, or CPU over the threshold), and the last CPU reading. */
  private readonly activity = new Map<string, { busyAt: number; cpu: number | undefined; at: number; calls: number }>();
  /** The newest leader term whose work this agent took (takesTerm), and the write that keeps it. */
  private leaderTerm: LeaderTerm | undefined;
  private termKept: Promise<void> = Promise.resolve();

  constructor(private readonly deps: AgentDeps) {}

  private get log(): Logger {
    return this.deps.log;
  }

  async start(): Promise<void> {
    const { driver, bus } = this.deps;
    this.stops.push(
      driver.onEvent((e) => {
        if (e.type === 'crashed') {
          this.log.warn({ sandboxId: e.vmId, pid: e.pid, detail: e.detail }, 'VM crashed');
          bus.publishEvent(this.event(HostEventType.VM_CRASHED, { sandboxId: e.vmId, message: e.detail }));
        }
      }),
    );
    this.stops.push(bus.serveExec((req, emit, signal) => this.exec(req, emit, signal)));
    this.stops.push(bus.serveFile((req) => this.file(req)));
    // Before any work is taken: a deposed leader's step redelivered after a restart is dropped.
    this.leaderTerm = await (this.deps.journal.leaderTerm?.() ?? Promise.resolve(undefined)).catch((e: unknown) => {
      this.log.error({ err: e }, 'the newest leader term is unreadable; taking work of any term until a leader sends some');
      return undefined;
    });
    this.stopConsuming = await bus.consumeWork((w, ctl) => this.onWork(w, ctl));
    // The builds in the image cache, then the default image built (or found), in the
    // background: heartbeats list them, and a restore here does not wait for that build.
    void (async () => {
      const recipe = this.deps.imageRecipe;
      if (recipe) {
        for (const name of this.deps.imageNames ?? []) {
          // One that cannot be read (its packages missing here): not listed, so not judged.
          const hash = await recipe(name).catch((e: unknown) => void this.log.warn({ err: e, image: name }, "this host's recipe for an image could not be read; heartbeats leave it out"));
          if (hash) this.recipes.set(name, hash);
        }
      }
      for (const i of (await this.deps.cachedImages?.()) ?? []) this.built.set(`${i.name}-${i.recipeHash}`, { ...i });
      await this.image(DEFAULT_IMAGE);
    })().catch((e: unknown) => this.log.warn({ err: e, image: DEFAULT_IMAGE }, 'the default guest image is not ready here; a create or restore builds it'));
    this.beat();
    const t = setInterval(() => this.beat(), this.deps.config.heartbeatMs);
    this.heartbeatTimer = t;
    this.stops.push(() => clearInterval(t));
    const keepMs = this.deps.config.journalRetentionMs ?? 0;
    if (keepMs > 0 && this.deps.journal.prune) {
      const prune = () =>
        void this.deps.journal.prune!(this.deps.clock.now() - keepMs).then(
          (n) => n > 0 && this.log.info({ ops: n }, 'old step results pruned from the journal'),
          (e: unknown) => this.log.warn({ err: e }, 'journal prune failed'),
        );
      prune();
      const j = setInterval(prune, Math.min(3_600_000, Math.max(1000, keepMs / 4)));
      this.stops.push(() => clearInterval(j));
    }
    const gcEvery = this.deps.config.gcIntervalMs ?? 0;
    if (gcEvery > 0) {
      const gc = () => void this.deps.shipper.collectGarbage().catch((e: unknown) => this.log.warn({ err: e }, 'chunk gc failed'));
      gc();
      const g = setInterval(gc, gcEvery);
      this.stops.push(() => clearInterval(g));
    }
  }

  /**
   * Stops taking work at once (steps waiting for a slot are given back once delivery has
   * ended: the bus delivers them again, to the next agent), ends the delivery of work, waits for the steps still
   * running to finish (at most shutdownGraceMs), then undoes the rest of start(): every part,
   * even if one fails to stop. Rejects once all ran if any failed, naming them. VMs are left
   * running (the next agent adopts them).
   */
  stop(): Promise<void> {
    this.closing ??= this.shutdown();
    return this.closing;
  }

  private async shutdown(): Promise<void> {
    this.closed = true;
    // Heartbeats go on, saying the host is stopping (placement leaves it out) while the running
    // steps finish: silent from the start of the grace (20 s) to the next agent's first
    // heartbeat, a restart came close to the 30 s after which the host and all its sandboxes
    // are lost. The next agent has the whole threshold from the last of these.
    this.beat();
    const failures: unknown[] = [];
    const attempt = async (s: () => void | Promise<void>): Promise<void> => {
      try {
        await s();
      } catch (e) {
        failures.push(e);
        this.log.error({ err: e }, 'stopping: a part of the agent did not stop cleanly');
      }
    };
    const consuming = this.stopConsuming;
    this.stopConsuming = undefined;
    // One grace for the whole stop, from its start: the consumer's stop (which can wait on
    // NATS) and the running steps share it, so the agent ends within the grace and is not
    // killed by its supervisor half-way.
    const graceMs = this.deps.config.shutdownGraceMs ?? 20_000;
    let timer: ReturnType<typeof setTimeout> | undefined;
    const graceOver = new Promise<boolean>((r) => (timer = setTimeout(() => r(false), graceMs)));
    try {
      if (consuming && !(await Promise.race([attempt(consuming).then(() => true), graceOver]))) this.log.warn({ graceMs }, 'stopping: the work consumer did not stop within the grace');
      // Steps waiting for a slot (none starts once stopping) are given back, once no more work
      // is delivered here: given back before, the bus could deliver them to this agent again.
      for (const q of this.queue.splice(0)) q.drop();
      // The deliveries being handled, and the step runs (inProgress), also those answered at
      // their deadline that run on.
      if (this.running.size > 0 || this.inProgress.size > 0) {
        const runs = [...this.inProgress.values()].map((p) => p.catch(() => undefined));
        const settled = await Promise.race([Promise.all([...this.running, ...runs]).then(() => true), graceOver]);
        if (!settled) this.log.warn({ steps: this.running.size, runs: this.inProgress.size, graceMs }, 'stopping with steps still running: they are delivered again to the next agent');
      }
    } finally {
      clearTimeout(timer);
      clearInterval(this.heartbeatTimer);
    }
    for (const s of this.stops.splice(0).reverse()) await attempt(s);
    for (const t of this.keepAlives) clearInterval(t);
    this.keepAlives.clear();
    this.stopNotes.clear(); // of stops dropped from the queue
    if (failures.length > 0) throw new AggregateError(failures, `${failures.length} part(s) of the agent did not stop cleanly: ${failures.map((e) => (e instanceof Error ? e.message : String(e))).join('; ')}`);
  }

  private event(type: HostEventType, fields: Partial<Pick<HostEvent, 'sandboxId' | 'snapshotId' | 'opId' | 'message'>> & { bytesDone?: bigint; bytesTotal?: bigint }): HostEvent {
    return create(HostEventSchema, { hostId: this.deps.config.hostId, type, time: { seconds: BigInt(Math.floor(this.deps.clock.now() / 1000)) }, ...fields });
  }

  /**
   * `more`: fields set in the same create. Not spread onto a message afterwards: a copy of a
   * message object costs more than making it (a heartbeat makes one per VM of the host).
   */
  vmStatus(v: VmInfo, more: { idle?: Duration; reason?: string } = {}): VmStatus {
    const rss = v.pid && this.deps.rss ? (this.deps.rss(v.pid) ?? 0) : 0;
    return create(VmStatusSchema, { sandboxId: v.sandboxId || v.vmId, state: VM_STATE[v.state], pid: v.pid, rssBytes: BigInt(rss), ...more });
  }

  private touch(vmId: string): void {
    const a = this.activity.get(vmId);
    const now = this.deps.clock.now();
    if (a) a.busyAt = now;
    else this.activity.set(vmId, { busyAt: now, cpu: undefined, at: now, calls: 0 });
  }

  /**
   * `fn`, an exec or file call into the VM, counted as activity for as long as it runs (a
   * command that mostly waits uses no guest CPU) and at its end: a sandbox is never idle, and
   * so never hibernated, during a call of its own.
   */
  private async inCall<T>(vmId: string, fn: () => Promise<T>): Promise<T> {
    this.touch(vmId);
    const a = this.activity.get(vmId)!;
    a.calls++;
    try {
      return await fn();
    } finally {
      a.calls--;
      this.touch(vmId);
    }
  }

  /** Milliseconds the VM has been idle (no calls, guest CPU under the threshold). */
  idleMs(v: VmInfo): number {
    const now = this.deps.clock.now();
    let a = this.activity.get(v.vmId);
    if (!a) {
      a = { busyAt: now, cpu: undefined, at: now, calls: 0 };
      this.activity.set(v.vmId, a);
    }
    if (a.calls > 0) a.busyAt = now;
    // Guest CPU as a fraction of the window since the last sample. /proc counts it in 10 ms
    // ticks: one tick in a window of a few ms (the idle pause judged twice, before and under
    // the driver's lock) read as a busy guest. So the baseline moves only after a window of
    // CPU_SAMPLE_MIN_MS (or a clock that stepped back); a shorter one is read against it with
    // two ticks' allowance, so a burst since the last heartbeat still counts.
    const cpu = this.deps.cpu?.(v.pid);
    const thresh = this.deps.idleCpuThreshold ?? 0.15;
    if (cpu !== undefined && a.cpu !== undefined && now > a.at) {
      const window = (now - a.at) / 1000;
      if (cpu - a.cpu > thresh * window + (now - a.at < CPU_SAMPLE_MIN_MS ? CPU_TICKS_ALLOWANCE_S : 0)) a.busyAt = now;
    }
    if (a.cpu === undefined || now - a.at >= CPU_SAMPLE_MIN_MS || now < a.at) {
      a.cpu = cpu;
      a.at = now;
    }
    return v.state === 'running' ? now - a.busyAt : 0;
  }

  private recordRestore(ms: number): void {
    this.restoreSamples.push({ ms, at: this.deps.clock.now() });
    if (this.restoreSamples.length > RESTORE_SAMPLES) this.restoreSamples.shift();
  }

  /** Median of the recent local restores, ms (0: none in the last RESTORE_SAMPLE_MAX_AGE_MS). */
  private restoreCostMs(): number {
    const since = this.deps.clock.now() - RESTORE_SAMPLE_MAX_AGE_MS;
    while (this.restoreSamples.length && this.restoreSamples[0]!.at < since) this.restoreSamples.shift();
    const s = this.restoreSamples.map((x) => x.ms).sort((a, b) => a - b);
    return s.length ? Math.round(s[Math.floor((s.length - 1) / 2)]!) : 0;
  }

  /**
   * A heartbeat that cannot go out (the bus refused it, or reading the host's state failed)
   * is logged, at most once a minute with how many failed, and the next one comes as usual:
   * thrown from start() it would end the agent, and from the interval crash it.
   */
  private beat(): void {
    const f = this.heartbeatFailures;
    try {
      this.heartbeat();
      if (f.failing) this.log.info({ notLogged: f.unlogged }, 'heartbeats are sent again');
      f.failing = false;
      f.unlogged = 0;
    } catch (e) {
      this.deps.metrics?.heartbeatFailed();
      f.failing = true;
      f.unlogged++;
      const now = this.deps.clock.now();
      if (now - f.loggedAt >= 60_000) {
        this.log.error({ err: e, failed: f.unlogged }, 'heartbeat not sent');
        f.loggedAt = now;
        f.unlogged = 0;
      }
    }
  }

  heartbeat(): void {
    const cfg = this.deps.config;
    const vms = this.deps.driver.list().filter((v) => v.state !== 'destroyed');
    const allocated = vms.reduce((a, v) => ({ vcpus: a.vcpus + v.vcpus, memoryMib: a.memoryMib + v.memoryMib }), { vcpus: 0, memoryMib: 0 });
    this.seq += 1n;
    // The host's, not its first VM's: an empty KVM host reported TCG, and no KVM snapshot was
    // placed on it.
    const accel = cfg.accel;
    const statuses = vms.map((v) => this.vmStatus(v, { idle: durationFromMs(Math.round(this.idleMs(v))) }));
    // Activity of VMs that are gone: forgotten, so the map stays as large as the host's VMs.
    if (this.activity.size > vms.length) {
      const live = new Set(vms.map((v) => v.vmId));
      for (const id of this.activity.keys()) if (!live.has(id)) this.activity.delete(id);
    }
    const hb = create(HeartbeatSchema, {
      hostId: cfg.hostId,
      seq: this.seq,
      bootId: cfg.bootId,
      time: { seconds: BigInt(Math.floor(this.deps.clock.now() / 1000)) },
      capacity: { vcpus: cfg.capacity.vcpus, memoryMib: BigInt(cfg.capacity.memoryMib), diskMib: BigInt(cfg.capacity.diskMib) },
      allocated: { vcpus: allocated.vcpus, memoryMib: BigInt(allocated.memoryMib) },
      vms: statuses,
      // What this host's VMs really use (resident memory), beside what is booked.
      memoryUsedBytes: statuses.reduce((a, v) => a + v.rssBytes, 0n),
      chunkStoreBytes: BigInt(this.deps.shipper.storedBytes()),
      imageCacheBytes: BigInt(this.deps.shipper.imageBytes?.() ?? 0),
      snapshots: this.deps.shipper.held(),
      accel: accel === 'kvm' ? Accel.KVM : Accel.TCG,
      qemuVersion: this.deps.qemuVersion,
      cpuModel: accel === 'kvm' ? 'host' : 'max',
      machine: 'microvm',
      peerAddress: cfg.peerAddress,
      linkBytesPerSecond: BigInt(cfg.linkBytesPerSecond),
      inflightOps: this.inflight,
      restoreSlots: cfg.concurrency,
      restoreCostMs: this.restoreCostMs(),
      images: this.imagesHere(),
      stopping: this.closed,
      interval: { nanos: (cfg.heartbeatMs % 1000) * 1e6, seconds: BigInt(Math.floor(cfg.heartbeatMs / 1000)) },
    });
    this.deps.metrics?.heartbeat(hb);
    this.deps.bus.publishHeartbeat(hb);
  }

  // ---------------------------------------------------------------- work

  /** The store each taken step was credited to when it was taken (its own, or the kept one for work that says none): judged by it at its turn. */
  private readonly creditedStore = new WeakMap<HostWork, bigint>();

  /** Whether `w` is of an older term, or an older store, than the newest this agent has taken (takesTerm). */
  private ofAnOlderTerm(w: HostWork): boolean {
    const kept = this.leaderTerm;
    if (w.leaderTerm === 0n || kept === undefined) return false;
    const ws = w.leaderStore || this.creditedStore.get(w) || 0n;
    if (ws && kept.store && ws !== kept.store) return ws < kept.store;
    return kept.cluster === w.leaderCluster && w.leaderTerm < kept.term;
  }

  /** Whether store `ws` (known) is newer than the kept term's: a larger id, or, with no store kept, made after the term was taken. */
  private newerStore(ws: bigint, kept: LeaderTerm): boolean {
    return kept.store ? ws > kept.store : kept.at !== undefined && storeMadeAtMs(ws) > kept.at;
  }

  /**
   * Whether a delivered step's leader term may act here (HostWork.leader_term). Work of an
   * older term than this agent has taken comes from a deposed leader (publishes its NATS
   * client held through a disconnect, or a step of its that was redelivered): dropped, with no
   * result (the result stream is the new leader's, which may wait on the same step), since the
   * new leader may have acted on this host since. The new leader sends again the steps of the
   * operations it runs on; a dropped clean-up of the old term (a stop sent without waiting)
   * is left to the stray-VM check (a VM with no record is stopped). Judged in delivery order,
   * so a newer term is taken before any later delivery. Term 0 (no term) is taken.
   * Terms are revisions of one fleet store (HostWork.leader_store), which a store made anew
   * counts from 1 again; store ids grow with the time the store was made:
   * - work of a newer store than the kept one (both known) is taken whatever its term; work of
   *   an older one (a deposed leader's held publishes, redeliveries, from before etcd was made
   *   anew) is dropped as an older term's is, in whatever order the two come;
   * - work that does not say its store (a scheduler of the version before it, during a rolling
   *   upgrade or after a rollback) is judged by etcd's cluster id as before: the same cluster's
   *   terms compared (its leaders and the new version's count the same revisions), another
   *   cluster's taken. The store kept stays known.
   */
  private takesTerm(w: HostWork): boolean {
    const kept = this.leaderTerm;
    if (w.leaderTerm === 0n) return true;
    let store = w.leaderStore || undefined;
    if (kept?.store && w.leaderStore && w.leaderStore < kept.store) {
      this.log.warn({ opId: w.opId, stepId: w.stepId, store: String(w.leaderStore), keptStore: String(kept.store) }, 'work from an older fleet store (etcd made anew since) dropped');
      return false;
    }
    if (kept && w.leaderStore && w.leaderStore !== kept.store && this.newerStore(w.leaderStore, kept)) {
      this.log.warn({ store: String(w.leaderStore), keptStore: String(kept.store ?? 0n) }, 'work from a newer fleet store (etcd made anew): its leader terms are taken from now on');
    } else if (kept && kept.cluster === w.leaderCluster) {
      if (w.leaderTerm < kept.term) {
        this.log.warn({ opId: w.opId, stepId: w.stepId, term: String(w.leaderTerm), newestTerm: String(kept.term) }, "work from a deposed leader's term dropped");
        return false;
      }
      // A scheduler that does not say its store, on the store kept: still that store.
      store ??= kept.store;
    } else if (kept) {
      this.log.warn({ cluster: String(w.leaderCluster), keptCluster: String(kept.cluster) }, 'work from another etcd cluster: its leader terms are taken from now on');
    }
    if (store) this.creditedStore.set(w, store);
    // The term kept already: nothing new to keep.
    if (kept && w.leaderTerm === kept.term && w.leaderCluster === kept.cluster && store === kept.store) return true;
    const term: LeaderTerm = { term: w.leaderTerm, cluster: w.leaderCluster, ...(store ? { store } : { at: this.deps.clock.now() }) };
    this.leaderTerm = term;
    const keep = this.deps.journal.setLeaderTerm;
    if (keep) this.termKept = this.termKept.then(() => keep.call(this.deps.journal, term)).catch((e: unknown) => this.log.error({ err: e, term: String(term.term) }, 'could not keep the newest leader term; a restart forgets it'));
    return true;
  }

  private onWork(w: HostWork, ctl: WorkControl): Promise<void> {
    // Stopping: not taken, not acked (the bus delivers it again, to the next agent).
    if (this.closed) return Promise.resolve();
    if (!this.takesTerm(w)) {
      ctl.ack();
      return Promise.resolve();
    }
    // On delivery, also of a stop that must wait for a slot: see noteStop.
    void this.noteStop(w);
    return new Promise<void>((resolve) => {
      // From delivery on, also while the step waits for a slot: JetStream would otherwise
      // deliver a queued step again after its ack wait, and copies would pile up in the queue.
      const keepAlive = setInterval(() => ctl.working(), 5000);
      this.keepAlives.add(keepAlive);
      const done = (): void => {
        clearInterval(keepAlive);
        this.keepAlives.delete(keepAlive);
        resolve();
      };
      const key = `${w.opId}/${w.stepId}`;
      const run = async (): Promise<void> => {
        // Judged again when it starts: a step that waited for a slot while a newer leader's
        // work arrived (or a new etcd cluster's) is of a deposed leader's term now, dropped as
        // takesTerm drops it.
        if (this.ofAnOlderTerm(w)) {
          this.log.warn({ opId: w.opId, stepId: w.stepId, term: String(w.leaderTerm), newestTerm: String(this.leaderTerm?.term), cluster: String(w.leaderCluster), keptCluster: String(this.leaderTerm?.cluster) }, "queued work of a deposed leader's term dropped");
          ctl.ack();
          return done();
        }
        // Another copy of a step that is running (a scheduler's re-send of a slow step, a
        // redelivery after a restart) waits for that run without a slot of its own: copies of
        // a few slow restores would otherwise take every slot and starve unrelated steps.
        const slot = !this.inProgress.has(key);
        if (slot) this.inflight++;
        try {
          const result = await this.runStep(w);
          await this.publishResult(result).catch((e: unknown) => {
            if (!isForkfleetError(e) || e.kind !== 'resource_exhausted') throw e;
            // Larger than the bus carries (a snapshot's manifest of a very large VM): every
            // redelivery would fail alike and the scheduler would wait out every attempt. Its
            // failure is answered instead, saying why.
            this.log.error({ err: e, opId: w.opId, stepId: w.stepId }, 'step result too large for the bus; reporting the step failed');
            return this.deps.bus.publishResult(create(HostResultSchema, { opId: w.opId, stepId: w.stepId, hostId: this.deps.config.hostId, attempt: w.attempt, error: { kind: 'resource_exhausted', message: `the step's result cannot be sent: ${e.message}`, retryable: false } }));
          });
          ctl.ack();
        } catch (e) {
          // Publishing the result failed (bus down): leave the message unacked for redelivery.
          this.log.warn({ err: e, opId: w.opId, stepId: w.stepId }, 'could not report step result; it will be redelivered');
        } finally {
          done();
          if (slot) {
            this.inflight--;
            this.startQueued();
          }
        }
      };
      if (this.inProgress.has(key) || this.inflight < this.deps.config.concurrency) this.begin(run);
      else
        this.queue.push({
          w,
          run,
          drop: () => {
            ctl.release();
            done();
          },
        });
    });
  }

  /**
   * Publishes a step's result, again after 1, 2 and 4 s (resultRetryMs) when the publish fails
   * (no PubAck in time: a JetStream leader election, a reconnect). Left unacked, the work would
   * be delivered again only after its ack wait, and a step that shares its message with others
   * (a batch) only once the slowest of them has ended: its result, journalled and ready, would
   * reach the scheduler only after its step timeout. A result too large for the bus is not
   * tried again (resource_exhausted: every try fails alike).
   */
  private async publishResult(result: HostResult): Promise<void> {
    const base = this.deps.config.resultRetryMs ?? 1000;
    for (let attempt = 1; ; attempt++) {
      try {
        return await this.deps.bus.publishResult(result);
      } catch (e) {
        if ((isForkfleetError(e) && e.kind === 'resource_exhausted') || attempt >= 4 || this.closed) throw e;
        this.log.warn({ err: e, opId: result.opId, stepId: result.stepId, attempt }, 'could not publish a step result; trying again');
        await new Promise((r) => setTimeout(r, base * 2 ** (attempt - 1)));
      }
    }
  }

  /** Runs a delivered step, kept among the running ones until it settles (stop() waits for them). */
  private begin(run: () => Promise<void>): void {
    const p = run().catch(() => undefined);
    this.running.add(p);
    void p.then(() => this.running.delete(p));
  }

  /** Starts queued steps while there are free slots (a queued copy of a running step takes none); none once stopping. */
  private startQueued(): void {
    while (!this.closed && this.queue.length > 0 && this.inflight < this.deps.config.concurrency) this.begin(this.queue.shift()!.run);
  }

  /**
   * Runs a step once per (op, step): concurrent deliveries share one run, later ones read the
   * journal. A send is answered by its deadline (HostWork.deadline) at the latest: a step whose
   * work hangs (an image build, a disk that does not answer) answers deadline_exceeded,
   * retryable, and frees its slot, while its run goes on; the scheduler's retry, a new send,
   * waits for that same run (and its VMs stay "being made" until it ends, so a destroy of them
   * still waits for it). Without a deadline, a hung step held its slot, and the steps that
   * waited for it theirs, for ever.
   */
  runStep(w: HostWork): Promise<HostResult> {
    const shared = this.inProgress.get(`${w.opId}/${w.stepId}`);
    const run = shared ? shared.then((r) => this.sharedBy(w, r)) : this.startStep(w);
    return this.byDeadline(w, run.then((r) => this.answerTo(w, r)));
  }

  /**
   * `r` as the answer to send `w`. It carries w's attempt, not that of the send whose run or
   * journal entry it is (a copy that shared a run, a re-send answered from the journal): the
   * scheduler takes a retryable failure of another attempt for a late answer to an earlier
   * send, and waits on for one that never comes. And a start does not report running a
   * sandbox the scheduler has given up on here (gaveUp) since its run checked: the stop that
   * gave it up ends that VM (after the run) or has ended it, and a send of the start answered
   * from that run or its journal entry (the op run again) had the sandbox recorded running
   * with no VM. Such a sandbox is left out, as a run after the give-up leaves it out; a start
   * whose every sandbox was given up fails (final), since a create or a wake records its
   * sandbox running from any success.
   */
  private answerTo(w: HostWork, r: HostResult): HostResult {
    const makes = makesOf(w);
    const out = new Set(makes.filter((id) => this.gaveUp.has(`${w.opId}/${id}`)));
    if (r.error || out.size === 0) return r.attempt === w.attempt ? r : { ...r, attempt: w.attempt };
    if (out.size < makes.length) return { ...r, attempt: w.attempt, vms: r.vms.filter((v) => !out.has(v.sandboxId)) };
    const error = create(ErrorInfoSchema, errorInfo(gaveUpError(w.opId, makes)));
    return create(HostResultSchema, { opId: w.opId, stepId: w.stepId, hostId: this.deps.config.hostId, attempt: w.attempt, error });
  }

  /**
   * A copy of a step that shared another send's run (a re-send at its deadline, a redelivery):
   * a retryable failure is journalled for the send that started the run only, so this copy,
   * delivered again (unacked: its batch not done, its ack lost, an agent restart), would run
   * the step again, a second VM of a sandbox the scheduler may have placed elsewhere since.
   * Its send is added to the entry. Entries of one step are rewritten one at a time.
   */
  private sharedBy(w: HostWork, r: HostResult): Promise<HostResult> {
    if (!r.error?.retryable) return Promise.resolve(r);
    return this.journalInTurn(w, async () => {
      const bytes = await this.deps.journal.get(w.opId, w.stepId);
      const entry = bytes && withSend(bytes, w);
      if (entry) await this.deps.journal.put(w.opId, w.stepId, entry);
    })
      .catch((e: unknown) => this.log.warn({ err: e, opId: w.opId, stepId: w.stepId }, 'could not journal a copy of a step that shared its run; a redelivery of it runs the step again'))
      .then(() => r);
  }

  /**
   * Runs a write of a step's journal entry after the ones before it of the same step: a copy's
   * read-modify-write (sharedBy) must not put back an entry a later run of the step replaced.
   */
  private journalInTurn(w: HostWork, write: () => Promise<void>): Promise<void> {
    return oneAtATime(this.sharing, `${w.opId}/${w.stepId}`, write);
  }

  private byDeadline(w: HostWork, run: Promise<HostResult>): Promise<HostResult> {
    if (!w.deadline) return run;
    // At most a timer's range: a deadline past it (a clock weeks behind) would fire at once.
    const ms = Math.min(MAX_TIMER_MS, Math.max(this.deps.config.stepDeadlineFloorMs ?? 10_000, timestampMs(w.deadline) - this.deps.clock.now()));
    let timer: ReturnType<typeof setTimeout> | undefined;
    const late = new Promise<HostResult>((resolve) => {
      timer = setTimeout(() => {
        this.log.warn({ opId: w.opId, stepId: w.stepId, attempt: w.attempt, ms }, 'step still running at its deadline; answered so, and it goes on');
        const error = create(ErrorInfoSchema, { kind: 'deadline_exceeded', message: `the step was still running after ${ms} ms, its deadline; it goes on, and the next attempt waits for it`, retryable: true });
        resolve(create(HostResultSchema, { opId: w.opId, stepId: w.stepId, hostId: this.deps.config.hostId, attempt: w.attempt, error }));
      }, ms);
    });
    return Promise.race([run, late]).finally(() => clearTimeout(timer));
  }

  private startStep(w: HostWork): Promise<HostResult> {
    const key = `${w.opId}/${w.stepId}`;
    void this.noteStop(w);
    // What this step waits for, by delivery order (steps start in it): a destroy waits for
    // the starts of its sandbox delivered before it, and a start for the destroys before it.
    // A stop of a start the scheduler gave up on then ends the VM that start made, not one a
    // later op's start (a wake placed on this host again) found running and took for its own.
    const makes = makesOf(w);
    const stops = w.work.case === 'destroyVm' && w.work.value.sandboxId ? [w.work.value.sandboxId] : [];
    const before = [...makes.flatMap((id) => [...(this.stopping.get(id) ?? [])]), ...stops.flatMap((id) => [...(this.making.get(id) ?? [])].map((m) => m.settled))];
    if (before.length > 0) this.after.set(key, before);
    const p = this.runStepOnce(w).finally(() => {
      this.inProgress.delete(key);
      this.after.delete(key);
      this.stopNotes.delete(key);
    });
    this.inProgress.set(key, p);
    // VMs this step makes are "being made" from now on, before its journal read: a destroy
    // delivered after it waits for it, instead of finding no VM while this step still reads
    // its journal, and the VM then running on with no record.
    const settled = p.then(
      () => undefined,
      () => undefined,
    );
    track(this.making, makes, { opId: w.opId, settled }, settled);
    track(this.stopping, stops, settled, settled);
    return p;
  }

  /** Settles when the steps delivered before `w` that it must wait for have (runStep). */
  private stepsBefore(w: HostWork): Promise<unknown> {
    return Promise.all(this.after.get(`${w.opId}/${w.stepId}`) ?? []);
  }

  private async runStepOnce(w: HostWork): Promise<HostResult> {
    // The term is kept before the step acts: after a crash, what it did is not undone by a
    // redelivered step of the term before.
    await this.termKept;
    const { journal, clock } = this.deps;
    const log = this.log.child({ opId: w.opId, stepId: w.stepId });
    const started = clock.now();
    /** Into the step metrics (also a step refused before it ran: a host refusing every step shows there). */
    const counted = (): void => this.deps.metrics?.step(w.work.case ?? 'none', result.error?.kind, clock.now() - started);
    const result = create(HostResultSchema, { opId: w.opId, stepId: w.stepId, hostId: this.deps.config.hostId, attempt: w.attempt });
    let read: Uint8Array | undefined;
    try {
      read = await journal.get(w.opId, w.stepId);
    } catch (e) {
      // A stop needs no journal to be safe to run again (it ends the VM if there is one), and
      // is often sent without a waiter to retry it (a start given up on, a dead VM's clean-up):
      // it runs.
      if (w.work.case === 'destroyVm') log.error({ err: e }, 'step journal unreadable; running the stop all the same');
      else {
        // Answered, not left to redelivery (which would fail alike until JetStream drops it):
        // the scheduler sees why, and retries the step (retryable: a disk error may pass; a step
        // answered final here would never run).
        log.error({ err: e }, 'step journal unreadable; step not run');
        result.error = create(ErrorInfoSchema, errorInfo(journalUnreadable(e)));
        counted();
        return result;
      }
    }
    const prior = journalled(read, w);
    if (prior) {
      // A give-up of this start's sandboxes that came before an agent restart is known from the
      // journal only: read into memory (gaveUpOn), so that the answer leaves them out (answerTo).
      if (!prior.error) {
        try {
          await Promise.all(makesOf(w).map((id) => this.gaveUpOn(w.opId, id)));
        } catch (e) {
          log.error({ err: e }, 'step journal unreadable; journalled result not answered');
          result.error = create(ErrorInfoSchema, errorInfo(e));
          counted();
          return result;
        }
      }
      return prior;
    }
    try {
      log.info({ work: w.work.case }, 'step started');
      await this.act(w, result, log);
    } catch (e) {
      log.warn({ err: e }, 'step failed');
      result.error = create(ErrorInfoSchema, errorInfo(e));
    }
    result.duration = durationFromMs(Math.round(clock.now() - started));
    counted();
    // A failure that may succeed on a retry is journalled for this send only (its attempt and
    // leader term): the scheduler's retry is a new send and runs the step again, while the
    // same message delivered again (a batch acked only once all its steps were, an ack that
    // was lost) gets the same answer. Run again, a restore answered failed, whose sandbox the
    // scheduler then placed elsewhere, made a second VM of it here; a pause, a paused VM
    // recorded running. A journal that cannot be written (disk full) does not hide what the
    // step did: the result goes out all the same (a redelivery would then run the step again,
    // and every step checks what is already there first).
    const entry = result.error?.retryable ? retryableEntry(w, result) : toBinary(HostResultSchema, result);
    await this.journalInTurn(w, () => journal.put(w.opId, w.stepId, entry)).catch((e: unknown) => log.error({ err: e }, 'could not journal the step result; reporting it anyway'));
    log.info({ ok: !result.error, ms: clock.now() - started }, 'step finished');
    return result;
  }

  private spec(v: VmSpec | undefined, field: string): Required<Pick<VmSpec, 'sandboxId' | 'hostname'>> & { vcpus: number; memoryMib: number; network?: NetworkPolicySpec } {
    if (!v || !v.sandboxId) throw new ForkfleetError('invalid_argument', `${field}: missing VM spec`, { field });
    const network = v.network?.allowEgress ? { network: { allowEgress: true, allowCidrs: [...v.network.allowCidrs] } } : {};
    return { sandboxId: v.sandboxId, hostname: v.hostname || v.sandboxId, vcpus: v.resources?.vcpus || 1, memoryMib: Number(v.resources?.memoryMib ?? 256n) || 256, ...network };
  }

  /**
   * A step's work. VMs a step makes are "being made" while it runs (runStep): a destroy of
   * one of them waits for every step making it that was delivered before it (the scheduler
   * can give up on a slow create or restore and destroy its sandbox while the VM is still
   * starting; found missing, the VM would run on with no record), and a start waits for the
   * destroys of its sandbox delivered before it. The wait is bounded by those steps, which
   * the scheduler's step timeout (180 s by default, per attempt) outlasts. Should the agent die meanwhile,
   * the scheduler stops a VM whose record moved on when the restore's result comes
   * (Executor.markRunning), or queues a stop of that op behind the restore (gaveUp).
   */
  /**
   * Whether the scheduler gave up on starting `sandboxId` in op `opId` here: in memory, or,
   * after an agent restart, its stop step's journalled result (the stop was acked then, and
   * will not come again to undo a start a redelivered batch would make).
   */
  private async gaveUpOn(opId: string, sandboxId: string): Promise<boolean> {
    const key = `${opId}/${sandboxId}`;
    if (this.gaveUp.has(key)) return true;
    // The reads at once: a restore step checks each of its VMs, on the way to ready. A stop's
    // delivery record (noteStop) counts as well as its result: delivered before the agent
    // died, it may not have run yet. Unreadable is not "not given up": the VM would be
    // started for a start that was given up on.
    const found = await Promise.all(GAVE_UP_KINDS.flatMap((kind) => [`stop-${kind}/${sandboxId}`, `stop-${kind}/${sandboxId}${STOP_NOTED}`]).map((step) => this.journalGet(opId, step)));
    if (!found.some(Boolean)) return false;
    this.rememberGaveUp(key);
    return true;
  }

  /**
   * Notes a guarded stop as it is delivered, before it waits for a slot or for the steps
   * before it: one by which the scheduler gives up on a start of its op here (GAVE_UP_STEP),
   * or one it sends with no waiter (UNWAITED_STOP_STEP: a hibernated sandbox's stop sent
   * again, a stray's, a lost VM's back on its host). A start of a given-up op coming after it
   * makes no VM of the sandbox (gaveUp). The owner the sandbox's VM has now (ownerOf) is kept
   * in `<step>#given-up`, where it outlives an agent restart, and for a stop with no waiter
   * the ops of the starts of the sandbox delivered before it (running, or waiting for a slot):
   * it waits for those, and the VM one of them makes (a child's that moved on during its
   * restore) is the one it was sent for. The stop then ends the VM only if one of those, or
   * its own op, still has it: one a later op's start made or took meanwhile is not its to end
   * (a wake placed here again, re-sent at once after an agent restart, while this stop,
   * delivered before the restart, comes back only after the bus's ack wait). What the first
   * delivery noted counts. Never rejects (a journal that fails leaves no owner known, and the
   * stop ends the VM as before owners were kept). Undefined for other steps (a user's
   * destroy, a drain's: they end whatever VM is there).
   */
  private noteStop(w: HostWork): Promise<StopNote> | undefined {
    if (w.work.case !== 'destroyVm' || !w.work.value.sandboxId) return undefined;
    const givingUp = GAVE_UP_STEP.test(w.stepId);
    if (!givingUp && !UNWAITED_STOP_STEP.test(w.stepId)) return undefined;
    const key = `${w.opId}/${w.stepId}`;
    const noted = this.stopNotes.get(key);
    if (noted) return noted;
    const sandboxId = w.work.value.sandboxId;
    if (givingUp) this.rememberGaveUp(`${w.opId}/${sandboxId}`);
    const { journal } = this.deps;
    const record = `${w.stepId}${STOP_NOTED}`;
    // Read now, in delivery order: a start delivered after this stop claims only once the note is done.
    const known = this.owners.has(sandboxId);
    const ownerNow = this.owners.get(sandboxId);
    const starts = givingUp ? [] : this.startsOf(sandboxId);
    // After any note of this sandbox under way (another op's stop): a claim waits for the last
    // note only, so notes go one after another.
    const before = this.noting.get(sandboxId);
    const p = (async (): Promise<StopNote> => {
      await before?.catch(() => undefined);
      const earlier = stopRecord(await journal.get(w.opId, record).catch(() => undefined));
      if (earlier) return earlier;
      const owner = known ? ownerNow : await this.ownerOf(sandboxId);
      await journal.put(w.opId, record, Buffer.from(JSON.stringify({ owner: owner ?? null, ...(starts.length ? { starts } : {}) }), 'utf8')).catch((e: unknown) => this.log.warn({ err: e, opId: w.opId, stepId: w.stepId }, 'could not journal the delivery of a stop; after a restart it may end a VM a later op took'));
      return { owner, starts };
    })();
    this.stopNotes.set(key, p);
    this.noting.set(sandboxId, p);
    void p.then(() => {
      if (this.noting.get(sandboxId) === p) this.noting.delete(sandboxId);
    });
    return p;
  }

  /** Ops of the starts of `sandboxId` delivered and not settled: running (making) or waiting for a slot (queue). */
  private startsOf(sandboxId: string): string[] {
    const running = [...(this.making.get(sandboxId) ?? [])].map((m) => m.opId);
    const queued = this.queue.filter((q) => makesOf(q.w).includes(sandboxId)).map((q) => q.w.opId);
    return [...new Set([...running, ...queued])];
  }

  /** The op that made or last took the sandbox's VM here (owners, else the journal); undefined when none is known or it is unreadable. */
  private async ownerOf(sandboxId: string): Promise<string | undefined> {
    const known = this.owners.get(sandboxId);
    if (known !== undefined) return known;
    const b = await this.deps.journal.get(ownerRecord(sandboxId), 'owner').catch((e: unknown) => {
      this.log.warn({ err: e, sandboxId }, "the owner of a sandbox's VM is unreadable: taken as unknown");
      return undefined;
    });
    if (!b?.length) return undefined;
    const owner = Buffer.from(b).toString('utf8');
    if (!this.owners.has(sandboxId)) this.setOwner(sandboxId, owner);
    return this.owners.get(sandboxId);
  }

  /**
   * Records `opId` as the owner of the sandbox's VM, which its create or restore made or found
   * running here and took (reported as its own), in memory and in the journal, before the
   * step's result goes out. After a stop of that sandbox being noted (noteStop), so the
   * note has the owner from before. A journal that cannot be written is logged: the owner is
   * then unknown after a restart, and a given-up stop ends the VM as before owners were kept.
   */
  private async claim(sandboxId: string, opId: string, log: Logger): Promise<void> {
    await this.noting.get(sandboxId);
    if (this.owners.get(sandboxId) === opId) return;
    this.setOwner(sandboxId, opId);
    await this.deps.journal.put(ownerRecord(sandboxId), 'owner', Buffer.from(opId, 'utf8')).catch((e: unknown) => log.warn({ err: e, sandboxId }, "could not journal the owner of a sandbox's VM"));
  }

  /**
   * Forgets the owner of the sandbox's VM once that VM is gone (a stop ended it or found none,
   * a start ended a stale one), in memory and in the journal (an empty record: none known). The
   * sandbox's next VM here is not that op's: a start that makes it, the agent killed before its
   * claim, is redelivered to the next agent and takes the VM, which that agent adopted, as its
   * own (ownVm: no owner known). With the old owner kept, it ended that VM as stale and made
   * it again. A journal that cannot be written is logged: the old owner then outlives a restart.
   */
  private async forgetOwner(sandboxId: string, log: Logger): Promise<void> {
    if ((await this.ownerOf(sandboxId)) === undefined) return;
    await this.deps.journal.put(ownerRecord(sandboxId), 'owner', new Uint8Array()).catch((e: unknown) => log.warn({ err: e, sandboxId }, "could not journal that a sandbox's VM has no owner any more"));
    this.owners.delete(sandboxId);
  }

  private setOwner(sandboxId: string, opId: string): void {
    this.owners.delete(sandboxId);
    this.owners.set(sandboxId, opId);
    if (this.owners.size > GAVE_UP_MAX) this.owners.delete(this.owners.keys().next().value as string);
  }

  /** A journal read a step cannot go on without: a failure is retryable (journalUnreadable), so the step is not answered final. */
  private async journalGet(opId: string, stepId: string): Promise<Uint8Array | undefined> {
    try {
      return await this.deps.journal.get(opId, stepId);
    } catch (e) {
      throw journalUnreadable(e);
    }
  }

  /** A journal write a step cannot go on without: a failure is retryable (journalUnwritable). */
  private async journalPut(opId: string, stepId: string, bytes: Uint8Array): Promise<void> {
    try {
      await this.deps.journal.put(opId, stepId, bytes);
    } catch (e) {
      throw journalUnwritable(e);
    }
  }

  private rememberGaveUp(key: string): void {
    this.gaveUp.add(key);
    if (this.gaveUp.size > GAVE_UP_MAX) this.gaveUp.delete(this.gaveUp.values().next().value as string);
    // A restore by migration of it under way: its wait and stream end now (minutes, else).
    this.migratingIn.get(key)?.abort(gaveUpReason(key));
  }

  /**
   * Whether a VM a create or restore of op `opId` finds for its sandbox is the one it makes,
   * made by an earlier run of this op (the agent died before its result, and adopted the VM
   * after its restart; a re-send), which is reported rather than made again: only a running
   * one made from `base` (the step's snapshot; null: a create's image) that this op made or
   * took (claim), or whose owner is not known (its claim not journalled before the agent
   * died; the owner of the sandbox's VM before it, ended here, is forgotten: forgetOwner). Any
   * other is stale and is not this op's to report: a hibernated sandbox's VM, paused, whose
   * stop failed; a drain's source left behind; the VM of a start the scheduler gave up on,
   * another op's; this op's own from an earlier step of another snapshot (a drain's migration
   * tried again from a newer snapshot of the source, the first attempt's VM not stopped yet).
   * Reported, the sandbox would be recorded running from it, with none of the step's snapshot
   * and none of its after_resume hooks run.
   */
  private async ownVm(vm: VmInfo, sandboxId: string, opId: string, base: string | null): Promise<boolean> {
    if (vm.state !== 'running' || vm.baseSnapshotId !== base) return false;
    const owner = await this.ownerOf(sandboxId);
    return owner === undefined || owner === opId;
  }

  /** Ends a VM a start found for its sandbox that is not its own (ownVm), and forgets its owner: the start makes the sandbox's VM anew. */
  private async destroyStale(vm: VmInfo, sandboxId: string, log: Logger): Promise<void> {
    if (vm.state !== 'crashed' && vm.state !== 'destroyed') log.warn({ sandboxId, state: vm.state, baseSnapshotId: vm.baseSnapshotId }, "a start found a VM of its sandbox that is not its own: ended, and the VM made anew");
    await this.deps.driver.destroy(sandboxId);
    await this.forgetOwner(sandboxId, log);
  }

  private async act(w: HostWork, result: HostResult, log: Logger): Promise<void> {
    const { driver, shipper } = this.deps;
    const work = w.work;
    switch (work.case) {
      case 'createVm': {
        const s = this.spec(work.value.vm, 'create_vm.vm');
        await this.stepsBefore(w);
        if (await this.gaveUpOn(w.opId, s.sandboxId)) throw gaveUpError(w.opId, [s.sandboxId]);
        const existing = driver.get(s.sandboxId);
        if (existing && (await this.ownVm(existing, s.sandboxId, w.opId, null))) {
          // Found running, this op's own (made before the agent died): reported, not made again.
          await this.claim(s.sandboxId, w.opId, log);
          result.vms = [this.vmStatus(existing)];
          return;
        }
        if (existing) await this.destroyStale(existing, s.sandboxId, log);
        const image = await this.image(work.value.image || DEFAULT_IMAGE);
        // Again after the image, whose build may take minutes: a start given up on meanwhile
        // (its stop noted on delivery) would boot a VM nobody books, until that stop ends it.
        if (this.gaveUp.has(`${w.opId}/${s.sandboxId}`)) throw gaveUpError(w.opId, [s.sandboxId]);
        const vm = await driver.create({ vmId: s.sandboxId, image, memoryMib: s.memoryMib, vcpus: s.vcpus, hostname: s.hostname, sandboxId: s.sandboxId, ...(s.network ? { network: s.network } : {}) });
        await this.claim(s.sandboxId, w.opId, log);
        this.touch(vm.vmId);
        result.vms = [this.vmStatus(vm)];
        return;
      }
      case 'snapshotVm': {
        const { sandboxId, snapshotId } = work.value;
        const local = await driver.snapshot(sandboxId, snapshotId); // idempotent per snapshot id
        result.pause = durationFromMs(Math.round(local.manifest.sourcePauseMs));
        result.manifest = await shipper.ingest(local);
        return;
      }
      case 'restoreVms': {
        const { snapshotId, vms } = work.value;
        const specs = vms.map((v, i) => this.spec(v, `restore_vms.vms[${i}]`));
        const have: VmInfo[] = [];
        const missing: typeof specs = [];
        await this.stepsBefore(w);
        const givenUp = await Promise.all(specs.map((s) => this.gaveUpOn(w.opId, s.sandboxId)));
        // Every one given up on: failed, as a create is (a wake records its sandbox running from any success).
        if (specs.length > 0 && givenUp.every(Boolean)) throw gaveUpError(w.opId, specs.map((s) => s.sandboxId));
        for (const [i, s] of specs.entries()) {
          // Given up on here (placed again elsewhere, say) before this step ran: not made.
          if (givenUp[i]) continue;
          const ex = driver.get(s.sandboxId);
          if (ex && (await this.ownVm(ex, s.sandboxId, w.opId, snapshotId))) have.push(ex);
          else {
            if (ex) await this.destroyStale(ex, s.sandboxId, log);
            missing.push(s);
          }
        }
        const clones: CloneSpec[] = missing.map((s) => ({ vmId: s.sandboxId, hostname: s.hostname, sandboxId: s.sandboxId, ...(s.network ? { network: s.network } : {}) }));
        // VMs with hooks that this step is about to make, recorded first: a redelivery after a
        // crash runs the hooks on those it finds, and only on those (not on a VM another op made).
        const making = `${w.stepId}#making`;
        // Unreadable is a retryable failure (the hooks of a VM made before would be skipped); torn: none recorded.
        const madeBefore = new Set<string>(have.length ? makingRecord(await this.journalGet(w.opId, making)) : []);
        const hooks = new Map(vms.map((v) => [v.sandboxId, v.afterResume]));
        const hooked = clones.filter((c) => (hooks.get(c.vmId)?.length ?? 0) > 0).map((c) => c.vmId);
        if (hooked.length) await this.journalPut(w.opId, making, Buffer.from(JSON.stringify([...new Set([...madeBefore, ...hooked])])));
        let made: VmInfo[] = [];
        const givenUpNow = (vmId: string): boolean => this.gaveUp.has(`${w.opId}/${vmId}`);
        const migrated = clones.length ? await this.restoreByMigration(w.opId, snapshotId, work.value.fetch, clones, log) : undefined;
        if (migrated) {
          // Given up on while it migrated (seconds to minutes: a disk layer, an image, the
          // stream): not kept, as a fetch makes none given up on meanwhile (below). It would run
          // unbooked, maybe beside the sandbox placed again elsewhere, until its stop ended it.
          const dropped = migrated.vms.filter((v) => givenUpNow(v.vmId));
          await Promise.all(dropped.map((v) => driver.destroy(v.vmId).catch((e: unknown) => log.warn({ err: e, vmId: v.vmId }, 'could not destroy a migrated VM given up on; its stop ends it'))));
          made = migrated.vms.filter((v) => !givenUpNow(v.vmId));
          if (made.length === 0 && have.length === 0) throw gaveUpError(w.opId, clones.map((c) => c.vmId));
          result.bytesFetched = BigInt(migrated.bytes);
          result.restoredByMigration = true;
        } else if (clones.length === 0) {
          // A redelivery that finds every VM (the agent died before its result): nothing to
          // restore, so nothing to fetch, which may not even be possible any more (sources
          // gone, ticket expired). Held here only if the snapshot is complete on this host (an
          // earlier restore by migration never fetched it).
          const held = shipper.holds ? await shipper.holds(snapshotId) : shipper.held().some((h) => h.snapshotId === snapshotId && h.complete);
          if (!held) result.snapshotNotHeld = true;
        } else {
          // Every one given up on while a restore by migration was tried: nothing to fetch for.
          if (have.length === 0 && clones.every((c) => givenUpNow(c.vmId))) throw gaveUpError(w.opId, clones.map((c) => c.vmId));
          const lease = shipper.lease?.(snapshotId, `restore/${w.opId}/${w.stepId}`);
          try {
            const f0 = this.deps.clock.now();
            const { local, bytesFetched } = await shipper.obtain(snapshotId, work.value.fetch, (done, total) =>
              this.deps.bus.publishEvent(this.event(HostEventType.TRANSFER_PROGRESS, { snapshotId, opId: w.opId, bytesDone: BigInt(done), bytesTotal: BigInt(total) })),
            );
            result.bytesFetched = BigInt(bytesFetched);
            if (bytesFetched > 0) {
              result.fetch = durationFromMs(Math.round(this.deps.clock.now() - f0));
              // Served onward from the moment it is stored durably (a fork's next wave copies
              // from here), not only once this step, with its VMs and their hooks, has ended.
              // Best effort: a failure to store is said below, where the step waits for it.
              void shipper
                .durable?.(snapshotId)
                .then(() => this.deps.bus.publishEvent(this.event(HostEventType.SNAPSHOT_STORED, { snapshotId, opId: w.opId })))
                .catch(() => undefined);
            }
            await this.baseImageFor(local.manifest, log);
            // Again after the fetch and the image (minutes, maybe): starts given up on meanwhile
            // are not made (they would run unbooked until their stops end them).
            const still = clones.filter((c) => !givenUpNow(c.vmId));
            if (still.length === 0 && have.length === 0) throw gaveUpError(w.opId, clones.map((c) => c.vmId));
            if (still.length) made = await driver.fork(local, still);
          } finally {
            lease?.release();
          }
          if (made.length) this.recordRestore(Math.min(...made.map((v) => v.readyMs)));
        }
        // Made or found running (and reported) by this op: its own from now on, also for a
        // guarded stop of an earlier op coming after (noteStop).
        await Promise.all([...have, ...made].map((v) => this.claim(v.vmId, w.opId, log)));
        // A VM an earlier delivery of this step made (the agent died before its result) gets
        // its hooks now unless that delivery recorded them run: at least once.
        const reports = new Map(
          await Promise.all(
            [...made, ...have.filter((v) => madeBefore.has(v.vmId))].map(async (v) => [v.vmId, await this.hooksOnce(w, v.vmId, hooks.get(v.vmId) ?? [], log, made.includes(v))] as const),
          ),
        );
        // The scheduler records this host as a holder of a snapshot it fetched: only once that
        // is durable (it ran alongside the restore). If it could not be, the VMs run all the
        // same (from the image) and the host says it does not hold the snapshot.
        if (!migrated && clones.length > 0) {
          await shipper.durable?.(snapshotId).catch((e: unknown) => {
            log.warn({ snapshotId, err: e instanceof Error ? e.message : String(e) }, 'fetched snapshot not stored durably: restored, but not held here');
            result.snapshotNotHeld = true;
          });
        }
        // A VM made now (a fork's child, a woken sandbox) has been idle for no time at all,
        // whatever an earlier VM of the same sandbox on this host last did.
        for (const v of made) this.touch(v.vmId);
        result.vms = [...have, ...made].map((v) => this.vmStatus(v, { reason: reports.get(v.vmId) ?? '' }));
        log.info({ children: made.length, reused: have.length, bytesFetched: Number(result.bytesFetched), migrated: !!migrated }, 'restored');
        return;
      }
      case 'pauseVm': {
        const vm = this.vmOf(work.value.sandboxId);
        // The idle rule's: only a VM idle still (a call may have begun since it judged).
        const idleFor = Number(work.value.onlyIfIdleMs);
        const notIdle = (v: VmInfo): ForkfleetError | undefined => {
          // Nor one in a snapshot (a fork of it): a call made meanwhile waits for the snapshot
          // to end and would run then, under the pause queued behind the snapshot.
          if (idleFor > 0 && v.state === 'snapshotting') {
            return new ForkfleetError('failed_precondition', `sandbox ${work.value.sandboxId} is not idle: a snapshot of it is under way; not paused for the idle hibernation`, { retryable: false });
          }
          const idle = idleFor > 0 && v.state === 'running' ? this.idleMs(v) : Number.POSITIVE_INFINITY;
          if (idle < idleFor) {
            return new ForkfleetError('failed_precondition', `sandbox ${work.value.sandboxId} is not idle: busy (a call or guest CPU) ${Math.round(idle / 1000)} s ago, under its idle timeout of ${Math.round(idleFor / 1000)} s; not paused for the idle hibernation`, { retryable: false });
          }
          // A drain's: not while a call runs in it (the drain waits for its calls, for a grace).
          const calls = work.value.unlessCalls && v.state === 'running' ? (this.activity.get(v.vmId)?.calls ?? 0) : 0;
          if (calls > 0) return new CallsRunningError(work.value.sandboxId, calls);
          return undefined;
        };
        const refused = notIdle(vm);
        if (refused) throw refused;
        // Judged again once the driver holds the VM: a snapshot holds it from before its state
        // says snapshotting, and a call made while the pause waits for it (busy from its start)
        // would run once it ends, under the pause. Also when already paused: the driver asks
        // QEMU then (a `cont` that timed out may have run the guest all the same).
        await driver.pause(vm.vmId, idleFor > 0 || work.value.unlessCalls ? { refuse: notIdle } : {});
        result.vms = [this.vmStatus(this.vmOf(vm.vmId))];
        return;
      }
      case 'resumeVm': {
        const vm = this.vmOf(work.value.sandboxId);
        // Also when running already: the driver asks QEMU then (a `stop` that timed out, in a
        // pause that failed, may have stopped the guest all the same).
        await driver.resume(vm.vmId);
        // Idle time counts from the resume, not from before the pause.
        this.touch(vm.vmId);
        // A redelivery (the agent died after the hooks, before the result) does not run them again.
        const reason = await this.hooksOnce(w, vm.vmId, work.value.afterResume, log, false);
        result.vms = [this.vmStatus(this.vmOf(vm.vmId), { reason })];
        return;
      }
      case 'destroyVm': {
        const { sandboxId } = work.value;
        const noted = this.noteStop(w);
        const then = noted ? await noted : undefined;
        await this.stepsBefore(w);
        if (!driver.get(sandboxId)) return this.forgetOwner(sandboxId, log);
        if (then) {
          // A guarded stop ends the VM it was sent for: its own op's start's, the one there when
          // it came, or the one a start delivered before it made; not one a later op's start
          // made or took since: that op reported it running.
          const owner = await this.ownerOf(sandboxId);
          if (owner !== undefined && owner !== w.opId && owner !== then.owner && !then.starts.includes(owner)) {
            log.info({ sandboxId, owner }, "stop of a VM a later op's start made or took since it was sent: left running");
            return;
          }
        }
        await driver.destroy(sandboxId);
        await this.forgetOwner(sandboxId, log);
        return;
      }
      case 'deleteSnapshot': {
        await driver.dropStandbys?.(work.value.snapshotId);
        await shipper.remove(work.value.snapshotId);
        return;
      }
      case 'fetchSnapshot': {
        // A replica or a drain: no VM restores from it here now, so no image is built (replicate).
        // Named no source, it must be here already: obtain checks that, as it always did.
        const replicate = shipper.replicate && work.value.sources.length > 0 ? shipper.replicate.bind(shipper) : undefined;
        const { bytesFetched } = replicate ? await replicate(work.value.snapshotId, work.value) : await shipper.obtain(work.value.snapshotId, work.value, () => undefined);
        // A replica counts once it survives a crash; a failure to store it may pass on a retry.
        await shipper.durable?.(work.value.snapshotId).catch((e: unknown) => {
          throw e instanceof ForkfleetError ? e : new ForkfleetError('unavailable', `storing snapshot ${work.value.snapshotId} durably failed: ${e instanceof Error ? e.message : String(e)}`, { cause: e });
        });
        result.bytesFetched = BigInt(bytesFetched);
        return;
      }
      default:
        throw new ForkfleetError('failed_precondition', `this agent does not support ${String(work.case)} work`);
    }
  }

  /**
   * Restore by migration (ADR 0015): when the snapshot is held elsewhere, the scheduler
   * allows it and the step is small, each VM is migrated from a source's paused clone
   * straight into its QEMU here, instead of fetching the whole snapshot first. All or
   * nothing: on any failure the VMs made so far are destroyed and undefined is returned, so
   * the step falls back to fetching the snapshot; the first failure ends the others' waits and
   * streams at once (a stream may run for minutes). A VM the scheduler gives up on (op
   * `opId`; rememberGaveUp) is not loaded, or has its load ended at once, and is not returned;
   * its siblings go on.
   */
  private async restoreByMigration(opId: string, snapshotId: string, fetch: FetchSnapshotWork | undefined, clones: CloneSpec[], log: Logger): Promise<{ vms: VmInfo[]; bytes: number } | undefined> {
    const { driver, shipper } = this.deps;
    const max = this.deps.config.migrateMaxChildren ?? 2;
    if (!fetch?.allowMigration || !fetch.ticket || clones.length > max || migrationSources(fetch).length === 0) return undefined;
    if (!driver.prepareIncoming || !shipper.incomingSource || !shipper.migrateFrom || !shipper.holds) return undefined;
    if (await shipper.holds(snapshotId)) return undefined;
    const prepare = driver.prepareIncoming.bind(driver);
    const migrateFrom = shipper.migrateFrom.bind(shipper);
    const listenHost = hostOfAddress(this.deps.config.peerAddress);
    const t0 = this.deps.clock.now();
    // The source is asked at once, while the disk layer is fetched and the VM prepared: its
    // connection waits (unread) until the VM is ready to load it.
    const srcP = shipper.incomingSource(snapshotId, fetch);
    // Any clone's failure (its preparation, its source, its load) ends every clone's wait for
    // its source's connection and any stream being loaded: all or nothing, the others' VMs
    // would be destroyed anyway, after their streams had run to the end.
    const anyFailed = new AbortController();
    try {
      const results = await Promise.allSettled(
        clones.map(async (c) => {
          const key = `${opId}/${c.vmId}`;
          // Given up on (rememberGaveUp) from here on: its wait for the source and its load end.
          const givenUp = new AbortController();
          if (this.gaveUp.has(key)) givenUp.abort(gaveUpReason(key));
          this.migratingIn.set(key, givenUp);
          const givenUpP = new Promise<never>((_, reject) => {
            if (givenUp.signal.aborted) reject(givenUp.signal.reason);
            else givenUp.signal.addEventListener('abort', () => reject(givenUp.signal.reason), { once: true });
          });
          givenUpP.catch(() => undefined);
          const incomingP = srcP.then(async (from) => {
            await this.baseImageFor(from.manifest, log);
            return prepare(from, c);
          });
          // A preparation that fails after the give-up fails nothing but this clone.
          incomingP.catch((e: unknown) => {
            if (!givenUp.signal.aborted) anyFailed.abort(e);
          });
          try {
            return await migrateFrom(fetch, listenHost, async (conn, sourceGone) => {
              const drop = (): void => {
                if (!('unixPath' in conn)) conn.destroy();
              };
              // Not held for a preparation still under way (an image build, a disk layer) once
              // given up on: the source's stream and relay are let go at once.
              const incoming = await Promise.race([incomingP, givenUpP]).catch((e: unknown) => {
                drop();
                throw e;
              });
              // Thrown, not returned: the source's call and a relay end now, not once the
              // source has found its stream going nowhere.
              if (givenUp.signal.aborted) {
                drop();
                throw givenUp.signal.reason;
              }
              // The load fails (its VM destroyed) as soon as either ends.
              return incoming.load(conn, AbortSignal.any([sourceGone, givenUp.signal]));
            }, AbortSignal.any([anyFailed.signal, givenUp.signal]));
          } catch (e) {
            await incomingP.then((i) => i.abort(), () => undefined);
            // Given up on: not a failure of the migration (its siblings go on).
            if (givenUp.signal.aborted) return undefined;
            anyFailed.abort(e);
            throw e;
          } finally {
            if (this.migratingIn.get(key) === givenUp) this.migratingIn.delete(key);
          }
        }),
      );
      const vms = results.flatMap((r) => (r.status === 'fulfilled' && r.value ? [r.value.result] : []));
      const failed = results.find((r): r is PromiseRejectedResult => r.status === 'rejected');
      if (failed) {
        await Promise.all(vms.map((v) => driver.destroy(v.vmId).catch(() => undefined)));
        throw failed.reason;
      }
      const bytes = (await srcP).bytesFetched + results.reduce((n, r) => n + (r.status === 'fulfilled' ? (r.value?.bytes ?? 0) : 0), 0);
      log.info({ snapshotId, vms: vms.length, bytes, ms: this.deps.clock.now() - t0 }, 'restored by migration');
      return { vms, bytes };
    } catch (e) {
      log.warn({ snapshotId, err: e instanceof Error ? e.message : String(e) }, 'restore by migration failed; fetching the snapshot instead');
      return undefined;
    } finally {
      (await srcP.catch(() => undefined))?.release();
    }
  }

  /** The builds here, and the recipe each image is built by here now (current; not built yet: no disk digest), for heartbeats. */
  private imagesHere(): Array<{ name: string; recipeHash: string; diskSha256: string; current: boolean }> {
    const out = [...this.built.values()].map((b) => ({ ...b, current: this.recipes.get(b.name) === b.recipeHash }));
    for (const [name, recipeHash] of this.recipes) if (!this.built.has(`${name}-${recipeHash}`)) out.push({ name, recipeHash, diskSha256: '', current: true });
    return out;
  }

  /** A guest image (deps.images: built first if its cache entry is missing or torn), noted as built here (built). */
  private async image(name: string): Promise<GuestImage> {
    const img = await this.deps.images(name);
    if (img.diskSha256) this.built.set(`${img.name}-${img.recipeHash}`, { name: img.name, recipeHash: img.recipeHash, diskSha256: img.diskSha256 });
    return img;
  }

  /**
   * This host's build of the image a snapshot was taken from, made before the snapshot is
   * restored: the restore runs over this host's own copy (the same cache path on every host),
   * which a host that never created a sandbox of that image has not built. A failure is only
   * logged: the driver then refuses the restore naming what is missing, as it refuses a build
   * whose base disk differs from the snapshot's (another recipe here, say).
   * One noted as built is looked for again in the cache (deps.cachedImage, that entry only:
   * image.json and file sizes, nothing hashed): one an operator removed since (or that was
   * torn) is no longer listed in heartbeats, and is built again as one never built here. One
   * that cannot be read now (EIO, EMFILE) is taken as there: VMs may run over it.
   */
  private async baseImageFor(m: { image?: { name: string; recipeHash: string } }, log: Logger): Promise<void> {
    const want = m.image;
    if (!want?.name) return;
    const key = `${want.name}-${want.recipeHash}`;
    if (this.built.has(key)) {
      // No way to look (a port not given): taken as there, as before that look existed.
      const here = this.deps.cachedImage ? await this.deps.cachedImage(want.name, want.recipeHash).catch(() => 'unknown' as const) : 'whole';
      // Said, not acted on: a cache disk that fails reads is the operator's to see.
      if (here === 'unknown') log.warn({ image: key }, 'the image cache entry noted as built here cannot be read now; taken as there');
      if (here !== 'missing') return;
      // Only the first to find it gone forgets the look done before, not a build started since.
      if (this.built.delete(key)) {
        this.baseImages.delete(key);
        log.warn({ image: key }, 'the image noted as built here is no longer in the cache: built again');
      }
    }
    let p = this.baseImages.get(key);
    if (!p) {
      // One look per image at a time, and once per agent for an image this host cannot build
      // (another recipe: another kernel or other package versions here). A failed build is
      // tried again by the next restore.
      p = (async () => {
        const here = await this.deps.imageRecipe?.(want.name);
        // Read again now: the recipe changes with the host's packages (an upgrade while the
        // agent runs), and heartbeats say it to placement.
        if (here !== undefined && this.recipes.has(want.name)) this.recipes.set(want.name, here);
        if (here !== undefined && here !== want.recipeHash) {
          log.warn({ image: key, recipeHere: here }, "this host's recipe for the image a snapshot was taken from differs: not built (the restore is refused)");
          return;
        }
        await this.image(want.name);
        if (!this.built.has(key)) log.warn({ image: key }, 'the image built here is not the one a snapshot was taken from');
      })().catch((e: unknown) => {
        this.baseImages.delete(key);
        log.warn({ err: e, image: key }, 'could not build the image a snapshot was taken from');
      });
      this.baseImages.set(key, p);
    }
    return p;
  }

  /**
   * The user's after_resume hooks of a restore or resume step on a VM, run once per step: the
   * report is journalled (`<step>#hooks/<vm>`), and a redelivery of the step (the agent died
   * after the hooks, before its result) answers with it instead of running them again.
   * `fresh`: the VM was made by this very run, so no earlier run can have run them. A journal
   * that fails is a retryable failure of the step (not answered final): the scheduler tries it
   * again.
   */
  private async hooksOnce(w: HostWork, vmId: string, hooks: readonly GuestHook[], log: Logger, fresh: boolean): Promise<string> {
    if (hooks.length === 0) return '';
    const key = `${w.stepId}#hooks/${vmId}`;
    const ran = fresh ? undefined : await this.journalGet(w.opId, key);
    if (ran) return Buffer.from(ran).toString('utf8');
    const report = await this.runHooks(vmId, hooks, log);
    await this.journalPut(w.opId, key, Buffer.from(report, 'utf8'));
    return report;
  }

  /**
   * The user's after_resume hooks, in order, in the guest. A failing hook doesn't fail the
   * restore or resume (the sandbox is healthy; the user's step is not): the first failure
   * is returned as a report for the sandbox's state_reason, and the rest still run.
   */
  private async runHooks(vmId: string, hooks: readonly GuestHook[], log: Logger): Promise<string> {
    const failures: string[] = [];
    for (const [i, h] of hooks.entries()) {
      const [path, ...args] = h.argv;
      if (!path) continue;
      const timeoutMs = h.timeout ? Number(h.timeout.seconds) * 1000 + Math.floor(h.timeout.nanos / 1e6) : 30_000;
      try {
        // Only the start of stderr is reported: the guest sends no more than that, so a hook that
        // writes megabytes costs no agent memory, for any number of VMs at once.
        const r = await this.deps.driver.exec(vmId, { path, args, timeoutMs, maxOutputBytes: HOOK_OUTPUT_BYTES });
        const stderr = (): string => r.stderr.subarray(0, HOOK_OUTPUT_BYTES).toString('utf8').trim().slice(0, 200);
        if (r.timedOut) failures.push(`after_resume[${i}] ${path} timed out after ${timeoutMs} ms and was killed`);
        else if (r.signal !== null) failures.push(`after_resume[${i}] ${path} was ended by signal ${r.signal}: ${stderr()}`);
        else if (r.exitCode !== 0) failures.push(`after_resume[${i}] ${path} exited ${r.exitCode}: ${stderr()}`);
      } catch (e) {
        // The report reaches the sandbox's owner: the error's kind only (its text is this host's:
        // socket paths, its internals), whole in this host's log.
        log.warn({ sandboxId: vmId, hook: i, err: e }, 'after_resume hook could not be run');
        failures.push(`after_resume[${i}] ${path} could not be run (${isForkfleetError(e) ? e.kind : 'internal'} error on its host)`);
      }
    }
    if (failures.length) log.warn({ sandboxId: vmId, failures }, 'after_resume hook failed');
    return failures.join('; ');
  }

  private vmOf(sandboxId: string): VmInfo {
    const vm = this.deps.driver.get(sandboxId);
    if (!vm || vm.state === 'destroyed') throw new ForkfleetError('not_found', `no VM for sandbox ${sandboxId} on host ${this.deps.config.hostId}`);
    return vm;
  }

  /**
   * The VM of a sandbox an exec or file call names. Its record says it runs here (the
   * scheduler checked), so a VM that is gone is not "no such sandbox" but a sandbox in the
   * wrong state until the VM check records it lost: failed_precondition on sandbox_id.
   */
  private callVm(sandboxId: string): VmInfo {
    const vm = this.deps.driver.get(sandboxId);
    // The scheduler matches this text (services/domain/fleet.ts vmNotRunning): a call refused so is sent again once woken.
    if (!vm || vm.state === 'destroyed') throw new ForkfleetError('failed_precondition', `sandbox ${sandboxId} has no VM on host ${this.deps.config.hostId} any more (it is being recorded lost)`, { field: 'sandbox_id' });
    return vm;
  }

  // ---------------------------------------------------------------- exec and files

  private async exec(req: HostExecRequest, emit: (out: HostExecOutput) => void, signal?: AbortSignal): Promise<void> {
    let seq = 0n;
    const out = (payload: HostExecOutput['payload']): void => emit({ $typeName: 'forkfleet.v1.HostExecOutput', seq: ++seq, payload });
    try {
      const vm = this.callVm(req.sandboxId);
      // A caller gone already (HostExecCancel before the command got here): it is not started.
      if (signal?.aborted) throw new ForkfleetError('cancelled', 'the exec was cancelled before its command started; it did not run');
      const timeoutMs = req.timeout ? Number(req.timeout.seconds) * 1000 + Math.floor(req.timeout.nanos / 1e6) : 60_000;
      const [path, ...args] = req.argv;
      // Output is passed on as the guest has it (a long command's while it runs), in pieces
      // that fit a NATS message.
      const piece = 512 * 1024;
      const onOutput = (stream: 'stdout' | 'stderr', data: Buffer): void => {
        for (let o = 0; o < data.length; o += piece) out({ case: stream, value: data.subarray(o, o + piece) });
      };
      const started = performance.now();
      const r = await this.inCall(vm.vmId, () =>
        this.deps.driver.exec(vm.vmId, {
          path: path!,
          args,
          // Added to the guest's environment; none given: the guest's own (PATH, HOME) as it is.
          ...(Object.keys(req.env).length ? { env: Object.entries(req.env).map(([k, v]) => `${k}=${v}`) } : {}),
          ...(req.cwd ? { cwd: req.cwd } : {}),
          ...(req.stdin.length ? { stdin: Buffer.from(req.stdin) } : {}),
          timeoutMs,
          onOutput,
          ...(signal ? { signal } : {}),
        }),
      );
      // A driver that does not stream returns the output with the exit.
      onOutput('stdout', r.stdout);
      onOutput('stderr', r.stderr);
      out({ case: 'exit', value: { $typeName: 'forkfleet.v1.HostExecExit', exitCode: r.exitCode, signal: r.signal ?? 0, timedOut: r.timedOut ?? false, outputTruncated: r.outputTruncated ?? false, durationMs: Math.round(performance.now() - started) } });
    } catch (e) {
      const info = errorInfo(e);
      out({ case: 'error', value: { $typeName: 'forkfleet.v1.ErrorInfo', ...info } });
    }
  }

  private async file(req: HostFileRequest): Promise<HostFileResponse> {
    const res: HostFileResponse = { $typeName: 'forkfleet.v1.HostFileResponse', data: new Uint8Array(), bytesWritten: 0n, eof: false };
    try {
      const vm = this.callVm(req.sandboxId);
      if (req.op.case === 'write') {
        const w = req.op.value;
        await this.inCall(vm.vmId, () => this.deps.driver.writeFile(vm.vmId, req.path, Buffer.from(w.data), { append: w.append, mode: w.mode }));
        res.bytesWritten = BigInt(w.data.length);
      } else if (req.op.case === 'read') {
        // A ranged read: the scheduler asks for pieces that fit a NATS message (HostFileRequest).
        const max = Number(req.op.value.maxBytes);
        const offset = Number(req.op.value.offset);
        const data = await this.inCall(vm.vmId, () => this.deps.driver.readFile(vm.vmId, req.path, { offset, maxBytes: max }));
        res.data = max > 0 && data.length > max ? data.subarray(0, max) : data;
        res.eof = max === 0 || data.length < max;
      } else {
        throw new ForkfleetError('invalid_argument', 'op: set read or write', { field: 'op' });
      }
    } catch (e) {
      res.error = { $typeName: 'forkfleet.v1.ErrorInfo', ...errorInfo(e) };
    }
    return res;
  }
}

/** Adds `entry` to each id's set in `m`, and takes it out again (and an emptied set) once `settled` settles. */
function track<T>(m: Map<string, Set<T>>, ids: readonly string[], entry: T, settled: Promise<void>): void {
  if (ids.length === 0) return;
  for (const id of ids) m.set(id, new Set([...(m.get(id) ?? []), entry]));
  void settled.then(() => {
    for (const id of ids) {
      const steps = m.get(id);
      steps?.delete(entry);
      if (steps?.size === 0) m.delete(id);
    }
  });
}

/** Sandbox ids a create or restore step makes. */
function makesOf(w: HostWork): string[] {
  const work = w.work;
  return (work.case === 'createVm' ? [work.value.vm?.sandboxId ?? ''] : work.case === 'restoreVms' ? work.value.vms.map((v) => v.sandboxId) : []).filter(Boolean);
}

/** The most of each stream an after_resume hook's exec reads from the guest: its failure report keeps 200 characters of stderr. */
const HOOK_OUTPUT_BYTES = 4096;

/** The image a create that names none boots, and the one an agent makes sure of when it starts. */
const DEFAULT_IMAGE = 'tiny';
/** Stops by which the scheduler gives up on a start of the same op on this host (Executor). */
const GAVE_UP_KINDS = ['unanswered', 'moved-on', 'replaced'] as const;
const GAVE_UP_STEP = new RegExp(`^stop-(${GAVE_UP_KINDS.join('|')})/`);
/**
 * Stops the scheduler sends with no waiter under an op of their own (`<op>-stop-again`,
 * `stray-…`, `moved-on-…`, `over-quota-…`, `no-room-…`, `vm-gone-…`, `reclaim-…`): meant for
 * the VM there when they are sent, not one a later op makes (noteStop). A user's destroy is
 * `destroy…`, and ends whatever VM is there.
 */
const UNWAITED_STOP_STEP = /^stop\//;
const GAVE_UP_MAX = 10_000;
/**
 * Suffix of a guarded stop's delivery record (noteStop): `{"owner": <op id> | null, "starts"?:
 * [<op id>]}`. Named when only give-ups had one (records an agent before wrote are read).
 */
const STOP_NOTED = '#given-up';

/** What a guarded stop noted on delivery (noteStop): the owner its sandbox's VM had (undefined: none known), and the ops of the starts of it delivered before. */
interface StopNote {
  owner: string | undefined;
  starts: string[];
}

/** Why a restore by migration of `<op>/<vm>` was ended: the scheduler gave up on that start (rememberGaveUp). */
function gaveUpReason(key: string): Error {
  return new Error(`the scheduler gave up on ${key}`);
}

/** The failure of a start of sandboxes the scheduler gave up on here (gaveUpOn). */
function gaveUpError(opId: string, sandboxIds: readonly string[]): ForkfleetError {
  return new ForkfleetError('failed_precondition', `the scheduler gave up on starting ${sandboxIds.join(', ')} here (op ${opId}): not started, or stopped`);
}

/** The journal "op" keeping the owner of a sandbox's VM (Agent.claim): one per sandbox, so prune drops it once not written for the retention. */
function ownerRecord(sandboxId: string): string {
  return `vm-owner_${Buffer.from(sandboxId, 'utf8').toString('base64url')}`;
}

/** The VMs with hooks a restore step recorded it was making (`<step>#making`); none when there is no record or it is torn. */
function makingRecord(bytes: Uint8Array | undefined): string[] {
  if (!bytes?.length) return [];
  try {
    const ids: unknown = JSON.parse(Buffer.from(bytes).toString('utf8'));
    return Array.isArray(ids) ? ids.filter((id): id is string => typeof id === 'string') : [];
  } catch {
    return [];
  }
}

/** A guarded stop's delivery record, or undefined when there is none or it is torn. */
function stopRecord(bytes: Uint8Array | undefined): StopNote | undefined {
  if (!bytes?.length) return undefined;
  try {
    const r = JSON.parse(Buffer.from(bytes).toString('utf8')) as { owner?: unknown; starts?: unknown };
    const starts = Array.isArray(r.starts) ? r.starts.filter((id): id is string => typeof id === 'string') : [];
    return { owner: typeof r.owner === 'string' ? r.owner : undefined, starts };
  } catch {
    return undefined;
  }
}

/** Starts a journal entry of a retryable failure, which answers only the send it came from (retryableEntry). */
const RETRYABLE_ENTRY = Buffer.from('ff-retryable-1\n', 'utf8');
/** Starts one that answers several sends: those that shared the run (Agent.sharedBy). */
const RETRYABLE_SENDS_ENTRY = Buffer.from('ff-retryable-2\n', 'utf8');

/** A retryable failure's journal entry: RETRYABLE_ENTRY, the send's leader term (8 bytes, big-endian), the result (whose attempt is the send's). */
function retryableEntry(w: HostWork, result: HostResult): Uint8Array {
  const term = Buffer.alloc(8);
  term.writeBigUInt64BE(w.leaderTerm);
  return Buffer.concat([RETRYABLE_ENTRY, term, toBinary(HostResultSchema, result)]);
}

/** The sends a retryable entry answers, and its result; undefined for any other entry. */
function retryableSends(buf: Buffer): { sends: Array<{ term: bigint; attempt: number }>; result: HostResult } | undefined {
  if (buf.subarray(0, RETRYABLE_ENTRY.length).equals(RETRYABLE_ENTRY)) {
    if (buf.length < RETRYABLE_ENTRY.length + 8) return undefined;
    const result = fromBinary(HostResultSchema, buf.subarray(RETRYABLE_ENTRY.length + 8));
    return { sends: [{ term: buf.readBigUInt64BE(RETRYABLE_ENTRY.length), attempt: result.attempt }], result };
  }
  if (buf.subarray(0, RETRYABLE_SENDS_ENTRY.length).equals(RETRYABLE_SENDS_ENTRY)) {
    // RETRYABLE_SENDS_ENTRY, the count (4 bytes), each send's term (8) and attempt (4), the result.
    let at = RETRYABLE_SENDS_ENTRY.length;
    if (buf.length < at + 4) return undefined;
    const n = buf.readUInt32BE(at);
    at += 4;
    if (buf.length < at + n * 12) return undefined;
    const sends: Array<{ term: bigint; attempt: number }> = [];
    for (let i = 0; i < n; i++, at += 12) sends.push({ term: buf.readBigUInt64BE(at), attempt: buf.readUInt32BE(at + 8) });
    return { sends, result: fromBinary(HostResultSchema, buf.subarray(at)) };
  }
  return undefined;
}

/** `bytes`, a retryable entry, answering send `w` too; undefined when it is no such entry or answers it already. */
function withSend(bytes: Uint8Array, w: HostWork): Uint8Array | undefined {
  const parsed = retryableSends(Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength));
  if (!parsed || parsed.result.opId !== w.opId || parsed.result.stepId !== w.stepId) return undefined;
  if (parsed.sends.some((x) => x.term === w.leaderTerm && x.attempt === w.attempt)) return undefined;
  const sends = [...parsed.sends, { term: w.leaderTerm, attempt: w.attempt }];
  const head = Buffer.alloc(4 + sends.length * 12);
  head.writeUInt32BE(sends.length, 0);
  sends.forEach((x, i) => {
    head.writeBigUInt64BE(x.term, 4 + i * 12);
    head.writeUInt32BE(x.attempt, 12 + i * 12);
  });
  return Buffer.concat([RETRYABLE_SENDS_ENTRY, head, toBinary(HostResultSchema, parsed.result)]);
}

/**
 * A journalled result of this step, or undefined: an empty or undecodable entry (a write an
 * OS crash cut short; the journal does not fsync) or one of another step counts as none, and
 * the step runs again; so does a retryable failure of another send (another attempt or
 * leader term: the scheduler's retry).
 */
function journalled(bytes: Uint8Array | undefined, w: HostWork): HostResult | undefined {
  if (!bytes || bytes.length === 0) return undefined;
  try {
    const buf = Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    const retryable = retryableSends(buf);
    if (retryable) {
      const { sends, result: r } = retryable;
      if (r.opId !== w.opId || r.stepId !== w.stepId || !sends.some((x) => x.term === w.leaderTerm && x.attempt === w.attempt)) return undefined;
      r.attempt = w.attempt;
      return r;
    }
    if (buf.subarray(0, RETRYABLE_ENTRY.length).equals(RETRYABLE_ENTRY) || buf.subarray(0, RETRYABLE_SENDS_ENTRY.length).equals(RETRYABLE_SENDS_ENTRY)) return undefined;
    const r = fromBinary(HostResultSchema, buf);
    return r.opId === w.opId && r.stepId === w.stepId ? r : undefined;
  } catch {
    return undefined;
  }
}
