import { Cluster } from 'ioredis';
import { closeRedis, type RedisClient, secondConnection } from '../../redis/client.js';
import { subjectKey } from '../../redis/keys.js';
import { type CreditState, withGrants } from '../credits.js';
import { DAY_MS, type QuotaSubject, windowStart } from '../decision.js';
import { billingPeriod, type Period } from '../period.js';
import { defineTopUp, topUpArgs } from './script.js';
import {
  type ExportState,
  type LedgerEntry,
  type TopUp,
  type TopUpResult,
  TopUpNotReplicated,
  topUpFingerprint,
  type Usage,
} from '../store.js';
import { countsAt, FIXED } from '../windows.js';

// The account book in Redis: top-ups (acknowledged once enough replicas hold them), the ledger,
// the export's state and the usage read. None of it is on the request path; the store
// (store.ts) hands these calls here, and keeps the decisions.

/** A pipeline of topup.lua and the WAIT after it: both go to the account's node. */
interface TopUpPipeline {
  topup(...keysThenArgs: Array<string | number>): TopUpPipeline;
  wait(replicas: number, timeoutMs: number): TopUpPipeline;
  exec(): Promise<Array<[Error | null, unknown]> | null>;
}

/** A ledger stream entry as the admin port shows it: numbers as numbers, the time from its id. */
function ledgerEntry(id: string, fields: string[]): LedgerEntry {
  const f: Record<string, string> = {};
  for (let i = 0; i < fields.length; i += 2) f[fields[i]!] = fields[i + 1]!;
  const entry: LedgerEntry = {
    id,
    atMs: Number(id.split('-')[0]),
    kind: f.kind as LedgerEntry['kind'],
    amount: Number(f.amount),
    balance: Number(f.balance),
  };
  if (f.kind === 'grant') Object.assign(entry, { periods: Number(f.periods), expired: Number(f.expired) });
  else if (f.kind === 'topup') Object.assign(entry, { reason: f.reason, idempotencyKey: f.idempotencyKey });
  return entry;
}

/**
 * The billing part of a usage read, as the next decision will find it (the read changes
 * nothing): the month's period in force and its count, the overage, and the credits with the
 * grants due applied. `stored`: the counters' ps, pc, os, oc, pe; `credited`: g, p, gp, ge, r.
 */
function billingUsage(subject: QuotaSubject, now: number, stored: number[], credited: Array<string | null>): Partial<Usage> {
  const { limits, billing } = subject;
  const [ps, pc, os, oc, pe] = stored as [number, number, number, number, number];
  const out: Partial<Usage> = {};
  let period: Period | undefined;
  if (limits.perMonth) {
    // As quota.lua: the stored period stays in force until its end.
    period = ps <= now && now < pe ? { startMs: ps, endMs: pe } : billingPeriod(now, billing.billingDay);
    out.monthUsed = ps === period.startMs ? pc : 0;
  }
  if (billing.credits) {
    const [g, p, gp, ge, r] = credited;
    const state: CreditState = { granted: Number(g ?? 0), purchased: Number(p ?? 0) };
    if (gp != null && ge != null) Object.assign(state, { grantedFor: Number(gp), grantedUntil: Number(ge) });
    const due = withGrants(state, billingPeriod(now, billing.billingDay), billing.credits, now);
    out.credits = { granted: due.state.granted, purchased: due.state.purchased, reserved: Number(r ?? 0) };
    period ??= due.inForce;
  }
  if (period) out.period = period;
  if (billing.overage > 0) out.overageUsed = os === (limits.perMonth ? period!.startMs : windowStart(now, DAY_MS)) ? oc : 0;
  return out;
}

/** Slots in flight (`slots`: ZRANGE WITHSCORES, expiries on Redis's clock) and burst tokens left (`tat`), as quota.lua finds them. */
function shortUsage(subject: QuotaSubject, now: number, slots: string[], tat: string | null): Partial<Usage> {
  const { concurrent, burst } = subject.short!;
  const out: Partial<Usage> = {};
  if (concurrent) {
    let n = 0;
    for (let i = 1; i < slots.length; i += 2) if (Number(slots[i]) > now) n++;
    out.inFlight = n;
  }
  if (burst) {
    const interval = 1000 / burst.perSecond;
    const backlog = Math.max(0, Number(tat ?? now) - now);
    out.burstLeft = Math.min(burst.size, Math.floor((burst.size * interval - backlog) / interval + 1e-9));
  }
  return out;
}

/** The fixed windows' fields of the counters hash (windows.ts): each one's start and count. */
const COUNTER_FIELDS = FIXED.flatMap((w) => [w.stored.start, w.stored.count]);

export interface AccountsOptions {
  /** CREDITS_ACK_REPLICAS: a top-up is acknowledged once this many replicas hold it (0: at once). */
  ackReplicas: number;
  /** CREDITS_ACK_TIMEOUT_MS: how long a top-up waits for them. */
  ackTimeoutMs: number;
  /** IDEMPOTENCY_KEY_HOURS, in ms: how long a top-up's idempotency key is remembered. */
  idempotencyMs: number;
}

export class RedisAccounts {
  /** The connection top-ups wait for replicas on (WAIT holds it): made at the first top-up. */
  private acking?: RedisClient;

  constructor(
    private readonly redis: RedisClient,
    private readonly options: AccountsOptions,
    /** A top-up's calls are over: its ledger entry went to the usage stream, its alert resolved (or maybe): mark them. */
    private readonly written: (subject: QuotaSubject) => void,
  ) {}

  /**
   * A top-up in one script (topup.lua): applied once per idempotency key, however the retries
   * race; then, with `ackReplicas`, WAIT on the same connection until that many replicas hold it
   * (a retry waits again), so an acknowledged top-up survives a failover.
   */
  async topUp(subject: QuotaSubject, t: TopUp): Promise<TopUpResult> {
    const redis = this.topUpConnection();
    let results: Array<[Error | null, unknown]>;
    try {
      results = await this.topUpCalls(redis, subject, t);
    } catch (err) {
      // A Cluster pipeline follows no redirection: after a failover, learn the new masters once and
      // send it again (applied once: its idempotency key).
      if (!(redis instanceof Cluster && /^MOVED /.test((err as Error).message))) throw err;
      await new Promise((done) => redis.refreshSlotsCache(done));
      results = await this.topUpCalls(redis, subject, t);
    } finally {
      // Its ledger entry as a usage event, a credits alert it resolves: written (or maybe), marked once the calls are over.
      this.written(subject);
    }
    const [made, ...rest] = results[0]![1] as [number, ...string[]];
    const acked = Number(results[1]?.[1] ?? 0);
    if (this.options.ackReplicas > 0 && acked < this.options.ackReplicas) throw new TopUpNotReplicated(acked, this.options.ackReplicas);
    if (Number(made) === 1) return { entryId: String(rest[0]), balance: Number(rest[1]), replayed: false, conflict: false };
    const [first, entryId, balance] = String(rest[0]).split(' ') as [string, string, string];
    return { entryId, balance: Number(balance), replayed: true, conflict: first !== topUpFingerprint(t) };
  }

  /** topup.lua, then WAIT with `ackReplicas`, in one pipeline: both reach the account's node, WAIT on the connection that wrote. */
  private async topUpCalls(redis: RedisClient, subject: QuotaSubject, t: TopUp): Promise<Array<[Error | null, unknown]>> {
    const pipe = (redis.pipeline() as unknown as TopUpPipeline).topup(...topUpArgs(subject, t, this.options.idempotencyMs));
    if (this.options.ackReplicas > 0) pipe.wait(this.options.ackReplicas, this.options.ackTimeoutMs);
    const results = (await pipe.exec()) ?? [];
    for (const [err] of results) if (err) throw err;
    return results;
  }

  /** Where top-ups go: the store's connection, or with `ackReplicas` one of their own (WAIT holds the connection it is sent on). */
  private topUpConnection(): RedisClient {
    if (this.options.ackReplicas === 0) return this.redis;
    if (!this.acking) {
      this.acking = secondConnection(this.redis);
      defineTopUp(this.acking);
    }
    return this.acking;
  }

  /**
   * Events sent (consumed by the exporter), still waiting, and dropped by the caps, in the
   * stream and the bundles both (as counted when the exporter saw the stream near its cap; the
   * bundles' as they were dropped), read in one transaction (one slot): the exporter's move
   * counts and trims in one script, so they always add up. And the units leased and not yet
   * written as events (quota.lua adds a lease's units, usagebatch.lua and a lease's close take
   * theirs out): held by live instances, or lost with a dead one.
   */
  async exportState(subject: QuotaSubject): Promise<ExportState> {
    const fields = ['consumed', 'dropped', 'unsettled', 'bconsumed', 'bdropped', 'badded', 'bupto'] as const;
    const results = await this.redis
      .multi()
      .xlen(subjectKey.events(subject.name))
      .hmget(subjectKey.eventsCursor(subject.name), ...fields)
      .hlen(subjectKey.eventsRejected(subject.name))
      .exec();
    const [length, values, rejected] = (results ?? []).map(([err, value]) => {
      if (err) throw err;
      return value;
    }) as [number, Array<string | null>, number];
    const c = Object.fromEntries(fields.map((f, i) => [f, Number(values[i] ?? 0)])) as Record<(typeof fields)[number], number>;
    return {
      // The cursor moved past a rejected event as past a sent one.
      exported: c.consumed + c.bconsumed - rejected,
      pending: length + c.badded - c.bupto,
      dropped: c.dropped + c.bdropped,
      rejected,
      unsettled: c.unsettled,
    };
  }

  /** The ledger stream, oldest first. */
  async ledger(subject: QuotaSubject): Promise<LedgerEntry[]> {
    const entries = await this.redis.xrange(subjectKey.ledger(subject.name), '-', '+');
    return entries.map(([id, fields]) => ledgerEntry(id, fields));
  }

  /** One MULTI: Redis time, the counters, the recent 429s and the credits, read together. */
  async read(subject: QuotaSubject): Promise<Usage> {
    const multi = this.redis
      .multi()
      .time()
      .hmget(subjectKey.counters(subject.name), ...COUNTER_FIELDS, 'ban', 'ps', 'pc', 'os', 'oc', 'pe')
      .lrange(subjectKey.rejections(subject.name), 0, -1)
      .hmget(subjectKey.credits(subject.name), 'g', 'p', 'gp', 'ge', 'r');
    // The slots' expiries (at most the limit, and those expired not yet swept) and the burst's TAT.
    if (subject.short) multi.zrange(subjectKey.slots(subject.name), 0, -1, 'WITHSCORES').get(subjectKey.burst(subject.name));
    const results = await multi.exec();
    const values = (results ?? []).map(([err, value]) => {
      if (err) throw err;
      return value;
    });
    const [time, fields, rejections, credited, slots, tat] = values as [
      [string, string],
      Array<string | null>,
      string[],
      Array<string | null>,
      string[] | undefined,
      string | null | undefined,
    ];
    const now = Number(time[0]) * 1000 + Math.floor(Number(time[1]) / 1000);
    const numbers = fields.map(Number);
    const stored = Object.fromEntries(COUNTER_FIELDS.map((f, i) => [f, numbers[i]!]));
    const [ban, ...billed] = numbers.slice(COUNTER_FIELDS.length) as [number, ...number[]];
    const withinMs = subject.bans?.withinMs ?? 0;
    const usage: Usage = {
      nowMs: now,
      ...countsAt(stored, now),
      banUntilMs: ban > now ? ban : 0,
      recentRejections: rejections.filter((t) => Number(t) > now - withinMs).length,
    };
    if (subject.short) Object.assign(usage, shortUsage(subject, now, slots ?? [], tat ?? null));
    return { ...usage, ...billingUsage(subject, now, billed, credited) };
  }

  close(): void {
    if (this.acking) void closeRedis(this.acking, 'now');
  }
}
