// Experiment harness for the transfer benchmark (not part of `npm run bench:transfer`): sets
// up the two namespaces and the source store once, then runs the fetch `--reps` times per
// configuration, so settings can be compared at the same machine load. Same endpoint,
// same link shaping and the same wire-byte counting as transfer.ts: `wire` is the sender's
// direction only (what goodput divides), from the root tbf's byte counter on a shaped link
// (`wire_counter` "tbf", transfer-link.ts) or the veth's on an unshaped one (--rate 0,
// "veth"); `wire_reverse` is the receiver's direction, `veth_forward` the sender's veth counter.
//   node --import tsx host-agent/bench/transfer-probe.ts --rate 1 --reps 3 \
//     --config 'base=' --config 'one=FF_STREAMS=1' [--prof DIR] [--naive] [--content synthetic|guest]
// A config is NAME=ENV[;ENV...] (environment of the fetch process). --prof writes CPU
// profiles of the fetch and server processes into DIR. --warm: each config fetches through its
// own long-lived receiver (`fetch-daemon`, as bench:transfer's `seconds`), warmed by one fetch
// of the warm-up snapshot `w` into a store of its own. Every fetch gets a new store; all are
// deleted at the end.
import { parseArgs } from 'node:util';
import { rmSync, mkdirSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { encodeSignedTicket, signTicket } from '../domain/tickets.ts';
import { createFabric, readLog, type NsHost } from '../adapters/peer/netns-testkit.ts';
import { procCpu, tempDir, waitFor } from '../../services/testkit/proc.ts';
import { prepareSource, prepareWarmup, startDaemon } from './transfer-source.ts';
import { parseRates, sampleEgress, setLinkRate, wireBytes, type EgressSample } from './transfer-link.ts';
import { snapshotBootedGuest } from './transfer-guest.ts';
import { loadavg } from 'node:os';
import { execFileSync, spawn } from 'node:child_process';

/** tbf drops and TCP retransmissions in a namespace (cumulative). */
function linkStats(ns: string): { drops: number; retrans: number } {
  const tc = execFileSync('ip', ['netns', 'exec', ns, 'tc', '-s', 'qdisc', 'show', 'dev', 'eth0']).toString();
  const snmp = execFileSync('ip', ['netns', 'exec', ns, 'cat', '/proc/net/snmp']).toString().split('\n').filter((l) => l.startsWith('Tcp:'));
  const [hdr, val] = snmp.map((l) => l.trim().split(/\s+/));
  const retrans = Number(val?.[hdr?.indexOf('RetransSegs') ?? -1] ?? 0);
  return { drops: Number(/dropped (\d+)/.exec(tc)?.[1] ?? 0), retrans };
}

const here = fileURLToPath(new URL('.', import.meta.url));
const ENDPOINT = resolve(here, '../adapters/peer/endpoint-main.ts');

async function main(): Promise<void> {
  const { values } = parseArgs({
    options: { rate: { type: 'string', default: '1' }, reps: { type: 'string', default: '3' }, config: { type: 'string', multiple: true }, prof: { type: 'string' }, naive: { type: 'boolean', default: false }, 'server-env': { type: 'string', default: '' }, 'server-endpoint': { type: 'string' }, warm: { type: 'boolean', default: false }, content: { type: 'string', default: 'synthetic' } },
  });
  const rates = parseRates(values.rate ?? '1');
  if (rates.length !== 1) throw new Error(`--rate: one link rate, not "${values.rate}"`);
  const g = rates[0]!;
  const configs = (values.config ?? ['base=']).map((c) => {
    const i = c.indexOf('=');
    const env = Object.fromEntries(c.slice(i + 1).split(';').filter(Boolean).map((kv) => kv.split('=') as [string, string]));
    return { name: c.slice(0, i), env };
  });
  const dir = tempDir('ff-probe-');
  const fabric = createFabric(2, 'ff-p');
  const daemons = new Map<string, ReturnType<typeof startDaemon>>();
  try {
    const [h0, h1] = fabric.hosts as [NsHost, NsHost];
    // guest: a booted guest's snapshot, as bench:transfer's default (transfer-guest.ts).
    const guest = values.content === 'guest' ? (await snapshotBootedGuest(dir, (line) => process.stderr.write(`${line}\n`))).s1 : undefined;
    const { artifacts, pem, srcRoot, signing, store } = await prepareSource(dir, guest);
    if (values.warm) await prepareWarmup(dir, artifacts, store, signing);
    const prof = values.prof ? resolve(values.prof) : undefined;
    if (prof) mkdirSync(prof, { recursive: true });
    // One directory per process kind: a tsx process also profiles its loader thread.
  const profArgs = (who: string): string[] => (prof ? ['--cpu-prof', '--cpu-prof-dir', join(prof, who)] : []);
    const port = 7443;
    const srvLog = join(dir, 'server.log');
    const server = fabric.spawn(h0, 'chunk-server', ['env', ...(values['server-env'] ?? '').split(';').filter(Boolean), process.execPath, ...profArgs('server'), '--import', 'tsx', values['server-endpoint'] ?? ENDPOINT, 'serve', '--root', srcRoot, '--listen', `${h0.address}:${port}`, '--trust', pem], srvLog);
    await waitFor('chunk server', async () => readLog(srvLog).includes('"listening"'), 20_000, 50);
    const naive = values.naive ? fabric.spawn(h0, 'naive', [process.execPath, '--import', 'tsx', ENDPOINT, 'naive-serve', '--listen', `${h0.address}:${port + 1}`, '--files', artifacts.map((a) => a.path).join(',')], join(dir, 'naive.log')) : undefined;
    setLinkRate(fabric, [h0, h1], g);
    const ticketFor = (snapshotId: string): string => Buffer.from(encodeSignedTicket(signTicket({ snapshotId, destinationHostId: 'h1', expiresAt: new Date(Date.now() + 3_600_000) }, signing))).toString('base64');
    const ticket = ticketFor('s1');
    if (values.warm) {
      for (const c of configs) {
        const { ENDPOINT: endpoint = ENDPOINT, ...env } = c.env;
        const dm = startDaemon(h1, ['env', ...Object.entries(env).map(([k, v]) => `${k}=${v}`), process.execPath, ...profArgs(`daemon-${c.name}`), '--import', 'tsx', endpoint, 'fetch-daemon', '--trust', pem], join(dir, `daemon-${c.name}.log`));
        daemons.set(c.name, dm);
        const wu = await dm.ask({ root: join(dir, `warmup-${c.name}`), hostId: 'h1', snapshot: 'w', ticket: ticketFor('w'), sources: `${h0.address}:${port}`, materialise: true });
        if (wu.ok !== true) throw new Error(`warm-up of ${c.name} failed: ${JSON.stringify(wu)}`);
        process.stdout.write(`${JSON.stringify({ config: c.name, warmup: true, seconds: wu.seconds, cpu_ms: wu.cpu_ms, faults: wu.page_faults })}\n`);
      }
    }
    /** The egress counters of the sender (h0) and the receiver (h1). */
    const egress = (): [EgressSample, EgressSample] => [sampleEgress(fabric, h0), sampleEgress(fabric, h1)];
    for (let rep = 0; rep < Number(values.reps); rep++) {
      for (const c of configs) {
        const dst = join(dir, `dst-${c.name}-${rep}`);
        // ENDPOINT=PATH in a config runs the fetch from another tree (A/B against a baseline).
        const { ENDPOINT: endpoint = ENDPOINT, ...env } = c.env;
        const envArgs = Object.entries(env).map(([k, v]) => `${k}=${v}`);
        const before = egress();
        const ls0 = [linkStats(h0.ns), linkStats(h1.ns)];
        const srvCpu0 = procCpu(server.pid);
        // PROBE_PERF=DIR: record the fetch process (and the server meanwhile) with perf.
        const perfDir = process.env.PROBE_PERF;
        const perfEvent = process.env.PROBE_PERF_EVENT ? ['-e', process.env.PROBE_PERF_EVENT, '-c', '1'] : ['-F', '1999'];
        const perfArgs = perfDir ? ['perf', 'record', ...perfEvent, '-g', '-o', join(perfDir, `fetch-${c.name}-${rep}.data`), '--'] : [];
        const srvPerf = perfDir ? spawn('perf', ['record', ...perfEvent, '-g', '-p', String(server.pid), '-o', join(perfDir, `server-${c.name}-${rep}.data`)], { stdio: 'ignore' }) : undefined;
        const dm = daemons.get(c.name);
        const dmPerf = perfDir && dm ? spawn('perf', ['record', ...perfEvent, '-g', '-p', String(dm.pid), '-o', join(perfDir, `fetch-${c.name}-${rep}.data`)], { stdio: 'ignore' }) : undefined;
        if (dmPerf) await new Promise((r) => setTimeout(r, 300));
        const r = dm
          ? { code: 0, stderr: '', stdout: JSON.stringify(await dm.ask({ root: dst, hostId: 'h1', snapshot: 's1', ticket, sources: `${h0.address}:${port}`, materialise: true })) }
          : await fabric.run(h1, [...perfArgs, 'env', ...envArgs, process.execPath, ...profArgs(`fetch-${c.name}`), '--import', 'tsx', endpoint, 'fetch', '--root', dst, '--host-id', 'h1', '--snapshot', 's1', '--ticket', ticket, '--sources', `${h0.address}:${port}`, '--trust', pem, '--materialise'], 300_000);
        const w = wireBytes(before, egress());
        for (const pp of [dmPerf]) {
          if (!pp) continue;
          pp.kill('SIGINT');
          await new Promise((r) => pp.once('exit', r));
        }
        if (srvPerf) {
          srvPerf.kill('SIGINT');
          await new Promise((r) => srvPerf.once('exit', r));
        }
        const ls1 = [linkStats(h0.ns), linkStats(h1.ns)];
        const srvCpu1 = procCpu(server.pid);
        const srvCpu = srvCpu1.ms - srvCpu0.ms;
        const srvFaults = srvCpu1.faults - srvCpu0.faults;
        const link = { drops: ls1[0]!.drops - ls0[0]!.drops + ls1[1]!.drops - ls0[1]!.drops, retrans: ls1[0]!.retrans - ls0[0]!.retrans + ls1[1]!.retrans - ls0[1]!.retrans };
        const line = r.stdout.trim().split('\n').pop() ?? '';
        if (r.code !== 0 || !line.startsWith('{')) throw new Error(`fetch failed (${r.code}): ${r.stderr.slice(-2000)}`);
        const out = JSON.parse(line) as Record<string, unknown>;
        const s = Number(out.seconds);
        const rep2 = out.report as { ms: number };
        process.stdout.write(
          `${JSON.stringify({ config: c.name, rep, load: +loadavg()[0]!.toFixed(2), seconds: +s.toFixed(3), fetch_ms: rep2.ms, ready: +Number(out.ready_seconds).toFixed(3), durable: +Number(out.durable_seconds).toFixed(3), wire: w.forward, wire_reverse: w.reverse, wire_counter: w.counter, veth_forward: w.vethForward, goodput: +((w.forward * 8) / s / 1e9).toFixed(3), cpu_ms: out.cpu_ms, sys_ms: out.cpu_sys_ms, faults: out.page_faults, gc: out.gc, srv_cpu_ms: srvCpu, srv_faults: srvFaults, phases: out.phases, link })}\n`,
        );
        // Kept until the end: deleting ~600 files slows the next fetch's creates (ADR 0008).
      }
      if (naive) {
        const nb = egress();
        const nr = await fabric.run(h1, [process.execPath, '--import', 'tsx', ENDPOINT, 'naive-recv', '--connect', `${h0.address}:${port + 1}`, '--out', join(dir, 'naive.bin')], 300_000);
        const nw = wireBytes(nb, egress());
        const n = JSON.parse(nr.stdout.trim().split('\n').pop() ?? '{}') as { seconds: number };
        rmSync(join(dir, 'naive.bin'), { force: true });
        process.stdout.write(`${JSON.stringify({ config: 'naive', rep, load: +loadavg()[0]!.toFixed(2), seconds: +n.seconds.toFixed(3), wire: nw.forward, wire_reverse: nw.reverse, wire_counter: nw.counter, veth_forward: nw.vethForward })}\n`);
      }
    }
    for (const dm of daemons.values()) await dm.stop();
    daemons.clear();
    await server.stop(5000);
    await naive?.stop(2000);
  } finally {
    for (const dm of daemons.values()) await dm.stop().catch(() => undefined);
    await fabric.destroy();
    rmSync(dir, { recursive: true, force: true });
  }
}

main().catch((e: unknown) => {
  process.stderr.write(`${e instanceof Error ? (e.stack ?? e.message) : String(e)}\n`);
  process.exitCode = 1;
});
