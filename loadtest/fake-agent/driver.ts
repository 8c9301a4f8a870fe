// A fake VmmDriver for scheduler tests and scale runs (DESIGN.md: "a fake host agent exists
// only for scheduler scale runs"). It implements the host agent's own port, so the real
// Agent (journal, idempotent steps, NATS protocol) runs unchanged on top of it.
//
// VMs are simulated: each one is a small JSON file under <dir>/vms/, written when the VM is
// "made", so a killed and restarted fake agent finds the VMs it had made (like the real
// driver adopting QEMU processes that outlived the agent). Latencies are configurable.
// With `persist: false` (FF_FAKE_STATE=memory, for runs that never restart an agent, such as
// bench:placement) VMs live in memory only: a fake host's file writes then cost nothing on
// the machine whose scheduler is being measured.
import { existsSync, mkdirSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { rename, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import type { CloneSpec, CreateVmSpec, ExecRequest, ExecResult, FileRange, FileWriteOptions, LocalSnapshot, RecoveryReport, SnapshotManifest, VmEvent, VmInfo, VmmDriver, Accel } from '../../host-agent/domain/vmm.ts';
import { ForkfleetError } from '../../proto/errors.ts';

export interface FakeLatencies {
  /** Boot of one VM from an image. */
  createMs: number;
  /** Per restored child (children of one step are made one after another). */
  restoreMsPerVm: number;
  snapshotMs: number;
  /** Fetching a snapshot this host does not hold. */
  fetchMs: number;
  destroyMs: number;
  /** A pause or a resume (default 0). */
  pauseMs?: number;
}

export const NO_LATENCY: FakeLatencies = { createMs: 0, restoreMsPerVm: 0, snapshotMs: 0, fetchMs: 0, destroyMs: 0 };

export const FAKE_QEMU_VERSION = '7.2.0-fake';

/** VMs whose hostname starts with this fail every snapshot (a fault for tests). */
export const FAIL_SNAPSHOT_HOSTNAME = 'fake-fail-snapshot';

/** VMs whose hostname starts with this fail to be created (a fault for tests). */
export const FAIL_CREATE_HOSTNAME = 'fake-fail-create';

/** VMs whose hostname starts with this fail their first create with a retryable error, and are made by the next (a fault for tests). */
export const FAIL_ONCE_HOSTNAME = 'fake-fail-once';

/** As FAIL_ONCE_HOSTNAME, with an error that is not retryable (the agent journals it). */
export const FAIL_ONCE_FINAL_HOSTNAME = 'fake-final-once';

const sleep = (ms: number): Promise<void> => (ms > 0 ? new Promise((r) => setTimeout(r, ms)) : Promise.resolve());

export class FakeVmmDriver implements VmmDriver {
  private readonly vms = new Map<string, VmInfo>();
  /** VMs of FAIL_ONCE_HOSTNAME whose first create failed. */
  private readonly failedOnce = new Set<string>();
  private readonly vmDir: string;
  private readonly snapDir: string;
  /**
   * The snapshots in snapDir with their manifests: read from disk once, then kept in step
   * with this driver's own writes and deletes (only this process changes its directory), so
   * a restore or a heartbeat does not read the directory again.
   */
  private readonly snaps = new Map<string, LocalSnapshot>();

  constructor(
    private readonly dir: string,
    private readonly latency: FakeLatencies,
    private readonly persist = true,
  ) {
    this.vmDir = join(dir, 'vms');
    this.snapDir = join(dir, 'snapshots');
    mkdirSync(this.vmDir, { recursive: true });
    mkdirSync(this.snapDir, { recursive: true });
    // Adopt what a previous run of this agent made.
    for (const f of readdirSync(this.vmDir)) {
      if (!f.endsWith('.json')) continue;
      const vm = JSON.parse(readFileSync(join(this.vmDir, f), 'utf8')) as VmInfo;
      this.vms.set(vm.vmId, vm);
    }
    for (const id of readdirSync(this.snapDir)) {
      const dir = join(this.snapDir, id);
      if (existsSync(join(dir, 'manifest.json'))) this.snaps.set(id, { dir, manifest: JSON.parse(readFileSync(join(dir, 'manifest.json'), 'utf8')) as SnapshotManifest });
    }
  }

  /** The snapshot this host holds, or undefined. */
  heldSnapshot(snapshotId: string): LocalSnapshot | undefined {
    return this.snaps.get(snapshotId);
  }

  /** Ids of the snapshots this host holds. */
  heldSnapshotIds(): string[] {
    return [...this.snaps.keys()];
  }

  get snapshotsDir(): string {
    return this.snapDir;
  }

  private save(vm: VmInfo): VmInfo {
    this.vms.set(vm.vmId, vm);
    if (this.persist) writeFileSync(join(this.vmDir, `${vm.vmId}.json`), JSON.stringify(vm));
    return vm;
  }

  /**
   * Like save, off the event loop: written through a temporary file and a rename, so a
   * reader (or a restart after a kill) never sees a half-written file.
   */
  private async saveAsync(vm: VmInfo): Promise<VmInfo> {
    this.vms.set(vm.vmId, vm);
    if (!this.persist) return vm;
    const p = join(this.vmDir, `${vm.vmId}.json`);
    await writeFile(`${p}.tmp`, JSON.stringify(vm));
    await rename(`${p}.tmp`, p);
    return vm;
  }

  private vm(vmId: string): VmInfo {
    const vm = this.vms.get(vmId);
    if (!vm || vm.state === 'destroyed') throw new ForkfleetError('not_found', `no VM ${vmId}`);
    return vm;
  }

  resolveAccel(): Promise<Accel> {
    return Promise.resolve('tcg');
  }

  async create(spec: CreateVmSpec): Promise<VmInfo> {
    await sleep(this.latency.createMs);
    if (spec.hostname?.startsWith(FAIL_CREATE_HOSTNAME)) throw new ForkfleetError('internal', `fake VM ${spec.vmId} cannot be created (hostname ${spec.hostname})`);
    const once = spec.hostname?.startsWith(FAIL_ONCE_HOSTNAME) ? 'unavailable' : spec.hostname?.startsWith(FAIL_ONCE_FINAL_HOSTNAME) ? 'internal' : undefined;
    if (once && !this.failedOnce.has(spec.vmId)) {
      this.failedOnce.add(spec.vmId);
      throw new ForkfleetError(once, `fake VM ${spec.vmId}: first create fails (hostname ${spec.hostname})`, { retryable: once === 'unavailable' });
    }
    return this.save({
      vmId: spec.vmId,
      state: 'running',
      accel: 'tcg',
      pid: process.pid,
      workdir: join(this.vmDir, spec.vmId),
      memoryMib: spec.memoryMib,
      vcpus: spec.vcpus,
      hostname: spec.hostname ?? spec.vmId,
      sandboxId: spec.sandboxId ?? spec.vmId,
      baseSnapshotId: null,
      readyMs: this.latency.createMs,
    });
  }

  exec(vmId: string, req: ExecRequest): Promise<ExecResult> {
    this.vm(vmId);
    const out = req.path === 'hostname' || req.args?.join(' ').includes('hostname') ? `${this.vm(vmId).hostname}\n` : '';
    return Promise.resolve({ exitCode: 0, signal: null, stdout: Buffer.from(out), stderr: Buffer.alloc(0) });
  }

  /** Guest files, per VM, in memory (not kept across a restart of the fake agent). */
  private readonly files = new Map<string, Map<string, { data: Buffer; mode: number }>>();

  readFile(vmId: string, path: string, range: FileRange = {}): Promise<Buffer> {
    this.vm(vmId);
    const f = this.files.get(vmId)?.get(path);
    if (!f) return Promise.reject(new ForkfleetError('not_found', `no such file in the guest: ${path}`));
    const from = range.offset ?? 0;
    return Promise.resolve(f.data.subarray(from, range.maxBytes ? from + range.maxBytes : undefined));
  }

  writeFile(vmId: string, path: string, data: Buffer, opts: FileWriteOptions = {}): Promise<void> {
    this.vm(vmId);
    const files = this.files.get(vmId) ?? new Map<string, { data: Buffer; mode: number }>();
    this.files.set(vmId, files);
    const before = files.get(path);
    files.set(path, { data: opts.append && before ? Buffer.concat([before.data, data]) : Buffer.from(data), mode: opts.mode || before?.mode || 0o600 });
    return Promise.resolve();
  }

  async pause(vmId: string): Promise<void> {
    await sleep(this.latency.pauseMs ?? 0);
    this.save({ ...this.vm(vmId), state: 'paused' });
  }

  async resume(vmId: string): Promise<void> {
    await sleep(this.latency.pauseMs ?? 0);
    this.save({ ...this.vm(vmId), state: 'running' });
  }

  async snapshot(vmId: string, snapshotId: string): Promise<LocalSnapshot> {
    const vm = this.vm(vmId);
    // A fault for tests of failed snapshots and hibernates: such a VM refuses every snapshot.
    if (vm.hostname?.startsWith(FAIL_SNAPSHOT_HOSTNAME)) throw new ForkfleetError('internal', `fake VM ${vmId} refuses snapshots (hostname ${vm.hostname})`);
    const dir = join(this.snapDir, snapshotId);
    const held = this.snaps.get(snapshotId);
    if (held) return held;
    await sleep(this.latency.snapshotMs);
    const manifest: SnapshotManifest = {
      schema: 1,
      snapshotId,
      parentSnapshotId: vm.baseSnapshotId,
      sourceVmId: vmId,
      createdAt: new Date().toISOString(),
      config: { machineType: 'microvm', memoryMib: vm.memoryMib, vcpus: vm.vcpus, devices: [], qemuVersion: FAKE_QEMU_VERSION, accel: 'tcg', cpuModel: 'max' },
      image: { name: 'fake', recipeHash: 'fake', kernelArgs: '' },
      files: { memory: 'mem.img', deviceState: 'state.bin', disk: 'disk.qcow2' },
      diskVirtualSize: 1024 * 1024 * 1024,
      method: 'shared-file',
      sourcePauseMs: 1,
    };
    mkdirSync(dir, { recursive: true });
    writeFileSync(join(dir, 'manifest.json'), JSON.stringify(manifest));
    const local = { dir, manifest };
    this.snaps.set(snapshotId, local);
    return local;
  }

  openSnapshot(dir: string): Promise<LocalSnapshot> {
    const held = [...this.snaps.values()].find((s) => s.dir === dir);
    return Promise.resolve(held ?? { dir, manifest: JSON.parse(readFileSync(join(dir, 'manifest.json'), 'utf8')) as SnapshotManifest });
  }

  /** Writes a snapshot this host received from a peer. */
  receiveSnapshot(manifest: SnapshotManifest): LocalSnapshot {
    const dir = join(this.snapDir, manifest.snapshotId);
    mkdirSync(dir, { recursive: true });
    writeFileSync(join(dir, 'manifest.json'), JSON.stringify(manifest));
    const local = { dir, manifest };
    this.snaps.set(manifest.snapshotId, local);
    return local;
  }

  async restore(snapshot: LocalSnapshot, child: CloneSpec): Promise<VmInfo> {
    const [vm] = await this.fork(snapshot, [child]);
    return vm!;
  }

  async fork(snapshot: LocalSnapshot, children: CloneSpec[]): Promise<VmInfo[]> {
    const out: VmInfo[] = [];
    // One after another, each saved as it is made: an agent killed mid-step keeps those made.
    for (const c of children) {
      await sleep(this.latency.restoreMsPerVm);
      out.push(
        await this.saveAsync({
          vmId: c.vmId,
          state: 'running',
          accel: 'tcg',
          pid: process.pid,
          workdir: join(this.vmDir, c.vmId),
          memoryMib: snapshot.manifest.config.memoryMib,
          vcpus: snapshot.manifest.config.vcpus,
          hostname: c.hostname ?? c.vmId,
          sandboxId: c.sandboxId ?? c.vmId,
          baseSnapshotId: snapshot.manifest.snapshotId,
          readyMs: this.latency.restoreMsPerVm,
        }),
      );
    }
    return out;
  }

  async destroy(vmId: string): Promise<void> {
    await sleep(this.latency.destroyMs);
    this.vms.delete(vmId);
    this.files.delete(vmId);
    if (this.persist) rmSync(join(this.vmDir, `${vmId}.json`), { force: true });
  }

  deleteSnapshot(snapshot: LocalSnapshot): Promise<void> {
    for (const [id, s] of this.snaps) if (s.dir === snapshot.dir) this.snaps.delete(id);
    rmSync(snapshot.dir, { recursive: true, force: true });
    return Promise.resolve();
  }

  /** Fake snapshots have no files that depend on each other. */
  snapshotsInUse(): Promise<Set<string>> {
    return Promise.resolve(new Set());
  }

  get(vmId: string): VmInfo | undefined {
    return this.vms.get(vmId);
  }

  list(): VmInfo[] {
    return [...this.vms.values()];
  }

  onEvent(_listener: (e: VmEvent) => void): () => void {
    return () => undefined;
  }

  recover(): Promise<RecoveryReport> {
    return Promise.resolve({ adopted: [...this.vms.keys()], reaped: [] });
  }

  close(): Promise<void> {
    return Promise.resolve();
  }
}

/** The VMs a fake agent's data directory holds (read by tests from outside the process). */
export function fakeVmsIn(dir: string): VmInfo[] {
  const vmDir = join(dir, 'vms');
  if (!existsSync(vmDir)) return [];
  return readdirSync(vmDir)
    .filter((f) => f.endsWith('.json'))
    .map((f) => JSON.parse(readFileSync(join(vmDir, f), 'utf8')) as VmInfo);
}
