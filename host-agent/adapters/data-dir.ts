// The agent's data directory (FF_DATA_DIR): every tenant's snapshot memory and disk chunks,
// images and VM files live under it, so it is root's alone. Only the top directory is made
// private: that closes the whole tree to other users without walking it (a large chunk store
// would take minutes), and the unit's UMask=0077 keeps what is made under it root's too.
//
// One agent per data directory (lockDataDir): an agent at start removes what a dead one left
// (relay sockets, chunk writes, scratch) and adopts or reaps the VMs under it. Run beside a
// live agent, it deleted that agent's files in use, and every VM of that agent, whose QMP
// that agent holds, failed adoption and was killed with its disk.
import { randomBytes } from 'node:crypto';
import { chmod, link, mkdir, readFile, rename, rm, stat, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { identityOf, isSameProcess, type ProcIdentity } from '../../deploy/fleet/proc-identity.ts';
import { ForkfleetError } from '../../proto/errors.ts';

/**
 * Makes `dir` (and missing parents) with mode 0700, or takes an existing one's group and other
 * bits away (an agent before this one made it 0755). Idempotent. Returns whether it changed a mode.
 */
export async function ensurePrivateDataDir(dir: string): Promise<boolean> {
  await mkdir(dir, { recursive: true, mode: 0o700 });
  if (((await stat(dir)).mode & 0o077) === 0) return false;
  await chmod(dir, 0o700);
  return true;
}

/** The lock file of a data directory: `<pid> <start time> <boot id>` of the agent holding it. */
export const DATA_DIR_LOCK = 'agent.lock';

/** Another agent runs from the data directory (its lock names a live process). */
export class DataDirInUseError extends ForkfleetError {
  readonly pid: number;
  constructor(dir: string, pid: number) {
    super('failed_precondition', `FF_DATA_DIR ${dir} is in use by another host agent, pid ${pid} (${join(dir, DATA_DIR_LOCK)}): stop it, or give this agent another FF_DATA_DIR`, { retryable: false });
    this.pid = pid;
  }
}

export interface DataDirLock {
  readonly path: string;
  /** Removes the lock if it is still this process's. Idempotent. */
  release(): Promise<void>;
}

interface Holder extends ProcIdentity {
  pid: number;
}

function holderOf(text: string): Holder | undefined {
  const [pid, startTime, bootId = ''] = text.trim().split(/\s+/);
  if (!pid || !/^\d+$/.test(pid) || !startTime || !/^\d+$/.test(startTime)) return undefined;
  return { pid: Number(pid), startTime: Number(startTime), bootId };
}

const errno = (e: unknown): unknown => (e as NodeJS.ErrnoException).code;

/** Agents found replacing each other's stale lock at once, after which one gives up. */
const LOCK_ATTEMPTS = 5;

/**
 * Takes `dir`'s lock for this process, or throws DataDirInUseError naming the agent that holds
 * it. The lock names its holder by PID, start time and boot id (proc-identity.ts): one whose
 * process has exited, or whose PID now names another process (after a reboot or a restart of
 * everything), holds nothing and is replaced; so is one that names no process (empty after a
 * power loss). It is made whole and then linked into place, so that it never exists without
 * its holder. A stale lock is moved aside before it is replaced, and one found to be another
 * agent's (taken between our read and our move) is put back: of two agents starting together
 * over a stale lock, one gets it and the other is refused.
 */
export async function lockDataDir(dir: string): Promise<DataDirLock> {
  const path = join(dir, DATA_DIR_LOCK);
  const me = identityOf(process.pid);
  const mine = `${process.pid} ${me.startTime} ${me.bootId}\n`;
  // Names of this call's own (two calls of one process must not share them).
  const own = `${path}.${process.pid}-${randomBytes(4).toString('hex')}`;
  const made = `${own}.new`;
  await writeFile(made, mine, { mode: 0o600 });
  try {
    for (let attempt = 1; ; attempt++) {
      try {
        await link(made, path);
        break;
      } catch (e) {
        if (errno(e) !== 'EEXIST') throw e;
      }
      const held = await readFile(path, 'utf8').catch((e: unknown) => {
        if (errno(e) === 'ENOENT') return undefined; // released meanwhile
        throw e;
      });
      if (held === undefined) continue;
      const holder = holderOf(held);
      if (holder && isSameProcess(holder.pid, holder)) throw new DataDirInUseError(dir, holder.pid);
      if (attempt >= LOCK_ATTEMPTS) throw new Error(`cannot take ${path}: agents starting at the same time keep replacing it`);
      await moveAsideIfStill(path, held, `${own}.stale`);
    }
  } finally {
    await rm(made, { force: true });
  }
  return {
    path,
    async release() {
      const held = await readFile(path, 'utf8').catch(() => undefined);
      if (held === mine) await rm(path, { force: true });
    },
  };
}

/** Removes the lock at `path` if it still reads `stale`; puts back one that does not. */
async function moveAsideIfStill(path: string, stale: string, aside: string): Promise<void> {
  try {
    await rename(path, aside);
  } catch (e) {
    if (errno(e) === 'ENOENT') return; // another agent moved it
    throw e;
  }
  try {
    if ((await readFile(aside, 'utf8')) !== stale) {
      await link(aside, path).catch((e: unknown) => {
        if (errno(e) !== 'EEXIST') throw e;
      });
    }
  } finally {
    await rm(aside, { force: true });
  }
}
