import { describe, expect, it } from 'vitest';
import { fleetStoreId } from './election.ts';

describe('fleet store ids', () => {
  it('fleetStoreId_ofAStoreMadeLater_isLarger_andEachIsANonZeroUint64', () => {
    const made = (ms: number, rnd: string): bigint => BigInt(fleetStoreId(`${ms}.${rnd}`));
    const first = made(1_700_000_000_000, 'aa');
    // Made a second later, whatever the random part: larger (agents keep the newest store's work).
    for (const rnd of ['00', 'ff', 'a1b2']) expect(made(1_700_000_001_000, rnd)).toBeGreaterThan(first);
    // The same incarnation, the same id (every leader of one store sends the same).
    expect(made(1_700_000_000_000, 'aa')).toBe(first);
    expect(made(1_700_000_000_000, 'ab')).not.toBe(first);
    for (const id of [first, BigInt(fleetStoreId('not-an-incarnation')), BigInt(fleetStoreId(`${2 ** 40}.x`))]) {
      expect(id).toBeGreaterThan(0n);
      expect(id).toBeLessThan(2n ** 64n);
    }
  });
});
