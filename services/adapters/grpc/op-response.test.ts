// What an operation's answer reads from the store (fleet-service.ts opResponse): only the
// records the answer shows. The Fleet and the store are stubs of our own ports.
import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { Metadata } from '@grpc/grpc-js';
import { fleetService } from './fleet-service.ts';
import type { CallContext } from './rpc.ts';
import type { Fleet } from '../../domain/fleet.ts';
import type { FleetStore } from '../../domain/ports.ts';
import type { OperationRec } from '../../domain/records.ts';
import { GetOperationRequestSchema } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { GetOperationRequest, Operation } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';

const ctx = { signal: new AbortController().signal, deadline: undefined, metadata: new Metadata(), peer: 'test', method: 'GetOperation', principal: { tenantId: 't1', admin: false, credentialId: 'c1' } } as unknown as CallContext;

/** GetOperation of `op`; the snapshot ids the store was asked for, and the answer. */
async function answerTo(op: Partial<OperationRec>): Promise<{ snapshotReads: string[]; answer: Operation }> {
  const rec = { id: 'op-aaaaaaaaaaaaaaaaaaaa', tenantId: 't1', state: 'succeeded', createdAt: 1, updatedAt: 2, input: {}, progress: { done: 1, total: 1, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {}, ...op } as OperationRec;
  const snapshotReads: string[] = [];
  const store = {
    getSnapshot: async (_t: string, id: string) => (snapshotReads.push(id), { value: { id, tenantId: 't1', state: 'ready', createdAt: 1, logicalBytes: 0, storedBytes: 0, vmConfig: null, labels: {}, hostIds: [], pinned: false, retentionTtlMs: null, keepLast: 0 }, modRevision: 1 }),
    getSandbox: async () => undefined,
  } as unknown as FleetStore;
  const fleet = { getOperation: async () => rec, sandboxAtSubmit: () => undefined } as unknown as Fleet;
  const h = fleetService({ fleet, store, clock: { now: () => 3 } }).handlers as unknown as { getOperation: (r: GetOperationRequest, c: CallContext) => Promise<Operation> };
  const answer = await h.getOperation(create(GetOperationRequestSchema, { operationId: rec.id }), ctx);
  return { snapshotReads, answer };
}

describe('operation answers', () => {
  it('aForksAnswer_readsNoSnapshot_itShowsTheChildrenOnly', async () => {
    // A fork of a snapshot (its target), and one of a live sandbox (the snapshot it took).
    expect((await answerTo({ kind: 'fork', targetId: 'sn-aaaaaaaaaaaaaaaaaaaa', result: { sandboxIds: [] } })).snapshotReads).toEqual([]);
    expect((await answerTo({ kind: 'fork', targetId: 'sb-aaaaaaaaaaaaaaaaaaaa', result: { sandboxIds: [], snapshotId: 'sn-bbbbbbbbbbbbbbbbbbbb' } })).snapshotReads).toEqual([]);
  });

  it('aSnapshotsAnswer_readsAndShowsItsSnapshot', async () => {
    const { snapshotReads, answer } = await answerTo({ kind: 'snapshot', targetId: 'sb-aaaaaaaaaaaaaaaaaaaa', result: { snapshotId: 'sn-bbbbbbbbbbbbbbbbbbbb' } });
    expect(snapshotReads).toEqual(['sn-bbbbbbbbbbbbbbbbbbbb']);
    expect(answer.result.case).toBe('snapshot');
  });
});
