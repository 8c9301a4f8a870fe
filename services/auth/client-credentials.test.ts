// A credentials file that is not valid JSON: the error says where, never what is there (the
// text around the fault is the token).
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { readCredentialsFile, resolveClientCredentials } from './client-credentials.ts';

const SECRET = 'ff_secret_0123456789abcdef';
const dirs: string[] = [];
afterEach(() => {
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
});

/** The error readCredentialsFile throws for a file of `text`. */
function errorFor(text: string): Error & { field?: string } {
  const d = mkdtempSync(join(tmpdir(), 'ff-creds-'));
  dirs.push(d);
  const path = join(d, 'credentials.json');
  writeFileSync(path, text);
  try {
    readCredentialsFile(path, 'credentials');
  } catch (e) {
    return e as Error & { field?: string };
  }
  throw new Error('no error');
}

describe('readCredentialsFile', () => {
  it('malformedJson_reportsTheLineAndColumn_neverTheTextAroundIt', () => {
    // An unquoted token: V8 quotes ten characters either side of it in its message.
    const unquoted = errorFor(`{\n  "tenant": "t1",\n  "token": ${SECRET}\n}\n`);
    expect(unquoted.message).not.toContain('ff_secret');
    expect(unquoted.message).not.toContain('0123456789');
    expect(unquoted.message).toMatch(/not valid JSON \(line 3, column \d+\)$/);
    expect(unquoted.field).toBe('credentials');
    // A missing comma after the token: V8 says "at position N".
    const comma = errorFor(`{"token": "${SECRET}" "tenant": "t1"}`);
    expect(comma.message).not.toContain(SECRET);
    expect(comma.message).toMatch(/line 1, column \d+/);
    // Cut short.
    expect(errorFor(`{"token": "${SECRET}`).message).not.toContain(SECRET);
  });

  it('aJsonValueThatIsNoObject_isRefused_withoutItsText', () => {
    const e = errorFor(`"${SECRET}"`);
    expect(e.message).not.toContain(SECRET);
    expect(e.message).toContain('want a JSON object');
  });
});

describe('resolveClientCredentials', () => {
  it('emptyFfTokenFfCaOrFfCredentials_areUnset_andTheFleetsCredentialsFileIsUsed', () => {
    // `FF_TOKEN= forkfleet ...` or an env file's `FF_CA=` line: as FF_FLEET_DIR and FF_API, empty is unset.
    const d = mkdtempSync(join(tmpdir(), 'ff-creds-'));
    dirs.push(d);
    writeFileSync(join(d, 'ca.crt'), '-----BEGIN CERTIFICATE-----\nfile\n');
    writeFileSync(join(d, 'credentials.json'), JSON.stringify({ token: 'ff_file', ca: 'ca.crt', tenant: 'dev' }));
    for (const env of [{ FF_TOKEN: '' }, { FF_CA: '' }, { FF_CREDENTIALS: '' }, { FF_TOKEN: '', FF_CA: '', FF_CREDENTIALS: '' }]) {
      const c = resolveClientCredentials({}, { FF_FLEET_DIR: d, ...env });
      expect(c, JSON.stringify(env)).toMatchObject({ token: 'ff_file', tenant: 'dev', source: join(d, 'credentials.json') });
      expect(c.caPem?.toString(), JSON.stringify(env)).toContain('file');
    }
  });

  it('aCredentialsFileWhoseCaIsPemText_trustsThatPem_asFfCaDoes_notTheFilesDirectoryJoinedOntoIt', () => {
    const d = mkdtempSync(join(tmpdir(), 'ff-creds-'));
    dirs.push(d);
    const caPem = '-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n';
    writeFileSync(join(d, 'credentials.json'), JSON.stringify({ token: 'ff_file', ca: caPem, tenant: 'dev' }));
    expect(readCredentialsFile(join(d, 'credentials.json'))?.ca).toBe(caPem);
    for (const env of [{ FF_FLEET_DIR: d }, { FF_CREDENTIALS: join(d, 'credentials.json') }]) {
      expect(resolveClientCredentials({}, env).caPem?.toString(), JSON.stringify(env)).toBe(caPem);
    }
    // The same PEM in FF_CA is taken alike.
    expect(resolveClientCredentials({}, { FF_FLEET_DIR: join(d, 'none'), FF_TOKEN: 't', FF_CA: caPem }).caPem?.toString()).toBe(caPem);
  });
});
