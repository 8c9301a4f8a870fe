// Placements that queue up while a placement commit is in flight are committed together, in
// one transaction. A job whose own guard keeps failing (a record its caller read that changed
// since, a placement of it that landed already) must then fail alone, not take the forks it
// was grouped with down with it. A placement decided before a host was cordoned must not
// land on it, and a fork and a delete of its snapshot that overlap never both succeed. Real etcd and nats-server, a scheduler replica in this
// process (its store wrapped to slow placement commits down and to fail one fork's) and a fake
// host agent process (loadtest/fake-agent/).
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { join } from 'node:path';
import { waitFor } from './testkit/proc.ts';
import { startFakeAgents } from './testkit/fleet-procs.ts';
import type { FakeAgentsProcess } from './testkit/fleet-procs.ts';
import { startTestScheduler } from './testkit/scheduler.ts';
import type { Fleet, TestScheduler } from './testkit/scheduler.ts';
import { OperationState, SnapshotState } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { Operation } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { FleetStore, StoreWrite } from './domain/ports.ts';
import { withCommitAt } from './testkit/store-proxy.ts';
import { EtcdFleetStore } from './adapters/etcd/store.ts';
import { sandboxRecord } from './testkit/records.ts';

const tenantId = 't1';
let keyN = 0;
const key = (): string => `k-${Date.now()}-${keyN++}`;

/** What the wrapped store saw of placement commits (those that create fork children). */
interface Seen {
  /** The label value of the fork whose placements conflict, as a stale guard would. */
  poison: string;
  /** Placement commits that held a poisoned child and children of another fork. */
  poisonedGroups: number;
  /** Runs once, when the next placement commit has been decided and is about to be sent. */
  beforeNextPlacement?: () => Promise<void>;
  /** Runs once, before the next commit that marks a snapshot `deleting`. */
  beforeDeletingMark?: () => Promise<void>;
}

/**
 * Placement commits take 300 ms (so the forks submitted meanwhile queue up into one group);
 * one that creates a child labelled `poison=<seen.poison>` conflicts without writing.
 */
function slowPlacements(store: FleetStore, seen: Seen): FleetStore {
  const childOf = (w: StoreWrite): string | undefined => (w.kind === 'sandbox' && w.expectRevision === 0 && w.value.opId && w.value.state === 'starting' ? w.value.opId : undefined);
  return withCommitAt(store, async (writes, fence) => {
    if (seen.beforeDeletingMark && writes.some((w) => w.kind === 'snapshot' && w.value.state === 'deleting')) {
      const hook = seen.beforeDeletingMark;
      seen.beforeDeletingMark = undefined;
      await hook();
    }
    const ops = new Set(writes.map(childOf).filter((x): x is string => x !== undefined));
    if (ops.size === 0) return store.commitAt(writes, fence);
    const hook = seen.beforeNextPlacement;
    seen.beforeNextPlacement = undefined;
    await hook?.();
    await new Promise((r) => setTimeout(r, 300));
    const poisoned = writes.some((w) => w.kind === 'sandbox' && childOf(w) && w.value.labels['poison'] === seen.poison);
    if (!poisoned) return store.commitAt(writes, fence);
    if (ops.size > 1) seen.poisonedGroups++;
    return 0;
  });
}

describe('placement groups (real etcd, NATS, a fake agent)', () => {
  let ts: TestScheduler;
  let hosts: FakeAgentsProcess;
  let api: Fleet;
  const seen: Seen = { poison: 'off', poisonedGroups: 0 };

  beforeAll(async () => {
    ts = await startTestScheduler({ prefix: 'ff-placegroups-', seams: { executorStore: (st) => slowPlacements(st, seen) } });
    api = ts.api;
    hosts = await startFakeAgents({ hosts: ['fake-a', 'fake-b'], dataDir: join(ts.dir, 'fleet'), natsUrl: ts.nats.url, logDir: ts.dir, env: { FF_FAKE_VCPUS: '64' } });
    await waitFor('hosts registered', async () => (await api.listHosts({})).hosts.length === 2, 20_000, 100);
  }, 120_000);

  afterAll(async () => {
    await hosts?.stop();
    await ts?.stop();
  }, 60_000);

  const wait = (op: Operation): Promise<Operation> => api.waitOperation({ tenantId, operationId: op.id, timeout: { seconds: 60n } }, { timeoutMs: 70_000 });

  it('forksPlacedTogether_withOneWhoseCommitAlwaysConflicts_failOnlyThatOne', async () => {
    const made = await wait(await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-a' } }));
    expect(made.state, made.error?.message).toBe(OperationState.SUCCEEDED);
    const sourceId = made.result.case === 'sandbox' ? made.result.value.id : '';
    const snap = await wait(await api.snapshotSandbox({ tenantId, idempotencyKey: key(), sandboxId: sourceId }));
    expect(snap.state, snap.error?.message).toBe(OperationState.SUCCEEDED);
    const snapshotId = snap.result.case === 'snapshot' ? snap.result.value.id : '';

    seen.poison = 'stale';
    const fork = (labels: Record<string, string>): Promise<Operation> => api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 2, labels, placement: { hostId: 'fake-a' } });
    // The first fork's commit is in flight (300 ms) while the others queue: they are
    // planned and committed as one group, the poisoned one among them.
    const first = await fork({});
    await new Promise((r) => setTimeout(r, 100));
    const [poisoned, ...others] = await Promise.all([fork({ poison: 'stale' }), ...Array.from({ length: 5 }, () => fork({}))]);
    const finals = await Promise.all([first, ...others].map(wait));
    const poisonedFinal = await wait(poisoned!);

    expect(seen.poisonedGroups, 'the poisoned fork was never committed in a group with others').toBeGreaterThan(0);
    for (const f of finals) expect(f.state, f.error?.message).toBe(OperationState.SUCCEEDED);
    expect(poisonedFinal.state).toBe(OperationState.FAILED);
    // Only the succeeded forks' children exist; the failed one booked nothing.
    const children = (await api.listSandboxes({ tenantId })).sandboxes.filter((s) => s.id !== sourceId);
    expect(children.length).toBe(2 * finals.length);
    const booked = (await api.listHosts({})).hosts.find((h) => h.id === 'fake-a')?.allocated?.vcpus;
    expect(booked).toBe(1 + children.length);
  }, 120_000);

  it('forkDecidedBeforeItsHostWasCordoned_isPlacedAgainElsewhere_notOnTheCordonedHost', async () => {
    const made = await wait(await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-a' } }));
    const sourceId = made.result.case === 'sandbox' ? made.result.value.id : '';
    const snap = await wait(await api.snapshotSandbox({ tenantId, idempotencyKey: key(), sandboxId: sourceId }));
    const snapshotId = snap.result.case === 'snapshot' ? snap.result.value.id : '';
    // The fork is decided over the leader's view (fake-a holds the snapshot: its children go
    // there); the host is cordoned through the API before that decision is committed.
    let cordoned = false;
    seen.beforeNextPlacement = async () => {
      await api.cordonHost({ idempotencyKey: key(), hostId: 'fake-a', cordon: true });
      cordoned = true;
    };
    try {
      const f = await wait(await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 3 }));
      expect(cordoned).toBe(true);
      expect(f.state, f.error?.message).toBe(OperationState.SUCCEEDED);
      const hostsOf = f.result.case === 'fork' ? f.result.value.children.map((c) => c.hostId) : [];
      expect(hostsOf).toEqual(['fake-b', 'fake-b', 'fake-b']);
    } finally {
      await api.cordonHost({ idempotencyKey: key(), hostId: 'fake-a', cordon: false });
    }
  }, 120_000);

  /** A sandbox on fake-a and a ready snapshot of it (held by fake-a). */
  const snapshotOnA = async (): Promise<string> => {
    const made = await wait(await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-a' } }));
    const sourceId = made.result.case === 'sandbox' ? made.result.value.id : '';
    const snap = await wait(await api.snapshotSandbox({ tenantId, idempotencyKey: key(), sandboxId: sourceId }));
    expect(snap.state, snap.error?.message).toBe(OperationState.SUCCEEDED);
    return snap.result.case === 'snapshot' ? snap.result.value.id : '';
  };

  it('forkChildrenOnTheHostHoldingTheSnapshot_bookOneImagePlusTheirPrivatePages_andGiveBackExactlyThatWhenDestroyed', async () => {
    const snapshotId = await snapshotOnA();
    const store = EtcdFleetStore.connect(ts.etcd.endpoints);
    try {
      const memoryOnA = async (): Promise<number> => (await store.getAlloc('fake-a')).value.allocated.memoryMib;
      const before = await memoryOnA();
      const fork = async (count: number): Promise<string[]> => {
        const f = await wait(await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count, placement: { hostId: 'fake-a' } }));
        expect(f.state, f.error?.message).toBe(OperationState.SUCCEEDED);
        return f.result.case === 'fork' ? f.result.value.children.map((c) => c.id) : [];
      };
      // 256 MiB guests: the image once plus ceil(256 * 48 / 256) = 48 MiB each, not 8 x 256.
      const first = await fork(8);
      expect(await memoryOnA()).toBe(before + 256 + 8 * 48);
      expect((await store.getAlloc('fake-a')).value.images?.[snapshotId]).toBe(8);
      // More children of the same image add their private pages only.
      const second = await fork(4);
      expect(await memoryOnA()).toBe(before + 256 + 12 * 48);
      for (const id of [...first, ...second]) {
        const d = await wait(await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
        expect(d.state, d.error?.message).toBe(OperationState.SUCCEEDED);
      }
      expect(await memoryOnA()).toBe(before);
      expect((await store.getAlloc('fake-a')).value.images?.[snapshotId]).toBeUndefined();
    } finally {
      store.close();
    }
  }, 120_000);

  it('deleteOfASnapshotWhileAnAcceptedForkOfItWaitsToBePlaced_isRefusedInUse_andTheForkSucceeds', async () => {
    const snapshotId = await snapshotOnA();
    // The fork is accepted and about to be placed (no child record names the snapshot yet)
    // when a delete of the snapshot runs to its end: it finds the fork's operation.
    let deleted: Operation | undefined;
    seen.beforeNextPlacement = async () => {
      deleted = await wait(await api.deleteSnapshot({ tenantId, idempotencyKey: key(), snapshotId }));
    };
    const f = await wait(await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 2 }));
    expect(deleted?.state).toBe(OperationState.FAILED);
    expect(deleted?.error?.message).toMatch(new RegExp(`in use; operations ${f.id} will start sandboxes from it`));
    expect(f.state, f.error?.message).toBe(OperationState.SUCCEEDED);
    expect((await api.getSnapshot({ tenantId, snapshotId })).state).toBe(SnapshotState.READY);
    const children = (await api.listSandboxes({ tenantId, pageSize: 1000 })).sandboxes.filter((b) => b.sourceSnapshotId === snapshotId);
    expect(children).toHaveLength(2);
  }, 120_000);

  it('deleteWhileAForkOfTheSnapshotCommits_findsItsChildren_andKeepsTheSnapshotReady', async () => {
    const snapshotId = await snapshotOnA();
    // The delete has checked what it checks before its `deleting` mark; a fork of the
    // snapshot is placed and finishes before that mark is committed.
    let fork: Operation | undefined;
    seen.beforeDeletingMark = async () => {
      fork = await wait(await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 2 }));
    };
    const del = await wait(await api.deleteSnapshot({ tenantId, idempotencyKey: key(), snapshotId }));
    expect(fork?.state, fork?.error?.message).toBe(OperationState.SUCCEEDED);
    expect(del.state).toBe(OperationState.FAILED);
    expect(del.error?.message).toContain('in use');
    expect((await api.getSnapshot({ tenantId, snapshotId })).state).toBe(SnapshotState.READY);
  }, 120_000);

  it('deleteTakenUpAgainAfterItFoundNoUser_goesOnDeleting_neverPutsBackASnapshotHostsMayHaveDeleted', async () => {
    // A delete that found no user cleared `deletingFrom`, then its leader died; a create
    // against the `deleting` mark failed meanwhile and left a failed sandbox naming it.
    const snapshotId = await snapshotOnA();
    const store = EtcdFleetStore.connect(ts.etcd.endpoints);
    try {
      const sn = (await store.getSnapshot(tenantId, snapshotId))!;
      const failed = sandboxRecord({ id: 'sb-failedaaaaaaaaaaaaaa', tenantId, state: 'failed', hostId: '', sourceSnapshotId: snapshotId, lineageId: 'sb-failedaaaaaaaaaaaaaa', hostname: 'f' });
      expect(await store.commit([{ kind: 'snapshot', value: { ...sn.value, state: 'deleting' }, expectRevision: sn.modRevision }, { kind: 'sandbox', value: failed, expectRevision: 0 }])).toBe(true);
      const del = await wait(await api.deleteSnapshot({ tenantId, idempotencyKey: key(), snapshotId }));
      expect(del.state, del.error?.message).toBe(OperationState.SUCCEEDED);
      expect((await store.getSnapshot(tenantId, snapshotId))?.value.state).toBe('deleted');
    } finally {
      store.close();
    }
  }, 120_000);
});
