// `npm run forkfleet -- ...` (and fleet:*, deploy:render) resolve relative paths from the
// directory the user typed the command in, not from the repository npm runs scripts in.
import { spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';

const ROOT = resolve(import.meta.dirname, '..');
const here = mkdtempSync(join(tmpdir(), 'ff-user-cwd-'));
afterAll(() => rmSync(here, { recursive: true, force: true }));

describe('the directory relative paths are resolved from', () => {
  it('npmRunForkfleet_resolvesARelativePathFromTheDirectoryItWasRunIn_notTheRepository', () => {
    const r = spawnSync('npm', ['--prefix', ROOT, 'run', '-s', 'forkfleet', '--', 'fleet', 'status', '--dir', './nofleet'], { cwd: here, encoding: 'utf8' });
    expect(r.stderr).toContain(`no fleet in ${join(here, 'nofleet')}`);
  });

  it('aProgramThatAnotherScriptStarts_keepsTheWorkingDirectoryItWasGiven', () => {
    const script = "import('./deploy/user-cwd.ts').then((m) => { m.enterUserCwd(['forkfleet']); process.stdout.write(process.cwd()); })";
    const run = (event: string): string => spawnSync(process.execPath, ['--import', 'tsx', '-e', script], { cwd: ROOT, encoding: 'utf8', env: { ...process.env, INIT_CWD: here, npm_lifecycle_event: event } }).stdout;
    expect(run('forkfleet')).toBe(here);
    expect(run('test')).toBe(ROOT);
  });
});
