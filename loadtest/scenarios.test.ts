import { describe, expect, it } from 'vitest';
import { Driver, OperationKind } from './scenarios.ts';
import type { Api } from './scenarios.ts';
import { OperationState } from '../proto/gen/forkfleet/v1/fleet_pb.ts';

/**
 * The fleet API as far as the driver uses it for a fork. The fork's children exist (with the
 * fork's labels) once it is submitted; its operation stays RUNNING until cancelled, or for
 * good when `hangs`. Destroys succeed at once.
 */
function fakeApi(o: { hangs: boolean }) {
  const sandboxes = new Map<string, Record<string, string>>();
  const cancelled: string[] = [];
  const destroyed: string[] = [];
  let release: (() => void) | undefined;
  const forkDone = new Promise<void>((r) => (release = r));
  let n = 0;
  const api = {
    forkSandbox: async (req: { count: number; labels: Record<string, string> }) => {
      for (let i = 0; i < req.count; i++) sandboxes.set(`sb-${n++}`, req.labels);
      return { id: 'op-fork', kind: OperationKind.FORK };
    },
    destroySandbox: async (req: { sandboxId: string }) => {
      destroyed.push(req.sandboxId);
      sandboxes.delete(req.sandboxId);
      return { id: `op-d-${req.sandboxId}`, kind: OperationKind.DESTROY };
    },
    cancelOperation: async (req: { operationId: string }) => {
      cancelled.push(req.operationId);
      release!();
      return { id: req.operationId };
    },
    waitOperation: async (req: { operationId: string }) => {
      if (req.operationId !== 'op-fork') return { id: req.operationId, state: OperationState.SUCCEEDED, result: { case: undefined } };
      if (o.hangs) await forkDone;
      return { id: 'op-fork', kind: OperationKind.FORK, state: cancelled.length ? OperationState.CANCELLED : OperationState.RUNNING, result: { case: undefined } };
    },
    listSandboxes: async (req: { labels: Record<string, string>; pageToken: string }) => ({
      sandboxes: [...sandboxes].filter(([, l]) => Object.entries(req.labels).every(([k, v]) => l[k] === v)).map(([id]) => ({ id })),
      nextPageToken: '',
    }),
  };
  return { api: api as unknown as Api, sandboxes, cancelled, destroyed };
}

describe('load-test driver', () => {
  it('fork_whenItsOperationTimesOut_cancelsItAndDestroysTheChildrenItMade', async () => {
    const f = fakeApi({ hangs: false });
    const d = new Driver(f.api, 1000);
    await expect(d.fork('snap-1', 2, {})).rejects.toThrow(/RUNNING after 1000 ms/);
    expect(f.cancelled).toEqual(['op-fork']);
    expect(f.destroyed.sort()).toEqual(['sb-0', 'sb-1']);
    expect(f.sandboxes.size).toBe(0);
  });

  it('tidy_whileAForkIsUnderWay_cancelsItAndDestroysWhatItMade', async () => {
    const f = fakeApi({ hangs: true });
    const d = new Driver(f.api, 1000);
    const forking = d.fork('snap-1', 3, {}).catch(() => undefined);
    await new Promise((r) => setTimeout(r, 20));
    await d.tidy();
    expect(f.cancelled).toContain('op-fork');
    expect(f.sandboxes.size).toBe(0);
    await forking;
  });
});
