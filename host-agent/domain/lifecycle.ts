// VM lifecycle transition table (CONVENTIONS.md §7). Adapters call assertTransition before
// they change a VM's state, so an impossible sequence fails loudly instead of corrupting state.
import type { VmState } from './vmm.ts';

export const VM_TRANSITIONS: Readonly<Record<VmState, readonly VmState[]>> = {
  starting: ['running', 'crashed', 'destroying'],
  running: ['paused', 'snapshotting', 'crashed', 'destroying'],
  paused: ['running', 'snapshotting', 'crashed', 'destroying'],
  // A snapshot returns the VM to the state it was taken in (running or paused).
  snapshotting: ['running', 'paused', 'crashed', 'destroying'],
  crashed: ['destroying'],
  destroying: ['destroyed'],
  destroyed: [],
};

/** States that own a QEMU process. */
export const LIVE_VM_STATES: ReadonlySet<VmState> = new Set(['starting', 'running', 'paused', 'snapshotting']);

export function canTransition(from: VmState, to: VmState): boolean {
  return VM_TRANSITIONS[from].includes(to);
}
