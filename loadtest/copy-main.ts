// Naive full-copy baseline helper, run inside a fleet host's network namespace:
//   copy-main.ts serve --listen IP:PORT --files F[,F]   streams every file whole on each connection
//   copy-main.ts recv  --connect IP:PORT --out DIR       waits for "go" on stdin, receives, prints JSON
// With --tls CA,CERT,KEY (each end its host's peer certificate) the stream is mutual TLS, as
// the fleet's peers speak it, so a TLS fleet is compared with an encrypted copy.
// Wire format per file: u16 name length, name, u64 size, bytes (copy-frames.ts). The receiver
// writes the bytes from the received chunks as they are, without copying them.
import { parseArgs } from 'node:util';
import { createReadStream, createWriteStream, readFileSync, statSync } from 'node:fs';
import { basename, join } from 'node:path';
import { connect, createServer } from 'node:net';
import type { Socket } from 'node:net';
import tls from 'node:tls';
import { once } from 'node:events';
import { FrameReader, type FileSink } from './copy-frames.ts';

const { positionals, values } = parseArgs({ allowPositionals: true, options: { listen: { type: 'string' }, connect: { type: 'string' }, files: { type: 'string' }, out: { type: 'string' }, tls: { type: 'string' } } });

/** --tls CA,CERT,KEY: PEM files of the fleet's CA and this end's host certificate. */
function tlsFiles(): { ca: Buffer; cert: Buffer; key: Buffer } | undefined {
  if (!values.tls) return undefined;
  const [ca, cert, key] = values.tls.split(',').map((f) => readFileSync(f));
  if (!ca || !cert || !key) throw new Error('--tls needs CA,CERT,KEY');
  return { ca, cert, key };
}

function need(k: 'listen' | 'connect' | 'files' | 'out'): string {
  const v = values[k];
  if (!v) throw new Error(`--${k} is required`);
  return v;
}

async function send(sock: Socket, files: string[]): Promise<void> {
  for (const f of files) {
    const name = Buffer.from(basename(f));
    const head = Buffer.alloc(2 + name.length + 8);
    head.writeUInt16BE(name.length, 0);
    name.copy(head, 2);
    head.writeBigUInt64BE(BigInt(statSync(f).size), 2 + name.length);
    if (!sock.write(head)) await once(sock, 'drain');
    for await (const chunk of createReadStream(f, { highWaterMark: 1 << 20 })) if (!sock.write(chunk as Buffer)) await once(sock, 'drain');
  }
  // The end marker (an empty name): a receiver that does not see it got a cut stream.
  sock.end(Buffer.alloc(2));
}

async function serve(): Promise<void> {
  const files = need('files').split(',');
  const [host, port] = need('listen').split(':');
  const onSock = (sock: Socket): void => void send(sock, files).catch((e: unknown) => process.stderr.write(`send failed: ${String(e)}\n`));
  const t = tlsFiles();
  const srv = t ? tls.createServer({ ...t, requestCert: true, rejectUnauthorized: true }, onSock) : createServer(onSock);
  srv.listen(Number(port), host, () => process.stdout.write(`${JSON.stringify({ listening: need('listen') })}\n`));
  process.once('SIGTERM', () => srv.close(() => process.exit(0)));
}

async function recv(): Promise<void> {
  const [host, port] = need('connect').split(':');
  const dir = need('out');
  process.stdout.write('{"ready":true}\n');
  await once(process.stdin, 'data');
  const t0 = performance.now();
  const t = tlsFiles();
  // The sender's certificate names its address (IP SAN), as between the fleet's agents.
  const sock = t ? tls.connect({ port: Number(port), host, ...t, servername: 'forkfleet-peer', checkServerIdentity: (_n, cert) => tls.checkServerIdentity(host!, cert) }) : connect(Number(port), host);
  // Each file's bytes are written straight from the received chunks (copy-frames.ts): no copy per chunk.
  const reader = new FrameReader((name): FileSink => {
    const out = createWriteStream(join(dir, name));
    return {
      write: async (b) => {
        if (!out.write(b)) await once(out, 'drain');
      },
      end: async () => {
        out.end();
        await once(out, 'finish');
      },
    };
  });
  let bytes = 0;
  for await (const chunk of sock) {
    bytes += (chunk as Buffer).length;
    await reader.push(chunk as Buffer);
  }
  // A sender that died mid-stream closes it too: only a complete one is a sample.
  reader.finish();
  const files = reader.files;
  process.stdout.write(`${JSON.stringify({ done: true, files, bytes, ms: performance.now() - t0 })}\n`);
  process.exit(0);
}

const run = positionals[0] === 'serve' ? serve : positionals[0] === 'recv' ? recv : undefined;
if (!run) {
  process.stderr.write('usage: copy-main.ts serve|recv ...\n');
  process.exit(2);
}
run().catch((e: unknown) => {
  process.stderr.write(`${e instanceof Error ? e.message : String(e)}\n`);
  process.exit(1);
});
