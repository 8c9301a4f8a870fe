// Undoes what a test process leaves behind when it ends without undoing it itself: a Ctrl-C, a
// kill, a crash or a hook timeout skips every afterAll, and the detached QEMUs, a fleet's
// daemons and its network namespaces would live on (namespaces until the next reboot).
//
// startReaper() (vitest's setup file for the int and e2e tiers, reaper-setup.ts) makes a list
// file, names it in FF_REAP_FILE (inherited by the agents and fleets a test starts) and starts
// a detached watcher: its own session, so a Ctrl-C's SIGINT to the terminal's process group does
// not reach it. What should outlive the process that made it notes itself in the list
// (noteForReaper: host-agent/adapters/tied.ts), as do the test kit's temporary directories. Once
// the test process is gone (its PID gone, a zombie, or another process's: the start time is
// compared), the watcher kills the noted processes that still are the ones noted (start time
// again: a reused PID is left alone), then deletes the noted namespaces that still are the ones
// noted (inode and change time: a name made again since is left alone) and directories, and
// its own list. Something a test already undid is found gone and skipped.
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { identityOf } from '../../deploy/fleet/proc-identity.ts';

/**
 * $1 = the list, $2 = the PID to outlive, $3 = its start time. `st` prints field 22 of
 * /proc/<pid>/stat (the start time): nothing when the process is gone or a zombie, `unknown`
 * when it exists but its stat could not be read (that never counts as gone). `read` is a
 * builtin: no fork per look.
 */
const WATCHER = [
  'list=$1; owner=$2; s0=$3',
  'st() { [ -e "/proc/$1" ] || return 0; s=; read -r s < "/proc/$1/stat" 2>/dev/null || { echo unknown; return 0; }; s=${s##*") "}; set -- $s; [ "$1" = Z ] && return 0; shift 19; echo "$1"; }',
  'while :; do t=$(st "$owner"); [ -n "$t" ] || break; [ "$t" = unknown ] || [ "$t" = "$s0" ] || break; sleep 1; done',
  // Processes first, then nothing of theirs writes into the directories. Again while the list
  // grows: an agent the test started may note one more QEMU in the moment before it is killed.
  'n=-1; while :; do m=$(wc -l < "$list"); [ "$m" = "$n" ] && break; n=$m',
  '  while read -r kind pid t; do if [ "$kind" = pid ] && [ -n "$t" ] && [ "$(st "$pid")" = "$t" ]; then kill -9 "$pid" 2>/dev/null; fi; done < "$list"',
  '  sleep 2',
  'done',
  // Only absolute paths at least two deep (noteForReaper writes no other); mounts inside
  // detached first, and rm stays on the directory's own file system.
  // A namespace only while its name is still the one noted (inode and change time: inode numbers
  // are reused at once): the next test file may have made one of that name since.
  `while read -r kind rest; do case $kind in netns) set -- $rest; [ -n "$2" ] && [ "$(stat -Lc %i:%Z "/run/netns/$1" 2>/dev/null)" = "$2" ] && ip netns del "$1" 2>/dev/null;; dir) case $rest in /?*/?*) ;; *) continue;; esac; awk -v d="$rest/" 'index($2, d) == 1 { print $2 }' /proc/self/mounts | sort -r | while read -r m; do umount -l "$m"; done; rm -rf --one-file-system -- "$rest";; esac; done < "$list"`,
  'rm -rf -- "${list%/*}"',
].join('\n');

/**
 * Starts this process's watcher (once per process: a worker that runs several test files keeps
 * its first) and returns the list file, also set as FF_REAP_FILE. The watcher's PID is returned
 * too (undefined when an earlier call started it), for tests of the watcher itself.
 */
export function startReaper(): { list: string; watcherPid: number | undefined } {
  const current = process.env.FF_REAP_FILE;
  if (current && process.env.FF_REAP_OWNER === String(process.pid) && existsSync(current)) return { list: current, watcherPid: undefined };
  const list = join(mkdtempSync(join(tmpdir(), 'ff-reap-')), 'list');
  writeFileSync(list, '');
  const owner = identityOf(process.pid).startTime;
  const watcher = spawn('sh', ['-c', WATCHER, 'ff-reaper', list, String(process.pid), String(owner)], { detached: true, stdio: 'ignore' });
  watcher.on('error', () => undefined);
  watcher.unref();
  process.env.FF_REAP_FILE = list;
  process.env.FF_REAP_OWNER = String(process.pid);
  return { list, watcherPid: watcher.pid };
}
