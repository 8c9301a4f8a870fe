// What the CLI prints and exits with around the fleet's answers: --json shapes, progress only
// when shown, an exec that breaks off, output held back for a slow reader, Ctrl-C while
// waiting. The SDK's calls are replaced by spies: no server is involved.
import { spawn } from 'node:child_process';
import { closeSync, openSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { Writable } from 'node:stream';
import { status as Status } from '@grpc/grpc-js';
import { describe, expect, it, vi } from 'vitest';
import { RpcError } from '../adapters/grpc/status.ts';
import { Forkfleet, Sandbox } from '../sdk/index.ts';
import type { CallOpts, ExecChunk, ExecStream, OperationInfo } from '../sdk/index.ts';
import { expiresText, main, readStdin, writeOut } from './main.ts';
import { isolatedCli } from './test-env.ts';

const API = '127.0.0.1:1';
const ROOT = resolve(import.meta.dirname, '..', '..');
const { out, err, tempDir } = isolatedCli('ff-cli-out-');

const tick = (ms = 10): Promise<void> => new Promise((r) => setTimeout(r, ms));

/** An exec stream that yields `chunks`, then throws `fail` if given; `pulled` counts the chunks taken. */
function fakeExec(chunks: ExecChunk[], fail?: unknown): ExecStream & { pulled: number } {
  const s = {
    pulled: 0,
    async *[Symbol.asyncIterator](): AsyncGenerator<ExecChunk> {
      for (const c of chunks) {
        s.pulled++;
        yield c;
      }
      if (fail) throw fail;
    },
    result: () => Promise.reject(new Error('not used')),
  };
  return s;
}
const stdoutChunk = (t: string): ExecChunk => ({ stream: 'stdout', data: Buffer.from(t) });
const exitChunk: ExecChunk = { stream: 'exit', exitCode: 0, signal: 0, timedOut: false, durationMs: 5, outputTruncated: false };
const dropped = (): RpcError => new RpcError(Status.UNAVAILABLE, 'unavailable', 'Connection dropped', true, undefined, undefined, false);

describe('--json shapes', () => {
  it('sandboxDestroy_printsAnArray_forOneIdAsForSeveral_andAFailureInItsPlace', async () => {
    vi.spyOn(Sandbox.prototype, 'destroy').mockImplementation(async function (this: Sandbox) {
      if (this.id === 'sb-missing') throw new RpcError(Status.NOT_FOUND, 'not_found', 'sandbox sb-missing not found', false, undefined, undefined, true);
      return this;
    });
    expect(await main(['--api', API, '--json', 'sandbox', 'destroy', 'sb-one'])).toBe(0);
    expect(JSON.parse(out.join(''))).toEqual([{ id: 'sb-one', state: 'destroyed' }]);
    out.length = 0;
    expect(await main(['--api', API, '--json', 'sandbox', 'destroy', 'sb-missing'])).toBe(1);
    const [failed] = JSON.parse(out.join('')) as Array<{ id: string; error: Record<string, unknown> }>;
    expect(failed).toMatchObject({ id: 'sb-missing', error: { kind: 'not_found', exitCode: 1 } });
    // Listed in the README as present: null when no field is named.
    expect(failed!.error).toHaveProperty('field', null);
  });

  it('sandboxLs_aStateThatDoesNotExist_isRefusedNamingTheFlag_asFieldInJson', async () => {
    expect(await main(['--api', API, '--json', 'sandbox', 'ls', '--state', 'runing'])).toBe(2);
    const text = err.join('');
    expect(text).toContain('--state');
    expect(text).not.toContain('states[0]');
    // A usage error's document has every field the README lists.
    expect((JSON.parse(out.at(-1)!) as { error: Record<string, unknown> }).error).toEqual(expect.objectContaining({ kind: 'invalid_argument', field: '--state', retryable: false, exitCode: 2 }));
    // No flag named (a missing argument): `field` null.
    expect(await main(['--api', API, '--json', 'sandbox', 'get'])).toBe(2);
    expect((JSON.parse(out.at(-1)!) as { error: Record<string, unknown> }).error).toEqual(expect.objectContaining({ kind: 'invalid_argument', field: null, exitCode: 2 }));
  });
});

describe('a line commander refuses', () => {
  it.each([
    [['sandbox', 'ls', '--limit', '5'], '--limit', 'forkfleet sandbox ls --help'],
    [['sandbox', 'ls', '--limit=5'], '--limit', 'forkfleet sandbox ls --help'],
    [['sandbox', 'fork', 'sb-1', '--spread', 'bogus'], '--spread', 'forkfleet sandbox fork --help'],
    [['events', '--type', 'bogus'], '--type', 'forkfleet events --help'],
    [['sandbox', 'create', '--memory'], '--memory', 'forkfleet sandbox create --help'],
  ])('isReportedAsTheClisOtherErrors_prefixedWithAHintLine_andWithJsonTheFlagAsField: %j', async (args, flag, help) => {
    expect(await main(['--api', API, ...args])).toBe(2);
    const text = err.join('');
    expect(text).toMatch(new RegExp(`^forkfleet: invalid_argument: .*'${flag}[ '=]`));
    expect(text).toMatch(new RegExp(`\n  hint: check ${flag}: \`${help}\` lists the flags\n$`));
    expect(text).not.toContain('Usage:');
    err.length = 0;
    expect(await main(['--api', API, '--json', ...args])).toBe(2);
    expect(JSON.parse(out.at(-1)!)).toEqual({ error: expect.objectContaining({ kind: 'invalid_argument', field: flag, hint: expect.stringContaining(help), exitCode: 2 }) });
    expect(err.join('')).toMatch(/^forkfleet: invalid_argument: /);
  });

  it('anUnknownCommand_hasAHintNamingTheCommandsHelp', async () => {
    expect(await main(['--api', API, 'sandbox', 'bogus'])).toBe(2);
    expect(err.join('')).toBe("forkfleet: invalid_argument: unknown command 'bogus'\n  hint: `forkfleet sandbox --help` lists the commands\n");
  });
});

describe('progress', () => {
  it('isAskedOfTheSdk_onlyWhenItIsShown_notWithJsonNorForSeveralIds', async () => {
    const seen: Array<CallOpts | undefined> = [];
    vi.spyOn(Sandbox.prototype, 'destroy').mockImplementation(async function (this: Sandbox, o?: CallOpts) {
      seen.push(o);
      return this;
    });
    await main(['--api', API, '--json', 'sandbox', 'destroy', 'sb-1']);
    await main(['--api', API, 'sandbox', 'destroy', 'sb-1', 'sb-2', 'sb-3']);
    expect(seen).toHaveLength(4);
    expect(seen.every((o) => o?.onProgress === undefined)).toBe(true);
    // One id, no --json: shown (one call a second is worth it).
    await main(['--api', API, 'sandbox', 'destroy', 'sb-1']);
    expect(seen[4]?.onProgress).toBeTypeOf('function');
  });
});

describe('sandbox exec', () => {
  it('aStreamThatBreaksOffAfterOutput_exits75_andJsonKeepsTheOutputSoFar', async () => {
    vi.spyOn(Forkfleet.prototype, 'sandbox').mockImplementation(function (this: Forkfleet, id: string) {
      const sb = new Sandbox(this, id);
      sb.exec = () => fakeExec([stdoutChunk('half '), stdoutChunk('done\n')], dropped());
      return sb;
    });
    expect(await main(['--api', API, '--json', 'sandbox', 'exec', 'sb-x', '--', 'work'])).toBe(75);
    const doc = JSON.parse(out.at(-1)!) as { error: { kind: string; exitCode: number; hint: string }; stdout: string; stderr: string };
    expect(doc).toMatchObject({ stdout: 'half done\n', stderr: '', error: { kind: 'unavailable', exitCode: 75 } });
    expect(doc.error.hint).toContain('may have run');
    expect(doc.error.hint).not.toContain('fleet:up');
  });

  it.each([
    ['refused', 'No connection established. Last error: connect ECONNREFUSED'],
    ['a name that does not resolve', 'Name resolution failed for target dns:typo:17700'],
  ])('aCallThatNeverReachedAScheduler_staysUnreachable69: %s', async (_why, message) => {
    vi.spyOn(Forkfleet.prototype, 'sandbox').mockImplementation(function (this: Forkfleet, id: string) {
      const sb = new Sandbox(this, id);
      sb.exec = () => fakeExec([], new RpcError(Status.UNAVAILABLE, 'unavailable', message, true, undefined, undefined, false));
      return sb;
    });
    expect(await main(['--api', API, '--json', 'sandbox', 'exec', 'sb-x', '--', 'work'])).toBe(69);
    expect(JSON.parse(out.at(-1)!)).not.toHaveProperty('stdout');
  });

  it('aStreamThatFailsAfterTheExitCame_exitsWithTheCommandsCode_andWarnsOnStderr', async () => {
    vi.spyOn(Forkfleet.prototype, 'sandbox').mockImplementation(function (this: Forkfleet, id: string) {
      const sb = new Sandbox(this, id);
      sb.exec = () => fakeExec([stdoutChunk('done\n'), { ...exitChunk, exitCode: 3 }], dropped());
      return sb;
    });
    expect(await main(['--api', API, 'sandbox', 'exec', 'sb-x', '--', 'work'])).toBe(3);
    expect(out.join('')).toBe('done\n');
    expect(err.join('')).toMatch(/warning: .*stream failed \(unavailable: Connection dropped\)/);
    expect(err.join('')).not.toContain('hint:');
    // --json: the command's result, not an error document.
    out.length = 0;
    expect(await main(['--api', API, '--json', 'sandbox', 'exec', 'sb-x', '--', 'work'])).toBe(3);
    const doc = JSON.parse(out.join('')) as Record<string, unknown>;
    expect(doc).toMatchObject({ stdout: 'done\n', exitCode: 3 });
    expect(doc).not.toHaveProperty('error');
  });

  it('aSlowReader_holdsTheStreamBack_untilStdoutDrains', async () => {
    const stream = fakeExec([stdoutChunk('a'), stdoutChunk('b'), exitChunk]);
    vi.spyOn(Forkfleet.prototype, 'sandbox').mockImplementation(function (this: Forkfleet, id: string) {
      const sb = new Sandbox(this, id);
      sb.exec = () => stream;
      return sb;
    });
    // stdout's buffer is full after every write (a pipe whose reader is slow).
    vi.mocked(process.stdout.write).mockImplementation((s) => (out.push(String(s)), false));
    const done = main(['--api', API, 'sandbox', 'exec', 'sb-x', '--', 'yes']);
    await tick();
    expect(stream.pulled).toBe(1);
    process.stdout.emit('drain');
    await tick();
    expect(stream.pulled).toBe(2);
    process.stdout.emit('drain');
    expect(await done).toBe(0);
    expect(out.join('')).toBe('ab');
  });
});

describe('writeOut', () => {
  it('resolvesAtOnce_whenTheBufferHasRoom_andAfterDrain_whenItIsFull', async () => {
    let release!: () => void;
    const sink = new Writable({ highWaterMark: 4, write: (_c, _e, cb) => void (release = () => cb()) });
    await writeOut(sink, 'ab'); // under the mark: no wait
    let resolved = false;
    const p = writeOut(sink, 'cdef').then(() => void (resolved = true));
    await tick();
    expect(resolved).toBe(false);
    release(); // 'ab' written; 'cdef' goes on
    await tick();
    release();
    await p;
    expect(resolved).toBe(true);
  });
});

describe('interrupted while waiting', () => {
  it('ctrlC_duringAFork_namesItsOperationAndKey_andExits130', async () => {
    const OP = `op-${'c'.repeat(20)}`;
    let release!: () => void;
    vi.spyOn(Forkfleet.prototype, 'fork').mockImplementation(async (_src, _n, _fo, o?: CallOpts) => {
      o?.onAccepted?.({ id: OP } as OperationInfo);
      await new Promise<void>((r) => (release = r));
      throw new Error('interrupted');
    });
    const before = process.listeners('SIGINT');
    const exit = vi.fn();
    const done = main(['--api', API, 'sandbox', 'fork', 'sb-src', '4'], exit);
    await tick();
    const added = process.listeners('SIGINT').filter((l) => !before.includes(l));
    expect(added).toHaveLength(1);
    added[0]!('SIGINT');
    expect(exit).toHaveBeenCalledWith(130);
    const text = err.join('');
    expect(text).toContain(`operation ${OP} goes on`);
    expect(text).toContain(`forkfleet operation cancel ${OP}`);
    expect(text).toMatch(/--idempotency-key cli-\S+/);
    release();
    await done;
    // Not waiting any more: SIGINT is left as it was.
    expect(process.listeners('SIGINT')).toEqual(before);
  });
});

describe('piped output', () => {
  it('jsonOutputPastThePipesBuffer_isWrittenWhole_beforeTheProcessExits', async () => {
    // ~450 KB of `token ls --json`, more than a pipe holds (64 KiB): no fleet needed.
    const file = join(tempDir(), 'tokens.json');
    const tokens = Array.from({ length: 3000 }, (_, i) => ({ tenant: `tenant-${i}`, token_sha256: i.toString(16).padStart(64, '0'), name: `a-long-enough-name-for-this-token-${i}` }));
    writeFileSync(file, JSON.stringify({ tokens }));
    const r = await new Promise<{ code: number | null; stdout: Buffer }>((res, rej) => {
      const p = spawn(process.execPath, ['--import', 'tsx', 'services/cli/main.ts', '--json', 'token', 'ls', '--tokens-file', file], { cwd: ROOT, stdio: ['ignore', 'pipe', 'ignore'] });
      const parts: Buffer[] = [];
      p.stdout.on('data', (d: Buffer) => parts.push(d));
      p.on('error', rej);
      p.on('close', (code) => res({ code, stdout: Buffer.concat(parts) }));
    });
    expect(r.code).toBe(0);
    expect(r.stdout.length).toBeGreaterThan(256 * 1024);
    expect((JSON.parse(r.stdout.toString()) as unknown[]).length).toBe(3000);
  });
});

describe('the idempotency key in errors', () => {
  const unreachable = (): RpcError => new RpcError(Status.UNAVAILABLE, 'unavailable', 'No connection established. Last error: connect ECONNREFUSED', true, undefined, undefined, false);

  it('execAndCp_sendNoKey_soTheirErrorsNeverOfferToRepeatWithOne_whilePauseDoes', async () => {
    vi.spyOn(Forkfleet.prototype, 'sandbox').mockImplementation(function (this: Forkfleet, id: string) {
      const sb = new Sandbox(this, id);
      sb.exec = () => fakeExec([], unreachable());
      return sb;
    });
    vi.spyOn(Sandbox.prototype, 'readFile').mockRejectedValue(unreachable());
    vi.spyOn(Sandbox.prototype, 'pause').mockRejectedValue(unreachable());
    const jsonError = (): Record<string, unknown> => (JSON.parse(out.at(-1)!) as { error: Record<string, unknown> }).error;
    for (const args of [['sandbox', 'exec', 'sb-x', '--', 'work'], ['sandbox', 'cp', 'sb-x:/etc/hostname', join(tempDir(), 'h')]]) {
      err.length = 0;
      expect(await main(['--api', API, '--json', '--idempotency-key', 'k-1', ...args])).toBe(69);
      expect(err.join(''), args[1]).not.toContain('--idempotency-key');
      expect(jsonError(), args[1]).not.toHaveProperty('idempotencyKey');
    }
    // A command that sends the key: offered.
    err.length = 0;
    expect(await main(['--api', API, '--idempotency-key', 'k-1', 'sandbox', 'pause', 'sb-x'])).toBe(69);
    expect(err.join('')).toContain('--idempotency-key k-1');
  });
});

describe('exec limits and copied files', () => {
  it('exec_withTimeoutButNoExecTimeout_limitsTheCommandByIt_andExecTimeoutStillWins_andATimeoutNamesTheLimitUsed', async () => {
    const limits: Array<string | undefined> = [];
    let exit = exitChunk;
    vi.spyOn(Forkfleet.prototype, 'sandbox').mockImplementation(function (this: Forkfleet, id: string) {
      const sb = new Sandbox(this, id);
      sb.exec = (_argv, o) => (limits.push(o?.timeout === undefined ? undefined : String(o.timeout)), fakeExec([exit]));
      return sb;
    });
    expect(await main(['--api', API, '--timeout', '10m', 'sandbox', 'exec', 'sb-x', '--', 'train'])).toBe(0);
    expect(await main(['--api', API, '--timeout', '10m', 'sandbox', 'exec', 'sb-x', '--exec-timeout', '2m', '--', 'train'])).toBe(0);
    expect(await main(['--api', API, 'sandbox', 'exec', 'sb-x', '--', 'train'])).toBe(0);
    expect(limits).toEqual(['10m', '2m', '60s']);
    // Killed at its limit: the message says the limit it had, and the flag that set it.
    exit = { ...exitChunk, exitCode: -1, signal: 9, timedOut: true };
    const said = async (args: string[]): Promise<string> => {
      err.length = 0;
      expect(await main(['--api', API, ...args])).toBe(137);
      return err.join('');
    };
    expect(await said(['--timeout', '10m', 'sandbox', 'exec', 'sb-x', '--', 'train'])).toContain('timed out after 10m (--timeout)');
    expect(await said(['--timeout', '10m', 'sandbox', 'exec', 'sb-x', '--exec-timeout', '2m', '--', 'train'])).toContain('timed out after 2m (--exec-timeout)');
    expect(await said(['sandbox', 'exec', 'sb-x', '--', 'train'])).toContain('timed out after 60s (--exec-timeout)');
  });

  it('execStdin_overWhatAnExecTakes_isRefusedNamingStdin_withAHintToCp_beforeAnyCall', async () => {
    // A pipe of 1 MiB + 1 byte into the CLI: refused once the byte past the limit came (exit 2),
    // not sent (the API address is a closed port: a call would exit 69).
    const r = await new Promise<{ code: number | null; stderr: string }>((res, rej) => {
      const p = spawn(process.execPath, ['--import', 'tsx', 'services/cli/main.ts', '--api', API, 'sandbox', 'exec', 'sb-x', '--stdin', '--', 'cat'], { cwd: ROOT, stdio: ['pipe', 'ignore', 'pipe'], env: { ...process.env, FF_FLEET_DIR: tempDir() } });
      const parts: Buffer[] = [];
      p.stderr.on('data', (d: Buffer) => parts.push(d));
      p.stdin.on('error', () => undefined); // it stops reading once past the limit
      p.stdin.end(Buffer.alloc((1 << 20) + 1));
      p.on('error', rej);
      p.on('close', (code) => res({ code, stderr: Buffer.concat(parts).toString() }));
    });
    expect(r.stderr).toContain('forkfleet: invalid_argument: --stdin: more than 1048576 bytes');
    expect(r.stderr).toMatch(/hint: check --stdin \(at most 1 MiB\): .*forkfleet sandbox cp/);
    expect(r.code).toBe(2);
  });

  it('readStdin_takesUpToTheLimit_andRefusesAFileLargerThanIt_namingStdin', () => {
    const dir = tempDir();
    const fdOf = (n: number): number => {
      const f = join(dir, `in-${n}`);
      writeFileSync(f, Buffer.alloc(n, 7));
      return openSync(f, 'r');
    };
    const fd = fdOf(10);
    try {
      expect(readStdin(10, fd)).toEqual(Buffer.alloc(10, 7));
    } finally {
      closeSync(fd);
    }
    const big = fdOf(11);
    try {
      expect(() => readStdin(10, big)).toThrow(expect.objectContaining({ kind: 'invalid_argument', field: '--stdin' }));
    } finally {
      closeSync(big);
    }
  });

  it('cp_fromASandboxIntoANewFile_makesItReadableByItsOwnerOnly_andAnExistingFileKeepsItsMode', async () => {
    vi.spyOn(Sandbox.prototype, 'readFile').mockResolvedValue(Buffer.from('-----BEGIN OPENSSH PRIVATE KEY-----\n'));
    const umask = process.umask(0o022);
    try {
      const fresh = join(tempDir(), 'id_ed25519');
      expect(await main(['--api', API, 'sandbox', 'cp', 'sb-x:/root/.ssh/id_ed25519', fresh])).toBe(0);
      expect(statSync(fresh).mode & 0o777).toBe(0o600);
      const kept = join(tempDir(), 'notes');
      writeFileSync(kept, 'old', { mode: 0o644 });
      expect(await main(['--api', API, 'sandbox', 'cp', 'sb-x:/root/notes', kept])).toBe(0);
      expect(statSync(kept).mode & 0o777).toBe(0o644);
      expect(readFileSync(kept, 'utf8')).toContain('PRIVATE KEY');
    } finally {
      process.umask(umask);
    }
  });
});

describe('sandbox create', () => {
  it('anImageGivenWithFromSnapshot_isRefusedNamingImage_andNothingIsCreated', async () => {
    const specs: unknown[] = [];
    vi.spyOn(Forkfleet.prototype, 'create').mockImplementation(async function (this: Forkfleet, spec) {
      specs.push(spec);
      return new Sandbox(this, 'sb-new');
    });
    expect(await main(['--api', API, '--json', 'sandbox', 'create', '--image', 'debian', '--from-snapshot', 'sn-1'])).toBe(2);
    expect(specs).toEqual([]);
    expect(JSON.parse(out.at(-1)!)).toMatchObject({ error: { kind: 'invalid_argument', field: '--image', exitCode: 2 } });
    // --image's default is no image given: the snapshot alone is restored.
    expect(await main(['--api', API, 'sandbox', 'create', '--from-snapshot', 'sn-1'])).toBe(0);
    expect(specs).toEqual([expect.objectContaining({ snapshotId: 'sn-1' })]);
    expect(specs[0]).not.toHaveProperty('image');
  });

  it('memoryOutsideTheApisBounds_isRefusedNamingMemory_andItsBoundsAreTaken', async () => {
    const specs: unknown[] = [];
    vi.spyOn(Forkfleet.prototype, 'create').mockImplementation(async function (this: Forkfleet, spec) {
      specs.push(spec);
      return new Sandbox(this, 'sb-new');
    });
    for (const mib of ['16', '63', '262145', '1048576']) {
      err.length = 0;
      expect(await main(['--api', API, '--json', 'sandbox', 'create', '--memory', mib]), mib).toBe(2);
      expect(JSON.parse(out.at(-1)!)).toMatchObject({ error: { kind: 'invalid_argument', field: '--memory' } });
      expect(err.join('')).toContain('want a whole number 64..262144');
    }
    expect(specs).toEqual([]);
    expect(await main(['--api', API, 'sandbox', 'create', '--memory', '64'])).toBe(0);
    expect(await main(['--api', API, 'sandbox', 'create', '--memory', '262144'])).toBe(0);
    expect(specs).toEqual([expect.objectContaining({ memoryMib: 64 }), expect.objectContaining({ memoryMib: 262144 })]);
  });

  it('aLabelKeyGivenTwice_isRefusedNamingLabel_andNothingIsCreatedOrListed', async () => {
    const create = vi.spyOn(Forkfleet.prototype, 'create').mockImplementation(async function (this: Forkfleet) {
      return new Sandbox(this, 'sb-new');
    });
    const list = vi.spyOn(Forkfleet.prototype, 'list').mockResolvedValue([]);
    for (const cmd of [['sandbox', 'create'], ['sandbox', 'ls']]) {
      err.length = 0;
      expect(await main(['--api', API, '--json', ...cmd, '--label', 'team=a', '--label', 'team=b'])).toBe(2);
      expect(JSON.parse(out.at(-1)!)).toMatchObject({ error: { kind: 'invalid_argument', field: '--label' } });
      expect(err.join('')).toContain('--label: key "team" given twice ("team=a", then "team=b")');
    }
    expect(create).not.toHaveBeenCalled();
    expect(list).not.toHaveBeenCalled();
    // Distinct keys: each taken.
    expect(await main(['--api', API, 'sandbox', 'create', '--label', 'team=a', '--label', 'env=ci'])).toBe(0);
    expect(create.mock.calls[0]?.[0]).toMatchObject({ labels: { team: 'a', env: 'ci' } });
  });
});

describe('the token', () => {
  it('aTokenWithACarriageReturn_isRefusedNamingToken_andNeverPrinted', async () => {
    vi.stubEnv('FF_TOKEN', 'ff_SECRET123\r');
    expect(await main(['--api', API, '--json', 'sandbox', 'get', 'sb-x'])).toBe(2);
    expect(out.join('') + err.join('')).not.toContain('SECRET');
    expect(JSON.parse(out.at(-1)!)).toMatchObject({ error: { kind: 'invalid_argument', field: 'token' } });
    expect(err.join('')).toContain('hint: check the token');
  });
});

describe('whole-number flags', () => {
  it.each([['1e2'], ['0x10'], ['0b11'], [' 5'], ['5.0'], ['-1']])('aValueThatIsNotDecimalDigits_isRefusedNamingTheFlag: %s', async (v) => {
    const list = vi.spyOn(Forkfleet.prototype, 'listOperations').mockResolvedValue([]);
    expect(await main(['--api', API, '--json', 'operation', 'ls', '--limit', v])).toBe(2);
    expect(list).not.toHaveBeenCalled();
    expect(JSON.parse(out.at(-1)!)).toMatchObject({ error: { kind: 'invalid_argument', field: '--limit' } });
  });

  it('decimalDigits_areTaken', async () => {
    const list = vi.spyOn(Forkfleet.prototype, 'listOperations').mockResolvedValue([]);
    expect(await main(['--api', API, '--json', 'operation', 'ls', '--limit', '016'])).toBe(0);
    expect(list.mock.calls[0]?.[0]).toMatchObject({ limit: 16 });
  });
});

describe('snapshot ls EXPIRES', () => {
  it('saysWhatRetentionWaitsFor_notNever_forASnapshotThatWillBeDeleted', () => {
    // A fork's snapshot past its TTL, still used by its children: shown as 'never' (or, before,
    // a time in the past), though retention deletes it once they are gone.
    const r = (ttlMs: number | undefined, keepLast = 0) => ({ ttlMs, keepLast });
    expect(expiresText({ expiresAt: undefined, pinned: false, retention: r(86_400_000) })).toBe('when unused');
    expect(expiresText({ expiresAt: undefined, pinned: false, retention: r(undefined, 3) })).toBe('keep_last 3');
    expect(expiresText({ expiresAt: '2026-12-08T00:00:00.000Z', pinned: false, retention: r(86_400_000) })).toBe('2026-12-08T00:00:00.000Z');
    expect(expiresText({ expiresAt: undefined, pinned: true, retention: r(86_400_000) })).toBe('never');
    expect(expiresText({ expiresAt: undefined, pinned: false, retention: r(undefined) })).toBe('never');
  });
});
