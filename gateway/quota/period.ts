// The billing period: pure calendar math on UTC milliseconds (no clock, no I/O). billing.lua
// computes the same periods inside Redis from Redis's own time; a test holds the two together.

/** A billing period: [startMs, endMs), both at 00:00 UTC on the account's billing day. */
export interface Period {
  startMs: number;
  endMs: number;
}

/** 00:00 UTC of the billing day in month `month` (0-based; any integer, Date.UTC carries the year): a day past the month's end is its last day. */
function startIn(year: number, month: number, billingDay: number): number {
  const daysInMonth = new Date(Date.UTC(year, month + 1, 0)).getUTCDate();
  return Date.UTC(year, month, Math.min(billingDay, daysInMonth));
}

/** The period holding `nowMs` for an account billed on `billingDay` (1-31). */
export function billingPeriod(nowMs: number, billingDay: number): Period {
  const now = new Date(nowMs);
  const year = now.getUTCFullYear();
  const month = now.getUTCMonth();
  const here = startIn(year, month, billingDay);
  if (nowMs >= here) return { startMs: here, endMs: startIn(year, month + 1, billingDay) };
  return { startMs: startIn(year, month - 1, billingDay), endMs: here };
}

/** The UTC months from `fromMs` to `toMs` (January 31 to February 1 is one): how many grants fall between two period bounds. */
export function periodsBetween(fromMs: number, toMs: number): number {
  const a = new Date(fromMs);
  const b = new Date(toMs);
  return (b.getUTCFullYear() - a.getUTCFullYear()) * 12 + (b.getUTCMonth() - a.getUTCMonth());
}
