import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import type { PeerCertificate } from 'node:tls';
import { agentConnectOptions, createNkeyFile, hostGroupPermissions, hostPermissions, natsServerAuthConfig, natsTlsOptions, nkeyConnectOptions } from './auth.ts';
import { fieldOf } from '../../testkit/fields.ts';

describe('NATS permissions', () => {
  it('hostPermissions_namesOnlyItsOwnSubjectsAndConsumer', () => {
    const p = hostPermissions('h1');
    const all = [...p.publish.allow, ...p.subscribe.allow];
    expect(all.filter((s) => /[*>]$/.test(s))).toEqual(['ff.execout.h1.>', '$JS.ACK.FF_WORK.agent-h1.>', '_INBOX_h1.>']);
    expect(all.filter((s) => s.includes('h2'))).toEqual([]);
    expect(p.publish.allow).toContain('$JS.API.CONSUMER.CREATE.FF_WORK.agent-h1.ff.work.h1');
    expect(p.publish.allow.some((s) => s.includes('DURABLE.CREATE') || s.includes('STREAM.CREATE') || s.startsWith('ff.work.'))).toBe(false);
    expect(p.subscribe.allow).toEqual(['ff.exec.h1', 'ff.execcancel.h1', 'ff.execalive.h1', 'ff.file.h1', '_INBOX_h1.>']);
  });
  it('hostGroupPermissions_isTheUnionWithOneInbox', () => {
    const p = hostGroupPermissions(['f-1', 'f-2'], '_INBOX_fakes');
    expect(p.subscribe.allow).toEqual(['ff.exec.f-1', 'ff.execcancel.f-1', 'ff.execalive.f-1', 'ff.file.f-1', 'ff.exec.f-2', 'ff.execcancel.f-2', 'ff.execalive.f-2', 'ff.file.f-2', '_INBOX_fakes.>']);
    expect(p.publish.allow).toContain('ff.result.f-2');
  });
  it('natsServerAuthConfig_schedulerHasNoPermissionBlock', () => {
    const cfg = JSON.parse(natsServerAuthConfig([{ nkey: 'US' }, { nkey: 'UH', permissions: hostPermissions('h1') }])) as { authorization: { users: Array<{ nkey: string; permissions?: unknown }> } };
    expect(cfg.authorization.users[0]).toEqual({ nkey: 'US' });
    expect(cfg.authorization.users[1]?.permissions).toBeDefined();
  });
  it('natsTlsOptions_checkTheServerCertificateAgainstTheAddressDialed_notLocalhost', () => {
    const opts = natsTlsOptions({ ca: undefined, cert: undefined, key: undefined }).tls as unknown as { checkServerIdentity: (this: unknown, host: string, cert: PeerCertificate) => Error | undefined };
    const certFor = (san: string): PeerCertificate => ({ subject: { CN: 'nats' }, subjectaltname: san }) as unknown as PeerCertificate;
    const dialed = (ip: string): unknown => ({ socket: { remoteAddress: ip } });
    // nats.js names no host for an IP server, so Node would check "localhost".
    expect(opts.checkServerIdentity.call(dialed('10.0.0.2'), 'localhost', certFor('IP Address:10.0.0.2'))).toBeUndefined();
    expect(opts.checkServerIdentity.call(dialed('10.0.0.3'), 'localhost', certFor('IP Address:10.0.0.2'))).toBeInstanceOf(Error);
    // A certificate for "localhost" does not pass for whatever server was dialed.
    expect(opts.checkServerIdentity.call(dialed('10.0.0.3'), 'localhost', certFor('DNS:localhost'))).toBeInstanceOf(Error);
    // Without a socket to tell the address: Node's own check of the name, which fails closed for IP-only certificates.
    expect(opts.checkServerIdentity.call(undefined, 'localhost', certFor('IP Address:10.0.0.2'))).toBeInstanceOf(Error);
    expect(opts.checkServerIdentity.call({ servername: 'nats.example' }, 'nats.example', certFor('DNS:nats.example'))).toBeUndefined();
  });
});

describe('An agent connection', () => {
  it('pingsItsServerEvery5sAndGivesUpAfter2Unanswered_soALinkThatWentSilentIsNoticedWellInsideTheHostLostThreshold', () => {
    const o = agentConnectOptions('host-a', undefined);
    expect(o).toMatchObject({ pingInterval: 5_000, maxPingOut: 2, inboxPrefix: expect.stringContaining('host-a') });
    // Within the default FF_HOST_LOST_AFTER (30 s): (maxPingOut + 1) pings.
    expect(o.pingInterval! * (o.maxPingOut! + 1)).toBeLessThan(30_000);
  });
});

describe('The NKey seed file', () => {
  it('nkeyConnectOptions_whenFileUnreadable_failsNamingFF_NATS_NKEY_FILEAndThePath', () => {
    const missing = join(tmpdir(), `ff-no-such-${process.pid}.nk`);
    expect(fieldOf(() => nkeyConnectOptions(missing))).toBe('FF_NATS_NKEY_FILE');
    expect(() => nkeyConnectOptions(missing)).toThrow(new RegExp(`^FF_NATS_NKEY_FILE: cannot read ${missing}: ENOENT`));
    // The agent's path is the same variable.
    expect(fieldOf(() => agentConnectOptions('host-a', missing))).toBe('FF_NATS_NKEY_FILE');
  });

  it('nkeyConnectOptions_whenNoUserSeed_failsNamingTheVariable_andASeedWorks', () => {
    const dir = mkdtempSync(join(tmpdir(), 'ff-nkey-'));
    try {
      const bad = join(dir, 'bad.nk');
      writeFileSync(bad, 'not a seed\n');
      expect(fieldOf(() => nkeyConnectOptions(bad))).toBe('FF_NATS_NKEY_FILE');
      const good = createNkeyFile(join(dir, 'good.nk')).seedFile;
      expect(nkeyConnectOptions(good).authenticator).toBeTypeOf('function');
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
