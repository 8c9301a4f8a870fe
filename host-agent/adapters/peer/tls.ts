// Mutual TLS on the peer transfer service (FF_PEER_CA, FF_PEER_CERT, FF_PEER_KEY). Guest
// memory and disks cross the network between hosts; with these set they cross encrypted, and
// each end proves which host it is with a certificate of the fleet's CA:
// - the receiver checks the source's certificate against the address it dialed (IP SAN);
// - the source takes the caller's host id from its certificate's CN
//   (`forkfleet-host-<id>`), not from what the caller says, so a ticket is honoured only for
//   the host it names even if someone else got hold of it.
// Migration streams (ADR 0015) use the same certificate through QEMU (writeQemuTlsDir).
// Without them, both ends speak plain text and the caller's host id is its `ff-host-id`
// metadata (server.ts), as before.
import { chmodSync, mkdirSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { checkServerIdentity } from 'node:tls';
import { ServerCredentials, credentials as grpcCredentials } from '@grpc/grpc-js';
import type { ChannelCredentials, ClientOptions } from '@grpc/grpc-js';
import { hostOfAddress } from '../../domain/agent.ts';
import type { CallContext } from '../../../services/adapters/grpc/rpc.ts';
import { readTlsClientFiles, type TlsClientFiles } from '../../../services/config.ts';
import { PEER_CN_PREFIX } from './peer-identity.ts';

/** PEM contents: the CA peers' certificates must chain to, and this host's certificate and key. */
export interface PeerTls {
  readonly ca: Buffer;
  readonly cert: Buffer;
  readonly key: Buffer;
}

/** The peer TLS files (config.peerTls), read once; a file that cannot be read fails naming its variable. */
export function readPeerTls(files: TlsClientFiles | undefined): PeerTls | undefined {
  if (!files) return undefined;
  const pem = readTlsClientFiles(files);
  if (!pem.ca || !pem.cert || !pem.key) throw new Error('peer TLS needs a CA, a certificate and a key');
  return { ca: pem.ca, cert: pem.cert, key: pem.key };
}

/** Server side: TLS with a required client certificate of the CA; without `tls`, plain text. */
export function peerServerCredentials(tls: PeerTls | undefined): ServerCredentials {
  return tls ? ServerCredentials.createSsl(tls.ca, [{ cert_chain: tls.cert, private_key: tls.key }], true) : ServerCredentials.createInsecure();
}

/**
 * The TLS server name (SNI) a receiver sends. TLS allows only a DNS name there (RFC 6066), and
 * peers are dialed by IP address, so SNI carries this fixed name; the certificate is still
 * checked against the address dialed (its IP SAN), never against this name.
 */
export const PEER_TLS_SERVER_NAME = 'forkfleet-peer';

/** Credentials and channel options for a client of the peer at `address` ("host:port"). */
export interface PeerChannel {
  readonly credentials: ChannelCredentials;
  readonly options: ClientOptions;
}

/**
 * Client side: TLS that verifies the peer against the CA and the address dialed, showing this
 * host's certificate; without `tls`, plain text.
 */
export function peerChannel(tls: PeerTls | undefined, address: string): PeerChannel {
  // Pings while a call is open: a peer that went silent (powered off, cut off) fails its calls
  // within ~30 s instead of leaving an idle stream open for good.
  const keepalive = { 'grpc.keepalive_time_ms': 20_000, 'grpc.keepalive_timeout_ms': 10_000 };
  if (!tls) return { credentials: grpcCredentials.createInsecure(), options: keepalive };
  const dialed = hostOfAddress(address);
  return {
    credentials: grpcCredentials.createSsl(tls.ca, tls.key, tls.cert, { checkServerIdentity: (_sni, cert) => checkServerIdentity(dialed, cert) }),
    options: { ...keepalive, 'grpc.ssl_target_name_override': PEER_TLS_SERVER_NAME },
  };
}

/**
 * The calling host's id from its client certificate's CN (`forkfleet-host-<id>`); '' when
 * the call has no certificate or it names no host (every ticket is then refused).
 */
export function certificateHostId(ctx: CallContext): string {
  const cn = ctx.peerCertificate()?.subject?.CN;
  const name = Array.isArray(cn) ? undefined : cn;
  return name?.startsWith(PEER_CN_PREFIX) ? name.slice(PEER_CN_PREFIX.length) : '';
}

/**
 * Writes `tls` into `dir` in QEMU's tls-creds-x509 layout (the host's one certificate serves
 * as both server and client), for migration streams between hosts (QemuDriverOptions
 * .migrationTlsDir). The directory and the keys are root's alone. Returns `dir`.
 */
export function writeQemuTlsDir(dir: string, tls: PeerTls): string {
  mkdirSync(dir, { recursive: true, mode: 0o700 });
  chmodSync(dir, 0o700);
  const files: Array<[string, Buffer, number]> = [
    ['ca-cert.pem', tls.ca, 0o644],
    ['server-cert.pem', tls.cert, 0o644],
    ['server-key.pem', tls.key, 0o600],
    ['client-cert.pem', tls.cert, 0o644],
    ['client-key.pem', tls.key, 0o600],
  ];
  for (const [name, data, mode] of files) writeFileSync(join(dir, name), data, { mode });
  return dir;
}
