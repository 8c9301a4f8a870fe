// main() run more than once in one process (a test, a wrapper) starts each run afresh: its own
// client, idempotency key and exit code. No server is involved: the API address is a closed
// port, which the CLI reports as unreachable.
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { main } from './main.ts';
import { isolatedCli } from './test-env.ts';

const API = '127.0.0.1:1';
const { out, tempDir } = isolatedCli('ff-cli-');

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
