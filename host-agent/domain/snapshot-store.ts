// Ports of the content-addressed snapshot store, and the in-memory registry of live roots
// (leases held by running VMs, digests pinned by in-flight ingests and transfers).
//
// Invariants:
// - A chunk is stored under the hex SHA-256 of its *uncompressed* content; a stored file
//   that does not decode and hash to its name is never returned as valid.
// - A manifest is stored only after every chunk it lists is stored, so "manifest present"
//   means "snapshot complete on this host".
// - A chunk is live while a stored manifest or an in-flight operation (a pin) reaches it.
//   GC deletes only chunks that are not live and are older than a grace period.
// - A lease keeps a snapshot's files (its materialised image, its VMM directory), not its
//   chunks or its manifest: a delete of a leased snapshot removes the manifest at once and
//   the files at a GC after the last lease is released.
import type { Codec, SignedManifest, SnapshotManifest } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import { SnapshotLeasedError } from './transfer-errors.ts';

/** Hex SHA-256 of a chunk's uncompressed content. */
export type DigestHex = string;

export interface Clock {
  now(): Date;
}

export const systemClock: Clock = { now: () => new Date() };

/** A chunk as stored and as sent on the wire: compressed data plus what it decodes to. */
export interface EncodedChunk {
  readonly digest: DigestHex;
  readonly codec: Codec;
  /** Uncompressed length. */
  readonly size: number;
  /** Stored bytes (compressed unless codec is NONE). */
  readonly data: Uint8Array;
}

export interface SweepStats {
  readonly scanned: number;
  readonly deleted: number;
  readonly freedBytes: number;
  /** Bytes of the chunks still stored after the sweep. */
  readonly keptBytes: number;
}

export interface ChunkStore {
  has(digest: DigestHex): Promise<boolean>;
  /** The subset of `digests` not stored (order kept, duplicates removed). */
  missing(digests: Iterable<DigestHex>): Promise<DigestHex[]>;
  /**
   * Stores (temp file, rename; durable at the next `sync()`). Unless `trusted`, first
   * decodes and hashes the data and throws DigestMismatchError when it doesn't match.
   * Idempotent.
   */
  put(chunk: EncodedChunk, opts?: { trusted?: boolean }): Promise<void>;
  /**
   * Decodes and verifies (DigestMismatchError), stores like `put`, and returns the decoded
   * content, so a receiver verifies each chunk exactly once and can use the plain bytes.
   */
  accept(chunk: EncodedChunk): Promise<Buffer>;
  /**
   * Makes every chunk stored so far durable (one batch of fsyncs). Run it before storing a
   * manifest: "manifest present" must survive an OS crash only together with its chunks.
   * `needs`: the chunks that manifest names; it fails (retryable) if one of them was lost to
   * an earlier failed fsync and not written again (without `needs`: if any was).
   */
  sync(needs?: Iterable<DigestHex>): Promise<void>;
  /** The stored bytes, unverified (for serving peers; the receiver verifies). */
  getEncoded(digest: DigestHex): Promise<EncodedChunk | undefined>;
  /** Decoded and verified content; a corrupt file is removed and ChunkCorruptError thrown. */
  readVerified(digest: DigestHex): Promise<Buffer>;
  /** Marks a chunk as recently referenced (GC grace period). */
  touch(digest: DigestHex): Promise<void>;
  /**
   * Deletes every stored chunk for which `isLive(digest, mtimeMs)` is false. The predicate
   * is evaluated synchronously right before each unlink, so a digest pinned by concurrent
   * code before the check is never deleted.
   */
  sweep(isLive: (digest: DigestHex, mtimeMs: number) => boolean): Promise<SweepStats>;
}

export interface ManifestStore {
  put(snapshotId: string, signed: SignedManifest): Promise<void>;
  get(snapshotId: string): Promise<SignedManifest | undefined>;
  delete(snapshotId: string): Promise<void>;
  list(): Promise<string[]>;
}

/** Every distinct digest a manifest references, across all artifacts. */
export function manifestDigests(m: SnapshotManifest): Set<DigestHex> {
  const out = new Set<DigestHex>();
  for (const a of m.artifacts) for (const c of a.chunks) out.add(Buffer.from(c.digest).toString('hex'));
  return out;
}

/** The plain size of every chunk the artifacts name (one digest is one content: one size). */
export function chunkSizes(artifacts: ReadonlyArray<Pick<SnapshotManifest['artifacts'][number], 'chunks'>>): Map<DigestHex, number> {
  const out = new Map<DigestHex, number>();
  for (const a of artifacts) for (const c of a.chunks) out.set(Buffer.from(c.digest).toString('hex'), c.size);
  return out;
}

/** Sum of stored (compressed) sizes of the distinct chunks in `m` that `have` lacks. */
export function bytesMissing(m: SnapshotManifest, have: ReadonlySet<DigestHex>): number {
  const seen = new Set<DigestHex>();
  let n = 0;
  for (const a of m.artifacts) {
    for (const c of a.chunks) {
      const d = Buffer.from(c.digest).toString('hex');
      if (have.has(d) || seen.has(d)) continue;
      seen.add(d);
      n += c.storedSize;
    }
  }
  return n;
}

export interface Lease {
  readonly snapshotId: string;
  readonly holder: string;
  release(): void;
}

/**
 * Live roots that are not manifests: leases (a restore or migration out is about to use, or
 * uses, a snapshot's files: its image or VMM directory) and pins (an ingest or transfer is
 * writing chunks that no manifest lists yet).
 */
export class LiveRoots {
  private readonly leases = new Map<string, Set<string>>();
  private readonly pins = new Map<DigestHex, number>();
  /** GCs between their mark and the end of their sweep (beginSweep). */
  private sweeps = 0;
  /** Unpins asked for while a GC ran: they take effect when the last one ends. */
  private deferred: Array<() => void> = [];

  lease(snapshotId: string, holder: string): Lease {
    let s = this.leases.get(snapshotId);
    if (!s) this.leases.set(snapshotId, (s = new Set()));
    s.add(holder);
    let released = false;
    return {
      snapshotId,
      holder,
      release: () => {
        if (released) return;
        released = true;
        const cur = this.leases.get(snapshotId);
        cur?.delete(holder);
        if (cur && cur.size === 0) this.leases.delete(snapshotId);
      },
    };
  }

  holders(snapshotId: string): string[] {
    return [...(this.leases.get(snapshotId) ?? [])];
  }

  leasedSnapshots(): string[] {
    return [...this.leases.keys()];
  }

  assertNotLeased(snapshotId: string): void {
    const h = this.holders(snapshotId);
    if (h.length > 0) throw new SnapshotLeasedError(snapshotId, h);
  }

  /** Pins digests until the returned function is called (reference counted). */
  pin(digests: Iterable<DigestHex>): () => void {
    const list = [...digests];
    for (const d of list) this.pins.set(d, (this.pins.get(d) ?? 0) + 1);
    let done = false;
    const release = (): void => {
      for (const d of list) {
        const n = (this.pins.get(d) ?? 1) - 1;
        if (n <= 0) this.pins.delete(d);
        else this.pins.set(d, n);
      }
    };
    return () => {
      if (done) return;
      done = true;
      if (this.sweeps > 0) this.deferred.push(release);
      else release();
    };
  }

  /**
   * A GC calls this before it marks: until the returned function is called, unpins wait. A
   * pin's owner unpins once its manifest is stored, maybe after the GC read the manifests, and
   * an old chunk (older than the grace period) would otherwise be swept under that manifest.
   */
  beginSweep(): () => void {
    this.sweeps++;
    let done = false;
    return () => {
      if (done) return;
      done = true;
      if (--this.sweeps > 0) return;
      for (const release of this.deferred.splice(0)) release();
    };
  }

  isPinned(digest: DigestHex): boolean {
    return this.pins.has(digest);
  }
}
