// WatchEvents over a store whose watch the test drives: what the stream does with a client
// that went away, one that does not read, and a store watch that breaks off.
import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { Metadata } from '@grpc/grpc-js';
import { fleetService } from './fleet-service.ts';
import type { CallContext } from './rpc.ts';
import type { Fleet } from '../../domain/fleet.ts';
import type { FleetStore, RecordChange } from '../../domain/ports.ts';
import { WatchEventsRequestSchema } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import { EventType } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { Event } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import { ForkfleetError } from '../../../proto/errors.ts';
import { sandboxRecord } from '../../testkit/records.ts';

/**
 * A store watch the test feeds by hand, at store revision `revision` (0: a store that has
 * none, so a watch from now gets no first progress marker); `stopped` once the service
 * cancels it, `from` the revision it was asked to start at.
 */
function drivenStore(revision = 0): { store: FleetStore; emit: (ch: RecordChange) => void; progress: (rev: number) => void; fail: (e: unknown) => void; state: { stopped: boolean; from: number | undefined } } {
  let onChange: ((ch: RecordChange) => void) | undefined;
  let onError: ((e: unknown) => void) | undefined;
  let onProgress: ((rev: number) => void) | undefined;
  const state: { stopped: boolean; from: number | undefined } = { stopped: false, from: undefined };
  const store = {
    revision: async () => revision,
    watchRecords: async (cb: (ch: RecordChange) => void, opts: { fromRevision?: number; onError?: (e: unknown) => void; onProgress?: (rev: number) => void } = {}) => {
      onChange = cb;
      onError = opts.onError;
      onProgress = opts.onProgress;
      state.from = opts.fromRevision;
      return () => void (state.stopped = true);
    },
  } as unknown as FleetStore;
  return { store, emit: (ch) => onChange?.(ch), progress: (rev) => onProgress?.(rev), fail: (e) => onError?.(e), state };
}

/**
 * A store with a history of record changes, compacted to `compactedTo`, that acts as etcd
 * does: a watch from before the compacted revision is cancelled ("compacted") after it
 * opened; one from it or later replays the changes from there, each with the previous value
 * etcd reads at the revision before it, which is gone for a change at the compacted revision.
 */
function historyStore(history: RecordChange[], compactedTo: number): FleetStore {
  const head = Math.max(...history.map((ch) => ch.revision));
  return {
    revision: async () => head,
    watchRecords: async (cb: (ch: RecordChange) => void, opts: { fromRevision?: number; onError?: (e: unknown) => void } = {}) => {
      const from = opts.fromRevision ?? head + 1;
      setImmediate(() => {
        if (from < compactedTo) return opts.onError?.(new Error(`watch from revision ${from}: required revision has been compacted`));
        for (const ch of history) {
          if (ch.revision < from) continue;
          if (ch.revision - 1 < compactedTo) {
            const { prev: _gone, ...rest } = ch;
            cb(rest as RecordChange);
          } else cb(ch);
        }
      });
      return () => undefined;
    },
  } as unknown as FleetStore;
}

const created = (revision: number, id: string): RecordChange => ({ kind: 'sandbox', value: sandboxRecord({ id, state: 'starting', updatedAt: 1 }), revision });
const destroyed = (revision: number, id: string): RecordChange => ({ kind: 'sandbox', value: sandboxRecord({ id, state: 'destroyed', updatedAt: 2 }), prev: sandboxRecord({ id, state: 'running', updatedAt: 1 }), revision });

function watch(store: FleetStore, ac: AbortController, req: { afterRevision?: bigint } = {}): AsyncIterable<Event> {
  const handlers = fleetService({ fleet: {} as Fleet, store, clock: { now: () => Date.now() } }).handlers as unknown as {
    watchEvents: (req: ReturnType<typeof create<typeof WatchEventsRequestSchema>>, ctx: CallContext) => AsyncIterable<Event>;
  };
  const ctx: CallContext = { signal: ac.signal, deadline: undefined, metadata: new Metadata(), peer: 'test', method: 'WatchEvents', principal: { tenantId: 't1', admin: false, credentialId: 'c1' } } as CallContext;
  return handlers.watchEvents(create(WatchEventsRequestSchema, req), ctx);
}

const tick = (): Promise<void> => new Promise((r) => setImmediate(r));

async function drain(it: AsyncIterable<Event>): Promise<{ events: Event[]; error: unknown }> {
  const events: Event[] = [];
  try {
    for await (const ev of it) events.push(ev);
    return { events, error: undefined };
  } catch (error) {
    return { events, error };
  }
}

describe('WatchEvents', () => {
  it('eventsArrivingAfterTheClientCancelled_areDropped_notThrown', async () => {
    const { store, emit, state } = drivenStore();
    const ac = new AbortController();
    const stream = watch(store, ac);
    await new Promise((r) => setImmediate(r));
    ac.abort();
    // etcd delivers until its cancel lands: this used to throw "push after end" out of the
    // watch's listener, which etcd3 rethrows, and the whole API replica exited.
    expect(() => emit(created(5, 'sb-late'))).not.toThrow();
    expect(state.stopped).toBe(true);
    expect((await drain(stream)).events).toHaveLength(0);
  });

  it('clientThatDoesNotRead_hasItsStreamEndedAtARevisionBoundary_withTheRevisionToResumeAfter', async () => {
    const { store, emit, state } = drivenStore();
    const stream = watch(store, new AbortController());
    await new Promise((r) => setImmediate(r));
    // 4,095 events queue up unread; three at one revision after them all go in, past the
    // 4,096 cap (a transaction's events are never split); the next revision ends the stream.
    for (let r = 1; r <= 4095; r++) emit(created(r, `sb-${r}`));
    for (const id of ['sb-a', 'sb-b', 'sb-c']) emit(created(5000, id));
    emit(created(5001, 'sb-over'));
    expect(state.stopped).toBe(true);
    const { events, error } = await drain(stream);
    expect(events).toHaveLength(4098);
    expect(events.at(-1)?.revision).toBe(5000n);
    expect(error).toBeInstanceOf(ForkfleetError);
    expect((error as ForkfleetError).kind).toBe('resource_exhausted');
    expect((error as Error).message).toMatch(/after_revision 5000/);
  });

  it('storeWatchThatBreaksOff_endsTheStreamUnavailable_namingTheRevisionToResumeAfter', async () => {
    const { store, emit, fail } = drivenStore();
    const stream = watch(store, new AbortController());
    await new Promise((r) => setImmediate(r));
    emit(created(7, 'sb-1'));
    fail(new Error('watch stream disconnected'));
    const { events, error } = await drain(stream);
    expect(events.map((e) => e.sandboxId)).toEqual(['sb-1']);
    expect((error as ForkfleetError).kind).toBe('unavailable');
    expect((error as Error).message).toMatch(/after_revision 7/);
  });

  it('resumeFromTheRevisionJustBeforeTheCompactedOne_isFailedPrecondition_notADestroyReplayedAsACreate', async () => {
    // Compacted to 11: the destroy at 11 is still in the history, its previous value (read at
    // 10) is not. Resuming after 10 used to open a watch from 11 and send sandbox_created.
    const store = historyStore([created(5, 'sb-1'), destroyed(11, 'sb-1')], 11);
    const ac = new AbortController();
    const timer = setTimeout(() => ac.abort(), 500);
    const { events, error } = await drain(watch(store, ac, { afterRevision: 10n }));
    clearTimeout(timer);
    expect(events.map((e) => EventType[e.type])).toEqual([]);
    expect(error).toBeInstanceOf(ForkfleetError);
    expect((error as ForkfleetError).kind).toBe('failed_precondition');
    expect((error as ForkfleetError).field).toBe('after_revision');
    expect((error as Error).message).toMatch(/revision 10 is compacted away/);
  });

  it('resumeFromTheCompactedRevisionItself_replaysTheChangesAfterIt_withTheirPreviousValues', async () => {
    const store = historyStore([created(5, 'sb-1'), created(11, 'sb-2'), destroyed(12, 'sb-1')], 11);
    const ac = new AbortController();
    const seen: string[] = [];
    for await (const e of watch(store, ac, { afterRevision: 11n })) {
      seen.push(`${e.revision}:${EventType[e.type]}:${e.sandboxId}`);
      ac.abort();
    }
    expect(seen).toEqual(['12:SANDBOX_DESTROYED:sb-1']);
  });

  it('watchFromNow_sendsAProgressMarkerAtTheStoresRevisionFirst_soABreakBeforeAnyEventResumesExactly', async () => {
    const { store, fail, state } = drivenStore(42);
    const stream = watch(store, new AbortController());
    await tick();
    await tick();
    expect(state.from).toBe(42); // changes after 42 only, none of them missed
    fail(new Error('watch stream disconnected'));
    const { events, error } = await drain(stream);
    expect(events.map((e) => [e.type, e.revision])).toEqual([[EventType.UNSPECIFIED, 42n]]);
    expect((error as ForkfleetError).kind).toBe('unavailable');
    // Was "resume with after_revision 0": from now again, and what happened meanwhile was lost.
    expect((error as Error).message).toMatch(/after_revision 42\b/);
  });

  it('watchFromNow_skipsTheChangesAtTheRevisionItBeganAt_andSendsTheOnesAfter', async () => {
    const { store, emit } = drivenStore(42);
    const ac = new AbortController();
    const stream = watch(store, ac);
    await tick();
    await tick();
    emit(created(42, 'sb-before'));
    emit(created(43, 'sb-after'));
    ac.abort();
    const { events } = await drain(stream);
    expect(events.map((e) => `${e.revision}:${e.sandboxId}`)).toEqual(['42:', '43:sb-after']);
  });

  it('compactedCancelOfAWatchThatPassedChangesOn_isUnavailableNamingTheLastRevisionQueued_notFailedPrecondition', async () => {
    const { store, emit, fail } = drivenStore(100);
    const stream = watch(store, new AbortController(), { afterRevision: 5n });
    await tick();
    await tick();
    emit(created(6, 'sb-1'));
    emit(created(9, 'sb-2'));
    // The store reports any cancel of a watch whose start is compacted by now as "compacted".
    fail(new Error('watch from revision 5: required revision has been compacted'));
    const { events, error } = await drain(stream);
    expect(events.map((e) => e.sandboxId)).toEqual(['sb-1', 'sb-2']);
    expect((error as ForkfleetError).kind).toBe('unavailable');
    expect((error as Error).message).toMatch(/after_revision 9\b/);
  });

  it('compactedCancelOfAWatchThatPassedOnlyProgressOn_isUnavailable_withTheResumePointItHad', async () => {
    const { store, progress, fail } = drivenStore(100);
    const stream = watch(store, new AbortController(), { afterRevision: 5n });
    await tick();
    await tick();
    progress(50); // other keys' changes: the watch started, its start was not compacted then
    fail(new Error('watch from revision 5: required revision has been compacted'));
    const { events, error } = await drain(stream);
    expect(events).toHaveLength(0);
    expect((error as ForkfleetError).kind).toBe('unavailable');
    expect((error as Error).message).toMatch(/after_revision 5\b/);
  });

  it('compactedCancelBeforeTheWatchPassedAnythingOn_isFailedPreconditionNamingAfterRevision', async () => {
    const { store, fail } = drivenStore(100);
    const stream = watch(store, new AbortController(), { afterRevision: 5n });
    await tick();
    await tick();
    fail(new Error('watch from revision 5: required revision has been compacted'));
    const { error } = await drain(stream);
    expect((error as ForkfleetError).kind).toBe('failed_precondition');
    expect((error as ForkfleetError).field).toBe('after_revision');
  });
});
