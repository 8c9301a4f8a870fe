// Transfer benchmark: two host-agent transfer endpoints in separate network namespaces on
// a tbf-shaped veth/bridge link move a 256 MiB guest's snapshot; compared with a plain TCP
// copy of the whole memory file plus disk over the same link. Then a diff snapshot.
//   npm run bench:transfer -- --json FILE [--rates 1,10] [--warmups 1] [--content guest|synthetic] [--tls]
// --rates: link rates in Gbit/s, numbers >= 0 (0: unshaped, any tbf removed from both ends);
// anything else is refused. Needs root (ip netns, tc). --tls: the endpoints speak mutual TLS,
// as agents with FF_PEER_* do (host-agent/adapters/peer/tls.ts; certificates of a CA made for
// the run); the naive baseline stays a plain TCP stream. Content (`--content`):
// - guest (default): a real booted 256 MiB `tiny` guest whose workload put 64 MiB in its RAM,
//   32 MiB random and 32 MiB of log-like text (transfer-guest.ts), snapshotted by the VMM
//   driver; the diff snapshot is of a child forked from it that wrote 16 MiB.
// - synthetic: transfer-image.ts's 256 MiB sparse memory with ~40 MiB kernel/module pages +
//   32 MiB random + 32 MiB text and a 64 MiB disk layer; no VM runs.
// The diff's `changed_bytes` is measured: the 4 KiB pages of s2's memory image that differ
// from s1's (`written_bytes` is what the child was told to write; its runs may overlap, and a
// guest's kernel changes pages of its own). The diff fetch must fetch at least one chunk and
// no more than s2's chunks that s1 lacks (`chunks_new_in_s2`), or the run fails.
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
// same way: `bytes_on_wire` is what both directions of the link carried while the fetch ran,
// from the root tbf's byte counter of each end on a shaped link (`wire_bytes_counter: "tbf"`:
// GSO packets counted with every segment's headers, as tbf charges the rate; transfer-link.ts)
// and from the veths' tx counters on an unshaped one (rate 0, `"veth"`); `veth_bytes` are the
// veth counters beside them (~4% lower on a shaped link: one set of headers per GSO packet).
// Goodput counts the sender's direction only (`bytes_on_wire_forward`), since tbf shapes each
// direction to the link rate on its own and the receiver's requests and ACKs (`_reverse`) use
// the other one. The naive copy's and the diff's wire bytes are counted the same way.
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
import { changedPageBytes, writeChildImage } from './transfer-image.ts';
import { parseRates, sampleEgress, setLinkRate, wireBytes, type EgressSample, type WireBytes } from './transfer-link.ts';
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
  /** Which counter the bytes_on_wire* fields come from: the root tbf's (shaped link) or the veths' (unshaped, link_gbps 0). */
  wire_bytes_counter: WireBytes['counter'];
  /** Both directions: sender to receiver (forward) plus the receiver's requests and ACKs (reverse). */
  bytes_on_wire: number;
  bytes_on_wire_forward: number;
  bytes_on_wire_reverse: number;
  /** The veths' tx counters over the same fetch, both directions and forward (GSO packets with one set of headers each). */
  veth_bytes: number;
  veth_bytes_forward: number;
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
  cold_veth_bytes: number | null;
  cold_goodput_gbps: number | null;
  cold_cpu_ms: number | null;
  cold_page_faults: number | null;
  /** The naive figures: null with --skip-naive. */
  naive_copy_seconds: number | null;
  naive_bytes_on_wire: number | null;
  naive_veth_bytes: number | null;
  speedup_vs_naive: number | null;
  speedup_ready_vs_naive: number | null;
  cold_speedup_vs_naive: number | null;
  load_avg: [number, number];
}

interface Diff {
  link_gbps: number;
  /** Measured: bytes of the 4 KiB pages of s2's memory image that differ from s1's. */
  changed_bytes: number;
  changed_bytes_counts: string;
  /** What the child was told to write (16 MiB); runs may overlap, and a guest changes pages of its own. */
  written_bytes: number;
  wire_bytes_counter: WireBytes['counter'];
  /** Both directions, from wire_bytes_counter's counter. */
  bytes_on_wire: number;
  bytes_on_wire_forward: number;
  /** The veths' tx counters, both directions. */
  veth_bytes: number;
  chunks_fetched: number;
  chunks_requested: number;
  /** s2's chunks that s1 lacks: chunks_fetched must be 1..this. */
  chunks_new_in_s2: number;
  seconds: number;
}

/** A --warmups value: a whole number >= 0. */
function parseWarmups(s: string): number {
  const n = /^\d+$/.test(s.trim()) ? Number(s) : NaN;
  if (!Number.isSafeInteger(n)) throw new Error(`--warmups: "${s}" is not a whole number >= 0`);
  return n;
}

async function main(): Promise<void> {
  const { values } = parseArgs({ options: { json: { type: 'string' }, rates: { type: 'string', default: '1,10' }, 'fsync-each': { type: 'boolean', default: false }, 'skip-naive': { type: 'boolean', default: false }, 'skip-cold': { type: 'boolean', default: false }, warmups: { type: 'string', default: '1' }, content: { type: 'string', default: 'guest' }, tls: { type: 'boolean', default: false } } });
  if (values.content !== 'guest' && values.content !== 'synthetic') throw new Error(`--content: "${values.content}" is neither guest nor synthetic`);
  // Checked before anything is set up: a rate that is no number used to run unshaped as link_gbps null.
  const rates = parseRates(values.rates ?? '1,10');
  const warmups = parseWarmups(values.warmups ?? '1');
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
    /** writtenBytes: what the child was told to write (its workload, or writeChildImage's runs). */
    let content: { s1: BenchArtifact[]; s2: BenchArtifact[]; writtenBytes: number; image: string };
    if (values.content === 'guest') {
      const g = await snapshotBootedGuest(dir, (line) => process.stderr.write(`${line}\n`));
      content = { s1: g.s1, s2: g.s2, writtenBytes: g.changedBytes, image: `booted guest (transfer-guest.ts): 256 MiB tiny guest, accel ${g.accel}, with 32 MiB random + 32 MiB text in tmpfs; diff: a child that wrote 16 MiB` };
    } else {
      const s1Files = writeSyntheticSource(dir);
      const child = join(dir, 'child.img');
      const written = 16 * 1024 * 1024;
      writeChildImage(s1Files[0]!.path, child, written, 7);
      content = {
        s1: s1Files,
        s2: s1Files.map((a) => (a.kind === ArtifactKind.MEMORY ? { ...a, path: child } : a)),
        writtenBytes: written,
        image: 'synthetic (transfer-image.ts): 256 MiB sparse memory, 40 MiB kernel/module pages + 32 MiB random + 32 MiB text; 64 MiB disk layer with 16 MiB of binaries',
      };
    }
    // What the diff changed, measured: the memory image's 4 KiB pages that differ between s1 and s2.
    const memOf = (arts: readonly BenchArtifact[]): string => {
      const m = arts.filter((a) => a.kind === ArtifactKind.MEMORY);
      if (m.length !== 1) throw new Error(`expected one memory artifact, found ${m.length}`);
      return m[0]!.path;
    };
    const changed = changedPageBytes(memOf(content.s1), memOf(content.s2));
    const { pem, srcRoot, store: A, signing, s1 } = await prepareSource(dir, content.s1);
    const s2 = await ingestSnapshot({ snapshotId: 's2', tenantId: 't', parentSnapshotId: 's1', sourceSandboxId: 'sb1', artifacts: content.s2 }, A);
    await A.manifests.put('s2', signManifest(s2.manifest, signing));
    s2.unpin();
    const w = await prepareWarmup(dir, content.s1, A, signing);
    const s1Digests = manifestDigests(s1.manifest);
    const wDigests = manifestDigests(w.manifest);
    const s2Digests = manifestDigests(s2.manifest);
    /** The chunks a receiver holding s1 lacks for s2: the most the diff fetch may fetch. */
    const s2New = [...s2Digests].filter((d) => !s1Digests.has(d)).length;
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
    /** The egress counters of the sender (h0) and the receiver (h1). */
    const egress = (): [EgressSample, EgressSample] => [sampleEgress(fabric, h0), sampleEgress(fabric, h1)];
    // Today's method: a fresh receiver process for one fetch.
    const coldFetch = async (root: string, snapshotId: string): Promise<{ out: Record<string, unknown>; wire: WireBytes }> => {
      const before = egress();
      const r = await fabric.run(h1, [...NODE, 'fetch', '--root', root, '--host-id', 'h1', '--snapshot', snapshotId, '--ticket', ticketFor(snapshotId), '--sources', `${h0.address}:${port}`, '--trust', pem, '--materialise', ...tlsArgs('h1', h1.address), ...(values['fsync-each'] ? ['--fsync-each'] : [])], 300_000);
      const wire = wireBytes(before, egress());
      const line = r.stdout.trim().split('\n').pop() ?? '';
      if (r.code !== 0 || !line.startsWith('{')) throw new Error(`fetch failed (${r.code}): ${r.stderr.slice(-2000)}`);
      return { out: checked(JSON.parse(line) as Record<string, unknown>, 'cold fetch'), wire };
    };
    // The agent's way: the long-lived receiver. Every fetch gets its own (new) root, so
    // nothing is deduplicated; nothing is deleted before the end (ADR 0008: on this ext4
    // without a journal, files created within minutes of many deletions cost ~1.5 ms each).
    daemon = startDaemon(h1, [...NODE, 'fetch-daemon', '--trust', pem, ...tlsArgs('h1', h1.address), ...(values['fsync-each'] ? ['--fsync-each'] : [])], join(dir, 'daemon.log'));
    const d = daemon;
    const warmFetch = async (root: string, snapshotId: string): Promise<{ out: Record<string, unknown>; wire: WireBytes }> => {
      const before = egress();
      const out = await d.ask({ root, hostId: 'h1', snapshot: snapshotId, ticket: ticketFor(snapshotId), sources: `${h0.address}:${port}`, materialise: true });
      return { out: checked(out, `fetch ${snapshotId}`), wire: wireBytes(before, egress()) };
    };
    for (let i = 0; i < warmups; i++) {
      const warmup = await warmFetch(join(dir, `dst-warmup-${i}`), 'w');
      process.stderr.write(`warm-up ${JSON.stringify({ seconds: warmup.out.seconds, cpu_ms: warmup.out.cpu_ms, page_faults: warmup.out.page_faults, fetched: (warmup.out.report as { fetched: number }).fetched })}\n`);
    }

    const logical = Number(s1.stats.logicalBytes);
    const nonzero = s1.manifest.artifacts.reduce((s, a) => s + a.chunks.reduce((t, c) => t + c.size, 0), 0);
    const runs: Run[] = [];
    let diff: Diff | undefined;
    for (const [i, g] of rates.entries()) {
      // 0: unshaped, also when an earlier rate of this run shaped the link (its tbf is removed).
      setLinkRate(fabric, [h0, h1], g);
      const load0 = loadavg()[0] ?? 0;
      // Directories by position in --rates: a rate given twice gets a new store each time.
      const dst = join(dir, `dst-${i}-${g}`);
      const { out, wire: ww } = await warmFetch(dst, 's1');
      const seconds = Number(out.seconds);
      const rep = out.report as { fetched: number; requested: number };
      if (rep.fetched !== s1Digests.size || rep.requested !== s1Digests.size) throw new Error(`warm fetch fetched ${rep.fetched} of ${s1Digests.size} chunks (${rep.requested} requested): deduplicated`);
      process.stderr.write(`fetch ${JSON.stringify({ report: out.report, phases: out.phases, cpu_ms: out.cpu_ms, page_faults: out.page_faults })}\n`);
      if (diff === undefined) {
        // Diff, on the first rate's link (whatever --rates holds): the receiver has s1; the child wrote 16 MiB.
        const dd = await warmFetch(dst, 's2');
        const drep = dd.out.report as { fetched: number; requested: number };
        // Checked like the s1 fetch: it moved something, and nothing the receiver already held.
        if (!(drep.fetched > 0 && drep.fetched <= s2New)) throw new Error(`diff fetch fetched ${drep.fetched} chunks (${drep.requested} requested); expected 1..${s2New}, the chunks of s2 that s1 lacks`);
        diff = {
          link_gbps: g,
          changed_bytes: changed,
          changed_bytes_counts: "4 KiB pages of s2's memory image that differ from s1's (measured; disk layer and device state not counted)",
          written_bytes: content.writtenBytes,
          wire_bytes_counter: dd.wire.counter,
          bytes_on_wire: dd.wire.forward + dd.wire.reverse,
          bytes_on_wire_forward: dd.wire.forward,
          veth_bytes: dd.wire.vethForward + dd.wire.vethReverse,
          chunks_fetched: drep.fetched,
          chunks_requested: drep.requested,
          chunks_new_in_s2: s2New,
          seconds: +Number(dd.out.seconds).toFixed(3),
        };
        process.stderr.write(`diff ${JSON.stringify(diff)}\n`);
      }
      // The same transfer into a fresh process (and a fresh root).
      const coldRoot = join(dir, `dst-cold-${i}-${g}`);
      // --skip-cold: the cold_* fields are null (not run), never 0 (which would read as instant).
      const cold = values['skip-cold'] ? undefined : await coldFetch(coldRoot, 's1');
      const coldSeconds = cold ? Number(cold.out.seconds) : null;
      // Baseline: plain TCP stream of the whole memory file plus the disk; every byte of them, or the run fails.
      const nb = egress();
      const naiveOut = values['skip-naive'] ? undefined : naiveCopied(await fabric.run(h1, [...NODE, 'naive-recv', '--connect', `${h0.address}:${port + 1}`, '--out', join(dir, `naive-${i}.bin`)], 300_000), naiveBytes);
      const nw = wireBytes(nb, egress());
      const naiveSeconds = naiveOut ? naiveOut.seconds : null;
      rmSync(join(dir, `naive-${i}.bin`), { force: true });
      runs.push({
        link_gbps: g,
        logical_bytes: logical,
        nonzero_bytes: nonzero,
        wire_bytes_counter: ww.counter,
        bytes_on_wire: ww.forward + ww.reverse,
        bytes_on_wire_forward: ww.forward,
        bytes_on_wire_reverse: ww.reverse,
        veth_bytes: ww.vethForward + ww.vethReverse,
        veth_bytes_forward: ww.vethForward,
        seconds: +seconds.toFixed(3),
        goodput_gbps: +((ww.forward * 8) / seconds / 1e9).toFixed(3),
        ready_seconds: +Number(out.ready_seconds).toFixed(3),
        materialise_ms: Math.round((Number(out.ready_seconds) - seconds) * 1000),
        durable_seconds: +Number(out.durable_seconds).toFixed(3),
        chunks_fetched: rep.fetched,
        chunks_total: s1Digests.size,
        cpu_ms: Number(out.cpu_ms),
        page_faults: Number(out.page_faults),
        cold_seconds: coldSeconds === null ? null : +coldSeconds.toFixed(3),
        cold_bytes_on_wire: cold ? cold.wire.forward + cold.wire.reverse : null,
        cold_veth_bytes: cold ? cold.wire.vethForward + cold.wire.vethReverse : null,
        cold_goodput_gbps: cold && coldSeconds! > 0 ? +((cold.wire.forward * 8) / coldSeconds! / 1e9).toFixed(3) : null,
        cold_cpu_ms: cold ? Number(cold.out.cpu_ms) : null,
        cold_page_faults: cold ? Number(cold.out.page_faults) : null,
        naive_copy_seconds: naiveSeconds === null ? null : +naiveSeconds.toFixed(3),
        naive_bytes_on_wire: naiveOut ? nw.forward + nw.reverse : null,
        naive_veth_bytes: naiveOut ? nw.vethForward + nw.vethReverse : null,
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
      receiver: `seconds/goodput/speedups: long-lived receiver after ${warmups} warm-up fetch(es) of a different snapshot (as an agent); cold_*: fresh receiver process per fetch`,
      wire_bytes: "bytes_on_wire*: the root tbf's byte counter of each end on a shaped link (wire_bytes_counter \"tbf\": GSO packets with every segment's headers, as tbf charges the rate), the veths' tx counters on an unshaped one (\"veth\"); veth_bytes*: the veth counters over the same span. Goodput counts bytes_on_wire_forward.",
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
