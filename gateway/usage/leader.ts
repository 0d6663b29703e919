import { randomUUID } from 'node:crypto';
import type { FastifyBaseLogger } from 'fastify';
import type { GatewayConfig } from '../config/config.js';
import type { RedisClient } from '../process/redis-client.js';

/** Takes the lead, or keeps it: one instance per deployment at a time (the lock expires if its holder dies). */
const LEAD = `if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) and 1 or 0`;
const LEASE_MS = 5000;

type LeaderRedis = RedisClient & { lead(lock: string, me: string, ms: number): Promise<number> };

/**
 * A background loop that one instance of a deployment runs at a time, holding a lock in Redis
 * (`<prefix>:<environment>:{<name>}:lock`, renewed every round, lapsing 5 s after its holder
 * dies): the usage exporter and the alert dispatcher. A round returns how much it sent: the next
 * comes at once after a full one, a quarter second after some, a second after none; a failed
 * round is tried again with exponential backoff and full jitter.
 */
export abstract class LeaderLoop<Target> {
  protected readonly redis: LeaderRedis;
  protected stopped = false;
  private readonly me = randomUUID();
  private timer?: NodeJS.Timeout;
  private failures = 0;
  private leading = false;

  constructor(
    redis: RedisClient,
    protected readonly config: () => GatewayConfig,
    protected readonly log: FastifyBaseLogger,
    private readonly name: string,
  ) {
    redis.defineCommand('lead', { numberOfKeys: 1, lua: LEAD });
    this.redis = redis as LeaderRedis;
  }

  /** What the config asks this loop to serve; undefined: nothing to do. */
  protected abstract target(config: GatewayConfig): Target | undefined;
  /** One round; returns what it sent, and whether that filled a batch. */
  protected abstract round(config: GatewayConfig, target: Target): Promise<{ sent: number; full: boolean }>;
  /** A failed round, told once per failure. */
  protected abstract failed(target: Target, err: Error, retryInMs: number): void;
  /** A round that succeeded after failures. */
  protected recovered?(target: Target): void;

  start(): void {
    this.schedule(0);
  }

  /** Stops at once: a round in flight moves no cursor (as if the process had died), so the next leader sends it again. */
  stop(): void {
    this.stopped = true;
    if (this.timer) clearTimeout(this.timer);
  }

  private schedule(ms: number): void {
    if (this.stopped) return;
    this.timer = setTimeout(() => void this.tick(), ms);
    this.timer.unref();
  }

  private async tick(): Promise<void> {
    const config = this.config();
    const target = this.target(config);
    if (!target) return this.schedule(1000);
    try {
      if (!(await this.lead(config))) return this.schedule(1000);
      const { sent, full } = await this.round(config, target);
      if (this.failures > 0) this.recovered?.(target);
      this.failures = 0;
      this.schedule(full ? 0 : sent > 0 ? 250 : 1000);
    } catch (err) {
      this.failures++;
      const wait = backoffMs(this.failures);
      this.failed(target, err as Error, wait);
      this.schedule(wait);
    }
  }

  private async lead(config: GatewayConfig): Promise<boolean> {
    const lock = `${config.registryKey.replace(/\{gateways\}$/, `{${this.name}}`)}:lock`;
    const leading = (await this.redis.lead(lock, this.me, LEASE_MS)) === 1;
    if (leading && !this.leading) this.log.info({ pid: process.pid }, `${this.name}: this instance leads`);
    this.leading = leading;
    return leading;
  }
}

/** Exponential backoff with full jitter: up to 0.5 s, 1 s, 2 s ... 30 s. */
export function backoffMs(failures: number): number {
  return Math.random() * Math.min(30_000, 500 * 2 ** Math.max(0, failures - 1));
}
