// Cross-host transfer: fetch the chunks a snapshot needs that this host lacks, from one or
// more peers in parallel. Each received chunk is verified once and stored on arrival (and
// its plain bytes handed to `onChunk`, which writes them into the image being
// materialised), so an interrupted transfer resumes by asking only for what is still
// missing. A chunk that fails verification (or that a peer lacks) is rejected and fetched
// from another source. Chunks are made durable in one batch before the manifest is stored.
import type { Logger } from 'pino';
import type { SignedManifest, SnapshotManifest } from '../../proto/gen/forkfleet/v1/snapshot_pb.ts';
import type { ChunkStore, DigestHex, EncodedChunk, LiveRoots, ManifestStore } from './snapshot-store.ts';
import { chunkSizes } from './snapshot-store.ts';
import { ChunkCorruptError, ChunkMissingError, ChunksUnavailableError, DigestMismatchError, ManifestInvalidError } from './transfer-errors.ts';
import { isForkfleetError } from '../../proto/errors.ts';
import { verifyManifest, type TrustedKeys } from './tickets.ts';

export type ChunkEvent = { readonly kind: 'chunk'; readonly chunk: EncodedChunk } | { readonly kind: 'missing'; readonly digest: DigestHex };

/** One open stream to a peer. Flow control (credits) is the adapter's business. */
export interface ChunkSession {
  want(digests: readonly DigestHex[]): void;
  /** Ends when the session is closed; throws when the peer fails. */
  readonly events: AsyncIterable<ChunkEvent>;
  close(): void;
}

/** Where a snapshot's signed manifest can be asked for (a peer; the shipper adds its own store). */
export interface ManifestSource {
  readonly id: string;
  getManifest(signal?: AbortSignal): Promise<SignedManifest>;
}

/** A peer that can serve one snapshot (the ticket is bound when the source is made). */
export interface ChunkSource extends ManifestSource {
  open(signal?: AbortSignal): ChunkSession;
}

/**
 * Receives each verified chunk's plain content (e.g. writes it into a sparse image). A sink
 * may carry a `placer`: then a store that can (`PlacingChunkStore`) writes the plain bytes
 * where the placer says itself, and the sink is not called for that chunk.
 */
export type ChunkSink = ((digest: DigestHex, plain: Buffer) => Promise<void>) & { readonly placer?: ChunkPlacer };

export interface ChunkPlacer {
  /** Where `digest`'s plain bytes go (opaque here; the store understands it), or undefined. */
  placesOf(digest: DigestHex): unknown;
  /** The store wrote them there. */
  placed(digest: DigestHex): void;
}

/** A ChunkStore that can also write a chunk's plain bytes where a ChunkPlacer says. */
export interface PlacingChunkStore extends ChunkStore {
  acceptInto(chunk: EncodedChunk, places: unknown): Promise<void>;
}

function canPlace(store: ChunkStore): store is PlacingChunkStore {
  return typeof (store as Partial<PlacingChunkStore>).acceptInto === 'function';
}

export interface FetchOptions {
  /**
   * Called once per fetched chunk, after it verified and was stored (unless its `placer`
   * had the store write the bytes: then `placer.placed` is called instead).
   */
  readonly onChunk?: ChunkSink;
  /** Digests requested per session and not yet received (per source). */
  readonly window?: number;
  /** Chunk writes in flight per session. */
  readonly putConcurrency?: number;
  /** Parallel streams per source (default 2): keeps a link busy while one stream stalls. */
  readonly streamsPerSource?: number;
  /** Reconnect attempts per source after a retryable failure (a chunk that could not be stored here is one). */
  readonly maxAttempts?: number;
  readonly backoffMs?: number;
  readonly signal?: AbortSignal;
  readonly log?: Logger;
  /**
   * The plain size the signed manifest gives each digest: a chunk a peer sends with another
   * size is rejected as a corrupt one is, before the store allocates for it (the size a
   * decode allocates is the one the chunk claims).
   */
  readonly sizes?: ReadonlyMap<DigestHex, number>;
  /**
   * A session with chunks asked and nothing from its source for this long (default 30 s) is
   * given up on as failed: its chunks go back to the queue and the source is tried again. A
   * peer that went silent (powered off, cut off) leaves no error on an idle stream.
   */
  readonly idleMs?: number;
}

/**
 * fetchChunks' session whose source sent more answers to digests it was not asked for (or was
 * asked once and answered already) than it has chunks asked of it at once: each one restarted
 * the silence timer, so such a peer held the chunks it was asked for, and the fetch, for ever.
 */
export class SourceStrayError extends Error {
  constructor(
    readonly source: string,
    strays: number,
  ) {
    super(`source ${source} sent ${strays} chunks or refusals for digests it was not asked for`);
  }
}

/** fetchChunks' session that heard nothing from its source for `ms` with chunks asked. */
export class SourceSilentError extends Error {
  constructor(
    readonly source: string,
    ms: number,
    asked: number,
  ) {
    super(`source ${source} sent nothing for ${ms} ms with ${asked} chunk(s) asked of it`);
  }
}

/**
 * fetchChunks received a chunk and could not store it here (a local write: ENOSPC, EIO): not
 * the source's doing. Fails the session, which counts as an attempt of its source.
 */
export class ChunkNotStoredError extends Error {
  constructor(
    readonly digest: DigestHex,
    cause: unknown,
  ) {
    super(`storing chunk ${digest.slice(0, 16)} on this host failed: ${cause instanceof Error ? cause.message : String(cause)}`, { cause });
  }
}

export interface SourceReport {
  readonly id: string;
  chunks: number;
  bytes: number;
  rejected: number;
  missing: number;
  failures: number;
  lastError?: string;
}

export interface FetchReport {
  /** Distinct chunks that were missing when the fetch started. */
  requested: number;
  fetched: number;
  /** Stored (compressed) bytes received. */
  bytes: number;
  rejected: number;
  sources: SourceReport[];
  ms: number;
}

class Notifier {
  private waiters: Array<() => void> = [];
  notify(): void {
    for (const w of this.waiters.splice(0)) w();
  }
  wait(): Promise<void> {
    return new Promise((r) => this.waiters.push(r));
  }
}

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    signal?.addEventListener('abort', () => {
      clearTimeout(t);
      resolve();
    }, { once: true });
  });
}

/**
 * fetchChunks' digests waiting to be asked for, in order: one list that every source reads
 * from a cursor of its own (one per source id, shared by its sessions). Behind a source's
 * cursor every entry was taken, is no longer wanted, or is excluded for that source (an
 * exclusion is for good), so no source looks at an entry twice: a take costs O(1) amortised
 * per entry and source. Scanning from the front of one array and splicing taken entries out
 * cost O(n) per take, O(n^2) per fetch (6 s of main thread for 64k chunks), and a source
 * rescanned every digest excluded for it at each take. Same order as that array: requeued
 * digests go to the end; a source takes the first entries it may, in order. Taken entries are
 * cleared in place; the list is compacted once they are most of it.
 */
export class DigestQueue {
  private slots: Array<DigestHex | undefined>;
  /** Cleared entries in `slots`. */
  private holes = 0;
  /** Each source id's cursor: an index into `slots`. */
  private readonly cursors = new Map<string, number>();
  /** Entries take() looked at, in all (its cost, for tests). */
  visited = 0;

  constructor(digests: Iterable<DigestHex>) {
    this.slots = [...digests];
  }

  push(d: DigestHex): void {
    this.slots.push(d);
  }

  /**
   * Up to `max` digests for source `id`, in order: the first entries that are still `wanted`
   * and not `excludedFor` it. Entries no longer wanted are dropped; excluded ones stay for the
   * other sources.
   */
  take(id: string, max: number, wanted: (d: DigestHex) => boolean, excludedFor: (d: DigestHex) => boolean): DigestHex[] {
    const out: DigestHex[] = [];
    let i = this.cursors.get(id) ?? 0;
    for (; i < this.slots.length && out.length < max; i++) {
      this.visited++;
      const d = this.slots[i];
      if (d === undefined) continue;
      if (wanted(d)) {
        if (excludedFor(d)) continue;
        out.push(d);
      }
      this.slots[i] = undefined;
      this.holes++;
    }
    this.cursors.set(id, i);
    if (this.holes > 1024 && this.holes * 2 > this.slots.length) this.compact();
    return out;
  }

  /** Drops the cleared entries, moving each cursor to where its entry went. */
  private compact(): void {
    const byIndex = [...this.cursors].sort((a, b) => a[1] - b[1]);
    const kept: DigestHex[] = [];
    let c = 0;
    for (let i = 0; i <= this.slots.length; i++) {
      for (; c < byIndex.length && (byIndex[c] as [string, number])[1] === i; c++) this.cursors.set((byIndex[c] as [string, number])[0], kept.length);
      const d = this.slots[i];
      if (d !== undefined) kept.push(d);
    }
    this.slots = kept;
    this.holes = 0;
  }
}

/**
 * The manifest of `snapshotId` from the first of `sources` whose answer verifies (the
 * signature, and that it is that snapshot's). A source whose manifest does not verify is
 * logged by id and the next one asked: the first source's bytes used to be taken on trust, and
 * a bad one failed the whole fetch (ManifestInvalidError, not retryable) while another source
 * held a good one. Throws only when none gives a valid one: the last failure to answer when a
 * source did not answer (a retry may reach it), else ManifestInvalidError naming each reason.
 */
export async function verifiedManifestFrom(
  snapshotId: string,
  sources: readonly ManifestSource[],
  trust: TrustedKeys,
  opts: { readonly signal?: AbortSignal | undefined; readonly log?: Logger | undefined } = {},
): Promise<{ signed: SignedManifest; manifest: SnapshotManifest; source: string }> {
  let unanswered: unknown;
  const invalid: string[] = [];
  /** Whether a source's manifest failed for a reason other than a key this host does not trust. */
  let theirs = false;
  for (const s of sources) {
    let signed: SignedManifest;
    try {
      signed = await s.getManifest(opts.signal);
    } catch (e) {
      unanswered = e;
      opts.log?.warn({ source: s.id, snapshotId, err: (e as Error).message }, 'GetManifest failed');
      continue;
    }
    try {
      return { signed, manifest: verifyManifest(signed, trust, snapshotId), source: s.id };
    } catch (e) {
      invalid.push(`${s.id}: ${(e as Error).message}`);
      theirs ||= trust.has(signed.keyId);
      opts.log?.warn({ source: s.id, snapshotId, err: (e as Error).message }, "a source's manifest does not verify: asking the next source");
    }
  }
  if (unanswered !== undefined) throw unanswered instanceof Error ? unanswered : new Error(String(unanswered));
  // Every source answered, with bytes that do not verify (or the plan named none): the sources'
  // fault, not this host's (the scheduler does not move the sandboxes for it). Unless every one
  // was signed by a key this host does not trust (its FF_TRUSTED_KEY behind a key rotation):
  // then the host is the one at fault, as for its own stored copy.
  throw new ManifestInvalidError(invalid.length > 0 ? `no source gave a valid manifest of ${snapshotId} (${invalid.join('; ')})` : 'no source returned a manifest', theirs || invalid.length === 0 ? { field: 'fetch.sources' } : {});
}

/**
 * Something that happens at most once (a session's failure, the fetch's end), told to whoever
 * waits for it then. Not a promise each wait races: a promise that never settles keeps the
 * result of every Promise.race it took part in (each race's reaction holds it) until it does,
 * and a session's reads race it once per chunk: every chunk read stayed in memory until the
 * session ended (200 races over 1 MiB results kept 199 MiB, measured in Node 20).
 */
class Once<T> {
  private outcome: { ok: boolean; v: unknown } | undefined;
  private readonly waiters = new Set<(ok: boolean, v: unknown) => void>();

  resolve(v: T): void {
    this.settle(true, v);
  }

  reject(e: unknown): void {
    this.settle(false, e);
  }

  private settle(ok: boolean, v: unknown): void {
    if (this.outcome) return;
    this.outcome = { ok, v };
    for (const w of this.waiters) w(ok, v);
    this.waiters.clear();
  }

  /** Calls `f` when this happens (at once if it has); returns what stops that. */
  on(f: (ok: boolean, v: unknown) => void): () => void {
    if (this.outcome) {
      f(this.outcome.ok, this.outcome.v);
      return () => undefined;
    }
    this.waiters.add(f);
    return () => this.waiters.delete(f);
  }

  /** `p`, or this first (its value, or its error). */
  race<U>(p: Promise<U>): Promise<U | T> {
    return new Promise<U | T>((resolve, reject) => {
      const off = this.on((ok, v) => (ok ? resolve(v as T) : reject(v)));
      p.then(
        (v) => (off(), resolve(v)),
        (e: unknown) => (off(), reject(e)),
      );
    });
  }
}

/**
 * `it.next()`, or `silent()` thrown when it has not settled within `ms`, or what `stop`
 * fails with first (the next is left to settle, its outcome ignored), or what `done`
 * resolves with first (then too).
 */
async function nextWithin<T>(it: AsyncIterator<T>, ms: number, silent: () => Error, stop: Once<never>, done?: Once<IteratorReturnResult<undefined>>): Promise<IteratorResult<T>> {
  const next = it.next();
  // Left unsettled when `stop`, the silence or `done` wins: a failure it has later is nobody's news.
  next.catch(() => undefined);
  let timer: NodeJS.Timeout | undefined;
  const offs: Array<() => void> = [];
  try {
    return await new Promise<IteratorResult<T>>((resolve, reject) => {
      timer = setTimeout(() => reject(silent()), ms);
      offs.push(stop.on((_, e) => reject(e)));
      if (done) offs.push(done.on((_, v) => resolve(v as IteratorReturnResult<undefined>)));
      next.then(resolve, reject);
    });
  } finally {
    clearTimeout(timer);
    for (const off of offs) off();
  }
}

/**
 * Fetches `digests` (those not already stored) into `store` from `sources`. Sources work in
 * parallel off one shared queue, so a faster peer takes more. Resolves with a report when all
 * are stored; throws ChunksUnavailableError (retryable) when no live source can supply the rest
 * (the chunks that did arrive stay stored), also when storing them here kept failing (a full
 * disk: its `cause` is then the ChunkNotStoredError, naming the write's error).
 *
 * Tail hedging (more than one source): a session with nothing left to take and nothing asked
 * asks its source again for digests other sources were asked for and have not answered (see
 * `hedge`). The first copy to arrive is stored; a later one is dropped, and is no stray for
 * the session that asked for it. With one source nothing changes.
 */
export async function fetchChunks(digests: Iterable<DigestHex>, sources: readonly ChunkSource[], store: ChunkStore, opts: FetchOptions = {}): Promise<FetchReport> {
  const t0 = performance.now();
  const window = opts.window ?? 64;
  const putConcurrency = opts.putConcurrency ?? 16;
  const maxAttempts = opts.maxAttempts ?? 3;
  const backoffMs = opts.backoffMs ?? 200;
  const idleMs = opts.idleMs ?? 30_000;
  const pending = new Set(await store.missing(digests));
  const queue = new DigestQueue(pending);
  const excluded = new Map<DigestHex, Set<string>>();
  const report: FetchReport = { requested: pending.size, fetched: 0, bytes: 0, rejected: 0, sources: [], ms: 0 };
  const changed = new Notifier();
  const placer = opts.onChunk?.placer && canPlace(store) ? opts.onChunk.placer : undefined;
  let alive = sources.length;
  let idle = 0;
  /** The last chunk a session could not store here (named in the error when the fetch fails). */
  let localFailure: ChunkNotStoredError | undefined;
  /** Received and being stored, by any session: a copy of one that arrives meanwhile is not stored again. */
  const storing = new Set<DigestHex>();
  /** Each live session: its source, and the digests it asked for and has had no answer to. */
  const sessions = new Set<{ readonly source: string; readonly requested: ReadonlySet<DigestHex> }>();
  /** A session asked for a digest another source was asked for too: from then on a copy may arrive twice. */
  let hedged = false;
  // Resolves once every chunk is stored: a session waiting on its peer for copies that arrived
  // from another source (hedged) stops waiting then. Only a hedge leaves a session so.
  const finished = new Once<IteratorReturnResult<undefined>>();
  const allStored = (): void => finished.resolve({ done: true, value: undefined });
  const done = sources.length > 1 ? finished : undefined;

  const exclude = (d: DigestHex, id: string): void => {
    let s = excluded.get(d);
    if (!s) excluded.set(d, (s = new Set()));
    s.add(id);
  };

  // Once hedged, a digest another session still has asked is not taken again (a "missing" or a
  // bad copy from the hedging source, or its session's failure, puts it back in the queue while
  // the first source still owes it): asked twice of one source, its second copy was a stray.
  // Every way a request ends without the chunk stored puts its digest back.
  const askedElsewhere = (d: DigestHex): boolean => {
    for (const s of sessions) if (s.requested.has(d)) return true;
    return false;
  };
  // Nor one being stored (a copy arrived): its store's failure puts it back.
  const wanted = (d: DigestHex): boolean => pending.has(d) && !storing.has(d) && !(hedged && askedElsewhere(d));
  const take = (id: string, max: number): DigestHex[] => queue.take(id, max, wanted, (d) => excluded.get(d)?.has(id) === true);

  const runSource = async (src: ChunkSource): Promise<void> => {
    const rep: SourceReport = { id: src.id, chunks: 0, bytes: 0, rejected: 0, missing: 0, failures: 0 };
    report.sources.push(rep);
    let attempt = 0;
    try {
      while (pending.size > 0 && !opts.signal?.aborted) {
        // Asked of the peer, no event yet.
        const requested = new Set<DigestHex>();
        const asking = { source: src.id, requested };
        sessions.add(asking);
        const session = src.open(opts.signal);
        const puts = new Set<Promise<void>>();
        let strays = 0;
        const refill = (): void => {
          const more = take(src.id, window - requested.size);
          if (more.length === 0) return;
          for (const d of more) requested.add(d);
          session.want(more);
        };
        /**
         * Tail hedging: asks this source for up to `window` digests that other sources' sessions
         * asked for and have not answered, oldest first (each such session's in turn), still
         * missing, not being stored, not excluded for this source nor asked of it already.
         * Without it, a slow peer (one that trickles restarts the silence timer with each
         * chunk) held up to `window` digests per stream, and the end of the fetch, while the
         * other sources sat idle: 300 chunks from a 1 ms source and a 200 ms one took 12.8 s,
         * the 1 ms one alone 0.3 s. Called only when this session has nothing asked.
         */
        const hedge = (): void => {
          const mine = [...sessions].filter((s) => s.source === src.id);
          let turn: Array<Iterator<DigestHex>> = [...sessions].filter((s) => s.source !== src.id).map((s) => s.requested.values());
          const more: DigestHex[] = [];
          while (turn.length > 0 && more.length < window) {
            const still: Array<Iterator<DigestHex>> = [];
            for (const asked of turn) {
              if (more.length >= window) break;
              const r = asked.next();
              if (r.done) continue;
              still.push(asked);
              const d = r.value;
              if (pending.has(d) && !storing.has(d) && excluded.get(d)?.has(src.id) !== true && !mine.some((s) => s.requested.has(d))) {
                requested.add(d);
                more.push(d);
              }
            }
            turn = still;
          }
          if (more.length === 0) return;
          hedged = true;
          opts.log?.debug({ source: src.id, chunks: more.length }, 'hedging: asking for chunks other sources have not sent yet');
          session.want(more);
        };
        // A chunk received on this session that could not be stored here fails the session
        // (as a source failure does: an attempt, then backoff), whatever the loop awaits then.
        let notStored: ChunkNotStoredError | undefined;
        const stop = new Once<never>();
        // (The session's puts have settled by then: a chunk whose store failed was requeued.)
        const giveBack = (): void => {
          for (const d of requested) if (pending.has(d)) queue.push(d);
          requested.clear();
          changed.notify();
        };
        try {
          refill();
          const it = session.events[Symbol.asyncIterator]();
          while (pending.size > 0) {
            if (notStored) throw notStored;
            if (requested.size === 0) {
              refill();
              if (requested.size === 0 && sources.length > 1) hedge();
              if (requested.size === 0) {
                if (puts.size > 0) {
                  await stop.race(Promise.race([changed.wait(), ...puts]));
                  continue;
                }
                // Nothing we may take: wait for another source to give work back, or finish.
                idle++;
                if (idle >= alive) {
                  idle--;
                  changed.notify();
                  break;
                }
                await changed.wait();
                idle--;
                continue;
              }
            }
            const r = await nextWithin(it, idleMs, () => new SourceSilentError(src.id, idleMs, requested.size), stop, done);
            if (r.done) {
              if (pending.size === 0) break; // `done`: all stored (what this peer still owes came from others)
              throw new Error('peer ended the stream early');
            }
            const ev = r.value;
            const d = ev.kind === 'missing' ? ev.digest : ev.chunk.digest;
            if (!requested.delete(d)) {
              if (++strays > window) throw new SourceStrayError(src.id, strays);
              continue;
            }
            if (ev.kind === 'missing') {
              rep.missing++;
              exclude(d, src.id);
              queue.push(d);
              changed.notify();
            } else {
              const size = opts.sizes?.get(d);
              if (size !== undefined && ev.chunk.size !== size) {
                rep.rejected++;
                report.rejected++;
                exclude(d, src.id);
                queue.push(d);
                opts.log?.warn({ source: src.id, digest: d, size: ev.chunk.size, manifestSize: size }, 'rejected chunk: not the size the manifest gives it; fetching elsewhere');
                changed.notify();
                continue;
              }
              // A copy of a hedged digest that another session received first (stored, or being
              // stored): dropped. This session asked for it, so it is no stray.
              if (hedged && (storing.has(d) || !pending.has(d))) {
                refill();
                continue;
              }
              storing.add(d);
              const chunk = ev.chunk;
              // The store may take `chunk.data` (hand it to a worker, detaching it).
              const bytes = chunk.data.length;
              const places = placer && pending.has(d) ? placer.placesOf(d) : undefined;
              const stored =
                places !== undefined
                  ? (store as PlacingChunkStore).acceptInto(chunk, places).then(() => placer?.placed(d))
                  : store.accept(chunk).then(async (plain) => {
                      if (opts.onChunk && pending.has(d)) await opts.onChunk(d, plain);
                    });
              const p = stored.then(
                () => {
                  storing.delete(d);
                  if (pending.delete(d)) {
                    report.fetched++;
                    report.bytes += bytes;
                    rep.chunks++;
                    rep.bytes += bytes;
                    if (pending.size === 0) allStored();
                  }
                  attempt = 0;
                  changed.notify();
                },
                (e: unknown) => {
                  storing.delete(d);
                  if (!(e instanceof DigestMismatchError)) {
                    // A local failure (a write, the verify worker): the chunk is not stored, and
                    // this source's retry or another source takes it up again, not given up on.
                    // It fails this session (`stop`), so it counts as an attempt: a write that
                    // always fails (a full disk) ends the fetch instead of fetching forever.
                    if (pending.has(d)) queue.push(d);
                    if (!notStored) {
                      notStored = new ChunkNotStoredError(d, e);
                      stop.reject(notStored);
                    }
                    changed.notify();
                    return;
                  }
                  rep.rejected++;
                  report.rejected++;
                  exclude(d, src.id);
                  queue.push(d);
                  opts.log?.warn({ source: src.id, digest: d, err: e.message }, 'rejected chunk: digest mismatch; fetching elsewhere');
                  changed.notify();
                },
              );
              puts.add(p);
              void p.finally(() => puts.delete(p)).catch(() => {});
              if (puts.size >= putConcurrency) await stop.race(Promise.race(puts));
              refill();
            }
          }
          await Promise.all(puts);
          session.close();
          return;
        } catch (e) {
          session.close();
          await Promise.allSettled(puts);
          giveBack();
          rep.failures++;
          rep.lastError = e instanceof Error ? e.message : String(e);
          if (e instanceof ChunkNotStoredError) localFailure = e;
          const cause = e instanceof ChunkNotStoredError ? e.cause : e;
          const retryable = isForkfleetError(cause) ? cause.retryable : true;
          opts.log?.warn({ source: src.id, err: rep.lastError, attempt }, 'chunk source failed');
          if (!retryable || ++attempt >= maxAttempts) return;
          await sleep(backoffMs * attempt, opts.signal);
        } finally {
          sessions.delete(asking);
        }
      }
    } finally {
      alive--;
      changed.notify();
    }
  };

  const streams = Math.max(1, opts.streamsPerSource ?? 2);
  alive = sources.length * streams;
  await Promise.all(sources.flatMap((s) => Array.from({ length: streams }, () => runSource(s))));
  report.ms = Math.round(performance.now() - t0);
  if (pending.size > 0) {
    const why = report.sources.map((s) => `${s.id}: ${s.lastError ?? `${s.missing} missing, ${s.rejected} rejected`}`).join('; ');
    // The sources' failure when a chunk still missing is one a source answered for and could not
    // deliver (it lacked it, or sent a bad copy), and this host's own writes did not fail (a
    // disk error here). Otherwise (no source answered for what is missing: their sessions
    // failed) this host may be the one cut off from them, at any point of the fetch: no field.
    const answered = [...pending].some((d) => (excluded.get(d)?.size ?? 0) > 0);
    throw new ChunksUnavailableError([...pending], why || 'no sources', localFailure ? { cause: localFailure } : answered || sources.length === 0 ? { field: 'fetch.sources' } : {});
  }
  return report;
}

export interface FetchSnapshotOptions extends FetchOptions {
  /** The signed manifest when the caller already has it (else asked of the sources). */
  readonly signed?: SignedManifest;
  /** `signed`'s manifest when the caller verified it already (verifiedManifestFrom): not verified again. */
  readonly verified?: SnapshotManifest;
  /**
   * Runs the chunk fetch. Lets the caller wrap it, e.g. to materialise the image while
   * chunks arrive. It must call `fetch` exactly once, and read back verified (readVerified)
   * the chunks that were stored before (the Materialiser does, as it copies them into the
   * image): without `around`, fetchSnapshot verifies those itself before it fetches.
   */
  readonly around?: (manifest: SnapshotManifest, fetch: (onChunk?: ChunkSink) => Promise<FetchReport>) => Promise<void>;
  /**
   * Resolve as soon as every chunk is stored (and `around` finished), and make the chunks
   * durable + store the manifest in the background: `durable` settles when that is done.
   * For the fork path, where the image is usable before it is on disk (ADR 0007).
   */
  readonly deferDurable?: boolean;
}

export interface FetchSnapshotDeps {
  readonly chunks: ChunkStore;
  readonly manifests: ManifestStore;
  readonly roots: LiveRoots;
  readonly trust: TrustedKeys;
  readonly log?: Logger;
}

/**
 * What a fetch that did not complete leaves for a retry to resume from: every chunk of the
 * snapshot stored here (received by it or by an earlier try) is touched, so a GC keeps it for
 * its grace period from now. Its pin goes with the failure, and the chunks' own mtimes may be
 * older than the grace (a fetch that ran longer). Never throws: the fetch's failure is the news.
 */
async function keepForRetry(chunks: ChunkStore, digests: ReadonlySet<DigestHex>, log?: Logger): Promise<void> {
  try {
    const missing = new Set(await chunks.missing(digests));
    const stored = [...digests].filter((d) => !missing.has(d));
    for (let i = 0; i < stored.length; i += 64) await Promise.all(stored.slice(i, i + 64).map((d) => chunks.touch(d)));
  } catch (e) {
    log?.warn({ err: (e as Error).message }, 'keeping the chunks of a failed fetch for a retry failed; the next GC may take them');
  }
}

/**
 * Reads back (verified) each chunk of `digests` that is stored here already, for a fetch that
 * builds no image (a replica, a drain): it would store the manifest, "complete", over them
 * without reading one, and a chunk file torn by an OS crash (an earlier write never synced;
 * `missing()` counts a file with a whole header as present) would stay named by it. A chunk
 * that fails the read is removed by it (quarantined, ChunkCorruptError), so the fetch that
 * follows gets it like a missing one. Returns how many were found so.
 */
async function verifyStored(snapshotId: string, chunks: ChunkStore, digests: ReadonlySet<DigestHex>, signal?: AbortSignal, log?: Logger): Promise<number> {
  const absent = new Set(await chunks.missing(digests));
  const stored = [...digests].filter((d) => !absent.has(d));
  let bad = 0;
  let next = 0;
  let failed = false;
  const reader = async (): Promise<void> => {
    for (let d = stored[next++]; d !== undefined && !failed && !signal?.aborted; d = stored[next++]) {
      try {
        await chunks.readVerified(d);
      } catch (e) {
        // Another failure (EIO) fails the fetch: its readers stop too.
        if (!(e instanceof ChunkCorruptError || e instanceof ChunkMissingError)) {
          failed = true;
          throw e;
        }
        bad++;
      }
    }
  };
  await Promise.all(Array.from({ length: Math.min(8, stored.length) }, reader));
  if (bad > 0) log?.warn({ snapshotId, chunks: bad, of: stored.length }, 'chunks stored here failed verification (removed): fetching them');
  return bad;
}

/**
 * Idempotent step: get the signed manifest from the first source whose manifest verifies,
 * fetch the missing chunks (pinned against GC while in flight), then store the manifest,
 * which marks the snapshot complete on this host. When it fails, the chunks it stored stay
 * for a GC grace period from the failure (keepForRetry), so a retry fetches only the rest.
 */
export async function fetchSnapshot(
  snapshotId: string,
  sources: readonly ChunkSource[],
  deps: FetchSnapshotDeps,
  opts: FetchSnapshotOptions = {},
): Promise<{ manifest: SnapshotManifest; signed: SignedManifest; report: FetchReport; durable: Promise<void> }> {
  const given = opts.signed ?? (await deps.manifests.get(snapshotId));
  const { signed: complete, manifest } = given
    ? { signed: given, manifest: opts.signed && opts.verified ? opts.verified : verifyManifest(given, deps.trust, snapshotId) }
    : await verifiedManifestFrom(snapshotId, sources, deps.trust, { signal: opts.signal, log: deps.log });
  // Each digest with the plain size the manifest gives it (checked against what peers send).
  const sizes = chunkSizes(manifest.artifacts);
  const digests = new Set(sizes.keys());
  const pinned = deps.roots.pin(digests);
  /** Unpins; first, unless the manifest was stored, keeps the chunks for a retry (pinned until then). */
  const unpin = async (complete: boolean): Promise<void> => {
    if (!complete) await keepForRetry(deps.chunks, digests, deps.log);
    pinned();
  };
  let durable: Promise<void> | undefined;
  try {
    let report: FetchReport | undefined;
    const fetch = async (onChunk?: ChunkSink): Promise<FetchReport> => {
      report = await fetchChunks(digests, sources, deps.chunks, { ...opts, sizes, ...(onChunk ? { onChunk } : {}) });
      return report;
    };
    if (opts.around) await opts.around(manifest, fetch);
    else {
      // No image is built: nothing else reads the chunks that were here already. Unless the
      // snapshot was complete here before (its manifest stored after its chunks were synced: a
      // step delivered again), whose chunks no crash can have torn.
      // (Without opts.signed, `given` is that stored manifest, read above.)
      const storedBefore = opts.signed ? await deps.manifests.get(snapshotId) : given;
      if (!storedBefore) await verifyStored(snapshotId, deps.chunks, digests, opts.signal, deps.log);
      await fetch();
    }
    if (!report) throw new Error('fetchSnapshot: around() did not run the fetch');
    // One batch of fsyncs for every chunk written, then the "complete" marker. Pinned until
    // the manifest (a root for GC) is stored.
    durable = (async () => {
      let stored = false;
      try {
        await deps.chunks.sync(digests);
        await deps.manifests.put(snapshotId, complete);
        stored = true;
      } finally {
        await unpin(stored);
      }
    })();
    if (!opts.deferDurable) await durable;
    else durable.catch((e: unknown) => deps.log?.warn({ snapshotId, err: (e as Error).message }, 'storing fetched snapshot durably failed'));
    return { manifest, signed: complete, report, durable };
  } finally {
    if (!durable) await unpin(false);
  }
}
