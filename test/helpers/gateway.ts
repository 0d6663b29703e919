import type { AddressInfo } from 'node:net';
import { Writable } from 'node:stream';
import type { FastifyInstance } from 'fastify';
import { afterAll, beforeAll, inject, onTestFinished } from 'vitest';
import { buildAdmin } from '../../gateway/admin/app.js';
import { buildGateway, type Gateway } from '../../gateway/http/app.js';
import { compileConfig, type ConfigFile, validateConfigFile } from '../../gateway/config/config.js';
import { closeRedis, connectRedis, type RedisClient } from '../../gateway/process/redis-client.js';
import { type GatewaySettings, loadSettings } from '../../gateway/config/settings.js';
import { type EchoBackend, echoBackend, petsBackend } from './backends.js';
import { call, uniquePrefix } from './config.js';
import { eventually } from './time.js';

export interface TestGatewayOptions {
  config: ConfigFile;
  /** 'echo' (default): a recording backend on port 0; 'pets': the real pet backend in-process; or a URL. */
  backend?: 'echo' | 'pets' | string;
  /** A Redis URL (default: the run's Redis), or false for the in-process store. */
  redis?: string | false;
  settings?: Partial<GatewaySettings>;
  /** The Redis key prefix, to share counters with a gateway process; unique by default. */
  redisKeyPrefix?: string;
  /** Also serve the admin app on its own port, with this token (or none). */
  admin?: { token?: string };
}

export interface TestGateway {
  gateway: Gateway;
  app: FastifyInstance;
  /** The public port, e.g. http://127.0.0.1:PORT. */
  url: string;
  port: number;
  adminUrl: string;
  admin?: FastifyInstance;
  /** The echo backend, when the gateway uses one. */
  echo?: EchoBackend;
  backendUrl: string;
  redis?: RedisClient;
  /** Every JSON log line the gateway has written. */
  logs: Array<Record<string, unknown>>;
  waitForLog(match: (line: Record<string, unknown>) => boolean, ms?: number): Promise<Record<string, unknown>>;
  /** A call to the public port with a bearer key. */
  call(path: string, key?: string, init?: RequestInit): Promise<Response>;
  /** Loads another config file, as a reload would. */
  load(config: ConfigFile): void;
  /** The same config under a new Redis prefix: every counter starts from zero. */
  freshCounters(): void;
  close(): Promise<void>;
}

const SETTINGS = {
  bodyLimit: 1024 * 1024,
  requestTimeoutMs: 30_000,
  upstreamTimeoutMs: 5000,
  trustProxy: false as const,
  logLevel: 'info' as const,
  logPretty: false,
  metricsKeyIds: false,
};
// The shipped quota settings, read from the settings' own defaults: a test that changes one says why.
const { quotaLeaseMax, quotaStoreFailure, redisTimeoutMs: shippedTimeout } = loadSettings({});

/**
 * The gateway in this process, on a real port, with real Redis and a real backend on port 0.
 * Called inside a test it closes itself when the test ends; elsewhere, call `close`.
 */
export async function buildTestGateway(opts: TestGatewayOptions): Promise<TestGateway> {
  const closers: Array<() => Promise<unknown> | unknown> = [];
  const close = async () => {
    for (const c of closers.reverse()) await c();
  };
  try {
    onTestFinished(close);
  } catch {
    // not inside a test: the caller closes it
  }
  let echo: EchoBackend | undefined;
  let backendUrl: string;
  if (opts.backend === undefined || opts.backend === 'echo') {
    echo = await echoBackend();
    closers.push(() => echo!.close());
    backendUrl = echo.url;
  } else if (opts.backend === 'pets') {
    const pets = await petsBackend();
    closers.push(pets.close);
    backendUrl = pets.url;
  } else {
    backendUrl = opts.backend;
  }
  const { redisClusterNodes, redisSentinels, redisSentinelName } = opts.settings ?? {};
  // A Cluster or Sentinel group given in the settings replaces the run's single Redis.
  const redisUrl = redisClusterNodes || redisSentinels ? undefined : opts.redis === undefined ? inject('redisUrl') : opts.redis || undefined;
  // The production client and its options (lifecycle.ts), so the tests exercise them.
  const redisTimeoutMs = opts.settings?.redisTimeoutMs ?? shippedTimeout;
  const redis = connectRedis({ redisUrl, redisClusterNodes, redisSentinels, redisSentinelName, redisTimeoutMs });
  if (redis) {
    closers.push(() => closeRedis(redis, 'now'));
    await eventually(() => redis.status === 'ready', 5000, 'Redis ready');
  }
  const logs: Array<Record<string, unknown>> = [];
  const waiters = new Set<() => void>();
  const logStream = new Writable({
    write(chunk, _enc, done) {
      for (const line of String(chunk).split('\n')) if (line) logs.push(JSON.parse(line));
      for (const w of waiters) w();
      done();
    },
  });
  let file = opts.config;
  let prefix = opts.redisKeyPrefix ?? uniquePrefix();
  const compile = () => compileConfig(validateConfigFile(file, 'test config'), prefix);
  const gateway = await buildGateway({ ...SETTINGS, quotaLeaseMax, quotaStoreFailure, backendUrl, ...opts.settings, redisTimeoutMs }, { config: compile(), redis, logStream });
  await gateway.app.listen({ port: 0, host: '127.0.0.1' });
  closers.push(() => gateway.app.close());
  const port = (gateway.app.server.address() as AddressInfo).port;
  const url = `http://127.0.0.1:${port}`;

  let admin: FastifyInstance | undefined;
  let adminUrl = '';
  if (opts.admin) {
    admin = await buildAdmin({ backendUrl, adminToken: opts.admin.token }, {
      config: gateway.config,
      store: gateway.store,
      metrics: gateway.metrics,
      redis,
      closing: () => false,
      log: gateway.app.log,
    });
    adminUrl = await admin.listen({ port: 0, host: '127.0.0.1' });
    closers.push(() => admin!.close());
  }

  const waitForLog: TestGateway['waitForLog'] = (match, ms = 5000) =>
    new Promise((resolve, reject) => {
      const check = () => {
        const found = logs.find(match);
        if (!found) return;
        clearTimeout(timer);
        waiters.delete(check);
        resolve(found);
      };
      const timer = setTimeout(() => {
        waiters.delete(check);
        reject(new Error(`log line not seen within ${ms} ms; lines:\n${logs.map((l) => JSON.stringify(l)).join('\n')}`));
      }, ms);
      waiters.add(check);
      check();
    });

  return {
    gateway,
    app: gateway.app,
    url,
    port,
    adminUrl,
    admin,
    echo,
    backendUrl,
    redis,
    logs,
    waitForLog,
    call: (path, key, init) => call(`${url}${path}`, key, init),
    load: (config) => {
      file = config;
      gateway.setConfig(compile());
    },
    freshCounters: () => {
      prefix = uniquePrefix();
      gateway.setConfig(compile());
    },
    close,
  };
}

/** A test gateway for a whole file or describe block: built before its tests, closed after them. */
export function useTestGateway(opts: TestGatewayOptions | (() => TestGatewayOptions)): TestGateway {
  const handle = {} as TestGateway;
  beforeAll(async () => {
    Object.assign(handle, await buildTestGateway(typeof opts === 'function' ? opts() : opts));
  });
  afterAll(() => handle.close?.());
  return handle;
}
