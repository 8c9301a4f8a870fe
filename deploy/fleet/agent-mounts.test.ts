// What a local fleet's agent sees of the fleet directory: its mount namespace's commands
// (agentMountCommands) run here in a private mount namespace of their own (unshare -m, as
// root), over a staged fleet directory; nothing is mounted outside it.
import { spawnSync } from 'node:child_process';
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { AGENT_HIDDEN_DIRS, AGENT_HIDDEN_FILES, AGENT_VISIBLE_ENTRIES, agentEnv, agentMountCommands, defaultOptions, FLEET_ENTRIES, peerCertFiles, shQuote } from './fleet.ts';
import type { FleetState, HostRecord } from './fleet.ts';

const tmp = mkdtempSync(join(tmpdir(), 'ff-agent-mounts-'));
afterAll(() => rmSync(tmp, { recursive: true, force: true }));

const canMount = process.getuid?.() === 0 && spawnSync('unshare', ['-m', '--propagation', 'private', 'true']).status === 0;

describe('an agent\'s view of the fleet directory', () => {
  it('everyFleetEntry_isEitherHiddenFromAgentsOrNamedAsVisible', () => {
    const hidden = [...AGENT_HIDDEN_DIRS, ...AGENT_HIDDEN_FILES];
    for (const e of FLEET_ENTRIES) expect([e, hidden.includes(e) !== AGENT_VISIBLE_ENTRIES.has(e)]).toEqual([e, true]);
    for (const e of hidden) expect(FLEET_ENTRIES.has(e)).toBe(true);
  });

  it.skipIf(!canMount)('agentMountCommands_hideTheSigningKeyCredentialsControlPlaneDataAndOtherHosts_butNotWhatTheAgentReads', () => {
    // A directory name the script must quote.
    const dir = join(tmp, 'fleet $x `y` "z"');
    const host = (id: string, i: number): HostRecord => ({ id, netns: `ffl-${id}`, address: `10.213.77.${11 + i}`, dataDir: join(dir, 'hosts', id), ifHost: `ffl${id}a`, ifBridge: `ffl${id}b` });
    const [h1, h2] = [host('h1', 0), host('h2', 1)];
    const state: FleetState = {
      version: 1, startedAt: new Date().toISOString(), options: defaultOptions({ dir, hosts: 2, hostMemoryMib: 1024 }), apiAddresses: [], metricsAddresses: [], etcdEndpoints: [], natsUrl: '', natsMonitor: '',
      netnsBridge: '', namespaces: [], hosts: [h1, h2], procs: [], signingKey: join(dir, 'keys', 'signing.pem'), trustedKey: join(dir, 'keys', 'signing.pem.pub'), guestCgroup: '',
    };
    const peer = peerCertFiles(h1);
    const env = agentEnv(state, h1, { FF_PEER_CA: peer.ca, FF_PEER_CERT: peer.cert, FF_PEER_KEY: peer.key });
    // As up leaves it once the agents are started (startAgent copies the public key into the host's directory).
    const secrets = ['keys/signing.pem', 'keys/tokens.json', 'pki/ca.key', 'pki/server.key', 'nats-keys/scheduler.nk', 'nats-keys/nats.conf', 'etcd/etcd-1/member/snap/db', 'nats/jetstream/x', 'logs/scheduler-1.log', 'credentials.json', 'dev-credentials.json', 'hosts/h2/nats.nk', 'hosts/h2/peer.key'].map((f) => join(dir, f));
    const own = ['hosts/h1/nats.nk', 'hosts/h1/trusted.pem', 'hosts/h1/peer-ca.crt', 'hosts/h1/peer.crt', 'hosts/h1/peer.key', 'hosts/h1/vmm/journal'].map((f) => join(dir, f));
    for (const f of [...secrets, ...own, join(dir, 'keys', 'signing.pem.pub'), join(dir, 'state.json')]) {
      mkdirSync(dirname(f), { recursive: true });
      writeFileSync(f, `${f}\n`);
    }
    mkdirSync(join(dir, '.own-h1'));
    // Every file the agent's environment names inside the fleet directory: all in its own.
    const named = Object.values(env).filter((v) => v.startsWith(`${dir}/`));
    expect(named.sort()).toEqual([h1.dataDir, ...own.slice(0, 5)].sort());

    const readable = (paths: string[]): string => paths.map((p) => `if [ -s ${shQuote(p)} ] || [ -d ${shQuote(p)} ]; then printf 'R %s\\n' ${shQuote(p)}; else printf -- '- %s\\n' ${shQuote(p)}; fi`).join('; ');
    const all = [...secrets, ...own, ...named, join(dir, 'state.json')];
    const script = ['set -e', ...agentMountCommands(dir, h1.dataDir, join(dir, '.own-h1')), readable(all), `echo written > ${shQuote(join(h1.dataDir, 'new'))}`].join('; ');
    const r = spawnSync('unshare', ['-m', '--propagation', 'private', 'sh', '-c', script], { encoding: 'utf8' });
    expect(r.stderr).toBe('');
    const seen = new Map(r.stdout.trim().split('\n').map((l) => [l.slice(2), l[0] === 'R'] as const));
    expect(secrets.filter((f) => seen.get(f) !== false)).toEqual([]);
    expect([...own, ...named, join(dir, 'state.json')].filter((f) => seen.get(f) !== true)).toEqual([]);
    // The agent's own directory is the real one (what it writes stays), and nothing leaked out of the namespace.
    expect(readFileSync(join(h1.dataDir, 'new'), 'utf8')).toBe('written\n');
    expect(readFileSync(join(dir, 'keys', 'signing.pem'), 'utf8')).toBe(`${join(dir, 'keys', 'signing.pem')}\n`);
    expect(spawnSync('findmnt', ['-rn', '-o', 'TARGET'], { encoding: 'utf8' }).stdout).not.toContain(tmp);
  });
});
