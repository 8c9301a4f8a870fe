// QEMU implementation of the VmmDriver port (DESIGN.md decision 2, VMM-NOTES.md).
//
// Layout under `root` (one filesystem, so snapshot files can be renamed into place):
//   vms/<vmId>/        vm.json, qemu.<gen>.pid, qmp.<gen>.sock, qga.<gen>.sock,
//                      qemu.<gen>.log, disk.<gen>.qcow2 and, for a VM booted from an image,
//                      mem.<gen>.img (share=on). <gen> grows when a snapshot replaces the process.
//   snapshots/<id>/    manifest.json (written last, after an fsync of the rest: its presence
//                      means complete), mem.img, state.bin, disk.qcow2, all 0444 and never
//                      written again.
// Invariant: a VM record exists exactly while its workdir exists; the pid files in a workdir
// name every QEMU that may still run for it, so recover() can adopt or reap after a restart.
import { createHash, randomBytes } from 'node:crypto';
import { access, chmod, copyFile, link, lstat, mkdir, open, readdir, readFile, readlink, realpath, rename, rm, stat, symlink, unlink, writeFile } from 'node:fs/promises';
import { constants, createReadStream, createWriteStream, writeFileSync } from 'node:fs';
import net from 'node:net';
import { setPriority } from 'node:os';
import { setTimeout as sleep } from 'node:timers/promises';
import { basename, dirname, join, resolve as resolvePath } from 'node:path';
import type { Logger } from 'pino';
import {
  IncompatibleSnapshotError,
  InvalidArgumentError,
  InvalidVmStateError,
  KvmUnavailableError,
  SnapshotInUseError,
  SnapshotNotFoundError,
  VmAlreadyExistsError,
  VmBootTimeoutError,
  VmCrashedError,
  VmStillSnapshottingError,
  VmmError,
  VmNotFoundError,
  CloneHygieneError,
  GuestAgentCommandError,
  GuestAgentTimeoutError,
  QmpCommandError,
} from '../../errors.ts';
import { diffFingerprint } from '../../domain/compat.ts';
import { ForkfleetError, isForkfleetError } from '../../../proto/errors.ts';
import { canTransition, LIVE_VM_STATES } from '../../domain/lifecycle.ts';
import {
  systemClock,
  type Accel,
  type AccelSetting,
  type Clock,
  type CloneSpec,
  type CreateVmSpec,
  type ExecRequest,
  type ExecResult,
  type FileRange,
  type FileWriteOptions,
  type GuestImage,
  type IncomingSource,
  type IncomingVm,
  type LocalSnapshot,
  type MigrateOutReport,
  type MigrationStream,
  type MigrationTarget,
  type NetworkPolicySpec,
  type PauseOptions,
  type RecoveryReport,
  type SnapshotManifest,
  type VmEvent,
  type VmInfo,
  type VmmDriver,
  type VmState,
} from '../../domain/vmm.ts';
import { GuestAgentClient } from '../guest/client.ts';
import { QmpClient, type QmpEvent } from '../qmp/client.ts';
import { fingerprint, qemuArgs, SERIAL_CHARDEV, SERIAL_RING_BYTES, type QemuLaunch } from './cmdline.ts';
import { RamPool, ramDirFor, ramFileOf } from './ram-pool.ts';
import { inNewNetns } from '../netns/netns.ts';
import { FsyncOpenError, fsyncAll, writeFileDurable } from '../durable.ts';
import { EgressManager, type EgressOptions } from '../netns/egress.ts';
import { DEFAULT_STANDBY_POLICY, StandbyPool, Urgency, type Standby, type StandbyPolicy } from './standby.ts';
import { recordedDiskSha256 } from '../../../deploy/images/meta.ts';
import type { GuestCgroup } from './cgroup.ts';
import {
  adoptProcess,
  cmdlineOf,
  isAlive,
  isKilled,
  killAndWait,
  killHard,
  OverlayFactory,
  qemuImgCreateOverlay,
  qemuImgRebaseUnsafe,
  qemuVersion,
  spawnQemu,
  type QemuProcess,
} from './process.ts';

export interface QemuDriverOptions {
  /** Root of VM workdirs and snapshots. Keep it short: unix socket paths are limited to 107 bytes. */
  root: string;
  accel: AccelSetting;
  logger: Logger;
  clock?: Clock;
  qemuBinary?: string;
  /** Cold boot to "agent answers" deadline. Default 90 s (TCG on 2 cores is slow). */
  bootTimeoutMs?: number;
  /** Restore to "agent answers" deadline. Default 60 s. */
  restoreTimeoutMs?: number;
  /** accel=auto: how long a KVM guest gets to prove it boots. Default 15 s. */
  autoProbeDeadlineMs?: number;
  /**
   * accel=auto: the image the probe boots, or how to get it (built only when a probe runs: an
   * image build at every start, before the first heartbeat, could take minutes after its recipe
   * changed while an adopted KVM guest already proves KVM). Required when accel is auto and
   * /dev/kvm exists.
   */
  probeImage?: GuestImage | (() => Promise<GuestImage>);
  /** TCG translation cache per VM, MiB. Default 64. */
  tcgTbMib?: number;
  /**
   * Called during a receiver snapshot (a clone's, ADR 0003) once its RAM is copied, while the
   * source VM is still stopped: its memory now must equal the new image, which tests check
   * here (QMP pmemsave of the source against mem.img).
   */
  snapshotCopied?: (e: { vmId: string; snapshotId: string; qmp: QmpClient }) => Promise<void>;
  /**
   * Called during a template snapshot (the VM's own share=on file becomes the image) at its
   * recovery points: `armed` (replacement QEMU ready, source untouched), `saved` (device state
   * saved, source killed, the replacement still waiting for the state), `loaded` (source
   * killed, the replacement has the device state, vm.json still names the source) and
   * `switched` (vm.json names the replacement, no manifest yet). Tests kill the agent there
   * (closing `replacement`, the QMP connection `detach` does not know of yet, as a dying
   * process would: QEMU serves one QMP client at a time).
   */
  snapshotStage?: (e: { vmId: string; snapshotId: string; stage: 'armed' | 'saved' | 'loaded' | 'switched'; replacement: QmpClient }) => Promise<void>;
  /** Egress for VMs whose network policy allows it (adapters/netns/egress.ts). */
  egress?: EgressOptions;
  /** Paused, pre-loaded QEMUs that forks claim (standby.ts, ADR 0014). Default DEFAULT_STANDBY_POLICY. */
  standby?: Partial<StandbyPolicy>;
  /** Guest RAM of migrated VMs on a huge-page tmpfs, some filled ahead (ram-pool.ts, ADR 0016). Absent: anonymous RAM. */
  ram?: { mount: string; keep: number; maxMib: number; prefillMib?: readonly number[] };
  /**
   * The cgroup every QEMU this driver starts joins at once (cgroup.ts): the guests together weigh
   * like one process against the agent and the rest of the host. Absent: QEMU stays in the agent's.
   */
  guestCgroup?: GuestCgroup;
  /**
   * Migration streams between hosts (migrateOut, prepareIncoming) over mutual TLS: a directory
   * in QEMU's tls-creds-x509 layout (ca-cert.pem, server-cert.pem, server-key.pem,
   * client-cert.pem, client-key.pem; the agent writes it from FF_PEER_*, peer/tls.ts). The
   * source checks the destination's certificate against its address, the destination asks for
   * the source's. Both ends must have it, or neither. Absent: plain text.
   */
  migrationTlsDir?: string;
  /**
   * Every migration stream this host sends goes to a unix socket here (TLS relays,
   * peer/tls-relay.ts): migration sources (migrateOut) then run in an empty network namespace of
   * their own, like every other QEMU, instead of the agent's, and a TCP target is refused.
   * A source QEMU loads a snapshot's device state; it need not reach the peer network to stream it.
   */
  migrationViaUnix?: boolean;
}

/** The QOM id of the TLS credentials a migration stream uses (QemuDriverOptions.migrationTlsDir). */
const MIGRATION_TLS_ID = 'ff-peer-tls';

/** Makes the next migration of `qmp`'s QEMU (either end) speak TLS with the credentials in `dir`. */
async function useMigrationTls(qmp: QmpClient, dir: string, end: { endpoint: 'client'; hostname: string } | { endpoint: 'server' }): Promise<void> {
  await qmp.execute('object-add', { 'qom-type': 'tls-creds-x509', id: MIGRATION_TLS_ID, dir, endpoint: end.endpoint, 'verify-peer': true });
  await qmp.execute('migrate-set-parameters', { 'tls-creds': MIGRATION_TLS_ID, ...(end.endpoint === 'client' ? { 'tls-hostname': end.hostname } : {}) });
}

/** What vm.json holds: enough to rebuild the record after an agent restart. */
interface VmPersisted {
  info: VmInfo;
  image: GuestImage;
  kernelArgs: string;
  memPath: string;
  memShared: boolean;
  diskPath: string;
  gen: number;
  /** Snapshots this VM's memory or disk chain depends on (nearest first). */
  dependsOn: string[];
  /** Set when the VM may have egress; absent: none (its namespace has nothing but loopback). */
  network?: NetworkPolicySpec;
  /** The directory its QEMU was started in, when that is not the workdir (a claimed standby). */
  launchDir?: string;
  /** Guest RAM is anonymous memory, not a file (a VM restored by migration from another host, ADR 0015). */
  anonymousRam?: boolean;
  /** Guest RAM is this file of the RAM pool (a VM restored by migration, ADR 0016); removed with the VM. */
  ramFile?: string;
  /**
   * A template snapshot under way (snapshotSharedFile), recorded before its first step: the
   * replacement QEMU's generation and files, the state to return to and the manifest to
   * write. recover() undoes the snapshot if the old QEMU still runs, or finishes it if the
   * replacement does.
   */
  switching?: { gen: number; memPath: string; diskPath: string; state: 'running' | 'paused'; manifest: SnapshotManifest };
  /**
   * A receiver snapshot whose files are complete (the VM's disk layer is backed by it) but whose
   * seal failed (ENOSPC, EIO): sealed before the VM's next snapshot, a retry of this one
   * included, which would otherwise find its directory and no manifest for good; removed with
   * the VM if still unsealed.
   */
  unsealed?: SnapshotManifest;
}

interface VmRecord extends VmPersisted {
  proc: QemuProcess;
  qmp: QmpClient;
  agent: GuestAgentClient | undefined;
  /** Set while we stop or replace the process on purpose, so its exit is not a crash. */
  expectExit: boolean;
  log: Logger;
  lock: Promise<unknown>;
  /** Wall-clock time of the last `stop` of a pause. */
  pausedAt?: number;
  /** Adopted while paused or with a slow guest agent: the previous agent's execs are ended once the guest answers (reapOrphans). */
  orphanExecsPending?: boolean;
  /**
   * How far the guest clock is known to be behind the host's: it stands still while the VM is
   * paused (VMM-NOTES gotcha 2). 0 after a boot or a clone hygiene; unknown (undefined) after
   * an adopt.
   */
  clockBehindMs?: number;
}

/** linux/timex.h: step the clock by timex.time (relative). */
const ADJ_SETOFFSET = 0x0100;
/** ff-clone's exit codes (deploy/images/ff-clone.S). */
const FF_CLONE_STEPS: Record<number, string> = {
  10: 'read record', 11: 'clock_adjtime', 12: 'open /dev/urandom', 13: 'write entropy',
  14: 'RNDRESEEDCRNG', 15: 'sethostname', 16: 'open sandbox-id', 17: 'write sandbox-id',
};
const VM_ID = /^[A-Za-z0-9][A-Za-z0-9_.-]{0,47}$/;
/** A resume refreshes the guest clock once the pauses since its last refresh add up to this. */
const CLOCK_REFRESH_AFTER_MS = 200;
/** How long a QEMU whose QMP closed unasked may take to be seen exiting before it is recorded crashed anyway (watch). */
const CRASH_EXIT_WAIT_MS = 2000;
/** How long a migration on this host (a snapshot's copy, a local restore) may take. Streams between hosts: MIGRATION_STREAM_WAIT. */
const MIGRATION_TIMEOUT_MS = 120_000;
/** How long a stopping agent waits for its migrations out to end (closeStandbys). */
const MIGRATION_CLOSE_WAIT_MS = 10_000;
/** Migration sources kept ready on a host, all snapshots together (ADR 0015). */
const MIGRATION_SOURCES_MAX = 2;
/** Migration destinations kept ready on a host, all configurations together (ADR 0015). */
const INCOMING_STANDBYS_MAX = 2;

/**
 * What an incoming standby is started as (ADR 0015): a migrated VM's QEMU before its stream
 * is known, so before its snapshot is. Keyed (`manifest.snapshotId`) by everything its command
 * line depends on: the image this host holds, kernel arguments, RAM, vCPUs, accel and disk size.
 */
interface IncomingTemplate {
  manifest: SnapshotManifest;
  image: GuestImage;
}

function incomingTemplate(m: SnapshotManifest, image: GuestImage): IncomingTemplate {
  const launch = [image.name, image.recipeHash, image.kernel, image.initrd, image.disk, m.image.kernelArgs, m.config.memoryMib, m.config.vcpus, m.config.accel, m.diskVirtualSize];
  const key = `incoming-${createHash('sha256').update(JSON.stringify(launch)).digest('hex').slice(0, 16)}`;
  return { manifest: { ...m, snapshotId: key }, image };
}

/** Durations of a restore's phases for its log line: `mark(k)` records the ms since the previous mark (or the start) as `phases[k]`. */
function phaseTimer(): { phases: Record<string, number>; mark: (k: string) => void } {
  const phases: Record<string, number> = {};
  let last = performance.now();
  return {
    phases,
    mark: (k) => {
      const now = performance.now();
      phases[k] = Math.round((now - last) * 10) / 10;
      last = now;
    },
  };
}

/** VM ids of accelerator probes (resolveAccel): never adopted by recover(). */
const PROBE_VM_PREFIX = 'kvmprobe-';

/** How often recover() tries to adopt a live VM before it reaps it (a second apart, then two). */
const ADOPT_ATTEMPTS = 3;

/** VMs recover() adopts or reaps at once. */
const RECOVER_CONCURRENCY = 4;

/** How long a snapshot waits for the guest-agent calls queued before it (and a file write under way) to be answered (GuestAgentClient.hold). */
const HOLD_WAIT_MS = 10_000;
/** How long a guest call (exec, file) waits for a snapshot of its VM to end (running()). */
const SNAPSHOT_WAIT_MS = 60_000;

export class QemuVmmDriver implements VmmDriver {
  private readonly opts: Required<Omit<QemuDriverOptions, 'probeImage' | 'egress' | 'standby' | 'ram' | 'snapshotCopied' | 'snapshotStage' | 'guestCgroup' | 'migrationTlsDir' | 'migrationViaUnix'>> &
    Pick<QemuDriverOptions, 'probeImage' | 'egress' | 'ram' | 'snapshotCopied' | 'snapshotStage' | 'guestCgroup' | 'migrationTlsDir' | 'migrationViaUnix'>;
  private egressManager: EgressManager | undefined;
  private readonly vms = new Map<string, VmRecord>();
  /** Set by close(): no VM is made after it (makeWorkdir refuses). */
  private closing = false;
  /** Set by closeStandbys: no migration source starts any more. */
  private sourcesClosed = false;
  /** migrateOut calls running (closeStandbys waits for them). */
  private readonly migratingOut = new Set<Promise<unknown>>();
  /**
   * Creates, forks and incoming restores under way: close() waits for them before it destroys
   * the VMs, since a VM is registered only once its QEMU answers QMP. One spawned and not yet
   * registered when close() listed the VMs was missed, and its detached QEMU outlived the process.
   */
  private readonly making = new Set<Promise<unknown>>();
  private readonly listeners = new Set<(e: VmEvent) => void>();
  private accelPromise: Promise<Accel> | undefined;
  private readonly overlays = new OverlayFactory();
  private versionPromise: Promise<string> | undefined;
  private ramPoolOpened: Promise<RamPool | undefined> | undefined;
  /** StandbyPolicy.incomingQuietMs. */
  private readonly incomingQuietMs: number;
  private readonly standbys: StandbyPool;
  /** Migration sources kept ready (ADR 0015): standbys in the agent's network namespace. */
  private readonly sources: StandbyPool;
  /** Migration destinations kept ready (ADR 0015): QEMUs waiting for a stream, by launch configuration. */
  private readonly incoming: StandbyPool<IncomingTemplate>;

  constructor(opts: QemuDriverOptions) {
    this.opts = {
      clock: systemClock,
      qemuBinary: 'qemu-system-x86_64',
      bootTimeoutMs: 90_000,
      restoreTimeoutMs: 60_000,
      autoProbeDeadlineMs: 15_000,
      tcgTbMib: 64,
      ...opts,
    };
    const policy = { ...DEFAULT_STANDBY_POLICY, ...opts.standby };
    this.incomingQuietMs = policy.incomingQuietMs;
    this.standbys = new StandbyPool(policy, (s, urgency) => this.launchStandby(s, { urgency }), (s) => this.discardStandby(s), this.opts.logger, this.opts.clock);
    // One per snapshot that was migrated out before, so the next child that leaves skips the
    // QEMU start; within the same host-wide cap as fork standbys.
    this.sources = new StandbyPool(
      { ...policy, max: Math.min(policy.max, MIGRATION_SOURCES_MAX), perSnapshot: Math.min(policy.perSnapshot, 1) },
      (s, urgency) => this.launchStandby(s, { source: true, urgency }),
      (s) => this.discardStandby(s),
      this.opts.logger,
      this.opts.clock,
    );
    // One per configuration that was migrated in before, so the next VM that arrives skips the
    // QEMU start; at most INCOMING_STANDBYS_MAX per host (none when the standby max is 0).
    this.incoming = new StandbyPool<IncomingTemplate>(
      { ...policy, max: Math.min(policy.max, INCOMING_STANDBYS_MAX), perSnapshot: Math.min(policy.perSnapshot, 1) },
      (t) => this.launchIncomingStandby(t),
      (s) => this.discardStandby(s),
      this.opts.logger,
      this.opts.clock,
    );
  }

  /**
   * The RAM pool (ADR 0016), opened (and its tmpfs mounted if need be) on first use; undefined
   * when the driver has none or it could not open (then migrated VMs get anonymous RAM).
   */
  private ramPool(): Promise<RamPool | undefined> {
    const ram = this.opts.ram;
    this.ramPoolOpened ??= ram ? RamPool.open(this.opts.root, { ...ram, logger: this.opts.logger.child({ component: 'ram-pool' }) }) : Promise.resolve(undefined);
    return this.ramPoolOpened;
  }

  private get ramDir(): string | undefined {
    return this.opts.ram ? ramDirFor(this.opts.ram.mount, this.opts.root) : undefined;
  }

  private get vmsDir(): string {
    return join(this.opts.root, 'vms');
  }
  private get snapshotsDir(): string {
    return join(this.opts.root, 'snapshots');
  }
  /** Standby QEMUs' directories (standby.ts); a claimed one's name stays as a symlink to its VM's workdir. */
  private get standbyDir(): string {
    return join(this.opts.root, 'standby');
  }

  qemuVersion(): Promise<string> {
    this.versionPromise ??= qemuVersion(this.opts.qemuBinary);
    return this.versionPromise;
  }

  // ---------------------------------------------------------------- accel

  resolveAccel(): Promise<Accel> {
    this.accelPromise ??= this.decideAccel();
    return this.accelPromise;
  }

  private async decideAccel(): Promise<Accel> {
    const log = this.opts.logger;
    if (this.opts.accel === 'tcg') return 'tcg';
    let kvmOk = true;
    try {
      await access('/dev/kvm', constants.R_OK | constants.W_OK);
    } catch {
      kvmOk = false;
    }
    if (this.opts.accel === 'kvm') {
      if (!kvmOk) throw new KvmUnavailableError('/dev/kvm missing or not accessible');
      return 'kvm';
    }
    if (!kvmOk) {
      log.info({ accel: 'tcg', reason: 'no /dev/kvm' }, 'accel auto: chose tcg');
      return 'tcg';
    }
    // A KVM guest adopted from the previous run (recover) proves KVM works here. The answer is
    // kept until the agent restarts, and a probe that failed once (its deadline missed on a
    // host busy adopting, a full disk) made this host TCG: in heartbeats, for restores of KVM
    // snapshots and for new sandboxes, while its KVM guests ran on.
    const kvmGuest = [...this.vms.values()].find((r) => r.info.accel === 'kvm' && LIVE_VM_STATES.has(r.info.state));
    if (kvmGuest) {
      log.info({ accel: 'kvm', vmId: kvmGuest.info.vmId }, 'accel auto: chose kvm (an adopted guest runs under it)');
      return 'kvm';
    }
    const probe = this.opts.probeImage;
    if (!probe) throw new InvalidArgumentError('probeImage', 'required for accel=auto');
    const image = typeof probe === 'function' ? await probe() : probe;
    // Prove KVM can run a stock guest: boot one to "agent answers" within the deadline, a second
    // one if the first fails (one missed deadline is not enough to give KVM up until a restart).
    const attempts = 2;
    for (let attempt = 1; ; attempt++) {
      const vmId = `${PROBE_VM_PREFIX}${process.pid}-${randomBytes(3).toString('hex')}`;
      const t0 = Date.now();
      try {
        await this.boot({ vmId, image, memoryMib: 128, vcpus: 1 }, 'kvm', this.opts.autoProbeDeadlineMs);
        log.info({ accel: 'kvm', probeMs: Date.now() - t0, attempt }, 'accel auto: chose kvm (probe guest booted)');
        return 'kvm';
      } catch (e) {
        if (attempt < attempts) {
          log.warn({ probeMs: Date.now() - t0, attempt, err: String(e) }, 'accel auto: the kvm probe guest did not boot (err: a crash, or its deadline missed); probing again');
          continue;
        }
        log.warn({ accel: 'tcg', probeMs: Date.now() - t0, attempt, err: String(e) }, 'accel auto: the kvm probe guest did not boot (err: a crash, or its deadline missed); chose tcg');
        return 'tcg';
      } finally {
        await this.destroy(vmId);
      }
    }
  }

  // ---------------------------------------------------------------- create

  create(spec: CreateVmSpec): Promise<VmInfo> {
    return this.whileOpen(this.createVm(spec));
  }

  /** Tracks a create, fork or incoming restore for close(). */
  private whileOpen<T>(p: Promise<T>): Promise<T> {
    this.making.add(p);
    const done = (): void => void this.making.delete(p);
    p.then(done, done);
    return p;
  }

  private async createVm(spec: CreateVmSpec): Promise<VmInfo> {
    validateId('vmId', spec.vmId);
    // The API's range (services/adapters/grpc/convert.ts LIMITS): a sandbox it accepts is not refused here.
    if (spec.memoryMib < 64 || spec.memoryMib > 262_144) throw new InvalidArgumentError('memoryMib', 'must be 64..262144');
    if (spec.vcpus < 1 || spec.vcpus > 64) throw new InvalidArgumentError('vcpus', 'must be 1..64');
    if (spec.network) EgressManager.validate(spec.network);
    const accel = await this.resolveAccel();
    return this.boot(spec, accel, this.opts.bootTimeoutMs);
  }

  private async boot(spec: CreateVmSpec, accel: Accel, deadlineMs: number): Promise<VmInfo> {
    const t0 = this.opts.clock.now();
    const workdir = await this.makeWorkdir(spec.vmId);
    const hostname = spec.hostname ?? spec.vmId;
    const sandboxId = spec.sandboxId ?? spec.vmId;
    const kernelArgs = `${spec.image.kernelArgs} ff.hostname=${hostname} ff.sandbox=${sandboxId}`;
    const gen = 0;
    const diskPath = join(workdir, `disk.${gen}.qcow2`);
    const memPath = join(workdir, `mem.${gen}.img`);
    const log = this.opts.logger.child({ vmId: spec.vmId });
    try {
      await this.overlays.create(spec.image.disk, diskPath, spec.image.diskVirtualSize);
      const persisted: VmPersisted = {
        info: {
          vmId: spec.vmId, state: 'starting', accel, pid: 0, workdir, memoryMib: spec.memoryMib, vcpus: spec.vcpus,
          hostname, sandboxId, baseSnapshotId: null, readyMs: 0,
        },
        image: spec.image, kernelArgs, memPath, memShared: true, diskPath, gen, dependsOn: [],
        ...(spec.network?.allowEgress ? { network: spec.network } : {}),
      };
      const rec = await this.launch(persisted, log, { incoming: false });
      rec.agent = await this.connectAgent(rec, deadlineMs - (this.opts.clock.now() - t0));
      await this.healthCheck(rec, 10_000);
      rec.clockBehindMs = 0; // a booting guest reads its clock from the RTC, which is the host's
      rec.info.readyMs = this.opts.clock.now() - t0;
      this.setState(rec, 'running');
      await this.persist(rec);
      log.info({ accel, readyMs: rec.info.readyMs, pid: rec.proc.pid }, 'vm booted');
      return { ...rec.info };
    } catch (e) {
      await this.destroy(spec.vmId).catch(() => undefined);
      await rm(workdir, { recursive: true, force: true });
      if (e instanceof VmCrashedError || e instanceof VmmError) throw e;
      throw new VmBootTimeoutError(spec.vmId, deadlineMs, { cause: e });
    }
  }

  private async makeWorkdir(vmId: string): Promise<string> {
    const workdir = join(this.vmsDir, vmId);
    if (this.closing) throw new VmmError(`${vmId}: not made, the VMM driver is closing`);
    if (this.vms.has(vmId)) throw new VmAlreadyExistsError(vmId);
    await mkdir(this.vmsDir, { recursive: true });
    try {
      await mkdir(workdir);
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code === 'EEXIST') throw new VmAlreadyExistsError(vmId);
      throw e;
    }
    return workdir;
  }

  /** The launch description of a VM's current process (for tools below the port, e.g. the benchmark). */
  launchOf(vmId: string): QemuLaunch {
    const rec = this.mustGet(vmId);
    return this.launchSpec(rec, rec.gen, rec.memPath, rec.memShared, rec.diskPath, false);
  }

  private launchSpec(p: VmPersisted, gen: number, memPath: string, memShared: boolean, disk: string, incoming: boolean, dir = p.info.workdir): QemuLaunch {
    return {
      name: `ff-${p.info.vmId}`,
      accel: p.info.accel,
      memoryMib: p.info.memoryMib,
      vcpus: p.info.vcpus,
      kernel: p.image.kernel,
      initrd: p.image.initrd,
      kernelArgs: p.kernelArgs,
      memPath,
      memShared,
      ...(p.anonymousRam ? { anonymousRam: true } : {}),
      ...(p.ramFile ? { ramFile: p.ramFile } : {}),
      disk,
      qmpSocket: join(dir, `qmp.${gen}.sock`),
      agentSocket: join(dir, `qga.${gen}.sock`),
      pidFile: join(dir, `qemu.${gen}.pid`),
      incoming,
      tcgTbMib: this.opts.tcgTbMib,
      netns: 'new',
      egress: !!p.network?.allowEgress,
    };
  }

  /** Spawn QEMU for `p` (generation p.gen) and connect QMP; registers the record. */
  private async launch(p: VmPersisted, log: Logger, o: { incoming: boolean; fdPassing?: boolean }): Promise<VmRecord> {
    const l = this.launchSpec(p, p.gen, p.memPath, p.memShared, p.diskPath, o.incoming);
    const { proc, qmp } = await this.spawnAndConnect(l, join(p.info.workdir, `qemu.${p.gen}.log`), [], p.network, { fdPassing: o.fdPassing ?? false });
    return this.register(p, proc, qmp, log);
  }

  /** The record of VM `p` whose QEMU is `proc`: registered, and watched for crashes. */
  private register(p: VmPersisted, proc: QemuProcess, qmp: QmpClient, log: Logger): VmRecord {
    const rec: VmRecord = { ...p, proc, qmp, agent: undefined, expectExit: false, log, lock: Promise.resolve() };
    rec.info.pid = proc.pid;
    this.vms.set(p.info.vmId, rec);
    this.watch(rec);
    return rec;
  }

  private async spawnAndConnect(l: QemuLaunch, logPath: string, extraFds: number[] = [], network?: NetworkPolicySpec, o: { fdPassing?: boolean } = {}): Promise<{ proc: QemuProcess; qmp: QmpClient }> {
    // Every QEMU the driver starts (boot, restore, snapshot replacement, receiver) runs in a new,
    // empty network namespace of its own (adapters/netns): the guest NIC reaches nothing.
    const qemu = l.niceness ? { command: 'nice', args: ['-n', String(l.niceness), this.opts.qemuBinary, ...qemuArgs(l)] } : { command: this.opts.qemuBinary, args: qemuArgs(l) };
    // QEMU still runs as root, but without the capabilities a guest that broke into it could
    // use against the host (withoutHostCaps): `unshare` makes its namespace first, then setpriv
    // drops them for good (the same process: its pid stays QEMU's).
    const capped = withoutHostCaps(qemu.command, qemu.args);
    const cmd = l.netns === 'new' ? inNewNetns(capped.command, capped.args) : capped;
    const proc = spawnQemu(cmd.command, cmd.args, logPath, extraFds);
    // The pid file at once, not only when QEMU writes it (-pidfile, once it has started up): an
    // agent killed in between left a QEMU that no pid file named, which its next start could
    // not find to reap (recover reaps by pid file). Same content as QEMU's own; its -pidfile
    // takes an existing unlocked file.
    try {
      writeFileSync(l.pidFile, `${proc.pid}\n`);
    } catch (err) {
      this.opts.logger.warn({ err, pid: proc.pid, pidFile: l.pidFile }, 'could not write the pid file of a new QEMU: an agent killed before QEMU writes it leaves that QEMU unreaped');
    }
    // Into the guests' cgroup before it has done much: all its threads move with it, and the
    // ones it starts later are born there. A VM outside still works, only unisolated.
    await this.opts.guestCgroup?.add(proc.pid).catch((err: unknown) => this.opts.logger.warn({ err, pid: proc.pid, cgroup: this.opts.guestCgroup?.dir }, 'QEMU could not join the guests cgroup: it runs unisolated'));
    let dead = false;
    void proc.exited.then(() => (dead = true));
    // Egress: link the new namespace out before the guest can run (a boot starts at once, but
    // its NIC is up only seconds later; a restore runs only after `cont`).
    if (l.egress && network?.allowEgress && !l.startPaused) {
      try {
        this.egressManager ??= new EgressManager({ logger: this.opts.logger.child({ component: 'egress' }), ...this.opts.egress });
        await this.egressManager.attach(proc.pid, network);
      } catch (e) {
        const exited = dead;
        await killAndWait(proc);
        // QEMU died meanwhile (bad arguments, no memory): its log says why, and a retry fails alike.
        if (exited) {
          throw qemuDidNotStart(await readFile(logPath, 'utf8').catch(() => ''), e);
        }
        // The network's own refusals say what they are (egress refused on this host, the
        // address pool full); a command of the attach that failed or hung is this host's
        // trouble, worth another try. Reported as "QEMU did not start" with QEMU's log (empty:
        // it was just killed), neither said what to fix, and a passing failure was final.
        if (isForkfleetError(e)) throw e;
        throw new VmmError(`linking the sandbox's network out failed: ${e instanceof Error ? e.message : String(e)}`, { cause: e, retryable: true });
      }
    }
    try {
      // QEMU answers QMP once its RAM is set up: a preallocated file takes ~4 ms per MiB here.
      const qmp = await QmpClient.connectWithRetry(l.qmpSocket, 10_000 + (l.preallocRam ? l.memoryMib * 10 : 0), () => !dead, o);
      return { proc, qmp };
    } catch (e) {
      await killAndWait(proc);
      throw qemuDidNotStart(await readFile(logPath, 'utf8').catch(() => ''), e);
    }
  }

  /**
   * Crash detection: QMP closing when we did not ask QEMU to go is a crash. Recorded once the
   * process is seen gone too (QMP can close before its exit is): a destroy of a crashed VM
   * then signals nothing, so never a PID given to another process since. One that outlives
   * its QMP by CRASH_EXIT_WAIT_MS counts as crashed all the same (a destroy kills it).
   */
  private watch(rec: VmRecord): void {
    const { qmp, proc } = rec;
    qmp.onClosed(() => {
      if (rec.expectExit || rec.proc !== proc || this.vms.get(rec.info.vmId) !== rec) return;
      rec.agent?.close();
      let t: NodeJS.Timeout | undefined;
      void Promise.race([proc.exited, new Promise<void>((r) => (t = setTimeout(r, CRASH_EXIT_WAIT_MS)))]).then(() => {
        clearTimeout(t);
        if (rec.expectExit || rec.proc !== proc || this.vms.get(rec.info.vmId) !== rec) return;
        const detail = `QEMU pid ${proc.pid} exited unexpectedly`;
        rec.log.error({ pid: proc.pid }, 'vm crashed');
        if (canTransition(rec.info.state, 'crashed')) this.setState(rec, 'crashed');
        this.emit({ type: 'crashed', vmId: rec.info.vmId, pid: proc.pid, detail });
      });
    });
  }

  /**
   * A guest-agent channel whose exec wrappers carry an instance of its own (see
   * GuestAgentClient.reapOrphanExecs): a VM restored from a snapshot taken while execs ran
   * can tell the wrappers it inherited, which carry the source's channel's instance, from its
   * own, also on the host that ran the source.
   */
  private openAgent(path: string): Promise<GuestAgentClient> {
    return GuestAgentClient.connect(path, 5000, randomBytes(4).toString('hex'), {}, this.opts.logger);
  }

  private async connectAgent(rec: VmRecord, deadlineMs: number, attemptMs = 1000): Promise<GuestAgentClient> {
    const agent = await this.openAgent(join(rec.info.workdir, `qga.${rec.gen}.sock`));
    try {
      await this.syncAgent(rec, agent, deadlineMs, attemptMs);
    } catch (e) {
      agent.close();
      throw e;
    }
    return agent;
  }

  /** Waits until the VM's guest agent answers; a QEMU that exited meanwhile is a crash. */
  private async syncAgent(rec: VmRecord, agent: GuestAgentClient, deadlineMs: number, attemptMs = 1000): Promise<void> {
    try {
      await agent.sync(Math.max(1000, deadlineMs), attemptMs);
    } catch (e) {
      if (rec.qmp.closed) throw new VmCrashedError(rec.info.vmId, 'QEMU exited before its guest agent answered', { cause: e });
      throw e;
    }
  }

  private async healthCheck(rec: VmRecord, timeoutMs: number): Promise<void> {
    const r = await this.agentOf(rec).exec({ path: '/bin/true', timeoutMs, captureOutput: false });
    if (r.exitCode !== 0) throw new CloneHygieneError(rec.info.vmId, 'health (exec /bin/true)');
  }

  // ---------------------------------------------------------------- guest operations

  private agentOf(rec: VmRecord): GuestAgentClient {
    if (rec.info.state === 'crashed') throw new VmCrashedError(rec.info.vmId, 'QEMU is gone');
    if (!rec.agent) throw new InvalidVmStateError(rec.info.vmId, rec.info.state, 'talk to the guest agent');
    return rec.agent;
  }

  /**
   * The VM's record once it runs. A snapshot holds the VM for seconds (RAM copied, disk
   * switched) while its sandbox stays RUNNING: a guest call meanwhile waits for it (at most
   * SNAPSHOT_WAIT_MS, then unavailable, retryable) instead of failing for good.
   */
  private async running(vmId: string, op: string): Promise<VmRecord> {
    let rec = this.mustGet(vmId);
    if (rec.info.state === 'snapshotting') {
      await this.whileIn(rec, 'snapshotting', SNAPSHOT_WAIT_MS);
      rec = this.mustGet(vmId);
      if (rec.info.state === 'snapshotting') throw new VmStillSnapshottingError(vmId, SNAPSHOT_WAIT_MS, op);
    }
    if (rec.info.state === 'crashed') throw new VmCrashedError(vmId, 'QEMU is gone');
    if (rec.info.state !== 'running') throw new InvalidVmStateError(vmId, rec.info.state, op);
    return rec;
  }

  /** Resolves once `rec` leaves `state` (at once if it is not in it), or after `ms`. */
  private whileIn(rec: VmRecord, state: VmState, ms: number): Promise<void> {
    return new Promise((resolve) => {
      if (rec.info.state !== state) return resolve();
      const done = (): void => {
        clearTimeout(t);
        off();
        resolve();
      };
      const t = setTimeout(done, ms);
      const off = this.onEvent((e) => {
        if (e.type === 'state' && e.vmId === rec.info.vmId && e.from === state) done();
      });
    });
  }

  async exec(vmId: string, req: ExecRequest): Promise<ExecResult> {
    return this.agentOf(await this.running(vmId, 'exec')).exec(req);
  }

  async readFile(vmId: string, path: string, range: FileRange = {}): Promise<Buffer> {
    return this.agentOf(await this.running(vmId, 'read a file')).readFile(path, range);
  }

  async writeFile(vmId: string, path: string, data: Buffer, opts: FileWriteOptions = {}): Promise<void> {
    // The chmod is the client's: a template snapshot then has the new bytes with the new mode.
    await this.agentOf(await this.running(vmId, 'write a file')).writeFile(path, data, { append: opts.append ?? false, mode: opts.mode });
  }

  // ---------------------------------------------------------------- pause / resume

  /**
   * Idempotent, and judged by QEMU when the record may be wrong: a `stop` or `cont` that timed
   * out is still carried out by QEMU afterwards, so a VM recorded paused is asked whether it
   * runs (and stopped if so), and a failed `stop` is followed by a query-status that records
   * what QEMU says. A pause of a running VM whose `stop` succeeds sends nothing else.
   * `opts.refuse` is asked once the VM's lock is held, so after a snapshot queued ahead (which
   * holds it from before its state says snapshotting until after its end): an error it returns
   * fails the pause, with nothing recorded or sent. A QEMU that exited fails it as crashed.
   */
  pause(vmId: string, opts: PauseOptions = {}): Promise<void> {
    return this.locked(vmId, (rec) => this.crashedIfGone(rec, async () => {
      const refused = opts.refuse?.({ ...rec.info });
      if (refused) throw refused;
      if (rec.info.state === 'paused') {
        if ((await queryStatus(rec.qmp)) !== 'running') return;
        rec.log.warn('the VM ran though it is recorded paused (a resume that timed out?): stopped again');
      } else this.assertState(rec, 'running', 'pause');
      // vm.json says paused before QEMU stops, and the VM is paused in memory only once both
      // are done. Were it written after, a failed write (a full disk) would leave the VM paused
      // in memory but recorded running: the step's retry finds it paused and skips the pause,
      // and the next agent's recover() resumes the user's paused sandbox (adoptOn runs a VM
      // recorded running). Recorded paused while it still runs (a failed stop) is safe:
      // adoptOn keeps what QEMU says then.
      await this.persist(rec, 'paused');
      try {
        await rec.qmp.execute('stop');
      } catch (e) {
        // A `stop` that timed out may have been carried out all the same: recorded running
        // then, the VM would stay frozen, every resume (a hibernate's resume-after-failure)
        // skipped as a no-op. QEMU is asked; one that does not answer leaves the record as it
        // is (a later resume asks again).
        if ((await queryStatus(rec.qmp).catch(() => 'running')) === 'running') throw e;
        rec.log.warn({ err: String(e) }, 'stop failed, but QEMU stopped the VM all the same: recorded paused');
      }
      // Kept if set: a VM recorded paused that ran again (a late `cont`) has its clock behind
      // since then at least; counting more only refreshes it sooner.
      rec.pausedAt ??= Date.now();
      this.setState(rec, 'paused');
    }));
  }

  /**
   * Idempotent, and judged by QEMU when the record may be wrong, as pause() is. A VM found
   * running whose clock is unknown (adopted: the previous agent may have died between a resume's
   * `cont` and its refresh) gets the refresh a resume after a long pause gets.
   */
  resume(vmId: string): Promise<void> {
    return this.locked(vmId, (rec) => this.crashedIfGone(rec, async () => {
      if (rec.info.state === 'running') {
        // A `stop` that timed out (a failed pause) may have stopped the guest after all.
        if ((await queryStatus(rec.qmp)) === 'running') {
          if (rec.clockBehindMs === undefined) this.refreshAfterResume(rec);
          return;
        }
        rec.log.warn('the VM is stopped though it is recorded running (a pause that timed out?): continued');
      } else this.assertState(rec, 'paused', 'resume');
      try {
        await rec.qmp.execute('cont');
      } catch (e) {
        // A `cont` that timed out may have run the guest all the same: recorded paused, it
        // would run on while every pause is skipped as a no-op. QEMU is asked.
        if ((await queryStatus(rec.qmp).catch(() => 'paused')) !== 'running') throw e;
        rec.log.warn({ err: String(e) }, 'cont failed, but QEMU runs the VM all the same: recorded running');
      }
      const behind = (rec.clockBehindMs ?? Infinity) + (rec.pausedAt === undefined ? Infinity : Date.now() - rec.pausedAt);
      rec.pausedAt = undefined;
      rec.clockBehindMs = behind;
      this.setState(rec, 'running');
      await this.persist(rec);
      if (rec.orphanExecsPending) void this.reapOrphans(rec, 60_000);
      // The guest clock stood still while paused (VMM-NOTES gotcha 2). Once the pauses since
      // the last refresh add up to CLOCK_REFRESH_AFTER_MS, a resume sets the clock, reseeds the
      // RNG and re-asserts the identity (one ff-clone exec, the same as after a restore), in
      // the background so resume stays a single QMP round trip. Shorter pauses leave the clock
      // that little behind and spare the guest an exec that would queue ahead of the caller's.
      if (behind >= CLOCK_REFRESH_AFTER_MS) this.refreshAfterResume(rec);
    }));
  }

  /** The clock/RNG/identity refresh of a resume, in the background; a failure leaves the clock unknown or behind, as it was. */
  private refreshAfterResume(rec: VmRecord): void {
    void this.cloneHygiene(rec).catch((e: unknown) => rec.log.warn({ err: String(e) }, 'clock/RNG/identity refresh after resume failed'));
  }

  /**
   * `fn` (a pause or resume) failing as crashed once the VM's QMP closed unasked: QEMU exited,
   * as the crash watcher records once it sees the process gone (up to CRASH_EXIT_WAIT_MS later).
   * Its ChannelClosedError (unavailable, retryable) would have the step retried only to fail
   * then as crashed, which is final.
   */
  private async crashedIfGone<T>(rec: VmRecord, fn: () => Promise<T>): Promise<T> {
    const gone = (): boolean => rec.qmp.closed && !rec.expectExit && this.vms.get(rec.info.vmId) === rec;
    if (gone()) throw new VmCrashedError(rec.info.vmId, 'QEMU exited (its QMP connection closed)');
    try {
      return await fn();
    } catch (e) {
      if (gone() && !(e instanceof VmCrashedError)) throw new VmCrashedError(rec.info.vmId, 'QEMU exited (its QMP connection closed)', { cause: e });
      throw e;
    }
  }

  // ---------------------------------------------------------------- snapshot

  async snapshot(vmId: string, snapshotId: string): Promise<LocalSnapshot> {
    validateId('snapshotId', snapshotId);
    // Taken before (a redelivered step): returned as it is, also when its VM is gone since
    // (the step's ingest still has to run on it).
    const done = join(this.snapshotsDir, snapshotId);
    if (await isSealed(done)) return this.openSnapshot(done);
    return this.locked(vmId, async (rec) => {
      const before = rec.info.state;
      if (before !== 'running' && before !== 'paused') throw new InvalidVmStateError(vmId, before, 'snapshot');
      // Recorded paused, but a `cont` that timed out may have run after all: a snapshot that
      // trusted the record would copy a running guest's RAM after freezing its disk (a child
      // that panics, and no error). Stopped again first, as the record says it is.
      if (before === 'paused' && (await queryStatus(rec.qmp)) === 'running') {
        rec.log.warn({ snapshotId }, 'the VM ran though it is recorded paused (a resume that timed out?): stopped before its snapshot');
        await rec.qmp.execute('stop');
      }
      // A template snapshot that failed after the VM switched onto it and could not be sealed
      // then: its files are complete (the VM runs from them); sealed before anything else, so
      // that this one (maybe its retry) does not build on an unsealed parent.
      await this.sealSwitched(rec);
      await this.sealUnsealed(rec);
      const qemuVersion = await this.qemuVersion();
      const dir = join(this.snapshotsDir, snapshotId);
      await mkdir(this.snapshotsDir, { recursive: true });
      try {
        await mkdir(dir);
      } catch (e) {
        // Idempotent: the same snapshot taken before is returned as it is.
        if ((e as NodeJS.ErrnoException).code === 'EEXIST') return this.openSnapshot(dir);
        throw e;
      }
      // A new directory: a failed seal of one removed from here before is not this one's.
      sealFailed.delete(dir);
      // QEMU may have exited during the awaits above (the crash watcher recorded it): the VM's
      // state says so (VmCrashedError), and the directory, which nothing names yet, goes.
      if (rec.info.state !== before) {
        await rm(dir, { recursive: true, force: true });
        this.assertState(rec, before, 'snapshot');
      }
      this.setState(rec, 'snapshotting');
      // All the manifest says but the pause is known before the snapshot starts (a template
      // snapshot records it in vm.json, for recover()).
      const draft: SnapshotManifest = {
        schema: 1,
        snapshotId,
        parentSnapshotId: rec.dependsOn[0] ?? null,
        sourceVmId: vmId,
        createdAt: new Date(this.opts.clock.now()).toISOString(),
        config: fingerprint(rec.info.accel, rec.info.memoryMib, rec.info.vcpus, qemuVersion),
        image: { name: rec.image.name, recipeHash: rec.image.recipeHash, kernelArgs: rec.kernelArgs, ...(rec.image.diskSha256 ? { diskSha256: rec.image.diskSha256 } : {}) },
        files: { memory: 'mem.img', deviceState: 'state.bin', disk: 'disk.qcow2' },
        diskVirtualSize: rec.image.diskVirtualSize,
        method: rec.memShared ? 'shared-file' : 'receiver',
        sourcePauseMs: 0,
      };
      /** Set once a receiver snapshot's files are complete and only its seal is left. */
      let sealing: SnapshotManifest | undefined;
      try {
        const result = rec.memShared
          ? await this.snapshotSharedFile(rec, dir, draft, before === 'paused' ? 'paused' : 'running')
          : await this.snapshotViaReceiver(rec, dir, snapshotId, before === 'paused');
        const manifest: SnapshotManifest = { ...draft, parentSnapshotId: result.parent, sourcePauseMs: result.pauseMs, ...(result.execsRunning ? { guestExecsRunning: true as const } : {}) };
        if (!rec.dependsOn.includes(snapshotId)) rec.dependsOn = [snapshotId, ...rec.dependsOn];
        if (draft.method === 'receiver') sealing = manifest;
        const sealStart = performance.now();
        await sealSnapshot(dir, rec.image, manifest);
        // Sealed: complete and valid from here on, whatever happens to the VM. Not recorded as
        // unsealed should what follows fail (a destroy removes an unsealed one's directory).
        sealing = undefined;
        const sealMs = Math.round(performance.now() - sealStart);
        rec.switching = undefined;
        // A VM whose QEMU exited meanwhile (the crash watcher recorded it crashed) stays crashed;
        // its snapshot is returned all the same.
        if (rec.info.state === 'snapshotting') this.setState(rec, before);
        await this.persist(rec);
        rec.log.info({ snapshotId, method: manifest.method, pauseMs: result.pauseMs, sealMs }, 'snapshot taken');
        // A snapshot is usually restored or forked soon (a fork, a wake from hibernation). Its
        // clones get this VM's network policy (a fork's children inherit the source's egress, a
        // wake restores the sandbox's own): none of a VM with egress could claim a standby.
        if (canUseStandby(rec.network)) this.standbys.demand({ dir, manifest }, 1);
        // Outside the pause: make the clone-overlay template now, so no fork pays qemu-img.
        await this.overlays
          .create(join(dir, 'disk.qcow2'), join(rec.info.workdir, `overlay-warm.${snapshotId}.qcow2`), rec.image.diskVirtualSize)
          .then(() => unlink(join(rec.info.workdir, `overlay-warm.${snapshotId}.qcow2`)))
          .catch((e: unknown) => rec.log.warn({ err: String(e) }, 'overlay template warm-up failed'));
        return { dir, manifest };
      } catch (e) {
        rec.log.error({ snapshotId, err: String(e) }, 'snapshot failed');
        if (rec.info.state === 'snapshotting') {
          // What QEMU says, not what it was before: a failed snapshot whose `cont` failed too
          // leaves the guest stopped, and recording it running would make a resume a no-op.
          let to: VmState = rec.qmp.closed ? 'crashed' : before;
          if (to === 'running' && (await queryStatus(rec.qmp).catch(() => 'running')) !== 'running') to = 'paused';
          if (to === 'paused' && before === 'running') rec.log.error({ snapshotId }, 'the VM stayed stopped after its failed snapshot: recorded paused (a resume runs it again)');
          this.setState(rec, to);
        }
        // A template VM that switched onto the snapshot runs from its files, which are
        // complete: sealed (the step still fails; a retry gets the snapshot). If even that
        // fails, `switching` stays in vm.json for the next snapshot or recover(). Not when the
        // seal's fsync failed: that snapshot is never sealed (sealSnapshot refuses it, and so
        // does every later try: the next snapshot of this VM, recover()).
        await this.sealSwitched(rec).catch((c: unknown) => rec.log.error({ snapshotId, err: String(c) }, 'sealing the switched snapshot failed'));
        // A replacement whose guest agent was not connected yet, or a source whose channel was
        // closed for a guest agent that did not let go of it: its socket, for later calls.
        if (!rec.agent && !rec.qmp.closed) rec.agent = await this.openAgent(join(rec.info.workdir, `qga.${rec.gen}.sock`)).catch(() => undefined);
        // Complete but not sealed: kept as such (vm.json), so the next snapshot of this VM, a
        // retry of this one first, seals it, and a destroy removes it. One whose seal's fsync
        // failed is refused there (never sealed), so the VM's next snapshot fails, naming it.
        if (sealing && rec.dependsOn.includes(snapshotId)) rec.unsealed = sealing;
        // vm.json was rewritten for a template snapshot: it says what is true now.
        if (draft.method === 'shared-file' || rec.unsealed) await this.persist(rec).catch(() => undefined);
        // The VM may depend on the directory (its memory file, or its disk layer's backing):
        // then it stays, named in the VM's dependsOn. So does one sealed though the step failed
        // (a template snapshot whose replacement failed after its source was killed): complete,
        // and the only copy of that guest.
        if (!rec.dependsOn.includes(snapshotId) && !(await isSealed(dir))) await rm(dir, { recursive: true, force: true });
        throw e;
      }
    });
  }

  /** Seals the receiver snapshot whose seal failed, if one is left (VmPersisted.unsealed). */
  private async sealUnsealed(rec: VmRecord): Promise<void> {
    const m = rec.unsealed;
    if (!m) return;
    const dir = join(this.snapshotsDir, m.snapshotId);
    await ensureSealed(dir, rec.image, m);
    rec.unsealed = undefined;
    await this.persist(rec);
  }

  /** Seals the template snapshot the VM switched onto, if one is left unsealed (VmPersisted.switching). */
  private async sealSwitched(rec: VmRecord): Promise<void> {
    const sw = rec.switching;
    if (!sw || sw.gen !== rec.gen) return;
    const dir = join(this.snapshotsDir, sw.manifest.snapshotId);
    await ensureSealed(dir, rec.image, sw.manifest);
    rec.switching = undefined;
    await this.persist(rec);
  }

  /**
   * The VM booted with a share=on memory file, so that file already is the memory image.
   * A replacement QEMU (share=off clone of the snapshot, -incoming defer) is launched first;
   * the pause is then stop + device state save + kill source + state load + cont.
   */
  private async snapshotSharedFile(rec: VmRecord, dir: string, draft: SnapshotManifest, resumeTo: 'running' | 'paused'): Promise<{ pauseMs: number; parent: string | null; execsRunning: boolean }> {
    const snapshotId = draft.snapshotId;
    const keepPaused = resumeTo === 'paused';
    const memImg = join(dir, 'mem.img');
    const diskImg = join(dir, 'disk.qcow2');
    const stateBin = join(dir, 'state.bin');
    const newGen = rec.gen + 1;
    const newDisk = join(rec.info.workdir, `disk.${snapshotId}.qcow2`);
    // Recorded first: an agent killed anywhere below leaves recover() what to undo or finish.
    rec.switching = { gen: newGen, memPath: memImg, diskPath: newDisk, state: resumeTo, manifest: draft };
    let renamed = false;
    try {
      await this.persist(rec);
      // A rename leaves the running QEMU's memory mapping untouched. The disk is hard-linked,
      // not renamed: QEMU's file driver reopens images by name when migration inactivates them.
      await rename(rec.memPath, memImg);
      renamed = true;
      await link(rec.diskPath, diskImg);
    } catch (e) {
      if (renamed) await rename(memImg, rec.memPath).catch(() => undefined);
      rec.switching = undefined;
      throw e;
    }
    const undo = async (): Promise<void> => {
      await rename(memImg, rec.memPath).catch(() => undefined);
      await unlink(diskImg).catch(() => undefined);
      rec.switching = undefined;
    };
    let repl: { proc: QemuProcess; qmp: QmpClient } | undefined;
    let feedReplacement: ((file: string) => Promise<void>) | undefined;
    try {
      await qemuImgCreateOverlay(diskImg, newDisk, rec.image.diskVirtualSize);
      repl = await this.spawnAndConnect(
        this.launchSpec(rec, newGen, memImg, false, newDisk, true),
        join(rec.info.workdir, `qemu.${newGen}.log`),
        [],
        rec.network,
      );
      await setCaps(repl.qmp, { events: true, 'x-ignore-shared': true });
      await setCaps(rec.qmp, { events: true, 'x-ignore-shared': true });
      feedReplacement = await armIncoming(repl.qmp, join(rec.info.workdir, `mig-in.${newGen}.sock`));
      await this.opts.snapshotStage?.({ vmId: rec.info.vmId, snapshotId, stage: 'armed', replacement: repl.qmp });
    } catch (e) {
      if (repl) {
        await killAndWait(repl.proc);
      }
      await rm(newDisk, { force: true });
      await this.removeGenFiles(rec.info.workdir, newGen);
      await undo();
      throw e;
    }
    // A running exec's status polls (and any other guest call) wait while the QEMU under the
    // guest is replaced, then go on through the replacement: the guest, its qemu-ga and
    // qemu-ga's table of running execs carry on there. Released on every path below. The
    // channel is held once the calls queued on it are answered; a guest agent that keeps them
    // longer than HOLD_WAIT_MS does not hold the snapshot up: the channel is closed instead
    // (those calls fail, as before there was a hold) and a new one opened on the replacement.
    const { release, execsRunning } = await this.holdGuestAgent(rec, snapshotId, 'on the replacement');
    try {
      return { ...(await this.switchToReplacement(rec, repl, feedReplacement, { stateBin, memImg, newDisk, newGen, snapshotId, keepPaused, parent: draft.parentSnapshotId, undo, draft, execsRunning }, (qga) => release?.(qga))), execsRunning };
    } finally {
      release?.();
    }
  }

  /** snapshotSharedFile's pause window and switch; `moveAgent` moves the guest agent's channel to the replacement's socket. */
  private async switchToReplacement(
    rec: VmRecord,
    repl: { proc: QemuProcess; qmp: QmpClient },
    feedReplacement: (file: string) => Promise<void>,
    o: { stateBin: string; memImg: string; newDisk: string; newGen: number; snapshotId: string; keepPaused: boolean; parent: string | null; undo: () => Promise<void>; draft: SnapshotManifest; execsRunning: boolean },
    moveAgent: (qgaPath: string) => void,
  ): Promise<{ pauseMs: number; parent: string | null }> {
    const { stateBin, memImg, newDisk, newGen, snapshotId, keepPaused, undo } = o;
    // ---- pause window
    const src = rec.qmp;
    const mark = src.mark;
    const rmark = repl.qmp.mark;
    let sourceKilled = false;
    try {
      if (keepPaused) await activateIfMigratedOut(src);
      // `stop` and `migrate` are pipelined: QMP runs them in order, one round trip.
      await migrateToFile(src, stateBin, join(rec.info.workdir, `mig-out.${rec.gen}.sock`), !keepPaused);
      // The source must never write the image again (VMM-NOTES gotcha 3): it dies before the
      // replacement runs: SIGKILL before the state load. Its vCPUs and devices are stopped
      // already, so waiting for the exit (unmapping its RAM) is left out of the pause.
      rec.expectExit = true;
      sourceKilled = true;
      killHard(rec.proc.pid);
      await this.opts.snapshotStage?.({ vmId: rec.info.vmId, snapshotId, stage: 'saved', replacement: repl.qmp });
      await feedReplacement(stateBin);
      if (!keepPaused) await repl.qmp.execute('cont');
      await rec.proc.exited;
    } catch (e) {
      await killAndWait(repl.proc);
      await rm(newDisk, { force: true });
      await this.removeGenFiles(rec.info.workdir, newGen);
      if (!sourceKilled) {
        await src.execute('migrate_cancel').catch(() => undefined);
        await undo();
        if (!keepPaused) await contAfterMigration(src).catch(() => undefined);
      } else {
        // Both QEMUs are gone: the VM crashed. Recorded and reported so here, since the crash
        // watch ignores the source's exit (expectExit). Waited for first: a dying QEMU with a
        // large guest still holds its QMP socket open while it unmaps its RAM, and snapshot()
        // would otherwise ask it for a status and record the VM running.
        rec.switching = undefined;
        rec.agent?.close();
        await rec.proc.exited;
        if (canTransition(rec.info.state, 'crashed')) this.setState(rec, 'crashed');
        this.emit({ type: 'crashed', vmId: rec.info.vmId, pid: rec.proc.pid, detail: `QEMU pid ${rec.proc.pid} was stopped for template snapshot ${snapshotId}, whose replacement failed: ${String(e)}` });
        // The snapshot's files are the only copy of the guest left, and they are complete: the
        // source was killed only once its save completed (what settleSwitch relies on too), and
        // it is gone. Sealed, as recover() would seal them under a replacement that loaded, so
        // that a retry of the step gets the snapshot (snapshot()'s sealed fast path: a
        // hibernate can finish) and snapshot()'s catch keeps it. Owned then as every sealed
        // snapshot whose step failed: the shipper's GC lists it as held, and the scheduler deletes
        // it unless it keeps it. Not sealed (its fsync failed), it goes with snapshot()'s catch.
        const manifest: SnapshotManifest = { ...o.draft, ...(o.execsRunning ? { guestExecsRunning: true as const } : {}) };
        await sealSnapshot(dirname(memImg), rec.image, manifest).catch((c: unknown) => rec.log.error({ snapshotId, err: String(c) }, 'sealing the template snapshot whose replacement failed failed: it is lost with the VM'));
      }
      throw e;
    }
    // ---- end of pause window
    await this.opts.snapshotStage?.({ vmId: rec.info.vmId, snapshotId, stage: 'loaded', replacement: repl.qmp });
    const stopEv = src.eventsSince(mark).find((e) => e.event === 'STOP');
    // From here the replacement runs the guest: nothing may fail before the record names it
    // (a throw left the record on the dead source, the VM recorded crashed, the snapshot's
    // directory removed under the running replacement). The RESUME only measures the pause.
    const resumeEv = keepPaused ? undefined : await repl.qmp.waitEvent('RESUME', 5000, () => true, rmark).catch(() => undefined);
    const pauseMs = stopEv && resumeEv ? resumeEv.timestampMs - stopEv.timestampMs : 0;
    if (stopEv) {
      const rel = (evs: QmpEvent[]): string[] => evs.map((e) => `${e.event}${e.data.status ? `:${String(e.data.status)}` : ''}+${(e.timestampMs - stopEv.timestampMs).toFixed(1)}`);
      rec.log.debug({ source: rel(src.eventsSince(mark)), replacement: rel(repl.qmp.eventsSince(rmark)) }, 'snapshot pause breakdown');
    }

    const oldGen = rec.gen;
    const oldDisk = rec.diskPath;
    src.close();
    moveAgent(join(rec.info.workdir, `qga.${newGen}.sock`));
    rec.proc = repl.proc;
    rec.qmp = repl.qmp;
    rec.info.pid = repl.proc.pid;
    rec.gen = newGen;
    rec.diskPath = newDisk;
    rec.expectExit = false;
    // The VM now maps the snapshot (share=off), which it depends on from here.
    rec.memShared = false;
    rec.memPath = memImg;
    rec.info.baseSnapshotId = snapshotId;
    rec.dependsOn = [snapshotId, ...rec.dependsOn];
    this.watch(rec);
    // vm.json names the replacement before anything else happens (still `switching`: the
    // manifest is not written yet).
    await this.persist(rec);
    // The source's disk, hard-linked as the snapshot's: the VM's name for it goes (recover()
    // and destroy remove it too, should this fail).
    await unlink(oldDisk).catch((e: unknown) => rec.log.warn({ err: String(e) }, 'removing the template\'s old disk name failed'));
    await this.opts.snapshotStage?.({ vmId: rec.info.vmId, snapshotId, stage: 'switched', replacement: repl.qmp });
    await this.removeGenFiles(rec.info.workdir, oldGen);
    if (!rec.agent) {
      rec.agent = keepPaused ? await this.openAgent(join(rec.info.workdir, `qga.${newGen}.sock`)) : await this.connectAgent(rec, this.opts.restoreTimeoutMs);
    } else if (!keepPaused) {
      // (A paused guest answers once resumed: its agent's next call connects and syncs.)
      await this.syncAgent(rec, rec.agent, this.opts.restoreTimeoutMs);
    }
    return { pauseMs, parent: o.parent };
  }

  /**
   * Holds the VM's guest-agent channel for a snapshot's copy (GuestAgentClient.hold), waiting
   * at most HOLD_WAIT_MS: past it the channel is closed instead (the calls it kept fail) and
   * rec.agent cleared, to be opened again `reopened` (said in the log). `execsRunning`: execs
   * were under way as the copy began (also those of a channel closed here), so their programs
   * are in the snapshot (SnapshotManifest.guestExecsRunning).
   */
  private async holdGuestAgent(rec: VmRecord, snapshotId: string, reopened: string): Promise<{ release: ((movedTo?: string) => void) | undefined; execsRunning: boolean }> {
    const holding = rec.agent?.hold();
    const release = holding ? await Promise.race([holding, new Promise<undefined>((r) => setTimeout(() => r(undefined), HOLD_WAIT_MS).unref())]) : undefined;
    const execsRunning = (rec.agent?.execsRunning ?? 0) > 0 || (holding !== undefined && !release);
    if (holding && !release) {
      rec.log.warn({ snapshotId }, `the guest agent kept its calls past the snapshot's wait: its channel is closed, and opened again ${reopened}`);
      void holding.then((r) => r());
      rec.agent?.close();
      rec.agent = undefined;
    }
    return { release, execsRunning };
  }

  /**
   * The VM is itself a clone (share=off): its private pages exist only in its process. Migrate
   * its whole RAM into a receiver QEMU whose memory is a new share=on file (the image), the
   * disk layer frozen at the instant the VM stops; the source then continues. Under KVM the
   * copy is a live precopy with pause-before-switchover; under TCG the VM is stopped for the
   * whole copy (TCG's dirty tracking misses writes). The receiver saves the device state with
   * x-ignore-shared and exits.
   * See docs/adr/0003-snapshot-of-a-clone.md.
   */
  private async snapshotViaReceiver(rec: VmRecord, dir: string, snapshotId: string, keepPaused: boolean): Promise<{ pauseMs: number; parent: string | null; execsRunning: boolean }> {
    const memImg = join(dir, 'mem.img');
    const diskImg = join(dir, 'disk.qcow2');
    const stateBin = join(dir, 'state.bin');
    const recvDir = join(dir, '.recv');
    await mkdir(recvDir);
    const recvDisk = join(recvDir, 'disk.qcow2');
    const migSock = join(recvDir, 'mig.sock');
    const newDisk = join(rec.info.workdir, `disk.${snapshotId}.qcow2`);
    const overlayNode = `ovl-${snapshotId}`;
    let recv: { proc: QemuProcess; qmp: QmpClient } | undefined;
    let linked = false;
    // Live precopy (the VM runs while its RAM is copied and stops only for the pages it
    // dirtied meanwhile) is only as good as the accelerator's dirty tracking. KVM's sees every
    // guest write; TCG's loses some writes to pages the guest keeps writing (a busy guest's
    // image had 7-43 stale 4 KiB pages in most snapshots, and its children panicked), so under
    // TCG the VM is stopped for the whole copy. The receiver then allocates its whole memory
    // file when it starts, before the VM stops: writing into new page cache is what made the
    // stopped copy slow (~1 s for 256 MiB here, ~70 ms with the file allocated).
    const live = !keepPaused && rec.info.accel === 'kvm';
    let release: (() => void) | undefined;
    try {
      if (keepPaused) await activateIfMigratedOut(rec.qmp);
      await this.mergeBackStrayLayer(rec, snapshotId);
      // qemu-img would overwrite it, and it may be the VM's live layer (see the catch below).
      // One the VM does not write is what an attempt killed before its blockdev-snapshot left
      // (an adopted VM was put back on its real top layer): it goes, with its block node.
      if (await stat(newDisk).then(() => true, () => false)) {
        if ((await topDiskFile(rec.qmp)) === newDisk) throw new VmmError(`disk layer ${newDisk} exists already and the VM writes it: an earlier attempt at snapshot ${snapshotId} was interrupted`);
        await rec.qmp.execute('blockdev-del', { 'node-name': overlayNode }).catch(() => undefined);
        await rm(newDisk, { force: true });
        rec.log.warn({ snapshotId, disk: newDisk }, 'removed the disk layer an interrupted attempt at this snapshot left');
      }
      await qemuImgCreateOverlay(rec.image.disk, recvDisk, rec.image.diskVirtualSize);
      await qemuImgCreateOverlay(diskImg, newDisk, rec.image.diskVirtualSize);
      // The receiver's RAM is the new image file, even when the VM's own RAM is anonymous.
      const l = { ...this.launchSpec(rec, 0, memImg, true, recvDisk, true, recvDir), anonymousRam: false, ramFile: undefined, startPaused: true, egress: false, name: `ff-recv-${snapshotId}`, preallocRam: !live };
      recv = await this.spawnAndConnect(l, join(recvDir, 'qemu.log'));
      await setCaps(recv.qmp, { events: true, 'x-ignore-shared': false });
      await recv.qmp.execute('migrate-incoming', { uri: `unix:${migSock}` });
      await setCaps(rec.qmp, { events: true, 'x-ignore-shared': false, 'pause-before-switchover': live });
      await rec.qmp.execute('migrate-set-parameters', { 'max-bandwidth': 64 * 1024 ** 3, 'downtime-limit': 30 });
      // Hard link, not rename: QEMU reopens the (now backing) image by its old name.
      await link(rec.diskPath, diskImg);
      linked = true;
      await rec.qmp.execute('blockdev-add', {
        'node-name': overlayNode,
        driver: 'qcow2',
        file: { driver: 'file', filename: newDisk },
        backing: null,
      });

      // Guest-agent calls wait out the copy (a stopped guest answers none, and their timeouts
      // would run), and a file write begun before it ends first: the guest is never copied
      // with a file its open emptied and its bytes yet to come (GuestAgentClient.hold). A
      // guest agent that keeps its calls past HOLD_WAIT_MS does not hold the snapshot up: its
      // channel is closed (those calls fail) and opened again once the VM runs on. A paused
      // VM's guest changes nothing during the copy, and calls to it wait for their timeouts
      // (a hibernate pauses first): not held, the copy does not wait for them.
      const held = keepPaused ? { release: undefined, execsRunning: (rec.agent?.execsRunning ?? 0) > 0 } : await this.holdGuestAgent(rec, snapshotId, 'afterwards');
      release = held.release;
      const { execsRunning } = held;
      const src = rec.qmp;
      const mark = src.mark;
      if (!live) {
        // Stopped for the whole copy (already, or from here): no write can be missed, and the
        // disk is frozen at the same instant.
        if (!keepPaused) await src.execute('stop');
        // ---- pause window (unless the VM was paused already)
        await src.execute('blockdev-snapshot', { node: 'disk0', overlay: overlayNode });
        await migrateAndWait(src, `unix:${migSock}`);
      } else {
        await src.execute('migrate', { uri: `unix:${migSock}` });
        await waitMigration(src, 'pre-switchover', mark);
        // ---- pause window (vCPUs stopped by the migration thread)
        await src.execute('blockdev-snapshot', { node: 'disk0', overlay: overlayNode });
        await src.execute('migrate-continue', { state: 'pre-switchover' });
        await waitMigration(src, 'completed', mark);
      }
      // RAM copied, the VM still stopped.
      await this.opts.snapshotCopied?.({ vmId: rec.info.vmId, snapshotId, qmp: src });
      if (!keepPaused) await contAfterMigration(src);
      // ---- end of pause window
      release?.();
      release = undefined;
      if (!rec.agent && !rec.qmp.closed) rec.agent = await this.openAgent(join(rec.info.workdir, `qga.${rec.gen}.sock`)).catch(() => undefined);
      const stopEv = src.eventsSince(mark).find((e) => e.event === 'STOP');
      const resumeEv = keepPaused ? undefined : await src.waitEvent('RESUME', 5000, () => true, mark);
      const pauseMs = stopEv && resumeEv ? resumeEv.timestampMs - stopEv.timestampMs : 0;
      if (live) await setCaps(src, { 'pause-before-switchover': false });

      await waitMigration(recv.qmp, 'completed', 0);
      await setCaps(recv.qmp, { 'x-ignore-shared': true });
      await migrateToFile(recv.qmp, stateBin, join(recvDir, 'mig-out.sock'));
      recv.qmp.close();
      await killAndWait(recv.proc);
      await rm(recvDir, { recursive: true, force: true });

      // The VM keeps its QEMU; only its disk moved to the new overlay.
      rec.diskPath = newDisk;
      if (!keepPaused) await rec.agent?.sync(10_000).catch(() => undefined);
      return { pauseMs, parent: rec.dependsOn[0] ?? null, execsRunning };
    } catch (e) {
      release?.();
      if (recv) {
        await killAndWait(recv.proc);
      }
      await rec.qmp.execute('migrate_cancel').catch(() => undefined);
      // A failure after blockdev-snapshot leaves the VM writing newDisk, whose header names its
      // backing (diskImg) in the snapshot directory that goes now: merged back into the layer
      // below first. Until then diskImg stays. A top layer QMP cannot tell counts as newDisk
      // once diskImg is linked (newDisk over diskImg, a link to the old layer, holds the same
      // bytes whichever of the two the VM writes).
      const top = rec.qmp.closed ? undefined : await topDiskFile(rec.qmp).catch(() => null);
      let onNewDisk = top === newDisk || (top === null && linked);
      if (linked && !rec.qmp.closed && !onNewDisk) await unlink(diskImg).catch(() => undefined);
      await rec.qmp.execute('blockdev-del', { 'node-name': overlayNode }).catch(() => undefined);
      if (onNewDisk) {
        try {
          // The completed copy left the images inactive: writable again before the merge.
          if ((await queryStatus(rec.qmp)) !== 'running') await reactivate(rec.qmp, keepPaused);
          await commitActiveLayer(rec.qmp, rec.diskPath, `ff-rollback-${snapshotId}`);
          onNewDisk = false;
        } catch (c) {
          rec.log.error({ err: String(c) }, 'merging the overlay of a failed snapshot back failed: the VM keeps writing it');
        }
      }
      // Still on newDisk (its merge failed): the VM's next snapshot merges it back first
      // (mergeBackStrayLayer). QEMU keeps its backing open after the directory goes.
      if (!onNewDisk) await rm(newDisk, { force: true });
      if (!rec.qmp.closed && (await queryStatus(rec.qmp).catch(() => '')) !== 'running' && !keepPaused) {
        await contAfterMigration(rec.qmp).catch(() => undefined);
      }
      await rm(recvDir, { recursive: true, force: true });
      throw e;
    }
  }

  /**
   * A clone snapshot that failed after its disk switch and could not merge the new layer back
   * leaves the VM writing that layer while rec.diskPath names the one below, which stopped
   * changing then: a snapshot that froze rec.diskPath would miss every write since. Merged
   * back first (the blocker may be gone); if it still fails, the snapshot fails, naming it,
   * rather than seal a stale disk.
   */
  private async mergeBackStrayLayer(rec: VmRecord, snapshotId: string): Promise<void> {
    const top = await topDiskFile(rec.qmp);
    if (!top || (await realpath(top).catch(() => top)) === (await realpath(rec.diskPath).catch(() => rec.diskPath))) return;
    try {
      await commitActiveLayer(rec.qmp, rec.diskPath, `ff-rollback-${snapshotId}`);
    } catch (e) {
      throw new VmmError(`the VM writes ${top}, the disk layer of a snapshot that failed, not its recorded layer ${rec.diskPath}; merging it back failed: ${String(e)}`);
    }
    await unlink(top).catch(() => undefined);
    rec.log.warn({ recorded: rec.diskPath, overlay: top }, 'VM wrote the disk layer of a failed snapshot: merged it back into its layer');
  }

  private async removeGenFiles(workdir: string, gen: number): Promise<void> {
    for (const f of [`qmp.${gen}.sock`, `qga.${gen}.sock`, `mig-in.${gen}.sock`, `qemu.${gen}.pid`, `qemu.${gen}.log`, `mem.${gen}.img`]) {
      await unlink(join(workdir, f)).catch(() => undefined);
    }
  }

  async openSnapshot(dir: string): Promise<LocalSnapshot> {
    let manifest: SnapshotManifest;
    try {
      manifest = JSON.parse(await readFile(join(dir, 'manifest.json'), 'utf8')) as SnapshotManifest;
    } catch (e) {
      throw new SnapshotNotFoundError(dir);
      void e;
    }
    return { dir, manifest };
  }

  // ---------------------------------------------------------------- restore / fork

  restore(snapshot: LocalSnapshot, child: CloneSpec): Promise<VmInfo> {
    return this.fork(snapshot, [child]).then((r) => r[0] as VmInfo);
  }

  fork(snapshot: LocalSnapshot, children: CloneSpec[]): Promise<VmInfo[]> {
    return this.whileOpen(this.forkNow(snapshot, children));
  }

  private async forkNow(snapshot: LocalSnapshot, children: CloneSpec[]): Promise<VmInfo[]> {
    if (children.length === 0) throw new InvalidArgumentError('children', 'at least one child');
    for (const [i, c] of children.entries()) {
      validateId(`children[${i}].vmId`, c.vmId);
      if (c.network) EgressManager.validate(c.network);
    }
    if (new Set(children.map((c) => c.vmId)).size !== children.length) throw new InvalidArgumentError('children', 'duplicate vmId');
    await this.assertCompatible(snapshot);
    if (snapshot.manifest.image.diskSha256) await assertSameBaseDisk(snapshot.manifest, await this.imageOf(snapshot), snapshot.dir);
    const results = await Promise.allSettled(children.map((c) => this.restoreOne(snapshot, c)));
    const failed = results.find((r): r is PromiseRejectedResult => r.status === 'rejected');
    if (failed) {
      // fork(N) is all or nothing: the children it restored go. Only those: a child that failed
      // undid its own part (restoreOne), and one that failed because its id was taken (a VM
      // running, or another restore's workdir) made nothing, and destroy() would have killed
      // and removed that other VM.
      await Promise.all(children.filter((_, i) => results[i]!.status === 'fulfilled').map((c) => this.destroy(c.vmId).catch(() => undefined)));
      throw failed.reason;
    }
    // Only for the children that could have claimed one: a standby no fork can claim would hold
    // a slot of the host-wide max, kept from idling out by every fork of the snapshot.
    const claimants = children.filter((c) => canUseStandby(c.network)).length;
    if (claimants > 0) this.standbys.demand(snapshot, claimants);
    return results.map((r) => (r as PromiseFulfilledResult<VmInfo>).value);
  }

  /** Refuse a snapshot this host cannot restore, naming every difference. */
  async assertCompatible(snapshot: LocalSnapshot): Promise<void> {
    const m = snapshot.manifest;
    const host = fingerprint(await this.resolveAccel(), m.config.memoryMib, m.config.vcpus, await this.qemuVersion());
    const diff = diffFingerprint(m.config, host);
    if (diff.length > 0) throw new IncompatibleSnapshotError(m.snapshotId, diff);
  }

  /** What a clone of `snapshot` persists (generation 0 in `workdir`). */
  private async clonePersisted(snapshot: LocalSnapshot, c: CloneSpec, workdir: string): Promise<VmPersisted> {
    const m = snapshot.manifest;
    return {
      info: {
        vmId: c.vmId, state: 'starting', accel: m.config.accel, pid: 0, workdir, memoryMib: m.config.memoryMib,
        vcpus: m.config.vcpus, hostname: c.hostname ?? c.vmId, sandboxId: c.sandboxId ?? c.vmId,
        baseSnapshotId: m.snapshotId, readyMs: 0,
      },
      image: await this.imageOf(snapshot),
      kernelArgs: m.image.kernelArgs,
      memPath: join(snapshot.dir, m.files.memory),
      memShared: false,
      diskPath: join(workdir, 'disk.0.qcow2'),
      gen: 0,
      dependsOn: await this.snapshotChain(snapshot),
      ...(c.network?.allowEgress ? { network: c.network } : {}),
    };
  }

  /**
   * Spawn QEMU for clone `p` of `snapshot` and load the snapshot's device state into it; the
   * guest stays paused. The device state goes in as an inherited fd (`migrate-incoming fd:3`):
   * QEMU reads the file itself, with no `exec:` fork and no stream through this event loop (ADR 0009).
   */
  private async spawnIncoming(snapshot: LocalSnapshot, p: VmPersisted, mark: (k: string) => void, niceness = 0, o: { source?: boolean; urgency?: Urgency } = {}): Promise<{ proc: QemuProcess; qmp: QmpClient }> {
    const m = snapshot.manifest;
    await this.overlays.create(join(snapshot.dir, m.files.disk), p.diskPath, m.diskVirtualSize);
    mark('overlay');
    const state = await open(join(snapshot.dir, m.files.deviceState), 'r');
    let started: { proc: QemuProcess; qmp: QmpClient };
    try {
      const spec = this.launchSpec(p, p.gen, p.memPath, p.memShared, p.diskPath, true);
      // A migration source (migrateOut) never runs the guest. It streams from the agent's network
      // namespace, or from its own when every stream goes to a unix socket (migrationViaUnix).
      const l = { ...spec, niceness, ...(o.source ? { startPaused: true, ...(this.opts.migrationViaUnix ? {} : { netns: undefined }) } : {}) };
      started = await this.spawnAndConnect(l, join(p.info.workdir, `qemu.${p.gen}.log`), [state.fd], p.network);
    } finally {
      await state.close();
    }
    // A standby started in the background that a claim then waits for (standby.ts) loads at nice 0.
    if (niceness > 0) o.urgency?.onUrgent(() => void reniceProcess(started.proc.pid, 0));
    mark('launch');
    try {
      // Pipelined: QMP runs them in order, so the capability is set before the load starts.
      const caps = setCaps(started.qmp, { events: true, 'x-ignore-shared': true });
      await Promise.all([caps, incomingAndWait(started.qmp, 'fd:3')]);
    } catch (e) {
      started.qmp.close();
      await killAndWait(started.proc);
      throw e;
    }
    mark('incoming');
    return started;
  }

  /** A standby (standby.ts): a clone's QEMU with the snapshot's device state loaded, paused, owned by no VM yet. */
  private async launchStandby(snapshot: LocalSnapshot, o: { source?: boolean; urgency?: Urgency } = {}): Promise<Standby> {
    const id = `${o.source ? 'source' : 'standby'}-${randomBytes(6).toString('hex')}`;
    const workdir = join(this.standbyDir, id);
    await mkdir(workdir, { recursive: true });
    try {
      const p = await this.clonePersisted(snapshot, { vmId: id }, workdir);
      // Nice 19: starting standbys is background work that must not slow the VMs and forks
      // running now; the claim renices the process to 0, and so does a claim that waits for it
      // while it starts (urgency), or it started at 0 when one waited already.
      const { proc, qmp } = await this.spawnIncoming(snapshot, p, () => undefined, o.urgency?.urgent ? 0 : 19, o);
      return { id, snapshotId: snapshot.manifest.snapshotId, workdir, proc, qmp, readyAt: this.opts.clock.now() };
    } catch (e) {
      await rm(workdir, { recursive: true, force: true });
      throw e;
    }
  }

  private async discardStandby(s: Standby): Promise<void> {
    s.qmp.close();
    await killAndWait(s.proc);
    await rm(s.workdir, { recursive: true, force: true });
    // An incoming standby's RAM file (named after it) goes back to the pool.
    await this.releaseRam(s.id);
  }

  /**
   * The RAM file of `id` (a VM or an incoming standby; its QEMU is gone) back to the pool when
   * one is open, else away; nothing without RAM files. `recorded` is the file its vm.json
   * names: one that is not where the pool is now (the agent restarted with the pool off, or
   * on another mount) is removed where it is, or it would pin host RAM for good.
   */
  private async releaseRam(id: string, recorded?: string): Promise<void> {
    const here = this.ramDir ? ramFileOf(this.ramDir, id) : undefined;
    if (recorded && recorded !== here && basename(recorded) === basename(ramFileOf('/', id))) await rm(recorded, { force: true });
    if (!this.ramDir) return;
    const pool = await this.ramPoolOpened;
    if (pool) await pool.recycle(id);
    else await rm(ramFileOf(this.ramDir, id), { force: true });
  }

  /**
   * An incoming standby (ADR 0015): the QEMU a VM migrated from another host with this
   * template's configuration will run in, started before any stream comes: RAM from the pool,
   * a placeholder disk (an empty overlay of the image's base disk, which QEMU opens inactive
   * and re-reads when the stream ends), waiting with `-incoming defer`. Its QMP connection can
   * pass file descriptors, so the migration connection accepted later goes to it by getfd.
   */
  private async launchIncomingStandby(t: IncomingTemplate): Promise<Standby> {
    const id = `incoming-${randomBytes(6).toString('hex')}`;
    const workdir = join(this.standbyDir, id);
    await mkdir(workdir, { recursive: true });
    try {
      // A filled RAM file, waiting for a fill if need be: an unfilled one would make the
      // stream's load fault in fresh memory (ADR 0016), and this is background work. The
      // pool is not refilled after: the file of the VM destroyed next comes back to it.
      const ram = await (await this.ramPool())?.take(id, t.manifest.config.memoryMib, { waitForFill: true });
      const p = this.incomingPersisted(t.manifest, t.image, { vmId: id }, workdir, ram?.path);
      await this.overlays.create(t.image.disk, p.diskPath, t.manifest.diskVirtualSize);
      const l = { ...this.launchSpec(p, p.gen, p.memPath, p.memShared, p.diskPath, true), niceness: 19 };
      const { proc, qmp } = await this.spawnAndConnect(l, join(workdir, `qemu.${p.gen}.log`), [], undefined, { fdPassing: true });
      return { id, snapshotId: t.manifest.snapshotId, workdir, proc, qmp, readyAt: this.opts.clock.now(), ...(ram ? { ramFilled: ram.filled } : {}) };
    } catch (e) {
      await rm(workdir, { recursive: true, force: true });
      await this.releaseRam(id);
      throw e;
    }
  }

  /** The record of a VM restored by migration (ADR 0015), before its QEMU runs. */
  private incomingPersisted(m: SnapshotManifest, image: GuestImage, c: CloneSpec, workdir: string, ramFile: string | undefined): VmPersisted {
    return {
      info: {
        vmId: c.vmId, state: 'starting', accel: m.config.accel, pid: 0, workdir, memoryMib: m.config.memoryMib,
        vcpus: m.config.vcpus, hostname: c.hostname ?? c.vmId, sandboxId: c.sandboxId ?? c.vmId,
        baseSnapshotId: m.snapshotId, readyMs: 0,
      },
      image,
      kernelArgs: m.image.kernelArgs,
      memPath: '',
      memShared: false,
      ...(ramFile ? { ramFile } : { anonymousRam: true }),
      diskPath: join(workdir, 'disk.0.qcow2'),
      gen: 0,
      dependsOn: [],
      ...(c.network?.allowEgress ? { network: c.network } : {}),
    };
  }

  /**
   * Makes a claimed standby the VM of `p`: its directory becomes the VM's workdir (a rename
   * over the empty one; QEMU's open files and listening sockets move with it), and it is
   * registered like a freshly launched process. The old name stays as a symlink to the new
   * one, because QEMU reopens its disk by the name it was started with (when a snapshot makes
   * it a read-only backing file); recover() skips such links, destroy removes it.
   */
  private async adoptStandby(p: VmPersisted, s: Standby, log: Logger): Promise<VmRecord> {
    try {
      await rename(s.workdir, p.info.workdir);
      await symlink(join('..', 'vms', p.info.vmId), s.workdir);
    } catch (e) {
      await this.discardStandby(s);
      throw e;
    }
    // Back to normal priority (it started at nice 19 as background work).
    await reniceProcess(s.proc.pid, 0);
    // An incoming standby's RAM file is the VM's now (renamed after it), booked by the scheduler.
    void this.ramPoolOpened?.then((pool) => pool?.adopted(s.id));
    const rec = this.register({ ...p, launchDir: s.workdir }, s.proc, s.qmp, log);
    if (s.qmp.closed) throw new VmCrashedError(p.info.vmId, 'standby QEMU exited before it was claimed');
    return rec;
  }

  /**
   * Keep `count` standbys of the snapshot on this host (capped by the standby policy's max);
   * resolves with how many are ready. Forks refill them on their own (policy perSnapshot).
   */
  warm(snapshot: LocalSnapshot, count: number): Promise<number> {
    return this.standbys.warm(snapshot, count);
  }

  async dropStandbys(snapshotId: string): Promise<void> {
    await Promise.all([this.standbys.drop(snapshotId), this.sources.drop(snapshotId)]);
  }

  /**
   * An agent stopping (VMs stay for the next one): every standby ends and no more are made
   * (standbys are never adopted), and the RAM pool stops its fill and removes its free files.
   * VMs' RAM files stay with the VMs.
   */
  async closeStandbys(): Promise<void> {
    // Migrations out still streaming end first (their source QEMUs, claimed from a pool, are
    // in none), for at most MIGRATION_CLOSE_WAIT_MS; one still going then is reaped by the
    // next agent's recover().
    this.sourcesClosed = true;
    let t: NodeJS.Timeout | undefined;
    await Promise.race([Promise.allSettled([...this.migratingOut]), new Promise((r) => (t = setTimeout(r, MIGRATION_CLOSE_WAIT_MS)))]);
    clearTimeout(t);
    // The pool closes last: discarding an incoming standby gives its RAM file back to it.
    await Promise.all([this.standbys.close(), this.sources.close(), this.incoming.close()]);
    await this.ramPoolOpened?.then((p) => p?.close());
  }

  // ---------------------------------------------------------------- restore by migration (ADR 0015)

  /**
   * Source side of a restore on another host (ADR 0015): a QEMU is started with the
   * snapshot's memory image mapped and its device state loaded, the guest never runs, and it
   * migrates everything (all of RAM, the device state) to the destination's listener at
   * `target`, then exits. It runs in the agent's network namespace, because it must reach the
   * other host, or with migrationViaUnix (a TLS relay carries the stream) in one of its own;
   * the guest's vCPUs never start in it. The snapshot's files are only read.
   */
  migrateOut(snapshot: LocalSnapshot, target: MigrationTarget, signal?: AbortSignal): Promise<MigrateOutReport> {
    // A stopping agent starts no source QEMU (closeStandbys waits for those running): one
    // started after the pools closed outlived the agent.
    if (this.sourcesClosed) return Promise.reject(new ForkfleetError('unavailable', 'this host agent is stopping: it starts no migration source now', { retryable: true }));
    const p = this.migrateOutNow(snapshot, target, signal);
    this.migratingOut.add(p);
    const done = (): void => void this.migratingOut.delete(p);
    p.then(done, done);
    return p;
  }

  private async migrateOutNow(snapshot: LocalSnapshot, target: MigrationTarget, signal?: AbortSignal): Promise<MigrateOutReport> {
    const t0 = performance.now();
    signal?.throwIfAborted();
    if ('host' in target && this.opts.migrationViaUnix) throw new VmmError('migration sources have no network here (migrationViaUnix): stream to a unix socket');
    await this.assertCompatible(snapshot);
    // A source being started is waited for a short while only (CLAIM_WAIT_MS), and not once
    // the destination gave up.
    const ready = await this.sources.claim(snapshot.manifest.snapshotId, { signal });
    if (!ready) signal?.throwIfAborted();
    // One of its own is on the restore's critical path: not background work (nice 19).
    const urgent = new Urgency();
    urgent.urge();
    const s = ready ?? (await this.launchStandby(snapshot, { source: true, urgency: urgent }));
    try {
      // A pooled one started as background work (nice 19); its stream is on a restore's critical path.
      if (ready) await reniceProcess(s.proc.pid, 0);
      await setCaps(s.qmp, { events: true, 'x-ignore-shared': false });
      // QEMU's default cap is 32 MiB/s; the link and the destination set the pace.
      await s.qmp.execute('migrate-set-parameters', { 'max-bandwidth': 64 * 1024 ** 3 });
      // To a unix socket, a TLS relay carries the stream (peer/tls-relay.ts); QEMU's own TLS only on TCP.
      if ('host' in target && this.opts.migrationTlsDir) await useMigrationTls(s.qmp, this.opts.migrationTlsDir, { endpoint: 'client', hostname: target.host });
      const tm = performance.now();
      // The destination gave up (its call ended): no stream goes to a listener it closed,
      // whose port a later restore on that host may have by now.
      signal?.throwIfAborted();
      const cancel = (): void => void s.qmp.execute('migrate_cancel').catch(() => undefined);
      signal?.addEventListener('abort', cancel, { once: true });
      try {
        // As long as it moves: a fixed deadline cut large VMs' streams (StreamWait).
        await migrateAndWait(s.qmp, migrationUri(target), MIGRATION_STREAM_WAIT);
      } finally {
        signal?.removeEventListener('abort', cancel);
      }
      const q = await s.qmp.execute<{ ram?: { transferred?: number; mbps?: number } }>('query-migrate').catch(() => undefined);
      const bytes = q?.ram?.transferred ?? 0;
      const ms = Math.round(performance.now() - t0);
      this.opts.logger.info({ snapshotId: snapshot.manifest.snapshotId, bytes, ms, ready: !!ready, prepareMs: Math.round(tm - t0), mbps: q?.ram?.mbps && Math.round(q.ram.mbps) }, 'snapshot migrated out');
      return { bytes, ms };
    } finally {
      await this.discardStandby(s);
      // Keep one ready for the next child of this snapshot that leaves the host (started
      // after this stream, so it does not compete with it).
      this.sources.demand(snapshot, 1);
    }
  }

  /**
   * Destination side (ADR 0015): a VM `c` that will be restored from the migration stream of
   * a snapshot this host does not hold. Prepared before the stream arrives: the workdir and
   * the disk (the snapshot's disk layer, which `src.writeDiskLayer` writes as the VM's own).
   * The QEMU is an incoming standby of the snapshot's configuration when one is ready (already
   * started, waiting for a stream), else one started here, while the source gets its end
   * ready. `load` hands it the accepted connection's descriptor (so the stream never passes
   * through this process), or has it listen on a TLS relay's unix socket. Either way the stream
   * goes into a RAM pool file (ADR 0016; anonymous RAM without a pool), then the VM gets the
   * same clone hygiene as any restore.
   */
  prepareIncoming(src: IncomingSource, c: CloneSpec): Promise<IncomingVm> {
    return this.whileOpen(this.prepareIncomingNow(src, c));
  }

  private async prepareIncomingNow(src: IncomingSource, c: CloneSpec): Promise<IncomingVm> {
    validateId('vmId', c.vmId);
    if (c.network) EgressManager.validate(c.network);
    const m = src.manifest;
    await this.assertCompatible({ dir: '', manifest: m });
    await assertSameBaseDisk(m, src.image, `incoming ${m.snapshotId}`);
    const t0 = this.opts.clock.now();
    const workdir = await this.makeWorkdir(c.vmId);
    const log = this.opts.logger.child({ vmId: c.vmId, snapshotId: m.snapshotId, migrated: true });
    const template = incomingTemplate(m, src.image);
    // A standby's namespace has no egress link; a VM that may have egress starts its own.
    // Only a ready one: one still starting may be waiting for its RAM file's fill.
    const standby = c.network?.allowEgress ? undefined : await this.incoming.claim(template.manifest.snapshotId, { waitForLaunching: false });
    let p: VmPersisted;
    let ram: { path: string; filled: boolean } | undefined;
    let claimed: VmRecord | undefined;
    // The layer's header names the source host's image disk: rebased onto ours when it differs.
    const writeLayer = async (path: string): Promise<void> => {
      await src.writeDiskLayer(path);
      if (src.diskLayerBacking !== src.image.disk) await qemuImgRebaseUnsafe(path, src.image.disk);
    };
    try {
      if (standby) {
        // Its RAM file is renamed after the VM (QEMU keeps the mapping), as the pool names a VM's.
        const ramFile = this.ramDir ? ramFileOf(this.ramDir, standby.id) : undefined;
        const own = this.ramDir ? ramFileOf(this.ramDir, c.vmId) : undefined;
        const hasRam = ramFile !== undefined && own !== undefined && (await rename(ramFile, own).then(() => true, () => false));
        p = this.incomingPersisted(m, src.image, c, workdir, hasRam ? own : undefined);
        // The layer goes into the placeholder disk the standby's QEMU opened (inactive until
        // the stream ends, when QEMU re-reads the image's metadata): written beside it, then
        // copied into the same file, whose inode QEMU holds.
        const layer = join(standby.workdir, 'disk.layer.qcow2');
        await writeLayer(layer);
        await copyFile(layer, join(standby.workdir, 'disk.0.qcow2'));
        await rm(layer, { force: true });
        claimed = await this.adoptStandby(p, standby, log);
      } else {
        ram = await (await this.ramPool())?.take(c.vmId, m.config.memoryMib);
        p = this.incomingPersisted(m, src.image, c, workdir, ram?.path);
        // The layer is this VM's own copy, so it becomes its disk (backed by the image's base
        // disk, like a booted VM's): nothing the VM or its later snapshots stand on lives
        // outside the snapshot store once the VM is gone.
        await writeLayer(p.diskPath);
        // Started now, while the source gets its end ready, rather than once it has connected
        // (150-300 ms of QEMU start on this machine were on every such restore's critical path).
        // It takes the stream's descriptor as a standby does (`getfd`), or listens on a relay's socket.
        claimed = await this.launch(p, log, { incoming: true, fdPassing: true });
      }
    } catch (e) {
      // adoptStandby registers the VM before its last check; a standby not adopted yet is ours to end.
      if (this.vms.has(c.vmId)) await this.destroy(c.vmId).catch(() => undefined);
      else if (standby) await this.discardStandby(standby);
      await this.reapWorkdir(workdir);
      throw e;
    }
    const prepareMs = this.opts.clock.now() - t0;
    const waiting = claimed;
    let used = false;
    return {
      vmId: c.vmId,
      load: async (conn: MigrationStream, sourceGone?: AbortSignal): Promise<VmInfo> => {
        if (used) throw new VmAlreadyExistsError(c.vmId);
        used = true;
        const t1 = this.opts.clock.now();
        const { phases: ph, mark } = phaseTimer();
        try {
          // The QEMU that waits for the stream: a claimed standby, or the one started at prepare.
          const rec = waiting;
          const socket = conn instanceof net.Socket;
          if (conn instanceof net.Socket) {
            try {
              // QEMU gets its own copy of the connection's descriptor; ours closes.
              await rec.qmp.executeWithFd('getfd', { fdname: 'migration' }, conn);
            } finally {
              conn.destroy();
            }
          }
          await setCaps(rec.qmp, { events: true, 'x-ignore-shared': false });
          // QEMU's own TLS only on a connection; a relay's stream (peer/tls-relay.ts) comes in
          // plain on a unix socket QEMU listens on, and the relay connects.
          const qemuTls = socket ? this.opts.migrationTlsDir : undefined;
          if (qemuTls) await useMigrationTls(rec.qmp, qemuTls, { endpoint: 'server' });
          const uri = conn instanceof net.Socket ? 'fd:migration' : `unix:${conn.unixPath}`;
          // QEMU tells no progress of an incoming stream: the source fails one that stalls, and
          // its failed answer (sourceGone) ends this wait; the cap is the backstop.
          await untilAborted(incomingAndWait(rec.qmp, uri, MIGRATION_STREAM_WAIT.maxMs), sourceGone, 'the migration source failed before the stream was loaded');
          // The VM's own later migrations (its snapshots, to a local file) are plain: a
          // server-side tls-creds left set would make QEMU refuse them.
          if (qemuTls) await rec.qmp.execute('migrate-set-parameters', { 'tls-creds': '' });
          mark('load');
          const loadMs = this.opts.clock.now() - t1;
          await this.startRestored(rec, t0, mark, m.guestExecsRunning === true);
          log.info({ readyMs: rec.info.readyMs, prepareMs, loadMs, phases: ph, ramFilled: ram?.filled ?? standby?.ramFilled, standby: standby?.id, pid: rec.proc.pid }, 'vm restored by migration');
          return { ...rec.info };
        } catch (e) {
          if (conn instanceof net.Socket) conn.destroy();
          await this.destroy(c.vmId).catch(() => undefined);
          await rm(workdir, { recursive: true, force: true });
          throw e;
        } finally {
          if (ram) void this.ramPool().then((pool) => pool?.refill());
          // Keep one QEMU of this configuration waiting for the next VM that arrives, started
          // once such VMs stopped arriving for a while: started between the restores of a
          // burst, it took CPU from the next one's stream and guest (ADR 0015, item 4).
          if (!c.network?.allowEgress) this.incoming.demandWhenQuiet(template, 1, this.incomingQuietMs);
        }
      },
      abort: async () => {
        used = true;
        await this.destroy(c.vmId).catch(() => undefined);
        await rm(workdir, { recursive: true, force: true });
        // As after a load: a standby this VM claimed is made again for the next one that arrives.
        if (!c.network?.allowEgress) this.incoming.demandWhenQuiet(template, 1, this.incomingQuietMs);
      },
    };
  }

  /**
   * Keep `count` incoming standbys (ADR 0015) for VMs migrated here from snapshots like
   * `src`'s (same image, RAM, vCPUs); resolves with how many are ready. Restores by
   * migration keep one on their own (policy perSnapshot).
   */
  warmIncoming(src: Pick<IncomingSource, 'manifest' | 'image'>, count: number): Promise<number> {
    return this.incoming.warm(incomingTemplate(src.manifest, src.image), count);
  }

  private async restoreOne(snapshot: LocalSnapshot, c: CloneSpec): Promise<VmInfo> {
    const t0 = this.opts.clock.now();
    const m = snapshot.manifest;
    const workdir = await this.makeWorkdir(c.vmId);
    const log = this.opts.logger.child({ vmId: c.vmId, snapshotId: m.snapshotId });
    try {
      const p = await this.clonePersisted(snapshot, c, workdir);
      const { phases: ph, mark } = phaseTimer();
      const standby = canUseStandby(p.network) ? await this.standbys.claim(m.snapshotId) : undefined;
      let rec: VmRecord;
      if (standby) {
        rec = await this.adoptStandby(p, standby, log);
        mark('standby');
      } else {
        const { proc, qmp } = await this.spawnIncoming(snapshot, p, mark);
        rec = this.register(p, proc, qmp, log);
      }
      await this.startRestored(rec, t0, mark, m.guestExecsRunning === true);
      log.debug({ phases: ph, standby: !!standby }, 'restore phases');
      log.info({ readyMs: rec.info.readyMs, pid: rec.proc.pid, standby: standby?.id }, 'vm restored');
      return { ...rec.info };
    } catch (e) {
      await this.destroy(c.vmId).catch(() => undefined);
      await rm(workdir, { recursive: true, force: true });
      throw e;
    }
  }

  /**
   * The end of every restore, same-host or migrated: the loaded VM runs its first guest
   * instruction, its agent is resynced, it gets clone hygiene, and it is recorded as running
   * with its ready time counted from `t0`. `execsRan` (the snapshot's guestExecsRunning): the
   * guest-agent execs that were running in the source when it was copied are ended first, as
   * a timeout would end them: their callers wait on the source (or were told it failed, when
   * it was hibernated), and here no one would poll them or enforce their timeouts.
   */
  private async startRestored(rec: VmRecord, t0: number, mark: (k: string) => void, execsRan = false): Promise<void> {
    await rec.qmp.execute('cont');
    mark('cont');
    try {
      rec.agent = await this.connectAgent(rec, this.opts.restoreTimeoutMs, 250);
      mark('sync');
      await this.cloneHygiene(rec, mark);
      // This channel's instance is new (openAgent): every wrapper in the guest is another's.
      if (execsRan) {
        await this.reapOrphans(rec, 30_000);
        mark('reap');
      }
    } catch (e) {
      // The VM is destroyed next: what the guest was doing is only visible now.
      rec.log.warn({ err: String(e), guest: await this.guestDiagnostics(rec) }, 'restored guest did not answer');
      throw e;
    }
    rec.info.readyMs = this.opts.clock.now() - t0;
    this.setState(rec, 'running');
    await this.persist(rec);
  }

  /**
   * What a guest that stopped answering its agent is doing: the run state, where its vCPU is
   * (twice, to tell a spinning guest from a halted one) and the end of its serial console
   * (kernel oopses and panics). Best effort: any part that fails is left out.
   */
  private async guestDiagnostics(rec: VmRecord): Promise<Record<string, unknown>> {
    const out: Record<string, unknown> = {};
    if (!rec.qmp.closed) {
      out.status = await queryStatus(rec.qmp).catch(() => undefined);
      const cpu: string[] = [];
      for (let i = 0; i < 2; i++) {
        const regs = await rec.qmp.execute<string>('human-monitor-command', { 'command-line': 'info registers' }).catch(() => '');
        cpu.push(`${/RIP=(\S+)/.exec(regs)?.[1] ?? '?'} HLT=${/HLT=(\d)/.exec(regs)?.[1] ?? '?'}`);
        if (i === 0) await new Promise((r) => setTimeout(r, 200));
      }
      out.cpu = cpu;
    }
    if (!rec.qmp.closed) {
      const serial = await rec.qmp.execute<string>('ringbuf-read', { device: SERIAL_CHARDEV, size: SERIAL_RING_BYTES, format: 'utf8' }).catch(() => '');
      if (serial) out.serialTail = serial.slice(-1500);
    }
    return out;
  }

  /**
   * Make a clone distinct and current before it is handed out (DESIGN.md decision 7, ADR 0009):
   * the host's clock, fresh RNG (host entropy written into the pool, then RNDRESEEDCRNG), its own
   * hostname and sandbox id. One `guest-get-time` (no guest process) measures the guest clock's
   * offset; then ONE guest exec of /sbin/ff-clone applies all of it, and its exit status 0 is
   * the "answers an exec" proof. Images without ff-clone get the older shell script +
   * guest-set-time (ADR 0005).
   */
  private async cloneHygiene(rec: VmRecord, mark: (k: string) => void = () => undefined): Promise<void> {
    const agent = this.agentOf(rec);
    const record = await this.cloneRecord(rec, agent).catch((e: unknown) => {
      throw new CloneHygieneError(rec.info.vmId, 'clock offset (guest-get-time)', { cause: e });
    });
    mark('getTime');
    if (record) {
      let r: ExecResult | undefined;
      try {
        r = await agent.exec({ path: '/sbin/ff-clone', stdin: record, timeoutMs: 30_000, captureOutput: false });
      } catch (e) {
        // qemu-ga reports a missing program as a command error: an image older than ff-clone.
        if (!(e instanceof GuestAgentCommandError)) throw new CloneHygieneError(rec.info.vmId, 'ff-clone', { cause: e });
        rec.log.debug({ err: String(e) }, 'no /sbin/ff-clone in the guest; using the shell hygiene');
      }
      if (r) {
        if (r.exitCode !== 0) throw new CloneHygieneError(rec.info.vmId, `ff-clone (exit ${r.exitCode}: step ${FF_CLONE_STEPS[r.exitCode] ?? '?'})`);
        mark('exec');
        rec.clockBehindMs = 0;
        return;
      }
    }
    await this.legacyCloneHygiene(rec, agent, mark);
    rec.clockBehindMs = 0;
  }

  /**
   * The 416-byte stdin record of ff-clone (deploy/images/ff-clone.S), or undefined when the
   * hostname or sandbox id does not fit it. The clock offset is host minus guest, measured at
   * the midpoint of one guest-get-time round trip: a relative step, so the exec's own latency
   * does not make the clock late.
   */
  private async cloneRecord(rec: VmRecord, agent: GuestAgentClient): Promise<Buffer | undefined> {
    const host = Buffer.from(rec.info.hostname);
    const sandbox = Buffer.from(`${rec.info.sandboxId}\n`);
    if (host.length > 64 || sandbox.length > 64) return undefined;
    // Date.now(), not performance.timeOrigin + now(): the guest must follow the host's wall
    // clock, which a long-lived agent's monotonic clock drifts away from.
    const before = Date.now();
    const guestNs = await agent.getTime();
    const after = Date.now();
    const hostNs = BigInt(Math.round((before + after) / 2)) * 1_000_000n;
    const offsetUs = (hostNs - guestNs) / 1000n;
    const b = Buffer.alloc(416);
    b.writeUInt32LE(ADJ_SETOFFSET, 0);
    // struct timex.time: tv_sec may be negative, tv_usec must be in [0, 1e6).
    let sec = offsetUs / 1_000_000n;
    let usec = offsetUs % 1_000_000n;
    if (usec < 0n) {
      usec += 1_000_000n;
      sec -= 1n;
    }
    b.writeBigInt64LE(sec, 72);
    b.writeBigInt64LE(usec, 80);
    randomBytes(64).copy(b, 208);
    b.writeBigUInt64LE(BigInt(host.length), 272);
    host.copy(b, 280);
    b.writeBigUInt64LE(BigInt(sandbox.length), 344);
    sandbox.copy(b, 352);
    return b;
  }

  private async legacyCloneHygiene(rec: VmRecord, agent: GuestAgentClient, mark: (k: string) => void): Promise<void> {
    const script =
      'cat > /dev/urandom && /sbin/ff-reseed && hostname "$1" && mkdir -p /run/forkfleet && echo "$2" > /run/forkfleet/sandbox-id';
    let r: ExecResult;
    try {
      r = await agent.exec({
        path: '/bin/sh',
        args: ['-c', script, 'sh', rec.info.hostname, rec.info.sandboxId],
        stdin: randomBytes(64),
        timeoutMs: 30_000,
      });
    } catch (e) {
      throw new CloneHygieneError(rec.info.vmId, 'reseed+identity', { cause: e });
    }
    if (r.exitCode !== 0) {
      throw new CloneHygieneError(rec.info.vmId, `reseed+identity (exit ${r.exitCode}: ${r.stderr.toString().trim()})`);
    }
    mark('exec');
    try {
      await agent.setTime();
      mark('setTime');
    } catch (e) {
      throw new CloneHygieneError(rec.info.vmId, 'clock', { cause: e });
    }
  }

  private async imageOf(snapshot: LocalSnapshot): Promise<GuestImage> {
    // The kernel and initrd must be the ones the source booted (the same command line).
    const img = await readFile(join(snapshot.dir, 'image.json'), 'utf8').catch(() => undefined);
    if (img) return JSON.parse(img) as GuestImage;
    throw new SnapshotNotFoundError(`${snapshot.dir} (image ${snapshot.manifest.image.name}-${snapshot.manifest.image.recipeHash} unknown here)`);
  }

  private async snapshotChain(snapshot: LocalSnapshot): Promise<string[]> {
    const chain = [snapshot.manifest.snapshotId];
    let parent = snapshot.manifest.parentSnapshotId;
    while (parent) {
      chain.push(parent);
      const m = await this.openSnapshot(join(this.snapshotsDir, parent)).catch(() => undefined);
      parent = m?.manifest.parentSnapshotId ?? null;
    }
    return chain;
  }

  // ---------------------------------------------------------------- destroy / delete

  /** Idempotent: destroying an unknown VM removes any leftover workdir and succeeds. */
  async destroy(vmId: string): Promise<void> {
    const rec = this.vms.get(vmId);
    if (!rec) {
      if (VM_ID.test(vmId)) await this.reapWorkdir(join(this.vmsDir, vmId));
      return;
    }
    await this.lockedRec(rec, async () => {
      if (rec.info.state === 'destroyed') return;
      if (rec.info.state !== 'destroying') this.setState(rec, 'destroying');
      rec.expectExit = true;
      rec.agent?.close();
      await killAndWait(rec.proc);
      rec.qmp.close();
      await this.reapWorkdir(rec.info.workdir, rec.launchDir);
      if (rec.launchDir) await rm(rec.launchDir, { force: true });
      // A snapshot of it that was never sealed serves nothing else (no manifest: no fork, no
      // fetch, no GC sees it): it goes with the VM, not at the next agent start.
      // So does a template snapshot the VM switched onto and that could not be sealed since.
      for (const id of [rec.unsealed?.snapshotId, rec.switching?.manifest.snapshotId]) {
        const unsealed = id && join(this.snapshotsDir, id);
        if (unsealed && !(await isSealed(unsealed))) await rm(unsealed, { recursive: true, force: true });
      }
      this.vms.delete(vmId);
      this.setState(rec, 'destroyed');
      rec.log.info('vm destroyed');
    });
  }

  /**
   * Kill every QEMU named by a pid file in the workdir (checking it is ours: its command line
   * names the workdir, or launchDir for a claimed standby), then remove it.
   */
  private async reapWorkdir(workdir: string, launchDir?: string): Promise<string[]> {
    const killed: string[] = [];
    const files = await readdir(workdir).catch(() => [] as string[]);
    const recordedRam = files.includes('vm.json') ? await readFile(join(workdir, 'vm.json'), 'utf8').then((t) => (JSON.parse(t) as { ramFile?: unknown }).ramFile).catch(() => undefined) : undefined;
    for (const f of files.filter((x) => x.endsWith('.pid'))) {
      const pid = Number((await readFile(join(workdir, f), 'utf8').catch(() => '')).trim());
      if (pid > 0 && (await this.isOurQemu(pid, workdir, launchDir))) {
        await killAndWait(adoptProcess(pid));
        killed.push(String(pid));
      }
    }
    await rm(workdir, { recursive: true, force: true });
    // A VM's RAM file (ram-pool.ts) goes with its workdir, whoever removes it.
    if (dirname(workdir) === this.vmsDir) await this.releaseRam(basename(workdir), typeof recordedRam === 'string' ? recordedRam : undefined);
    return killed;
  }

  private async isOurQemu(pid: number, workdir: string, launchDir?: string): Promise<boolean> {
    const cmd = await cmdlineOf(pid);
    if (!cmd) return false;
    if (cmd.some((a) => a.includes(`${workdir}/`))) return true;
    if (launchDir === undefined || !cmd.some((a) => a.includes(`${launchDir}/`))) return false;
    if (launchDir !== this.standbyDir) return true;
    // Any standby's QEMU (a workdir without vm.json, which may be a claimed standby's): not
    // one whose standby name links to another VM's workdir. That is the QEMU of a VM claimed
    // from it, which now has the pid a dead QEMU of this workdir left in its pid file.
    const arg = cmd.find((a) => a.includes(`${launchDir}/`))!;
    const sid = arg.slice(arg.indexOf(`${launchDir}/`) + launchDir.length + 1).split('/')[0]!;
    const target = await readlink(join(this.standbyDir, sid)).catch(() => undefined);
    return target === undefined || resolvePath(this.standbyDir, target) === workdir;
  }

  vmsUse(snapshotId: string): boolean {
    for (const v of this.vms.values()) if (v.info.state !== 'destroyed' && v.dependsOn.includes(snapshotId)) return true;
    return false;
  }

  async snapshotsInUse(): Promise<Set<string>> {
    const used = new Set<string>();
    for (const v of this.vms.values()) if (v.info.state !== 'destroyed') for (const id of v.dependsOn) used.add(id);
    for (const other of await readdir(this.snapshotsDir).catch(() => [] as string[])) {
      const m = await this.openSnapshot(join(this.snapshotsDir, other)).catch(() => undefined);
      if (m?.manifest.parentSnapshotId) used.add(m.manifest.parentSnapshotId);
    }
    return used;
  }

  async deleteSnapshot(snapshot: LocalSnapshot): Promise<void> {
    const id = snapshot.manifest.snapshotId;
    // Standbys are not users: they go with the snapshot.
    await this.dropStandbys(id);
    const users = [...this.vms.values()].filter((v) => v.dependsOn.includes(id)).map((v) => `vm ${v.info.vmId}`);
    for (const other of await readdir(this.snapshotsDir).catch(() => [] as string[])) {
      const m = await this.openSnapshot(join(this.snapshotsDir, other)).catch(() => undefined);
      if (m?.manifest.parentSnapshotId === id) users.push(`snapshot ${other}`);
    }
    if (users.length > 0) throw new SnapshotInUseError(id, users);
    // The manifest first: a kill during the recursive rm leaves a directory without one, which
    // is no snapshot and goes with recover()'s sweep (a partial one with its manifest left
    // would pass for complete).
    await unlink(join(snapshot.dir, 'manifest.json')).catch((e: unknown) => {
      if ((e as NodeJS.ErrnoException).code !== 'ENOENT') throw e;
    });
    await rm(snapshot.dir, { recursive: true, force: true });
  }

  /**
   * Forget every VM without stopping it: an agent shutting down for an upgrade, after which a
   * new agent adopts them with recover('adopt'). Tests use it to simulate an agent crash.
   */
  detach(): void {
    // Standbys are left running too; they are never adopted, a new agent's recover reaps them.
    this.standbys.abandon();
    this.sources.abandon();
    this.incoming.abandon();
    for (const rec of this.vms.values()) {
      rec.expectExit = true;
      rec.agent?.close();
      rec.qmp.close();
    }
    this.vms.clear();
  }

  async close(): Promise<void> {
    this.closing = true;
    await Promise.allSettled([...this.making]);
    await this.closeStandbys();
    await Promise.all([...this.vms.keys()].map((id) => this.destroy(id)));
    // Again, now that no VM file is left: removes the pool's directory.
    await (await this.ramPoolOpened)?.close();
  }

  // ---------------------------------------------------------------- recovery

  async recover(mode: 'adopt' | 'reap'): Promise<RecoveryReport> {
    const report: RecoveryReport = { adopted: [], reaped: [] };
    /** Adopted guests ending the previous agent's execs, all at once: awaited before recover() returns, so no exec of ours overlaps them. */
    const reaping: Array<Promise<void>> = [];
    // A few VMs at a time: one whose QMP is slow to answer may take its adopt's retries
    // (adoptOrGiveUp, up to ~18 s), and the agent heartbeats only once recover() is done.
    const queue = (await readdir(this.vmsDir).catch(() => [] as string[])).filter((vmId) => !this.vms.has(vmId));
    const one = async (vmId: string): Promise<void> => {
      const workdir = join(this.vmsDir, vmId);
      let persisted = await readFile(join(workdir, 'vm.json'), 'utf8')
        .then((s) => JSON.parse(s) as VmPersisted)
        .catch(() => undefined);
      const launched = persisted?.launchDir;
      if (mode === 'adopt' && persisted?.switching) {
        persisted = await this.settleSwitchOrGiveUp(persisted);
      }
      const pid = persisted ? await this.livePid(workdir, persisted.gen, persisted.launchDir) : 0;
      const alive = pid > 0;
      // An accelerator probe the agent died in (resolveAccel) is nobody's VM: reaped.
      if (mode === 'adopt' && persisted && alive && !vmId.startsWith(PROBE_VM_PREFIX)) {
        const reaped = await this.adoptOrGiveUp(persisted, pid, workdir);
        if (reaped !== false) {
          if (reaped) reaping.push(reaped);
          report.adopted.push(vmId);
          return;
        }
      }
      // No vm.json yet: it may be a claimed standby (incoming ones wait for their stream so),
      // whose QEMU was started under standby/.
      await this.reapWorkdir(workdir, launched ?? this.standbyDir);
      if (launched) await rm(launched, { force: true });
      report.reaped.push(vmId);
    };
    await Promise.all(
      Array.from({ length: Math.min(RECOVER_CONCURRENCY, queue.length) }, async () => {
        for (let vmId = queue.shift(); vmId !== undefined; vmId = queue.shift()) await one(vmId);
      }),
    );
    report.adopted.sort();
    report.reaped.sort();
    // RAM files of VMs that are gone (ADR 0016); the pool keeps its filled free files.
    if (this.opts.ram) {
      const ramReaped = await (await this.ramPool())?.reap(new Set(this.vms.keys()));
      if (ramReaped?.length) this.opts.logger.info({ vms: ramReaped }, 'left-over RAM files reaped');
    }
    // Standbys are never adopted (a new agent makes its own). A claimed one's old name is a
    // symlink to its VM's workdir: kept while that exists (QEMU reopens its disk by it).
    for (const id of await readdir(this.standbyDir).catch(() => [] as string[])) {
      const dir = join(this.standbyDir, id);
      if ((await lstat(dir).catch(() => undefined))?.isSymbolicLink()) {
        if (!(await stat(dir).then(() => true, () => false))) await rm(dir, { force: true });
        continue;
      }
      const killed = await this.reapWorkdir(dir);
      this.opts.logger.info({ standby: id, killed }, 'left-over standby reaped');
    }
    // Receivers of interrupted snapshots, and snapshots that never got their manifest.
    for (const snap of await readdir(this.snapshotsDir).catch(() => [] as string[])) {
      const dir = join(this.snapshotsDir, snap);
      await this.reapWorkdir(join(dir, '.recv'));
      const complete = await isSealed(dir);
      if (!complete && ![...this.vms.values()].some((v) => v.memPath.startsWith(`${dir}/`) || v.dependsOn.includes(snap))) {
        await rm(dir, { recursive: true, force: true });
        report.reaped.push(`snapshot:${snap}`);
      }
    }
    // Adopted VMs with egress get this agent's agent-side rules (a changed deny list, or a
    // firewall reload that flushed them), not only the next new egress VM.
    if ([...this.vms.values()].some((v) => v.network?.allowEgress)) {
      this.egressManager ??= new EgressManager({ logger: this.opts.logger.child({ component: 'egress' }), ...this.opts.egress });
      await this.egressManager.applyAgentSide().catch((e: unknown) => this.opts.logger.error({ err: e }, 'egress rules of the agent side could not be applied for adopted sandboxes'));
    }
    await Promise.all(reaping);
    return report;
  }

  /**
   * The pid of this VM's QEMU of generation `gen` if it runs (0 if not). One killed already
   * (isKilled: a template snapshot's source, SIGKILLed by an agent that died right after) does
   * not: it was taken for a source never stopped, and the snapshot undone under a VM dying.
   */
  private async livePid(workdir: string, gen: number, launchDir?: string): Promise<number> {
    const pid = Number((await readFile(join(workdir, `qemu.${gen}.pid`), 'utf8').catch(() => '')).trim());
    return pid > 0 && isAlive(pid) && !isKilled(pid) && (await this.isOurQemu(pid, workdir, launchDir)) ? pid : 0;
  }

  /**
   * A template snapshot the previous agent died in (VmPersisted.switching). If the old QEMU
   * still runs, the source was never stopped for good: the snapshot is undone as its own
   * failure path would (replacement killed, memory file renamed back, new layer removed; the
   * directory, without a manifest, goes with recover()'s sweep). If only the replacement runs
   * and has loaded the device state, it is the VM: the record moves onto it, and the snapshot,
   * whose files are complete, is sealed (if that fails, left `switching` for the VM's next
   * snapshot to seal). A replacement still waiting for the state is given the snapshot's state
   * file first. Otherwise (no QEMU, or a state that does not load) there
   * is nothing to adopt: undefined, and the workdir is reaped.
   */
  private async settleSwitch(p: VmPersisted): Promise<VmPersisted | undefined> {
    const sw = p.switching!;
    const id = sw.manifest.snapshotId;
    const dir = join(this.snapshotsDir, id);
    const { workdir } = p.info;
    const log = this.opts.logger.child({ vmId: p.info.vmId, snapshotId: id });
    const settled = (q: VmPersisted): VmPersisted => ({ ...q, info: { ...q.info, state: sw.state }, switching: undefined });
    if (p.gen !== sw.gen) {
      const oldPid = await this.livePid(workdir, p.gen, p.launchDir);
      const newPid = await this.livePid(workdir, sw.gen, p.launchDir);
      if (oldPid) {
        if (newPid) await killAndWait(adoptProcess(newPid));
        if (!(await stat(p.memPath).then(() => true, () => false))) await rename(sw.memPath, p.memPath).catch(() => undefined);
        await rm(sw.diskPath, { force: true });
        await this.removeGenFiles(workdir, sw.gen);
        log.warn('agent died in a template snapshot before its source stopped: snapshot undone');
        return settled(p);
      }
      if (!newPid) return undefined;
      const qmp = await QmpClient.connect(join(workdir, `qmp.${sw.gen}.sock`));
      let status: string;
      try {
        status = await queryStatus(qmp);
        const sock = join(workdir, `mig-in.${sw.gen}.sock`);
        if (status === 'inmigrate' && (await stat(sock).then((st) => st.isSocket(), () => false))) {
          // The agent died after it had saved the device state and killed the source, before
          // the replacement (armed, listening) loaded it. The source is gone for good; the
          // snapshot's state file is whole (the source is killed only once its save completed),
          // so the replacement loads it now. A state file that is not whole fails the load,
          // and the VM is reaped as before.
          await feedIncoming(qmp, sock, join(dir, 'state.bin'), qmp.mark);
          log.warn('agent died in a template snapshot between the source\'s save and the replacement\'s load: loaded now');
          status = await queryStatus(qmp);
        }
      } finally {
        qmp.close();
      }
      if (status !== 'running' && status !== 'paused') return undefined; // never got the device state
      await unlink(p.diskPath).catch(() => undefined); // hard-linked as the snapshot's disk
      await this.removeGenFiles(workdir, p.gen);
      p = { ...p, gen: sw.gen, memPath: sw.memPath, memShared: false, diskPath: sw.diskPath, info: { ...p.info, baseSnapshotId: id }, dependsOn: p.dependsOn.includes(id) ? p.dependsOn : [id, ...p.dependsOn] };
    } else if (!(await this.livePid(workdir, sw.gen, p.launchDir))) {
      // Not sealed on the word of a record alone: after an OS crash the memory file's and
      // state's last writes may never have reached the disk. Reaped, the directory swept.
      return undefined;
    }
    if (await sealFailedAt(dir)) {
      // The previous agent's seal fsync failed: never sealed (a second fsync returns 0). The VM
      // runs from it and is adopted with `switching` left, so that its next snapshot fails
      // naming it (sealSwitched) and a destroy removes the directory; retried here, the seal
      // would fail every attempt and the VM be reaped.
      log.error('agent died in a template snapshot whose seal fsync had failed: snapshot left unsealed for good');
      return { ...settled(p), switching: sw };
    }
    try {
      await ensureSealed(dir, p.image, sw.manifest);
    } catch (e) {
      // A seal that failed (a full disk, EMFILE) fails the same way when retried seconds later:
      // retried here until given up on, the VM, which runs from the complete files, would be
      // killed and its disk removed. Adopted with `switching` left, as the failed snapshot()
      // leaves it: its next snapshot seals this one first (sealSwitched), and a destroy removes
      // the directory if it is never sealed.
      log.error({ err: String(e) }, 'agent died in a template snapshot after the VM switched onto it, and sealing it failed: adopted, the snapshot left to seal at its next snapshot');
      return { ...settled(p), switching: sw };
    }
    log.warn('agent died in a template snapshot after the VM switched onto it: snapshot sealed');
    return settled(p);
  }

  /**
   * adopt(), tried again while the QEMU lives: a QMP greeting or answer that timed out on a
   * loaded host is no reason to kill a healthy VM and remove its disk. False once it is given
   * up on (the caller reaps it).
   */
  private adoptOrGiveUp(p: VmPersisted, pid: number, workdir: string): Promise<Promise<void> | undefined | false> {
    return this.whileAlive(p, 'adopt', () => this.adopt(p, pid), async () => (await this.livePid(workdir, p.gen, p.launchDir)) === pid);
  }

  /**
   * settleSwitch(), tried again while a QEMU of the VM (either generation) lives, as adopt is:
   * reaping after one QMP timeout would kill a replacement that has become the VM and sweep
   * its complete snapshot. Undefined once it is given up on (the caller reaps).
   */
  private async settleSwitchOrGiveUp(p: VmPersisted): Promise<VmPersisted | undefined> {
    const { workdir } = p.info;
    const alive = async (): Promise<boolean> => (await this.livePid(workdir, p.gen, p.launchDir)) > 0 || (await this.livePid(workdir, p.switching!.gen, p.launchDir)) > 0;
    const r = await this.whileAlive(p, 'settling an interrupted template snapshot', () => this.settleSwitch(p), alive);
    return r === false ? undefined : r;
  }

  /** `attempt` until it succeeds, up to ADOPT_ATTEMPTS times while `alive`; false once given up on. */
  private async whileAlive<T>(p: VmPersisted, what: string, attempt: () => Promise<T>, alive: () => Promise<boolean>): Promise<T | false> {
    for (let n = 1; ; n++) {
      try {
        return await attempt();
      } catch (e) {
        const lives = await alive();
        if (!lives || n >= ADOPT_ATTEMPTS) {
          this.opts.logger.warn({ vmId: p.info.vmId, err: String(e), attempt: n, alive: lives }, `${what} failed; reaping`);
          return false;
        }
        this.opts.logger.warn({ vmId: p.info.vmId, err: String(e), attempt: n }, `${what} failed; trying again`);
        await sleep(n * 1000);
      }
    }
  }

  /** Ends the execs a previous agent left in the VM's guest (GuestAgentClient.reapOrphanExecs); never rejects. */
  private reapOrphans(rec: VmRecord, timeoutMs: number): Promise<void> {
    const agent = rec.agent;
    if (!agent) return Promise.resolve();
    return agent.reapOrphanExecs(timeoutMs).then(
      (n) => {
        rec.orphanExecsPending = undefined;
        if (n > 0) rec.log.warn({ execs: n }, 'ended the execs an earlier agent or the snapshot\'s source left running in the guest');
      },
      (e: unknown) => rec.log.warn({ err: String(e) }, 'could not end the execs the previous agent left in the guest'),
    );
  }

  /** Adopts a running VM; resolves with its guest's reaping of the execs the previous agent left (or undefined), which recover() awaits. */
  private async adopt(p: VmPersisted, pid: number): Promise<Promise<void> | undefined> {
    const log = this.opts.logger.child({ vmId: p.info.vmId });
    const qmp = await QmpClient.connect(join(p.info.workdir, `qmp.${p.gen}.sock`));
    // QEMU serves one monitor client at a time: a connection left open by a failed attempt
    // would leave the next attempt (adoptOrGiveUp) without a greeting. (Closing twice is a no-op.)
    try {
      return await this.adoptOn(p, pid, qmp, log);
    } catch (e) {
      qmp.close();
      throw e;
    }
  }

  private async adoptOn(p: VmPersisted, pid: number, qmp: QmpClient, log: Logger): Promise<Promise<void> | undefined> {
    // A migration out that the previous agent started (a snapshot's RAM copy, a move to another
    // host; under KVM the VM runs while it copies) belongs to a step that died with that agent:
    // cancelled, or it would complete and stop the VM adopted here as running. The redelivered
    // step starts its own.
    if (await cancelMigrationOut(qmp)) log.warn('adopted VM was migrating out for the previous agent: migration cancelled');
    // A clone-overlay warm-up (snapshot(): made, then removed at once) the previous agent died
    // between: no QEMU opens it, and nothing else would remove it before the VM is destroyed.
    for (const f of await readdir(p.info.workdir).catch(() => [] as string[])) {
      if (/^overlay-warm\..+\.qcow2$/.test(f)) await unlink(join(p.info.workdir, f)).catch(() => undefined);
    }
    let status = await queryStatus(qmp);
    if (p.info.state === 'running' && status !== 'running') {
      // Stopped by an operation the previous agent died in (a snapshot's copy, a pause it had
      // not recorded yet): the VM runs again, as recorded; a redelivered step redoes its own pause.
      await reactivate(qmp, false);
      log.warn({ status }, 'adopted VM was stopped mid-operation: resumed');
      status = await queryStatus(qmp);
    }
    // A receiver snapshot switches the VM onto a new overlay (blockdev-snapshot) before vm.json
    // says so. After a kill in between, QEMU writes that overlay while vm.json names the layer
    // below: a later snapshot would hard-link the stale layer as its disk (missing every write
    // since), and the overlay's header names its backing inside the unfinished snapshot's
    // directory, which goes. The overlay is merged back down, as if the snapshot never began.
    const top = await topDiskFile(qmp).catch(() => undefined);
    if (top && (await realpath(top).catch(() => top)) !== (await realpath(p.diskPath).catch(() => p.diskPath))) {
      // disk.<snapshot>.qcow2: whose snapshot it began. One that got its manifest is complete
      // (its disk is the recorded layer, hard-linked): the VM stays on the new layer, as the
      // snapshot's end would have recorded. Merging down would write into the snapshot's disk.
      const of = /^disk\.(.+)\.qcow2$/.exec(basename(top))?.[1];
      if (of && (await isSealed(join(this.snapshotsDir, of)))) {
        log.warn({ recorded: p.diskPath, snapshotId: of }, 'VM was recorded before its finished snapshot: now on that snapshot\'s new layer');
        p = { ...p, diskPath: top, dependsOn: p.dependsOn.includes(of) ? p.dependsOn : [of, ...p.dependsOn] };
      } else {
        try {
          // A paused VM's images may still be inactive (a migration stopped it): writable first.
          if (status !== 'running') await reactivate(qmp, true);
          await commitActiveLayer(qmp, p.diskPath, `ff-rollback-${p.info.vmId}`);
          await unlink(top).catch(() => undefined);
          log.warn({ recorded: p.diskPath, overlay: top }, 'VM wrote a disk overlay of an interrupted snapshot: merged it back into its layer');
        } catch (e) {
          // A merge that fails (a full disk, a slow job) is no reason to kill a VM that QMP just
          // answered and remove its disk: adopted on the overlay it writes (QEMU keeps its
          // backing open after the unfinished snapshot's directory goes), and its next snapshot
          // merges it back first (mergeBackStrayLayer), or fails naming it. A job still running
          // (not ready in time) is cancelled: left, it holds the disk, and that merge's own job
          // would be refused on every snapshot.
          await cancelBlockJob(qmp, `ff-rollback-${p.info.vmId}`).catch((c: unknown) => log.warn({ err: String(c) }, 'could not cancel the merge job'));
          log.warn({ recorded: p.diskPath, overlay: top, err: String(e) }, 'VM writes a disk overlay of an interrupted snapshot and merging it back failed: adopted on it; its next snapshot merges it back first');
        }
      }
    }
    const proc = adoptProcess(pid);
    const rec = this.register(p, proc, qmp, log);
    try {
      rec.info.state = status === 'running' ? 'running' : 'paused';
      rec.agent = await this.openAgent(join(p.info.workdir, `qga.${p.gen}.sock`));
      // A slow or busy guest agent (a loaded TCG guest, qemu-ga stopped by the user) is no
      // reason to kill a VM that QMP just answered: the channel stays unsynced and the next
      // guest call syncs first (GuestAgentClient.commandRaw).
      let answered = false;
      if (status === 'running') {
        answered = await rec.agent.sync(10_000).then(
          () => true,
          (e: unknown) => {
            if (!(e instanceof GuestAgentTimeoutError)) throw e;
            log.warn({ err: String(e) }, 'adopted VM: guest agent did not answer yet; the next guest call syncs again');
            return false;
          },
        );
      }
      // vm.json already describes this VM: a failed rewrite (a full disk) is no reason to
      // kill it and remove its disk. The next state change writes it again.
      await this.persist(rec).catch((e: unknown) => log.warn({ err: String(e) }, 'adopted VM: could not rewrite vm.json; the next state change writes it'));
      log.info({ pid, status }, 'vm adopted');
      // The previous agent's execs in this guest: nobody polls them, so nobody ends them at
      // their timeout; ended now, with the output files no one will read. A guest that did not
      // answer yet is asked in the background (its channel syncs first); a paused one once it
      // is resumed: they would otherwise run on with no timeout.
      if (answered) return this.reapOrphans(rec, 15_000);
      rec.orphanExecsPending = true;
      if (status === 'running') void this.reapOrphans(rec, 120_000);
      return undefined;
    } catch (e) {
      // Not adopted after all: the caller tries again or reaps it, and no record of it stays behind.
      rec.expectExit = true;
      this.vms.delete(p.info.vmId);
      proc.unwatch?.();
      rec.agent?.close();
      qmp.close();
      throw e;
    }
  }

  // ---------------------------------------------------------------- bookkeeping

  get(vmId: string): VmInfo | undefined {
    const r = this.vms.get(vmId);
    return r ? { ...r.info } : undefined;
  }

  list(): VmInfo[] {
    return [...this.vms.values()].map((r) => ({ ...r.info }));
  }

  onEvent(listener: (e: VmEvent) => void): () => void {
    this.listeners.add(listener);
    return () => this.listeners.delete(listener);
  }

  /** QMP of a VM, for tools (the benchmark) that drive QEMU below the port. */
  qmpOf(vmId: string): QmpClient {
    return this.mustGet(vmId).qmp;
  }

  private emit(e: VmEvent): void {
    for (const l of this.listeners) l(e);
  }

  private setState(rec: VmRecord, to: VmState): void {
    const from = rec.info.state;
    if (from === to) return;
    if (!canTransition(from, to)) throw new InvalidVmStateError(rec.info.vmId, from, `become ${to}`);
    rec.info.state = to;
    this.emit({ type: 'state', vmId: rec.info.vmId, from, to });
  }

  private assertState(rec: VmRecord, want: VmState, op: string): void {
    if (rec.info.state === 'crashed') throw new VmCrashedError(rec.info.vmId, 'QEMU is gone');
    if (rec.info.state !== want) throw new InvalidVmStateError(rec.info.vmId, rec.info.state, op);
  }

  private mustGet(vmId: string): VmRecord {
    const r = this.vms.get(vmId);
    if (!r) throw new VmNotFoundError(vmId);
    return r;
  }

  private locked<T>(vmId: string, fn: (rec: VmRecord) => Promise<T>): Promise<T> {
    const rec = this.mustGet(vmId);
    return this.lockedRec(rec, () => fn(rec));
  }

  private lockedRec<T>(rec: VmRecord, fn: () => Promise<T>): Promise<T> {
    const run = rec.lock.then(fn, fn);
    rec.lock = run.catch(() => undefined);
    return run;
  }

  /** Writes vm.json; `state`: the one to record when it is not the VM's yet (pause). */
  private async persist(rec: VmRecord, state: VmState = rec.info.state): Promise<void> {
    const p: VmPersisted = {
      info: { ...rec.info, state }, image: rec.image, kernelArgs: rec.kernelArgs, memPath: rec.memPath, memShared: rec.memShared,
      diskPath: rec.diskPath, gen: rec.gen, dependsOn: rec.dependsOn, ...(rec.anonymousRam ? { anonymousRam: true } : {}), ...(rec.ramFile ? { ramFile: rec.ramFile } : {}),
      ...(rec.network ? { network: rec.network } : {}),
      ...(rec.launchDir ? { launchDir: rec.launchDir } : {}),
      ...(rec.switching ? { switching: rec.switching } : {}),
      ...(rec.unsealed ? { unsealed: rec.unsealed } : {}),
    };
    await writeJsonAtomic(join(rec.info.workdir, 'vm.json'), p);
  }
}

/**
 * A QEMU that did not start: the last lines of its log, or, when it wrote none (killed after its
 * QMP socket stayed silent past the wait, on a host too busy to start it in time), what the
 * wait met: the error said "QEMU did not start: " and nothing more.
 */
export function qemuDidNotStart(log: string, cause: unknown): VmmError {
  const tail = log.trim().split('\n').slice(-3).join(' | ');
  return new VmmError(`QEMU did not start: ${tail || `its log is empty; ${cause instanceof Error ? cause.message : String(cause)}`}`, { cause });
}

// -------------------------------------------------------------------- QMP helpers

export async function setCaps(qmp: QmpClient, caps: Record<string, boolean>): Promise<void> {
  await qmp.execute('migrate-set-capabilities', {
    capabilities: Object.entries(caps).map(([capability, state]) => ({ capability, state })),
  });
}

async function queryStatus(qmp: QmpClient): Promise<string> {
  const r = await qmp.execute<{ status: string }>('query-status');
  return r.status;
}

/**
 * How a migration stream between hosts (ADR 0015) is waited for: by its progress, not by a
 * fixed deadline. A stream takes as long as the VM's RAM needs (32 GiB at the 1-2.8 Gbit/s
 * measured here is 1.5-4.5 minutes), and the 120 s that bounds a migration on this host cut
 * every such stream, whose restore then fetched the snapshot after all.
 */
export interface StreamWait {
  /**
   * The source: how long after `migrate` the stream may move nothing because the destination
   * has not started reading it (its disk layer, its QEMU start: peer/migrate.ts's
   * MIGRATION_START_MS). The destination's own windows start later (its relay's wait for its
   * QEMU only once the source has connected), so a destination that never reads is failed
   * here, and the source's failed answer ends the destination's wait.
   */
  readonly startMs: number;
  /** The source: past `startMs`, the stream fails once it has sent nothing (query-migrate's ram.transferred) for this long. */
  readonly stallMs: number;
  /**
   * Either end: the stream fails after this long whatever it moves. The destination's QEMU
   * (7.2) tells no progress of an incoming migration (query-migrate: its status only), so the
   * destination's wait is this cap and the source's answer (a stalled stream fails there).
   */
  readonly maxMs: number;
  /** The source: how often it asks QEMU how far the stream is. */
  readonly pollMs: number;
}

/** The streams' limits (StreamWait): 30 min is 45 GB of RAM at 25 MB/s. */
export const MIGRATION_STREAM_WAIT: StreamWait = { startMs: 120_000, stallMs: 30_000, maxMs: 30 * 60_000, pollMs: 1_000 };

/**
 * Wait for a MIGRATION event with `status` (events seen since `sinceMark`, a QmpClient mark,
 * count), for `limit.timeoutMs` (default MIGRATION_TIMEOUT_MS); with `limit.stream`, an
 * outgoing stream, for as long as it moves (untilStalled), at most `stream.maxMs`.
 */
async function waitMigration(qmp: QmpClient, status: string, sinceMark: number, limit: { timeoutMs?: number; stream?: StreamWait } = {}): Promise<QmpEvent> {
  const ended = qmp.waitEvent(
    'MIGRATION',
    limit.stream?.maxMs ?? limit.timeoutMs ?? MIGRATION_TIMEOUT_MS,
    (e) => e.data.status === status || e.data.status === 'failed' || e.data.status === 'cancelled',
    sinceMark,
  );
  const ev = limit.stream ? await untilStalled(qmp, ended, limit.stream) : await ended;
  if (ev.data.status !== status) {
    const info = await qmp.execute<{ 'error-desc'?: string }>('query-migrate').catch(() => ({ 'error-desc': undefined }));
    throw new VmmError(`migration ${String(ev.data.status)}: ${info['error-desc'] ?? 'no detail'}`);
  }
  return ev;
}

/**
 * `cont` on a migration source. QEMU emits MIGRATION `completed` from the migration thread a
 * moment before the main loop leaves `finish-migrate`, and `cont` in that window fails with
 * "Migration is not finalized yet" (seen under heavy host load): retry it briefly.
 */
export async function contAfterMigration(qmp: QmpClient, deadlineMs = 5000): Promise<void> {
  const end = Date.now() + deadlineMs;
  for (;;) {
    try {
      await qmp.execute('cont');
      return;
    } catch (e) {
      if (!(e instanceof QmpCommandError) || !/not finalized/i.test(e.message) || Date.now() > end) throw e;
      await new Promise((r) => setTimeout(r, 2));
    }
  }
}

/** QEMU's migration URI for `t`. */
function migrationUri(t: MigrationTarget): string {
  if ('unixPath' in t) return `unix:${t.unixPath}`;
  return `tcp:${t.host.includes(':') ? `[${t.host}]` : t.host}:${t.port}`;
}

/**
 * `ended` (the wait for an outgoing migration's end on `qmp`), or a VmmError once the stream
 * has sent nothing for `w.stallMs`, and not before `w.startMs` from now: the destination may
 * take that long to start reading, while the stream waits in buffers.
 */
async function untilStalled<T>(qmp: QmpClient, ended: Promise<T>, w: StreamWait): Promise<T> {
  const t0 = Date.now();
  let sent = -1;
  let movedAt = t0;
  let timer: NodeJS.Timeout | undefined;
  let over = false;
  const stalled = new Promise<never>((_, reject) => {
    const check = async (): Promise<void> => {
      // A query that fails (QEMU busy, exiting) counts as no progress; the end's own wait sees QEMU go.
      const q = await qmp.execute<{ ram?: { transferred?: number } }>('query-migrate').catch(() => undefined);
      if (over) return;
      const now = Date.now();
      const n = q?.ram?.transferred;
      if (n !== undefined && n > sent) {
        sent = n;
        movedAt = now;
      }
      if (now >= Math.max(t0 + w.startMs, movedAt + w.stallMs)) {
        reject(new VmmError(`migration stalled: nothing sent for ${now - movedAt} ms (${Math.max(0, sent)} bytes in all)`));
        return;
      }
      timer = setTimeout(() => void check(), w.pollMs);
    };
    timer = setTimeout(() => void check(), w.pollMs);
  });
  // The loser is settled later (the wait for the event when QEMU goes): not an unhandled rejection.
  ended.catch(() => undefined);
  try {
    return await Promise.race([ended, stalled]);
  } finally {
    over = true;
    clearTimeout(timer);
  }
}

/** `migrate` to `uri` and wait for its end: for MIGRATION_TIMEOUT_MS, or with `stream` (a stream to another host) as long as it moves. */
export async function migrateAndWait(qmp: QmpClient, uri: string, stream?: StreamWait): Promise<void> {
  const mark = qmp.mark;
  await qmp.execute('migrate', { uri });
  await waitMigration(qmp, 'completed', mark, stream ? { stream } : {});
}

/**
 * The classic baseline's saved file: a clone of `snap` saved the ordinary way, with all of
 * RAM in the migration stream (what `virsh save` does). Returns the clone's launch
 * description, from which benchmarks restore copies of the file.
 */
export async function saveFullRamStream(driver: QemuVmmDriver, snap: LocalSnapshot, file: string): Promise<QemuLaunch> {
  await driver.fork(snap, [{ vmId: 'classic-src' }]);
  const q = driver.qmpOf('classic-src');
  await setCaps(q, { events: true, 'x-ignore-shared': false });
  // Through a socket the driver serves: QEMU may not spawn `exec:cat` (its seccomp sandbox).
  await migrateToFile(q, file, join(dirname(file), 'classic-save.sock'), true);
  const launch = driver.launchOf('classic-src');
  await driver.destroy('classic-src');
  return launch;
}

/** `p`, or a VmmError (`why`, with the signal's reason) as soon as `signal` aborts. */
async function untilAborted<T>(p: Promise<T>, signal: AbortSignal | undefined, why: string): Promise<T> {
  if (!signal) return p;
  let onAbort = (): void => undefined;
  const aborted = new Promise<never>((_, reject) => {
    onAbort = () => reject(new VmmError(`${why}: ${signal.reason instanceof Error ? signal.reason.message : String(signal.reason)}`));
    if (signal.aborted) onAbort();
    else signal.addEventListener('abort', onAbort, { once: true });
  });
  p.catch(() => undefined); // settled later, once the VM is destroyed
  try {
    return await Promise.race([p, aborted]);
  } finally {
    signal.removeEventListener('abort', onAbort);
  }
}

/** `migrate-incoming` from `uri` and wait for the load, at most `timeoutMs` (a stream from another host: MIGRATION_STREAM_WAIT.maxMs). */
export async function incomingAndWait(qmp: QmpClient, uri: string, timeoutMs = MIGRATION_TIMEOUT_MS): Promise<void> {
  const mark = qmp.mark;
  await qmp.execute('migrate-incoming', { uri });
  await waitMigration(qmp, 'completed', mark, { timeoutMs });
}

/**
 * Save a migration stream to `file` through a unix socket the agent serves. Cheaper than
 * `exec:cat > file`, which makes QEMU fork itself (tens of ms under a large mapping) inside
 * the pause window.
 */
export async function migrateToFile(qmp: QmpClient, file: string, sockPath: string, stopFirst = false): Promise<void> {
  await unlink(sockPath).catch(() => undefined);
  const server = net.createServer();
  const written = new Promise<void>((resolve, reject) => {
    server.once('connection', (conn) => {
      const out = createWriteStream(file);
      conn.pipe(out);
      out.once('finish', () => resolve());
      // A failed write (ENOSPC, EIO) ends the stream, so QEMU's migration fails at once
      // instead of blocking on a socket nobody reads.
      out.once('error', (e) => {
        conn.destroy();
        reject(e);
      });
      conn.once('error', reject);
    });
  });
  // Handled now: it may fail while the migration is still awaited (an unhandled rejection
  // would end the agent); the write error is what is thrown then.
  let writeError: unknown;
  written.catch((e: unknown) => (writeError = e));
  await new Promise<void>((resolve, reject) => server.listen(sockPath, resolve).once('error', reject));
  try {
    const mark = qmp.mark;
    const stopped = stopFirst ? qmp.execute('stop') : Promise.resolve();
    const started = qmp.execute('migrate', { uri: `unix:${sockPath}` });
    await Promise.all([stopped, started]);
    await waitMigration(qmp, 'completed', mark);
    await written;
  } catch (e) {
    throw writeError ?? e;
  } finally {
    server.close();
    await unlink(sockPath).catch(() => undefined);
  }
}

/**
 * Arm an incoming migration: QEMU listens on a unix socket. The returned function streams
 * `file` into it and resolves when QEMU has loaded it. Arming ahead keeps the QMP round trip
 * out of a pause window.
 */
export async function armIncoming(qmp: QmpClient, sockPath: string): Promise<(file: string) => Promise<void>> {
  await unlink(sockPath).catch(() => undefined);
  const mark = qmp.mark;
  await qmp.execute('migrate-incoming', { uri: `unix:${sockPath}` });
  return (file: string) => feedIncoming(qmp, sockPath, file, mark);
}

/** Streams `file` into the incoming migration QEMU listens for on `sockPath` (armIncoming) and waits for its load. */
async function feedIncoming(qmp: QmpClient, sockPath: string, file: string, mark: number): Promise<void> {
  const conn = net.createConnection(sockPath);
  conn.on('error', () => undefined);
  const state = createReadStream(file);
  // A read error (EIO) ends the stream, so the load fails at once; without a listener it
  // would be an uncaught exception that ends the agent.
  state.on('error', () => conn.destroy());
  state.pipe(conn);
  try {
    await waitMigration(qmp, 'completed', mark);
  } finally {
    conn.destroy();
    state.destroy();
    await unlink(sockPath).catch(() => undefined);
  }
}

/** Sets the nice value of every thread of `pid` (nice is per thread on Linux); twice, in case one was being created meanwhile. */
async function reniceProcess(pid: number, niceness: number): Promise<void> {
  for (let pass = 0; pass < 2; pass++) {
    for (const tid of await readdir(`/proc/${pid}/task`).catch(() => [] as string[])) {
      try {
        setPriority(Number(tid), niceness);
      } catch {
        // a thread that just ended
      }
    }
  }
}

/** Load a migration stream from `file` (see armIncoming). */
export async function incomingFromFile(qmp: QmpClient, file: string, sockPath: string): Promise<void> {
  await (await armIncoming(qmp, sockPath))(file);
}

/**
 * Whether a VM with this network policy may be made from a standby: a standby's namespace has
 * no egress link, so a VM that may have egress starts a QEMU of its own. The claim (restoreOne)
 * and the demands that keep standbys (forkNow, snapshot) ask this same question.
 */
function canUseStandby(network: NetworkPolicySpec | undefined): boolean {
  return !network?.allowEgress;
}

function validateId(field: string, id: string): void {
  if (!VM_ID.test(id)) throw new InvalidArgumentError(field, 'must match [A-Za-z0-9][A-Za-z0-9_.-]{0,47}');
}

/**
 * Refuses a snapshot whose disk layer was taken over another base disk than this host's copy
 * of its image (`image.disk`, this host's cache entry for the recipe hash): the recipe hash
 * names the recipe, not the bytes (the debian image's packages come from the mirror at build
 * time), and a layer over other bytes reads as a corrupt file system. The same error as an
 * image unknown here: this host cannot restore it. A manifest without a digest (taken before
 * digests were recorded) is not checked.
 */
async function assertSameBaseDisk(m: SnapshotManifest, image: GuestImage, where: string): Promise<void> {
  const want = m.image.diskSha256;
  if (!want) return;
  const here = await recordedDiskSha256(image.disk);
  const name = `${m.image.name}-${m.image.recipeHash}`;
  if (!here) throw new SnapshotNotFoundError(`${where} (image ${name} unknown here: no digest recorded for ${image.disk}; the snapshot's base disk has sha256 ${want})`);
  if (here !== want) throw new SnapshotNotFoundError(`${where} (image ${name} here is another build: its base disk has sha256 ${here}, the snapshot was taken over sha256 ${want})`);
}

/**
 * Makes a snapshot directory whose files are complete a snapshot: image.json, every file
 * read-only and fsynced, and last manifest.json, written durably (temp, fsync, rename,
 * fsync of the directory). manifest.json means "complete", also after an OS crash. The
 * fsync took 81-83 ms of a ~235 ms template snapshot and 116-126 ms of a ~1.7 s clone
 * snapshot here (256 MiB guest); publishing first and syncing in the background
 * (DeferredSync) measured the same totals (227-235 ms), so it is done inline.
 */
/** Whether the snapshot directory is sealed: its manifest, written last, is there. */
function isSealed(dir: string): Promise<boolean> {
  return stat(join(dir, 'manifest.json')).then(() => true, () => false);
}

/** Seals the snapshot unless it is sealed already (a seal that failed earlier, done now). */
async function ensureSealed(dir: string, image: GuestImage, manifest: SnapshotManifest): Promise<void> {
  if (!(await isSealed(dir))) await sealSnapshot(dir, image, manifest);
}

/**
 * In a snapshot directory whose files' fsync failed: it is never sealed (ADR 0007, "A failed
 * fsync is never retried"). Linux reports a writeback error to one fsync only, so a second
 * seal's fsync returned 0 and wrote manifest.json over a mem.img whose data never reached the
 * disk (the page cache serves it whole until it is evicted). Not made durable: after an OS
 * crash no QEMU runs from the directory, and recover() sweeps it (it has no manifest).
 */
const SEAL_FAILED = 'seal-failed';
/** Directories whose seal's fsync failed in this process (should writing SEAL_FAILED have failed too). */
const sealFailed = new Set<string>();

/**
 * Whether a seal of `dir` failed for good (its files' fsync failed). Such a directory stays
 * while its VM runs from it (its memory file, its disk layer's backing) and goes with the VM
 * (destroy) or, once no VM needs it, with recover()'s sweep of unsealed directories.
 */
async function sealFailedAt(dir: string): Promise<boolean> {
  return sealFailed.has(dir) || (await stat(join(dir, SEAL_FAILED)).then(() => true, () => false));
}

function snapshotNotDurable(id: string, cause?: unknown): VmmError {
  const why = cause === undefined ? '' : ` (${String((cause as Error).message ?? cause)})`;
  return new VmmError(
    `snapshot ${id}: the fsync of its files failed${why}: their data may never have reached the disk, so it is never sealed (a second fsync would pass without writing it); the VM that runs from it cannot be snapshotted again (destroy it)`,
    { cause, retryable: false },
  );
}

async function sealSnapshot(dir: string, image: GuestImage, manifest: SnapshotManifest): Promise<void> {
  if (await sealFailedAt(dir)) throw snapshotNotDurable(manifest.snapshotId);
  await writeJsonAtomic(join(dir, 'image.json'), image);
  const files = ['mem.img', 'state.bin', 'disk.qcow2', 'image.json'].map((f) => join(dir, f));
  for (const f of files) await chmod(f, 0o444);
  try {
    await fsyncAll(files);
  } catch (e) {
    // Opening a file for its fsync failed (EMFILE): nothing was written back, a later seal may
    // fsync them. Any other failure may have lost data: the directory is marked at once (a
    // kill before the mark would leave recover() a directory it seals).
    if (e instanceof FsyncOpenError) throw e;
    sealFailed.add(dir);
    try {
      writeFileSync(join(dir, SEAL_FAILED), `${String((e as Error).message ?? e)}\n`);
    } catch {
      // Refused in this process all the same (sealFailed); a later process would not know.
    }
    throw snapshotNotDurable(manifest.snapshotId, e);
  }
  await writeFileDurable(join(dir, 'manifest.json'), JSON.stringify(manifest, null, 2), 0o444);
}

async function writeJsonAtomic(path: string, value: unknown): Promise<void> {
  const tmp = `${path}.tmp`;
  await writeFile(tmp, JSON.stringify(value, null, 2));
  await rename(tmp, path);
}

/**
 * A paused VM whose last migration out completed (a snapshot of it, or an earlier attempt's)
 * stays in postmigrate, its disk images inactive: QEMU refuses to migrate it again ("paused due
 * to previous migration") and to commit its layers. Only cont makes them active: the guest runs
 * for the moment between cont and stop (as a failed snapshot's merge-back already does).
 */
async function activateIfMigratedOut(qmp: QmpClient): Promise<void> {
  if ((await queryStatus(qmp)) === 'postmigrate') await reactivate(qmp, true);
}

/**
 * Cancels what `busy` asks about with `cancel` if it is under way, and waits until it is not;
 * true if it was. Throws naming `what` if it is still under way after `timeoutMs`.
 */
async function cancelAndWait(busy: () => Promise<boolean>, cancel: () => Promise<unknown>, what: string, timeoutMs = 10_000): Promise<boolean> {
  if (!(await busy())) return false;
  await cancel();
  for (const end = Date.now() + timeoutMs; await busy(); ) {
    if (Date.now() > end) throw new VmmError(`${what} not cancelled after ${timeoutMs} ms`);
    await sleep(20);
  }
  return true;
}

/** Cancels block job `jobId` if it runs, and waits until it is gone. */
function cancelBlockJob(qmp: QmpClient, jobId: string): Promise<boolean> {
  const runs = async (): Promise<boolean> => (await qmp.execute<Array<{ device: string }>>('query-block-jobs')).some((j) => j.device === jobId);
  return cancelAndWait(runs, () => qmp.execute('block-job-cancel', { device: jobId, force: true }), `block job ${jobId}`);
}

/** Migration states in which a migration is over (query-migrate); absent when none ever ran. */
const MIGRATION_OVER = new Set(['none', 'completed', 'failed', 'cancelled']);

/** Cancels the VM's migration out if one is under way and waits until it is over; true if there was one. */
function cancelMigrationOut(qmp: QmpClient): Promise<boolean> {
  const underWay = async (): Promise<boolean> => !MIGRATION_OVER.has((await qmp.execute<{ status?: string }>('query-migrate')).status ?? 'none');
  return cancelAndWait(underWay, () => qmp.execute('migrate_cancel'), 'migration out');
}

/**
 * Makes a stopped VM's disk images writable again: QEMU inactivates them when a migration
 * completes, and only `cont` activates them (QEMU 7.2 has no command for it alone). The VM
 * is stopped again at once when it is to stay paused (it runs for one QMP round trip).
 */
async function reactivate(qmp: QmpClient, stayPaused: boolean): Promise<void> {
  await qmp.execute('migrate_cancel').catch(() => undefined);
  await contAfterMigration(qmp);
  if (stayPaused) await qmp.execute('stop');
}

/**
 * Merges the VM's active disk layer into the layer below it (`base`, by file name) and makes
 * that the active layer again: a live active block-commit, completed (the VM may run).
 */
async function commitActiveLayer(qmp: QmpClient, basePath: string, jobId: string): Promise<void> {
  const mark = qmp.mark;
  const block = (await qmp.execute<Array<{ device?: string; inserted?: { 'node-name'?: string; image?: ImageInfo } }>>('query-block')).find((b) => b.device === 'disk0')?.inserted;
  const topNode = block?.['node-name'];
  const base = await backingNameOf(block?.image, basePath);
  const ofJob = (e: QmpEvent): boolean => e.data.device === jobId || e.data.id === jobId;
  // An agent killed during this merge leaves the job running in QEMU: the next one takes it up.
  const running = (await qmp.execute<Array<{ device: string }>>('query-block-jobs')).some((j) => j.device === jobId);
  if (!running) await qmp.execute('block-commit', { 'job-id': jobId, device: 'disk0', base });
  // Ready once the overlay's data is in `base` (then writes go to both until completion).
  for (const end = Date.now() + 120_000; ; ) {
    const job = (await qmp.execute<Array<{ device: string; ready: boolean }>>('query-block-jobs')).find((j) => j.device === jobId);
    if (!job) {
      const ended = qmp.eventsSince(mark).find((e) => e.event === 'BLOCK_JOB_COMPLETED' && ofJob(e));
      throw new VmmError(`block-commit ${jobId} ended before it was ready: ${String(ended?.data.error ?? 'no detail')}`);
    }
    if (job.ready) break;
    if (Date.now() > end) throw new VmmError(`block-commit ${jobId} not ready after 120 s`);
    await new Promise((r) => setTimeout(r, 10));
  }
  await qmp.execute('block-job-complete', { device: jobId });
  const done = await qmp.waitEvent('BLOCK_JOB_COMPLETED', 120_000, ofJob, mark);
  if (done.data.error) throw new VmmError(`block-commit ${jobId} failed: ${String(done.data.error)}`);
  // An overlay added with blockdev-add stays a named node once out of the chain: closed here.
  if (topNode) await qmp.execute('blockdev-del', { 'node-name': topNode }).catch(() => undefined);
}

/**
 * The file of the top layer of the VM's disk (drive disk0) as QEMU reports it (query-block).
 * After blockdev-snapshot of an overlay added with its backing given at run time, QEMU names
 * the layer by a `json:{...}` descriptor: its `file.filename` is the file.
 */
/** query-block's image chain: each image and the one below it. */
interface ImageInfo {
  filename?: string;
  'backing-image'?: ImageInfo;
}

/**
 * The name QEMU knows the layer at `path` by in the backing chain below `image`: block-commit
 * finds its base by that name. A VM claimed from a standby opened its disk under the standby's
 * directory name (a symlink to its workdir now), not the workdir path the record keeps; the
 * record's path would not be found ("Can't find ... in the backing chain"). `path` itself
 * when no layer of the chain resolves to it.
 */
async function backingNameOf(image: ImageInfo | undefined, path: string): Promise<string> {
  const want = await realpath(path).catch(() => path);
  for (let i = image?.['backing-image']; i; i = i['backing-image']) {
    if (i.filename && !i.filename.startsWith('json:') && (await realpath(i.filename).catch(() => i.filename)) === want) return i.filename;
  }
  return path;
}

async function topDiskFile(qmp: QmpClient): Promise<string | undefined> {
  const blocks = await qmp.execute<Array<{ device?: string; inserted?: { file: string } }>>('query-block');
  const file = blocks.find((b) => b.device === 'disk0')?.inserted?.file;
  if (!file?.startsWith('json:')) return file;
  const desc = JSON.parse(file.slice('json:'.length)) as { file?: { filename?: string } };
  return desc.file?.filename;
}

/**
 * Capabilities a QEMU never needs (its network is slirp in a namespace the agent links; its
 * files are opened as root by path; the agent does cgroups, links and namespaces) and that a
 * guest that broke into QEMU could use against the host: reconfigure networks and firewalls
 * (its namespace's filter is what keeps an egress sandbox off the host's networks), mount,
 * load modules, trace or read other processes' memory, raw I/O. Dropped from the bounding set
 * before QEMU is exec'd, so QEMU's process has none of them and cannot get them back.
 */
export const QEMU_DROPPED_CAPS = ['net_admin', 'net_raw', 'sys_admin', 'sys_module', 'sys_ptrace', 'sys_rawio', 'sys_boot', 'sys_time', 'mknod', 'audit_control', 'mac_admin', 'mac_override', 'syslog'] as const;

export function withoutHostCaps(command: string, args: string[]): { command: string; args: string[] } {
  // --inh-caps too: an agent started with inheritable (or ambient) capabilities would hand them
  // to QEMU past the bounding set; clearing the inheritable set clears the ambient one.
  return { command: 'setpriv', args: ['--inh-caps=-all', '--bounding-set', QEMU_DROPPED_CAPS.map((c) => `-${c}`).join(','), '--', command, ...args] };
}
