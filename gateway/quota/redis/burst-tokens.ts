import type { QuotaSubject } from '../decision.js';
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
  /**
   * Subjects with a call asking for tokens in flight, settled when it is back: one at a time,
   * or concurrent grants would waste each other's; requests meanwhile wait for its tokens.
   */
  private readonly asking = new Map<string, Promise<void>>();

  /** `most`: BURST_TOKEN_LEASE, the most a call asks for. */
  constructor(
    private readonly clock: Clock,
    private readonly most: number,
  ) {}

  /** Tokens a call leases for a burst of `size`: a tenth of it, at most BURST_TOKEN_LEASE (0: the subject leases none). */
  perCall(size: number): number {
    return Math.min(this.most, Math.floor(size / 10));
  }

  /**
   * Tokens a request's call asks for: with units leased too (`units`: a leased token is spent
   * with a leased unit), and only while none are held here or being asked for (a grant replaces them).
   */
  want(subject: QuotaSubject, cost: number, units: boolean): number {
    const burst = subject.short?.burst;
    if (!burst || cost !== 1 || !units || !this.mayAsk(subject.name)) return 0;
    return this.perCall(burst.size);
  }

  /** The call asking for the subject's tokens, when a request waiting for it could then be decided here (`slot`: one lingers, for concurrency). */
  asked(subject: QuotaSubject, cost: number, slot: boolean): Promise<void> | undefined {
    const short = subject.short;
    if (!short?.burst || cost !== 1 || (short.concurrent && !slot)) return undefined;
    return this.asking.get(subject.name);
  }

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

  /** A call asking for the subject's tokens is sent: the function to call when it is back, whatever came. */
  ask(name: string): () => void {
    let settle!: () => void;
    this.asking.set(
      name,
      new Promise<void>((r) => {
        settle = r;
      }),
    );
    return () => {
      this.asking.delete(name); // before the waiters resume
      settle();
    };
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
