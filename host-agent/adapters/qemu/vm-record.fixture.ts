// A VM's record as QemuVmmDriver keeps it (its private VmRecord), for unit tests that drive the
// driver without QEMU: a running VM of the tiny image in `workdir`, generation 1, its memory
// and disk there, a QMP that is open and answers nothing. `over` replaces or adds fields.
import { join } from 'node:path';
import pino from 'pino';
import type { QemuVmmDriver } from './driver.ts';

export interface FakeVmRecord {
  info: { vmId: string; state: string; workdir: string; accel: string; memoryMib: number; vcpus: number };
  [k: string]: unknown;
}

export function runningVmRecord(workdir: string, over: Record<string, unknown> = {}): FakeVmRecord {
  return {
    info: { vmId: 'vm1', state: 'running', workdir, accel: 'tcg', memoryMib: 128, vcpus: 1 },
    image: { name: 'tiny', disk: '/x', recipeHash: '0123456789abcdef', diskVirtualSize: 64 << 20 },
    kernelArgs: '',
    memShared: false,
    memPath: join(workdir, 'mem.1.img'),
    diskPath: join(workdir, 'disk.1.qcow2'),
    gen: 1,
    dependsOn: [],
    qmp: { closed: false },
    agent: undefined,
    expectExit: false,
    log: pino({ level: 'silent' }),
    lock: Promise.resolve(),
    ...over,
  };
}

/** Closes a driver that holds the fake `vm1` (runningVmRecord): the record goes first, as there is no QEMU to stop. */
export async function closeWithoutVm(driver: QemuVmmDriver): Promise<void> {
  (driver as unknown as { vms: Map<string, unknown> }).vms.delete('vm1');
  await driver.close();
}
