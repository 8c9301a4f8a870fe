import { describe, expect, it } from 'vitest';
import { compileAgentConfig, DEFAULT_GUEST_CGROUP, sandboxDenyCidrs } from './config.ts';
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

  it('hostId_namedLikeASandboxSnapshotOrOperation_isRefusedNamingFF_HOST_ID', () => {
    for (const id of ['sb-1', 'sn-a', 'op-x']) expect(fieldOf(() => compileAgentConfig({ ...base, FF_HOST_ID: id }))).toBe('FF_HOST_ID');
    expect(compileAgentConfig({ ...base, FF_HOST_ID: 'sbx-1' }).hostId).toBe('sbx-1');
  });

  it('guestCgroup_whenPathEscapesOrWeightIsOutOfRange_namesTheVariable', () => {
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_GUEST_CGROUP: '../x' }))).toBe('FF_GUEST_CGROUP');
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_GUEST_CGROUP: 'a b' }))).toBe('FF_GUEST_CGROUP');
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_GUEST_CPU_WEIGHT: '0' }))).toBe('FF_GUEST_CPU_WEIGHT');
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_GUEST_CPU_WEIGHT: '10001' }))).toBe('FF_GUEST_CPU_WEIGHT');
  });

  it('egressPool_smallerThanA28OrNotACidr_isRefusedNamingFF_EGRESS_POOL', () => {
    for (const v of ['10.0.0.0/29', '10.0.0.0/30', '10.0.0.0/32', '10.0.0.1', 'nope']) expect(fieldOf(() => compileAgentConfig({ ...base, FF_EGRESS_POOL: v })), v).toBe('FF_EGRESS_POOL');
    expect(compileAgentConfig({ ...base, FF_EGRESS_POOL: '10.0.0.0/28' }).egress.pool).toBe('10.0.0.0/28');
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

describe('compileAgentConfig: value rules', () => {
  // Each integer setting with a value it accepts (so a refusal below is the spelling's, not the range's).
  const INTEGERS: Record<string, string> = { FF_CAPACITY_VCPUS: '64', FF_CAPACITY_MEMORY_MIB: '4096', FF_CAPACITY_DISK_MIB: '4096', FF_LINK_BYTES_PER_SECOND: '4096', FF_STEP_CONCURRENCY: '16', FF_CHUNK_BYTES: '4096', FF_STANDBY_MAX: '16', FF_STANDBY_PER_SNAPSHOT: '16', FF_MIGRATE_MAX_CHILDREN: '16', FF_RAM_POOL: '16', FF_RAM_POOL_MAX_MIB: '4096', FF_RAM_POOL_MIB: '4096', FF_GUEST_CPU_WEIGHT: '4096' };
  const DURATIONS = ['FF_HEARTBEAT_INTERVAL', 'FF_GC_INTERVAL', 'FF_JOURNAL_RETENTION', 'FF_GC_GRACE', 'FF_STANDBY_IDLE', 'FF_INCOMING_STANDBY_QUIET'];

  it('defaults_areUnchanged', () => {
    const c = compileAgentConfig(base);
    expect(c).toMatchObject({ peerAddr: '127.0.0.1:0', peerAdvertise: '', heartbeatMs: 1000, concurrency: 4, chunkBytes: 256 * 1024, logLevel: 'info', linkBytesPerSecond: 1.25e9, gcIntervalMs: 300_000, journalRetentionMs: 48 * 3_600_000, gcGraceMs: 60_000, migrateMaxChildren: 2 });
    expect(c.standby).toEqual({ max: 8, perSnapshot: 2, idleMs: 600_000, incomingQuietMs: 3000 });
    expect(c.ram).toMatchObject({ keep: 2, maxMib: 2048, prefillMib: [] });
    expect(c.capacity.diskMib).toBe(100 * 1024);
  });

  it('metricsAddr_unsetIsOff_hostPortServes_andAnythingElseNamesTheVariable', () => {
    expect(compileAgentConfig(base).metricsAddr).toBe('');
    expect(compileAgentConfig({ ...base, FF_METRICS_ADDR: '10.0.0.5:17711' }).metricsAddr).toBe('10.0.0.5:17711');
    expect(compileAgentConfig({ ...base, FF_METRICS_ADDR: '127.0.0.1:0' }).metricsAddr).toBe('127.0.0.1:0');
    for (const bad of ['17711', '10.0.0.5', '10.0.0.5:99999', ':80']) expect(fieldOf(() => compileAgentConfig({ ...base, FF_METRICS_ADDR: bad })), bad).toBe('FF_METRICS_ADDR');
  });

  it('chunkBytes_aboveWhatOnePeerMessageCarries_isRefusedNamingTheVariable', () => {
    expect(compileAgentConfig({ ...base, FF_CHUNK_BYTES: String(4 << 20) }).chunkBytes).toBe(4 << 20);
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_CHUNK_BYTES: String((4 << 20) + 1) }))).toBe('FF_CHUNK_BYTES');
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_CHUNK_BYTES: String(64 << 20) }))).toBe('FF_CHUNK_BYTES');
  });

  it('standbyMax_empty_isRefusedNamingTheVariable', () => {
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_STANDBY_MAX: '' }))).toBe('FF_STANDBY_MAX');
    expect(compileAgentConfig({ ...base, FF_STANDBY_MAX: '0' }).standby.max).toBe(0);
  });

  it('integerSettings_emptyOrWhitespace_areRefusedNamingTheVariable', () => {
    // FF_RAM_POOL_MIB is a list: '' is none (prefill nothing), spaces alone are refused.
    for (const name of Object.keys(INTEGERS)) for (const v of name === 'FF_RAM_POOL_MIB' ? [' ', '\t'] : ['', ' ', '\t']) expect(fieldOf(() => compileAgentConfig({ ...base, [name]: v })), `${name}=${JSON.stringify(v)}`).toBe(name);
  });

  it('integerSettings_hexExponentSignOrDecimalPoint_areRefusedNamingTheVariable', () => {
    for (const [name, ok] of Object.entries(INTEGERS)) {
      expect(fieldOf(() => compileAgentConfig({ ...base, [name]: ok })), `${name}=${ok}`).toBeUndefined();
      const n = Number(ok);
      for (const v of [`0x${n.toString(16)}`, `${ok}e0`, `+${ok}`, `${ok}.0`, `${ok}x`]) expect(fieldOf(() => compileAgentConfig({ ...base, [name]: v })), `${name}=${JSON.stringify(v)}`).toBe(name);
    }
  });

  it('integerSettings_paddedWithSpaces_areRefusedNamingTheVariable', () => {
    // Items of the FF_RAM_POOL_MIB list may have spaces around the commas ('256, 512'), as other lists.
    for (const [name, ok] of Object.entries(INTEGERS)) if (name !== 'FF_RAM_POOL_MIB') for (const v of [` ${ok}`, `${ok} `]) expect(fieldOf(() => compileAgentConfig({ ...base, [name]: v })), `${name}=${JSON.stringify(v)}`).toBe(name);
  });

  it('integerSettings_plainDecimalDigits_areAccepted_zeroStillTurnsStandbysMigrationAndThePoolOff', () => {
    const c = compileAgentConfig({ ...base, FF_STANDBY_MAX: '0', FF_MIGRATE_MAX_CHILDREN: '0', FF_RAM_POOL: '0', FF_CAPACITY_VCPUS: '032', FF_RAM_POOL_MIB: '256, 512' });
    expect(c).toMatchObject({ migrateMaxChildren: 0, capacity: { vcpus: 32 } });
    expect(c.standby.max).toBe(0);
    expect(c.ram).toMatchObject({ keep: 0, prefillMib: [256, 512] });
  });

  it('ramPoolMib_emptyItem_isRefusedNamingTheVariable', () => {
    for (const v of ['256,,512', '256,', ' ']) expect(fieldOf(() => compileAgentConfig({ ...base, FF_RAM_POOL_MIB: v })), v).toBe('FF_RAM_POOL_MIB');
  });

  it('ramPoolAndCpuWeight_whenTheirFeatureIsOff_areStillValidated', () => {
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_RAM_MOUNT: '', FF_RAM_POOL: '' }))).toBe('FF_RAM_POOL');
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_GUEST_CGROUP: '', FF_GUEST_CPU_WEIGHT: 'x' }))).toBe('FF_GUEST_CPU_WEIGHT');
  });

  it('durationSettings_emptyPaddedOrJunk_areRefusedNamingTheVariable', () => {
    for (const name of DURATIONS) for (const v of ['', ' ', ' 5s', '5s ', '-1s', '1d', '0x10']) expect(fieldOf(() => compileAgentConfig({ ...base, [name]: v })), `${name}=${JSON.stringify(v)}`).toBe(name);
  });

  it('heartbeatInterval_zeroOrUnder100ms_isRefusedNamingTheVariable', () => {
    for (const v of ['0', '0s', '1ms', '99ms']) expect(fieldOf(() => compileAgentConfig({ ...base, FF_HEARTBEAT_INTERVAL: v })), v).toBe('FF_HEARTBEAT_INTERVAL');
    expect(compileAgentConfig({ ...base, FF_HEARTBEAT_INTERVAL: '500ms' }).heartbeatMs).toBe(500);
    expect(compileAgentConfig({ ...base, FF_HEARTBEAT_INTERVAL: '100ms' }).heartbeatMs).toBe(100);
  });

  it('gcGraceAndStandbyIdle_underOneSecond_areRefusedNamingTheVariable', () => {
    for (const name of ['FF_GC_GRACE', 'FF_STANDBY_IDLE']) for (const v of ['0s', '999ms']) expect(fieldOf(() => compileAgentConfig({ ...base, [name]: v })), `${name}=${v}`).toBe(name);
    expect(compileAgentConfig({ ...base, FF_GC_GRACE: '1s' }).gcGraceMs).toBe(1000);
  });

  it('gcIntervalAndJournalRetention_zeroTurnsThemOff_butUnderOneSecondIsRefused', () => {
    expect(compileAgentConfig({ ...base, FF_GC_INTERVAL: '0s', FF_JOURNAL_RETENTION: '0' })).toMatchObject({ gcIntervalMs: 0, journalRetentionMs: 0 });
    for (const name of ['FF_GC_INTERVAL', 'FF_JOURNAL_RETENTION']) for (const v of ['1ms', '500ms']) expect(fieldOf(() => compileAgentConfig({ ...base, [name]: v })), `${name}=${v}`).toBe(name);
    // Shorter than the work stream keeps a message (24 h), a redelivered step could run twice.
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_JOURNAL_RETENTION: '23h' }))).toBe('FF_JOURNAL_RETENTION');
    expect(compileAgentConfig({ ...base, FF_JOURNAL_RETENTION: '24h' }).journalRetentionMs).toBe(24 * 3_600_000);
  });

  it('incomingStandbyQuiet_zeroMeansAtOnce_andIsAccepted', () => {
    expect(compileAgentConfig({ ...base, FF_INCOMING_STANDBY_QUIET: '0s' }).standby.incomingQuietMs).toBe(0);
  });

  it('timerDurations_longerThanNodeTimersTake_areRefusedNamingTheVariable', () => {
    for (const name of ['FF_HEARTBEAT_INTERVAL', 'FF_GC_INTERVAL', 'FF_INCOMING_STANDBY_QUIET']) expect(fieldOf(() => compileAgentConfig({ ...base, [name]: '600h' })), name).toBe(name);
    expect(compileAgentConfig({ ...base, FF_JOURNAL_RETENTION: '720h' }).journalRetentionMs).toBe(720 * 3_600_000);
  });

  it('peerAddr_portAbove65535OrNotHostPort_isRefused_portZeroPicksOne', () => {
    for (const v of ['0.0.0.0:99999', '0.0.0.0:65536', '10.0.0.1', ':7800', '10.0.0.1:', 'a b:1', '10.0.0.1:78x', '']) expect(fieldOf(() => compileAgentConfig({ ...base, FF_PEER_ADDR: v })), v).toBe('FF_PEER_ADDR');
    expect(compileAgentConfig({ ...base, FF_PEER_ADDR: '0.0.0.0:0' }).peerAddr).toBe('0.0.0.0:0');
    expect(compileAgentConfig({ ...base, FF_PEER_ADDR: '10.0.0.1:65535' }).peerAddr).toBe('10.0.0.1:65535');
  });

  it('peerAdvertise_emptyMeansTheBoundAddress_elseHostPortWithANonZeroPort', () => {
    expect(compileAgentConfig({ ...base, FF_PEER_ADVERTISE: '' }).peerAdvertise).toBe('');
    expect(compileAgentConfig({ ...base, FF_PEER_ADVERTISE: '10.0.0.1:7800' }).peerAdvertise).toBe('10.0.0.1:7800');
    for (const v of ['10.0.0.1:0', '10.0.0.1:70000', '10.0.0.1', ' ']) expect(fieldOf(() => compileAgentConfig({ ...base, FF_PEER_ADVERTISE: v })), v).toBe('FF_PEER_ADVERTISE');
  });

  it('logLevel_notAPinoLevel_isRefusedNamingTheVariable', () => {
    for (const v of ['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent']) expect(compileAgentConfig({ ...base, FF_LOG_LEVEL: v }).logLevel).toBe(v);
    for (const v of ['verbose', 'INFO', 'warning', '', ' info']) expect(fieldOf(() => compileAgentConfig({ ...base, FF_LOG_LEVEL: v })), v).toBe('FF_LOG_LEVEL');
  });

  it('dataDirAndTrustedKey_emptyOrWhitespace_areRefusedNamingTheVariable', () => {
    for (const v of ['', '  ']) {
      expect(fieldOf(() => compileAgentConfig({ ...base, FF_DATA_DIR: v }))).toBe('FF_DATA_DIR');
      expect(fieldOf(() => compileAgentConfig({ ...base, FF_TRUSTED_KEY: v }))).toBe('FF_TRUSTED_KEY');
    }
  });
});

describe('sandboxDenyCidrs', () => {
  it('addsTheNatsServersByAddress_toTheOperatorsDenyList_once', () => {
    const deny = (natsUrl: string, cidrs: string[]) => sandboxDenyCidrs({ natsUrl, egress: { pool: '100.96.0.0/16', denyCidrs: cidrs } });
    expect(deny('tls://10.0.0.11:4222,tls://10.0.0.12:4222,nats://nats.internal:4222', ['10.0.1.0/24'])).toEqual(['10.0.1.0/24', '10.0.0.11/32', '10.0.0.12/32']);
    expect(deny('nats://10.0.0.11:4222', ['10.0.0.11/32'])).toEqual(['10.0.0.11/32']);
    expect(deny('nats://user:pw@10.0.0.9:4222', [])).toEqual(['10.0.0.9/32']);
  });
});
