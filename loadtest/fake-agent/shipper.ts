// A fake SnapshotShipper for the fake host agent: snapshots are "held" when the fake driver
// holds their manifest (a file in its directory, also kept in memory). A host that lacks a snapshot refuses to
// restore it unless the step names sources, a ticket and a manifest signature, exactly as
// the real shipper does (host-agent/adapters/shipper.ts), then "fetches" it after a delay.
import { create, toBinary } from '@bufbuild/protobuf';
import type { SnapshotShipper } from '../../host-agent/domain/agent.ts';
import type { LocalSnapshot } from '../../host-agent/domain/vmm.ts';
import type { FetchSnapshotWork, HeldSnapshot } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { HeldSnapshotSchema } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { SignedManifestSchema, SnapshotManifestSchema } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import type { SignedManifest } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { Accel } from '../../proto/gen/forkfleet/v1/common_pb.ts';
import { ForkfleetError } from '../../proto/errors.ts';
import type { FakeLatencies, FakeVmmDriver } from './driver.ts';
import { FAKE_QEMU_VERSION } from './driver.ts';

/** Logical size reported for every fake snapshot (drives the scheduler's transfer estimates). */
export const FAKE_SNAPSHOT_BYTES = 64 * 1024 * 1024;

export class FakeShipper implements SnapshotShipper {
  constructor(
    private readonly driver: FakeVmmDriver,
    private readonly hostId: string,
    private readonly latency: FakeLatencies,
  ) {}

  ingest(local: LocalSnapshot): Promise<SignedManifest> {
    const c = local.manifest.config;
    const m = create(SnapshotManifestSchema, {
      snapshotId: local.manifest.snapshotId,
      parentSnapshotId: local.manifest.parentSnapshotId ?? '',
      sourceSandboxId: local.manifest.sourceVmId,
      vmConfig: { machine: c.machineType, memoryMib: BigInt(c.memoryMib), vcpus: c.vcpus, devices: c.devices, qemuVersion: c.qemuVersion, accel: c.accel === 'kvm' ? Accel.KVM : Accel.TCG, cpuModel: c.cpuModel, image: local.manifest.image.name },
      chunkSize: 256 * 1024,
      artifacts: [{ name: 'memory', size: BigInt(FAKE_SNAPSHOT_BYTES), chunks: [{ storedSize: FAKE_SNAPSHOT_BYTES / 2 }] }],
    });
    return Promise.resolve(create(SignedManifestSchema, { manifest: toBinary(SnapshotManifestSchema, m) }));
  }

  async obtain(snapshotId: string, fetch: FetchSnapshotWork | undefined, onProgress: (done: number, total: number) => void): Promise<{ local: LocalSnapshot; bytesFetched: number }> {
    const held = this.driver.heldSnapshot(snapshotId);
    if (held) return { local: held, bytesFetched: 0 };
    if (!fetch || fetch.sources.length === 0) throw new ForkfleetError('not_found', `snapshot ${snapshotId} is not on host ${this.hostId} and no source was named`);
    if (!fetch.ticket) throw new ForkfleetError('invalid_argument', 'fetch.ticket: missing', { field: 'fetch.ticket' });
    if (!fetch.manifest || fetch.manifest.signature.length === 0) throw new ForkfleetError('invalid_argument', 'fetch.manifest: missing signature', { field: 'fetch.manifest' });
    if (this.latency.fetchMs > 0) await new Promise((r) => setTimeout(r, this.latency.fetchMs));
    onProgress(FAKE_SNAPSHOT_BYTES, FAKE_SNAPSHOT_BYTES);
    const local = this.driver.receiveSnapshot({
      schema: 1,
      snapshotId,
      parentSnapshotId: null,
      sourceVmId: '',
      createdAt: new Date().toISOString(),
      config: { machineType: 'microvm', memoryMib: 256, vcpus: 1, devices: [], qemuVersion: FAKE_QEMU_VERSION, accel: 'tcg', cpuModel: 'max' },
      image: { name: 'fake', recipeHash: 'fake', kernelArgs: '' },
      files: { memory: 'mem.img', deviceState: 'state.bin', disk: 'disk.qcow2' },
      diskVirtualSize: 1024 * 1024 * 1024,
      method: 'shared-file',
      sourcePauseMs: 0,
    });
    return { local, bytesFetched: FAKE_SNAPSHOT_BYTES };
  }

  held(): HeldSnapshot[] {
    return this.driver.heldSnapshotIds().map((id) => create(HeldSnapshotSchema, { snapshotId: id, complete: true, bytesPresent: BigInt(FAKE_SNAPSHOT_BYTES) }));
  }

  async remove(snapshotId: string): Promise<void> {
    const held = this.driver.heldSnapshot(snapshotId);
    if (held) await this.driver.deleteSnapshot(held);
  }

  /** A fake host stores no chunks: nothing to collect. */
  async collectGarbage(): Promise<void> {}

  storedBytes(): number {
    return 0;
  }
}
