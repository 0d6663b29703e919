// Redis's time as this instance sees it: learned from the time each reply carries, and used
// where no reply is at hand (a ban remembered, a lease handed out) and for the moment a call
// is given up, which quota.lua compares with its own TIME.

/** Wall-clock and monotonic time, injected so tests can drive them. */
export interface Clock {
  /** Milliseconds since the epoch (Date.now). */
  wall(): number;
  /** A monotonic millisecond count (performance.now): leases and timeouts. */
  mono(): number;
}

export const SYSTEM_CLOCK: Clock = { wall: Date.now, mono: () => performance.now() };

/** How long a lower bound of the offset stays trusted before a newer sample may replace it. */
const BOUND_TTL_MS = 10_000;

export class RedisClock {
  /** Redis time minus local time, from the latest reply. */
  private offsetMs = 0;
  /**
   * The largest lower bound of the offset seen lately. A reply's time was read by Redis
   * between the call's sending and its reply's arrival, so `redis - arrived` can only
   * understate the offset; the largest such value is the truest bound from below. Deadlines
   * use it, so a deadline never falls after the moment this instance really gave up.
   */
  private lowerBound = Number.NEGATIVE_INFINITY;
  private lowerBoundAt = 0;

  constructor(private readonly clock: Clock) {}

  /** A reply's Redis time (ms), with the local time its call was sent and its reply arrived. */
  learn(redisMs: number, sentAt: number, arrivedAt = this.clock.wall()): void {
    this.offsetMs = redisMs - sentAt;
    const bound = redisMs - arrivedAt;
    const mono = this.clock.mono();
    if (bound >= this.lowerBound || mono - this.lowerBoundAt > BOUND_TTL_MS) {
      this.lowerBound = bound;
      this.lowerBoundAt = mono;
    }
  }

  /** Redis's time now, as well as this instance knows it. */
  now(): number {
    return this.clock.wall() + this.offsetMs;
  }

  /**
   * The Redis time after which a call sent at `sentAt` (local) and given up `budgetMs` later
   * must change nothing; 0 (no deadline) until a reply has taught the offset.
   */
  deadline(sentAt: number, budgetMs: number): number {
    return Number.isFinite(this.lowerBound) ? Math.floor(sentAt + this.lowerBound + budgetMs) : 0;
  }
}
