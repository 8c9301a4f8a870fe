// A standalone transfer endpoint (chunk store + peer server + fetcher) for tests and the
// transfer benchmark, run inside a network namespace:
//   serve       --root DIR --listen IP:PORT --trust PEM --key-id ID
//   fetch       --root DIR --host-id H --snapshot S --ticket B64 --sources ADDR[,ADDR] --trust PEM --key-id ID [--materialise]
//   naive-serve --listen IP:PORT --files F[,F]      (baseline: plain TCP stream of whole files)
//   naive-recv  --connect IP:PORT --out FILE
// `serve` prints {"listening":ADDR} once ready; `fetch` and `naive-recv` print one JSON report.
// Tuning knobs for experiments (fetch): FF_STREAMS (streams per source), FF_CREDIT,
// FF_WINDOW (digests requested per stream); defaults are those of the agent.
// With --materialise (as the agent's fork path does it), `seconds` is when the last chunk
// was stored, `ready_seconds` when the image was complete (it is written while chunks
// arrive) and `durable_seconds` when the chunks were fsynced and the manifest stored.
import { parseArgs } from 'node:util';
import { createPublicKey } from 'node:crypto';
import { createReadStream, createWriteStream, readFileSync } from 'node:fs';
import { createServer, connect } from 'node:net';
import { pipeline } from 'node:stream/promises';
import { pino } from 'pino';
import { FsChunkStore, FsManifestStore } from '../chunkstore/fs-store.ts';
import { Materialiser } from '../chunkstore/materialise.ts';
import { LiveRoots, systemClock } from '../../domain/snapshot-store.ts';
import { decodeSignedTicket, type TrustedKeys } from '../../domain/tickets.ts';
import { fetchSnapshot } from '../../domain/transfer.ts';
import { startGrpcServer } from '../../../services/adapters/grpc/server.ts';
import { chunkTransferService } from './server.ts';
import { PeerChunkSource } from './client.ts';

const log = pino({ level: process.env.LOG_LEVEL ?? 'info' }, pino.destination(2));

const { positionals, values } = parseArgs({
  allowPositionals: true,
  options: {
    root: { type: 'string' },
    listen: { type: 'string' },
    connect: { type: 'string' },
    trust: { type: 'string' },
    'key-id': { type: 'string', default: 'k1' },
    'host-id': { type: 'string' },
    snapshot: { type: 'string' },
    ticket: { type: 'string' },
    sources: { type: 'string' },
    materialise: { type: 'boolean', default: false },
    files: { type: 'string' },
    out: { type: 'string' },
    'fsync-each': { type: 'boolean', default: false },
  },
});

function need(name: keyof typeof values): string {
  const v = values[name];
  if (typeof v !== 'string' || v === '') throw new Error(`--${name} is required`);
  return v;
}

function trust(): TrustedKeys {
  return new Map([[values['key-id'] ?? 'k1', createPublicKey(readFileSync(need('trust')))]]);
}

async function serve(): Promise<void> {
  const root = need('root');
  const chunks = new FsChunkStore(root);
  const manifests = new FsManifestStore(root);
  const { registration, stats } = chunkTransferService({ chunks, manifests, trust: trust(), clock: systemClock, log });
  const srv = await startGrpcServer({
    address: need('listen'),
    services: [registration],
    channelOptions: { 'grpc-node.flow_control_window': 16 * 1024 * 1024 },
  });
  process.stdout.write(`${JSON.stringify({ listening: srv.address, pid: process.pid })}\n`);
  const stop = (): void => {
    log.info({ stats }, 'stopping');
    void srv.close(500).then(() => process.exit(0));
  };
  process.once('SIGTERM', stop);
  process.once('SIGINT', stop);
}

async function fetch(): Promise<void> {
  const root = need('root');
  const hostId = need('host-id');
  const snapshotId = need('snapshot');
  // --fsync-each: the old behaviour (fsync every chunk), for comparison.
  const chunks = new FsChunkStore(root, { fsyncEach: values['fsync-each'] });
  const manifests = new FsManifestStore(root);
  const roots = new LiveRoots();
  const ticket = decodeSignedTicket(Buffer.from(need('ticket'), 'base64'));
  const sources = need('sources')
    .split(',')
    .map((address, i) => new PeerChunkSource({ id: `src${i}:${address}`, address, ticket, hostId, ...(process.env.FF_CREDIT ? { credit: Number(process.env.FF_CREDIT) } : {}) }));
  // Where the time goes, for the bench report (ms since t0): manifest fetched and verified,
  // missing chunks listed, first chunk received / stored / in the image. Also the fetch's
  // CPU time and page faults (all threads).
  const phases: Record<string, number> = {};
  const since = (): number => Math.round(performance.now() - t0);
  const traced = (store: FsChunkStore): FsChunkStore => {
    const missing = store.missing.bind(store);
    const accept = store.accept.bind(store);
    store.missing = async (d) => {
      phases.missing_start ??= since();
      const r = await missing(d);
      phases.missing_done ??= since();
      return r;
    };
    store.accept = async (c) => {
      phases.first_received ??= since();
      const r = await accept(c);
      phases.first_stored ??= since();
      return r;
    };
    return store;
  };
  const t0 = performance.now();
  const cpu0 = process.cpuUsage();
  const faults0 = process.resourceUsage().minorPageFault;
  const out: Record<string, unknown> = {};
  try {
    const fetchOpts = { backoffMs: 100, ...(process.env.FF_STREAMS ? { streamsPerSource: Number(process.env.FF_STREAMS) } : {}), ...(process.env.FF_WINDOW ? { window: Number(process.env.FF_WINDOW) } : {}) };
    const deps = { chunks: traced(chunks), manifests, roots, trust: trust(), log };
    if (values.materialise) {
      // As the agent does it: the image is written while chunks arrive.
      const mat = new Materialiser({ root, chunks, manifests, roots, trust: trust(), log });
      let fetchedAt = 0;
      const { report, durable } = await fetchSnapshot(snapshotId, sources, deps, {
        ...fetchOpts,
        deferDurable: true,
        around: async (manifest, run) => {
          phases.manifest = since();
          out.materialised = await mat.materialiseWhile(snapshotId, manifest, async (sink) => {
            await run(async (d, plain) => {
              phases.first_chunk ??= since();
              await sink(d, plain);
            });
            fetchedAt = performance.now();
          });
        },
      });
      out.ok = true;
      out.report = report;
      out.seconds = (fetchedAt - t0) / 1000;
      out.ready_seconds = (performance.now() - t0) / 1000;
      await durable;
      out.durable_seconds = (performance.now() - t0) / 1000;
      await mat.flush();
    } else {
      const { report } = await fetchSnapshot(snapshotId, sources, deps, fetchOpts);
      out.ok = true;
      out.report = report;
      out.seconds = (performance.now() - t0) / 1000;
    }
  } catch (e) {
    const err = e as Error & { kind?: string; digests?: readonly string[] };
    out.ok = false;
    out.error = { name: err.name, kind: err.kind, message: err.message, missing: err.digests?.length };
    out.seconds = (performance.now() - t0) / 1000;
  } finally {
    for (const s of sources) s.close();
  }
  out.phases = phases;
  const cpu = process.cpuUsage(cpu0);
  out.cpu_ms = Math.round((cpu.user + cpu.system) / 1000);
  out.cpu_sys_ms = Math.round(cpu.system / 1000);
  out.page_faults = process.resourceUsage().minorPageFault - faults0;
  out.stored = (await chunks.list()).length;
  process.stdout.write(`${JSON.stringify(out)}\n`);
}

async function naiveServe(): Promise<void> {
  const files = need('files').split(',');
  const [host, port] = need('listen').split(':');
  const srv = createServer((sock) => {
    void (async () => {
      for (const f of files) await pipeline(createReadStream(f, { highWaterMark: 1 << 20 }), sock, { end: false });
      sock.end();
    })().catch((e: unknown) => log.error({ err: e }, 'naive send failed'));
  });
  srv.listen(Number(port), host, () => process.stdout.write(`${JSON.stringify({ listening: need('listen'), pid: process.pid })}\n`));
  process.once('SIGTERM', () => srv.close(() => process.exit(0)));
}

async function naiveRecv(): Promise<void> {
  const [host, port] = need('connect').split(':');
  const t0 = performance.now();
  const sock = connect(Number(port), host);
  const out = createWriteStream(need('out'));
  let bytes = 0;
  sock.on('data', (b: Buffer) => (bytes += b.length));
  await pipeline(sock, out);
  process.stdout.write(`${JSON.stringify({ bytes, seconds: (performance.now() - t0) / 1000 })}\n`);
}

const cmd = positionals[0];
const run = cmd === 'serve' ? serve : cmd === 'fetch' ? fetch : cmd === 'naive-serve' ? naiveServe : cmd === 'naive-recv' ? naiveRecv : undefined;
if (!run) {
  process.stderr.write('usage: endpoint-main.ts serve|fetch|naive-serve|naive-recv ...\n');
  process.exit(2);
}
run().catch((e: unknown) => {
  log.error({ err: e }, 'endpoint failed');
  process.exit(1);
});
