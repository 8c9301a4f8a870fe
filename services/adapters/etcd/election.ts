// Scheduler leader election on etcd (etcd3 Election). The lease TTL bounds failover: a
// killed leader's lease lapses after `ttlSeconds`, then a standby's campaign wins.
import type { Etcd3 } from 'etcd3';
import type { Campaign } from 'etcd3';
import type { LeaderElection, LeaderFence } from '../../domain/ports.ts';
import { keys } from './keys.ts';

export class EtcdLeaderElection implements LeaderElection {
  private campaignObj: Campaign | undefined;
  private leader = false;
  private lastFence: LeaderFence | undefined;
  private readonly lostCbs: Array<() => void> = [];

  constructor(
    private readonly client: Etcd3,
    private readonly candidateId: string,
    private readonly ttlSeconds = 2,
  ) {}

  campaign(): Promise<void> {
    return new Promise((resolve, reject) => {
      const election = this.client.election(keys.election(), this.ttlSeconds);
      const c = election.campaign(this.candidateId);
      this.campaignObj = c;
      let ended = false;
      c.on('elected', () => {
        // The fence: the campaign key (prefix + lease id) at the create revision it has now.
        // Gone already (the lease lapsed in between): a fence no write can pass. Read again
        // on a failed read (an etcd hiccup): giving up here leaves the election to the caller.
        const readFence = async (): Promise<LeaderFence> => {
          const key = await c.getCampaignKey();
          for (let attempt = 1; ; attempt++) {
            try {
              const kv = (await this.client.get(key).exec()).kvs[0];
              return { key, createRevision: kv ? Number(kv.create_revision) : -1 };
            } catch (e) {
              if (attempt === 5 || ended) throw e;
              await new Promise((r) => setTimeout(r, 200 * attempt));
            }
          }
        };
        readFence().then(
          (fence) => {
            // Lost (or resigned) while the fence was read: this campaign is over.
            if (ended || this.campaignObj !== c) return;
            this.lastFence = fence;
            this.leader = true;
            resolve();
          },
          (err: unknown) => {
            ended = true;
            void c.resign().catch(() => undefined);
            reject(err instanceof Error ? err : new Error(String(err)));
          },
        );
      });
      c.on('error', (err: Error) => {
        ended = true;
        const was = this.leader && this.campaignObj === c;
        if (this.campaignObj === c) this.leader = false;
        if (was) for (const cb of this.lostCbs) cb();
        else reject(err);
      });
    });
  }

  onLost(cb: () => void): void {
    this.lostCbs.push(cb);
  }

  isLeader(): boolean {
    return this.leader;
  }

  fence(): LeaderFence | undefined {
    return this.lastFence;
  }

  async resign(): Promise<void> {
    this.leader = false;
    // Forgotten first: a campaign whose fence read ends after this does not become leader.
    const c = this.campaignObj;
    this.campaignObj = undefined;
    await c?.resign().catch(() => undefined);
  }
}
