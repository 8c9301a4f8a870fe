// What the load test says about the fleet it measures: worked out from what the fleet reports
// (ListHosts) and from the environment its agents are started from. Pure.

/**
 * The hosts' link rate in Gbit/s, from the linkBytesPerSecond each reports (ListHosts;
 * FF_LINK_BYTES_PER_SECOND on the agents). null when a host reports none or they differ: one
 * figure would then be wrong for some link, and the capacity plan would scale by it.
 */
export function linkGbpsOf(hosts: ReadonlyArray<{ linkBytesPerSecond: number }>): number | null {
  const rates = new Set(hosts.map((h) => h.linkBytesPerSecond));
  const [rate] = rates;
  if (rates.size !== 1 || rate === undefined || !(rate > 0)) return null;
  return Math.round((rate * 8) / 1e6) / 1000;
}

/**
 * Whether agents started from `env` encrypt their migration streams (host-agent config.ts
 * peerMigrationTls): with peer TLS, unless FF_PEER_MIGRATION_TLS=off leaves them plain.
 */
export function migrationStreamsEncrypted(peerTls: boolean, env: NodeJS.ProcessEnv = process.env): boolean {
  return peerTls && (env.FF_PEER_MIGRATION_TLS ?? 'on') !== 'off';
}
