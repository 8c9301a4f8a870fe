// What the SDK's watch() does when its event stream breaks: it resumes after the last store
// revision it saw whole, so the other events of a revision it was part-way through are not
// lost and the ones it yielded are not repeated. The typed gRPC client is replaced by a fake
// of its interface: no server is involved.
import { create } from '@bufbuild/protobuf';
import { status as Status } from '@grpc/grpc-js';
import { describe, expect, it } from 'vitest';
import { RpcError } from '../adapters/grpc/status.ts';
import { EventSchema, EventType } from '../../proto/gen/forkfleet/v1/fleet_pb.ts';
import { Forkfleet, type RetryOptions } from './index.ts';

const broke = (): RpcError => new RpcError(Status.UNAVAILABLE, 'unavailable', 'the stream broke off', true, undefined, undefined, true);
const ev = (revision: number, sandboxId: string) => create(EventSchema, { revision: BigInt(revision), type: EventType.SANDBOX_STATE_CHANGED, tenantId: 't1', sandboxId });

function client(watchEvents: (req: { afterRevision: bigint }) => AsyncIterable<unknown>, retry: Partial<RetryOptions> = {}): Forkfleet {
  const ff = new Forkfleet({ address: '127.0.0.1:1', token: 'ff_test', ca: Buffer.from('-----BEGIN CERTIFICATE-----\n'), tenant: 't1', retry: { baseMs: 1, maxMs: 1, ...retry } });
  ff.close();
  (ff as unknown as { rpc: unknown }).rpc = { watchEvents };
  return ff;
}

describe('SDK watch across a broken stream', () => {
  it('breakInsideARevision_resumesAfterTheRevisionBefore_yieldingItsOtherEventsOnce', async () => {
    const asked: bigint[] = [];
    const ff = client(async function* (req) {
      asked.push(req.afterRevision);
      if (asked.length === 1) {
        yield ev(5, 'sb-a');
        yield ev(6, 'sb-b1'); // revision 6 carries two events: the stream breaks between them
        throw broke();
      }
      // The server replays every event after the revision asked for.
      yield ev(6, 'sb-b1');
      yield ev(6, 'sb-b2');
      yield ev(7, 'sb-c');
    });
    const seen: string[] = [];
    for await (const e of ff.watch({ afterRevision: 4 })) seen.push(`${e.revision}:${e.sandboxId}`);
    expect(seen).toEqual(['5:sb-a', '6:sb-b1', '6:sb-b2', '7:sb-c']);
    expect(asked).toEqual([4n, 5n]);
  });

  it('watchFromNow_breakAfterItsFirstEvent_resumesFromThatEventsRevision_notFromNowAgain', async () => {
    const asked: bigint[] = [];
    const ff = client(async function* (req) {
      asked.push(req.afterRevision);
      if (asked.length === 1) {
        yield ev(9, 'sb-a');
        throw broke();
      }
      yield ev(9, 'sb-a');
      yield ev(10, 'sb-b'); // happened while the stream was down
    });
    const seen: string[] = [];
    for await (const e of ff.watch()) seen.push(`${e.revision}:${e.sandboxId}`);
    expect(seen).toEqual(['9:sb-a', '10:sb-b']);
    expect(asked).toEqual([0n, 8n]);
  });

  it('watchFromNow_breakBeforeItsFirstEvent_resumesFromTheMarkerTheServerSentFirst', async () => {
    const asked: bigint[] = [];
    const ff = client(async function* (req) {
      asked.push(req.afterRevision);
      if (asked.length === 1) {
        yield create(EventSchema, { revision: 30n, tenantId: 't1' }); // the store's revision as the watch began
        throw broke();
      }
      yield ev(31, 'sb-a'); // happened while the stream was down
    });
    const seen: string[] = [];
    for await (const e of ff.watch()) seen.push(`${e.revision}:${e.sandboxId}`);
    expect(seen).toEqual(['31:sb-a']);
    expect(asked).toEqual([0n, 30n]);
  });

  it('progressMarker_isNotYielded_andIsWhereABreakResumes', async () => {
    const asked: bigint[] = [];
    const ff = client(async function* (req) {
      asked.push(req.afterRevision);
      if (asked.length === 1) {
        yield ev(5, 'sb-a');
        yield create(EventSchema, { revision: 40n, tenantId: 't1' }); // nothing of this watch's up to 40
        throw broke();
      }
      yield ev(41, 'sb-b');
    });
    const seen: string[] = [];
    for await (const e of ff.watch({ afterRevision: 4 })) seen.push(`${e.revision}:${e.sandboxId}`);
    expect(seen).toEqual(['5:sb-a', '41:sb-b']);
    expect(asked).toEqual([4n, 40n]);
  });

  it('anEventOfATypeThisSdkDoesNotKnow_isYielded_notTakenForAProgressMarker', async () => {
    const ff = client(async function* () {
      yield create(EventSchema, { revision: 7n, type: 99 as EventType, tenantId: 't1', sandboxId: 'sb-new' });
      yield ev(7, 'sb-same-revision');
    });
    const seen: string[] = [];
    for await (const e of ff.watch({ afterRevision: 6 })) seen.push(`${e.revision}:${e.sandboxId}`);
    expect(seen).toEqual(['7:sb-new', '7:sb-same-revision']);
  });

  it('anUnknownEventTypeName_isInvalidArgumentNamingTheField', async () => {
    const ff = client(async function* () {
      yield* [];
    });
    await expect(async () => {
      for await (const e of ff.watch({ types: ['sandbox_state_changed', 'nope'] })) void e;
    }).rejects.toMatchObject({ kind: 'invalid_argument', field: 'types[1]' });
  });

  it('streamThatBreaksBeforeAnyEvent_moreTimesThanTheAttempts_failsWithNoOutageAllowance', async () => {
    // (With the default allowance, a scheduler answering UNAVAILABLE is asked again for up to
    // WAIT_OUTAGE_MS: retry.test.ts.)
    let calls = 0;
    const ff = client(
      async function* () {
        calls++;
        yield* [];
        throw broke();
      },
      { outageWaitMs: 0 },
    );
    await expect(async () => {
      for await (const e of ff.watch({ afterRevision: 1 })) void e;
    }).rejects.toMatchObject({ kind: 'unavailable' });
    expect(calls).toBe(5);
  });
});
