import { afterEach, beforeEach, describe, expect, it, vi } from 'vitest';
import { spawn, spawnSync } from 'node:child_process';
import { chmodSync, chownSync, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, statSync, utimesSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { hostname, tmpdir } from 'node:os';
import { Authenticator, bearerOf, credentialIdOf, listTokens, mintToken, parseTokensFile, revokeTokens, sha256 } from './tokens.ts';
import { ApiGuard, REVOCATION_CHECK_MS, tenantFor, requireAdmin } from './guard.ts';
import { defaultCredentialsFile, resolveClientCredentials } from './client-credentials.ts';
import { ForkfleetError } from '../../proto/errors.ts';

const kindOf = (f: () => unknown): string | undefined => {
  try {
    f();
    return undefined;
  } catch (e) {
    return e instanceof ForkfleetError ? `${e.kind}${e.field ? `:${e.field}` : ''}` : String(e);
  }
};
const md = (...auth: string[]): { get(k: string): string[] } => ({ get: (k: string) => (k === 'authorization' ? auth : []) });

describe('tokens file', () => {
  let dir: string;
  beforeEach(() => {
    dir = mkdtempSync(join(tmpdir(), 'ff-tokens-'));
  });
  afterEach(() => rmSync(dir, { recursive: true, force: true }));

  it('mintToken_storesOnlyTheDigest_inAFileOnlyTheOwnerReads', () => {
    const file = join(dir, 'tokens.json');
    const token = mintToken(file, { tenant: 'acme', quotas: { sandboxes: 3 } });
    const text = readFileSync(file, 'utf8');
    expect(token).toMatch(/^ff_[A-Za-z0-9_-]{43}$/);
    expect(text).not.toContain(token);
    expect(text).toContain(sha256(token).toString('hex'));
    expect(statSync(file).mode & 0o777).toBe(0o600);
    const [e] = parseTokensFile(text);
    expect(e).toMatchObject({ tenant: 'acme', admin: false, quotas: { sandboxes: 3 } });
  });

  it('parseTokensFile_withBadEntries_failsNamingTheField', () => {
    expect(kindOf(() => parseTokensFile('nope'))).toBe('invalid_argument:FF_TOKENS_FILE');
    expect(kindOf(() => parseTokensFile('{"tokens":[{"tenant":"A!","token_sha256":"' + '0'.repeat(64) + '"}]}'))).toBe('invalid_argument:FF_TOKENS_FILE tokens[0].tenant');
    expect(kindOf(() => parseTokensFile('{"tokens":[{"tenant":"a","token_sha256":"xyz"}]}'))).toBe('invalid_argument:FF_TOKENS_FILE tokens[0].token_sha256');
    expect(kindOf(() => parseTokensFile('{"tokens":[{"tenant":"a","token_sha256":"' + '0'.repeat(64) + '","rate":{"per_s":0}}]}'))).toBe('invalid_argument:FF_TOKENS_FILE tokens[0].rate.per_s');
    expect(kindOf(() => parseTokensFile('{"tokens":[{"tenant":"admin","token_sha256":"' + '0'.repeat(64) + '"}]}'))).toBe('invalid_argument:FF_TOKENS_FILE tokens[0].tenant');
    const h = (c: string): string => c.repeat(64);
    expect(kindOf(() => parseTokensFile(JSON.stringify({ tokens: [{ tenant: 'a', token_sha256: h('1'), quotas: { sandboxes: 1 } }, { tenant: 'a', token_sha256: h('2'), quotas: { sandboxes: 2 } }] })))).toBe('invalid_argument:FF_TOKENS_FILE tokens[1]');
  });

  it('parseTokensFile_withAnUnknownOrMistypedKey_failsNamingIt_insteadOfReadingNoLimit', () => {
    const h = '4'.repeat(64);
    const entry = (e: object): string => JSON.stringify({ tokens: [{ tenant: 'a', token_sha256: h, ...e }] });
    // Each of these was read as no quota at all.
    expect(kindOf(() => parseTokensFile(entry({ quotas: { memory_mb: 1024, sandboxes: 5 } })))).toBe('invalid_argument:FF_TOKENS_FILE tokens[0].quotas.memory_mb');
    expect(kindOf(() => parseTokensFile(entry({ quotas: { sandbox: 5 } })))).toBe('invalid_argument:FF_TOKENS_FILE tokens[0].quotas.sandbox');
    // null is unset (a generator's "none"), as it always was.
    expect(parseTokensFile(entry({ quotas: null }))[0]?.quotas).toBeUndefined();
    expect(kindOf(() => parseTokensFile(entry({ quotas: '5' })))).toBe('invalid_argument:FF_TOKENS_FILE tokens[0].quotas');
    expect(kindOf(() => parseTokensFile(entry({ quotas: [5] })))).toBe('invalid_argument:FF_TOKENS_FILE tokens[0].quotas');
    expect(kindOf(() => parseTokensFile(entry({ quota: { sandboxes: 5 } })))).toBe('invalid_argument:FF_TOKENS_FILE tokens[0].quota');
    expect(kindOf(() => parseTokensFile(entry({ rate: { per_s: 5, bursts: 10 } })))).toBe('invalid_argument:FF_TOKENS_FILE tokens[0].rate.bursts');
    // Every key the file may hold is taken.
    const all = { admin: true, name: 'ci', quotas: { sandboxes: 50, memory_mib: 65536, snapshot_bytes: 1 }, rate: { per_s: 50, burst: 100 }, idle_timeout: '10m' };
    expect(parseTokensFile(JSON.stringify({ tokens: [{ tenant: 'admin', token_sha256: h, ...all }] }))[0]).toMatchObject({ quotas: { sandboxes: 50, memoryMib: 65536, snapshotBytes: 1 }, rate: { perSecond: 50, burst: 100 }, idleTimeoutMs: 600_000 });
  });

  it('mintToken_withEveryOption_writesAnEntryTheFileTakesAgain', () => {
    const file = join(dir, 'tokens.json');
    mintToken(file, { tenant: 'admin', admin: true, name: 'ops', quotas: { sandboxes: 1, memory_mib: 2, snapshot_bytes: 3 }, rate: { per_s: 4, burst: 5 } });
    mintToken(file, { tenant: 'acme' });
    expect(listTokens(file).map((t) => t.tenant)).toEqual(['admin', 'acme']);
  });

  it('parseTokensFile_withTwoEntriesOfATenantWithDifferentIdleTimeouts_failsNamingTheLaterEntry', () => {
    const doc = (a: string | undefined, b: string | undefined): string => JSON.stringify({ tokens: [{ tenant: 't', token_sha256: '1'.repeat(64), ...(a ? { idle_timeout: a } : {}) }, { tenant: 't', token_sha256: '2'.repeat(64), ...(b ? { idle_timeout: b } : {}) }] });
    // Read silently, the first won: which timeout the tenant got hung on the file's order.
    expect(kindOf(() => parseTokensFile(doc('10m', '1m')))).toBe('invalid_argument:FF_TOKENS_FILE tokens[1]');
    // Set once per tenant, or the same on each, is taken.
    expect(parseTokensFile(doc('10m', undefined))).toHaveLength(2);
    expect(parseTokensFile(doc(undefined, '10m'))).toHaveLength(2);
    expect(parseTokensFile(doc('10m', '600s'))).toHaveLength(2);
  });

  it('tenantIdleTimeout_isParsedAsADuration_andABadOneNamesTheField', () => {
    const h = '3'.repeat(64);
    expect(parseTokensFile(JSON.stringify({ tokens: [{ tenant: 'a', token_sha256: h, idle_timeout: '10m' }] }))[0]!.idleTimeoutMs).toBe(600_000);
    expect(kindOf(() => parseTokensFile(JSON.stringify({ tokens: [{ tenant: 'a', token_sha256: h, idle_timeout: 'soon' }] })))).toBe('invalid_argument:FF_TOKENS_FILE tokens[0].idle_timeout');
  });

  it('authenticate_resolvesKnownTokens_andRefusesMissingMalformedOrUnknownOnes', () => {
    const file = join(dir, 'tokens.json');
    const a = mintToken(file, { tenant: 'acme' });
    const root = mintToken(file, { tenant: 'ops', admin: true });
    const auth = new Authenticator(file, undefined);
    expect(auth.authenticate(`Bearer ${a}`)).toMatchObject({ tenantId: 'acme', admin: false });
    expect(auth.authenticate(`Bearer ${root}`)).toMatchObject({ tenantId: 'ops', admin: true });
    expect(auth.authenticate(`Bearer ${a}`).credentialId).not.toBe(auth.authenticate(`Bearer ${root}`).credentialId);
    expect(kindOf(() => auth.authenticate(undefined))).toBe('unauthenticated');
    expect(kindOf(() => auth.authenticate(a))).toBe('unauthenticated');
    expect(kindOf(() => auth.authenticate(`Bearer ${a}x`))).toBe('unauthenticated');
    expect(kindOf(() => auth.authenticate('Basic Zm9vOmJhcg=='))).toBe('unauthenticated');
  });

  it('authenticate_afterAMint_seesTheNewTokenWithoutARestart', () => {
    const file = join(dir, 'tokens.json');
    mintToken(file, { tenant: 'acme' });
    let now = 0;
    const auth = new Authenticator(file, undefined, () => now);
    const b = mintToken(file, { tenant: 'beta' });
    utimesSync(file, new Date(), new Date(Date.now() + 5000)); // a distinct mtime whatever the fs resolution
    now = 2000;
    expect(auth.authenticate(`Bearer ${b}`).tenantId).toBe('beta');
  });

  it('authenticator_withACorruptedFileOnReload_keepsTheTokensItHad_andSaysSoOnce_untilTheFileIsGoodAgain', () => {
    const file = join(dir, 'tokens.json');
    const a = mintToken(file, { tenant: 'acme' });
    let now = 0;
    const said: Array<string | undefined> = [];
    const auth = new Authenticator(file, undefined, () => now, (why) => said.push(why));
    writeFileSync(file, '{ broken');
    utimesSync(file, new Date(), new Date(Date.now() + 5000));
    now = 2000;
    expect(auth.authenticate(`Bearer ${a}`).tenantId).toBe('acme');
    now = 4000;
    auth.authenticate(`Bearer ${a}`);
    expect(said).toEqual([expect.stringMatching(/^cannot take .*tokens\.json: .*revoked ones included/)]);
    expect(auth.reloadError).toBe(said[0]);
    // A directory where the file was (as unreadable as a file of another user): said too.
    rmSync(file);
    mkdirSync(file);
    utimesSync(file, new Date(), new Date(Date.now() + 9000));
    now = 6000;
    auth.authenticate(`Bearer ${a}`);
    expect(said).toHaveLength(2);
    rmSync(file, { recursive: true });
    const b = mintToken(file, { tenant: 'beta' });
    utimesSync(file, new Date(), new Date(Date.now() + 12_000));
    now = 8000;
    expect(auth.authenticate(`Bearer ${b}`).tenantId).toBe('beta');
    expect(said[2]).toBeUndefined();
    expect(said).toHaveLength(3);
    expect(auth.reloadError).toBeUndefined();
  });

  it('revokeAndMint_ofAFileAnotherUserOwnsWithItsOwnMode_keepItsModeOwnerAndGroup_soTheSchedulerStillReadsIt', () => {
    // The rendered deployment: root-owned tokens.json, 0644, read by the scheduler's DynamicUser.
    const file = join(dir, 'tokens.json');
    mintToken(file, { tenant: 'acme', name: 'ci' });
    mintToken(file, { tenant: 'acme', name: 'laptop' });
    chmodSync(file, 0o644);
    chownSync(file, 4321, 8765);
    revokeTokens(file, 'ci');
    mintToken(file, { tenant: 'beta' });
    const st = statSync(file);
    expect([st.mode & 0o7777, st.uid, st.gid]).toEqual([0o644, 4321, 8765]);
    expect(listTokens(file).map((t) => t.name)).toEqual(['laptop', '']);
  });

  it('revokeTokens_byNameOrId_removesOnlyThose_andTheAuthenticatorRefusesThemAfterItsNextReload', () => {
    const file = join(dir, 'tokens.json');
    const a = mintToken(file, { tenant: 'acme', name: 'ci' });
    const b = mintToken(file, { tenant: 'acme', name: 'laptop' });
    const c = mintToken(file, { tenant: 'beta' });
    let now = 0;
    const auth = new Authenticator(file, undefined, () => now);
    expect(listTokens(file)).toEqual([
      { id: credentialIdOf(sha256(a)), tenant: 'acme', name: 'ci', admin: false },
      { id: credentialIdOf(sha256(b)), tenant: 'acme', name: 'laptop', admin: false },
      { id: credentialIdOf(sha256(c)), tenant: 'beta', name: '', admin: false },
    ]);
    expect(revokeTokens(file, 'ci').map((t) => t.name)).toEqual(['ci']);
    expect(revokeTokens(file, credentialIdOf(sha256(c))).map((t) => t.tenant)).toEqual(['beta']);
    expect(kindOf(() => revokeTokens(file, 'ci'))).toBe('not_found');
    expect(kindOf(() => revokeTokens(file, ''))).toBe('not_found');
    utimesSync(file, new Date(), new Date(Date.now() + 5000));
    now = 2000;
    expect(kindOf(() => auth.authenticate(`Bearer ${a}`))).toBe('unauthenticated');
    expect(kindOf(() => auth.authenticate(`Bearer ${c}`))).toBe('unauthenticated');
    expect(auth.authenticate(`Bearer ${b}`).tenantId).toBe('acme');
    expect([auth.has(credentialIdOf(sha256(a))), auth.has(credentialIdOf(sha256(b)))]).toEqual([false, true]);
  });

  it('authenticator_afterARevokeThatLeavesTheFilesMtimeAsItWas_refusesTheRevokedToken', () => {
    // A file system with a coarse mtime (or one clock tick) can give the replacement the mtime
    // of the file it replaced: its size and inode still differ.
    const file = join(dir, 'tokens.json');
    const leaked = mintToken(file, { tenant: 'acme', name: 'leaked' });
    const kept = mintToken(file, { tenant: 'acme', name: 'kept' });
    const fixed = new Date(1_700_000_000_000);
    utimesSync(file, fixed, fixed);
    let now = 0;
    const auth = new Authenticator(file, undefined, () => now);
    expect(auth.authenticate(`Bearer ${leaked}`).tenantId).toBe('acme');
    revokeTokens(file, 'leaked');
    utimesSync(file, fixed, fixed);
    now = 2000;
    expect(kindOf(() => auth.authenticate(`Bearer ${leaked}`))).toBe('unauthenticated');
    expect(auth.authenticate(`Bearer ${kept}`).tenantId).toBe('acme');
  });

  it('mintAndRevoke_inConcurrentProcesses_loseNoMintAndResurrectNoRevokedToken', async () => {
    // Two `token mint` loops and a `token revoke` loop at once, as separate CLI processes.
    const file = join(dir, 'tokens.json');
    for (let i = 0; i < 20; i++) mintToken(file, { tenant: 'acme', name: `old-${i}` });
    const go = join(dir, 'go');
    const script = join(dir, 'writer.mjs');
    writeFileSync(
      script,
      `const [role, file, go] = process.argv.slice(2);
const { existsSync } = await import('node:fs');
const { mintToken, revokeTokens } = await import(${JSON.stringify(new URL('./tokens.ts', import.meta.url).href)});
const pause = new Int32Array(new SharedArrayBuffer(4));
console.log('ready');
while (!existsSync(go)) Atomics.wait(pause, 0, 0, 1);
if (role === 'revoke') for (let i = 0; i < 20; i++) revokeTokens(file, 'old-' + i);
else for (let i = 0; i < 25; i++) mintToken(file, { tenant: 'ci', name: role + '-' + i });
`,
    );
    const run = (role: string): { ready: Promise<void>; done: Promise<string> } => {
      const child = spawn(process.execPath, ['--import', 'tsx', script, role, file, go], { stdio: ['ignore', 'pipe', 'pipe'] });
      let out = '';
      let err = '';
      let ready: () => void = () => undefined;
      const readyP = new Promise<void>((resolve) => (ready = resolve));
      child.stdout.on('data', (d: Buffer) => {
        out += d.toString();
        if (out.includes('ready')) ready();
      });
      child.stderr.on('data', (d: Buffer) => (err += d.toString()));
      const done = new Promise<string>((resolve) => child.on('exit', (code) => (ready(), resolve(code === 0 ? '' : `${role} exited ${code}: ${err}`))));
      return { ready: readyP, done };
    };
    const writers = ['m1', 'm2', 'revoke'].map(run);
    await Promise.all(writers.map((w) => w.ready));
    writeFileSync(go, '');
    expect((await Promise.all(writers.map((w) => w.done))).filter(Boolean)).toEqual([]);
    const names = listTokens(file).map((t) => t.name);
    expect(names.filter((n) => n.startsWith('old-'))).toEqual([]);
    expect(names.filter((n) => n.startsWith('m1-'))).toHaveLength(25);
    expect(names.filter((n) => n.startsWith('m2-'))).toHaveLength(25);
    expect(existsSync(`${file}.lock`)).toBe(false);
  }, 60_000);

  it('mintAndRevoke_withAStaleLockLeftByADeadOrLongGoneWriter_takeItOver_andRemoveTheirOwn', () => {
    const file = join(dir, 'tokens.json');
    const lock = `${file}.lock`;
    mintToken(file, { tenant: 'acme', name: 'ci' });
    // A writer that died holding it (kill -9 mid-mint): its pid is no longer alive.
    const dead = spawnSync(process.execPath, ['-e', '']).pid;
    writeFileSync(lock, `${dead} ${hostname()}\n`);
    mintToken(file, { tenant: 'acme', name: 'laptop' });
    expect(existsSync(lock)).toBe(false);
    // A lock older than any mint takes, whoever holds it (this very process here).
    writeFileSync(lock, `${process.pid} ${hostname()}\n`);
    const old = new Date(Date.now() - 60_000);
    utimesSync(lock, old, old);
    expect(revokeTokens(file, 'ci').map((t) => t.name)).toEqual(['ci']);
    expect(existsSync(lock)).toBe(false);
    // A revoke that finds nothing writes nothing, and leaves no lock either.
    expect(kindOf(() => revokeTokens(file, 'ci'))).toBe('not_found');
    expect(existsSync(lock)).toBe(false);
    expect(listTokens(file).map((t) => t.name)).toEqual(['laptop']);
  });

  it('bearerOf_acceptsOnlyTheBearerScheme', () => {
    expect(bearerOf('Bearer abc')).toBe('abc');
    expect(bearerOf('bearer abc')).toBeUndefined();
    expect(bearerOf('Bearer ')).toBeUndefined();
    expect(bearerOf(undefined)).toBeUndefined();
  });
});

describe('ApiGuard and tenancy', () => {
  let dir: string;
  beforeEach(() => {
    dir = mkdtempSync(join(tmpdir(), 'ff-guard-'));
  });
  afterEach(() => rmSync(dir, { recursive: true, force: true }));

  it('admit_overTheTenantRate_isRetryableResourceExhausted_andRefillsWithTime', () => {
    const file = join(dir, 'tokens.json');
    const a = mintToken(file, { tenant: 'acme', rate: { per_s: 2, burst: 2 } });
    let now = 0;
    const guard = new ApiGuard(new Authenticator(file, undefined, () => now), { maxStreamsPerCredential: 8, now: () => now });
    guard.admit({ metadata: md(`Bearer ${a}`), streaming: false });
    guard.admit({ metadata: md(`Bearer ${a}`), streaming: false });
    let err: unknown;
    try {
      guard.admit({ metadata: md(`Bearer ${a}`), streaming: false });
    } catch (e) {
      err = e;
    }
    expect(err).toMatchObject({ kind: 'resource_exhausted', retryable: true, field: 'rate' });
    now = 500;
    expect(guard.admit({ metadata: md(`Bearer ${a}`), streaming: false }).principal.tenantId).toBe('acme');
  });

  it('admit_withDefaultRate_limitsTenantsWithoutTheirOwn', () => {
    const file = join(dir, 'tokens.json');
    const a = mintToken(file, { tenant: 'acme' });
    const guard = new ApiGuard(new Authenticator(file, { perSecond: 1, burst: 1 }, () => 0), { maxStreamsPerCredential: 8, now: () => 0 });
    guard.admit({ metadata: md(`Bearer ${a}`), streaming: false });
    expect(kindOf(() => guard.admit({ metadata: md(`Bearer ${a}`), streaming: false }))).toBe('resource_exhausted:rate');
  });

  it('admit_streamsOverThePerCredentialCap_areRefusedUntilOneEnds', () => {
    const file = join(dir, 'tokens.json');
    const a = mintToken(file, { tenant: 'acme' });
    const guard = new ApiGuard(new Authenticator(file, undefined), { maxStreamsPerCredential: 2 });
    const s1 = guard.admit({ metadata: md(`Bearer ${a}`), streaming: true });
    guard.admit({ metadata: md(`Bearer ${a}`), streaming: true });
    expect(kindOf(() => guard.admit({ metadata: md(`Bearer ${a}`), streaming: true }))).toBe('resource_exhausted:streams');
    guard.admit({ metadata: md(`Bearer ${a}`), streaming: false }); // unary calls are not capped
    s1.release!();
    expect(guard.admit({ metadata: md(`Bearer ${a}`), streaming: true }).principal.tenantId).toBe('acme');
  });

  it('admit_streamOfARevokedCredential_isEndedAtTheNextCheck_andOthersAndEndedStreamsAreLeftAlone', () => {
    vi.useFakeTimers();
    try {
      const file = join(dir, 'tokens.json');
      const a = mintToken(file, { tenant: 'acme', name: 'leaked' });
      const b = mintToken(file, { tenant: 'acme' });
      const guard = new ApiGuard(new Authenticator(file, undefined), { maxStreamsPerCredential: 4 });
      const ended: string[] = [];
      const open = (token: string, name: string): ReturnType<ApiGuard['admit']> => {
        const s = guard.admit({ metadata: md(`Bearer ${token}`), streaming: true });
        s.onRevoke!((err) => ended.push(`${name}: ${err.message}`));
        return s;
      };
      open(a, 'a1');
      open(b, 'b1');
      open(a, 'a-closed').release!();
      vi.advanceTimersByTime(REVOCATION_CHECK_MS * 2);
      expect(ended).toEqual([]);
      revokeTokens(file, 'leaked');
      utimesSync(file, new Date(), new Date(Date.now() + 5000));
      vi.advanceTimersByTime(REVOCATION_CHECK_MS * 2);
      expect(ended).toEqual([expect.stringMatching(/^a1: credential revoked/)]);
      expect(kindOf(() => guard.admit({ metadata: md(`Bearer ${a}`), streaming: true }))).toBe('unauthenticated');
    } finally {
      vi.useRealTimers();
    }
  });

  it('admit_streamsAndLongPollsOfACredentialWhoseTenantOrAdminFlagIsEdited_areEndedAtTheNextCheck_andCallsAdmittedAsItIsNowAreLeftAlone', () => {
    vi.useFakeTimers();
    try {
      const file = join(dir, 'tokens.json');
      const ops = mintToken(file, { tenant: 'ops', admin: true, name: 'ops' });
      const ci = mintToken(file, { tenant: 'acme', name: 'ci' });
      const other = mintToken(file, { tenant: 'acme', name: 'other' });
      const guard = new ApiGuard(new Authenticator(file, undefined), { maxStreamsPerCredential: 8 });
      const ended: string[] = [];
      const open = (token: string, name: string, method?: string): ReturnType<ApiGuard['admit']> => {
        const s = guard.admit({ metadata: md(`Bearer ${token}`), streaming: method === undefined, ...(method ? { method } : {}) });
        s.onRevoke!((err) => ended.push(`${name}: ${err.message}`));
        return s;
      };
      open(ops, 'ops-watch');
      open(ops, 'ops-wait', '/forkfleet.v1.FleetService/WaitOperation');
      open(ci, 'ci-watch');
      open(other, 'other-watch');
      // The entries keep their token (and so their credential id): ops loses admin, ci moves to another tenant.
      const doc = JSON.parse(readFileSync(file, 'utf8')) as { tokens: Array<Record<string, unknown>> };
      for (const t of doc.tokens) {
        if (t.name === 'ops') delete t.admin;
        if (t.name === 'ci') t.tenant = 'beta';
      }
      writeFileSync(file, JSON.stringify(doc));
      utimesSync(file, new Date(), new Date(Date.now() + 5000));
      vi.advanceTimersByTime(REVOCATION_CHECK_MS * 2);
      expect(ended.sort()).toEqual([
        expect.stringMatching(/^ci-watch: credential changed .*tenant is now beta, not acme/),
        expect.stringMatching(/^ops-wait: credential changed .*no longer an admin credential/),
        expect.stringMatching(/^ops-watch: credential changed .*no longer an admin credential/),
      ]);
      // A stream admitted as the entry is now is left alone by later checks.
      open(ci, 'ci-again');
      vi.advanceTimersByTime(REVOCATION_CHECK_MS * 2);
      expect(ended).toHaveLength(3);
      expect(guard.admit({ metadata: md(`Bearer ${ci}`), streaming: true }).principal).toMatchObject({ tenantId: 'beta', admin: false });
    } finally {
      vi.useRealTimers();
    }
  });

  it('admit_waitOperationLongPolls_areCappedLikeStreamsOnTheirOwnCount_otherUnaryCallsAreNot', () => {
    const file = join(dir, 'tokens.json');
    const a = mintToken(file, { tenant: 'acme' });
    const guard = new ApiGuard(new Authenticator(file, undefined), { maxStreamsPerCredential: 2 });
    const wait = (): ReturnType<ApiGuard['admit']> => guard.admit({ metadata: md(`Bearer ${a}`), streaming: false, method: '/forkfleet.v1.FleetService/WaitOperation' });
    const w1 = wait();
    wait();
    expect(kindOf(wait)).toBe('resource_exhausted:streams');
    expect(guard.admit({ metadata: md(`Bearer ${a}`), streaming: false, method: '/forkfleet.v1.FleetService/GetOperation' }).release).toBeUndefined();
    // Streams have their own count: both caps can be used in full at once.
    guard.admit({ metadata: md(`Bearer ${a}`), streaming: true });
    guard.admit({ metadata: md(`Bearer ${a}`), streaming: true });
    w1.release!();
    expect(wait().principal.tenantId).toBe('acme');
  });

  it('admit_waitOperationLongPollOfARevokedCredential_isEndedAtTheNextCheck_andOneAnsweredIsLeftAlone', () => {
    vi.useFakeTimers();
    try {
      const file = join(dir, 'tokens.json');
      const a = mintToken(file, { tenant: 'acme', name: 'leaked' });
      const guard = new ApiGuard(new Authenticator(file, undefined), { maxStreamsPerCredential: 4 });
      const ended: string[] = [];
      const wait = (name: string): ReturnType<ApiGuard['admit']> => {
        const w = guard.admit({ metadata: md(`Bearer ${a}`), streaming: false, method: '/forkfleet.v1.FleetService/WaitOperation' });
        // A WaitOperation may wait 10 minutes: its call is ended like a stream's.
        w.onRevoke!((err) => ended.push(`${name}: ${err.message}`));
        return w;
      };
      wait('w1');
      wait('w-answered').release!();
      revokeTokens(file, 'leaked');
      utimesSync(file, new Date(), new Date(Date.now() + 5000));
      vi.advanceTimersByTime(REVOCATION_CHECK_MS * 2);
      expect(ended).toEqual([expect.stringMatching(/^w1: credential revoked/)]);
    } finally {
      vi.useRealTimers();
    }
  });

  it('admit_watchEventsStreams_areCappedPerCredentialBelowTheStreamCap_andAFreedWatchOrARefusedOneLeavesOtherStreamsTheirRoom', () => {
    const file = join(dir, 'tokens.json');
    const a = mintToken(file, { tenant: 'acme' });
    const ops = mintToken(file, { tenant: 'ops', admin: true });
    const guard = new ApiGuard(new Authenticator(file, undefined), { maxStreamsPerCredential: 4, maxWatchesPerCredential: 2 });
    const watch = (): ReturnType<ApiGuard['admit']> => guard.admit({ metadata: md(`Bearer ${a}`), streaming: true, method: '/forkfleet.v1.FleetService/WatchEvents' });
    const exec = (): ReturnType<ApiGuard['admit']> => guard.admit({ metadata: md(`Bearer ${a}`), streaming: true, method: '/forkfleet.v1.FleetService/Exec' });
    const w1 = watch();
    watch();
    expect(kindOf(watch)).toBe('resource_exhausted:streams');
    // The refused watch took no stream: two execs still fit beside the two watches.
    exec();
    exec();
    expect(kindOf(exec)).toBe('resource_exhausted:streams');
    w1.release!();
    // A watch's release frees its stream too, so one more exec (or a watch) fits.
    exec();
    expect(kindOf(watch)).toBe('resource_exhausted:streams');
    // An admin credential (the dashboard watches once per tenant) is not capped.
    for (let i = 0; i < 4; i++) guard.admit({ metadata: md(`Bearer ${ops}`), streaming: true, method: '/forkfleet.v1.FleetService/WatchEvents' });
  });

  it('admit_withTwoAuthorizationHeaders_isUnauthenticated', () => {
    const file = join(dir, 'tokens.json');
    const a = mintToken(file, { tenant: 'acme' });
    const guard = new ApiGuard(new Authenticator(file, undefined), { maxStreamsPerCredential: 2 });
    expect(kindOf(() => guard.admit({ metadata: md(`Bearer ${a}`, `Bearer ${a}`), streaming: false }))).toBe('unauthenticated');
  });

  it('tenantFor_emptyMeansOwn_otherIsPermissionDeniedNamingTheField_exceptForAdmins', () => {
    const user = { tenantId: 'acme', admin: false, credentialId: 'x' };
    const admin = { tenantId: 'ops', admin: true, credentialId: 'y' };
    expect(tenantFor(user, '')).toBe('acme');
    expect(tenantFor(user, 'acme')).toBe('acme');
    expect(kindOf(() => tenantFor(user, 'beta'))).toBe('permission_denied:tenant_id');
    expect(kindOf(() => tenantFor(user, 'beta', 'header.tenant_id'))).toBe('permission_denied:header.tenant_id');
    expect(tenantFor(admin, 'beta')).toBe('beta');
    expect(tenantFor(admin, '')).toBe('ops');
    expect(kindOf(() => requireAdmin(user, 'ListHosts'))).toBe('permission_denied');
    expect(kindOf(() => requireAdmin(admin, 'ListHosts'))).toBeUndefined();
  });
});

describe('client credentials', () => {
  it('resolveClientCredentials_prefersOptions_thenANamedCredentialsFile_thenEnv_thenTheFleetsFile', () => {
    const dir = mkdtempSync(join(tmpdir(), 'ff-creds-'));
    try {
      writeFileSync(join(dir, 'ca.crt'), '-----BEGIN CERTIFICATE-----\nfile\n');
      writeFileSync(join(dir, 'credentials.json'), JSON.stringify({ token: 'ff_file', ca: 'ca.crt', tenant: 'dev' }));
      const fromFile = resolveClientCredentials({}, { FF_FLEET_DIR: dir });
      expect(fromFile).toMatchObject({ token: 'ff_file', tenant: 'dev', source: join(dir, 'credentials.json') });
      expect(fromFile.caPem?.toString()).toContain('file');
      expect(resolveClientCredentials({}, { FF_FLEET_DIR: dir, FF_TOKEN: 'ff_env' }).token).toBe('ff_env');
      expect(resolveClientCredentials({ token: 'ff_opt' }, { FF_FLEET_DIR: dir, FF_TOKEN: 'ff_env' }).token).toBe('ff_opt');
      expect(resolveClientCredentials({}, { FF_FLEET_DIR: join(dir, 'none') })).toMatchObject({ token: undefined, caPem: undefined });
      // An empty FF_FLEET_DIR is the default directory (as fleet:up reads it), not the working directory.
      expect(defaultCredentialsFile({ FF_FLEET_DIR: '' })).toBe('/var/lib/ffleet/credentials.json');
      // A file named on purpose wins over FF_TOKEN / FF_CA (an exported dev token must not
      // stand in for the admin file the command names).
      const named = resolveClientCredentials({ credentialsFile: join(dir, 'credentials.json') }, { FF_TOKEN: 'ff_env', FF_CA: join(dir, 'other.crt') });
      expect(named).toMatchObject({ token: 'ff_file', source: join(dir, 'credentials.json') });
      expect(named.caPem?.toString()).toContain('file');
      expect(resolveClientCredentials({}, { FF_CREDENTIALS: join(dir, 'credentials.json'), FF_TOKEN: 'ff_env' }).token).toBe('ff_file');
      // The fleet file's tenant goes with its token only: FF_TOKEN is some other tenant's.
      expect(resolveClientCredentials({}, { FF_FLEET_DIR: dir, FF_TOKEN: 'ff_env' }).tenant).toBeUndefined();
      // A named file that is not there is an error naming where it was named, not a silent
      // fall back to FF_TOKEN; the fleet's default file may be absent.
      expect(kindOf(() => resolveClientCredentials({ credentialsFile: join(dir, 'typo.json') }, { FF_TOKEN: 'ff_env' }))).toBe('invalid_argument:credentials');
      expect(kindOf(() => resolveClientCredentials({}, { FF_CREDENTIALS: join(dir, 'typo.json'), FF_TOKEN: 'ff_env' }))).toBe('invalid_argument:FF_CREDENTIALS');
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
