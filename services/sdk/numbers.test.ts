// Whole-number options from JavaScript (no types to stop a 1.5 or a NaN) are refused before any
// call, naming the field; before, they failed to encode and came back INTERNAL naming nothing
// (or a bare RangeError from BigInt). The typed gRPC client is a fake that counts calls.
import { describe, expect, it } from 'vitest';
import { Forkfleet } from './index.ts';

function client(): { ff: Forkfleet; calls: string[] } {
  const calls: string[] = [];
  const ff = new Forkfleet({ address: '127.0.0.1:1', token: 'ff_test', ca: Buffer.from('-----BEGIN CERTIFICATE-----\n'), tenant: 't1', retry: { attempts: 1 } });
  ff.close();
  (ff as unknown as { rpc: unknown }).rpc = new Proxy({}, { get: (_t, name) => () => (calls.push(String(name)), Promise.reject(new Error('no server'))) });
  return { ff, calls };
}

describe('SDK whole-number options', () => {
  it('aFractionNaNOrNegativeNumber_isInvalidArgumentNamingTheField_andNoCallIsMade', async () => {
    const { ff, calls } = client();
    const bad: Array<[string, () => Promise<unknown>]> = [
      ['resources.memory_mib', () => ff.create({ memoryMib: 1.5 })],
      ['resources.disk_mib', () => ff.create({ diskMib: -1 })],
      ['resources.vcpus', () => ff.create({ vcpus: Number.NaN })],
      ['count', () => ff.fork({ snapshotId: 'sn-x' }, 2.5)],
      ['placement.max_per_host', () => ff.fork({ snapshotId: 'sn-x' }, 2, { maxPerHost: -2 })],
      ['snapshot_retention.keep_last', () => ff.fork({ snapshotId: 'sn-x' }, 2, { snapshotRetention: { keepLast: 0.5 } })],
      ['retention.keep_last', () => ff.sandbox('sb-x').snapshot({ keepLast: Infinity })],
      ['max_bytes', () => ff.sandbox('sb-x').readFile('/etc/hostname', { maxBytes: 1.25 })],
      ['limit', () => ff.listOperations({ limit: Number.NaN })],
      [
        'after_revision',
        async () => {
          for await (const e of ff.watch({ afterRevision: -3 })) void e;
        },
      ],
    ];
    for (const [field, call] of bad) await expect(call(), field).rejects.toMatchObject({ kind: 'invalid_argument', field });
    expect(calls).toEqual([]);
  });
});
