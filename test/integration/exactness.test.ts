import { afterAll, beforeAll, describe, expect, inject, it } from 'vitest';
import { echoBackend, type EchoBackend } from '../helpers/backends.js';
import { busyCores } from '../helpers/contention.js';
import { call, makeKey, tempDir, testConfig, type TestKey, uniquePrefix, writeConfig } from '../helpers/config.js';
import { type Started, startProcess } from '../helpers/processes.js';
import { spawnCluster, spawnSentinels } from '../helpers/redis.js';
import { scaled } from '../helpers/budget.js';

// Exactness at the shipped settings (no quota setting is changed here): several gateway
// processes on one Redis, a Redis Cluster and a Sentinel group, under CPU contention (one busy
// process per core), admit exactly a key's limit in every burst, leases on (a key of 1,000 a
// minute takes leases of 10), and refuse the rest with 429, never anything else.

const LIMITS = [3, 10, 1000] as const;
const BURSTS = 10;
/** Requests per burst: enough past the limit that every instance drains any lease it holds. */
const burstSize = (limit: number) => (limit >= 200 ? limit + 600 : 4 * limit);
const IN_FLIGHT = 100;

type Topology = { name: string; env: () => Record<string, string> };

/** Keys of each limit: one per burst, and spares for a burst that crossed a minute. */
function keysFor(limit: number): TestKey[] {
  return Array.from({ length: BURSTS + 3 }, () => ({ ...makeKey('enterprise'), limits: { perMinute: limit, perDay: 1_000_000 } }));
}

async function gatewayProcess(env: Record<string, string>): Promise<Started & { url: string }> {
  const g = await startProcess('dist/gateway/server.js', { GATEWAY_PORT: '0', ADMIN_PORT: '0', ...env }, (l) => l.msg === 'gateway ready');
  return { ...g, url: String(g.logs.find((l) => l.msg === 'gateway ready')!.address) };
}

/** The statuses of `n` requests with `key`, alternated over `urls`, at most IN_FLIGHT at once. */
async function burst(urls: string[], key: string, n: number): Promise<number[]> {
  const statuses: number[] = [];
  let next = 0;
  const worker = async () => {
    while (next < n) {
      const i = next++;
      const res = await call(`${urls[i % urls.length]}/v1/pets`, key);
      await res.arrayBuffer();
      statuses.push(res.status);
    }
  };
  await Promise.all(Array.from({ length: Math.min(IN_FLIGHT, n) }, worker));
  return statuses;
}

/** Ten bursts per limit, each on a fresh key and within one UTC minute (else redone on a spare key). */
async function everyBurstExact(urls: string[], keys: Map<number, TestKey[]>, diagnose: () => string): Promise<void> {
  for (const limit of LIMITS) {
    const spare = [...keys.get(limit)!];
    for (let b = 0; b < BURSTS; b++) {
      for (;;) {
        const key = spare.shift()!;
        const minute = Math.floor(Date.now() / 60_000);
        const statuses = await burst(urls, key.key, burstSize(limit));
        if (Math.floor(Date.now() / 60_000) !== minute) continue; // two windows: proves nothing
        const admitted = statuses.filter((s) => s === 200).length;
        const got = { limit, burst: b, admitted, other: statuses.filter((s) => s !== 200 && s !== 429) };
        expect(got, admitted === limit ? '' : diagnose()).toEqual({ limit, burst: b, admitted: limit, other: [] });
        break;
      }
    }
  }
}

const topologies: Array<Topology & { setup?: () => Promise<{ env: Record<string, string>; stop: () => void }> }> = [
  { name: 'one Redis', env: () => ({ REDIS_URL: inject('redisUrl') }) },
  {
    name: 'a Redis Cluster',
    env: () => ({}),
    setup: async () => {
      // Redis's default node timeout: no failover meant here, and a 1 s one under this
      // contention makes nodes flag each other and fsync their cluster file, stalling for 300 ms.
      const c = await spawnCluster(15_000);
      return { env: { REDIS_CLUSTER_NODES: c.nodes }, stop: c.stop };
    },
  },
  {
    name: 'a Sentinel group',
    env: () => ({}),
    setup: async () => {
      const s = await spawnSentinels();
      return { env: { REDIS_SENTINELS: s.sentinels, REDIS_SENTINEL_NAME: s.name }, stop: s.stop };
    },
  },
];

describe.each(topologies)('exact at the shipped settings, under CPU contention, on $name', (topology) => {
  let redisEnv: Record<string, string>;
  let stopRedis = () => {};
  let echo: EchoBackend;
  beforeAll(async () => {
    echo = await echoBackend();
    const made = topology.setup ? await topology.setup() : { env: topology.env(), stop: () => {} };
    redisEnv = made.env;
    stopRedis = made.stop;
  });
  afterAll(async () => {
    await echo?.close();
    stopRedis();
  });

  /** Gateway processes sharing one config, Redis prefix and backend; `workers` per process. */
  async function deployment(workers: number[]) {
    const keys = new Map(LIMITS.map((l) => [l, keysFor(l)]));
    const { dir, cleanup } = tempDir();
    const file = `${dir}/gateway.json`;
    writeConfig(file, testConfig([...keys.values()].flat()));
    const env = { ...redisEnv, GATEWAY_CONFIG: file, BACKEND_URL: echo.url, REDIS_KEY_PREFIX: uniquePrefix() };
    const procs: Array<Started & { url: string }> = [];
    try {
      for (const n of workers) procs.push(await gatewayProcess({ ...env, GATEWAY_WORKERS: String(n) }));
    } catch (err) {
      await Promise.all(procs.map((p) => p.stop()));
      cleanup();
      throw err;
    }
    return {
      keys,
      // What the quota stores said, for a failure's message.
      diagnose: () => JSON.stringify(procs.flatMap((p) => p.logs.filter((l) => String(l.msg).startsWith('quota store')))),
      // A process with two workers gets two turns in the rotation: one per worker.
      urls: workers.flatMap((n, i) => Array<string>(n).fill(procs[i]!.url)),
      stop: async () => {
        await Promise.all(procs.map((p) => p.stop()));
        cleanup();
      },
    };
  }

  for (const [what, workers] of [
    ['three gateway processes', [1, 1, 1]],
    ['GATEWAY_WORKERS=2 beside another process', [2, 1]],
  ] as const) {
    it(`${what}: every burst admits exactly the limit`, { timeout: scaled(180_000) }, async () => {
      const d = await deployment([...workers]);
      const busy = busyCores(170_000);
      try {
        await everyBurstExact(d.urls, d.keys, d.diagnose);
      } finally {
        busy.stop();
        await d.stop();
      }
    });
  }
});
