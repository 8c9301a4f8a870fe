// main() run more than once in one process (a test, a wrapper) starts each run afresh: its own
// client, idempotency key and exit code. No server is involved: the API address is a closed
// port, which the CLI reports as unreachable.
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { main } from './main.ts';

const API = '127.0.0.1:1';
let out: string[] = [];
/** Each test's temporary directories, removed after it. */
const dirs: string[] = [];
const tempDir = (): string => {
  const d = mkdtempSync(join(tmpdir(), 'ff-cli-'));
  dirs.push(d);
  return d;
};

beforeEach(() => {
  out = [];
  // No credentials of the machine's (a local fleet's) are used: TLS with the system roots, no token.
  vi.stubEnv('FF_FLEET_DIR', tempDir());
  vi.stubEnv('FF_CREDENTIALS', undefined);
  vi.stubEnv('FF_TOKEN', undefined);
  vi.stubEnv('FF_CA', undefined);
  vi.spyOn(process.stdout, 'write').mockImplementation((s) => (out.push(String(s)), true));
  vi.spyOn(process.stderr, 'write').mockImplementation(() => true);
});
afterEach(() => {
  vi.restoreAllMocks();
  vi.unstubAllEnvs();
  process.exitCode = undefined;
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
});

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
