import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { timestampFromMs } from '@bufbuild/protobuf/wkt';
import { OperationSchema } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import { phasesOf, summarisePhases } from './phases.ts';

const dur = (ms: number): { seconds: bigint; nanos: number } => ({ seconds: BigInt(Math.floor(ms / 1000)), nanos: (ms % 1000) * 1e6 });

describe('phases', () => {
  it('phasesOf_splitsAForkIntoSchedulerHostAndOverhead_bothFromTheStepItWaitedLongestFor_andSumsTheBytesMoved', () => {
    const op = create(OperationSchema, {
      createdAt: timestampFromMs(10_000),
      updatedAt: timestampFromMs(12_500),
      steps: [
        { stepId: 'restore/h2', sentAt: timestampFromMs(10_040), finishedAt: timestampFromMs(12_400), hostDuration: dur(2_300), bytesFetched: 3n << 20n, restoredByMigration: true },
        { stepId: 'restore/h3', sentAt: timestampFromMs(10_050), finishedAt: timestampFromMs(11_000), hostDuration: dur(2_310), bytesFetched: 1n << 20n },
      ],
    });
    // h3's host reports more time than h2's, but the op waited for h2: both figures are h2's.
    expect(phasesOf(op, 123.45)).toEqual({ op_ms: 2_500, to_first_step_ms: 40, host_step_ms: 2_300, step_overhead_ms: 60, exec_after_op_ms: 123.5, bytes_moved: 4 << 20, migrated: true });
  });

  it('phasesOf_anOperationWithoutATimedStep_isUndefined', () => {
    expect(phasesOf(create(OperationSchema, { createdAt: timestampFromMs(1), updatedAt: timestampFromMs(2) }), 5)).toBeUndefined();
    expect(phasesOf(create(OperationSchema, { createdAt: timestampFromMs(1), updatedAt: timestampFromMs(2), steps: [{ stepId: 'resume', finishedAt: timestampFromMs(2) }] }), 5)).toBeUndefined();
  });

  it('summarisePhases_takesTheMedianOfEachField_andCountsTheMigratedSamples', () => {
    const p = (ms: number, migrated: boolean): Parameters<typeof summarisePhases>[0][number] => ({ op_ms: ms, to_first_step_ms: 1, host_step_ms: ms / 2, step_overhead_ms: 3, exec_after_op_ms: 4, bytes_moved: 10, migrated });
    expect(summarisePhases([p(100, true), p(300, false), p(200, true)])).toEqual({ n: 3, op_ms: 200, to_first_step_ms: 1, host_step_ms: 100, step_overhead_ms: 3, exec_after_op_ms: 4, bytes_moved: 10, migrated_samples: 2 });
    expect(summarisePhases([p(100, false), p(200, false)])?.op_ms).toBe(150);
    expect(summarisePhases([])).toBeUndefined();
  });
});
