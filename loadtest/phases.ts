// Where a sample's time went, from the operation's host steps (Operation.steps) and the load
// test's own clock. Server times are only subtracted from server times, client times from
// client times: the two clocks are never mixed. Pure.
import { durationMs, timestampMs } from '@bufbuild/protobuf/wkt';
import type { Operation } from '../proto/gen/forkfleet/v1/fleet_pb.ts';

/** One sample's breakdown (ms, bytes). */
export interface OpPhases {
  /** The operation inside the scheduler: recorded until its final write. */
  op_ms: number;
  /** Recorded until its first host step was sent: queueing, placement, the live source's snapshot is not in it (it is a step). */
  to_first_step_ms: number;
  /**
   * The step that took longest from sent to answered (a fork's hosts restore in parallel: it
   * is the one the operation waited for), as its host measured it.
   */
  host_step_ms: number;
  /** The same step's time outside its host: NATS both ways and the leader. */
  step_overhead_ms: number;
  /** After the API answered with the finished operation, until the last sandbox answered its exec (load test clock). */
  exec_after_op_ms: number;
  /** Snapshot bytes the hosts fetched or received by migration. */
  bytes_moved: number;
  /** Some host's VMs came by live migration. */
  migrated: boolean;
}

export function phasesOf(op: Operation, execAfterOpMs: number): OpPhases | undefined {
  const steps = op.steps.filter((s) => s.sentAt && s.finishedAt);
  if (!op.createdAt || !op.updatedAt || steps.length === 0) return undefined;
  const took = (s: (typeof steps)[number]): number => timestampMs(s.finishedAt!) - timestampMs(s.sentAt!);
  const host = (s: (typeof steps)[number]): number => (s.hostDuration ? durationMs(s.hostDuration) : 0);
  const longest = steps.reduce((a, b) => (took(b) > took(a) ? b : a));
  return {
    op_ms: timestampMs(op.updatedAt) - timestampMs(op.createdAt),
    to_first_step_ms: Math.min(...steps.map((s) => timestampMs(s.sentAt!))) - timestampMs(op.createdAt),
    host_step_ms: host(longest),
    step_overhead_ms: took(longest) - host(longest),
    exec_after_op_ms: Math.round(execAfterOpMs * 10) / 10,
    bytes_moved: op.steps.reduce((n, s) => n + Number(s.bytesFetched), 0),
    migrated: op.steps.some((s) => s.restoredByMigration),
  };
}

/** Medians of a scenario's samples, field by field; `migrated`: in how many samples. */
export type PhaseSummary = { n: number; migrated_samples: number } & Omit<OpPhases, 'migrated'>;

export function summarisePhases(samples: readonly OpPhases[]): PhaseSummary | undefined {
  if (samples.length === 0) return undefined;
  const median = (xs: number[]): number => {
    const s = [...xs].sort((a, b) => a - b);
    const m = s.length >> 1;
    return s.length % 2 ? s[m]! : Math.round(((s[m - 1]! + s[m]!) / 2) * 10) / 10;
  };
  const of = (k: keyof Omit<OpPhases, 'migrated'>): number => median(samples.map((p) => p[k]));
  return {
    n: samples.length,
    op_ms: of('op_ms'),
    to_first_step_ms: of('to_first_step_ms'),
    host_step_ms: of('host_step_ms'),
    step_overhead_ms: of('step_overhead_ms'),
    exec_after_op_ms: of('exec_after_op_ms'),
    bytes_moved: of('bytes_moved'),
    migrated_samples: samples.filter((p) => p.migrated).length,
  };
}
