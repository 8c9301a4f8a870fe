// For the CLI's unit tests: each test runs main() with no credentials of the machine's (a
// local fleet's: TLS with the system roots, no token), a fleet directory of its own, and
// stdout/stderr captured instead of printed.
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, beforeEach, vi } from 'vitest';

/**
 * Registers the before/after hooks of a test file: `out` and `err` hold what the test's runs
 * wrote (emptied before each test); `tempDir()` makes a directory removed after the test.
 */
export function isolatedCli(prefix: string): { out: string[]; err: string[]; tempDir: () => string } {
  const out: string[] = [];
  const err: string[] = [];
  const dirs: string[] = [];
  const tempDir = (): string => {
    const d = mkdtempSync(join(tmpdir(), prefix));
    dirs.push(d);
    return d;
  };
  beforeEach(() => {
    out.length = 0;
    err.length = 0;
    vi.stubEnv('FF_FLEET_DIR', tempDir());
    vi.stubEnv('FF_CREDENTIALS', undefined);
    vi.stubEnv('FF_TOKEN', undefined);
    vi.stubEnv('FF_CA', undefined);
    vi.spyOn(process.stdout, 'write').mockImplementation((s) => (out.push(String(s)), true));
    vi.spyOn(process.stderr, 'write').mockImplementation((s) => (err.push(String(s)), true));
  });
  afterEach(() => {
    vi.restoreAllMocks();
    vi.unstubAllEnvs();
    process.exitCode = undefined;
    for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
  });
  return { out, err, tempDir };
}
