// Step results journalled as files: <dir>/<opId>/<stepId-encoded>.bin, written through a
// temporary file and a rename so a crash never leaves a half-written result.
import { mkdir, readFile, rename, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import type { Journal } from '../../domain/agent.ts';

const SAFE = /^[A-Za-z0-9_-]{1,64}$/;

export class FsJournal implements Journal {
  /** Op directories this process made (nothing removes them), so a put skips the mkdir. */
  private readonly made = new Set<string>();

  constructor(private readonly dir: string) {}

  private path(opId: string, stepId: string): string {
    if (!SAFE.test(opId)) throw new Error(`journal: bad op id ${JSON.stringify(opId)}`);
    return join(this.dir, opId, `${Buffer.from(stepId).toString('base64url')}.bin`);
  }

  async get(opId: string, stepId: string): Promise<Uint8Array | undefined> {
    try {
      return await readFile(this.path(opId, stepId));
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code === 'ENOENT') return undefined;
      throw e;
    }
  }

  async put(opId: string, stepId: string, result: Uint8Array): Promise<void> {
    const p = this.path(opId, stepId);
    if (!this.made.has(opId)) {
      await mkdir(join(this.dir, opId), { recursive: true });
      if (this.made.size >= 10_000) this.made.clear();
      this.made.add(opId);
    }
    const tmp = `${p}.tmp-${process.pid}`;
    await writeFile(tmp, result);
    await rename(tmp, p);
  }
}
