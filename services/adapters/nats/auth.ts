// NATS authentication and authorization (issue #9, control-plane isolation).
//
// Every connection authenticates with an NKey (challenge-response: the server config holds
// only public keys, each client keeps its seed in a 0600 file). The scheduler user has full
// rights. Each host agent's user may use only its own subjects:
//   publish    ff.result.<h>  ff.heartbeat.<h>  ff.event.<h>       (its results, heartbeats, events)
//              ff.execout.<h>.>                                      (exec output streams, to the
//                  scheduler's per-call subject under this host's prefix)
//              $JS.API.INFO, $JS.API.STREAM.INFO.<FF streams>        (read-only checks at start-up)
//              $JS.API.CONSUMER.CREATE.FF_WORK.agent-<h>.ff.work.<h> (its durable consumer; the
//                  filter is part of the subject, so it cannot create a consumer on another
//                  host's work; the server rejects a body whose filter differs from the subject)
//              $JS.API.CONSUMER.INFO|MSG.NEXT.FF_WORK.agent-<h>     (pull its work)
//              $JS.API.CONSUMER.DELETE.FF_WORK.agent-<h>            (make its consumer again when
//                  the server lost its store: ensureWorkConsumer; its work stays in the stream)
//              $JS.ACK.FF_WORK.agent-<h>.>                          (ack / in-progress its work)
//              one reply to each request it received, within 2 min (allow_responses: file relay)
//   subscribe  ff.exec.<h>  ff.execcancel.<h>  ff.execalive.<h>    (its relays, exec cancels and
//              ff.file.<h>                                           keepalives)
//              _INBOX_<h>.>                                          (its own inbox)
// Agents never create streams (the scheduler does; an agent waits for them) and cannot
// create, read or pull another host's consumer. Anything else is a permissions violation.
import { chmodSync, readFileSync, writeFileSync } from 'node:fs';
import type { Socket } from 'node:net';
import { checkServerIdentity, type PeerCertificate } from 'node:tls';
import { nkeyAuthenticator, nkeys } from 'nats';
import type { ConnectionOptions, TlsOptions } from 'nats';
import { agentInboxPrefix, STREAM_EVENTS, STREAM_RESULTS, STREAM_WORK, subjects, workConsumer } from './subjects.ts';
import type { TlsClientPem } from '../../config.ts';
import { InvalidArgumentError } from '../../../proto/errors.ts';

export interface NatsPermissions {
  publish: { allow: string[] };
  subscribe: { allow: string[] };
  allow_responses?: { max: number; expires: string };
}

/** One answer per request received, within 2 minutes (file requests time out after 30 s). */
export const RESPONSE_WINDOW = { max: 1, expires: '2m' } as const;

export function hostPermissions(hostId: string): NatsPermissions {
  const c = workConsumer(hostId);
  return {
    publish: {
      allow: [
        subjects.result(hostId),
        subjects.heartbeat(hostId),
        subjects.event(hostId),
        `${subjects.execOut(hostId)}.>`,
        '$JS.API.INFO',
        ...[STREAM_WORK, STREAM_RESULTS, STREAM_EVENTS].map((s) => `$JS.API.STREAM.INFO.${s}`),
        `$JS.API.CONSUMER.CREATE.${STREAM_WORK}.${c}.${subjects.work(hostId)}`,
        `$JS.API.CONSUMER.INFO.${STREAM_WORK}.${c}`,
        `$JS.API.CONSUMER.MSG.NEXT.${STREAM_WORK}.${c}`,
        `$JS.API.CONSUMER.DELETE.${STREAM_WORK}.${c}`,
        `$JS.ACK.${STREAM_WORK}.${c}.>`,
      ],
    },
    subscribe: { allow: [subjects.exec(hostId), subjects.execCancel(hostId), subjects.execAlive(hostId), subjects.file(hostId), `${agentInboxPrefix(hostId)}.>`] },
    allow_responses: { ...RESPONSE_WINDOW },
  };
}

/**
 * One NATS user standing in for several hosts (the loadtest's fake agents share one
 * connection): the union of their permissions, with one inbox prefix for the connection.
 */
export function hostGroupPermissions(hostIds: string[], inboxPrefix: string): NatsPermissions {
  const per = hostIds.map(hostPermissions);
  return {
    publish: { allow: per.flatMap((p) => p.publish.allow).filter((x, i, a) => a.indexOf(x) === i) },
    // Each host's relay subjects (all it may subscribe to but its inbox), then the one inbox.
    subscribe: { allow: [...hostIds.flatMap((h) => hostPermissions(h).subscribe.allow.filter((x) => !x.startsWith(agentInboxPrefix(h)))), `${inboxPrefix}.>`] },
    allow_responses: { ...RESPONSE_WINDOW },
  };
}

export interface NatsUser {
  /** Public NKey (starts with U). */
  nkey: string;
  /** Omitted: full rights (the scheduler). */
  permissions?: NatsPermissions;
}

/**
 * nats-server configuration text for these users (NATS conf accepts JSON). Pass it with
 * `-c FILE`; listen address, JetStream and store dir still come from the command line.
 */
/** nats-server's `authorization` block for these users (a user without permissions may do anything). */
export function natsAuthorization(users: readonly NatsUser[]): { users: Array<{ nkey: string; permissions?: NatsPermissions }> } {
  return { users: users.map((u) => (u.permissions ? { nkey: u.nkey, permissions: u.permissions } : { nkey: u.nkey })) };
}

export function natsServerAuthConfig(users: NatsUser[]): string {
  return `${JSON.stringify({ authorization: natsAuthorization(users) }, null, 2)}\n`;
}

export interface NatsCredential {
  /** Public key, for the server config. */
  publicKey: string;
  /** Where the seed is (0600). */
  seedFile: string;
}

/** Creates a user NKey and writes its seed to `seedFile` (mode 0600). */
export function createNkeyFile(seedFile: string): NatsCredential {
  const kp = nkeys.createUser();
  writeFileSync(seedFile, `${new TextDecoder().decode(kp.getSeed())}\n`, { mode: 0o600 });
  chmodSync(seedFile, 0o600);
  return { publicKey: kp.getPublicKey(), seedFile };
}

/**
 * Connection options that authenticate with the NKey seed in `seedFile` (read once). A file
 * that cannot be read, or holds no user seed, fails naming `variable` (where the path came
 * from), as the other FF_NATS_* files do (readTlsClientFiles): a bare ENOENT named none.
 */
export function nkeyConnectOptions(seedFile: string, variable = 'FF_NATS_NKEY_FILE'): Pick<ConnectionOptions, 'authenticator'> {
  let seed: string;
  try {
    seed = readFileSync(seedFile, 'utf8').trim();
  } catch (e) {
    throw new InvalidArgumentError(variable, `cannot read ${seedFile}: ${(e as Error).message}`, { cause: e });
  }
  if (!/^SU[A-Z2-7]{56}$/.test(seed)) throw new InvalidArgumentError(variable, `${seedFile}: not a NATS user NKey seed`);
  return { authenticator: nkeyAuthenticator(new TextEncoder().encode(seed)) };
}

/**
 * Connection options for TLS to NATS: none without `tls` (nats.js then upgrades only when a
 * server requires it). With it, TLS is required (a server without it is refused), the server is
 * verified against `tls.ca` (else the system roots), and `tls.cert` / `tls.key` is the client
 * certificate a server with `verify` asks for. The NKey still decides what the client may do.
 */
export function natsTlsOptions(tls: TlsClientPem | undefined): Pick<ConnectionOptions, 'tls'> {
  if (!tls) return {};
  // nats.js hands options it does not know to Node's tls.connect.
  const options: TlsOptions & { checkServerIdentity: typeof checkDialedServer } = {
    ...(tls.ca ? { ca: tls.ca.toString('utf8') } : {}),
    ...(tls.cert && tls.key ? { cert: tls.cert.toString('utf8'), key: tls.key.toString('utf8') } : {}),
    checkServerIdentity: checkDialedServer,
  };
  return { tls: options };
}

/**
 * Node's check of a NATS server's certificate, against the address nats.js dialed. nats.js
 * (2.29) upgrades its socket to TLS without naming the host when the host is an IP address,
 * and Node then checks the certificate against "localhost" (nats-io/nats.js#303): an IP
 * address in the certificate would never match, and a "localhost" would match any server.
 * Node calls this with its connect options as `this`; with no name in them, their socket's
 * remote address is the server dialed. Otherwise (a name given), Node's own check of that name.
 */
function checkDialedServer(this: { servername?: string; host?: string; socket?: Socket } | undefined, hostname: string, cert: PeerCertificate): Error | undefined {
  const dialed = !this?.servername && !this?.host ? this?.socket?.remoteAddress : undefined;
  return checkServerIdentity(dialed ?? hostname, cert);
}

/**
 * How the scheduler's and the agents' connections notice a link that went silent without a
 * reset (a partition, a NATS node gone): within ~10 s by pings, well inside the host-lost
 * threshold (nats.js's default is 2 min x 2). The scheduler holds lost transitions only while
 * it knows its link is down; an agent whose link died unnoticed kept publishing heartbeats,
 * results and exec output into the dead socket (buffered in memory) for minutes, while the
 * scheduler, hearing nothing, lost the host and every sandbox on it.
 */
export const LINK_CHECK = { pingInterval: 5_000, maxPingOut: 2 } as const satisfies Pick<ConnectionOptions, 'pingInterval' | 'maxPingOut'>;

/**
 * What a host agent passes to `connect()`: its own inbox prefix (its permissions allow only
 * that) and, when a seed file is configured, NKey authentication; the link check.
 */
export function agentConnectOptions(hostId: string, seedFile: string | undefined): Pick<ConnectionOptions, 'authenticator' | 'inboxPrefix' | 'pingInterval' | 'maxPingOut'> {
  return { inboxPrefix: agentInboxPrefix(hostId), ...LINK_CHECK, ...(seedFile ? nkeyConnectOptions(seedFile) : {}) };
}
