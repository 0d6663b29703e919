import { readFileSync } from 'node:fs';
import type { Redis } from 'ioredis';
import type { FastifyBaseLogger } from 'fastify';
import { DAY_MS, type Decision, type Limits, MINUTE_MS, windowStart, windows } from './headers.js';

export interface BanPolicy {
  afterRejected: number;
  withinMs: number;
  durationMs: number;
}

/** Whose quota: a key or a client address. `key` is the Redis key base, with its hash tag. */
export interface QuotaSubject {
  key: string;
  limits: Limits;
  bans: BanPolicy | null;
}

/** A subject's counters as they stand, read without counting (for the admin usage lookup). */
export interface Usage {
  nowMs: number;
  minuteUsed: number;
  dayUsed: number;
  /** 0 when not banned. */
  banUntilMs: number;
  /** 429s within the ban window so far. */
  recentRejections: number;
}

/** The store behind one interface: one decision per request. */
export interface QuotaStore {
  consume(subject: QuotaSubject): Promise<Decision>;
  peek(subject: QuotaSubject): Promise<Usage>;
  /** True while decisions come from the in-process fallback because Redis failed. */
  readonly degraded: boolean;
  /** Bans this instance knows to be in force now. */
  activeBans(): number;
}

const OUTCOMES = ['allowed', 'minute', 'day', 'banned'] as const;

function toDecision(
  subject: QuotaSubject,
  [outcome, minuteUsed, dayUsed, nowMs, banUntilMs]: number[],
): Decision {
  const w = windows(subject.limits, nowMs!, minuteUsed!, dayUsed!);
  const o = OUTCOMES[outcome!];
  if (o === 'allowed') return { outcome: 'allowed', nowMs: nowMs!, windows: w };
  if (o === 'banned') return { outcome: 'banned', nowMs: nowMs!, banUntilMs: banUntilMs!, windows: w };
  return { outcome: 'rejected', violated: o === 'minute' ? 'minute' : 'day', nowMs: nowMs!, windows: w };
}

interface MemoryState {
  ms: number;
  mc: number;
  ds: number;
  dc: number;
  ban: number;
  rejections: number[];
}

/**
 * The in-process store: the same rules as quota.lua, step for step, on a Map. Used when no
 * REDIS_URL is set and as the fallback while Redis fails; its limits are per process.
 */
export class MemoryQuotaStore implements QuotaStore {
  readonly degraded = false;
  private readonly states = new Map<string, MemoryState>();
  private lastSweep = 0;

  constructor(private readonly clock: () => number = Date.now) {}

  async consume(subject: QuotaSubject): Promise<Decision> {
    return toDecision(subject, this.step(subject, this.clock()));
  }

  async peek({ key, bans }: QuotaSubject): Promise<Usage> {
    const now = this.clock();
    const s = this.states.get(key);
    if (!s) return { nowMs: now, minuteUsed: 0, dayUsed: 0, banUntilMs: 0, recentRejections: 0 };
    return {
      nowMs: now,
      minuteUsed: s.ms === windowStart(now, MINUTE_MS) ? s.mc : 0,
      dayUsed: s.ds === windowStart(now, DAY_MS) ? s.dc : 0,
      banUntilMs: s.ban > now ? s.ban : 0,
      recentRejections: bans ? s.rejections.filter((t) => t > now - bans.withinMs).length : 0,
    };
  }

  activeBans(): number {
    const now = this.clock();
    let n = 0;
    for (const s of this.states.values()) if (s.ban > now) n++;
    return n;
  }

  private step({ key, limits, bans }: QuotaSubject, now: number): number[] {
    this.sweep(now);
    const s = this.states.get(key) ?? { ms: 0, mc: 0, ds: 0, dc: 0, ban: 0, rejections: [] };
    this.states.set(key, s);
    if (s.ban > now) return [3, 0, 0, now, s.ban];
    const ms = windowStart(now, MINUTE_MS);
    const ds = windowStart(now, DAY_MS);
    const mc = s.ms === ms ? s.mc : 0;
    const dc = s.ds === ds ? s.dc : 0;
    const violated = limits.perDay > 0 && dc >= limits.perDay ? 2 : mc >= limits.perMinute ? 1 : 0;
    if (violated > 0) {
      if (bans) {
        s.rejections = [now, ...s.rejections.filter((t) => t > now - bans.withinMs)].slice(0, bans.afterRejected + 1);
        if (s.rejections.length > bans.afterRejected) {
          s.ban = now + bans.durationMs;
          s.rejections = [];
          return [3, mc, dc, now, s.ban];
        }
      }
      return [violated, mc, dc, now, 0];
    }
    Object.assign(s, { ms, mc: mc + 1, ds, dc: dc + 1 });
    return [0, mc + 1, dc + 1, now, 0];
  }

  /** Drops states whose windows and ban are over, at most once a minute. */
  private sweep(now: number): void {
    if (now - this.lastSweep < MINUTE_MS) return;
    this.lastSweep = now;
    const day = windowStart(now, DAY_MS);
    const minute = windowStart(now, MINUTE_MS);
    for (const [k, s] of this.states) if (s.ds < day && s.ms < minute && s.ban <= now) this.states.delete(k);
  }
}

const SCRIPT = readFileSync(new URL('./quota.lua', import.meta.url), 'utf8');
const RETRY_REDIS_AFTER_MS = 1000;

type QuotaRedis = Redis & {
  quota(k1: string, k2: string, ...args: number[]): Promise<number[]>;
};

/**
 * Redis: one EVALSHA of quota.lua per request. Bans already seen are answered from memory
 * without a round trip. When Redis fails, decisions come from the in-process fallback
 * (logged once, `degraded` set) and Redis is tried again after a second.
 */
export class RedisQuotaStore implements QuotaStore {
  private readonly redis: QuotaRedis;
  private readonly bans = new Map<string, number>();
  /** Redis time minus local time, from the last reply; turns local time into Redis time for cached bans. */
  private offsetMs = 0;
  private retryAt = 0;
  private readonly fallback = new MemoryQuotaStore();

  constructor(
    redis: Redis,
    private readonly log: FastifyBaseLogger,
    /** Told the duration of every script call, in seconds (the latency histogram). */
    private readonly observe: (seconds: number) => void = () => {},
  ) {
    redis.defineCommand('quota', { numberOfKeys: 2, lua: SCRIPT });
    this.redis = redis as QuotaRedis;
  }

  get degraded(): boolean {
    return this.retryAt !== 0;
  }

  async consume(subject: QuotaSubject): Promise<Decision> {
    const local = Date.now();
    const banUntil = this.bans.get(subject.key);
    if (banUntil !== undefined) {
      const now = local + this.offsetMs;
      if (banUntil > now) {
        return { outcome: 'banned', nowMs: now, banUntilMs: banUntil, windows: windows(subject.limits, now, 0, 0) };
      }
      this.bans.delete(subject.key);
    }
    if (this.retryAt > local) return this.fallback.consume(subject);
    const { limits, bans } = subject;
    let reply: number[];
    const started = performance.now();
    try {
      reply = await this.redis.quota(
        subject.key,
        `${subject.key}:rej`,
        limits.perMinute,
        limits.perDay,
        bans?.afterRejected ?? 0,
        bans?.withinMs ?? 0,
        bans?.durationMs ?? 0,
      );
    } catch (err) {
      this.failed(err, local);
      return this.fallback.consume(subject);
    } finally {
      this.observe((performance.now() - started) / 1000);
    }
    if (this.retryAt !== 0) {
      this.retryAt = 0;
      this.log.info('quota store: Redis answers again');
    }
    this.offsetMs = reply[3]! - local;
    if (reply[0] === 3) this.bans.set(subject.key, reply[4]!);
    return toDecision(subject, reply);
  }

  private failed(err: unknown, local: number): void {
    if (this.retryAt === 0) this.log.warn({ err }, 'quota store: Redis failed; limits are per process until it answers');
    this.retryAt = local + RETRY_REDIS_AFTER_MS;
  }

  /** One MULTI: Redis time, the counters and the recent 429s, read together. */
  async peek(subject: QuotaSubject): Promise<Usage> {
    let values: unknown[];
    try {
      const results = await this.redis
        .multi()
        .time()
        .hmget(subject.key, 'ms', 'mc', 'ds', 'dc', 'ban')
        .lrange(`${subject.key}:rej`, 0, -1)
        .exec();
      values = (results ?? []).map(([err, value]) => {
        if (err) throw err;
        return value;
      });
    } catch (err) {
      this.failed(err, Date.now());
      return this.fallback.peek(subject);
    }
    const [time, fields, rejections] = values as [[string, string], Array<string | null>, string[]];
    const now = Number(time[0]) * 1000 + Math.floor(Number(time[1]) / 1000);
    const [ms, mc, ds, dc, ban] = fields.map(Number) as [number, number, number, number, number];
    const withinMs = subject.bans?.withinMs ?? 0;
    return {
      nowMs: now,
      minuteUsed: ms === windowStart(now, MINUTE_MS) ? mc : 0,
      dayUsed: ds === windowStart(now, DAY_MS) ? dc : 0,
      banUntilMs: ban > now ? ban : 0,
      recentRejections: rejections.filter((t) => Number(t) > now - withinMs).length,
    };
  }

  activeBans(): number {
    const now = Date.now() + this.offsetMs;
    let n = 0;
    for (const until of this.bans.values()) if (until > now) n++;
    return n;
  }
}
