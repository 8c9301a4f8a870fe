// The explanation record: why a decision came out as it did, in data (adapters log it,
// the dashboard shows it, "what-if" runs diff it).
import type { Explanation, FilterReason, FleetView, HostChoice, Placement, PlacementRequest } from './types.ts';

/** Hosts examined and, for those filtered, the first failing reason. Invariant: sum(filtered) <= examined. */
export interface Tally {
  examined: number;
  filtered: Partial<Record<FilterReason, number>>;
}

export interface ExplanationInput {
  readonly view: FleetView;
  readonly request: PlacementRequest;
  readonly tally: Tally;
  readonly feasible: number;
  readonly sampled: boolean;
  readonly fallbackFullScan: boolean;
  readonly requested: number;
  readonly placements: readonly Placement[];
  readonly unknownSnapshot: boolean;
}

export function buildExplanation(x: ExplanationInput): Explanation {
  const byHost = new Map<string, { children: number; holds: boolean; last: Placement }>();
  let makespanMs = 0;
  let sum = 0;
  for (const p of x.placements) {
    const e = byHost.get(p.hostId);
    if (e === undefined) byHost.set(p.hostId, { children: 1, holds: p.holdsSnapshot, last: p });
    else {
      e.children++;
      e.last = p;
    }
    makespanMs = Math.max(makespanMs, p.score.etaMs);
    sum += p.score.etaMs;
  }
  const chosen: HostChoice[] = [...byHost].map(([hostId, e]) => ({ hostId, children: e.children, holdsSnapshot: e.holds, lastChild: e.last.score }));
  const filtered = { ...x.tally.filtered };
  const placed = x.placements.length;
  const reasons = Object.entries(filtered)
    .sort((a, b) => (b[1] ?? 0) - (a[1] ?? 0))
    .map(([r, n]) => `${r}=${n}`)
    .join(', ');
  const what = x.request.kind === 'create' ? 'create' : `${x.request.kind} of ${x.request.snapshotId}`;
  let summary: string;
  if (x.unknownSnapshot) summary = `${what}: snapshot not in view revision ${x.view.revision}`;
  else if (placed === x.requested) {
    summary = `${what}: placed ${placed} on ${chosen.length} host(s), ${chosen.filter((c) => c.holdsSnapshot).length} holding the snapshot; makespan ${makespanMs.toFixed(0)} ms`;
  } else {
    // Feasible hosts that a per-host cap leaves short are filtered by nothing: say the cap.
    const cap = x.request.preferences?.maxPerHost;
    const siblings = x.request.kind === 'fork' && (x.request.siblingsPerHost?.size ?? 0) > 0;
    const capped = cap !== undefined ? `; at most ${cap} per host${siblings ? ", the fork's children already placed counted" : ''}` : '';
    summary = `${what}: no capacity, could place ${placed} of ${x.requested}; ${x.feasible} feasible of ${x.tally.examined} examined (${reasons || 'none filtered'})${capped}`;
  }
  return {
    requestId: x.request.id,
    kind: x.request.kind,
    decidedAtMs: x.request.nowMs,
    viewRevision: x.view.revision,
    fleetSize: x.view.hosts.length,
    examined: x.tally.examined,
    feasible: x.feasible,
    sampled: x.sampled,
    fallbackFullScan: x.fallbackFullScan,
    filtered,
    requested: x.requested,
    placed,
    chosen,
    makespanMs,
    meanEtaMs: placed === 0 ? 0 : sum / placed,
    summary,
  };
}
