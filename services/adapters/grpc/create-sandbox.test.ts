// CreateSandbox's handler: what it refuses before the use case, and what it tells the use case
// of the request (the Fleet is a stub of our own: it records its input and answers no further).
import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import type { MessageInitShape } from '@bufbuild/protobuf';
import { Metadata } from '@grpc/grpc-js';
import { fleetService } from './fleet-service.ts';
import type { CallContext } from './rpc.ts';
import type { CreateInput, Fleet } from '../../domain/fleet.ts';
import type { FleetStore } from '../../domain/ports.ts';
import { CreateSandboxRequestSchema } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { CreateSandboxRequest } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import { Spread } from '../../../proto/gen/forkfleet/v1/common_pb.ts';

const ctx = { signal: new AbortController().signal, deadline: undefined, metadata: new Metadata(), peer: 'test', method: 'CreateSandbox', principal: { tenantId: 't1', admin: false, credentialId: 'c1' } } as unknown as CallContext;
const SNAPSHOT = 'sn-aaaaaaaaaaaaaaaaaaaa';
/** What the stub Fleet answers every create with, once it has the input. */
const REACHED = new Error('reached the use case');

/** Calls CreateSandbox with `req` (an image create unless it says otherwise); the Fleet's input, or the handler's refusal. */
async function createWith(req: Omit<MessageInitShape<typeof CreateSandboxRequestSchema>, '$typeName'>): Promise<{ input?: CreateInput; refused?: { kind: string; field?: string; message: string } }> {
  let input: CreateInput | undefined;
  const fleet = {
    createSandbox: async (i: CreateInput) => {
      input = i;
      throw REACHED;
    },
  } as unknown as Fleet;
  const h = fleetService({ fleet, store: {} as FleetStore, clock: { now: () => Date.now() } }).handlers as unknown as { createSandbox: (r: CreateSandboxRequest, c: CallContext) => Promise<unknown> };
  const e = await h.createSandbox(create(CreateSandboxRequestSchema, { idempotencyKey: 'k1', source: { case: 'image', value: 'tiny' }, ...req }), ctx).then(
    () => undefined,
    (x: unknown) => x,
  );
  if (e === REACHED) return { input: input! };
  return { refused: e as { kind: string; field?: string; message: string } };
}

describe('CreateSandbox placement', () => {
  it('spreadSet_isInvalidArgumentNamingIt_onlyAForkHasChildrenToSpread', async () => {
    for (const spread of [Spread.SPREAD, Spread.PACK]) {
      const { refused } = await createWith({ placement: { spread } });
      expect(refused).toMatchObject({ kind: 'invalid_argument', field: 'placement.spread', message: expect.stringMatching(/^placement\.spread: only for a fork/) });
    }
    // Restores too.
    expect((await createWith({ source: { case: 'snapshotId', value: SNAPSHOT }, placement: { spread: Spread.SPREAD } })).refused).toMatchObject({ field: 'placement.spread' });
  });

  it('maxPerHostSet_isInvalidArgumentNamingIt_onlyAForkHasChildrenToCap', async () => {
    const { refused } = await createWith({ placement: { maxPerHost: 1 } });
    expect(refused).toMatchObject({ kind: 'invalid_argument', field: 'placement.max_per_host', message: expect.stringMatching(/^placement\.max_per_host: only for a fork/) });
  });

  it('placementAtItsDefaults_reachesTheUseCase', async () => {
    expect((await createWith({ placement: { spread: Spread.UNSPECIFIED, maxPerHost: 0 } })).input).toBeDefined();
    expect((await createWith({})).input).toBeDefined();
  });
});

describe('CreateSandbox resources', () => {
  it('diskMib_isToldSetOnlyWhenTheCallerSetsIt_soARestoreCanTakeItsSnapshotsDisk', async () => {
    const unset = (await createWith({ source: { case: 'snapshotId', value: SNAPSHOT } })).input!;
    expect(unset.resourcesSet).toEqual({ vcpus: false, memoryMib: false });
    const set = (await createWith({ source: { case: 'snapshotId', value: SNAPSHOT }, resources: { diskMib: 4096n } })).input!;
    expect(set.resourcesSet).toEqual({ vcpus: false, memoryMib: false, diskMib: true });
    expect(set.resources.diskMib).toBe(4096);
  });
});
