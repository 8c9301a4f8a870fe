import { describe, expect, it } from 'vitest';
import { spawnSync } from 'node:child_process';
import { cgroupMountCommands, shQuote } from './fleet.ts';

// /proc/self/mounts lines as the three layouts print them.
const V2 = 'cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate,memory_recursiveprot 0 0\n';
const V1 = 'tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0\ncgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\ncgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0\n';
const V1_COMOUNTED = 'tmpfs /sys/fs/cgroup tmpfs ro,mode=755 0 0\ncgroup /sys/fs/cgroup/cpu,cpuacct cgroup rw,nosuid,nodev,noexec,relatime,cpu,cpuacct 0 0\n';

describe('cgroupMountCommands (an agent namespace sees the cpu hierarchy)', () => {
  it('onCgroupV2_mountsTheUnifiedHierarchy', () => {
    expect(cgroupMountCommands(V2)).toEqual(['mount -t cgroup2 cgroup2 /sys/fs/cgroup']);
  });

  it('onCgroupV1_mountsTheCpuControllerWhereTheMachineHasIt', () => {
    expect(cgroupMountCommands(V1)).toEqual(['mount -t tmpfs -o size=64k,mode=0755 ff-cgroup /sys/fs/cgroup', "mkdir -p '/sys/fs/cgroup/cpu'", "mount -t cgroup -o cpu cgroup '/sys/fs/cgroup/cpu'"]);
  });

  it('onCoMountedCpuAndCpuacct_mountsBothAndLinksCpu', () => {
    expect(cgroupMountCommands(V1_COMOUNTED)).toEqual([
      'mount -t tmpfs -o size=64k,mode=0755 ff-cgroup /sys/fs/cgroup',
      "mkdir -p '/sys/fs/cgroup/cpu,cpuacct'",
      "mount -t cgroup -o cpu,cpuacct cgroup '/sys/fs/cgroup/cpu,cpuacct'",
      "ln -s '/sys/fs/cgroup/cpu,cpuacct' /sys/fs/cgroup/cpu",
    ]);
  });

  it('withoutACpuHierarchy_mountsNothing', () => {
    expect(cgroupMountCommands('proc /proc proc rw 0 0\n')).toEqual([]);
  });
});

describe('shQuote (paths in the agent\'s sh -c script)', () => {
  it('aPathWithShellCharacters_reachesTheCommandAsOneWordUnchanged', () => {
    for (const p of ['/srv/f$x', '/a b/c', "/it's", '/q"uote', '/back`tick`', '/bs\\n', '/$(touch /tmp/nope)']) {
      const r = spawnSync('sh', ['-c', `printf %s ${shQuote(p)}`], { encoding: 'utf8' });
      expect(r.stdout).toBe(p);
    }
  });
});
