// An image cache entry's image.json: what the build script wrote (file names, ready marker)
// and what build.ts adds once the script is done: each file's size (a cheap check that a
// cache entry is whole, e.g. after a power loss) and the base disk's sha256 (snapshots record
// it; a host restores one only over a base disk with the same digest). Kept apart from
// build.ts so the VMM driver can read it without loading the builder.
import { createHash } from 'node:crypto';
import { createReadStream } from 'node:fs';
import { readFile, stat } from 'node:fs/promises';
import { basename, dirname, join } from 'node:path';

export const IMAGE_META_FILE = 'image.json';

export interface ImageMeta {
  name: string;
  kernelVersion: string;
  /** File names in the entry's directory. */
  kernel: string;
  initrd: string;
  disk: string;
  readyMarker: string;
  /** Appended to the recipe's kernel arguments. */
  kernelArgs?: string;
  /** sha256 (hex) of the disk file as built; never written afterwards (VMs overlay it). */
  diskSha256: string;
  diskVirtualSize: number;
  /** Bytes of each file above, by name. */
  sizes: Record<string, number>;
}

const SHA256 = /^[0-9a-f]{64}$/;

/** sha256 (hex) of a file's bytes, read as a stream. */
export async function fileSha256(path: string): Promise<string> {
  const h = createHash('sha256');
  for await (const chunk of createReadStream(path, { highWaterMark: 1 << 20 })) h.update(chunk as Buffer);
  return h.digest('hex');
}

function isPlainName(v: unknown): v is string {
  return typeof v === 'string' && v !== '' && v !== '.' && v !== '..' && !v.includes('/');
}

/** A file (or a directory on its path) that is not there, as opposed to one that cannot be read now. */
function isMissing(e: unknown): boolean {
  const code = (e as NodeJS.ErrnoException | undefined)?.code;
  return code === 'ENOENT' || code === 'ENOTDIR';
}

/**
 * The entry in `dir`, if it is whole as far as a cheap look tells: image.json parses, has
 * every field, and names files that exist with the sizes it records. Else why not (the
 * caller builds it again). Contents are not hashed: that is the build's work, once.
 * A file that cannot be read for another reason than its absence (EIO, EMFILE, EACCES) is
 * thrown, not `invalid`: the entry may be whole, and its caller must not remove a base disk
 * running VMs and snapshots use for what may be a passing fault.
 */
export async function checkImageDir(dir: string): Promise<{ meta: ImageMeta } | { invalid: string }> {
  let raw: string;
  try {
    raw = await readFile(join(dir, IMAGE_META_FILE), 'utf8');
  } catch (e) {
    if (!isMissing(e)) throw e;
    return { invalid: `${IMAGE_META_FILE}: ${(e as NodeJS.ErrnoException).code}` };
  }
  let m: Partial<ImageMeta>;
  try {
    m = JSON.parse(raw) as Partial<ImageMeta>;
  } catch {
    return { invalid: `${IMAGE_META_FILE} does not parse` };
  }
  if (typeof m !== 'object' || m === null) return { invalid: `${IMAGE_META_FILE} is not an object` };
  for (const f of ['kernel', 'initrd', 'disk'] as const) if (!isPlainName(m[f])) return { invalid: `${IMAGE_META_FILE}: ${f} is not a file name` };
  if (typeof m.readyMarker !== 'string' || typeof m.name !== 'string' || typeof m.kernelVersion !== 'string') return { invalid: `${IMAGE_META_FILE}: name, kernelVersion or readyMarker missing` };
  if (m.kernelArgs !== undefined && typeof m.kernelArgs !== 'string') return { invalid: `${IMAGE_META_FILE}: kernelArgs is not a string` };
  if (typeof m.diskSha256 !== 'string' || !SHA256.test(m.diskSha256)) return { invalid: `${IMAGE_META_FILE}: no diskSha256` };
  if (typeof m.diskVirtualSize !== 'number' || !(m.diskVirtualSize > 0)) return { invalid: `${IMAGE_META_FILE}: no diskVirtualSize` };
  if (typeof m.sizes !== 'object' || m.sizes === null) return { invalid: `${IMAGE_META_FILE}: no sizes` };
  for (const f of [m.kernel, m.initrd, m.disk] as string[]) {
    const want = (m.sizes as Record<string, unknown>)[f];
    if (typeof want !== 'number') return { invalid: `${IMAGE_META_FILE}: no size for ${f}` };
    const st = await stat(join(dir, f)).catch((e: unknown) => {
      if (isMissing(e)) return undefined;
      throw e;
    });
    if (!st?.isFile()) return { invalid: `${f} missing` };
    if (st.size !== want) return { invalid: `${f} has ${st.size} bytes, ${IMAGE_META_FILE} says ${want}` };
  }
  return { meta: m as ImageMeta };
}

/**
 * The recorded sha256 of the base disk at `disk` (a GuestImage's disk: a cache entry's
 * file), from the image.json beside it; undefined when there is none, or it does not name
 * that file or record a digest (no image built here at that path).
 */
export async function recordedDiskSha256(disk: string): Promise<string | undefined> {
  try {
    const m = JSON.parse(await readFile(join(dirname(disk), IMAGE_META_FILE), 'utf8')) as Partial<ImageMeta>;
    if (m.disk !== basename(disk) || typeof m.diskSha256 !== 'string' || !SHA256.test(m.diskSha256)) return undefined;
    return m.diskSha256;
  } catch {
    return undefined;
  }
}
