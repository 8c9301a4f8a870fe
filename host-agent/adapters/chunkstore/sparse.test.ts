import { describe, expect, it } from 'vitest';
import { nonZeroRuns, PAGE, ZERO_PAGE } from './sparse.ts';

function pages(spec: string): Buffer {
  // One character per page: '0' a zero page, anything else a page with data.
  const b = Buffer.alloc(spec.length * PAGE);
  for (let i = 0; i < spec.length; i++) if (spec[i] !== '0') b[i * PAGE + PAGE - 1] = 1;
  return b;
}

describe('nonZeroRuns', () => {
  it('nonZeroRuns_mergesAdjacentDataPagesAndSkipsZeroPages', () => {
    expect(nonZeroRuns(pages('x0xx00x'), ZERO_PAGE, PAGE)).toEqual([0, PAGE, 2 * PAGE, 4 * PAGE, 6 * PAGE, 7 * PAGE]);
  });

  it('nonZeroRuns_allZeroOrAllData_givesNoRunOrOneRun', () => {
    expect(nonZeroRuns(pages('0000'), ZERO_PAGE, PAGE)).toEqual([]);
    expect(nonZeroRuns(pages('xxxx'), ZERO_PAGE, PAGE)).toEqual([0, 4 * PAGE]);
  });

  it('nonZeroRuns_partialLastPage_countsAsAPage', () => {
    const b = Buffer.alloc(PAGE + 100);
    b[PAGE + 99] = 7;
    expect(nonZeroRuns(b, ZERO_PAGE, PAGE)).toEqual([PAGE, PAGE + 100]);
    expect(nonZeroRuns(Buffer.alloc(PAGE + 100), ZERO_PAGE, PAGE)).toEqual([]);
  });
});
