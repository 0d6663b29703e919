import { createHash } from 'node:crypto';
import type { FastifyBaseLogger } from 'fastify';
import { Cluster, Redis } from 'ioredis';

// The Redis client a gateway process uses: which Redis the settings name, its fail-fast
// options, its reconnects, and the wait for it at start.

/** The client of whichever Redis the settings name: one node, a Cluster, or a Sentinel group's master. */
export type RedisClient = Redis | Cluster;

/** Which Redis: one node by URL, a Cluster by its seed nodes, or a Sentinel group's master (settings.ts reads it from the env). */
export type RedisTarget =
  | { kind: 'single'; url: string; auth?: RedisAuth; tls?: RedisTls }
  | { kind: 'cluster'; nodes: RedisNode[]; auth?: RedisAuth; tls?: RedisTls; natMap?: Record<string, RedisNode> }
  | { kind: 'sentinel'; sentinels: RedisNode[]; name: string; auth?: RedisAuth; tls?: RedisTls; sentinelAuth?: RedisAuth };

/** An ACL user and its password, or requirepass's password alone. */
export interface RedisAuth {
  username?: string;
  password?: string;
}

/** TLS on, checked against this CA (PEM) or, without one, the system's. */
export interface RedisTls {
  ca?: string;
}

export interface RedisNode {
  host: string;
  port: number;
}

/**
 * Fail fast instead of queueing: no offline queue, one retry, and a command timeout, for each
 * kind of Redis. A Cluster follows MOVED and refreshes its slot map when a master fails over;
 * a Sentinel client asks the sentinels for the master again on every reconnect, and listens
 * for their +switch-master so a failover is followed without waiting for an error.
 */
export function connectRedis(target: RedisTarget | undefined, timeoutMs: number): RedisClient | undefined {
  if (!target) return undefined;
  const tls = target.tls && (target.tls.ca ? { ca: target.tls.ca } : {});
  const node = {
    ...target.auth,
    ...(tls && { tls }),
    maxRetriesPerRequest: 1,
    // A backstop that empties the queue of a Redis that never answers. The quota store gives
    // up on its own calls at REDIS_TIMEOUT_MS, after reading the sockets; this one comes
    // later, so a stall of this process cannot turn a reply already in into a timeout.
    commandTimeout: commandTimeoutFor(timeoutMs),
    connectTimeout: 2000,
    // ioredis's ready check asks INFO, which managed Redis and restricted ACL users often
    // refuse; ioredis then prints a line of its own to the console, not a JSON log line. The
    // probe below (EVALSHA) asks what the gateway does need; a Sentinel's master is checked by ROLE.
    enableReadyCheck: false,
    // Without the ready check, ioredis says ready once its CLIENT SETINFO calls are answered:
    // after a refused AUTH that is after the connection closed, and the client then stays
    // "ready" on a dead socket, its reconnect refused as "already connected" (seen on a real
    // Redis whose password was fixed). Without them, ready comes before AUTH's answer.
    disableClientInfo: true,
  };
  // No auto-pipelining: it holds a command back until the event loop's check phase, after
  // every request of a busy poll, and a call held there for REDIS_TIMEOUT_MS would look like a
  // Redis that does not answer (measured: a false failure under CPU contention). A command
  // leaves when it is made; with leases, that is about once per hundred requests of a busy key.
  const common = { enableOfflineQueue: false, enableAutoPipelining: false };
  // A refused login is retried at the backoff's longest wait: each attempt connects, so ioredis
  // counts from one again, and without this a wrong password cost Redis ten logins a second.
  // (Called on a close, so never before `redis` below is set.)
  // A Sentinel group's "master" that turns out a replica is left at once (leaveReplicas), and the
  // connection that found it had reset ioredis's count: the waits grow with the streak instead,
  // or every instance would connect ten times a second until the sentinels fail over.
  const retry = (times: number) =>
    refusals.has(redis) ? backoff(Number.POSITIVE_INFINITY) : backoff(Math.max(times, replicaStreaks.get(redis) ?? 0));
  const redis: RedisClient =
    target.kind === 'cluster'
      ? new Cluster(target.nodes, {
          ...common,
          clusterRetryStrategy: retry,
          slotsRefreshTimeout: 2000,
          redisOptions: node,
          natMap: target.natMap,
        })
      : target.kind === 'sentinel'
        ? new Redis({
            ...common,
            ...node,
            sentinels: target.sentinels,
            name: target.name,
            sentinelUsername: target.sentinelAuth?.username,
            sentinelPassword: target.sentinelAuth?.password,
            ...(tls && { sentinelTLS: tls, enableTLSForSentinelMode: true }),
            sentinelRetryStrategy: backoff,
            retryStrategy: retry,
            failoverDetector: true,
          })
        : new Redis(target.url, { ...common, ...node, retryStrategy: retry });
  // Reported through the store's degraded line and the start's line (redisProblem), not per event.
  redis.on('error', (err: Error) => remember(redis, err));
  // A Cluster's own error only says "Failed to refresh slots cache"; its nodes' say why (NOAUTH...).
  if (redis instanceof Cluster) redis.on('node error', (err: Error) => remember(redis, err));
  redis.on('ready', () => lastErrors.delete(redis));
  if (redis instanceof Redis) reconnectWhenEnded(redis);
  if (target.kind === 'sentinel') leaveReplicas(redis as Redis);
  return redis;
}

/** When ioredis itself gives up on a command (its promise rejected): well after the quota store's own REDIS_TIMEOUT_MS. */
export const commandTimeoutFor = (timeoutMs: number) => Math.max(1000, 4 * timeoutMs);

/** The wait before the n-th reconnect attempt in a row: 100 ms more each time, at most 2 s. */
const backoff = (times: number) => Math.min(times * 100, 2000);

/**
 * The check ioredis's ready check made on a Sentinel group's master, by ROLE instead of INFO:
 * a sentinel that has not yet seen a failover may name a node that is a replica now, and the
 * client must ask again rather than stay there, its writes refused. A user denied ROLE keeps
 * the node the sentinels named.
 */
function leaveReplicas(redis: Redis): void {
  redis.on('ready', () => {
    redis.role().then(
      (role) => {
        if (Array.isArray(role) && role[0] !== 'master') {
          replicaStreaks.set(redis, (replicaStreaks.get(redis) ?? 0) + 1);
          redis.disconnect(true);
        } else replicaStreaks.delete(redis);
      },
      () => {},
    );
  });
}

/** Connections in a row whose node, named master by the sentinels, was a replica: what the reconnect's wait grows with. */
const replicaStreaks = new WeakMap<RedisClient, number>();

/** The last connection error of each client, until it is ready again. */
const lastErrors = new WeakMap<RedisClient, string>();
/**
 * The last refusal of each client, until a probe is let through (probeAccess). Not cleared by
 * 'ready': without the ready check, ioredis says ready before AUTH is answered, on every attempt.
 */
const refusals = new WeakMap<RedisClient, string>();

/** Redis's refusals of who we are: the one fix is in the settings, not in waiting. */
const REFUSED = /^(NOAUTH|WRONGPASS|NOPERM)\b/;

/** Keeps a refusal; a NOAUTH (a call on a connection whose login failed) does not hide the WRONGPASS that caused it. */
function keepRefusal(redis: RedisClient, message: string): void {
  if (!REFUSED.test(message)) return;
  if (message.startsWith('NOAUTH') && refusals.get(redis)?.startsWith('WRONGPASS')) return;
  refusals.set(redis, message);
}

/** Keeps a refusal over the vaguer errors that follow it (a Cluster's slots refresh, a closed socket). */
function remember(redis: RedisClient, err: Error): void {
  const kept = lastErrors.get(redis);
  keepRefusal(redis, err.message);
  if (kept && REFUSED.test(kept) && !REFUSED.test(err.message)) return;
  lastErrors.set(redis, err.message);
}

/**
 * A refusal by Redis of the gateway's credentials or rights, in an operator's words with what
 * to change; undefined for any other error.
 */
export function refusal(message: string): string | undefined {
  const code = REFUSED.exec(message)?.[1];
  if (code === 'NOAUTH') return `${message} Redis asks for a password: give it in the URL (redis://:password@host:port) or REDIS_PASSWORD`;
  if (code === 'WRONGPASS') return `${message} The username or password is wrong: check REDIS_USERNAME and REDIS_PASSWORD, or the URL's`;
  if (code === 'NOPERM')
    return `${message} The Redis user may not run what the gateway needs (docs/operators.md, "Managed Redis", lists the ACL)`;
  return undefined;
}

/** Whether a line (a failure as redisProblem words it) tells of such a refusal. */
export const isRefusal = (line: string) => /\b(NOAUTH|WRONGPASS|NOPERM)\b/.test(line);

/** Redis's refusal of this client's credentials or rights, in refusal's words, until a probe is let through; else undefined. */
export function connectionRefusal(redis: RedisClient): string | undefined {
  const kept = refusals.get(redis);
  return kept === undefined ? undefined : refusal(kept);
}

/** A script nobody loads: EVALSHA answers NOSCRIPT to a user who may run scripts, NOAUTH or NOPERM to one who may not. */
const PROBE_SHA = createHash('sha1').update('-- the gateway asks whether it may run scripts').digest('hex');

/**
 * Whether this client may log in and run the gateway's scripts: undefined, or the call's own
 * error. A refusal is kept (connectionRefusal) until a probe is let through.
 */
export async function probeAccess(redis: RedisClient): Promise<string | undefined> {
  try {
    await redis.evalsha(PROBE_SHA, 0);
  } catch (err) {
    const said = err instanceof Error ? err.message : String(err);
    if (!said.startsWith('NOSCRIPT')) {
      keepRefusal(redis, said);
      return said;
    }
  }
  refusals.delete(redis);
  return undefined;
}

/** The setting that named this Redis. */
function settingOf(redis: RedisClient): string {
  if (redis instanceof Cluster) return 'REDIS_CLUSTER_NODES';
  return redis.options.sentinels?.length ? 'REDIS_SENTINELS' : 'REDIS_URL';
}

/** Which Redis, for a log line: its address (never its password), or the settings that chose a Cluster or Sentinel group. */
export function redisWhere(redis: RedisClient): string {
  if (redis instanceof Cluster) return 'Redis Cluster (REDIS_CLUSTER_NODES)';
  const { sentinels, name, host, port } = redis.options;
  return sentinels?.length ? `Redis Sentinel master ${name} (REDIS_SENTINELS)` : `Redis at ${host}:${port}`;
}

/**
 * Why a call to Redis failed, in one line: where, and the connection's own error while it is
 * not connected (ioredis then answers every call with "Stream isn't writeable", which says
 * neither where nor why).
 */
export function redisProblem(redis: RedisClient, err: unknown): string {
  const connection =
    redis.status === 'ready' ? undefined : (refusals.get(redis) ?? lastErrors.get(redis) ?? `not connected (${redis.status})`);
  const message = connection ?? (err instanceof Error ? err.message : String(err));
  keepRefusal(redis, message);
  return `${redisWhere(redis)}: ${refusal(message) ?? message}`;
}

/**
 * A second connection to the same Redis, for calls that hold their connection (WAIT): the
 * requests' calls on the first must not queue behind them. It queues its calls until connected.
 */
export function secondConnection(redis: RedisClient): RedisClient {
  const twin =
    redis instanceof Cluster ? redis.duplicate(undefined, { enableOfflineQueue: true }) : redis.duplicate({ enableOfflineQueue: true });
  twin.on('error', () => {}); // the first connection reports Redis's failures
  // The twin meets the same Sentinel race as the first (see reconnectWhenEnded): top-ups would fail until a restart.
  if (twin instanceof Redis) reconnectWhenEnded(twin);
  return twin;
}

/** Clients closed by closeRedis: the only ones meant to stay closed. */
const closedByUs = new WeakSet<RedisClient>();

/** Closes a client from connectRedis for good: QUIT (the socket if that fails), or the socket at once. */
export async function closeRedis(redis: RedisClient, how: 'quit' | 'now' = 'quit'): Promise<void> {
  closedByUs.add(redis);
  if (how === 'quit') await redis.quit().catch(() => redis.disconnect());
  else redis.disconnect();
}

/**
 * ioredis ends a client for good, with no further reconnect, when its connector gives up in
 * the middle of a connect: a Sentinel's +switch-master arriving while it asks the sentinels
 * for the master does that (the failover detector closes the connector under the attempt),
 * and the gateway would then decide locally until restarted. Only closeRedis should end a
 * client, so any other end is followed by a new connect, with the usual backoff.
 */
function reconnectWhenEnded(redis: Redis): void {
  let ends = 0;
  redis.on('ready', () => (ends = 0));
  redis.on('end', () => {
    if (closedByUs.has(redis)) return;
    setTimeout(() => {
      if (!closedByUs.has(redis) && redis.status === 'end') redis.connect().catch(() => {});
    }, backoff(++ends)).unref();
  });
}

/**
 * Waits for Redis so the first requests are decided by it, but never holds up listening: it
 * stops waiting at the first failed attempt (a Redis that is down refuses at once) or after
 * 1 s (one that does not answer), says so, and the store decides locally until Redis is back.
 * Connected, it asks once whether the gateway may log in and run its scripts (probeAccess).
 */
export async function awaitRedis(redis: RedisClient | undefined, log: FastifyBaseLogger): Promise<void> {
  if (!redis) return;
  if (redis.status !== 'ready') await firstOutcome(redis, 1000);
  if (redis.status === 'ready') {
    let timer: NodeJS.Timeout | undefined;
    const late = new Promise<void>((resolve) => (timer = setTimeout(resolve, 1000)));
    await Promise.race([probeAccess(redis), late]).finally(() => clearTimeout(timer));
  }
  const refused = connectionRefusal(redis);
  // Refused credentials will not mend by waiting: said as such, and that counting is now per instance.
  if (refused)
    log.warn(
      `${redisWhere(redis)} refused the gateway: ${refused}. Until it accepts, each instance counts alone, from its share of the quota`,
    );
  else if ((redis.status as string) !== 'ready')
    log.warn(
      `${redisProblem(redis, 'not ready yet')}: is Redis running there, and is ${settingOf(redis)} right? Until it answers, each instance counts alone, from its share of the quota`,
    );
}

/** How often the start's warning is said again while Redis has never answered: a line at boot scrolls away. */
export const UNANSWERED_EVERY_MS = 5000;

/**
 * After awaitRedis: while this Redis has never answered since start (a refused connection, a
 * service that is not Redis, a refused login), says so again every `everyMs`, naming the
 * address as the settings give it; stops at the first probe let through (probeAccess). Returns the stop.
 */
export function warnUntilAnswered(redis: RedisClient | undefined, log: FastifyBaseLogger, everyMs = UNANSWERED_EVERY_MS): () => void {
  if (!redis || (redis.status === 'ready' && !refusals.has(redis))) return () => {};
  const since = Date.now();
  const timer = setInterval(() => {
    const why = refusals.get(redis) ?? lastErrors.get(redis) ?? `not connected (${redis.status})`;
    const seconds = Math.round((Date.now() - since) / 1000);
    log.warn(
      `${redisWhere(redis)} has not answered since start (${seconds} s ago): ${refusal(why) ?? why}; is Redis running there, and is ${settingOf(redis)} right? Until it answers, each instance counts alone, from its share of the quota`,
    );
  }, everyMs).unref();
  const stop = () => {
    clearInterval(timer);
    redis.off('ready', onReady);
  };
  // A connection is not yet an answer: an HTTP server accepts it too, and a login may be refused.
  const onReady = () => {
    void probeAccess(redis).then((problem) => {
      if (problem !== undefined) return;
      stop();
      log.info(`${redisWhere(redis)} answered, ${Math.round((Date.now() - since) / 1000)} s after start`);
    });
  };
  redis.on('ready', onReady);
  if (redis.status === 'ready') onReady();
  return stop;
}

/** Resolves when the client is ready, fails an attempt, or after `ms`. */
function firstOutcome(redis: RedisClient, ms: number): Promise<void> {
  return new Promise<void>((resolve) => {
    const done = () => {
      clearTimeout(timer);
      redis.off('ready', done);
      redis.off('error', done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    redis.once('ready', done);
    redis.once('error', done);
  });
}

/**
 * Whether Redis keeps what it holds on disk (AOF or RDB snapshots), on every master: `kept`
 * (credits and their ledger, registry keys) live only there. A line to warn with when some master keeps nothing
 * or cannot be asked (CONFIG refused, as on many managed Redis services); undefined when all do.
 */
export async function persistenceProblem(redis: RedisClient, kept: string[] = ['credits']): Promise<string | undefined> {
  const what = kept.join(' and ');
  const masters: Redis[] = redis instanceof Cluster ? redis.nodes('master') : [redis];
  const bare: string[] = [];
  for (const node of masters) {
    let aof: string;
    let save: string;
    try {
      aof = ((await node.config('GET', 'appendonly')) as string[])[1] ?? '';
      save = ((await node.config('GET', 'save')) as string[])[1] ?? '';
    } catch (err) {
      return `could not check that ${redisWhere(redis)} keeps ${what} on disk (CONFIG GET: ${(err as Error).message}): make sure it does (appendonly yes, or RDB snapshots and backups), or a Redis restart loses them`;
    }
    if (aof !== 'yes' && save.trim() === '') bare.push(`${node.options.host}:${node.options.port}`);
  }
  if (bare.length === 0) return undefined;
  const on = redis instanceof Cluster ? ` on ${bare.join(', ')}` : '';
  const losses = kept.map((k) => LOSSES[k] ?? k).join(' and ');
  return `${redisWhere(redis)} keeps nothing on disk (appendonly no, save ''${on}): a Redis restart loses ${losses}; set appendonly yes (redis.conf, or CONFIG SET appendonly yes)`;
}

/** What a restart of a Redis that keeps nothing on disk loses, by what the gateway keeps there. */
const LOSSES: Record<string, string> = {
  credits: 'every credit balance, top-up and ledger entry',
  'registry keys': 'every key of the key registry (its clients are then told their key is unknown)',
  'usage export': 'the usage events not yet exported to the billing sink',
};

export const LATE = Symbol('late');

/**
 * What `promise` settles to, or LATE if it is still pending `ms` after the call. The check
 * runs after the event loop has read the sockets (setImmediate follows the poll phase), so a
 * stall of this process (GC, a busy core) is never taken for Redis's silence: a reply that
 * arrived meanwhile wins.
 */
export function within<T>(promise: Promise<T>, ms: number): Promise<T | typeof LATE> {
  return new Promise((resolve, reject) => {
    let settled = false;
    const timer = setTimeout(
      () =>
        setImmediate(() => {
          if (settled) return;
          settled = true;
          resolve(LATE);
        }),
      ms,
    );
    promise.then(
      (value) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        resolve(value);
      },
      (err: unknown) => {
        if (settled) return;
        settled = true;
        clearTimeout(timer);
        reject(err);
      },
    );
  });
}
