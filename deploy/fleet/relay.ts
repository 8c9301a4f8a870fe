// A byte relay between a TCP port and a unix socket, used by the local fleet so that host
// agents inside their network namespaces reach the control plane (NATS) on the root
// namespace's loopback without any address outside the fleet's own namespaces: the unix
// socket lives in the shared filesystem.
//
//   node --import tsx deploy/fleet/relay.ts tcp:127.0.0.1:4222=unix:/run/x.sock [more...]
//   node --import tsx deploy/fleet/relay.ts unix:/run/x.sock=tcp:127.0.0.1:34567
import { createConnection, createServer } from 'node:net';
import type { Socket } from 'node:net';
import { rmSync } from 'node:fs';

type End = { kind: 'tcp'; host: string; port: number } | { kind: 'unix'; path: string };

function parse(s: string): End {
  if (s.startsWith('unix:')) return { kind: 'unix', path: s.slice(5) };
  const m = /^tcp:([^:]+):(\d+)$/.exec(s);
  if (!m) throw new Error(`relay: bad endpoint ${JSON.stringify(s)} (want tcp:HOST:PORT or unix:PATH)`);
  return { kind: 'tcp', host: m[1]!, port: Number(m[2]) };
}

function dial(e: End): Socket {
  return e.kind === 'unix' ? createConnection(e.path) : createConnection(e.port, e.host);
}

/** Resolves once it listens (a port or socket it cannot take ends the process, saying why). */
function relay(listen: End, to: End): Promise<void> {
  const server = createServer((client) => {
    const upstream = dial(to);
    client.setNoDelay(true);
    upstream.on('connect', () => {
      if (upstream instanceof Object && 'setNoDelay' in upstream) upstream.setNoDelay(true);
    });
    client.pipe(upstream);
    upstream.pipe(client);
    const close = (): void => {
      client.destroy();
      upstream.destroy();
    };
    client.on('error', close);
    upstream.on('error', close);
    client.on('close', close);
    upstream.on('close', close);
  });
  server.on('error', (e) => {
    process.stderr.write(`relay: ${e.message}\n`);
    process.exit(1);
  });
  return new Promise((resolve) => {
    if (listen.kind === 'unix') {
      rmSync(listen.path, { force: true });
      server.listen(listen.path, resolve);
    } else {
      server.listen(listen.port, listen.host, resolve);
    }
  });
}

const pairs = process.argv.slice(2);
if (pairs.length === 0) {
  process.stderr.write('usage: relay.ts LISTEN=TARGET ...\n');
  process.exit(2);
}
const listening: Array<Promise<void>> = [];
for (const p of pairs) {
  const [l, t] = p.split('=');
  if (!l || !t) throw new Error(`relay: bad pair ${p}`);
  listening.push(relay(parse(l), parse(t)));
}
process.on('SIGTERM', () => process.exit(0));
// Only once every end listens: the fleet waits for this line before its agents connect.
await Promise.all(listening);
process.stdout.write('relay ready\n');
