// The etcd client's wiring, seen on the wire: what metadata each call carries and how etcd's
// refusals come back. A bare gRPC server with etcd's method paths records the calls and
// answers as etcd would (store.int.test.ts runs the store against a real etcd); a real
// member that lost its leader, or etcd's own limits on the metadata, cannot be shown there.
import { afterAll, afterEach, beforeAll, describe, expect, it } from 'vitest';
import { Server, ServerCredentials, status } from '@grpc/grpc-js';
import type { Metadata, MethodDefinition, ServerDuplexStream, ServerUnaryCall, ServiceError, UntypedServiceImplementation, sendUnaryData } from '@grpc/grpc-js';
import { EtcdFleetStore } from './store.ts';
import { StoreDuplicateKeyError, StoreLimitError } from './errors.ts';
import { StoreFullError } from '../../domain/errors.ts';
import type { StoreWrite } from '../../domain/ports.ts';
import { sandboxRecord } from '../../testkit/records.ts';

/** A method of etcd's API by its path, with its messages left as bytes. */
function method(path: string, stream: boolean): MethodDefinition<Buffer, Buffer> {
  const same = (b: Buffer): Buffer => b;
  return { path, requestStream: stream, responseStream: stream, requestSerialize: same, requestDeserialize: same, responseSerialize: same, responseDeserialize: same };
}

/**
 * The answer to a watch's create request: a WatchResponse with a header at revision 1 (field 1,
 * a ResponseHeader with revision, its field 3, = 1) and `created: true` (field 3 = 1).
 */
const WATCH_CREATED = Buffer.from([0x0a, 0x02, 0x18, 0x01, 0x18, 0x01]);
/** The answer to a cancel request: `canceled: true` (field 4) for watch id 0. */
const WATCH_CANCELED = Buffer.from([0x0a, 0x02, 0x18, 0x01, 0x20, 0x01]);

interface Seen {
  path: string;
  hasleader: string[];
}

describe('EtcdFleetStore wiring (a bare gRPC server in etcd\'s place)', () => {
  const server = new Server();
  const seen: Seen[] = [];
  /** Whether the Watch streams end, once their watch is created, as a member that lost its leader ends them. */
  let noLeader = false;
  /** What the next Txn calls are answered with. */
  let txnAnswer: Partial<ServiceError> = { code: status.INVALID_ARGUMENT, details: 'unset' };
  let endpoint = '';
  let store: EtcdFleetStore | undefined;

  const note = (path: string, md: Metadata): void => void seen.push({ path, hasleader: md.get('hasleader').map(String) });

  beforeAll(async () => {
    const unary = (path: string, answer: () => Partial<ServiceError>) => (call: ServerUnaryCall<Buffer, Buffer>, cb: sendUnaryData<Buffer>): void => {
      note(path, call.metadata);
      cb(answer() as ServiceError);
    };
    server.addService({ Range: method('/etcdserverpb.KV/Range', false), Txn: method('/etcdserverpb.KV/Txn', false) }, {
      // Not a fault of the member (etcd3 would retry one): answered at once.
      Range: unary('/etcdserverpb.KV/Range', () => ({ code: status.NOT_FOUND, details: 'test: no reads here' })),
      Txn: unary('/etcdserverpb.KV/Txn', () => txnAnswer),
    } as UntypedServiceImplementation);
    server.addService({ Watch: method('/etcdserverpb.Watch/Watch', true) }, {
      Watch: (call: ServerDuplexStream<Buffer, Buffer>) => {
        note('/etcdserverpb.Watch/Watch', call.metadata);
        // A WatchRequest's create_request is its field 1, cancel_request its field 2. The stream
        // stays open until the client ends it.
        call.on('data', (req: Buffer) => {
          call.write(req[0] === 0x0a ? WATCH_CREATED : WATCH_CANCELED);
          if (noLeader) setTimeout(() => call.emit('error', { code: status.UNAVAILABLE, details: 'etcdserver: no leader' }), 50);
        });
        call.on('end', () => call.end());
        call.on('error', () => undefined);
      },
    } as UntypedServiceImplementation);
    const port = await new Promise<number>((resolve, reject) => server.bindAsync('127.0.0.1:0', ServerCredentials.createInsecure(), (e, p) => (e ? reject(e) : resolve(p))));
    endpoint = `http://127.0.0.1:${port}`;
  });

  afterEach(() => {
    store?.close();
    store = undefined;
    seen.length = 0;
  });

  afterAll(() => {
    server.forceShutdown();
  });

  it('watch_carriesHasLeaderMetadata_soAMemberWithoutLeaderEndsItInsteadOfKeepingItSilent', async () => {
    store = EtcdFleetStore.connect([endpoint], undefined, '', 2000);
    const stop = await store.watchOps(() => undefined, { onError: () => undefined });
    await store.revision().catch(() => undefined); // a unary call, for comparison
    stop();
    const watches = seen.filter((s) => s.path === '/etcdserverpb.Watch/Watch');
    expect(watches.length).toBeGreaterThan(0);
    for (const w of watches) expect(w.hasleader).toEqual(['true']);
    // Only watches: a unary call is answered (or refused) by the member itself.
    const ranges = seen.filter((s) => s.path === '/etcdserverpb.KV/Range');
    expect(ranges.length).toBeGreaterThan(0);
    for (const r of ranges) expect(r.hasleader).toEqual([]);
  });

  it('watch_whenMemberEndsItForWantOfALeader_reportsTheWatchBroken', async () => {
    noLeader = true;
    try {
      store = EtcdFleetStore.connect([endpoint], undefined, '', 2000);
      let broke: ((e: unknown) => void) | undefined;
      const broken = new Promise<unknown>((r) => (broke = r));
      const stop = await store.watchOps(() => undefined, { onError: (e) => broke?.(e) });
      // etcd3 reports the stream's end as 'disconnected', which the store passes on (onBroken):
      // the executor lists the ops again and watches again.
      expect(String(await broken)).toContain('no leader');
      stop();
    } finally {
      noLeader = false;
    }
  });

  const write: StoreWrite[] = [{ kind: 'sandbox', value: sandboxRecord({ id: 'sb-1', tenantId: 't1', lineageId: 'sb-1', hostname: 'sb-1', labels: {}, afterResume: [], allowCidrs: [] }) }];
  const txns = (): number => seen.filter((s) => s.path === '/etcdserverpb.KV/Txn').length;

  it('commit_whenRequestOverGrpcMessageLimit_failsOnceAsStoreLimitErrorNotRetryable', async () => {
    // etcd's gRPC server refuses a message over --max-request-bytes + 512 KiB before etcd sees it.
    txnAnswer = { code: status.RESOURCE_EXHAUSTED, details: 'grpc: received message larger than max (2621500 vs. 2097152)' };
    store = EtcdFleetStore.connect([endpoint], undefined, '', 2000);
    const err: unknown = await store.commit(write).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(StoreLimitError);
    expect(err).toMatchObject({ kind: 'failed_precondition', retryable: false, limit: '--max-request-bytes' });
    expect((err as Error).message).toContain('--max-request-bytes');
    // Sent once: etcd3 retries a RESOURCE_EXHAUSTED (its member-fault policy) by default.
    expect(txns()).toBe(1);
  });

  it('commit_whenTooManyOpsOrTooLarge_failsAsStoreLimitErrorNamingTheEtcdFlag', async () => {
    store = EtcdFleetStore.connect([endpoint], undefined, '', 2000);
    txnAnswer = { code: status.INVALID_ARGUMENT, details: 'etcdserver: too many operations in txn request' };
    await expect(store.commit(write)).rejects.toMatchObject({ name: 'StoreLimitError', kind: 'failed_precondition', retryable: false, limit: '--max-txn-ops', message: expect.stringContaining('--max-txn-ops 1024') });
    txnAnswer = { code: status.INVALID_ARGUMENT, details: 'etcdserver: request is too large' };
    await expect(store.commit(write)).rejects.toMatchObject({ name: 'StoreLimitError', retryable: false, limit: '--max-request-bytes' });
    txnAnswer = { code: status.INVALID_ARGUMENT, details: 'etcdserver: duplicate key given in txn request' };
    await expect(store.commit(write)).rejects.toBeInstanceOf(StoreDuplicateKeyError);
    expect(txns()).toBe(3);
  });

  it('commit_whenEtcdHasTooManyRequests_staysStoreFullErrorRetryable', async () => {
    txnAnswer = { code: status.RESOURCE_EXHAUSTED, details: 'etcdserver: too many requests' };
    store = EtcdFleetStore.connect([endpoint], undefined, '', 2000);
    const err: unknown = await store.commit(write).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(StoreFullError);
    expect(err).toMatchObject({ kind: 'resource_exhausted', retryable: true });
    // Passes with time: etcd3 tries it again, as before.
    expect(txns()).toBe(4);
  });
});

describe('etcd3 member failures (ConnectionPool.markFailed, as store.ts patches it)', () => {
  const member = () => {
    let resets = 0;
    return { resource: { resetAllServices: () => void resets++, faultHandling: { execute: async (fn: () => unknown) => fn() } }, resets: () => resets };
  };

  it('aStreamThisClientCancelledItself_closesNoClientOfTheMember_whileAnUnavailableStreamStillDoes', async () => {
    // A standby's election watch, cancelled once it won, closed every client to the member: ~10 s
    // later grpc-js dropped the new leader's watches and its lease keepalive (seen at every failover).
    const { ConnectionPool } = await import('etcd3/lib/connection-pool.js');
    const markFailed = (ConnectionPool.prototype as unknown as { markFailed(this: unknown, r: unknown, e: Error): void }).markFailed;
    const own = member();
    markFailed.call({}, own.resource, Object.assign(new Error('1 CANCELLED: Cancelled on client'), { code: status.CANCELLED, details: 'Cancelled on client' }));
    expect(own.resets()).toBe(0);
    const broken = member();
    markFailed.call({}, broken.resource, Object.assign(new Error('14 UNAVAILABLE: Connection dropped'), { code: status.UNAVAILABLE, details: 'Connection dropped' }));
    expect(broken.resets()).toBe(1);
  });
});
