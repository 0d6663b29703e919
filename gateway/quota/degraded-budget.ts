import { LRUCache } from 'lru-cache';
import { DAY_MS, degradedShare, MINUTE_MS, periodOf, type QuotaSubject, type WindowCounts, windowStart } from './decision.js';
import type { Period } from './period.js';
import { type Counters, countsAt, QuotaStoreUnavailable } from './store.js';

/** Units admitted while Redis failed and not yet written back, for one subject and window pair. */
export interface WriteBack {
  name: string;
  /** Unique per instance and batch: Redis applies each write-back once, however often it is sent. */
  id: string;
  minuteStart: number;
  minuteUnits: number;
  dayStart: number;
  dayUnits: number;
  hasDay: boolean;
  /** The billing period (a subject with a month window), its end, and the units admitted in it, days of the outage before this one included; 0: none. */
  periodStart: number;
  periodEnd: number;
  periodUnits: number;
}

/** What a subject spent of its degraded budget in the current windows, and how much of it is written back. */
interface Spent {
  minuteStart: number;
  minuteCount: number;
  dayStart: number;
  dayCount: number;
  minuteWritten: number;
  dayWritten: number;
  hasDay: boolean;
  periodStart: number;
  periodEnd: number;
  /** Units this instance admitted from the budget in the billing period (not reset with the day), and written back. */
  periodCount: number;
  periodWritten: number;
}

/**
 * Subjects whose last counters are kept (about 200 B each: 20 MB at most), least recently used
 * out. Each source address is a subject, and a client has as many addresses as it likes (IPv6):
 * unbounded, they were kept until the day's end. One forgotten while Redis fails is decided as a
 * subject never seen: its share of the whole window.
 */
export const SEEN_MAX = 100_000;

/** Redis's last counters of a subject, with its billing period's count (a subject with a month window). */
interface Seen extends Counters {
  periodStart: number;
  periodEnd: number;
  monthCount: number;
}

/**
 * The degraded budget: while Redis is declared failing, an instance admits in each window at
 * most its share (degradedShare) of what it last knew was left: the window's limit less the
 * count in Redis's last reply for that subject (0 once the window has changed), divided among
 * the live instances Redis knew of at the last heartbeat. Instances that knew the same count
 * admit at most what was left, together; a window that starts during the failure admits at
 * most its limit. What was admitted is written back to Redis when it answers again.
 */
export class DegradedBudget {
  /** Per subject, the counters of Redis's last reply: what was left when Redis failed. */
  private readonly seen = new LRUCache<string, Seen>({ max: SEEN_MAX });
  private readonly spent = new Map<string, Spent>();
  private fleet = { instances: 1, rank: 0 };
  private batch = 0;
  /** Write-backs made and not yet confirmed by Redis: sent again, with the same id, until they are. */
  private readonly unconfirmed = new Map<string, WriteBack>();
  private lastSweep = 0;

  constructor(private readonly instanceId: string) {}

  /** The live instances and this one's rank among them, from the last heartbeat. */
  setFleet(instances: number, rank: number): void {
    this.fleet = { instances, rank };
  }

  get instances(): number {
    return this.fleet.instances;
  }

  /** Subjects whose last counters are kept (SEEN_MAX at most). */
  get seenSubjects(): number {
    return this.seen.size;
  }

  /** A reply's counts: the latest Redis knows. A subject whose budget is all written back starts afresh. */
  see(name: string, { nowMs, minuteUsed, dayUsed, monthUsed, period }: WindowCounts): void {
    this.seen.set(name, {
      minuteStart: windowStart(nowMs, MINUTE_MS),
      minuteCount: minuteUsed,
      dayStart: windowStart(nowMs, DAY_MS),
      dayCount: dayUsed,
      ban: 0,
      periodStart: period?.startMs ?? 0,
      periodEnd: period?.endMs ?? 0,
      monthCount: monthUsed ?? 0,
    });
    const s = this.spent.get(name);
    if (s && s.minuteCount === s.minuteWritten && s.dayCount === s.dayWritten && s.periodCount === s.periodWritten) this.spent.delete(name);
    this.sweep(nowMs);
  }

  /** One decision from the budget at Redis time `nowMs` (as this instance knows it). */
  consume(subject: QuotaSubject, cost: number, nowMs: number): WindowCounts {
    const { name, limits } = subject;
    const period = limits.perMonth ? periodOf(subject, nowMs) : undefined;
    const known = this.seen.get(name);
    // A month this instance has no count of (it never heard from Redis in this period) could be
    // used up already: nothing is admitted from it without Redis.
    if (period && known?.periodStart !== period.startMs) throw new QuotaStoreUnavailable();
    const s = this.current(name, nowMs, limits.perDay > 0, period);
    const { minuteUsed: knownM, dayUsed: knownD } = known ? countsAt(known, nowMs) : { minuteUsed: 0, dayUsed: 0 };
    const { instances, rank } = this.fleet;
    const shareM = degradedShare(limits.perMinute - knownM, instances, rank);
    const shareD = limits.perDay > 0 ? degradedShare(limits.perDay - knownD, instances, rank) : Number.POSITIVE_INFINITY;
    // The period's share is of what it had left when Redis last answered, for the whole outage, midnights included.
    const shareP = period ? degradedShare(limits.perMonth! - known!.monthCount, instances, rank) : Number.POSITIVE_INFINITY;
    // Reported as used: all but this instance's share, then what it admitted of it.
    const minuteUsed = limits.perMinute - shareM + s.minuteCount;
    const dayUsed = limits.perDay > 0 ? limits.perDay - shareD + s.dayCount : 0;
    const violated =
      s.periodCount + cost > shareP ? 'month' : s.dayCount + cost > shareD ? 'day' : s.minuteCount + cost > shareM ? 'minute' : undefined;
    if (violated) return { outcome: violated, minuteUsed, dayUsed, nowMs, banUntilMs: 0 };
    s.minuteCount += cost;
    s.dayCount += cost;
    s.periodCount += cost;
    return { outcome: 'allowed', minuteUsed: minuteUsed + cost, dayUsed: limits.perDay > 0 ? dayUsed + cost : 0, nowMs, banUntilMs: 0 };
  }

  /** A refund of a request admitted from the budget, if its windows are current (what is written back stays). */
  refund(name: string, countedAtMs: number, cost: number): void {
    const s = this.spent.get(name);
    if (!s) return;
    if (s.minuteStart === windowStart(countedAtMs, MINUTE_MS)) s.minuteCount = Math.max(s.minuteWritten, s.minuteCount - cost);
    if (s.dayStart === windowStart(countedAtMs, DAY_MS)) s.dayCount = Math.max(s.dayWritten, s.dayCount - cost);
  }

  /** The counts as this instance sees them while Redis fails: Redis's last, plus its own admissions. */
  usage(name: string, nowMs: number): { minuteUsed: number; dayUsed: number } {
    const known = this.seen.get(name);
    const k = known ? countsAt(known, nowMs) : { minuteUsed: 0, dayUsed: 0 };
    const s = this.spent.get(name);
    const own = s ? countsAt(s, nowMs) : { minuteUsed: 0, dayUsed: 0 };
    return { minuteUsed: k.minuteUsed + own.minuteUsed, dayUsed: k.dayUsed + own.dayUsed };
  }

  /** What is to be written back: new admissions as a new batch, and every earlier batch Redis has not confirmed. */
  drain(): WriteBack[] {
    const id = `${this.instanceId}:${++this.batch}`;
    for (const [name, s] of this.spent) {
      const minuteUnits = s.minuteCount - s.minuteWritten;
      const dayUnits = s.dayCount - s.dayWritten;
      const periodUnits = s.periodCount - s.periodWritten;
      if (minuteUnits === 0 && dayUnits === 0 && periodUnits === 0) continue;
      this.unconfirmed.set(`${id}:${name}`, {
        name,
        id,
        minuteStart: s.minuteStart,
        minuteUnits,
        dayStart: s.dayStart,
        dayUnits,
        hasDay: s.hasDay,
        periodStart: s.periodStart,
        periodEnd: s.periodEnd,
        periodUnits,
      });
      s.minuteWritten = s.minuteCount;
      s.dayWritten = s.dayCount;
      s.periodWritten = s.periodCount;
    }
    return [...this.unconfirmed.values()];
  }

  /** Redis applied this write-back (or had already). */
  confirmed(w: WriteBack): void {
    this.unconfirmed.delete(`${w.id}:${w.name}`);
  }

  /** The subject's spending in the windows current at `nowMs`. */
  private current(name: string, nowMs: number, hasDay: boolean, period: Period | undefined): Spent {
    const minuteStart = windowStart(nowMs, MINUTE_MS);
    const dayStart = windowStart(nowMs, DAY_MS);
    const [periodStart, periodEnd] = period ? [period.startMs, period.endMs] : [0, 0];
    let s = this.spent.get(name);
    if (!s) {
      s = {
        minuteStart,
        minuteCount: 0,
        dayStart,
        dayCount: 0,
        minuteWritten: 0,
        dayWritten: 0,
        hasDay,
        periodStart,
        periodEnd,
        periodCount: 0,
        periodWritten: 0,
      };
      this.spent.set(name, s);
    }
    if (s.minuteStart !== minuteStart) Object.assign(s, { minuteStart, minuteCount: 0, minuteWritten: 0 });
    if (s.dayStart !== dayStart) Object.assign(s, { dayStart, dayCount: 0, dayWritten: 0 });
    if (s.periodStart !== periodStart) Object.assign(s, { periodStart, periodEnd, periodCount: 0, periodWritten: 0 });
    return s;
  }

  /** Forgets, at most once a minute, what belongs to an earlier day. */
  private sweep(nowMs: number): void {
    if (nowMs - this.lastSweep < MINUTE_MS) return;
    this.lastSweep = nowMs;
    const today = windowStart(nowMs, DAY_MS);
    // A subject's last month count is kept until its period ends: the degraded budget needs it all period.
    const stale = [...this.seen.entries()].filter(([, c]) => c.dayStart < today && c.periodEnd <= nowMs);
    for (const [name] of stale) this.seen.delete(name);
    for (const [name, s] of this.spent)
      if (s.dayStart < today && s.minuteCount === s.minuteWritten && s.dayCount === s.dayWritten && s.periodCount === s.periodWritten)
        this.spent.delete(name);
  }
}
