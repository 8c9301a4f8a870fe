// A migrating drain over a fleet that cannot take what it moves: what it sends hosts (no pause
// or snapshot for a sandbox no other host can take), the error it ends with (its kind by cause,
// the copies off named truthfully) and the progress it writes. The Executor as a leader's over
// an in-memory store of our own port (writes guarded by revision) and stub host steps.
import { describe, expect, it } from 'vitest';
import { create, toBinary } from '@bufbuild/protobuf';
import { HeartbeatSchema } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { SnapshotManifestSchema } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import { HostStepError } from './errors.ts';
import type { StoreWrite } from './ports.ts';
import type { HostRec, OperationRec, SandboxRec, SnapshotRec } from './records.ts';
import { leaderExecutor } from '../testkit/executor.ts';
import { writeKey } from './executor.ts';
import { sandboxRecord, snapshotRecord } from '../testkit/records.ts';

const NOW = 1_000_000;

const host = (id: string, o: { cordoned?: boolean; draining?: boolean; vcpus?: number } = {}): HostRec => ({
  id,
  state: 'ready',
  cordoned: o.cordoned ?? false,
  draining: o.draining ?? false,
  capacity: { vcpus: o.vcpus ?? 16, memoryMib: 16_384, diskMib: 100_000 },
  accel: 'tcg',
  qemuVersion: '8.2.2',
  cpuModel: 'max',
  machine: 'microvm',
  peerAddress: `${id}:7000`,
  linkBytesPerSecond: 1.25e9,
  labels: {},
  registeredAt: 0,
  lastHeartbeatAt: NOW,
  bootId: 'b',
});

interface Ran {
  /** Host steps sent: `<stepId>@<hostId>`. */
  steps: string[];
  /** Every op record written for the drain, in order. */
  opWrites: OperationRec[];
  final: OperationRec;
  sandboxes: Map<string, SandboxRec>;
}

/**
 * Drain op-d of host F (`migrate`), cordoned and draining, with `hosts` besides (each heard
 * now), the `sandboxes` and `snapshots` given; every host step answers at once (a snapshot
 * step with a manifest of a 1-vCPU microvm guest).
 */
async function drain(hosts: HostRec[], sandboxes: SandboxRec[], snapshots: SnapshotRec[] = [], migrate = true, o: { callsFor?: number; callGraceMs?: number; stopping?: string[]; ops?: OperationRec[]; snapshotMs?: number } = {}): Promise<Ran> {
  const op = { id: 'op-d', tenantId: 'admin', kind: 'drain', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'F', input: { migrate }, progress: { done: 0, total: 0, message: 'queued', bytesTransferred: 0 }, result: null, error: null, steps: {} } as unknown as OperationRec;
  const all = [host('F', { cordoned: true, draining: true }), ...hosts];
  let rev = 10;
  const recs = new Map<string, { value: unknown; rev: number }>();
  const put = (k: string, value: unknown): void => void recs.set(k, { value: structuredClone(value), rev });
  for (const h of all) put(`host/${h.id}`, h);
  for (const sb of sandboxes) put(`sandbox/${sb.tenantId}/${sb.id}`, sb);
  for (const sn of snapshots) put(`snapshot/${sn.tenantId}/${sn.id}`, sn);
  put(`op/admin/op-d`, op);
  for (const other of o.ops ?? []) put(`op/${other.tenantId}/${other.id}`, other);
  const get = <T>(k: string): { value: T; modRevision: number } | undefined => {
    const r = recs.get(k);
    return r && { value: structuredClone(r.value) as T, modRevision: r.rev };
  };
  const list = <T>(prefix: string): Array<{ value: T; modRevision: number }> => [...recs.keys()].filter((k) => k.startsWith(prefix)).map((k) => get<T>(k)!);
  // A check's key is the record's it guards.
  const keyOf = (w: StoreWrite): string => writeKey(w).replace(/^check\//, '');
  const opWrites: OperationRec[] = [];
  const store = {
    getHost: async (id: string) => get(`host/${id}`),
    getSandbox: async (t: string, id: string) => get(`sandbox/${t}/${id}`),
    listSandboxes: async () => list('sandbox/'),
    getSnapshot: async (t: string, id: string) => get(`snapshot/${t}/${id}`),
    listSnapshots: async () => list('snapshot/'),
    // The hibernates a drain without migrate submits end at once.
    getOp: async (t: string, id: string) => get(`op/${t}/${id}`) ?? (id.startsWith('op-__drain/') ? { value: { id, tenantId: t, state: 'succeeded' }, modRevision: 1 } : undefined),
    getAlloc: async (hostId: string) => get(`alloc/${hostId}`) ?? { value: { hostId, allocated: { vcpus: 0, memoryMib: 0, diskMib: 0 }, sandboxes: 0 }, modRevision: 0 },
    commitAt: async (ws: StoreWrite[]) => {
      for (const w of ws) if (w.expectRevision !== undefined && w.expectRevision !== (recs.get(keyOf(w))?.rev ?? 0)) return 0;
      rev++;
      for (const w of ws) {
        if (w.kind.startsWith('check-')) continue;
        put(keyOf(w), (w as { value: unknown }).value);
        if (w.kind === 'op') opWrites.push(structuredClone(w.value as OperationRec));
      }
      return rev;
    },
  };
  const heard = new HeartbeatRegistry();
  for (const h of all) heard.record(create(HeartbeatSchema, { hostId: h.id, bootId: 'b', stopping: o.stopping?.includes(h.id) ?? false }), NOW);
  // `callsFor`: how many of a drain's pauses unless calls the host refuses (a call runs in the VM).
  let callsLeft = o.callsFor ?? 0;
  const t0 = Date.now();
  const ex = leaderExecutor(store, { ...(o.callGraceMs !== undefined ? { config: { liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 }, stepTimeoutMs: 1000, stepAttempts: 1, chunkBytes: 1 << 18, drainCallGraceMs: o.callGraceMs }, clock: { now: () => NOW + Date.now() - t0 } } : {}), heard, signer: { manifest: () => ({ signature: new Uint8Array([1]), keyId: 'k' }), ticket: () => ({}) } as never, submit: async (tenantId, key, kind) => ({ id: `op-${key}`, tenantId, kind, state: 'pending' }) as unknown as OperationRec });
  const inner = ex as unknown as {
    ops: Map<string, { value: OperationRec; modRevision: number }>;
    running: Map<string, Promise<void>>;
    cache: { hosts: Map<string, unknown> };
    step: (op: OperationRec, stepId: string, hostId: string, work: { case: string; value: { snapshotId?: string; unlessCalls?: boolean } }) => Promise<unknown>;
    runDrain(op: OperationRec): Promise<void>;
  };
  for (const h of all) inner.cache.hosts.set(h.id, { value: h, modRevision: 10 });
  inner.ops.set(op.id, { value: op, modRevision: 10 });
  // Run as the leader runs it: its own op writes keep the leader's copy current.
  inner.running.set(op.id, new Promise<void>(() => undefined));
  const steps: string[] = [];
  inner.step = async (_op, stepId, hostId, work) => {
    steps.push(`${stepId}@${hostId}`);
    if (work.case === 'pauseVm' && work.value.unlessCalls && callsLeft > 0) {
      callsLeft--;
      throw new HostStepError(hostId, stepId, 'failed_precondition', 'sandbox has 1 call(s) running (exec or file); not paused for the move yet', false, 'unless_calls');
    }
    if (work.case !== 'snapshotVm') return { vms: [] };
    if (o.snapshotMs) await new Promise((r) => setTimeout(r, o.snapshotMs));
    const manifest = create(SnapshotManifestSchema, { snapshotId: work.value.snapshotId!, tenantId: 't1', vmConfig: { machine: 'microvm', memoryMib: 256n, vcpus: 1, qemuVersion: '8.2.2', cpuModel: 'max' }, chunkSize: 1 << 18 });
    return { vms: [], manifest: { manifest: toBinary(SnapshotManifestSchema, manifest) } };
  };
  await inner.runDrain(op);
  const final = get<OperationRec>('op/admin/op-d')!.value;
  return { steps, opWrites, final, sandboxes: new Map(list<SandboxRec>('sandbox/').map((v) => [v.value.id, v.value])) };
}

describe('A migrating drain', () => {
  it('ofASandboxNoOtherHostCanTake_sendsItNoPauseOrSnapshot_andStillMovesOneAHostCanTake', async () => {
    // T has 4 vCPUs: room for SMALL (1), none for BIG (8).
    const big = sandboxRecord({ id: 'BIG', hostId: 'F', resources: { vcpus: 8, memoryMib: 256, diskMib: 1024 } });
    const small = sandboxRecord({ id: 'SMALL', hostId: 'F' });
    const r = await drain([host('T', { vcpus: 4 })], [big, small]);
    expect(r.steps.filter((s) => s.includes('/BIG/'))).toEqual([]);
    expect(r.steps.filter((s) => s.includes('/SMALL/'))).toEqual(['migrate/SMALL/pause-unless-calls/0@F', 'migrate/SMALL/restore@T', 'migrate/SMALL/destroy-source@F']);
    // One snapshot taken: SMALL's (BIG's would be a second).
    expect(r.steps.filter((s) => s.startsWith('snapshot/'))).toHaveLength(1);
    expect(r.sandboxes.get('SMALL')).toMatchObject({ hostId: 'T', state: 'running', opId: '' });
    expect(r.sandboxes.get('BIG')).toMatchObject({ hostId: 'F', state: 'running', opId: '' });
    expect(r.final.state).toBe('failed');
    expect(r.final.error).toMatchObject({ kind: 'resource_exhausted', retryable: true });
    expect(r.final.error?.message).toMatch(/^moved 1 of 2 sandboxes off F; BIG: no other host can take it now \(insufficient_vcpu=1\); it was not paused or snapshotted$/);
  });

  it('thatNoHostCanTakeAnything_endsAsAFailedPrecondition_namingTheSnapshotsACordonedHostAlsoHoldsSo', async () => {
    // G is cordoned but live: no sandbox can go there, and no snapshot copy; sn-u is on G too.
    const sns = [snapshotRecord({ id: 'sn-u', hostIds: ['F', 'G'] }), snapshotRecord({ id: 'sn-v', hostIds: ['F'] })];
    const r = await drain([host('G', { cordoned: true })], [sandboxRecord({ id: 'S1', hostId: 'F' })], sns);
    expect(r.steps).toEqual([]);
    expect(r.final.error).toMatchObject({ kind: 'failed_precondition', retryable: false });
    const msg = r.final.error?.message ?? '';
    expect(msg).toContain('S1: no other host can take it now (cordoned=1); it was not paused or snapshotted');
    expect(msg).toContain('no uncordoned host is ready to take a copy of the 2 snapshots held only by F and cordoned or draining hosts: sn-u (also on G), sn-v');
    expect(msg).not.toMatch(/sn-u is only on F/);
  });

  it('whoseSnapshotsNoHostCanTakeACopyOf_endsAsAFailedPrecondition_notInternal_inOneTruthfulLine', async () => {
    // Nothing to move; sn-u is also on G, which is cordoned but live, sn-v on F alone.
    const sns = [snapshotRecord({ id: 'sn-u', hostIds: ['F', 'G'] }), snapshotRecord({ id: 'sn-v', hostIds: ['F'] })];
    const r = await drain([host('G', { cordoned: true })], [], sns);
    expect(r.final.error).toEqual({ kind: 'failed_precondition', retryable: false, message: 'moved 0 of 0 sandboxes off F; no uncordoned host is ready to take a copy of the 2 snapshots held only by F and cordoned or draining hosts: sn-u (also on G), sn-v' });
  });

  it('writesItsProgress_asEachSandboxEnds_andEndsWithTheSameTotal', async () => {
    const big = sandboxRecord({ id: 'BIG', hostId: 'F', resources: { vcpus: 8, memoryMib: 256, diskMib: 1024 } });
    const r = await drain([host('T', { vcpus: 4 })], [big, sandboxRecord({ id: 'SMALL', hostId: 'F' })]);
    const seen = r.opWrites.map((o) => `${o.progress.done}/${o.progress.total} ${o.progress.message}`);
    const distinct = seen.filter((s, i) => s !== seen[i - 1]);
    expect(distinct.slice(0, 4)).toEqual([
      '0/2 moved 0 of 2 sandboxes off F',
      '0/2 moved 0 of 2 sandboxes off F (1 could not be)',
      '1/2 moved 1 of 2 sandboxes off F (1 could not be)',
      '1/2 moved 1 of 2 sandboxes off F (1 could not be); copying off the snapshots no uncordoned host holds',
    ]);
    expect(r.final.progress).toMatchObject({ done: 1, total: 2 });
  });
});

describe('A hibernating drain', () => {
  it('writesItsProgress_asEachHibernateEnds_andEndsWithTheSameTotal', async () => {
    const r = await drain([host('T')], [sandboxRecord({ id: 'S1', hostId: 'F' }), sandboxRecord({ id: 'S2', hostId: 'F' })], [], false);
    const seen = r.opWrites.map((o) => `${o.progress.done}/${o.progress.total}`);
    expect(seen).toContain('0/2');
    expect(seen).toContain('1/2');
    expect(r.final.progress).toMatchObject({ done: 2, total: 2 });
  });
});

describe('A migrating drain, a sandbox with calls running', () => {
  it('waitsForItsCallsToEnd_beforeItPausesIt_askingAgainEachSecond', async () => {
    // A drain --migrate paused a VM under a running exec: its caller's stream was cut.
    const r = await drain([host('T')], [sandboxRecord({ id: 'S1', hostId: 'F' })], [], true, { callsFor: 2 });
    expect(r.steps.filter((s) => s.includes('/S1/'))).toEqual(['migrate/S1/pause-unless-calls/0@F', 'migrate/S1/pause-unless-calls/1@F', 'migrate/S1/pause-unless-calls/2@F', 'migrate/S1/restore@T', 'migrate/S1/destroy-source@F']);
    expect(r.final.state).toBe('succeeded');
  });

  it('whoseCallsOutlastTheGrace_isPausedAllTheSame_andMoved_theGraceBeingOneForTheWholeDrain', async () => {
    // Moved one after another: a grace per sandbox would add up to N x 60 s.
    const r = await drain([host('T')], [sandboxRecord({ id: 'S1', hostId: 'F' }), sandboxRecord({ id: 'S2', hostId: 'F' })], [], true, { callsFor: 1000, callGraceMs: 1500 });
    const s1 = r.steps.filter((s) => s.includes('/S1/'));
    expect(s1.filter((s) => s.includes('pause-unless-calls')).length).toBeGreaterThanOrEqual(2);
    expect(s1.slice(-3)).toEqual(['migrate/S1/pause@F', 'migrate/S1/restore@T', 'migrate/S1/destroy-source@F']);
    // The grace spent on S1: S2 is paused at once.
    expect(r.steps.filter((s) => s.includes('/S2/'))).toEqual(['migrate/S2/pause@F', 'migrate/S2/restore@T', 'migrate/S2/destroy-source@F']);
    expect(r.final.state).toBe('succeeded');
  });

  it('spendsItsGraceOnlyOnWaiting_soAMoveThatTookLong_leavesTheNextSandboxItsAsk', async () => {
    // S1 waits 1 s for a call, then its snapshot takes 1.6 s: longer than the 1.5 s grace.
    const r = await drain([host('T')], [sandboxRecord({ id: 'S1', hostId: 'F' }), sandboxRecord({ id: 'S2', hostId: 'F' })], [], true, { callsFor: 1, callGraceMs: 1500, snapshotMs: 1600 });
    expect(r.steps.filter((s) => s.includes('/S2/'))[0]).toBe('migrate/S2/pause-unless-calls/0@F');
  });
});

describe('A migrating drain that could not do it all', () => {
  it('whoseOnlyUncordonedHostIsRestartingItsAgent_endsUnavailableAndRetryable_notAFailedPrecondition', async () => {
    // G can take work again in seconds: a drain run again then copies sn-v there.
    const r = await drain([host('G')], [], [snapshotRecord({ id: 'sn-v', hostIds: ['F'] })], true, { stopping: ['G'] });
    expect(r.final.error).toMatchObject({ kind: 'unavailable', retryable: true, message: expect.stringContaining('sn-v') });
  });

  it('ofASandboxAnotherOperationHolds_endsRetryable_asItsMessageSaysToRunItAgain', async () => {
    // A user's snapshot of S1 holds it: the drain moves it when run again.
    const snap = { id: 'op-s', tenantId: 't1', kind: 'snapshot', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'S1', input: {}, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps: {} } as unknown as OperationRec;
    const r = await drain([host('T')], [sandboxRecord({ id: 'S1', hostId: 'F', opId: 'op-s' })], [], true, { ops: [snap] });
    expect(r.final.error).toMatchObject({ kind: 'unavailable', retryable: true, message: expect.stringContaining('op-s') });
  });
});
