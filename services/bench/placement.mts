// Benchmark: placement decisions and committed placements.
//
//   npm run bench:placement -- --json FILE [--hosts 100] [--forks 300] [--count 64] [--inflight 16]
//                                       [--log-level info] (schedulers' and agents' logs, with --keep-dir)
//                                       [--no-decide] [--keep-dir] [--cpu-prof] [--churn SECONDS]
//
// Prints (and writes to FILE) { decide, committed_per_s, ... }:
//   decide           the pure placement bench (scheduler/bench/decide.ts, run as is) on
//                    100 / 1000 / 10000 simulated hosts: { per_s, p50_us, p99_us, ... }, with
//                    DECISIONS=2000 unless set; `decisions_per_size` (timed) and
//                    `warmup_decisions` (untimed, first) are decide.ts's own, per fleet size
//                    (null with --no-decide)
//   committed_per_s  child sandbox records committed per second through the real scheduler
//                    (two replicas as processes: the leader executes, the other serves the
//                    API) on a real etcd, with fake host agents on real NATS that answer at
//                    once, under fork(count) requests kept `inflight` at a time. Measured
//                    from the first request to the last fork reaching `succeeded`, so every
//                    counted child was placed, booked, restored by its agent and marked running.
//                    Four untimed warm-up forks first spread the snapshot over the fleet: the
//                    timed forks mostly land on hosts that already hold it, so the figure is
//                    placements without transfer plans (the fake agents' "fetch" is instant
//                    anyway; transfer time is bench:transfer's and the loadtest's).
//                    `committed.warmup_forks` (x `count` children) says how many, and
//                    `committed.snapshot_holders_at_start` / `_at_end` how many of the `hosts`
//                    held the snapshot (its host_ids, read untimed) when the measured part
//                    began and ended.
//   cpu_us_per_child CPU (user+sys, /proc ticks) of each process over the same span, per
//                    committed child: leader, API replica, fake agents, etcd, NATS and this
//                    bench's own gRPC client. On a machine that every process shares,
//                    committed_per_s is at most about (cores * 1e6) / their sum.
//   per_child        etcd puts / txns / ranges (its /metrics) and NATS messages in / out (its
//                    /varz) per committed child over the same span, and the growth of etcd's
//                    database (total and in use) and key count per child.
//   churn            with --churn S: after the measured part, S seconds of the RL cycle
//                    (fork(count), then destroy every child) with etcd's database and key
//                    count sampled every 2 s: whether etcd stays bounded (ADR 0017). Set
//                    FF_RECORD_RETENTION / FF_ETCD_COMPACT_INTERVAL to shorten the run.
// Ctrl-C or a kill: what it started (etcd, NATS, schedulers, fake agents) is stopped and its
// directory removed (unless kept) before it exits (loadtest/interrupt.ts).
import { execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { loadavg } from 'node:os';
import { startEtcd } from '../testkit/etcd.ts';
import type { EtcdCluster } from '../testkit/etcd.ts';
import { startNats } from '../testkit/nats.ts';
import type { NatsServer } from '../testkit/nats.ts';
import { procCpu, waitFor } from '../testkit/proc.ts';
import { startFakeAgents, startSchedulerProcess } from '../testkit/fleet-procs.ts';
import type { SchedulerProcess } from '../testkit/fleet-procs.ts';
import { loadSigningKey } from '../scheduler.ts';
import { FleetService, OperationState } from '../../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { Operation } from '../../proto/gen/forkfleet/v1/fleet_pb.ts';
import { Spread } from '../../proto/gen/forkfleet/v1/common_pb.ts';
import { undoOnInterrupt } from '../../loadtest/interrupt.ts';

const ROOT = resolve(import.meta.dirname, '..', '..');

/** etcd's MVCC counters (its /metrics) and nats-server's message counters (its /varz). */
async function counters(etcdUrl: string, natsMonitorPort: number): Promise<Record<string, number>> {
  const metrics = await (await fetch(`${etcdUrl}/metrics`)).text();
  const metric = (name: string): number => Number(new RegExp(`^${name} (\\S+)$`, 'm').exec(metrics)?.[1] ?? NaN);
  const varz = (await (await fetch(`http://127.0.0.1:${natsMonitorPort}/varz`)).json()) as { in_msgs: number; out_msgs: number };
  return { etcd_puts: metric('etcd_mvcc_put_total'), etcd_txns: metric('etcd_mvcc_txn_total'), etcd_ranges: metric('etcd_mvcc_range_total'), nats_in_msgs: varz.in_msgs, nats_out_msgs: varz.out_msgs, etcd_db_bytes: metric('etcd_mvcc_db_total_size_in_bytes'), etcd_db_in_use_bytes: metric('etcd_mvcc_db_total_size_in_use_in_bytes'), etcd_keys: metric('etcd_debugging_mvcc_keys_total') };
}


function arg(name: string, dflt: string): string {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 && process.argv[i + 1] !== undefined ? process.argv[i + 1]! : dflt;
}

const jsonPath = arg('json', '');
const HOSTS = Number(arg('hosts', '100'));
const FORKS = Number(arg('forks', '300'));
const COUNT = Number(arg('count', '64'));
const INFLIGHT = Number(arg('inflight', '16'));
/** Skips the pure decide bench (quick committed_per_s iterations). */
const NO_DECIDE = process.argv.includes('--no-decide');
/** The scheduler replicas (prof/) and the fake agents (prof-agents/) write V8 CPU profiles into the run's directory (kept). */
const CPU_PROF = process.argv.includes('--cpu-prof');
/** Keeps the run's directory (scheduler and agent logs, CPU profiles) and prints its path. */
const KEEP_DIR = CPU_PROF || process.argv.includes('--keep-dir');
const CHURN_S = Number(arg('churn', '0'));

// 1. The pure decision bench, reused as it is (it prints JSON).
const decideOut = NO_DECIDE
  ? undefined
  : (JSON.parse(execFileSync(process.execPath, ['--import', 'tsx', join(ROOT, 'scheduler', 'bench', 'decide.ts')], { env: { ...process.env, DECISIONS: process.env.DECISIONS ?? '2000' }, encoding: 'utf8', maxBuffer: 16 << 20 })) as { decide: Record<string, unknown>; decisions_per_size: number; warmup_decisions: number });
const decide = decideOut?.decide;

// 2. Committed placements through the real scheduler.
const dir = mkdtempSync('/tmp/ff-bench-');
/** What the run started so far, for undo(); `starting`: etcd's and NATS's start while it runs. */
const made: { etcd?: EtcdCluster; nats?: NatsServer; starting?: Promise<unknown> } = {};
const scheds: SchedulerProcess[] = [];
let fakes: Awaited<ReturnType<typeof startFakeAgents>> | undefined;
/** Undoes the run, once: at its end, or first on Ctrl-C or a kill. */
const { undo, off: offInterrupt } = undoOnInterrupt(async () => {
  // A start under way finishes first, so that what it starts is stopped too.
  await made.starting?.catch(() => undefined);
  await fakes?.stop().catch(() => undefined);
  for (const s of scheds) await s.proc.stop().catch(() => undefined);
  await made.nats?.stop().catch(() => undefined);
  await made.etcd?.stop().catch(() => undefined);
  if (KEEP_DIR) process.stderr.write(`bench: kept ${dir}\n`);
  else rmSync(dir, { recursive: true, force: true });
}, (line) => process.stderr.write(`bench: ${line}\n`));
try {
  // Each is recorded as soon as it is up: should the other fail, undo() still stops it.
  const starting = Promise.allSettled([startEtcd({ logDir: dir }).then((e) => (made.etcd = e)), startNats({ logDir: dir }).then((n) => (made.nats = n))]);
  made.starting = starting;
  const [etcdStarted, natsStarted] = await starting;
  if (etcdStarted.status === 'rejected') throw etcdStarted.reason;
  if (natsStarted.status === 'rejected') throw natsStarted.reason;
  const etcd = etcdStarted.value;
  const nats = natsStarted.value;
  const signingKeyPath = join(dir, 'signing.pem');
  loadSigningKey(signingKeyPath, 'scheduler-1');
  const env = { FF_LOG_LEVEL: arg('log-level', 'warn'), FF_STEP_TIMEOUT: '30s' };
  for (const id of ['b1', 'b2']) scheds.push(await startSchedulerProcess({ id, dir, etcdEndpoints: etcd.endpoints, natsUrl: nats.url, signingKeyPath, env, ...(CPU_PROF ? { nodeArgs: ['--cpu-prof', `--cpu-prof-dir=${join(dir, 'prof')}`] } : {}) }));
  const hosts = Array.from({ length: HOSTS }, (_, i) => `bench-${i + 1}`);
  fakes = await startFakeAgents({ hosts, dataDir: join(dir, 'fleet'), natsUrl: nats.url, logDir: dir, env: { FF_FAKE_VCPUS: '1000000', FF_FAKE_MEMORY_MIB: '1000000000', FF_HEARTBEAT_INTERVAL_MS: '1000', FF_STEP_CONCURRENCY: '64', FF_FAKE_STATE: 'memory', FF_LOG_LEVEL: arg('log-level', 'warn') }, ...(CPU_PROF ? { nodeArgs: ['--cpu-prof', `--cpu-prof-dir=${join(dir, 'prof-agents')}`] } : {}) });
  await waitFor('leader elected', async () => (await Promise.all(scheds.map((s) => s.isLeader()))).some(Boolean), 20_000, 50);
  const leaders = await Promise.all(scheds.map((s) => s.isLeader()));
  const apiSched = scheds[leaders.indexOf(false)] ?? scheds[0]!;
  const api = apiSched.credentials.client(FleetService, apiSched.api);
  await waitFor('hosts registered', async () => (await api.listHosts({})).hosts.length === HOSTS, 60_000, 200);
  const tenantId = 'bench';
  let k = 0;
  const ok = async (op: Operation): Promise<Operation> => {
    const f = await api.waitOperation({ tenantId, operationId: op.id, timeout: { seconds: 120n } }, { timeoutMs: 130_000 });
    if (f.state !== OperationState.SUCCEEDED) throw new Error(`${op.id}: ${OperationState[f.state]} ${f.error?.message}`);
    return f;
  };
  const created = await ok(await api.createSandbox({ tenantId, idempotencyKey: `c-${k++}`, source: { case: 'image', value: 'tiny' }, resources: { memoryMib: 256n, vcpus: 1 } }));
  const parentId = created.result.case === 'sandbox' ? created.result.value.id : '';
  const snap = await ok(await api.snapshotSandbox({ tenantId, idempotencyKey: `s-${k++}`, sandboxId: parentId }));
  const snapshotId = snap.result.case === 'snapshot' ? snap.result.value.id : '';
  const fork = (): Promise<Operation> => api.forkSandbox({ tenantId, idempotencyKey: `f-${k++}`, source: { case: 'snapshotId', value: snapshotId }, count: COUNT, placement: { spread: Spread.SPREAD } });
  // Warm-up: spreads the snapshot over the fleet and warms the JIT.
  const WARMUP_FORKS = 4;
  for (let i = 0; i < WARMUP_FORKS; i++) await ok(await fork());
  /** Hosts that hold the snapshot (all its chunks), as the API reports it; read outside the measured span and its counters. */
  const holders = async (): Promise<number> => (await api.getSnapshot({ tenantId, snapshotId })).hostIds.length;

  /** Forks children and destroys them again for `s` seconds; etcd sampled every 2 s. */
  async function churnFor(s: number): Promise<Record<string, unknown>> {
    const samples: Array<{ t: number; keys: number; db_mib: number; db_in_use_mib: number }> = [];
    const t0 = performance.now();
    const sample = async (): Promise<void> => {
      const c = await counters(etcd.endpoints[0]!, nats.monitorPort);
      samples.push({ t: Math.round((performance.now() - t0) / 1000), keys: c.etcd_keys!, db_mib: Number((c.etcd_db_bytes! / 2 ** 20).toFixed(1)), db_in_use_mib: Number((c.etcd_db_in_use_bytes! / 2 ** 20).toFixed(1)) });
    };
    await sample();
    const timer = setInterval(() => void sample(), 2000);
    let cycles = 0;
    let destroyed = 0;
    const cycle = async (): Promise<void> => {
      while (performance.now() - t0 < s * 1000) {
        const f = await ok(await fork());
        const ids = f.result.case === 'fork' ? f.result.value.children.map((c) => c.id) : [];
        await Promise.all(ids.map(async (sandboxId) => ok(await api.destroySandbox({ tenantId, idempotencyKey: `d-${k++}`, sandboxId }))));
        destroyed += ids.length;
        cycles++;
      }
    };
    await Promise.all(Array.from({ length: Math.max(1, INFLIGHT >> 2) }, () => cycle()));
    clearInterval(timer);
    await sample();
    return { seconds: s, cycles, children_created_and_destroyed: destroyed, retention: process.env.FF_RECORD_RETENTION ?? '1h (default)', compact_interval: process.env.FF_ETCD_COMPACT_INTERVAL ?? '5m (default)', samples };
  }

  let next = 0;
  let children = 0;
  const holdersAtStart = await holders();
  const loadAtStart = loadavg()[0] ?? 0;
  // CPU of every process during the measured part: where a committed child's cost goes.
  const procs: Record<string, number> = {
    leader: scheds[leaders.indexOf(true)]?.proc.pid ?? -1,
    api_replica: apiSched.proc.pid,
    fake_agents: fakes.proc.pid,
    etcd: etcd.members[0]!.proc.pid,
    nats: nats.proc.pid,
  };
  const cpu0 = Object.fromEntries(Object.entries(procs).map(([k, pid]) => [k, procCpu(pid).ms]));
  const client0 = process.cpuUsage();
  const count0 = await counters(etcd.endpoints[0]!, nats.monitorPort);
  const t0 = performance.now();
  const worker = async (): Promise<void> => {
    while (next < FORKS) {
      next++;
      const f = await ok(await fork());
      children += f.result.case === 'fork' ? f.result.value.children.length : 0;
    }
  };
  await Promise.all(Array.from({ length: INFLIGHT }, () => worker()));
  const seconds = (performance.now() - t0) / 1000;
  const clientCpu = process.cpuUsage(client0);
  const count1 = await counters(etcd.endpoints[0]!, nats.monitorPort);
  const perChild = Object.fromEntries(Object.entries(count1).map(([k, v]) => [k, Number(((v - count0[k]!) / Math.max(1, children)).toFixed(2))]));
  const cpuPerChild: Record<string, number> = Object.fromEntries(Object.entries(procs).map(([k, pid]) => [k, Math.round(((procCpu(pid).ms - cpu0[k]!) * 1000) / Math.max(1, children))]));
  // The bench's own gRPC client (this process), which decodes every fork's children.
  cpuPerChild.bench_client = Math.round((clientCpu.user + clientCpu.system) / Math.max(1, children));
  const holdersAtEnd = await holders();
  // After every figure above is taken: the churn's work is not in them.
  const churn = CHURN_S > 0 ? await churnFor(CHURN_S) : undefined;
  api.close();
  const out = {
    decide,
    // decide.ts's own sample counts, per fleet size (null with --no-decide).
    decisions_per_size: decideOut?.decisions_per_size ?? null,
    warmup_decisions: decideOut?.warmup_decisions ?? null,
    committed_per_s: Math.round(children / seconds),
    committed: {
      children, forks: FORKS, count: COUNT, inflight: INFLIGHT, hosts: HOSTS, seconds: Number(seconds.toFixed(2)), forks_per_s: Number((FORKS / seconds).toFixed(1)),
      // Untimed fork(count)s before the measured part; they spread the snapshot, so the timed forks mostly need no transfer plan.
      warmup_forks: WARMUP_FORKS,
      snapshot_holders_at_start: holdersAtStart,
      snapshot_holders_at_end: holdersAtEnd,
    },
    // CPU microseconds per committed child, by process, over the measured part (10 ms ticks).
    cpu_us_per_child: cpuPerChild,
    // etcd puts, transactions and range reads, and NATS messages in and out, per committed child.
    per_child: perChild,
    ...(churn ? { churn } : {}),
    node: process.version,
    // The machine's 1-minute load when the measured part started and when it ended (our own
    // processes included): compare runs only at similar loads.
    loadavg_1m_at_start: Number(loadAtStart.toFixed(2)),
    loadavg_1m: Number((loadavg()[0] ?? 0).toFixed(2)),
  };
  const text = `${JSON.stringify(out, null, 2)}\n`;
  process.stdout.write(text);
  if (jsonPath) writeFileSync(jsonPath, text);
} finally {
  await undo();
  offInterrupt();
}
