import { describe, expect, it } from 'vitest';
import { compileAgentConfig, DEFAULT_GUEST_CGROUP } from './config.ts';
import { fieldOf } from '../services/testkit/fields.ts';

const base = { FF_TRUSTED_KEY: '/k.pem', FF_HOST_ID: 'h1' };

describe('compileAgentConfig: guest CPU isolation', () => {
  it('guestCgroup_unset_isTheDefaultGroupAndOptional', () => {
    expect(compileAgentConfig(base).guestCgroup).toEqual({ path: DEFAULT_GUEST_CGROUP, cpuWeight: 100, required: false });
  });

  it('guestCgroup_set_isRequired_andEmptyTurnsItOff', () => {
    expect(compileAgentConfig({ ...base, FF_GUEST_CGROUP: 'forkfleet/guests', FF_GUEST_CPU_WEIGHT: '400' }).guestCgroup).toEqual({ path: 'forkfleet/guests', cpuWeight: 400, required: true });
    expect(compileAgentConfig({ ...base, FF_GUEST_CGROUP: '' }).guestCgroup).toBeUndefined();
  });

  it('guestCgroup_whenPathEscapesOrWeightIsOutOfRange_namesTheVariable', () => {
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_GUEST_CGROUP: '../x' }))).toBe('FF_GUEST_CGROUP');
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_GUEST_CGROUP: 'a b' }))).toBe('FF_GUEST_CGROUP');
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_GUEST_CPU_WEIGHT: '0' }))).toBe('FF_GUEST_CPU_WEIGHT');
    expect(fieldOf(() => compileAgentConfig({ ...base, FF_GUEST_CPU_WEIGHT: '10001' }))).toBe('FF_GUEST_CPU_WEIGHT');
  });
});
