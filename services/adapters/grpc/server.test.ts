// The gRPC server's health service (grpc.health.v1) over real gRPC on loopback: what probes
// and load balancers hear while the replica cannot serve, and at shutdown; and what server
// reflection tells buf curl (the repo's own buf binary). The readiness checks are functions of
// the test (etcd and NATS are checked in scheduler.ts).
import { execFile } from 'node:child_process';
import { resolve } from 'node:path';
import { promisify } from 'node:util';
import { afterEach, describe, expect, it } from 'vitest';
import { create, createFileRegistry, fromBinary } from '@bufbuild/protobuf';
import { FileDescriptorProtoSchema, FileDescriptorSetSchema } from '@bufbuild/protobuf/wkt';
import { credentials, makeGenericClientConstructor } from '@grpc/grpc-js';
import type { Client, ClientReadableStream, ServiceError } from '@grpc/grpc-js';
import { service as healthService } from 'grpc-health-check';
import type { ServingStatus } from 'grpc-health-check';
import { register } from './rpc.ts';
import { asProtocWritesIt, followReadiness, startGrpcServer } from './server.ts';
import type { Readiness, RunningGrpcServer } from './server.ts';
import { EchoService } from '../../../proto/gen/forkfleet/testing/v1/echo_pb.ts';

type HealthClient = Client & {
  check(req: { service: string }, cb: (err: ServiceError | null, res?: { status: ServingStatus }) => void): void;
  watch(req: { service: string }): ClientReadableStream<{ status: ServingStatus }>;
};
const HealthClientCtor = makeGenericClientConstructor(healthService as never, 'Health') as unknown as new (address: string, creds: ReturnType<typeof credentials.createInsecure>) => HealthClient;

function statusOf(client: HealthClient): Promise<ServingStatus> {
  return new Promise((resolve, reject) => client.check({ service: '' }, (err, res) => (err ? reject(err) : resolve(res!.status))));
}

let server: RunningGrpcServer | undefined;
let client: HealthClient | undefined;
let readiness: Readiness | undefined;

afterEach(async () => {
  readiness?.stop();
  client?.close();
  await server?.close(100);
  [server, client, readiness] = [undefined, undefined, undefined];
});

async function started(): Promise<{ server: RunningGrpcServer; client: HealthClient }> {
  server = await startGrpcServer({ address: '127.0.0.1:0', services: [] });
  client = new HealthClientCtor(server.address, credentials.createInsecure());
  return { server, client };
}

describe('gRPC health', () => {
  it('readiness_whileACheckFailsThrowsOrHangs_answersNotServing_andServingAgainOnceAllPass', async () => {
    const { server, client } = await started();
    let etcd: 'up' | 'down' | 'hung' | 'throws' = 'up';
    let nats = true;
    const changes: Array<[boolean, readonly string[]]> = [];
    readiness = followReadiness(
      server,
      [
        { name: 'etcd', ready: () => (etcd === 'up' ? Promise.resolve(true) : etcd === 'down' ? Promise.resolve(false) : etcd === 'hung' ? new Promise<boolean>(() => undefined) : Promise.reject(new Error('unreachable'))) },
        { name: 'nats', ready: () => nats },
      ],
      { everyMs: 60_000, timeoutMs: 100, onChange: (serving, failing) => changes.push([serving, failing]) },
    );
    expect(await readiness.check()).toBe(true);
    expect(await statusOf(client)).toBe('SERVING');
    for (const state of ['down', 'hung', 'throws'] as const) {
      etcd = state;
      expect(await readiness.check()).toBe(false);
      expect(await statusOf(client), state).toBe('NOT_SERVING');
    }
    etcd = 'up';
    nats = false;
    expect(await readiness.check()).toBe(false);
    expect(await statusOf(client)).toBe('NOT_SERVING');
    nats = true;
    expect(await readiness.check()).toBe(true);
    expect(await statusOf(client)).toBe('SERVING');
    // Told on changes only.
    expect(changes).toEqual([
      [false, ['etcd']],
      [true, []],
    ]);
  });

  it('readiness_checksOnItsOwnEveryInterval_andNoLongerOnceStopped', async () => {
    const { server, client } = await started();
    let ok = true;
    let asked = 0;
    readiness = followReadiness(server, [{ name: 'etcd', ready: () => (asked++, ok) }], { everyMs: 20, timeoutMs: 100 });
    ok = false;
    await expect.poll(() => statusOf(client), { timeout: 2000, interval: 20 }).toBe('NOT_SERVING');
    ok = true;
    await expect.poll(() => statusOf(client), { timeout: 2000, interval: 20 }).toBe('SERVING');
    readiness.stop();
    const before = asked;
    ok = false;
    await new Promise((r) => setTimeout(r, 100));
    expect(asked).toBeLessThanOrEqual(before + 1); // a round already running when stopped
    expect(await statusOf(client)).toBe('SERVING');
  });

  it('close_tellsHealthWatchersNotServingBeforeTheServerShutsDown_andReadinessCannotUndoIt', async () => {
    const { server, client } = await started();
    const seen: ServingStatus[] = [];
    const watch = client.watch({ service: '' });
    watch.on('data', (m: { status: ServingStatus }) => seen.push(m.status));
    watch.on('error', () => undefined);
    await expect.poll(() => seen, { timeout: 2000, interval: 10 }).toEqual(['SERVING']);
    // The open Watch stream holds the graceful shutdown until it is forced (300 ms).
    const closing = server.close(300);
    server.setServing('SERVING'); // a readiness round finishing meanwhile
    await expect.poll(() => seen, { timeout: 2000, interval: 10 }).toEqual(['SERVING', 'NOT_SERVING']);
    await closing;
  });
});

describe('gRPC reflection', () => {
  it('listsTheHealthServiceWithTheServices_soBufCurlCanCallHealthCheck', async () => {
    server = await startGrpcServer({
      address: '127.0.0.1:0',
      services: [register(EchoService, { async echo() { return {}; }, async *echoServerStream() {}, async echoClientStream() { return {}; }, async *echoBidi() {} })],
    });
    const buf = (...args: string[]): Promise<{ stdout: string }> => promisify(execFile)(resolve(import.meta.dirname, '../../../node_modules/.bin/buf'), ['curl', '--protocol', 'grpc', '--http2-prior-knowledge', ...args]);
    const listed = (await buf('--list-services', `http://${server.address}`)).stdout.split('\n').filter(Boolean);
    expect(listed).toEqual(expect.arrayContaining(['forkfleet.testing.v1.EchoService', 'grpc.health.v1.Health']));
    // Found by reflection, as an SRE's `buf curl .../grpc.health.v1.Health/Check` finds it.
    expect(JSON.parse((await buf(`http://${server.address}/grpc.health.v1.Health/Check`)).stdout)).toEqual({ status: 'SERVING' });
  });
});

describe('asProtocWritesIt', () => {
  it('healthProtoAsProtoLoaderWroteIt_becomesAFileProtobufEsReads_withItsMapFieldAMap', () => {
    const file = fromBinary(FileDescriptorProtoSchema, Object.values(healthService)[0]!.requestType.fileDescriptorProtos[0]!);
    const registry = createFileRegistry(create(FileDescriptorSetSchema, { file: [asProtocWritesIt(file)] }));
    expect(registry.getService('grpc.health.v1.Health')?.methods.map((m) => m.name)).toEqual(['Check', 'Watch', 'List']);
    expect(registry.getMessage('grpc.health.v1.HealthListResponse')?.field.statuses?.fieldKind).toBe('map');
    expect(registry.getMessage('grpc.health.v1.HealthCheckResponse')?.field.status?.enum?.typeName).toBe('grpc.health.v1.HealthCheckResponse.ServingStatus');
  });
});
