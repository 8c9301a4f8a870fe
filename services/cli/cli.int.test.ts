// The CLI and the SDK example end to end against a real 2-host local fleet (one per file):
// create, exec, fork 4, ls, pin, destroy, with --json parsed at each step.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { spawn } from 'node:child_process';
import { join, resolve } from 'node:path';
import { tmpdir } from 'node:os';
import { defaultOptions, down, readState, up } from '../../deploy/fleet/fleet.ts';

const DIR = '/var/lib/ffleet-ui';
const ROOT = resolve(import.meta.dirname, '..', '..');

interface Run {
  code: number;
  stdout: string;
  stderr: string;
}

/** Runs the CLI like a user would; FF_FLEET_DIR makes --api default to this fleet. */
function cli(args: string[], env: Record<string, string> = {}): Promise<Run> {
  return new Promise((res, rej) => {
    const p = spawn(process.execPath, ['--import', 'tsx', 'services/cli/main.ts', ...args], { cwd: ROOT, env: { ...process.env, FF_FLEET_DIR: DIR, FF_TENANT: 'cli', ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    p.stdout.on('data', (d: Buffer) => (stdout += d.toString()));
    p.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
    p.on('error', rej);
    p.on('exit', (code) => res({ code: code ?? -1, stdout, stderr }));
  });
}

async function json<T>(args: string[]): Promise<T> {
  const r = await cli(['--json', ...args]);
  expect(r.code, `${args.join(' ')}: ${r.stderr}`).toBe(0);
  return JSON.parse(r.stdout) as T;
}

describe('forkfleet CLI and SDK against a local fleet', () => {
  beforeAll(async () => {
    // A fleet a killed earlier run left up (its processes are detached) is taken down first.
    if (readState(DIR)) await down(DIR);
    await up(defaultOptions({ hosts: 2, dir: DIR, prefix: 'ffui', basePort: 20700 }));
  }, 180_000);

  afterAll(async () => {
    await down(DIR);
  }, 120_000);

  it('walkthrough_createGetEventsExecFork4LsPinDestroyOpsDrainRestart_jsonParsesAndExitCodesPassThrough', async () => {
    const status = await json<{ api: string[]; hosts: unknown[] }>(['fleet', 'status', '--dir', DIR]);
    expect(status.api).toHaveLength(2);

    const hosts = await json<Array<{ id: string; state: string }>>(['hosts', 'ls']);
    expect(hosts.map((h) => h.state)).toEqual(['ready', 'ready']);

    const sb = await json<{ id: string; tenantId: string; state: string; hostId: string }>(['sandbox', 'create', '--image', 'tiny', '--memory', '256', '--idle-timeout', '1h']);
    expect(sb.state).toBe('running');
    expect(await json<{ id: string; state: string; resources: { memoryMib: number } }>(['sandbox', 'get', sb.id])).toMatchObject({ id: sb.id, state: 'running', resources: { memoryMib: 256 }, idleTimeoutMs: 3_600_000, ttlMs: null });
    expect((await cli(['sandbox', 'get', sb.id])).stdout).toMatch(new RegExp(`^id\\s+${sb.id}\nstate\\s+running\n`));

    // Its history, replayed from the start (--after 1): the create's end, then that operation.
    const ev = await cli(['--json', 'events', '--after', '1', '--sandbox', sb.id, '--type', 'operation_done', '--count', '1', '--for', '60s']);
    expect(ev.code, ev.stderr).toBe(0);
    const done = ev.stdout.trim().split('\n').map((l) => JSON.parse(l) as { type: string; sandboxId: string; operationId: string; time: string });
    expect(done).toHaveLength(1);
    expect(done[0]).toMatchObject({ type: 'operation_done', sandboxId: sb.id });
    const createOp = await json<{ kind: string; state: string; targetId: string; updatedAt: string; sandbox: { id: string } }>(['operation', 'get', done[0]!.operationId]);
    expect(createOp).toMatchObject({ kind: 'create', state: 'succeeded', targetId: sb.id, sandbox: { id: sb.id }, progress: { done: 1, total: 1 }, steps: [{ stepId: 'create', hostId: sb.hostId, action: 'create_vm', state: 'succeeded', attempt: 1 }] });
    // A replayed event keeps the time of its change.
    expect(done[0]!.time).toBe(createOp.updatedAt);

    // exec streams output and passes the exit code through
    const ex = await cli(['sandbox', 'exec', sb.id, '--', 'sh', '-c', 'echo out; echo err >&2; exit 3']);
    expect(ex).toMatchObject({ code: 3, stdout: 'out\n', stderr: 'err\n' });
    const exj = await cli(['--json', 'sandbox', 'exec', sb.id, '--', 'sh', '-c', 'sleep 0.3; echo hi; echo state > /tmp/s']);
    expect(exj.code).toBe(0);
    // durationMs: the command's run time as its host timed it: about the sleep. The guest sleeps
    // 0.3 s by its own clock, which a restored TCG guest may run a little fast against the host's
    // (a CI run measured 298 ms), so the floor leaves it 50 ms.
    expect(JSON.parse(exj.stdout)).toMatchObject({ stdout: 'hi\n', exitCode: 0, durationMs: expect.any(Number) });
    expect(JSON.parse(exj.stdout).durationMs).toBeGreaterThanOrEqual(250);

    // fork 4: progress goes to stderr, the children as JSON to stdout
    const fk = await cli(['--json', 'sandbox', 'fork', sb.id, '4', '--ttl', '2h', '--idle-timeout', '0']);
    expect(fk.code, fk.stderr).toBe(0);
    const fork = JSON.parse(fk.stdout) as { snapshotId: string; children: Array<{ id: string; state: string }> };
    expect(fork.children).toHaveLength(4);
    expect(fork.children.every((c) => c.state === 'running')).toBe(true);
    const child = fork.children[0]!;
    expect(await json<{ ttlMs: number | null; idleTimeoutMs: number | null }>(['sandbox', 'get', child.id])).toMatchObject({ ttlMs: 7_200_000, idleTimeoutMs: 0 });
    expect((await cli(['sandbox', 'get', child.id])).stdout).toMatch(/\nidle timeout\s+never\n/);
    expect((await cli(['sandbox', 'exec', child.id, '--', 'cat', '/tmp/s'])).stdout).toBe('state\n');

    const ls = await json<Array<{ id: string; state: string }>>(['sandbox', 'ls']);
    expect(new Set(ls.filter((s) => s.state === 'running').map((s) => s.id))).toEqual(new Set([sb.id, ...fork.children.map((c) => c.id)]));
    const human = await cli(['sandbox', 'ls']);
    expect(human.stdout).toMatch(/^ID\s+STATE\s+HOST/);
    expect((await cli(['sandbox', 'list'])).stdout).toBe(human.stdout); // `list` is `ls`
    const onHost = await json<Array<{ id: string; hostId: string }>>(['sandbox', 'ls', '--host', sb.hostId]);
    expect(onHost.map((s) => s.id)).toContain(sb.id);
    expect(onHost.every((s) => s.hostId === sb.hostId)).toBe(true);
    // An admin's view of the host, whoever's sandboxes they are (this fleet's credentials are admin).
    const everyones = await cli(['sandbox', 'ls', '--all-tenants', '--host', sb.hostId]);
    expect(everyones.stdout).toMatch(new RegExp(`^ID\\s+TENANT\\s+STATE[^\\n]*\\n(.*\\n)*${sb.id}\\s+${sb.tenantId}\\s+running`));

    const snaps = await json<Array<{ id: string; hostIds: string[] }>>(['snapshot', 'ls']);
    expect(snaps.map((s) => s.id)).toContain(fork.snapshotId);
    const pinned = await json<{ id: string; pinned: boolean }>(['snapshot', 'pin', fork.snapshotId]);
    expect(pinned).toMatchObject({ id: fork.snapshotId, pinned: true });

    // errors say what to do next
    const missing = await cli(['sandbox', 'exec', 'sb-aaaaaaaaaaaaaaaaaaaa', '--', 'true']);
    expect(missing.code).toBe(1);
    expect(missing.stderr).toContain('forkfleet sandbox ls');
    const bad = await cli(['--json', 'sandbox', 'fork', sb.id, '100000']);
    expect(bad.code).toBe(2);
    expect(JSON.parse(bad.stdout).error.kind).toBe('invalid_argument');
    // A bad option of `fleet up` is refused before anything is installed or started.
    const badLink = await cli(['--json', 'fleet', 'up', '--link', 'fast', '--dir', join(tmpdir(), `ff-cli-never-${process.pid}`)]);
    expect([badLink.code, JSON.parse(badLink.stdout).error.field]).toEqual([2, '--link']);
    const badPrefix = await cli(['--json', 'fleet', 'up', '--prefix', 'Bad1', '--dir', join(tmpdir(), `ff-cli-never-${process.pid}`)]);
    expect([badPrefix.code, JSON.parse(badPrefix.stdout).error.field]).toEqual([2, '--prefix']);
    const badTls = await cli(['--json', 'fleet', 'up', '--peer-tls', 'maybe', '--dir', join(tmpdir(), `ff-cli-never-${process.pid}`)]);
    expect([badTls.code, JSON.parse(badTls.stdout).error.field]).toEqual([2, '--peer-tls']);
    // A file copied to stdout is the output, so it is no JSON document: refused with --json.
    const rawJson = await cli(['--json', 'sandbox', 'cp', `${sb.id}:/etc/hostname`, '-']);
    expect([rawJson.code, JSON.parse(rawJson.stdout).error.field]).toEqual([2, '--json']);
    // A usage error commander finds (a bad choice) is JSON on stdout too, and a bad --env names --env.
    const badChoice = await cli(['--json', 'sandbox', 'fork', sb.id, '2', '--locality', 'nowhere']);
    expect([badChoice.code, JSON.parse(badChoice.stdout).error.kind]).toEqual([2, 'invalid_argument']);
    expect(JSON.parse((await cli(['--json', 'sandbox', 'exec', sb.id, '--env', 'FOO', '--', 'true'])).stdout).error.field).toBe('--env');
    const down = await cli(['--api', '127.0.0.1:1', 'hosts', 'ls']);
    expect(down.code).toBe(69);
    expect(down.stderr).toContain('npm run fleet:up');
    expect(down.stderr).not.toContain('--idempotency-key');
    // A change that got no answer may have been taken: the error says how to repeat it safely.
    // (A command that takes several ids prints an array, with one id too.)
    const downPause = await cli(['--json', '--api', '127.0.0.1:1', 'sandbox', 'pause', sb.id]);
    expect(downPause.code).toBe(69);
    const key = (JSON.parse(downPause.stdout) as Array<{ id: string; error: { idempotencyKey: string } }>)[0]!.error.idempotencyKey;
    expect(key).toMatch(/^cli-/);
    expect(downPause.stderr).toContain(`--idempotency-key ${key}`);

    // Several targets, one of them missing: the other is still paused, the missing one is named
    // on stderr and in its place in the output, and the exit code is its failure's.
    const noSuch = `sb-${'a'.repeat(20)}`;
    const mixed = await cli(['--json', 'sandbox', 'pause', noSuch, fork.children[0]!.id]);
    expect(mixed.code, mixed.stderr).toBe(1);
    expect((JSON.parse(mixed.stdout) as Array<{ id: string; state?: string; error?: { kind: string } }>).map((m) => [m.id, m.state ?? m.error?.kind])).toEqual([[noSuch, 'not_found'], [fork.children[0]!.id, 'paused']]);
    expect(mixed.stderr).toContain(`forkfleet: ${noSuch}: not_found`);

    // One --idempotency-key for five sandboxes: each gets its own (K/<id>), and the command repeated does nothing twice.
    const destroyArgs = ['--idempotency-key', `walk-${process.pid}`, 'sandbox', 'destroy', sb.id, ...fork.children.map((c) => c.id)];
    const destroyed = await json<Array<{ id: string; state: string }>>(destroyArgs);
    expect(destroyed.map((d) => d.state)).toEqual(Array(5).fill('destroyed'));
    expect((await json<Array<{ id: string; state: string }>>(destroyArgs)).map((d) => d.state)).toEqual(Array(5).fill('destroyed'));
    expect((await json<unknown[]>(['sandbox', 'ls'])).length).toBe(0);

    // What ran, newest first: the five destroys; on the first sandbox, its destroy, the fork of it and its create.
    const destroys = await json<Array<{ kind: string; state: string; targetId: string }>>(['operation', 'ls', '--kind', 'destroy', '--limit', '5']);
    expect(destroys.map((o) => [o.kind, o.state])).toEqual(Array(5).fill(['destroy', 'succeeded']));
    expect(new Set(destroys.map((o) => o.targetId))).toEqual(new Set([sb.id, ...fork.children.map((c) => c.id)]));
    const onSb = await cli(['op', 'ls', '--target', sb.id]);
    expect(onSb.stdout).toMatch(/^ID\s+KIND\s+STATE\s+TARGET\s+PROGRESS\s+CREATED\s+TOOK/);
    expect(onSb.stdout.trim().split('\n').slice(1).map((l) => l.split(/\s+/)[1])).toEqual(['destroy', 'fork', 'create']);
    // Where the fork's time went: its source's snapshot, then the restores, each with its times.
    const forkOp = await cli(['op', 'get', onSb.stdout.trim().split('\n')[2]!.split(/\s+/)[0]!]);
    expect(forkOp.stdout).toMatch(/\nSTEP\s+HOST\s+ACTION\s+STATE\s+SENT\s+TOOK\s+ON HOST\s+NOTES\nsnapshot\/sn-\S+\s+h\d\s+snapshot_vm\s+succeeded\s+\+\d\S*\s+\d\S*\s+\d\S*\s+source paused \d/);
    expect(forkOp.stdout).toMatch(/\nrestore\/h\d\s+h\d\s+restore_vms\s+succeeded\s+\+\d\S*\s+\d\S*\s+\d/);
    expect(forkOp.stdout).toMatch(/\ntook\s+\d+(\.\d)?m?s\n/);
    expect((await cli(['op', 'ls', '--state', 'done'])).code).toBe(2);
    // A finished operation cannot be cancelled: the API says why, exit 1.
    const late = await cli(['--json', 'operation', 'cancel', done[0]!.operationId]);
    expect([late.code, JSON.parse(late.stdout).error.kind]).toEqual([1, 'failed_precondition']);
    expect(JSON.parse(late.stdout).error.message).toContain('already succeeded');
    // Nothing counts against the tenant's quotas now (and this fleet sets none).
    expect(await json<{ tenantId: string; sandboxes: number; memoryMib: number; quota: object }>(['usage'])).toMatchObject({ tenantId: sb.tenantId, sandboxes: 0, memoryMib: 0, quota: {} });
    expect((await cli(['usage'])).stdout).toMatch(/^tenant\s+\S+\nsandboxes\s+0 \(no limit\)\nmemory\s+0 MiB \(no limit\)\n/);

    // A drain is the admin tenant's operation: the CLI follows it whatever --tenant says
    // (FF_TENANT=cli here). Once drained, the host is cordoned and no longer draining.
    const drained = await json<{ state: string; kind: string }>(['hosts', 'drain', hosts[1]!.id]);
    expect(drained).toMatchObject({ kind: 'drain', state: 'succeeded' });
    const after = await json<Array<{ id: string; cordoned: boolean; draining: boolean }>>(['hosts', 'ls']);
    expect(after.find((h) => h.id === hosts[1]!.id)).toMatchObject({ cordoned: true, draining: false });
    const drains = await json<Array<{ kind: string; targetId: string; tenantId: string }>>(['--tenant', 'admin', 'op', 'ls', '--kind', 'drain', '--limit', '1']);
    expect(drains).toEqual([expect.objectContaining({ kind: 'drain', targetId: hosts[1]!.id, tenantId: 'admin' })]);
    expect(await json<{ cordoned: boolean }>(['hosts', 'cordon', '--undo', hosts[1]!.id])).toMatchObject({ cordoned: false });

    // fleet restart: one process, by the name fleet status shows; a name it does not know is a bad argument.
    const restarted = await json<{ name: string; pid: number }>(['fleet', 'restart', `agent-${hosts[1]!.id}`, '--dir', DIR]);
    expect(restarted.name).toBe(`agent-${hosts[1]!.id}`);
    const st = await json<{ procs: Array<{ name: string; pid: number; alive: boolean }> }>(['fleet', 'status', '--dir', DIR]);
    expect(st.procs.find((p) => p.name === restarted.name)).toMatchObject({ pid: restarted.pid, alive: true });
    const unknown = await cli(['fleet', 'restart', 'agent-nope', '--dir', DIR]);
    expect(unknown.code).toBe(2);
    expect(unknown.stderr).toContain('agent-h1');
  }, 360_000);

  it('credentials_tenantTokenActsOnlyForItsTenant_noTokenIsUnauthenticated_withHints', async () => {
    // fleet:up wrote credentials.json (admin, found by default) and dev-credentials.json (tenant dev).
    const dev = ['--credentials', `${DIR}/dev-credentials.json`];
    const mine = await cli(['--json', ...dev, 'sandbox', 'ls'], { FF_TENANT: '' });
    expect(mine.code, mine.stderr).toBe(0);
    expect(JSON.parse(mine.stdout)).toEqual([]);
    const hosts = await cli([...dev, 'hosts', 'ls'], { FF_TENANT: '' });
    expect(hosts.code).toBe(1);
    expect(hosts.stderr).toContain('permission_denied');
    expect(hosts.stderr).toContain('admin credential');
    const other = await cli([...dev, '--tenant', 'cli', 'sandbox', 'ls']);
    expect(other.code).toBe(1);
    expect(other.stderr).toContain('permission_denied');
    expect(other.stderr).toContain('drop --tenant');
    const api = (await json<{ api: string[] }>(['fleet', 'status', '--dir', DIR])).api.join(',');
    const anon = await cli(['--api', api, 'sandbox', 'ls'], { FF_FLEET_DIR: '/nonexistent', FF_CA: `${DIR}/pki/ca.crt` });
    expect(anon.code).toBe(1);
    expect(anon.stderr).toContain('unauthenticated');
    expect(anon.stderr).toContain('FF_TOKEN');
    // Without the CA the server's certificate is not trusted: no call is made at all.
    const untrusted = await cli(['--api', api, 'sandbox', 'ls'], { FF_FLEET_DIR: '/nonexistent' });
    expect(untrusted.code).toBe(69);
    expect(untrusted.stderr).toContain('FF_CA');
  }, 120_000);

  it('sdkExample_bestOfN_keepsTheBestChildAndDestroysTheRest', async () => {
    const r = await new Promise<Run>((res) => {
      const p = spawn(process.execPath, ['--import', 'tsx', 'services/sdk/examples/best-of-n.ts', '--n', '3', '--tenant', 'sdk-example'], { cwd: ROOT, env: { ...process.env, FF_FLEET_DIR: DIR }, stdio: ['ignore', 'pipe', 'pipe'] });
      let stdout = '';
      let stderr = '';
      p.stdout.on('data', (d: Buffer) => (stdout += d.toString()));
      p.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
      p.on('exit', (code) => res({ code: code ?? -1, stdout, stderr }));
    });
    expect(r.code, r.stderr).toBe(0);
    const out = JSON.parse(r.stdout.trim().split('\n').pop()!) as { best: { score: number }; scores: Array<{ score: number }>; kept: string };
    expect(out.scores).toHaveLength(3);
    expect(out.best.score).toBe(Math.max(...out.scores.map((s) => s.score)));
    const left = JSON.parse((await cli(['--json', '--tenant', 'sdk-example', 'sandbox', 'ls'])).stdout) as Array<{ id: string }>;
    expect(left.map((s) => s.id)).toEqual([out.kept]);
  }, 300_000);
});
