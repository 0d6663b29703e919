import type { FastifyBaseLogger } from 'fastify';

// Failure detection: whether Redis is declared failing, decided for the connection, never per
// request. Declared when a call fails (a killed Redis refuses at once) or has no answer within
// REDIS_TIMEOUT_MS (a frozen one); a heartbeat finds the same while no request is asking.
// A Redis that answers, however slowly within that time, is not failing: requests wait for it.

export interface HealthOptions {
  /** One heartbeat: rejects when Redis fails. */
  beat: () => Promise<void>;
  /** Runs once Redis answers again, before it is trusted: calls `healthy` when done, or rejects. */
  recover: (healthy: () => void) => Promise<void>;
  log: FastifyBaseLogger;
  /** Between heartbeats while Redis answers; 0: none (a store that only reads probes only while Redis fails). */
  heartbeatMs: number;
  /** Between probes while it fails. */
  probeMs: number;
  /** A failure in one line: where, and why. */
  describe: (err: unknown) => string;
}

export class RedisHealth {
  /** Since when Redis has been failing (Date.now()); 0 while it answers. */
  private failingSince = 0;
  private timer: NodeJS.Timeout | undefined;
  private ticking = false;
  private closed = false;
  private lastReason: string | undefined;

  constructor(private readonly o: HealthOptions) {}

  get failing(): boolean {
    return this.failingSince !== 0;
  }

  /** While failing: why, as the last failed call or probe said it. */
  get reason(): string | undefined {
    return this.failing ? this.lastReason : undefined;
  }

  /** Starts the heartbeat now (on connecting), then every heartbeatMs. */
  start(): void {
    this.schedule(0);
  }

  /** Redis failed a call or left it unanswered: declared once, then probed until it answers. */
  failed(err: unknown): void {
    if (this.closed) return;
    this.lastReason = this.o.describe(err);
    if (this.failingSince !== 0) return;
    this.failingSince = Date.now();
    const reason = this.lastReason;
    this.o.log.warn({ reason }, 'quota store: Redis failed; each instance decides from its share of what was left until Redis answers');
    this.schedule(this.o.probeMs);
  }

  close(): void {
    this.closed = true;
    clearTimeout(this.timer);
  }

  private schedule(ms: number): void {
    if (this.closed) return;
    clearTimeout(this.timer);
    this.timer = setTimeout(() => void this.tick(), ms);
    this.timer.unref(); // never what keeps a stopping process alive
  }

  private async tick(): Promise<void> {
    if (this.ticking) return; // the one in flight schedules the next
    this.ticking = true;
    try {
      await this.o.beat();
      if (this.failing) await this.o.recover(() => this.healthy());
    } catch (err) {
      this.failed(err);
    } finally {
      this.ticking = false;
    }
    if (this.failing) this.schedule(this.o.probeMs);
    else if (this.o.heartbeatMs > 0) this.schedule(this.o.heartbeatMs);
  }

  private healthy(): void {
    if (this.failingSince === 0) return;
    this.failingSince = 0;
    this.o.log.info('quota store: Redis answers again');
  }
}
