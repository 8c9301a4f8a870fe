// The dashboard's event stream against tokens that change while it is open (no API behind
// it: each push carries the state's error, which is all this test needs).
import { createServer, type ServerResponse } from 'node:http';
import { connect, type AddressInfo } from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import type { SandboxInfo, SnapshotInfo } from '../sdk/index.ts';
import { dashboardHandler, fleetLists, metricsFromUrls, SHOWN_ROWS } from './handler.ts';

const cleanups: Array<() => void> = [];
afterEach(() => {
  for (const c of cleanups.splice(0)) c();
});

describe('dashboard event stream', () => {
  it('events_ofATokenRevokedWhileTheStreamIsOpen_endTheStream', async () => {
    const allowed = new Set(['ff_admin']);
    const handler = dashboardHandler({ api: '127.0.0.1:1', tenants: ['t'], token: 'ff_x', intervalMs: 50, authorize: (t) => allowed.has(t) });
    const server = createServer((req, res) => void handler(req, res));
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    cleanups.push(() => {
      handler.close();
      server.closeAllConnections();
      server.close();
    });
    const res = await fetch(`http://127.0.0.1:${(server.address() as AddressInfo).port}/dashboard/api/events`, { headers: { authorization: 'Bearer ff_admin' } });
    expect(res.status).toBe(200);
    const reader = res.body!.getReader();
    const first = await reader.read();
    expect(new TextDecoder().decode(first.value)).toMatch(/^data: /);
    allowed.delete('ff_admin');
    // The stream ends (reads come back done) instead of pushing the fleet on.
    const ended = (async () => {
      for (;;) if ((await reader.read()).done) return true;
    })();
    await expect(Promise.race([ended, new Promise((r) => setTimeout(() => r(false), 3000))])).resolves.toBe(true);
  });

  it('events_toAClientThatStopsReading_areNotBufferedWithoutBound', async () => {
    // A 1 MiB state (a long metrics error stands in for a large fleet) every 20 ms.
    const handler = dashboardHandler({ api: '127.0.0.1:1', tenants: ['t'], intervalMs: 20, metrics: () => Promise.reject(new Error('x'.repeat(1 << 20))) });
    let stream: ServerResponse | undefined;
    const server = createServer((req, res) => {
      stream = res;
      void handler(req, res);
    });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    const client = connect((server.address() as AddressInfo).port, '127.0.0.1');
    cleanups.push(() => {
      client.destroy();
      handler.close();
      server.closeAllConnections();
      server.close();
    });
    client.write('GET /dashboard/api/events HTTP/1.1\r\nhost: x\r\n\r\n');
    client.pause(); // and never reads
    await new Promise((r) => setTimeout(r, 1500));
    expect(stream).toBeDefined();
    // ~75 pushes of 1 MiB were buffered for this client before; now at most the one it stalled on.
    expect(stream!.writableLength).toBeLessThan(4 << 20);
  });

  it('watches_runWhileThePageIsLookedAt_andEndOnceNoStreamIsOpenAndNoStateWasAskedForAWhile', async () => {
    const handler = dashboardHandler({ api: '127.0.0.1:1', tenants: ['t'], intervalMs: 20, watchIdleMs: 100 });
    cleanups.push(() => handler.close());
    expect(handler.watching()).toBe(false);
    await handler.state();
    expect(handler.watching()).toBe(true);
    await new Promise((r) => setTimeout(r, 60));
    await handler.state(); // looked at again: runs on
    await new Promise((r) => setTimeout(r, 60));
    expect(handler.watching()).toBe(true);
    await new Promise((r) => setTimeout(r, 200));
    expect(handler.watching()).toBe(false);
    // A new look starts them again; none after close() (its clients are closed).
    await handler.state();
    expect(handler.watching()).toBe(true);
    handler.close();
    await handler.state().catch(() => undefined);
    expect(handler.watching()).toBe(false);
  });

  it('state_whileACollectIsStillRunning_sharesIt_insteadOfStartingAnother', async () => {
    // A scheduler slow to answer: the metrics read never ends. Before, every /api/state (and
    // every stream's push) past the cache's 500 ms started one more collect beside it.
    let started = 0;
    const handler = dashboardHandler({ api: '127.0.0.1:1', tenants: ['t'], intervalMs: 20, metrics: () => (started++, new Promise<string>(() => undefined)) });
    const server = createServer((req, res) => void handler(req, res));
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    const gone = new AbortController();
    cleanups.push(() => {
      gone.abort();
      handler.close();
      server.closeAllConnections();
      server.close();
    });
    const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/dashboard/api/state`;
    for (let i = 0; i < 4; i++) {
      fetch(url, { signal: gone.signal }).catch(() => undefined);
      await new Promise((r) => setTimeout(r, 300));
    }
    expect(started).toBe(1);
  });
});

describe('dashboard state of a large fleet', () => {
  const sandbox = (i: number, state: 'running' | 'starting', hostId: string, sourceSnapshotId: string): SandboxInfo => ({ id: `sb-${i}`, state, hostId, sourceSnapshotId }) as SandboxInfo;
  const snapshot = (i: number, hostIds: string[]): SnapshotInfo => ({ id: `sn-${i}`, hostIds }) as SnapshotInfo;

  it('fleetLists_ofMoreSandboxesAndSnapshotsThanThePageLists_sendsOnlyTheRowsItLists_andCountsThemAll', () => {
    // 150 running, then 100 starting on h-1 from sn-0, which only h-0 holds: all past the rows shown.
    const sandboxes = [...Array.from({ length: 150 }, (_, i) => sandbox(i, 'running', 'h-0', '')), ...Array.from({ length: 100 }, (_, i) => sandbox(150 + i, 'starting', 'h-1', 'sn-0'))];
    const snapshots = Array.from({ length: 250 }, (_, i) => snapshot(i, ['h-0']));
    const st = fleetLists(sandboxes, snapshots);
    expect(SHOWN_ROWS).toBe(100);
    expect(st.sandboxes).toEqual(sandboxes.slice(0, SHOWN_ROWS));
    expect(st.snapshots).toEqual(snapshots.slice(0, SHOWN_ROWS));
    expect(st.totals).toEqual({ sandboxes: 250, snapshots: 250 });
    expect(st.byState).toEqual({ running: 150, starting: 100 });
    // Transfers come from every sandbox, not only the rows sent.
    expect(st.transfers).toHaveLength(100);
    expect(st.transfers[0]).toMatchObject({ kind: 'inflight', snapshotId: 'sn-0', toHostId: 'h-1', fromHostIds: ['h-0'], sandboxId: 'sb-150' });
  });

  it('fleetLists_ofAWakingSandbox_showsTheFetchOfItsHibernationSnapshot_andOfAnUnplacedOneNone', () => {
    const waking = { id: 'sb-w', state: 'waking', hostId: 'h-1', sourceSnapshotId: '', hibernationSnapshotId: 'sn-h' } as SandboxInfo;
    // Forked from sn-f, which h-1 does not hold, woken on h-2 which holds its hibernation snapshot: nothing to fetch.
    const held = { id: 'sb-x', state: 'waking', hostId: 'h-2', sourceSnapshotId: 'sn-f', hibernationSnapshotId: 'sn-h' } as SandboxInfo;
    const pending = { id: 'sb-p', state: 'pending', hostId: '', sourceSnapshotId: 'sn-f' } as SandboxInfo;
    const st = fleetLists([waking, held, pending], [{ id: 'sn-h', hostIds: ['h-0', 'h-2'] } as SnapshotInfo, { id: 'sn-f', hostIds: ['h-0'] } as SnapshotInfo]);
    expect(st.transfers).toEqual([expect.objectContaining({ kind: 'inflight', snapshotId: 'sn-h', toHostId: 'h-1', sandboxId: 'sb-w' })]);
  });

  it('fleetLists_ofAFleetThePageListsWhole_sendsItAll', () => {
    const st = fleetLists([sandbox(0, 'running', 'h-0', '')], [snapshot(0, ['h-0'])]);
    expect([st.sandboxes.length, st.snapshots.length, st.totals]).toEqual([1, 1, { sandboxes: 1, snapshots: 1 }]);
  });
});

describe('dashboard metrics collector', () => {
  it('metricsFromUrls_sendsTheHeadersItIsGiven_andSkipsAPeerThatRefuses', async () => {
    const seen: Array<string | undefined> = [];
    const server = createServer((req, res) => {
      seen.push(req.headers.authorization);
      if (req.headers.authorization === 'Bearer the-metrics-token-0123') res.writeHead(200).end('forkfleet_up 1\n');
      else res.writeHead(401).end();
    });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    try {
      const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/metrics`;
      expect(await metricsFromUrls([url], () => ({ authorization: 'Bearer the-metrics-token-0123' }))()).toEqual(['forkfleet_up 1\n']);
      expect(await metricsFromUrls([url])()).toEqual([]);
      expect(seen).toEqual(['Bearer the-metrics-token-0123', undefined]);
    } finally {
      server.close();
    }
  });
});
