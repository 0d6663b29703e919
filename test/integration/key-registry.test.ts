import { execFile } from 'node:child_process';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { promisify } from 'node:util';
import { Redis } from 'ioredis';
import { describe, expect, inject, it, onTestFinished } from 'vitest';
import { generateKey, hashKey } from '../../gateway/auth/keys.js';
import { RegistryKeys } from '../../gateway/auth/registry.js';
import type { ConfigFile } from '../../gateway/config/config.js';
import { accountName } from '../../gateway/redis/keys.js';
import { adminCall, issueKey } from '../helpers/admin.js';
import { buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import { makeKey, tempDir, testConfig, uniquePrefix, writeConfig } from '../helpers/config.js';
import { monitorRedis, spawnCluster, spawnRedis } from '../helpers/redis.js';
import { startSink } from '../helpers/sink.js';
import { eventually } from '../helpers/time.js';
import { scaled } from '../helpers/budget.js';

// The key registry (KEY_STORE=redis): keys in Redis, each instance caching the keys in use and
// told of every change on a channel. A key change costs one key; a key issued on one instance
// works on every other at once; a revoked one is refused by all; keys never issued are refused
// without a call to Redis.

const TOKEN = 'key-registry-token-0123456789';
const run = promisify(execFile);

/** Instances of one deployment with the key registry on: one config, one Redis prefix. */
async function deployment(n: number, config: ConfigFile, settings: Record<string, unknown> = {}, redis?: string) {
  const redisKeyPrefix = uniquePrefix();
  return Promise.all(
    Array.from({ length: n }, () =>
      buildTestGateway({ config, redisKeyPrefix, redis, admin: { token: TOKEN }, settings: { keyStore: 'redis', ...settings } }),
    ),
  );
}

const admin = (gw: TestGateway, path: string, init: RequestInit = {}) => adminCall(gw, TOKEN, path, init);
const issue = (gw: TestGateway, body: Record<string, unknown>) => issueKey(gw, TOKEN, body);

const statusOn = async (gw: TestGateway, key: string) => {
  const res = await gw.call('/v1/pets', key);
  await res.arrayBuffer();
  return res.status;
};

describe('the key registry', () => {
  it('a key issued on one instance is enforced on the others, its quota shared; revoked, every instance refuses it', async () => {
    const [a, b, c] = await deployment(3, testConfig([]));
    const { id, key } = await issue(a!, { plan: 'tiny' }); // 3 a minute
    const startedAt = Date.now();
    await eventually(async () => (await statusOn(b!, key)) === 200, 5000, 'the new key accepted on another instance');
    console.log(`a key issued on A answered 200 on B ${Date.now() - startedAt} ms later`);
    // One quota across the instances: 3 a minute, the first already used on B.
    const got = [await statusOn(c!, key), await statusOn(a!, key), await statusOn(b!, key)];
    if (got.at(-1) === 200) return; // a new minute began in between: the count proves nothing (rare, never a failure)
    expect(got).toEqual([200, 200, 429]);
    expect((await admin(a!, `/admin/keys/${id}/revoke`, { method: 'POST', body: '{}' })).status).toBe(200);
    for (const gw of [a, b, c]) {
      await eventually(
        async () => {
          const res = await gw!.call('/v1/pets', key);
          return res.status === 401 && (await res.json()).message === 'This API key has been revoked';
        },
        5000,
        'the revoked key refused',
      );
    }
    // The usage lookup finds a registry key by its id, and its account.
    const usage = await admin(b!, `/admin/keys/${id}/usage`);
    expect(usage.status).toBe(200);
    expect(await usage.json()).toMatchObject({ id, revoked: true, plan: 'tiny' });
  });

  it('refuses keys it never issued without asking Redis, however many', async () => {
    const own = await spawnRedis(); // its own Redis: the commands counted are this test's alone
    onTestFinished(() => own.stop());
    // Room for the flood on the per-address quota, so each answer is the key's refusal (401).
    const [gw] = await deployment(1, testConfig([], { unauthenticated: { perMinute: 1000 } }), {}, own.url);
    await gw!.gateway.keys!.ready();
    const { key } = await issue(gw!, { plan: 'free' });
    await eventually(() => gw!.gateway.keys!.announced === 1, 5000, 'the new key announced');
    expect(await statusOn(gw!, key)).toBe(200);
    // What Redis is asked, command by command: a count of all lookups would also see one the
    // gateway rightly makes for the issued key (its cache entry timing out on a slow machine).
    const monitor = await monitorRedis(own.url); // resolves once MONITOR is on
    onTestFinished(() => monitor.disconnect());
    const looked: string[] = [];
    monitor.on('monitor', (_time: string, args: string[]) => {
      // Key lookups only (the heartbeat script reads the instances' hash with HGETALL too).
      if (args[0]?.toLowerCase() === 'hgetall' && /:\{keys\}:key:/.test(args[1]!)) looked.push(args[1]!);
    });
    const never = Array.from({ length: 300 }, () => generateKey('production'));
    for (const k of never) {
      const res = await gw!.call('/v1/pets', k.key); // well formed, never issued
      expect(res.status).toBe(401);
      await res.arrayBuffer();
    }
    expect(await statusOn(gw!, key)).toBe(200);
    const issued = hashKey(key);
    // A marker after the flood: every command before it has been seen once the marker has.
    const mark = `marker-${Date.now()}`;
    const seen = new Promise<void>((resolve) => monitor.on('monitor', (_t: string, args: string[]) => args[1] === mark && resolve()));
    const probe = new Redis(own.url).on('error', () => {});
    onTestFinished(() => probe.disconnect());
    await probe.hgetall(mark);
    await seen;
    expect(never.filter((k) => looked.some((name) => name.endsWith(k.hash)))).toEqual([]);
    expect(looked.filter((name) => !name.endsWith(issued))).toEqual([]);
  });

  it('serves a key it has read from its cache, without asking Redis again', async () => {
    const own = await spawnRedis();
    onTestFinished(() => own.stop());
    const [gw] = await deployment(1, testConfig([]), {}, own.url);
    await gw!.gateway.keys!.ready();
    const { key } = await issue(gw!, { plan: 'free' });
    await eventually(() => gw!.gateway.keys!.announced === 1, 5000, 'the new key announced');
    const probe = new Redis(own.url).on('error', () => {});
    onTestFinished(() => probe.disconnect());
    const lookups = async () => Number((await probe.info('commandstats')).match(/cmdstat_hgetall:calls=(\d+)/)?.[1] ?? 0);
    expect(await statusOn(gw!, key)).toBe(200); // read from Redis once
    const before = await lookups();
    // Back to back, well within the cache's minute: from the cache.
    for (let i = 0; i < 3; i++) expect(await statusOn(gw!, key)).toBe(200); // within the free plan's 5 a minute
    expect(await lookups()).toBe(before);
  });

  it('a revoke announced while the key is being read is not outlived by that read: the next request is refused', async () => {
    const [gw] = await deployment(1, testConfig([]));
    await gw!.gateway.keys!.ready();
    const { id, key } = await issue(gw!, { plan: 'free' });
    await eventually(() => gw!.gateway.keys!.announced >= 1, 5000, 'the new key announced');
    // Redis answers the key's first read at once; the answer reaches the cache only once the
    // revoke has been announced (the two come on different connections, in either order).
    const redis = gw!.redis!;
    const read = redis.hgetall.bind(redis);
    let held = 0;
    let letGo!: () => void;
    const revoked = new Promise<void>((r) => (letGo = r));
    redis.hgetall = (async (name: string) => {
      const answer = await read(name);
      if (name.includes(':key:') && held++ === 0) await revoked;
      return answer;
    }) as typeof redis.hgetall;
    onTestFinished(() => void (redis.hgetall = read as typeof redis.hgetall));
    const first = statusOn(gw!, key);
    await eventually(() => held === 1, 5000, "the key's first read answered and held");
    const before = gw!.gateway.keys!.announced;
    expect((await admin(gw!, `/admin/keys/${id}/revoke`, { method: 'POST', body: '{}' })).status).toBe(200);
    await eventually(() => gw!.gateway.keys!.announced > before, 5000, 'the revoke announced');
    letGo();
    // Read again once the revoke was heard: refused, as every request after it.
    expect(await first).toBe(401);
    expect(await statusOn(gw!, key)).toBe(401);
  });

  it('gives the answers the config file gives: the same statuses, headers and refusals for the same keys', async () => {
    const answers = async (gw: TestGateway, key: string) => {
      const out = [];
      for (let i = 0; i < 2; i++) {
        const res = await gw.call('/v1/pets', key);
        await res.arrayBuffer();
        out.push([res.status, res.headers.get('ratelimit-policy'), res.headers.get('x-ratelimit-limit')]);
      }
      const unknown = await gw.call('/v1/pets', generateKey('production').key);
      out.push([unknown.status, unknown.headers.get('www-authenticate'), await unknown.text()]);
      return out;
    };
    // The same key (one digest) in the file of one deployment and in the registry of another.
    const made = { ...makeKey('free'), id: 'same-key' };
    const [fromFile] = await deployment(1, testConfig([made]));
    const [fromRegistry] = await deployment(1, testConfig([]));
    const registry = new RegistryKeys(
      fromRegistry!.redis!,
      () => fromRegistry!.gateway.config(),
      fromRegistry!.gateway.config().redisPrefix,
    );
    // Subscribed before the key is added, then the add heard: a request sent before the change
    // reaches this instance's filter is refused as never issued (a CI run on Node 24 saw 401).
    await fromRegistry!.gateway.keys!.ready();
    expect(await registry.add({ id: made.id, hash: made.hash, plan: made.plan })).toBe(true);
    await eventually(() => fromRegistry!.gateway.keys!.announced === 1, 5000, 'the added key announced');
    expect(await answers(fromRegistry!, made.key)).toEqual(await answers(fromFile!, made.key));
  });

  it("exports a registry key's usage, though the config lists no such account", async () => {
    const sink = await startSink();
    onTestFinished(() => sink.close());
    const [gw] = await deployment(1, testConfig([], { usage: { export: { url: sink.url, maxEvents: 1000, batchSize: 50 } } }));
    const { key } = await issue(gw!, { plan: 'free', account: 'registry-only' });
    await eventually(async () => (await statusOn(gw!, key)) === 200, 5000, 'the new key accepted');
    for (let i = 0; i < 2; i++) expect(await statusOn(gw!, key)).toBe(200);
    await eventually(() => sink.requests().length === 3, 20_000, 'three events at the sink');
    expect(sink.requests().map((e) => e.subject)).toEqual(['registry-only', 'registry-only', 'registry-only']);
  });

  it('has the events of an account only the registry names delivered by the sweep when their mark was lost', async () => {
    const sink = await startSink();
    onTestFinished(() => sink.close());
    const [gw] = await deployment(1, testConfig([], { usage: { export: { url: sink.url, maxEvents: 1000, batchSize: 50 } } }));
    // Two keys the config does not know: one names its account, one does not (its account is its id).
    await issue(gw!, { plan: 'free', account: 'registry-lost' });
    const { id } = await issue(gw!, { plan: 'free' });
    // As a script call leaves them when its instance dies before the flush that marks the
    // account: in the accounts' streams (with their statuses), in no index.
    const at = Date.now();
    const multi = gw!.redis!.multi();
    for (const account of ['registry-lost', id]) {
      const name = accountName(gw!.gateway.config().redisPrefix, account);
      multi.xadd(
        `${name}:events`,
        `${at}-1`,
        'kind',
        'request',
        'rid',
        `lost-${account}`,
        'key',
        'k',
        'plan',
        'free',
        'route',
        'listPets',
        'at',
        at,
      );
      multi.hset(`${name}:statuses`, `${at}-1`, '200');
    }
    await multi.exec();
    await eventually(() => sink.requests().length >= 2, 20_000, 'the events at the sink');
    expect(
      sink
        .requests()
        .map((e) => [e.subject, e.data!.requestId])
        .sort(),
    ).toEqual(
      [
        ['registry-lost', 'lost-registry-lost'],
        [id, `lost-${id}`],
      ].sort(),
    );
  });

  it('on a Redis Cluster, a key issued on one instance works on another', { timeout: scaled(60_000) }, async () => {
    const cluster = await spawnCluster();
    onTestFinished(() => cluster.stop());
    const [a, b] = await deployment(2, testConfig([]), { redisClusterNodes: cluster.nodes });
    const { key } = await issue(a!, { plan: 'free' });
    await eventually(async () => (await statusOn(b!, key)) === 200, 10_000, 'the new key accepted on the other instance');
  });

  it('keys import and export move keys between the file and the registry (the compiled keys command)', {
    timeout: scaled(60_000),
  }, async () => {
    const dir = tempDir();
    onTestFinished(dir.cleanup);
    const file = join(dir.dir, 'gateway.yaml');
    const inFile = makeKey('free');
    writeConfig(file, testConfig([inFile]));
    const prefix = uniquePrefix();
    const env = { ...process.env, GATEWAY_CONFIG: file, KEY_STORE: 'redis', REDIS_KEY_PREFIX: prefix, REDIS_URL: inject('redisUrl') };
    const keys = (...args: string[]) => run(process.execPath, ['dist/gateway/auth/cli.js', ...args], { env });
    const imported = await keys('import');
    expect(imported.stderr).toContain('imported 1 keys');
    // The registry holds the key now, and the file no longer does (key-import.ts says why).
    expect(imported.stderr).toContain(`removed 1 from ${file}`);
    expect(JSON.parse(readFileSync(file, 'utf8')).keys).toEqual([]);
    const created = await keys('create', '--plan', 'tiny', '--id', 'only-in-registry');
    expect(created.stdout.trim()).toMatch(/^psk_live_/);
    const listed = await keys('list');
    expect(listed.stdout).toMatch(new RegExp(`^${inFile.id}\\s.*\\sregistry$`, 'm'));
    expect(listed.stdout).toMatch(/^only-in-registry\s.*\sregistry$/m);
    const rotated = await keys('rotate', '--id', 'only-in-registry', '--grace', '10m');
    expect(rotated.stdout.trim()).toMatch(/^psk_live_/);
    expect(rotated.stderr).toMatch(/new key "only-in-registry-2"/);
    const exported = await keys('export');
    expect(exported.stderr).toContain('exported 3 of 3 keys');
    const fileOnly = await run(process.execPath, ['dist/gateway/auth/cli.js', 'list'], { env: { ...env, KEY_STORE: 'file' } });
    expect(fileOnly.stdout).toMatch(/only-in-registry\s/);
  });
});

describe('a gateway whose key store is the file, beside a registry in its Redis', () => {
  it('refuses a registry key with a log line naming the store it asked and KEY_STORE=redis; unknown keys then ask Redis nothing', async () => {
    const own = await spawnRedis(); // its own Redis: the commands counted are this test's alone
    onTestFinished(() => own.stop());
    const config = testConfig([], { unauthenticated: { perMinute: 1000 } }); // room for the flood on the per-address quota
    const redisKeyPrefix = uniquePrefix();
    // The shipped KEY_STORE (file), started before the registry holds a key, as in the walkthrough.
    const fileGw = await buildTestGateway({ config, redis: own.url, redisKeyPrefix });
    const registry = await buildTestGateway({
      config,
      redis: own.url,
      redisKeyPrefix,
      admin: { token: TOKEN },
      settings: { keyStore: 'redis' },
    });
    const { key } = await issue(registry, { plan: 'free' });
    const said = (l: Record<string, unknown>) => l.keyStore === 'file' && /KEY_STORE=redis/.test(String(l.msg));
    // Asked again at most once a second after an unknown key: the first 401s may come before.
    await eventually(async () => (await statusOn(fileGw, key)) === 401 && fileGw.logs.some(said), 5000, 'the 401 explained');
    expect(fileGw.logs.find(said)!.msg).toBe(
      `an API key unknown to the config file was refused (401): KEY_STORE=file, so only the file's keys were asked, and the key registry in Redis at 127.0.0.1:${new URL(own.url).port} holds keys this gateway does not read; start it with KEY_STORE=redis to accept them`,
    );
    expect(JSON.stringify(fileGw.logs)).not.toContain(key); // never the plain key
    const probe = new Redis(own.url).on('error', () => {});
    onTestFinished(() => probe.disconnect());
    const checks = async () => Number((await probe.info('commandstats')).match(/cmdstat_zcard:calls=(\d+)/)?.[1] ?? 0);
    const before = await checks();
    for (let i = 0; i < 100; i++) expect(await statusOn(fileGw, generateKey('production').key)).toBe(401);
    expect(await checks()).toBe(before); // known to hold keys: no call per unknown key
    expect(fileGw.logs.filter(said)).toHaveLength(1); // and a line a minute at most
  });
});
