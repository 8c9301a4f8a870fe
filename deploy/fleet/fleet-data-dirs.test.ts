// The fleet's host data directories are made owner-only, as their agents want them: a fresh
// fleet:up leaves an agent nothing to fix (and no WARN to log) at its start.
import { mkdtempSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { makeHostDataDir } from './fleet.ts';
import { ensurePrivateDataDir } from '../../host-agent/adapters/data-dir.ts';

const dirs: string[] = [];
afterEach(() => {
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
});

describe('makeHostDataDir', () => {
  it('makeHostDataDir_underTheUsualUmask_makesItOwnerOnly_soItsAgentHasNothingToFix', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'ff-datadir-'));
    dirs.push(dir);
    const dataDir = join(dir, 'hosts', 'h1');
    const umask = process.umask(0o022);
    try {
      makeHostDataDir(dataDir);
    } finally {
      process.umask(umask);
    }
    expect(statSync(dataDir).mode & 0o777).toBe(0o700);
    // What the agent checks at its start: false, nothing made private, no WARN.
    expect(await ensurePrivateDataDir(dataDir)).toBe(false);
  });
});
