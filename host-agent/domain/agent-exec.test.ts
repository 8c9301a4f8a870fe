// The agent's exec paths (API execs relayed from the bus, after_resume hooks) against a fake
// VmmDriver: what the driver is asked to run, and what is not run at all.
import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { pino } from 'pino';
import { Agent } from './agent.ts';
import type { AgentBus, AgentDeps, SnapshotShipper } from './agent.ts';
import { MemoryJournal } from '../adapters/journal/memory-journal.ts';
import type { ExecRequest, ExecResult, VmInfo, VmmDriver } from './vmm.ts';
import { HostExecRequestSchema, HostWorkSchema } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type { HostExecOutput, HostExecRequest } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';

const vm = { vmId: 'sb-1', sandboxId: 'sb-1', state: 'running', pid: 1, readyMs: 1, vcpus: 1, memoryMib: 256 } as VmInfo;
const ok: ExecResult = { exitCode: 0, signal: null, stdout: Buffer.alloc(0), stderr: Buffer.alloc(0) };

/** An agent over a driver with one running VM (sb-1) whose execs `exec` answers; `onExec` is the bus's exec handler. */
async function agentWith(exec: (req: ExecRequest) => Promise<ExecResult>): Promise<{ agent: Agent; onExec: (req: HostExecRequest, signal?: AbortSignal) => Promise<HostExecOutput[]> }> {
  let handler: ((req: HostExecRequest, emit: (o: HostExecOutput) => void, signal: AbortSignal) => Promise<void>) | undefined;
  const bus: Partial<AgentBus> = {
    serveExec: (f) => ((handler = f), () => undefined),
    serveFile: () => () => undefined,
    consumeWork: async () => async () => undefined,
    publishHeartbeat: () => undefined,
  };
  const driver: Partial<VmmDriver> = { get: (id) => (id === 'sb-1' ? vm : undefined), list: () => [vm], onEvent: () => () => undefined, exec: (_id, req) => exec(req), resume: async () => undefined };
  const deps: AgentDeps = {
    driver: driver as VmmDriver,
    shipper: { held: () => [], storedBytes: () => 0 } as unknown as SnapshotShipper,
    bus: bus as AgentBus,
    journal: new MemoryJournal(),
    images: () => Promise.reject(new Error('no images in this test')),
    clock: { now: () => 1_000 },
    log: pino({ level: 'silent' }),
    config: { hostId: 'h1', bootId: 'b', accel: 'tcg', capacity: { vcpus: 4, memoryMib: 4096, diskMib: 10_000 }, peerAddress: '', linkBytesPerSecond: 1, heartbeatMs: 1000, concurrency: 3, shutdownGraceMs: 100 },
    qemuVersion: '7.2.0',
  } as AgentDeps;
  const agent = new Agent(deps);
  await agent.start();
  return {
    agent,
    onExec: async (req, signal = new AbortController().signal) => {
      const out: HostExecOutput[] = [];
      await handler!(req, (o) => void out.push(o), signal);
      return out;
    },
  };
}

const execReq = (env: Record<string, string> = {}): HostExecRequest => create(HostExecRequestSchema, { sandboxId: 'sb-1', argv: ['/usr/bin/env'], env });

describe('Agent exec', () => {
  it('exec_withoutEnv_asksForNoEnvironment_soTheGuestKeepsItsOwn_andGivenEnvIsPassedToBeAddedToIt', async () => {
    const asked: ExecRequest[] = [];
    const { agent, onExec } = await agentWith(async (req) => (asked.push(req), ok));
    try {
      await onExec(execReq());
      await onExec(execReq({ FOO: 'a b' }));
      // An empty list made qemu-ga run the command with no PATH or HOME at all.
      expect(asked[0]?.env).toBeUndefined();
      expect(asked[1]?.env).toEqual(['FOO=a b']);
    } finally {
      await agent.stop?.();
    }
  });

  it('exec_whoseCallerIsGoneBeforeItStarts_doesNotRunTheCommand_andAnswersCancelled', async () => {
    const asked: ExecRequest[] = [];
    const { agent, onExec } = await agentWith(async (req) => (asked.push(req), ok));
    try {
      const gone = new AbortController();
      gone.abort();
      const out = await onExec(execReq(), gone.signal);
      expect(asked).toEqual([]);
      expect(out.at(-1)?.payload).toMatchObject({ case: 'error', value: { kind: 'cancelled' } });
    } finally {
      await agent.stop?.();
    }
  });

  it('resume_whoseHookWritesMegabytes_asksTheGuestForOnlyABoundedStartOfItsOutput_andReportsItsFirstLine', async () => {
    const asked: Array<ExecRequest & { maxOutputBytes?: number }> = [];
    // A driver as the guest client is: at most maxOutputBytes of each stream (64 MiB without it).
    const { agent } = await agentWith(async (req: ExecRequest & { maxOutputBytes?: number }) => {
      asked.push(req);
      const n = Math.min(req.maxOutputBytes ?? 64 << 20, 64 << 20);
      return { exitCode: 2, signal: null, stdout: Buffer.alloc(n, 0x6f), stderr: Buffer.concat([Buffer.from('token stale\n'), Buffer.alloc(n, 0x65)]).subarray(0, n), outputTruncated: true };
    });
    try {
      const r = await agent.runStep(create(HostWorkSchema, { opId: 'op-a', stepId: 'resume', attempt: 1, work: { case: 'resumeVm', value: { sandboxId: 'sb-1', afterResume: [{ argv: ['/bin/refresh'] }] } } }));
      expect(asked).toHaveLength(1);
      expect(asked[0]?.maxOutputBytes).toBeGreaterThan(0);
      expect(asked[0]?.maxOutputBytes).toBeLessThanOrEqual(64 << 10);
      expect(r.vms[0]?.reason).toMatch(/^after_resume\[0\] \/bin\/refresh exited 2: token stale\ne+$/);
    } finally {
      await agent.stop?.();
    }
  });
});
