import { describe, expect, it } from 'vitest';
import { makeKey, testConfig } from '../helpers/config.js';
import { useTestGateway } from '../helpers/gateway.js';
import { inOneMinute } from '../helpers/time.js';

// GET /v1/me/usage: a key's holder reads its account's quota from the store the gateway
// enforces with. It costs the key nothing and counts per client address (4 a minute here), so
// it answers when the key is over its limit or banned.

const tiny = makeKey('tiny'); // 3 a minute, 4 a day
const other = makeKey('free');
const gw = useTestGateway({ config: testConfig([tiny, other]) });

const usage = async (key?: string) => {
  const res = await gw.call('/v1/me/usage', key);
  return { status: res.status, body: await res.json(), headers: res.headers };
};

describe("a key's own usage", () => {
  it('shows the windows as the store holds them, costs the key nothing, and answers past its limit', async () => {
    gw.freshCounters(); // each test's own counters: the per-address minute included
    await inOneMinute(
      async () => {
        for (let i = 0; i < 3; i++) expect((await gw.call('/v1/pets', tiny.key)).status).toBe(200);
        expect((await gw.call('/v1/pets', tiny.key)).status).toBe(429);
        const seen = await usage(tiny.key);
        expect(seen.status).toBe(200);
        expect(seen.headers.get('cache-control')).toBe('no-store');
        expect(seen.body).toMatchObject({
          account: tiny.id,
          plan: 'tiny',
          limits: { perMinute: 3, perDay: 4 },
          enforced: true,
          windows: { minute: { limit: 3, used: 3, remaining: 0 }, day: { limit: 4, used: 3, remaining: 1 } },
          ban: { active: false, until: null },
          recentRejections: 1,
        });
        // Asked again: the same counts, since the lookup itself is not counted against the key.
        expect((await usage(tiny.key)).body.windows.minute.used).toBe(3);
      },
      () => gw.freshCounters(),
    );
  });

  it("shows only the caller's own account, needs a key, and is limited per client address", async () => {
    gw.freshCounters();
    await inOneMinute(
      async () => {
        expect((await usage(other.key)).body).toMatchObject({ account: other.id, windows: { minute: { used: 0 } } });
        const without = await usage();
        expect(without.status).toBe(401);
        expect(without.body.code).toBe('unauthorized');
        // 4 a minute per address (unauthenticated.perMinute): the two above, two more, then 429.
        expect([(await usage(other.key)).status, (await usage(other.key)).status]).toEqual([200, 200]);
        const limited = await usage(other.key);
        expect(limited.status).toBe(429);
        expect(limited.body.code).toBe('rate_limited');
        expect(limited.headers.get('retry-after')).toMatch(/^[0-9]+$/);
      },
      () => gw.freshCounters(),
    );
  });

  it('answers GET and HEAD only, in the Error shape, never proxied', async () => {
    gw.freshCounters();
    const res = await gw.call('/v1/me/usage', other.key, { method: 'POST' });
    expect(res.status).toBe(405);
    expect(res.headers.get('allow')).toBe('GET, HEAD');
    expect((await res.json()).code).toBe('method_not_allowed');
    expect(gw.echo!.seen.filter((r) => r.url.startsWith('/v1/me'))).toEqual([]);
  });
});
