// The live fleet dashboard as a plain node:http request handler: mount it on any HTTP
// server (the scheduler's metrics server, or a standalone one).
//
//   GET {base}/                 the page (plain HTML/CSS/JS, no external assets)
//   GET {base}/api/state        one JSON snapshot of the fleet
//   GET {base}/api/events       the same, pushed as server-sent events every second
// With `authorize`, the /api endpoints need an admin bearer token (header or ?token=).
//
// It reads the fleet through the public API (SDK) and latency from the scheduler's
// prom-client registry text (forkfleet_operation_duration_seconds by kind).
import { readFileSync } from 'node:fs';
import type { IncomingMessage, ServerResponse } from 'node:http';
import { Forkfleet } from '../sdk/index.ts';
import type { EventInfo, HostInfo, SandboxInfo, SnapshotInfo } from '../sdk/index.ts';
import { parseMetrics, quantile } from './metrics.ts';
import type { HistogramData } from './metrics.ts';

export interface DashboardDeps {
  /** Scheduler API address(es), host:port. */
  api: string | string[];
  /** Tenants whose sandboxes and snapshots are shown. Default FF_DASHBOARD_TENANTS (comma list) or 'default'. */
  tenants?: string[];
  /** Prometheus text of the scheduler registry (or of each replica): `() => registry.metrics()`. */
  metrics?: () => Promise<string | string[]>;
  /** URL prefix. Default '/dashboard'. */
  basePath?: string;
  /** Push interval of the SSE stream. Default 1000 ms. */
  intervalMs?: number;
  /** How long the event watches run on with no stream open and no state asked for (default 60 s). */
  watchIdleMs?: number;
  /**
   * Credential and CA for the API (TLS). Default: the SDK's discovery (FF_TOKEN, FF_CA, the
   * credentials file). It needs an admin credential to list hosts and other tenants.
   */
  token?: string;
  ca?: string | Buffer;
  /**
   * Who may read the fleet through this page: called with the bearer token of each /api
   * request (`Authorization: Bearer` or `?token=`; the page takes it from `#token=` in its
   * URL). Absent: no check (a handler mounted where only trusted users reach it).
   */
  authorize?: (token: string) => boolean;
}

export interface Transfer {
  kind: 'inflight' | 'done';
  snapshotId: string;
  toHostId: string;
  fromHostIds: string[];
  sandboxId: string;
  operationId: string;
  bytes: number;
  at: string | undefined;
}

export interface DashboardState {
  time: string;
  api: string;
  error: string | undefined;
  hosts: HostInfo[];
  tenants: string[];
  /** The first SHOWN_ROWS of the fleet's sandboxes: what the page lists. */
  sandboxes: SandboxInfo[];
  /** Over every sandbox of the fleet, as are `totals` and the in-flight transfers. */
  byState: Record<string, number>;
  /** The first SHOWN_ROWS of the fleet's snapshots. */
  snapshots: SnapshotInfo[];
  totals: { sandboxes: number; snapshots: number };
  transfers: Transfer[];
  events: EventInfo[];
  latency: Record<string, { histogram: HistogramData; p50: number | undefined; p95: number | undefined; p99: number | undefined }>;
  operations: Array<{ kind: string; result: string; value: number }>;
  leaders: number;
  metricsError: string | undefined;
}

export type DashboardHandler = ((req: IncomingMessage, res: ServerResponse) => boolean) & {
  /** Collects one state (what the page receives). */
  state(): Promise<DashboardState>;
  /** Stops the event watches and the SSE streams. */
  close(): void;
  /** Whether the tenants' event watches run (they do while the page is looked at). */
  watching(): boolean;
};

/** Fetches /metrics from each URL (e.g. the fleet's state.json metricsAddresses) for `metrics`, with `headers()` (the metrics token). */
export function metricsFromUrls(urls: string[], headers: () => Record<string, string> | undefined = () => undefined): () => Promise<string[]> {
  return async () =>
    (
      await Promise.all(
        urls.map(async (u) => {
          try {
            const h = headers();
            const r = await fetch(u.startsWith('http') ? u : `http://${u}/metrics`, { signal: AbortSignal.timeout(2000), ...(h ? { headers: h } : {}) });
            return r.ok ? await r.text() : '';
          } catch {
            return '';
          }
        }),
      )
    ).filter(Boolean);
}

const PAGE = readFileSync(new URL('./page.html', import.meta.url), 'utf8');
const TRANSITIONAL = new Set(['pending', 'starting', 'waking']);

/**
 * Rows of sandboxes and of snapshots the page lists (page.html): only those are sent. Every
 * state went to every open page each second, the whole fleet's lists in each.
 */
export const SHOWN_ROWS = 100;

/**
 * The fleet's lists as the page gets them: counts and in-flight transfers over every sandbox
 * and snapshot, the lists themselves cut to the SHOWN_ROWS the page lists. Pure.
 */
export function fleetLists(sandboxes: readonly SandboxInfo[], snapshots: readonly SnapshotInfo[]): Pick<DashboardState, 'sandboxes' | 'snapshots' | 'byState' | 'totals' | 'transfers'> {
  const byState: Record<string, number> = {};
  for (const s of sandboxes) byState[s.state] = (byState[s.state] ?? 0) + 1;
  // In flight: a sandbox coming up from a snapshot its host does not hold yet is fetching it.
  const transfers: Transfer[] = [];
  const snaps = new Map(snapshots.map((s) => [s.id, s]));
  for (const s of sandboxes) {
    // A wake restores the hibernation snapshot (the executor's choice too), not the one the
    // sandbox was first made from; a sandbox not placed yet goes to no host.
    const from = s.state === 'waking' && s.hibernationSnapshotId ? s.hibernationSnapshotId : s.sourceSnapshotId;
    if (!TRANSITIONAL.has(s.state) || !from || !s.hostId) continue;
    const sn = snaps.get(from);
    if (sn && !sn.hostIds.includes(s.hostId)) transfers.push({ kind: 'inflight', snapshotId: sn.id, toHostId: s.hostId, fromHostIds: sn.hostIds, sandboxId: s.id, operationId: '', bytes: 0, at: undefined });
  }
  return { sandboxes: sandboxes.slice(0, SHOWN_ROWS), snapshots: snapshots.slice(0, SHOWN_ROWS), byState, totals: { sandboxes: sandboxes.length, snapshots: snapshots.length }, transfers };
}

export function dashboardHandler(deps: DashboardDeps): DashboardHandler {
  const base = (deps.basePath ?? '/dashboard').replace(/\/$/, '');
  const tenants = deps.tenants ?? (process.env.FF_DASHBOARD_TENANTS ?? 'default').split(',').map((t) => t.trim()).filter(Boolean);
  const clients = new Map(tenants.map((t) => [t, new Forkfleet({ address: deps.api, tenant: t, timeoutMs: 3000, retry: { attempts: 1, rateLimitWaitMs: 0, outageWaitMs: 0, unreachableWaitMs: 0 }, ...(deps.token !== undefined ? { token: deps.token } : {}), ...(deps.ca !== undefined ? { ca: deps.ca } : {}) })]));
  const first = clients.values().next().value as Forkfleet;
  const interval = deps.intervalMs ?? 1000;
  const events: EventInfo[] = [];
  const doneTransfers: Transfer[] = [];
  const streams = new Set<ServerResponse>();
  const watchIdleMs = deps.watchIdleMs ?? 60_000;
  /** The tenants' event watches while the page is looked at (startWatches); undefined when none run. */
  let watchers: AbortController | undefined;
  let lastLook = 0;
  let idleCheck: ReturnType<typeof setInterval> | undefined;
  let cache: { at: number; p: Promise<DashboardState>; done: boolean } | undefined;
  /** close() was called: no watch starts again (its clients are closed). */
  let closed = false;

  /**
   * Watches every tenant's events while the page is looked at: they end once no stream is open
   * and no state was asked for in watchIdleMs. Run for good after a first look, they decoded
   * every change in the fleet and asked the API about every finished operation, on the admin
   * rate budget, with nobody looking.
   */
  function startWatches(): void {
    lastLook = Date.now();
    if (watchers || closed) return;
    const ac = new AbortController();
    watchers = ac;
    idleCheck = setInterval(() => {
      if (streams.size === 0 && Date.now() - lastLook > watchIdleMs) stopWatches();
    }, Math.max(10, Math.min(watchIdleMs, 10_000)));
    idleCheck.unref();
    for (const [tenant, ff] of clients) {
      void (async () => {
        while (!ac.signal.aborted) {
          try {
            for await (const ev of ff.watch({ signal: ac.signal })) {
              events.unshift(ev);
              events.length = Math.min(events.length, 50);
              if (ev.type === 'operation_done' && ev.operationId) void noteOperation(ff, ev.operationId, tenant);
            }
          } catch {
            /* the API went away: try again shortly */
          }
          await new Promise((r) => setTimeout(r, 1000).unref());
        }
      })();
    }
  }

  function stopWatches(): void {
    watchers?.abort();
    watchers = undefined;
    clearInterval(idleCheck);
  }

  /** Operation lookups under way (noteOperation): a few at once, the rest skipped (a fleet churning sandboxes finishes hundreds a second). */
  let noting = 0;
  async function noteOperation(ff: Forkfleet, id: string, _tenant: string): Promise<void> {
    if (noting >= 4) return;
    noting++;
    try {
      const op = await ff.operation(id);
      if (op.progress.bytesTransferred <= 0) return;
      const kids = op.fork?.children ?? (op.sandbox ? [op.sandbox] : []);
      doneTransfers.unshift({ kind: 'done', snapshotId: op.fork?.snapshotId ?? op.snapshot?.id ?? op.sandbox?.sourceSnapshotId ?? '', toHostId: [...new Set(kids.map((k) => k.hostId))].join(','), fromHostIds: [], sandboxId: op.targetId, operationId: op.id, bytes: op.progress.bytesTransferred, at: op.updatedAt });
      doneTransfers.length = Math.min(doneTransfers.length, 20);
    } catch {
      /* gone or unreachable: skip */
    } finally {
      noting--;
    }
  }

  async function collect(): Promise<DashboardState> {
    const st: DashboardState = {
      time: new Date().toISOString(),
      api: first.address,
      error: undefined,
      hosts: [],
      tenants,
      sandboxes: [],
      byState: {},
      snapshots: [],
      totals: { sandboxes: 0, snapshots: 0 },
      transfers: [],
      events: [...events],
      latency: {},
      operations: [],
      leaders: 0,
      metricsError: undefined,
    };
    try {
      const [hosts, per] = await Promise.all([
        first.hosts.list(),
        Promise.all([...clients.values()].map(async (ff) => ({ sandboxes: await ff.list(), snapshots: await ff.snapshots.list() }))),
      ]);
      st.hosts = hosts.sort((a, b) => a.id.localeCompare(b.id));
      Object.assign(st, fleetLists(per.flatMap((p) => p.sandboxes), per.flatMap((p) => p.snapshots)));
    } catch (e) {
      st.error = e instanceof Error ? e.message : String(e);
    }
    st.transfers.push(...doneTransfers);
    if (deps.metrics) {
      try {
        const raw = await deps.metrics();
        const view = parseMetrics(Array.isArray(raw) ? raw : [raw]);
        for (const [kind, h] of Object.entries(view.durations)) st.latency[kind] = { histogram: { ...h, le: h.le.map((x) => (x === Infinity ? 1e308 : x)) }, p50: quantile(h, 0.5), p95: quantile(h, 0.95), p99: quantile(h, 0.99) };
        st.operations = view.operations;
        st.leaders = view.leaders;
      } catch (e) {
        st.metricsError = e instanceof Error ? e.message : String(e);
      }
    }
    return st;
  }

  function state(): Promise<DashboardState> {
    startWatches();
    const now = Date.now();
    // A collect still running is shared however old it is: each stream's push and each
    // /api/state starting one more beside it would pile calls onto a scheduler slow to answer.
    if (!cache || (cache.done && now - cache.at > Math.min(500, interval / 2))) {
      const c = { at: now, p: collect(), done: false };
      void c.p.then(
        () => (c.done = true),
        () => (c.done = true),
      );
      cache = c;
    }
    return cache.p;
  }

  const handler = ((req: IncomingMessage, res: ServerResponse): boolean => {
    // Node's parser passes request targets the URL parser refuses (an absolute one with a bad
    // port, say): such a request is not the dashboard's, and must not throw in the server.
    let url: URL;
    try {
      url = new URL(req.url ?? '/', 'http://x');
    } catch {
      return false;
    }
    const path = url.pathname;
    if (path !== base && !path.startsWith(`${base}/`)) return false;
    if (req.method !== 'GET' && req.method !== 'HEAD') {
      res.writeHead(405, { allow: 'GET' }).end();
      return true;
    }
    const rest = path.slice(base.length) || '/';
    if (rest === '/' || rest === '/index.html') {
      if (path === base) {
        res.writeHead(302, { location: `${base}/` }).end();
        return true;
      }
      res.writeHead(200, { 'content-type': 'text/html; charset=utf-8', 'cache-control': 'no-store' }).end(PAGE.replace('__BASE__', base));
      return true;
    }
    const token = /^Bearer (\S+)$/.exec(req.headers.authorization ?? '')?.[1] ?? url.searchParams.get('token') ?? '';
    if (rest.startsWith('/api/') && deps.authorize) {
      if (!token || !deps.authorize(token)) {
        res.writeHead(401, { 'content-type': 'application/json', 'www-authenticate': 'Bearer' }).end(JSON.stringify({ error: 'an admin token is needed: open the dashboard as .../dashboard/#token=<admin token>' }));
        return true;
      }
    }
    if (rest === '/api/state') {
      state().then(
        (s) => res.writeHead(200, { 'content-type': 'application/json', 'cache-control': 'no-store' }).end(JSON.stringify(s)),
        (e: unknown) => res.writeHead(500, { 'content-type': 'application/json' }).end(JSON.stringify({ error: String(e) })),
      );
      return true;
    }
    if (rest === '/api/events') {
      res.writeHead(200, { 'content-type': 'text/event-stream', 'cache-control': 'no-store', connection: 'keep-alive' });
      streams.add(res);
      let busy = false;
      const push = (): void => {
        // A client that stops reading (a laptop asleep, a half-open link) would have every
        // push buffered here, without bound: skipped until it has taken the last one. Each
        // push is the whole state, so a skipped one loses nothing.
        if (busy || res.writableNeedDrain) return;
        // Asked again on every push, as the API's guard does for its streams: a token revoked
        // (taken out of the tokens file) while the page is open must not keep reading the fleet.
        if (deps.authorize && !deps.authorize(token)) {
          stop();
          res.end();
          return;
        }
        busy = true;
        state()
          .then((s) => void res.write(`data: ${JSON.stringify(s)}\n\n`))
          .catch(() => undefined)
          .finally(() => (busy = false));
      };
      const t = setInterval(push, interval);
      const stop = (): void => {
        clearInterval(t);
        streams.delete(res);
      };
      push();
      req.on('close', stop);
      res.on('close', stop);
      return true;
    }
    res.writeHead(404).end();
    return true;
  }) as DashboardHandler;
  handler.state = state;
  handler.watching = () => watchers !== undefined;
  handler.close = () => {
    closed = true;
    stopWatches();
    for (const s of streams) s.destroy();
    streams.clear();
    for (const ff of clients.values()) ff.close();
  };
  return handler;
}
