// Standbys (ADR 0014) are kept only for VMs that could claim one. A standby's network
// namespace has no egress link, so a clone that may have egress never claims one: a fork of
// such children, or a snapshot of a VM with egress (its clones inherit its policy), keeping
// standbys would hold slots of the host-wide max that no fork can use. No QEMU runs: the
// restores and the snapshot's copy are stood in for, and the pool's demand is recorded.
import { afterAll, describe, expect, it } from 'vitest';
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import type { CloneSpec, LocalSnapshot, NetworkPolicySpec, VmInfo } from '../../domain/vmm.ts';
import { QemuVmmDriver } from './driver.ts';
import { runningVmRecord } from './vm-record.fixture.ts';

const base = mkdtempSync(join(tmpdir(), 'ff-standby-demand-'));
afterAll(() => rmSync(base, { recursive: true, force: true }));

/** The driver's private parts the tests reach. */
interface Internals {
  vms: Map<string, unknown>;
  overlays: unknown;
  standbys: { demand(snapshot: LocalSnapshot, n: number): void };
  restoreOne(snapshot: LocalSnapshot, c: CloneSpec): Promise<VmInfo>;
  snapshotViaReceiver(rec: unknown, dir: string): Promise<{ pauseMs: number; parent: string | null }>;
}

const egress: NetworkPolicySpec = { allowEgress: true, allowCidrs: [] };
const noEgress: NetworkPolicySpec = { allowEgress: false, allowCidrs: [] };

let n = 0;
/** A driver whose restores and snapshot copies succeed without QEMU, and the standby demands it makes. */
function setup(): { root: string; driver: QemuVmmDriver; internals: Internals; demands: Array<[string, number]> } {
  const root = join(base, `agent-${++n}`);
  const driver = new QemuVmmDriver({ root, accel: 'tcg', logger: pino({ level: 'silent' }) });
  const internals = driver as unknown as Internals;
  const demands: Array<[string, number]> = [];
  internals.standbys.demand = (s, count) => void demands.push([s.manifest.snapshotId, count]);
  driver.assertCompatible = () => Promise.resolve();
  internals.restoreOne = (_s, c) => Promise.resolve({ vmId: c.vmId } as VmInfo);
  return { root, driver, internals, demands };
}

const snapshot = { dir: '/nowhere', manifest: { snapshotId: 'sn-1', image: {} } } as unknown as LocalSnapshot;

describe('standby demand', () => {
  it('fork_whoseChildrenAllMayReachTheNetwork_demandsNoStandby', async () => {
    const { driver, demands } = setup();
    await driver.fork(snapshot, [{ vmId: 'c1', network: egress }, { vmId: 'c2', network: egress }]);
    expect(demands).toEqual([]);
    await driver.close();
  });

  it('fork_ofChildrenWithoutEgress_demandsAStandbyForEachOfThemOnly', async () => {
    const { driver, demands } = setup();
    // A policy that allows no egress is no egress: such a child claims a standby.
    await driver.fork(snapshot, [{ vmId: 'c1' }, { vmId: 'c2', network: egress }, { vmId: 'c3', network: noEgress }]);
    expect(demands).toEqual([['sn-1', 2]]);
    await driver.close();
  });

  /** snapshot() of a running receiver-method VM with `network`, its copy stood in for. */
  async function snapshotOf(network: NetworkPolicySpec | undefined): Promise<Array<[string, number]>> {
    const { root, driver, internals, demands } = setup();
    internals.overlays = { create: () => Promise.resolve() }; // no qemu-img
    driver.qemuVersion = () => Promise.resolve('7.2.0');
    internals.snapshotViaReceiver = (_r, dir) => {
      for (const f of ['mem.img', 'state.bin', 'disk.qcow2']) writeFileSync(join(dir, f), f);
      return Promise.resolve({ pauseMs: 1, parent: null });
    };
    const workdir = join(root, 'vms', 'vm1');
    mkdirSync(workdir, { recursive: true });
    internals.vms.set('vm1', runningVmRecord(workdir, network ? { network } : {}));
    const snap = await driver.snapshot('vm1', 'sn-1');
    expect(snap.manifest.snapshotId).toBe('sn-1');
    internals.vms.delete('vm1'); // no QEMU to stop
    await driver.close();
    return demands;
  }

  it('snapshot_ofAVmThatMayReachTheNetwork_demandsNoStandby', async () => {
    expect(await snapshotOf(egress)).toEqual([]);
  });

  it('snapshot_ofAVmWithoutEgress_demandsAStandby', async () => {
    expect(await snapshotOf(undefined)).toEqual([['sn-1', 1]]);
  });
});
