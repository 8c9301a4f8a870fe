import { describe, expect, it } from 'vitest';
import { compileAgentConfig, DEFAULT_GUEST_CGROUP } from './config.ts';
import { fieldOf } from '../services/testkit/fields.ts';

const base = { FF_TRUSTED_KEY: '/k.pem', FF_HOST_ID: 'h1' };

describe('compileAgentConfig: guest CPU isolation', () => {
  it('guestCgroup_unset_isTheDefaultGroupAndOptional', () => {
    expect(compileAgentConfig(base).guestCgroup).toEqual({ path: DEFAULT_GUEST_CGROUP, cpuWeight: 100, required: false });
  });

  it('guestCgroup_set_isRequired_andEmptyTurnsItOff', () => {
    expect(compileAgentConfig({ ...base, FF_GUEST_CGROUP: 'forkfleet/guests', FF_GUEST_CPU_WEIGHT: '400' }).guestCgroup).toEqual({ path: 'forkfleet/guests', cpuWeight: 400, required: true });
    expect(compileAgentConfig({ ...base, FF_GUEST_CGROUP: '' }).guestCgroup).toBeUndefined();
  });

  it('guestCgroup_whenPathEscapesOrWeightIsOutOfRange_namesTheVariable', () => {
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_GUEST_CGROUP: '../x' }))).toBe('FF_GUEST_CGROUP');
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_GUEST_CGROUP: 'a b' }))).toBe('FF_GUEST_CGROUP');
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_GUEST_CPU_WEIGHT: '0' }))).toBe('FF_GUEST_CPU_WEIGHT');
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_GUEST_CPU_WEIGHT: '10001' }))).toBe('FF_GUEST_CPU_WEIGHT');
  });
});

describe('compileAgentConfig: NATS TLS', () => {
  it('natsTls_unset_isOff_tlsUrlsOrTheCa_turnItOn', () => {
    expect(compileAgentConfig(base).natsTls).toBeUndefined();
    expect(compileAgentConfig({ ...base, FF_NATS_URL: 'tls://10.0.0.1:4222' }).natsTls).toEqual({ prefix: 'FF_NATS', ca: '', cert: '', key: '' });
    expect(compileAgentConfig({ ...base, FF_NATS_CA: '/n/ca.crt', FF_NATS_CERT: '/n/c.crt', FF_NATS_KEY: '/n/c.key' }).natsTls).toEqual({ prefix: 'FF_NATS', ca: '/n/ca.crt', cert: '/n/c.crt', key: '/n/c.key' });
  });

  it('natsTls_whenCertLacksKeyOrKeyLacksCertOrTheUrlIsNotNats_namesTheVariable', () => {
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_NATS_CA: '/n/ca.crt', FF_NATS_CERT: '/n/c.crt' }))).toBe('FF_NATS_KEY');
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_NATS_KEY: '/n/c.key' }))).toBe('FF_NATS_CERT');
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_NATS_URL: 'https://10.0.0.1:4222' }))).toBe('FF_NATS_URL');
  });
});

describe('compileAgentConfig: peer TLS', () => {
  it('peerTls_unset_isPlainText_allThreeFilesTurnOnMutualTls', () => {
    expect(compileAgentConfig(base).peerTls).toBeUndefined();
    expect(compileAgentConfig({ ...base, FF_PEER_CA: '/p/ca.crt', FF_PEER_CERT: '/p/h.crt', FF_PEER_KEY: '/p/h.key' }).peerTls).toEqual({ prefix: 'FF_PEER', ca: '/p/ca.crt', cert: '/p/h.crt', key: '/p/h.key' });
  });

  it('peerMigrationTls_isOnByDefault_takesRelayQemuOrOff_andAnythingElseNamesTheVariable', () => {
    expect(compileAgentConfig(base).peerMigrationTls).toBe('on');
    for (const v of ['relay', 'qemu', 'off'] as const) expect(compileAgentConfig({ ...base, FF_PEER_MIGRATION_TLS: v }).peerMigrationTls).toBe(v);
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_PEER_MIGRATION_TLS: 'no' }))).toBe('FF_PEER_MIGRATION_TLS');
  });

  it('peerTls_withoutOneOfItsThreeFiles_namesTheMissingVariable', () => {
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_PEER_CERT: '/p/h.crt', FF_PEER_KEY: '/p/h.key' }))).toBe('FF_PEER_CA');
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_PEER_CA: '/p/ca.crt' }))).toBe('FF_PEER_CERT');
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_PEER_CA: '/p/ca.crt', FF_PEER_CERT: '/p/h.crt' }))).toBe('FF_PEER_KEY');
  });
});
