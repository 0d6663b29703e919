import { format } from 'node:util';
import type closeWithGrace from 'close-with-grace';
import type { FastifyBaseLogger, FastifyInstance } from 'fastify';
import type { DestinationStream } from 'pino';
import { announceReady, closeServer, createLogger, exitOnSignals, listenOrExit } from '../../runtime/process.js';
import type { GatewayConfig } from '../config/config.js';
import { type GatewaySettings, redisTarget } from '../config/settings.js';
import { type AdminPortParts, bootWarnings, buildAdminPort, buildGateway, type Gateway, reloadCheck } from '../app.js';
import { type ReloadCheck, reloader, watchConfig } from './config-watch.js';
import { awaitRedis, closeRedis, connectRedis, persistenceProblem, type RedisClient, warnUntilAnswered, within } from '../redis/client.js';

// The one start sequence of a gateway process, as envoy's runner.go: connect Redis, build the
// gateway and its admin port, wait for Redis, take reloads, stop on signals, listen. A single
// process, a cluster worker, the cluster primary and the test helper all start through it;
// what differs is which ports a process serves and where its reloads come from.

export interface RunOptions {
  /** Serves the public port: a single process or a cluster worker; not the cluster primary. */
  serve: boolean;
  /** Serves the admin port, with these parts in place of this process's own (the primary's aggregated metrics). */
  admin: AdminPortParts | false;
  /**
   * Where new configs come from: the config file and SIGHUP (`onReload` is told of each
   * accepted one), the cluster primary, or nowhere (a test swaps configs itself).
   */
  reloads: 'file' | 'primary' | 'none';
  onReload?: (reason: string) => void;
  /** The primary's own close: drain its workers; resolves with whether one cut connections. */
  drain?: (log: FastifyBaseLogger) => Promise<boolean>;
  /**
   * Takes the process over: exits on signals (these left alone) and tells a supervising
   * parent when it is ready. A test's gateway leaves its process alone.
   */
  ownProcess: false | { ignoreSignals?: readonly closeWithGrace.AllEvents[]; announce: boolean };
  /** Where log lines go (tests read them); stdout when unset. */
  logStream?: DestinationStream;
}

export interface Running {
  gateway?: Gateway;
  admin?: FastifyInstance;
  redis?: RedisClient;
  log: FastifyBaseLogger;
  /** Where each port listens, e.g. http://127.0.0.1:3000. */
  address?: string;
  adminAddress?: string;
  /**
   * /readyz answers 503 from now on, reloads stop, in-flight requests finish, then the rest
   * closes; Redis by QUIT, or at once. Resolves with whether connections were cut.
   */
  close(redisClose?: 'quit' | 'now'): Promise<boolean>;
}

const PUBLIC = { port: 'GATEWAY_PORT', host: 'GATEWAY_HOST' };
const ADMIN = { port: 'ADMIN_PORT', host: 'ADMIN_HOST' };
/** Past the grace period: the time admin, Redis and the workers' own margins may take to close. */
const CLOSE_MARGIN_MS = 5000;

export async function run(settings: GatewaySettings, initial: GatewayConfig, options: RunOptions): Promise<Running> {
  // A library's console.warn (ioredis's "Redis server does not require a password") becomes a
  // log line, so a process of ours writes JSON only; held until the logger exists.
  const warned: string[] = [];
  let warn = (line: string): void => {
    warned.push(line);
  };
  if (options.ownProcess) console.warn = (...args: unknown[]) => warn(format(...args));
  const target = redisTarget(settings);
  const redis = connectRedis(target, settings.redisTimeoutMs);
  const redisConnection = target && { target, timeoutMs: settings.redisTimeoutMs };
  const gateway = options.serve
    ? await buildGateway(settings, {
        config: initial,
        redis,
        redisConnection,
        logStream: options.logStream,
        // The file a primary or this process reloads: the portal's keys are issued there.
        keyFile: options.reloads === 'none' ? undefined : settings.configFile,
      })
    : undefined;
  const log = gateway?.app.log ?? createLogger('gateway', settings.logLevel, settings.logPretty, () => {}, options.logStream);
  warn = (line) => {
    log.warn({ source: 'console' }, line);
  };
  for (const line of warned.splice(0)) warn(line);
  // The gateway holds the config in force; the primary, which serves none, holds its own.
  let primaryConfig = initial;
  const config = gateway?.config ?? (() => primaryConfig);
  const setConfig = gateway?.setConfig ?? ((next: GatewayConfig) => void (primaryConfig = next));
  let closing = false;
  const listening: { address?: string } = {};
  // Portal links point at PORTAL_URL, else at this process's public port once it listens.
  const portalUrl = () => settings.portalUrl ?? listening.address ?? `http://${settings.host}:${settings.port}`;
  const admin = options.admin
    ? await buildAdminPort(settings, {
        gateway,
        redis,
        log,
        config,
        closing: () => closing,
        portalUrl,
        own: options.admin,
        // The key API edits the config file only where this process watches it: an edit of a file nobody reloads would change nothing.
        configFile: options.reloads === 'file' ? settings.configFile : undefined,
      })
    : undefined;
  if (!redis) log.warn('REDIS_URL is not set: quotas are kept in this process only, so limits are per gateway process');
  await awaitRedis(redis, log);
  // Said again until Redis answers, by the deployment's process (a single one, or the cluster's primary).
  const stopWarning = options.admin ? warnUntilAnswered(redis, log) : () => {};
  // Once per deployment process: a single one, or the cluster's primary (its workers serve no admin).
  if (options.admin && redis?.status === 'ready') await warnIfNotKept(keptIn(settings, initial), redis, log);
  if (options.admin && redis?.status === 'ready') await warnAtBoot(bootWarnings(settings, redis, initial), log, settings.redisTimeoutMs);
  // Only where the file is watched: a worker takes the config its primary has checked.
  const check = options.reloads === 'file' ? reloadCheck(settings, redis, config) : undefined;
  const apply = options.admin && redis ? warningOnReload(settings, config, setConfig, redis, log) : setConfig;
  const stopReloads = takeReloads(settings, options, apply, log, check);

  const close = async (redisClose: 'quit' | 'now' = 'quit') => {
    closing = true;
    stopReloads();
    stopWarning();
    let cut = false;
    if (gateway) cut = await closeServer(gateway.app, settings.shutdownGraceMs);
    if (options.drain) cut = (await options.drain(log)) || cut;
    await admin?.close();
    if (redis) await closeRedis(redis, redisClose);
    return cut;
  };
  if (options.ownProcess) exitOnSignals(log, settings.shutdownGraceMs + CLOSE_MARGIN_MS, () => close(), options.ownProcess.ignoreSignals);

  const address = gateway ? await listenOrExit(gateway.app, settings.port, settings.host, PUBLIC) : undefined;
  listening.address = address;
  const adminAddress = admin ? await listenOrExit(admin, settings.adminPort, settings.adminHost, ADMIN) : undefined;
  if (options.ownProcess && options.ownProcess.announce) ready(log, settings, initial, { address, adminAddress, redis: !!redis });
  return { gateway, admin, redis, log, address, adminAddress, close };
}

/** The ready line, then the parent told: both stores named (a key issued in the registry gets 401 from a gateway whose key store is the file). */
function ready(
  log: FastifyBaseLogger,
  settings: GatewaySettings,
  initial: GatewayConfig,
  at: { address?: string; adminAddress?: string; redis: boolean },
): void {
  const { address, adminAddress: admin } = at;
  const [store, keyStore] = [at.redis ? 'redis' : 'memory', settings.keyStore];
  log.info({ address, admin, environment: initial.environment, backend: settings.backendUrl, store, keyStore }, 'gateway ready');
  announceReady();
}

/** What this config has Redis keep that a restart must not lose: credits, registry keys, usage events not yet exported. */
function keptIn(settings: GatewaySettings, config: GatewayConfig): string[] {
  return [
    ...([...config.accounts.values()].some((s) => s.billing.credits) ? ['credits'] : []),
    ...(settings.keyStore === 'redis' ? ['registry keys'] : []),
    ...(config.usageExport ? ['usage export'] : []),
  ];
}

/** `apply`, then the persistence warning if the new config adds what Redis must keep: the README adds credits to a running gateway. */
function warningOnReload(
  settings: GatewaySettings,
  config: () => GatewayConfig,
  apply: (next: GatewayConfig) => void,
  redis: RedisClient,
  log: FastifyBaseLogger,
) {
  return (next: GatewayConfig) => {
    const before = keptIn(settings, config());
    apply(next);
    const now = keptIn(settings, next);
    if (now.some((k) => !before.includes(k))) void warnIfNotKept(now, redis, log);
  };
}

/** Boot's warnings (app.ts: the registry's keys whose plan the config lacks), a line each; a Redis that fails or stalls here is said elsewhere. */
async function warnAtBoot(warnings: Promise<string[]>, log: FastifyBaseLogger, timeoutMs: number) {
  const lines = await within(warnings, timeoutMs).catch(() => undefined);
  if (Array.isArray(lines)) for (const line of lines) log.warn(line);
}

/** A warning when Redis keeps nothing on disk and holds what a restart must not lose (`kept`). */
async function warnIfNotKept(kept: string[], redis: RedisClient, log: FastifyBaseLogger) {
  if (kept.length === 0) return;
  const problem = await persistenceProblem(redis, kept).catch(
    (err: Error) => `could not check that Redis keeps ${kept.join(' and ')} on disk: ${err.message}`,
  );
  if (problem) log.warn(problem);
}

/** Starts taking new configs the way `options.reloads` says; returns the stop. */
function takeReloads(
  settings: GatewaySettings,
  options: RunOptions,
  apply: (c: GatewayConfig) => void,
  log: FastifyBaseLogger,
  check?: ReloadCheck,
): () => void {
  const reload = reloader(settings, apply, log, check);
  if (options.reloads === 'file') {
    return watchConfig(settings.configFile, (reason) => {
      void reload(reason).then((taken) => taken && options.onReload?.(reason));
    });
  }
  if (options.reloads === 'primary') {
    const onMessage = (m: { type?: string; reason?: string }) => {
      if (m?.type === RELOAD) void reload(m.reason ?? 'primary');
    };
    process.on('message', onMessage);
    return () => process.off('message', onMessage);
  }
  return () => {};
}

/** The message a cluster primary sends its workers once it has accepted a new config. */
export const RELOAD = 'gateway:reload';
