// A test process for reaper.int.test.ts: starts its reaper, makes what a test would leave
// behind (noted as the real code notes it), prints what it made as one JSON line, then waits
// to be killed, or exits at once with `exit`.
import { spawn, execFileSync } from 'node:child_process';
import { writeFileSync, appendFileSync } from 'node:fs';
import { join } from 'node:path';
import { startReaper } from './reaper.ts';
import { tempDir } from './proc.ts';
import { noteForReaper } from '../../host-agent/adapters/tied.ts';

const TIED = join(import.meta.dirname, '..', '..', 'host-agent', 'adapters', 'tied.ts');

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
// As an agent the test started, not noted itself: once the watcher's first pass has killed
// `left` (gone, or a zombie), notes one more process, and writes its PID to `late`.
const late = join(dir, '..', `${dir.split('/').pop()}.late`);
const noterCode = `
import { spawn } from 'node:child_process';
import { readFileSync, writeFileSync } from 'node:fs';
import { noteForReaper } from ${JSON.stringify(TIED)};
const alive = (pid) => { try { return !/\\) Z /.test(readFileSync('/proc/' + pid + '/stat', 'utf8')); } catch { return false; } };
const t = setInterval(() => {
  if (alive(${left})) return;
  clearInterval(t);
  const c = spawn('sleep', ['300'], { detached: true, stdio: 'ignore' });
  c.unref();
  noteForReaper({ pid: c.pid });
  writeFileSync(${JSON.stringify(late)}, String(c.pid));
}, 20);
setTimeout(() => process.exit(1), 60_000).unref();
`;
const noter = spawn(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', noterCode], { detached: true, stdio: 'ignore' });
noter.unref();
process.stdout.write(`${JSON.stringify({ list, watcherPid, left, reused, dir, late, noter: noter.pid })}\n`);
if (how === 'wait') setInterval(() => undefined, 60_000);
