import { describe, expect, it } from 'vitest';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { tmpdir } from 'node:os';
import { connect, createServer } from 'node:net';
import type { AddressInfo } from 'node:net';
import { startNaive } from './baselines.ts';
import type { LocalBaseline } from './baselines.ts';

/** Only what startNaive reads of a baseline: the classic save file and the snapshot's disk. */
function fakeBaseline(dir: string): LocalBaseline {
  writeFileSync(join(dir, 'full.bin'), 'ram');
  writeFileSync(join(dir, 'disk.qcow2'), 'disk');
  return { classicFile: join(dir, 'full.bin'), snap: { dir }, dir } as unknown as LocalBaseline;
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
});
