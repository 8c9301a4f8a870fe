// ListSandboxes and ListOperations with all_tenants: an admin credential's, and refused to any
// other naming the field (the Fleet is a stub of our own that fails if reached).
import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { Metadata } from '@grpc/grpc-js';
import { fleetService } from './fleet-service.ts';
import type { CallContext } from './rpc.ts';
import type { Fleet } from '../../domain/fleet.ts';
import type { FleetStore } from '../../domain/ports.ts';
import { ListOperationsRequestSchema, ListSandboxesRequestSchema } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { ListOperationsRequest, ListSandboxesRequest } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';

const ctx = { signal: new AbortController().signal, deadline: undefined, metadata: new Metadata(), peer: 'test', method: 'ListSandboxes', principal: { tenantId: 't1', admin: false, credentialId: 'c1' } } as unknown as CallContext;

describe('all_tenants', () => {
  it('fromATenantCredential_isPermissionDeniedNamingAllTenants_beforeAnythingIsRead', async () => {
    const fleet = new Proxy({}, { get: () => () => Promise.reject(new Error('reached the use case')) }) as unknown as Fleet;
    const h = fleetService({ fleet, store: {} as FleetStore, clock: { now: () => Date.now() } }).handlers as unknown as {
      listSandboxes: (r: ListSandboxesRequest, c: CallContext) => Promise<unknown>;
      listOperations: (r: ListOperationsRequest, c: CallContext) => Promise<unknown>;
    };
    for (const call of [() => h.listSandboxes(create(ListSandboxesRequestSchema, { allTenants: true }), ctx), () => h.listOperations(create(ListOperationsRequestSchema, { allTenants: true }), ctx)]) {
      await expect(call()).rejects.toMatchObject({ kind: 'permission_denied', field: 'all_tenants', message: expect.stringContaining('with all_tenants needs an admin credential') });
    }
  });
});
