// Integration tests of the QEMU VmmDriver against real QEMU (TCG on the dev machine).
// One template VM is booted for the file and everything forks from its snapshot.
import { execFileSync } from 'node:child_process';
import { createHash, randomBytes } from 'node:crypto';
import { createReadStream, readFileSync } from 'node:fs';
import { copyFile, mkdir, readdir, readFile, rm, stat, writeFile } from 'node:fs/promises';
import net from 'node:net';
import { join } from 'node:path';
import { pino } from 'pino';
import { afterAll, beforeAll, describe, expect, it, onTestFinished, vi } from 'vitest';
import { ensureImage } from '../../../deploy/images/build.ts';
import { IncompatibleSnapshotError, VmCrashedError } from '../../errors.ts';
import type { GuestImage, LocalSnapshot, RecoveryReport, VmEvent, VmInfo } from '../../domain/vmm.ts';
import { waitFor, tempDir } from '../../../services/testkit/proc.ts';
import { QmpClient } from '../qmp/client.ts';
import { QemuVmmDriver } from './driver.ts';
import { ramDirFor, tmpfsOptions } from './ram-pool.ts';
import { cmdlineOf, isAlive, killHard } from './process.ts';
import { devPeerTls } from '../../../deploy/pki/pki.ts';
import { writeQemuTlsDir } from '../peer/tls.ts';
import { findSocat, listenRelay } from '../peer/tls-relay.ts';
import { netnsOf } from '../netns/netns.ts';
import type { ForkfleetError } from '../../../proto/errors.ts';
import { migrateOutThroughRelay } from '../peer/migrate.ts';

const logger = pino({ level: process.env.LOG_LEVEL ?? 'warn' });
let root: string;
let image: GuestImage;
let driver: QemuVmmDriver;
let snap: LocalSnapshot;
const MEM = 128;
/** Standbys only where a test asks for them (warm), so none start in the background of other tests. */
const NO_REFILL = { perSnapshot: 0 };

async function sh(vmId: string, script: string, d = driver): Promise<string> {
  const r = await d.exec(vmId, { path: '/bin/sh', args: ['-c', script], timeoutMs: 30_000 });
  if (r.exitCode !== 0) throw new Error(`${vmId}: ${script}: exit ${r.exitCode} ${r.stderr.toString()}`);
  return r.stdout.toString().trim();
}

async function digest(path: string): Promise<string> {
  const h = createHash('sha256');
  for await (const chunk of createReadStream(path)) h.update(chunk as Buffer);
  return h.digest('hex');
}

/** Every live process whose command line mentions the test root (QEMU of ours). */
async function ourProcesses(): Promise<number[]> {
  const pids: number[] = [];
  for (const d of await readdir('/proc')) {
    if (!/^\d+$/.test(d)) continue;
    const cmd = await cmdlineOf(Number(d));
    if (cmd && cmd[0]?.includes('qemu') && cmd.some((a) => a.includes(root))) pids.push(Number(d));
  }
  return pids;
}

/** True once `pid` no longer runs (a zombie awaiting its reaper counts as gone). */
async function goneWithin(pid: number, ms: number): Promise<boolean> {
  const end = Date.now() + ms;
  while (Date.now() < end) {
    const stat = await readFile(`/proc/${pid}/stat`, 'utf8').catch(() => '');
    if (!stat || /\) Z /.test(stat)) return true;
    await new Promise((r) => setTimeout(r, 20));
  }
  return !isAlive(pid);
}

/** The nice value of each thread of a process (/proc/<pid>/task/<tid>/stat field 19). */
async function niceOfThreads(pid: number): Promise<number[]> {
  const out: number[] = [];
  for (const tid of await readdir(`/proc/${pid}/task`)) {
    const st = await readFile(`/proc/${pid}/task/${tid}/stat`, 'utf8').catch(() => '');
    if (st) out.push(Number(st.slice(st.lastIndexOf(')') + 2).split(' ')[16]));
  }
  return out;
}

/** Every file (not directory) under `dir`, recursively; sockets included. */
async function allFiles(dir: string): Promise<string[]> {
  const out: string[] = [];
  for (const e of await readdir(dir, { withFileTypes: true })) {
    if (e.isDirectory()) out.push(...(await allFiles(join(dir, e.name))));
    else out.push(join(dir, e.name));
  }
  return out;
}

/** Set by a test to look at a receiver snapshot's source while it is stopped after the copy. */
let onSnapshotCopied: ((e: { snapshotId: string; qmp: QmpClient }) => Promise<void>) | undefined;
let onSnapshotStage: ((e: { snapshotId: string; stage: 'armed' | 'saved' | 'loaded' | 'switched'; replacement: QmpClient }) => Promise<void>) | undefined;

/**
 * The 4 KiB pages (by guest-physical page number) in which a dump of guest-physical memory
 * and a memory image differ, leaving out 0xa0000-0xfffff, where a dump shows the firmware
 * and option ROMs instead of the RAM beneath them.
 */
async function differingPages(dump: string, image: string): Promise<number[]> {
  const [a, b] = await Promise.all([readFile(dump), readFile(image)]);
  const out: number[] = [];
  if (a.length !== b.length) return [-1];
  for (let off = 0; off < a.length; off += 4096) {
    if (off >= 0xa0000 && off < 0x100000) continue;
    if (a.compare(b, off, off + 4096, off, off + 4096) !== 0) out.push(off / 4096);
  }
  return out;
}

// Written to a temporary file and renamed: `echo > /tmp/counter` truncates first, and a read
// (or a snapshot) between the truncate and the write saw an empty file, i.e. counter 0 (a CI
// run failed on it with a busy guest under TCG).
const COUNTER = "setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/counter.t; mv /tmp/counter.t /tmp/counter; sleep 0.2; done' </dev/null >/dev/null 2>&1 &";

const newDriver = (): QemuVmmDriver => new QemuVmmDriver({ root, accel: 'tcg', logger, standby: NO_REFILL, snapshotCopied: (e) => onSnapshotCopied?.(e) ?? Promise.resolve(), snapshotStage: (e) => onSnapshotStage?.(e) ?? Promise.resolve() });

/** A new agent's driver on the same root after the old one died (`detach`ed first, unless `dead`): it recovers, and becomes `driver`. */
async function restartAgent(opts: { dead?: boolean } = {}): Promise<RecoveryReport> {
  if (!opts.dead) driver.detach();
  driver = newDriver();
  return driver.recover('adopt');
}

/**
 * One child of each snapshot, which must answer `script` with `out`; then it is destroyed. A
 * script that checks disk contents drops the guest's page cache first: the snapshot's RAM
 * carries recently written files, and reads would not reach the disk.
 */
async function childrenSee(cases: ReadonlyArray<{ of: LocalSnapshot; id: string; script: string; out: string }>): Promise<void> {
  for (const c of cases) {
    const [vm] = await driver.fork(c.of, [{ vmId: c.id, hostname: c.id }]);
    expect(vm?.state).toBe('running');
    expect(await sh(c.id, c.script)).toBe(c.out);
    await driver.destroy(c.id);
  }
}

beforeAll(async () => {
  image = await ensureImage('tiny');
  root = tempDir('ffv-');
  driver = newDriver();
  await driver.create({ vmId: 'tpl', image, memoryMib: MEM, vcpus: 1, hostname: 'tpl' });
  await sh('tpl', COUNTER);
  await driver.writeFile('tpl', '/dev/shm/marker', Buffer.from('tmpfs-before-snapshot'));
  await sh('tpl', 'echo disk-before-snapshot > /data/marker && sync');
  await new Promise((r) => setTimeout(r, 500));
  snap = await driver.snapshot('tpl', 'snap-tpl');
});

afterAll(async () => {
  await driver?.close().catch(() => undefined);
  // Safety net by PID, even if a test failed half-way.
  if (root) {
    for (const pid of await ourProcesses()) killHard(pid);
    await rm(root, { recursive: true, force: true });
  }
});

describe('QemuVmmDriver (real QEMU)', () => {
  it('snapshot_whenTemplateSnapshotted_sourceKeepsRunningAndImageIsImmutable', async () => {
    expect(snap.manifest.method).toBe('shared-file');
    expect(snap.manifest.config).toMatchObject({ machineType: 'microvm', memoryMib: MEM, accel: 'tcg', cpuModel: 'max' });
    expect(snap.manifest.sourcePauseMs).toBeGreaterThan(0);
    const a = Number(await sh('tpl', 'cat /tmp/counter'));
    await new Promise((r) => setTimeout(r, 700));
    const b = Number(await sh('tpl', 'cat /tmp/counter'));
    expect(b).toBeGreaterThan(a);
    for (const f of ['mem.img', 'state.bin', 'disk.qcow2']) {
      expect((await stat(join(snap.dir, f))).mode & 0o777).toBe(0o444);
    }
    expect(driver.get('tpl')?.baseSnapshotId).toBe('snap-tpl');
  });

  it('restore_whenSnapshotRestored_counterProcessAndTmpfsFileSurvive', async () => {
    const vm = await driver.restore(snap, { vmId: 'r1', hostname: 'r1', sandboxId: 'sb-r1' });
    expect(vm.state).toBe('running');
    expect((await driver.readFile('r1', '/dev/shm/marker')).toString()).toBe('tmpfs-before-snapshot');
    expect(await sh('r1', 'cat /data/marker')).toBe('disk-before-snapshot');
    const a = Number(await sh('r1', 'cat /tmp/counter'));
    await new Promise((r) => setTimeout(r, 700));
    const b = Number(await sh('r1', 'cat /tmp/counter'));
    expect(a).toBeGreaterThan(0);
    expect(b).toBeGreaterThan(a);
    expect(await sh('r1', 'hostname')).toBe('r1');
    expect(await sh('r1', 'cat /run/forkfleet/sandbox-id')).toBe('sb-r1');
    await driver.destroy('r1');
  });

  it('fork_whenFourChildren_eachDivergesIndependentlyWithFreshRngClockAndIdentity', async () => {
    const memBefore = await digest(join(snap.dir, 'mem.img'));
    const diskBefore = await digest(join(snap.dir, 'disk.qcow2'));
    const ids = ['c0', 'c1', 'c2', 'c3'];
    const vms = await driver.fork(snap, ids.map((vmId) => ({ vmId, hostname: `h-${vmId}`, sandboxId: `sb-${vmId}` })));
    expect(vms.map((v) => v.state)).toEqual(['running', 'running', 'running', 'running']);
    // Clock: set at hand-out, so checked first (a TCG guest's clock can drift under heavy host
    // load afterwards); within 1 s of the host, bounded by the exec round trip.
    const before = Date.now() / 1000;
    const clocks = await Promise.all(ids.map((id) => sh(id, 'date +%s')));
    const after = Date.now() / 1000;
    for (const c of clocks) {
      expect(Number(c)).toBeGreaterThanOrEqual(Math.floor(before) - 1);
      expect(Number(c)).toBeLessThanOrEqual(Math.ceil(after) + 1);
    }
    // Each child writes its own data to tmpfs and disk.
    await Promise.all(ids.map((id) => sh(id, `echo ${id} > /dev/shm/me && echo ${id} > /data/me && sync`)));
    for (const id of ids) {
      expect(await sh(id, 'cat /dev/shm/me /data/me')).toBe(`${id}\n${id}`);
      expect(await sh(id, 'hostname')).toBe(`h-${id}`);
      expect(await sh(id, 'cat /run/forkfleet/sandbox-id')).toBe(`sb-${id}`);
    }
    // RNG: every child produces different bytes.
    const rng = await Promise.all(ids.map((id) => sh(id, 'head -c 32 /dev/urandom | od -An -tx1 | tr -d " \\n"')));
    expect(new Set(rng).size).toBe(ids.length);
    // The parent's memory image and disk layer are untouched by the children.
    expect(await digest(join(snap.dir, 'mem.img'))).toBe(memBefore);
    expect(await digest(join(snap.dir, 'disk.qcow2'))).toBe(diskBefore);
    for (const id of ids.slice(1)) await driver.destroy(id);
  });

  it('snapshot_whenForkedChildSnapshotted_branchOfBranchRestoresAndChildContinues', async () => {
    // c0 is a clone (share=off); its snapshot goes through a receiver.
    await sh('c0', 'echo branch-data > /dev/shm/branch && echo branch-disk > /data/branch && sync');
    const snapping = driver.snapshot('c0', 'snap-c0');
    // A guest call while the snapshot holds the VM (its sandbox stays RUNNING) waits for it,
    // instead of failing for good with "vm c0 is snapshotting".
    const until = Date.now() + 10_000;
    while (driver.get('c0')?.state !== 'snapshotting' && Date.now() < until) await new Promise((r) => setTimeout(r, 5));
    expect(driver.get('c0')?.state).toBe('snapshotting');
    const during = sh('c0', 'echo during');
    const s2 = await snapping;
    expect(await during).toBe('during');
    expect(s2.manifest.method).toBe('receiver');
    expect(s2.manifest.parentSnapshotId).toBe('snap-tpl');
    // The source continues and can write after its snapshot.
    await sh('c0', 'echo after > /dev/shm/after');
    const [g] = await driver.fork(s2, [{ vmId: 'g0', hostname: 'g0' }]);
    expect(g?.state).toBe('running');
    expect(await sh('g0', 'cat /dev/shm/branch /data/branch /dev/shm/me /dev/shm/marker')).toBe(
      'branch-data\nbranch-disk\nc0\ntmpfs-before-snapshot',
    );
    expect(await sh('g0', 'test -e /dev/shm/after || echo absent')).toBe('absent');
    const a = Number(await sh('g0', 'cat /tmp/counter'));
    await new Promise((r) => setTimeout(r, 700));
    expect(Number(await sh('g0', 'cat /tmp/counter'))).toBeGreaterThan(a);
    // A snapshot of a snapshot's child: the grand-child snapshots too (branches of branches).
    const s3 = await driver.snapshot('g0', 'snap-g0');
    const [gg] = await driver.fork(s3, [{ vmId: 'gg0' }]);
    expect(await sh(gg?.vmId ?? '', 'cat /data/branch')).toBe('branch-disk');
    await driver.destroy('gg0');
    await driver.destroy('g0');
    await driver.destroy('c0');
    await expect(driver.deleteSnapshot(s2)).rejects.toThrow(/in use by snapshot snap-g0/);
    await driver.deleteSnapshot(s3);
    await driver.deleteSnapshot(s2);
  });

  it('snapshot_ofACloneWhileAFileIsWrittenIntoIt_waitsForTheWrite_soItsChildHasTheWholeFileOrNone', async () => {
    // A clone's snapshot goes through a receiver: the guest stops while its RAM is copied. A
    // WriteFile is several guest-agent commands (the open truncates, the writes follow); the
    // snapshot must not stop the guest between them.
    const [cw] = await driver.fork(snap, [{ vmId: 'cw', hostname: 'cw' }]);
    expect(cw?.state).toBe('running');
    const data = randomBytes(6 << 20);
    let ch: VmInfo | undefined;
    let s: Awaited<ReturnType<typeof driver.snapshot>> | undefined;
    try {
      const t0 = Date.now();
      const writing = driver.writeFile('cw', '/dev/shm/big', data).then(() => Date.now() - t0);
      await new Promise((r) => setTimeout(r, 150));
      s = await driver.snapshot('cw', 'snap-cw');
      expect(s.manifest.method).toBe('receiver');
      const writeMs = await writing;
      [ch] = await driver.fork(s, [{ vmId: 'cw1', hostname: 'cw1' }]);
      const seen = await sh('cw1', 'if [ -e /dev/shm/big ]; then wc -c < /dev/shm/big; sha256sum < /dev/shm/big | cut -d" " -f1; else echo absent; fi');
      expect(seen === 'absent' || seen === `${data.length}\n${createHash('sha256').update(data).digest('hex')}`, `the child saw ${JSON.stringify(seen)} (the write took ${writeMs} ms)`).toBe(true);
      // And the source has it whole.
      expect(await sh('cw', 'wc -c < /dev/shm/big')).toBe(String(data.length));
    } finally {
      if (ch) await driver.destroy('cw1').catch(() => undefined);
      await driver.destroy('cw').catch(() => undefined);
      if (s) await driver.deleteSnapshot(s).catch(() => undefined);
    }
  });

  it('snapshot_ofACloneWhileAnExecRuns_marksIt_andItsChildEndsTheInheritedProgram_whileTheSourcesExecCompletes', async () => {
    // The exec's caller waits on the source; in a child no one polls its copy, and nothing
    // would enforce its timeout: the child ends it before it is handed out.
    expect(snap.manifest.guestExecsRunning).toBeUndefined();
    const [ce] = await driver.fork(snap, [{ vmId: 'ce', hostname: 'ce' }]);
    expect(ce?.state).toBe('running');
    let ch: VmInfo | undefined;
    let s: Awaited<ReturnType<typeof driver.snapshot>> | undefined;
    try {
      const running = driver.exec('ce', { path: '/bin/sh', args: ['-c', 'sleep 3; echo late > /dev/shm/late'], timeoutMs: 60_000 });
      await new Promise((r) => setTimeout(r, 500));
      s = await driver.snapshot('ce', 'snap-ce');
      expect(s.manifest.guestExecsRunning).toBe(true);
      [ch] = await driver.fork(s, [{ vmId: 'ce1', hostname: 'ce1' }]);
      expect(await running).toMatchObject({ exitCode: 0 });
      await new Promise((r) => setTimeout(r, 4000));
      expect(await sh('ce', 'cat /dev/shm/late')).toBe('late');
      expect(await sh('ce1', 'cat /dev/shm/late 2>/dev/null || echo absent')).toBe('absent');
    } finally {
      if (ch) await driver.destroy('ce1').catch(() => undefined);
      await driver.destroy('ce').catch(() => undefined);
      if (s) await driver.deleteSnapshot(s).catch(() => undefined);
    }
  });

  it('snapshot_ofAChildThatKeepsRewritingMemory_orOfAPausedChild_restoresChildrenThatRunClean', async () => {
    // A receiver snapshot copies a clone's RAM while the clone is stopped (under TCG). The live
    // precopy it replaced lost writes of a guest that kept rewriting pages: this test's images
    // then had 5-11 pages that differed from the source's memory, and in a probe 4 of 6
    // children of such snapshots never answered their agent. A paused clone's snapshot hung until the
    // migration timeout (pause-before-switchover with nobody to continue).
    await driver.fork(snap, [{ vmId: 'busy', hostname: 'busy' }]);
    for (const f of ['x', 'y']) await sh('busy', `setsid sh -c 'while true; do dd if=/dev/urandom of=/dev/shm/${f} bs=64k count=64 2>/dev/null; done' </dev/null >/dev/null 2>&1 &`);
    const traces = "dmesg | grep -c 'Call Trace' || true";
    expect(await sh('busy', traces)).toBe('0');
    // The source's memory at the instant its RAM was copied, to compare with each image.
    const dumps = new Map<string, string>();
    onSnapshotCopied = async ({ snapshotId, qmp }) => {
      const file = join(root, `${snapshotId}.dump`);
      await qmp.execute('pmemsave', { val: 0, size: MEM * 1024 * 1024, filename: file });
      dumps.set(snapshotId, file);
    };
    const snaps: LocalSnapshot[] = [];
    try {
      for (let i = 0; i < 4; i++) snaps.push(await driver.snapshot('busy', `snap-busy-${i}`));
      await driver.pause('busy');
      snaps.push(await driver.snapshot('busy', 'snap-busy-paused'));
      await driver.resume('busy');
    } finally {
      onSnapshotCopied = undefined;
    }
    for (const s of snaps) {
      expect(await differingPages(dumps.get(s.manifest.snapshotId) ?? '', join(s.dir, 'mem.img'))).toEqual([]);
      await rm(dumps.get(s.manifest.snapshotId) ?? '', { force: true });
    }
    for (const [i, s] of snaps.entries()) {
      const id = `busy-k${i}`;
      await driver.fork(s, [{ vmId: id }]);
      expect(await sh(id, traces)).toBe('0');
      expect(Number(await sh(id, 'cat /tmp/counter'))).toBeGreaterThan(0);
      await driver.destroy(id);
    }
    await driver.destroy('busy');
    for (const s of snaps.reverse()) await driver.deleteSnapshot(s);
  });

  it('snapshot_ofAChildWhoseSealFails_isSealedByItsRetry_andOneNeverSealedGoesWithItsVm', async () => {
    // The RAM and disk are copied, then writing image.json fails (a directory in its temp
    // file's place stands in for ENOSPC or EIO). The VM's disk layer is backed by that
    // directory now, so it stays; a retry of the same snapshot found it with no manifest, for
    // good, and a destroyed VM left it behind until the agent restarted.
    await driver.fork(snap, [{ vmId: 'us1', hostname: 'us1' }, { vmId: 'us2', hostname: 'us2' }]);
    onSnapshotCopied = async ({ snapshotId }) => {
      if (snapshotId.startsWith('snap-us')) await mkdir(join(root, 'snapshots', snapshotId, 'image.json.tmp'));
    };
    try {
      for (const vm of ['us1', 'us2']) await expect(driver.snapshot(vm, `snap-${vm}`)).rejects.toThrow(/EISDIR/);
    } finally {
      onSnapshotCopied = undefined;
    }
    expect(driver.get('us1')?.state).toBe('running');
    await rm(join(root, 'snapshots', 'snap-us1', 'image.json.tmp'), { recursive: true });
    const again = await driver.snapshot('us1', 'snap-us1');
    expect(again.manifest.snapshotId).toBe('snap-us1');
    await driver.fork(again, [{ vmId: 'us1-k' }]);
    expect(await sh('us1-k', 'echo up')).toBe('up');
    await driver.destroy('us2');
    await expect(stat(join(root, 'snapshots', 'snap-us2'))).rejects.toMatchObject({ code: 'ENOENT' });
    for (const vm of ['us1-k', 'us1']) await driver.destroy(vm);
    await driver.deleteSnapshot(again);
  });

  it('snapshot_ofAPausedChild_twiceWhileItStaysPaused_succeedsBothTimes_andTheSecondRestoresAChildThatRuns', async () => {
    // A paused clone's snapshot leaves its QEMU in postmigrate, which refuses another migration.
    await driver.fork(snap, [{ vmId: 'still', hostname: 'still' }]);
    await sh('still', 'echo before > /tmp/mark');
    await driver.pause('still');
    // A resume whose `cont` timed out in the driver but ran in QEMU later: the VM runs while
    // recorded paused. Its snapshot stops it again before anything is copied.
    const qmp = driver.qmpOf('still');
    await qmp.execute('cont');
    const sent: string[] = [];
    const execute = qmp.execute.bind(qmp);
    qmp.execute = ((c: string, args?: Record<string, unknown>) => (sent.push(c), execute(c, args))) as typeof qmp.execute;
    const first = await driver.snapshot('still', 'snap-still-1').finally(() => (qmp.execute = execute));
    expect(sent.indexOf('stop')).toBeGreaterThanOrEqual(0);
    expect(sent.indexOf('stop')).toBeLessThan(sent.findIndex((c) => c.startsWith('blockdev-snapshot') || c === 'migrate'));
    const second = await driver.snapshot('still', 'snap-still-2');
    expect(driver.get('still')?.state).toBe('paused');
    await driver.fork(second, [{ vmId: 'still-k' }]);
    expect(await sh('still-k', 'cat /tmp/mark')).toBe('before');
    await driver.destroy('still-k');
    await driver.resume('still');
    expect(await sh('still', 'cat /tmp/mark')).toBe('before');
    await driver.destroy('still');
    for (const s of [second, first]) await driver.deleteSnapshot(s);
  });

  it('fork_whenStandbyWarm_childIsTheStandbyQemuWithSnapshotStateAndSnapshotsLikeAnyChild', async () => {
    expect(await driver.warm(snap, 2)).toBe(2);
    const standbyDir = join(root, 'standby');
    const standbyPids = await Promise.all((await readdir(standbyDir)).map(async (d) => Number((await readFile(join(standbyDir, d, 'qemu.0.pid'), 'utf8')).trim())));
    // Standbys start as background work (nice 19); a claimed one runs at normal priority.
    for (const pid of standbyPids) expect(await niceOfThreads(pid)).toEqual(expect.arrayContaining([19]));
    const [vm] = await driver.fork(snap, [{ vmId: 'w0', hostname: 'w0', sandboxId: 'sb-w0' }]);
    expect(standbyPids).toContain(vm?.pid);
    expect(new Set(await niceOfThreads(vm?.pid ?? 0))).toEqual(new Set([0]));
    expect((await driver.readFile('w0', '/dev/shm/marker')).toString()).toBe('tmpfs-before-snapshot');
    expect(await sh('w0', 'cat /data/marker; hostname; cat /run/forkfleet/sandbox-id')).toBe('disk-before-snapshot\nw0\nsb-w0');
    const a = Number(await sh('w0', 'cat /tmp/counter'));
    await new Promise((r) => setTimeout(r, 700));
    expect(Number(await sh('w0', 'cat /tmp/counter'))).toBeGreaterThan(a);
    // Its snapshot makes its disk a read-only backing file, which QEMU reopens by the name it
    // was started with: the standby's old directory name must still lead to it.
    await sh('w0', 'echo from-standby > /data/w && sync');
    const s = await driver.snapshot('w0', 'snap-w0');
    const [g] = await driver.fork(s, [{ vmId: 'wg0' }]);
    expect(await sh(g?.vmId ?? '', 'cat /data/w')).toBe('from-standby');
    await driver.destroy('wg0');
    await driver.destroy('w0');
    await driver.deleteSnapshot(s);
    // The claimed standby's name went with its VM; the other standby is still there (the
    // agent-restart test below shows recover() reaps it).
    const left = await readdir(standbyDir);
    expect(left).toHaveLength(1);
    expect(standbyPids.filter((p) => p !== vm?.pid).every(isAlive)).toBe(true);
  });

  it('recover_ofAWorkdirWithoutVmJsonWhosePidFileNamesAVmClaimedFromAStandby_reapsTheWorkdir_andLeavesThatVmRunning', async () => {
    // A dead QEMU's pid file, its pid since reused by the QEMU of another VM that was claimed
    // from a standby (that QEMU's command line names standby/<id>/, as a claimed standby of
    // this workdir's would): recover() must not kill it.
    await driver.warm(snap, 1); // one standby (the test before may have left it warm already)
    const [vm] = await driver.fork(snap, [{ vmId: 'w9', hostname: 'w9' }]);
    const ghost = join(root, 'vms', 'ghost-w9');
    try {
      expect((await cmdlineOf(vm!.pid!))?.some((a) => a.includes(`${join(root, 'standby')}/`))).toBe(true);
      await mkdir(ghost, { recursive: true });
      await writeFile(join(ghost, 'qemu.0.pid'), `${vm!.pid}\n`);
      const report = await restartAgent();
      expect([report.reaped.includes('ghost-w9'), report.adopted.includes('w9')]).toEqual([true, true]);
      expect(isAlive(vm!.pid!)).toBe(true);
      expect(await sh('w9', 'hostname')).toBe('w9');
    } finally {
      await rm(ghost, { recursive: true, force: true });
      await driver.destroy('w9').catch(() => undefined);
    }
  });

  it('migrate_whenRestoredOnAnotherHostsDriver_directlyOrIntoAnIncomingStandby_vmHasSnapshotStateOwnIdentitySnapshotsAndLeavesNothing', async () => {
    // Another "host": a second driver with its own root, and its RAM pool on a huge-page tmpfs
    // of the test's own (ADR 0016); the stream crosses loopback TCP.
    const ramMount = join(root, 'ram');
    const dest = new QemuVmmDriver({ root: join(root, 'host2'), accel: 'tcg', logger, standby: NO_REFILL, ram: { mount: ramMount, keep: 1, maxMib: 1024 } });
    const ramDir = ramDirFor(ramMount, join(root, 'host2'));
    const server = net.createServer({ pauseOnConnect: true });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    const port = (server.address() as net.AddressInfo).port;
    const accepted = new Promise<net.Socket>((r) => server.once('connection', r));
    try {
      // The layer's header names the image disk by another host's path: it is rebased onto ours.
      const src = { manifest: snap.manifest, image, diskLayerBacking: '/elsewhere/disk.qcow2', writeDiskLayer: (p: string) => copyFile(join(snap.dir, snap.manifest.files.disk), p) };
      const incoming = await dest.prepareIncoming(src, { vmId: 'm0', hostname: 'm0', sandboxId: 'sb-m0' });
      const [sent, vm] = await Promise.all([driver.migrateOut(snap, { host: '127.0.0.1', port }), accepted.then((c) => incoming.load(c))]);
      expect(sent.bytes).toBeGreaterThan(16 << 20);
      expect(vm).toMatchObject({ state: 'running', baseSnapshotId: 'snap-tpl', hostname: 'm0' });
      // Its RAM is its file in the pool, mapped shared in huge pages.
      expect((await cmdlineOf(vm.pid))?.join(' ')).toContain(`mem-path=${join(ramDir, 'vm-m0.ram')},share=on,align=2M`);
      expect((await dest.readFile('m0', '/dev/shm/marker')).toString()).toBe('tmpfs-before-snapshot');
      expect(await sh('m0', 'cat /data/marker; hostname; cat /run/forkfleet/sandbox-id', dest)).toBe('disk-before-snapshot\nm0\nsb-m0');
      const a = Number(await sh('m0', 'cat /tmp/counter', dest));
      await new Promise((r) => setTimeout(r, 700));
      expect(Number(await sh('m0', 'cat /tmp/counter', dest))).toBeGreaterThan(a);
      // The source's QEMU never ran the guest and is gone; nothing of it is left.
      expect((await readdir(join(root, 'standby')).catch(() => [] as string[])).filter((d) => d.startsWith('source-'))).toEqual([]);
      // A migrated VM snapshots and forks like any other, also once it is gone (as after a
      // hibernation): its snapshot stands on nothing in the VM's workdir.
      await sh('m0', 'echo migrated > /data/m && sync', dest);
      const s = await dest.snapshot('m0', 'snap-m0');
      await dest.destroy('m0');
      // Its RAM file went back to the pool (or the pool had filled one), for the next VM of that size.
      await waitFor('a filled RAM file', async () => (await readdir(ramDir)).some((f) => f.startsWith(`free-${MEM}-`)), 30_000);
      expect((await readdir(ramDir)).filter((f) => f.startsWith('vm-'))).toEqual([]);
      const [g] = await dest.fork(s, [{ vmId: 'mg0' }]);
      expect(await sh(g?.vmId ?? '', 'cat /data/m /dev/shm/marker', dest)).toBe('migrated\ntmpfs-before-snapshot');
      await dest.destroy('mg0');
      await dest.deleteSnapshot(s);
      // A prepared VM whose stream never comes is aborted without a trace.
      const unused = await dest.prepareIncoming(src, { vmId: 'm1' });
      await unused.abort();
      expect(await readdir(join(root, 'host2', 'vms'))).toEqual([]);
      expect((await readdir(ramDir)).filter((f) => f.startsWith('vm-'))).toEqual([]);

      // An incoming standby (a QEMU of this configuration started before any stream, waiting
      // with a placeholder disk) takes the next VM: the connection goes to it by getfd, and the
      // snapshot's disk layer replaces the placeholder before QEMU activates it.
      expect(await dest.warmIncoming(src, 1)).toBe(1);
      const standbys2 = join(root, 'host2', 'standby');
      const [waiting] = await readdir(standbys2);
      const standbyPid = Number((await readFile(join(standbys2, waiting ?? '', 'qemu.0.pid'), 'utf8')).trim());
      expect(isAlive(standbyPid)).toBe(true);
      const server2 = net.createServer({ pauseOnConnect: true });
      await new Promise<void>((r) => server2.listen(0, '127.0.0.1', r));
      const accepted2 = new Promise<net.Socket>((r) => server2.once('connection', r));
      try {
        const incoming2 = await dest.prepareIncoming(src, { vmId: 'm2', hostname: 'm2', sandboxId: 'sb-m2' });
        const port2 = (server2.address() as net.AddressInfo).port;
        const [, vm2] = await Promise.all([driver.migrateOut(snap, { host: '127.0.0.1', port: port2 }), accepted2.then((c) => incoming2.load(c))]);
        expect(vm2.pid).toBe(standbyPid);
        expect(vm2).toMatchObject({ state: 'running', baseSnapshotId: 'snap-tpl', hostname: 'm2' });
        expect((await dest.readFile('m2', '/dev/shm/marker')).toString()).toBe('tmpfs-before-snapshot');
        expect(await sh('m2', 'cat /data/marker; hostname; cat /run/forkfleet/sandbox-id', dest)).toBe('disk-before-snapshot\nm2\nsb-m2');
        const b = Number(await sh('m2', 'cat /tmp/counter', dest));
        await new Promise((r) => setTimeout(r, 700));
        expect(Number(await sh('m2', 'cat /tmp/counter', dest))).toBeGreaterThan(b);
        // The disk is the layer, writable: what the VM writes survives its own snapshot.
        await sh('m2', 'echo via-standby > /data/s && sync', dest);
        const s2 = await dest.snapshot('m2', 'snap-m2');
        // Its RAM file was renamed after the VM, like any migrated VM's.
        expect((await readdir(ramDir)).filter((f) => f.startsWith('vm-'))).toEqual(['vm-m2.ram']);
        await dest.destroy('m2');
        const [g2] = await dest.fork(s2, [{ vmId: 'mg2' }]);
        expect(await sh(g2?.vmId ?? '', 'cat /data/s', dest)).toBe('via-standby');
        await dest.destroy('mg2');
        await dest.deleteSnapshot(s2);
      } finally {
        server2.close();
      }
      expect(isAlive(standbyPid)).toBe(false);
      expect(await readdir(standbys2)).toEqual([]);
      expect(await readdir(join(root, 'host2', 'vms'))).toEqual([]);
      expect((await readdir(ramDir)).filter((f) => f.startsWith('vm-'))).toEqual([]);
      // One left waiting when the driver closes goes with it, RAM file and all (checked below).
      expect(await dest.warmIncoming(src, 1)).toBe(1);
    } finally {
      server.close();
      await dest.close();
      if (await tmpfsOptions(ramMount)) execFileSync('umount', [ramMount]);
    }
    // The pool's files and directory went with the driver.
    expect(await readdir(ramMount)).toEqual([]);
  });

  it('migrateOut_whoseDestinationGivesUpMidStream_isCancelledAtOnce_andLeavesNoSourceQemu', async () => {
    // A destination that accepts and never reads (gone, or a listener whose port another
    // restore has by now): the source stops when the caller's signal says so.
    const server = net.createServer({ pauseOnConnect: true });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    const accepted = new Promise<net.Socket>((r) => server.once('connection', r));
    const ac = new AbortController();
    try {
      const out = driver.migrateOut(snap, { host: '127.0.0.1', port: (server.address() as net.AddressInfo).port }, ac.signal);
      out.catch(() => undefined);
      const conn = await accepted;
      await new Promise((r) => setTimeout(r, 300));
      const t0 = Date.now();
      ac.abort(new Error('destination gave up'));
      await expect(out).rejects.toThrow(/cancelled|destination gave up/);
      expect(Date.now() - t0).toBeLessThan(5_000);
      conn.destroy();
      expect((await readdir(join(root, 'standby')).catch(() => [] as string[])).filter((d) => d.startsWith('source-'))).toEqual([]);
      // Already given up before it starts: nothing is launched.
      await expect(driver.migrateOut(snap, { host: '127.0.0.1', port: 1 }, AbortSignal.abort(new Error('too late')))).rejects.toThrow('too late');
    } finally {
      server.close();
    }
  });

  it('migrate_overTls_whenBothHostsHaveTheFleetsCertificates_restoresTheVm_andAPlainTextStreamIsRefused', async () => {
    // Two more "hosts", each with a certificate of one CA naming 127.0.0.1 (as deploy/ issues them).
    const pki = join(root, 'tls');
    const tlsDir = (name: string): string => writeQemuTlsDir(join(pki, `qemu-${name}`), devPeerTls(pki, name, '127.0.0.1'));
    const src = new QemuVmmDriver({ root: join(root, 'tls-src'), accel: 'tcg', logger, standby: NO_REFILL, migrationTlsDir: tlsDir('src') });
    const dest = new QemuVmmDriver({ root: join(root, 'tls-dst'), accel: 'tcg', logger, standby: NO_REFILL, migrationTlsDir: tlsDir('dst') });
    const server = net.createServer({ pauseOnConnect: true });
    await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
    const port = (server.address() as net.AddressInfo).port;
    const next = (): Promise<net.Socket> => new Promise((r) => server.once('connection', r));
    const layer = { manifest: snap.manifest, image, diskLayerBacking: image.disk, writeDiskLayer: (p: string) => copyFile(join(snap.dir, snap.manifest.files.disk), p) };
    try {
      const incoming = await dest.prepareIncoming(layer, { vmId: 't0', hostname: 't0', sandboxId: 'sb-t0' });
      const accepted = next();
      const [sent, vm] = await Promise.all([src.migrateOut(snap, { host: '127.0.0.1', port }), accepted.then((c) => incoming.load(c))]);
      expect(sent.bytes).toBeGreaterThan(16 << 20);
      expect(vm).toMatchObject({ state: 'running', baseSnapshotId: 'snap-tpl', hostname: 't0' });
      expect(await sh('t0', 'cat /data/marker; hostname', dest)).toBe('disk-before-snapshot\nt0');
      // It snapshots like any VM (its own migration to a file is not the peer stream's TLS).
      await sh('t0', 'echo over-tls > /data/t && sync', dest);
      const st = await dest.snapshot('t0', 'snap-t0');
      await dest.destroy('t0');
      const [tg] = await dest.fork(st, [{ vmId: 'tg0' }]);
      expect(await sh(tg?.vmId ?? '', 'cat /data/t', dest)).toBe('over-tls');
      await dest.destroy('tg0');
      await dest.deleteSnapshot(st);
      // A source without the certificates (plain text) gets nothing in: the destination's QEMU
      // drops the stream, the source says so (as MigrateSnapshot's failure tells migrateFrom),
      // and the load fails at once, leaving no VM.
      const refused = await dest.prepareIncoming(layer, { vmId: 't1' });
      const accepted2 = next();
      const sourceGone = new AbortController();
      const t1 = Date.now();
      const out = driver.migrateOut(snap, { host: '127.0.0.1', port }).catch((e: unknown) => {
        sourceGone.abort(e);
        throw e;
      });
      const [sentPlain, load] = await Promise.allSettled([out, accepted2.then((c) => refused.load(c, sourceGone.signal))]);
      expect(sentPlain.status).toBe('rejected');
      expect(load.status).toBe('rejected');
      expect(Date.now() - t1).toBeLessThan(30_000);
      expect(await readdir(join(root, 'tls-dst', 'vms'))).toEqual([]);
    } finally {
      server.close();
      await src.close();
      await dest.close();
    }
  });

  it.skipIf(!findSocat())('migrate_throughTlsRelays_qemuStreamsPlainTextToUnixSocketsFromItsOwnNetnsAndTheRelaysCarryItOverTls_restoresTheVm_andEitherEndMayBeQemusOwnTls', async () => {
    // As two agents with FF_PEER_MIGRATION_TLS=relay: each QEMU speaks to a unix socket on its
    // own host, two socat relays carry the stream over mutual TLS and check each other's host.
    const pki = join(root, 'relay-pki');
    const relayOf = (name: string) => ({ socat: findSocat()!, tlsDir: writeQemuTlsDir(join(pki, `qemu-${name}`), devPeerTls(pki, name, '127.0.0.1')), socketDir: join(root, `relay-${name}`) });
    const [rs, rd] = [relayOf('rsrc'), relayOf('rdst')];
    // As main.ts sets it up with relays: the source QEMU runs in a network namespace of its own.
    // It keeps one source QEMU ready after a stream (perSnapshot 1), checked below.
    const src = new QemuVmmDriver({ root: join(root, 'relay-src'), accel: 'tcg', logger, standby: { perSnapshot: 1 }, migrationTlsDir: rs.tlsDir, migrationViaUnix: true });
    const dest = new QemuVmmDriver({ root: join(root, 'relay-dst'), accel: 'tcg', logger, standby: NO_REFILL, migrationTlsDir: rd.tlsDir });
    const srcQemuTls = new QemuVmmDriver({ root: join(root, 'relay-src-qemu-tls'), accel: 'tcg', logger, standby: NO_REFILL, migrationTlsDir: rs.tlsDir });
    const layer = { manifest: snap.manifest, image, diskLayerBacking: image.disk, writeDiskLayer: (p: string) => copyFile(join(snap.dir, snap.manifest.files.disk), p) };
    const unixPath = join(root, 'relay-in.sock');
    const inbound = await listenRelay({ ...rd, unixPath, peerHostId: 'rsrc', acceptTimeoutMs: 20_000, bindHost: '127.0.0.1', fromHost: '127.0.0.1' });
    try {
      const incoming = await dest.prepareIncoming(layer, { vmId: 'r0', hostname: 'r0', sandboxId: 'sb-r0' });
      const [sent, vm] = await Promise.all([
        migrateOutThroughRelay(rs, { host: '127.0.0.1', port: inbound.port, hostId: 'rdst' }, (to) => src.migrateOut(snap, to)),
        inbound.verified.then(() => incoming.load({ unixPath })),
      ]);
      expect(sent.bytes).toBeGreaterThan(16 << 20);
      expect(vm).toMatchObject({ state: 'running', baseSnapshotId: 'snap-tpl', hostname: 'r0' });
      expect(await sh('r0', 'cat /data/marker; hostname', dest)).toBe('disk-before-snapshot\nr0');
      expect((await inbound.exited).code).toBe(0);
      await dest.destroy('r0');
      // The source QEMU made ready for the next stream runs in a network namespace of its own.
      const sources = join(root, 'relay-src', 'standby');
      let sourcePid = 0;
      await waitFor('a ready migration source', async () => {
        const d = (await readdir(sources)).find((x) => x.startsWith('source-'));
        sourcePid = d ? Number((await readFile(join(sources, d, 'qemu.0.pid'), 'utf8').catch(() => '')).trim()) : 0;
        return sourcePid > 0 && isAlive(sourcePid);
      }, 30_000);
      expect(await netnsOf(sourcePid)).toBeDefined();
      expect(await netnsOf(sourcePid)).not.toBe(await netnsOf('self'));

      // Mixed ends, as while a fleet moves host by host from QEMU's TLS (=qemu) to relays: the
      // wire is TLS with the same certificates either way.
      // 1. A relay source to a destination whose QEMU reads the connection with its own TLS.
      const server = net.createServer({ pauseOnConnect: true });
      await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
      try {
        const accepted = new Promise<net.Socket>((r) => server.once('connection', r));
        const toQemuTls = await dest.prepareIncoming(layer, { vmId: 'r1', hostname: 'r1' });
        const [, vm1] = await Promise.all([
          migrateOutThroughRelay(rs, { host: '127.0.0.1', port: (server.address() as net.AddressInfo).port, hostId: 'rdst' }, (to) => src.migrateOut(snap, to)),
          accepted.then((c) => toQemuTls.load(c)),
        ]);
        expect(vm1).toMatchObject({ state: 'running', hostname: 'r1' });
      } finally {
        server.close();
      }
      await dest.destroy('r1');
      // 2. A source QEMU with its own TLS to a destination relay.
      const unixPath2 = join(root, 'relay-in2.sock');
      const inbound2 = await listenRelay({ ...rd, unixPath: unixPath2, peerHostId: 'rsrc', acceptTimeoutMs: 20_000, bindHost: '127.0.0.1', fromHost: '127.0.0.1' });
      try {
        const fromQemuTls = await dest.prepareIncoming(layer, { vmId: 'r2', hostname: 'r2' });
        // Such a source has no network of its own to reach a TCP target from.
        await expect(src.migrateOut(snap, { host: '127.0.0.1', port: inbound2.port })).rejects.toThrow('stream to a unix socket');
        const [, vm2] = await Promise.all([srcQemuTls.migrateOut(snap, { host: '127.0.0.1', port: inbound2.port }), inbound2.verified.then(() => fromQemuTls.load({ unixPath: unixPath2 }))]);
        expect(vm2).toMatchObject({ state: 'running', hostname: 'r2' });
        expect(await sh('r2', 'hostname', dest)).toBe('r2');
      } finally {
        await inbound2.stop();
      }
      await dest.destroy('r2');
      expect(await readdir(join(root, 'relay-dst', 'vms'))).toEqual([]);
      expect(await readdir(rs.socketDir)).toEqual([]);
    } finally {
      await inbound.stop();
      await src.close();
      await srcQemuTls.close();
      await dest.close();
    }
  });

  it('exec_ofACommandThatLeavesAProcessRunning_returnsWhenTheCommandExits_withItsOutputAndStdin_andTheProcessLivesOn', async () => {
    const t0 = Date.now();
    const r = await driver.exec('tpl', { path: '/bin/sh', args: ['-c', 'sleep 300 & echo $!; cat; echo err >&2; exit 3'], stdin: Buffer.from('from stdin\n'), timeoutMs: 20_000 });
    expect(Date.now() - t0).toBeLessThan(10_000);
    expect(r.timedOut).toBeUndefined();
    expect(r.exitCode).toBe(3);
    const [pid, echoed] = r.stdout.toString().trim().split('\n');
    expect(echoed).toBe('from stdin');
    expect(r.stderr.toString()).toBe('err\n');
    expect(await sh('tpl', `kill -0 ${pid} && echo alive`)).toBe('alive');
    await sh('tpl', `kill ${pid}`);
    // The wrapper's files are gone (but those of the wrapper running this check, our parent).
    expect(await sh('tpl', 'ls -a /tmp | grep ff-exec | grep -v "ff-exec-$PPID[.]" | wc -l')).toBe('0');
  });

  it('exec_withACwd_runsThere_andADirectoryItCannotEnter_failsNamingCwd_notAsTheProgramsExit', async () => {
    expect((await driver.exec('tpl', { path: '/bin/pwd', cwd: '/etc' })).stdout.toString()).toBe('/etc\n');
    // A program's own exit 125 with a line like the wrapper's is still the program's.
    const own = await driver.exec('tpl', { path: '/bin/sh', args: ['-c', 'echo "ff-exec-x cwd-missing" >&2; exit 125'], cwd: '/' });
    expect([own.exitCode, own.stderr.toString()]).toEqual([125, 'ff-exec-x cwd-missing\n']);
    const fails = async (cwd: string): Promise<ForkfleetError> => (await driver.exec('tpl', { path: '/bin/true', cwd }).then(() => undefined, (e: unknown) => e)) as ForkfleetError;
    const missing = await fails('/no/such/dir');
    expect([missing.kind, missing.field, missing.message]).toEqual(['not_found', 'cwd', 'cwd: /no/such/dir: no such directory (in the guest)']);
    const file = await fails('/bin/sh');
    expect([file.kind, file.field]).toEqual(['not_found', 'cwd']);
    expect(file.message).toMatch(/not a directory/);
    // No wrapper files are left by the refused ones.
    expect(await sh('tpl', 'ls -a /tmp | grep ff-exec | grep -v "ff-exec-$PPID[.]" | wc -l')).toBe('0');
  });

  it('exec_inTheGuest_addsGivenVariablesToItsEnvironment_outOfEveryCommandLine_andReportsASignalDeathAsTheSignal', async () => {
    // The guest's own PATH stays; a name like the wrapper's own works; the value is in no argv.
    const env = await driver.exec('tpl', { path: '/bin/sh', args: ['-c', 'printf "%s|%s|%s|" "$FF_SECRET" "$n" "${PATH:+path}"; cat /proc/[0-9]*/cmdline 2>/dev/null | tr "\\000" " " | grep -c s3cr3t-v4lu[e]'], env: ['FF_SECRET=s3cr3t-v4lue', 'n=7'] });
    expect(env.stdout.toString()).toBe('s3cr3t-v4lue|7|path|0\n');
    const killed = await driver.exec('tpl', { path: '/bin/sh', args: ['-c', 'kill -TERM $$'] });
    expect([killed.signal, killed.exitCode, killed.stderr.toString()]).toEqual([15, -1, '']);
    expect((await driver.exec('tpl', { path: '/bin/sh', args: ['-c', 'exit 3'] })).exitCode).toBe(3);
  });

  it('exec_withOnOutput_passesALongCommandsOutputWhileItRuns_andEveryByteOnceInOrder', async () => {
    const got: Array<{ stream: string; text: string; at: number }> = [];
    const onOutput = (stream: string, data: Buffer): void => void got.push({ stream, text: data.toString(), at: Date.now() });
    const r = await driver.exec('tpl', { path: '/bin/sh', args: ['-c', 'echo first; echo oops >&2; sleep 2; echo second'], timeoutMs: 20_000, onOutput });
    const endedAt = Date.now();
    expect(r.exitCode).toBe(0);
    expect(r.stdout.length + r.stderr.length).toBe(0);
    expect(got.filter((g) => g.stream === 'stdout').map((g) => g.text).join('')).toBe('first\nsecond\n');
    expect(got.filter((g) => g.stream === 'stderr').map((g) => g.text).join('')).toBe('oops\n');
    // "first" came while the command slept, not with its exit.
    expect(endedAt - got.find((g) => g.text.startsWith('first'))!.at).toBeGreaterThan(1000);
    // A short command's output all comes at its exit, the same way.
    const quick: string[] = [];
    await driver.exec('tpl', { path: '/bin/echo', args: ['hi'], onOutput: (_s, d) => void quick.push(d.toString()) });
    expect(quick.join('')).toBe('hi\n');
  });

  it('exec_ofMoreOutputThanQemuGaCanHold_returnsAllOfIt_inPieces_andTheGuestAgentLivesOn', async () => {
    // 8 MB of stdout handed to qemu-ga whole got it OOM-killed in this 128 MiB guest.
    const script = 'head -c 8000000 /dev/zero | tr "\\0" a; echo done >&2';
    const r = await driver.exec('tpl', { path: '/bin/sh', args: ['-c', script], timeoutMs: 120_000 });
    expect(r.exitCode).toBe(0);
    expect(r.stdout.length).toBe(8_000_000);
    expect(r.stdout.every((b) => b === 0x61)).toBe(true);
    expect(r.stderr.toString()).toBe('done\n');
    expect(r.outputTruncated).toBeUndefined();
    // Streamed (as the API runs it): every byte once, in order.
    const got: Buffer[] = [];
    const s = await driver.exec('tpl', { path: '/bin/sh', args: ['-c', script], timeoutMs: 120_000, onOutput: (stream, d) => void (stream === 'stdout' && got.push(Buffer.from(d))) });
    expect(s.exitCode).toBe(0);
    const all = Buffer.concat(got);
    expect(all.length).toBe(8_000_000);
    expect(all.every((b) => b === 0x61)).toBe(true);
    // qemu-ga still answers, and no output file is left behind.
    expect(await sh('tpl', 'ls -a /tmp | grep ff-exec | grep -v "ff-exec-$PPID[.]" | wc -l')).toBe('0');
  }, 300_000);

  it('guestAgent_isSparedByTheOomKiller_andStartedAgainWhenKilled', async () => {
    expect(await sh('tpl', 'cat /proc/$(pidof qemu-ga)/oom_score_adj')).toBe('-1000');
    const before = await sh('tpl', 'pidof qemu-ga');
    // Killed a second after this exec has returned (nothing of ours in flight then).
    await driver.exec('tpl', { path: '/bin/sh', args: ['-c', '(sleep 1; kill -9 $(pidof qemu-ga)) >/dev/null 2>&1 &'], timeoutMs: 10_000 });
    await new Promise((r) => setTimeout(r, 3000));
    const after = await sh('tpl', 'pidof qemu-ga');
    expect(after).not.toBe(before);
    expect(await sh('tpl', 'echo back')).toBe('back');
  }, 120_000);

  it('exec_pastItsTimeout_killsTheCommand_andSaysTimedOut_withWhatItWrote', async () => {
    const t0 = Date.now();
    // The program and what it started: a shell waiting on a sleep.
    const r = await driver.exec('tpl', { path: '/bin/sh', args: ['-c', 'echo started; sleep 301; echo never'], timeoutMs: 1500 });
    expect(Date.now() - t0).toBeLessThan(8000);
    expect(r.timedOut).toBe(true);
    expect(r.stdout.toString()).toBe('started\n');
    expect(await sh('tpl', 'ps | grep -c "[s]leep 301" || true')).toBe('0');
  });

  it('exec_whenItsSignalAborts_killsTheCommandAndWhatItStarted_andSaysCancelled', async () => {
    // Aborted while it runs: killed with its child, and what it wrote comes back.
    const ac = new AbortController();
    const t0 = Date.now();
    setTimeout(() => ac.abort(), 1500);
    const r = await driver.exec('tpl', { path: '/bin/sh', args: ['-c', 'echo started; sleep 302; echo never'], timeoutMs: 60_000, signal: ac.signal });
    expect(Date.now() - t0).toBeLessThan(8000);
    expect(r.cancelled).toBe(true);
    expect(r.timedOut).toBeUndefined();
    expect(r.stdout.toString()).toBe('started\n');
    // Aborted before the guest has even started it: it never runs, or is killed once it does.
    const early = new AbortController();
    const pending = driver.exec('tpl', { path: '/bin/sh', args: ['-c', 'sleep 303'], timeoutMs: 60_000, signal: early.signal });
    early.abort();
    expect((await pending).cancelled).toBe(true);
    expect(await sh('tpl', 'ps | grep -c "[s]leep 30[23]" || true')).toBe('0');
  });

  it('pause_thenResume_guestContinues', async () => {
    await driver.pause('tpl');
    expect(driver.get('tpl')?.state).toBe('paused');
    await expect(driver.exec('tpl', { path: '/bin/true' })).rejects.toThrow(/paused/);
    await driver.resume('tpl');
    expect(await sh('tpl', 'echo ok')).toBe('ok');
  });

  it('resume_afterPauseOfSeconds_guestClockIsSetBackToTheHostsWithinOneSecond', async () => {
    await driver.pause('tpl');
    await new Promise((r) => setTimeout(r, 2500)); // the guest clock stands still meanwhile
    await driver.resume('tpl');
    // The refresh runs in the background after resume; the guest agent serves it before this exec.
    let skew = Infinity;
    for (const end = Date.now() + 15_000; Date.now() < end && Math.abs(skew) > 1; ) {
      const before = Date.now() / 1000;
      const guest = Number(await sh('tpl', 'date +%s'));
      skew = guest - (before + Date.now() / 1000) / 2;
    }
    expect(Math.abs(skew)).toBeLessThanOrEqual(1);
  });

  it('restore_whenHostIncompatible_refusesNamingEveryDifference', async () => {
    const bad: LocalSnapshot = {
      dir: snap.dir,
      manifest: { ...snap.manifest, config: { ...snap.manifest.config, accel: 'kvm', cpuModel: 'host', qemuVersion: '8.2.2', devices: ['virtio-blk-device:qcow2'] } },
    };
    const err = await driver.restore(bad, { vmId: 'never' }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(IncompatibleSnapshotError);
    expect((err as IncompatibleSnapshotError).differences.map((d) => d.field)).toEqual(['qemuVersion', 'accel', 'cpuModel', 'devices']);
    expect((err as Error).message).toMatch(/accel \(snapshot kvm, host tcg\)/);
    expect(driver.get('never')).toBeUndefined();
  });

  it('crash_whenQemuKilledWith9_isDetectedAndReported', async () => {
    const [vm] = await driver.fork(snap, [{ vmId: 'victim' }]);
    const events: VmEvent[] = [];
    const off = driver.onEvent((e) => events.push(e));
    killHard(vm?.pid ?? 0);
    const t0 = Date.now();
    while (!events.some((e) => e.type === 'crashed') && Date.now() - t0 < 5000) await new Promise((r) => setTimeout(r, 20));
    off();
    expect(events).toContainEqual(expect.objectContaining({ type: 'crashed', vmId: 'victim', pid: vm?.pid }));
    expect(driver.get('victim')?.state).toBe('crashed');
    await expect(driver.exec('victim', { path: '/bin/true' })).rejects.toBeInstanceOf(VmCrashedError);
    // Its PID may belong to another process by now: destroying it signals nothing.
    const kill = vi.spyOn(process, 'kill');
    try {
      await driver.destroy('victim');
      expect(kill.mock.calls.filter(([pid]) => pid === vm?.pid)).toEqual([]);
    } finally {
      kill.mockRestore();
    }
    expect(driver.get('victim')).toBeUndefined();
  });

  it('qemu_thatTriesToStartAProcess_isKilledByItsSeccompSandbox_andTheVmIsReportedCrashed', async () => {
    // What a guest that broke into QEMU would do next; `exec:` makes QEMU fork and run a shell.
    const [vm] = await driver.fork(snap, [{ vmId: 'spawner' }]);
    const marker = join(root, 'spawned-by-qemu');
    await driver.qmpOf('spawner').execute('migrate', { uri: `exec:touch ${marker}` }).catch(() => undefined);
    const t0 = Date.now();
    while (driver.get('spawner')?.state !== 'crashed' && Date.now() - t0 < 5000) await new Promise((r) => setTimeout(r, 20));
    expect(driver.get('spawner')?.state).toBe('crashed');
    expect(await stat(marker).then(() => true, () => false)).toBe(false);
    expect(isAlive(vm?.pid ?? 0)).toBe(false);
    await driver.destroy('spawner');
  });

  it('snapshot_ofATemplateWhoseSealFailsAndItsRetryToo_keepsTheVmRunning_andTheUnsealedSnapshotGoesWithTheVm', async () => {
    // The VM switched onto the snapshot's files; writing image.json then fails (a directory in
    // its temp file's place stands in for ENOSPC), and again in the retry. Its files (a whole
    // memory image) served nothing and were left behind until the agent restarted.
    await driver.create({ vmId: 'ts1', image, memoryMib: MEM, vcpus: 1, hostname: 'ts1' });
    const dir = join(root, 'snapshots', 'snap-ts1');
    onSnapshotStage = async (e) => {
      if (e.snapshotId === 'snap-ts1' && e.stage === 'switched') await mkdir(join(dir, 'image.json.tmp'));
    };
    try {
      await expect(driver.snapshot('ts1', 'snap-ts1')).rejects.toThrow(/EISDIR/);
    } finally {
      onSnapshotStage = undefined;
    }
    expect(driver.get('ts1')?.state).toBe('running');
    expect(await sh('ts1', 'echo up')).toBe('up');
    await driver.destroy('ts1');
    await expect(stat(dir)).rejects.toMatchObject({ code: 'ENOENT' });
  });

  it('snapshot_ofATemplateWhoseReplacementDiesAfterTheSourceStopped_recordsTheVmCrashed_reportsIt_andKeepsTheSavedGuestForARetry', async () => {
    await driver.create({ vmId: 'tc1', image, memoryMib: MEM, vcpus: 1, hostname: 'tc1' });
    await sh('tc1', 'echo saved-before-the-failure > /dev/shm/tc1');
    const events: VmEvent[] = [];
    const off = driver.onEvent((e) => events.push(e));
    // The replacement QEMU quits once armed: the source is stopped and killed, then the state
    // load into the replacement fails. Neither QEMU is left.
    onSnapshotStage = async (e) => {
      if (e.snapshotId === 'snap-tc1' && e.stage === 'armed') await e.replacement.execute('quit').catch(() => undefined);
    };
    try {
      await expect(driver.snapshot('tc1', 'snap-tc1')).rejects.toThrow();
    } finally {
      onSnapshotStage = undefined;
      off();
    }
    expect(driver.get('tc1')?.state).toBe('crashed');
    expect(events).toContainEqual(expect.objectContaining({ type: 'crashed', vmId: 'tc1' }));
    // The source was saved whole before it was killed: those files are the guest now. The
    // step's retry returns them as the snapshot, and a VM restored from it has the guest's RAM.
    const kept = await driver.snapshot('tc1', 'snap-tc1');
    await driver.destroy('tc1');
    expect(driver.get('tc1')).toBeUndefined();
    await driver.fork(kept, [{ vmId: 'tc1-back' }]);
    expect(await sh('tc1-back', 'cat /dev/shm/tc1')).toBe('saved-before-the-failure');
    await driver.destroy('tc1-back');
    await driver.deleteSnapshot(kept);
  });

  it('recover_whenReapingVmLeftByPreviousDriver_killsQemuAndRemovesSocketsAndFiles', async () => {
    // Its own root, so the reaping driver sees only the leftover (the snapshot stays in `root`).
    const other = tempDir('ffr-');
    try {
      const previous = new QemuVmmDriver({ root: other, accel: 'tcg', logger, standby: NO_REFILL });
      const [vm] = await previous.fork(snap, [{ vmId: 'orphan' }]);
      const pid = vm?.pid ?? 0;
      expect(pid).toBeGreaterThan(0);
      // The previous agent dies without stopping its VM.
      previous.detach();
      expect(isAlive(pid)).toBe(true);
      expect((await readdir(join(other, 'vms', 'orphan'))).some((f) => f.endsWith('.sock'))).toBe(true);

      const next = new QemuVmmDriver({ root: other, accel: 'tcg', logger, standby: NO_REFILL });
      const report = await next.recover('reap');
      expect(report).toEqual({ adopted: [], reaped: ['orphan'] });
      expect(await goneWithin(pid, 2000)).toBe(true);
      expect(next.list()).toEqual([]);
      expect(await readdir(join(other, 'vms'))).toEqual([]);
      expect(await allFiles(other)).toEqual([]);
      // Idempotent: a second reap finds nothing.
      expect(await next.recover('reap')).toEqual({ adopted: [], reaped: [] });
    } finally {
      await rm(other, { recursive: true, force: true });
    }
  });

  it('recover_whenAgentDiedWithIncomingQemusWaitingForTheirStreams_claimedStandbysOrStartedAtPrepare_reapsEveryQemuAndFile', async () => {
    const other = tempDir('ffr-');
    try {
      const previous = new QemuVmmDriver({ root: other, accel: 'tcg', logger, standby: NO_REFILL });
      const src = { manifest: snap.manifest, image, diskLayerBacking: '/elsewhere/disk.qcow2', writeDiskLayer: (p: string) => copyFile(join(snap.dir, snap.manifest.files.disk), p) };
      expect(await previous.warmIncoming(src, 2)).toBe(2);
      const standbys = join(other, 'standby');
      const pids = await Promise.all((await readdir(standbys)).map(async (d) => Number((await readFile(join(standbys, d, 'qemu.0.pid'), 'utf8')).trim())));
      // One is claimed (its directory is the VM's now, with no vm.json until it is restored);
      // the agent dies before the stream comes.
      await previous.prepareIncoming(src, { vmId: 'inflight' });
      // With the standbys taken, prepare starts a QEMU of its own, which also waits for its stream.
      await previous.prepareIncoming(src, { vmId: 'inflight1' });
      await previous.prepareIncoming(src, { vmId: 'inflight2' });
      const started = Number((await readFile(join(other, 'vms', 'inflight2', 'qemu.0.pid'), 'utf8')).trim());
      previous.detach();
      expect([...pids, started].every(isAlive)).toBe(true);

      const next = new QemuVmmDriver({ root: other, accel: 'tcg', logger, standby: NO_REFILL });
      const report = await next.recover('adopt');
      expect(report.adopted).toEqual([]);
      expect([...report.reaped].sort()).toEqual(['inflight', 'inflight1', 'inflight2']);
      for (const pid of [...pids, started]) expect(await goneWithin(pid, 2000)).toBe(true);
      expect(await allFiles(other)).toEqual([]);
    } finally {
      await rm(other, { recursive: true, force: true });
    }
  });

  // Also for a VM claimed from a standby: QEMU knows its disk by the standby's directory name,
  // and the merge named the layer by the workdir path ("Can't find ... in the backing chain"),
  // so the VM was reaped.
  /**
   * The agent dies while snapshot `snapshotId` of clone `vm` copies its RAM: after
   * blockdev-snapshot switched the VM onto its new disk layer (and stopped it), before
   * vm.json said so.
   */
  const agentDiesInSnapshotCopy = async (vm: string, snapshotId: string): Promise<void> => {
    let died: () => void = () => undefined;
    const dead = new Promise<void>((r) => (died = r));
    onSnapshotCopied = async (at) => {
      if (at.snapshotId !== snapshotId) return;
      driver.detach();
      died();
      await new Promise(() => undefined); // a dead agent runs no more of the snapshot
    };
    void driver.snapshot(vm, snapshotId).catch(() => undefined);
    await dead;
    onSnapshotCopied = undefined;
  };

  it('recover_afterAgentKillMidCloneSnapshot_whenMergingTheNewLayerBackFails_adoptsTheVmOnIt_andItsNextSnapshotMergesItAndKeepsEveryWrite', async () => {
    await driver.fork(snap, [{ vmId: 'k8', hostname: 'k8' }]);
    await sh('k8', 'echo one > /data/one && sync');
    await agentDiesInSnapshotCopy('k8', 'snap-k8-cut');
    // The new agent's merge back is refused (as a full disk would fail it). It used to throw
    // out of the adoption, three times, and the healthy VM was killed and its disk removed.
    const execute = QmpClient.prototype.execute;
    const refused = vi.spyOn(QmpClient.prototype, 'execute').mockImplementation(function (this: QmpClient, cmd, args, timeoutMs) {
      if (cmd === 'block-commit') return Promise.reject(new Error('block-commit refused (injected)'));
      return execute.call(this, cmd, args, timeoutMs) as never;
    });
    let report: RecoveryReport;
    try {
      report = await restartAgent({ dead: true });
    } finally {
      refused.mockRestore();
    }
    expect(report.adopted).toContain('k8');
    expect(driver.get('k8')?.state).toBe('running');
    expect(await sh('k8', 'cat /data/one')).toBe('one');
    await sh('k8', 'echo two > /data/two && sync');
    // The next snapshot merges the layer back first, and freezes a disk with every write.
    const s = await driver.snapshot('k8', 'snap-k8-good');
    await childrenSee([{ of: s, id: 'k8g', script: 'echo 3 > /proc/sys/vm/drop_caches; cat /data/one /data/two', out: 'one\ntwo' }]);
    await driver.destroy('k8');
    await driver.deleteSnapshot(s);
  });

  for (const [how, k1, fromStandby] of [['', 'k1', false], ['_ofAVmClaimedFromAStandby', 'k1s', true]] as const) it(`recover_afterAgentKillMidCloneSnapshot${how}_mergesTheNewLayerBack_resumesTheVm_andTheReRunAndLaterSnapshotsKeepEveryWrite`, async () => {
    if (fromStandby) await driver.warm(snap, 1);
    const [vm] = await driver.fork(snap, [{ vmId: k1, hostname: k1 }]);
    expect((await cmdlineOf(vm!.pid!))?.some((a) => a.includes(`${join(root, 'standby')}/`))).toBe(fromStandby);
    await sh(k1, 'echo one > /data/one && sync');
    await agentDiesInSnapshotCopy(k1, `snap-${k1}-cut`);
    expect((await restartAgent({ dead: true })).adopted).toContain(k1);
    // Running again (the killed snapshot had stopped it), on the layer it writes.
    expect(driver.get(k1)?.state).toBe('running');
    expect(await sh(k1, 'cat /data/one')).toBe('one');
    await sh(k1, 'echo two > /data/two && sync');
    // The redelivered step takes the killed snapshot again, and it holds every write; so
    // does a later one (its disk chain opens: the fork boots).
    const again = await driver.snapshot(k1, `snap-${k1}-cut`);
    await sh(k1, 'echo three > /data/three && sync');
    const later = await driver.snapshot(k1, `snap-${k1}-later`);
    await childrenSee([
      { of: again, id: `${k1}g`, script: 'echo 3 > /proc/sys/vm/drop_caches; cat /data/one /data/two; test -e /data/three || echo no-three', out: 'one\ntwo\nno-three' },
      { of: later, id: `${k1}h`, script: 'echo 3 > /proc/sys/vm/drop_caches; cat /data/one /data/two /data/three', out: 'one\ntwo\nthree' },
    ]);
    await driver.destroy(k1);
    await driver.deleteSnapshot(later);
    await driver.deleteSnapshot(again);
  });

  it('snapshot_ofACloneAfterAnAttemptKilledBeforeItsDiskSwitched_removesTheLayerItLeft_andSucceeds', async () => {
    await driver.fork(snap, [{ vmId: 'k5', hostname: 'k5' }]);
    await sh('k5', 'echo one > /data/one && sync');
    // What an agent killed between creating the snapshot's new layer and blockdev-snapshot
    // leaves in the VM's directory (the snapshot's own directory is swept at start). The
    // redelivered step used to fail on it, "exists already", and journal that failure.
    execFileSync('qemu-img', ['create', '-q', '-f', 'qcow2', join(root, 'vms', 'k5', 'disk.snap-k5-again.qcow2'), '64M']);
    const again = await driver.snapshot('k5', 'snap-k5-again');
    await childrenSee([{ of: again, id: 'k5c', script: 'cat /data/one', out: 'one' }]);
    await driver.destroy('k5');
    await driver.deleteSnapshot(again);
  });

  /**
   * Snapshot `snap-<vm>-bad` of `vm` fails inside its RAM copy, and from then on the source's
   * QMP refuses `cmd`, if given (until stopRefusing).
   */
  const snapshotFailingInItsCopy = async (vm: string, cmd?: string): Promise<void> => {
    onSnapshotCopied = async ({ snapshotId, qmp }) => {
      if (snapshotId !== `snap-${vm}-bad`) return;
      if (cmd === undefined) throw new Error('copy failed');
      const execute = qmp.execute.bind(qmp);
      qmp.execute = (async (c: string, args?: Record<string, unknown>) => {
        if (c === cmd) throw new Error(`${cmd} refused (injected)`);
        return execute(c, args as never);
      }) as typeof qmp.execute;
      throw new Error('copy failed');
    };
    try {
      await expect(driver.snapshot(vm, `snap-${vm}-bad`)).rejects.toThrow(/copy failed/);
    } finally {
      onSnapshotCopied = undefined;
    }
  };
  const stopRefusing = (vm: string): void => {
    const qmp = (driver as unknown as { vms: Map<string, { qmp: { execute: unknown } }> }).vms.get(vm)!.qmp;
    delete (qmp as { execute?: unknown }).execute;
  };

  it('snapshot_ofACloneThatFailsAfterItsDiskSwitched_mergesTheLayerBack_andLaterSnapshotsKeepEveryWrite', async () => {
    await driver.fork(snap, [{ vmId: 'k3', hostname: 'k3' }]);
    await sh('k3', 'echo one > /data/one && sync');
    // Fails inside the RAM copy, after blockdev-snapshot moved the VM onto its new layer.
    await snapshotFailingInItsCopy('k3');
    expect(driver.get('k3')?.state).toBe('running');
    await sh('k3', 'echo two > /data/two && sync');
    const s = await driver.snapshot('k3', 'snap-k3-good');
    // Read from the disk, not the page cache the snapshot's RAM carries.
    await childrenSee([{ of: s, id: 'k3g', script: 'echo 3 > /proc/sys/vm/drop_caches; cat /data/one /data/two', out: 'one\ntwo' }]);
    await driver.destroy('k3');
    await driver.deleteSnapshot(s);
  });

  it('snapshot_ofACloneThatFailsAfterItsDiskSwitched_andWhoseMergeBackFailsToo_laterSnapshotsMergeItBackFirst_andKeepEveryWrite', async () => {
    await driver.fork(snap, [{ vmId: 'k6', hostname: 'k6' }]);
    await sh('k6', 'echo one > /data/one && sync');
    // Fails inside the RAM copy, after blockdev-snapshot moved the VM onto its new layer, and
    // its merge back is refused: the VM runs on, writing the new layer.
    await snapshotFailingInItsCopy('k6', 'block-commit');
    expect(driver.get('k6')?.state).toBe('running');
    stopRefusing('k6');
    await sh('k6', 'echo two > /data/two && sync');
    // The next snapshot freezes the layer the VM writes, not the one below it (which stopped
    // changing at the failed attempt and has no `two`).
    const s = await driver.snapshot('k6', 'snap-k6-good');
    await childrenSee([{ of: s, id: 'k6g', script: 'echo 3 > /proc/sys/vm/drop_caches; cat /data/one /data/two', out: 'one\ntwo' }]);
    await driver.destroy('k6');
    await driver.deleteSnapshot(s);
  });

  it('snapshot_thatFailsWhileTheVmIsStopped_andWhoseContFailsToo_recordsTheVmPaused_soAResumeRunsItAgain', async () => {
    await driver.fork(snap, [{ vmId: 'k7', hostname: 'k7' }]);
    // Fails inside the RAM copy (the VM stopped), and every `cont` of the source fails from then on.
    await snapshotFailingInItsCopy('k7', 'cont');
    expect(driver.get('k7')?.state).toBe('paused');
    // The injected failure ends with the snapshot; a resume now runs the guest again.
    stopRefusing('k7');
    await driver.resume('k7');
    expect(await sh('k7', 'echo alive')).toBe('alive');
    await driver.destroy('k7');
  });

  it('recover_whenKilledAfterACloneSnapshotsManifestBeforeVmJson_keepsTheVmOnItsNewLayer_andTheSnapshotsDiskUntouched', async () => {
    await driver.fork(snap, [{ vmId: 'k2', hostname: 'k2' }]);
    await sh('k2', 'echo one > /data/one && sync');
    const vmJson = join(root, 'vms', 'k2', 'vm.json');
    const stale = await readFile(vmJson, 'utf8');
    const s1 = await driver.snapshot('k2', 'snap-k2');
    // As if killed after manifest.json and before vm.json was rewritten: the record names the
    // layer that is now the snapshot's disk (hard-linked).
    await writeFile(vmJson, stale);
    const diskBefore = await digest(join(s1.dir, 'disk.qcow2'));
    expect((await restartAgent()).adopted).toContain('k2');
    await sh('k2', 'echo two > /data/two && sync');
    expect(await digest(join(s1.dir, 'disk.qcow2'))).toBe(diskBefore);
    const s2 = await driver.snapshot('k2', 'snap-k2-next');
    await childrenSee([
      { of: s1, id: 'k2g', script: 'echo 3 > /proc/sys/vm/drop_caches; cat /data/one; test -e /data/two || echo no-two', out: 'one\nno-two' },
      { of: s2, id: 'k2h', script: 'echo 3 > /proc/sys/vm/drop_caches; cat /data/one /data/two', out: 'one\ntwo' },
    ]);
    await driver.destroy('k2');
    await driver.deleteSnapshot(s2);
    await driver.deleteSnapshot(s1);
  });

  it('recover_afterAgentKillInATemplateSnapshot_undoesItBeforeTheSourceStops_sealsItOnceTheReplacementRuns', async () => {
    const qemusOf = async (vmId: string): Promise<number> => (await Promise.all((await ourProcesses()).map(async (pid) => (await cmdlineOf(pid))?.some((a) => a.includes(`/vms/${vmId}/`))))).filter(Boolean).length;
    /** Runs a template snapshot until `stage`, where the agent dies. */
    const dieAt = async (vmId: string, snapshotId: string, stage: 'armed' | 'saved' | 'loaded' | 'switched'): Promise<void> => {
      let died: () => void = () => undefined;
      const dead = new Promise<void>((r) => (died = r));
      onSnapshotStage = async (e) => {
        if (e.snapshotId !== snapshotId || e.stage !== stage) return;
        driver.detach();
        e.replacement.close(); // a dead agent's connections close
        died();
        await new Promise(() => undefined); // a dead agent runs no more of the snapshot
      };
      void driver.snapshot(vmId, snapshotId).catch(() => undefined);
      await dead;
      onSnapshotStage = undefined;
    };
    /** After the restart: the VM runs its replacement, on the sealed snapshot, which the redelivered step gets and whose child sees the VM's state. */
    const sealedAndRunning = async (vmId: string, snapshotId: string): Promise<void> => {
      expect(await qemusOf(vmId)).toBe(1);
      expect(driver.get(vmId)).toMatchObject({ state: 'running', baseSnapshotId: snapshotId });
      expect(await sh(vmId, 'cat /dev/shm/mark')).toBe(vmId);
      const sealed = await driver.snapshot(vmId, snapshotId);
      expect(sealed.manifest).toMatchObject({ snapshotId, method: 'shared-file', sourceVmId: vmId });
      await childrenSee([{ of: sealed, id: `${vmId}c`, script: 'cat /dev/shm/mark; echo 3 > /proc/sys/vm/drop_caches; cat /data/mark', out: `${vmId}\n${vmId}-disk` }]);
      await driver.destroy(vmId);
      await driver.deleteSnapshot(sealed);
    };
    try {
      for (const vmId of ['tp2', 'tp3', 'tp4']) {
        await driver.create({ vmId, image, memoryMib: MEM, vcpus: 1, hostname: vmId });
        await sh(vmId, `echo ${vmId} > /dev/shm/mark && echo ${vmId}-disk > /data/mark && sync`);
      }
      // 1. Killed with the replacement QEMU ready and the source not yet stopped: undone. The
      //    replacement is gone, the VM runs on its own memory file, the half-made snapshot goes.
      await dieAt('tp2', 'snap-tp2-armed', 'armed');
      expect(await qemusOf('tp2')).toBe(2);
      const r1 = await restartAgent({ dead: true });
      expect(r1.adopted).toEqual(expect.arrayContaining(['tp2', 'tp3']));
      expect(r1.reaped).toContain('snapshot:snap-tp2-armed');
      expect(await qemusOf('tp2')).toBe(1);
      expect(driver.get('tp2')?.state).toBe('running');
      expect(driver.get('tp2')?.baseSnapshotId).not.toBe('snap-tp2-armed');
      expect(await sh('tp2', 'cat /dev/shm/mark /data/mark')).toBe('tp2\ntp2-disk');
      // 2. Killed once the source is gone and the replacement has the device state, vm.json
      //    still naming the source: the restarted agent moves the VM onto the replacement.
      //    Its QMP socket held by another client at first (no greeting, as on a loaded host):
      //    the settling is tried again, not given up with the VM killed and the snapshot swept.
      await dieAt('tp2', 'snap-tp2-loaded', 'loaded');
      const newest = (await readdir(join(root, 'vms', 'tp2'))).filter((f) => /^qmp\.\d+\.sock$/.test(f)).sort((a, b) => Number(b.split('.')[1]) - Number(a.split('.')[1]))[0]!;
      const blocker = net.connect(join(root, 'vms', 'tp2', newest));
      await new Promise<void>((resolve, reject) => blocker.once('connect', resolve).once('error', reject));
      const release = setTimeout(() => blocker.destroy(), 5_500);
      try {
        expect((await restartAgent({ dead: true })).adopted).toEqual(expect.arrayContaining(['tp2', 'tp3']));
      } finally {
        clearTimeout(release);
        blocker.destroy();
      }
      await sealedAndRunning('tp2', 'snap-tp2-loaded');
      // 3. Killed after vm.json names the replacement, before the manifest.
      await dieAt('tp3', 'snap-tp3-switched', 'switched');
      expect((await restartAgent({ dead: true })).adopted).toEqual(expect.arrayContaining(['tp3', 'tp4']));
      await sealedAndRunning('tp3', 'snap-tp3-switched');
      // 3b. Killed once the source saved its state and was killed, before the replacement
      //     loaded it: the only QEMU left waits for a state the snapshot holds whole. It gets
      //     it; the VM was reaped here before, lost, with its snapshot swept.
      await driver.create({ vmId: 'tp5', image, memoryMib: MEM, vcpus: 1, hostname: 'tp5' });
      await sh('tp5', 'echo tp5 > /dev/shm/mark && echo tp5-disk > /data/mark && sync');
      await dieAt('tp5', 'snap-tp5-saved', 'saved');
      expect((await restartAgent({ dead: true })).adopted).toEqual(expect.arrayContaining(['tp4', 'tp5']));
      await sealedAndRunning('tp5', 'snap-tp5-saved');
      // 4. Not killed: failing after the switch (a guest agent that does not come back, say).
      //    The step fails, but the VM runs from the snapshot's files: they are sealed.
      onSnapshotStage = async (e) => {
        if (e.snapshotId === 'snap-tp4-failed' && e.stage === 'switched') throw new Error('failed after the switch');
      };
      await expect(driver.snapshot('tp4', 'snap-tp4-failed')).rejects.toThrow(/after the switch/);
      onSnapshotStage = undefined;
      expect(JSON.parse(await readFile(join(root, 'snapshots', 'snap-tp4-failed', 'manifest.json'), 'utf8'))).toMatchObject({ snapshotId: 'snap-tp4-failed' });
      await sealedAndRunning('tp4', 'snap-tp4-failed');
    } finally {
      onSnapshotStage = undefined;
    }
  });

  it('snapshot_ofATemplateWhileAnExecRuns_theExecCarriesOnInTheReplacementQemu_andReturnsItsWholeOutput', async () => {
    await driver.create({ vmId: 'tx1', image, memoryMib: MEM, vcpus: 1, hostname: 'tx1' });
    let s: Awaited<ReturnType<typeof driver.snapshot>> | undefined;
    try {
      const started = Date.now();
      const running = driver.exec('tx1', { path: '/bin/sh', args: ['-c', 'echo before; sleep 3; echo after; echo err >&2; exit 7'], timeoutMs: 60_000 });
      await new Promise((r) => setTimeout(r, 1000));
      s = await driver.snapshot('tx1', 'snap-tx1');
      expect(s.manifest.method).toBe('shared-file');
      const r = await running;
      expect(r).toMatchObject({ exitCode: 7 });
      expect(r.stdout.toString()).toBe('before\nafter\n');
      expect(r.stderr.toString()).toBe('err\n');
      // The command ran on past the switch (it started 1 s before it). Not a full 3 s by the
      // host's clock: under TCG the guest's clock can jump forward by the switch's pause, and
      // its sleep end that much early (seen: 2.5 s).
      expect(Date.now() - started).toBeGreaterThanOrEqual(1500);
      // The moved channel serves later calls too.
      expect(await sh('tx1', 'echo again')).toBe('again');
    } finally {
      await driver.destroy('tx1').catch(() => undefined);
      // Also when an assertion above failed: a snapshot left behind fails the last test's check that nothing is.
      if (s) await driver.deleteSnapshot(s).catch(() => undefined);
    }
  });

  it('recover_whileTheGuestAgentDoesNotAnswer_adoptsTheVm_andItsNextGuestCallSyncs', async () => {
    // QEMU's guest-agent chardev serves one connection at a time: while this one is open, the
    // new driver's connection waits unanswered, as with a busy or stopped qemu-ga.
    driver.detach();
    const sock = (await readdir(join(root, 'vms', 'tpl'))).find((f) => /^qga\.\d+\.sock$/.test(f));
    expect(sock).toBeDefined();
    const blocker = net.connect(join(root, 'vms', 'tpl', sock!));
    await new Promise<void>((resolve, reject) => blocker.once('connect', resolve).once('error', reject));
    try {
      const report = await restartAgent({ dead: true });
      expect(report.adopted).toEqual(['tpl']);
      expect(report.reaped).toEqual([]);
      expect(driver.get('tpl')?.state).toBe('running');
    } finally {
      blocker.destroy();
    }
    // The channel freed, the first guest call syncs and is answered.
    expect(await sh('tpl', 'cat /dev/shm/marker', driver)).toBe('tmpfs-before-snapshot');
  }, 60_000);

  it('recover_whenVmJsonCannotBeRewritten_adoptsTheVmAndKeepsItsDisk', async () => {
    // A full disk, say: adopt's rewrite of vm.json fails. vm.json already describes the VM,
    // so it is adopted, not killed with its disk removed.
    await driver.fork(snap, [{ vmId: 'ad1', hostname: 'ad1' }]);
    await sh('ad1', 'echo kept > /data/ad1 && sync');
    const blocked = join(root, 'vms', 'ad1', 'vm.json.tmp');
    await mkdir(blocked);
    try {
      const report = await restartAgent();
      expect(report.adopted).toContain('ad1');
      expect(report.reaped).not.toContain('ad1');
      expect(await sh('ad1', 'cat /data/ad1')).toBe('kept');
    } finally {
      await rm(blocked, { recursive: true, force: true });
      await driver.destroy('ad1').catch(() => undefined);
    }
  });

  it('recover_whenQmpDoesNotGreetAtFirst_triesAgainAndAdoptsTheVm', async () => {
    // QEMU's QMP socket serves one client at a time: while this one holds it, the new agent's
    // first connection gets no greeting and times out (5 s), as on a loaded host. The VM is
    // adopted on a later try, not killed with its disk.
    await driver.fork(snap, [{ vmId: 'ad2', hostname: 'ad2' }]);
    driver.detach();
    const sock = (await readdir(join(root, 'vms', 'ad2'))).find((f) => /^qmp\.\d+\.sock$/.test(f));
    expect(sock).toBeDefined();
    const blocker = net.connect(join(root, 'vms', 'ad2', sock!));
    await new Promise<void>((resolve, reject) => blocker.once('connect', resolve).once('error', reject));
    const release = setTimeout(() => blocker.destroy(), 5_500);
    try {
      const report = await restartAgent({ dead: true });
      expect(report.adopted).toContain('ad2');
      expect(report.reaped).not.toContain('ad2');
      expect(driver.get('ad2')?.state).toBe('running');
    } finally {
      clearTimeout(release);
      blocker.destroy();
      await driver.destroy('ad2').catch(() => undefined);
    }
  }, 60_000);

  it('recover_ofAnAcceleratorProbeTheAgentDiedIn_reapsIt', async () => {
    // resolveAccel's probe VM, alive when the agent died: nobody's sandbox, so not adopted.
    await driver.fork(snap, [{ vmId: 'kvmprobe-1-abcdef', hostname: 'probe' }]);
    const report = await restartAgent();
    expect(report.reaped).toContain('kvmprobe-1-abcdef');
    expect(report.adopted).not.toContain('kvmprobe-1-abcdef');
    expect(driver.get('kvmprobe-1-abcdef')).toBeUndefined();
  });

  it('recover_afterAgentRestart_endsTheExecsTheDeadAgentLeftRunning_andRemovesOutputFilesNoOneWillRead', async () => {
    // An exec of the agent that dies: nobody will poll it or end it at its timeout.
    const orphan = driver.exec('tpl', { path: '/bin/sh', args: ['-c', 'echo $$ > /tmp/orphan.pid; exec sleep 300'], timeoutMs: 600_000 });
    orphan.catch(() => undefined);
    await waitFor('the orphan exec started', async () => (await sh('tpl', 'cat /tmp/orphan.pid 2>/dev/null || true')) !== '', 10_000, 200);
    const pid = await sh('tpl', 'cat /tmp/orphan.pid');
    // Output a wrapper left for a reader that died with its agent (that wrapper is gone).
    await sh('tpl', 'echo left > /tmp/.ff-exec-99999.out');
    const report = await restartAgent();
    expect(report.adopted).toEqual(['tpl']);
    await expect(orphan).rejects.toThrow();
    expect(await sh('tpl', `[ -d /proc/${pid} ] && echo running || echo ended`)).toBe('ended');
    // Only the files of the wrapper running this check are there.
    expect(await sh('tpl', 'ls -a /tmp | grep ff-exec | grep -v "ff-exec-$PPID[.]" | wc -l')).toBe('0');
  });

  it('recover_ofAPausedVm_endsTheExecsTheDeadAgentLeftRunning_onceTheVmIsResumed', async () => {
    await driver.fork(snap, [{ vmId: 'or1', hostname: 'or1' }]);
    try {
      const orphan = driver.exec('or1', { path: '/bin/sh', args: ['-c', 'echo $$ > /tmp/orphan.pid; exec sleep 300'], timeoutMs: 600_000 });
      orphan.catch(() => undefined);
      await waitFor('the orphan exec started', async () => (await sh('or1', 'cat /tmp/orphan.pid 2>/dev/null || true')) !== '', 10_000, 200);
      const pid = await sh('or1', 'cat /tmp/orphan.pid');
      // Paused when its agent dies (a drain's pause before its snapshot, say): the new agent
      // cannot reach the guest at adopt.
      await driver.pause('or1');
      const report = await restartAgent();
      expect(report.adopted).toContain('or1');
      await expect(orphan).rejects.toThrow();
      await driver.resume('or1');
      await waitFor('the orphan exec ended', async () => (await sh('or1', `[ -d /proc/${pid} ] && echo running || echo ended`)) === 'ended', 20_000, 250);
    } finally {
      await driver.destroy('or1').catch(() => undefined);
    }
  });

  it('recover_ofAVmMigratingOutWhenTheAgentDied_cancelsTheMigration_soTheAdoptedVmKeepsRunning', async () => {
    await driver.fork(snap, [{ vmId: 'k9', hostname: 'k9' }]);
    await sh('k9', 'echo one > /dev/shm/one');
    driver.detach();
    // What a dead agent's live migration out leaves (a KVM snapshot's RAM copy, a move to
    // another host): the VM runs while QEMU streams its RAM, slowly, to a peer that stays.
    const sock = (await readdir(join(root, 'vms', 'k9'))).find((f) => /^qmp\.\d+\.sock$/.test(f))!;
    const qmp = await QmpClient.connect(join(root, 'vms', 'k9', sock));
    const peer = net.createServer((c) => c.on('error', () => undefined).resume());
    const peerSock = join(root, 'k9-peer.sock');
    await new Promise<void>((resolve) => peer.listen(peerSock, resolve));
    onTestFinished(() => void peer.close());
    try {
      await qmp.execute('migrate-set-parameters', { 'max-bandwidth': 8 << 20 });
      await qmp.execute('migrate', { uri: `unix:${peerSock}` });
      await waitFor('the migration to run', async () => (await qmp.execute<{ status: string }>('query-migrate')).status === 'active', 5000);
    } finally {
      qmp.close();
    }
    expect((await restartAgent({ dead: true })).adopted).toContain('k9');
    const adopted = (driver as unknown as { vms: Map<string, { qmp: QmpClient }> }).vms.get('k9')!.qmp;
    expect((await adopted.execute<{ status: string }>('query-migrate')).status).toBe('cancelled');
    // Left running, the migration would complete and stop the VM recorded as running.
    await new Promise((r) => setTimeout(r, 3000));
    expect((await adopted.execute<{ status: string }>('query-status')).status).toBe('running');
    expect(await sh('k9', 'cat /dev/shm/one')).toBe('one');
    await driver.destroy('k9');
  });

  it('qemu_runsWithoutTheCapabilitiesAGuestThatBrokeIntoItCouldUseAgainstTheHost', async () => {
    const pid = driver.get('tpl')!.pid;
    const caps = (of: number | 'self', line: string): bigint => BigInt(`0x${(readFileSync(`/proc/${of}/status`, 'utf8').split('\n').find((l) => l.startsWith(line)) ?? '').split(/\s+/)[1]}`);
    // Bits of linux/capability.h: CAP_NET_ADMIN 12, CAP_NET_RAW 13, CAP_SYS_MODULE 16, CAP_SYS_RAWIO 17, CAP_SYS_PTRACE 19, CAP_SYS_ADMIN 21.
    for (const bit of [12n, 13n, 16n, 17n, 19n, 21n]) {
      // The agent (this test) has it: QEMU lacks it because it was dropped, not because no one had it.
      expect((caps('self', 'CapEff:') >> bit) & 1n, `the agent's CapEff bit ${bit}`).toBe(1n);
      for (const set of ['CapEff:', 'CapPrm:', 'CapInh:', 'CapBnd:', 'CapAmb:']) expect((caps(pid, set) >> bit) & 1n, `QEMU's ${set} bit ${bit}`).toBe(0n);
    }
    // Still root, with what it needs of root's (its files, /dev/kvm).
    expect(readFileSync(`/proc/${pid}/status`, 'utf8')).toMatch(/^Uid:\s+0\s/m);
  });

  it('recover_afterAgentRestart_adoptsRunningVmAndDestroyLeavesNothing', async () => {
    // The previous agent died between a clone-overlay warm-up's create and its removal.
    const warm = join(root, 'vms', 'tpl', 'overlay-warm.snap-x.qcow2');
    await writeFile(warm, 'left by a killed agent');
    // Simulate an agent crash: forget everything without killing QEMU.
    const report = await restartAgent();
    expect(report.adopted).toEqual(['tpl']);
    await expect(stat(warm)).rejects.toThrow(/ENOENT/);
    expect(await sh('tpl', 'cat /dev/shm/marker', driver)).toBe('tmpfs-before-snapshot');
    await driver.close();
    await driver.deleteSnapshot(snap);
    expect(await ourProcesses()).toEqual([]);
    expect(await readdir(join(root, 'vms'))).toEqual([]);
    expect(await readdir(join(root, 'standby'))).toEqual([]);
    expect(await readdir(join(root, 'snapshots'))).toEqual([]);
  });

  it('resolveAccel_whenAutoAndKvmCannotBootGuest_fallsBackToTcg', async () => {
    const auto = new QemuVmmDriver({ root, accel: 'auto', logger, probeImage: image, autoProbeDeadlineMs: 4000 });
    const accel = await auto.resolveAccel();
    // On a bare-metal KVM host this would be 'kvm'; here /dev/kvm is PVM and stock guests hang.
    expect(['kvm', 'tcg']).toContain(accel);
    expect(await ourProcesses()).toEqual([]);
    expect(await readdir(join(root, 'vms'))).toEqual([]);
  });
});
