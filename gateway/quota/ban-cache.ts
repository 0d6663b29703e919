import { DAY_MS, MINUTE_MS, windowStart } from './decision.js';
import type { Counters } from './store.js';

/**
 * Bans this instance has seen in Redis's replies, with the counters they came with: a banned
 * key is refused from memory, without a round trip, until its ban ends, and while Redis fails.
 */
export class BanCache {
  private readonly bans = new Map<string, Counters>();

  remember(name: string, minuteUsed: number, dayUsed: number, nowMs: number, banUntilMs: number): void {
    this.bans.set(name, {
      minuteStart: windowStart(nowMs, MINUTE_MS),
      minuteCount: minuteUsed,
      dayStart: windowStart(nowMs, DAY_MS),
      dayCount: dayUsed,
      ban: banUntilMs,
    });
  }

  /** The subject's ban in force at `nowMs` (Redis time), if any; an ended one is forgotten. */
  get(name: string, nowMs: number): Counters | undefined {
    const known = this.bans.get(name);
    if (!known) return undefined;
    if (known.ban > nowMs) return known;
    this.bans.delete(name);
    return undefined;
  }

  active(nowMs: number): number {
    let n = 0;
    for (const { ban } of this.bans.values()) if (ban > nowMs) n++;
    return n;
  }
}
