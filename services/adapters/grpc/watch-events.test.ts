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
import type { Event } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import { ForkfleetError } from '../../../proto/errors.ts';
import { sandboxRecord } from '../../testkit/records.ts';

/** A store watch the test feeds by hand; `stopped` once the service cancels it. */
function drivenStore(): { store: FleetStore; emit: (ch: RecordChange) => void; fail: (e: unknown) => void; state: { stopped: boolean } } {
  let onChange: ((ch: RecordChange) => void) | undefined;
  let onError: ((e: unknown) => void) | undefined;
  const state = { stopped: false };
  const store = {
    watchRecords: async (cb: (ch: RecordChange) => void, opts: { onError?: (e: unknown) => void } = {}) => {
      onChange = cb;
      onError = opts.onError;
      return () => void (state.stopped = true);
    },
  } as unknown as FleetStore;
  return { store, emit: (ch) => onChange?.(ch), fail: (e) => onError?.(e), state };
}

const created = (revision: number, id: string): RecordChange => ({ kind: 'sandbox', value: sandboxRecord({ id, state: 'starting', updatedAt: 1 }), revision });

function watch(store: FleetStore, ac: AbortController): AsyncIterable<Event> {
  const handlers = fleetService({ fleet: {} as Fleet, store, clock: { now: () => Date.now() } }).handlers as unknown as {
    watchEvents: (req: ReturnType<typeof create<typeof WatchEventsRequestSchema>>, ctx: CallContext) => AsyncIterable<Event>;
  };
  const ctx: CallContext = { signal: ac.signal, deadline: undefined, metadata: new Metadata(), peer: 'test', method: 'WatchEvents', principal: { tenantId: 't1', admin: false, credentialId: 'c1' } } as CallContext;
  return handlers.watchEvents(create(WatchEventsRequestSchema, {}), ctx);
}

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
});
