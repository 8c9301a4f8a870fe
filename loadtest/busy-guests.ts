// Benchmark: does the control plane stay responsive while every guest burns CPU? (ADR 0018)
//
//   npm run loadtest:busy -- [--children 32] [--seconds 30] [--json FILE]   (a local fleet must be up)
//
// An RL step forks N children that all compute at once. This creates one sandbox whose guest
// spins forever (`while :; do :; done`), forks it `children` times spread over the hosts
// (every child inherits the spinning process), and for `seconds` samples every 250 ms:
// ListHosts through the API (latency, each host's state and heartbeat age) and each
// scheduler's `forkfleet_scheduler_is_leader`. The same sampling runs for 5 s before the fork
// (the baseline: one busy guest). Then it destroys everything it made. Prints JSON:
//   { env: {guest_cgroup, hosts, children, seconds, cores}, fork_ms,
//     baseline: {api_ms, api_failures, heartbeat_age_ms}, busy: {api_ms, api_failures, heartbeat_age_ms, hosts_not_ready,
//     host_state_changes, leader_changes, leaderless_samples}, load_avg }
// Compare runs of the fleet with FF_GUEST_CGROUP= (off) and without it (on), at the same
// `children`. Nothing here is timed as a pass/fail check: it reports what it saw.
import { parseArgs } from 'node:util';
import { readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { cpus, loadavg } from 'node:os';
import { Forkfleet } from '../services/sdk/index.ts';
import type { Sandbox } from '../services/sdk/index.ts';
import { LatencyHistogram } from './hist.ts';
import { onInterrupt } from './interrupt.ts';

const { values } = parseArgs({
  options: {
    children: { type: 'string', default: '32' },
    seconds: { type: 'string', default: '30' },
    json: { type: 'string', default: '' },
    dir: { type: 'string', default: process.env.FF_FLEET_DIR ?? '/var/lib/ffleet' },
  },
});
const children = Number(values.children);
const seconds = Number(values.seconds);
if (!(Number.isInteger(children) && children >= 1 && children <= 256)) throw new Error('--children: an integer in [1, 256]');
if (!(seconds > 0)) throw new Error('--seconds: a positive number');

interface FleetStateFile {
  apiAddresses: string[];
  metricsAddresses: string[];
  hosts: unknown[];
  guestCgroup?: string;
}
const state = JSON.parse(readFileSync(join(values.dir, 'state.json'), 'utf8')) as FleetStateFile;
const ff = new Forkfleet({ address: state.apiAddresses.join(',') });
const log = (s: string): void => void process.stderr.write(`busy-guests: ${s}\n`);

interface Phase {
  /** ListHosts alone, call to answer. */
  api: LatencyHistogram;
  /** ListHosts calls that failed or took over 30 s (not in `api`). */
  apiFailures: number;
  heartbeatAge: LatencyHistogram;
  notReady: number;
  stateChanges: number;
  leaderChanges: number;
  leaderless: number;
}
const newPhase = (): Phase => ({ api: new LatencyHistogram(), apiFailures: 0, heartbeatAge: new LatencyHistogram(), notReady: 0, stateChanges: 0, leaderChanges: 0, leaderless: 0 });

/** Which scheduler leads, by its metrics address ('' when none says so or none answers). */
async function leader(): Promise<string> {
  const says = await Promise.all(
    state.metricsAddresses.map(async (a) => {
      const text = await fetch(`http://${a}/metrics`, { signal: AbortSignal.timeout(2000) }).then((r) => r.text(), () => '');
      return /^forkfleet_scheduler_is_leader 1$/m.test(text) ? a : '';
    }),
  );
  return says.filter(Boolean).join('+');
}

/** Samples every 250 ms into `phase` until `untilMs`. */
async function sample(phase: Phase, untilMs: number): Promise<void> {
  let lastStates = new Map<string, string>();
  let lastLeader: string | undefined;
  while (performance.now() < untilMs) {
    const next = performance.now() + 250;
    const t0 = performance.now();
    // Timed alone: the leader reads below run alongside and are not in the figure.
    const timedList = ff.hosts.list({ timeoutMs: 30_000 }).then(
      (hosts) => ({ hosts, ms: performance.now() - t0, at: Date.now() }),
      () => undefined,
    );
    const [listed, lead] = await Promise.all([timedList, leader()]);
    if (listed) {
      phase.api.record(listed.ms);
      for (const h of listed.hosts) {
        if (h.state !== 'ready') phase.notReady++;
        if (lastStates.size > 0 && lastStates.get(h.id) !== h.state) phase.stateChanges++;
        if (h.lastHeartbeat) phase.heartbeatAge.record(Math.max(0, listed.at - Date.parse(h.lastHeartbeat)));
      }
      lastStates = new Map(listed.hosts.map((h) => [h.id, h.state]));
    } else phase.apiFailures++;
    if (!lead) phase.leaderless++;
    if (lastLeader !== undefined && lead && lead !== lastLeader) phase.leaderChanges++;
    if (lead) lastLeader = lead;
    await new Promise((r) => setTimeout(r, Math.max(0, next - performance.now())));
  }
}

const report = (p: Phase): Record<string, unknown> => ({
  api_ms: p.api.summary(),
  api_failures: p.apiFailures,
  heartbeat_age_ms: p.heartbeatAge.summary(),
  hosts_not_ready: p.notReady,
  host_state_changes: p.stateChanges,
  leader_changes: p.leaderChanges,
  leaderless_samples: p.leaderless,
});

let parent: Sandbox | undefined;
let kids: Sandbox[] = [];
/** Every sandbox this run makes carries it, so a run stopped mid-fork (children not known yet) still finds them. */
const LABEL = { loadtest: `busy-guests-${process.pid}-${Date.now()}` };
let tidied: Promise<void> | undefined;
const tidy = (): Promise<void> =>
  (tidied ??= (async () => {
    log('destroying what it made');
    // A fork stopped by Ctrl-C may still be committing children after a lookup: look again
    // until a lookup finds nothing more (three rounds at most). Whatever could not be
    // destroyed, or looked up, is named and the run exits nonzero: those guests would spin on
    // and skew every later run on the fleet.
    let ids = new Set([...kids.map((k) => k.id), ...(parent ? [parent.id] : [])]);
    const gone = new Set<string>();
    const failed = new Map<string, string>();
    for (let round = 0; round < 3; round++) {
      const lookup = `(list by label ${LABEL.loadtest})`;
      const made = await ff.list({ labels: LABEL }).then(
        (list) => (failed.delete(lookup), list.map((s) => s.id)),
        (e: unknown) => {
          failed.set(lookup, e instanceof Error ? e.message : String(e));
          return [];
        },
      );
      for (const id of made) ids.add(id);
      const todo = [...ids].filter((id) => !gone.has(id) && !failed.has(id));
      if (todo.length === 0) break;
      const results = await Promise.allSettled(todo.map((id) => ff.sandbox(id).destroy({ timeoutMs: 10 * 60_000 })));
      results.forEach((r, i) => (r.status === 'fulfilled' ? gone.add(todo[i]!) : failed.set(todo[i]!, r.reason instanceof Error ? r.reason.message : String(r.reason))));
      ids = new Set();
    }
    ff.close();
    if (failed.size > 0) {
      for (const [id, why] of failed) log(`not destroyed: ${id}: ${why}`);
      process.exitCode = 1;
    }
  })());
// Ctrl-C or a kill: the spinning guests are destroyed all the same (they would skew every later run on the fleet).
onInterrupt(tidy, log);
try {
  parent = await ff.create({ image: 'tiny', memoryMib: 256, labels: LABEL });
  // Detached from the exec: the spinning loop outlives it, in the parent and in every child.
  const r = await parent.sh('setsid sh -c "while :; do :; done" </dev/null >/dev/null 2>&1 & echo ok');
  if (r.stdout.trim() !== 'ok') throw new Error(`could not start the busy loop: ${r.stderr}`);
  log(`parent ${parent.id} spins; baseline for 5 s`);
  const baseline = newPhase();
  await sample(baseline, performance.now() + 5000);
  log(`forking ${children} children (spread)`);
  const t0 = performance.now();
  kids = await parent.fork(children, { spread: 'spread', labels: LABEL }, { timeoutMs: 30 * 60_000 });
  const forkMs = Math.round(performance.now() - t0);
  log(`forked in ${forkMs} ms; sampling for ${seconds} s with ${kids.length + 1} spinning guests`);
  const busy = newPhase();
  await sample(busy, performance.now() + seconds * 1000);
  const out = {
    env: { guest_cgroup: state.guestCgroup ?? '', hosts: state.hosts.length, children, seconds, cores: cpus().length },
    fork_ms: forkMs,
    baseline: report(baseline),
    busy: report(busy),
    load_avg: loadavg().map((x) => Number(x.toFixed(2))),
  };
  const text = `${JSON.stringify(out, null, 2)}\n`;
  process.stdout.write(text);
  if (values.json) writeFileSync(values.json, text);
} finally {
  await tidy();
}
