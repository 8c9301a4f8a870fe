// A test process for reaper.int.test.ts: starts its reaper, makes what a test would leave
// behind (noted as the real code notes it), prints what it made as one JSON line, then waits
// to be killed, or exits at once with `exit`.
import { spawn, execFileSync } from 'node:child_process';
import { writeFileSync, appendFileSync } from 'node:fs';
import { join } from 'node:path';
import { startReaper } from './reaper.ts';
import { tempDir } from './proc.ts';
import { noteForReaper } from '../../host-agent/adapters/tied.ts';

const [ns, how] = process.argv.slice(2) as [string, 'wait' | 'exit'];
const { list, watcherPid } = startReaper();
const sleeper = (): number => {
  const c = spawn('sleep', ['300'], { detached: true, stdio: 'ignore' });
  c.unref();
  return c.pid!;
};
const left = sleeper();
noteForReaper({ pid: left });
// Noted with another start time: as a PID the kernel has since given to another process.
const reused = sleeper();
appendFileSync(list, `pid ${reused} 1\n`);
execFileSync('ip', ['netns', 'add', ns]);
noteForReaper({ netns: ns });
const dir = tempDir('ff-reap-fixture-');
writeFileSync(join(dir, 'data'), 'x');
process.stdout.write(`${JSON.stringify({ list, watcherPid, left, reused, dir })}\n`);
if (how === 'wait') setInterval(() => undefined, 60_000);
