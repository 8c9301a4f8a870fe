// The dashboard in real headless Chromium against a real 2-host local fleet, and the
// scheduler's /metrics through promtool. One fleet for the file.
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { execFileSync, spawnSync } from 'node:child_process';
import { createServer } from 'node:http';
import type { Server } from 'node:http';
import { readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { connect } from 'node:net';
import { chromium } from 'playwright-core';
import type { BrowserContext } from 'playwright-core';
import { defaultOptions, down, readState, up } from '../../deploy/fleet/fleet.ts';
import type { FleetState } from '../../deploy/fleet/fleet.ts';
import { Forkfleet } from '../sdk/index.ts';
import type { Sandbox } from '../sdk/index.ts';
import { dashboardHandler, metricsFromUrls } from './handler.ts';
import { resolveClientCredentials } from '../auth/client-credentials.ts';
import type { DashboardHandler } from './handler.ts';
import { tempDir } from '../testkit/proc.ts';

const DIR = '/var/lib/ffleet-ui';
// prom-client's default metrics name three gauges *_total; promtool's linter flags them.
// They are not ours; scheduler.ts can drop them with registry.removeSingleMetric(name).
const PROM_CLIENT_GAUGES = ['nodejs_active_handles_total', 'nodejs_active_requests_total', 'nodejs_active_resources_total'];

describe('dashboard and metrics against a local fleet', () => {
  let fleet: FleetState;
  let ff: Forkfleet;
  let sb: Sandbox;
  let handler: DashboardHandler;
  let server: Server;
  let base: string;
  let browser: BrowserContext | undefined;
  let tmp: string;

  beforeAll(async () => {
    tmp = tempDir('ff-dash-');
    // A fleet a killed earlier run left up (its processes are detached) is taken down first.
    if (readState(DIR)) await down(DIR);
    fleet = await up(defaultOptions({ hosts: 2, dir: DIR, prefix: 'ffui', basePort: 20700 }));
    // The fleet's admin credential (credentials.json), acting for tenant 'dash'.
    const credentialsFile = join(DIR, 'credentials.json');
    ff = new Forkfleet({ address: fleet.apiAddresses, tenant: 'dash', credentialsFile });
    sb = await ff.create({ image: 'tiny', memoryMib: 256 });
    const creds = resolveClientCredentials({ credentialsFile });
    handler = dashboardHandler({ api: fleet.apiAddresses, tenants: ['dash'], metrics: metricsFromUrls(fleet.metricsAddresses), ...(creds.token ? { token: creds.token } : {}), ...(creds.caPem ? { ca: creds.caPem } : {}) });
    server = createServer((req, res) => {
      if (!handler(req, res)) res.writeHead(404).end();
    });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    const a = server.address();
    base = `http://127.0.0.1:${typeof a === 'object' && a ? a.port : 0}/dashboard/`;
  }, 240_000);

  afterAll(async () => {
    await browser?.close().catch(() => undefined);
    handler?.close();
    server?.closeAllConnections();
    await new Promise<void>((r) => (server ? server.close(() => r()) : r()));
    if (sb) await sb.destroy().catch(() => undefined);
    ff?.close();
    await down(DIR);
    if (tmp) rmSync(tmp, { recursive: true, force: true });
  }, 120_000);

  it('page_inChromium_showsBothHostsAndTheRunningSandboxLive', { timeout: 180_000 }, async () => {
    // A fresh profile directory: playwright passes it to Chromium as --user-data-dir.
    browser = await chromium.launchPersistentContext(join(tmp, 'profile'), {
      executablePath: '/usr/bin/chromium',
      headless: true,
      viewport: { width: 1400, height: 900 },
      args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking', '--disable-component-update', '--disable-sync'],
    });
    const page = await browser.newPage();
    const external: string[] = [];
    page.on('request', (r) => {
      if (!r.url().startsWith(base.slice(0, base.indexOf('/dashboard')))) external.push(r.url());
    });
    await page.goto(base);
    await page.waitForSelector('[data-host-id="h1"]', { timeout: 20_000 });
    await page.waitForSelector('[data-host-id="h2"]', { timeout: 20_000 });
    await page.waitForSelector(`[data-sandbox-id="${sb.id}"][data-state="running"]`, { timeout: 20_000 });
    await page.waitForSelector('.hist[data-kind="create"]', { timeout: 20_000 });
    // It updates live: the stamp changes without a reload.
    const t1 = await page.getAttribute('body', 'data-updated');
    await page.waitForFunction(`document.body.getAttribute('data-updated') !== ${JSON.stringify(t1)}`, undefined, { timeout: 10_000 });

    expect(await page.locator('[data-host-id]').count()).toBe(2);
    expect(await page.locator('#hosts .bar').count()).toBeGreaterThanOrEqual(2);
    expect(await page.locator('[data-state="running"] b').first().textContent()).toBe('1');
    const shot = join(tmp, 'dashboard.png');
    await page.screenshot({ path: shot, fullPage: true });
    expect(statSync(shot).size).toBeGreaterThan(10 * 1024);
    expect(external).toEqual([]);
  });

  it('stateEndpoint_reportsHostsSandboxesAndLatencyFromTheRegistry', async () => {
    const s = await handler.state();
    expect(s.error).toBeUndefined();
    expect(s.hosts.map((h) => h.id)).toEqual(['h1', 'h2']);
    expect(s.byState.running).toBe(1);
    expect(s.latency.create?.histogram.count).toBeGreaterThanOrEqual(1);
    expect(s.leaders).toBe(1);
  });

  it('schedulersOwnDashboard_servesFleetStateOnlyToAdminTokens', async () => {
    const url = `http://${fleet.metricsAddresses[0]}/dashboard/api/state`;
    const admin = (JSON.parse(readFileSync(join(DIR, 'credentials.json'), 'utf8')) as { token: string }).token;
    const tenant = (JSON.parse(readFileSync(join(DIR, 'dev-credentials.json'), 'utf8')) as { token: string }).token;
    expect((await fetch(url)).status).toBe(401);
    expect((await fetch(`${url}?token=${tenant}`)).status).toBe(401);
    expect((await fetch(url, { headers: { authorization: 'Bearer ff_not-a-real-token' } })).status).toBe(401);
    const ok = await fetch(`${url}?token=${admin}`);
    expect(ok.status).toBe(200);
    expect(((await ok.json()) as { hosts: Array<{ id: string }> }).hosts.map((h) => h.id)).toEqual(['h1', 'h2']);
    // The page itself carries no data and loads without a token.
    expect((await fetch(`http://${fleet.metricsAddresses[0]}/dashboard/`)).status).toBe(200);
  });

  it('requestWhoseTargetTheUrlParserRefuses_isAnswered404_andTheReplicaServesOn', async () => {
    const addr = fleet.metricsAddresses[0]!;
    const i = addr.lastIndexOf(':');
    // Node's HTTP parser takes this request line; WHATWG URL refuses its port.
    const answer = await new Promise<string>((resolve, reject) => {
      const s = connect({ host: addr.slice(0, i), port: Number(addr.slice(i + 1)) }, () => s.write('GET http://x:99999/ HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n'));
      let got = '';
      s.on('data', (d: Buffer) => (got += d.toString()));
      s.on('end', () => resolve(got));
      s.on('error', reject);
    });
    expect(answer).toMatch(/^HTTP\/1\.1 404/);
    expect((await fetch(`http://${addr}/metrics`)).status).toBe(200);
  });

  it('schedulerMetrics_passPromtoolCheckMetrics_andTheLeaderReportsHostCapacityBookingAndSandboxes', async () => {
    const texts = await Promise.all(fleet.metricsAddresses.map(async (addr) => (await fetch(`http://${addr}/metrics`)).text()));
    // Only the leader has observed operations.
    expect(texts.join('\n')).toContain('forkfleet_operation_duration_seconds_bucket{le="0.05",kind="create"}');
    // Fleet state, for capacity planning and alerts: the leader reports it, the other replica
    // exposes the same metrics without samples.
    const sample = (text: string, series: string): number | undefined => {
      const line = text.split('\n').find((l) => l.startsWith(`${series} `));
      return line === undefined ? undefined : Number(line.slice(series.length + 1));
    };
    const leaderText = texts.find((t) => sample(t, 'forkfleet_scheduler_is_leader') === 1)!;
    const standbyText = texts.find((t) => t !== leaderText)!;
    expect(sample(leaderText, 'forkfleet_hosts{state="ready"}')).toBe(2);
    expect(sample(leaderText, 'forkfleet_hosts{state="lost"}')).toBe(0);
    const hostsNow = await ff.hosts.list();
    for (const h of hostsNow) {
      expect(sample(leaderText, `forkfleet_host_memory_capacity_bytes{host="${h.id}"}`)).toBe(h.capacity.memoryMib * 1024 * 1024);
      expect(sample(leaderText, `forkfleet_host_memory_allocated_bytes{host="${h.id}"}`)).toBe(h.allocated.memoryMib * 1024 * 1024);
      expect(sample(leaderText, `forkfleet_host_vcpus_capacity{host="${h.id}"}`)).toBe(h.capacity.vcpus);
    }
    expect(sample(leaderText, `forkfleet_host_sandboxes{host="${sb.info!.hostId}"}`)).toBeGreaterThanOrEqual(1);
    expect(sample(leaderText, 'forkfleet_sandboxes{state="running"}')).toBeGreaterThanOrEqual(1);
    // Per tenant: what 'dash' books now, as its own list adds it up.
    const mine = await ff.list();
    const holding = mine.filter((s) => ['starting', 'running', 'paused', 'hibernating', 'destroying'].includes(s.state));
    expect(sample(leaderText, 'forkfleet_tenant_memory_booked_bytes{tenant="dash"}')).toBe(holding.reduce((n, s) => n + s.resources.memoryMib, 0) * 1024 * 1024);
    expect(sample(leaderText, 'forkfleet_tenant_vcpus_booked{tenant="dash"}')).toBe(holding.reduce((n, s) => n + s.resources.vcpus, 0));
    expect(sample(leaderText, 'forkfleet_tenant_sandboxes{tenant="dash",state="running"}')).toBe(mine.filter((s) => s.state === 'running').length);
    expect(standbyText).toContain('# TYPE forkfleet_hosts gauge');
    expect(sample(standbyText, 'forkfleet_hosts{state="ready"}')).toBeUndefined();
    for (const text of texts) {
      const full = spawnSync('promtool', ['check', 'metrics'], { input: text, encoding: 'utf8' });
      const problems = `${full.stdout}${full.stderr}`.split('\n').filter(Boolean);
      // Parse errors would be exit 1; lint findings are exit 3 and must only be prom-client's.
      expect(full.status === 0 || full.status === 3, problems.join('\n')).toBe(true);
      expect(problems.filter((p) => !PROM_CLIENT_GAUGES.some((g) => p.startsWith(g)))).toEqual([]);
      const ours = text.split('\n').filter((l) => !PROM_CLIENT_GAUGES.some((g) => l.includes(` ${g} `) || l.startsWith(g))).join('\n');
      expect(execFileSync('promtool', ['check', 'metrics'], { input: ours, encoding: 'utf8' })).toBe('');
    }
  });

  it('grafanaDashboard_queriesParseAsPromQl_andNameOnlyMetricsTheSchedulersExpose', async () => {
    const board = JSON.parse(readFileSync(join(import.meta.dirname, '..', '..', 'deploy', 'grafana', 'forkfleet.json'), 'utf8')) as { panels: Array<{ title: string; targets?: Array<{ expr: string }> }> };
    const exprs = board.panels.flatMap((p) => (p.targets ?? []).map((t) => ({ title: p.title, expr: t.expr })));
    expect(exprs.length).toBeGreaterThan(10);
    // promtool parses PromQL in recording rules: one rule per panel query, with Grafana's
    // interval variables ($__rate_interval) as a fixed range.
    const rules = join(tmp, 'grafana-rules.yml');
    writeFileSync(rules, `groups:\n  - name: grafana\n    rules:\n${exprs.map((e, i) => `      - record: grafana_panel_${i}\n        expr: ${JSON.stringify(e.expr.replace(/\$__\w+/g, '5m'))}\n`).join('')}`);
    const check = spawnSync('promtool', ['check', 'rules', rules], { encoding: 'utf8' });
    expect(check.status, `${check.stdout}${check.stderr}`).toBe(0);
    const exposed = new Set((await Promise.all(fleet.metricsAddresses.map(async (addr) => (await fetch(`http://${addr}/metrics`)).text()))).join('\n').match(/^# TYPE \S+/gm)!.map((l) => l.slice('# TYPE '.length)));
    const unknown = exprs.flatMap((e) => [...e.expr.matchAll(/\bforkfleet_[a-z_]+/g)].map((m) => m[0].replace(/_(bucket|sum|count)$/, '')).filter((name) => !exposed.has(name)).map((name) => `${e.title}: ${name}`));
    expect(unknown).toEqual([]);
  });
});
