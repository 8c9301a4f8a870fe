// The leader's operation executor. It carries out pending operations: places them with
// the pure placement library, commits the placement with revision guards (capacity is
// never double-booked), sends host steps over the WorkBus and records their results.
//
// Recovery: every decision is written to etcd before the step is sent, and steps are
// idempotent on the agents (keyed by op id + step id). A new leader re-runs every
// non-terminal operation: committed placements are not redone, sent steps are re-sent
// (the agent answers a repeat from its journal), and nothing is lost or duplicated.
import { create, fromBinary } from '@bufbuild/protobuf';
import type { Logger } from 'pino';
import type { Clock, FleetStore, StoreWrite, Versioned, WorkBus } from './ports.ts';
import type { HostAllocRec, HostRec, OperationError, OperationRec, ResourcesRec, SandboxRec, SandboxState, SnapshotRec } from './records.ts';
import { canTransition, isTerminal } from './records.ts';
import type { HostResultMsg, HostWorkMsg } from './messages.ts';
import { HostWorkSchema, VmSpecSchema } from './messages.ts';
import { fleetViewInput } from './fleet-view.ts';
import type { LivenessConfig , HeartbeatRegistry} from './fleet-view.ts';
import { ConflictError, HostStepError, NoCapacityError, NotFoundError, StepTimeoutError, WrongStateError } from './errors.ts';
import { buildFleetView, place, rngForRequest } from '../../scheduler/index.ts';
import type { PlacementConfig, PlacementRequest, PlacementResult } from '../../scheduler/index.ts';
import type { PlacementPrefs } from './fleet.ts';
import { newId } from './fleet.ts';
import { isForkfleetError } from '../../proto/errors.ts';
import { SnapshotManifestSchema } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { Accel } from '../../proto/gen/forkfleet/v1/common_pb.ts';
import type { SignedTicket } from '../../proto/gen/forkfleet/v1/transfer_pb.ts';

export interface ExecutorConfig {
  liveness: LivenessConfig;
  /** How long one host step may take before it is re-sent. */
  stepTimeoutMs: number;
  stepAttempts: number;
  chunkBytes: number;
  placement?: PlacementConfig;
}

/** The scheduler's signing key at work (host-agent/domain/tickets.ts). */
export interface Signer {
  /** A ticket for one destination to fetch one snapshot. */
  ticket(snapshotId: string, destinationHostId: string): SignedTicket;
  /** A signature over a manifest's exact bytes. */
  manifest(bytes: Uint8Array): { signature: Uint8Array; keyId: string };
}

export interface ExecutorDeps {
  store: FleetStore;
  bus: WorkBus;
  clock: Clock;
  log: Logger;
  heard: HeartbeatRegistry;
  signer: Signer;
  config: ExecutorConfig;
  /** Observability hook: every finished operation (adapters turn it into metrics). */
  onFinished?: (kind: OperationRec['kind'], ok: boolean, seconds: number) => void;
}

type Waiter = { resolve: (r: HostResultMsg | undefined) => void };

const ZERO: ResourcesRec = { vcpus: 0, memoryMib: 0, diskMib: 0 };

function addRes(a: ResourcesRec, b: ResourcesRec, sign: 1 | -1): ResourcesRec {
  return {
    vcpus: Math.max(0, a.vcpus + sign * b.vcpus),
    memoryMib: Math.max(0, a.memoryMib + sign * b.memoryMib),
    diskMib: Math.max(0, a.diskMib + sign * b.diskMib),
  };
}

function errorOf(e: unknown): OperationError {
  if (isForkfleetError(e)) return { kind: e.kind, message: e.message, retryable: e.retryable, ...(e.field ? { field: e.field } : {}) };
  return { kind: 'internal', message: e instanceof Error ? e.message : String(e), retryable: false };
}

function stepKey(opId: string, stepId: string): string {
  return `${opId}/${stepId}`;
}

export class Executor {
  private readonly running = new Map<string, Promise<void>>();
  private readonly waiters = new Map<string, Waiter>();
  /** Results that arrived before anyone waited for them (e.g. right after a failover). */
  private readonly early = new Map<string, HostResultMsg>();
  private stops: Array<() => void | Promise<void>> = [];
  private active = false;

  constructor(private readonly deps: ExecutorDeps) {}

  get log(): Logger {
    return this.deps.log;
  }

  /** Called when this replica becomes leader. */
  async start(): Promise<void> {
    this.active = true;
    const stopResults = await this.deps.bus.consumeResults((r, ack) => {
      this.onResult(r);
      ack();
    });
    this.stops.push(stopResults);
    this.stops.push(await this.deps.store.watchOps((op) => this.maybeRun(op)));
    for (const v of await this.deps.store.listOps({ activeOnly: true })) this.maybeRun(v.value);
    const t = setInterval(() => void this.reconcileHosts().catch((e: unknown) => this.log.warn({ err: e }, 'host reconcile failed')), 1000);
    this.stops.push(() => clearInterval(t));
  }

  async stop(): Promise<void> {
    this.active = false;
    for (const s of this.stops.splice(0)) await s();
    // Waiting runners would only time out: wake them so they end now; the next leader
    // re-runs their operations from etcd.
    for (const [k, w] of this.waiters) {
      this.waiters.delete(k);
      w.resolve(undefined);
    }
    await Promise.race([Promise.allSettled([...this.running.values()]), new Promise((r) => setTimeout(r, 2000))]);
  }

  onResult(r: HostResultMsg): void {
    const key = stepKey(r.opId, r.stepId);
    const w = this.waiters.get(key);
    if (w) {
      this.waiters.delete(key);
      w.resolve(r);
    } else {
      this.early.set(key, r);
      if (this.early.size > 10_000) this.early.delete(this.early.keys().next().value as string);
    }
  }

  private maybeRun(op: OperationRec): void {
    if (!this.active || isTerminal(op.state) || this.running.has(op.id)) return;
    const p = this.run(op.tenantId, op.id)
      .catch((e: unknown) => this.log.error({ err: e, opId: op.id }, 'operation runner crashed'))
      .finally(() => this.running.delete(op.id));
    this.running.set(op.id, p);
  }

  // ---------------------------------------------------------------- records

  private async updateOp(tenantId: string, id: string, mutate: (op: OperationRec) => void): Promise<OperationRec> {
    for (let i = 0; i < 20; i++) {
      const v = await this.deps.store.getOp(tenantId, id);
      if (!v) throw new NotFoundError('operation', id);
      const next = structuredClone(v.value);
      mutate(next);
      next.updatedAt = this.deps.clock.now();
      if (await this.deps.store.commit([{ kind: 'op', value: next, expectRevision: v.modRevision }])) return next;
    }
    throw new ConflictError(`operation ${id}`);
  }

  private async updateSandbox(tenantId: string, id: string, mutate: (sb: SandboxRec) => void, extra: (sb: SandboxRec, before: SandboxRec) => StoreWrite[] = () => []): Promise<SandboxRec> {
    for (let i = 0; i < 20; i++) {
      const v = await this.deps.store.getSandbox(tenantId, id);
      if (!v) throw new NotFoundError('sandbox', id);
      const next = structuredClone(v.value);
      mutate(next);
      if (!canTransition(v.value.state, next.state)) throw new WrongStateError('sandbox', id, v.value.state, `cannot become ${next.state}`);
      next.updatedAt = this.deps.clock.now();
      if (await this.deps.store.commit([{ kind: 'sandbox', value: next, expectRevision: v.modRevision }, ...extra(next, v.value)])) return next;
    }
    throw new ConflictError(`sandbox ${id}`);
  }

  /** Moves a sandbox to `state`, keeping the running-time clock and the host's booked capacity right. */
  private setState(sb: SandboxRec, state: SandboxState, now: number, reason = ''): void {
    if (sb.state === 'running' && state !== 'running' && sb.runningSince !== null) {
      sb.runningMsBefore += Math.max(0, now - sb.runningSince);
      sb.runningSince = null;
    }
    if (state === 'running' && sb.runningSince === null) sb.runningSince = now;
    sb.state = state;
    sb.stateReason = reason;
  }

  /** Releases the capacity a sandbox booked on its host (guarded read-modify-write). */
  private async releaseCapacity(hostId: string, res: ResourcesRec): Promise<void> {
    if (!hostId) return;
    for (let i = 0; i < 20; i++) {
      const a = await this.deps.store.getAlloc(hostId);
      const next: HostAllocRec = { hostId, allocated: addRes(a.value.allocated, res, -1), sandboxes: Math.max(0, a.value.sandboxes - 1) };
      if (await this.deps.store.commit([{ kind: 'alloc', value: next, expectRevision: a.modRevision }])) return;
    }
    throw new ConflictError(`capacity of host ${hostId}`);
  }

  private async finish(op: OperationRec, result: OperationRec['result'], error: OperationError | null): Promise<void> {
    await this.updateOp(op.tenantId, op.id, (o) => {
      o.state = error ? 'failed' : 'succeeded';
      o.result = result;
      o.error = error;
      o.progress.message = error ? error.message : 'done';
    });
    this.log.info({ opId: op.id, kind: op.kind, ok: !error, error: error?.message }, 'operation finished');
    this.deps.onFinished?.(op.kind, !error, (this.deps.clock.now() - op.createdAt) / 1000);
  }

  // ---------------------------------------------------------------- host steps

  /**
   * Sends one step to a host and waits for its result, re-sending on timeout (the agent
   * dedups by op + step). The step is recorded in the operation before it is sent.
   */
  private async step(op: OperationRec, stepId: string, hostId: string, work: HostWorkMsg['work'], timeoutMs = this.deps.config.stepTimeoutMs): Promise<HostResultMsg> {
    const key = stepKey(op.id, stepId);
    for (let attempt = 1; attempt <= this.deps.config.stepAttempts; attempt++) {
      const early = this.early.get(key);
      if (early) {
        this.early.delete(key);
        return this.checkResult(early, hostId, stepId);
      }
      await this.updateOp(op.tenantId, op.id, (o) => {
        o.steps[stepId] = { hostId, status: 'sent', attempt };
      });
      const result = new Promise<HostResultMsg | undefined>((resolve) => {
        const t = setTimeout(() => {
          this.waiters.delete(key);
          resolve(undefined);
        }, timeoutMs);
        this.waiters.set(key, {
          resolve: (r) => {
            clearTimeout(t);
            resolve(r);
          },
        });
      });
      const msg = create(HostWorkSchema, { opId: op.id, stepId, attempt, tenantId: op.tenantId, work });
      try {
        await this.deps.bus.sendWork(hostId, msg);
      } catch (e) {
        this.log.warn({ err: e, opId: op.id, stepId, hostId }, 'sending work failed; will retry');
      }
      const r = await result;
      if (!this.active) throw new StepTimeoutError(hostId, stepId, 0);
      if (r) {
        await this.updateOp(op.tenantId, op.id, (o) => {
          const s = o.steps[stepId];
          if (s) s.status = r.error ? 'failed' : 'done';
        });
        return this.checkResult(r, hostId, stepId);
      }
      this.log.warn({ opId: op.id, stepId, hostId, attempt }, 'host step timed out; re-sending');
    }
    throw new StepTimeoutError(hostId, stepId, timeoutMs * this.deps.config.stepAttempts);
  }

  private checkResult(r: HostResultMsg, hostId: string, stepId: string): HostResultMsg {
    if (r.error) throw new HostStepError(hostId, stepId, r.error.kind, r.error.message, r.error.retryable);
    return r;
  }

  // ---------------------------------------------------------------- placement

  private async placeAndBook(
    op: OperationRec,
    request: (view: ReturnType<typeof buildFleetView>) => PlacementRequest,
    records: (result: Extract<PlacementResult, { ok: true }>) => { perChild: ResourcesRec; writes: StoreWrite[] },
  ): Promise<Extract<PlacementResult, { ok: true }>> {
    for (let attempt = 0; attempt < 10; attempt++) {
      const now = this.deps.clock.now();
      const [hosts, allocs, snaps] = await Promise.all([this.deps.store.listHosts(), this.deps.store.listAllocs(), this.deps.store.listSnapshots(undefined)]);
      const allocMap = new Map<string, Versioned<HostAllocRec>>(allocs.map((a) => [a.value.hostId, a]));
      const revision = Math.max(0, ...hosts.map((h) => h.modRevision), ...allocs.map((a) => a.modRevision));
      const view = buildFleetView(
        fleetViewInput({
          hosts: hosts.map((h) => h.value),
          allocs: new Map([...allocMap].map(([k, v]) => [k, v.value])),
          heard: this.deps.heard,
          snapshots: snaps.map((s) => s.value),
          revision,
          now,
          liveness: this.deps.config.liveness,
          chunkBytes: this.deps.config.chunkBytes,
        }),
      );
      const req = request(view);
      const result = place(view, req, rngForRequest(`${op.id}/${attempt}`), this.deps.config.placement);
      if (!result.ok) throw new NoCapacityError(result.explanation.summary);
      const { perChild, writes } = records(result);
      // Book capacity on every chosen host, guarded by the alloc revisions this plan read.
      const perHost = new Map<string, number>();
      for (const p of result.placements) perHost.set(p.hostId, (perHost.get(p.hostId) ?? 0) + 1);
      const allocWrites: StoreWrite[] = [...perHost].map(([hostId, n]) => {
        const cur = allocMap.get(hostId);
        const base = cur?.value ?? { hostId, allocated: ZERO, sandboxes: 0 };
        let allocated = base.allocated;
        for (let i = 0; i < n; i++) allocated = addRes(allocated, perChild, 1);
        return { kind: 'alloc', value: { hostId, allocated, sandboxes: base.sandboxes + n }, expectRevision: cur?.modRevision ?? 0 };
      });
      if (await this.deps.store.commit([...allocWrites, ...writes])) return result;
      this.log.debug({ opId: op.id, attempt }, 'placement commit conflicted; re-planning');
    }
    throw new ConflictError('host capacity (too many concurrent placements)');
  }

  private prefs(p: PlacementPrefs | undefined): PlacementRequest['preferences'] {
    if (!p) return {};
    return {
      locality: p.locality,
      spread: p.spread,
      ...(p.maxPerHost ? { maxPerHost: p.maxPerHost } : {}),
      ...(p.hostId ? { pinnedHostId: p.hostId } : {}),
    };
  }

  // ---------------------------------------------------------------- operations

  private async run(tenantId: string, opId: string): Promise<void> {
    const v = await this.deps.store.getOp(tenantId, opId);
    if (!v || isTerminal(v.value.state)) return;
    let op = v.value;
    if (op.state === 'pending') op = await this.updateOp(tenantId, opId, (o) => (o.state = 'running'));
    try {
      switch (op.kind) {
        case 'create':
          return await this.runCreate(op);
        case 'fork':
          return await this.runFork(op);
        case 'snapshot':
          return await this.runSnapshot(op);
        case 'pause':
        case 'resume':
          return await this.runPauseResume(op);
        case 'destroy':
          return await this.runDestroy(op);
        case 'delete_snapshot':
          return await this.runDeleteSnapshot(op);
        default:
          return await this.finish(op, null, { kind: 'failed_precondition', message: `operation kind ${op.kind} is not supported by this scheduler version`, retryable: false });
      }
    } catch (e) {
      // Stepping down is not a failure: the next leader re-runs the operation.
      if (!this.active) return;
      this.log.warn({ err: e, opId: op.id, kind: op.kind }, 'operation failed');
      await this.finish(op, null, errorOf(e));
    }
  }

  private vmSpec(sb: SandboxRec): ReturnType<typeof create<typeof VmSpecSchema>> {
    return create(VmSpecSchema, {
      sandboxId: sb.id,
      hostname: sb.hostname,
      resources: { vcpus: sb.resources.vcpus, memoryMib: BigInt(sb.resources.memoryMib), diskMib: BigInt(sb.resources.diskMib) },
      network: { allowEgress: sb.allowEgress },
    });
  }

  private async runCreate(op: OperationRec): Promise<void> {
    const v = await this.deps.store.getSandbox(op.tenantId, op.targetId);
    if (!v) throw new NotFoundError('sandbox', op.targetId);
    let sb = v.value;
    if (sb.state === 'pending') {
      const prefs = (op.input as { placement?: PlacementPrefs }).placement;
      const sandboxRev = v.modRevision;
      const result = await this.placeAndBook(
        op,
        () =>
          sb.sourceSnapshotId
            ? { kind: 'restore', id: op.id, nowMs: this.deps.clock.now(), snapshotId: sb.sourceSnapshotId, overlayDiskMib: sb.resources.diskMib, preferences: this.prefs(prefs) }
            : { kind: 'create', id: op.id, nowMs: this.deps.clock.now(), resources: sb.resources, preferences: this.prefs(prefs) },
        (res) => {
          const next = structuredClone(sb);
          next.state = 'starting';
          next.hostId = res.placements[0]!.hostId;
          next.opId = op.id;
          next.updatedAt = this.deps.clock.now();
          sb = next;
          return { perChild: sb.resources, writes: [{ kind: 'sandbox', value: next, expectRevision: sandboxRev }] };
        },
      );
      await this.updateOp(op.tenantId, op.id, (o) => {
        o.result = { explanation: result.explanation };
        o.progress = { done: 0, total: 1, message: `booting on ${sb.hostId}`, bytesTransferred: 0 };
      });
    }
    if (sb.state !== 'starting') {
      // Already past this point (re-run after a failover).
      return this.finish(op, { sandboxIds: [sb.id] }, sb.state === 'running' ? null : { kind: 'failed_precondition', message: `sandbox is ${sb.state}`, retryable: false });
    }
    try {
      const work: HostWorkMsg['work'] = sb.sourceSnapshotId
        ? { case: 'restoreVms', value: { snapshotId: sb.sourceSnapshotId, vms: [this.vmSpec(sb)] } as never }
        : { case: 'createVm', value: { vm: this.vmSpec(sb), image: sb.image } as never };
      await this.step(op, 'create', sb.hostId, work);
    } catch (e) {
      await this.failSandbox(sb, e);
      throw e;
    }
    const now = this.deps.clock.now();
    await this.updateSandbox(sb.tenantId, sb.id, (s) => {
      this.setState(s, 'running', now);
      s.opId = '';
    });
    await this.finish(op, { sandboxIds: [sb.id] }, null);
  }

  private async failSandbox(sb: SandboxRec, e: unknown): Promise<void> {
    const now = this.deps.clock.now();
    const message = e instanceof Error ? e.message : String(e);
    const hostId = sb.hostId;
    await this.updateSandbox(sb.tenantId, sb.id, (s) => {
      this.setState(s, 'failed', now, message);
      s.opId = '';
    }).catch((err: unknown) => this.log.warn({ err, sandboxId: sb.id }, 'could not mark sandbox failed'));
    // A failed start holds no VM: the agent cleans up its own half-made VM in the step.
    await this.releaseCapacity(hostId, sb.resources);
  }

  private async runSnapshot(op: OperationRec): Promise<void> {
    const input = op.input as { snapshotId: string; pin?: boolean; keepLast?: number; retentionTtlMs?: number | null; labels?: Record<string, string> };
    const sn = await this.snapshotOf(op, op.targetId, input.snapshotId, input);
    await this.finish(op, { snapshotId: sn.id }, null);
  }

  /** Takes a snapshot of a live sandbox on its host and records it. Idempotent per snapshot id. */
  private async snapshotOf(op: OperationRec, sandboxId: string, snapshotId: string, opts: { pin?: boolean; keepLast?: number; retentionTtlMs?: number | null; labels?: Record<string, string> }): Promise<SnapshotRec> {
    const existing = await this.deps.store.getSnapshot(op.tenantId, snapshotId);
    if (existing?.value.state === 'ready') return existing.value;
    const sbv = await this.deps.store.getSandbox(op.tenantId, sandboxId);
    if (!sbv) throw new NotFoundError('sandbox', sandboxId);
    const sb = sbv.value;
    if (sb.state !== 'running' && sb.state !== 'paused') throw new WrongStateError('sandbox', sb.id, sb.state, 'only a running or paused sandbox can be snapshotted');
    const now = this.deps.clock.now();
    const rec: SnapshotRec = existing?.value ?? {
      id: snapshotId,
      tenantId: op.tenantId,
      state: 'creating',
      sourceSandboxId: sb.id,
      parentSnapshotId: sb.sourceSnapshotId,
      lineageId: sb.lineageId,
      createdAt: now,
      pinned: opts.pin ?? false,
      retentionTtlMs: opts.retentionTtlMs ?? null,
      keepLast: opts.keepLast ?? 0,
      logicalBytes: 0,
      storedBytes: 0,
      hostIds: [],
      vmConfig: null,
      labels: opts.labels ?? {},
      manifestSignature: '',
      manifestKeyId: '',
    };
    if (!existing) await this.deps.store.commit([{ kind: 'snapshot', value: rec, expectRevision: 0 }]);
    let r: HostResultMsg;
    try {
      r = await this.step(op, `snapshot/${snapshotId}`, sb.hostId, { case: 'snapshotVm', value: { sandboxId: sb.id, snapshotId, parentSnapshotId: sb.sourceSnapshotId } as never });
    } catch (e) {
      await this.deps.store.commit([{ kind: 'snapshot', value: { ...rec, state: 'failed' } }]);
      throw e;
    }
    const ready: SnapshotRec = { ...rec, state: 'ready', hostIds: [sb.hostId] };
    if (r.manifest && r.manifest.manifest.length > 0) {
      const sig = this.deps.signer.manifest(r.manifest.manifest);
      ready.manifestSignature = Buffer.from(sig.signature).toString('base64');
      ready.manifestKeyId = sig.keyId;
      const m = fromBinary(SnapshotManifestSchema, r.manifest.manifest);
      const vc = m.vmConfig;
      if (vc) {
        ready.vmConfig = {
          machine: vc.machine,
          memoryMib: Number(vc.memoryMib),
          vcpus: vc.vcpus,
          devices: vc.devices,
          qemuVersion: vc.qemuVersion,
          accel: vc.accel === Accel.KVM ? 'kvm' : 'tcg',
          cpuModel: vc.cpuModel,
          image: vc.image,
        };
      }
      let logical = 0;
      let stored = 0;
      for (const a of m.artifacts) {
        logical += Number(a.size);
        for (const c of a.chunks) stored += c.storedSize;
      }
      ready.logicalBytes = logical;
      ready.storedBytes = stored;
    }
    await this.deps.store.commit([{ kind: 'snapshot', value: ready }]);
    return ready;
  }

  private async runPauseResume(op: OperationRec): Promise<void> {
    const sbv = await this.deps.store.getSandbox(op.tenantId, op.targetId);
    if (!sbv) throw new NotFoundError('sandbox', op.targetId);
    const sb = sbv.value;
    const target: SandboxState = op.kind === 'pause' ? 'paused' : 'running';
    if (sb.state !== target) {
      if (sb.state !== 'running' && sb.state !== 'paused') throw new WrongStateError('sandbox', sb.id, sb.state, `cannot ${op.kind}`);
      await this.step(op, op.kind, sb.hostId, op.kind === 'pause' ? { case: 'pauseVm', value: { sandboxId: sb.id } as never } : { case: 'resumeVm', value: { sandboxId: sb.id } as never });
      const now = this.deps.clock.now();
      await this.updateSandbox(sb.tenantId, sb.id, (s) => this.setState(s, target, now));
    }
    await this.finish(op, { sandboxIds: [sb.id] }, null);
  }

  private async runDestroy(op: OperationRec): Promise<void> {
    const sbv = await this.deps.store.getSandbox(op.tenantId, op.targetId);
    if (!sbv) throw new NotFoundError('sandbox', op.targetId);
    const sb = sbv.value;
    if (sb.state === 'destroyed') return this.finish(op, { sandboxIds: [sb.id] }, null);
    const heldCapacity = ['starting', 'running', 'paused', 'hibernating', 'destroying'].includes(sb.state);
    if (sb.state !== 'destroying') await this.updateSandbox(sb.tenantId, sb.id, (s) => this.setState(s, 'destroying', this.deps.clock.now()));
    if (sb.hostId && sb.state !== 'lost') await this.step(op, 'destroy', sb.hostId, { case: 'destroyVm', value: { sandboxId: sb.id } as never });
    await this.updateSandbox(sb.tenantId, sb.id, (s) => {
      this.setState(s, 'destroyed', this.deps.clock.now());
      s.opId = '';
    });
    if (heldCapacity) await this.releaseCapacity(sb.hostId, sb.resources);
    await this.finish(op, { sandboxIds: [sb.id] }, null);
  }

  private async runDeleteSnapshot(op: OperationRec): Promise<void> {
    const v = await this.deps.store.getSnapshot(op.tenantId, op.targetId);
    if (!v) throw new NotFoundError('snapshot', op.targetId);
    const sn = v.value;
    if (sn.pinned) throw new WrongStateError('snapshot', sn.id, 'pinned', 'unpin it first');
    await this.deps.store.commit([{ kind: 'snapshot', value: { ...sn, state: 'deleting' } }]);
    await Promise.all(sn.hostIds.map((h) => this.step(op, `delete/${h}`, h, { case: 'deleteSnapshot', value: { snapshotId: sn.id } as never }).catch((e: unknown) => this.log.warn({ err: e, hostId: h }, 'snapshot delete on host failed'))));
    await this.deps.store.commit([{ kind: 'snapshot', value: { ...sn, state: 'deleted', hostIds: [] } }]);
    await this.finish(op, { snapshotId: sn.id }, null);
  }

  private async runFork(op: OperationRec): Promise<void> {
    const input = op.input as {
      snapshotId: string;
      sandboxId: string;
      count: number;
      childIds: string[];
      lineageId: string;
      placement?: PlacementPrefs;
      labels?: Record<string, string>;
      ttlMs?: number | null;
      forkSnapshotId?: string;
    };
    // 1. The snapshot: given, or taken now from the live sandbox (recorded so a re-run reuses it).
    let snapshotId = input.snapshotId || input.forkSnapshotId || '';
    if (!snapshotId) {
      const id = newId('sn');
      await this.updateOp(op.tenantId, op.id, (o) => {
        (o.input as { forkSnapshotId?: string }).forkSnapshotId = id;
        o.progress.message = 'snapshotting source';
      });
      snapshotId = (await this.snapshotOf(op, input.sandboxId, id, {})).id;
    }
    const snv = await this.deps.store.getSnapshot(op.tenantId, snapshotId);
    if (!snv || snv.value.state !== 'ready') throw new NotFoundError('snapshot', snapshotId);
    const sn = snv.value;
    const source = sn.sourceSandboxId ? (await this.deps.store.getSandbox(op.tenantId, sn.sourceSandboxId))?.value : undefined;
    const resources: ResourcesRec = source?.resources ?? { vcpus: sn.vmConfig?.vcpus ?? 1, memoryMib: sn.vmConfig?.memoryMib ?? 256, diskMib: 1024 };

    // 2. Placement, committed with the children's records in one transaction.
    const existing = await Promise.all(input.childIds.map((id) => this.deps.store.getSandbox(op.tenantId, id)));
    let children: SandboxRec[];
    let transfers: Array<{ sourceHostId: string; destinationHostId: string; wave: number }> = [];
    if (existing.every((e) => e === undefined)) {
      const now = this.deps.clock.now();
      let made: SandboxRec[] = [];
      const result = await this.placeAndBook(
        op,
        () => ({ kind: 'fork', id: op.id, nowMs: now, snapshotId, count: input.count, overlayDiskMib: resources.diskMib, preferences: this.prefs(input.placement) }),
        (res) => {
          made = res.placements.map((p) => {
            const id = input.childIds[p.childIndex]!;
            return {
              id,
              tenantId: op.tenantId,
              state: 'starting',
              stateReason: '',
              hostId: p.hostId,
              resources,
              image: source?.image ?? '',
              sourceSnapshotId: snapshotId,
              lineageId: input.lineageId,
              hostname: id,
              labels: input.labels ?? {},
              ttlMs: input.ttlMs ?? null,
              idleTimeoutMs: source?.idleTimeoutMs ?? null,
              allowEgress: source?.allowEgress ?? false,
              createdAt: now,
              updatedAt: now,
              runningMsBefore: 0,
              runningSince: null,
              hibernationSnapshotId: '',
              opId: op.id,
            } satisfies SandboxRec;
          });
          return { perChild: resources, writes: made.map((sb) => ({ kind: 'sandbox', value: sb, expectRevision: 0 }) as StoreWrite) };
        },
      );
      children = made;
      transfers = (result.transferPlan?.transfers ?? []).map((t) => ({ sourceHostId: t.sourceHostId, destinationHostId: t.destinationHostId, wave: t.wave }));
      await this.updateOp(op.tenantId, op.id, (o) => {
        (o.input as { transfers?: unknown }).transfers = transfers;
        o.result = { sandboxIds: children.map((c) => c.id), snapshotId, explanation: result.explanation };
        o.progress = { done: 0, total: children.length, message: 'restoring children', bytesTransferred: 0 };
      });
    } else {
      children = existing.filter((e): e is Versioned<SandboxRec> => e !== undefined).map((e) => e.value);
      transfers = ((op.input as { transfers?: typeof transfers }).transfers ?? []);
    }

    // 3. One restore step per host, in transfer waves: a host that fetches from another
    //    destination starts after that destination holds the snapshot.
    const byHost = new Map<string, SandboxRec[]>();
    for (const c of children) if (c.state === 'starting') byHost.set(c.hostId, [...(byHost.get(c.hostId) ?? []), c]);
    const sourceOf = new Map(transfers.map((t) => [t.destinationHostId, t.sourceHostId]));
    const hostRecs = new Map((await this.deps.store.listHosts()).map((h) => [h.value.id, h.value] as [string, HostRec]));
    const done = new Map<string, Promise<boolean>>();
    const runHost = (hostId: string): Promise<boolean> => {
      const existingRun = done.get(hostId);
      if (existingRun) return existingRun;
      const p = (async () => {
        const src = sourceOf.get(hostId);
        if (src && byHost.has(src)) await runHost(src).catch(() => false);
        const vms = (byHost.get(hostId) ?? []).map((c) => this.vmSpec(c));
        const fetch = src
          ? {
              snapshotId,
              sources: [src, ...sn.hostIds.filter((h) => h !== src && h !== hostId)].map((h) => ({ hostId: h, address: hostRecs.get(h)?.peerAddress ?? '' })),
              ticket: this.deps.signer.ticket(snapshotId, hostId),
              manifest: { signature: Buffer.from(sn.manifestSignature, 'base64'), keyId: sn.manifestKeyId },
            }
          : undefined;
        try {
          await this.step(op, `restore/${hostId}`, hostId, { case: 'restoreVms', value: { snapshotId, vms, ...(fetch ? { fetch } : {}) } as never });
        } catch (e) {
          for (const c of byHost.get(hostId) ?? []) await this.failSandbox(c, e);
          throw e;
        }
        const now = this.deps.clock.now();
        for (const c of byHost.get(hostId) ?? []) {
          await this.updateSandbox(c.tenantId, c.id, (s) => {
            this.setState(s, 'running', now);
            s.opId = '';
          });
        }
        if (fetch) await this.addHolder(op.tenantId, snapshotId, hostId);
        await this.updateOp(op.tenantId, op.id, (o) => {
          o.progress.done += vms.length;
        });
        return true;
      })();
      done.set(hostId, p);
      return p;
    };
    const outcomes = await Promise.allSettled([...byHost.keys()].map((h) => runHost(h)));
    const failed = outcomes.filter((o): o is PromiseRejectedResult => o.status === 'rejected');
    const final = await Promise.all(children.map((c) => this.deps.store.getSandbox(op.tenantId, c.id)));
    const runningIds = final.filter((f) => f?.value.state === 'running').map((f) => f!.value.id);
    const result = { sandboxIds: children.map((c) => c.id), snapshotId };
    if (failed.length > 0) {
      const first = errorOf(failed[0]!.reason);
      return this.finish(op, result, { ...first, message: `${runningIds.length} of ${children.length} children started; ${first.message}` });
    }
    await this.finish(op, result, null);
  }

  private async addHolder(tenantId: string, snapshotId: string, hostId: string): Promise<void> {
    for (let i = 0; i < 20; i++) {
      const v = await this.deps.store.getSnapshot(tenantId, snapshotId);
      if (!v || v.value.hostIds.includes(hostId)) return;
      if (await this.deps.store.commit([{ kind: 'snapshot', value: { ...v.value, hostIds: [...v.value.hostIds, hostId] }, expectRevision: v.modRevision }])) return;
    }
  }

  // ---------------------------------------------------------------- hosts

  /** Registers new hosts and moves silent ones to suspect, then lost (their sandboxes become lost). */
  async reconcileHosts(): Promise<void> {
    const now = this.deps.clock.now();
    const recs = new Map((await this.deps.store.listHosts()).map((h) => [h.value.id, h]));
    for (const heard of this.deps.heard.all()) {
      const hb = heard.hb;
      const cur = recs.get(hb.hostId);
      const state = now - heard.heardAt > this.deps.config.liveness.lostAfterMs ? 'lost' : now - heard.heardAt > this.deps.config.liveness.suspectAfterMs ? 'suspect' : 'ready';
      const next: HostRec = {
        id: hb.hostId,
        state,
        cordoned: cur?.value.cordoned ?? false,
        draining: cur?.value.draining ?? false,
        capacity: { vcpus: hb.capacity?.vcpus ?? 0, memoryMib: Number(hb.capacity?.memoryMib ?? 0n), diskMib: Number(hb.capacity?.diskMib ?? 0n) },
        accel: hb.accel === Accel.KVM ? 'kvm' : 'tcg',
        qemuVersion: hb.qemuVersion,
        cpuModel: hb.cpuModel,
        machine: hb.machine,
        peerAddress: hb.peerAddress,
        linkBytesPerSecond: Number(hb.linkBytesPerSecond),
        labels: cur?.value.labels ?? {},
        registeredAt: cur?.value.registeredAt ?? now,
        lastHeartbeatAt: cur?.value.lastHeartbeatAt ?? now,
        bootId: hb.bootId,
      };
      const changed = !cur || cur.value.state !== next.state || cur.value.bootId !== next.bootId || cur.value.peerAddress !== next.peerAddress || JSON.stringify(cur.value.capacity) !== JSON.stringify(next.capacity);
      // Heartbeat times are written only with a state change (or every 10 s), not per beat.
      if (changed || now - next.lastHeartbeatAt > 10_000) {
        next.lastHeartbeatAt = heard.heardAt;
        await this.deps.store.commit([{ kind: 'host', value: next, expectRevision: cur?.modRevision ?? 0 }]);
        if (cur && cur.value.state !== state) this.log.warn({ hostId: hb.hostId, from: cur.value.state, to: state }, 'host state changed');
        if (state === 'lost' && cur?.value.state !== 'lost') await this.markHostLost(hb.hostId);
      }
    }
  }

  private async markHostLost(hostId: string): Promise<void> {
    const now = this.deps.clock.now();
    for (const v of await this.deps.store.listSandboxes(undefined)) {
      const sb = v.value;
      if (sb.hostId !== hostId || !['running', 'paused', 'starting', 'hibernating'].includes(sb.state)) continue;
      await this.updateSandbox(sb.tenantId, sb.id, (s) => this.setState(s, 'lost', now, `host ${hostId} lost`)).catch(() => undefined);
      await this.releaseCapacity(hostId, sb.resources).catch(() => undefined);
    }
  }
}
