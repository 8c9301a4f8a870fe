import { describe, expect, it } from 'vitest';
import { durationMs, timestampMs } from '@bufbuild/protobuf/wkt';
import { enumFilter, env, guestFilePath, idemKey, image, labels, lifecycle, LIMITS, network, NEWEST_OPERATION_FIRST, operationKind, operationState, operationTarget, page, pageToken, SANDBOXES_BY_ID, SNAPSHOTS_BY_ID, toSnapshot, toSteps } from './convert.ts';
import { OperationKind, OperationState, OperationStepState } from '../../../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { OperationRec } from '../../domain/records.ts';
import { InvalidArgumentError } from '../../../proto/errors.ts';
import type { SnapshotRec } from '../../domain/records.ts';
import { snapshotRecord } from '../../testkit/records.ts';

const base: SnapshotRec = snapshotRecord({ createdAt: 1_000_000, keepLast: 1 });

describe('toSnapshot expires_at', () => {
  it('keepLastExpiryAnnounced_isTheAnnouncedTime', () => {
    const sn = toSnapshot({ ...base, expiryDueAt: 2_000_000 });
    expect(sn.expiresAt && timestampMs(sn.expiresAt)).toBe(2_000_000);
  });

  it('ttlOnly_isCreatedPlusTtl_andNoRetention_isUnset', () => {
    const withTtl = toSnapshot({ ...base, keepLast: 0, retentionTtlMs: 60_000 }, 1_000_000);
    expect(withTtl.expiresAt && timestampMs(withTtl.expiresAt)).toBe(1_060_000);
    expect(toSnapshot({ ...base, keepLast: 0 }).expiresAt).toBeUndefined();
    expect(toSnapshot({ ...base, expiryDueAt: null }).expiresAt).toBeUndefined();
  });

  it('aTtlsEndAlreadyPastWithNoAnnouncement_isUnset_notATimeInThePast', () => {
    // An eval harness saw expires_at in the past on a snapshot a child used: its deletion waits
    // for the child, and a full notice comes once it is free.
    expect(toSnapshot({ ...base, keepLast: 0, retentionTtlMs: 60_000 }, 1_060_001).expiresAt).toBeUndefined();
  });

  it('pinned_isUnset_evenWithATtlOrAnAnnouncementFromBeforeThePin', () => {
    expect(toSnapshot({ ...base, pinned: true, keepLast: 0, retentionTtlMs: 60_000 }).expiresAt).toBeUndefined();
    expect(toSnapshot({ ...base, pinned: true, expiryDueAt: 2_000_000 }).expiresAt).toBeUndefined();
  });
});

describe('list pages', () => {
  const ids = Array.from({ length: 7 }, (_, i) => ({ id: `sb-${String.fromCharCode(97 + ((i * 5) % 7))}aaaaaaaaaaaaaaaaaaa` }));

  it('pages_walkEveryItemOnceInIdOrder_andTheLastHasNoToken', () => {
    const seen: string[] = [];
    let token = '';
    for (let n = 0; n < 10; n++) {
      const p = page(ids, 3, pageToken(token, SANDBOXES_BY_ID), SANDBOXES_BY_ID);
      seen.push(...p.items.map((x) => x.id));
      token = p.nextPageToken;
      if (!token) break;
    }
    expect(seen).toEqual(ids.map((x) => x.id).sort());
    expect(page(ids, 0, '', SANDBOXES_BY_ID).items).toHaveLength(7);
    expect(page(ids, 7, '', SANDBOXES_BY_ID).nextPageToken).toBe('');
  });

  it('pageToken_notMadeByTheApi_isInvalidArgumentNamingTheField', () => {
    expect(() => pageToken('not a token', SANDBOXES_BY_ID)).toThrow(InvalidArgumentError);
    expect(() => pageToken(Buffer.from('../etc').toString('base64url'), SANDBOXES_BY_ID)).toThrow(/page_token/);
  });

  it('pageToken_ofAnotherList_isInvalidArgument', () => {
    const snapshotToken = Buffer.from('sn-aaaaaaaaaaaaaaaaaaaa').toString('base64url');
    expect(pageToken(snapshotToken, SNAPSHOTS_BY_ID)).toBe('sn-aaaaaaaaaaaaaaaaaaaa');
    expect(() => pageToken(snapshotToken, SANDBOXES_BY_ID)).toThrow(/page_token/);
  });
});

describe('operation lists', () => {
  // Seven operations, two created in the same millisecond: newest first, then by id.
  const at = [5, 9, 1, 9, 3, 7, 2];
  const ops = at.map((t, i) => ({ id: `op-${String.fromCharCode(97 + i)}aaaaaaaaaaaaaaaaaaa`, createdAt: 1_700_000_000_000 + t }) as OperationRec);
  const newestFirst = [...ops].sort((a, b) => b.createdAt - a.createdAt || (a.id < b.id ? -1 : 1)).map((o) => o.id);

  it('pages_walkEveryOperationOnceNewestFirst_tiesById_andAPageHoldsAtMost100', () => {
    const seen: string[] = [];
    let token = '';
    do {
      const p = page(ops, 2, pageToken(token, NEWEST_OPERATION_FIRST), NEWEST_OPERATION_FIRST);
      seen.push(...p.items.map((x) => x.id));
      token = p.nextPageToken;
    } while (token);
    expect(seen).toEqual(newestFirst);
    const many = Array.from({ length: 150 }, (_, i) => ({ id: `op-${String(i).padStart(20, '0')}`, createdAt: i }) as OperationRec);
    expect(page(many, 0, '', NEWEST_OPERATION_FIRST).items).toHaveLength(100);
    expect(page(many, 500, '', NEWEST_OPERATION_FIRST).items).toHaveLength(100);
  });

  it('pagesOfForks_endBeforeTheirChildrenPassTheBudget_holdOneForkAtLeast_andStillWalkEveryOperationOnce', () => {
    const forks = Array.from({ length: 30 }, (_, i) => ({ id: `op-${'a'.repeat(19)}${'abcdefghijklmnopqrstuvwxyz234567'[i]}`, createdAt: 1_700_000_000_000 + i, result: { sandboxIds: Array.from({ length: 100 }, (_, j) => `sb-${j}`) } }) as OperationRec);
    const budget = { weight: (o: OperationRec) => o.result?.sandboxIds?.length ?? 0, max: 1024 };
    const sizes: number[] = [];
    const seen: string[] = [];
    let token = '';
    do {
      const p = page(forks, 0, pageToken(token, NEWEST_OPERATION_FIRST), NEWEST_OPERATION_FIRST, budget);
      sizes.push(p.items.length);
      seen.push(...p.items.map((x) => x.id));
      token = p.nextPageToken;
    } while (token);
    expect(sizes).toEqual([10, 10, 10]);
    expect(seen).toEqual([...forks].reverse().map((o) => o.id));
    // One fork heavier than the whole budget still makes a page of its own.
    expect(page(forks, 0, '', NEWEST_OPERATION_FIRST, { ...budget, max: 50 }).items).toHaveLength(1);
  });

  it('aSandboxListToken_isNotAnOperationListToken_andTheOtherWayRound', () => {
    const opToken = page(ops, 1, '', NEWEST_OPERATION_FIRST).nextPageToken;
    expect(pageToken(opToken, NEWEST_OPERATION_FIRST)).toMatch(/^\d{15}\.op-/);
    expect(() => pageToken(opToken, SANDBOXES_BY_ID)).toThrow(/page_token/);
    expect(() => pageToken(Buffer.from('sb-aaaaaaaaaaaaaaaaaaaa').toString('base64url'), NEWEST_OPERATION_FIRST)).toThrow(/page_token/);
  });

  it('filters_withUnspecifiedOrUnknownValues_areInvalidArgumentNamingTheField', () => {
    expect(operationState(OperationState.RUNNING, 'states[0]')).toBe('running');
    expect(operationKind(OperationKind.DELETE_SNAPSHOT, 'kinds[0]')).toBe('delete_snapshot');
    expect(() => operationState(OperationState.UNSPECIFIED, 'states[2]')).toThrow(/states\[2\]/);
    expect(() => operationKind(42 as OperationKind, 'kinds[1]')).toThrow(/kinds\[1\]/);
    expect(operationTarget('host-7', 'target_id')).toBe('host-7');
    expect(operationTarget('sn-aaaaaaaaaaaaaaaaaaaa', 'target_id')).toBe('sn-aaaaaaaaaaaaaaaaaaaa');
    expect(() => operationTarget('../etc', 'target_id')).toThrow(InvalidArgumentError);
  });
});

describe('lifecycle hooks', () => {
  it('afterResumeArgv_withNulOrEmpty_isInvalidArgumentNamingTheArgument', () => {
    const hook = (argv: string[]) => () => lifecycle({ $typeName: 'forkfleet.v1.Lifecycle', afterResume: [{ $typeName: 'forkfleet.v1.Hook', argv }] } as never);
    expect(hook(['/bin/true', 'a\0b'])).toThrow(/lifecycle\.after_resume\[0\]\.argv\[1\]/);
    expect(hook([])).toThrow(/lifecycle\.after_resume\[0\]\.argv/);
    expect(hook(['/bin/true'])().afterResume[0]!.argv).toEqual(['/bin/true']);
  });

  it('afterResumeTimeouts_addingUpToMoreThanAMinute_isInvalidArgumentOnTheList_soNoResumeOrWakeOutlivesItsStep', () => {
    const hooks = (...secs: Array<number | undefined>) => () =>
      lifecycle({ $typeName: 'forkfleet.v1.Lifecycle', afterResume: secs.map((s) => ({ $typeName: 'forkfleet.v1.Hook', argv: ['/bin/true'], ...(s === undefined ? {} : { timeout: { seconds: BigInt(s), nanos: 0 } }) })) } as never);
    expect(hooks(60)().afterResume[0]!.timeoutMs).toBe(60_000);
    expect(hooks(undefined, undefined)().afterResume.map((h) => h.timeoutMs)).toEqual([30_000, 30_000]);
    expect(hooks(61)).toThrow(/lifecycle\.after_resume\[0\]\.timeout/);
    // Unset ones share the budget when more than two: eight without timeouts stay valid.
    expect(hooks(undefined, undefined, undefined)().afterResume.map((h) => h.timeoutMs)).toEqual([20_000, 20_000, 20_000]);
    expect(hooks(...Array<undefined>(8).fill(undefined))().afterResume.every((h) => h.timeoutMs === 7500)).toBe(true);
    expect(hooks(30, 20, 11)).toThrow(/lifecycle\.after_resume: the hooks' timeouts add up to 61000 ms/);
    expect(hooks(50, undefined, undefined)).toThrow(InvalidArgumentError);
  });
});

describe('image', () => {
  it('unknownImageName_isInvalidArgumentListingTheImagesHostsBuild', () => {
    expect(image('tiny')).toBe('tiny');
    expect(() => image('ubuntu')).toThrow(/unknown image "ubuntu"; hosts build tiny, debian/);
  });
});

describe('operation steps', () => {
  it('areInTheOrderFirstSent_anEarlierLeadersStepByItsAnswer_withTheirTimesAndBytes', () => {
    const steps = toSteps({
      'restore/h2': { hostId: 'h2', action: 'restore_vms', status: 'sent', attempt: 1, sentAt: 5_000 },
      'restore/h3': { hostId: 'h3', action: 'restore_vms', status: 'done', attempt: 2, sentAt: 4_000, endedAt: 9_000, hostMs: 4_500, bytesFetched: 1234, migrated: true },
      // Sent by a leader that died; its answer reached this one.
      'restore/h4': { hostId: 'h4', action: 'restore_vms', status: 'failed', attempt: 1, endedAt: 4_500 },
      'snapshot/sn-1': { hostId: 'h1', action: 'snapshot_vm', status: 'done', attempt: 1, sentAt: 1_000, endedAt: 3_900, hostMs: 2_800, pauseMs: 120 },
    });
    expect(steps.map((st) => [st.stepId, st.action, st.state, st.attempt])).toEqual([
      ['snapshot/sn-1', 'snapshot_vm', OperationStepState.SUCCEEDED, 1],
      ['restore/h3', 'restore_vms', OperationStepState.SUCCEEDED, 2],
      ['restore/h4', 'restore_vms', OperationStepState.FAILED, 1],
      ['restore/h2', 'restore_vms', OperationStepState.RUNNING, 1],
    ]);
    const [snap, h3, h4, h2] = steps;
    expect(durationMs(snap!.pause!)).toBe(120);
    expect([timestampMs(h3!.sentAt!), timestampMs(h3!.finishedAt!), durationMs(h3!.hostDuration!), h3!.bytesFetched, h3!.restoredByMigration]).toEqual([4_000, 9_000, 4_500, 1234n, true]);
    expect([h4!.sentAt, h4!.hostDuration]).toEqual([undefined, undefined]);
    expect([h2!.finishedAt, h2!.bytesFetched, h2!.restoredByMigration]).toEqual([undefined, 0n, false]);
  });
});

describe('fields a record stores', () => {
  it('idempotencyKey_startingWithTwoUnderscores_isInvalidArgument', () => {
    // "__ttl/<sandbox>" is the key of the scheduler's own TTL destroy of that sandbox.
    expect(() => idemKey('__ttl/sb-aaaaaaaaaaaaaaaaaaaa')).toThrow(/idempotency_key.*reserved/);
    expect(idemKey('_one-underscore_is-fine')).toBe('_one-underscore_is-fine');
  });

  it('labels_withControlCharacters_isInvalidArgumentNamingTheLabel', () => {
    expect(() => labels({ team: 'a\u0000b' })).toThrow(/^labels\["team"\]: .*control/);
    expect(labels({ team: 'rl-ablation ü' })).toEqual({ team: 'rl-ablation ü' });
    // C1 controls (U+009B is a terminal's CSI, as ESC [ is) and the line separators too.
    for (const v of ['x\u009b31m', 'a\u0085b', 'a\u2028b']) expect(() => labels({ team: v })).toThrow(/^labels\["team"\]: .*control/);
  });

  it('labelValues_withBidiControlsZeroWidthOrOtherFormatCharacters_areInvalidArgumentNamingTheLabelAndTheCharacter', () => {
    // U+202E shows "exe.txt" as "txt.exe"; U+200B makes "prod" a value that only looks like it; and the rest of Cf.
    const bad = ['\u202Aa', 'a\u202E', '\u2066x', 'x\u2069', 'pr\u200Bod', 'a\u200Fb', '\uFEFFv', 'a\u00ADb', 'a\u2060b', 'a\u{E0001}b'];
    for (const v of bad) expect(() => labels({ team: v }), JSON.stringify(v)).toThrow(expect.objectContaining({ kind: 'invalid_argument', field: 'labels["team"]' }));
    expect(() => labels({ team: 'pr\u200Bod' })).toThrow(/U\+200B at \[2\]/);
    // A selector refuses controls, but may name a value stored before format characters were refused.
    expect(() => labels({ team: 'a\u001b' }, 'labels', true)).toThrow(expect.objectContaining({ field: 'labels["team"]' }));
    expect(labels({ team: 'a\u202E' }, 'labels', true)).toEqual({ team: 'a\u202E' });
    // Letters, marks and symbols of any script are fine, and so are the zero-width non-joiner
    // and joiner that Persian words and emoji sequences need.
    for (const v of ['Ünïcødé', '日本語', 'emoji 🚀', 'e\u0301', 'می\u200Cخواهم', '👩\u200D💻']) expect(labels({ team: v })).toEqual({ team: v });
  });

  it('idleTimeout_underASecondButNotZero_isInvalidArgument_notTruncatedToDisabled', () => {
    const idle = (seconds: bigint, nanos: number) => lifecycle({ idleTimeout: { seconds, nanos }, afterResume: [] } as never).idleTimeoutMs;
    expect(idle(0n, 0)).toBe(0);
    expect(idle(1n, 0)).toBe(1000);
    expect(() => idle(0n, 500_000)).toThrow(/lifecycle\.idle_timeout/);
    expect(() => idle(0n, -500_000)).toThrow(/lifecycle\.idle_timeout/);
    expect(() => idle(0n, 999_000_000)).toThrow(/lifecycle\.idle_timeout/);
  });

  it('operationTarget_thatLooksLikeAMalformedSandboxOrSnapshotId_isInvalidArgument', () => {
    expect(operationTarget('sb-aaaaaaaaaaaaaaaaaaaa', 'target_id')).toBe('sb-aaaaaaaaaaaaaaaaaaaa');
    expect(operationTarget('kvm-01', 'target_id')).toBe('kvm-01');
    for (const bad of ['sb-bad', 'op-aaaaaaaaaaaaaaaaaaaa', 'sn-x']) expect(() => operationTarget(bad, 'target_id')).toThrow(/^target_id: /);
  });

  it('guestFilePath_ofTheRootOrADirectory_isInvalidArgument', () => {
    expect(guestFilePath('/tmp/x')).toBe('/tmp/x');
    expect(() => guestFilePath('/', 'header.path')).toThrow(/^header\.path: must name a file/);
    expect(() => guestFilePath('/tmp/')).toThrow(/^path: /);
  });

  it('guestFilePath_withASegmentLongerThanAFileNameCanBe_isInvalidArgument_andAWrittenNameLeavesRoomForItsStagingName', () => {
    expect(guestFilePath(`/tmp/${'a'.repeat(255)}`)).toHaveLength(260);
    expect(() => guestFilePath(`/tmp/${'a'.repeat(256)}`)).toThrow(/^path: each path segment must be at most 255 bytes/);
    expect(() => guestFilePath(`/${'é'.repeat(128)}/x`)).toThrow(/^path: each path segment/);
    expect(guestFilePath(`/tmp/${'a'.repeat(232)}`, 'header.path', true)).toHaveLength(237);
    expect(() => guestFilePath(`/tmp/${'a'.repeat(233)}`, 'header.path', true)).toThrow(/^header\.path: a file written through the API has a name of at most 232 bytes/);
  });

  it('guestPath_ofPathMaxBytes_isInvalidArgument_andAWrittenPathLeavesRoomForItsStagingName', () => {
    // Linux's PATH_MAX counts the NUL: 4095 bytes open, 4096 are ENAMETOOLONG in the guest.
    const pathOf = (bytes: number): string => {
      let p = '';
      while (bytes - p.length > 101) p += `/${'a'.repeat(99)}`;
      return `${p}/${'a'.repeat(bytes - p.length - 1)}`;
    };
    expect(pathOf(4096)).toHaveLength(4096);
    expect(guestFilePath(pathOf(4095))).toHaveLength(4095);
    expect(() => guestFilePath(pathOf(4096), 'path')).toThrow(/^path: must be at most 4095 bytes/);
    expect(guestFilePath(pathOf(4072), 'header.path', true)).toHaveLength(4072);
    expect(() => guestFilePath(pathOf(4073), 'header.path', true)).toThrow(/^header\.path: a file written through the API has a path of at most 4072 bytes/);
  });

  it('labels_withAKeyOutsidePrintableAscii_nameItEscaped_andTheSchedulersOwnKeysOnlyFilter', () => {
    // JSON's own escapes stay (\n), anything else outside printable ASCII becomes \uXXXX.
    expect(() => labels({ 'é\n': 'x' })).toThrow(expect.objectContaining({ field: 'labels["\\u00e9\\n"]' }));
    expect(() => labels({ 'forkfleet.io/hibernation': 'sb-x' })).toThrow(/^labels\["forkfleet\.io\/hibernation"\]: keys starting forkfleet\.io\/ \(in any case\) are the scheduler's own/);
    expect(labels({ 'forkfleet.io/hibernation': 'sb-x' }, 'labels', true)).toEqual({ 'forkfleet.io/hibernation': 'sb-x' });
  });

  it('reservedLabelPrefix_inAnyCase_isTheSchedulers', () => {
    for (const k of ['Forkfleet.io/hibernation', 'FORKFLEET.IO/purpose', 'ForkFleet.Io/x']) {
      expect(() => labels({ [k]: 'x' }), k).toThrow(expect.objectContaining({ field: `labels[${JSON.stringify(k)}]`, message: expect.stringMatching(/scheduler's own/) }));
      expect(labels({ [k]: 'x' }, 'labels', true)).toEqual({ [k]: 'x' });
    }
    expect(labels({ 'forkfleet.iox/a': 'x', 'my.forkfleet.io/a': 'y' })).toEqual({ 'forkfleet.iox/a': 'x', 'my.forkfleet.io/a': 'y' });
  });

  it('mapEntries_areNamedOneWay_theKeyQuoted_whetherTheKeyOrTheValueIsBad', () => {
    // A bad key and a bad value of an entry name it alike.
    expect(() => labels({ 'a b': 'x' })).toThrow(expect.objectContaining({ field: 'labels["a b"]' }));
    expect(() => labels({ team: 'v'.repeat(257) })).toThrow(expect.objectContaining({ field: 'labels["team"]' }));
    expect(() => labels({ team: 'a\u0007' })).toThrow(expect.objectContaining({ field: 'labels["team"]' }));
    expect(() => labels({ 'forkfleet.io/x': 'y' })).toThrow(expect.objectContaining({ field: 'labels["forkfleet.io/x"]' }));
    expect(() => env({ '1A': 'x' })).toThrow(expect.objectContaining({ field: 'env["1A"]' }));
    expect(() => env({ PATH: 'a\0b' })).toThrow(expect.objectContaining({ field: 'env["PATH"]' }));
  });

  it('labelKey_startingWithPunctuation_isInvalidArgument_andTheErrorSaysKeysStartWithALetterOrDigit', () => {
    for (const k of ['.a', '_a', '/a', '-a']) expect(() => labels({ [k]: 'x' }), k).toThrow(/label keys are 1-63 characters of a-z, A-Z, 0-9, \. _ \/ -, starting with a letter or digit/);
    expect(labels({ 'a._/-': 'x', '9z': 'y' })).toEqual({ 'a._/-': 'x', '9z': 'y' });
  });

  it('execEnvValues_keepFormatAndControlCharacters_theyAreBytesTheGuestGets', () => {
    expect(env({ PS1: '\u001b[1m$ \u202E', ZW: 'a\u200Bb' })).toEqual({ PS1: '\u001b[1m$ \u202E', ZW: 'a\u200Bb' });
  });

  it('labelOrEnvKey_tooLongToNameWhole_isNamedByItsMap_withItsLength_notCutToAnotherKey', () => {
    expect(() => labels({ ['k'.repeat(100)]: 'x' })).toThrow(expect.objectContaining({ field: 'labels', message: expect.stringMatching(/^labels: a key of 100 characters: label keys are 1-63/) }));
    expect(() => env({ ['V'.repeat(129)]: 'x' })).toThrow(expect.objectContaining({ field: 'env' }));
    expect(() => env({ '1A': 'x' })).toThrow(expect.objectContaining({ field: 'env["1A"]' }));
  });

  it('allowCidrs_listedTwice_isInvalidArgumentNamingTheSecond', () => {
    expect(() => network({ allowEgress: true, allowCidrs: ['10.0.0.0/8', '192.0.2.0/24', '10.0.0.0/8'] } as never)).toThrow(/network\.allow_cidrs\[2\].*twice/);
  });

  it('allowCidrs_withHostBitsSet_isInvalidArgumentNamingItAndTheNetworkMeant', () => {
    const cidrs = (...allowCidrs: string[]) => network({ allowEgress: true, allowCidrs } as never).allowCidrs;
    // The agent would allow all of 10.0.0.0/8 for 10.1.2.3/8: both were accepted as two entries.
    expect(() => cidrs('10.0.0.0/8', '10.1.2.3/8')).toThrow(expect.objectContaining({ field: 'network.allow_cidrs[1]', message: 'network.allow_cidrs[1]: 10.1.2.3/8 has host bits set; did you mean 10.0.0.0/8?' }));
    expect(() => cidrs('203.0.113.7/24')).toThrow(/allow_cidrs\[0\]: 203\.0\.113\.7\/24 has host bits set; did you mean 203\.0\.113\.0\/24\?/);
    expect(() => cidrs('255.255.255.255/0')).toThrow(/did you mean 0\.0\.0\.0\/0\?/);
    expect(() => cidrs('192.0.2.129/25')).toThrow(/did you mean 192\.0\.2\.128\/25\?/);
    // Networks as written, and any address as a /32.
    expect(cidrs('0.0.0.0/0', '10.0.0.0/8', '192.0.2.128/25', '198.51.100.7/32', '255.255.255.255/32')).toEqual(['0.0.0.0/0', '10.0.0.0/8', '192.0.2.128/25', '198.51.100.7/32', '255.255.255.255/32']);
    // The same network at another length is another entry.
    expect(cidrs('10.0.0.0/8', '10.0.0.0/16')).toEqual(['10.0.0.0/8', '10.0.0.0/16']);
  });

  it('labels_overTheByteBudget_isInvalidArgument', () => {
    // 64 labels of 256-byte values: within the count and value limits, over the total.
    const many = Object.fromEntries(Array.from({ length: LIMITS.maxLabels }, (_, i) => [`k${i}`, 'v'.repeat(256)]));
    expect(() => labels(many)).toThrow(/^labels: at most 4096 bytes/);
  });

  it('afterResumeHooks_overTheByteBudget_isInvalidArgument', () => {
    const hook = { argv: ['/bin/sh', '-c', 'x'.repeat(4000)] };
    expect(lifecycle({ afterResume: [hook, hook] } as never).afterResume).toHaveLength(2);
    expect(() => lifecycle({ afterResume: [hook, hook, hook] } as never)).toThrow(/lifecycle\.after_resume: at most 8192 bytes/);
  });

  it('env_namesWithTheExecWrappersReservedPrefixes_areInvalidArgumentNamingTheEntry', () => {
    for (const k of ['_ff_n', 'FFE_TOKEN']) expect(() => env({ [k]: 'x' })).toThrow(expect.objectContaining({ kind: 'invalid_argument', field: `env["${k}"]` }));
    // Names like the wrapper's own short ones are the caller's to use.
    expect(env({ n: '7', f: '/x', ffe_lower: '1' })).toEqual({ n: '7', f: '/x', ffe_lower: '1' });
  });

  it('env_withTooManyVariables_isInvalidArgument', () => {
    expect(() => env(Object.fromEntries(Array.from({ length: LIMITS.maxEnv + 1 }, (_, i) => [`V${i}`, ''])))).toThrow(/^env: at most 256/);
  });
});

describe('enumFilter', () => {
  it('aValueGivenTwice_isRefusedNamingItsSecondPlace_soNoListIsLongerThanItsEnum', () => {
    expect(enumFilter([OperationKind.FORK, OperationKind.CREATE], 'kinds', operationKind)).toEqual(['fork', 'create']);
    expect(() => enumFilter([OperationKind.FORK, OperationKind.CREATE, OperationKind.FORK], 'kinds', operationKind)).toThrow(expect.objectContaining({ kind: 'invalid_argument', field: 'kinds[2]' }));
    // Four million of one value (a 4 MiB request) stop at the second, not after reading them all.
    const many = new Array<OperationState>(4_000_000).fill(OperationState.RUNNING);
    expect(() => enumFilter(many, 'states', operationState)).toThrow(expect.objectContaining({ field: 'states[1]' }));
    expect(() => enumFilter([0 as OperationState], 'states', operationState)).toThrow(expect.objectContaining({ field: 'states[0]' }));
  });
});
