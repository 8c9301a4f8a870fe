// WriteFile and ReadFile hold whole files in a replica's memory: what bounds that.
import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { Metadata } from '@grpc/grpc-js';
import { FilePieces, fleetService } from './fleet-service.ts';
import type { FleetServiceDeps } from './fleet-service.ts';
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

function service(fleet: Partial<Fleet>, fileBufferBytes: number, more: Partial<FleetServiceDeps> = {}): Handlers {
  return fleetService({ fleet: fleet as Fleet, store: {} as FleetStore, clock: { now: () => Date.now() }, fileBufferBytes, ...more }).handlers as unknown as Handlers;
}

const callOf = (tenantId: string): CallContext => ({ ...ctx, principal: { tenantId, admin: false, credentialId: `c-${tenantId}` } }) as CallContext;

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

  it('writeFile_whoseHeaderCheckIsSlow_takesTheDataThatComesMeanwhileFromTheBudget_andRefusesWhatDoesNotFitBeforeTheCheckEnds', async () => {
    // The header's check reads etcd, which can take seconds: meanwhile the client sends on.
    const checks: Array<() => void> = [];
    const h = service({ checkWritable: () => new Promise<void>((r) => checks.push(r)), writeFile: async (_t: string, _s: string, _p: string, _m: number, b: Buffer) => b.length }, 32 * MiB);
    const a = upload();
    const first = h.writeFile(a.reqs, ctx);
    a.send(header());
    a.send(data(12 * MiB));
    a.send(data(12 * MiB));
    a.end();
    await new Promise((r) => setTimeout(r, 10));
    // A second upload of the same tenant, while the first's check still waits: its data does
    // not fit beside what the first holds, and it is told so before either check ends.
    const b = upload();
    const second = h.writeFile(b.reqs, ctx);
    b.send(header());
    b.send(data(12 * MiB));
    const early = await Promise.race([second.then(() => 'written', (e: unknown) => e), new Promise((r) => setTimeout(() => r('still waiting for its check'), 500))]);
    expect(early).toMatchObject({ kind: 'resource_exhausted', retryable: true, field: 'data' });
    // The first, once checked, is written whole.
    for (const ok of checks) ok();
    await expect(first).resolves.toEqual({ bytesWritten: BigInt(24 * MiB) });
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

  it('writeFiles_ofOneTenantWhoseUploadsStall_holdAtMostItsShare_soAnotherTenantsUploadStillFits', async () => {
    const h = service({ checkWritable: async () => undefined, writeFile: async (_t: string, _s: string, _p: string, _m: number, b: Buffer) => b.length }, 256 * MiB);
    const as = { ...ctx, principal: { tenantId: 'ta', admin: false, credentialId: 'ca' } } as CallContext;
    const bs = { ...ctx, principal: { tenantId: 'tb', admin: false, credentialId: 'cb' } } as CallContext;
    // Tenant a: two 64 MiB uploads that never end hold its share (half of 256 MiB).
    const stalled = [upload(), upload()];
    const calls = stalled.map((u) => h.writeFile(u.reqs, as));
    for (const u of stalled) {
      u.send(header());
      u.send(data(64 * MiB));
    }
    await new Promise((r) => setTimeout(r, 10));
    const more = upload();
    const third = h.writeFile(more.reqs, as);
    more.send(header());
    more.send(data(1));
    more.end();
    await expect(third).rejects.toMatchObject({ kind: 'resource_exhausted', retryable: true, field: 'data', message: expect.stringContaining('tenant ta') });
    // Tenant b's upload fits beside them.
    const b = upload();
    const other = h.writeFile(b.reqs, bs);
    b.send(header());
    b.send(data(64 * MiB));
    b.end();
    await expect(other).resolves.toEqual({ bytesWritten: BigInt(64 * MiB) });
    for (const u of stalled) u.end();
    await Promise.all(calls);
  });

  it('writeFiles_ofTwoTenantsWhoseUploadsStall_areEndedAfterTheIdlePeriod_writingNothing_andAThirdTenantsUploadThenFits', async () => {
    const written: string[] = [];
    // 128 MiB: a tenant may hold 64 MiB, so two tenants hold it all.
    const h = service({ checkWritable: async () => undefined, writeFile: async (t: string, _s: string, _p: string, _m: number, b: Buffer) => (written.push(t), b.length) }, 128 * MiB, { writeFileIdleMs: 300 });
    const stalled = ['ta', 'tb'].map((t) => {
      const u = upload();
      const call = h.writeFile(u.reqs, callOf(t));
      const ended = call.then(() => 'written', (e: unknown) => e);
      u.send(header());
      u.send(data(64 * MiB));
      return ended;
    });
    await new Promise((r) => setTimeout(r, 10));
    const attempt = (): Promise<{ bytesWritten: bigint }> => {
      const u = upload();
      const call = h.writeFile(u.reqs, callOf('tc'));
      u.send(header());
      u.send(data(MiB));
      u.end();
      return call;
    };
    await expect(attempt()).rejects.toMatchObject({ kind: 'resource_exhausted', message: expect.stringContaining('FF_FILE_BUFFER_MAX') });
    // Their clients send nothing more (hung, yet connected): ended once the idle period passes.
    for (const ended of await Promise.all(stalled)) expect(ended).toMatchObject({ kind: 'resource_exhausted', message: expect.stringContaining('sent nothing for 0.3s') });
    await expect(attempt()).resolves.toEqual({ bytesWritten: BigInt(MiB) });
    expect(written).toEqual(['tc']);
  });

  it('writeFile_thatSendsAPieceWithinEachIdlePeriod_isNotEnded_howeverLongItTakes', async () => {
    const h = service({ checkWritable: async () => undefined, writeFile: async (_t: string, _s: string, _p: string, _m: number, b: Buffer) => b.length }, 64 * MiB, { writeFileIdleMs: 400 });
    const u = upload();
    const call = h.writeFile(u.reqs, ctx);
    u.send(header());
    // 600 ms in all, a piece every 100 ms.
    for (let i = 0; i < 6; i++) {
      await new Promise((r) => setTimeout(r, 100));
      u.send(data(MiB));
    }
    u.end();
    await expect(call).resolves.toEqual({ bytesWritten: BigInt(6 * MiB) });
  });

  it('filePieces_ofManyTinyOrEmptyPieces_holdAFewBlocks_notAnArrayEach_andJoinToTheFile', () => {
    const pieces = new FilePieces();
    for (let i = 0; i < 200_000; i++) pieces.add(new Uint8Array(0));
    expect(pieces.arrays).toBe(0);
    for (let i = 0; i < 200_000; i++) pieces.add(Uint8Array.of(i & 0xff));
    const big = new Uint8Array(100_000).fill(7);
    pieces.add(big);
    pieces.add(Uint8Array.of(1, 2, 3));
    // 200,000 bytes in 64 KiB blocks (4), the large piece as it is (1), the last block (1).
    expect(pieces.arrays).toBe(6);
    const whole = pieces.join();
    expect(whole.length).toBe(300_003);
    expect(whole[0]).toBe(0);
    expect(whole[199_999]).toBe(199_999 & 0xff);
    expect(whole[200_000]).toBe(7);
    expect([...whole.subarray(300_000)]).toEqual([1, 2, 3]);
  });

  it('filePieces_ofOneBytePiecesTakingTurnsWithLargeOnes_holdAboutTheBytesTheyCount_notABlockPerSmallPiece', () => {
    const pieces = new FilePieces();
    for (let i = 0; i < 100; i++) {
      pieces.add(Uint8Array.of(i));
      pieces.add(new Uint8Array(FilePieces.BLOCK / 4));
    }
    // Each one-byte piece sealed into an array of its own size, not a view of a 64 KiB block.
    const held = (pieces as unknown as { parts: Uint8Array[] }).parts.reduce((n, p) => n + p.buffer.byteLength, 0);
    expect(held).toBeLessThan(2 * 100 * (1 + FilePieces.BLOCK / 4));
    expect(pieces.join().length).toBe(100 * (1 + FilePieces.BLOCK / 4));
  });
});
