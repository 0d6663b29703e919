import type { FastifyBaseLogger } from 'fastify';
import { LATE, type RedisClient, redisProblem, within } from '../../redis/client.js';
import type { Clock, RedisClock } from './clock.js';
import type { DegradedBudget, WriteBack } from './degraded-budget.js';
import { RedisHealth } from './health.js';
import { heartbeatArgs, writeBackArgs } from './script.js';

/** Between heartbeats while Redis answers; a heartbeat counts for three of them. */
const HEARTBEAT_MS = 1000;
/** Between probes while Redis fails: decisions come back to Redis within this of it answering. */
const PROBE_MS = 250;

type FleetRedis = RedisClient & {
  writeback(...keysThenArgs: Array<number | string>): Promise<number>;
  heartbeat(...keysThenArgs: Array<number | string>): Promise<[live: number, rank: number, nowMs: number]>;
};

export interface FleetOptions {
  /** With the scripts defined (script.ts defineScripts). */
  redis: RedisClient;
  log: FastifyBaseLogger;
  instanceId: string;
  /** This process's clock, and Redis's as learned from each heartbeat. */
  clock: Clock;
  redisClock: RedisClock;
  budget: DegradedBudget;
  timeoutMs: number;
  /**
   * The registry key of this deployment's live instances: given, this instance counts in the
   * degraded budget's division (a gateway's store); left out, it only reads Redis's time.
   */
  registry?: () => string;
  /** Units admitted while Redis failed, written back to it. */
  writtenBack: (units: number) => void;
}

const late = (ms: number) => new Error(`no answer within REDIS_TIMEOUT_MS (${ms} ms)`);

/**
 * This instance among its fleet: whether Redis is failing (health.ts), the heartbeat that
 * says it is alive, how many are and what time Redis keeps, and, before Redis is trusted
 * again, the write-back of what the degraded budget admitted meanwhile.
 */
export class Fleet {
  private readonly redis: FleetRedis;
  private readonly health: RedisHealth;

  constructor(private readonly o: FleetOptions) {
    this.redis = o.redis as FleetRedis;
    this.health = new RedisHealth({
      beat: () => this.beat(),
      recover: (healthy) => this.writeBack(healthy),
      log: o.log,
      heartbeatMs: o.registry ? HEARTBEAT_MS : 0,
      probeMs: PROBE_MS,
      describe: (err) => redisProblem(o.redis, err),
    });
    if (o.registry) {
      // A heartbeat on every (re)connection: the clock offset and the fleet before the first decision.
      o.redis.on('ready', () => this.health.start());
      if (o.redis.status === 'ready') this.health.start();
    }
  }

  get failing(): boolean {
    return this.health.failing;
  }

  /** While failing: the last failure, in one line. */
  get reason(): string | undefined {
    return this.health.reason;
  }

  /** A call failed or went unanswered: Redis is declared failing (once) and probed. */
  failed(err: unknown): void {
    this.health.failed(err);
  }

  /** A heartbeat: this instance is alive (if it decides), how many are, and Redis's time. */
  private async beat(): Promise<void> {
    const { registry, clock, redisClock, timeoutMs } = this.o;
    const sentAt = clock.wall();
    const call = registry ? this.redis.heartbeat(...heartbeatArgs(registry(), this.o.instanceId, 3 * HEARTBEAT_MS)) : this.redis.time();
    const reply = await within(call as Promise<unknown>, timeoutMs);
    if (reply === LATE) throw late(timeoutMs);
    if (registry) {
      const [live, rank, nowMs] = reply as [number, number, number];
      redisClock.learn(nowMs, sentAt);
      // Learned only while Redis answers: while it fails, the fleet stays as it was before.
      if (!this.health.failing) this.o.budget.setFleet(live, rank);
    } else {
      const [s, us] = reply as [string, string];
      redisClock.learn(Number(s) * 1000 + Math.floor(Number(us) / 1000), sentAt);
    }
  }

  /**
   * Before Redis is trusted again: what this instance admitted on its own is added to Redis's
   * windows (each batch once, by its id), then `healthy` is called in the same tick as the
   * last, empty, drain, so no admission falls between.
   */
  private async writeBack(healthy: () => void): Promise<void> {
    for (;;) {
      const batch = this.o.budget.drain();
      if (batch.length === 0) return healthy();
      await Promise.all(batch.map((w) => this.writeOne(w)));
    }
  }

  private async writeOne(w: WriteBack): Promise<void> {
    const applied = await within(this.redis.writeback(...writeBackArgs(w)), this.o.timeoutMs);
    if (applied === LATE) throw late(this.o.timeoutMs);
    this.o.budget.confirmed(w);
    if (applied === 1) this.o.writtenBack(Math.max(...Object.values(w.units)));
  }

  /** Stops the heartbeat and the probes. */
  stop(): void {
    this.health.close();
  }

  /** Leaves the registry (after stop), so the others' shares grow at once. */
  async leave(): Promise<void> {
    const { registry } = this.o;
    if (registry && !this.health.failing && this.redis.status === 'ready') {
      const call = this.redis.heartbeat(...heartbeatArgs(registry(), this.o.instanceId, 0));
      await within(call, this.o.timeoutMs).catch(() => {});
    }
  }
}
