// For tests: node:fs/promises whose file handles fail their next fsync once per path (EIO),
// and whose open of a path can fail once (EMFILE),
// as Linux reports a writeback error to one fsync only (the fsync after it returns 0). A test
// file mocks node:fs/promises with it and adds paths to `failOnce`:
//   vi.mock('node:fs/promises', async (real) => (await import('../fsync-fault.ts')).failingFsync(await real()));
import type * as FsPromises from 'node:fs/promises';

/** Paths whose next fsync fails (EIO). */
export const failOnce = new Set<string>();
/** Paths whose next open fails (EMFILE). */
export const openFailsOnce = new Set<string>();

export function failingFsync(real: typeof FsPromises): typeof FsPromises {
  const open = async (...a: Parameters<typeof real.open>): ReturnType<typeof real.open> => {
    const path = String(a[0]);
    if (openFailsOnce.delete(path)) throw Object.assign(new Error(`EMFILE: too many open files, open '${path}'`), { code: 'EMFILE' });
    const fh = await real.open(...a);
    if (failOnce.delete(path)) fh.sync = () => Promise.reject(Object.assign(new Error(`EIO: i/o error, fsync '${path}'`), { code: 'EIO' }));
    return fh;
  };
  return { ...real, open, default: { ...real, open } } as typeof FsPromises;
}
