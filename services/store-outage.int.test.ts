// A placement commit whose answer is lost: etcd applied it, the scheduler did not hear so.
// Real etcd and nats-server, a scheduler replica in this process whose executor writes
// through a fault-injecting wrapper of the real store (the only fake here: it implements our
// own FleetStore port), and fake host agents as a process (loadtest/fake-agent/).
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { rmSync } from 'node:fs';
import { join } from 'node:path';
import { pino } from 'pino';
import { startEtcd } from './testkit/etcd.ts';
import type { EtcdCluster } from './testkit/etcd.ts';
import { startNats } from './testkit/nats.ts';
import type { NatsServer } from './testkit/nats.ts';
import { sleep, waitFor, tempDir } from './testkit/proc.ts';
import { startFakeAgents } from './testkit/fleet-procs.ts';
import type { FakeAgentsProcess } from './testkit/fleet-procs.ts';
import { testCredentials } from './testkit/credentials.ts';
import { compileSchedulerConfig } from './config.ts';
import { startScheduler } from './scheduler.ts';
import type { SchedulerHandle } from './scheduler.ts';
import { EtcdFleetStore } from './adapters/etcd/store.ts';
import type { FleetStore, StoreWrite } from './domain/ports.ts';
import { withCommitAt } from './testkit/store-proxy.ts';
import { StoreUnavailableError } from './domain/errors.ts';
import { HOLDS_CAPACITY } from './domain/records.ts';
import { FAIL_CREATE_HOSTNAME } from '../loadtest/fake-agent/driver.ts';
import type { Client } from './adapters/grpc/rpc.ts';
import { FleetService, OperationState } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { Operation } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import { Spread } from '../proto/gen/forkfleet/v1/common_pb.ts';
import { Forkfleet } from './sdk/index.ts';
import { bookedFor } from './domain/image-shares.ts';
import { DEFAULT_PLACEMENT_CONFIG } from '../scheduler/index.ts';

type Fleet = Client<(typeof FleetService)['method']>;
const tenantId = 't1';
let keyN = 0;
const key = (): string => `k-${Date.now()}-${keyN++}`;
const HOSTS = ['fake-1', 'fake-2', 'fake-3', 'fake-4'];

/**
 * How the next commit of a kind goes wrong: a placement (it writes a starting sandbox) whose
 * answer is lost or that etcd3 retries after it applied; or, with the answer lost, a commit
 * that marks a restored child running, or one that switches a migrated sandbox to its new host.
 */
type Fault = 'answer-lost' | 'applied-then-retried' | 'running-answer-lost' | 'switch-answer-lost' | 'snapshot-create-retried' | 'failed-not-applied' | 'placed-then-snapshot-deleting';

const isSandbox = (w: StoreWrite, p: (sb: Extract<StoreWrite, { kind: 'sandbox' }>['value']) => boolean): boolean => w.kind === 'sandbox' && p(w.value);
const placement = (w: StoreWrite): boolean => isSandbox(w, (sb) => sb.state === 'starting') && w.expectRevision !== undefined;
const targets: Record<Fault, (w: StoreWrite) => boolean> = {
  'answer-lost': placement,
  'applied-then-retried': placement,
  'running-answer-lost': (w) => isSandbox(w, (sb) => sb.state === 'running' && sb.sourceSnapshotId !== '' && sb.stateReason === ''),
  'switch-answer-lost': (w) => isSandbox(w, (sb) => sb.stateReason.startsWith('migrated from')),
  'snapshot-create-retried': (w) => w.kind === 'snapshot' && w.value.state === 'creating' && w.expectRevision === 0,
  'failed-not-applied': (w) => isSandbox(w, (sb) => sb.state === 'failed'),
  'placed-then-snapshot-deleting': (w) => isSandbox(w, (sb) => sb.state === 'running' && sb.sourceSnapshotId !== '' && sb.stateReason === ''),
};

/** The store, but the next commit `armed.fault` names applies and then fails as it says. */
function faulty(store: FleetStore, armed: { fault?: Fault; hit: number }): FleetStore {
  const commitAt = async (writes: readonly StoreWrite[], fence?: Parameters<FleetStore['commitAt']>[1]): Promise<number> => {
    const fault = armed.fault && writes.some(targets[armed.fault]) ? armed.fault : undefined;
    if (!fault) return store.commitAt(writes, fence);
    armed.fault = undefined;
    armed.hit++;
    // etcd was unreachable: nothing applied.
    if (fault === 'failed-not-applied') throw new StoreUnavailableError('write', new Error('etcd unreachable (injected)'));
    // The children's restore answered, but marking them running meets an outage (nothing
    // applied), and meanwhile a delete of their snapshot began (its record says deleting).
    if (fault === 'placed-then-snapshot-deleting') {
      const sbw = writes.find((w) => w.kind === 'sandbox');
      const sn = sbw?.kind === 'sandbox' ? await store.getSnapshot(sbw.value.tenantId, sbw.value.sourceSnapshotId) : undefined;
      if (sn) await store.commit([{ kind: 'snapshot', value: { ...sn.value, state: 'deleting' }, expectRevision: sn.modRevision }]);
      throw new StoreUnavailableError('write', new Error('etcd unreachable (injected)'));
    }
    const rev = await store.commitAt(writes, fence);
    expect(rev).toBeGreaterThan(0);
    // etcd applied it; the answer never arrived:
    if (fault !== 'applied-then-retried' && fault !== 'snapshot-create-retried') throw new StoreUnavailableError('write', new Error('connection reset before the answer (injected)'));
    // etcd3 retried the call the way its retry policy does, after the first one had applied.
    return store.commitAt(writes, fence);
  };
  return withCommitAt(store, commitAt);
}

describe('a placement commit whose answer is lost (real etcd, NATS, fake agents)', () => {
  let etcd: EtcdCluster;
  let nats: NatsServer;
  let dir: string;
  let store: EtcdFleetStore;
  let sched: SchedulerHandle;
  let agents: FakeAgentsProcess;
  let api: Fleet;
  let snapshotId = '';
  let creds: ReturnType<typeof testCredentials>;
  const armed: { fault?: Fault; hit: number } = { hit: 0 };

  async function wait(op: Operation, tenant = tenantId): Promise<Operation> {
    return api.waitOperation({ tenantId: tenant, operationId: op.id, timeout: { seconds: 60n } }, { timeoutMs: 70_000 });
  }

  /** Every live sandbox is booked once on its host, and no operation is left unfinished. */
  async function assertBookedOnce(): Promise<void> {
    const live = (await store.listSandboxes(undefined)).map((v) => v.value).filter((s) => HOLDS_CAPACITY.has(s.state));
    for (const a of await store.listAllocs()) {
      const mine = live.filter((s) => s.hostId === a.value.hostId);
      expect(a.value.sandboxes, `sandboxes booked on ${a.value.hostId}`).toBe(mine.length);
      expect(a.value.allocated.memoryMib, `memory booked on ${a.value.hostId}`).toBe(bookedFor(a.value.hostId, mine, DEFAULT_PLACEMENT_CONFIG.privateMemoryFraction).allocated.memoryMib);
    }
    expect((await store.listOps({ activeOnly: true })).map((o) => `${o.value.kind} ${o.value.id} ${o.value.state}`)).toEqual([]);
  }

  beforeAll(async () => {
    dir = tempDir('ff-outage-');
    [etcd, nats] = await Promise.all([startEtcd(), startNats()]);
    store = EtcdFleetStore.connect(etcd.endpoints);
    creds = testCredentials(dir);
    sched = await startScheduler(
      compileSchedulerConfig({ grpcAddr: '127.0.0.1:0', etcdEndpoints: etcd.endpoints.join(','), natsUrl: nats.url, signingKeyPath: join(dir, 'signing.pem'), suspectAfterMs: '3s', lostAfterMs: '20s', ...creds.config }),
      pino({ level: 'warn' }),
      { executorStore: (s) => faulty(s, armed) },
    );
    await sched.leader;
    agents = await startFakeAgents({ hosts: HOSTS, dataDir: join(dir, 'fleet'), natsUrl: nats.url, logDir: dir, env: { FF_FAKE_VCPUS: '16' } });
    api = creds.client(FleetService, sched.address);
    await waitFor('hosts registered', async () => (await api.listHosts({})).hosts.length === HOSTS.length, 20_000, 100);
    const parent = await wait(await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }));
    expect(parent.state).toBe(OperationState.SUCCEEDED);
    const snap = await wait(await api.snapshotSandbox({ tenantId, idempotencyKey: key(), sandboxId: parent.result.case === 'sandbox' ? parent.result.value.id : '' }));
    snapshotId = snap.result.case === 'snapshot' ? snap.result.value.id : '';
    expect(snapshotId).not.toBe('');
  }, 120_000);

  afterAll(async () => {
    api?.close();
    await sched?.close();
    await agents?.stop();
    store?.close();
    await nats?.stop();
    await etcd?.stop();
    if (dir) rmSync(dir, { recursive: true, force: true });
  }, 60_000);

  for (const fault of ['answer-lost', 'applied-then-retried'] as const) {
    it(`fork_whosePlacementCommit${fault === 'answer-lost' ? 'AnswerIsLost' : 'IsRetriedAfterItApplied'}_startsEveryChildBookedOnce`, async () => {
      armed.fault = fault;
      const hits = armed.hit;
      const op = await wait(await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 6, placement: { spread: Spread.SPREAD } }));
      expect(armed.hit).toBe(hits + 1);
      expect(op.state, op.error?.message).toBe(OperationState.SUCCEEDED);
      const ids = op.result.case === 'fork' ? op.result.value.children.map((c) => c.id) : [];
      expect(ids).toHaveLength(6);
      const states = await Promise.all(ids.map(async (id) => (await store.getSandbox(tenantId, id))?.value.state));
      expect(states).toEqual(Array(6).fill('running'));
      await assertBookedOnce();
    }, 90_000);
  }

  it('fork_whoseSnapshotStartsDeletingWhileItIsRunAgainAfterAnOutage_startsItsPlacedChildren_notLeavesThemStarting', async () => {
    armed.fault = 'placed-then-snapshot-deleting';
    const hits = armed.hit;
    try {
      const op = await wait(await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 2 }));
      expect(armed.hit).toBe(hits + 1);
      expect(op.state, op.error?.message).toBe(OperationState.SUCCEEDED);
      const ids = op.result.case === 'fork' ? op.result.value.children.map((c) => c.id) : [];
      expect(ids).toHaveLength(2);
      expect(await Promise.all(ids.map(async (id) => (await store.getSandbox(tenantId, id))?.value.state))).toEqual(['running', 'running']);
      await assertBookedOnce();
    } finally {
      // The delete never ran: the shared snapshot is ready again for the other tests.
      const sn = await store.getSnapshot(tenantId, snapshotId);
      if (sn && sn.value.state !== 'ready') await store.commit([{ kind: 'snapshot', value: { ...sn.value, state: 'ready' }, expectRevision: sn.modRevision }]);
    }
  }, 90_000);

  it('snapshot_whoseRecordsCreateIsRetriedAfterItApplied_isTakenAndReady_notLeftCreating', async () => {
    const made = await wait(await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }));
    armed.fault = 'snapshot-create-retried';
    const hits = armed.hit;
    const op = await wait(await api.snapshotSandbox({ tenantId, idempotencyKey: key(), sandboxId: made.result.case === 'sandbox' ? made.result.value.id : '' }));
    expect(armed.hit).toBe(hits + 1);
    expect(op.state, op.error?.message).toBe(OperationState.SUCCEEDED);
    const id = op.result.case === 'snapshot' ? op.result.value.id : '';
    expect((await store.getSnapshot(tenantId, id))?.value.state).toBe('ready');
    await assertBookedOnce();
  }, 90_000);

  it('fork_whoseCommitMarkingChildrenRunningLosesItsAnswer_succeedsWithEveryChildRunning', async () => {
    armed.fault = 'running-answer-lost';
    const hits = armed.hit;
    const op = await wait(await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 4, placement: { spread: Spread.SPREAD } }));
    expect(armed.hit).toBe(hits + 1);
    expect(op.state, op.error?.message).toBe(OperationState.SUCCEEDED);
    const ids = op.result.case === 'fork' ? op.result.value.children.map((c) => c.id) : [];
    expect(await Promise.all(ids.map(async (id) => (await store.getSandbox(tenantId, id))?.value.state))).toEqual(Array(4).fill('running'));
    await assertBookedOnce();
  }, 90_000);

  it('drain_whoseCommitSwitchingASandboxLosesItsAnswer_movesItAndStopsTheSourceVm', async () => {
    const made = await wait(await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-4' } }));
    const id = made.result.case === 'sandbox' ? made.result.value.id : '';
    expect(agents.vms().get('fake-4')?.map((v) => v.sandboxId)).toContain(id);
    armed.fault = 'switch-answer-lost';
    const hits = armed.hit;
    const op = await wait(await api.drainHost({ idempotencyKey: key(), hostId: 'fake-4', migrate: true }), 'admin');
    expect(armed.hit).toBe(hits + 1);
    expect(op.state, op.error?.message).toBe(OperationState.SUCCEEDED);
    const after = (await store.getSandbox(tenantId, id))?.value;
    expect(after?.state).toBe('running');
    expect(after?.hostId).not.toBe('fake-4');
    expect(agents.vms().get('fake-4')).toEqual([]);
    expect(agents.vms().get(after!.hostId)?.map((v) => v.sandboxId)).toContain(id);
    await api.cordonHost({ idempotencyKey: key(), hostId: 'fake-4', cordon: false });
    await assertBookedOnce();
  }, 90_000);

  it('create_whosePlacementCommitAnswerIsLost_startsTheSandboxBookedOnce', async () => {
    armed.fault = 'answer-lost';
    const hits = armed.hit;
    const op = await wait(await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }));
    expect(armed.hit).toBe(hits + 1);
    expect(op.state, op.error?.message).toBe(OperationState.SUCCEEDED);
    const id = op.result.case === 'sandbox' ? op.result.value.id : '';
    expect((await store.getSandbox(tenantId, id))?.value.state).toBe('running');
    await assertBookedOnce();
  }, 90_000);
  it('create_whoseFailedRecordCannotBeWrittenAtFirst_endsWithTheSandboxFailedAndUnbooked_notLeftStarting', async () => {
    // The host refuses the create; the write marking the sandbox failed meets an etcd outage.
    armed.fault = 'failed-not-applied';
    const hit = armed.hit;
    const op = await wait(await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, hostname: `${FAIL_CREATE_HOSTNAME}-1` }));
    expect(armed.hit).toBe(hit + 1);
    expect(op.state).toBe(OperationState.FAILED);
    expect((await store.getSandbox(tenantId, op.targetId))?.value).toMatchObject({ state: 'failed', opId: '' });
    await assertBookedOnce();
  });

  it('sdkWait_whenEtcdRestartsUnderARunningFork_ridesOutTheOutage_andReturnsTheSucceededFork', async () => {
    // A host whose restores take 3 s: the fork is still running when etcd goes away.
    const slow = await startFakeAgents({ hosts: ['slow-1'], dataDir: join(dir, 'slow'), natsUrl: nats.url, logDir: dir, env: { FF_FAKE_VCPUS: '16', FF_FAKE_RESTORE_MS_PER_VM: '3000' } });
    const sdk = new Forkfleet({ address: sched.address, token: creds.adminToken, ca: creds.caPem, tenant: tenantId });
    try {
      await waitFor('slow host registered', async () => (await api.listHosts({})).hosts.some((h) => h.id === 'slow-1'), 20_000, 100);
      const op = await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 2, placement: { hostId: 'slow-1' } });
      // With a progress callback, as the CLI waits: a read every second.
      const waited = sdk.wait(op.id, { timeoutMs: 60_000, onProgress: () => undefined });
      await waitFor('children restoring', async () => (await store.listSandboxes(tenantId)).some((v) => v.value.opId === op.id && v.value.state === 'starting'), 20_000, 50);
      // The scheduler's reads fail while etcd is down, and for a while after (etcd3 keeps
      // its circuit open): the SDK's wait goes on polling instead of giving up.
      await etcd.members[0]!.restart();
      const done = await waited;
      expect(done.state).toBe('succeeded');
      expect(done.fork?.children.map((c) => c.state)).toEqual(['running', 'running']);
      await assertBookedOnce();
    } finally {
      sdk.close();
      await slow.stop();
    }
  }, 90_000);
  it('sdkCreate_submittedWhileEtcdIsDown_isAskedAgainUntilItIsBack_andMakesOneSandbox', async () => {
    const sdk = new Forkfleet({ address: sched.address, token: creds.adminToken, ca: creds.caPem, tenant: 'outage' });
    try {
      await etcd.members[0]!.proc.stop();
      // The scheduler answers UNAVAILABLE (its store is down) for as long as etcd is away:
      // the SDK asks again with the same idempotency key, past its five quick attempts.
      const created = sdk.create({ image: 'tiny', memoryMib: 256 });
      await sleep(3000);
      await etcd.members[0]!.restart();
      const sb = await created;
      expect(sb.info?.state).toBe('running');
      expect((await store.listSandboxes('outage')).map((v) => v.value.id)).toEqual([sb.id]);
      await assertBookedOnce();
    } finally {
      sdk.close();
    }
  }, 90_000);
});
