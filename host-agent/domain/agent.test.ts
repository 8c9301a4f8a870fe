import { describe, expect, it } from 'vitest';
import { create, toBinary, fromBinary } from '@bufbuild/protobuf';
import { pino } from 'pino';
import { Agent } from './agent.ts';
import type { AgentBus, SnapshotShipper } from './agent.ts';
import { MemoryJournal } from '../adapters/journal/memory-journal.ts';
import type { VmmDriver } from './vmm.ts';
import { HostResultSchema, HostWorkSchema } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { ForkfleetError } from '../../proto/errors.ts';

function agentWith(driver: Partial<VmmDriver>, shipper: Partial<SnapshotShipper> = {}): { agent: Agent; journal: MemoryJournal } {
  const journal = new MemoryJournal();
  const agent = new Agent({
    driver: { get: () => undefined, list: () => [], ...driver } as VmmDriver,
    shipper: { held: () => [], storedBytes: () => 0, ...shipper } as SnapshotShipper,
    bus: {} as AgentBus,
    journal,
    images: () => Promise.reject(new Error('no images in this test')),
    clock: { now: () => 1_000 },
    log: pino({ level: 'silent' }),
    config: { hostId: 'h1', bootId: 'b', capacity: { vcpus: 4, memoryMib: 4096, diskMib: 10_000 }, peerAddress: '', linkBytesPerSecond: 1, heartbeatMs: 1000, concurrency: 1 },
    qemuVersion: '7.2.0',
  });
  return { agent, journal };
}

const work = (stepId: string, w: Parameters<typeof create<typeof HostWorkSchema>>[1]) => create(HostWorkSchema, { opId: 'op-a', stepId, attempt: 1, ...w });

describe('Agent steps', () => {
  it('step_whenItFails_returnsAnEncodableResultCarryingTheNamedError', async () => {
    const { agent, journal } = agentWith({}, { obtain: () => Promise.reject(new ForkfleetError('not_found', 'snapshot sn-x is not on host h1')) });
    const r = await agent.runStep(work('restore/h1', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } }));
    const back = fromBinary(HostResultSchema, toBinary(HostResultSchema, r));
    expect(back.error?.kind).toBe('not_found');
    expect(back.error?.message).toContain('sn-x');
    expect(journal.results.size).toBe(1); // a non-retryable failure is final and journalled
  });

  it('step_whenRetryableFailure_isNotJournalledSoRedeliveryTriesAgain', async () => {
    const { agent, journal } = agentWith({}, { obtain: () => Promise.reject(new ForkfleetError('unavailable', 'peer down')) });
    const r = await agent.runStep(work('restore/h1', { work: { case: 'restoreVms', value: { snapshotId: 'sn-x', vms: [{ sandboxId: 'sb-1' }] } } }));
    expect(r.error?.retryable).toBe(true);
    expect(journal.results.size).toBe(0);
  });

  it('step_whenRedelivered_answersFromTheJournalWithoutActingAgain', async () => {
    let destroys = 0;
    const { agent } = agentWith({ get: () => ({ vmId: 'sb-1' }) as never, destroy: async () => void destroys++ });
    const w = work('destroy', { work: { case: 'destroyVm', value: { sandboxId: 'sb-1' } } });
    const a = await agent.runStep(w);
    const b = await agent.runStep(w);
    expect(destroys).toBe(1);
    expect(toBinary(HostResultSchema, b)).toEqual(toBinary(HostResultSchema, a));
  });
});
