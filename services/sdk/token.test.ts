// A token a request header cannot carry (a CRLF file's trailing \r, a space) is refused when
// the client is made, naming `token` and where it came from, never the token: grpc-js would
// fail each call with a message quoting the whole header. No server is involved.
import { afterEach, describe, expect, it, vi } from 'vitest';
import { Forkfleet } from './index.ts';

const CA = Buffer.from('-----BEGIN CERTIFICATE-----\n');

/** What `new Forkfleet(...)` threw, or undefined. */
function made(opts: ConstructorParameters<typeof Forkfleet>[0]): unknown {
  try {
    new Forkfleet(opts).close();
    return undefined;
  } catch (e) {
    return e;
  }
}

afterEach(() => void vi.unstubAllEnvs());

describe('Forkfleet token', () => {
  it.each([
    ['a trailing \\r (a CRLF file)', 'ff_SECRET123\r'],
    ['a trailing newline', 'ff_SECRET123\n'],
    ['a space', 'ff_SECRET 123'],
    ['a non-ASCII character', 'ff_SECRET123é'],
  ])('aTokenWithACharacterAHeaderCannotCarry_isRefusedNamingToken_withoutRepeatingIt: %s', (_why, token) => {
    const e = made({ address: '127.0.0.1:1', token, ca: CA, tenant: 't1' });
    expect(e).toMatchObject({ kind: 'invalid_argument', field: 'token', retryable: false });
    expect((e as Error).message).not.toContain('SECRET');
    expect((e as Error).message).toContain('the token option');
  });

  it('aTokenFromFF_TOKEN_isCheckedToo_andTheErrorNamesFF_TOKEN', () => {
    vi.stubEnv('FF_CREDENTIALS', undefined);
    vi.stubEnv('FF_FLEET_DIR', '/nonexistent-ff-token-test');
    vi.stubEnv('FF_TOKEN', 'ff_SECRET123\r');
    const e = made({ address: '127.0.0.1:1', ca: CA, tenant: 't1' });
    expect(e).toMatchObject({ kind: 'invalid_argument', field: 'token' });
    expect((e as Error).message).toContain('FF_TOKEN');
    expect((e as Error).message).not.toContain('SECRET');
  });

  it('anOrdinaryToken_isTaken', () => {
    expect(made({ address: '127.0.0.1:1', token: 'ff_abc-DEF_123.~+/=', ca: CA, tenant: 't1' })).toBeUndefined();
  });
});
