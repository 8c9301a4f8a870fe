// WriteFile and ReadFile hold whole files in a replica's memory: what bounds that.
import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { Metadata } from '@grpc/grpc-js';
import { fleetService } from './fleet-service.ts';
import type { CallContext } from './rpc.ts';
import type { Fleet } from '../../domain/fleet.ts';
import type { FleetStore } from '../../domain/ports.ts';
import { NotFoundError } from '../../domain/errors.ts';
import { ReadFileRequestSchema, WriteFileRequestSchema } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { ReadFileRequest, WriteFileRequest } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';

const MiB = 1 << 20;
const SB = 'sb-aaaaaaaaaaaaaaaaaaaa';
const ctx: CallContext = { signal: new AbortController().signal, deadline: undefined, metadata: new Metadata(), peer: 'test', method: 'WriteFile', principal: { tenantId: 't1', admin: false, credentialId: 'c1' } } as CallContext;

type Handlers = {
  writeFile: (reqs: AsyncIterable<WriteFileRequest>, ctx: CallContext) => Promise<{ bytesWritten: bigint }>;
  readFile: (req: ReadFileRequest, ctx: CallContext) => AsyncIterable<{ data: Uint8Array }>;
};

function service(fleet: Partial<Fleet>, fileBufferBytes: number): Handlers {
  return fleetService({ fleet: fleet as Fleet, store: {} as FleetStore, clock: { now: () => Date.now() }, fileBufferBytes }).handlers as unknown as Handlers;
}

const header = (sandboxId = SB): WriteFileRequest => create(WriteFileRequestSchema, { payload: { case: 'header', value: { sandboxId, path: '/tmp/f' } } });
const data = (n: number): WriteFileRequest => create(WriteFileRequestSchema, { payload: { case: 'data', value: new Uint8Array(n) } });

/** An upload the test feeds: `send` queues a message, `end` closes it. */
function upload(): { reqs: AsyncIterable<WriteFileRequest>; send: (r: WriteFileRequest) => void; end: () => void } {
  const queue: WriteFileRequest[] = [];
  let wake: (() => void) | undefined;
  let ended = false;
  return {
    reqs: (async function* () {
      for (;;) {
        while (queue.length > 0) yield queue.shift()!;
        if (ended) return;
        await new Promise<void>((r) => (wake = r));
      }
    })(),
    send: (r) => {
      queue.push(r);
      wake?.();
    },
    end: () => {
      ended = true;
      wake?.();
    },
  };
}

describe('file calls within the replica budget', () => {
  it('writeFile_toASandboxThatDoesNotExist_isRefusedAtItsHeader_beforeAnyDataIsHeld', async () => {
    const h = service({ checkWritable: async (_t: string, id: string) => Promise.reject(new NotFoundError('sandbox', id)) }, 64 * MiB);
    const u = upload();
    const call = h.writeFile(u.reqs, ctx);
    u.send(header());
    // No data sent, the stream still open: refused already.
    await expect(call).rejects.toMatchObject({ kind: 'not_found' });
  });

  it('writeFiles_pastTheReplicasBudget_areRefusedRetryable_andTheBudgetComesBackWhenTheyEnd', async () => {
    const written: number[] = [];
    const h = service({ checkWritable: async () => undefined, writeFile: async (_t: string, _s: string, _p: string, _m: number, b: Buffer) => (written.push(b.length), b.length) }, 64 * MiB);
    // One upload holds 40 MiB and stays open; a second one's 30 MiB do not fit beside it.
    const a = upload();
    const first = h.writeFile(a.reqs, ctx);
    a.send(header());
    a.send(data(40 * MiB));
    await new Promise((r) => setTimeout(r, 10));
    const b = upload();
    const second = h.writeFile(b.reqs, ctx);
    b.send(header());
    b.send(data(30 * MiB));
    b.end();
    await expect(second).rejects.toMatchObject({ kind: 'resource_exhausted', retryable: true, field: 'data' });
    a.end();
    await expect(first).resolves.toEqual({ bytesWritten: BigInt(40 * MiB) });
    // Everything was given back: a 30 MiB upload fits now.
    const c = upload();
    const third = h.writeFile(c.reqs, ctx);
    c.send(header());
    c.send(data(30 * MiB));
    c.end();
    await expect(third).resolves.toEqual({ bytesWritten: BigInt(30 * MiB) });
    expect(written).toEqual([40 * MiB, 30 * MiB]);
  });

  it('readFile_pastTheReplicasBudget_isRefusedRetryable_whileAnotherIsHeldByAReaderThatDoesNotRead', async () => {
    // The fleet reads in pieces of 8 MiB and tells the service before it keeps each one.
    const h = service({ readFile: async (_t: string, _s: string, _p: string, _m: number, _w: boolean, hold: (n: number) => void) => {
      for (let i = 0; i < 5; i++) hold(8 * MiB);
      return Buffer.alloc(40 * MiB);
    } } as Partial<Fleet>, 64 * MiB);
    const req = create(ReadFileRequestSchema, { sandboxId: SB, path: '/tmp/f' });
    // A reader that takes one piece and then stops reading: its 40 MiB stay held.
    const slow = h.readFile(req, ctx)[Symbol.asyncIterator]();
    expect((await slow.next()).done).toBe(false);
    await expect(h.readFile(req, ctx)[Symbol.asyncIterator]().next()).rejects.toMatchObject({ kind: 'resource_exhausted', retryable: true });
    await slow.return?.(undefined);
    // Given back once that call ended.
    const again = h.readFile(req, ctx)[Symbol.asyncIterator]();
    expect((await again.next()).done).toBe(false);
    await again.return?.(undefined);
  });
});
