// End to end through the public API on one machine: real etcd, real nats-server, a
// scheduler replica, and two real host agents running QEMU (TCG here).
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { readFileSync, rmSync } from 'node:fs';
import { join } from 'node:path';
import { pino } from 'pino';
import { status as Status } from '@grpc/grpc-js';
import { Etcd3 } from 'etcd3';
import { connect } from 'nats';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import { subjects, WORK_ACK_WAIT_MS } from './adapters/nats/subjects.ts';
import { HostFileRequestSchema, HostFileResponseSchema } from '../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { startEtcd } from './testkit/etcd.ts';
import { keys } from './adapters/etcd/keys.ts';
import type { EtcdCluster } from './testkit/etcd.ts';
import { startNats } from './testkit/nats.ts';
import type { NatsServer } from './testkit/nats.ts';
import { startAgent } from './testkit/agent.ts';
import type { AgentProcess } from './testkit/agent.ts';
import { pidAlive, waitFor, tempDir } from './testkit/proc.ts';
import { qemuPidsByVm } from '../deploy/fleet/fleet.ts';
import { compileSchedulerConfig } from './config.ts';
import { startScheduler } from './scheduler.ts';
import type { SchedulerHandle } from './scheduler.ts';
import { testCredentials } from './testkit/credentials.ts';
import type { Client } from './adapters/grpc/rpc.ts';
import type { RpcError } from './adapters/grpc/status.ts';
import { FleetService, OperationState, SandboxState } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { Operation } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import { Locality } from '../proto/gen/forkfleet/v1/common_pb.ts';

type Fleet = Client<(typeof FleetService)['method']>;
const tenantId = 't1';
let keyN = 0;
const key = (): string => `k-${Date.now()}-${keyN++}`;

async function done(api: Fleet, op: Operation): Promise<Operation> {
  const final = await api.waitOperation({ tenantId, operationId: op.id, timeout: { seconds: 300n } }, { timeoutMs: 310_000 });
  if (final.state !== OperationState.SUCCEEDED) throw new Error(`operation ${op.id} ${OperationState[final.state]}: ${final.error?.message}`);
  return final;
}

async function sh(api: Fleet, sandboxId: string, script: string): Promise<{ out: string; code: number }> {
  let out = '';
  let code = -1;
  for await (const r of api.exec({ tenantId, sandboxId, argv: ['/bin/sh', '-c', script], timeout: { seconds: 60n } })) {
    if (r.payload.case === 'stdout') out += Buffer.from(r.payload.value).toString();
    if (r.payload.case === 'exit') code = r.payload.value.exitCode;
  }
  return { out, code };
}

describe('scheduler + host agents (real etcd, NATS, QEMU)', () => {
  let etcd: EtcdCluster;
  let nats: NatsServer;
  let sched: SchedulerHandle;
  const agents: AgentProcess[] = [];
  let api: Fleet;
  let dir: string;

  beforeAll(async () => {
    dir = tempDir('ff-sched-');
    [etcd, nats] = await Promise.all([startEtcd(), startNats()]);
    const keyPath = join(dir, 'signing.pem');
    const creds = testCredentials(dir);
    sched = await startScheduler(
      compileSchedulerConfig({ grpcAddr: '127.0.0.1:0', etcdEndpoints: etcd.endpoints.join(','), natsUrl: nats.url, signingKeyPath: keyPath, suspectAfterMs: '3s', lostAfterMs: '20s', ...creds.config }),
      // FF_TEST_SCHED_LOG=info shows the scheduler's log (it runs in this process).
      pino({ level: process.env.FF_TEST_SCHED_LOG ?? 'warn' }),
    );
    await sched.leader;
    for (const hostId of ['host-a', 'host-b']) agents.push(await startAgent({ hostId, natsUrl: nats.url, trustedKeyPath: `${keyPath}.pub`, ...(process.env.FF_TEST_LOG_DIR ? { logDir: process.env.FF_TEST_LOG_DIR } : {}) }));
    api = creds.client(FleetService, sched.address);
    await waitFor('both hosts registered', async () => (await api.listHosts({})).hosts.length === 2, 20_000, 100);
  }, 240_000);

  afterAll(async () => {
    api?.close();
    await sched?.close();
    await Promise.all(agents.map((a) => a.teardown()));
    await nats?.stop();
    await etcd?.stop();
    if (dir) rmSync(dir, { recursive: true, force: true });
  }, 120_000);

  it('createSandbox_withMalformedTenant_isInvalidArgumentNamingTheField', async () => {
    const e = (await api.createSandbox({ tenantId: 'Not a tenant!', idempotencyKey: key(), source: { case: 'image', value: 'tiny' } }).catch((x: unknown) => x)) as RpcError;
    expect(e.code).toBe(Status.INVALID_ARGUMENT);
    expect(e.field).toBe('tenant_id');
  });

  it('forkSandbox_withCountOverCap_isInvalidArgumentAndCreatesNothing', async () => {
    const before = (await api.listSandboxes({ tenantId })).sandboxes.length;
    const e = (await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: 'sn-aaaaaaaaaaaaaaaaaaaa' }, count: 100_000 }).catch((x: unknown) => x)) as RpcError;
    expect(e.code).toBe(Status.INVALID_ARGUMENT);
    expect(e.field).toBe('count');
    expect((await api.listSandboxes({ tenantId })).sandboxes.length).toBe(before);
  });

  it('lifecycle_createExecSnapshotForkPauseResumeDestroy_overThePublicApi', async () => {
    // create, idempotently
    const k = key();
    const op1 = await api.createSandbox({ tenantId, idempotencyKey: k, source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } });
    const again = await api.createSandbox({ tenantId, idempotencyKey: k, source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } });
    expect(again.id).toBe(op1.id);
    const created = await done(api, op1);
    expect(created.result.case).toBe('sandbox');
    const parent = created.result.case === 'sandbox' ? created.result.value : undefined;
    expect(parent?.state).toBe(SandboxState.RUNNING);
    const parentId = parent!.id;

    // exec and state in the guest
    expect(await sh(api, parentId, 'echo hello; exit 3')).toEqual({ out: 'hello\n', code: 3 });
    await sh(api, parentId, 'echo parent-state > /tmp/state; (i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.2; done) >/dev/null 2>&1 &');

    // snapshot
    const snapOp = await done(api, await api.snapshotSandbox({ tenantId, idempotencyKey: key(), sandboxId: parentId }));
    const snap = snapOp.result.case === 'snapshot' ? snapOp.result.value : undefined;
    expect(snap?.hostIds.length).toBe(1);
    expect(snap?.vmConfig?.memoryMib).toBe(256n);
    const snapshotId = snap!.id;
    const holder = snap!.hostIds[0]!;

    // fork 2 on the holder and 1 across hosts
    const same = await done(api, await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 2, placement: { locality: Locality.SAME_HOST } }));
    const cross = await done(api, await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 1, placement: { locality: Locality.CROSS_HOST } }));
    const sameKids = same.result.case === 'fork' ? same.result.value.children : [];
    const crossKids = cross.result.case === 'fork' ? cross.result.value.children : [];
    expect(sameKids.map((c) => c.hostId)).toEqual([holder, holder]);
    expect(crossKids.length).toBe(1);
    expect(crossKids[0]!.hostId).not.toBe(holder);
    const kids = [...sameKids, ...crossKids];

    // children carry the parent's state and keep its process running, then diverge
    for (const [i, c] of kids.entries()) {
      const r = await sh(api, c.id, `cat /tmp/state; a=$(cat /tmp/counter); sleep 1; b=$(cat /tmp/counter); [ "$b" -gt "$a" ] && echo counting; echo child-${i} > /tmp/state; hostname`);
      expect(r.out).toContain('parent-state');
      expect(r.out).toContain('counting');
      expect(r.out.trim().split('\n').pop()).toBe(c.id);
    }
    for (const [i, c] of kids.entries()) expect((await sh(api, c.id, 'cat /tmp/state')).out).toBe(`child-${i}\n`);
    expect((await sh(api, parentId, 'cat /tmp/state')).out).toBe('parent-state\n');

    // The cross-host child came by migration from the holder (ADR 0015), so the other host does
    // not hold the snapshot; three children there are forked from a fetched copy, so then it does.
    expect((await api.getSnapshot({ tenantId, snapshotId })).hostIds).toEqual([holder]);
    const other = crossKids[0]!.hostId;
    const three = await done(api, await api.forkSandbox({ tenantId, idempotencyKey: key(), source: { case: 'snapshotId', value: snapshotId }, count: 3, placement: { locality: Locality.CROSS_HOST, hostId: other } }));
    const threeKids = three.result.case === 'fork' ? three.result.value.children : [];
    expect(threeKids.map((c) => c.hostId)).toEqual([other, other, other]);
    expect((await sh(api, threeKids[0]!.id, 'cat /tmp/state')).out).toBe('parent-state\n');
    expect(new Set((await api.getSnapshot({ tenantId, snapshotId })).hostIds)).toEqual(new Set([holder, other]));
    kids.push(...threeKids);

    // pause and resume
    const paused = await done(api, await api.pauseSandbox({ tenantId, idempotencyKey: key(), sandboxId: parentId }));
    expect(paused.result.case === 'sandbox' && paused.result.value.state).toBe(SandboxState.PAUSED);
    const execPaused = (await sh(api, parentId, 'true').catch((e: unknown) => e)) as RpcError;
    expect(execPaused.code).toBe(Status.FAILED_PRECONDITION);
    const resumed = await done(api, await api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId: parentId }));
    expect((await sh(api, parentId, 'echo back')).out).toBe('back\n');
    // The sandbox's new state and the op's end were committed in one transaction: no reader
    // ever sees a finished resume on a paused sandbox, or a running sandbox with its resume open.
    const etcdClient = new Etcd3({ hosts: etcd.endpoints });
    try {
      const [opKv, sbKv] = await Promise.all([keys.op(tenantId, resumed.id), keys.sandbox(tenantId, parentId)].map(async (k) => (await etcdClient.get(k).exec()).kvs[0]));
      expect(opKv?.mod_revision).toBeDefined();
      expect(opKv?.mod_revision).toBe(sbKv?.mod_revision);
    } finally {
      etcdClient.close();
    }

    // destroy everything: no QEMU left on any host, capacity released
    for (const id of [parentId, ...kids.map((c) => c.id)]) await done(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
    await waitFor('no QEMU left', async () => agents.every((a) => a.qemuPids().filter(pidAlive).length === 0), 20_000, 200);
    const hosts = (await api.listHosts({})).hosts;
    for (const h of hosts) expect(h.allocated?.memoryMib ?? 0n).toBe(0n);
    const live = (await api.listSandboxes({ tenantId })).sandboxes;
    expect(live.filter((s) => s.state !== SandboxState.DESTROYED && s.state !== SandboxState.FAILED)).toEqual([]);
  }, 300_000);

  it('idleSandbox_hibernatesOnSchedule_thenExecWakesItWithFilesAndProcessesIntact', async () => {
    const created = await done(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, lifecycle: { idleTimeout: { seconds: 4n } } }));
    const sb = created.result.case === 'sandbox' ? created.result.value : undefined;
    const id = sb!.id;
    await sh(api, id, 'echo kept > /tmp/kept; (i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 1; done) >/dev/null 2>&1 &');
    const host = agents.find((a) => a.hostId === sb!.hostId)!;
    const pidsBefore = host.qemuPids().filter(pidAlive);
    expect(pidsBefore.length).toBeGreaterThan(0);
    const memBefore = (await api.listHosts({})).hosts.find((h) => h.id === sb!.hostId)!.allocated!.memoryMib;

    // Idle: no calls; the guest's counter sleeps most of the time.
    await waitFor('hibernated', async () => (await api.getSandbox({ tenantId, sandboxId: id })).state === SandboxState.HIBERNATED, 90_000, 500);
    const hib = await api.getSandbox({ tenantId, sandboxId: id });
    expect(hib.hibernationSnapshotId).toMatch(/^sn-/);
    expect(pidsBefore.filter(pidAlive)).toEqual([]); // its QEMU is gone: CPU and RAM given back
    const memAfter = (await api.listHosts({})).hosts.find((h) => h.id === sb!.hostId)!.allocated!.memoryMib;
    expect(memBefore - memAfter).toBe(256n);

    // Any call wakes it: two concurrent execs share one wake.
    const [a, b] = await Promise.all([sh(api, id, 'cat /tmp/kept; cat /tmp/counter'), sh(api, id, 'cat /tmp/kept')]);
    expect(a.out.split('\n')[0]).toBe('kept');
    expect(b.out).toBe('kept\n');
    const c1 = Number(a.out.split('\n')[1]);
    await new Promise((r) => setTimeout(r, 2500));
    const c2 = Number((await sh(api, id, 'cat /tmp/counter')).out);
    expect(c2).toBeGreaterThan(c1); // the counter process survived hibernation and runs again
    expect((await api.getSandbox({ tenantId, sandboxId: id })).state).toBe(SandboxState.RUNNING);
    await done(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
  }, 300_000);

  it('files_largerThanANatsMessage_roundTripInPieces_withTheirMode_aFailedWriteLeavesTheOldFile_andAnOversizedExecOrAMissingPathIsAClientError', async () => {
    const created = await done(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }));
    const sb = created.result.case === 'sandbox' ? created.result.value : undefined;
    const agent = agents.find((a) => a.hostId === sb!.hostId)!;
    // 3 MiB: three times NATS' default max_payload, which one relayed message used to be.
    const data = Buffer.alloc(3 << 20);
    for (let i = 0; i < data.length; i += 4) data.writeUInt32LE((i * 2654435761) >>> 0, i);
    const header = { tenantId, idempotencyKey: key(), sandboxId: sb!.id, path: '/tmp/big.bin', mode: 0o750 };
    const pieces = [0, 1, 2, 3].map((i) => ({ payload: { case: 'data' as const, value: data.subarray(i * (768 << 10), (i + 1) * (768 << 10)) } }));
    const w = await api.writeFile([{ payload: { case: 'header' as const, value: header } }, ...pieces]);
    expect(w.bytesWritten).toBe(BigInt(data.length));
    const back: Buffer[] = [];
    for await (const r of api.readFile({ tenantId, sandboxId: sb!.id, path: '/tmp/big.bin' })) back.push(Buffer.from(r.data));
    expect(Buffer.concat(back).equals(data)).toBe(true);
    // max_bytes cuts it; the mode was set after the last piece.
    const head: Buffer[] = [];
    for await (const r of api.readFile({ tenantId, sandboxId: sb!.id, path: '/tmp/big.bin', maxBytes: 1_500_000n })) head.push(Buffer.from(r.data));
    expect(Buffer.concat(head).equals(data.subarray(0, 1_500_000))).toBe(true);
    expect(await sh(api, sb!.id, 'stat -c %a:%s /tmp/big.bin')).toEqual({ out: `750:${data.length}\n`, code: 0 });
    // An exec whose stdin cannot fit one relayed message is refused up front, naming stdin.
    const e = (await (async () => {
      for await (const _ of api.exec({ tenantId, sandboxId: sb!.id, argv: ['cat'], stdin: new Uint8Array(1 << 20) }));
    })().catch((x: unknown) => x)) as RpcError;
    expect(e.code).toBe(Status.INVALID_ARGUMENT);
    expect(e.field).toBe('stdin');
    const m = (await api.writeFile([{ payload: { case: 'header' as const, value: { ...header, idempotencyKey: key(), mode: 0o10000 } } }]).catch((x: unknown) => x)) as RpcError;
    expect(m.code).toBe(Status.INVALID_ARGUMENT);
    expect(m.field).toBe('header.mode');
    // The guest's refusals of a path name it: a file that is not there, a directory.
    const missing = (await (async () => {
      for await (const _ of api.readFile({ tenantId, sandboxId: sb!.id, path: '/tmp/not-there' }));
    })().catch((x: unknown) => x)) as RpcError;
    expect([Status[missing.code], missing.field]).toEqual(['NOT_FOUND', 'path']);
    const dir = (await api.writeFile([{ payload: { case: 'header' as const, value: { ...header, idempotencyKey: key(), path: '/tmp/no-dir/f' } } }]).catch((x: unknown) => x)) as RpcError;
    expect([Status[dir.code], dir.field]).toEqual(['NOT_FOUND', 'header.path']);
    // A write that fails part-way (the file system fills up after the first piece) leaves the
    // file it was to replace as it was, and no temporary file.
    expect(await sh(api, sb!.id, 'mkdir -p /mnt/small && mount -t tmpfs -o size=1m tmpfs /mnt/small && echo old > /mnt/small/f && echo ok')).toEqual({ out: 'ok\n', code: 0 });
    const full = (await api.writeFile([{ payload: { case: 'header' as const, value: { ...header, idempotencyKey: key(), path: '/mnt/small/f' } } }, ...pieces]).catch((x: unknown) => x)) as RpcError;
    expect(full.code).not.toBe(Status.OK);
    expect(full.field).toBe('header.path');
    expect(await sh(api, sb!.id, 'cat /mnt/small/f; ls -A /mnt/small')).toEqual({ out: 'old\nf\n', code: 0 });
    // A file that was there keeps its owner and group, in one piece or several, and its mode
    // when none is given.
    expect(await sh(api, sb!.id, 'echo x > /tmp/owned && chown 1000:1000 /tmp/owned && chmod 640 /tmp/owned && echo ok')).toEqual({ out: 'ok\n', code: 0 });
    await api.writeFile([{ payload: { case: 'header' as const, value: { ...header, idempotencyKey: key(), path: '/tmp/owned', mode: 0 } } }, { payload: { case: 'data' as const, value: Buffer.from('small') } }]);
    expect(await sh(api, sb!.id, 'stat -c %u:%g:%a /tmp/owned; cat /tmp/owned')).toEqual({ out: '1000:1000:640\nsmall', code: 0 });
    await api.writeFile([{ payload: { case: 'header' as const, value: { ...header, idempotencyKey: key(), path: '/tmp/owned', mode: 0 } } }, ...pieces]);
    expect(await sh(api, sb!.id, 'stat -c %u:%g:%a:%s /tmp/owned')).toEqual({ out: `1000:1000:640:${data.length}\n`, code: 0 });
    // Through a dangling relative link, written where the link points (busybox's readlink -f
    // resolved it against the current directory).
    expect(await sh(api, sb!.id, 'mkdir -p /tmp/ln && ln -s target /tmp/ln/dang && echo ok')).toEqual({ out: 'ok\n', code: 0 });
    await api.writeFile([{ payload: { case: 'header' as const, value: { ...header, idempotencyKey: key(), path: '/tmp/ln/dang', mode: 0 } } }, ...pieces]);
    expect(await sh(api, sb!.id, '[ -L /tmp/ln/dang ] && stat -c %s /tmp/ln/target')).toEqual({ out: `${data.length}\n`, code: 0 });
    // As a one-piece write would: through a symbolic link (the link stays, its target is
    // replaced), keeping an existing file's mode when none is given, and never into a directory.
    expect(await sh(api, sb!.id, 'ln -s /tmp/big.bin /tmp/link && mkdir /tmp/adir && echo ok')).toEqual({ out: 'ok\n', code: 0 });
    const rev = Buffer.from(data).reverse();
    const revPieces = [0, 1, 2, 3].map((i) => ({ payload: { case: 'data' as const, value: rev.subarray(i * (768 << 10), (i + 1) * (768 << 10)) } }));
    await api.writeFile([{ payload: { case: 'header' as const, value: { ...header, idempotencyKey: key(), path: '/tmp/link', mode: 0 } } }, ...revPieces]);
    expect(await sh(api, sb!.id, '[ -L /tmp/link ] && stat -c %a:%s /tmp/big.bin')).toEqual({ out: `750:${data.length}\n`, code: 0 });
    const target: Buffer[] = [];
    for await (const r of api.readFile({ tenantId, sandboxId: sb!.id, path: '/tmp/big.bin' })) target.push(Buffer.from(r.data));
    expect(Buffer.concat(target).equals(rev)).toBe(true);
    const intoDir = (await api.writeFile([{ payload: { case: 'header' as const, value: { ...header, idempotencyKey: key(), path: '/tmp/adir' } } }, ...pieces]).catch((x: unknown) => x)) as RpcError;
    expect([intoDir.code === Status.OK, intoDir.field]).toEqual([false, 'header.path']);
    expect(await sh(api, sb!.id, 'ls -A /tmp/adir | wc -l')).toEqual({ out: '0\n', code: 0 });
    // A whole-file read in one answer (as a scheduler before ranged reads asks for it) is
    // over NATS' limit: the agent answers with an error instead of dying on the publish.
    const nc = await connect({ servers: nats.url });
    try {
      const req = create(HostFileRequestSchema, { sandboxId: sb!.id, path: '/tmp/big.bin', op: { case: 'read', value: { maxBytes: 0n } } });
      const res = fromBinary(HostFileResponseSchema, (await nc.request(subjects.file(agent.hostId), toBinary(HostFileRequestSchema, req), { timeout: 30_000 })).data);
      expect(res.error?.field).toBe('max_bytes');
    } finally {
      await nc.close();
    }
    // The host agent served all of it and is still up.
    expect(pidAlive(agent.proc.pid)).toBe(true);
    expect(await sh(api, sb!.id, 'echo up')).toEqual({ out: 'up\n', code: 0 });
    await done(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: sb!.id }));
  }, 300_000);

  it('exec_cancelledByItsClientMidway_killsTheCommandInTheGuest', async () => {
    const created = await done(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }));
    const id = created.result.case === 'sandbox' ? created.result.value.id : '';
    const ac = new AbortController();
    const got: string[] = [];
    const e = (await (async () => {
      for await (const r of api.exec({ tenantId, sandboxId: id, argv: ['/bin/sh', '-c', 'echo started; sleep 304; echo never'], timeout: { seconds: 300n } }, { signal: ac.signal })) {
        if (r.payload.case === 'stdout') got.push(Buffer.from(r.payload.value).toString());
        // Its output streams while it runs; the client then gives up on it.
        if (got.join('') === 'started\n') ac.abort();
      }
    })().catch((x: unknown) => x)) as RpcError;
    expect(e.code).toBe(Status.CANCELLED);
    expect(got.join('')).toBe('started\n');
    // The API told the host, which killed the command and its sleep (it would run 300 s).
    await waitFor('the cancelled command gone from the guest', async () => (await sh(api, id, 'ps | grep -c "[s]leep 304" || true')).out === '0\n', 15_000, 250);
    await done(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
  }, 300_000);

  it('waitOperation_whoseCallDeadlineComesBeforeItsTimeout_answersWithTheOperationAsItIs', async () => {
    const op = await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } });
    // A boot takes seconds under TCG: still going when the call's 1.5 s deadline comes.
    const now = await api.waitOperation({ tenantId, operationId: op.id, timeout: { seconds: 60n } }, { timeoutMs: 1500 });
    expect([OperationState.PENDING, OperationState.RUNNING]).toContain(now.state);
    const final = await done(api, op);
    await done(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: final.result.case === 'sandbox' ? final.result.value.id : '' }));
  }, 300_000);

  it('hibernate_pausesTheGuestBeforeItsSnapshot_andAnExecCancelledByItsClientWhileTheSandboxWakes_neverRunsTheCommand', async () => {
    const created = await done(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }));
    const id = created.result.case === 'sandbox' ? created.result.value.id : '';
    const hib = await done(api, await api.hibernateSandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
    // The guest is paused before its snapshot and stays so until it stops: it never runs on
    // past the state the wake brings back.
    expect(hib.steps.map((s) => s.action)).toEqual(['pause_vm', 'snapshot_vm', 'destroy_vm']);
    // The client gives up while the exec waits for the wake (a restore: seconds under TCG).
    const ac = new AbortController();
    setTimeout(() => ac.abort(), 150);
    const e = (await (async () => {
      for await (const _ of api.exec({ tenantId, sandboxId: id, argv: ['/bin/sh', '-c', 'echo ran > /tmp/ran'], timeout: { seconds: 60n } }, { signal: ac.signal })) void _;
    })().catch((x: unknown) => x)) as RpcError;
    expect(e.code).toBe(Status.CANCELLED);
    // The wake goes on (others may be waiting for it); the cancelled command never runs.
    await waitFor('woken', async () => (await api.getSandbox({ tenantId, sandboxId: id })).state === SandboxState.RUNNING, 120_000, 250);
    await new Promise((r) => setTimeout(r, 2000));
    expect((await sh(api, id, 'cat /tmp/ran 2>/dev/null; echo end')).out).toBe('end\n');
    await done(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
  }, 300_000);

  it('step_whoseAgentIsKilledAndRestartedMidway_isSentAgainAtOnce_andMakesOneVm', async () => {
    // A create on host-b boots a guest (seconds under TCG): its agent is killed mid-boot.
    const agent = agents.find((a) => a.hostId === 'host-b')!;
    const from = readFileSync(agent.logPath, 'utf8').length;
    const op = await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, placement: { hostId: 'host-b' } });
    await waitFor('step started on host-b', async () => readFileSync(agent.logPath, 'utf8').slice(from).split('\n').some((l) => l.includes('"step started"') && l.includes(op.id)), 30_000, 20);
    agent.proc.kill();
    await agent.proc.exited;
    const killedAt = Date.now();
    await agent.restart();
    const final = await done(api, op);
    const sb = final.result.case === 'sandbox' ? final.result.value : undefined;
    expect(sb).toMatchObject({ state: SandboxState.RUNNING, hostId: 'host-b' });
    // The leader saw the agent's new boot id and sent the step again: the dead agent's work
    // message would have come back only after JetStream's ack wait.
    expect(Date.now() - killedAt).toBeLessThan(WORK_ACK_WAIT_MS);
    // One VM for it, whatever the killed agent had started.
    expect(qemuPidsByVm(agent.dataDir).get(sb!.id)).toHaveLength(1);
    expect((await sh(api, sb!.id, 'echo up')).out).toBe('up\n');
    await done(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: sb!.id }));
  }, 300_000);

  it('vmGone_crashedQemuOrReapedAtAgentRestart_marksTheSandboxLostWithWhy_andFreesItsCapacity', async () => {
    const make = async (hostId?: string): Promise<{ id: string; hostId: string }> => {
      const op = await done(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 }, ...(hostId ? { placement: { hostId } } : {}) }));
      const sb = op.result.case === 'sandbox' ? op.result.value : undefined;
      return { id: sb!.id, hostId: sb!.hostId };
    };
    const a = await make();
    const b = await make(a.hostId);
    expect(b.hostId).toBe(a.hostId);
    const agent = agents.find((x) => x.hostId === a.hostId)!;
    const allocated = async (): Promise<bigint> => (await api.listHosts({})).hosts.find((h) => h.id === a.hostId)!.allocated!.memoryMib;
    const before = await allocated();
    const lost = (id: string) => async () => (await api.getSandbox({ tenantId, sandboxId: id })).state === SandboxState.LOST;

    // 1. QEMU killed under a running sandbox: its host reports the VM crashed.
    for (const pid of qemuPidsByVm(agent.dataDir).get(a.id) ?? []) process.kill(pid, 'SIGKILL');
    await waitFor('crashed sandbox lost', lost(a.id), 30_000, 200);
    expect((await api.getSandbox({ tenantId, sandboxId: a.id })).stateReason).toMatch(/its VM crashed on host/);
    expect(await allocated()).toBe(before - 256n);
    // The host is told to clean the dead VM up (its directory goes).
    await waitFor('dead VM cleaned up', async () => !qemuPidsByVm(agent.dataDir).has(a.id), 30_000, 200);

    // 2. The agent killed, the VM's QEMU gone meanwhile: the restarted agent reaps it and its
    //    heartbeats no longer list it.
    agent.proc.kill();
    await agent.proc.exited;
    for (const pid of qemuPidsByVm(agent.dataDir).get(b.id) ?? []) process.kill(pid, 'SIGKILL');
    await agent.restart();
    await waitFor('reaped sandbox lost', lost(b.id), 60_000, 200);
    expect((await api.getSandbox({ tenantId, sandboxId: b.id })).stateReason).toMatch(/no longer runs its VM \(its agent restarted\)/);
    expect(await allocated()).toBe(before - 512n);
    // Destroying a lost sandbox releases nothing more: its booking went when it was lost.
    for (const id of [a.id, b.id]) await done(api, await api.destroySandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
    for (const id of [a.id, b.id]) expect((await api.getSandbox({ tenantId, sandboxId: id })).state).toBe(SandboxState.DESTROYED);
    expect(await allocated()).toBe(before - 512n);
  }, 300_000);

  it('ttl_countsRunningTimeOnly_pausedTimeDoesNotExpireTheSandbox', async () => {
    const created = await done(api, await api.createSandbox({ tenantId, idempotencyKey: key(), source: { case: 'image', value: 'tiny' }, lifecycle: { ttl: { seconds: 6n } } }));
    const id = created.result.case === 'sandbox' ? created.result.value.id : '';
    await done(api, await api.pauseSandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
    await new Promise((r) => setTimeout(r, 9000)); // longer than the TTL, all of it paused
    expect((await api.getSandbox({ tenantId, sandboxId: id })).state).toBe(SandboxState.PAUSED);
    await done(api, await api.resumeSandbox({ tenantId, idempotencyKey: key(), sandboxId: id }));
    await waitFor('destroyed by ttl', async () => (await api.getSandbox({ tenantId, sandboxId: id })).state === SandboxState.DESTROYED, 60_000, 500);
  }, 300_000);
});
