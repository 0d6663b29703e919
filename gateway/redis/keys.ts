// A name changed here strands what Redis holds under the old one: test/unit/redis-keys.test.ts pins them.
// An account's keys share the hash tag `{k:<account>}`, so a script touching several stays on one Cluster node.

export const deploymentPrefix = (redisKeyPrefix: string, environment: string) => `${redisKeyPrefix}:${environment}`;

/** Its counters hash, and the stem of its other keys. */
export const accountName = (prefix: string, account: string) => `${prefix}:{k:${account}}`;

export function accountOfName(prefix: string, name: string): string | undefined {
  const stem = `${prefix}:{k:`;
  return name.startsWith(stem) && name.endsWith('}') ? name.slice(stem.length, -1) : undefined;
}

export const addressName = (prefix: string, address: string) => `${prefix}:{a:${address}}`;

/** A hash: id -> last heartbeat. */
export const gatewaysKey = (prefix: string) => `${prefix}:{gateways}`;

export const loopKey = (prefix: string, loop: string, what: 'lock' | 'active' | 'sweep' | 'deliveries' | 'periods') =>
  `${prefix}:{${loop}}:${what}`;

/** Plain functions, not an object per subject: quota.lua's keys are built on every call. */
export const subjectKey = {
  counters: (name: string) => name,
  /** Times of its recent 429s (a list): what a ban counts. */
  rejections: (name: string) => `${name}:rej`,
  /** A hash: granted, purchased, the grant's period. */
  credits: (name: string) => `${name}:credits`,
  ledger: (name: string) => `${name}:ledger`,
  /** Top-ups whose idempotency key expired (a hash: key -> "fingerprint entryId balance"). */
  topUps: (name: string) => `${name}:topups`,
  /** One top-up's answer, by its idempotency key, for IDEMPOTENCY_KEY_HOURS. */
  topUp: (name: string, idempotencyKey: string) => `${name}:topup:${idempotencyKey}`,
  events: (name: string) => `${name}:events`,
  eventsCursor: (name: string) => `${name}:events:cursor`,
  /** The usage exporter's last write before its WAIT, in the account's slot (usage/replicated.ts); it expires. */
  eventsReplicated: (name: string) => `${name}:events:replicated`,
  /** Events a sink refused for good (a hash: event id -> why, and the event): out of the way of those behind them. */
  eventsRejected: (name: string) => `${name}:events:rejected`,
  statuses: (name: string) => `${name}:statuses`,
  /** Leased admissions' events, a bundle an entry (usagebatch.lua); their cursor is in the events cursor's hash. */
  bundles: (name: string) => `${name}:bundles`,
  /** Per billing period, the events the sink accepted (usage/periods.ts): a hash, `<period start>|<figure>` -> value. */
  statements: (name: string) => `${name}:statements`,
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
  audit: (name: string) => `${name}:audit`,
  /** A minute (`m`) or UTC day (`d`) from `startMs`: a hash, outcome -> count. */
  history: (name: string, unit: 'm' | 'd', startMs: number) => `${name}:hist:${unit}:${startMs}`,
} as const;

/** The plans' prices as they changed (a sorted set by when, in Redis time): what a period that ended is priced by (usage/closes.ts). */
export const pricesKey = (prefix: string) => `${prefix}:{prices}`;

/** The whole deployment's requests by outcome, as the accounts' `history` buckets, in one slot of their own. */
export const deploymentHistoryKey = (prefix: string, unit: 'm' | 'd', startMs: number) => `${prefix}:{history}:${unit}:${startMs}`;
/** The accounts' admitted requests in the UTC month from `monthStartMs` (a sorted set, by subject name): the operator's top accounts. */
export const deploymentTopKey = (prefix: string, monthStartMs: number) => `${prefix}:{history}:top:${monthStartMs}`;
/** The operator's standing reads (portal/standing.ts): accounts near a limit (a sorted set by when the last near window resets, and a hash of those windows) and each account's last balance (a hash) with their sum. */
export const deploymentStandingKeys = (prefix: string) => ({
  near: `${prefix}:{history}:near`,
  windows: `${prefix}:{history}:near:windows`,
  balances: `${prefix}:{history}:balances`,
  total: `${prefix}:{history}:outstanding`,
});

/** By the SHA-256 of their secret: Redis never holds one a reader could replay. */
export function portalKeys(prefix: string) {
  const base = `${prefix}:{portal}`;
  return {
    session: (digest: string) => `${base}:session:${digest}`,
    link: (digest: string) => `${base}:link:${digest}`,
  };
}

/** One slot: the registry's scripts touch several at once. */
export function registryKeys(prefix: string) {
  const base = `${prefix}:{keys}`;
  return {
    record: (digest: string) => `${base}:key:${digest}`,
    id: (id: string) => `${base}:id:${id}`,
    account: (account: string) => `${base}:account:${account}`,
    /** A sorted set, all scores 0: lexical order for listing. */
    ids: `${base}:ids`,
    /** Keys issued per plan, revoked included: what a reload removing a plan is checked against. */
    plans: `${base}:plans`,
    /** Rebuilt a page at a time (`~at`: the last id counted), renamed to `plans` once whole. */
    plansRecount: `${base}:plans:recount`,
    bloom: `${base}:bloom`,
    changed: `${base}:changed`,
  };
}
