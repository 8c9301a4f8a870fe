// The VmmDriver port: what the host agent's domain needs from a virtual machine monitor.
// The QEMU adapter (adapters/qemu) implements it; a fake can implement it for scale runs.
// Everything here is plain data so it can cross process and wire boundaries unchanged.

import type { Socket } from 'node:net';

export type Accel = 'kvm' | 'tcg';
export type AccelSetting = Accel | 'auto';

/** Where a guest image's boot artefacts are on this host (see deploy/images/build.ts). */
export interface GuestImage {
  name: string;
  /** Hash of the recipe the image was built from. */
  recipeHash: string;
  kernel: string;
  initrd: string;
  /** Base disk (qcow2) every VM of this image overlays; never written. */
  disk: string;
  diskVirtualSize: number;
  /**
   * sha256 (hex) of the base disk file as built (deploy/images/meta.ts). Builds are
   * reproducible, but a host's build of the same recipe can still differ (the debian image's
   * mirror): snapshots record it and restore only over a base disk with the same digest.
   * Absent for images built before it was recorded.
   */
  diskSha256?: string;
  kernelArgs: string;
  readyMarker: string;
}

/**
 * A sandbox's network policy (proto NetworkPolicy). Every VM has a NIC in a network namespace
 * of its own; without allowEgress nothing outside the VM is reachable. With it, only
 * allowCidrs (empty: any address) and never the host's own namespace or the driver's deny list.
 */
export interface NetworkPolicySpec {
  allowEgress: boolean;
  allowCidrs: string[];
}

export interface CreateVmSpec {
  vmId: string;
  image: GuestImage;
  memoryMib: number;
  vcpus: number;
  hostname?: string;
  sandboxId?: string;
  /** Default: no egress. */
  network?: NetworkPolicySpec;
}

export interface CloneSpec {
  vmId: string;
  hostname?: string;
  sandboxId?: string;
  /** Default: no egress (a clone does not inherit its parent's policy). */
  network?: NetworkPolicySpec;
}

/**
 * Lifecycle of one VM as the driver sees it. Invariant: exactly the states in LIVE_VM_STATES
 * own a QEMU process; `crashed` and `destroyed` own none (a crashed VM's workdir is kept for
 * inspection until destroy).
 */
export type VmState = 'starting' | 'running' | 'paused' | 'snapshotting' | 'crashed' | 'destroying' | 'destroyed';

export interface VmInfo {
  vmId: string;
  state: VmState;
  accel: Accel;
  pid: number;
  workdir: string;
  memoryMib: number;
  vcpus: number;
  hostname: string;
  sandboxId: string;
  /** Snapshot whose memory image this VM maps privately; null for a VM booted from an image. */
  baseSnapshotId: string | null;
  /** Milliseconds from the first action to "answers an exec". */
  readyMs: number;
}

export interface ExecRequest {
  path: string;
  args?: string[];
  /** NAME=VALUE entries added to the guest's environment (its PATH, HOME stay unless named). */
  env?: string[];
  /**
   * The guest directory to run in; one it cannot enter fails the exec, naming the field `cwd`
   * (with captureOutput off there is no stderr to tell why: the shell's exit 2, as before).
   */
  cwd?: string;
  stdin?: Buffer;
  timeoutMs?: number;
  /** Collect stdout/stderr (default true). Off saves the guest two pipes when only the exit status matters. */
  captureOutput?: boolean;
  /**
   * Output as it comes: a program still running after a moment has what it wrote so far
   * passed here while it runs, and the rest when it exits. With it, ExecResult's stdout and
   * stderr are empty: every byte went here, in order per stream.
   */
  onOutput?: (stream: 'stdout' | 'stderr', data: Buffer) => void;
  /** Aborting kills the program and everything it started, as at its timeout; the result then says `cancelled`. */
  signal?: AbortSignal;
  /**
   * The most of each stream read from the guest and returned (or passed to onOutput); past it
   * the result says outputTruncated. Default and ceiling: 64 MiB. A caller that keeps a line
   * of a failure (an after_resume hook) spares the guest and the agent the rest.
   */
  maxOutputBytes?: number;
}

export interface FileRange {
  offset?: number;
  maxBytes?: number;
}

export interface FileWriteOptions {
  append?: boolean;
  /** Permission bits set after the write; 0 or absent leaves the guest's default. */
  mode?: number;
}

export interface ExecResult {
  /** -1 when a signal ended the program (or it never started: `cancelled`). */
  exitCode: number;
  /** The signal that ended the program (a wrapped program's exit 128+N reads as signal N too: GuestAgentClient.exec). */
  signal: number | null;
  stdout: Buffer;
  stderr: Buffer;
  /** The command ran past timeoutMs and was killed; stdout and stderr hold what it wrote until then. */
  timedOut?: boolean;
  /** ExecRequest.signal aborted first and the command was killed; stdout and stderr hold what it wrote until then. */
  cancelled?: boolean;
  /** stdout or stderr had more than an exec returns (guest/client.ts EXEC_MAX_OUTPUT_BYTES, or qemu-ga's own 16 MiB without the wrapper): what followed is missing. */
  outputTruncated?: boolean;
}

/**
 * Everything a host must match to restore a snapshot (VMM-NOTES gotcha 5). Plain JSON.
 * Device strings are normalised QEMU device descriptions, sorted.
 */
export interface VmConfigFingerprint {
  machineType: string;
  memoryMib: number;
  vcpus: number;
  devices: string[];
  qemuVersion: string;
  accel: Accel;
  cpuModel: string;
}

export interface SnapshotManifest {
  schema: 1;
  snapshotId: string;
  parentSnapshotId: string | null;
  sourceVmId: string;
  createdAt: string;
  config: VmConfigFingerprint;
  /**
   * The image the snapshot's disk layer overlays. diskSha256 (GuestImage.diskSha256) is absent
   * in manifests from before it was recorded; those are restored without the check.
   */
  image: { name: string; recipeHash: string; kernelArgs: string; diskSha256?: string };
  files: {
    /** Full guest RAM image; clones map it with share=off. Relative to the snapshot dir. */
    memory: string;
    /** Device state stream (migration with x-ignore-shared). */
    deviceState: string;
    /** Frozen qcow2 layer; its backing chain ends at the image's base disk. */
    disk: string;
  };
  diskVirtualSize: number;
  /** How the memory image was produced: the source's own share=on file, or a full-RAM receiver. */
  method: 'shared-file' | 'receiver';
  /** How long the source VM's vCPUs were stopped, from QEMU's STOP to RESUME events. */
  sourcePauseMs: number;
  /**
   * Guest-agent execs were running in the source when it was copied: their programs are in
   * the snapshot, and a VM restored from it ends them before it is handed out (no caller
   * polls them there, nor enforces their timeouts). Absent: none (or a manifest from before).
   */
  guestExecsRunning?: true;
}

export interface LocalSnapshot {
  dir: string;
  manifest: SnapshotManifest;
}

/** What the source of a restore by migration reports (ADR 0015). */
export interface MigrateOutReport {
  /** Migration stream bytes sent. */
  bytes: number;
  ms: number;
}

/**
 * Where a migration stream goes or comes from (ADR 0015): a TCP connection the VMM reads or
 * writes itself (plain text, or QEMU's own TLS), or a unix socket on this host whose other
 * end is a TLS relay (peer/tls-relay.ts): the VMM connects to it (source) or listens on it
 * (destination).
 */
export type MigrationTarget = { readonly host: string; readonly port: number } | { readonly unixPath: string };
export type MigrationStream = Socket | { readonly unixPath: string };

/** A snapshot this host does not hold, as a restore by migration needs it (ADR 0015). */
export interface IncomingSource {
  /** The VMM adapter's manifest of the snapshot (from the signed manifest's metadata). */
  manifest: SnapshotManifest;
  /** This host's copy of the image the snapshot was taken from. */
  image: GuestImage;
  /** Writes the snapshot's disk layer (qcow2) at `path`, verified. */
  writeDiskLayer(path: string): Promise<void>;
  /** The backing file name the layer's header holds (rebased onto `image.disk` when it differs). */
  diskLayerBacking: string;
}

/** A VM waiting for its migration stream (ADR 0015). */
export interface IncomingVm {
  readonly vmId: string;
  /**
   * Loads the stream arriving on `conn` (an accepted connection this process must not have
   * read from; it is handed to the VMM and closed here), or on a unix socket the VMM listens
   * on at `conn.unixPath` (a TLS relay connects to it). Resolves when the VM is restored,
   * clean and answering exec. On failure the VM is destroyed. `sourceGone` aborting (the source
   * reported its end of the stream failed) fails it at once: a stream that never began to
   * load, such as a TLS handshake that failed, would otherwise be waited for until a timeout.
   */
  load(conn: MigrationStream, sourceGone?: AbortSignal): Promise<VmInfo>;
  abort(): Promise<void>;
}

export type VmEvent =
  | { type: 'state'; vmId: string; from: VmState; to: VmState }
  | { type: 'crashed'; vmId: string; pid: number; detail: string };

export interface PauseOptions {
  /**
   * Asked once the driver holds the VM (after a snapshot or other operation on it queued
   * ahead), with the VM as it is then, before anything is recorded or sent: an error it returns
   * fails the pause. The idle rule's pause judges idleness here, not before a wait.
   */
  refuse?: (vm: VmInfo) => Error | undefined;
}

export interface RecoveryReport {
  adopted: string[];
  reaped: string[];
}

export interface VmmDriver {
  /** The accelerator VMs are started with; for `auto`, decided once by a probe boot. */
  resolveAccel(): Promise<Accel>;
  create(spec: CreateVmSpec): Promise<VmInfo>;
  exec(vmId: string, req: ExecRequest): Promise<ExecResult>;
  /** The file's bytes from `range.offset`, at most `range.maxBytes` (0 or absent: to the end). */
  readFile(vmId: string, path: string, range?: FileRange): Promise<Buffer>;
  /** Replaces the file with `data` (or appends it), then sets `mode` when given. */
  writeFile(vmId: string, path: string, data: Buffer, opts?: FileWriteOptions): Promise<void>;
  pause(vmId: string, opts?: PauseOptions): Promise<void>;
  resume(vmId: string): Promise<void>;
  /** Immutable snapshot; the source keeps running afterwards. */
  snapshot(vmId: string, snapshotId: string): Promise<LocalSnapshot>;
  openSnapshot(dir: string): Promise<LocalSnapshot>;
  /** One restored VM, clean (reseeded, clock set, own identity) and answering exec. */
  restore(snapshot: LocalSnapshot, child: CloneSpec): Promise<VmInfo>;
  /** N copy-on-write children of one snapshot on this host. */
  fork(snapshot: LocalSnapshot, children: CloneSpec[]): Promise<VmInfo[]>;
  destroy(vmId: string): Promise<void>;
  deleteSnapshot(snapshot: LocalSnapshot): Promise<void>;
  /**
   * Optional (drivers with standby processes, ADR 0014): stop the snapshot's standbys and make
   * no more, e.g. before a snapshot fetched from a peer is deleted.
   */
  dropStandbys?(snapshotId: string): Promise<void>;
  /**
   * Optional (ADR 0015): restore on another host by migration. The source migrates a paused
   * clone's whole RAM and device state to `target` (the destination's listener); the
   * destination prepares a VM that loads that stream. `signal` aborts a stream whose
   * destination gave up.
   */
  migrateOut?(snapshot: LocalSnapshot, target: MigrationTarget, signal?: AbortSignal): Promise<MigrateOutReport>;
  prepareIncoming?(src: IncomingSource, child: CloneSpec): Promise<IncomingVm>;
  /**
   * Snapshots whose files something on this host still needs: a VM maps its memory image or
   * stands on its disk layer, or a local snapshot's disk layer is backed by it. Their
   * files must stay even after the snapshot is deleted.
   */
  snapshotsInUse(): Promise<Set<string>>;
  /**
   * Whether a VM here maps the snapshot's memory image or stands on its disk layer, now
   * (synchronous: a GC asks it last, in the turn it removes the files; snapshotsInUse's answer
   * may be older than a VM restored since).
   */
  vmsUse?(snapshotId: string): boolean;
  get(vmId: string): VmInfo | undefined;
  list(): VmInfo[];
  onEvent(listener: (e: VmEvent) => void): () => void;
  /** After an agent restart: adopt VMs whose QEMU still runs, reap leftovers of the rest. */
  recover(mode: 'adopt' | 'reap'): Promise<RecoveryReport>;
  /** Destroy every VM this driver knows (shutdown). */
  close(): Promise<void>;
}

export interface Clock {
  now(): number;
}

export const systemClock: Clock = { now: () => Date.now() };
