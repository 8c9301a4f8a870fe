// Fake host agents: the real host-agent Agent (journal per (op, step), idempotent steps)
// over the real NATS adapter (same subjects, streams, consumers and messages as a real
// agent), with a simulated VMM (driver.ts) and snapshot store (shipper.ts). For scheduler
// tests and scale runs only; never where a real agent would do.
import { randomUUID } from 'node:crypto';
import { mkdirSync } from 'node:fs';
import { join } from 'node:path';
import type { NatsConnection } from 'nats';
import type { Logger } from 'pino';
import { Agent } from '../../host-agent/domain/agent.ts';
import { NatsAgentBus } from '../../host-agent/adapters/nats/agent-bus.ts';
import { FsJournal } from '../../host-agent/adapters/journal/fs-journal.ts';
import { MemoryJournal } from '../../host-agent/adapters/journal/memory-journal.ts';
import { ImageBuildError } from '../../host-agent/errors.ts';
import { FakeVmmDriver, FAKE_QEMU_VERSION } from './driver.ts';
import type { FakeLatencies } from './driver.ts';
import { FakeShipper } from './shipper.ts';

export interface FakeAgentOptions {
  hostId: string;
  /** Holds the simulated VMs, snapshots and the step journal; reuse it to restart the "same" host. */
  dataDir: string;
  capacity: { vcpus: number; memoryMib: number; diskMib: number };
  latency: FakeLatencies;
  heartbeatMs: number;
  concurrency: number;
  linkBytesPerSecond?: number;
  /** 'memory': VMs and the step journal in memory only (an agent that is never restarted); default 'files'. */
  state?: 'files' | 'memory';
  /** Every guest image fails to build here, after `latency.createMs` (a fault for tests: a host that fails every create from an image). */
  failImages?: boolean;
}

export interface FakeAgent {
  readonly hostId: string;
  readonly driver: FakeVmmDriver;
  stop(): Promise<void>;
}

export async function startFakeAgent(nc: NatsConnection, o: FakeAgentOptions, log: Logger): Promise<FakeAgent> {
  mkdirSync(o.dataDir, { recursive: true });
  const memory = o.state === 'memory';
  const driver = new FakeVmmDriver(join(o.dataDir, 'vmm'), o.latency, !memory);
  const bus = await NatsAgentBus.create(nc, o.hostId, log);
  const agent = new Agent({
    driver,
    shipper: new FakeShipper(driver, o.hostId, o.latency),
    bus,
    journal: memory ? new MemoryJournal() : new FsJournal(join(o.dataDir, 'journal')),
    // A failing build fails after the create latency (a build takes a while).
    images: async (name) => {
      if (!o.failImages) return { name, recipeHash: 'fake', kernel: '', initrd: '', disk: '', diskVirtualSize: 0, kernelArgs: '', readyMarker: '' };
      await new Promise((r) => setTimeout(r, o.latency.createMs));
      throw new ImageBuildError(name, `fake host ${o.hostId} fails every image build (FF_FAKE_FAIL_IMAGES)`);
    },
    clock: { now: () => Date.now() },
    log,
    config: {
      hostId: o.hostId,
      bootId: randomUUID(),
      accel: 'tcg', // as its fake VMs and snapshots say
      capacity: o.capacity,
      peerAddress: `127.0.0.1:1`, // never dialled: fake transfers are simulated
      linkBytesPerSecond: o.linkBytesPerSecond ?? 1.25e9,
      heartbeatMs: o.heartbeatMs,
      concurrency: o.concurrency,
      // As a real agent's default: its journal is pruned past any redelivery (long scale runs).
      journalRetentionMs: 48 * 3_600_000,
      // Its steps are simulated: a stop waits briefly for them (tests stop fake hosts mid-step).
      shutdownGraceMs: 1000,
    },
    qemuVersion: FAKE_QEMU_VERSION,
  });
  await agent.start();
  return { hostId: o.hostId, driver, stop: () => agent.stop() };
}
