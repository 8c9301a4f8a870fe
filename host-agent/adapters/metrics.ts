// The host agent's Prometheus metrics (FF_METRICS_ADDR): what it did (steps, heartbeats that
// failed), whether its NATS link is up, and the host's state as its last heartbeat reported it
// to the schedulers. The schedulers export the fleet's view (services/fleet-metrics.ts) from the
// leader's caches; these come from the host itself, so they go on while no scheduler leads, and
// say what a host's agent sees when it and the leader disagree.
import { createServer, type Server } from 'node:http';
import { Counter, Gauge, Histogram, Registry, collectDefaultMetrics } from 'prom-client';
import { VmState } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type { Heartbeat } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type { AgentMetrics } from '../domain/agent.ts';

/** Seconds: a same-host restore on KVM (tens of ms) up to a fetch or migration that runs out FF_STEP_TIMEOUT (180 s by default). */
export const AGENT_STEP_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 180];

/** VM states as label values (VmState without its prefix, lower case). */
const VM_STATES: ReadonlyArray<[VmState, string]> = [
  [VmState.STARTING, 'starting'],
  [VmState.RUNNING, 'running'],
  [VmState.PAUSED, 'paused'],
  [VmState.STOPPED, 'stopped'],
  [VmState.CRASHED, 'crashed'],
];

export class PromAgentMetrics implements AgentMetrics {
  readonly registry = new Registry();
  private readonly steps: Counter<'kind' | 'result'>;
  private readonly stepSeconds: Histogram<'kind'>;
  private readonly heartbeatFailures: Counter;
  private readonly natsLink: Gauge;
  private last: Heartbeat | undefined;

  constructor() {
    collectDefaultMetrics({ register: this.registry });
    const registers = [this.registry];
    this.steps = new Counter({ name: 'forkfleet_agent_steps_total', help: 'Host steps this agent ran, by work kind and result (ok, or the error kind).', labelNames: ['kind', 'result'], registers });
    this.stepSeconds = new Histogram({ name: 'forkfleet_agent_step_duration_seconds', help: 'How long host steps took on this agent, by work kind.', labelNames: ['kind'], buckets: AGENT_STEP_BUCKETS, registers });
    this.heartbeatFailures = new Counter({ name: 'forkfleet_agent_heartbeat_failures_total', help: 'Heartbeats this agent could not build or send.', registers });
    // Heartbeats published while the link is down are buffered by nats.js, not failed: this says so.
    this.natsLink = new Gauge({ name: 'forkfleet_agent_nats_connected', help: '1 while this agent is connected to NATS (0 while it reconnects, and once its connection has closed).', registers });
    // The host's state, from the heartbeat built last (none before the first: no samples).
    const last = (): Heartbeat | undefined => this.last;
    const fromLast = (name: string, help: string, value: (hb: Heartbeat) => number | bigint): void => {
      new Gauge({
        name,
        help,
        // The host's id: without a label, a gauge reset before the first heartbeat would read 0.
        labelNames: ['host'],
        registers,
        collect() {
          this.reset();
          const hb = last();
          if (hb) this.set({ host: hb.hostId }, Number(value(hb)));
        },
      });
    };
    new Gauge({
      name: 'forkfleet_agent_vms',
      help: 'VMs on this host, by state (as its last heartbeat reported them).',
      labelNames: ['host', 'state'],
      registers,
      collect() {
        this.reset();
        const hb = last();
        if (!hb) return;
        for (const [state, label] of VM_STATES) this.set({ host: hb.hostId, state: label }, hb.vms.filter((v) => v.state === state).length);
      },
    });
    fromLast('forkfleet_agent_vcpus_capacity', 'vCPUs the schedulers may book on this host (FF_CAPACITY_VCPUS).', (hb) => hb.capacity?.vcpus ?? 0);
    fromLast('forkfleet_agent_memory_capacity_bytes', 'Memory the schedulers may book on this host (FF_CAPACITY_MEMORY_MIB).', (hb) => (hb.capacity?.memoryMib ?? 0n) * 1048576n);
    fromLast('forkfleet_agent_vcpus_used', "vCPUs of this host's VMs.", (hb) => hb.allocated?.vcpus ?? 0);
    fromLast('forkfleet_agent_memory_guests_bytes', "Guest memory of this host's VMs (their configured size).", (hb) => (hb.allocated?.memoryMib ?? 0n) * 1048576n);
    fromLast('forkfleet_agent_memory_used_bytes', "Resident memory of this host's VMs (RSS of their QEMUs).", (hb) => hb.memoryUsedBytes);
    fromLast('forkfleet_agent_chunk_store_bytes', "Bytes in this host's chunk store.", (hb) => hb.chunkStoreBytes);
    fromLast('forkfleet_agent_snapshots_held', 'Snapshots this host holds whole.', (hb) => hb.snapshots.filter((s) => s.complete).length);
    fromLast('forkfleet_agent_steps_in_flight', 'Host steps running on this agent now.', (hb) => hb.inflightOps);
    fromLast('forkfleet_agent_restore_cost_seconds', "Median of this host's recent local restores (0: none lately).", (hb) => hb.restoreCostMs / 1000);
    fromLast('forkfleet_agent_stopping', '1 while the agent is shutting down (it takes no new work).', (hb) => (hb.stopping ? 1 : 0));
  }

  heartbeat(hb: Heartbeat): void {
    this.last = hb;
  }

  heartbeatFailed(): void {
    this.heartbeatFailures.inc();
  }

  /** Whether the agent's NATS link is up (agent-bus.ts followLink). */
  natsConnected(up: boolean): void {
    this.natsLink.set(up ? 1 : 0);
  }

  step(kind: string, errorKind: string | undefined, ms: number): void {
    this.steps.inc({ kind, result: errorKind ?? 'ok' });
    this.stepSeconds.observe({ kind }, ms / 1000);
  }
}

/**
 * Serves `registry` at GET /metrics on `address` (host:port; port 0 picks one). Resolves
 * with the server and the address it listens on; `onError` hears what goes wrong after.
 */
export async function serveMetrics(registry: Registry, address: string, onError: (err: Error) => void = () => undefined): Promise<{ server: Server; address: string }> {
  const i = address.lastIndexOf(':');
  const host = address.slice(0, i);
  const port = Number(address.slice(i + 1));
  const server = createServer((req, res) => {
    if (req.method !== 'GET' || (req.url ?? '').split('?')[0] !== '/metrics') {
      res.writeHead(404, { 'content-type': 'text/plain' }).end('not found: GET /metrics\n');
      return;
    }
    registry.metrics().then(
      (text) => res.writeHead(200, { 'content-type': registry.contentType }).end(text),
      (e: unknown) => res.writeHead(500, { 'content-type': 'text/plain' }).end(`metrics failed: ${String(e)}\n`),
    );
  });
  await new Promise<void>((resolve, reject) => {
    server.once('error', reject);
    server.listen(port, host.replace(/^\[(.*)\]$/, '$1'), () => {
      server.off('error', reject);
      resolve();
    });
  });
  // Later errors (an accept failing with EMFILE on a host full of QEMUs): told, not thrown
  // (an 'error' event nobody listens to would end the agent).
  server.on('error', onError);
  const a = server.address();
  return { server, address: typeof a === 'object' && a ? `${host}:${a.port}` : address };
}
