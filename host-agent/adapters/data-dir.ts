// The agent's data directory (FF_DATA_DIR): every tenant's snapshot memory and disk chunks,
// images and VM files live under it, so it is root's alone. Only the top directory is made
// private: that closes the whole tree to other users without walking it (a large chunk store
// would take minutes), and the unit's UMask=0077 keeps what is made under it root's too.
import { chmod, mkdir, stat } from 'node:fs/promises';

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
