// migrateToFile against a stand-in for QEMU's side of the QMP protocol (our QmpClient's
// surface): 'migrate' connects to the unix socket and streams bytes, then a MIGRATION event
// says how it ended. What a failed write of the saved state does to the agent process.
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { connect } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { migrateToFile } from './driver.ts';
import type { QmpClient, QmpEvent } from '../qmp/client.ts';

const dir = mkdtempSync(join(tmpdir(), 'ff-migfile-'));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** Streams `bytes` to the migration socket; MIGRATION 'completed' once written, 'failed' if the socket broke. */
function fakeQemu(bytes: Buffer): QmpClient {
  const events: QmpEvent[] = [];
  const waiters: Array<() => void> = [];
  const emit = (status: string): void => {
    events.push({ event: 'MIGRATION', data: { status }, timestampMs: Date.now() });
    for (const w of waiters.splice(0)) w();
  };
  const qmp = {
    mark: 0,
    async execute(cmd: string, args?: { uri?: string }): Promise<unknown> {
      if (cmd === 'migrate') {
        const sock = connect(args!.uri!.slice('unix:'.length), () => sock.end(bytes, () => emit('completed')));
        sock.on('error', () => emit('failed'));
      }
      return {};
    },
    waitEvent(name: string, _timeoutMs: number, match: (e: QmpEvent) => boolean): Promise<QmpEvent> {
      return new Promise((resolve) => {
        const look = (): void => {
          const e = events.find((x) => x.event === name && match(x));
          if (e) resolve(e);
          else waiters.push(look);
        };
        look();
      });
    },
  };
  return qmp as unknown as QmpClient;
}

describe('migrateToFile', () => {
  it('savesTheStreamToTheFile', async () => {
    const data = Buffer.alloc(1 << 20, 7);
    await migrateToFile(fakeQemu(data), join(dir, 'state.bin'), join(dir, 'ok.sock'));
    expect(readFileSync(join(dir, 'state.bin')).equals(data)).toBe(true);
  });

  it('whoseFileCannotBeWritten_rejectsWithTheWriteError_andLeavesNoUnhandledRejection', async () => {
    const unhandled: unknown[] = [];
    const onUnhandled = (e: unknown): void => void unhandled.push(e);
    process.on('unhandledRejection', onUnhandled);
    try {
      // A directory that does not exist: the write stream fails as soon as QEMU connects.
      const saving = migrateToFile(fakeQemu(Buffer.alloc(4 << 20, 1)), join(dir, 'missing', 'state.bin'), join(dir, 'bad.sock'));
      await expect(saving).rejects.toThrow(/ENOENT/);
      await new Promise((r) => setTimeout(r, 50));
      expect(unhandled).toEqual([]);
    } finally {
      process.off('unhandledRejection', onUnhandled);
    }
  });
});
