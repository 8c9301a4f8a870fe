// The fleet's state as numbers for Prometheus (scheduler.ts registers them): hosts by
// liveness, each host's capacity, booking and measured use, sandboxes and snapshots by state.
// Pure: the leader's caches in, numbers out. Capacity planning reads these: booked against
// capacity per host, and what the hosts report using. Per tenant, what each holds now (booked
// vCPUs and memory, stored snapshot bytes): integrated over time, they are what to charge a
// tenant for, and they show that a hibernated sandbox books no CPU or memory, only storage.
import type { HostAllocRec, HostRec, SandboxRec, SnapshotRec } from './records.ts';
import { HOLDS_CAPACITY } from './records.ts';
import type { HeartbeatRegistry, LivenessConfig } from './fleet-view.ts';
import { livenessOf } from './fleet-view.ts';

const MIB = 1024 * 1024;

export interface HostGauges {
  state: HostRec['state'];
  cordoned: boolean;
  draining: boolean;
  capacity: { vcpus: number; memoryBytes: number; diskBytes: number };
  allocated: { vcpus: number; memoryBytes: number; diskBytes: number };
  sandboxes: number;
  /** From the host's last heartbeat; undefined when this replica has not heard it. */
  memoryUsedBytes: number | undefined;
  chunkStoreBytes: number | undefined;
  imageCacheBytes: number | undefined;
}

/** What one tenant holds now. */
export interface TenantGauges {
  /** Sandboxes by state (destroyed and failed ones until history retention deletes them). */
  sandboxes: Map<string, number>;
  /** vCPUs and memory booked by its sandboxes that hold capacity (starting, running, paused, hibernating, destroying). */
  vcpus: number;
  memoryBytes: number;
  /** Stored bytes of its ready snapshots (hibernation snapshots included). */
  snapshotStoredBytes: number;
}

export interface FleetGauges {
  hosts: Map<string, HostGauges>;
  /** Sandbox records by state (destroyed and failed ones until history retention deletes them); undefined until the leader's index has loaded. */
  sandboxes: Map<string, number> | undefined;
  snapshots: Map<string, number>;
  /** Stored (compressed, deduplicated within the snapshot) bytes of ready snapshots. */
  snapshotStoredBytes: number;
  /** By tenant; undefined until the leader's sandbox index has loaded. */
  tenants: Map<string, TenantGauges> | undefined;
}

export interface FleetGaugeInput {
  hosts: Iterable<HostRec>;
  allocs: ReadonlyMap<string, HostAllocRec>;
  heard: Pick<HeartbeatRegistry, 'get'>;
  now: number;
  liveness: LivenessConfig;
  sandboxes: Iterable<SandboxRec> | undefined;
  snapshots: Iterable<SnapshotRec>;
}

const bytes = (r: { vcpus: number; memoryMib: number; diskMib: number } | undefined): HostGauges['capacity'] => ({ vcpus: r?.vcpus ?? 0, memoryBytes: (r?.memoryMib ?? 0) * MIB, diskBytes: (r?.diskMib ?? 0) * MIB });

/**
 * Sandbox states whose capacity a tenant's booked gauges count: those that hold a VM, and a
 * waking one, booked on its host from its placement (milliseconds after the wake claims it)
 * through its restore, which takes seconds: left out, a fleet waking sandboxes showed their
 * tenant's booking drop and come back.
 */
const BOOKED: ReadonlySet<SandboxRec['state']> = new Set([...HOLDS_CAPACITY, 'waking']);

/** The gauges of the fleet `i` describes. A host's state is as ListHosts shows it: from its heartbeats when heard, else its record's. */
export function fleetGauges(i: FleetGaugeInput): FleetGauges {
  const hosts = new Map<string, HostGauges>();
  for (const h of i.hosts) {
    const heard = i.heard.get(h.id);
    const alloc = i.allocs.get(h.id);
    hosts.set(h.id, {
      state: heard ? livenessOf(heard.heardAt, i.now, i.liveness) : h.state,
      cordoned: h.cordoned,
      draining: h.draining,
      capacity: bytes(h.capacity),
      allocated: bytes(alloc?.allocated),
      sandboxes: alloc?.sandboxes ?? 0,
      memoryUsedBytes: heard ? Number(heard.hb.memoryUsedBytes) : undefined,
      chunkStoreBytes: heard ? Number(heard.hb.chunkStoreBytes) : undefined,
      imageCacheBytes: heard ? Number(heard.hb.imageCacheBytes) : undefined,
    });
  }
  let sandboxes: Map<string, number> | undefined;
  let tenants: Map<string, TenantGauges> | undefined;
  const tenant = (id: string): TenantGauges => {
    let t = tenants!.get(id);
    if (!t) tenants!.set(id, (t = { sandboxes: new Map(), vcpus: 0, memoryBytes: 0, snapshotStoredBytes: 0 }));
    return t;
  };
  if (i.sandboxes) {
    sandboxes = new Map();
    tenants = new Map();
    for (const s of i.sandboxes) {
      sandboxes.set(s.state, (sandboxes.get(s.state) ?? 0) + 1);
      const t = tenant(s.tenantId);
      t.sandboxes.set(s.state, (t.sandboxes.get(s.state) ?? 0) + 1);
      if (BOOKED.has(s.state)) {
        t.vcpus += s.resources.vcpus;
        t.memoryBytes += s.resources.memoryMib * MIB;
      }
    }
  }
  const snapshots = new Map<string, number>();
  let snapshotStoredBytes = 0;
  for (const s of i.snapshots) {
    snapshots.set(s.state, (snapshots.get(s.state) ?? 0) + 1);
    if (s.state !== 'ready') continue;
    snapshotStoredBytes += s.storedBytes;
    if (tenants) tenant(s.tenantId).snapshotStoredBytes += s.storedBytes;
  }
  return { hosts, sandboxes, snapshots, snapshotStoredBytes, tenants };
}
