import { describe, expect, it } from 'vitest';
import { fleetChannelOptions } from './tls.ts';

describe('fleetChannelOptions', () => {
  it('ipOrListTargets_areVerifiedAgainstTheServerName_dnsTargetsAgainstThemselves', () => {
    expect(fleetChannelOptions('127.0.0.1:7700', {}, undefined)['grpc.ssl_target_name_override']).toBe('localhost');
    expect(fleetChannelOptions('[::1]:7700', {}, undefined)['grpc.ssl_target_name_override']).toBe('localhost');
    expect(fleetChannelOptions('ipv4:127.0.0.1:1,127.0.0.1:2', {}, 'fleet.example')['grpc.ssl_target_name_override']).toBe('fleet.example');
    expect(fleetChannelOptions('fleet.example:7700', {}, 'other')['grpc.ssl_target_name_override']).toBeUndefined();
    expect(fleetChannelOptions('10.0.0.1:1', { 'grpc.keepalive_time_ms': 5 }, undefined)).toMatchObject({ 'grpc.keepalive_time_ms': 5 });
  });
});
