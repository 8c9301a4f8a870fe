// Fleet state as Prometheus gauges, for capacity planning and alerts (a host suspect or lost,
// memory booked against capacity per host). Only the leader reports values (its caches are
// the ones kept current); other replicas expose the metrics without samples, so `max` or
// `sum` over replicas gives the fleet's figure.
import { Gauge } from 'prom-client';
import type { Registry } from 'prom-client';
import type { FleetGauges, HostGauges, TenantGauges } from './domain/fleet-gauges.ts';

const HOST_STATES = ['ready', 'suspect', 'lost'] as const;

/**
 * Registers the gauges on `registry`; `source` is asked at most once a second (scrapes in
 * between share its answer) and once more whenever `term` changes: a figure computed while
 * leading is not served after leadership ended, nor one of an earlier term in a later one.
 * `term`: a value that changes when leadership is won or lost (the scheduler's term count).
 */
export function registerFleetGauges(registry: Registry, source: () => FleetGauges | undefined, term: () => unknown = () => undefined): void {
  let cached: { at: number; term: unknown; value: FleetGauges | undefined } | undefined;
  const current = (): FleetGauges | undefined => {
    const now = Date.now();
    const t = term();
    if (!cached || now - cached.at >= 1000 || cached.term !== t) cached = { at: now, term: t, value: source() };
    return cached.value;
  };
  const gauge = <L extends string>(name: string, help: string, labelNames: readonly L[], fill: (g: Gauge<L>, s: FleetGauges) => void): void => {
    new Gauge<L>({
      name,
      help,
      labelNames,
      registers: [registry],
      collect() {
        this.reset();
        const s = current();
        if (s) fill(this, s);
        // reset() leaves a gauge without labels at 0: a standby's 0 would read as the fleet's figure.
        else if (labelNames.length === 0) this.remove();
      },
    });
  };
  const perHost = (name: string, help: string, value: (h: HostGauges) => number | undefined): void =>
    gauge(name, help, ['host'], (g, s) => {
      for (const [host, h] of s.hosts) {
        const v = value(h);
        if (v !== undefined) g.set({ host }, v);
      }
    });

  gauge('forkfleet_hosts', 'Hosts by state (ready, suspect: heartbeats late, lost), as ListHosts shows them.', ['state'], (g, s) => {
    for (const state of HOST_STATES) g.set({ state }, [...s.hosts.values()].filter((h) => h.state === state).length);
  });
  gauge('forkfleet_hosts_cordoned', 'Hosts that take no new sandboxes (cordoned, drained or being drained).', [], (g, s) => g.set([...s.hosts.values()].filter((h) => h.cordoned).length));
  gauge('forkfleet_hosts_draining', 'Hosts a drain is at work on.', [], (g, s) => g.set([...s.hosts.values()].filter((h) => h.draining).length));
  perHost('forkfleet_host_vcpus_capacity', 'vCPUs a host offers to sandboxes.', (h) => h.capacity.vcpus);
  perHost('forkfleet_host_vcpus_allocated', 'vCPUs booked on a host by placed sandboxes.', (h) => h.allocated.vcpus);
  perHost('forkfleet_host_memory_capacity_bytes', 'Memory a host offers to sandboxes.', (h) => h.capacity.memoryBytes);
  perHost('forkfleet_host_memory_allocated_bytes', 'Memory booked on a host by placed sandboxes (fork children on a host that held their snapshot: its memory image once plus their private pages).', (h) => h.allocated.memoryBytes);
  perHost('forkfleet_host_memory_used_bytes', "Memory a host's sandboxes use, from its last heartbeat.", (h) => h.memoryUsedBytes);
  perHost('forkfleet_host_disk_capacity_bytes', 'Disk a host offers to sandboxes.', (h) => h.capacity.diskBytes);
  perHost('forkfleet_host_disk_allocated_bytes', 'Disk booked on a host by placed sandboxes.', (h) => h.allocated.diskBytes);
  perHost('forkfleet_host_chunk_store_bytes', "Bytes in a host's snapshot chunk store, from its last heartbeat.", (h) => h.chunkStoreBytes);
  perHost('forkfleet_host_image_cache_bytes', "Bytes the snapshot images materialised on a host take beside its chunks (allocated), from its last heartbeat.", (h) => h.imageCacheBytes);
  perHost('forkfleet_host_sandboxes', 'Sandboxes booked on a host.', (h) => h.sandboxes);
  gauge('forkfleet_sandboxes', 'Sandbox records by state (destroyed and failed ones until FF_RECORD_RETENTION deletes them).', ['state'], (g, s) => {
    for (const [state, n] of s.sandboxes ?? []) g.set({ state }, n);
  });
  gauge('forkfleet_snapshots', 'Snapshot records by state.', ['state'], (g, s) => {
    for (const [state, n] of s.snapshots) g.set({ state }, n);
  });
  const perTenant = (name: string, help: string, value: (t: TenantGauges) => number): void =>
    gauge(name, help, ['tenant'], (g, s) => {
      for (const [tenant, t] of s.tenants ?? []) g.set({ tenant }, value(t));
    });
  gauge('forkfleet_tenant_sandboxes', "A tenant's sandbox records by state (destroyed and failed ones until FF_RECORD_RETENTION deletes them).", ['tenant', 'state'], (g, s) => {
    for (const [tenant, t] of s.tenants ?? []) for (const [state, n] of t.sandboxes) g.set({ tenant, state }, n);
  });
  perTenant('forkfleet_tenant_vcpus_booked', "vCPUs booked by a tenant's sandboxes that hold capacity or are waking (a hibernated one books none).", (t) => t.vcpus);
  perTenant('forkfleet_tenant_memory_booked_bytes', "Memory booked by a tenant's sandboxes that hold capacity or are waking (a hibernated one books none).", (t) => t.memoryBytes);
  perTenant('forkfleet_tenant_snapshot_stored_bytes', "A tenant's ready snapshots' stored sizes, summed (hibernation snapshots included).", (t) => t.snapshotStoredBytes);
  gauge('forkfleet_snapshot_stored_bytes', "Ready snapshots' stored (compressed) sizes, summed; a chunk shared between snapshots counts in each, so the hosts' chunk stores hold less.", [], (g, s) => g.set(s.snapshotStoredBytes));
}
