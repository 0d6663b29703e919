import { loadSettings } from '../../gateway/config/settings.js';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { Validator } from '@seriousme/openapi-schema-validator';
import { describe, expect, it, onTestFinished } from 'vitest';
import { parseConfigText } from '../../gateway/config/config.js';
import { makeKey, type TestKey, tempDir, testConfig, uniquePrefix } from '../helpers/config.js';
import { buildTestGateway, type TestGateway, type TestGatewayOptions } from '../helpers/gateway.js';
import { spawnRedis, testClient } from '../helpers/redis.js';
import { eventually, inOneMinute } from '../helpers/time.js';
import { scaled } from '../helpers/budget.js';

// The admin surface (health, readiness, metrics, key usage) and the access log, through the
// in-process gateway and admin app on real ports and real Redis. Every test builds its own
// gateway, so its counters, metrics and logs start from zero and it passes alone.
const ADMIN_TOKEN = 'admin-token-0123456789';
const ADMIN_ROUTES = ['/healthz', '/readyz', '/metrics', '/admin/keys/:id/usage'];

function build(keys: TestKey[], over: Partial<TestGatewayOptions> = {}): Promise<TestGateway> {
  return buildTestGateway({ config: testConfig(keys), admin: { token: ADMIN_TOKEN }, ...over });
}

/**
 * The gateway's calls of two of its scripts on its Redis client, counted as they are sent: the
 * quota decision, and the heartbeat (also the probe while Redis is declared failing). A frozen
 * Redis answers neither: what a test waits on instead of a pause.
 */
function watchScripts(gw: TestGateway) {
  const seen = { quota: 0, quotaInFlight: 0, heartbeat: 0, heartbeatInFlight: 0 };
  const client = gw.redis as unknown as Record<'quota' | 'heartbeat', (...a: unknown[]) => Promise<unknown>>;
  const quota = client.quota.bind(client);
  const heartbeat = client.heartbeat.bind(client);
  client.quota = (...a) => {
    seen.quota++;
    seen.quotaInFlight++;
    return quota(...a).finally(() => seen.quotaInFlight--);
  };
  client.heartbeat = (...a) => {
    seen.heartbeat++;
    seen.heartbeatInFlight++;
    return heartbeat(...a).finally(() => seen.heartbeatInFlight--);
  };
  return seen;
}

const admin = (gw: TestGateway, path: string, token?: string) =>
  fetch(`${gw.adminUrl}${path}`, { headers: token ? { authorization: `Bearer ${token}` } : {} });
const metrics = async (gw: TestGateway) => (await admin(gw, '/metrics')).text();
/** Quota calls made to Redis (answered or given up on), and decisions made in-process because Redis was declared failing. */
async function quotaCounts(gw: TestGateway): Promise<{ calls: number; local: number }> {
  const text = await metrics(gw);
  return {
    calls: Number(/^gateway_redis_duration_seconds_count (\d+)$/m.exec(text)?.[1]),
    local: Number(/^gateway_quota_local_decisions_total\{reason="failing"\} (\d+)$/m.exec(text)?.[1]),
  };
}
const usage = async (gw: TestGateway, id: string) => (await admin(gw, `/admin/keys/${id}/usage`, ADMIN_TOKEN)).json();
/** The Redis hash a key's counters live in, as the gateway named it. */
const redisKey = (gw: TestGateway, id: string) => [...gw.gateway.config().consumers.values()].find((c) => c.id === id)!.subject.name;
const codes = async (gw: TestGateway, key: string, n: number) => {
  const out: string[] = [];
  for (let i = 0; i < n; i++) {
    const res = await gw.call('/v1/pets', key);
    out.push(res.ok ? String(res.status) : (await res.json()).code);
  }
  return out;
};

describe('admin port', () => {
  it('answers health and readiness', async () => {
    const gw = await build([]);
    expect(await (await admin(gw, '/healthz')).json()).toEqual({ status: 'ok' });
    // One access line per admin request too, not fastify's "incoming request" / "request completed" pair.
    const line = await gw.waitForLog((l) => l.msg === 'admin request' && l.url === '/healthz');
    expect(line).toMatchObject({ method: 'GET', status: 200, ms: expect.any(Number) });
    expect(gw.logs.filter((l) => l.msg === 'incoming request' || l.msg === 'request completed')).toEqual([]);
    const ready = await admin(gw, '/readyz');
    expect(ready.status).toBe(200);
    expect(await ready.json()).toEqual({ status: 'ready', store: 'redis' });
    expect(gw.echo!.seen.map((s) => s.url)).toEqual(['/healthz']); // readiness asked the backend
  });

  it('shows a key usage that moves with its requests, behind the admin token', async () => {
    const k = makeKey('free'); // 5 a minute
    // A fresh gateway per run, so a run discarded by inOneMinute leaves nothing behind.
    const gw = await inOneMinute(async () => {
      const gw = await build([k]);
      const before = await usage(gw, k.id);
      expect(before).toMatchObject({ id: k.id, plan: 'free', revoked: false, limits: { perMinute: 5, perDay: 1000 } });
      expect(before.windows.minute.used).toBe(0);
      expect(await codes(gw, k.key, 7)).toEqual(['200', '200', '200', '200', '200', 'rate_limited', 'rate_limited']);
      const after = await usage(gw, k.id);
      expect(after.windows.minute).toEqual({ limit: 5, used: 5, remaining: 0, resetAt: expect.stringMatching(/:00\.000Z$/) });
      expect(Date.parse(after.windows.minute.resetAt)).toBe((Math.floor(Date.now() / 60_000) + 1) * 60_000);
      expect(after.windows.day).toMatchObject({ used: before.windows.day.used + 5, remaining: 995 });
      expect(after.recentRejections).toBe(2);
      expect(after.ban).toEqual({ active: false, until: null });
      expect(after.store).toBe('redis');
      return gw;
    });

    for (const token of [undefined, 'wrong-token-0123456789']) {
      const res = await admin(gw, `/admin/keys/${k.id}/usage`, token);
      expect(res.status).toBe(401);
      expect((await res.json()).code).toBe('unauthorized');
    }
    const missing = await admin(gw, '/admin/keys/nobody/usage', ADMIN_TOKEN);
    expect(missing.status).toBe(404);
    expect((await missing.json()).code).toBe('key_not_found');
  });

  it('serves Prometheus metrics with bounded labels and no key ids', async () => {
    const k = makeKey('free'); // 5 a minute
    const text = await inOneMinute(async () => {
      const gw = await build([k]);
      expect(await codes(gw, k.key, 6)).toEqual(['200', '200', '200', '200', '200', 'rate_limited']);
      expect((await gw.call('/v1/pets')).status).toBe(401);
      const res = await admin(gw, '/metrics');
      expect(res.headers.get('content-type')).toMatch(/^text\/plain/);
      return res.text();
    });
    // This gateway answered exactly these requests: 5 admitted, 1 over the minute limit, 1 without a key.
    expect(text).toMatch(/^gateway_requests_total\{route="listPets",status="200",plan="free"\} 5$/m);
    expect(text).toMatch(/^gateway_requests_total\{route="listPets",status="429",plan="free"\} 1$/m);
    expect(text).toMatch(/^gateway_requests_total\{route="none",status="401",plan="none"\} 1$/m);
    expect(text).toMatch(/^gateway_rejections_total\{reason="minute"\} 1$/m);
    expect(text).toMatch(/^gateway_rejections_total\{reason="unauthenticated"\} 1$/m);
    expect(text).toMatch(/^gateway_redis_duration_seconds_count 7$/m); // one script call per request
    expect(text).toMatch(/^gateway_upstream_duration_seconds_count\{route="listPets"\} 5$/m);
    expect(text).toMatch(/^gateway_bans_active 0$/m);
    expect(text).toMatch(/^gateway_quota_store_degraded 0$/m);
    expect(text).not.toContain(k.id);
    expect(text).not.toContain(k.key);
  });

  it('shows a ban in the usage and the metrics', async () => {
    const k = makeKey('free'); // 5 a minute; bans: afterRejected 3 within 60 s, for 900 s
    const gw = await inOneMinute(async () => {
      const gw = await build([k]);
      // 5 admitted, 3 refusals allowed, the 4th refusal bans.
      expect(await codes(gw, k.key, 9)).toEqual([
        ...['200', '200', '200', '200', '200'],
        ...['rate_limited', 'rate_limited', 'rate_limited', 'key_banned'],
      ]);
      return gw;
    });
    const after = await usage(gw, k.id);
    expect(after.ban.active).toBe(true);
    expect(Date.parse(after.ban.until) - Date.now()).toBeGreaterThan(890_000);
    expect(Date.parse(after.ban.until) - Date.now()).toBeLessThanOrEqual(900_000);
    const text = await metrics(gw);
    expect(text).toMatch(/^gateway_bans_active 1$/m);
    expect(text).toMatch(/^gateway_rejections_total\{reason="banned"\} 1$/m);
    expect(text).toMatch(/^gateway_rejections_total\{reason="minute"\} 3$/m);
  });

  it('lifts a ban on the admin port, and every instance sees it within a second', async () => {
    const k = makeKey('free'); // 5 a minute; banned after 4 refusals within 60 s
    const prefix = uniquePrefix(); // two instances on one Redis: one deployment
    const [a, b] = [await build([k], { redisKeyPrefix: prefix }), await build([k], { redisKeyPrefix: prefix })];
    // At most 10 of 30 fit two minute windows, so refusals pile up within 60 s whatever the clock.
    let last = '';
    for (let i = 0; i < 30 && last !== 'key_banned'; i++) last = (await codes(a, k.key, 1))[0]!;
    expect(last).toBe('key_banned');
    expect(await codes(b, k.key, 1)).toEqual(['key_banned']); // b has seen it from Redis and keeps it
    const unban = await fetch(`${a.adminUrl}/admin/accounts/${k.id}/unban`, {
      method: 'POST',
      headers: { authorization: `Bearer ${ADMIN_TOKEN}` },
    });
    expect(await unban.json()).toEqual({ account: k.id, lifted: true });
    expect((await usage(a, k.id)).ban).toEqual({ active: false, until: null });
    expect(await codes(a, k.key, 1)).not.toEqual(['key_banned']);
    // b asks Redis again once its copy of the ban is a second old.
    await eventually(async () => (await codes(b, k.key, 1))[0] !== 'key_banned', 3000, 'the ban lifted on b');
  });

  it('answers 401 to everyone when no admin token is set, and logs why', async () => {
    const k = makeKey('free');
    const gw = await build([k], { admin: {} });
    const res = await admin(gw, `/admin/keys/${k.id}/usage`, 'anything-at-all-0123');
    expect(res.status).toBe(401);
    expect((await res.json()).message).toMatch(/ADMIN_TOKEN is not configured/);
    expect(gw.logs.some((l) => /ADMIN_TOKEN is not set/.test(String(l.msg)))).toBe(true);
    // With a token set, the same request is let through to the lookup.
    const withToken = await build([k]);
    expect((await admin(withToken, `/admin/keys/${k.id}/usage`, ADMIN_TOKEN)).status).toBe(200);
    expect(withToken.logs.some((l) => /ADMIN_TOKEN is not set/.test(String(l.msg)))).toBe(false);
  });

  it('is never registered on the public server, and listens on its own port', async () => {
    const k = makeKey('free');
    const gw = await build([k]);
    const publicRoutes = gw.app.printRoutes();
    for (const url of ADMIN_ROUTES) {
      expect(gw.admin!.hasRoute({ method: 'GET', url }), url).toBe(true); // the list is the admin app's
      expect(gw.app.hasRoute({ method: 'GET', url }), url).toBe(false);
    }
    // (The public port's own /v1/me/usage is the key holder's view, not this.)
    for (const segment of ['healthz', 'readyz', 'metrics', 'admin']) expect(publicRoutes).not.toContain(segment);
    expect(new URL(gw.adminUrl).port).not.toBe(String(gw.port));
    // And as a client meets it: the public port does not answer them, with a valid key or without.
    for (const path of ['/healthz', '/metrics', `/admin/keys/${k.id}/usage`]) {
      expect((await gw.call(path, k.key)).status, path).toBe(404);
    }
    expect(gw.echo!.seen).toEqual([]);
  });

  it('reports a backend that does not answer, or answers badly, in readiness', async () => {
    const gw = await build([]);
    const { arrived, release } = gw.echo!.hold(); // the backend takes the health check and never answers
    try {
      const ready = await admin(gw, '/readyz');
      expect((await arrived).url).toBe('/healthz');
      expect(ready.status).toBe(503);
      expect((await ready.json()).message).toMatch(/backend/);
    } finally {
      release();
    }
    gw.echo!.answer = (req, res) => {
      res.writeHead(req.url === '/healthz' ? 503 : 200).end();
    };
    const ready = await admin(gw, '/readyz');
    expect(ready.status).toBe(503);
    expect((await ready.json()).message).toMatch(/backend: status 503/);
  });
});

describe('access log', () => {
  it('writes one access line per request with id, key id, plan, route, status, duration and outcome', async () => {
    const k = makeKey('free');
    const gw = await build([k]);
    const reqId = `trace-${k.id}`;
    const res = await gw.call('/v1/pets', k.key, { headers: { 'x-request-id': reqId } });
    expect(res.status).toBe(200);
    expect(res.headers.get('x-request-id')).toBe(reqId);
    const line = await gw.waitForLog((l) => l.reqId === reqId && l.msg === 'request');
    expect(line).toMatchObject({ keyId: k.id, plan: 'free', route: 'listPets', method: 'GET', status: 200, outcome: 'allowed' });
    expect(typeof line.ms).toBe('number');
    expect(gw.logs.filter((l) => l.reqId === reqId)).toHaveLength(1);
    expect(JSON.stringify(gw.logs)).not.toContain(k.key);
  });

  it('names the refusal in the outcome, and the route it was refused on', async () => {
    const k = makeKey('tiny'); // 3 a minute
    const lines = await inOneMinute(async () => {
      const gw = await build([k]);
      for (let i = 0; i < 4; i++) await gw.call('/v1/pets', k.key, { headers: { 'x-request-id': `r${i}-${k.id}` } });
      return Promise.all([0, 3].map((i) => gw.waitForLog((l) => l.reqId === `r${i}-${k.id}` && l.msg === 'request')));
    });
    expect(lines.map((l) => [l.status, l.outcome, l.route])).toEqual([
      [200, 'allowed', 'listPets'],
      [429, 'minute', 'listPets'],
    ]);
  });
});

describe("the admin port's OpenAPI document", () => {
  it('is valid, lists exactly the admin routes, and is served on the admin port only', async () => {
    const gw = await build([]);
    const doc = (await (await admin(gw, '/openapi.json')).json()) as { paths: Record<string, Record<string, unknown>> };
    const result = await new Validator().validate(doc as never);
    expect(result.errors ?? []).toEqual([]);
    const documented = Object.entries(doc.paths).flatMap(([path, ops]) =>
      Object.keys(ops).map((m) => `${m.toUpperCase()} ${path.replace(/\{(\w+)\}/g, ':$1')}`),
    );
    for (const op of documented) {
      const [method, url] = op.split(' ') as [string, string];
      expect(gw.admin!.hasRoute({ method: method as 'GET', url }), op).toBe(true);
    }
    // And every route the admin port serves is documented.
    // printRoutes draws a tree, a level per 4 characters of indent: join each line to its parents.
    const routes: string[] = [];
    const stack: string[] = [];
    for (const line of gw.admin!.printRoutes({ commonPrefix: false }).split('\n').filter(Boolean)) {
      const at = line.search(/[^│├└─\s]/);
      const depth = Math.floor(at / 4);
      const m = /^(\S+)(?: \(([A-Z, ]+)\))?/.exec(line.slice(at))!;
      stack.length = depth;
      stack.push(m[1]!);
      for (const method of m[2]?.split(', ') ?? []) if (method !== 'HEAD') routes.push(`${method} ${stack.join('')}`);
    }
    // The operator page (/admin/ui) is HTML for a browser, not API: kept out of the document on purpose.
    const pages = routes.filter((r) => / \/admin\/ui(\/|$)/.test(r));
    expect(pages.sort()).toEqual(['GET /admin/ui', 'GET /admin/ui/accounts/:account', 'POST /admin/ui/sign-in', 'POST /admin/ui/sign-out']);
    expect(routes.filter((r) => !pages.includes(r)).sort()).toEqual(documented.sort());
    expect((await gw.call('/openapi.json')).status).toBe(401); // not on the public port (without a key, no route is told)
  });
});

describe('accounts in the usage lookup', () => {
  it("a key answers with its account's shared windows; the account answers with its keys", async () => {
    const web = { ...makeKey('free'), account: 'acme' };
    const app = { ...makeKey('free'), account: 'acme' };
    const gw = await build([web, app]);
    await inOneMinute(async () => {
      gw.freshCounters();
      for (const k of [web, app, app]) expect((await gw.call('/v1/pets', k.key)).status).toBe(200);
      const byKey = await usage(gw, web.id);
      expect(byKey).toMatchObject({ id: web.id, account: 'acme', windows: { minute: { used: 3 } } });
      const byAccount = await (await admin(gw, '/admin/accounts/acme/usage', ADMIN_TOKEN)).json();
      expect(byAccount).toMatchObject({ account: 'acme', keys: [app.id, web.id].sort(), windows: { minute: { used: 3 } } });
    });
    expect((await admin(gw, '/admin/accounts/nobody/usage', ADMIN_TOKEN)).status).toBe(404);
    expect((await admin(gw, '/admin/accounts/acme/usage')).status).toBe(401);
  });
});

describe("an account's settings through the key API", () => {
  /** A gateway on a config file of its own, reloaded on change as a deployment's is. */
  async function onFile(keys: TestKey[]) {
    const { dir, cleanup } = tempDir();
    onTestFinished(cleanup);
    const file = join(dir, 'gateway.json');
    return { gw: await build(keys, { configFile: file }), file };
  }
  const put = (gw: TestGateway, account: string, body: unknown) =>
    fetch(`${gw.adminUrl}/admin/accounts/${account}`, {
      method: 'PUT',
      headers: { authorization: `Bearer ${ADMIN_TOKEN}`, 'content-type': 'application/json' },
      body: JSON.stringify(body),
    });
  /** The file's accounts, read as JSON: a JSON file stays JSON (and parseConfigText, the gateway's validator, accepts it). */
  const accountsIn = (file: string) => {
    const text = readFileSync(file, 'utf8');
    expect(parseConfigText(text, file).accounts).toEqual(JSON.parse(text).accounts);
    return JSON.parse(text).accounts;
  };
  const credits = { grant: 500, every: 'month', rollover: true };

  it('PUT sets the billing day and credits in the file, which the gateway then applies; null removes one', async () => {
    const web = { ...makeKey('free'), account: 'acme' };
    const { gw, file } = await onFile([web]);
    const res = await put(gw, 'acme', { billingDay: 15, credits });
    expect(res.status).toBe(200);
    expect(await res.json()).toEqual({ account: 'acme', billingDay: 15, credits });
    expect(accountsIn(file)).toEqual({ acme: { billingDay: 15, credits } });
    await eventually(
      async () => {
        const seen = await usage(gw, web.id);
        return seen.period?.billingDay === 15 && seen.credits?.grant === 500 && seen.credits.rollover === true;
      },
      5000,
      'the reloaded gateway bills acme from the 15th, with its credits',
    );
    const removed = await put(gw, 'acme', { credits: null });
    expect(await removed.json()).toEqual({ account: 'acme', billingDay: 15 });
    expect(accountsIn(file)).toEqual({ acme: { billingDay: 15 } });
    expect(await (await put(gw, 'acme', { billingDay: null })).json()).toEqual({ account: 'acme' });
    expect(accountsIn(file)).toBeUndefined(); // the entry left empty is gone, and the map with it
  });

  it.each([
    ['a billing day of 0', { billingDay: 0 }, 'body.billingDay: Expected union value'],
    ['a billing day of 32', { billingDay: 32 }, 'body.billingDay: Expected union value'],
    ['credits without every', { credits: { grant: 5 } }, 'body.credits: Expected union value'],
    ['a misspelled field', { billingday: 5 }, 'body.billingday: Unexpected property'],
    ['nothing to set', {}, 'body: Expected object to have at least 1 properties'],
  ])('refuses %s: 400 in the Error shape, naming the field, and the file untouched', async (_name, body, message) => {
    const { gw, file } = await onFile([{ ...makeKey('free'), account: 'acme' }]);
    const before = readFileSync(file, 'utf8');
    const res = await put(gw, 'acme', body);
    expect(res.status).toBe(400);
    expect(await res.json()).toEqual({ code: 'bad_request', message, status: 400 });
    expect(readFileSync(file, 'utf8')).toBe(before);
  });

  it('answers 404 key_not_found for an account no key of the file is in, and writes nothing', async () => {
    const { gw, file } = await onFile([{ ...makeKey('free'), account: 'acme' }]);
    const before = readFileSync(file, 'utf8');
    const res = await put(gw, 'nobody', { billingDay: 5 });
    expect(res.status).toBe(404);
    expect(await res.json()).toEqual({
      code: 'key_not_found',
      message: expect.stringMatching(/^no key of account "nobody" in /),
      status: 404,
    });
    expect(readFileSync(file, 'utf8')).toBe(before);
  });
});

describe('a frozen Redis', () => {
  it('keeps serving from the degraded budget while Redis is frozen, says so, and goes back to Redis', async () => {
    const redis = await spawnRedis(); // its own Redis, so this test can freeze it
    onTestFinished(() => redis.stop());
    const other = makeKey('free'); // 5 a minute
    const spare = makeKey('free'); // untouched until Redis comes back
    const poller = { ...makeKey('enterprise'), limits: { perMinute: 100_000, perDay: 1_000_000 } };
    const gw = await build([other, spare, poller], { redis: redis.url });

    redis.proc.kill('SIGSTOP');
    try {
      const res = await gw.call('/v1/pets/1', other.key);
      expect(res.status).toBe(200); // served: the echo backend answers 200 to everything
      expect(gw.echo!.seen.map((s) => s.url)).toEqual(['/v1/pets/1']);
      expect(res.headers.get('x-ratelimit-limit')).toBe('5');
      await gw.waitForLog((l) => String(l.msg).startsWith('quota store: Redis failed'));
      expect(await metrics(gw)).toMatch(/^gateway_quota_store_degraded 1$/m);
      const ready = await admin(gw, '/readyz');
      expect(ready.status).toBe(503);
      expect((await ready.json()).message).toBe('Not ready: redis: connected but not answering in time');
    } finally {
      redis.proc.kill('SIGCONT');
    }
    // Whenever the store tries Redis again, a request is decided there again.
    await eventually(async () => (await gw.call('/v1/pets', poller.key)).ok && !gw.gateway.store.degraded, 10_000, 'back on Redis');
    await gw.waitForLog((l) => l.msg === 'quota store: Redis answers again');
    expect(await metrics(gw)).toMatch(/^gateway_quota_store_degraded 0$/m);
    const res = await gw.call('/v1/pets', spare.key);
    expect(res.status).toBe(200);
    const check = testClient(redis.url);
    try {
      expect(await check.hget(redisKey(gw, spare.id), 'dc')).toBe('1'); // counted in Redis, not in this process
    } finally {
      check.disconnect();
    }
    expect((await admin(gw, '/readyz')).status).toBe(200);
  });

  it('while Redis is frozen only the requests in flight at the freeze wait (up to REDIS_TIMEOUT_MS); later ones never do', async () => {
    const redis = await spawnRedis();
    onTestFinished(() => redis.stop());
    const k = { ...makeKey('enterprise'), limits: { perMinute: 100, perDay: 100_000 } }; // no lease: every request asks
    // The shipped REDIS_TIMEOUT_MS (600 ms once, to save time: the request before the freeze could miss it on a loaded machine).
    const timeoutMs = loadSettings({}).redisTimeoutMs;
    const gw = await build([k], { redis: redis.url });
    expect((await gw.call('/v1/pets', k.key)).status).toBe(200);
    const scripts = watchScripts(gw);
    const timed = async () => {
      const t = performance.now();
      expect((await gw.call('/v1/pets', k.key)).status).toBe(200);
      return performance.now() - t;
    };
    redis.proc.kill('SIGSTOP');
    try {
      expect(await timed()).toBeGreaterThanOrEqual(timeoutMs * 0.9); // the one in flight waits its timeout
      // Then over four probes of Redis (each a heartbeat it leaves unanswered), a steady client
      // sends one request per probe: each is decided in-process, from the degraded budget, and
      // none sends a quota call to wait on (each call is timed in gateway_redis_duration_seconds;
      // the probe is not). Counted, not timed: on a loaded machine any request may take longer
      // than a fraction of the timeout.
      const before = await quotaCounts(gw);
      expect(before.calls).toBeGreaterThanOrEqual(2); // the request before the freeze, and the one that waited
      let later = 0;
      for (; later < 4; later++) {
        const probes = scripts.heartbeat;
        expect((await gw.call('/v1/pets', k.key)).status).toBe(200);
        await eventually(() => scripts.heartbeat > probes, 5000, 'the next probe of Redis');
      }
      expect(await quotaCounts(gw)).toEqual({ calls: before.calls, local: before.local + later });
      expect(scripts.quota).toBe(1); // the one that waited
    } finally {
      redis.proc.kill('SIGCONT');
    }
  });

  it('a slow Redis is waited for: the request is decided and counted in Redis, never in-process', async () => {
    const redis = await spawnRedis();
    onTestFinished(() => redis.stop());
    const k = { ...makeKey('enterprise'), limits: { perMinute: 100, perDay: 100_000 } }; // below 200: no lease, every request asks
    // REDIS_TIMEOUT_MS far above the stall (until the next heartbeat, about 1 s), so a late thaw on a loaded machine stays "slow", never "failing".
    const gw = await build([k], { redis: redis.url, settings: { redisTimeoutMs: 5000 } });
    expect((await gw.call('/v1/pets', k.key)).status).toBe(200);
    const scripts = watchScripts(gw);
    // Frozen between heartbeats: one in flight would hold the next back until REDIS_TIMEOUT_MS.
    await eventually(() => scripts.heartbeatInFlight === 0, 5000, 'no heartbeat in flight');
    redis.proc.kill('SIGSTOP');
    let thawed = false;
    const answer = gw.call('/v1/pets', k.key).then((res) => ({ status: res.status, afterThaw: thawed }));
    try {
      // Slow: silent while the request's quota call waits and the heartbeat after it is sent
      // (a second later), then it answers both.
      await eventually(() => scripts.quotaInFlight === 1, 5000, "the request's quota call sent");
      const beats = scripts.heartbeat;
      await eventually(() => scripts.heartbeat > beats, 5000, 'the next heartbeat sent');
      expect(scripts.quotaInFlight).toBe(1);
    } finally {
      thawed = true;
      redis.proc.kill('SIGCONT');
    }
    // Answered once Redis was: it waited for Redis's own decision.
    expect(await answer).toEqual({ status: 200, afterThaw: true });
    expect(gw.gateway.store.degraded).toBe(false);
    expect(await metrics(gw)).toMatch(/^gateway_quota_local_decisions_total\{reason="failing"\} 0$/m);
    expect((await usage(gw, k.id)).windows.day.used).toBe(2);
  });

  it('counts a request decided from the degraded budget once: Redis, woken, does not count it, and the write-back does', async () => {
    const redis = await spawnRedis();
    onTestFinished(() => redis.stop());
    const k = { ...makeKey('enterprise'), limits: { perMinute: 100, perDay: 100_000 } }; // no lease
    const gw = await build([k], { redis: redis.url });
    expect((await gw.call('/v1/pets', k.key)).status).toBe(200); // decided in Redis
    redis.proc.kill('SIGSTOP');
    try {
      // Three at once: all three scripts are on the wire when Redis stops answering.
      const answers = await Promise.all([1, 2, 3].map(() => gw.call('/v1/pets', k.key)));
      expect(answers.map((r) => r.status)).toEqual([200, 200, 200]);
      expect(gw.gateway.store.degraded).toBe(true);
      // Woken past the scripts' deadlines: each is at most the moment the gateway gave up on its
      // script (quota/redis/clock.ts), which came before its answer. Redis runs on this machine, on this
      // clock: once the clock has moved on from the last answer, every deadline is behind Redis.
      const answered = Date.now();
      await eventually(() => Date.now() > answered, 1000, 'the clock past the last answer');
    } finally {
      redis.proc.kill('SIGCONT');
    }
    await eventually(() => !gw.gateway.store.degraded, 5000, 'back on Redis');
    const check = testClient(redis.url);
    try {
      // The woken scripts changed nothing; the three admitted meanwhile were written back, once.
      expect(await check.hget(redisKey(gw, k.id), 'dc')).toBe('4');
    } finally {
      check.disconnect();
    }
    expect(await metrics(gw)).toMatch(/^gateway_quota_written_back_total 3$/m);
    expect((await gw.call('/v1/pets', k.key)).status).toBe(200);
    expect((await usage(gw, k.id)).windows.day.used).toBe(5);
  });

  it('QUOTA_STORE_FAILURE=closed: 503 quota_store_unavailable with Retry-After while Redis is frozen, never a 429', async () => {
    const redis = await spawnRedis();
    onTestFinished(() => redis.stop());
    const k = { ...makeKey('enterprise'), limits: { perMinute: 100, perDay: 100_000 } }; // no lease: a leased unit is served even then
    const gw = await build([k], { redis: redis.url, settings: { quotaStoreFailure: 'closed' } }); // the setting under test
    expect((await gw.call('/v1/pets', k.key)).status).toBe(200);
    redis.proc.kill('SIGSTOP');
    try {
      for (const key of [k.key, undefined]) {
        // With the key, and without one (the per-address quota is in the store too).
        const res = await gw.call('/v1/pets', key);
        expect(res.status).toBe(503);
        expect(await res.json()).toEqual({ code: 'quota_store_unavailable', message: expect.any(String), status: 503 });
        expect(res.headers.get('retry-after')).toBe('1');
        expect(res.headers.get('ratelimit-policy')).toMatch(/^"minute";q=\d+;w=60/);
        expect(res.headers.get('x-ratelimit-remaining')).toBeNull(); // unknown: not claimed
      }
      expect(gw.echo!.seen.length).toBe(1); // only the request before the freeze reached the backend
      expect(await metrics(gw)).toMatch(/^gateway_rejections_total\{reason="unavailable"\} 2$/m);
      await gw.waitForLog((l) => l.msg === 'request' && l.status === 503 && l.outcome === 'unavailable');
    } finally {
      redis.proc.kill('SIGCONT');
    }
    await eventually(async () => (await gw.call('/v1/pets', k.key)).status === 200, 5000, 'served again once Redis answers');
  });

  it('clears the degraded state within 2 s of Redis answering again, with no request in between', async () => {
    const redis = await spawnRedis();
    onTestFinished(() => redis.stop());
    const k = makeKey('free');
    const gw = await build([k], { redis: redis.url });
    redis.proc.kill('SIGSTOP');
    try {
      expect((await gw.call('/v1/pets', k.key)).status).toBe(200); // decided in-process: Redis does not answer
      await gw.waitForLog((l) => String(l.msg).startsWith('quota store: Redis failed'));
      expect(await metrics(gw)).toMatch(/^gateway_quota_store_degraded 1$/m);
    } finally {
      redis.proc.kill('SIGCONT');
    }
    const answered = Date.now();
    const requests = gw.echo!.seen.length;
    await eventually(async () => /^gateway_quota_store_degraded 0$/m.test(await metrics(gw)), 2500, 'degraded back to 0');
    expect(Date.now() - answered).toBeLessThan(scaled(2500)); // 2 s and a poll's turn, on a quiet machine
    expect((await usage(gw, k.id)).store).toBe('redis');
    expect(gw.echo!.seen.length).toBe(requests); // no API request helped it
    expect(gw.logs.some((l) => l.msg === 'quota store: Redis answers again')).toBe(true);
  });

  it('says in plain words when Redis is gone', async () => {
    const redis = await spawnRedis();
    const gw = await build([makeKey('free')], { redis: redis.url });
    redis.stop();
    await eventually(async () => (await admin(gw, '/readyz')).status === 503, 5000, 'not ready');
    const { message } = await (await admin(gw, '/readyz')).json();
    expect(message).toMatch(/^Not ready: redis: not connected \((connecting|reconnecting|connect|close|end)\); the gateway keeps trying$/);
  });
});
