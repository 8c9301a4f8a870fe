// The `forkfleet` command line: npm run forkfleet -- <command> [...]
// Every command takes --json (one JSON document on stdout), --api host:port and --tenant.
// Talks to the fleet through the SDK (services/sdk); `fleet` commands drive deploy/fleet.
import { spawn, spawnSync } from 'node:child_process';
import { fstatSync, readFileSync, readSync, writeFileSync } from 'node:fs';
import { resolve } from 'node:path';
import { Command, CommanderError, Option } from 'commander';
import { execNeverStarted, Forkfleet, ForkfleetError, newIdempotencyKey, OperationFailedError, operationIdOf, parseDuration, RpcError } from '../sdk/index.ts';
import type { CallOpts, EventInfo, HostInfo, OperationInfo, OperationKindName, OperationStateName, SandboxInfo, SandboxStateName, SnapshotInfo } from '../sdk/index.ts';
import { OPERATION_KINDS, OPERATION_STATES, SANDBOX_STATES } from '../sdk/index.ts';
import { defaultApi, EXIT, exitCodeFor, hintFor } from './hints.ts';
import { EVENT_TYPES } from '../domain/events.ts';
import { LIMITS } from '../adapters/grpc/convert.ts';
import { enterUserCwd } from '../../deploy/user-cwd.ts';
import { defaultFleetDir } from '../auth/client-credentials.ts';

const ROOT = resolve(import.meta.dirname, '..', '..');

interface Globals {
  api: string;
  tenant: string;
  credentials?: string;
  json: boolean;
  timeout?: string;
  idempotencyKey?: string;
}

/**
 * What one invocation (one program from buildProgram, one main() call) holds: its client, the
 * idempotency key its mutating calls share, and the exit code a command chose. Kept per
 * program, so that a second main() in the same process (a test, a wrapper) starts afresh:
 * not with the first one's closed client, key or exit code.
 */
interface Invocation {
  client?: Forkfleet;
  key?: string;
  exitCode?: number;
  /** The operations this run waits on now (an interrupt names them): their label, key, and id once accepted. */
  waits: Set<Waiting>;
  /** What SIGINT does while `waits` is not empty (main sets it); otherwise SIGINT is left as it is. */
  onInterrupt?: () => void;
  /** A progress line is drawn on the terminal (stderr), not yet ended with a newline. */
  progressDrawn?: boolean;
  /** --json: what an exec printed before its stream broke off (the error document carries it). */
  execOutput?: { stdout: string; stderr: string };
  /**
   * The key (or base of the per-target keys) this run's mutating calls were sent with: the one
   * an error or an interrupt offers to repeat the command with. Unset for a command that sends
   * none (exec, cp, reads), --idempotency-key or not: repeating it with the key does not make
   * it run at most once.
   */
  keySent?: string;
  /** `loadtest`: the words after it, as given (main() keeps them from commander: splitLine). */
  loadtestArgs?: string[];
}
interface Waiting {
  label: string;
  /** The key it was submitted with (a wait on an operation named by id has none). */
  key?: string;
  opId?: string;
}
const invocations = new WeakMap<Command, Invocation>();
function invocation(cmd: Command): Invocation {
  let root = cmd;
  while (root.parent) root = root.parent;
  let inv = invocations.get(root);
  if (!inv) invocations.set(root, (inv = { waits: new Set() }));
  return inv;
}

function globals(cmd: Command): Globals {
  return cmd.optsWithGlobals() as Globals;
}
function client(cmd: Command): Forkfleet {
  const g = globals(cmd);
  const inv = invocation(cmd);
  // TLS; token and CA from --credentials, FF_TOKEN / FF_CA, FF_CREDENTIALS or the local fleet's credentials.json.
  // A fleet that cannot be reached fails the command after the attempts (~3 s, exit 69, with the
  // key to repeat it), not after the SDK's WAIT_UNREACHABLE_MS: a person is waiting.
  inv.client ??= new Forkfleet({ address: g.api, retry: { unreachableWaitMs: 0 }, ...(g.tenant ? { tenant: g.tenant } : {}), ...(g.credentials ? { credentialsFile: g.credentials } : {}) });
  return inv.client;
}

const isTty = (): boolean => Boolean(process.stderr.isTTY);

function out(cmd: Command, data: unknown, human: () => string): void {
  if (globals(cmd).json) process.stdout.write(`${JSON.stringify(data, null, 2)}\n`);
  else process.stdout.write(human());
}

/**
 * Writes `data` and, when the stream's buffer is full (a slow reader of a pipe), waits until
 * it has drained (or the stream failed or closed): streamed output (exec, events) is held
 * back at its source, not buffered here without bound.
 */
export async function writeOut(s: NodeJS.WritableStream, data: string | Uint8Array): Promise<void> {
  if (s.write(data)) return;
  await new Promise<void>((res) => {
    const done = (): void => {
      s.off('drain', done);
      s.off('error', done);
      s.off('close', done);
      res();
    };
    s.once('drain', done);
    s.once('error', done);
    s.once('close', done);
  });
}

function fmtBytes(n: number): string {
  if (n < 1024) return `${n} B`;
  const u = ['KiB', 'MiB', 'GiB', 'TiB'];
  let v = n / 1024;
  let i = 0;
  while (v >= 1024 && i < u.length - 1) {
    v /= 1024;
    i++;
  }
  return `${v.toFixed(1)} ${u[i]}`;
}

/** 95ms, 12s, 3m20s, 2h5m: a duration for a person. */
function fmtMs(ms: number): string {
  if (ms < 1000) return `${Math.round(ms)}ms`;
  const s = Math.floor(ms / 1000);
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m${s % 60 ? `${s % 60}s` : ''}`;
  return `${Math.floor(m / 60)}h${m % 60 ? `${m % 60}m` : ''}`;
}

function table(rows: string[][]): string {
  if (rows.length === 0) return '';
  const widths = rows[0]!.map((_, c) => Math.max(...rows.map((r) => (r[c] ?? '').length)));
  return `${rows.map((r) => r.map((cell, c) => (c === r.length - 1 ? cell : cell.padEnd(widths[c]!))).join('  ')).join('\n')}\n`;
}

/** `key  value` lines (a record shown to a person), empty values left out. */
function fields(rows: Array<[string, string]>): string {
  return table(rows.filter(([, v]) => v !== ''));
}
const labelText = (labels: Record<string, string>): string => Object.entries(labels).map(([k, v]) => `${k}=${v}`).join(',');

function sandboxFields(s: SandboxInfo): string {
  return fields([
    ['id', s.id],
    ['state', s.stateReason ? `${s.state} (${s.stateReason})` : s.state],
    ['host', s.hostId],
    ['source', s.sourceSnapshotId || s.image],
    ['lineage', s.lineageId],
    ['hostname', s.hostname],
    ['resources', `${s.resources.vcpus} vCPU, ${s.resources.memoryMib} MiB memory, ${s.resources.diskMib} MiB disk`],
    ['labels', labelText(s.labels)],
    ['ran', `${fmtMs(s.runningMs)}${s.ttlMs ? ` of a ${fmtMs(s.ttlMs)} TTL` : ''}`],
    ['idle timeout', s.idleTimeoutMs ? `${fmtMs(s.idleTimeoutMs)} (then hibernated)` : s.idleTimeoutMs === 0 ? 'never' : ''],
    ['created', s.createdAt ?? ''],
    ['changed', s.updatedAt ?? ''],
    ['hibernation', s.hibernationSnapshotId],
  ]);
}

function operationFields(op: OperationInfo): string {
  const p = op.progress;
  const progressText = [p.total > 0 ? `${p.done}/${p.total}` : '', p.message, p.bytesTransferred > 0 ? `${fmtBytes(p.bytesTransferred)} transferred` : ''].filter(Boolean).join(' · ');
  return fields([
    ['id', op.id],
    ['kind', op.kind],
    ['state', op.cancelRequested && (op.state === 'pending' || op.state === 'running') ? `${op.state} (cancel requested)` : op.state],
    ['target', op.targetId],
    ['tenant', op.tenantId],
    ['created', op.createdAt ?? ''],
    ['updated', op.updatedAt ?? ''],
    ['took', tookText(op)],
    ['progress', progressText],
    ['error', op.error ? `${op.error.kind}: ${op.error.message}${op.error.retryable ? ' (retryable)' : ''}` : ''],
    ['sandbox', op.sandbox ? `${op.sandbox.id} ${op.sandbox.state}${op.sandbox.hostId ? ` on ${op.sandbox.hostId}` : ''}` : ''],
    ['snapshot', op.snapshot ? `${op.snapshot.id} ${op.snapshot.state}` : (op.fork?.snapshotId ?? '')],
    ['placement', op.fork?.summary ?? ''],
    ['children', op.fork ? op.fork.children.map((c) => `${c.id}${c.hostId ? `@${c.hostId}` : ''}`).join(' ') : ''],
  ]) + stepsTable(op);
}

/** 460ms, 7.3s, 3m20s: a step's time, to a tenth of a second under a minute. */
function fmtStepMs(ms: number): string {
  return ms < 1000 ? `${Math.round(ms)}ms` : ms < 60_000 ? `${(ms / 1000).toFixed(1)}s` : fmtMs(ms);
}

/**
 * The op's host steps: when each was sent (after the op was created), how long until its
 * answer came, how long it took on the host, and what it moved. Empty when it has none.
 */
function stepsTable(op: OperationInfo): string {
  if (op.steps.length === 0) return '';
  const created = op.createdAt ? Date.parse(op.createdAt) : undefined;
  const rows = op.steps.map((st) => {
    const sent = st.sentAt ? Date.parse(st.sentAt) : undefined;
    const ended = st.finishedAt ? Date.parse(st.finishedAt) : undefined;
    const notes = [
      st.pauseMs !== undefined ? `source paused ${fmtStepMs(st.pauseMs)}` : '',
      st.bytesFetched > 0 ? `${fmtBytes(st.bytesFetched)} ${st.restoredByMigration ? 'migrated' : 'fetched'}` : st.restoredByMigration ? 'migrated' : '',
      st.attempt > 1 ? `attempt ${st.attempt}` : '',
    ].filter(Boolean).join(', ');
    return [
      st.stepId,
      st.hostId,
      st.action,
      st.state,
      sent !== undefined && created !== undefined ? `+${fmtStepMs(sent - created)}` : '-',
      sent !== undefined && ended !== undefined ? fmtStepMs(ended - sent) : '-',
      st.hostMs !== undefined ? fmtStepMs(st.hostMs) : '-',
      notes,
    ];
  });
  const omitted = op.stepsOmitted > 0 ? ` (${op.stepsOmitted} earlier steps, ended, not kept)` : '';
  return `\nsteps${omitted} (sent: after the operation was created; took: until the scheduler had the answer; on host: as the host measured it)\n${table([['STEP', 'HOST', 'ACTION', 'STATE', 'SENT', 'TOOK', 'ON HOST', 'NOTES'], ...rows])}`;
}

/** TIME  REVISION  TYPE  SUBJECT  details: the subject is the snapshot for snapshot events, else the sandbox (or host). */
function eventLine(e: EventInfo): string {
  const subject = (e.type.startsWith('snapshot_') && e.snapshotId) || e.sandboxId || e.snapshotId || e.hostId || '-';
  const detail = [
    e.sandboxState !== 'unspecified' ? e.sandboxState : '',
    e.hostId && subject !== e.hostId ? `on ${e.hostId}` : '',
    e.sandboxId && subject !== e.sandboxId ? `of ${e.sandboxId}` : '',
    e.operationId,
    e.message,
  ].filter(Boolean).join('  ');
  return `${e.time ?? '-'}  ${e.revision}  ${e.type}  ${subject}${detail ? `  ${detail}` : ''}\n`;
}

/** `K/<target>`, refused up front (naming the flag) when it would be longer than a key may be. */
function perTargetKey(key: string, target: string): string {
  const k = `${key}/${target}`;
  if (k.length > 128) throw new ForkfleetError('invalid_argument', `--idempotency-key: at most ${127 - target.length} characters with this command (each target gets <key>/<id>, and a key is at most 128)`, { field: '--idempotency-key' });
  return k;
}

/**
 * The key (or, per target, the base of the keys) of this invocation's mutating calls: the
 * user's --idempotency-key, else one made for this run (once), which an error that may hide an
 * accepted request shows, so that the command can be repeated without doing the work twice.
 */
function keyBase(cmd: Command): string {
  const inv = invocation(cmd);
  return (inv.keySent = globals(cmd).idempotencyKey ?? (inv.key ??= newIdempotencyKey('cli')));
}

/**
 * A file transfer's deadline: --timeout, for the whole transfer with its retries (the SDK's
 * timeoutMs alone is per attempt, and a scheduler answering UNAVAILABLE is asked again for a
 * minute); without it, the SDK's FILE_CALL_TIMEOUT_MS per attempt.
 */
function fileCallOpts(cmd: Command): CallOpts {
  const t = globals(cmd).timeout;
  if (!t) return {};
  const ms = parseDuration(t, '--timeout');
  return { timeoutMs: ms, deadline: new Date(Date.now() + ms) };
}

/**
 * The options of a call that submits an operation and waits for it. `target`: the one a
 * command that can name several acts on here; its call gets --idempotency-key K as
 * `K/<target>` (with one target too, so that repeating the command with fewer or more targets
 * finds the same keys), since the fleet ties a key to one request: one key for every target
 * would refuse all but one. `show`: report progress on stderr (never on stdout, so --json stays
 * parseable); without --json only, since the SDK polls once a second for it instead of
 * long-polling, and not for a command given several targets (their lines would overwrite
 * each other, and 64 targets would make 64 calls a second).
 */
function progress(cmd: Command, label: string, target?: string, show = true): CallOpts {
  const g = globals(cmd);
  const started = Date.now();
  let last = '';
  const opts: CallOpts = {
    ...(g.timeout ? { timeoutMs: parseDuration(g.timeout, '--timeout') } : {}),
    idempotencyKey: target === undefined ? keyBase(cmd) : perTargetKey(keyBase(cmd), target),
  };
  if (!show || g.json) return opts;
  opts.onProgress = (op: OperationInfo) => {
    const p = op.progress;
    const parts = [`${label}: ${op.state}`];
    if (p.total > 0) parts.push(`${p.done}/${p.total} ${op.kind === 'fork' ? 'children ready' : 'done'}`);
    if (p.bytesTransferred > 0) parts.push(`${fmtBytes(p.bytesTransferred)} transferred`);
    if (p.message) parts.push(p.message);
    const key = parts.join(' · ');
    const line = `${key} · ${((Date.now() - started) / 1000).toFixed(1)}s`;
    // On a terminal, redraw one line every poll; otherwise print a line only when something changed.
    if (isTty()) {
      process.stderr.write(`\r\x1b[2K${line}`);
      invocation(cmd).progressDrawn = true;
    } else if (key !== last) process.stderr.write(`${line}\n`);
    last = key;
  };
  return opts;
}

/**
 * Runs `call` (one that submits an operation and waits for it, with progress(cmd, label,
 * target, show)'s options), keeping it in this run's waits while it runs: an interrupt names
 * its operation (or its key, before the fleet's answer came).
 */
async function waitingOn<T>(cmd: Command, label: string, target: string | undefined, show: boolean, call: (o: CallOpts) => Promise<T>): Promise<T> {
  const o = progress(cmd, label, target, show);
  const w: Waiting = { label, ...(o.idempotencyKey ? { key: o.idempotencyKey } : {}) };
  const done = waiting(cmd, w);
  try {
    return await call({ ...o, onAccepted: (op) => void (w.opId = op.id) });
  } finally {
    done();
  }
}

/**
 * Adds `w` to this run's waits, with the run's SIGINT handler on while there are any (an
 * interrupt then names them); returns its removal. Outside waits SIGINT keeps its default (a
 * blocking read of stdin, `exec --stdin`, stays interruptible).
 */
function waiting(cmd: Command, w: Waiting): () => void {
  const inv = invocation(cmd);
  inv.waits.add(w);
  if (inv.waits.size === 1 && inv.onInterrupt) process.on('SIGINT', inv.onInterrupt);
  return () => {
    if (inv.waits.delete(w) && inv.waits.size === 0 && inv.onInterrupt) process.off('SIGINT', inv.onInterrupt);
  };
}
/** Ends the progress line drawn on a terminal, if one was. */
function endProgress(cmd: Command): void {
  const inv = invocation(cmd);
  if (inv.progressDrawn) process.stderr.write('\n');
  inv.progressDrawn = false;
}

function sandboxRows(list: SandboxInfo[]): string[][] {
  return [['ID', 'STATE', 'HOST', 'MEMORY', 'SOURCE', 'CREATED'], ...list.map((s) => [s.id, s.state, s.hostId || '-', `${s.resources.memoryMib} MiB`, s.sourceSnapshotId || s.image || '-', s.createdAt ?? '-'])];
}
/**
 * When a snapshot goes, for the EXPIRES column: its expires_at; else never (pinned, or no
 * retention); else what retention waits for: a TTL already run out while sandboxes use it
 * (deleted once they are gone), or a keep_last window it is inside still.
 */
export function expiresText(s: Pick<SnapshotInfo, 'expiresAt' | 'pinned' | 'retention'>): string {
  if (s.expiresAt) return s.expiresAt;
  if (s.pinned) return 'never';
  if (s.retention.ttlMs !== undefined) return 'when unused';
  return s.retention.keepLast > 0 ? `keep_last ${s.retention.keepLast}` : 'never';
}
function snapshotRows(list: SnapshotInfo[]): string[][] {
  return [['ID', 'STATE', 'PINNED', 'SOURCE', 'STORED', 'HOSTS', 'EXPIRES'], ...list.map((s) => [s.id, s.state, s.pinned ? 'yes' : 'no', s.sourceSandboxId || '-', fmtBytes(s.storedBytes), s.hostIds.join(',') || '-', expiresText(s)])];
}
/** `rows` (a header, then one row per item of `list`) with a TENANT column after the id, when asked. */
function withTenant(rows: string[][], list: ReadonlyArray<{ tenantId: string }>, show: boolean | undefined): string[][] {
  if (!show) return rows;
  return rows.map((r, i) => [r[0]!, i === 0 ? 'TENANT' : list[i - 1]!.tenantId, ...r.slice(1)]);
}
/** An ended operation's time from its record to its end ('' while it runs). */
function tookText(o: OperationInfo): string {
  const ended = o.state === 'succeeded' || o.state === 'failed' || o.state === 'cancelled';
  return ended && o.createdAt && o.updatedAt ? fmtStepMs(Date.parse(o.updatedAt) - Date.parse(o.createdAt)) : '';
}
function operationRows(list: OperationInfo[]): string[][] {
  return [
    ['ID', 'KIND', 'STATE', 'TARGET', 'PROGRESS', 'CREATED', 'TOOK', 'ERROR'],
    ...list.map((o) => [o.id, o.kind, o.state, o.targetId || '-', o.progress.total > 0 ? `${o.progress.done}/${o.progress.total}` : '-', o.createdAt ?? '-', tookText(o) || '-', o.error ? `${o.error.kind}: ${o.error.message}` : '']),
  ];
}
function hostRows(list: HostInfo[]): string[][] {
  return [
    ['ID', 'STATE', 'FLAGS', 'MEMORY', 'VCPUS', 'SANDBOXES', 'SNAPSHOTS', 'ACCEL'],
    ...list.map((h) => [h.id, h.state, [h.cordoned ? 'cordoned' : '', h.draining ? 'draining' : ''].filter(Boolean).join(',') || '-', `${h.allocated.memoryMib}/${h.capacity.memoryMib} MiB`, `${h.allocated.vcpus}/${h.capacity.vcpus}`, String(h.sandboxCount), String(h.snapshotCount), h.accel]),
  ];
}

/**
 * A whole-number flag (or argument) from `min` to `max`, in decimal digits only (a minus sign
 * only where `min` is negative): Number() would also take `1e2`, `0x100`, `0b11` or ` 5 `.
 */
function intArg(name: string, min: number, max: number): (v: string) => number {
  const digits = min < 0 ? /^-?\d+$/ : /^\d+$/;
  return (v: string) => {
    const n = digits.test(v) ? Number(v) : NaN;
    if (!Number.isSafeInteger(n) || n < min || n > max) throw new ForkfleetError('invalid_argument', `${name}: want a whole number ${min}..${max} in decimal digits, got ${JSON.stringify(v)}`, { field: name });
    return n;
  };
}

/**
 * This process's stdin, for `sandbox exec --stdin`: refused naming --stdin when it is more than
 * `max` bytes (what an exec takes, LIMITS.maxStdinBytes), before it is all read: a file's size
 * is known at once, a pipe's once `max` + 1 bytes have come.
 */
export function readStdin(max: number, fd = 0): Buffer {
  const tooMuch = (): ForkfleetError => new ForkfleetError('invalid_argument', `--stdin: more than ${max} bytes; a command's stdin takes at most that`, { field: '--stdin' });
  const st = fstatSync(fd);
  if (st.isFile() && st.size > max) throw tooMuch();
  const chunks: Buffer[] = [];
  const buf = Buffer.allocUnsafe(64 * 1024);
  let n = 0;
  for (let got; (got = readSync(fd, buf, 0, buf.length, null)) > 0; ) {
    n += got;
    if (n > max) throw tooMuch();
    chunks.push(Buffer.from(buf.subarray(0, got)));
  }
  return Buffer.concat(chunks, n);
}

/**
 * A repeatable key=value option (`flag` names it in errors). `once`: a key given twice is
 * refused, rather than its last value taken unsaid.
 */
function pairsArg(flag: string, once = false): (v: string, prev?: Record<string, string>) => Record<string, string> {
  return (v, prev = {}) => {
    const i = v.indexOf('=');
    if (i <= 0) throw new ForkfleetError('invalid_argument', `${flag}: want key=value, got ${JSON.stringify(v)}`, { field: flag });
    const key = v.slice(0, i);
    if (once && Object.hasOwn(prev, key)) throw new ForkfleetError('invalid_argument', `${flag}: key ${JSON.stringify(key)} given twice (${JSON.stringify(`${key}=${prev[key]}`)}, then ${JSON.stringify(v)}); give each key once`, { field: flag });
    return { ...prev, [key]: v.slice(i + 1) };
  };
}
// A label has one value: `--label team=a --label team=b` (a typo, or a selector meant as
// "either") would be team=b unsaid.
const labelsArg = pairsArg('--label', true);

export function buildProgram(): Command {
  const program = new Command('forkfleet')
    .description('Forkfleet: fork, snapshot and run AI-agent sandboxes on a fleet of QEMU microVMs')
    .addOption(new Option('--api <host:port>', 'scheduler API address; several (comma-separated) must be IP addresses, a.b.c.d:port or [v6]:port').default(defaultApi(), 'FF_API, the local fleet, or 127.0.0.1:17700'))
    .addOption(new Option('--tenant <id>', 'tenant (only admin credentials may name another than their own)').default(process.env.FF_TENANT ?? '', "FF_TENANT, else the credential's tenant"))
    .option('--credentials <file>', 'JSON credentials file {token, ca, tenant} (FF_CREDENTIALS; default: the local fleet\'s credentials.json)')
    .option('--json', 'print one JSON document on stdout', false)
    .option('--timeout <duration>', 'how long to wait for operations, e.g. 5m; also the deadline of a cp, retries included')
    .option('--idempotency-key <key>', 'reuse a key so that repeating this command does nothing twice')
    // A line commander refuses is reported by main(), as the CLI's other errors are (refusal()).
    .configureOutput({ outputError: () => undefined })
    .exitOverride();

  // ----- fleet
  const fleet = program.command('fleet').description('the local multi-host fleet (deploy/fleet)');
  const fleetDir = (o: { dir?: string }): string => o.dir ?? defaultFleetDir();
  fleet
    .command('up')
    .description('start a local fleet: etcd, NATS, 2 schedulers and N host agents in network namespaces')
    .option('--hosts <n>', 'host agents', intArg('--hosts', 1, 32), 3)
    .option('--etcd <n>', 'etcd members (1 or 3)', intArg('--etcd', 1, 3), 1)
    .option('--link <rate>', 'shaped link rate', '10gbit')
    .option('--dir <dir>', 'fleet directory (FF_FLEET_DIR)')
    .option('--prefix <p>', 'network namespace prefix')
    .option('--base-port <port>', 'first port of the control plane (it listens on port .. port + 41)', intArg('--base-port', 1024, 65535 - 41)) // as deploy/fleet/fleet.ts's BASE_PORT_RANGE (imported lazily, below)
    .option('--peer-tls <on|off>', 'mutual TLS between the agents', 'on')
    .action(async (o: { hosts: number; etcd: number; link: string; dir?: string; prefix?: string; basePort?: number; peerTls: string }, cmd: Command) => {
      const { up, defaultOptions, validateOptions } = await import('../../deploy/fleet/fleet.ts');
      if (o.peerTls !== 'on' && o.peerTls !== 'off') throw new ForkfleetError('invalid_argument', `--peer-tls: on or off, got ${JSON.stringify(o.peerTls)}`, { field: '--peer-tls' });
      const opts = defaultOptions({ hosts: o.hosts, etcd: o.etcd as 1 | 3, link: o.link, dir: fleetDir(o), peerTls: o.peerTls === 'on', ...(o.prefix ? { prefix: o.prefix } : {}), ...(o.basePort ? { basePort: o.basePort } : {}) });
      // Every option checked (naming its flag) before anything is installed or started.
      validateOptions(opts);
      // As `npm run fleet:up`: the Debian packages the fleet runs on (etcd, NATS, QEMU, ...),
      // installed when missing (idempotent, under a second when nothing is). Its output goes
      // to stderr, so that --json output stays one document.
      const setup = spawnSync('bash', [resolve(ROOT, 'deploy', 'setup.sh')], { cwd: ROOT, stdio: ['ignore', 2, 2] });
      if (setup.status !== 0) throw new ForkfleetError('failed_precondition', `deploy/setup.sh failed (${setup.error?.message ?? `exit ${setup.status ?? setup.signal}`}): see its output above`);
      const s = await up(opts);
      out(cmd, { dir: s.options.dir, api: s.apiAddresses, metrics: s.metricsAddresses, hosts: s.hosts.map((h) => ({ id: h.id, address: h.address })) }, () =>
        `fleet is up in ${s.options.dir}: ${s.hosts.length} hosts; API ${s.apiAddresses.join(', ')}; metrics ${s.metricsAddresses.map((m) => `http://${m}/metrics`).join(' ')}\n` +
        `next: forkfleet --api ${s.apiAddresses.join(',')} sandbox create --image tiny\n`);
    });
  fleet
    .command('down')
    .description('stop the local fleet (processes by PID, namespaces, data)')
    .option('--dir <dir>', 'fleet directory (FF_FLEET_DIR)')
    .action(async (o: { dir?: string }, cmd: Command) => {
      const { down } = await import('../../deploy/fleet/fleet.ts');
      const found = await down(fleetDir(o));
      out(cmd, { dir: fleetDir(o), down: true, found }, () => (found ? `fleet in ${fleetDir(o)} is down\n` : `no fleet in ${fleetDir(o)}: nothing to stop\n`));
    });
  fleet
    .command('status')
    .description('processes and hosts of the local fleet')
    .option('--dir <dir>', 'fleet directory (FF_FLEET_DIR)')
    .action(async (o: { dir?: string }, cmd: Command) => {
      const { status } = await import('../../deploy/fleet/fleet.ts');
      const st = await status(fleetDir(o));
      const procs = st.procs.map((p) => ({ name: p.name, kind: p.kind, pid: p.pid, alive: p.alive, netns: p.netns ?? null }));
      out(cmd, { dir: fleetDir(o), startedAt: st.state.startedAt, api: st.state.apiAddresses, metrics: st.state.metricsAddresses, procs, hosts: st.hosts }, () =>
        `fleet in ${fleetDir(o)}, up since ${st.state.startedAt}; API ${st.state.apiAddresses.join(', ')}\n` +
        table([['PROCESS', 'PID', 'ALIVE', 'NETNS'], ...procs.map((p) => [p.name, String(p.pid), p.alive ? 'up' : 'DOWN', p.netns ?? '-'])]));
    });

  fleet
    .command('restart')
    .description('stop one process of the local fleet (if it runs) and start it again as it was started, e.g. after killing it to see the fleet recover: agent-h2, scheduler-1, etcd-1, nats (names: fleet status)')
    .argument('<process>')
    .option('--dir <dir>', 'fleet directory (FF_FLEET_DIR)')
    .action(async (name: string, o: { dir?: string }, cmd: Command) => {
      const { readState, restartProcess } = await import('../../deploy/fleet/fleet.ts');
      const names = readState(fleetDir(o))?.procs.map((p) => p.name) ?? [];
      if (!names.includes(name)) throw new ForkfleetError('invalid_argument', `process: ${JSON.stringify(name)} is not a process of the fleet in ${fleetDir(o)}${names.length ? ` (${names.join(', ')})` : ' (is it up?)'}`, { field: 'process' });
      const rec = await restartProcess(fleetDir(o), name);
      out(cmd, { name: rec.name, pid: rec.pid }, () => `${rec.name} restarted: pid ${rec.pid}\n`);
    });

  // ----- token
  const token = program.command('token').description('API credentials (bearer tokens, stored hashed)');
  const tokensFileOf = (o: { tokensFile?: string }): string => o.tokensFile ?? process.env.FF_TOKENS_FILE ?? resolve(fleetDir({}), 'keys', 'tokens.json');
  token
    .command('mint')
    .description('add a token for --tenant to a tokens file (FF_TOKENS_FILE of the schedulers) and print it: the only time it is shown')
    .option('--tokens-file <file>', 'tokens file (FF_TOKENS_FILE, else <fleet dir>/keys/tokens.json)')
    .option('--admin', 'may list, cordon and drain hosts, and act for any tenant', false)
    .option('--name <name>', 'a note stored with the hash')
    .option('--sandboxes <n>', 'quota: sandboxes', intArg('--sandboxes', 0, 1 << 30))
    .option('--memory-mib <n>', 'quota: memory of live sandboxes, MiB', intArg('--memory-mib', 0, 2 ** 40))
    .option('--snapshot-bytes <n>', 'quota: stored snapshot bytes', intArg('--snapshot-bytes', 0, Number.MAX_SAFE_INTEGER))
    .option('--rate <per_s>', 'rate limit, requests per second', intArg('--rate', 1, 1_000_000))
    .option('--burst <n>', 'rate limit burst', intArg('--burst', 1, 1_000_000))
    .action(async (o: { tokensFile?: string; admin: boolean; name?: string; sandboxes?: number; memoryMib?: number; snapshotBytes?: number; rate?: number; burst?: number }, cmd: Command) => {
      const { mintToken, credentialIdOf, sha256 } = await import('../auth/tokens.ts');
      const g = globals(cmd);
      if (!g.tenant) throw new ForkfleetError('invalid_argument', '--tenant: name the tenant the token acts for', { field: '--tenant' });
      if (o.burst !== undefined && o.rate === undefined) throw new ForkfleetError('invalid_argument', '--burst: a burst belongs to a rate limit; set --rate too', { field: '--burst' });
      const file = tokensFileOf(o);
      const quotas = { ...(o.sandboxes !== undefined ? { sandboxes: o.sandboxes } : {}), ...(o.memoryMib !== undefined ? { memory_mib: o.memoryMib } : {}), ...(o.snapshotBytes !== undefined ? { snapshot_bytes: o.snapshotBytes } : {}) };
      const t = mintToken(file, {
        tenant: g.tenant,
        admin: o.admin,
        ...(o.name ? { name: o.name } : {}),
        ...(Object.keys(quotas).length ? { quotas } : {}),
        ...(o.rate !== undefined ? { rate: { per_s: o.rate, ...(o.burst !== undefined ? { burst: o.burst } : {}) } } : {}),
      });
      out(cmd, { tenant: g.tenant, admin: o.admin, token: t, id: credentialIdOf(sha256(t)), tokensFile: file }, () => `${t}
`);
      if (!g.json) process.stderr.write(`token for tenant ${g.tenant}${o.admin ? ' (admin)' : ''} added to ${file}; it is not stored in clear anywhere: keep it now (FF_TOKEN=...)
`);
    });

  token
    .command('ls')
    .alias('list')
    .description('list the tokens of a tokens file: id, tenant, name, admin (the tokens themselves are not stored)')
    .option('--tokens-file <file>', 'tokens file (FF_TOKENS_FILE, else <fleet dir>/keys/tokens.json)')
    .action(async (o: { tokensFile?: string }, cmd: Command) => {
      const { listTokens } = await import('../auth/tokens.ts');
      const list = listTokens(tokensFileOf(o));
      out(cmd, list, () => table([['ID', 'TENANT', 'NAME', 'ADMIN'], ...list.map((t) => [t.id, t.tenant, t.name || '-', t.admin ? 'yes' : 'no'])]));
    });
  token
    .command('revoke')
    .description('remove tokens by id (from token ls) or by name: the schedulers refuse them, and end their open streams (exec, watch), within about a second')
    .argument('<id-or-name>')
    .option('--tokens-file <file>', 'tokens file (FF_TOKENS_FILE, else <fleet dir>/keys/tokens.json)')
    .action(async (which: string, o: { tokensFile?: string }, cmd: Command) => {
      const { revokeTokens } = await import('../auth/tokens.ts');
      const gone = revokeTokens(tokensFileOf(o), which);
      out(cmd, gone, () => gone.map((t) => `revoked ${t.id}  ${t.tenant}  ${t.name || '-'}\n`).join(''));
    });

  // ----- sandbox
  const sb = program.command('sandbox').alias('sb').description('create, run and fork sandboxes');
  sb.command('create')
    .description('boot a sandbox from an image or restore one from a snapshot')
    .option('--image <name>', 'guest image', 'tiny')
    .option('--from-snapshot <id>', 'restore from this snapshot instead of an image')
    .option('--memory <mib>', 'memory, MiB', intArg('--memory', LIMITS.minMemoryMib, LIMITS.maxMemoryMib))
    .option('--vcpus <n>', 'vCPUs', intArg('--vcpus', 1, 64))
    .option('--ttl <duration>', 'destroy after this much running time, e.g. 1h')
    .option('--idle-timeout <duration>', 'hibernate it after this long idle (its CPU and RAM go back; the next call wakes it), e.g. 10m; 0 never (default: the tenant\'s)')
    .option('--host <id>', 'place on this host')
    .option('--label <key=value>', 'label (repeatable)', labelsArg)
    .action(async (o: { image: string; fromSnapshot?: string; memory?: number; vcpus?: number; ttl?: string; idleTimeout?: string; host?: string; label?: Record<string, string> }, cmd: Command) => {
      // A restored sandbox runs its snapshot's image: an --image given with it would be dropped unsaid.
      if (o.fromSnapshot && cmd.getOptionValueSource('image') === 'cli') throw new ForkfleetError('invalid_argument', '--image: give --image or --from-snapshot, not both (a sandbox restored from a snapshot runs the snapshot\'s image)', { field: '--image' });
      const ff = client(cmd);
      const s = await waitingOn(cmd, 'create', undefined, true, (w) => ff.create(
        { ...(o.fromSnapshot ? { snapshotId: o.fromSnapshot } : { image: o.image }), ...(o.memory ? { memoryMib: o.memory } : {}), ...(o.vcpus ? { vcpus: o.vcpus } : {}), ...(o.ttl ? { ttl: o.ttl } : {}), ...(o.idleTimeout !== undefined ? { idleTimeout: o.idleTimeout } : {}), ...(o.host ? { hostId: o.host } : {}), labels: o.label ?? {} },
        w,
      ));
      endProgress(cmd);
      out(cmd, s.info, () => `${s.id}  ${s.info?.state} on ${s.info?.hostId}\nnext: forkfleet sandbox exec ${s.id} -- uname -a\n`);
    });
  sb.command('ls').alias('list')
    .description('list sandboxes (all but destroyed)')
    .addOption(new Option('--state <state...>', 'only these states').choices(SANDBOX_STATES))
    .option('--label <key=value>', 'label selector (repeatable)', labelsArg)
    .option('--host <id>', 'only those on this host (e.g. before draining it)')
    .option('--all-tenants', 'every tenant\'s, with a TENANT column (admin)')
    .action(async (o: { state?: SandboxStateName[]; label?: Record<string, string>; host?: string; allTenants?: boolean }, cmd: Command) => {
      const list = await client(cmd).list({ ...(o.state ? { states: o.state } : {}), ...(o.label ? { labels: o.label } : {}), ...(o.host ? { hostId: o.host } : {}), ...(o.allTenants ? { allTenants: true } : {}) });
      out(cmd, list, () => (list.length ? table(withTenant(sandboxRows(list), list, o.allTenants)) : 'no sandboxes; create one with `forkfleet sandbox create`\n'));
    });
  sb.command('get').alias('show')
    .description('one sandbox: state (and why), host, source, resources, labels')
    .argument('<sandbox>')
    .action(async (id: string, _o: unknown, cmd: Command) => {
      const s = await client(cmd).get(id);
      out(cmd, s, () => sandboxFields(s));
    });
  sb.command('exec')
    .description('run a command in the guest, streaming its output; exits with its exit code')
    .argument('<sandbox>')
    .argument('<argv...>', 'command and arguments (put them after --)')
    .option('--env <key=value>', 'environment variable, added to the guest\'s own environment (repeatable); names starting _ff_ or FFE_ are refused', pairsArg('--env'))
    .option('--cwd <dir>', 'working directory')
    .option('--exec-timeout <duration>', 'kill the command after this long (default: --timeout when given, else 60s)', '60s')
    .option('--stdin', `send this process's stdin to the command (at most ${LIMITS.maxStdinBytes >> 20} MiB; copy more into the sandbox with sandbox cp, and have the command read the file)`, false)
    .action(async (id: string, argv: string[], o: { env?: Record<string, string>; cwd?: string; execTimeout: string; stdin: boolean }, cmd: Command) => {
      const g = globals(cmd);
      const stdin = o.stdin ? readStdin(LIMITS.maxStdinBytes) : undefined;
      // `--timeout 10m` with no --exec-timeout meant the command's limit too: it used to be
      // taken and ignored, and the command killed at the default 60 s.
      const byTimeout = cmd.getOptionValueSource('execTimeout') === 'default' && Boolean(g.timeout);
      const limit = byTimeout ? g.timeout! : o.execTimeout;
      const stream = client(cmd).sandbox(id).exec(argv, { env: o.env ?? {}, ...(o.cwd ? { cwd: o.cwd } : {}), timeout: limit, ...(stdin ? { stdin } : {}) });
      const res = { stdout: '', stderr: '', exitCode: -1, signal: 0, timedOut: false, durationMs: 0, outputTruncated: false };
      // --json: each stream decoded once, whole (a character split across two chunks stays whole).
      const parts: Record<'stdout' | 'stderr', Uint8Array[]> = { stdout: [], stderr: [] };
      let output = false;
      let exited = false;
      try {
        for await (const c of stream) {
          if (c.stream === 'exit') {
            exited = true;
            Object.assign(res, { exitCode: c.exitCode, signal: c.signal, timedOut: c.timedOut, durationMs: c.durationMs, outputTruncated: c.outputTruncated });
          } else {
            output = true;
            if (g.json) parts[c.stream].push(c.data);
            // A slow reader of our stdout holds the stream back, rather than this process buffering it.
            else await writeOut(c.stream === 'stdout' ? process.stdout : process.stderr, c.data);
          }
        }
      } catch (e) {
        // The exit came, then the stream failed (the connection dropped as it ended): the
        // command's outcome is known, so the CLI exits with its code; the failure is a warning.
        if (exited) {
          const d = describeError(e, g.api);
          process.stderr.write(`forkfleet: warning: the command's exit came, then its stream failed (${d.kind}: ${d.message}); exiting with the command's status\n`);
        } else {
          // Broke off after the command may have started: its outcome is unknown (exit 75), and
          // --json keeps what it printed until then.
          if (execMayHaveRun(e, output)) {
            startedExecs.add(e as object);
            if (g.json) invocation(cmd).execOutput = { stdout: Buffer.concat(parts.stdout).toString(), stderr: Buffer.concat(parts.stderr).toString() };
          }
          throw e;
        }
      }
      res.stdout = Buffer.concat(parts.stdout).toString();
      res.stderr = Buffer.concat(parts.stderr).toString();
      if (g.json) process.stdout.write(`${JSON.stringify(res, null, 2)}\n`);
      else if (res.timedOut) process.stderr.write(`forkfleet: command timed out after ${limit} (${byTimeout ? '--timeout' : '--exec-timeout'})\n`);
      if (!g.json && res.outputTruncated) process.stderr.write('forkfleet: output truncated: stdout or stderr had more than an exec returns (64 MiB each); write it to a file in the sandbox and cp it out\n');
      invocation(cmd).exitCode = res.signal ? 128 + res.signal : res.exitCode < 0 ? 1 : res.exitCode;
    });
  sb.command('cp')
    .description('copy a file into or out of a sandbox: cp ./local SANDBOX:/path or cp SANDBOX:/path ./local (- for stdin/stdout)')
    .argument('<src>')
    .argument('<dst>')
    .option('--mode <octal>', 'permission bits of an uploaded file', '644')
    .action(async (src: string, dst: string, o: { mode: string }, cmd: Command) => {
      const remote = (p: string): { id: string; path: string } | undefined => {
        const m = /^(sb-[A-Za-z0-9_-]+):(\/.*)$/.exec(p);
        return m ? { id: m[1]!, path: m[2]! } : undefined;
      };
      const rs = remote(src);
      const rd = remote(dst);
      if ((rs && rd) || (!rs && !rd)) throw new ForkfleetError('invalid_argument', 'cp: exactly one of SRC and DST must be SANDBOX:/absolute/path', { field: 'path' });
      if (rd) {
        const data = src === '-' ? readFileSync(0) : readFileSync(src);
        if (!/^[0-7]{1,4}$/.test(o.mode)) throw new ForkfleetError('invalid_argument', `--mode: want octal permission bits such as 644 or 0755, got ${JSON.stringify(o.mode)}`, { field: 'header.mode' });
        const n = await client(cmd).sandbox(rd.id).writeFile(rd.path, data, parseInt(o.mode, 8), fileCallOpts(cmd));
        out(cmd, { sandboxId: rd.id, path: rd.path, bytes: n }, () => `${n} bytes -> ${rd.id}:${rd.path}\n`);
      } else {
        // The file's bytes are the output: not a JSON document, so not with --json.
        if (dst === '-' && globals(cmd).json) throw new ForkfleetError('invalid_argument', 'cp: --json with DST - (stdout): the file\'s bytes would be the output; give a DST file to get a JSON report', { field: '--json' });
        const data = await client(cmd).sandbox(rs!.id).readFile(rs!.path, fileCallOpts(cmd));
        if (dst === '-') process.stdout.write(data);
        else {
          // Created readable by its owner only (a guest's keys and .env files are what people
          // copy out); a file that exists keeps its mode, as with cp.
          writeFileSync(dst, data, { mode: 0o600 });
          out(cmd, { sandboxId: rs!.id, path: rs!.path, bytes: data.length, to: dst }, () => `${rs!.id}:${rs!.path} -> ${dst} (${data.length} bytes)\n`);
        }
      }
    });
  for (const [name, desc] of [
    ['pause', 'pause the vCPUs (memory stays)'],
    ['resume', 'resume a paused or hibernated sandbox'],
    ['hibernate', 'snapshot the sandbox, then free its CPU and RAM'],
    ['destroy', 'destroy sandboxes'],
  ] as const) {
    sb.command(name)
      .description(desc)
      .argument('<sandbox...>')
      .action(async (ids: string[], _o: unknown, cmd: Command) => {
        const ff = client(cmd);
        const done = await eachTarget(cmd, ids, async (id) => {
          const s = ff.sandbox(id);
          await waitingOn(cmd, `${name} ${id}`, id, ids.length === 1, (o) => (name === 'pause' ? s.pause(o) : name === 'resume' ? s.resume(o) : name === 'hibernate' ? s.hibernate(o) : s.destroy(o)));
          return s.info ?? { id, state: name === 'destroy' ? 'destroyed' : 'unknown' };
        });
        // An array, one element per id in order, however many ids (README: --json output).
        out(cmd, done, () => done.map((s) => ('error' in s ? '' : `${s.id}  ${s.state}\n`)).join(''));
      });
  }
  sb.command('snapshot')
    .description('snapshot a sandbox (it keeps running)')
    .argument('<sandbox>')
    .option('--pin', 'keep it regardless of retention', false)
    .option('--ttl <duration>', 'retention TTL')
    .option('--label <key=value>', 'label (repeatable)', labelsArg)
    .action(async (id: string, o: { pin: boolean; ttl?: string; label?: Record<string, string> }, cmd: Command) => {
      const s = client(cmd).sandbox(id);
      const sn = await waitingOn(cmd, 'snapshot', undefined, true, (w) => s.snapshot({ pin: o.pin, ...(o.ttl ? { ttl: o.ttl } : {}), labels: o.label ?? {} }, w));
      endProgress(cmd);
      out(cmd, sn, () => `${sn.id}  ${sn.state} on ${sn.hostIds.join(',')}  ${fmtBytes(sn.storedBytes)} stored\nnext: forkfleet sandbox fork ${sn.id} 4\n`);
    });
  sb.command('fork')
    .description('fork a live sandbox (sb-...) or a snapshot (sn-...) into COUNT children')
    .argument('<source>', 'sandbox or snapshot id')
    .argument('[count]', 'children, 1..256', intArg('count', 1, 256), 1)
    .addOption(new Option('--locality <l>', 'where children go').choices(['any', 'same_host', 'cross_host']).default('any'))
    .addOption(new Option('--spread <s>', 'prefer filling busy hosts (pack) or distinct hosts (spread); a preference weighed against time to ready, see --max-per-host for a hard limit').choices(['pack', 'spread']))
    .option('--max-per-host <n>', 'at most this many children per host', intArg('--max-per-host', 1, 256))
    .option('--label <key=value>', 'label (repeatable)', labelsArg)
    .option('--ttl <duration>', 'destroy each child after this much running time, e.g. 1h')
    .option('--idle-timeout <duration>', 'hibernate each child after this long idle; 0 never (default: the source sandbox\'s)')
    .option('--snapshot-ttl <duration>', 'forking a live sandbox: delete the snapshot it takes this long after it was taken, once no child restores from it (default: the fleet\'s, 24h; 0 keeps it)')
    .option('--snapshot-keep-last <n>', 'forking a live sandbox: keep only the newest N snapshots of its lineage', intArg('--snapshot-keep-last', 1, 10_000))
    .action(async (source: string, count: number, o: { locality: 'any' | 'same_host' | 'cross_host'; spread?: 'pack' | 'spread'; maxPerHost?: number; label?: Record<string, string>; ttl?: string; idleTimeout?: string; snapshotTtl?: string; snapshotKeepLast?: number }, cmd: Command) => {
      const src = source.startsWith('sn-') ? { snapshotId: source } : { sandboxId: source };
      const keep = o.snapshotTtl !== undefined && (o.snapshotTtl.trim() === '0' || parseDuration(o.snapshotTtl, 'snapshot_retention.ttl') === 0);
      const snapshotRetention = o.snapshotTtl !== undefined || o.snapshotKeepLast !== undefined ? { ...(o.snapshotTtl !== undefined && !keep ? { ttl: o.snapshotTtl } : {}), ...(o.snapshotKeepLast ? { keepLast: o.snapshotKeepLast } : {}) } : undefined;
      const ff = client(cmd);
      const r = await waitingOn(cmd, `fork x${count}`, undefined, true, (w) => ff.fork(src, count, { locality: o.locality, ...(o.spread ? { spread: o.spread } : {}), ...(o.maxPerHost ? { maxPerHost: o.maxPerHost } : {}), labels: o.label ?? {}, ...(o.ttl ? { ttl: o.ttl } : {}), ...(o.idleTimeout !== undefined ? { idleTimeout: o.idleTimeout } : {}), ...(snapshotRetention ? { snapshotRetention } : {}) }, w));
      endProgress(cmd);
      const children = r.children.map((c) => c.info!);
      out(cmd, { snapshotId: r.snapshotId, children, placement: r.operation.fork?.summary ?? '' }, () =>
        `forked ${children.length} from ${r.snapshotId}${r.operation.fork?.summary ? ` (${r.operation.fork.summary})` : ''}\n${table(sandboxRows(children))}`);
    });

  // ----- snapshots
  const sn = program.command('snapshot').alias('sn').description('list, pin and delete snapshots');
  sn.command('ls').alias('list')
    .description('list snapshots and where they live')
    .option('--lineage <id>', 'only this lineage')
    .action(async (o: { lineage?: string }, cmd: Command) => {
      const list = await client(cmd).snapshots.list(o.lineage ?? '');
      out(cmd, list, () => (list.length ? table(snapshotRows(list)) : 'no snapshots; take one with `forkfleet sandbox snapshot SANDBOX`\n'));
    });
  for (const name of ['pin', 'unpin'] as const) {
    sn.command(name)
      .description(name === 'pin' ? 'keep a snapshot regardless of retention' : 'let retention delete it again')
      .argument('<snapshot>')
      .action(async (id: string, _o: unknown, cmd: Command) => {
        const ff = client(cmd);
        const key = globals(cmd).idempotencyKey;
        if (key) invocation(cmd).keySent = key;
        const opts = key ? { idempotencyKey: key } : {};
        const s = name === 'pin' ? await ff.snapshots.pin(id, opts) : await ff.snapshots.unpin(id, opts);
        out(cmd, s, () => `${s.id}  pinned=${s.pinned}\n`);
      });
  }
  sn.command('rm')
    .description('delete snapshots')
    .argument('<snapshot...>')
    .action(async (ids: string[], _o: unknown, cmd: Command) => {
      const ff = client(cmd);
      const done = await eachTarget(cmd, ids, async (id) => {
        const op = await waitingOn(cmd, `rm ${id}`, id, ids.length === 1, (o) => ff.snapshots.delete(id, o));
        return { snapshotId: op.targetId, operation: op.id, state: op.state };
      });
      out(cmd, done, () => done.map((d) => ('error' in d ? '' : `${d.snapshotId}  deleted\n`)).join(''));
    });

  // ----- operations and events
  const op = program.command('operation').alias('op').description('operations (what create, fork, drain, ... did)');
  op.command('get').alias('show')
    .description('one operation: state, progress, error, and for a fork its placement and children (a drain is the admin tenant\'s: --tenant admin)')
    .argument('<operation>')
    .action(async (id: string, _o: unknown, cmd: Command) => {
      const o = await client(cmd).operation(id);
      out(cmd, o, () => operationFields(o));
    });
  op.command('cancel')
    .description('ask a running create, fork or drain to stop: it ends cancelled at its next safe point, destroying what it started (a drain is the admin tenant\'s: --tenant admin)')
    .argument('<operation>')
    .option('--wait', 'wait until it has ended, and show how')
    .action(async (id: string, o: { wait?: boolean }, cmd: Command) => {
      const ff = client(cmd);
      let op = await ff.cancelOperation(id);
      if (o.wait) {
        const done = waiting(cmd, { label: `cancel ${id}`, opId: id });
        op = await ff.wait(id, globals(cmd).timeout ? { timeoutMs: parseDuration(globals(cmd).timeout!, '--timeout') } : {}).catch((e: unknown) => {
          if (e instanceof OperationFailedError) return e.operation;
          throw e;
        }).finally(done);
      }
      out(cmd, op, () => operationFields(op));
    });
  op.command('ls').alias('list')
    .description('the tenant\'s operations, newest first: running ones and those finished within the retention (1h by default); drains are the admin tenant\'s (--tenant admin)')
    .addOption(new Option('--state <state...>', 'only these states').choices(OPERATION_STATES))
    .addOption(new Option('--kind <kind...>', 'only these kinds').choices(OPERATION_KINDS))
    .option('--target <id>', 'only those acting on this sandbox, snapshot or host')
    .option('--limit <n>', 'at most this many, newest first', intArg('--limit', 1, 100_000), 100)
    .option('--all-tenants', 'every tenant\'s, with a TENANT column (admin)')
    .action(async (o: { state?: OperationStateName[]; kind?: OperationKindName[]; target?: string; limit: number; allTenants?: boolean }, cmd: Command) => {
      const list = await client(cmd).listOperations({ ...(o.state ? { states: o.state } : {}), ...(o.kind ? { kinds: o.kind } : {}), ...(o.target ? { targetId: o.target } : {}), limit: o.limit, ...(o.allTenants ? { allTenants: true } : {}) });
      out(cmd, list, () => (list.length ? table(withTenant(operationRows(list), list, o.allTenants)) : 'no operations\n'));
    });
  program
    .command('events')
    .description('follow the tenant\'s lifecycle events as they happen (one line each; --json: one JSON object per line), until interrupted')
    .option('--sandbox <id>', 'only this sandbox\'s events')
    .addOption(new Option('--type <type...>', 'only these types').choices(EVENT_TYPES))
    .option('--after <revision>', 'first replay every event after this revision (an event\'s second column), then follow', intArg('--after', 1, Number.MAX_SAFE_INTEGER))
    .option('--count <n>', 'stop after this many events', intArg('--count', 1, Number.MAX_SAFE_INTEGER))
    .option('--for <duration>', 'stop after this long, e.g. 30s')
    .action(async (o: { sandbox?: string; type?: string[]; after?: number; count?: number; for?: string }, cmd: Command) => {
      const ac = new AbortController();
      const stop = (): void => ac.abort();
      process.once('SIGINT', stop);
      const timer = o.for ? setTimeout(stop, parseDuration(o.for, '--for')) : undefined;
      const json = globals(cmd).json;
      let seen = 0;
      try {
        for await (const e of client(cmd).watch({ ...(o.sandbox ? { sandboxId: o.sandbox } : {}), ...(o.type ? { types: o.type } : {}), ...(o.after ? { afterRevision: o.after } : {}), signal: ac.signal })) {
          await writeOut(process.stdout, json ? `${JSON.stringify(e)}\n` : eventLine(e));
          if (o.count && ++seen >= o.count) break;
        }
      } catch (e) {
        // Interrupted or out of time: the end the user asked for, not an error.
        if (!ac.signal.aborted) throw e;
      } finally {
        clearTimeout(timer);
        process.off('SIGINT', stop);
      }
    });

  // ----- hosts
  program
    .command('usage')
    .description('the tenant\'s quotas and rate limit, and what counts against the quotas now (how many more sandboxes a fork may start)')
    .action(async (_o: unknown, cmd: Command) => {
      const u = await client(cmd).usage();
      const of = (used: string, limit: string | undefined): string => `${used}${limit === undefined ? ' (no limit)' : ` of ${limit}`}`;
      const q = u.quota;
      out(cmd, u, () =>
        fields([
          ['tenant', u.tenantId],
          ['sandboxes', of(String(u.sandboxes), q.sandboxes === undefined ? undefined : String(q.sandboxes))],
          ['memory', of(`${u.memoryMib} MiB`, q.memoryMib === undefined ? undefined : `${q.memoryMib} MiB`)],
          ['snapshots', of(fmtBytes(u.snapshotBytes), q.snapshotBytes === undefined ? undefined : fmtBytes(q.snapshotBytes))],
          ['rate', u.ratePerSecond > 0 ? `${u.ratePerSecond} calls/s, burst ${u.rateBurst}` : 'no limit'],
        ]));
    });

  const hosts = program.command('hosts').description('fleet hosts (admin)');
  hosts.command('ls').alias('list').description('hosts, their capacity and load').action(async (_o: unknown, cmd: Command) => {
    const list = await client(cmd).hosts.list();
    out(cmd, list, () => table(hostRows(list)));
  });
  hosts
    .command('cordon')
    .description('take no new sandboxes on a host (--undo to uncordon)')
    .argument('<host>')
    .option('--undo', 'uncordon', false)
    .action(async (id: string, o: { undo: boolean }, cmd: Command) => {
      const h = await client(cmd).hosts.cordon(id, !o.undo, { idempotencyKey: keyBase(cmd) });
      out(cmd, h, () => `${h.id}  cordoned=${h.cordoned}\n`);
    });
  hosts
    .command('drain')
    .description('cordon a host, then hibernate (or --migrate) its sandboxes')
    .argument('<host>')
    .option('--migrate', 'move running sandboxes to other hosts instead of hibernating them (without it, each is hibernated and its snapshot copied to another host, where it wakes)', false)
    .action(async (id: string, o: { migrate: boolean }, cmd: Command) => {
      const ff = client(cmd);
      const op = await waitingOn(cmd, `drain ${id}`, undefined, true, (w) => ff.hosts.drain(id, o.migrate, w));
      endProgress(cmd);
      out(cmd, op, () => `${id} drained: ${op.progress.done} sandbox(es) ${o.migrate ? 'moved to other hosts' : 'hibernated, their snapshots copied to other hosts'}\n`);
    });
  hosts
    .command('rm')
    .description('remove a lost host from the fleet (drain it and stop its agent first)')
    .argument('<host>')
    .action(async (id: string, _o: unknown, cmd: Command) => {
      const r = await client(cmd).hosts.remove(id);
      out(cmd, r, () => `${id} removed${r.lostSandboxes ? `; ${r.lostSandboxes} lost sandbox(es) were on it` : ''}\n`);
    });

  // ----- loadtest
  program
    .command('loadtest')
    .description('run the load test (npm run loadtest -- ARGS): every word after `loadtest` is its own, passed on as given (its options: forkfleet loadtest -- --help)')
    .argument('[args...]')
    .allowUnknownOption()
    .action(async (args: string[], _o: unknown, cmd: Command) => {
      // main() gives commander the line up to `loadtest` only (splitLine): the load test's
      // --api and --json FILE are not the CLI's.
      const passed = invocation(cmd).loadtestArgs ?? args;
      const code = await new Promise<number>((res) => {
        const child = spawn('npm', ['run', 'loadtest', '--', ...passed], { cwd: ROOT, stdio: 'inherit' });
        child.on('exit', (c, sig) => res(sig ? 1 : (c ?? 1)));
        child.on('error', () => res(1));
      });
      invocation(cmd).exitCode = code;
    });

  // Each command's refusals name it, so that the hint can name its --help.
  const tag = (c: Command): void => {
    c.exitOverride((err) => {
      refusedBy.set(err, c);
      throw err;
    });
    c.commands.forEach(tag);
  };
  tag(program);
  return program;
}

/** The command that refused a line (its exitOverride, set in buildProgram). */
const refusedBy = new WeakMap<CommanderError, Command>();

/**
 * A line commander refused (an unknown option or command, a value not among an option's
 * choices, a missing value or argument), described as the CLI's other errors are: `field` is
 * the flag its message names (`unknown option '--limit'`, `option '--spread <s>' argument
 * 'bogus' is invalid`), and the hint names the help of the command that refused it.
 */
function refusal(e: CommanderError, cmd: Command | undefined): DescribedError {
  const message = e.message.replace(/^error: /, '');
  const option = /^(?:unknown |required )?option '([^']+)'/.exec(message)?.[1];
  const field = option === undefined ? null : (/--[^\s,=<[]+/.exec(option) ?? /^-[^\s,=<[-]/.exec(option))?.[0] ?? null;
  const path: string[] = [];
  for (let c = cmd; c?.parent; c = c.parent) path.unshift(c.name());
  const help = `\`forkfleet ${[...path, '--help'].join(' ')}\``;
  const hint = e.code === 'commander.unknownCommand' ? `${help} lists the commands` : field ? `check ${field}: ${help} lists the flags` : `${help} lists the arguments and flags`;
  return { kind: 'invalid_argument', message, field, retryable: false, hint, exitCode: EXIT.usage };
}

/**
 * Runs `act` on every target at once and waits for all of them: one target's failure neither
 * hides nor cancels the others. Each failure (a lone target's too) is reported on stderr
 * (and in --json output as `{ id, error }` in its place: the output is one array, one element
 * per id, however many ids), the others' results are returned, and the exit code is the
 * first failure's.
 */
async function eachTarget<T>(cmd: Command, ids: string[], act: (id: string) => Promise<T>): Promise<Array<T | { id: string; error: DescribedError }>> {
  const settled = await Promise.allSettled(ids.map(act));
  endProgress(cmd);
  const g = globals(cmd);
  const inv = invocation(cmd);
  return settled.map((r, i) => {
    if (r.status === 'fulfilled') return r.value;
    const d = describeError(r.reason, g.api, inv.keySent);
    process.stderr.write(`forkfleet: ${ids[i]}: ${d.kind}: ${d.message}\n  hint: ${d.hint}\n`);
    if (!inv.exitCode) inv.exitCode = d.exitCode;
    return { id: ids[i]!, error: d };
  });
}

export interface DescribedError {
  kind: string;
  message: string;
  /** The flag or request field at fault; null when none is named (present in --json output either way). */
  field: string | null;
  retryable: boolean;
  hint: string;
  exitCode: number;
  /** The operation the fleet accepted before this error (it may still be running). */
  operationId?: string;
  /** The key to repeat the command with, when the error may hide a request the fleet accepted. */
  idempotencyKey?: string;
  /** A failed fork's children that are left (not failed or destroyed): they count against the quota until destroyed. */
  children?: string[];
}

/**
 * Exec errors (of `sandbox exec`) after which the command may have run: describeError gives
 * them exit 75 (outcome unknown) and says so, not "is the fleet up?".
 */
const startedExecs = new WeakSet<object>();

/** Kinds of the fleet's own failure (a host lost, a deadline), as opposed to a refusal of the request. */
const FLEET_FAILURES: ReadonlySet<string> = new Set(['unavailable', 'deadline_exceeded', 'internal', 'aborted']);

/**
 * Whether an exec that failed with `e` may have run its command: output had come, or the call
 * broke off (no answer: the connection dropped, the deadline passed; or the fleet failed
 * behind the scheduler, e.g. its host lost) rather than being refused or never reaching a
 * scheduler (execNeverStarted).
 */
function execMayHaveRun(e: unknown, gotOutput: boolean): boolean {
  if (typeof e !== 'object' || e === null) return false;
  if (gotOutput) return true;
  if (execNeverStarted(e)) return false;
  return e instanceof RpcError && (!e.answered || FLEET_FAILURES.has(e.kind));
}

/** Children of a failed fork that hold nothing (any more): the result lists each child it placed, in its state now. */
const GONE: ReadonlySet<string> = new Set(['failed', 'destroying', 'destroyed', 'lost']);

/** File system errors of the local files a command names (describeError). */
const LOCAL_FILE_ERRORS = new Set(['ENOENT', 'EACCES', 'EPERM', 'EISDIR', 'ENOTDIR', 'ELOOP', 'ENAMETOOLONG', 'EROFS', 'ENOSPC']);

/** `key`: the idempotency key the command sent (Invocation.keySent); undefined when it sent none (exec, cp, reads). */
export function describeError(e: unknown, api: string, key?: string): DescribedError {
  if (e instanceof ForkfleetError) {
    const base = { kind: e.kind, message: e.message, field: e.field ?? null, retryable: e.retryable };
    const operationId = e instanceof OperationFailedError ? undefined : operationIdOf(e);
    const started = startedExecs.has(e);
    // Accepted (an operation whose wait failed) or started (an exec that broke off): exit 75.
    const like = { ...base, field: e.field, operation: e instanceof OperationFailedError, answered: e instanceof RpcError && e.answered, accepted: operationId !== undefined || started, keyed: key !== undefined };
    const d: DescribedError = { ...base, hint: hintFor(like, api), exitCode: exitCodeFor(like) };
    if (started) return { ...d, hint: 'the command had started when its stream broke off: it may have run on, or to its end, with no exit seen; check what it does before running it again (exec runs again each time)' };
    // An operation that ran and failed: which one, and for a fork the children it left (a
    // partial fork keeps those that started; they count against the quota). A cancelled fork
    // destroyed the ones that started, whatever state its result caught them in.
    if (e instanceof OperationFailedError) {
      const left = e.operation.state === 'cancelled' ? [] : (e.operation.fork?.children ?? []).filter((c) => !GONE.has(c.state));
      const children = left.map((c) => c.id);
      const leftText = children.length ? ` (${children.length} ${children.length === 1 ? 'child was' : 'children were'} left, counting against the quota until destroyed: ${left.map((c) => `${c.id} ${c.state}`).join(', ')})` : '';
      return { ...d, operationId: e.operation.id, ...(children.length ? { children } : {}), hint: `${d.hint}; details: \`forkfleet operation get ${e.operation.id}\`${leftText}` };
    }
    // Accepted, then the wait for it failed (an outage, --timeout): follow it, do not submit
    // again. Not the kind's own hint ("retry ..."): a repeat without the key submits a second one.
    if (operationId) return { ...d, operationId, ...(key ? { idempotencyKey: key } : {}), hint: `operation ${operationId} was accepted and goes on: follow it with \`forkfleet operation get ${operationId}\`${key ? `, or wait for it again by repeating the command with --idempotency-key ${key} (without it, the command submits a second one)` : ''}` };
    // No answer, or the scheduler's store did not answer: the request may have been applied.
    const unsure = e instanceof RpcError && (!e.answered || e.kind === 'unavailable' || e.kind === 'deadline_exceeded');
    if (unsure && key) return { ...d, idempotencyKey: key, hint: `${d.hint}; the fleet may have taken the request: repeat the command with --idempotency-key ${key} to do the work at most once` };
    return d;
  }
  const message = e instanceof Error ? e.message : String(e);
  // Not the fleet's answer: a local file or directory the command was given (sandbox cp's
  // source, --credentials, --tokens-file) that is missing or not readable.
  const code = (e as NodeJS.ErrnoException | undefined)?.code;
  if (typeof code === 'string' && LOCAL_FILE_ERRORS.has(code)) return { kind: 'failed_precondition', message, field: null, retryable: false, hint: `a local file or directory: check the path and its permissions (a relative path is from ${process.cwd()})`, exitCode: EXIT.error };
  return { kind: 'internal', message, field: null, retryable: false, hint: 'this is a bug in the CLI or a local problem; the message above says what', exitCode: EXIT.error };
}

/**
 * What an interrupt (Ctrl-C) leaves on stderr: each operation this run was waiting on, which
 * goes on without it (its id, how to follow and stop it), or, before the fleet's answer came,
 * the key to repeat the command with. '' when it was waiting on none.
 */
function interruptNotice(waits: Iterable<{ label: string; key?: string; opId?: string }>, key: string | undefined): string {
  const list = [...waits];
  if (list.length === 0) return '';
  const lines = list.map((w) =>
    w.opId
      ? `  ${w.label}: operation ${w.opId} goes on: follow it with \`forkfleet operation get ${w.opId}\` (a create, fork or drain stops with \`forkfleet operation cancel ${w.opId}\`)\n`
      : `  ${w.label}: no answer yet: the fleet may have taken it${w.key ? ` (idempotency key ${w.key})` : ''}\n`,
  );
  const again = key && list.some((w) => w.key) ? `  to wait for ${list.length === 1 ? 'it' : 'them'} again without doing the work twice, repeat the command with --idempotency-key ${key}\n` : '';
  return `forkfleet: interrupted while waiting; not stopped on the fleet:\n${lines.join('')}${again}`;
}

/**
 * Sets the exit code and exits once stdout and stderr have been written out: a pipe's writes
 * are asynchronous, and process.exit() at once would cut them short (a file copied to stdout
 * past the pipe's 64 KiB). Exits then even if some handle lingers.
 */
function exitWhenFlushed(code: number): void {
  process.exitCode = code;
  let left = 2;
  const done = (): void => {
    if (--left === 0) process.exit(code);
  };
  for (const s of [process.stdout, process.stderr]) {
    if (s.destroyed || !s.writable) done();
    else s.write('', () => done());
  }
}

/** A word commander would take for an option (`-` alone is an operand: stdin or stdout). */
const optionLike = (w: string | undefined): boolean => w !== undefined && w.length > 1 && w.startsWith('-');

/**
 * The index of the first operand of `argv` from `from` on, as commander reads the line: an
 * option of a command in `scope` (the program and the commands named so far) is skipped with
 * its value, wherever it is. -1 at `--`, at the end, or at an option none of them has.
 */
function operandAt(argv: string[], from: number, scope: Command[]): number {
  for (let i = from; i < argv.length; i++) {
    const w = argv[i]!;
    if (w === '--') return -1;
    if (!optionLike(w)) return i;
    const eq = w.startsWith('--') ? w.indexOf('=') : -1;
    const flag = eq > 0 ? w.slice(0, eq) : w;
    const opt = scope.flatMap((c) => c.options).find((o) => o.long === flag || o.short === flag);
    if (!opt) return -1;
    if (eq < 0 && (opt.required || (opt.optional && !optionLike(argv[i + 1])))) i++;
  }
  return -1;
}
const subcommand = (cmd: Command, w: string | undefined): Command | undefined => cmd.commands.find((c) => c.name() === w || c.aliases().includes(w ?? ''));

interface Line {
  /** What commander parses. */
  argv: string[];
  /** `loadtest`'s words (its leading `--`, as `loadtest -- ARGS`, dropped). */
  loadtestArgs?: string[];
  /** `sandbox exec`'s command given with option-like words outside `--`: refused (`json`: --json came before the command). */
  refused?: { cmd: Command; message: string; json: boolean };
}

/**
 * What commander cannot be left to read, since it takes the program's options (--api, --json,
 * --tenant, ...) wherever they are on the line, and a command's own options after its
 * arguments, so they would be taken from words that are not the CLI's, silently:
 * - `loadtest ARGS`: the words after `loadtest` are the load test's (its own --api, --json
 *   FILE), passed on as given; commander gets the line up to `loadtest`.
 * - `sandbox exec ID CMD ARGS`: a word of the command's that looks like an option (`python
 *   eval.py --json --cwd /w`, `mytool -h`) would be the CLI's: refused, unless it is after `--`
 *   (`sandbox exec ID [options] -- CMD ARGS`, where every word is the command's).
 */
function splitLine(program: Command, argv: string[]): Line {
  const scope = [program];
  let at = operandAt(argv, 0, scope);
  const top = subcommand(program, argv[at]);
  if (top?.name() === 'loadtest') {
    const rest = argv.slice(at + 1);
    // `loadtest --help` alone: the CLI's help for it; `loadtest -- --help` reaches the load test's own usage.
    if (rest.length === 1 && (rest[0] === '-h' || rest[0] === '--help')) return { argv };
    return { argv: argv.slice(0, at + 1), loadtestArgs: rest[0] === '--' ? rest.slice(1) : rest };
  }
  if (top?.name() !== 'sandbox') return { argv };
  scope.push(top);
  at = operandAt(argv, at + 1, scope);
  const exec = subcommand(top, argv[at]);
  if (exec?.name() !== 'exec') return { argv };
  scope.push(exec);
  const id = operandAt(argv, at + 1, scope);
  // The command's first word, when it comes before any `--`.
  const first = id < 0 ? -1 : operandAt(argv, id + 1, scope);
  if (first < 0) return { argv };
  const end = argv.indexOf('--', first);
  const word = argv.slice(first + 1, end < 0 ? undefined : end).find(optionLike);
  if (word === undefined) return { argv };
  return {
    argv,
    refused: {
      cmd: exec,
      json: argv.slice(0, first).includes('--json'),
      message: `sandbox exec: ${JSON.stringify(word)} after the command's first word ${JSON.stringify(argv[first])} would be taken as this CLI's option, not the command's; put the command after --: forkfleet sandbox exec ID [options] -- CMD ARGS...`,
    },
  };
}

/**
 * Runs one command line; resolves with its exit code (services/cli/README.md, "Exit codes").
 * `exit`: how an interrupt (SIGINT) while waiting on operations ends the process, after
 * saying what it leaves running.
 */
export async function main(argv: string[], exit: (code: number) => void = exitWhenFlushed): Promise<number> {
  const program = buildProgram();
  const inv = invocation(program);
  // Ctrl-C while waiting on operations (waiting()): they go on without us; say which, then exit 130.
  const onSigint = (): void => {
    if (inv.progressDrawn) process.stderr.write('\n');
    process.stderr.write(interruptNotice(inv.waits, inv.keySent));
    exit(EXIT.interrupted);
  };
  inv.onInterrupt = onSigint;
  const line = splitLine(program, argv);
  if (line.loadtestArgs) inv.loadtestArgs = line.loadtestArgs;
  try {
    if (line.refused) {
      // As commander refuses a line (exit 2, reported as refusal() describes it).
      if (line.refused.json) program.setOptionValue('json', true);
      line.refused.cmd.error(`error: ${line.refused.message}`, { exitCode: EXIT.usage, code: 'forkfleet.execArgv' });
    }
    await program.parseAsync(line.argv, { from: 'user' });
    return inv.exitCode ?? EXIT.ok;
  } catch (e) {
    // As parsed: a `--json` after `--` is the guest command's (sandbox exec SB -- tool --json).
    const g = program.opts() as Globals;
    const json = g.json === true;
    if (e instanceof CommanderError && e.exitCode === 0) return EXIT.ok; // --help
    if (e instanceof CommanderError && e.code === 'commander.help') {
      // A command that needs a subcommand, given none: commander printed its help on stderr.
      if (json) process.stdout.write(`${JSON.stringify({ error: { kind: 'invalid_argument', message: e.message, field: null, retryable: false, hint: 'forkfleet <command> --help', exitCode: EXIT.usage } })}\n`);
      return EXIT.usage;
    }
    const d = e instanceof CommanderError ? refusal(e, refusedBy.get(e)) : describeError(e, g.api, inv.keySent);
    // One line: a stream of --json events (forkfleet events) stays one JSON object per line.
    // An exec that broke off: what it printed until then, too.
    if (json) process.stdout.write(`${JSON.stringify({ error: d, ...inv.execOutput })}\n`);
    process.stderr.write(`${inv.progressDrawn ? '\n' : ''}forkfleet: ${d.kind}: ${d.message}\n  hint: ${d.hint}\n`);
    return d.exitCode;
  } finally {
    process.off('SIGINT', onSigint);
    inv.client?.close();
  }
}

if (process.argv[1] && resolve(process.argv[1]) === resolve(import.meta.filename)) {
  enterUserCwd(['forkfleet']);
  // The reader of our output went away (`| head`): stop at once, as a tool killed by SIGPIPE
  // would (the shell's 141), not with an unhandled error; an exec's output is not needed.
  process.stdout.on('error', (e: NodeJS.ErrnoException) => {
    if (e.code !== 'EPIPE') throw e;
    process.exit(128 + 13);
  });
  // Nowhere left to report anything: go on without it.
  process.stderr.on('error', () => {});
  // Not process.exit() at once: that cuts piped output short (exitWhenFlushed).
  void main(process.argv.slice(2)).then(exitWhenFlushed);
}
