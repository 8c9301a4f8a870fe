import { describe, expect, it } from 'vitest';
import { compileSchedulerConfig, parseBytes, readTlsClientFiles } from './config.ts';
import { fieldOf } from './testkit/fields.ts';

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
