// A FleetStore whose commits go through a given function (fault injection in integration
// tests); every other call goes to the real store.
import type { FleetStore, StoreWrite } from '../domain/ports.ts';

export function withCommitAt(store: FleetStore, commitAt: FleetStore['commitAt']): FleetStore {
  return new Proxy(store, {
    get(target, prop) {
      if (prop === 'commitAt') return commitAt;
      if (prop === 'commit') return async (writes: readonly StoreWrite[]) => (await commitAt(writes)) > 0;
      const v = Reflect.get(target, prop, target) as unknown;
      return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v;
    },
  });
}
