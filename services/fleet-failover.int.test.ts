// Scheduler failover, host liveness, cordon and drain with real etcd, real nats-server,
// two scheduler replicas as separate processes and fake host agents (the real Agent over
// the real NATS protocol, with simulated VMs: loadtest/fake-agent/).
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { readFileSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { startEtcd } from './testkit/etcd.ts';
import type { EtcdCluster } from './testkit/etcd.ts';
import { startNats } from './testkit/nats.ts';
import type { NatsServer } from './testkit/nats.ts';
import { sleep, waitFor, tempDir } from './testkit/proc.ts';
import { startFakeAgents, startSchedulerProcess } from './testkit/fleet-procs.ts';
import type { FakeAgentsProcess, SchedulerProcess } from './testkit/fleet-procs.ts';
import { loadSigningKey } from './scheduler.ts';
import { EtcdFleetStore } from './adapters/etcd/store.ts';
import type { Client } from './adapters/grpc/rpc.ts';
import { FleetService, HostState, OperationKind, OperationState, OperationStepState, SandboxState } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import { durationMs, timestampMs } from '@bufbuild/protobuf/wkt';
import type { Operation } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import { Spread, Locality } from '../proto/gen/forkfleet/v1/common_pb.ts';
import { HOLDS_CAPACITY } from './domain/records.ts';
import { STREAM_WORK, workConsumer } from './adapters/nats/subjects.ts';
import { status as Status } from '@grpc/grpc-js';
import type { RpcError } from './adapters/grpc/status.ts';
import type { SandboxRec } from './domain/records.ts';
import { FAIL_ONCE_FINAL_HOSTNAME, FAIL_ONCE_HOSTNAME, FAIL_SNAPSHOT_HOSTNAME } from '../loadtest/fake-agent/driver.ts';
import { NatsWorkBus } from './adapters/nats/bus.ts';
import { create } from '@bufbuild/protobuf';
import { HostWorkSchema } from './domain/messages.ts';
import { bookedFor } from './domain/image-shares.ts';
import { DEFAULT_PLACEMENT_CONFIG } from '../scheduler/index.ts';

type Fleet = Client<(typeof FleetService)['method']>;
const tenantId = 't1';
let keyN = 0;
const key = (): string => `k-${Date.now()}-${keyN++}`;
const HOSTS = Array.from({ length: 10 }, (_, i) => `fake-${i + 1}`);

async function wait(api: Fleet, op: Operation, tenant = tenantId, seconds = 60): Promise<Operation> {
  return api.waitOperation({ tenantId: tenant, operationId: op.id, timeout: { seconds: BigInt(seconds) } }, { timeoutMs: seconds * 1000 + 10_000 });
}

async function ok(api: Fleet, op: Operation, tenant = tenantId): Promise<Operation> {
  const final = await wait(api, op, tenant);
  if (final.state !== OperationState.SUCCEEDED) throw new Error(`operation ${op.id} ${OperationState[final.state]}: ${final.error?.message}`);
  return final;
}

describe('scheduler replicas + fake host agents (real etcd, NATS)', () => {
  let etcd: EtcdCluster;
  let nats: NatsServer;
  let dir: string;
  let store: EtcdFleetStore;
  const scheds: SchedulerProcess[] = [];
  const fakes: FakeAgentsProcess[] = [];
  let main: FakeAgentsProcess;
  let api: Fleet;
  let parentId = '';
  let snapshotId = '';
  /** Starts another scheduler replica (as beforeAll's), for tests that kill the leader again. */
  let startReplica: (id: string) => Promise<SchedulerProcess>;

  /** Every fake VM, etcd sandbox and alloc record agree: no VM twice, none missing, capacity = sum of sandboxes. */
  async function assertConsistent(): Promise<void> {
    const sandboxes = (await store.listSandboxes(undefined)).map((v) => v.value);
    const live = sandboxes.filter((s) => HOLDS_CAPACITY.has(s.state));
    const where = new Map<string, string[]>();
    for (const f of fakes) for (const [host, vms] of f.vms()) for (const vm of vms) where.set(vm.sandboxId, [...(where.get(vm.sandboxId) ?? []), host]);
    for (const [id, hosts] of where) expect(hosts, `VM ${id} runs on ${hosts.join(', ')}`).toHaveLength(1);
    const byId = new Map(sandboxes.map((s) => [s.id, s]));
    for (const s of live.filter((x) => x.state === 'running' || x.state === 'paused')) expect(where.get(s.id), `sandbox ${s.id} (${s.state} on ${s.hostId})`).toEqual([s.hostId]);
    for (const [id, hosts] of where) {
      const s = byId.get(id);
      if (s?.state === 'lost') continue; // its host is gone; the VM files stay in the dead host's directory
      expect(s && HOLDS_CAPACITY.has(s.state) ? s.hostId : 'none', `VM ${id} on ${hosts[0]}`).toBe(hosts[0]);
    }
    for (const a of await store.listAllocs()) {
      const mine = live.filter((s) => s.hostId === a.value.hostId);
      expect(a.value.sandboxes, `alloc count of ${a.value.hostId}`).toBe(mine.length);
      expect(a.value.allocated.vcpus, `vcpus booked on ${a.value.hostId}`).toBe(mine.reduce((n, s) => n + s.resources.vcpus, 0));
      expect(a.value.allocated.memoryMib, `memory booked on ${a.value.hostId}`).toBe(bookedFor(a.value.hostId, mine, DEFAULT_PLACEMENT_CONFIG.privateMemoryFraction).allocated.memoryMib);
    }
    expect((await store.listOps({ activeOnly: true })).map((o) => `${o.value.kind} ${o.value.id} ${o.value.state}`)).toEqual([]);
  }

  /** A fake agent process of its own for `hostId` (so it can be killed alone), registered. */
  async function ownHost(hostId: string, dataDir: string, env: Record<string, string> = {}): Promise<FakeAgentsProcess> {
    const agents = await startFakeAgents({ hosts: [hostId], dataDir: join(dir, dataDir), natsUrl: nats.url, logDir: dir, env: { FF_FAKE_VCPUS: '8', ...env } });
    fakes.push(agents);
    await waitFor(`${hostId} registered`, async () => (await api.listHosts({})).hosts.some((h) => h.id === hostId), 10_000, 50);
    return agents;
  }

  /** ownHost, with one sandbox on it. */
  async function hostWithSandbox(hostId: string, dataDir: string, env: Record<string, string> = {}): Promise<{ agents: FakeAgentsProcess; sandboxId: string }> {
    const agents = await ownHost(hostId, dataDir, env);
    const c = await ok(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId } }));
    return { agents, sandboxId: c.result.case === 'sandbox' ? c.result.value.id : '' };
  }

  /**
   * A sandbox on a host of its own whose snapshot takes 3 s (long enough to kill the leader in
   * the middle of it), a fork of it under way (its snapshot recorded and creating), and a new
   * standby replica `replicaId` that the API now talks to. The caller kills `leader`.
   */
  async function forkWhileItsSourceSnapshots(hostId: string, replicaId: string, count: number): Promise<{ sourceId: string; op: Operation; forkSnapshotId: string; leader: SchedulerProcess; standby: SchedulerProcess }> {
    await ownHost(hostId, hostId, { FF_FAKE_SNAPSHOT_MS: '3000' });
    const c = await ok(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId } }));
    const sourceId = c.result.case === 'sandbox' ? c.result.value.id : '';
    // A standby to take over (earlier tests killed replicas), and the API on it.
    const standby = await startReplica(replicaId);
    const alive = scheds.filter((s) => s.proc.child.exitCode === null && s.proc.child.signalCode === null && s !== standby);
    const leader = (await Promise.all(alive.map(async (s) => ((await s.isLeader()) ? s : undefined)))).find(Boolean)!;
    api.close();
    api = standby.credentials.client(FleetService, standby.api);
    const op = await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'sandboxId', value: sourceId }, count });
    let forkSnapshotId = '';
    await waitFor('source snapshot under way', async () => {
      forkSnapshotId = ((await store.getOp(tenantId, op.id))?.value.input as { forkSnapshotId?: string } | undefined)?.forkSnapshotId ?? '';
      return forkSnapshotId !== '' && (await store.getSnapshot(tenantId, forkSnapshotId))?.value.state === 'creating';
    }, 20_000, 10);
    return { sourceId, op, forkSnapshotId, leader, standby };
  }

  beforeAll(async () => {
    dir = tempDir('ff-failover-');
    [etcd, nats] = await Promise.all([startEtcd(), startNats()]);
    store = EtcdFleetStore.connect(etcd.endpoints);
    const signingKeyPath = join(dir, 'signing.pem');
    loadSigningKey(signingKeyPath, 'scheduler-1');
    const env = { FF_HOST_SUSPECT_AFTER: '1500ms', FF_HOST_LOST_AFTER: '5s', FF_STEP_TIMEOUT: '5s', FF_STEP_ATTEMPTS: '5', FF_ELECTION_TTL: '1s' };
    startReplica = async (id) => {
      const p = await startSchedulerProcess({ id, dir, etcdEndpoints: etcd.endpoints, natsUrl: nats.url, signingKeyPath, env });
      scheds.push(p);
      return p;
    };
    for (const id of ['s1', 's2']) await startReplica(id);
    main = await startFakeAgents({
      hosts: HOSTS,
      dataDir: join(dir, 'fleet'),
      natsUrl: nats.url,
      logDir: dir,
      env: { FF_FAKE_VCPUS: '24', FF_FAKE_RESTORE_MS_PER_VM: '100', FF_FAKE_FETCH_MS: '300' },
    });
    fakes.push(main);
    api = scheds[0]!.credentials.client(FleetService, scheds[0]!.api);
    await waitFor('hosts registered', async () => (await api.listHosts({})).hosts.length === HOSTS.length, 20_000, 100);
    const created = await ok(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }));
    parentId = created.result.case === 'sandbox' ? created.result.value.id : '';
    const snap = await ok(api, await api.snapshotSandbox({ tenantId, idempotencyKey: key(), sandboxId: parentId }));
    snapshotId = snap.result.case === 'snapshot' ? snap.result.value.id : '';
    expect(snapshotId).not.toBe('');
  }, 180_000);

  afterAll(async () => {
    api?.close();
    for (const s of scheds) await s.proc.stop();
    for (const f of fakes) await f.stop();
    store?.close();
    await nats?.stop();
    await etcd?.stop();
    if (dir && !process.env.FF_KEEP) rmSync(dir, { recursive: true, force: true });
  }, 60_000);

  it('fanout_whenLeaderKilledMidway_completesViaStandbyWithoutDoublePlacementOrLostOp', async () => {
    const leaders = await Promise.all(scheds.map((s) => s.isLeader()));
    expect(leaders.filter(Boolean)).toHaveLength(1);
    const leader = scheds[leaders.indexOf(true)]!;
    const standby = scheds[leaders.indexOf(false)]!;
    api.close();
    api = standby.credentials.client(FleetService, standby.api);

    const op = await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 64, placement: { spread: Spread.SPREAD, maxPerHost: 8 } });
    // Kill the leader once the placement is committed and some, not all, children run.
    let children: string[] = [];
    await waitFor('fan-out half-way', async () => {
      const rec = (await store.getOp(tenantId, op.id))?.value;
      children = rec?.result?.sandboxIds ?? [];
      if (children.length !== 64) return false;
      const states = await Promise.all(children.map((id) => store.getSandbox(tenantId, id)));
      const running = states.filter((s) => s?.value.state === 'running').length;
      return running > 0 && running < 64;
    }, 30_000, 10);
    const beforeKill = (await Promise.all(children.map((id) => store.getSandbox(tenantId, id)))).filter((s) => s?.value.state === 'running').length;
    const killedAt = Date.now();
    leader.proc.kill();
    await leader.proc.exited;
    await waitFor('standby takes over', () => standby.isLeader(), 10_000, 20);
    const takeoverMs = Date.now() - killedAt;
    process.stdout.write(`${JSON.stringify({ takeover_ms: takeoverMs, children_running_at_kill: beforeKill })}\n`);
    expect(takeoverMs).toBeLessThan(3000);

    const final = await wait(api, op);
    expect(final.state, final.error?.message).toBe(OperationState.SUCCEEDED);
    const recs = (await store.listSandboxes(tenantId)).map((v) => v.value);
    const kids = recs.filter((s) => children.includes(s.id));
    expect(kids).toHaveLength(64);
    expect(new Set(kids.map((k) => k.id)).size).toBe(64);
    expect(kids.every((k) => k.state === 'running')).toBe(true);
    expect(new Set(kids.map((k) => k.hostId)).size).toBeGreaterThanOrEqual(8);
    await assertConsistent();
  });

  it('forkOfALiveSandbox_whenLeaderKilledWhileItSnapshotsTheSource_takesUpTheSameSnapshotAndCompletes', async () => {
    const { sourceId, op, forkSnapshotId, leader, standby } = await forkWhileItsSourceSnapshots('fake-slow-snap', 's3', 3);
    leader.proc.kill();
    await leader.proc.exited;
    await waitFor('standby takes over', () => standby.isLeader(), 10_000, 20);

    const final = await wait(api, op);
    expect(final.state, final.error?.message).toBe(OperationState.SUCCEEDED);
    const result = final.result.case === 'fork' ? final.result.value : undefined;
    expect(result?.snapshotId).toBe(forkSnapshotId);
    expect(result?.children.map((k) => k.state)).toEqual(Array(3).fill(SandboxState.RUNNING));
    expect((await store.getSnapshot(tenantId, forkSnapshotId))?.value.state).toBe('ready');
    // One snapshot of the source: the new leader took up the old one's.
    expect((await store.listSnapshots(tenantId)).filter((v) => v.value.sourceSandboxId === sourceId).map((v) => v.value.id)).toEqual([forkSnapshotId]);
    await assertConsistent();
  });

  it('forkOfALiveSandbox_whoseSourceIsLostDuringTheFailover_failsAndMarksItsUnfinishedSnapshotFailed', async () => {
    const { sourceId, op, forkSnapshotId, leader, standby } = await forkWhileItsSourceSnapshots('fake-slow-snap-2', 's4', 2);
    leader.proc.kill();
    await leader.proc.exited;
    // While no replica leads: the source is recorded lost (as its host's loss would), its booking released.
    const sb = (await store.getSandbox(tenantId, sourceId))!;
    const alloc = await store.getAlloc('fake-slow-snap-2');
    expect(await store.commit([
      { kind: 'sandbox', value: { ...sb.value, state: 'lost', stateReason: 'test: lost during the failover', updatedAt: Date.now() }, expectRevision: sb.modRevision },
      { kind: 'alloc', value: { ...alloc.value, sandboxes: alloc.value.sandboxes - 1, allocated: { ...alloc.value.allocated, vcpus: alloc.value.allocated.vcpus - 1, memoryMib: alloc.value.allocated.memoryMib - 256 } }, expectRevision: alloc.modRevision },
    ])).toBe(true);
    await waitFor('standby takes over', () => standby.isLeader(), 10_000, 20);

    const final = await wait(api, op);
    expect(final.state).toBe(OperationState.FAILED);
    expect(final.error?.message).toMatch(/lost/);
    // Not left creating (nothing expires a creating snapshot, and a delete refuses it).
    expect((await store.getSnapshot(tenantId, forkSnapshotId))?.value.state).toBe('failed');
    // Its VM still runs on its host: the leader takes it back (booked once).
    await waitFor('source reclaimed', async () => (await store.getSandbox(tenantId, sourceId))?.value.state === 'running', 20_000, 100);
    await assertConsistent();
  });

  it('forkOfALiveSandbox_givesTheSnapshotItTakesTheDefaultTtlOrTheRetentionAsked_andASnapshotSourceNone', async () => {
    const fork = async (retention?: { ttl?: { seconds: bigint; nanos?: number }; keepLast?: number }): Promise<{ snapshotId: string; children: string[] }> => {
      const f = await ok(api, await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'sandboxId', value: parentId }, count: 1, ...(retention ? { snapshotRetention: retention } : {}) }));
      return f.result.case === 'fork' ? { snapshotId: f.result.value.snapshotId, children: f.result.value.children.map((c) => c.id) } : { snapshotId: '', children: [] };
    };
    // Unset: the fleet's default TTL (24h), so repeated forks do not keep every snapshot forever.
    const dflt = await fork();
    expect((await store.getSnapshot(tenantId, dflt.snapshotId))?.value).toMatchObject({ retentionTtlMs: 24 * 3_600_000, keepLast: 0, pinned: false });
    expect((await api.getSnapshot({ tenantId, snapshotId: dflt.snapshotId })).expiresAt).toBeDefined();
    // What the request asks for; an empty retention keeps it.
    const asked = await fork({ ttl: { seconds: 600n }, keepLast: 3 });
    expect((await store.getSnapshot(tenantId, asked.snapshotId))?.value).toMatchObject({ retentionTtlMs: 600_000, keepLast: 3 });
    const kept = await fork({});
    expect((await store.getSnapshot(tenantId, kept.snapshotId))?.value).toMatchObject({ retentionTtlMs: null, keepLast: 0 });
    // A snapshot source takes no snapshot: a retention for it is a bad argument, as is a bad TTL.
    const bad = async (req: Parameters<Fleet['forkSandbox']>[0]): Promise<string | undefined> => ((await api.forkSandbox(req).catch((e: unknown) => e)) as { code?: number; field?: string }).field;
    expect(await bad({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 1, snapshotRetention: { keepLast: 2 } })).toBe('snapshot_retention');
    expect(await bad({ tenantId, idempotencyKey: key(), source: { case: 'sandboxId', value: parentId }, count: 1, snapshotRetention: { ttl: { seconds: 0n, nanos: 5 } } })).toBe('snapshot_retention.ttl');
    for (const id of [...dflt.children, ...asked.children, ...kept.children]) await ok(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
    await assertConsistent();
  });

  it('forkOfASnapshot_whoseInheritedHooksMakeItsChildrenOverflowOneTransaction_isRefusedNamingCount_andBooksNothing', async () => {
    // The children inherit the source's hooks besides the fork's own labels: the API counts both.
    const hooks = [0, 1].map(() => ({ argv: ['/bin/sh', '-c', `echo ${'x'.repeat(3900)}`] }));
    const src = await ok(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 128n, vcpus: 1 }, lifecycle: { afterResume: hooks } }));
    const srcId = src.result.case === 'sandbox' ? src.result.value.id : '';
    const snap = await ok(api, await api.snapshotSandbox({ tenantId, idempotencyKey: key(), sandboxId: srcId }));
    const snId = snap.result.case === 'snapshot' ? snap.result.value.id : '';
    const labels = Object.fromEntries(Array.from({ length: 14 }, (_, i) => [`k${i}`, 'v'.repeat(250)]));
    const refused = (await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snId }, count: 100, labels, placement: { spread: Spread.SPREAD } }).catch((e: unknown) => e)) as RpcError;
    expect([Status[refused.code], refused.field]).toEqual(['INVALID_ARGUMENT', 'count']);
    expect(refused.message).toMatch(/at most \d+ children with these labels and after_resume hooks/);
    // The same fork with fewer children fits.
    const small = await ok(api, await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snId }, count: 2, labels }));
    for (const id of [srcId, ...(small.result.case === 'fork' ? small.result.value.children.map((c) => c.id) : [])]) await ok(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
    await assertConsistent();
  });

  it('fork_whenHostAgentRestartedMidStep_neitherLosesNorDuplicatesSandboxes', async () => {
    const slow = await ownHost('fake-r', 'restart', { FF_FAKE_VCPUS: '32', FF_FAKE_RESTORE_MS_PER_VM: '150', FF_FAKE_FETCH_MS: '100' });
    const op = await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 16, placement: { hostId: 'fake-r' } });
    await waitFor('some VMs made', async () => {
      const n = slow.vms().get('fake-r')!.length;
      return n > 2 && n < 16;
    }, 20_000, 10);
    await slow.restart();
    const final = await ok(api, op);
    const ids = final.result.case === 'fork' ? final.result.value.children.map((c) => c.id) : [];
    expect(ids).toHaveLength(16);
    const vms = slow.vms().get('fake-r')!.map((v) => v.sandboxId);
    expect(vms.sort()).toEqual([...ids].sort());
    // Its one step says it was sent again.
    expect(final.steps.map((st) => [st.stepId, st.state])).toEqual([['restore/fake-r', OperationStepState.SUCCEEDED]]);
    expect(final.steps[0]!.attempt).toBeGreaterThanOrEqual(2);
    await assertConsistent();
  });

  it('operation_listsEachHostStep_whenItWasSentHowLongItTookThereAndWhatItFetched_andACreateEndsOneOfOneDone', async () => {
    const c = await ok(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }));
    expect([c.progress?.done, c.progress?.total]).toEqual([1, 1]);
    expect(c.steps.map((st) => [st.stepId, st.action, st.state, st.attempt])).toEqual([['create', 'create_vm', OperationStepState.SUCCEEDED, 1]]);
    const source = c.result.case === 'sandbox' ? c.result.value : undefined;
    const sourceId = source?.id ?? '';
    // A fork of the live sandbox: its snapshot is taken first, then each host restores (and
    // the hosts that do not hold it fetch it: 300 ms in beforeAll's fake agents, 100 ms on
    // fake-r, at once on the hosts other tests started; placement may pick any of them).
    const f = await ok(api, await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'sandboxId', value: sourceId }, count: 3, placement: { spread: Spread.SPREAD } }));
    const kids = f.result.case === 'fork' ? f.result.value.children : [];
    const [snap, ...restores] = f.steps;
    expect([snap?.stepId.startsWith('snapshot/'), snap?.action, snap?.state]).toEqual([true, 'snapshot_vm', OperationStepState.SUCCEEDED]);
    expect(restores.map((st) => [st.action, st.state])).toEqual(Array(3).fill(['restore_vms', OperationStepState.SUCCEEDED]));
    expect(new Set(restores.map((st) => st.hostId))).toEqual(new Set(kids.map((k) => k.hostId)));
    const created = timestampMs(f.createdAt!);
    for (const st of f.steps) {
      const sent = timestampMs(st.sentAt!);
      const ended = timestampMs(st.finishedAt!);
      expect(sent).toBeGreaterThanOrEqual(created);
      expect(ended).toBeGreaterThanOrEqual(sent);
      // The host's own time fits inside the scheduler's (same clock here; 5 ms of rounding).
      expect(durationMs(st.hostDuration!)).toBeLessThanOrEqual(ended - sent + 5);
    }
    // No restore is sent before the snapshot it restores is taken.
    for (const st of restores) expect(timestampMs(st.sentAt!)).toBeGreaterThanOrEqual(timestampMs(snap!.finishedAt!));
    const fetched = restores.filter((st) => st.hostId !== source?.hostId);
    expect(fetched.length).toBeGreaterThan(0);
    const fetchMsOf = (hostId: string): number => (HOSTS.includes(hostId) ? 300 : hostId === 'fake-r' ? 100 : 0);
    for (const st of fetched) {
      expect(st.bytesFetched).toBeGreaterThan(0n);
      expect(durationMs(st.hostDuration!), `restore on ${st.hostId}`).toBeGreaterThanOrEqual(fetchMsOf(st.hostId));
    }
    // Their capacity goes back: later tests fill the hosts.
    for (const id of [sourceId, ...kids.map((k) => k.id)]) await ok(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
    await assertConsistent();
  });

  it('fork_whenHostCordoned_placesNothingOnIt', async () => {
    await api.cordonHost({ idempotencyKey: key(), hostId: 'fake-1', cordon: true });
    const op = await ok(api, await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 20, placement: { spread: Spread.SPREAD } }));
    const kids = op.result.case === 'fork' ? op.result.value.children : [];
    expect(kids).toHaveLength(20);
    expect(kids.filter((k) => k.hostId === 'fake-1')).toEqual([]);
    await api.cordonHost({ idempotencyKey: key(), hostId: 'fake-1', cordon: false });
    await assertConsistent();
  });

  it('drain_withoutMigrate_hibernatesItsSandboxes_andCopiesEverySnapshotOnlyItHeld_soTheHostCanBeRemovedAndTheyWakeElsewhere', async () => {
    const { agents: h, sandboxId: running } = await hostWithSandbox('fake-h', 'hib-drain');
    const make = async (): Promise<string> => {
      const c = await ok(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-h' } }));
      return c.result.case === 'sandbox' ? c.result.value.id : '';
    };
    const paused = await make();
    await ok(api, await api.pauseSandbox({ tenantId, idempotencyKey: key(), sandboxId: paused }));
    // Hibernated before the drain, its snapshot on this host alone (as an idle hibernation).
    const earlier = await make();
    await ok(api, await api.hibernateSandbox({ tenantId, idempotencyKey: key(), sandboxId: earlier, replicas: 0 }));
    const earlierSn = (await store.getSandbox(tenantId, earlier))!.value.hibernationSnapshotId;
    expect((await store.getSnapshot(tenantId, earlierSn))?.value.hostIds).toEqual(['fake-h']);

    // A user's snapshot that only this host holds.
    const snap = await ok(api, await api.snapshotSandbox({ tenantId, idempotencyKey: key(), sandboxId: running }));
    const userSn = snap.result.case === 'snapshot' ? snap.result.value.id : '';
    expect((await store.getSnapshot(tenantId, userSn))?.value.hostIds).toEqual(['fake-h']);

    const final = await ok(api, await api.drainHost({ idempotencyKey: key(), hostId: 'fake-h', migrate: false }), 'admin');
    expect(final.progress?.done).toBe(2);
    expect((await store.getHost('fake-h'))?.value).toMatchObject({ cordoned: true, draining: false });
    for (const id of [running, paused, earlier]) {
      const sb = (await store.getSandbox(tenantId, id))!.value;
      expect(sb.state, id).toBe('hibernated');
      const holders = (await store.getSnapshot(tenantId, sb.hibernationSnapshotId))!.value.hostIds;
      expect(holders.filter((x) => x !== 'fake-h'), `copies of ${sb.hibernationSnapshotId}`).not.toEqual([]);
    }
    expect((await store.getSnapshot(tenantId, userSn))!.value.hostIds.filter((x) => x !== 'fake-h')).not.toEqual([]);
    expect(h.vms().get('fake-h')).toEqual([]);
    expect((await store.getAlloc('fake-h')).value).toMatchObject({ sandboxes: 0, allocated: { vcpus: 0, memoryMib: 0 } });
    await assertConsistent();

    // The host can go: its hibernated sandboxes do not need it.
    h.proc.kill();
    fakes.splice(fakes.indexOf(h), 1);
    await waitFor('fake-h lost', async () => (await store.getHost('fake-h'))?.value.state === 'lost', 20_000, 100);
    await api.removeHost({ hostId: 'fake-h' });
    expect(await store.getHost('fake-h')).toBeUndefined();
    // And each wakes on another host, from the copy.
    const woke = await ok(api, await api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId: running }));
    expect(woke.result.case === 'sandbox' && woke.result.value.hostId).not.toBe('fake-h');
    expect((await store.getSandbox(tenantId, running))?.value.state).toBe('running');
    await h.stop();
    await assertConsistent();
  }, 90_000);

  it('drain_withMigrate_movesEveryRunningSandboxToAnotherHost', async () => {
    const before = (await store.listSandboxes(tenantId)).map((v) => v.value).filter((s) => s.hostId === 'fake-4' && s.state === 'running');
    expect(before.length).toBeGreaterThan(0);
    const final = await ok(api, await api.drainHost({ idempotencyKey: key(), hostId: 'fake-4', migrate: true }), 'admin');
    expect(final.state).toBe(OperationState.SUCCEEDED);
    // Drained: still cordoned, no longer draining.
    expect((await api.listHosts({})).hosts.find((x) => x.id === 'fake-4')).toMatchObject({ cordoned: true, draining: false });
    // The snapshots it took to move them expire (they were kept forever).
    const taken = (await store.listSnapshots(tenantId)).map((v) => v.value).filter((sn) => sn.labels['forkfleet.io/purpose'] === 'migration' && before.some((s) => s.id === sn.sourceSandboxId));
    expect(taken.length).toBe(before.length);
    for (const sn of taken) expect(sn.retentionTtlMs, sn.id).toBe(24 * 3_600_000);
    const after = new Map((await store.listSandboxes(tenantId)).map((v) => [v.value.id, v.value] as [string, SandboxRec]));
    for (const s of before) {
      expect(after.get(s.id)?.state).toBe('running');
      expect(after.get(s.id)?.hostId).not.toBe('fake-4');
    }
    expect(main.vms().get('fake-4')).toEqual([]);
    // Each move is marked switched in the drain's record: a re-run goes by that, not by where
    // the sandbox is by then (executor-drain.test.ts).
    const rec = (await store.listOps({ activeOnly: false })).find((o) => o.value.id === final.id)?.value;
    const migrations = (rec?.input as { migrations?: Record<string, { switched?: boolean }> } | undefined)?.migrations ?? {};
    expect(before.map((s) => migrations[s.id]?.switched)).toEqual(before.map(() => true));
    await api.cordonHost({ idempotencyKey: key(), hostId: 'fake-4', cordon: false });
    await assertConsistent();
  });

  it('drain_whoseSandboxIsDestroyedWhileItIsCopied_removesTheCopy_andBooksNothingTwice', async () => {
    const { sandboxId: sbId } = await hostWithSandbox('fake-m', 'migrating');
    const drain = await api.drainHost({ idempotencyKey: key(), hostId: 'fake-m', migrate: true });
    // Destroyed once the drain chose a host for it (its restore there takes ~400 ms).
    await waitFor('destination chosen', async () => {
      const o = (await store.getOp('admin', drain.id))?.value;
      return Boolean((o?.input as { migrations?: Record<string, { toHostId?: string }> } | undefined)?.migrations?.[sbId]?.toHostId);
    }, 10_000, 5);
    await ok(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: sbId }));
    const f = await wait(api, drain, 'admin');
    expect(f.state).toBe(OperationState.FAILED);
    expect(f.error?.message).toContain('moved on during its migration');
    expect((await store.getSandbox(tenantId, sbId))?.value.state).toBe('destroyed');
    await waitFor('no VM of it anywhere', async () => ![...fakes.flatMap((x) => [...x.vms().values()])].some((vms) => vms.some((v) => v.sandboxId === sbId)), 10_000, 50);
    await assertConsistent();
  }, 60_000);

  it('drain_claimsEachSandboxWhileItMoves_soAResumeMidwayIsRefused_andTheSwitchEndsTheClaim', async () => {
    // Snapshots take 1.5 s on fake-q: the drain's source stays paused that long.
    const { sandboxId: sbId } = await hostWithSandbox('fake-q', 'claimed', { FF_FAKE_SNAPSHOT_MS: '1500' });
    const drain = await api.drainHost({ idempotencyKey: key(), hostId: 'fake-q', migrate: true });
    await waitFor('the sandbox claimed by the drain', async () => (await store.getSandbox(tenantId, sbId))?.value.opId === drain.id, 10_000, 5);
    // A resume now would run the paused source on after its snapshot: refused.
    const resumed = await wait(api, await api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId: sbId }));
    expect(resumed.state).toBe(OperationState.FAILED);
    const f = await wait(api, drain, 'admin');
    expect(f.state, f.error?.message).toBe(OperationState.SUCCEEDED);
    const after = (await store.getSandbox(tenantId, sbId))?.value;
    expect(after).toMatchObject({ state: 'running', opId: '' });
    expect(after?.hostId).not.toBe('fake-q');
    await api.cordonHost({ idempotencyKey: key(), hostId: 'fake-q', cordon: false });
    await assertConsistent();
  }, 60_000);

  it('drain_ofASandboxResumedWhileTheDrainMovedAnother_movesItRunning_notAsTheListBeforeHadIt', async () => {
    // Snapshots take 2 s here: the drain moves the first sandbox (its tenant sorts first) for
    // that long before it reaches the second, which was paused when the drain listed it.
    await ownHost('fake-stale', 'stale', { FF_FAKE_SNAPSHOT_MS: '2000' });
    const make = async (t: string): Promise<string> => {
      const c = await ok(api, await api.createSandbox({ tenantId: t, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-stale' } }), t);
      return c.result.case === 'sandbox' ? c.result.value.id : '';
    };
    const first = await make('aa-stale');
    const second = await make('zz-stale');
    await ok(api, await api.pauseSandbox({ tenantId: 'zz-stale', idempotencyKey: key(), sandboxId: second }), 'zz-stale');
    const drain = await api.drainHost({ idempotencyKey: key(), hostId: 'fake-stale', migrate: true });
    await waitFor('the first sandbox claimed by the drain', async () => (await store.getSandbox('aa-stale', first))?.value.opId === drain.id, 10_000, 5);
    // Not claimed yet: its user resumes it, and works in it from then on.
    await ok(api, await api.resumeSandbox({ tenantId: 'zz-stale', idempotencyKey: key(), sandboxId: second }), 'zz-stale');
    const f = await wait(api, drain, 'admin');
    expect(f.state, f.error?.message).toBe(OperationState.SUCCEEDED);
    for (const [t, id] of [['aa-stale', first], ['zz-stale', second]] as const) {
      const after = (await store.getSandbox(t, id))?.value;
      expect([after?.state, after?.opId], id).toEqual(['running', '']);
      expect(after?.hostId, id).not.toBe('fake-stale');
    }
    await api.cordonHost({ idempotencyKey: key(), hostId: 'fake-stale', cordon: false });
    await assertConsistent();
  }, 90_000);

  it('drain_whoseHostIsLostOnceTheSandboxSwitched_countsItMoved_thoughItsSourceVmCouldNotBeStopped', async () => {
    // Stopping a VM takes 3 s on fake-gone: the host dies between the switch and that stop.
    const { agents, sandboxId } = await hostWithSandbox('fake-gone', 'gone', { FF_FAKE_DESTROY_MS: '3000' });
    const drain = await api.drainHost({ idempotencyKey: key(), hostId: 'fake-gone', migrate: true });
    await waitFor('the sandbox switched to another host', async () => {
      const h = (await store.getSandbox(tenantId, sandboxId))?.value.hostId;
      return h !== undefined && h !== 'fake-gone';
    }, 20_000, 5);
    agents.proc.kill();
    await agents.proc.exited;
    fakes.splice(fakes.indexOf(agents), 1);
    const f = await wait(api, drain, 'admin');
    expect(f.state, f.error?.message).toBe(OperationState.SUCCEEDED);
    const after = (await store.getSandbox(tenantId, sandboxId))?.value;
    expect(after?.state).toBe('running');
    await hostsSettled();
    await assertConsistent();
  }, 90_000);

  it('drain_ofAHostWhereAForksChildIsStillStarting_waitsForIt_andMovesItToo', async () => {
    // Restores take 3 s on fake-z: the fork's child is still starting when the drain begins.
    const { sandboxId: srcId } = await hostWithSandbox('fake-z', 'startingdrain', { FF_FAKE_RESTORE_MS_PER_VM: '3000' });
    const fork = await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'sandboxId', value: srcId }, count: 1, placement: { hostId: 'fake-z' } });
    let childId = '';
    await waitFor('the child starting on fake-z', async () => {
      const c = (await store.listSandboxes(tenantId)).map((v) => v.value).find((x) => x.hostId === 'fake-z' && x.state === 'starting');
      childId = c?.id ?? '';
      return c !== undefined;
    }, 10_000, 20);
    const drain = await wait(api, await api.drainHost({ idempotencyKey: key(), hostId: 'fake-z', migrate: true }), 'admin');
    expect(drain.state, drain.error?.message).toBe(OperationState.SUCCEEDED);
    expect((await wait(api, fork)).state).toBe(OperationState.SUCCEEDED);
    for (const id of [srcId, childId]) {
      const sb = (await store.getSandbox(tenantId, id))?.value;
      expect(sb?.state, id).toBe('running');
      expect(sb?.hostId, id).not.toBe('fake-z');
    }
    await api.cordonHost({ idempotencyKey: key(), hostId: 'fake-z', cordon: false });
    await assertConsistent();
  }, 90_000);

  it('host_whenSilent_becomesSuspectThenLost_itsSandboxesLost_andRestoreElsewhereFetchesFromSurvivingHolder', async () => {
    // A sandbox and its snapshot on the doomed host; the snapshot also reaches fake-l5. Hosts of
    // this test's own: the shared ones may be full by now (earlier tests pack them).
    const { agents: doomed, sandboxId: sbId } = await hostWithSandbox('fake-l', 'lost');
    await Promise.all([ownHost('fake-l5', 'l5'), ownHost('fake-l6', 'l6')]);
    const sn = await ok(api, await api.snapshotSandbox({ tenantId, idempotencyKey: key(), sandboxId: sbId }));
    const snId = sn.result.case === 'snapshot' ? sn.result.value.id : '';
    await ok(api, await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snId }, count: 1, placement: { hostId: 'fake-l5', locality: Locality.CROSS_HOST } }));

    doomed.proc.kill();
    const killed = Date.now();
    const seen = new Set<string>();
    await waitFor('host lost', async () => {
      const h = (await store.getHost('fake-l'))?.value;
      if (h) seen.add(h.state);
      return h?.state === 'lost';
    }, 15_000, 50);
    const lostAfter = Date.now() - killed;
    expect(seen.has('suspect')).toBe(true);
    expect(lostAfter).toBeGreaterThanOrEqual(4000);
    await waitFor('sandbox lost', async () => (await store.getSandbox(tenantId, sbId))?.value.state === 'lost', 5_000, 50);
    expect((await store.getAlloc('fake-l')).value.sandboxes).toBe(0);

    // Restore from the surviving copy on a host that has never held it: it must fetch (sources + ticket + signature).
    const r = await ok(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snId }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-l6' } }));
    expect(r.result.case === 'sandbox' && r.result.value.hostId).toBe('fake-l6');
    expect((await store.getSnapshot(tenantId, snId))?.value.hostIds).toContain('fake-l6');
    await sleep(10);
    await assertConsistent();
  });

  it('destroy_whoseHostDiesMeanwhile_endsDestroyedWithTheBookingReleased_andTheHostCanBeRemoved', async () => {
    const { agents: dying, sandboxId: sbId } = await hostWithSandbox('fake-d', 'dying');
    dying.proc.kill();
    // Its VMs died with it (the files it leaves are not VMs): out of assertConsistent's view.
    fakes.splice(fakes.indexOf(dying), 1);
    // Asked while the host is still counted ready: the step goes out and no answer comes.
    const destroy = await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: sbId });
    const f = await wait(api, destroy);
    expect(f.state, f.error?.message).toBe(OperationState.SUCCEEDED);
    expect((await store.getSandbox(tenantId, sbId))?.value.state).toBe('destroyed');
    expect((await store.getAlloc('fake-d')).value).toMatchObject({ sandboxes: 0, allocated: { vcpus: 0, memoryMib: 0 } });
    await waitFor('host lost', async () => (await store.getHost('fake-d'))?.value.state === 'lost', 15_000, 50);
    await api.removeHost({ hostId: 'fake-d' });
    expect(await store.getHost('fake-d')).toBeUndefined();
    await dying.stop();
    await assertConsistent();
  }, 60_000);

  it('removeHost_ofALostHost_dropsItsRecordsAndQueue_refusesLiveOrUnknownHosts_andTheAgentBackRegistersAnew', async () => {
    const { agents: gone, sandboxId: sbId } = await hostWithSandbox('fake-x', 'removed');
    const code = (p: Promise<unknown>): Promise<{ code?: number; field?: string; message?: string }> => p.then(() => ({}), (e: unknown) => e as { code: number; field?: string });
    // Refused while the host is heard from, for an unknown host, and for a malformed id.
    const live = await code(api.removeHost({ hostId: 'fake-x' }));
    expect([live.code, live.field]).toEqual([Status.FAILED_PRECONDITION, 'host_id']);
    expect(live.message).toMatch(/ready .*stop its agent/);
    expect((await code(api.removeHost({ hostId: 'no-such-host' }))).code).toBe(Status.NOT_FOUND);
    const bad = await code(api.removeHost({ hostId: 'Bad Host!' }));
    expect([bad.code, bad.field]).toEqual([Status.INVALID_ARGUMENT, 'host_id']);
    expect((await store.getHost('fake-x'))?.value.state).toBe('ready');

    gone.proc.kill();
    await waitFor('fake-x lost and its sandbox lost', async () => (await store.getHost('fake-x'))?.value.state === 'lost' && (await store.getSandbox(tenantId, sbId))?.value.state === 'lost', 20_000, 100);
    const jsm = await (await import('nats')).connect({ servers: nats.url }).then((nc) => nc.jetstreamManager().then((m) => ({ m, nc })));
    try {
      expect((await jsm.m.consumers.info(STREAM_WORK, workConsumer('fake-x'))).name).toBe(workConsumer('fake-x'));
      expect((await api.removeHost({ hostId: 'fake-x' })).lostSandboxes).toBe(1);
      expect(await store.getHost('fake-x')).toBeUndefined();
      expect((await store.getAlloc('fake-x')).modRevision).toBe(0);
      expect((await api.listHosts({})).hosts.map((h) => h.id)).not.toContain('fake-x');
      expect(await jsm.m.consumers.info(STREAM_WORK, workConsumer('fake-x')).then(() => 'exists', () => 'gone')).toBe('gone');
      // A second call: the host is gone.
      expect((await code(api.removeHost({ hostId: 'fake-x' }))).code).toBe(Status.NOT_FOUND);
      // The leader does not bring it back from the last heartbeat it heard.
      await sleep(2500);
      expect(await store.getHost('fake-x')).toBeUndefined();
    } finally {
      await jsm.nc.close();
    }
    // Its agent starts again: a new host, and its VM reclaims the lost sandbox.
    await gone.restart();
    await waitFor('fake-x registered again', async () => (await store.getHost('fake-x'))?.value.state === 'ready', 10_000, 100);
    await waitFor('its lost sandbox reclaimed', async () => (await store.getSandbox(tenantId, sbId))?.value.state === 'running', 10_000, 100);
    await sleep(10);
    await assertConsistent();
  });

  // Last: it fills the fleet. Forks that arrive together are placed together (one plan and one
  // transaction for the group, each seeing what the earlier ones booked); more children than
  // there is room for must fail whole forks, never over-book a host.
  it('forks_whenManyArriveTogetherBeyondCapacity_neverOverBookAHost', async () => {
    const ops = await Promise.all(Array.from({ length: 12 }, () => api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 30, placement: { spread: Spread.SPREAD } })));
    const finals = await Promise.all(ops.map((op) => wait(api, op)));
    const succeeded = finals.filter((f) => f.state === OperationState.SUCCEEDED);
    const failed = finals.filter((f) => f.state !== OperationState.SUCCEEDED);
    // 10 hosts of 24 vCPUs hold well under 360 more children: some forks fit, the rest find no room.
    expect(succeeded.length).toBeGreaterThan(0);
    expect(failed.length).toBeGreaterThan(0);
    for (const f of failed) expect(f.error?.message ?? '').toMatch(/capacity|no host|room|feasible/i);
    for (const a of await store.listAllocs()) {
      const cap = (await store.getHost(a.value.hostId))?.value.capacity.vcpus ?? 0;
      expect(a.value.allocated.vcpus, `vcpus booked on ${a.value.hostId}`).toBeLessThanOrEqual(cap);
    }
    await assertConsistent();
  }, 120_000);

  it('destroy_twiceAtOnceUnderDifferentKeys_destroysOnceAndReleasesTheBookingOnce', async () => {
    // On a host of its own: the test before fills the shared ones on purpose.
    await ownHost('fake-twice', 'twice');
    const op = await ok(api, await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 6, placement: { hostId: 'fake-twice' } }));
    const kids = op.result.case === 'fork' ? op.result.value.children : [];
    expect(kids).toHaveLength(6);
    // A user's destroy and a TTL's, say: two operations on the same sandbox at once.
    const destroys = await Promise.all(kids.flatMap((k) => [0, 1].map(() => api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: k.id }))));
    for (const f of await Promise.all(destroys.map((d) => wait(api, d)))) expect(f.state).toBe(OperationState.SUCCEEDED);
    for (const k of kids) expect((await store.getSandbox(tenantId, k.id))?.value.state).toBe('destroyed');
    await assertConsistent();
  });

  it('failedCreateHibernateAndWake_leaveTheSandboxInAStateItCanLeave_withItsBookingRight', async () => {
    // A create no host can take: the sandbox fails (it used to stay pending, counted by quota).
    // Larger than any host has in all, it is not retryable (a client would retry forever).
    const big = await wait(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 64 } }));
    expect(big.state).toBe(OperationState.FAILED);
    expect(big.error).toMatchObject({ kind: 'resource_exhausted', field: 'resources.vcpus', retryable: false });
    const bigId = big.targetId;
    expect((await store.getSandbox(tenantId, bigId))?.value).toMatchObject({ state: 'failed', opId: '' });
    expect((await store.getSandbox(tenantId, bigId))?.value.stateReason).toMatch(/^create failed: resources\.vcpus: 64 vCPUs is more than any host of the fleet has in all/);

    // A hibernate whose snapshot fails (the fake refuses it for this hostname), from paused:
    // back to paused (it used to stay hibernating, which hibernate, resume and destroy refuse).
    const c = await ok(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, hostname: `${FAIL_SNAPSHOT_HOSTNAME}-1` }));
    const sid = c.result.case === 'sandbox' ? c.result.value.id : '';
    await ok(api, await api.pauseSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid }));
    const hib = await wait(api, await api.hibernateSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid }));
    expect(hib.state).toBe(OperationState.FAILED);
    expect((await store.getSandbox(tenantId, sid))?.value).toMatchObject({ state: 'paused', opId: '' });
    expect((await store.getSandbox(tenantId, sid))?.value.hibernatingFrom).toBeUndefined();
    await ok(api, await api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid }));
    await assertConsistent();

    // A wake no host can take (every host cordoned): back to hibernated, nothing booked.
    const w = await ok(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }));
    const wid = w.result.case === 'sandbox' ? w.result.value.id : '';
    await ok(api, await api.hibernateSandbox({ tenantId, idempotencyKey: key(), sandboxId: wid }));
    const open = (await api.listHosts({})).hosts.filter((h) => !h.cordoned).map((h) => h.id);
    try {
      for (const h of open) await api.cordonHost({ idempotencyKey: key(), hostId: h, cordon: true });
      const wake = await wait(api, await api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId: wid }));
      expect(wake.state).toBe(OperationState.FAILED);
      expect((await store.getSandbox(tenantId, wid))?.value).toMatchObject({ state: 'hibernated', opId: '' });
      await assertConsistent();
    } finally {
      for (const h of open) await api.cordonHost({ idempotencyKey: key(), hostId: h, cordon: false });
    }
    await ok(api, await api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId: wid }));
    for (const id of [bigId, sid, wid]) await ok(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
    await assertConsistent();
  }, 120_000);

  for (const [how, prefix, hostId] of [['ARetryableFailure', FAIL_ONCE_HOSTNAME, 'fake-once'], ['AFinalFailure', FAIL_ONCE_FINAL_HOSTNAME, 'fake-once-final']] as const) it(`create_whoseHostAnswers${how}_isGivenUpOnThere_soALaterCopyOfItsStepMakesNoVm`, async () => {
    await hostsSettled();
    await ownHost(hostId, hostId);
    // The host's first create of this VM fails (a retryable failure is not journalled by the
    // agent; a restore a restarted agent ran again keeps what its first run made).
    const op = await wait(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, hostname: `${prefix}-1`, placement: { hostId } }));
    expect(op.state).toBe(OperationState.FAILED);
    const sandboxId = op.targetId;
    expect((await store.getSandbox(tenantId, sandboxId))?.value.state).toBe('failed');
    // Another copy of the same step reaches the host later (a re-send queued behind the first,
    // a redelivery): it must not make the VM of a sandbox recorded failed and unbooked.
    const nc = await (await import('nats')).connect({ servers: nats.url });
    try {
      const bus = await NatsWorkBus.create(nc);
      await sleep(500);
      // A new op id: a final failure's step is answered from the journal, this one runs anew.
      await bus.sendWork(hostId, create(HostWorkSchema, { opId: op.id, stepId: 'create-copy', attempt: 9, tenantId, work: { case: 'createVm', value: { vm: { sandboxId, hostname: `${prefix}-1`, resources: { vcpus: 1, memoryMib: 256n, diskMib: 0n } }, image: 'tiny' } as never } }));
      await sleep(1500);
    } finally {
      await nc.close();
    }
    expect(fakes.flatMap((f) => f.vms().get(hostId) ?? []).map((v) => v.sandboxId)).not.toContain(sandboxId);
    await assertConsistent();
  }, 60_000);

  it('fork_whoseHostWasToldToGiveAChildUp_failsThatChild_andDoesNotRecordItRunningWithNoVm', async () => {
    await hostsSettled();
    const { sandboxId: sourceId } = await hostWithSandbox('fake-gaveup', 'gaveup', { FF_FAKE_SNAPSHOT_MS: '2000' });
    const op = await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'sandboxId', value: sourceId }, count: 2, placement: { hostId: 'fake-gaveup' } });
    const childIds = ((await store.getOp(tenantId, op.id))?.value.input as { childIds: string[] }).childIds;
    // While the source is snapshotted, the host is told to give the first child up for this op
    // (as it is when a child it was starting is placed elsewhere, then back on it).
    const nc = await (await import('nats')).connect({ servers: nats.url });
    try {
      const bus = await NatsWorkBus.create(nc);
      await bus.sendWork('fake-gaveup', create(HostWorkSchema, { opId: op.id, stepId: `stop-replaced/${childIds[0]}`, attempt: 1, tenantId, work: { case: 'destroyVm', value: { sandboxId: childIds[0]! } as never } }));
    } finally {
      await nc.close();
    }
    const final = await wait(api, op);
    expect(final.state).toBe(OperationState.FAILED);
    expect(final.error?.message).toContain('1 of 2');
    expect((await store.getSandbox(tenantId, childIds[0]!))?.value.state).toBe('failed');
    expect((await store.getSandbox(tenantId, childIds[1]!))?.value.state).toBe('running');
    await assertConsistent();
  }, 60_000);

  it('fork_whoseChildIsDestroyedDuringItsRestore_runsTheOthers_andLeavesNoVmOfTheDestroyedOne', async () => {
    // Four children on a host of their own: its restore takes ~600 ms (150 ms per VM).
    const slow = await ownHost('fake-s', 'slow', { FF_FAKE_RESTORE_MS_PER_VM: '150' });
    const fork = await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 4, placement: { hostId: 'fake-s' } });
    let kids: SandboxRec[] = [];
    await waitFor('children starting', async () => {
      kids = (await store.listSandboxes(tenantId)).map((v) => v.value).filter((v) => v.opId === fork.id && v.state === 'starting');
      return kids.length === 4;
    }, 10_000, 10);
    const gone = kids[0]!.id;
    const destroy = await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: gone });
    const f = await wait(api, fork);
    expect(f.state, f.error?.message).toBe(OperationState.SUCCEEDED);
    // Three started: the destroyed one is not counted.
    expect(f.progress?.done).toBe(3);
    expect((await wait(api, destroy)).state).toBe(OperationState.SUCCEEDED);
    for (const k of kids.slice(1)) expect((await store.getSandbox(tenantId, k.id))?.value.state).toBe('running');
    expect((await store.getSandbox(tenantId, gone))?.value.state).toBe('destroyed');
    await waitFor('no VM of the destroyed child', async () => !(slow.vms().get('fake-s') ?? []).some((v) => v.sandboxId === gone), 10_000, 50);
    await assertConsistent();
    for (const k of kids.slice(1)) await ok(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: k.id }));
  }, 60_000);

  it('hibernationSnapshot_deletedWhileItsHibernateStopsTheVm_isRefusedAsInUse_andTheSandboxHibernatesInIt', async () => {
    // A host whose VMs take 2 s to stop: the hibernation snapshot is ready, and no sandbox
    // record names it yet, for that long.
    await ownHost('fake-hib-del', 'hib-del', { FF_FAKE_DESTROY_MS: '2000' });
    const c = await ok(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-hib-del' } }));
    const sid = c.result.case === 'sandbox' ? c.result.value.id : '';
    const hib = await api.hibernateSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid });
    const snId = ((await store.getOp(tenantId, hib.id))?.value.input as { snapshotId: string }).snapshotId;
    await waitFor('the hibernation snapshot is ready', async () => (await store.getSnapshot(tenantId, snId))?.value.state === 'ready', 10_000, 10);
    expect((await store.getSandbox(tenantId, sid))?.value.state).toBe('hibernating');
    const del = (await api.deleteSnapshot({ tenantId, idempotencyKey: key(), snapshotId: snId }).catch((x: unknown) => x)) as RpcError;
    expect([del.code, del.field, del.message]).toEqual([Status.FAILED_PRECONDITION, 'snapshot_id', expect.stringContaining(sid)]);
    await ok(api, hib);
    expect((await store.getSandbox(tenantId, sid))?.value).toMatchObject({ state: 'hibernated', hibernationSnapshotId: snId });
    expect((await store.getSandbox(tenantId, sid))?.value.hibernatingTo).toBeUndefined();
    expect((await store.getSnapshot(tenantId, snId))?.value.state).toBe('ready');
    await ok(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: sid }));
    await assertConsistent();
  });

  it('work_ofADeposedLeadersTerm_reachingAHostAfterTheNewLeadersWork_isDropped_whileTheNewTermsWorkIsTaken', async () => {
    await hostsSettled();
    const hostId = 'fake-term';
    /** The leader term the host's agent keeps (its journal's leader-term file: "<cluster> <term>"). */
    const kept = (): { cluster: bigint; term: bigint } => {
      const [cluster, term] = readFileSync(join(dir, 'term', hostId, 'journal', 'leader-term'), 'utf8').trim().split(' ').map(BigInt);
      return { cluster: cluster!, term: term! };
    };
    const vmsOn = (): string[] => fakes.flatMap((f) => f.vms().get(hostId) ?? []).map((v) => v.sandboxId);
    await hostWithSandbox(hostId, 'term');
    const old = kept();
    await killLeader(await standbyTakesTheApi('s-term'));
    await ok(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId } }));
    const now = kept();
    expect(now.cluster).toBe(old.cluster);
    expect(now.term).toBeGreaterThan(old.term);
    // The deposed leader's publish (its NATS client held it through a disconnect) reaches the
    // host now, then one of the new term: the first makes no VM, the second does.
    const createVm = (sandboxId: string): ReturnType<typeof create<typeof HostWorkSchema>>['work'] => ({ case: 'createVm', value: { vm: { sandboxId, hostname: sandboxId, resources: { vcpus: 1, memoryMib: 256n, diskMib: 0n } }, image: 'tiny' } as never });
    const nc = await (await import('nats')).connect({ servers: nats.url });
    try {
      const bus = await NatsWorkBus.create(nc);
      bus.newTerm(old);
      await bus.sendWork(hostId, create(HostWorkSchema, { opId: 'op-deposed', stepId: 'create', attempt: 1, tenantId, work: createVm('sb-deposed00000000000') }));
      bus.newTerm(now);
      await bus.sendWork(hostId, create(HostWorkSchema, { opId: 'op-current', stepId: 'create', attempt: 1, tenantId, work: createVm('sb-current00000000000') }));
      await waitFor("the new term's VM made", async () => vmsOn().includes('sb-current00000000000'), 10_000, 20);
      expect(vmsOn()).not.toContain('sb-deposed00000000000');
      // That VM has no record: stopped again, so the fleet stays consistent.
      await bus.sendWork(hostId, create(HostWorkSchema, { opId: 'op-current', stepId: 'destroy', attempt: 1, tenantId, work: { case: 'destroyVm', value: { sandboxId: 'sb-current00000000000' } as never } }));
      await waitFor("the new term's VM stopped", async () => !vmsOn().includes('sb-current00000000000'), 10_000, 20);
    } finally {
      await nc.close();
    }
    expect(vmsOn()).not.toContain('sb-deposed00000000000');
    await assertConsistent();
  }, 90_000);

  /** A running sandbox on a host of its own, its record then rewritten with `left` (what an op that ended unsettled leaves; the op here is one that is gone). */
  async function leftByAnEndedOp(hostId: string, left: Partial<SandboxRec>): Promise<string> {
    await hostsSettled();
    const { sandboxId } = await hostWithSandbox(hostId, hostId);
    const v = (await store.getSandbox(tenantId, sandboxId))!;
    expect(await store.commit([{ kind: 'sandbox', value: { ...v.value, ...left }, expectRevision: v.modRevision }])).toBe(true);
    return sandboxId;
  }

  it('destroy_ofASandboxLeftHibernatingByAHibernateThatEnded_destroysIt_releasingItsBookingAndStoppingItsVm', async () => {
    // A hibernate that failed past its steps (its final write lost every retry, say).
    const sandboxId = await leftByAnEndedOp('fake-hibend', { state: 'hibernating', opId: 'op-endedhibernate000000', hibernatingFrom: 'running', hibernatingTo: 'sn-endedhibernate000000' });
    const d = await wait(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId }));
    expect(d.state, d.error?.message).toBe(OperationState.SUCCEEDED);
    expect((await store.getSandbox(tenantId, sandboxId))?.value.state).toBe('destroyed');
    expect(fakes.flatMap((f) => f.vms().get('fake-hibend') ?? [])).toEqual([]);
    await assertConsistent();
  }, 90_000);

  it('sandbox_leftDestroyingByADestroyThatEnded_isDestroyedByAnotherThatTheLeaderStarts_releasingItsBookingAndStoppingItsVm', async () => {
    // A destroy whose host step failed (or whose final write lost every retry): booked, its
    // VM perhaps still there.
    const sandboxId = await leftByAnEndedOp('fake-desend', { state: 'destroying', opId: 'op-endeddestroy00000000' });
    await waitFor('the sandbox destroyed', async () => (await store.getSandbox(tenantId, sandboxId))?.value.state === 'destroyed', 20_000, 100);
    expect(fakes.flatMap((f) => f.vms().get('fake-desend') ?? [])).toEqual([]);
    await assertConsistent();
  }, 90_000);

  it('hibernate_runAgainByANewLeaderAfterTheSandboxWasWokenMeanwhile_leavesItRunning_withItsVmAndOneBooking', async () => {
    await hostsSettled();
    // fake-hib-a runs the sandbox; fake-hib-r copies the replica in 8 s; every other host is
    // cordoned so the copy goes there. The sandbox is recorded hibernated, woken on fake-hib-a
    // while the copy runs, and then the leader dies: the standby runs the hibernate again.
    const { sandboxId } = await hostWithSandbox('fake-hib-a', 'hib-a');
    await ownHost('fake-hib-r', 'hib-r', { FF_FAKE_FETCH_MS: '8000' });
    const others = (await api.listHosts({})).hosts.filter((h) => h.id !== 'fake-hib-a' && h.id !== 'fake-hib-r' && !h.cordoned).map((h) => h.id);
    const leader = await standbyTakesTheApi('s-hib');
    try {
      for (const id of others) await api.cordonHost({ idempotencyKey: key(), hostId: id, cordon: true });
      const hib = await api.hibernateSandbox({ tenantId, idempotencyKey: key(), sandboxId, replicas: 1 });
      await waitFor('the sandbox recorded hibernated while its replica is copied', async () => (await store.getSandbox(tenantId, sandboxId))?.value.state === 'hibernated', 20_000, 20);
      await ok(api, await api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId }));
      expect((await store.getOp(tenantId, hib.id))?.value.state).toBe('running');
      await killLeader(leader);
      const final = await wait(api, hib);
      expect(final.state, final.error?.message).toBe(OperationState.SUCCEEDED);
      // Woken is woken: running, its VM running where the record says, booked once.
      const sb = (await store.getSandbox(tenantId, sandboxId))?.value;
      expect(sb).toMatchObject({ state: 'running', opId: '' });
      const vm = fakes.flatMap((f) => [...f.vms().values()].flat()).find((v) => v.sandboxId === sandboxId);
      expect(vm?.state).toBe('running');
      await assertConsistent();
    } finally {
      for (const id of others) await api.cordonHost({ idempotencyKey: key(), hostId: id, cordon: false });
    }
  }, 120_000);

  it('drain_runAgainByANewLeaderAfterItsSandboxWasDestroyedMidMigration_releasesTheDestinationsBooking_andRemovesTheCopy', async () => {
    await hostsSettled();
    // fake-dr-a is drained; fake-dr-b, the only other uncordoned host, restores in 6 s. The
    // sandbox is destroyed once a host is booked for it, and the leader dies while the copy
    // is made: the standby runs the drain again.
    const { sandboxId } = await hostWithSandbox('fake-dr-a', 'dr-a');
    await ownHost('fake-dr-b', 'dr-b', { FF_FAKE_RESTORE_MS_PER_VM: '6000' });
    const others = (await api.listHosts({})).hosts.filter((h) => h.id !== 'fake-dr-a' && h.id !== 'fake-dr-b' && !h.cordoned).map((h) => h.id);
    const leader = await standbyTakesTheApi('s-dr');
    try {
      for (const id of others) await api.cordonHost({ idempotencyKey: key(), hostId: id, cordon: true });
      const drain = await api.drainHost({ idempotencyKey: key(), hostId: 'fake-dr-a', migrate: true });
      await waitFor('fake-dr-b booked for it', async () => {
        const o = (await store.getOp('admin', drain.id))?.value;
        return (o?.input as { migrations?: Record<string, { toHostId?: string }> } | undefined)?.migrations?.[sandboxId]?.toHostId === 'fake-dr-b';
      }, 20_000, 5);
      await ok(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId }));
      await killLeader(leader);
      const f = await wait(api, drain, 'admin');
      expect(f.state).toBe(OperationState.FAILED);
      expect(f.error?.message).toContain('moved on during its migration');
      await waitFor('no VM of it anywhere', async () => !fakes.flatMap((x) => [...x.vms().values()]).some((vms) => vms.some((v) => v.sandboxId === sandboxId)), 20_000, 50);
      // Nothing booked on fake-dr-b for the destroyed sandbox (assertConsistent counts every host's bookings).
      await assertConsistent();
    } finally {
      for (const id of [...others, 'fake-dr-a']) await api.cordonHost({ idempotencyKey: key(), hostId: id, cordon: false });
    }
  }, 120_000);

  it('snapshot_pinnedWhileTaken_staysPinnedOnceReady_andADeleteMeanwhileIsRefusedByTheCall_writingNothing', async () => {
    // A host whose snapshots take 600 ms.
    await ownHost('fake-p', 'pin', { FF_FAKE_SNAPSHOT_MS: '600' });
    const c = await ok(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-p' } }));
    const sid = c.result.case === 'sandbox' ? c.result.value.id : '';
    const snap = await api.snapshotSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid });
    let snId = '';
    await waitFor('snapshot creating', async () => {
      const o = (await store.getOp(tenantId, snap.id))?.value;
      snId = (o?.input as { snapshotId?: string } | undefined)?.snapshotId ?? '';
      return snId !== '' && (await store.getSnapshot(tenantId, snId))?.value.state === 'creating';
    }, 10_000, 10);
    await api.pinSnapshot({ tenantId, idempotencyKey: key(), snapshotId: snId });
    // Refused by the call itself, naming the field, with no operation recorded (one would have
    // marked the snapshot deleting, refusing forks of it, until it failed).
    const del = (await api.deleteSnapshot({ tenantId, idempotencyKey: key(), snapshotId: snId }).catch((x: unknown) => x)) as RpcError;
    expect([del.code, del.field]).toEqual([Status.FAILED_PRECONDITION, 'snapshot_id']);
    expect((await store.listOps({ activeOnly: false, tenantId })).some((v) => v.value.kind === 'delete_snapshot' && v.value.targetId === snId)).toBe(false);
    await ok(api, snap);
    expect((await store.getSnapshot(tenantId, snId))?.value).toMatchObject({ state: 'ready', pinned: true });
    await ok(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: sid }));
  }, 60_000);

  it('drain_whoseSandboxFitsNoOtherHost_failsAndLeavesItsVmRunning', async () => {
    // 40 vCPUs: no other host has that many. The migration pauses the source VM before it
    // books a destination; when none can take it, the source must run again.
    const big = await ownHost('fake-big', 'big', { FF_FAKE_VCPUS: '40' });
    const c = await ok(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 40 }, placement: { hostId: 'fake-big' } }));
    const id = c.result.case === 'sandbox' ? c.result.value.id : '';
    const final = await wait(api, await api.drainHost({ idempotencyKey: key(), hostId: 'fake-big', migrate: true }), 'admin');
    expect(final.state).toBe(OperationState.FAILED);
    expect(final.error?.message).toMatch(/moved 0 of 1/);
    expect((await store.getHost('fake-big'))?.value).toMatchObject({ cordoned: true, draining: false });
    expect(big.vms().get('fake-big')?.find((v) => v.sandboxId === id)?.state).toBe('running');
    expect((await store.getSandbox(tenantId, id))?.value.state).toBe('running');
    await ok(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
    await assertConsistent();
  });

  it('forks_thatFinishBeforeTheirOwnWatchEventsArrive_runOnceAndSucceed', async () => {
    // Agents that answer at once, with no files (FF_FAKE_STATE=memory): an op can end before
    // the leader's watch has delivered its earlier writes. Those late, unfinished copies must
    // not start it again (a second run would try to place the children again and fail the op).
    const quickHosts = ['quick-1', 'quick-2'];
    const quick = await startFakeAgents({ hosts: quickHosts, dataDir: join(dir, 'quick'), natsUrl: nats.url, logDir: dir, env: { FF_FAKE_VCPUS: '100000', FF_FAKE_MEMORY_MIB: '100000000', FF_FAKE_STATE: 'memory', FF_STEP_CONCURRENCY: '64' } });
    try {
      await waitFor('quick hosts registered', async () => (await api.listHosts({})).hosts.filter((h) => quickHosts.includes(h.id)).length === 2, 20_000, 100);
      const FORKS = 48;
      let next = 0;
      const finals: Operation[] = [];
      await Promise.all(
        Array.from({ length: 16 }, async () => {
          while (next < FORKS) {
            const hostId = quickHosts[next++ % 2]!;
            finals.push(await wait(api, await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 64, placement: { hostId } })));
          }
        }),
      );
      expect(finals.filter((f) => f.state !== OperationState.SUCCEEDED).map((f) => `${f.id}: ${f.error?.message}`)).toEqual([]);
      const children = finals.flatMap((f) => (f.result.case === 'fork' ? f.result.value.children : []));
      expect(new Set(children.map((c) => c.id)).size).toBe(FORKS * 64);
      const onQuick = (await store.listSandboxes(tenantId)).filter((v) => quickHosts.includes(v.value.hostId));
      expect(onQuick.map((v) => v.value.state).filter((s) => s !== 'running')).toEqual([]);
      expect(onQuick).toHaveLength(FORKS * 64);
    } finally {
      await quick.stop();
    }
  }, 180_000);
  it('host_ofAThousandSandboxes_whenLost_marksThemLostAFewTransactionsAtATime_andReleasesItsWholeBooking', async () => {
    const hostId = 'many-lost';
    const many = await startFakeAgents({ hosts: [hostId], dataDir: join(dir, 'many-lost'), natsUrl: nats.url, logDir: dir, env: { FF_FAKE_VCPUS: '100000', FF_FAKE_MEMORY_MIB: '100000000', FF_FAKE_STATE: 'memory', FF_STEP_CONCURRENCY: '64' } });
    try {
      await waitFor(`${hostId} registered`, async () => (await api.listHosts({})).hosts.some((h) => h.id === hostId), 20_000, 100);
      for (let i = 0; i < 4; i++) await ok(api, await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 250, placement: { hostId } }));
      expect((await store.getAlloc(hostId)).value.sandboxes).toBe(1000);
      many.proc.kill();
      await many.proc.exited;
      const onHost = async () => (await store.listSandboxes(tenantId)).filter((v) => v.value.hostId === hostId);
      await waitFor('every sandbox of the lost host marked lost', async () => (await onHost()).every((v) => v.value.state === 'lost'), 60_000, 250);
      const lost = await onHost();
      expect(lost).toHaveLength(1000);
      expect(new Set(lost.map((v) => v.value.stateReason))).toEqual(new Set([`host ${hostId} lost`]));
      // Batches of 99 with the host's booking in one transaction each (11 for 1,000; a few more
      // if a batch met a conflict and went one by one), not a transaction per sandbox.
      expect(new Set(lost.map((v) => v.modRevision)).size).toBeLessThanOrEqual(20);
      expect((await store.getAlloc(hostId)).value).toMatchObject({ sandboxes: 0, allocated: { vcpus: 0, memoryMib: 0, diskMib: 0 } });
    } finally {
      await many.stop();
    }
  }, 180_000);
  it('listOperations_newestFirst_filtersByStateKindAndTarget_pagesEveryOneOnce_andNamesABadField', async () => {
    const t = 'ops-list';
    const a = await ok(api, await api.createSandbox({ tenantId: t, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }), t);
    const sandboxId = a.result.case === 'sandbox' ? a.result.value.id : '';
    const snap = await ok(api, await api.snapshotSandbox({ tenantId: t, idempotencyKey: key(), sandboxId }), t);
    const forked = await ok(api, await api.forkSandbox({ tenantId: t, idempotencyKey: key(), source: { case: 'snapshotId', value: snap.result.case === 'snapshot' ? snap.result.value.id : '' }, count: 3 }), t);
    const kids = forked.result.case === 'fork' ? forked.result.value.children.map((c) => c.id) : [];
    for (const id of kids) await ok(api, await api.destroySandbox({ tenantId: t, idempotencyKey: key(), sandboxId: id }), t);
    const submitted = [a, snap, forked].map((o) => o.id);

    const all = (await api.listOperations({ tenantId: t })).operations;
    expect(all).toHaveLength(3 + kids.length);
    const created = all.map((o) => Number(o.createdAt!.seconds) * 1000 + Math.floor(o.createdAt!.nanos / 1e6));
    expect(created).toEqual([...created].sort((x, y) => y - x));
    expect(all.slice(-3).map((o) => o.id)).toEqual([...submitted].reverse());
    expect(new Set(all.map((o) => o.tenantId))).toEqual(new Set([t]));
    // A fork comes with its children, as GetOperation gives it.
    const fork = (await api.listOperations({ tenantId: t, kinds: [OperationKind.FORK] })).operations;
    expect(fork.map((o) => o.id)).toEqual([forked.id]);
    expect(fork[0]!.result.case === 'fork' ? fork[0]!.result.value.children.map((c) => c.id).sort() : []).toEqual([...kids].sort());
    expect((await api.listOperations({ tenantId: t, kinds: [OperationKind.CREATE, OperationKind.SNAPSHOT] })).operations.map((o) => o.id)).toEqual([snap.id, a.id]);
    expect((await api.listOperations({ tenantId: t, states: [OperationState.SUCCEEDED] })).operations).toHaveLength(all.length);
    expect((await api.listOperations({ tenantId: t, states: [OperationState.FAILED, OperationState.RUNNING] })).operations).toEqual([]);
    expect((await api.listOperations({ tenantId: t, targetId: kids[0]! })).operations.map((o) => OperationKind[o.kind])).toEqual(['DESTROY']);
    expect((await api.listOperations({ tenantId: t, targetId: sandboxId })).operations.map((o) => o.id)).toEqual([snap.id, a.id]);

    // Pages of 2 walk every operation once, in the same order.
    const walked: string[] = [];
    let pageToken = '';
    do {
      const p = await api.listOperations({ tenantId: t, pageSize: 2, pageToken });
      expect(p.operations.length).toBeLessThanOrEqual(2);
      walked.push(...p.operations.map((o) => o.id));
      pageToken = p.nextPageToken;
    } while (pageToken);
    expect(walked).toEqual(all.map((o) => o.id));

    const bad = async (req: Parameters<Fleet['listOperations']>[0]): Promise<string> => {
      const e = (await api.listOperations(req).then(() => undefined, (x: unknown) => x)) as { code?: number; field?: string } | undefined;
      expect(e?.code).toBe(Status.INVALID_ARGUMENT);
      return e?.field ?? '';
    };
    expect(await bad({ tenantId: t, states: [OperationState.UNSPECIFIED] })).toBe('states[0]');
    expect(await bad({ tenantId: t, kinds: [OperationKind.FORK, 99 as OperationKind] })).toBe('kinds[1]');
    expect(await bad({ tenantId: t, targetId: '../etc' })).toBe('target_id');
    // A sandbox list's token is not an operation list's.
    expect(await bad({ tenantId: t, pageToken: Buffer.from(sandboxId).toString('base64url') })).toBe('page_token');
  }, 60_000);
  it('listsOfAllTenants_showAnAdminEveryTenantsSandboxesOnAHostAndTheirOperations_andNeedNoTenantId', async () => {
    const made = async (t: string, hostId?: string): Promise<{ id: string; hostId: string; opId: string }> => {
      const op = await ok(api, await api.createSandbox({ tenantId: t, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, ...(hostId ? { placement: { hostId } } : {}) }), t);
      return { id: op.result.case === 'sandbox' ? op.result.value.id : '', hostId: op.result.case === 'sandbox' ? op.result.value.hostId : '', opId: op.id };
    };
    // A host of their own: earlier tests leave the shared ones nearly full.
    const agents = await ownHost('fake-tenants', 'tenants');
    const x = await made('tenant-x', 'fake-tenants');
    const y = await made('tenant-y', 'fake-tenants');
    const onHost = (await api.listSandboxes({ allTenants: true, hostId: x.hostId })).sandboxes;
    expect(onHost.every((s) => s.hostId === x.hostId)).toBe(true);
    expect(onHost.filter((s) => s.id === x.id || s.id === y.id).map((s) => [s.id, s.tenantId]).sort()).toEqual([[x.id, 'tenant-x'], [y.id, 'tenant-y']].sort());
    // Without all_tenants, one tenant's only; host_id filters on the server.
    expect((await api.listSandboxes({ tenantId: 'tenant-x', hostId: x.hostId })).sandboxes.map((s) => s.id)).toEqual([x.id]);
    const other = HOSTS.find((h) => h !== x.hostId)!;
    expect((await api.listSandboxes({ tenantId: 'tenant-x', hostId: other })).sandboxes).toEqual([]);
    const creates = (await api.listOperations({ allTenants: true, kinds: [OperationKind.CREATE] })).operations;
    expect(creates.slice(0, 2).map((o) => [o.id, o.tenantId])).toEqual([[y.opId, 'tenant-y'], [x.opId, 'tenant-x']]);

    const fieldOf = (p: Promise<unknown>): Promise<[number | undefined, string | undefined]> => p.then(() => [undefined, undefined], (e: { code?: number; field?: string }) => [e.code, e.field]);
    expect(await fieldOf(api.listSandboxes({ allTenants: true, tenantId: 'tenant-x' }))).toEqual([Status.INVALID_ARGUMENT, 'tenant_id']);
    expect(await fieldOf(api.listOperations({ allTenants: true, tenantId: 'tenant-x' }))).toEqual([Status.INVALID_ARGUMENT, 'tenant_id']);
    expect(await fieldOf(api.listSandboxes({ tenantId: 'tenant-x', hostId: 'Not A Host' }))).toEqual([Status.INVALID_ARGUMENT, 'host_id']);
    for (const s of [x, y]) await ok(api, await api.destroySandbox({ tenantId: s === x ? 'tenant-x' : 'tenant-y', idempotencyKey: key(), sandboxId: s.id }), s === x ? 'tenant-x' : 'tenant-y');
    await agents.stop();
  }, 60_000);

  /**
   * Hosts an earlier test stopped the agents of are lost (their sandboxes too) before a test
   * checks the whole fleet's consistency: until then their sandboxes run with no VM anywhere.
   */
  async function hostsSettled(): Promise<void> {
    await waitFor('no host suspect, and no sandbox running on a lost one', async () => {
      const hosts = (await api.listHosts({})).hosts;
      if (hosts.some((h) => h.state === HostState.SUSPECT)) return false;
      const lost = new Set(hosts.filter((h) => h.state === HostState.LOST).map((h) => h.id));
      return (await store.listSandboxes(undefined)).every((v) => !lost.has(v.value.hostId) || (v.value.state !== 'running' && v.value.state !== 'paused'));
    }, 60_000, 250);
  }

  /** A new standby replica `replicaId`, which the API now talks to; returns the leader (for killLeader). */
  async function standbyTakesTheApi(replicaId: string): Promise<SchedulerProcess> {
    const standby = await startReplica(replicaId);
    const alive = scheds.filter((x) => x.proc.child.exitCode === null && x.proc.child.signalCode === null && x !== standby);
    const leader = (await Promise.all(alive.map(async (x) => ((await x.isLeader()) ? x : undefined)))).find(Boolean)!;
    api.close();
    api = standby.credentials.client(FleetService, standby.api);
    return leader;
  }

  /** Kills the leader and waits until another replica leads. */
  async function killLeader(leader: SchedulerProcess): Promise<void> {
    leader.proc.kill();
    await leader.proc.exited;
    const rest = scheds.filter((x) => x !== leader && x.proc.child.exitCode === null && x.proc.child.signalCode === null);
    await waitFor('a standby takes over', async () => (await Promise.all(rest.map((x) => x.isLeader()))).some(Boolean), 10_000, 20);
  }

  /** A fork's or drain's CancelOperation, then its end: CANCELLED, with the error saying what it undid. */
  async function cancelled(op: Operation, tenant = tenantId): Promise<Operation> {
    const asked = await api.cancelOperation({ tenantId: tenant, operationId: op.id });
    expect(asked.cancelRequested).toBe(true);
    const final = await wait(api, op, tenant);
    expect([OperationState[final.state], final.error?.kind]).toEqual(['CANCELLED', 'cancelled']);
    // Asked again: the same answer, nothing else happens.
    expect((await api.cancelOperation({ tenantId: tenant, operationId: op.id })).state).toBe(OperationState.CANCELLED);
    return final;
  }

  it('cancelOperation_ofAForkWhileItsChildrenRestore_destroysEveryChildThatStarted_andLeavesNoVmOrBooking', async () => {
    await hostsSettled();
    const { sandboxId: sourceId } = await hostWithSandbox('fake-cancel-f', 'cancel-f', { FF_FAKE_RESTORE_MS_PER_VM: '1500' });
    const op = await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'sandboxId', value: sourceId }, count: 3, placement: { hostId: 'fake-cancel-f' } });
    let childIds: string[] = [];
    await waitFor('children placed and restoring', async () => {
      childIds = (await store.getOp(tenantId, op.id))?.value.result?.sandboxIds ?? [];
      return childIds.length === 3;
    }, 20_000, 20);
    const final = await cancelled(op);
    expect(final.error?.message).toContain('destroyed 3 of the 3 sandboxes it had started');
    const children = new Map((await store.listSandboxes(tenantId)).map((v) => [v.value.id, v.value] as [string, SandboxRec]));
    for (const id of childIds) expect([children.get(id)?.state, children.get(id)?.stateReason], id).toEqual(['destroyed', `fork ${op.id} cancelled`]);
    // The source runs on; nothing of the children is left on the host or booked for them.
    expect(children.get(sourceId)?.state).toBe('running');
    expect(fakes.flatMap((f) => f.vms().get('fake-cancel-f') ?? []).map((v) => v.sandboxId)).toEqual([sourceId]);
    await assertConsistent();
  }, 90_000);

  it('cancelOperation_ofAForkWhileItSnapshotsItsLiveSource_placesNoChild_andTheSourceRunsOn', async () => {
    await hostsSettled();
    const { sandboxId: sourceId } = await hostWithSandbox('fake-cancel-s', 'cancel-s', { FF_FAKE_SNAPSHOT_MS: '2000' });
    const op = await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'sandboxId', value: sourceId }, count: 4 });
    await waitFor('source snapshot under way', async () => ((await store.getOp(tenantId, op.id))?.value.input as { forkSnapshotId?: string }).forkSnapshotId !== undefined, 20_000, 10);
    const final = await cancelled(op);
    expect(final.result.case === 'fork' ? final.result.value.children : []).toEqual([]);
    expect((await store.getOp(tenantId, op.id))?.value.result?.sandboxIds).toBeUndefined();
    expect((await store.getSandbox(tenantId, sourceId))?.value.state).toBe('running');
    expect(fakes.flatMap((f) => f.vms().get('fake-cancel-s') ?? []).map((v) => v.sandboxId)).toEqual([sourceId]);
    await assertConsistent();
  }, 90_000);

  it('cancelOperation_ofADrainBetweenItsMigrations_movesNoFurtherSandbox_andTheHostStaysCordonedNotDraining', async () => {
    await hostsSettled();
    await ownHost('fake-cancel-d', 'cancel-d', { FF_FAKE_SNAPSHOT_MS: '1500' });
    const ids: string[] = [];
    for (let i = 0; i < 2; i++) {
      const c = await ok(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-cancel-d' } }));
      ids.push(c.result.case === 'sandbox' ? c.result.value.id : '');
    }
    const op = await api.drainHost({ idempotencyKey: key(), hostId: 'fake-cancel-d', migrate: true });
    await waitFor('first migration under way', async () => Object.keys(((await store.getOp('admin', op.id))?.value.input as { migrations?: object }).migrations ?? {}).length > 0, 20_000, 10);
    const final = await cancelled(op, 'admin');
    expect(final.error?.message).toMatch(/moved 1 of 2 sandboxes off fake-cancel-d/);
    expect((await api.listHosts({})).hosts.find((h) => h.id === 'fake-cancel-d')).toMatchObject({ cordoned: true, draining: false });
    const after = await Promise.all(ids.map(async (id) => (await store.getSandbox(tenantId, id))?.value));
    expect(after.map((s) => s?.state)).toEqual(['running', 'running']);
    expect(after.filter((s) => s?.hostId === 'fake-cancel-d')).toHaveLength(1);
    await assertConsistent();
    await api.cordonHost({ idempotencyKey: key(), hostId: 'fake-cancel-d', cordon: false });
  }, 90_000);

  it('cancelOperation_ofADrain_whenTheLeaderDiesMidMigrationBeforeBookingAHost_theStandbyUndoesIt_leavingNoSandboxClaimedPausedOrBookedTwice', async () => {
    await hostsSettled();
    const { sandboxId } = await hostWithSandbox('fake-cancel-m', 'cancel-m', { FF_FAKE_SNAPSHOT_MS: '3000' });
    const standby = await startReplica('s-cancel-m');
    const alive = scheds.filter((x) => x.proc.child.exitCode === null && x.proc.child.signalCode === null && x !== standby);
    const leader = (await Promise.all(alive.map(async (x) => ((await x.isLeader()) ? x : undefined)))).find(Boolean)!;
    api.close();
    api = standby.credentials.client(FleetService, standby.api);
    const op = await api.drainHost({ idempotencyKey: key(), hostId: 'fake-cancel-m', migrate: true });
    // Claimed and paused for its snapshot (3 s on this host) when the drain is cancelled and its leader dies.
    await waitFor('the sandbox claimed for its migration', async () => (await store.getSandbox(tenantId, sandboxId))?.value.opId === op.id, 20_000, 10);
    await api.cancelOperation({ tenantId: 'admin', operationId: op.id });
    leader.proc.kill();
    await leader.proc.exited;
    const others = scheds.filter((x) => x !== leader && x.proc.child.exitCode === null && x.proc.child.signalCode === null);
    await waitFor('a standby takes over', async () => (await Promise.all(others.map((x) => x.isLeader()))).some(Boolean), 10_000, 20);
    const final = await wait(api, op, 'admin');
    expect(OperationState[final.state]).toBe('CANCELLED');
    // Undone, as no host was booked for it yet: it runs where it was, unclaimed.
    const sb = (await store.getSandbox(tenantId, sandboxId))?.value;
    expect(sb).toMatchObject({ state: 'running', opId: '', hostId: 'fake-cancel-m' });
    const vm = fakes.flatMap((f) => [...f.vms().values()].flat()).find((v) => v.sandboxId === sandboxId);
    expect(vm?.state).toBe('running');
    await assertConsistent();
    await api.cordonHost({ idempotencyKey: key(), hostId: 'fake-cancel-m', cordon: false });
  }, 90_000);

  it('cancelOperation_ofACreateWhileItBoots_destroysTheSandboxOnceItStarted_andLeavesNoVmOrBooking', async () => {
    await hostsSettled();
    await ownHost('fake-cancel-c', 'cancel-c', { FF_FAKE_CREATE_MS: '1500' });
    const op = await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-cancel-c' } });
    await waitFor('booting', async () => (await store.getSandbox(tenantId, op.targetId))?.value.state === 'starting', 20_000, 10);
    const final = await cancelled(op);
    expect(final.error?.message).toContain('destroyed 1 of the 1 sandboxes it had started');
    expect((await store.getSandbox(tenantId, op.targetId))?.value.state).toBe('destroyed');
    expect(fakes.flatMap((f) => f.vms().get('fake-cancel-c') ?? [])).toEqual([]);
    await assertConsistent();
  }, 60_000);

  it('cancelOperation_ofAFork_whenTheLeaderIsKilledWhileItDestroysTheChildren_endsCancelledViaTheStandby_withEachChildDestroyedOnce', async () => {
    await hostsSettled();
    const { sandboxId: sourceId } = await hostWithSandbox('fake-cancel-k', 'cancel-k', { FF_FAKE_RESTORE_MS_PER_VM: '300', FF_FAKE_DESTROY_MS: '2000' });
    // A standby to take over, and the API on it.
    const standby = await startReplica('s-cancel');
    const alive = scheds.filter((x) => x.proc.child.exitCode === null && x.proc.child.signalCode === null && x !== standby);
    const leader = (await Promise.all(alive.map(async (x) => ((await x.isLeader()) ? x : undefined)))).find(Boolean)!;
    api.close();
    api = standby.credentials.client(FleetService, standby.api);
    const op = await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'sandboxId', value: sourceId }, count: 3, placement: { hostId: 'fake-cancel-k' } });
    await waitFor('children placed', async () => ((await store.getOp(tenantId, op.id))?.value.result?.sandboxIds ?? []).length === 3, 20_000, 20);
    await api.cancelOperation({ tenantId, operationId: op.id });
    // The leader is destroying the children (2 s each on the host) when it dies.
    const destroys = async (): Promise<Array<{ value: { idempotencyKey?: string; state: string } }>> => (await store.listOps({ activeOnly: false, tenantId })).filter((v) => v.value.kind === 'destroy' && (v.value.idempotencyKey ?? '').startsWith(`__cancel/${op.id}/`));
    await waitFor('destroys under way', async () => (await destroys()).length === 3, 30_000, 20);
    leader.proc.kill();
    await leader.proc.exited;
    const others = scheds.filter((x) => x !== leader && x.proc.child.exitCode === null && x.proc.child.signalCode === null);
    await waitFor('a standby takes over', async () => (await Promise.all(others.map((x) => x.isLeader()))).some(Boolean), 10_000, 20);
    const final = await wait(api, op);
    expect([OperationState[final.state], final.error?.message]).toEqual(['CANCELLED', 'cancelled by a CancelOperation call; destroyed 3 of the 3 sandboxes it had started']);
    // The same three destroy operations, each succeeded: none submitted again under another key.
    expect((await destroys()).map((v) => v.value.state)).toEqual(['succeeded', 'succeeded', 'succeeded']);
    for (const id of (await store.getOp(tenantId, op.id))?.value.result?.sandboxIds ?? []) expect((await store.getSandbox(tenantId, id))?.value.state, id).toBe('destroyed');
    await assertConsistent();
  }, 120_000);

  it('cancelOperation_ofAFinishedOrSingleStepOperation_isFailedPrecondition_ofAnUnknownOneNotFound_andABadIdNamesTheField', async () => {
    const c = await ok(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }));
    const sandboxId = c.result.case === 'sandbox' ? c.result.value.id : '';
    const fail = (p: Promise<unknown>): Promise<[number | undefined, string | undefined]> => p.then(() => [undefined, undefined], (e: { code?: number; field?: string }) => [e.code, e.field]);
    expect(await fail(api.cancelOperation({ tenantId, operationId: c.id }))).toEqual([Status.FAILED_PRECONDITION, 'operation_id']);
    // A pause is one host step: refused while it runs as well as after.
    const pause = await api.pauseSandbox({ tenantId, idempotencyKey: key(), sandboxId });
    expect(await fail(api.cancelOperation({ tenantId, operationId: pause.id }))).toEqual([Status.FAILED_PRECONDITION, 'operation_id']);
    await ok(api, pause);
    expect((await fail(api.cancelOperation({ tenantId, operationId: 'op-aaaaaaaaaaaaaaaaaaaa' })))[0]).toBe(Status.NOT_FOUND);
    expect(await fail(api.cancelOperation({ tenantId, operationId: 'Not An Id' }))).toEqual([Status.INVALID_ARGUMENT, 'operation_id']);
    await ok(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId }));
    // An operation the sandbox's state does not allow names the sandbox as the field.
    expect(await fail(api.pauseSandbox({ tenantId, idempotencyKey: key(), sandboxId }))).toEqual([Status.FAILED_PRECONDITION, 'sandbox_id']);
  }, 60_000);
});
