import { describe, expect, it } from 'vitest';
import { naiveCopied, speedup } from './naive-copy.ts';

const report = (o: object): string => `starting\n${JSON.stringify(o)}\n`;

describe('naive copy baseline', () => {
  it('naiveCopied_everyByteReceived_isTheReport', () => {
    expect(naiveCopied({ code: 0, stdout: report({ bytes: 1000, seconds: 2.5 }), stderr: '' }, 1000)).toEqual({ bytes: 1000, seconds: 2.5 });
  });

  it('naiveCopied_aShortCopy_throwsInsteadOfPassingForAFastOne', () => {
    expect(() => naiveCopied({ code: 0, stdout: report({ bytes: 600, seconds: 0.5 }), stderr: '' }, 1000)).toThrow(/received 600 of 1000 bytes/);
  });

  it('naiveCopied_aReceiverThatFailed_throws', () => {
    expect(() => naiveCopied({ code: 1, stdout: '', stderr: 'ECONNRESET' }, 1000)).toThrow(/exit 1.*ECONNRESET/);
    expect(() => naiveCopied({ code: null, stdout: report({ bytes: 1000, seconds: 2 }), stderr: '' }, 1000)).toThrow(/exit null/);
  });

  it('speedup_ofASkippedSide_isNull', () => {
    expect(speedup(3, 1.5)).toBe(2);
    expect(speedup(null, 1.5)).toBeNull();
    expect(speedup(3, null)).toBeNull();
  });
});
