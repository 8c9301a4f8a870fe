// Reads Prometheus text exposition (what prom-client's Registry.metrics() returns) into the
// few series the dashboard shows. Pure: text in, data out.

export interface HistogramData {
  /** Upper bounds, ascending, +Inf last. */
  le: number[];
  /** Cumulative counts per bound. */
  cumulative: number[];
  count: number;
  sum: number;
}

export interface MetricsView {
  /** forkfleet_operation_duration_seconds by kind, summed over every text given. */
  durations: Record<string, HistogramData>;
  /** forkfleet_operations_total by kind and result. */
  operations: Array<{ kind: string; result: string; value: number }>;
  /** 1 when some replica reports forkfleet_scheduler_is_leader 1. */
  leaders: number;
}

const LINE = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$/;

function parseLabels(s: string | undefined): Record<string, string> {
  const out: Record<string, string> = {};
  if (!s) return out;
  const re = /([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g;
  for (let m = re.exec(s); m; m = re.exec(s)) out[m[1]!] = m[2]!.replace(/\\(.)/g, (_x, c: string) => (c === 'n' ? '\n' : c));
  return out;
}

const toNum = (v: string): number => (v === '+Inf' ? Infinity : v === '-Inf' ? -Infinity : Number(v));

export function parseMetrics(texts: string[]): MetricsView {
  const durations: Record<string, { buckets: Map<number, number>; count: number; sum: number }> = {};
  const ops = new Map<string, number>();
  let leaders = 0;
  for (const text of texts) {
    for (const raw of text.split('\n')) {
      const line = raw.trim();
      if (!line || line.startsWith('#')) continue;
      const m = LINE.exec(line);
      if (!m) continue;
      const [, name, labelText, value] = m;
      const labels = parseLabels(labelText);
      const v = toNum(value!);
      if (name!.startsWith('forkfleet_operation_duration_seconds')) {
        const kind = labels.kind ?? 'unknown';
        const d = (durations[kind] ??= { buckets: new Map(), count: 0, sum: 0 });
        if (name === 'forkfleet_operation_duration_seconds_bucket' && labels.le !== undefined) d.buckets.set(toNum(labels.le), (d.buckets.get(toNum(labels.le)) ?? 0) + v);
        else if (name === 'forkfleet_operation_duration_seconds_count') d.count += v;
        else if (name === 'forkfleet_operation_duration_seconds_sum') d.sum += v;
      } else if (name === 'forkfleet_operations_total') {
        const k = `${labels.kind ?? 'unknown'}\u0000${labels.result ?? 'unknown'}`;
        ops.set(k, (ops.get(k) ?? 0) + v);
      } else if (name === 'forkfleet_scheduler_is_leader' && v === 1) leaders++;
    }
  }
  const out: MetricsView = { durations: {}, operations: [], leaders };
  for (const [kind, d] of Object.entries(durations)) {
    const le = [...d.buckets.keys()].sort((a, b) => a - b);
    out.durations[kind] = { le, cumulative: le.map((b) => d.buckets.get(b) ?? 0), count: d.count, sum: d.sum };
  }
  for (const [k, value] of ops) {
    const [kind, result] = k.split('\u0000') as [string, string];
    out.operations.push({ kind, result, value });
  }
  out.operations.sort((a, b) => a.kind.localeCompare(b.kind) || a.result.localeCompare(b.result));
  return out;
}

/** Estimated quantile q (0..1) of a cumulative histogram, interpolating inside the bucket, as histogram_quantile does. */
export function quantile(h: HistogramData, q: number): number | undefined {
  const total = h.cumulative[h.cumulative.length - 1] ?? 0;
  if (total === 0) return undefined;
  const rank = q * total;
  let prevLe = 0;
  let prevCount = 0;
  for (let i = 0; i < h.le.length; i++) {
    const le = h.le[i]!;
    const c = h.cumulative[i]!;
    if (c >= rank) {
      if (le === Infinity) return prevLe;
      return prevLe + ((le - prevLe) * (rank - prevCount)) / Math.max(1e-12, c - prevCount);
    }
    prevLe = le;
    prevCount = c;
  }
  return prevLe;
}
