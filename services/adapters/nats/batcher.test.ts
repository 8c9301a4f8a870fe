import { describe, expect, it } from 'vitest';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import { HostResultBatchSchema, HostResultSchema, HostWorkBatchSchema, HostWorkSchema } from '../../domain/messages.ts';
import { frameBatch, settleAfter, SubjectBatcher } from './batcher.ts';
import type { JsPublisher } from './js-publisher.ts';

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

  it('settleAfter_acksTheMessageOnlyOnceEveryItemIsAcked_andNaksItInsteadWhenAnItemWasGivenBack', () => {
    const calls: string[] = [];
    const all = settleAfter(3, () => calls.push('ack'), () => calls.push('nak'));
    all.ack();
    all.ack();
    expect(calls).toEqual([]);
    all.ack();
    expect(calls).toEqual(['ack']);
    const some = settleAfter(3, () => calls.push('ack'), () => calls.push('nak'));
    some.ack();
    some.release();
    expect(calls).toEqual(['ack']);
    some.ack();
    expect(calls).toEqual(['ack', 'nak']);
  });

  it('subjectBatcher_whoseFenceRefusesWhileAnItemWaitsForThePubAckAhead_failsThatItem_andNeverPublishesIt', async () => {
    // A deposed leader's step queued behind a message in flight: when that message's PubAck
    // comes, the lease is gone, and the step must not reach the host.
    const published: string[] = [];
    let ackFirst: () => void = () => undefined;
    const publisher = {
      publish: (subject: string, _bytes: Uint8Array, o: { msgId?: string }) => {
        published.push(o.msgId ?? '');
        return published.length === 1 ? new Promise<void>((r) => (ackFirst = r)) : Promise.resolve();
      },
    } as unknown as JsPublisher;
    let leading = true;
    const batcher = new SubjectBatcher(publisher, {}, () => (leading ? undefined : new Error('not leading')));
    const first = batcher.publish('ff.work.h1', new Uint8Array([1]), 'a');
    await new Promise((r) => setImmediate(r));
    const second = batcher.publish('ff.work.h1', new Uint8Array([2]), 'b');
    second.catch(() => undefined);
    leading = false;
    ackFirst();
    await first;
    await expect(second).rejects.toThrow('not leading');
    expect(published).toEqual(['a']);
    // Leading again: sent as before.
    leading = true;
    await batcher.publish('ff.work.h1', new Uint8Array([3]), 'c');
    expect(published).toEqual(['a', 'c']);
  });

  it('subjectBatcher_failAll_whileAnItemWaitsForThePubAckAhead_failsIt_andItIsNeverPublished_thoughTheFenceSaysYes', async () => {
    // The replica lost its lease and won it back before the PubAck ahead came: the fence says
    // yes again, but the queued step was decided (and stamped) by the earlier term.
    const published: string[] = [];
    let ackFirst: () => void = () => undefined;
    const publisher = {
      publish: (_subject: string, _bytes: Uint8Array, o: { msgId?: string }) => {
        published.push(o.msgId ?? '');
        return published.length === 1 ? new Promise<void>((r) => (ackFirst = r)) : Promise.resolve();
      },
    } as unknown as JsPublisher;
    const batcher = new SubjectBatcher(publisher, {}, () => undefined);
    const first = batcher.publish('ff.work.h1', new Uint8Array([1]), 'a');
    await new Promise((r) => setImmediate(r));
    const second = batcher.publish('ff.work.h1', new Uint8Array([2]), 'b');
    second.catch(() => undefined);
    batcher.failAll(new Error('an earlier term'));
    ackFirst();
    await first;
    await expect(second).rejects.toThrow('an earlier term');
    expect(published).toEqual(['a']);
    await batcher.publish('ff.work.h1', new Uint8Array([3]), 'c');
    expect(published).toEqual(['a', 'c']);
  });
});
