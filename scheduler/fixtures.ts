// Builders for tests and benchmarks (not used by place()). Defaults describe a healthy
// KVM host and a 256 MiB, 2-vCPU snapshot so tests state only what matters to them.
import type { ForkRequest, HostInput, HostVmm, SnapshotInput } from './types.ts';

export const GIB = 1024 * 1024 * 1024;
export const MIB = 1024 * 1024;

export const KVM_82: HostVmm = { qemuVersion: '8.2.2', machines: ['pc-q35-8.2', 'microvm'], cpuModels: ['host', 'Skylake-Server-v4'], accel: 'kvm' };

export function hostInput(id: string, over: Partial<HostInput> = {}): HostInput {
  return {
    id,
    state: 'ready',
    cordoned: false,
    draining: false,
    capacity: { vcpus: 32, memoryMib: 65536, diskMib: 500_000 },
    allocated: { vcpus: 0, memoryMib: 0, diskMib: 0 },
    inflightOps: 0,
    link: { bandwidthBytesPerS: 1.25e9, rxLoadBytesPerS: 0, txLoadBytesPerS: 0 },
    vmm: KVM_82,
    heldSnapshots: [],
    ...over,
  };
}

export function snapshotInput(id = 'snap-a', over: Partial<SnapshotInput> = {}): SnapshotInput {
  return {
    id,
    totalBytes: 1 * GIB,
    chunkBytes: 4 * MIB,
    vmConfig: { qemuVersion: '8.2.0', machine: 'pc-q35-8.2', cpuModel: 'host', accel: 'kvm', vcpus: 2, memoryMib: 256 },
    ...over,
  };
}

export function forkRequest(count: number, over: Partial<ForkRequest> = {}): ForkRequest {
  return { kind: 'fork', id: `op-fork-${count}`, nowMs: 1_700_000_000_000, snapshotId: 'snap-a', count, overlayDiskMib: 512, ...over };
}
