// How a host's peer certificate names it (mutual TLS between agents, tls.ts): its CN is
// `forkfleet-host-<host id>`. Kept apart from tls.ts so that deploy/ can issue certificates
// without loading grpc-js.

export const PEER_CN_PREFIX = 'forkfleet-host-';

/** The CN of `hostId`'s peer certificate. */
export const peerCertificateCn = (hostId: string): string => `${PEER_CN_PREFIX}${hostId}`;
