// The local fleet's API credentials (issue #9): a dev CA and the schedulers' TLS certificate
// (deploy/pki), a tokens file of hashes, and two client credential files:
//   <dir>/pki/{ca.crt,ca.key,server.crt,server.key}
//   <dir>/keys/tokens.json      FF_TOKENS_FILE of the schedulers: SHA-256 digests only
//   <dir>/credentials.json      admin token + CA: what `npm run forkfleet`, fleet:status and the
//                               SDK find by default (services/auth/client-credentials.ts)
//   <dir>/dev-credentials.json  a token of tenant `dev` (with quotas): FF_CREDENTIALS=<that file>
// Tokens are minted afresh on every `up`. `down` removes pki/ with the rest, so the next
// `up` makes a new CA too: clients must re-read ca.crt (the CLI and SDK do, from the files).
import { mkdirSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { ensureDevPki } from '../pki/pki.ts';
import { mintToken } from '../../services/auth/tokens.ts';
import type { FleetService } from '../../proto/gen/forkfleet/v1/fleet_pb.ts';
import type { Client } from '../../services/adapters/grpc/rpc.ts';

export const DEV_TENANT = 'dev';
/**
 * The tenant of credentials.json's admin token. A request that names no tenant acts as its
 * credential's (services/auth/guard.ts), so what the Quick Start's CLI and SDK create is this tenant's.
 */
export const ADMIN_TENANT = 'admin';

/**
 * FF_DASHBOARD_TENANTS of the fleet's schedulers: `env`'s when set, else the tenants of the
 * fleet's credential files (admin, dev) and of the examples (default, demo). The dashboard
 * lists only these, so without the admin tenant it left out every sandbox the CLI made.
 */
export function fleetDashboardTenants(env: NodeJS.ProcessEnv = process.env): string {
  return env.FF_DASHBOARD_TENANTS ?? [ADMIN_TENANT, 'default', 'demo', DEV_TENANT].join(',');
}

export function apiCredentialPaths(dir: string): { pki: string; caCert: string; serverCert: string; serverKey: string; tokensFile: string; credentials: string; devCredentials: string } {
  const pki = join(dir, 'pki');
  return {
    pki,
    caCert: join(pki, 'ca.crt'),
    serverCert: join(pki, 'server.crt'),
    serverKey: join(pki, 'server.key'),
    tokensFile: join(dir, 'keys', 'tokens.json'),
    credentials: join(dir, 'credentials.json'),
    devCredentials: join(dir, 'dev-credentials.json'),
  };
}

export function makeApiCredentials(dir: string): void {
  const p = apiCredentialPaths(dir);
  ensureDevPki(p.pki);
  mkdirSync(join(dir, 'keys'), { recursive: true, mode: 0o700 });
  rmSync(p.tokensFile, { force: true });
  // The admin's rate is high so load tests are not throttled; the dev tenant gets the default rate.
  const admin = mintToken(p.tokensFile, { tenant: ADMIN_TENANT, admin: true, name: 'fleet-admin', rate: { per_s: 10_000, burst: 20_000 } });
  const dev = mintToken(p.tokensFile, { tenant: DEV_TENANT, name: 'fleet-dev', quotas: { sandboxes: 200, memory_mib: 262_144, snapshot_bytes: 200 * 2 ** 30 } });
  writeFileSync(p.credentials, `${JSON.stringify({ token: admin, ca: 'pki/ca.crt' }, null, 2)}\n`, { mode: 0o600 });
  writeFileSync(p.devCredentials, `${JSON.stringify({ token: dev, ca: 'pki/ca.crt', tenant: DEV_TENANT }, null, 2)}\n`, { mode: 0o600 });
}

/** FF_TLS_* and FF_TOKENS_FILE for a scheduler of the fleet in `dir`. */
export function schedulerApiEnv(dir: string): Record<string, string> {
  const p = apiCredentialPaths(dir);
  return { FF_TLS_CERT: p.serverCert, FF_TLS_KEY: p.serverKey, FF_TLS_CA: p.caCert, FF_TOKENS_FILE: p.tokensFile };
}

/** An admin client of the fleet's API at `address` (grpc-js loaded only when called). */
export async function fleetApiClient(dir: string, address: string): Promise<Client<(typeof FleetService)['method']>> {
  const [{ createClient }, { fleetChannelCredentials, fleetChannelOptions }, { resolveClientCredentials }, { FleetService: service }] = await Promise.all([
    import('../../services/adapters/grpc/rpc.ts'),
    import('../../services/adapters/grpc/tls.ts'),
    import('../../services/auth/client-credentials.ts'),
    import('../../proto/gen/forkfleet/v1/fleet_pb.ts'),
  ]);
  const creds = resolveClientCredentials({ credentialsFile: apiCredentialPaths(dir).credentials }, {});
  return createClient(service, address, fleetChannelCredentials(creds), fleetChannelOptions(address));
}
