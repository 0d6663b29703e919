import { isIP } from 'node:net';
import { Type } from '@sinclair/typebox';
import { flag, logLevel, oneOf, readSettings } from '../../runtime/settings.js';
import type { RedisTarget } from '../redis/client.js';

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

/** A port a Redis listens on: 1 to 65535 (a pattern, so the error is the hint's words). */
const REDIS_PORT = '([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])';
/** `host:port,host:port,...` */
const HOST_PORTS = `^[^,:\\s]+:${REDIS_PORT}(,[^,:\\s]+:${REDIS_PORT})*$`;
const HOST_PORTS_HINT = 'host:port pairs separated by commas, ports 1 to 65535, e.g. 10.0.0.1:7000,10.0.0.2:7000';

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
    throw new Error(`not a URL: ${value} (e.g. redis://127.0.0.1:6379)`);
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
  redisClusterNodes: Type.Optional(Type.String({ env: 'REDIS_CLUSTER_NODES', pattern: HOST_PORTS, hint: HOST_PORTS_HINT })),
  redisSentinels: Type.Optional(Type.String({ env: 'REDIS_SENTINELS', pattern: HOST_PORTS, hint: HOST_PORTS_HINT })),
  redisSentinelName: Type.Optional(Type.String({ env: 'REDIS_SENTINEL_NAME', pattern: '^[A-Za-z0-9_.-]{1,64}$' })),
  configFile: Type.String({ env: 'GATEWAY_CONFIG', minLength: 1, default: 'config/gateway.yaml' }),
  // Where keys live: the config file (the default, and the GitOps path), or also a key registry
  // in Redis for deployments past a file (docs/keys.md): a key change then costs one key.
  keyStore: oneOf('KEY_STORE', ['file', 'redis'], 'file'),
  bodyLimit: Type.Integer({ env: 'GATEWAY_BODY_LIMIT', minimum: 1, default: 1024 * 1024 }),
  // A client's whole request (headers and body) must arrive within this; then 408 (slow clients).
  requestTimeoutMs: Ms('GATEWAY_REQUEST_TIMEOUT_MS', 30_000),
  upstreamTimeoutMs: Ms('UPSTREAM_TIMEOUT_MS', 10_000),
  // A Redis call unanswered this long declares Redis failing; until then requests wait for it.
  // 1 s: a Redis Cluster node under CPU contention was seen to stall for 300-400 ms, and a
  // stall taken for a failure lets each instance admit from its budget (exactness test).
  redisTimeoutMs: Ms('REDIS_TIMEOUT_MS', 1000),
  // While Redis fails: decide from each instance's degraded budget (open) or answer 503 (closed).
  quotaStoreFailure: oneOf('QUOTA_STORE_FAILURE', ['open', 'closed'], 'open'),
  quotaLeaseMax: Type.Integer({ env: 'QUOTA_LEASE_MAX', minimum: 1, maximum: 1000, default: 100 }),
  // A top-up answers 201 once this many replicas hold it (WAIT), else 503 (a retry with the same
  // Idempotency-Key adds nothing and waits again). Unset: 1 on a Cluster or a Sentinel group,
  // whose replication is asynchronous (a failover could lose an unreplicated top-up); 0 on REDIS_URL.
  creditsAckReplicas: Type.Optional(Type.Integer({ env: 'CREDITS_ACK_REPLICAS', minimum: 0, maximum: 16 })),
  creditsAckTimeoutMs: Ms('CREDITS_ACK_TIMEOUT_MS', 2000),
  // How long a top-up's Idempotency-Key is remembered (Stripe keeps 24 h): a retry after it adds again.
  idempotencyKeyHours: Type.Integer({ env: 'IDEMPOTENCY_KEY_HOURS', minimum: 1, maximum: 8760, default: 24 }),
  redisKeyPrefix: Type.String({ env: 'REDIS_KEY_PREFIX', pattern: '^[A-Za-z0-9_.-]{1,32}$', default: 'gw' }),
  // Never a plain "true": that would trust any X-Forwarded-For a client writes.
  trustProxy: Type.Transform(Type.String({ env: 'TRUST_PROXY', minLength: 1, default: 'false' }))
    .Decode(parseTrustProxy)
    .Encode(String),
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

/** Which Redis the settings name, if any: a single node, a Cluster or a Sentinel group. */
export function redisTarget(
  s: Pick<GatewaySettings, 'redisUrl' | 'redisClusterNodes' | 'redisSentinels' | 'redisSentinelName'>,
): RedisTarget | undefined {
  const nodes = (list: string) =>
    list.split(',').map((n) => ({ host: n.slice(0, n.lastIndexOf(':')), port: Number(n.slice(n.lastIndexOf(':') + 1)) }));
  if (s.redisClusterNodes) return { kind: 'cluster' as const, nodes: nodes(s.redisClusterNodes) };
  if (s.redisSentinels) return { kind: 'sentinel' as const, sentinels: nodes(s.redisSentinels), name: s.redisSentinelName! };
  if (s.redisUrl) return { kind: 'single' as const, url: s.redisUrl };
  return undefined;
}

/** Replicas a top-up waits for before it is acknowledged (CREDITS_ACK_REPLICAS, or its default for the topology). */
export function ackReplicas(s: Parameters<typeof redisTarget>[0] & Pick<GatewaySettings, 'creditsAckReplicas'>): number {
  const kind = redisTarget(s)?.kind;
  return s.creditsAckReplicas ?? (kind === 'cluster' || kind === 'sentinel' ? 1 : 0);
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
