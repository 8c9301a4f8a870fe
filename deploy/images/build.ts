// Guest images, built from Debian packages already installed on the machine and cached by
// the hash of their recipe (build script + package versions + options), outside git.
//   cache: $FORKFLEET_CACHE_DIR/images/<name>-<hash>/ (default /var/cache/forkfleet)
//   CLI:   node --import tsx deploy/images/build.ts tiny|debian
// A build runs in a temp dir next to the cache entry and is renamed into place, so a reader
// never sees a half-built image and concurrent builders do not clash; its files and the dir
// are fsynced before the rename (and the cache root after it), so a power loss leaves the
// whole entry or none. A cache hit is checked cheaply (meta.ts checkImageDir: image.json
// parses, its files exist with the sizes it records); an entry that fails it is built again
// (one that cannot be read now, EIO say, is an error: not removed, as VMs may run over it).
// Callers in one process asking for the same entry share one build. The build's processes
// die with the process that started it (a PID namespace of their own, tied to it), and the
// temp dir of a builder that was killed is removed by the next build.
// Builds are reproducible (the scripts, mkext4.sh): the same recipe hash gives the same bytes
// on every host, as far as the debian image's mirror allows. image.json records the base
// disk's sha256, which snapshots carry (a host refuses to restore one over another disk).
import { execFile } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import { mkdir, mkdtemp, readdir, readFile, rename, rm, stat, writeFile } from 'node:fs/promises';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { ImageBuildError } from '../../host-agent/errors.ts';
import { fsyncAll, fsyncPath } from '../../host-agent/adapters/durable.ts';
import { onPath, tiedToUs } from '../../host-agent/adapters/tied.ts';
import type { GuestImage } from '../../host-agent/domain/vmm.ts';

import { checkImageDir, fileSha256, IMAGE_META_FILE, type ImageMeta } from './meta.ts';
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
    inputs: ['mkext4.sh', 'ff-clone.b64', 'ff-reseed.b64'],
    // cpio writes the initramfs: its version is part of the image's bytes. xz unpacks the
    // kernel (without it the build could say only that the extraction failed), zstd the
    // modules of a kernel that ships them compressed so.
    packages: ['linux-image-amd64', 'busybox-static', 'qemu-guest-agent', 'e2fsprogs', 'qemu-utils', 'cpio', 'xz-utils', 'zstd'],
    closureOf: ['/usr/sbin/qemu-ga'],
    defaultDiskMib: 64,
    kernelArgs: MICROVM_ARGS,
  },
  debian: {
    script: 'build-debian.sh',
    inputs: ['mkext4.sh', 'ff-clone.b64', 'ff-reseed.b64'],
    packages: ['linux-image-amd64', 'busybox-static', 'mmdebstrap', 'e2fsprogs', 'qemu-utils', 'cpio', 'xz-utils', 'zstd'],
    defaultDiskMib: 1024,
    kernelArgs: MICROVM_ARGS,
  },
};

/** The Debian packages whose versions are in an image's recipe hash, and its build script. */
export function recipeInputs(name: ImageName): { script: string; packages: readonly string[] } {
  return { script: RECIPES[name].script, packages: RECIPES[name].packages };
}

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

/** `package=version` of each of the image's packages, one a line; a failure names those dpkg does not know. */
export async function packageVersions(name: string, pkgs: readonly string[]): Promise<string> {
  try {
    const { stdout } = await run('dpkg-query', ['-W', '-f', '${Package}=${Version}\\n', ...pkgs]);
    return stdout;
  } catch (e) {
    const stderr = (e as { stderr?: string }).stderr ?? '';
    const named = [...stderr.matchAll(/no packages found matching (\S+)/g)].map((m) => m[1]!);
    const missing = named.length > 0 ? named : pkgs;
    throw new ImageBuildError(name, `missing Debian packages ${missing.join(', ')} (apt-get install ${missing.join(' ')})`, { cause: e });
  }
}

export async function recipeHash(name: ImageName, opts: ImageOptions = {}): Promise<{ hash: string; kernelVersion: string; diskMib: number }> {
  const r = RECIPES[name];
  const kernelVersion = opts.kernelVersion ?? (await guestKernel());
  const diskMib = opts.diskMib ?? r.defaultDiskMib;
  const h = createHash('sha256');
  h.update(await readFile(join(here, r.script)));
  for (const f of r.inputs) h.update(await readFile(join(here, f)));
  h.update(await packageVersions(name, r.packages));
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
 * Whether a builder's PID is in use: a process we may not signal (EPERM: another user's, root's
 * build seen by a non-root agent) is alive too, not gone.
 */
function builderAlive(pid: number): boolean {
  try {
    process.kill(pid, 0);
    return true;
  } catch (e) {
    return (e as NodeJS.ErrnoException).code === 'EPERM';
  }
}

/**
 * Removes the temp dirs of builds whose builder is gone (killed mid-build: its processes died
 * with it, see buildCommand). A dir whose builder's PID is alive, even reused by another
 * process, is left alone. Housekeeping: a dir that cannot be removed is warned about and left
 * (the next build tries again), not an error of the image asked for.
 */
export async function removeAbandonedBuilds(root: string): Promise<string[]> {
  const removed: string[] = [];
  for (const name of await readdir(root).catch(() => [] as string[])) {
    const pid = Number(BUILD_DIR.exec(name)?.[1] ?? NaN);
    if (!Number.isInteger(pid) || pid <= 1 || pid === process.pid || builderAlive(pid)) continue;
    try {
      await rm(join(root, name), { recursive: true, force: true });
      removed.push(name);
    } catch (e) {
      process.emitWarning(`the abandoned image build ${join(root, name)} could not be removed: ${(e as Error).message ?? String(e)}`);
    }
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

/**
 * The builds in the image cache that look whole (checkImageDir: image.json and its files'
 * sizes; not hashed): name, recipe hash and base disk sha256 of each `<name>-<hash>` entry. A
 * host agent lists them in its heartbeats from its start (Heartbeat.images).
 */
export async function cachedImages(opts: Pick<ImageOptions, 'cacheDir'> = {}): Promise<Array<{ name: string; recipeHash: string; diskSha256: string }>> {
  const root = join(opts.cacheDir ?? defaultCacheDir(), 'images');
  const out: Array<{ name: string; recipeHash: string; diskSha256: string }> = [];
  for (const entry of await readdir(root).catch(() => [] as string[])) {
    const m = /^([a-z]+)-([0-9a-f]+)$/.exec(entry);
    if (!m || !(IMAGE_NAMES as readonly string[]).includes(m[1]!)) continue;
    // One that cannot be read now is left out, as one that is not whole.
    const checked = await checkImageDir(join(root, entry)).catch((e: unknown) => ({ invalid: String(e) }));
    if ('meta' in checked) out.push({ name: m[1]!, recipeHash: m[2]!, diskSha256: checked.meta.diskSha256 });
  }
  return out;
}

/**
 * Whether one cache entry is there whole ('whole': its image.json parses and its files have
 * the sizes it records), gone or torn ('missing'), or cannot be told now ('unknown': a read
 * failed for another reason than a missing file, EIO or EMFILE say). One entry, not a listing:
 * an agent asks it on each restore of an image it noted as built.
 */
export async function cachedImage(name: ImageName, recipeHash: string, opts: Pick<ImageOptions, 'cacheDir'> = {}): Promise<'whole' | 'missing' | 'unknown'> {
  const dir = join(opts.cacheDir ?? defaultCacheDir(), 'images', `${name}-${recipeHash}`);
  try {
    return 'meta' in (await checkImageDir(dir)) ? 'whole' : 'missing';
  } catch {
    return 'unknown';
  }
}

/** Longest an image build may take (a Debian image from a slow mirror takes minutes). */
const BUILD_TIMEOUT_MS = 30 * 60_000;

/** Cache entries being checked or built by this process, by directory: one build per entry. */
const inflight = new Map<string, Promise<GuestImage>>();

/**
 * Return the cached image for `name`, building it first if its recipe changed or its cache
 * entry is not whole. Concurrent calls for the same entry share one build.
 */
export async function ensureImage(name: ImageName, opts: ImageOptions = {}): Promise<GuestImage> {
  const { hash, kernelVersion, diskMib } = await recipeHash(name, opts);
  const root = join(opts.cacheDir ?? defaultCacheDir(), 'images');
  const dir = join(root, `${name}-${hash}`);
  let p = inflight.get(dir);
  if (!p) {
    const started = loadOrBuild(name, hash, kernelVersion, diskMib, root, dir);
    p = started.finally(() => {
      if (inflight.get(dir) === p) inflight.delete(dir);
    });
    inflight.set(dir, p);
  }
  // A copy each: one caller's changes are not another's.
  return { ...(await p) };
}

async function loadOrBuild(name: ImageName, hash: string, kernelVersion: string, diskMib: number, root: string, dir: string): Promise<GuestImage> {
  const r = RECIPES[name];
  // Every time, not only before a build: a killed build's directory (~1 GiB for debian) would
  // otherwise stay for good once its image was found cached (another builder won) or is never
  // asked for again.
  await removeAbandonedBuilds(root);
  // A read error other than a missing file (EIO, EMFILE) fails this call and leaves the entry:
  // it may be whole, and running VMs overlay its disk.
  const check = () =>
    checkImageDir(dir).catch((e: unknown) => {
      throw new ImageBuildError(name, `the cache entry ${dir} cannot be read (left as it is)`, { cause: e });
    });
  let checked = await check();
  // An entry there now but not whole when checked may be another process's build that was
  // renamed into place in between: checked again before it is moved aside, and after (a whole
  // one goes back), so that no caller rebuilds, or hides for a moment, an image just published.
  if ('invalid' in checked && (await exists(dir))) {
    checked = await check();
    if ('invalid' in checked) {
      await discardEntry(root, dir, name, hash);
      checked = await check();
    }
  }
  if ('invalid' in checked) {
    await build(name, hash, kernelVersion, diskMib, root, dir);
    checked = await check();
    if ('invalid' in checked) throw new ImageBuildError(name, `${dir} after the build: ${checked.invalid}`);
  }
  const meta = checked.meta;
  return {
    name,
    recipeHash: hash,
    kernel: join(dir, meta.kernel),
    initrd: join(dir, meta.initrd),
    disk: join(dir, meta.disk),
    diskVirtualSize: meta.diskVirtualSize,
    diskSha256: meta.diskSha256,
    kernelArgs: meta.kernelArgs ? `${r.kernelArgs} ${meta.kernelArgs}` : r.kernelArgs,
    readyMarker: meta.readyMarker,
  };
}

/**
 * Moves a cache entry that is not whole out of the way (under a temp dir's name, so a kill
 * midway leaves it to removeAbandonedBuilds) and removes it. One that is whole by then
 * (another process built it meanwhile), or cannot be read to tell, goes back.
 */
async function discardEntry(root: string, dir: string, name: string, hash: string): Promise<void> {
  const aside = join(root, `.${name}-${hash}.build-${process.pid}-broken-${randomBytes(4).toString('hex')}`);
  try {
    await rename(dir, aside);
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code === 'ENOENT') return; // gone already
    throw new ImageBuildError(name, `cannot move the broken cache entry ${dir} aside`, { cause: e });
  }
  const broken = await checkImageDir(aside).then((c) => 'invalid' in c, () => false);
  if (!broken && (await rename(aside, dir).then(() => true, () => false))) return;
  await rm(aside, { recursive: true, force: true });
}

/** Builds the entry in a temp dir and renames it into place, durably. */
async function build(name: ImageName, hash: string, kernelVersion: string, diskMib: number, root: string, dir: string): Promise<void> {
  const r = RECIPES[name];
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
    // FF_RECIPE_HASH seeds what would otherwise be random (the file system's UUID).
    // Bounded: a stalled package mirror or a disk that stops answering would otherwise hold
    // every step that waits for this image (they share the build) for ever. SIGKILL: as root
    // the build runs under `unshare --fork --kill-child`, which ignores SIGTERM while it waits,
    // and killed, takes its PID namespace (the whole build) with it.
    await run(...buildCommand(args), { maxBuffer: 64 << 20, timeout: BUILD_TIMEOUT_MS, killSignal: 'SIGKILL', env: { ...process.env, TMPDIR: scratch, FF_RECIPE_HASH: hash } });
    await rm(scratch, { recursive: true, force: true });
    await completeMeta(tmp);
    // Durable before it is published: a power loss must not leave the name with torn files.
    const files = (await readdir(tmp, { recursive: true })).map((f) => join(tmp, f));
    await fsyncAll([...files, join(tmp, '.')]);
    try {
      await rename(tmp, dir);
    } catch (e) {
      // Another builder won the race; its result is equivalent.
      if ('invalid' in (await checkImageDir(dir))) throw e;
    }
    await fsyncPath(root);
  } catch (e) {
    const stderr = (e as { stderr?: string }).stderr ?? '';
    throw new ImageBuildError(name, stderr.trim().split('\n').slice(-5).join(' | ') || String(e), { cause: e });
  } finally {
    await rm(tmp, { recursive: true, force: true });
  }
}

/** Adds to the script's image.json what a cache hit checks and a snapshot records: sizes, the disk's digest and virtual size. */
async function completeMeta(tmp: string): Promise<void> {
  const path = join(tmp, IMAGE_META_FILE);
  const script = JSON.parse(await readFile(path, 'utf8')) as Omit<ImageMeta, 'diskSha256' | 'diskVirtualSize' | 'sizes'>;
  const sizes: Record<string, number> = {};
  for (const f of [script.kernel, script.initrd, script.disk]) sizes[f] = (await stat(join(tmp, f))).size;
  const disk = join(tmp, script.disk);
  const { stdout } = await run('qemu-img', ['info', '--output=json', disk]);
  const diskVirtualSize = (JSON.parse(stdout) as { 'virtual-size': number })['virtual-size'];
  const meta: ImageMeta = { ...script, diskSha256: await fileSha256(disk), diskVirtualSize, sizes };
  await writeFile(path, `${JSON.stringify(meta)}\n`);
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
      // The message and its causes, not a stack: what failed (a package, a download, mmdebstrap).
      const lines: string[] = [];
      for (let c: unknown = e; c !== undefined && lines.length < 5; c = c instanceof Error ? c.cause : undefined) lines.push(c instanceof Error ? c.message : String(c));
      process.stderr.write(`images:build ${name}: ${lines.join('\n  caused by: ')}\n`);
      process.exit(1);
    },
  );
}
