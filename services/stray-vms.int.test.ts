// No VM runs without a record of it: the leader stops a VM that a host runs and no sandbox
// record places there. Real etcd and nats-server, a scheduler replica in this process, fake
// host agents as a process (loadtest/fake-agent/); the stray VM is made by a host step sent
// straight to the host's work subject, as a step of a crashed or deposed leader would be.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { join } from 'node:path';
import { connect } from 'nats';
import type { NatsConnection } from 'nats';
import { create, toBinary } from '@bufbuild/protobuf';
import { waitFor } from './testkit/proc.ts';
import { startFakeAgents } from './testkit/fleet-procs.ts';
import type { FakeAgentsProcess } from './testkit/fleet-procs.ts';
import { startTestScheduler } from './testkit/scheduler.ts';
import type { Fleet, TestScheduler } from './testkit/scheduler.ts';
import { subjects } from './adapters/nats/subjects.ts';
import { HostWorkSchema } from './domain/messages.ts';
import { OperationState } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { Operation } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import { status as Status } from '@grpc/grpc-js';
import type { RpcError } from './adapters/grpc/status.ts';

const tenantId = 't1';
let keyN = 0;
const key = (): string => `k-${Date.now()}-${keyN++}`;
const HOSTS = ['fake-1', 'fake-2'];
const GRACE_MS = 3000;

describe('stray VMs (real etcd, NATS, fake agents)', () => {
  let ts: TestScheduler;
  let agents: FakeAgentsProcess;
  let api: Fleet;
  let nc: NatsConnection;

  const vmsOn = (hostId: string): string[] => (agents.vms().get(hostId) ?? []).map((v) => v.sandboxId);

  /** A VM on `hostId` for `sandboxId`, made by a step no op of this scheduler sent. */
  async function makeVm(hostId: string, sandboxId: string): Promise<void> {
    const work = create(HostWorkSchema, {
      opId: `op-test-${sandboxId}`,
      stepId: 'create',
      attempt: 1,
      tenantId,
      work: { case: 'createVm', value: { vm: { sandboxId, hostname: sandboxId, resources: { vcpus: 1, memoryMib: 256n, diskMib: 1024n } }, image: 'tiny' } as never },
    });
    await nc.jetstream().publish(subjects.work(hostId), toBinary(HostWorkSchema, work), { msgID: `test/${hostId}/${sandboxId}` });
    await waitFor(`VM ${sandboxId} on ${hostId}`, async () => vmsOn(hostId).includes(sandboxId), 10_000, 50);
  }

  async function ok(op: Operation): Promise<Operation> {
    const final = await api.waitOperation({ tenantId, operationId: op.id, timeout: { seconds: 60n } }, { timeoutMs: 70_000 });
    expect(final.state, final.error?.message).toBe(OperationState.SUCCEEDED);
    return final;
  }

  beforeAll(async () => {
    ts = await startTestScheduler({ prefix: 'ff-stray-', config: { suspectAfterMs: '3s', lostAfterMs: '20s', strayVmGraceMs: `${GRACE_MS}ms` } });
    api = ts.api;
    agents = await startFakeAgents({ hosts: HOSTS, dataDir: join(ts.dir, 'fleet'), natsUrl: ts.nats.url, logDir: ts.dir, env: { FF_FAKE_VCPUS: '8' } });
    nc = await connect({ servers: ts.nats.url });
    await waitFor('hosts registered', async () => (await api.listHosts({})).hosts.length === HOSTS.length, 20_000, 100);
  }, 120_000);

  afterAll(async () => {
    await nc?.close();
    await agents?.stop();
    await ts?.stop();
  }, 60_000);

  it('aVmWithNoRecord_andOneWhoseSandboxLivesOnAnotherHost_areStoppedAfterTheGrace_andRecordedVmsStay', async () => {
    const live = await ok(await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-1' } }));
    const liveId = live.result.case === 'sandbox' ? live.result.value.id : '';
    const t0 = Date.now();
    // A VM of no sandbox at all, and a second VM of the live sandbox on the other host.
    await makeVm('fake-2', 'sb-norecord0000000000');
    await makeVm('fake-2', liveId);
    await waitFor('the stray VMs stopped', async () => vmsOn('fake-2').length === 0, 30_000, 100);
    // Not before the grace: each was stray in two VM checks at least GRACE_MS apart.
    expect(Date.now() - t0).toBeGreaterThanOrEqual(GRACE_MS);
    expect(vmsOn('fake-1')).toEqual([liveId]);
    const rec = await api.getSandbox({ tenantId, sandboxId: liveId });
    expect(rec.hostId).toBe('fake-1');
  }, 60_000);

  it('exec_inASandboxWhoseVmIsGoneFromItsHost_isFailedPreconditionNamingSandboxId_asTheHostSaidIt', async () => {
    const made = await ok(await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-1' } }));
    const id = made.result.case === 'sandbox' ? made.result.value.id : '';
    const gone = create(HostWorkSchema, { opId: `op-test-gone-${id}`, stepId: 'destroy', attempt: 1, tenantId, work: { case: 'destroyVm', value: { sandboxId: id } as never } });
    await nc.jetstream().publish(subjects.work('fake-1'), toBinary(HostWorkSchema, gone), { msgID: `test/gone/${id}` });
    await waitFor(`VM ${id} gone`, async () => !vmsOn('fake-1').includes(id), 10_000, 50);
    const e = (await (async () => {
      for await (const _ of api.exec({ tenantId, sandboxId: id, argv: ['true'] })) void _;
    })().then(() => undefined, (x: unknown) => x)) as RpcError | undefined;
    expect([e && Status[e.code], e?.field]).toEqual(['FAILED_PRECONDITION', 'sandbox_id']);
    await ok(await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
  }, 60_000);

  it('aVmOfADestroyedSandbox_isStopped', async () => {
    const made = await ok(await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'fake-2' } }));
    const id = made.result.case === 'sandbox' ? made.result.value.id : '';
    await ok(await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
    expect(vmsOn('fake-2')).toEqual([]);
    await makeVm('fake-2', id); // a restore that finished after its op had given up, say
    await waitFor('the destroyed sandbox\'s VM stopped', async () => vmsOn('fake-2').length === 0, 30_000, 100);
  }, 60_000);
});
