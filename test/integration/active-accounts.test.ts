import { Redis } from 'ioredis';
import { describe, expect, inject, it, onTestFinished } from 'vitest';
import type { ConfigFile } from '../../gateway/config/config.js';
import { accountName, accountOfName, loopKey } from '../../gateway/redis/keys.js';
import { addBatchEvent, batchEvents, defineScripts, usageBatchArgs } from '../../gateway/quota/redis/script.js';
import { generateKey } from '../../gateway/auth/keys.js';
import { RegistryKeys } from '../../gateway/auth/registry.js';
import { ActiveIndex, defineActiveScripts, markActive } from '../../gateway/usage/active.js';
import { usagePending } from '../../gateway/usage/cursors.js';
import { Sweep } from '../../gateway/usage/sweep.js';
import { makeKey, type TestKey, testConfig, uniquePrefix } from '../helpers/config.js';
import { buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import { freePort } from '../helpers/net.js';
import { spawnCluster, spawnRedis, testClient } from '../helpers/redis.js';
import { startSink } from '../helpers/sink.js';
import { decidedByRedis, eventually } from '../helpers/time.js';

// Issue 30: the export and alert loops read the accounts marked active, not every account
// configured; a paced sweep finds what a lost mark would have left behind; and one busy account
// does not hold the others back.

const plans: ConfigFile['plans'] = { metered: { perMinute: 100_000, perDay: 1_000_000 } };
const SECRET = `whsec_${Buffer.from('a secret of thirty-two bytes!!!!').toString('base64')}`;
const keys = (n: number, account = (i: number) => `acct-${i}`): TestKey[] =>
  Array.from({ length: n }, (_, i) => ({ ...makeKey('metered'), account: account(i) }));
const nameOf = (gw: TestGateway, account: string) => gw.gateway.config().accounts.get(account)!.name;

/** Rounds each loop has run (gateway_leader_rounds_total). */
async function rounds(gw: TestGateway): Promise<{ export: number; alerts: number }> {
  const text = await gw.gateway.metrics.registry.getSingleMetricAsString('gateway_leader_rounds_total');
  const of = (loop: string) => Number(new RegExp(`loop="${loop}"} (\\d+)`).exec(text)?.[1] ?? 0);
  return { export: of('usage-export'), alerts: of('alerts') };
}

/** Calls of every command since the last CONFIG RESETSTAT (those of the scripts included), leaving out the test's own INFO and CONFIG. */
async function commandCalls(redis: Redis): Promise<number> {
  const info = await redis.info('commandstats');
  let sum = 0;
  for (const [, cmd, calls] of info.matchAll(/^cmdstat_([^:]+):calls=(\d+)/gm)) if (!/^(info|config)/.test(cmd!)) sum += Number(calls);
  return sum;
}

describe('idle export and alert loops', () => {
  /**
   * Redis commands per round of the two loops, over `n` idle rounds each, with `accounts`
   * configured and `registered` keys in a key registry (accounts only it names), on a Redis of its own.
   */
  async function idleCost(accounts: number, n: number, registered = 0): Promise<number> {
    const server = await spawnRedis();
    onTestFinished(() => server.stop());
    const sink = await startSink();
    onTestFinished(() => sink.close());
    const receiver = `http://127.0.0.1:${await freePort()}/hooks`; // never called: nothing happens
    const config = testConfig(keys(accounts), {
      plans,
      usage: { export: { url: sink.url, maxEvents: 1000, batchSize: 500 } },
      alerts: { url: receiver, secret: SECRET, thresholds: [0.5] },
    });
    const gw = await buildTestGateway({ config, redis: server.url });
    const redis = testClient(server.url);
    onTestFinished(async () => {
      await redis.quit();
    });
    const registry = new RegistryKeys(gw.redis!, () => gw.gateway.config(), gw.gateway.config().redisPrefix);
    for (let i = 0; i < registered; i += 500) {
      const made = Array.from({ length: Math.min(500, registered - i) }, (_, k) => ({
        id: `reg-${i + k}`,
        hash: generateKey('production').hash,
        plan: 'metered',
        ...((i + k) % 2 === 0 && { account: `reg-acct-${i + k}` }),
      }));
      await Promise.all(made.map((entry) => registry.add(entry)));
    }
    // Past the first rounds (the lead taken), then counted over `n` more of each loop.
    await eventually(async () => Object.values(await rounds(gw)).every((r) => r >= 2), 20_000, 'both loops leading');
    await redis.config('RESETSTAT');
    const from = await rounds(gw);
    await eventually(
      async () => {
        const now = await rounds(gw);
        return now.export >= from.export + n && now.alerts >= from.alerts + n;
      },
      60_000,
      `${n} idle rounds of each loop`,
    );
    const calls = await commandCalls(redis);
    const to = await rounds(gw);
    await gw.close();
    return calls / (to.export - from.export + to.alerts - from.alerts);
  }

  it('issue as many Redis commands a round with 5,000 accounts configured as with 100', async () => {
    const few = await idleCost(100, 4);
    const many = await idleCost(5000, 4);
    // Reading every account, a round of the two took 2 commands an account each: 20,000 here.
    expect(many).toBeLessThan(few * 1.5 + 10);
  }, 120_000);

  it("issue as many Redis commands a round with 5,000 keys in a key registry as with 100: the sweep walks the registry's keys at its pace", async () => {
    // What it guards is the cost: walking every registry key a round costs some 13,000 commands
    // a round here. That the registry's accounts are walked at all, key-registry.test.ts checks.
    const few = await idleCost(10, 4, 100);
    const many = await idleCost(10, 4, 5000);
    expect(many).toBeLessThan(few * 1.5 + 10);
  }, 120_000);
});

describe('an account whose mark was lost', () => {
  it('has its events and alerts delivered by the sweep', async () => {
    const sink = await startSink();
    onTestFinished(() => sink.close());
    const got: string[] = [];
    const { createServer } = await import('node:http');
    const hooks = createServer((req, res) => {
      got.push(String(req.headers['webhook-id']));
      req.resume().on('end', () => res.writeHead(204).end());
    });
    await new Promise<void>((r) => hooks.listen(0, '127.0.0.1', r));
    onTestFinished(() => new Promise<void>((r) => hooks.close(() => r())));
    const url = `http://127.0.0.1:${(hooks.address() as { port: number }).port}/hooks`;
    const config = testConfig(keys(30), {
      plans,
      usage: { export: { url: sink.url, maxEvents: 1000, batchSize: 50 } },
      alerts: { url, secret: SECRET, thresholds: [0.5] },
    });
    const gw = await buildTestGateway({ config });
    const redis = gw.redis!;
    const name = nameOf(gw, 'acct-17');
    // As a script call leaves them when its instance dies before the flush that marks the
    // account: in the streams (with their statuses), in neither index.
    const at = Date.now();
    const multi = redis.multi();
    const events = [1, 2, 3].map((i) => `${at}-${i}`);
    const alerts = [1, 2, 3].map((i) => `${at}-${i}`);
    events.forEach((id, i) => {
      multi.xadd(`${name}:events`, id, 'kind', 'request', 'rid', `lost-${i}`, 'key', 'k', 'plan', 'metered', 'route', 'listPets', 'at', at);
      multi.hset(`${name}:statuses`, id, '200');
    });
    for (const id of alerts) {
      multi.xadd(
        `${name}:alerts`,
        id,
        'kind',
        'crossed',
        'window',
        'day',
        'period',
        at,
        'threshold',
        '0.5',
        'used',
        5,
        'limit',
        10,
        'at',
        at,
      );
    }
    await multi.exec();
    // And a bundle of leased admissions' events (usagebatch.lua, as the store calls it) in another account, unmarked too.
    const bundled = gw.gateway.config().accounts.get('acct-23')!;
    const batch = batchEvents();
    for (let k = 0; k < 2; k++) {
      const tag = { requestId: `bundled-${k}`, keyId: 'k', plan: 'free', route: 'listPets', method: 'GET' };
      addBatchEvent(batch, { at, tag, status: 200, windows: '1,null,1,null' }, 0, '');
    }
    defineScripts(redis);
    await (redis as unknown as Record<'usagebatch', (...a: Array<string | number>) => Promise<number>>).usagebatch(
      ...usageBatchArgs(bundled, 'lost:1', batch),
    );
    await eventually(() => sink.requests().length >= 5, 20_000, 'the events at the sink');
    await eventually(() => got.length >= 3, 20_000, 'the alerts at the receiver');
    expect(sink.requests().map((e) => e.data!.requestId)).toEqual(
      expect.arrayContaining(['lost-0', 'lost-1', 'lost-2', 'bundled-0', 'bundled-1']),
    );
    expect(
      sink
        .requests()
        .filter((e) => e.subject === 'acct-17')
        .map((e) => e.data!.requestId),
    ).toEqual(['lost-0', 'lost-1', 'lost-2']);
    expect(got).toEqual(alerts.map((id) => `acct-17/${id}`));
  }, 40_000);
});

describe('the sweep', () => {
  it("goes on from where it was when keys are issued: its place is kept below the walk's length", async () => {
    const redis = testClient(inject('redisUrl'));
    onTestFinished(async () => {
      await redis.quit();
    });
    const prefix = uniquePrefix();
    const config = {
      environment: 'production' as const,
      redisPrefix: prefix,
      accounts: new Map(),
      accountOf: (n: string) => accountOfName(prefix, n),
    };
    const registry = new RegistryKeys(redis, () => ({ plans, environment: 'production' }), prefix);
    // Keys issued in id order, each its own account with an event unsent: every account the walk visits is marked.
    const add = async (i: number) => {
      await registry.add({ id: `k${i}`, hash: generateKey('production').hash, plan: 'metered', account: `r${i}` });
      await redis.xadd(`${accountName(prefix, `r${i}`)}:events`, '*', 'kind', 'request');
    };
    for (let i = 0; i < 4; i++) await add(i);
    // A leader that has walked for a long time: a million accounts checked.
    await redis.set(loopKey(prefix, 'usage-export', 'sweep'), 1_000_000);
    defineActiveScripts(redis);
    // At 1 account a second, not the shipped 40: each step below then checks exactly one, so the order shows.
    const sweep = new Sweep(redis, 'usage-export', 1, usagePending);
    const visited: string[] = [];
    for (let step = 0; step < 4; step++) {
      // One account a step (the pace, 1 a second, and a second between steps), a key issued after each.
      visited.push(...(await sweep.step(config, step * 1000)).map((n) => accountOfName(prefix, n)!));
      await add(4 + step);
    }
    // On, one account after the other: counted on from a million modulo 4, 5, 6 and 7, the
    // walk would have gone r0, r1, r0, r4.
    expect(visited).toEqual(['r0', 'r1', 'r2', 'r3']);
  });
});

describe('the active index', () => {
  it('keeps an account marked after its score was read, whatever the leader does with what it read', async () => {
    const redis = testClient(inject('redisUrl'));
    onTestFinished(async () => {
      await redis.quit();
    });
    const gw = await buildTestGateway({ config: testConfig(keys(1), { plans }), redis: inject('redisUrl') });
    const config = gw.gateway.config();
    const index = new ActiveIndex(redis, 'usage-export');
    await markActive(redis, config, 'usage-export', ['account-a', 'account-b']);
    const first = await index.take(config, 10);
    expect(first.picked.map((m) => m.name)).toEqual(['account-a', 'account-b']);
    // An event of account-a written after the leader read its score, marked by its instance.
    await markActive(redis, config, 'usage-export', ['account-a']);
    await index.unmark(config, first.picked);
    const key = loopKey(config.redisPrefix, 'usage-export', 'active');
    expect(await redis.zrange(key, 0, -1)).toEqual(['account-a']);
    const second = await index.take(config, 10);
    await index.unmark(config, second.picked);
    expect(await redis.zcard(key)).toBe(0);
  });
});

describe('a busy account', () => {
  it('does not hold back the others: their events go in the first batch beside its backlog', async () => {
    const sink = await startSink();
    onTestFinished(() => sink.close());
    // Named so the index lists the busy account first.
    const config = testConfig(
      keys(21, (i) => (i === 0 ? 'a-busy' : `b-light-${i}`)),
      {
        plans,
        usage: { export: { url: sink.url, maxEvents: 10_000, batchSize: 50 } },
      },
    );
    const gw = await buildTestGateway({ config });
    const redis = gw.redis!;
    const at = Date.now();
    const event = (rid: string) => ['kind', 'request', 'rid', rid, 'key', 'k', 'plan', 'metered', 'route', 'listPets', 'at', at];
    // All at once, statuses included (one MULTI), so no round sees some accounts' events and not the others'.
    const multi = redis.multi();
    const add = (account: string, id: string, rid: string) => {
      const name = nameOf(gw, account);
      multi.xadd(`${name}:events`, id, ...event(rid)).hset(`${name}:statuses`, id, '200');
    };
    for (let i = 0; i < 1000; i++) add('a-busy', `${at}-${i + 1}`, `busy-${i}`);
    for (let i = 1; i <= 20; i++) add(`b-light-${i}`, `${at}-1`, `light-${i}`);
    await multi.exec();
    await eventually(() => sink.requests().length >= 50, 20_000, 'the first batch');
    const first = sink.requests().slice(0, 50);
    expect(first.filter((e) => String(e.data!.requestId).startsWith('light-'))).toHaveLength(20);
    await eventually(() => sink.requests().length >= 1020, 60_000, 'the backlog too');
  }, 90_000);
});

describe('usage export on a Redis Cluster', () => {
  it("joins each event's status, whichever nodes the accounts of one 100 ms batch live on", async () => {
    const cluster = await spawnCluster();
    onTestFinished(() => cluster.stop());
    const sink = await startSink();
    onTestFinished(() => sink.close());
    const accounts = keys(9);
    const config = testConfig(accounts, { plans, usage: { export: { url: sink.url, maxEvents: 1000, batchSize: 50 } } });
    const gw = await buildTestGateway({ config, settings: { redisClusterNodes: cluster.nodes } });
    const nodes = new Set(accounts.map((k) => cluster.masterOf(`${nameOf(gw, k.account!)}:statuses`).port));
    expect(nodes.size).toBeGreaterThan(1); // the scenario: one status batch spans nodes
    // Together, so their statuses go in the same batch. A run during which the gateway declared
    // the Cluster failing (a stall on a loaded machine) answers 503 and is made again; a 503 writes no event.
    await decidedByRedis([gw], async () => {
      const answers = await Promise.all(accounts.map((k) => gw.call('/v1/pets', k.key)));
      expect(answers.map((a) => a.status)).toEqual(accounts.map(() => 200));
    });
    // A status not joined is waited for 10 s, then sent as null: the first events are those with one.
    await eventually(() => sink.requests().length >= 9, 30_000, 'the events at the sink');
    const statuses = sink.requests().map((e) => e.data!.status);
    expect(statuses.length).toBeGreaterThanOrEqual(9);
    expect(statuses.filter((s) => s !== 200)).toEqual([]);
  }, 60_000);
});
