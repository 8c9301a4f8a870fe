// How a migration stream between hosts is waited for (ADR 0015, StreamWait): as long as it
// moves, not for a fixed 120 s, which cut every large VM's stream. Against a stand-in for
// QEMU's side of QMP (our QmpClient's surface): query-migrate's ram.transferred follows a
// script, and a MIGRATION event says how the stream ended; its wait times out as QmpClient's
// does. Minutes pass on vitest's fake clock, the stall tests use small limits on the real one.
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import { afterAll, afterEach, describe, expect, it, vi } from 'vitest';
import type { QmpClient, QmpEvent } from '../qmp/client.ts';
import { QmpTimeoutError } from '../../errors.ts';
import type { LocalSnapshot } from '../../domain/vmm.ts';
import { incomingAndWait, migrateAndWait, MIGRATION_STREAM_WAIT, QemuVmmDriver, type StreamWait } from './driver.ts';
import type { Standby } from './standby.ts';

const base = mkdtempSync(join(tmpdir(), 'ff-migrate-stream-wait-'));
afterAll(() => rmSync(base, { recursive: true, force: true }));
afterEach(() => void vi.useRealTimers());

/**
 * A QEMU whose stream has sent `transferred(ms since the migration began)` bytes and ends
 * ('completed') at `endsAtMs`, or never (undefined).
 */
function fakeQemu(transferred: (ms: number) => number, endsAtMs?: number): QmpClient & { queries: number } {
  const events: QmpEvent[] = [];
  const waiters: Array<() => void> = [];
  let began: number | undefined;
  const qmp = {
    mark: 0,
    queries: 0,
    closed: false,
    close: () => undefined,
    async execute(cmd: string): Promise<unknown> {
      if (cmd === 'migrate' || cmd === 'migrate-incoming') {
        began = Date.now();
        if (endsAtMs !== undefined) {
          setTimeout(() => {
            events.push({ event: 'MIGRATION', data: { status: 'completed' }, timestampMs: Date.now() });
            for (const w of waiters.splice(0)) w();
          }, endsAtMs);
        }
      }
      if (cmd === 'query-migrate') {
        qmp.queries++;
        return began === undefined ? {} : { status: 'active', ram: { transferred: transferred(Date.now() - began) } };
      }
      return {};
    },
    waitEvent(name: string, timeoutMs: number, match: (e: QmpEvent) => boolean): Promise<QmpEvent> {
      return new Promise((resolve, reject) => {
        const t = setTimeout(() => reject(new QmpTimeoutError(`event ${name}`, timeoutMs)), timeoutMs);
        const look = (): void => {
          const e = events.find((x) => x.event === name && match(x));
          if (!e) return void waiters.push(look);
          clearTimeout(t);
          resolve(e);
        };
        look();
      });
    },
  };
  return qmp as unknown as QmpClient & { queries: number };
}

/** 1 GB/s: a stream that keeps moving. */
const moving = (ms: number): number => ms * 1e6;

/** Runs `p` while the fake clock moves on by `ms`; its outcome ('done' or the error). */
async function onFakeClock(p: Promise<unknown>, ms: number): Promise<unknown> {
  const outcome = p.then(() => 'done', (e: unknown) => e);
  for (let t = 0; t < ms; t += 1000) await vi.advanceTimersByTimeAsync(1000);
  return outcome;
}

const small: StreamWait = { startMs: 300, stallMs: 150, maxMs: 20_000, pollMs: 10 };

describe('a migration stream between hosts', () => {
  it('migrateAndWait_aStreamThatKeepsMovingPastTheOldTwoMinutes_isWaitedForToItsEnd', async () => {
    vi.useFakeTimers({ toFake: ['setTimeout', 'clearTimeout', 'Date'] });
    const qmp = fakeQemu(moving, 200_000);
    expect(await onFakeClock(migrateAndWait(qmp, 'tcp:10.0.0.2:4000', MIGRATION_STREAM_WAIT), 201_000)).toBe('done');
  });

  it('migrateAndWait_aStreamThatStopsMoving_failsOnceItHasSentNothingForTheStallWindow', async () => {
    // Moves for 400 ms (past the start window), then sends nothing.
    const qmp = fakeQemu((ms) => Math.min(ms, 400) * 1e6);
    const t0 = Date.now();
    await expect(migrateAndWait(qmp, 'tcp:10.0.0.2:4000', small)).rejects.toThrow(/migration stalled: nothing sent for \d+ ms/);
    const took = Date.now() - t0;
    expect(took).toBeGreaterThanOrEqual(400 + small.stallMs);
    expect(took).toBeLessThan(5_000);
  });

  it('migrateAndWait_aDestinationThatStartsReadingWithinTheStartWindow_isNotTakenForAStall', async () => {
    // The first bytes fill the buffers, then nothing moves for 250 ms (longer than the stall
    // window, within the start window) while the destination prepares; then it reads.
    const qmp = fakeQemu((ms) => (ms < 250 ? 1e6 : ms * 1e6), 600);
    await expect(migrateAndWait(qmp, 'tcp:10.0.0.2:4000', small)).resolves.toBeUndefined();
    expect(qmp.queries).toBeGreaterThan(10);
  });

  it('migrateAndWait_whenTheDestinationNeverStartsReading_failsAtTheEndOfTheStartWindow', async () => {
    const qmp = fakeQemu(() => 1e6);
    const t0 = Date.now();
    await expect(migrateAndWait(qmp, 'tcp:10.0.0.2:4000', small)).rejects.toThrow(/migration stalled/);
    const took = Date.now() - t0;
    expect(took).toBeGreaterThanOrEqual(small.startMs);
    expect(took).toBeLessThan(5_000);
  });

  it('incomingAndWait_withTheStreamsCap_waitsPastTheOldTwoMinutesForALoadStillUnderWay', async () => {
    vi.useFakeTimers({ toFake: ['setTimeout', 'clearTimeout', 'Date'] });
    const qmp = fakeQemu(() => 0, 200_000);
    expect(await onFakeClock(incomingAndWait(qmp, 'unix:/nowhere/in.sock', MIGRATION_STREAM_WAIT.maxMs), 201_000)).toBe('done');
  });

  it('migrateOut_aStreamThatKeepsMovingPastTheOldTwoMinutes_isNotCutOff', async () => {
    vi.useFakeTimers({ toFake: ['setTimeout', 'clearTimeout', 'Date'] });
    const driver = new QemuVmmDriver({ root: join(base, 'agent-out'), accel: 'tcg', logger: pino({ level: 'silent' }) });
    driver.assertCompatible = () => Promise.resolve();
    const qmp = fakeQemu(moving, 200_000);
    const internals = driver as unknown as {
      launchStandby(snapshot: LocalSnapshot, o: { source?: boolean }): Promise<Standby>;
      discardStandby(s: Standby): Promise<void>;
    };
    // The call's own source gets the fake QEMU; the one kept ready after it never starts.
    let launches = 0;
    const ends: Array<() => void> = [];
    internals.launchStandby = () =>
      launches++ === 0 ? Promise.resolve({ id: 'source-1', qmp, proc: { pid: 1 }, workdir: join(base, 'source-1') } as unknown as Standby) : new Promise((_, reject) => ends.push(() => reject(new Error('no QEMU in this test'))));
    internals.discardStandby = () => Promise.resolve();
    const snapshot = { dir: '/nowhere', manifest: { snapshotId: 'sn-1', image: {} } } as unknown as LocalSnapshot;
    const outcome = await onFakeClock(driver.migrateOut!(snapshot, { unixPath: '/nowhere/out.sock' }), 201_000);
    expect(outcome).toBe('done');
    vi.useRealTimers();
    ends.splice(0).forEach((end) => end());
    await driver.close();
  });
});
