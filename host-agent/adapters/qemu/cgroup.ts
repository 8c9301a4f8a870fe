// Guest CPU isolation: every QEMU the driver starts joins one cgroup whose CPU weight is that
// of a single ordinary process (cgroup v2 `cpu.weight`, v1 `cpu.shares`). The scheduler
// divides CPU between the guests *as a group* and everything else on the host: busy guests
// still get every cycle nothing else wants (the weight is not a cap), but they cannot starve
// the agent's heartbeats, NATS and peer transfers, nor the control plane of a local fleet.
// Without it, 64 forked children on 2 cores made their hosts miss heartbeats (suspect) and
// the scheduler leader lose its lease (ADR 0018, with the measurement).
//
// The group is made if it does not exist (v2: `+cpu` is enabled in each parent's
// `cgroup.subtree_control` on the way). A VM moved there keeps its membership across agent
// restarts; adopted VMs stay where they are.
import { access, mkdir, readFile, writeFile } from 'node:fs/promises';
import { join, resolve } from 'node:path';
import { HostSetupError } from '../../errors.ts';

/** Where the cgroup file systems are mounted on every distribution the agent targets. */
export const CGROUP_ROOT = '/sys/fs/cgroup';

export interface GuestCgroupOptions {
  /** Path of the group below the cgroup root (v2) or below the cpu controller's mount (v1), e.g. "forkfleet-guests". */
  readonly path: string;
  /** CPU weight, cgroup v2 scale: 1..10000, 100 = one ordinary process (v1: shares = weight * 1024 / 100). */
  readonly cpuWeight: number;
  /** Test seam: the cgroup file systems' root. */
  readonly root?: string;
}

export type CgroupVersion = 'v1' | 'v2';

/** The cgroup hierarchy this machine runs: v2 (unified, cgroup.controllers at the root) or v1 with a cpu controller. */
export async function cgroupVersion(root = CGROUP_ROOT): Promise<CgroupVersion | undefined> {
  if (await exists(join(root, 'cgroup.controllers'))) return 'v2';
  if (await exists(join(root, 'cpu', 'cpu.shares'))) return 'v1';
  return undefined;
}

/** Where groups with the cpu controller live: the v2 root, or v1's cpu mount; undefined without either. */
export async function cpuHierarchy(root = CGROUP_ROOT): Promise<{ version: CgroupVersion; base: string } | undefined> {
  const version = await cgroupVersion(root);
  return version && { version, base: version === 'v2' ? root : join(root, 'cpu') };
}

/** cgroup v1 cpu.shares for a v2 weight (v2 default 100 = v1 default 1024). */
export function sharesForWeight(weight: number): number {
  return Math.max(2, Math.round((weight * 1024) / 100));
}

export class GuestCgroup {
  private constructor(
    readonly version: CgroupVersion,
    /** The group's directory. */
    readonly dir: string,
    /** The group as /proc/<pid>/cgroup names it ("/forkfleet-guests"). */
    readonly procPath: string,
    readonly cpuWeight: number,
  ) {}

  /**
   * Makes (or reuses) the group and sets its weight. Throws a HostSetupError saying what is
   * missing when the machine has no writable cgroup hierarchy with a cpu controller.
   */
  static async open(o: GuestCgroupOptions): Promise<GuestCgroup> {
    if (!Number.isInteger(o.cpuWeight) || o.cpuWeight < 1 || o.cpuWeight > 10_000) throw new HostSetupError(`guest cgroup: cpu weight must be an integer in [1, 10000], got ${o.cpuWeight}`);
    const rel = o.path.replace(/^\/+|\/+$/g, '');
    if (!rel || rel.split('/').some((p) => p === '' || p === '.' || p === '..')) throw new HostSetupError(`guest cgroup: ${JSON.stringify(o.path)} is not a cgroup path below the root`);
    const root = o.root ?? CGROUP_ROOT;
    const h = await cpuHierarchy(root);
    if (!h) throw new HostSetupError(`guest cgroup: no cgroup v2 hierarchy and no v1 cpu controller under ${root}`);
    const { version, base } = h;
    const dir = resolve(base, rel);
    try {
      if (version === 'v2') {
        // Each parent must hand the cpu controller down, the root included.
        let parent = base;
        for (const part of rel.split('/')) {
          await enableCpu(parent);
          parent = join(parent, part);
          await mkdir(parent, { recursive: true });
        }
        await writeFile(join(dir, 'cpu.weight'), String(o.cpuWeight));
      } else {
        await mkdir(dir, { recursive: true });
        await writeFile(join(dir, 'cpu.shares'), String(sharesForWeight(o.cpuWeight)));
      }
    } catch (e) {
      throw new HostSetupError(`guest cgroup ${dir}: ${(e as Error).message}`, { cause: e });
    }
    return new GuestCgroup(version, dir, `/${rel}`, o.cpuWeight);
  }

  /**
   * Moves process `pid` (all its threads) into the group. A process that already exited is
   * no error; anything else is thrown (the caller decides whether a VM may run outside).
   */
  async add(pid: number): Promise<void> {
    try {
      await writeFile(join(this.dir, 'cgroup.procs'), String(pid));
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code === 'ESRCH') return;
      throw e;
    }
  }

  /** Whether `pid` is in this group now (from /proc/<pid>/cgroup: "0::/path" on v2, "N:cpu,cpuacct:/path" on v1). */
  async holds(pid: number): Promise<boolean> {
    const lines = await readFile(`/proc/${pid}/cgroup`, 'utf8').catch(() => '');
    return lines.split('\n').some((l) => {
      const [, controllers = '', path] = l.split(':');
      const mine = this.version === 'v2' ? controllers === '' : controllers.split(',').includes('cpu');
      return mine && path === this.procPath;
    });
  }
}

async function enableCpu(dir: string): Promise<void> {
  const controllers = (await readFile(join(dir, 'cgroup.controllers'), 'utf8')).split(/\s+/);
  if (!controllers.includes('cpu')) throw new Error(`the cpu controller is not available in ${dir}`);
  const enabled = (await readFile(join(dir, 'cgroup.subtree_control'), 'utf8')).split(/\s+/);
  if (!enabled.includes('cpu')) await writeFile(join(dir, 'cgroup.subtree_control'), '+cpu');
}

async function exists(p: string): Promise<boolean> {
  return access(p).then(
    () => true,
    () => false,
  );
}
