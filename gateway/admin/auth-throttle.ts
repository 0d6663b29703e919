import { LRUCache } from 'lru-cache';

// Failed admin authentications, per client address: past FAILURES_PER_MINUTE in a minute the
// address is refused (429) until that minute is over, whatever token it sends, so a guess is
// never checked while it lasts. 2,000 wrong tokens went by in 1.96 s without it.

export const FAILURES_PER_MINUTE = 10;
const WINDOW_MS = 60_000;
/** Addresses remembered, least recently failed out: a few hundred KB at most. */
export const ADDRESSES_MAX = 10_000;

interface Failures {
  count: number;
  /** When this address's minute of failures ends (ms). */
  resetAt: number;
}

export class AuthThrottle {
  private readonly failures = new LRUCache<string, Failures>({ max: ADDRESSES_MAX });

  constructor(private readonly now: () => number = Date.now) {}

  /** Seconds until `address` may try again; 0 when it may now. */
  retryAfter(address: string): number {
    const f = this.failures.get(address);
    if (!f) return 0;
    const left = f.resetAt - this.now();
    if (left <= 0) {
      this.failures.delete(address);
      return 0;
    }
    return f.count >= FAILURES_PER_MINUTE ? Math.ceil(left / 1000) : 0;
  }

  /** Counts a failed attempt; true when it is the one that reaches the limit. */
  failed(address: string): boolean {
    const now = this.now();
    let f = this.failures.get(address);
    if (!f || f.resetAt <= now) f = { count: 0, resetAt: now + WINDOW_MS };
    f.count++;
    this.failures.set(address, f);
    return f.count === FAILURES_PER_MINUTE;
  }

  get addresses(): number {
    return this.failures.size;
  }
}
