import { createServer, type Server } from 'node:http';
import { Redis } from 'ioredis';
import type { AddressInfo } from 'node:net';
import { join } from 'node:path';
import { describe, expect, inject, it, onTestFinished } from 'vitest';
import { call, makeKey, tempDir, testConfig, type TestKey, uniquePrefix, writeConfig } from '../helpers/config.js';
import { adminCall } from '../helpers/admin.js';
import { buildTestGateway, type TestGateway } from '../helpers/gateway.js';
import { startProcess } from '../helpers/processes.js';
import { spawnCluster, spawnRedis, spawnSentinels } from '../helpers/redis.js';
import { FULL_SIZE, scaled } from '../helpers/budget.js';
import { decidedByRedis, eventually } from '../helpers/time.js';
import type { ConfigFile } from '../../gateway/config/config.js';
import type { GatewaySettings } from '../../gateway/config/settings.js';

// Concurrency through the gateway (issue 47): three gateways on one Redis in front of a backend
// that sleeps and records its own highest concurrency. The shipped settings, but for the test
// that kills an instance, which shortens the slot's TTL (and says why).

const LIMIT = 10;

interface SleepyBackend {
  url: string;
  /** Requests it is serving now, and the most it ever served at once. */
  current: number;
  max: number;
  /** Answers the requests it holds (those that sleep until told), and every later one at once. */
  wake(): void;
  reset(): void;
}

/** A backend that answers each request after `sleepMs` (or, with Infinity, when woken), counting what it serves at once. */
async function sleepyBackend(sleepMs: number): Promise<SleepyBackend> {
  const held = new Set<() => void>();
  const state = { current: 0, max: 0, awake: false };
  const server: Server = createServer((req, res) => {
    state.current++;
    state.max = Math.max(state.max, state.current);
    let done = false;
    const finish = () => {
      if (done) return;
      done = true;
      state.current--;
      held.delete(answer);
    };
    const answer = () => {
      res.writeHead(200, { 'content-type': 'application/json' }).end('[]');
      finish();
    };
    res.once('close', finish);
    req.resume();
    if (Number.isFinite(sleepMs)) setTimeout(answer, sleepMs);
    else if (state.awake) answer();
    else held.add(answer);
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  onTestFinished(
    () =>
      new Promise<void>((r) => {
        for (const a of held) a();
        server.closeAllConnections();
        server.close(() => r());
      }),
  );
  return {
    url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    get current() {
      return state.current;
    },
    get max() {
      return state.max;
    },
    wake: () => {
      state.awake = true;
      for (const a of [...held]) a();
    },
    reset: () => {
      state.max = state.current;
    },
  };
}

function config(key: TestKey): ConfigFile {
  return testConfig([key], {
    plans: { conc: { perMinute: 100_000, perDay: 1_000_000, concurrent: LIMIT } },
    // Thousands of 429s a minute here are the point: no ban.
    bans: { afterRejected: 1_000_000, withinSeconds: 1, durationSeconds: 1 },
    // /v1/me/usage counts per address: the tests read it in loops.
    unauthenticated: { perMinute: 100_000 },
  });
}

async function gateways(key: TestKey, backendUrl: string, n = 3, settings?: Partial<GatewaySettings>): Promise<TestGateway[]> {
  const redisKeyPrefix = uniquePrefix();
  return Promise.all(
    Array.from({ length: n }, () => buildTestGateway({ config: config(key), backend: backendUrl, redisKeyPrefix, settings, admin: {} })),
  );
}

/** Calls of quota.lua a gateway made (its latency histogram's count, on the admin port). */
async function scriptCalls(gw: TestGateway): Promise<number> {
  const text = await (await fetch(`${gw.adminUrl}/metrics`)).text();
  return Number(/^gateway_redis_duration_seconds_count (\d+)$/m.exec(text)?.[1]);
}

/** Statuses and error codes of `n` requests sent at once, alternated over the gateways. */
async function wave(gws: TestGateway[], key: string, n: number): Promise<{ statuses: number[]; codes: Set<string> }> {
  const codes = new Set<string>();
  const statuses = await Promise.all(
    Array.from({ length: n }, async (_, i) => {
      const res = await gws[i % gws.length]!.call('/v1/pets', key);
      const body = (await res.json()) as { code?: string };
      if (res.status !== 200) codes.add(`${res.status} ${body.code}`);
      return res.status;
    }),
  );
  return { statuses, codes };
}

const inFlight = async (gw: TestGateway, key: string) =>
  ((await (await gw.call('/v1/me/usage', key)).json()) as { concurrency: { inFlight: number } }).concurrency.inFlight;

describe('concurrency across three gateways on one Redis', () => {
  it(
    'the backend sees exactly the limit in flight, run after run, and every refusal is a 429 concurrency_limit_exceeded',
    async () => {
      const backend = await sleepyBackend(500);
      const key = makeKey('conc');
      const gws = await gateways(key, backend.url);
      // 5 runs of 300 requests at once; the 20 of 1,000 under `npm run test:full` (minutes here).
      const [runs, size] = FULL_SIZE ? [20, 1000] : [5, 300];
      for (let run = 0; run < runs; run++) {
        // A run during which a gateway stalled past REDIS_TIMEOUT_MS (this process runs all three
        // and the clients) answers 503 from the degraded budget, as it should: discarded, run again.
        await decidedByRedis(gws, async () => {
          backend.reset();
          const { statuses, codes } = await wave(gws, key.key, size);
          await eventually(async () => (await inFlight(gws[0]!, key.key)) === 0, undefined, 'no slot left in flight');
          expect({ run, max: backend.max, codes: [...codes] }).toEqual({ run, max: LIMIT, codes: ['429 concurrency_limit_exceeded'] });
          expect(statuses.filter((s) => s === 200).length).toBeGreaterThanOrEqual(LIMIT);
        });
      }
      const res = await gws[1]!.call('/v1/pets', key.key);
      expect(res.headers.get('ratelimit-policy')).toContain(`"concurrent";q=${LIMIT};qu="concurrent-requests"`);
      expect(res.headers.get('ratelimit')).toContain(`"concurrent";r=${LIMIT - 1}`);
    },
    FULL_SIZE ? 600_000 : 120_000,
  );

  it('clients sending again as soon as answered: freed slots are handed on without a Redis call, and the backend never sees more than the limit', async () => {
    const backend = await sleepyBackend(10);
    const key = makeKey('conc');
    // The linger scaled from the shipped 20 ms: the clients and the three gateways share this
    // process's event loop, and on a loaded machine a client's next request comes later than that.
    const gws = await gateways(key, backend.url, 3, { concurrencySlotLingerMs: Math.min(1000, scaled(20)) });
    const drained = () => eventually(async () => (await inFlight(gws[0]!, key.key)) === 0, undefined, 'no slot left in flight');
    // A run during which a gateway found Redis late (a stall on a loaded machine) answered 503 as it should: discarded.
    await decidedByRedis(
      gws,
      async () => {
        const before = await Promise.all(gws.map(scriptCalls));
        // Four clients a gateway, twelve against the limit of ten, each sending its next request as
        // soon as it has its answer: a freed slot lingers (20 ms, scaled) and the next request here takes it.
        let admitted = 0;
        const codes = new Set<string>();
        await Promise.all(
          Array.from({ length: 12 }, async (_, c) => {
            for (let i = 0; i < 25; i++) {
              const res = await gws[c % 3]!.call('/v1/pets', key.key);
              const body = (await res.json()) as { code?: string };
              if (res.status === 200) admitted++;
              else codes.add(`${res.status} ${body.code}`);
            }
          }),
        );
        expect(backend.max).toBeLessThanOrEqual(LIMIT);
        expect([...codes].filter((c) => c !== '429 concurrency_limit_exceeded')).toEqual([]);
        const calls = (await Promise.all(gws.map(scriptCalls))).reduce((sum, n, i) => sum + n - before[i]!, 0);
        // Every refusal is a call (the client sends again at once); without the linger so is every
        // admission, with it most are handed a slot here.
        expect(admitted).toBeGreaterThan(150);
        expect(calls - (300 - admitted)).toBeLessThan(admitted / 3);
        await drained();
      },
      drained,
    );
  }, 120_000);

  it("on a Redis Cluster too: every key of the decision in the account's slot, exactly the limit at the backend", {
    timeout: scaled(60_000),
  }, async () => {
    const cluster = await spawnCluster();
    onTestFinished(() => cluster.stop());
    const backend = await sleepyBackend(500);
    const key = makeKey('conc');
    const gws = await gateways(key, backend.url, 3, { redisClusterNodes: cluster.nodes });
    for (let run = 0; run < 3; run++) {
      await decidedByRedis(gws, async () => {
        backend.reset();
        const { codes } = await wave(gws, key.key, 200);
        await eventually(async () => (await inFlight(gws[0]!, key.key)) === 0, undefined, 'no slot left in flight');
        expect({ run, max: backend.max, codes: [...codes] }).toEqual({ run, max: LIMIT, codes: ['429 concurrency_limit_exceeded'] });
      });
    }
  });

  it('on a Sentinel group: exactly the limit at the backend', { timeout: scaled(60_000) }, async () => {
    const group = await spawnSentinels();
    onTestFinished(() => group.stop());
    const backend = await sleepyBackend(500);
    const key = makeKey('conc');
    const gws = await gateways(key, backend.url, 3, { redisSentinels: group.sentinels, redisSentinelName: group.name });
    await decidedByRedis(gws, async () => {
      backend.reset();
      const { codes } = await wave(gws, key.key, 200);
      await eventually(async () => (await inFlight(gws[0]!, key.key)) === 0, undefined, 'no slot left in flight');
      expect({ max: backend.max, codes: [...codes] }).toEqual({ max: LIMIT, codes: ['429 concurrency_limit_exceeded'] });
    });
  });

  it('aborted requests hold their slots until the backend is done with them, then leave none in flight', async () => {
    const backend = await sleepyBackend(Number.POSITIVE_INFINITY);
    const key = makeKey('conc');
    const gws = await gateways(key, backend.url);
    const aborts = Array.from({ length: 60 }, () => new AbortController());
    let refused = 0;
    const sent = aborts.map((a, i) =>
      gws[i % 3]!.call('/v1/pets', key.key, { signal: a.signal }).then(
        (r) => (r.status === 429 ? refused++ : r.status),
        () => 'aborted',
      ),
    );
    await eventually(
      () => backend.current === LIMIT && refused === 60 - LIMIT,
      undefined,
      'the backend holding the limit, the rest refused',
    );
    for (const a of aborts) a.abort();
    await Promise.all(sent);
    // The clients are gone, the backend still works on their requests: no slot is free yet.
    const more = await wave(gws, key.key, 30);
    expect([...more.codes]).toEqual(['429 concurrency_limit_exceeded']);
    expect(backend.max).toBe(LIMIT);
    backend.wake();
    await eventually(async () => (await inFlight(gws[2]!, key.key)) === 0, undefined, 'the aborted requests’ slots released');
    expect((await wave(gws, key.key, LIMIT)).statuses).toEqual(Array(LIMIT).fill(200));
  }, 60_000);

  it('a slot is released on every way out: a refused route, a backend that cannot be reached', async () => {
    const key = makeKey('conc');
    // A backend address nothing listens on: every proxied request is a 502.
    const gws = await gateways(key, 'http://127.0.0.1:9', 1);
    const drained = () => eventually(async () => (await inFlight(gws[0]!, key.key)) === 0, undefined, 'no slot left');
    // Forty Redis calls: a run during which the gateway found Redis late (a stall on a loaded machine) is discarded.
    await decidedByRedis(
      gws,
      async () => {
        for (let i = 0; i < 2 * LIMIT; i++) expect((await gws[0]!.call('/v1/nowhere', key.key)).status).toBe(404);
        for (let i = 0; i < 2 * LIMIT; i++) expect((await gws[0]!.call('/v1/pets', key.key)).status).toBe(502);
        await drained();
      },
      drained,
    );
  }, 60_000);
});

describe('a client gone before its admission', () => {
  it('gets its slot back at once, and its request never reaches the backend', async () => {
    const redis = await spawnRedis();
    onTestFinished(() => redis.stop());
    const backend = await sleepyBackend(0);
    const key = makeKey('conc');
    const gw = await buildTestGateway({
      config: config(key),
      backend: backend.url,
      redis: redis.url,
      admin: {},
      // The admission must wait for the frozen Redis rather than give it up after the shipped 1 s.
      settings: { redisTimeoutMs: 60_000 },
    });
    const metric = async (name: string) => {
      const text = await (await fetch(`${gw.adminUrl}/metrics`)).text();
      return Number(new RegExp(`^${name} (\\d+)`, 'm').exec(text)?.[1] ?? -1);
    };
    redis.proc.kill('SIGSTOP');
    const abort = new AbortController();
    const sent = gw.call('/v1/pets', key.key, { signal: abort.signal }).catch(() => 'aborted');
    await eventually(async () => (await metric('gateway_requests_in_flight')) === 1, undefined, 'the request waiting on Redis');
    abort.abort();
    expect(await sent).toBe('aborted');
    await eventually(async () => (await metric('gateway_connections_open')) === 0, undefined, 'the gateway seeing the client gone');
    redis.proc.kill('SIGCONT');
    await eventually(async () => (await metric('gateway_requests_in_flight')) === 0, undefined, 'the request over');
    await eventually(async () => (await inFlight(gw, key.key)) === 0, undefined, 'its slot released');
    expect(backend.max).toBe(0);
  }, 60_000);
});

describe('an instance killed holding slots', () => {
  it('its slots stay while it renews them, and free within the TTL once it is SIGKILLed', async () => {
    const backend = await sleepyBackend(Number.POSITIVE_INFINITY);
    const key = makeKey('conc');
    const { dir, cleanup } = tempDir();
    onTestFinished(cleanup);
    const file = join(dir, 'gateway.json');
    writeConfig(file, config(key));
    const prefix = uniquePrefix();
    // A slot's TTL of 1.5 s (scaled to the machine's load) rather than the shipped 15 s: the test
    // waits past it twice. Renewed every third of it, so a stall of two thirds would drop the slots.
    const TTL = Math.min(15_000, scaled(1500));
    const gw = await startProcess(
      'dist/gateway/server.js',
      {
        GATEWAY_PORT: '0',
        ADMIN_PORT: '0',
        REDIS_URL: inject('redisUrl'),
        REDIS_KEY_PREFIX: prefix,
        GATEWAY_CONFIG: file,
        BACKEND_URL: backend.url,
        CONCURRENCY_SLOT_TTL_MS: String(TTL),
        // The held requests outlive the waits below (up to 3 TTLs and more): no 504 ends them first.
        UPSTREAM_TIMEOUT_MS: '120000',
      },
      (l) => l.msg === 'gateway ready',
    );
    const url = String(gw.logs.find((l) => l.msg === 'gateway ready')!.address);
    const reader = await buildTestGateway({
      config: config(key),
      backend: backend.url,
      redisKeyPrefix: prefix,
      settings: { upstreamTimeoutMs: 120_000 }, // as the instance's, above
    });
    // The instance to kill holds all but one slot; the reader holds the last one throughout, so
    // the set's own expiry keeps being pushed on: the dead slots leave by their own expiry alone.
    for (let i = 0; i < LIMIT - 1; i++) void call(`${url}/v1/pets`, key.key).catch(() => {});
    await eventually(() => backend.current === LIMIT - 1, undefined, 'the instance to kill holding its slots');
    void reader.call('/v1/pets', key.key).catch(() => {});
    await eventually(() => backend.current === LIMIT, undefined, 'the reader holding the last slot');
    // Three TTLs of long responses: renewed, the slots still count.
    await new Promise((r) => setTimeout(r, 3 * TTL));
    expect(await inFlight(reader, key.key)).toBe(LIMIT);
    expect((await reader.call('/v1/pets', key.key)).status).toBe(429);
    gw.proc.kill('SIGKILL');
    const killedAt = Date.now();
    await eventually(async () => (await inFlight(reader, key.key)) === 1, 4 * TTL, 'the dead instance’s slots expired');
    // Within the TTL of its last renewal, and the time to ask (at most another TTL, a busy machine's).
    expect(Date.now() - killedAt).toBeLessThan(2 * TTL);
    // And the next request is admitted: it reaches the backend beside the reader's.
    let status = 0;
    void reader.call('/v1/pets', key.key).then((r) => (status = r.status));
    await eventually(() => backend.current === 2 || status !== 0, undefined, 'the next request decided');
    expect([backend.current, status]).toEqual([2, 0]);
    backend.wake();
  }, 60_000);
});

describe('a Redis that lost the slots held', () => {
  it('gets them back from the instance serving them: a restart without persistence admits none past the limit', async () => {
    const redis = await spawnRedis();
    onTestFinished(() => redis.stop());
    const backend = await sleepyBackend(Number.POSITIVE_INFINITY);
    const key = makeKey('conc');
    const redisKeyPrefix = uniquePrefix();
    const [holder, other] = await Promise.all(
      [0, 1].map(() => buildTestGateway({ config: config(key), backend: backend.url, redis: redis.url, redisKeyPrefix })),
    );
    for (let i = 0; i < LIMIT; i++) void holder!.call('/v1/pets', key.key).catch(() => {});
    await eventually(() => backend.current === LIMIT, undefined, 'the holder serving the limit');
    // Killed and started again on its port, empty (no persistence): the set of slots is gone,
    // as the last writes are in a failover to a replica that had not received them.
    const port = Number(new URL(redis.url).port);
    redis.proc.kill('SIGKILL');
    const again = await spawnRedis({ at: port });
    onTestFinished(() => again.stop());
    // The holder puts its slots back once connected again (and at each renewal, a third of the
    // shipped 15 s TTL, did the reconnect go unseen): the other instance counts them.
    await eventually(async () => (await inFlight(other!, key.key)) === LIMIT, undefined, 'the slots back in the new Redis');
    const { codes } = await wave([other!, holder!], key.key, 30);
    expect({ max: backend.max, codes: [...codes] }).toEqual({ max: LIMIT, codes: ['429 concurrency_limit_exceeded'] });
    backend.wake();
    await eventually(async () => (await inFlight(other!, key.key)) === 0, undefined, 'the slots released once served');
  }, 60_000);
});

describe('burst through the gateway', () => {
  it('a 429 burst_limit_exceeded with the wait to the next token; /v1/me/usage and the admin lookup show both policies', async () => {
    const backend = await sleepyBackend(0);
    const key = makeKey('short');
    const token = 'a-test-admin-token-of-32-chars!!';
    const gw = await buildTestGateway({
      config: testConfig([key], {
        // A token every 10 s: the five requests and the reads below fall well within one token's time.
        plans: { short: { perMinute: 1000, perDay: 100_000, concurrent: 5, burst: { size: 4, perSecond: 0.1 } } },
        unauthenticated: { perMinute: 1000 },
      }),
      backend: backend.url,
      admin: { token },
    });
    const statuses = [];
    for (let i = 0; i < 5; i++) statuses.push(await gw.call('/v1/pets', key.key));
    expect(statuses.map((r) => r.status)).toEqual([200, 200, 200, 200, 429]);
    const refused = statuses[4]!;
    expect((await refused.json()).code).toBe('burst_limit_exceeded');
    // A token every 10 s: the wait is 1 to 10 whole seconds, never 0, and the header says the same.
    const wait = Number(refused.headers.get('retry-after'));
    expect(wait >= 1 && wait <= 10, `retry-after ${wait}`).toBe(true);
    expect(refused.headers.get('ratelimit-policy')).toContain('"concurrent";q=5;qu="concurrent-requests", "burst";q=4;w=40');
    const t = /"concurrent";r=5, "burst";r=0;t=(\d+)$/.exec(refused.headers.get('ratelimit') ?? '')?.[1];
    expect(Number(t) >= 1 && Number(t) <= 10, `ratelimit ${refused.headers.get('ratelimit')}`).toBe(true);
    // The last request's slot lingers (CONCURRENCY_SLOT_LINGER_MS, 20 ms), counted in Redis, until released.
    await eventually(async () => (await inFlight(gw, key.key)) === 0, undefined, 'the last slot released');
    const mine = await (await gw.call('/v1/me/usage', key.key)).json();
    const admin = await (await adminCall(gw, token, `/admin/keys/${key.id}/usage`)).json();
    for (const view of [mine, admin]) {
      expect(view.concurrency).toEqual({ limit: 5, inFlight: 0 });
      expect(view.burst).toEqual({ size: 4, perSecond: 0.1, remaining: 0 });
      // The day's window: the minute's may have turned since.
      expect(view.windows.day.used).toBe(4);
    }
  }, 60_000);
});

describe('cost (issue 47, item 6: at most 2 Redis commands a request)', () => {
  it('fifty clients on a concurrency key, a burst key and a plain key: the short keys cost a small fraction of a Redis call a request', async () => {
    // A Redis of its own: its command counts are this test's alone.
    const server = await spawnRedis();
    onTestFinished(() => server.stop());
    const r = new Redis(server.url);
    onTestFinished(async () => {
      await r.quit();
    });
    const backend = await sleepyBackend(0);
    /** Commands a gateway sends itself (the scripts, and the slots' ZREMs), from Redis's own counts. */
    const sent = async () => {
      const info = await r.info('commandstats');
      const n = (cmd: string) => Number(new RegExp(`^cmdstat_${cmd}:calls=(\\d+)`, 'm').exec(info)?.[1] ?? 0);
      return n('evalsha') + n('eval') + n('zrem');
    };
    const N = 1500;
    const perRequest: Record<string, number> = {};
    const shorts = { plain: {}, concurrent: { concurrent: 100_000 }, burst: { burst: { size: 1_000_000, perSecond: 1_000_000 } } };
    for (const [name, short] of Object.entries(shorts)) {
      const key = makeKey('p');
      const plans = { p: { perMinute: 1_000_000, perDay: 100_000_000, ...short } };
      const gw = await buildTestGateway({ config: testConfig([key], { plans }), backend: backend.url, redis: server.url });
      expect((await gw.call('/v1/pets', key.key)).status).toBe(200); // its scripts loaded, its first lease taken
      const drained = async () => {
        if (name === 'concurrent') await eventually(async () => (await inFlight(gw, key.key)) === 0, undefined, 'no slot left');
      };
      // A run during which the gateway found Redis late (a stall on a loaded machine) answered 503 as it should: discarded.
      await decidedByRedis(
        [gw],
        async () => {
          const before = await sent();
          let left = N;
          const statuses = new Set<number>();
          await Promise.all(
            Array.from({ length: 50 }, async () => {
              while (left-- > 0) {
                const res = await gw.call('/v1/pets', key.key);
                await res.arrayBuffer();
                statuses.add(res.status);
              }
            }),
          );
          await drained(); // the last slots' linger over: their release counted too
          perRequest[name] = ((await sent()) - before) / N;
          expect([...statuses]).toEqual([200]);
        },
        drained,
      );
    }
    // Before leases for them, each request of either was a script call, and a ZREM with concurrency.
    expect(perRequest.concurrent).toBeLessThan(0.25);
    expect(perRequest.burst).toBeLessThan(0.25);
    expect(perRequest.plain).toBeLessThan(0.05);
  }, 120_000);
});
