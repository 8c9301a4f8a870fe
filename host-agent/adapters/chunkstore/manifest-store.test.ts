import { afterEach, describe, expect, it } from 'vitest';
import { spawnSync } from 'node:child_process';
import { mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { FsManifestStore } from './fs-store.ts';

const dirs: string[] = [];
afterEach(() => {
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
});

describe('FsManifestStore', () => {
  it('open_removesTempFilesOfAKilledWriter_andLeavesALiveProcesssOnes', () => {
    const root = mkdtempSync(join(tmpdir(), 'ff-manifests-'));
    dirs.push(root);
    new FsManifestStore(root);
    const dead = spawnSync('true').pid; // exited: its pid names a writer that is gone
    writeFileSync(join(root, 'tmp', `${dead}.abcd.1.tmp`), 'half a manifest');
    writeFileSync(join(root, 'tmp', `${process.pid}.abcd.2.tmp`), 'being written');
    new FsManifestStore(root);
    expect(readdirSync(join(root, 'tmp'))).toEqual([`${process.pid}.abcd.2.tmp`]);
  });
});
