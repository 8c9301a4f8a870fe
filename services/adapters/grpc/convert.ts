// Validation and conversion between the generated API types and the domain's inputs and
// records. Every field is checked here; a bad one is INVALID_ARGUMENT naming the field.
import { create } from '@bufbuild/protobuf';
import type { MessageInitShape } from '@bufbuild/protobuf';
import type { Duration, DurationSchema, Timestamp } from '@bufbuild/protobuf/wkt';
import { timestampFromMs } from '@bufbuild/protobuf/wkt';
import { InvalidArgumentError } from '../../../proto/errors.ts';
import { IMAGE_NAMES } from '../../../deploy/images/names.ts';
import { Locality, Spread, Accel } from '../../../proto/gen/forkfleet/v1/common_pb.ts';
import type { Lifecycle, NetworkPolicy, PlacementPreference, Resources, ResourcesSchema } from '../../../proto/gen/forkfleet/v1/common_pb.ts';
import {
  HostSchema,
  HostState as PbHostState,
  OperationKind as PbOpKind,
  OperationSchema,
  OperationState as PbOpState,
  OperationStepSchema,
  OperationStepState as PbStepState,
  EventSchema,
  EventType as PbEventType,
  SandboxSchema,
  SandboxState as PbSandboxState,
  SnapshotSchema,
  SnapshotState as PbSnapshotState,
} from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { Event, Host, Operation, OperationStep, Sandbox, Snapshot } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { FleetEvent, FleetEventType } from '../../domain/events.ts';
import type { HookRec, HostAllocRec, HostRec, OperationRec, ResourcesRec, SandboxRec, SandboxState, SnapshotRec, StepRec } from '../../domain/records.ts';
import { TENANT_ID_RE } from '../../domain/records.ts';
import type { PlacementPrefs } from '../../domain/fleet.ts';
import { runningMs } from '../../domain/fleet.ts';
import { asciiOnly } from './status.ts';

export const LIMITS = {
  maxForkCount: 256,
  maxVcpus: 64,
  minMemoryMib: 64,
  maxMemoryMib: 262_144,
  maxDiskMib: 1_048_576,
  defaultDiskMib: 1024,
  maxLabels: 64,
  maxArgv: 256,
  maxArgBytes: 4096,
  maxStdinBytes: 1 << 20,
  maxExecTimeoutMs: 3_600_000,
  defaultExecTimeoutMs: 60_000,
  maxWaitMs: 600_000,
  defaultWaitMs: 60_000,
  maxDurationMs: 10 * 365 * 24 * 3_600_000,
  /** Linux's PATH_MAX (4096) counts the terminating NUL: a path of 4096 bytes fails in the guest (ENAMETOOLONG). */
  maxPathBytes: 4095,
  maxFileBytes: 64 << 20,
  maxReplicas: 8,
  maxKeepLast: 10_000,
  maxHooks: 8,
  /** The after_resume hooks' timeouts together, at most. */
  maxHooksMs: 60_000,
  maxCidrs: 64,
  /** A sandbox's labels as stored (JSON), at most: every child of a fork carries a copy. */
  maxLabelBytes: 4096,
  /** A sandbox's after_resume hooks as stored (JSON), at most: every child of a fork carries a copy. */
  maxHookBytes: 8192,
  maxEnv: 256,
};

/** UTF-8 bytes of `v` as JSON: what a record stores of it. */
export function jsonBytes(v: unknown): number {
  return Buffer.byteLength(JSON.stringify(v));
}

/**
 * The field naming one entry of a client-given map (labels, env), for an error about its key
 * or its value alike: `field["key"]`, the key quoted as JSON in printable ASCII (see asciiOnly),
 * so that any key, valid or not, is named one way and unambiguously.
 */
function mapEntry(field: string, k: string): string {
  return `${field}[${asciiOnly(JSON.stringify(k))}]`;
}

/**
 * The error for a client-given map key that is not a valid one, naming it (mapEntry); a key too
 * long to name whole is named by the map, and the error says its length (a cut-off key would
 * name another key).
 */
function badKey(field: string, k: string, why: string): InvalidArgumentError {
  if (k.length > 64) return new InvalidArgumentError(field, `a key of ${k.length} characters: ${why}`);
  return new InvalidArgumentError(mapEntry(field, k), why);
}

/**
 * Characters text that people read must not have: controls (C0, DEL and C1: U+009B starts a
 * terminal escape as ESC [ does), line and paragraph separators, and format characters
 * (Unicode category Cf: bidi overrides and isolates U+202A-U+202E and U+2066-U+2069, which
 * make a dashboard or CLI show the text reordered; zero-width characters such as U+200B,
 * U+2060 and U+FEFF, which make two values that look alike differ; soft hyphens and the
 * like), except the zero-width non-joiner and joiner (U+200C, U+200D): Persian and Indic
 * words and emoji sequences need them.
 */
const NOT_SHOWN_AS_IS = /[\p{Cc}\p{Zl}\p{Zp}]|(?![\u200c\u200d])\p{Cf}/u;
/** What a label selector's value may not have: controls and separators (it may name values stored before format characters were refused). */
const CONTROL_OR_SEPARATOR = /[\p{Cc}\p{Zl}\p{Zp}]/u;

/**
 * Where `v` has a character of `re`, said as "U+XXXX at [i]" (i counts UTF-16 code units, as
 * JavaScript does), or undefined. Label values are text that dashboards and CLIs print.
 */
function controlIn(v: string, re: RegExp = NOT_SHOWN_AS_IS): string | undefined {
  const m = re.exec(v);
  if (!m) return undefined;
  return `U+${m[0].codePointAt(0)!.toString(16).toUpperCase().padStart(4, '0')} at [${m.index}]`;
}

const KEY_RE = /^[\x21-\x7e]{1,128}$/;
const ID_RE = { sb: /^sb-[a-z2-7]{20}$/, sn: /^sn-[a-z2-7]{20}$/, op: /^op-[a-z2-7]{20}$/ };
const IMAGE_RE = /^[a-z0-9][a-z0-9._-]{0,63}$/;
const HOSTNAME_RE = /^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$/;
const HOST_ID_RE = /^[a-z0-9][a-z0-9-]{0,62}$/;
const LABEL_KEY_RE = /^[a-zA-Z0-9][a-zA-Z0-9._/-]{0,62}$/;

export function tenant(v: string, field = 'tenant_id'): string {
  if (!TENANT_ID_RE.test(v)) throw new InvalidArgumentError(field, 'must be 1-63 characters of a-z, 0-9 and -, starting with a letter or digit');
  return v;
}

export function idemKey(v: string, field = 'idempotency_key'): string {
  if (!KEY_RE.test(v)) throw new InvalidArgumentError(field, 'must be 1-128 printable ASCII characters without spaces');
  // The scheduler submits its own operations (TTL expiry, wake, cancel) under keys that start
  // with "__": a client's key there could stand in for one of them.
  if (v.startsWith('__')) throw new InvalidArgumentError(field, 'must not start with "__" (reserved for the scheduler\'s own operations)');
  return v;
}

export function id(kind: keyof typeof ID_RE, v: string, field: string): string {
  if (!ID_RE[kind].test(v)) throw new InvalidArgumentError(field, `must be an id of the form ${kind}-<20 base32 characters>`);
  return v;
}

export function hostId(v: string, field = 'host_id'): string {
  if (!HOST_ID_RE.test(v)) throw new InvalidArgumentError(field, 'must be a host id (a-z, 0-9, -)');
  return v;
}

function intIn(v: number | bigint, field: string, min: number, max: number): number {
  const n = Number(v);
  if (!Number.isSafeInteger(n) || n < min || n > max) throw new InvalidArgumentError(field, `must be an integer in [${min}, ${max}], got ${String(v)}`);
  return n;
}

export function durationMs(d: Duration | undefined, field: string, opts: { min?: number; max?: number } = {}): number | null {
  if (!d) return null;
  if (d.nanos < -999_999_999 || d.nanos > 999_999_999 || (d.seconds > 0n && d.nanos < 0) || (d.seconds < 0n && d.nanos > 0)) throw new InvalidArgumentError(field, 'is not a valid duration');
  const min = opts.min ?? 0;
  // A negative duration under a millisecond would truncate to 0 (and pass a min of 0).
  if (min >= 0 && (d.seconds < 0n || d.nanos < 0)) throw new InvalidArgumentError(field, `must be between ${min} ms and ${opts.max ?? LIMITS.maxDurationMs} ms`);
  const ms = Number(d.seconds) * 1000 + Math.trunc(d.nanos / 1e6);
  const max = opts.max ?? LIMITS.maxDurationMs;
  if (!Number.isFinite(ms) || ms < min || ms > max) throw new InvalidArgumentError(field, `must be between ${min} ms and ${max} ms`);
  return ms;
}

export function resources(r: Resources | undefined, field = 'resources'): ResourcesRec {
  const vcpus = r?.vcpus ? intIn(r.vcpus, `${field}.vcpus`, 1, LIMITS.maxVcpus) : 1;
  const memoryMib = r?.memoryMib ? intIn(r.memoryMib, `${field}.memory_mib`, LIMITS.minMemoryMib, LIMITS.maxMemoryMib) : 256;
  if (memoryMib % 2 !== 0) throw new InvalidArgumentError(`${field}.memory_mib`, 'must be a multiple of 2');
  const diskMib = r?.diskMib ? intIn(r.diskMib, `${field}.disk_mib`, 1, LIMITS.maxDiskMib) : LIMITS.defaultDiskMib;
  return { vcpus, memoryMib, diskMib };
}

/** Most items in one page of a list (page_size 0 or more: this many). */
export const MAX_PAGE = 1000;

/**
 * The order a list is paged in: by `key`, ascending. A page token is the key of the last item
 * of the page before, base64url-encoded, so a page resumes after it even when items came and
 * went meanwhile; `pattern` is what such a key looks like, `max` the largest page.
 */
export interface PageOrder<T> {
  key(item: T): string;
  pattern: RegExp;
  max: number;
}

/** Sandboxes: in id order. */
export const SANDBOXES_BY_ID: PageOrder<{ id: string }> = { key: (x) => x.id, pattern: ID_RE.sb, max: MAX_PAGE };
/** Snapshots: in id order. */
export const SNAPSHOTS_BY_ID: PageOrder<{ id: string }> = { key: (x) => x.id, pattern: ID_RE.sn, max: MAX_PAGE };

/** Most operations in one page: each fork's children come with it. */
export const MAX_OPERATION_PAGE = 100;
/** Epoch ms that count down in a key that sorts ascending (newest first); good until the year 33658. */
const NEWEST_FIRST = 1e15;

/** Operations: newest first (then by id). */
export const NEWEST_OPERATION_FIRST: PageOrder<OperationRec> = {
  key: (op) => `${String(NEWEST_FIRST - op.createdAt).padStart(15, '0')}.${op.id}`,
  pattern: /^\d{15}\.op-[a-z2-7]{20}$/,
  max: MAX_OPERATION_PAGE,
};

/** The key a page token carries ('' for none); a token this API did not make for this list is INVALID_ARGUMENT. */
export function pageToken(token: string, order: Pick<PageOrder<never>, 'pattern'>, field = 'page_token'): string {
  if (!token) return '';
  const key = Buffer.from(token, 'base64url').toString('utf8');
  if (!order.pattern.test(key) || Buffer.from(key).toString('base64url') !== token) throw new InvalidArgumentError(field, 'not a token this API returned');
  return key;
}

/** One page of `all` (sorted here by the order's key): items after `after`, at most `pageSize` (0: the order's max), and the token for the next page ('' at the end). */
export function page<T extends { id: string }>(
  all: readonly T[],
  pageSize: number,
  after: string,
  order: PageOrder<NoInfer<T>>,
  // What one item costs the answer (a fork operation answers with its children), and the most a
  // page may cost: a page ends before the item that would pass it (it holds one item at least).
  budget?: { weight: (x: NoInfer<T>) => number; max: number },
): { items: T[]; nextPageToken: string } {
  let size = pageSizeOf(pageSize, order);
  const sorted = all.map((x) => ({ x, k: order.key(x) })).sort((a, b) => (a.k < b.k ? -1 : a.k > b.k ? 1 : 0));
  const from = after ? sorted.findIndex((e) => e.k > after) : 0;
  if (budget && from >= 0) {
    let spent = 0;
    for (let i = from; i < Math.min(sorted.length, from + size); i++) {
      spent += budget.weight(sorted[i]!.x);
      if (spent > budget.max && i > from) {
        size = i - from;
        break;
      }
    }
  }
  const items = from < 0 ? [] : sorted.slice(from, from + size);
  const more = from >= 0 && from + size < sorted.length;
  return { items: items.map((e) => e.x), nextPageToken: more ? Buffer.from(items[items.length - 1]!.k).toString('base64url') : '' };
}

/** How many items a page of `order` holds for a request's page_size (0: the order's max). */
export function pageSizeOf(pageSize: number, order: Pick<PageOrder<never>, 'max'>): number {
  return pageSize === 0 ? order.max : Math.min(pageSize, order.max);
}

/** The page token that resumes after `item` (page). */
export function tokenOf<T>(item: T, order: Pick<PageOrder<T>, 'key'>): string {
  return Buffer.from(order.key(item)).toString('base64url');
}

/** Label keys the scheduler sets itself (a hibernation snapshot's sandbox, a migration's snapshot) and acts on. */
export const RESERVED_LABEL_PREFIX = 'forkfleet.io/';

/**
 * Labels to set (`filter` false) or to select by (`filter` true: a reserved key may be
 * asked for, e.g. to list hibernation snapshots, but never set: retention would treat a
 * user's snapshot labelled forkfleet.io/hibernation as a sandbox's hibernation image).
 */
export function labels(m: Record<string, string>, field = 'labels', filter = false): Record<string, string> {
  const entries = Object.entries(m);
  if (entries.length > LIMITS.maxLabels) throw new InvalidArgumentError(field, `at most ${LIMITS.maxLabels} labels`);
  for (const [k, v] of entries) {
    if (!LABEL_KEY_RE.test(k)) throw badKey(field, k, 'label keys are 1-63 characters of a-z, A-Z, 0-9, . _ / -, starting with a letter or digit');
    // In any case: Forkfleet.io/hibernation is no key of a user's either (it reads as the scheduler's).
    if (!filter && k.toLowerCase().startsWith(RESERVED_LABEL_PREFIX)) throw new InvalidArgumentError(mapEntry(field, k), `keys starting ${RESERVED_LABEL_PREFIX} (in any case) are the scheduler's own`);
    if (Buffer.byteLength(v) > 256) throw new InvalidArgumentError(mapEntry(field, k), 'label values are at most 256 bytes');
    const bad = controlIn(v, filter ? CONTROL_OR_SEPARATOR : NOT_SHOWN_AS_IS);
    if (bad) throw new InvalidArgumentError(mapEntry(field, k), `label values must not contain control, format (bidi, zero-width) or separator characters: ${bad}`);
  }
  const bytes = jsonBytes(m);
  if (bytes > LIMITS.maxLabelBytes) throw new InvalidArgumentError(field, `at most ${LIMITS.maxLabelBytes} bytes of keys and values together (as JSON), got ${bytes}`);
  return { ...m };
}

export function placement(p: PlacementPreference | undefined, field = 'placement'): PlacementPrefs {
  const locality = p?.locality ?? Locality.UNSPECIFIED;
  const spread = p?.spread ?? Spread.UNSPECIFIED;
  if (!(locality in Locality)) throw new InvalidArgumentError(`${field}.locality`, 'unknown value');
  if (!(spread in Spread)) throw new InvalidArgumentError(`${field}.spread`, 'unknown value');
  return {
    locality: locality === Locality.SAME_HOST ? 'SAME_HOST' : locality === Locality.CROSS_HOST ? 'CROSS_HOST' : 'ANY',
    spread: spread === Spread.SPREAD ? 'SPREAD' : 'PACK',
    maxPerHost: intIn(p?.maxPerHost ?? 0, `${field}.max_per_host`, 0, LIMITS.maxForkCount),
    hostId: p?.hostId ? hostId(p.hostId, `${field}.host_id`) : '',
  };
}

/** Zero disables; anything else is at least a second (a shorter one would truncate to 0, the opposite). */
function idleTimeout(d: Duration | undefined, field: string): number | null {
  if (!d || (d.seconds === 0n && d.nanos === 0)) return durationMs(d, field);
  return durationMs(d, field, { min: 1000 });
}

export function lifecycle(l: Lifecycle | undefined, field = 'lifecycle'): { ttlMs: number | null; idleTimeoutMs: number | null; afterResume: HookRec[] } {
  const hooks = l?.afterResume ?? [];
  if (hooks.length > LIMITS.maxHooks) throw new InvalidArgumentError(`${field}.after_resume`, `at most ${LIMITS.maxHooks} hooks`);
  // Unset, a hook's timeout is 30 s, or its share of the budget when more hooks share it (so
  // that up to 8 hooks without timeouts stay valid).
  const dflt = Math.min(30_000, Math.floor(LIMITS.maxHooksMs / Math.max(1, hooks.length)));
  const afterResume = hooks.map((h, i) => {
    const f = `${field}.after_resume[${i}]`;
    // The same rules as Exec's argv (a hook is an exec after every resume).
    return { argv: [...argv(h.argv, `${f}.argv`)], timeoutMs: durationMs(h.timeout, `${f}.timeout`, { min: 100, max: LIMITS.maxHooksMs }) ?? dflt };
  });
  const bytes = jsonBytes(afterResume);
  if (bytes > LIMITS.maxHookBytes) throw new InvalidArgumentError(`${field}.after_resume`, `at most ${LIMITS.maxHookBytes} bytes of hooks together (as JSON), got ${bytes}: put a longer script in a file in the guest and run that`);
  // The hooks run inside the resume, wake or restore step, before the sandbox is running:
  // together they must leave that step (and a call waiting on a wake) time of its own.
  const totalMs = afterResume.reduce((t, h) => t + h.timeoutMs, 0);
  if (totalMs > LIMITS.maxHooksMs) throw new InvalidArgumentError(`${field}.after_resume`, `the hooks' timeouts add up to ${totalMs} ms (${dflt} each when unset); at most ${LIMITS.maxHooksMs} ms together: they run inside every resume, wake and restore`);
  return {
    ttlMs: durationMs(l?.ttl, `${field}.ttl`, { min: 1000 }),
    idleTimeoutMs: idleTimeout(l?.idleTimeout, `${field}.idle_timeout`),
    afterResume,
  };
}

const IPV4_CIDR = /^(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(\.(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)){3}\/(3[0-2]|[12]?\d)$/;

/** The sandbox's egress policy: off unless allowed; allowed CIDRs are IPv4 (the guest NIC has no IPv6). */
export function network(n: NetworkPolicy | undefined, field = 'network'): { allowEgress: boolean; allowCidrs: string[] } {
  const cidrs = n?.allowCidrs ?? [];
  if (cidrs.length > LIMITS.maxCidrs) throw new InvalidArgumentError(`${field}.allow_cidrs`, `at most ${LIMITS.maxCidrs} entries`);
  // A network's address with host bits set is refused, not masked: the agent would allow the
  // whole network (10.1.2.3/8 is 10.0.0.0/8 to nftables), which its writer may not have meant.
  // Every entry is then a network in one spelling, and a duplicate is one of the same value.
  const seen = new Map<string, number>();
  cidrs.forEach((c, i) => {
    if (!IPV4_CIDR.test(c)) throw new InvalidArgumentError(`${field}.allow_cidrs[${i}]`, `must be an IPv4 CIDR such as 203.0.113.0/24, got ${JSON.stringify(c.slice(0, 64))}`);
    const [addr, bits] = c.split('/') as [string, string];
    const value = addr.split('.').reduce((a, o) => a * 256 + Number(o), 0);
    const size = 2 ** (32 - Number(bits));
    const network = value - (value % size);
    const canonical = `${[24, 16, 8, 0].map((sh) => Math.floor(network / 2 ** sh) % 256).join('.')}/${Number(bits)}`;
    if (network !== value) throw new InvalidArgumentError(`${field}.allow_cidrs[${i}]`, `${c} has host bits set; did you mean ${canonical}?`);
    const first = seen.get(canonical);
    if (first !== undefined) throw new InvalidArgumentError(`${field}.allow_cidrs[${i}]`, `${c} is listed twice (first at [${first}])`);
    seen.set(canonical, i);
  });
  if (cidrs.length && !n?.allowEgress) throw new InvalidArgumentError(`${field}.allow_cidrs`, 'needs allow_egress: egress is off unless allowed');
  return { allowEgress: n?.allowEgress ?? false, allowCidrs: [...cidrs] };
}

export function hostname(v: string, field = 'hostname'): string {
  if (v && !HOSTNAME_RE.test(v)) throw new InvalidArgumentError(field, 'must be an RFC 1123 label: 1-63 characters of a-z, 0-9 and -');
  return v;
}

export function image(v: string, field = 'image'): string {
  if (!IMAGE_RE.test(v)) throw new InvalidArgumentError(field, 'must be an image name such as "tiny" or "debian"');
  // Checked here, not when a host fails to build it after the sandbox's records are written.
  if (!(IMAGE_NAMES as readonly string[]).includes(v)) throw new InvalidArgumentError(field, `unknown image ${JSON.stringify(v)}; hosts build ${IMAGE_NAMES.join(', ')}`);
  return v;
}

/** An absolute guest path without NUL, `..` segments or empty segments. */
export function guestPath(v: string, field = 'path'): string {
  if (!v.startsWith('/')) throw new InvalidArgumentError(field, 'must be an absolute path');
  if (Buffer.byteLength(v) > LIMITS.maxPathBytes) throw new InvalidArgumentError(field, `must be at most ${LIMITS.maxPathBytes} bytes`);
  if (v.includes('\0')) throw new InvalidArgumentError(field, 'must not contain NUL');
  const segs = v.split('/').slice(1);
  if (segs.some((s) => s === '..' || s === '.')) throw new InvalidArgumentError(field, 'must not contain . or .. segments');
  if (v.length > 1 && segs.some((s) => s === '')) throw new InvalidArgumentError(field, 'must not contain empty segments');
  if (segs.some((s) => Buffer.byteLength(s) > NAME_MAX)) throw new InvalidArgumentError(field, `each path segment must be at most ${NAME_MAX} bytes`);
  return v;
}

/** The longest file name Linux file systems take. */
const NAME_MAX = 255;

/**
 * What WriteFile adds to a file's name while it stages it beside the file (`.NAME.ff-write-`
 * and 12 hex digits, services/domain/fleet.ts): a name longer than NAME_MAX less this would
 * fail in the guest, and only for a file large enough to be staged.
 */
export const WRITE_STAGING_NAME_BYTES = 23;

/** A file in the guest (ReadFile, WriteFile): a guest path that names a file, not the root. */
export function guestFilePath(v: string, field = 'path', writing = false): string {
  guestPath(v, field);
  if (v === '/') throw new InvalidArgumentError(field, 'must name a file, not a directory');
  const name = v.slice(v.lastIndexOf('/') + 1);
  if (writing && Buffer.byteLength(name) > NAME_MAX - WRITE_STAGING_NAME_BYTES) throw new InvalidArgumentError(field, `a file written through the API has a name of at most ${NAME_MAX - WRITE_STAGING_NAME_BYTES} bytes (it is staged beside itself under a longer one)`);
  // The staged file's path is as much longer: refused before the upload, not after it.
  if (writing && Buffer.byteLength(v) > LIMITS.maxPathBytes - WRITE_STAGING_NAME_BYTES) throw new InvalidArgumentError(field, `a file written through the API has a path of at most ${LIMITS.maxPathBytes - WRITE_STAGING_NAME_BYTES} bytes (it is staged beside itself under a longer one)`);
  return v;
}

export function argv(v: string[], field = 'argv'): string[] {
  if (v.length === 0) throw new InvalidArgumentError(field, 'must name a command');
  if (v.length > LIMITS.maxArgv) throw new InvalidArgumentError(field, `at most ${LIMITS.maxArgv} arguments`);
  v.forEach((a, i) => {
    if (Buffer.byteLength(a) > LIMITS.maxArgBytes) throw new InvalidArgumentError(`${field}[${i}]`, `at most ${LIMITS.maxArgBytes} bytes`);
    if (a.includes('\0')) throw new InvalidArgumentError(`${field}[${i}]`, 'must not contain NUL');
  });
  if (!v[0]) throw new InvalidArgumentError(`${field}[0]`, 'must not be empty');
  return v;
}

export function env(m: Record<string, string>, field = 'env'): Record<string, string> {
  const entries = Object.entries(m);
  if (entries.length > LIMITS.maxEnv) throw new InvalidArgumentError(field, `at most ${LIMITS.maxEnv} variables`);
  // Values are bytes the guest's command gets, not text shown to people: only NUL, which an
  // environment entry cannot hold, is refused (as in argv).
  for (const [k, val] of entries) {
    if (!/^[A-Za-z_][A-Za-z0-9_]{0,127}$/.test(k)) throw badKey(field, k, 'names are 1-128 characters of A-Z, a-z, 0-9 and _, not starting with a digit');
    // The guest exec wrapper's own names (host-agent/adapters/guest/client.ts RESERVED_ENV_PREFIXES): the agent would refuse them too, later.
    if (k.startsWith('_ff_') || k.startsWith('FFE_')) throw badKey(field, k, 'names starting _ff_ or FFE_ are reserved for the guest exec wrapper');
    if (val.includes('\0') || Buffer.byteLength(val) > LIMITS.maxArgBytes) throw new InvalidArgumentError(mapEntry(field, k), 'value must be at most 4096 bytes without NUL');
  }
  return { ...m };
}

// ------------------------------------------------------------------ to proto

const SB_STATE: Record<SandboxState, PbSandboxState> = {
  pending: PbSandboxState.PENDING,
  starting: PbSandboxState.STARTING,
  running: PbSandboxState.RUNNING,
  paused: PbSandboxState.PAUSED,
  hibernating: PbSandboxState.HIBERNATING,
  hibernated: PbSandboxState.HIBERNATED,
  waking: PbSandboxState.WAKING,
  destroying: PbSandboxState.DESTROYING,
  destroyed: PbSandboxState.DESTROYED,
  failed: PbSandboxState.FAILED,
  lost: PbSandboxState.LOST,
};

/**
 * A repeated enum filter (states, kinds, event types), each entry read by `one`: a value given
 * twice is refused naming it, so the list is never longer than the enum. A 4 MiB request of one
 * value repeated ~4 million times cost seconds of the replica's event loop (each entry read,
 * then every record of the tenant matched against all of them), stalling every tenant.
 */
export function enumFilter<P, T>(values: readonly P[], field: string, one: (v: P, field: string) => T): T[] {
  const seen = new Set<P>();
  return values.map((v, i) => {
    if (seen.has(v)) throw new InvalidArgumentError(`${field}[${i}]`, `${String(v)} is given twice`);
    seen.add(v);
    return one(v, `${field}[${i}]`);
  });
}

export function sandboxState(s: PbSandboxState, field: string): SandboxState {
  const found = (Object.entries(SB_STATE) as [SandboxState, PbSandboxState][]).find(([, v]) => v === s);
  if (!found) throw new InvalidArgumentError(field, `unknown sandbox state ${s}`);
  return found[0];
}

function ts(ms: number): Timestamp {
  return timestampFromMs(ms);
}

/** A Duration of milliseconds, for answers. */
export function durationOfMs(ms: number): MessageInitShape<typeof DurationSchema> {
  return { seconds: BigInt(Math.floor(ms / 1000)), nanos: Math.round((ms % 1000) * 1e6) };
}

function pbResources(r: ResourcesRec): MessageInitShape<typeof ResourcesSchema> {
  return { vcpus: r.vcpus, memoryMib: BigInt(r.memoryMib), diskMib: BigInt(r.diskMib) };
}

export function toSandbox(sb: SandboxRec, now: number): Sandbox {
  return create(SandboxSchema, {
    id: sb.id,
    tenantId: sb.tenantId,
    state: SB_STATE[sb.state],
    stateReason: sb.stateReason,
    hostId: sb.hostId,
    resources: pbResources(sb.resources),
    image: sb.image,
    sourceSnapshotId: sb.sourceSnapshotId,
    lineageId: sb.lineageId,
    hostname: sb.hostname,
    labels: sb.labels,
    lifecycle: {
      ...(sb.ttlMs !== null ? { ttl: durationOfMs(sb.ttlMs) } : {}),
      ...(sb.idleTimeoutMs !== null ? { idleTimeout: durationOfMs(sb.idleTimeoutMs) } : {}),
    },
    network: { allowEgress: sb.allowEgress, allowCidrs: sb.allowCidrs ?? [] },
    createdAt: ts(sb.createdAt),
    updatedAt: ts(sb.updatedAt),
    runningTime: durationOfMs(runningMs(sb, now)),
    hibernationSnapshotId: sb.hibernationSnapshotId,
  });
}

const SN_STATE: Record<SnapshotRec['state'], PbSnapshotState> = {
  creating: PbSnapshotState.CREATING,
  ready: PbSnapshotState.READY,
  deleting: PbSnapshotState.DELETING,
  deleted: PbSnapshotState.DELETED,
  failed: PbSnapshotState.FAILED,
};

/**
 * When retention will delete the snapshot: the announced time once it is expiring (keep_last
 * or TTL, ADR 0011), else its TTL's end while that is ahead; unset when neither applies, and for a pinned one
 * (never deleted by retention; an announcement made before the pin stays in the record until
 * the next pass withdraws it).
 */
function expiresAt(sn: SnapshotRec, now: number): { expiresAt?: Timestamp } {
  if (sn.pinned) return {};
  if (sn.expiryDueAt !== undefined && sn.expiryDueAt !== null) return { expiresAt: ts(sn.expiryDueAt) };
  // A TTL's end already past with no announcement: sandboxes use it (retention deletes none in
  // use, and withdrew any announcement), or the next pass is about to announce it with its
  // notice. Either way not then: a time in the past read as a deletion that never came.
  const end = sn.retentionTtlMs !== null ? sn.createdAt + sn.retentionTtlMs : undefined;
  return end !== undefined && end > now ? { expiresAt: ts(end) } : {};
}

/** `now`: for expires_at (a TTL's end already past is not shown). */
export function toSnapshot(sn: SnapshotRec, now = Date.now()): Snapshot {
  return create(SnapshotSchema, {
    id: sn.id,
    tenantId: sn.tenantId,
    state: SN_STATE[sn.state],
    sourceSandboxId: sn.sourceSandboxId,
    parentSnapshotId: sn.parentSnapshotId,
    lineageId: sn.lineageId,
    createdAt: ts(sn.createdAt),
    pinned: sn.pinned,
    retention: { ...(sn.retentionTtlMs !== null ? { ttl: durationOfMs(sn.retentionTtlMs) } : {}), keepLast: sn.keepLast },
    ...expiresAt(sn, now),
    logicalBytes: BigInt(sn.logicalBytes),
    storedBytes: BigInt(sn.storedBytes),
    hostIds: sn.hostIds,
    ...(sn.vmConfig
      ? {
          vmConfig: {
            machine: sn.vmConfig.machine,
            memoryMib: BigInt(sn.vmConfig.memoryMib),
            vcpus: sn.vmConfig.vcpus,
            devices: sn.vmConfig.devices,
            qemuVersion: sn.vmConfig.qemuVersion,
            accel: sn.vmConfig.accel === 'kvm' ? Accel.KVM : Accel.TCG,
            cpuModel: sn.vmConfig.cpuModel,
            image: sn.vmConfig.image,
            imageDigest: sn.vmConfig.imageRecipeHash ?? '',
            imageDiskSha256: sn.vmConfig.imageDiskSha256 ?? '',
          },
        }
      : {}),
    labels: sn.labels,
  });
}

const OP_KIND: Record<OperationRec['kind'], PbOpKind> = {
  create: PbOpKind.CREATE,
  pause: PbOpKind.PAUSE,
  resume: PbOpKind.RESUME,
  hibernate: PbOpKind.HIBERNATE,
  wake: PbOpKind.WAKE,
  snapshot: PbOpKind.SNAPSHOT,
  fork: PbOpKind.FORK,
  destroy: PbOpKind.DESTROY,
  delete_snapshot: PbOpKind.DELETE_SNAPSHOT,
  drain: PbOpKind.DRAIN,
};

const OP_STATE: Record<OperationRec['state'], PbOpState> = {
  pending: PbOpState.PENDING,
  running: PbOpState.RUNNING,
  succeeded: PbOpState.SUCCEEDED,
  failed: PbOpState.FAILED,
  cancelled: PbOpState.CANCELLED,
};

/** A requested operation state; UNSPECIFIED or an unknown number is INVALID_ARGUMENT naming the field. */
export function operationState(s: PbOpState, field: string): OperationRec['state'] {
  const found = (Object.entries(OP_STATE) as [OperationRec['state'], PbOpState][]).find(([, v]) => v === s);
  if (!found) throw new InvalidArgumentError(field, `unknown operation state ${s}`);
  return found[0];
}

/** A requested operation kind; UNSPECIFIED or an unknown number is INVALID_ARGUMENT naming the field. */
export function operationKind(k: PbOpKind, field: string): OperationRec['kind'] {
  const found = (Object.entries(OP_KIND) as [OperationRec['kind'], PbOpKind][]).find(([, v]) => v === k);
  if (!found) throw new InvalidArgumentError(field, `unknown operation kind ${k}`);
  return found[0];
}

/** Operations whose answer shows their snapshot (Operation.result.snapshot); the others show their sandboxes. */
export const SNAPSHOT_RESULT_KINDS: ReadonlySet<OperationRec['kind']> = new Set(['snapshot', 'delete_snapshot', 'hibernate']);

/** What an operation acts on: a sandbox or snapshot id, or a host id (a drain). */
export function operationTarget(v: string, field: string): string {
  // A host id may look like anything of [a-z0-9-], but not like a malformed sandbox or snapshot id.
  const idLike = /^(sb|sn|op)-/.test(v);
  if (!ID_RE.sb.test(v) && !ID_RE.sn.test(v) && (idLike || !HOST_ID_RE.test(v))) throw new InvalidArgumentError(field, 'must be a sandbox id (sb-...), a snapshot id (sn-...) or a host id');
  return v;
}

export interface OpResultObjects {
  sandboxes: SandboxRec[];
  snapshot: SnapshotRec | undefined;
}

export function toOperation(op: OperationRec, objs: OpResultObjects, now: number): Operation {
  let result: MessageInitShape<typeof OperationSchema>['result'] = { case: undefined };
  if (op.kind === 'fork' && op.result) {
    const ex = op.result.explanation as { examined?: number; filtered?: Record<string, number>; summary?: string; chosen?: Array<{ hostId: string; children: number; lastChild?: { etaMs: number; restoreMs: number; transferMs: number; queueMs: number } }> } | undefined;
    result = {
      case: 'fork',
      value: {
        snapshotId: op.result.snapshotId ?? '',
        children: objs.sandboxes.map((s) => toSandbox(s, now)),
        ...(ex
          ? {
              explanation: {
                hostsConsidered: ex.examined ?? 0,
                filtered: ex.filtered ?? {},
                summary: ex.summary ?? '',
                choices: (ex.chosen ?? []).map((c) => ({
                  hostId: c.hostId,
                  count: c.children,
                  etaMs: c.lastChild?.etaMs ?? 0,
                  restoreMs: c.lastChild?.restoreMs ?? 0,
                  transferMs: c.lastChild?.transferMs ?? 0,
                  queueMs: c.lastChild?.queueMs ?? 0,
                })),
              },
            }
          : {}),
      },
    };
  } else if (objs.snapshot && SNAPSHOT_RESULT_KINDS.has(op.kind)) {
    result = { case: 'snapshot', value: toSnapshot(objs.snapshot, now) };
  } else if (objs.sandboxes[0]) {
    result = { case: 'sandbox', value: toSandbox(objs.sandboxes[0], now) };
  }
  return create(OperationSchema, {
    id: op.id,
    tenantId: op.tenantId,
    kind: OP_KIND[op.kind],
    state: OP_STATE[op.state],
    createdAt: ts(op.createdAt),
    updatedAt: ts(op.updatedAt),
    progress: { done: op.progress.done, total: op.progress.total, message: op.progress.message, bytesTransferred: BigInt(op.progress.bytesTransferred) },
    targetId: op.targetId,
    result,
    ...(op.error ? { error: { kind: op.error.kind, message: op.error.message, retryable: op.error.retryable, field: op.error.field ?? '' } } : {}),
    cancelRequested: op.cancelRequested ?? false,
    steps: toSteps(op.steps),
    stepsOmitted: op.stepsOmitted ?? 0,
  });
}

const STEP_STATE: Record<StepRec['status'], PbStepState> = { sent: PbStepState.RUNNING, done: PbStepState.SUCCEEDED, failed: PbStepState.FAILED };

/** An op's step log in the order the steps were first sent (a step an earlier leader sent, with no send time, by its answer). */
export function toSteps(steps: OperationRec['steps']): OperationStep[] {
  const at = (s: StepRec): number => s.sentAt ?? s.endedAt ?? Number.MAX_SAFE_INTEGER;
  return Object.entries(steps)
    .sort(([a, x], [b, y]) => at(x) - at(y) || (a < b ? -1 : a > b ? 1 : 0))
    .map(([stepId, s]) => create(OperationStepSchema, {
      stepId,
      hostId: s.hostId,
      action: s.action ?? '',
      state: STEP_STATE[s.status],
      attempt: s.attempt,
      ...(s.sentAt !== undefined ? { sentAt: ts(s.sentAt) } : {}),
      ...(s.endedAt !== undefined ? { finishedAt: ts(s.endedAt) } : {}),
      ...(s.hostMs !== undefined ? { hostDuration: durationOfMs(s.hostMs) } : {}),
      ...(s.pauseMs !== undefined ? { pause: durationOfMs(s.pauseMs) } : {}),
      bytesFetched: BigInt(s.bytesFetched ?? 0),
      restoredByMigration: s.migrated ?? false,
    }));
}

const HOST_STATE: Record<HostRec['state'], PbHostState> = { ready: PbHostState.READY, suspect: PbHostState.SUSPECT, lost: PbHostState.LOST };

export function hostState(s: PbHostState, field: string): HostRec['state'] {
  const found = (Object.entries(HOST_STATE) as [HostRec['state'], PbHostState][]).find(([, v]) => v === s);
  if (!found) throw new InvalidArgumentError(field, `unknown host state ${s}`);
  return found[0];
}

export function toHost(h: HostRec, alloc: HostAllocRec | undefined, live: { state: HostRec['state']; snapshotCount: number; lastHeartbeatAt: number; memoryUsedBytes: number; chunkStoreBytes: number } | undefined): Host {
  return create(HostSchema, {
    id: h.id,
    state: HOST_STATE[live?.state ?? h.state],
    cordoned: h.cordoned,
    draining: h.draining,
    capacity: pbResources(h.capacity),
    allocated: pbResources(alloc?.allocated ?? { vcpus: 0, memoryMib: 0, diskMib: 0 }),
    sandboxCount: alloc?.sandboxes ?? 0,
    snapshotCount: live?.snapshotCount ?? 0,
    accel: h.accel === 'kvm' ? Accel.KVM : Accel.TCG,
    qemuVersion: h.qemuVersion,
    cpuModel: h.cpuModel,
    peerAddress: h.peerAddress,
    lastHeartbeat: ts(live?.lastHeartbeatAt ?? h.lastHeartbeatAt),
    labels: h.labels,
    linkBytesPerSecond: BigInt(h.linkBytesPerSecond),
    memoryUsedBytes: BigInt(live?.memoryUsedBytes ?? 0),
    chunkStoreBytes: BigInt(live?.chunkStoreBytes ?? 0),
  });
}

const EVENT_TYPE: Record<FleetEventType, PbEventType> = {
  sandbox_created: PbEventType.SANDBOX_CREATED,
  sandbox_state_changed: PbEventType.SANDBOX_STATE_CHANGED,
  sandbox_destroyed: PbEventType.SANDBOX_DESTROYED,
  snapshot_created: PbEventType.SNAPSHOT_CREATED,
  sandbox_restored: PbEventType.SANDBOX_RESTORED,
  sandbox_hibernated: PbEventType.SANDBOX_HIBERNATED,
  sandbox_woken: PbEventType.SANDBOX_WOKEN,
  snapshot_expiring: PbEventType.SNAPSHOT_EXPIRING,
  snapshot_expired: PbEventType.SNAPSHOT_EXPIRED,
  operation_done: PbEventType.OPERATION_DONE,
  snapshot_expiry_withdrawn: PbEventType.SNAPSHOT_EXPIRY_WITHDRAWN,
};

export function toEvent(e: FleetEvent): Event {
  return create(EventSchema, {
    revision: BigInt(e.revision),
    type: EVENT_TYPE[e.type],
    tenantId: e.tenantId,
    time: timestampFromMs(e.time),
    sandboxId: e.sandboxId,
    snapshotId: e.snapshotId,
    hostId: e.hostId,
    operationId: e.operationId,
    sandboxState: e.sandboxState ? SB_STATE[e.sandboxState] : PbSandboxState.UNSPECIFIED,
    message: e.message,
  });
}
