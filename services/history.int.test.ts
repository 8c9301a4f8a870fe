// Bounded history (services/domain/history.ts, ADR 0017) with real etcd, real nats-server,
// a scheduler process and fake host agents: expired records go, live ones stay, a new
// leader expires what the old one finished, and etcd's history is compacted.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { readFileSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { startEtcd } from './testkit/etcd.ts';
import type { EtcdCluster } from './testkit/etcd.ts';
import { startNats } from './testkit/nats.ts';
import type { NatsServer } from './testkit/nats.ts';
import { waitFor, tempDir } from './testkit/proc.ts';
import { startFakeAgents, startSchedulerProcess } from './testkit/fleet-procs.ts';
import type { FakeAgentsProcess, SchedulerProcess } from './testkit/fleet-procs.ts';
import { loadSigningKey } from './scheduler.ts';
import { EtcdFleetStore } from './adapters/etcd/store.ts';
import { keys } from './adapters/etcd/keys.ts';
import type { Client } from './adapters/grpc/rpc.ts';
import type { RpcError } from './adapters/grpc/status.ts';
import { FleetService, OperationState } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { Operation } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import { status as Status } from '@grpc/grpc-js';
import { connect } from 'nats';
import { subjects } from './adapters/nats/subjects.ts';
import { decodeHeartbeat } from './adapters/nats/bus.ts';
import type { OperationRec } from './domain/records.ts';

type Fleet = Client<(typeof FleetService)['method']>;
const tenantId = 't1';
const RETENTION = '3s';

describe('history retention and etcd compaction (real etcd, NATS, fake agents)', () => {
  let etcd: EtcdCluster;
  let nats: NatsServer;
  let dir: string;
  let store: EtcdFleetStore;
  let fakes: FakeAgentsProcess;
  let signingKeyPath: string;
  const scheds: SchedulerProcess[] = [];
  let api: Fleet;

  const start = async (id: string): Promise<SchedulerProcess> => {
    const s = await startSchedulerProcess({ id, dir, etcdEndpoints: etcd.endpoints, natsUrl: nats.url, signingKeyPath, env: { FF_RECORD_RETENTION: RETENTION, FF_ETCD_COMPACT_INTERVAL: '1s', FF_ELECTION_TTL: '1s', FF_HELD_SNAPSHOT_CHECK: '1s' } });
    scheds.push(s);
    return s;
  };
  const ok = async (op: Operation): Promise<Operation> => {
    const f = await api.waitOperation({ tenantId, operationId: op.id, timeout: { seconds: 30n } }, { timeoutMs: 40_000 });
    if (f.state !== OperationState.SUCCEEDED) throw new Error(`operation ${op.id} ${OperationState[f.state]}: ${f.error?.message}`);
    return f;
  };
  const create = async (idempotencyKey: string): Promise<{ op: Operation; sandboxId: string }> => {
    const op = await ok(await api.createSandbox({ tenantId, idempotencyKey, source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }));
    return { op, sandboxId: op.result.case === 'sandbox' ? op.result.value.id : '' };
  };

  const snapshot = async (sandboxId: string, idempotencyKey: string): Promise<string> => {
    const op = await ok(await api.snapshotSandbox({ tenantId, idempotencyKey, sandboxId }));
    return op.result.case === 'snapshot' ? op.result.value.id : '';
  };

  /** Waits until the leader has compacted etcd past `rev` (a read at `rev` fails as compacted). */
  const compactedPast = (rev: number): Promise<void> =>
    waitFor(`a compaction past revision ${rev}`, async () => {
      try {
        await store.etcd.get(keys.hosts()).revision(String(rev)).exec();
        return false;
      } catch (e) {
        return /compacted/i.test(String(e));
      }
    }, 20_000, 250);

  beforeAll(async () => {
    dir = tempDir('ff-history-');
    [etcd, nats] = await Promise.all([startEtcd(), startNats()]);
    store = EtcdFleetStore.connect(etcd.endpoints);
    signingKeyPath = join(dir, 'signing.pem');
    loadSigningKey(signingKeyPath, 'scheduler-1');
    const s = await start('h1');
    fakes = await startFakeAgents({ hosts: ['hist-1', 'hist-2'], dataDir: join(dir, 'fleet'), natsUrl: nats.url, logDir: dir });
    api = s.credentials.client(FleetService, s.api);
    await waitFor('leader', () => s.isLeader(), 20_000, 100);
    await waitFor('hosts registered', async () => (await api.listHosts({})).hosts.length === 2, 30_000, 100);
  }, 120_000);

  afterAll(async () => {
    api?.close();
    store?.close();
    await fakes?.stop();
    for (const s of scheds) await s.proc.stop();
    await nats?.stop();
    await etcd?.stop();
    if (dir && !process.env.FF_KEEP) rmSync(dir, { recursive: true, force: true });
  }, 60_000);

  it('retention_deletesDestroyedSandboxesAndFinishedOpsWithTheirKeys_andKeepsLiveSandboxes', async () => {
    const kept = await create('keep-1');
    const gone = await create('gone-1');
    const destroy = await ok(await api.destroySandbox({ tenantId, idempotencyKey: 'destroy-1', sandboxId: gone.sandboxId }));
    // Within the retention the key still answers with the same operation.
    expect((await api.destroySandbox({ tenantId, idempotencyKey: 'destroy-1', sandboxId: gone.sandboxId })).id).toBe(destroy.id);
    await waitFor('the destroyed sandbox and its ops expire', async () => (await store.getSandbox(tenantId, gone.sandboxId)) === undefined && (await store.getOp(tenantId, destroy.id)) === undefined, 30_000, 250);
    expect(await store.getIdempotent(tenantId, 'destroy-1')).toBeUndefined();
    await waitFor('the create ops expire', async () => (await store.getOp(tenantId, kept.op.id)) === undefined && (await store.getOp(tenantId, gone.op.id)) === undefined, 30_000, 250);
    // The running sandbox stays, and answers as before.
    expect((await store.getSandbox(tenantId, kept.sandboxId))?.value.state).toBe('running');
    expect((await api.getSandbox({ tenantId, sandboxId: kept.sandboxId })).id).toBe(kept.sandboxId);
    // The expired sandbox is gone from the API too.
    const e = (await api.getSandbox({ tenantId, sandboxId: gone.sandboxId }).catch((x: unknown) => x)) as RpcError;
    expect(e.code).toBe(Status.NOT_FOUND);
    // After the retention a reused key starts a new operation.
    const again = await create('keep-1');
    expect(again.op.id).not.toBe(kept.op.id);
    expect(again.sandboxId).not.toBe(kept.sandboxId);
  }, 90_000);

  it('retention_deletesTheRecordOfADeletedSnapshot_andKeepsAReadyOne', async () => {
    const src = await create('snap-src');
    const [keep, drop] = [await snapshot(src.sandboxId, 'snap-keep'), await snapshot(src.sandboxId, 'snap-drop')];
    await ok(await api.deleteSnapshot({ tenantId, idempotencyKey: 'snap-del', snapshotId: drop }));
    expect((await store.getSnapshot(tenantId, drop))?.value.state).toBe('deleted');
    await waitFor('the deleted snapshot record expires', async () => (await store.getSnapshot(tenantId, drop)) === undefined, 30_000, 250);
    expect((await store.getSnapshot(tenantId, keep))?.value.state).toBe('ready');
    expect((await api.getSnapshot({ tenantId, snapshotId: keep })).id).toBe(keep);
    // The leader goes on placing from the kept one.
    const fork = await ok(await api.forkSandbox({ tenantId, idempotencyKey: 'snap-fork', source: { case: 'snapshotId', value: keep }, count: 2 }));
    expect(fork.result.case === 'fork' ? fork.result.value.children.length : 0).toBe(2);
  }, 90_000);

  it('retentionsDelete_ofASnapshotNotAnnouncedAndDue_keepsIt_aNewRetentionClearsAnAnnouncement_theSameOneSetAgainKeepsIt_andOneDueIsDeleted', async () => {
    const src = await create('exp-src');
    const snap = async (key: string, keepLast = 0): Promise<string> => {
      const op = await ok(await api.snapshotSandbox({ tenantId, idempotencyKey: key, sandboxId: src.sandboxId, retention: { keepLast } }));
      return op.result.case === 'snapshot' ? op.result.value.id : '';
    };
    const dueAt = async (id: string): Promise<number | null> => (await store.getSnapshot(tenantId, id))?.value.expiryDueAt ?? null;
    /** The delete retention submits for a snapshot it planned gone (Executor: `__expire/<id>/<rev>`). */
    const expire = async (sn: string, n: number): Promise<OperationRec> => {
      const now = Date.now();
      const id = `op-exp${String(n).padStart(17, '0')}`;
      const op: OperationRec = { id, tenantId, kind: 'delete_snapshot', state: 'pending', createdAt: now, updatedAt: now, targetId: sn, input: { reason: 'expired' }, progress: { done: 0, total: 0, message: 'queued', bytesTransferred: 0 }, result: null, error: null, steps: {} };
      expect(await store.commit([{ kind: 'op', value: op, expectRevision: 0 }])).toBe(true);
      await waitFor(`op ${id} ends`, async () => ['succeeded', 'failed'].includes((await store.getOp(tenantId, id))?.value.state ?? ''), 20_000, 50);
      return (await store.getOp(tenantId, id))!.value;
    };
    // Not announced (a retention set since cleared it, or a pass withdrew it): kept, and the op says so.
    const lone = await snap('exp-lone');
    const kept = await expire(lone, 1);
    expect([kept.state, kept.progress.message]).toEqual(['succeeded', expect.stringContaining('kept')]);
    expect((await store.getSnapshot(tenantId, lone))?.value.state).toBe('ready');
    // keep_last 1 of two: the older is announced; a new rule clears that in the call itself.
    const older = await snap('exp-old', 1);
    await snap('exp-new', 1);
    await waitFor('the older snapshot announced', async () => (await dueAt(older)) !== null, 20_000, 100);
    await api.setSnapshotRetention({ tenantId, idempotencyKey: 'exp-ret', snapshotId: older, retention: { keepLast: 5 } });
    expect(await dueAt(older)).toBeNull();
    // Announced again, and due: deleted.
    await api.setSnapshotRetention({ tenantId, idempotencyKey: 'exp-ret2', snapshotId: older, retention: { keepLast: 1 } });
    await waitFor('the older snapshot announced again', async () => (await dueAt(older)) !== null, 20_000, 100);
    // The same rule set again (a retry after a lost answer, a client that syncs its rules)
    // keeps the announcement: clearing it postponed the deletion by a whole notice each time.
    const announced = await dueAt(older);
    await api.setSnapshotRetention({ tenantId, idempotencyKey: 'exp-ret3', snapshotId: older, retention: { keepLast: 1 } });
    expect(await dueAt(older)).toBe(announced);
    const v = (await store.getSnapshot(tenantId, older))!;
    expect(await store.commit([{ kind: 'snapshot', value: { ...v.value, expiryDueAt: Date.now() - 1000 }, expectRevision: v.modRevision }])).toBe(true);
    expect((await expire(older, 2)).state).toBe('succeeded');
    await waitFor('the older snapshot deleted', async () => (await store.getSnapshot(tenantId, older))?.value.state === 'deleted', 20_000, 100);
  }, 90_000);

  it('forkOfASnapshot_afterItsSourceSandboxsRecordExpired_givesTheChildrenThatSandboxsDiskEgressAndHooks', async () => {
    const made = await ok(await api.createSandbox({ tenantId, idempotencyKey: 'inh-src', source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1, diskMib: 2048n }, network: { allowEgress: true, allowCidrs: ['198.51.100.0/24'] }, lifecycle: { afterResume: [{ argv: ['/bin/true'] }] } }));
    const srcId = made.result.case === 'sandbox' ? made.result.value.id : '';
    const snap = await snapshot(srcId, 'inh-snap');
    await ok(await api.destroySandbox({ tenantId, idempotencyKey: 'inh-destroy', sandboxId: srcId }));
    await waitFor('the source sandbox record expires', async () => (await store.getSandbox(tenantId, srcId)) === undefined, 30_000, 250);
    const fork = await ok(await api.forkSandbox({ tenantId, idempotencyKey: 'inh-fork', source: { case: 'snapshotId', value: snap }, count: 1 }));
    const child = (await store.getSandbox(tenantId, fork.result.case === 'fork' ? fork.result.value.children[0]!.id : ''))?.value;
    expect(child).toMatchObject({ resources: { diskMib: 2048 }, allowEgress: true, allowCidrs: ['198.51.100.0/24'], image: 'tiny' });
    expect(child?.afterResume?.map((h) => h.argv)).toEqual([['/bin/true']]);
  }, 90_000);

  it('aHostThatStillHoldsASnapshotWhoseRecordIsGone_isToldToDeleteIt_andKeepsTheLiveOne', async () => {
    const src = await create('held-src');
    const [live, stale] = [await snapshot(src.sandboxId, 'held-live'), await snapshot(src.sandboxId, 'held-stale')];
    // What hosts say they hold, from their heartbeats.
    const nc = await connect({ servers: nats.url });
    const held = new Map<string, Set<string>>();
    const sub = nc.subscribe(subjects.allHeartbeats, { callback: (_e, m) => {
      const hb = decodeHeartbeat(m.data);
      held.set(hb.hostId, new Set(hb.snapshots.map((x) => x.snapshotId)));
    } });
    try {
      const holds = (id: string): boolean => [...held.values()].some((s) => s.has(id));
      await waitFor('both snapshots held', async () => holds(live) && holds(stale), 10_000, 100);
      // The record of one goes (as when it expired while its host was away and missed the delete).
      const v = await store.getSnapshot(tenantId, stale);
      expect(await store.commit([{ kind: 'delete-snapshot', tenantId, id: stale, expectRevision: v!.modRevision }])).toBe(true);
      await waitFor('no host holds the snapshot whose record is gone', async () => !holds(stale), 20_000, 100);
      expect(holds(live)).toBe(true);
    } finally {
      sub.unsubscribe();
      await nc.close();
    }
  }, 60_000);

  it('aHostThatNoLongerHoldsASnapshot_isDroppedFromItsHolders_andAForkThereFetchesItFromAnother', async () => {
    const src = await create('lost-src');
    const sn = await snapshot(src.sandboxId, 'lost-snap');
    const first = (await store.getSnapshot(tenantId, sn))!.value.hostIds;
    expect(first).toHaveLength(1);
    const [a] = first as [string];
    const b = fakes.hosts.find((h) => h !== a)!;
    // A fork onto the other host fetches the snapshot there: both hold it.
    await ok(await api.forkSandbox({ tenantId, idempotencyKey: 'lost-fork-b', source: { case: 'snapshotId', value: sn }, count: 1, placement: { hostId: b } }));
    await waitFor('both hosts recorded as holders', async () => (await store.getSnapshot(tenantId, sn))!.value.hostIds.length === 2, 10_000, 100);
    // Host a loses its copy (a disk replaced, chunks found corrupt): its heartbeats stop listing it.
    rmSync(join(dir, 'fleet', a, 'vmm', 'snapshots', sn), { recursive: true });
    await fakes.restart();
    await waitFor(`${a} dropped from the snapshot's holders`, async () => JSON.stringify((await store.getSnapshot(tenantId, sn))!.value.hostIds) === JSON.stringify([b]), 30_000, 200);
    // Placement no longer takes host a for a holder: a fork there fetches the snapshot from b.
    const fork = await ok(await api.forkSandbox({ tenantId, idempotencyKey: 'lost-fork-a', source: { case: 'snapshotId', value: sn }, count: 1, placement: { hostId: a } }));
    expect(fork.result.case === 'fork' ? fork.result.value.children.map((c) => c.hostId) : []).toEqual([a]);
  }, 90_000);

  it('compaction_dropsHistoryOlderThanOneInterval_whileListsAndWatchesGoOn', async () => {
    const rev = await store.revision();
    await compactedPast(rev);
    // The leader keeps working across compactions: a new sandbox starts and is listed.
    const c = await create('after-compaction');
    expect((await api.listSandboxes({ tenantId })).sandboxes.map((s) => s.id)).toContain(c.sandboxId);
  }, 60_000);

  it('aNewLeader_expiresTheOpsTheOldLeaderFinished', async () => {
    const c = await create('before-failover');
    // The old leader dies before the op's retention has passed; the new one lists it at start.
    const old = scheds[0]!;
    old.proc.kill();
    await old.proc.exited;
    const next = await start('h2');
    await waitFor('the new leader', () => next.isLeader(), 30_000, 100);
    api.close();
    api = next.credentials.client(FleetService, next.api);
    await waitFor('the op finished under the old leader expires', async () => (await store.getOp(tenantId, c.op.id)) === undefined, 30_000, 250);
    expect(await store.getIdempotent(tenantId, 'before-failover')).toBeUndefined();
    expect((await store.getSandbox(tenantId, c.sandboxId))?.value.state).toBe('running');
  }, 90_000);

  it('etcdRestart_afterCompaction_theLeaderWatchesAgainAndKeepsPlacing', async () => {
    // The leader's watches resume from the revision each last saw; for a quiet prefix (no
    // snapshot changed in this file) that revision is compacted away by now, so etcd cancels
    // the resumed watch. The leader must watch again and list, not die on the cancel.
    const leader = scheds[scheds.length - 1]!;
    const before = await create('before-restart');
    const rev = await store.revision();
    await compactedPast(rev);
    await etcd.members[0]!.restart();
    await waitFor('the leader watches again', () => Promise.resolve(readFileSync(join(dir, `scheduler-${leader.id}.log`), 'utf8').includes('watch broke off; watching again')), 30_000, 200);
    expect(leader.proc.child.exitCode).toBeNull();
    const after = await create('after-restart');
    expect((await store.getSandbox(tenantId, after.sandboxId))?.value.state).toBe('running');
    expect((await store.getSandbox(tenantId, before.sandboxId))?.value.state).toBe('running');
  }, 90_000);
});
