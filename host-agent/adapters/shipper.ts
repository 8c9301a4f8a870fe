// SnapshotShipper: joins the VMM's snapshot directories to the content-addressed chunk
// store. A snapshot taken here is cut into chunks (ingest); a snapshot that lives only on
// other hosts is fetched from peers, verified against the scheduler's signature and
// materialised into a directory the VMM driver opens like one of its own.
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { access, mkdir, open, readdir, readFile, rename, rm, writeFile } from 'node:fs/promises';
import { join } from 'node:path';
import { create, toBinary, fromBinary } from '@bufbuild/protobuf';
import type { Logger } from 'pino';
import { migrationSources, type IncomingSnapshot, type SnapshotShipper } from '../domain/agent.ts';
import type { GuestImage, LocalSnapshot, MigrationStream, SnapshotManifest as VmmSnapshotManifest, VmmDriver } from '../domain/vmm.ts';
import type { ChunkStore, ManifestStore } from '../domain/snapshot-store.ts';
import { chunkSizes, manifestDigests } from '../domain/snapshot-store.ts';
import type { LiveRoots } from '../domain/snapshot-store.ts';
import { verifyManifest, type TrustedKeys } from '../domain/tickets.ts';
import { fetchChunks, fetchSnapshot, verifiedManifestFrom, type FetchSnapshotOptions, type ManifestSource } from '../domain/transfer.ts';
import { ChunkCorruptError, ChunkMissingError, ManifestInvalidError, ManifestNotFoundError } from '../domain/transfer-errors.ts';
import { collectGarbage } from '../domain/snapshot-store-gc.ts';
import type { GcResult } from '../domain/snapshot-store-gc.ts';
import { ingestSnapshot } from './chunkstore/ingest.ts';
import { encodeChunk, sha256Hex } from './chunkstore/codec.ts';
import type { MaterialisedSnapshot, Materialiser } from './chunkstore/materialise.ts';
import { PeerChunkSource } from './peer/client.ts';
import { migrateFrom, type MigrationRelaySettings } from './peer/migrate.ts';
import type { PeerTls } from './peer/tls.ts';
import { ArtifactKind, SignedManifestSchema, SnapshotManifestSchema } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import type { Artifact, SignedManifest, SnapshotManifest } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { HeldSnapshotSchema } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import type { FetchSnapshotWork, HeldSnapshot } from '../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { Accel } from '../../proto/gen/forkfleet/v1/common_pb.ts';
import { ForkfleetError } from '../../proto/errors.ts';
import { writeFileDurable } from './durable.ts';
import { writeSparse } from './chunkstore/sparse.ts';
import { runTied } from './tied.ts';

const run = promisify(execFile);

/** The VMM's small files that travel in the manifest's metadata map. */
const META_FILES = ['manifest.json', 'image.json'] as const;

export interface ShipperDeps {
  hostId: string;
  driver: VmmDriver;
  /** The driver's snapshot directory root (<driver root>/snapshots). */
  driverSnapshotsDir: string;
  chunks: ChunkStore;
  manifests: ManifestStore;
  materialiser: Materialiser;
  roots: LiveRoots;
  trust: TrustedKeys;
  scratchDir: string;
  log: Logger;
  chunkSize: number;
  /** Unreferenced chunks younger than this survive a GC (default 60 s). */
  gcGraceMs?: number;
  /** Mutual TLS to the peers it fetches from (peer/tls.ts); absent: plain text. */
  peerTls?: PeerTls | undefined;
  /**
   * Migration streams arrive through TLS relays (peer/tls-relay.ts): socat's path, this host's
   * certificates in QEMU's layout, and where the relays' unix sockets go. Absent: QEMU reads
   * the connection itself (plain, or QEMU's own TLS).
   */
  migrationRelay?: MigrationRelaySettings | undefined;
}

/** Marks a VMM snapshot directory whose snapshot was deleted while something still used it. */
const DELETED_MARKER = '.deleted';

/**
 * One fetch of a snapshot (obtain, replicate), ingest of one, or repair of one taken here
 * (restoreOwnChunks), as remove() sees it.
 */
interface FetchAttempt {
  /** What it does to the snapshot, for the error that says a delete won. */
  doing: 'fetched' | 'ingested' | 'repaired';
  /** Set by remove(): the attempt must not store the manifest (or, stored already, it is deleted), nor hold the snapshot. */
  removed: boolean;
  /** The manifest put, once begun (settles, never rejects): remove() waits for it before it deletes. */
  storing?: Promise<void>;
}

/** The attempt's manifest was not stored (or not kept): the snapshot was deleted on this host meanwhile. */
function removedWhile(snapshotId: string, hostId: string, doing: FetchAttempt['doing']): ForkfleetError {
  return new ForkfleetError('failed_precondition', `snapshot ${snapshotId} was deleted on host ${hostId} while it was being ${doing}: not kept`, { retryable: false });
}

async function exists(p: string): Promise<boolean> {
  return access(p).then(
    () => true,
    () => false,
  );
}

export class ChunkStoreShipper implements SnapshotShipper {
  /** Snapshots whose every chunk is here (the heartbeat reports them). */
  private readonly complete = new Set<string>();
  /**
   * Snapshots the VMM wrote here whose ingest has not stored a manifest (one running, or one
   * that failed or was killed): reported as held but not complete, so the scheduler has a
   * snapshot whose record failed or is gone deleted here (reconcileHeldSnapshots) instead of
   * its VMM directory (the guest's whole memory) staying on disk for good.
   */
  private readonly sealedOnly = new Set<string>();
  /**
   * Snapshots whose manifest is stored here but some chunk is not (quarantined as corrupt,
   * lost to an OS crash): reported as held but not complete, so that once the snapshot's
   * record is deleted or gone the scheduler has them deleted here (reconcileHeldSnapshots);
   * unreported, their manifest, their other chunks and their image stayed for good.
   */
  private readonly storedIncomplete = new Set<string>();
  /** Fetches obtain() returned before they were durable, until they are, by snapshot (durable()). */
  private readonly durables = new Map<string, Promise<void>>();
  /** Why the last such fetch of a snapshot could not be made durable (until it is, or removed). */
  private readonly notDurable = new Map<string, unknown>();
  /**
   * Fetches of a snapshot from before fetchSnapshot began until their manifest is stored or
   * they failed, ingests from their start until they return, and repairs of a snapshot taken
   * here, by snapshot. remove() marks them: one removed meanwhile stores no manifest and holds
   * nothing (it would bring the snapshot back after a delete that was reported done).
   */
  private readonly attempts = new Map<string, Set<FetchAttempt>>();
  /** Snapshots a remove() is at work on (how many at once): an attempt begun meanwhile is marked removed. */
  private readonly removing = new Map<string, number>();
  /**
   * Repairs of a snapshot taken here (restoreOwnChunks) that a restore started, by snapshot:
   * one at a time, in the background. A restore needs only the directory; it used to wait for
   * the repair, and concurrent restores each ran one.
   */
  private readonly repairing = new Set<string>();
  /**
   * Per snapshot taken here, the chunks a repair found its own files do not give back (a
   * flattened disk layer's never match): later repairs do not read and hash them again (every
   * restore did). A fetch brings them (replicate). Forgotten when the snapshot is removed.
   */
  private readonly notInOwnFiles = new Map<string, Set<string>>();
  /** Deleted snapshots whose VMM directory a GC kept because a lease held it: a GC follows the last release. */
  private readonly keptForLease = new Set<string>();
  private gcRun: Promise<unknown> = Promise.resolve();
  /** The GC pass queued behind gcRun and not started yet (collectGarbage's callers share it). */
  private gcPending: Promise<GcResult> | undefined;
  private lastGc: GcResult | undefined;
  /** Chunk bytes stored since the last GC counted them (ingests' new chunks, fetches' bytes): storedBytes(). */
  private storedSinceGc = 0;
  /** The disk the materialised images took when the last GC counted them (Materialiser.diskBytes): imageBytes(). */
  private imageBytesAtGc = 0;

  constructor(private readonly deps: ShipperDeps) {}

  /** Fills the held set from what is on disk (after an agent restart). */
  async load(): Promise<void> {
    // Checked, not assumed: a snapshot found incomplete here before a restart (a chunk
    // quarantined, or lost to an OS crash) is not a holder again until it is fetched again.
    const digestsOf = new Map<string, Set<string>>();
    for (const id of await this.deps.manifests.list()) {
      try {
        const stored = await this.deps.manifests.get(id);
        if (stored) digestsOf.set(id, manifestDigests(fromBinary(SnapshotManifestSchema, stored.manifest)));
      } catch (e) {
        this.deps.log.warn({ snapshotId: id, err: (e as Error).message }, 'stored manifest does not read: not reported as held');
      }
    }
    const gone = new Set(await this.deps.chunks.missing([...digestsOf.values()].flatMap((ds) => [...ds])));
    for (const [id, ds] of digestsOf) {
      const lacking = gone.size === 0 ? 0 : [...ds].filter((d) => gone.has(d)).length;
      if (lacking === 0) this.markComplete(id);
      else this.storedIncomplete.add(id);
      if (lacking > 0) this.deps.log.warn({ snapshotId: id, chunks: lacking }, 'stored snapshot lacks chunks: reported held but not complete until they are fetched again');
    }
    for (const id of await readdir(this.deps.driverSnapshotsDir).catch(() => [] as string[])) {
      const dir = join(this.deps.driverSnapshotsDir, id);
      // Sealed (the VMM's manifest.json is written last), not deleted, and never ingested.
      if (!this.complete.has(id) && (await exists(join(dir, 'manifest.json'))) && !(await exists(join(dir, DELETED_MARKER)))) this.sealedOnly.add(id);
    }
  }

  held(): HeldSnapshot[] {
    const out = [...this.complete].map((snapshotId) => create(HeldSnapshotSchema, { snapshotId, complete: true }));
    for (const snapshotId of new Set([...this.sealedOnly, ...this.storedIncomplete])) if (!this.complete.has(snapshotId)) out.push(create(HeldSnapshotSchema, { snapshotId, complete: false }));
    return out;
  }

  /**
   * Every other snapshot held complete whose manifest names one of `digests` (chunks found
   * corrupt or missing for the snapshot `but`, and not fetched back) is held complete no more:
   * snapshots share chunks, and one that stayed "complete" kept peers sent here for chunks it
   * lacked, its only holder reported holding it. It becomes complete again as the first one
   * does (a restore here that finds every chunk, a fetch; an agent restart checks them all).
   * Manifests are read only on such a finding.
   */
  private async incompleteWith(digests: readonly string[], but: string): Promise<void> {
    const lost = new Set(digests);
    for (const id of [...this.complete]) {
      if (id === but) continue;
      const stored = await this.deps.manifests.get(id).catch(() => undefined);
      if (!stored) continue;
      let named: number;
      try {
        named = [...manifestDigests(fromBinary(SnapshotManifestSchema, stored.manifest))].filter((d) => lost.has(d)).length;
      } catch {
        continue; // a manifest that does not decode: the GC removes it
      }
      if (named === 0 || !this.complete.delete(id)) continue;
      this.storedIncomplete.add(id);
      this.deps.log.warn({ snapshotId: id, chunks: named, foundBy: but }, 'stored snapshot shares chunks found corrupt or missing: reported held but not complete until they are fetched again');
    }
  }

  private markComplete(snapshotId: string): void {
    this.complete.add(snapshotId);
    this.storedIncomplete.delete(snapshotId);
  }

  /**
   * Disk layers of a clone's snapshot are backed by its parent snapshot's layer, whose path
   * is host-local. A portable snapshot carries one layer backed only by the image's base
   * disk (same path on every host: the image cache is keyed by recipe hash).
   */
  private async portableDisk(local: LocalSnapshot, imageDisk: string): Promise<string> {
    const disk = join(local.dir, local.manifest.files.disk);
    const { stdout } = await run('qemu-img', ['info', '--output=json', '-U', disk]);
    const info = JSON.parse(stdout) as { 'full-backing-filename'?: string; 'backing-filename'?: string };
    const backing = info['full-backing-filename'] ?? info['backing-filename'];
    if (!backing || backing === imageDisk) return disk;
    await mkdir(this.deps.scratchDir, { recursive: true });
    const flat = join(this.deps.scratchDir, `${local.manifest.snapshotId}.disk.qcow2`);
    try {
      // Tied to the agent: a killed agent's convert would go on writing a whole disk into a
      // file the next agent removes at start (main.ts clears the scratch directory).
      await runTied('qemu-img', ['convert', '-U', '-O', 'qcow2', '-B', imageDisk, '-F', 'qcow2', disk, flat]);
    } catch (e) {
      await rm(flat, { force: true });
      throw e;
    }
    return flat;
  }

  /**
   * Cuts a snapshot taken here into the chunk store and stores its (unsigned) manifest. Run
   * again (the snapshot step redelivered), it returns the stored manifest, first storing
   * again from the snapshot's files any chunk it lacks (restoreOwnChunks); that repair
   * failing (a full disk, EIO) fails no ingest: the stored manifest is returned all the same,
   * the snapshot held incomplete. A delete of the snapshot meanwhile (its step timed out, its
   * op failed) wins: no manifest is kept and the ingest fails, rather than the host holding a
   * deleted snapshot complete.
   */
  async ingest(local: LocalSnapshot): Promise<SignedManifest> {
    const m = local.manifest;
    const { attempt, forget } = this.track(m.snapshotId, 'ingested');
    try {
      return await this.ingestTracked(local, attempt);
    } finally {
      forget();
    }
  }

  private async ingestTracked(local: LocalSnapshot, attempt: FetchAttempt): Promise<SignedManifest> {
    const m = local.manifest;
    const existing = await this.deps.manifests.get(m.snapshotId);
    this.throwIfRemoved(m.snapshotId, attempt);
    // Deleted here already (its marker is written before the manifest goes, and stays until a
    // GC removes the directory): a snapshot step run again then would cut it anew and hold it.
    if (!existing && (await exists(join(local.dir, DELETED_MARKER)))) throw removedWhile(m.snapshotId, this.deps.hostId, attempt.doing);
    if (existing) {
      // Kept as stored: the scheduler signed these bytes. A chunk lost since (removed by a
      // failed start-up fsync, quarantined) is stored again from the snapshot's own files.
      // Its failure is logged, not thrown: a failed snapshot step could have the scheduler
      // delete a snapshot that restores (from its directory) all the same.
      if (!this.complete.has(m.snapshotId)) {
        await this.restoreOwnChunks(local).catch((e: unknown) => {
          if (!attempt.removed) this.deps.log.warn({ snapshotId: m.snapshotId, err: (e as Error).message }, 'could not store again the chunks a snapshot taken here lacks');
        });
      }
      // Also when the repair left chunks missing (it returns, rather than fails, then).
      this.throwIfRemoved(m.snapshotId, attempt);
      return existing;
    }
    this.sealedOnly.add(m.snapshotId);
    const image = JSON.parse(await readFile(join(local.dir, 'image.json'), 'utf8')) as { disk: string };
    const metadata: Record<string, Uint8Array> = {};
    for (const f of META_FILES) metadata[f] = await readFile(join(local.dir, f));
    const disk = await this.portableDisk(local, image.disk);
    const { manifest, stats, unpin } = await ingestSnapshot(
      {
        snapshotId: m.snapshotId,
        tenantId: '',
        ...(m.parentSnapshotId ? { parentSnapshotId: m.parentSnapshotId } : {}),
        sourceSandboxId: m.sourceVmId,
        vmConfig: {
          $typeName: 'forkfleet.v1.VmConfig',
          machine: m.config.machineType,
          memoryMib: BigInt(m.config.memoryMib),
          vcpus: m.config.vcpus,
          devices: m.config.devices,
          qemuVersion: m.config.qemuVersion,
          accel: m.config.accel === 'kvm' ? Accel.KVM : Accel.TCG,
          cpuModel: m.config.cpuModel,
          image: m.image.name,
          imageDigest: m.image.recipeHash,
          imageDiskSha256: m.image.diskSha256 ?? '',
        },
        artifacts: [
          { kind: ArtifactKind.MEMORY, name: m.files.memory, path: join(local.dir, m.files.memory) },
          { kind: ArtifactKind.DEVICE_STATE, name: m.files.deviceState, path: join(local.dir, m.files.deviceState) },
          { kind: ArtifactKind.DISK_LAYER, name: m.files.disk, path: disk, backing: image.disk },
        ],
      },
      { chunks: this.deps.chunks, roots: this.deps.roots, clock: { now: () => new Date() }, chunkSize: this.deps.chunkSize, log: this.deps.log },
    ).finally(async () => {
      // In the chunk store now, or the ingest failed (a retry flattens again). A copy left
      // behind only costs disk: it must not fail an ingest whose chunks are pinned.
      if (disk === join(local.dir, m.files.disk)) return;
      await rm(disk, { force: true }).catch((e: unknown) => this.deps.log.warn({ path: disk, err: (e as Error).message }, 'could not remove the flattened disk'));
    });
    // Unsigned here: the scheduler signs the exact bytes; restores verify its signature.
    manifest.metadata = metadata;
    const signed = create(SignedManifestSchema, { manifest: toBinary(SnapshotManifestSchema, manifest) });
    try {
      // Refused once remove() marked the ingest; a put under way, remove() waits for and undoes.
      await this.manifestsFor(attempt).put(m.snapshotId, signed);
    } finally {
      unpin(); // the manifest keeps the chunks from here (or nothing does: a failed put)
    }
    this.throwIfRemoved(m.snapshotId, attempt);
    this.markComplete(m.snapshotId);
    this.sealedOnly.delete(m.snapshotId);
    this.deps.log.info({ snapshotId: m.snapshotId, ...stats }, 'snapshot ingested');
    this.storedSinceGc += stats.newStoredBytes;
    return signed;
  }

  async durable(snapshotId: string): Promise<void> {
    await this.durables.get(snapshotId)?.catch(() => undefined);
    const failed = this.notDurable.get(snapshotId);
    // Stored since by another path (an ingest, a later fetch): held all the same.
    if (failed !== undefined && !(await this.deps.manifests.get(snapshotId))) throw failed;
  }

  lease(snapshotId: string, holder: string): { release(): void } {
    const lease = this.deps.roots.lease(snapshotId, holder);
    return {
      release: () => {
        lease.release();
        // Deleted while leased, its VMM directory kept for the lease: removed now if nothing
        // else uses it (VMs forked from it do: then a later GC, once they are gone).
        if (this.deps.roots.holders(snapshotId).length > 0 || !this.keptForLease.delete(snapshotId)) return;
        void this.collectGarbage().catch((e: unknown) => this.deps.log.warn({ snapshotId, err: (e as Error).message }, 'gc after a deleted snapshot\'s lease was released failed'));
      },
    };
  }

  async obtain(snapshotId: string, fetch: FetchSnapshotWork | undefined, onProgress: (done: number, total: number) => void): Promise<{ local: LocalSnapshot; bytesFetched: number }> {
    const own = join(this.deps.driverSnapshotsDir, snapshotId);
    // Not one deleted here (marked, kept only while something uses it): a GC may be removing
    // it now. The caller's lease, taken before this check, keeps one marked after it.
    if (await this.ownSealed(own)) {
      const local = await this.deps.driver.openSnapshot(own);
      // Its directory is whole, but held complete only with every chunk here (peers are sent
      // here for them): one lost since is stored again from its files, in the background (the
      // restore needs only the directory). Fails no restore.
      if (!this.complete.has(snapshotId)) this.repairInBackground(local);
      return { local, bytesFetched: 0 };
    }

    let bytesFetched = 0;
    let mat: MaterialisedSnapshot | undefined;
    let fetchedManifest: SignedManifest | undefined;
    const stored = await this.deps.manifests.get(snapshotId);
    let removedMeanwhile = false;
    /** Chunks the stored copy was found to lack: other snapshots naming them lack them too, unless the fetch below brings them back. */
    let lacking: readonly string[] | undefined;
    if (stored && stored.signature.length > 0) {
      // Its chunks pinned while the image is built from them: a delete of the snapshot meanwhile
      // (remove, and the GC after it) must not take chunks this build still reads.
      let unpin: (() => void) | undefined;
      try {
        unpin = this.deps.roots.pin(manifestDigests(verifyManifest(stored, this.deps.trust, snapshotId)));
        mat = await this.deps.materialiser.materialise(snapshotId);
      } catch (e) {
        if (e instanceof ManifestNotFoundError) {
          // Deleted here since it was read (remove): fetched from the sources named, if any, for
          // this restore, but not stored again (not held here), as a fetch that remove() marks.
          this.deps.log.info({ snapshotId }, 'stored manifest removed before its image was built: fetching the snapshot for this restore');
          removedMeanwhile = true;
        } else {
          if (!(e instanceof ChunkCorruptError || e instanceof ChunkMissingError)) throw e;
          // Stored, but a chunk is gone (quarantined, or lost to an OS crash): not a holder
          // until every chunk is here again, so the scheduler stops naming this host.
          this.complete.delete(snapshotId);
          this.storedIncomplete.add(snapshotId);
          lacking = e.digests;
          if (!fetch || fetch.sources.length === 0) {
            await this.incompleteWith(lacking, snapshotId);
            throw new ForkfleetError('not_found', `snapshot ${snapshotId} is incomplete on host ${this.deps.hostId} (${e.digests.length} chunk(s) corrupt or missing) and no source was named`, { cause: e });
          }
          // The fetch below asks the sources only for what the store lacks (ADR 0007).
          this.deps.log.warn({ snapshotId, chunks: e.digests.length, err: e.message }, 'stored snapshot lacks chunks: fetching them again');
        }
      } finally {
        unpin?.();
      }
    }
    if (!mat) {
      const got = await this.fetchFrom(snapshotId, fetch, stored, true, removedMeanwhile).catch(async (e: unknown) => {
        if (lacking) await this.incompleteWith(lacking, snapshotId);
        throw e;
      });
      mat = got.mat;
      bytesFetched = got.bytesFetched;
      onProgress(bytesFetched, bytesFetched);
      fetchedManifest = got.signed;
    }
    mat ??= await this.deps.materialiser.materialise(snapshotId);
    // The manifest the image was built from (removed meanwhile, the image still stands).
    const signed = fetchedManifest ?? stored ?? (await this.deps.manifests.get(snapshotId));
    if (!signed) throw new ForkfleetError('internal', `manifest of ${snapshotId} vanished`);
    const manifest = fromBinary(SnapshotManifestSchema, signed.manifest);
    for (const f of META_FILES) {
      const target = join(mat.dir, f);
      if (await exists(target)) continue;
      const data = manifest.metadata[f];
      if (!data) throw new ForkfleetError('internal', `manifest of ${snapshotId} lacks ${f}`);
      const tmp = `${target}.tmp`;
      await writeFile(tmp, data, { mode: 0o444 });
      await rename(tmp, target);
    }
    // Held complete only with every chunk here: a cached image is materialised without reading
    // one (a chunk lost since, or quarantined for another snapshot that shares it, would go
    // unnoticed), and peers are sent here for chunks. Checked only when it would change what is
    // reported, not on every restore of a snapshot held complete already.
    // Not one removed while its image was built: its chunks were pinned, not held.
    if (
      !fetchedManifest &&
      !this.complete.has(snapshotId) &&
      (await this.deps.chunks.missing([...manifestDigests(manifest)])).length === 0 &&
      (await this.deps.manifests.get(snapshotId)) !== undefined
    ) {
      this.markComplete(snapshotId);
    }
    return { local: await this.deps.driver.openSnapshot(mat.dir), bytesFetched };
  }

  /**
   * A replica or a drain (the fetchSnapshot step): what the store lacks of the snapshot is
   * fetched and verified, and its manifest stored, but no image is built. No VM restores from
   * it here now, and an image (the whole memory uncompressed, and the disk layer) would stay
   * until the snapshot is deleted (Materialiser.prune keeps an image whose manifest is
   * stored), its disk uncounted. A restore here builds it then (obtain). Run again, it finds
   * what is stored and fetches only what is missing. The manifest is stored in the
   * background, as for obtain: `durable()` waits for it.
   *
   * A snapshot taken here needs nothing fetched while it is complete, or while its ingest has
   * not stored its manifest. Incomplete (a chunk lost since), what it lacks is stored again
   * from its own files (restoreOwnChunks) and what those do not give back is fetched: it
   * used to return at once, reported done while the host went on holding it incomplete. A
   * repair that fails (a full disk, EIO) leaves it all to the fetch. A delete during the
   * repair, or between it and the fetch, wins: nothing is fetched, the step fails (a fetch
   * begun after the repair used to store the deleted snapshot's manifest again).
   */
  async replicate(snapshotId: string, fetch: FetchSnapshotWork): Promise<{ bytesFetched: number }> {
    const own = join(this.deps.driverSnapshotsDir, snapshotId);
    // Known to remove() from the start to the end, fetchFrom's own attempt included: no gap
    // between the repair and the fetch where a delete goes unseen.
    const { attempt, forget } = this.track(snapshotId, 'fetched');
    try {
      if (await this.ownSealed(own)) {
        if (this.complete.has(snapshotId)) return { bytesFetched: 0 };
        const lacking = await this.deps.driver
          .openSnapshot(own)
          .then((local) => this.restoreOwnChunks(local))
          .catch((e: unknown) => {
            if (attempt.removed) throw removedWhile(snapshotId, this.deps.hostId, 'repaired');
            this.deps.log.warn({ snapshotId, err: (e as Error).message }, 'could not store again from its own files the chunks a snapshot taken here lacks: fetching them');
            return null; // all left to the fetch
          });
        // undefined: no manifest stored yet (its ingest stores one); []: held complete now.
        if (lacking !== null && !lacking?.length) return { bytesFetched: 0 };
      }
      const stored = await this.deps.manifests.get(snapshotId);
      this.throwIfRemoved(snapshotId, attempt);
      const { bytesFetched } = await this.fetchFrom(snapshotId, fetch, stored, false);
      return { bytesFetched };
    } finally {
      forget();
    }
  }

  /**
   * Fetches from `fetch`'s sources what the store lacks of the snapshot, with `build` into its
   * image too. Returns once every chunk is stored; `durable()` waits for the rest. `removed`:
   * a delete here won already (obtain found the stored manifest gone), so the fetch serves the
   * restore at hand and stores no manifest, as one that remove() marks.
   */
  private async fetchFrom(snapshotId: string, fetch: FetchSnapshotWork | undefined, stored: SignedManifest | undefined, build: boolean, removed = false): Promise<{ mat: MaterialisedSnapshot | undefined; bytesFetched: number; signed: SignedManifest }> {
    if (!fetch || fetch.sources.length === 0) throw new ForkfleetError('not_found', `snapshot ${snapshotId} is not on host ${this.deps.hostId} and no source was named`);
    const sources = this.sourcesOf(fetch);
    // Known to remove() from here: a delete of the snapshot meanwhile (before obtain returns,
    // or before the deferred manifest write below) wins, and the fetch stores no manifest.
    const { attempt, forget } = this.track(snapshotId, 'fetched', removed);
    let durableSet = false;
    try {
      // The manifest bytes come from a peer; the signature comes from the scheduler. It is
      // stored only after every chunk is (fetchSnapshot), so "manifest present" = complete.
      const t0 = performance.now();
      const given = fetch.manifest && fetch.manifest.signature.length > 0 ? await this.signedBySchedulerFrom(snapshotId, fetch, sources, stored) : undefined;
      // With `build`, the image is written while chunks arrive; chunks already here are copied
      // after. The fork needs the image, not the durable "complete" marker: the chunk fsyncs and
      // the manifest put finish in the background (the snapshot is reported held after).
      let mat: MaterialisedSnapshot | undefined;
      const around: FetchSnapshotOptions['around'] = async (manifest, run) => {
        mat = await this.deps.materialiser.materialiseWhile(snapshotId, manifest, async (sink) => {
          await run(sink);
        });
      };
      const { report, durable, signed: got } = await fetchSnapshot(
        snapshotId,
        sources,
        { chunks: this.deps.chunks, manifests: this.manifestsFor(attempt), roots: this.deps.roots, trust: this.deps.trust, log: this.deps.log },
        { deferDurable: true, ...(given ? { signed: given.signed, verified: given.manifest } : {}), ...(build ? { around } : {}) },
      );
      this.notDurable.delete(snapshotId);
      const settled: Promise<void> = durable
        .then(
          () => {
            // Removed while its manifest was being stored: remove() deletes it (it waited
            // for the put), so the snapshot is not held.
            if (attempt.removed) this.notDurable.set(snapshotId, removedWhile(snapshotId, this.deps.hostId, attempt.doing));
            else this.markComplete(snapshotId);
          },
          (e: unknown) => {
            // Logged by fetchSnapshot; durable() reports it, a later fetch replaces it.
            this.notDurable.set(snapshotId, e);
          },
        )
        .finally(forget);
      durableSet = true;
      this.durables.set(snapshotId, settled);
      void settled.then(() => {
        if (this.durables.get(snapshotId) === settled) this.durables.delete(snapshotId);
      });
      this.deps.log.info({ snapshotId, fetch: { ...report, sources: report.sources.length }, totalMs: Math.round(performance.now() - t0) }, build ? 'snapshot fetched and materialised' : 'snapshot fetched');
      this.storedSinceGc += report.bytes ?? 0;
      return { mat, bytesFetched: report.bytes ?? 0, signed: got };
    } finally {
      if (!durableSet) forget();
      for (const s of sources) s.close();
    }
  }

  /** A VMM snapshot directory that is sealed (the VMM's manifest.json) and not deleted. */
  private async ownSealed(dir: string): Promise<boolean> {
    return (await exists(join(dir, 'manifest.json'))) && !(await exists(join(dir, DELETED_MARKER)));
  }

  /** An attempt remove() marked fails (removedWhile): the delete wins. */
  private throwIfRemoved(snapshotId: string, attempt: FetchAttempt): void {
    if (attempt.removed) throw removedWhile(snapshotId, this.deps.hostId, attempt.doing);
  }

  /** Registers an attempt on the snapshot for remove() to mark; `forget` once it is over. */
  private track(snapshotId: string, doing: FetchAttempt['doing'], removed = false): { attempt: FetchAttempt; forget: () => void } {
    // Begun while a remove() of it runs: marked at once (remove() marks only those it found).
    const attempt: FetchAttempt = { doing, removed: removed || this.removing.has(snapshotId) };
    let attempts = this.attempts.get(snapshotId);
    if (!attempts) this.attempts.set(snapshotId, (attempts = new Set()));
    const mine = attempts;
    mine.add(attempt);
    const forget = (): void => {
      mine.delete(attempt);
      if (mine.size === 0 && this.attempts.get(snapshotId) === mine) this.attempts.delete(snapshotId);
    };
    return { attempt, forget };
  }

  /**
   * A snapshot taken here whose manifest is stored but some chunk is not (removed because its
   * fsync failed at start-up, quarantined as corrupt, or shared with one found so:
   * incompleteWith): every chunk it lacks is read again from the snapshot's own files and
   * stored if its bytes hash to the digest the manifest names, and once none is missing the
   * snapshot is held complete again. The manifest stays as stored: its bytes are the ones the
   * scheduler signed. Unrepaired, it stayed incomplete for good (an ingest run again, a
   * restore or a replica here each took the VMM directory for the whole snapshot), and the
   * scheduler, no longer counting this host as a holder, perhaps had none left.
   * The disk layer is read from the directory's own file: a layer ingest flattened
   * (portableDisk) has other bytes, and its chunks are left for a fetch (replicate).
   * Returns the digests still missing ([]: held complete now), undefined when no manifest is
   * stored (its ingest stores one). A chunk these files did not give back is not read for
   * again (notInOwnFiles). A delete meanwhile wins (removedWhile), whatever it returns.
   */
  private async restoreOwnChunks(local: LocalSnapshot): Promise<string[] | undefined> {
    const snapshotId = local.manifest.snapshotId;
    const { attempt, forget } = this.track(snapshotId, 'repaired');
    try {
      // Read once known to remove(): a delete done before this finds no manifest.
      const stored = await this.deps.manifests.get(snapshotId);
      this.throwIfRemoved(snapshotId, attempt);
      if (!stored) return undefined;
      const manifest = fromBinary(SnapshotManifestSchema, stored.manifest);
      const digests = manifestDigests(manifest);
      const lacking = new Set(await this.deps.chunks.missing(digests));
      const notInFiles = this.notInOwnFiles.get(snapshotId);
      /** Digests looked for in the files (the ones still lacking after are remembered). */
      const sought = new Set<string>();
      let restored = 0;
      for (const a of manifest.artifacts) {
        const refs = a.chunks.filter((c) => {
          const digest = Buffer.from(c.digest).toString('hex');
          return lacking.has(digest) && !notInFiles?.has(digest);
        });
        if (refs.length === 0) continue;
        // The file ingest cut, by the name it gave the artifact (only bytes that hash to a
        // digest the manifest names are stored, whatever the file holds).
        const fh = await open(join(local.dir, a.name), 'r').catch((e: unknown) => {
          // Gone: its chunks stay missing, for good (another error may pass: asked again).
          if ((e as NodeJS.ErrnoException).code === 'ENOENT') for (const c of refs) sought.add(Buffer.from(c.digest).toString('hex'));
          return undefined;
        });
        if (!fh) continue;
        try {
          for (const c of refs) {
            const digest = Buffer.from(c.digest).toString('hex');
            if (!lacking.has(digest)) continue; // stored already, from another offset
            sought.add(digest);
            const buf = Buffer.alloc(c.size);
            const { bytesRead } = await fh.read(buf, 0, c.size, Number(c.index) * manifest.chunkSize);
            if (bytesRead !== c.size || sha256Hex(buf) !== digest) continue;
            const enc = await encodeChunk(buf, digest);
            await this.deps.chunks.put(enc, { trusted: true });
            this.storedSinceGc += enc.data.length;
            lacking.delete(digest);
            restored++;
          }
        } finally {
          await fh.close();
        }
      }
      // Only those it lacked: the rest were there at the look above (a quarantine since marks
      // the snapshot incomplete itself, incompleteWith).
      const still = lacking.size === 0 ? [] : await this.deps.chunks.missing([...lacking]);
      this.throwIfRemoved(snapshotId, attempt);
      const notGiven = [...sought].filter((d) => lacking.has(d));
      if (notGiven.length > 0) {
        const known = notInFiles ?? new Set<string>();
        for (const d of notGiven) known.add(d);
        this.notInOwnFiles.set(snapshotId, known);
      }
      if (still.length > 0) {
        this.deps.log.warn({ snapshotId, restored, missing: still.length }, 'a snapshot taken here lacks chunks its own files do not give back: held incomplete until they are fetched');
        return still;
      }
      // Durable before the snapshot is reported complete, as any stored manifest's chunks are.
      await this.deps.chunks.sync(digests);
      this.throwIfRemoved(snapshotId, attempt);
      this.markComplete(snapshotId);
      this.sealedOnly.delete(snapshotId);
      if (restored > 0) this.deps.log.info({ snapshotId, chunks: restored }, 'chunks a snapshot taken here lacked were stored again from its own files: held complete');
      return [];
    } finally {
      forget();
    }
  }

  /**
   * restoreOwnChunks for a restore here, not awaited by it, and one at a time per snapshot: a
   * restore that finds one running leaves the snapshot to it. Its failure fails nothing.
   */
  private repairInBackground(local: LocalSnapshot): void {
    const snapshotId = local.manifest.snapshotId;
    if (this.repairing.has(snapshotId)) return;
    this.repairing.add(snapshotId);
    void this.restoreOwnChunks(local)
      .catch((e: unknown) => this.deps.log.warn({ snapshotId, err: (e as Error).message }, 'could not store again the chunks a snapshot taken here lacks'))
      .finally(() => this.repairing.delete(snapshotId));
  }

  /**
   * The manifest store as one fetch writes to it: once remove() marked the fetch, its put is
   * refused; a put that began before is remembered, for remove() to wait for and undo.
   */
  private manifestsFor(attempt: FetchAttempt): ManifestStore {
    const store = this.deps.manifests;
    return {
      get: (id) => store.get(id),
      list: () => store.list(),
      delete: (id) => store.delete(id),
      put: (id, signed) => {
        if (attempt.removed) return Promise.reject(removedWhile(id, this.deps.hostId, attempt.doing));
        const p = store.put(id, signed);
        attempt.storing = p.then(
          () => undefined,
          () => undefined,
        );
        return p;
      },
    };
  }

  /**
   * The manifest bytes under the signature the scheduler put in `fetch`, verified: the bytes
   * stored here, else those of the first source whose bytes the signature verifies. A source
   * whose bytes do not verify is logged and the next asked (verifiedManifestFrom): the first
   * answer used to be taken, and a bad one failed the restore though another source held the
   * snapshot. None that verifies: ManifestInvalidError when every source answered, else
   * unavailable (retryable), as when none answered.
   */
  private async signedBySchedulerFrom(snapshotId: string, fetch: FetchSnapshotWork, sources: readonly PeerChunkSource[], stored?: SignedManifest): Promise<{ signed: SignedManifest; manifest: SnapshotManifest }> {
    const sig = fetch.manifest;
    if (!sig || sig.signature.length === 0) throw new ForkfleetError('invalid_argument', 'fetch.manifest: missing signature', { field: 'fetch.manifest' });
    const underSig = (bytes: Uint8Array): SignedManifest => create(SignedManifestSchema, { manifest: bytes, signature: sig.signature, keyId: sig.keyId });
    const candidates: ManifestSource[] = [
      ...(stored && stored.manifest.length > 0 ? [{ id: `${this.deps.hostId} (stored here)`, getManifest: async () => underSig(stored.manifest) }] : []),
      ...sources.map((s) => ({ id: s.id, getManifest: async (signal?: AbortSignal) => underSig((await s.getManifest(signal)).manifest) })),
    ];
    try {
      return await verifiedManifestFrom(snapshotId, candidates, this.deps.trust, { log: this.deps.log });
    } catch (e) {
      if (e instanceof ManifestInvalidError) throw e;
      throw new ForkfleetError('unavailable', `no source returned the manifest of ${snapshotId}`, { cause: e });
    }
  }

  /** True when the snapshot is on this host: taken here, or every chunk and its manifest stored. */
  async holds(snapshotId: string): Promise<boolean> {
    if (this.complete.has(snapshotId)) return true;
    return this.ownSealed(join(this.deps.driverSnapshotsDir, snapshotId));
  }

  /**
   * What a restore by migration (ADR 0015) needs of a snapshot this host does not hold: the
   * VMM's manifest and image description (from the scheduler-signed manifest, verified) and
   * the disk layer, whose chunks are fetched from the sources here (the memory comes in the
   * migration stream). `release` unpins the fetched chunks once the layer is written.
   */
  async incomingSource(snapshotId: string, fetch: FetchSnapshotWork): Promise<IncomingSnapshot> {
    const sources = this.sourcesOf(fetch);
    try {
      const { manifest } = await this.signedBySchedulerFrom(snapshotId, fetch, sources, await this.deps.manifests.get(snapshotId));
      const disk = manifest.artifacts.find((a) => a.kind === ArtifactKind.DISK_LAYER);
      if (!disk) throw new ForkfleetError('failed_precondition', `snapshot ${snapshotId} has no disk layer`);
      const meta = <T>(name: (typeof META_FILES)[number]): T => {
        const data = manifest.metadata[name];
        if (!data) throw new ForkfleetError('failed_precondition', `manifest of ${snapshotId} lacks ${name}`);
        return JSON.parse(Buffer.from(data).toString('utf8')) as T;
      };
      const sizes = chunkSizes([disk]);
      const digests = new Set(sizes.keys());
      const unpin = this.deps.roots.pin(digests);
      try {
        const report = await fetchChunks(digests, sources, this.deps.chunks, { log: this.deps.log, sizes });
        this.storedSinceGc += report.bytes ?? 0;
        return {
          manifest: meta<VmmSnapshotManifest>('manifest.json'),
          image: meta<GuestImage>('image.json'),
          diskLayerBacking: disk.backing,
          writeDiskLayer: (path) => this.writeArtifact(disk, manifest.chunkSize, path),
          bytesFetched: report.bytes ?? 0,
          release: unpin,
        };
      } catch (e) {
        unpin();
        throw e;
      }
    } finally {
      for (const s of sources) s.close();
    }
  }

  /**
   * Restore by migration (ADR 0015): asks the sources in turn to migrate the snapshot to a
   * one-shot listener on `listenHost`, and hands the first connection to `load`. A source
   * that fails before it connects is skipped; a failure after that is final.
   */
  async migrateFrom<T>(fetch: FetchSnapshotWork, listenHost: string, load: (conn: MigrationStream, sourceGone: AbortSignal) => Promise<T>, signal?: AbortSignal): Promise<{ result: T; bytes: number }> {
    const ticket = fetch.ticket;
    if (!ticket) throw new ForkfleetError('invalid_argument', 'fetch.ticket: missing', { field: 'fetch.ticket' });
    let lastErr: unknown = new ForkfleetError('unavailable', `no source with an address for ${fetch.snapshotId}`);
    for (const s of migrationSources(fetch)) {
      let started = false;
      try {
        if (signal?.aborted) throw signal.reason;
        const relay = this.deps.migrationRelay && { ...this.deps.migrationRelay, sourceHostId: s.hostId };
        const r = await migrateFrom({ sourceAddress: s.address, ticket, hostId: this.deps.hostId, listenHost, tls: this.deps.peerTls, relay, ...(signal ? { signal } : {}) }, (conn, sourceGone) => {
          started = true;
          return load(conn, sourceGone);
        });
        if (r.sourceError) this.deps.log.warn({ source: s.hostId, snapshotId: fetch.snapshotId, err: r.sourceError }, 'migration source failed to answer after its stream was loaded; the VM stands');
        return { result: r.result, bytes: r.bytes };
      } catch (e) {
        if (started) throw e;
        lastErr = e;
        this.deps.log.warn({ source: s.hostId, snapshotId: fetch.snapshotId, err: (e as Error).message }, 'migration source failed before connecting');
      }
    }
    throw lastErr;
  }

  /** Writes an artifact from verified stored chunks into a new sparse file at `path`. */
  private async writeArtifact(a: Artifact, chunkSize: number, path: string): Promise<void> {
    const fh = await open(path, 'wx');
    try {
      await fh.truncate(Number(a.size));
      for (const c of a.chunks) {
        const plain = await this.deps.chunks.readVerified(Buffer.from(c.digest).toString('hex'));
        // As materialised images are written: zero pages stay holes, and a short write (a nearly
        // full disk reports fewer bytes, no error) fails the artifact rather than leave zeros in it.
        await writeSparse(fh.fd, plain, Number(c.index) * chunkSize);
      }
    } finally {
      await fh.close();
    }
  }

  private sourcesOf(fetch: FetchSnapshotWork): PeerChunkSource[] {
    const ticket = fetch.ticket;
    if (!ticket) throw new ForkfleetError('invalid_argument', 'fetch.ticket: missing', { field: 'fetch.ticket' });
    return fetch.sources.filter((s) => s.address).map((s) => new PeerChunkSource({ id: s.hostId, address: s.address, ticket, hostId: this.deps.hostId, tls: this.deps.peerTls }));
  }

  /**
   * Deletes a snapshot from this host: its manifest at once (its chunks go at the GC that
   * follows), its VMM directory as soon as nothing uses it. A VM restored from it, a later
   * snapshot's disk layer backed by it, or a lease (a restore between obtain() and its VMs
   * running, a migration out) keeps the directory; a `.deleted` marker makes a later GC
   * remove it once free (also after an agent restart). The delete is done all the same: the
   * snapshot is no longer held here, and a restore no longer takes it up.
   *
   * A fetch or an ingest of the snapshot under way stores no manifest after this (one
   * storing it now is waited for and its manifest deleted), also a fetch whose manifest
   * write obtain() left to the background: the delete wins.
   */
  async remove(snapshotId: string): Promise<void> {
    // Attempts begun from here until the manifest is gone (a snapshot step redelivered, a
    // restore's repair) are marked as they begin: one begun after the mark below found the
    // manifest readable, repaired the snapshot and held it complete again. Not through the GC
    // pass after it (a fetch begun then, a replica asked again, is no attempt on what was
    // deleted); an ingest begun then finds the directory's delete marker (ingestTracked).
    this.removing.set(snapshotId, (this.removing.get(snapshotId) ?? 0) + 1);
    let marking = true;
    const unmark = (): void => {
      if (!marking) return;
      marking = false;
      const n = (this.removing.get(snapshotId) ?? 1) - 1;
      if (n > 0) this.removing.set(snapshotId, n);
      else this.removing.delete(snapshotId);
    };
    try {
      await this.removeMarked(snapshotId, unmark);
    } finally {
      unmark();
    }
  }

  private async removeMarked(snapshotId: string, manifestGone: () => void): Promise<void> {
    // Cleared before the fetches are marked: what a marked fetch reports (durable()) is set after.
    const notDurable = this.notDurable.get(snapshotId);
    this.notDurable.delete(snapshotId);
    const fetches = [...(this.attempts.get(snapshotId) ?? [])];
    for (const f of fetches) f.removed = true;
    // A manifest put that began before the mark: finished first, then deleted below.
    await Promise.all(fetches.map((f) => f.storing));
    // Forgotten first (no restore takes it up meanwhile); known again if the marker or the
    // manifest's delete fails (a full disk, EIO): the host's heartbeats go on listing it, so
    // the scheduler asks again, rather than its files staying unlisted until a restart.
    const had = [this.complete, this.storedIncomplete, this.sealedOnly].filter((set) => set.delete(snapshotId));
    this.notInOwnFiles.delete(snapshotId);
    const own = join(this.deps.driverSnapshotsDir, snapshotId);
    try {
      // Durable before the manifest goes: a directory with neither marker nor manifest after a
      // power loss would be reported as a snapshot never ingested, and deleted only later.
      if (await exists(own)) await writeFileDurable(join(own, DELETED_MARKER), '');
      // A GC meanwhile found the sealed directory before its marker, and listed it again.
      this.sealedOnly.delete(snapshotId);
      await this.deps.manifests.delete(snapshotId);
      manifestGone();
    } catch (e) {
      for (const set of had) set.add(snapshotId);
      if (notDurable !== undefined && !this.notDurable.has(snapshotId)) this.notDurable.set(snapshotId, notDurable);
      throw e;
    }
    // Done: the manifest is gone. The pass that follows still ends the step, so that a delete
    // reported done has freed the snapshot's bytes (the next heartbeat's storedBytes, the
    // directory of a snapshot nothing uses); a burst of deletes shares one pass (collectGarbage).
    // Its failure fails no delete: the next pass (periodic, or the next delete's) retries.
    await this.collectGarbage().catch((e: unknown) => this.deps.log.warn({ snapshotId, err: (e as Error).message }, 'gc after a snapshot delete failed; the delete is done, the next gc frees its chunks'));
  }

  /**
   * Bytes the chunk store holds: what the last GC counted, and what ingests and fetches stored
   * since (the GC runs every few minutes, and placement counts this as the host's disk in use).
   */
  storedBytes(): number {
    return (this.lastGc?.keptBytes ?? 0) + this.storedSinceGc;
  }

  /** Bytes the materialised images of held snapshots take (allocated): what the last GC counted, and what was built since. */
  imageBytes(): number {
    return this.imageBytesAtGc + this.deps.materialiser.builtBytesSince();
  }

  /**
   * One GC pass (one at a time): VMM directories of deleted snapshots that nothing uses
   * any more, materialised images without manifest or lease, then chunks that no
   * manifest, running VM or in-flight transfer reaches (snapshot-store-gc.ts).
   *
   * Passes merge: at most one runs and one waits, and every caller until the waiting one
   * starts shares it. A pass that has not started sees whatever its callers did before they
   * called (a manifest deleted, a marker written), so sharing it loses nothing; a pass per call
   * made K deletes at once run K full passes in turn, the k-th delete waiting for k of them.
   */
  collectGarbage(): Promise<GcResult> {
    if (this.gcPending) return this.gcPending;
    const run = async (): Promise<GcResult> => {
      // Started: what a caller does from now on may come too late for this pass.
      this.gcPending = undefined;
      const dirs: string[] = [];
      for (const id of await readdir(this.deps.driverSnapshotsDir).catch(() => [] as string[])) {
        const dir = join(this.deps.driverSnapshotsDir, id);
        if (!(await exists(join(dir, DELETED_MARKER)))) {
          // Sealed by a snapshot whose step failed after (its VM crashed while the image was
          // synced, say): never ingested, so nothing listed it. Listed now, as load() lists
          // such a directory after a restart: the scheduler has a snapshot it does not keep
          // deleted here, rather than its memory image staying until the agent restarts.
          // The marker checked again last: a remove() that wrote it meanwhile has already
          // unlisted the snapshot, and listing it now would report a deleted snapshot held.
          if (!this.complete.has(id) && !this.storedIncomplete.has(id) && !this.sealedOnly.has(id) && (await exists(join(dir, 'manifest.json'))) && !(await exists(join(dir, DELETED_MARKER)))) {
            this.sealedOnly.add(id);
            this.deps.log.info({ snapshotId: id }, 'a sealed snapshot no step reported is listed as held (incomplete)');
          }
          continue;
        }
        // Leased (a restore that obtain() gave this directory and whose VMs do not run from it
        // yet, a migration out): kept, and removed by a GC after the last release. Checked after
        // the marker was seen: a lease taken after this check is taken after the marker was
        // written, and obtain() then does not hand the directory out.
        if (this.deps.roots.holders(id).length > 0) {
          this.keptForLease.add(id);
          this.deps.log.debug({ snapshotId: id, holders: this.deps.roots.holders(id) }, 'deleted snapshot leased on this host; kept until released');
          continue;
        }
        this.keptForLease.delete(id);
        try {
          await this.deps.driver.deleteSnapshot(await this.deps.driver.openSnapshot(dir));
          dirs.push(id);
        } catch (e) {
          this.deps.log.debug({ snapshotId: id, err: String(e) }, 'deleted snapshot still in use on this host; kept for now');
        }
      }
      // Images of fetches whose manifest is not stored yet are in use too (a fork maps them
      // next): asked per image, just before it would go.
      const inUse = await this.deps.driver.snapshotsInUse();
      const images = await this.deps.materialiser.prune((id) => inUse.has(id) || this.durables.has(id) || this.deps.driver.vmsUse?.(id) === true);
      this.imageBytesAtGc = await this.deps.materialiser.diskBytes();
      const since = this.storedSinceGc;
      const gc = await collectGarbage({ chunks: this.deps.chunks, manifests: this.deps.manifests, roots: this.deps.roots, clock: { now: () => new Date() }, graceMs: this.deps.gcGraceMs ?? 60_000, log: this.deps.log });
      // A manifest that no longer decoded is gone: so is the snapshot, from what this host holds.
      for (const id of gc.removedManifests) {
        this.complete.delete(id);
        this.storedIncomplete.delete(id);
      }
      this.lastGc = gc;
      // What the sweep counted; what was stored while it ran may not be in it (counted again: over, not under).
      this.storedSinceGc -= Math.min(since, this.storedSinceGc);
      if (dirs.length || images.length) this.deps.log.info({ snapshotDirs: dirs, images }, 'deleted snapshots removed from disk');
      return gc;
    };
    const next = this.gcRun.catch(() => undefined).then(run);
    this.gcRun = next;
    this.gcPending = next;
    return next;
  }
}
