import { type Period, periodsBetween } from './period.js';

// Prepaid credits, pure: what billing.lua's `credits` does inside Redis, for the in-process
// store and for reading a balance without changing it.

/** An account's credits: what is left of the grants (expires at the period's end unless they roll over) and what was bought (never expires). */
export interface CreditState {
  granted: number;
  purchased: number;
  /** The period of the last grant; absent before the first. */
  grantedFor?: number;
  grantedUntil?: number;
}

/** A grant made when a period starts: the units added, for how many periods, and what was left of the last grant and expired. */
export interface Grant {
  amount: number;
  periods: number;
  expired: number;
}

/**
 * The credits at `nowMs` with the grants due applied (a new state), the grant made if one was
 * due, and the grant period in force. As billing.lua's `credits`: the last grant's period stays
 * in force until its end, even if the billing day moved since; then `period` (the one holding
 * `nowMs`) gets one grant, or with rollover one for each period since.
 */
export function withGrants(
  s: CreditState,
  period: Period,
  credits: { grant: number; rollover: boolean },
  nowMs: number,
): { state: CreditState; grant?: Grant; inForce: Period } {
  if (s.grantedUntil !== undefined && nowMs < s.grantedUntil) {
    return { state: s, inForce: { startMs: s.grantedFor!, endMs: s.grantedUntil } };
  }
  const periods = s.grantedUntil === undefined ? 1 : Math.max(1, periodsBetween(s.grantedUntil, period.startMs) + 1);
  const granted = credits.rollover ? s.granted + periods * credits.grant : credits.grant;
  const grant = { amount: credits.grant * (credits.rollover ? periods : 1), periods, expired: credits.rollover ? 0 : s.granted };
  const state = { granted, purchased: s.purchased, grantedFor: period.startMs, grantedUntil: period.endMs };
  return { state, grant, inForce: period };
}

/** `units` paid from the credits: the granted ones first (they may expire), then the purchased. */
export function spend(s: CreditState, units: number): void {
  const fromGrant = Math.min(s.granted, units);
  s.granted -= fromGrant;
  s.purchased -= units - fromGrant;
}
