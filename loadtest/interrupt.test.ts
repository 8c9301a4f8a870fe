import { describe, expect, it } from 'vitest';
import { RunStopped, stopThenUndo, undoOnInterrupt } from './interrupt.ts';

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

describe('stopThenUndo', () => {
  it('undo_beforeTheLoopEnded_stopsTheRun_andTearsDownOnlyOnceTheLoopHasUnwound', async () => {
    const order: string[] = [];
    const run = stopThenUndo(async () => void order.push('teardown'), () => undefined);
    try {
      // As a Ctrl-C does while a sample runs: nothing may start behind the teardown's back.
      const undone = run.undo();
      expect(run.signal.aborted).toBe(true);
      expect(() => run.check('fork_same_host_1')).toThrow(RunStopped);
      await new Promise((r) => setTimeout(r, 20));
      expect(order).toEqual([]);
      order.push('loop ended');
      run.loopEnded();
      await undone;
      expect(order).toEqual(['loop ended', 'teardown']);
      // The run's own end gets the same teardown, not a second one.
      await run.undo();
      expect(order).toEqual(['loop ended', 'teardown']);
    } finally {
      run.off();
    }
  });

  it('check_beforeAStop_passes', () => {
    const run = stopThenUndo(async () => undefined, () => undefined);
    run.off();
    expect(() => run.check('x')).not.toThrow();
  });
});
