// qemu-guest-agent client over the host end of a virtio-serial port (a unix socket served by
// QEMU). The channel carries no request ids, and bytes in flight when a snapshot was taken are
// replayed to every clone, so: one request at a time, and `sync()` (guest-sync-delimited with a
// fresh id) before first use, after every restore, and after any timeout.
import { randomBytes, randomInt } from 'node:crypto';
import type net from 'node:net';
import type { Logger } from 'pino';
import { ChannelClosedError, GuestAgentCommandError, GuestAgentTimeoutError, GuestChmodError, InvalidArgumentError } from '../../errors.ts';
import type { ExecRequest, ExecResult } from '../../domain/vmm.ts';
import { ForkfleetError } from '../../../proto/errors.ts';
import { connectUnix } from '../unix-connect.ts';

/**
 * What the exec wrapper hands qemu-ga of each stream. qemu-ga holds a program's whole output
 * in memory and sends it as one base64 JSON answer: 8 MB of stdout got qemu-ga OOM-killed in a
 * 128 MiB guest (the kernel's log said so; nothing restarts it, so the sandbox lost its guest
 * agent for good). Past this, the wrapper leaves the stream's file for the host to read in
 * pieces (readLeftOutput).
 */
export const EXEC_HANDED_BYTES = 1 << 20;
/** The most of one stream's output an exec returns; past it the result says outputTruncated. */
export const EXEC_MAX_OUTPUT_BYTES = 64 << 20;
/** The most of each stream this client's own execs take (chmod, the reaping of orphans): a line or a number is all they print. */
const HELPER_OUTPUT_BYTES = 4096;

/**
 * How a caller's variables reach the program. Their values travel only in environments (each
 * process's /proc/<pid>/environ is readable by its owner only), never in a command line (any
 * guest user reads /proc/<pid>/cmdline, ps shows it): qemu-ga's `env` carries each one as
 * FFE_<NAME>=VALUE, and the wrapper's arguments name them (names are no secret). qemu-ga 7.2's
 * `env` replaces the environment (no PATH, no HOME), so a wrapper given variables first takes
 * back the guest's own from its parent's, qemu-ga's, initial environment (RESTORE_BASE): the
 * wrapper and its wc, cat, head and rm run as they would without variables. Then, in the
 * process that becomes the program, each NAME is exported from FFE_NAME and FFE_NAME unset
 * (EXPORT_NAMES). Without variables qemu-ga's `env` is not set and none of this runs.
 *
 * Hence the prefixes of the names the wrappers keep for themselves: `_ff_` their own variables
 * (EXEC_WRAPPER's, EXEC_DIRECT's), `FFE_` a caller's variable on its way in. A caller's
 * variable may not be named so: refused here (exportsOf) and at the API
 * (services/adapters/grpc/convert.ts env()).
 */
export const RESERVED_ENV_PREFIXES: readonly string[] = Object.freeze(['_ff_', 'FFE_']);

/** RESTORE_BASE's stand-in for a newline inside a value of qemu-ga's environment (`tr` makes one). */
const SOH = '\u0001';

/**
 * Sh function `_ff_base`: exports each NAME=VALUE of /proc/$PPID/environ (qemu-ga's initial
 * environment: NUL-separated, read through `tr`, one process) whose NAME a shell takes and is
 * not a reserved one (RESERVED_ENV_PREFIXES); an entry whose value holds a newline (a line
 * that may not be an entry of its own) is left out, as is one the shell cannot hold. PWD is
 * the shell's own (as it makes it at its start; qemu-ga's may be stale). Nothing is
 * evaluated: `export "NAME=VALUE"` takes the value as it is.
 */
const RESTORE_BASE = [
  '_ff_base() {',
  '  while IFS= read -r _ff_e; do',
  '    _ff_k=${_ff_e%%=*}',
  '    case $_ff_k in "$_ff_e"|""|[0-9]*|*[!A-Za-z0-9_]*|FFE_*|_ff_*) continue;; esac',
  `    case $_ff_e in *"${SOH}"*) continue;; PWD=*) export PWD; continue;; esac`,
  '    export "$_ff_e"',
  '  done <<_ff_EOF',
  `$(tr '\\000\\n' '\\n\\001' 2>/dev/null <"/proc/$PPID/environ")`,
  '_ff_EOF',
  '}',
].join('\n');

/**
 * Exports the caller's variables: "$1".."$_ff_n" name them, FFE_<NAME> holds each one's value
 * (and is unset), the names are shifted off. The names are of [A-Za-z_][A-Za-z0-9_]* only
 * (exportsOf checks them), so the eval runs nothing but the export and the unset.
 */
const EXPORT_NAMES = 'while [ "$_ff_n" -gt 0 ]; do eval "export $1=\\"\\$FFE_$1\\"; unset FFE_$1"; shift; _ff_n=$((_ff_n-1)); done';

/**
 * The wrapper's last line: how EXEC_END_NAMED tells a wrapper (its $0 follows this in its
 * command line) from any other process that has the call's nonce among its arguments.
 */
const WRAPPER_TAIL = '# ff-exec-wrapper-end';

/**
 * Arguments: $1 the most of each stream to hand qemu-ga, $2 the directory to run in (empty:
 * qemu-ga's), $3 how many caller variables follow, then their NAMES (values in FFE_<NAME>:
 * see RESERVED_ENV_PREFIXES), then the program and its arguments ("$@" after those). The
 * variables are added to the environment the guest gives qemu-ga's programs, not replacing it.
 * Runs the program with stdout and stderr in files, copies them to its own (qemu-ga's pipes)
 * and ends as the program did (GuestAgent.exec). The files are in the caller's TMPDIR if the
 * caller's variables have one (an empty one: /tmp), else in /tmp, never a TMPDIR of qemu-ga's:
 * the host names them by the same rule (wrapperDir). A directory it cannot enter ends it with
 * status 125 and a last stderr line "$0 cwd-<why>" (missing, notdir or denied), before any
 * file is made, so the host can tell a bad working directory from a program's own exit
 * (cwdRefusal). A file longer than the most to hand is copied only that far and left in place;
 * the wrapper then ends stderr with a line "$0 out err" naming what it left ($0 is
 * `ff-exec-<instance>-<nonce>`, a nonce of the call, which the host takes off again). Where no
 * file can be made (no writable directory) the program runs directly, as it would without the
 * wrapper. Only the shell's own commands and `rm` run for a program that writes nothing (and
 * `tr` given variables); `wc` and `cat` for each stream it wrote: each process costs ~5-10 ms
 * under TCG.
 *
 * The wrapper's own variables are named _ff_* and the caller's are exported only in the
 * subshell that becomes the program, after its output is redirected: a caller's `f` or `n`
 * changes nothing of the wrapper's.
 *
 * A program ended by a signal: the shell only says 128+N, so after its clean-up the wrapper
 * ends itself by the same signal (with core dumps off: the program's own core file stays the
 * one there), and qemu-ga reports the signal as it does for a program run without the wrapper.
 * A shell cannot tell that from a program's own `exit 128+N`, which is reported as signal N
 * too (the stop signals excepted: a shell never waits out a stopped child). What the shell
 * itself writes while the program runs (bash's "Killed") goes nowhere, not into the
 * program's stderr.
 */
const EXEC_WRAPPER = [
  '_ff_h=$1; _ff_c=$2; _ff_n=$3; shift 3',
  RESTORE_BASE,
  // qemu-ga's `env` is set only with variables: FFE_TMPDIR is then the caller's, if any. Named
  // before the cd: a relative TMPDIR means what it means to the host's file reads and EXEC_KILL.
  '_ff_t=/tmp; if [ "$_ff_n" -gt 0 ]; then _ff_t=${FFE_TMPDIR:-/tmp}; _ff_base; fi',
  '_ff_f="$_ff_t/.ff-exec-$$"',
  'case $_ff_f in /*) ;; *) _ff_f="$PWD/$_ff_f" ;; esac',
  'if [ -n "$_ff_c" ] && ! cd "$_ff_c" 2>/dev/null; then if [ ! -e "$_ff_c" ]; then _ff_c=missing; elif [ ! -d "$_ff_c" ]; then _ff_c=notdir; else _ff_c=denied; fi; printf \'\\n%s cwd-%s\\n\' "$0" "$_ff_c" >&2; exit 125; fi',
  // `true`, not `:`: a redirection that fails on a special builtin (`:`) ends a non-interactive
  // shell (dash with 2, busybox with 1, nothing said), and the program would never run.
  `if ! true 2>/dev/null >"$_ff_f.out"; then ${EXPORT_NAMES}; exec "$@"; fi`,
  // The shell notes a child's death by a signal ("Segmentation fault") on its own stderr, and
  // dash and busybox do so with a simple command's redirections still in place (the
  // program's stderr file) or a subshell's already undone: its stderr is /dev/null meanwhile,
  // and the program a subshell that becomes it (fd 3, the saved stderr, closed). The
  // subshell redirects first: no variable of the caller's is exported yet.
  'exec 3>&2 2>/dev/null',
  `( exec >"$_ff_f.out" 2>"$_ff_f.err" 3>&-; ${EXPORT_NAMES}; exec "$@" )`,
  '_ff_r=$?',
  'exec 2>&3 3>&-',
  '_ff_k=',
  'if [ -s "$_ff_f.out" ]; then if [ "$(wc -c <"$_ff_f.out")" -gt "$_ff_h" ]; then _ff_k=" out"; head -c "$_ff_h" "$_ff_f.out"; else cat "$_ff_f.out"; fi; fi',
  'if [ -s "$_ff_f.err" ]; then if [ "$(wc -c <"$_ff_f.err")" -gt "$_ff_h" ]; then _ff_k="$_ff_k err"; head -c "$_ff_h" "$_ff_f.err" >&2; else cat "$_ff_f.err" >&2; fi; fi',
  'set --',
  'case "$_ff_k" in *out*) ;; *) set -- "$_ff_f.out";; esac',
  'case "$_ff_k" in *err*) ;; *) set -- "$@" "$_ff_f.err";; esac',
  '[ $# -eq 0 ] || rm -f "$@"',
  '[ -z "$_ff_k" ] || printf \'\\n%s%s\\n\' "$0" "$_ff_k" >&2',
  'if [ "$_ff_r" -gt 128 ] && [ "$_ff_r" -le 192 ]; then case "$(kill -l "$_ff_r" 2>/dev/null)" in STOP|TSTP|TTIN|TTOU|"") ;; *) ulimit -c 0 2>/dev/null; kill -$((_ff_r - 128)) $$ 2>/dev/null;; esac; fi',
  'exit $_ff_r',
  WRAPPER_TAIL,
].join('\n');

/**
 * Runs a program without capture, for a call with a directory or variables ($1 the directory,
 * empty for qemu-ga's; $2 how many caller variables follow, then their names, as
 * EXEC_WRAPPER's; then the program): the program replaces the shell, so qemu-ga watches it
 * itself. A directory it cannot enter ends it with the shell's status (there is no stderr to
 * say why). The directory is entered before the caller's variables are exported (their CDPATH
 * does not apply).
 */
const EXEC_DIRECT = ['_ff_c=$1; _ff_n=$2; shift 2', RESTORE_BASE, '[ "$_ff_n" -eq 0 ] || _ff_base', '[ -z "$_ff_c" ] || cd "$_ff_c" || exit', EXPORT_NAMES, 'exec "$@"'].join('\n');

/**
 * Sh function `kill_tree P`: kills every process under P (found through /proc with the shell's
 * own commands; the tree is collected first, then killed, so nothing is re-parented in
 * between), not P itself. Its variables are the shell's globals: t_, m_, d_, q_, k_, v_.
 */
const KILL_TREE = [
  'kill_tree() {',
  '  t_=" $1 "; m_=1',
  '  while [ $m_ = 1 ]; do m_=0',
  '    for d_ in /proc/[0-9]*; do q_=${d_#/proc/}',
  '      case "$t_" in *" $q_ "*) continue;; esac',
  '      while read -r k_ v_; do if [ "$k_" = PPid: ]; then case "$t_" in *" $v_ "*) t_="$t_$q_ "; m_=1;; esac; break; fi; done < "$d_/status"',
  '    done 2>/dev/null',
  '  done',
  '  for q_ in $t_; do [ "$q_" = "$1" ] || kill -KILL "$q_" 2>/dev/null; done',
  '}',
].join('\n');

/**
 * Kills what the wrapper runs ($1 is the wrapper's pid, $2 its stdout file): its child, the
 * program, and every process under it, then continues the wrapper (a program may have stopped
 * it, `kill -STOP $PPID`: stopped, it would never copy out and exit). The wrapper itself lives
 * on to copy out what the program wrote; a program that runs without one (no file) is $1
 * itself.
 */
const EXEC_KILL = [KILL_TREE, 'kill_tree "$1"', 'kill -CONT "$1" 2>/dev/null', '[ -e "$2" ] || kill -KILL "$1" 2>/dev/null', 'exit 0'].join('\n');

/**
 * For a start whose answer never came ($1 is the call's $0, $2 the wrappers' file directory):
 * finds the wrapper by its $0 (EXEC_WRAPPER's WRAPPER_TAIL precedes it in its command line,
 * and nothing else's), kills what it runs and continues it as EXEC_KILL does, and prints its
 * pid. The wrapper's forks that have not exec'd anything (the subshell before it becomes the
 * program, a `$(wc ...)`) have its command line too: a match whose parent matches is one of
 * those, not a wrapper (all are matched first, then sorted out, before anything is killed).
 */
const EXEC_END_NAMED = [
  KILL_TREE,
  'm=" "; e=',
  'for w in /proc/[0-9]*; do',
  `  case "$(tr '\\000' ' ' 2>/dev/null <"$w/cmdline")" in *"${WRAPPER_TAIL} $1 "*) ;; *) continue;; esac`,
  '  p=; while read -r k v; do if [ "$k" = PPid: ]; then p=$v; break; fi; done 2>/dev/null <"$w/status"',
  '  w=${w#/proc/}; m="$m$w "; e="$e $w:$p"',
  'done',
  'for w in $e; do',
  '  p=${w#*:}; w=${w%:*}',
  '  case "$m" in *" $p "*) continue;; esac',
  '  kill_tree "$w"; kill -CONT "$w" 2>/dev/null',
  '  [ -e "$2/.ff-exec-$w.out" ] || kill -KILL "$w" 2>/dev/null',
  '  echo "$w"',
  'done',
].join('\n');

/**
 * Names this agent process's exec wrappers ($0 is `ff-exec-<instance>-<nonce>`), so that a
 * later agent on the same VM (after a crash or a restart) can tell the wrappers nobody polls
 * any more from its own. (A driver may name its own: GuestAgentClient.connect's `instance`.)
 */
const AGENT_INSTANCE = randomBytes(4).toString('hex');

/**
 * Run once a restarted agent has adopted a VM ($1 is the new agent's instance): the execs the
 * previous agent ran (wrappers whose $0 names another instance) can no longer be answered or
 * timed out by anyone, so their programs are killed as a timeout would have, their wrappers
 * (continued, if stopped) exit, and the output files in /tmp of wrappers that are gone are
 * removed (also the ones a wrapper left for a reader that died). Prints how many execs it
 * ended. The wrappers are found by their command lines, as EXEC_END_NAMED finds one, wherever
 * their files are: found by their files in /tmp, a wrapper whose caller gave another TMPDIR
 * ran on, unsupervised, in every sandbox restored from a snapshot taken while it ran. (Its
 * files in that TMPDIR stay.) `t` is built in two parts so that this script's own command
 * line does not match it.
 */
const REAP_ORPHAN_EXECS = [
  KILL_TREE,
  'cmd_of() { tr \'\\000\' \' \' <"/proc/$1/cmdline" 2>/dev/null; }',
  'wrapper() { case "$(cmd_of "$1")" in *" ff-exec-"*) return 0;; esac; return 1; }',
  'pid_of() { w_=${1##*/.ff-exec-}; w_=${w_%.*}; case "$w_" in ""|*[!0-9]*) w_=;; esac; }',
  `t="${WRAPPER_TAIL} ff-""exec-"`,
  // Every wrapper of another instance, and the forks of one (a match whose parent matches).
  'm=" "; e=',
  'for w in /proc/[0-9]*; do',
  // A wrapper is a shell: its name read by a builtin first, so that a command line is read
  // (a fork of tr) only for shells. Read for every process, the scan took seconds in a
  // loaded TCG guest, and an inherited program ran on meanwhile.
  '  c=; read -r c 2>/dev/null <"$w/comm"; case $c in sh|dash|ash|bash|busybox) ;; *) continue;; esac',
  '  case "$(cmd_of "${w#/proc/}")" in *"$t$1-"*) continue;; *"$t"*) ;; *) continue;; esac',
  '  p=; while read -r k v; do if [ "$k" = PPid: ]; then p=$v; break; fi; done 2>/dev/null <"$w/status"',
  '  w=${w#/proc/}; m="$m$w "; e="$e $w:$p"',
  'done',
  'ended=',
  'for w in $e; do',
  '  p=${w#*:}; w=${w%:*}',
  '  case "$m" in *" $p "*) continue;; esac',
  '  kill_tree "$w"; kill -CONT "$w" 2>/dev/null; ended="$ended $w"',
  'done',
  // And by their files in /tmp, as before: a wrapper of an agent older than WRAPPER_TAIL.
  'for f in /tmp/.ff-exec-*.out; do',
  '  pid_of "$f"; [ -n "$w_" ] && [ -d "/proc/$w_" ] && wrapper "$w_" || continue',
  '  case "$m" in *" $w_ "*) continue;; esac',
  '  case "$(cmd_of "$w_")" in *" ff-exec-$1-"*) continue;; esac',
  '  kill_tree "$w_"; kill -CONT "$w_" 2>/dev/null; ended="$ended $w_"',
  'done',
  'n=0; while [ -n "$ended" ] && [ $n -lt 50 ]; do a_=; for w in $ended; do [ -d "/proc/$w" ] && a_=1; done; [ -z "$a_" ] && break; sleep 0.1; n=$((n+1)); done',
  'for f in /tmp/.ff-exec-*.out /tmp/.ff-exec-*.err; do',
  '  pid_of "$f"; [ -n "$w_" ] || continue',
  '  [ -d "/proc/$w_" ] && wrapper "$w_" && continue',
  '  rm -f "$f"',
  'done',
  'set -- $ended; echo $#',
].join('\n');

/**
 * The times an exec's supervision runs on (GuestAgentClient.connect's `timing` replaces them;
 * tests shorten them).
 */
export interface ExecTimings {
  /**
   * How long an exec's start (guest-exec, answered with the pid) may take, whatever the exec's
   * own timeout. The start given only the exec's timeout (down to 1 ms from the API, while a
   * start takes 15-25 ms under TCG) failed late and left the program running with no one to
   * time it out or kill it; given this, the program started late is timed out and killed by
   * the poll loop, against the exec's own deadline.
   */
  startMinMs: number;
  /** How long one status poll of a running exec, or a kill, waits for its answer. */
  pollTimeoutMs: number;
  /**
   * How long a killed program has to be seen to exit (and its output to be copied out) before
   * exec gives up on it and answers its caller with an error; the kill goes on (endLater).
   */
  killGraceMs: number;
  /** How often the kill is sent again while the killed program has not exited. */
  killAgainMs: number;
  /** The longest wait between tries of ending an exec given up on, while the guest does not answer (endLater). */
  endLaterMaxWaitMs: number;
  /**
   * How long endLater tries to end an exec given up on before it stops trying (and logs it):
   * a guest that never answers again, or a program no kill ends, is not tried for good.
   */
  endLaterGiveUpMs: number;
}

export const EXEC_TIMINGS: Readonly<ExecTimings> = Object.freeze({ startMinMs: 10_000, pollTimeoutMs: 10_000, killGraceMs: 5000, killAgainMs: 1000, endLaterMaxWaitMs: 30_000, endLaterGiveUpMs: 10 * 60_000 });

type ExecStatus = {
  exited: boolean;
  exitcode?: number;
  signal?: number;
  'out-data'?: string;
  'err-data'?: string;
  'out-truncated'?: boolean;
  'err-truncated'?: boolean;
};

/** What endLater needs of an exec its caller no longer waits for. */
interface Abandoned {
  /** The wrapper's $0 (EXEC_WRAPPER), by which a start never answered is found. */
  zero: string;
  capture: boolean;
  env: readonly string[] | undefined;
  /** Known once the start was answered. */
  pid?: number;
  /** Live-output handles still open. */
  handles?: number[];
  /** Kills and removals started, whose records qemu-ga keeps until asked. */
  helpers?: number[];
}

/**
 * The most wrappers endLater takes a search for one (findWrappers) to have found: a nonce is
 * one call's, so there is one; a guest naming thousands would have each one polled and killed,
 * on every try.
 */
const MAX_WRAPPERS_FOUND = 4;

/** A command not sent because its caller's signal aborted while it waited for the channel. */
class NotSentError extends Error {}

/**
 * The caller's NAME=VALUE entries as the wrappers take them (RESERVED_ENV_PREFIXES): `names`
 * for their arguments, `env` (FFE_NAME=VALUE) for qemu-ga's `env`. Names are ones a shell
 * takes (the wrappers export and eval them), as the API's are, and not reserved ones; a name
 * given twice has its last value.
 */
function exportsOf(env: readonly string[] | undefined): { names: string[]; env: string[] } {
  const values = new Map<string, string>();
  (env ?? []).forEach((e, i) => {
    if (!/^[A-Za-z_][A-Za-z0-9_]*=/.test(e)) throw new InvalidArgumentError(`env[${i}]`, 'must be NAME=VALUE, NAME of A-Z, a-z, 0-9 and _, not starting with a digit');
    if (e.includes('\0')) throw new InvalidArgumentError(`env[${i}]`, 'must not contain NUL');
    const name = e.slice(0, e.indexOf('='));
    if (RESERVED_ENV_PREFIXES.some((p) => name.startsWith(p))) throw new InvalidArgumentError(`env[${JSON.stringify(name)}]`, `names starting ${RESERVED_ENV_PREFIXES.join(' or ')} are reserved for the guest exec wrapper`);
    values.delete(name);
    values.set(name, e.slice(name.length + 1));
  });
  return { names: [...values.keys()], env: [...values].map(([k, v]) => `FFE_${k}=${v}`) };
}

type GuestExecArgs = { path: string; arg: string[]; env?: string[]; 'capture-output': boolean; 'input-data'?: string };

/**
 * What guest-exec is given for `req` (`zero` the wrapper's $0, `max` the most of each stream
 * returned): the program under EXEC_WRAPPER with output captured; without capture, directly
 * or, for a directory or variables, under EXEC_DIRECT. qemu-ga's own `env` is set only with
 * variables, and then holds only them, as FFE_NAME=VALUE (it replaces the guest's environment,
 * which the wrappers take back: RESERVED_ENV_PREFIXES); no value is ever in an argument.
 */
function guestExecArgs(req: ExecRequest, zero: string, max = EXEC_MAX_OUTPUT_BYTES): GuestExecArgs {
  const vars = exportsOf(req.env);
  const run = [req.cwd ?? '', String(vars.names.length), ...vars.names, req.path, ...(req.args ?? [])];
  const env = vars.names.length ? { env: vars.env } : {};
  const args: GuestExecArgs =
    (req.captureOutput ?? true)
      ? { path: '/bin/sh', arg: ['-c', EXEC_WRAPPER, zero, String(Math.min(EXEC_HANDED_BYTES, max)), ...run], ...env, 'capture-output': true }
      : req.cwd || vars.names.length
        ? { path: '/bin/sh', arg: ['-c', EXEC_DIRECT, 'ff-run', ...run], ...env, 'capture-output': false }
        : { path: req.path, arg: req.args ?? [], 'capture-output': false };
  if (req.stdin) args['input-data'] = req.stdin.toString('base64');
  return args;
}

const sleep = (ms: number, unref = false): Promise<void> =>
  new Promise((r) => {
    const t = setTimeout(r, ms);
    if (unref) t.unref();
  });

/**
 * With `onOutput`, a program still running after this long has its output files read while
 * it runs, at most every LIVE_READ_EVERY_MS (two guest-file-reads each time): short execs
 * pay nothing for it.
 */
const LIVE_AFTER_MS = 300;
const LIVE_READ_EVERY_MS = 250;

/** `maxBytes`: the longest line it takes (replyCap); a longer one closes the channel. */
type Reader = { delimited: boolean; maxBytes: number; resolve: (line: string) => void; reject: (e: Error) => void };

const SYNC_FLUSH = Buffer.from([0xff]);

/**
 * The most the channel holds of an answer not yet complete: the largest reply qemu-ga sends
 * is guest-exec-status with 16 MiB of captured stdout *and* 16 MiB of stderr, ~42.7 MiB in
 * base64. The guest is the tenant's: one that writes more than this without a newline (or
 * floods the port) gets its channel closed, not the agent's memory (the next call connects
 * again). Each command's answer has a tighter cap of its own (replyCap).
 */
export const MAX_PENDING_REPLY_BYTES = 48 << 20;

/** qemu-ga's own cap on each stream a guest-exec-status carries (GUEST_EXEC_MAX_OUTPUT). */
const QGA_MAX_OUTPUT_BYTES = 16 << 20;

/**
 * The longest answer to a command that carries no file bytes nor program output (a sync, a
 * pid, a handle, a clock, a helper's status), or the refusal of any command: qemu-ga's error
 * names the path, each byte of it not ASCII written as 6 characters (a 4 KiB path: 24 KiB).
 */
const SMALL_REPLY_BYTES = 64 << 10;

const base64Length = (bytes: number): number => Math.ceil(bytes / 3) * 4;

/**
 * The longest answer `execute` may have (`args` its arguments): a file read's base64 of what
 * it asked for, an exec status both streams at qemu-ga's cap, anything else SMALL_REPLY_BYTES.
 * A guest answering with more gets its channel closed before the answer is parsed: a line of
 * tens of MiB costs the agent's event loop, every sandbox's, its parse.
 */
function replyCap(execute: string, args: Record<string, unknown> | undefined): number {
  if (execute === 'guest-file-read') return base64Length(typeof args?.count === 'number' ? args.count : 0) + SMALL_REPLY_BYTES;
  if (execute === 'guest-exec-status') return 2 * base64Length(QGA_MAX_OUTPUT_BYTES) + SMALL_REPLY_BYTES;
  return SMALL_REPLY_BYTES;
}

/**
 * The most of JSON's structure (`{`, `[`, `,` and `:` outside strings) an answer may have: qemu-ga's have a few dozen. What JSON.parse takes long over is
 * structure, not length: 38 MiB of nested arrays under the cap blocked the event loop 6.5 s (a
 * flat array as long: 0.5 s and ~150 MB), 40 MiB of base64 in a string ~50 ms.
 */
const MAX_REPLY_STRUCTURES = 1024;

/**
 * Whether `line` has at most MAX_REPLY_STRUCTURES, counted before it is parsed. A string is
 * skipped to its closing quote by indexOf (one native scan for a long one: base64 output).
 */
function plainEnough(line: Buffer): boolean {
  let n = 0;
  for (let i = 0; i < line.length; i++) {
    const c = line[i];
    if (c === 0x22) {
      while (true) {
        const q = line.indexOf(0x22, i + 1);
        if (q < 0) return true; // a string without its end: JSON.parse refuses it in one pass
        let backslashes = 0;
        while (line[q - 1 - backslashes] === 0x5c) backslashes++;
        i = q;
        // An escaped quote makes no structure (qemu-ga's error repeats a path of quotes so).
        if (backslashes % 2 === 0) break;
      }
    } else if (c === 0x7b || c === 0x5b || c === 0x2c || c === 0x3a) {
      if (++n > MAX_REPLY_STRUCTURES) return false;
    }
  }
  return true;
}

/** How many of something are under way, and a wait for there to be none. */
class Count {
  private n = 0;
  private waiting: Array<() => void> = [];

  get count(): number {
    return this.n;
  }

  up(): void {
    this.n++;
  }

  down(): void {
    if (--this.n === 0) for (const r of this.waiting.splice(0)) r();
  }

  /** Resolves once there are none (at once if there are none now). */
  none(): Promise<void> {
    return this.n === 0 ? Promise.resolve() : new Promise((r) => this.waiting.push(r));
  }
}

export class GuestAgentClient {
  private sock!: net.Socket;
  /** Received bytes up to the last line end seen (and what follows it in that piece). */
  private buf: Buffer = Buffer.alloc(0);
  /** Pieces received after `buf` with no line end yet. */
  private parts: Buffer[] = [];
  private partLen = 0;
  private reader: Reader | undefined;
  private closedError: Error | undefined;
  /** close() was called: the channel stays closed (no reconnect). */
  private shut = false;
  private tail: Promise<unknown> = Promise.resolve();
  private synced = false;
  /**
   * A file write (writeFile) and a hold exclude each other: a write is several commands, and a
   * hold granted between them would snapshot the guest with the file half written (the open
   * truncates it). `writes`: writes begun and not ended; a hold is queued once there are none.
   * `holds`: holds asked for and not yet released; no write begins while there is one (one
   * asked for included, so writes coming one after another cannot put a hold off for ever).
   */
  private readonly writes = new Count();
  private readonly holds = new Count();
  /** Execs begun and not ended (execsRunning). */
  private readonly execs = new Count();

  private constructor(
    private path: string,
    sock: net.Socket,
    /** Names the wrappers of this client's execs (AGENT_INSTANCE). */
    private readonly instance: string,
    private readonly timing: Readonly<ExecTimings>,
    /** Says when endLater stops trying to end an exec (nothing else is logged here). */
    private readonly log: Pick<Logger, 'warn'> | undefined,
  ) {
    this.attach(sock);
  }

  /** Makes `sock` the channel; events of an earlier socket are ignored from then on. */
  private attach(sock: net.Socket): void {
    this.sock = sock;
    sock.on('data', (d: Buffer) => {
      if (sock !== this.sock) return;
      // Bytes no command waits for (a late answer to a timed-out one, or whatever a guest
      // writes unasked) are dropped: the next command resyncs first.
      const r = this.reader;
      if (!r) return;
      // Waiting for a sync's delimiter: everything before it is stale.
      if (r.delimited && !d.includes(0xff)) return void this.dropBuffered();
      if (this.buf.length + this.partLen + d.length > MAX_PENDING_REPLY_BYTES) return void this.refuse(`it sent over ${MAX_PENDING_REPLY_BYTES} bytes without ending a line`);
      // Pieces of a line are joined once its end is here (joining at every piece copies the
      // line again each time: quadratic in a long answer).
      if (d.includes(0x0a) || (r.delimited && d.includes(0xff))) {
        this.buf = this.buf.length || this.parts.length ? Buffer.concat([this.buf, ...this.parts, d]) : d;
        this.parts = [];
        this.partLen = 0;
        this.pump();
      } else {
        this.parts.push(d);
        this.partLen += d.length;
        // Past its sync's delimiter, what is held is the start of the answer (pump takes each
        // whole line at once): refused as soon as it is longer than the answer may be.
        if (this.buf.length + this.partLen > r.maxBytes) this.refuse(overCap(r.maxBytes));
      }
    });
    sock.on('error', (e) => {
      if (sock === this.sock) this.closedError ??= new ChannelClosedError('guest agent', { cause: e });
    });
    sock.on('close', () => {
      if (sock !== this.sock) return;
      this.closedError ??= new ChannelClosedError('guest agent');
      const r = this.reader;
      this.reader = undefined;
      r?.reject(this.closedError);
    });
  }

  static async connect(path: string, timeoutMs = 5000, instance = AGENT_INSTANCE, timing: Partial<ExecTimings> = {}, log?: Pick<Logger, 'warn'>): Promise<GuestAgentClient> {
    if (!/^[0-9a-f]+$/.test(instance)) throw new Error(`guest agent client: instance must be lower-case hex, got ${JSON.stringify(instance)}`);
    return new GuestAgentClient(path, await openSocket(path, timeoutMs), instance, Object.freeze({ ...EXEC_TIMINGS, ...timing }), log);
  }

  close(): void {
    this.shut = true;
    this.sock.destroy();
  }

  /**
   * Holds the channel while the guest's QEMU is replaced under it (a template snapshot swaps
   * the process; the guest, its qemu-ga and qemu-ga's table of running execs carry on in the
   * replacement). Resolves once the file writes begun before it have ended (writeFile: each is
   * one whole, never split by a snapshot) and then the commands queued before it are answered;
   * commands queued from then on (a running exec's status polls, its kill) wait, without their
   * timeouts running, until the returned function is called, and no file write begins from the
   * call of hold() until then. Commands queued while a write ends go before the hold. A write
   * that takes long keeps the hold waiting as long as a slow command does: the caller's bound
   * on the wait (closing the channel) ends it, failing the write. `release(path)` moves the
   * channel to the replacement's socket: the next command connects there and resyncs.
   * `release()` keeps the socket it had. Call it exactly once, on every path.
   */
  hold(): Promise<(movedTo?: string) => void> {
    this.holds.up();
    return new Promise((held) => {
      // Queued only once no write is under way: queued at once, a write's next command would
      // wait behind the hold, which would wait for the write.
      void this.writes.none().then(() =>
        this.serial(
          () =>
            new Promise<void>((done) => {
              let released = false;
              held((movedTo) => {
                if (released) return;
                released = true;
                if (movedTo !== undefined && movedTo !== this.path && !this.shut) {
                  this.path = movedTo;
                  this.synced = false;
                  this.closedError ??= new ChannelClosedError('guest agent (moved to a new QEMU)');
                  this.sock.destroy();
                }
                done();
                this.holds.down();
              });
            }),
        ),
      );
    });
  }

  /** The connection is gone (closed here, by QEMU, or for flooding). The next call connects again, unless close() was called. */
  get closed(): boolean {
    return this.closedError !== undefined || this.sock.destroyed;
  }

  /**
   * For a caller holding the channel (inside serial()): a connection that was lost (the guest
   * flooded it, a reply outgrew the cap, the socket dropped) is opened again, unsynced. QEMU's
   * chardev takes a new connection once the old one is gone; if QEMU is gone too, the
   * connect fails and the call with it.
   */
  private async reopenIfLost(): Promise<void> {
    if (!this.closed) return;
    if (this.shut) throw this.closedError ?? new ChannelClosedError('guest agent');
    const lost = this.closedError;
    const sock = await openSocket(this.path, 5000).catch((e: unknown) => {
      throw new ChannelClosedError(`guest agent (connecting again: ${(e as Error).message})`, { cause: lost });
    });
    if (this.shut) {
      sock.destroy();
      throw this.closedError ?? new ChannelClosedError('guest agent');
    }
    this.dropBuffered();
    this.reader = undefined;
    this.closedError = undefined;
    this.synced = false;
    this.attach(sock);
  }

  /**
   * Resynchronise: send guest-sync-delimited with a fresh id until the agent answers with that
   * id, discarding anything before it (stale replies, replayed bytes). Retries until deadline,
   * so it doubles as "wait until the agent is up".
   */
  sync(deadlineMs: number, attemptMs = 1000): Promise<void> {
    return this.serial(async () => {
      await this.reopenIfLost();
      await this.syncNow(deadlineMs, attemptMs);
    });
  }

  /** sync()'s work, for a caller that already holds the channel (inside serial()). */
  private async syncNow(deadlineMs: number, attemptMs = 1000): Promise<void> {
    const end = Date.now() + deadlineMs;
    // The first attempt gets `attemptMs`, later ones twice the previous (up to 2 s): a short
    // first wait costs little when a request was lost, and a slow guest still converges.
    let wait = attemptMs;
    while (true) {
      this.throwIfClosed();
      const id = randomInt(1, 2 ** 47);
      this.dropBuffered();
      // A 0xFF byte first (invalid JSON) makes qemu-ga's parser drop half a request it holds
      // (a snapshot taken mid-write replays one into every clone), so the sync itself parses.
      this.sock.write(Buffer.concat([SYNC_FLUSH, Buffer.from(JSON.stringify({ execute: 'guest-sync-delimited', arguments: { id } }) + '\n')]));
      const attemptEnd = Math.min(end, Date.now() + wait);
      wait = Math.min(2 * wait, Math.max(attemptMs, 2000));
      try {
        while (true) {
          const line = await this.readLine(true, Math.max(1, attemptEnd - Date.now()), SMALL_REPLY_BYTES);
          const msg = tryParse(line);
          if (msg && msg.return === id) {
            this.synced = true;
            return;
          }
        }
      } catch (e) {
        if (!(e instanceof GuestAgentTimeoutError)) throw e;
        if (Date.now() >= end) throw new GuestAgentTimeoutError('guest-sync-delimited', deadlineMs);
      }
    }
  }

  /**
   * One command, answered in order, within `timeoutMs` of its sending however many other
   * lines the guest writes meanwhile. A timeout leaves the channel unsynced; the next call
   * resyncs. With `unless`, a command whose signal aborted while it waited for the channel is
   * not sent (NotSentError). An answer longer than `maxReplyBytes` (replyCap), or of more
   * structure than any of qemu-ga's (plainEnough), closes the channel (ChannelClosedError; the
   * next call connects again).
   */
  command<T = unknown>(execute: string, args?: Record<string, unknown>, timeoutMs = 10_000, unless?: AbortSignal, maxReplyBytes = replyCap(execute, args)): Promise<T> {
    return this.commandRaw<T>(execute, JSON.stringify(args === undefined ? { execute } : { execute, arguments: args }), timeoutMs, unless, maxReplyBytes);
  }

  private commandRaw<T>(execute: string, json: string, timeoutMs: number, unless?: AbortSignal, maxReplyBytes = SMALL_REPLY_BYTES): Promise<T> {
    return this.serial(async () => {
      // Checked once this command holds the channel, not when it was queued: a command ahead
      // of it may have timed out meanwhile, and its late answer would be taken for this one's.
      if (unless?.aborted) throw new NotSentError(execute);
      await this.reopenIfLost();
      if (!this.synced) await this.syncNow(timeoutMs);
      this.throwIfClosed();
      if (unless?.aborted) throw new NotSentError(execute);
      this.sock.write(json + '\n');
      // One deadline for the answer: a guest writing a line that answers nothing every so often
      // (each read waiting afresh) would keep the command, and every one queued behind it, waiting.
      const end = Date.now() + timeoutMs;
      try {
        while (true) {
          const msg = tryParse(await this.readLine(false, Math.max(1, end - Date.now()), maxReplyBytes));
          if (!msg) continue;
          if ('error' in msg) {
            const err = msg.error as { desc?: string; class?: string };
            throw new GuestAgentCommandError(execute, `${err.class ?? ''}: ${err.desc ?? JSON.stringify(err)}`);
          }
          if ('return' in msg) return msg.return as T;
        }
      } catch (e) {
        if (e instanceof GuestAgentTimeoutError) {
          this.synced = false;
          throw new GuestAgentTimeoutError(execute, timeoutMs);
        }
        throw e;
      }
    });
  }

  async ping(timeoutMs = 5000): Promise<void> {
    await this.command('guest-ping', undefined, timeoutMs);
  }

  /** How many execs of this client are under way: a snapshot taken now has their programs running. */
  get execsRunning(): number {
    return this.execs.count;
  }

  /**
   * Run a program; resolves with its exit code (or the signal that ended it), stdout and
   * stderr once it has exited. Past `timeoutMs` the program is killed and the result says
   * `timedOut`, with what it wrote; when `signal` aborts first, the same, and it says
   * `cancelled`. Aborted before the start was sent, the program is not started (exit code -1,
   * `cancelled`). Each stream returns at most `maxOutputBytes` (EXEC_MAX_OUTPUT_BYTES), live
   * or not; past it the result says `outputTruncated`. `env` adds to the guest's environment;
   * its values are never in a command line in the guest (RESERVED_ENV_PREFIXES).
   *
   * With output captured, the program runs under EXEC_WRAPPER: qemu-ga reports a process
   * exited only once its output pipes close, so a command that leaves a process behind
   * (`server &`, `nohup ... &`) would otherwise never finish. The wrapper gives the program
   * files for stdout and stderr instead of qemu-ga's pipes and copies them out when it exits;
   * what the program left running goes on, writing into files no one reads.
   *
   * A guest that does not answer for a while (a paused VM, a guest starved of CPU) does not
   * end the supervision: an unanswered status poll is followed by the next, and the deadline
   * and the cancel still kill the program. A killed program not seen to exit within
   * killGraceMs of its kill (a kill tried at least once) makes exec reject with a
   * GuestAgentTimeoutError that says so, and the program is ended in the background once the
   * guest answers again (endLater), as is what a start answered too late started.
   */
  async exec(req: ExecRequest): Promise<ExecResult> {
    this.execs.up();
    try {
      return await this.execCounted(req);
    } finally {
      this.execs.down();
    }
  }

  private async execCounted(req: ExecRequest): Promise<ExecResult> {
    const timeoutMs = req.timeoutMs ?? 30_000;
    const end = Date.now() + timeoutMs;
    const capture = req.captureOutput ?? true;
    const max = req.maxOutputBytes !== undefined && Number.isFinite(req.maxOutputBytes) ? Math.max(0, Math.min(EXEC_MAX_OUTPUT_BYTES, Math.floor(req.maxOutputBytes))) : EXEC_MAX_OUTPUT_BYTES;
    // The wrapper's $0: names its line about output it left (EXEC_WRAPPER), which no program
    // output can fake without knowing this call's nonce.
    const zero = `ff-exec-${this.instance}-${randomBytes(8).toString('hex')}`;
    const args = guestExecArgs(req, zero, max);
    const notStarted: ExecResult = { exitCode: -1, signal: null, stdout: Buffer.alloc(0), stderr: Buffer.alloc(0), cancelled: true };
    // A caller gone before the start: nothing runs.
    if (req.signal?.aborted) return notStarted;
    const abandoned: Abandoned = { zero, capture, env: req.env };
    const pid = await this.startExec(args, Math.max(timeoutMs, this.timing.startMinMs), req.signal, abandoned);
    if (pid === undefined) return notStarted;
    const t = this.timing;
    const started = Date.now();
    let delay = 2;
    let killedAt: number | undefined;
    let lastKill = 0;
    let kills = 0;
    /** Since when the guest has left the polls unanswered (undefined: it answered the last). */
    let silentSince: number | undefined;
    let why: { timedOut: true } | { cancelled: true } | undefined;
    /** Helpers started (kills, the output files' removal): qemu-ga keeps each one's record until its status is asked for. */
    const helpers: number[] = [];
    let gaveUp = false;
    const files = wrapperFiles(pid, req.env);
    const live = capture && req.onOutput ? new LiveOutput(this, files, req.onOutput, max, t.pollTimeoutMs) : undefined;
    try {
      while (true) {
        // Each poll gets its own timeout: the deadline is the loop's to enforce.
        let st: ExecStatus | undefined;
        try {
          // Without capture there is no output to carry.
          st = await this.command<ExecStatus>('guest-exec-status', { pid }, t.pollTimeoutMs, undefined, capture ? undefined : SMALL_REPLY_BYTES);
          silentSince = undefined;
        } catch (e) {
          // Unanswered is not an end: the program may still run, and is still timed out and
          // cancelled (the guest may be paused, or starved of CPU under TCG).
          if (!(e instanceof GuestAgentTimeoutError)) throw e;
          silentSince ??= Date.now() - t.pollTimeoutMs;
        }
        if (st?.exited) {
          if (req.cwd && st.exitcode === 125) {
            const refused = cwdRefusal(Buffer.from(st['err-data'] ?? '', 'base64'), zero, req.cwd);
            if (refused) throw refused;
          }
          const told = leftStreams(Buffer.from(st['err-data'] ?? '', 'base64'), zero);
          // What qemu-ga was handed of each stream (more than `max` only from a program the
          // wrapper ran directly), and the rest from the files the wrapper left.
          const handed = { stdout: Buffer.from(st['out-data'] ?? '', 'base64'), stderr: told.stderr };
          let truncated = st['out-truncated'] === true || st['err-truncated'] === true || handed.stdout.length > max || handed.stderr.length > max;
          const parts: { stdout: Buffer[]; stderr: Buffer[] } = { stdout: [handed.stdout.subarray(0, max)], stderr: [handed.stderr.subarray(0, max)] };
          // (Without capture there is no output, and nothing for onOutput.)
          if (live) {
            live.finish(handed.stdout, handed.stderr);
            parts.stdout = [];
            parts.stderr = [];
          }
          if (told.left.length) {
            for (const stream of told.left) {
              const from = Math.max(handed[stream].length, live?.passed(stream) ?? 0);
              const rest = await this.readLeftOutput(files[stream], from, Math.max(0, max - from), (piece) => (live ? req.onOutput?.(stream, piece) : parts[stream].push(piece)));
              truncated ||= !rest.complete;
            }
            const rm = await this.startPid(rmArgs(told.left.map((x) => files[x])), t.pollTimeoutMs).catch(() => undefined);
            if (rm !== undefined) helpers.push(rm);
          }
          const stdout = live ? Buffer.alloc(0) : Buffer.concat(parts.stdout);
          const stderr = live ? Buffer.alloc(0) : Buffer.concat(parts.stderr);
          return { exitCode: st.exitcode ?? -1, signal: st.signal ?? null, stdout, stderr, ...why, ...(truncated ? { outputTruncated: true } : {}) };
        }
        const now = Date.now();
        if (st && live && now - started >= LIVE_AFTER_MS) await live.poll(now);
        if (why === undefined && (now >= end || req.signal?.aborted)) {
          why = now >= end ? { timedOut: true } : { cancelled: true };
          killedAt = now;
        }
        if (killedAt !== undefined && kills > 0 && now - killedAt >= t.killGraceMs) {
          // The caller is answered; the kill goes on without it until the program is seen to exit.
          gaveUp = true;
          this.endLater({ ...abandoned, pid, handles: live?.release() ?? [], helpers });
          const state = silentSince === undefined ? 'still not exited; the kill goes on' : `the guest agent has not answered for ${now - silentSince} ms; it is killed again once it answers`;
          const ended = why && 'cancelled' in why ? 'cancelled' : 'timed out';
          throw new GuestAgentTimeoutError(`guest-exec ${req.path} (${ended} and killed after ${now - started} ms, ${state})`, now - started);
        }
        if (killedAt !== undefined && now - lastKill >= t.killAgainMs) {
          // Kill the program (the wrapper then copies out what it wrote and exits) or, without
          // the wrapper, the process itself. Again while it has not exited: a kill that came
          // before the wrapper started the program found nothing to kill.
          lastKill = now;
          kills++;
          const k = await this.startPid(killArgs(pid, capture, files), t.pollTimeoutMs).catch(() => undefined);
          if (k !== undefined) helpers.push(k);
        }
        // An unanswered poll has waited its timeout already.
        if (st) await sleep(delay);
        // The next poll comes after a fifth of the time waited so far (2..100 ms): an exit is
        // noticed at most ~20% late, and a slow exec (many clones sharing the CPU under TCG) is
        // not slowed further by a stream of polls, each of which costs the guest CPU (ADR 0009).
        delay = Math.min(100, Math.max(2, (Date.now() - started) / 5));
      }
    } finally {
      if (!gaveUp) {
        // Closed on every way out: qemu-ga keeps an open handle until it is closed.
        await live?.close();
        // Asked once: a helper that has exited (they take milliseconds) is forgotten by qemu-ga.
        for (const h of helpers) await this.command('guest-exec-status', { pid: h }, t.pollTimeoutMs, undefined, SMALL_REPLY_BYTES).catch(() => undefined);
      }
    }
  }

  /**
   * Starts a program (guest-exec) and resolves with its pid. An answer without one (a guest
   * whose qemu-ga was replaced) is refused, GuestAgentCommandError, never taken for a pid.
   */
  private async startPid(args: Record<string, unknown>, timeoutMs: number, unless?: AbortSignal): Promise<number> {
    const r = await this.command<unknown>('guest-exec', args, timeoutMs, unless);
    const pid = (r as { pid?: unknown } | null)?.pid;
    if (typeof pid !== 'number' || !Number.isSafeInteger(pid) || pid <= 0) throw new GuestAgentCommandError('guest-exec', `answered without a pid: ${String(JSON.stringify(r)).slice(0, 100)}`);
    return pid;
  }

  /**
   * Sends an exec's start (guest-exec) and resolves with the pid. Resolves undefined when
   * `signal` aborted before the start was sent (nothing runs), or when the start was not
   * answered within killGraceMs of the abort (what it starts is ended by endLater). A start
   * not answered within `timeoutMs` rejects, and what it may start once the guest answers
   * again (qemu-ga reads the request then) is ended by endLater too.
   */
  private async startExec(args: Record<string, unknown>, timeoutMs: number, signal: AbortSignal | undefined, abandoned: Abandoned): Promise<number | undefined> {
    const start = this.startPid(args, timeoutMs, signal);
    const unanswered = (e: unknown): void => {
      if (e instanceof GuestAgentTimeoutError) this.endLater(abandoned);
    };
    let timer: ReturnType<typeof setTimeout> | undefined;
    let waitNoLonger: (v: undefined) => void = () => undefined;
    const cancelled = new Promise<undefined>((r) => (waitNoLonger = r));
    const onAbort = (): void => void (timer = setTimeout(() => waitNoLonger(undefined), this.timing.killGraceMs));
    signal?.addEventListener('abort', onAbort, { once: true });
    try {
      const r = await Promise.race([start, cancelled]);
      if (r !== undefined) return r;
      // The caller is gone and the guest slow to answer: it is answered now, the start later.
      // Caught to the end: a rejection nothing handles ends the agent's process, every sandbox's.
      void start.then((pid) => this.endLater({ ...abandoned, pid }), unanswered).catch(() => undefined);
      return undefined;
    } catch (e) {
      if (e instanceof NotSentError) return undefined;
      unanswered(e);
      throw e;
    } finally {
      signal?.removeEventListener('abort', onAbort);
      clearTimeout(timer);
    }
  }

  /**
   * Ends, in the background, an exec its caller no longer waits for (exec gave up on it, or
   * its start was answered too late): the kill is sent until qemu-ga says the program exited
   * (a start never answered is first found by its nonce, EXEC_END_NAMED), its status is taken
   * (qemu-ga keeps an exited program's record and output until then), the files its wrapper
   * left are removed, and handles are closed. The helpers it starts (kills, removals; and
   * those exec started) have their statuses taken on each try, so their records do not pile
   * up in qemu-ga. A pid qemu-ga does not know (it was restarted, or its record was taken) is
   * dropped. Tries while the channel is open and each failure is a timeout (or a helper's start
   * refused), waiting ever longer between tries (up to endLaterMaxWaitMs), for at most
   * endLaterGiveUpMs (checked before each close, status and kill too, the wrapper search
   * running once: a guest answering each just in time makes a try long); then it stops and
   * logs what it left.
   */
  private endLater(x: Abandoned): void {
    const t = this.timing;
    const handles = [...(x.handles ?? [])];
    const helpers = [...(x.helpers ?? [])];
    let pids = x.pid === undefined ? undefined : [x.pid];
    const files = (pid: number): { stdout: string; stderr: string } => wrapperFiles(pid, x.env);
    /** The guest refused the handle or pid (it does not know it): nothing more to do for that one. */
    const refused = (e: unknown): void => {
      if (!(e instanceof GuestAgentCommandError)) throw e;
    };
    const started = Date.now();
    const late = (): boolean => Date.now() - started >= t.endLaterGiveUpMs;
    const run = async (): Promise<void> => {
      let wait = t.killAgainMs;
      let tries = 0;
      while (!this.shut) {
        tries++;
        try {
          while (handles.length && !late()) {
            await this.command('guest-file-close', { handle: handles[0] }, t.pollTimeoutMs).catch(refused);
            handles.shift();
          }
          await this.takeStatuses(helpers, late);
          pids ??= x.capture ? await this.findWrappers(x.zero, wrapperDir(x.env), helpers) : [];
          for (const pid of [...pids]) {
            if (late()) break;
            const st = await this.command<ExecStatus>('guest-exec-status', { pid }, t.pollTimeoutMs).catch((e: unknown) => void refused(e));
            if (!st || st.exited) pids = pids.filter((p) => p !== pid);
            if (!st) continue;
            if (st.exited) {
              const left = leftStreams(Buffer.from(st['err-data'] ?? '', 'base64'), x.zero).left.map((s) => files(pid)[s]);
              if (left.length) helpers.push(await this.startPid(rmArgs(left), t.pollTimeoutMs));
            } else {
              helpers.push(await this.startPid(killArgs(pid, x.capture, files(pid)), t.pollTimeoutMs));
            }
          }
          if (pids.length === 0) {
            // Asked once more: the helpers just started take milliseconds.
            await sleep(Math.min(100, t.killAgainMs), true);
            await this.takeStatuses(helpers, late);
            if (helpers.length === 0) return;
          }
        } catch (e) {
          // Unanswered, or a helper's start refused (a guest short of memory for a moment): tried
          // again. Anything else is a channel closed for good (the VM is gone): nothing left to end.
          if (!(e instanceof GuestAgentTimeoutError || e instanceof GuestAgentCommandError)) return;
        }
        if (late()) {
          const left = { exec: x.zero, pids: pids ?? 'not found yet', helpers, handles, tries };
          this.log?.warn(left, `guest exec: stopped trying to end an exec its caller left, after ${Date.now() - started} ms (the guest did not answer, or its program did not exit)`);
          return;
        }
        await sleep(wait, true);
        wait = Math.min(2 * wait, t.endLaterMaxWaitMs);
      }
    };
    void run().catch(() => undefined);
  }

  /**
   * Takes the status of each helper of `helpers` and leaves there only those still running
   * (an exited one's record is gone from qemu-ga once asked; one qemu-ga does not know is
   * dropped). A status left unanswered rejects, with the rest still in `helpers`; once `stop()`
   * says so, the rest are left there.
   */
  private async takeStatuses(helpers: number[], stop: () => boolean): Promise<void> {
    for (let i = 0; i < helpers.length && !stop(); ) {
      // A wrapper search among them captures its output: the exec status's own cap.
      const st = await this.command<ExecStatus>('guest-exec-status', { pid: helpers[i] }, this.timing.pollTimeoutMs).catch((e: unknown) => {
        if (e instanceof GuestAgentCommandError) return undefined;
        throw e;
      });
      if (st && !st.exited) i++;
      else helpers.splice(i, 1);
    }
  }

  /**
   * The pids of the wrappers whose $0 is `zero` (their programs killed: EXEC_END_NAMED), at
   * most MAX_WRAPPERS_FOUND of them. A search whose end is not seen in time is added to
   * `helpers`, for its record to be taken.
   */
  private async findWrappers(zero: string, dir: string, helpers: number[]): Promise<number[]> {
    const t = this.timing;
    const pid = await this.startPid({ path: '/bin/sh', arg: ['-c', EXEC_END_NAMED, 'ff-end', zero, dir], 'capture-output': true }, t.pollTimeoutMs);
    const end = Date.now() + t.pollTimeoutMs;
    try {
      while (true) {
        // Its output is captured (pids; a process gone mid-scan may add a line of stderr).
        const st = await this.command<ExecStatus>('guest-exec-status', { pid }, t.pollTimeoutMs);
        if (st.exited) return (Buffer.from(st['out-data'] ?? '', 'base64').toString('latin1').match(/\d+/g) ?? []).slice(0, MAX_WRAPPERS_FOUND).map(Number);
        if (Date.now() >= end) throw new GuestAgentTimeoutError(`search for the exec ${zero}`, t.pollTimeoutMs);
        await sleep(20);
      }
    } catch (e) {
      if (e instanceof GuestAgentTimeoutError) helpers.push(pid);
      throw e;
    }
  }

  /**
   * Ends the execs an earlier agent (another instance) left running in this guest (REAP_ORPHAN_EXECS) and
   * removes the output files nobody will read; resolves with how many execs it ended.
   */
  async reapOrphanExecs(timeoutMs = 30_000): Promise<number> {
    const r = await this.exec({ path: '/bin/sh', args: ['-c', REAP_ORPHAN_EXECS, 'ff-reap', this.instance], timeoutMs, maxOutputBytes: HELPER_OUTPUT_BYTES });
    if (r.exitCode !== 0) throw new GuestAgentCommandError('reap orphan execs', `exit ${r.exitCode}: ${r.stderr.toString('utf8').trim()}`);
    return Number(r.stdout.toString('utf8').trim()) || 0;
  }

  /**
   * A file the exec wrapper left (its output past EXEC_HANDED_BYTES), from `from`, in pieces
   * of at most 1 MiB (qemu-ga answers each in one line), at most `max` bytes; `complete` says
   * whether the end was reached (one byte more is asked for to know).
   */
  private async readLeftOutput(path: string, from: number, max: number, onPiece: (b: Buffer) => void): Promise<{ complete: boolean }> {
    let got = 0;
    try {
      await this.readPieces(path, from, max + 1, 10_000, (piece) => {
        const mine = piece.subarray(0, Math.max(0, max - got));
        got += piece.length;
        if (mine.length) onPiece(mine);
      });
    } catch (e) {
      if (e instanceof GuestAgentCommandError) return { complete: false }; // gone (not openable)
      throw e;
    }
    return { complete: got <= max };
  }

  /** The file's bytes from `range.offset` (default 0), at most `range.maxBytes` of them (0 or absent: to the end). */
  async readFile(path: string, range: { offset?: number; maxBytes?: number } = {}, timeoutMs = 10_000): Promise<Buffer> {
    const parts: Buffer[] = [];
    await this.readPieces(path, range.offset ?? 0, range.maxBytes || Infinity, timeoutMs, (piece) => parts.push(piece)).catch((e: unknown) => {
      throw pathError(path, e);
    });
    return Buffer.concat(parts);
  }

  /** Reads `path` from `offset`, at most `max` bytes, handing each guest-file-read answer (at most 1 MiB) to `onPiece`. */
  private async readPieces(path: string, offset: number, max: number, timeoutMs: number, onPiece: (piece: Buffer) => void): Promise<void> {
    const handle = await this.command<number>('guest-file-open', { path, mode: 'r' }, timeoutMs);
    try {
      if (offset) await this.command('guest-file-seek', { handle, offset, whence: 'set' }, timeoutMs);
      let left = max;
      while (left > 0) {
        const count = Math.min(1 << 20, left);
        const r = await this.command<{ count: number; 'buf-b64': string; eof: boolean }>('guest-file-read', { handle, count }, timeoutMs);
        // What was decoded counts, not what the guest says it sent.
        const got = readAnswer(r, count);
        if (got.length) onPiece(got);
        left -= got.length;
        if (r.eof || got.length === 0) break;
      }
    } finally {
      await this.command('guest-file-close', { handle }, timeoutMs);
    }
  }

  /**
   * Writes `data` to the file, replacing it, or after its end with `append`; with a `mode`
   * (not 0), then sets the file's mode to it (GuestChmodError if the guest's chmod fails). The
   * whole of it, chmod included, is one with respect to hold(): a snapshot has the file as it
   * was before or as it is after, never emptied by the open with its new bytes yet to come, nor
   * new bytes with the old mode. Asked for while a hold is asked for or held, it sends nothing
   * until the hold is released (its timeouts not running meanwhile).
   */
  async writeFile(path: string, data: Buffer, opts: { append?: boolean; mode?: number } = {}, timeoutMs = 10_000): Promise<void> {
    // Checked again after each wait: another hold may have been asked for before this one went on.
    while (this.holds.count > 0) await this.holds.none();
    this.writes.up();
    try {
      await this.writeFileRaw(path, data, opts, timeoutMs).catch((e: unknown) => {
        throw pathError(path, e);
      });
      if (!opts.mode) return;
      // qemu-ga opens files with its own default mode and has no chmod: the guest's chmod sets it.
      const mode = opts.mode & 0o7777;
      // Its output is only quoted in an error: the guest hands no more than that.
      const r = await this.exec({ path: '/bin/chmod', args: [mode.toString(8), path], maxOutputBytes: HELPER_OUTPUT_BYTES });
      if (r.exitCode !== 0) throw new GuestChmodError(path, mode, r.exitCode, r.stderr.toString('utf8'));
    } finally {
      this.writes.down();
    }
  }

  private async writeFileRaw(path: string, data: Buffer, opts: { append?: boolean }, timeoutMs: number): Promise<void> {
    const handle = await this.command<number>('guest-file-open', { path, mode: opts.append ? 'a' : 'w' }, timeoutMs);
    try {
      for (let off = 0; off < data.length || off === 0; off += 1 << 20) {
        const part = data.subarray(off, off + (1 << 20));
        await this.command('guest-file-write', { handle, 'buf-b64': part.toString('base64') }, timeoutMs);
        if (data.length === 0) break;
      }
    } finally {
      await this.command('guest-file-close', { handle }, timeoutMs);
    }
  }

  /** The guest's wall clock, ns since the epoch (guest-get-time: no process is spawned). */
  async getTime(timeoutMs = 10_000): Promise<bigint> {
    // Through a JS number the value keeps ~256 ns precision (it exceeds 2^53), plenty here.
    const ns = await this.command<number>('guest-get-time', undefined, timeoutMs);
    return BigInt(Math.round(ns));
  }

  /** Set the guest clock to `epochNs` (default: the host's now). qemu-ga also writes the RTC. */
  async setTime(epochNs?: bigint, timeoutMs = 10_000): Promise<void> {
    const ns = epochNs ?? BigInt(Date.now()) * 1_000_000n;
    // Nanoseconds since the epoch exceed 2^53, so the JSON is written by hand.
    await this.commandRaw('guest-set-time', `{"execute":"guest-set-time","arguments":{"time":${ns.toString()}}}`, timeoutMs);
  }

  private serial<T>(fn: () => Promise<T>): Promise<T> {
    const run = this.tail.then(fn, fn);
    this.tail = run.catch(() => undefined);
    return run;
  }

  private throwIfClosed(): void {
    if (this.closedError) throw this.closedError;
  }

  private readLine(delimited: boolean, timeoutMs: number, maxBytes: number): Promise<string> {
    return new Promise((resolve, reject) => {
      if (this.closed) return void reject(this.closedError ?? new ChannelClosedError('guest agent'));
      const t = setTimeout(() => {
        this.reader = undefined;
        reject(new GuestAgentTimeoutError('read', timeoutMs));
      }, timeoutMs);
      // Ended by a line, the timeout, or the socket's 'close' (which rejects the reader).
      this.reader = {
        delimited,
        maxBytes,
        resolve: (line) => {
          clearTimeout(t);
          resolve(line);
        },
        reject: (e) => {
          clearTimeout(t);
          reject(e);
        },
      };
      this.pump();
    });
  }

  /**
   * Closes the channel of a guest that broke the protocol (flooded it, or answered with more
   * than the command may be answered with): the waiting reader fails at once, and the next
   * call connects again (reopenIfLost).
   */
  private refuse(why: string): void {
    this.closedError = new ChannelClosedError(`guest agent (${why})`);
    this.dropBuffered();
    this.sock.destroy();
    const r = this.reader;
    this.reader = undefined;
    r?.reject(this.closedError);
  }

  private dropBuffered(): void {
    this.buf = Buffer.alloc(0);
    this.parts = [];
    this.partLen = 0;
  }

  private pump(): void {
    const r = this.reader;
    if (!r) return;
    if (r.delimited) {
      const ff = this.buf.indexOf(0xff);
      if (ff < 0) {
        this.buf = Buffer.alloc(0);
        return;
      }
      this.buf = this.buf.subarray(ff + 1);
      r.delimited = false;
    }
    const nl = this.buf.indexOf(0x0a);
    // Refused before it is parsed (replyCap, plainEnough).
    if ((nl < 0 ? this.buf.length : nl) > r.maxBytes) return void this.refuse(overCap(r.maxBytes));
    if (nl < 0) return;
    const bytes = this.buf.subarray(0, nl);
    if (!plainEnough(bytes)) return void this.refuse(`an answer of more than ${MAX_REPLY_STRUCTURES} JSON structures, more than any of qemu-ga's`);
    const line = bytes.toString('utf8');
    this.buf = this.buf.subarray(nl + 1);
    this.reader = undefined;
    r.resolve(line);
  }
}

function openSocket(path: string, timeoutMs: number): Promise<net.Socket> {
  return connectUnix(path, timeoutMs, () => new GuestAgentTimeoutError(`connect ${path}`, timeoutMs));
}

/**
 * The wrapper's stderr without its last line naming the streams it left in files (EXEC_WRAPPER:
 * "\\n$0 out err\\n"), and those streams.
 */
export function leftStreams(stderr: Buffer, zero: string): { stderr: Buffer; left: Array<'stdout' | 'stderr'> } {
  const at = stderr.lastIndexOf(`\n${zero}`);
  if (at < 0) return { stderr, left: [] };
  const line = stderr.subarray(at + 1).toString('latin1').trim();
  if (!/^ff-exec-[0-9a-f-]+( out)?( err)?$/.test(line) || line === zero) return { stderr, left: [] };
  const words = line.split(' ').slice(1);
  return { stderr: stderr.subarray(0, at), left: words.map((w) => (w === 'out' ? 'stdout' : 'stderr')) };
}

/**
 * The error for a working directory EXEC_WRAPPER could not enter, from its last stderr line
 * ("<zero> cwd-<why>", the call's nonce, which the program cannot know), or undefined when the
 * exit was the program's own.
 */
export function cwdRefusal(stderr: Buffer, zero: string, cwd: string): ForkfleetError | undefined {
  const last = stderr.toString('latin1').trimEnd().split('\n').pop() ?? '';
  const why = last.startsWith(`${zero} cwd-`) ? last.slice(zero.length + 5) : '';
  const at = (kind: ForkfleetError['kind'], text: string): ForkfleetError => new ForkfleetError(kind, `cwd: ${cwd}: ${text} (in the guest)`, { field: 'cwd' });
  if (why === 'missing') return at('not_found', 'no such directory');
  if (why === 'notdir') return at('not_found', 'not a directory');
  if (why === 'denied') return at('failed_precondition', 'the guest refuses to enter it');
  return undefined;
}

/**
 * The bytes of a guest-file-read answer that asked for `count`. More than asked for is
 * refused (GuestAgentCommandError): a piece cut from it would keep the whole decoded answer
 * in memory for as long as the piece is held (an exec's output gathered piece by piece).
 */
function readAnswer(r: { 'buf-b64'?: unknown } | null, count: number): Buffer {
  const b64 = r?.['buf-b64'];
  if (typeof b64 !== 'string') throw new GuestAgentCommandError('guest-file-read', 'answered without buf-b64');
  const got = Buffer.from(b64, 'base64');
  if (got.length > count) throw new GuestAgentCommandError('guest-file-read', `answered ${got.length} bytes, more than the ${count} asked for`);
  return got;
}

function tryParse(line: string): Record<string, unknown> | undefined {
  try {
    const v: unknown = JSON.parse(line.trim());
    return v && typeof v === 'object' ? (v as Record<string, unknown>) : undefined;
  } catch {
    return undefined;
  }
}

/**
 * Where the wrappers put their output files: the TMPDIR the caller's variables give (the last
 * one; an empty one is /tmp), else /tmp, never qemu-ga's own TMPDIR (EXEC_WRAPPER's rule).
 */
function wrapperDir(env: readonly string[] | undefined): string {
  return env?.findLast((e) => e.startsWith('TMPDIR='))?.slice(7) || '/tmp';
}

/** The wrapper's output files for the wrapper with this pid (wrapperDir). */
function wrapperFiles(pid: number, env: readonly string[] | undefined): { stdout: string; stderr: string } {
  const tmp = wrapperDir(env);
  return { stdout: `${tmp}/.ff-exec-${pid}.out`, stderr: `${tmp}/.ff-exec-${pid}.err` };
}

/** The guest-exec that kills the program of the exec with this pid (EXEC_KILL), or, run without the wrapper, the process itself. */
/** A helper (guest-exec) that removes `files`, its output not captured. */
function rmArgs(files: readonly string[]): Record<string, unknown> {
  return { path: '/bin/sh', arg: ['-c', 'rm -f "$@"', 'ff-rm', ...files], 'capture-output': false };
}

/** Why a reader's answer is refused for its length (replyCap). */
function overCap(maxBytes: number): string {
  return `an answer over ${maxBytes} bytes, more than the command may be answered with`;
}

function killArgs(pid: number, capture: boolean, files: { stdout: string }): Record<string, unknown> {
  return capture
    ? { path: '/bin/sh', arg: ['-c', EXEC_KILL, 'ff-kill', String(pid), files.stdout], 'capture-output': false }
    : { path: '/bin/sh', arg: ['-c', 'kill -KILL "$1"', 'ff-kill', String(pid)], 'capture-output': false };
}

/**
 * Reads a running program's output files (EXEC_WRAPPER's) through guest-file-read and passes
 * what is new to onOutput, at most `max` bytes of each stream; at exit, passes what qemu-ga
 * returns past the bytes already passed (qemu-ga's output is the files' content), up to `max`
 * too. A file it cannot open (the wrapper ran the program directly, or the file is gone), or
 * whose open went unanswered, is simply not read early.
 */
class LiveOutput {
  private readonly sent = { stdout: 0, stderr: 0 };
  private readonly handles: { stdout?: number | null; stderr?: number | null } = {};
  private readonly openFailures = { stdout: 0, stderr: 0 };
  /**
   * A read whose answer was lost (timed out) may still have moved the handle's position in
   * the guest: the next read seeks back to what was passed first, so no byte is skipped.
   */
  private readonly unsure = { stdout: false, stderr: false };
  private lastReadAt = 0;

  constructor(
    private readonly agent: GuestAgentClient,
    private readonly files: { stdout: string; stderr: string },
    private readonly onOutput: (stream: 'stdout' | 'stderr', data: Buffer) => void,
    private readonly max: number,
    private readonly timeoutMs: number,
  ) {}

  async poll(now: number): Promise<void> {
    if (now - this.lastReadAt < LIVE_READ_EVERY_MS) return;
    this.lastReadAt = now;
    for (const stream of ['stdout', 'stderr'] as const) {
      // At the cap nothing more is read: the exit's read of what is left says whether there was more.
      const want = Math.min(1 << 20, this.max - this.sent[stream]);
      if (want <= 0) continue;
      try {
        if (this.handles[stream] === undefined) {
          // Tried on a few polls (the shell may not have made the file yet), then given up on.
          // An open left unanswered may still have opened the file in the guest, under a handle
          // never learnt (and so never closed): the stream is not read live again, lest each
          // poll leak one more (the rest comes at exit, as without live reads).
          const h = await this.agent.command<number>('guest-file-open', { path: this.files[stream], mode: 'r' }, this.timeoutMs).catch((e: unknown) => {
            if (e instanceof GuestAgentTimeoutError) {
              this.handles[stream] = null;
              throw e;
            }
            return undefined;
          });
          this.handles[stream] = h ?? (++this.openFailures[stream] >= 3 ? null : undefined);
        }
        const handle = this.handles[stream];
        if (handle === null || handle === undefined) continue;
        if (this.unsure[stream]) {
          await this.agent.command('guest-file-seek', { handle, offset: this.sent[stream], whence: 'set' }, this.timeoutMs);
          this.unsure[stream] = false;
        }
        this.unsure[stream] = true;
        const r = await this.agent.command<{ count: number; 'buf-b64': string }>('guest-file-read', { handle, count: want }, this.timeoutMs);
        // What was decoded counts.
        const got = readAnswer(r, want);
        this.unsure[stream] = false;
        if (got.length > 0) {
          this.sent[stream] += got.length;
          this.onOutput(stream, got);
        }
      } catch (e) {
        // Unanswered: the rest of this poll would wait as long again for nothing.
        if (e instanceof GuestAgentTimeoutError) return;
      }
    }
  }

  /** At exit, with each stream's whole output (qemu-ga's): only what was not passed yet goes out, up to the cap. */
  finish(stdout: Buffer, stderr: Buffer): void {
    for (const [stream, all] of [['stdout', stdout], ['stderr', stderr]] as const) {
      const upTo = Math.min(all.length, this.max);
      if (upTo > this.sent[stream]) this.onOutput(stream, all.subarray(this.sent[stream], upTo));
      this.sent[stream] = Math.max(this.sent[stream], upTo);
    }
  }

  /** Bytes of `stream` passed to onOutput so far. */
  passed(stream: 'stdout' | 'stderr'): number {
    return this.sent[stream];
  }

  /** The handles still open, for someone else to close: this no longer reads. */
  release(): number[] {
    const open = [this.handles.stdout, this.handles.stderr].filter((h): h is number => typeof h === 'number');
    this.handles.stdout = this.handles.stderr = null;
    return open;
  }

  async close(): Promise<void> {
    for (const handle of this.release()) await this.agent.command('guest-file-close', { handle }, this.timeoutMs).catch(() => undefined);
  }
}

/**
 * The guest's refusal of a file call, when it is about the caller's path (qemu-ga appends the
 * errno's text): an error that names the `path` field, not an internal one. None of those is
 * retryable, a full guest file system included (resource_exhausted, retryable by default): the
 * same call meets the same guest until someone frees space in it, and a retry would send the
 * whole file again for nothing.
 */
export function pathError(path: string, e: unknown): unknown {
  if (!(e instanceof GuestAgentCommandError)) return e;
  const at = (kind: ForkfleetError['kind'], why: string): ForkfleetError => new ForkfleetError(kind, `${path}: ${why} (in the guest)`, { field: 'path', retryable: false, cause: e });
  const m = e.message;
  if (/No such file or directory/i.test(m)) return at('not_found', 'no such file or directory');
  if (/Not a directory/i.test(m)) return at('not_found', 'a part of the path is not a directory');
  if (/Is a directory/i.test(m)) return at('invalid_argument', 'is a directory');
  if (/Permission denied|Read-only file system|Operation not permitted/i.test(m)) return at('failed_precondition', 'the guest refuses access');
  if (/No space left on device|Disk quota exceeded/i.test(m)) return at('resource_exhausted', 'the guest file system is full');
  if (/File name too long/i.test(m)) return at('invalid_argument', 'a name in it is too long');
  if (/Too many levels of symbolic links/i.test(m)) return at('invalid_argument', 'its symbolic links loop');
  if (/File too large/i.test(m)) return at('invalid_argument', 'the file would be larger than the guest file system allows');
  if (/Text file busy|Device or resource busy/i.test(m)) return at('failed_precondition', 'the file is busy (a running program, or a mount point)');
  if (/No such device or address|No such device/i.test(m)) return at('failed_precondition', 'a device or pipe nothing serves');
  // The guest short of a resource for a moment: no fault of the path, worth a retry.
  if (/Too many open files|Cannot allocate memory|Resource temporarily unavailable|Interrupted system call/i.test(m)) return new ForkfleetError('unavailable', `${path}: the guest is short of a resource (${m.slice(0, 200)}); retry`, { retryable: true, cause: e });
  // Any other refusal to open the path (a /proc or /sys file, a socket): the caller's path,
  // with the guest's words. Failures past the open (a read that fails mid-file) stay internal.
  if (/failed to open file/i.test(m)) return at('failed_precondition', `the guest refuses to open it: ${m.replace(/^.*failed to open file '.*?'( \(mode: '\w+'\))?:?\s*/s, '').slice(0, 200) || 'no reason given'}`);
  return e;
}
