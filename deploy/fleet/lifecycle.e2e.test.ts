// Hibernate, wake and retention end to end (issue #8) on a local fleet of 2 hosts in network
// namespaces, with real etcd, NATS, schedulers, agents and QEMU. Each host may book 600 MiB,
// so two 256 MiB guests fill it: that is how "a wake with the host full" is made.
// The schedulers send every event to a webhook receiver in this process that refuses its
// first requests (retries) and checks every signature.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { execFileSync } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { createServer } from 'node:http';
import type { Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { join } from 'node:path';
import { defaultOptions, down, pidAlive, procAlive, qemuPidsByVm, readState, up } from './fleet.ts';
import type { FleetState } from './fleet.ts';
import { fleetApiClient } from './api-credentials.ts';
import type { Client } from '../../services/adapters/grpc/rpc.ts';
import { EventType, OperationState, SandboxState, SnapshotState } from '../../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { Event, Operation , FleetService} from '../../proto/gen/forkfleet/v1/fleet_pb.ts';
import { verifyWebhookSignature } from '../../services/domain/webhooks.ts';

type Api = Client<(typeof FleetService)['method']>;
const DIR = '/var/lib/ffleet-life';
const SECRET = 'e2e-webhook-secret-0123456789';
const tenantId = 'e2e';
let n = 0;
const key = (): string => `life-${Date.now()}-${n++}`;
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

interface Hook {
  delivery: string;
  attempt: number;
  status: number;
  signatureOk: boolean;
  body: { type: string; sandboxId: string; snapshotId: string };
}

/** Bytes of the chunk files in a host's content-addressed store (read from disk, not reported). */
function chunkStoreBytes(dataDir: string): number {
  const out = execFileSync('du', ['-sb', join(dataDir, 'chunks')], { encoding: 'utf8' });
  return Number(out.split(/\s/)[0]);
}

function rssBytes(pid: number): number {
  return Number(readFileSync(`/proc/${pid}/statm`, 'utf8').split(' ')[1]) * 4096;
}

describe('hibernate, wake and retention on a local fleet (2 hosts of 600 MiB, real everything)', () => {
  let state: FleetState;
  let api: Api;
  let receiver: Server;
  const hooks: Hook[] = [];
  let refuseFirst = 3;

  async function done(op: Operation, timeoutS = 240): Promise<Operation> {
    const final = await api.waitOperation({ tenantId, operationId: op.id, timeout: { seconds: BigInt(timeoutS) } }, { timeoutMs: timeoutS * 1000 + 5000 });
    if (final.state !== OperationState.SUCCEEDED) throw new Error(`operation ${op.id} ${OperationState[final.state]}: ${final.error?.message}`);
    return final;
  }

  async function sh(sandboxId: string, script: string): Promise<string> {
    let out = '';
    for await (const r of api.exec({ tenantId, sandboxId, argv: ['/bin/sh', '-c', script], timeout: { seconds: 120n } }, { timeoutMs: 300_000 })) {
      if (r.payload.case === 'stdout') out += Buffer.from(r.payload.value).toString();
    }
    return out;
  }

  async function waitFor<T>(what: string, fn: () => Promise<T | undefined>, timeoutMs: number): Promise<T> {
    const until = Date.now() + timeoutMs;
    for (;;) {
      const v = await fn();
      if (v !== undefined) return v;
      if (Date.now() > until) throw new Error(`timed out waiting for ${what}`);
      await sleep(250);
    }
  }

  const hostUsed = async (hostId: string): Promise<{ used: number; at: number }> => {
    const h = (await api.listHosts({})).hosts.find((x) => x.id === hostId)!;
    return { used: Number(h.memoryUsedBytes), at: Number(h.lastHeartbeat?.seconds ?? 0n) * 1000 + Math.floor((h.lastHeartbeat?.nanos ?? 0) / 1e6) };
  };

  beforeAll(async () => {
    receiver = createServer((req, res) => {
      let body = '';
      req.on('data', (c: Buffer) => (body += c.toString('utf8')));
      req.on('end', () => {
        const status = refuseFirst-- > 0 ? 503 : 200;
        hooks.push({
          delivery: String(req.headers['forkfleet-delivery']),
          attempt: Number(req.headers['forkfleet-attempt']),
          status,
          signatureOk: verifyWebhookSignature(SECRET, body, String(req.headers['forkfleet-signature']), Math.floor(Date.now() / 1000)),
          body: JSON.parse(body) as Hook['body'],
        });
        res.writeHead(status).end();
      });
    });
    await new Promise<void>((r) => receiver.listen(0, '127.0.0.1', () => r()));
    const port = (receiver.address() as AddressInfo).port;
    if (readState(DIR)) await down(DIR);
    state = await up(
      defaultOptions({
        hosts: 2,
        etcd: 1,
        link: '10gbit',
        dir: DIR,
        prefix: 'ffh',
        basePort: 15700,
        hostMemoryMib: 600,
        schedulerEnv: {
          FF_SNAPSHOT_EXPIRY_NOTICE: '2s',
          FF_WEBHOOKS: JSON.stringify([{ url: `http://127.0.0.1:${port}/hook`, secret: SECRET }]),
          FF_WEBHOOK_RETRY_BASE: '300ms',
        },
        agentEnv: { FF_GC_GRACE: '1s' },
      }),
    );
    api = await fleetApiClient(DIR, state.apiAddresses[0]!);
  }, 300_000);

  afterAll(async () => {
    api?.close();
    await down(DIR);
    await new Promise<void>((r) => receiver.close(() => r()));
    expect(execFileSync('ip', ['netns', 'list'], { encoding: 'utf8' })).not.toMatch(/\bffh-/);
    for (const p of state.procs) expect(procAlive(p)).toBe(false);
    expect(existsSync(DIR)).toBe(false);
  }, 120_000);

  let a = '';
  let h1 = '';
  let h2 = '';
  let workerPid = '';
  let e = '';

  it('idleSandbox_hibernatesOnSchedule_andItsHostsUsedMemoryDropsByAtLeastItsRss', async () => {
    [h1, h2] = state.hosts.map((h) => h.id) as [string, string];
    const c = await done(await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, placement: { hostId: h1 }, lifecycle: { idleTimeout: { seconds: 8n } } }));
    a = c.result.case === 'sandbox' ? c.result.value.id : '';
    // State to survive the hibernation: a file, 32 MiB of memory in use, a running process.
    // The sandbox hibernates whenever it is idle for 8 s, in this test and in the later ones.
    workerPid = (await sh(a, 'echo before-hibernate > /root/note; dd if=/dev/urandom of=/dev/shm/blob bs=1M count=32 2>/dev/null; (while true; do sleep 1; done) >/dev/null 2>&1 & echo $!')).trim();
    expect(workerPid).toMatch(/^\d+$/);
    const dataDir = state.hosts.find((h) => h.id === h1)!.dataDir;
    const pid = qemuPidsByVm(dataDir).get(a)!.find(pidAlive)!;
    const rss = rssBytes(pid);
    // The host's used memory, as the fleet reports it, from a heartbeat after the RSS reading.
    const t0 = Date.now();
    const before = await waitFor('a heartbeat after the RSS reading', async () => {
      const u = await hostUsed(h1);
      return u.at > t0 ? u : undefined;
    }, 10_000);
    const sb = await waitFor('the idle sandbox to hibernate', async () => {
      const s = await api.getSandbox({ tenantId, sandboxId: a });
      return s.state === SandboxState.HIBERNATED ? s : undefined;
    }, 120_000);
    expect(sb.hibernationSnapshotId).not.toBe('');
    expect(qemuPidsByVm(dataDir).get(a)?.some(pidAlive) ?? false).toBe(false);
    const t1 = Date.now();
    const after = await waitFor('a heartbeat after the hibernation', async () => {
      const u = await hostUsed(h1);
      return u.at > t1 ? u : undefined;
    }, 10_000);
    expect(rss).toBeGreaterThan(32 * 2 ** 20);
    expect(before.used - after.used).toBeGreaterThanOrEqual(rss);
  }, 240_000);

  it('execOnHibernatedSandboxWhoseHostIsFull_wakesItOnTheOtherHost_withFilesAndProcessesIntact', async () => {
    // Fill h1 with two children of the hibernated sandbox (forked from its hibernation
    // snapshot without waking it): 2 x 256 MiB of 600.
    const f = await done(await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'sandboxId', value: a }, count: 2, placement: { hostId: h1 }, lifecycle: { idleTimeout: { seconds: 0n } } }));
    const kids = f.result.case === 'fork' ? f.result.value.children : [];
    expect(kids.map((k) => k.hostId)).toEqual([h1, h1]);
    expect((await api.getSandbox({ tenantId, sandboxId: a })).state).toBe(SandboxState.HIBERNATED);

    const out = await sh(a, `cat /root/note; kill -0 ${workerPid} && echo worker-alive; wc -c < /dev/shm/blob`);
    expect(out).toBe(`before-hibernate\nworker-alive\n${32 * 2 ** 20}\n`);
    const woken = await api.getSandbox({ tenantId, sandboxId: a });
    expect(woken.state).toBe(SandboxState.RUNNING);
    expect(woken.hostId).toBe(h2);
    for (const k of kids) await done(await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: k.id }));
  }, 240_000);

  it('pausedAndHibernatedTime_doNotConsumeTheTtl_andAfterResumeHooksRunEveryTime', async () => {
    const ttlS = 15;
    const f = await done(
      await api.forkSandbox({
        tenantId,
        idempotencyKey: key(),
        source: { case: 'sandboxId', value: a },
        count: 1,
        // No idle hibernation for this child (its source has one): the TTL clock is what is watched.
        lifecycle: { ttl: { seconds: BigInt(ttlS) }, idleTimeout: { seconds: 0n }, afterResume: [{ argv: ['/bin/sh', '-c', 'echo ran >> /root/hook-runs'] }] },
      }),
    );
    const d = f.result.case === 'fork' ? f.result.value.children[0]!.id : '';
    const runs = async () => (await sh(d, 'cat /root/hook-runs | wc -l')).trim();
    expect(await runs()).toBe('1'); // after the restore

    await done(await api.pauseSandbox({ tenantId, idempotencyKey: key(), sandboxId: d }));
    await sleep((ttlS + 5) * 1000);
    await done(await api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId: d }));
    expect(await runs()).toBe('2'); // after the resume

    await done(await api.hibernateSandbox({ tenantId, idempotencyKey: key(), sandboxId: d }));
    await sleep(5000);
    expect(await runs()).toBe('3'); // the exec woke it: after the wake
    const s = await api.getSandbox({ tenantId, sandboxId: d });
    expect(s.state).toBe(SandboxState.RUNNING);
    const ranMs = Number(s.runningTime?.seconds ?? 0n) * 1000;
    // Wall time since the fork is well over the TTL; running time is not.
    expect(ranMs).toBeLessThan(ttlS * 1000);

    // Running time does reach the TTL eventually: then the sandbox is destroyed.
    const gone = await waitFor('the TTL to destroy the sandbox', async () => {
      const x = await api.getSandbox({ tenantId, sandboxId: d });
      return x.state === SandboxState.DESTROYED ? x : undefined;
    }, (ttlS + 30) * 1000);
    expect(Number(gone.runningTime?.seconds ?? 0n)).toBeGreaterThanOrEqual(ttlS);
  }, 300_000);

  it('keepLastN_prunesTheOldestSnapshotAfterAnnouncingIt_andGcFreesItsChunks', async () => {
    const events: Event[] = [];
    const ctl = new AbortController();
    const watching = (async () => {
      try {
        // Not the progress markers (type UNSPECIFIED; a watch from now starts with one).
        for await (const e of api.watchEvents({ tenantId, types: [EventType.SNAPSHOT_EXPIRING, EventType.SNAPSHOT_EXPIRED] }, { signal: ctl.signal })) if (e.type !== EventType.UNSPECIFIED) events.push(e);
      } catch {
        /* cancelled */
      }
    })();
    // A child of the idle sandbox that never idles (the idle one hibernates between calls).
    const f = await done(await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'sandboxId', value: a }, count: 1, lifecycle: { idleTimeout: { seconds: 0n } } }));
    const child = f.result.case === 'fork' ? f.result.value.children[0]! : undefined;
    e = child!.id;
    const host = state.hosts.find((h) => h.id === child!.hostId)!;
    const snaps: string[] = [];
    for (let i = 0; i < 3; i++) {
      // 8 MiB of fresh random bytes, written over the same file each time: each snapshot
      // holds chunks no other snapshot has.
      await sh(e, 'dd if=/dev/urandom of=/dev/shm/blob bs=1M count=8 conv=notrunc 2>/dev/null; sync');
      const s = await done(await api.snapshotSandbox({ tenantId, idempotencyKey: key(), sandboxId: e, retention: { keepLast: 2 } }));
      snaps.push(s.result.case === 'snapshot' ? s.result.value.id : '');
      if (i === 1) await sleep(3000); // nothing is pruned while the lineage has at most 2
    }
    const withThree = chunkStoreBytes(host.dataDir);
    // A deleted snapshot is NOT_FOUND to the API.
    const gone = (id: string) => api.getSnapshot({ tenantId, snapshotId: id }).then((s) => s.state === SnapshotState.DELETED, (e: { code?: number }) => e.code === 5);
    await waitFor('the oldest snapshot to be deleted by retention', async () => ((await gone(snaps[0]!)) ? true : undefined), 60_000);
    for (const id of snaps.slice(1)) expect((await api.getSnapshot({ tenantId, snapshotId: id })).state).toBe(SnapshotState.READY);
    // The host deleted its manifest and collected the chunks only it reached.
    const freed = await waitFor('GC to free the pruned snapshot chunks', async () => {
      const d = withThree - chunkStoreBytes(host.dataDir);
      return d >= 4 * 2 ** 20 ? d : undefined;
    }, 30_000);
    expect(freed).toBeGreaterThanOrEqual(4 * 2 ** 20);
    await waitFor('both retention events', async () => (events.length >= 2 ? true : undefined), 10_000);
    ctl.abort();
    await watching;
    const forFirst = events.filter((e) => e.snapshotId === snaps[0]);
    expect(forFirst.map((e) => e.type)).toEqual([EventType.SNAPSHOT_EXPIRING, EventType.SNAPSHOT_EXPIRED]);
    // Announced before it happened.
    expect(Number(forFirst[0]!.revision)).toBeLessThan(Number(forFirst[1]!.revision));
    // The two kept snapshots were not announced.
    expect(events.filter((e) => snaps.slice(1).includes(e.snapshotId))).toEqual([]);
  }, 240_000);

  it('webhooks_signaturesVerify_andAFailingReceiverGetsRetries', async () => {
    await waitFor('the expiry webhooks', async () => (hooks.some((h) => h.body.type === 'snapshot_expired' && h.status === 200) ? true : undefined), 30_000);
    expect(hooks.every((h) => h.signatureOk)).toBe(true);
    const refused = hooks.filter((h) => h.status === 503);
    expect(refused.length).toBe(3);
    // Each refused delivery came again, with a higher attempt number, and was accepted.
    for (const r of refused) expect(hooks.some((h) => h.delivery === r.delivery && h.attempt > r.attempt && h.status === 200)).toBe(true);
    const types = new Set(hooks.filter((h) => h.status === 200).map((h) => h.body.type));
    for (const t of ['sandbox_created', 'snapshot_created', 'sandbox_hibernated', 'sandbox_woken', 'sandbox_restored', 'snapshot_expiring', 'snapshot_expired']) expect(types, t).toContain(t);
    for (const id of [a, e]) await done(await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
  }, 120_000);
});
