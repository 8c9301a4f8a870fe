// Deterministic simulated fleets for benchmarks and what-if runs (xoshiro seeded by a fixed
// string): varied capacity and usage, ~5% of hosts hold each snapshot, a few are suspect,
// lost, cordoned or draining, 10/25 Gb/s links with some load, 3% on an older QEMU.
import { rngForRequest, type Rng } from '../rng.ts';
import { buildFleetView } from '../view.ts';
import { GIB, KVM_82, MIB } from '../fixtures.ts';
import type { FleetView, HostInput, HostVmm, SnapshotInput } from '../types.ts';

export const SNAPSHOTS: SnapshotInput[] = ['snap-a', 'snap-b', 'snap-c'].map((id, i) => ({
  id,
  totalBytes: (1 + i) * GIB,
  chunkBytes: 4 * MIB,
  vmConfig: { qemuVersion: '8.2.0', machine: 'pc-q35-8.2', cpuModel: 'host', accel: 'kvm', vcpus: 2, memoryMib: 256 * (1 + i) },
}));

const OLD_QEMU: HostVmm = { qemuVersion: '8.1.5', machines: ['pc-q35-8.1'], cpuModels: ['host'], accel: 'kvm' };

export function pick<T>(rng: Rng, xs: readonly T[]): T {
  return xs[rng.nextInt(xs.length)] as T;
}

/** Deterministic simulated fleet of n hosts. */
export function generateFleet(n: number): FleetView {
  const rng = rngForRequest(`bench-fleet-${n}`);
  const hosts: HostInput[] = [];
  for (let i = 0; i < n; i++) {
    const vcpus = pick(rng, [32, 64, 96, 128]);
    const memoryMib = vcpus * pick(rng, [2048, 4096, 8192]);
    const diskMib = pick(rng, [500_000, 1_000_000, 2_000_000]);
    const used = rng.nextFloat() * 0.95;
    const bw = pick(rng, [1.25e9, 3.125e9]);
    const held = SNAPSHOTS.filter(() => rng.nextFloat() < 0.05).map((s) => s.id);
    const r = rng.nextFloat();
    hosts.push({
      id: `host-${String(i).padStart(5, '0')}`,
      state: r < 0.01 ? 'suspect' : r < 0.015 ? 'lost' : 'ready',
      cordoned: rng.nextFloat() < 0.01,
      draining: rng.nextFloat() < 0.01,
      capacity: { vcpus, memoryMib, diskMib },
      allocated: { vcpus: Math.floor(vcpus * used), memoryMib: Math.floor(memoryMib * used), diskMib: Math.floor(diskMib * used * 0.5) },
      inflightOps: rng.nextInt(6),
      link: { bandwidthBytesPerS: bw, rxLoadBytesPerS: bw * rng.nextFloat() * 0.5, txLoadBytesPerS: bw * rng.nextFloat() * 0.5 },
      vmm: rng.nextFloat() < 0.03 ? OLD_QEMU : KVM_82,
      heldSnapshots: held,
      partialSnapshots: rng.nextFloat() < 0.02 ? { 'snap-a': Math.floor(rng.nextFloat() * GIB) } : undefined,
      residentImages: held.filter(() => rng.nextFloat() < 0.5),
      restoreCostMs: 100 + rng.nextInt(100),
    });
  }
  return buildFleetView({ revision: 1, observedAtMs: 0, hosts, snapshots: SNAPSHOTS });
}

