// What the leader takes from a host's answers and heartbeats: the text tenants then read in a
// sandbox's state_reason, and the times and intervals it serves or acts on. The Executor over
// stub ports of our own (every store or bus method not named answers at once with nothing).
import { describe, expect, it } from 'vitest';
import pino from 'pino';
import { create } from '@bufbuild/protobuf';
import type { MessageInitShape } from '@bufbuild/protobuf';
import { durationFromMs } from '@bufbuild/protobuf/wkt';
import { Executor } from './executor.ts';
import type { ExecutorDeps } from './executor.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import { HeartbeatSchema, HostResultSchema, VmState } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type { HostResult, HostWork } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type { OperationRec, SandboxRec, StepRec } from './records.ts';
import { sandboxRecord } from '../testkit/records.ts';
import { toSteps } from '../adapters/grpc/convert.ts';

/** What a test's host answers a step with. */
type HostResultInit = Omit<MessageInitShape<typeof HostResultSchema>, '$typeName'>;

function stub<T>(methods: Record<string, unknown>): T {
  return new Proxy(methods, { get: (target, key) => (key in target ? target[key as string] : key === 'then' ? undefined : async () => []) }) as T;
}

/** Host text of the kind a QEMU driver says: host paths, a terminal escape, a bidi override, a forged second line. */
const HOST_TEXT = "qemu-system-x86_64: -drive file=/var/lib/forkfleet/vms/sb-a/disk.qcow2: \u001b[31mPermission denied\u001b[0m\u202E\nsandbox sb-b destroyed by admin";

/** An Executor whose log lines are kept; `answer(w)`: what host h1 answers a step with (sent back at once). */
function executorWith(o: { heard?: HeartbeatRegistry; answer?: (w: HostWork) => HostResultInit } = {}): { ex: Executor; logs: Array<Record<string, unknown>> } {
  const logs: Array<Record<string, unknown>> = [];
  const ref: { ex?: Executor } = {};
  const sendWork = async (_hostId: string, w: HostWork): Promise<void> => {
    const a = o.answer?.(w);
    if (a) setTimeout(() => ref.ex?.onResult(create(HostResultSchema, { opId: w.opId, stepId: w.stepId, hostId: 'h1', attempt: w.attempt, ...a }), 'h1'), 5);
  };
  const ex = new Executor({
    store: stub<ExecutorDeps['store']>({}),
    bus: stub<ExecutorDeps['bus']>({ sendWork }),
    clock: { now: () => Date.now() },
    log: pino({ level: 'info' }, { write: (line: string) => void logs.push(JSON.parse(line) as Record<string, unknown>) }),
    heard: o.heard ?? new HeartbeatRegistry(),
    signer: stub({}),
    config: { liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 }, stepTimeoutMs: 2000, stepAttempts: 1, chunkBytes: 1 << 18 },
  });
  ref.ex = ex;
  return { ex, logs };
}

/** Runs one pause step on h1, answered with `extra`; its entry in the op's step log. */
async function stepLogged(extra: HostResultInit): Promise<{ ex: Executor; st: StepRec; logs: Array<Record<string, unknown>> }> {
  const { ex, logs } = executorWith({ answer: () => extra });
  const inner = ex as unknown as { active: boolean; stepLog: Map<string, OperationRec['steps']>; step(op: OperationRec, stepId: string, hostId: string, work: HostWork['work']): Promise<unknown> };
  inner.active = true;
  await inner.step({ id: 'op-1', tenantId: 't1', kind: 'pause' } as OperationRec, 'pause/sb-a', 'h1', { case: 'pauseVm', value: { sandboxId: 'sb-a' } as never });
  return { ex, st: inner.stepLog.get('op-1')!['pause/sb-a']!, logs };
}

/** reconcileVms (`passes` times) over one running sandbox on h1, last changed `changedAgoMs` ago, whose host's heartbeat (now) says `hb`; the state changes it made. */
async function reconciled(hb: Parameters<typeof create<typeof HeartbeatSchema>>[1], changedAgoMs: number, passes = 1): Promise<{ changes: Array<{ state: string; reason: string }>; logs: Array<Record<string, unknown>> }> {
  const now = Date.now();
  const heard = new HeartbeatRegistry();
  heard.record(create(HeartbeatSchema, { hostId: 'h1', bootId: 'b', seq: 7n, ...hb }), now);
  const { ex, logs } = executorWith({ heard });
  const changes: Array<{ state: string; reason: string }> = [];
  const inner = ex as unknown as {
    sandboxIndexReady: boolean;
    sandboxIndex: Map<string, { value: SandboxRec; modRevision: number }>;
    vmStateChange: (sb: SandboxRec, still: unknown, state: string, reason: string) => Promise<boolean>;
    sendHostWork: () => Promise<void>;
  };
  inner.sandboxIndexReady = true;
  inner.sandboxIndex.set('t1/sb-a', { value: sandboxRecord({ state: 'running', opId: '', updatedAt: now - changedAgoMs }), modRevision: 3 });
  inner.vmStateChange = async (_sb, _still, state, reason) => {
    changes.push({ state, reason });
    return true;
  };
  inner.sendHostWork = async () => undefined;
  for (let i = 0; i < passes; i++) await ex.reconcileVms();
  return { changes, logs };
}

describe('host text a tenant reads', () => {
  it('aHostsReasonForACrashedVm_staysOutOfTheStateReason_andIsLoggedWhole', async () => {
    const { changes, logs } = await reconciled({ vms: [{ sandboxId: 'sb-a', state: VmState.CRASHED, reason: HOST_TEXT }] }, 10_000);
    expect(changes).toEqual([{ state: 'lost', reason: "its VM crashed on host h1 (its host's account of it is in the scheduler's log)" }]);
    expect(logs.find((l) => l.msg === 'sandbox lost: its VM is gone')).toMatchObject({ sandboxId: 'sb-a', hostReason: HOST_TEXT });
    // Without one, the state reason says only what happened.
    expect((await reconciled({ vms: [{ sandboxId: 'sb-a', state: VmState.STOPPED }] }, 10_000)).changes).toEqual([{ state: 'lost', reason: 'its VM stopped on host h1' }]);
  });

  it('anAfterResumeHookReport_isCutTo200Characters_withoutControlOrFormatCharacters_andLoggedWhole', () => {
    const { ex, logs } = executorWith();
    const hookReport = (ex as unknown as { hookReport(r: HostResult | undefined, id: string): string }).hookReport.bind(ex);
    const long = `after_resume[0] /bin/refresh exited 1: ${'x'.repeat(300)}`;
    const shown = hookReport(create(HostResultSchema, { hostId: 'h1', vms: [{ sandboxId: 'sb-a', reason: long }, { sandboxId: 'sb-b', reason: HOST_TEXT }] }), 'sb-a');
    expect([...shown]).toHaveLength(200);
    expect(shown).toMatch(/^after_resume\[0\] \/bin\/refresh exited 1: x+\u2026$/);
    expect(logs.find((l) => l.sandboxId === 'sb-a')).toMatchObject({ msg: 'after_resume hook failed', report: long });
    // Controls and separators become a space, format characters (bidi, zero-width) go.
    const cleaned = hookReport(create(HostResultSchema, { vms: [{ sandboxId: 'sb-b', reason: HOST_TEXT }] }), 'sb-b');
    expect(cleaned).not.toMatch(/[\p{Cc}\p{Cf}\u2028\u2029]/u);
    expect(cleaned).toContain(' [31mPermission denied [0m sandbox sb-b destroyed');
    // A character is never cut in half (an astral one is two UTF-16 units).
    const astral = hookReport(create(HostResultSchema, { vms: [{ sandboxId: 'sb-a', reason: '🚀'.repeat(300) }] }), 'sb-a');
    expect(astral).toBe(`${'🚀'.repeat(199)}\u2026`);
    // No report: empty, nothing logged.
    expect(hookReport(create(HostResultSchema, { vms: [{ sandboxId: 'sb-a' }] }), 'sb-a')).toBe('');
    expect(hookReport(undefined, 'sb-a')).toBe('');
  });
});

describe('times and intervals a host reports', () => {
  it('aNegativeStepDuration_isTakenAsAbsent_notServedAsAnInvalidMixedSignDuration', async () => {
    const { st, logs } = await stepLogged({ duration: { seconds: -2n, nanos: -500_000_000 }, pause: { seconds: -1n, nanos: 0 } });
    expect(st.hostMs).toBeUndefined();
    expect(st.pauseMs).toBeUndefined();
    expect(toSteps({ 'pause/sb-a': st })[0]!.hostDuration).toBeUndefined();
    expect(logs.filter((l) => /negative or invalid step time/.test(String(l.msg)))).toHaveLength(1);
    // Malformed ones too (nanos of the other sign, or out of range); valid ones are kept.
    for (const d of [{ seconds: 1n, nanos: -1 }, { seconds: 0n, nanos: 1_000_000_000 }, { seconds: 400_000_000_000n, nanos: 0 }]) expect((await stepLogged({ duration: d })).st.hostMs, String(d.seconds)).toBeUndefined();
    expect((await stepLogged({ duration: durationFromMs(1500), pause: durationFromMs(20) })).st).toMatchObject({ hostMs: 1500, pauseMs: 20 });
  });

  it('aNegativeFetchTime_isTakenAsAbsent_soTheHostsFetchRateIsPricedOverTheStep', async () => {
    const MIB = 1024 * 1024;
    const { ex } = await stepLogged({ bytesFetched: BigInt(80 * MIB), duration: durationFromMs(2000), fetch: { seconds: -1n, nanos: 0 } });
    const rate = (ex as unknown as { fetchRates: { current(now: number): ReadonlyMap<string, number> } }).fetchRates.current(Date.now()).get('h1');
    // 80 MiB over the 2 s step: 40 MiB/s (a negative time read as 1 ms priced it at 80 GiB/s).
    expect(rate).toBeCloseTo(40 * MIB, -3);
  });

  it('aHugeHeartbeatInterval_isClampedTo60s_soTheDeadVmCheckStillRunsForThatHost_andIsLoggedOnce', async () => {
    const huge = { seconds: 1_000_000_000n, nanos: 0 };
    // Changed 3 minutes ago: past two clamped intervals (2 min), within two claimed ones (63 years).
    const { changes, logs } = await reconciled({ interval: huge, vms: [{ sandboxId: 'sb-a', state: VmState.CRASHED }] }, 180_000, 3);
    // (The stub store leaves the sandbox running, so each pass finds it again.)
    expect(changes).toEqual(Array.from({ length: 3 }, () => ({ state: 'lost', reason: 'its VM crashed on host h1' })));
    expect(logs.filter((l) => /heartbeats less often than every 60 s/.test(String(l.msg)))).toHaveLength(1);
    // Within two clamped intervals, it still waits (a heartbeat may not list a new VM yet).
    expect((await reconciled({ interval: huge, vms: [{ sandboxId: 'sb-a', state: VmState.CRASHED }] }, 100_000)).changes).toEqual([]);
  });
});
