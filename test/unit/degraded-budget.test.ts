import { describe, expect, it } from 'vitest';
import { DAY_MS, degradedShare, MINUTE_MS, NO_BILLING, type QuotaSubject } from '../../gateway/quota/decision.js';
import { QuotaStoreUnavailable } from '../../gateway/quota/store.js';
import { DegradedBudget, SEEN_MAX } from '../../gateway/quota/redis/degraded-budget.js';
import { LeaseBook, leaseOf } from '../../gateway/quota/redis/lease-book.js';
import { RedisClock } from '../../gateway/quota/redis/clock.js';

// The pieces of the Redis store that need no Redis: the degraded budget's share, the budget
// itself, the lease book and the Redis clock, each on an injected clock.

const subject = (perMinute: number, perDay: number): QuotaSubject => ({
  name: 's',
  limits: { perMinute, perDay },
  bans: null,
  policy: '',
  lasting: true,
  billing: NO_BILLING,
  events: 0,
  alerts: '',
  enforce: true,
});
const T0 = Date.UTC(2026, 10, 25, 10, 0, 0); // a minute's start
const admitted = (b: DegradedBudget, s: QuotaSubject, n: number, now = T0) =>
  Array.from({ length: n }, () => b.consume(s, 1, now).outcome).filter((o) => o === 'allowed').length;

describe('degradedShare', () => {
  it.each([
    // left, instances: each rank's share, adding up to what was left
    [10, 3, [4, 3, 3]],
    [6, 3, [2, 2, 2]],
    [2, 3, [1, 1, 0]],
    [0, 3, [0, 0, 0]],
    [-4, 2, [0, 0]],
    [7, 1, [7]],
  ])('%i left among %i instances: %j', (left, n, shares) => {
    const got = Array.from({ length: n }, (_, rank) => degradedShare(left, n, rank));
    expect(got).toEqual(shares);
    expect(got.reduce((a, b) => a + b, 0)).toBe(Math.max(0, left));
  });

  it('takes no fleet as a fleet of one', () => {
    expect(degradedShare(5, 0, 0)).toBe(5);
  });
});

describe('the degraded budget', () => {
  const reply = (minuteUsed: number) => ({ outcome: 'allowed' as const, nowMs: T0 + 5, minuteUsed, dayUsed: minuteUsed, banUntilMs: 0 });

  it(`keeps the last counts of at most ${SEEN_MAX} subjects, however many addresses are seen`, () => {
    const b = new DegradedBudget('me');
    for (let i = 0; i < 2 * SEEN_MAX; i++) b.see(`addr:${i}`, reply(1));
    expect(b.seenSubjects).toBe(SEEN_MAX);
  });

  it('still refuses a subject within the cap that Redis said was spent, after others came and went', () => {
    const b = new DegradedBudget('me');
    const s = subject(10, 1000);
    b.see('s', reply(10));
    for (let i = 1; i < SEEN_MAX; i++) b.see(`addr:${i}`, reply(1));
    expect(b.consume(s, 1, T0 + 10).outcome).toBe('minute');
  });

  it("admits this instance's share of what Redis last said was left, in each window", () => {
    const b = new DegradedBudget('me');
    b.setFleet(3, 2);
    const s = subject(10, 1000);
    b.see('s', { outcome: 'allowed', nowMs: T0 + 5, minuteUsed: 4, dayUsed: 100, banUntilMs: 0 }); // 6 left this minute: 2 each
    expect(admitted(b, s, 5, T0 + 10)).toBe(2);
    const refused = b.consume(s, 1, T0 + 10);
    expect(refused.outcome).toBe('minute');
    expect(refused.minuteUsed).toBe(10); // its share is spent: no room claimed
  });

  it('in a minute that starts while Redis fails, the shares add up to the limit', () => {
    const s = subject(10, 1000);
    const total = [0, 1, 2].reduce((sum, rank) => {
      const b = new DegradedBudget(`i${rank}`);
      b.setFleet(3, rank);
      b.see('s', { outcome: 'allowed', nowMs: T0 - 1, minuteUsed: 9, dayUsed: 500, banUntilMs: 0 }); // last minute's count says nothing of this one
      return sum + admitted(b, s, 20);
    }, 0);
    expect(total).toBe(10);
  });

  it('refuses for the day once its share of the day is spent, whatever the minute has left', () => {
    const b = new DegradedBudget('me');
    b.setFleet(2, 0);
    const s = subject(100, 1000);
    b.see('s', { outcome: 'allowed', nowMs: T0, minuteUsed: 0, dayUsed: 996, banUntilMs: 0 }); // 4 left today: 2 for each of two instances
    expect(admitted(b, s, 3)).toBe(2);
    expect(b.consume(s, 1, T0 + MINUTE_MS).outcome).toBe('day'); // a new minute, the same day
  });

  it('shares what the billing period had left when it is less than the day, and writes the units back to the period', () => {
    const b = new DegradedBudget('me');
    b.setFleet(2, 0);
    const monthly: QuotaSubject = { ...subject(100, 1000), limits: { perMinute: 100, perDay: 1000, perMonth: 5000 } };
    // 4 left this period (5,000 less 4,996), though the day has 900: 2 for each of two instances.
    const period = { startMs: Date.UTC(2026, 10, 1), endMs: Date.UTC(2026, 11, 1) };
    b.see('s', { outcome: 'allowed', nowMs: T0, minuteUsed: 0, dayUsed: 100, monthUsed: 4996, period, banUntilMs: 0 });
    expect(admitted(b, monthly, 3)).toBe(2);
    expect(b.consume(monthly, 1, T0 + 1).outcome).toBe('month');
    // The next day of the same outage: a new day's share, but the period's share stays spent.
    expect(b.consume(monthly, 1, T0 + DAY_MS).outcome).toBe('month');
    // Written back: nothing to today (yesterday's units are yesterday's), both to the period.
    expect(b.drain().map((w) => [w.units.day, w.periodStart, w.periodEnd, w.periodUnits])).toEqual([[0, period.startMs, period.endMs, 2]]);
  });

  it('admits nothing from a month it has no count of: it may be used up already', () => {
    const b = new DegradedBudget('me');
    const monthly: QuotaSubject = { ...subject(100, 1000), limits: { perMinute: 100, perDay: 1000, perMonth: 5000 } };
    expect(() => b.consume(monthly, 1, T0)).toThrow(QuotaStoreUnavailable);
  });

  it('writes back each admission once: a batch is sent again until confirmed, under its own id', () => {
    const b = new DegradedBudget('me');
    const s = subject(10, 1000);
    admitted(b, s, 3);
    const first = b.drain();
    expect(first.map((w) => [w.id, w.units.minute, w.units.day])).toEqual([['me:1', 3, 3]]);
    admitted(b, s, 1);
    const second = b.drain(); // not confirmed: the first again, and the new unit in a batch of its own
    expect(second.map((w) => [w.id, w.units.minute, w.units.day])).toEqual([
      ['me:1', 3, 3],
      ['me:2', 1, 1],
    ]);
    for (const w of second) b.confirmed(w);
    expect(b.drain()).toEqual([]);
    expect(admitted(b, s, 10)).toBe(6); // what was written back is still spent: 10 in all
  });

  it('gives a refunded unit back to the budget, unless it was written back', () => {
    const b = new DegradedBudget('me');
    const s = subject(2, 1000);
    expect(admitted(b, s, 2)).toBe(2);
    b.refund('s', T0, 1);
    expect(admitted(b, s, 2)).toBe(1);
    for (const w of b.drain()) b.confirmed(w);
    b.refund('s', T0, 1);
    expect(admitted(b, s, 1)).toBe(0);
  });
});

describe('the lease book', () => {
  it('hands out a lease within its minute, then the one taken ahead, and keeps expired units to give back', () => {
    let mono = 0;
    const book = new LeaseBook({ wall: () => T0, mono: () => mono });
    book.grant('s', leaseOf(2, 3, 0, T0 + 30_000, { minuteUsed: 3, dayUsed: 3 })); // 30 s left in its minute
    book.grantAhead('s', leaseOf(3, 3, 0, T0 + 30_000, { minuteUsed: 6, dayUsed: 6 }));
    expect([book.take('s')?.left, book.take('s')?.left]).toEqual([1, 0]);
    expect(book.take('s')?.minuteUsed).toBe(6); // the lease taken ahead
    mono = 30_000; // its minute is over
    expect(book.take('s')).toBeUndefined();
    // Both leases are closed with the next call, the spent one too: 2 units unused of 6 leased.
    expect(book.takeUnused('s')).toMatchObject({ left: 2, size: 6 });
    expect(book.takeUnused('s')).toBeUndefined();
  });

  it('closes two leases of one day but two minutes together, giving no minute its units back', () => {
    let mono = 0;
    const book = new LeaseBook({ wall: () => T0, mono: () => mono });
    book.grant('s', leaseOf(2, 3, 0, T0 + 30_000, { minuteUsed: 3, dayUsed: 3 }));
    book.grantAhead('s', leaseOf(3, 3, 0, T0 + 90_000, { minuteUsed: 3, dayUsed: 6 })); // the next minute
    mono = 100_000; // both over
    expect(book.take('s')).toBeUndefined();
    expect(book.takeUnused('s')).toMatchObject({ left: 5, size: 6, starts: { minute: 0, day: T0 - (T0 % DAY_MS) } });
  });

  it('keeps the leases of subjects that stopped sending to close, and forgets them once their day and period are over', () => {
    let mono = 120_000;
    const book = new LeaseBook({ wall: () => T0, mono: () => mono });
    book.sweep(T0); // the first sweep of the book
    book.grant('s', leaseOf(5, 6, mono, T0 + 30_000, { minuteUsed: 6, dayUsed: 6 }));
    mono += 60_000;
    book.sweep(T0); // its minute is over, the minute of grace not yet
    expect(book.hasCurrent('s')).toBe(true);
    mono += 60_000; // a sweep at most once a minute
    book.sweep(T0);
    expect(book.hasCurrent('s')).toBe(false);
    expect(book.takeUnused('s')).toMatchObject({ left: 5, size: 6 }); // closed with the subject's next call
    book.grant('s', leaseOf(5, 6, mono, T0 + 30_000, { minuteUsed: 6, dayUsed: 6 }));
    mono += 120_000;
    book.sweep(T0 + 60_000);
    mono += 60_000;
    book.sweep(T0 + DAY_MS); // its day is over (no billing period): nothing left to close it in
    expect(book.takeUnused('s')).toBeUndefined();
  });
});

describe('the Redis clock', () => {
  it('puts a deadline no later than the moment this instance gives up, in Redis time', () => {
    let wall = 1_000_000;
    const clock = new RedisClock({ wall: () => wall, mono: () => wall });
    expect(clock.deadline(wall, 250)).toBe(0); // no reply yet: no deadline
    // Redis runs 5 s ahead; the reply took 40 ms, so its time was read somewhere within them.
    clock.learn(1_005_030, 1_000_000, 1_000_040);
    wall = 1_000_100;
    expect(clock.now()).toBe(1_005_130); // from the latest sample
    // Given up at 1_000_350 local = Redis 1_005_350 at the most: the deadline is at or before it.
    expect(clock.deadline(1_000_100, 250)).toBeLessThanOrEqual(1_005_350);
    expect(clock.deadline(1_000_100, 250)).toBe(1_005_340);
    clock.learn(1_005_210, 1_000_200, 1_000_201); // a quicker round trip: a tighter bound
    expect(clock.deadline(1_000_300, 250)).toBe(1_005_559);
  });
});
