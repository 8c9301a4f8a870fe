// Scenarios against the public gRPC API. Latency = from the API call until the child (or the
// resumed sandbox) answers an exec. Children are destroyed between samples.
import { createClient } from '../services/adapters/grpc/rpc.ts';
import { fleetChannelCredentials, fleetChannelOptions } from '../services/adapters/grpc/tls.ts';
import { resolveClientCredentials } from '../services/auth/client-credentials.ts';
import type { Client } from '../services/adapters/grpc/rpc.ts';
import { FleetService, OperationKind, OperationState } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { Operation, Sandbox, Snapshot } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import { Locality, Spread } from '../proto/gen/forkfleet/v1/common_pb.ts';
import { setupScript } from './workload.ts';
import { phasesOf } from './phases.ts';
import type { OpPhases } from './phases.ts';
import { RunStopped } from './interrupt.ts';

export type Api = Client<(typeof FleetService)['method']>;
export const TENANT = 'loadtest';
let keyN = 0;
const key = (): string => `lt-${process.pid}-${Date.now()}-${keyN++}`;

export class OpFailed extends Error {
  constructor(message: string, readonly notSupported: boolean) {
    super(message);
    this.name = 'OpFailed';
  }
}

/**
 * A TLS client of the API at `addr`. Credential and CA: `credentialsFile` (a fleet's
 * credentials.json, admin: it acts for tenant TENANT), else FF_TOKEN / FF_CA / FF_CREDENTIALS
 * (services/auth/client-credentials.ts).
 */
export function connect(addr: string, credentialsFile?: string): Api {
  const creds = resolveClientCredentials(credentialsFile ? { credentialsFile } : {});
  return createClient(FleetService, addr, fleetChannelCredentials(creds), fleetChannelOptions(addr));
}

/**
 * Label key of every sandbox a run creates (the value is the run's `Ledger.run`): tidy() finds by
 * it what no answer named, such as the children of a fork under way at Ctrl-C.
 */
export const RUN_LABEL = 'loadtest-run';
/** Label key of one create or fork call (the value is its idempotency key): what that call made, should it fail. */
export const CALL_LABEL = 'loadtest-call';

/** What a run has made and not yet undone: destroyed (and uncordoned) at its end, also after a failed sample or a Ctrl-C. */
export interface Ledger {
  /** The RUN_LABEL value of this run's sandboxes. */
  run: string;
  sandboxes: Set<string>;
  cordoned: Set<string>;
  /** Creates and forks under way (operation ids): tidy() cancels them. */
  ops: Set<string>;
  /**
   * Sandboxes whose destroy failed twice (id to the last error): still on the fleet, taking its
   * CPU under the samples that follow. A later destroy that succeeds removes one. A subset of `sandboxes`.
   */
  undestroyed: Map<string, string>;
  /**
   * Aborted when the run stops (Ctrl-C): no create, fork or host cordon starts after it, and
   * waits for operations and execs end at once. Clean-up (cancel, destroy, uncordon) ignores it.
   */
  signal: AbortSignal | undefined;
}

export function newLedger(signal?: AbortSignal): Ledger {
  return { run: `lt-${process.pid}-${Date.now()}`, sandboxes: new Set(), cordoned: new Set(), ops: new Set(), undestroyed: new Map(), signal };
}

/** Where a fork's children must be, relative to the hosts that held its snapshot just before it. */
export interface PlacementWant {
  /** Snapshot.host_ids read before the fork. */
  holders: readonly string[];
  /** `holder`: LOCALITY_SAME_HOST; `non-holder`: LOCALITY_CROSS_HOST. */
  on: 'holder' | 'non-holder';
}

/** Why the children are not where `want` says (undefined when they all are): a sample placed so measures something else. */
export function misplaced(want: PlacementWant, children: ReadonlyArray<{ id: string; hostId: string }>): string | undefined {
  const held = new Set(want.holders);
  const bad = children.filter((c) => held.has(c.hostId) !== (want.on === 'holder'));
  if (bad.length === 0) return undefined;
  const where = want.on === 'holder' ? 'a host that did not hold' : 'a host that already held';
  return `fork placed ${bad.length} of ${children.length} children on ${where} the snapshot (${bad.map((c) => `${c.id} on ${c.hostId || 'no host'}`).join(', ')}; holders before the fork: ${want.holders.join(', ') || 'none'})`;
}

/** Children per host, holders of the snapshot marked: "h1 2 (holder), h2 2, h3 2". */
export function childrenPerHost(children: ReadonlyArray<{ hostId: string }>, holders: readonly string[]): string {
  const n = new Map<string, number>();
  for (const c of children) n.set(c.hostId, (n.get(c.hostId) ?? 0) + 1);
  return [...n].sort(([a], [b]) => a.localeCompare(b)).map(([h, k]) => `${h || 'no host'} ${k}${holders.includes(h) ? ' (holder)' : ''}`).join(', ');
}

export class Driver {
  /** Takes the breakdown of each timed operation (fork, resume, restore) with its kind, when set. */
  phaseSink: ((kind: OperationKind, p: OpPhases) => void) | undefined;

  /** `ledger`: shared by the drivers of one run (one for timed calls, one for setup). */
  constructor(readonly api: Api, readonly opTimeoutMs: number, readonly ledger: Ledger = newLedger()) {}

  /** Throws RunStopped once the run stops: what would start something (a create, fork or cordon) checks first. */
  private check(what: string): void {
    if (this.ledger.signal?.aborted) throw new RunStopped(what);
  }

  /** Hands the sink a timed op's breakdown: `opAt` when the API answered it done, `readyAt` when its last sandbox answered an exec. */
  private phases(op: Operation, opAt: number, readyAt: number): void {
    const p = this.phaseSink && phasesOf(op, readyAt - opAt);
    if (p) this.phaseSink!(op.kind, p);
  }

  /** Waits for `op`; `abortable`: a stop of the run ends the wait at once (RunStopped), the operation goes on. */
  async done(op: Operation, abortable = true): Promise<Operation> {
    const signal = abortable ? this.ledger.signal : undefined;
    let f: Operation;
    try {
      f = await this.api.waitOperation({ tenantId: TENANT, operationId: op.id, timeout: { seconds: BigInt(Math.ceil(this.opTimeoutMs / 1000)) } }, { timeoutMs: this.opTimeoutMs + 10_000, ...(signal ? { signal } : {}) });
    } catch (e) {
      if (signal?.aborted) throw new RunStopped(`waiting for operation ${op.id}`);
      throw e;
    }
    if (f.state === OperationState.SUCCEEDED) return f;
    const msg = f.error?.message ?? '';
    const state = OperationState[f.state] ?? String(f.state);
    throw new OpFailed(`operation ${op.id} (${op.kind}) ${state}${msg ? `: ${msg}` : f.state === OperationState.RUNNING ? ` after ${this.opTimeoutMs} ms` : ''}`, /not supported|unimplemented/i.test(msg));
  }

  /**
   * Submits a create or fork (`submit` puts `call` into its request) and waits for it. One that
   * did not succeed (it failed, was still running at the timeout, or was never answered) is
   * cancelled and waited for, and whatever it made is destroyed now, found by its call label:
   * no answer names those sandboxes, and they would run under every later scenario.
   */
  private async made(submit: (call: { idempotencyKey: string; labels: Record<string, string> }) => Promise<Operation>): Promise<Operation> {
    this.check('create or fork');
    const k = key();
    let op: Operation | undefined;
    try {
      op = await submit({ idempotencyKey: k, labels: { [RUN_LABEL]: this.ledger.run, [CALL_LABEL]: k } });
      this.ledger.ops.add(op.id);
      // Stopped while it was submitted: the teardown may have listed the run's sandboxes already.
      this.check('create or fork');
      return await this.done(op);
    } catch (e) {
      if (op) await this.cancel(op.id);
      await this.destroyAll(await this.labelled({ [CALL_LABEL]: k }).catch(() => []));
      throw e;
    } finally {
      if (op) this.ledger.ops.delete(op.id);
    }
  }

  /** Cancels a create or fork under way and waits (a while) for it to end: a cancelled one destroys what it started. Best effort. */
  private async cancel(operationId: string): Promise<void> {
    const s = Math.ceil(Math.min(this.opTimeoutMs, 60_000) / 1000);
    try {
      await this.api.cancelOperation({ tenantId: TENANT, operationId });
      await this.api.waitOperation({ tenantId: TENANT, operationId, timeout: { seconds: BigInt(s) } }, { timeoutMs: s * 1000 + 10_000 });
    } catch {
      /* it ended already (FAILED_PRECONDITION), or the API is gone: its sandboxes are found by their labels all the same */
    }
  }

  /** Ids of the run's tenant's sandboxes (all but destroyed ones) that carry every label given. */
  private async labelled(labels: Record<string, string>): Promise<string[]> {
    const ids: string[] = [];
    let pageToken = '';
    do {
      const r = await this.api.listSandboxes({ tenantId: TENANT, labels, pageToken });
      ids.push(...r.sandboxes.map((s) => s.id));
      pageToken = r.nextPageToken;
    } while (pageToken);
    return ids;
  }

  async exec(sandboxId: string, script: string): Promise<string> {
    let out = '';
    let code = -1;
    const signal = this.ledger.signal;
    try {
      for await (const r of this.api.exec({ tenantId: TENANT, idempotencyKey: key(), sandboxId, argv: ['/bin/sh', '-c', script], timeout: { seconds: 300n } }, { timeoutMs: 310_000, ...(signal ? { signal } : {}) })) {
        if (r.payload.case === 'stdout') out += Buffer.from(r.payload.value).toString();
        if (r.payload.case === 'exit') code = r.payload.value.exitCode;
      }
    } catch (e) {
      if (signal?.aborted) throw new RunStopped(`exec in ${sandboxId}`);
      throw e;
    }
    if (code !== 0) throw new Error(`exec in ${sandboxId} exited ${code}`);
    return out;
  }

  async create(image: string, guestMib: number): Promise<Sandbox> {
    const op = await this.made((call) => this.api.createSandbox({ tenantId: TENANT, ...call, source: { case: 'image', value: image }, resources: { memoryMib: BigInt(guestMib), vcpus: 1 } }));
    if (op.result.case !== 'sandbox') throw new Error('create returned no sandbox');
    this.ledger.sandboxes.add(op.result.value.id);
    return op.result.value;
  }

  /** Boot + setup; returns the sandbox and ms from the call until the setup's exec answered. */
  async coldBoot(guestMib: number, dirtyMib: number): Promise<{ sb: Sandbox; ms: number }> {
    const t0 = performance.now();
    const sb = await this.create('tiny', guestMib);
    await this.exec(sb.id, setupScript(dirtyMib));
    return { sb, ms: performance.now() - t0 };
  }

  async snapshot(sandboxId: string): Promise<Snapshot> {
    const op = await this.done(await this.api.snapshotSandbox({ tenantId: TENANT, idempotencyKey: key(), sandboxId }));
    if (op.result.case !== 'snapshot') throw new Error('snapshot returned no snapshot');
    return op.result.value;
  }

  async getSnapshot(snapshotId: string): Promise<Snapshot> {
    return this.api.getSnapshot({ tenantId: TENANT, snapshotId });
  }

  /**
   * fork(N); each child's latency is from the call until it answers an exec. `where`: the
   * children must be on (or off) the snapshot's holders, else the sample fails (its children destroyed).
   */
  async fork(snapshotId: string, count: number, placement: { locality?: Locality; spread?: Spread }, where?: PlacementWant): Promise<{ children: Sandbox[]; ms: number[] }> {
    const t0 = performance.now();
    const op = await this.made((call) => this.api.forkSandbox({ tenantId: TENANT, ...call, source: { case: 'snapshotId', value: snapshotId }, count, placement }));
    const opAt = performance.now();
    const children = op.result.case === 'fork' ? op.result.value.children : [];
    for (const c of children) this.ledger.sandboxes.add(c.id);
    try {
      if (children.length !== count) throw new Error(`fork returned ${children.length} children, asked for ${count}`);
      const wrong = where && misplaced(where, children);
      if (wrong) throw new Error(wrong);
      const ms = await Promise.all(children.map(async (c) => (await this.exec(c.id, 'true'), performance.now() - t0)));
      this.phases(op, opAt, t0 + Math.max(...ms));
      return { children, ms };
    } catch (e) {
      // A failed sample's children go now: they would run (and take CPU) under every later scenario.
      await this.destroyAll(children.map((c) => c.id));
      throw e;
    }
  }

  /** CreateSandbox from a snapshot, k at once; each latency is call until exec answered. */
  async restoreConcurrent(snapshotId: string, k: number, guestMib: number): Promise<{ sandboxes: Sandbox[]; ms: number[] }> {
    /** Every sandbox made, also one whose exec then failed. */
    const made: string[] = [];
    const res = await Promise.allSettled(
      Array.from({ length: k }, async () => {
        const t0 = performance.now();
        const op = await this.made((call) => this.api.createSandbox({ tenantId: TENANT, ...call, source: { case: 'snapshotId', value: snapshotId }, resources: { memoryMib: BigInt(guestMib), vcpus: 1 } }));
        const opAt = performance.now();
        if (op.result.case !== 'sandbox') throw new Error('restore returned no sandbox');
        this.ledger.sandboxes.add(op.result.value.id);
        made.push(op.result.value.id);
        await this.exec(op.result.value.id, 'true');
        this.phases(op, opAt, performance.now());
        return { sb: op.result.value, ms: performance.now() - t0 };
      }),
    );
    const ok = res.flatMap((r) => (r.status === 'fulfilled' ? [r.value] : []));
    const bad = res.find((r): r is PromiseRejectedResult => r.status === 'rejected');
    if (bad) {
      await this.destroyAll(made);
      throw bad.reason;
    }
    return { sandboxes: ok.map((o) => o.sb), ms: ok.map((o) => o.ms) };
  }

  async pause(sandboxId: string): Promise<void> {
    await this.done(await this.api.pauseSandbox({ tenantId: TENANT, idempotencyKey: key(), sandboxId }));
  }

  async hibernate(sandboxId: string): Promise<void> {
    await this.done(await this.api.hibernateSandbox({ tenantId: TENANT, idempotencyKey: key(), sandboxId }));
  }

  /** ResumeSandbox; ms from the call until the sandbox answers an exec. */
  async resume(sandboxId: string): Promise<number> {
    const t0 = performance.now();
    const op = await this.done(await this.api.resumeSandbox({ tenantId: TENANT, idempotencyKey: key(), sandboxId }));
    const opAt = performance.now();
    await this.exec(sandboxId, 'true');
    const readyAt = performance.now();
    this.phases(op, opAt, readyAt);
    return readyAt - t0;
  }

  async hostOf(sandboxId: string): Promise<string> {
    return (await this.api.getSandbox({ tenantId: TENANT, sandboxId })).hostId;
  }

  /** A cordon refuses once the run stops (RunStopped); an uncordon (clean-up) always goes ahead. */
  async cordon(hostId: string, cordon: boolean): Promise<void> {
    if (cordon) this.check(`cordon ${hostId}`);
    if (cordon) this.ledger.cordoned.add(hostId);
    await this.api.cordonHost({ idempotencyKey: key(), hostId, cordon });
    if (!cordon) this.ledger.cordoned.delete(hostId);
  }

  /**
   * Destroys each sandbox, trying a failed one once more. One that fails twice stays on the
   * fleet: it goes into the ledger's `undestroyed`, for the caller to report, and tidy() tries
   * it again at the end. Never throws; a stop of the run does not cut it short.
   */
  async destroyAll(ids: readonly string[]): Promise<void> {
    const once = async (sandboxId: string): Promise<void> => {
      try {
        await this.done(await this.api.destroySandbox({ tenantId: TENANT, idempotencyKey: key(), sandboxId }), false);
      } catch (e) {
        // Gone already (a cancelled fork destroys what it made): nothing is left running.
        if ((e as { kind?: unknown }).kind !== 'not_found') throw e;
      }
    };
    await Promise.all(ids.map(async (sandboxId) => {
      try {
        await once(sandboxId).catch(() => once(sandboxId));
        this.ledger.sandboxes.delete(sandboxId);
        this.ledger.undestroyed.delete(sandboxId);
      } catch (e) {
        this.ledger.undestroyed.set(sandboxId, e instanceof Error ? e.message : String(e));
      }
    }));
  }

  /**
   * A same-host child of `snapshotId`, hibernated (not timed: a wake's setup). A child whose
   * hibernate fails is destroyed before the error is thrown (`onHibernateError` sees it first).
   */
  async hibernatedChild(snapshotId: string, onHibernateError?: (e: unknown) => void): Promise<{ id: string; host: string }> {
    const { children } = await this.fork(snapshotId, 1, { locality: Locality.SAME_HOST });
    const c = children[0]!;
    try {
      await this.hibernate(c.id);
    } catch (e) {
      onHibernateError?.(e);
      await this.destroyAll([c.id]);
      throw e;
    }
    return { id: c.id, host: c.hostId };
  }

  /**
   * Wakes a hibernated child of `snapshotId`; ms from ResumeSandbox until it answers an exec.
   * Warm: on its own host, where its snapshot is. Cold: its host cordoned first, so it must
   * wake on a peer that fetches the snapshot; a wake that stays put is an error, not a sample.
   * The child is destroyed (and its host uncordoned) on every path.
   */
  async wakeHibernated(snapshotId: string, cold: boolean, onHibernateError?: (e: unknown) => void): Promise<number> {
    const h = await this.hibernatedChild(snapshotId, onHibernateError);
    try {
      if (cold) await this.cordon(h.host, true);
      const ms = await this.resume(h.id);
      const on = await this.hostOf(h.id);
      if (cold && on === h.host) throw new Error(`woke on its own (cordoned) host ${h.host}: not a cold wake`);
      // A warm wake is placed on its snapshot's host only by preference: one that went to a peer was not warm.
      if (!cold && on !== h.host) throw new Error(`woke on ${on}, not on ${h.host} where its snapshot is: not a warm wake`);
      return ms;
    } finally {
      // Only a cordon this run asked for (the ledger has it from before the call): on a shared
      // fleet (--api) the host may have been cordoned by someone else, if ours was refused.
      if (cold && this.ledger.cordoned.has(h.host)) await this.cordon(h.host, false).catch(() => undefined);
      await this.destroyAll([h.id]);
    }
  }

  /**
   * Undoes what the run made: every sandbox in the ledger or carrying the run's label (also what
   * a create or fork under way made, which it cancels first), every host cordoned and not uncordoned.
   */
  async tidy(): Promise<void> {
    await Promise.all([...this.ledger.ops].map((id) => this.cancel(id)));
    const labelled = await this.labelled({ [RUN_LABEL]: this.ledger.run }).catch(() => []);
    await this.destroyAll([...new Set([...this.ledger.sandboxes, ...labelled])]);
    await Promise.all([...this.ledger.cordoned].map((h) => this.cordon(h, false).catch(() => undefined)));
  }

  async hosts(): Promise<Array<{ id: string; accel: string; linkBytesPerSecond: number }>> {
    return (await this.api.listHosts({})).hosts.map((h) => ({ id: h.id, accel: h.accel === 1 ? 'kvm' : 'tcg', linkBytesPerSecond: Number(h.linkBytesPerSecond) }));
  }
}

export { Locality, OperationKind, Spread };
