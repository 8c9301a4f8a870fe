// The host steps an op's record keeps (OperationRec.steps). Every write of a running op
// carries its step log, so an op with very many steps (a drain moving thousands of sandboxes:
// ~4 steps of ~180 bytes each per sandbox, the record rewritten several times per move) would
// write bytes growing with the square of its size and, at ~1,500 sandboxes, pass etcd's
// request limit: its writes, the final one included, would fail. The record keeps the latest
// STEPS_KEPT ended steps and every step still running; the rest are counted in stepsOmitted.
// The steps are what an operator reads (GetOperation, `operation get`); no decision reads them
// back from the record (a leader counts a step's sends in its own memory).
import type { OperationRec, StepRec } from './records.ts';

/** Ended steps an op's record keeps at most: ~92 KB of steps. */
export const STEPS_KEPT = 512;

/**
 * Drops the earliest ended steps of `op.steps` beyond `kept` (by end time, then id), counting
 * them in `op.stepsOmitted`. `omitted`: the ids this process dropped from the op's record
 * before (its step log still holds them and puts them back before each write), counted once.
 */
export function capSteps(op: OperationRec, omitted: Set<string>, kept = STEPS_KEPT): void {
  const ended: Array<[string, StepRec]> = Object.entries(op.steps).filter(([, s]) => s.status !== 'sent');
  if (ended.length <= kept) return;
  ended.sort(([a, x], [b, y]) => (x.endedAt ?? 0) - (y.endedAt ?? 0) || (a < b ? -1 : a > b ? 1 : 0));
  let more = 0;
  for (const [id] of ended.slice(0, ended.length - kept)) {
    delete op.steps[id];
    if (!omitted.has(id)) {
      omitted.add(id);
      more++;
    }
  }
  if (more > 0) op.stepsOmitted = (op.stepsOmitted ?? 0) + more;
}
