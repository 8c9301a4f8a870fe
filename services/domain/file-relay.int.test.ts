// The scheduler's file relay against a host agent that predates ranged files (no
// Heartbeat.ranged_files): real etcd and NATS, the agent's side played by a responder that
// answers as the old agent did (whole-file reads cut at max_bytes, every write truncating).
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { connect } from 'nats';
import type { NatsConnection } from 'nats';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import { startEtcd } from '../testkit/etcd.ts';
import type { EtcdCluster } from '../testkit/etcd.ts';
import { startNats } from '../testkit/nats.ts';
import type { NatsServer } from '../testkit/nats.ts';
import { EtcdFleetStore } from '../adapters/etcd/store.ts';
import { NatsWorkBus } from '../adapters/nats/bus.ts';
import { subjects } from '../adapters/nats/subjects.ts';
import { Fleet } from './fleet.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import { systemClock } from './ports.ts';
import type { SandboxRec } from './records.ts';
import { HeartbeatSchema, HostFileRequestSchema, HostFileResponseSchema } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';

describe('file relay to an agent without ranged files (real etcd, NATS)', () => {
  let etcd: EtcdCluster;
  let nats: NatsServer;
  let nc: NatsConnection;
  let store: EtcdFleetStore;
  let fleet: Fleet;
  const heard = new HeartbeatRegistry();
  const file = { data: Buffer.alloc(0) };
  const requests: Array<{ offset: bigint; maxBytes: bigint; append?: boolean }> = [];

  beforeAll(async () => {
    [etcd, nats] = await Promise.all([startEtcd(), startNats()]);
    store = EtcdFleetStore.connect(etcd.endpoints);
    nc = await connect({ servers: nats.url });
    fleet = new Fleet({ store, bus: await NatsWorkBus.create(nc), clock: systemClock, heard, liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 } });
    // The old agent: no ranged_files in its heartbeat, offset and append unknown to it.
    heard.record(create(HeartbeatSchema, { hostId: 'old-1', seq: 1n, bootId: 'b' }), Date.now());
    nc.subscribe(subjects.file('old-1'), {
      callback: (_e, m) => {
        const req = fromBinary(HostFileRequestSchema, m.data);
        if (req.op.case === 'write') {
          requests.push({ offset: 0n, maxBytes: 0n, append: req.op.value.append });
          file.data = Buffer.from(req.op.value.data);
          m.respond(toBinary(HostFileResponseSchema, create(HostFileResponseSchema, { bytesWritten: BigInt(req.op.value.data.length) })));
        } else if (req.op.case === 'read') {
          requests.push({ offset: req.op.value.offset, maxBytes: req.op.value.maxBytes });
          const max = Number(req.op.value.maxBytes);
          m.respond(toBinary(HostFileResponseSchema, create(HostFileResponseSchema, { data: max > 0 ? file.data.subarray(0, max) : file.data })));
        }
      },
    });
    const now = Date.now();
    const sb: SandboxRec = {
      id: 'sb-aaaaaaaaaaaaaaaaaaaa', tenantId: 't', state: 'running', stateReason: '', hostId: 'old-1', resources: { vcpus: 1, memoryMib: 256, diskMib: 1024 },
      image: 'tiny', sourceSnapshotId: '', lineageId: 'sb-aaaaaaaaaaaaaaaaaaaa', hostname: 'x', labels: {}, ttlMs: null, idleTimeoutMs: null, allowEgress: false,
      createdAt: now, updatedAt: now, runningMsBefore: 0, runningSince: now, hibernationSnapshotId: '', opId: '',
    };
    await store.commit([{ kind: 'sandbox', value: sb, expectRevision: 0 }]);
    // A current agent: ranged reads that say when they reached the end of the file.
    heard.record(create(HeartbeatSchema, { hostId: 'new-2', seq: 1n, bootId: 'b', rangedFiles: true }), Date.now());
    nc.subscribe(subjects.file('new-2'), {
      callback: (_e, m) => {
        const req = fromBinary(HostFileRequestSchema, m.data);
        if (req.op.case !== 'read') return;
        const from = Number(req.op.value.offset);
        const data = ranged.data.subarray(from, from + Number(req.op.value.maxBytes));
        m.respond(toBinary(HostFileResponseSchema, create(HostFileResponseSchema, { data, eof: from + data.length >= ranged.data.length })));
      },
    });
    await store.commit([{ kind: 'sandbox', value: { ...sb, id: 'sb-rangedaaaaaaaaaaaaa', hostId: 'new-2' }, expectRevision: 0 }]);
  }, 60_000);
  const ranged = { data: Buffer.alloc(0) };

  afterAll(async () => {
    await nc?.close();
    store?.close();
    await nats?.stop();
    await etcd?.stop();
  });

  it('oldAgent_getsEachFileInOneMessage_andFilesOverAPieceFailClearlyInsteadOfCorrupting', async () => {
    const small = Buffer.from('a small file');
    expect(await fleet.writeFile('t', 'sb-aaaaaaaaaaaaaaaaaaaa', '/tmp/f', 0o644, small)).toBe(small.length);
    expect(Buffer.from(await fleet.readFile('t', 'sb-aaaaaaaaaaaaaaaaaaaa', '/tmp/f', 64 << 20)).equals(small)).toBe(true);
    expect(requests.map((r) => r.append ?? r.offset)).toEqual([false, 0n]);
    // Over one piece: a refusal naming the field, nothing sent.
    requests.length = 0;
    await expect(fleet.writeFile('t', 'sb-aaaaaaaaaaaaaaaaaaaa', '/tmp/f', 0, Buffer.alloc(2 << 20))).rejects.toMatchObject({ kind: 'failed_precondition', field: 'data' });
    expect(requests).toEqual([]);
    file.data = Buffer.alloc(2 << 20, 7);
    await expect(fleet.readFile('t', 'sb-aaaaaaaaaaaaaaaaaaaa', '/tmp/f', 64 << 20)).rejects.toMatchObject({ kind: 'failed_precondition', field: 'max_bytes' });
    // One capped request (its answer fits a NATS message), not repeated copies of the first piece.
    expect(requests).toHaveLength(1);
    expect(Number(requests[0]!.maxBytes)).toBeLessThanOrEqual(512 << 10);
  });

  it('readFile_ofTheWholeFile_longerThanTheLimit_isRefusedNamingMaxBytes_notCutShort_whileAnAskedMaxBytesCutsIt', async () => {
    const id = 'sb-rangedaaaaaaaaaaaaa';
    ranged.data = Buffer.alloc(3 << 20, 5);
    // Whole file asked (max_bytes 0), the limit 2 MiB here: refused, not 2 MiB of a 3 MiB file.
    await expect(fleet.readFile('t', id, '/tmp/big', 2 << 20, true)).rejects.toMatchObject({ kind: 'failed_precondition', field: 'max_bytes' });
    // A part asked for: that part.
    expect((await fleet.readFile('t', id, '/tmp/big', 2 << 20, false)).length).toBe(2 << 20);
    // A whole file of exactly the limit, and a short one, come back whole.
    ranged.data = Buffer.alloc(2 << 20, 6);
    expect(Buffer.from(await fleet.readFile('t', id, '/tmp/big', 2 << 20, true)).equals(ranged.data)).toBe(true);
    ranged.data = Buffer.from('short');
    expect(Buffer.from(await fleet.readFile('t', id, '/tmp/big', 2 << 20, true)).toString()).toBe('short');
  });

  it('writeFileRefusals_nameItsHeaderFields_aSandboxNotRunning_andAModeTheGuestCouldNotSet_keepingTheHostsRetryableFlag', async () => {
    const now = Date.now();
    const base = (await store.getSandbox('t', 'sb-aaaaaaaaaaaaaaaaaaaa'))!.value;
    await store.commit([{ kind: 'sandbox', value: { ...base, id: 'sb-pausedaaaaaaaaaaaaa', state: 'paused', runningSince: null, updatedAt: now }, expectRevision: 0 }]);
    await expect(fleet.writeFile('t', 'sb-pausedaaaaaaaaaaaaa', '/tmp/f', 0o644, Buffer.from('x'))).rejects.toMatchObject({ kind: 'failed_precondition', field: 'header.sandbox_id' });
    // A current agent whose guest refused the chmod: it names `mode`, and says not to retry.
    heard.record(create(HeartbeatSchema, { hostId: 'new-1', seq: 1n, bootId: 'b', rangedFiles: true }), Date.now());
    const sub = nc.subscribe(subjects.file('new-1'), {
      callback: (_e, m) => m.respond(toBinary(HostFileResponseSchema, create(HostFileResponseSchema, { error: { kind: 'failed_precondition', message: 'chmod 4755 /tmp/f in the guest failed (exit 1)', field: 'mode', retryable: false } }))),
    });
    try {
      await store.commit([{ kind: 'sandbox', value: { ...base, id: 'sb-newhostaaaaaaaaaaaa', hostId: 'new-1', updatedAt: now }, expectRevision: 0 }]);
      await expect(fleet.writeFile('t', 'sb-newhostaaaaaaaaaaaa', '/tmp/f', 0o4755, Buffer.from('x'))).rejects.toMatchObject({ kind: 'failed_precondition', field: 'header.mode', retryable: false });
    } finally {
      sub.unsubscribe();
    }
  });

  it('fileCalls_whoseCallHasEnded_writeNothing_andReadNoFurtherPiece', async () => {
    const ended = new AbortController();
    ended.abort();
    requests.length = 0;
    await expect(fleet.writeFile('t', 'sb-aaaaaaaaaaaaaaaaaaaa', '/tmp/f', 0o644, Buffer.from('x'), ended.signal)).rejects.toMatchObject({ kind: 'cancelled' });
    expect(requests).toEqual([]);
    // Ended after the first piece of a 3 MiB read: no second piece is asked for.
    ranged.data = Buffer.alloc(3 << 20, 1);
    const mid = new AbortController();
    let pieces = 0;
    const hold = (): void => {
      pieces++;
      mid.abort();
    };
    await expect(fleet.readFile('t', 'sb-rangedaaaaaaaaaaaaa', '/tmp/big', 3 << 20, false, hold, mid.signal)).rejects.toMatchObject({ kind: 'cancelled' });
    expect(pieces).toBe(1);
  });
});
