// The API edge parses a request only once its caller is admitted: an unauthenticated or
// rate-limited caller's body (up to FF_GRPC_MAX_RECV, maybe compressed from a few KB) costs
// the replica no decode.
import { describe, expect, it, vi } from 'vitest';
import { EventEmitter } from 'node:events';
import * as protobuf from '@bufbuild/protobuf';
import { Metadata, status as Status } from '@grpc/grpc-js';
import { grpcHandlers, register } from './rpc.ts';
import type { CallGuard } from './rpc.ts';
import { UnauthenticatedError } from '../../auth/errors.ts';
import { FleetService, ListSandboxesRequestSchema, SandboxState } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';

vi.mock('@bufbuild/protobuf', async (importOriginal) => {
  const orig = await importOriginal<typeof protobuf>();
  return { ...orig, fromBinary: vi.fn(orig.fromBinary) };
});

/** A unary call as grpc-js hands it to a handler: its request already through requestDeserialize. */
function unaryCall(bytes: Uint8Array): unknown {
  const def = register(FleetService, {} as never).definition as unknown as Record<string, { requestDeserialize: (b: Buffer) => unknown }>;
  return Object.assign(new EventEmitter(), {
    request: def.listSandboxes!.requestDeserialize(Buffer.from(bytes)),
    metadata: new Metadata(),
    getPeer: () => 'test',
    getDeadline: () => Infinity,
  });
}

/** A FleetService whose only method is ListSandboxes (the others are never called here). */
const only = (listSandboxes: unknown): never => new Proxy({ listSandboxes }, { get: (t, k) => (k === 'listSandboxes' ? t.listSandboxes : () => Promise.reject(new Error(`${String(k)} called`))) }) as never;

type Handlers = Record<string, (call: unknown, cb: (err: unknown, res?: unknown) => void) => void>;
/** The call's answer: the status it failed with, or null. */
const answer = (h: Handlers, call: unknown): Promise<{ code: number; details: string } | null> => new Promise((resolve) => h.listSandboxes!(call, (e) => resolve(e as { code: number; details: string } | null)));

describe('request decoding at the API edge', () => {
  const body = protobuf.toBinary(ListSandboxesRequestSchema, protobuf.create(ListSandboxesRequestSchema, { states: Array<SandboxState>(100_000).fill(SandboxState.RUNNING) }));
  const decodes = (): number => vi.mocked(protobuf.fromBinary).mock.calls.filter(([schema]) => schema === ListSandboxesRequestSchema).length;

  it('aRequestOfACallerTheGuardRefuses_isAnsweredWithoutBeingDecoded', async () => {
    const listed = vi.fn(async () => ({ sandboxes: [], nextPageToken: '' }));
    const refuse: CallGuard = { admit: () => { throw new UnauthenticatedError('no token'); } };
    const handlers = grpcHandlers(register(FleetService, only(listed)), () => {}, refuse) as Handlers;
    const before = decodes();
    expect((await answer(handlers, unaryCall(body)))?.code).toBe(Status.UNAUTHENTICATED);
    expect(listed).not.toHaveBeenCalled();
    expect(decodes() - before).toBe(0);
  });

  it('aRequestOfAnAdmittedCaller_isDecodedForItsHandler_andBadBytesAreInvalidArgumentNamingTheRequest', async () => {
    const seen: unknown[] = [];
    const admit: CallGuard = { admit: () => ({ principal: { tenantId: 't1', admin: false, credentialId: 'c1' } }) };
    const handlers = grpcHandlers(register(FleetService, only(async (req: unknown) => (seen.push(req), { sandboxes: [], nextPageToken: '' }))), () => {}, admit) as Handlers;
    expect(await answer(handlers, unaryCall(body))).toBeNull();
    expect((seen[0] as { states: unknown[] }).states).toHaveLength(100_000);
    const err = await answer(handlers, unaryCall(Uint8Array.of(0x12, 0xff, 0xff, 0xff, 0xff, 0x0f)));
    expect(err?.code).toBe(Status.INVALID_ARGUMENT);
    expect(err?.details).toMatch(/^request: not a valid encoding/);
  });
});
