// A snapshot records the sha256 of the base disk its disk layer overlays; a host restores it
// only over a base disk with that digest (its own build of the image may have other bytes),
// and refuses otherwise as it refuses an image unknown here. No QEMU runs: the refusal comes
// before anything is started.
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import pino from 'pino';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { SnapshotNotFoundError } from '../../errors.ts';
import type { GuestImage, LocalSnapshot, SnapshotManifest } from '../../domain/vmm.ts';
import { fingerprint } from './cmdline.ts';
import { QemuVmmDriver } from './driver.ts';

const dir = mkdtempSync(join(tmpdir(), 'ff-image-digest-'));
const HERE = 'a'.repeat(64);
const THERE = 'b'.repeat(64);
let driver: QemuVmmDriver;

/** This host's cache entry of image tiny-0123456789abcdef, recording `digest` (none: no image.json). */
function localImage(name: string, digest: string | undefined): GuestImage {
  const entry = join(dir, 'cache', name);
  mkdirSync(entry, { recursive: true });
  const disk = join(entry, 'disk.qcow2');
  writeFileSync(disk, '');
  if (digest) writeFileSync(join(entry, 'image.json'), JSON.stringify({ name: 'tiny', kernel: 'vmlinux', initrd: 'initramfs.cpio', disk: 'disk.qcow2', readyMarker: 'FORKFLEET_READY', diskSha256: digest }));
  return { name: 'tiny', recipeHash: '0123456789abcdef', kernel: join(entry, 'vmlinux'), initrd: join(entry, 'initramfs.cpio'), disk, diskVirtualSize: 64 << 20, kernelArgs: '', readyMarker: 'FORKFLEET_READY', diskSha256: digest ?? HERE };
}

/** A sealed snapshot (as shipped: manifest.json and the source's image.json) taken over a base disk with `digest`. */
async function snapshot(id: string, image: GuestImage, digest: string | undefined): Promise<LocalSnapshot> {
  const sdir = join(dir, 'snapshots', id);
  mkdirSync(sdir, { recursive: true });
  const manifest: SnapshotManifest = {
    schema: 1,
    snapshotId: id,
    parentSnapshotId: null,
    sourceVmId: 'src',
    createdAt: new Date(0).toISOString(),
    config: fingerprint('tcg', 128, 1, await driver.qemuVersion()),
    image: { name: 'tiny', recipeHash: '0123456789abcdef', kernelArgs: 'console=ttyS0', ...(digest ? { diskSha256: digest } : {}) },
    files: { memory: 'mem.img', deviceState: 'state.bin', disk: 'disk.qcow2' },
    diskVirtualSize: 64 << 20,
    method: 'receiver',
    sourcePauseMs: 0,
  };
  writeFileSync(join(sdir, 'manifest.json'), JSON.stringify(manifest));
  writeFileSync(join(sdir, 'image.json'), JSON.stringify(image));
  return { dir: sdir, manifest };
}

beforeAll(() => {
  driver = new QemuVmmDriver({ root: join(dir, 'agent'), accel: 'tcg', logger: pino({ level: 'silent' }) });
});
afterAll(async () => {
  await driver.close();
  rmSync(dir, { recursive: true, force: true });
});

describe('base disk digest of a restored snapshot', () => {
  it('restore_whenSnapshotWasTakenOverAnotherBaseDisk_refusesNamingBothDigests', async () => {
    const snap = await snapshot('s-other', localImage('tiny-0123456789abcdef', HERE), THERE);
    const err = await driver.restore(snap, { vmId: 'never' }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(SnapshotNotFoundError);
    expect((err as Error).message).toContain(`sha256 ${HERE}`);
    expect((err as Error).message).toContain(`sha256 ${THERE}`);
    expect((err as Error).message).toContain('tiny-0123456789abcdef');
    expect(driver.get('never')).toBeUndefined();
    expect(existsSync(join(dir, 'agent', 'vms', 'never'))).toBe(false);
  });

  it('prepareIncoming_whenSnapshotWasTakenOverAnotherBaseDisk_refusesBeforePreparingAnything', async () => {
    const image = localImage('tiny-0123456789abcdef', HERE);
    const snap = await snapshot('s-incoming', image, THERE);
    const err = await driver
      .prepareIncoming({ manifest: snap.manifest, image, diskLayerBacking: image.disk, writeDiskLayer: () => Promise.reject(new Error('must not be fetched')) }, { vmId: 'never-in' })
      .catch((e: unknown) => e);
    expect(err).toBeInstanceOf(SnapshotNotFoundError);
    expect((err as Error).message).toMatch(new RegExp(`${HERE}.*${THERE}`));
    expect(existsSync(join(dir, 'agent', 'vms', 'never-in'))).toBe(false);
  });

  it('restore_whenThisHostRecordsNoDigestForTheImage_refusesAsUnknownHere', async () => {
    const snap = await snapshot('s-unknown', localImage('tiny-unrecorded', undefined), THERE);
    const err = await driver.restore(snap, { vmId: 'never2' }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(SnapshotNotFoundError);
    expect((err as Error).message).toMatch(/unknown here/);
    expect((err as Error).message).toContain(THERE);
  });

  it('restore_whenDigestsMatch_orTheManifestHasNone_isNotRefusedForTheImage', async () => {
    // Both go on to the restore itself, which fails here for want of the snapshot's files.
    for (const [id, digest] of [['s-same', HERE], ['s-old', undefined]] as const) {
      const snap = await snapshot(id, localImage('tiny-0123456789abcdef', HERE), digest);
      const err = await driver.restore(snap, { vmId: `vm-${id}` }).catch((e: unknown) => e);
      expect(err).toBeInstanceOf(Error);
      expect(err).not.toBeInstanceOf(SnapshotNotFoundError);
      expect(driver.get(`vm-${id}`)).toBeUndefined();
    }
  });
});
