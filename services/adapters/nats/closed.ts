// A NATS connection that closed for good ends the process. nats.js stops reconnecting once the
// server refused it a second time with the same auth error since it connected, however far
// apart and with reconnects between (protocol.js handleAuthError keeps the last one; an
// Authorization Violation: a key rotated on the server first, say), maxReconnectAttempts -1 or
// not, and closes the connection. Nothing reads it again: a scheduler kept its etcd lease and
// led while it could send no host work nor hear a result, and an agent ran on unheard (its host
// declared lost) while systemd's Restart=always never fired. Exiting hands the lease on and
// has the supervisor start the process afresh, with credentials read again.
import type { NatsConnection } from 'nats';
import type { Logger } from 'pino';

/** How long `beforeExit` (a scheduler resigning its lease) may take before the process exits all the same. */
export const BEFORE_EXIT_MS = 5000;

export interface ClosedForGoodOptions {
  log: Logger;
  /** True while the process shuts down by itself: the connection it closes is no news then. */
  isStopping: () => boolean;
  /** Done, best effort and for at most `beforeExitMs`, before exiting (a scheduler resigns here). */
  beforeExit?: () => Promise<unknown>;
  beforeExitMs?: number;
  exit?: (code: number) => void;
}

/**
 * Once `nc` has closed, unless the process is stopping: logs at fatal with the error it closed
 * with, runs `beforeExit`, and exits with status 1. Settles when that is done (or not needed).
 */
export async function exitWhenClosedForGood(nc: Pick<NatsConnection, 'closed'>, o: ClosedForGoodOptions): Promise<void> {
  const err = await nc.closed().catch((e: unknown) => e);
  if (o.isStopping()) return;
  o.log.fatal({ err }, 'the NATS connection closed for good (nats.js gave up reconnecting, e.g. after a second auth refusal of the same kind): exiting for the supervisor to start this process again');
  if (o.beforeExit) {
    let timer: ReturnType<typeof setTimeout> | undefined;
    await Promise.race([
      o.beforeExit().catch((e: unknown) => o.log.warn({ err: e }, 'before exiting: not done')),
      new Promise<void>((r) => (timer = setTimeout(r, o.beforeExitMs ?? BEFORE_EXIT_MS))),
    ]);
    clearTimeout(timer);
  }
  (o.exit ?? ((code: number) => process.exit(code)))(1);
}
