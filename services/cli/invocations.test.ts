// main() run more than once in one process (a test, a wrapper) starts each run afresh: its own
// client, idempotency key and exit code; and the words of a command line that are not the CLI's
// (a guest command's, the load test's) are never taken as its flags. No server is involved: the
// API address is a closed port, which the CLI reports as unreachable; `npm` is not started.
import type * as ChildProcess from 'node:child_process';
import { EventEmitter } from 'node:events';
import { join } from 'node:path';
import { describe, expect, it, vi } from 'vitest';
import { Forkfleet, Sandbox } from '../sdk/index.ts';
import type { ExecChunk, ExecStream } from '../sdk/index.ts';
import { main } from './main.ts';
import { isolatedCli } from './test-env.ts';

/** The arguments of each `npm` the CLI started (`loadtest`): a child that exits 0 at once stands in for it. */
const npmRuns = vi.hoisted((): string[][] => []);
vi.mock('node:child_process', async (importOriginal) => {
  const actual = await importOriginal<typeof ChildProcess>();
  const spawn = (cmd: string, args: string[], ...rest: unknown[]): unknown => {
    if (cmd !== 'npm') return (actual.spawn as (...a: unknown[]) => unknown)(cmd, args, ...rest);
    npmRuns.push(args);
    const child = new EventEmitter();
    setImmediate(() => child.emit('exit', 0, null));
    return child;
  };
  return { ...actual, spawn };
});

const API = '127.0.0.1:1';
const { out, err, tempDir } = isolatedCli('ff-cli-');

/** The `error` of the --json document main printed last. */
const lastJsonError = (): { kind: string; exitCode: number; idempotencyKey?: string } => (JSON.parse(out.at(-1)!) as { error: { kind: string; exitCode: number; idempotencyKey?: string } }).error;

describe('CLI main run twice in one process', () => {
  it('aSecondRun_reportsTheFleetUnreachable_asTheFirstDid_notAClosedClient', async () => {
    expect(await main(['--api', API, 'sandbox', 'get', 'sb-x'])).toBe(69);
    expect(await main(['--api', API, 'sandbox', 'get', 'sb-x'])).toBe(69);
  });

  it('twoMutatingRuns_reportDifferentIdempotencyKeys', async () => {
    expect(await main(['--api', API, '--json', 'sandbox', 'create'])).toBe(69);
    const first = lastJsonError();
    expect(await main(['--api', API, '--json', 'sandbox', 'create'])).toBe(69);
    const second = lastJsonError();
    expect(first.idempotencyKey).toMatch(/^cli-/);
    expect(second.idempotencyKey).toMatch(/^cli-/);
    expect(second.idempotencyKey).not.toBe(first.idempotencyKey);
  });

  it('anExitCodeLeftInTheProcess_doesNotBecomeTheNextRunsCode', async () => {
    // As an earlier `sandbox exec` whose command exited 3 used to leave it.
    process.exitCode = 3;
    const tokens = join(tempDir(), 'tokens.json');
    expect(await main(['--tenant', 't1', 'token', 'mint', '--tokens-file', tokens])).toBe(0);
  });

  it('aJsonFlagOfTheGuestCommand_afterTheDoubleDash_isNotTheCLIs', async () => {
    expect(await main(['--api', API, 'sandbox', 'exec', 'sb-x', '--', 'tool', '--json'])).toBe(69);
    expect(out.join('')).not.toContain('"error"');
  });
});

describe('words that are not the CLI\'s', () => {
  /** The argv of each exec the runs sent (none ran: each is answered with exit 0 at once). */
  function execs(): string[][] {
    const sent: string[][] = [];
    const exit: ExecChunk = { stream: 'exit', exitCode: 0, signal: 0, timedOut: false, durationMs: 1, outputTruncated: false };
    vi.spyOn(Forkfleet.prototype, 'sandbox').mockImplementation(function (this: Forkfleet, id: string) {
      const sb = new Sandbox(this, id);
      sb.exec = (argv): ExecStream => {
        sent.push(argv);
        return { async *[Symbol.asyncIterator]() { yield exit; }, result: () => Promise.reject(new Error('not used')) };
      };
      return sb;
    });
    return sent;
  }

  it('loadtest_passesEveryWordAfterIt_asGiven_itsApiAndJsonFileIncluded', async () => {
    npmRuns.length = 0;
    expect(await main(['loadtest', '--quick', '--api', '10.0.0.5:17700', '--json', 'out.json'])).toBe(0);
    // As the README writes it: `loadtest -- ARGS`.
    expect(await main(['--api', API, 'loadtest', '--', '--quick', '--timeout', '5m'])).toBe(0);
    expect(npmRuns).toEqual([
      ['run', 'loadtest', '--', '--quick', '--api', '10.0.0.5:17700', '--json', 'out.json'],
      ['run', 'loadtest', '--', '--quick', '--timeout', '5m'],
    ]);
    expect(out.join('')).toBe('');
  });

  it('loadtest_withHelpAlone_printsItsHelp_andRunsNothing', async () => {
    npmRuns.length = 0;
    for (const h of ['--help', '-h']) {
      out.length = 0;
      expect(await main(['loadtest', h])).toBe(0);
      expect(out.join('')).toContain('Usage: forkfleet loadtest');
    }
    expect(npmRuns).toEqual([]);
  });

  it.each([
    [['sandbox', 'exec', 'sb-1', 'python', 'eval.py', '--json', '--tenant', 'team-b', '--cwd', '/work'], '--json'],
    [['sandbox', 'exec', 'sb-x', 'mytool', '-h'], '-h'],
    [['sb', 'exec', '--cwd', '/w', 'sb-1', 'python', '-V', '--', 'x'], '-V'],
  ])('execWithAnOptionLikeWordOfTheCommandOutsideTheDoubleDash_isRefusedWithUsage2_andRunsNothing: %j', async (args, word) => {
    const sent = execs();
    expect(await main(['--api', API, ...args])).toBe(2);
    expect(sent).toEqual([]);
    expect(err.join('')).toContain(`"${word}"`);
    expect(err.join('')).toContain('put the command after --: forkfleet sandbox exec ID [options] -- CMD ARGS...');
    // --json before the command: the refusal is a JSON document too.
    out.length = 0;
    expect(await main(['--api', API, '--json', ...args])).toBe(2);
    expect(JSON.parse(out.at(-1)!)).toMatchObject({ error: { kind: 'invalid_argument', exitCode: 2 } });
  });

  it('exec_withItsOptionsBeforeTheCommand_orTheCommandAfterTheDoubleDash_runsItAsGiven', async () => {
    const sent = execs();
    expect(await main(['--api', API, 'sandbox', 'exec', 'sb-1', '--', 'python', 'x.py', '--json', '-h'])).toBe(0);
    expect(await main(['--api', API, 'sandbox', 'exec', 'sb-1', '--cwd', '/w', '--tenant', 't1', 'python', 'x.py'])).toBe(0);
    expect(await main(['--api', API, 'sandbox', 'exec', 'sb-1', 'ls', '-'])).toBe(0);
    expect(sent).toEqual([['python', 'x.py', '--json', '-h'], ['python', 'x.py'], ['ls', '-']]);
    expect(out.join('')).not.toContain('{');
  });
});
