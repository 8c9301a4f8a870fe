// The agent's first NATS connection: waited for while no server can be reached (an agent that
// exited then was restarted every second and redid its whole start each time), but not when
// waiting cannot help: refused credentials, a TLS handshake that fails (a wrong FF_NATS_CA, a
// server certificate that does not verify), or anything not known to pass with time.
import { connect, ErrorCode, NatsError, type ConnectionOptions, type NatsConnection } from 'nats';
import type { Logger } from 'pino';

/** NATS's own codes for a server not reached (yet). */
const NATS_PASSING: ReadonlySet<string> = new Set([ErrorCode.ConnectionRefused, ErrorCode.ConnectionTimeout, ErrorCode.Timeout, ErrorCode.Disconnect, ErrorCode.ConnectionClosed]);
/** The socket's codes for a server or network not reachable (yet). nats.js passes a failed TLS handshake on as the socket's error too (DEPTH_ZERO_SELF_SIGNED_CERT, ...): not among these. */
const SOCKET_PASSING: ReadonlySet<string> = new Set(['ECONNREFUSED', 'ECONNRESET', 'ETIMEDOUT', 'EHOSTUNREACH', 'ENETUNREACH', 'ENOTFOUND', 'EAI_AGAIN', 'EPIPE']);

/** Whether waiting may mend a failed first connect: a server not reached, not one that refused or failed us. */
export function waitingHelps(err: unknown): boolean {
  const code = (err as { code?: unknown } | undefined)?.code;
  if (typeof code !== 'string') return false;
  return err instanceof NatsError ? NATS_PASSING.has(code) : SOCKET_PASSING.has(code);
}

/** Connects, waiting 1 s to 10 s between attempts (a warning each) while waitingHelps; anything else is thrown. */
export async function connectWaiting(opts: ConnectionOptions, log: Logger, o: { connect?: (opts: ConnectionOptions) => Promise<NatsConnection>; sleep?: (ms: number) => Promise<void> } = {}): Promise<NatsConnection> {
  const dial = o.connect ?? connect;
  const sleep = o.sleep ?? ((ms: number) => new Promise<void>((r) => setTimeout(r, ms)));
  for (let waitMs = 1000; ; waitMs = Math.min(2 * waitMs, 10_000)) {
    try {
      return await dial(opts);
    } catch (err) {
      if (!waitingHelps(err)) throw err;
      log.warn({ err, retryInMs: waitMs }, 'NATS cannot be reached: the agent starts once it can');
      await sleep(waitMs);
    }
  }
}
