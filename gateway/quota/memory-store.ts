import { type CreditState, spend, withGrants } from './credits.js';
import {
  DAY_MS,
  type Decision,
  decision,
  MINUTE_MS,
  type QuotaSubject,
  type ShortState,
  softQuota,
  type WindowCounts,
  windowStart,
} from './decision.js';
import { billingPeriod, type Period } from './period.js';
import {
  type AccountBook,
  type LedgerEntry,
  type Operations,
  type RequestPath,
  type TopUp,
  type TopUpResult,
  topUpFingerprint,
  type Usage,
} from './store.js';
import { type Counts, countsFrom, FIXED, fixedLimits, windowRow } from './windows.js';

// The fixed windows (windows.ts) by position: a state keeps each one's start and count in arrays in this order.
const LENGTH = FIXED.map((w) => w.lengthMs!);
const NAME = FIXED.map((w) => w.name);
/** The day's position: the overage window of a subject without a month. */
const DAY = FIXED.indexOf(windowRow('day'));

interface MemoryState {
  /** Each fixed window's start and admitted count (as quota.lua's ms/mc, ds/dc, ...). */
  starts: number[];
  counts: number[];
  ban: number;
  /** The month window's period (as quota.lua's ps, pe) and its count. */
  periodStart: number;
  periodEnd: number;
  periodCount: number;
  /** Overage billed in the overage window starting at overageStart (quota.lua's os, oc). */
  overageStart: number;
  overageCount: number;
  rejections: number[];
  /** When the state may be dropped: what PEXPIREAT / PEXPIRE give the script's keys. */
  expiresAt: number;
}

/** An account's credits, ledger and top-ups: kept for good, as their Redis keys are. */
interface Account {
  credits: CreditState;
  ledger: LedgerEntry[];
  topUps: Map<string, { fingerprint: string; entryId: string; balance: number }>;
}

/**
 * The in-process store: the same rules as quota.lua, step for step, on a Map. Used when no
 * REDIS_URL is set and as the fallback while Redis fails; its limits are per process.
 */
export class MemoryQuotaStore implements RequestPath, AccountBook, Operations {
  readonly degraded = false;
  private readonly states = new Map<string, MemoryState>();
  private readonly accounts = new Map<string, Account>();
  private lastSweep = 0;
  private entries = 0;
  /** The fixed windows' counts of the step under way (one at a time: steps are synchronous). */
  private readonly used: number[] = LENGTH.map(() => 0);
  /** Concurrency slots in flight per subject (in-process: they end with the process, no expiry needed), and each burst's TAT (ms). */
  private readonly slots = new Map<string, Set<string>>();
  private readonly tats = new Map<string, number>();
  private slotIds = 0;

  constructor(private readonly clock: () => number = Date.now) {}

  consume(subject: QuotaSubject, cost = 1): Decision {
    return decision(subject, this.step(subject, this.clock(), cost));
  }

  async peek(subject: QuotaSubject): Promise<Usage> {
    const { name, bans, limits, billing } = subject;
    const now = this.clock();
    const s = this.states.get(name);
    const usage: Usage = s
      ? {
          nowMs: now,
          ...countsOf(s, now, 0),
          banUntilMs: s.ban > now ? s.ban : 0,
          recentRejections: bans ? s.rejections.filter((t) => t > now - bans.withinMs).length : 0,
        }
      : { nowMs: now, minuteUsed: 0, dayUsed: 0, banUntilMs: 0, recentRejections: 0 };
    let period: Period | undefined;
    if (limits.perMonth) {
      period = monthPeriod(subject, s, now);
      usage.monthUsed = s && s.periodStart === period.startMs ? s.periodCount : 0;
    }
    if (billing.credits) {
      const { state, inForce } = withGrants(this.account(name).credits, billingPeriod(now, billing.billingDay), billing.credits, now);
      usage.credits = { granted: state.granted, purchased: state.purchased };
      period ??= inForce;
    }
    if (period) usage.period = period;
    const short = this.peekShort(subject, now);
    if (short?.inFlight !== undefined) usage.inFlight = short.inFlight;
    if (short?.burstLeft !== undefined) usage.burstLeft = short.burstLeft;
    if (billing.overage > 0) {
      const start = period && limits.perMonth ? period.startMs : windowStart(now, DAY_MS);
      usage.overageUsed = s && s.overageStart === start ? s.overageCount : 0;
    }
    return usage;
  }

  async refund(subject: QuotaSubject, countedAtMs: number, cost = 1): Promise<void> {
    const s = this.states.get(subject.name);
    if (s) {
      for (let i = 0; i < LENGTH.length; i++) {
        if (s.starts[i] === windowStart(countedAtMs, LENGTH[i]!)) s.counts[i] = Math.max(0, s.counts[i]! - cost);
      }
      // The period it was counted in, if it is still the one stored (as refund.lua does).
      const inPeriod = subject.limits.perMonth !== undefined && s.periodStart <= countedAtMs && countedAtMs < s.periodEnd;
      if (inPeriod) s.periodCount = Math.max(0, s.periodCount - cost);
      // The overage takes back what no delivered unit is under any more, at most `cost` (as refund.lua does).
      const dayStart = s.starts[DAY]!;
      const sameDay = dayStart === windowStart(countedAtMs, DAY_MS);
      const [long, from] = subject.limits.perMonth
        ? [s.periodCount, inPeriod ? s.periodStart : -1]
        : [s.counts[DAY]!, sameDay ? dayStart : -1];
      if (s.overageStart === from) s.overageCount -= Math.min(cost, Math.max(0, s.overageCount - Math.max(0, long - softQuota(subject))));
    }
    // Given back as purchased credits, which never expire (as refund.lua does).
    if (subject.billing.credits) this.account(subject.name).credits.purchased += cost;
  }

  release({ name }: QuotaSubject, slot: string): void {
    const held = this.slots.get(name);
    if (held?.delete(slot) && held.size === 0) this.slots.delete(name);
  }

  /**
   * Concurrency and burst as quota.lua has them: their state now (for the headers), and with
   * `take`, the refusal if either refuses, else the slot and the burst's tokens taken.
   */
  private short(
    subject: QuotaSubject,
    now: number,
    cost: number,
    take: boolean,
  ): { state: ShortState; refused?: 'burst' | 'concurrent'; slot?: string } {
    const { concurrent, burst } = subject.short!;
    let held = this.slots.get(subject.name);
    const inFlight = held?.size ?? 0;
    const interval = burst ? 1000 / burst.perSecond : 0;
    let tat = burst ? Math.max(this.tats.get(subject.name) ?? now, now) : now;
    const state = (): ShortState => ({
      ...(concurrent && { inFlight: held?.size ?? 0 }),
      ...(burst && burstState(burst, interval, tat, now)),
    });
    if (!take) return { state: state() };
    // The burst first (its wait is known), then a free slot; nothing taken unless both admit.
    const over = burst ? tat + cost * interval - now - burst.size * interval : 0;
    if (over > 1e-6) return { state: { ...state(), burstRetryMs: Math.max(1, Math.ceil(over)) }, refused: 'burst' };
    if (concurrent && inFlight >= concurrent) return { state: state(), refused: 'concurrent' };
    if (burst) this.tats.set(subject.name, (tat += cost * interval));
    if (!concurrent) return { state: state() };
    const slot = `m${++this.slotIds}`;
    if (!held) this.slots.set(subject.name, (held = new Set()));
    held.add(slot);
    return { state: state(), slot };
  }

  async unban({ name }: QuotaSubject): Promise<boolean> {
    const s = this.states.get(name);
    if (!s) return false;
    const lifted = s.ban > this.clock();
    s.ban = 0;
    s.rejections = [];
    return lifted;
  }

  async topUp(subject: QuotaSubject, t: TopUp): Promise<TopUpResult> {
    const account = this.account(subject.name);
    const fingerprint = topUpFingerprint(t);
    const seen = account.topUps.get(t.idempotencyKey);
    if (seen) return { entryId: seen.entryId, balance: seen.balance, replayed: true, conflict: seen.fingerprint !== fingerprint };
    const now = this.clock();
    this.grantDue(subject, account, billingPeriod(now, subject.billing.billingDay), now);
    account.credits.purchased += t.amount;
    const balance = account.credits.granted + account.credits.purchased;
    const entryId = this.append(account, now, {
      kind: 'topup',
      amount: t.amount,
      balance,
      reason: t.reason,
      idempotencyKey: t.idempotencyKey,
    });
    account.topUps.set(t.idempotencyKey, { fingerprint, entryId, balance });
    return { entryId, balance, replayed: false, conflict: false };
  }

  async ledger({ name }: QuotaSubject): Promise<LedgerEntry[]> {
    return [...(this.accounts.get(name)?.ledger ?? [])];
  }

  activeBans(): number {
    const now = this.clock();
    let n = 0;
    for (const s of this.states.values()) if (s.ban > now) n++;
    return n;
  }

  private account(name: string): Account {
    let a = this.accounts.get(name);
    if (!a) {
      a = { credits: { granted: 0, purchased: 0 }, ledger: [], topUps: new Map() };
      this.accounts.set(name, a);
    }
    return a;
  }

  /** An entry at the ledger's end, with an id that orders as Redis's stream ids do (time, then sequence). */
  private append(account: Account, now: number, entry: Omit<LedgerEntry, 'id' | 'atMs'>): string {
    const id = `${now}-${this.entries++}`;
    account.ledger.push({ id, atMs: now, ...entry });
    return id;
  }

  /** Applies the grants due at `now` (`period` holds it), each with its ledger entry; returns the grant period in force. */
  private grantDue(subject: QuotaSubject, account: Account, period: Period, now: number): Period | undefined {
    const credits = subject.billing.credits;
    if (!credits) return undefined;
    const { state, grant, inForce } = withGrants(account.credits, period, credits, now);
    account.credits = state;
    if (grant) this.append(account, now, { kind: 'grant', ...grant, balance: state.granted + state.purchased });
    return inForce;
  }

  private step(subject: QuotaSubject, now: number, cost: number): WindowCounts {
    const { name, limits, bans, billing } = subject;
    this.sweep(now);
    const s = this.stateOf(name);
    // Each fixed window's admitted count now (0 in a window that has started since), and its limit (0: none).
    const used = this.used;
    for (let i = 0; i < LENGTH.length; i++) used[i] = s.starts[i] === now - (now % LENGTH[i]!) ? s.counts[i]! : 0;
    const fixed = fixedLimits(limits);
    const account = billing.credits ? this.account(name) : undefined;
    const granted = account && this.grantDue(subject, account, billingPeriod(now, billing.billingDay), now);
    // The month's period in force (as quota.lua: the stored one until it ends); without a month, the grant's.
    const period = limits.perMonth ? monthPeriod(subject, s, now) : granted;
    const monthUsed = limits.perMonth && s.periodStart === period!.startMs ? s.periodCount : 0;
    const counts = (outcome: WindowCounts['outcome'], taken = 0, banUntilMs = 0): WindowCounts => {
      const c = countsFrom(used, taken) as WindowCounts;
      c.outcome = outcome;
      c.nowMs = now;
      c.banUntilMs = banUntilMs;
      if (period) Object.assign(c, { period, monthUsed: limits.perMonth ? monthUsed + taken : 0 });
      if (account) c.balance = account.credits.granted + account.credits.purchased;
      // A refusal shows concurrency and burst as they stand (the burst's and a slot's own refusals say more).
      if (outcome !== 'allowed' && subject.short) c.short = this.peekShort(subject, now);
      return c;
    };
    if (s.ban > now) return counts('banned', 0, s.ban);
    // The state lasts until the end of its longest window; the longest window used up is the one reported.
    let expireAt = 0;
    let violated: WindowCounts['outcome'] | undefined;
    for (let i = 0; i < LENGTH.length; i++) {
      if (fixed[i] === 0) continue;
      expireAt = windowStart(now, LENGTH[i]!) + LENGTH[i]!;
      if (used[i]! + cost > fixed[i]!) violated = NAME[i];
    }
    if (limits.perMonth && period) expireAt = period.endMs;
    if (limits.perMonth && monthUsed + cost > limits.perMonth) violated = 'month';
    if (violated) {
      if (bans) {
        s.rejections = [now, ...s.rejections.filter((t) => t > now - bans.withinMs)].slice(0, bans.afterRejected + 1);
        s.expiresAt = Math.max(s.expiresAt, now + bans.withinMs);
        if (s.rejections.length > bans.afterRejected) {
          s.ban = now + bans.durationMs;
          s.rejections = [];
          s.expiresAt = Math.max(s.expiresAt, expireAt, s.ban);
          return counts('banned', 0, s.ban);
        }
      }
      return counts(violated);
    }
    // Every window has room; the balance must cover the cost too (a 402, which bans no one).
    if (account && account.credits.granted + account.credits.purchased < cost) return counts('credits');
    // Then the burst and a free slot: refused, charged nothing.
    const short = subject.short ? this.short(subject, now, cost, true) : undefined;
    if (short?.refused) return Object.assign(counts(short.refused), { short: short.state });
    if (account) spend(account.credits, cost);
    for (let i = 0; i < LENGTH.length; i++) {
      s.starts[i] = windowStart(now, LENGTH[i]!);
      s.counts[i] = used[i]! + cost;
    }
    s.expiresAt = Math.max(s.expiresAt, expireAt, s.ban);
    if (limits.perMonth && period)
      Object.assign(s, { periodStart: period.startMs, periodEnd: period.endMs, periodCount: monthUsed + cost });
    const overageFrom = limits.perMonth ? period!.startMs : windowStart(now, DAY_MS);
    const overage = this.billOverage(subject, s, overageFrom, limits.perMonth ? monthUsed : used[DAY]!, cost);
    const c = Object.assign(counts('allowed', cost), overage);
    if (short) Object.assign(c, { short: short.state, ...(short.slot && { slot: short.slot }) });
    return c;
  }

  /** A subject's state, made at its first request. */
  private stateOf(name: string): MemoryState {
    let s = this.states.get(name);
    if (!s) {
      s = {
        starts: LENGTH.map(() => 0),
        counts: LENGTH.map(() => 0),
        ban: 0,
        periodStart: 0,
        periodEnd: 0,
        periodCount: 0,
        overageStart: 0,
        overageCount: 0,
        rejections: [],
        expiresAt: 0,
      };
      this.states.set(name, s);
    }
    return s;
  }

  /** The short policies' state without taking anything (a refusal by another check, a reading). */
  peekShort(subject: QuotaSubject, now: number): ShortState | undefined {
    return subject.short ? this.short(subject, now, 0, false).state : undefined;
  }

  /** The units of an admission past the quota (soft line), added to the window's overage, as quota.lua's take does. */
  private billOverage(subject: QuotaSubject, s: MemoryState, start: number, before: number, cost: number) {
    const soft = softQuota(subject);
    if (soft === 0) return {};
    if (s.overageStart !== start) Object.assign(s, { overageStart: start, overageCount: 0 });
    const units = Math.max(0, before + cost - Math.max(soft, before));
    s.overageCount += units;
    return { overageUsed: s.overageCount, overageUnits: units };
  }

  /** Drops states whose windows, ban and recent 429s are all over, at most once a minute. */
  private sweep(now: number): void {
    if (now - this.lastSweep < MINUTE_MS) return;
    this.lastSweep = now;
    for (const [k, s] of this.states) if (s.expiresAt <= now) this.states.delete(k);
    // A burst back to full is as good as none (quota.lua's key expires then).
    for (const [k, tat] of this.tats) if (tat <= now) this.tats.delete(k);
  }
}

/** A burst's tokens left with its TAT at `tat`, and ms until the next (0: full), as quota.lua's burstState. */
function burstState(burst: { size: number }, interval: number, tat: number, now: number): ShortState {
  const left = Math.floor((burst.size * interval - (tat - now)) / interval + 1e-9);
  if (left >= burst.size) return { burstLeft: burst.size, burstNextMs: 0 };
  return { burstLeft: left, burstNextMs: Math.max(1, Math.ceil(tat - now - (burst.size - left - 1) * interval)) };
}

/** A state's admitted counts of the fixed windows current at `now`, each with `taken` more. */
function countsOf(s: MemoryState, now: number, taken: number): Counts {
  return countsFrom(
    LENGTH.map((length, i) => (s.starts[i] === now - (now % length) ? s.counts[i]! : 0)),
    taken,
  );
}

/** The month window's period in force at `now`: the stored one until it ends (a billing day changed meanwhile applies from the next), else the billing day's. */
function monthPeriod(subject: QuotaSubject, s: MemoryState | undefined, now: number): Period {
  if (s && s.periodStart <= now && now < s.periodEnd) return { startMs: s.periodStart, endMs: s.periodEnd };
  return billingPeriod(now, subject.billing.billingDay);
}
