import { describe, expect, it } from 'vitest';
import { timestampMs } from '@bufbuild/protobuf/wkt';
import { image, lifecycle, page, pageToken, toSnapshot } from './convert.ts';
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
    const withTtl = toSnapshot({ ...base, keepLast: 0, retentionTtlMs: 60_000 });
    expect(withTtl.expiresAt && timestampMs(withTtl.expiresAt)).toBe(1_060_000);
    expect(toSnapshot({ ...base, keepLast: 0 }).expiresAt).toBeUndefined();
    expect(toSnapshot({ ...base, expiryDueAt: null }).expiresAt).toBeUndefined();
  });
});

describe('list pages', () => {
  const ids = Array.from({ length: 7 }, (_, i) => ({ id: `sb-${String.fromCharCode(97 + ((i * 5) % 7))}aaaaaaaaaaaaaaaaaaa` }));

  it('pages_walkEveryItemOnceInIdOrder_andTheLastHasNoToken', () => {
    const seen: string[] = [];
    let token = '';
    for (let n = 0; n < 10; n++) {
      const p = page(ids, 3, pageToken(token));
      seen.push(...p.items.map((x) => x.id));
      token = p.nextPageToken;
      if (!token) break;
    }
    expect(seen).toEqual(ids.map((x) => x.id).sort());
    expect(page(ids, 0, '').items).toHaveLength(7);
    expect(page(ids, 7, '').nextPageToken).toBe('');
  });

  it('pageToken_notMadeByTheApi_isInvalidArgumentNamingTheField', () => {
    expect(() => pageToken('not a token')).toThrow(InvalidArgumentError);
    expect(() => pageToken(Buffer.from('../etc').toString('base64url'))).toThrow(/page_token/);
  });
});

describe('lifecycle hooks', () => {
  it('afterResumeArgv_withNulOrEmpty_isInvalidArgumentNamingTheArgument', () => {
    const hook = (argv: string[]) => () => lifecycle({ $typeName: 'forkfleet.v1.Lifecycle', afterResume: [{ $typeName: 'forkfleet.v1.Hook', argv }] } as never);
    expect(hook(['/bin/true', 'a\0b'])).toThrow(/lifecycle\.after_resume\[0\]\.argv\[1\]/);
    expect(hook([])).toThrow(/lifecycle\.after_resume\[0\]\.argv/);
    expect(hook(['/bin/true'])().afterResume[0]!.argv).toEqual(['/bin/true']);
  });
});

describe('image', () => {
  it('unknownImageName_isInvalidArgumentListingTheImagesHostsBuild', () => {
    expect(image('tiny')).toBe('tiny');
    expect(() => image('ubuntu')).toThrow(/unknown image "ubuntu"; hosts build tiny, debian/);
  });
});
