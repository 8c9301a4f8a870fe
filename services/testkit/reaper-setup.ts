// vitest setup file of the int and e2e tiers (vitest.config.ts): every test process gets its
// reaper (reaper.ts) before its test file starts anything.
import { startReaper } from './reaper.ts';

startReaper();
