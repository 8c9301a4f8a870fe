import { describe, expect, it } from 'vitest';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import { HostResultBatchSchema, HostResultSchema, HostWorkBatchSchema, HostWorkSchema } from '../../domain/messages.ts';
import { ackAfter, frameBatch } from './batcher.ts';

describe('batches of host work and results', () => {
  it('frameBatch_ofEncodedItems_decodesAsTheBatchMessageWithTheSameItemsInOrder', () => {
    const work = [1, 2, 3].map((i) => create(HostWorkSchema, { opId: `op-${i}`, stepId: `restore/h${i}`, attempt: i, tenantId: 't', work: { case: 'destroyVm', value: { sandboxId: `sb-${i}` } as never } }));
    const batch = fromBinary(HostWorkBatchSchema, frameBatch(work.map((w) => toBinary(HostWorkSchema, w))));
    expect(batch.items.map((w) => toBinary(HostWorkSchema, w))).toEqual(work.map((w) => toBinary(HostWorkSchema, w)));
    const results = [create(HostResultSchema, { opId: 'op-1', stepId: 's', hostId: 'h1', error: { kind: 'internal', message: 'x' } }), create(HostResultSchema, { opId: 'op-2', stepId: 's', hostId: 'h1' })];
    expect(fromBinary(HostResultBatchSchema, frameBatch(results.map((r) => toBinary(HostResultSchema, r)))).items.map((r) => [r.opId, r.error?.message])).toEqual([
      ['op-1', 'x'],
      ['op-2', undefined],
    ]);
  });

  it('ackAfter_acksTheMessageOnlyOnceEveryItemIsAcked', () => {
    let acks = 0;
    const ack = ackAfter(3, () => acks++);
    ack();
    ack();
    expect(acks).toBe(0);
    ack();
    expect(acks).toBe(1);
  });
});
