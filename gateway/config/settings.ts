import { readFileSync } from 'node:fs';
import { isIP } from 'node:net';
import { Type } from '@sinclair/typebox';
import { flag, logLevel, oneOf, readSettings } from '../../runtime/settings.js';
import type { RedisAuth, RedisTarget } from '../redis/client.js';

// The gateway's process settings: each one's variable, default and rule side by side.

/** TRUST_PROXY: false, a hop count, or proxy addresses/CIDRs; every entry checked, so a typo stops the boot. */
function parseTrustProxy(value: string): false | number | string {
  if (value === 'false') return false;
  if (/^[0-9]+$/.test(value)) return Number(value);
  const bad = value
    .split(',')
    .map((t) => t.trim())
    .filter((t) => {
      if (['loopback', 'linklocal', 'uniquelocal'].includes(t)) return false;
      const [addr = '', bits, ...rest] = t.split('/');
      const max = isIP(addr) === 4 ? 32 : 128;
      return rest.length > 0 || isIP(addr) === 0 || (bits !== undefined && !(/^[0-9]+$/.test(bits) && Number(bits) <= max));
    });
  if (bad.length > 0) throw new Error(`not an address, CIDR or hop count: ${bad.join(', ')}`);
  return value;
}

/** OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: the collector's whole traces URL (the spec's signal variable: no path is added). */
function parseTracesUrl(value: string): string {
  let url: URL;
  try {
    url = new URL(value);
  } catch {
    throw new Error(`not a URL: ${value} (e.g. http://collector:4318/v1/traces)`);
  }
  if (url.protocol !== 'http:' && url.protocol !== 'https:') throw new Error(`not an http(s) URL: ${value}`);
  return value;
}

/** A Redis URL as an error may show it: never its password. */
const withoutPassword = (value: string) => value.replace(/\/\/[^@/,]*@/g, '//***@');

/** A REDIS_CLUSTER_NODES or REDIS_SENTINELS entry: host:port, or a redis:// or rediss:// URL (its credentials and TLS). */
interface NodeEntry {
  host: string;
  port: number;
  username?: string;
  password?: string;
  tls: boolean;
  /** Written as a URL (its scheme and credentials said), not host:port. */
  url: boolean;
}

function parseNodeEntry(entry: string): NodeEntry {
  if (/^rediss?:\/\//.test(entry)) {
    const url = new URL(parseRedisUrl(entry));
    const port = Number(url.port || 6379);
    return {
      host: url.hostname.replace(/^\[(.*)\]$/, '$1'),
      port,
      username: url.username ? decodeURIComponent(url.username) : undefined,
      password: url.password ? decodeURIComponent(url.password) : undefined,
      tls: url.protocol === 'rediss:',
      url: true,
    };
  }
  const at = entry.lastIndexOf(':');
  const port = Number(entry.slice(at + 1));
  if (at <= 0 || !/^[0-9]{1,5}$/.test(entry.slice(at + 1)) || !/^[A-Za-z0-9._-]+$/.test(entry.slice(0, at)))
    throw new Error(`not host:port or a redis:// URL: ${withoutPassword(entry)}`);
  if (port < 1 || port > 65535) throw new Error(`port out of range (1 to 65535): ${entry}`);
  return { host: entry.slice(0, at), port, tls: false, url: false };
}

/**
 * REDIS_CLUSTER_NODES, REDIS_SENTINELS: entries separated by commas, each host:port or a
 * redis:// (rediss://) URL. The first entry's credentials and TLS apply to every node of the
 * list (a managed Cluster's nodes share them), so a URL further on may not say otherwise.
 */
function parseNodeList(value: string): string {
  const entries = value.split(',').map((e) => parseNodeEntry(e.trim()));
  const [first] = entries;
  // host:port entries take the first's; a URL further on must not say otherwise.
  const differ = entries.find((e) => e.url && (e.tls !== first!.tls || e.password !== first!.password || e.username !== first!.username));
  if (differ)
    throw new Error(
      `${withoutPassword(value)}: the first entry's credentials and scheme apply to every node; write them once, on the first`,
    );
  return value;
}
const NODES_HINT = 'e.g. 10.0.0.1:7000,10.0.0.2:7000, or rediss://user:password@10.0.0.1:7000,10.0.0.2:7000';

/** REDIS_CLUSTER_NAT_MAP: `announced-host:port=reachable-host:port,...` (a managed Cluster behind NAT). */
function parseNatMap(value: string): string {
  for (const pair of value.split(',')) {
    const [from, to, ...rest] = pair.split('=');
    if (rest.length > 0 || !from || !to) throw new Error(`not announced-host:port=reachable-host:port: ${pair}`);
    parseNodeEntry(from.trim());
    parseNodeEntry(to.trim());
  }
  return value;
}

/** REDIS_TLS_CA_FILE: read once, here, so a missing or unreadable file stops the boot with its path. */
function readCaFile(path: string): string {
  let pem: string;
  try {
    pem = readFileSync(path, 'utf8');
  } catch (err) {
    throw new Error(`cannot read ${path}: ${(err as NodeJS.ErrnoException).code ?? (err as Error).message}`, { cause: err });
  }
  if (!pem.includes('-----BEGIN CERTIFICATE-----')) throw new Error(`${path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)`);
  return pem;
}

const Port = (env: string, fallback: number) =>
  Type.Integer({ env, minimum: 0, maximum: 65535, default: fallback, hint: 'a port number, 0 to 65535 (0: any free port)' });
const Ms = (env: string, fallback: number) =>
  Type.Integer({ env, minimum: 1, default: fallback, hint: 'a whole number of milliseconds, 1 or more' });

/** REDIS_URL: redis:// or rediss://, with a host and a port a URL can have. */
function parseRedisUrl(value: string): string {
  let url: URL;
  try {
    url = new URL(value);
  } catch {
    const port = /:([0-9]+)(?:[/?#]|$)/.exec(value.replace(/^[a-z]+:\/\//, ''))?.[1];
    if (port && Number(port) > 65535) throw new Error(`port ${port} is out of range: 1 to 65535`);
    throw new Error(`not a URL: ${withoutPassword(value)} (e.g. redis://127.0.0.1:6379)`);
  }
  if (url.port === '0') throw new Error('port 0 is out of range: 1 to 65535');
  if (url.protocol !== 'redis:' && url.protocol !== 'rediss:') throw new Error(`not a redis:// or rediss:// URL: ${url.protocol}//...`);
  if (!url.hostname) throw new Error('no host (e.g. redis://127.0.0.1:6379)');
  return value;
}

export const GatewaySettingsSchema = Type.Object({
  port: Port('GATEWAY_PORT', 3000),
  host: Type.String({ env: 'GATEWAY_HOST', minLength: 1, default: '127.0.0.1' }),
  backendUrl: Type.String({ env: 'BACKEND_URL', pattern: '^https?://', default: 'http://127.0.0.1:3001' }),
  redisUrl: Type.Optional(
    Type.Transform(Type.String({ env: 'REDIS_URL', minLength: 1 }))
      .Decode(parseRedisUrl)
      .Encode(String),
  ),
  // A Redis Cluster from its seed nodes, or a Sentinel group: instead of REDIS_URL.
  // Entries are host:port or URLs; a URL's credentials and TLS are the first entry's, for all.
  redisClusterNodes: Type.Optional(
    Type.Transform(Type.String({ env: 'REDIS_CLUSTER_NODES', minLength: 1, hint: NODES_HINT }))
      .Decode(parseNodeList)
      .Encode(String),
  ),
  // The sentinels themselves: a URL's credentials here are the sentinels' own (sentinel.conf's requirepass).
  redisSentinels: Type.Optional(
    Type.Transform(Type.String({ env: 'REDIS_SENTINELS', minLength: 1, hint: NODES_HINT }))
      .Decode(parseNodeList)
      .Encode(String),
  ),
  redisSentinelName: Type.Optional(Type.String({ env: 'REDIS_SENTINEL_NAME', pattern: '^[A-Za-z0-9_.-]{1,64}$' })),
  // The data nodes' credentials (an ACL user, or requirepass), where no REDIS_URL or
  // REDIS_CLUSTER_NODES URL carries them: a Sentinel group's master and replicas, or any topology.
  redisUsername: Type.Optional(Type.String({ env: 'REDIS_USERNAME', minLength: 1 })),
  redisPassword: Type.Optional(Type.String({ env: 'REDIS_PASSWORD', minLength: 1, secret: true })),
  // A private CA for rediss:// (PEM), in place of NODE_EXTRA_CA_CERTS; the system's CAs without it.
  redisTlsCa: Type.Optional(
    Type.Transform(Type.String({ env: 'REDIS_TLS_CA_FILE', minLength: 1 }))
      .Decode(readCaFile)
      .Encode(String),
  ),
  redisClusterNatMap: Type.Optional(
    Type.Transform(
      Type.String({ env: 'REDIS_CLUSTER_NAT_MAP', minLength: 1, hint: 'announced-host:port=reachable-host:port pairs, by commas' }),
    )
      .Decode(parseNatMap)
      .Encode(String),
  ),
  configFile: Type.String({ env: 'GATEWAY_CONFIG', minLength: 1, default: 'config/gateway.yaml' }),
  // Where keys live: the config file (the default, and the GitOps path), or also a key registry
  // in Redis for deployments past a file (docs/keys.md): a key change then costs one key.
  keyStore: oneOf('KEY_STORE', ['file', 'redis'], 'file'),
  bodyLimit: Type.Integer({ env: 'GATEWAY_BODY_LIMIT', minimum: 1, default: 1024 * 1024 }),
  // A client's whole request (headers and body) must arrive within this; then 408 (slow clients).
  requestTimeoutMs: Ms('GATEWAY_REQUEST_TIMEOUT_MS', 30_000),
  upstreamTimeoutMs: Ms('UPSTREAM_TIMEOUT_MS', 10_000),
  // Hostile clients (docs/operators.md#hostile-clients). Past either cap: 503 gateway_busy. Keep
  // the connections below the open-file limit (ulimit -n), less the backend's and Redis's.
  maxConnections: Type.Integer({ env: 'GATEWAY_MAX_CONNECTIONS', minimum: 1, default: 16_384 }),
  maxInFlight: Type.Integer({ env: 'GATEWAY_MAX_IN_FLIGHT', minimum: 1, default: 1024 }),
  // Requests in progress per connection: 1, as nginx; the rest of a pipeline waits its turn unread.
  pipelined: Type.Integer({ env: 'GATEWAY_MAX_PIPELINED', minimum: 1, maximum: 64, default: 1 }),
  // A response its client has not taken this long after it was written: the connection is cut.
  unreadTimeoutMs: Ms('GATEWAY_UNREAD_TIMEOUT_MS', 10_000),
  // A Redis call unanswered this long declares Redis failing; until then requests wait for it.
  // 1 s: a Redis Cluster node under CPU contention was seen to stall for 300-400 ms, and a
  // stall taken for a failure lets each instance admit from its budget (exactness test).
  redisTimeoutMs: Ms('REDIS_TIMEOUT_MS', 1000),
  // While Redis fails: decide from each instance's degraded budget (open) or answer 503 (closed).
  quotaStoreFailure: oneOf('QUOTA_STORE_FAILURE', ['open', 'closed'], 'open'),
  quotaLeaseMax: Type.Integer({ env: 'QUOTA_LEASE_MAX', minimum: 1, maximum: 1000, default: 100 }),
  // A concurrency slot lives this long without a renewal (renewed every third of it while its
  // request runs): an instance that dies frees its slots within it (docs/reference.md).
  concurrencySlotTtlMs: Type.Integer({ env: 'CONCURRENCY_SLOT_TTL_MS', minimum: 300, maximum: 15_000, default: 15_000 }),
  // A freed slot lingers this long for the account's next request on the same instance (no
  // Redis call), still counted in Redis; other instances see it taken that much longer.
  concurrencySlotLingerMs: Type.Integer({ env: 'CONCURRENCY_SLOT_LINGER_MS', minimum: 0, maximum: 1000, default: 20 }),
  // Burst tokens an instance takes beyond a request's in one call (at most a tenth of the size),
  // spent here within BURST_TOKEN_LEASE_MS: the bound's additive excess (docs/reference.md).
  burstTokenLease: Type.Integer({ env: 'BURST_TOKEN_LEASE', minimum: 0, maximum: 100, default: 10 }),
  burstTokenLeaseMs: Type.Integer({ env: 'BURST_TOKEN_LEASE_MS', minimum: 10, maximum: 1000, default: 100 }),
  // Leased admissions' usage events are written in batches, this often (or every 1,000): an
  // instance that dies loses at most this much of its events, counted as unsettled (docs/reference.md).
  usageBatchMs: Type.Integer({ env: 'USAGE_BATCH_MS', minimum: 10, maximum: 10_000, default: 1000 }),
  // A top-up answers 201 once this many replicas hold it (WAIT), else 503 (a retry with the same
  // Idempotency-Key adds nothing and waits again). Unset: 1 on a Cluster or a Sentinel group,
  // whose replication is asynchronous (a failover could lose an unreplicated top-up); 0 on REDIS_URL.
  creditsAckReplicas: Type.Optional(Type.Integer({ env: 'CREDITS_ACK_REPLICAS', minimum: 0, maximum: 16 })),
  creditsAckTimeoutMs: Ms('CREDITS_ACK_TIMEOUT_MS', 2000),
  // The usage exporter sends a round's events to the sink once this many replicas hold them
  // (WAIT), so a failover never leaves the biller an event Redis lost; an event that waited
  // EXPORT_ACK_HOLD_MS (60 s) goes without (usage/replicated.ts). Unset: as
  // CREDITS_ACK_REPLICAS's default, 1 on a Cluster or a Sentinel group, 0 on REDIS_URL.
  usageExportAckReplicas: Type.Optional(Type.Integer({ env: 'USAGE_EXPORT_ACK_REPLICAS', minimum: 0, maximum: 16 })),
  // How long a top-up's Idempotency-Key is remembered (Stripe keeps 24 h): a retry after it adds again.
  idempotencyKeyHours: Type.Integer({ env: 'IDEMPOTENCY_KEY_HOURS', minimum: 1, maximum: 8760, default: 24 }),
  redisKeyPrefix: Type.String({ env: 'REDIS_KEY_PREFIX', pattern: '^[A-Za-z0-9_.-]{1,32}$', default: 'gw' }),
  // Never a plain "true": that would trust any X-Forwarded-For a client writes.
  trustProxy: Type.Transform(Type.String({ env: 'TRUST_PROXY', minLength: 1, default: 'false' }))
    .Decode(parseTrustProxy)
    .Encode(String),
  // The portal (docs/operators.md#usage-portal): the public URL its links are minted for (the
  // gateway's own address when unset), and how long a key rotated there keeps working.
  portalUrl: Type.Optional(Type.String({ env: 'PORTAL_URL', pattern: '^https?://[^/?#]+$', hint: 'scheme://host[:port], no path' })),
  portalRotateGraceMs: Ms('PORTAL_ROTATE_GRACE_MS', 86_400_000),
  adminPort: Port('ADMIN_PORT', 9000),
  adminHost: Type.String({ env: 'ADMIN_HOST', minLength: 1, default: '127.0.0.1' }),
  adminToken: Type.Optional(
    Type.String({
      env: 'ADMIN_TOKEN',
      minLength: 16,
      secret: true,
      hint: 'at least 16 characters: a long random string (openssl rand -hex 24)',
    }),
  ),
  metricsKeyIds: flag('METRICS_KEY_IDS', 'true', 'false', false),
  shutdownGraceMs: Type.Integer({ env: 'SHUTDOWN_GRACE_MS', minimum: 0, default: 10_000 }),
  workers: Type.Integer({ env: 'GATEWAY_WORKERS', minimum: 1, maximum: 64, default: 1 }),
  // Tracing (OpenTelemetry, OTLP/HTTP): off unless a collector URL is given. The standard
  // variables' names; the sampler is parentbased_traceidratio (a client's sampled flag decides
  // for a trace it continues, OTEL_TRACES_SAMPLER_ARG for a new one).
  tracingUrl: Type.Optional(
    Type.Transform(Type.String({ env: 'OTEL_EXPORTER_OTLP_TRACES_ENDPOINT', minLength: 1 }))
      .Decode(parseTracesUrl)
      .Encode(String),
  ),
  tracingServiceName: Type.String({ env: 'OTEL_SERVICE_NAME', minLength: 1, default: 'pet-store-gateway' }),
  tracingSampleRatio: Type.Number({ env: 'OTEL_TRACES_SAMPLER_ARG', minimum: 0, maximum: 1, default: 1 }),
  tracingDelayMs: Ms('OTEL_BSP_SCHEDULE_DELAY', 5000),
  logPretty: flag('LOG_PRETTY', '1', '0', false),
  logLevel: logLevel(),
});
export type GatewaySettings = ReturnType<typeof loadSettings>;

export function loadSettings(env: NodeJS.ProcessEnv = process.env) {
  const settings = readSettings(GatewaySettingsSchema, env, 'gateway');
  const chosen = [
    settings.redisUrl && 'REDIS_URL',
    settings.redisClusterNodes && 'REDIS_CLUSTER_NODES',
    settings.redisSentinels && 'REDIS_SENTINELS',
  ].filter(Boolean);
  const problems = [];
  if (chosen.length > 1) problems.push(`  ${chosen.join(', ')}: set one of them, not ${chosen.length}`);
  if (settings.redisSentinels && !settings.redisSentinelName)
    problems.push('  REDIS_SENTINEL_NAME: required with REDIS_SENTINELS (the master group name)');
  if (settings.redisSentinelName && !settings.redisSentinels)
    problems.push('  REDIS_SENTINEL_NAME: only means something with REDIS_SENTINELS');
  if (settings.keyStore === 'redis' && chosen.length === 0)
    problems.push('  KEY_STORE=redis: the key registry lives in Redis: set REDIS_URL (or REDIS_CLUSTER_NODES, or REDIS_SENTINELS)');
  if (problems.length > 0) throw new Error(['Invalid gateway settings:', ...problems].join('\n'));
  return settings;
}

type RedisSettings = Pick<
  GatewaySettings,
  | 'redisUrl'
  | 'redisClusterNodes'
  | 'redisSentinels'
  | 'redisSentinelName'
  | 'redisUsername'
  | 'redisPassword'
  | 'redisTlsCa'
  | 'redisClusterNatMap'
>;

/**
 * Which Redis the settings name, if any: a single node, a Cluster or a Sentinel group, with
 * the credentials and TLS of each connection. A URL's own credentials come first; then
 * REDIS_USERNAME and REDIS_PASSWORD. TLS is a rediss:// scheme, checked against
 * REDIS_TLS_CA_FILE when it is set.
 */
export function redisTarget(s: Partial<RedisSettings>): RedisTarget | undefined {
  const tls = (on: boolean) => (on ? { ca: s.redisTlsCa } : undefined);
  const auth = (e?: { username?: string; password?: string }): RedisAuth | undefined => {
    const username = e?.username ?? (e?.password ? undefined : s.redisUsername);
    const password = e?.password ?? s.redisPassword;
    return password || username ? { username, password } : undefined;
  };
  const list = (v: string) => v.split(',').map((e) => parseNodeEntry(e.trim()));
  if (s.redisClusterNodes) {
    const entries = list(s.redisClusterNodes);
    const natMap = s.redisClusterNatMap
      ? Object.fromEntries(
          s.redisClusterNatMap.split(',').map((pair) => {
            const [from, to] = pair.split('=').map((e) => parseNodeEntry(e!.trim()));
            return [`${from!.host}:${from!.port}`, { host: to!.host, port: to!.port }];
          }),
        )
      : undefined;
    const nodes = entries.map(({ host, port }) => ({ host, port }));
    return { kind: 'cluster', nodes, auth: auth(entries[0]), tls: tls(entries[0]!.tls), natMap };
  }
  if (s.redisSentinels) {
    const entries = list(s.redisSentinels);
    const first = entries[0]!;
    const sentinelAuth = first.password || first.username ? { username: first.username, password: first.password } : undefined;
    const sentinels = entries.map(({ host, port }) => ({ host, port }));
    // rediss:// sentinels: the data nodes they name are reached over TLS too (one trust for the group).
    return { kind: 'sentinel', sentinels, name: s.redisSentinelName!, auth: auth(), tls: tls(first.tls), sentinelAuth };
  }
  if (s.redisUrl) {
    const url = new URL(s.redisUrl);
    // A URL with credentials keeps them (ioredis reads them from it); else the settings' own.
    return {
      kind: 'single',
      url: s.redisUrl,
      auth: url.password || url.username ? undefined : auth(),
      tls: tls(url.protocol === 'rediss:'),
    };
  }
  return undefined;
}

/**
 * Replicas a top-up waits for before it is acknowledged (`set`: CREDITS_ACK_REPLICAS), or the
 * usage exporter before it sends (USAGE_EXPORT_ACK_REPLICAS), each set apart: unset, 1 on a
 * Cluster or a Sentinel group (asynchronous replicas a failover promotes), 0 on REDIS_URL.
 */
export function ackReplicas(s: Partial<RedisSettings>, set: number | undefined): number {
  const kind = redisTarget(s)?.kind;
  return set ?? (kind === 'cluster' || kind === 'sentinel' ? 1 : 0);
}

/** GATEWAY_CONFIG alone, for the keys command: other settings do not concern it. */
export function configFilePath(env: NodeJS.ProcessEnv = process.env): string {
  const { env: name, default: fallback } = GatewaySettingsSchema.properties.configFile;
  return env[name] || fallback;
}

/** TRUST_PROXY as fastify takes it: a hop count trusts that many proxies nearest to the gateway. */
export function fastifyTrustProxy(value: GatewaySettings['trustProxy']) {
  return typeof value === 'number' ? (_addr: string, hop: number) => hop < value : value;
}
