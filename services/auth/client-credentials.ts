// Where a client (SDK, CLI, dashboard, tools) finds its credential and the CA that signed the
// scheduler's certificate, in this order:
//   1. explicit options (token, ca);
//   2. FF_TOKEN and FF_CA (a PEM file path or the PEM text);
//   3. a credentials file: FF_CREDENTIALS, else <FF_FLEET_DIR or /var/lib/ffleet>/credentials.json
//      when it exists (fleet:up writes one): {"token": "...", "ca": "pki/ca.crt", "tenant": "...", "api": ["host:port"]}
//      with `ca`, as FF_CA, a PEM file path (a relative one is from the file's directory) or the PEM text.
// An empty variable is unset (FF_TOKEN= in a shell or an env file must not hide the file's token).
import { existsSync, readFileSync } from 'node:fs';
import { dirname, isAbsolute, join } from 'node:path';
import { InvalidArgumentError } from '../../proto/errors.ts';

export interface ClientCredentials {
  /** Bearer token; undefined sends none (the server answers UNAUTHENTICATED). */
  readonly token: string | undefined;
  /** PEM of the CA to trust; undefined trusts the system's roots. */
  readonly caPem: Buffer | undefined;
  /** Tenant and API addresses named by the credentials file, if any. */
  readonly tenant: string | undefined;
  readonly api: string[] | undefined;
  /** Where they came from, for error messages. */
  readonly source: string;
}

export interface CredentialOptions {
  token?: string;
  /** A PEM file path or the PEM text itself. */
  ca?: string | Buffer;
  credentialsFile?: string;
}

/** A CA given as its PEM text, not as a file's path (FF_CA, the option, the credentials file's `ca`). */
function isPemText(v: string): boolean {
  return v.includes('-----BEGIN');
}

function pem(v: string | Buffer, field: string): Buffer {
  if (Buffer.isBuffer(v)) return v;
  if (isPemText(v)) return Buffer.from(v);
  try {
    return readFileSync(v);
  } catch (e) {
    throw new InvalidArgumentError(field, `cannot read CA certificate ${v}: ${(e as Error).message}`);
  }
}

/** The local fleet's directory, as clients find it: FF_FLEET_DIR, empty or unset meaning /var/lib/ffleet (as fleet:up reads it). */
export function defaultFleetDir(env: NodeJS.ProcessEnv = process.env): string {
  return env.FF_FLEET_DIR || '/var/lib/ffleet';
}

export function defaultCredentialsFile(env: NodeJS.ProcessEnv = process.env): string {
  return env.FF_CREDENTIALS || join(defaultFleetDir(env), 'credentials.json');
}

interface CredentialsFile {
  token?: string;
  ca?: string;
  tenant?: string;
  api?: string[];
}

/**
 * The credentials file at `path`. Missing or unreadable (e.g. not root): undefined for the
 * local fleet's default file, an error naming `named` (--credentials, FF_CREDENTIALS) for a
 * file the caller named: a typo there must not fall back to some other token.
 */
export function readCredentialsFile(path: string, named?: string): CredentialsFile | undefined {
  let text: string;
  try {
    if (!existsSync(path)) {
      if (named) throw new InvalidArgumentError(named, `${path}: no such file`);
      return undefined;
    }
    text = readFileSync(path, 'utf8');
  } catch (e) {
    if (e instanceof InvalidArgumentError) throw e;
    if (named) throw new InvalidArgumentError(named, `${path}: cannot read it: ${(e as Error).message}`);
    return undefined;
  }
  let doc: CredentialsFile;
  try {
    doc = JSON.parse(text) as CredentialsFile;
  } catch (e) {
    // Never JSON.parse's message: it quotes the text around the fault, which is the token.
    throw new InvalidArgumentError(named ?? 'FF_CREDENTIALS', `${path}: not valid JSON${whereInText(text, e)}`);
  }
  if (typeof doc !== 'object' || doc === null || Array.isArray(doc)) throw new InvalidArgumentError(named ?? 'FF_CREDENTIALS', `${path}: want a JSON object {"token", "ca", "tenant"}`);
  // PEM text is taken as it is, as FF_CA's: the directory joined onto it made a CA no
  // certificate verifies against ("unable to verify the first certificate").
  return { ...doc, ...(doc.ca ? { ca: isAbsolute(doc.ca) || isPemText(doc.ca) ? doc.ca : join(dirname(path), doc.ca) } : {}) };
}

/**
 * Where in `text` a JSON.parse error is, as " (line L, column C)", when it can be told: V8 says
 * " at position N", or the end of the input, or quotes the text around an unexpected token
 * (`Unexpected token 'f', ..."ten chars before, ten after"...`: the quote is found in the text,
 * and only the position reported). '' otherwise. Never any of the text itself.
 */
export function whereInText(text: string, e: unknown): string {
  const message = e instanceof Error ? e.message : '';
  const at = /at position (\d+)/.exec(message);
  let pos = at ? Number(at[1]) : /end of (JSON )?input/i.test(message) ? text.length : undefined;
  const quoted = pos === undefined ? /^Unexpected token '([^]+?)', \.\.\."([^]*)"(?:\.\.\.)? is not valid JSON$/.exec(message) : null;
  if (quoted) {
    // The quote starts ten characters before the token (V8's JsonParser context), and must
    // be found once in the text, with the token where it says.
    const i = text.indexOf(quoted[2]!);
    const p = i + 10;
    if (i >= 0 && text.indexOf(quoted[2]!, i + 1) < 0 && text.startsWith(quoted[1]!, p)) pos = p;
  }
  if (pos === undefined) return '';
  const before = text.slice(0, pos);
  const line = before.split('\n').length;
  const column = pos - before.lastIndexOf('\n');
  return ` (line ${line}, column ${column})`;
}

export function resolveClientCredentials(o: CredentialOptions = {}, env: NodeJS.ProcessEnv = process.env): ClientCredentials {
  // A file named on purpose (--credentials, FF_CREDENTIALS) comes before FF_TOKEN and FF_CA;
  // the local fleet's default file comes after them. Empty variables are unset, as FF_FLEET_DIR and FF_API are.
  const [ffCredentials, ffToken, ffCa] = [env.FF_CREDENTIALS || undefined, env.FF_TOKEN || undefined, env.FF_CA || undefined];
  const named = o.credentialsFile ?? ffCredentials;
  const filePath = named ?? defaultCredentialsFile(env);
  const file = o.token !== undefined && o.ca !== undefined ? undefined : readCredentialsFile(filePath, o.credentialsFile !== undefined ? 'credentials' : ffCredentials !== undefined ? 'FF_CREDENTIALS' : undefined);
  const pick = <T>(option: T | undefined, fromEnv: T | undefined, fromFile: T | undefined): [T | undefined, 'options' | 'env' | 'file' | 'none'] => {
    const order: Array<[T | undefined, 'options' | 'env' | 'file']> = named !== undefined ? [[option, 'options'], [fromFile, 'file'], [fromEnv, 'env']] : [[option, 'options'], [fromEnv, 'env'], [fromFile, 'file']];
    const hit = order.find(([v]) => v !== undefined);
    return hit ?? [undefined, 'none'];
  };
  const [token, tokenFrom] = pick(o.token, ffToken, file?.token);
  const [ca, caFrom] = pick<string | Buffer>(o.ca, ffCa, file?.ca);
  const source = tokenFrom === 'options' ? 'options' : tokenFrom === 'env' ? 'FF_TOKEN' : tokenFrom === 'file' ? filePath : 'none';
  // The file's tenant goes with the file's token: another token (FF_TOKEN) is another tenant's.
  return { token: token || undefined, caPem: ca ? pem(ca, caFrom === 'options' ? 'ca' : caFrom === 'env' ? 'FF_CA' : filePath) : undefined, tenant: tokenFrom === 'file' ? file?.tenant : undefined, api: file?.api, source };
}
