import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { type Gateway, call, makeKey, startGateway, startStack, testConfig } from '../helpers/stack.js';
import { roomInMinute } from '../helpers/time.js';

const free = makeKey('free'); // 5/min
const tiny = makeKey('tiny'); // 3/min, 4/day
const daily = { ...makeKey('enterprise'), limits: { perMinute: 10, perDay: 3 } };
const crowd = { ...makeKey('enterprise'), limits: { perMinute: 40, perDay: 100000 } };
const offender = makeKey('free');
let stack: Awaited<ReturnType<typeof startStack>>;
let others: Gateway[];

beforeAll(async () => {
  stack = await startStack(testConfig([free, tiny, daily, crowd, offender]));
  // Two more gateway processes on the same Redis and backend: three instances in all.
  others = await Promise.all([startGateway(stack.env), startGateway(stack.env)]);
});
afterAll(async () => {
  await Promise.all(others.map((g) => g.stop()));
  await stack.stop();
});

const statuses = async (url: string, key: string, n: number) => {
  const out: number[] = [];
  for (let i = 0; i < n; i++) out.push((await call(`${url}/v1/pets`, key)).status);
  return out;
};

describe('quotas through the gateway', () => {
  it('refuses past the minute limit with 429, rate_limited and Retry-After to the minute end', async () => {
    await roomInMinute(5000);
    expect(await statuses(stack.gateway.url, free.key, 5)).toEqual([200, 200, 200, 200, 200]);
    const res = await call(`${stack.gateway.url}/v1/pets`, free.key);
    expect(res.status).toBe(429);
    const body = await res.json();
    expect(body).toEqual({ code: 'rate_limited', message: expect.stringContaining('Minute limit of 5'), status: 429 });
    const retry = Number(res.headers.get('retry-after'));
    const toMinuteEnd = Math.ceil((60_000 - (Date.now() % 60_000)) / 1000);
    expect(Math.abs(retry - toMinuteEnd)).toBeLessThanOrEqual(1);
    expect(res.headers.get('x-ratelimit-remaining')).toBe('0');
    expect(Number(res.headers.get('x-ratelimit-reset'))).toBe(Math.ceil(Date.now() / 60_000) * 60);
    expect(res.headers.get('cache-control')).toBe('no-store');
  });

  it('does not charge the day window for requests refused by the minute limit', async () => {
    await roomInMinute(5000);
    expect(await statuses(stack.gateway.url, tiny.key, 5)).toEqual([200, 200, 200, 429, 429]);
    // The third refusal (one short of a ban): 3 admitted of 4 a day, so one is left.
    const res = await call(`${stack.gateway.url}/v1/pets`, tiny.key);
    expect(res.status).toBe(429);
    expect(res.headers.get('ratelimit')).toMatch(/^"minute";r=0;t=\d+, "day";r=1;t=\d+$/);
  });

  it('refuses past the day limit with daily_quota_exceeded and Retry-After to 00:00 UTC', async () => {
    expect(await statuses(stack.gateway.url, daily.key, 3)).toEqual([200, 200, 200]);
    const res = await call(`${stack.gateway.url}/v1/pets`, daily.key);
    expect(res.status).toBe(429);
    expect((await res.json()).code).toBe('daily_quota_exceeded');
    const toMidnight = Math.ceil((86_400_000 - (Date.now() % 86_400_000)) / 1000);
    expect(Math.abs(Number(res.headers.get('retry-after')) - toMidnight)).toBeLessThanOrEqual(1);
    expect(res.headers.get('x-ratelimit-limit')).toBe('3');
  });

  it('three gateway processes on one Redis admit exactly the limit under concurrent load', async () => {
    await roomInMinute(10_000);
    const urls = [stack.gateway.url, ...others.map((g) => g.url)];
    const all = await Promise.all(
      Array.from({ length: 120 }, (_, i) => call(`${urls[i % 3]}/v1/pets`, crowd.key).then((r) => r.status)),
    );
    expect(all.filter((s) => s === 200)).toHaveLength(40);
    expect(all.filter((s) => s === 429)).toHaveLength(80);
    const after = await call(`${others[1]!.url}/v1/pets`, crowd.key);
    expect(after.headers.get('x-ratelimit-limit')).toBe('40');
  });

  it('bans a key that keeps sending after 429s, on every instance, without extending the ban', async () => {
    await roomInMinute(5000);
    const [a, b] = [stack.gateway.url, others[0]!.url];
    // 5 admitted, 3 refusals allowed, the 4th refusal within 60 s bans.
    expect(await statuses(a, offender.key, 9)).toEqual([200, 200, 200, 200, 200, 429, 429, 429, 429]);
    const first = await call(`${b}/v1/pets`, offender.key);
    expect(first.status).toBe(429);
    expect((await first.json()).code).toBe('key_banned');
    const retry = Number(first.headers.get('retry-after'));
    expect(retry).toBeGreaterThan(890);
    expect(retry).toBeLessThanOrEqual(900);
    expect(first.headers.get('x-ratelimit-remaining')).toBe('0');
    const reset = Number(first.headers.get('x-ratelimit-reset'));
    expect(Math.abs(reset - (Date.now() / 1000 + retry))).toBeLessThanOrEqual(2);
    for (const url of [a, b, others[1]!.url, a]) {
      const res = await call(`${url}/v1/pets`, offender.key);
      expect(res.status).toBe(429);
      expect(res.headers.get('x-ratelimit-reset')).toBe(String(reset)); // not extended
    }
  });

  it('limits requests without a valid key per address', async () => {
    await roomInMinute(5000);
    // The earlier tests sent none without a key; unauthenticated allows 4 a minute.
    const got: number[] = [];
    for (let i = 0; i < 6; i++) got.push((await fetch(`${others[1]!.url}/v1/pets`)).status);
    expect(got).toEqual([401, 401, 401, 401, 429, 429]);
  });
});
