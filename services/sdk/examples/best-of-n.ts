// Best of N: prepare one sandbox, fork it N ways, run a task in each child with a different
// seed, keep the child with the best score and destroy the rest.
//
//   node --import tsx services/sdk/examples/best-of-n.ts [--n 8] [--api host:port] [--tenant t]
//
// Prints one JSON line at the end: {"best": {...}, "scores": [...], "kept": "sb-..."}.
import { resolve } from 'node:path';
import { parseArgs } from 'node:util';
import { Forkfleet, OperationFailedError, operationIdOf } from '../index.ts';
import type { OperationInfo, Sandbox } from '../index.ts';
import { defaultApi } from '../../cli/hints.ts';

export interface Score {
  sandboxId: string;
  hostId: string;
  seed: number;
  score: number;
}

/**
 * The sandboxes an operation made before `e` ended the call that waited for it, to destroy.
 * A failed operation's error lists them. One whose wait gave up (an outage, a timeout) was
 * accepted and may still be running: it is cancelled (a running create or fork stops and
 * destroys what it started; one that ended meanwhile refuses the cancel and keeps them),
 * followed until it ends, and its result read. Best effort: what cannot be read is not listed.
 */
export async function leftBy(ff: Forkfleet, e: unknown): Promise<string[]> {
  let op: OperationInfo | undefined = e instanceof OperationFailedError ? e.operation : undefined;
  const opId = op ? undefined : operationIdOf(e);
  if (opId) {
    op = await ff.cancelOperation(opId).catch(() => undefined);
    op = await ff.wait(opId, { timeoutMs: 120_000 }).catch((x: unknown) => (x instanceof OperationFailedError ? x.operation : undefined)) ?? (await ff.operation(opId).catch(() => op));
  }
  const made = [...(op?.sandbox ? [op.sandbox] : []), ...(op?.fork?.children ?? [])];
  return made.filter((s) => s.state !== 'destroying' && s.state !== 'destroyed').map((s) => s.id);
}

/** The example's work on `ff`; on failure it destroys what it made (the fork's children included) and throws. */
export async function bestOfN(ff: Forkfleet, o: { n: number; keepParent?: boolean; log?: (s: string) => void }): Promise<{ best: Score; scores: Score[]; kept: string }> {
  const log = o.log ?? (() => {});
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
    kids.push(...(await parent.fork(o.n, { spread: 'spread' }, { onProgress })));
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
    if (!o.keepParent) await parent.destroy();
    return { best, scores, kept: best.sandboxId };
  } catch (e) {
    // Leave nothing behind on failure, including what an operation made before the wait for
    // it failed: a partly failed fork's children, or those of a fork accepted whose wait gave
    // up (they run, and count against the quota, until destroyed).
    for (const id of await leftBy(ff, e)) if (id !== parent?.id && !kids.some((k) => k.id === id)) kids.push(ff.sandbox(id));
    await Promise.allSettled([...kids, ...(parent ? [parent] : [])].map((k) => k.destroy()));
    throw e;
  }
}

if (process.argv[1] && resolve(process.argv[1]) === resolve(import.meta.filename)) {
  const { values } = parseArgs({
    options: {
      n: { type: 'string', default: '8' },
      api: { type: 'string', default: defaultApi() },
      tenant: { type: 'string', default: process.env.FF_TENANT ?? '' },
      'keep-parent': { type: 'boolean', default: false },
    },
  });
  // TLS; the token and CA come from FF_TOKEN / FF_CA, FF_CREDENTIALS or the local fleet's credentials.json.
  const ff = new Forkfleet({ address: values.api, ...(values.tenant ? { tenant: values.tenant } : {}) });
  try {
    const r = await bestOfN(ff, { n: Number(values.n), keepParent: values['keep-parent'], log: (s) => void process.stderr.write(`best-of-n: ${s}\n`) });
    process.stdout.write(`${JSON.stringify(r)}\n`);
  } finally {
    ff.close();
  }
}
