// How a fleet's start ends when it is stopped or fails (bringup.ts), with steps of the test's
// own standing in for the fleet's: a "launch" refuses once the start is stopped, as fleet.ts's
// does, and records what it started, as state.json does. Also fleet.ts's real launch().
import { EventEmitter } from 'node:events';
import { existsSync, mkdirSync, mkdtempSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { setTimeout as delay } from 'node:timers/promises';
import { afterAll, describe, expect, it } from 'vitest';
import { allSteps, guardedStart, throwIfStopped } from './bringup.ts';
import type { SignalSource, StartEnd } from './bringup.ts';
import { FleetInterruptedError, STOP_SIGNALS, StartStoppedError } from './errors.ts';
import { defaultOptions, launch } from './fleet.ts';
import type { FleetState } from './fleet.ts';

/** What a fake start did, in order: launches, steps settling, the cleanup and what it saw. */
class Timeline {
  readonly events: string[] = [];
  readonly launched: string[] = [];
  launch(abort: AbortSignal, name: string): void {
    throwIfStopped(abort);
    this.launched.push(name);
    this.events.push(`launch ${name}`);
  }
  /** A wait that ends when `abort` fires (as waitLog's loop does), after `ms` at most. */
  async wait(abort: AbortSignal, ms: number): Promise<void> {
    const until = Date.now() + ms;
    while (Date.now() < until) {
      throwIfStopped(abort);
      await delay(5);
    }
  }
}

const signalSource = (): EventEmitter & SignalSource => new EventEmitter() as EventEmitter & SignalSource;
const listeners = (s: EventEmitter): number => STOP_SIGNALS.reduce((n, sig) => n + s.listenerCount(sig), 0);

describe('guardedStart', () => {
  it('sigint_stopsTheStart_waitsForTheStepInFlight_thenCleansUpWhatItLaunched_andThrowsExitCode130', async () => {
    const signals = signalSource();
    const t = new Timeline();
    let cleanedUp: { end: StartEnd; launched: string[] } | undefined;
    const run = guardedStart(
      async (abort) => {
        t.launch(abort, 'etcd');
        // A step in flight when the signal comes: it is between two awaits (a port check), and
        // then would start a process the cleanup must know of.
        await delay(30);
        t.events.push('step in flight settles');
        t.launch(abort, 'nats');
        await t.wait(abort, 10_000);
        t.launch(abort, 'scheduler');
        return 'up';
      },
      async (end) => {
        t.events.push('cleanup');
        cleanedUp = { end, launched: [...t.launched] };
      },
      { signals, onSignal: (sig) => t.events.push(`told of ${sig}`) },
    );
    await delay(5);
    signals.emit('SIGINT', 'SIGINT');
    // One-shot, all three together: a second signal would end the process at once.
    expect(listeners(signals)).toBe(0);
    const e = await run.then(() => undefined, (x: unknown) => x);
    expect(e).toBeInstanceOf(FleetInterruptedError);
    expect(e).toMatchObject({ signal: 'SIGINT', exitCode: 130 });
    // The stop's own refusal is no cause worth naming.
    expect((e as Error).cause).toBeUndefined();
    expect(t.events).toEqual(['launch etcd', 'told of SIGINT', 'step in flight settles', 'cleanup']);
    expect(cleanedUp).toEqual({ end: { signal: 'SIGINT' }, launched: ['etcd'] });
  });

  it.each([
    ['SIGTERM', 143],
    ['SIGHUP', 129],
  ] as const)('%s_endsInTheCleanup_andExitCode%i', async (sig, code) => {
    const signals = signalSource();
    let cleanups = 0;
    const run = guardedStart((abort) => new Timeline().wait(abort, 10_000), async () => void cleanups++, { signals });
    await delay(5);
    signals.emit(sig, sig);
    await expect(run).rejects.toMatchObject({ name: 'FleetInterruptedError', signal: sig, exitCode: code });
    expect(cleanups).toBe(1);
  });

  it('failure_cleansUpOnceTheStartSettled_andThrowsItsError_withTheHandlersGone', async () => {
    const signals = signalSource();
    const boom = new Error('nats-server: port 17740 on 127.0.0.1 is already in use');
    const ends: StartEnd[] = [];
    const run = guardedStart(
      async () => {
        throw boom;
      },
      async (end) => void ends.push(end),
      { signals },
    );
    await expect(run).rejects.toBe(boom);
    expect(ends).toEqual([{ error: boom }]);
    expect(listeners(signals)).toBe(0);
  });

  it('signalWhileAStepFails_isReportedAsTheStop_withTheFailureAsCause', async () => {
    const signals = signalSource();
    const boom = new Error('etcd-1 exited (see logs/etcd-1.log)');
    const run = guardedStart(
      async () => {
        await delay(20);
        throw boom;
      },
      async () => undefined,
      { signals },
    );
    signals.emit('SIGINT', 'SIGINT');
    await expect(run).rejects.toMatchObject({ name: 'FleetInterruptedError', exitCode: 130, cause: boom });
  });

  it('success_withoutASignal_returnsWithoutCleanup_andRemovesTheHandlers', async () => {
    const signals = signalSource();
    let cleanups = 0;
    await expect(guardedStart(async () => 'up', async () => void cleanups++, { signals })).resolves.toBe('up');
    expect(cleanups).toBe(0);
    expect(listeners(signals)).toBe(0);
  });
});

describe('allSteps (etcd and NATS, the agents: side by side)', () => {
  it('oneStepFailing_stopsTheOthers_andSettlesOnlyOnceEveryStepHas_soNothingStartsAfterTheCleanupReadTheState', async () => {
    const t = new Timeline();
    const portInUse = new Error('nats-server: port 17740 on 127.0.0.1 is already in use');
    const run = allSteps(new AbortController().signal, [
      // etcd: still checking its ports when NATS fails; then it would launch.
      async (abort) => {
        await delay(30);
        try {
          t.launch(abort, 'etcd-1');
        } finally {
          t.events.push('etcd step settled');
        }
      },
      async () => {
        await delay(1);
        throw portInUse;
      },
    ]);
    const e = await run.then(() => undefined, (x: unknown) => x);
    t.events.push('allSteps rejected');
    expect(e).toBe(portInUse);
    expect(t.launched).toEqual([]);
    expect(t.events).toEqual(['etcd step settled', 'allSteps rejected']);
  });

  it('theStartStopped_stopsEveryStep', async () => {
    const t = new Timeline();
    const ctl = new AbortController();
    const run = allSteps(ctl.signal, [(a) => t.wait(a, 10_000), (a) => t.wait(a, 10_000)]);
    await delay(5);
    ctl.abort('SIGINT');
    await expect(run).rejects.toBeInstanceOf(StartStoppedError);
  });

  it('everyStepSucceeding_resolves', async () => {
    const t = new Timeline();
    await allSteps(new AbortController().signal, [async (a) => t.launch(a, 'etcd-1'), async (a) => t.launch(a, 'nats')]);
    expect(t.launched.sort()).toEqual(['etcd-1', 'nats']);
  });
});

describe('fleet.ts launch', () => {
  const tmp = mkdtempSync(join(tmpdir(), 'ff-launch-'));
  afterAll(() => rmSync(tmp, { recursive: true, force: true }));

  it('launch_afterTheStartIsStopped_refuses_startingAndRecordingNothing', () => {
    const opts = defaultOptions({ dir: tmp, hosts: 1, hostMemoryMib: 1024 });
    const state: FleetState = {
      version: 1, startedAt: '', options: opts, apiAddresses: [], metricsAddresses: [], etcdEndpoints: [], natsUrl: '', natsMonitor: '',
      netnsBridge: '', namespaces: [], hosts: [], procs: [], signingKey: '', trustedKey: '',
    };
    const ctl = new AbortController();
    ctl.abort('SIGINT');
    expect(() => launch(state, ctl.signal, { name: 'etcd-1', kind: 'etcd' }, 'sleep', ['30'])).toThrow(StartStoppedError);
    expect(state.procs).toEqual([]);
    expect(existsSync(join(tmp, 'state.json'))).toBe(false);
    expect(existsSync(join(tmp, 'logs', 'etcd-1.log'))).toBe(false);
  });

  const stateIn = (dir: string): FleetState => ({
    version: 1, startedAt: '', options: defaultOptions({ dir, hosts: 1, hostMemoryMib: 1024 }), apiAddresses: [], metricsAddresses: [], etcdEndpoints: [], natsUrl: '', natsMonitor: '',
    netnsBridge: '', namespaces: [], hosts: [], procs: [], signingKey: '', trustedKey: '',
  });
  /** PIDs of live processes whose command line holds `mark`. */
  const running = (mark: string): number[] =>
    readdirSync('/proc')
      .filter((d) => /^\d+$/.test(d))
      .filter((d) => {
        try {
          return readFileSync(`/proc/${d}/cmdline`, 'utf8').includes(mark);
        } catch {
          return false;
        }
      })
      .map(Number);

  it('launch_whoseStateCannotBeSaved_killsTheProcessItStarted_andThrows', async () => {
    // Nothing would stop a process that state.json does not name: the start's cleanup reads it.
    const dir = mkdtempSync(join(tmp, 'unsaved-'));
    mkdirSync(join(dir, 'logs'));
    mkdirSync(join(dir, 'state.json.tmp')); // the save's write fails (EISDIR)
    const state = stateIn(dir);
    const mark = `${process.pid}.${Date.now() % 100000}`;
    expect(() => launch(state, new AbortController().signal, { name: 'etcd-1', kind: 'etcd' }, 'sh', ['-c', `sleep 30; echo ${mark}`])).toThrow(/EISDIR/);
    expect(state.procs).toEqual([]);
    const until = Date.now() + 5000;
    while (running(mark).length > 0 && Date.now() < until) await delay(20);
    expect(running(mark)).toEqual([]);
  });

  it('launch_ofACommandThatCannotStart_throws_andNothingEndsThisProcess', async () => {
    const dir = mkdtempSync(join(tmp, 'nostart-'));
    mkdirSync(join(dir, 'logs'));
    const state = stateIn(dir);
    const uncaught: unknown[] = [];
    const onUncaught = (e: unknown): void => void uncaught.push(e);
    process.on('uncaughtException', onUncaught);
    try {
      expect(() => launch(state, new AbortController().signal, { name: 'nats', kind: 'nats' }, join(dir, 'no-such-command'), [])).toThrow(/could not start/);
      await delay(50); // the failed spawn's 'error' comes on a later tick
      expect(uncaught).toEqual([]);
      expect(state.procs).toEqual([]);
    } finally {
      process.off('uncaughtException', onUncaught);
    }
  });
});
