import { DAY_MS, type Decision, MINUTE_MS, type QuotaSubject, type ShortState, windowStart } from '../decision.js';
import type { Period } from '../period.js';
import type { Clock } from './clock.js';
import { type Counts, FIXED, type WindowName } from '../windows.js';

/**
 * Units Redis granted this instance in one admission and not handed out yet (see leaseSize),
 * with the counts Redis held after the lease (what headers report; monthUsed the billing
 * period's, a subject with a month window). A lease lives within one Redis minute, the shortest
 * window, so no window rolls over under it: it never hands out past any window's room.
 */
export interface Lease extends Counts {
  left: number;
  /** Monotonic time before which the lease is surely still in its Redis minute. */
  until: number;
  /** The Redis minute's end. */
  windowEndMs: number;
  /** The starts of the fixed windows it was counted in (windows.ts), so unused units go back to them; 0: to none of that window. */
  starts: Partial<Record<WindowName, number>>;
  period?: Period;
  /**
   * The lease's size when taken: the next one is asked for once half of it is handed out. Of
   * leases closed and given back together, their sizes added: Redis learns from it how many of
   * their units were delivered (size less left), which is what overage bills.
   */
  size: number;
  /** A credit lease's id in Redis (its call's), under which its credits are held until it is closed. */
  id?: string;
  /** Credits left in Redis when it was taken, beside those it holds (a subject with credits). */
  balance?: number;
  /** Of leases to close: each credit lease's id and units not handed out, which go back to the balance. */
  credits?: Array<[id: string, left: number]>;
  /** Taken for a subject whose usage is exported: its units never handed out leave the account's `unsettled` when it closes. */
  events?: boolean;
  /** A subject with concurrency or burst: their state as its call saw it, what a unit's headers report. */
  short?: ShortState;
  /** The decision its units share within one second of Redis time, for one subject (see RedisStore.fromLease). */
  shared?: { second: number; subject: QuotaSubject; decision: Decision };
}

/**
 * A lease of `units` from a reply at Redis time `nowMs` to a call sent at monotonic `sentMono`:
 * timed from the sending, so it ends no later than its Redis minute.
 */
export function leaseOf(
  units: number,
  size: number,
  sentMono: number,
  nowMs: number,
  counts: Counts & { period?: Period; balance?: number },
  id?: string,
): Lease {
  const windowEndMs = windowStart(nowMs, MINUTE_MS) + MINUTE_MS;
  const starts: Lease['starts'] = {};
  const lease = { left: units, until: sentMono + windowEndMs - nowMs, windowEndMs, starts, size, shared: undefined } as Lease;
  for (const w of FIXED) {
    starts[w.name] = windowStart(nowMs, w.lengthMs!);
    lease[w.used] = counts[w.used] ?? 0;
  }
  lease.monthUsed = counts.monthUsed ?? 0;
  lease.period = counts.period;
  // Credits are held in Redis under the lease's id only when the subject has credits.
  if (counts.balance !== undefined) Object.assign(lease, { id, balance: counts.balance });
  return lease;
}

/**
 * The leases of one instance, per subject: the one being handed out, the one taken ahead of
 * need, the units of expired ones to give back to Redis with the next call, and the lease
 * request in flight (one per subject: concurrent requests wait for the lease it brings
 * instead of each taking one, which would reserve many times what they use).
 */
export class LeaseBook {
  private readonly current = new Map<string, Lease>();
  private readonly ahead = new Map<string, Lease>();
  private readonly unused = new Map<string, Lease>();
  private readonly pending = new Map<string, Promise<boolean>>();
  private lastSweep = 0;

  constructor(private readonly clock: Clock) {}

  /**
   * Hands out one unit of the subject's lease, if it has one left within its minute, the lease
   * taken ahead once the current one is spent; returns that lease, or undefined.
   */
  take(name: string): Lease | undefined {
    const mono = this.clock.mono();
    for (;;) {
      const lease = this.current.get(name);
      if (lease) {
        if (lease.left > 0 && mono < lease.until) {
          lease.left--;
          return lease;
        }
        this.current.delete(name);
        this.keepUnused(name, lease); // even spent, it is closed with the next call
      }
      const next = this.ahead.get(name);
      if (!next) return undefined;
      this.ahead.delete(name);
      this.current.set(name, next);
    }
  }

  grant(name: string, lease: Lease): void {
    this.current.set(name, lease);
  }

  grantAhead(name: string, lease: Lease): void {
    this.ahead.set(name, lease);
  }

  hasCurrent(name: string): boolean {
    return this.current.has(name);
  }

  /** Whether a unit of the subject's may be handed out here now (the current lease's, or the one ahead). */
  hasUnits(name: string): boolean {
    const lease = this.current.get(name);
    return (lease !== undefined && lease.left > 0 && this.clock.mono() < lease.until) || this.ahead.has(name);
  }

  /** The short policies' state a call of the subject's saw: what its leased units report from now on. */
  seeShort(name: string, short: ShortState): void {
    for (const held of [this.current, this.ahead]) {
      const lease = held.get(name);
      if (lease) lease.short = short;
    }
  }

  hasAhead(name: string): boolean {
    return this.ahead.has(name);
  }

  /** A lease never handed out (its grant came too late to use): closed with the subject's next call, all its units given back. */
  giveBack(name: string, lease: Lease): void {
    this.keepUnused(name, lease);
  }

  /** The leases to close with the subject's next call (their unused units, their sizes), taken out of the book. */
  takeUnused(name: string): Lease | undefined {
    const back = this.unused.get(name);
    if (back) this.unused.delete(name);
    return back;
  }

  inFlight(name: string): Promise<boolean> | undefined {
    return this.pending.get(name);
  }

  /** A lease request in flight until `done` settles (with whether it brought a lease). */
  track(name: string, done: Promise<boolean>): void {
    this.pending.set(name, done);
    void done.then(() => this.pending.delete(name)); // before the waiters resume
  }

  /**
   * Keeps a lease to close, with its unused units to give back. Two leases to close at once
   * (the current one and the one taken ahead, both expired) merge when they counted in the
   * same day and billing period (the windows overage is billed in); otherwise the older stays
   * counted and open: under-admission and, past the quota, under-billing of its delivered
   * units, never over.
   */
  private keepUnused(name: string, lease: Lease): void {
    const held = this.unused.get(name);
    // Credits are not counted per window: every credit lease is closed, merged or not.
    const credits: Lease['credits'] = [...(held?.credits ?? []), ...(lease.id ? [[lease.id, lease.left] as [string, number]] : [])];
    if (held && held.starts.day === lease.starts.day && held.period?.startMs === lease.period?.startMs && held.events === lease.events) {
      // Of two minutes (or hours), neither is given its units back (they stay counted there: the safe side).
      for (const w of FIXED) if (held.starts[w.name] !== lease.starts[w.name]) held.starts[w.name] = 0;
      held.left += lease.left;
      held.size += lease.size;
      held.credits = credits;
    } else this.unused.set(name, { ...lease, starts: { ...lease.starts }, credits });
  }

  /** The subject's leases past their time, kept to close (a credit lease's holder closes it before Redis gives it back whole). */
  lapse(name: string): boolean {
    const mono = this.clock.mono();
    for (const held of [this.current, this.ahead]) {
      const lease = held.get(name);
      if (lease && mono >= lease.until) {
        held.delete(name);
        this.keepUnused(name, lease);
      }
    }
    return this.unused.has(name);
  }

  /** Every lease of the subject closed now, handed out or not (the instance stops): whether there are any to close. */
  closeAll(name: string): boolean {
    for (const held of [this.current, this.ahead]) {
      const lease = held.get(name);
      if (lease) {
        held.delete(name);
        this.keepUnused(name, lease);
      }
    }
    return this.unused.has(name);
  }

  /**
   * At most once a minute: leases over for a minute are kept to close with their subject's
   * next call, however late (what they delivered is billed then), and leases to close whose
   * day and billing period both ended are forgotten (Redis would ignore them).
   */
  sweep(wallNow: number): void {
    const now = this.clock.mono();
    if (now - this.lastSweep < MINUTE_MS) return;
    this.lastSweep = now;
    for (const held of [this.current, this.ahead]) {
      for (const [name, lease] of held) {
        if (lease.until > now - MINUTE_MS) continue;
        held.delete(name);
        this.keepUnused(name, lease);
      }
    }
    for (const [name, lease] of this.unused) {
      if ((lease.starts.day ?? 0) + DAY_MS <= wallNow && (lease.period?.endMs ?? 0) <= wallNow) this.unused.delete(name);
    }
  }
}

/** A lease's counts: every window's, as Redis held them after it; with credits, its balance and the units it still holds. */
export function countsOfLease(lease: Lease): Counts & { balance?: number } {
  const out: Counts & { balance?: number } = { minuteUsed: 0, dayUsed: 0, monthUsed: lease.monthUsed };
  for (const w of FIXED) out[w.used] = lease[w.used] ?? 0;
  if (lease.balance !== undefined) out.balance = lease.balance + lease.left;
  return out;
}
