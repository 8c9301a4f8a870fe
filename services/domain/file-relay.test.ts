// Which file relay a host gets: what this replica has heard from it decides, and a host it has
// not heard yet is not guessed at.
import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import type { FleetStore, WorkBus } from './ports.ts';
import { Fleet } from './fleet.ts';
import { HeartbeatRegistry } from './fleet-view.ts';
import { sandboxRecord } from '../testkit/records.ts';
import { HeartbeatSchema, HostExecOutputSchema, HostFileResponseSchema } from './messages.ts';
import type { HostExecRequestMsg, HostFileRequestMsg } from './messages.ts';

/** A Fleet over one running sandbox, sb-a on host h1, whose relayed file requests are kept in `sent`. */
function fleetOnH1(): { fleet: Fleet; heard: HeartbeatRegistry; sent: HostFileRequestMsg[]; execs: string[][] } {
  const sent: HostFileRequestMsg[] = [];
  const execs: string[][] = [];
  const store = { getSandbox: async () => ({ value: sandboxRecord(), modRevision: 3 }) } as unknown as FleetStore;
  const bus = {
    maxPayload: 1 << 20,
    file: async (_h: string, req: HostFileRequestMsg) => {
      sent.push(req);
      return create(HostFileResponseSchema, { bytesWritten: BigInt(req.op.case === 'write' ? req.op.value.data.length : 0) });
    },
    // The guest command that puts a written file in place.
    exec: async function* (_h: string, req: HostExecRequestMsg) {
      execs.push(req.argv);
      yield create(HostExecOutputSchema, { seq: 1n, payload: { case: 'exit', value: { exitCode: 0 } } });
    },
  } as unknown as WorkBus;
  const heard = new HeartbeatRegistry();
  return { fleet: new Fleet({ store, bus, clock: { now: () => Date.now() }, heard, liveness: { suspectAfterMs: 3000, lostAfterMs: 10_000 } }), heard, sent, execs };
}

describe('the file relay a host gets', () => {
  it('fileCalls_toAHostThisReplicaHasNotHeardYet_areUnavailableAndRetryable_notTakenForAnOldAgent', async () => {
    // A replica that just started: no heartbeat from h1 yet.
    const { fleet, sent } = fleetOnH1();
    await expect(fleet.writeFile('t1', 'sb-a', '/tmp/f', 0o600, new Uint8Array(600 << 10))).rejects.toMatchObject({ kind: 'unavailable', retryable: true });
    await expect(fleet.writeFile('t1', 'sb-a', '/tmp/f', 0o600, new Uint8Array(10))).rejects.toMatchObject({ kind: 'unavailable', retryable: true });
    await expect(fleet.readFile('t1', 'sb-a', '/tmp/f', 64 << 20, true)).rejects.toMatchObject({ kind: 'unavailable', retryable: true });
    expect(sent).toEqual([]);
  });

  it('writeFile_toAnAgentWithoutRangedFiles_sendsTheMode_asToACurrentOne', async () => {
    const { fleet, heard, sent, execs } = fleetOnH1();
    heard.record(create(HeartbeatSchema, { hostId: 'h1', seq: 1n, bootId: 'b' }), Date.now());
    expect(await fleet.writeFile('t1', 'sb-a', '/tmp/f', 0o600, new Uint8Array(10))).toBe(10);
    expect(sent.map((r) => (r.op.case === 'write' ? r.op.value.mode : undefined))).toEqual([0o600]);
    expect(execs).toEqual([]);
    // Heard again, with ranged files: the same write goes as one piece that replaces the file, mode set.
    sent.length = 0;
    heard.record(create(HeartbeatSchema, { hostId: 'h1', seq: 2n, bootId: 'b', rangedFiles: true }), Date.now());
    expect(await fleet.writeFile('t1', 'sb-a', '/tmp/f', 0o640, new Uint8Array(10))).toBe(10);
    expect(sent.map((r) => (r.op.case === 'write' ? [r.path, r.op.value.mode, r.op.value.append] : undefined))).toEqual([['/tmp/f', 0o640, false]]);
    expect(execs).toEqual([]);
  });

  it('writeFile_ofSeveralPieces_makesTheTemporaryFile0600BeforeAnyByte_thenPutsItInPlaceWithTheModeAsked', async () => {
    // The guest agent makes a new file 0666: made first, 0600 and new, by a guest command.
    const { fleet, heard, sent, execs } = fleetOnH1();
    heard.record(create(HeartbeatSchema, { hostId: 'h1', seq: 1n, bootId: 'b', rangedFiles: true }), Date.now());
    expect(await fleet.writeFile('t1', 'sb-a', '/tmp/secret', 0o640, new Uint8Array(1200 << 10))).toBe(1200 << 10);
    const tmp = sent[0]!.path;
    expect(tmp).toMatch(/^\/tmp\/\.secret\.ff-write-[0-9a-f]{12}$/);
    expect(sent.map((r) => (r.op.case === 'write' ? [r.path, r.op.value.mode, r.op.value.append] : undefined))).toEqual([[tmp, 0, false], [tmp, 0, true], [tmp, 0, true]]);
    expect(execs.map((a) => [a[2], ...a.slice(4)])).toEqual([['umask 077 && set -C && : > "$1"', tmp], [expect.stringContaining('mv -f'), tmp, '/tmp/secret', '640']]);
  });
});
