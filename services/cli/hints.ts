// What to do next, for each error kind the API returns. Pure so that it can be unit-tested.
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { defaultFleetDir } from '../auth/client-credentials.ts';
import { LIMITS } from '../adapters/grpc/convert.ts';

export interface ErrorLike {
  kind?: string;
  message: string;
  field?: string | undefined;
  retryable?: boolean;
  /**
   * The error is an operation's: it ran on the fleet and ended FAILED (the SDK's
   * OperationFailedError), so the API answered and the call itself did not fail.
   */
  operation?: boolean;
  /** The scheduler answered with this error (RpcError.answered): it is reachable, whatever failed behind it. */
  answered?: boolean;
  /**
   * The fleet took the work (it accepted the operation, or the exec's command started) and
   * only its outcome is unknown: the wait for it, or the exec's stream, failed.
   */
  accepted?: boolean;
  /** The command sent an idempotency key (--idempotency-key counts): exec, cp and reads send none, so advice about the key is for the others only. */
  keyed?: boolean;
}

/** An operation that failed on the fleet for a reason of the fleet's (a host lost, a step timed out). */
const FLEET_KINDS = new Set(['unavailable', 'deadline_exceeded', 'internal', 'aborted']);

/** What an exec takes on its stdin, and how to give a command more (the server's field and the CLI's flag). */
const STDIN = `--stdin (at most ${LIMITS.maxStdinBytes >> 20} MiB): copy larger input into the sandbox (\`forkfleet sandbox cp FILE SANDBOX:/tmp/in\`) and have the command read the file`;

/** Proto field path -> the CLI flag or argument that sets it. */
const FLAG_OF_FIELD: Readonly<Record<string, string>> = {
  tenant_id: '--tenant',
  sandbox_id: 'the SANDBOX argument',
  snapshot_id: 'the SNAPSHOT argument',
  host_id: 'the HOST argument',
  count: 'the COUNT argument (1..256)',
  image: '--image',
  argv: 'the command after --',
  'resources.memory_mib': '--memory',
  'resources.vcpus': '--vcpus',
  'resources.disk_mib': `the SDK's diskMib (the CLI asks for the default, ${LIMITS.defaultDiskMib} MiB)`,
  'lifecycle.ttl': '--ttl',
  'lifecycle.idle_timeout': '--idle-timeout',
  snapshot_retention: '--snapshot-ttl / --snapshot-keep-last (only when forking a live SANDBOX)',
  'snapshot_retention.ttl': '--snapshot-ttl (at least 1s)',
  'snapshot_retention.keep_last': '--snapshot-keep-last',
  timeout: '--exec-timeout (at most 1h)',
  'retention.ttl': '--ttl',
  path: 'the guest path',
  'header.path': 'the guest path',
  'header.mode': '--mode',
  cwd: '--cwd',
  stdin: STDIN,
  '--stdin': STDIN,
  env: '--env',
  labels: '--label',
  after_revision: '--after',
  token: 'the token (FF_TOKEN, or "token" in the credentials file): no spaces, line endings or other control characters',
  'placement.max_per_host': '--max-per-host',
  'placement.spread': '--spread',
  'placement.host_id': '--host',
  'placement.locality': '--locality',
  lineage_id: '--lineage',
  idempotency_key: '--idempotency-key',
  credentials: '--credentials (the file it names)',
  FF_CREDENTIALS: 'FF_CREDENTIALS (the file it names)',
};

/** Fields that name what a call acts on: not found, it is the id (or the tenant) to check, with `ls`. */
const ID_FIELDS: ReadonlySet<string> = new Set(['tenant_id', 'sandbox_id', 'snapshot_id', 'host_id', 'operation_id', 'lineage_id']);

/**
 * The flag or argument that sets `field`: a map entry's (`env["FFE_X"]`, `labels["team"]`) or a
 * list element's (`argv[0]`) is its map's or list's. A field of the CLI's own (`--memory`) is
 * the flag itself. Undefined when it is neither.
 */
function flagOf(field: string): string | undefined {
  return FLAG_OF_FIELD[field.replace(/\[.*\]$/, '')] ?? (field.startsWith('--') ? field : undefined);
}

export function hintFor(e: ErrorLike, api: string): string {
  // A placement no host was eligible for (cordoned, draining or down hosts, a locality or pin
  // none meets): no freed capacity helps, a host uncordoned, back or added does.
  if (/no host is eligible for this|no other host can take it now|no uncordoned host is ready/.test(e.message)) {
    return `no host could take it as the fleet is now (the message says why, host by host): see the hosts with \`forkfleet hosts ls\`; uncordon one (\`forkfleet hosts cordon HOST --undo\`), wait for one that is down, or add one${e.retryable ? '; running the command again may succeed once one is back' : ''}`;
  }
  if (e.operation && FLEET_KINDS.has(e.kind ?? '')) {
    const again = e.retryable ? 'running the command again may succeed' : 'running it again will likely fail the same way';
    return `the operation ran and failed on the fleet (the API is reachable): see the sandboxes' states with \`forkfleet sandbox ls\` and the hosts' with \`forkfleet hosts ls\`; ${again}`;
  }
  switch (e.kind) {
    case 'invalid_argument': {
      const flag = e.field ? (flagOf(e.field) ?? `field ${e.field}`) : undefined;
      return flag ? `check ${flag}` : 'check the arguments (forkfleet <command> --help)';
    }
    case 'not_found': {
      // Not an id but something a flag names (--cwd, a guest path): `ls` would not show it.
      const flag = e.field && !ID_FIELDS.has(e.field) ? flagOf(e.field) : undefined;
      if (flag) return `check ${flag}: what it names is not there${e.field === 'cwd' || /path/.test(e.field ?? '') ? ' in the sandbox' : ''}`;
      return 'list what exists with `forkfleet sandbox ls` (or `forkfleet snapshot ls`, `forkfleet hosts ls`); ids are per tenant, so check --tenant too';
    }
    case 'unavailable':
      if (/certificate|ssl|tls|handshake/i.test(e.message)) return "the scheduler's TLS certificate is not trusted: set FF_CA to its CA (the local fleet's is <fleet dir>/pki/ca.crt) or use --credentials";
      // The scheduler answered, but etcd did not: work already submitted goes on once it is back.
      if (/fleet store is unavailable/.test(e.message)) return 'the scheduler cannot reach etcd just now (`forkfleet fleet status` shows the local fleet\'s); an operation it accepted goes on: retry in a few seconds, and see what already ran with `forkfleet operation ls`';
      // Answered: a host or a guest behind the scheduler, not the fleet's API.
      if (e.answered) return 'the scheduler answered, but something behind it did not (a host agent, or the sandbox\'s guest): retry in a few seconds, and see the hosts with `forkfleet hosts ls`';
      return `is the fleet up at ${api}? start one with \`npm run fleet:up\` (or \`forkfleet fleet up\`), or point --api / FF_API at a scheduler`;
    case 'deadline_exceeded':
      return 'the call took too long; the operation may still finish: check with `forkfleet sandbox ls`, or retry with a larger --timeout';
    case 'failed_precondition': {
      // A revision to resume events from that the store no longer keeps (compacted away).
      if (e.field === 'after_revision') return 'the store no longer keeps events that old: see the current state (`forkfleet sandbox ls`), then follow from now without --after (or with a later revision)';
      // A flag's value in the wrong state (--cwd the guest refuses to enter), not the sandbox's.
      const flag = e.field && !ID_FIELDS.has(e.field) ? flagOf(e.field) : undefined;
      if (flag) return `check ${flag}`;
      // The local fleet's commands, pointed at a directory with no fleet in it.
      if (/has processes that are not running/.test(e.message)) return 'start the process named again (`npm run fleet:restart -- NAME`; `npm run fleet:status` lists them), or take the fleet down (`npm run fleet:down`) and bring it up afresh';
      if (/^no fleet in /.test(e.message)) return 'start one with `npm run fleet:up` (or `forkfleet fleet up`), or point --dir (FF_FLEET_DIR) at the fleet\'s directory';
      // "sandbox sb-... is paused; it must be running": say how to get it there.
      const paused = /sandbox (sb-[A-Za-z0-9_-]+) is paused/.exec(e.message);
      if (paused) return `resume it first: \`forkfleet sandbox resume ${paused[1]}\` (a hibernated sandbox wakes by itself; a paused one stays paused until resumed)`;
      return 'the sandbox or snapshot is in the wrong state for this; see its state with `forkfleet sandbox get ID` (or `forkfleet sandbox ls`)';
    }
    case 'resource_exhausted': {
      if (e.field?.startsWith('quotas.')) return "your tenant's quota is used up: destroy sandboxes (`forkfleet sandbox destroy`) or delete snapshots, or ask an admin for a larger quota";
      if (e.field === 'rate') return 'too many requests for your tenant; wait a moment and run the command again';
      if (e.field === 'streams') return 'too many exec/file/watch streams open with this credential; let some finish';
      // The guest refused a file call on the path for want of space (host-agent/adapters/guest
      // pathError: not retryable): the sandbox's own disk, which no freed fleet capacity helps.
      if (e.field === 'path' || e.field === 'header.path') return `the sandbox's file system is full: free space in it (\`forkfleet sandbox exec SANDBOX -- df -h\` shows how full it is; \`forkfleet sandbox exec SANDBOX -- rm ...\` frees some), or use a sandbox with a larger disk: ${flagOf('resources.disk_mib')}`;
      // The scheduler's bound on file bytes it holds at once (ByteBudget, FF_FILE_BUFFER_MAX;
      // one tenant at most half of it): other transfers hold it, and it passes as they end.
      if (e.field === 'data' || e.field === 'max_bytes') return 'the scheduler holds as many file bytes for transfers as it may just now (FF_FILE_BUFFER_MAX; one tenant at most half of it): let the file copies under way (`forkfleet sandbox cp`, yours or other tenants) end, then run the command again; an operator can raise FF_FILE_BUFFER_MAX';
      // Output or events that came faster than this client read them (a slow reader of its
      // output, e.g. a pipe): no capacity is missing.
      if (!e.field && /exec output not read/.test(e.message)) return "the command's output came faster than it was read (whatever reads this command's output was slow), so the fleet stopped the command: write a large output to a file in the sandbox and copy it out with `forkfleet sandbox cp`";
      if (!e.field && /events wait unread/.test(e.message)) return 'events came faster than they were read: read them faster, and follow again with --after the revision the message names';
      // A create larger than any host of the fleet, even empty (the field names the resource):
      // freeing capacity cannot place it, asking for less of that resource can.
      const resource = e.field?.startsWith('resources.') ? flagOf(e.field) : undefined;
      if (resource) return `no host of the fleet is that large, even empty: ask for less with ${resource}, or add a larger host; see \`forkfleet hosts ls\``;
      return 'no capacity: free some with `forkfleet sandbox destroy`, or add hosts; see `forkfleet hosts ls`';
    }
    case 'already_exists':
      return e.keyed ? 'it exists already; reuse it, or pass a new --idempotency-key' : 'it exists already; reuse it';
    case 'aborted':
      return 'a concurrent change conflicted; run the command again';
    case 'unauthenticated':
      return 'no valid credential: set FF_TOKEN and FF_CA, or --credentials FILE (the local fleet writes credentials.json in its directory)';
    case 'permission_denied':
      return e.field === 'tenant_id' ? "your credential acts for its own tenant only: drop --tenant (or FF_TENANT)" : 'this needs an admin credential';
    case 'cancelled':
      // An operation someone cancelled (CancelOperation), or this call interrupted.
      return e.operation ? 'the operation was cancelled (`forkfleet operation cancel`); what it started was destroyed: see `forkfleet operation get OP`' : 'the call was cancelled';
    default:
      return `see the scheduler logs (npm run fleet:status shows where they are)`;
  }
}

/**
 * The CLI's exit codes (services/cli/README.md lists them; `sandbox exec` passes the guest
 * command's through instead when it has one).
 */
export const EXIT = {
  ok: 0,
  /** The API refused the call, an operation failed, or a local error. */
  error: 1,
  /** Bad arguments (the message names the flag). */
  usage: 2,
  /** The fleet's API could not be reached (EX_UNAVAILABLE): nothing was taken. */
  unavailable: 69,
  /** Accepted or started, outcome unknown (EX_TEMPFAIL): an operation whose wait failed, an exec whose stream broke off. */
  unknownOutcome: 75,
  /** Interrupted (SIGINT, 128 + 2). */
  interrupted: 130,
} as const;

export function exitCodeFor(e: ErrorLike): number {
  if (e.accepted) return EXIT.unknownOutcome;
  if (e.kind === 'invalid_argument') return EXIT.usage;
  if (e.kind === 'unavailable' && !e.operation && !e.answered) return EXIT.unavailable;
  return EXIT.error;
}

/** --api default: FF_API, else the local fleet's state.json, else 127.0.0.1:17700. */
export function defaultApi(env: NodeJS.ProcessEnv = process.env): string {
  if (env.FF_API) return env.FF_API;
  const p = join(defaultFleetDir(env), 'state.json');
  if (existsSync(p)) {
    try {
      const s = JSON.parse(readFileSync(p, 'utf8')) as { apiAddresses?: string[] };
      if (s.apiAddresses && s.apiAddresses.length > 0) return s.apiAddresses.join(',');
    } catch {
      /* fall through */
    }
  }
  return '127.0.0.1:17700';
}
