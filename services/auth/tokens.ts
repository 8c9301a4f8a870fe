// Per-tenant bearer tokens. The tokens file (FF_TOKENS_FILE) holds only SHA-256 digests:
//
//   { "tokens": [ { "tenant": "acme", "token_sha256": "<64 hex>", "admin": false, "name": "ci",
//                   "quotas": { "sandboxes": 50, "memory_mib": 65536, "snapshot_bytes": 107374182400 },
//                   "rate": { "per_s": 50, "burst": 100 }, "idle_timeout": "10m" } ] }
//
// `admin` tokens may call the fleet operations (ListHosts, CordonHost, DrainHost, RemoveHost) and act for
// any tenant by naming it in `tenant_id`. Quotas, rate and idle_timeout are per tenant: every
// entry of a tenant that sets them must agree. A key not shown above (a misspelt quota) is
// refused, naming it. A token is `ff_` + 43 base64url characters (256 random bits);
// `mintToken` prints it once and stores only its digest. The file is re-read when it changes,
// so a minted token works without a restart. `mintToken` and `revokeTokens` change it under a
// lock file (<file>.lock), so two at once (two CLI processes) lose neither's change.
import { createHash, randomBytes, timingSafeEqual } from 'node:crypto';
import { chownSync, closeSync, existsSync, fstatSync, linkSync, openSync, readFileSync, renameSync, rmSync, statSync, writeFileSync, writeSync } from 'node:fs';
import { hostname } from 'node:os';
import { ForkfleetError, InvalidArgumentError } from '../../proto/errors.ts';
import { parseDuration } from '../config.ts';
import { UnauthenticatedError } from './errors.ts';
import type { RateSpec } from './limits.ts';
import { TENANT_ID_RE } from '../domain/records.ts';

export interface TenantQuota {
  /** Sandboxes that are not destroyed, failed or lost. */
  readonly sandboxes?: number;
  /** Memory of the tenant's sandboxes that hold or are about to hold capacity, MiB. */
  readonly memoryMib?: number;
  /** Stored bytes of the tenant's snapshots (hibernation snapshots included). */
  readonly snapshotBytes?: number;
}

export interface TokenEntry {
  readonly tenant: string;
  readonly digest: Buffer;
  readonly admin: boolean;
  readonly name: string;
  readonly quotas: TenantQuota | undefined;
  readonly rate: RateSpec | undefined;
  /** The tenant's idle timeout for sandboxes that set none (`"idle_timeout": "10m"`). */
  readonly idleTimeoutMs?: number | undefined;
}

/** Who is calling, as the edge resolved it from the credential. */
export interface Principal {
  readonly tenantId: string;
  readonly admin: boolean;
  /** Stable, non-secret id of the credential (a digest prefix), for per-credential limits and logs. */
  readonly credentialId: string;
}

const TOKEN_RE = /^ff_[A-Za-z0-9_-]{43}$/;

export function sha256(token: string): Buffer {
  return createHash('sha256').update(token, 'utf8').digest();
}

/** The credential id of a token's digest: the first 12 hex digits of its SHA-256, shown by `forkfleet token ls`. */
export function credentialIdOf(digest: Buffer): string {
  return digest.subarray(0, 6).toString('hex');
}

export function newToken(): string {
  return `ff_${randomBytes(32).toString('base64url')}`;
}

function positiveInt(field: string, v: unknown): number | undefined {
  if (v === undefined) return undefined;
  if (typeof v !== 'number' || !Number.isSafeInteger(v) || v < 0) throw new InvalidArgumentError(field, `must be a non-negative integer, got ${JSON.stringify(v)}`);
  return v;
}

// The keys of an entry, and of its `quotas` and `rate`: every one mintToken writes, and idle_timeout.
const ENTRY_KEYS: readonly string[] = ['tenant', 'token_sha256', 'admin', 'name', 'quotas', 'rate', 'idle_timeout'];
const QUOTA_KEYS: readonly string[] = ['sandboxes', 'memory_mib', 'snapshot_bytes'];
const RATE_KEYS: readonly string[] = ['per_s', 'burst'];

/** Refuses a key of `o` not in `keys`, naming it: a misspelt limit (`memory_mb`, `quota`) read as none was no limit at all. */
function knownKeys(where: string, o: Record<string, unknown>, keys: readonly string[]): void {
  for (const k of Object.keys(o)) if (!keys.includes(k)) throw new InvalidArgumentError(`${where}.${k}`, `unknown key; the keys are ${keys.join(', ')}`);
}

/** Validates one raw entry; `where` names it in errors (e.g. "FF_TOKENS_FILE tokens[2]"). */
export function parseEntry(raw: unknown, where: string): TokenEntry {
  if (typeof raw !== 'object' || raw === null || Array.isArray(raw)) throw new InvalidArgumentError(where, 'must be an object');
  const r = raw as Record<string, unknown>;
  knownKeys(where, r, ENTRY_KEYS);
  if (typeof r.tenant !== 'string' || !TENANT_ID_RE.test(r.tenant)) throw new InvalidArgumentError(`${where}.tenant`, 'must be 1-63 characters of a-z, 0-9 and -');
  if (typeof r.token_sha256 !== 'string' || !/^[0-9a-f]{64}$/.test(r.token_sha256)) throw new InvalidArgumentError(`${where}.token_sha256`, 'must be 64 lowercase hex digits');
  if (r.admin !== undefined && typeof r.admin !== 'boolean') throw new InvalidArgumentError(`${where}.admin`, 'must be true or false');
  // Fleet operations (drain) are recorded under tenant 'admin': only admin tokens may act as it.
  if (r.tenant === 'admin' && r.admin !== true) throw new InvalidArgumentError(`${where}.tenant`, "'admin' is reserved for admin tokens (set \"admin\": true)");
  let quotas: TenantQuota | undefined;
  // null (a generator's "none", jq or Terraform output) is unset, as before such keys were checked.
  if (r.quotas !== undefined && r.quotas !== null) {
    if (typeof r.quotas !== 'object' || Array.isArray(r.quotas)) throw new InvalidArgumentError(`${where}.quotas`, `must be an object such as {"sandboxes": 50}, got ${JSON.stringify(r.quotas)}`);
    const q = r.quotas as Record<string, unknown>;
    knownKeys(`${where}.quotas`, q, QUOTA_KEYS);
    const sandboxes = positiveInt(`${where}.quotas.sandboxes`, q.sandboxes);
    const memoryMib = positiveInt(`${where}.quotas.memory_mib`, q.memory_mib);
    const snapshotBytes = positiveInt(`${where}.quotas.snapshot_bytes`, q.snapshot_bytes);
    quotas = { ...(sandboxes === undefined ? {} : { sandboxes }), ...(memoryMib === undefined ? {} : { memoryMib }), ...(snapshotBytes === undefined ? {} : { snapshotBytes }) };
  }
  let rate: RateSpec | undefined;
  if (r.rate !== undefined) {
    const q = (typeof r.rate === 'object' && r.rate !== null ? r.rate : {}) as Record<string, unknown>;
    knownKeys(`${where}.rate`, q, RATE_KEYS);
    const perSecond = q.per_s;
    if (typeof perSecond !== 'number' || !(perSecond > 0)) throw new InvalidArgumentError(`${where}.rate.per_s`, 'must be a number > 0');
    const burst = positiveInt(`${where}.rate.burst`, q.burst) ?? Math.max(1, Math.ceil(perSecond));
    if (burst < 1) throw new InvalidArgumentError(`${where}.rate.burst`, 'must be at least 1');
    rate = { perSecond, burst };
  }
  let idleTimeoutMs: number | undefined;
  if (r.idle_timeout !== undefined) {
    if (typeof r.idle_timeout !== 'string') throw new InvalidArgumentError(`${where}.idle_timeout`, "must be a duration such as '90s' or '10m' ('0s' disables)");
    idleTimeoutMs = parseDuration(`${where}.idle_timeout`, r.idle_timeout);
  }
  return { tenant: r.tenant, digest: Buffer.from(r.token_sha256, 'hex'), admin: r.admin === true, name: typeof r.name === 'string' ? r.name : '', quotas, rate, ...(idleTimeoutMs === undefined ? {} : { idleTimeoutMs }) };
}

export function parseTokensFile(text: string, where = 'FF_TOKENS_FILE'): TokenEntry[] {
  let doc: unknown;
  try {
    doc = JSON.parse(text);
  } catch (e) {
    throw new InvalidArgumentError(where, `not JSON: ${(e as Error).message}`);
  }
  const list = (doc as { tokens?: unknown } | null)?.tokens;
  if (!Array.isArray(list)) throw new InvalidArgumentError(where, 'must be {"tokens": [...]}');
  const entries = list.map((e, i) => parseEntry(e, `${where} tokens[${i}]`));
  const byTenant = new Map<string, TokenEntry>();
  const differs = (a: unknown, b: unknown): boolean => a !== undefined && b !== undefined && JSON.stringify(a) !== JSON.stringify(b);
  for (const [i, e] of entries.entries()) {
    const seen = byTenant.get(e.tenant);
    // idle_timeout too: read silently, the first entry's won, whatever a later one said.
    if (seen && (differs(e.quotas, seen.quotas) || differs(e.rate, seen.rate) || differs(e.idleTimeoutMs, seen.idleTimeoutMs))) {
      throw new InvalidArgumentError(`${where} tokens[${i}]`, `quotas/rate/idle_timeout of tenant ${e.tenant} differ from an earlier entry; set them once per tenant`);
    }
    byTenant.set(e.tenant, { ...e, quotas: e.quotas ?? seen?.quotas, rate: e.rate ?? seen?.rate, idleTimeoutMs: e.idleTimeoutMs ?? seen?.idleTimeoutMs });
  }
  return entries;
}

/** The bearer token in an `authorization` header value, or undefined. */
export function bearerOf(header: string | undefined): string | undefined {
  const m = /^Bearer ([\x21-\x7e]{1,512})$/.exec(header?.trim() ?? '');
  return m?.[1];
}

/** Resolves credentials to principals, and knows each tenant's quotas and rate. */
export class Authenticator {
  private entries: TokenEntry[] = [];
  private byTenant = new Map<string, { quotas: TenantQuota | undefined; rate: RateSpec | undefined; idleTimeoutMs: number | undefined }>();
  private readonly ephemeral: TokenEntry[] = [];
  /** mtime, size and inode of the file last taken: a replacement may keep the mtime (coarse clocks). */
  private stamp = '';
  private checkedAt = 0;

  /** Why the file could not be taken since it last changed (undefined: the tokens in use are the file's). */
  private failing: string | undefined;

  /**
   * `path` '' means no file (only ephemeral tokens). `onReloadError`: told once per failure
   * (a file that changed and cannot be read or parsed, or is gone), and `undefined` once the
   * file is taken again: the scheduler logs it, since a revocation is then not in force.
   */
  constructor(
    private readonly path: string,
    private readonly defaultRate: RateSpec | undefined,
    private readonly now: () => number = Date.now,
    private readonly onReloadError: (why: string | undefined) => void = () => undefined,
  ) {
    this.reload(true);
  }

  /** Why the tokens file could not be taken since it last changed, or undefined (the tokens in use are the file's). */
  get reloadError(): string | undefined {
    return this.failing;
  }

  /**
   * Re-reads the file when its mtime, size or inode changed (checked at most once a second): a
   * revoke's replacement within one mtime tick still has another inode. A bad new file
   * keeps the old tokens (a typo in a hand edit does not lock every tenant out), and says so
   * through onReloadError (a token revoked in it stays valid until the file can be read).
   */
  private reload(force = false): void {
    if (!this.path) return this.index();
    const t = this.now();
    if (!force && t - this.checkedAt < 1000) return;
    this.checkedAt = t;
    let stamp: string;
    try {
      const st = statSync(this.path);
      stamp = `${st.mtimeMs}:${st.size}:${st.ino}`;
    } catch (e) {
      if (force) throw new InvalidArgumentError('FF_TOKENS_FILE', `cannot read ${this.path}: ${(e as Error).message}`);
      return this.fail(`cannot read ${this.path}: ${(e as Error).message}`);
    }
    if (stamp === this.stamp) return;
    try {
      this.entries = parseTokensFile(readFileSync(this.path, 'utf8'));
      this.stamp = stamp;
      this.index();
      if (this.failing !== undefined) {
        this.failing = undefined;
        this.onReloadError(undefined);
      }
    } catch (e) {
      if (force) throw e;
      this.fail(`cannot take ${this.path}: ${(e as Error).message}`);
    }
  }

  private fail(why: string): void {
    const said = `${why}; the tokens read before stay in force, revoked ones included, until it can be read`;
    if (this.failing === said) return;
    this.failing = said;
    this.onReloadError(said);
  }

  private index(): void {
    this.byTenant = new Map();
    for (const e of [...this.entries, ...this.ephemeral]) {
      const seen = this.byTenant.get(e.tenant);
      this.byTenant.set(e.tenant, { quotas: seen?.quotas ?? e.quotas, rate: seen?.rate ?? e.rate, idleTimeoutMs: seen?.idleTimeoutMs ?? e.idleTimeoutMs });
    }
  }

  /** Adds an in-memory token (never written anywhere), e.g. for the scheduler's own dashboard. */
  addEphemeral(tenant: string, admin: boolean, name: string): string {
    const token = newToken();
    this.ephemeral.push({ tenant, digest: sha256(token), admin, name, quotas: undefined, rate: undefined });
    this.index();
    return token;
  }

  /** The principal of an `authorization` header value; UnauthenticatedError otherwise. */
  authenticate(authorization: string | undefined): Principal {
    const token = bearerOf(authorization);
    if (token === undefined) throw new UnauthenticatedError(authorization === undefined ? 'no credentials' : 'malformed authorization header');
    this.reload();
    const digest = sha256(token);
    let found: TokenEntry | undefined;
    // Compare against every entry in constant time per entry; no early exit on a match.
    for (const e of [...this.entries, ...this.ephemeral]) if (timingSafeEqual(e.digest, digest) && !found) found = e;
    if (!found) throw new UnauthenticatedError('unknown token');
    return { tenantId: found.tenant, admin: found.admin, credentialId: credentialIdOf(found.digest) };
  }

  /** Whether a credential (by id) is still in the tokens file (re-read when it changed) or is an in-memory one. */
  has(credentialId: string): boolean {
    return this.principalOf(credentialId) !== undefined;
  }

  /**
   * The principal a credential (by id) resolves to now, as authenticate would resolve its token
   * (the first entry with its digest), the tokens file re-read when it changed; undefined when
   * it is gone. An entry keeps its id when its `tenant` or `admin` is edited.
   */
  principalOf(credentialId: string): Principal | undefined {
    this.reload();
    const found = [...this.entries, ...this.ephemeral].find((e) => credentialIdOf(e.digest) === credentialId);
    return found && { tenantId: found.tenant, admin: found.admin, credentialId };
  }

  quotaOf(tenantId: string): TenantQuota | undefined {
    this.reload();
    return this.byTenant.get(tenantId)?.quotas;
  }

  idleTimeoutOf(tenantId: string): number | undefined {
    this.reload();
    return this.byTenant.get(tenantId)?.idleTimeoutMs;
  }

  rateOf(tenantId: string): RateSpec | undefined {
    return this.byTenant.get(tenantId)?.rate ?? this.defaultRate;
  }
}

export interface MintOptions {
  tenant: string;
  admin?: boolean;
  name?: string;
  quotas?: { sandboxes?: number; memory_mib?: number; snapshot_bytes?: number };
  rate?: { per_s: number; burst?: number };
}

/** What `forkfleet token ls` shows of a tokens file entry (never the token, which is not stored). */
export interface TokenListing {
  id: string;
  tenant: string;
  name: string;
  admin: boolean;
}

function listingOf(e: TokenEntry): TokenListing {
  return { id: credentialIdOf(e.digest), tenant: e.tenant, name: e.name, admin: e.admin };
}

export function listTokens(path: string): TokenListing[] {
  return parseTokensFile(readFileSync(path, 'utf8'), path).map(listingOf);
}

/**
 * Removes from the tokens file every entry whose credential id (or longer digest prefix, at
 * least 12 hex digits) or name is `which`, and returns them; none is NotFoundError. The file
 * is replaced atomically, under its lock; each scheduler refuses the removed tokens, and ends
 * their open streaming calls, within about a second.
 */
export function revokeTokens(path: string, which: string): TokenListing[] {
  return updateTokensFile(path, 'fail', (doc, entries) => {
    const hit = (e: TokenEntry): boolean => (/^[0-9a-f]{12,64}$/.test(which) && e.digest.toString('hex').startsWith(which)) || (e.name !== '' && e.name === which);
    const gone = entries.filter(hit);
    if (gone.length === 0) throw new ForkfleetError('not_found', `no token in ${path} has the id or name ${JSON.stringify(which)} (forkfleet token ls lists them)`);
    doc.tokens = doc.tokens.filter((_, i) => !hit(entries[i]!));
    return gone.map(listingOf);
  });
}

/**
 * How long a mint or revoke waits for another one's lock, and the age at which a lock is taken
 * for abandoned: the wait outlasts that age, so a lock left by a writer on another host (whose
 * pid cannot be checked from here) is taken over rather than failing every call until then.
 */
const LOCK_STALE_MS = 30_000;
const LOCK_WAIT_MS = LOCK_STALE_MS + 5_000;

function sleepSync(ms: number): void {
  Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);
}

/** What the lock file `lock` holds ("<pid> <host>"), or '' (gone, or not yet written). */
function holderOf(lock: string): string {
  try {
    return readFileSync(lock, 'utf8').trim();
  } catch {
    return '';
  }
}

/**
 * Whether the lock file `lock` was left by a writer that is gone: its pid (on this host) is no
 * longer alive, or it is older than LOCK_STALE_MS (no writer holds it more than milliseconds).
 * A lock just created, before its holder wrote its pid, is not stale until that age.
 */
function staleLock(lock: string, st: { mtimeMs: number }): boolean {
  if (Date.now() - st.mtimeMs > LOCK_STALE_MS) return true;
  const holder = holderOf(lock).split(' ');
  const pid = Number(holder[0]);
  if (!Number.isSafeInteger(pid) || pid <= 0 || holder[1] !== hostname()) return false;
  try {
    process.kill(pid, 0);
    return false;
  } catch (e) {
    // EPERM: alive, another user's (a root CLI while this one is not).
    return (e as NodeJS.ErrnoException).code === 'ESRCH';
  }
}

/**
 * Takes `<path>.lock` (created exclusively, holding "<pid> <host>"), waiting with a short
 * backoff up to LOCK_WAIT_MS for another writer's, and taking over a stale one; returns the
 * inode of the lock it holds, for releaseLock.
 */
function takeLock(path: string): number {
  const lock = `${path}.lock`;
  const deadline = Date.now() + LOCK_WAIT_MS;
  for (let wait = 2; ; wait = Math.min(wait * 2, 50)) {
    let fd: number | undefined;
    try {
      fd = openSync(lock, 'wx', 0o600);
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code !== 'EEXIST') throw e;
    }
    if (fd !== undefined) {
      try {
        writeSync(fd, `${process.pid} ${hostname()}\n`);
        return fstatSync(fd).ino;
      } catch (e) {
        rmSync(lock, { force: true });
        throw e;
      } finally {
        closeSync(fd);
      }
    }
    let st: { mtimeMs: number; ino: number } | undefined;
    try {
      st = statSync(lock);
    } catch {
      continue; // released meanwhile
    }
    if (staleLock(lock, st)) {
      // Moved aside rather than removed: another waiter may have taken it over already, and
      // its fresh lock (another inode) is put back instead of removed.
      const aside = `${lock}.${process.pid}.stale`;
      try {
        renameSync(lock, aside);
      } catch {
        continue;
      }
      if (statSync(aside).ino !== st.ino) {
        try {
          linkSync(aside, lock);
        } catch {
          // Someone took the lock meanwhile; the one moved aside is its holder's still.
        }
      }
      rmSync(aside, { force: true });
      continue;
    }
    if (Date.now() >= deadline) {
      throw new ForkfleetError('unavailable', `${lock} is held by another forkfleet token mint or revoke (${holderOf(lock) || 'pid not yet written'}); retry, or remove the file if that process is gone`);
    }
    sleepSync(wait);
  }
}

/** Removes the lock `takeLock` returned `ino` for, unless another writer took it over meanwhile. */
function releaseLock(path: string, ino: number): void {
  const lock = `${path}.lock`;
  try {
    if (statSync(lock).ino === ino) rmSync(lock);
  } catch {
    // Gone already.
  }
}

/**
 * Reads the tokens file under its lock, lets `mutate` change its document (`entries` parsed
 * from it, index for index), writes it back and returns what `mutate` returned. Read under
 * the lock: a mint or revoke that read it before another one wrote would write back the old
 * list, dropping the other's new token or restoring the token it revoked. A missing file is
 * an empty one (`ifMissing` 'create') or the read's error ('fail'). `mutate` throwing writes
 * nothing.
 */
function updateTokensFile<T>(path: string, ifMissing: 'create' | 'fail', mutate: (doc: { tokens: unknown[] }, entries: TokenEntry[]) => T): T {
  const ino = takeLock(path);
  try {
    const text = ifMissing === 'create' && !existsSync(path) ? '{"tokens": []}' : readFileSync(path, 'utf8');
    const entries = parseTokensFile(text, path);
    const doc = JSON.parse(text) as { tokens: unknown[] };
    const result = mutate(doc, entries);
    writeTokensFile(path, doc);
    return result;
  } finally {
    releaseLock(path, ino);
  }
}

/**
 * Writes a tokens file through a temporary file and a rename, after checking the scheduler
 * would take it. A file it replaces keeps its mode, owner and group: the scheduler reading it
 * may run as another user (the rendered unit's DynamicUser reads a 0644 root-owned file), and a
 * replacement only the CLI's user could read was a revocation the scheduler never took. A new
 * file is 0600 (it holds digests only, but names every tenant).
 */
function writeTokensFile(path: string, doc: { tokens: unknown[] }): void {
  const text = `${JSON.stringify(doc, null, 2)}\n`;
  parseTokensFile(text, path); // never write a file the scheduler would refuse
  const old = existsSync(path) ? statSync(path) : undefined;
  const tmp = `${path}.${process.pid}.tmp`;
  try {
    writeFileSync(tmp, text, { mode: old ? old.mode & 0o7777 : 0o600 });
    if (old && (old.uid !== process.getuid?.() || old.gid !== process.getgid?.())) chownSync(tmp, old.uid, old.gid);
    renameSync(tmp, path);
  } catch (e) {
    rmSync(tmp, { force: true });
    throw e;
  }
}

/**
 * Appends a new token's digest to the tokens file (created mode 0600 when missing; replaced
 * atomically, under its lock) and returns the token: the only time it exists in clear.
 */
export function mintToken(path: string, o: MintOptions): string {
  const token = newToken();
  const raw = { tenant: o.tenant, token_sha256: sha256(token).toString('hex'), ...(o.admin ? { admin: true } : {}), ...(o.name ? { name: o.name } : {}), ...(o.quotas ? { quotas: o.quotas } : {}), ...(o.rate ? { rate: o.rate } : {}) };
  updateTokensFile(path, 'create', (doc) => {
    doc.tokens.push(raw);
  });
  if (!TOKEN_RE.test(token)) throw new Error('minted a malformed token');
  return token;
}
