import { describe, expect, it } from 'vitest';
import { qemuArgs, SERIAL_CHARDEV, SERIAL_RING_BYTES, type QemuLaunch } from './cmdline.ts';

const launch: QemuLaunch = {
  name: 'ff-a', accel: 'tcg', memoryMib: 256, vcpus: 1, kernel: '/k', initrd: '/i', kernelArgs: 'console=ttyS0',
  memPath: '/s/mem.img', memShared: false, disk: '/v/disk.qcow2', qmpSocket: '/v/q', agentSocket: '/v/g',
  pidFile: '/v/pid', incoming: true,
};

describe('qemuArgs', () => {
  it('args_whenClone_mapsImagePrivately', () => {
    const a = qemuArgs(launch);
    expect(a[a.indexOf('-object') + 1]).toBe('memory-backend-file,id=mem,size=256M,mem-path=/s/mem.img,share=off');
    expect(a.slice(-2)).toEqual(['-incoming', 'defer']);
  });
  it('args_whenTemplateOnKvm_sharesFileAndUsesHostCpu', () => {
    const a = qemuArgs({ ...launch, memShared: true, accel: 'kvm', incoming: false });
    expect(a).toContain('memory-backend-file,id=mem,size=256M,mem-path=/s/mem.img,share=on');
    expect(a[a.indexOf('-cpu') + 1]).toBe('host');
    expect(a[a.indexOf('-accel') + 1]).toBe('kvm');
    expect(a).not.toContain('-incoming');
  });
  it('args_whenPreallocAsked_allocatesTheWholeMemoryFileAtStart', () => {
    const a = qemuArgs({ ...launch, memShared: true, preallocRam: true });
    expect(a[a.indexOf('-object') + 1]).toBe('memory-backend-file,id=mem,size=256M,mem-path=/s/mem.img,share=on,prealloc=on');
  });
  it('args_whenRamFileGiven_mapsItSharedAndHugePageAligned_beforeAnonymousRam', () => {
    const a = qemuArgs({ ...launch, anonymousRam: true, ramFile: '/r/vm-a.ram' });
    expect(a[a.indexOf('-object') + 1]).toBe('memory-backend-file,id=mem,size=256M,mem-path=/r/vm-a.ram,share=on,align=2M');
    expect(qemuArgs({ ...launch, anonymousRam: true })[a.indexOf('-object') + 1]).toBe('memory-backend-ram,id=mem,size=256M');
  });
});

describe('qemuArgs: the guest NIC', () => {
  it('args_guestConsole_goesToABoundedRingInQemu_neverToAFileOnTheHost', () => {
    const a = qemuArgs(launch);
    expect(a[a.indexOf('-serial') + 1]).toBe(`chardev:${SERIAL_CHARDEV}`);
    expect(a).toContain(`ringbuf,id=${SERIAL_CHARDEV},size=${SERIAL_RING_BYTES}`);
    expect(a.some((x) => x.startsWith('file:'))).toBe(false);
  });

  it('args_whenNoEgress_userNetworkingIsRestricted', () => {
    const a = qemuArgs(launch);
    expect(a[a.indexOf('-netdev') + 1]).toBe('user,id=net0,restrict=on,ipv6=off');
    expect(a).toContain('virtio-net-device,netdev=net0,mac=52:54:00:12:34:56');
  });
  it('args_whenEgressAllowed_userNetworkingIsUnrestrictedWithTheSameDevice', () => {
    const a = qemuArgs({ ...launch, egress: true });
    expect(a[a.indexOf('-netdev') + 1]).toBe('user,id=net0,restrict=off,ipv6=off');
    expect(a).toContain('virtio-net-device,netdev=net0,mac=52:54:00:12:34:56');
  });
});

describe('qemuArgs: the seccomp sandbox', () => {
  it('args_everyVm_runsUnderSeccomp_thatDeniesSpawningPrivilegeAndSchedulingChanges', () => {
    for (const l of [launch, { ...launch, incoming: false, memShared: true }, { ...launch, accel: 'kvm' as const, egress: true }]) {
      const a = qemuArgs(l);
      const opts = (a[a.indexOf('-sandbox') + 1] ?? '').split(',');
      expect(opts[0]).toBe('on');
      expect(opts).toEqual(expect.arrayContaining(['spawn=deny', 'elevateprivileges=deny', 'resourcecontrol=deny', 'obsolete=deny']));
    }
  });
});
