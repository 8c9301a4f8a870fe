// Authentication, tenancy and limits of the Fleet API (issue #9) with a real scheduler:
// real etcd, real nats-server, the scheduler in-process serving TLS with a tokens file, and
// fake host agents (the real Agent over real NATS, simulated VMs: loadtest/fake-agent/),
// which is the cheapest way to a running sandbox and a snapshot that exec and fork work on.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { rmSync } from 'node:fs';
import { join } from 'node:path';
import { pino } from 'pino';
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { status as Status } from '@grpc/grpc-js';
import { startEtcd } from '../testkit/etcd.ts';
import type { EtcdCluster } from '../testkit/etcd.ts';
import { startNats } from '../testkit/nats.ts';
import type { NatsServer } from '../testkit/nats.ts';
import { waitFor, tempDir } from '../testkit/proc.ts';
import { startFakeAgents } from '../testkit/fleet-procs.ts';
import type { FakeAgentsProcess } from '../testkit/fleet-procs.ts';
import { testCredentials } from '../testkit/credentials.ts';
import type { TestCredentials } from '../testkit/credentials.ts';
import { compileSchedulerConfig } from '../config.ts';
import { startScheduler } from '../scheduler.ts';
import type { SchedulerHandle } from '../scheduler.ts';
import { EtcdFleetStore } from '../adapters/etcd/store.ts';
import { sandboxRecord } from '../testkit/records.ts';
import { createClient } from '../adapters/grpc/rpc.ts';
import type { Client } from '../adapters/grpc/rpc.ts';
import type { RpcError } from '../adapters/grpc/status.ts';
import { Forkfleet } from '../sdk/index.ts';
import { revokeTokens } from './tokens.ts';
import { EventType, FleetService, OperationState, SandboxState } from '../../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { Operation } from '../../proto/gen/forkfleet/v1/fleet_pb.ts';

type Api = Client<(typeof FleetService)['method']>;
let keyN = 0;
const key = (): string => `auth-${Date.now()}-${keyN++}`;
const HOSTS = ['fa-1', 'fa-2'];

/** The error a call (or the first read of a stream) fails with; undefined when it succeeds. */
async function failure(p: Promise<unknown> | AsyncIterable<unknown>): Promise<RpcError | undefined> {
  try {
    if (Symbol.asyncIterator in p) for await (const _ of p);
    else await p;
    return undefined;
  } catch (e) {
    return e as RpcError;
  }
}
const codeOf = async (p: Promise<unknown> | AsyncIterable<unknown>): Promise<string> => {
  const e = await failure(p);
  return e === undefined ? 'OK' : (Status[e.code] ?? String(e.code));
};

async function ok(api: Api, op: Operation): Promise<Operation> {
  const final = await api.waitOperation({ operationId: op.id, timeout: { seconds: 60n } }, { timeoutMs: 70_000 });
  if (final.state !== OperationState.SUCCEEDED) throw new Error(`operation ${op.id} ${OperationState[final.state]}: ${final.error?.message}`);
  return final;
}

describe('Fleet API authentication, tenancy and limits (real scheduler, etcd, NATS)', () => {
  let etcd: EtcdCluster;
  let nats: NatsServer;
  let dir: string;
  let store: EtcdFleetStore;
  let sched: SchedulerHandle;
  let fakes: FakeAgentsProcess;
  let creds: TestCredentials;
  let admin: Api;
  let a: Api;
  let b: Api;
  const tokens: Record<string, string> = {};
  const clients: Api[] = [];
  // tenant-a's sandbox, snapshot and operation
  let sbA = '';
  let snA = '';
  let opA = '';

  const client = (token: string): Api => {
    const c = creds.client(FleetService, sched.address, token);
    clients.push(c);
    return c;
  };

  /** Every record in etcd but host liveness (heartbeat-driven), the election and the leader's webhook cursor. */
  async function records(): Promise<Record<string, string>> {
    const all = await store.etcd.getAll().prefix('/ff/v1/').strings();
    return Object.fromEntries(Object.entries(all).filter(([k]) => !/^\/ff\/v1\/(hosts|alloc|election|webhooks)\//.test(k)));
  }

  beforeAll(async () => {
    dir = tempDir('ff-auth-');
    [etcd, nats] = await Promise.all([startEtcd(), startNats()]);
    store = EtcdFleetStore.connect(etcd.endpoints);
    creds = testCredentials(dir);
    tokens.a = creds.mint({ tenant: 'tenant-a' });
    tokens.b = creds.mint({ tenant: 'tenant-b' });
    tokens.tight = creds.mint({ tenant: 'tight', quotas: { sandboxes: 1, memory_mib: 512 } });
    tokens.slow = creds.mint({ tenant: 'slow', rate: { per_s: 1, burst: 3 } });
    tokens.life = creds.mint({ tenant: 'life' });
    tokens.rated = creds.mint({ tenant: 'rated', rate: { per_s: 50, burst: 70 } });
    const signingKeyPath = join(dir, 'signing.pem');
    sched = await startScheduler(
      compileSchedulerConfig({ grpcAddr: '127.0.0.1:0', etcdEndpoints: etcd.endpoints.join(','), natsUrl: nats.url, signingKeyPath, maxStreamsPerCredential: '2', maxRecvBytes: '64KiB', metricsAddr: '127.0.0.1:0', ...creds.config }),
      pino({ level: 'warn' }),
      // Progress markers after 0.3 s without events (30 s in a deployment).
      { watchProgressMs: 300 },
    );
    await sched.leader;
    fakes = await startFakeAgents({ hosts: HOSTS, dataDir: join(dir, 'fleet'), natsUrl: nats.url, logDir: dir, env: { FF_FAKE_VCPUS: '16' } });
    admin = client(creds.adminToken);
    a = client(tokens.a);
    b = client(tokens.b);
    await waitFor('hosts registered', async () => (await admin.listHosts({})).hosts.length === HOSTS.length, 30_000, 100);
    // tenant-a: a running sandbox (tenant_id omitted: the credential's tenant) and a snapshot of it.
    const created = await ok(a, await a.createSandbox({ idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }));
    sbA = created.result.case === 'sandbox' ? created.result.value.id : '';
    expect(created.tenantId).toBe('tenant-a');
    const snap = await ok(a, await a.snapshotSandbox({ idempotencyKey: key(), sandboxId: sbA }));
    snA = snap.result.case === 'snapshot' ? snap.result.value.id : '';
    opA = snap.id;
    expect(sbA).toMatch(/^sb-/);
    expect(snA).toMatch(/^sn-/);
  }, 180_000);

  afterAll(async () => {
    for (const c of clients) c.close();
    await sched?.close();
    await fakes?.stop();
    store?.close();
    await nats?.stop();
    await etcd?.stop();
    if (dir) rmSync(dir, { recursive: true, force: true });
  }, 60_000);

  it('call_withoutCredentials_isUnauthenticated_forUnaryAndStreamingCalls', async () => {
    const anon = client('');
    expect(await codeOf(anon.listSandboxes({}))).toBe('UNAUTHENTICATED');
    expect(await codeOf(anon.getSandbox({ tenantId: 'tenant-a', sandboxId: sbA }))).toBe('UNAUTHENTICATED');
    expect(await codeOf(anon.exec({ tenantId: 'tenant-a', sandboxId: sbA, argv: ['true'] }))).toBe('UNAUTHENTICATED');
    expect(await codeOf(anon.writeFile([{ payload: { case: 'header', value: { tenantId: 'tenant-a', sandboxId: sbA, path: '/tmp/x' } } }]))).toBe('UNAUTHENTICATED');
  });

  it('call_withUnknownOrMalformedToken_isUnauthenticated', async () => {
    expect(await codeOf(client(`ff_${'x'.repeat(43)}`).listSandboxes({}))).toBe('UNAUTHENTICATED');
    expect(await codeOf(client(tokens.a!.slice(0, -1)).listSandboxes({}))).toBe('UNAUTHENTICATED');
    const wrongScheme = creds.client(FleetService, sched.address, '');
    clients.push(wrongScheme);
    expect(await codeOf(wrongScheme.listSandboxes({}, { metadata: { authorization: `Token ${tokens.a}` } }))).toBe('UNAUTHENTICATED');
  });

  it('plaintextConnection_isRefused_andChangesNothing', async () => {
    const before = await records();
    const plain = createClient(FleetService, sched.address);
    clients.push(plain);
    const e = await failure(plain.createSandbox({ tenantId: 'tenant-a', idempotencyKey: key(), source: { case: 'image', value: 'tiny' } }, { timeoutMs: 5000 }));
    expect(e).toBeDefined();
    expect([Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED]).toContain(e!.code);
    expect(await records()).toEqual(before);
  });

  it('crossTenant_readExecFilesForkRestoreDestroyDelete_areNotFound_andChangeNothing', async () => {
    const vmsBefore = fakes.vms();
    const before = await records();
    const results: Record<string, string> = {
      getSandbox: await codeOf(b.getSandbox({ sandboxId: sbA })),
      exec: await codeOf(b.exec({ sandboxId: sbA, argv: ['/bin/sh', '-c', 'echo pwned > /tmp/x'] })),
      writeFile: await codeOf(b.writeFile([{ payload: { case: 'header', value: { sandboxId: sbA, path: '/tmp/x' } } }, { payload: { case: 'data', value: Buffer.from('pwned') } }])),
      readFile: await codeOf(b.readFile({ sandboxId: sbA, path: '/etc/hostname' })),
      forkSandbox: await codeOf(b.forkSandbox({ idempotencyKey: key(), source: { case: 'sandboxId', value: sbA }, count: 1 })),
      forkSnapshot: await codeOf(b.forkSandbox({ idempotencyKey: key(), source: { case: 'snapshotId', value: snA }, count: 1 })),
      restore: await codeOf(b.createSandbox({ idempotencyKey: key(), source: { case: 'snapshotId', value: snA }, resources: { memoryMib: 256n, vcpus: 1 } })),
      pause: await codeOf(b.pauseSandbox({ idempotencyKey: key(), sandboxId: sbA })),
      snapshot: await codeOf(b.snapshotSandbox({ idempotencyKey: key(), sandboxId: sbA })),
      hibernate: await codeOf(b.hibernateSandbox({ idempotencyKey: key(), sandboxId: sbA })),
      destroy: await codeOf(b.destroySandbox({ idempotencyKey: key(), sandboxId: sbA })),
      getSnapshot: await codeOf(b.getSnapshot({ snapshotId: snA })),
      pinSnapshot: await codeOf(b.pinSnapshot({ idempotencyKey: key(), snapshotId: snA })),
      deleteSnapshot: await codeOf(b.deleteSnapshot({ idempotencyKey: key(), snapshotId: snA })),
      getOperation: await codeOf(b.getOperation({ operationId: opA })),
      waitOperation: await codeOf(b.waitOperation({ operationId: opA, timeout: { seconds: 1n } })),
      cancelOperation: await codeOf(b.cancelOperation({ operationId: opA })),
    };
    expect(results).toEqual(Object.fromEntries(Object.keys(results).map((k) => [k, 'NOT_FOUND'])));
    expect((await b.listSandboxes({})).sandboxes).toEqual([]);
    expect((await b.listSnapshots({})).snapshots).toEqual([]);
    // Nothing changed: every record (tenant-a's and any tenant-b op or idempotency key), and every VM.
    await new Promise((r) => setTimeout(r, 300));
    expect(await records()).toEqual(before);
    expect(fakes.vms()).toEqual(vmsBefore);
    // tenant-a still sees its own, unchanged.
    expect((await a.getSandbox({ sandboxId: sbA })).id).toBe(sbA);
    expect((await a.getSnapshot({ snapshotId: snA })).id).toBe(snA);
  });

  it('requestNamingAnotherTenant_isPermissionDeniedNamingTenantId_andAdminMayActForIt', async () => {
    const e = await failure(b.getSandbox({ tenantId: 'tenant-a', sandboxId: sbA }));
    expect(e?.code).toBe(Status.PERMISSION_DENIED);
    expect(e?.field).toBe('tenant_id');
    const w = await failure(b.writeFile([{ payload: { case: 'header', value: { tenantId: 'tenant-a', sandboxId: sbA, path: '/tmp/x' } } }]));
    expect(w?.code).toBe(Status.PERMISSION_DENIED);
    expect(w?.field).toBe('header.tenant_id');
    expect((await admin.getSandbox({ tenantId: 'tenant-a', sandboxId: sbA })).id).toBe(sbA);
  });

  it('hostOperationsAndListsOfAllTenants_withTenantCredentials_arePermissionDenied_andChangeNothing', async () => {
    const before = await store.listHosts();
    expect(await codeOf(a.listSandboxes({ allTenants: true }))).toBe('PERMISSION_DENIED');
    expect(await codeOf(a.listOperations({ allTenants: true }))).toBe('PERMISSION_DENIED');
    // Its own tenant's operations are its to list, another's are not.
    expect(await codeOf(a.listOperations({}))).toBe('OK');
    expect(await codeOf(a.listOperations({ tenantId: 'tenant-b' }))).toBe('PERMISSION_DENIED');
    expect(await codeOf(a.listHosts({}))).toBe('PERMISSION_DENIED');
    expect(await codeOf(a.cordonHost({ idempotencyKey: key(), hostId: HOSTS[0]!, cordon: true }))).toBe('PERMISSION_DENIED');
    expect(await codeOf(a.drainHost({ idempotencyKey: key(), hostId: HOSTS[0]!, migrate: true }))).toBe('PERMISSION_DENIED');
    expect(await codeOf(a.removeHost({ hostId: HOSTS[0]! }))).toBe('PERMISSION_DENIED');
    expect((await store.listHosts()).map((h) => [h.value.id, h.value.cordoned, h.value.draining])).toEqual(before.map((h) => [h.value.id, h.value.cordoned, h.value.draining]));
    expect((await admin.listHosts({})).hosts.length).toBe(HOSTS.length);
  });

  it('quotaExceeded_isResourceExhaustedNamingTheQuota_andCreatesNothing', async () => {
    const tight = client(tokens.tight!);
    const big = await failure(tight.createSandbox({ idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 1024n, vcpus: 1 } }));
    expect(big?.code).toBe(Status.RESOURCE_EXHAUSTED);
    expect(big?.field).toBe('quotas.memory_mib');
    expect(big?.retryable).toBe(false);
    expect(big?.message).toMatch(/0 MiB in use \+ 1024 MiB asked > 512 MiB/);
    const first = await ok(tight, await tight.createSandbox({ idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }));
    const id = first.result.case === 'sandbox' ? first.result.value.id : '';
    const before = await records();
    const second = await failure(tight.createSandbox({ idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }));
    expect(second?.code).toBe(Status.RESOURCE_EXHAUSTED);
    expect(second?.field).toBe('quotas.sandboxes');
    const fork = await failure(tight.forkSandbox({ idempotencyKey: key(), source: { case: 'sandboxId', value: id }, count: 2 }));
    expect(fork?.code).toBe(Status.RESOURCE_EXHAUSTED);
    expect(fork?.field).toBe('quotas.sandboxes');
    expect(await records()).toEqual(before);
    // The tenant sees its quota and what counts against it.
    const used = await tight.getTenantUsage({});
    expect([used.tenantId, used.sandboxes, used.memoryMib, used.quota?.sandboxes, used.quota?.memoryMib, used.quota?.snapshotBytes]).toEqual(['tight', 1, 256n, 1, 512n, undefined]);
    // Destroying frees the quota.
    await ok(tight, await tight.destroySandbox({ idempotencyKey: key(), sandboxId: id }));
    expect((await tight.getTenantUsage({})).sandboxes).toBe(0);
    await ok(tight, await tight.createSandbox({ idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }));
  });

  it('tenantUsage_showsItsOwnRateAndNoLimitsWhereNoneAreSet_andAnotherTenantsOnlyToAnAdmin', async () => {
    const rated = await client(tokens.rated!).getTenantUsage({});
    expect([rated.tenantId, rated.ratePerSecond, rated.rateBurst, rated.quota?.sandboxes, rated.quota?.memoryMib]).toEqual(['rated', 50, 70, undefined, undefined]);
    expect(await codeOf(a.getTenantUsage({ tenantId: 'tight' }))).toBe('PERMISSION_DENIED');
    expect((await admin.getTenantUsage({ tenantId: 'tight' })).quota?.sandboxes).toBe(1);
    const bad = await failure(admin.getTenantUsage({ tenantId: 'Not A Tenant' }));
    expect([bad?.code, bad?.field]).toEqual([Status.INVALID_ARGUMENT, 'tenant_id']);
  });

  it('tenantOverItsRate_isRetryableResourceExhausted_andTheSdkRetriesThrough', async () => {
    const slow = client(tokens.slow!);
    const codes = await Promise.all(Array.from({ length: 6 }, () => codeOf(slow.listSandboxes({}))));
    expect(codes.filter((c) => c === 'OK').length).toBeGreaterThanOrEqual(1);
    expect(codes.filter((c) => c === 'OK').length).toBeLessThanOrEqual(4);
    const e = await failure(slow.listSandboxes({}));
    expect(e?.code).toBe(Status.RESOURCE_EXHAUSTED);
    expect(e?.retryable).toBe(true);
    expect(e?.field).toBe('rate');
    // Other tenants are not slowed by it.
    expect(await codeOf(a.listSandboxes({}))).toBe('OK');
    // The SDK retries retryable errors with backoff: over the limit, its calls still succeed.
    const sdk = new Forkfleet({ address: sched.address, token: tokens.slow!, ca: creds.caPem, retry: { attempts: 8, baseMs: 500, maxMs: 2000 } });
    try {
      for (let i = 0; i < 3; i++) expect(await sdk.list()).toEqual([]);
    } finally {
      sdk.close();
    }
  });

  it('bufCurl_overTlsWithTheCa_listsMethodsOpenly_andCallsWithABearerToken', async () => {
    const run = promisify(execFile);
    const base = ['buf', 'curl', '--protocol', 'grpc', '--cacert', creds.caPath];
    const list = await run('npx', [...base, '--list-methods', `https://${sched.address}`]);
    expect(list.stdout).toContain('forkfleet.v1.FleetService/CreateSandbox');
    const call = await run('npx', [...base, '-H', `authorization: Bearer ${tokens.a}`, '-d', JSON.stringify({ sandboxId: sbA }), `https://${sched.address}/forkfleet.v1.FleetService/GetSandbox`]);
    expect((JSON.parse(call.stdout) as { id: string }).id).toBe(sbA);
    const anon = await run('npx', [...base, '-d', JSON.stringify({ sandboxId: sbA }), `https://${sched.address}/forkfleet.v1.FleetService/GetSandbox`]).catch((e: unknown) => e as { stderr: string });
    expect(anon.stderr).toMatch(/unauthenticated/i);
  });

  it('schedulerDashboard_readsTheApiWithItsInMemoryAdminToken_andServesItOnlyToAdmins', async () => {
    const url = `http://${sched.metricsAddress}/dashboard/api/state`;
    expect((await fetch(url)).status).toBe(401);
    const state = (await (await fetch(`${url}?token=${creds.adminToken}`)).json()) as { error?: string; hosts: unknown[] };
    expect(state.error).toBeUndefined();
    expect(state.hosts).toHaveLength(HOSTS.length);
  });

  it('requestOverTheMessageSizeLimit_isResourceExhausted_andTheServerStaysUp', async () => {
    const e = await failure(a.exec({ sandboxId: sbA, argv: ['cat'], stdin: new Uint8Array(100 * 1024) }));
    expect(e?.code).toBe(Status.RESOURCE_EXHAUSTED);
    expect(await codeOf(a.exec({ sandboxId: sbA, argv: ['true'], stdin: new Uint8Array(1024) }))).toBe('OK');
  });

  it('streamsOverThePerCredentialCap_areResourceExhausted_untilOneCloses', async () => {
    const ac = [new AbortController(), new AbortController()];
    const open = ac.map((c) => failure(a.watchEvents({}, { signal: c.signal })));
    await new Promise((r) => setTimeout(r, 500));
    const third = await failure(a.watchEvents({}, { timeoutMs: 3000 }));
    expect(third?.code).toBe(Status.RESOURCE_EXHAUSTED);
    expect(third?.field).toBe('streams');
    // Another credential is not affected.
    expect(await codeOf(b.watchEvents({}, { timeoutMs: 500 }))).toBe('DEADLINE_EXCEEDED');
    ac[0]!.abort();
    await open[0];
    await waitFor('a stream slot is free again', async () => (await failure(a.watchEvents({}, { timeoutMs: 300 })))?.code === Status.DEADLINE_EXCEEDED, 10_000, 100);
    ac[1]!.abort();
    await open[1];
  });

  it('revokedToken_endsItsOpenStreamUnauthenticated_andIsRefusedFromThenOn_whileOtherStreamsGoOn', async () => {
    const leaked = creds.mint({ tenant: 'tenant-a', name: 'leaked-ci' });
    const c = client(leaked);
    await waitFor('the new token is taken', async () => (await codeOf(c.listSandboxes({}))) === 'OK', 10_000, 100);
    const other = new AbortController();
    const otherEnded = failure(b.watchEvents({}, { signal: other.signal }));
    const revokedEnd = failure(c.watchEvents({}, { timeoutMs: 30_000 }));
    await new Promise((r) => setTimeout(r, 300));
    expect(revokeTokens(creds.tokensFile, 'leaked-ci')).toHaveLength(1);
    const e = await revokedEnd;
    expect([e && Status[e.code], e?.message]).toEqual(['UNAUTHENTICATED', expect.stringMatching(/credential revoked/)]);
    expect(await codeOf(c.listSandboxes({}))).toBe('UNAUTHENTICATED');
    other.abort();
    expect((await otherEnded)?.code).toBe(Status.CANCELLED);
  });

  it('placementOnANamedHost_isForAdminCredentialsOnly', async () => {
    const life = client(tokens.life!);
    const e = await failure(life.createSandbox({ idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, placement: { hostId: HOSTS[0]! } }));
    expect(e?.code).toBe(Status.PERMISSION_DENIED);
    expect(e?.field).toBe('placement.host_id');
    const f = await failure(life.forkSandbox({ idempotencyKey: key(), source: { case: 'snapshotId', value: 'sn-aaaaaaaaaaaaaaaaaaaa' }, count: 1, placement: { hostId: HOSTS[0]! } }));
    expect(f?.field).toBe('placement.host_id');
  });

  it('createFromSnapshot_booksTheSnapshotsVmSize_andRefusesAnotherNamingTheField', async () => {
    const life = client(tokens.life!);
    const src = await ok(life, await life.createSandbox({ idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 512n, vcpus: 2 } }));
    const srcId = src.result.case === 'sandbox' ? src.result.value.id : '';
    const snap = await ok(life, await life.snapshotSandbox({ idempotencyKey: key(), sandboxId: srcId }));
    const snapshotId = snap.result.case === 'snapshot' ? snap.result.value.id : '';
    // Unset: the restore is booked at the snapshot's 512 MiB and 2 vCPUs (not the 256 MiB / 1 default).
    const restored = await ok(life, await life.createSandbox({ idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId } }));
    const sb = restored.result.case === 'sandbox' ? restored.result.value : undefined;
    expect([sb?.resources?.memoryMib, sb?.resources?.vcpus]).toEqual([512n, 2]);
    const e = await failure(life.createSandbox({ idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, resources: { memoryMib: 256n } }));
    expect(e?.code).toBe(Status.INVALID_ARGUMENT);
    expect(e?.field).toBe('resources.memory_mib');
    const v = await failure(life.createSandbox({ idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, resources: { memoryMib: 512n, vcpus: 1 } }));
    expect(v?.field).toBe('resources.vcpus');
    for (const id of [srcId, sb!.id]) await ok(life, await life.destroySandbox({ idempotencyKey: key(), sandboxId: id }));
  });

  it('watchEvents_afterRevision_replaysWhatHappenedSince_andACompactedOneIsFailedPrecondition', async () => {
    const life = client(tokens.life!);
    const from = await store.revision();
    const made = await ok(life, await life.createSandbox({ idempotencyKey: key(), source: { case: 'image', value: 'tiny' } }));
    const id = made.result.case === 'sandbox' ? made.result.value.id : '';
    // Opened after the sandbox is running: the replay still brings its events, in revision order.
    const ac = new AbortController();
    const seen: Array<{ revision: bigint; state: number }> = [];
    try {
      for await (const ev of life.watchEvents({ sandboxId: id, afterRevision: BigInt(from) }, { signal: ac.signal, timeoutMs: 10_000 })) {
        seen.push({ revision: ev.revision, state: ev.sandboxState });
        if (ev.sandboxState === SandboxState.RUNNING) break;
      }
    } finally {
      ac.abort();
    }
    expect(seen.map((e) => e.state)).toContain(SandboxState.RUNNING);
    expect(seen.every((e, i) => e.revision > BigInt(from) && (i === 0 || e.revision >= seen[i - 1]!.revision))).toBe(true);
    expect((await failure(life.watchEvents({ afterRevision: -1n })))?.field).toBe('after_revision');
    await ok(life, await life.destroySandbox({ idempotencyKey: key(), sandboxId: id }));
    await store.compact(await store.revision());
    const gone = await failure(life.watchEvents({ afterRevision: BigInt(from) }, { timeoutMs: 10_000 }));
    expect(gone?.code).toBe(Status.FAILED_PRECONDITION);
    expect(gone?.field).toBe('after_revision');
  });

  it('watchEvents_thatMatchesNothing_getsProgressMarkersAsTheStoreMovesOn_andOneIsAResumePointPastACompaction', async () => {
    const life = client(tokens.life!);
    const quiet = `sb-${'q'.repeat(20)}`;
    // A sandbox of its own that nothing changes (a watch of one the tenant lacks is NOT_FOUND).
    await store.commit([{ kind: 'sandbox', value: sandboxRecord({ id: quiet, tenantId: 'life', state: 'destroyed', hostId: '', lineageId: quiet }) }]);
    const from = await store.revision();
    const ac = new AbortController();
    const markers: Array<{ type: EventType; revision: bigint }> = [];
    const reading = (async () => {
      try {
        for await (const ev of life.watchEvents({ sandboxId: quiet }, { signal: ac.signal, timeoutMs: 30_000 })) {
          markers.push({ type: ev.type, revision: ev.revision });
          // Past the first: a watch from now opens with a marker at the store's revision, which a
          // write of someone else's since `from` would put past it before this test moved anything.
          if (markers.length > 1 && ev.revision > BigInt(from)) break;
        }
      } finally {
        ac.abort();
      }
    })();
    // Another tenant's work moves the store on; nothing of it is this watch's.
    const made = await ok(a, await a.createSandbox({ idempotencyKey: key(), source: { case: 'image', value: 'tiny' } }));
    await reading;
    expect(markers.every((m) => m.type === EventType.UNSPECIFIED)).toBe(true);
    const mark = markers.at(-1)!.revision;
    expect(mark).toBeGreaterThan(BigInt(from));
    // Compacted up to the marker: a watch resumed from it is accepted (it waits for events,
    // here until its deadline), where one from before it is FAILED_PRECONDITION.
    await store.compact(Number(mark));
    expect(await codeOf(life.watchEvents({ sandboxId: quiet, afterRevision: mark }, { timeoutMs: 1500 }))).toBe('DEADLINE_EXCEEDED');
    expect((await failure(life.watchEvents({ sandboxId: quiet, afterRevision: BigInt(from) }, { timeoutMs: 10_000 })))?.code).toBe(Status.FAILED_PRECONDITION);
    await ok(a, await a.destroySandbox({ idempotencyKey: key(), sandboxId: made.result.case === 'sandbox' ? made.result.value.id : '' }));
  });

  it('sdkSandboxHandle_showsTheStateEachLifecycleCallLeftIt_hibernateIncluded', async () => {
    const sdk = new Forkfleet({ address: sched.address, token: tokens.life!, ca: creds.caPem });
    try {
      const sb = await sdk.create({ image: 'tiny', memoryMib: 256 });
      expect(sb.info?.state).toBe('running');
      expect((await sb.pause()).info?.state).toBe('paused');
      expect((await sb.resume()).info?.state).toBe('running');
      // A hibernation's operation result is its snapshot: the handle must not keep 'running'.
      expect((await sb.hibernate()).info?.state).toBe('hibernated');
      expect((await sb.resume()).info?.state).toBe('running');
      expect((await sb.destroy()).info?.state).toBe('destroyed');
    } finally {
      sdk.close();
    }
  });
});
