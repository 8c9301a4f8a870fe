// The transfer benchmark's naive baseline: one plain TCP stream of the snapshot's whole files
// (endpoint-main.ts naive-serve, naive-recv), read from the receiver's exit and report.

/**
 * naive-recv's report ({ seconds, bytes }), checked: it exited 0 and received `expectedBytes`
 * (every file whole). A sender that fails part-way ends the stream early, and a short copy
 * would pass for a fast one.
 */
export function naiveCopied(r: { code: number | null; stdout: string; stderr: string }, expectedBytes: number): { seconds: number; bytes: number } {
  const line = r.stdout.trim().split('\n').pop() ?? '';
  if (r.code !== 0 || !line.startsWith('{')) throw new Error(`naive copy failed (exit ${r.code}): ${r.stderr.slice(-2000)}`);
  const out = JSON.parse(line) as { seconds?: unknown; bytes?: unknown };
  if (out.bytes !== expectedBytes) throw new Error(`naive copy received ${String(out.bytes)} of ${expectedBytes} bytes`);
  if (typeof out.seconds !== 'number' || !(out.seconds > 0)) throw new Error(`naive copy reported no time: ${line}`);
  return { seconds: out.seconds, bytes: expectedBytes };
}

/** naive / other, to 2 places; null when either was not measured (skipped). */
export function speedup(naiveSeconds: number | null, seconds: number | null): number | null {
  return naiveSeconds === null || seconds === null || !(seconds > 0) ? null : +(naiveSeconds / seconds).toFixed(2);
}
