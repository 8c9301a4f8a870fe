#!/usr/bin/env bash
# Installs what Forkfleet needs on a Debian 12 host, idempotently: Debian packages through
# the machine's own apt sources, then the npm dependencies from package-lock.json.
# Safe to run again and again; it does nothing when everything is present.
set -euo pipefail
cd "$(dirname "$0")/.."

# Node.js 20.19+ or 22.12+ (package.json's engines, the test runner's vite's own): older 20.x
# lack import.meta.dirname (until 20.11), which the fleet and the agents use.
if ! node -e 'const [a, b] = process.versions.node.split(".").map(Number); process.exit((a === 20 && b >= 19) || (a === 22 && b >= 12) || a > 22 ? 0 : 1)'; then
  echo "setup: Forkfleet needs Node.js 20.19 or later 20.x, or 22.12 or later; this is $(node -v 2>/dev/null || echo 'no node')" >&2
  exit 1
fi

# One run at a time: two (the Quick start's commands started together) would meet at dpkg's
# lock, run npm ci into the same node_modules, and one's EXIT trap would remove the
# policy-rc.d the other still relies on. The second waits for the first.
lock=${FORKFLEET_SETUP_LOCK:-/run/lock/forkfleet-setup.lock}
mkdir -p "$(dirname "$lock")" 2>/dev/null || true
# The braces keep 2>/dev/null to this exec (a bare `exec ... 2>/dev/null` would send the rest
# of the script's errors there too); without a writable lock file it runs unlocked.
if { exec 9>>"$lock"; } 2>/dev/null; then flock 9; fi

APT_PACKAGES=(
  qemu-system-x86 qemu-utils qemu-guest-agent linux-image-amd64 busybox-static
  etcd-server etcd-client nats-server iproute2 zstd lz4 cpio kmod e2fsprogs xz-utils mmdebstrap chromium prometheus openssl
  util-linux nftables
  # socat carries migration streams between hosts over TLS (host-agent/adapters/peer/tls-relay.ts).
  socat
  # systemd-analyze checks the rendered units of a real deployment (deploy/hosts).
  systemd
  # zstd-napi (the chunk codec) builds its native addon with node-gyp during npm ci when no
  # prebuilt binary can be fetched, as on a machine that reaches only the npm registry.
  g++ make python3
  # .ci/run checks that the generated code is current with git.
  git
  # sysctl turns on IP forwarding for sandbox egress (host-agent/adapters/netns/egress.ts);
  # minimal Debian installs lack it.
  procps
)

# Installed, whatever was asked of it: a package on hold reads `hold ok installed`.
# One line per installed architecture (a multi-arch package has several).
installed() { dpkg-query -W -f='${db:Status-Status}\n' "$1" 2>/dev/null | grep -qx installed; }

# Runs "$@"; while it fails on a lock another apt or dpkg holds, again every 10 s, for up to
# 10 min. Its output is shown only when it fails for good; its exit status is the command's.
retry_locked() {
  local out rc i
  for ((i = 1; ; i++)); do
    out=$("$@" 2>&1) && rc=0 || rc=$?
    if ((rc == 0)); then return 0; fi
    if ((i >= 60)) || ! grep -qiE 'could not get lock|locked by another process' <<<"$out"; then
      printf '%s\n' "$out" >&2
      return "$rc"
    fi
    echo "setup: another apt or dpkg holds the package lock; waiting ($1 ${*:2:3} ...)" >&2
    sleep "${FORKFLEET_SETUP_LOCK_RETRY_S:-10}"
  done
}

# Forkfleet starts its own etcd, NATS and Prometheus; the Debian services these packages enable
# would start at the next boot (Prometheus listening on every interface). Those this script
# installs are disabled: noted (unit:package) in a file that outlives the run before installing,
# so that a run killed or failing before it disables them leaves the note, and disabled, by this
# run or the next, once installed. A machine's own services (their packages were there before)
# are never noted; nor is one a rendered deployment runs (deploy/hosts: its drop-in) disabled.
SERVICES=(etcd:etcd-server nats-server:nats-server prometheus:prometheus)
pending=${FORKFLEET_SETUP_PENDING:-/var/lib/forkfleet-setup/services-to-disable}

# Disables (and stops, where systemd runs them) the services noted in $pending. A line is
# dropped once done; one that failed stays for the next run.
disable_noted_services() {
  [[ -s $pending ]] || return 0
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: services this script installed are still enabled ($pending): run it as root to disable them" >&2
    return 0
  fi
  if ! command -v systemctl >/dev/null; then rm -f "$pending"; return 0; fi # no systemd: nothing starts them
  local left=() s unit ok
  while IFS= read -r s; do
    unit=${s%%:*}
    # Not installed (removed since): noted anew if this script installs it again.
    if [[ -z $s ]] || ! installed "${s#*:}"; then continue; fi
    # Configured by a rendered deployment (deploy/hosts), which runs it: left alone.
    if [[ -e /etc/systemd/system/$unit.service.d/forkfleet.conf ]]; then continue; fi
    ok=1
    if systemctl is-enabled --quiet "$unit" 2>/dev/null && ! systemctl disable --quiet "$unit"; then ok=0; fi
    # is-active fails where systemd does not run (a container): then nothing runs it.
    if systemctl is-active --quiet "$unit" 2>/dev/null && ! systemctl stop "$unit"; then ok=0; fi
    if ((!ok)); then left+=("$s"); fi
  done < <(sort -u "$pending")
  if ((${#left[@]})); then
    printf '%s\n' "${left[@]}" > "$pending"
    echo "setup: could not disable ${left[*]%%:*}; the next run tries again" >&2
  else
    rm -f "$pending"
  fi
}

# The policy-rc.d an install below puts in place carries this marker line. One that a run
# killed after its install left (the lock is ours, so no other run is installing now) is
# removed on every run, not only on one that installs something: left behind, it would keep
# the machine's later upgrades from restarting services.
# FORKFLEET_POLICY_RC_D: another path, for setup.sh's own tests only (invoke-rc.d reads only the default).
marker='# forkfleet setup.sh: removed when it ends'
policy_rc=${FORKFLEET_POLICY_RC_D:-/usr/sbin/policy-rc.d}
if [[ $(id -u) -eq 0 ]] && grep -qxsF "$marker" "$policy_rc"; then rm -f "$policy_rc"; fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  if ! installed "$p"; then missing+=("$p"); fi
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: missing Debian packages: ${missing[*]}; run as root or install them" >&2
    exit 1
  fi
  echo "setup: installing Debian packages: ${missing[*]}"
  for s in "${SERVICES[@]}"; do
    if [[ " ${missing[*]} " == *" ${s#*:} "* ]]; then
      mkdir -p "$(dirname "$pending")" && echo "$s" >> "$pending"
    fi
  done
  export DEBIAN_FRONTEND=noninteractive
  # Installing must not start services (there may be no init system here).
  # Only while installing: left behind, it would keep later upgrades from restarting services.
  # Ours carries the marker line (above); someone else's is left alone.
  if [[ ! -e $policy_rc ]] || grep -qxF "$marker" "$policy_rc"; then
    printf '#!/bin/sh\n%s\nexit 101\n' "$marker" > "$policy_rc" && chmod +x "$policy_rc"
    trap 'rm -f "$policy_rc"' EXIT
  fi
  # A run killed while dpkg worked leaves packages unpacked or half-configured, and apt then
  # refuses to install anything until they are configured: finish that first (only then: dpkg
  # does not wait for the package lock).
  # Each waits (up to 10 min) for the locks another apt or dpkg holds instead of failing at
  # once: on a machine just booted, apt's daily timers and unattended-upgrades may hold them.
  # apt-get waits for dpkg's lock itself (DPkg::Lock::Timeout); not for the package lists'
  # lock, nor does dpkg: retried while they fail on a lock (retry_locked).
  if [[ -n $(dpkg --audit 2>/dev/null) ]]; then retry_locked dpkg --configure -a; fi
  apt_wait=(-o DPkg::Lock::Timeout=600)
  retry_locked apt-get "${apt_wait[@]}" update -qq
  retry_locked apt-get "${apt_wait[@]}" install -y -qq --no-install-recommends "${missing[@]}"
  # Installed: services may start again (the trap covers a run that fails before this).
  if grep -qxsF "$marker" "$policy_rc"; then rm -f "$policy_rc"; fi
  trap - EXIT
fi
# Every run: also those a killed or failed run noted.
disable_noted_services

# npm dependencies: reinstall only when package-lock.json changed since the last install.
stamp=node_modules/.forkfleet-lock.sha256
want=$(sha256sum package-lock.json | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  echo "setup: npm ci"
  # node-gyp (zstd-napi, when no prebuilt binary is reachable) takes Node's headers from the
  # installed Node where it has them, instead of downloading them from outside the npm registry.
  node_prefix=$(dirname "$(dirname "$(command -v node)")")
  if [[ -z ${npm_config_nodedir:-} && -f $node_prefix/include/node/node_api.h ]]; then export npm_config_nodedir=$node_prefix; fi
  # Native addons build from source (zstd-napi's prebuild-install would first try to download
  # a binary from outside the npm registry).
  npm_config_build_from_source=true npm ci --no-audit --no-fund --loglevel=error
  echo "$want" > "$stamp"
fi
