// A NATS connection closed for good (nats.js gave up reconnecting) ends the process, unless the
// process is stopping anyway.
import { describe, expect, it } from 'vitest';
import { pino } from 'pino';
import type { Logger } from 'pino';
import { exitWhenClosedForGood } from './closed.ts';

/** A logger that keeps what it logs, level and message. */
function recording(): { log: Logger; lines: Array<{ level: number; msg: string; err?: { message?: string } }> } {
  const lines: Array<{ level: number; msg: string; err?: { message?: string } }> = [];
  const log = pino({ level: 'trace' }, { write: (s: string) => void lines.push(JSON.parse(s)) });
  return { log, lines };
}

const refused = { closed: () => Promise.resolve(new Error('Authorization Violation')) };

describe('exitWhenClosedForGood', () => {
  it('connectionClosedByRepeatedAuthErrors_logsFatalWithTheError_runsBeforeExit_andExits1', async () => {
    const { log, lines } = recording();
    const done: string[] = [];
    await exitWhenClosedForGood(refused, { log, isStopping: () => false, beforeExit: async () => void done.push('resigned'), exit: (code) => void done.push(`exit ${code}`) });
    expect(done).toEqual(['resigned', 'exit 1']);
    const fatal = lines.find((l) => l.level === 60);
    expect(fatal?.msg).toMatch(/closed for good/);
    expect(fatal?.err?.message).toBe('Authorization Violation');
  });

  it('connectionClosedWhileStopping_exitsNot', async () => {
    const { log, lines } = recording();
    const exits: number[] = [];
    await exitWhenClosedForGood(refused, { log, isStopping: () => true, beforeExit: async () => exits.push(-1), exit: (code) => void exits.push(code) });
    expect(exits).toEqual([]);
    expect(lines).toEqual([]);
  });

  it('beforeExitThatHangsOrFails_doesNotHoldTheExit', async () => {
    const { log } = recording();
    const exits: number[] = [];
    await exitWhenClosedForGood(refused, { log, isStopping: () => false, beforeExit: () => new Promise(() => undefined), beforeExitMs: 20, exit: (code) => void exits.push(code) });
    await exitWhenClosedForGood(refused, { log, isStopping: () => false, beforeExit: () => Promise.reject(new Error('etcd out of reach')), exit: (code) => void exits.push(code) });
    expect(exits).toEqual([1, 1]);
  });
});
