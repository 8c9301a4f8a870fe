// A sandbox whose record and VM disagree on paused/running (a pause or resume step that
// failed after its VM changed, e.g. the agent could not write the VM's state file): the call
// that asks for the state the record already shows must still put the VM there. Real etcd and
// nats-server, a scheduler replica in this process, a fake host agent process whose VM state
// file the test edits while the agent is down (loadtest/fake-agent/).
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { readdirSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { waitFor } from './testkit/proc.ts';
import { startFakeAgents } from './testkit/fleet-procs.ts';
import type { FakeAgentsProcess } from './testkit/fleet-procs.ts';
import { startTestScheduler } from './testkit/scheduler.ts';
import type { Fleet, TestScheduler } from './testkit/scheduler.ts';
import { OperationState, SandboxState } from '../proto/gen/forkfleet/v1/fleet_pb.ts';

const tenantId = 't1';
let keyN = 0;
const key = (): string => `k-${Date.now()}-${keyN++}`;

describe('record and VM out of step (real etcd, NATS, a fake agent)', () => {
  let ts: TestScheduler;
  let host: FakeAgentsProcess;
  let api: Fleet;

  beforeAll(async () => {
    ts = await startTestScheduler({ prefix: 'ff-vmstate-' });
    api = ts.api;
    // Pauses and resumes take 300 ms: long enough for ops submitted together to overlap.
    host = await startFakeAgents({ hosts: ['fake-v'], dataDir: join(ts.dir, 'fleet'), natsUrl: ts.nats.url, logDir: ts.dir, env: { FF_FAKE_PAUSE_MS: '300' } });
    await waitFor('host registered', async () => (await api.listHosts({})).hosts.length === 1, 20_000, 100);
  }, 120_000);

  afterAll(async () => {
    await host?.stop();
    await ts?.stop();
  }, 60_000);

  /** Rewrites the fake VM's state file while its agent is down; the agent adopts it as written. */
  async function setVmState(sandboxId: string, state: 'running' | 'paused'): Promise<void> {
    await host.stop();
    const dir = join(host.dataDir, 'fake-v', 'vmm', 'vms');
    const file = readdirSync(dir).map((f) => join(dir, f)).find((f) => (JSON.parse(readFileSync(f, 'utf8')) as { sandboxId: string }).sandboxId === sandboxId)!;
    writeFileSync(file, JSON.stringify({ ...(JSON.parse(readFileSync(file, 'utf8')) as object), state }));
    await host.restart();
  }
  const vmState = (sandboxId: string): string | undefined => host.vms().get('fake-v')?.find((v) => v.sandboxId === sandboxId)?.state;

  it('resumeOfASandboxRecordedRunningWhoseVmIsPaused_resumesTheVm_andPauseTheReverse', async () => {
    const made = await api.waitOperation({ tenantId, operationId: (await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } })).id, timeout: { seconds: 30n } });
    expect(made.state, made.error?.message).toBe(OperationState.SUCCEEDED);
    const sid = made.result.case === 'sandbox' ? made.result.value.id : '';

    await setVmState(sid, 'paused');
    const resume = await api.waitOperation({ tenantId, operationId: (await api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid })).id, timeout: { seconds: 30n } });
    expect(resume.state, resume.error?.message).toBe(OperationState.SUCCEEDED);
    expect(vmState(sid)).toBe('running');

    const paused = await api.waitOperation({ tenantId, operationId: (await api.pauseSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid })).id, timeout: { seconds: 30n } });
    expect(paused.state, paused.error?.message).toBe(OperationState.SUCCEEDED);
    expect((await api.getSandbox({ tenantId, sandboxId: sid })).state).toBe(SandboxState.PAUSED);
    await setVmState(sid, 'running');
    const again = await api.waitOperation({ tenantId, operationId: (await api.pauseSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid })).id, timeout: { seconds: 30n } });
    expect(again.state, again.error?.message).toBe(OperationState.SUCCEEDED);
    expect(vmState(sid)).toBe('paused');
  }, 120_000);

  it('pausesAndResumesOfOneSandbox_submittedTogether_runOneAfterAnotherInTheirOrder_andTheRecordEndsAsTheVm', async () => {
    const made = await api.waitOperation({ tenantId, operationId: (await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } })).id, timeout: { seconds: 30n } });
    const sid = made.result.case === 'sandbox' ? made.result.value.id : '';
    for (const last of ['resume', 'pause'] as const) {
      const kinds = last === 'resume' ? (['pause', 'resume', 'pause', 'resume'] as const) : (['resume', 'pause', 'resume', 'pause'] as const);
      const ops = [];
      for (const k of kinds) ops.push(await (k === 'pause' ? api.pauseSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid }) : api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId: sid })));
      const done = await Promise.all(ops.map(async (o) => api.waitOperation({ tenantId, operationId: o.id, timeout: { seconds: 30n } })));
      expect(done.map((d) => OperationState[d.state])).toEqual(['SUCCEEDED', 'SUCCEEDED', 'SUCCEEDED', 'SUCCEEDED']);
      // Each ended after the one before it.
      for (let i = 1; i < done.length; i++) expect(Number(done[i]!.updatedAt!.seconds) * 1e3 + done[i]!.updatedAt!.nanos / 1e6).toBeGreaterThanOrEqual(Number(done[i - 1]!.updatedAt!.seconds) * 1e3 + done[i - 1]!.updatedAt!.nanos / 1e6);
      const want = last === 'resume' ? 'running' : 'paused';
      expect([SandboxState[(await api.getSandbox({ tenantId, sandboxId: sid })).state].toLowerCase(), vmState(sid)]).toEqual([want, want]);
    }
  });
});
