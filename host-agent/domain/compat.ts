// Snapshot compatibility (VMM-NOTES gotcha 5): a restore needs the same machine type, memory
// size, vCPUs, device set, QEMU version, accelerator and CPU model. Pure; returns every field
// that differs so the refusal can say exactly what to fix.
import type { CompatDifference } from '../errors.ts';
import type { VmConfigFingerprint } from './vmm.ts';
import { qemuSeries } from '../../scheduler/feasibility.ts';

/** QEMU migration streams are compared at major.minor (7.2.x restores 7.2.y): placement's rule too, so it places no restore here that this refuses. */
export { qemuSeries };

export function diffFingerprint(snapshot: VmConfigFingerprint, host: VmConfigFingerprint): CompatDifference[] {
  const out: CompatDifference[] = [];
  const scalar = (field: keyof VmConfigFingerprint, a: string | number, b: string | number): void => {
    if (a !== b) out.push({ field, snapshot: a, host: b });
  };
  scalar('machineType', snapshot.machineType, host.machineType);
  scalar('memoryMib', snapshot.memoryMib, host.memoryMib);
  scalar('vcpus', snapshot.vcpus, host.vcpus);
  scalar('qemuVersion', qemuSeries(snapshot.qemuVersion), qemuSeries(host.qemuVersion));
  scalar('accel', snapshot.accel, host.accel);
  scalar('cpuModel', snapshot.cpuModel, host.cpuModel);
  const a = [...snapshot.devices].sort().join(',');
  const b = [...host.devices].sort().join(',');
  if (a !== b) out.push({ field: 'devices', snapshot: a, host: b });
  return out;
}
