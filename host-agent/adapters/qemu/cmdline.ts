// QEMU command lines for Forkfleet VMs (pure). One device set for every VM of a machine type,
// because a snapshot restores only into the same machine, memory size and devices
// (VMM-NOTES gotcha 5); fingerprint() is what the snapshot manifest records of it.
import type { Accel, VmConfigFingerprint } from '../../domain/vmm.ts';

/** The chardev of the guest's serial console (a ring in QEMU's memory). */
export const SERIAL_CHARDEV = 'serial0';
/** What the console ring keeps: the last 64 KiB the guest wrote (a power of two, as QEMU needs). */
export const SERIAL_RING_BYTES = 64 * 1024;

export const MACHINE_TYPE = 'microvm';
export const AGENT_PORT = 'org.qemu.guest_agent.0';
export const DEVICES: readonly string[] = [
  'isa-serial',
  'memory-backend-file:mem',
  'virtio-blk-device:qcow2',
  'virtio-rng-device',
  'virtio-serial-device',
  `virtserialport:${AGENT_PORT}`,
  'virtio-net-device:user',
];

/**
 * The guest NIC (issue #9, sandbox isolation): QEMU user networking (slirp), and the QEMU
 * process itself runs in a fresh, empty network namespace (QemuLaunch.netns, see
 * host-agent/adapters/netns). restrict=on unless the sandbox may have egress (then the agent
 * links its namespace out, with a firewall: adapters/netns/egress.ts). Slirp's state is part of
 * the migration stream, so every VM has the same NIC and a snapshot restores only where it had
 * one; restrict is not part of that state, so a clone's policy may differ from its parent's.
 */
export const GUEST_MAC = '52:54:00:12:34:56';

/**
 * QEMU's seccomp filter (what libvirt asks for by default): the guest runs an agent's untrusted
 * code, and a guest that breaks into QEMU must not start processes (`spawn`: the kernel kills
 * QEMU on fork or exec, so the driver never uses `exec:` migration URIs), change its user, or
 * change scheduling (`resourcecontrol`: the agent renices standbys from outside). It is applied
 * before the guest runs, so it holds for every VM the driver starts.
 */
export const SECCOMP_SANDBOX = 'on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny';

export function cpuModel(accel: Accel): string {
  return accel === 'kvm' ? 'host' : 'max';
}

export interface QemuLaunch {
  name: string;
  accel: Accel;
  memoryMib: number;
  vcpus: number;
  kernel: string;
  initrd: string;
  kernelArgs: string;
  /**
   * Guest RAM file: share=on for a VM booted from an image, share=off (a private copy-on-write
   * mapping that never writes back) for a clone. Not readonly=on: QEMU 7.2 would then map guest
   * RAM PROT_READ.
   */
  memPath: string;
  memShared: boolean;
  /**
   * Allocate every page of the memory file when QEMU starts (prealloc=on), before anything
   * is written into it.
   */
  preallocRam?: boolean;
  /** Anonymous RAM instead of the file (classic save/restore baseline in the benchmark). */
  anonymousRam?: boolean;
  /**
   * Guest RAM is this file on a huge-page tmpfs (ram-pool.ts), mapped share=on and 2 MiB
   * aligned so it maps in huge pages; before memPath and anonymousRam.
   */
  ramFile?: string;
  disk: string;
  qmpSocket: string;
  agentSocket: string;
  pidFile: string;
  /** Wait for `migrate-incoming` instead of booting. */
  incoming: boolean;
  /** Do not start vCPUs when ready (receivers that must never run the guest). */
  startPaused?: boolean;
  /** TCG translation-cache size in MiB (bounds per-VM memory under TCG). */
  tcgTbMib?: number;
  /** Run the process in a new, empty network namespace of its own (the driver always does). */
  netns?: 'new';
  /** slirp restrict=off: the agent links the namespace out (egress allowed by policy). */
  egress?: boolean;
  /** Start at this nice value (standbys: background work until claimed, then reniced to 0). */
  niceness?: number;
}

export function qemuArgs(l: QemuLaunch): string[] {
  const accelArg = l.accel === 'kvm' ? 'kvm' : `tcg,tb-size=${l.tcgTbMib ?? 64}`;
  const mem = [
    'memory-backend-file',
    'id=mem',
    `size=${l.memoryMib}M`,
    `mem-path=${l.memPath}`,
    l.memShared ? 'share=on' : 'share=off',
    ...(l.preallocRam ? ['prealloc=on'] : []),
  ].join(',');
  const ramObject = l.ramFile
    ? `memory-backend-file,id=mem,size=${l.memoryMib}M,mem-path=${l.ramFile},share=on,align=2M`
    : l.anonymousRam
      ? `memory-backend-ram,id=mem,size=${l.memoryMib}M`
      : mem;
  const args = [
    '-name', l.name,
    '-machine', `${MACHINE_TYPE},pit=on,pic=on,rtc=on,memory-backend=mem`,
    '-accel', accelArg,
    '-cpu', cpuModel(l.accel),
    '-m', `${l.memoryMib}M`,
    '-smp', String(l.vcpus),
    '-object', ramObject,
    '-nodefaults', '-no-user-config', '-nographic',
    // The guest's console (the kernel's, and whatever its root writes to ttyS0) goes to a ring
    // in QEMU's memory, read back over QMP when a guest stops answering: a file would grow
    // without bound on the host's data disk, shared by every tenant's sandboxes.
    '-chardev', `ringbuf,id=${SERIAL_CHARDEV},size=${SERIAL_RING_BYTES}`,
    '-serial', `chardev:${SERIAL_CHARDEV}`,
    '-kernel', l.kernel,
    '-initrd', l.initrd,
    '-append', l.kernelArgs,
    '-device', 'virtio-serial-device',
    '-chardev', `socket,id=qga0,path=${l.agentSocket},server=on,wait=off`,
    '-device', `virtserialport,chardev=qga0,name=${AGENT_PORT}`,
    '-drive', `if=none,id=disk0,file=${l.disk},format=qcow2,cache=writeback,discard=unmap`,
    '-device', 'virtio-blk-device,drive=disk0',
    '-device', 'virtio-rng-device',
    '-netdev', `user,id=net0,restrict=${l.egress ? 'off' : 'on'},ipv6=off`,
    '-device', `virtio-net-device,netdev=net0,mac=${GUEST_MAC}`,
    '-qmp', `unix:${l.qmpSocket},server=on,wait=off`,
    '-pidfile', l.pidFile,
    '-sandbox', SECCOMP_SANDBOX,
  ];
  if (l.incoming) args.push('-incoming', 'defer');
  if (l.startPaused) args.push('-S');
  return args;
}

export function fingerprint(accel: Accel, memoryMib: number, vcpus: number, qemuVersion: string): VmConfigFingerprint {
  return { machineType: MACHINE_TYPE, memoryMib, vcpus, devices: [...DEVICES], qemuVersion, accel, cpuModel: cpuModel(accel) };
}
