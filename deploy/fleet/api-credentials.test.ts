import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { apiCredentialPaths, fleetDashboardTenants, makeApiCredentials } from './api-credentials.ts';
import { parseTokensFile, sha256 } from '../../services/auth/tokens.ts';

const dirs: string[] = [];
afterEach(() => {
  for (const d of dirs.splice(0)) rmSync(d, { recursive: true, force: true });
});

describe('fleetDashboardTenants', () => {
  it('default_includesTheTenantOfEveryCredentialFile', () => {
    const dir = mkdtempSync(join(tmpdir(), 'ff-api-creds-'));
    dirs.push(dir);
    makeApiCredentials(dir);
    const p = apiCredentialPaths(dir);
    const entries = parseTokensFile(readFileSync(p.tokensFile, 'utf8'));
    const shown = fleetDashboardTenants({}).split(',');
    for (const file of [p.credentials, p.devCredentials]) {
      const { token } = JSON.parse(readFileSync(file, 'utf8')) as { token: string };
      // A request naming no tenant acts as its credential's: the sandboxes `sandbox create` makes.
      const tenant = entries.find((e) => e.digest.equals(sha256(token)))?.tenant;
      expect(tenant).toBeDefined();
      expect(shown).toContain(tenant);
    }
  });

  it('whenFF_DASHBOARD_TENANTSSet_takesIt', () => {
    expect(fleetDashboardTenants({ FF_DASHBOARD_TENANTS: 'acme' })).toBe('acme');
  });
});
