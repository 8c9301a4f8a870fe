// The template's fixed setup, replayed by every scenario and baseline: `dirtyMib` of random
// data in guest RAM (tmpfs /dev/shm) and a long-running process.
export function setupScript(dirtyMib: number): string {
  return [
    `dd if=/dev/urandom of=/dev/shm/dirty bs=1M count=${dirtyMib} 2>/dev/null`,
    "setsid sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 0.2; done' </dev/null >/dev/null 2>&1 &",
    'true',
  ].join('\n');
}
