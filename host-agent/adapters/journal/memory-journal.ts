// Step results kept in memory only: for agents that are never restarted (the fake agents of
// bench:placement, FF_FAKE_STATE=memory) and for unit tests. A restart loses them, so a real
// agent uses FsJournal.
import type { Journal } from '../../domain/agent.ts';

export class MemoryJournal implements Journal {
  /** By `<opId>/<stepId>`. */
  readonly results = new Map<string, Uint8Array>();

  get(opId: string, stepId: string): Promise<Uint8Array | undefined> {
    return Promise.resolve(this.results.get(`${opId}/${stepId}`));
  }

  put(opId: string, stepId: string, result: Uint8Array): Promise<void> {
    this.results.set(`${opId}/${stepId}`, result);
    return Promise.resolve();
  }
}
