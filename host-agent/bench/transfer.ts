// Transfer benchmark: two host-agent transfer endpoints in separate network namespaces on
// a tbf-shaped veth/bridge link move a 256 MiB guest's snapshot; compared with a plain TCP
// copy of the whole memory file plus disk over the same link. Then a diff snapshot.
//   npm run bench:transfer -- --json FILE [--rates 1,10]
// Needs root (ip netns, tc). Content is synthetic (see transfer-image.ts): 256 MiB sparse
// memory with ~40 MiB kernel/module pages + 32 MiB random + 32 MiB text; a 64 MiB disk layer.
import { parseArgs } from 'node:util';
import { writeFileSync, rmSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { ingestSnapshot } from '../adapters/chunkstore/ingest.ts';
import { encodeSignedTicket, signManifest, signTicket } from '../domain/tickets.ts';
import { ArtifactKind } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { createFabric, readLog, type Fabric, type NsHost } from '../adapters/peer/netns-testkit.ts';
import { tempDir, waitFor } from '../../services/testkit/proc.ts';
import { writeChildImage } from './transfer-image.ts';
import { prepareSource } from './transfer-source.ts';

const here = fileURLToPath(new URL('.', import.meta.url));
const ENDPOINT = resolve(here, '../adapters/peer/endpoint-main.ts');
const NODE = [process.execPath, ...(process.env.BENCH_NODE_ARGS ?? '').split(' ').filter(Boolean), '--import', 'tsx', ENDPOINT];

interface Run {
  link_gbps: number;
  logical_bytes: number;
  nonzero_bytes: number;
  bytes_on_wire: number;
  /** Until every chunk is stored and synced (manifest stored). */
  seconds: number;
  goodput_gbps: number;
  /** Until the materialised image is complete too (it is written while chunks arrive). */
  ready_seconds: number;
  /** ready_seconds - seconds: the materialise work left after the last chunk. */
  materialise_ms: number;
  /** Until the chunks are fsynced and the manifest stored (off the fork's critical path). */
  durable_seconds: number;
  naive_copy_seconds: number;
  naive_bytes_on_wire: number;
  speedup_vs_naive: number;
  speedup_ready_vs_naive: number;
}

function wire(f: Fabric, hosts: readonly NsHost[]): number {
  return hosts.reduce((s, h) => s + f.counters(h).tx, 0);
}

async function main(): Promise<void> {
  const { values } = parseArgs({ options: { json: { type: 'string' }, rates: { type: 'string', default: '1,10' }, 'fsync-each': { type: 'boolean', default: false }, 'skip-naive': { type: 'boolean', default: false } } });
  const dir = tempDir('ff-bench-transfer-');
  const fabric = createFabric(2, 'ff-b');
  try {
    const [h0, h1] = fabric.hosts as [NsHost, NsHost];
    const { mem, disk, pem, srcRoot, store: A, signing, s1 } = await prepareSource(dir);
    const child = join(dir, 'child.img');
    const changed = writeChildImage(mem, child, 16 * 1024 * 1024, 7);
    const s2 = await ingestSnapshot(
      { snapshotId: 's2', tenantId: 't', parentSnapshotId: 's1', sourceSandboxId: 'sb1', artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', path: child }, { kind: ArtifactKind.DISK_LAYER, name: 'disk/0', path: disk }] },
      A,
    );
    await A.manifests.put('s2', signManifest(s2.manifest, signing));
    process.stderr.write(`ingest s1 ${JSON.stringify(s1.stats)}\ningest s2 ${JSON.stringify(s2.stats)}\n`);

    const port = 7443;
    const srvLog = join(dir, 'server.log');
    const server = fabric.spawn(h0, 'chunk-server', [...NODE, 'serve', '--root', srcRoot, '--listen', `${h0.address}:${port}`, '--trust', pem], srvLog);
    await waitFor('chunk server', async () => readLog(srvLog).includes('"listening"'), 20_000, 50);
    const naiveLog = join(dir, 'naive.log');
    const naive = fabric.spawn(h0, 'naive-server', [...NODE, 'naive-serve', '--listen', `${h0.address}:${port + 1}`, '--files', `${mem},${disk}`], naiveLog);
    await waitFor('naive server', async () => readLog(naiveLog).includes('"listening"'), 20_000, 50);

    const ticketFor = (snapshotId: string): string =>
      Buffer.from(encodeSignedTicket(signTicket({ snapshotId, destinationHostId: 'h1', expiresAt: new Date(Date.now() + 600_000) }, signing))).toString('base64');
    const fetch = async (root: string, snapshotId: string): Promise<{ out: Record<string, unknown>; wire: number }> => {
      const before = wire(fabric, [h0, h1]);
      const r = await fabric.run(h1, [...NODE, 'fetch', '--root', root, '--host-id', 'h1', '--snapshot', snapshotId, '--ticket', ticketFor(snapshotId), '--sources', `${h0.address}:${port}`, '--trust', pem, '--materialise', ...(values['fsync-each'] ? ['--fsync-each'] : [])], 300_000);
      const after = wire(fabric, [h0, h1]);
      const line = r.stdout.trim().split('\n').pop() ?? '';
      if (r.code !== 0 || !line.startsWith('{')) throw new Error(`fetch failed (${r.code}): ${r.stderr.slice(-2000)}`);
      const out = JSON.parse(line) as Record<string, unknown>;
      if (out.ok !== true) throw new Error(`fetch failed: ${line}`);
      return { out, wire: after - before };
    };

    const logical = Number(s1.stats.logicalBytes);
    const nonzero = s1.manifest.artifacts.reduce((s, a) => s + a.chunks.reduce((t, c) => t + c.size, 0), 0);
    const runs: Run[] = [];
    let diff: { changed_bytes: number; bytes_on_wire: number; chunks_fetched: number; seconds: number } | undefined;
    for (const g of (values.rates ?? '1,10').split(',').map(Number)) {
      const rate = `${g}gbit`;
      const burst = g >= 10 ? '4mb' : '256kb';
      if (g > 0) {
        fabric.shape(h0, rate, burst);
        fabric.shape(h1, rate, burst);
      }
      const dst = join(dir, `dst-${g}`);
      const { out, wire: w } = await fetch(dst, 's1');
      const seconds = Number(out.seconds);
      process.stderr.write(`fetch ${JSON.stringify(out.report)}\n`);
      // Baseline: plain TCP stream of the whole memory file plus the disk.
      const nb = wire(fabric, [h0, h1]);
      const nr = values['skip-naive'] ? { stdout: '{"seconds":0}' } : await fabric.run(h1, [...NODE, 'naive-recv', '--connect', `${h0.address}:${port + 1}`, '--out', join(dir, `naive-${g}.bin`)], 300_000);
      const nw = wire(fabric, [h0, h1]) - nb;
      const naiveOut = JSON.parse(nr.stdout.trim().split('\n').pop() ?? '{}') as { seconds: number };
      rmSync(join(dir, `naive-${g}.bin`), { force: true });
      runs.push({
        link_gbps: g,
        logical_bytes: logical,
        nonzero_bytes: nonzero,
        bytes_on_wire: w,
        seconds: +seconds.toFixed(3),
        goodput_gbps: +((w * 8) / seconds / 1e9).toFixed(3),
        ready_seconds: +Number(out.ready_seconds).toFixed(3),
        materialise_ms: Math.round((Number(out.ready_seconds) - seconds) * 1000),
        durable_seconds: +Number(out.durable_seconds).toFixed(3),
        naive_copy_seconds: +naiveOut.seconds.toFixed(3),
        naive_bytes_on_wire: nw,
        speedup_vs_naive: +(naiveOut.seconds / seconds).toFixed(2),
        speedup_ready_vs_naive: +(naiveOut.seconds / Number(out.ready_seconds)).toFixed(2),
      });
      process.stderr.write(`run ${JSON.stringify(runs[runs.length - 1])}\n`);
      if (g === 1) {
        // Diff: the receiver has s1; the child changed 16 MiB.
        const d = await fetch(dst, 's2');
        const rep = d.out.report as { fetched: number };
        diff = { changed_bytes: changed, bytes_on_wire: d.wire, chunks_fetched: rep.fetched, seconds: +Number(d.out.seconds).toFixed(3) };
        process.stderr.write(`diff ${JSON.stringify(diff)}\n`);
      }
      rmSync(dst, { recursive: true, force: true });
    }
    await server.stop(2000);
    await naive.stop(2000);
    const result = { image: 'synthetic (transfer-image.ts): 256 MiB sparse memory, 40 MiB kernel/module pages + 32 MiB random + 32 MiB text; 64 MiB disk layer with 16 MiB of binaries', chunk_size: s1.manifest.chunkSize, runs, diff };
    const json = JSON.stringify(result, null, 2);
    if (values.json) writeFileSync(values.json, json + '\n');
    process.stdout.write(json + '\n');
  } finally {
    await fabric.destroy();
    rmSync(dir, { recursive: true, force: true });
  }
}

main().catch((e: unknown) => {
  process.stderr.write(`${e instanceof Error ? (e.stack ?? e.message) : String(e)}\n`);
  process.exitCode = 1;
});
