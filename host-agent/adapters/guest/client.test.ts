// GuestAgentClient against a fake qemu-ga on a unix socket that misbehaves as a tenant's guest
// may: the guest is untrusted, the agent's memory is every tenant's.
import { afterEach, describe, expect, it } from 'vitest';
import { createServer } from 'node:net';
import type { Server, Socket } from 'node:net';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { GuestAgentClient, MAX_PENDING_REPLY_BYTES, cwdRefusal, leftStreams, pathError } from './client.ts';
import { ChannelClosedError, GuestAgentCommandError, GuestAgentTimeoutError } from '../../errors.ts';
import type { ForkfleetError } from '../../../proto/errors.ts';

interface FakeGuestOptions {
  /** Replaces the answer to guest-ping. */
  onPing?: (sock: Socket) => void;
  /** Answers to other commands (in order, as qemu-ga answers: after `delayMs`, the ones before it first). */
  answer?: (req: { execute: string; arguments?: Record<string, unknown> }) => { delayMs?: number; reply: unknown } | undefined;
  /** Bytes each new connection's parser holds already (half a request a snapshot replayed). */
  seed?: string;
}

/**
 * Answers guest-sync-delimited and guest-ping like qemu-ga (and what `answer` says). Like
 * qemu-ga's parser, a 0xFF byte drops whatever came before it; a line that does not parse is
 * counted in `parseErrors` and answered with an error.
 */
async function fakeGuest(o: FakeGuestOptions | ((sock: Socket) => void) = {}): Promise<{ path: string; sockets: Socket[]; parseErrors: () => number; close: () => Promise<void> }> {
  const opts: FakeGuestOptions = typeof o === 'function' ? { onPing: o } : o;
  const dir = mkdtempSync(join(tmpdir(), 'ff-qga-'));
  const path = join(dir, 'qga.sock');
  const sockets: Socket[] = [];
  let parseErrors = 0;
  const srv: Server = createServer((sock) => {
    sockets.push(sock);
    sock.on('error', () => undefined);
    let pending = opts.seed ?? '';
    let inOrder: Promise<unknown> = Promise.resolve();
    const send = (delayMs: number, line: string | Buffer): void => {
      inOrder = inOrder.then(() => new Promise((r) => setTimeout(r, delayMs))).then(() => void (sock.destroyed || sock.write(line)));
    };
    sock.on('data', (d) => {
      pending += d.toString('latin1');
      const ff = pending.lastIndexOf('\xff');
      if (ff >= 0) pending = pending.slice(ff + 1);
      let nl: number;
      while ((nl = pending.indexOf('\n')) >= 0) {
        const line = pending.slice(0, nl);
        pending = pending.slice(nl + 1);
        let req: { execute: string; arguments?: Record<string, unknown> };
        try {
          req = JSON.parse(line) as typeof req;
        } catch {
          parseErrors++;
          send(0, '{"error": {"class": "GenericError", "desc": "JSON parse error"}}\n');
          continue;
        }
        if (req.execute === 'guest-sync-delimited') send(0, Buffer.concat([Buffer.from([0xff]), Buffer.from(`${JSON.stringify({ return: req.arguments?.id })}\n`)]));
        else if (req.execute === 'guest-ping' && opts.onPing) opts.onPing(sock);
        else if (req.execute === 'guest-ping') send(0, '{"return": {}}\n');
        else {
          const a = opts.answer?.(req);
          if (a) send(a.delayMs ?? 0, `${JSON.stringify({ return: a.reply })}\n`);
        }
      }
    });
  });
  await new Promise<void>((r) => srv.listen(path, r));
  return {
    path,
    sockets,
    parseErrors: () => parseErrors,
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

  it('answerWithoutANewlinePastTheCap_closesTheChannel_insteadOfBufferingIt_andTheNextCallConnectsAgain', async () => {
    let flooded: Promise<number> | undefined;
    const g = await fakeGuest((sock) => {
      if (flooded) sock.write('{"return": {}}\n');
      else flooded = flood(sock, MAX_PENDING_REPLY_BYTES + (64 << 20));
    });
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    await expect(c.ping(30_000)).rejects.toBeInstanceOf(ChannelClosedError);
    // The client hung up once the cap was passed: the guest could not push it all.
    expect(await flooded).toBeLessThan(MAX_PENDING_REPLY_BYTES + (64 << 20));
    expect(c.closed).toBe(true);
    // The sandbox keeps a guest channel: a new connection, synced before the command.
    await c.ping(5000);
    expect(g.sockets).toHaveLength(2);
    // Closed by its owner (a destroyed VM, a snapshot's switch), it stays closed.
    c.close();
    await expect(c.ping(1000)).rejects.toBeInstanceOf(ChannelClosedError);
    expect(g.sockets).toHaveLength(2);
  }, 60_000);

  it('commandQueuedBehindOneThatTimesOut_resyncsFirst_andNeverTakesTheLateAnswerForItsOwn', async () => {
    let handle = 100;
    const g = await fakeGuest({
      // qemu-ga answers in order; the open of /slow takes 1.5 s (a FIFO, a loaded guest).
      answer: (req) => (req.execute === 'guest-file-open' ? { delayMs: req.arguments?.path === '/slow' ? 1500 : 0, reply: handle++ } : undefined),
    });
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    await c.sync(5000);
    const slow = c.command<number>('guest-file-open', { path: '/slow', mode: 'w' }, 500);
    const next = c.command<number>('guest-file-open', { path: '/b', mode: 'w' }, 5000);
    await expect(slow).rejects.toBeInstanceOf(GuestAgentTimeoutError);
    // /slow was given handle 100 (answered late); /b's own open is the second one.
    expect(await next).toBe(101);
  }, 30_000);

  it('execStatusWithFullStdoutAndStderr_fitsUnderTheCap', async () => {
    // qemu-ga caps each stream at 16 MiB and sends both, base64, in one line.
    const out = Buffer.alloc(16 << 20, 0x61).toString('base64');
    const g = await fakeGuest({ answer: (req) => (req.execute === 'guest-exec-status' ? { reply: { exited: true, exitcode: 0, 'out-data': out, 'err-data': out } } : undefined) });
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    const st = await c.command<{ 'out-data': string; 'err-data': string }>('guest-exec-status', { pid: 1 }, 30_000);
    expect(st['out-data'].length + st['err-data'].length).toBe(2 * out.length);
  }, 60_000);

  it('exec_whoseOutputPassedQemuGasCap_saysTheOutputWasTruncated', async () => {
    const g = await fakeGuest({
      answer: (req) =>
        req.execute === 'guest-exec' ? { reply: { pid: 42 } } : req.execute === 'guest-exec-status' ? { reply: { exited: true, exitcode: 0, 'out-data': 'YQ==', 'out-truncated': true } } : undefined,
    });
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    const r = await c.exec({ path: '/bin/yes', timeoutMs: 5000 });
    expect(r).toMatchObject({ exitCode: 0, outputTruncated: true });
    expect(r.stdout.toString()).toBe('a');
  });

  it('exec_whoseTimeoutIsShorterThanItsStart_waitsForThePid_andKillsTheProgramAsTimedOut_notLeavingItRunning', async () => {
    // A start answered after 60 ms, an exec timeout of 10 ms: the start failed late before,
    // and the program it started ran on with no one to kill it.
    const kills: string[] = [];
    const g = await fakeGuest({
      answer: (req) => {
        if (req.execute === 'guest-exec') {
          const arg = (req.arguments?.arg as string[] | undefined) ?? [];
          if (arg[2] === 'ff-kill') {
            kills.push(arg[3] ?? '');
            return { reply: { pid: 50 } };
          }
          return { delayMs: 60, reply: { pid: 42 } };
        }
        if (req.execute === 'guest-exec-status') return { reply: req.arguments?.pid === 42 && kills.length === 0 ? { exited: false } : { exited: true, signal: 9 } };
        return undefined;
      },
    });
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    const r = await c.exec({ path: '/bin/sleep', args: ['600'], timeoutMs: 10 });
    expect(r).toMatchObject({ timedOut: true, signal: 9 });
    expect(kills[0]).toBe('42');
  });

  it('sync_ofAGuestWhoseParserHoldsHalfARequest_flushesItFirst_soTheFirstSyncParses', async () => {
    // A snapshot taken while a write was half sent replays that half into every clone's qemu-ga.
    const g = await fakeGuest({ seed: '{"execute": "guest-file-write", "arguments": {"handle": 1, "buf-b64": "QUFB' });
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    await c.sync(10_000, 5000);
    expect(g.parseErrors()).toBe(0);
  }, 30_000);

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

describe('GuestAgentClient.hold', () => {
  let guests: Array<Awaited<ReturnType<typeof fakeGuest>>> = [];
  afterEach(async () => {
    for (const g of guests) await g.close();
    guests = [];
  });

  it('commandsQueuedWhileHeld_waitWithoutTimingOut_andGoToTheSocketItWasMovedTo', async () => {
    const status = (exited: boolean) => (req: { execute: string }) => (req.execute === 'guest-exec-status' ? { reply: exited ? { exited: true, exitcode: 0, 'out-data': Buffer.from('from the replacement').toString('base64') } : { exited: false } } : undefined);
    const old = await fakeGuest({ answer: status(false) });
    const moved = await fakeGuest({ answer: status(true) });
    guests.push(old, moved);
    const c = await GuestAgentClient.connect(old.path);
    try {
      expect(await c.command<{ exited: boolean }>('guest-exec-status', { pid: 1 })).toEqual({ exited: false });
      const release = await c.hold();
      // Queued during the hold, with a timeout shorter than the hold: it must wait, not time out.
      const queued = c.command<{ exited: boolean; 'out-data': string }>('guest-exec-status', { pid: 1 }, 100);
      await new Promise((r) => setTimeout(r, 300));
      for (const s of old.sockets) s.destroy(); // the old QEMU dies under the hold
      await new Promise((r) => setTimeout(r, 50));
      release(moved.path);
      release(old.path); // a second call does nothing
      const r = await queued;
      expect(Buffer.from(r['out-data'], 'base64').toString()).toBe('from the replacement');
      expect(moved.sockets).toHaveLength(1);
      await c.ping(1000);
    } finally {
      c.close();
    }
  });

  it('releasedWithoutAPath_keepsTheSocketItHad', async () => {
    const g = await fakeGuest();
    guests.push(g);
    const c = await GuestAgentClient.connect(g.path);
    try {
      await c.ping(1000);
      const release = await c.hold();
      const queued = c.ping(100);
      await new Promise((r) => setTimeout(r, 200));
      release();
      await queued;
      expect(g.sockets).toHaveLength(1);
    } finally {
      c.close();
    }
  });
});

describe('pathError', () => {
  it('guestRefusalsOfThePath_nameThePathField_withTheirKind_anyOtherRefusalToOpenItToo_laterErrorsPassUnchanged', () => {
    const refused = (desc: string) => pathError('/x/y', new GuestAgentCommandError('guest-file-open', `GenericError: failed to open file '/x/y' (mode: 'r'): ${desc}`)) as ForkfleetError;
    expect([refused('No such file or directory').kind, refused('No such file or directory').field]).toEqual(['not_found', 'path']);
    expect(refused('Not a directory').kind).toBe('not_found');
    expect(refused('Is a directory').kind).toBe('invalid_argument');
    expect(refused('Permission denied').kind).toBe('failed_precondition');
    expect(refused('No space left on device').kind).toBe('resource_exhausted');
    expect([refused('Too many levels of symbolic links').kind, refused('Too many levels of symbolic links').field]).toEqual(['invalid_argument', 'path']);
    expect(refused('File too large').kind).toBe('invalid_argument');
    expect(refused('Text file busy').kind).toBe('failed_precondition');
    expect(refused('No such device or address').kind).toBe('failed_precondition');
    // A guest short of a resource for a moment is no fault of the path: retryable.
    expect([refused('Too many open files').kind, refused('Too many open files').retryable, refused('Too many open files').field]).toEqual(['unavailable', true, undefined]);
    // Any other refusal to open the path names it too, with the guest's reason.
    const odd = refused('Invalid argument');
    expect([odd.kind, odd.field, odd.message]).toEqual(['failed_precondition', 'path', '/x/y: the guest refuses to open it: Invalid argument (in the guest)']);
    const other = new GuestAgentCommandError('guest-file-read', 'GenericError: Input/output error');
    expect(pathError('/x/y', other)).toBe(other);
  });
});

describe('cwdRefusal', () => {
  it('namesCwd_onlyForTheWrappersLastLineWithThisCallsNonce', () => {
    const zero = 'ff-exec-0123456789abcdef';
    const e = cwdRefusal(Buffer.from(`\n${zero} cwd-denied\n`), zero, '/root');
    expect([e?.kind, e?.field, e?.message]).toEqual(['failed_precondition', 'cwd', 'cwd: /root: the guest refuses to enter it (in the guest)']);
    expect(cwdRefusal(Buffer.from(`\n${zero} cwd-missing\n`), zero, '/x')?.kind).toBe('not_found');
    expect(cwdRefusal(Buffer.from(`\nff-exec-ffffffffffffffff cwd-missing\n`), zero, '/x')).toBeUndefined();
    expect(cwdRefusal(Buffer.from(`\n${zero} cwd-missing\nmore\n`), zero, '/x')).toBeUndefined();
    expect(cwdRefusal(Buffer.from(''), zero, '/x')).toBeUndefined();
  });
});

describe('leftStreams', () => {
  it('takesOffTheWrappersLastLineNamingWhatItLeft_onlyWithThisCallsNonce', () => {
    const zero = 'ff-exec-0123456789abcdef';
    expect(leftStreams(Buffer.from(`warning\n\n${zero} out err\n`), zero)).toEqual({ stderr: Buffer.from('warning\n'), left: ['stdout', 'stderr'] });
    expect(leftStreams(Buffer.from(`\n${zero} out\n`), zero)).toEqual({ stderr: Buffer.alloc(0), left: ['stdout'] });
    // A program that writes such a line with another nonce (or none) keeps its stderr as it is.
    const fake = Buffer.from('x\nff-exec-ffffffffffffffff out\n');
    expect(leftStreams(fake, zero)).toEqual({ stderr: fake, left: [] });
    expect(leftStreams(Buffer.from('plain\n'), zero)).toEqual({ stderr: Buffer.from('plain\n'), left: [] });
  });
});
