// Scheduler replica process. Configuration comes from FF_* environment variables
// (services/config.ts). Stops cleanly on SIGTERM / SIGINT.
import { pino } from 'pino';
import { compileSchedulerConfig } from './config.ts';
import { startScheduler } from './scheduler.ts';

async function main(): Promise<void> {
  const config = compileSchedulerConfig();
  const log = pino({ level: config.logLevel, base: { component: 'scheduler', schedulerId: config.id } });
  const handle = await startScheduler(config, log);
  // One line on stdout that scripts can wait for.
  process.stdout.write(`${JSON.stringify({ ready: true, api: handle.address, metrics: handle.metricsAddress })}\n`);
  let stopping = false;
  const stop = (sig: string): void => {
    if (stopping) return;
    stopping = true;
    log.info({ sig }, 'stopping');
    handle.close().then(
      () => process.exit(0),
      (err: unknown) => {
        log.error({ err }, 'unclean stop');
        process.exit(1);
      },
    );
  };
  process.on('SIGTERM', () => stop('SIGTERM'));
  process.on('SIGINT', () => stop('SIGINT'));
}

main().catch((err: unknown) => {
  process.stderr.write(`scheduler: ${err instanceof Error ? err.message : String(err)}\n`);
  process.exit(1);
});
