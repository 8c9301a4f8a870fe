// Load test: same-host against cross-host fork and resume latency through the public API.
// Every option: USAGE below (npm run loadtest -- --help). A command line it cannot parse ends
// with one line naming the option, exit 2, before anything starts.
//   npm run loadtest -- [--quick] [--json FILE] [--report DIR] [--api HOST:PORT]
//        [--hosts 3] [--link 10gbit] [--guest-mib 256] [--dirty-mib 64] [--samples 10]
//        [--concurrency 4] [--fanout N] [--duration 300s] [--budget 3600s] [--metrics-port 19790]
//        [--keep-logs] [--only fork_cross_host_4,resume_paused,...] (the others are reported as
//        skipped); --quick's defaults: --samples 3 --duration 40s --budget 200s (MODE_DEFAULTS)
//   npm run loadtest -- --plan --forks-per-s X --p95-ms Y --from FILE   (capacity planning;
//        p95 per child; --host-slots defaults to the agents' FF_STEP_CONCURRENCY, 4)
// Without --api it starts its own fleet (deploy/fleet/fleet.ts) in --fleet-dir with prefix
// fflt and base port 19700, and always brings it down.
import { parseArgs } from 'node:util';
import { parseOnOff } from '../services/config.ts';
import { cpSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { createServer } from 'node:http';
import type { Server } from 'node:http';
import { execFileSync } from 'node:child_process';
import { join, resolve } from 'node:path';
import { tmpdir } from 'node:os';
import { pino } from 'pino';
import { Histogram, Registry } from 'prom-client';
import { RunStopped, stopThenUndo } from './interrupt.ts';
import { LatencyHistogram, NO_SAMPLES } from './hist.ts';
import { Driver, Locality, OperationKind, Spread, childrenPerHost, connect, newLedger, OpFailed } from './scenarios.ts';
import { summarisePhases } from './phases.ts';
import type { OpPhases, PhaseSummary } from './phases.ts';
import { classicRestoreOnce, closeLocalBaseline, prepareLocalBaseline, startNaive } from './baselines.ts';
import type { LocalBaseline } from './baselines.ts';
import { SCHEMA_VERSION, checks, failedNames, renderReport } from './report.ts';
import type { Leftovers, RunEnv, RunResult, ScenarioResult } from './report.ts';
import { PlanInputError, formatPlan, planCapacity } from './plan.ts';
import type { Plan, PlanOptions } from './plan.ts';
import { linkGbpsOf, migrationStreamsEncrypted } from './run-env.ts';
import { findSocat } from '../host-agent/adapters/peer/tls-relay.ts';
import type { Snapshot } from '../proto/gen/forkfleet/v1/fleet_pb.ts';
import { FleetPartlyDownError } from '../deploy/fleet/errors.ts';
import type * as FleetModule from '../deploy/fleet/fleet.ts';
import { waitForQuietCpu } from './quiet.ts';

type FleetMod = typeof FleetModule;

const ROOT = resolve(import.meta.dirname, '..');
const log = (s: string): void => void process.stderr.write(`loadtest: ${s}\n`);

function parseDuration(s: string, field: string): number {
  const m = /^(\d+(?:\.\d+)?)(ms|s|m)$/.exec(s);
  if (!m) throw new Error(`--${field}: want a duration like '60s' or '500ms', got ${JSON.stringify(s)}`);
  return Number(m[1]) * { ms: 1, s: 1000, m: 60_000 }[m[2] as 'ms' | 's' | 'm'];
}

function posInt(v: string | undefined, field: string, dflt: number): number {
  if (v === undefined) return dflt;
  const n = Number(v);
  if (!Number.isInteger(n) || n < 1) throw new Error(`--${field}: want an integer >= 1, got ${JSON.stringify(v)}`);
  return n;
}

export interface LoadtestConfig {
  quick: boolean;
  api: string | undefined;
  hosts: number;
  link: string;
  linkGbps: number;
  guestMib: number;
  dirtyMib: number;
  samples: number;
  concurrency: number;
  fanout: number;
  /** Per-scenario sampling budget. */
  durationMs: number;
  /** Whole-run budget; scenarios stop taking samples past it (each keeps at least one). */
  budgetMs: number;
  opTimeoutMs: number;
  metricsPort: number;
  json: string | undefined;
  report: string;
  /** Copy the started fleet's process logs to <report>/fleet-logs even when every scenario passed. */
  keepLogs: boolean;
  fleetDir: string;
  prefix: string;
  basePort: number;
  /** Mutual TLS between the started fleet's agents (--peer-tls on|off, default on). */
  peerTls: boolean;
  /** --only: the scenarios to run; undefined runs them all. */
  only: ReadonlySet<string> | undefined;
}

/** The quiet CPU each scenario waits for (loadtest/quiet.ts). */
const QUIET = { busyBelow: 0.5, windowMs: 500, maxMs: 8000 } as const;
/** Every scenario, in the order of the JSON and the report. */
const SCENARIOS = ['fork_same_host_1', 'fork_same_host_4', 'fork_same_host_8', 'fork_cross_host_1', 'fork_cross_host_4', 'fork_fanout', 'resume_paused', 'resume_hibernated_warm', 'resume_hibernated_cold', 'restore_concurrent', 'cold_boot', 'classic_restore', 'naive_full_copy'] as const;

function parseOnly(v: string | undefined): ReadonlySet<string> | undefined {
  if (v === undefined) return undefined;
  const names = v.split(',').map((n) => n.trim()).filter(Boolean);
  const unknown = names.filter((n) => !(SCENARIOS as readonly string[]).includes(n));
  if (names.length === 0 || unknown.length > 0) throw new Error(`--only: want scenario names separated by commas (${SCENARIOS.join(', ')}), got ${JSON.stringify(v)}`);
  return new Set(names);
}

/** The defaults that --quick changes: compileConfig takes them, USAGE prints them. */
export const MODE_DEFAULTS = {
  full: { samples: 10, duration: '300s', budget: '3600s', opTimeout: '300s' },
  quick: { samples: 3, duration: '40s', budget: '200s', opTimeout: '45s' },
} as const;

export function compileConfig(v: Record<string, string | boolean | undefined>): Readonly<LoadtestConfig> {
  const s = (k: string): string | undefined => (typeof v[k] === 'string' ? (v[k] as string) : undefined);
  const quick = v.quick === true;
  const dflt = MODE_DEFAULTS[quick ? 'quick' : 'full'];
  const link = s('link') ?? '10gbit';
  const m = /^(\d+(?:\.\d+)?)(g|m)bit$/i.exec(link);
  if (!m) throw new Error(`--link: want a rate like 10gbit or 500mbit, got ${JSON.stringify(link)}`);
  const hosts = posInt(s('hosts'), 'hosts', 3);
  const samples = posInt(s('samples'), 'samples', dflt.samples);
  return Object.freeze({
    quick,
    api: s('api'),
    hosts,
    link,
    linkGbps: Number(m[1]) / (m[2]!.toLowerCase() === 'm' ? 1000 : 1),
    guestMib: posInt(s('guest-mib'), 'guest-mib', 256),
    dirtyMib: posInt(s('dirty-mib'), 'dirty-mib', 64),
    samples,
    concurrency: posInt(s('concurrency'), 'concurrency', 4),
    fanout: posInt(s('fanout'), 'fanout', hosts * 2),
    durationMs: parseDuration(s('duration') ?? dflt.duration, 'duration'),
    budgetMs: parseDuration(s('budget') ?? dflt.budget, 'budget'),
    opTimeoutMs: parseDuration(s('op-timeout') ?? dflt.opTimeout, 'op-timeout'),
    metricsPort: Number(s('metrics-port') ?? 19790),
    json: s('json'),
    report: s('report') ?? join(ROOT, 'loadtest', 'out'),
    keepLogs: v['keep-logs'] === true,
    fleetDir: s('fleet-dir') ?? '/var/lib/ffleet-lt',
    prefix: s('prefix') ?? 'fflt',
    basePort: Number(s('base-port') ?? 19700),
    peerTls: parseOnOff('--peer-tls', s('peer-tls'), true),
    only: parseOnly(s('only')),
  });
}

/** The operation kind a scenario times (its setup's other operations, e.g. a wake's hibernate, are not broken down). */
function timedKind(scenario: string): OperationKind[] {
  if (scenario.startsWith('fork_')) return [OperationKind.FORK];
  if (scenario === 'resume_paused') return [OperationKind.RESUME];
  if (scenario.startsWith('resume_hibernated')) return [OperationKind.WAKE, OperationKind.RESUME];
  if (scenario === 'restore_concurrent') return [OperationKind.CREATE];
  return [];
}

class Recorder {
  readonly hists = new Map<string, LatencyHistogram>();
  readonly phases = new Map<string, OpPhases[]>();
  readonly results: Record<string, ScenarioResult> = {};
  private readonly prom = new Map<string, Histogram>();
  constructor(private readonly registry: Registry) {}

  record(name: string, ms: number): void {
    let h = this.hists.get(name);
    if (!h) this.hists.set(name, (h = new LatencyHistogram()));
    h.record(ms);
    let p = this.prom.get(name);
    if (!p) {
      p = new Histogram({ name: `forkfleet_loadtest_${name}_seconds`, help: `${name}: API call until the sandbox answers an exec`, buckets: [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128], registers: [this.registry] });
      this.prom.set(name, p);
    }
    p.observe(ms / 1000);
  }

  finish(name: string, failed?: string, truncated?: string, left: Leftovers = {}): void {
    const s = { ...(this.hists.get(name)?.summary() ?? NO_SAMPLES), ...left };
    this.results[name] = failed ? { ...s, failed } : truncated ? { ...s, truncated } : s;
    log(`${name}: ${JSON.stringify(this.results[name])}`);
  }

  skip(name: string, reason: string): void {
    this.results[name] = { skipped: reason };
    log(`${name}: skipped: ${reason}`);
  }
}

/**
 * Waits, untimed, for the QEMU-level baseline guest's preparation (a boot, the guest writing
 * --dirty-mib, a snapshot, the full-RAM save to a file, qemu-img) to end either way. runLoad
 * calls it once the template's snapshot exists, before its first timed scenario: on a machine
 * shared with the fleet that work slowed the first fleet scenarios (fork_same_host_1 most,
 * which flattered the cross/same ratio). A failed preparation is not thrown here: the
 * baselines await it again, which rethrows it, and report themselves failed. Resolves with the
 * ms it waited.
 */
export async function baselinePrepared(prep: Promise<unknown> | undefined, signal?: AbortSignal): Promise<number> {
  const t0 = Date.now();
  // Or until the run is stopped (Ctrl-C): its undo waits for this loop, and the preparation
  // may take minutes; the caller's run.check() then ends the run.
  let onAbort = (): void => undefined;
  const stopped = new Promise<void>((r) => {
    onAbort = r;
    if (signal?.aborted) r();
    else signal?.addEventListener('abort', onAbort, { once: true });
  });
  await Promise.race([prep?.catch(() => undefined), stopped]);
  signal?.removeEventListener('abort', onAbort);
  return Date.now() - t0;
}

/** The QEMU-level baseline guest's figures for the run's env: its accel, and its boot + setup (below the API: not a cold_boot sample). */
export function baselineEnv(local: Pick<LocalBaseline, 'accel' | 'coldBootMs'> | undefined): { baseline_accel?: string; baseline_cold_boot_ms?: number } {
  return local ? { baseline_accel: local.accel, baseline_cold_boot_ms: Math.round(local.coldBootMs * 10) / 10 } : {};
}

/** How the fleet's agents (started from this environment) encrypt migration streams (host-agent config.ts peerMigrationTls). */
function migrationTlsNote(): string {
  const v = process.env.FF_PEER_MIGRATION_TLS ?? 'on';
  if (v === 'off') return 'left plain (FF_PEER_MIGRATION_TLS=off)';
  if (v === 'qemu' || (v === 'on' && !findSocat())) return "by QEMU's TLS";
  return 'by socat TLS relays';
}

function gitCommit(): string {
  try {
    const c = execFileSync('git', ['-C', ROOT, 'rev-parse', '--short', 'HEAD'], { encoding: 'utf8' }).trim();
    const dirty = execFileSync('git', ['-C', ROOT, 'status', '--porcelain'], { encoding: 'utf8' }).trim() ? '+dirty' : '';
    return c + dirty;
  } catch {
    return 'unknown';
  }
}

async function runLoad(cfg: Readonly<LoadtestConfig>): Promise<RunResult> {
  const started = Date.now();
  const registry = new Registry();
  const rec = new Recorder(registry);
  const selected = (name: string): boolean => !cfg.only || cfg.only.has(name);
  const notes: string[] = [];
  let metrics: Server | undefined;
  if (cfg.metricsPort > 0) {
    metrics = createServer((_req, res) => void registry.metrics().then((t) => res.writeHead(200, { 'content-type': registry.contentType }).end(t)));
    await new Promise<void>((r, j) => metrics!.once('error', j).listen(cfg.metricsPort, '127.0.0.1', () => r()));
    log(`Prometheus metrics on http://127.0.0.1:${cfg.metricsPort}/metrics`);
  }
  let fleetMod: FleetMod | undefined;
  let fleetHosts: Array<{ netns: string; address: string; dataDir: string }> = [];
  let apiAddr = cfg.api;
  const work = mkdtempSync(join(tmpdir(), 'fflt-'));
  let local: LocalBaseline | undefined;
  let localP: Promise<LocalBaseline> | undefined;
  const logger = pino({ level: process.env.LOG_LEVEL ?? 'warn' });
  const cleanup: Array<() => Promise<void>> = [];
  let driver: Driver | undefined;
  /** The fleet's start while it runs (teardown waits for it). */
  let starting: Promise<unknown> | undefined;
  /**
   * Undoes the run, once: what it made through the API (what a failed sample left, and with
   * --api the template and cordons on a fleet that stays up), the baselines, the fleet it
   * started. Also on Ctrl-C or a kill, which would otherwise leave the fleet up (its processes
   * are detached) for the next run to find and measure on. On those it first stops the run and
   * waits for its code to unwind (RunStop.undo): a sample still going would fork or cordon
   * behind tidy()'s back, and with --api that would stay on the shared fleet.
   */
  const teardown = async (): Promise<void> => {
    // A fleet started here goes down whole; a given one keeps running, so it is tidied.
    if (driver && !fleetMod) await driver.tidy().catch(() => undefined);
    for (const c of cleanup.reverse()) await c().catch(() => undefined);
    // The baselines' QEMUs, a classic restore under way included (detached, unknown to the driver).
    await closeLocalBaseline(local ?? (await localP?.catch(() => undefined))).catch(() => undefined);
    try {
      if (fleetMod) {
        // A start still running holds the fleet directory's lock: it finishes (or fails and
        // cleans up after itself) first, then the fleet goes down whole.
        if (starting) log('waiting for the fleet\'s start to finish, to take it down');
        await starting?.catch(() => undefined);
        log('bringing the fleet down');
        await fleetMod.down(cfg.fleetDir);
      }
    } finally {
      rmSync(work, { recursive: true, force: true });
      if (metrics) await new Promise((r) => metrics!.close(() => r(undefined)));
    }
  };
  const run = stopThenUndo(teardown, log);
  /** Shared by the run's drivers: what tidy() undoes, and the stop every create, fork and cordon checks. */
  const ledger = newLedger(run.signal);
  try {
    // Fleet (or a given API) and the QEMU-level baseline guest are prepared in parallel: setup
    // only. The template boots beside it too (cold_boot sample 1 says so); the timed scenarios
    // start only once it is done (baselinePrepared, after the template's snapshot).
    if (selected('classic_restore') || selected('naive_full_copy')) {
      localP = prepareLocalBaseline({ root: join(work, 'q'), accel: (process.env.FF_ACCEL as 'auto' | 'kvm' | 'tcg' | undefined) ?? 'auto', guestMib: cfg.guestMib, dirtyMib: cfg.dirtyMib, logger, signal: run.signal });
      localP.catch(() => undefined);
    }
    if (!apiAddr) {
      fleetMod = await import('../deploy/fleet/fleet.ts');
      log(`starting a ${cfg.hosts}-host fleet in ${cfg.fleetDir} (links ${cfg.link})`);
      // Configured as an operator who knows the sandbox size would: agents keep RAM of that
      // size ready for restores by migration (ADR 0016).
      const agentEnv = { FF_RAM_POOL_MIB: String(cfg.guestMib) };
      const fleetOpts = fleetMod.defaultOptions({ hosts: cfg.hosts, link: cfg.link, dir: cfg.fleetDir, prefix: cfg.prefix, basePort: cfg.basePort, agentEnv, peerTls: cfg.peerTls });
      const fm = fleetMod;
      const st = await (starting = fm.up(fleetOpts).catch(async (e: unknown) => {
        // The load test's own fleet, left by a run that was killed, with a process down since:
        // up no longer wipes such a fleet unasked; this directory is the load test's, so it does.
        if (!(e instanceof FleetPartlyDownError)) throw e;
        log(`${e.message}: a fleet an earlier load test left; taking it down and starting afresh`);
        await fm.down(cfg.fleetDir);
        return fm.up(fleetOpts);
      }));
      // Ctrl-C while it started: the teardown takes the fleet down; the run stops here.
      run.check('fleet start');
      notes.push(`fleet agents: FF_RAM_POOL_MIB=${cfg.guestMib} (RAM of the guest's size filled at agent start, ADR 0016).`);
      notes.push(`between agents: ${cfg.peerTls ? `mutual TLS (chunk transfers and migration streams encrypted, the latter ${migrationTlsNote()})` : 'plain text (--peer-tls off)'}.`);
      apiAddr = st.apiAddresses[0]!;
      fleetHosts = st.hosts;
    }
    // A fleet started here: its admin credential; a given --api: FF_TOKEN / FF_CA / FF_CREDENTIALS.
    const api = connect(apiAddr, fleetMod ? join(cfg.fleetDir, 'credentials.json') : undefined);
    cleanup.push(async () => api.close());
    const d = new Driver(api, cfg.opTimeoutMs, ledger);
    driver = d;
    // Setup steps (template boot, snapshots taken between samples) are not timed; give them longer.
    const setup = new Driver(api, Math.max(cfg.opTimeoutMs, 240_000), ledger);
    let hosts = await d.hosts();
    for (let i = 0; i < 100 && hosts.length < cfg.hosts && cfg.api === undefined; i++) {
      await new Promise((r) => setTimeout(r, 200));
      hosts = await d.hosts();
    }
    const accels = new Set(hosts.map((h) => h.accel));
    const accel = accels.size > 1 ? 'mixed' : (hosts[0]?.accel ?? 'unknown');
    const overBudget = (): boolean => Date.now() - started > cfg.budgetMs;

    /** Notes the sandboxes a scenario could not destroy (those undestroyed now that were not at its start). */
    const undestroyedNote = (name: string, before: ReadonlySet<string>): Leftovers => {
      const mine = [...ledger.undestroyed].filter(([id]) => !before.has(id));
      if (mine.length === 0) return {};
      notes.push(`${name}: ${mine.length} sandbox(es) could not be destroyed (tried twice): ${mine.map(([id, why]) => `${id} (${why.slice(0, 120)})`).join(', ')}; the scenarios after it ran beside them (tried again before each, and at the end).`);
      return { destroy_failures: mine.length };
    };

    /** Per scenario: how long it waited for a quiet CPU before its first sample. */
    const settled: string[] = [];
    /** Why the CPU could not be read (no /proc/stat): no scenario waited. */
    let quietUnreadable: string | undefined;
    /**
     * Runs a scenario's samples. Stops at once (throwing RunStopped, so the run unwinds) when the
     * run is stopping: checked before the scenario, before each sample, and after a failed one.
     */
    async function scenario(name: string, samples: number, one: () => Promise<number[]>): Promise<void> {
      run.check(name);
      if (!selected(name)) return rec.skip(name, 'not selected (--only)');
      // What earlier scenarios could not destroy gets one more try; what is still there, this one runs beside.
      if (ledger.undestroyed.size) await d.destroyAll([...ledger.undestroyed.keys()]);
      const left: Leftovers = ledger.undestroyed.size ? { leftover_sandboxes: ledger.undestroyed.size } : {};
      const undestroyedBefore = new Set(ledger.undestroyed.keys());
      // Every scenario, fleet or baseline, starts on a CPU that the previous one's background
      // work (standby launches, RAM pool refills) has left (loadtest/quiet.ts).
      if (samples > 0) {
        const settle = await waitForQuietCpu({ ...QUIET, signal: run.signal });
        run.check(name);
        if (settle.unreadable) quietUnreadable = settle.unreadable;
        else settled.push(`${name} ${settle.waitedMs} ms${settle.quiet ? '' : ` (gave up, ${Math.round(settle.busy * 100)}% busy)`}`);
      }
      const t0 = Date.now();
      const kinds = timedKind(name);
      d.phaseSink = (kind, p) => {
        if (!kinds.includes(kind)) return;
        const list = rec.phases.get(name);
        if (list) list.push(p);
        else rec.phases.set(name, [p]);
      };
      try {
        let truncated: string | undefined;
        for (let i = 0; i < samples; i++) {
          if (i > 0 && (Date.now() - t0 > cfg.durationMs || overBudget())) {
            truncated = `${i} of ${samples} samples`;
            notes.push(`${name}: stopped after ${truncated} (time budget); no target is judged on it`);
            break;
          }
          run.check(name);
          for (const ms of await one()) rec.record(name, ms);
        }
        rec.finish(name, undefined, truncated, { ...left, ...undestroyedNote(name, undestroyedBefore) });
      } catch (e) {
        if (e instanceof RunStopped || run.signal.aborted) throw e instanceof RunStopped ? e : new RunStopped(name);
        rec.finish(name, e instanceof Error ? e.message : String(e), undefined, { ...left, ...undestroyedNote(name, undestroyedBefore) });
      } finally {
        d.phaseSink = undefined;
      }
    }

    log('template: boot + setup through the API');
    const tpl = await setup.coldBoot(cfg.guestMib, cfg.dirtyMib);
    if (selected('cold_boot')) {
      rec.record('cold_boot', tpl.ms);
      notes.push(`cold_boot sample 1 is the template${localP ? ', booted while the QEMU-level baseline guest booted too (both setups share the CPUs)' : ''}.`);
    }
    const s0 = await setup.snapshot(tpl.sb.id);
    log(`template ${tpl.sb.id} on ${tpl.sb.hostId}, snapshot ${s0.id} (${s0.storedBytes} stored bytes of ${s0.logicalBytes})`);
    // Setup ends here: no timed scenario shares the CPUs with the baseline guest's preparation.
    const waitedMs = await baselinePrepared(localP, run.signal);
    run.check('QEMU-level baseline preparation');
    if (waitedMs >= 1000) notes.push(`the timed scenarios waited ${Math.round(waitedMs / 1000)} s after the template's snapshot for the QEMU-level baseline guest's preparation (untimed).`);
    const kids = async (r: { children: Array<{ id: string }>; ms: number[] }): Promise<number[]> => {
      await d.destroyAll(r.children.map((c) => c.id));
      return r.ms;
    };

    // The scenarios whose p50s the issue's ratios compare take at least 5 samples: with 3, the
    // p50 is the middle one, and single samples swing by hundreds of ms on a shared machine.
    const ratioSamples = Math.max(cfg.samples, 5);
    // Every child must land on a host that held the snapshot just before the fork (read untimed).
    for (const n of [1, 4, 8]) {
      await scenario(`fork_same_host_${n}`, n === 1 ? ratioSamples : Math.max(1, Math.ceil(cfg.samples / (n / 2))), async () => {
        const holders = (await d.getSnapshot(s0.id)).hostIds;
        return kids(await d.fork(s0.id, n, { locality: Locality.SAME_HOST }, { holders, on: 'holder' }));
      });
    }

    // A sample takes ~0.1 s, and single samples swing by tens of ms on a shared machine (the
    // first follows fork_same_host_8's teardown): with 15, one or two slow samples barely move the p50.
    await scenario('resume_paused', Math.max(cfg.samples, 15), async () => {
      await d.pause(tpl.sb.id);
      return [await d.resume(tpl.sb.id)];
    });

    // Cross host: the target hosts must lack the snapshot, so take a fresh one when every host holds it (not timed).
    let cur: Snapshot = s0;
    const fresh = async (needFree: number): Promise<Snapshot> => {
      cur = await d.getSnapshot(cur.id);
      if (hosts.length - new Set(cur.hostIds).size < needFree) cur = await setup.snapshot(tpl.sb.id);
      return cur;
    };
    if (hosts.length < 2) {
      for (const n of ['fork_cross_host_1', 'fork_cross_host_4']) rec.skip(n, 'needs at least 2 hosts');
    } else {
      // Every child must land on a host that did not hold the snapshot just before the fork.
      const crossFork = async (need: number, n: number): Promise<number[]> => {
        const s = await fresh(need);
        return kids(await d.fork(s.id, n, { locality: Locality.CROSS_HOST }, { holders: s.hostIds, on: 'non-holder' }));
      };
      await scenario('fork_cross_host_1', ratioSamples, () => crossFork(1, 1));
      await scenario('fork_cross_host_4', Math.max(1, Math.ceil(cfg.samples / 2)), () => crossFork(hosts.length - 1, 4));
    }
    // SPREAD is a preference, not a limit (common.proto; scheduler/cost.ts adds 50 ms per
    // sibling on a host): children may share a host when that is clearly faster, so no sample
    // fails on where they went. Where they went is noted.
    const spreads: string[] = [];
    await scenario('fork_fanout', Math.max(1, Math.ceil(cfg.samples / 2)), async () => {
      const s = await fresh(hosts.length - 1);
      const r = await d.fork(s.id, cfg.fanout, { spread: Spread.SPREAD });
      spreads.push(childrenPerHost(r.children, s.hostIds));
      return kids(r);
    });
    if (spreads.length) notes.push(`fork_fanout: children per host in each sample (SPREAD prefers distinct hosts but does not require them): ${spreads.map((x) => `[${x}]`).join('; ')}.`);
    // A host fetches only the chunks it lacks, and every snapshot here is of the same template:
    // a host that fetched an earlier one holds most of a fresh one's chunks. What each sample
    // moved says how cold its cross-host fork was (a restore by migration moves the whole RAM).
    for (const name of ['fork_cross_host_1', 'fork_cross_host_4', 'fork_fanout']) {
      const moved = (rec.phases.get(name) ?? []).map((p) => (p.bytes_moved / 1048576).toFixed(1));
      if (moved.length) notes.push(`${name}: MiB moved per sample: ${moved.join(', ')} (a snapshot of the template stores ${(Number(s0.storedBytes) / 1048576).toFixed(1)} MiB; less means the hosts held chunks of an earlier one).`);
    }

    await scenario('restore_concurrent', Math.max(1, Math.ceil(cfg.samples / 2)), async () => {
      const r = await d.restoreConcurrent(s0.id, cfg.concurrency, cfg.guestMib);
      await d.destroyAll(r.sandboxes.map((s) => s.id));
      return r.ms;
    });

    // Hibernate + wake. Warm: the hibernation snapshot is on the host. Cold: its host is
    // cordoned, so the wake must land on a host that fetches the snapshot from a peer.
    // The child is destroyed on every path, one whose hibernate failed included (Driver.wakeHibernated).
    let hibernateUnsupported: string | undefined;
    const onHibernateError = (e: unknown): void => {
      if (e instanceof OpFailed && e.notSupported) hibernateUnsupported = `HibernateSandbox not supported by this fleet: ${e.message}`;
    };
    const wake = async (cold: boolean): Promise<number[]> => [await d.wakeHibernated(s0.id, cold, onHibernateError)];
    for (const [name, cold] of [['resume_hibernated_warm', false], ['resume_hibernated_cold', true]] as const) {
      if (hibernateUnsupported) rec.skip(name, hibernateUnsupported);
      else if (cold && hosts.length < 2) rec.skip(name, 'needs at least 2 hosts');
      else {
        await scenario(name, ratioSamples, () => wake(cold));
        if (hibernateUnsupported) rec.skip(name, hibernateUnsupported);
      }
    }

    // QEMU-level baselines.
    if (localP) {
      try {
        local = await localP;
        run.check('QEMU-level baselines');
        // Its boot is below the API (and maybe on another accel): env.baseline_cold_boot_ms, not a cold_boot sample.
        notes.push(`QEMU-level baseline guest: accel ${local.accel}; its boot+setup took ${Math.round(local.coldBootMs)} ms below the API (env.baseline_cold_boot_ms; cold_boot is through the API only).`);
        await scenario('classic_restore', ratioSamples, async () => [await classicRestoreOnce(local!)]);
        const [a, b] = fleetHosts;
        // The copy is encrypted exactly when the fork's migration streams are (with the peer
        // certificates the fleet issued its hosts): plain with --peer-tls off or FF_PEER_MIGRATION_TLS=off.
        const peerFiles = (h: { dataDir: string }): readonly [string, string, string] => {
          const f = fleetMod!.peerCertFiles(h);
          return [f.ca, f.cert, f.key];
        };
        const naiveTls = a && b && fleetMod && migrationStreamsEncrypted(cfg.peerTls) ? { from: peerFiles(a), to: peerFiles(b) } : undefined;
        // The copy server's stop is in the clean-up list from its spawn on, not from its "listening":
        // a Ctrl-C in between would leave it running in the fleet host's namespace.
        const naive = await startNaive(local, a && b ? { fromNetns: a.netns, toNetns: b.netns, fromAddress: a.address, port: 7990, ...(naiveTls ? { tls: naiveTls } : {}) } : { fromAddress: '127.0.0.1', port: 19795 }, (stop) => cleanup.push(stop));
        if (!(a && b)) notes.push('naive_full_copy: no fleet namespaces known (--api), so the copy ran over unshaped loopback.');
        const copies: Array<{ bytes: number; copyMs: number }> = [];
        await scenario('naive_full_copy', ratioSamples, async () => {
          const r = await naive.once();
          copies.push(r);
          return [r.ms];
        });
        if (copies.length) {
          const ms = copies.map((c) => c.copyMs).sort((x, y) => x - y);
          notes.push(`naive_full_copy: copied ${(copies[0]!.bytes / 1048576).toFixed(1)} MiB (full-RAM save stream + disk layer) ${naiveTls ? 'over mutual TLS, as the fleet\'s peers, ' : ''}in ${Math.round(ms[(ms.length - 1) >> 1]!)} ms (median of ${ms.length}; ${Math.round(ms[0]!)}-${Math.round(ms[ms.length - 1]!)}), then a classic restore.`);
        }
      } catch (e) {
        if (e instanceof RunStopped) throw e;
        // A selected baseline that could not run failed (the run exits nonzero), it was not skipped.
        const why = `QEMU-level baseline failed: ${e instanceof Error ? e.message : String(e)}`;
        for (const n of ['classic_restore', 'naive_full_copy']) {
          if (rec.results[n]) continue;
          if (selected(n)) rec.finish(n, why);
          else rec.skip(n, 'not selected (--only)');
        }
      }
    }
    // More cold boots if there is time left.
    await scenario('cold_boot', overBudget() ? 0 : 1, async () => {
      const r = await d.coldBoot(cfg.guestMib, cfg.dirtyMib);
      await d.destroyAll([r.sb.id]);
      return [r.ms];
    });
    await d.tidy();
    if (ledger.undestroyed.size) notes.push(`${ledger.undestroyed.size} sandbox(es) could not be destroyed even at the end (tidy): ${[...ledger.undestroyed.keys()].join(', ')}; they are still on the fleet.`);
    // A failed scenario (or --keep-logs): the fleet's process logs outlive the fleet (fleet:down deletes its directory).
    const failed = failedNames(rec.results);
    if ((failed.length > 0 || cfg.keepLogs) && fleetMod) {
      const kept = join(cfg.report, 'fleet-logs');
      rmSync(kept, { recursive: true, force: true });
      cpSync(join(cfg.fleetDir, 'logs'), kept, { recursive: true });
      notes.push(`${failed.length > 0 ? `${failed.join(', ')} failed: ` : ''}the fleet's process logs are kept in ${kept}.`);
    }

    const scenarios: Record<string, ScenarioResult> = {};
    const samples: Record<string, number[]> = {};
    const phases: Record<string, PhaseSummary> = {};
    for (const n of SCENARIOS) {
      scenarios[n] = rec.results[n] ?? { skipped: 'not run' };
      samples[n] = (rec.hists.get(n)?.samples ?? []).map((x) => Math.round(x * 10) / 10);
      const p = summarisePhases(rec.phases.get(n) ?? []);
      if (p) phases[n] = p;
    }
    if (quietUnreadable) notes.push(`no scenario waited for a quiet CPU: ${quietUnreadable}`);
    if (settled.length) notes.push(`before its first sample each scenario waited for a quiet CPU (a ${QUIET.windowMs} ms window under ${QUIET.busyBelow * 100}% busy, at most ${QUIET.maxMs / 1000} s): ${settled.join(', ')}.`);
    notes.push(`fork_fanout: ${cfg.fanout} children, placement.spread SPREAD; restore_concurrent: ${cfg.concurrency} CreateSandbox(snapshot_id) at once; run took ${Math.round((Date.now() - started) / 1000)} s.`);
    // A fleet started here has --link on its links; a given one (--api) has what its hosts report.
    const linkGbps = fleetMod ? cfg.linkGbps : linkGbpsOf(hosts);
    if (!fleetMod) notes.push(`link: ${linkGbps === null ? 'unknown (the hosts report no link rate, or differing ones)' : `${linkGbps} Gbit/s, as the hosts report it`}; --link applies only to a fleet the load test starts.`);
    // RunEnv's fields, the baseline guest's boot, and the template snapshot's size (what a cold fetch moves: the planner reads it).
    const env: RunEnv = {
      accel, ...baselineEnv(local), hosts: hosts.length, link_gbps: linkGbps, guest_mib: cfg.guestMib, dirty_mib: cfg.dirtyMib, date: new Date().toISOString(), git_commit: gitCommit(), api: apiAddr, mode: cfg.quick ? 'quick' : 'full',
      snapshot_stored_bytes: Number(s0.storedBytes), notes,
    };
    return {
      schema_version: SCHEMA_VERSION,
      env,
      scenarios,
      samples,
      phases,
    };
  } finally {
    // First: a teardown started by a signal waits for this (the run's code has unwound).
    run.loopEnded();
    try {
      await run.undo();
    } finally {
      run.off();
    }
  }
}

const { full: F, quick: Q } = MODE_DEFAULTS;
const USAGE = `usage: npm run loadtest -- [--quick] [--json FILE] [--report DIR] [--api HOST:PORT]
         [--hosts 3] [--link 10gbit] [--guest-mib 256] [--dirty-mib 64] [--samples ${F.samples}]
         [--concurrency 4] [--fanout N] [--duration ${F.duration}] [--budget ${F.budget}] [--op-timeout ${F.opTimeout}]
         [--metrics-port 19790] [--keep-logs] [--peer-tls on|off]
         [--fleet-dir DIR] [--prefix P] [--base-port N]
         [--only fork_cross_host_4,resume_paused,...]   (the others are reported as skipped)
         --quick's defaults: --samples ${Q.samples} --duration ${Q.duration} --budget ${Q.budget} --op-timeout ${Q.opTimeout}
       npm run loadtest -- --plan --forks-per-s X --p95-ms Y --from FILE
         [--fork-n 1] [--host-slots 4] [--seconds 20]   (capacity planning from a run's JSON:
         the fewest hosts per link rate for a p95 per child; --host-slots assumes the agents'
         FF_STEP_CONCURRENCY; --seconds are measured after a warm-up of 40 s)
Without --api it starts its own fleet and always brings it down. Method: docs/adr/0010-loadtest-method.md.
`;

/** A command line the load test cannot parse: reported in one line with the usage hint, exit 2, nothing started. */
class UsageError extends Error {}

/** The options main() takes (USAGE). */
function parseArgsOrUsage(args: string[]) {
  try {
    return parseArgs({
      args,
      options: {
        quick: { type: 'boolean' }, plan: { type: 'boolean' }, json: { type: 'string' }, report: { type: 'string' }, api: { type: 'string' },
        hosts: { type: 'string' }, link: { type: 'string' }, 'guest-mib': { type: 'string' }, 'dirty-mib': { type: 'string' }, samples: { type: 'string' },
        concurrency: { type: 'string' }, fanout: { type: 'string' }, duration: { type: 'string' }, budget: { type: 'string' }, 'op-timeout': { type: 'string' },
        'metrics-port': { type: 'string' }, 'keep-logs': { type: 'boolean' }, only: { type: 'string' }, 'fleet-dir': { type: 'string' }, prefix: { type: 'string' }, 'base-port': { type: 'string' },
        'forks-per-s': { type: 'string' }, 'p95-ms': { type: 'string' }, from: { type: 'string' }, 'fork-n': { type: 'string' }, 'host-slots': { type: 'string' }, seconds: { type: 'string' }, 'peer-tls': { type: 'string' },
      },
    }).values;
  } catch (e) {
    // parseArgs' own errors (an unknown option, a missing value, a stray word): one line, not a stack.
    if (e instanceof TypeError && 'code' in e && String(e.code).startsWith('ERR_PARSE_ARGS')) throw new UsageError(`${e.message} (npm run loadtest -- --help)`);
    throw e;
  }
}

/** Resolves with the exit status: 1 when a scenario failed (its figures are partial; the reports say which). */
async function main(argv = process.argv.slice(2)): Promise<number> {
  if (argv.includes('-h') || argv.includes('--help')) {
    process.stdout.write(USAGE);
    return 0;
  }
  const values = parseArgsOrUsage(argv);
  if (values.plan) {
    // Like the fleet's options: a missing or bad flag, an unreadable --from, a run the planner
    // cannot use or a target no fleet meets ends in one line naming the flag, exit 2.
    const usage = (e: unknown): UsageError => new UsageError(`${e instanceof Error ? e.message : String(e)} (npm run loadtest -- --help)`);
    if (!values.from || !values['forks-per-s'] || !values['p95-ms']) throw usage('--plan needs --forks-per-s X --p95-ms Y --from FILE');
    const posNumber = (field: 'forks-per-s' | 'p95-ms'): number => {
      const v = values[field]!;
      const n = Number(v);
      if (!(Number.isFinite(n) && n > 0)) throw usage(`--${field}: want a number > 0, got ${JSON.stringify(v)}`);
      return n;
    };
    let options: PlanOptions;
    let run: RunResult;
    try {
      options = {
        forksPerSecond: posNumber('forks-per-s'), p95TargetMs: posNumber('p95-ms'),
        ...(values['fork-n'] !== undefined ? { childrenPerFork: posInt(values['fork-n'], 'fork-n', 1) } : {}),
        ...(values['host-slots'] !== undefined ? { slotsPerHost: posInt(values['host-slots'], 'host-slots', 4) } : {}),
        ...(values.seconds !== undefined ? { simulatedSeconds: posInt(values.seconds, 'seconds', 20) } : {}),
      };
      let text: string;
      try {
        text = readFileSync(values.from, 'utf8');
      } catch (e) {
        throw new Error(`--from: cannot read ${values.from}: ${e instanceof Error ? e.message : String(e)}`);
      }
      try {
        run = JSON.parse(text) as RunResult;
      } catch (e) {
        throw new Error(`--from: ${values.from} is not JSON: ${e instanceof Error ? e.message : String(e)}`);
      }
    } catch (e) {
      throw e instanceof UsageError ? e : usage(e);
    }
    let plan: Plan;
    try {
      plan = planCapacity(run, options);
    } catch (e) {
      throw e instanceof PlanInputError ? usage(e) : e;
    }
    process.stdout.write(formatPlan(plan));
    if (values.json) writeFileSync(values.json, `${JSON.stringify(plan, null, 2)}\n`);
    return 0;
  }
  let cfg: Readonly<LoadtestConfig>;
  try {
    cfg = compileConfig(values);
  } catch (e) {
    // A bad value (`--hosts 0`, `--link 10gb`): compileConfig only reads the options.
    throw new UsageError(`${e instanceof Error ? e.message : String(e)} (npm run loadtest -- --help)`);
  }
  const result = await runLoad(cfg);
  mkdirSync(cfg.report, { recursive: true });
  const { markdown, files } = renderReport(result);
  writeFileSync(join(cfg.report, 'report.md'), markdown);
  for (const [f, svg] of Object.entries(files)) writeFileSync(join(cfg.report, f), svg);
  // The ratios against this run's own baselines go into the JSON too, not only into the report.
  const ratios = checks(result.scenarios, result.env);
  const withRatios = `${JSON.stringify({ ...result, checks: ratios }, null, 2)}\n`;
  writeFileSync(join(cfg.report, 'result.json'), withRatios);
  if (cfg.json) writeFileSync(cfg.json, withRatios);
  for (const c of ratios) log(`${c.what.padEnd(50)} ${c.target.padEnd(9)} ${c.value.padEnd(10)} ${c.ok === undefined ? 'no data' : c.ok ? 'ok' : 'MISS'}`);
  log(`report: ${join(cfg.report, 'report.md')}`);
  process.stdout.write(`${JSON.stringify({ schema_version: result.schema_version, env: result.env, scenarios: result.scenarios, checks: ratios })}\n`);
  const failed = failedNames(result.scenarios);
  if (failed.length) log(`failed: ${failed.join(', ')} (exit 1)`);
  return failed.length ? 1 : 0;
}

// Run as a script only: the unit tests import the helpers above.
if (process.argv[1] && resolve(process.argv[1]) === resolve(import.meta.filename)) {
  main().then(
    (code) => process.exit(code),
    (e: unknown) => {
      process.stderr.write(`loadtest: ${e instanceof UsageError ? e.message : e instanceof Error ? (e.stack ?? e.message) : String(e)}\n`);
      process.exit(e instanceof UsageError ? 2 : 1);
    },
  );
}
