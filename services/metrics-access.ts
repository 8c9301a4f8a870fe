// Who may read a scheduler's /metrics. Its series name tenants (forkfleet_tenant_*: each
// tenant's sandboxes, bookings and stored bytes), so with FF_METRICS_TOKEN_FILE set a scrape
// must carry `Authorization: Bearer <that file's token>` (Prometheus: `authorization:
// { credentials_file: ... }`); anything else gets 401. Not an API token: the listener is plain
// HTTP, and API tokens cross only TLS (ADR 0012); this one opens nothing but /metrics. Unset,
// /metrics is open (a local fleet on loopback); the rendered deployment sets it
// (deploy/hosts/render.ts).
// The file is read again when it changes (mtime, size or inode), so a token is rotated without
// a restart where the scheduler reads the file itself (the rendered deployment hands it a copy
// at start: rotating there takes a restart); a file that cannot be read then keeps the token
// in force and is reported once.
import { createHash, timingSafeEqual } from 'node:crypto';
import { readFileSync, statSync } from 'node:fs';
import { InvalidArgumentError } from '../proto/errors.ts';

/** Shortest token taken: a guessable one would make the check decoration. */
export const MIN_METRICS_TOKEN_LENGTH = 16;

export interface MetricsAccess {
  /** Whether a request with this Authorization header may read /metrics. */
  allowed(authorization: string | undefined): boolean;
  /** The header this replica sends to its peers' /metrics (the dashboard's collector); undefined when open. */
  header(): Record<string, string> | undefined;
}

/** Whether a listen host is a loopback address (only this machine reaches it). */
export function isLoopbackHost(host: string): boolean {
  const h = host.replace(/^\[|\]$/g, '');
  return h === 'localhost' || h === '::1' || /^127\./.test(h);
}

const digest = (s: string): Buffer => createHash('sha256').update(s).digest();

/**
 * The bearer credential of an HTTP Authorization header, or undefined. Not auth/tokens.ts's
 * bearerOf, which takes the API's gRPC metadata as the SDK writes it: HTTP scrapers may write
 * the scheme in any case and pad it (RFC 7235), and are taken so.
 */
export function bearerOf(authorization: string | undefined): string | undefined {
  const m = /^bearer\s+(\S+)\s*$/i.exec(authorization ?? '');
  return m?.[1];
}

function readToken(path: string): string {
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch (e) {
    throw new InvalidArgumentError('FF_METRICS_TOKEN_FILE', `cannot read ${path}: ${(e as Error).message}`);
  }
  const token = text.trim();
  if (token.length < MIN_METRICS_TOKEN_LENGTH || /\s/.test(token)) throw new InvalidArgumentError('FF_METRICS_TOKEN_FILE', `${path} must hold one token of at least ${MIN_METRICS_TOKEN_LENGTH} characters and no white space`);
  return token;
}

/**
 * The access rule of FF_METRICS_TOKEN_FILE (`tokenFile`, empty: open). Throws
 * InvalidArgumentError naming the setting when the file cannot be read or holds no usable
 * token.
 */
export function metricsAccess(tokenFile: string, onReloadFailed: (why: string) => void = () => undefined): MetricsAccess {
  if (!tokenFile) return { allowed: () => true, header: () => undefined };
  let token = readToken(tokenFile);
  let want = digest(token);
  const stamp = (): string => {
    try {
      const s = statSync(tokenFile);
      return `${s.mtimeMs}:${s.size}:${s.ino}`;
    } catch {
      return '';
    }
  };
  let seen = stamp();
  let failed = '';
  const current = (): void => {
    const now = stamp();
    if (now === seen) return;
    try {
      token = readToken(tokenFile);
      want = digest(token);
      seen = now;
      failed = '';
    } catch (e) {
      const why = (e as Error).message;
      if (why !== failed) onReloadFailed(why);
      failed = why;
    }
  };
  return {
    allowed(authorization) {
      const bearer = bearerOf(authorization);
      if (bearer === undefined) return false;
      current();
      return timingSafeEqual(digest(bearer), want);
    },
    header() {
      current();
      return { authorization: `Bearer ${token}` };
    },
  };
}
