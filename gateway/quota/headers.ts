import type { Decision, Limits, ShortPolicies, ShortState, WindowState } from './decision.js';
import { isWindow, WINDOWS, windowRow } from './windows.js';

// Pure header math: a decision in, header values out. No clock, no I/O.

/**
 * `RateLimit-Policy` (draft-ietf-httpapi-ratelimit-headers-10) of the fixed-length windows
 * (windows.ts): constant per limits, built at load. A calendar window's item (the month)
 * depends on the period's length (28 to 31 days), so rateLimitHeaders appends it per decision.
 */
export function policyHeader(limits: Limits, short?: ShortPolicies): string {
  const parts: string[] = [];
  for (const w of WINDOWS) {
    const limit = limits[w.limit] ?? 0;
    if (w.lengthMs && (w.always || limit > 0)) parts.push(`"${w.name}";q=${limit};w=${w.lengthMs / 1000}`);
  }
  // The draft's registered unit for in-flight requests; `w` of the burst: seconds to refill from empty (no sub-second values).
  if (short?.concurrent) parts.push(`"concurrent";q=${short.concurrent};qu="concurrent-requests"`);
  if (short?.burst) parts.push(`"burst";q=${short.burst.size};w=${burstRefillSeconds(short.burst)}`);
  return parts.join(', ');
}

/** Whole seconds a burst takes to refill from empty, at least 1. */
export const burstRefillSeconds = (b: { size: number; perSecond: number }) => Math.max(1, Math.ceil(b.size / b.perSecond));

/** The short policies' RateLimit items: free slots, tokens left and seconds to the next (0 when full). */
function shortItems(s: ShortState, limits: ShortPolicies | undefined): string {
  let out = '';
  if (s.inFlight !== undefined && limits?.concurrent) out += `, "concurrent";r=${Math.max(0, limits.concurrent - s.inFlight)}`;
  if (s.burstLeft !== undefined) {
    const t = s.burstNextMs ? Math.max(1, Math.ceil(s.burstNextMs / 1000)) : 0;
    out += `, "burst";r=${s.burstLeft};t=${t}`;
  }
  return out;
}

/** The policy with the calendar window's item, if the decision has one: its `w` is the period's length in seconds. */
function fullPolicy(d: Decision, policy: string): string {
  const month = d.windows.at(-1);
  if (!month || !d.period || windowRow(month.name).lengthMs) return policy;
  return `${policy}, "${month.name}";q=${month.limit};w=${(d.period.endMs - d.period.startMs) / 1000}`;
}

const remaining = (w: WindowState) => Math.max(0, w.limit - w.used);
/** Whole seconds until `atMs`, rounded up and never 0 while it is still ahead. */
const secondsUntil = (atMs: number, nowMs: number) => Math.max(1, Math.ceil((atMs - nowMs) / 1000));

/** The window the X- headers describe: the violated one, else the fewest remaining, the shorter on a tie. */
export function reportedWindow(d: Decision): WindowState {
  const violated = isWindow(d.outcome) ? d.windows.find((w) => w.name === d.outcome) : undefined;
  return violated ?? d.windows.reduce((best, w) => (remaining(w) < remaining(best) ? w : best));
}

/**
 * When a window can admit again. During a ban nothing is admitted before the ban ends, and a
 * window already used up stays closed until its own reset if that comes later (a ban that
 * started with the day used up ends at midnight UTC in effect, not after 15 minutes).
 */
function reopensAt(d: Decision, w: WindowState): number {
  if (d.outcome !== 'banned') return w.resetMs;
  return remaining(w) === 0 ? Math.max(d.banUntilMs, w.resetMs) : d.banUntilMs;
}

/**
 * Seconds a refused client should wait: until a request can be admitted again. Out of credits,
 * only when a grant is due (then until it); else a top-up, not time, is what helps.
 */
export function retryAfterSeconds(d: Decision): number | undefined {
  // In flight: no one knows when a slot frees; a second is the shortest delay-seconds can say.
  if (d.outcome === 'concurrent') return 1;
  if (d.outcome === 'burst') return Math.max(1, Math.ceil((d.short?.burstRetryMs ?? 1000) / 1000));
  if (d.outcome === 'credits') return d.grantAtMs === undefined ? undefined : secondsUntil(d.grantAtMs, d.nowMs);
  if (d.outcome === 'banned') return secondsUntil(Math.max(...d.windows.map((w) => reopensAt(d, w))), d.nowMs);
  if (d.outcome !== 'allowed') return secondsUntil(reportedWindow(d).resetMs, d.nowMs);
  return undefined;
}

/** Every rate-limit header of a response. During a ban every window reports 0 left. */
export function rateLimitHeaders(d: Decision, policy: string, short?: ShortPolicies): Record<string, string> {
  const w = reportedWindow(d);
  const banned = d.outcome === 'banned';
  const resetMs = banned ? d.banUntilMs : w.resetMs;
  let state = d.windows.map((x) => `"${x.name}";r=${banned ? 0 : remaining(x)};t=${secondsUntil(reopensAt(d, x), d.nowMs)}`).join(', ');
  if (d.short) state += shortItems(d.short, short);
  const headers: Record<string, string> = {
    'x-ratelimit-limit': String(w.limit),
    'x-ratelimit-remaining': String(banned ? 0 : remaining(w)),
    'x-ratelimit-reset': String(Math.ceil(resetMs / 1000)),
    'ratelimit-policy': fullPolicy(d, policy),
    ratelimit: state,
  };
  if (d.balance !== undefined) headers['x-credits-remaining'] = String(d.balance);
  if (d.overage > 0 && d.outcome === 'allowed') headers['x-quota-overage'] = String(d.overageUsed);
  const retry = retryAfterSeconds(d);
  if (retry !== undefined) headers['retry-after'] = String(retry);
  return headers;
}
