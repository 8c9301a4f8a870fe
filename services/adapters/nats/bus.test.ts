import { describe, expect, it } from 'vitest';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import type { MessageInitShape } from '@bufbuild/protobuf';
import type { JetStreamManager, NatsConnection, Status } from 'nats';
import { HeartbeatSchema, HostExecCancelSchema, HostExecOutputSchema, HostExecRequestSchema, VmState } from '../../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type { HostExecOutput } from '../../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { AsyncQueue } from '../grpc/queue.ts';
import { ForkfleetError } from '../../../proto/errors.ts';
import { decodeHeartbeat, NatsWorkBus } from './bus.ts';
import { ensureStreams, STREAM_WORK, subjects } from './subjects.ts';

describe('decodeHeartbeat', () => {
  const hb = create(HeartbeatSchema, {
    hostId: 'h1',
    seq: 7n,
    bootId: 'boot',
    capacity: { vcpus: 8, memoryMib: 1024n },
    vms: Array.from({ length: 50 }, (_, i) => ({ sandboxId: `sb-${i}`, state: VmState.RUNNING, rssBytes: BigInt(i), idle: { seconds: BigInt(i), nanos: 5 } })),
    snapshots: [{ snapshotId: 'sn-1', complete: true }],
    peerAddress: '127.0.0.1:1',
    inflightOps: 3,
  });

  it('decodeHeartbeat_withVms_equalsAFullDecodeWhenVmsAreRead', () => {
    const bytes = toBinary(HeartbeatSchema, hb);
    const lazy = decodeHeartbeat(bytes);
    expect(lazy.hostId).toBe('h1');
    expect(lazy.snapshots.map((s) => s.snapshotId)).toEqual(['sn-1']);
    expect(lazy.vms.map((v) => v.sandboxId)).toEqual(hb.vms.map((v) => v.sandboxId));
    expect({ ...lazy, vms: [...lazy.vms] }).toEqual(fromBinary(HeartbeatSchema, bytes));
  });

  it('decodeHeartbeat_withVmEntriesInterleavedWithOtherFields_stillEqualsAFullDecode', () => {
    // Protobuf allows any field order; our encoder writes the list in one run, another may not.
    const vmOnly = (i: number): Uint8Array => toBinary(HeartbeatSchema, create(HeartbeatSchema, { vms: [hb.vms[i]!] }));
    const other = toBinary(HeartbeatSchema, create(HeartbeatSchema, { ...hb, vms: [] }));
    const bytes = Buffer.concat([vmOnly(0), other.subarray(0, 4), vmOnly(1), other.subarray(4), vmOnly(2)]);
    const lazy = decodeHeartbeat(bytes);
    expect({ ...lazy, vms: [...lazy.vms] }).toEqual(fromBinary(HeartbeatSchema, bytes));
    expect(lazy.vms.map((v) => v.sandboxId)).toEqual(['sb-0', 'sb-1', 'sb-2']);
  });

  it('decodeHeartbeat_withoutVms_decodesAsUsual', () => {
    const bytes = toBinary(HeartbeatSchema, create(HeartbeatSchema, { ...hb, vms: [] }));
    expect(decodeHeartbeat(bytes)).toEqual(fromBinary(HeartbeatSchema, bytes));
  });

  it('decodeHeartbeat_whenMalformed_throws', () => {
    expect(() => decodeHeartbeat(new Uint8Array([0x42, 0xff, 0xff]))).toThrow();
  });
});

/**
 * A NatsConnection of our own making, enough for NatsWorkBus.exec: what is published is
 * recorded, `deliver` calls the subscription of a subject, `status` pushes a status event.
 * (These tests are about what the bus does at a reconnect, which a real server cannot be
 * made to lose messages in on cue; bus.int.test.ts runs the exec relay against one.)
 */
function fakeNc() {
  const subs = new Map<string, (err: Error | null, m: { data: Uint8Array; subject: string }) => void>();
  const published: Array<{ subject: string; data: Uint8Array; reply?: string }> = [];
  const statuses = new AsyncQueue<Status>();
  const nc = {
    subscribe: (subject: string, opts: { callback: (err: Error | null, m: { data: Uint8Array; subject: string }) => void }) => {
      subs.set(subject, opts.callback);
      return { unsubscribe: () => void subs.delete(subject) };
    },
    publish: (subject: string, data: Uint8Array, opts?: { reply?: string }) => void published.push({ subject, data, ...(opts?.reply ? { reply: opts.reply } : {}) }),
    status: () => statuses,
    jetstream: () => ({}),
    closed: () => new Promise(() => undefined),
    isClosed: () => false,
    options: {},
  };
  return {
    nc: nc as unknown as NatsConnection,
    published,
    deliver: (subject: string, out: MessageInitShape<typeof HostExecOutputSchema>) => subs.get(subject)?.(null, { subject, data: toBinary(HostExecOutputSchema, create(HostExecOutputSchema, out)) }),
    status: (type: 'disconnect' | 'reconnect') => statuses.push({ type, data: '' } as Status),
  };
}

/** A bus over `nc` without JetStream set up (create() would ask a server for the streams). */
function busOver(nc: NatsConnection): NatsWorkBus {
  return new (NatsWorkBus as unknown as new (nc: NatsConnection, jsm: unknown, streamReplicas: number, log: undefined) => NatsWorkBus)(nc, {}, 1, undefined);
}

/** The next read of `it`, or 'still waiting' after `ms`. */
async function nextWithin<T>(it: AsyncIterator<T>, ms: number): Promise<IteratorResult<T> | 'still waiting'> {
  let t: ReturnType<typeof setTimeout> | undefined;
  try {
    return await Promise.race([it.next(), new Promise<'still waiting'>((r) => (t = setTimeout(() => r('still waiting'), ms)))]);
  } finally {
    clearTimeout(t);
  }
}

describe('NatsWorkBus.exec whose output may be lost in a reconnect', () => {
  const req = create(HostExecRequestSchema, { sandboxId: 'sb-1', argv: ['sleep', '5'] });
  const cancels = (f: ReturnType<typeof fakeNc>): string[] => f.published.filter((p) => p.subject === subjects.execCancel('h1')).map((p) => fromBinary(HostExecCancelSchema, p.data).replySubject);

  it('exec_whoseHostAnswersAKeepaliveThatItRunsNoSuchExec_failsUnavailableAtOnce', async () => {
    const f = fakeNc();
    const bus = busOver(f.nc);
    try {
      const it = bus.exec('h1', req, { timeoutMs: 60_000 })[Symbol.asyncIterator]();
      const inbox = f.published.find((p) => p.subject === subjects.exec('h1'))!.reply!;
      f.deliver(inbox, { seq: 1n, payload: { case: 'stdout', value: new TextEncoder().encode('hi') } });
      expect(((await it.next()).value as HostExecOutput).payload.case).toBe('stdout');
      // The exit went out while a connection was down and is gone; the host's answer to the
      // next keepalive (agent-bus.ts NO_SUCH_EXEC) says it runs no such exec.
      f.deliver(inbox, { seq: 0n, payload: { case: 'error', value: { kind: 'unavailable', message: 'host h1 runs no exec for this call' } } });
      // Before, the call waited out its whole timeout (here a minute; up to an hour and 10 s).
      const r = nextWithin(it, 1000);
      await expect(r).rejects.toBeInstanceOf(ForkfleetError);
      await expect(r).rejects.toMatchObject({ kind: 'unavailable', retryable: false, message: expect.stringMatching(/runs no exec for this call/) });
      // And the host is no longer told that anyone waits for it.
      expect((bus as unknown as { execsWaiting: Map<string, unknown> }).execsWaiting.size).toBe(0);
    } finally {
      bus.close();
    }
  });

  it('exec_openAcrossADisconnectThatLostNothing_goesOnToItsExit', async () => {
    const f = fakeNc();
    const bus = busOver(f.nc);
    try {
      const it = bus.exec('h1', req, { timeoutMs: 60_000 })[Symbol.asyncIterator]();
      const inbox = f.published.find((p) => p.subject === subjects.exec('h1'))!.reply!;
      f.status('disconnect');
      f.status('reconnect');
      await new Promise((r) => setImmediate(r));
      const next = it.next();
      expect(await Promise.race([next, new Promise((r) => setTimeout(() => r('still waiting'), 200))])).toBe('still waiting');
      f.deliver(inbox, { seq: 1n, payload: { case: 'exit', value: { exitCode: 0 } } });
      expect(((await next).value as HostExecOutput).payload.case).toBe('exit');
      expect(cancels(f)).toEqual([]);
    } finally {
      bus.close();
    }
  });

  it('exec_startedAfterAReconnect_orEndedBeforeTheDisconnect_isLeftAlone', async () => {
    const f = fakeNc();
    const bus = busOver(f.nc);
    try {
      const done = bus.exec('h1', req, { timeoutMs: 60_000 })[Symbol.asyncIterator]();
      const doneInbox = f.published.find((p) => p.subject === subjects.exec('h1'))!.reply!;
      f.deliver(doneInbox, { seq: 1n, payload: { case: 'exit', value: { exitCode: 0 } } });
      f.status('disconnect');
      f.status('reconnect');
      await new Promise((r) => setImmediate(r));
      const later = bus.exec('h1', req, { timeoutMs: 60_000 })[Symbol.asyncIterator]();
      const laterInbox = f.published.filter((p) => p.subject === subjects.exec('h1'))[1]!.reply!;
      expect(((await done.next()).value as HostExecOutput).payload.case).toBe('exit');
      const next = later.next();
      expect(await Promise.race([next, new Promise((r) => setTimeout(() => r('still waiting'), 200))])).toBe('still waiting');
      f.deliver(laterInbox, { seq: 1n, payload: { case: 'exit', value: { exitCode: 0 } } });
      expect(((await next).value as HostExecOutput).payload.case).toBe('exit');
      expect(cancels(f)).toEqual([]);
    } finally {
      bus.close();
    }
  });
});

describe('ensureStreams', () => {
  it('ensureStreams_whenTheStreamsAreMissing_makesTheWorkStreamLast', async () => {
    // Streams lost under a running fleet and made again: an agent may take a step as soon as
    // the work stream exists, and its result then needs the results stream.
    const made: string[] = [];
    const jsm = {
      streams: {
        info: () => Promise.reject(new Error('stream not found')),
        add: (c: { name: string }) => (made.push(c.name), Promise.resolve({})),
      },
    } as unknown as JetStreamManager;
    await ensureStreams(jsm);
    expect(made).toHaveLength(3);
    expect(made.at(-1)).toBe(STREAM_WORK);
  });
});
