import { LRUCache } from 'lru-cache';
import { DAY_MS, degradedShare, MINUTE_MS, periodOf, type QuotaSubject, type WindowCounts, windowStart } from '../decision.js';
import type { Period } from '../period.js';
import { QuotaStoreUnavailable } from '../store.js';
import { type Counts, countsAt, FIXED, type Stored, storedAt, type WindowName, windowRow } from '../windows.js';

/** Units admitted while Redis failed and not yet written back, for one subject: per fixed window (windows.ts), its start and units. */
export interface WriteBack {
  name: string;
  /** Unique per instance and batch: Redis applies each write-back once, however often it is sent. */
  id: string;
  starts: Partial<Record<WindowName, number>>;
  units: Partial<Record<WindowName, number>>;
  /** The longest fixed window the subject has (ms): the counters last until its end. */
  longestMs: number;
  /** The billing period (a subject with a month window), its end, and the units admitted in it, days of the outage before this one included; 0: none. */
  periodStart: number;
  periodEnd: number;
  periodUnits: number;
}

/** What a subject spent of its degraded budget in the current fixed windows, and how much of it is written back. */
interface Spent {
  start: Partial<Record<WindowName, number>>;
  count: Partial<Record<WindowName, number>>;
  written: Partial<Record<WindowName, number>>;
  longestMs: number;
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
interface Seen {
  stored: Stored;
  periodStart: number;
  periodEnd: number;
  monthCount: number;
}

/** The stored name of the day's start: what a last count is forgotten by. */
const DAY_START = windowRow('day').stored.start;

/** Whether a subject's spending is all written back. */
const settled = (s: Spent) => s.periodCount === s.periodWritten && FIXED.every((w) => s.count[w.name] === s.written[w.name]);

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
  see(name: string, counts: WindowCounts): void {
    const { nowMs, monthUsed, period } = counts;
    this.seen.set(name, {
      stored: storedAt(counts, nowMs),
      periodStart: period?.startMs ?? 0,
      periodEnd: period?.endMs ?? 0,
      monthCount: monthUsed ?? 0,
    });
    const s = this.spent.get(name);
    if (s && settled(s)) this.spent.delete(name);
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
    const s = this.current(subject, nowMs, period);
    const knownUsed: Counts = known ? countsAt(known.stored, nowMs) : { minuteUsed: 0, dayUsed: 0 };
    const { instances, rank } = this.fleet;
    // Reported as used: all but this instance's share, then what it admitted of it; the longest window violated is reported.
    const counts = { minuteUsed: 0, dayUsed: 0 } as Counts;
    let violated: WindowCounts['outcome'] | undefined;
    for (const w of FIXED) {
      const limit = limits[w.limit] ?? 0;
      if (!w.always && limit <= 0) continue;
      const share = degradedShare(limit - (knownUsed[w.used] ?? 0), instances, rank);
      const own = s.count[w.name] ?? 0;
      counts[w.used] = limit - share + own;
      if (own + cost > share) violated = w.name;
    }
    // The period's share is of what it had left when Redis last answered, for the whole outage, midnights included.
    if (period && s.periodCount + cost > degradedShare(limits.perMonth! - known!.monthCount, instances, rank)) violated = 'month';
    if (violated) return { outcome: violated, ...counts, nowMs, banUntilMs: 0 };
    for (const w of FIXED) {
      s.count[w.name] = (s.count[w.name] ?? 0) + cost;
      if (w.always || (limits[w.limit] ?? 0) > 0) counts[w.used]! += cost;
    }
    s.periodCount += cost;
    return { outcome: 'allowed', ...counts, nowMs, banUntilMs: 0 };
  }

  /** A refund of a request admitted from the budget, if its windows are current (what is written back stays). */
  refund(name: string, countedAtMs: number, cost: number): void {
    const s = this.spent.get(name);
    if (!s) return;
    for (const w of FIXED) {
      if (s.start[w.name] !== windowStart(countedAtMs, w.lengthMs!)) continue;
      s.count[w.name] = Math.max(s.written[w.name] ?? 0, (s.count[w.name] ?? 0) - cost);
    }
  }

  /** The counts as this instance sees them while Redis fails: Redis's last, plus its own admissions. */
  usage(name: string, nowMs: number): Counts {
    const known = this.seen.get(name);
    const out: Counts = known ? countsAt(known.stored, nowMs) : { minuteUsed: 0, dayUsed: 0 };
    const s = this.spent.get(name);
    if (s)
      for (const w of FIXED)
        if (s.start[w.name] === windowStart(nowMs, w.lengthMs!)) out[w.used] = (out[w.used] ?? 0) + (s.count[w.name] ?? 0);
    return out;
  }

  /** What is to be written back: new admissions as a new batch, and every earlier batch Redis has not confirmed. */
  drain(): WriteBack[] {
    const id = `${this.instanceId}:${++this.batch}`;
    for (const [name, s] of this.spent) {
      if (settled(s)) continue;
      const units: WriteBack['units'] = {};
      for (const w of FIXED) units[w.name] = (s.count[w.name] ?? 0) - (s.written[w.name] ?? 0);
      this.unconfirmed.set(`${id}:${name}`, {
        name,
        id,
        starts: { ...s.start },
        units,
        longestMs: s.longestMs,
        periodStart: s.periodStart,
        periodEnd: s.periodEnd,
        periodUnits: s.periodCount - s.periodWritten,
      });
      s.written = { ...s.count };
      s.periodWritten = s.periodCount;
    }
    return [...this.unconfirmed.values()];
  }

  /** Redis applied this write-back (or had already). */
  confirmed(w: WriteBack): void {
    this.unconfirmed.delete(`${w.id}:${w.name}`);
  }

  /** The subject's spending in the windows current at `nowMs`. */
  private current(subject: QuotaSubject, nowMs: number, period: Period | undefined): Spent {
    const [periodStart, periodEnd] = period ? [period.startMs, period.endMs] : [0, 0];
    let s = this.spent.get(subject.name);
    if (!s) {
      // The counters last until the end of the longest fixed window the subject has.
      const longestMs = Math.max(...FIXED.filter((w) => w.always || (subject.limits[w.limit] ?? 0) > 0).map((w) => w.lengthMs!));
      s = { start: {}, count: {}, written: {}, longestMs, periodStart, periodEnd, periodCount: 0, periodWritten: 0 };
      this.spent.set(subject.name, s);
    }
    for (const w of FIXED) {
      const start = windowStart(nowMs, w.lengthMs!);
      if (s.start[w.name] === start) continue;
      s.start[w.name] = start;
      s.count[w.name] = 0;
      s.written[w.name] = 0;
    }
    if (s.periodStart !== periodStart) Object.assign(s, { periodStart, periodEnd, periodCount: 0, periodWritten: 0 });
    return s;
  }

  /** Forgets, at most once a minute, what belongs to an earlier day. */
  private sweep(nowMs: number): void {
    if (nowMs - this.lastSweep < MINUTE_MS) return;
    this.lastSweep = nowMs;
    const today = windowStart(nowMs, DAY_MS);
    // A subject's last month count is kept until its period ends: the degraded budget needs it all period.
    // Collected first: the LRU of addresses is not changed while it is walked.
    const stale = [...this.seen.entries()].filter(([, c]) => (c.stored[DAY_START] ?? 0) < today && c.periodEnd <= nowMs);
    for (const [name] of stale) this.seen.delete(name);
    for (const [name, s] of this.spent) if ((s.start.day ?? 0) < today && settled(s)) this.spent.delete(name);
  }
}
