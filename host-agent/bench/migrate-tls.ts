// Benchmark: what TLS costs a restore by migration (ADR 0015) on this machine, and which TLS:
// QEMU's own channel or the agents' TLS relays (FF_PEER_MIGRATION_TLS).
//
//   npm run bench:migrate-tls -- [--reps 5] [--json FILE]
//
// Boots one 256 MiB `tiny` guest (accel from FF_ACCEL, default auto) with 64 MiB of data in
// RAM (32 MiB random, 32 MiB text), snapshots it, then restores it by migration between two
// driver pairs on loopback (the agents' own code: migrateOut, prepareIncoming, load),
// alternating in every round:
//   plain   QEMU to QEMU, no TLS (FF_PEER_MIGRATION_TLS=off)
//   tls     QEMU to QEMU over QEMU's mutual TLS with certificates of one CA (=qemu)
//   relay   QEMU to a unix socket, socat relays over mutual TLS, unix socket to QEMU (=relay;
//           skipped when socat is not installed)
// Prints per mode the medians of the source's stream time (`migrate` to completed) and of
// call to ready (stream loaded, VM resumed, clone hygiene done), and their ratios to plain.
import { rmSync, writeFileSync } from 'node:fs';
import { copyFile, mkdtemp } from 'node:fs/promises';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { pino } from 'pino';
import { ensureImage } from '../../deploy/images/build.ts';
import { devPeerTls } from '../../deploy/pki/pki.ts';
import { QemuVmmDriver } from '../adapters/qemu/driver.ts';
import { writeQemuTlsDir } from '../adapters/peer/tls.ts';
import { findSocat, listenRelay } from '../adapters/peer/tls-relay.ts';
import { migrateOutThroughRelay } from '../adapters/peer/migrate.ts';
import type { AccelSetting } from '../domain/vmm.ts';

const arg = (name: string, dflt: string): string => {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 && process.argv[i + 1] !== undefined ? process.argv[i + 1]! : dflt;
};
const REPS = Number(arg('reps', '5'));
const accel = (process.env.FF_ACCEL ?? 'auto') as AccelSetting;
const logger = pino({ level: 'warn' });
const root = await mkdtemp(join(tmpdir(), 'ff-migrate-tls-'));
const NO_STANDBY = { perSnapshot: 0 };
const drivers: QemuVmmDriver[] = [];
const newDriver = (name: string, tlsDir?: string, viaUnix = false): QemuVmmDriver => {
  const d = new QemuVmmDriver({ root: join(root, name), accel, logger, standby: NO_STANDBY, ...(tlsDir ? { migrationTlsDir: tlsDir } : {}), ...(viaUnix ? { migrationViaUnix: true } : {}) });
  drivers.push(d);
  return d;
};

const median = (xs: number[]): number => {
  const s = [...xs].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2]! : (s[s.length / 2 - 1]! + s[s.length / 2]!) / 2;
};

try {
  const image = await ensureImage('tiny');
  const tpl = newDriver('tpl');
  await tpl.create({ vmId: 'tpl', image, memoryMib: 256, vcpus: 1, hostname: 'tpl' });
  const sh = async (script: string): Promise<void> => {
    const r = await tpl.exec('tpl', { path: '/bin/sh', args: ['-c', script], timeoutMs: 120_000 });
    if (r.exitCode !== 0) throw new Error(`guest: ${script}: ${r.stderr.toString()}`);
  };
  await sh('head -c 33554432 /dev/urandom > /dev/shm/random && yes "2026-12-03T07:00:00Z INFO worker step=17 reward=0.25 tokens=512" | head -c 33554432 > /dev/shm/text && sync');
  const snap = await tpl.snapshot('tpl', 'snap-probe');
  await tpl.destroy('tpl');

  const pki = join(root, 'pki');
  const plainSrc = newDriver('plain-src');
  const plainDst = newDriver('plain-dst');
  const tlsA = writeQemuTlsDir(join(pki, 'qa'), devPeerTls(pki, 'a', '127.0.0.1'));
  const tlsB = writeQemuTlsDir(join(pki, 'qb'), devPeerTls(pki, 'b', '127.0.0.1'));
  const qemuSrc = newDriver('qemu-src', tlsA);
  const qemuDst = newDriver('qemu-dst', tlsB);
  const socat = findSocat();
  const relaySrc = newDriver('relay-src', tlsA, true);
  const relayDst = newDriver('relay-dst', tlsB);
  const layer = { manifest: snap.manifest, image, diskLayerBacking: image.disk, writeDiskLayer: (p: string) => copyFile(join(snap.dir, snap.manifest.files.disk), p) };

  type Mode = 'plain' | 'tls' | 'relay';
  const modes: Mode[] = socat ? ['plain', 'tls', 'relay'] : ['plain', 'tls'];
  const got: Record<Mode, { streamMs: number[]; loadMs: number[]; bytes: number }> = {
    plain: { streamMs: [], loadMs: [], bytes: 0 },
    tls: { streamMs: [], loadMs: [], bytes: 0 },
    relay: { streamMs: [], loadMs: [], bytes: 0 },
  };
  let n = 0;
  for (let rep = 0; rep < REPS; rep++) {
    // Alternated, so neither mode always runs first in a round.
    for (const mode of rep % 2 ? [...modes].reverse() : modes) {
      const dst = mode === 'tls' ? qemuDst : mode === 'relay' ? relayDst : plainDst;
      if (mode === 'relay') {
        const vmId = `m${n++}`;
        const unixPath = join(root, `${vmId}.sock`);
        const relay = { socat: socat!, socketDir: join(root, 'relay-out') };
        const inbound = await listenRelay({ socat: socat!, tlsDir: tlsB, unixPath, peerHostId: 'a', acceptTimeoutMs: 20_000, bindHost: '127.0.0.1', fromHost: '127.0.0.1' });
        const incoming = await dst.prepareIncoming(layer, { vmId, hostname: vmId, sandboxId: `sb-${vmId}` });
        const t0 = performance.now();
        const out = migrateOutThroughRelay({ ...relay, tlsDir: tlsA }, { host: '127.0.0.1', port: inbound.port, hostId: 'b' }, (to) => relaySrc.migrateOut(snap, to));
        const [sent] = await Promise.all([out, inbound.verified.then(() => incoming.load({ unixPath }))]);
        const loadMs = performance.now() - t0;
        await inbound.stop();
        got[mode].streamMs.push(sent.ms);
        got[mode].loadMs.push(Math.round(loadMs));
        got[mode].bytes = sent.bytes;
        await dst.destroy(vmId);
        process.stderr.write(`${mode} stream ${sent.ms} ms, ready ${Math.round(loadMs)} ms\n`);
        continue;
      }
      let got1: (s: net.Socket) => void = () => undefined;
      const next = new Promise<net.Socket>((r) => (got1 = r));
      const server = net.createServer({ pauseOnConnect: true }, (s) => got1(s));
      await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
      const port = (server.address() as net.AddressInfo).port;
      const vmId = `m${n++}`;
      const incoming = await dst.prepareIncoming(layer, { vmId, hostname: vmId, sandboxId: `sb-${vmId}` });
      const t0 = performance.now();
      const out = (mode === 'tls' ? qemuSrc : plainSrc).migrateOut(snap, { host: '127.0.0.1', port });
      const [sent] = await Promise.all([out, next.then((s) => incoming.load(s))]);
      const loadMs = performance.now() - t0;
      server.close();
      got[mode].streamMs.push(sent.ms);
      got[mode].loadMs.push(Math.round(loadMs));
      got[mode].bytes = sent.bytes;
      await dst.destroy(vmId);
      process.stderr.write(`${mode} stream ${sent.ms} ms, ready ${Math.round(loadMs)} ms\n`);
    }
  }
  const out = {
    accel: await plainSrc.resolveAccel(),
    reps: REPS,
    stream_bytes: got.plain.bytes,
    modes: Object.fromEntries(modes.map((m) => [m, { source_stream_ms_p50: median(got[m].streamMs), call_to_ready_ms_p50: median(got[m].loadMs), call_to_ready_ms: got[m].loadMs }])),
    ...Object.fromEntries(
      modes
        .filter((m) => m !== 'plain')
        .map((m) => [
          `${m}_over_plain`,
          {
            source_stream: Number((median(got[m].streamMs) / median(got.plain.streamMs)).toFixed(2)),
            call_to_ready: Number((median(got[m].loadMs) / median(got.plain.loadMs)).toFixed(2)),
          },
        ]),
    ),
  };
  console.log(JSON.stringify(out, null, 2));
  const json = arg('json', '');
  if (json) writeFileSync(json, JSON.stringify(out, null, 2));
} finally {
  for (const d of drivers) await d.close().catch(() => undefined);
  rmSync(root, { recursive: true, force: true });
}
