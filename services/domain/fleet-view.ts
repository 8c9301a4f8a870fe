// What the scheduler knows about hosts between etcd reads: the last heartbeat of each
// host (held in memory by every replica) merged with the etcd records (cordon, drain,
// booked capacity). Liveness is derived from heartbeat age.
import type { HeartbeatMsg } from './messages.ts';
import type { HostAllocRec, HostRec, HostState, SnapshotRec } from './records.ts';
import type { FleetViewInput, HostInput, SnapshotInput } from '../../scheduler/index.ts';

export interface LivenessConfig {
  /** Heartbeats older than this make a host suspect. */
  suspectAfterMs: number;
  /** Heartbeats older than this make a host lost. */
  lostAfterMs: number;
}

export interface HeardHost {
  hb: HeartbeatMsg;
  /** Local receive time (ms). */
  heardAt: number;
}

export function livenessOf(heardAt: number | undefined, now: number, cfg: LivenessConfig): HostState {
  if (heardAt === undefined) return 'lost';
  const age = now - heardAt;
  if (age > cfg.lostAfterMs) return 'lost';
  if (age > cfg.suspectAfterMs) return 'suspect';
  return 'ready';
}

export class HeartbeatRegistry {
  private readonly hosts = new Map<string, HeardHost>();

  record(hb: HeartbeatMsg, now: number): { isNew: boolean; restarted: boolean } {
    const prev = this.hosts.get(hb.hostId);
    this.hosts.set(hb.hostId, { hb, heardAt: now });
    return { isNew: prev === undefined, restarted: prev !== undefined && prev.hb.bootId !== hb.bootId };
  }

  get(hostId: string): HeardHost | undefined {
    return this.hosts.get(hostId);
  }

  /** Drops a host's last heartbeat (a removed host that stays silent). */
  forget(hostId: string): void {
    this.hosts.delete(hostId);
  }

  all(): HeardHost[] {
    return [...this.hosts.values()];
  }

  /** Hosts whose snapshot list contains `snapshotId` as complete. */
  holders(snapshotId: string): string[] {
    const out: string[] = [];
    for (const h of this.hosts.values()) if (h.hb.snapshots.some((s) => s.snapshotId === snapshotId && s.complete)) out.push(h.hb.hostId);
    return out;
  }
}

/** Builds the placement library's input from etcd records plus heartbeats. */
export function fleetViewInput(args: {
  hosts: readonly HostRec[];
  allocs: ReadonlyMap<string, HostAllocRec>;
  heard: HeartbeatRegistry;
  snapshots: readonly SnapshotRec[];
  revision: number;
  now: number;
  liveness: LivenessConfig;
  /** Chunk size used by the snapshot store. */
  chunkBytes: number;
  /**
   * Host steps this scheduler has sent and not yet seen finish, per host. A host's queue is
   * the larger of this and its last heartbeat's count: the leader knows its own steps at
   * once, a heartbeat only up to a second later.
   */
  ownInflight?: ReadonlyMap<string, number>;
}): FleetViewInput {
  const hosts: HostInput[] = args.hosts.map((h) => {
    const heard = args.heard.get(h.id);
    const alloc = args.allocs.get(h.id);
    const state = h.state === 'lost' && heard === undefined ? 'lost' : livenessOf(heard?.heardAt, args.now, args.liveness);
    const held = new Set<string>();
    for (const s of heard?.hb.snapshots ?? []) if (s.complete) held.add(s.snapshotId);
    for (const s of args.snapshots) if (s.hostIds.includes(h.id)) held.add(s.id);
    return {
      id: h.id,
      state,
      cordoned: h.cordoned,
      draining: h.draining,
      capacity: h.capacity,
      allocated: alloc?.allocated ?? { vcpus: 0, memoryMib: 0, diskMib: 0 },
      inflightOps: Math.max(heard?.hb.inflightOps ?? 0, args.ownInflight?.get(h.id) ?? 0),
      // The host's measured restore time and its slots price its queue (scheduler/README.md).
      ...(heard && heard.hb.restoreCostMs > 0 && heard.hb.restoreSlots > 0 ? { restoreCostMs: heard.hb.restoreCostMs, restoreSlots: heard.hb.restoreSlots } : {}),
      link: { bandwidthBytesPerS: Math.max(1, h.linkBytesPerSecond), rxLoadBytesPerS: 0, txLoadBytesPerS: 0 },
      vmm: { qemuVersion: h.qemuVersion, machines: [h.machine], cpuModels: [h.cpuModel], accel: h.accel },
      heldSnapshots: [...held],
    };
  });
  const snapshots: SnapshotInput[] = args.snapshots
    .filter((s) => s.state === 'ready' && s.vmConfig !== null)
    .map((s) => {
      const vc = s.vmConfig!;
      return {
        id: s.id,
        totalBytes: Math.max(s.storedBytes, 1),
        chunkBytes: args.chunkBytes,
        vmConfig: { qemuVersion: vc.qemuVersion, machine: vc.machine, cpuModel: vc.cpuModel, accel: vc.accel, vcpus: vc.vcpus, memoryMib: vc.memoryMib },
      };
    });
  return { revision: args.revision, observedAtMs: args.now, hosts, snapshots };
}

