// The README's "Host prerequisites" names the Debian packages deploy/setup.sh installs, so an
// operator preparing hosts by hand (or auditing one) installs the same set.
import { readFileSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { describe, expect, it } from 'vitest';

const ROOT = resolve(import.meta.dirname, '..');

/** The package names in setup.sh's APT_PACKAGES array (comments dropped). */
function setupPackages(script: string): string[] {
  const body = /^APT_PACKAGES=\(\n([\s\S]*?)^\)/m.exec(script)?.[1];
  if (body === undefined) throw new Error('setup.sh: no APT_PACKAGES=( ... ) array');
  return body.split('\n').flatMap((line) => line.replace(/#.*/, '').trim().split(/\s+/)).filter((p) => p !== '');
}

/** The package list in the README's prerequisites: the first code span after "setup.sh` installs". */
function readmePackages(readme: string): string[] {
  const m = /`deploy\/setup\.sh` installs[^`]*(?:`APT_PACKAGES`[^`]*)?`([^`]+)`/.exec(readme);
  if (!m) throw new Error('README.md: no package list after "`deploy/setup.sh` installs"');
  return m[1]!.split(/\s+/).filter((p) => p !== '');
}

describe('host prerequisites', () => {
  it('readme_listsExactlyThePackagesSetupInstalls', () => {
    const setup = setupPackages(readFileSync(join(ROOT, 'deploy', 'setup.sh'), 'utf8'));
    const readme = readmePackages(readFileSync(join(ROOT, 'README.md'), 'utf8'));
    expect(setup.length).toBeGreaterThan(10);
    expect([...readme].sort()).toEqual([...setup].sort());
  });
});
