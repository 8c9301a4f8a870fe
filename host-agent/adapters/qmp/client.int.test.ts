// QmpClient against a real QEMU (no guest: -machine none): event marks stay right after the
// client has dropped old events from its history.
import { rm } from 'node:fs/promises';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { killAndWait, spawnQemu, type QemuProcess } from '../qemu/process.ts';
import { QmpClient } from './client.ts';
import { tempDir } from '../../../services/testkit/proc.ts';

describe('QmpClient events (real QEMU)', () => {
  let proc: QemuProcess | undefined;
  let qmp: QmpClient | undefined;
  let dir = '';
  afterEach(async () => {
    qmp?.close();
    if (proc) await killAndWait(proc);
    if (dir) await rm(dir, { recursive: true, force: true });
  });

  it('waitEvent_afterMoreEventsThanTheClientKeeps_findsTheEventThatCameAfterTheMark', async () => {
    dir = tempDir('ff-qmp-');
    const sock = join(dir, 'qmp.sock');
    proc = spawnQemu('qemu-system-x86_64', ['-machine', 'none', '-nodefaults', '-display', 'none', '-S', '-qmp', `unix:${sock},server=on,wait=off`], join(dir, 'qemu.log'));
    qmp = await QmpClient.connectWithRetry(sock, 10_000, () => true);
    // 600 STOP/RESUME events: more than the client keeps, as a long-lived sandbox that was
    // paused and resumed many times has seen.
    for (let i = 0; i < 300; i++) {
      await qmp.execute('cont');
      await qmp.execute('stop');
    }
    await qmp.waitEvent('STOP', 5000, () => true, qmp.mark - 1);
    const mark = qmp.mark;
    await qmp.execute('cont');
    // The RESUME has arrived by the time `cont` returns or soon after; either way the wait finds it.
    const ev = await qmp.waitEvent('RESUME', 2000, () => true, mark);
    expect(ev.event).toBe('RESUME');
    expect(qmp.eventsSince(mark).map((e) => e.event)).toEqual(['RESUME']);
    expect(qmp.eventsSince(qmp.mark)).toEqual([]);
  });
});
