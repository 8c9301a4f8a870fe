// The source QEMU of a migration out (ADR 0015) is on a restore's critical path. A source still
// starting in the pool (nice 19, background work) is waited for only briefly and not once the
// destination gave up, and a source started for the call itself is not background work.
// No QEMU runs: the driver's launches of sources are stood in for.
import { afterAll, describe, expect, it } from 'vitest';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import type { LocalSnapshot } from '../../domain/vmm.ts';
import { QemuVmmDriver } from './driver.ts';
import type { Standby, Urgency } from './standby.ts';

const base = mkdtempSync(join(tmpdir(), 'ff-migrate-out-source-'));
afterAll(() => rmSync(base, { recursive: true, force: true }));

/** The driver's private parts the tests reach. */
interface Internals {
  sources: { warm(snapshot: LocalSnapshot, count: number): Promise<number> };
  launchStandby(snapshot: LocalSnapshot, o: { source?: boolean; urgency?: Urgency }): Promise<Standby>;
}

const snapshot = { dir: '/nowhere', manifest: { snapshotId: 'sn-1', image: {} } } as unknown as LocalSnapshot;
const target = { unixPath: '/nowhere/mig.sock' };

let n = 0;
/** A driver whose source launches wait until `fail()` ends them (with an error: no QEMU here); `launches` lists their options. */
function setup(): { driver: QemuVmmDriver; launches: Array<{ source?: boolean; urgency?: Urgency }>; fail: () => void; internals: Internals } {
  const driver = new QemuVmmDriver({ root: join(base, `agent-${++n}`), accel: 'tcg', logger: pino({ level: 'silent' }) });
  driver.assertCompatible = () => Promise.resolve();
  const internals = driver as unknown as Internals;
  const launches: Array<{ source?: boolean; urgency?: Urgency }> = [];
  const ends: Array<() => void> = [];
  internals.launchStandby = (_s, o) => {
    launches.push(o);
    return new Promise((_resolve, reject) => ends.push(() => reject(new Error('no QEMU in this test'))));
  };
  return { driver, launches, internals, fail: () => ends.splice(0).forEach((end) => end()) };
}

describe('migrateOut source', () => {
  it('migrateOut_whenTheDestinationGivesUpWhileAPooledSourceStarts_endsAtOnceAndStartsNone', async () => {
    const { driver, launches, internals, fail } = setup();
    const warming = internals.sources.warm(snapshot, 1);
    await new Promise((r) => setImmediate(r));
    expect(launches).toHaveLength(1);
    const ac = new AbortController();
    const out = driver.migrateOut!(snapshot, target, ac.signal);
    const outcome = out.then(() => 'streamed', (e: unknown) => (e as Error).name);
    await new Promise((r) => setImmediate(r));
    ac.abort();
    expect(await outcome).toBe('AbortError');
    // Waiting, it raised the pooled source's priority; it started no source of its own.
    expect(launches[0]?.urgency?.urgent).toBe(true);
    expect(launches).toHaveLength(1);
    fail();
    await warming;
    await driver.close();
  });

  it('migrateOut_withNoPooledSource_startsItsOwnAtNormalPriority', async () => {
    const { driver, launches, fail } = setup();
    const out = driver.migrateOut!(snapshot, target).catch((e: unknown) => e);
    await new Promise((r) => setImmediate(r));
    expect(launches).toHaveLength(1);
    expect(launches[0]).toMatchObject({ source: true });
    expect(launches[0]?.urgency?.urgent).toBe(true);
    fail();
    await out;
    await driver.close();
  });
});
