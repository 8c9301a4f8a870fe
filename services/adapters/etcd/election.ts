// Scheduler leader election on etcd (etcd3 Election). The lease TTL bounds failover: a
// killed leader's lease lapses after `ttlSeconds`, then a standby's campaign wins.
//
// A leader cut off from etcd (a partition, a stalled etcd member) must stop acting before a
// standby can win, or two replicas send host work at once. etcd3 reports a lease lost only
// when no keepalive has been answered for 2 x TTL; etcd can expire it after 1 x TTL. So each
// campaign keeps its own deadline: the send time of the last answered keepalive plus the TTL
// (etcd renews from when the request arrives, which is later). A leader steps down when that
// deadline comes within LEASE_MARGIN_MS, before etcd could let anyone else win.
import { createHash, randomBytes } from 'node:crypto';
import type { EventEmitter } from 'node:events';
import type { Etcd3 } from 'etcd3';
import { Campaign } from 'etcd3';
import type { LeaderElection, LeaderFence } from '../../domain/ports.ts';
import { keys } from './keys.ts';

/** How long before the lease's earliest possible expiry a leader steps down. */
const LEASE_MARGIN_MS = 250;
const LEASE_CHECK_MS = 50;

/**
 * etcd3 (1.1.2, the newest) makes a campaign's key with `if Create == 0 then put else get`. When
 * the key is there already (the client sent the txn again after a first try that landed: a
 * deadline, an etcd leader change, a reset connection), it takes the key's create revision as
 * the campaign's, but still waits for every key made before the txn's answer revision to go:
 * its own key among them, which its lease keeps alive. The campaign never wins, and every other
 * replica queues behind its key for good. Go's clientv3 waits for the keys made before the key's
 * create revision; so does this (Campaign.keyRevision: the txn's revision when it put the key,
 * the key's create revision when it was there; a symbol once resigned).
 */
function waitBehindOwnKeyOnly(): void {
  const proto = Campaign.prototype as unknown as { waitForElected?: (this: { keyRevision?: unknown }, revision: string) => Promise<void>; __ffPatched?: boolean };
  if (proto.__ffPatched || typeof proto.waitForElected !== 'function') return;
  const wait = proto.waitForElected;
  proto.waitForElected = function (revision) {
    const own = this.keyRevision;
    return wait.call(this, typeof own === 'string' || typeof own === 'number' ? String(own) : revision);
  };
  proto.__ffPatched = true;
}
waitBehindOwnKeyOnly();

/**
 * The earliest time etcd may expire a campaign's lease, from the lease's keepalive events.
 * On the monotonic clock (performance.now): a wall clock stepped back by NTP would let a
 * leader act past the lease's real expiry.
 * etcd3 keeps the Lease private; without it (another etcd3 version) the deadline is never
 * renewed past the first TTL, so the check below would step down at once: `known` says so.
 */
function leaseDeadline(c: Campaign, ttlMs: number): { until: () => number; known: boolean; close: () => void } {
  const lease = (c as unknown as { lease?: EventEmitter }).lease;
  let until = performance.now() + ttlMs; // the lease is granted after this
  if (!lease || typeof lease.on !== 'function') return { until: () => until, known: false, close: () => undefined };
  // Keepalives go out on one stream and are answered in order: an answer is for the oldest
  // request still unanswered on the current stream.
  let sent: number[] = [];
  const onFired = (): void => void sent.push(performance.now());
  const onStream = (): void => void (sent = []);
  const onAnswer = (): void => {
    const at = sent.shift();
    if (at !== undefined) until = Math.max(until, at + ttlMs);
  };
  lease.on('keepaliveEstablished', onStream);
  lease.on('keepaliveFired', onFired);
  lease.on('keepaliveSucceeded', onAnswer);
  return {
    until: () => until,
    known: true,
    close: () => {
      lease.off('keepaliveEstablished', onStream);
      lease.off('keepaliveFired', onFired);
      lease.off('keepaliveSucceeded', onAnswer);
    },
  };
}

/**
 * The incarnation of the fleet's etcd data (keys.incarnation()): `<epoch ms>.<random hex>`,
 * which the first leader of a new store writes (only if absent) and every later one reads.
 * etcd's own cluster id is the same for a cluster rebuilt from the same member list and token
 * (the rendered deployment's are fixed), whose revisions, and so leader terms, start again at
 * 1; agents that kept a higher term would drop every step of the new leaders as a deposed
 * leader's. HostWork.leader_store carries it (fleetStoreId); leader_cluster stays etcd's
 * cluster id, which schedulers of the version before send too. A store restored from a backup
 * keeps the key (and so looks older than one made since): delete the key before the schedulers
 * start (services/README.md, "Leader terms").
 */
export async function incarnation(client: Etcd3, now = Date.now): Promise<string> {
  const key = keys.incarnation();
  const res = await client
    .if(key, 'Create', '==', 0)
    .then(client.put(key).value(`${now()}.${randomBytes(16).toString('hex')}`), client.get(key))
    .else(client.get(key))
    .commit();
  const kv = res.responses[res.succeeded ? 1 : 0]?.response_range?.kvs[0];
  if (!kv) throw new Error(`${key}: not there after it was written`);
  return kv.value.toString();
}

/**
 * HostWork.leader_store's value (decimal) for an incarnation: the second it was made in the
 * high 34 bits and 30 bits of its digest below, so a store made later has the larger id
 * (agents take the newest store's work and drop an older one's, whatever the order it comes
 * in). Never 0 ("not known").
 */
export function fleetStoreId(incarnationId: string): string {
  const ms = Number(/^(\d{1,15})\./.exec(incarnationId)?.[1] ?? 0);
  const seconds = BigInt(Math.floor(ms / 1000)) & ((1n << 34n) - 1n);
  const low = BigInt(createHash('sha256').update(incarnationId).digest().readUInt32BE(0) & 0x3fff_ffff);
  const id = (seconds << 30n) | low;
  return String(id === 0n ? 1n : id);
}

export class EtcdLeaderElection implements LeaderElection {
  private campaignObj: Campaign | undefined;
  private leader = false;
  private lastFence: LeaderFence | undefined;
  private readonly lostCbs: Array<() => void> = [];
  /** Campaigns a later campaign() replaced: their promises never settle (campaign()). */
  private readonly superseded = new WeakSet<Campaign>();
  /** Stops the current campaign's lease watchdog. */
  private stopWatchdog: (() => void) | undefined;
  /** The current term's lease deadline, where known: isLeader() checks it itself. */
  private leaseUntil: (() => number) | undefined;

  constructor(
    private readonly client: Etcd3,
    private readonly candidateId: string,
    private readonly ttlSeconds = 2,
  ) {}

  /**
   * Stands for leader; resolves once elected, with the fence read. A campaign still standing from
   * an earlier call is resigned first, as resign() does (no onLost; its promise never settles):
   * forgotten while its lease is kept alive, its key would stay ahead of every later one, and no
   * replica could win.
   */
  campaign(): Promise<void> {
    if (this.campaignObj) {
      this.superseded.add(this.campaignObj);
      // Its part before the key's delete is synchronous: forgotten, and not leader, at once.
      void this.resign();
    }
    return new Promise((resolve, reject) => {
      const election = this.client.election(keys.election(), this.ttlSeconds);
      const c = election.campaign(this.candidateId);
      this.campaignObj = c;
      let ended = false;
      const deadline = leaseDeadline(c, this.ttlSeconds * 1000);
      let watchdog: NodeJS.Timeout | undefined;
      const stopWatchdog = (): void => {
        if (watchdog) clearInterval(watchdog);
        watchdog = undefined;
        deadline.close();
      };
      this.stopWatchdog = stopWatchdog;
      /** Leadership ends here: this campaign's key may outlive it, so it is revoked (a new campaign would wait behind it). */
      const stepDown = (): void => {
        stopWatchdog();
        ended = true;
        const was = this.leader && this.campaignObj === c;
        if (this.campaignObj === c) {
          this.leader = false;
          this.campaignObj = undefined;
        }
        void c.resign().catch(() => undefined);
        if (was) for (const cb of this.lostCbs) cb();
      };
      c.on('elected', () => {
        // The fence: the campaign key (prefix + lease id) at the create revision it has now.
        // Gone already (the lease lapsed in between): a fence no write can pass. Read again
        // on a failed read (an etcd hiccup): giving up here leaves the election to the caller.
        const readFence = async (): Promise<LeaderFence> => {
          const key = await c.getCampaignKey();
          for (let attempt = 1; ; attempt++) {
            try {
              const res = await this.client.get(key).exec();
              const kv = res.kvs[0];
              return { key, createRevision: kv ? Number(kv.create_revision) : -1, clusterId: res.header.cluster_id, storeId: fleetStoreId(await incarnation(this.client)) };
            } catch (e) {
              if (attempt === 5 || ended) throw e;
              await new Promise((r) => setTimeout(r, 200 * attempt));
            }
          }
        };
        readFence().then(
          (fence) => {
            // Lost, resigned or superseded while the fence was read: this campaign is over, and
            // its key, which would hold every other campaign back while its lease lives, goes.
            if (ended || this.campaignObj !== c) {
              stopWatchdog();
              void c.resign().catch(() => undefined);
              return;
            }
            this.lastFence = fence;
            this.leader = true;
            this.leaseUntil = deadline.known ? deadline.until : undefined;
            if (deadline.known) {
              watchdog = setInterval(() => {
                if (performance.now() >= deadline.until() - LEASE_MARGIN_MS) stepDown();
              }, LEASE_CHECK_MS);
              watchdog.unref();
            }
            resolve();
          },
          (err: unknown) => {
            ended = true;
            deadline.close();
            void c.resign().catch(() => undefined);
            if (!this.superseded.has(c)) reject(err instanceof Error ? err : new Error(String(err)));
          },
        );
      });
      c.on('error', (err: Error) => {
        stopWatchdog();
        ended = true;
        const was = this.leader && this.campaignObj === c;
        if (this.campaignObj === c) this.leader = false;
        if (was) for (const cb of this.lostCbs) cb();
        else if (!this.superseded.has(c)) reject(err);
      });
    });
  }

  onLost(cb: () => void): void {
    this.lostCbs.push(cb);
  }

  /**
   * Leading, and the lease has not run out: checked against the deadline here too, not only
   * by the watchdog's timer, so a replica whose event loop stalled past its lease knows it
   * before the timer runs (I/O callbacks can come first after a stall).
   */
  isLeader(): boolean {
    if (!this.leader) return false;
    const until = this.leaseUntil;
    return until === undefined || performance.now() < until() - LEASE_MARGIN_MS;
  }

  fence(): LeaderFence | undefined {
    return this.lastFence;
  }

  async resign(): Promise<void> {
    this.leader = false;
    // Forgotten first: a campaign whose fence read ends after this does not become leader.
    const c = this.campaignObj;
    this.campaignObj = undefined;
    this.stopWatchdog?.();
    await c?.resign().catch(() => undefined);
  }
}
