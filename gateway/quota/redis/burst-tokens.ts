import type { Clock } from './clock.js';

/** Above this many subjects held, a grant first drops the expired ones: memory bounded by traffic. */
const SWEEP_ABOVE = 1000;

/**
 * Burst tokens quota.lua leased this instance beyond a request's own (BURST_TOKEN_LEASE), per
 * subject: taken out of the GCRA state in Redis when granted, spent here one a request, and
 * dropped unspent once BURST_TOKEN_LEASE_MS has passed since their call was sent, so each
 * instance adds at most that many tokens, and only that long, to the burst's bound
 * (docs/reference.md, Concurrency and burst).
 */
export class BurstTokens {
  private readonly held = new Map<string, { left: number; until: number }>();
  /** Subjects with a call asking for tokens in flight: one at a time, or concurrent grants would waste each other's. */
  private readonly asking = new Set<string>();

  constructor(private readonly clock: Clock) {}

  /** Whether a token of the subject's may be spent here now. */
  has(name: string): boolean {
    const t = this.held.get(name);
    if (t && t.left > 0 && this.clock.mono() < t.until) return true;
    if (t) this.held.delete(name);
    return false;
  }

  /** Whether a call of the subject's may ask for tokens now: none held here, none being asked for. */
  mayAsk(name: string): boolean {
    return !this.asking.has(name) && !this.has(name);
  }

  /** A call asking for the subject's tokens is sent; `answered` when it is back, whatever came. */
  ask(name: string): void {
    this.asking.add(name);
  }

  answered(name: string): void {
    this.asking.delete(name);
  }

  /** Spends one (after `has`). */
  take(name: string): void {
    const t = this.held.get(name);
    if (t && --t.left === 0) this.held.delete(name);
  }

  /** `n` tokens from a call sent at monotonic `sentMono`, spendable for `forMs` from then; they replace any left. */
  grant(name: string, n: number, sentMono: number, forMs: number): void {
    if (this.held.size > SWEEP_ABOVE) {
      const now = this.clock.mono();
      for (const [k, t] of this.held) if (t.until <= now) this.held.delete(k);
    }
    this.held.set(name, { left: n, until: sentMono + forMs });
  }
}
