// Step results journalled as files: <dir>/<opId>/<stepId-encoded>.bin, written through a
// temporary file and a rename so a crash never leaves a half-written result. `prune` drops
// the results of ops that finished long ago (past any redelivery: the work stream keeps a
// message at most 24 h), so the journal does not grow with every op the host ever ran.
//
// A temp file is `<step>.bin.tmp-<pid>.<nonce>`, the nonce drawn once per process: one a
// killed writer left is removed when the journal opens (every temp without this process's
// nonce), whatever the retention. The pid alone would not do: an agent that is PID 1 in its
// container has the pid of every agent before it.
import { mkdir, readdir, readFile, rename, rm, stat, writeFile } from 'node:fs/promises';
import { createHash, randomBytes } from 'node:crypto';
import { join } from 'node:path';
import type { Journal, LeaderTerm } from '../../domain/agent.ts';
import { writeFileDurable } from '../durable.ts';
import { oneAtATime } from '../../domain/one-at-a-time.ts';

const SAFE = /^[A-Za-z0-9_-]+$/;
/** Longer op ids (the scheduler's own, e.g. a stray VM's stop names the host and the sandbox) go by a digest. */
const MAX_NAME = 64;

/** What this process's temp files end with (`.tmp-<pid>.<nonce>`); exported for tests. */
export const TEMP_SUFFIX = `.tmp-${process.pid}.${randomBytes(6).toString('hex')}`;
/** A journal temp file of any process: this version's names and the older `.tmp-<pid>`. */
const TEMP = /\.tmp-\d+(\.[0-9a-f]+)?$/;

/** An op's directory: its id, or for a long one a digest of it ('~' is in no op id). */
function opDir(opId: string): string {
  return opId.length <= MAX_NAME ? opId : `~${createHash('sha256').update(opId).digest('hex').slice(0, 40)}`;
}

export class FsJournal implements Journal {
  /** Op directories this process made (only prune removes them), so a put skips the mkdir. */
  private readonly made = new Set<string>();
  /**
   * Puts and prune's removal, by op directory, one after another: a prune that read an op's
   * old mtime and then removed its directory could take a result a put had just written there
   * (a lost result runs its step again when the work is redelivered), or make the put fail.
   */
  private readonly busy = new Map<string, Promise<unknown>>();
  /**
   * Settles once the temp files earlier processes left are removed (started at construction,
   * in the background: nothing waits for it, since this process's own temps are never
   * touched by it). Never rejects: a sweep that fails leaves only small files.
   */
  readonly swept: Promise<void>;

  constructor(private readonly dir: string) {
    this.swept = this.sweepTemps().catch(() => undefined);
  }

  private path(opId: string, stepId: string): string {
    if (!SAFE.test(opId)) throw new Error(`journal: bad op id ${JSON.stringify(opId)}`);
    const step = Buffer.from(stepId).toString('base64url');
    return join(this.dir, opDir(opId), `${step.length <= 200 ? step : `~${createHash('sha256').update(stepId).digest('base64url')}`}.bin`);
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
    const dir = opDir(opId);
    return oneAtATime(this.busy, dir, async () => {
      if (!this.made.has(dir)) {
        await mkdir(join(this.dir, dir), { recursive: true });
        if (this.made.size >= 10_000) this.made.clear();
        this.made.add(dir);
      }
      const tmp = `${p}${TEMP_SUFFIX}`;
      try {
        await writeFile(tmp, result);
        await rename(tmp, p);
      } catch (e) {
        // A write or rename that failed (a full disk, an I/O error) leaves no temp file behind
        // (as writeFileDurable): left, it stayed until the next agent start, and on a full disk
        // every failed put added one.
        await rm(tmp, { force: true }).catch(() => undefined);
        throw e;
      }
    });
  }

  /** The newest leader term (Journal.leaderTerm): a file beside the op directories, which prune leaves. */
  private get termPath(): string {
    return join(this.dir, 'leader-term');
  }

  /**
   * `<cluster> <term>`, decimal, then ` <store>` when the store is known (LeaderTerm.store):
   * one file, replaced whole, so a crash keeps one record or the other. An agent of the version
   * before reads only the first form: rolled back, it cannot read a record with a store, and
   * takes work of any term until a leader sends some (it logs so).
   */
  async leaderTerm(): Promise<LeaderTerm | undefined> {
    let text: string;
    try {
      text = (await readFile(this.termPath, 'utf8')).trim();
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code === 'ENOENT') return undefined;
      throw e;
    }
    const m = /^(\d{1,20}) (\d{1,20})(?: (\d{1,20}))?$/.exec(text);
    if (!m) throw new Error(`journal: ${this.termPath} holds no leader term: ${JSON.stringify(text.slice(0, 60))}`);
    const store = m[3] ? BigInt(m[3]) : 0n;
    // No store: when it was written (LeaderTerm.at), which its store existed by.
    return { cluster: BigInt(m[1]!), term: BigInt(m[2]!), ...(store ? { store } : { at: (await stat(this.termPath)).mtimeMs }) };
  }

  async setLeaderTerm(term: LeaderTerm): Promise<void> {
    await mkdir(this.dir, { recursive: true });
    // Durable: a term forgotten by an OS crash would let a deposed leader's redelivered step act.
    await writeFileDurable(this.termPath, `${term.cluster} ${term.term}${term.store ? ` ${term.store}` : ''}\n`);
  }

  /** Removes every temp file in the op directories that this process did not make (TEMP_SUFFIX). */
  private async sweepTemps(): Promise<void> {
    for (const opId of await readdir(this.dir).catch(() => [] as string[])) {
      const d = join(this.dir, opId);
      for (const f of await readdir(d).catch(() => [] as string[])) {
        if (TEMP.test(f) && !f.endsWith(TEMP_SUFFIX)) await rm(join(d, f), { force: true });
      }
    }
  }

  /**
   * Removes every op whose results were last written before `olderThanMs` (epoch ms; the op
   * directory's mtime). Returns how many ops went.
   */
  async prune(olderThanMs: number): Promise<number> {
    let removed = 0;
    for (const opId of await readdir(this.dir).catch(() => [] as string[])) {
      const d = join(this.dir, opId);
      // Read and removed with no put of the op in between (busy).
      const gone = await oneAtATime(this.busy, opId, async () => {
        const st = await stat(d).catch(() => undefined);
        if (!st?.isDirectory() || st.mtimeMs >= olderThanMs) return false;
        await rm(d, { recursive: true, force: true });
        this.made.delete(opId);
        return true;
      });
      if (gone) removed++;
    }
    return removed;
  }
}
