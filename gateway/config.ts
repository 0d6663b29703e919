import { readFileSync } from 'node:fs';
import { isIP } from 'node:net';
import { type Static, Type } from '@sinclair/typebox';
import { Value } from '@sinclair/typebox/value';
import { parse as parseYaml } from 'yaml';
import { LogLevel, readEnv } from '../runtime/process.js';
import { deprecationHeaders, type Limits, policyHeader } from './headers.js';
import type { Environment } from './keys.js';
import type { QuotaSubject } from './quota-store.js';
import { ROUTES, type RouteId } from './routes.js';

// ---- process settings (env) ----

/** TRUST_PROXY as fastify takes it; every address is checked here, so a typo stops the boot. */
function trustProxy(value: string): false | number | string {
  if (value === 'false') return false;
  if (/^[0-9]+$/.test(value)) return Number(value);
  const bad = value.split(',').map((t) => t.trim()).filter((t) => {
    if (['loopback', 'linklocal', 'uniquelocal'].includes(t)) return false;
    const [addr = '', bits, ...rest] = t.split('/');
    const max = isIP(addr) === 4 ? 32 : 128;
    return rest.length > 0 || isIP(addr) === 0 || (bits !== undefined && !(/^[0-9]+$/.test(bits) && Number(bits) <= max));
  });
  if (bad.length > 0) {
    throw new Error(`Invalid gateway settings:\n  TRUST_PROXY: not an address, CIDR or hop count: ${bad.join(', ')}`);
  }
  return value;
}

const Env = Type.Object({
  GATEWAY_PORT: Type.Integer({ minimum: 0, maximum: 65535, default: 3000 }),
  GATEWAY_HOST: Type.String({ minLength: 1, default: '127.0.0.1' }),
  BACKEND_URL: Type.String({ pattern: '^https?://', default: 'http://127.0.0.1:3001' }),
  REDIS_URL: Type.Optional(Type.String({ pattern: '^rediss?://' })),
  GATEWAY_CONFIG: Type.String({ minLength: 1, default: 'config/gateway.yaml' }),
  GATEWAY_BODY_LIMIT: Type.Integer({ minimum: 1, default: 1024 * 1024 }),
  UPSTREAM_TIMEOUT_MS: Type.Integer({ minimum: 1, default: 10_000 }),
  REDIS_TIMEOUT_MS: Type.Integer({ minimum: 1, default: 250 }),
  REDIS_KEY_PREFIX: Type.String({ pattern: '^[A-Za-z0-9_.-]{1,32}$', default: 'gw' }),
  ADMIN_PORT: Type.Integer({ minimum: 0, maximum: 65535, default: 9000 }),
  ADMIN_HOST: Type.String({ minLength: 1, default: '127.0.0.1' }),
  ADMIN_TOKEN: Type.Optional(Type.String({ minLength: 16 })),
  METRICS_KEY_IDS: Type.Union([Type.Literal('true'), Type.Literal('false')], { default: 'false' }),
  SHUTDOWN_GRACE_MS: Type.Integer({ minimum: 0, default: 10_000 }),
  LOG_PRETTY: Type.Union([Type.Literal('1'), Type.Literal('0')], { default: '0' }),
  // Never a plain "true": that would trust any X-Forwarded-For a client writes.
  TRUST_PROXY: Type.String({
    minLength: 1,
    default: 'false',
    description: 'false, a hop count, or a comma-separated list of proxy addresses/CIDRs (or loopback, linklocal, uniquelocal)',
  }),
  LOG_LEVEL: LogLevel,
});

export interface GatewaySettings {
  port: number;
  host: string;
  backendUrl: string;
  redisUrl: string | undefined;
  configFile: string;
  bodyLimit: number;
  upstreamTimeoutMs: number;
  redisTimeoutMs: number;
  redisKeyPrefix: string;
  /** For fastify's trustProxy: false, a hop count, or addresses/CIDRs of trusted proxies. */
  trustProxy: false | number | string;
  adminPort: number;
  adminHost: string;
  adminToken: string | undefined;
  metricsKeyIds: boolean;
  shutdownGraceMs: number;
  logLevel: string;
  logPretty: boolean;
}

/** GATEWAY_CONFIG alone, for the keys command: other settings do not concern it. */
export function configFilePath(env: NodeJS.ProcessEnv = process.env): string {
  return env.GATEWAY_CONFIG || Env.properties.GATEWAY_CONFIG.default;
}

export function loadSettings(env: NodeJS.ProcessEnv = process.env): GatewaySettings {
  const v = readEnv(Env, env, 'gateway');
  return Object.freeze({
    port: v.GATEWAY_PORT,
    host: v.GATEWAY_HOST,
    backendUrl: v.BACKEND_URL,
    redisUrl: v.REDIS_URL,
    configFile: v.GATEWAY_CONFIG,
    bodyLimit: v.GATEWAY_BODY_LIMIT,
    upstreamTimeoutMs: v.UPSTREAM_TIMEOUT_MS,
    redisTimeoutMs: v.REDIS_TIMEOUT_MS,
    redisKeyPrefix: v.REDIS_KEY_PREFIX,
    trustProxy: trustProxy(v.TRUST_PROXY),
    adminPort: v.ADMIN_PORT,
    adminHost: v.ADMIN_HOST,
    adminToken: v.ADMIN_TOKEN,
    metricsKeyIds: v.METRICS_KEY_IDS === 'true',
    shutdownGraceMs: v.SHUTDOWN_GRACE_MS,
    logLevel: v.LOG_LEVEL,
    logPretty: v.LOG_PRETTY === '1',
  });
}

// ---- the config file (plans, keys, bans, deprecations) ----

const Count = Type.Integer({ minimum: 1 });
const LimitsSchema = Type.Object({ perMinute: Count, perDay: Count }, { additionalProperties: false });
const IsoDate = Type.String({ pattern: '^\\d{4}-\\d{2}-\\d{2}T\\d{2}:\\d{2}(:\\d{2}(\\.\\d+)?)?(Z|[+-]\\d{2}:\\d{2})$' });

export const ConfigFile = Type.Object(
  {
    environment: Type.Union([Type.Literal('production'), Type.Literal('staging')]),
    plans: Type.Record(
      Type.String({ pattern: '^[a-z0-9_-]{1,64}$' }),
      Type.Object(
        { perMinute: Type.Optional(Count), perDay: Type.Optional(Count), custom: Type.Optional(Type.Boolean()) },
        { additionalProperties: false },
      ),
    ),
    keys: Type.Array(
      Type.Object(
        {
          id: Type.String({ pattern: '^[a-z0-9_-]{1,64}$' }),
          hash: Type.String({ pattern: '^sha256:[0-9a-f]{64}$' }),
          plan: Type.String(),
          limits: Type.Optional(LimitsSchema),
          createdAt: Type.Optional(IsoDate),
          revokedAt: Type.Optional(IsoDate),
        },
        { additionalProperties: false },
      ),
      { default: [] },
    ),
    bans: Type.Object(
      { afterRejected: Count, withinSeconds: Count, durationSeconds: Count },
      { additionalProperties: false },
    ),
    unauthenticated: Type.Object({ perMinute: Count }, { additionalProperties: false }),
    deprecations: Type.Array(
      Type.Object(
        {
          method: Type.String(),
          path: Type.String(),
          deprecatedAt: IsoDate,
          sunset: IsoDate,
          successor: Type.String({ pattern: '^/' }),
          documentation: Type.Optional(Type.String({ pattern: '^https?://' })),
        },
        { additionalProperties: false },
      ),
      { default: [] },
    ),
  },
  { additionalProperties: false },
);
export type ConfigFile = Static<typeof ConfigFile>;

export interface Consumer {
  id: string;
  plan: string;
  limits: Limits;
  revoked: boolean;
  /** Its quota in the store; the key base has a hash tag so all its Redis keys share a Cluster slot. */
  subject: QuotaSubject;
  /** RateLimit-Policy value, built once. */
  policy: string;
  /** What the backend is told about the caller (X-Consumer-Id, X-Consumer-Plan), built once. */
  upstreamHeaders: Readonly<Record<string, string>>;
}

export interface Deprecation {
  sunsetMs: number;
  headers: Record<string, string>;
}

/** The config as the hot path reads it: frozen, indexed, headers prebuilt. */
export interface GatewayConfig {
  environment: Environment;
  /** Start of every Redis key: `<REDIS_KEY_PREFIX>:<environment>`. */
  keyPrefix: string;
  consumers: ReadonlyMap<string, Consumer>;
  unauthenticated: { limits: Limits; policy: string };
  deprecations: ReadonlyMap<RouteId, Deprecation>;
}

export class ConfigError extends Error {
  constructor(
    readonly source: string,
    readonly problems: string[],
  ) {
    super(`${source}: invalid config\n  ${problems.join('\n  ')}`);
  }
}

/** Validates parsed YAML/JSON; returns the typed file or every problem, each with its path. */
export function validateConfigFile(raw: unknown, source: string): ConfigFile {
  const value = Value.Default(ConfigFile, structuredClone(raw ?? {}));
  const problems = [...Value.Errors(ConfigFile, value)].map((e) => `${e.path.slice(1).replaceAll('/', '.') || '(root)'}: ${e.message}`);
  if (problems.length === 0) problems.push(...crossChecks(value as ConfigFile));
  if (problems.length > 0) throw new ConfigError(source, problems);
  return value as ConfigFile;
}

function crossChecks(file: ConfigFile): string[] {
  const problems: string[] = [];
  for (const [name, plan] of Object.entries(file.plans)) {
    const fixed = plan.perMinute !== undefined && plan.perDay !== undefined;
    if (plan.custom ? plan.perMinute !== undefined || plan.perDay !== undefined : !fixed) {
      problems.push(`plans.${name}: give either perMinute and perDay, or custom: true`);
    }
  }
  const ids = new Set<string>();
  const hashes = new Set<string>();
  file.keys.forEach((k, i) => {
    const plan = file.plans[k.plan];
    if (!plan) problems.push(`keys.${i}.plan: unknown plan "${k.plan}"`);
    else if (plan.custom && !k.limits) problems.push(`keys.${i}.limits: required for the custom plan "${k.plan}"`);
    if (ids.has(k.id)) problems.push(`keys.${i}.id: duplicate id "${k.id}"`);
    if (hashes.has(k.hash)) problems.push(`keys.${i}.hash: duplicate hash`);
    ids.add(k.id);
    hashes.add(k.hash);
  });
  file.deprecations.forEach((d, i) => {
    if (!ROUTES.some((r) => r.method === d.method && r.path === d.path)) {
      problems.push(`deprecations.${i}: no route ${d.method} ${d.path}`);
    }
    if (Date.parse(d.sunset) < Date.parse(d.deprecatedAt)) {
      problems.push(`deprecations.${i}.sunset: earlier than deprecatedAt (RFC 9745 §4)`);
    }
  });
  return problems;
}

/** Turns a valid file into the structures the hot path reads. */
export function compileConfig(file: ConfigFile, redisKeyPrefix = 'gw'): GatewayConfig {
  const keyPrefix = `${redisKeyPrefix}:${file.environment}`;
  const bans = {
    afterRejected: file.bans.afterRejected,
    withinMs: file.bans.withinSeconds * 1000,
    durationMs: file.bans.durationSeconds * 1000,
  };
  const consumers = new Map<string, Consumer>();
  for (const k of file.keys) {
    const plan = file.plans[k.plan]!;
    const limits = k.limits ?? { perMinute: plan.perMinute!, perDay: plan.perDay! };
    consumers.set(k.hash, {
      id: k.id,
      plan: k.plan,
      limits,
      revoked: k.revokedAt !== undefined,
      subject: { key: `${keyPrefix}:{k:${k.id}}`, limits, bans },
      policy: policyHeader(limits),
      upstreamHeaders: Object.freeze({ 'x-consumer-id': k.id, 'x-consumer-plan': k.plan }),
    });
  }
  const deprecations = new Map<RouteId, Deprecation>();
  for (const d of file.deprecations) {
    const route = ROUTES.find((r) => r.method === d.method && r.path === d.path)!;
    const input = {
      deprecatedAtMs: Date.parse(d.deprecatedAt),
      sunsetMs: Date.parse(d.sunset),
      successor: d.successor,
      documentation: d.documentation,
    };
    deprecations.set(route.id, { sunsetMs: input.sunsetMs, headers: deprecationHeaders(input) });
  }
  const anonymous = { perMinute: file.unauthenticated.perMinute, perDay: 0 };
  return Object.freeze({
    environment: file.environment,
    keyPrefix,
    consumers,
    unauthenticated: { limits: anonymous, policy: policyHeader(anonymous) },
    deprecations,
  });
}

export function parseConfigText(text: string, source: string): ConfigFile {
  let raw: unknown;
  try {
    raw = parseYaml(text);
  } catch (err) {
    throw new ConfigError(source, [`not valid YAML or JSON: ${(err as Error).message.split('\n')[0]}`]);
  }
  return validateConfigFile(raw, source);
}

/** Reads, validates and compiles a config file; throws ConfigError naming every problem. */
export function loadConfigFile(path: string, redisKeyPrefix?: string): GatewayConfig {
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch (err) {
    throw new ConfigError(path, [`cannot read: ${(err as NodeJS.ErrnoException).code ?? (err as Error).message}`]);
  }
  return compileConfig(parseConfigText(text, path), redisKeyPrefix);
}
