// ChunkStoreShipper's delete against what still uses the snapshot: a restore's lease, and a
// fetch whose manifest write obtain() left to the background. Real chunk, manifest and image
// stores in a temp directory; the VMM driver is a fake of our own port. No peer is asked for
// anything unless a test starts one: every chunk a fetch needs is already stored here.
// `qemu-img info` (an ingest asks it for the disk layer's backing) answers "no backing": the
// layer is ingested as it is, and no QEMU program runs.
import type * as ChildProcess from 'node:child_process';
import { afterAll, beforeAll, describe, expect, it, vi } from 'vitest';
import { existsSync, mkdirSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { rm } from 'node:fs/promises';
import { join } from 'node:path';
import { create, fromBinary } from '@bufbuild/protobuf';
import { pino } from 'pino';
import { ChunkStoreShipper } from './shipper.ts';
import { FsChunkStore, FsManifestStore } from './chunkstore/fs-store.ts';
import { ingestSnapshot } from './chunkstore/ingest.ts';
import { Materialiser } from './chunkstore/materialise.ts';
import { LiveRoots, systemClock, type ChunkStore, type ManifestStore } from '../domain/snapshot-store.ts';
import { generateSigningKey, signManifest, signTicket, type SigningKey, type TrustedKeys } from '../domain/tickets.ts';
import type { LocalSnapshot, SnapshotManifest as VmmSnapshotManifest, VmmDriver } from '../domain/vmm.ts';
import { ArtifactKind, SignedManifestSchema, SnapshotManifestSchema, type SignedManifest } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { FetchSnapshotWorkSchema, type FetchSnapshotWork } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { tempDir } from '../../services/testkit/proc.ts';
import { startGrpcServer, type RunningGrpcServer } from '../../services/adapters/grpc/server.ts';
import { chunkTransferService } from './peer/server.ts';
import { sha256Hex } from './chunkstore/codec.ts';

vi.mock('node:child_process', async (importOriginal) => {
  const actual = await importOriginal<typeof ChildProcess>();
  const { promisify } = await import('node:util');
  const real = promisify(actual.execFile) as (...a: unknown[]) => Promise<unknown>;
  const execFile = Object.assign((...a: unknown[]) => (actual.execFile as (...a: unknown[]) => unknown)(...a), {
    [promisify.custom]: async (cmd: string, args: readonly string[], ...rest: unknown[]) => (cmd === 'qemu-img' && args[0] === 'info' ? { stdout: '{}', stderr: '' } : real(cmd, args, ...rest)),
  });
  return { ...actual, execFile };
});

const CS = 64 * 1024;
const log = pino({ level: 'silent' });
let dir: string;
let key: SigningKey;
let trust: TrustedKeys;

beforeAll(() => {
  dir = tempDir('ff-shipper-unit-');
  ({ signing: key, trusted: trust } = generateSigningKey('k1'));
});
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** A gate a test opens: `wait()` resolves once `open()` was called. */
function gate(): { wait: () => Promise<void>; open: () => void; entered: Promise<void> } {
  let open!: () => void;
  let enter!: () => void;
  const opened = new Promise<void>((r) => (open = r));
  const entered = new Promise<void>((r) => (enter = r));
  return {
    wait: () => {
      enter();
      return opened;
    },
    open,
    entered,
  };
}

/**
 * The driver as the shipper uses it: snapshot directories hold the VMM's manifest.json; a
 * delete waits for `deleting` (when set) and removes the directory (no VM uses any).
 */
function fakeDriver(opts: { deleting?: () => Promise<void> } = {}): VmmDriver & { deleted: string[] } {
  const deleted: string[] = [];
  return {
    deleted,
    openSnapshot: async (d: string): Promise<LocalSnapshot> => ({ dir: d, manifest: JSON.parse(readFileSync(join(d, 'manifest.json'), 'utf8')) as VmmSnapshotManifest }),
    deleteSnapshot: async (s: LocalSnapshot) => {
      await opts.deleting?.();
      await rm(s.dir, { recursive: true, force: true });
      deleted.push(s.manifest.snapshotId);
    },
    snapshotsInUse: async () => new Set<string>(),
    vmsUse: () => false,
  } as unknown as VmmDriver & { deleted: string[] };
}

async function host(name: string, opts: { driver?: VmmDriver; chunks?: (c: FsChunkStore) => ChunkStore; manifests?: (m: FsManifestStore) => ManifestStore; gcGraceMs?: number } = {}) {
  const root = join(dir, name);
  const store = new FsChunkStore(root, { offload: false });
  const stored = new FsManifestStore(root);
  const chunks = opts.chunks?.(store) ?? store;
  const manifests = opts.manifests?.(stored) ?? stored;
  const roots = new LiveRoots();
  const materialiser = new Materialiser({ root, chunks: store, manifests: stored, trust, roots, syncInline: true });
  const driverSnapshotsDir = join(root, 'vmm');
  mkdirSync(driverSnapshotsDir, { recursive: true });
  const driver = opts.driver ?? fakeDriver();
  const shipper = new ChunkStoreShipper({ hostId: 'h1', driver, driverSnapshotsDir, chunks, manifests, materialiser, roots, trust, scratchDir: join(root, 'scratch'), log, chunkSize: CS, ...(opts.gcGraceMs === undefined ? {} : { gcGraceMs: opts.gcGraceMs }) });
  return { root, store, stored, roots, driverSnapshotsDir, shipper };
}

/** A manifest store whose first read also removes what it read: remove() of the snapshot, right after obtain read it. */
function removedOnFirstRead(m: FsManifestStore): ManifestStore {
  let reads = 0;
  return {
    get: async (id) => {
      const got = await m.get(id);
      if (reads++ === 0) await m.delete(id);
      return got;
    },
    list: () => m.list(),
    delete: (id) => m.delete(id),
    put: (id, s) => m.put(id, s),
  };
}

/** A manifest store whose writes wait for `g` before they store. */
function putsWaitFor(g: ReturnType<typeof gate>): (m: FsManifestStore) => ManifestStore {
  return (m) => ({
    get: (id) => m.get(id),
    list: () => m.list(),
    delete: (id) => m.delete(id),
    put: async (id, s) => {
      await g.wait();
      await m.put(id, s);
    },
  });
}

/** A snapshot the VMM took here: its sealed directory. */
function ownSnapshot(driverSnapshotsDir: string, snapshotId: string): string {
  const own = join(driverSnapshotsDir, snapshotId);
  mkdirSync(own, { recursive: true });
  writeFileSync(join(own, 'memory'), 'guest memory');
  writeFileSync(join(own, 'manifest.json'), JSON.stringify({ snapshotId }));
  return own;
}

/**
 * A snapshot held elsewhere whose chunks are all stored here already (the manifest bytes too,
 * unsigned, as an ingest stores them): a fetch of it asks no peer for anything. The work
 * carries the scheduler's signature. Its two chunks are filled with `fill` and `fill + 1`.
 */
async function chunksHere(h: Awaited<ReturnType<typeof host>>, snapshotId: string, fill = 1) {
  const mem = join(h.root, `${snapshotId}.mem`);
  writeFileSync(mem, Buffer.concat([Buffer.alloc(CS, fill), Buffer.alloc(CS, fill + 1)]));
  const r = await ingestSnapshot({ snapshotId, tenantId: 't', sourceSandboxId: 'sb', artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', path: mem }] }, { chunks: h.store, roots: new LiveRoots(), clock: systemClock, chunkSize: CS });
  r.unpin();
  r.manifest.metadata = { 'manifest.json': Buffer.from(JSON.stringify({ snapshotId })), 'image.json': Buffer.from('{}') };
  const signed = signManifest(r.manifest, key);
  await h.stored.put(snapshotId, create(SignedManifestSchema, { manifest: signed.manifest }));
  const ticket = signTicket({ snapshotId, destinationHostId: 'h1', expiresAt: new Date(Date.now() + 60_000) }, key);
  // An address nothing listens on: never dialled, as no chunk is missing.
  return create(FetchSnapshotWorkSchema, { snapshotId, sources: [{ hostId: 'hA', address: '127.0.0.1:9' }], ticket, manifest: signed });
}

describe('ChunkStoreShipper.remove against a lease', () => {
  it('remove_whileARestoreLeasesTheSnapshotsOwnDirectory_keepsItUntilTheLeaseIsReleased_andReportsTheDeleteDone', async () => {
    const h = await host('leased-own');
    const own = ownSnapshot(h.driverSnapshotsDir, 'sn-a');
    await h.shipper.load();
    // restoreVms: the lease, then obtain() gives the snapshot's own directory; its VMs do not
    // map it yet (the driver would refuse to delete it then).
    const lease = h.shipper.lease('sn-a', 'restore/op-1/restore');
    const { local } = await h.shipper.obtain('sn-a', undefined, () => undefined);
    expect(local.dir).toBe(own);
    // A delete step of the same snapshot, running alongside: done, though the files stay.
    await h.shipper.remove('sn-a');
    expect(existsSync(join(own, 'memory'))).toBe(true);
    await h.shipper.collectGarbage();
    expect(existsSync(join(own, 'memory'))).toBe(true);
    expect(h.shipper.held()).toEqual([]);
    expect(await h.shipper.holds('sn-a')).toBe(false);
    // Released: a GC follows by itself and removes the directory.
    lease.release();
    await vi.waitFor(() => expect(existsSync(own)).toBe(false));
  });

  it('obtain_ofASnapshotDeletedHereWhoseDirectoryAGcIsRemovingNow_doesNotHandTheDirectoryOut', async () => {
    const deleting = gate();
    const driver = fakeDriver({ deleting: deleting.wait });
    const h = await host('deleting-own', { driver });
    ownSnapshot(h.driverSnapshotsDir, 'sn-b');
    await h.shipper.load();
    const removed = h.shipper.remove('sn-b');
    // The GC is deleting the directory (it found no lease); a restore leases and obtains now.
    await deleting.entered;
    const lease = h.shipper.lease('sn-b', 'restore/op-2/restore');
    const got = h.shipper.obtain('sn-b', undefined, () => undefined);
    deleting.open();
    await expect(got).rejects.toThrow(/not on host h1/);
    lease.release();
    await removed;
    expect(driver.deleted).toEqual(['sn-b']);
  });
});

/** The chunk store with its sweep wrapped: `before` runs ahead of each sweep; `sweeps` counts them (one per GC pass). */
function countingSweeps(before: (n: number) => Promise<void> = async () => undefined) {
  const counted = { sweeps: 0 };
  const wrap = (c: FsChunkStore): ChunkStore =>
    new Proxy(c, {
      get: (target, k) => {
        const v = Reflect.get(target, k) as unknown;
        if (k === 'sweep') return async (isLive: Parameters<FsChunkStore['sweep']>[0]) => (await before(++counted.sweeps), target.sweep(isLive));
        return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v;
      },
    });
  return { counted, wrap };
}

describe('ChunkStoreShipper.remove and the GC after it', () => {
  it('remove_ofTenSnapshotsAtOnce_sharesGcPasses_atMostTwo_andEachEndsWithTheChunksNothingElseReachesFreed', async () => {
    let gcCalls = 0;
    // The first pass sweeps only once all ten deletes asked for theirs: each pass is slow
    // next to a delete, as on a big store.
    const { counted, wrap } = countingSweeps(async (n) => {
      if (n === 1) await vi.waitFor(() => expect(gcCalls).toBe(10));
    });
    const h = await host('remove-burst', { chunks: wrap, gcGraceMs: 0 });
    await chunksHere(h, 'sn-keep', 100);
    const kept = await h.store.list();
    const ids = Array.from({ length: 10 }, (_, i) => `sn-burst-${i}`);
    for (const [i, id] of ids.entries()) await chunksHere(h, id, 2 * i + 10);
    await h.shipper.load();
    expect(await h.store.list()).toHaveLength(22);
    const collect = h.shipper.collectGarbage.bind(h.shipper);
    vi.spyOn(h.shipper, 'collectGarbage').mockImplementation(() => (gcCalls++, collect()));
    await Promise.all(ids.map((id) => h.shipper.remove(id)));
    // One pass ran when the first delete asked; the other nine shared the one after it (ten
    // passes in turn before).
    expect(gcCalls).toBe(10);
    expect(counted.sweeps).toBeLessThanOrEqual(2);
    expect(await h.store.list()).toEqual(kept);
    expect(h.shipper.held().map((x) => x.snapshotId)).toEqual(['sn-keep']);
  });

  it('remove_whenTheGcAfterItFails_isDoneAllTheSame_andTheNextPassFreesItsChunks', async () => {
    let failing = true;
    const { counted, wrap } = countingSweeps(async () => {
      if (failing) throw Object.assign(new Error('EIO: i/o error, scandir'), { code: 'EIO' });
    });
    const h = await host('remove-gc-fails', { chunks: wrap, gcGraceMs: 0 });
    await chunksHere(h, 'sn-gcf');
    await h.shipper.load();
    // The manifest is gone: the delete is done, though its pass failed.
    await h.shipper.remove('sn-gcf');
    expect(counted.sweeps).toBe(1);
    expect(await h.stored.get('sn-gcf')).toBeUndefined();
    expect(h.shipper.held()).toEqual([]);
    expect(await h.store.list()).toHaveLength(2);
    failing = false;
    await h.shipper.collectGarbage();
    expect(await h.store.list()).toEqual([]);
  });
});

describe('ChunkStoreShipper.remove against a fetch whose manifest write is deferred', () => {
  it('remove_afterObtainReturnedButBeforeTheManifestWasWritten_wins_theSnapshotIsNeitherStoredNorHeld', async () => {
    const syncing = gate();
    // The fetch's chunk fsyncs (before its manifest write) take until the gate opens.
    const h = await host('deferred-before-put', {
      chunks: (c) =>
        new Proxy(c, {
          get: (target, k) => {
            const v = Reflect.get(target, k) as unknown;
            if (k === 'sync') return async () => (await syncing.wait(), target.sync());
            return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v;
          },
        }),
    });
    const work = await chunksHere(h, 'sn-c');
    await h.shipper.load();
    const { local } = await h.shipper.obtain('sn-c', work, () => undefined);
    expect(readFileSync(join(local.dir, 'memory')).length).toBe(2 * CS);
    await syncing.entered;
    await h.shipper.remove('sn-c');
    syncing.open();
    const durable = h.shipper.durable('sn-c');
    await durable.catch(() => undefined);
    // The background write did not bring the snapshot back: not stored, not held, and the
    // restore that waits for it hears so (it reports the snapshot not held here).
    expect(await h.stored.get('sn-c')).toBeUndefined();
    expect(h.shipper.held()).toEqual([]);
    expect(await h.shipper.holds('sn-c')).toBe(false);
    await expect(durable).rejects.toThrow(/deleted on host h1 while it was being fetched/);
  });

  it('remove_whileTheFetchsManifestIsBeingWritten_waitsForTheWriteAndDeletesIt', async () => {
    const putting = gate();
    const h = await host('deferred-during-put', { manifests: putsWaitFor(putting) });
    // Stored unsigned through the real store (the wrapper's put is the fetch's).
    const work = await chunksHere(h, 'sn-d');
    await h.shipper.load();
    await h.shipper.obtain('sn-d', work, () => undefined);
    await putting.entered;
    let removeDone = false;
    const removed = h.shipper.remove('sn-d').then(() => (removeDone = true));
    await new Promise((r) => setTimeout(r, 50));
    expect(removeDone).toBe(false); // waits for the put that began before it
    putting.open();
    await removed;
    const durable = h.shipper.durable('sn-d');
    await durable.catch(() => undefined);
    expect(await h.stored.get('sn-d')).toBeUndefined();
    expect(h.shipper.held()).toEqual([]);
    await expect(durable).rejects.toThrow(/deleted on host h1 while it was being fetched/);
  });
});

describe('ChunkStoreShipper.replicate', () => {
  it('replicate_ofASnapshotHeldElsewhere_storesItHeldComplete_andBuildsNoImage_untilARestoreHere', async () => {
    // The fetchSnapshot step (a replica, a drain) built the whole memory image and disk layer,
    // which no VM here used and which stayed (uncounted) until the snapshot was deleted.
    const h = await host('replicate');
    const work = await chunksHere(h, 'sn-r');
    const { bytesFetched } = await h.shipper.replicate('sn-r', work);
    await h.shipper.durable('sn-r');
    expect(bytesFetched).toBe(0);
    expect((await h.stored.get('sn-r'))?.signature.length).toBeGreaterThan(0);
    expect(h.shipper.held()).toEqual([expect.objectContaining({ snapshotId: 'sn-r', complete: true })]);
    expect(readdirSync(join(h.root, 'images'))).toEqual([]);
    // A restore here builds the image then, from the stored manifest.
    const { local } = await h.shipper.obtain('sn-r', undefined, () => undefined);
    expect(readFileSync(join(local.dir, 'memory')).length).toBe(2 * CS);
  });
});

describe('ChunkStoreShipper.obtain against a delete', () => {
  it('obtain_thatFindsAChunkCorrupt_andCannotFetchItBack_holdsNoOtherSnapshotSharingThatChunkCompleteEither', async () => {
    const h = await host('shared-chunk-corrupt');
    // Same content: sn-g and sn-h share both chunks.
    for (const id of ['sn-g', 'sn-h']) await h.stored.put(id, (await chunksHere(h, id)).manifest!);
    await h.shipper.load();
    expect(h.shipper.held().map((x) => [x.snapshotId, x.complete]).sort()).toEqual([['sn-g', true], ['sn-h', true]]);
    const chunkDir = join(h.root, 'chunks');
    const files = readdirSync(chunkDir, { recursive: true, withFileTypes: true }).filter((e) => e.isFile() && /^[0-9a-f]{64}$/.test(e.name));
    expect(files.length).toBe(2);
    const f = join(files[0]!.parentPath, files[0]!.name);
    writeFileSync(f, Buffer.alloc(readFileSync(f).length, 0x5a));
    await expect(h.shipper.obtain('sn-g', undefined, () => undefined)).rejects.toThrow(/incomplete on host h1/);
    expect(h.shipper.held().map((x) => [x.snapshotId, x.complete]).sort()).toEqual([['sn-g', false], ['sn-h', false]]);
  });

  it('obtain_whenTheStoredManifestIsRemovedBeforeItsImageIsBuilt_fetchesFromTheSourcesNamedForThisRestore_butDoesNotHoldItAgain', async () => {
    // The image build read the manifest again, found none (ManifestNotFoundError, final) and
    // the restore failed for good though sources were named.
    const h = await host('removed-before-build', { manifests: removedOnFirstRead });
    const work = await chunksHere(h, 'sn-e');
    await h.stored.put('sn-e', work.manifest!);
    const { local } = await h.shipper.obtain('sn-e', work, () => undefined);
    expect(readFileSync(join(local.dir, 'memory')).length).toBe(2 * CS);
    // The delete finished first: the snapshot is not stored, nor held, here again.
    await expect(h.shipper.durable('sn-e')).rejects.toThrow();
    expect(await h.stored.get('sn-e')).toBeUndefined();
    expect(h.shipper.held().filter((x) => x.snapshotId === 'sn-e' && x.complete)).toEqual([]);
  });

  it('obtain_whenTheStoredManifestIsRemovedBeforeItsImageIsBuilt_andNoSourceIsNamed_saysTheSnapshotIsNotHere', async () => {
    const h = await host('removed-before-build-no-source', { manifests: removedOnFirstRead });
    const work = await chunksHere(h, 'sn-f');
    await h.stored.put('sn-f', work.manifest!);
    await expect(h.shipper.obtain('sn-f', undefined, () => undefined)).rejects.toThrow(/not on host h1 and no source was named/);
  });
});

describe('ChunkStoreShipper: the manifest bytes from the sources', () => {
  /** A peer's ChunkTransferService whose manifest store answers `manifestBytes` for every snapshot (chunks: none). */
  async function peerAnswering(name: string, manifestBytes: Uint8Array): Promise<RunningGrpcServer> {
    const root = join(dir, name);
    const manifests: ManifestStore = { get: async () => create(SignedManifestSchema, { manifest: manifestBytes }), put: async () => undefined, delete: async () => undefined, list: async () => [] };
    const svc = chunkTransferService({ chunks: new FsChunkStore(root), manifests, trust, clock: systemClock });
    return startGrpcServer({ address: '127.0.0.1:0', services: [svc.registration] });
  }

  it('replicate_whoseFirstSourceAnswersBytesTheSchedulersSignatureDoesNotVerify_takesTheNextSourcesBytes_andHoldsTheSnapshot', async () => {
    const h = await host('manifest-liar');
    // The chunks are here, the manifest is not: it comes from a source, under the scheduler's signature.
    const work = await chunksHere(h, 'sn-l');
    await h.stored.delete('sn-l');
    const honestBytes = work.manifest!.manifest;
    const liar = await peerAnswering('peer-liar', Buffer.concat([honestBytes, Buffer.from([0x08, 0x01])]));
    const honest = await peerAnswering('peer-honest', honestBytes);
    try {
      const fromBoth = create(FetchSnapshotWorkSchema, { snapshotId: 'sn-l', ticket: work.ticket, manifest: work.manifest, sources: [{ hostId: 'liar', address: liar.address }, { hostId: 'honest', address: honest.address }] });
      await h.shipper.replicate('sn-l', fromBoth);
      await h.shipper.durable('sn-l');
      expect(Buffer.from((await h.stored.get('sn-l'))!.manifest)).toEqual(Buffer.from(honestBytes));
      expect(h.shipper.held()).toEqual([expect.objectContaining({ snapshotId: 'sn-l', complete: true })]);
    } finally {
      await liar.close(100);
      await honest.close(100);
    }
  });
});

/**
 * A snapshot the VMM took here that an ingest can cut: its sealed directory with the VMM's
 * manifest, `memory` (two chunks filled with `fill` and `fill + 1`), `state` and `disk`.
 */
function takenHere(driverSnapshotsDir: string, snapshotId: string, fill: number): LocalSnapshot {
  const own = ownSnapshot(driverSnapshotsDir, snapshotId);
  writeFileSync(join(own, 'memory'), Buffer.concat([Buffer.alloc(CS, fill), Buffer.alloc(CS, fill + 1)]));
  writeFileSync(join(own, 'state'), Buffer.alloc(1000, fill + 2));
  writeFileSync(join(own, 'disk'), Buffer.alloc(CS, fill + 3));
  writeFileSync(join(own, 'image.json'), JSON.stringify({ disk: '/images/base.qcow2' }));
  const manifest: VmmSnapshotManifest = {
    schema: 1,
    snapshotId,
    parentSnapshotId: null,
    sourceVmId: 'vm-1',
    createdAt: new Date().toISOString(),
    config: { machineType: 'microvm', memoryMib: 256, vcpus: 1, devices: [], qemuVersion: '8', accel: 'tcg', cpuModel: 'max' },
    image: { name: 'tiny', recipeHash: 'h', kernelArgs: '' },
    files: { memory: 'memory', deviceState: 'state', disk: 'disk' },
    diskVirtualSize: CS,
    method: 'shared-file',
    sourcePauseMs: 0,
  };
  writeFileSync(join(own, 'manifest.json'), JSON.stringify(manifest));
  return { dir: own, manifest };
}

/** The chunk store with the methods `over` gives in place of its own (the others bound to it). */
function chunksWith(over: (c: FsChunkStore) => Partial<ChunkStore>): (c: FsChunkStore) => ChunkStore {
  return (c) => {
    const o = over(c);
    return new Proxy(c, {
      get: (target, k) => {
        if (Object.hasOwn(o, k)) return Reflect.get(o, k) as unknown;
        const v = Reflect.get(target, k) as unknown;
        return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v;
      },
    });
  };
}

/** A peer whose ChunkTransferService holds the chunks of `sn-own` (as takenHere cuts it with fill 7) and answers `ingested` as its manifest. */
async function peerHoldingOwn(name: string, ingested: SignedManifest): Promise<RunningGrpcServer> {
  const peerRoot = join(dir, name);
  const peerChunks = new FsChunkStore(peerRoot, { offload: false });
  const mem = join(peerRoot, 'memory');
  writeFileSync(mem, Buffer.concat([Buffer.alloc(CS, 7), Buffer.alloc(CS, 8)]));
  (await ingestSnapshot({ snapshotId: 'sn-own', tenantId: '', sourceSandboxId: 'vm-1', artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', path: mem }] }, { chunks: peerChunks, roots: new LiveRoots(), clock: systemClock, chunkSize: CS })).unpin();
  const peerManifests: ManifestStore = { get: async () => ingested, put: async () => undefined, delete: async () => undefined, list: async () => [] };
  return startGrpcServer({ address: '127.0.0.1:0', services: [chunkTransferService({ chunks: peerChunks, manifests: peerManifests, trust, clock: systemClock }).registration] });
}

/** Runs `body` with a peerHoldingOwn(`name`, `ingested`) at the address it is given; the peer is closed after, whatever `body` did. */
async function withPeerHoldingOwn<T>(name: string, ingested: SignedManifest, body: (address: string) => Promise<T>): Promise<T> {
  const peer = await peerHoldingOwn(name, ingested);
  try {
    return await body(peer.address);
  } finally {
    await peer.close(100);
  }
}

/** Replicates `sn-own` with `work` and expects it fetched (some bytes from the sources), `lost` stored again if named, and the snapshot durable and held complete. */
async function expectReplicaFetchedAndHeldComplete(h: Awaited<ReturnType<typeof host>>, work: FetchSnapshotWork, lost?: string): Promise<void> {
  const { bytesFetched } = await h.shipper.replicate('sn-own', work);
  await h.shipper.durable('sn-own');
  expect(bytesFetched).toBeGreaterThan(0);
  if (lost !== undefined) expect(await h.store.has(lost)).toBe(true);
  expect(h.shipper.held()).toEqual([expect.objectContaining({ snapshotId: 'sn-own', complete: true })]);
}

/**
 * A snapshot taken and ingested here whose second memory chunk was lost (removed because
 * its fsync failed at start-up), and the agent restarted (with `opts`): held, not complete.
 */
async function lostAChunk(name: string, opts: Parameters<typeof host>[1] = {}) {
  const first = await host(name);
  const local = takenHere(first.driverSnapshotsDir, 'sn-own', 7);
  const ingested = await first.shipper.ingest(local);
  const lost = sha256Hex(Buffer.alloc(CS, 8));
  rmSync(first.store.pathOf(lost));
  const h = await host(name, opts);
  await h.shipper.load();
  expect(h.shipper.held().map((x) => [x.snapshotId, x.complete])).toEqual([['sn-own', false]]);
  // The scheduler signed the manifest the snapshot step returned.
  const signed = signManifest(fromBinary(SnapshotManifestSchema, ingested.manifest), key);
  const ticket = signTicket({ snapshotId: 'sn-own', destinationHostId: 'h1', expiresAt: new Date(Date.now() + 60_000) }, key);
  const work = (address = '127.0.0.1:9') => create(FetchSnapshotWorkSchema, { snapshotId: 'sn-own', sources: [{ hostId: 'hA', address }], ticket, manifest: signed });
  return { h, local, ingested, lost, work };
}

describe('ChunkStoreShipper: a snapshot taken here that lost a chunk', () => {

  it('ingest_runAgainForIt_storesTheChunkAgainFromItsOwnFiles_keepsTheStoredManifest_andHoldsItComplete', async () => {
    // It returned the stored manifest: incomplete for good, the host no holder of the snapshot.
    const { h, local, ingested, lost } = await lostAChunk('own-lost-ingest');
    const again = await h.shipper.ingest(local);
    expect(Buffer.from(again.manifest)).toEqual(Buffer.from(ingested.manifest));
    expect(await h.store.has(lost)).toBe(true);
    expect(h.shipper.held()).toEqual([expect.objectContaining({ snapshotId: 'sn-own', complete: true })]);
  });

  it('replicate_ofIt_storesTheChunkAgainFromItsOwnFiles_andHoldsItComplete', async () => {
    // It returned at once (its VMM directory is here) and durable() resolved: reported done,
    // the host still not a holder.
    const { h, lost, work } = await lostAChunk('own-lost-replicate');
    expect(await h.shipper.replicate('sn-own', work())).toEqual({ bytesFetched: 0 });
    await h.shipper.durable('sn-own');
    expect(await h.store.has(lost)).toBe(true);
    expect(h.shipper.held()).toEqual([expect.objectContaining({ snapshotId: 'sn-own', complete: true })]);
  });

  it('obtain_ofIt_givesItsOwnDirectory_storesTheChunkAgainFromItsOwnFiles_andHoldsItComplete', async () => {
    const { h, local, lost } = await lostAChunk('own-lost-obtain');
    const got = await h.shipper.obtain('sn-own', undefined, () => undefined);
    expect(got.local.dir).toBe(local.dir);
    // In the background: the restore does not wait for it.
    await vi.waitFor(() => expect(h.shipper.held()).toEqual([expect.objectContaining({ snapshotId: 'sn-own', complete: true })]));
    expect(await h.store.has(lost)).toBe(true);
  });

  it('replicate_ofIt_whenItsOwnFilesNoLongerHoldTheChunk_fetchesItFromTheSources_andHoldsItComplete', async () => {
    const { h, local, ingested, lost, work } = await lostAChunk('own-lost-fetched');
    writeFileSync(join(local.dir, 'memory'), Buffer.alloc(2 * CS, 0x5a));
    await withPeerHoldingOwn('own-lost-peer', ingested, (address) => expectReplicaFetchedAndHeldComplete(h, work(address), lost));
  });
});

describe('ChunkStoreShipper.remove against an ingest', () => {
  it('remove_whileAnIngestStoresItsManifest_waitsForTheWriteAndDeletesIt_andTheIngestFails', async () => {
    // The delete was reported done, then the ingest stored its manifest and held the deleted
    // snapshot complete.
    const putting = gate();
    const h = await host('ingest-during-remove', { manifests: putsWaitFor(putting) });
    const local = takenHere(h.driverSnapshotsDir, 'sn-i', 20);
    const ingesting = h.shipper.ingest(local);
    ingesting.catch(() => undefined);
    await putting.entered;
    const removed = h.shipper.remove('sn-i');
    putting.open();
    await removed;
    await expect(ingesting).rejects.toThrow(/deleted on host h1 while it was being ingested/);
    expect(await h.stored.get('sn-i')).toBeUndefined();
    expect(h.shipper.held()).toEqual([]);
  });
});

describe('ChunkStoreShipper: a delete during the repair of a snapshot taken here', () => {
  /** The chunk store whose `missing` waits for `g` at its `n`-th call once `on.gated` is set (restoreOwnChunks calls it twice: what it lacks, what it still lacks). */
  function missingWaitsAt(n: number, g: ReturnType<typeof gate>, on: { gated: boolean }) {
    let calls = 0;
    return chunksWith((c) => ({
      missing: async (ds: Iterable<string>) => {
        const out = await c.missing(ds);
        if (on.gated && ++calls === n) await g.wait();
        return out;
      },
    }));
  }

  it('replicate_ofIt_whenItIsRemovedDuringTheRepair_andItsOwnFilesDoNotGiveTheChunkBack_failsAndFetchesNothing', async () => {
    // The repair returned the chunk still lacking, unmarked; the fetch after it took it from
    // the peer and stored the manifest: the deleted snapshot held complete.
    const g = gate();
    const on = { gated: false };
    const { h, local, ingested, lost, work } = await lostAChunk('own-removed-repairing', { chunks: missingWaitsAt(2, g, on) });
    writeFileSync(join(local.dir, 'memory'), Buffer.alloc(2 * CS, 0x5a));
    await withPeerHoldingOwn('own-removed-repairing-peer', ingested, async (address) => {
      on.gated = true;
      const replicating = h.shipper.replicate('sn-own', work(address));
      replicating.catch(() => undefined);
      await g.entered;
      await h.shipper.remove('sn-own');
      g.open();
      await expect(replicating).rejects.toThrow(/deleted on host h1 while it was being repaired/);
      await h.shipper.durable('sn-own').catch(() => undefined);
      expect(await h.stored.get('sn-own')).toBeUndefined();
      expect(await h.store.has(lost)).toBe(false);
      expect(h.shipper.held()).toEqual([]);
    });
  });

  it('replicate_ofIt_whenItIsRemovedBetweenTheRepairAndTheFetch_failsAndFetchesNothing', async () => {
    // Nothing tracked the snapshot between the repair's end and the fetch's start.
    const g = gate();
    let gated = false;
    let gets = 0;
    const { h, local, ingested, lost, work } = await lostAChunk('own-removed-before-fetch', {
      // The repair reads the manifest first; replicate reads it again for the fetch.
      manifests: (m) => ({
        get: async (id) => {
          const got = await m.get(id);
          if (gated && ++gets === 2) await g.wait();
          return got;
        },
        list: () => m.list(),
        delete: (id) => m.delete(id),
        put: (id, s) => m.put(id, s),
      }),
    });
    writeFileSync(join(local.dir, 'memory'), Buffer.alloc(2 * CS, 0x5a));
    await withPeerHoldingOwn('own-removed-before-fetch-peer', ingested, async (address) => {
      gated = true;
      const replicating = h.shipper.replicate('sn-own', work(address));
      replicating.catch(() => undefined);
      await g.entered;
      await h.shipper.remove('sn-own');
      g.open();
      await expect(replicating).rejects.toThrow(/deleted on host h1/);
      await h.shipper.durable('sn-own').catch(() => undefined);
      expect(await h.stored.get('sn-own')).toBeUndefined();
      expect(await h.store.has(lost)).toBe(false);
      expect(h.shipper.held()).toEqual([]);
    });
  });

  it('ingest_runAgainForIt_whenItIsRemovedDuringTheRepair_andItsOwnFilesDoNotGiveTheChunkBack_fails', async () => {
    // It returned the stored manifest: the snapshot step reported done for a deleted snapshot.
    const g = gate();
    const on = { gated: false };
    const { h, local } = await lostAChunk('own-removed-ingesting', { chunks: missingWaitsAt(2, g, on) });
    writeFileSync(join(local.dir, 'memory'), Buffer.alloc(2 * CS, 0x5a));
    on.gated = true;
    const ingesting = h.shipper.ingest(local);
    ingesting.catch(() => undefined);
    await g.entered;
    await h.shipper.remove('sn-own');
    g.open();
    await expect(ingesting).rejects.toThrow(/deleted on host h1 while it was being ingested/);
    expect(await h.stored.get('sn-own')).toBeUndefined();
    expect(h.shipper.held()).toEqual([]);
  });
});

describe('ChunkStoreShipper: an attempt begun while a delete runs', () => {
  it('ingest_runAgainWhileARemoveWaitsForTheManifestsDelete_failsAndHoldsNothing', async () => {
    // Begun after remove() had marked the attempts it found, it found the manifest still
    // readable, repaired the snapshot and held it complete again after the delete was done.
    const deleting = gate();
    const { h, local } = await lostAChunk('own-ingest-during-remove', {
      manifests: (m) => ({
        get: (id) => m.get(id),
        list: () => m.list(),
        put: (id: string, sm: SignedManifest) => m.put(id, sm),
        delete: async (id: string) => {
          await deleting.wait();
          return m.delete(id);
        },
      }),
    });
    const removing = h.shipper.remove('sn-own');
    await deleting.entered;
    const ingesting = h.shipper.ingest(local);
    ingesting.catch(() => undefined);
    await new Promise((r) => setTimeout(r, 20));
    deleting.open();
    await removing;
    await expect(ingesting).rejects.toThrow(/deleted on host h1 while it was being ingested/);
    expect(h.shipper.held()).toEqual([]);
  });
});

describe('ChunkStoreShipper: after a delete', () => {
  it('replicate_askedWhileTheDeletesGcPassRuns_isNoAttemptOnTheDeletedSnapshot_andGoesOn', async () => {
    // remove() counted as removing through its GC pass, after the manifest was gone: a replica
    // asked again then failed as deleted while being fetched.
    const sweeping = gate();
    let gated = false;
    const { h, work } = await lostAChunk('own-replicate-after-remove', {
      chunks: chunksWith((c) => ({
        sweep: async (keep: Parameters<FsChunkStore['sweep']>[0]) => {
          if (gated) await sweeping.wait();
          return c.sweep(keep);
        },
      })),
    });
    gated = true;
    const removing = h.shipper.remove('sn-own');
    await sweeping.entered;
    expect(await h.stored.get('sn-own')).toBeUndefined();
    // Its own directory is marked deleted: a replica now fetches from the sources (none here).
    const e = await h.shipper.replicate('sn-own', work()).then(() => undefined, (x: unknown) => x as Error);
    sweeping.open();
    await removing;
    expect(e?.message ?? '').not.toMatch(/deleted on host h1 while/);
  });
});

describe('ChunkStoreShipper: a snapshot step run again after its delete', () => {
  it('ingest_whileTheDeleteWaitsForAGcPass_isRefused_andNothingIsHeld', async () => {
    // The manifest gone, the directory not yet (the GC pass removes it): the step redelivered
    // cut the directory anew and held the deleted snapshot complete.
    const sweeping = gate();
    let gated = false;
    const { h, local } = await lostAChunk('ingest-after-manifest-gone', {
      chunks: chunksWith((c) => ({
        sweep: async (keep: Parameters<FsChunkStore['sweep']>[0]) => {
          if (gated) {
            gated = false;
            await sweeping.wait();
          }
          return c.sweep(keep);
        },
      })),
    });
    gated = true;
    const gc = h.shipper.collectGarbage(); // a periodic pass already running
    await sweeping.entered;
    const removing = h.shipper.remove('sn-own');
    await vi.waitFor(async () => expect(await h.stored.get('sn-own')).toBeUndefined());
    const ingested = h.shipper.ingest(local);
    ingested.catch(() => undefined);
    await expect(ingested).rejects.toThrow(/deleted on host h1 while it was being ingested/);
    sweeping.open();
    await gc;
    await removing;
    expect(h.shipper.held()).toEqual([]);
    expect(await h.stored.get('sn-own')).toBeUndefined();
  });
});

describe('ChunkStoreShipper: a repair of a snapshot taken here that fails', () => {
  const enospc = () => Object.assign(new Error('ENOSPC: no space left on device, write'), { code: 'ENOSPC' });

  it('ingest_runAgainForIt_whenStoringTheChunkAgainFails_resolvesWithTheStoredManifest_andHoldsItIncomplete', async () => {
    // The snapshot step failed (ENOSPC), and its op with it: a snapshot that restores from its
    // directory could be deleted for it.
    const { h, local, ingested } = await lostAChunk('own-repair-put-fails', { chunks: chunksWith(() => ({ put: async () => Promise.reject(enospc()) })) });
    const again = await h.shipper.ingest(local);
    expect(Buffer.from(again.manifest)).toEqual(Buffer.from(ingested.manifest));
    expect(h.shipper.held()).toEqual([expect.objectContaining({ snapshotId: 'sn-own', complete: false })]);
  });

  it('replicate_ofIt_whenStoringTheChunkAgainFails_fetchesItFromTheSources_andHoldsItComplete', async () => {
    // The replica step failed on the repair's error, though a source held every chunk.
    const { h, ingested, lost, work } = await lostAChunk('own-repair-put-fails-replicate', { chunks: chunksWith(() => ({ put: async () => Promise.reject(enospc()) })) });
    await withPeerHoldingOwn('own-repair-put-fails-peer', ingested, (address) => expectReplicaFetchedAndHeldComplete(h, work(address), lost));
  });
});

describe('ChunkStoreShipper: the repair of a snapshot taken here, for a restore', () => {
  /** The chunk store whose `put` waits for `g`, counting its calls. */
  function putWaits(g: ReturnType<typeof gate>) {
    const counted = { puts: 0 };
    const wrap = chunksWith((c) => ({
      put: async (...a: Parameters<ChunkStore['put']>) => {
        counted.puts++;
        await g.wait();
        return c.put(...a);
      },
    }));
    return { counted, wrap };
  }

  it('obtain_ofIt_resolvesWithoutWaitingForTheRepair', async () => {
    // The restore waited for the repair to read, hash, store and sync every chunk it lacked.
    const g = gate();
    const { wrap } = putWaits(g);
    const { h, local, lost } = await lostAChunk('own-repair-background', { chunks: wrap });
    let returned = false;
    const got = h.shipper.obtain('sn-own', undefined, () => undefined).then((r) => ((returned = true), r));
    await vi.waitFor(() => expect(returned).toBe(true));
    expect((await got).local.dir).toBe(local.dir);
    await g.entered;
    expect(h.shipper.held()).toEqual([expect.objectContaining({ snapshotId: 'sn-own', complete: false })]);
    g.open();
    await vi.waitFor(() => expect(h.shipper.held()).toEqual([expect.objectContaining({ snapshotId: 'sn-own', complete: true })]));
    expect(await h.store.has(lost)).toBe(true);
  });

  it('obtain_ofItTwiceAtOnce_runsOneRepair', async () => {
    // Each restore ran its own, reading and storing the same chunks.
    const g = gate();
    const { counted, wrap } = putWaits(g);
    const { h, lost } = await lostAChunk('own-repair-single-flight', { chunks: wrap });
    let returned = 0;
    const both = Promise.all([0, 1].map(() => h.shipper.obtain('sn-own', undefined, () => undefined).then(() => returned++)));
    // Both restores returned (one repair, in the background), or both repairs got to the put.
    await vi.waitFor(() => expect(returned === 2 || counted.puts === 2).toBe(true));
    g.open();
    await both;
    await vi.waitFor(() => expect(h.shipper.held()).toEqual([expect.objectContaining({ snapshotId: 'sn-own', complete: true })]));
    expect(counted.puts).toBe(1);
    expect(await h.store.has(lost)).toBe(true);
  });

  it('ingest_runAgainAfterItsOwnFilesDidNotGiveAChunkBack_readsThemForItNoMore_andReplicateFetchesIt', async () => {
    // Every restore read and hashed again chunks those files can never give back (a flattened
    // disk layer's).
    const { h, local, ingested, lost, work } = await lostAChunk('own-repair-remembers');
    const memory = readFileSync(join(local.dir, 'memory'));
    writeFileSync(join(local.dir, 'memory'), Buffer.alloc(2 * CS, 0x5a));
    await h.shipper.ingest(local);
    expect(await h.store.has(lost)).toBe(false);
    // A sealed snapshot's files do not change: put back only to see whether they are read again.
    writeFileSync(join(local.dir, 'memory'), memory);
    await h.shipper.ingest(local);
    expect(await h.store.has(lost)).toBe(false);
    expect(h.shipper.held()).toEqual([expect.objectContaining({ snapshotId: 'sn-own', complete: false })]);
    await withPeerHoldingOwn('own-repair-remembers-peer', ingested, (address) => expectReplicaFetchedAndHeldComplete(h, work(address)));
  });
});
