// The quota model: what is asked (a subject: its limits and ban policy) and what is decided
// (one Outcome, and the windows as they stand after it). Pure: plain values and `now`.

import { billingPeriod, type Period } from './period.js';
import { type Counts, type UsedCounts, type WindowLimits, type WindowName, windowsOf } from './windows.js';

export const MINUTE_MS = 60_000;
export const DAY_MS = 86_400_000;

/**
 * Why a request was admitted or refused: the one vocabulary of quota.lua (which returns the
 * index), the in-process store, the headers, the error codes, the access line and the metrics.
 */
export const OUTCOMES = ['allowed', 'minute', 'day', 'banned', 'month', 'credits', 'hour', 'concurrent', 'burst'] as const;
export type Outcome = (typeof OUTCOMES)[number];
export type Refusal = Exclude<Outcome, 'allowed'>;
/** A refusal a subject in shadow mode (`enforce: false`) would have had: counted and reported, but admitted. */
export type ShadowOutcome = `would_${Refusal}`;
/** What admission ends with: a decision's outcome, a shadow refusal, or `unavailable` when a store failing closed could not decide. */
export type AdmissionOutcome = Outcome | ShadowOutcome | 'unavailable';

/**
 * The limits a subject is refused at (with overage, a quota's ceiling: the quota plus its
 * overage), one field per window (windows.ts). perDay 0: no day window (the unauthenticated
 * per-address limit has only a minute); the others 0 or absent: none.
 */
export type Limits = WindowLimits & { perDay: number };

/** What an account is billed by, beyond its windows: its period, its overage and its prepaid credits. */
export interface Billing {
  /** The day of the month (1-31, UTC) the billing period starts on; past a month's end, its last day. */
  billingDay: number;
  /**
   * Units admitted past the quota of the month window (the day's, without one), billed extra:
   * the window's limit is its quota plus these. 0: none.
   */
  overage: number;
  /** Prepaid credits: `grant` each period (added to what is left with `rollover`); absent: none. */
  credits?: { grant: number; rollover: boolean };
}

/** Billing for a subject that has none beyond its windows (an address's). */
export const NO_BILLING: Billing = Object.freeze({ billingDay: 1, overage: 0 });

/**
 * The short policies beside the windows (docs/reference.md, Concurrency and burst): requests in
 * flight at once, and a GCRA burst of `size` refilled at `perSecond`. Either absent: none.
 */
export interface ShortPolicies {
  concurrent?: number;
  burst?: { size: number; perSecond: number };
}

export interface BanPolicy {
  afterRejected: number;
  withinMs: number;
  durationMs: number;
}

/** Whose quota: a key's, or a client address's. Built once per key at config load. */
export interface QuotaSubject {
  /** Base name of its counters in the store, with a hash tag so they share one Cluster slot. */
  name: string;
  limits: Limits;
  bans: BanPolicy | null;
  /** Its `RateLimit-Policy` header value, constant per limits. */
  policy: string;
  /** Built once at config load (a key's), not per request (an address's): only then can admissions share headers. */
  lasting: boolean;
  /** False in shadow mode: decided and counted as if enforced, but never refused for quota. */
  enforce: boolean;
  billing: Billing;
  /** Usage events: the most its stream keeps (0: none recorded; an address's, or no export configured). */
  events: number;
  /** Threshold alerts: the fractions of its day, month and credits that fire a webhook, as a comma list ('' none). */
  alerts: string;
  /** Its concurrency and burst policies, if any: a leased unit of such a subject goes with a lingering slot and a leased token. */
  short?: ShortPolicies;
}

/** Whether a subject has a concurrency or burst policy (and so asks its store on every request). */
export const hasShort = (s: QuotaSubject): boolean => s.short !== undefined;

/** The short policies' state after a decision (a subject that has them). */
export interface ShortState {
  /** Requests in flight after the decision (this one's slot included when admitted); absent without concurrency. */
  inFlight?: number;
  /** Tokens left after it, and ms until the next comes back (0: full); absent without burst. */
  burstLeft?: number;
  burstNextMs?: number;
  /** A burst refusal: ms until the request's cost fits. */
  burstRetryMs?: number;
}

/** The subject's billing period at `nowMs`, if it has a month window or credits. */
export function periodOf({ limits, billing }: QuotaSubject, nowMs: number): Period | undefined {
  return limits.perMonth || billing.credits ? billingPeriod(nowMs, billing.billingDay) : undefined;
}

/** The window that has overage: the month's if the subject has one, else the day's. */
export const overageWindow = (limits: Limits): 'month' | 'day' => (limits.perMonth ? 'month' : 'day');

/** The quota past which units are overage (0: no overage): the overage window's limit less the overage. */
export function softQuota({ limits, billing }: QuotaSubject): number {
  if (billing.overage === 0) return 0;
  return (limits.perMonth || limits.perDay) - billing.overage;
}

/** One window's state after the decision. `used` counts admitted requests only. */
export interface WindowState {
  name: WindowName;
  limit: number;
  used: number;
  resetMs: number;
}

export interface Decision {
  outcome: Outcome;
  nowMs: number;
  /** When the ban ends; 0 unless the outcome is `banned`. */
  banUntilMs: number;
  windows: WindowState[];
  /** The billing period, for a subject with a month window or credits. */
  period?: Period;
  /** Credits left after the decision; absent without credits. */
  balance?: number;
  /** When the next grant adds credits (the period's end), if one is due: what a 402's Retry-After waits for. */
  grantAtMs?: number;
  /** This request's units past the quota of the overage window (billed extra); 0 when none. */
  overage: number;
  /** Units billed as overage in the overage window so far, this request's included (a subject with overage). */
  overageUsed?: number;
  /**
   * The usage event Redis wrote with this admission (quota.lua: a subject that records events,
   * not leased). The request learns its event's id from its tag (EventTag.eventId), which has a
   * leased admission's too.
   */
  eventId?: string;
  /**
   * How long this decision waited on Redis, in ms (a call of its own, or a sibling's lease
   * call it waited for): 0 when a lease or a known ban answered. Absent from the in-process store.
   */
  redisMs?: number;
  /** Answered from a lease this instance holds (Redis store). */
  leased?: boolean;
  /** Concurrency and burst, for a subject with either. */
  short?: ShortState;
  /** The concurrency slot this admission holds, released when the request ends (RequestPath.release). */
  slot?: string;
}

/** What a store counted: the outcome and the admitted counts of the current windows (Counts: one per window). */
export type WindowCounts = Counts & CountedBeyond;
interface CountedBeyond {
  outcome: Outcome;
  nowMs: number;
  banUntilMs: number;
  /** The billing period's bounds (its count is monthUsed), for a subject with a month window or credits. */
  period?: Period;
  /** Credits left; absent without credits. */
  balance?: number;
  /** Overage billed in the window so far, and this request's part of it (a subject with overage). */
  overageUsed?: number;
  overageUnits?: number;
  eventId?: string;
  short?: ShortState;
  slot?: string;
}

/** What a usage event says of its request beyond the decision: who, what, where. */
export interface EventTag {
  requestId: string;
  keyId: string;
  plan: string;
  route: string;
  method: string;
  /**
   * Set by the store once the request is admitted: its usage event's id, the one its final
   * status and a refund name (the event quota.lua wrote, or the one a lease's unit opened in its
   * batches). A lease's decision is one object shared by its units (redis/store.ts, fromLease):
   * the one thing each request has of its own comes back here rather than in a copy of it.
   */
  eventId?: string;
}

/** Window boundaries are aligned to UTC: the minute at second :00, the day at 00:00. */
export function windowStart(nowMs: number, sizeMs: number): number {
  return nowMs - (nowMs % sizeMs);
}

/** The windows of a subject (windows.ts, shortest first) from the admitted counts of the current windows (the month's needs its period). */
export function windows(limits: Limits, nowMs: number, used: UsedCounts, period?: Period): WindowState[] {
  const list: WindowState[] = [];
  for (const { row: w, limit } of windowsOf(limits)) {
    const resetMs = w.lengthMs ? windowStart(nowMs, w.lengthMs) + w.lengthMs : period?.endMs;
    if (resetMs !== undefined) list.push({ name: w.name, limit, used: used[w.used] ?? 0, resetMs });
  }
  return list;
}

export function decision({ limits, billing }: QuotaSubject, c: WindowCounts): Decision {
  const list = windows(limits, c.nowMs, c, c.period);
  const d: Decision = { outcome: c.outcome, nowMs: c.nowMs, banUntilMs: c.banUntilMs, windows: list, overage: 0 };
  if (c.period) d.period = c.period;
  // Counted where decided, one request at a time (no lease reaches past the quota): exact.
  if (billing.overage > 0) {
    d.overage = c.overageUnits ?? 0;
    d.overageUsed = c.overageUsed ?? 0;
  }
  if (c.eventId) d.eventId = c.eventId;
  if (c.short) d.short = c.short;
  if (c.slot) d.slot = c.slot;
  if (billing.credits && c.balance !== undefined) {
    d.balance = c.balance;
    if (billing.credits.grant > 0 && c.period) d.grantAtMs = c.period.endMs;
  }
  return d;
}

/**
 * Units one instance may take from Redis at once for a subject: 1% of its smaller window,
 * at most `max`, and 1 (no lease) below 200 a window. What an instance leased and did not
 * hand out before the minute ends is lost: at most a lease and a half per instance per minute
 * (the rest of the current lease, and the one taken ahead once half of it was handed out).
 */
export function leaseSize(limits: Limits, max: number): number {
  let smallest = Number.POSITIVE_INFINITY;
  for (const { limit } of windowsOf(limits)) smallest = Math.min(smallest, limit);
  return Math.max(1, Math.min(max, Math.floor(smallest / 100)));
}

/**
 * An instance's share of `left` units while Redis fails: an equal part for each of the
 * `instances` Redis knew of, the remainder to the lowest ranks, so the shares of instances
 * that knew the same count add up to exactly `left`. Pure, like the rest of this file.
 */
export function degradedShare(left: number, instances: number, rank: number): number {
  if (left <= 0) return 0;
  const n = Math.max(1, instances);
  return Math.floor(left / n) + (rank < left % n ? 1 : 0);
}
