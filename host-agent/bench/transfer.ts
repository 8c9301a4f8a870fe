// Transfer benchmark: two host-agent transfer endpoints in separate network namespaces on
// a tbf-shaped veth/bridge link move a 256 MiB guest's snapshot; compared with a plain TCP
// copy of the whole memory file plus disk over the same link. Then a diff snapshot.
//   npm run bench:transfer -- --json FILE [--rates 1,10] [--warmups 1] [--content guest|synthetic] [--tls]
// Needs root (ip netns, tc). --tls: the endpoints speak mutual TLS, as agents with FF_PEER_*
// do (host-agent/adapters/peer/tls.ts; certificates of a CA made for the run); the naive
// baseline stays a plain TCP stream. Content (`--content`):
// - guest (default): a real booted 256 MiB `tiny` guest whose workload put 64 MiB in its RAM,
//   32 MiB random and 32 MiB of log-like text (transfer-guest.ts), snapshotted by the VMM
//   driver; the diff snapshot is of a child forked from it that wrote 16 MiB.
// - synthetic: transfer-image.ts's 256 MiB sparse memory with ~40 MiB kernel/module pages +
//   32 MiB random + 32 MiB text and a 64 MiB disk layer; no VM runs.
//
// The receiver is measured twice per link rate (ADR 0008, "Warm receiver"):
// - `seconds` (and goodput, speedups): a long-lived receiver (`endpoint-main.ts fetch-daemon`),
//   as the host agent is: its heap, JIT, malloc arenas and verify workers are warm because it
//   first fetched (once; `--warmups N`) a warm-up snapshot `w` of the same size class whose
//   every chunk differs from s1's (checked at ingest) into a store of its own, so nothing can
//   be deduplicated:
//   the bench checks that the measured fetch fetched every chunk of s1. Every measured fetch
//   uses a new store; all are deleted only at the end (deleting them in between would slow
//   the next fetch's file creation on this machine's ext4, see ADR 0008).
// - `cold_seconds`: the same transfer into a fresh receiver process per fetch (`fetch`), the
//   method used before. Its clock starts in the new process after start-up, but the fetch
//   runs with cold JIT, a new heap (first-touch page faults, ~1 ms per fresh 256 KiB here) and
//   verify workers that boot on the first chunk: costs an agent pays once, not per fork.
// Both rows use the same chunk server (warmed by the warm-up fetch) and count wire bytes the
// same way: `bytes_on_wire` is the tx of both veth ends while the fetch runs; goodput counts
// the sender's end only (`bytes_on_wire_forward`), since tbf shapes each direction to the
// link rate on its own and the receiver's requests and ACKs (`_reverse`) use the other one.
// `speedup_vs_naive` is naive_copy_seconds / seconds (chunks stored); the naive copy's clock
// also covers writing the whole file, so `speedup_ready_vs_naive` (image complete) is the
// like-for-like one. A copy that received less than the files' size fails the run; with
// --skip-naive the naive figures and speedups are null.
// Ctrl-C or a kill: the namespaces, the processes in them, the guest's QEMUs and the run's
// directory are removed before it exits (loadtest/interrupt.ts).
import { parseArgs } from 'node:util';
import { rmSync, statSync, writeFileSync } from 'node:fs';
import { loadavg } from 'node:os';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { ingestSnapshot } from '../adapters/chunkstore/ingest.ts';
import { encodeSignedTicket, signManifest, signTicket } from '../domain/tickets.ts';
import { manifestDigests } from '../domain/snapshot-store.ts';
import { ArtifactKind } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { createFabric, endpointTlsArgs, readLog, type Fabric, type NsHost } from '../adapters/peer/netns-testkit.ts';
import { tempDir, waitFor } from '../../services/testkit/proc.ts';
import { writeChildImage } from './transfer-image.ts';
import { closeBootedGuests, snapshotBootedGuest, type BenchArtifact } from './transfer-guest.ts';
import { naiveCopied, speedup } from './naive-copy.ts';
import { undoOnInterrupt } from '../../loadtest/interrupt.ts';
import { prepareSource, prepareWarmup, startDaemon, writeSyntheticSource } from './transfer-source.ts';
import { ensureCa } from '../../deploy/pki/pki.ts';

const here = fileURLToPath(new URL('.', import.meta.url));
const ENDPOINT = resolve(here, '../adapters/peer/endpoint-main.ts');
const NODE = [process.execPath, ...(process.env.BENCH_NODE_ARGS ?? '').split(' ').filter(Boolean), '--import', 'tsx', ENDPOINT];

interface Run {
  link_gbps: number;
  logical_bytes: number;
  /** Bytes of the chunks that hold any non-zero byte (what a sparse image has allocated). */
  nonzero_bytes: number;
  /** Both directions: sender to receiver (forward) plus the receiver's requests and ACKs (reverse). */
  bytes_on_wire: number;
  bytes_on_wire_forward: number;
  bytes_on_wire_reverse: number;
  /** Warm (long-lived) receiver: until every chunk is stored (not yet synced). */
  seconds: number;
  /** Forward wire bytes (each direction of the link is shaped to link_gbps on its own) over `seconds`. */
  goodput_gbps: number;
  /** Until the materialised image is complete too (it is written while chunks arrive). */
  ready_seconds: number;
  /** ready_seconds - seconds: the materialise work left after the last chunk. */
  materialise_ms: number;
  /** Until the chunks are fsynced and the manifest stored (off the fork's critical path). */
  durable_seconds: number;
  /** Chunks the warm fetch fetched (== chunks_total: the warm-up deduplicated nothing). */
  chunks_fetched: number;
  chunks_total: number;
  /** Receiver CPU (user+sys, all threads) and minor page faults during the warm fetch. */
  cpu_ms: number;
  page_faults: number;
  /** The same transfer into a fresh receiver process (the method before: cold JIT and heap); null with --skip-cold. */
  cold_seconds: number | null;
  cold_bytes_on_wire: number | null;
  cold_goodput_gbps: number | null;
  cold_cpu_ms: number | null;
  cold_page_faults: number | null;
  /** The naive figures: null with --skip-naive. */
  naive_copy_seconds: number | null;
  naive_bytes_on_wire: number | null;
  speedup_vs_naive: number | null;
  speedup_ready_vs_naive: number | null;
  cold_speedup_vs_naive: number | null;
  load_avg: [number, number];
}

function wire(f: Fabric, hosts: readonly NsHost[]): number {
  return hosts.reduce((s, h) => s + f.counters(h).tx, 0);
}

async function main(): Promise<void> {
  const { values } = parseArgs({ options: { json: { type: 'string' }, rates: { type: 'string', default: '1,10' }, 'fsync-each': { type: 'boolean', default: false }, 'skip-naive': { type: 'boolean', default: false }, 'skip-cold': { type: 'boolean', default: false }, warmups: { type: 'string', default: '1' }, content: { type: 'string', default: 'guest' }, tls: { type: 'boolean', default: false } } });
  if (values.content !== 'guest' && values.content !== 'synthetic') throw new Error(`--content: "${values.content}" is neither guest nor synthetic`);
  let daemon: ReturnType<typeof startDaemon> | undefined;
  /** What the run made so far, for undo(). */
  const made: { dir?: string; fabric?: Fabric } = {};
  /** Undoes the run, once: at its end, or first on Ctrl-C or a kill. */
  const { undo, off: offInterrupt } = undoOnInterrupt(async () => {
    await daemon?.stop().catch(() => undefined);
    await closeBootedGuests().catch(() => undefined);
    await made.fabric?.destroy();
    if (made.dir) rmSync(made.dir, { recursive: true, force: true });
  }, (line) => process.stderr.write(`bench:transfer: ${line}\n`));
  try {
    const dir = (made.dir = tempDir('ff-bench-transfer-'));
    const fabric = (made.fabric = createFabric(2, 'ff-b'));
    const [h0, h1] = fabric.hosts as [NsHost, NsHost];
    let content: { s1: BenchArtifact[]; s2: BenchArtifact[]; changedBytes: number; image: string };
    if (values.content === 'guest') {
      const g = await snapshotBootedGuest(dir, (line) => process.stderr.write(`${line}\n`));
      content = { ...g, image: `booted guest (transfer-guest.ts): 256 MiB tiny guest, accel ${g.accel}, with 32 MiB random + 32 MiB text in tmpfs; diff: a child that wrote 16 MiB` };
    } else {
      const s1Files = writeSyntheticSource(dir);
      const child = join(dir, 'child.img');
      const changedBytes = writeChildImage(s1Files[0]!.path, child, 16 * 1024 * 1024, 7);
      content = {
        s1: s1Files,
        s2: s1Files.map((a) => (a.kind === ArtifactKind.MEMORY ? { ...a, path: child } : a)),
        changedBytes,
        image: 'synthetic (transfer-image.ts): 256 MiB sparse memory, 40 MiB kernel/module pages + 32 MiB random + 32 MiB text; 64 MiB disk layer with 16 MiB of binaries',
      };
    }
    const { pem, srcRoot, store: A, signing, s1 } = await prepareSource(dir, content.s1);
    const changed = content.changedBytes;
    const s2 = await ingestSnapshot({ snapshotId: 's2', tenantId: 't', parentSnapshotId: 's1', sourceSandboxId: 'sb1', artifacts: content.s2 }, A);
    await A.manifests.put('s2', signManifest(s2.manifest, signing));
    s2.unpin();
    const w = await prepareWarmup(dir, content.s1, A, signing);
    const s1Digests = manifestDigests(s1.manifest);
    const wDigests = manifestDigests(w.manifest);
    const s2Digests = manifestDigests(s2.manifest);
    const shared = [...wDigests].filter((d) => s1Digests.has(d) || s2Digests.has(d)).length;
    if (shared > 0) throw new Error(`warm-up snapshot shares ${shared} chunks with s1/s2`);
    process.stderr.write(`ingest s1 ${JSON.stringify(s1.stats)}\ningest s2 ${JSON.stringify(s2.stats)}\ningest w ${JSON.stringify(w.stats)}\n`);

    const port = 7443;
    // --tls: each end's certificate names its host (h0 serves, h1 is the ticket's destination).
    const tlsCa = { caCert: join(dir, 'tls-ca.crt'), caKey: join(dir, 'tls-ca.key') };
    if (values.tls) ensureCa(tlsCa.caCert, tlsCa.caKey);
    const tlsArgs = (hostId: string, address: string): string[] => (values.tls ? endpointTlsArgs(tlsCa, dir, hostId, address, `tls-${hostId}`) : []);
    const srvLog = join(dir, 'server.log');
    const server = fabric.spawn(h0, 'chunk-server', [...NODE, 'serve', '--root', srcRoot, '--listen', `${h0.address}:${port}`, '--trust', pem, ...tlsArgs('h0', h0.address)], srvLog);
    await waitFor('chunk server', async () => readLog(srvLog).includes('"listening"'), 20_000, 50);
    const naiveLog = join(dir, 'naive.log');
    const naive = fabric.spawn(h0, 'naive-server', [...NODE, 'naive-serve', '--listen', `${h0.address}:${port + 1}`, '--files', content.s1.map((a) => a.path).join(',')], naiveLog);
    /** What the naive copy must receive: every file whole. */
    const naiveBytes = content.s1.reduce((n, a) => n + statSync(a.path).size, 0);
    await waitFor('naive server', async () => readLog(naiveLog).includes('"listening"'), 20_000, 50);

    const ticketFor = (snapshotId: string): string =>
      Buffer.from(encodeSignedTicket(signTicket({ snapshotId, destinationHostId: 'h1', expiresAt: new Date(Date.now() + 600_000) }, signing))).toString('base64');
    const checked = (out: Record<string, unknown>, what: string): Record<string, unknown> => {
      if (out.ok !== true) throw new Error(`${what} failed: ${JSON.stringify(out)}`);
      return out;
    };
    // Today's method: a fresh receiver process for one fetch.
    const coldFetch = async (root: string, snapshotId: string): Promise<{ out: Record<string, unknown>; wire: number; forward: number }> => {
      const before = wire(fabric, [h0, h1]);
      const forward0 = wire(fabric, [h0]);
      const r = await fabric.run(h1, [...NODE, 'fetch', '--root', root, '--host-id', 'h1', '--snapshot', snapshotId, '--ticket', ticketFor(snapshotId), '--sources', `${h0.address}:${port}`, '--trust', pem, '--materialise', ...tlsArgs('h1', h1.address), ...(values['fsync-each'] ? ['--fsync-each'] : [])], 300_000);
      const after = wire(fabric, [h0, h1]);
      const line = r.stdout.trim().split('\n').pop() ?? '';
      if (r.code !== 0 || !line.startsWith('{')) throw new Error(`fetch failed (${r.code}): ${r.stderr.slice(-2000)}`);
      return { out: checked(JSON.parse(line) as Record<string, unknown>, 'cold fetch'), wire: after - before, forward: wire(fabric, [h0]) - forward0 };
    };
    // The agent's way: the long-lived receiver. Every fetch gets its own (new) root, so
    // nothing is deduplicated; nothing is deleted before the end (ADR 0008: on this ext4
    // without a journal, files created within minutes of many deletions cost ~1.5 ms each).
    daemon = startDaemon(h1, [...NODE, 'fetch-daemon', '--trust', pem, ...tlsArgs('h1', h1.address), ...(values['fsync-each'] ? ['--fsync-each'] : [])], join(dir, 'daemon.log'));
    const d = daemon;
    const warmFetch = async (root: string, snapshotId: string): Promise<{ out: Record<string, unknown>; wire: number; forward: number }> => {
      const before = wire(fabric, [h0, h1]);
      const forward0 = wire(fabric, [h0]);
      const out = await d.ask({ root, hostId: 'h1', snapshot: snapshotId, ticket: ticketFor(snapshotId), sources: `${h0.address}:${port}`, materialise: true });
      const after = wire(fabric, [h0, h1]);
      return { out: checked(out, `fetch ${snapshotId}`), wire: after - before, forward: wire(fabric, [h0]) - forward0 };
    };
    for (let i = 0; i < Number(values.warmups); i++) {
      const warmup = await warmFetch(join(dir, `dst-warmup-${i}`), 'w');
      process.stderr.write(`warm-up ${JSON.stringify({ seconds: warmup.out.seconds, cpu_ms: warmup.out.cpu_ms, page_faults: warmup.out.page_faults, fetched: (warmup.out.report as { fetched: number }).fetched })}\n`);
    }

    const logical = Number(s1.stats.logicalBytes);
    const nonzero = s1.manifest.artifacts.reduce((s, a) => s + a.chunks.reduce((t, c) => t + c.size, 0), 0);
    const runs: Run[] = [];
    let diff: { link_gbps: number; changed_bytes: number; bytes_on_wire: number; chunks_fetched: number; seconds: number } | undefined;
    for (const g of (values.rates ?? '1,10').split(',').map(Number)) {
      const rate = `${g}gbit`;
      const burst = g >= 10 ? '4mb' : '256kb';
      if (g > 0) {
        fabric.shape(h0, rate, burst);
        fabric.shape(h1, rate, burst);
      }
      const load0 = loadavg()[0] ?? 0;
      const { out, wire: wb, forward: wf } = await warmFetch(join(dir, `dst-${g}`), 's1');
      const seconds = Number(out.seconds);
      const rep = out.report as { fetched: number; requested: number };
      if (rep.fetched !== s1Digests.size || rep.requested !== s1Digests.size) throw new Error(`warm fetch fetched ${rep.fetched} of ${s1Digests.size} chunks (${rep.requested} requested): deduplicated`);
      process.stderr.write(`fetch ${JSON.stringify({ report: out.report, phases: out.phases, cpu_ms: out.cpu_ms, page_faults: out.page_faults })}\n`);
      if (diff === undefined) {
        // Diff, on the first rate's link (whatever --rates holds): the receiver has s1; the child changed 16 MiB.
        const dd = await warmFetch(join(dir, `dst-${g}`), 's2');
        const drep = dd.out.report as { fetched: number };
        diff = { link_gbps: g, changed_bytes: changed, bytes_on_wire: dd.wire, chunks_fetched: drep.fetched, seconds: +Number(dd.out.seconds).toFixed(3) };
        process.stderr.write(`diff ${JSON.stringify(diff)}\n`);
      }
      // The same transfer into a fresh process (and a fresh root).
      const coldRoot = join(dir, `dst-cold-${g}`);
      // --skip-cold: the cold_* fields are null (not run), never 0 (which would read as instant).
      const cold = values['skip-cold'] ? undefined : await coldFetch(coldRoot, 's1');
      const coldSeconds = cold ? Number(cold.out.seconds) : null;
      // Baseline: plain TCP stream of the whole memory file plus the disk; every byte of them, or the run fails.
      const nb = wire(fabric, [h0, h1]);
      const naiveOut = values['skip-naive'] ? undefined : naiveCopied(await fabric.run(h1, [...NODE, 'naive-recv', '--connect', `${h0.address}:${port + 1}`, '--out', join(dir, `naive-${g}.bin`)], 300_000), naiveBytes);
      const nw = wire(fabric, [h0, h1]) - nb;
      const naiveSeconds = naiveOut ? naiveOut.seconds : null;
      rmSync(join(dir, `naive-${g}.bin`), { force: true });
      runs.push({
        link_gbps: g,
        logical_bytes: logical,
        nonzero_bytes: nonzero,
        bytes_on_wire: wb,
        bytes_on_wire_forward: wf,
        bytes_on_wire_reverse: wb - wf,
        seconds: +seconds.toFixed(3),
        goodput_gbps: +((wf * 8) / seconds / 1e9).toFixed(3),
        ready_seconds: +Number(out.ready_seconds).toFixed(3),
        materialise_ms: Math.round((Number(out.ready_seconds) - seconds) * 1000),
        durable_seconds: +Number(out.durable_seconds).toFixed(3),
        chunks_fetched: rep.fetched,
        chunks_total: s1Digests.size,
        cpu_ms: Number(out.cpu_ms),
        page_faults: Number(out.page_faults),
        cold_seconds: coldSeconds === null ? null : +coldSeconds.toFixed(3),
        cold_bytes_on_wire: cold ? cold.wire : null,
        cold_goodput_gbps: cold && coldSeconds! > 0 ? +((cold.forward * 8) / coldSeconds! / 1e9).toFixed(3) : null,
        cold_cpu_ms: cold ? Number(cold.out.cpu_ms) : null,
        cold_page_faults: cold ? Number(cold.out.page_faults) : null,
        naive_copy_seconds: naiveSeconds === null ? null : +naiveSeconds.toFixed(3),
        naive_bytes_on_wire: naiveOut ? nw : null,
        speedup_vs_naive: speedup(naiveSeconds, seconds),
        speedup_ready_vs_naive: speedup(naiveSeconds, Number(out.ready_seconds)),
        cold_speedup_vs_naive: speedup(naiveSeconds, coldSeconds !== null && coldSeconds > 0 ? coldSeconds : null),
        load_avg: [+load0.toFixed(2), +(loadavg()[0] ?? 0).toFixed(2)],
      });
      process.stderr.write(`run ${JSON.stringify(runs[runs.length - 1])}\n`);
    }
    await daemon.stop();
    daemon = undefined;
    await server.stop(2000);
    await naive.stop(2000);
    const result = {
      image: content.image,
      transport: values.tls ? 'mutual TLS between the endpoints (the naive baseline: plain TCP)' : 'plain text',
      receiver: `seconds/goodput/speedups: long-lived receiver after ${values.warmups} warm-up fetch(es) of a different snapshot (as an agent); cold_*: fresh receiver process per fetch`,
      chunk_size: s1.manifest.chunkSize,
      runs,
      diff,
    };
    const json = JSON.stringify(result, null, 2);
    if (values.json) writeFileSync(values.json, json + '\n');
    process.stdout.write(json + '\n');
  } finally {
    await undo();
    offInterrupt();
  }
}

main().catch((e: unknown) => {
  process.stderr.write(`${e instanceof Error ? (e.stack ?? e.message) : String(e)}\n`);
  process.exitCode = 1;
});
