// Guest images, built from Debian packages already installed on the machine and cached by
// the hash of their recipe (build script + package versions + options), outside git.
//   cache: $FORKFLEET_CACHE_DIR/images/<name>-<hash>/ (default /var/cache/forkfleet)
//   CLI:   node --import tsx deploy/images/build.ts tiny|debian
// A build runs in a temp dir next to the cache entry and is renamed into place, so a reader
// never sees a half-built image and concurrent builders do not clash. The build's processes
// die with the process that started it (a PID namespace of their own, tied to it), and the
// temp dir of a builder that was killed is removed by the next build.
import { execFile } from 'node:child_process';
import { createHash } from 'node:crypto';
import { mkdir, mkdtemp, readdir, readFile, rename, rm, stat } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { ImageBuildError } from '../../host-agent/errors.ts';
import { isAlive } from '../../host-agent/adapters/qemu/process.ts';
import { onPath, tiedToUs } from '../../host-agent/adapters/tied.ts';
import type { GuestImage } from '../../host-agent/domain/vmm.ts';

import { IMAGE_NAMES, type ImageName } from './names.ts';

const run = promisify(execFile);
const here = dirname(fileURLToPath(import.meta.url));

export type { ImageName } from './names.ts';

export interface ImageOptions {
  /** Guest kernel version; default: the one linux-image-amd64 installs (guestKernel). */
  kernelVersion?: string;
  /** Size of the data disk (tiny) or root disk (debian), MiB. */
  diskMib?: number;
  cacheDir?: string;
}

interface Recipe {
  script: string;
  /** Further files in this directory the script reads (part of the recipe hash). */
  inputs: string[];
  packages: string[];
  defaultDiskMib: number;
  kernelArgs: string;
  /**
   * Host binaries the script copies with their shared-library closure (ldd): the libraries'
   * contents are inputs too, so a security update of glib or libc builds the image again
   * (the packages above name only the binary's own package).
   */
  closureOf?: string[];
}

// Kernel arguments for -M microvm under TCG (VMM-NOTES): the early TSC frequency avoids a
// hang in calibration, pci=off skips probing a bus microvm doesn't have.
const MICROVM_ARGS = 'console=ttyS0 tsc_early_khz=2000000 pci=off quiet';

const RECIPES: Record<ImageName, Recipe> = {
  tiny: {
    script: 'build-tiny.sh',
    inputs: ['ff-clone.b64', 'ff-reseed.b64'],
    packages: ['linux-image-amd64', 'busybox-static', 'qemu-guest-agent', 'e2fsprogs', 'qemu-utils'],
    closureOf: ['/usr/sbin/qemu-ga'],
    defaultDiskMib: 64,
    kernelArgs: MICROVM_ARGS,
  },
  debian: {
    script: 'build-debian.sh',
    inputs: ['ff-clone.b64', 'ff-reseed.b64'],
    packages: ['linux-image-amd64', 'busybox-static', 'mmdebstrap', 'e2fsprogs', 'qemu-utils'],
    defaultDiskMib: 1024,
    kernelArgs: MICROVM_ARGS,
  },
};

export function defaultCacheDir(): string {
  return process.env.FORKFLEET_CACHE_DIR ?? '/var/cache/forkfleet';
}

/**
 * The guest kernel: the one linux-image-amd64 (which setup installs) depends on, where it is
 * in /boot; else the newest generic one there. Not simply the newest: a cloud image's
 * linux-image-cloud-amd64 (6.1.0-28-cloud-amd64 sorts after 6.1.0-28-amd64) is built for
 * another set of devices, and the recipe hash names linux-image-amd64's version.
 */
async function guestKernel(): Promise<string> {
  const depends = await run('dpkg-query', ['-W', '-f', '${Depends}', 'linux-image-amd64']).then(
    (r) => r.stdout,
    () => '',
  );
  const wanted = /linux-image-(\S+)/.exec(depends)?.[1];
  if (wanted && (await exists(`/boot/vmlinuz-${wanted}`))) return wanted;
  const { stdout } = await run('sh', ['-c', 'ls /boot/vmlinuz-* | sed "s|/boot/vmlinuz-||" | grep -v -e "-cloud-" -e "-rt-" | sort -V | tail -n1']);
  const v = stdout.trim();
  if (!v) throw new ImageBuildError('?', 'no /boot/vmlinuz-* (install linux-image-amd64)');
  return v;
}

async function packageVersions(pkgs: string[]): Promise<string> {
  try {
    const { stdout } = await run('dpkg-query', ['-W', '-f', '${Package}=${Version}\\n', ...pkgs]);
    return stdout;
  } catch (e) {
    throw new ImageBuildError(pkgs.join(','), `missing Debian packages (apt-get install ${pkgs.join(' ')})`, { cause: e });
  }
}

export async function recipeHash(name: ImageName, opts: ImageOptions = {}): Promise<{ hash: string; kernelVersion: string; diskMib: number }> {
  const r = RECIPES[name];
  const kernelVersion = opts.kernelVersion ?? (await guestKernel());
  const diskMib = opts.diskMib ?? r.defaultDiskMib;
  const h = createHash('sha256');
  h.update(await readFile(join(here, r.script)));
  for (const f of r.inputs) h.update(await readFile(join(here, f)));
  h.update(await packageVersions(r.packages));
  for (const bin of r.closureOf ?? []) h.update(await closureDigest(bin));
  if (name === 'debian') h.update(await readFile(await aptSourcesFile()));
  h.update(JSON.stringify({ name, kernelVersion, diskMib, kernelArgs: r.kernelArgs }));
  return { hash: h.digest('hex').slice(0, 16), kernelVersion, diskMib };
}

/** Each library `bin` loads (as ldd resolves them, the build script copies them): path and content digest, one per line. */
export async function closureDigest(bin: string): Promise<string> {
  const { stdout } = await run('ldd', [bin]).catch((e: unknown) => {
    throw new ImageBuildError(bin, `ldd ${bin} failed (is its package installed?)`, { cause: e });
  });
  const libs = [...new Set(stdout.match(/\/\S+/g) ?? [])].sort();
  const lines = await Promise.all(libs.map(async (lib) => `${lib} ${createHash('sha256').update(await readFile(lib)).digest('hex')}`));
  return `${lines.join('\n')}\n`;
}

/** The machine's own apt sources: the debian image's mirror argument (no host names in code). */
export async function aptSourcesFile(): Promise<string> {
  for (const f of ['/etc/apt/sources.list.d/debian.sources', '/etc/apt/sources.list']) {
    try {
      if ((await stat(f)).size > 0) return f;
    } catch {
      // try the next one
    }
  }
  throw new ImageBuildError('debian', 'no apt sources file on this machine');
}

async function exists(p: string): Promise<boolean> {
  try {
    await stat(p);
    return true;
  } catch {
    return false;
  }
}

/** A build's temp dir: `.<name>-<hash>.build-<builder pid>-<random>`. */
const BUILD_DIR = /^\.[a-z0-9]+-[0-9a-f]+\.build-(\d+)-/;

/**
 * Removes the temp dirs of builds whose builder is gone (killed mid-build: its processes died
 * with it, see buildCommand). A dir whose builder's PID is alive, even reused by another
 * process, is left alone.
 */
export async function removeAbandonedBuilds(root: string): Promise<string[]> {
  const removed: string[] = [];
  for (const name of await readdir(root).catch(() => [] as string[])) {
    const pid = Number(BUILD_DIR.exec(name)?.[1] ?? NaN);
    if (!Number.isInteger(pid) || pid <= 1 || pid === process.pid || isAlive(pid)) continue;
    await rm(join(root, name), { recursive: true, force: true });
    removed.push(name);
  }
  return removed;
}

/**
 * The command line of a build script. It runs as PID 1 of a PID namespace of its own that is
 * tied to this process (setpriv --pdeathsig, unshare --kill-child): if this process dies, the
 * kernel kills the build and everything it started (mmdebstrap, apt, mkfs), instead of a
 * second build racing an orphaned one. In a mount namespace of its own too: what mmdebstrap
 * mounts in the root file system it builds goes with the namespace, so removing a killed
 * build's temp dir never reaches into a mount. Without root or unshare, only bash is tied.
 */
export function buildCommand(args: readonly string[]): [string, string[]] {
  if (process.getuid?.() === 0 && onPath('unshare')) return tiedToUs('unshare', ['--mount', '--pid', '--fork', '--kill-child=KILL', '--', 'bash', ...args]);
  return tiedToUs('bash', args);
}

/** Return the cached image for `name`, building it first if its recipe changed. */
export async function ensureImage(name: ImageName, opts: ImageOptions = {}): Promise<GuestImage> {
  const r = RECIPES[name];
  const { hash, kernelVersion, diskMib } = await recipeHash(name, opts);
  const root = join(opts.cacheDir ?? defaultCacheDir(), 'images');
  const dir = join(root, `${name}-${hash}`);
  // Every time, not only before a build: a killed build's directory (~1 GiB for debian) would
  // otherwise stay for good once its image was found cached (another builder won) or is never
  // asked for again.
  await removeAbandonedBuilds(root);
  if (!(await exists(join(dir, 'image.json')))) {
    await mkdir(root, { recursive: true });
    const tmp = await mkdtemp(join(root, `.${name}-${hash}.build-${process.pid}-`));
    try {
      const args = [join(here, r.script), tmp, kernelVersion, String(diskMib)];
      if (name === 'debian') args.push(await aptSourcesFile());
      // The scripts' temp files (mktemp, mmdebstrap's) go inside the build's own directory: a
      // killed build (its EXIT traps never run) leaves nothing in /tmp, and
      // removeAbandonedBuilds takes them with the rest.
      const scratch = join(tmp, '.scratch');
      await mkdir(scratch);
      await run(...buildCommand(args), { maxBuffer: 64 << 20, env: { ...process.env, TMPDIR: scratch } });
      await rm(scratch, { recursive: true, force: true });
      try {
        await rename(tmp, dir);
      } catch (e) {
        // Another builder won the race; its result is equivalent.
        if (!(await exists(join(dir, 'image.json')))) throw e;
      }
    } catch (e) {
      const stderr = (e as { stderr?: string }).stderr ?? '';
      throw new ImageBuildError(name, stderr.trim().split('\n').slice(-5).join(' | ') || String(e), { cause: e });
    } finally {
      await rm(tmp, { recursive: true, force: true });
    }
  }
  const meta = JSON.parse(await readFile(join(dir, 'image.json'), 'utf8')) as {
    kernel: string;
    initrd: string;
    disk: string;
    readyMarker: string;
    kernelArgs?: string;
  };
  const { stdout } = await run('qemu-img', ['info', '--output=json', join(dir, meta.disk)]);
  const info = JSON.parse(stdout) as { 'virtual-size': number };
  return {
    name,
    recipeHash: hash,
    kernel: join(dir, meta.kernel),
    initrd: join(dir, meta.initrd),
    disk: join(dir, meta.disk),
    diskVirtualSize: info['virtual-size'],
    kernelArgs: meta.kernelArgs ? `${r.kernelArgs} ${meta.kernelArgs}` : r.kernelArgs,
    readyMarker: meta.readyMarker,
  };
}

if (process.argv[1] && fileURLToPath(import.meta.url) === process.argv[1]) {
  const name = process.argv[2] as ImageName | undefined;
  if (!name || !(IMAGE_NAMES as readonly string[]).includes(name)) {
    console.error('usage: node --import tsx deploy/images/build.ts tiny|debian');
    process.exit(2);
  }
  const t0 = Date.now();
  ensureImage(name).then(
    (img) => console.log(JSON.stringify({ ...img, ms: Date.now() - t0 }, null, 2)),
    (e: unknown) => {
      console.error(e);
      process.exit(1);
    },
  );
}
