import { chmodSync, mkdirSync, mkdtempSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { ensurePrivateDataDir } from './data-dir.ts';

const dirs: string[] = [];
afterEach(() => {
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
});
const temp = (): string => {
  const d = mkdtempSync(join(tmpdir(), 'ff-data-dir-'));
  dirs.push(d);
  return d;
};
const mode = (p: string): number => statSync(p).mode & 0o777;

describe('ensurePrivateDataDir', () => {
  it('ensurePrivateDataDir_ofAMissingDirectory_makesItOwnerOnly', async () => {
    const dir = join(temp(), 'var', 'lib', 'forkfleet');
    expect(await ensurePrivateDataDir(dir)).toBe(false);
    expect(mode(dir)).toBe(0o700);
  });

  it('ensurePrivateDataDir_ofOneOthersCanRead_takesTheirBitsAway_butLeavesWhatIsInsideAsItIs', async () => {
    // As an agent before this one left it: mkdir without a mode under umask 0022.
    const dir = join(temp(), 'forkfleet');
    mkdirSync(join(dir, 'chunks'), { recursive: true });
    writeFileSync(join(dir, 'chunks', 'c1'), 'x');
    chmodSync(dir, 0o755);
    chmodSync(join(dir, 'chunks'), 0o755);
    chmodSync(join(dir, 'chunks', 'c1'), 0o644);
    expect(await ensurePrivateDataDir(dir)).toBe(true);
    expect(mode(dir)).toBe(0o700);
    expect([mode(join(dir, 'chunks')), mode(join(dir, 'chunks', 'c1'))]).toEqual([0o755, 0o644]);
    // Again: nothing to do.
    expect(await ensurePrivateDataDir(dir)).toBe(false);
    expect(mode(dir)).toBe(0o700);
  });
});
