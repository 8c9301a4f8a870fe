import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { existsSync } from 'node:fs';
import { Etcd3 } from 'etcd3';
import { startEtcd } from './etcd.ts';
import type { EtcdCluster } from './etcd.ts';
import { pidAlive, sleep } from './proc.ts';

describe('etcd harness (real etcd)', () => {
  let etcd: EtcdCluster;
  let client: Etcd3;

  beforeAll(async () => {
    etcd = await startEtcd();
    client = new Etcd3({ hosts: etcd.endpoints });
  });

  afterAll(async () => {
    client?.close();
    await etcd?.stop();
  });

  it('txn_whenModRevisionMatches_commits', async () => {
    await client.put('/t/cas').value('v1');
    const res = await client.get('/t/cas').exec();
    const rev = res.kvs[0]?.mod_revision;
    expect(rev).toBeDefined();
    const txn = await client.if('/t/cas', 'Mod', '==', rev as string).then(client.put('/t/cas').value('v2')).commit();
    expect(txn.succeeded).toBe(true);
    expect(await client.get('/t/cas').string()).toBe('v2');
  });

  it('txn_whenModRevisionIsStale_failsAndLeavesValue', async () => {
    await client.put('/t/stale').value('a');
    const rev = (await client.get('/t/stale').exec()).kvs[0]?.mod_revision as string;
    await client.put('/t/stale').value('b'); // someone else wrote after our read
    const txn = await client.if('/t/stale', 'Mod', '==', rev).then(client.put('/t/stale').value('ours')).commit();
    expect(txn.succeeded).toBe(false);
    expect(await client.get('/t/stale').string()).toBe('b');
  });

  it('lease_whenNotKeptAlive_expiresAndDeletesItsKeys', async () => {
    const lease = client.lease(1, { autoKeepAlive: false });
    await lease.put('/t/leased').value('x');
    expect(await client.get('/t/leased').string()).toBe('x');
    const deadline = Date.now() + 5000;
    while (Date.now() < deadline && (await client.get('/t/leased').string()) !== null) await sleep(100);
    expect(await client.get('/t/leased').string()).toBeNull();
  });

  it('stop_killsProcessByPidAndRemovesDataDir', async () => {
    const extra = await startEtcd();
    const m = extra.members[0];
    expect(m).toBeDefined();
    const { pid, dir } = m!.proc;
    expect(pidAlive(pid)).toBe(true);
    await extra.stop();
    expect(pidAlive(pid)).toBe(false);
    expect(dir !== undefined && existsSync(dir)).toBe(false);
  });
});
