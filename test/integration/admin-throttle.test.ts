import { describe, expect, it } from 'vitest';
import { ADDRESSES_MAX, AuthThrottle, FAILURES_PER_MINUTE } from '../../gateway/admin/auth-throttle.js';
import { makeKey, testConfig } from '../helpers/config.js';
import { useTestGateway } from '../helpers/gateway.js';

// The admin port defends its token: past FAILURES_PER_MINUTE failed authentications in a minute
// from one address, that address is answered 429 (Error shape, Retry-After) whatever it sends,
// and every admin log line names the client's address.
const TOKEN = 'admin-token-0123456789abcdef';
const k = makeKey('free');
const gw = useTestGateway({ config: testConfig([k]), admin: { token: TOKEN } });

const usage = (token: string) => fetch(`${gw.adminUrl}/admin/keys/${k.id}/usage`, { headers: { authorization: `Bearer ${token}` } });

describe('failed admin authentications', () => {
  it(`are refused with 429 after ${FAILURES_PER_MINUTE} in a minute from one address, the right token too`, async () => {
    expect((await usage(TOKEN)).status).toBe(200);
    const statuses = [];
    for (let i = 0; i < FAILURES_PER_MINUTE; i++) statuses.push((await usage(`wrong-token-${i}-xxxxxxxxxxxx`)).status);
    expect(statuses).toEqual(Array(FAILURES_PER_MINUTE).fill(401));
    for (const token of ['wrong-token-again-xxxxxxxxxx', TOKEN]) {
      const res = await usage(token);
      expect(res.status).toBe(429);
      expect(Number(res.headers.get('retry-after'))).toBeGreaterThan(0);
      expect(await res.json()).toEqual({
        code: 'rate_limited',
        message: expect.stringMatching(/failed admin authentications/),
        status: 429,
      });
    }
    // Health, readiness and metrics take no token: never throttled.
    expect((await fetch(`${gw.adminUrl}/healthz`)).status).toBe(200);
    const lines = gw.logs.filter((l) => l.msg === 'admin request');
    expect(lines.length).toBeGreaterThan(FAILURES_PER_MINUTE);
    expect(lines.every((l) => l.address === '127.0.0.1')).toBe(true);
    expect(gw.logs.some((l) => l.level === 40 && l.address === '127.0.0.1' && /failed authentications/.test(String(l.msg)))).toBe(true);
  });

  it(`remembers at most ${ADDRESSES_MAX} addresses, and a minute's failures from one address only`, () => {
    let now = 0;
    const throttle = new AuthThrottle(() => now);
    for (let i = 0; i < 3 * ADDRESSES_MAX; i++) throttle.failed(`10.0.${i >> 8}.${i & 255}`);
    expect(throttle.addresses).toBe(ADDRESSES_MAX);
    for (let i = 0; i < FAILURES_PER_MINUTE; i++) throttle.failed('192.0.2.1');
    expect(throttle.retryAfter('192.0.2.1')).toBe(60);
    expect(throttle.retryAfter('192.0.2.2')).toBe(0);
    now += 60_000;
    expect(throttle.retryAfter('192.0.2.1')).toBe(0);
  });
});
