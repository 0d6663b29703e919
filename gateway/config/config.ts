import { UNREADABLE, yamlProblem } from './read-errors.js';
import { headerProblems, secretProblems } from './env-template.js';
import { exportProblems, type UsageExport, UsageExportSchema } from './usage-export.js';
import { readFileSync } from 'node:fs';
import { type Static, Type } from '@sinclair/typebox';
import { Value } from '@sinclair/typebox/value';
import { parse as parseYaml } from 'yaml';
import { clientOf } from '../address.js';
import { compileDeprecation, type Deprecation } from '../deprecation.js';
import { type Billing, type Limits, NO_BILLING, type QuotaSubject } from '../quota/decision.js';
import { policyHeader } from '../quota/headers.js';
import { burstProblems, shortOf } from './short.js';
import { type LimitField, WINDOWS } from '../quota/windows.js';
import { accountName, accountOfName, addressName, deploymentPrefix, gatewaysKey } from '../redis/keys.js';
import { ROUTES, type RouteId } from '../routes.js';
import { AccountName, AccountSchema, Costs, Count, IsoDate, LimitsSchema, PlanSchema, Thresholds } from './plan-schema.js';

// The config file the operator edits (plans, keys, bans, deprecations): read, validated with
// every problem named by its path, and compiled into the frozen structures the hot path reads.

export { AccountSchema, CreditsSchema, type KeyLimits, limitFields, optionalLimitFields, PRICE_DECIMALS } from './plan-schema.js';

/** Which keys a deployment takes: `psk_live_` (production) or `psk_test_` (staging). */
const EnvironmentSchema = Type.Union([Type.Literal('production'), Type.Literal('staging')]);
export type Environment = Static<typeof EnvironmentSchema>;

export const ConfigFile = Type.Object(
  {
    environment: EnvironmentSchema,
    plans: Type.Record(Type.String({ pattern: '^[a-z0-9_-]{1,64}$' }), PlanSchema),
    keys: Type.Array(
      Type.Object(
        {
          id: Type.String({ pattern: '^[a-z0-9_-]{1,64}$' }),
          /** Keys of one account share its quota (minute, day, bans); a key without one is its own account. */
          account: Type.Optional(AccountName),
          hash: Type.String({ pattern: '^sha256:[0-9a-f]{64}$' }),
          plan: Type.String(),
          limits: Type.Optional(LimitsSchema),
          /** Units a route costs this key, over its plan's (`"POST /v1/pets": 5`). */
          costs: Type.Optional(Costs),
          /** Shadow mode for this key alone (over its plan's `enforce`). */
          enforce: Type.Optional(Type.Boolean()),
          createdAt: Type.Optional(IsoDate),
          revokedAt: Type.Optional(IsoDate),
          /** From this moment the key answers 401 "expired", as a revoked one does. */
          expiresAt: Type.Optional(IsoDate),
        },
        { additionalProperties: false },
      ),
      { default: [] },
    ),
    /** Per account (a key's `account`, or its id): its billing day and, over its plan's, its credits. */
    accounts: Type.Optional(Type.Record(AccountName, AccountSchema)),
    bans: Type.Object({ afterRejected: Count, withinSeconds: Count, durationSeconds: Count }, { additionalProperties: false }),
    unauthenticated: Type.Object({ perMinute: Count }, { additionalProperties: false }),
    /** Usage events: every counted request, exported to a billing sink as CloudEvents. */
    usage: Type.Optional(
      Type.Object(
        {
          export: UsageExportSchema,
        },
        { additionalProperties: false },
      ),
    ),
    /** Threshold alerts: a webhook (Standard Webhooks, signed with `secret`) when an account reaches a threshold, and when that resolves. */
    alerts: Type.Optional(
      Type.Object(
        {
          url: Type.String({ pattern: '^https?://[^\\s]+$' }),
          secret: Type.String({ pattern: '^whsec_[A-Za-z0-9+/]{32,}={0,2}$' }),
          thresholds: Thresholds,
        },
        { additionalProperties: false },
      ),
    ),
    /** Browser origins allowed to call the API and read its headers (CORS); none by default. */
    cors: Type.Optional(
      Type.Object({ origins: Type.Array(Type.String({ pattern: '^https?://[^/\\s]+$' })) }, { additionalProperties: false }),
    ),
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

/** A key from the file, as the hot path reads it. */
export interface Consumer {
  /** The key id: names the key in the file, the logs, the metrics and its Redis keys. */
  id: string;
  /** The account whose quota it uses: its `account`, or its own id. */
  account: string;
  plan: string;
  revoked: boolean;
  /** When the key stops working (ms since the epoch); Infinity when it does not expire. */
  expiresAtMs: number;
  /** Units each route costs, where not 1: the plan's costs, then the key's. */
  costs: ReadonlyMap<RouteId, number>;
  /** Its quota: limits, ban policy, policy header and Redis key base, built once. */
  subject: QuotaSubject;
  /** What the backend is told about the caller (X-Consumer-Id, X-Consumer-Plan), built once. */
  upstreamHeaders: Readonly<Record<string, string>>;
}

/** The config as the hot path reads it: frozen, indexed, headers prebuilt. */
export interface GatewayConfig {
  environment: Environment;
  /** The Redis key of this deployment's live instances (`<REDIS_KEY_PREFIX>:<environment>:{gateways}`). */
  registryKey: string;
  /** `<REDIS_KEY_PREFIX>:<environment>`: the start of every Redis key of this deployment. */
  redisPrefix: string;
  /** The plans as the file gives them: what a new key of the key registry is checked against. */
  plans: ConfigFile['plans'];
  /** Keys by the SHA-256 of the key: the only index, so the plain key is never kept. */
  consumers: ReadonlyMap<string, Consumer>;
  /** The file's key entries as written (no secret is in them): what the admin port lists, a page at a time. */
  keys: readonly KeyEntry[];
  /** A key (of the file or of the key registry) as the hot path reads it, under this config's plans and accounts. */
  consumerOf(key: KeyEntry): Consumer | undefined;
  /** The account a key subject's Redis name is of (`<prefix>:<environment>:{k:<account>}`), or undefined for another name. */
  accountOf(subjectName: string): string | undefined;
  /** The quota of requests without a valid key, per client (address.ts: an IPv6 address by its /64). */
  addressSubject(address: string): QuotaSubject;
  deprecations: ReadonlyMap<RouteId, Deprecation>;
  /** Origins allowed by CORS (exact `scheme://host[:port]`). */
  corsOrigins: ReadonlySet<string>;
  /** Where usage events go, when configured (every key's subject then records them). */
  usageExport?: UsageExport;
  /** Where threshold alerts go, and the secret that signs them. */
  alerts?: { url: string; secret: string };
  /** One subject per account (its first key's): what the exporter reads. */
  accounts: ReadonlyMap<string, QuotaSubject>;
  /** The billing days the `accounts:` section sets (1 for any other account), a key registry's accounts' too. */
  billingDays: ReadonlyMap<string, number>;
}

export type { UsageExport } from './usage-export.js';

export class ConfigError extends Error {
  constructor(
    readonly source: string,
    readonly problems: string[],
  ) {
    super(`${source}: invalid config\n  ${problems.join('\n  ')}`);
  }
}

/** How a file is read beside the key registry (KEY_STORE=redis). */
export interface ConfigOptions {
  /**
   * Keys also live in the key registry: an `accounts:` entry may be of an account whose keys
   * are all there, so the file alone cannot say it names no account (the keys command and the
   * admin API check the registry when they set one).
   */
  keysElsewhere?: boolean;
  /** Where `${NAME}` in the file is looked up (process.env by default). */
  env?: NodeJS.ProcessEnv;
}

/** Validates parsed YAML/JSON; returns the typed file or every problem, each with its path. */
export function validateConfigFile(raw: unknown, source: string, options: ConfigOptions = {}): ConfigFile {
  const value = Value.Default(ConfigFile, structuredClone(raw ?? {}));
  const problems = [...Value.Errors(ConfigFile, value)].map(
    (e) => `${e.path.slice(1).replaceAll('/', '.') || '(root)'}: ${e.message}${e.schema.hint ? `: ${e.schema.hint}` : ''}`,
  );
  if (problems.length === 0) problems.push(...crossChecks(value as ConfigFile, options));
  if (problems.length > 0) throw new ConfigError(source, problems);
  return value as ConfigFile;
}

/** What a plan with fixed limits gives: `perMinute and perDay (and perMonth)`. */
const PLAN_LIMITS = (() => {
  const [required, optional] = [WINDOWS.filter((w) => w.inPlans === 'required'), WINDOWS.filter((w) => w.inPlans === 'optional')];
  return `${required.map((w) => w.limit).join(' and ')} (and ${optional.map((w) => w.limit).join(', ')})`;
})();

/**
 * Why a key cannot join `account`: its keys share one quota, so they must agree on the plan and
 * limits (`limits`: the first key's, as JSON, or "null"). Said alike by the file and the registry.
 */
export function accountDisagrees(account: string, first: { plan: string; limits: string }, where: string): string {
  const limits = first.limits === 'null' ? '' : ` with limits ${first.limits}`;
  return `account "${account}" is on plan ${first.plan}${limits} (${where}); its keys share one quota, so they must agree`;
}

function crossChecks(file: ConfigFile, options: ConfigOptions): string[] {
  const problems: string[] = [];
  for (const [name, plan] of Object.entries(file.plans)) {
    const given = WINDOWS.filter((w) => plan[w.limit] !== undefined);
    const fixed = WINDOWS.every((w) => w.inPlans === 'optional' || plan[w.limit] !== undefined);
    if (plan.custom ? given.length > 0 : !fixed) problems.push(`plans.${name}: give either ${PLAN_LIMITS}, or custom: true`);
  }
  const currencies = new Set(Object.values(file.plans).flatMap((p) => (p.prices ? [p.prices.currency] : [])));
  if (currencies.size > 1)
    problems.push(`plans: prices are in one currency, a statement's total in it; found ${[...currencies].join(', ')}`);
  const ids = new Set<string>();
  const hashes = new Set<string>();
  const accounts = new Map<string, { index: number; plan: string; limits: string; enforce: boolean }>();
  file.keys.forEach((k, i) => {
    // Own names only: a key on "constructor" must not find Object's.
    const plan = Object.hasOwn(file.plans, k.plan) ? file.plans[k.plan] : undefined;
    if (!plan) problems.push(`keys.${i}.plan: unknown plan "${k.plan}"`);
    else if (plan.custom && !k.limits) problems.push(`keys.${i}.limits: required for the custom plan "${k.plan}"`);
    if (ids.has(k.id)) problems.push(`keys.${i}.id: duplicate id "${k.id}"`);
    // One account, one quota: its keys must agree on the plan and limits it is measured by, and
    // on enforcing it (a shadow key's would-be refusals would ban its enforced siblings).
    const account = k.account ?? k.id;
    const first = accounts.get(account);
    const enforce = k.enforce ?? plan?.enforce ?? true;
    if (!first) accounts.set(account, { index: i, plan: k.plan, limits: JSON.stringify(k.limits ?? null), enforce });
    else if (first.plan !== k.plan || first.limits !== JSON.stringify(k.limits ?? null)) {
      problems.push(`keys.${i}: ${accountDisagrees(account, first, `keys.${first.index}`)}`);
    } else if (first.enforce !== enforce) {
      problems.push(
        `keys.${i}.enforce: account "${account}" is ${first.enforce ? 'enforced' : 'in shadow mode'} (keys.${first.index}); its keys share one quota and one ban, so they must agree`,
      );
    }
    if (hashes.has(k.hash)) problems.push(`keys.${i}.hash: duplicate hash`);
    ids.add(k.id);
    hashes.add(k.hash);
  });
  for (const name of Object.keys(file.accounts ?? {})) {
    if (!accounts.has(name) && !options.keysElsewhere)
      problems.push(`accounts.${name}: no key in account "${name}" (a key's account, or its id)`);
  }
  const checkCosts = (costs: Record<string, number> | undefined, where: string) => {
    for (const route of Object.keys(costs ?? {})) {
      if (!ROUTES.some((r) => `${r.method} ${r.path}` === route))
        problems.push(`${where}.costs: no route "${route}" (write "METHOD /path", e.g. "POST /v1/pets")`);
    }
  };
  for (const [name, plan] of Object.entries(file.plans)) checkCosts(plan.costs, `plans.${name}`);
  file.keys.forEach((k, i) => checkCosts(k.costs, `keys.${i}`));
  for (const [name, plan] of Object.entries(file.plans)) problems.push(...burstProblems(plan.burst, plan.costs, `plans.${name}`));
  file.keys.forEach((k, i) => {
    const plan = Object.hasOwn(file.plans, k.plan) ? file.plans[k.plan] : undefined;
    // Its own limits replace the plan's burst; its own costs meet whichever burst it has.
    const burst = k.limits ? k.limits.burst : k.costs && plan?.burst;
    problems.push(...burstProblems(burst, { ...plan?.costs, ...k.costs }, k.limits ? `keys.${i}.limits` : `keys.${i} (plans.${k.plan})`));
  });
  file.deprecations.forEach((d, i) => {
    if (!ROUTES.some((r) => r.method === d.method && r.path === d.path)) {
      problems.push(`deprecations.${i}: no route ${d.method} ${d.path}`);
    }
    if (Date.parse(d.sunset) < Date.parse(d.deprecatedAt)) {
      problems.push(`deprecations.${i}.sunset: earlier than deprecatedAt (RFC 9745 §4)`);
    }
  });
  problems.push(...headerProblems(file.usage?.export.headers, 'usage.export.headers', options.env ?? process.env));
  problems.push(...secretProblems(file.usage?.export.stripe?.secretKey, 'usage.export.stripe.secretKey', options.env ?? process.env));
  problems.push(...exportProblems(file.usage?.export));
  return problems;
}

/** Route costs by route id, keeping only those that differ from 1. */
function routeCosts(costs: Record<string, number>): ReadonlyMap<RouteId, number> {
  const out = new Map<RouteId, number>();
  for (const r of ROUTES) {
    const cost = costs[`${r.method} ${r.path}`];
    if (cost !== undefined && cost !== 1) out.set(r.id, cost);
  }
  return out;
}

type PlanEntry = ConfigFile['plans'][string];
/** A key's entry, as the config file lists it and the key registry stores it. */
export type KeyEntry = ConfigFile['keys'][number];
type AccountEntry = NonNullable<ConfigFile['accounts']>[string];

/** What an account is billed by: its billing day, its plan's overage, and its own credits or else its plan's. */
/** The billing days the `accounts:` section sets. */
const billingDays = (file: ConfigFile): Map<string, number> =>
  new Map(Object.entries(file.accounts ?? {}).flatMap(([a, s]) => (s.billingDay ? [[a, s.billingDay] as const] : [])));

function billingOf(plan: PlanEntry, account: AccountEntry | undefined): Billing {
  const credits = account?.credits ?? plan.credits;
  return Object.freeze({
    billingDay: account?.billingDay ?? 1,
    overage: plan.overage?.upTo ?? 0,
    ...(credits && { credits: { grant: credits.grant, rollover: credits.rollover ?? false } }),
  });
}

/** The limits a key is refused at: with overage, the month's quota (the day's, without one) plus the overage. */
function ceilings(quota: Partial<Record<LimitField, number>>, overage: number): Limits {
  const limits = { perDay: 0 } as Limits;
  for (const w of WINDOWS) if (quota[w.limit] !== undefined) limits[w.limit] = quota[w.limit]!;
  if (limits.perMonth) limits.perMonth += overage;
  else limits.perDay += overage;
  return limits;
}

/** The deprecated routes' headers and sunsets, by route. */
function deprecationsOf(file: ConfigFile): Map<RouteId, Deprecation> {
  const deprecations = new Map<RouteId, Deprecation>();
  for (const d of file.deprecations) {
    const route = ROUTES.find((r) => r.method === d.method && r.path === d.path)!;
    const dates = { deprecatedAtMs: Date.parse(d.deprecatedAt), sunsetMs: Date.parse(d.sunset) };
    deprecations.set(route.id, compileDeprecation({ ...dates, successor: d.successor, documentation: d.documentation }));
  }
  return deprecations;
}

/** Turns a valid file into the structures the hot path reads. */
export function compileConfig(file: ConfigFile, redisKeyPrefix = 'gw'): GatewayConfig {
  const build = configBuilder(file, redisKeyPrefix);
  for (const k of file.keys) build.add(k);
  return build.done();
}

/**
 * compileConfig a key at a time: a reload adds the keys a slice at a time between requests
 * (load-thread.ts), the file's other sections given whole in `file` (its own keys not added).
 */
export function configBuilder(file: ConfigFile, redisKeyPrefix = 'gw'): { add(k: KeyEntry): void; done(): GatewayConfig } {
  const redisPrefix = deploymentPrefix(redisKeyPrefix, file.environment);
  const bans = {
    afterRejected: file.bans.afterRejected,
    withinMs: file.bans.withinSeconds * 1000,
    durationMs: file.bans.durationSeconds * 1000,
  };
  /** One key as the hot path reads it; undefined when its plan is not in this config (a registry key's may not be). */
  const consumerOf = (k: KeyEntry): Consumer | undefined => {
    if (!Object.hasOwn(file.plans, k.plan)) return undefined;
    const plan = file.plans[k.plan]!;
    const account = k.account ?? k.id;
    const billing = billingOf(plan, file.accounts && Object.hasOwn(file.accounts, account) ? file.accounts[account] : undefined);
    const limits = ceilings(k.limits ?? plan, billing.overage);
    const short = shortOf(k.limits ?? plan);
    return {
      id: k.id,
      account,
      plan: k.plan,
      revoked: k.revokedAt !== undefined,
      expiresAtMs: k.expiresAt ? Date.parse(k.expiresAt) : Number.POSITIVE_INFINITY,
      costs: routeCosts({ ...plan.costs, ...k.costs }),
      // Named by the account: a key without one keeps the name (and the counters) it always had.
      subject: {
        name: accountName(redisPrefix, account),
        limits,
        bans,
        policy: policyHeader(limits, short),
        lasting: true,
        enforce: k.enforce ?? plan.enforce ?? true,
        billing,
        events: file.usage?.export.maxEvents ?? 0,
        alerts: file.alerts ? (plan.alerts?.thresholds ?? file.alerts.thresholds).join(',') : '',
        short,
      },
      upstreamHeaders: Object.freeze({ 'x-consumer-id': k.id, 'x-consumer-account': account, 'x-consumer-plan': k.plan }),
    };
  };
  const consumers = new Map<string, Consumer>();
  const keys: KeyEntry[] = [];
  const accounts = new Map<string, QuotaSubject>(); // each account's first key's subject: its keys share it
  const add = (k: KeyEntry) => {
    const c = consumerOf(k)!; // validated: its plan exists
    keys.push(k);
    consumers.set(k.hash, c);
    if (!accounts.has(c.account)) accounts.set(c.account, c.subject);
  };
  const anonymous = { perMinute: file.unauthenticated.perMinute, perDay: 0 };
  const anonymousPolicy = policyHeader(anonymous);
  const done = (): GatewayConfig =>
    Object.freeze({
      environment: file.environment,
      registryKey: gatewaysKey(redisPrefix),
      redisPrefix,
      plans: file.plans,
      consumers,
      keys,
      consumerOf,
      accountOf: (name: string) => accountOfName(redisPrefix, name),
      billingDays: billingDays(file),
      addressSubject: (address: string) => ({
        name: addressName(redisPrefix, clientOf(address)),
        limits: anonymous,
        bans: null,
        policy: anonymousPolicy,
        lasting: false,
        enforce: true,
        billing: NO_BILLING,
        events: 0,
        alerts: '',
        short: undefined,
      }),
      deprecations: deprecationsOf(file),
      corsOrigins: new Set(file.cors?.origins ?? []),
      usageExport: file.usage?.export,
      alerts: file.alerts && { url: file.alerts.url, secret: file.alerts.secret },
      accounts,
    });
  return { add, done };
}

export function parseConfigText(text: string, source: string, options: ConfigOptions = {}): ConfigFile {
  let raw: unknown;
  try {
    raw = parseYaml(text);
  } catch (err) {
    throw new ConfigError(source, [`not valid YAML or JSON ${yamlProblem(err as Error, text)}`]);
  }
  return validateConfigFile(raw, source, options);
}

/**
 * Reads, validates and compiles a config file; throws ConfigError naming every problem.
 * `setting` names where the path came from, for a file that cannot be read at all.
 */
export function loadConfigFile(path: string, redisKeyPrefix?: string, setting?: string, options: ConfigOptions = {}): GatewayConfig {
  return compileConfig(readConfigFile(path, setting, options), redisKeyPrefix);
}

/** Reads and validates a config file, uncompiled (a reload's thread does this: load-worker.ts). */
export function readConfigFile(path: string, setting?: string, options: ConfigOptions = {}): ConfigFile {
  let text: string;
  try {
    text = readFileSync(path, 'utf8');
  } catch (err) {
    const code = (err as NodeJS.ErrnoException).code ?? '';
    const why = `cannot read it: ${UNREADABLE[code] ?? (err as Error).message}`;
    const error = new ConfigError(setting ? `${setting}=${path}` : path, [why]);
    error.message = `${error.source}: ${why}`; // one line: there is no content to list problems in
    throw error;
  }
  return parseConfigText(text, path, options);
}
