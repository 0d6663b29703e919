import { type Period, periodsBetween } from './period.js';

// Prepaid credits, pure: what billing.lua's `credits` does inside Redis, for the in-process
// store and for reading a balance without changing it.

/** An account's credits: what is left of the grants (expires at the period's end unless they roll over) and what was bought (never expires). */
export interface CreditState {
  granted: number;
  purchased: number;
  /** The start of the period of the last grant; absent before the first. */
  grantedFor?: number;
}

/** A grant made when a period starts: the units added, for how many periods, and what was left of the last grant and expired. */
export interface Grant {
  amount: number;
  periods: number;
  expired: number;
}

/** The credits with the grants due by `period` applied (a new state), and the grant made, if one was due. */
export function withGrants(
  s: CreditState,
  period: Period,
  credits: { grant: number; rollover: boolean },
): { state: CreditState; grant?: Grant } {
  if (s.grantedFor === period.startMs) return { state: s };
  const periods = s.grantedFor === undefined ? 1 : periodsBetween(s.grantedFor, period.startMs);
  // A period earlier than the last grant's (the billing day moved back): its grant was made.
  if (periods < 1) return { state: s };
  const granted = credits.rollover ? s.granted + periods * credits.grant : credits.grant;
  const grant = { amount: credits.grant * (credits.rollover ? periods : 1), periods, expired: credits.rollover ? 0 : s.granted };
  return { state: { granted, purchased: s.purchased, grantedFor: period.startMs }, grant };
}

/** `units` paid from the credits: the granted ones first (they may expire), then the purchased. */
export function spend(s: CreditState, units: number): void {
  const fromGrant = Math.min(s.granted, units);
  s.granted -= fromGrant;
  s.purchased -= units - fromGrant;
}
