import { describe, expect, it } from 'vitest';
import { linkGbpsOf, migrationStreamsEncrypted } from './run-env.ts';

describe('run environment', () => {
  it('linkGbpsOf_hostsReportingOneRate_isThatRateInGbits', () => {
    expect(linkGbpsOf([{ linkBytesPerSecond: 1.25e9 }, { linkBytesPerSecond: 1.25e9 }])).toBe(10);
    expect(linkGbpsOf([{ linkBytesPerSecond: 62.5e6 }])).toBe(0.5);
  });

  it('linkGbpsOf_ratesThatDifferOrAreAbsent_isUnknown', () => {
    expect(linkGbpsOf([{ linkBytesPerSecond: 1.25e9 }, { linkBytesPerSecond: 125e6 }])).toBeNull();
    expect(linkGbpsOf([{ linkBytesPerSecond: 0 }, { linkBytesPerSecond: 0 }])).toBeNull();
    expect(linkGbpsOf([])).toBeNull();
  });

  it('migrationStreamsEncrypted_withPeerTls_unlessMigrationTlsIsOff', () => {
    expect(migrationStreamsEncrypted(true, {})).toBe(true);
    expect(migrationStreamsEncrypted(true, { FF_PEER_MIGRATION_TLS: 'qemu' })).toBe(true);
    expect(migrationStreamsEncrypted(true, { FF_PEER_MIGRATION_TLS: 'relay' })).toBe(true);
    expect(migrationStreamsEncrypted(true, { FF_PEER_MIGRATION_TLS: 'off' })).toBe(false);
    expect(migrationStreamsEncrypted(false, {})).toBe(false);
  });
});
