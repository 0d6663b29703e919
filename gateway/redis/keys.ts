// Every Redis key name the gateway uses, built here and nowhere else (STYLE.md, "name every
// wire"). Stored data outlives a release: a name changed here strands what Redis holds under the
// old one, so test/unit/redis-keys.test.ts pins them. A leaf: it imports nothing of the gateway.
//
// Cluster slots: Redis hashes only the part between the first `{` and `}` (the hash tag). Every
// key of one account carries `{k:<account>}`, so quota.lua and the usage scripts, which touch
// several of them in one call, stay on one node; each background loop and the key registry
// have a tag of their own.

/** The deployment's prefix: REDIS_KEY_PREFIX and the config's environment. */
export const deploymentPrefix = (redisKeyPrefix: string, environment: string) => `${redisKeyPrefix}:${environment}`;

/** An account's base name: its counters hash, and the stem of its other keys. */
export const accountName = (prefix: string, account: string) => `${prefix}:{k:${account}}`;

/** The account whose base name `name` is, or undefined for any other name (an address's). */
export function accountOfName(prefix: string, name: string): string | undefined {
  const stem = `${prefix}:{k:`;
  return name.startsWith(stem) && name.endsWith('}') ? name.slice(stem.length, -1) : undefined;
}

/** An unauthenticated client address's base name (its minute counter). */
export const addressName = (prefix: string, address: string) => `${prefix}:{a:${address}}`;

/** The live gateway instances (a hash: id -> last heartbeat), read by the degraded budget. */
export const gatewaysKey = (prefix: string) => `${prefix}:{gateways}`;

/** A background loop's keys, in the loop's own slot: its leader lock, its index of active accounts, its sweep position, its recent deliveries. */
export const loopKey = (prefix: string, loop: string, what: 'lock' | 'active' | 'sweep' | 'deliveries') => `${prefix}:{${loop}}:${what}`;

/**
 * The keys beside a subject's counters (`name`: accountName or addressName), in its slot. Plain
 * functions, not an object per subject: quota.lua's keys are built on every call.
 */
export const subjectKey = {
  /** The counters hash: window starts and counts, ban end, period, overage. */
  counters: (name: string) => name,
  /** Times of its recent 429s (a list): what a ban counts. */
  rejections: (name: string) => `${name}:rej`,
  /** Prepaid credits (a hash: granted, purchased, the grant's period). */
  credits: (name: string) => `${name}:credits`,
  /** The credits' ledger (a stream). */
  ledger: (name: string) => `${name}:ledger`,
  /** Top-ups whose idempotency key expired (a hash: key -> "fingerprint entryId balance"). */
  topUps: (name: string) => `${name}:topups`,
  /** One top-up's answer, by its idempotency key, for IDEMPOTENCY_KEY_HOURS. */
  topUp: (name: string, idempotencyKey: string) => `${name}:topup:${idempotencyKey}`,
  /** Usage events (a stream), the exporter's cursor over it (a hash), admitted requests' statuses (a hash). */
  events: (name: string) => `${name}:events`,
  eventsCursor: (name: string) => `${name}:events:cursor`,
  statuses: (name: string) => `${name}:statuses`,
  /**
   * Leased admissions' usage events, a bundle an entry (a stream, usagebatch.lua): its cursor
   * lives in the events cursor's hash, beside the other stream's.
   */
  bundles: (name: string) => `${name}:bundles`,
  /** Threshold alerts fired (a hash), to send (a stream), the dispatcher's cursor and fence. */
  alerted: (name: string) => `${name}:alerted`,
  alerts: (name: string) => `${name}:alerts`,
  alertsCursor: (name: string) => `${name}:alerts:cursor`,
  alertsFence: (name: string) => `${name}:alerts:fence`,
  /** Degraded-budget write-backs already applied (a hash of batch ids). */
  writtenBack: (name: string) => `${name}:wb`,
  /** Concurrency slots in flight (a sorted set: slot id -> expiry, Redis ms). */
  slots: (name: string) => `${name}:slots`,
  /** The burst's theoretical arrival time (GCRA, Redis ms). */
  burst: (name: string) => `${name}:burst`,
  /** One quota.lua call's reply, by the call's id, for a resend to find. */
  call: (name: string, callId: string) => `${name}:call:${callId}`,
  /** One batch of leased admissions' usage events, by its id, once written: a resend writes nothing. */
  usageBatch: (name: string, batchId: string) => `${name}:ub:${batchId}`,
  /** The portal's audit log of the account's self-service actions (a capped stream). */
  audit: (name: string) => `${name}:audit`,
  /** Requests by outcome in one minute (`m`) or UTC day (`d`) starting at `startMs` (a hash: outcome -> count). */
  history: (name: string, unit: 'm' | 'd', startMs: number) => `${name}:hist:${unit}:${startMs}`,
} as const;

/**
 * The portal's sessions and single-use links, by the SHA-256 of their secret (Redis never holds
 * one a reader could replay), in one slot of their own: a session is found by its id alone.
 */
export function portalKeys(prefix: string) {
  const base = `${prefix}:{portal}`;
  return {
    session: (digest: string) => `${base}:session:${digest}`,
    link: (digest: string) => `${base}:link:${digest}`,
  };
}

/** The key registry's names (KEY_STORE=redis), all in one slot (`{keys}`): its scripts touch several at once. */
export function registryKeys(prefix: string) {
  const base = `${prefix}:{keys}`;
  return {
    record: (digest: string) => `${base}:key:${digest}`,
    id: (id: string) => `${base}:id:${id}`,
    /** The ids of an account's keys (a set). */
    account: (account: string) => `${base}:account:${account}`,
    /** Every id, for listing in order (a sorted set, all scores 0). */
    ids: `${base}:ids`,
    /** Keys issued per plan, revoked ones included (a hash: plan -> count): what a reload removing a plan is checked against. */
    plans: `${base}:plans`,
    /** The same counts while they are rebuilt a page at a time (`~at`: the last id counted), renamed to `plans` once whole. */
    plansRecount: `${base}:plans:recount`,
    bloom: `${base}:bloom`,
    /** The channel a change's digest is published on. */
    changed: `${base}:changed`,
  };
}
