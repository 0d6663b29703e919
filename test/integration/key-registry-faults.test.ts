import { describe, expect, it, onTestFinished } from 'vitest';
import { generateKey } from '../../gateway/auth/keys.js';
import { RegistryKeys } from '../../gateway/auth/registry.js';
import { loadSettings } from '../../gateway/config/settings.js';
import { connectRedis, closeRedis } from '../../gateway/redis/client.js';
import { scaled } from '../helpers/budget.js';
import { makeKey, testConfig, uniquePrefix } from '../helpers/config.js';
import { adminCall, issueKey } from '../helpers/admin.js';
import { buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import { spawnRedis } from '../helpers/redis.js';
import { startStack } from '../helpers/stack.js';
import { tcpProxy } from '../helpers/tcp-proxy.js';
import { eventually } from '../helpers/time.js';

// The key registry (KEY_STORE=redis) where a store of credentials must not break: a key in both
// stores, a change channel dead without a close, Redis killed, frozen, restarted empty, and a
// gateway started while it is down. Real Redis processes, real faults, a real TCP proxy.

const TOKEN = 'key-registry-faults-token-0123456789';
/** The shipped REDIS_TIMEOUT_MS: the longest a request may wait on the registry. */
const { redisTimeoutMs } = loadSettings({});

const admin = (gw: TestGateway, path: string, init: RequestInit = {}) => adminCall(gw, TOKEN, path, init);
const issue = (gw: TestGateway, body: Record<string, unknown>) => issueKey(gw, TOKEN, body);

/** One request: its status, its Error code (if any) and how long it took. */
async function answer(gw: TestGateway, key: string): Promise<{ status: number; code?: string; ms: number }> {
  const started = performance.now();
  const res = await gw.call('/v1/pets', key);
  const body = (await res.json()) as { code?: string };
  return { status: res.status, code: body.code, ms: performance.now() - started };
}

const statusOn = async (gw: TestGateway, key: string) => (await answer(gw, key)).status;

async function gatewayOn(redis: string, settings: Record<string, unknown> = {}, prefix = uniquePrefix(), keys = [makeKey('free')]) {
  return buildTestGateway({
    config: testConfig(keys, { plans: { free: { perMinute: 1000, perDay: 100_000 } }, unauthenticated: { perMinute: 10_000 } }),
    redis,
    redisKeyPrefix: prefix,
    admin: { token: TOKEN },
    settings: { keyStore: 'redis', ...settings },
  });
}

const metric = async (gw: TestGateway, name: string) =>
  Number(new RegExp(`^${name} (\\S+)$`, 'm').exec(await gw.gateway.metrics.text())?.[1]);

describe('the key registry under faults', () => {
  it('a key in both stores: a revoke in the registry wins over the file, at the gateway and in the usage lookup', async () => {
    const both = { ...makeKey('free'), id: 'in-both' };
    const gw = await gatewayOn((await spawnRedis().then((r) => (onTestFinished(() => r.stop()), r))).url, {}, uniquePrefix(), [both]);
    const registry = new RegistryKeys(gw.redis!, () => gw.gateway.config(), gw.gateway.config().redisPrefix);
    // As `keys import` leaves it: the same key (one digest) in the file and in the registry.
    expect(await registry.add({ id: both.id, hash: both.hash, plan: 'free' })).toBe(true);
    await gw.gateway.keys!.ready();
    expect(await statusOn(gw, both.key)).toBe(200);
    await registry.revoke(both.id);
    await eventually(async () => (await answer(gw, both.key)).status === 401, 5000, 'the key revoked in the registry refused');
    const res = await gw.call('/v1/pets', both.key);
    expect(await res.json()).toMatchObject({ code: 'unauthorized', message: 'This API key has been revoked' });
    const usage = await admin(gw, `/admin/keys/${both.id}/usage`);
    expect(await usage.json()).toMatchObject({ id: both.id, revoked: true });
  });

  it('an instance whose change channel dies silently enforces new, revoked and rotated keys within 5 s, and says so', {
    timeout: scaled(60_000),
  }, async () => {
    const redis = await spawnRedis();
    onTestFinished(() => redis.stop());
    const proxy = await tcpProxy(new URL(redis.url).host);
    const prefix = uniquePrefix();
    const deaf = await gatewayOn(proxy.url, {}, prefix); // its channel runs through the proxy
    const other = await gatewayOn(redis.url, {}, prefix);
    await deaf.gateway.keys!.ready();
    const revoked = await issue(other, { plan: 'free' });
    const rotated = await issue(other, { plan: 'free' });
    await eventually(async () => (await statusOn(deaf, revoked.key)) === 200, 5000, 'the first key accepted');
    expect(await statusOn(deaf, rotated.key)).toBe(200); // both cached now
    // The subscriber's connection stays open and passes nothing, as a dead peer leaves it; so does every new one.
    expect(proxy.hold((sent) => sent.includes('subscribe'))).toBe(1);
    const changedAt = performance.now();
    const fresh = await issue(other, { plan: 'free' });
    expect((await admin(other, `/admin/keys/${revoked.id}/revoke`, { method: 'POST', body: '{}' })).status).toBe(200);
    const rotation = await admin(other, `/admin/keys/${rotated.id}/rotate`, { method: 'POST', body: JSON.stringify({ grace: '1s' }) });
    expect(rotation.status).toBe(201);
    const enforced = async () =>
      (await statusOn(deaf, fresh.key)) === 200 &&
      (await statusOn(deaf, revoked.key)) === 401 &&
      (await statusOn(deaf, rotated.key)) === 401; // its grace of 1 s is over
    await eventually(enforced, 5000, 'every change enforced on the deaf instance');
    console.log(`changes enforced on an instance with a dead channel ${Math.round(performance.now() - changedAt)} ms after they were made`);
    const ready = await fetch(`${deaf.adminUrl}/readyz`);
    expect(ready.status).toBe(503);
    expect((await ready.json()).message).toMatch(/key registry: its change channel has been silent since/);
    expect(await metric(deaf, 'gateway_key_registry_channel_silent')).toBe(1);
    expect(await metric(deaf, 'gateway_key_registry_channel_silences_total')).toBe(1);
    // A channel that delivers again ends the silence.
    proxy.release();
    await eventually(async () => (await fetch(`${deaf.adminUrl}/readyz`)).status === 200, 10_000, 'ready again');
    expect(await metric(deaf, 'gateway_key_registry_channel_silent')).toBe(0);
  });

  it('an instance that issues, rotates or revokes a key itself enforces it before it answers, though its channel passes nothing', async () => {
    const redis = await spawnRedis();
    onTestFinished(() => redis.stop());
    const proxy = await tcpProxy(new URL(redis.url).host);
    const gw = await gatewayOn(proxy.url);
    await gw.gateway.keys!.ready();
    // Its channel passes nothing from here (held as a dead peer holds it): what it knows of a
    // change it knows from making it. The requests follow at once, well within the second
    // before the channel's silence is noticed (and the filter read again).
    expect(proxy.hold((sent) => sent.includes('subscribe'))).toBe(1);
    const heard = gw.gateway.keys!.announced;
    const fresh = await issue(gw, { plan: 'free' });
    expect(await statusOn(gw, fresh.key)).toBe(200);
    const rotation = await admin(gw, `/admin/keys/${fresh.id}/rotate`, { method: 'POST', body: JSON.stringify({ grace: '1h' }) });
    const rotated = (await rotation.json()) as { id: string; key: string };
    expect(await statusOn(gw, rotated.key)).toBe(200);
    expect((await admin(gw, `/admin/keys/${rotated.id}/revoke`, { method: 'POST', body: '{}' })).status).toBe(200);
    expect(await statusOn(gw, rotated.key)).toBe(401); // cached a moment ago, as the first key is
    expect(await statusOn(gw, fresh.key)).toBe(200); // within its grace
    expect(gw.gateway.keys!.announced).toBe(heard); // none of it came by the channel
  });

  it('Redis killed: a key read before keeps working past its cache minute, a key never read gets 503 at once; restarted, both work', {
    timeout: scaled(120_000),
  }, async () => {
    const redis = await spawnRedis();
    onTestFinished(() => redis.stop());
    const port = Number(new URL(redis.url).port);
    const gw = await gatewayOn(redis.url);
    await gw.gateway.keys!.ready();
    const seen = await issue(gw, { plan: 'free' });
    const unseen = await issue(gw, { plan: 'free' });
    // Both in this instance's filter before Redis goes: else `unseen` is a key never issued (401).
    await eventually(() => gw.gateway.keys!.announced >= 2, 5000, 'both keys announced');
    await eventually(async () => (await statusOn(gw, seen.key)) === 200, 5000, 'the key read once');
    redis.proc.kill('SIGKILL');
    await eventually(() => gw.gateway.store.degraded, 5000, 'Redis declared failing');
    const never = await answer(gw, unseen.key);
    expect({ status: never.status, code: never.code }).toEqual({ status: 503, code: 'quota_store_unavailable' });
    expect(never.ms).toBeLessThan(redisTimeoutMs);
    // Past the cache's minute (its backstop while Redis answers), Redis still down: the last answer stands.
    const until = Date.now() + 61_000;
    while (Date.now() < until) {
      expect(await answer(gw, seen.key)).toMatchObject({ status: 200 });
      await new Promise((r) => setTimeout(r, 5000));
    }
    expect(await answer(gw, seen.key)).toMatchObject({ status: 200 });
    // The same Redis (no persistence: this test's keys are gone with it) back on its port.
    const again = await spawnRedis({ at: port });
    onTestFinished(() => again.stop());
    await eventually(() => !gw.gateway.store.degraded, 10_000, 'Redis answers again');
    const registry = new RegistryKeys(gw.redis!, () => gw.gateway.config(), gw.gateway.config().redisPrefix);
    const made = await registry.create({ plan: 'free' });
    await eventually(async () => (await statusOn(gw, made.key)) === 200, 5000, 'a key made after the restart accepted');
  });

  it('Redis frozen: a key never read waits at most REDIS_TIMEOUT_MS, then 503 at once; a key read before keeps working', {
    timeout: scaled(30_000),
  }, async () => {
    const redis = await spawnRedis();
    onTestFinished(() => redis.stop());
    const gw = await gatewayOn(redis.url);
    await gw.gateway.keys!.ready();
    const seen = await issue(gw, { plan: 'free' });
    const unseen = await issue(gw, { plan: 'free' });
    // Both in this instance's filter before Redis goes: else `unseen` is a key never issued (401).
    await eventually(() => gw.gateway.keys!.announced >= 2, 5000, 'both keys announced');
    await eventually(async () => (await statusOn(gw, seen.key)) === 200, 5000, 'the key read once');
    redis.proc.kill('SIGSTOP');
    onTestFinished(() => void redis.proc.kill('SIGCONT'));
    const first = await answer(gw, unseen.key);
    expect({ status: first.status, code: first.code }).toEqual({ status: 503, code: 'quota_store_unavailable' });
    // The wait is the timeout plus this process's own turn of the event loop, never the 4 s it was.
    expect(first.ms).toBeLessThan(redisTimeoutMs + scaled(500));
    await eventually(() => gw.gateway.store.degraded, 5000, 'Redis declared failing');
    const then = await answer(gw, unseen.key);
    expect({ status: then.status, code: then.code }).toEqual({ status: 503, code: 'quota_store_unavailable' });
    expect(then.ms).toBeLessThan(redisTimeoutMs); // at once: not the timeout's wait
    expect(await answer(gw, seen.key)).toMatchObject({ status: 200 });
    redis.proc.kill('SIGCONT');
    await eventually(async () => (await statusOn(gw, unseen.key)) === 200, 10_000, 'the other key accepted once Redis answers');
  });

  it('a gateway started while Redis is down says so, answers 503 to registry keys, and serves them once Redis answers', {
    timeout: scaled(30_000),
  }, async () => {
    const redis = await spawnRedis();
    const port = Number(new URL(redis.url).port);
    const prefix = uniquePrefix();
    // A key issued while Redis ran, as the keys command issues it.
    const client = connectRedis({ kind: 'single', url: redis.url }, 1000)!;
    await eventually(() => client.status === 'ready', 5000, 'the keys client ready');
    const config = testConfig([makeKey('free')], { plans: { free: { perMinute: 1000, perDay: 100_000 } } });
    const made = await new RegistryKeys(client, () => config as never, `${prefix}:production`).create({ plan: 'free' });
    await closeRedis(client);
    await redis.stop();
    const gw = await buildTestGateway({
      config,
      redis: redis.url,
      redisKeyPrefix: prefix,
      admin: { token: TOKEN },
      settings: { keyStore: 'redis' },
      awaitRedis: false,
    });
    const down = await answer(gw, made.key);
    expect({ status: down.status, code: down.code }).toEqual({ status: 503, code: 'quota_store_unavailable' });
    expect(gw.logs.some((l) => /key registry: Redis has not answered since this instance started/.test(String(l.msg)))).toBe(true);
    const ready = await fetch(`${gw.adminUrl}/readyz`);
    expect((await ready.json()).message).toMatch(/key registry: not read yet/);
    // Back with no keys (it kept nothing on disk): the key is unknown then, the registry's own answer.
    const again = await spawnRedis({ at: port });
    onTestFinished(() => again.stop());
    await gw.gateway.keys!.ready();
    const registry = new RegistryKeys(gw.redis!, () => gw.gateway.config(), gw.gateway.config().redisPrefix);
    const after = await registry.create({ plan: 'free' });
    await eventually(async () => (await statusOn(gw, after.key)) === 200, 5000, 'a registry key served once Redis answers');
    expect(await answer(gw, generateKey('production').key)).toMatchObject({ status: 401 });
  });

  it('with Redis keeping nothing on disk: a warning at boot; restarted empty, an error and a warning in /readyz', {
    timeout: scaled(30_000),
  }, async () => {
    const redis = await spawnRedis(); // --save '' --appendonly no
    const port = Number(new URL(redis.url).port);
    const gw = await gatewayOn(redis.url);
    const warned = gw.logs.filter((l) => /keeps nothing on disk/.test(String(l.msg)));
    expect(warned).toHaveLength(1);
    expect(warned[0]!.msg).toMatch(/every key of the key registry.*set appendonly yes/);
    await gw.gateway.keys!.ready();
    const { key } = await issue(gw, { plan: 'free' });
    await eventually(async () => (await statusOn(gw, key)) === 200, 5000, 'the key accepted');
    await redis.stop();
    const again = await spawnRedis({ at: port });
    onTestFinished(() => again.stop());
    await gw.waitForLog((l) => l.level === 50 && /filter came back empty after holding keys/.test(String(l.msg)), scaled(10_000));
    const ready = await fetch(`${gw.adminUrl}/readyz`);
    expect(ready.status).toBe(200);
    expect((await ready.json()).warnings).toEqual([expect.stringMatching(/Redis lost the registry/)]);
  });
});

describe('the key registry under GATEWAY_WORKERS', () => {
  it("/readyz on the primary's admin port names each worker whose change channel went silent, and is ready again once it delivers", {
    timeout: scaled(90_000),
  }, async () => {
    const redis = await spawnRedis();
    onTestFinished(() => redis.stop());
    const proxy = await tcpProxy(new URL(redis.url).host);
    const stack = await startStack(testConfig([makeKey('free')]), { GATEWAY_WORKERS: '2', KEY_STORE: 'redis', REDIS_URL: proxy.url });
    onTestFinished(() => stack.stop());
    const readyz = async () => {
      const res = await fetch(`${stack.gateway.adminUrl}/readyz`);
      return { status: res.status, body: (await res.json()) as { message?: string } };
    };
    await eventually(async () => (await readyz()).status === 200, 10_000, 'ready at first');
    // Each worker's subscriber stays open and passes nothing, as a dead peer leaves it (the primary subscribes to none).
    expect(proxy.hold((sent) => sent.includes('subscribe'))).toBe(2);
    let last = { status: 0, body: {} as { message?: string } };
    await eventually(
      async () => {
        last = await readyz();
        return (last.body.message?.match(/worker \d+: key registry: its change channel has been silent since/g) ?? []).length === 2;
      },
      10_000,
      "both workers' silence on the primary's /readyz",
    );
    expect(last.status).toBe(503);
    proxy.release();
    await eventually(async () => (await readyz()).status === 200, 15_000, 'ready again once the channels deliver');
  });
});
