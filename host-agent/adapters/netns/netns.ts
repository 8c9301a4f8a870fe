// Per-sandbox network namespaces (issue #9, sandbox isolation).
//
// Each QEMU process is started by `unshare --net -- qemu-system-...`: unshare(CLONE_NEWNET)
// then exec, so the PID the agent records is QEMU's own and the namespace is fresh and empty
// (only a loopback device, left down). The guest's NIC is QEMU user networking (slirp,
// restrict=on), whose sockets live in that namespace: from inside the guest nothing is
// reachable, not the host's or the agent's namespace, etcd, NATS, the scheduler, peer ports
// or other sandboxes (each has its own namespace). The namespace has no name and no file: the
// kernel frees it when its last process (the QEMU) exits, so destroy, crash and agent restart
// leak nothing, and every clone restored from one snapshot gets its own. A snapshot that
// replaces a VM's process (a new generation) gets a new namespace with the new process.
//
// Egress, only when the sandbox's NetworkPolicy allows it, links this namespace out with a
// veth and firewall rules (egress.ts).
import { readlink } from 'node:fs/promises';

export const UNSHARE = 'unshare';

/** The command line that runs `binary args...` in a new, empty network namespace. */
export function inNewNetns(binary: string, args: string[]): { command: string; args: string[] } {
  return { command: UNSHARE, args: ['--net', '--', binary, ...args] };
}

/** The network namespace of a process, as the kernel names it ("net:[4026532...]"); undefined if gone. */
export async function netnsOf(pid: number | 'self'): Promise<string | undefined> {
  return readlink(`/proc/${pid}/ns/net`).catch(() => undefined);
}

/**
 * Resolves once process `pid`, started by inNewNetns, is in a namespace other than this
 * process's. The spawn returns before `unshare` has run: anything done in /proc/<pid>/ns/net
 * before then (a veth peer, the sandbox's drop-everything nftables ruleset) would land in the
 * agent's own namespace. Rejects if the process exits first, or after `timeoutMs`.
 */
export async function ownNetns(pid: number, timeoutMs = 10_000): Promise<string> {
  const mine = await netnsOf('self');
  const until = Date.now() + timeoutMs;
  for (;;) {
    const ns = await netnsOf(pid);
    if (ns === undefined) throw new Error(`process ${pid} exited before it had a network namespace of its own`);
    if (ns !== mine) return ns;
    if (Date.now() > until) throw new Error(`process ${pid} still shares this process's network namespace after ${timeoutMs} ms`);
    await new Promise((r) => setTimeout(r, 2));
  }
}
