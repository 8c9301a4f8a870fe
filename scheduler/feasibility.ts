// Feasibility: small checks run in order on each candidate host; the first that fails names
// the reason the host is filtered (Nomad's feasibility iterators). Checks only read the
// host and the per-decision context; none depends on other hosts or on the plan so far,
// except resource room, which the planner tracks per child (see place.ts).
import { roomFor, missingBytes, type Demand } from './cost.ts';
import type { FilterReason, FleetView, HostView, HostVmm, Locality, SnapshotView, VmConfig, VmmRequirement } from './types.ts';

/** Per-decision facts shared by every check. Built once per place() call. */
export interface DecisionContext {
  readonly view: FleetView;
  readonly demand: Demand;
  readonly locality: Locality;
  /** Index of the pinned host, or -1. */
  readonly pinnedIndex: number;
  /** Indexes of the hosts the request avoids (preferences.avoidHostIds). */
  readonly avoided: ReadonlySet<number>;
  /** Hosts holding the snapshot fully (empty for create). */
  readonly holderSet: ReadonlySet<number>;
  /** Bytes present on partial holders. */
  readonly partial: ReadonlyMap<number, number> | undefined;
  /** Whether some ready holder has outbound bandwidth, i.e. a cold host can get the bytes at all. */
  readonly hasSource: boolean;
  /** Compatibility per VMM profile, computed lazily: 0 unknown, 1 yes, 2 no. */
  readonly compat: Uint8Array;
  readonly vmmRequirement: VmmRequirement | undefined;
}

/** What a host that passed every check brings to the planner. */
export interface Candidate {
  /** Host index (hot loops use this; `host` is touched only for chosen hosts). */
  readonly index: number;
  readonly host: HostView;
  readonly holds: boolean;
  readonly missingBytes: number;
  /** Max children of this request that fit (before maxPerHost). >= 1. */
  readonly room: number;
}

/** A feasibility check on host index i: null if it passes, else why not. */
export type Check = (i: number, ctx: DecisionContext) => FilterReason | null;

export const hostStateCheck: Check = (i, ctx) => {
  const st = ctx.view.cols.state[i];
  return st === 0 ? null : st === 2 ? 'host_lost' : 'host_suspect';
};
export const cordonCheck: Check = (i, ctx) => (ctx.view.cols.cordoned[i] === 1 ? 'cordoned' : null);
export const drainCheck: Check = (i, ctx) => (ctx.view.cols.draining[i] === 1 ? 'draining' : null);
/** pinnedIndex -2 (a host the view lacks) refuses every host, as place() does. */
export const pinCheck: Check = (i, ctx) => (ctx.pinnedIndex !== -1 && i !== ctx.pinnedIndex ? 'not_pinned' : null);
export const avoidCheck: Check = (i, ctx) => (ctx.avoided.size > 0 && ctx.avoided.has(i) ? 'avoided' : null);
export const localityCheck: Check = (i, ctx) => {
  if (ctx.demand.snapshot === null || ctx.locality === 'ANY') return null;
  return (ctx.locality === 'SAME_HOST') === ctx.holderSet.has(i) ? null : 'locality';
};
export const vmmCheck: Check = (i, ctx) => {
  const p = ctx.view.cols.vmmProfile[i] as number;
  let c = ctx.compat[p];
  if (c === undefined || c === 0) {
    const profile = ctx.view.vmmProfiles[p];
    const ok = profile !== undefined && vmmCompatible(profile, ctx.demand.snapshot, ctx.vmmRequirement);
    c = ok ? 1 : 2;
    ctx.compat[p] = c;
  }
  if (c !== 1) return 'vmm_incompatible';
  // The host's own build of the snapshot's image (profiles leave images out: builds differ per host).
  const base = ctx.demand.snapshot?.vmConfig.baseImage;
  return base && !sameBaseImage(ctx.view.hosts[i]!.vmm, base) ? 'vmm_incompatible' : null;
};

/**
 * Whether the host can restore over the base disk a snapshot's layer overlays: its build of
 * the image has that disk's digest, or it has not built the image and its agent would build
 * it for the restore: by the snapshot's recipe (HostVmm.recipes), or the host does not say
 * (an agent that predates HostVmm.images or .recipes). `base.key` is `<name>-<recipeHash>`.
 */
export function sameBaseImage(host: HostVmm, base: NonNullable<VmConfig['baseImage']>): boolean {
  const built = host.images?.[base.key];
  if (built) return built === base.diskSha256;
  if (!host.recipes) return true;
  const dash = base.key.lastIndexOf('-');
  const recipe = host.recipes[base.key.slice(0, dash)];
  return recipe === undefined || recipe === base.key.slice(dash + 1);
}
export const transferCheck: Check = (i, ctx) => {
  if (ctx.demand.snapshot === null || ctx.holderSet.has(i)) return null;
  if ((ctx.view.cols.downlink[i] as number) <= 0) return 'no_inbound_bandwidth';
  return ctx.hasSource ? null : 'no_transfer_source';
};

/**
 * Runs the static checks, cheapest and most selective first, then resource room for one
 * child. Returns the candidate or the first failing reason. The checks are called by name,
 * not looped over as a list: each call site then sees one function, which V8 inlines (a
 * decision on 10,000 hosts runs this a few hundred times).
 */
export function evaluateHost(i: number, ctx: DecisionContext): Candidate | FilterReason {
  const r = pinCheck(i, ctx) ?? avoidCheck(i, ctx) ?? hostStateCheck(i, ctx) ?? cordonCheck(i, ctx) ?? drainCheck(i, ctx) ?? localityCheck(i, ctx) ?? vmmCheck(i, ctx) ?? transferCheck(i, ctx);
  if (r !== null) return r;
  const snap = ctx.demand.snapshot;
  const holds = ctx.holderSet.has(i);
  const missing = missingBytes(snap, ctx.partial?.get(i) ?? 0, holds);
  const room = roomFor(ctx.demand, ctx.view.cols, i, missing);
  if (typeof room === 'string') return room;
  return { index: i, host: ctx.view.hosts[i] as HostView, holds, missingBytes: missing, room };
}

/** "8.2.2" -> [8, 2, 2]; missing or non-numeric parts count as 0. */
export function parseVersion(v: string): number[] {
  return v.split('.').map((p) => {
    const n = Number.parseInt(p, 10);
    return Number.isFinite(n) ? n : 0;
  });
}

export function compareVersions(a: string, b: string): number {
  const x = parseVersion(a);
  const y = parseVersion(b);
  for (let i = 0; i < Math.max(x.length, y.length); i++) {
    const d = (x[i] ?? 0) - (y[i] ?? 0);
    if (d !== 0) return d;
  }
  return 0;
}

/**
 * The QEMU release series a snapshot's state is tied to: major.minor (7.2.x restores 7.2.y).
 * The host agent refuses a restore on any other (host-agent/domain/compat.ts, which uses this
 * one rule): a microvm machine type is not versioned, so nothing keeps a newer series loading
 * an older one's device state.
 */
export function qemuSeries(version: string): string {
  const m = /^(\d+)\.(\d+)/.exec(version);
  return m ? `${m[1]}.${m[2]}` : version;
}

/**
 * A snapshot restores on a host when: same accel (a KVM snapshot's CPU state does not load
 * under TCG and vice versa), the host supports its machine type and CPU model, and the host's
 * QEMU is of the snapshot's series (qemuSeries; the agent refuses any other, so a host that
 * placement chose would fail the restore, every time). Also its build of the snapshot's image must have the
 * base disk the snapshot overlays: sameBaseImage, per host (vmmCheck), not part of the shared
 * profile this judges. A create checks only what it asks for.
 */
export function vmmCompatible(host: HostVmm, snapshot: SnapshotView | null, req: VmmRequirement | undefined): boolean {
  if (snapshot !== null) {
    const vm = snapshot.vmConfig;
    return (
      host.accel === vm.accel &&
      host.machines.includes(vm.machine) &&
      host.cpuModels.includes(vm.cpuModel) &&
      qemuSeries(host.qemuVersion) === qemuSeries(vm.qemuVersion)
    );
  }
  if (req === undefined) return true;
  if (req.accel !== undefined && host.accel !== req.accel) return false;
  if (req.machine !== undefined && !host.machines.includes(req.machine)) return false;
  if (req.cpuModel !== undefined && !host.cpuModels.includes(req.cpuModel)) return false;
  if (req.minQemuVersion !== undefined && compareVersions(host.qemuVersion, req.minQemuVersion) < 0) return false;
  return true;
}
