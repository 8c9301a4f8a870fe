// GuestAgentClient against a fake qemu-ga on a unix socket that misbehaves as a tenant's guest
// may: the guest is untrusted, the agent's memory is every tenant's.
import { afterEach, describe, expect, it, vi } from 'vitest';
import { createServer } from 'node:net';
import type { Server, Socket } from 'node:net';
import { spawn, spawnSync } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import { closeSync, mkdtempSync, openSync, readFileSync, readSync, readdirSync, rmSync } from 'node:fs';
import { constants, tmpdir } from 'node:os';
import { join } from 'node:path';
import { GuestAgentClient, MAX_PENDING_REPLY_BYTES, RESERVED_ENV_PREFIXES, cwdRefusal, leftStreams, pathError } from './client.ts';
import type { ExecTimings } from './client.ts';
import { ChannelClosedError, GuestAgentCommandError, GuestAgentTimeoutError } from '../../errors.ts';
import { env as apiEnv } from '../../../services/adapters/grpc/convert.ts';
import type { ForkfleetError } from '../../../proto/errors.ts';

interface FakeGuestOptions {
  /** Replaces the answer to guest-ping. */
  onPing?: (sock: Socket) => void;
  /**
   * Answers to other commands (in order, as qemu-ga answers: after `delayMs`, the ones before
   * it first); `raw` is written as it is, in place of the answer.
   */
  answer?: (req: { execute: string; arguments?: Record<string, unknown> }) => { delayMs?: number; reply?: unknown; error?: string; raw?: string } | undefined;
  /** Bytes each new connection's parser holds already (half a request a snapshot replayed). */
  seed?: string;
  /**
   * While true, requests (syncs too) are held unanswered, and answered in order once it is
   * false again: a paused guest's qemu-ga, or a starved one's.
   */
  silent?: () => boolean;
  /** Requests it reads and never answers (a lost one). */
  drop?: (req: { execute: string; arguments?: Record<string, unknown> }) => boolean;
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
    const handle = (req: { execute: string; arguments?: Record<string, unknown> }): void => {
      if (req.execute === 'guest-sync-delimited') send(0, Buffer.concat([Buffer.from([0xff]), Buffer.from(`${JSON.stringify({ return: req.arguments?.id })}\n`)]));
      else if (req.execute === 'guest-ping' && opts.onPing) opts.onPing(sock);
      else if (req.execute === 'guest-ping') send(0, '{"return": {}}\n');
      else {
        const a = opts.answer?.(req);
        if (a) send(a.delayMs ?? 0, a.raw ?? `${JSON.stringify(a.error !== undefined ? { error: { class: 'GenericError', desc: a.error } } : { return: a.reply })}\n`);
      }
    };
    const held: Array<Parameters<typeof handle>[0]> = [];
    let waking: ReturnType<typeof setInterval> | undefined;
    const hold = (req: Parameters<typeof handle>[0]): void => {
      held.push(req);
      waking ??= setInterval(() => {
        if (opts.silent?.() || sock.destroyed) return;
        clearInterval(waking);
        waking = undefined;
        for (const r of held.splice(0)) handle(r);
      }, 10);
    };
    sock.on('close', () => clearInterval(waking));
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
        if (opts.drop?.(req)) continue;
        if (opts.silent?.() || held.length) hold(req);
        else handle(req);
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

  it('command_whoseGuestWritesLinesThatAnswerNothing_timesOutOnItsDeadline_notAfterEachLine', async () => {
    // A line every 30 ms, never the answer: each read waiting afresh, the command never ended.
    const g = await fakeGuest((sock) => {
      const every = setInterval(() => void (sock.destroyed || sock.write('{}\n')), 30);
      sock.on('close', () => clearInterval(every));
      cleanups.push(() => clearInterval(every));
    });
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    await c.sync(5000);
    const started = Date.now();
    const r = await Promise.race([c.ping(300).then(() => 'answered', (e: unknown) => e), new Promise((r) => setTimeout(() => r('still waiting'), 3000))]);
    expect(r).toBeInstanceOf(GuestAgentTimeoutError);
    expect(Date.now() - started).toBeLessThan(2000);
  });

  it('answerLongerThanItsCommandMayHave_closesTheChannelBeforeItIsParsed_andTheNextCallConnectsAgain', async () => {
    let pings = 0;
    const g = await fakeGuest((sock) => void sock.write(pings++ === 0 ? `{"return": "${'A'.repeat(1 << 20)}"}\n` : '{"return": {}}\n'));
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    await expect(c.ping(5000)).rejects.toBeInstanceOf(ChannelClosedError);
    await c.ping(5000);
    expect(g.sockets).toHaveLength(2);
  });

  it('answerOfMoreJsonStructureThanQemuGasUnderTheCap_closesTheChannelBeforeItIsParsed_whileHonestAnswersGoThrough', async () => {
    // Deeply nested arrays (20 M of them blocked the event loop for seconds in JSON.parse), or
    // a flat array as long, each followed by a well-formed answer.
    const n = 1 << 20;
    const shapes = ['['.repeat(n) + ']'.repeat(n), `[${'0,'.repeat(n)}0]`, `{"return": ${'{"a":'.repeat(2000)}1${'}'.repeat(2000)}}`];
    let asked = 0;
    const g = await fakeGuest({
      answer: (req) => {
        if (req.execute === 'guest-file-open') return { reply: 7 };
        if (req.execute !== 'guest-exec-status') return undefined;
        const shape = shapes[asked++];
        return { raw: `${shape === undefined ? '' : `${shape}\n`}{"return": {"exited": false, "out-data": "${'QUFB'.repeat(1 << 18)}"}}\n` };
      },
    });
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    for (let i = 0; i < shapes.length; i++) {
      await expect(c.command('guest-exec-status', { pid: 1 }, 10_000)).rejects.toBeInstanceOf(ChannelClosedError);
      expect(await c.command('guest-file-open', { path: '/x', mode: 'r' }, 5000)).toBe(7);
    }
    expect(g.sockets).toHaveLength(1 + shapes.length);
    // An honest status with 1 MiB of output (a few structures, one long string).
    expect(await c.command('guest-exec-status', { pid: 1 }, 5000)).toMatchObject({ exited: false });
  }, 30_000);

  it('anHonestErrorRepeatingAPathOfManyQuotes_isTheCallersError_notAClosedChannel', async () => {
    // qemu-ga's refusal names the path, each quote in it escaped: no JSON structure.
    const g = await fakeGuest({ answer: (req) => (req.execute === 'guest-file-open' ? { error: `failed to open file '${String(req.arguments?.path)}' (mode: 'r'): No such file or directory` } : undefined) });
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    const path = '/tmp/' + Array.from({ length: 5 }, () => '"'.repeat(220)).join('/');
    const e = await c.readFile(path).then(() => undefined, (x: unknown) => x);
    expect(e).not.toBeInstanceOf(ChannelClosedError);
    expect(e).toMatchObject({ kind: 'not_found' });
    expect(g.sockets).toHaveLength(1);
  });

  it('readFile_whoseGuestAnswersMoreThanAskedFor_isRefused_whileAnHonestGuestsFileComesInPiecesOfAMiB', async () => {
    const content = randomBytes((5 << 20) / 2);
    let pos = 0;
    let path = '';
    const counts: number[] = [];
    const g = await fakeGuest({
      answer: (req) => {
        const a = req.arguments ?? {};
        if (req.execute === 'guest-file-open') {
          path = String(a.path);
          pos = 0;
          return { reply: 1 };
        }
        if (req.execute === 'guest-file-close') return { reply: {} };
        if (req.execute !== 'guest-file-read') return undefined;
        const count = a.count as number;
        counts.push(count);
        // The liar answers 1000 bytes more than asked for (its answer under the read's cap).
        const piece = path === '/liar' ? randomBytes(count + 1000) : content.subarray(pos, pos + count);
        pos += piece.length;
        return { reply: { count: piece.length, 'buf-b64': piece.toString('base64'), eof: pos >= content.length } };
      },
    });
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    expect((await c.readFile('/honest', {}, 10_000)).equals(content)).toBe(true);
    expect(Math.max(...counts)).toBe(1 << 20);
    await expect(c.readFile('/liar', { maxBytes: 10 }, 5000)).rejects.toBeInstanceOf(GuestAgentCommandError);
  }, 30_000);

  it('writeFileWithAMode_andReapOrphanExecs_haveTheGuestHandThemLittleOutput', async () => {
    const handed: string[] = [];
    const g = await fakeGuest({
      answer: (req) => {
        const a = req.arguments ?? {};
        if (req.execute === 'guest-file-open') return { reply: 1 };
        if (req.execute === 'guest-file-write') return { reply: { count: 2, eof: false } };
        if (req.execute === 'guest-file-close') return { reply: {} };
        if (req.execute === 'guest-exec') {
          // The wrapper's $1: the most of each stream it hands qemu-ga (EXEC_WRAPPER).
          handed.push((a.arg as string[])[3] ?? '');
          return { reply: { pid: 42 } };
        }
        if (req.execute === 'guest-exec-status') return { reply: { exited: true, exitcode: 0, 'out-data': Buffer.from('0\n').toString('base64') } };
        return undefined;
      },
    });
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    await c.writeFile('/x', Buffer.from('hi'), { mode: 0o755 });
    expect(await c.reapOrphanExecs()).toBe(0);
    expect(handed).toHaveLength(2);
    for (const h of handed) expect(Number(h)).toBeLessThanOrEqual(4096);
  });

  it('writeFile_intoAFullGuestFileSystem_rejectsResourceExhaustedNamingThePath_notRetryable', async () => {
    const g = await fakeGuest({
      answer: (req) => {
        if (req.execute === 'guest-file-open') return { reply: 1 };
        // qemu-ga's words for fwrite's ENOSPC (and fclose's: "failed to close handle: ...").
        if (req.execute === 'guest-file-write') return { error: 'failed to write to file: No space left on device' };
        if (req.execute === 'guest-file-close') return { reply: {} };
        return undefined;
      },
    });
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    const e = (await c.writeFile('/data/big.bin', Buffer.alloc(3 << 20)).catch((x: unknown) => x)) as ForkfleetError;
    expect([e.kind, e.field, e.retryable, e.message]).toEqual(['resource_exhausted', 'path', false, '/data/big.bin: the guest file system is full (in the guest)']);
  });

  it('exec_whoseStartIsAnsweredWithoutAPid_rejects_insteadOfAnsweringNotStartedOrPollingNoPid', async () => {
    const answers: unknown[] = [{}, null, { pid: 'x' }];
    const statuses: unknown[] = [];
    const g = await fakeGuest({
      answer: (req) => {
        if (req.execute === 'guest-exec') return { reply: answers.shift() };
        if (req.execute === 'guest-exec-status') statuses.push(req.arguments?.pid);
        return req.execute === 'guest-exec-status' ? { reply: { exited: true, exitcode: 0 } } : undefined;
      },
    });
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    for (let i = 0; i < 3; i++) await expect(c.exec({ path: '/bin/true', timeoutMs: 5000 })).rejects.toBeInstanceOf(GuestAgentCommandError);
    expect(statuses).toEqual([]);
  });
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

  /** A guest whose file and exec commands are answered after `delayMs`, each recorded as it arrives. */
  const fileGuest = async (delayMs: number): Promise<{ g: Awaited<ReturnType<typeof fakeGuest>>; seen: GuestRequest[] }> => {
    const seen: GuestRequest[] = [];
    const g = await fakeGuest({
      answer: (req) => {
        seen.push(req);
        if (req.execute === 'guest-file-open') return { delayMs, reply: 7 };
        if (req.execute === 'guest-file-write') return { delayMs, reply: { count: 1, eof: false } };
        if (req.execute === 'guest-exec') return { delayMs, reply: { pid: 9 } };
        if (req.execute === 'guest-exec-status') return { delayMs, reply: { exited: true, exitcode: 0 } };
        return { delayMs, reply: {} };
      },
    });
    guests.push(g);
    return { g, seen };
  };
  const whole = ['guest-file-open', 'guest-file-write', 'guest-file-close', 'guest-exec', 'guest-exec-status'];

  it('writeFile_duringASnapshotHold_isNeverSplit_aHoldAskedForAfterItsTruncatingOpenWasSent_isGrantedOnlyOnceTheWriteAndItsChmodHaveEnded', async () => {
    const { g, seen } = await fileGuest(50);
    const c = await GuestAgentClient.connect(g.path);
    try {
      const w = c.writeFile('/etc/app.conf', Buffer.from('new contents'), { mode: 0o600 });
      await vi.waitFor(() => expect(seen.map((r) => r.execute)).toEqual(['guest-file-open']), { interval: 1 });
      const release = await c.hold();
      // What a snapshot taken now would have of the write: all of it (none is no longer possible: the open went first).
      const atHold = seen.map((r) => r.execute);
      release();
      await w;
      expect(atHold).toEqual(whole);
      expect(seen[3]?.arguments).toMatchObject({ arg: expect.arrayContaining(['/bin/chmod', '600', '/etc/app.conf']) as unknown });
    } finally {
      c.close();
    }
  });

  it('writeFile_askedForWhileAHoldIsHeld_sendsNothingUntilItsRelease_isNotSplitByASnapshotAskedForRightThen_andCompletesWithoutTimingOut', async () => {
    const { g, seen } = await fileGuest(20);
    const c = await GuestAgentClient.connect(g.path);
    try {
      const release = await c.hold();
      // Its timeout is shorter than the hold: waiting for the release does not count.
      const w = c.writeFile('/etc/app.conf', Buffer.from('new contents'), {}, 100);
      await new Promise((r) => setTimeout(r, 300));
      expect(seen).toEqual([]);
      // A second snapshot right after the first (a template, then another): it too has none or all of the write.
      release();
      const releaseNext = await c.hold();
      const atNextHold = seen.map((r) => r.execute);
      releaseNext();
      expect([[], whole.slice(0, 3)]).toContainEqual(atNextHold);
      await w;
      expect(seen.map((r) => r.execute)).toEqual(whole.slice(0, 3));
      expect(Buffer.from(seen[1]?.arguments?.['buf-b64'] as string, 'base64').toString()).toBe('new contents');
    } finally {
      c.close();
    }
  });

  it('hold_waitingForAWriteTheGuestLeavesUnanswered_isGrantedOnceItsCallerClosesTheChannel_andTheWriteFails', async () => {
    // What the driver does past HOLD_WAIT_MS: closes the channel rather than wait on.
    const seen: string[] = [];
    const g = await fakeGuest({ answer: (req) => (seen.push(req.execute), req.execute === 'guest-file-open' ? { reply: 7 } : undefined) });
    guests.push(g);
    const c = await GuestAgentClient.connect(g.path);
    const w = c.writeFile('/etc/app.conf', Buffer.from('new contents'), {}, 60_000);
    const failed = w.then(
      () => undefined,
      (e: unknown) => e,
    );
    await vi.waitFor(() => expect(seen).toEqual(['guest-file-open', 'guest-file-write']), { interval: 1 });
    const holding = c.hold();
    const early = await Promise.race([holding.then(() => 'granted'), new Promise((r) => setTimeout(() => r('waiting'), 200))]);
    expect(early).toBe('waiting');
    c.close();
    const release = await holding;
    release();
    expect(await failed).toBeInstanceOf(ChannelClosedError);
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

  it('aFullGuestFileSystem_andEveryOtherRefusalOfThePath_isNotRetryable_onlyAGuestShortOfAResourceForAMomentIs', () => {
    const refused = (desc: string) => pathError('/x/y', new GuestAgentCommandError('guest-file-write', `GenericError: failed to write to file: ${desc}`)) as ForkfleetError;
    // resource_exhausted is retryable by default (no capacity now may be capacity later); a full
    // guest disk stays full until someone frees space in it.
    const full = refused('No space left on device');
    expect([full.kind, full.retryable, full.field]).toEqual(['resource_exhausted', false, 'path']);
    expect(refused('Disk quota exceeded').retryable).toBe(false);
    for (const desc of ['No such file or directory', 'Not a directory', 'Is a directory', 'Permission denied', 'File name too long', 'Too many levels of symbolic links', 'File too large', 'Text file busy', 'No such device', 'Invalid argument']) {
      expect([desc, refused(desc).retryable]).toEqual([desc, false]);
    }
    expect(refused('Cannot allocate memory').retryable).toBe(true);
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

type GuestRequest = { execute: string; arguments?: Record<string, unknown> };

interface ShellGuestOptions {
  /** qemu-ga's environment for a request that gives none (default: this process's). */
  env?: NodeJS.ProcessEnv;
  /**
   * For a guest-exec whose arguments it returns something for: runs that (the arguments, or
   * others in their place) and never answers the request (an answer lost).
   */
  lose?: (arg: string[]) => string[] | undefined;
}

/**
 * A qemu-ga 7.2 whose guest is this machine: guest-exec runs the program here (`/bin/sh` as
 * `shell`: dash, or busybox's), with qemu-ga's environment (this process's, whose initial one
 * is what /proc/$PPID/environ shows its programs) unless the request gives one, which replaces
 * it as qemu-ga's does; a captured program is reported exited once it has exited and its pipes
 * have closed, with its exit status or the signal that ended it. guest-file-* read real files.
 * `log` holds every request; `handed` the most of each stream one status answer handed over
 * (decoded bytes); `started` the pids it started. Closed, it kills the process groups it
 * started that still run a second on (a test that fails leaves nothing running).
 */
async function shellGuest(shell: string[], o: ShellGuestOptions = {}): Promise<Awaited<ReturnType<typeof fakeGuest>> & { log: GuestRequest[]; handed: () => { stdout: number; stderr: number }; started: number[]; recorded: (pid: number) => boolean }> {
  const log: GuestRequest[] = [];
  const started: number[] = [];
  const alive = new Set<number>();
  const runs = new Map<number, { done: boolean; code: number | null; signal: NodeJS.Signals | null; out: Buffer[]; err: Buffer[] }>();
  const files = new Map<number, { fd: number; pos: number }>();
  let handles = 1;
  const handed = { stdout: 0, stderr: 0 };
  const g = await fakeGuest({
    answer: (req) => {
      log.push(req);
      const a = req.arguments ?? {};
      if (req.execute === 'guest-exec') {
        const given = (a.arg as string[] | undefined) ?? [];
        const lost = o.lose?.(given);
        const arg = lost ?? given;
        const [cmd, ...rest] = a.path === '/bin/sh' ? [...shell, ...arg] : [a.path as string, ...arg];
        const env = a.env ? Object.fromEntries((a.env as string[]).map((e) => [e.slice(0, e.indexOf('=')), e.slice(e.indexOf('=') + 1)])) : (o.env ?? process.env);
        const capture = a['capture-output'] === true;
        const input = a['input-data'] as string | undefined;
        const child = spawn(cmd!, rest, { env, detached: true, stdio: [input ? 'pipe' : 'ignore', capture ? 'pipe' : 'ignore', capture ? 'pipe' : 'ignore'] });
        started.push(child.pid!);
        alive.add(child.pid!);
        child.on('exit', () => alive.delete(child.pid!));
        const run = { done: false, code: null as number | null, signal: null as NodeJS.Signals | null, out: [] as Buffer[], err: [] as Buffer[] };
        child.stdout?.on('data', (d: Buffer) => run.out.push(d));
        child.stderr?.on('data', (d: Buffer) => run.err.push(d));
        if (input) child.stdin?.end(Buffer.from(input, 'base64'));
        child.on('close', (code, signal) => Object.assign(run, { done: true, code, signal }));
        runs.set(child.pid!, run);
        return lost ? undefined : { reply: { pid: child.pid } };
      }
      if (req.execute === 'guest-exec-status') {
        const run = runs.get(a.pid as number);
        if (!run) return { error: `Invalid parameter 'pid'` };
        if (!run.done) return { reply: { exited: false } };
        runs.delete(a.pid as number);
        const out = Buffer.concat(run.out);
        const err = Buffer.concat(run.err);
        handed.stdout = Math.max(handed.stdout, out.length);
        handed.stderr = Math.max(handed.stderr, err.length);
        return { reply: { exited: true, ...(run.signal ? { signal: constants.signals[run.signal] } : { exitcode: run.code }), 'out-data': out.toString('base64'), 'err-data': err.toString('base64') } };
      }
      if (req.execute === 'guest-file-open') {
        try {
          const h = handles++;
          files.set(h, { fd: openSync(a.path as string, 'r'), pos: 0 });
          return { reply: h };
        } catch (e) {
          return { error: `failed to open file '${String(a.path)}': ${(e as Error).message}` };
        }
      }
      const f = files.get(a.handle as number);
      if (!f) return req.execute.startsWith('guest-file-') ? { error: 'invalid handle' } : undefined;
      if (req.execute === 'guest-file-seek') {
        f.pos = a.offset as number;
        return { reply: { position: f.pos, eof: false } };
      }
      if (req.execute === 'guest-file-read') {
        const buf = Buffer.alloc(a.count as number);
        const n = readSync(f.fd, buf, 0, buf.length, f.pos);
        f.pos += n;
        return { reply: { count: n, 'buf-b64': buf.subarray(0, n).toString('base64'), eof: n < buf.length } };
      }
      if (req.execute === 'guest-file-close') {
        closeSync(f.fd);
        files.delete(a.handle as number);
        return { reply: {} };
      }
      return undefined;
    },
  });
  const close = async (): Promise<void> => {
    // What is still running a second on (a helper's rm takes milliseconds) is a test's leftover.
    for (const end = Date.now() + 1000; alive.size && Date.now() < end; ) await new Promise((r) => setTimeout(r, 20));
    for (const pid of alive) {
      try {
        process.kill(-pid, 'SIGKILL');
      } catch {
        // gone
      }
    }
    await g.close();
  };
  return { ...g, close, log, handed: () => ({ ...handed }), started, recorded: (pid) => runs.has(pid) };
}

const busybox = spawnSync('busybox', ['sh', '-c', 'exit 0']).status === 0;
const shells: Array<[string, string[]]> = [['dash (/bin/sh)', ['/bin/sh']], ...(busybox ? [['busybox sh', ['busybox', 'sh']] as [string, string[]]] : [])];

describe.each(shells)('GuestAgentClient.exec, the wrapper under %s', (_name, shell) => {
  const cleanups: Array<() => Promise<void> | void> = [];
  afterEach(async () => {
    for (const c of cleanups.splice(0)) await c();
  });
  const connect = async (o: ShellGuestOptions & { timing?: Partial<ExecTimings> } = {}): Promise<{ c: GuestAgentClient; g: Awaited<ReturnType<typeof shellGuest>> }> => {
    const g = await shellGuest(shell, o);
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path, 5000, undefined, o.timing);
    cleanups.push(() => c.close());
    return { c, g };
  };

  it('exec_ofAProgramEndedByASignal_reportsThatSignal_notExit128PlusIt_withoutTheShellsNoteInItsStderr_whileANormalExitKeepsItsStatus', async () => {
    const { c } = await connect();
    const term = await c.exec({ path: '/bin/sh', args: ['-c', 'echo out; echo err >&2; kill -TERM $$'] });
    expect(term).toMatchObject({ exitCode: -1, signal: 15 });
    expect([term.stdout.toString(), term.stderr.toString()]).toEqual(['out\n', 'err\n']);
    const three = await c.exec({ path: '/bin/sh', args: ['-c', 'echo err >&2; exit 3'] });
    expect(three).toMatchObject({ exitCode: 3, signal: null });
    expect(three.stderr.toString()).toBe('err\n');
    // Killed at its timeout: signal 9, and only what the program wrote (no "Killed").
    const slow = await c.exec({ path: '/bin/sh', args: ['-c', 'printf abc >&2; exec sleep 30'], timeoutMs: 300 });
    expect(slow).toMatchObject({ timedOut: true, exitCode: -1, signal: 9 });
    expect(slow.stderr.toString()).toBe('abc');
  });

  it('reapOrphanExecs_endsTheExecsAnotherAgentInstanceLeft_whateverTmpdirTheirCallerGave_andNotItsOwn', async () => {
    // An exec with TMPDIR keeps its files there: found by its files in /tmp, it ran on,
    // unsupervised, in every sandbox restored from a snapshot taken while it ran.
    const g = await shellGuest(shell);
    cleanups.push(g.close);
    const dir = mkdtempSync(join(tmpdir(), 'ff-reap-'));
    cleanups.push(() => rmSync(dir, { recursive: true, force: true }));
    const late = (n: string): string[] => ['-c', `sleep 2; echo late > ${join(dir, n)}`];
    const before = await GuestAgentClient.connect(g.path, 5000, 'aaaa');
    cleanups.push(() => before.close());
    const now = await GuestAgentClient.connect(g.path, 5000, 'bbbb');
    cleanups.push(() => now.close());
    const runs = [
      before.exec({ path: '/bin/sh', args: late('default-tmp'), timeoutMs: 30_000 }),
      before.exec({ path: '/bin/sh', args: late('own-tmp'), env: [`TMPDIR=${dir}`], timeoutMs: 30_000 }),
      now.exec({ path: '/bin/sh', args: late('mine'), timeoutMs: 30_000 }),
    ].map((p) => p.catch(() => undefined));
    await vi.waitFor(() => expect(g.started).toHaveLength(3));
    expect(await now.reapOrphanExecs()).toBe(2);
    await Promise.all(runs);
    expect(readdirSync(dir).filter((f) => !f.startsWith('.ff-exec-')).sort()).toEqual(['mine']);
  });

  it('exec_withoutVariablesOrWithNone_runsInTheGuestsEnvironment_andGivenVariablesAreAddedToIt_withoutBreakingTheWrapper', async () => {
    const { c } = await connect();
    const show = ['-c', 'printf "%s|%s|%s" "$HOME" "$FOO" "$PATH"'];
    const inherited = `${process.env.HOME}||${process.env.PATH}`;
    expect((await c.exec({ path: '/bin/sh', args: show })).stdout.toString()).toBe(inherited);
    // What the agent sends for an API exec without env: the guest's own, not an empty one.
    expect((await c.exec({ path: '/bin/sh', args: show, env: [] })).stdout.toString()).toBe(inherited);
    expect((await c.exec({ path: '/bin/sh', args: show, env: ['FOO=a b $x'] })).stdout.toString()).toBe(`${process.env.HOME}|a b $x|${process.env.PATH}`);
    // A PATH of the caller's is the program's; the wrapper still copies its output (wc, cat) out.
    const own = await c.exec({ path: '/bin/sh', args: show, env: ['PATH=/nowhere'] });
    expect([own.exitCode, own.stdout.toString(), own.stderr.toString()]).toEqual([0, `${process.env.HOME}||/nowhere`, '']);
    // Without capture too.
    const dir = mkdtempSync(join(tmpdir(), 'ff-env-'));
    cleanups.push(() => rmSync(dir, { recursive: true, force: true }));
    const r = await c.exec({ path: '/bin/sh', args: ['-c', 'printf "%s|%s" "$HOME" "$FOO" > out; exit 4'], env: ['FOO=1'], cwd: dir, captureOutput: false });
    expect(r.exitCode).toBe(4);
    expect(spawnSync('cat', [join(dir, 'out')]).stdout.toString()).toBe(`${process.env.HOME}|1`);
  });

  it('exec_whoseCallerWantsLittleOutput_isHandedNoMoreThanThatByTheGuest_andSaysTruncated', async () => {
    const { c, g } = await connect();
    const r = await c.exec({ path: '/bin/sh', args: ['-c', 'head -c 3000000 /dev/zero | tr "\\000" a; head -c 5000 /dev/zero >&2; exit 1'], maxOutputBytes: 100 } as Parameters<GuestAgentClient['exec']>[0]);
    expect(r).toMatchObject({ exitCode: 1, outputTruncated: true });
    expect([r.stdout.toString(), r.stderr.length]).toEqual(['a'.repeat(100), 100]);
    // The guest copied out no more either (stderr: and the wrapper's line naming what it left).
    expect(g.handed().stdout).toBe(100);
    expect(g.handed().stderr).toBeLessThan(200);
  });

  it('exec_withLiveOutputPastTheCap_passesNoMoreThanTheCapOfEachStream_andSaysTruncated', async () => {
    const { c, g } = await connect();
    const passed = { stdout: 0, stderr: 0 };
    const cap = 3 << 20;
    // 5 MiB at once, then a wait: read live (1 MiB a read), past the cap.
    const r = await c.exec({ path: '/bin/sh', args: ['-c', 'head -c 5242880 /dev/zero; head -c 10 /dev/zero >&2; sleep 2'], onOutput: (s, d) => void (passed[s] += d.length), maxOutputBytes: cap } as Parameters<GuestAgentClient['exec']>[0]);
    expect(r).toMatchObject({ exitCode: 0, outputTruncated: true });
    expect(passed).toEqual({ stdout: cap, stderr: 10 });
    // Every read asked for something: none past the cap, none for a negative count.
    const counts = g.log.filter((q) => q.execute === 'guest-file-read').map((q) => q.arguments?.count as number);
    expect(counts.length).toBeGreaterThan(0);
    expect(Math.min(...counts)).toBeGreaterThan(0);
  });

  it('exec_withASecretInItsVariables_neverPutsItInACommandLine_andTheProgramSeesItBesideTheGuestsPathAndHome', async () => {
    const { c, g } = await connect();
    const secret = `s3cret-${randomBytes(8).toString('hex')}`;
    const cmdlines: string[] = [];
    let running = true;
    // What `ps` shows any guest user, all along the program's run: every process's command line.
    const watch = (async () => {
      while (running) {
        for (const d of readdirSync('/proc').filter((x) => /^\d+$/.test(x))) {
          try {
            cmdlines.push(readFileSync(`/proc/${d}/cmdline`, 'latin1'));
          } catch {
            // gone
          }
        }
        await new Promise((r) => setTimeout(r, 50));
      }
    })();
    const show = ['-c', 'sleep 0.6; printf "%s|%s|%s|%s" "$API_KEY" "${FFE_API_KEY-none}" "$HOME" "$PATH"'];
    const r = await c.exec({ path: '/bin/sh', args: show, env: ['API_KEY=' + secret] });
    const dir = mkdtempSync(join(tmpdir(), 'ff-env-'));
    cleanups.push(() => rmSync(dir, { recursive: true, force: true }));
    const direct = await c.exec({ path: '/bin/sh', args: ['-c', 'sleep 0.6; printf "%s|%s" "$API_KEY" "$HOME" > out'], env: ['API_KEY=' + secret], cwd: dir, captureOutput: false });
    running = false;
    await watch;
    expect([r.exitCode, r.stdout.toString(), r.stderr.toString()]).toEqual([0, `${secret}|none|${process.env.HOME}|${process.env.PATH}`, '']);
    expect([direct.exitCode, readFileSync(join(dir, 'out'), 'utf8')]).toEqual([0, `${secret}|${process.env.HOME}`]);
    // The wrapper was seen running (its nonce's line), and no command line ever held the secret.
    expect(cmdlines.some((l) => l.includes('# ff-exec-wrapper-end'))).toBe(true);
    expect(cmdlines.filter((l) => l.includes(secret))).toEqual([]);
    // Nor any argument the guest was given: only qemu-ga's env carries it.
    const starts = g.log.filter((q) => q.execute === 'guest-exec');
    expect(starts.filter((q) => JSON.stringify(q.arguments?.arg).includes(secret))).toEqual([]);
    expect(starts.slice(0, 2).map((q) => q.arguments?.env)).toEqual([[`FFE_API_KEY=${secret}`], [`FFE_API_KEY=${secret}`]]);
  });

  it('exec_withVariablesNamedAsTheWrappersOwnOnceWere_givesEachToTheProgram_andTheWrapperWorksAsWithout', async () => {
    const { c } = await connect();
    const names = ['n', 'f', 'c', 'h', 't', 'i', 'a', 'r', 'k'];
    const env = names.map((x) => `${x}=${x === 'n' ? '7' : x === 'f' ? '/nonexistent/x' : x === 'h' ? '1' : `v-${x}`}`);
    const print = names.map((x) => `"$${x}"`).join(' ');
    const r = await c.exec({ path: '/bin/sh', args: ['-c', `printf '%s,' ${print}; echo err >&2; exit 3`], env });
    expect([r.exitCode, r.stdout.toString(), r.stderr.toString()]).toEqual([3, '7,/nonexistent/x,v-c,1,v-t,v-i,v-a,v-r,v-k,', 'err\n']);
    // Without capture (EXEC_DIRECT's own were c and n), in a directory.
    const dir = mkdtempSync(join(tmpdir(), 'ff-env-'));
    cleanups.push(() => rmSync(dir, { recursive: true, force: true }));
    const d = await c.exec({ path: '/bin/sh', args: ['-c', `printf '%s,' ${print} > out`], env, cwd: dir, captureOutput: false });
    expect([d.exitCode, readFileSync(join(dir, 'out'), 'utf8')]).toEqual([0, '7,/nonexistent/x,v-c,1,v-t,v-i,v-a,v-r,v-k,']);
  });

  it('exec_whoseTmpdirCannotBeWritten_runsTheProgramDirectly_insteadOfEndingTheWrapper', async () => {
    const { c } = await connect();
    const r = await c.exec({ path: '/bin/sh', args: ['-c', 'echo out; echo err >&2; printf "%s" "$TMPDIR"; exit 4'], env: ['TMPDIR=/nonexistent'] });
    expect([r.exitCode, r.stdout.toString(), r.stderr.toString()]).toEqual([4, 'out\n/nonexistent', 'err\n']);
  });

  it('exec_withoutACallersTmpdir_keepsItsFilesInTmp_notInQemuGasTmpdir_whereTheHostReadsWhatWasLeft', async () => {
    // qemu-ga's own TMPDIR elsewhere: the host reads what the wrapper left in /tmp (wrapperDir).
    const qgaTmp = mkdtempSync(join(tmpdir(), 'ff-qga-tmp-'));
    cleanups.push(() => rmSync(qgaTmp, { recursive: true, force: true }));
    const { c } = await connect({ env: { ...process.env, TMPDIR: qgaTmp } });
    // 1.5 MiB: past what the wrapper hands qemu-ga (EXEC_HANDED_BYTES), the rest left in a file.
    const r = await c.exec({ path: '/bin/sh', args: ['-c', 'head -c 1572864 /dev/zero; printf "%s" "$TMPDIR" >&2'] });
    expect([r.exitCode, r.stdout.length, r.outputTruncated, r.stderr.toString()]).toEqual([0, 1572864, undefined, qgaTmp]);
    expect(readdirSync(qgaTmp)).toEqual([]);
  });

  it('exec_whoseProgramStopsTheWrapper_isKilledAtItsDeadline_andAnswered_theWrapperContinued', async () => {
    const { c, g } = await connect({ timing: { killGraceMs: 1500 } });
    const r = await c.exec({ path: '/bin/sh', args: ['-c', 'echo started; kill -STOP $PPID; exec sleep 30'], timeoutMs: 300 });
    expect(r).toMatchObject({ timedOut: true, signal: 9 });
    expect(r.stdout.toString()).toBe('started\n');
    expect(g.recorded(g.started[0]!)).toBe(false);
  });

  it('exec_givenAVariableWithAReservedName_isRefused_namingTheEntry', async () => {
    const { c, g } = await connect();
    for (const p of RESERVED_ENV_PREFIXES) {
      await expect(c.exec({ path: '/bin/true', env: ['A=1', `${p}n=1`] })).rejects.toMatchObject({ kind: 'invalid_argument', field: `env["${p}n"]` });
    }
    expect(g.log.filter((q) => q.execute === 'guest-exec')).toEqual([]);
  });

  it('exec_whoseStartIsNeverAnswered_findsTheWrapperByItsNonce_notItsForksWithTheSameCommandLine_andTakesItsRecord', async () => {
    // The start is run but not answered; in the wrapper's place, a shell with its command line
    // whose subshell (a fork that runs on, with that same command line) outlives the search.
    const { c, g } = await connect({
      timing: { startMinMs: 300, pollTimeoutMs: 1000, killAgainMs: 100, endLaterMaxWaitMs: 200 },
      lose: (arg) => (arg[1]?.endsWith('# ff-exec-wrapper-end') ? ['-c', '( sleep 30; : )\n# ff-exec-wrapper-end', ...arg.slice(2)] : undefined),
    });
    await expect(c.exec({ path: '/bin/sleep', args: ['30'], timeoutMs: 100 })).rejects.toBeInstanceOf(GuestAgentTimeoutError);
    const wrapper = g.started[0]!;
    const deadline = Date.now() + 10_000;
    while (g.recorded(wrapper) && Date.now() < deadline) await new Promise((r) => setTimeout(r, 50));
    // Ended, its record taken, and no status asked of a pid qemu-ga never started.
    expect(g.recorded(wrapper)).toBe(false);
    const asked = g.log.filter((q) => q.execute === 'guest-exec-status').map((q) => q.arguments?.pid as number);
    expect(asked).toContain(wrapper);
    expect(asked.filter((p) => !g.started.includes(p))).toEqual([]);
  });
});

describe('GuestAgentClient.exec when the guest does not answer, or the caller cancels', () => {
  const cleanups: Array<() => Promise<void> | void> = [];
  afterEach(async () => {
    for (const c of cleanups.splice(0)) await c();
  });
  const timing = { startMinMs: 600, pollTimeoutMs: 200, killGraceMs: 300, killAgainMs: 100, endLaterMaxWaitMs: 200 };
  const until = async (ok: () => boolean, ms = 5000): Promise<void> => {
    const end = Date.now() + ms;
    while (!ok()) {
      if (Date.now() > end) throw new Error('condition not met in time');
      await new Promise((r) => setTimeout(r, 20));
    }
  };
  /**
   * A guest that runs one program, pid 42, until it is killed (ff-kill; never, if `immortal`),
   * and the kills and other execs it was sent. Each kill is a helper with a pid of its own
   * (1000 on), whose record qemu-ga keeps (`records`) until its status is asked for; pids in
   * `unknown` are refused as qemu-ga refuses a pid it does not know; pids in `slow` run on, and
   * each status of one is answered after 300 ms.
   */
  const programGuest = async (o: { silent?: () => boolean; drop?: FakeGuestOptions['drop']; found?: string; foundStderr?: string; unknown?: number[]; slow?: number[]; immortal?: boolean; timing?: Partial<ExecTimings>; log?: Parameters<typeof GuestAgentClient.connect>[4] } = {}) => {
    const kills: string[] = [];
    const execs: string[][] = [];
    const records = new Set<number>();
    const statuses: number[] = [];
    let helper = 1000;
    let killed = false;
    const g = await fakeGuest({
      silent: o.silent,
      drop: o.drop,
      answer: (req) => {
        if (req.execute === 'guest-exec') {
          const arg = (req.arguments?.arg as string[] | undefined) ?? [];
          execs.push(arg);
          if (arg[2] === 'ff-kill') {
            kills.push(arg[3] ?? '');
            killed = !o.immortal;
            records.add(helper);
            return { reply: { pid: helper++ } };
          }
          if (arg[2] === 'ff-end') return { reply: { pid: 60 } };
          return { reply: { pid: 42 } };
        }
        if (req.execute === 'guest-exec-status') {
          const pid = req.arguments?.pid as number;
          statuses.push(pid);
          if (o.unknown?.includes(pid)) return { error: "Invalid parameter 'pid'" };
          if (o.slow?.includes(pid)) return { delayMs: 300, reply: { exited: false } };
          if (records.delete(pid)) return { reply: { exited: true, exitcode: 0 } };
          if (pid === 60) return { reply: { exited: true, exitcode: 0, 'out-data': Buffer.from(o.found ?? '').toString('base64'), ...(o.foundStderr ? { 'err-data': Buffer.from(o.foundStderr).toString('base64') } : {}) } };
          return { reply: pid === 42 && !killed ? { exited: false } : { exited: true, signal: 9 } };
        }
        return undefined;
      },
    });
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path, 5000, undefined, { ...timing, ...o.timing }, o.log);
    cleanups.push(() => c.close());
    await c.sync(1000);
    return { c, kills, execs, records, statuses };
  };

  it('exec_whoseStatusPollsGoUnanswered_keepsSupervisingIt_andKillsItAtItsDeadline_beforeAnsweringTimedOut', async () => {
    let polls = 0;
    // The second and third polls are never answered (each waits out its timeout).
    const { c, kills } = await programGuest({ drop: (req) => req.execute === 'guest-exec-status' && req.arguments?.pid === 42 && [2, 3].includes(++polls) });
    const r = await c.exec({ path: '/bin/sleep', args: ['600'], timeoutMs: 500 });
    expect(r).toMatchObject({ timedOut: true, signal: 9 });
    expect(kills[0]).toBe('42');
    expect(polls).toBeGreaterThan(3);
  });

  it('exec_whoseGuestPausesLongerThanAPollWaits_isStillCancelled_andItsProgramKilled_onceTheGuestAnswersAgain', async () => {
    let silent = false;
    const { c, kills } = await programGuest({ silent: () => silent });
    const ac = new AbortController();
    const run = c.exec({ path: '/bin/sleep', args: ['600'], timeoutMs: 60_000, signal: ac.signal });
    await new Promise((r) => setTimeout(r, 50));
    silent = true; // PauseSandbox: several polls' timeouts
    await new Promise((r) => setTimeout(r, 700));
    ac.abort();
    silent = false;
    expect(await run).toMatchObject({ cancelled: true, signal: 9 });
    expect(kills[0]).toBe('42');
  });

  it('exec_whoseGuestStopsAnswering_rejectsOnlyAfterItsDeadlineAndAKill_sayingSo_andKillsTheProgramOnceTheGuestAnswersAgain', async () => {
    let silent = false;
    const { c, kills } = await programGuest({ silent: () => silent });
    const run = c.exec({ path: '/bin/sleep', args: ['600'], timeoutMs: 300 });
    await new Promise((r) => setTimeout(r, 50));
    silent = true;
    const started = Date.now();
    await expect(run).rejects.toThrow(/timed out and killed .*has not answered/);
    expect(Date.now() - started).toBeGreaterThanOrEqual(250);
    expect(kills).toEqual([]); // nothing got through
    silent = false;
    await until(() => kills.includes('42'));
  });

  it('exec_cancelledBeforeItsStartIsSent_doesNotStartTheProgram_evenWhenItWaitedForTheChannel', async () => {
    const g = await fakeGuest({
      answer: (req) =>
        req.execute === 'guest-exec' ? { reply: { pid: 42 } } : req.execute === 'guest-exec-status' ? { reply: { exited: true, exitcode: 0 } } : req.execute === 'guest-file-open' ? { delayMs: 300, reply: 1 } : undefined,
    });
    cleanups.push(g.close);
    const execs: string[] = [];
    const c = await GuestAgentClient.connect(g.path);
    cleanups.push(() => c.close());
    await c.sync(1000);
    // Every start that reaches the guest.
    g.sockets[0]!.on('data', (d: Buffer) => void (d.includes('"guest-exec"') && execs.push(d.toString())));
    const gone = new AbortController();
    gone.abort();
    expect(await c.exec({ path: '/bin/touch', args: ['/tmp/x'], signal: gone.signal })).toMatchObject({ cancelled: true, exitCode: -1 });
    // Queued behind a slow command, cancelled while it waits.
    const slow = c.command('guest-file-open', { path: '/slow', mode: 'r' }, 5000);
    const ac = new AbortController();
    const run = c.exec({ path: '/bin/touch', args: ['/tmp/x'], signal: ac.signal });
    setTimeout(() => ac.abort(), 100);
    expect(await run).toMatchObject({ cancelled: true, exitCode: -1 });
    await slow;
    await c.ping(1000);
    expect(execs).toEqual([]);
  });

  it('exec_cancelledWhileTheGuestDoesNotAnswerItsStart_answersCancelledPromptly_andKillsWhatTheStartStartedOnceTheGuestAnswers', async () => {
    let silent = false;
    const { c, kills } = await programGuest({ silent: () => silent });
    silent = true;
    const ac = new AbortController();
    const started = Date.now();
    const run = c.exec({ path: '/bin/sleep', args: ['600'], timeoutMs: 60_000, signal: ac.signal });
    setTimeout(() => ac.abort(), 100);
    expect(await run).toMatchObject({ cancelled: true, exitCode: -1 });
    expect(Date.now() - started).toBeLessThan(2000);
    expect(kills).toEqual([]);
    // The guest runs the start and answers it late: what it started is killed then.
    silent = false;
    await until(() => kills.includes('42'));
  });

  it('exec_whoseStartIsNotAnsweredInTime_rejects_andWhatItStartsOnceTheGuestAnswersIsFoundByItsNonceAndKilled', async () => {
    let silent = false;
    const { c, kills, execs } = await programGuest({ silent: () => silent, found: '42\n' });
    silent = true;
    await expect(c.exec({ path: '/bin/sleep', args: ['600'], timeoutMs: 100 })).rejects.toBeInstanceOf(GuestAgentTimeoutError);
    silent = false;
    await until(() => kills.includes('42'));
    // Found by the $0 of the start that was never answered, as a wrapper's (EXEC_END_NAMED).
    const zero = execs.find((a) => a[1]?.endsWith('# ff-exec-wrapper-end'))?.[2];
    expect(zero).toMatch(/^ff-exec-/);
    expect(execs.find((a) => a[2] === 'ff-end')?.[3]).toBe(zero);
  });
  it('endLater_givenPidsOfWhichQemuGaKnowsOnlySome_dropsTheUnknownOnes_andStillKillsTheWrapper', async () => {
    let silent = false;
    // The search names a pid qemu-ga refuses (77) before the wrapper's.
    const { c, kills, statuses } = await programGuest({ silent: () => silent, found: '77\n42\n', unknown: [77] });
    silent = true;
    await expect(c.exec({ path: '/bin/sleep', args: ['600'], timeoutMs: 100 })).rejects.toBeInstanceOf(GuestAgentTimeoutError);
    silent = false;
    await until(() => kills.includes('42'));
    await until(() => statuses.filter((p) => p === 42).length >= 2); // and its end seen
    expect(statuses.filter((p) => p === 77)).toHaveLength(1);
  });

  it('endLater_givenASearchThatNamesManyWrappers_pollsAndKillsOnlyAFew', async () => {
    let silent = false;
    // The search (a guest's to answer) names the wrapper and 100 more.
    const others = Array.from({ length: 100 }, (_, i) => 5000 + i);
    const { c, kills, statuses } = await programGuest({ silent: () => silent, found: ['42', ...others].join('\n'), unknown: others });
    silent = true;
    await expect(c.exec({ path: '/bin/sleep', args: ['600'], timeoutMs: 100 })).rejects.toBeInstanceOf(GuestAgentTimeoutError);
    silent = false;
    await until(() => kills.includes('42'));
    await until(() => statuses.filter((p) => p === 42).length >= 2); // a second try: the first is over
    expect(new Set(statuses.filter((p) => others.includes(p))).size).toBeLessThanOrEqual(3);
  });

  it('endLater_whoseWrapperSearchPrintsMuchStderr_stillKillsTheWrapper', async () => {
    let silent = false;
    // Processes gone mid-scan (a busy guest) each add a line of stderr to the search's status.
    const stderr = 'ff-end: cannot open /proc/12345/cmdline: No such file\n'.repeat(1500);
    const { c, kills } = await programGuest({ silent: () => silent, found: '42\n', foundStderr: stderr });
    silent = true;
    await expect(c.exec({ path: '/bin/sleep', args: ['600'], timeoutMs: 100 })).rejects.toBeInstanceOf(GuestAgentTimeoutError);
    silent = false;
    await until(() => kills.includes('42'));
  });

  it('endLater_whoseGuestAnswersEachStatusJustInTime_stopsAtItsBound_withinATry', async () => {
    const warned: unknown[] = [];
    const log = { warn: (obj: unknown) => void warned.push(obj) } as unknown as Parameters<typeof GuestAgentClient.connect>[4];
    let silent = false;
    const slow = [5000, 5001, 5002, 5003];
    const { c, statuses } = await programGuest({ silent: () => silent, found: slow.join('\n'), slow, timing: { endLaterGiveUpMs: 200, pollTimeoutMs: 1000 }, log });
    silent = true;
    await expect(c.exec({ path: '/bin/sleep', args: ['600'], timeoutMs: 100 })).rejects.toBeInstanceOf(GuestAgentTimeoutError);
    silent = false;
    await until(() => warned.length > 0);
    // Each status takes 300 ms: past its bound after the first, not after all four.
    expect(statuses.filter((p) => slow.includes(p)).length).toBeLessThanOrEqual(2);
  });

  it('exec_cancelledWhoseStartIsAnsweredLateWithoutAPid_answersCancelled_andLeavesNoUnhandledRejection', async () => {
    // An unhandled rejection ends the agent's process (Node 20), every sandbox's.
    const unhandled: unknown[] = [];
    const onUnhandled = (e: unknown): void => void unhandled.push(e);
    process.on('unhandledRejection', onUnhandled);
    cleanups.push(() => void process.off('unhandledRejection', onUnhandled));
    let answered = false;
    const g = await fakeGuest({
      answer: (req) => {
        if (req.execute !== 'guest-exec') return undefined;
        setTimeout(() => (answered = true), 500);
        return { delayMs: 400, reply: null };
      },
    });
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path, 5000, undefined, { ...timing, killGraceMs: 100, startMinMs: 2000 });
    cleanups.push(() => c.close());
    await c.sync(1000);
    const ac = new AbortController();
    setTimeout(() => ac.abort(), 50);
    expect(await c.exec({ path: '/bin/true', signal: ac.signal, timeoutMs: 1000 })).toMatchObject({ cancelled: true, exitCode: -1 });
    await until(() => answered);
    await new Promise((r) => setTimeout(r, 200));
    expect(unhandled).toEqual([]);
  });

  it('endLater_ofAProgramNoKillEnds_stopsTryingAfterItsBound_andLogsIt', async () => {
    const warned: Array<{ obj: unknown; msg: string }> = [];
    const log = { warn: (obj: unknown, msg: string) => void warned.push({ obj, msg }) } as unknown as Parameters<typeof GuestAgentClient.connect>[4];
    const { c, kills } = await programGuest({ immortal: true, timing: { endLaterGiveUpMs: 800 }, log });
    await expect(c.exec({ path: '/bin/sleep', args: ['600'], timeoutMs: 100 })).rejects.toThrow(/timed out and killed/);
    await until(() => warned.length > 0);
    const sent = kills.length;
    expect(sent).toBeGreaterThan(2);
    await new Promise((r) => setTimeout(r, 700)); // over 3 of its longest waits
    expect(kills).toHaveLength(sent);
    expect(warned).toHaveLength(1);
    expect(warned[0]?.obj).toMatchObject({ pids: [42] });
    expect(warned[0]?.msg).toMatch(/stopped trying to end an exec/);
  });

  it('endLater_takesTheStatusOfEachKillItStarts_whileItGoesOn_soQemuGaDoesNotPileUpTheirRecords', async () => {
    const { c, kills, records } = await programGuest({ immortal: true, timing: { endLaterGiveUpMs: 5000 } });
    await expect(c.exec({ path: '/bin/sleep', args: ['600'], timeoutMs: 100 })).rejects.toThrow(/timed out and killed/);
    await until(() => kills.length >= 6);
    // The last kill's record at most: every earlier one was asked for on a later try.
    expect(records.size).toBeLessThanOrEqual(1);
  });

  it('exec_withLiveOutputWhoseFileOpenGoesUnanswered_opensThatFileNoMore_andItsOutputStillComesAtExit', async () => {
    const opens: string[] = [];
    let exitAt = Infinity;
    const g = await fakeGuest({
      answer: (req) => {
        const path = String(req.arguments?.path);
        if (req.execute === 'guest-exec') {
          exitAt = Date.now() + 2000;
          return { reply: { pid: 42 } };
        }
        if (req.execute === 'guest-exec-status') return { reply: Date.now() < exitAt ? { exited: false } : { exited: true, exitcode: 0, 'out-data': Buffer.from('all of it').toString('base64') } };
        if (req.execute === 'guest-file-open') {
          opens.push(path);
          // The stdout file's open is answered after the client gave up on it (its handle never learnt).
          return path.endsWith('.out') ? { delayMs: 400, reply: opens.length } : { error: `failed to open file '${path}' (mode: 'r'): No such file or directory` };
        }
        if (req.execute === 'guest-file-close') return { reply: {} };
        return undefined;
      },
    });
    cleanups.push(g.close);
    const c = await GuestAgentClient.connect(g.path, 5000, undefined, timing);
    cleanups.push(() => c.close());
    const got: string[] = [];
    const r = await c.exec({ path: '/bin/x', timeoutMs: 10_000, onOutput: (s, d) => void got.push(`${s}:${d.toString()}`) });
    expect(r.exitCode).toBe(0);
    expect(opens.filter((p) => p.endsWith('.out'))).toHaveLength(1);
    expect(got).toEqual(['stdout:all of it']);
  });
});

describe('RESERVED_ENV_PREFIXES', () => {
  it('namesTheExecWrapperReserves_areRefusedAtTheApiToo_namingTheEntry', () => {
    expect(RESERVED_ENV_PREFIXES.length).toBeGreaterThan(0);
    for (const p of RESERVED_ENV_PREFIXES) expect(() => apiEnv({ PATH: '/bin', [`${p}X`]: '1' })).toThrow(expect.objectContaining({ kind: 'invalid_argument', field: `env["${p}X"]` }));
    // Names are case-sensitive in a shell: only the prefixes as they are.
    expect(apiEnv({ ffe_x: '1', _FF_x: '2' })).toEqual({ ffe_x: '1', _FF_x: '2' });
  });
});
