// Snapshot retention, as a pure plan over the leader's records (DESIGN.md decision 8).
//
// Rules, per snapshot (a snapshot carries its own Retention):
//   - pinned: never expires;
//   - keep_last = N > 0: expires once it is not among the newest N ready, unpinned
//     snapshots of its lineage that carry a keep_last rule too, and are of its kind: a
//     sandbox's hibernation snapshots (label forkfleet.io/hibernation) count only against
//     each other, the snapshots of forks of a live sandbox (label forkfleet.io/purpose: fork)
//     only against each other, every other snapshot only against other such snapshots. So
//     the snapshots the system takes (hibernation, fork of a live sandbox, migration, which
//     carry their own rules) and snapshots taken without keep_last never push a user's
//     snapshot out of its window;
//   - ttl: expires `ttl` after it was created;
//   - a hibernation snapshot whose sandbox is gone (destroyed, or its record expired)
//     expires: nothing wakes from it any more.
// Expiry is announced first: the record gets `expiryDueAt` (the SNAPSHOT_EXPIRING event)
// at least `noticeMs` before the deletion, or at the TTL when that is later. A snapshot that
// a live sandbox still restores from (its source) or hibernates in is never deleted, nor
// announced: its notice starts when that sandbox is gone. An announced snapshot that is no longer due
// (pinned meanwhile, retention changed, back inside the window) or that came into use has its
// announcement withdrawn (expiryDueAt cleared: the SNAPSHOT_EXPIRY_WITHDRAWN event).
import type { SandboxRec, SnapshotRec } from './records.ts';
import { snapshotsUsedBy } from './records.ts';

export interface RetentionPlan {
  /** Announce (set expiryDueAt). */
  readonly announce: ReadonlyArray<{ snapshot: SnapshotRec; dueAt: number }>;
  /** Withdraw an announcement (clear expiryDueAt). */
  readonly withdraw: readonly SnapshotRec[];
  /** Delete now (reason: expired). */
  readonly expire: readonly SnapshotRec[];
  /** Due, but still in use by a live sandbox (id -> sandbox ids), for explanations and logs. */
  readonly held: ReadonlyMap<string, readonly string[]>;
}

/** The label that names the sandbox a hibernation snapshot belongs to. */
export const HIBERNATION_LABEL = 'forkfleet.io/hibernation';

/** The label that says why the system took a snapshot ('fork': of a live sandbox a fork started from; 'migration'). */
export const PURPOSE_LABEL = 'forkfleet.io/purpose';

/**
 * When retention wants `sn` gone, or null when it is kept. `rank` is its place among the
 * snapshots it is counted against (see the rules above), newest first; `orphan`: a hibernation
 * snapshot whose sandbox is gone.
 */
function wantedGoneAt(sn: SnapshotRec, rank: number, orphan: boolean, now: number, noticeMs: number): number | null {
  if (sn.pinned) return null;
  const byTtl = sn.retentionTtlMs !== null ? sn.createdAt + sn.retentionTtlMs : null;
  const outOfWindow = (sn.keepLast > 0 && rank >= sn.keepLast) || orphan;
  // An announcement already made keeps its time; a new one gives the full notice.
  const byWindow = outOfWindow ? (sn.expiryDueAt ?? now + noticeMs) : null;
  if (byTtl === null) return byWindow;
  if (byWindow === null) return byTtl;
  return Math.min(byTtl, byWindow);
}

/**
 * `opUsers`: snapshots that running operations are about to place sandboxes from, with the
 * operations' ids (a fork's snapshot of a live sandbox has no child record yet between
 * becoming ready and its children's placement); held like those sandboxes use.
 */
export function planRetention(snapshots: readonly SnapshotRec[], sandboxes: readonly SandboxRec[], now: number, noticeMs: number, opUsers: ReadonlyMap<string, readonly string[]> = new Map()): RetentionPlan {
  const users = new Map<string, string[]>([...opUsers].map(([id, ops]) => [id, [...ops]]));
  const live = new Set<string>();
  for (const sb of sandboxes) {
    if (sb.state === 'destroyed') continue;
    live.add(sb.id);
    for (const id of snapshotsUsedBy(sb)) {
      // Appended in place: thousands of children share one snapshot (a copy per user is quadratic).
      const list = users.get(id);
      if (list) list.push(sb.id);
      else users.set(id, [sb.id]);
    }
  }
  const lineages = new Map<string, SnapshotRec[]>();
  for (const sn of snapshots) {
    if (sn.state !== 'ready' || sn.pinned) continue;
    // Ranked only against the snapshots it is counted against; one without keep_last is alone.
    const of = sn.labels[HIBERNATION_LABEL];
    const purpose = sn.labels[PURPOSE_LABEL];
    const kind = of !== undefined ? `hibernation/${of}` : purpose !== undefined ? `purpose/${purpose}` : 'user';
    const key = sn.keepLast > 0 ? `${sn.tenantId}/${sn.lineageId || sn.id}/${kind}` : `${sn.tenantId}/alone/${sn.id}`;
    const list = lineages.get(key);
    if (list) list.push(sn);
    else lineages.set(key, [sn]);
  }
  const announce: Array<{ snapshot: SnapshotRec; dueAt: number }> = [];
  const expire: SnapshotRec[] = [];
  const held = new Map<string, readonly string[]>();
  const due = new Set<string>();
  for (const list of lineages.values()) {
    list.sort((a, b) => b.createdAt - a.createdAt || (a.id < b.id ? -1 : a.id > b.id ? 1 : 0));
    list.forEach((sn, rank) => {
      const of = sn.labels[HIBERNATION_LABEL];
      const goneAt = wantedGoneAt(sn, rank, of !== undefined && !live.has(of), now, noticeMs);
      if (goneAt === null || goneAt - noticeMs > now) return;
      const by = users.get(sn.id);
      if (by) {
        // Not announced while a live sandbox uses it, and an announcement made before it came
        // into use is withdrawn (not in `due`): the notice starts once it is free, in full.
        held.set(sn.id, by);
        return;
      }
      due.add(sn.id);
      const announced = sn.expiryDueAt !== undefined && sn.expiryDueAt !== null;
      if (!announced) {
        // A full notice, also for one whose TTL passed while a sandbox used it (or while no
        // leader ran): deleted at once it would get none.
        announce.push({ snapshot: sn, dueAt: Math.max(goneAt, now + noticeMs) });
        return;
      }
      if (sn.expiryDueAt! > now) return;
      expire.push(sn);
    });
  }
  const withdraw = snapshots.filter((sn) => sn.state === 'ready' && sn.expiryDueAt !== undefined && sn.expiryDueAt !== null && !due.has(sn.id));
  return { announce, withdraw, expire, held };
}
