// The gRPC server's health service (grpc.health.v1) over real gRPC on loopback: what probes
// and load balancers hear while the replica cannot serve, and at shutdown. The readiness
// checks are functions of the test (etcd and NATS are checked in scheduler.ts).
import { afterEach, describe, expect, it } from 'vitest';
import { credentials, makeGenericClientConstructor } from '@grpc/grpc-js';
import type { Client, ClientReadableStream, ServiceError } from '@grpc/grpc-js';
import { service as healthService } from 'grpc-health-check';
import type { ServingStatus } from 'grpc-health-check';
import { followReadiness, startGrpcServer } from './server.ts';
import type { Readiness, RunningGrpcServer } from './server.ts';

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
