import { afterAll, describe, expect, it } from 'vitest';
import { chmodSync, existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { tmpdir } from 'node:os';
import { connect, createServer } from 'node:net';
import type { AddressInfo } from 'node:net';
import { OverlayFactory } from '../host-agent/adapters/qemu/process.ts';
import { naiveDir, startNaive } from './baselines.ts';
import type { LocalBaseline } from './baselines.ts';

// qemu-img is, on PATH, a script that notes each call and writes the overlay it was asked for
// (its second-to-last argument): OverlayFactory's real code runs, no qemu-img does.
const bin = mkdtempSync(join(tmpdir(), 'lt-qemu-img-'));
const qemuImgCalls = join(bin, 'calls');
writeFileSync(join(bin, 'qemu-img'), `#!/bin/sh\necho "$*" >> ${qemuImgCalls}\nfor a; do overlay=$last; last=$a; done\nprintf 'QFI-overlay' > "$overlay"\n`);
chmodSync(join(bin, 'qemu-img'), 0o755);
process.env.PATH = `${bin}:${process.env.PATH ?? ''}`;
afterAll(() => rmSync(bin, { recursive: true, force: true }));
const calls = (): string[] => (existsSync(qemuImgCalls) ? readFileSync(qemuImgCalls, 'utf8').trim().split('\n') : []);

/** Only what startNaive reads of a baseline: the classic save file, the snapshot's disk and the overlay factory. */
function fakeBaseline(dir: string): LocalBaseline {
  writeFileSync(join(dir, 'full.bin'), 'ram');
  writeFileSync(join(dir, 'disk.qcow2'), 'disk');
  return { classicFile: join(dir, 'full.bin'), snap: { dir, manifest: { diskVirtualSize: 1 << 30 } }, dir, overlays: new OverlayFactory() } as unknown as LocalBaseline;
}

async function freePort(): Promise<number> {
  const srv = createServer();
  await new Promise<void>((r) => srv.listen(0, '127.0.0.1', () => r()));
  const { port } = srv.address() as AddressInfo;
  await new Promise((r) => srv.close(r));
  return port;
}

/** Whether something accepts a TCP connection on the port. */
function answers(port: number): Promise<boolean> {
  return new Promise((r) => {
    const sock = connect(port, '127.0.0.1');
    sock.once('connect', () => (sock.destroy(), r(true)));
    sock.once('error', () => r(false));
  });
}

describe('naive copy sender', () => {
  it('startNaive_registersTheSendersStopAtItsSpawn_soATeardownBeforeItListensStopsIt', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'lt-naive-'));
    const stops: Array<() => Promise<void>> = [];
    try {
      const starting = startNaive(fakeBaseline(dir), { fromAddress: '127.0.0.1', port: 0 }, (s) => stops.push(s));
      // Before its first await: a Ctrl-C from here on finds the sender in the clean-up list.
      expect(stops).toHaveLength(1);
      await stops[0]!();
      // Stopped before it printed "listening": the start fails, and does not wait for an exit that came already.
      await expect(starting).rejects.toThrow(/exited without output/);
    } finally {
      for (const stop of stops) await stop();
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it('startNaive_thatStarted_isStoppedByTheRegisteredStop', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'lt-naive-'));
    const port = await freePort();
    const stops: Array<() => Promise<void>> = [];
    try {
      const naive = await startNaive(fakeBaseline(dir), { fromAddress: '127.0.0.1', port }, (s) => stops.push(s));
      expect(stops).toHaveLength(1);
      expect(await answers(port)).toBe(true);
      await stops[0]!();
      expect(await answers(port)).toBe(false);
      await naive.close();
    } finally {
      for (const stop of stops) await stop();
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it('startNaive_samples_receiveIntoOneDirectory_soTheRestoreOverlayIsMadeOnceBeforeTheFirstSample', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'lt-naive-'));
    const port = await freePort();
    const stops: Array<() => Promise<void>> = [];
    rmSync(qemuImgCalls, { force: true });
    try {
      const b = fakeBaseline(dir);
      const restored: Array<{ file: string; backing: string; qemuImgCalls: number }> = [];
      let r = 0;
      // What classicRestore does with the copy before QEMU: an overlay on the copied disk (OverlayFactory).
      const restore = async (base: LocalBaseline, file: string, backing: string): Promise<number> => {
        await base.overlays.create(backing, join(dir, `restore-${r++}.qcow2`), base.snap.manifest.diskVirtualSize);
        restored.push({ file: readFileSync(file, 'utf8'), backing, qemuImgCalls: calls().length });
        return 1;
      };
      const naive = await startNaive(b, { fromAddress: '127.0.0.1', port }, (s) => stops.push(s), restore);
      // Primed before any sample, untimed, for the path every sample's copy lands at.
      expect(calls()).toHaveLength(1);
      expect(calls()[0]).toContain(`-b ${join(naiveDir(b), 'disk.qcow2')} `);
      for (let i = 0; i < 3; i++) {
        const s = await naive.once();
        expect(s.bytes).toBeGreaterThan(0);
      }
      expect(restored.map((x) => x.backing)).toEqual(Array(3).fill(join(naiveDir(b), 'disk.qcow2')));
      expect(restored.map((x) => x.file)).toEqual(['ram', 'ram', 'ram']);
      // No qemu-img inside any sample.
      expect(restored.map((x) => x.qemuImgCalls)).toEqual([1, 1, 1]);
      expect(existsSync(naiveDir(b))).toBe(false);
      await naive.close();
    } finally {
      for (const stop of stops) await stop();
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
