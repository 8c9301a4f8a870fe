import { describe, expect, it } from 'vitest';
import { diffFingerprint, qemuSeries } from './compat.ts';
import { canTransition } from './lifecycle.ts';
import type { VmConfigFingerprint } from './vmm.ts';

const base: VmConfigFingerprint = {
  machineType: 'microvm',
  memoryMib: 256,
  vcpus: 1,
  devices: ['virtio-blk-device', 'virtio-rng-device'],
  qemuVersion: '7.2.22',
  accel: 'tcg',
  cpuModel: 'max',
};

describe('diffFingerprint', () => {
  it('diff_whenIdenticalOrPatchLevelDiffers_reportsNothing', () => {
    expect(diffFingerprint(base, { ...base, qemuVersion: '7.2.9', devices: [...base.devices].reverse() })).toEqual([]);
  });
  it('diff_whenSeveralFieldsDiffer_namesEachWithBothValues', () => {
    const d = diffFingerprint(base, { ...base, memoryMib: 512, accel: 'kvm', qemuVersion: '8.2.1', devices: ['virtio-blk-device'] });
    expect(d.map((x) => x.field)).toEqual(['memoryMib', 'qemuVersion', 'accel', 'devices']);
    expect(d[0]).toEqual({ field: 'memoryMib', snapshot: 256, host: 512 });
  });
  it('qemuSeries_keepsMajorMinor', () => {
    expect(qemuSeries('7.2.22')).toBe('7.2');
  });
});

describe('lifecycle', () => {
  it('transition_fromDestroyed_allowsNothing', () => {
    expect(canTransition('destroyed', 'running')).toBe(false);
    expect(canTransition('running', 'snapshotting')).toBe(true);
    expect(canTransition('crashed', 'running')).toBe(false);
  });
});
