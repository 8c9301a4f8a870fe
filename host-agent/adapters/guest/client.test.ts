// GuestAgentClient against a fake qemu-ga on a unix socket that misbehaves as a tenant's guest
// may: the guest is untrusted, the agent's memory is every tenant's.
import { afterEach, describe, expect, it } from 'vitest';
import { createServer } from 'node:net';
import type { Server, Socket } from 'node:net';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { GuestAgentClient, MAX_PENDING_REPLY_BYTES, pathError } from './client.ts';
import { ChannelClosedError, GuestAgentCommandError } from '../../errors.ts';
import type { ForkfleetError } from '../../../proto/errors.ts';

/** Answers guest-sync-delimited and guest-ping like qemu-ga; `onPing` replaces the ping answer. */
async function fakeGuest(onPing?: (sock: Socket) => void): Promise<{ path: string; sockets: Socket[]; close: () => Promise<void> }> {
  const dir = mkdtempSync(join(tmpdir(), 'ff-qga-'));
  const path = join(dir, 'qga.sock');
  const sockets: Socket[] = [];
  const srv: Server = createServer((sock) => {
    sockets.push(sock);
    sock.on('error', () => undefined);
    let pending = '';
    sock.on('data', (d) => {
      pending += d.toString('utf8');
      let nl: number;
      while ((nl = pending.indexOf('\n')) >= 0) {
        const req = JSON.parse(pending.slice(0, nl)) as { execute: string; arguments?: { id?: number } };
        pending = pending.slice(nl + 1);
        if (req.execute === 'guest-sync-delimited') sock.write(Buffer.concat([Buffer.from([0xff]), Buffer.from(`${JSON.stringify({ return: req.arguments?.id })}\n`)]));
        else if (req.execute === 'guest-ping') (onPing ?? ((s: Socket) => s.write('{"return": {}}\n')))(sock);
      }
    });
  });
  await new Promise<void>((r) => srv.listen(path, r));
  return {
    path,
    sockets,
    close: async () => {
      for (const s of sockets) s.destroy();
      await new Promise((r) => srv.close(r));
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

/** Writes `total` bytes of `fill` (no newline) as fast as the socket takes them. */
function flood(sock: Socket, total: number, fill = 0x41): Promise<number> {
  const chunk = Buffer.alloc(1 << 20, fill);
  return new Promise((resolve) => {
    let sent = 0;
    const more = (): void => {
      while (sent < total && !sock.destroyed) {
        sent += chunk.length;
        if (!sock.write(chunk)) return void sock.once('drain', more);
      }
      resolve(sent);
    };
    sock.once('close', () => resolve(sent));
    more();
  });
}

describe('GuestAgentClient with an untrusted guest', () => {
  const cleanups: Array<() => Promise<void> | void> = [];
  afterEach(async () => {
    for (const c of cleanups.splice(0)) await c();
  });

  it('answerWithoutANewlinePastTheCap_closesTheChannel_insteadOfBufferingIt', async () => {
    let flooded: Promise<number> | undefined;
    const g = await fakeGuest((sock) => void (flooded = flood(sock, MAX_PENDING_REPLY_BYTES + (64 << 20))));
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    await expect(c.ping(30_000)).rejects.toBeInstanceOf(ChannelClosedError);
    // The client hung up once the cap was passed: the guest could not push it all.
    expect(await flooded).toBeLessThan(MAX_PENDING_REPLY_BYTES + (64 << 20));
    await expect(c.ping(1000)).rejects.toBeInstanceOf(ChannelClosedError);
  }, 60_000);

  it('bytesNoCommandWaitsFor_areDropped_andTheNextCommandIsAnswered', async () => {
    const g = await fakeGuest();
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    await c.ping(5000);
    // Unasked, more than the cap: nothing holds it, and the channel stays usable.
    await flood(g.sockets[0]!, MAX_PENDING_REPLY_BYTES + (8 << 20));
    await new Promise((r) => setTimeout(r, 200));
    await c.sync(5000);
    await c.ping(5000);
  }, 60_000);
});

describe('pathError', () => {
  it('guestRefusalsOfThePath_nameThePathField_withTheirKind_otherErrorsPassUnchanged', () => {
    const refused = (desc: string) => pathError('/x/y', new GuestAgentCommandError('guest-file-open', `GenericError: failed to open file '/x/y' (mode: 'r'): ${desc}`)) as ForkfleetError;
    expect([refused('No such file or directory').kind, refused('No such file or directory').field]).toEqual(['not_found', 'path']);
    expect(refused('Not a directory').kind).toBe('not_found');
    expect(refused('Is a directory').kind).toBe('invalid_argument');
    expect(refused('Permission denied').kind).toBe('failed_precondition');
    expect(refused('No space left on device').kind).toBe('resource_exhausted');
    const other = new GuestAgentCommandError('guest-file-read', 'GenericError: Input/output error');
    expect(pathError('/x/y', other)).toBe(other);
  });
});
