import { defineConfig } from 'vitest/config';

// Three tiers (the team's DESIGN.md, "Test tiers", names the first two):
//   unit: *.test.ts, pure logic, fast, run in parallel.
//   int:  *.int.test.ts, real etcd / nats-server / QEMU started by the tests; files run
//         one at a time because this machine has 2 cores and QEMU runs under TCG.
//   e2e:  *.e2e.test.ts, a whole local fleet (deploy/fleet) with faults injected.
// The tiers run one after another (sequence.groupOrder): without it vitest runs projects
// side by side, and on a machine with more cores the int tests' guests and the e2e fleet
// would share it.
const exclude = ['node_modules/**', '**/.cache/**'];
// The int and e2e tiers start real processes and namespaces: a test process that ends without
// undoing them (Ctrl-C, kill, crash, hook timeout) has them undone by its reaper.
const REAPER = './services/testkit/reaper-setup.ts';
// ... and one such run at a time on a machine: their fleets use fixed directories and ports.
const RUN_LOCK = './services/testkit/run-lock-setup.ts';
export default defineConfig({
  test: {
    projects: [
      {
        test: {
          name: 'unit',
          include: ['**/*.test.ts'],
          exclude: [...exclude, '**/*.int.test.ts', '**/*.e2e.test.ts'],
          testTimeout: 20_000,
          sequence: { groupOrder: 0 },
        },
      },
      {
        test: {
          // The local multi-host fleet in network namespaces, with faults injected.
          name: 'e2e',
          include: ['**/*.e2e.test.ts'],
          exclude,
          fileParallelism: false,
          setupFiles: [REAPER],
          globalSetup: [RUN_LOCK],
          sequence: { groupOrder: 2 },
          testTimeout: 300_000,
          hookTimeout: 300_000,
        },
      },
      {
        test: {
          name: 'int',
          include: ['**/*.int.test.ts'],
          exclude,
          fileParallelism: false,
          setupFiles: [REAPER],
          globalSetup: [RUN_LOCK],
          sequence: { groupOrder: 1 },
          testTimeout: 120_000,
          hookTimeout: 180_000,
        },
      },
    ],
  },
});
