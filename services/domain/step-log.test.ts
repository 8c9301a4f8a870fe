import { describe, expect, it } from 'vitest';
import pino from 'pino';
import { capSteps } from './step-log.ts';
import { Executor } from './executor.ts';
import type { ExecutorDeps } from './executor.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import type { OperationRec, StepRec } from './records.ts';
import type { StoreWrite } from './ports.ts';

const ended = (n: number): StepRec => ({ hostId: 'h', status: 'done', attempt: 1, endedAt: n });
const op = (steps: Record<string, StepRec>): OperationRec => ({ id: 'op-1', tenantId: 't', kind: 'drain', state: 'running', createdAt: 1, updatedAt: 1, targetId: 'F', input: {}, progress: { done: 0, total: 0, message: '', bytesTransferred: 0 }, result: null, error: null, steps }) as unknown as OperationRec;

describe('capSteps', () => {
  it('keepsTheLatestEndedStepsAndEveryRunningOne_countingTheRestOnceWhateverPutsThemBack', () => {
    const steps: Record<string, StepRec> = {};
    for (let i = 0; i < 10; i++) steps[`s${i}`] = ended(100 + i);
    steps.running = { hostId: 'h', status: 'sent', attempt: 1, sentAt: 1 };
    const o = op({ ...steps });
    const omitted = new Set<string>();
    capSteps(o, omitted, 4);
    expect(Object.keys(o.steps).sort()).toEqual(['running', 's6', 's7', 's8', 's9']);
    expect(o.stepsOmitted).toBe(6);
    // The next write merges the whole step log back in: the same steps go, counted once.
    Object.assign(o.steps, steps);
    capSteps(o, omitted, 4);
    expect(o.stepsOmitted).toBe(6);
    expect(Object.keys(o.steps)).toHaveLength(5);
  });

  it('leavesAnOpWithFewStepsAsItIs', () => {
    const o = op({ a: ended(1), b: ended(2) });
    capSteps(o, new Set(), 4);
    expect(Object.keys(o.steps)).toEqual(['a', 'b']);
    expect(o.stepsOmitted).toBeUndefined();
  });
});

describe('Executor op writes', () => {
  it('anOpWithThousandsOfSteps_writesARecordOfTheLatest512AndCountsTheRest_onEveryWrite', async () => {
    // A drain that moved 1,000 sandboxes (4 steps each) rewrote every step with every write:
    // bytes growing with the square of the host's size, and past etcd's request limit.
    const rec = op({});
    let rev = 10;
    const writes: StoreWrite[] = [];
    const store = new Proxy({
      getOp: async () => ({ value: structuredClone(rec), modRevision: rev }),
      commitAt: async (w: StoreWrite[]) => {
        writes.push(...w);
        const o = w.find((x): x is Extract<StoreWrite, { kind: 'op' }> => x.kind === 'op');
        if (o) Object.assign(rec, structuredClone(o.value));
        return ++rev;
      },
    } as Record<string, unknown>, { get: (t, k) => (k in t ? t[k as string] : k === 'then' ? undefined : async () => []) }) as unknown as ExecutorDeps['store'];
    const ex = new Executor({ store, bus: {} as ExecutorDeps['bus'], clock: { now: () => 5 }, log: pino({ level: 'silent' }), heard: new HeartbeatRegistry(), signer: {} as ExecutorDeps['signer'], config: { liveness: { suspectAfterMs: 5000, lostAfterMs: 15_000 }, stepTimeoutMs: 100, stepAttempts: 1, chunkBytes: 1 << 18 } });
    const inner = ex as unknown as { active: boolean; stepLog: Map<string, OperationRec['steps']>; updateOp(t: string, id: string, m: (o: OperationRec) => void): Promise<OperationRec> };
    inner.active = true;
    const log: OperationRec['steps'] = {};
    for (let i = 0; i < 4000; i++) log[`migrate/S${i}/step${i % 4}`] = ended(1000 + i);
    inner.stepLog.set('op-1', log);
    await inner.updateOp('t', 'op-1', () => undefined);
    await inner.updateOp('t', 'op-1', (o) => (o.progress.done = 1));
    const ops = writes.filter((w): w is Extract<StoreWrite, { kind: 'op' }> => w.kind === 'op');
    expect(ops).toHaveLength(2);
    for (const w of ops) {
      expect(Object.keys(w.value.steps)).toHaveLength(512);
      expect(w.value.stepsOmitted).toBe(4000 - 512);
      expect(JSON.stringify(w.value).length).toBeLessThan(128 * 1024);
    }
    expect(Object.keys(ops[1]!.value.steps)).toContain('migrate/S3999/step3');
  });
});
