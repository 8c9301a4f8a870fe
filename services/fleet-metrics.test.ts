// The fleet gauges' one-second memo against leadership changes: a figure computed while
// leading is not served once this replica has stopped leading.
import { describe, expect, it } from 'vitest';
import { Registry } from 'prom-client';
import { registerFleetGauges } from './fleet-metrics.ts';
import type { FleetGauges } from './domain/fleet-gauges.ts';

const figures = (): FleetGauges => ({
  hosts: new Map([['h1', { state: 'ready', cordoned: false, draining: false, capacity: { vcpus: 8, memoryBytes: 1, diskBytes: 1 }, allocated: { vcpus: 1, memoryBytes: 1, diskBytes: 1 }, sandboxes: 1, memoryUsedBytes: undefined, chunkStoreBytes: undefined, imageCacheBytes: undefined }]]),
  sandboxes: new Map([['running', 1]]),
  snapshots: new Map(),
  snapshotStoredBytes: 0,
  tenants: undefined,
});

const sample = (text: string, series: string): number | undefined => {
  const line = text.split('\n').find((l) => l.startsWith(`${series} `));
  return line === undefined ? undefined : Number(line.slice(series.length + 1));
};

describe('registerFleetGauges', () => {
  it('scrapeJustAfterLeadershipEnded_reportsNoFigures_notTheMemoOfTheTermThatEnded', async () => {
    const registry = new Registry();
    let term = 1;
    let leading = true;
    let asked = 0;
    registerFleetGauges(registry, () => (asked++, leading ? figures() : undefined), () => term);
    expect(sample(await registry.metrics(), 'forkfleet_hosts{state="ready"}')).toBe(1);
    // Scrapes within the second share one answer.
    expect(sample(await registry.metrics(), 'forkfleet_sandboxes{state="running"}')).toBe(1);
    expect(asked).toBe(1);
    // Leadership lost (the scheduler counts a term): asked again at once.
    leading = false;
    term++;
    const text = await registry.metrics();
    expect(text).toContain('# TYPE forkfleet_hosts gauge');
    expect(sample(text, 'forkfleet_hosts{state="ready"}')).toBeUndefined();
    expect(sample(text, 'forkfleet_sandboxes{state="running"}')).toBeUndefined();
  });

  it('gaugesWithoutLabels_onAReplicaThatDoesNotLead_haveNoSample_notA0', async () => {
    const registry = new Registry();
    let leading = false;
    registerFleetGauges(registry, () => (leading ? { ...figures(), snapshotStoredBytes: 7 } : undefined), () => leading);
    const standby = await registry.metrics();
    for (const name of ['forkfleet_hosts_cordoned', 'forkfleet_hosts_draining', 'forkfleet_snapshot_stored_bytes']) {
      expect(standby).toContain(`# TYPE ${name} gauge`);
      expect(sample(standby, name)).toBeUndefined();
    }
    leading = true;
    const leader = await registry.metrics();
    expect([sample(leader, 'forkfleet_hosts_cordoned'), sample(leader, 'forkfleet_hosts_draining'), sample(leader, 'forkfleet_snapshot_stored_bytes')]).toEqual([0, 0, 7]);
  });
});
