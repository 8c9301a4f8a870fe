// Durations the SDK sends: whole nanoseconds, and a bad one named before anything is sent.
import { describe, expect, it } from 'vitest';
import { toBinary, create } from '@bufbuild/protobuf';
import { DurationSchema } from '@bufbuild/protobuf/wkt';
import { durationOf, Forkfleet, parseDuration } from './index.ts';
import { ForkfleetError } from '../../proto/errors.ts';

describe('durationOf', () => {
  it('fractionalMilliseconds_becomeWholeNanoseconds_thatEncode', () => {
    for (const v of ['1.005s', '0.1s', '2.5ms', '1h', '0']) {
      const d = durationOf(parseDuration(v));
      expect(Number.isInteger(d.nanos)).toBe(true);
      expect(() => toBinary(DurationSchema, create(DurationSchema, d))).not.toThrow();
    }
    expect(durationOf(parseDuration('1.005s'))).toEqual({ seconds: 1n, nanos: 5_000_000 });
    expect(durationOf(2.5)).toEqual({ seconds: 0n, nanos: 2_500_000 });
  });

  it('negativeOrNotFinite_isAnInvalidArgumentNamingTheField', () => {
    for (const ms of [-1, Number.NaN, Number.POSITIVE_INFINITY]) {
      let e: unknown;
      try {
        durationOf(ms, 'lifecycle.ttl');
      } catch (x) {
        e = x;
      }
      expect(e).toBeInstanceOf(ForkfleetError);
      expect(e).toMatchObject({ kind: 'invalid_argument', field: 'lifecycle.ttl' });
    }
  });

  it('aDurationThatDoesNotParse_isNamedByTheFieldItIsFor', () => {
    expect(() => parseDuration('1d', 'lifecycle.ttl')).toThrow(expect.objectContaining({ kind: 'invalid_argument', field: 'lifecycle.ttl', message: expect.stringMatching(/^lifecycle\.ttl: want a duration/) }));
  });
});

describe('Forkfleet address', () => {
  const make = (address: string): Forkfleet => new Forkfleet({ address, token: 'ff_x', ca: Buffer.from('-----BEGIN CERTIFICATE-----\n') });
  it('aListOfSchedulers_mustBeIpAddressesOfOneFamily_andAListWithAHostNameIsRefusedNamingAddress', () => {
    const ok = [make('127.0.0.1:1,127.0.0.2:1'), make('[::1]:1,[::2]:1'), make('api.example:17700')];
    expect(ok.map((f) => f.address)).toEqual(['ipv4:127.0.0.1:1,127.0.0.2:1', 'ipv6:[::1]:1,[::2]:1', 'api.example:17700']);
    for (const f of ok) f.close();
    for (const bad of ['api1.example:17700,api2.example:17700', '127.0.0.1:1,[::1]:1']) expect(() => make(bad)).toThrow(expect.objectContaining({ kind: 'invalid_argument', field: 'address' }));
  });
});
