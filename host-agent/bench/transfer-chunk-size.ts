// Measures chunk size and codec choices on a guest's memory image and a child's (ADR 0007).
// Usage: node --import tsx host-agent/bench/transfer-chunk-size.ts [--content synthetic|guest]
//   synthetic (default): transfer-image.ts's image and child;
//   guest: a real booted guest's snapshot and its child's (transfer-guest.ts, as bench:transfer).
// Ctrl-C or a kill: the guest's QEMUs and the run's directory are removed before it exits.
import { createHash } from 'node:crypto';
import { mkdtempSync, readFileSync, rmSync, openSync, writeSync, fsyncSync, closeSync, renameSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { compressSync as lz4c, uncompressSync as lz4d } from 'lz4-napi';
import { compress as zc, decompress as zd } from 'zstd-napi';
import { parseArgs } from 'node:util';
import { writeMemoryImage, writeChildImage } from './transfer-image.ts';
import { closeBootedGuests, snapshotBootedGuest } from './transfer-guest.ts';
import { undoOnInterrupt } from '../../loadtest/interrupt.ts';
import { ArtifactKind } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';

async function main(): Promise<void> {
  const { values } = parseArgs({ options: { content: { type: 'string', default: 'synthetic' } } });
  const dir = mkdtempSync(join(tmpdir(), 'ff-chunk-'));
  /** Undoes the run, once: at its end, or first on Ctrl-C or a kill. */
  const { undo, off: offInterrupt } = undoOnInterrupt(async () => {
    await closeBootedGuests().catch(() => undefined);
    rmSync(dir, { recursive: true, force: true });
  }, (line) => process.stderr.write(`transfer-chunk-size: ${line}\n`));
  try {
    let mem = join(dir, 'mem.img');
    let child = join(dir, 'child.img');
    if (values.content === 'guest') {
      const g = await snapshotBootedGuest(dir, (line) => process.stderr.write(`${line}\n`));
      const memOf = (as: typeof g.s1): string => as.find((x) => x.kind === ArtifactKind.MEMORY)!.path;
      mem = memOf(g.s1);
      child = memOf(g.s2);
    } else if (values.content === 'synthetic') {
      writeMemoryImage(mem);
      writeChildImage(mem, child, 16 * 1024 * 1024, 99);
    } else throw new Error(`--content: "${values.content}" is neither guest nor synthetic`);
    const a = readFileSync(mem);
    const b = readFileSync(child);
    const results: Record<string, unknown>[] = [];
    for (const cs of [64 * 1024, 128 * 1024, 256 * 1024, 1024 * 1024]) {
      // The measurements below are synchronous: between them a Ctrl-C gets its turn.
      await new Promise((r) => setImmediate(r));
      const zero = Buffer.alloc(cs);
      const nz: Buffer[] = [];
      let t = performance.now();
      for (let o = 0; o < a.length; o += cs) {
        const c = a.subarray(o, o + cs);
        if (!c.equals(zero)) nz.push(c);
      }
      const zeroScanMs = performance.now() - t;
      t = performance.now();
      for (const c of nz) createHash('sha256').update(c).digest();
      const shaMs = performance.now() - t;
      const row: Record<string, unknown> = { chunk_kib: cs / 1024, nonzero_chunks: nz.length, nonzero_mib: (nz.length * cs) / 2 ** 20, zero_scan_ms: Math.round(zeroScanMs), sha256_ms: Math.round(shaMs) };
      for (const [name, comp, dec] of [
        ['lz4', (x: Buffer) => lz4c(x), (x: Buffer) => lz4d(x)],
        ['zstd1', (x: Buffer) => zc(x, { compressionLevel: 1 }), (x: Buffer) => zd(x)],
        ['zstd3', (x: Buffer) => zc(x, { compressionLevel: 3 }), (x: Buffer) => zd(x)],
      ] as const) {
        t = performance.now();
        const out = nz.map((c) => comp(c));
        const cms = performance.now() - t;
        t = performance.now();
        for (const o of out) dec(o);
        const dms = performance.now() - t;
        let stored = 0;
        for (let i = 0; i < out.length; i++) stored += Math.min(out[i]!.length, nz[i]!.length);
        row[`${name}_stored_mib`] = +(stored / 2 ** 20).toFixed(1);
        row[`${name}_compress_ms`] = Math.round(cms);
        row[`${name}_decompress_ms`] = Math.round(dms);
      }
      // Diff: chunks of the child not in the parent (by digest), and their lz4 stored size.
      const parentSet = new Set<string>();
      for (let o = 0; o < a.length; o += cs) parentSet.add(createHash('sha256').update(a.subarray(o, o + cs)).digest('hex'));
      let diffChunks = 0;
      let diffStored = 0;
      for (let o = 0; o < b.length; o += cs) {
        const c = b.subarray(o, o + cs);
        if (c.equals(zero)) continue;
        if (!parentSet.has(createHash('sha256').update(c).digest('hex'))) {
          diffChunks++;
          diffStored += Math.min(lz4c(c).length, c.length);
        }
      }
      row.diff_chunks = diffChunks;
      row.diff_raw_mib = +((diffChunks * cs) / 2 ** 20).toFixed(1);
      row.diff_lz4_mib = +(diffStored / 2 ** 20).toFixed(1);
      // Durable write cost per chunk: temp + fsync + rename, 64 chunks.
      const sample = nz.slice(0, 64);
      t = performance.now();
      sample.forEach((c, i) => {
        const p = join(dir, `t${i}`);
        const fd = openSync(p + '.tmp', 'w');
        writeSync(fd, c);
        fsyncSync(fd);
        closeSync(fd);
        renameSync(p + '.tmp', p);
      });
      row.fsync_write_ms_per_chunk = +((performance.now() - t) / sample.length).toFixed(2);
      results.push(row);
    }
    console.log(JSON.stringify(results, null, 1));
  } finally {
    await undo();
    offInterrupt();
  }
}
main().catch((e: unknown) => {
  process.stderr.write(`${e instanceof Error ? (e.stack ?? e.message) : String(e)}\n`);
  process.exitCode = 1;
});
