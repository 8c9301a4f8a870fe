// TLS and bearer-token credentials for the Fleet API's gRPC channels.
import { Metadata, ServerCredentials, credentials as grpcCredentials } from '@grpc/grpc-js';
import type { ChannelCredentials, ClientOptions } from '@grpc/grpc-js';
import { isIP } from 'node:net';

/** TLS to the scheduler, trusting `caPem` (system roots when undefined), sending `token` on every call. */
export function fleetChannelCredentials(o: { caPem?: Buffer | undefined; token?: string | undefined }): ChannelCredentials {
  const tls = grpcCredentials.createSsl(o.caPem ?? null);
  const { token } = o;
  if (!token) return tls;
  const bearer = grpcCredentials.createFromMetadataGenerator((_params, cb) => {
    const md = new Metadata();
    md.set('authorization', `Bearer ${token}`);
    cb(null, md);
  });
  return grpcCredentials.combineChannelCredentials(tls, bearer);
}

/**
 * Channel options for a target. The server's certificate is checked against the target's
 * host name; a target that is an IP address or a comma list (`ipv4:a:1,b:2`) is checked
 * against `serverName` (default FF_TLS_SERVER_NAME, else `localhost`, a SAN of the dev
 * certificate from deploy/pki): node refuses IP addresses as TLS server names (RFC 6066)
 * and a list has no single name.
 *
 * Also: answers up to CLIENT_MAX_RECEIVE_BYTES (the server sends up to FF_GRPC_MAX_SEND,
 * 16 MiB by default; grpc-js's own limit is 4 MiB, which a page of 100 large forks passes),
 * and keepalive pings while calls are open, so that a scheduler that vanished (powered off,
 * cut off) fails an exec or a watch within ~30 s instead of leaving it waiting forever.
 */
export function fleetChannelOptions(target: string, over: ClientOptions = {}, serverName = process.env.FF_TLS_SERVER_NAME): ClientOptions {
  const host = target.startsWith('ipv4:') || target.startsWith('ipv6:') ? '' : target.replace(/:\d+$/, '').replace(/^\[(.*)\]$/, '$1');
  const name = host === '' || isIP(host) !== 0 ? (serverName ?? 'localhost') : undefined;
  return {
    ...(name ? { 'grpc.ssl_target_name_override': name, 'grpc.default_authority': name } : {}),
    'grpc.max_receive_message_length': CLIENT_MAX_RECEIVE_BYTES,
    'grpc.keepalive_time_ms': 20_000,
    'grpc.keepalive_timeout_ms': 10_000,
    ...over,
  };
}

/** The largest answer a Fleet API client takes (the server's FF_GRPC_MAX_SEND can be raised up to this). */
export const CLIENT_MAX_RECEIVE_BYTES = 64 * 1024 * 1024;

export function fleetServerCredentials(o: { certPem: Buffer; keyPem: Buffer }): ServerCredentials {
  return ServerCredentials.createSsl(null, [{ cert_chain: o.certPem, private_key: o.keyPem }], false);
}
