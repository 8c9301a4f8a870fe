import { afterEach, describe, expect, it } from 'vitest';
import { spawn, spawnSync } from 'node:child_process';
import { mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { FsManifestStore } from './fs-store.ts';

const dirs: string[] = [];
afterEach(() => {
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
});

describe('FsManifestStore', () => {
  it('open_removesTempFilesOfAKilledWriter_evenOneThatHadThisProcesssPid_andLeavesALiveProcesssOnes', () => {
    const root = mkdtempSync(join(tmpdir(), 'ff-manifests-'));
    dirs.push(root);
    new FsManifestStore(root);
    const dead = spawnSync('true').pid; // exited: its pid names a writer that is gone
    const live = spawn('sleep', ['30'], { stdio: 'ignore' });
    try {
      writeFileSync(join(root, 'tmp', `${dead}.abcd.1.tmp`), 'half a manifest');
      writeFileSync(join(root, 'tmp', `${live.pid}.abcd.2.tmp`), 'being written');
      // An earlier process with this same pid (an agent that is PID 1 in its container each start).
      writeFileSync(join(root, 'tmp', `${process.pid}.abcd.3.tmp`), 'half a manifest');
      new FsManifestStore(root);
      expect(readdirSync(join(root, 'tmp'))).toEqual([`${live.pid}.abcd.2.tmp`]);
    } finally {
      live.kill();
    }
  });
});
