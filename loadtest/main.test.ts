// The load test's command line: --help prints the usage and starts nothing; an option it does
// not know, or a bad value, ends at once with one line naming it (exit 2), not a stack trace.
// The script is run as `npm run loadtest` runs it; every case ends before any fleet starts.
import { spawnSync } from 'node:child_process';
import { resolve } from 'node:path';
import { describe, expect, it } from 'vitest';

const MAIN = resolve(import.meta.dirname, 'main.ts');
const run = (...args: string[]) => spawnSync(process.execPath, ['--import', 'tsx', MAIN, ...args], { encoding: 'utf8', timeout: 60_000 });

describe('loadtest command line', () => {
  it('help_printsTheUsage_andExitsZero', () => {
    const r = run('--quick', '--help');
    expect(r.status).toBe(0);
    expect(r.stdout).toMatch(/^usage: npm run loadtest -- \[--quick\]/);
    expect(r.stdout).toContain('--plan --forks-per-s X --p95-ms Y --from FILE');
  });

  it('anUnknownOption_endsWithOneLineNamingIt_exit2', () => {
    const r = run('--quick', '--hostz', '3');
    expect(r.status).toBe(2);
    expect(r.stderr.trim().split('\n')).toEqual([expect.stringMatching(/^loadtest: .*'--hostz'.*\(npm run loadtest -- --help\)$/)]);
  });

  it('aBadValue_endsWithOneLineNamingTheOption_exit2', () => {
    const r = run('--hosts', '0');
    expect(r.status).toBe(2);
    expect(r.stderr.trim().split('\n')).toEqual([expect.stringMatching(/^loadtest: --hosts: want an integer >= 1, got "0" \(npm run loadtest -- --help\)$/)]);
  });
});
