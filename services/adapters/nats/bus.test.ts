import { describe, expect, it } from 'vitest';
import { create, fromBinary, toBinary } from '@bufbuild/protobuf';
import { HeartbeatSchema, VmState } from '../../../proto/gen/forkfleet/v1/hostwork_pb.ts';
import { decodeHeartbeat } from './bus.ts';

describe('decodeHeartbeat', () => {
  const hb = create(HeartbeatSchema, {
    hostId: 'h1',
    seq: 7n,
    bootId: 'boot',
    capacity: { vcpus: 8, memoryMib: 1024n },
    vms: Array.from({ length: 50 }, (_, i) => ({ sandboxId: `sb-${i}`, state: VmState.RUNNING, rssBytes: BigInt(i), idle: { seconds: BigInt(i), nanos: 5 } })),
    snapshots: [{ snapshotId: 'sn-1', complete: true }],
    peerAddress: '127.0.0.1:1',
    inflightOps: 3,
  });

  it('decodeHeartbeat_withVms_equalsAFullDecodeWhenVmsAreRead', () => {
    const bytes = toBinary(HeartbeatSchema, hb);
    const lazy = decodeHeartbeat(bytes);
    expect(lazy.hostId).toBe('h1');
    expect(lazy.snapshots.map((s) => s.snapshotId)).toEqual(['sn-1']);
    expect(lazy.vms.map((v) => v.sandboxId)).toEqual(hb.vms.map((v) => v.sandboxId));
    expect({ ...lazy, vms: [...lazy.vms] }).toEqual(fromBinary(HeartbeatSchema, bytes));
  });

  it('decodeHeartbeat_withVmEntriesInterleavedWithOtherFields_stillEqualsAFullDecode', () => {
    // Protobuf allows any field order; our encoder writes the list in one run, another may not.
    const vmOnly = (i: number): Uint8Array => toBinary(HeartbeatSchema, create(HeartbeatSchema, { vms: [hb.vms[i]!] }));
    const other = toBinary(HeartbeatSchema, create(HeartbeatSchema, { ...hb, vms: [] }));
    const bytes = Buffer.concat([vmOnly(0), other.subarray(0, 4), vmOnly(1), other.subarray(4), vmOnly(2)]);
    const lazy = decodeHeartbeat(bytes);
    expect({ ...lazy, vms: [...lazy.vms] }).toEqual(fromBinary(HeartbeatSchema, bytes));
    expect(lazy.vms.map((v) => v.sandboxId)).toEqual(['sb-0', 'sb-1', 'sb-2']);
  });

  it('decodeHeartbeat_withoutVms_decodesAsUsual', () => {
    const bytes = toBinary(HeartbeatSchema, create(HeartbeatSchema, { ...hb, vms: [] }));
    expect(decodeHeartbeat(bytes)).toEqual(fromBinary(HeartbeatSchema, bytes));
  });

  it('decodeHeartbeat_whenMalformed_throws', () => {
    expect(() => decodeHeartbeat(new Uint8Array([0x42, 0xff, 0xff]))).toThrow();
  });
});
