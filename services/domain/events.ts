// Fleet events, derived from record changes (each change carries the record's previous
// value, so an event is emitted exactly at the transition, not on every rewrite of the
// record). One derivation serves WatchEvents and the webhooks.
import type { RecordChange } from './ports.ts';
import type { SandboxState, SnapshotRec } from './records.ts';
import { isTerminal, sandboxOfOp } from './records.ts';

export const EVENT_TYPES = [
  'sandbox_created',
  'sandbox_state_changed',
  'sandbox_destroyed',
  'snapshot_created',
  'sandbox_restored',
  'sandbox_hibernated',
  'sandbox_woken',
  'snapshot_expiring',
  'snapshot_expired',
  'operation_done',
  'snapshot_expiry_withdrawn',
] as const;

export type FleetEventType = (typeof EVENT_TYPES)[number];

export interface FleetEvent {
  /** Store revision of the change; with `type` it identifies the event. */
  revision: number;
  type: FleetEventType;
  tenantId: string;
  /** Epoch ms. */
  time: number;
  sandboxId: string;
  snapshotId: string;
  hostId: string;
  operationId: string;
  sandboxState: SandboxState | '';
  message: string;
}

/**
 * The events one record change means. `time` is when the change was made, from the record
 * so that a replayed event keeps its time: a sandbox's or an operation's `updatedAt`. A
 * snapshot record carries no time of its last change, so a snapshot event takes the time
 * of what it reports, where the record has one: snapshot_created its `createdAt` (when it
 * began to be taken), snapshot_expired its `endedAt` (when it became deleted).
 * snapshot_expiring and snapshot_expiry_withdrawn have none (the record keeps the time of the
 * deletion, not of its announcement), nor has a record written before those fields: `now`,
 * when the change is seen (at once on a live watch; the replay's time for a replayed one).
 */
export function eventsOf(ch: RecordChange, now: number): FleetEvent[] {
  const changedAt = ch.kind === 'snapshot' ? 0 : ch.value.updatedAt;
  const base = { revision: ch.revision, tenantId: ch.value.tenantId, time: changedAt > 0 ? changedAt : now, sandboxId: '', snapshotId: '', hostId: '', operationId: '', sandboxState: '' as const, message: '' };
  if (ch.kind === 'sandbox') {
    const sb = ch.value;
    const prev = ch.prev;
    const ev = (type: FleetEventType): FleetEvent => ({ ...base, type, sandboxId: sb.id, hostId: sb.hostId, sandboxState: sb.state, message: sb.stateReason });
    if (!prev) return [ev('sandbox_created')];
    if (prev.state === sb.state) return [];
    if (sb.state === 'destroyed') return [ev('sandbox_destroyed')];
    if (sb.state === 'hibernated' && prev.state === 'hibernating') return [ev('sandbox_hibernated')];
    if (sb.state === 'running' && prev.state === 'waking') return [ev('sandbox_woken')];
    if (sb.state === 'running' && prev.state === 'starting' && sb.sourceSnapshotId) return [ev('sandbox_restored')];
    return [ev('sandbox_state_changed')];
  }
  if (ch.kind === 'snapshot') {
    const sn = ch.value;
    const prev = ch.prev;
    const ev = (type: FleetEventType, message: string, at = 0): FleetEvent => ({ ...base, type, snapshotId: sn.id, sandboxId: sn.sourceSandboxId, message, time: at > 0 ? at : now });
    const out: FleetEvent[] = [];
    // A delete that found the snapshot in use puts it back from `deleting`: not a new snapshot.
    if (sn.state === 'ready' && prev?.state !== 'ready' && prev?.state !== 'deleting') out.push(ev('snapshot_created', '', sn.createdAt));
    const due = sn.expiryDueAt ?? null;
    const wasDue = prev?.expiryDueAt ?? null;
    if (sn.state === 'ready' && due !== null && wasDue === null) out.push(ev('snapshot_expiring', `expires at ${new Date(due).toISOString()}`));
    // The announcement called off (pinned, a new retention rule, back inside its keep_last
    // window, or a sandbox uses it): whoever acted on snapshot_expiring learns it stays. Should
    // retention want it gone again, a new snapshot_expiring gives a full notice.
    if (sn.state === 'ready' && due === null && wasDue !== null) out.push(ev('snapshot_expiry_withdrawn', `expiry at ${new Date(wasDue).toISOString()} withdrawn: ${withdrawnWhy(sn, prev!)}`));
    if (sn.state === 'deleted' && prev?.state !== 'deleted' && sn.deletedReason === 'expired') out.push(ev('snapshot_expired', 'deleted by retention', sn.endedAt));
    return out;
  }
  const o = ch.value;
  if (!isTerminal(o.state) || (ch.prev && isTerminal(ch.prev.state))) return [];
  return [{ ...base, type: 'operation_done', operationId: o.id, sandboxId: sandboxOfOp(o), snapshotId: o.targetId.startsWith('sn-') ? o.targetId : '', message: o.error?.message ?? o.state }];
}

/** Why an announced expiry was withdrawn, as far as the record tells (whether a sandbox uses it, it does not). */
function withdrawnWhy(sn: SnapshotRec, prev: SnapshotRec): string {
  if (sn.pinned) return 'pinned';
  if (sn.retentionTtlMs !== prev.retentionTtlMs || sn.keepLast !== prev.keepLast) return 'retention changed';
  return 'in use by a sandbox, or back inside its keep_last window';
}
