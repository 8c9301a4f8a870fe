import { createServer } from 'node:net';
import { resolve } from 'node:path';
import { afterEach, describe, expect, it, vi } from 'vitest';
import { checkFleetPortsFree, defaultOptions, fleetPorts, parseCli, upSummary, USAGE, UsageError, validateOptions } from './fleet.ts';

afterEach(() => vi.unstubAllEnvs());

describe('parseCli (fleet.ts arguments)', () => {
  it('upWithInlineValues_takesThem', () => {
    const c = parseCli(['up', '--hosts=5', '--etcd', '3', '--link=1gbit', '--prefix', 'ffq', '--base-port', '18000', '--peer-tls', 'off', '--dir', '/tmp/ffq']);
    expect(c).toMatchObject({ cmd: 'up', opts: { hosts: 5, etcd: 3, link: '1gbit', prefix: 'ffq', basePort: 18000, peerTls: false, dir: '/tmp/ffq' } });
  });

  it('up_withoutFlags_takesTheDefaults', () => {
    vi.stubEnv('FF_FLEET_DIR', '');
    expect(parseCli(['up'])).toMatchObject({ cmd: 'up', opts: { hosts: 3, etcd: 1, link: '10gbit', prefix: 'ffl', basePort: 17700, peerTls: true, dir: '/var/lib/ffleet' } });
  });

  it('unknownFlag_isAnErrorNamingIt', () => {
    expect(() => parseCli(['up', '--host', '3'])).toThrow(UsageError);
    expect(() => parseCli(['up', '--host', '3'])).toThrow(/--host\b/);
  });

  it('flagOfAnotherCommand_isAnErrorNamingIt', () => {
    expect(() => parseCli(['down', '--hosts', '3'])).toThrow(/--hosts: not a flag of down/);
    expect(() => parseCli(['up', '--json'])).toThrow(/--json: not a flag of up/);
  });

  it.each([
    [['up', '--hosts', '2.5'], /--hosts: an integer 1\.\.32, got "2\.5"/],
    [['up', '--hosts', '0'], /--hosts: an integer 1\.\.32/],
    [['up', '--hosts', '33'], /--hosts: an integer 1\.\.32/],
    [['up', '--hosts', '0x10'], /--hosts/],
    [['up', '--hosts='], /--hosts/],
    [['up', '--base-port', 'abc'], /--base-port: an integer 1024\.\.65494, got "abc"/],
    [['up', '--base-port', '65500'], /--base-port/],
    [['up', '--etcd', '2'], /--etcd: 1 or 3/],
    [['up', '--peer-tls', 'yes'], /--peer-tls: on or off/],
    [['up', '--link', 'fast'], /--link/],
    [['up', '--prefix', 'FFL'], /--prefix/],
  ])('badValue_%j_isAnErrorNamingTheFlag', (argv, message) => {
    expect(() => parseCli(argv)).toThrow(message);
  });

  it('missingValue_isAnError', () => {
    expect(() => parseCli(['up', '--hosts'])).toThrow(/--hosts/);
  });

  it('commands_andTheirArguments_areChecked', () => {
    expect(() => parseCli([])).toThrow(/a command/);
    expect(() => parseCli(['start'])).toThrow(/unknown command "start"/);
    expect(() => parseCli(['restart'])).toThrow(/one process name/);
    expect(() => parseCli(['down', 'now'])).toThrow(/unexpected argument "now"/);
    expect(parseCli(['restart', 'agent-h2', '--dir', '/tmp/f'])).toEqual({ cmd: 'restart', dir: '/tmp/f', name: 'agent-h2' });
    expect(parseCli(['status', '--json', '--dir', '/tmp/f'])).toEqual({ cmd: 'status', dir: '/tmp/f', json: true });
    expect(parseCli(['--help'])).toEqual({ cmd: 'help' });
  });

  it('usage_listsEveryFlag', () => {
    for (const flag of ['--hosts', '--etcd', '--link', '--prefix', '--base-port', '--peer-tls', '--json', '--dir', '--help', 'restart NAME']) expect(USAGE).toContain(flag);
  });
});

describe('the fleet directory is absolute', () => {
  it('relativeDirFlag_isResolvedAgainstTheWorkingDirectory', () => {
    expect(parseCli(['down', '--dir', 'tmp/fleet'])).toEqual({ cmd: 'down', dir: resolve('tmp/fleet') });
    expect(parseCli(['up', '--dir', './f'])).toMatchObject({ opts: { dir: resolve('f') } });
  });

  it('relativeFF_FLEET_DIR_isResolvedToo', () => {
    vi.stubEnv('FF_FLEET_DIR', 'rel/fleet');
    expect(defaultOptions().dir).toBe(resolve('rel/fleet'));
    expect(parseCli(['status'])).toMatchObject({ dir: resolve('rel/fleet') });
  });
});

describe('--prefix and the agents\' egress firewall', () => {
  it('prefixStartingWithFfe_isRejectedNamingPrefix', () => {
    // Its links would be ffe*: host-agent/adapters/netns/egress.ts drops all input from those.
    expect(() => validateOptions(defaultOptions({ prefix: 'ffe' }))).toThrow(/--prefix: "ffe" .*ffeh1a.*does not start with ffe/);
    expect(() => parseCli(['up', '--prefix', 'ffeast'])).toThrow(/--prefix/);
  });

  it('otherPrefixes_areAccepted', () => {
    for (const prefix of ['ffl', 'ff', 'f', 'ffx', 'ffh', 'effe']) expect(() => validateOptions(defaultOptions({ prefix, hostMemoryMib: 1024 }))).not.toThrow();
  });
});

describe('the fleet\'s ports, checked before up makes anything', () => {
  it('fleetPorts_areEveryListenerOfTheControlPlane_schedulersIncluded', () => {
    const ports = fleetPorts({ basePort: 17700, etcd: 3 });
    expect(ports.map((p) => p.port).sort((a, b) => a - b)).toEqual([17700, 17701, 17710, 17711, 17720, 17721, 17722, 17730, 17731, 17732, 17740, 17741]);
    expect(ports.find((p) => p.port === 17711)?.what).toBe('scheduler-2 metrics');
    expect(fleetPorts({ basePort: 17700, etcd: 1 })).toHaveLength(8);
  });

  it('checkFleetPortsFree_namesABusySchedulerPort', async () => {
    // An ephemeral port on loopback (not the fleet's range), taken by this test.
    const server = createServer();
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    const port = (server.address() as { port: number }).port;
    try {
      await expect(checkFleetPortsFree({ basePort: port - 10, etcd: 1 })).rejects.toThrow(new RegExp(`ports already in use on 127\\.0\\.0\\.1: (.*, )?${port} \\(scheduler-1 metrics\\).*choose --base-port`));
    } finally {
      await new Promise((r) => server.close(r));
    }
  });
});

describe("what fleet:up prints", () => {
  const state = { hosts: [{ id: 'h1', address: '10.0.0.11' }], apiAddresses: ['127.0.0.1:17700'], metricsAddresses: ['127.0.0.1:17710'] } as never;

  it('forAFleetOutsideTheDefaultDirectory_tellsToExportFF_FLEET_DIR_whichTheCliSdkAndFleetCommandsRead', () => {
    const out = upSummary(state, defaultOptions({ dir: '/tmp/ff-other' }));
    expect(out).toContain('the CLI and SDK find it with FF_FLEET_DIR=/tmp/ff-other');
    expect(out).toContain('export FF_FLEET_DIR=/tmp/ff-other');
  });

  it('forTheDefaultDirectory_namesNoVariable', () => {
    const out = upSummary(state, defaultOptions({ dir: '/var/lib/ffleet' }));
    expect(out).toContain('(admin; the CLI and SDK find it)');
    expect(out).not.toContain('FF_FLEET_DIR');
  });
});
