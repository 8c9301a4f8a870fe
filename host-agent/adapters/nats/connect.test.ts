// The agent's first NATS connect waits only for what passes with time: a server not reached.
// A refused key, or a TLS handshake that fails (nats.js passes the socket's error on), stops it.
import { describe, expect, it } from 'vitest';
import pino from 'pino';
import { ErrorCode, NatsError, type NatsConnection } from 'nats';
import { connectWaiting, waitingHelps } from './connect.ts';

const socketError = (code: string): Error => Object.assign(new Error(code), { code });

describe('the agent waiting for NATS at start', () => {
  it('waitingHelps_forAServerNotReached_notForRefusedCredentialsOrAFailedTlsHandshake', () => {
    expect(waitingHelps(new NatsError('refused', ErrorCode.ConnectionRefused))).toBe(true);
    expect(waitingHelps(socketError('ENOTFOUND'))).toBe(true);
    expect(waitingHelps(socketError('ECONNRESET'))).toBe(true);
    expect(waitingHelps(new NatsError('no', ErrorCode.AuthorizationViolation))).toBe(false);
    expect(waitingHelps(socketError('DEPTH_ZERO_SELF_SIGNED_CERT'))).toBe(false);
    expect(waitingHelps(socketError('ERR_TLS_CERT_ALTNAME_INVALID'))).toBe(false);
    expect(waitingHelps(new Error('no code'))).toBe(false);
  });

  it('connectWaiting_triesAgainWhileNoServerAnswers_andFailsAtOnceOnACertificateThatDoesNotVerify', async () => {
    const slept: number[] = [];
    const nc = {} as NatsConnection;
    let tries = 0;
    const log = pino({ level: 'silent' });
    const got = await connectWaiting({}, log, { connect: async () => (++tries < 4 ? Promise.reject(socketError('ECONNREFUSED')) : nc), sleep: async (ms) => void slept.push(ms) });
    expect(got).toBe(nc);
    expect(slept).toEqual([1000, 2000, 4000]);
    let tlsTries = 0;
    await expect(connectWaiting({}, log, { connect: async () => (tlsTries++, Promise.reject(socketError('DEPTH_ZERO_SELF_SIGNED_CERT'))), sleep: async () => undefined })).rejects.toMatchObject({ code: 'DEPTH_ZERO_SELF_SIGNED_CERT' });
    expect(tlsTries).toBe(1);
  });
});
