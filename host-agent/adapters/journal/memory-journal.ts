// Step results kept in memory only: for agents that are never restarted (the fake agents of
// bench:placement, FF_FAKE_STATE=memory) and for unit tests. A restart loses them, so a real
// agent uses FsJournal.
import type { Journal, LeaderTerm } from '../../domain/agent.ts';

export class MemoryJournal implements Journal {
  /** By `<opId>/<stepId>`. */
  readonly results = new Map<string, Uint8Array>();

  get(opId: string, stepId: string): Promise<Uint8Array | undefined> {
    return Promise.resolve(this.results.get(`${opId}/${stepId}`));
  }

  /** When each op's results were last written. */
  private readonly lastAt = new Map<string, number>();

  put(opId: string, stepId: string, result: Uint8Array): Promise<void> {
    this.results.set(`${opId}/${stepId}`, result);
    this.lastAt.delete(opId);
    this.lastAt.set(opId, Date.now());
    return Promise.resolve();
  }

  /** The newest leader term kept (setLeaderTerm). */
  term: LeaderTerm | undefined;

  leaderTerm(): Promise<LeaderTerm | undefined> {
    return Promise.resolve(this.term);
  }

  setLeaderTerm(term: LeaderTerm): Promise<void> {
    this.term = term;
    return Promise.resolve();
  }

  prune(olderThanMs: number): Promise<number> {
    let removed = 0;
    // lastAt is in write order (re-inserted on each put): the oldest come first.
    for (const [opId, at] of this.lastAt) {
      if (at >= olderThanMs) break;
      this.lastAt.delete(opId);
      for (const k of this.results.keys()) if (k.startsWith(`${opId}/`)) this.results.delete(k);
      removed++;
    }
    return Promise.resolve(removed);
  }
}
