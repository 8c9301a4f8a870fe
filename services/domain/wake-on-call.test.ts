// What Exec, ReadFile and WriteFile answer when the sandbox they name is hibernated (or being
// hibernated) and the wake they start for it does not succeed; and when a hibernate takes it
// after they read it running, so that its host refuses them before any of them ran.
import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import type { OperationError, OperationRec, SandboxRec } from './records.ts';
import type { FleetStore, WorkBus } from './ports.ts';
import { Fleet } from './fleet.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import { sandboxRecord } from '../testkit/records.ts';
import { HeartbeatSchema, HostExecOutputSchema, HostFileResponseSchema } from './messages.ts';
import type { HostExecOutputMsg, HostExecRequestMsg, HostFileRequestMsg } from './messages.ts';

/**
 * A Fleet over one sandbox (as `sandbox()` is now), whose operations all read as `op(id)`;
 * `submitted()`: wakes started (`onCommit` told of each). `bus`: the relay, to hosts h1 and h2
 * (heard, with ranged files).
 */
function fleetOver(sandbox: () => SandboxRec, op: (id: string) => Partial<OperationRec>, now: () => number = () => Date.now(), relay: { bus?: Partial<WorkBus>; onCommit?: () => void } = {}): { fleet: Fleet; submitted: () => number } {
  let n = 0;
  const store = {
    getIdempotent: async () => undefined,
    getSandbox: async () => ({ value: sandbox(), modRevision: 3 }),
    listSandboxes: async () => [{ value: sandbox(), modRevision: 3 }],
    listSnapshots: async () => [],
    listOps: async () => [],
    getOp: async (tenantId: string, id: string) => ({ value: { id, tenantId, kind: 'wake', error: null, ...op(id) }, modRevision: 4 }),
    watchOps: async () => () => undefined,
    commit: async () => {
      n++;
      relay.onCommit?.();
      return true;
    },
  } as unknown as FleetStore;
  const heard = new HeartbeatRegistry();
  for (const hostId of ['h1', 'h2']) heard.record(create(HeartbeatSchema, { hostId, seq: 1n, bootId: 'b', rangedFiles: true }), Date.now());
  const fleet = new Fleet({ store, bus: { maxPayload: 1 << 20, ...relay.bus } as WorkBus, clock: { now }, heard, liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 } });
  return { fleet, submitted: () => n };
}

const hibernated = (): SandboxRec => sandboxRecord({ state: 'hibernated', hostId: '', opId: '', updatedAt: 5 });
const failedWith = (error: OperationError) => (): Partial<OperationRec> => ({ state: 'failed', error });
const read = (f: Fleet): Promise<unknown> => f.readFile('t1', 'sb-a', '/etc/hostname', 1024);

describe('a call on a hibernated sandbox whose wake does not succeed', () => {
  it('answers_theWakesOwnKindAndRetryability_namingTheSandbox_soAWakeThatCanNeverSucceedIsNotRetried', async () => {
    // The hibernation snapshot is gone: a retry would start one more wake that fails the same way.
    const gone = fleetOver(hibernated, failedWith({ kind: 'not_found', message: 'snapshot sn-x not found', retryable: false, field: 'snapshot_id' }));
    await expect(read(gone.fleet)).rejects.toMatchObject({ kind: 'not_found', retryable: false, field: 'sandbox_id', message: expect.stringMatching(/^waking sandbox sb-a failed: snapshot sn-x not found/) });
    expect(gone.submitted()).toBe(1);
    // No host with room now: retryable, as the wake said.
    const full = fleetOver(hibernated, failedWith({ kind: 'resource_exhausted', message: 'no host has room', retryable: true }));
    await expect(read(full.fleet)).rejects.toMatchObject({ kind: 'resource_exhausted', retryable: true });
    // WriteFile names its header's field.
    await expect(full.fleet.writeFile('t1', 'sb-a', '/tmp/x', 0o644, new Uint8Array(1))).rejects.toMatchObject({ field: 'header.sandbox_id' });
  });

  it('neverRelays_anAuthenticationKindFromTheWake_asTheCallersOwn', async () => {
    const f = fleetOver(hibernated, failedWith({ kind: 'permission_denied', message: 'host refused', retryable: false }));
    await expect(read(f.fleet)).rejects.toMatchObject({ kind: 'internal', retryable: false });
  });

  it('isUnavailableAndRetryable_whenTheWakeWasCancelled_orStillRuns_orTheSandboxIsStillBeingHibernated', async () => {
    await expect(read(fleetOver(hibernated, () => ({ state: 'cancelled' })).fleet)).rejects.toMatchObject({ kind: 'unavailable', retryable: true });
    // A clock that moves 301 s per reading: the wait for the wake gives up at once.
    let t = 0;
    const slow = fleetOver(hibernated, () => ({ state: 'running' }), () => (t += 301_000));
    await expect(read(slow.fleet)).rejects.toMatchObject({ kind: 'unavailable', retryable: true, message: expect.stringMatching(/takes longer than expected/) });
    // Still hibernating once the wait for its hibernate ended: it will be hibernated, then woken.
    const hibernating = fleetOver(() => sandboxRecord({ state: 'hibernating', opId: 'op-h' }), () => ({ state: 'succeeded' }));
    await expect(read(hibernating.fleet)).rejects.toMatchObject({ kind: 'unavailable', retryable: true, message: expect.stringMatching(/still being hibernated/) });
    expect(hibernating.submitted()).toBe(0);
  });
});

/** The host agent's refusal of a call that reached a VM its hibernate had paused (the driver's InvalidVmStateError). */
const PAUSED = { kind: 'failed_precondition', message: 'vm vm-7 is paused; cannot exec', retryable: false, field: '' };
const exitOf = (seq: bigint): HostExecOutputMsg => create(HostExecOutputSchema, { seq, payload: { case: 'exit', value: { exitCode: 0 } } });
const errorOf = (info: typeof PAUSED): HostExecOutputMsg => create(HostExecOutputSchema, { seq: 1n, payload: { case: 'error', value: info } });

/**
 * Sandbox sb-a running on h1, taken by a hibernate when its first call reaches h1 (`hibernate`,
 * then it reads as `taken`), woken on h2 by the wake the call starts. `hosts`: where each exec
 * or file request went; `answer(n)`: what the n-th exec gets (the first: PAUSED).
 */
function racingHibernate(taken: SandboxRec = hibernated(), answer: (n: number, host: string) => HostExecOutputMsg[] = (n) => (n === 0 ? [errorOf(PAUSED)] : [exitOf(1n)])) {
  let sb = sandboxRecord({ updatedAt: 1 });
  const hosts: string[] = [];
  const hibernate = (): void => void (sb = taken);
  const bus: Partial<WorkBus> = {
    exec: async function* (hostId: string, _req: HostExecRequestMsg) {
      const n = hosts.push(hostId) - 1;
      if (n === 0) hibernate();
      yield* answer(n, hostId);
    },
    file: async (hostId: string, req: HostFileRequestMsg) => {
      hosts.push(hostId);
      if (hostId === 'h1') {
        hibernate();
        return create(HostFileResponseSchema, { error: { kind: 'failed_precondition', message: 'sandbox sb-a has no VM on host h1 any more (it is being recorded lost)', retryable: false, field: 'sandbox_id' } });
      }
      return create(HostFileResponseSchema, { data: Buffer.from('sb-a'), eof: true, bytesWritten: BigInt(req.op.case === 'write' ? req.op.value.data.length : 0) });
    },
  };
  // The hibernate ends (hibernated) when its operation is read; the wake's commit runs it on h2.
  const f = fleetOver(
    () => sb,
    (id) => {
      if (id === 'op-h' && sb.state === 'hibernating') sb = hibernated();
      return { state: 'succeeded' };
    },
    () => Date.now(),
    { bus, onCommit: () => void (sb = sandboxRecord({ hostId: 'h2', updatedAt: 9 })) },
  );
  return { ...f, hosts };
}

async function drain(it: AsyncIterable<HostExecOutputMsg>): Promise<string[]> {
  const got: string[] = [];
  for await (const m of it) got.push(m.payload.case ?? '');
  return got;
}

const execOf = (f: Fleet): AsyncIterable<HostExecOutputMsg> => f.exec({ tenantId: 't1', sandboxId: 'sb-a', argv: ['/bin/true'], env: {}, cwd: '', stdin: new Uint8Array(), timeoutMs: 1000 });

describe('a call whose host finds the VM paused or gone by a hibernate that took the sandbox after the call read it running', () => {
  it('exec_refusedBeforeItRan_waitsForTheHibernate_wakesTheSandbox_andIsSentAgainOnce', async () => {
    // Refused while the hibernate runs (hibernating): its end is waited for, then the wake.
    const r = racingHibernate(sandboxRecord({ state: 'hibernating', opId: 'op-h', updatedAt: 2 }));
    expect(await drain(execOf(r.fleet))).toEqual(['exit']);
    expect(r.hosts).toEqual(['h1', 'h2']);
    expect(r.submitted()).toBe(1);
    // Refused once it is hibernated already (the VM stopped): woken, sent again.
    const done = racingHibernate();
    expect(await drain(execOf(done.fleet))).toEqual(['exit']);
    expect(done.hosts).toEqual(['h1', 'h2']);
  });

  it('readFileAndWriteFile_refusedBeforeAnyOfItRan_wakeTheSandbox_andAreSentAgainOnce', async () => {
    const read = racingHibernate();
    expect(Buffer.from(await read.fleet.readFile('t1', 'sb-a', '/etc/hostname', 1024)).toString()).toBe('sb-a');
    expect(read.hosts).toEqual(['h1', 'h2']);
    const write = racingHibernate();
    expect(await write.fleet.writeFile('t1', 'sb-a', '/tmp/x', 0o644, new Uint8Array(3))).toBe(3);
    expect(write.hosts).toEqual(['h1', 'h2']);
  });

  it('isNeverSentAgain_onceItsHostHasAnsweredAnyOfIt_orForAnyOtherError', async () => {
    // Output came first: the command ran; the error is the host's, as before.
    const ran = racingHibernate(undefined, () => [create(HostExecOutputSchema, { seq: 1n, payload: { case: 'stdout', value: Buffer.from('x') } }), create(HostExecOutputSchema, { seq: 2n, payload: { case: 'error', value: PAUSED } })]);
    expect(await drain(execOf(ran.fleet))).toEqual(['stdout', 'error']);
    expect(ran.hosts).toEqual(['h1']);
    // The guest's own failure (it may have run in part).
    const broke = racingHibernate(undefined, () => [errorOf({ kind: 'failed_precondition', message: 'vm vm-7: guest agent channel closed while running exec', retryable: false, field: '' })]);
    expect(await drain(execOf(broke.fleet))).toEqual(['error']);
    expect(broke.hosts).toEqual(['h1']);
    // Refused again once woken, the woken record unchanged: the host's refusal, no third send.
    const twice = racingHibernate(undefined, () => [errorOf(PAUSED)]);
    expect(await drain(execOf(twice.fleet))).toEqual(['error']);
    expect(twice.hosts).toEqual(['h1', 'h2']);
    // A read whose first piece was answered: refused at its second, it is not read again (its pieces were held).
    let sb = sandboxRecord({ updatedAt: 1 });
    const pieces: bigint[] = [];
    const file = async (_h: string, req: HostFileRequestMsg) => {
      pieces.push(req.op.case === 'read' ? req.op.value.offset : -1n);
      if (pieces.length === 1) return create(HostFileResponseSchema, { data: new Uint8Array(512 << 10) });
      sb = hibernated();
      return create(HostFileResponseSchema, { error: { kind: 'failed_precondition', message: 'vm vm-7 is paused; cannot read a file', retryable: false } });
    };
    const part = fleetOver(() => sb, () => ({ state: 'succeeded' }), () => Date.now(), { bus: { file } });
    await expect(part.fleet.readFile('t1', 'sb-a', '/big', 1 << 20)).rejects.toMatchObject({ kind: 'failed_precondition', message: 'vm vm-7 is paused; cannot read a file' });
    expect(pieces).toEqual([0n, 512n << 10n]);
    expect(part.submitted()).toBe(0);
  });

  it('isTheHostsRefusal_whenTheRecordHasNotMovedYet_andFailedPreconditionNamingThePause_whenItsOwnerPausedIt', async () => {
    // Recorded running as it was read (the record catches up later: a pause, or a VM gone from
    // its host, being recorded): not sent again; the host's refusal is the answer, as before.
    const unmoved = racingHibernate(sandboxRecord({ updatedAt: 1 }));
    expect(await drain(execOf(unmoved.fleet))).toEqual(['error']);
    expect(unmoved.hosts).toEqual(['h1']);
    // Held by an operation (a drain moving it pauses its VM while the record says running):
    // it passes, so the caller is told to retry.
    const held = racingHibernate(sandboxRecord({ updatedAt: 1, opId: 'op-d' }));
    await expect(drain(execOf(held.fleet))).rejects.toMatchObject({ kind: 'unavailable', retryable: true, message: expect.stringMatching(/held by operation op-d/) });
    expect(held.hosts).toEqual(['h1']);
    // Refused for a while only (a snapshot of it under way): retryable, as it passes.
    const snapshotting = racingHibernate(sandboxRecord({ updatedAt: 1 }), () => [errorOf({ kind: 'unavailable', message: 'vm vm-7 is still being snapshotted after 30000 ms; cannot exec yet', retryable: true, field: '' })]);
    await expect(drain(execOf(snapshotting.fleet))).rejects.toMatchObject({ kind: 'unavailable', retryable: true, message: expect.stringMatching(/still being snapshotted/) });
    expect(snapshotting.hosts).toEqual(['h1']);
    // Paused by its owner meanwhile: the pause is the answer, as a call made after it gets.
    const paused = racingHibernate(sandboxRecord({ state: 'paused', updatedAt: 2 }));
    await expect(drain(execOf(paused.fleet))).rejects.toMatchObject({ kind: 'failed_precondition', field: 'sandbox_id', message: 'sandbox sb-a is paused; it must be running (ResumeSandbox resumes it)' });
    expect(paused.hosts).toEqual(['h1']);
    expect(paused.submitted()).toBe(0);
  });

  it('isTheHostsRefusal_notARetry_whenItsOwnersPauseHoldsTheSandbox', async () => {
    // The pause's step paused the VM, its final write (paused) to come: the hold does not pass
    // as a drain's does; a retry would fail on "paused". A call made a moment later gets that.
    const hosts: string[] = [];
    const exec = async function* (hostId: string): AsyncIterable<HostExecOutputMsg> {
      hosts.push(hostId);
      yield errorOf(PAUSED);
    };
    const pausing = fleetOver(() => sandboxRecord({ updatedAt: 1, opId: 'op-p' }), (id) => ({ kind: id === 'op-p' ? 'pause' : 'wake', state: 'running' }), () => Date.now(), { bus: { exec } });
    expect(await drain(execOf(pausing.fleet))).toEqual(['error']);
    expect(hosts).toEqual(['h1']);
    expect(pausing.submitted()).toBe(0);
  });
});

describe('a command whose guest connection drops while it runs', () => {
  /** Sandbox sb-a running on h1; its exec prints, then the host reports the guest connection closed, after `then` became the record. */
  function droppedUnder(then: SandboxRec, ops: Record<string, Partial<OperationRec>> = {}) {
    let sb = sandboxRecord({ hostId: 'h1', updatedAt: 1 });
    const bus: Partial<WorkBus> = {
      exec: async function* () {
        yield create(HostExecOutputSchema, { seq: 1n, payload: { case: 'stdout', value: Buffer.from('start\n') } });
        sb = then;
        yield errorOf({ kind: 'unavailable', message: 'guest agent connection closed', retryable: true, field: '' });
      },
    };
    const f = fleetOver(() => sb, (id) => ops[id] ?? {}, () => Date.now(), { bus });
    return async (): Promise<string> => {
      let last = '';
      for await (const m of execOf(f.fleet)) if (m.payload.case === 'error') last = `${m.payload.value.kind}: ${m.payload.value.message}`;
      return last.replace(/^unavailable: /, '');
    };
  }

  it('namesTheDrainHibernateOrDestroyThatTookItsSandbox_insteadOfAnErrorThatReadsAsALostHost', async () => {
    // An SRE's drain --migrate ended a running exec with only "guest agent connection closed".
    const moving = droppedUnder(sandboxRecord({ hostId: 'h1', opId: 'op-d', updatedAt: 2 }), { 'op-d': { kind: 'drain' } });
    expect(await moving()).toBe('sandbox sb-a is being moved off host h1 by drain op-d while the command ran: it may go on in the sandbox, but its output and exit status are lost (guest agent connection closed)');
    const moved = droppedUnder(sandboxRecord({ hostId: 'h2', updatedAt: 3 }));
    expect(await moved()).toMatch(/^sandbox sb-a was moved from host h1 to h2 while the command ran/);
    const hibernatedMeanwhile = droppedUnder(sandboxRecord({ state: 'hibernated', hostId: '', updatedAt: 3 }));
    expect(await hibernatedMeanwhile()).toMatch(/^sandbox sb-a was hibernated while the command ran/);
    // An eval harness could not tell its sandbox's TTL from a broken host.
    const expired = droppedUnder(sandboxRecord({ state: 'destroying', stateReason: 'ttl', hostId: 'h1', updatedAt: 3 }));
    expect(await expired()).toBe('failed_precondition: sandbox sb-a was destroyed (ttl) while the command ran: the command ended with it (guest agent connection closed)');
  });

  it('isTheHostsOwnError_whenNoOperationTookTheSandbox', async () => {
    expect(await droppedUnder(sandboxRecord({ hostId: 'h1', updatedAt: 1 }))()).toBe('guest agent connection closed');
  });
});
