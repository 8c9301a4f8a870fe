// A create whose start fails on its host for the host's own reasons (here: every image build
// fails there) is placed on another host, and placement then prefers other hosts for a while
// (executor.ts placeCreateAgain, failedStarts). Real etcd and nats-server, a scheduler replica
// in this process and two fake host agent processes (loadtest/fake-agent/), one of which fails
// every image build, 1.5 s after it began (FF_FAKE_FAIL_IMAGES, FF_FAKE_CREATE_MS).
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { join } from 'node:path';
import { waitFor } from './testkit/proc.ts';
import { startFakeAgents } from './testkit/fleet-procs.ts';
import type { FakeAgentsProcess } from './testkit/fleet-procs.ts';
import { startTestScheduler } from './testkit/scheduler.ts';
import type { Fleet, TestScheduler } from './testkit/scheduler.ts';
import { HostState, OperationState, OperationStepState } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { Operation } from '../proto/gen/forkfleet/v1/fleet_pb.ts';

const tenantId = 't1';
let keyN = 0;
const key = (): string => `k-${Date.now()}-${keyN++}`;

describe('a create whose host fails its start (real etcd, NATS, fake agents)', () => {
  let ts: TestScheduler;
  let bad: FakeAgentsProcess;
  let good: FakeAgentsProcess;
  let api: Fleet;

  beforeAll(async () => {
    ts = await startTestScheduler({ prefix: 'ff-create-elsewhere-' });
    api = ts.api;
    bad = await startFakeAgents({ hosts: ['fake-bad'], dataDir: join(ts.dir, 'bad'), natsUrl: ts.nats.url, logDir: ts.dir, env: { FF_FAKE_VCPUS: '64', FF_FAKE_FAIL_IMAGES: '1', FF_FAKE_CREATE_MS: '1500' } });
    good = await startFakeAgents({ hosts: ['fake-good'], dataDir: join(ts.dir, 'good'), natsUrl: ts.nats.url, logDir: ts.dir, env: { FF_FAKE_VCPUS: '64' } });
    await waitFor('hosts registered', async () => (await api.listHosts({})).hosts.filter((h) => h.state === HostState.READY).length === 2, 20_000, 100);
  }, 120_000);

  afterAll(async () => {
    await bad?.stop();
    await good?.stop();
    await ts?.stop();
  }, 60_000);

  const wait = async (op: Operation): Promise<Operation> => api.waitOperation({ tenantId, operationId: op.id, timeout: { seconds: 60n } }, { timeoutMs: 70_000 });
  const create = async (placement?: { hostId: string }): Promise<Operation> => wait(await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, ...(placement ? { placement } : {}) }));
  const hostOf = (op: Operation): string => (op.result.case === 'sandbox' ? op.result.value.hostId : '');

  it('placedOnTheFailingHostFirst_runsOnTheOther_andLaterCreatesGoThereFirst', async () => {
    // Placed on fake-bad while fake-good is cordoned; fake-good is uncordoned while fake-bad's
    // build takes its 1.5 s to fail: the create is then placed on fake-good.
    await api.cordonHost({ idempotencyKey: key(), hostId: 'fake-good', cordon: true });
    const submitted = await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } });
    await waitFor('placed on fake-bad', async () => (await api.getSandbox({ tenantId, sandboxId: submitted.targetId })).hostId === 'fake-bad', 10_000, 20);
    await api.cordonHost({ idempotencyKey: key(), hostId: 'fake-good', cordon: false });
    const moved = await wait(submitted);
    expect(moved.state, moved.error?.message).toBe(OperationState.SUCCEEDED);
    expect(hostOf(moved)).toBe('fake-good');
    expect(moved.steps.map((s) => [s.stepId, s.hostId, s.state])).toEqual([
      ['create', 'fake-bad', OperationStepState.FAILED],
      ['create/fake-good', 'fake-good', OperationStepState.SUCCEEDED],
    ]);
    // The failed host keeps no booking and no VM of it.
    expect((await api.listHosts({})).hosts.find((h) => h.id === 'fake-bad')?.sandboxCount).toBe(0);
    await waitFor('no VM of it on fake-bad', async () => !(bad.vms().get('fake-bad') ?? []).some((v) => v.sandboxId === moved.targetId && v.state !== 'destroyed'), 10_000, 100);
    // fake-bad failed a start lately: the next creates go to fake-good without trying it.
    for (let i = 0; i < 3; i++) {
      const op = await create();
      expect(op.state, op.error?.message).toBe(OperationState.SUCCEEDED);
      expect(op.steps.map((s) => s.hostId)).toEqual(['fake-good']);
    }
  }, 120_000);

  it('pinnedToTheFailingHost_failsThere_withItsError', async () => {
    const op = await create({ hostId: 'fake-bad' });
    expect(op.state).toBe(OperationState.FAILED);
    expect(op.steps.map((s) => s.hostId)).toEqual(['fake-bad']);
    expect((await api.listHosts({})).hosts.find((h) => h.id === 'fake-bad')?.sandboxCount).toBe(0);
  }, 60_000);
});
