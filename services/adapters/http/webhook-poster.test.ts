import { createServer } from 'node:http';
import type { AddressInfo } from 'node:net';
import { describe, expect, it } from 'vitest';
import { fetchPoster } from './webhook-poster.ts';

describe('fetchPoster', () => {
  it('receiverAnsweringWithAnEndlessBody_isTakenAtItsStatus_withoutReadingTheBody', async () => {
    let written = 0;
    const chunk = Buffer.alloc(64 * 1024, 'x');
    const srv = createServer((req, res) => {
      req.resume();
      req.on('end', () => {
        res.writeHead(200, { 'content-type': 'text/plain' });
        const more = (): void => {
          let room = true;
          while (!res.destroyed && room) {
            room = res.write(chunk);
            written += chunk.length;
          }
          if (!res.destroyed) res.once('drain', more);
        };
        more();
      });
    });
    await new Promise<void>((r) => srv.listen(0, '127.0.0.1', () => r()));
    try {
      const url = `http://127.0.0.1:${(srv.address() as AddressInfo).port}/hook`;
      expect(await fetchPoster.post(url, '{}', { 'content-type': 'application/json' }, 5000)).toBe(200);
      // The client let go of the body: the server could not push more than its socket buffers.
      expect(written).toBeLessThan(16 * 1024 * 1024);
    } finally {
      srv.closeAllConnections();
      await new Promise((r) => srv.close(r));
    }
  });
});
