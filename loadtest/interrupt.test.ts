import { describe, expect, it } from 'vitest';
import { undoOnInterrupt } from './interrupt.ts';

describe('undoOnInterrupt', () => {
  it('undo_calledBySignalAndRunEnd_tearsDownOnce_andOffRemovesTheHandlers', async () => {
    const before = process.listenerCount('SIGINT');
    let runs = 0;
    const { undo, off } = undoOnInterrupt(async () => void runs++, () => undefined);
    expect(process.listenerCount('SIGINT')).toBe(before + 1);
    const [a, b] = [undo(), undo()];
    expect(a).toBe(b);
    await a;
    expect(runs).toBe(1);
    off();
    expect(process.listenerCount('SIGINT')).toBe(before);
  });
});
