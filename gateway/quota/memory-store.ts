import { DAY_MS, type Decision, decision, MINUTE_MS, type QuotaSubject, type WindowCounts, windowStart } from './decision.js';
import { type Counters, countsAt, type QuotaStore, type Usage } from './store.js';

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

  async consume(subject: QuotaSubject, cost = 1): Promise<Decision> {
    return decision(subject.limits, this.step(subject, this.clock(), cost));
  }

  async peek({ name, bans }: QuotaSubject): Promise<Usage> {
    const now = this.clock();
    const s = this.states.get(name);
    if (!s) return { nowMs: now, minuteUsed: 0, dayUsed: 0, banUntilMs: 0, recentRejections: 0 };
    return {
      nowMs: now,
      ...countsAt(s, now),
      banUntilMs: s.ban > now ? s.ban : 0,
      recentRejections: bans ? s.rejections.filter((t) => t > now - bans.withinMs).length : 0,
    };
  }

  async refund({ name }: QuotaSubject, countedAtMs: number, cost = 1): Promise<void> {
    const s = this.states.get(name);
    if (!s) return;
    if (s.minuteStart === windowStart(countedAtMs, MINUTE_MS)) s.minuteCount = Math.max(0, s.minuteCount - cost);
    if (s.dayStart === windowStart(countedAtMs, DAY_MS)) s.dayCount = Math.max(0, s.dayCount - cost);
  }

  async unban({ name }: QuotaSubject): Promise<boolean> {
    const s = this.states.get(name);
    if (!s) return false;
    const lifted = s.ban > this.clock();
    s.ban = 0;
    s.rejections = [];
    return lifted;
  }

  activeBans(): number {
    const now = this.clock();
    let n = 0;
    for (const s of this.states.values()) if (s.ban > now) n++;
    return n;
  }

  private step({ name, limits, bans }: QuotaSubject, now: number, cost: number): WindowCounts {
    this.sweep(now);
    let s = this.states.get(name);
    if (!s) {
      s = { minuteStart: 0, minuteCount: 0, dayStart: 0, dayCount: 0, ban: 0, rejections: [], expiresAt: 0 };
      this.states.set(name, s);
    }
    const { minuteUsed, dayUsed } = countsAt(s, now);
    const refused = (outcome: WindowCounts['outcome'], banUntilMs = 0): WindowCounts => ({
      outcome,
      minuteUsed,
      dayUsed,
      nowMs: now,
      banUntilMs,
    });
    if (s.ban > now) return refused('banned', s.ban);
    const minuteStart = windowStart(now, MINUTE_MS);
    const dayStart = windowStart(now, DAY_MS);
    const expireAt = limits.perDay > 0 ? dayStart + DAY_MS : minuteStart + MINUTE_MS;
    const violated =
      limits.perDay > 0 && dayUsed + cost > limits.perDay ? 'day' : minuteUsed + cost > limits.perMinute ? 'minute' : undefined;
    if (violated) {
      if (bans) {
        s.rejections = [now, ...s.rejections.filter((t) => t > now - bans.withinMs)].slice(0, bans.afterRejected + 1);
        s.expiresAt = Math.max(s.expiresAt, now + bans.withinMs);
        if (s.rejections.length > bans.afterRejected) {
          s.ban = now + bans.durationMs;
          s.rejections = [];
          s.expiresAt = Math.max(s.expiresAt, expireAt, s.ban);
          return refused('banned', s.ban);
        }
      }
      return refused(violated);
    }
    Object.assign(s, {
      minuteStart,
      minuteCount: minuteUsed + cost,
      dayStart,
      dayCount: dayUsed + cost,
      expiresAt: Math.max(s.expiresAt, expireAt, s.ban),
    });
    return { outcome: 'allowed', minuteUsed: minuteUsed + cost, dayUsed: dayUsed + cost, nowMs: now, banUntilMs: 0 };
  }

  /** Drops states whose windows, ban and recent 429s are all over, at most once a minute. */
  private sweep(now: number): void {
    if (now - this.lastSweep < MINUTE_MS) return;
    this.lastSweep = now;
    for (const [k, s] of this.states) if (s.expiresAt <= now) this.states.delete(k);
  }
}
