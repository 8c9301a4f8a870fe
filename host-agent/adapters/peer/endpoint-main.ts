// A standalone transfer endpoint (chunk store + peer server + fetcher) for tests and the
// transfer benchmark, run inside a network namespace:
//   serve       --root DIR --listen IP:PORT --trust PEM --key-id ID
//   fetch       --root DIR --host-id H --snapshot S --ticket B64 --sources ADDR[,ADDR] --trust PEM --key-id ID [--materialise]
//   fetch-daemon --trust PEM --key-id ID   (long-lived receiver: JSON requests on stdin, see fetchDaemon)
//   naive-serve --listen IP:PORT --files F[,F]      (baseline: plain TCP stream of whole files)
//   naive-recv  --connect IP:PORT --out FILE
// `serve` prints {"listening":ADDR} once ready; `fetch` and `naive-recv` print one JSON report.
// serve, fetch and fetch-daemon take --tls-ca, --tls-cert and --tls-key (PEM files): mutual TLS
// as an agent with FF_PEER_* speaks it (tls.ts; the server then takes the caller's host id from
// its certificate, not from --host-id).
// Tuning knobs for experiments (fetch): FF_STREAMS (streams per source), FF_CREDIT,
// FF_WINDOW (digests requested per stream), FF_PUTS (chunks being stored per stream);
// defaults are those of the agent.
// With --materialise (as the agent's fork path does it), `seconds` is when the last chunk
// was stored, `ready_seconds` when the image was complete (it is written while chunks
// arrive) and `durable_seconds` when the chunks were fsynced and the manifest stored.
import { parseArgs } from 'node:util';
import { createPublicKey } from 'node:crypto';
import { createReadStream, createWriteStream, readFileSync } from 'node:fs';
import { createServer, connect } from 'node:net';
import { pipeline } from 'node:stream/promises';
import { createInterface } from 'node:readline';
import { PerformanceObserver } from 'node:perf_hooks';
import { pino } from 'pino';
import { FsChunkStore, FsManifestStore } from '../chunkstore/fs-store.ts';
import { Materialiser } from '../chunkstore/materialise.ts';
import { LiveRoots, systemClock } from '../../domain/snapshot-store.ts';
import { decodeSignedTicket, type TrustedKeys } from '../../domain/tickets.ts';
import { fetchSnapshot } from '../../domain/transfer.ts';
import { startGrpcServer } from '../../../services/adapters/grpc/server.ts';
import { chunkTransferService } from './server.ts';
import { PeerChunkSource } from './client.ts';
import { certificateHostId, peerServerCredentials, type PeerTls } from './tls.ts';

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
    'tls-ca': { type: 'string' },
    'tls-cert': { type: 'string' },
    'tls-key': { type: 'string' },
  },
});

/** --tls-ca, --tls-cert and --tls-key: all three or none. */
const peerTls: PeerTls | undefined =
  values['tls-ca'] || values['tls-cert'] || values['tls-key'] ? { ca: readFileSync(need('tls-ca')), cert: readFileSync(need('tls-cert')), key: readFileSync(need('tls-key')) } : undefined;

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
  const { registration, stats } = chunkTransferService({ chunks, manifests, trust: trust(), clock: systemClock, log, ...(peerTls ? { callerHostId: certificateHostId } : {}) });
  const srv = await startGrpcServer({
    address: need('listen'),
    services: [registration],
    credentials: peerServerCredentials(peerTls),
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

/** A receiver's long-lived state: what an agent keeps between fetches. */
interface Receiver {
  readonly root: string;
  readonly chunks: FsChunkStore;
  readonly manifests: FsManifestStore;
  readonly roots: LiveRoots;
  readonly mat: Materialiser;
  /** Phase marks of the fetch in progress (set by the store wrappers of openReceiver). */
  phases: Record<string, number>;
  t0: number;
}

interface FetchRequest {
  readonly hostId: string;
  readonly snapshot: string;
  readonly ticket: string;
  readonly sources: string;
  readonly materialise: boolean;
}

function openReceiver(root: string): Receiver {
  // --fsync-each: the old behaviour (fsync every chunk), for comparison.
  const chunks = new FsChunkStore(root, { fsyncEach: values['fsync-each'] });
  const manifests = new FsManifestStore(root);
  const roots = new LiveRoots();
  const mat = new Materialiser({ root, chunks, manifests, roots, trust: trust(), log });
  const rx: Receiver = { root, chunks, manifests, roots, mat, phases: {}, t0: 0 };
  // Where the time goes, for the bench report (ms since t0): manifest fetched and verified,
  // missing chunks listed, first and last chunk received / stored, first chunk in the image.
  const since = (): number => Math.round(performance.now() - rx.t0);
  const missing = chunks.missing.bind(chunks);
  const accept = chunks.accept.bind(chunks);
  const acceptInto = chunks.acceptInto.bind(chunks);
  chunks.missing = async (d) => {
    rx.phases.missing_start ??= since();
    const r = await missing(d);
    rx.phases.missing_done ??= since();
    return r;
  };
  const mark = (what: 'received' | 'stored'): void => {
    const t = since();
    rx.phases[`last_${what}`] = t;
    rx.phases[`first_${what}`] ??= t;
  };
  chunks.accept = async (c) => {
    mark('received');
    const r = await accept(c);
    mark('stored');
    return r;
  };
  chunks.acceptInto = async (c, places) => {
    mark('received');
    await acceptInto(c, places);
    mark('stored');
  };
  return rx;
}

/** One fetch; the report also has the fetch's CPU time and page faults (all threads). */
async function fetchOnce(rx: Receiver, req: FetchRequest): Promise<Record<string, unknown>> {
  const { chunks, manifests, roots, mat } = rx;
  const snapshotId = req.snapshot;
  const ticket = decodeSignedTicket(Buffer.from(req.ticket, 'base64'));
  const sources = req.sources
    .split(',')
    .map((address, i) => new PeerChunkSource({ id: `src${i}:${address}`, address, ticket, hostId: req.hostId, tls: peerTls, ...(process.env.FF_CREDIT ? { credit: Number(process.env.FF_CREDIT) } : {}) }));
  const phases: Record<string, number> = (rx.phases = {});
  const t0 = (rx.t0 = performance.now());
  const since = (): number => Math.round(performance.now() - t0);
  const cpu0 = process.cpuUsage();
  const faults0 = process.resourceUsage().minorPageFault;
  // Main-isolate garbage collections during the fetch (count and pause ms by kind).
  const gc: Record<string, [number, number]> = {};
  const gcObs = new PerformanceObserver((list) => {
    for (const e of list.getEntries()) {
      const kind = ({ 1: 'minor', 2: 'major', 4: 'incremental', 8: 'weakcb' } as Record<number, string>)[((e as unknown as { detail?: { kind?: number } }).detail?.kind ?? 0)] ?? 'other';
      const g = (gc[kind] ??= [0, 0]);
      g[0]++;
      g[1] = Math.round(g[1] + e.duration);
    }
  });
  gcObs.observe({ entryTypes: ['gc'] });
  const out: Record<string, unknown> = {};
  try {
    const fetchOpts = { backoffMs: 100, ...(process.env.FF_STREAMS ? { streamsPerSource: Number(process.env.FF_STREAMS) } : {}), ...(process.env.FF_WINDOW ? { window: Number(process.env.FF_WINDOW) } : {}), ...(process.env.FF_PUTS ? { putConcurrency: Number(process.env.FF_PUTS) } : {}) };
    const deps = { chunks, manifests, roots, trust: trust(), log };
    if (req.materialise) {
      // As the agent does it: the image is written while chunks arrive.
      let fetchedAt = 0;
      const { report, durable } = await fetchSnapshot(snapshotId, sources, deps, {
        ...fetchOpts,
        deferDurable: true,
        around: async (manifest, run) => {
          phases.manifest = since();
          out.materialised = await mat.materialiseWhile(snapshotId, manifest, async (sink) => {
            // Passed on as the agent's shipper does, with the first chunk in the image noted.
            const placer = sink.placer;
            const traced = async (d: string, plain: Buffer): Promise<void> => {
              phases.first_chunk ??= since();
              await sink(d, plain);
            };
            await run(
              placer
                ? Object.assign(traced, {
                    placer: {
                      placesOf: (d: string) => placer.placesOf(d),
                      placed: (d: string) => {
                        phases.first_chunk ??= since();
                        placer.placed(d);
                      },
                    },
                  })
                : traced,
            );
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
  gcObs.disconnect();
  out.gc = gc;
  const cpu = process.cpuUsage(cpu0);
  out.cpu_ms = Math.round((cpu.user + cpu.system) / 1000);
  out.cpu_sys_ms = Math.round(cpu.system / 1000);
  out.page_faults = process.resourceUsage().minorPageFault - faults0;
  out.stored = (await chunks.list()).length;
  return out;
}

async function fetch(): Promise<void> {
  const rx = openReceiver(need('root'));
  const out = await fetchOnce(rx, { hostId: need('host-id'), snapshot: need('snapshot'), ticket: need('ticket'), sources: need('sources'), materialise: values.materialise ?? false });
  process.stdout.write(`${JSON.stringify(out)}\n`);
}

/**
 * A long-lived receiver, as a host agent is: JIT, heap, verify workers and buffer pools are
 * kept across fetches. Reads one JSON request per stdin line and answers one JSON line each
 * (same output as `fetch`): {"root","hostId","snapshot","ticket","sources","materialise"}.
 * Each `root` is a chunk store opened on first use and kept (the bench gives every fetch its
 * own, so nothing is deduplicated and nothing is deleted between fetches: see ADR 0008 on
 * ext4 without a journal). Exits when stdin ends.
 */
async function fetchDaemon(): Promise<void> {
  const receivers = new Map<string, Receiver>();
  process.stdout.write(`${JSON.stringify({ ready: true, pid: process.pid })}\n`);
  for await (const line of createInterface({ input: process.stdin, crlfDelay: Infinity })) {
    if (!line.trim()) continue;
    let out: Record<string, unknown>;
    try {
      const req = JSON.parse(line) as FetchRequest & { root: string };
      let rx = receivers.get(req.root);
      if (!rx) receivers.set(req.root, (rx = openReceiver(req.root)));
      out = await fetchOnce(rx, req);
    } catch (e) {
      out = { ok: false, error: { name: (e as Error).name, message: (e as Error).message } };
    }
    process.stdout.write(`${JSON.stringify(out)}\n`);
  }
  for (const rx of receivers.values()) await rx.mat.flush();
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
const run = cmd === 'serve' ? serve : cmd === 'fetch' ? fetch : cmd === 'fetch-daemon' ? fetchDaemon : cmd === 'naive-serve' ? naiveServe : cmd === 'naive-recv' ? naiveRecv : undefined;
if (!run) {
  process.stderr.write('usage: endpoint-main.ts serve|fetch|fetch-daemon|naive-serve|naive-recv ...\n');
  process.exit(2);
}
run().catch((e: unknown) => {
  log.error({ err: e }, 'endpoint failed');
  process.exit(1);
});
