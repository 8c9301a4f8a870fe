// SVG charts rendered as strings (no browser, no dependency): a latency CDF with a log
// x-axis, and grouped bars. Pure functions of their data.
import { cdfPoints } from './hist.ts';

export interface CdfSeries {
  name: string;
  samples: readonly number[];
}

export interface BarGroup {
  label: string;
  bars: ReadonlyArray<{ name: string; value: number }>;
}

const PALETTE = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f', '#bcbd22', '#17becf', '#393b79', '#637939', '#8c6d31'];
const W = 760;
const H = 420;
const M = { l: 64, r: 210, t: 36, b: 52 };

export function escapeXml(s: string): string {
  return s.replace(/&/g, '&amp;').replace(/</g, '&lt;').replace(/>/g, '&gt;').replace(/"/g, '&quot;');
}

const f = (x: number): string => (Math.round(x * 10) / 10).toString();

/** Decade ticks (1, 10, 100, ...) covering [lo, hi], plus 2x and 5x when there are few decades. */
export function logTicks(lo: number, hi: number): number[] {
  const a = Math.floor(Math.log10(lo));
  const b = Math.ceil(Math.log10(hi));
  const ticks: number[] = [];
  for (let e = a; e <= b; e++) for (const m of b - a <= 2 ? [1, 2, 5] : [1]) ticks.push(m * 10 ** e);
  return ticks.filter((t) => t >= 10 ** a && t <= 10 ** b);
}

function fmtMs(ms: number): string {
  return ms >= 1000 ? `${ms / 1000}s` : `${ms}ms`;
}

/** Empirical CDF of each series; x is latency on a log scale, y the fraction of samples. */
export function renderCdf(title: string, series: readonly CdfSeries[]): string {
  const live = series.filter((s) => s.samples.length > 0);
  const all = live.flatMap((s) => s.samples).filter((v) => v > 0);
  const lo = all.length ? Math.min(...all) : 1;
  const hi = all.length ? Math.max(...all) : 10;
  const ticks = logTicks(lo, Math.max(hi, lo * 1.01));
  const x0 = Math.log10(ticks[0] ?? 1);
  const x1 = Math.log10(ticks[ticks.length - 1] ?? 10);
  const pw = W - M.l - M.r;
  const ph = H - M.t - M.b;
  const sx = (v: number): number => M.l + ((Math.log10(Math.max(v, 10 ** x0)) - x0) / (x1 - x0 || 1)) * pw;
  const sy = (p: number): number => M.t + (1 - p) * ph;
  const out: string[] = [];
  out.push(`<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}" font-family="sans-serif" font-size="12">`);
  out.push(`<rect width="${W}" height="${H}" fill="white"/>`);
  out.push(`<text x="${M.l}" y="20" font-size="15" font-weight="bold">${escapeXml(title)}</text>`);
  for (const t of ticks) {
    out.push(`<line x1="${f(sx(t))}" y1="${M.t}" x2="${f(sx(t))}" y2="${M.t + ph}" stroke="#ddd"/>`);
    out.push(`<text x="${f(sx(t))}" y="${M.t + ph + 16}" text-anchor="middle">${fmtMs(t)}</text>`);
  }
  for (const p of [0, 0.25, 0.5, 0.75, 0.95, 1]) {
    out.push(`<line x1="${M.l}" y1="${f(sy(p))}" x2="${M.l + pw}" y2="${f(sy(p))}" stroke="#eee"/>`);
    out.push(`<text x="${M.l - 6}" y="${f(sy(p) + 4)}" text-anchor="end">${p}</text>`);
  }
  out.push(`<rect x="${M.l}" y="${M.t}" width="${pw}" height="${ph}" fill="none" stroke="#333"/>`);
  out.push(`<text x="${M.l + pw / 2}" y="${H - 12}" text-anchor="middle">latency, API call to exec answered (log scale)</text>`);
  out.push(`<text x="16" y="${M.t + ph / 2}" text-anchor="middle" transform="rotate(-90 16 ${M.t + ph / 2})">fraction of samples</text>`);
  live.forEach((s, i) => {
    const color = PALETTE[i % PALETTE.length] ?? '#000';
    const pts = cdfPoints(s.samples);
    // Step function: horizontal to each sample, then up.
    let d = `M${f(sx(pts[0]?.[0] ?? lo))},${f(sy(0))}`;
    let prevY = 0;
    for (const [v, p] of pts) {
      d += ` L${f(sx(v))},${f(sy(prevY))} L${f(sx(v))},${f(sy(p))}`;
      prevY = p;
    }
    out.push(`<path d="${d}" fill="none" stroke="${color}" stroke-width="2"><title>${escapeXml(s.name)}</title></path>`);
    const ly = M.t + 8 + i * 18;
    out.push(`<line x1="${M.l + pw + 12}" y1="${ly}" x2="${M.l + pw + 32}" y2="${ly}" stroke="${color}" stroke-width="3"/>`);
    out.push(`<text x="${M.l + pw + 38}" y="${ly + 4}">${escapeXml(s.name)} (n=${s.samples.length})</text>`);
  });
  if (live.length === 0) out.push(`<text x="${M.l + pw / 2}" y="${M.t + ph / 2}" text-anchor="middle">no samples</text>`);
  out.push('</svg>');
  return `${out.join('\n')}\n`;
}

/** Grouped vertical bars on a linear scale from 0, each labelled with its value. */
export function renderBars(title: string, yLabel: string, groups: readonly BarGroup[]): string {
  const names = [...new Set(groups.flatMap((g) => g.bars.map((b) => b.name)))];
  const max = Math.max(1, ...groups.flatMap((g) => g.bars.map((b) => b.value)));
  const pw = W - M.l - M.r;
  const ph = H - M.t - M.b;
  const gw = pw / Math.max(1, groups.length);
  const bw = (gw * 0.8) / Math.max(1, names.length);
  const sy = (v: number): number => M.t + (1 - v / max) * ph;
  const out: string[] = [];
  out.push(`<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}" font-family="sans-serif" font-size="12">`);
  out.push(`<rect width="${W}" height="${H}" fill="white"/>`);
  out.push(`<text x="${M.l}" y="20" font-size="15" font-weight="bold">${escapeXml(title)}</text>`);
  for (let k = 0; k <= 4; k++) {
    const v = (max * k) / 4;
    out.push(`<line x1="${M.l}" y1="${f(sy(v))}" x2="${M.l + pw}" y2="${f(sy(v))}" stroke="#eee"/>`);
    out.push(`<text x="${M.l - 6}" y="${f(sy(v) + 4)}" text-anchor="end">${Math.round(v)}</text>`);
  }
  out.push(`<rect x="${M.l}" y="${M.t}" width="${pw}" height="${ph}" fill="none" stroke="#333"/>`);
  out.push(`<text x="16" y="${M.t + ph / 2}" text-anchor="middle" transform="rotate(-90 16 ${M.t + ph / 2})">${escapeXml(yLabel)}</text>`);
  groups.forEach((g, gi) => {
    const gx = M.l + gi * gw + gw * 0.1;
    g.bars.forEach((b) => {
      const ni = names.indexOf(b.name);
      const color = PALETTE[ni % PALETTE.length] ?? '#000';
      const x = gx + ni * bw;
      out.push(`<rect x="${f(x)}" y="${f(sy(b.value))}" width="${f(bw * 0.9)}" height="${f(M.t + ph - sy(b.value))}" fill="${color}"><title>${escapeXml(`${g.label} ${b.name}: ${b.value}`)}</title></rect>`);
      out.push(`<text x="${f(x + bw * 0.45)}" y="${f(sy(b.value) - 4)}" text-anchor="middle" font-size="10">${Math.round(b.value)}</text>`);
    });
    out.push(`<text x="${f(M.l + gi * gw + gw / 2)}" y="${M.t + ph + 16}" text-anchor="middle">${escapeXml(g.label)}</text>`);
  });
  names.forEach((n, i) => {
    const ly = M.t + 8 + i * 18;
    out.push(`<rect x="${M.l + pw + 12}" y="${ly - 6}" width="20" height="12" fill="${PALETTE[i % PALETTE.length] ?? '#000'}"/>`);
    out.push(`<text x="${M.l + pw + 38}" y="${ly + 4}">${escapeXml(n)}</text>`);
  });
  out.push('</svg>');
  return `${out.join('\n')}\n`;
}
