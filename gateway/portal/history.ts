import type { FastifyBaseLogger } from 'fastify';
import type { AccessEntry } from '../observability/access-log.js';
import type { Decision } from '../quota/decision.js';
import { isWindow } from '../quota/windows.js';
import type { RedisClient } from '../redis/client.js';
import { DOCUMENT_ROUTE, PORTAL_ROUTE, type RouteId, STATEMENT_ROUTE, USAGE_ROUTE } from '../routes.js';
import { deploymentHistoryKey, deploymentTopKey, subjectKey } from '../redis/keys.js';
import { defineStandingScripts, writeStanding } from './standing.js';

// Requests over time by outcome, per account: counted in memory from what the access line
// already knows (no Redis call per request) and flushed once a second, one pipeline for each
// account active in that second (HINCRBY on its minute's and its day's bucket hash, EXPIRE), and
// one more for the deployment's sum of them (what the operator page charts), the month's
// ranking of accounts by admitted requests (its top accounts) and each active account's
// standing from its last decision (standing.ts), so the cost follows traffic and nothing ever
// scans the accounts.

/** The outcomes a chart stacks, in its order: what a bucket's hash fields are named. */
export const OUTCOME_FIELDS = [
  'admitted',
  'limited_minute',
  'limited_hour',
  'limited_day',
  'limited_month',
  'limited_banned',
  'credits',
  'refunded_502',
  'refunded_504',
] as const;
export type OutcomeField = (typeof OUTCOME_FIELDS)[number];

export const MINUTE_MS = 60_000;
export const DAY_MS = 86_400_000;
/** Minute buckets are kept 48 h, day buckets 400 days (a year and its month of comparison). */
const KEEP_S = { m: 48 * 3600, d: 400 * 86_400, top: 62 * 86_400 } as const;

/** The UTC calendar month's first instant: what the top accounts are ranked over. */
export const monthStart = (ms: number) => {
  const d = new Date(ms);
  return Date.UTC(d.getUTCFullYear(), d.getUTCMonth(), 1);
};

/**
 * The gateway's own routes: a key's usage and statement, the document, the portal. They are
 * answered on the per-address quota, never the key's: not its account's requests, and their
 * decision (the address's windows) says nothing of the account's standing.
 */
const OWN_ROUTES: ReadonlySet<RouteId | undefined> = new Set([USAGE_ROUTE.id, STATEMENT_ROUTE.id, DOCUMENT_ROUTE.id, PORTAL_ROUTE.id]);

/** The bucket field a request's answer counts in, or none (no key, the key's own routes, or refused for another reason). */
export function outcomeField(e: AccessEntry): OutcomeField | undefined {
  const { outcome, status } = e;
  if (!e.consumer || outcome === undefined || OWN_ROUTES.has(e.route)) return undefined;
  if (outcome === 'allowed' || outcome.startsWith('would_')) {
    // The proxy gave a 502/504 back to the windows and credits: shown apart, not billed.
    if (status === 502) return 'refunded_502';
    if (status === 504) return 'refunded_504';
    return 'admitted';
  }
  if (status === 429 && (isWindow(outcome) || outcome === 'banned')) return `limited_${outcome}` as OutcomeField;
  if (status === 402 && outcome === 'credits') return 'credits';
  return undefined;
}

export type Buckets = Array<{ startMs: number; counts: Partial<Record<OutcomeField, number>> }>;

/** Where a unit's bucket starting at a time lives: an account's, or the deployment's. */
export type BucketKey = (unit: 'm' | 'd', startMs: number) => string;
export const accountBuckets =
  (subjectName: string): BucketKey =>
  (unit, startMs) =>
    subjectKey.history(subjectName, unit, startMs);
export const deploymentBuckets =
  (prefix: string): BucketKey =>
  (unit, startMs) =>
    deploymentHistoryKey(prefix, unit, startMs);
type Counted = Map<number, Map<OutcomeField, number>>;

export class OutcomeHistory {
  /** subject name -> minute start -> field -> count, since the last flush. */
  private pending = new Map<string, Counted>();
  /** subject name -> its last decision since the last flush: its standing (standing.ts). */
  private last = new Map<string, Decision>();
  private readonly timer: NodeJS.Timeout;

  constructor(
    private readonly redis: RedisClient,
    /** The deployment's Redis prefix (the config's `redisPrefix`), read per flush: a reload may change it. */
    private readonly prefix: () => string,
    private readonly log: FastifyBaseLogger,
    private readonly now: () => number = Date.now,
  ) {
    this.timer = setInterval(() => void this.flush(), 1000);
    this.timer.unref();
    defineStandingScripts(redis);
  }

  /** Counts one answered request: a few map updates, no I/O. */
  count(e: AccessEntry): void {
    const field = outcomeField(e);
    if (!field) return;
    const now = this.now();
    const minute = now - (now % MINUTE_MS);
    const name = e.consumer!.subject.name;
    let byMinute = this.pending.get(name);
    if (!byMinute) this.pending.set(name, (byMinute = new Map()));
    let fields = byMinute.get(minute);
    if (!fields) byMinute.set(minute, (fields = new Map()));
    fields.set(field, (fields.get(field) ?? 0) + 1);
    if (e.decision) this.last.set(name, e.decision);
  }

  /**
   * Writes what was counted since the last flush: one pipeline per active account (its keys
   * share its slot, so a Cluster takes it whole) and one for the deployment's sum, all sent at
   * once. A flush Redis refuses is dropped (history is for reading, never billing) and logged.
   */
  async flush(): Promise<void> {
    if (this.pending.size === 0) return;
    const batch = this.pending;
    const last = this.last;
    this.pending = new Map();
    this.last = new Map();
    const sum: Counted = new Map();
    for (const byMinute of batch.values()) {
      for (const [minute, fields] of byMinute) {
        let into = sum.get(minute);
        if (!into) sum.set(minute, (into = new Map()));
        for (const [field, n] of fields) into.set(field, (into.get(field) ?? 0) + n);
      }
    }
    const writes = [...batch].map(([name, byMinute]) => this.write(accountBuckets(name), byMinute));
    writes.push(this.write(deploymentBuckets(this.prefix()), sum), this.rank(batch), this.standing(last));
    await Promise.all(writes);
  }

  /** Each active account's admitted requests added to the month's ranking: one ZINCRBY an account a second. */
  private async rank(batch: ReadonlyMap<string, Counted>): Promise<void> {
    const key = deploymentTopKey(this.prefix(), monthStart(this.now()));
    const pipeline = this.redis.pipeline();
    for (const [name, byMinute] of batch) {
      let admitted = 0;
      for (const fields of byMinute.values()) admitted += fields.get('admitted') ?? 0;
      if (admitted > 0) pipeline.zincrby(key, admitted, name);
    }
    if (pipeline.length === 0) return;
    pipeline.expire(key, KEEP_S.top);
    await pipeline
      .exec()
      .catch((err: Error) => this.log.warn({ cause: err.message }, 'portal history: a second of rankings was not written'));
  }

  /** Each active account's standing from its last decision: near a limit or not, and its balance. */
  private async standing(last: ReadonlyMap<string, Decision>): Promise<void> {
    if (last.size === 0) return;
    await writeStanding(this.redis, this.prefix(), last, this.now()).catch((err: Error) =>
      this.log.warn({ cause: err.message }, 'portal history: a second of standings was not written'),
    );
  }

  private async write(key: BucketKey, byMinute: Counted): Promise<void> {
    const pipeline = this.redis.pipeline();
    for (const [minute, fields] of byMinute) {
      const buckets = [
        [key('m', minute), KEEP_S.m],
        [key('d', minute - (minute % DAY_MS)), KEEP_S.d],
      ] as const;
      for (const [bucket, keep] of buckets) {
        for (const [field, n] of fields) pipeline.hincrby(bucket, field, n);
        pipeline.expire(bucket, keep);
      }
    }
    await pipeline
      .exec()
      .catch((err: Error) => this.log.warn({ cause: err.message }, 'portal history: a second of counts was not written'));
  }

  async close(): Promise<void> {
    clearInterval(this.timer);
    await this.flush();
  }
}

/** The last `n` buckets of `unit` up to `nowMs`, oldest first: an account's or the deployment's. */
export async function readBuckets(redis: RedisClient, key: BucketKey, unit: 'm' | 'd', n: number, nowMs: number): Promise<Buckets> {
  const size = unit === 'm' ? MINUTE_MS : DAY_MS;
  const last = nowMs - (nowMs % size);
  const starts = Array.from({ length: n }, (_, i) => last - (n - 1 - i) * size);
  const pipeline = redis.pipeline();
  for (const start of starts) pipeline.hgetall(key(unit, start));
  const replies = (await pipeline.exec()) ?? [];
  return starts.map((startMs, i) => {
    const [err, hash] = replies[i] ?? [new Error('no reply'), null];
    if (err) throw err;
    const counts: Buckets[number]['counts'] = {};
    for (const [field, value] of Object.entries((hash ?? {}) as Record<string, string>)) counts[field as OutcomeField] = Number(value);
    return { startMs, counts };
  });
}
