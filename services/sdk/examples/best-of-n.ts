// Best of N: prepare one sandbox, fork it N ways, run a task in each child with a different
// seed, keep the child with the best score and destroy the rest.
//
//   node --import tsx services/sdk/examples/best-of-n.ts [--n 8] [--api host:port] [--tenant t]
//
// Prints one JSON line at the end: {"best": {...}, "scores": [...], "kept": "sb-..."}.
import { parseArgs } from 'node:util';
import { Forkfleet, OperationFailedError } from '../index.ts';
import type { Sandbox } from '../index.ts';
import { defaultApi } from '../../cli/hints.ts';

const { values } = parseArgs({
  options: {
    n: { type: 'string', default: '8' },
    api: { type: 'string', default: defaultApi() },
    tenant: { type: 'string', default: process.env.FF_TENANT ?? '' },
    'keep-parent': { type: 'boolean', default: false },
  },
});
const n = Number(values.n);
// TLS; the token and CA come from FF_TOKEN / FF_CA, FF_CREDENTIALS or the local fleet's credentials.json.
const ff = new Forkfleet({ address: values.api, ...(values.tenant ? { tenant: values.tenant } : {}) });
const log = (s: string): void => void process.stderr.write(`best-of-n: ${s}\n`);

let parent: Sandbox | undefined;
const kids: Sandbox[] = [];
try {
  parent = await ff.create({ image: 'tiny', memoryMib: 256, labels: { example: 'best-of-n' } });
  log(`parent ${parent.id} on ${parent.info?.hostId}`);
  // Shared set-up done once, inherited by every child through the fork.
  await ff.sandbox(parent.id).writeFile('/tmp/task.sh', 'seed=$1; x=$(( (seed * 1103515245 + 12345) % 2147483648 )); echo $(( x % 1000 ))\n', 0o755);

  let shown = '';
  const onProgress = (op: { progress: { done: number; total: number } }): void => {
    const line = `fork: ${op.progress.done}/${op.progress.total} children ready`;
    if (line !== shown) log((shown = line));
  };
  kids.push(...(await parent.fork(n, { spread: 'spread' }, { onProgress })));
  log(`forked ${kids.length}: ${kids.map((k) => `${k.id}@${k.info?.hostId}`).join(' ')}`);

  const scores = await Promise.all(
    kids.map(async (k, seed) => {
      const r = await k.sh(`sh /tmp/task.sh ${seed + 1}`);
      if (r.exitCode !== 0) throw new Error(`${k.id}: task exited ${r.exitCode}: ${r.stderr}`);
      return { sandboxId: k.id, hostId: k.info?.hostId ?? '', seed: seed + 1, score: Number(r.stdout.trim()) };
    }),
  );
  const best = scores.reduce((a, b) => (b.score > a.score ? b : a));
  log(`best: ${best.sandboxId} (seed ${best.seed}) scored ${best.score}`);
  await Promise.all(kids.filter((k) => k.id !== best.sandboxId).map((k) => k.destroy()));
  if (!values['keep-parent']) await parent.destroy();
  process.stdout.write(`${JSON.stringify({ best, scores, kept: best.sandboxId })}\n`);
} catch (e) {
  // Leave nothing behind on failure, including the children a partly failed fork started
  // (its error carries them: they run, and count against the quota, until destroyed).
  if (e instanceof OperationFailedError) for (const c of e.operation.fork?.children ?? []) if (!kids.some((k) => k.id === c.id)) kids.push(ff.sandbox(c.id));
  await Promise.allSettled([...kids, ...(parent ? [parent] : [])].map((k) => k.destroy()));
  throw e;
} finally {
  ff.close();
}
