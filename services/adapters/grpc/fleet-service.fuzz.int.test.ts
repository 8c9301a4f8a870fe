// Fuzzes the public Fleet API over real gRPC against real etcd and NATS: thousands of
// malformed and boundary-value requests, raw undecodable bytes and truncated streams.
// The server must never crash or hang, must answer bad input with a client error (never
// INTERNAL), and a request that fails must not change any state in etcd.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import fc from 'fast-check';
import { Client as GrpcClient, Metadata, status as Status } from '@grpc/grpc-js';
import type { ServiceError } from '@grpc/grpc-js';
import { connect } from 'nats';
import type { NatsConnection } from 'nats';
import { startEtcd } from '../../testkit/etcd.ts';
import type { EtcdCluster } from '../../testkit/etcd.ts';
import { startNats } from '../../testkit/nats.ts';
import type { NatsServer } from '../../testkit/nats.ts';
import { EtcdFleetStore } from '../etcd/store.ts';
import { NatsWorkBus } from '../nats/bus.ts';
import { Fleet } from '../../domain/fleet.ts';
import { HeartbeatRegistry } from '../../domain/fleet-view.ts';
import { systemClock } from '../../domain/ports.ts';
import { fleetService } from './fleet-service.ts';
import { startGrpcServer } from './server.ts';
import type { RunningGrpcServer } from './server.ts';
import { fleetChannelCredentials, fleetChannelOptions, fleetServerCredentials } from './tls.ts';
import { testCredentials } from '../../testkit/credentials.ts';
import type { TestCredentials } from '../../testkit/credentials.ts';
import { ApiGuard } from '../../auth/guard.ts';
import { Authenticator } from '../../auth/tokens.ts';
import { readFileSync, rmSync } from 'node:fs';
import type { Client } from './rpc.ts';
import type { RpcError } from './status.ts';
import { EventType, FleetService, OperationKind, SandboxState } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import { Locality } from '../../../proto/gen/forkfleet/v1/common_pb.ts';
import { sandboxRecord, snapshotRecord } from '../../testkit/records.ts';
import { tempDir } from '../../testkit/proc.ts';

type Api = Client<(typeof FleetService)['method']>;

// Codes a correct server may give a bad or unlucky request. INTERNAL and UNKNOWN mean a bug.
const CLIENT_ERRORS = new Set([Status.INVALID_ARGUMENT, Status.NOT_FOUND, Status.FAILED_PRECONDITION, Status.RESOURCE_EXHAUSTED, Status.ALREADY_EXISTS, Status.ABORTED]);
const RUNS = Number(process.env.FF_FUZZ_RUNS ?? 720);

const nasty = fc.oneof(
  fc.constantFrom('', ' ', 'a', 'T1', 'tenant!', '../../etc/passwd', '/ff/v1/', 'sb-', 'sb-aaaaaaaaaaaaaaaaaaaa', 'sb-AAAAAAAAAAAAAAAAAAAA', 'sn-bbbbbbbbbbbbbbbbbbbb', 'op-cccccccccccccccccccc', '\u0000', 'x'.repeat(200), '☃', 'tiny', '/tmp/x', '/', '/a/../b', '//x'),
  fc.string({ maxLength: 80 }),
  fc.string({ unit: 'binary', maxLength: 40 }),
);
const smallInt = fc.oneof(fc.constantFrom(0, 1, 2, 63, 64, 65, 255, 256, 257, 4095, 2 ** 31 - 1, 2 ** 32 - 1), fc.nat({ max: 2 ** 32 - 1 }));
const enumInt = fc.oneof(fc.constantFrom(0, 1, 2, 3, 4, 99, -1), fc.integer({ min: -(2 ** 31), max: 2 ** 31 - 1 }));
const bigU64 = fc.oneof(fc.constantFrom(0n, 1n, 63n, 64n, 65n, 256n, 257n, 262_144n, 262_145n, 2n ** 53n, 2n ** 64n - 1n), fc.bigInt({ min: 0n, max: 2n ** 64n - 1n }));
const duration = fc.option(fc.record({ seconds: fc.bigInt({ min: -(2n ** 40n), max: 2n ** 40n }), nanos: fc.integer({ min: -2_000_000_000, max: 2_000_000_000 }) }), { nil: undefined });

describe('Fleet API fuzzing (real gRPC, etcd and NATS)', () => {
  let etcd: EtcdCluster;
  let nats: NatsServer;
  let nc: NatsConnection;
  let store: EtcdFleetStore;
  let server: RunningGrpcServer;
  let api: Api;
  let cases = 0;
  let dir = '';
  let creds: TestCredentials;

  beforeAll(async () => {
    [etcd, nats] = await Promise.all([startEtcd(), startNats()]);
    store = EtcdFleetStore.connect(etcd.endpoints);
    nc = await connect({ servers: nats.url });
    const bus = await NatsWorkBus.create(nc);
    // No leader executor runs here: the only writes to etcd are the API's own.
    const fleet = new Fleet({ store, bus, clock: systemClock, heard: new HeartbeatRegistry(), liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 } });
    // The production edge: TLS, the bearer-token guard and its limits, an admin credential
    // (which may name any tenant, so tenant_id fuzzing still reaches validation).
    dir = tempDir('ff-fuzz-');
    creds = testCredentials(dir);
    const guard = new ApiGuard(new Authenticator(creds.tokensFile, { perSecond: 100, burst: 200 }), { maxStreamsPerCredential: 64 });
    server = await startGrpcServer({
      address: '127.0.0.1:0',
      services: [fleetService({ fleet, store, clock: systemClock })],
      credentials: fleetServerCredentials({ certPem: readFileSync(creds.config.tlsCertPath), keyPem: readFileSync(creds.config.tlsKeyPath) }),
      guard,
    });
    api = creds.client(FleetService, server.address);
  }, 60_000);

  afterAll(async () => {
    api?.close();
    await server?.close();
    await nc?.close();
    store?.close();
    await nats?.stop();
    await etcd?.stop();
    if (dir) rmSync(dir, { recursive: true, force: true });
    // CI runs at least 6,400 fuzz cases (9 properties x RUNS + the truncated streams).
    if (RUNS >= 720) expect(cases).toBeGreaterThanOrEqual(6400);
  });

  async function revision(): Promise<string> {
    const r = await store.etcd.get('/ff/v1/__revision_probe__').exec();
    return r.header.revision;
  }

  /** Calls once; asserts a clean answer within the deadline, a field named by an INVALID_ARGUMENT, and no state change on error. */
  async function probe(call: () => Promise<unknown>): Promise<void> {
    cases++;
    const before = await revision();
    const t0 = Date.now();
    try {
      await call();
    } catch (e) {
      const err = e as RpcError;
      expect(CLIENT_ERRORS.has(err.code), `unexpected ${Status[err.code]}: ${err.message}`).toBe(true);
      // A bad field is named (ff-error-field), so a client can point at it.
      if (err.code === Status.INVALID_ARGUMENT) expect(err.field, `INVALID_ARGUMENT naming no field: ${err.message}`).toMatch(/^[a-z_]/);
      expect(await revision(), `a failed call changed state: ${err.message}`).toBe(before);
    }
    expect(Date.now() - t0).toBeLessThan(5000);
  }

  const opts = { timeoutMs: 5000 };

  it('createSandbox_withArbitraryFields_answersCleanlyAndFailsWithoutSideEffects', async () => {
    await fc.assert(
      fc.asyncProperty(nasty, nasty, nasty, fc.record({ vcpus: smallInt, memoryMib: bigU64, diskMib: bigU64 }), fc.dictionary(nasty, nasty, { maxKeys: 3 }), duration, nasty, async (tenantId, key, image, resources, labels, ttl, hostname) => {
        await probe(() => api.createSandbox({ tenantId, idempotencyKey: key, source: { case: 'image', value: image }, resources, labels, lifecycle: ttl ? { ttl } : {}, hostname }, opts));
      }),
      { numRuns: RUNS },
    );
  });

  it('forkSandbox_withArbitraryFields_answersCleanlyAndFailsWithoutSideEffects', async () => {
    await fc.assert(
      fc.asyncProperty(nasty, nasty, nasty, smallInt, fc.record({ locality: enumInt, spread: enumInt, maxPerHost: smallInt, hostId: nasty }), async (tenantId, key, src, count, placement) => {
        await probe(() => api.forkSandbox({ tenantId, idempotencyKey: key, source: { case: 'snapshotId', value: src }, count, placement }, opts));
      }),
      { numRuns: RUNS },
    );
  });

  // The nested fields: network policy, placement, lifecycle (idle timeout, hooks), a snapshot
  // or sandbox source, labels and snapshot retention.
  const cidr = fc.oneof(nasty, fc.tuple(fc.nat({ max: 300 }), fc.nat({ max: 300 }), fc.nat({ max: 300 }), fc.nat({ max: 300 }), fc.integer({ min: -1, max: 40 })).map(([a, b, c, d, n]) => `${a}.${b}.${c}.${d}/${n}`));
  const hook = fc.record({ argv: fc.array(nasty, { maxLength: 4 }), timeout: duration });
  const lifecycle = fc.record({ ttl: duration, idleTimeout: duration, afterResume: fc.array(hook, { maxLength: 10 }) });
  const placement = fc.record({ locality: enumInt, spread: enumInt, maxPerHost: smallInt, hostId: nasty });
  // Valid often enough that validation goes on to the nested fields.
  const goodKey = fc.oneof(fc.uuid(), nasty);
  /** `arb`, or the field left unset half the time, so that a bad value elsewhere is reached. */
  const orUnset = <T,>(arb: fc.Arbitrary<T>): fc.Arbitrary<T | undefined> => fc.oneof(fc.constant(undefined), arb);
  const goodSource = fc.oneof(fc.constantFrom('tiny', 'sn-bbbbbbbbbbbbbbbbbbbb', 'sb-aaaaaaaaaaaaaaaaaaaa'), nasty);

  it('createSandbox_withArbitraryNetworkPlacementLifecycleAndSource_answersCleanlyAndFailsWithoutSideEffects', async () => {
    await fc.assert(
      fc.asyncProperty(goodKey, fc.boolean(), goodSource, orUnset(fc.record({ allowEgress: fc.boolean(), allowCidrs: fc.array(cidr, { maxLength: 70 }) })), orUnset(placement), orUnset(lifecycle), async (key, fromSnapshot, src, network, place, life) => {
        await probe(() => api.createSandbox({ tenantId: 't', idempotencyKey: key, source: fromSnapshot ? { case: 'snapshotId', value: src } : { case: 'image', value: src }, network, placement: place, lifecycle: life }, opts));
      }),
      { numRuns: RUNS },
    );
  });

  it('forkSandbox_withArbitrarySourceLabelsLifecycleAndRetention_answersCleanlyAndFailsWithoutSideEffects', async () => {
    await fc.assert(
      fc.asyncProperty(goodKey, fc.boolean(), goodSource, fc.oneof(fc.constantFrom(1, 2), smallInt), orUnset(fc.dictionary(nasty, nasty, { maxKeys: 5 })), orUnset(lifecycle), orUnset(fc.record({ ttl: duration, keepLast: smallInt })), async (key, fromSandbox, src, count, labels, life, retention) => {
        await probe(() => api.forkSandbox({ tenantId: 't', idempotencyKey: key, source: fromSandbox ? { case: 'sandboxId', value: src } : { case: 'snapshotId', value: src }, count, labels, lifecycle: life, snapshotRetention: retention }, opts));
      }),
      { numRuns: RUNS },
    );
  });

  it('sandboxOperations_withArbitraryIds_answerCleanly', async () => {
    await fc.assert(
      fc.asyncProperty(fc.constantFrom('pause', 'resume', 'destroy', 'hibernate', 'snapshot', 'get'), nasty, nasty, nasty, async (which, tenantId, key, sandboxId) => {
        const req = { tenantId, idempotencyKey: key, sandboxId };
        await probe(() => {
          switch (which) {
            case 'pause':
              return api.pauseSandbox(req, opts);
            case 'resume':
              return api.resumeSandbox(req, opts);
            case 'destroy':
              return api.destroySandbox(req, opts);
            case 'hibernate':
              return api.hibernateSandbox(req, opts);
            case 'snapshot':
              return api.snapshotSandbox(req, opts);
            default:
              return api.getSandbox(req, opts);
          }
        });
      }),
      { numRuns: RUNS },
    );
  });

  it('exec_withArbitraryArgvPathsAndTimeouts_answersCleanly', async () => {
    await fc.assert(
      fc.asyncProperty(nasty, nasty, fc.array(nasty, { maxLength: 4 }), fc.dictionary(nasty, nasty, { maxKeys: 2 }), nasty, fc.uint8Array({ maxLength: 64 }), duration, async (tenantId, sandboxId, argv, env, cwd, stdin, timeout) => {
        await probe(async () => {
          for await (const _ of api.exec({ tenantId, sandboxId, argv, env, cwd, stdin, ...(timeout ? { timeout } : {}) }, opts)) {
            /* drain */
          }
        });
      }),
      { numRuns: RUNS },
    );
  });

  it('files_withArbitraryPaths_answerCleanly', async () => {
    await fc.assert(
      fc.asyncProperty(nasty, nasty, nasty, bigU64, fc.boolean(), async (tenantId, sandboxId, path, maxBytes, write) => {
        await probe(async () => {
          if (write) {
            await api.writeFile([{ payload: { case: 'header', value: { tenantId, sandboxId, path, mode: 0o644 } } }, { payload: { case: 'data', value: new Uint8Array([1, 2, 3]) } }], opts);
          } else {
            for await (const _ of api.readFile({ tenantId, sandboxId, path, maxBytes }, opts)) {
              /* drain */
            }
          }
        });
      }),
      { numRuns: RUNS },
    );
  });

  it('snapshotsHostsAndOperations_withArbitraryFields_answerCleanly', async () => {
    await fc.assert(
      fc.asyncProperty(fc.constantFrom('getSnapshot', 'pin', 'unpin', 'retention', 'deleteSnapshot', 'cordon', 'drain', 'removeHost', 'getOp', 'waitOp', 'cancelOp', 'listOps', 'usage', 'listSandboxes', 'listSnapshots'), nasty, nasty, nasty, smallInt, duration, async (which, tenantId, key, id, n, d) => {
        await probe(() => {
          switch (which) {
            case 'getSnapshot':
              return api.getSnapshot({ tenantId, snapshotId: id }, opts);
            case 'pin':
              return api.pinSnapshot({ tenantId, idempotencyKey: key, snapshotId: id }, opts);
            case 'unpin':
              return api.unpinSnapshot({ tenantId, idempotencyKey: key, snapshotId: id }, opts);
            case 'retention':
              return api.setSnapshotRetention({ tenantId, idempotencyKey: key, snapshotId: id, retention: { keepLast: n, ...(d ? { ttl: d } : {}) } }, opts);
            case 'deleteSnapshot':
              return api.deleteSnapshot({ tenantId, idempotencyKey: key, snapshotId: id }, opts);
            case 'cordon':
              return api.cordonHost({ idempotencyKey: key, hostId: id, cordon: n % 2 === 0 }, opts);
            case 'drain':
              return api.drainHost({ idempotencyKey: key, hostId: id }, opts);
            case 'removeHost':
              return api.removeHost({ hostId: id }, opts);
            case 'getOp':
              return api.getOperation({ tenantId, operationId: id }, opts);
            case 'waitOp':
              return api.waitOperation({ tenantId, operationId: id, timeout: { seconds: 0n, nanos: 1_000_000 } }, opts);
            case 'cancelOp':
              return api.cancelOperation({ tenantId, operationId: id }, opts);
            case 'usage':
              return api.getTenantUsage({ tenantId }, opts);
            case 'listOps':
              return api.listOperations({ tenantId, pageSize: n, states: [n % 7, -(n % 3)], kinds: [n % 12], targetId: id, pageToken: key }, opts);
            case 'listSandboxes':
              return api.listSandboxes({ tenantId, pageSize: n, states: [n % 20, -(n % 3)] }, opts);
            default:
              return api.listSnapshots({ tenantId, lineageId: id, pageSize: n }, opts);
          }
        });
      }),
      { numRuns: RUNS },
    );
  });

  it('refusals_nameTheFieldAtFault_andWriteNothing', async () => {
    const t = 'refusals';
    const sb = (c: string): string => `sb-${c.repeat(20)}`;
    const sn = (c: string): string => `sn-${c.repeat(20)}`;
    await store.commit([
      { kind: 'snapshot', value: snapshotRecord({ id: sn('c'), tenantId: t, state: 'creating', sourceSandboxId: sb('a'), lineageId: sb('a') }) },
      { kind: 'sandbox', value: sandboxRecord({ id: sb('a'), tenantId: t, lineageId: sb('a') }) },
      { kind: 'sandbox', value: sandboxRecord({ id: sb('h'), tenantId: t, state: 'hibernated', hostId: '', runningSince: null, hibernationSnapshotId: sn('c'), lineageId: sb('h') }) },
    ]);
    const refused = async (call: () => Promise<unknown>, code: Status, field: string): Promise<string> => {
      const before = await revision();
      const e = (await call().then(() => undefined, (x: unknown) => x)) as RpcError | undefined;
      expect(e, `expected ${Status[code]} naming ${field}`).toBeDefined();
      expect([Status[e!.code], e!.field]).toEqual([Status[code], field]);
      expect(await revision(), 'a refused call wrote to etcd').toBe(before);
      return e!.message;
    };
    const big = Object.fromEntries(Array.from({ length: 12 }, (_, i) => [`k${i}`, 'v'.repeat(250)]));
    // Scheduler-owned keys: "__ttl/<sandbox>" is the key of that sandbox's own TTL destroy.
    await refused(() => api.pauseSandbox({ tenantId: t, idempotencyKey: `__ttl/${sb('a')}`, sandboxId: sb('a') }), Status.INVALID_ARGUMENT, 'idempotency_key');
    await refused(() => api.createSandbox({ tenantId: t, idempotencyKey: 'k1', source: { case: 'image', value: 'tiny' }, labels: { a: 'x\u0007' } }), Status.INVALID_ARGUMENT, 'labels["a"]');
    // A key outside printable ASCII is named escaped: gRPC metadata carries only printable
    // ASCII, and sending it raw threw inside the server's error path and ended the process.
    await refused(() => api.createSandbox({ tenantId: t, idempotencyKey: 'k1u', source: { case: 'image', value: 'tiny' }, labels: { 'é\u007f': 'x' } }), Status.INVALID_ARGUMENT, 'labels["\\u00e9\\u007f"]');
    await refused(async () => {
      for await (const _ of api.exec({ tenantId: t, sandboxId: sb('a'), argv: ['true'], env: { Ä: '1' } })) void _;
    }, Status.INVALID_ARGUMENT, 'env["\\u00c4"]');
    // The scheduler's own label keys are not the client's to set (retention acts on them).
    await refused(() => api.snapshotSandbox({ tenantId: t, idempotencyKey: 'k1r', sandboxId: sb('a'), labels: { 'forkfleet.io/hibernation': sb('a') } }), Status.INVALID_ARGUMENT, 'labels["forkfleet.io/hibernation"]');
    // A snapshot still being written cannot be restored (as it cannot be forked).
    await refused(() => api.createSandbox({ tenantId: t, idempotencyKey: 'k2', source: { case: 'snapshotId', value: sn('c') } }), Status.FAILED_PRECONDITION, 'snapshot_id');
    // 256 children with ~3 KiB of labels each do not fit one placement transaction.
    expect(await refused(() => api.forkSandbox({ tenantId: t, idempotencyKey: 'k3', source: { case: 'sandboxId', value: sb('a') }, count: 256, labels: big }), Status.INVALID_ARGUMENT, 'count')).toMatch(/at most \d+ children/);
    await refused(() => api.forkSandbox({ tenantId: t, idempotencyKey: 'k4', source: { case: 'sandboxId', value: sb('h') }, count: 2, snapshotRetention: { keepLast: 1 } }), Status.FAILED_PRECONDITION, 'snapshot_retention');
    // A fork of a snapshot inherits the after_resume hooks of the sandbox it was taken of
    // (~8 KiB here): counted at the API, as the fork's own labels are.
    const hooks = Array.from({ length: 8 }, (_, i) => ({ argv: ['sh', '-c', `${i}`.padEnd(950, '#')], timeoutMs: 1000 }));
    await store.commit([
      { kind: 'sandbox', value: sandboxRecord({ id: sb('k'), tenantId: t, lineageId: sb('k'), afterResume: hooks }) },
      { kind: 'snapshot', value: snapshotRecord({ id: sn('k'), tenantId: t, sourceSandboxId: sb('k'), lineageId: sb('k') }) },
    ]);
    expect(await refused(() => api.forkSandbox({ tenantId: t, idempotencyKey: 'k4h', source: { case: 'snapshotId', value: sn('k') }, count: 200 }), Status.INVALID_ARGUMENT, 'count')).toMatch(/at most \d+ children/);
    // Locality is relative to a snapshot's holders: an image has none.
    await refused(() => api.createSandbox({ tenantId: t, idempotencyKey: 'k4l', source: { case: 'image', value: 'tiny' }, placement: { locality: Locality.CROSS_HOST } }), Status.INVALID_ARGUMENT, 'placement.locality');
    // A placement pinned to a host the fleet does not have would fail only once placed.
    await refused(() => api.createSandbox({ tenantId: t, idempotencyKey: 'k4p', source: { case: 'image', value: 'tiny' }, placement: { hostId: 'no-such-host' } }), Status.INVALID_ARGUMENT, 'placement.host_id');
    await refused(() => api.forkSandbox({ tenantId: t, idempotencyKey: 'k5', source: { case: 'sandboxId', value: sb('a') }, count: 4, placement: { hostId: 'h1', maxPerHost: 2 } }), Status.INVALID_ARGUMENT, 'placement.max_per_host');
    await refused(() => api.setSnapshotRetention({ tenantId: t, idempotencyKey: 'k6', snapshotId: sn('c') }), Status.INVALID_ARGUMENT, 'retention');
    await refused(() => api.listSandboxes({ tenantId: t, pageToken: Buffer.from(sn('c')).toString('base64url') }), Status.INVALID_ARGUMENT, 'page_token');
    // A WriteFile for a sandbox that cannot take it is refused at its header, before any data
    // is pulled (it used to hold up to 64 MiB of the replica's file budget first).
    await store.commit([{ kind: 'sandbox', value: sandboxRecord({ id: sb('p'), tenantId: t, state: 'paused', lineageId: sb('p') }) }]);
    let dataPulled = false;
    async function* pausedWrite(): AsyncGenerator<never> {
      yield { payload: { case: 'header', value: { tenantId: t, sandboxId: sb('p'), path: '/tmp/x', mode: 0o644 } } } as never;
      await new Promise((r) => setTimeout(r, 3000));
      dataPulled = true;
      yield { payload: { case: 'data', value: new Uint8Array(1024) } } as never;
    }
    await refused(() => api.writeFile(pausedWrite()), Status.FAILED_PRECONDITION, 'header.sandbox_id');
    expect(dataPulled).toBe(false);
    // A watch of a sandbox the tenant does not have would never send anything.
    await refused(async () => {
      for await (const _ of api.watchEvents({ tenantId: t, sandboxId: sb('z') })) void _;
    }, Status.NOT_FOUND, 'sandbox_id');
    // A filter value given twice (a request of millions of them stalled the replica).
    await refused(() => api.listSandboxes({ tenantId: t, states: [SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.RUNNING] }), Status.INVALID_ARGUMENT, 'states[2]');
    await refused(() => api.listOperations({ tenantId: t, kinds: new Array<OperationKind>(50_000).fill(OperationKind.FORK) }), Status.INVALID_ARGUMENT, 'kinds[1]');
    // An exec too large for the relay names the part that is large.
    await refused(async () => {
      for await (const _ of api.exec({ tenantId: t, sandboxId: sb('a'), argv: ['true'], env: Object.fromEntries(Array.from({ length: 256 }, (_, i) => [`V${i}`, 'x'.repeat(4096)])) })) void _;
    }, Status.INVALID_ARGUMENT, 'env');
    await refused(async () => {
      for await (const _ of api.watchEvents({ tenantId: t, types: [EventType.SANDBOX_STATE_CHANGED, EventType.HOST_STATE_CHANGED] })) void _;
    }, Status.INVALID_ARGUMENT, 'types[1]');
    // A revision the store has not reached would skip every event up to it without a word.
    const ahead = BigInt(await revision()) + 1000n;
    expect(
      await refused(async () => {
        for await (const _ of api.watchEvents({ tenantId: t, afterRevision: ahead })) void _;
      }, Status.INVALID_ARGUMENT, 'after_revision'),
    ).toContain('ahead of the store');
  });

  it('idempotencyKey_usedAgainForAnotherRequest_isInvalidArgumentNamingIt_andTheFirstOperationStands', async () => {
    const t = 'rekey';
    const sb = (c: string): string => `sb-${c.repeat(20)}`;
    await store.commit([
      { kind: 'sandbox', value: sandboxRecord({ id: sb('a'), tenantId: t, lineageId: sb('a') }) },
      { kind: 'sandbox', value: sandboxRecord({ id: sb('b'), tenantId: t, lineageId: sb('b') }) },
    ]);
    const first = await api.pauseSandbox({ tenantId: t, idempotencyKey: 'once', sandboxId: sb('a') }, opts);
    // The same request again: the same operation.
    expect((await api.pauseSandbox({ tenantId: t, idempotencyKey: 'once', sandboxId: sb('a') }, opts)).id).toBe(first.id);
    const before = await revision();
    for (const other of [() => api.destroySandbox({ tenantId: t, idempotencyKey: 'once', sandboxId: sb('b') }, opts), () => api.pauseSandbox({ tenantId: t, idempotencyKey: 'once', sandboxId: sb('b') }, opts), () => api.destroySandbox({ tenantId: t, idempotencyKey: 'once', sandboxId: sb('a') }, opts)]) {
      const e = (await other().then(() => undefined, (x: unknown) => x)) as RpcError | undefined;
      expect([e && Status[e.code], e?.field]).toEqual([Status[Status.INVALID_ARGUMENT], 'idempotency_key']);
      expect(e?.message).toContain(first.id);
    }
    expect(await revision(), 'a refused call wrote to etcd').toBe(before);
  });

  it('idempotencyKey_usedAgainWithOtherParameters_isInvalidArgumentNamingIt_whileTheSameRequestAgainGetsTheFirstOperation', async () => {
    const t = 'rekey-params';
    const a = `sb-${'p'.repeat(20)}`;
    await store.commit([{ kind: 'sandbox', value: sandboxRecord({ id: a, tenantId: t, lineageId: a }) }]);
    const create = (memoryMib: bigint, labels: Record<string, string> = {}) => api.createSandbox({ tenantId: t, idempotencyKey: 'c', source: { case: 'image', value: 'tiny' }, resources: { memoryMib, vcpus: 1 }, labels }, opts);
    const snapshot = (pin: boolean) => api.snapshotSandbox({ tenantId: t, idempotencyKey: 's', sandboxId: a, pin }, opts);
    const fork = (count: number) => api.forkSandbox({ tenantId: t, idempotencyKey: 'f', source: { case: 'sandboxId', value: a }, count }, opts);
    const hibernate = (replicas: number) => api.hibernateSandbox({ tenantId: t, idempotencyKey: 'h', sandboxId: a, replicas }, opts);
    const cases: Array<[() => Promise<{ id: string }>, Array<() => Promise<unknown>>]> = [
      [() => create(256n, { team: 'rl' }), [() => create(512n, { team: 'rl' }), () => create(256n, { team: 'eval' }), () => create(256n)]],
      [() => snapshot(false), [() => snapshot(true)]],
      [() => fork(1), [() => fork(64)]],
      [() => hibernate(1), [() => hibernate(2)]],
    ];
    for (const [same, others] of cases) {
      const first = await same();
      expect((await same()).id).toBe(first.id);
      const before = await revision();
      for (const other of others) {
        const e = (await other().then(() => undefined, (x: unknown) => x)) as RpcError | undefined;
        expect([e && Status[e.code], e?.field]).toEqual([Status[Status.INVALID_ARGUMENT], 'idempotency_key']);
        expect(e?.message).toContain(first.id);
      }
      expect(await revision(), 'a refused call wrote to etcd').toBe(before);
      expect((await same()).id).toBe(first.id);
    }
  });

  it('rawBytes_thatAreNotAValidMessage_getInvalidArgumentAndServerStaysUp', async () => {
    const raw = new GrpcClient(server.address, fleetChannelCredentials({ caPem: creds.caPem, token: creds.adminToken }), fleetChannelOptions(server.address));
    const methods = ['CreateSandbox', 'ForkSandbox', 'GetSandbox', 'WaitOperation', 'CordonHost', 'Exec'];
    await fc.assert(
      fc.asyncProperty(fc.constantFrom(...methods), fc.uint8Array({ minLength: 1, maxLength: 256 }), async (method, bytes) => {
        cases++;
        const before = await revision();
        const code = await new Promise<Status>((resolve) => {
          const path = `/forkfleet.v1.FleetService/${method}`;
          const ser = (b: Buffer): Buffer => b;
          const de = (b: Buffer): Buffer => b;
          if (method === 'Exec') {
            const call = raw.makeServerStreamRequest(path, ser, de, Buffer.from(bytes), new Metadata(), { deadline: Date.now() + 5000 });
            call.on('data', () => undefined);
            call.on('error', (e: ServiceError) => resolve(e.code));
            call.on('end', () => resolve(Status.OK));
          } else {
            raw.makeUnaryRequest(path, ser, de, Buffer.from(bytes), new Metadata(), { deadline: Date.now() + 5000 }, (e: ServiceError | null) => resolve(e ? e.code : Status.OK));
          }
        });
        expect(code === Status.OK || CLIENT_ERRORS.has(code), `raw ${method}: ${Status[code]}`).toBe(true);
        expect(await revision()).toBe(before);
      }),
      { numRuns: RUNS },
    );
    raw.close();
  });

  it('truncatedWriteFileStream_isRefusedAndTheServerKeepsServing', async () => {
    for (let i = 0; i < 20; i++) {
      cases++;
      const ac = new AbortController();
      async function* parts(): AsyncGenerator<never> {
        yield { payload: { case: 'header', value: { tenantId: 't', sandboxId: 'sb-aaaaaaaaaaaaaaaaaaaa', path: '/tmp/x', mode: 0o644 } } } as never;
        yield { payload: { case: 'data', value: new Uint8Array(1024) } } as never;
        ac.abort(); // the client goes away mid-stream
        await new Promise((r) => setTimeout(r, 5));
      }
      const err = (await api.writeFile(parts(), { signal: ac.signal }).catch((e: unknown) => e)) as RpcError;
      expect(err.code).toBe(Status.CANCELLED);
    }
    // Still serving.
    const e = (await api.getSandbox({ tenantId: 't', sandboxId: 'sb-aaaaaaaaaaaaaaaaaaaa' }).catch((x: unknown) => x)) as RpcError;
    expect(e.code).toBe(Status.NOT_FOUND);
  });
});
