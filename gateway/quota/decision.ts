// The quota model: what is asked (a subject: its limits and ban policy) and what is decided
// (one Outcome, and the windows as they stand after it). Pure: plain values and `now`.

export const MINUTE_MS = 60_000;
export const DAY_MS = 86_400_000;

/**
 * Why a request was admitted or refused: the one vocabulary of quota.lua (which returns the
 * index), the in-process store, the headers, the error codes, the access line and the metrics.
 */
export const OUTCOMES = ['allowed', 'minute', 'day', 'banned'] as const;
export type Outcome = (typeof OUTCOMES)[number];
export type Refusal = Exclude<Outcome, 'allowed'>;
/** A refusal a subject in shadow mode (`enforce: false`) would have had: counted and reported, but admitted. */
export type ShadowOutcome = `would_${Refusal}`;
/** What admission ends with: a decision's outcome, a shadow refusal, or `unavailable` when a store failing closed could not decide. */
export type AdmissionOutcome = Outcome | ShadowOutcome | 'unavailable';

export interface Limits {
  perMinute: number;
  /** 0: no day window (the unauthenticated per-address limit has only a minute). */
  perDay: number;
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
}

/** One window's state after the decision. `used` counts admitted requests only. */
export interface WindowState {
  name: 'minute' | 'day';
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
}

/** What a store counted: the outcome and the admitted counts of the current windows. */
export interface WindowCounts {
  outcome: Outcome;
  minuteUsed: number;
  dayUsed: number;
  nowMs: number;
  banUntilMs: number;
}

/** Window boundaries are aligned to UTC: the minute at second :00, the day at 00:00. */
export function windowStart(nowMs: number, sizeMs: number): number {
  return nowMs - (nowMs % sizeMs);
}

/** The windows of a subject from the admitted counts of the current windows. */
export function windows(limits: Limits, nowMs: number, minuteUsed: number, dayUsed: number): WindowState[] {
  const list: WindowState[] = [
    { name: 'minute', limit: limits.perMinute, used: minuteUsed, resetMs: windowStart(nowMs, MINUTE_MS) + MINUTE_MS },
  ];
  if (limits.perDay > 0) {
    list.push({ name: 'day', limit: limits.perDay, used: dayUsed, resetMs: windowStart(nowMs, DAY_MS) + DAY_MS });
  }
  return list;
}

export function decision(limits: Limits, c: WindowCounts): Decision {
  return { outcome: c.outcome, nowMs: c.nowMs, banUntilMs: c.banUntilMs, windows: windows(limits, c.nowMs, c.minuteUsed, c.dayUsed) };
}

/**
 * Units one instance may take from Redis at once for a subject: 1% of its smaller window,
 * at most `max`, and 1 (no lease) below 200 a window. What an instance leased and did not
 * hand out before the minute ends is lost: at most a lease and a half per instance per minute
 * (the rest of the current lease, and the one taken ahead once half of it was handed out).
 */
export function leaseSize(limits: Limits, max: number): number {
  const smallest = limits.perDay > 0 ? Math.min(limits.perMinute, limits.perDay) : limits.perMinute;
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
