// A connection to a unix socket (QEMU's QMP and guest-agent chardevs), given up after a time.
import net from 'node:net';

/** Connects to `path`; after `timeoutMs` without a connection, destroys it and rejects with `timedOut()`. */
export function connectUnix(path: string, timeoutMs: number, timedOut: () => Error): Promise<net.Socket> {
  return new Promise((resolve, reject) => {
    const s = net.createConnection(path);
    const t = setTimeout(() => {
      s.destroy();
      reject(timedOut());
    }, timeoutMs);
    s.once('connect', () => {
      clearTimeout(t);
      resolve(s);
    });
    s.once('error', (e) => {
      clearTimeout(t);
      reject(e);
    });
  });
}
