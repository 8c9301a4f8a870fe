// A host that dies while a fork waits on it: the fork goes on when the host is marked lost,
// not after FF_STEP_TIMEOUT x FF_STEP_ATTEMPTS. The children the lost host was starting are
// placed again on a live host when one has room (within the fork's maxPerHost), and fail
// otherwise. Real etcd and nats-server, a scheduler replica in this process, fake host agent
// processes (loadtest/fake-agent/); the one whose restores never finish in time is
// SIGKILLed mid-fork.
import { status as Status } from '@grpc/grpc-js';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { join } from 'node:path';
import { readFileSync } from 'node:fs';
import { waitFor } from './testkit/proc.ts';
import { startFakeAgents } from './testkit/fleet-procs.ts';
import type { FakeAgentsProcess } from './testkit/fleet-procs.ts';
import { startTestScheduler } from './testkit/scheduler.ts';
import type { Fleet, TestScheduler } from './testkit/scheduler.ts';
import { HostState, OperationState, SandboxState, SnapshotState } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import { Spread } from '../proto/gen/forkfleet/v1/common_pb.ts';
import type { FleetStore, StoreWrite } from './domain/ports.ts';
import { withCommitAt } from './testkit/store-proxy.ts';
import { EtcdFleetStore } from './adapters/etcd/store.ts';
import { HOLDS_CAPACITY } from './domain/records.ts';
import type { HostRec } from './domain/records.ts';
import { sandboxRecord, snapshotRecord } from './testkit/records.ts';
import { bookedFor } from './domain/image-shares.ts';
import { DEFAULT_PLACEMENT_CONFIG } from '../scheduler/index.ts';

/**
 * The store, but while `retried.armed`, the next commit with a write that `matches` (a child
 * placed again, a snapshot made ready) applies and is then sent once more, as etcd3's retry
 * policy does after a lost answer: the second one conflicts, so the executor sees a failed
 * write that in fact landed.
 */
function retriedCommit(store: FleetStore, matches: (w: StoreWrite) => boolean, retried: { armed: boolean; hit: number }): FleetStore {
  const commitAt: FleetStore['commitAt'] = async (writes, fence) => {
    if (!retried.armed || !writes.some(matches)) return store.commitAt(writes, fence);
    retried.armed = false;
    retried.hit++;
    expect(await store.commitAt(writes, fence)).toBeGreaterThan(0);
    return store.commitAt(writes, fence);
  };
  return withCommitAt(store, commitAt);
}

const isReplacement = (w: StoreWrite): boolean => w.kind === 'sandbox' && w.value.stateReason.startsWith('placed again');
/** The write that makes a snapshot ready (its answer "lost" in the same way). */
const isSnapshotReady = (w: StoreWrite): boolean => w.kind === 'snapshot' && w.value.state === 'ready';

/** Once armed for a sandbox: the write that records it running throws an unexpected error (its op fails by runOnce's catch-all, unsettled). */
function failingRunningWrite(store: FleetStore, trap: { sandboxId: string; hit: number }): FleetStore {
  const commitAt: FleetStore['commitAt'] = async (writes, fence) => {
    if (!trap.sandboxId || !writes.some((w) => w.kind === 'sandbox' && w.value.id === trap.sandboxId && w.value.state === 'running')) return store.commitAt(writes, fence);
    trap.sandboxId = '';
    trap.hit++;
    throw new Error('injected: the write that ends the wake failed unexpectedly');
  };
  return withCommitAt(store, commitAt);
}

const tenantId = 't1';
let keyN = 0;
const key = (): string => `k-${Date.now()}-${keyN++}`;
const LOST_AFTER_MS = 3000;
const STEP_TIMEOUT_MS = 120_000;

describe('a host lost mid-operation (real etcd, NATS, fake agents)', () => {
  let ts: TestScheduler;
  let healthy: FakeAgentsProcess;
  let dying: FakeAgentsProcess;
  let dyingToo: FakeAgentsProcess | undefined;
  let api: Fleet;
  let agents: (hostId: string, env: Record<string, string>) => Promise<FakeAgentsProcess>;
  let sourceId = '';
  const retried = { armed: false, hit: 0 };
  const readyRetried = { armed: false, hit: 0 };
  const runningTrap = { sandboxId: '', hit: 0 };
  let dyingThird: FakeAgentsProcess | undefined;
  let dyingHib: FakeAgentsProcess | undefined;
  let replicaHost: FakeAgentsProcess | undefined;
  let slowSnapshots: FakeAgentsProcess | undefined;

  beforeAll(async () => {
    ts = await startTestScheduler({ prefix: 'ff-hostloss-', config: { suspectAfterMs: '1s', lostAfterMs: `${LOST_AFTER_MS}ms`, stepTimeoutMs: `${STEP_TIMEOUT_MS}ms` }, seams: { executorStore: (st) => failingRunningWrite(retriedCommit(retriedCommit(st, isReplacement, retried), isSnapshotReady, readyRetried), runningTrap) } });
    api = ts.api;
    agents = (hostId, env) => startFakeAgents({ hosts: [hostId], dataDir: join(ts.dir, 'fleet'), natsUrl: ts.nats.url, logDir: ts.dir, env: { FF_FAKE_VCPUS: '8', ...env } });
    // fake-b takes a minute per restored VM: its fork step is still running when it dies.
    [healthy, dying] = await Promise.all([agents('fake-a', {}), agents('fake-b', { FF_FAKE_RESTORE_MS_PER_VM: '60000' })]);
    await waitFor('hosts registered', async () => (await api.listHosts({})).hosts.length === 2, 20_000, 100);
  }, 120_000);

  afterAll(async () => {
    await healthy?.stop();
    await dying?.stop();
    await dyingToo?.stop();
    await dyingThird?.stop();
    await dyingHib?.stop();
    await replicaHost?.stop();
    await slowSnapshots?.stop();
    await ts?.stop();
  }, 60_000);

  /**
   * The memory booked on `hostId` is that of the sandboxes that hold capacity there, as the
   * store has them (an invariant every commit keeps: bookings move with state changes). Other
   * tests' work changes fleet-wide totals meanwhile, so this is what the wake tests check.
   */
  async function bookedAsRecorded(hostId: string): Promise<void> {
    const store = EtcdFleetStore.connect(ts.etcd.endpoints);
    try {
      const live = (await store.listSandboxes(undefined)).map((v) => v.value).filter((x) => x.hostId === hostId && HOLDS_CAPACITY.has(x.state));
      expect((await store.getAlloc(hostId)).value.allocated.memoryMib, `memory booked on ${hostId}`).toBe(bookedFor(hostId, live, DEFAULT_PLACEMENT_CONFIG.privateMemoryFraction).allocated.memoryMib);
    } finally {
      store.close();
    }
  }

  /** The host a wake booked (its op's recorded choice). */
  async function bookedBy(opId: string): Promise<string> {
    const store = EtcdFleetStore.connect(ts.etcd.endpoints);
    try {
      return ((await store.getOp(tenantId, opId))?.value.input as { bookedHost?: string } | undefined)?.bookedHost ?? '';
    } finally {
      store.close();
    }
  }

  /** Destroys the sandbox (a failed test's too: fake-a has 8 vCPUs for every test here). */
  async function destroyed(sid: string): Promise<void> {
    const gone = await api.waitOperation({ tenantId, operationId: (await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: sid })).id, timeout: { seconds: 30n } }, { timeoutMs: 40_000 });
    expect(gone.state, gone.error?.message).toBe(OperationState.SUCCEEDED);
  }

  /** A sandbox made on fake-a and hibernated there. */
  async function hibernatedOnFakeA(): Promise<{ sid: string }> {
    const made = await api.waitOperation({ tenantId, operationId: (await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-a' } })).id, timeout: { seconds: 30n } });
    expect(made.state, made.error?.message).toBe(OperationState.SUCCEEDED);
    const sid = made.result.case === 'sandbox' ? made.result.value.id : '';
    const hib = await api.waitOperation({ tenantId, operationId: (await api.hibernateSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid, replicas: 0 })).id, timeout: { seconds: 30n } });
    expect(hib.state, hib.error?.message).toBe(OperationState.SUCCEEDED);
    return { sid };
  }

  it('forkWhoseHostDies_withNoRoomElsewhereUnderMaxPerHost_endsWhenTheHostIsLost_withItsOtherChildrenRunning_andTheLostOnesFailedAndUnbooked', async () => {
    const made = await api.waitOperation({ tenantId, operationId: (await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-a' } })).id, timeout: { seconds: 30n } });
    expect(made.state, made.error?.message).toBe(OperationState.SUCCEEDED);
    sourceId = made.result.case === 'sandbox' ? made.result.value.id : '';

    // maxPerHost 1: fake-a, the only live host left, already runs one child of this fork.
    const fork = await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'sandboxId', value: sourceId }, count: 2, placement: { spread: Spread.SPREAD, maxPerHost: 1 } });
    // Both children are placed (one per host) and fake-a's is running: fake-b's restore is under way.
    let childIds: string[] = [];
    await waitFor('the fork placed', async () => {
      const sbs = (await api.listSandboxes({ tenantId })).sandboxes.filter((s) => s.id !== sourceId);
      childIds = sbs.map((s) => s.id);
      return sbs.length === 2 && sbs.some((s) => s.hostId === 'fake-a' && s.state === SandboxState.RUNNING) && sbs.some((s) => s.hostId === 'fake-b' && s.state === SandboxState.STARTING);
    }, 30_000, 50);

    const killedAt = Date.now();
    dying.proc.kill();
    const final = await api.waitOperation({ tenantId, operationId: fork.id, timeout: { seconds: 60n } }, { timeoutMs: 70_000 });
    const tookMs = Date.now() - killedAt;
    // Lost after LOST_AFTER_MS of silence, found by the next 1 s host pass; far below the step timeout.
    expect(tookMs).toBeLessThan(LOST_AFTER_MS + 10_000);
    expect(final.state).toBe(OperationState.FAILED);
    expect(final.error?.message).toMatch(/^1 of 2 children started; host fake-b was lost/);

    const children = await Promise.all(childIds.map((id) => api.getSandbox({ tenantId, sandboxId: id })));
    const onA = children.find((s) => s.hostId === 'fake-a');
    const onB = children.find((s) => s.hostId === 'fake-b');
    expect(onA?.state).toBe(SandboxState.RUNNING);
    expect(onB?.state).toBe(SandboxState.FAILED);
    expect(onB?.stateReason).toMatch(/host fake-b was lost/);
    // The failed child's booking went with it: the lost host books nothing.
    const hostB = (await api.listHosts({})).hosts.find((h) => h.id === 'fake-b');
    expect(hostB?.state).toBe(HostState.LOST);
    expect(hostB?.allocated?.vcpus ?? 0).toBe(0);
  }, 90_000);

  /**
   * Starts a host whose restores take a minute, and forks `count` children onto it (fake-a
   * cordoned meanwhile, uncordoned after): they are still starting when the test kills it.
   */
  async function forkOntoASlowHost(hostId: string, count: number, env: Record<string, string> = {}): Promise<{ host: FakeAgentsProcess; forkId: string; childIds: string[] }> {
    const host = await agents(hostId, { FF_FAKE_RESTORE_MS_PER_VM: '60000', ...env });
    await waitFor(`${hostId} registered`, async () => (await api.listHosts({})).hosts.some((h) => h.id === hostId && h.state === HostState.READY), 20_000, 100);
    await api.cordonHost({ idempotencyKey: key(), hostId: 'fake-a', cordon: true });
    const fork = await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'sandboxId', value: sourceId }, count });
    let childIds: string[] = [];
    await waitFor(`the fork placed on ${hostId}`, async () => {
      const op = await api.getOperation({ tenantId, operationId: fork.id });
      childIds = op.result.case === 'fork' ? op.result.value.children.map((c) => c.id) : [];
      if (childIds.length !== count) return false;
      const sbs = await Promise.all(childIds.map((id) => api.getSandbox({ tenantId, sandboxId: id })));
      return sbs.every((s) => s.hostId === hostId && s.state === SandboxState.STARTING);
    }, 30_000, 50);
    await api.cordonHost({ idempotencyKey: key(), hostId: 'fake-a', cordon: false });
    return { host, forkId: fork.id, childIds };
  }

  it('forkWhoseHostDies_placesTheChildrenItWasStartingAgainOnALiveHost_andSucceedsWithAllOfThem', async () => {
    // Both children go to fake-c.
    const placed = await forkOntoASlowHost('fake-c', 2);
    dyingToo = placed.host;
    const { childIds } = placed;
    const fork = { id: placed.forkId };

    const killedAt = Date.now();
    dyingToo.proc.kill();
    const final = await api.waitOperation({ tenantId, operationId: fork.id, timeout: { seconds: 60n } }, { timeoutMs: 70_000 });
    expect(Date.now() - killedAt).toBeLessThan(LOST_AFTER_MS + 10_000);
    expect(final.state, final.error?.message).toBe(OperationState.SUCCEEDED);
    const children = await Promise.all(childIds.map((id) => api.getSandbox({ tenantId, sandboxId: id })));
    for (const c of children) {
      expect(c.state).toBe(SandboxState.RUNNING);
      expect(c.hostId).toBe('fake-a');
    }
    // The booking moved with them: the lost host books nothing, fake-a books the source,
    // the first test's running child and these two.
    const hosts = (await api.listHosts({})).hosts;
    expect(hosts.find((h) => h.id === 'fake-c')?.state).toBe(HostState.LOST);
    expect(hosts.find((h) => h.id === 'fake-c')?.allocated?.vcpus ?? 0).toBe(0);
    expect(hosts.find((h) => h.id === 'fake-a')?.allocated?.vcpus).toBe(4);
    // Both tests' stranded children, as an SRE sees them.
    const text = await ts.sched.registry.metrics();
    expect(text).toMatch(/^forkfleet_fork_children_replaced_total\{result="placed"\} 2$/m);
    expect(text).toMatch(/^forkfleet_fork_children_replaced_total\{result="failed"\} 1$/m);
    // The restore steps the lost host never answered failed; those of the hosts the children moved to succeeded.
    expect(text).toMatch(/^forkfleet_host_step_duration_seconds_count\{action="restore_vms",result="failed"\} [1-9]/m);
    expect(text).toMatch(/^forkfleet_host_step_duration_seconds_count\{action="restore_vms",result="succeeded"\} [1-9]/m);
    expect(text).toMatch(/^forkfleet_host_step_host_seconds_count\{action="restore_vms"\} [1-9]/m);
  }, 90_000);

  it('replacement_whoseCommitLandsButIsRetriedAndConflicts_goesOnWithTheChildrenWhereItPutThem', async () => {
    const placed = await forkOntoASlowHost('fake-d', 1);
    dyingThird = placed.host;
    const fork = { id: placed.forkId };
    const childId = placed.childIds[0]!;
    retried.armed = true;
    dyingThird.proc.kill();
    const final = await api.waitOperation({ tenantId, operationId: fork.id, timeout: { seconds: 60n } }, { timeoutMs: 70_000 });
    expect(retried.hit).toBe(1);
    expect(final.state, final.error?.message).toBe(OperationState.SUCCEEDED);
    const child = await api.getSandbox({ tenantId, sandboxId: childId });
    expect(child.state).toBe(SandboxState.RUNNING);
    expect(child.hostId).toBe('fake-a');
    // Booked once, on fake-a: the two earlier tests' 4 and this child.
    const hosts = (await api.listHosts({})).hosts;
    expect(hosts.find((h) => h.id === 'fake-d')?.allocated?.vcpus ?? 0).toBe(0);
    expect(hosts.find((h) => h.id === 'fake-a')?.allocated?.vcpus).toBe(5);
  }, 90_000);

  it('lostHostThatComesBack_doesNotStartASecondVmOfTheChildrenPlacedAgainElsewhere', async () => {
    const placed = await forkOntoASlowHost('fake-k', 2, { FF_LOG_LEVEL: 'info' });
    const back = placed.host;
    try {
      back.proc.kill();
      const final = await api.waitOperation({ tenantId, operationId: placed.forkId, timeout: { seconds: 60n } }, { timeoutMs: 70_000 });
      expect(final.state, final.error?.message).toBe(OperationState.SUCCEEDED);
      for (const id of placed.childIds) expect((await api.getSandbox({ tenantId, sandboxId: id })).hostId).toBe('fake-a');
      // fake-k comes back. The restore it was running is delivered to it again (after
      // JetStream's ack wait); the children run on fake-a by now, so it must not start them.
      const log = join(ts.dir, 'fake-agents-fake-k.log');
      const from = readFileSync(log, 'utf8').length;
      await back.restart();
      const finished = (step: string): boolean => readFileSync(log, 'utf8').slice(from).split('\n').some((l) => l.includes('"step finished"') && l.includes(placed.forkId) && l.includes(`"stepId":"${step}`));
      await waitFor('the redelivered restore and the stops of the children placed again, handled on fake-k', async () => finished('restore/') && placed.childIds.every((id) => finished(`stop-replaced/${id}`)), 60_000, 200);
      const vms = (back.vms().get('fake-k') ?? []).map((v) => v.sandboxId);
      for (const id of placed.childIds) expect(vms).not.toContain(id);
    } finally {
      await back.stop();
    }
  }, 150_000);

  it('hibernate_whoseHostIsLostWhileItsReplicaIsCopied_leavesItHibernatedFromTheNewSnapshot_andItWakesFromIt', async () => {
    // fake-h runs the sandbox; fake-r takes a minute to copy the replica; every other host is
    // cordoned so that the replica goes to fake-r. fake-h dies while fake-r copies.
    const [h, r] = await Promise.all([agents('fake-h', {}), agents('fake-r', { FF_FAKE_FETCH_MS: '60000', FF_LOG_LEVEL: 'info' })]);
    dyingHib = h;
    replicaHost = r;
    await waitFor('fake-h and fake-r registered', async () => (await api.listHosts({})).hosts.filter((x) => (x.id === 'fake-h' || x.id === 'fake-r') && x.state === HostState.READY).length === 2, 20_000, 100);
    const made = await api.waitOperation({ tenantId, operationId: (await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-h' } })).id, timeout: { seconds: 30n } });
    expect(made.state, made.error?.message).toBe(OperationState.SUCCEEDED);
    const sid = made.result.case === 'sandbox' ? made.result.value.id : '';
    const others = (await api.listHosts({})).hosts.filter((x) => x.id !== 'fake-h' && x.id !== 'fake-r' && !x.cordoned).map((x) => x.id);
    for (const id of others) await api.cordonHost({ idempotencyKey: key(), hostId: id, cordon: true });
    const store = EtcdFleetStore.connect(ts.etcd.endpoints);
    try {
      const hib = await api.hibernateSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid, replicas: 1 });
      const rLog = join(ts.dir, 'fake-agents-fake-r.log');
      await waitFor('the replica copy started on fake-r', async () => readFileSync(rLog, 'utf8').split('\n').some((l) => l.includes('"step started"') && l.includes(hib.id) && l.includes('replicate/fake-r')), 30_000, 50);
      h.proc.kill();
      await waitFor('fake-h lost', async () => (await api.listHosts({})).hosts.some((x) => x.id === 'fake-h' && x.state === HostState.LOST), LOST_AFTER_MS + 10_000, 200);
      // Its VM was stopped before the copy began: the sandbox is hibernated, from the snapshot
      // this hibernate took (it used to be marked lost, with no snapshot to restore it from).
      const rec = (await store.getSandbox(tenantId, sid))!.value;
      expect(rec.state).toBe('hibernated');
      expect(rec.hibernationSnapshotId).not.toBe('');
      expect(rec.opId).toBe('');
      // fake-h comes back with the snapshot on its disk; the sandbox wakes from it.
      await h.restart();
      await waitFor('fake-h taken back by the host pass', async () => (await store.getHost('fake-h'))?.value.state === 'ready', 20_000, 200);
      const wake = await api.waitOperation({ tenantId, operationId: (await api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid })).id, timeout: { seconds: 30n } });
      expect(wake.state, wake.error?.message).toBe(OperationState.SUCCEEDED);
      expect((await api.getSandbox({ tenantId, sandboxId: sid })).state).toBe(SandboxState.RUNNING);
    } finally {
      for (const id of others) await api.cordonHost({ idempotencyKey: key(), hostId: id, cordon: false });
      store.close();
    }
  }, 120_000);

  it('sandboxLostMidHibernate_whoseVmComesBackWithItsHost_isTakenBack_resumedAsItWasRunning_andWatchedAgain_notLeftToTheFailedOp', async () => {
    // fake-s takes a minute per snapshot: it dies while the hibernate's snapshot step runs,
    // is lost, and comes back with the VM still there.
    const host = await agents('fake-s', { FF_FAKE_SNAPSHOT_MS: '60000', FF_LOG_LEVEL: 'info' });
    slowSnapshots = host;
    await waitFor('fake-s registered', async () => (await api.listHosts({})).hosts.some((x) => x.id === 'fake-s' && x.state === HostState.READY), 20_000, 100);
    const made = await api.waitOperation({ tenantId, operationId: (await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-s' } })).id, timeout: { seconds: 30n } });
    expect(made.state, made.error?.message).toBe(OperationState.SUCCEEDED);
    const sid = made.result.case === 'sandbox' ? made.result.value.id : '';
    const store = EtcdFleetStore.connect(ts.etcd.endpoints);
    try {
      const hib = await api.hibernateSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid, replicas: 0 });
      const sLog = join(ts.dir, 'fake-agents-fake-s.log');
      await waitFor('the snapshot step started on fake-s', async () => readFileSync(sLog, 'utf8').split('\n').some((l) => l.includes('"step started"') && l.includes(hib.id)), 30_000, 50);
      host.proc.kill();
      await waitFor('the sandbox lost with its host', async () => (await store.getSandbox(tenantId, sid))?.value.state === 'lost', LOST_AFTER_MS + 10_000, 200);
      await host.restart();
      // Taken back paused, as its VM is (a hibernate pauses the guest before its snapshot), then
      // resumed: it was running when the hibernate began, and nobody asked for a pause.
      await waitFor('the sandbox back and running again', async () => (await store.getSandbox(tenantId, sid))?.value.state === 'running', 30_000, 200);
      expect(host.vms().get('fake-s')?.find((v) => v.sandboxId === sid)?.state).toBe('running');
      // No op is at work on it (the VM checks and the lifecycle rules see it again), and the
      // ended hibernate's snapshot is no longer held in use by it.
      const back = (await store.getSandbox(tenantId, sid))?.value;
      expect(back?.opId).toBe('');
      expect(back?.hibernatingTo).toBeUndefined();
    } finally {
      store.close();
    }
  }, 120_000);

  it('lostSandboxWhoseVmComesBack_toAHostBookedFullMeanwhile_staysLost_andItsVmIsStopped_neverBookingTheHostTwice', async () => {
    const host = await agents('fake-f', { FF_FAKE_VCPUS: '2' });
    let restarted = false;
    await waitFor('fake-f registered', async () => (await api.listHosts({})).hosts.some((x) => x.id === 'fake-f' && x.state === HostState.READY), 20_000, 100);
    const made = await api.waitOperation({ tenantId, operationId: (await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 2 }, placement: { hostId: 'fake-f' } })).id, timeout: { seconds: 30n } });
    expect(made.state, made.error?.message).toBe(OperationState.SUCCEEDED);
    const sid = made.result.case === 'sandbox' ? made.result.value.id : '';
    const store = EtcdFleetStore.connect(ts.etcd.endpoints);
    try {
      host.proc.kill();
      await waitFor('the sandbox lost with its host', async () => (await store.getSandbox(tenantId, sid))?.value.state === 'lost', LOST_AFTER_MS + 10_000, 200);
      // What a placement in the moment between the host's return and the reclaim does: it
      // books the host's room (its 2 vCPUs) for a sandbox of its own.
      const alloc = await store.getAlloc('fake-f');
      expect(alloc.value.allocated.vcpus).toBe(0);
      expect(await store.commit([{ kind: 'alloc', value: { hostId: 'fake-f', allocated: { vcpus: 2, memoryMib: 256, diskMib: 1024 }, sandboxes: 1 }, expectRevision: alloc.modRevision }])).toBe(true);
      // The dead agent's VM is still there, and comes back with it.
      expect((host.vms().get('fake-f') ?? []).map((v) => v.vmId)).toContain(sid);
      await host.restart();
      restarted = true;
      await waitFor('fake-f ready again', async () => (await api.listHosts({})).hosts.some((x) => x.id === 'fake-f' && x.state === HostState.READY), 20_000, 100);
      // The VM came back but does not fit: it is stopped (gone from the host's heartbeats)...
      await waitFor('the VM stopped', async () => !(host.vms().get('fake-f') ?? []).some((v) => v.vmId === sid), 20_000, 200);
      // ...and the sandbox stays lost, the host booked once.
      expect((await store.getSandbox(tenantId, sid))?.value.state).toBe('lost');
      expect((await store.getAlloc('fake-f')).value.allocated.vcpus).toBe(2);
    } finally {
      store.close();
      if (restarted) await host.stop();
    }
  }, 90_000);

  it('lostSandboxWhoseVmComesBack_afterItsTenantFilledItsQuotaMeanwhile_staysLost_andItsVmIsStopped', async () => {
    const capped = 'capped';
    ts.credentials.mint({ tenant: capped, quotas: { sandboxes: 1 } });
    const create = (hostId?: string) =>
      api.createSandbox({ tenantId: capped, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, ...(hostId ? { placement: { hostId } } : {}) });
    const host = await agents('fake-qb', {});
    let restarted = false;
    await waitFor('fake-qb registered', async () => (await api.listHosts({})).hosts.some((x) => x.id === 'fake-qb' && x.state === HostState.READY), 20_000, 100);
    const made = await api.waitOperation({ tenantId: capped, operationId: (await create('fake-qb')).id, timeout: { seconds: 30n } });
    expect(made.state, made.error?.message).toBe(OperationState.SUCCEEDED);
    const sid = made.result.case === 'sandbox' ? made.result.value.id : '';
    // The quota is in force (the tokens file is read again at most once a second).
    await waitFor('the quota in force', async () => (await create().then(() => false, (e: { code?: number }) => e.code === Status.RESOURCE_EXHAUSTED)), 10_000, 500);
    const store = EtcdFleetStore.connect(ts.etcd.endpoints);
    let replacement = '';
    try {
      host.proc.kill();
      await waitFor('the sandbox lost with its host', async () => (await store.getSandbox(capped, sid))?.value.state === 'lost', LOST_AFTER_MS + 10_000, 200);
      // A lost sandbox does not count: its tenant makes a replacement, which fills the quota.
      const again = await api.waitOperation({ tenantId: capped, operationId: (await create()).id, timeout: { seconds: 30n } });
      expect(again.state, again.error?.message).toBe(OperationState.SUCCEEDED);
      replacement = again.result.case === 'sandbox' ? again.result.value.id : '';
      await host.restart();
      restarted = true;
      await waitFor('fake-qb ready again', async () => (await api.listHosts({})).hosts.some((x) => x.id === 'fake-qb' && x.state === HostState.READY), 20_000, 100);
      // The VM came back over the quota: it is stopped, and the sandbox stays lost.
      await waitFor('the VM stopped', async () => !(host.vms().get('fake-qb') ?? []).some((v) => v.vmId === sid), 20_000, 200);
      expect((await store.getSandbox(capped, sid))?.value.state).toBe('lost');
      expect((await api.getTenantUsage({ tenantId: capped })).sandboxes).toBe(1);
    } finally {
      store.close();
      if (restarted) await host.stop();
      // The replacement went to a shared host (fake-a has 8 vCPUs for every test here).
      if (replacement) await api.waitOperation({ tenantId: capped, operationId: (await api.destroySandbox({ tenantId: capped, idempotencyKey: key(), sandboxId: replacement })).id, timeout: { seconds: 30n } });
    }
  }, 90_000);

  it('twoWakesOfOneHibernatedSandbox_underDifferentKeys_bothSucceed_withOneVmAndOneBooking', async () => {
    // fake-w's restores take 1.5 s: the second wake arrives while the first one restores. It
    // is the only host with 16 vCPUs, so the wakes cannot go to a faster host.
    const host = await agents('fake-w', { FF_FAKE_RESTORE_MS_PER_VM: '1500', FF_FAKE_VCPUS: '16' });
    try {
      await waitFor('fake-w registered', async () => (await api.listHosts({})).hosts.some((x) => x.id === 'fake-w' && x.state === HostState.READY), 20_000, 100);
      const made = await api.waitOperation({ tenantId, operationId: (await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 16 }, placement: { hostId: 'fake-w' } })).id, timeout: { seconds: 30n } });
      expect(made.state, made.error?.message).toBe(OperationState.SUCCEEDED);
      const sid = made.result.case === 'sandbox' ? made.result.value.id : '';
      const hib = await api.waitOperation({ tenantId, operationId: (await api.hibernateSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid, replicas: 0 })).id, timeout: { seconds: 30n } });
      expect(hib.state, hib.error?.message).toBe(OperationState.SUCCEEDED);
      const booked = (): Promise<number> => api.listHosts({}).then((r) => r.hosts.reduce((n, h) => n + Number(h.allocated?.memoryMib ?? 0n), 0));
      const before = await booked();
      const first = await api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid });
      await waitFor('the first wake under way', async () => (await api.getSandbox({ tenantId, sandboxId: sid })).state === SandboxState.WAKING, 10_000, 20);
      const second = await api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid });
      expect(second.id).not.toBe(first.id);
      const ends = await Promise.all([first, second].map((op) => api.waitOperation({ tenantId, operationId: op.id, timeout: { seconds: 60n } }, { timeoutMs: 70_000 })));
      expect(ends.map((o) => o.state)).toEqual([OperationState.SUCCEEDED, OperationState.SUCCEEDED]);
      expect((await api.getSandbox({ tenantId, sandboxId: sid })).state).toBe(SandboxState.RUNNING);
      // One VM of it across the fleet, one booking of its 256 MiB.
      const vms = [...host.vms().values(), ...healthy.vms().values()].flat().filter((v) => v.vmId === sid);
      expect(vms).toHaveLength(1);
      expect((await booked()) - before).toBe(256);
    } finally {
      await host.stop();
    }
  }, 120_000);

  it('hibernate_askingForMoreReplicasThanThereAreReadyHosts_succeeds_sayingHowManyCopiesWereMade_andAskedAgainOnceHibernated_copiesTheSnapshotItHas', async () => {
    // Every host but fake-a (and fake-v, where the sandbox runs) is cordoned: one copy can be made of three asked for.
    const host = await agents('fake-v', { FF_FAKE_VCPUS: '16' });
    const others = (await api.listHosts({})).hosts.filter((x) => x.id !== 'fake-a' && x.id !== 'fake-v' && !x.cordoned).map((x) => x.id);
    try {
      await waitFor('fake-v registered', async () => (await api.listHosts({})).hosts.some((x) => x.id === 'fake-v' && x.state === HostState.READY), 20_000, 100);
      for (const id of others) await api.cordonHost({ idempotencyKey: key(), hostId: id, cordon: true });
      const made = await api.waitOperation({ tenantId, operationId: (await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 16 }, placement: { hostId: 'fake-v' } })).id, timeout: { seconds: 30n } });
      expect(made.state, made.error?.message).toBe(OperationState.SUCCEEDED);
      const sid = made.result.case === 'sandbox' ? made.result.value.id : '';
      const hib = await api.waitOperation({ tenantId, operationId: (await api.hibernateSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid, replicas: 3 })).id, timeout: { seconds: 30n } });
      expect(hib.state, hib.error?.message).toBe(OperationState.SUCCEEDED);
      expect(hib.progress?.message).toMatch(/^hibernated; 1 of 3 replicas of snapshot sn-\S+ made \(1 other ready host\(s\)\)$/);
      const snapshotId = (await api.getSandbox({ tenantId, sandboxId: sid })).hibernationSnapshotId;
      expect([...(await api.getSnapshot({ tenantId, snapshotId })).hostIds].sort()).toEqual(['fake-a', 'fake-v']);
      // Hibernated already, asked again with another ready host up: that host gets a copy of
      // the snapshot it has (the request's replicas were silently ignored).
      const more = await agents('fake-rep', {});
      try {
        await waitFor('fake-rep registered', async () => (await api.listHosts({})).hosts.some((x) => x.id === 'fake-rep' && x.state === HostState.READY), 20_000, 100);
        const again = await api.waitOperation({ tenantId, operationId: (await api.hibernateSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid, replicas: 3 })).id, timeout: { seconds: 30n } });
        expect(again.state, again.error?.message).toBe(OperationState.SUCCEEDED);
        expect(again.progress?.message).toBe(`hibernated already; 2 of 3 replicas of snapshot ${snapshotId} made (2 other ready host(s))`);
        expect([...(await api.getSnapshot({ tenantId, snapshotId })).hostIds].sort()).toEqual(['fake-a', 'fake-rep', 'fake-v']);
        // As many as it has: nothing to copy, nothing to report.
        const enough = await api.waitOperation({ tenantId, operationId: (await api.hibernateSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid, replicas: 2 })).id, timeout: { seconds: 30n } });
        expect(enough.progress?.message).toBe('done');
      } finally {
        await more.stop();
      }
      const gone = await api.waitOperation({ tenantId, operationId: (await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: sid })).id, timeout: { seconds: 30n } });
      expect(gone.state, gone.error?.message).toBe(OperationState.SUCCEEDED);
    } finally {
      for (const id of others) await api.cordonHost({ idempotencyKey: key(), hostId: id, cordon: false });
      await host.stop();
    }
  }, 120_000);

  it('snapshot_whoseReadyWriteLandedButItsAnswerWasLost_succeeds_notChangedWhileItWasTaken', async () => {
    const made = await api.waitOperation({ tenantId, operationId: (await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-a' } })).id, timeout: { seconds: 30n } });
    expect(made.state, made.error?.message).toBe(OperationState.SUCCEEDED);
    const sid = made.result.case === 'sandbox' ? made.result.value.id : '';
    readyRetried.armed = true;
    const snap = await api.waitOperation({ tenantId, operationId: (await api.snapshotSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid })).id, timeout: { seconds: 30n } });
    expect(readyRetried.hit).toBe(1);
    expect(snap.state, snap.error?.message).toBe(OperationState.SUCCEEDED);
    const snapshotId = snap.result.case === 'snapshot' ? snap.result.value.id : '';
    expect((await api.getSnapshot({ tenantId, snapshotId })).state).toBe(SnapshotState.READY);
    const gone = await api.waitOperation({ tenantId, operationId: (await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: sid })).id, timeout: { seconds: 30n } });
    expect(gone.state, gone.error?.message).toBe(OperationState.SUCCEEDED);
  }, 60_000);

  it('wake_takingOverFromAWakeThatFailedUnsettled_usesTheHostThatOneBooked_andBooksTheSandboxOnce', async () => {
    const { sid } = await hibernatedOnFakeA();
    try {
      runningTrap.sandboxId = sid;
      const first = await api.waitOperation({ tenantId, operationId: (await api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid })).id, timeout: { seconds: 30n } });
      expect(runningTrap.hit).toBe(1);
      expect(first.state).toBe(OperationState.FAILED);
      const firstHost = await bookedBy(first.id);
      expect(firstHost).not.toBe('');
      // Left waking, its host booked by the failed wake; the next wake takes it over.
      const second = await api.waitOperation({ tenantId, operationId: (await api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid })).id, timeout: { seconds: 30n } });
      expect(second.state, second.error?.message).toBe(OperationState.SUCCEEDED);
      const sb = await api.getSandbox({ tenantId, sandboxId: sid });
      expect([sb.state, sb.hostId]).toEqual([SandboxState.RUNNING, firstHost]);
      await bookedAsRecorded(firstHost);
    } finally {
      await destroyed(sid);
    }
  }, 60_000);

  it('destroy_ofASandboxWhoseWakeFailedUnsettled_releasesThatWakesBooking_andDestroysIt', async () => {
    const { sid } = await hibernatedOnFakeA();
    runningTrap.sandboxId = sid;
    const wake = await api.waitOperation({ tenantId, operationId: (await api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid })).id, timeout: { seconds: 30n } });
    expect(wake.state).toBe(OperationState.FAILED);
    const wakeHost = await bookedBy(wake.id);
    expect((await api.getSandbox({ tenantId, sandboxId: sid })).state).toBe(SandboxState.WAKING);
    // Not "still busy" until the step timeout (two minutes here): its wake has ended.
    await destroyed(sid);
    expect((await api.getSandbox({ tenantId, sandboxId: sid })).state).toBe(SandboxState.DESTROYED);
    await bookedAsRecorded(wakeHost);
    await waitFor('its VM stopped', async () => !healthy.vms().get(wakeHost)?.some((v) => v.sandboxId === sid), 10_000, 50);
  }, 60_000);

  it('natsDownLongerThanTheLostThreshold_losesNoHostAndNoSandbox_andTheFleetWorksWhenItIsBack', async () => {
    const made = await api.waitOperation({ tenantId, operationId: (await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } })).id, timeout: { seconds: 30n } });
    expect(made.state, made.error?.message).toBe(OperationState.SUCCEEDED);
    const sid = made.result.case === 'sandbox' ? made.result.value.id : '';
    const hostId = made.result.case === 'sandbox' ? made.result.value.hostId : '';
    const store = EtcdFleetStore.connect(ts.etcd.endpoints);
    const seen = new Set<string>();
    let watching = true;
    const watch = (async () => {
      while (watching) {
        const [sb, host] = await Promise.all([store.getSandbox(tenantId, sid), store.getHost(hostId)]);
        seen.add(`sandbox:${sb?.value.state}`).add(`host:${host?.value.state}`);
        await new Promise((r) => setTimeout(r, 100));
      }
    })();
    try {
      // Every host and the scheduler hear nothing for LOST_AFTER_MS + 2 s.
      await ts.nats.restart(LOST_AFTER_MS + 2000);
      await waitFor('its host heard again', async () => (await api.listHosts({})).hosts.some((x) => x.id === hostId && x.state === HostState.READY), 30_000, 200);
      await new Promise((r) => setTimeout(r, 2000));
      watching = false;
      await watch;
      expect([...seen].filter((x) => x.endsWith(':lost'))).toEqual([]);
      // The work path came back with NATS: a destroy goes through.
      const gone = await api.waitOperation({ tenantId, operationId: (await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: sid })).id, timeout: { seconds: 30n } });
      expect(gone.state, gone.error?.message).toBe(OperationState.SUCCEEDED);
    } finally {
      watching = false;
      await watch;
      store.close();
    }
  }, 120_000);

  it('removeHost_withAHibernatedSandboxWhoseOnlyOtherCopyIsOnALostHost_isRefused', async () => {
    const store = EtcdFleetStore.connect(ts.etcd.endpoints);
    try {
      const host = (id: string): HostRec => ({ id, state: 'lost', cordoned: false, draining: false, capacity: { vcpus: 8, memoryMib: 8192, diskMib: 100_000 }, accel: 'tcg', qemuVersion: '7.2', cpuModel: 'max', machine: 'microvm', peerAddress: '', linkBytesPerSecond: 0, labels: {}, registeredAt: 0, lastHeartbeatAt: 0, bootId: 'b' });
      const sbId = 'sb-hibonlyaaaaaaaaaaaaa';
      const snId = 'sn-hibonlyaaaaaaaaaaaaa';
      expect(
        await store.commit([
          { kind: 'host', value: host('gone-a') },
          { kind: 'host', value: host('gone-b') },
          { kind: 'snapshot', value: snapshotRecord({ id: snId, tenantId, hostIds: ['gone-a', 'gone-b'], lineageId: sbId, sourceSandboxId: sbId }) },
          { kind: 'sandbox', value: sandboxRecord({ id: sbId, tenantId, hostId: 'gone-a', lineageId: sbId, hostname: sbId, state: 'hibernated', hibernationSnapshotId: snId }) },
        ]),
      ).toBe(true);
      // gone-b, the only other holder, is lost too: removing gone-a would leave the sandbox nothing to wake from.
      const e = (await ts.api.removeHost({ hostId: 'gone-a' }).catch((x: unknown) => x)) as { code?: number; message?: string };
      expect(e.code).toBe(9); // FAILED_PRECONDITION
      expect(e.message).toContain(sbId);
      expect(await store.getHost('gone-a')).toBeDefined();
    } finally {
      store.close();
    }
  }, 60_000);

  it('hostsThisLeaderNeverHeard_goLost_andALostHostsSandboxesLeftRunning_areMarkedLost', async () => {
    // What a leader finds after a failover or a restart: 'ghost' (recorded ready) died before
    // this scheduler started, so it never heard it; 'ghost-2' is recorded lost, but the pass
    // that lost it did not get to its sandbox (a leader that died in between).
    const store = EtcdFleetStore.connect(ts.etcd.endpoints);
    try {
      const host = (id: string, state: HostRec['state']): HostRec => ({ id, state, cordoned: false, draining: false, capacity: { vcpus: 8, memoryMib: 8192, diskMib: 100_000 }, accel: 'tcg', qemuVersion: '7.2', cpuModel: 'max', machine: 'microvm', peerAddress: '', linkBytesPerSecond: 0, labels: {}, registeredAt: 0, lastHeartbeatAt: 0, bootId: 'b' });
      const booked = { vcpus: 1, memoryMib: 256, diskMib: 1024 };
      const sb = (id: string, hostId: string) => sandboxRecord({ id, tenantId, hostId, lineageId: id, hostname: id });
      const [a, b] = ['sb-ghostaaaaaaaaaaaaaaa', 'sb-ghostbbbbbbbbbbbbbbb'];
      expect(
        await store.commit([
          { kind: 'host', value: host('ghost', 'ready') },
          { kind: 'host', value: host('ghost-2', 'lost') },
          { kind: 'alloc', value: { hostId: 'ghost', allocated: booked, sandboxes: 1 } },
          { kind: 'alloc', value: { hostId: 'ghost-2', allocated: booked, sandboxes: 1 } },
          { kind: 'sandbox', value: sb(a, 'ghost') },
          { kind: 'sandbox', value: sb(b, 'ghost-2') },
        ]),
      ).toBe(true);
      await waitFor('both sandboxes lost', async () => (await Promise.all([a, b].map((id) => api.getSandbox({ tenantId, sandboxId: id })))).every((x) => x.state === SandboxState.LOST), LOST_AFTER_MS + 10_000, 200);
      const hosts = (await api.listHosts({})).hosts;
      expect(hosts.find((h) => h.id === 'ghost')?.state).toBe(HostState.LOST);
      // Their bookings went with them.
      for (const id of ['ghost', 'ghost-2']) expect(hosts.find((h) => h.id === id)?.allocated?.vcpus ?? 0).toBe(0);
    } finally {
      store.close();
    }
  }, 60_000);
});
