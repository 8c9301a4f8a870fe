// followLink (agent-bus.ts): the agent's NATS link told in its log and its metrics, over a status
// stream of our own making (a real server cannot be made to refuse and drop a link on cue).
import { describe, expect, it } from 'vitest';
import pino from 'pino';
import type { Status } from 'nats';
import { PromAgentMetrics } from '../metrics.ts';
import { followLink } from './agent-bus.ts';

async function* statuses(list: Status[]): AsyncGenerator<Status> {
  yield* list;
}

describe('followLink', () => {
  it('linkThatDropsIsRefusedAndComesBack_isLoggedOncePerEvent_andTheConnectedGaugeFollowsIt', async () => {
    const lines: Array<{ level: number; msg: string; code?: string; subject?: string }> = [];
    const log = pino({ level: 'info' }, { write: (s: string) => void lines.push(JSON.parse(s)) });
    const m = new PromAgentMetrics();
    const connected = async (): Promise<number | undefined> => (await m.registry.getSingleMetric('forkfleet_agent_nats_connected')!.get()).values[0]?.value;
    const seen: number[] = [];
    const events: Status[] = [
      { type: 'disconnect', data: 'nats://10.0.0.1:4222' } as Status,
      { type: 'error', data: 'PERMISSIONS_VIOLATION', permissionContext: { operation: 'publish', subject: 'ff.heartbeat.h2' } } as Status,
      { type: 'pingTimer', data: 1 } as Status,
      { type: 'reconnect', data: 'nats://10.0.0.1:4222' } as Status,
    ];
    // The gauge is read as each event is handed on: 1 from the start, 0 while down, 1 back, 0 once closed.
    async function* watched(): AsyncGenerator<Status> {
      for await (const st of statuses(events)) {
        seen.push((await connected()) ?? -1);
        yield st;
      }
      seen.push((await connected()) ?? -1);
    }
    await followLink(watched(), log, (up) => m.natsConnected(up));
    expect(seen).toEqual([1, 0, 0, 0, 1]);
    expect(await connected()).toBe(0); // the status stream ends when the connection has closed
    expect(lines.map((l) => [l.level, l.msg])).toEqual([
      [40, expect.stringMatching(/NATS connection lost/)],
      [40, expect.stringMatching(/NATS server reported an error/)],
      [30, 'NATS connection back'],
    ]);
    expect(lines[1]).toMatchObject({ code: 'PERMISSIONS_VIOLATION', subject: 'ff.heartbeat.h2' });
  });
});
