import { Writable } from 'node:stream';
import type { FastifyInstance } from 'fastify';
import { afterAll, beforeAll, inject, onTestFinished } from 'vitest';
import { compileConfig, type ConfigFile, validateConfigFile } from '../../gateway/config/config.js';
import { type GatewaySettings, loadSettings } from '../../gateway/config/settings.js';
import type { Gateway } from '../../gateway/app.js';
import type { RedisClient } from '../../gateway/redis/client.js';
import { run } from '../../gateway/process/runner.js';
import { type EchoBackend, echoBackend, petsBackend } from './backends.js';
import { call, uniquePrefix, writeConfig } from './config.js';
import { type LogLine, logLines } from './logs.js';
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
  /**
   * Write the config to this file and run on it as a deployment does: the file is reloaded when
   * it changes and the admin key API edits it (`load` and `freshCounters` then do not apply).
   */
  configFile?: string;
  /** False: return without waiting for Redis (a gateway started while Redis is down). */
  awaitRedis?: false;
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
  logs: LogLine[];
  waitForLog(match: (line: LogLine) => boolean, ms?: number): Promise<LogLine>;
  /** A call to the public port with a bearer key. */
  call(path: string, key?: string, init?: RequestInit): Promise<Response>;
  /** Loads another config file, as a reload would. */
  load(config: ConfigFile): void;
  /** The same config under a new Redis prefix: every counter starts from zero. */
  freshCounters(): void;
  close(): Promise<void>;
}

// The shipped settings, read from their own defaults: a test that changes one says why.
const SHIPPED = loadSettings({});

/**
 * The gateway in this process, started by the production runner (process/runner.ts) on real
 * ports, with real Redis and a real backend on port 0. Called inside a test it closes itself
 * when the test ends; elsewhere, call `close`.
 */
export async function buildTestGateway(opts: TestGatewayOptions): Promise<TestGateway> {
  const closers: Array<() => Promise<unknown> | unknown> = [];
  // Once: a test that closes its gateway itself (to see what a close does) is closed again when it ends.
  let closed: Promise<void> | undefined;
  const close = () =>
    (closed ??= (async () => {
      for (const c of closers.reverse()) await c();
    })());
  try {
    onTestFinished(close);
  } catch {
    // not inside a test: the caller closes it
  }
  const { backendUrl, echo } = await startBackend(opts.backend, closers);
  const { redisClusterNodes, redisSentinels } = opts.settings ?? {};
  // A Cluster or Sentinel group given in the settings replaces the run's single Redis.
  const redisUrl =
    redisClusterNodes || redisSentinels ? undefined : opts.redis === undefined ? inject('redisUrl') : opts.redis || undefined;
  let prefix = opts.redisKeyPrefix ?? uniquePrefix();
  if (opts.configFile) writeConfig(opts.configFile, opts.config);
  const settings: GatewaySettings = {
    ...SHIPPED,
    ...{ port: 0, host: '127.0.0.1', adminPort: 0, adminHost: '127.0.0.1', backendUrl, redisUrl, adminToken: opts.admin?.token },
    ...(opts.configFile && { configFile: opts.configFile, redisKeyPrefix: prefix }),
    ...opts.settings,
  };
  const { logs, add, waitForLog } = logLines(() => logs.map((l) => JSON.stringify(l)).join('\n'), 5000);
  const logStream = new Writable({
    write(chunk, _enc, done) {
      for (const line of String(chunk).split('\n')) if (line) add(JSON.parse(line));
      done();
    },
  });
  let file = opts.config;
  const compile = () => compileConfig(validateConfigFile(file, 'test config'), prefix);
  const running = await run(settings, compile(), {
    serve: true,
    admin: opts.admin ? {} : false,
    reloads: opts.configFile ? 'file' : 'none',
    ownProcess: false,
    logStream,
  });
  // The quick close: a test's Redis may be frozen or gone by now.
  closers.push(() => running.close('now'));
  const { redis, admin } = running;
  const gateway = running.gateway!;
  // The runner waits at most 1 s for Redis; a test's first request must find it ready.
  if (redis && opts.awaitRedis !== false) await eventually(() => redis.status === 'ready' && !gateway.store.degraded, 5000, 'Redis ready');

  return {
    gateway,
    app: gateway.app,
    url: running.address!,
    port: Number(new URL(running.address!).port),
    adminUrl: running.adminAddress ?? '',
    admin,
    echo,
    backendUrl,
    redis,
    logs,
    waitForLog,
    call: (path, key, init) => call(`${running.address}${path}`, key, init),
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

/** The backend a test gateway proxies to: a recording echo on port 0, the pet backend in-process, or a URL. */
async function startBackend(backend: TestGatewayOptions['backend'], closers: Array<() => unknown>) {
  if (backend === undefined || backend === 'echo') {
    const echo = await echoBackend();
    closers.push(() => echo.close());
    return { backendUrl: echo.url, echo };
  }
  if (backend === 'pets') {
    const pets = await petsBackend();
    closers.push(pets.close);
    return { backendUrl: pets.url };
  }
  return { backendUrl: backend };
}

/**
 * `n` instances of one deployment on the run's Redis: one config and one Redis prefix.
 * `share()` moves them all to fresh counters at once (a test redone after a minute boundary).
 */
export async function buildInstances(n: number, opts: TestGatewayOptions) {
  const instances = await Promise.all(Array.from({ length: n }, () => buildTestGateway(opts)));
  const share = () => {
    instances[0]!.freshCounters();
    for (const g of instances.slice(1)) g.gateway.setConfig(instances[0]!.gateway.config());
  };
  share();
  return { instances, share };
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
