// The README's "Host prerequisites" names the Debian packages deploy/setup.sh installs, so an
// operator preparing hosts by hand (or auditing one) installs the same set. Below: setup.sh's
// own behaviour, with stubs for the system's commands.
import { spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { copyFileSync, existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { afterEach, beforeEach, describe, expect, it } from 'vitest';

const ROOT = resolve(import.meta.dirname, '..');

/** The package names in setup.sh's APT_PACKAGES array (comments dropped). */
function setupPackages(script: string): string[] {
  const body = /^APT_PACKAGES=\(\n([\s\S]*?)^\)/m.exec(script)?.[1];
  if (body === undefined) throw new Error('setup.sh: no APT_PACKAGES=( ... ) array');
  return body.split('\n').flatMap((line) => line.replace(/#.*/, '').trim().split(/\s+/)).filter((p) => p !== '');
}

/** The package list in the README's prerequisites: the first code span after "setup.sh` installs". */
function readmePackages(readme: string): string[] {
  const m = /`deploy\/setup\.sh` installs[^`]*(?:`APT_PACKAGES`[^`]*)?`([^`]+)`/.exec(readme);
  if (!m) throw new Error('README.md: no package list after "`deploy/setup.sh` installs"');
  return m[1]!.split(/\s+/).filter((p) => p !== '');
}

describe('host prerequisites', () => {
  it('readme_listsExactlyThePackagesSetupInstalls', () => {
    const setup = setupPackages(readFileSync(join(ROOT, 'deploy', 'setup.sh'), 'utf8'));
    const readme = readmePackages(readFileSync(join(ROOT, 'README.md'), 'utf8'));
    expect(setup.length).toBeGreaterThan(10);
    expect([...readme].sort()).toEqual([...setup].sort());
  });
});

// setup.sh itself, run as a copy in a scratch repository (its own package-lock.json and install
// stamp, so npm ci never runs) with stubs first on PATH: dpkg-query, id and systemctl answer as
// each test says, and npm, apt-get and dpkg fail loudly if reached (unless a test replaces
// them). Its lock, pending-services note and policy-rc.d are paths in the scratch directory
// (FORKFLEET_SETUP_LOCK, FORKFLEET_SETUP_PENDING, FORKFLEET_POLICY_RC_D): nothing on the
// machine is read or changed but that directory.
describe('setup.sh', () => {
  let tmp: string;
  beforeEach(() => {
    tmp = mkdtempSync(join(tmpdir(), 'ff-setup-'));
    mkdirSync(join(tmp, 'repo', 'deploy'), { recursive: true });
    mkdirSync(join(tmp, 'repo', 'node_modules'));
    mkdirSync(join(tmp, 'bin'));
    copyFileSync(join(ROOT, 'deploy', 'setup.sh'), join(tmp, 'repo', 'deploy', 'setup.sh'));
    writeFileSync(join(tmp, 'repo', 'package-lock.json'), '{}\n');
    writeFileSync(join(tmp, 'repo', 'node_modules', '.forkfleet-lock.sha256'), `${createHash('sha256').update('{}\n').digest('hex')}\n`);
    const stubs: Record<string, string> = {
      // The package is the last argument; those in STUB_MISSING are not installed.
      'dpkg-query': 'for a; do p=$a; done\ncase " $STUB_MISSING " in *" $p "*) echo "dpkg-query: no packages found matching $p" >&2; exit 1;; esac\nprintf "installed\\n"',
      id: 'echo "$STUB_UID"',
      // Every call logged; a unit is enabled, active, or fails to change as the STUB_ lists say.
      systemctl: [
        'echo "$*" >> "$STUB_LOG"',
        'for a; do unit=$a; done',
        'listed() { case " $1 " in *" $unit "*) return 0;; esac; return 1; }',
        'case $1 in',
        '  is-enabled) listed "$STUB_ENABLED" || exit 1;;',
        '  is-active) listed "$STUB_ACTIVE" || { echo "System has not been booted with systemd as init system (PID 1)." >&2; exit 1; };;',
        '  disable|stop) if listed "$STUB_FAIL"; then echo "Failed to $1 $unit.service: stub" >&2; exit 1; fi;;',
        'esac',
      ].join('\n'),
      ...Object.fromEntries(['npm', 'apt-get', 'dpkg'].map((c) => [c, `echo "stub: ${c} must not run in this test" >&2; exit 97`])),
    };
    for (const [name, body] of Object.entries(stubs)) writeFileSync(join(tmp, 'bin', name), `#!/bin/sh\n${body}\n`, { mode: 0o755 });
  });
  afterEach(() => rmSync(tmp, { recursive: true, force: true }));

  const pending = (): string => join(tmp, 'services-to-disable');
  const policyRc = (): string => join(tmp, 'policy-rc.d');
  const MARKED = '#!/bin/sh\n# forkfleet setup.sh: removed when it ends\nexit 101\n';
  const systemctlCalls = (): string[] => (existsSync(join(tmp, 'systemctl.log')) ? readFileSync(join(tmp, 'systemctl.log'), 'utf8').split('\n').filter(Boolean) : []);
  function runSetup(env: { STUB_MISSING?: string; STUB_UID?: string; STUB_ENABLED?: string; STUB_ACTIVE?: string; STUB_FAIL?: string; FORKFLEET_SETUP_LOCK_RETRY_S?: string }): { status: number | null; stderr: string } {
    const r = spawnSync('bash', [join(tmp, 'repo', 'deploy', 'setup.sh')], {
      encoding: 'utf8',
      env: {
        ...process.env,
        PATH: `${join(tmp, 'bin')}:${process.env.PATH ?? '/usr/bin:/bin'}`,
        FORKFLEET_SETUP_LOCK: join(tmp, 'setup.lock'),
        FORKFLEET_SETUP_PENDING: pending(),
        FORKFLEET_POLICY_RC_D: policyRc(),
        STUB_LOG: join(tmp, 'systemctl.log'),
        STUB_MISSING: '',
        STUB_UID: '0',
        STUB_ENABLED: '',
        STUB_ACTIVE: '',
        STUB_FAIL: '',
        ...env,
      },
    });
    return { status: r.status, stderr: r.stderr };
  }

  it('setup_asNonRootWithPackagesMissing_namesThemOnStderr', () => {
    // The lock's `exec 9>>lock 2>/dev/null` once sent all later errors to /dev/null.
    const r = runSetup({ STUB_MISSING: 'socat prometheus', STUB_UID: '1000' });
    expect(r.status).toBe(1);
    expect(r.stderr).toContain('setup: missing Debian packages: prometheus socat; run as root or install them');
  });

  it('setup_afterARunThatStoppedBeforeDisablingTheServicesItInstalled_nextRunDisablesThem_andLeavesTheMachinesOwn', () => {
    // A run killed (or failing) after noting these, before disabling them. etcd was not noted:
    // the machine had its package (and maybe runs its service) before.
    writeFileSync(pending(), 'prometheus:prometheus\nnats-server:nats-server\n');
    const r = runSetup({ STUB_ENABLED: 'etcd nats-server prometheus', STUB_ACTIVE: 'prometheus' });
    expect(r.stderr).toBe('');
    expect(r.status).toBe(0);
    const calls = systemctlCalls();
    expect(calls).toEqual(expect.arrayContaining(['disable --quiet prometheus', 'stop prometheus', 'disable --quiet nats-server']));
    // nats-server is not running (is-active fails, as where systemd does not run): not stopped.
    expect(calls.filter((c) => /^(disable|stop) /.test(c)).sort()).toEqual(['disable --quiet nats-server', 'disable --quiet prometheus', 'stop prometheus']);
    expect(existsSync(pending())).toBe(false);
  });

  it('setup_serviceThatFailsToDisable_staysNotedForTheNextRun_andSaysWhy', () => {
    writeFileSync(pending(), 'etcd:etcd-server\nprometheus:prometheus\n');
    const r = runSetup({ STUB_ENABLED: 'etcd prometheus', STUB_FAIL: 'etcd' });
    expect(r.status).toBe(0);
    expect(r.stderr).toContain('Failed to disable etcd.service: stub');
    expect(r.stderr).toContain('setup: could not disable etcd; the next run tries again');
    expect(readFileSync(pending(), 'utf8')).toBe('etcd:etcd-server\n');
    // The next run, where it works, finishes the job.
    expect(runSetup({ STUB_ENABLED: 'etcd' }).status).toBe(0);
    expect(existsSync(pending())).toBe(false);
    expect(systemctlCalls().filter((c) => c === 'disable --quiet etcd')).toHaveLength(2);
  });

  it('setup_findsThePolicyRcDAKilledRunLeft_removesIt_evenWhenNothingIsToInstall', () => {
    writeFileSync(policyRc(), MARKED, { mode: 0o755 });
    expect(runSetup({}).status).toBe(0);
    expect(existsSync(policyRc())).toBe(false);
  });

  it('setup_leavesAPolicyRcDThatIsNotItsOwn_whetherItInstallsOrNot', () => {
    const theirs = '#!/bin/sh\nexit 101\n';
    writeFileSync(policyRc(), theirs, { mode: 0o755 });
    expect(runSetup({}).status).toBe(0);
    expect(readFileSync(policyRc(), 'utf8')).toBe(theirs);
    // An install (apt-get stubbed to fail): theirs is neither replaced nor removed.
    expect(runSetup({ STUB_MISSING: 'socat' }).status).not.toBe(0);
    expect(readFileSync(policyRc(), 'utf8')).toBe(theirs);
  });

  it('setup_install_holdsServicesWhileAptRuns_andRemovesItsPolicyRcDWhenAptFails', () => {
    // dpkg --audit names nothing to finish; apt-get records whether services were held when it ran, then fails.
    writeFileSync(join(tmp, 'bin', 'dpkg'), '#!/bin/sh\nexit 0\n', { mode: 0o755 });
    writeFileSync(join(tmp, 'bin', 'apt-get'), `#!/bin/sh\ngrep -q 'exit 101' "${policyRc()}" && echo "held: $*" >> "${join(tmp, 'apt.log')}"\nexit 97\n`, { mode: 0o755 });
    const r = runSetup({ STUB_MISSING: 'socat' });
    expect(r.status).toBe(97);
    // It waits for the package lock (apt's timers may hold it on a machine just booted).
    expect(readFileSync(join(tmp, 'apt.log'), 'utf8')).toContain('held: -o DPkg::Lock::Timeout=600 update -qq');
    expect(existsSync(policyRc())).toBe(false);
  });

  it('setup_install_whileAnotherAptHoldsThePackageListsLock_waitsForIt_andInstalls', () => {
    // apt's daily timers on a machine just booted: apt-get update fails on the lists' lock
    // (DPkg::Lock::Timeout covers dpkg's lock only) until they end.
    writeFileSync(join(tmp, 'bin', 'dpkg'), '#!/bin/sh\nexit 0\n', { mode: 0o755 });
    const count = join(tmp, 'apt.count');
    writeFileSync(join(tmp, 'bin', 'apt-get'), `#!/bin/sh\nn=$(cat "${count}" 2>/dev/null || echo 0); n=$((n+1)); echo $n > "${count}"\nif [ $n -le 2 ]; then echo "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 4242 (apt-get)" >&2; exit 100; fi\necho "ran: $*" >> "${join(tmp, 'apt.log')}"\n`, { mode: 0o755 });
    const r = runSetup({ STUB_MISSING: 'socat', FORKFLEET_SETUP_LOCK_RETRY_S: '0' });
    expect(r.status).toBe(0);
    expect(r.stderr).toContain('holds the package lock; waiting');
    expect(readFileSync(join(tmp, 'apt.log'), 'utf8').split('\n').filter(Boolean).map((l) => l.replace(/^ran: -o DPkg::Lock::Timeout=600 /, '').split(' ')[0])).toEqual(['update', 'install']);
  });

  it('setup_asNonRootWithServicesNoted_keepsTheNote_andSaysSo', () => {
    writeFileSync(pending(), 'prometheus:prometheus\n');
    const r = runSetup({ STUB_UID: '1000', STUB_ENABLED: 'prometheus' });
    expect(r.status).toBe(0);
    expect(r.stderr).toContain('run it as root to disable them');
    expect(readFileSync(pending(), 'utf8')).toBe('prometheus:prometheus\n');
    expect(systemctlCalls()).toEqual([]);
  });
});
