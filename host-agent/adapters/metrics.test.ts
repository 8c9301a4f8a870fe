import { create } from '@bufbuild/protobuf';
import { describe, expect, it } from 'vitest';
import { HeartbeatSchema, VmState } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { PromAgentMetrics, serveMetrics } from './metrics.ts';

/** The value of one sample in Prometheus text (`name{labels} value`), undefined if absent. */
function sample(text: string, series: string): number | undefined {
  const line = text.split('\n').find((l) => l.startsWith(`${series} `));
  return line === undefined ? undefined : Number(line.slice(series.length + 1));
}

describe('agent metrics', () => {
  it('hostGauges_haveNoSamplesBeforeTheFirstHeartbeat_thenSayWhatTheLastOneReported', async () => {
    const m = new PromAgentMetrics();
    const before = await m.registry.metrics();
    expect(before).not.toMatch(/^forkfleet_agent_(chunk_store_bytes|vms)\{/m);
    m.heartbeat(create(HeartbeatSchema, {
      hostId: 'h1',
      capacity: { vcpus: 8, memoryMib: 4096n, diskMib: 1n },
      allocated: { vcpus: 3, memoryMib: 768n },
      memoryUsedBytes: 123_456_789n,
      chunkStoreBytes: 5_000_000_000n,
      vms: [{ sandboxId: 'a', state: VmState.RUNNING }, { sandboxId: 'b', state: VmState.RUNNING }, { sandboxId: 'c', state: VmState.PAUSED }],
      snapshots: [{ snapshotId: 'sn-1', complete: true }, { snapshotId: 'sn-2', complete: false }],
      inflightOps: 2,
      restoreCostMs: 450,
      stopping: true,
    }));
    const after = await m.registry.metrics();
    expect(sample(after, 'forkfleet_agent_vms{host="h1",state="running"}')).toBe(2);
    expect(sample(after, 'forkfleet_agent_vms{host="h1",state="paused"}')).toBe(1);
    expect(sample(after, 'forkfleet_agent_vms{host="h1",state="crashed"}')).toBe(0);
    expect(sample(after, 'forkfleet_agent_vcpus_capacity{host="h1"}')).toBe(8);
    expect(sample(after, 'forkfleet_agent_memory_capacity_bytes{host="h1"}')).toBe(4096 * 1048576);
    expect(sample(after, 'forkfleet_agent_vcpus_used{host="h1"}')).toBe(3);
    expect(sample(after, 'forkfleet_agent_memory_guests_bytes{host="h1"}')).toBe(768 * 1048576);
    expect(sample(after, 'forkfleet_agent_memory_used_bytes{host="h1"}')).toBe(123_456_789);
    expect(sample(after, 'forkfleet_agent_chunk_store_bytes{host="h1"}')).toBe(5_000_000_000);
    expect(sample(after, 'forkfleet_agent_snapshots_held{host="h1"}')).toBe(1);
    expect(sample(after, 'forkfleet_agent_steps_in_flight{host="h1"}')).toBe(2);
    expect(sample(after, 'forkfleet_agent_restore_cost_seconds{host="h1"}')).toBe(0.45);
    expect(sample(after, 'forkfleet_agent_stopping{host="h1"}')).toBe(1);
  });

  it('steps_countByKindAndResult_andTheirDurationsGoInSeconds', async () => {
    const m = new PromAgentMetrics();
    m.step('restoreVms', undefined, 30);
    m.step('restoreVms', 'not_found', 5);
    m.step('restoreVms', undefined, 200);
    m.heartbeatFailed();
    const text = await m.registry.metrics();
    expect(sample(text, 'forkfleet_agent_steps_total{kind="restoreVms",result="ok"}')).toBe(2);
    expect(sample(text, 'forkfleet_agent_steps_total{kind="restoreVms",result="not_found"}')).toBe(1);
    expect(sample(text, 'forkfleet_agent_step_duration_seconds_count{kind="restoreVms"}')).toBe(3);
    expect(sample(text, 'forkfleet_agent_step_duration_seconds_sum{kind="restoreVms"}')).toBeCloseTo(0.235, 6);
    expect(sample(text, 'forkfleet_agent_step_duration_seconds_bucket{le="0.01",kind="restoreVms"}')).toBe(1);
    expect(sample(text, 'forkfleet_agent_heartbeat_failures_total')).toBe(1);
  });

  it('serveMetrics_answersGetMetricsAndNothingElse', async () => {
    const m = new PromAgentMetrics();
    m.step('pauseVm', undefined, 1);
    const { server, address } = await serveMetrics(m.registry, '127.0.0.1:0');
    try {
      const ok = await fetch(`http://${address}/metrics`);
      expect(ok.status).toBe(200);
      expect(ok.headers.get('content-type')).toContain('text/plain');
      expect(await ok.text()).toContain('forkfleet_agent_steps_total{kind="pauseVm",result="ok"} 1');
      expect((await fetch(`http://${address}/`)).status).toBe(404);
      expect((await fetch(`http://${address}/metrics`, { method: 'POST' })).status).toBe(404);
    } finally {
      await new Promise((r) => (server.close(r), server.closeAllConnections()));
    }
  });
});
