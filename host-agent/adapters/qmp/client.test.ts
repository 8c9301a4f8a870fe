// QMP connect against a monitor socket that closes before its greeting: a QEMU that made its
// -qmp socket and then failed to start (a drive, a memory backend, the kernel) and exited.
// No QEMU runs: a unix socket server stands in for the one that closes.
import { afterAll, describe, expect, it } from 'vitest';
import { mkdtempSync, rmSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { ChannelClosedError } from '../../errors.ts';
import { QmpClient } from './client.ts';

const base = mkdtempSync(join(tmpdir(), 'ff-qmp-'));
afterAll(() => rmSync(base, { recursive: true, force: true }));

/** A unix socket server that closes every connection at once, without a greeting. */
async function closingServer(name: string): Promise<{ path: string; server: net.Server }> {
  const path = join(base, name);
  const server = net.createServer((s) => s.destroy());
  await new Promise<void>((resolve) => server.listen(path, resolve));
  return { path, server };
}

describe('QmpClient.connect', () => {
  it('connect_whenTheMonitorClosesBeforeItsGreeting_rejectsWithChannelClosedAtOnce', async () => {
    const { path, server } = await closingServer('qmp.sock');
    const t0 = Date.now();
    try {
      await expect(QmpClient.connect(path, 5000)).rejects.toBeInstanceOf(ChannelClosedError);
      expect(Date.now() - t0).toBeLessThan(1000);
    } finally {
      server.close();
    }
  });

  it('connectWithRetry_whenTheMonitorClosesBeforeItsGreetingAndQemuExits_rejectsWithChannelClosedAtOnce', async () => {
    // QEMU still alive for the first tries (it closes its monitor before it exits), then gone.
    const { path, server } = await closingServer('qmp-retry.sock');
    const t0 = Date.now();
    let tries = 0;
    try {
      const err = await QmpClient.connectWithRetry(path, 5000, () => ++tries <= 3).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(ChannelClosedError);
      expect((err as Error).cause).toBeInstanceOf(ChannelClosedError);
      expect(Date.now() - t0).toBeLessThan(1000);
    } finally {
      server.close();
    }
  });
});
