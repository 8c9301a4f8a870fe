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
});
