import { EventEmitter } from 'node:events';
import { describe, expect, it } from 'vitest';
import { Etcd3 } from 'etcd3';
import { EtcdLeaderElection, fleetStoreId } from './election.ts';

describe('fleet store ids', () => {
  it('fleetStoreId_ofAStoreMadeLater_isLarger_andEachIsANonZeroUint64', () => {
    const made = (ms: number, rnd: string): bigint => BigInt(fleetStoreId(`${ms}.${rnd}`));
    const first = made(1_700_000_000_000, 'aa');
    // Made a second later, whatever the random part: larger (agents keep the newest store's work).
    for (const rnd of ['00', 'ff', 'a1b2']) expect(made(1_700_000_001_000, rnd)).toBeGreaterThan(first);
    // The same incarnation, the same id (every leader of one store sends the same).
    expect(made(1_700_000_000_000, 'aa')).toBe(first);
    expect(made(1_700_000_000_000, 'ab')).not.toBe(first);
    for (const id of [first, BigInt(fleetStoreId('not-an-incarnation')), BigInt(fleetStoreId(`${2 ** 40}.x`))]) {
      expect(id).toBeGreaterThan(0n);
      expect(id).toBeLessThan(2n ** 64n);
    }
  });
});

const sleep = (ms: number): Promise<'pending'> => new Promise((r) => setTimeout(() => r('pending'), ms));

describe('leader election', () => {
  it('campaign_whenItsKeyWasMadeByAnEarlierTryOfTheTxn_waitsOnlyForKeysMadeBeforeIt_andWins', async () => {
    // etcd3's client over a stand-in for etcd: the campaign's create txn landed once, its answer
    // was lost, and the txn sent again finds the key there (else branch), made at revision 100
    // while etcd is at 105 now. Only the campaign's own key is in the election.
    const client = new Etcd3({ hosts: 'http://127.0.0.1:1' });
    const own = (key: Buffer | string): object => ({ key: Buffer.from(key), value: Buffer.from('me'), create_revision: '100', mod_revision: '100', version: '1', lease: '42' });
    const header = { revision: '105', cluster_id: '7' };
    const waitedBefore: string[] = [];
    client.mock({
      exec: async (_service: string, method: string, payload: { compare?: Array<{ key: Buffer }>; key?: Buffer; max_create_revision?: string }) => {
        if (method === 'leaseGrant') return { ID: '42', TTL: '2', header };
        if (method === 'leaseRevoke') return { header };
        if (method === 'txn' && String(payload.compare?.[0]?.key).startsWith('election/'))
          return { succeeded: false, header, responses: [{ response_range: { kvs: [own(payload.compare![0]!.key)], more: false, count: '1' } }] };
        if (method === 'txn') return { succeeded: false, header, responses: [{ response_range: { kvs: [{ value: Buffer.from('1700000000000.ab') }] } }] }; // incarnation
        if (method === 'range' && payload.max_create_revision !== undefined) {
          waitedBefore.push(payload.max_create_revision);
          return { header, kvs: Number(payload.max_create_revision) < 100 ? [] : [own('election//ff/v1/election/42')], more: false, count: '0' };
        }
        if (method === 'range') return { header, kvs: [own(payload.key!)], more: false, count: '1' };
        throw new Error(`unexpected ${method}`);
      },
      // Watches and keepalives: never answered (a wait for the own key to go would be for ever).
      withConnection: () => new Promise(() => undefined),
    } as never);
    const el = new EtcdLeaderElection(client, 'me', 2);
    try {
      expect(await Promise.race([el.campaign(), sleep(1000)])).toBeUndefined();
      expect(waitedBefore).toEqual(['99']);
      expect(el.isLeader()).toBe(true);
      expect(el.fence()?.createRevision).toBe(100);
    } finally {
      await el.resign();
      client.close();
    }
  });

  it('campaign_whenAnEarlierCampaignStillStands_resignsIt_andOnlyTheLaterOneLeads', async () => {
    // A stand-in client whose campaigns the test elects by hand.
    const campaigns: Array<EventEmitter & { resigned: number; lease: EventEmitter; getCampaignKey: () => Promise<string>; resign: () => Promise<void> }> = [];
    const client = {
      election: () => ({
        campaign: () => {
          const n = campaigns.length + 1;
          const c = Object.assign(new EventEmitter(), {
            resigned: 0,
            lease: new EventEmitter(),
            getCampaignKey: async () => `election//ff/v1/election/${n}`,
            resign: async () => void c.resigned++,
          });
          campaigns.push(c);
          return c;
        },
      }),
      get: (key: string) => ({ exec: async () => ({ kvs: [{ create_revision: key.slice(-1) }], header: { cluster_id: '7' } }) }),
      put: () => ({ value: () => ({}) }),
      if: () => ({ then: () => ({ else: () => ({ commit: async () => ({ succeeded: false, responses: [{ response_range: { kvs: [{ value: Buffer.from('1700000000000.ab') }] } }] }) }) }) }),
    };
    const el = new EtcdLeaderElection(client as never, 'me', 2);
    let firstSettled = false;
    void el.campaign().then(
      () => (firstSettled = true),
      () => (firstSettled = true),
    );
    const second = el.campaign(); // e.g. a failed start's retry racing onLost's
    const [first, later] = [campaigns[0]!, campaigns[1]!];
    try {
      // Its key would hold every later campaign back while its lease lives.
      expect(first.resigned).toBeGreaterThan(0);
      // Elected anyway (it was ahead of the later one): not the leader, and its key goes.
      const before = first.resigned;
      first.emit('elected');
      await sleep(20);
      expect(el.isLeader()).toBe(false);
      expect(first.resigned).toBeGreaterThan(before);
      first.emit('error', new Error('lease revoked'));
      await sleep(0);
      expect(firstSettled).toBe(false); // its caller does not stand again on top of the later one
      later.emit('elected');
      await second;
      expect(el.isLeader()).toBe(true);
      expect(el.fence()?.createRevision).toBe(2);
      expect(later.resigned).toBe(0);
    } finally {
      await el.resign();
    }
  });
});
