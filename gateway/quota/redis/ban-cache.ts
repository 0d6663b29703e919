import type { WindowCounts } from '../decision.js';
import type { Counters } from '../store.js';
import { type Counts, storedAt } from '../windows.js';

/** What a ban's reply said of the billing period and credits, so a refusal from memory reports them as Redis did. */
export type BillingCounts = Pick<WindowCounts, 'monthUsed' | 'period' | 'balance'>;

/**
 * Bans this instance has seen in Redis's replies, with the counters they came with: a banned
 * key is refused from memory, without a round trip, until its ban ends, and while Redis fails.
 * While Redis answers, a ban seen more than `recheckMs` ago is asked again (one call a second
 * per banned key at most), so a ban lifted on the admin port, by any instance, ends everywhere.
 */
export class BanCache {
  private readonly bans = new Map<string, Counters & { seenAt: number; billing: BillingCounts }>();

  constructor(private readonly recheckMs = 1000) {}

  /** A ban Redis answered with at `nowMs`, with the windows' counts it came with. */
  remember(name: string, counts: Counts, nowMs: number, banUntilMs: number, billing: BillingCounts = {}): void {
    this.bans.set(name, { billing, stored: storedAt(counts, nowMs), ban: banUntilMs, seenAt: nowMs });
  }

  /** Redis said this subject is not banned (any more). */
  forget(name: string): void {
    this.bans.delete(name);
  }

  /**
   * The subject's ban in force at `nowMs` (Redis time), if any; an ended one is forgotten. With
   * `recheck`, one seen longer ago than the recheck interval is not returned to this one caller,
   * which is to ask Redis; it counts as seen now, so the requests beside it keep being refused
   * from memory until Redis answers (one recheck at a time, at most one a second).
   */
  get(name: string, nowMs: number, recheck = false): (Counters & { billing: BillingCounts }) | undefined {
    const known = this.bans.get(name);
    if (!known) return undefined;
    if (known.ban <= nowMs) {
      this.bans.delete(name);
      return undefined;
    }
    if (!recheck || nowMs - known.seenAt < this.recheckMs) return known;
    known.seenAt = nowMs;
    return undefined;
  }

  active(nowMs: number): number {
    let n = 0;
    for (const { ban } of this.bans.values()) if (ban > nowMs) n++;
    return n;
  }
}
