// ChunkStoreShipper over real chunk stores, a real chunk server on loopback and real
// qemu-img; the VMM driver is a fake of our own port (only openSnapshot is used here).
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { cpSync, existsSync, mkdirSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { execFileSync } from 'node:child_process';
import { join } from 'node:path';
import { create, fromBinary } from '@bufbuild/protobuf';
import { pino } from 'pino';
import { ChunkStoreShipper } from './shipper.ts';
import { FsChunkStore, FsManifestStore, overwriteChunkFile } from './chunkstore/fs-store.ts';
import { ingestSnapshot } from './chunkstore/ingest.ts';
import { Materialiser } from './chunkstore/materialise.ts';
import { chunkTransferService } from './peer/server.ts';
import { LiveRoots, systemClock } from '../domain/snapshot-store.ts';
import { generateSigningKey, signManifest, signTicket, type SigningKey, type TrustedKeys } from '../domain/tickets.ts';
import type { LocalSnapshot, SnapshotManifest as VmmSnapshotManifest, VmmDriver } from '../domain/vmm.ts';
import { ArtifactKind, SnapshotManifestSchema } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import type { SignedManifest } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { FetchSnapshotWorkSchema } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { startGrpcServer, type RunningGrpcServer } from '../../services/adapters/grpc/server.ts';
import { tempDir } from '../../services/testkit/proc.ts';
import { randomBytesSeeded, textBytes } from '../bench/transfer-image.ts';

const CS = 256 * 1024;
const log = pino({ level: 'silent' });
let dir: string;
let key: SigningKey;
let trust: TrustedKeys;
let server: RunningGrpcServer;
let signed: SignedManifest;
let memPath: string;
/** s1's chunk digests, in memory order. */
let s1Digests: string[];
const served: string[] = [];

/** Reads the VMM manifest the snapshot's metadata carries: all obtain() needs of a driver. */
const driver = {
  openSnapshot: async (d: string): Promise<LocalSnapshot> => ({ dir: d, manifest: JSON.parse(readFileSync(join(d, 'manifest.json'), 'utf8')) as VmmSnapshotManifest }),
  snapshotsInUse: async () => new Set<string>(),
} as unknown as VmmDriver;

/** A host that stored s1 (its chunks and signed manifest), restarted: the shipper loads what it holds. `keepStore`: its store as an earlier receiver(name) left it. */
async function receiver(name: string, opts: { keepStore?: boolean; driver?: VmmDriver; gcGraceMs?: number; readDelayMs?: number; onRead?: () => void } = {}) {
  const root = join(dir, name);
  if (!opts.keepStore) cpSync(join(dir, 'A', 'chunks'), join(root, 'chunks'), { recursive: true });
  const chunks = new FsChunkStore(root);
  const manifests = new FsManifestStore(root);
  await manifests.put('s1', signed);
  const roots = new LiveRoots();
  // `readDelayMs`: the image build reads each stored chunk that much later (a slow disk).
  const delay = opts.readDelayMs;
  const readSlowly = delay
    ? new Proxy(chunks, {
        get: (target, k) => {
          const v = Reflect.get(target, k) as unknown;
          if (k !== 'readVerified') return typeof v === 'function' ? (v as (...a: unknown[]) => unknown).bind(target) : v;
          return async (d: string) => {
            opts.onRead?.();
            await new Promise((r) => setTimeout(r, delay));
            return target.readVerified(d);
          };
        },
      })
    : chunks;
  const materialiser = new Materialiser({ root, chunks: readSlowly, manifests, roots, trust });
  const driverSnapshotsDir = join(root, 'vmm');
  mkdirSync(driverSnapshotsDir, { recursive: true });
  const shipper = new ChunkStoreShipper({ hostId: 'hostR', driver: opts.driver ?? driver, driverSnapshotsDir, chunks, manifests, materialiser, roots, trust, scratchDir: join(root, 'scratch'), log, chunkSize: CS, ...(opts.gcGraceMs !== undefined ? { gcGraceMs: opts.gcGraceMs } : {}) });
  await shipper.load();
  return { chunks, manifests, shipper, root };
}

function work(sources: Array<{ hostId: string; address: string }>) {
  const ticket = signTicket({ snapshotId: 's1', destinationHostId: 'hostR', expiresAt: new Date(Date.now() + 60_000) }, key);
  return create(FetchSnapshotWorkSchema, { snapshotId: 's1', sources, ticket, manifest: signed });
}

beforeAll(async () => {
  dir = tempDir('ff-shipper-');
  const gen = generateSigningKey('k1');
  key = gen.signing;
  trust = gen.trusted;
  // Host A holds s1: four chunks of memory, and the VMM's small files in the manifest.
  memPath = join(dir, 'mem.img');
  writeFileSync(memPath, Buffer.concat([textBytes(CS, 1), randomBytesSeeded(CS, 2), textBytes(CS, 3), randomBytesSeeded(CS, 4)]));
  const chunks = new FsChunkStore(join(dir, 'A'));
  const manifests = new FsManifestStore(join(dir, 'A'));
  const r = await ingestSnapshot({ snapshotId: 's1', tenantId: 't', sourceSandboxId: 'sb', artifacts: [{ kind: ArtifactKind.MEMORY, name: 'memory', path: memPath }] }, { chunks, roots: new LiveRoots(), clock: systemClock, chunkSize: CS });
  r.manifest.metadata = { 'manifest.json': Buffer.from(JSON.stringify({ snapshotId: 's1' })), 'image.json': Buffer.from('{}') };
  signed = signManifest(r.manifest, key);
  s1Digests = r.manifest.artifacts[0]!.chunks.map((c) => Buffer.from(c.digest).toString('hex'));
  await manifests.put('s1', signed);
  r.unpin();
  const svc = chunkTransferService({ chunks, manifests, trust, clock: systemClock, onServed: (d) => served.push(d) });
  server = await startGrpcServer({ address: '127.0.0.1:0', services: [svc.registration] });
});

afterAll(async () => {
  await server?.close(100);
  if (dir) rmSync(dir, { recursive: true, force: true });
});

describe('ChunkStoreShipper.obtain', () => {
  it('obtain_whenAStoredChunkIsCorruptAndSourcesAreNamed_fetchesOnlyThatChunkAgainAndMaterialises', async () => {
    const { chunks, shipper } = await receiver('R-corrupt');
    const victim = s1Digests[1]!;
    const raw = readFileSync(chunks.pathOf(victim));
    raw[100] = (raw[100] ?? 0) ^ 1;
    await overwriteChunkFile(chunks, victim, raw);
    served.length = 0;

    const { local, bytesFetched } = await shipper.obtain('s1', work([{ hostId: 'hostA', address: server.address }]), () => undefined);
    await shipper.durable('s1');
    expect(served).toEqual([victim]);
    expect(bytesFetched).toBeGreaterThan(0);
    expect(readFileSync(join(local.dir, 'memory')).equals(readFileSync(memPath))).toBe(true);
    expect((await chunks.readVerified(victim)).length).toBe(CS);
    expect(shipper.held().map((h) => h.snapshotId)).toEqual(['s1']);
  });

  it('obtain_whenAStoredChunkIsMissingAndNoSourceIsNamed_reportsTheSnapshotHeldButIncompleteAndSaysWhy', async () => {
    const { chunks, shipper } = await receiver('R-missing');
    rmSync(chunks.pathOf(s1Digests[2]!));
    expect(shipper.held().map((h) => h.snapshotId)).toEqual(['s1']);

    await expect(shipper.obtain('s1', work([]), () => undefined)).rejects.toThrow(/s1 is incomplete on host hostR .*no source/);
    // Not a holder (the scheduler stops naming this host), but still reported, so that the
    // scheduler has it deleted here once its record is deleted or gone.
    expect(shipper.held().map((h) => [h.snapshotId, h.complete])).toEqual([['s1', false]]);
    expect(await shipper.holds('s1')).toBe(false);
    await expect(shipper.obtain('s1', undefined, () => undefined)).rejects.toThrow(/no source/);
    await shipper.remove('s1');
    expect(shipper.held()).toEqual([]);
  });

  it('obtain_fromTheStoredManifest_whileTheSnapshotIsRemovedAndCollected_buildsItsImageFromChunksTheGcLeft', async () => {
    // Chunk reads take 300 ms; the snapshot is removed (and its chunks collected, no grace)
    // while the image is being built from them.
    let removing: Promise<void> | undefined;
    const r = await receiver('R-removed', { gcGraceMs: 0, readDelayMs: 300, onRead: () => void (removing ??= r.shipper.remove('s1')) });
    const { chunks, shipper } = r;
    // The delete starts as the build reads its first chunk.
    const { local } = await shipper.obtain('s1', undefined, () => undefined);
    await removing;
    expect(readFileSync(join(local.dir, 'memory')).equals(readFileSync(memPath))).toBe(true);
    // Not reported held again by the restore that outlived its delete.
    expect(shipper.held()).toEqual([]);
    // Collected once the build no longer needs them.
    await shipper.collectGarbage();
    expect(await chunks.missing(s1Digests)).toEqual(s1Digests);
  });

  it('load_afterARestart_reportsASnapshotWhoseStoredChunkIsMissing_asHeldButIncomplete', async () => {
    const { chunks, shipper } = await receiver('R-restart');
    expect(shipper.held().map((h) => h.snapshotId)).toEqual(['s1']);
    rmSync(chunks.pathOf(s1Digests[3]!));
    // The agent restarts: the manifest is still stored, one of its chunks is not.
    const { shipper: restarted } = await receiver('R-restart', { keepStore: true });
    expect(restarted.held().map((h) => [h.snapshotId, h.complete])).toEqual([['s1', false]]);
    expect(await restarted.holds('s1')).toBe(false);
  });

  it('obtain_fromACachedImage_whileAStoredChunkIsMissing_restoresButDoesNotReportTheSnapshotComplete', async () => {
    const { chunks, shipper } = await receiver('R-cached');
    // Materialised (the image is cached), then a chunk goes (quarantined for another snapshot
    // that shares it, or lost): a restore from the cached image reads no chunk.
    await shipper.obtain('s1', undefined, () => undefined);
    rmSync(chunks.pathOf(s1Digests[0]!));
    const { shipper: restarted } = await receiver('R-cached', { keepStore: true });
    expect(restarted.held().map((h) => [h.snapshotId, h.complete])).toEqual([['s1', false]]);
    const { local } = await restarted.obtain('s1', undefined, () => undefined);
    expect(readFileSync(join(local.dir, 'memory')).equals(readFileSync(memPath))).toBe(true);
    // Peers would be sent here for that chunk: not a holder until it is back.
    expect(restarted.held().map((h) => [h.snapshotId, h.complete])).toEqual([['s1', false]]);
    expect(await restarted.holds('s1')).toBe(false);
  });

  it('gc_keepsAnImageWithoutManifestThatAVmUsesNow_evenWhenTheDriversInUseListIsOlder', async () => {
    // The driver's in-use list is taken before the GC's scan, and says nothing uses s1; a VM
    // restored from its image since (its lease released once it ran) uses it by then.
    let vmUses = true;
    const racing = { ...driver, snapshotsInUse: async () => new Set<string>(), vmsUse: (id: string) => vmUses && id === 's1' } as unknown as VmmDriver;
    const { manifests, shipper, root } = await receiver('R-gc', { driver: racing });
    await shipper.obtain('s1', undefined, () => undefined);
    // No manifest (a fetch whose background save failed): only the VM keeps the image.
    await manifests.delete('s1');
    await shipper.collectGarbage();
    expect(existsSync(join(root, 'images', 's1'))).toBe(true);
    vmUses = false;
    await shipper.collectGarbage();
    expect(existsSync(join(root, 'images', 's1'))).toBe(false);
  });
});

describe('ChunkStoreShipper.collectGarbage', () => {
  it('gc_listsASealedSnapshotNoStepReported_asHeldIncomplete_soTheSchedulerHasItDeleted', async () => {
    const { shipper, root } = await receiver('R-sealed-unreported');
    // A snapshot the driver sealed after the agent started, whose step then failed: never ingested.
    const dir = join(root, 'vmm', 'orphan');
    mkdirSync(dir, { recursive: true });
    writeFileSync(join(dir, 'manifest.json'), JSON.stringify({ snapshotId: 'orphan' }));
    // One still being written (no manifest yet) is not.
    mkdirSync(join(root, 'vmm', 'half'), { recursive: true });
    expect(shipper.held().map((h) => h.snapshotId)).toEqual(['s1']);
    await shipper.collectGarbage();
    expect(shipper.held().map((h) => [h.snapshotId, h.complete])).toEqual([['s1', true], ['orphan', false]]);
  });
});

describe('ChunkStoreShipper.remove', () => {
  it('remove_whoseManifestDeleteFails_keepsReportingTheSnapshot_soTheSchedulerAsksAgain_andASecondRemoveDeletesIt', async () => {
    const { manifests, shipper } = await receiver('R-remove-fails');
    expect(shipper.held().map((h) => [h.snapshotId, h.complete])).toEqual([['s1', true]]);
    const realDelete = manifests.delete.bind(manifests);
    manifests.delete = async () => {
      throw Object.assign(new Error('ENOSPC: no space left on device'), { code: 'ENOSPC' });
    };
    await expect(shipper.remove('s1')).rejects.toThrow(/ENOSPC/);
    expect(shipper.held().map((h) => [h.snapshotId, h.complete])).toEqual([['s1', true]]);
    manifests.delete = realDelete;
    await shipper.remove('s1');
    expect(shipper.held()).toEqual([]);
    expect(await manifests.get('s1')).toBeUndefined();
  });
});

/** A VMM snapshot manifest of a 256 MiB guest whose files are `memory`, `state` and `disk.qcow2` in its directory. */
function vmmManifest(snapshotId: string, image: VmmSnapshotManifest['image']): VmmSnapshotManifest {
  return {
    schema: 1,
    snapshotId,
    parentSnapshotId: null,
    sourceVmId: 'vm-1',
    createdAt: new Date().toISOString(),
    config: { machineType: 'microvm', memoryMib: 256, vcpus: 1, devices: [], qemuVersion: '8', accel: 'tcg', cpuModel: 'max' },
    image,
    files: { memory: 'memory', deviceState: 'state', disk: 'disk.qcow2' },
    diskVirtualSize: 4 << 20,
    method: 'shared-file',
    sourcePauseMs: 0,
  };
}

describe('ChunkStoreShipper.ingest', () => {
  it('ingest_recordsTheImagesRecipeAndItsBaseDisksDigest_inTheManifestsVmConfig_forPlacementToMatchHostsBuilds_andCountsItsChunksInTheStoredBytesAtOnce', async () => {
    const root = join(dir, 'D');
    const snap = join(root, 'vmm', 'd1');
    mkdirSync(snap, { recursive: true });
    const base = join(root, 'base.qcow2');
    execFileSync('qemu-img', ['create', '-q', '-f', 'qcow2', base, '4M']);
    execFileSync('qemu-img', ['create', '-q', '-f', 'qcow2', '-b', base, '-F', 'qcow2', join(snap, 'disk.qcow2')]);
    writeFileSync(join(snap, 'image.json'), JSON.stringify({ disk: base }));
    writeFileSync(join(snap, 'manifest.json'), '{}');
    writeFileSync(join(snap, 'memory'), randomBytesSeeded(2 * CS, 31));
    writeFileSync(join(snap, 'state'), textBytes(CS, 32));
    const diskSha256 = 'ab'.repeat(32);
    const manifest = vmmManifest('d1', { name: 'tiny', recipeHash: 'e250dbfa', kernelArgs: '', diskSha256 });
    const chunks = new FsChunkStore(root);
    const manifests = new FsManifestStore(root);
    const roots = new LiveRoots();
    const shipper = new ChunkStoreShipper({ hostId: 'hostD', driver, driverSnapshotsDir: join(root, 'vmm'), chunks, manifests, materialiser: new Materialiser({ root, chunks, manifests, roots, trust }), roots, trust, scratchDir: join(root, 'scratch'), log, chunkSize: CS });
    expect(shipper.storedBytes()).toBe(0);
    const signed = await shipper.ingest({ dir: snap, manifest });
    const vc = fromBinary(SnapshotManifestSchema, signed.manifest).vmConfig;
    expect([vc?.image, vc?.imageDigest, vc?.imageDiskSha256]).toEqual(['tiny', 'e250dbfa', diskSha256]);
    // Counted at once (heartbeats report it; placement takes it as disk in use), not only
    // after the next GC, minutes later: 2 chunks of random memory store at least their size.
    expect(shipper.storedBytes()).toBeGreaterThanOrEqual(2 * CS);
  });

  it('ingest_whenTheIngestFailsAfterFlatteningTheDisk_removesTheFlattenedDiskFromScratch_andReportsTheSnapshotHeldIncomplete', async () => {
    const root = join(dir, 'I');
    const snap = join(root, 'vmm', 'x1');
    mkdirSync(snap, { recursive: true });
    // A clone's layer: backed by its parent's layer, which the image's base disk backs.
    const base = join(root, 'base.qcow2');
    const parent = join(root, 'parent.qcow2');
    execFileSync('qemu-img', ['create', '-q', '-f', 'qcow2', base, '4M']);
    execFileSync('qemu-img', ['create', '-q', '-f', 'qcow2', '-b', base, '-F', 'qcow2', parent]);
    execFileSync('qemu-img', ['create', '-q', '-f', 'qcow2', '-b', parent, '-F', 'qcow2', join(snap, 'disk.qcow2')]);
    writeFileSync(join(snap, 'image.json'), JSON.stringify({ disk: base }));
    writeFileSync(join(snap, 'manifest.json'), '{}');
    // No memory file in its directory: the ingest fails after the disk was flattened.
    const manifest = vmmManifest('x1', { name: 'tiny', recipeHash: 'h', kernelArgs: '' });
    const chunks = new FsChunkStore(root);
    const manifests = new FsManifestStore(root);
    const roots = new LiveRoots();
    const scratchDir = join(root, 'scratch');
    const shipperOf = () =>
      new ChunkStoreShipper({
        hostId: 'hostI',
        driver,
        driverSnapshotsDir: join(root, 'vmm'),
        chunks,
        manifests,
        materialiser: new Materialiser({ root, chunks, manifests, roots, trust }),
        roots,
        trust,
        scratchDir,
        log,
        chunkSize: CS,
      });
    const shipper = shipperOf();
    await expect(shipper.ingest({ dir: snap, manifest })).rejects.toThrow(/ENOENT/);
    expect(existsSync(scratchDir)).toBe(true); // it was flattened there
    expect(readdirSync(scratchDir)).toEqual([]);
    // The VMM's directory stays (a running VM's disk may be backed by it): reported held but
    // not complete, so the scheduler can have it deleted once its record failed. Also after a
    // restart of the agent.
    const heldOf = (sh: ChunkStoreShipper) => sh.held().map((h) => [h.snapshotId, h.complete]);
    expect(heldOf(shipper)).toEqual([['x1', false]]);
    const restarted = shipperOf();
    await restarted.load();
    expect(heldOf(restarted)).toEqual([['x1', false]]);
    // Deleted: marked for the GC (which removes the directory once nothing uses it), no longer held.
    await restarted.remove('x1');
    expect(existsSync(join(snap, '.deleted'))).toBe(true);
    expect(heldOf(restarted)).toEqual([]);
    const again = shipperOf();
    await again.load();
    expect(heldOf(again)).toEqual([]);
  });
});
