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

/** A subject's stored counters: window starts, admitted counts, ban end (the script's hash fields). */
interface Counters {
  ms: number;
  mc: number;
  ds: number;
  dc: number;
  ban: number;
}

/** Admitted counts of the windows current at `now`: a stored count of an older window is 0. */
function countsAt(c: Counters, now: number): { minuteUsed: number; dayUsed: number } {
  return {
    minuteUsed: c.ms === windowStart(now, MINUTE_MS) ? c.mc : 0,
    dayUsed: c.ds === windowStart(now, DAY_MS) ? c.dc : 0,
  };
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

interface MemoryState extends Counters {
  rejections: number[];
  /** When the state may be dropped: what PEXPIREAT / PEXPIRE give the script's keys. */
  expiresAt: number;
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
      ...countsAt(s, now),
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
    let s = this.states.get(key);
    if (!s) {
      s = { ms: 0, mc: 0, ds: 0, dc: 0, ban: 0, rejections: [], expiresAt: 0 };
      this.states.set(key, s);
    }
    const { minuteUsed: mc, dayUsed: dc } = countsAt(s, now);
    if (s.ban > now) return [3, mc, dc, now, s.ban];
    const ms = windowStart(now, MINUTE_MS);
    const ds = windowStart(now, DAY_MS);
    const expireAt = limits.perDay > 0 ? ds + DAY_MS : ms + MINUTE_MS;
    const violated = limits.perDay > 0 && dc >= limits.perDay ? 2 : mc >= limits.perMinute ? 1 : 0;
    if (violated > 0) {
      if (bans) {
        s.rejections = [now, ...s.rejections.filter((t) => t > now - bans.withinMs)].slice(0, bans.afterRejected + 1);
        s.expiresAt = Math.max(s.expiresAt, now + bans.withinMs);
        if (s.rejections.length > bans.afterRejected) {
          s.ban = now + bans.durationMs;
          s.rejections = [];
          s.expiresAt = Math.max(s.expiresAt, expireAt, s.ban);
          return [3, mc, dc, now, s.ban];
        }
      }
      return [violated, mc, dc, now, 0];
    }
    Object.assign(s, { ms, mc: mc + 1, ds, dc: dc + 1, expiresAt: Math.max(s.expiresAt, expireAt, s.ban) });
    return [0, mc + 1, dc + 1, now, 0];
  }

  /** Drops states whose windows, ban and recent 429s are all over, at most once a minute. */
  private sweep(now: number): void {
    if (now - this.lastSweep < MINUTE_MS) return;
    this.lastSweep = now;
    for (const [k, s] of this.states) if (s.expiresAt <= now) this.states.delete(k);
  }

  /** How many subjects it holds (for tests of the sweep). */
  get size(): number {
    return this.states.size;
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
  /** Bans seen in replies, with the counters they came with: answered without a round trip. */
  private readonly bans = new Map<string, Counters>();
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
    const known = this.bans.get(subject.key);
    if (known) {
      const now = local + this.offsetMs;
      if (known.ban > now) {
        const { minuteUsed, dayUsed } = countsAt(known, now);
        return { outcome: 'banned', nowMs: now, banUntilMs: known.ban, windows: windows(subject.limits, now, minuteUsed, dayUsed) };
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
    const [outcome, mc, dc, now, ban] = reply as [number, number, number, number, number];
    this.offsetMs = now - local;
    if (outcome === 3) {
      this.bans.set(subject.key, { ms: windowStart(now, MINUTE_MS), mc, ds: windowStart(now, DAY_MS), dc, ban });
    }
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
      ...countsAt({ ms, mc, ds, dc, ban }, now),
      banUntilMs: ban > now ? ban : 0,
      recentRejections: rejections.filter((t) => Number(t) > now - withinMs).length,
    };
  }

  activeBans(): number {
    const now = Date.now() + this.offsetMs;
    let n = 0;
    for (const { ban } of this.bans.values()) if (ban > now) n++;
    return n;
  }
}
