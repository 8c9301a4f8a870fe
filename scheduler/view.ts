// Builds the indexed, immutable FleetView that place() reads. This is the only O(hosts)
// step, done once per etcd read; decisions on large fleets then touch only the snapshot's
// holders plus a sample (see place.ts).
import { InvalidArgumentError } from '../proto/errors.ts';
import type { FleetView, FleetViewInput, HostColumns, HostInput, HostView, HostVmm, SnapshotView, VmConfig } from './types.ts';

/** The profile hosts share (images apart: builds differ per host, and vmmCheck looks at them per host). */
function vmmKey(v: HostVmm): string {
  return `${v.accel}|${v.qemuVersion}|${[...v.machines].sort().join(',')}|${[...v.cpuModels].sort().join(',')}`;
}

function checkResources(field: string, r: HostInput['capacity']): void {
  for (const k of ['vcpus', 'memoryMib', 'diskMib'] as const) {
    if (!Number.isFinite(r[k]) || r[k] < 0) throw new InvalidArgumentError(`${field}.${k}`, `must be a finite number >= 0, got ${r[k]}`);
  }
}

/** The field of a snapshot's VM configuration that buildFleetView refuses, if any. */
export function vmConfigFault(vm: Pick<VmConfig, 'vcpus' | 'memoryMib'>): 'vcpus' | 'memoryMib' | undefined {
  if (!(Number.isInteger(vm.vcpus) && vm.vcpus >= 1)) return 'vcpus';
  if (!(Number.isFinite(vm.memoryMib) && vm.memoryMib > 0)) return 'memoryMib';
  return undefined;
}

/**
 * Validates the plain input and builds the indexes. Throws InvalidArgumentError (field
 * named) on duplicate ids or impossible numbers; unknown snapshot ids in a host's holdings
 * are kept (the manifest may simply not be in this read).
 */
export function buildFleetView(input: FleetViewInput): FleetView {
  const hostIndexById = new Map<string, number>();
  const profiles: HostVmm[] = [];
  const profileByKey = new Map<string, number>();
  const holders = new Map<string, number[]>();
  const partialHolders = new Map<string, Map<number, number>>();
  const snapshots = new Map<string, SnapshotView>();
  const residentHosts = new Map<string, Map<number, number>>();
  const n = input.hosts.length;
  const f64 = (): Float64Array => new Float64Array(n);
  const cols: HostColumns = {
    state: new Uint8Array(n),
    cordoned: new Uint8Array(n),
    draining: new Uint8Array(n),
    vmmProfile: new Int32Array(n),
    capVcpus: f64(),
    capMemoryMib: f64(),
    capDiskMib: f64(),
    allocVcpus: f64(),
    allocMemoryMib: f64(),
    allocDiskMib: f64(),
    inflightOps: f64(),
    restoreCostMs: f64(),
    queuePerOpMs: f64(),
    downlink: f64(),
    uplink: f64(),
  };

  for (const s of input.snapshots) {
    if (snapshots.has(s.id)) throw new InvalidArgumentError('snapshots.id', `duplicate snapshot ${s.id}`);
    if (!(s.totalBytes >= 0) || !(s.chunkBytes > 0)) throw new InvalidArgumentError(`snapshots[${s.id}]`, 'totalBytes must be >= 0 and chunkBytes > 0');
    // What every child of it takes: NaN memory passes every `< 1` room check, 0 vCPUs fit without end.
    const bad = vmConfigFault(s.vmConfig);
    if (bad) throw new InvalidArgumentError(`snapshots[${s.id}].vmConfig.${bad}`, `must be ${bad === 'vcpus' ? 'an integer >= 1' : 'a finite number > 0'}, got ${s.vmConfig[bad]}`);
    snapshots.set(s.id, s);
  }

  const hosts: HostView[] = input.hosts.map((h, index) => {
    if (hostIndexById.has(h.id)) throw new InvalidArgumentError('hosts.id', `duplicate host ${h.id}`);
    hostIndexById.set(h.id, index);
    checkResources(`hosts[${h.id}].capacity`, h.capacity);
    checkResources(`hosts[${h.id}].allocated`, h.allocated);
    if (h.restoreSlots !== undefined && !(Number.isInteger(h.restoreSlots) && h.restoreSlots >= 1)) {
      throw new InvalidArgumentError(`hosts[${h.id}].restoreSlots`, `must be an integer >= 1, got ${h.restoreSlots}`);
    }
    if (!(Number.isFinite(h.inflightOps) && h.inflightOps >= 0)) throw new InvalidArgumentError(`hosts[${h.id}].inflightOps`, `must be a finite number >= 0, got ${h.inflightOps}`);
    if (h.restoreCostMs !== undefined && !(Number.isFinite(h.restoreCostMs) && h.restoreCostMs >= 0)) {
      throw new InvalidArgumentError(`hosts[${h.id}].restoreCostMs`, `must be a finite number >= 0, got ${h.restoreCostMs}`);
    }
    // A NaN here would pass every `<= 0` check and price hosts NaN, which no comparison orders.
    for (const f of ['bandwidthBytesPerS', 'rxLoadBytesPerS', 'txLoadBytesPerS'] as const) {
      if (!(Number.isFinite(h.link[f]) && h.link[f] >= 0)) throw new InvalidArgumentError(`hosts[${h.id}].link.${f}`, `must be a finite number >= 0, got ${h.link[f]}`);
    }
    const key = vmmKey(h.vmm);
    let vmmProfile = profileByKey.get(key);
    if (vmmProfile === undefined) {
      vmmProfile = profiles.length;
      profiles.push(h.vmm);
      profileByKey.set(key, vmmProfile);
    }
    const full = new Set(h.heldSnapshots);
    for (const sid of full) {
      let list = holders.get(sid);
      if (list === undefined) holders.set(sid, (list = []));
      list.push(index);
    }
    for (const [sid, bytes] of Object.entries(h.partialSnapshots ?? {})) {
      if (full.has(sid) || !(bytes > 0)) continue;
      let m = partialHolders.get(sid);
      if (m === undefined) partialHolders.set(sid, (m = new Map()));
      m.set(index, bytes);
    }
    const shares = (sid: string): Map<number, number> => {
      let m = residentHosts.get(sid);
      if (m === undefined) residentHosts.set(sid, (m = new Map()));
      return m;
    };
    for (const [sid, n] of Object.entries(h.imageShares ?? {})) if (Number.isInteger(n) && n > 0) shares(sid).set(index, n);
    for (const sid of h.residentImages ?? []) shares(sid).set(index, Number.POSITIVE_INFINITY);
    cols.state[index] = h.state === 'ready' ? 0 : h.state === 'suspect' ? 1 : 2;
    cols.cordoned[index] = h.cordoned ? 1 : 0;
    cols.draining[index] = h.draining ? 1 : 0;
    cols.vmmProfile[index] = vmmProfile;
    cols.capVcpus[index] = h.capacity.vcpus;
    cols.capMemoryMib[index] = h.capacity.memoryMib;
    cols.capDiskMib[index] = h.capacity.diskMib;
    cols.allocVcpus[index] = h.allocated.vcpus;
    cols.allocMemoryMib[index] = h.allocated.memoryMib;
    cols.allocDiskMib[index] = h.allocated.diskMib;
    cols.inflightOps[index] = h.inflightOps;
    cols.restoreCostMs[index] = h.restoreCostMs ?? Number.NaN;
    cols.queuePerOpMs[index] = h.restoreCostMs !== undefined && h.restoreSlots !== undefined ? h.restoreCostMs / h.restoreSlots : Number.NaN;
    cols.downlink[index] = h.link.bandwidthBytesPerS - h.link.rxLoadBytesPerS;
    cols.uplink[index] = h.link.bandwidthBytesPerS - h.link.txLoadBytesPerS;
    return { ...h, index, vmmProfile };
  });

  const holderSets = new Map<string, ReadonlySet<number>>();
  for (const [sid, list] of holders) holderSets.set(sid, new Set(list));
  return Object.freeze({
    revision: input.revision,
    observedAtMs: input.observedAtMs,
    hosts,
    hostIndexById,
    snapshots,
    holders,
    holderSets,
    partialHolders,
    cols,
    residentHosts,
    vmmProfiles: profiles,
  });
}
