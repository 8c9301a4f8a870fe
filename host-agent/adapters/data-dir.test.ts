import { spawn } from 'node:child_process';
import { chmodSync, existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it, vi } from 'vitest';
import type * as FsPromises from 'node:fs/promises';
import { identityOf } from '../../deploy/fleet/proc-identity.ts';
import { DATA_DIR_LOCK, DataDirInUseError, ensurePrivateDataDir, lockDataDir } from './data-dir.ts';

// A read of a lock file can be held after it has read (as when the agent that read it is slow to
// go on): heldRead, once armed, holds the next one until its release is called.
const gate = vi.hoisted(() => ({ armed: undefined as Promise<void> | undefined, reading: () => {} }));
vi.mock('node:fs/promises', async (importReal) => {
  const real = await importReal<typeof FsPromises>();
  const readFile = (async (...args: Parameters<typeof real.readFile>) => {
    const text = await real.readFile(...args);
    const held = gate.armed;
    if (held && String(args[0]).endsWith('agent.lock')) {
      gate.armed = undefined;
      gate.reading();
      await held;
    }
    return text;
  }) as typeof real.readFile;
  return { ...real, readFile, default: { ...real, readFile } };
});
/** Arms the gate: `read` resolves once a lock file has been read and held; `release` lets it go on. */
function heldRead(): { read: Promise<void>; release: () => void } {
  let release!: () => void;
  gate.armed = new Promise((r) => (release = r));
  const read = new Promise<void>((r) => (gate.reading = r));
  return { read, release };
}

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

describe('lockDataDir', () => {
  const ours = (): string => `${process.pid} ${identityOf(process.pid).startTime} ${identityOf(process.pid).bootId}\n`;

  it('lockDataDir_whileALiveAgentHoldsIt_isRefusedNamingFF_DATA_DIRAndThatPid', async () => {
    const dir = temp();
    const first = await lockDataDir(dir);
    expect(readFileSync(join(dir, DATA_DIR_LOCK), 'utf8')).toBe(ours());
    const second = lockDataDir(dir);
    await expect(second).rejects.toBeInstanceOf(DataDirInUseError);
    await expect(second).rejects.toThrow(new RegExp(`FF_DATA_DIR ${dir} .*pid ${process.pid}`));
    // The refused one took nothing away and left nothing behind.
    expect(readdirSync(dir)).toEqual([DATA_DIR_LOCK]);
    await first.release();
  });

  it('lockDataDir_whoseLockNamesAnExitedProcess_takesItOver', async () => {
    const dir = temp();
    const child = spawn('sleep', ['30']);
    const id = identityOf(child.pid!);
    child.kill('SIGKILL');
    await new Promise((r) => child.on('exit', r));
    writeFileSync(join(dir, DATA_DIR_LOCK), `${child.pid} ${id.startTime} ${id.bootId}\n`);
    const lock = await lockDataDir(dir);
    expect(readFileSync(join(dir, DATA_DIR_LOCK), 'utf8')).toBe(ours());
    expect(readdirSync(dir)).toEqual([DATA_DIR_LOCK]);
    await lock.release();
  });

  it('lockDataDir_whoseLockNamesAPidNowReusedByAnotherProcess_orNoProcess_takesItOver', async () => {
    // This process's PID, but another start time (the agent that wrote it is gone, its PID
    // given to us); and a lock a power loss left empty.
    for (const stale of [`${process.pid} ${identityOf(process.pid).startTime + 1} ${identityOf(process.pid).bootId}\n`, '']) {
      const dir = temp();
      writeFileSync(join(dir, DATA_DIR_LOCK), stale);
      const lock = await lockDataDir(dir);
      expect(readFileSync(join(dir, DATA_DIR_LOCK), 'utf8')).toBe(ours());
      await lock.release();
    }
  });

  it('lockDataDir_afterRelease_canBeTakenAgain_andReleaseLeavesAnotherHoldersLock', async () => {
    const dir = temp();
    const lock = await lockDataDir(dir);
    await lock.release();
    expect(existsSync(join(dir, DATA_DIR_LOCK))).toBe(false);
    const again = await lockDataDir(dir);
    await again.release();
    // Taken over since (this agent was thought dead): the late release leaves the new holder's lock.
    const late = await lockDataDir(dir);
    writeFileSync(join(dir, DATA_DIR_LOCK), '1 1 other\n');
    await late.release();
    expect(readFileSync(join(dir, DATA_DIR_LOCK), 'utf8')).toBe('1 1 other\n');
  });

  it('lockDataDir_ofAgentsStartingTogetherOverAStaleLock_givesItToOne', async () => {
    // Both read the dead agent's lock; one takes it over before the other goes on. The other
    // must then be refused (the first is this process, alive), not replace the first's lock.
    const dir = temp();
    writeFileSync(join(dir, DATA_DIR_LOCK), '999999999 1 gone\n');
    const slow = heldRead();
    const late = lockDataDir(dir).then(() => 'taken', (e: unknown) => e);
    await slow.read;
    const first = await lockDataDir(dir);
    slow.release();
    expect(await late).toBeInstanceOf(DataDirInUseError);
    expect(readFileSync(join(dir, DATA_DIR_LOCK), 'utf8')).toBe(ours());
    expect(readdirSync(dir)).toEqual([DATA_DIR_LOCK]);
    await first.release();
  });
});
