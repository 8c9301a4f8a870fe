// The build scripts' kernel modules step: each module the guest is given (virtio, ext4) is
// resolved with modprobe --show-depends, and one that resolves to nothing (modprobe failing,
// as while an upgrade has unpacked a kernel but not run its depmod) stops the build rather
// than caching an image whose guest never finds its disk. The step alone is run (its lines of
// each script, from `mods=()` to the end of the copy loop), with a stub modprobe first on PATH:
// the rest of a build needs the machine's kernel, busybox and mmdebstrap.
import { spawnSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, beforeEach, describe, expect, it } from 'vitest';

/** The module step of a build script: from `mods=()` through the loop that copies them. */
function moduleStep(script: string): string {
  const text = readFileSync(join(import.meta.dirname, script), 'utf8');
  const step = /^mods=\(\)\n[\s\S]*?^done\n[\s\S]*?^done\n/m.exec(text)?.[0];
  if (step === undefined || !step.includes('load-order')) throw new Error(`${script}: no module step (mods=() ... done ... done)`);
  return step;
}

describe.each(['build-tiny.sh', 'build-debian.sh'])('%s modules', (script) => {
  let tmp: string;
  beforeEach(() => {
    tmp = mkdtempSync(join(tmpdir(), 'ff-build-modules-'));
    mkdirSync(join(tmp, 'bin'));
    mkdirSync(join(tmp, 'out', 'lib', 'modules'), { recursive: true });
    mkdirSync(join(tmp, 'ko'));
    for (const m of ['virtio_ring', 'virtio', 'virtio_mmio', 'virtio_console', 'virtio_blk', 'virtio-rng', 'virtio_net', 'ext4']) writeFileSync(join(tmp, 'ko', `${m}.ko`), m);
    // The module is the last argument. STUB_FAIL: modprobe fails for it; STUB_EMPTY: answers
    // nothing; STUB_BUILTIN: built in. Else its dependencies and itself, as insmod lines.
    writeFileSync(
      join(tmp, 'bin', 'modprobe'),
      [
        '#!/bin/bash',
        'for a; do m=$a; done',
        'listed() { case " $1 " in *" $m "*) return 0;; esac; return 1; }',
        'if listed "$STUB_FAIL"; then echo "modprobe: FATAL: Module $m not found in directory /lib/modules/$2" >&2; exit 1; fi',
        'listed "$STUB_EMPTY" && exit 0',
        'if listed "$STUB_BUILTIN"; then echo "builtin $m"; exit 0; fi',
        'printf "insmod %s \\n" "$STUB_KO/virtio_ring.ko" "$STUB_KO/virtio.ko" "$STUB_KO/$m.ko"',
      ].join('\n'),
      { mode: 0o755 },
    );
  });
  afterEach(() => rmSync(tmp, { recursive: true, force: true }));

  function run(env: { STUB_FAIL?: string; STUB_EMPTY?: string; STUB_BUILTIN?: string }): { status: number | null; stderr: string; loadOrder: string[] } {
    const out = join(tmp, 'out');
    // tiny writes under $root, debian under $ird.
    const r = spawnSync('bash', ['-c', `set -euo pipefail\nkver=6.1.0-test\nroot=${out}\nird=${out}\n${moduleStep(script)}`], {
      encoding: 'utf8',
      env: { ...process.env, PATH: `${join(tmp, 'bin')}:${process.env.PATH ?? '/usr/bin:/bin'}`, STUB_KO: join(tmp, 'ko'), STUB_FAIL: '', STUB_EMPTY: '', STUB_BUILTIN: '', ...env },
    });
    let loadOrder: string[] = [];
    try {
      loadOrder = readFileSync(join(out, 'lib', 'modules', 'load-order'), 'utf8').split('\n').filter(Boolean);
    } catch {
      // not written
    }
    return { status: r.status, stderr: r.stderr, loadOrder };
  }

  it('moduleStep_whenModprobeFails_stopsTheBuild', () => {
    const r = run({ STUB_FAIL: 'virtio_blk' });
    expect(r.status).not.toBe(0);
    expect(r.stderr).toContain('Module virtio_blk not found');
  });

  it('moduleStep_whenAModuleIsNeitherAModuleNorBuiltIn_stopsTheBuild_namingIt', () => {
    const r = run({ STUB_EMPTY: 'ext4' });
    expect(r.status).not.toBe(0);
    expect(r.stderr).toContain('module ext4: neither a module nor built in for kernel 6.1.0-test');
  });

  it('moduleStep_withModulesAndBuiltIns_writesEachModuleOnceInDependencyOrder', () => {
    const r = run({ STUB_BUILTIN: 'ext4 virtio_mmio' });
    expect(r.stderr).toBe('');
    expect(r.status).toBe(0);
    const own = ['virtio_console', 'virtio_blk', 'virtio-rng', ...(script === 'build-tiny.sh' ? ['virtio_net'] : [])];
    expect(r.loadOrder).toEqual(['virtio_ring.ko', 'virtio.ko', ...own.map((m) => `${m}.ko`)]);
  });
});
