import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { bearerOf, isLoopbackHost, metricsAccess } from './metrics-access.ts';

const dirs: string[] = [];
const tokenFile = (content: string): string => {
  const d = mkdtempSync(join(tmpdir(), 'ff-metrics-access-'));
  dirs.push(d);
  const f = join(d, 'metrics.token');
  writeFileSync(f, content);
  return f;
};
afterEach(() => {
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
});

describe('metricsAccess', () => {
  it('metricsAccess_withoutATokenFile_isOpenAndSendsNoHeader', () => {
    const a = metricsAccess('');
    expect(a.allowed(undefined)).toBe(true);
    expect(a.header()).toBeUndefined();
  });

  it('metricsAccess_withATokenFile_admitsOnlyThatBearerToken', () => {
    const a = metricsAccess(tokenFile('s3cret-metrics-token-0123\n'));
    expect(a.allowed('Bearer s3cret-metrics-token-0123')).toBe(true);
    expect(a.allowed('bearer s3cret-metrics-token-0123')).toBe(true);
    expect(a.allowed(undefined)).toBe(false);
    expect(a.allowed('Bearer s3cret-metrics-token-0124')).toBe(false);
    expect(a.allowed('Basic s3cret-metrics-token-0123')).toBe(false);
    expect(a.allowed('s3cret-metrics-token-0123')).toBe(false);
    expect(a.header()).toEqual({ authorization: 'Bearer s3cret-metrics-token-0123' });
  });

  it('metricsAccess_ofAFileThatChanges_takesTheNewToken_andKeepsTheOldOneWhenTheNewFileIsUnusable', () => {
    const f = tokenFile('first-token-0123456789');
    const failures: string[] = [];
    const a = metricsAccess(f, (why) => failures.push(why));
    writeFileSync(f, 'second-token-0123456789-longer');
    expect(a.allowed('Bearer first-token-0123456789')).toBe(false);
    expect(a.allowed('Bearer second-token-0123456789-longer')).toBe(true);
    writeFileSync(f, 'short');
    expect(a.allowed('Bearer second-token-0123456789-longer')).toBe(true);
    expect(a.allowed('Bearer short')).toBe(false);
    expect(failures).toHaveLength(1);
    expect(failures[0]).toMatch(/FF_METRICS_TOKEN_FILE: .* at least 16 characters/);
  });

  it('metricsAccess_ofAMissingOrShortTokenFile_failsNamingTheSetting', () => {
    expect(() => metricsAccess('/nonexistent/metrics.token')).toThrow(/FF_METRICS_TOKEN_FILE: cannot read \/nonexistent\/metrics\.token/);
    expect(() => metricsAccess(tokenFile('\n'))).toThrow(/FF_METRICS_TOKEN_FILE: .* at least 16 characters/);
    expect(() => metricsAccess(tokenFile('two tokens-0123456789 here'))).toThrow(/no white space/);
  });

  it('bearerOf_andIsLoopbackHost_readTheirInputs', () => {
    expect(bearerOf('Bearer abc')).toBe('abc');
    expect(bearerOf('Bearer  abc  ')).toBe('abc');
    expect(bearerOf('Bearer a b')).toBeUndefined();
    expect(bearerOf('')).toBeUndefined();
    for (const h of ['127.0.0.1', '127.1.2.3', 'localhost', '::1', '[::1]']) expect(isLoopbackHost(h)).toBe(true);
    for (const h of ['0.0.0.0', '10.0.0.11', '::', 'example.internal']) expect(isLoopbackHost(h)).toBe(false);
  });
});
