import { describe, expect, it } from 'vitest';
import { compileSchedulerConfig, MAX_TIMER_MS, parseBytes, parseDuration, readTlsClientFiles } from './config.ts';
import { fieldOf } from './testkit/fields.ts';
import { defaultApi } from './cli/hints.ts';

const tls = { FF_TLS_CERT: '/c.crt', FF_TLS_KEY: '/c.key', FF_TOKENS_FILE: '/t.json' };

describe('compileSchedulerConfig: NATS', () => {
  it('natsUrl_takesTheServersOfACluster_andStreamReplicasDefaultToOne', () => {
    const c = compileSchedulerConfig({}, { ...tls, FF_NATS_URL: 'nats://10.0.0.1:4222,nats://10.0.0.2:4222', FF_NATS_STREAM_REPLICAS: '3' });
    expect(c).toMatchObject({ natsUrl: 'nats://10.0.0.1:4222,nats://10.0.0.2:4222', natsStreamReplicas: 3 });
    expect(compileSchedulerConfig({}, tls).natsStreamReplicas).toBe(1);
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_NATS_URL: 'nats://a:4222,http://b' }))).toBe('FF_NATS_URL');
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_NATS_STREAM_REPLICAS: '6' }))).toBe('FF_NATS_STREAM_REPLICAS');
  });
});

describe('compileSchedulerConfig: control-plane TLS', () => {
  const https = { ...tls, FF_ETCD_ENDPOINTS: 'https://10.0.0.1:2379,https://10.0.0.2:2379' };

  it('etcdAndNatsTls_unset_areOff_asBefore', () => {
    expect(compileSchedulerConfig({}, tls)).toMatchObject({ etcdEndpoints: ['http://127.0.0.1:2379'], etcdTls: undefined, natsUrl: 'nats://127.0.0.1:4222', natsTls: undefined });
  });

  it('etcdTls_caAlone_verifiesTheServer_certAndKey_addAClientCertificate_httpsAlone_usesTheSystemRoots', () => {
    expect(compileSchedulerConfig({}, { ...https, FF_ETCD_CA: '/e/ca.crt' }).etcdTls).toEqual({ prefix: 'FF_ETCD', ca: '/e/ca.crt', cert: '', key: '' });
    expect(compileSchedulerConfig({}, { ...https, FF_ETCD_CA: '/e/ca.crt', FF_ETCD_CERT: '/e/c.crt', FF_ETCD_KEY: '/e/c.key' }).etcdTls).toEqual({ prefix: 'FF_ETCD', ca: '/e/ca.crt', cert: '/e/c.crt', key: '/e/c.key' });
    expect(compileSchedulerConfig({}, https).etcdTls).toEqual({ prefix: 'FF_ETCD', ca: '', cert: '', key: '' });
  });

  it('etcdTls_whenCertLacksKeyOrKeyLacksCertOrEndpointIsPlainHttp_namesTheVariable', () => {
    expect(fieldOf(() => compileSchedulerConfig({}, { ...https, FF_ETCD_CERT: '/e/c.crt' }))).toBe('FF_ETCD_KEY');
    expect(fieldOf(() => compileSchedulerConfig({}, { ...https, FF_ETCD_KEY: '/e/c.key' }))).toBe('FF_ETCD_CERT');
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_ETCD_CA: '/e/ca.crt' }))).toBe('FF_ETCD_ENDPOINTS');
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_ETCD_ENDPOINTS: 'http://10.0.0.1:2379', FF_ETCD_CERT: '/e/c.crt', FF_ETCD_KEY: '/e/c.key' }))).toBe('FF_ETCD_ENDPOINTS');
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_ETCD_ENDPOINTS: 'https://10.0.0.1:2379,http://10.0.0.2:2379' }))).toBe('FF_ETCD_ENDPOINTS');
  });

  it('etcdServerName_isADnsNameUsedOnlyWithTls_elseNamesTheVariable', () => {
    expect(compileSchedulerConfig({}, { ...https, FF_ETCD_CA: '/e/ca.crt', FF_ETCD_SERVER_NAME: 'etcd.forkfleet' }).etcdServerName).toBe('etcd.forkfleet');
    expect(compileSchedulerConfig({}, https).etcdServerName).toBe('');
    expect(fieldOf(() => compileSchedulerConfig({}, { ...https, FF_ETCD_SERVER_NAME: '10.0.0.1:2379' }))).toBe('FF_ETCD_SERVER_NAME');
    expect(fieldOf(() => compileSchedulerConfig({}, { ...https, FF_ETCD_SERVER_NAME: 'bad name' }))).toBe('FF_ETCD_SERVER_NAME');
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_ETCD_SERVER_NAME: 'etcd.forkfleet' }))).toBe('FF_ETCD_SERVER_NAME');
  });

  it('natsTls_tlsUrlsOrTheCa_turnItOn_andCertWithoutKeyNamesTheVariable', () => {
    expect(compileSchedulerConfig({}, { ...tls, FF_NATS_URL: 'tls://10.0.0.1:4222,tls://10.0.0.2:4222' }).natsTls).toEqual({ prefix: 'FF_NATS', ca: '', cert: '', key: '' });
    expect(compileSchedulerConfig({}, { ...tls, FF_NATS_CA: '/n/ca.crt' }).natsTls).toEqual({ prefix: 'FF_NATS', ca: '/n/ca.crt', cert: '', key: '' });
    expect(compileSchedulerConfig({}, { ...tls, FF_NATS_URL: 'tls://10.0.0.1:4222', FF_NATS_CA: '/n/ca.crt', FF_NATS_CERT: '/n/c.crt', FF_NATS_KEY: '/n/c.key' }).natsTls).toMatchObject({ cert: '/n/c.crt', key: '/n/c.key' });
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_NATS_CERT: '/n/c.crt' }))).toBe('FF_NATS_KEY');
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_NATS_KEY: '/n/c.key' }))).toBe('FF_NATS_CERT');
  });

  it('readTlsClientFiles_whenAFileIsMissing_namesItsVariable', () => {
    const c = compileSchedulerConfig({}, { ...https, FF_ETCD_CA: '/nonexistent/ca.crt' });
    expect(fieldOf(() => readTlsClientFiles(c.etcdTls!))).toBe('FF_ETCD_CA');
    expect(readTlsClientFiles({ prefix: 'FF_NATS', ca: '', cert: '', key: '' })).toEqual({ ca: undefined, cert: undefined, key: undefined });
  });
});

describe('compileSchedulerConfig: API edge', () => {
  it('withoutTlsOrTokens_failsAtStartupNamingTheVariable', () => {
    expect(fieldOf(() => compileSchedulerConfig({}, {}))).toBe('FF_TLS_CERT');
    expect(fieldOf(() => compileSchedulerConfig({}, { FF_TLS_CERT: '/c.crt' }))).toBe('FF_TLS_KEY');
    expect(fieldOf(() => compileSchedulerConfig({}, { FF_TLS_CERT: '/c.crt', FF_TLS_KEY: '/c.key' }))).toBe('FF_TOKENS_FILE');
  });

  it('limits_haveDefaultsSizedForAFork256Step_andParseFromTheEnvironment', () => {
    const d = compileSchedulerConfig({}, tls);
    expect(d).toMatchObject({ maxRecvBytes: 4 * 1024 * 1024, maxSendBytes: 16 * 1024 * 1024, maxStreamsPerCredential: 512, ratePerSecond: 200, rateBurst: 600, tlsCaPath: '' });
    const c = compileSchedulerConfig({}, { ...tls, FF_GRPC_MAX_RECV: '512KiB', FF_MAX_STREAMS_PER_CREDENTIAL: '3', FF_RATE_PER_S: '0' });
    expect(c).toMatchObject({ maxRecvBytes: 512 * 1024, maxStreamsPerCredential: 3, ratePerSecond: 0 });
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_GRPC_MAX_RECV: '1KiB' }))).toBe('FF_GRPC_MAX_RECV');
    expect(d.fileBufferBytes).toBe(512 * 1024 * 1024);
    expect(compileSchedulerConfig({}, { ...tls, FF_FILE_BUFFER_MAX: '1GiB' }).fileBufferBytes).toBe(1024 * 1024 * 1024);
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_FILE_BUFFER_MAX: '32MiB' }))).toBe('FF_FILE_BUFFER_MAX');
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_MAX_STREAMS_PER_CREDENTIAL: '0' }))).toBe('FF_MAX_STREAMS_PER_CREDENTIAL');
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_RATE_BURST: 'x' }))).toBe('FF_RATE_BURST');
  });

  it('history_defaultsToOneHourRetentionAndFiveMinuteCompaction_zeroTurnsEachOff_andJunkNamesTheVariable', () => {
    expect(compileSchedulerConfig({}, tls)).toMatchObject({ recordRetentionMs: 3_600_000, etcdCompactIntervalMs: 300_000 });
    expect(compileSchedulerConfig({}, { ...tls, FF_RECORD_RETENTION: '0s', FF_ETCD_COMPACT_INTERVAL: '0s' })).toMatchObject({ recordRetentionMs: 0, etcdCompactIntervalMs: 0 });
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_RECORD_RETENTION: '10ms' }))).toBe('FF_RECORD_RETENTION');
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_ETCD_COMPACT_INTERVAL: 'often' }))).toBe('FF_ETCD_COMPACT_INTERVAL');
  });

  it('forkSnapshotTtl_defaultsToOneDay_zeroKeepsThem_andJunkNamesTheVariable', () => {
    expect(compileSchedulerConfig({}, tls).forkSnapshotTtlMs).toBe(86_400_000);
    expect(compileSchedulerConfig({}, { ...tls, FF_FORK_SNAPSHOT_TTL: '0s' }).forkSnapshotTtlMs).toBe(0);
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_FORK_SNAPSHOT_TTL: '10ms' }))).toBe('FF_FORK_SNAPSHOT_TTL');
  });

  it('heldSnapshotCheck_defaultsToThirtySeconds_andUnderOneSecondNamesTheVariable', () => {
    expect(compileSchedulerConfig({}, tls).heldSnapshotCheckMs).toBe(30_000);
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_HELD_SNAPSHOT_CHECK: '100ms' }))).toBe('FF_HELD_SNAPSHOT_CHECK');
  });

  it('strayVmGrace_defaultsToZeroMeaningDerived_andUnderOneSecondNamesTheVariable', () => {
    expect(compileSchedulerConfig({}, tls).strayVmGraceMs).toBe(0);
    expect(compileSchedulerConfig({}, { ...tls, FF_STRAY_VM_GRACE: '2s' }).strayVmGraceMs).toBe(2000);
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_STRAY_VM_GRACE: '10ms' }))).toBe('FF_STRAY_VM_GRACE');
  });

  it('parseBytes_acceptsUnitsAndRejectsJunk', () => {
    expect(parseBytes('f', '4MiB')).toBe(4 * 1024 * 1024);
    expect(parseBytes('f', '100')).toBe(100);
    expect(fieldOf(() => parseBytes('f', '4 MB'))).toBe('f');
  });
});

describe('compileSchedulerConfig: value rules', () => {
  // Each integer setting with a value it accepts (so a refusal below is the spelling's, not the range's).
  const INTEGERS: Record<string, string> = { FF_NATS_STREAM_REPLICAS: '3', FF_STEP_ATTEMPTS: '16', FF_CHUNK_BYTES: '4096', FF_MIGRATE_MAX_CHILDREN: '16', FF_MAX_STREAMS_PER_CREDENTIAL: '16', FF_RATE_BURST: '16' };
  const DURATIONS = ['FF_HOST_SUSPECT_AFTER', 'FF_HOST_LOST_AFTER', 'FF_STEP_TIMEOUT', 'FF_STRAY_VM_GRACE', 'FF_ELECTION_TTL', 'FF_SNAPSHOT_EXPIRY_NOTICE', 'FF_WEBHOOK_RETRY_BASE', 'FF_RECORD_RETENTION', 'FF_FORK_SNAPSHOT_TTL', 'FF_ETCD_COMPACT_INTERVAL', 'FF_HELD_SNAPSHOT_CHECK'];

  it('defaults_areUnchanged', () => {
    expect(compileSchedulerConfig({}, tls)).toMatchObject({
      grpcAddr: '127.0.0.1:17700', metricsAddr: '', logLevel: 'info', natsStreamReplicas: 1, suspectAfterMs: 5000, lostAfterMs: 30_000, stepTimeoutMs: 180_000, stepAttempts: 3, strayVmGraceMs: 0,
      chunkBytes: 256 * 1024, migrateMaxChildren: 2, electionTtlSeconds: 2, ratePerSecond: 200, rateBurst: 600, expiryNoticeMs: 600_000, webhookRetryBaseMs: 1000, heldSnapshotCheckMs: 30_000,
    });
  });

  it('grpcAddr_default_isWhereTheCliLooksWithoutApiOrFleet', () => {
    expect(compileSchedulerConfig({}, tls).grpcAddr).toBe(defaultApi({ FF_FLEET_DIR: '/nonexistent/ffleet' }));
  });

  it('rateAndMigrateMax_emptyOrWhitespace_areRefusedNamingTheVariable_notTurnedOff', () => {
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_RATE_PER_S: '' }))).toBe('FF_RATE_PER_S');
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_MIGRATE_MAX_CHILDREN: ' ' }))).toBe('FF_MIGRATE_MAX_CHILDREN');
  });

  it('integerSettings_emptyOrWhitespace_areRefusedNamingTheVariable', () => {
    for (const name of Object.keys(INTEGERS)) for (const v of ['', ' ', '\t']) expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, [name]: v })), `${name}=${JSON.stringify(v)}`).toBe(name);
  });

  it('integerSettings_hexExponentSignDecimalPointOrPadding_areRefusedNamingTheVariable', () => {
    for (const [name, ok] of Object.entries(INTEGERS)) {
      expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, [name]: ok })), `${name}=${ok}`).toBeUndefined();
      for (const v of [`0x${Number(ok).toString(16)}`, `${ok}e0`, `+${ok}`, `${ok}.0`, ` ${ok}`, `${ok} `]) expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, [name]: v })), `${name}=${JSON.stringify(v)}`).toBe(name);
    }
  });

  it('chunkBytes_isBoundedAsTheAgentsSetting', () => {
    expect(compileSchedulerConfig({}, { ...tls, FF_CHUNK_BYTES: String(4 << 20) }).chunkBytes).toBe(4 << 20);
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_CHUNK_BYTES: String((4 << 20) + 1) }))).toBe('FF_CHUNK_BYTES');
  });

  it('ratePerSecond_isADecimalNumber_zeroTurnsTheDefaultLimitOff_hexExponentOrPaddingIsRefused', () => {
    expect(compileSchedulerConfig({}, { ...tls, FF_RATE_PER_S: '0.5' }).ratePerSecond).toBe(0.5);
    expect(compileSchedulerConfig({}, { ...tls, FF_RATE_PER_S: '0' }).ratePerSecond).toBe(0);
    for (const v of ['0x10', '1e3', ' 5', '5 ', '-1', '.5', 'Infinity']) expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_RATE_PER_S: v })), v).toBe('FF_RATE_PER_S');
  });

  it('durationSettings_emptyPaddedOrJunk_areRefusedNamingTheVariable', () => {
    for (const name of DURATIONS) for (const v of ['', ' ', ' 5s', '5s ', '-1s', '1d']) expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, [name]: v })), `${name}=${JSON.stringify(v)}`).toBe(name);
    expect(fieldOf(() => parseDuration('f', '99999999999999999999h'))).toBe('f');
  });

  it('stepTimeoutAndHostSuspectAfter_zeroOrUnderOneSecond_areRefusedNamingTheVariable', () => {
    for (const name of ['FF_STEP_TIMEOUT', 'FF_HOST_SUSPECT_AFTER']) for (const v of ['0', '0s', '999ms']) expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, [name]: v })), `${name}=${v}`).toBe(name);
    expect(compileSchedulerConfig({}, { ...tls, FF_HOST_SUSPECT_AFTER: '1500ms', FF_HOST_LOST_AFTER: '5s', FF_STEP_TIMEOUT: '5s' })).toMatchObject({ suspectAfterMs: 1500, lostAfterMs: 5000, stepTimeoutMs: 5000 });
  });

  it('rawOptions_areValidatedAsTheVariables_andNameThem', () => {
    expect(fieldOf(() => compileSchedulerConfig({ stepTimeoutMs: '0ms' }, tls))).toBe('FF_STEP_TIMEOUT');
    expect(fieldOf(() => compileSchedulerConfig({ grpcAddr: '127.0.0.1:70000' }, tls))).toBe('FF_GRPC_ADDR');
    expect(compileSchedulerConfig({ grpcAddr: '127.0.0.1:0', metricsAddr: '127.0.0.1:0', maxRecvBytes: '64KiB', maxStreamsPerCredential: '2' }, tls)).toMatchObject({ grpcAddr: '127.0.0.1:0', metricsAddr: '127.0.0.1:0', maxRecvBytes: 65_536, maxStreamsPerCredential: 2 });
  });

  it('hostLostAfter_notLongerThanSuspectAfter_isRefusedNamingIt', () => {
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_HOST_SUSPECT_AFTER: '5s', FF_HOST_LOST_AFTER: '5s' }))).toBe('FF_HOST_LOST_AFTER');
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_HOST_SUSPECT_AFTER: '10s', FF_HOST_LOST_AFTER: '5s' }))).toBe('FF_HOST_LOST_AFTER');
  });

  it('webhookRetryBase_zeroOrUnder100ms_isRefused_expiryNoticeZeroMeansNoNotice', () => {
    for (const v of ['0s', '99ms']) expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_WEBHOOK_RETRY_BASE: v })), v).toBe('FF_WEBHOOK_RETRY_BASE');
    expect(compileSchedulerConfig({}, { ...tls, FF_WEBHOOK_RETRY_BASE: '300ms' }).webhookRetryBaseMs).toBe(300);
    expect(compileSchedulerConfig({}, { ...tls, FF_SNAPSHOT_EXPIRY_NOTICE: '0s' }).expiryNoticeMs).toBe(0);
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_SNAPSHOT_EXPIRY_NOTICE: '10ms' }))).toBe('FF_SNAPSHOT_EXPIRY_NOTICE');
  });

  it('timerDurations_longerThanNodeTimersTake_areRefusedNamingTheVariable', () => {
    for (const name of ['FF_STEP_TIMEOUT', 'FF_HELD_SNAPSHOT_CHECK', 'FF_ETCD_COMPACT_INTERVAL', 'FF_WEBHOOK_RETRY_BASE', 'FF_ELECTION_TTL']) expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, [name]: `${MAX_TIMER_MS + 1}` })), name).toBe(name);
    expect(compileSchedulerConfig({}, { ...tls, FF_STEP_TIMEOUT: `${MAX_TIMER_MS}` }).stepTimeoutMs).toBe(MAX_TIMER_MS);
    expect(compileSchedulerConfig({}, { ...tls, FF_RECORD_RETENTION: '720h', FF_FORK_SNAPSHOT_TTL: '720h' })).toMatchObject({ recordRetentionMs: 720 * 3_600_000, forkSnapshotTtlMs: 720 * 3_600_000 });
  });

  it('grpcAndMetricsAddr_portAbove65535OrNotHostPort_areRefused_portZeroPicksOne', () => {
    for (const name of ['FF_GRPC_ADDR', 'FF_METRICS_ADDR']) {
      for (const v of ['0.0.0.0:99999', '0.0.0.0:65536', '127.0.0.1', ':7700', '127.0.0.1:', ' ', '127.0.0.1:7700 ']) expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, [name]: v })), `${name}=${JSON.stringify(v)}`).toBe(name);
      expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, [name]: '0.0.0.0:0' })), name).toBeUndefined();
      expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, [name]: '10.0.0.1:65535' })), name).toBeUndefined();
    }
    expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_GRPC_ADDR: '' }))).toBe('FF_GRPC_ADDR');
    expect(compileSchedulerConfig({}, { ...tls, FF_METRICS_ADDR: '' }).metricsAddr).toBe('');
  });

  it('logLevel_notAPinoLevel_isRefusedNamingTheVariable', () => {
    for (const v of ['fatal', 'error', 'warn', 'info', 'debug', 'trace', 'silent']) expect(compileSchedulerConfig({}, { ...tls, FF_LOG_LEVEL: v }).logLevel).toBe(v);
    for (const v of ['verbose', 'INFO', 'warning', '', ' info']) expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, FF_LOG_LEVEL: v })), v).toBe('FF_LOG_LEVEL');
  });

  it('requiredPathsAndSchedulerId_whitespaceOnly_areRefusedNamingTheVariable', () => {
    for (const name of ['FF_TLS_CERT', 'FF_TLS_KEY', 'FF_TOKENS_FILE', 'FF_SCHEDULER_ID']) for (const v of ['', '  ']) expect(fieldOf(() => compileSchedulerConfig({}, { ...tls, [name]: v })), `${name}=${JSON.stringify(v)}`).toBe(name);
  });
});
