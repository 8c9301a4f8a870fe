import { describe, expect, it } from 'vitest';
import { hostGroupPermissions, hostPermissions, natsServerAuthConfig } from './auth.ts';

describe('NATS permissions', () => {
  it('hostPermissions_namesOnlyItsOwnSubjectsAndConsumer', () => {
    const p = hostPermissions('h1');
    const all = [...p.publish.allow, ...p.subscribe.allow];
    expect(all.filter((s) => /[*>]$/.test(s))).toEqual(['ff.execout.h1.>', '$JS.ACK.FF_WORK.agent-h1.>', '_INBOX_h1.>']);
    expect(all.filter((s) => s.includes('h2'))).toEqual([]);
    expect(p.publish.allow).toContain('$JS.API.CONSUMER.CREATE.FF_WORK.agent-h1.ff.work.h1');
    expect(p.publish.allow.some((s) => s.includes('DURABLE.CREATE') || s.includes('STREAM.CREATE') || s.startsWith('ff.work.'))).toBe(false);
    expect(p.subscribe.allow).toEqual(['ff.exec.h1', 'ff.file.h1', '_INBOX_h1.>']);
  });
  it('hostGroupPermissions_isTheUnionWithOneInbox', () => {
    const p = hostGroupPermissions(['f-1', 'f-2'], '_INBOX_fakes');
    expect(p.subscribe.allow).toEqual(['ff.exec.f-1', 'ff.file.f-1', 'ff.exec.f-2', 'ff.file.f-2', '_INBOX_fakes.>']);
    expect(p.publish.allow).toContain('ff.result.f-2');
  });
  it('natsServerAuthConfig_schedulerHasNoPermissionBlock', () => {
    const cfg = JSON.parse(natsServerAuthConfig([{ nkey: 'US' }, { nkey: 'UH', permissions: hostPermissions('h1') }])) as { authorization: { users: Array<{ nkey: string; permissions?: unknown }> } };
    expect(cfg.authorization.users[0]).toEqual({ nkey: 'US' });
    expect(cfg.authorization.users[1]?.permissions).toBeDefined();
  });
});
