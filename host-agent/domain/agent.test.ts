import { describe, expect, it, vi } from 'vitest';
import { create, toBinary, fromBinary } from '@bufbuild/protobuf';
import { pino } from 'pino';
import { durationMs, timestampFromMs } from '@bufbuild/protobuf/wkt';
import { Agent, RESTORE_SAMPLE_MAX_AGE_MS } from './agent.ts';
import type { AgentBus, AgentConfig, AgentDeps, SnapshotShipper, WorkControl } from './agent.ts';
import { MemoryJournal } from '../adapters/journal/memory-journal.ts';
import type { Accel, VmInfo, VmmDriver } from './vmm.ts';
import { Accel as ProtoAccel } from '../../proto/gen/forkfleet/v1/common_pb.ts';
import { HostEventType, HostResultSchema, HostWorkSchema, VmState as PbVmState, type Heartbeat } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { ForkfleetError } from '../../proto/errors.ts';

/** `config` overrides the test's: 3 step slots, and steps still running after 100 ms do not hold up stop(). */
function agentWith(driver: Partial<VmmDriver>, shipper: Partial<SnapshotShipper> = {}, bus: Partial<AgentBus> = {}, clock = { now: () => 1_000 }, journal = new MemoryJournal(), accel: Accel = 'tcg', config: Partial<AgentConfig> = {}, extra: Partial<AgentDeps> = {}): { agent: Agent; journal: MemoryJournal } {
  const agent = new Agent({
    // pause and resume: no-ops, as the QEMU driver's are for a VM already in that state.
    driver: { get: () => undefined, list: () => [], pause: async () => undefined, resume: async () => undefined, ...driver } as VmmDriver,
    shipper: { held: () => [], storedBytes: () => 0, ...shipper } as SnapshotShipper,
    bus: bus as AgentBus,
    journal,
    images: () => Promise.reject(new Error('no images in this test')),
    clock,
    log: pino({ level: 'silent' }),
    config: { hostId: 'h1', bootId: 'b', accel, capacity: { vcpus: 4, memoryMib: 4096, diskMib: 10_000 }, peerAddress: '', linkBytesPerSecond: 1, heartbeatMs: 1000, concurrency: 3, shutdownGraceMs: 100, ...config },
    qemuVersion: '7.2.0',
    ...extra,
  });
  return { agent, journal };
}

const work = (stepId: string, w: Parameters<typeof create<typeof HostWorkSchema>>[1]) => create(HostWorkSchema, { opId: 'op-a', stepId, attempt: 1, ...w });

/** A delivery's control as the bus hands it to onWork: `ack` as given, keep-alives and give-backs ignored. */
const ctlOf = (ack: () => void = () => undefined): WorkControl => ({ ack, working: () => undefined, release: () => undefined });

describe('Agent steps', () => {
  it('step_whenItFails_returnsAnEncodableResultCarryingTheNamedError', async () => {
    const { agent, journal } = agentWith({}, { obtain: () => Promise.reject(new ForkfleetError('not_found', 'snapshot sn-x is not on host h1')) });
    const r = await agent.runStep(work('restore/h1', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } }));
    const back = fromBinary(HostResultSchema, toBinary(HostResultSchema, r));
    expect(back.error?.kind).toBe('not_found');
    expect(back.error?.message).toContain('sn-x');
    expect(journal.results.size).toBe(1); // a non-retryable failure is final and journalled
  });

  it('metrics_hearEveryStepTheAgentRuns_notOneAnsweredAgainFromItsJournal_andEveryHeartbeatItSends', async () => {
    const steps: Array<[string, string | undefined]> = [];
    const beats: Heartbeat[] = [];
    const sent: Heartbeat[] = [];
    let t = 1_000;
    const { agent } = agentWith({}, { obtain: () => ((t += 40), Promise.reject(new ForkfleetError('not_found', 'snapshot sn-x is gone'))) }, { publishHeartbeat: (hb) => void sent.push(hb) }, { now: () => t }, undefined, 'tcg', {}, {
      metrics: {
        step: (kind, err, ms) => {
          steps.push([kind, err]);
          expect(ms).toBe(40);
        },
        heartbeat: (hb) => void beats.push(hb),
        heartbeatFailed: () => undefined,
      },
    });
    const restore = work('restore/h1', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } });
    await agent.runStep(restore);
    await agent.runStep(restore); // delivered again: answered from the journal
    expect(steps).toEqual([['restoreVms', 'not_found']]);
    agent.heartbeat();
    expect(beats).toHaveLength(1);
    expect(beats[0]).toBe(sent[0]);
  });

  it('metrics_hearStepsRefusedForAnUnreadableJournal_beforeTheyRanOrWhenTheirJournalledAnswerCannotBeChecked', async () => {
    const steps: Array<[string, string | undefined, number]> = [];
    let t = 1_000;
    const journal = new MemoryJournal();
    const restore = work('restore/h1', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } });
    // Answered before: delivered again, its give-up records are read before it is answered.
    await journal.put('op-a', 'restore/h1', toBinary(HostResultSchema, create(HostResultSchema, { opId: 'op-a', stepId: 'restore/h1', hostId: 'h1', attempt: 1 })));
    let unreadable = (_stepId: string): boolean => true;
    const get = journal.get.bind(journal);
    journal.get = (opId, stepId) => ((t += 5), unreadable(stepId) ? Promise.reject(Object.assign(new Error('EIO: read'), { code: 'EIO' })) : get(opId, stepId));
    const { agent } = agentWith({}, {}, {}, { now: () => t }, journal, 'tcg', {}, {
      metrics: { step: (kind, err, ms) => void steps.push([kind, err, ms]), heartbeat: () => undefined, heartbeatFailed: () => undefined },
    });
    expect((await agent.runStep(restore)).error?.kind).toBe('unavailable');
    unreadable = (stepId) => stepId !== 'restore/h1';
    expect((await agent.runStep(restore)).error?.kind).toBe('unavailable');
    // Timed as steps that ran: each journal read here takes 5 ms.
    expect(steps).toEqual([['restoreVms', 'unavailable', 5], ['restoreVms', 'unavailable', expect.any(Number)]]);
  });

  it('step_thatMeetsAFullDiskOrAnIoError_isAnsweredRetryable_andTheSchedulersRetryRunsIt_whileAnUnknownErrorIsFinal', async () => {
    const sys = (code: string) => Object.assign(new Error(`${code}: write /var/lib/forkfleet/chunks/ab/x.tmp`), { code });
    let fail: Error = sys('ENOSPC');
    let obtains = 0;
    const { agent } = agentWith({}, {
      obtain: () => {
        obtains++;
        return Promise.reject(fail);
      },
    });
    const restore = (stepId: string, attempt: number) => work(stepId, { attempt, work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } });
    expect((await agent.runStep(restore('restore/a', 1))).error).toMatchObject({ kind: 'resource_exhausted', retryable: true });
    fail = sys('EIO');
    expect((await agent.runStep(restore('restore/a', 2))).error).toMatchObject({ kind: 'unavailable', retryable: true });
    fail = new ForkfleetError('not_found', 'snapshot sn-x is gone'); // GC freed the disk; the snapshot is gone meanwhile
    expect((await agent.runStep(restore('restore/a', 3))).error?.kind).toBe('not_found');
    expect(obtains).toBe(3);
    // An error of no known kind is final: the retry gets the same answer, and nothing runs again.
    fail = new TypeError('a bug');
    expect((await agent.runStep(restore('restore/b', 1))).error).toMatchObject({ kind: 'internal', retryable: false });
    fail = sys('ENOSPC');
    expect((await agent.runStep(restore('restore/b', 2))).error).toMatchObject({ kind: 'internal', retryable: false });
    expect(obtains).toBe(4);
  });

  it('step_whenRetryableFailure_answersTheSameSendDeliveredAgainFromTheJournal_andRunsTheSchedulersRetry', async () => {
    let obtains = 0;
    let up = false;
    const { agent } = agentWith({}, {
      obtain: () => {
        obtains++;
        return up ? Promise.reject(new ForkfleetError('not_found', 'snapshot sn-x is gone')) : Promise.reject(new ForkfleetError('unavailable', 'peer down'));
      },
    });
    const restore = (attempt: number, leaderTerm = 5n) => work('restore/h1', { attempt, leaderTerm, work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } });
    const r = await agent.runStep(restore(1));
    expect([r.error?.kind, r.error?.retryable]).toEqual(['unavailable', true]);
    up = true;
    // The same message again (its batch was not acked yet, or its ack was lost): the scheduler
    // has its answer and may have placed the sandbox elsewhere since; the restore is not run again.
    const again = await agent.runStep(restore(1));
    expect(toBinary(HostResultSchema, again)).toEqual(toBinary(HostResultSchema, r));
    expect(obtains).toBe(1);
    // The scheduler's retry is a new send (its next attempt, or a new leader's): it runs.
    expect((await agent.runStep(restore(2))).error?.kind).toBe('not_found');
    expect(obtains).toBe(2);
  });

  it('step_whoseRunASecondSendShared_andEndedInARetryableFailure_answersEitherSendDeliveredAgainFromTheJournal_withoutRunningAgain', async () => {
    let obtains = 0;
    let fail: () => void = () => undefined;
    const { agent } = agentWith({}, { obtain: () => (++obtains === 1 ? new Promise((_, reject) => (fail = () => reject(new ForkfleetError('unavailable', 'peer down')))) : Promise.reject(new ForkfleetError('unavailable', 'peer down'))) });
    const restore = (attempt: number) => work('restore/h1', { attempt, leaderTerm: 5n, work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } });
    // Send 1 runs; the scheduler's send 2 (after send 1's deadline) shares that run.
    const first = agent.runStep(restore(1));
    await new Promise((r) => setTimeout(r, 10));
    const second = agent.runStep(restore(2));
    await new Promise((r) => setTimeout(r, 10));
    fail();
    expect((await first).error?.retryable).toBe(true);
    expect((await second).error?.retryable).toBe(true);
    // Each answer carries its own send's attempt: the scheduler takes a retryable failure of
    // attempt 1 for a late answer to its first send, and waits on for the second's.
    expect([(await first).attempt, (await second).attempt]).toEqual([1, 2]);
    // Either message delivered again (unacked) is answered from the journal: no second run, no
    // second VM of a sandbox the scheduler may have placed elsewhere since.
    const again2 = await agent.runStep(restore(2));
    const again1 = await agent.runStep(restore(1));
    expect([again1.error?.kind, again1.attempt, again2.error?.kind, again2.attempt]).toEqual(['unavailable', 1, 'unavailable', 2]);
    expect(obtains).toBe(1);
    // The scheduler's next send runs.
    await agent.runStep(restore(3));
    expect(obtains).toBe(2);
  });

  it('step_whenRetryableFailureOfALeaderBefore_isRunAgainForTheNewLeadersSendOfTheSameAttempt', async () => {
    let obtains = 0;
    const { agent } = agentWith({}, { obtain: () => (obtains++, Promise.reject(new ForkfleetError('unavailable', 'peer down'))) });
    const restore = (leaderTerm: bigint) => work('restore/h1', { attempt: 1, leaderTerm, work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } });
    await agent.runStep(restore(5n));
    await agent.runStep(restore(6n));
    expect(obtains).toBe(2);
  });

  it('step_whenRedelivered_answersFromTheJournalWithoutActingAgain', async () => {
    let destroys = 0;
    const { agent } = agentWith({ get: () => ({ vmId: 'sb-1' }) as never, destroy: async () => void destroys++ });
    const w = work('destroy', { work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } });
    const a = await agent.runStep(w);
    const b = await agent.runStep(w);
    expect(destroys).toBe(1);
    expect(toBinary(HostResultSchema, b)).toEqual(toBinary(HostResultSchema, a));
  });

  it('restore_ofAFetchedSnapshot_answersOnlyOnceTheFetchIsDurable_andIfItCannotBeSaysTheSnapshotIsNotHeld', async () => {
    const order: string[] = [];
    let settle: (ok: boolean) => void = () => undefined;
    const { agent, journal } = agentWith(
      { fork: async (_s, clones) => clones.map((c) => ({ vmId: c.vmId, sandboxId: c.vmId, state: 'running', pid: 0, readyMs: 1 }) as VmInfo) },
      {
        obtain: async () => ({ local: { dir: '/x', manifest: {} } as never, bytesFetched: 10 }),
        durable: () =>
          new Promise<void>((resolve, reject) => {
            settle = (ok) => {
              order.push(ok ? 'durable' : 'durable failed');
              if (ok) resolve();
              else reject(new Error('EIO: fsync failed'));
            };
          }),
      },
    );
    const restore = (step: string) => agent.runStep(work(step, { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: `sb-${step}` }] } } })).then((r) => (order.push('answered'), r));
    const ok = restore('r1');
    await new Promise((r) => setTimeout(r, 20));
    expect(order).toEqual([]); // the VM runs, but the host does not say so before it holds the snapshot
    settle(true);
    expect((await ok).error).toBeUndefined();
    expect(order).toEqual(['durable', 'answered']);
    const bad = restore('r2');
    await new Promise((r) => setTimeout(r, 20));
    settle(false);
    const r = await bad;
    // The VM runs from the image: the restore succeeded, but the host does not hold the snapshot.
    expect(r.error).toBeUndefined();
    expect(r.snapshotNotHeld).toBe(true);
    expect(r.vms.map((v) => v.sandboxId)).toEqual(['sb-r2']);
    expect((await ok).snapshotNotHeld).toBe(false);
    expect(journal.results.has('op-a/r2')).toBe(true);
  });

  it('restore_ofAFetchedSnapshot_saysItIsStoredOnceItIsDurable_beforeItsVmsAreUp_soAForksNextWaveCanCopyFromHere', async () => {
    const events: Array<[HostEventType, string, string]> = [];
    const forks: Array<() => void> = [];
    const vmsUp = async (): Promise<void> => {
      await vi.waitFor(() => expect(forks).toHaveLength(1));
      forks.shift()!();
    };
    const { agent } = agentWith(
      { fork: async (_s, clones) => (await new Promise<void>((r) => forks.push(r)), clones.map((c) => ({ vmId: c.vmId, sandboxId: c.vmId, state: 'running', pid: 0, readyMs: 1 }) as VmInfo)) },
      { obtain: async (snapshotId) => ({ local: { dir: '/x', manifest: {} } as never, bytesFetched: snapshotId === 'sn-here' ? 0 : 10 }), durable: async () => undefined },
      { publishEvent: (e) => void events.push([e.type, e.snapshotId, e.opId]) },
    );
    const restore = agent.runStep(work('r1', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } }));
    await vi.waitFor(() => expect(events).toEqual([[HostEventType.SNAPSHOT_STORED, 'sn-x', 'op-a']]));
    await vmsUp();
    expect((await restore).error).toBeUndefined();
    // One this host held already was not fetched: nothing to say.
    const held = agent.runStep(work('r2', { work: { case: 'restoreVms', value: { snapshotId: 'sn-here', vms: [{ sandboxId: 'sb-2' }] } } }));
    await vmsUp();
    expect((await held).error).toBeUndefined();
    expect(events).toHaveLength(1);
  });

  it('pause_ofTheIdleRule_isRefusedWhileACallRunsOrJustRan_andPausesAVmIdleForTheWholeTimeout', async () => {
    let t = 1_000_000;
    let releaseCall!: () => void;
    const paused: string[] = [];
    const vm = { vmId: 'sb-1', sandboxId: 'sb-1', state: 'running', pid: 0 } as VmInfo;
    const { agent } = agentWith({ get: () => vm, list: () => [vm], pause: async (id) => void paused.push(id) }, {}, {}, { now: () => t });
    const idlePause = (n: number) => agent.runStep(work(`pause-${n}`, { work: { case: 'pauseVm', value: { sandboxId: 'sb-1', onlyIfIdleMs: 60_000n } } }));
    const inner = agent as unknown as { inCall<T>(vmId: string, fn: () => Promise<T>): Promise<T> };
    agent.idleMs(vm); // seen idle from now
    t += 61_000;
    // An Exec begins just after the rule judged the sandbox idle.
    const call = inner.inCall('sb-1', () => new Promise<void>((r) => (releaseCall = r)));
    expect((await idlePause(1)).error).toMatchObject({ kind: 'failed_precondition', retryable: false, message: expect.stringMatching(/not idle/) });
    t += 61_000;
    expect((await idlePause(2)).error?.kind).toBe('failed_precondition'); // still running
    releaseCall();
    await call;
    t += 30_000;
    expect((await idlePause(3)).error?.kind).toBe('failed_precondition'); // ended 30 s ago
    expect(paused).toEqual([]);
    t += 31_000;
    expect((await idlePause(4)).error).toBeUndefined();
    // A user's pause (no idle condition) pauses whatever the VM did.
    expect(paused).toEqual(['sb-1']);
    inner.inCall('sb-1', () => Promise.resolve());
    expect((await agent.runStep(work('pause-user', { work: { case: 'pauseVm', value: { sandboxId: 'sb-1' } } }))).error).toBeUndefined();
    expect(paused).toEqual(['sb-1', 'sb-1']);
  });

  it('pause_ofADrainUnlessCalls_isRefusedWhileACallRuns_namingTheCondition_andPausesOnceItEnded_whateverTheGuestCpu', async () => {
    // A drain --migrate paused a VM under a running exec: the command went on in the moved VM,
    // its caller's stream was cut. The drain's pause now waits for calls (for a grace).
    let releaseCall!: () => void;
    const paused: string[] = [];
    const vm = { vmId: 'sb-1', sandboxId: 'sb-1', state: 'running', pid: 0 } as VmInfo;
    const { agent } = agentWith({ get: () => vm, list: () => [vm], pause: async (id) => void paused.push(id) });
    const drainPause = (n: number) => agent.runStep(work(`pause-${n}`, { work: { case: 'pauseVm', value: { sandboxId: 'sb-1', unlessCalls: true } } }));
    const inner = agent as unknown as { inCall<T>(vmId: string, fn: () => Promise<T>): Promise<T> };
    const call = inner.inCall('sb-1', () => new Promise<void>((r) => (releaseCall = r)));
    expect((await drainPause(1)).error).toMatchObject({ kind: 'failed_precondition', retryable: false, field: 'unless_calls', message: expect.stringMatching(/1 call\(s\) running/) });
    expect(paused).toEqual([]);
    releaseCall();
    await call;
    // Just ended: no idle time asked for, only no call running.
    expect((await drainPause(2)).error).toBeUndefined();
    expect(paused).toEqual(['sb-1']);
  });

  it('pause_ofTheIdleRule_isRefusedWhileASnapshotOfTheVmRuns_whateverItsIdleTime', async () => {
    let t = 1_000_000;
    const paused: string[] = [];
    const vm = { vmId: 'sb-1', sandboxId: 'sb-1', state: 'running', pid: 0 } as VmInfo;
    const { agent } = agentWith({ get: () => vm, list: () => [vm], pause: async (id) => void paused.push(id) }, {}, {}, { now: () => t });
    const idlePause = (n: number) => agent.runStep(work(`pause-${n}`, { work: { case: 'pauseVm', value: { sandboxId: 'sb-1', onlyIfIdleMs: 60_000n } } }));
    agent.idleMs(vm); // seen idle from now
    t += 61_000;
    // A fork of the sandbox snapshots it: an Exec made meanwhile waits for the snapshot's end.
    vm.state = 'snapshotting';
    expect((await idlePause(1)).error).toMatchObject({ kind: 'failed_precondition', retryable: false, message: expect.stringMatching(/not idle/) });
    expect(paused).toEqual([]);
    vm.state = 'running';
    expect((await idlePause(2)).error).toBeUndefined();
    expect(paused).toEqual(['sb-1']);
  });

  it('pause_ofTheIdleRule_isJudgedAgainOnceTheDriverHoldsTheVm_andRefusedForACallMadeWhileItWaitedForASnapshot', async () => {
    let t = 1_000_000;
    const paused: string[] = [];
    const vm = { vmId: 'sb-1', sandboxId: 'sb-1', state: 'running', pid: 0 } as VmInfo;
    // A snapshot (a fork's) holds the VM and its state still says running: the driver's pause
    // waits for it, then asks the pause's condition, as the QEMU driver does under its lock.
    let snapshotEnds!: () => void;
    const snapshotting = new Promise<void>((r) => (snapshotEnds = r));
    const { agent } = agentWith(
      {
        get: () => vm,
        list: () => [vm],
        pause: async (id, opts) => {
          await snapshotting;
          const refused = opts?.refuse?.({ ...vm });
          if (refused) throw refused;
          paused.push(id);
        },
      },
      {},
      {},
      { now: () => t },
    );
    const inner = agent as unknown as { inCall<T>(vmId: string, fn: () => Promise<T>): Promise<T> };
    agent.idleMs(vm); // seen idle from now
    t += 61_000;
    const pause = agent.runStep(work('pause-1', { work: { case: 'pauseVm', value: { sandboxId: 'sb-1', onlyIfIdleMs: 60_000n } } }));
    await new Promise((r) => setTimeout(r, 10));
    // An Exec arrives meanwhile: it waits for the snapshot too, and would run under the pause.
    let releaseCall!: () => void;
    const call = inner.inCall('sb-1', () => new Promise<void>((r) => (releaseCall = r)));
    snapshotEnds();
    expect((await pause).error).toMatchObject({ kind: 'failed_precondition', retryable: false, message: expect.stringMatching(/not idle/) });
    expect(paused).toEqual([]);
    releaseCall();
    await call;
  });

  it('pause_ofTheIdleRule_judgedTwiceMillisecondsApart_isNotRefusedForOneTickOfGuestCpuBetween', async () => {
    // /proc counts guest CPU in 10 ms ticks: one tick over the few ms between the two
    // judgements (before the driver's lock and under it) read as 200% busy.
    let t = 1_000_000;
    let cpu = 5;
    const paused: string[] = [];
    const vm = { vmId: 'sb-1', sandboxId: 'sb-1', state: 'running', pid: 0 } as VmInfo;
    const { agent } = agentWith(
      {
        get: () => vm,
        list: () => [vm],
        pause: async (id, opts) => {
          t += 5;
          cpu += 0.01;
          const refused = opts?.refuse?.({ ...vm });
          if (refused) throw refused;
          paused.push(id);
        },
      },
      {},
      {},
      { now: () => t },
      undefined,
      undefined,
      {},
      { cpu: () => cpu },
    );
    agent.idleMs(vm); // seen idle from now
    t += 61_000;
    const r = await agent.runStep(work('pause-1', { work: { case: 'pauseVm', value: { sandboxId: 'sb-1', onlyIfIdleMs: 60_000n } } }));
    expect(r.error).toBeUndefined();
    expect(paused).toEqual(['sb-1']);
  });

  it('pause_ofTheIdleRule_underASecondAfterTheLastSample_isRefusedForABurstOfGuestCpuSinceIt', async () => {
    let t = 1_000_000;
    let cpu = 5;
    const paused: string[] = [];
    const vm = { vmId: 'sb-1', sandboxId: 'sb-1', state: 'running', pid: 0 } as VmInfo;
    const { agent } = agentWith({ get: () => vm, list: () => [vm], pause: async (id) => void paused.push(id) }, {}, {}, { now: () => t }, undefined, undefined, {}, { cpu: () => cpu });
    agent.idleMs(vm); // seen idle from now
    t += 61_000;
    agent.idleMs(vm); // a heartbeat's sample: idle
    // A job starts: 0.4 s of guest CPU in the 600 ms before the pause arrives.
    t += 600;
    cpu += 0.4;
    const r = await agent.runStep(work('pause-1', { work: { case: 'pauseVm', value: { sandboxId: 'sb-1', onlyIfIdleMs: 60_000n } } }));
    expect(r.error).toMatchObject({ kind: 'failed_precondition', message: expect.stringMatching(/not idle/) });
    expect(paused).toEqual([]);
  });

  it('idleMs_afterTheClockSteppedBack_measuresGuestCpuAgain', () => {
    let t = 1_000_000;
    let cpu = 5;
    const vm = { vmId: 'sb-1', sandboxId: 'sb-1', state: 'running', pid: 0 } as VmInfo;
    const { agent } = agentWith({ get: () => vm, list: () => [vm] }, {}, {}, { now: () => t }, undefined, undefined, {}, { cpu: () => cpu });
    agent.idleMs(vm);
    t += 120_000;
    expect(agent.idleMs(vm)).toBe(120_000);
    t -= 60_000; // an NTP step back
    agent.idleMs(vm);
    t += 2_000;
    cpu += 1.5; // busy since
    expect(agent.idleMs(vm)).toBe(0);
  });

  it('pauseAndResume_whateverTheVmsRecordSays_areHandedToTheDriver_whichAsksQemu', async () => {
    // A pause whose `stop` timed out left the VM recorded running while QEMU stopped it; a
    // resume whose `cont` timed out, the reverse. The step that puts it right is not skipped.
    const calls: string[] = [];
    const vm = { vmId: 'sb-1', sandboxId: 'sb-1', state: 'running', pid: 0 } as VmInfo;
    const { agent } = agentWith({ get: () => vm, list: () => [vm], pause: async (id) => void calls.push(`pause ${id}`), resume: async (id) => void calls.push(`resume ${id}`) });
    expect((await agent.runStep(work('resume', { work: { case: 'resumeVm', value: { sandboxId: 'sb-1' } } }))).error).toBeUndefined();
    vm.state = 'paused';
    expect((await agent.runStep(work('pause', { work: { case: 'pauseVm', value: { sandboxId: 'sb-1' } } }))).error).toBeUndefined();
    expect(calls).toEqual(['resume sb-1', 'pause sb-1']);
  });

  it('restore_thatFetchedTheSnapshot_saysHowLongTheFetchTook_apartFromTheStepsWholeTimeWithItsRestores', async () => {
    const { agent } = agentWith(
      { fork: async (_s, clones) => (await new Promise((r) => setTimeout(r, 80)), clones.map((c) => ({ vmId: c.vmId, sandboxId: c.vmId, state: 'running', pid: 0, readyMs: 1 }) as VmInfo)) },
      { obtain: async () => (await new Promise((r) => setTimeout(r, 20)), { local: { dir: '/x', manifest: {} } as never, bytesFetched: 10 }) },
      {},
      { now: () => Date.now() },
    );
    const r = await agent.runStep(work('r1', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-r1' }] } } }));
    expect(r.bytesFetched).toBe(10n);
    const fetchMs = durationMs(r.fetch!);
    expect(fetchMs).toBeGreaterThanOrEqual(15);
    expect(durationMs(r.duration!) - fetchMs).toBeGreaterThanOrEqual(70);
  });

  it('step_whoseJournalEntryIsEmpty_asAnOsCrashCanLeaveIt_runsAgain', async () => {
    let destroys = 0;
    const { agent, journal } = agentWith({ get: () => ({ vmId: 'sb-1' }) as never, destroy: async () => void destroys++ });
    await journal.put('op-a', 'destroy', new Uint8Array(0));
    const r = await agent.runStep(work('destroy', { work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } }));
    expect(r).toMatchObject({ opId: 'op-a', stepId: 'destroy' });
    expect(destroys).toBe(1);
  });

  it('restore_redeliveredAfterTheAgentDiedBeforeItsHooksRan_runsThemOnTheVmItFinds_butNotTwiceOnceRecorded', async () => {
    const execs: string[] = [];
    const vm = { vmId: 'sb-h', sandboxId: 'sb-h', state: 'running', pid: 1, readyMs: 1, baseSnapshotId: 'sn-x' } as VmInfo;
    const { agent, journal } = agentWith(
      { get: (id) => (id === 'sb-h' ? vm : undefined), exec: async (id, req) => (execs.push(`${id} ${req.path}`), { exitCode: 0, stdout: Buffer.alloc(0), stderr: Buffer.alloc(0) }) as never },
      { obtain: async () => ({ local: { dir: '/x', manifest: {} } as never, bytesFetched: 0 }) },
    );
    const step = (stepId: string) => work(stepId, { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-h', afterResume: [{ argv: ['/bin/refresh'] }] }] } } });
    // A VM of that id this step did not make (another op's): its hooks are not this step's to run.
    expect((await agent.runStep(step('restore/other'))).error).toBeUndefined();
    expect(execs).toEqual([]);
    // The first delivery recorded the VM it was making, made it and died before its hooks:
    // the VM is here, no result.
    await journal.put('op-a', 'restore/h1#making', Buffer.from(JSON.stringify(['sb-h'])));
    const r = await agent.runStep(step('restore/h1'));
    expect(r.error).toBeUndefined();
    expect(execs).toEqual(['sb-h /bin/refresh']);
    // Died again after the hooks, before the result was journalled: they are not run twice.
    journal.results.delete('op-a/restore/h1');
    expect((await agent.runStep(step('restore/h1'))).error).toBeUndefined();
    expect(execs).toEqual(['sb-h /bin/refresh']);
  });

  it('resume_whoseHookTimesOut_reportsItTimedOut_andRunsTheNextHook', async () => {
    const execs: string[] = [];
    const vm = { vmId: 'sb-t', sandboxId: 'sb-t', state: 'running', pid: 1, readyMs: 1 } as VmInfo;
    const { agent } = agentWith({
      get: (id) => (id === 'sb-t' ? vm : undefined),
      exec: async (_id, req) => {
        execs.push(req.path);
        return (req.path === '/bin/slow' ? { exitCode: 137, signal: null, timedOut: true, stdout: Buffer.alloc(0), stderr: Buffer.from('Killed') } : { exitCode: 0, signal: null, stdout: Buffer.alloc(0), stderr: Buffer.alloc(0) }) as never;
      },
    });
    const r = await agent.runStep(work('resume', { work: { case: 'resumeVm', value: { sandboxId: 'sb-t', afterResume: [{ argv: ['/bin/slow'], timeout: { seconds: 2n, nanos: 0 } }, { argv: ['/bin/next'] }] } } }));
    expect(r.error).toBeUndefined();
    expect(execs).toEqual(['/bin/slow', '/bin/next']);
    expect(r.vms[0]?.reason).toBe('after_resume[0] /bin/slow timed out after 2000 ms and was killed');
  });

  it('resume_whoseHookDiesOfASignalOrCannotRun_reportsTheSignal_andOnlyTheKindOfTheHostsError', async () => {
    const vm = { vmId: 'sb-s', sandboxId: 'sb-s', state: 'running', pid: 1, readyMs: 1 } as VmInfo;
    const { agent } = agentWith({
      get: (id) => (id === 'sb-s' ? vm : undefined),
      exec: async (_id, req) => {
        if (req.path === '/bin/crash') return { exitCode: -1, signal: 11, stdout: Buffer.alloc(0), stderr: Buffer.from('bad pointer') };
        throw new ForkfleetError('unavailable', 'guest agent socket /var/lib/forkfleet/vms/sb-s/qga.sock did not answer');
      },
    });
    const r = await agent.runStep(work('resume', { work: { case: 'resumeVm', value: { sandboxId: 'sb-s', afterResume: [{ argv: ['/bin/crash'] }, { argv: ['/bin/next'] }] } } }));
    expect(r.error).toBeUndefined();
    expect(r.vms[0]?.reason).toBe('after_resume[0] /bin/crash was ended by signal 11: bad pointer; after_resume[1] /bin/next could not be run (unavailable error on its host)');
  });

  it('resume_redeliveredAfterItsHooksRan_butBeforeItsResultWasJournalled_doesNotRunThemAgain_andAnswersTheirReport', async () => {
    const execs: string[] = [];
    const vm = { vmId: 'sb-r', sandboxId: 'sb-r', state: 'running', pid: 1, readyMs: 1 } as VmInfo;
    const { agent, journal } = agentWith({
      get: (id) => (id === 'sb-r' ? vm : undefined),
      exec: async (_id, req) => (execs.push(req.path), { exitCode: 1, signal: null, stdout: Buffer.alloc(0), stderr: Buffer.from('token stale') }),
    });
    const step = work('resume', { work: { case: 'resumeVm', value: { sandboxId: 'sb-r', afterResume: [{ argv: ['/bin/refresh'] }] } } });
    const first = await agent.runStep(step);
    expect(first.vms[0]?.reason).toBe('after_resume[0] /bin/refresh exited 1: token stale');
    // The agent died after the hooks, before the step's result was journalled: delivered again.
    journal.results.delete('op-a/resume');
    const again = await agent.runStep(step);
    expect(execs).toEqual(['/bin/refresh']);
    expect(again.error).toBeUndefined();
    expect(again.vms[0]?.reason).toBe(first.vms[0]?.reason);
  });

  it('restoreOrResume_whoseHookRecordCannotBeWrittenOrRead_isAnsweredRetryable_andNotJournalledAsFinal', async () => {
    const vms = new Map<string, VmInfo>();
    const execs: string[] = [];
    const journal = new MemoryJournal();
    const put = journal.put.bind(journal);
    const get = journal.get.bind(journal);
    const eio = (): Promise<never> => Promise.reject(new Error('EIO: i/o error'));
    journal.put = (opId, stepId, b) => (stepId.includes('#hooks/') ? eio() : put(opId, stepId, b));
    journal.get = (opId, stepId) => (stepId.includes('#hooks/') ? eio() : get(opId, stepId));
    const { agent } = agentWith({ ...mapDriver(vms), exec: async (_id, req) => (execs.push(req.path), { exitCode: 0, signal: null, stdout: Buffer.alloc(0), stderr: Buffer.alloc(0) }) }, obtained, {}, undefined, journal);
    const hook = [{ argv: ['/bin/refresh'] }];
    const restore = work('restore/h1', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1', afterResume: hook }] } } });
    const r = await agent.runStep(restore);
    expect([r.error?.kind, r.error?.retryable]).toEqual(['unavailable', true]);
    // Journalled for this send only, so the scheduler's retry (its next attempt) runs it.
    expect(journal.results.has('op-a/restore/h1')).toBe(true);
    // The retry finds the VM; that it made it earlier cannot be read: retryable again, not answered without its hooks.
    journal.get = (opId, stepId) => (stepId.includes('#hooks/') || stepId.endsWith('#making') ? eio() : get(opId, stepId));
    const again = await agent.runStep({ ...restore, attempt: 2 });
    expect([again.error?.kind, again.error?.retryable]).toEqual(['unavailable', true]);
    journal.get = (opId, stepId) => (stepId.includes('#hooks/') ? eio() : get(opId, stepId));
    // A resume whose record of hooks run cannot be read does not run them blind.
    const resumed = await agent.runStep(work('resume', { work: { case: 'resumeVm', value: { sandboxId: 'sb-1', afterResume: hook } } }));
    expect([resumed.error?.kind, resumed.error?.retryable]).toEqual(['unavailable', true]);
    expect(execs).toEqual(['/bin/refresh']); // the restore's only
  });

  it('restore_redeliveredWithEveryVmPresent_fetchesNothing_andSaysWhetherTheSnapshotIsHeldHere', async () => {
    const vm = { vmId: 'sb-m', sandboxId: 'sb-m', state: 'running', pid: 1, readyMs: 1, baseSnapshotId: 'sn-x' } as VmInfo;
    let obtains = 0;
    let held = false;
    const { agent } = agentWith(
      { get: (id) => (id === 'sb-m' ? vm : undefined) },
      // The first delivery restored by migration (or its fetch was cut off): a fetch now would
      // fail, its ticket expired and its sources gone.
      { obtain: () => (obtains++, Promise.reject(new ForkfleetError('unavailable', 'no source answers'))), holds: async () => held },
    );
    const step = (stepId: string) => work(stepId, { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-m' }] } } });
    const r = await agent.runStep(step('restore/h1'));
    expect(r.error).toBeUndefined();
    expect(r.vms.map((v) => v.sandboxId)).toEqual(['sb-m']);
    expect(r.snapshotNotHeld).toBe(true);
    held = true;
    expect((await agent.runStep(step('restore/h2'))).snapshotNotHeld).toBe(false);
    expect(obtains).toBe(0);
  });

  it('destroy_ofAVmARestoreIsStillMaking_waitsForIt_thenDestroysIt', async () => {
    const vms = new Map<string, VmInfo>();
    let finishFork: () => void = () => undefined;
    const { agent } = agentWith(
      {
        get: (id) => vms.get(id),
        fork: (_s, clones) =>
          new Promise<VmInfo[]>((resolve) => {
            finishFork = () => {
              const made = clones.map((c) => ({ vmId: c.vmId, sandboxId: c.vmId, state: 'running', pid: 0, readyMs: 1 }) as VmInfo);
              for (const v of made) vms.set(v.vmId, v);
              resolve(made);
            };
          }),
        destroy: async (id) => void vms.delete(id),
      },
      { obtain: async () => ({ local: { dir: '/x', manifest: {} } as never, bytesFetched: 0 }) },
    );
    const restore = agent.runStep(work('restore/h1', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }, { sandboxId: 'sb-2' }] } } }));
    await new Promise((r) => setTimeout(r, 10));
    // The scheduler gave up on the slow restore and destroys one sandbox meanwhile.
    let destroyed = false;
    const destroy = agent.runStep(create(HostWorkSchema, { opId: 'op-d', stepId: 'destroy', attempt: 1, work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } })).then((r) => ((destroyed = true), r));
    await new Promise((r) => setTimeout(r, 10));
    expect(destroyed).toBe(false);
    finishFork();
    expect((await restore).error).toBeUndefined();
    expect((await destroy).error).toBeUndefined();
    expect([...vms.keys()]).toEqual(['sb-2']);
  });

  /** A driver whose VMs are a map: fork makes every clone at once, destroy removes one. */
  const mapDriver = (vms: Map<string, VmInfo>): Partial<VmmDriver> => ({
    get: (id) => vms.get(id),
    // Made from the snapshot's manifest, as the QEMU driver records it (VmInfo.baseSnapshotId).
    fork: async (s, clones) => clones.map((c) => (vms.set(c.vmId, { vmId: c.vmId, sandboxId: c.vmId, state: 'running', pid: 0, readyMs: 1, baseSnapshotId: (s as { manifest?: { snapshotId?: string } }).manifest?.snapshotId ?? null } as VmInfo), vms.get(c.vmId)!)),
    destroy: async (id) => void vms.delete(id),
  });
  const obtained = { obtain: async (snapshotId: string) => ({ local: { dir: '/x', manifest: { snapshotId } } as never, bytesFetched: 0 }) };

  it('destroy_deliveredRightAfterARestoreOfItsSandbox_waitsForIt_evenWhileTheRestoreStillReadsItsJournal', async () => {
    const vms = new Map<string, VmInfo>();
    const { agent, journal } = agentWith(mapDriver(vms), obtained);
    // The restore's journal read is the slower one (a redelivery after an agent restart: both
    // steps start together, in delivery order).
    const get = journal.get.bind(journal);
    journal.get = async (op, step) => {
      if (step === 'restore/h1') await new Promise((r) => setTimeout(r, 30));
      return get(op, step);
    };
    const restore = agent.runStep(work('restore/h1', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } }));
    const destroy = agent.runStep(create(HostWorkSchema, { opId: 'op-d', stepId: 'destroy', attempt: 1, work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } }));
    expect((await restore).error).toBeUndefined();
    expect((await destroy).error).toBeUndefined();
    expect([...vms.keys()]).toEqual([]);
  });

  it('stopOfAStartGivenUp_whileItFetches_leavesItUnmade_andALaterOpsRestoreOfTheSandboxMakesItsOwnAfterIt', async () => {
    const vms = new Map<string, VmInfo>();
    let forks = 0;
    let destroys = 0;
    let releaseFirst: () => void = () => undefined;
    const firstFetched = new Promise<void>((r) => (releaseFirst = r));
    const driver = mapDriver(vms);
    const { agent } = agentWith(
      { ...driver, fork: (s, clones) => (forks++, driver.fork!(s, clones)), destroy: (id) => (destroys++, driver.destroy!(id)) },
      // The first wake's fetch is slow; the second's is at once.
      { obtain: async (_id, fetch) => (fetch?.snapshotId === 'slow' ? await firstFetched : undefined, { local: { dir: '/x', manifest: {} } as never, bytesFetched: 0 }) },
    );
    const restore = (opId: string, fetchId: string) => agent.runStep(create(HostWorkSchema, { opId, stepId: 'restore/h1', attempt: 1, work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }], fetch: { snapshotId: fetchId } } } }));
    // Wake 1 restores slowly; the scheduler gives up on it (stop), then wakes the sandbox here again.
    const w1 = restore('op-w1', 'slow');
    await new Promise((r) => setTimeout(r, 10));
    const stop = agent.runStep(create(HostWorkSchema, { opId: 'op-w1', stepId: 'stop-unanswered/sb-1', attempt: 1, work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } }));
    const w2 = restore('op-w2', 'fast');
    await new Promise((r) => setTimeout(r, 10));
    releaseFirst();
    await Promise.all([w1, stop]);
    const second = await w2;
    expect(second.error).toBeUndefined();
    expect(second.vms.map((v) => v.sandboxId)).toEqual(['sb-1']);
    // Wake 1's VM not made (given up on while it fetched), wake 2's made after it and running.
    expect([forks, destroys, [...vms.keys()]]).toEqual([1, 0, ['sb-1']]);
  });

  it('restoreOrCreate_ofAStartTheSchedulerGaveUpOnHere_doesNotMakeThatVm', async () => {
    const vms = new Map<string, VmInfo>();
    const { agent } = agentWith(mapDriver(vms), obtained);
    // The child was placed again elsewhere (its host was lost); the stop of the same op comes
    // before the restore that was still queued here.
    expect((await agent.runStep(work('stop-replaced/sb-1', { work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } }))).error).toBeUndefined();
    const r = await agent.runStep(work('restore/h1', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }, { sandboxId: 'sb-2' }] } } }));
    expect(r.error).toBeUndefined();
    expect([...vms.keys()]).toEqual(['sb-2']);
    await agent.runStep(work('stop-unanswered/sb-3', { work: { case: 'destroyVm', value: { sandboxId: 'sb-3' } } }));
    const c = await agent.runStep(work('create', { work: { case: 'createVm', value: { vm: { sandboxId: 'sb-3' } } } }));
    expect(c.error?.message).toMatch(/gave up on starting sb-3/);
    // Another op's start of the same sandbox (a later wake here, say) is not affected.
    await agent.runStep(create(HostWorkSchema, { opId: 'op-b', stepId: 'restore/h1', attempt: 1, work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } }));
    expect([...vms.keys()].sort()).toEqual(['sb-1', 'sb-2']);
  });

  it('restoreOrCreate_ofAStartGivenUpOnBeforeTheAgentRestarted_isStillNotMade_byTheStopsJournalledResult', async () => {
    const vms = new Map<string, VmInfo>();
    const before = agentWith(mapDriver(vms), obtained);
    expect((await before.agent.runStep(work('stop-unanswered/sb-4', { work: { case: 'destroyVm', value: { sandboxId: 'sb-4' } } }))).error).toBeUndefined();
    // The agent restarts (its in-memory list is gone); a batch holding the start is delivered again.
    const after = agentWith(mapDriver(vms), obtained, {}, undefined, before.journal);
    expect((await after.agent.runStep(work('restore/h1', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-4' }, { sandboxId: 'sb-5' }] } } }))).error).toBeUndefined();
    expect([...vms.keys()]).toEqual(['sb-5']);
    expect((await after.agent.runStep(work('create', { work: { case: 'createVm', value: { vm: { sandboxId: 'sb-4' } } } }))).error?.message).toMatch(/gave up on starting sb-4/);
    // A restore of that sandbox alone fails as the create does: a wake records its sandbox running from any success.
    expect((await after.agent.runStep(work('wake', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-4' }] } } }))).error).toMatchObject({ kind: 'failed_precondition', retryable: false });
  });

  /** Wake `opId`'s restore of sb-1, and wake op-w1's stop given up on it (the scheduler's settleWake). */
  const wake = (opId: string) => create(HostWorkSchema, { opId, stepId: 'restore/h1', attempt: 1, work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } });
  const stopW1 = create(HostWorkSchema, { opId: 'op-w1', stepId: 'stop-unanswered/sb-1', attempt: 1, work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } });

  it('restore_whoseStartIsGivenUpOnWhileItFetches_makesNoVm_andFailsGivenUp', async () => {
    const vms = new Map<string, VmInfo>();
    let release: () => void = () => undefined;
    const fetched = new Promise<void>((r) => (release = r));
    let forks = 0;
    const driver = mapDriver(vms);
    const counted = { ...driver, fork: (sn: never, clones: never) => (forks++, driver.fork!(sn, clones)) } as Partial<VmmDriver>;
    const { agent } = agentWith(counted, { obtain: async (snapshotId: string) => (await fetched, { local: { dir: '/x', manifest: { snapshotId } } as never, bytesFetched: 0 }) });
    const restoring = agent.runStep(wake('op-w1'));
    await new Promise((r) => setTimeout(r, 5));
    // The scheduler gives up on it (its step timed out) while the snapshot is still coming.
    const stopping = agent.runStep(stopW1);
    await new Promise((r) => setTimeout(r, 5));
    release();
    expect((await restoring).error?.message).toMatch(/gave up on starting sb-1/);
    expect((await stopping).error).toBeUndefined();
    // Not made at all (it used to be made, then ended by the stop that waited for it).
    expect([forks, vms.size]).toEqual([0, 0]);
  });

  /**
   * A restore by migration (ADR 0015) over a map driver: each clone's source connects once
   * `gate(vmId).connect()` is called (or its wait ends when migrateFrom's signal aborts), its
   * stream loads once `gate(vmId).load()` is; `prepareFails` clones fail their preparation.
   * Records loads, aborted preparations, fetches (the fallback) and the signal each clone's
   * migrateFrom was given.
   */
  const migrationHarness = (vms: Map<string, VmInfo>, o: { prepareFails?: string[]; prepared?: Promise<void> } = {}) => {
    const gates = new Map<string, { connect: () => void; connected: Promise<void>; load: () => void; loaded: Promise<void> }>();
    const gate = (id: string) => {
      let g = gates.get(id);
      if (!g) {
        let connect!: () => void;
        let load!: () => void;
        const connected = new Promise<void>((r) => (connect = r));
        const loaded = new Promise<void>((r) => (load = r));
        gates.set(id, (g = { connect, connected, load, loaded }));
      }
      return g;
    };
    const seen = { loads: [] as string[], aborted: [] as string[], fetches: 0, signals: new Map<string, AbortSignal | undefined>(), execs: [] as string[], streamsDropped: [] as string[] };
    let n = 0;
    const driver: Partial<VmmDriver> = {
      ...mapDriver(vms),
      exec: async (id, req) => (seen.execs.push(`${id} ${req.path}`), { exitCode: 0, signal: null, stdout: Buffer.alloc(0), stderr: Buffer.alloc(0) }),
      prepareIncoming: async (_src, c) => {
        await o.prepared;
        if (o.prepareFails?.includes(c.vmId)) throw new ForkfleetError('internal', `QEMU for ${c.vmId} did not start`);
        return {
          vmId: c.vmId,
          // As the QEMU driver's: the load fails (its VM destroyed) once `gone` aborts.
          load: async (_conn, gone) => {
            seen.loads.push(c.vmId);
            await Promise.race([gate(c.vmId).loaded, new Promise((_, reject) => (gone?.aborted ? reject(new Error('the load was given up')) : gone?.addEventListener('abort', () => reject(new Error('the load was given up')))))]);
            const info = { vmId: c.vmId, sandboxId: c.vmId, state: 'running', pid: 0, readyMs: 1, baseSnapshotId: 'sn-x' } as VmInfo;
            vms.set(c.vmId, info);
            return info;
          },
          abort: async () => void seen.aborted.push(c.vmId),
        };
      },
    };
    const shipper: Partial<SnapshotShipper> = {
      obtain: async (snapshotId: string) => (seen.fetches++, { local: { dir: '/x', manifest: { snapshotId } } as never, bytesFetched: 0 }),
      holds: async () => false,
      incomingSource: async () => ({ manifest: { snapshotId: 'sn-x' } as never, image: {} as never, diskLayerBacking: '', writeDiskLayer: async () => undefined, bytesFetched: 0, release: () => undefined }),
      // Clones ask in order; the n-th asks for the n-th VM's stream (the order of the step's list).
      migrateFrom: async <T,>(_f: unknown, _h: string, load: (conn: { unixPath: string }, gone: AbortSignal) => Promise<T>, signal?: AbortSignal) => {
        const id = `sb-${++n}`;
        seen.signals.set(id, signal);
        // The wait for the source's connection ends when the caller gives up (as peer/migrate.ts's).
        await Promise.race([gate(id).connected, new Promise((_, reject) => signal?.addEventListener('abort', () => reject(signal.reason as Error)))]);
        // The agent's callback failing is the stream dropped (the peer module then ends the source's call).
        // As peer/migrate.ts's: the caller giving up cancels the source's call, whose failure ends the load.
        const gone = new AbortController();
        if (signal?.aborted) gone.abort(signal.reason);
        else signal?.addEventListener('abort', () => gone.abort(signal.reason), { once: true });
        const result = await load({ unixPath: `/nowhere/${id}.sock` }, gone.signal).catch((e: unknown) => {
          seen.streamsDropped.push(id);
          throw e;
        });
        return { result, bytes: 100 };
      },
    } as Partial<SnapshotShipper>;
    // Each VM with the user's after_resume hook /bin/refresh.
    const migrateWork = (opId: string, ids: string[]) =>
      create(HostWorkSchema, { opId, stepId: 'restore/h1', attempt: 1, work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: ids.map((sandboxId) => ({ sandboxId, afterResume: [{ argv: ['/bin/refresh'] }] })), fetch: { snapshotId: 'sn-x', allowMigration: true, ticket: {}, sources: [{ hostId: 'h2', address: '10.0.0.2:7443', mayMigrate: true }] } } } });
    const { agent } = agentWith(driver, shipper, {}, undefined, undefined, 'tcg', { peerAddress: '10.0.0.1:7443' });
    return { agent, gate, seen, migrateWork };
  };

  it('restoreByMigration_ofAStartGivenUpOnBeforeItsStreamCame_loadsNoVm_fetchesNothing_andFailsGivenUp', async () => {
    const vms = new Map<string, VmInfo>();
    const { agent, gate, seen, migrateWork } = migrationHarness(vms);
    const restoring = agent.runStep(migrateWork('op-w1', ['sb-1']));
    await new Promise((r) => setTimeout(r, 5));
    // The scheduler gives up on it (placed again elsewhere) while the source gets its stream ready.
    const stopping = agent.runStep(stopW1);
    await new Promise((r) => setTimeout(r, 5));
    gate('sb-1').connect();
    expect((await restoring).error?.message).toMatch(/gave up on starting sb-1/);
    expect((await stopping).error).toBeUndefined();
    expect([seen.loads, seen.aborted, seen.fetches, vms.size]).toEqual([[], ['sb-1'], 0, 0]);
  });

  it('restoreByMigration_ofAStartGivenUpOnWhileItsStreamLoads_endsTheLoadAtOnce_notWhenTheStreamEnds', async () => {
    // A large VM's stream may run for many minutes; the scheduler gives up on the start meanwhile.
    const vms = new Map<string, VmInfo>();
    const { agent, gate, seen, migrateWork } = migrationHarness(vms);
    gate('sb-1').connect();
    const restoring = agent.runStep(migrateWork('op-w1', ['sb-1']));
    await vi.waitFor(() => expect(seen.loads).toEqual(['sb-1']));
    const stopping = agent.runStep(stopW1);
    // The stream never ends here: only the give-up can end the step. No VM is kept, and the
    // user's hook never ran beside the sandbox placed elsewhere.
    expect((await restoring).error?.message).toMatch(/gave up on starting sb-1/);
    expect((await stopping).error).toBeUndefined();
    expect([seen.execs, seen.fetches, vms.size]).toEqual([[], 0, 0]);
  });

  it('restoreByMigration_ofAStartGivenUpOnWhileItIsStillPrepared_dropsTheSourcesStreamAtOnce_notOncePrepared', async () => {
    const vms = new Map<string, VmInfo>();
    let prepare!: () => void;
    // Its preparation (an image build, a disk layer) takes long; the source has connected.
    const { agent, gate, seen, migrateWork } = migrationHarness(vms, { prepared: new Promise<void>((r) => (prepare = r)) });
    gate('sb-1').connect();
    const restoring = agent.runStep(migrateWork('op-w1', ['sb-1']));
    // Its source asked (the migration under way), not given up on before the step ran.
    await vi.waitFor(() => expect(seen.signals.has('sb-1')).toBe(true));
    const stopping = agent.runStep(stopW1);
    await vi.waitFor(() => expect(seen.streamsDropped).toEqual(['sb-1']));
    prepare();
    expect((await restoring).error?.message).toMatch(/gave up on starting sb-1/);
    expect((await stopping).error).toBeUndefined();
    expect([seen.loads, seen.aborted, vms.size]).toEqual([[], ['sb-1'], 0]);
  });

  it('restoreByMigration_ofTwo_oneGivenUpOnWhosePreparationThenFails_keepsTheOther_andFetchesNothing', async () => {
    const vms = new Map<string, VmInfo>();
    let prepare!: () => void;
    const { agent, gate, seen, migrateWork } = migrationHarness(vms, { prepared: new Promise<void>((r) => (prepare = r)), prepareFails: ['sb-1'] });
    gate('sb-2').connect();
    const restoring = agent.runStep(migrateWork('op-w1', ['sb-1', 'sb-2']));
    await vi.waitFor(() => expect(seen.signals.size).toBe(2));
    const stopping = agent.runStep(stopW1);
    await new Promise((r) => setTimeout(r, 5));
    // Both preparations end, sb-1's failing; sb-2's stream is still loading meanwhile.
    prepare();
    await vi.waitFor(() => expect(seen.loads).toEqual(['sb-2']));
    await new Promise((r) => setTimeout(r, 5));
    gate('sb-2').load();
    const r = await restoring;
    expect(r.error).toBeUndefined();
    expect((await stopping).error).toBeUndefined();
    expect([r.vms.map((v) => v.sandboxId), seen.fetches, [...vms.keys()]]).toEqual([['sb-2'], 0, ['sb-2']]);
  });

  it('restoreByMigration_whoseOtherClonesPreparationFails_endsThisClonesWaitAtOnce_andFetchesInstead', async () => {
    const vms = new Map<string, VmInfo>();
    // sb-1's QEMU does not start; sb-2's source never connects: only an end of its wait ends the step.
    const { agent, seen, migrateWork } = migrationHarness(vms, { prepareFails: ['sb-1'] });
    const r = await agent.runStep(migrateWork('op-m', ['sb-1', 'sb-2']));
    expect(r.error).toBeUndefined();
    expect(seen.signals.get('sb-2')?.aborted).toBe(true);
    // All or nothing: both restored from the fetched snapshot instead.
    expect([seen.loads, seen.fetches, [...vms.keys()].sort()]).toEqual([[], 1, ['sb-1', 'sb-2']]);
  });

  it('create_whoseStartIsGivenUpOnWhileItsImageBuilds_bootsNoVm', async () => {
    const vms = new Map<string, VmInfo>();
    let created = 0;
    let release: () => void = () => undefined;
    const built = new Promise<void>((r) => (release = r));
    const driver = mapDriver(vms);
    const { agent } = agentWith({ ...driver, create: (spec: never) => (created++, driver.create!(spec)) } as Partial<VmmDriver>, {}, {}, undefined, undefined, 'tcg', {}, { images: async () => (await built, { name: 'tiny' } as never) });
    const creating = agent.runStep(work('create', { work: { case: 'createVm', value: { vm: { sandboxId: 'sb-6' } } } }));
    await new Promise((r) => setTimeout(r, 5));
    const stopping = agent.runStep(work('stop-unanswered/sb-6', { work: { case: 'destroyVm', value: { sandboxId: 'sb-6' } } }));
    await new Promise((r) => setTimeout(r, 5));
    release();
    expect((await creating).error?.message).toMatch(/gave up on starting sb-6/);
    expect((await stopping).error).toBeUndefined();
    expect(created).toBe(0);
  });

  it('stopOfAStartGivenUp_redeliveredAfterAnAgentRestart_leavesRunningTheVmALaterOpsStartMadeMeanwhile', async () => {
    const vms = new Map<string, VmInfo>();
    const journal = new MemoryJournal();
    // Wake 1 restores slowly; the scheduler gives up on it (its stop waits for the restore) and
    // wakes the sandbox here again (wake 2 waits for the stop). Then the agent is killed.
    const before = agentWith(mapDriver(vms), { obtain: () => new Promise<never>(() => undefined) }, {}, undefined, journal);
    void before.agent.runStep(wake('op-w1'));
    await new Promise((r) => setTimeout(r, 5));
    void before.agent.runStep(stopW1);
    void before.agent.runStep(wake('op-w2'));
    await new Promise((r) => setTimeout(r, 5));
    expect(vms.size).toBe(0);
    // A fresh agent stands in for the restarted one. Wake 2 is re-sent at once and makes the
    // VM; wake 1's restore and stop come back only after the bus's ack wait.
    const after = agentWith(mapDriver(vms), obtained, {}, undefined, journal);
    expect((await after.agent.runStep(wake('op-w2'))).vms.map((v) => v.sandboxId)).toEqual(['sb-1']);
    expect((await after.agent.runStep(wake('op-w1'))).vms).toEqual([]); // given up on: neither made nor taken
    expect((await after.agent.runStep(stopW1)).error).toBeUndefined();
    expect([...vms.keys()]).toEqual(['sb-1']);
  });

  it('stopOfAStartGivenUp_redeliveredAfterAnAgentRestart_leavesRunningTheVmALaterOpsStartMadeInPlaceOfTheOneItFound', async () => {
    const vms = new Map<string, VmInfo>();
    const journal = new MemoryJournal();
    let forks = 0;
    const driver = mapDriver(vms);
    const counted = { ...driver, fork: (s: never, clones: never) => (forks++, driver.fork!(s, clones)) } as Partial<VmmDriver>;
    // Wake 1 made the VM, but its step had not finished (its fetch not yet durable) when the
    // agent was killed, with its stop and wake 2 waiting behind it.
    const before = agentWith(counted, { ...obtained, durable: () => new Promise<never>(() => undefined) }, {}, undefined, journal);
    void before.agent.runStep(wake('op-w1'));
    await new Promise((r) => setTimeout(r, 5));
    void before.agent.runStep(stopW1);
    void before.agent.runStep(wake('op-w2'));
    await new Promise((r) => setTimeout(r, 5));
    expect([...vms.keys()]).toEqual(['sb-1']);
    // Wake 2, re-sent at once, finds it running: wake 1's, not its own (its after_resume hooks
    // never ran there), so it is ended and wake 2 makes its own. Wake 1's steps come back after.
    const after = agentWith(counted, obtained, {}, undefined, journal);
    expect((await after.agent.runStep(wake('op-w2'))).vms.map((v) => v.sandboxId)).toEqual(['sb-1']);
    expect((await after.agent.runStep(wake('op-w1'))).vms).toEqual([]);
    expect((await after.agent.runStep(stopW1)).error).toBeUndefined();
    expect([forks, [...vms.keys()]]).toEqual([2, ['sb-1']]);
  });

  it('stopOfAStartGivenUp_whoseSandboxsVmAnEarlierOpMade_endsIt_alsoAfterARestart_asDoesAnOrdinaryDestroy', async () => {
    const vms = new Map<string, VmInfo>();
    const journal = new MemoryJournal();
    const first = agentWith(mapDriver(vms), obtained, {}, undefined, journal);
    expect((await first.agent.runStep(wake('op-c'))).error).toBeUndefined();
    // An op that ended without settling the sandbox (a hibernate, say) gives it up: the VM
    // there when its stop came is the one to end, whoever made it.
    const after = agentWith(mapDriver(vms), obtained, {}, undefined, journal);
    expect((await after.agent.runStep(create(HostWorkSchema, { opId: 'op-h', stepId: 'stop-unanswered/sb-1', attempt: 1, work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } }))).error).toBeUndefined();
    expect([...vms.keys()]).toEqual([]);
    // A user's destroy ends the VM whichever op made it.
    expect((await after.agent.runStep(wake('op-w2'))).error).toBeUndefined();
    expect((await after.agent.runStep(create(HostWorkSchema, { opId: 'op-d', stepId: 'destroy', attempt: 1, work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } }))).error).toBeUndefined();
    expect([...vms.keys()]).toEqual([]);
  });

  /** A driver over `vms` (mapDriver) that counts forks and records the after_resume hooks it runs. */
  const hookedDriver = (vms: Map<string, VmInfo>, counts: { forks: number; execs: string[] }): Partial<VmmDriver> => {
    const driver = mapDriver(vms);
    return {
      ...driver,
      fork: (s, clones) => (counts.forks++, driver.fork!(s, clones)),
      exec: async (id, req) => (counts.execs.push(`${id} ${req.path}`), { exitCode: 0, signal: null, stdout: Buffer.alloc(0), stderr: Buffer.alloc(0) }),
    };
  };
  /** Op `opId`'s wake of sb-1 from `snapshotId`, with an after_resume hook. */
  const hookedWake = (opId: string, snapshotId = 'sn-h') => create(HostWorkSchema, { opId, stepId: 'wake/h1', attempt: 1, work: { case: 'restoreVms', value: { snapshotId, vms: [{ sandboxId: 'sb-1', afterResume: [{ argv: ['/bin/refresh'] }] }] } } });

  it('wake_ofASandboxWhoseStaleVmIsStillHere_pausedOrAnEarlierOps_endsIt_andRestoresAFreshOne_runningItsHooks', async () => {
    const vms = new Map<string, VmInfo>();
    const counts = { forks: 0, execs: [] as string[] };
    const { agent } = agentWith(hookedDriver(vms, counts), obtained);
    // A hibernate paused sb-1 and took sn-h of it (the VM maps it since), but its stop, and the
    // stop sent again, never ran; the sandbox is woken on this host.
    vms.set('sb-1', { vmId: 'sb-1', sandboxId: 'sb-1', state: 'paused', pid: 1, readyMs: 1, baseSnapshotId: 'sn-h' } as VmInfo);
    const r = await agent.runStep(hookedWake('op-w1'));
    expect(r.error).toBeUndefined();
    expect(r.vms.map((v) => [v.sandboxId, v.state])).toEqual([['sb-1', PbVmState.RUNNING]]);
    expect(counts).toEqual({ forks: 1, execs: ['sb-1 /bin/refresh'] });
    // Wake 1's VM, running, is still here when the next wake comes (its stop not run yet): not
    // that wake's own, so not handed to it without its restore and its hooks.
    const next = await agent.runStep(hookedWake('op-w2'));
    expect(next.vms.map((v) => [v.sandboxId, v.state])).toEqual([['sb-1', PbVmState.RUNNING]]);
    expect(counts).toEqual({ forks: 2, execs: ['sb-1 /bin/refresh', 'sb-1 /bin/refresh'] });
  });

  it('restoreOfAnOp_findingTheVmItsOwnEarlierStepMadeFromAnotherSnapshot_endsIt_andRestoresFromItsOwnSnapshot', async () => {
    // A drain's migration of sb-1 tried again from a newer snapshot of the source (sn-2) on
    // the host where its first attempt (from sn-1, same op) left a VM its stop has not ended
    // yet: that VM holds the source's state as of sn-1, and must not be reported as sn-2's.
    const vms = new Map<string, VmInfo>();
    const counts = { forks: 0, execs: [] as string[] };
    const { agent } = agentWith(hookedDriver(vms, counts), obtained);
    expect((await agent.runStep(hookedWake('op-d', 'sn-1'))).error).toBeUndefined();
    expect(vms.get('sb-1')?.baseSnapshotId).toBe('sn-1');
    const again = create(HostWorkSchema, { opId: 'op-d', stepId: 'wake/h1/1', attempt: 1, work: { case: 'restoreVms', value: { snapshotId: 'sn-2', vms: [{ sandboxId: 'sb-1', afterResume: [{ argv: ['/bin/refresh'] }] }] } } });
    const r = await agent.runStep(again);
    expect(r.vms.map((v) => [v.sandboxId, v.state])).toEqual([['sb-1', PbVmState.RUNNING]]);
    expect([counts.forks, vms.get('sb-1')?.baseSnapshotId]).toEqual([2, 'sn-2']);
  });

  it('start_redeliveredAfterAnAgentRestart_reportsTheVmItFinds_onlyIfItRunsAndIsItsOwn_orWithNoOwnerKnownWasMadeFromItsSnapshot', async () => {
    const vms = new Map<string, VmInfo>();
    const counts = { forks: 0, execs: [] as string[] };
    // No owner recorded (the agent died before the restore's claim was journalled): a running
    // VM made from the step's snapshot is the one it made, and is reported, not made again.
    vms.set('sb-1', { vmId: 'sb-1', sandboxId: 'sb-1', state: 'running', pid: 1, readyMs: 1, baseSnapshotId: 'sn-h' } as VmInfo);
    const adopted = agentWith(hookedDriver(vms, counts), obtained);
    expect((await adopted.agent.runStep(hookedWake('op-w1'))).vms.map((v) => v.sandboxId)).toEqual(['sb-1']);
    expect(counts.forks).toBe(0);
    // One made from another snapshot (a drain's source left behind) is not: restored anew.
    vms.set('sb-1', { vmId: 'sb-1', sandboxId: 'sb-1', state: 'running', pid: 1, readyMs: 1, baseSnapshotId: 'sn-drain' } as VmInfo);
    const leftover = agentWith(hookedDriver(vms, counts), obtained);
    expect((await leftover.agent.runStep(hookedWake('op-w1'))).vms.map((v) => v.sandboxId)).toEqual(['sb-1']);
    expect(counts).toEqual({ forks: 1, execs: ['sb-1 /bin/refresh'] });
  });

  it('start_killedBeforeItsClaim_afterTheSandboxsEarlierVmWasEnded_isRedeliveredAndTakesTheVmItMade_asOneWithNoOwnerKnown', async () => {
    // The earlier VM ended by a stop (a hibernate's), or by the start itself as stale (a paused
    // VM whose stop failed): either way, its owner is no owner of the VM made next.
    for (const endedBy of ['stop', 'the start'] as const) {
      const vms = new Map<string, VmInfo>();
      const counts = { forks: 0, execs: [] as string[] };
      const journal = new MemoryJournal();
      let destroys = 0;
      const driver = hookedDriver(vms, counts);
      const counted: Partial<VmmDriver> = { ...driver, destroy: (id) => (destroys++, driver.destroy!(id)) };
      const before = agentWith(counted, obtained, {}, undefined, journal);
      // op-c made sb-1 here (its owner, journalled); then its VM was ended, or left paused.
      expect((await before.agent.runStep(hookedWake('op-c', 'sn-0'))).error).toBeUndefined();
      if (endedBy === 'stop') expect((await before.agent.runStep(create(HostWorkSchema, { opId: 'op-h', stepId: 'stop', attempt: 1, work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } }))).error).toBeUndefined();
      else vms.set('sb-1', { ...vms.get('sb-1')!, state: 'paused' });
      // Wake op-w1 forks sb-1 here; the agent is killed before its claim is journalled.
      const put = journal.put.bind(journal);
      journal.put = (opId, stepId, bytes) => (stepId === 'owner' && Buffer.from(bytes).toString('utf8') === 'op-w1' ? new Promise<never>(() => undefined) : put(opId, stepId, bytes));
      void before.agent.runStep(hookedWake('op-w1'));
      await new Promise((r) => setTimeout(r, 10));
      journal.put = put;
      expect([counts.forks, destroys, vms.get('sb-1')?.baseSnapshotId]).toEqual([2, 1, 'sn-h']);
      // The next agent adopts the VM; the wake, redelivered, reports it (its hooks run now), not
      // ending it as stale and forking again.
      const after = agentWith(counted, obtained, {}, undefined, journal);
      expect((await after.agent.runStep(hookedWake('op-w1'))).vms.map((v) => [v.sandboxId, v.state])).toEqual([['sb-1', PbVmState.RUNNING]]);
      expect([endedBy, counts.forks, destroys]).toEqual([endedBy, 2, 1]);
    }
  });

  it('startAnsweredFromItsJournal_afterTheSchedulerGaveItsSandboxUpHere_doesNotReportItRunning_alsoAfterAnAgentRestart', async () => {
    const vms = new Map<string, VmInfo>();
    const journal = new MemoryJournal();
    const image = { name: 'tiny', recipeHash: 'r', kernel: '', initrd: '', disk: '', diskVirtualSize: 1, kernelArgs: '', readyMarker: '' };
    const driver = { ...mapDriver(vms), create: async (spec: { vmId: string }) => (vms.set(spec.vmId, { vmId: spec.vmId, sandboxId: spec.vmId, state: 'running', pid: 0, readyMs: 1 } as VmInfo), vms.get(spec.vmId)!) } as Partial<VmmDriver>;
    const agentOver = () => agentWith(driver, obtained, {}, undefined, journal, 'tcg', {}, { images: async () => image }).agent;
    const agent = agentOver();
    const restore = (attempt: number) => work('restore/h1', { attempt, work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } });
    const createVm = (attempt: number) => work('create', { attempt, work: { case: 'createVm', value: { vm: { sandboxId: 'sb-2' } } } });
    const stop = (sandboxId: string) => work(`stop-unanswered/${sandboxId}`, { work: { case: 'destroyVm', value: { sandboxId } } });
    expect((await agent.runStep(restore(1))).vms.map((v) => v.sandboxId)).toEqual(['sb-1']);
    expect((await agent.runStep(createVm(1))).vms.map((v) => v.sandboxId)).toEqual(['sb-2']);
    // Their answers did not reach the scheduler in time: it gives both up here (the stops end
    // the VMs), and the op, run again, sends its steps again.
    expect((await agent.runStep(stop('sb-1'))).error).toBeUndefined();
    expect((await agent.runStep(stop('sb-2'))).error).toBeUndefined();
    expect(vms.size).toBe(0);
    for (const a of [agent, agentOver()]) {
      const restored = await a.runStep(restore(2));
      expect([restored.vms, restored.error?.kind, restored.error?.retryable]).toEqual([[], 'failed_precondition', false]);
      const created = await a.runStep(createVm(2));
      expect([created.vms, created.error?.kind]).toEqual([[], 'failed_precondition']);
    }
  });

  it('copyOfAStartSharingItsRun_whenTheSchedulerGaveItsSandboxUpMeanwhile_doesNotReportItRunning', async () => {
    const vms = new Map<string, VmInfo>();
    let fetched: () => void = () => undefined;
    const { agent } = agentWith(mapDriver(vms), { obtain: () => new Promise((r) => (fetched = () => r({ local: { dir: '/x', manifest: {} } as never, bytesFetched: 0 }))) });
    const restore = (attempt: number) => work('restore/h1', { attempt, work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } });
    // The restore runs past its deadlines; the scheduler gives sb-1 up here, runs the op again,
    // and its send shares the run still going.
    const first = agent.runStep(restore(1));
    await new Promise((r) => setTimeout(r, 10));
    const stopped = agent.runStep(work('stop-unanswered/sb-1', { work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } }));
    const second = agent.runStep(restore(2));
    await new Promise((r) => setTimeout(r, 10));
    fetched();
    for (const r of [await first, await second]) expect([r.vms, r.error?.kind]).toEqual([[], 'failed_precondition']);
    expect((await second).attempt).toBe(2);
    expect((await stopped).error).toBeUndefined();
    expect(vms.size).toBe(0);
  });

  it('stopSentWithNoWaiter_redeliveredAfterAnAgentRestart_leavesRunningTheVmALaterOpsStartMadeMeanwhile', async () => {
    const vms = new Map<string, VmInfo>();
    const journal = new MemoryJournal();
    // As stopOfAStartGivenUp_redeliveredAfterAnAgentRestart_leavesRunningTheVmALaterOpsStartMadeMeanwhile,
    // with a stop the scheduler sends with no waiter (a hibernated sandbox's stop sent again).
    const stopAgain = create(HostWorkSchema, { opId: 'op-h-stop-again', stepId: 'stop/sb-1', attempt: 1, work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } });
    const before = agentWith(mapDriver(vms), { obtain: () => new Promise<never>(() => undefined) }, {}, undefined, journal);
    void before.agent.runStep(wake('op-w1'));
    await new Promise((r) => setTimeout(r, 5));
    void before.agent.runStep(stopAgain);
    void before.agent.runStep(wake('op-w2'));
    await new Promise((r) => setTimeout(r, 5));
    expect(vms.size).toBe(0);
    const after = agentWith(mapDriver(vms), obtained, {}, undefined, journal);
    expect((await after.agent.runStep(wake('op-w2'))).vms.map((v) => v.sandboxId)).toEqual(['sb-1']);
    expect((await after.agent.runStep(stopAgain)).error).toBeUndefined();
    expect([...vms.keys()]).toEqual(['sb-1']);
  });

  it('stopSentWithNoWaiter_whileAStartOfItsSandboxDeliveredBeforeItRuns_endsTheVmThatStartMakes_alsoAfterAnAgentRestart', async () => {
    const vms = new Map<string, VmInfo>();
    const journal = new MemoryJournal();
    let fetched: () => void = () => undefined;
    // A child moved on during its restore (op-f): the scheduler stops its VM, which the
    // restore is still making.
    const movedOn = create(HostWorkSchema, { opId: 'moved-on-sb-1', stepId: 'stop/sb-1', attempt: 1, work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } });
    const first = agentWith(mapDriver(vms), { obtain: () => new Promise((r) => (fetched = () => r({ local: { dir: '/x', manifest: {} } as never, bytesFetched: 0 }))) }, {}, undefined, journal);
    const restore = first.agent.runStep(wake('op-f'));
    await new Promise((r) => setTimeout(r, 5));
    const stop = first.agent.runStep(movedOn);
    fetched();
    expect((await restore).vms.map((v) => v.sandboxId)).toEqual(['sb-1']);
    expect((await stop).error).toBeUndefined();
    expect(vms.size).toBe(0);
    // The same, the agent killed before either finished: both come back after its restart.
    const movedOn2 = create(HostWorkSchema, { ...movedOn, opId: 'moved-on-sb-1-2' });
    const before = agentWith(mapDriver(vms), { obtain: () => new Promise<never>(() => undefined) }, {}, undefined, journal);
    void before.agent.runStep(wake('op-f2'));
    await new Promise((r) => setTimeout(r, 5));
    void before.agent.runStep(movedOn2);
    await new Promise((r) => setTimeout(r, 5));
    const after = agentWith(mapDriver(vms), obtained, {}, undefined, journal);
    expect((await after.agent.runStep(wake('op-f2'))).vms.map((v) => v.sandboxId)).toEqual(['sb-1']);
    expect((await after.agent.runStep(movedOn2)).error).toBeUndefined();
    expect(vms.size).toBe(0);
  });

  it('stopSentWithNoWaiter_deliveredWhileAStartOfItsSandboxWaitsForASlot_endsTheVmThatStartMakes', async () => {
    const vms = new Map<string, VmInfo>();
    let onWork: ((w: ReturnType<typeof work>, ctl: WorkControl) => Promise<void>) | undefined;
    let fetched: () => void = () => undefined;
    let obtains = 0;
    const { agent } = agentWith(
      { ...mapDriver(vms), onEvent: () => () => undefined },
      // The first restore's fetch waits, holding the only slot; the others' are at once.
      { obtain: (snapshotId: string) => (obtains++ === 0 ? new Promise((r) => (fetched = () => r({ local: { dir: '/x', manifest: { snapshotId } } as never, bytesFetched: 0 }))) : obtained.obtain(snapshotId)) },
      { serveExec: () => () => undefined, serveFile: () => () => undefined, consumeWork: async (f) => ((onWork = f as never), async () => undefined), publishHeartbeat: () => undefined, publishResult: async () => undefined },
      undefined,
      undefined,
      undefined,
      { concurrency: 1 },
    );
    await agent.start();
    const ctl = ctlOf();
    const busy = onWork!(work('restore/other', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-9' }] } } }), ctl);
    const restore = onWork!(wake('op-f'), ctl);
    const stop = onWork!(create(HostWorkSchema, { opId: 'moved-on-sb-1', stepId: 'stop/sb-1', attempt: 1, work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } }), ctl);
    await new Promise((r) => setTimeout(r, 10));
    fetched();
    await Promise.all([busy, restore, stop]);
    expect([...vms.keys()]).toEqual(['sb-9']);
    await agent.stop();
  });

  it('work_waitingForAStepSlot_isKeptAliveSoTheBusDoesNotDeliverItAgain', async () => {
    vi.useFakeTimers();
    try {
      let onWork: ((w: ReturnType<typeof work>, ctl: WorkControl) => Promise<void>) | undefined;
      const { agent } = agentWith(
        { onEvent: () => () => undefined },
        { obtain: () => new Promise<never>(() => undefined) },
        { serveExec: () => () => undefined, serveFile: () => () => undefined, consumeWork: async (f) => ((onWork = f as never), async () => undefined), publishHeartbeat: () => undefined, publishResult: async () => undefined },
      );
      await agent.start();
      // Three restores whose fetch never ends take every slot (concurrency 3); a fourth waits for one.
      const alive = [0, 0, 0, 0];
      for (let i = 0; i < 4; i++)  void onWork!(work(`restore/${i}`, { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: `sb-${i}` }] } } }), { ack: () => undefined, working: () => void alive[i]!++, release: () => undefined });
      await vi.advanceTimersByTimeAsync(11_000);
      expect(alive[3]).toBeGreaterThanOrEqual(2);
      // The restores never end: stop() waits out its grace for them.
      const stopped = agent.stop();
      await vi.advanceTimersByTimeAsync(100);
      await stopped;
    } finally {
      vi.useRealTimers();
    }
  });

  it('stop_heartbeatsOnSayingItIsStopping_whileItsStepsFinish_andGoesSilentOnlyOnceTheyHave', async () => {
    vi.useFakeTimers();
    try {
      let onWork: ((w: ReturnType<typeof work>, ctl: WorkControl) => Promise<void>) | undefined;
      const beats: boolean[] = [];
      let fetched: () => void = () => undefined;
      const { agent } = agentWith(
        { onEvent: () => () => undefined, fork: async (_s, clones) => clones.map((c) => ({ vmId: c.vmId, sandboxId: c.vmId, state: 'running', pid: 0, readyMs: 1 }) as VmInfo) },
        { obtain: () => new Promise((r) => (fetched = () => r({ local: { dir: '/x', manifest: {} } as never, bytesFetched: 0 }))) },
        { serveExec: () => () => undefined, serveFile: () => () => undefined, consumeWork: async (f) => ((onWork = f as never), async () => undefined), publishHeartbeat: (hb) => void beats.push(hb.stopping), publishResult: async () => undefined },
        undefined,
        undefined,
        undefined,
        { shutdownGraceMs: 20_000 },
      );
      await agent.start();
      void onWork!(work('restore/1', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } }), ctlOf());
      await vi.advanceTimersByTimeAsync(10);
      expect(beats.every((b) => b === false)).toBe(true);
      const stopped = agent.stop();
      await vi.advanceTimersByTimeAsync(5_000);
      // Not silent while the restore runs on: 1 at once and ~1 a second, each saying "stopping".
      const during = beats.slice(beats.lastIndexOf(false) + 1);
      expect(during.length).toBeGreaterThanOrEqual(5);
      expect(during.every((b) => b === true)).toBe(true);
      fetched();
      await vi.advanceTimersByTimeAsync(10);
      await stopped;
      const n = beats.length;
      await vi.advanceTimersByTimeAsync(5_000);
      expect(beats.length).toBe(n);
    } finally {
      vi.useRealTimers();
    }
  });

  /** An agent over `journal` whose work is delivered by `deliver(step, term, cluster, store)`: a destroy of sb-<step>; whether it was acked. */
  const termedAgent = async (journal: MemoryJournal, destroyed: string[], answered: string[]) => {
    let onWork: ((w: ReturnType<typeof work>, ctl: WorkControl) => Promise<void>) | undefined;
    const { agent } = agentWith(
      { onEvent: () => () => undefined, get: (id: string) => ({ vmId: id, sandboxId: id }) as never, destroy: async (id: string) => void destroyed.push(id) },
      {},
      { serveExec: () => () => undefined, serveFile: () => () => undefined, consumeWork: async (f) => ((onWork = f as never), async () => undefined), publishHeartbeat: () => undefined, publishResult: async (r) => void answered.push(r.stepId) },
      undefined,
      journal,
    );
    await agent.start();
    const deliver = async (step: string, term: bigint, cluster: bigint, store = 0n): Promise<boolean> => {
      let acked = false;
      await onWork!(create(HostWorkSchema, { opId: 'op-t', stepId: step, attempt: 1, leaderTerm: term, leaderCluster: cluster, leaderStore: store, work: { case: 'destroyVm', value: { sandboxId: `sb-${step}` } } }), ctlOf(() => void (acked = true)));
      return acked;
    };
    return { agent, deliver };
  };

  it('work_ofAnOlderLeaderTermThanOneTaken_isAckedAndDroppedWithoutAResult_alsoAfterARestart_whileAnotherEtcdClustersTermIsTaken', async () => {
    const journal = new MemoryJournal();
    const destroyed: string[] = [];
    const answered: string[] = [];
    const startAgent = () => termedAgent(journal, destroyed, answered);
    const first = await startAgent();
    expect(await first.deliver('a', 10n, 7n)).toBe(true);
    expect(await first.deliver('b', 9n, 7n)).toBe(true); // acked, so JetStream does not deliver it again
    expect(await first.deliver('c', 0n, 7n)).toBe(true); // no term: a scheduler that predates them
    expect(destroyed).toEqual(['sb-a', 'sb-c']);
    expect(answered).toEqual(['a', 'c']);
    expect(journal.term).toEqual({ term: 10n, cluster: 7n, at: expect.any(Number) });
    await first.agent.stop();

    const second = await startAgent();
    expect(await second.deliver('d', 9n, 7n)).toBe(true);
    expect(await second.deliver('e', 3n, 8n)).toBe(true); // etcd made anew: its revisions count from 1 again
    expect(await second.deliver('f', 2n, 8n)).toBe(true);
    expect(destroyed).toEqual(['sb-a', 'sb-c', 'sb-e']);
    expect(answered).toEqual(['a', 'c', 'e']);
    expect(journal.term).toEqual({ term: 3n, cluster: 8n, at: expect.any(Number) });
    await second.agent.stop();
  });

  it('work_ofAnOlderFleetStoreThanTheNewestTaken_isAckedAndDroppedWithoutAResult_inWhateverOrderTheyCome', async () => {
    const journal = new MemoryJournal();
    const destroyed: string[] = [];
    const answered: string[] = [];
    const { agent, deliver } = await termedAgent(journal, destroyed, answered);
    // etcd cluster 7 throughout (rebuilt from the same members and token): store 70, then 80.
    expect(await deliver('a1', 10n, 7n, 70n)).toBe(true);
    expect(await deliver('b1', 2n, 7n, 80n)).toBe(true); // the store made anew: its revisions count from 1 again
    // Store 70's leader, deposed, still publishes (held by its NATS client), in a newer term
    // of its own: dropped, and the agent stays with store 80, whose work is taken.
    expect(await deliver('a2', 11n, 7n, 70n)).toBe(true);
    expect(await deliver('b2', 2n, 7n, 80n)).toBe(true);
    expect(await deliver('z', 0n, 7n, 70n)).toBe(true); // no term: taken, as ever
    expect(destroyed).toEqual(['sb-a1', 'sb-b1', 'sb-b2', 'sb-z']);
    expect(answered).toEqual(['a1', 'b1', 'b2', 'z']);
    expect(journal.term).toEqual({ term: 2n, cluster: 7n, store: 80n });
    await agent.stop();
  });

  it('work_ofANewerFleetStore_isTakenEvenWhenTheOlderStoresComesAfterIt_toAnAgentThatKnewNoStore', async () => {
    const journal = new MemoryJournal();
    const destroyed: string[] = [];
    const answered: string[] = [];
    const { agent, deliver } = await termedAgent(journal, destroyed, answered);
    // A new host (no term kept) hears the new store first, then the deposed old store's held publish.
    expect(await deliver('b1', 2n, 7n, 80n)).toBe(true);
    expect(await deliver('a1', 10n, 7n, 70n)).toBe(true);
    expect(await deliver('b2', 2n, 7n, 80n)).toBe(true);
    expect(destroyed).toEqual(['sb-b1', 'sb-b2']);
    expect(journal.term).toEqual({ term: 2n, cluster: 7n, store: 80n });
    await agent.stop();
  });

  it('work_ofAStoreMadeAfterATermKeptWithNoStore_isTakenWhateverItsTerm_andOfOneMadeBefore_isJudgedByTerm', async () => {
    // An agent upgraded from before stores kept `7 10` (no store) at T; etcd then made anew.
    const T = 1_700_000_000_000;
    const madeAt = (ms: number, low = 5n): bigint => (BigInt(ms / 1000) << 30n) | low;
    for (const [store, taken] of [
      [madeAt(T + 60_000), true], // made after the term was kept: newer, its term 2 taken
      [madeAt(T - 60_000), false], // made before: may be the kept term's own store, term 2 < 10
    ] as const) {
      const journal = new MemoryJournal();
      journal.term = { term: 10n, cluster: 7n, at: T };
      const destroyed: string[] = [];
      const { agent, deliver } = await termedAgent(journal, destroyed, []);
      expect(await deliver('b1', 2n, 7n, store)).toBe(true);
      expect(destroyed).toEqual(taken ? ['sb-b1'] : []);
      await agent.stop();
    }
  });

  it('work_thatSaysNoStore_queuedForASlot_isJudgedAtItsTurnByTheStoreItWasTakenUnder', async () => {
    // Taken under store 70 (a scheduler of the version before, term 11); while it waits for a
    // slot, store 80's first work is taken (etcd made anew, term 2): at its turn it is of the older store.
    const destroyed: string[] = [];
    const answered: string[] = [];
    let release: () => void = () => undefined;
    let onWork: ((w: ReturnType<typeof work>, ctl: WorkControl) => Promise<void>) | undefined;
    const journal = new MemoryJournal();
    journal.term = { term: 10n, cluster: 7n, store: (1_700_000_000n << 30n) | 70n };
    const { agent } = agentWith(
      { onEvent: () => () => undefined, get: (id: string) => ({ vmId: id, sandboxId: id, state: 'running' }) as never, destroy: async (id: string) => void destroyed.push(id) },
      { obtain: () => new Promise((_, reject) => (release = () => reject(new ForkfleetError('not_found', 'gone')))) },
      { serveExec: () => () => undefined, serveFile: () => () => undefined, consumeWork: async (f) => ((onWork = f as never), async () => undefined), publishHeartbeat: () => undefined, publishResult: async (r) => void answered.push(r.stepId) },
      undefined,
      journal,
      'tcg',
      { concurrency: 1 },
    );
    await agent.start();
    const deliver = (step: string, term: bigint, w: Parameters<typeof work>[1], store: bigint) =>
      onWork!(create(HostWorkSchema, { ...w, opId: `op-${step}`, stepId: step, attempt: 1, leaderTerm: term, leaderCluster: 7n, leaderStore: store }), ctlOf(() => undefined));
    const restoring = deliver('restore', 10n, { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-r' }] } } }, journal.term.store!);
    const queued = deliver('old', 11n, { work: { case: 'destroyVm', value: { sandboxId: 'sb-old' } } }, 0n);
    await new Promise((r) => setTimeout(r, 10));
    const fresh = deliver('new', 2n, { work: { case: 'destroyVm', value: { sandboxId: 'sb-new' } } }, (1_800_000_000n << 30n) | 80n);
    release();
    await Promise.all([restoring, queued, fresh]);
    expect(destroyed).toEqual(['sb-r', 'sb-new']);
    expect(answered).toEqual(['restore', 'new']);
    await agent.stop();
  });

  it('work_ofAnOlderFleetStore_isDroppedAlsoAfterARestart_theStoreKeptInTheJournal', async () => {
    const journal = new MemoryJournal();
    const destroyed: string[] = [];
    const answered: string[] = [];
    const first = await termedAgent(journal, destroyed, answered);
    expect(await first.deliver('a1', 10n, 7n, 70n)).toBe(true);
    expect(await first.deliver('b1', 2n, 7n, 80n)).toBe(true);
    await first.agent.stop();
    // A redelivery of store 70's work to the next agent: dropped; store 80's taken.
    const second = await termedAgent(journal, destroyed, answered);
    expect(await second.deliver('a2', 10n, 7n, 70n)).toBe(true);
    expect(await second.deliver('b2', 2n, 7n, 80n)).toBe(true);
    expect(destroyed).toEqual(['sb-a1', 'sb-b1', 'sb-b2']);
    expect(answered).toEqual(['a1', 'b1', 'b2']);
    await second.agent.stop();
  });

  it('work_ofSchedulersOfTheVersionBeforeAndAfterTheStore_onOneStore_isJudgedByTermAlone_throughAnUpgradeAndARollback', async () => {
    const journal = new MemoryJournal();
    const destroyed: string[] = [];
    const answered: string[] = [];
    const { agent, deliver } = await termedAgent(journal, destroyed, answered);
    // Cluster 7, store 70: the version before sends no store (0); both count the same revisions.
    expect(await deliver('a', 10n, 7n)).toBe(true);
    expect(await deliver('b', 11n, 7n, 70n)).toBe(true); // upgraded leader
    expect(await deliver('c', 12n, 7n)).toBe(true); // an old replica leads again (rollback)
    expect(await deliver('d', 13n, 7n, 70n)).toBe(true); // forward again
    expect(await deliver('e', 12n, 7n)).toBe(true); // the deposed old one's held publish: dropped
    expect(await deliver('f', 12n, 7n, 70n)).toBe(true); // and the deposed new one's: dropped
    expect(destroyed).toEqual(['sb-a', 'sb-b', 'sb-c', 'sb-d']);
    expect(answered).toEqual(['a', 'b', 'c', 'd']);
    expect(journal.term).toEqual({ term: 13n, cluster: 7n, store: 70n });
    await agent.stop();
  });

  it.each([
    ['term', 6n, 10n],
    ['fleet store', 1n, 20n],
  ])('work_ofATermQueuedForASlotWhileANewerTermWasTaken_isAckedAndDroppedWhenItsTurnComes_withoutARunOrAResult (a newer %s)', async (_newer, newTerm, newStore) => {
    const destroyed: string[] = [];
    const answered: string[] = [];
    let release: () => void = () => undefined;
    let onWork: ((w: ReturnType<typeof work>, ctl: WorkControl) => Promise<void>) | undefined;
    const { agent } = agentWith(
      { onEvent: () => () => undefined, get: (id: string) => ({ vmId: id, sandboxId: id, state: 'running' }) as never, destroy: async (id: string) => void destroyed.push(id) },
      { obtain: () => new Promise((_, reject) => (release = () => reject(new ForkfleetError('not_found', 'gone')))) },
      { serveExec: () => () => undefined, serveFile: () => () => undefined, consumeWork: async (f) => ((onWork = f as never), async () => undefined), publishHeartbeat: () => undefined, publishResult: async (r) => void answered.push(r.stepId) },
      undefined,
      new MemoryJournal(),
      'tcg',
      { concurrency: 1 },
    );
    await agent.start();
    const acks: string[] = [];
    const deliver = (step: string, term: bigint, w: Parameters<typeof work>[1], store = 10n) =>
      onWork!(create(HostWorkSchema, { ...w, opId: `op-${step}`, stepId: step, attempt: 1, leaderTerm: term, leaderCluster: 1n, leaderStore: store }), ctlOf(() => void acks.push(step)));
    // Term 5: a restore holds the only slot, a destroy waits for it.
    const restoring = deliver('restore', 5n, { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-r' }] } } });
    const queued = deliver('old', 5n, { work: { case: 'destroyVm', value: { sandboxId: 'sb-old' } } });
    await new Promise((r) => setTimeout(r, 10));
    // The new leader's first work takes term 6, or its new fleet store's term (it waits for the slot too).
    const fresh = deliver('new', newTerm, { work: { case: 'destroyVm', value: { sandboxId: 'sb-new' } } }, newStore);
    release();
    await Promise.all([restoring, queued, fresh]);
    // (sb-r: the failed restore's clean-up.)
    expect(destroyed).toEqual(['sb-r', 'sb-new']);
    expect(answered).toEqual(['restore', 'new']);
    expect(acks.sort()).toEqual(['new', 'old', 'restore']);
    await agent.stop();
  });

  it('step_whoseJournalCannotBeRead_isAnsweredRetryable_andMakesNoVm_evenWhenOnlyTheGaveUpCheckFails', async () => {
    let created = 0;
    const journal = new MemoryJournal();
    const { agent } = agentWith({ create: async () => ((created++, { vmId: 'sb-1', sandboxId: 'sb-1', state: 'running', pid: 1 }) as never) }, {}, {}, undefined, journal);
    const eio = (): Promise<never> => Promise.reject(new Error('EIO: i/o error, read'));
    const get = journal.get.bind(journal);
    journal.get = eio;
    const all = await agent.runStep(work('create', { work: { case: 'createVm', value: { vm: { sandboxId: 'sb-1' } } } }));
    expect([all.error?.kind, all.error?.retryable]).toEqual(['unavailable', true]);
    // The step's own entry reads (none), the gave-up check's do not.
    journal.get = (opId, stepId) => (stepId.startsWith('stop-') ? eio() : get(opId, stepId));
    const check = await agent.runStep(work('create', { attempt: 2, work: { case: 'createVm', value: { vm: { sandboxId: 'sb-1' } } } }));
    expect([check.error?.kind, check.error?.retryable]).toEqual(['unavailable', true]);
    expect(created).toBe(0);
  });

  it('stop_whoseJournalCannotBeRead_runsAllTheSame_soAStopSentWithoutAWaiterIsNotLost', async () => {
    const destroyed: string[] = [];
    const journal = new MemoryJournal();
    const { agent } = agentWith({ get: (id: string) => ({ vmId: id, sandboxId: id }) as never, destroy: async (id: string) => void destroyed.push(id) }, {}, {}, undefined, journal);
    journal.get = (): Promise<never> => Promise.reject(new Error('EIO: i/o error, read'));
    const r = await agent.runStep(work('stop-unanswered/sb-1', { work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } }));
    expect(r.error).toBeUndefined();
    expect(destroyed).toEqual(['sb-1']);
  });

  it('stepResult_largerThanTheBusCarries_isReportedAsTheStepsFailureNamingWhy_andTheWorkAcked', async () => {
    let onWork: ((w: ReturnType<typeof work>, ctl: WorkControl) => Promise<void>) | undefined;
    const sent: Array<{ stepId: string; error?: { kind: string; retryable: boolean; message: string } }> = [];
    const { agent } = agentWith(
      { onEvent: () => () => undefined, get: () => ({ vmId: 'sb-1', sandboxId: 'sb-1' }) as never, destroy: async () => undefined },
      {},
      {
        serveExec: () => () => undefined,
        serveFile: () => () => undefined,
        consumeWork: async (f) => ((onWork = f as never), async () => undefined),
        publishHeartbeat: () => undefined,
        publishResult: async (r) => {
          if (!r.error) throw new ForkfleetError('resource_exhausted', '2000000 bytes is more than the NATS server\'s max_payload of 1048576 bytes');
          sent.push({ stepId: r.stepId, error: r.error });
        },
      },
    );
    await agent.start();
    let acked = false;
    await onWork!(work('destroy', { work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } }), ctlOf(() => void (acked = true)));
    expect(acked).toBe(true);
    expect(sent).toEqual([{ stepId: 'destroy', error: expect.objectContaining({ kind: 'resource_exhausted', retryable: false, message: expect.stringContaining('max_payload of 1048576 bytes') }) }]);
    await agent.stop();
  });

  it('stepResult_whosePublishFails_isPublishedAgainAfterABackoff_andTheWorkAckedOnlyThen_thoughASiblingOfItsBatchStillRuns', async () => {
    let onWork: ((w: ReturnType<typeof work>, ctl: WorkControl) => Promise<void>) | undefined;
    const tries: string[] = [];
    let release: () => void = () => undefined;
    const { agent } = agentWith(
      { onEvent: () => () => undefined, get: (id: string) => ({ vmId: id, sandboxId: id, state: 'running' }) as never, destroy: async () => undefined },
      { obtain: () => new Promise((_, reject) => (release = () => reject(new ForkfleetError('not_found', 'gone')))) },
      {
        serveExec: () => () => undefined,
        serveFile: () => () => undefined,
        consumeWork: async (f) => ((onWork = f as never), async () => undefined),
        publishHeartbeat: () => undefined,
        publishResult: async (r) => {
          tries.push(r.stepId);
          if (r.stepId === 'destroy' && tries.filter((t) => t === 'destroy').length <= 2) throw new ForkfleetError('deadline_exceeded', 'no PubAck within 5000 ms');
        },
      },
      undefined,
      new MemoryJournal(),
      'tcg',
      { resultRetryMs: 20 },
    );
    await agent.start();
    // One message carrying both (a batch): a slow restore and a destroy.
    const acks: string[] = [];
    const ctl = (step: string) => (ctlOf(() => void acks.push(step)));
    const slow = onWork!(work('restore', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-r' }] } } }), ctl('restore'));
    await onWork!(work('destroy', { work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } }), ctl('destroy'));
    // Published on its third try, 20 + 40 ms later, while the restore still runs.
    expect(tries).toEqual(['destroy', 'destroy', 'destroy']);
    expect(acks).toEqual(['destroy']);
    release();
    await slow;
    await agent.stop();
  });

  it('copiesOfARunningStep_takeNoStepSlot_soOtherStepsStillRun', async () => {
    let onWork: ((w: ReturnType<typeof work>, ctl: WorkControl) => Promise<void>) | undefined;
    let destroyed = false;
    const { agent } = agentWith(
      { onEvent: () => () => undefined, get: (id: string) => (id === 'sb-9' ? ({ vmId: id, sandboxId: id } as never) : undefined), destroy: async () => void (destroyed = true) },
      { obtain: () => new Promise<never>(() => undefined) },
      { serveExec: () => () => undefined, serveFile: () => () => undefined, consumeWork: async (f) => ((onWork = f as never), async () => undefined), publishHeartbeat: () => undefined, publishResult: async () => undefined },
    );
    await agent.start();
    const ctl = ctlOf();
    // A restore whose fetch does not end, and two more copies of it (re-sends of a slow step), with 3 slots.
    for (let i = 0; i < 3; i++) void onWork!(work('restore/h1', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } }), ctl);
    await Promise.race([onWork!(work('destroy', { work: { case: 'destroyVm', value: { sandboxId: 'sb-9' } } }), ctl), new Promise((r) => setTimeout(r, 2000))]);
    expect(destroyed).toBe(true);
    await agent.stop();
  });

  it('stepsThatHang_areAnsweredRetryableAtTheirDeadline_freeingTheirSlots_whileTheirRunGoesOn_andTheNextSendGetsItsResult', async () => {
    let onWork: ((w: ReturnType<typeof work>, ctl: WorkControl) => Promise<void>) | undefined;
    const results: Array<{ stepId: string; attempt: number; kind: string | undefined }> = [];
    let release: (e: Error) => void = () => undefined;
    const hung = new Promise<never>((_, reject) => (release = reject));
    hung.catch(() => undefined);
    let obtains = 0;
    let destroyed = false;
    const now = { now: () => Date.now() };
    const { agent } = agentWith(
      { onEvent: () => () => undefined, get: (id: string) => (id === 'sb-9' ? ({ vmId: id, sandboxId: id } as never) : undefined), destroy: async () => void (destroyed = true) },
      { obtain: () => (obtains++, hung) },
      {
        serveExec: () => () => undefined,
        serveFile: () => () => undefined,
        consumeWork: async (f) => ((onWork = f as never), async () => undefined),
        publishHeartbeat: () => undefined,
        publishResult: async (r) => void results.push({ stepId: r.stepId, attempt: r.attempt, kind: r.error?.kind }),
      },
      now,
      undefined,
      'tcg',
      { stepDeadlineFloorMs: 10 },
    );
    await agent.start();
    const ctl = ctlOf();
    const due = (ms: number) => timestampFromMs(Date.now() + ms);
    // Three restores whose fetch hangs take every slot (concurrency 3).
    const hanging = [0, 1, 2].map((i) => onWork!(work(`restore/${i}`, { deadline: due(100), work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: `sb-${i}` }] } } }), ctl));
    await Promise.race([Promise.all(hanging), new Promise((r) => setTimeout(r, 3000))]);
    expect(results.map((r) => r.kind)).toEqual(['deadline_exceeded', 'deadline_exceeded', 'deadline_exceeded']);
    // Their slots are free: an unrelated destroy runs.
    await Promise.race([onWork!(work('destroy', { deadline: due(1000), work: { case: 'destroyVm', value: { sandboxId: 'sb-9' } } }), ctl), new Promise((r) => setTimeout(r, 2000))]);
    expect(destroyed).toBe(true);
    // The scheduler's retry of the first waits for its run, which answers it once it ends; the fetch ran once.
    const retry = onWork!(work('restore/0', { attempt: 2, deadline: due(5000), work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-0' }] } } }), ctl);
    release(new ForkfleetError('not_found', 'snapshot sn-x is gone'));
    await retry;
    expect(results.at(-1)).toMatchObject({ stepId: 'restore/0', kind: 'not_found' });
    expect(obtains).toBe(3);
    await agent.stop();
  });

  it('stop_whoseWorkConsumerDoesNotStop_endsWithinTheGraceAllTheSame', async () => {
    // The consumer waits on NATS (a backoff, a reconnect): the grace counts from the stop, not from after it.
    const { agent } = agentWith(
      { onEvent: () => () => undefined },
      {},
      { serveExec: () => () => undefined, serveFile: () => () => undefined, consumeWork: async () => () => new Promise<void>(() => undefined), publishHeartbeat: () => undefined, publishResult: async () => undefined },
    );
    await agent.start();
    const t0 = Date.now();
    await agent.stop();
    expect(Date.now() - t0).toBeLessThan(2000);
  });

  it('stop_startsNoQueuedStepOnceCalled_givesItBackOnceDeliveryHasEnded_heartbeatsOnAsStopping_andResolvesOnlyOnceTheRunningStepsHaveFinished', async () => {
    let onWork: ((w: ReturnType<typeof work>, ctl: WorkControl) => Promise<void>) | undefined;
    let consumerEnded = false;
    const fetched: Array<() => void> = [];
    const asked: string[] = [];
    const answered: string[] = [];
    let created = 0;
    const { agent } = agentWith(
      {
        onEvent: () => () => undefined,
        get: (id) => void asked.push(id),
        fork: async (_s, clones) => clones.map((c) => ({ vmId: c.vmId, sandboxId: c.vmId, state: 'running', pid: 0, readyMs: 1 }) as VmInfo),
        create: async () => (created++, { vmId: 'sb-q', sandboxId: 'sb-q', state: 'running', pid: 1 } as VmInfo),
      },
      { obtain: () => new Promise((r) => fetched.push(() => r({ local: { dir: '/x', manifest: {} } as never, bytesFetched: 0 }))) },
      {
        serveExec: () => () => undefined,
        serveFile: () => () => undefined,
        // Ending the bus's consumer takes a while.
        consumeWork: async (f) => ((onWork = f as never), () => new Promise<void>((r) => setTimeout(() => r(void (consumerEnded = true)), 20))),
        publishHeartbeat: (hb) => void (beats++, hb.stopping && stoppingBeats++),
        publishResult: async (r) => void answered.push(r.stepId),
      },
      undefined,
      undefined,
      undefined,
      { shutdownGraceMs: 5_000, heartbeatMs: 10 },
    );
    let beats = 0;
    let stoppingBeats = 0;
    await agent.start();
    const ctl = ctlOf();
    // Three restores whose fetches wait fill the three slots; a create waits for one.
    for (let i = 0; i < 3; i++) void onWork!(work(`restore/${i}`, { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: `sb-${i}` }] } } }), ctl);
    let queuedAcked = false;
    let queuedReleased: string | undefined;
    const queued = onWork!(work('create', { work: { case: 'createVm', value: { vm: { sandboxId: 'sb-q' } } } }), { ack: () => void (queuedAcked = true), working: () => undefined, release: () => void (queuedReleased = consumerEnded ? 'after the consumer ended' : 'while work could still arrive') });
    await new Promise((r) => setTimeout(r, 10));
    expect(fetched.length).toBe(3);
    let stopped = false;
    const beatsAtStop = beats;
    const stopping = agent.stop().then(() => void (stopped = true));
    fetched[0]!(); // a slot frees while the consumer is still ending
    await new Promise((r) => setTimeout(r, 50));
    expect(answered).toEqual(['restore/0']);
    expect(stopped).toBe(false);
    // Heartbeats on, saying it stops, while the running steps finish: the scheduler places
    // no work here and does not take the host for lost.
    expect(beats).toBeGreaterThan(beatsAtStop);
    expect(stoppingBeats).toBe(beats - beatsAtStop);
    fetched[1]!();
    fetched[2]!();
    await stopping;
    const beatsAtEnd = beats;
    await new Promise((r) => setTimeout(r, 30));
    expect(beats).toBe(beatsAtEnd);
    expect(answered.sort()).toEqual(['restore/0', 'restore/1', 'restore/2']);
    // The create never ran: given back unacked (the bus delivers it again at once, to the
    // next agent), once this one's delivery had ended (else the bus could deliver it here again).
    expect([created, asked.includes('sb-q'), queuedAcked]).toEqual([0, false, false]);
    expect(queuedReleased).toBe('after the consumer ended');
    expect(await Promise.race([queued.then(() => 'settled'), new Promise((r) => setTimeout(() => r('pending'), 50))])).toBe('settled');
    // Work delivered while it stops is not taken.
    await onWork!(work('create-2', { work: { case: 'createVm', value: { vm: { sandboxId: 'sb-q' } } } }), ctl);
    expect(asked.includes('sb-q')).toBe(false);
  });

  it('stop_whenAPartOfTheAgentFailsToStop_stillStopsTheOthers_andRejectsNamingIt', async () => {
    const stopped: string[] = [];
    const { agent } = agentWith(
      { onEvent: () => () => void stopped.push('events') },
      {},
      {
        serveExec: () => () => void stopped.push('exec'),
        serveFile: () => () => {
          throw new Error('file relay: connection closed');
        },
        consumeWork: async () => async () => void stopped.push('work'),
        publishHeartbeat: () => undefined,
      },
    );
    await agent.start();
    await expect(agent.stop()).rejects.toThrow(/file relay: connection closed/);
    expect(stopped).toEqual(['work', 'exec', 'events']);
  });

  it('heartbeat_thatTheBusRefuses_isLogged_andTheAgentStartsAndBeatsOn_insteadOfEnding', async () => {
    vi.useFakeTimers();
    try {
      let beats = 0;
      const { agent } = agentWith(
        { onEvent: () => () => undefined },
        {},
        {
          serveExec: () => () => undefined,
          serveFile: () => () => undefined,
          consumeWork: async () => async () => undefined,
          // nats.js throws from publish: over max_payload, or the connection closed.
          publishHeartbeat: () => {
            beats++;
            throw Object.assign(new Error('MAX_PAYLOAD_EXCEEDED'), { code: 'MAX_PAYLOAD_EXCEEDED' });
          },
        },
      );
      await agent.start();
      expect(beats).toBe(1);
      await vi.advanceTimersByTimeAsync(3_000); // heartbeatMs 1000
      expect(beats).toBe(4);
      await agent.stop();
    } finally {
      vi.useRealTimers();
    }
  });

  it('execOrFileCall_forASandboxWhoseVmIsGone_isAFailedPreconditionOnSandboxId_notNotFound', async () => {
    let onFile: ((req: unknown) => Promise<{ error?: { kind: string; field: string } }>) | undefined;
    let onExec: ((req: unknown, emit: (o: { payload: { case: string; value: { kind: string; field: string } } }) => void) => Promise<void>) | undefined;
    const { agent } = agentWith(
      { onEvent: () => () => undefined },
      {},
      { serveExec: (f) => ((onExec = f as never), () => undefined), serveFile: (f) => ((onFile = f as never), () => undefined), consumeWork: async () => async () => undefined, publishHeartbeat: () => undefined },
    );
    await agent.start();
    try {
      const res = await onFile!({ sandboxId: 'sb-gone', path: '/tmp/f', op: { case: 'read', value: { maxBytes: 1n, offset: 0n } } });
      expect(res.error).toMatchObject({ kind: 'failed_precondition', field: 'sandbox_id' });
      const out: Array<{ payload: { case: string; value: { kind: string; field: string } } }> = [];
      await onExec!({ sandboxId: 'sb-gone', argv: ['true'], env: {}, cwd: '', stdin: new Uint8Array() }, (o) => void out.push(o));
      expect(out.at(-1)?.payload).toMatchObject({ case: 'error', value: { kind: 'failed_precondition', field: 'sandbox_id' } });
    } finally {
      await agent.stop?.();
    }
  });

  it('heartbeat_whileAnExecRunsInTheVm_reportsItNotIdle_andIdleOnlySinceTheExecEnded', async () => {
    const beats: Heartbeat[] = [];
    let now = 1_000;
    let onExec: ((req: unknown, emit: (o: unknown) => void) => Promise<void>) | undefined;
    let finishExec!: () => void;
    const running = { vmId: 'sb-1', sandboxId: 'sb-1', state: 'running', pid: 0, readyMs: 1, vcpus: 1, memoryMib: 256 } as VmInfo;
    const { agent } = agentWith(
      {
        list: () => [running],
        get: () => running,
        onEvent: () => () => undefined,
        // A command that waits (sleep, a slow download): no guest CPU while it runs.
        exec: () => new Promise((r) => (finishExec = () => r({ exitCode: 0, signal: 0, stdout: Buffer.alloc(0), stderr: Buffer.alloc(0) }))),
      },
      {},
      { serveExec: (f) => ((onExec = f as never), () => undefined), serveFile: () => () => undefined, consumeWork: async () => async () => undefined, publishHeartbeat: (hb) => void beats.push(hb) },
      { now: () => now },
    );
    await agent.start();
    try {
      const idleS = (): bigint | undefined => beats.at(-1)!.vms.find((v) => v.sandboxId === 'sb-1')?.idle?.seconds;
      const exec = onExec!({ sandboxId: 'sb-1', argv: ['/bin/sleep', '3600'], env: {}, cwd: '', stdin: new Uint8Array() }, () => undefined);
      now += 600_000;
      agent.heartbeat();
      expect(idleS()).toBe(0n);
      finishExec();
      await exec;
      now += 5_000;
      agent.heartbeat();
      expect(idleS()).toBe(5n);
    } finally {
      await agent.stop?.();
    }
  });

  it('heartbeat_ofAKvmHostWithNoVm_saysKvmWithTheHostCpuModel_soKvmSnapshotsCanBePlacedThere', () => {
    const beats: Heartbeat[] = [];
    const { agent } = agentWith({ list: () => [] }, {}, { publishHeartbeat: (hb) => void beats.push(hb) }, undefined, undefined, 'kvm');
    agent.heartbeat();
    expect([beats[0]?.accel, beats[0]?.cpuModel]).toEqual([ProtoAccel.KVM, 'host']);
  });

  it('heartbeat_afterLocalRestores_reportsItsSlotsAndTheMedianOfEachStepsFirstReadyChild', async () => {
    const beats: Heartbeat[] = [];
    let n = 0;
    // Steps whose first children were ready after 300, 100 and 200 ms (their siblings later).
    const ready = [[300, 900], [100], [200, 250]];
    const { agent } = agentWith(
      { fork: async (_s, clones) => clones.map((c, i) => ({ vmId: c.vmId, sandboxId: c.vmId, state: 'running', pid: 0, readyMs: ready[n]![i]! }) as VmInfo) },
      { obtain: async () => ({ local: { dir: '/x', manifest: {} } as never, bytesFetched: 0 }) },
      { publishHeartbeat: (hb) => void beats.push(hb) },
    );
    agent.heartbeat();
    expect(beats[0]).toMatchObject({ restoreSlots: 3, restoreCostMs: 0 });
    for (; n < ready.length; n++) {
      const vms = ready[n]!.map((_, i) => ({ sandboxId: `sb-${n}-${i}` }));
      const r = await agent.runStep(work(`restore/${n}`, { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms } } }));
      expect(r.error).toBeUndefined();
    }
    agent.heartbeat();
    expect(beats[1]).toMatchObject({ restoreSlots: 3, restoreCostMs: 200 });
  });

  it('heartbeat_ofASandboxWokenOrResumed_reportsItIdleSinceThen_notSinceItsEarlierVmWentIdle', async () => {
    const beats: Heartbeat[] = [];
    let now = 1_000;
    const vms = new Map<string, VmInfo>();
    const vm = (state: VmInfo['state']): VmInfo => ({ vmId: 'sb-1', sandboxId: 'sb-1', state, pid: 0, readyMs: 1, vcpus: 1, memoryMib: 256 }) as VmInfo;
    const { agent } = agentWith(
      {
        list: () => [...vms.values()],
        get: (id) => vms.get(id),
        fork: async (_s, clones) => clones.map(() => (vms.set('sb-1', vm('running')), vms.get('sb-1')!)),
        resume: async () => void vms.set('sb-1', vm('running')),
      },
      { obtain: async () => ({ local: { dir: '/x', manifest: {} } as never, bytesFetched: 0 }) },
      { publishHeartbeat: (hb) => void beats.push(hb) },
      { now: () => now },
    );
    const idleS = (): bigint | undefined => beats.at(-1)!.vms.find((v) => v.sandboxId === 'sb-1')?.idle?.seconds;
    vms.set('sb-1', vm('running'));
    agent.heartbeat();
    now += 600_000;
    agent.heartbeat();
    expect(idleS()).toBe(600n);
    // Hibernated (its VM destroyed), then woken on this host an hour later.
    vms.delete('sb-1');
    now += 3_600_000;
    expect((await agent.runStep(work('wake', { work: { case: 'restoreVms', value: { snapshotId: 'sn-h', vms: [{ sandboxId: 'sb-1' }] } } }))).error).toBeUndefined();
    agent.heartbeat();
    expect(idleS()).toBe(0n);
    // Paused for an hour, then resumed.
    vms.set('sb-1', vm('paused'));
    now += 3_600_000;
    expect((await agent.runStep(work('resume', { work: { case: 'resumeVm', value: { sandboxId: 'sb-1' } } }))).error).toBeUndefined();
    agent.heartbeat();
    expect(idleS()).toBe(0n);
  });

  it('heartbeat_whenTheHostsRestoresAreOlderThanTheirMaxAge_reportsNoCostSoPlacementTriesItAgain', async () => {
    const beats: Heartbeat[] = [];
    let now = 1_000;
    let n = 0;
    const ready = [5000, 6000, 100];
    const { agent } = agentWith(
      { fork: async (_s, clones) => clones.map((c) => ({ vmId: c.vmId, sandboxId: c.vmId, state: 'running', pid: 0, readyMs: ready[n]! }) as VmInfo) },
      { obtain: async () => ({ local: { dir: '/x', manifest: {} } as never, bytesFetched: 0 }) },
      { publishHeartbeat: (hb) => void beats.push(hb) },
      { now: () => now },
    );
    const restore = async (): Promise<void> => {
      expect((await agent.runStep(work(`restore/${n}`, { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: `sb-${n}` }] } } }))).error).toBeUndefined();
      n++;
    };
    // A slow spell: two slow restores.
    await restore();
    now += 60_000;
    await restore();
    agent.heartbeat();
    expect(beats.at(-1)!.restoreCostMs).toBe(5000); // the median (the lower middle of two)
    // Until the first is past the max age, both count; then only the second.
    now = 1_000 + RESTORE_SAMPLE_MAX_AGE_MS;
    agent.heartbeat();
    expect(beats.at(-1)!.restoreCostMs).toBe(5000);
    now = 1_000 + RESTORE_SAMPLE_MAX_AGE_MS + 1;
    agent.heartbeat();
    expect(beats.at(-1)!.restoreCostMs).toBe(6000);
    // Then none: the host reports no cost (placement prices it with its default).
    now = 1_000 + 60_000 + RESTORE_SAMPLE_MAX_AGE_MS + 1;
    agent.heartbeat();
    expect(beats.at(-1)!.restoreCostMs).toBe(0);
    // A new restore is its price again.
    await restore();
    agent.heartbeat();
    expect(beats.at(-1)!.restoreCostMs).toBe(100);
  });

  /**
   * An agent whose restores obtain a snapshot over the image `debian` built by `recipeHash` and
   * fork it (each fork noted in `o.order`), its heartbeats to `o.beats`; `extra` gives its
   * images. `restore(n)` runs op-n's restore of sb-n from sn-d.
   */
  function restoringOverDebian(recipeHash: string, extra: Partial<AgentDeps>, o: { order?: string[]; beats?: Heartbeat[] } = {}) {
    const { order, beats } = o;
    const { agent } = agentWith(
      { fork: async (_s, clones) => (order?.push('fork'), clones.map((c) => ({ vmId: c.vmId, sandboxId: c.vmId, state: 'running', pid: 0, readyMs: 1 }) as VmInfo)) },
      { obtain: async () => ({ local: { dir: '/x', manifest: { image: { name: 'debian', recipeHash, kernelArgs: '' } } } as never, bytesFetched: 0 }) },
      beats ? { publishHeartbeat: (hb) => void beats.push(hb) } : {},
      undefined,
      undefined,
      undefined,
      {},
      extra,
    );
    const restore = (n: number) => agent.runStep(create(HostWorkSchema, { opId: `op-${n}`, stepId: 'restore/h1', attempt: 1, work: { case: 'restoreVms', value: { snapshotId: 'sn-d', vms: [{ sandboxId: `sb-${n}` }] } } }));
    return { agent, restore };
  }

  it('restore_ofASnapshotWhoseImageThisHostHasNotBuilt_buildsItFirst_onceOnly_andHeartbeatsListTheBuilds', async () => {
    const asked: string[] = [];
    const order: string[] = [];
    const beats: Heartbeat[] = [];
    const { agent, restore } = restoringOverDebian(
      'r1',
      {
        images: async (name) => {
          asked.push(name);
          order.push(`image ${name}`);
          return { name, recipeHash: 'r1', diskSha256: `sha-of-${name}`, kernel: '', initrd: '', disk: '', diskVirtualSize: 1, kernelArgs: '', readyMarker: '' };
        },
      },
      { order, beats },
    );
    expect((await restore(1)).error).toBeUndefined();
    expect((await restore(2)).error).toBeUndefined();
    // Built before the first restore, and not looked for again.
    expect(order).toEqual(['image debian', 'fork', 'fork']);
    agent.heartbeat();
    expect(beats.at(-1)!.images.map((i) => [i.name, i.recipeHash, i.diskSha256])).toEqual([['debian', 'r1', 'sha-of-debian']]);
    expect(asked).toEqual(['debian']);
  });

  it('restore_ofASnapshotWhoseImageWasRemovedFromTheCacheSinceItWasBuilt_buildsItAgain_andHeartbeatsStopListingItIfThatFails', async () => {
    const order: string[] = [];
    const beats: Heartbeat[] = [];
    // The image cache as cachedImages lists it: what images() built, less what an operator removed.
    let cache: Array<{ name: string; recipeHash: string; diskSha256: string }> = [];
    let buildFails = false;
    let unreadable = false;
    const { agent, restore } = restoringOverDebian(
      'r1',
      {
        images: async (name) => {
          order.push(`image ${name}`);
          if (buildFails) throw new Error('mmdebstrap failed');
          cache = [{ name, recipeHash: 'r1', diskSha256: 'sha-1' }];
          return { name, recipeHash: 'r1', diskSha256: 'sha-1', kernel: '', initrd: '', disk: '', diskVirtualSize: 1, kernelArgs: '', readyMarker: '' };
        },
        // The listing leaves out an entry it cannot read (build.ts cachedImages).
        cachedImages: async () => (unreadable ? [] : cache),
        cachedImage: async (name, hash) => (unreadable ? 'unknown' : cache.some((i) => i.name === name && i.recipeHash === hash) ? 'whole' : 'missing'),
      },
      { order, beats },
    );
    const listed = (): string[] => (agent.heartbeat(), beats.at(-1)!.images.map((i) => `${i.name}-${i.recipeHash}`));
    expect((await restore(1)).error).toBeUndefined();
    expect((await restore(2)).error).toBeUndefined();
    expect(order).toEqual(['image debian', 'fork', 'fork']);
    // Removed by an operator: the next restore builds it again before restoring over it.
    cache = [];
    expect((await restore(3)).error).toBeUndefined();
    expect(order).toEqual(['image debian', 'fork', 'fork', 'image debian', 'fork']);
    expect(listed()).toEqual(['debian-r1']);
    // An entry that cannot be read now (EIO) is taken as there: not built again, still listed.
    unreadable = true;
    expect((await restore(5)).error).toBeUndefined();
    expect(order).toEqual(['image debian', 'fork', 'fork', 'image debian', 'fork', 'fork']);
    expect(listed()).toEqual(['debian-r1']);
    unreadable = false;
    // Removed again, and this time the build fails: no longer listed as built here.
    cache = [];
    buildFails = true;
    await restore(4);
    expect(order.slice(6)).toEqual(['image debian', 'fork']);
    expect(listed()).toEqual([]);
  });

  it('restore_ofASnapshotWhoseImageRecipeThisHostDoesNotHave_buildsNothing_andLooksOnlyOnce', async () => {
    const asked: string[] = [];
    const recipes: string[] = [];
    const { restore } = restoringOverDebian('theirs', {
      images: async (name) => (asked.push(name), { name, recipeHash: 'ours', diskSha256: 'x', kernel: '', initrd: '', disk: '', diskVirtualSize: 1, kernelArgs: '', readyMarker: '' }),
      imageRecipe: async (name) => (recipes.push(name), 'ours'),
    });
    for (const n of [1, 2, 3]) await restore(n);
    // Another recipe here (another kernel, other packages): a build would not be the snapshot's image.
    expect(asked).toEqual([]);
    expect(recipes).toEqual(['debian']);
  });

  it('heartbeats_listTheRecipeEachImageIsBuiltByHereNow_builtOrNot_besideOlderBuildsInTheCache', async () => {
    // Placement reads them: a snapshot over another recipe's build, which this agent would
    // refuse, is not placed here. An image whose recipe cannot be read here is left out.
    const beats: Heartbeat[] = [];
    const image = (name: string, recipeHash: string, diskSha256: string) => ({ name, recipeHash, diskSha256, kernel: '', initrd: '', disk: '', diskVirtualSize: 1, kernelArgs: '', readyMarker: '' });
    const { agent } = agentWith(
      { onEvent: () => () => undefined },
      {},
      { serveExec: () => () => undefined, serveFile: () => () => undefined, consumeWork: async () => async () => undefined, publishHeartbeat: (hb) => void beats.push(hb), publishResult: async () => undefined },
      undefined,
      undefined,
      undefined,
      {},
      {
        imageNames: ['tiny', 'debian', 'broken'],
        imageRecipe: async (name) => {
          if (name === 'broken') throw new Error('missing Debian packages');
          return name === 'tiny' ? 'tiny-now' : 'debian-now';
        },
        cachedImages: async () => [{ name: 'tiny', recipeHash: 'tiny-old', diskSha256: 'sha-old' }],
        images: async (name) => image(name, 'tiny-now', 'sha-now'),
      },
    );
    await agent.start();
    try {
      // The recipes are read and the default image found in the background of start().
      await vi.waitFor(() => {
        agent.heartbeat();
        expect(beats.at(-1)?.images ?? []).toHaveLength(3);
      });
      expect(beats.at(-1)!.images.map((i) => [i.name, i.recipeHash, i.diskSha256, i.current]).sort()).toEqual([
        ['debian', 'debian-now', '', true],
        ['tiny', 'tiny-now', 'sha-now', true],
        ['tiny', 'tiny-old', 'sha-old', false],
      ]);
    } finally {
      await agent.stop();
    }
  });
});
