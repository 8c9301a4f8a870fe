// TLS and bearer tokens for tests that start schedulers: a dev CA and server certificate
// (deploy/pki) and a tokens file with an admin token, made once per directory (idempotent),
// plus clients that use them.
import { existsSync, readFileSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import type { ClientOptions } from '@grpc/grpc-js';
import type { GenService, GenServiceMethods } from '@bufbuild/protobuf/codegenv2';
import { ensureDevPki } from '../../deploy/pki/pki.ts';
import { mintToken } from '../auth/tokens.ts';
import type { MintOptions } from '../auth/tokens.ts';
import { createClient } from '../adapters/grpc/rpc.ts';
import type { Client } from '../adapters/grpc/rpc.ts';
import { fleetChannelCredentials, fleetChannelOptions } from '../adapters/grpc/tls.ts';

export interface TestCredentials {
  readonly caPath: string;
  readonly caPem: Buffer;
  readonly tokensFile: string;
  /** Admin token of tenant 'admin' (acts for any tenant; rate 100k/s, so benchmarks are not throttled). */
  readonly adminToken: string;
  /** FF_TLS_CERT, FF_TLS_KEY, FF_TLS_CA and FF_TOKENS_FILE for a scheduler. */
  readonly env: Record<string, string>;
  /** Raw options for compileSchedulerConfig. */
  readonly config: { tlsCertPath: string; tlsKeyPath: string; tlsCaPath: string; tokensFile: string };
  /** Adds a token to the tokens file (the scheduler picks it up within a second) and returns it. */
  mint(o: MintOptions): string;
  /** A TLS client of `service` at `address` sending `token` (default: the admin token; '' sends none). */
  client<S extends GenServiceMethods>(service: GenService<S>, address: string, token?: string, options?: ClientOptions): Client<S>;
}

export function testCredentials(dir: string): TestCredentials {
  const pki = ensureDevPki(join(dir, 'pki'));
  const tokensFile = join(dir, 'tokens.json');
  const adminPath = join(dir, 'admin.token');
  if (!existsSync(adminPath) || !existsSync(tokensFile)) writeFileSync(adminPath, mintToken(tokensFile, { tenant: 'admin', admin: true, name: 'test-admin', rate: { per_s: 100_000, burst: 100_000 } }), { mode: 0o600 });
  const adminToken = readFileSync(adminPath, 'utf8').trim();
  const caPem = readFileSync(pki.caCert);
  const config = { tlsCertPath: pki.serverCert, tlsKeyPath: pki.serverKey, tlsCaPath: pki.caCert, tokensFile };
  return {
    caPath: pki.caCert,
    caPem,
    tokensFile,
    adminToken,
    env: { FF_TLS_CERT: pki.serverCert, FF_TLS_KEY: pki.serverKey, FF_TLS_CA: pki.caCert, FF_TOKENS_FILE: tokensFile },
    config,
    mint: (o) => mintToken(tokensFile, o),
    client: (service, address, token = adminToken, options = {}) =>
      createClient(service, address, fleetChannelCredentials({ caPem, token: token || undefined }), fleetChannelOptions(address, options)),
  };
}
